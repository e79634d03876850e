"""OpenAI request bodies in, checked values out; OpenAI response objects out.

Every field a request may carry is checked here, before anything reaches the model: a wrong type
or range is an `ApiError` (HTTP 400 with OpenAI's `{"error": {"message", "type", "param",
"code"}}`) naming the field. Unknown fields are ignored, as OpenAI's and llama-server's servers do
(clients send extras). The shapes of the responses follow OpenAI's API reference; `timings` and
`/props`-style extras follow llama-server.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import regex

from deltarun.runner.sampling import MAX_REPEAT_PENALTY, MIN_REPEAT_PENALTY, SamplingParams

_DEFAULTS = SamplingParams()
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
#: choices one request may ask for (`n`): each is a job of its own, sharing the prompt's evaluation
MAX_CHOICES = 16
#: Values (each `,`, `[` and `{` outside strings counts one) and object keys (`:`) a request body may
#: hold. `json.loads` holds the GIL while it scans, so a body full of tiny values would stall the
#: event loop for all of its parsing: with numbers and objects parsed through Python hooks (points
#: where other threads get the GIL), what is left in one C stretch is about 120 ns a value and 1 us
#: a key of one object on a 2 GHz Xeon: within 50 ms. A prompt of token ids as long as the largest
#: context (262,144) still fits.
MAX_JSON_ITEMS = 300_000
MAX_JSON_KEYS = 1 << 15
#: Digits of a JSON number: Python's int() of a long one takes quadratic time (seeds and ids need 20).
MAX_NUMBER_DIGITS = 40
#: Nesting a request body may have: far more than any request or JSON schema needs, far less than
#: the recursion limit of the code that walks it later (templates, grammar compilation, hashing).
MAX_JSON_DEPTH = 64
#: Messages in one conversation, and tools, as OpenAI's API limits them.
MAX_MESSAGES = 2048
MAX_TOOLS = 128
#: `chat_template_kwargs` the server sets itself: the template's own variables, and the other
#: arguments of `ChatTemplate.render` (the kwargs are passed beside them: "images" or "self" would
#: be a second value for one argument)
TEMPLATE_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "images",
                               "self"})


class ApiError(Exception):
    """An error answered as JSON: status, OpenAI error type, the offending parameter, a code."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None, extra: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.extra = extra or {}
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}


#: (path prefix, error body) for the APIs whose errors are not OpenAI's shape, longest prefix first.
_ERROR_SHAPES: list[tuple[str, Callable[[ApiError], dict[str, Any]]]] = []


def register_error_shape(prefix: str, body: Callable[[ApiError], dict[str, Any]]) -> None:
    """Errors of requests under `prefix` (e.g. "/v1/messages") get `body(error)` instead of OpenAI's
    shape: the app's handlers and the request guard (host, origin, content type, size, time limits)
    render every error through `error_body`."""
    _ERROR_SHAPES[:] = sorted([(p, b) for p, b in _ERROR_SHAPES if p != prefix] + [(prefix, body)],
                              key=lambda pb: -len(pb[0]))


def error_body(e: ApiError, path: str = "") -> dict[str, Any]:
    """The JSON body of `e` in the shape of the API `path` belongs to (OpenAI's unless registered)."""
    for prefix, body in _ERROR_SHAPES:
        if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
            return body(e)
    return e.body()


# --------------------------------------------------------------------------------------------- bodies
_MAYBE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")     # a JSON escape of a UTF-16 surrogate
_SURROGATE = re.compile("[\\ud800-\\udfff]")
_STRINGS = regex.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"')     # JSON strings (possessive: no backtracking)


def parse_json_body(raw: bytes) -> Any:
    """A request body's JSON, refused with a 4xx before or instead of anything that would fail later:
    more than MAX_JSON_ITEMS values or MAX_JSON_KEYS keys (413, counted before parsing), text that is
    not UTF-8, numbers of more than MAX_NUMBER_DIGITS digits, NaN, Infinity and numbers beyond a
    double (not JSON: an answer echoing one could not be encoded), nesting deeper than MAX_JSON_DEPTH,
    and lone UTF-16 surrogates (`"\\ud800"`: Python strings may hold them, but no UTF-8 text
    can, so an answer echoing one could not be sent).

    CPU work (up to one body's worth): call it off the event loop."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(f"the request body is not UTF-8 text (byte {e.start})", code="invalid_json") from None
    values, keys = _counts(text)
    if values > MAX_JSON_ITEMS or keys > MAX_JSON_KEYS:
        what = f"{values} JSON values (at most {MAX_JSON_ITEMS})" if values > MAX_JSON_ITEMS else \
            f"{keys} JSON object keys (at most {MAX_JSON_KEYS})"
        raise ApiError(f"the request body holds {what}", status=413, code="body_too_large")
    try:
        body = json.loads(text, parse_int=_json_int, parse_float=_json_float, parse_constant=_json_constant,
                          object_pairs_hook=_json_object)
    except RecursionError:
        raise ApiError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json") \
            from None
    except ValueError as e:
        raise ApiError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    _check_structure(body, surrogates=_MAYBE_SURROGATE.search(text) is not None)
    return body


def _counts(text: str) -> tuple[int, int]:
    """(values, keys) of a JSON text: counted in the whole text (an upper bound) and, only when that
    is over a limit, outside its strings (text with many commas or colons is not refused)."""
    values, keys = text.count(",") + text.count("[") + text.count("{"), text.count(":")
    if values > MAX_JSON_ITEMS or keys > MAX_JSON_KEYS:
        bare = _STRINGS.sub('""', text, concurrent=True)     # releases the GIL while it scans
        values, keys = bare.count(",") + bare.count("[") + bare.count("{"), bare.count(":")
    return values, keys


def _json_int(digits: str) -> int:
    if len(digits) > MAX_NUMBER_DIGITS:
        raise ValueError(f"a number of {len(digits)} digits (at most {MAX_NUMBER_DIGITS})")
    return int(digits)


def strict_json(text: str) -> Any:
    """`json.loads` of JSON proper: NaN, Infinity and numbers beyond a double, which Python's json
    takes, are a ValueError like any other (a value holding one could not be sent as JSON)."""
    return json.loads(text, parse_float=_finite_float, parse_constant=_json_constant)


def _json_float(digits: str) -> float:
    if len(digits) > MAX_NUMBER_DIGITS:
        raise ValueError(f"a number of {len(digits)} characters (at most {MAX_NUMBER_DIGITS})")
    return _finite_float(digits)


def _finite_float(digits: str) -> float:
    value = float(digits)
    if not math.isfinite(value):
        raise ValueError(f"the number {digits} is beyond the range of a double")
    return value


def _json_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON value")


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def _check_structure(body: Any, surrogates: bool) -> None:
    """Depth (iteratively: the check must not recurse itself) and, when the text has a surrogate
    escape (a pair is fine: JSON writes an emoji that way), lone surrogates in keys and values."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")
        if isinstance(value, dict):
            if surrogates:
                _check_text(value.keys())
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, (dict, list)) or surrogates)
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)) or surrogates)
        elif isinstance(value, str) and surrogates:
            _check_text((value,))


def _check_text(texts: Any) -> None:
    for t in texts:
        if isinstance(t, str) and _SURROGATE.search(t):
            raise ApiError("the request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                           "which is not text", code="invalid_json")


# --------------------------------------------------------------------------------------------- checks
def _type_error(param: str, what: str) -> ApiError:
    return ApiError(f"'{param}' must be {what}", param=param, code="invalid_type")


def _number(body: dict, key: str, default: float | None, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _type_error(key, "a number")
    if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ApiError(f"'{key}' is {v}, outside {rng}", param=key, code="invalid_value")
    return float(v)


def _integer(body: dict, key: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _type_error(key, "an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(f"'{key}' is {v}, outside [{lo if lo is not None else '-inf'}, "
                       f"{hi if hi is not None else 'inf'}]", param=key, code="invalid_value")
    return v


def _boolean(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(key, "a boolean")
    return v


def _object(body: dict, key: str) -> dict | None:
    v = body.get(key)
    if v is not None and not isinstance(v, dict):
        raise _type_error(key, "an object")
    return v


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _type_error("stop", "a string or a list of strings")
    if len(v) > MAX_STOPS:
        raise ApiError(f"'stop' has {len(v)} strings; at most {MAX_STOPS}", param="stop", code="invalid_value")
    return [s for s in v if s]


# --------------------------------------------------------------------------------------------- requests
@dataclass
class SamplingRequest:
    """The fields /v1/chat/completions and /v1/completions share."""

    max_tokens: int | None = None
    sampling: SamplingParams = _DEFAULTS
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stops: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    n: int = 1                           # choices (each a job; see worker.GenParams.group)


@dataclass
class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    response_format: dict[str, Any] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: tokens the answer may think for before the template's end-of-thinking marker is forced
    #: (llama-server's `reasoning_budget_tokens`; None, also for -1: `serve --reasoning-budget`)
    reasoning_budget: int | None = None
    #: the messages' images by digest, once prepared (`serve.images.prepare_images`)
    images: dict[str, Any] = field(default_factory=dict)
    #: the answer continues the final assistant message (`continue_final_message`, as vLLM's and
    #: llama-server's); None: when the messages end with one and the server prefills
    #: (`serve --prefill-assistant`, `PromptBuilder.continues`)
    continue_final: bool | None = None


@dataclass
class CompletionRequest(SamplingRequest):
    prompt: str | list[int] = ""
    echo: bool = False
    #: tokens generated when the request names no max_tokens: OpenAI's legacy 16; None: until the
    #: end of generation or the context (llama-server's own endpoints, whose n_predict is -1)
    default_max_tokens: int | None = 16


def _sampling_fields(body: dict, req: SamplingRequest, logprobs_is_int: bool = False, least_tokens: int = 1) -> None:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_body")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string")
    req.model = model
    mt = _integer(body, "max_completion_tokens", None, lo=1)
    req.max_tokens = _integer(body, "max_tokens", mt, lo=least_tokens)
    n_predict = _integer(body, "n_predict", None, lo=-1)      # llama-server's name
    if req.max_tokens is None and n_predict is not None and n_predict > 0:
        req.max_tokens = n_predict
    req.n = _integer(body, "n", 1, lo=1, hi=MAX_CHOICES)
    temperature = _number(body, "temperature", _DEFAULTS.temperature, lo=0.0)
    seed = _integer(body, "seed", None)
    req.sampling = SamplingParams(
        temperature=temperature,
        top_k=_integer(body, "top_k", _DEFAULTS.top_k, lo=0),
        top_p=_number(body, "top_p", _DEFAULTS.top_p, lo=0.0, hi=1.0, lo_open=True),
        min_p=_number(body, "min_p", _DEFAULTS.min_p, lo=0.0, hi=1.0),
        repeat_penalty=_number(body, "repeat_penalty", _DEFAULTS.repeat_penalty, lo=MIN_REPEAT_PENALTY,
                               hi=MAX_REPEAT_PENALTY),
        repeat_last_n=_integer(body, "repeat_last_n", _DEFAULTS.repeat_last_n, lo=-1),
        seed=None if seed is None else seed % 2**63)
    req.presence_penalty = _number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0)
    req.frequency_penalty = _number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)
    bias = _object(body, "logit_bias") or {}
    req.logit_bias = {}
    for k, v in bias.items():
        if not (k.isascii() and k.isdigit() and len(k) <= MAX_NUMBER_DIGITS):
            raise ApiError(f"'logit_bias' key {k[:40]!r} is not a token id", param="logit_bias", code="invalid_value")
        tid = int(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise ApiError(f"'logit_bias' value for {k} must be a number in [-100, 100]", param="logit_bias",
                           code="invalid_value")
        req.logit_bias[tid] = float(v)
    req.stops = _stops(body)
    req.ignore_eos = _boolean(body, "ignore_eos", False)
    if logprobs_is_int:      # /v1/completions: logprobs is the number of alternatives
        k = _integer(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        req.logprobs, req.top_logprobs = k is not None, k or 0
    else:
        req.logprobs = _boolean(body, "logprobs", False)
        req.top_logprobs = _integer(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
        if req.top_logprobs and not req.logprobs:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    req.stream = _boolean(body, "stream", False)
    opts = _object(body, "stream_options") or {}
    req.include_usage = _boolean(opts, "include_usage", False) if req.stream else False


def prompt_chars(req: SamplingRequest) -> int:
    """Characters of text a request's prompt is made of (messages, or a completion's prompt text): what
    it costs to render and tokenize, known before doing either."""
    if isinstance(req, CompletionRequest):
        return len(req.prompt) if isinstance(req.prompt, str) else 0
    n = 0
    for m in getattr(req, "messages", ()):
        content = m.get("content") or ""
        n += (len(content) if isinstance(content, str) else sum(len(p.get("text", "")) for p in content)) \
            + len(m.get("reasoning_content") or "")
        for call in m.get("tool_calls") or ():
            n += len(json.dumps(call["function"]["arguments"]))
    return n


def check_token_ids(req: SamplingRequest, n_vocab: int) -> None:
    """What needs the model to check: `logit_bias` keys are token ids of its vocabulary (OpenAI
    answers 400 for others too)."""
    bad = next((t for t in req.logit_bias if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise ApiError(f"'logit_bias' names token id {bad}, outside the vocabulary (0..{n_vocab - 1})",
                       param="logit_bias", code="invalid_value")


def _message_content(content: Any, where: str, images: bool) -> str | list[dict[str, Any]] | None:
    """Content of a message: a string, the text parts of a list joined, or, when the list holds
    images (`images`: a user message), its parts in order: text parts and image parts
    `{"type": "image", "data": bytes, "param": where}` (`serve.images` prepares them). The other
    APIs' translations hand their images over in that form (bytes: no JSON body can hold one)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _type_error(f"{where}.content", "a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        p = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _type_error(p, "an object with a 'type'")
        kind = part["type"]
        if kind in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise _type_error(f"{p}.text", "a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image_url", "input_image") or (kind == "image" and isinstance(part.get("data"), bytes)):
            if not images:
                raise ApiError(f"{p} is an image: images are accepted in user messages only", param=p,
                               code="unsupported_content")
            if kind == "image":            # decoded already, by the Messages or Responses translation
                parts.append({"type": "image", "data": part["data"], "param": part.get("param", p)})
                continue
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            parts.append({"type": "image", "data": data_url_bytes(url, f"{p}.image_url"), "param": p})
        else:
            raise ApiError(f"{p} has type {kind!r}; only text and image_url parts are supported", param=p,
                           code="unsupported_content")
    if any(q["type"] == "image" for q in parts):
        return parts
    return "".join(q["text"] for q in parts)


#: media types a data: URL may name (Pillow decides from the bytes; the type is checked as a courtesy)
IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")


def data_url_bytes(url: Any, where: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL; http(s) and other URLs are refused (the
    server downloads nothing)."""
    if not isinstance(url, str):
        raise _type_error(where, "a data: URL string (or an object with 'url')")
    head, comma, payload = url.partition(",")
    if not head.lower().startswith("data:"):
        raise ApiError(f"{where} is not a data: URL ({url[:40]!r}...): only data: URLs are accepted, the server "
                       f"downloads nothing", param=where, code="invalid_image_url")
    media, *options = head[5:].split(";")
    if not comma or "base64" not in (o.lower() for o in options):
        raise ApiError(f"{where}: a data: URL must be base64 ('data:image/png;base64,...')", param=where,
                       code="invalid_image_url")
    return base64_image(media, payload, where)


def base64_image(media_type: Any, payload: Any, where: str) -> bytes:
    """The bytes of a base64-encoded image of `media_type` (a data: URL's, or an Anthropic image
    block's source), or one 400."""
    if not isinstance(media_type, str) or media_type.lower() not in IMAGE_MEDIA_TYPES:
        raise ApiError(f"{where}: media type {str(media_type)[:40]!r} is not an image deltarun reads (PNG, JPEG, "
                       f"WebP, GIF)", param=where, code="invalid_image_url")
    try:
        if not isinstance(payload, str):
            raise ValueError("not a string")
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(f"{where}: the image data is not valid base64", param=where, code="invalid_image_url") from None


def _messages(body: dict) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list", param="messages", code="invalid_value")
    if len(msgs) > MAX_MESSAGES:
        raise ApiError(f"'messages' has {len(msgs)} messages; at most {MAX_MESSAGES}", param="messages",
                       code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(f"{where}.role is {role!r}; expected one of {', '.join(ROLES)}", param=f"{where}.role",
                           code="invalid_value")
        msg = dict(m)
        msg["role"] = "system" if role == "developer" else role
        text = _message_content(m.get("content"), where, images=role == "user")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise _type_error(f"{where}.tool_calls", "a list on an assistant message")
            msg["tool_calls"] = [_history_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if text is None and not calls:
            raise ApiError(f"{where} has no content", param=f"{where}.content", code="invalid_value")
        msg["content"] = text or ""
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise _type_error(f"{where}.reasoning_content", "a string")
        out.append(msg)
    return out


def _history_tool_call(call: Any, where: str) -> dict[str, Any]:
    import json

    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _type_error(f"{where}.function", "an object with a 'name'")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):      # templates write arguments as an object
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ApiError(f"{where}.function.arguments is not JSON", param=f"{where}.function.arguments",
                           code="invalid_value") from None
    return {**call, "function": {"name": fn["name"], "arguments": args}}


def _tools(body: dict) -> tuple[list[dict[str, Any]], str | dict[str, Any]]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _type_error("tools", "a list")
    if len(tools) > MAX_TOOLS:
        raise ApiError(f"'tools' has {len(tools)} tools; at most {MAX_TOOLS}", param="tools", code="invalid_value")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                           param=f"tools[{i}]", code="invalid_value")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _type_error(f"tools[{i}].function.parameters", "a JSON schema object")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ApiError(f"'tool_choice' is {choice!r}; expected none, auto, required or a function",
                           param="tool_choice", code="invalid_value")
        if choice == "required" and not tools:
            raise ApiError("'tool_choice' is required but no tools are given", param="tool_choice",
                           code="invalid_value")
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if name not in [t["function"]["name"] for t in tools]:
            raise ApiError(f"'tool_choice' names function {name!r}, which is not among the tools",
                           param="tool_choice", code="invalid_value")
    else:
        raise _type_error("tool_choice", "a string or an object")
    return tools, choice


def _response_format(body: dict) -> dict[str, Any] | None:
    rf = _object(body, "response_format")
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"schema": None}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ApiError("'response_format.json_schema.schema' must be a JSON schema object",
                           param="response_format.json_schema.schema", code="invalid_value")
        return {"schema": schema}
    raise ApiError(f"'response_format.type' is {kind!r}; expected text, json_object or json_schema",
                   param="response_format.type", code="invalid_value")


def parse_chat(body: Any) -> ChatRequest:
    req = ChatRequest()
    _sampling_fields(body, req)
    req.messages = _messages(body)
    if body.get("continue_final_message") is not None:
        req.continue_final = _boolean(body, "continue_final_message", False)
    if req.continue_final and req.messages[-1]["role"] != "assistant":
        raise ApiError("'continue_final_message' is true but the last message is not the assistant's",
                       param="continue_final_message", code="invalid_value")
    req.tools, req.tool_choice = _tools(body)
    req.response_format = _response_format(body)
    if req.response_format is not None and req.tool_choice not in ("none", "auto"):
        raise ApiError("'response_format' and a forced 'tool_choice' cannot be combined", param="response_format",
                       code="invalid_value")
    kwargs = _object(body, "chat_template_kwargs") or {}
    reserved = TEMPLATE_RESERVED & set(kwargs)
    if reserved:
        raise ApiError(f"'chat_template_kwargs' may not set {', '.join(sorted(reserved))}",
                       param="chat_template_kwargs", code="invalid_value")
    req.template_kwargs = dict(kwargs)
    budget = _integer(body, "reasoning_budget_tokens", -1, lo=-1)      # llama-server's field; -1: no limit
    req.reasoning_budget = budget if budget >= 0 else None
    return req


def parse_completion(body: Any) -> CompletionRequest:
    req = CompletionRequest()
    # max_tokens 0 (as OpenAI's legacy completions): the prompt alone, with echo and logprobs
    # its tokens' logprobs (lm-evaluation-harness scores continuations so)
    _sampling_fields(body, req, logprobs_is_int=True, least_tokens=0)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("'prompt' is empty", param="prompt", code="invalid_value")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass
    else:
        raise _type_error("prompt", "a non-empty string or list of token ids (one prompt)")
    req.prompt = prompt
    req.echo = _boolean(body, "echo", False)
    return req


@dataclass
class InfillRequest(CompletionRequest):
    """llama-server's `/infill`: the code between `input_prefix` and `input_suffix`, with other
    files' snippets (`input_extra`) as context; `fim_prompt` (its `prompt`) continues the prefix."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[tuple[str, str]] = field(default_factory=list)     # (file name, text)
    fim_prompt: str = ""


def parse_llama_server_completion(body: Any) -> CompletionRequest:
    """llama-server's own `/completion`: /v1/completions' fields, one answer, until the end of
    generation when it names no n_predict."""
    req = parse_completion(body)
    _llama_server_fields(req)
    return req


def _llama_server_fields(req: CompletionRequest) -> None:
    """What llama-server's own endpoints answer: once, until the end without n_predict."""
    if req.n != 1:
        raise ApiError("'n' must be 1 here (llama-server's own endpoints answer once)", param="n",
                       code="invalid_value")
    req.default_max_tokens = None


def parse_infill(body: Any) -> InfillRequest:
    req = InfillRequest()
    _sampling_fields(body, req)
    _llama_server_fields(req)
    for key in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(key), str):
            raise ApiError(f"'{key}' is required: a string", param=key, code="invalid_value")
        setattr(req, key, body[key])
    if body.get("prompt") is not None and not isinstance(body["prompt"], str):
        raise _type_error("prompt", "a string")
    req.fim_prompt = body.get("prompt") or ""
    extra = body.get("input_extra") or []
    if not isinstance(extra, list):
        raise _type_error("input_extra", 'a list of {"filename": string, "text": string}')
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str) \
                or not isinstance(chunk.get("filename", ""), str):
            raise _type_error(f"input_extra[{i}]", 'an object {"filename": string, "text": string}')
        req.input_extra.append((chunk.get("filename", "tmp"), chunk["text"]))
    return req


# --------------------------------------------------------------------------------------------- responses
def usage(n_prompt: int, n_cached: int, n_generated: int) -> dict[str, Any]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_generated, "total_tokens": n_prompt + n_generated,
            "prompt_tokens_details": {"cached_tokens": n_cached}}


def timings(n_cached: int, n_evaluated: int, prompt_s: float, n_generated: int, generate_s: float) -> dict[str, Any]:
    """llama-server's `timings` object."""
    def per(n: int, s: float) -> tuple[float, float]:
        return (1e3 * s / n if n else 0.0, n / s if s > 0 else 0.0)

    p_tok, p_tps = per(n_evaluated, prompt_s)
    g_tok, g_tps = per(n_generated, generate_s)
    return {"cache_n": n_cached, "prompt_n": n_evaluated, "prompt_ms": 1e3 * prompt_s, "prompt_per_token_ms": p_tok,
            "prompt_per_second": p_tps, "predicted_n": n_generated, "predicted_ms": 1e3 * generate_s,
            "predicted_per_token_ms": g_tok, "predicted_per_second": g_tps}


def chat_message(content: str, reasoning: str, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not tool_calls) else None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in tool_calls]
    return msg


def envelope(obj_type: str, cid: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": cid, "object": obj_type, "created": int(created or time.time()), "model": model,
            "system_fingerprint": "deltarun"}


def chat_delta(delta: Any, first: bool) -> dict[str, Any]:
    """The `delta` of a chat.completion.chunk from an output `Delta`."""
    d: dict[str, Any] = {}
    if first:
        d["role"] = "assistant"
    if delta.reasoning:
        d["reasoning_content"] = delta.reasoning
    if delta.content or (first and not delta.tool_calls and not delta.reasoning):
        d["content"] = delta.content
    if delta.tool_calls:
        d["tool_calls"] = delta.tool_calls
    return d
