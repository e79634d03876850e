"""Generated tokens -> OpenAI message deltas: text, stop strings, reasoning and tool calls.

The worker pushes every sampled token into an `OutputStream`; it returns the `Delta` that can be
sent now. Text is held back only while it may still turn into something else: the start of a stop
string, of a `<think>`/`</think>` tag, or of a `<tool_call>` block.

Tool calls are parsed in the format of the model's chat template (`tool_format_of`): the two
forms Qwen models write,

- Qwen3 / Qwen3-Next (JSON): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`
- Qwen3-Coder / Qwen3.5 (XML): `<tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`

or Kimi's (Kimi-K2, Kimi-Linear), one section of calls, each with its id `functions.NAME:INDEX`:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|>...<|tool_calls_section_end|>

read as llama.cpp reads it (common/parsers/kimi-k2.cpp): the section markers may be missing (a
call may open with `<|tool_call_begin|>` and the answer end without the section's end), the id must
be `functions.<name>:<digits>`, the arguments a JSON object. The call keeps the model's id (the
Kimi templates write `tool_call['id']` back and head the tool's answer with `## Return of <id>`,
so the next turn's prompt shows the model its own ids) and its arguments as written.

A block that does not parse is passed on as content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from deltarun.apps.chat import THINK_CLOSE, THINK_OPEN, StopMatcher, ThinkingSplitter, partial_suffix
from deltarun.apps.serve.protocol import strict_json
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
    """A parameter value: JSON when it parses (numbers, objects, true), else the text itself (so
    `NaN` is the string "NaN")."""
    try:
        return strict_json(text)
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
        obj = strict_json(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            strict_json(args)
        except ValueError:
            return None
        return {"name": obj["name"], "arguments": args}
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


KIMI_SECTION_OPEN, KIMI_SECTION_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_OPEN, KIMI_ARGS, KIMI_CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_KIMI_ID = re.compile(r"functions\.(.+):\d+", re.S)


def parse_kimi_tool_calls(block: str) -> list[dict[str, Any]] | None:
    """[{"id", "name", "arguments"}] from one Kimi tool-call section (its opening marker included,
    its closing one not), or None when any of it is not a call (see the module)."""
    body = block.strip()
    if body.startswith(KIMI_SECTION_OPEN):
        body = body[len(KIMI_SECTION_OPEN):].lstrip()
    calls: list[dict[str, Any]] = []
    while body:
        if not body.startswith(KIMI_CALL_OPEN):
            return None
        end = body.find(KIMI_CALL_CLOSE)
        nxt = body.find(KIMI_CALL_OPEN, len(KIMI_CALL_OPEN))
        stop = min((i for i in (end, nxt) if i >= 0), default=len(body))   # the last call may lack its end
        call, body = body[len(KIMI_CALL_OPEN):stop], body[stop:]
        if body.startswith(KIMI_CALL_CLOSE):
            body = body[len(KIMI_CALL_CLOSE):]
        body = body.lstrip()
        call_id, sep, args = call.partition(KIMI_ARGS)
        m = _KIMI_ID.fullmatch(call_id.strip())
        if not sep or m is None:
            return None
        try:
            obj = strict_json(args)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        calls.append({"id": call_id.strip(), "name": m.group(1), "arguments": args.strip()})
    return calls or None


def _qwen_calls(block: str) -> list[dict[str, Any]] | None:
    call = parse_tool_call(block[len(TOOL_OPEN):])
    return None if call is None else [call]


@dataclass(frozen=True)
class ToolFormat:
    """How a template's model writes tool calls: the texts that open a block, the one that closes
    it (a block the answer ends in is read as it is), the one that closes each call in a block, and
    the block (opener included) to calls ({"name", "arguments"}, and "id" where the model writes
    one) or None."""

    name: str
    opens: tuple[str, ...]
    close: str
    call_close: str
    parse: Callable[[str], list[dict[str, Any]] | None]


QWEN_TOOLS = ToolFormat("qwen", (TOOL_OPEN,), TOOL_CLOSE, TOOL_CLOSE, _qwen_calls)
KIMI_TOOLS = ToolFormat("kimi", (KIMI_SECTION_OPEN, KIMI_CALL_OPEN), KIMI_SECTION_CLOSE, KIMI_CALL_CLOSE,
                        parse_kimi_tool_calls)


def tool_format_of(template_source: str) -> ToolFormat:
    """The tool-call format a chat template teaches: Kimi's when it writes both Kimi markers (the
    rule llama.cpp's common/chat.cpp picks its Kimi-K2 parser by), else Qwen's."""
    if KIMI_SECTION_OPEN in template_source and KIMI_CALL_OPEN in template_source:
        return KIMI_TOOLS
    return QWEN_TOOLS


def parse_tool_calls(text: str, fmt: ToolFormat = QWEN_TOOLS) -> tuple[str, list[dict[str, Any]]]:
    """Split a whole answer into content and OpenAI tool calls (non-streaming use, tests)."""
    stream = ToolCallStream(fmt)
    d = stream.push(text)
    d.add(stream.flush())
    return d.content, d.tool_calls


class ToolCallStream:
    """Content text in, content and complete tool calls out; tool-call blocks are buffered."""

    def __init__(self, fmt: ToolFormat = QWEN_TOOLS) -> None:
        self.fmt = fmt
        self.pending = ""
        self.inside = False
        self.n_calls = 0

    def _calls(self, block: str, closed: bool) -> Delta:
        calls, rest = self.fmt.parse(block), ""
        if calls is None and not closed and (end := block.rfind(self.fmt.call_close)) >= 0:
            # the answer ended inside a block of several calls (Kimi's section): its complete
            # calls are calls, the cut one's text is content, as a cut block of one call is
            end += len(self.fmt.call_close)
            calls, rest = self.fmt.parse(block[:end]), block[end:]
        if calls is None:
            return Delta(content=block + (self.fmt.close if closed else ""))
        out = Delta(content=rest)
        for call in calls:
            index, self.n_calls = self.n_calls, self.n_calls + 1
            call_id = call.get("id") or new_call_id()
            out.tool_calls.append({"index": index, "id": call_id, "type": "function",
                                   "function": {"name": call["name"], "arguments": call["arguments"]}})
        return out

    def push(self, text: str) -> Delta:
        out = Delta()
        buf = self.pending + text
        while True:
            if self.inside:
                i = buf.find(self.fmt.close)
                if i < 0:
                    self.pending = buf
                    return out
                out.add(self._calls(buf[:i], True))
                buf = buf[i + len(self.fmt.close):]
                self.inside = False
            else:
                found = [(i, o) for o in self.fmt.opens if (i := buf.find(o)) >= 0]
                if not found:
                    hold = partial_suffix(buf, list(self.fmt.opens))
                    out.content += buf[:len(buf) - hold]
                    self.pending = buf[len(buf) - hold:]
                    return out
                i = min(found)[0]
                out.content += buf[:i]
                buf = buf[i:]              # the block keeps its opener: the parser reads which one it was
                self.inside = True

    def flush(self) -> Delta:
        """The end of the answer: an unterminated block is parsed as it is (the model ran out of
        tokens, or Kimi's section end is left out)."""
        buf, self.pending = self.pending, ""
        if not self.inside:
            return Delta(content=buf)
        self.inside = False
        return self._calls(buf, False)


class OutputStream:
    """Tokens in, deltas out: UTF-8 assembly, stop strings, then reasoning and tool-call parsing."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), *, reasoning: bool = False,
                 starts_thinking: bool = False, tools: bool = False, tool_format: ToolFormat = QWEN_TOOLS):
        self.decoder = StreamDecoder(tokenizer)
        self.stopper = StopMatcher(stops)
        self.thinking = ThinkingSplitter(starts_thinking) if reasoning else None
        self.tools = ToolCallStream(tool_format) if tools else None
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
