"""Speculative decoding under a JSON schema: one `response_format` request, without drafts and with
each draft source, on the same model (an in-process `deltarun serve`, one sequence).

    python bench/json_drafts.py model.gguf --rounds 2 --tokens 128
    python bench/json_drafts.py model.gguf --drafts none,mtp --no-schema    # the same request, free


Why: the request's grammar masks each verification row as it stands after the drafts before it
(`sampling.accept_draft` walks a fork of the processors), so a constrained answer drafts as a free
one does; this measures what that gains where the drafts are right (n-grams over a repetitive
answer) and what it costs where they are not. Each source runs in a server of its own; the rounds
alternate them. `--no-schema` sends the request without `response_format` (on a file whose drafts are
wrong: what a paused draft source costs over plain decoding). Prints tokens/s (the server's `timings.predicted_per_second`), drafted and
accepted tokens, and the answer's start (the same for every source: greedy).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import openai

from deltarun.apps.serve.server import ServeHandle, ServeSettings
from deltarun.runner.model import Model

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}
DEPTH = {"mtp": 3, "ngram": 8}


def server(path: Path, draft: str | None, threads: int) -> ServeHandle:
    def model() -> Model:
        return Model(path, n_ctx=1024, n_seq_max=1, rs_slots=max(DEPTH.values()) + 1, n_threads=threads,
                     mtp=draft == "mtp")

    return ServeHandle(model, ServeSettings(parallel=1, draft=draft, draft_max=DEPTH.get(draft or ""),
                                            prefill_ahead=False))


def one(h: ServeHandle, tokens: int, schema: bool = True) -> openai.types.chat.ChatCompletion:
    c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=600)
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}} if schema else {}
    return c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Write the word hello many times"}], max_tokens=tokens,
        temperature=0, extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}, **fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafts", default="none,ngram,mtp", help="sources to compare, in order (none: no drafts)")
    ap.add_argument("--no-schema", action="store_true", help="the request without response_format")
    a = ap.parse_args()
    for r in range(a.rounds):
        for name in a.drafts.split(","):
            draft = None if name == "none" else name
            with server(a.model, draft, a.threads) as h:
                one(h, 8, not a.no_schema)                 # warm-up: graphs and the grammar compiled
                out = one(h, a.tokens, not a.no_schema)
            t = out.model_extra["timings"]
            print(f"round {r} {name}: {t['predicted_per_second']:.1f} t/s, {t['predicted_n']} tokens, drafted "
                  f"{t.get('draft_n', 0)}, accepted {t.get('draft_n_accepted', 0)}: "
                  f"{(out.choices[0].message.content or '')[:40]!r}", flush=True)


if __name__ == "__main__":
    main()
