"""Generated tokens -> OpenAI message deltas: text, stop strings, reasoning and tool calls.

The worker pushes every sampled token into an `OutputStream`; it returns the `Delta` that can be
sent now. Text is held back only while it may still turn into something else: the start of a stop
string, of a `<think>`/`</think>` tag, or of a `<tool_call>` block.

Tool calls are parsed in the two forms Qwen models write:

- Qwen3 / Qwen3-Next (JSON): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`
- Qwen3-Coder / Qwen3.5 (XML): `<tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`

A block that parses in neither form is passed on as content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

from deltarun.apps.chat import THINK_CLOSE, THINK_OPEN, StopMatcher, ThinkingSplitter, partial_suffix
from deltarun.base.tokenizer import StreamDecoder

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.S)


@dataclass
class Delta:
    """What a step adds to the answer."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def add(self, other: "Delta") -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _xml_value(text: str) -> Any:
    """A parameter value: JSON when it parses (numbers, objects, true), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_tool_call(body: str) -> dict[str, Any] | None:
    """{"name", "arguments" (a JSON string)} from the text between the tool-call tags, or None."""
    body = body.strip()
    if body.startswith("<function="):
        m = _XML_FUNCTION.match(body)
        if not m:
            return None
        args = {name: _xml_value(value) for name, value in _XML_PARAMETER.findall(m.group(2))}
        return {"name": m.group(1), "arguments": json.dumps(args, ensure_ascii=False)}
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return {"name": obj["name"], "arguments": args}
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split a whole answer into content and OpenAI tool calls (non-streaming use, tests)."""
    stream = ToolCallStream()
    d = stream.push(text)
    d.add(stream.flush())
    return d.content, d.tool_calls


class ToolCallStream:
    """Content text in, content and complete tool calls out; `<tool_call>` blocks are buffered."""

    def __init__(self) -> None:
        self.pending = ""
        self.inside = False
        self.n_calls = 0

    def _call(self, body: str) -> Delta:
        call = parse_tool_call(body)
        if call is None:
            return Delta(content=TOOL_OPEN + body + TOOL_CLOSE)
        index, self.n_calls = self.n_calls, self.n_calls + 1
        return Delta(tool_calls=[{"index": index, "id": new_call_id(), "type": "function", "function": call}])

    def push(self, text: str) -> Delta:
        out = Delta()
        buf = self.pending + text
        while True:
            if self.inside:
                i = buf.find(TOOL_CLOSE)
                if i < 0:
                    self.pending = buf
                    return out
                out.add(self._call(buf[:i]))
                buf = buf[i + len(TOOL_CLOSE):]
                self.inside = False
            else:
                i = buf.find(TOOL_OPEN)
                if i < 0:
                    hold = partial_suffix(buf, [TOOL_OPEN])
                    out.content += buf[:len(buf) - hold]
                    self.pending = buf[len(buf) - hold:]
                    return out
                out.content += buf[:i]
                buf = buf[i + len(TOOL_OPEN):]
                self.inside = True

    def flush(self) -> Delta:
        """The end of the answer: an unterminated block is parsed as it is (the model ran out of tokens)."""
        buf, self.pending = self.pending, ""
        if not self.inside:
            return Delta(content=buf)
        self.inside = False
        call = parse_tool_call(buf)
        if call is None:
            return Delta(content=TOOL_OPEN + buf)
        return self._call(buf)


class OutputStream:
    """Tokens in, deltas out: UTF-8 assembly, stop strings, then reasoning and tool-call parsing."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), *, reasoning: bool = False,
                 starts_thinking: bool = False, tools: bool = False):
        self.decoder = StreamDecoder(tokenizer)
        self.stopper = StopMatcher(stops)
        self.thinking = ThinkingSplitter(starts_thinking) if reasoning else None
        self.tools = ToolCallStream() if tools else None
        self.text = ""                 # the generated text, up to a stop string
        self.content = ""              # the answer's content as the client receives it (no reasoning)
        self._content_started = False
        self._saw_reasoning = False
        self.n_tool_calls = 0

    @property
    def stopped(self) -> bool:
        """A stop string appeared: generation ends here."""
        return self.stopper.hit is not None

    def push(self, token: int) -> Delta:
        return self._text(self.stopper.push(self.decoder.push(token)))

    def flush(self) -> Delta:
        d = self._text(self.stopper.push(self.decoder.flush()) + self.stopper.flush())
        if self.thinking is not None:
            d.add(self._split(self.thinking.flush()))
        if self.tools is not None:
            d.add(self._tools(self.tools.flush()))
        return d

    def _text(self, text: str) -> Delta:
        self.text += text
        if not text:
            return Delta()
        if self.thinking is None:
            return self._content(text)
        return self._split(self.thinking.push(text))

    def _split(self, parts: list[tuple[bool, str]]) -> Delta:
        d = Delta()
        for is_thinking, piece in parts:
            if is_thinking:
                piece = piece.replace(THINK_OPEN, "").replace(THINK_CLOSE, "")
                if not self._saw_reasoning:
                    piece = piece.lstrip("\n")
                self._saw_reasoning = self._saw_reasoning or bool(piece)
                d.reasoning += piece
            else:
                d.add(self._content(piece))
        return d

    def _content(self, text: str) -> Delta:
        if self.tools is not None:
            return self._tools(self.tools.push(text))
        return self._lead(Delta(content=text))

    def _tools(self, d: Delta) -> Delta:
        self.n_tool_calls += len(d.tool_calls)
        return self._lead(d)

    def _lead(self, d: Delta) -> Delta:
        """Drop the blank lines between a think block and the answer (as llama-server does)."""
        if not self._content_started and d.content:
            if self._saw_reasoning or (self.thinking is not None and self.thinking.thinking is False
                                       and THINK_CLOSE in self.text):
                d.content = d.content.lstrip("\n")
            self._content_started = bool(d.content)
        self.content += d.content
        return d
