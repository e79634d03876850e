"""Prometheus metrics of the server (`GET /metrics`), in a registry of its own per server.

Names follow llama-server's (`llamacpp:prompt_tokens_total` ... become `deltarun_...`), plus the
prompt-cache counters a hybrid model makes interesting: tokens reused from the cache and tokens
actually evaluated.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("deltarun_prompt_tokens", "Prompt tokens of finished and running requests", registry=r)
        self.cached_tokens = Counter("deltarun_prompt_tokens_cached", "Prompt tokens reused from the prompt cache",
                                     registry=r)
        self.evaluated_tokens = Counter("deltarun_prompt_tokens_evaluated", "Prompt tokens evaluated (not cached)",
                                        registry=r)
        self.ahead_tokens = Counter("deltarun_prompt_tokens_ahead",
                                    "Prompt tokens evaluated ahead of their request, while idle (the likely "
                                    "start of a conversation's next prompt)", registry=r)
        self.ridden_tokens = Counter("deltarun_prompt_tokens_ridden",
                                     "Prompt tokens evaluated in the graph of a decode step (their rows share "
                                     "its reads of the weights)", registry=r)
        self.generated_tokens = Counter("deltarun_tokens_predicted", "Generated tokens", registry=r)
        self.requests = Counter("deltarun_requests", "Requests admitted to the model", registry=r)
        self.running = Gauge("deltarun_requests_processing", "Requests holding a sequence slot", registry=r)
        self.queued = Gauge("deltarun_requests_deferred", "Requests waiting for a slot", registry=r)
        self.prompt_tps = Gauge("deltarun_prompt_tokens_seconds", "Prompt evaluation throughput, tokens/s", registry=r)
        self.predicted_tps = Gauge("deltarun_predicted_tokens_seconds",
                                   "Generation throughput over all running sequences, tokens/s", registry=r)
        self.drafted_tokens = Counter("deltarun_draft_tokens", "Drafted tokens verified by the model (--draft)",
                                      registry=r)
        self.accepted_tokens = Counter("deltarun_draft_tokens_accepted", "Drafted tokens the model agreed with",
                                       registry=r)
        self.cache_bytes = Gauge("deltarun_prompt_cache_bytes", "Host RAM held by the prompt cache", registry=r)
        self._lock = threading.Lock()
        self._prompt = [0, 0.0]     # tokens, seconds
        self._decode = [0, 0.0]

    def prompt_done(self, n_prompt: int, n_cached: int) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(n_prompt)
        self.cached_tokens.inc(n_cached)

    def prefill_step(self, n_tokens: int, seconds: float, ahead: bool = False, ridden: bool = False) -> None:
        """A prompt chunk evaluated in `seconds` (`ridden`: along a decode step, the time it added)."""
        (self.ahead_tokens if ahead else self.evaluated_tokens).inc(n_tokens)
        if ridden:
            self.ridden_tokens.inc(n_tokens)
        with self._lock:
            self._prompt[0] += n_tokens
            self._prompt[1] += seconds
            self.prompt_tps.set(self._prompt[0] / self._prompt[1] if self._prompt[1] > 0 else 0.0)

    def decode_step(self, n_tokens: int, seconds: float) -> None:
        self.generated_tokens.inc(n_tokens)
        with self._lock:
            self._decode[0] += n_tokens
            self._decode[1] += seconds
            self.predicted_tps.set(self._decode[0] / self._decode[1] if self._decode[1] > 0 else 0.0)

    def drafts(self, n_drafted: int, n_accepted: int) -> None:
        self.drafted_tokens.inc(n_drafted)
        self.accepted_tokens.inc(n_accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
