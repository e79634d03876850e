"""`--reasoning-budget N` (llama.cpp's name and meaning) of `deltarun generate`, `chat` and `serve`.

On the tiny Qwen3.5 model, whose chat prompt opens the think block (`<think>\\n`) and whose random
weights never close it: with a budget of N the answer is the unconstrained greedy answer's first N
tokens (more only to finish a UTF-8 character), counted here from the tokens, then the template's
end-of-thinking marker; -1 leaves the answer as it is; bad values end in one line and a non-zero
exit. The budget itself (`runner.reasoning.ThinkingBudget`) has its tests in test_thinking_budget.
"""

from __future__ import annotations

import httpx
import pytest
from click.testing import CliRunner
from test_serve import _server
from test_thinking_budget import _thinking_length

from deltarun.apps.chat import ChatSession
from deltarun.base.chat_template import ChatTemplate
from deltarun.cli.main import cli
from deltarun.runner.generation import generate_tokens
from deltarun.runner.model import Model
from deltarun.runner.sampling import GREEDY, Sampler

PROMPT = "<|im_start|>user\nThink about it<|im_end|>\n<|im_start|>assistant\n<think>\n"
MESSAGE = "Think about it"
N = 24
MARKER = "\n</think>\n\n"                  # the Qwen3.5 template's, between reasoning and content


@pytest.fixture(scope="module")
def qwen35(tiny_model_path):
    """(path, the free greedy tokens after PROMPT, after the chat prompt of MESSAGE, the tokenizer)."""
    path = tiny_model_path("tiny-qwen35", "f32")
    with Model(path, n_ctx=512, n_seq_max=1) as m:
        assert ChatTemplate.from_model(m).reasoning_separator() == MARKER
        free = list(generate_tokens(m, m.tokenizer.encode(PROMPT), N, Sampler(GREEDY)))
        m.reset()
        chat_prompt = ChatSession(m).prompt_tokens([{"role": "user", "content": MESSAGE}])
        free_chat = list(generate_tokens(m, chat_prompt, N, Sampler(GREEDY)))
        yield path, free, free_chat, m.tokenizer


def _text(tok, tokens: list[int]) -> str:
    return b"".join(tok.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")


def _run(*args: object, stdin: str | None = None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=stdin)


def _thinking(tok, free: list[int], n: int) -> int:
    """Tokens a budget of n lets the free answer think (n, or more to finish a character)."""
    k = _thinking_length(tok, free, n) if n else 0
    assert "</think>" not in _text(tok, free[:k + 4]), "the model closed its block itself: nothing to count"
    return k


@pytest.mark.parametrize("n", [0, 1, 5])
def test_generate_thinks_n_tokens_then_the_marker(qwen35, n):
    path, free, _, tok = qwen35
    r = _run("generate", path, "-p", PROMPT, "-n", 16, "--temp", 0, "--reasoning-budget", n)
    assert r.exit_code == 0, r.output
    k = _thinking(tok, free, n)
    assert r.stdout.startswith(_text(tok, free[:k]) + MARKER), (r.stdout, _text(tok, free[:k]))
    assert f"thinking: {k} tokens (--reasoning-budget {n})" in r.stderr


def test_generate_without_a_budget_is_the_free_answer(qwen35):
    path, free, _, tok = qwen35
    for extra in ([], ["--reasoning-budget", "-1"]):
        r = _run("generate", path, "-p", PROMPT, "-n", N, "--temp", 0, *extra)
        assert r.exit_code == 0, r.output
        assert r.stdout.rstrip("\n") == _text(tok, free).rstrip("\n") and "thinking:" not in r.stderr


def test_chat_thinks_n_tokens_per_answer(qwen35):
    """chat --single: the free answer's first n tokens, then the marker; piped messages: every
    answer gets a fresh budget (one marker each)."""
    path, _, free, tok = qwen35
    n = 3
    r = _run("chat", path, "--single", "-n", 12, "--temp", 0, "--reasoning-budget", n, stdin=MESSAGE)
    assert r.exit_code == 0, r.output
    k = _thinking(tok, free, n)
    assert r.stdout.startswith(_text(tok, free[:k]) + MARKER.rstrip("\n")), (r.stdout, _text(tok, free[:k]))
    r = _run("chat", path, "-n", 12, "--temp", 0, "--reasoning-budget", n, stdin=f"{MESSAGE}\nAnd again\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.count("</think>") == 2
    plain = _run("chat", path, "--single", "-n", 12, "--temp", 0, stdin=MESSAGE)
    assert "</think>" not in plain.stdout and plain.stdout.startswith(_text(tok, free[:k]))


def test_serve_budget_is_the_default_of_requests(qwen35):
    """serve --reasoning-budget: a request that names no budget (or -1) gets the server's; one that
    names its own keeps it."""
    path, _, free, tok = qwen35
    body = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    with _server(path, parallel=1, reasoning_budget=3) as h:
        def reasoning(**extra) -> str:
            r = httpx.post(h.base_url + "/v1/chat/completions", json={**body, **extra}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["reasoning_content"]
        want = (_text(tok, free[:_thinking(tok, free, 3)]) + "\n").lstrip("\n")
        assert reasoning() == reasoning(reasoning_budget_tokens=-1) == want
        assert reasoning(reasoning_budget_tokens=5) == (_text(tok, free[:_thinking(tok, free, 5)]) + "\n").lstrip("\n")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("value", ["-5", "text", "1.5"])
def test_bad_budgets_end_in_one_line(tmp_path, command, value):
    """The option is checked before anything runs (a missing model file would fail later, with
    another message; serve would otherwise start)."""
    path = tmp_path / "missing.gguf"
    r = _run(command, path, "-p", PROMPT, "--reasoning-budget", value) if command == "generate" else \
        _run(command, path, "--reasoning-budget", value, stdin=MESSAGE)
    assert r.exit_code != 0 and "Traceback" not in r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--reasoning-budget" in lines[0], r.stderr
