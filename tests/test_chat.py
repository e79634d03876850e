"""`deltarun chat` and ChatSession: template rendering, incremental prefill, rollback/recompute,
stop strings, save/load, Ctrl-C and a full context, with the tiny f32 model.

Answers of the tiny model are random-looking text; where a test needs an answer with known
tokens it scripts the sampler (`Scripted`), so prefill counts do not depend on whether the random
answer happens to re-tokenize to the same ids.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import click
import jinja2
import jinja2.ext
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deltarun.apps.chat import ChatSession, StopMatcher, ThinkingSplitter, common_prefix_length, common_text_prefix
from deltarun.base.chat_template import ChatTemplate, qwen3_template_source
from deltarun.base.errors import ContextFullError, TokenizerError
from deltarun.cli.main import cli
from deltarun.runner.model import Model
from deltarun.runner.sampling import GREEDY, Sampler

from shipped_data import QWEN3_TEMPLATE, QWEN35_TEMPLATE

FAST = ["--ctx", "256", "--threads", "1", "--kv-type", "f32", "--temp", "0"]


@pytest.fixture(scope="module")
def model_path(tiny_model_path) -> Path:
    return tiny_model_path("tiny", "f32")


@pytest.fixture(scope="module")
def shared_model(model_path):
    with Model(model_path, n_ctx=256, n_threads=1, kv_type="f32") as m:
        yield m


@pytest.fixture
def model(shared_model):
    shared_model.reset()
    return shared_model


class Scripted(Sampler):
    """Returns the given token ids in order, then falls back to greedy."""

    def __init__(self, tokens: list[int]):
        super().__init__(GREEDY)
        self.script = list(tokens)

    def sample(self, logits, history=None, processors=None):
        return self.script.pop(0) if self.script else super().sample(logits, history, processors)


def script(model: Model, text: str, end: bool = True) -> list[int]:
    toks = model.tokenizer.encode(text)
    return toks + ([model.tokenizer.token_id("<|im_end|>")] if end else [])


def invoke(*args, input: str | None = None, color: bool = False):
    result = CliRunner().invoke(cli, [str(a) for a in args], input=input, color=color)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def hf_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in, written out independently."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n2+2 is 4."},
    {"role": "user", "content": "And 3+3? Answer «briefly»."},
    {"role": "assistant", "content": "6."},
    {"role": "user", "content": "Thanks!"},
]


# --- template ------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab\u00e9\U0001f600", max_size=40), st.text(alphabet="ab\u00e9\U0001f600", max_size=40),
       st.text(alphabet="ab", max_size=40))
def test_common_text_prefix_is_the_longest_shared_start(shared, a, b):
    """Against the definition (os.path.commonprefix, which the serve and chat boundaries used)."""
    x, y = shared + a, shared + b
    assert common_text_prefix(x, y) == len(os.path.commonprefix([x, y])) == common_text_prefix(y, x)


def test_template_renders_like_plain_jinja2(model):
    source = model.file.get("tokenizer.chat_template")
    assert source == QWEN3_TEMPLATE.read_text(encoding="utf-8")
    assert source == qwen3_template_source()
    tmpl = ChatTemplate.from_model(model)
    assert not tmpl.is_builtin
    reference = hf_environment().from_string(source)
    for thinking in (False, True, None):
        for gen in (True, False):
            extra = {} if thinking is None else {"enable_thinking": thinking}
            want = reference.render(messages=CONVERSATION, add_generation_prompt=gen, bos_token="<|endoftext|>",
                                    eos_token="<|endoftext|>", **extra)
            assert tmpl.render(CONVERSATION, add_generation_prompt=gen, enable_thinking=thinking) == want
    text = tmpl.render(CONVERSATION, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert "Simple sum" not in text                    # earlier turns' thinking is dropped
    assert "<|im_start|>assistant\n2+2 is 4.<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    session = ChatSession(model, tmpl, enable_thinking=False)
    session.messages = copy.deepcopy(CONVERSATION)
    assert session.render() == text


def test_template_environment_details():
    t = ChatTemplate("{{ messages[0].content | tojson }}|{{ {'a': [1, 2]} | tojson(indent=2) }}|"
                     "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
                     "{{ bos_token }}{{ strftime_now('%Y') | length }}")
    out = t.render([{"role": "user", "content": "é<b>"}, {"role": "assistant", "content": "x"}])
    assert out == '"é<b>"|{\n  "a": [\n    1,\n    2\n  ]\n}|user|4'
    with pytest.raises(TokenizerError, match="does not parse: line 1"):
        ChatTemplate("{% if messages %}unclosed")
    with pytest.raises(TokenizerError, match="no tools here"):
        ChatTemplate("{{ raise_exception('no tools here') }}").render([])
    with pytest.raises(TokenizerError):  # the sandbox is immutable
        ChatTemplate("{{ messages.append(1) }}").render([])
    fake = SimpleNamespace(file=SimpleNamespace(get=lambda key, default=None: None), path=Path("x.gguf"),
                           tokenizer=SimpleNamespace(bos_id=None, eos_id=None))
    builtin = ChatTemplate.from_model(fake)
    assert builtin.is_builtin and builtin.source == qwen3_template_source()


# --- session: incremental prefill, rollback, recompute -----------------------------------------------
def test_second_turn_evaluates_only_the_new_tokens(model):
    session = ChatSession(model, sampler=Scripted(script(model, "Hi there, friend!")), system="Be nice.")
    assert session.ask("Hello") == "Hi there, friend!"
    first_prompt = session.last_prefill_tokens
    assert session.last_reused_tokens == 0 and first_prompt == len(session.tokenize(
        "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"))
    held = model.tokens()
    evaluated_before = model.stats.n_eval_tokens

    session.sampler = Scripted(script(model, "Fine."))
    assert session.ask("How are you?") == "Fine."
    new_text = "<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
    assert session.last_reused_tokens == len(held)
    assert session.last_prefill_tokens == len(session.tokenize(new_text))
    assert not session.last_recomputed and session.last_turn.rolled_back == 0
    # the model evaluated the new prompt tokens and the answer's tokens, nothing else
    assert model.stats.n_eval_tokens - evaluated_before == session.last_prefill_tokens + len(script(model, "Fine.")) - 1
    assert session.messages[-1] == {"role": "assistant", "content": "Fine."}
    following = session.prompt_tokens(session.messages + [{"role": "user", "content": "next"}])
    assert following[:model.n_past()] == model.tokens()          # the next turn will reuse all of it


HEADER = "<|im_start|>assistant\n"


def header_tokens(session: ChatSession, prompt_text: str) -> int:
    """Tokens of a prompt up to and including its last assistant header."""
    return len(session.tokenize(prompt_text[:prompt_text.rindex(HEADER) + len(HEADER)]))


def test_real_answers_keep_the_model_in_step(model):
    """With the model's own answers: every turn evaluates exactly what it does not hold."""
    session = ChatSession(model, n_predict=6)
    previous_header = 0
    for text in ("Hello", "Tell me more", "Thanks"):
        held = model.tokens()
        evaluated = model.stats.n_eval_tokens
        session.ask(text)
        prompt_text = session.render(session.messages[:-1])
        prompt = session.tokenize(prompt_text)
        common = common_prefix_length(held, prompt)
        # the model keeps what it holds when the prompt extends it, else returns to the previous
        # prompt's assistant header (the answer re-tokenized differently)
        reused = common if common == len(held) else previous_header
        assert session.last_reused_tokens == reused
        assert session.last_generated_tokens == 6 and session.last_stop_reason == "length"
        # the prompt's new tokens and the answer but its last token: nothing else
        assert model.stats.n_eval_tokens - evaluated == len(prompt) - reused + 5
        previous_header = header_tokens(session, prompt_text)


QWEN35 = ChatTemplate(QWEN35_TEMPLATE.read_text(encoding="utf-8"), bos_token=None, eos_token="<|im_end|>")


@pytest.mark.parametrize("template", ["qwen3", "qwen3.5"])
@pytest.mark.parametrize("think", [False, True])
def test_each_turn_evaluates_only_the_new_tokens_with_and_without_thinking(model, template, think):
    """The templates re-render an answer differently once it is history: without thinking the
    empty think block of the generation prompt is left out, with thinking the thinking is dropped.
    The checkpoint after the assistant header means each turn evaluates the re-rendered answer and
    the new message, never the whole conversation again."""
    session = ChatSession(model, QWEN35 if template == "qwen3.5" else None, enable_thinking=think)
    opens_think = template == "qwen3.5" and think      # the prompt itself opens the think block
    reply = ("hmm\n</think>\n\n" if opens_think else "<think>\nhmm\n</think>\n\n" if think else "") + "Hi!"
    previous_header = 0
    for text in ("Hello", "Tell me more", "Thanks"):
        answer = script(model, reply)
        session.sampler = Scripted(answer)
        evaluated = model.stats.n_eval_tokens
        session.ask(text)
        prompt_text = session.render(session.messages[:-1])
        assert prompt_text.endswith(HEADER + ("<think>\n" if opens_think else "" if think else
                                              "<think>\n\n</think>\n\n"))
        prompt = session.tokenize(prompt_text)
        # the prompt from the previous assistant header on, and the answer (ended by <|im_end|>)
        assert model.stats.n_eval_tokens - evaluated == len(prompt) - previous_header + len(answer) - 1
        assert session.last_prefill_tokens == len(prompt) - previous_header
        previous_header = header_tokens(session, prompt_text)
    # the state the checkpoint led to is the one a fresh session computes
    history = copy.deepcopy(session.messages)
    session.sampler, session.n_predict = Scripted([]), 4
    answer = session.ask("Bye")
    model.reset()
    fresh = ChatSession(model, session.template, Scripted([]), enable_thinking=think, n_predict=4)
    fresh.messages = history
    assert fresh.ask("Bye") == answer


@pytest.mark.parametrize("template", ["qwen3", "qwen3.5"])
@pytest.mark.parametrize("think", [False, True])
def test_prefill_next_turn_leaves_the_turn_only_its_new_message(model, template, think):
    """What the interactive chat does while the user types: the re-rendered answer is evaluated
    ahead, so the next turn evaluates only its new message (from where its text starts) and the
    answers are those of a session that did not prefill ahead. A second call has nothing to do."""
    tmpl = QWEN35 if template == "qwen3.5" else None
    opens_think = template == "qwen3.5" and think
    reply = ("hmm\n</think>\n\n" if opens_think else "<think>\nhmm\n</think>\n\n" if think else "") + "Hi!"
    answers = {}
    for ahead in (False, True):
        model.reset()
        session = ChatSession(model, tmpl, enable_thinking=think, n_predict=5)
        got, held = [], 0
        for k, text in enumerate(("Hello", "Tell me more", "Thanks")):
            session.sampler = Scripted(script(model, reply) if k == 0 else [])
            got.append(session.ask(text))
            if ahead and k:          # this turn started from what the previous one evaluated ahead
                prompt = session.tokenize(session.render(session.messages[:-1]))
                assert session.last_reused_tokens == held
                assert session.last_prefill_tokens == len(prompt) - held
            if ahead:
                before = session.prompt_tokens(session.messages + [{"role": "user", "content": "Next"}])
                n = session.prefill_next_turn()
                start = common_prefix_length(model.tokens(), before)
                assert n > 0 and start == len(model.tokens()) and session.prefill_next_turn() == 0
                # the prefix held is where the next message's text begins: a different message
                # shares exactly that much
                other = session.prompt_tokens(session.messages + [{"role": "user", "content": "Other"}])
                assert common_prefix_length(before, other) == start
                held = start
        answers[ahead] = got
        if ahead:
            assert session.totals.ahead_tokens > 0
    assert answers[True] == answers[False]


def test_readme_example_reuses_the_conversation(model, model_path):
    """`printf 'Hello\\nTell me more\\n' | deltarun chat model.gguf -n 64 --no-think`, then /stats:
    the second turn reuses the first prompt up to its assistant header."""
    r = invoke("chat", model_path, "-n", "64", "--no-think", *FAST, input="Hello\nTell me more\n/stats\n")
    assert "session: 2 turns" in r.stderr and "0 recomputes" in r.stderr, r.stderr
    session = ChatSession(model)
    header = len(session.tokenize("<|im_start|>user\nHello<|im_end|>\n" + HEADER))
    assert f", {header} reused, " in r.stderr, r.stderr


def test_dropped_thinking_restores_the_checkpoint_and_matches_a_fresh_session(model):
    session = ChatSession(model, sampler=Scripted(script(model, "<think>\nhmm\n</think>\n\nHi!")))
    assert session.ask("Hello").endswith("Hi!")
    first_prompt = session._checkpoint.n_past      # the prompt of the first turn
    session.sampler = Sampler(GREEDY)
    session.n_predict = 6
    evaluated = model.stats.n_eval_tokens
    answer = session.ask("Again")
    # the re-rendered history lacks the thinking: the slots cannot reach back, but the checkpoint
    # taken at the end of the first prompt can; only the rest of the prompt is evaluated
    assert session.last_turn.restored and not session.last_recomputed
    assert session.last_reused_tokens == first_prompt
    full = len(session.tokenize(session.render(session.messages[:-1])))
    assert session.last_prefill_tokens == full - first_prompt
    assert model.stats.n_eval_tokens - evaluated == full - first_prompt + 5    # and 5 of the 6 answer tokens
    model.reset()
    fresh = ChatSession(model, n_predict=6)
    fresh.messages = copy.deepcopy(session.messages[:-2])
    assert fresh.ask("Again") == answer


@pytest.mark.parametrize("rs_slots", [1, 2])
def test_stop_string_leftover_is_undone_and_matches_a_fresh_session(model_path, rs_slots):
    with Model(model_path, n_ctx=256, n_threads=1, kv_type="f32", rs_slots=rs_slots) as m:
        tok = m.tokenizer
        answer = tok.encode(" Hi X!")
        assert [tok.decode([t]) for t in answer[-2:]] == [" X", "!"]
        # " X" is evaluated before "!" completes the stop string: the model holds a token that is
        # not in the conversation. It came from a one-token decode ubatch: with a rollback slot
        # (K = 2) it is undone within the slots, with none (K = 1) the next turn returns to the
        # checkpoint taken after the first prompt.
        session = ChatSession(m, sampler=Scripted(answer), stop=["X!"])
        assert session.ask("Hello") == " Hi "
        assert session.last_stop_reason == "stop" and session.messages[-1]["content"] == " Hi "
        assert tok.decode(m.tokens()[-3:]) == " Hi X"
        session.sampler = Sampler(GREEDY)
        session.n_predict = 5
        first_prompt = session._checkpoint.n_past
        held = len(m.tokens())
        after = session.ask("More")
        assert not session.last_recomputed
        if rs_slots > 1:
            assert session.last_turn.rolled_back == 1 and not session.last_turn.restored
            assert session.last_reused_tokens == held - 1
        else:
            assert session.last_turn.restored and session.last_reused_tokens == first_prompt
        m.reset()
        fresh = ChatSession(m, n_predict=5)
        fresh.messages = copy.deepcopy(session.messages[:-2])
        assert fresh.ask("More") == after


def test_cancelled_turn_is_rolled_back_within_the_slots(model_path, monkeypatch):
    """Ctrl-C before the first token leaves the cancelled prompt in the model; the next message
    shares the prefix up to it, and the rest lies in the last prefill ubatch: a rollback undoes it."""
    with Model(model_path, n_ctx=256, n_threads=1, kv_type="f32", rs_slots=13) as m:
        session = ChatSession(m, n_predict=5, system="S")
        session.ask("Hello")
        real_sample = Sampler.sample

        def interrupted(self, logits, history=None, processors=None):
            raise KeyboardInterrupt

        monkeypatch.setattr(Sampler, "sample", interrupted)
        with pytest.raises(KeyboardInterrupt):
            session.ask("Never mind")
        monkeypatch.setattr(Sampler, "sample", real_sample)
        assert [x["role"] for x in session.messages] == ["system", "user", "assistant"]
        held = m.tokens()
        after = session.ask("Something else")
        prompt = session.prompt_tokens(session.messages[:-1])
        kept = common_prefix_length(held, prompt)
        assert not session.last_recomputed and session.last_turn.rolled_back == len(held) - kept > 0
        assert session.last_reused_tokens == kept and session.last_prefill_tokens == len(prompt) - kept
        m.reset()
        fresh = ChatSession(m, n_predict=5)
        fresh.messages = copy.deepcopy(session.messages[:-2])
        assert fresh.ask("Something else") == after


def test_stop_strings(model):
    free = ChatSession(model, n_predict=10).ask("Hello")
    stop = free[4:7]
    assert len(stop) == 3
    model.reset()
    session = ChatSession(model, n_predict=10, stop=["never appears", stop])
    cut = session.ask("Hello")
    assert cut == free[:free.index(stop)]
    assert session.last_stop_reason == "stop" and session.messages[-1]["content"] == cut

    m = StopMatcher(["</s>", "END"])
    shown = [m.push(p) for p in ["abc<", "/", "s", "> more"]]
    assert "".join(shown) == "abc" and m.hit == "</s>" and m.kept == "abc"
    m = StopMatcher(["END"])
    assert m.push("xEN") == "x" and m.push("x") == "ENx" and m.flush() == "" and m.kept == "xENx"


def test_interrupt_keeps_the_partial_answer_and_a_consistent_model(model, monkeypatch):
    session = ChatSession(model, n_predict=8)
    session.ask("Hello")
    calls = {"n": 0}
    real_sample = Sampler.sample

    def flaky(self, logits, history=None, processors=None):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_sample(self, logits, history, processors)

    monkeypatch.setattr(Sampler, "sample", flaky)
    pieces = []
    with pytest.raises(KeyboardInterrupt):
        for piece in session.send("Tell me more"):
            pieces.append(piece)
    monkeypatch.undo()
    assert session.last_stop_reason == "interrupted" and session.last_generated_tokens == 3
    assert session.messages[-2] == {"role": "user", "content": "Tell me more"}
    partial = session.messages[-1]["content"]
    assert session.messages[-1]["role"] == "assistant" and partial.startswith("".join(pieces))
    assert model.n_past() == len(model.tokens())
    history = copy.deepcopy(session.messages)

    answer = session.ask("Next")
    model.reset()
    fresh = ChatSession(model, n_predict=8)
    fresh.messages = history
    assert fresh.ask("Next") == answer


def test_interrupt_while_printing_and_before_the_first_token(model, monkeypatch):
    session = ChatSession(model, n_predict=8)
    stream = session.send("Hello")
    first = next(stream)
    try:
        raise KeyboardInterrupt          # arrives in the caller, between two pieces
    except KeyboardInterrupt:
        stream.close()
    assert session.last_stop_reason == "interrupted"
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.messages[-1]["content"].startswith(first)

    def interrupted_eval(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "eval", interrupted_eval)
    with pytest.raises(KeyboardInterrupt):
        session.ask("Cancelled during the prompt")
    monkeypatch.undo()
    assert [m["role"] for m in session.messages] == ["user", "assistant"]   # the turn did not happen
    assert session.ask("Go on")                                              # and the session still works


def test_context_full_and_context_shift(model_path):
    with Model(model_path, n_ctx=48, n_threads=1, kv_type="f32") as m:
        session = ChatSession(m, n_predict=4, system="S")
        with pytest.raises(ContextFullError, match="context full"):
            session.ask("word " * 60)
        assert [x["role"] for x in session.messages] == ["system"]
        session.n_predict = -1
        session.ask("Hi")
        assert session.last_stop_reason == "context" and m.n_past() == m.n_ctx

        shifting = ChatSession(m, n_predict=6, system="S", context_shift=True)
        m.reset()
        dropped = 0
        for i in range(5):
            shifting.ask(f"Question number {i}")
            dropped += shifting.last_turn.dropped_messages
        assert dropped > 0 and shifting.messages[0] == {"role": "system", "content": "S"}
        assert shifting.messages[-2]["content"] == "Question number 4"
        before = copy.deepcopy(shifting.messages)
        with pytest.raises(ContextFullError):          # too long even alone: the history stays
            shifting.ask("word " * 60)
        assert shifting.messages == before

        m.reset()                                  # an answer that fills the context shifts mid-answer
        mid = ChatSession(m, n_predict=3, system="S", context_shift=True)
        mid.ask("Hi")
        mid.n_predict = 40
        mid.ask("Go")
        turn = mid.last_turn
        assert turn.dropped_messages == 2 and turn.recomputed and turn.stop_reason == "context"
        assert turn.reused_tokens + turn.generated_tokens > m.n_ctx       # it went on past the first fill
        assert [x["role"] for x in mid.messages] == ["system", "user", "assistant"]


def test_save_and_load(model, tmp_path):
    session = ChatSession(model, n_predict=4, system="sys")
    session.ask("Hello")
    path = tmp_path / "chat.json"
    session.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["chat.json"]          # no temporary file left
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["format"] == "deltarun-chat" and data["messages"] == session.messages
    saved = copy.deepcopy(session.messages)
    session.reset()
    assert session.messages == [{"role": "system", "content": "sys"}] and model.n_past() == 0
    session.load(path)
    assert session.messages == saved
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "wrong.json").write_text('[{"role": "robot", "content": "x"}]', encoding="utf-8")
    for name, message in [("missing.json", "no such file"), ("bad.json", "not valid JSON"),
                          ("wrong.json", "role 'robot'")]:
        with pytest.raises(Exception, match=message):
            session.load(tmp_path / name)
    assert session.messages == saved
    with pytest.raises(Exception, match="cannot save"):
        session.save(tmp_path / "no-such-dir" / "x.json")


def test_splitters():
    s = ThinkingSplitter()
    parts = s.push("a<thi") + s.push("nk>deep</th") + s.push("ink>b") + s.flush()
    merged: list[tuple[bool, str]] = []
    for kind, text in parts:
        if merged and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + text)
        else:
            merged.append((kind, text))
    assert merged == [(False, "a"), (True, "<think>deep</think>"), (False, "b")]
    s = ThinkingSplitter(thinking=True)
    assert s.push("x</think>y") == [(True, "x</think>"), (False, "y")]


# --- the command --------------------------------------------------------------------------------------
def expected_answers(path: Path, texts: list[str], n: int, **kw) -> list[str]:
    with Model(path, n_ctx=256, n_threads=1, kv_type="f32") as m:
        session = ChatSession(m, n_predict=n, **kw)
        return [session.ask(t) for t in texts]


def test_cli_two_turns_through_stdin(model_path):
    r = invoke("chat", model_path, "-n", "6", "--system", "Be brief", *FAST, input="Hello\n\nHow are you?\n")
    a, b = expected_answers(model_path, ["Hello", "How are you?"], 6, system="Be brief")
    assert r.stdout == f"{a}\n{b}\n"
    assert "2 turns" in r.stderr
    single = invoke("chat", model_path, "-n", "6", "--single", *FAST, input="line one\nline two\n")
    assert single.stdout == expected_answers(model_path, ["line one\nline two"], 6)[0] + "\n"


def test_cli_commands_save_load(model_path, tmp_path):
    f = tmp_path / "conv.json"
    lines = ["Hello", f"/save {f}", "/reset", "/stats", f"/load {f}", "/load missing.json", "/bogus", "/help",
             "/system Be kind", "/system", "//slash", "/stats", "/exit", "never read"]
    r = invoke("chat", model_path, "-n", "5", *FAST, input="\n".join(lines) + "\n")
    a = expected_answers(model_path, ["Hello"], 5)[0]
    saved = json.loads(f.read_text(encoding="utf-8"))["messages"]
    assert saved == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": a}]
    # after /reset + /load the conversation goes on as if nothing happened
    with Model(model_path, n_ctx=256, n_threads=1, kv_type="f32") as m:
        s = ChatSession(m, n_predict=5)
        s.messages = [{"role": "system", "content": "Be kind"}] + saved
        b = s.ask("/slash")
    assert r.stdout == f"{a}\n{b}\n"
    for fragment in ["[saved 2 messages", "[conversation reset]", "context: 0 / 256", "[loaded 2 messages",
                     "no such file", "unknown command /bogus", "/save FILE", "[system prompt set]",
                     "system prompt: 'Be kind'", "5 messages"]:
        assert fragment in r.stderr, fragment


def test_cli_interrupt_continues_with_the_next_line(model_path, monkeypatch):
    calls = {"n": 0}
    real_sample = Sampler.sample

    def flaky(self, logits, history=None, processors=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_sample(self, logits, history, processors)

    monkeypatch.setattr(Sampler, "sample", flaky)
    r = invoke("chat", model_path, "-n", "5", *FAST, input="Hello\nAgain\n")
    monkeypatch.undo()
    assert "[interrupted]" in r.stderr
    # the first answer stops after the two tokens sampled before Ctrl-C and stays in the
    # conversation; the next line is answered in full, as that conversation goes on
    with Model(model_path, n_ctx=256, n_threads=1, kv_type="f32") as m:
        session = ChatSession(m, n_predict=2)
        partial = session.ask("Hello")
        session.n_predict = 5
        again = session.ask("Again")
    assert partial and r.stdout == f"{partial}\n{again}\n"


def test_cli_stop_thinking_and_context_messages(model_path, monkeypatch):
    a = expected_answers(model_path, ["Hello"], 10)[0]
    r = invoke("chat", model_path, "-n", "10", "--stop", "never", "--stop", a[4:7], *FAST, input="Hello\n")
    assert r.stdout == a[:a.index(a[4:7])] + "\n"

    thinking = "<think>\nhmm\n</think>\n\nHi!"
    state = {}

    def scripted(self, logits, history=None, processors=None):
        if "queue" not in state:
            state["queue"] = list(state["ids"])
        return state["queue"].pop(0)

    with Model(model_path, n_ctx=64, n_threads=1) as m:
        state["ids"] = script(m, thinking)
    monkeypatch.setattr(Sampler, "sample", scripted)
    shown = invoke("chat", model_path, *FAST, input="Hello\n", color=True)
    assert "\x1b[2m" in shown.stdout and click.unstyle(shown.stdout) == thinking + "\n"
    state.pop("queue")
    hidden = invoke("chat", model_path, "--hide-thinking", *FAST, input="Hello\n")
    assert hidden.stdout == "Hi!\n"
    monkeypatch.undo()

    full = invoke("chat", model_path, "-n", "4", "--ctx", "40", "--threads", "1", "--temp", "0",
                  input="word " * 50 + "\nHi\n")
    assert "context full" in full.stderr and "/reset" in full.stderr and "--context-shift" in full.stderr
    cut = invoke("chat", model_path, "--ctx", "40", "--threads", "1", "--temp", "0", input="Hi\n")
    assert "[context full: 40/40 tokens" in cut.stderr


def test_prefill_next_turn_before_the_first_message_evaluates_the_system_prompt(model):
    session = ChatSession(model, system="You are a terse assistant who answers in one line.", n_predict=3,
                          enable_thinking=False)
    n = session.prefill_next_turn()
    held = model.tokens()
    prompt = session.prompt_tokens(session.messages + [{"role": "user", "content": "Hello"}])
    assert n == len(held) > 10 and prompt[:n] == held
    answer = session.ask("Hello")
    assert session.last_reused_tokens == n and session.last_prefill_tokens == len(prompt) - n
    model.reset()
    assert ChatSession(model, system=session.system, n_predict=3, enable_thinking=False).ask("Hello") == answer


def test_repl_prefills_the_next_turn_while_the_user_types(model, monkeypatch, capsys):
    """The interactive loop starts `prefill_next_turn` in a thread before reading each line and
    waits for it before running the line: the second turn reuses what was evaluated ahead, and the
    answers are those of a plain session."""
    from deltarun.cli import chat as chat_cli

    lines = iter(["Hello", "Tell me more", "/stats"])

    def read() -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(chat_cli, "_read_message", read)
    monkeypatch.setattr(chat_cli, "_setup_readline", lambda: (lambda: None))
    session = ChatSession(model, n_predict=5, enable_thinking=False)
    chat_cli._repl(chat_cli.ChatUI(session))
    out = capsys.readouterr()
    assert session.totals.ahead_tokens > 0 and "evaluated while you typed" in out.err
    prompt2 = session.tokenize(session.render(session.messages[:-1]))
    first = session.messages[:2]
    ahead = common_prefix_length(session.tokenize(session.render(first + [{"role": "user", "content": "x"}],
                                                                  add_generation_prompt=False)), prompt2)
    assert session.last_reused_tokens == ahead and session.last_prefill_tokens == len(prompt2) - ahead
    model.reset()
    plain = ChatSession(model, n_predict=5, enable_thinking=False)
    assert [plain.ask("Hello"), plain.ask("Tell me more")] == [m["content"] for m in session.messages[1::2]]
