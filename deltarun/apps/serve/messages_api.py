"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the chat pipeline.

A request is translated into the Chat Completions body it means, then checked by `parse_chat` and
built by `PromptBuilder.chat`: the same template, prompt cache, grammars and tool-call parsing as
/v1/chat/completions, so a conversation costs the same evaluated tokens through either. The
translation (the one llama-server's `/v1/messages` makes too):

- `system` (a string or text blocks) -> a first system message;
- `text` blocks -> text parts; `image` blocks with a base64 source -> image parts (a url source is
  refused: the server downloads nothing; images need `serve --mmproj`); `thinking` blocks -> the
  assistant message's `reasoning_content`
  (so the template renders an agent loop's earlier thinking as it was generated, and the prompt
  cache finds it); `redacted_thinking` is dropped; `tool_use` -> an assistant tool call;
  `tool_result` (text or text blocks; `is_error` prefixes "Error: ") -> a tool message;
- `tools[].input_schema` -> the function's parameters; `tool_choice` auto / any / tool / none ->
  auto / required / that function / none (a forced call's arguments follow its schema through
  llguidance); `output_config.format` (a JSON schema) -> `response_format`;
- `thinking` enabled / adaptive / disabled -> the template's `enable_thinking` (absent: the
  template's default); enabled's `budget_tokens` -> `reasoning_budget_tokens` (the answer's
  thinking ends with the template's end-of-thinking marker after that many tokens,
  `runner.reasoning.ThinkingBudget`);
- a last `assistant` message is continued (prefill, `continue_final_message`): the answer's content
  starts with its text and the response holds what follows it; one with `tool_use` is refused;
- `stop_sequences` -> `stop`; `temperature`, `top_p`, `top_k`, and llama-server's sampling
  extras (`min_p`, `seed`, ...) as they are: SDKs that no longer have sampling arguments send them
  as extra body fields, else the server's defaults apply.

Unknown fields (`cache_control`, `metadata`, `service_tier`, ...) are ignored. Errors are
Anthropic's `{"type": "error", "error": {"type", "message"}}` with the HTTP status of the problem.

Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens evaluated,
`cache_read_input_tokens` those the prompt cache resumed from; their sum is the prompt. A stream's
`message_start` is sent at once, before the cache is looked up, so it counts the whole prompt as
input; `message_delta` carries the final split (the API's usage totals there overwrite).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, AsyncIterator, Awaitable, Callable

from sse_starlette.sse import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deltarun.apps.serve.answers import TEXT, THINKING, TOOL_CALL, Block, BlockSplitter, Ending, Step, submit_chat
from deltarun.apps.serve.protocol import (MAX_STOPS, ApiError, ChatRequest, base64_image, parse_chat,
                                          register_error_shape)

#: llama-server's sampling fields, passed through as they are (the anthropic SDK 2.x sends them as extra body)
SAMPLING_EXTRAS = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty", "repeat_last_n",
                   "presence_penalty", "frequency_penalty", "ignore_eos", "logit_bias")
THINKING_ON = ("enabled", "adaptive", "between_tools")
PING_S = 15
#: Claude Code starts its system prompt with a billing header whose `cch=` value changes on every
#: request; left as it is, no request could resume past it from the prompt cache
_BILLING_CCH = re.compile(r"^(x-anthropic-billing-header:[^\n]*?cch=)[0-9a-zA-Z]{5};")

#: Anthropic's error type for an HTTP status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


# --------------------------------------------------------------------------------------------- errors
def error_body(e: ApiError) -> dict[str, Any]:
    """Anthropic's error object for an `ApiError` (its status picks the type). A prompt over the
    context is told in the API's words, "prompt is too long: N tokens > M maximum", which Claude
    Code answers by compacting the conversation."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    message = e.message
    if "n_prompt_tokens" in e.extra and "n_ctx" in e.extra:
        message = f"prompt is too long: {e.extra['n_prompt_tokens']} tokens > {e.extra['n_ctx'] - 1} maximum ({message})"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


def _bad(message: str) -> ApiError:
    return ApiError(message, code="invalid_request")


def _anthropic_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Any error of a handler answered in Anthropic's shape (an unexpected one as a 500)."""
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except Exception as e:  # noqa: BLE001 - a bug still answers in the client's error shape
            return error_response(ApiError(f"internal error: {type(e).__name__}: {e}", status=500))
    return wrapped


# --------------------------------------------------------------------------------------------- requests
def _text_blocks(content: Any, where: str, what: str = "text") -> list[dict[str, str]]:
    """A string or a list of text blocks -> chat text parts (other blocks refused)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}: expected a string or a list of {what} blocks")
    parts = []
    for j, block in enumerate(content):
        p = f"{where}.{j}"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(f"{p}: a block of type {kind!r} where only text blocks are supported"
                       + (" (this model reads text only)" if kind in ("image", "document") else ""))
        if not isinstance(block.get("text"), str):
            raise _bad(f"{p}.text: expected a string")
        parts.append({"type": "text", "text": block["text"]})
    return parts


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "" or system == []:
        return []
    parts = _text_blocks(system, "system")
    for part in parts:
        part["text"] = _BILLING_CCH.sub(r"\1fffff;", part["text"])
    return [{"role": "system", "content": parts}]


def _user_message(content: Any, where: str) -> list[dict[str, Any]]:
    """A user message -> chat messages: its text as user messages, its tool results as tool
    messages, in the order of the blocks."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise _bad(f"{where}.content: expected a string or a non-empty list of content blocks")
    out: list[dict[str, Any]] = []
    text: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        p = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text += _text_blocks([block], f"{where}.content")
        elif kind == "tool_result":
            if text:
                out.append({"role": "user", "content": text})
                text = []
            out.append(_tool_result(block, p))
        elif kind == "image":
            text.append(_image(block, p))
        elif kind == "document":
            raise _bad(f"{p}: a block of type {kind!r}: this model reads text only")
        else:
            raise _bad(f"{p}: a block of type {kind!r} in a user message; expected text or tool_result")
    if text:
        out.append({"role": "user", "content": text})
    return out


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block -> the chat image part `parse_chat` takes decoded (`protocol._message_content`)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind != "base64":
        raise _bad(f"{where}.source: an image source of type {kind!r}; only base64 sources are accepted (the "
                   f"server downloads nothing)")
    data = base64_image(source.get("media_type"), source.get("data"), f"{where}.source")
    return {"type": "image", "data": data, "param": where}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise _bad(f"{where}.tool_use_id: expected a string")
    content = block.get("content", "")
    parts = _text_blocks(content, f"{where}.content") if content != "" else []
    text = "".join(p["text"] for p in parts)
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise _bad(f"{where}.is_error: expected a boolean")
    return {"role": "tool", "tool_call_id": tool_use_id, "content": "Error: " + text if is_error else text}


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where}.content: expected a string or a list of content blocks")
    text: list[dict[str, str]] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        p = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text += _text_blocks([block], f"{where}.content")
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _bad(f"{p}.thinking: expected a string")
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            pass
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not block["name"]:
                raise _bad(f"{p}: a tool_use block needs a string 'id' and 'name'")
            if not isinstance(block.get("input"), dict):
                raise _bad(f"{p}.input: expected an object")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        else:
            raise _bad(f"{p}: a block of type {kind!r} in an assistant message; expected text, thinking "
                       f"or tool_use")
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages: expected a non-empty list")
    out = _system(body.get("system"))
    for i, m in enumerate(msgs):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}.role: expected 'user' or 'assistant'")
        if "content" not in m:
            raise _bad(f"{where}.content: Field required")
        if m["role"] == "user":
            out += _user_message(m["content"], where)
        else:
            out.append(_assistant_message(m["content"], where))
    return out


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _bad("tools: expected a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"tools.{i}: expected an object with a 'name'")
        if t.get("type") not in (None, "custom"):
            raise _bad(f"tools.{i}: tool type {t['type']!r} is one of Anthropic's server tools; only custom "
                       f"tools (name, description, input_schema) are supported")
        schema = t.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise _bad(f"tools.{i}.input_schema: expected a JSON schema object")
        fn: dict[str, Any] = {"name": t["name"]}      # in the order clients write: templates render it as it is
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    names = [t["function"]["name"] for t in out]
    choice = body.get("tool_choice")
    if choice is None:
        return out, "auto" if out else "none"
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice.type: expected 'auto', 'any', 'tool' or 'none'")
    if kind in ("any", "tool") and not out:
        raise _bad(f"tool_choice: type {kind!r} needs tools")
    if kind == "tool":
        if choice.get("name") not in names:
            raise _bad(f"tool_choice.name: {choice.get('name')!r} is not among the tools ({', '.join(names)})")
        return out, {"type": "function", "function": {"name": choice["name"]}}
    return out, {"auto": "auto", "any": "required", "none": "none"}[kind]


def _thinking(body: dict[str, Any]) -> tuple[bool | None, int | None]:
    """The template's thinking switch from `thinking` (None: not given) and its token budget
    (None: none)."""
    th = body.get("thinking")
    if th is None:
        return None, None
    kind = th.get("type") if isinstance(th, dict) else None
    if kind == "disabled":
        return False, None
    if kind not in THINKING_ON:
        raise _bad(f"thinking.type: expected one of enabled, disabled, {', '.join(THINKING_ON[1:])}")
    budget = th.get("budget_tokens")
    if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise _bad("thinking.budget_tokens: expected a positive integer")
    return True, budget if kind == "enabled" else None


def _output_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`output_config.format` (or the older top-level `output_format`) -> response_format."""
    cfg = body.get("output_config")
    if cfg is not None and not isinstance(cfg, dict):
        raise _bad("output_config: expected an object")
    fmt = (cfg or {}).get("format") or body.get("output_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format: expected {'type': 'json_schema', 'schema': {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_body(body: Any, count_only: bool = False) -> dict[str, Any]:
    """The Chat Completions body a Messages request means (see the module docstring)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    out: dict[str, Any] = {"messages": _messages(body)}
    # a last assistant message is continued: its text starts the answer (Anthropic's prefill)
    out["continue_final_message"] = out["messages"][-1]["role"] == "assistant"
    out["tools"], out["tool_choice"] = _tools(body)
    if not count_only:
        mt = body.get("max_tokens")
        if mt is None:
            raise _bad("max_tokens: Field required")
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise _bad("max_tokens: expected a positive integer")
        out["max_tokens"] = mt
        stops = body.get("stop_sequences") or []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("stop_sequences: expected a list of strings")
        if len(stops) > MAX_STOPS:
            raise _bad(f"stop_sequences: at most {MAX_STOPS} strings")
        out["stop"] = stops
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream: expected a boolean")
        out["stream"] = stream
        for key in SAMPLING_EXTRAS:
            if body.get(key) is not None:
                out[key] = body[key]
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
            raise _bad("metadata: expected an object")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs: expected an object")
    thinking, budget = _thinking(body)
    if thinking is not None:
        kwargs = {**kwargs, "enable_thinking": thinking}
    if budget is not None:
        out["reasoning_budget_tokens"] = budget
    out["chat_template_kwargs"] = kwargs
    rf = _output_format(body)
    if rf is not None:
        out["response_format"] = rf
    if isinstance(body.get("model"), str):
        out["model"] = body["model"]
    return out


def _max_calls(body: dict[str, Any]) -> int | None:
    """1 when `tool_choice.disable_parallel_tool_use` asks for at most one call, else None."""
    choice = body.get("tool_choice")
    return 1 if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True else None


def parse_messages(body: Any, count_only: bool = False) -> ChatRequest:
    """A Messages request body -> the checked chat request it means."""
    return parse_chat(chat_body(body, count_only))


# --------------------------------------------------------------------------------------------- responses
def _usage(r: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": r["n_prompt"] - r["n_cached"], "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": r["n_cached"], "output_tokens": r["n_generated"]}


def _stop_reason(end: Ending) -> str:
    if end.reason == "tool_calls":
        return "tool_use"
    if end.reason == "length":
        return "model_context_window_exceeded" if end.context_full else "max_tokens"
    return "stop_sequence" if end.stop_sequence is not None else "end_turn"


def _tool_input(arguments: str) -> dict[str, Any]:
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {"arguments": value}


def content_block(b: Block) -> dict[str, Any]:
    """The finished block as Anthropic's content block."""
    if b.kind == THINKING:
        return {"type": "thinking", "thinking": b.text, "signature": ""}
    if b.kind == TEXT:
        return {"type": "text", "text": b.text}
    return {"type": "tool_use", "id": b.call["id"], "name": b.call["function"]["name"], "input": _tool_input(b.text)}


def _start_block(b: Block) -> dict[str, Any]:
    """The block as `content_block_start` announces it: empty."""
    if b.kind == THINKING:
        return {"type": "thinking", "thinking": "", "signature": ""}
    if b.kind == TEXT:
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": b.call["id"], "name": b.call["function"]["name"], "input": {}}


_DELTAS = {THINKING: ("thinking_delta", "thinking"), TEXT: ("text_delta", "text"),
           TOOL_CALL: ("input_json_delta", "partial_json")}


def _event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with its name (the anthropic SDK reads the `event:` line)."""
    return b"event: " + name.encode() + b"\r\ndata: " + json.dumps(data).encode() + b"\r\n\r\n"


def _step_event(s: Step) -> bytes:
    i = s.block.index
    if s.what == "open":
        return _event("content_block_start", {"type": "content_block_start", "index": i,
                                              "content_block": _start_block(s.block)})
    if s.what == "close":
        return _event("content_block_stop", {"type": "content_block_stop", "index": i})
    kind, field = _DELTAS[s.block.kind]
    return _event("content_block_delta", {"type": "content_block_delta", "index": i,
                                          "delta": {"type": kind, field: s.piece}})


def _ping() -> ServerSentEvent:
    return ServerSentEvent(data='{"type": "ping"}', event="ping")


# --------------------------------------------------------------------------------------------- routes
def messages_routes(state: Any) -> list[Route]:
    """The routes of /v1/messages and /v1/messages/count_tokens on the server's `state`."""
    from deltarun.apps.serve.relay import check_prompt_size, read_json, run_cpu

    register_error_shape("/v1/messages", error_body)

    @_anthropic_errors
    async def messages(request: Request) -> Response:
        body = await read_json(request, state.max_body)
        req, params, relay = await submit_chat(state, lambda: parse_messages(body))
        max_calls = _max_calls(body)
        mid, model = "msg_" + secrets.token_hex(12), req.model or state.model_name
        tokenizer = state.builder.tokenizer
        if req.stream:
            return EventSourceResponse(_stream(relay, req, params, mid, model, tokenizer, max_calls), ping=PING_S,
                                       ping_message_factory=_ping, shutdown_grace_period=5.0,
                                       headers={"Cache-Control": "no-cache"})
        splitter = BlockSplitter(max_calls)
        async for ev in relay.events(request):
            if ev.error is not None:
                return error_response(ev.error)
            if ev.delta is not None:
                splitter.push(ev.delta)
            if ev.finish_reason is not None:
                splitter.close()
                blocks = splitter.blocks
                end = Ending.of(tokenizer, req, ev.finish_reason, ev.result, any(b.kind == THINKING for b in blocks))
                return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": model,
                                     "content": [content_block(b) for b in blocks], "stop_reason": _stop_reason(end),
                                     "stop_sequence": end.stop_sequence, "usage": _usage(ev.result)})
        return Response(status_code=499)     # the client went away

    async def _stream(relay: Any, req: ChatRequest, params: Any, mid: str, model: str, tokenizer: Any,
                      max_calls: int | None) -> AsyncIterator[bytes]:
        """The events of each worker event go out in one write (each write costs the loop a turn)."""
        yield _event("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": len(params.prompt), "cache_creation_input_tokens": 0,
                                             "cache_read_input_tokens": 0, "output_tokens": 0}}}) \
            + _event("ping", {"type": "ping"})
        splitter = BlockSplitter(max_calls)
        async for ev in relay.events():
            if ev.error is not None:
                yield _event("error", error_body(ev.error))
                return
            steps = splitter.push(ev.delta) if ev.delta is not None else []
            if ev.finish_reason is None:
                if steps:
                    yield b"".join(_step_event(s) for s in steps)
                continue
            steps += splitter.close()
            end = Ending.of(tokenizer, req, ev.finish_reason, ev.result, any(b.kind == THINKING for b in splitter.blocks))
            yield b"".join(_step_event(s) for s in steps) \
                + _event("message_delta", {"type": "message_delta", "delta": {
                    "stop_reason": _stop_reason(end), "stop_sequence": end.stop_sequence}, "usage": _usage(ev.result)}) \
                + _event("message_stop", {"type": "message_stop"})

    @_anthropic_errors
    async def count_tokens(request: Request) -> Response:
        body = await read_json(request, state.max_body)
        builder = state.builder

        def count() -> int:
            req = parse_messages(body, count_only=True)
            check_prompt_size(req, builder.n_ctx, "messages")
            if req.response_format is not None:      # a schema that cannot be compiled is a 400 here too
                builder.grammars.json_schema(req.response_format["schema"], "output_config")
            return builder.prompt_length(req)
        return JSONResponse({"input_tokens": await run_cpu(count)})

    return [Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
