"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`) on the chat pipeline.

A request is translated into the Chat Completions body it means, checked by `parse_chat` and built
by `PromptBuilder.chat`: the same template, prompt cache, grammars and tool-call parsing as
/v1/chat/completions. The translation:

- `instructions` -> a first system message (not carried over to a follow-up, as OpenAI does);
- `input` (a string, or items) -> messages: `message` items by role (`developer` as system; text
  parts, and a user message's `input_image` parts with data: URLs, which need `serve --mmproj`),
  `function_call_output` -> a tool message, and each run of `reasoning`, assistant `message` and
  `function_call` items -> one assistant message with `reasoning_content`, content
  and tool calls: the order this server answers in, so an answer sent back renders as generated;
- `previous_response_id` -> the stored conversation of that response, then the new input: the
  prompt extends the previous one, and the prompt cache evaluates only what is new;
- an `item_reference` input item -> the stored input or output item it names (`ResponseStore.item`);
- function `tools` (flat: `name`, `parameters`) -> chat tools; `tool_choice` as in chat
  (`{"type": "function", "name"}` names one); `text.format` json_schema / json_object ->
  `response_format` (llguidance); `reasoning.effort` none / minimal -> thinking off, low and up
  -> on (absent: the template's default; the API has no token budget, llama-server's
  `reasoning_budget_tokens` extra is one); `max_output_tokens` -> `max_tokens`; `temperature`,
  `top_p` and llama-server's sampling extras as they are; `parallel_tool_calls: false` keeps the
  first call of an answer.

An answer becomes output items in its order (`reasoning` with the reasoning text, `message` with
`output_text`, `function_call`), `usage` counts the prompt's cached tokens and the reasoning
tokens. With `store` (the default) the response is kept in a bounded `ResponseStore`. Errors are
OpenAI's error object; a stream that fails ends with `response.failed`.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deltarun.apps.serve.answers import TEXT, THINKING, Block, BlockSplitter, Ending, Step, submit_chat
from deltarun.apps.serve.protocol import ApiError, ChatRequest, data_url_bytes, parse_chat
from deltarun.apps.serve.response_store import ResponseStore, StoredResponse

SAMPLING_EXTRAS = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty", "repeat_last_n",
                   "presence_penalty", "frequency_penalty", "ignore_eos", "logit_bias", "reasoning_budget_tokens")
EFFORT_OFF = ("none", "minimal")
EFFORT_ON = ("low", "medium", "high", "xhigh")
_ASSISTANT_SIDE = ("reasoning", "function_call")


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(message, param=param, code=code)


# --------------------------------------------------------------------------------------------- requests
def _text(content: Any, where: str, images: bool = False) -> str | list[dict[str, Any]]:
    """A string, or the text parts of a list (input_text / output_text / refusal), as one string; with
    `images` (a user message) and input_image parts, the chat parts in order, each image decoded
    from its data: URL (`protocol.data_url_bytes`: no downloads)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{where}' must be a string or a list of content parts", where, "invalid_type")
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        p = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise _bad(f"'{p}.text' must be a string", f"{p}.text", "invalid_type")
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        elif kind == "input_image" and images:
            if part.get("image_url") is None and part.get("file_id") is not None:
                raise _bad(f"'{p}.file_id': files are not kept here; send the image as an image_url data: URL", p,
                           "unsupported_content")
            parts += [{"type": "text", "text": "".join(texts)}] if texts else []
            parts.append({"type": "image", "data": data_url_bytes(part.get("image_url"), f"{p}.image_url"), "param": p})
            texts = []
        elif kind == "input_image":
            raise _bad(f"'{p}' is an image: images are accepted in user messages only", p, "unsupported_content")
        elif kind in ("input_file", "input_audio"):
            raise _bad(f"'{p}' is of type {kind!r}: this model reads text and images only", p, "unsupported_content")
        else:
            raise _bad(f"'{p}' has type {kind!r}; expected input_text or output_text", p, "unsupported_content")
    if not parts:
        return "".join(texts)
    return parts + ([{"type": "text", "text": "".join(texts)}] if texts else [])


def input_messages(items: Any) -> list[dict[str, Any]]:
    """`input` -> chat messages (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("'input' must be a string or a list of items", "input", "invalid_type")
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None        # the assistant message a run of assistant-side items builds

    def assistant(fresh: bool) -> dict[str, Any]:
        nonlocal cur
        if cur is None or fresh:
            cur = {"role": "assistant", "content": ""}
            out.append(cur)
        return cur

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"'{where}' must be an object", where, "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"'{where}.role' is {role!r}; expected user, assistant, system or developer",
                           f"{where}.role")
            text = _text(item.get("content"), f"{where}.content", images=role == "user")
            if role == "assistant":
                a = assistant(fresh=cur is not None and bool(cur["content"] or cur.get("tool_calls")))
                a["content"] = text
            else:
                cur = None
                out.append({"role": role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise _bad(f"'{where}.content' must be a list of reasoning_text parts", f"{where}.content",
                           "invalid_type")
            texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text"]
            if not all(isinstance(t, str) for t in texts):
                raise _bad(f"'{where}.content' must be reasoning_text parts with a string 'text'",
                           f"{where}.content", "invalid_type")
            text = "".join(texts)
            a = assistant(fresh=cur is not None and bool(cur["content"] or cur.get("tool_calls")))
            a["reasoning_content"] = a.get("reasoning_content", "") + text
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str) or not name or not isinstance(args, str):
                raise _bad(f"'{where}' must have a string call_id, name and arguments", where, "invalid_type")
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:
                raise _bad(f"'{where}.arguments' is not valid JSON", f"{where}.arguments") from None
            assistant(fresh=False).setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"'{where}.call_id' must be a string", f"{where}.call_id", "invalid_type")
            cur = None
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output", ""),
                                                                               f"{where}.output")})
        else:
            raise _bad(f"'{where}' is an item of type {kind!r}; supported: message, function_call, "
                       f"function_call_output, reasoning", f"{where}.type", "unsupported_item")
    return out


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools", "invalid_type")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}] has type {kind!r}; only function tools are supported", f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"tools[{i}] needs a 'name'", f"tools[{i}].name")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"'tools[{i}].parameters' must be a JSON schema object", f"tools[{i}].parameters",
                       "invalid_type")
        fn: dict[str, Any] = {"name": t["name"]}      # in the order clients write: templates render it as it is
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = params or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is None or isinstance(choice, str):
        return out, choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        names = [t["function"]["name"] for t in out]
        if choice.get("name") not in names:
            raise _bad(f"'tool_choice' names function {choice.get('name')!r}, which is not among the tools",
                       "tool_choice")
        return out, {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("'tool_choice' must be none, auto, required or {'type': 'function', 'name': ...}", "tool_choice")


def _format(body: dict[str, Any]) -> dict[str, Any] | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("'text' must be an object", "text", "invalid_type")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("'text.format.schema' must be a JSON schema object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise _bad("'text.format.type' must be text, json_object or json_schema", "text.format.type")


def _thinking(body: dict[str, Any]) -> bool | None:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _bad("'reasoning' must be an object", "reasoning", "invalid_type")
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort not in EFFORT_OFF + EFFORT_ON:
        raise _bad(f"'reasoning.effort' is {effort!r}; expected one of {', '.join(EFFORT_OFF + EFFORT_ON)}",
                   "reasoning.effort")
    return effort in EFFORT_ON


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean", key, "invalid_type")
    return v


def _not_found(rid: str) -> ApiError:
    return ApiError(f"No response found with id {rid!r}.", status=404, param="response_id", code="not_found")


def resolve_references(body: Any, store: ResponseStore) -> Any:
    """`body` with each `item_reference` input item replaced by the stored item it names (an input
    or output item of a stored response); a 400 for one that names none. Runs on the event loop,
    as the store is not shared with threads."""
    items = body.get("input") if isinstance(body, dict) else None
    if not isinstance(items, list) or not any(isinstance(i, dict) and i.get("type") == "item_reference"
                                              for i in items):
        return body
    resolved = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            target = store.item(item["id"]) if isinstance(item.get("id"), str) else None
            if target is None:
                raise _bad(f"'input[{i}]' references item {item.get('id')!r}, which no stored response holds",
                           f"input[{i}].id", "item_not_found")
            item = {k: v for k, v in target.items() if k != "status"}
        resolved.append(item)
    return {**body, "input": resolved}


def previous(body: Any, store: ResponseStore) -> StoredResponse | None:
    """The stored response a request continues (`previous_response_id`), None when it starts anew;
    a 400 when it names one that does not exist, was deleted, evicted, or never stored."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_body")
    prev_id = body.get("previous_response_id")
    if prev_id is None:
        return None
    prev = store.get(prev_id) if isinstance(prev_id, str) else None
    if prev is None:
        raise ApiError(f"Previous response with id {prev_id!r} not found.", param="previous_response_id",
                       code="previous_response_not_found")
    return prev


class ResponsesRequest:
    """A checked Responses request: the chat request it means and what the response echoes."""

    def __init__(self, body: Any, prev: StoredResponse | None = None):
        """`prev`: the stored response `previous_response_id` names (`previous` finds it)."""
        self.body = body
        prev_id = body.get("previous_response_id")
        if _flag(body, "background", False):
            raise _bad("'background' responses are not supported", "background", "unsupported_value")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions", "invalid_type")
        if body.get("input") is None:
            raise _bad("'input' is required", "input", "missing_required_parameter")
        #: the conversation without the instructions: the earlier one's, then this input's
        self.new_messages = input_messages(body["input"])
        self.conversation = (prev.conversation if prev is not None else []) + self.new_messages
        system = [{"role": "system", "content": instructions}] if instructions else []
        # an assistant message last is history: the answer is a new message (OpenAI's meaning)
        chat: dict[str, Any] = {"messages": system + self.conversation, "continue_final_message": False}
        chat["tools"], choice = _tools(body)
        if choice is not None:
            chat["tool_choice"] = choice
        rf = _format(body)
        if rf is not None:
            chat["response_format"] = rf
        thinking = _thinking(body)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
        chat["chat_template_kwargs"] = kwargs if thinking is None else {**kwargs, "enable_thinking": thinking}
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        for key in SAMPLING_EXTRAS:
            if body.get(key) is not None:
                chat[key] = body[key]
        chat["stream"] = _flag(body, "stream", False)
        if isinstance(body.get("model"), str):
            chat["model"] = body["model"]
        try:
            self.chat: ChatRequest = parse_chat(chat)
        except ApiError as e:           # name the Responses field
            if e.param == "max_tokens":
                e.param, e.message = "max_output_tokens", e.message.replace("'max_tokens'", "'max_output_tokens'")
            raise
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
            raise _bad("'metadata' must be an object", "metadata", "invalid_type")
        self.store = _flag(body, "store", True)
        self.parallel_tool_calls = _flag(body, "parallel_tool_calls", True)
        self.previous_response_id = prev_id
        self.effort = (body.get("reasoning") or {}).get("effort")

    def echo(self) -> dict[str, Any]:
        """The request's fields as a response object repeats them."""
        b, s = self.body, self.chat.sampling
        return {"instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "metadata": b.get("metadata") or {}, "parallel_tool_calls": self.parallel_tool_calls,
                "previous_response_id": self.previous_response_id,
                "reasoning": {"effort": self.effort, "summary": None}, "store": self.store,
                "temperature": s.temperature, "text": b.get("text") or {"format": {"type": "text"}},
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [], "top_p": s.top_p,
                "truncation": "disabled", "user": b.get("user"), "background": False}


# --------------------------------------------------------------------------------------------- responses
def _item(b: Block, item_id: str, status: str = "completed") -> dict[str, Any]:
    """Block -> output item (filled as far as the block is)."""
    if b.kind == THINKING:
        return {"id": item_id, "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": b.text}] if status == "completed" else [],
                "status": status}
    if b.kind == TEXT:
        content = [_text_part(b.text)] if status == "completed" else []
        return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}
    return {"id": item_id, "type": "function_call", "call_id": b.call["id"], "name": b.call["function"]["name"],
            "arguments": b.text if status == "completed" else "", "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


_ID_PREFIX = {THINKING: "rs_", TEXT: "msg_"}


def _new_item_id(b: Block) -> str:
    return _ID_PREFIX.get(b.kind, "fc_") + secrets.token_hex(12)


#: ids of the input items a request sends without one, by type (the output items' prefixes)
_INPUT_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "reasoning": "rs_"}


def listed_input(items: Any) -> list[dict[str, Any]]:
    """A request's `input` (checked by `input_messages`) as `GET /v1/responses/{id}/input_items`
    lists it back: items with their type, an id (theirs, or a new one), status, and a message's
    text as a content part (`input_text`; an assistant's `output_text`)."""
    out = []
    for item in ([{"role": "user", "content": items}] if isinstance(items, str) else items):
        kind = item.get("type", "message")
        obj = {"id": _INPUT_ID_PREFIX.get(kind, "item_") + secrets.token_hex(12), **item, "type": kind,
               "status": "completed"}
        if kind == "message" and isinstance(item.get("content"), str):
            obj["content"] = [_text_part(item["content"]) if item["role"] == "assistant"
                              else {"type": "input_text", "text": item["content"]}]
        out.append(obj)
    return out


def _usage(r: dict[str, Any], end: Ending) -> dict[str, Any]:
    return {"input_tokens": r["n_prompt"], "input_tokens_details": {"cached_tokens": r["n_cached"]},
            "output_tokens": r["n_generated"], "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
            "total_tokens": r["n_prompt"] + r["n_generated"]}


def assistant_message(blocks: list[Block]) -> dict[str, Any]:
    """The answer as the chat message a follow-up's conversation holds (what `input_messages` makes
    of the output items sent back)."""
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if b.kind == TEXT)}
    reasoning = "".join(b.text for b in blocks if b.kind == THINKING)
    if reasoning:
        msg["reasoning_content"] = reasoning
    calls = [{"id": b.call["id"], "type": "function", "function": {"name": b.call["function"]["name"],
                                                                   "arguments": json.loads(b.text)}}
             for b in blocks if b.kind not in (TEXT, THINKING)]
    if calls:
        msg["tool_calls"] = calls
    return msg


class _Answer:
    """One response being made: its id, item ids and the response object at each stage.

    Every response object repeats the request's fields (`ResponsesRequest.echo`: its tools and
    instructions), which are serialized once (`to_json`): an agent's 16 tools take 100 us a dump,
    and a stream sends the object three times."""

    def __init__(self, rr: ResponsesRequest, model: str):
        self.rr, self.model = rr, model
        self.id = "resp_" + secrets.token_hex(16)
        self.created = int(time.time())
        self.item_ids: dict[int, str] = {}
        self.splitter = BlockSplitter(None if rr.parallel_tool_calls else 1)
        self.echo = rr.echo()
        self._echo_json = json.dumps(self.echo)[1:-1]      # its members, without the braces

    def item_id(self, b: Block) -> str:
        if b.index not in self.item_ids:
            self.item_ids[b.index] = _new_item_id(b)
        return self.item_ids[b.index]

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
                "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
                "model": self.model, "output": output, "usage": usage, **self.echo}

    def to_json(self, response: dict[str, Any]) -> str:
        """One of this answer's response objects as JSON (what json.dumps writes), the request's
        fields spliced in as serialized once."""
        own = {k: v for k, v in response.items() if k not in self.echo}
        return json.dumps(own)[:-1] + ", " + self._echo_json + "}"

    def close(self) -> list[Step]:
        """The answer ended: close its last block; an empty answer is one empty message."""
        steps = self.splitter.close()
        if not self.splitter.blocks:
            b = Block(0, TEXT)
            self.splitter.blocks.append(b)
            steps = [Step("open", b), Step("close", b)]
        return steps

    def finished(self, tokenizer: Any, reason: str, result: dict[str, Any]) -> dict[str, Any]:
        blocks = self.splitter.blocks
        end = Ending.of(tokenizer, self.rr.chat, reason, result, any(b.kind == THINKING for b in blocks))
        output = [_item(b, self.item_id(b)) for b in blocks]
        incomplete = "max_output_tokens" if reason == "length" else None
        return self.response("incomplete" if incomplete else "completed", output, _usage(result, end),
                             incomplete=incomplete)

    def keep(self, store: ResponseStore, response: dict[str, Any], text: str) -> None:
        """Store the finished `response` (`text`: its JSON) when the request asks to."""
        if self.rr.store:
            answer = assistant_message(self.splitter.blocks)
            store.put(response, self.rr.conversation + [answer], self.rr.new_messages + [answer], len(text),
                      listed_input(self.rr.body["input"]))


# --------------------------------------------------------------------------------------------- routes
def responses_routes(state: Any, store: ResponseStore | None = None) -> list[Route]:
    """The routes of /v1/responses on the server's `state`, keeping responses in `store`."""
    from deltarun.apps.serve.relay import read_json

    responses = store if store is not None else ResponseStore()

    async def create(request: Request) -> Response:
        body = await read_json(request, state.max_body)
        prev = previous(body, responses)          # on the event loop: the store is not shared with threads
        body = resolve_references(body, responses)
        rr, params, relay = await submit_chat(state, lambda: ResponsesRequest(body, prev), lambda r: r.chat)
        answer = _Answer(rr, rr.chat.model or state.model_name)
        tokenizer = state.builder.tokenizer
        if rr.chat.stream:
            return EventSourceResponse(_stream(relay, answer, tokenizer), shutdown_grace_period=5.0,
                                       headers={"Cache-Control": "no-cache"})
        async for ev in relay.events(request):
            if ev.error is not None:
                return JSONResponse(ev.error.body(), status_code=ev.error.status, headers=ev.error.headers)
            if ev.delta is not None:
                answer.splitter.push(ev.delta)
            if ev.finish_reason is not None:
                answer.close()
                out = answer.finished(tokenizer, ev.finish_reason, ev.result)
                text = answer.to_json(out)
                answer.keep(responses, out, text)
                return Response(text, media_type="application/json")
        return Response(status_code=499)     # the client went away

    async def _stream(relay: Any, answer: _Answer, tokenizer: Any) -> AsyncIterator[bytes]:
        seq = 0

        def event(data: dict[str, Any], response: str | None = None) -> bytes:
            """One event; `response`, a response object's JSON (`to_json`), goes in as its "response"."""
            nonlocal seq
            data["sequence_number"] = seq
            seq += 1
            text = json.dumps(data)
            if response is not None:
                text = text[:-1] + ', "response": ' + response + "}"
            return b"event: " + data["type"].encode() + b"\r\ndata: " + text.encode() + b"\r\n\r\n"

        start = answer.to_json(answer.response("in_progress", []))
        yield event({"type": "response.created"}, start) + event({"type": "response.in_progress"}, start)
        async for ev in relay.events():     # the events of each worker event go out in one write
            if ev.error is not None:
                err = {"code": ev.error.code or ev.error.type, "message": ev.error.message}
                yield event({"type": "error", **err, "param": ev.error.param}) \
                    + event({"type": "response.failed"}, answer.to_json(answer.response("failed", [], error=err)))
                return
            steps = answer.splitter.push(ev.delta) if ev.delta is not None else []
            if ev.finish_reason is not None:
                steps += answer.close()
            chunk = b"".join(event(data) for s in steps for data in _step_events(answer, s))
            if ev.finish_reason is not None:
                out = answer.finished(tokenizer, ev.finish_reason, ev.result)
                text = answer.to_json(out)
                answer.keep(responses, out, text)
                kind = "response.incomplete" if out["status"] == "incomplete" else "response.completed"
                chunk += event({"type": kind}, text)
            if chunk:
                yield chunk

    def stored(rid: str) -> StoredResponse:
        e = responses.get(rid)
        if e is None:
            raise _not_found(rid)
        return e

    async def get(request: Request) -> Response:
        return JSONResponse(stored(request.path_params["response_id"]).response)

    async def input_items(request: Request) -> Response:
        """The stored response's input items, a page at a time (`limit` 1-100, default 20; `order`
        desc, the default, or asc; `after`: the id of the item the page starts after)."""
        e = stored(request.path_params["response_id"])
        q = request.query_params
        limit = q.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise _bad(f"'limit' is {limit!r}; expected an integer from 1 to 100", "limit", "invalid_value")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise _bad(f"'order' is {order!r}; expected asc or desc", "order", "invalid_value")
        items = e.input_items if order == "asc" else e.input_items[::-1]
        after = q.get("after")
        if after is not None:
            at = next((i for i, it in enumerate(items) if it["id"] == after), None)
            if at is None:
                raise _bad(f"'after' names no input item of this response: {after!r}", "after", "invalid_value")
            items = items[at + 1:]
        page = items[:int(limit)]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})

    async def delete(request: Request) -> Response:
        rid = request.path_params["response_id"]
        if not responses.delete(rid):
            raise _not_found(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{response_id}", get, methods=["GET"]),
            Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete, methods=["DELETE"])]


def _step_events(answer: _Answer, s: Step) -> list[dict[str, Any]]:
    """The stream events of one block step."""
    b, iid = s.block, answer.item_id(s.block)
    at = {"item_id": iid, "output_index": b.index}
    if b.kind == THINKING:
        part, delta_type, done_type = _reasoning_part, "response.reasoning_text.delta", "response.reasoning_text.done"
    elif b.kind == TEXT:
        part, delta_type, done_type = _text_part, "response.output_text.delta", "response.output_text.done"
    else:
        part = None
    if s.what == "open":
        out = [{"type": "response.output_item.added", "output_index": b.index, "item": _item(b, iid, "in_progress")}]
        if part is not None:
            out.append({"type": "response.content_part.added", **at, "content_index": 0, "part": part("")})
        return out
    if s.what == "delta":
        if part is None:
            return [{"type": "response.function_call_arguments.delta", **at, "delta": s.piece}]
        extra = {"logprobs": []} if b.kind == TEXT else {}
        return [{"type": delta_type, **at, "content_index": 0, "delta": s.piece, **extra}]
    if part is None:
        done = [{"type": "response.function_call_arguments.done", **at, "name": b.call["function"]["name"],
                 "arguments": b.text}]
    else:
        extra = {"logprobs": []} if b.kind == TEXT else {}
        done = [{"type": done_type, **at, "content_index": 0, "text": b.text, **extra},
                {"type": "response.content_part.done", **at, "content_index": 0, "part": part(b.text)}]
    return done + [{"type": "response.output_item.done", "output_index": b.index, "item": _item(b, iid)}]
