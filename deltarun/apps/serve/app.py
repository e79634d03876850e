"""The HTTP side: a Starlette app whose handlers validate, build prompts and talk to the worker.

Handlers never touch the model: they turn a body into `GenParams` (in the thread pool), submit a
`Job` and relay the worker's `Event`s, as one JSON response or as server-sent events (`data:
{chunk}` ... `data: [DONE]`). A client that disconnects cancels its job; so does the end of a
stream for any other reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import importlib
import json
import logging
import secrets
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deltarun.apps.serve.guard import HostPolicy, RequestGuard, error_response
from deltarun.apps.serve.metrics import CONTENT_TYPE_LATEST
from deltarun.apps.serve.output import Delta
from deltarun.apps.serve.protocol import (ApiError, ChatRequest, chat_delta, chat_message, check_token_ids, envelope,
                                          parse_chat, parse_completion, parse_infill, parse_llama_server_completion,
                                          timings, usage)
from deltarun.apps.serve.relay import (MAX_CHARS_PER_TOKEN, Mailbox, Relay, check_prompt_size, read_json,
                                       run_cpu)
from deltarun.apps.serve.worker import Event, GenParams, Worker

#: The APIs the server speaks, as /props lists them
API_ENDPOINTS = {"openai": ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models"],
                 "anthropic": ["/v1/messages", "/v1/messages/count_tokens"]}
PUBLIC_PATHS = {"/health", "/v1/health", "/"}   # "/": the static chat page (it sends the key itself)
#: Token ids of one JSON answer encoded in one go (json.dumps holds the GIL: about 0.2 us each)
ENCODE_SLICE = 8192
class ServerState:
    """What the handlers share: the worker, the prompt builder (made once the model is loaded), settings."""

    def __init__(self, worker: Worker, make_builder: Callable[[Any], Any], *, model_name: str,
                 api_key: str | None = None, max_body: int = 8 << 20, n_parallel: int = 1,
                 prefill_ahead: bool = True, policy: HostPolicy | None = None, expose_model_path: bool = False):
        self.worker = worker
        self.policy = policy or HostPolicy()
        self.expose_model_path = expose_model_path     # /props: the model's absolute path, else its file name
        self.prefill_ahead = prefill_ahead
        self._ahead_tasks: set[asyncio.Task] = set()    # next_turn renderings under way
        self._make_builder = make_builder
        self._builder: Any = None
        self.model_name = model_name
        self.api_key = api_key
        self.max_body = max_body
        self.n_parallel = n_parallel
        self.created = int(time.time())
        self._mailbox: Mailbox | None = None

    def mailbox(self) -> "Mailbox":
        """The event carrier of the running loop (made on the first request)."""
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
            self.worker.after_step = self._mailbox.wake
        return self._mailbox

    def prepare(self) -> None:
        """Once the model is loaded: make the prompt builder (compiling the chat template) and
        render one message, and load the module anyio runs `run_in_threadpool` with (anyio imports
        its asyncio backend on first use), so the first request does not pay for them (about 15 +
        20 ms)."""
        try:
            importlib.import_module("anyio._backends._asyncio")
        except ImportError:              # another anyio layout: the first request imports it
            pass
        try:
            self.builder.chat(ChatRequest(messages=[{"role": "user", "content": "hello"}]))
        except Exception:  # noqa: BLE001 - only a warm-up: the first request reports whatever this is
            pass

    @property
    def settled(self) -> bool:
        """No next-turn rendering under way and the worker idle (tests wait for this)."""
        return not self._ahead_tasks and self.worker.idle

    def answered(self, params: GenParams, ev: Event) -> None:
        """A job ended with `ev`: after a chat answer that the client will send back as it is (not a
        tool call), have the worker prefill the conversation's next prompt start while idle
        (`PromptBuilder.next_turn`, `Worker.prefill_ahead`)."""
        if not self.prefill_ahead or not isinstance(params.req, ChatRequest) or params.ahead or params.choice \
                or ev.finish_reason not in ("stop", "length") or ev.result is None:
            return
        task = asyncio.get_running_loop().create_task(self._next_turn(params.req, ev.result["content"]))
        self._ahead_tasks.add(task)
        task.add_done_callback(self._ahead_tasks.discard)

    async def _next_turn(self, req: ChatRequest, content: str) -> None:
        try:
            params = await run_in_threadpool(self.builder.next_turn, req, content)
            if params is not None:
                self.worker.prefill_ahead(params)
        except ApiError:                 # loading, restarting or shutting down: nothing to do ahead
            pass
        except Exception:  # noqa: BLE001 - a prediction must never fail the request it follows
            logging.getLogger("deltarun.serve").exception("rendering the next turn ahead failed")

    @property
    def builder(self) -> Any:
        if self.worker.load_error is not None:
            raise ApiError(f"the model failed to load: {self.worker.load_error}", status=500, type="server_error")
        down = getattr(self.worker, "unavailable", None)    # a supervised model process being restarted
        if down is not None:
            raise down
        if not self.worker.ready.is_set():
            raise ApiError("Loading model", status=503, type="unavailable_error", code="loading",
                           headers={"Retry-After": "1"})
        if self._builder is None:
            self._builder = self._make_builder(self.worker)
        return self._builder


def _error_response(e: ApiError, path: str = "") -> JSONResponse:
    return error_response(e, path)


class _ContentChunk:
    """A stream's text-only chunk as bytes, from its JSON with the text spliced in: the same bytes
    as `_sse(json.dumps(chunk))` with that text, at a tenth of the cost (5 us a token)."""

    def __init__(self, chunk: dict[str, Any]):
        head, tail = json.dumps(chunk).split('"content": ""', 1)    # the one empty string: in the delta
        self.head, self.tail = b"data: " + head.encode() + b'"content": ', tail.encode() + b"\r\n\r\n"

    def encode(self, text: str) -> bytes:
        return self.head + json.dumps(text).encode() + self.tail


def _sse(data: str) -> bytes:
    """One server-sent event, encoded as sse-starlette encodes `{"data": data}` (no newline in
    `data`: JSON text or [DONE]); handing it bytes skips its per-event ServerSentEvent."""
    return b"data: " + data.encode() + b"\r\n\r\n"


def _chunk(cid: str, model: str, created: int, choice: dict[str, Any] | None, obj: str) -> dict[str, Any]:
    out = envelope(obj, cid, model, created)
    out["choices"] = [choice] if choice is not None else []
    return out


def create_app(state: ServerState) -> Starlette:
    async def health(request: Request) -> Response:
        try:
            state.builder
        except ApiError as e:
            return JSONResponse({"error": {"code": e.status, "message": e.message, "type": e.type}},
                                status_code=e.status, headers=e.headers)
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        meta: dict[str, Any] = {}
        w = state.worker
        if w.ready.is_set() and w.model is not None:
            m = w.model
            meta = {"n_ctx": m.n_ctx, "n_vocab": m.hp.n_vocab, "n_embd": m.hp.n_embd, "size": m.path.stat().st_size}
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "deltarun",
             "meta": meta}]})

    async def _submit(request: Request, parse: Callable[[Any], Any], build: Callable[[Any], Callable[[Any], Any]],
                      prefix: str) -> tuple[Any, list[Relay], str, int, str]:
        """What both completion endpoints do first: parse the body, build the prompt (in the thread
        pool), submit a job per choice (`_choice_params`); returns (request, relays, id, created,
        model name)."""
        body = await read_json(request, state.max_body)
        builder = state.builder

        def prepare() -> tuple[Any, GenParams]:
            req = parse(body)
            check_token_ids(req, builder.n_vocab)
            check_prompt_size(req, builder.n_ctx, "messages" if isinstance(req, ChatRequest) else "prompt")
            return req, build(builder)(req)
        req, params = await run_cpu(prepare)
        relays: list[Relay] = []
        try:
            for p in _choice_params(req, params):
                relays.append(Relay(state, p))
        except ApiError:                  # (a full queue) none of the choices runs
            for r in relays:
                r.job.cancel()
            raise
        return req, relays, prefix + secrets.token_hex(12), int(time.time()), req.model or state.model_name

    async def _gathered(relay: Relay, request: Request) -> tuple[Delta, list[dict[str, Any]], str, dict[str, Any]] \
            | ApiError | None:
        """A job's whole answer: its text, logprobs, finish reason and result; its error; or None
        when the client went away."""
        text = Delta()
        logprobs: list[dict[str, Any]] = []
        async for ev in relay.events(request):
            if ev.error is not None:
                return ev.error
            if ev.delta is not None:
                text.add(ev.delta)
            if ev.prompt_logprobs:    # (before any token's)
                logprobs.extend(ev.prompt_logprobs)
            if ev.logprobs:
                logprobs.extend(ev.logprobs)
            if ev.finish_reason is not None:
                return text, logprobs, ev.finish_reason, ev.result
        return None

    async def _answer(relays: list[Relay], request: Request, obj: str, cid: str, model: str, created: int,
                      choice: Callable[[Delta, list[dict[str, Any]], str], dict[str, Any]]) -> Response:
        """A non-streaming answer: gather each job's text and logprobs, then one JSON body with a
        `choice(text, logprobs, finish_reason)` per job, usage and timings."""
        # the first choice to fail fails the request at once, and the others stop (their relays
        # cancel their jobs as the tasks are cancelled)
        tasks = [asyncio.ensure_future(_gathered(r, request)) for r in relays]
        try:
            for done in asyncio.as_completed(tasks):
                a = await done
                if isinstance(a, ApiError):
                    return _error_response(a, request.url.path)
                if a is None:
                    return Response(status_code=499)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        answers = [t.result() for t in tasks]
        out = envelope(obj, cid, model, created)
        out["choices"] = [dict(choice(text, lps, reason), index=i) for i, (text, lps, reason, _) in enumerate(answers)]
        r = _merged_result(dict(enumerate(a[3] for a in answers)))
        out["usage"] = usage(r["n_prompt"], r["n_cached"], r["n_generated"])
        out["timings"] = _timings(r)
        return JSONResponse(out)

    async def chat_completions(request: Request) -> Response:
        req, relays, cid, created, model = await _submit(request, parse_chat, lambda b: b.chat, "chatcmpl-")
        # a continued message comes back whole, its text before the answer's (as llama-server's)
        continued = req.messages[-1] if state.builder.continues(req) else None
        prefill = Delta(content=continued.get("content") or "", reasoning=continued.get("reasoning_content") or "") \
            if continued is not None else None
        if req.stream:
            return EventSourceResponse(_chat_stream(relays, cid, model, created, req.include_usage, prefill),
                                       shutdown_grace_period=5.0, headers={"Cache-Control": "no-cache"})

        def choice(text: Delta, logprobs: list[dict[str, Any]], reason: str) -> dict[str, Any]:
            if prefill is not None:
                text = Delta(content=prefill.content + text.content, reasoning=prefill.reasoning + text.reasoning,
                             tool_calls=text.tool_calls)
            return {"index": 0, "message": chat_message(text.content, text.reasoning, text.tool_calls),
                    "logprobs": {"content": logprobs} if req.logprobs else None, "finish_reason": reason}
        return await _answer(relays, request, "chat.completion", cid, model, created, choice)

    async def _chat_stream(relays: list[Relay], cid: str, model: str, created: int,
                           include_usage: bool, prefill: Delta | None = None) -> AsyncIterator[bytes]:
        first = [True] * len(relays)
        text_chunks = [_ContentChunk(_chunk(cid, model, created, {"index": i, "delta": {"content": ""}, "logprobs": None,
                                                                  "finish_reason": None}, "chat.completion.chunk"))
                       for i in range(len(relays))]
        results: dict[int, dict[str, Any]] = {}
        if prefill is not None:           # each choice opens with the continued message's text
            for i in range(len(relays)):
                first[i] = False
                yield _sse(json.dumps(_chunk(cid, model, created, {"index": i, "delta": chat_delta(prefill, True),
                                                                   "logprobs": None, "finish_reason": None},
                                             "chat.completion.chunk")))
        async for i, ev in _merged_events(relays):
            if ev.error is not None:
                yield _sse(json.dumps(ev.error.body()))
                break
            if not first[i] and not ev.logprobs and ev.delta and ev.delta.content and not ev.delta.reasoning \
                    and not ev.delta.tool_calls:
                yield text_chunks[i].encode(ev.delta.content)     # the usual chunk: text only
            elif ev.delta or ev.logprobs or first[i]:
                delta = ev.delta or Delta()
                choice = {"index": i, "delta": chat_delta(delta, first[i]), "logprobs": None, "finish_reason": None}
                if ev.logprobs:
                    choice["logprobs"] = {"content": ev.logprobs}
                first[i] = False
                yield _sse(json.dumps(_chunk(cid, model, created, choice, "chat.completion.chunk")))
            if ev.finish_reason is not None:
                results[i] = ev.result
                last = _chunk(cid, model, created, {"index": i, "delta": {}, "logprobs": None,
                                                    "finish_reason": ev.finish_reason}, "chat.completion.chunk")
                for chunk in _final_chunks(last, results, len(relays), include_usage):
                    yield _sse(json.dumps(chunk))
        yield _sse("[DONE]")

    async def completions(request: Request) -> Response:
        req, relays, cid, created, model = await _submit(request, parse_completion, lambda b: b.completion, "cmpl-")
        tok = state.worker.model.tokenizer
        echo = await run_cpu(tok.decode, relays[0].job.params.prompt) if req.echo else ""
        if req.stream:
            return EventSourceResponse(_completion_stream(relays, cid, model, created, req.include_usage, echo,
                                                          req.logprobs), shutdown_grace_period=5.0)

        def choice(text: Delta, lps: list[dict[str, Any]], reason: str) -> dict[str, Any]:
            return {"index": 0, "text": echo + text.content,
                    "logprobs": _legacy_logprobs(lps) if req.logprobs else None, "finish_reason": reason}
        return await _answer(relays, request, "text_completion", cid, model, created, choice)

    async def _completion_stream(relays: list[Relay], cid: str, model: str, created: int, include_usage: bool,
                                 echo: str, logprobs: bool) -> AsyncIterator[bytes]:
        offsets = [0] * len(relays)       # text_offset of each choice's next token: its text sent before it
        if echo and not logprobs:
            for i in range(len(relays)):
                yield _sse(json.dumps(_chunk(cid, model, created, {"index": i, "text": echo, "logprobs": None,
                                                                    "finish_reason": None}, "text_completion")))
        results: dict[int, dict[str, Any]] = {}
        async for i, ev in _merged_events(relays):
            if ev.error is not None:
                yield _sse(json.dumps(ev.error.body()))
                break
            if ev.prompt_logprobs:        # the echo comes with its tokens' logprobs
                lp = _legacy_logprobs(ev.prompt_logprobs, offsets[i])
                offsets[i] = _next_offset(lp)
                yield _sse(json.dumps(_chunk(cid, model, created, {"index": i, "text": echo, "logprobs": lp,
                                                                    "finish_reason": None}, "text_completion")))
            text = ev.delta.content if ev.delta is not None else ""
            if text or ev.logprobs or ev.finish_reason is not None:
                lp = _legacy_logprobs(ev.logprobs, offsets[i]) if ev.logprobs else None
                offsets[i] = _next_offset(lp) if lp else offsets[i]
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": ev.finish_reason}
                out = _chunk(cid, model, created, choice, "text_completion")
                if ev.finish_reason is None:
                    yield _sse(json.dumps(out))
                else:
                    results[i] = ev.result
                    for chunk in _final_chunks(out, results, len(relays), include_usage, timings_on_finish=True):
                        yield _sse(json.dumps(chunk))
        yield _sse("[DONE]")

    async def metrics(request: Request) -> Response:
        running, queued = state.worker.counts
        state.worker.metrics.running.set(running)
        state.worker.metrics.queued.set(queued)
        return Response(state.worker.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(request: Request) -> Response:
        builder = state.builder
        limit = builder.n_ctx * MAX_CHARS_PER_TOKEN
        # a body longer than the longest text allowed can be (12 bytes a character: an escaped
        # surrogate pair) is refused before it is read and parsed
        body = await read_json(request, min(state.max_body, 12 * limit + (64 << 10)))
        if not isinstance(body, dict) or not isinstance(body.get("content", ""), str):
            raise ApiError("'content' must be a string", param="content", code="invalid_type")
        text = body.get("content", "")
        if len(text) > limit:
            raise ApiError(f"'content' has {len(text)} characters; at most {limit} ({MAX_CHARS_PER_TOKEN} for each "
                           f"token of the context)", status=413, param="content", code="content_too_large")
        tok = builder.tokenizer

        def work() -> bytes:
            ids = tok.encode(text, bool(body.get("add_special", False)), bool(body.get("parse_special", True)))
            if not body.get("with_pieces"):
                return _json_list(b'{"tokens": [', ids, b"]}")
            pieces = []
            for t in ids:
                b = tok.token_bytes(t)
                try:
                    piece: Any = b.decode("utf-8")
                except UnicodeDecodeError:
                    piece = list(b)
                pieces.append({"id": t, "piece": piece})
            return _json_list(b'{"tokens": [', pieces, b"]}")
        return Response(await run_cpu(work), media_type="application/json")

    async def detokenize(request: Request) -> Response:
        body = await read_json(request, state.max_body)
        ids = body.get("tokens", []) if isinstance(body, dict) else None
        tok = state.builder.tokenizer

        def work() -> bytes:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ApiError("'tokens' must be a list of token ids", param="tokens", code="invalid_type")
            bad = next((t for t in ids if not 0 <= t < tok.n_vocab), None)
            if bad is not None:
                raise ApiError(f"token id {bad} is outside the vocabulary", param="tokens", code="invalid_value")
            return json.dumps({"content": tok.decode(ids)}, ensure_ascii=False).encode("utf-8")
        return Response(await run_cpu(work), media_type="application/json")

    async def infill(request: Request) -> Response:
        """llama-server's `/infill` (editor completion plugins): the fill-in-the-middle prompt
        (`serve.infill`), completed."""
        return await _llama_server_answer(request, parse_infill, lambda b: b.infill)

    async def llama_server_completion(request: Request) -> Response:
        """llama-server's own `/completion` (clients written for it, such as SillyTavern's)."""
        return await _llama_server_answer(request, parse_llama_server_completion, lambda b: b.completion)

    async def _llama_server_answer(request: Request, parse: Callable[[Any], Any],
                                   build: Callable[[Any], Any]) -> Response:
        """A completion answered in llama-server's own format: `content`, `stop`, token counts and
        `timings`; a stream sends a `content` piece per event and ends with the whole record
        (`stop` true)."""
        req, relays, _, _, model = await _submit(request, parse, build, "")
        prompt_text = await run_cpu(state.builder.tokenizer.decode, relays[0].job.params.prompt)

        def record(content: str, reason: str, r: dict[str, Any]) -> dict[str, Any]:
            stop_type = "limit" if reason == "length" else "word" if r["stop_word"] else "eos"
            return {"index": 0, "content": content, "tokens": [], "id_slot": -1, "stop": True, "model": model,
                    "prompt": prompt_text,
                    "tokens_predicted": r["n_generated"], "tokens_evaluated": r["n_prompt"],
                    "tokens_cached": r["n_cached"], "truncated": False, "stop_type": stop_type,
                    "stopping_word": r["stop_word"], "has_new_line": "\n" in content, "timings": _timings(r)}

        if req.stream:
            async def events() -> AsyncIterator[bytes]:
                async for ev in relays[0].events(request):
                    if ev.error is not None:
                        yield _sse(json.dumps(ev.error.body()))
                        return
                    if ev.delta is not None and ev.delta.content:
                        yield _sse(json.dumps({"index": 0, "content": ev.delta.content, "tokens": [], "stop": False,
                                               "id_slot": -1}))
                    if ev.finish_reason is not None:
                        yield _sse(json.dumps(record("", ev.finish_reason, ev.result)))
                        return
            return EventSourceResponse(events(), shutdown_grace_period=5.0, headers={"Cache-Control": "no-cache"})
        a = await _gathered(relays[0], request)
        if isinstance(a, ApiError):
            return _error_response(a, request.url.path)
        if a is None:
            return Response(status_code=499)          # the client went away
        text, _, reason, result = a
        return JSONResponse(record(text.content, reason, result))

    async def apply_template(request: Request) -> Response:
        """llama-server's `/apply-template`: the prompt a chat request's body would be answered
        after (template, tools, thinking switch, a continued assistant message), nothing run."""
        body = await read_json(request, state.max_body)
        builder = state.builder
        return JSONResponse({"prompt": await run_cpu(lambda: builder.prompt_text(parse_chat(body)))})

    async def props(request: Request) -> Response:
        b = state.builder
        m = state.worker.model
        tok = b.tokenizer
        from dataclasses import asdict

        from deltarun.runner.sampling import SamplingParams

        return JSONResponse({
            "default_generation_settings": {"params": asdict(SamplingParams()), "n_ctx": m.n_ctx},
            "total_slots": state.n_parallel,
            "model_alias": state.model_name,
            "model_path": str(m.path) if state.expose_model_path else Path(m.path).name,
            "modalities": {"vision": b.vision is not None, "audio": False, "video": False},
            "chat_template": b.template.source,
            "bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
            "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
            "build_info": "deltarun",
            "rs_slots": m.rs_slots,
            "cache_ram_bytes": state.worker.cache_bytes,
            "speculative": {"draft": state.worker.draft_spec, "draft_max": state.worker.draft_max,
                            "n_drafted": state.worker.n_drafted, "n_accepted": state.worker.n_accepted},
            "endpoints": API_ENDPOINTS,
        })

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error_response(exc, request.url.path)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if request.url.path.startswith("/v1/messages"):
            return _error_response(ApiError(f"{request.method} {request.url.path}: {exc.detail}",
                                            status=exc.status_code), request.url.path)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {exc.detail}", "type": kind,
                                       "param": None, "code": None}}, status_code=exc.status_code)

    async def server_error(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}: {exc}",
                                       "type": "server_error", "param": None, "code": None}}, status_code=500)

    from deltarun.apps.serve.messages_api import messages_routes
    from deltarun.apps.serve.pages import page_routes
    from deltarun.apps.serve.responses_api import responses_routes

    routes = page_routes(state) + messages_routes(state) + responses_routes(state) + [
        Route("/health", health), Route("/v1/health", health),
        Route("/v1/models", models), Route("/models", models),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]), Route("/completions", completions, methods=["POST"]),
        Route("/metrics", metrics), Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]), Route("/props", props),
        Route("/apply-template", apply_template, methods=["POST"]), Route("/infill", infill, methods=["POST"]),
        Route("/completion", llama_server_completion, methods=["POST"]),
    ]
    # outermost first: host, origin and content type checked (and any error answered) before CORS
    # answers a preflight, and both before the key is asked for (a preflight carries none)
    middleware = [Middleware(RequestGuard, policy=state.policy)]
    if state.policy.cors:
        middleware.append(Middleware(CORSMiddleware, allow_origins=["*"] if state.policy.any_origin else
                                     sorted(state.policy.origins), allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                                     allow_headers=["*"], max_age=600))
    if state.api_key:
        middleware.append(Middleware(ApiKeyMiddleware, key=state.api_key))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error})


class ApiKeyMiddleware:
    """401 with OpenAI's error object unless `Authorization: Bearer KEY` (or `x-api-key`) matches."""

    def __init__(self, app: Any, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            token = given[7:].strip() if given[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(token, self.key):
                e = ApiError("invalid or missing API key (send 'Authorization: Bearer KEY')", status=401,
                             type="authentication_error", code="invalid_api_key")
                await _error_response(e, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _json_list(head: bytes, items: list[Any], tail: bytes) -> bytes:
    """`head + JSON items joined by ", " + tail`, encoded ENCODE_SLICE items at a time (each json.dumps
    holds the GIL: slices let the event loop in between)."""
    parts = [json.dumps(items[i:i + ENCODE_SLICE], ensure_ascii=False)[1:-1] for i in range(0, len(items), ENCODE_SLICE)]
    return head + ", ".join(p for p in parts if p).encode("utf-8") + tail


def _timings(r: dict[str, Any]) -> dict[str, Any]:
    """llama-server's `timings` of a finished job's result, with its draft counts when it drafted."""
    t = timings(r["n_cached"], r["n_evaluated"], r["prompt_s"], r["n_generated"], r["generate_s"])
    if r.get("n_drafted"):
        t["draft_n"], t["draft_n_accepted"] = r["n_drafted"], r["n_accepted"]
    return t


def _choice_params(req: Any, params: GenParams) -> list[GenParams]:
    """A job's parameters per choice (`n`): one group, so that the worker evaluates the prompt once
    (`GenParams.group`); with a seed, choice i draws with seed + i (else n equal answers)."""
    if req.n == 1:
        return [params]
    group = secrets.token_hex(8)
    out = []
    for i in range(req.n):
        r = req
        if i and req.sampling.seed is not None:
            r = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, seed=req.sampling.seed + i))
        out.append(dataclasses.replace(params, req=r, group=group, choice=i))
    return out


def _merged_result(results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The jobs' results of one request's choices as one (by choice index): the prompt as choice 0
    read it, the prompt tokens evaluated, tokens generated and drafts summed, the longest
    generation's seconds."""
    if len(results) == 1:
        return next(iter(results.values()))
    r = dict(results[0])
    for k in ("n_evaluated", "n_generated", "n_drafted", "n_accepted"):
        r[k] = sum(x[k] for x in results.values())
    r["generate_s"] = max(x["generate_s"] for x in results.values())
    return r


def _final_chunks(finish: dict[str, Any], results: dict[int, dict[str, Any]], n_choices: int,
                  include_usage: bool, timings_on_finish: bool = False) -> list[dict[str, Any]]:
    """What a stream sends when a choice finishes (`results` holds it): its finish chunk; after the
    last choice's, the usage chunk (with include_usage) and llama-server's timings of the whole
    request, on the last chunk (or, for /v1/completions, on the finish chunk, as before `n`)."""
    if len(results) < n_choices:
        return [finish]
    r = _merged_result(results)
    if timings_on_finish or not include_usage:
        finish["timings"] = _timings(r)
    if not include_usage:
        return [finish]
    usage_chunk = {k: v for k, v in finish.items() if k != "timings"}
    usage_chunk["choices"] = []
    usage_chunk["usage"] = usage(r["n_prompt"], r["n_cached"], r["n_generated"])
    if not timings_on_finish:
        usage_chunk["timings"] = _timings(r)
    return [finish, usage_chunk]


async def _merged_events(relays: list[Relay]) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) from every relay as they come (one relay: its events as they are). A
    consumer that stops early cancels every choice's job."""
    if len(relays) == 1:
        async for ev in relays[0].events():
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(i: int, relay: Relay) -> None:
        try:
            async for ev in relay.events():
                queue.put_nowait((i, ev))
        finally:
            queue.put_nowait((i, None))
    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(relays)]
    try:
        left = len(relays)
        while left:
            i, ev = await queue.get()
            if ev is None:
                left -= 1
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()


def _legacy_logprobs(entries: list[dict[str, Any]], start: int = 0) -> dict[str, Any]:
    """/v1/completions' logprobs object from per-token entries, the first token at `start` in the
    choice's text (a prompt's first token has no logprob nor alternatives: None, as OpenAI's)."""
    offsets, pos = [], start
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}


def _next_offset(lp: dict[str, Any]) -> int:
    """The text_offset after the last token of a legacy logprobs object."""
    return lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else 0
