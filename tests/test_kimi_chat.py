"""Chatting with a Kimi-Linear file over HTTP: the kimi-k2 vocabulary's end-of-turn tokens end an
answer. (Kimi's tool-call format is parsed in tests/test_serve_parts.py.)"""

from __future__ import annotations

import httpx

from deltarun.apps.serve.server import ServeHandle, ServeSettings
from deltarun.runner.model import Model


def test_serve_chat_ends_at_kimis_end_of_turn(tiny_model_path):
    """A chat over HTTP with the kimi-k2 vocabulary: an answer's content comes back, and
    generation stops at Kimi's end-of-turn token `<|im_end|>` (and at `[EOT]`), which is not
    written into the content (llama.cpp's kimi-k2 end-of-generation ids)."""
    path = tiny_model_path("tiny-kimi-linear-k2vocab", "f32")
    with ServeHandle(lambda: Model(path, n_ctx=256, n_seq_max=1, n_ubatch=32, n_threads=1),
                     ServeSettings(parallel=1, prefill_ahead=False)) as h:
        def ask(**kw):
            r = httpx.post(h.base_url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0, **kw})
            assert r.status_code == 200, r.text
            return r.json()

        r = ask()
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 5
        assert isinstance(r["choices"][0]["message"]["content"], str) and r["choices"][0]["message"]["content"]
        for end in ("<|im_end|>", "[EOT]"):
            ids = httpx.post(h.base_url + "/tokenize", json={"content": end}).json()["tokens"]
            assert len(ids) == 1 and ids[0] >= 2304          # one of the 256 special ids after the ranks
            r = ask(logit_bias={str(ids[0]): 100})           # the end-of-turn token first: an empty answer
            assert r["choices"][0]["finish_reason"] == "stop", (end, r)
            assert r["usage"]["completion_tokens"] == 0 and r["choices"][0]["message"]["content"] == ""
