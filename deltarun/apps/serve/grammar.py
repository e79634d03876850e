"""Constrained decoding with llguidance: JSON schemas and tool calls to token masks.

llguidance compiles a JSON schema or a Lark grammar against the model's vocabulary and, at each
step, gives the set of tokens that keep the output valid; the sampler only ever sees those. The
vocabulary is handed over as the bytes of every token, special tokens marked with a 0xff prefix
(as llguidance's own llama.cpp bridge does), so grammars can name them (`<tool_call>`).

A forced tool call (`tool_choice` required or a function) constrains the answer from its first
token (`Constraint`), in the call syntax the model's template teaches (`CallSyntax`): Qwen3's JSON
or Qwen3-Coder/Qwen3.5's XML in a `<tool_call>` block, or Kimi's section of calls. With
`tool_choice: auto` the same grammar waits for its trigger, the block's opening token
(`<tool_call>`, `<|tool_calls_section_begin|>`), as llama.cpp's lazy grammars do
(`LazyConstraint`): the text before it is the model's own, and from the trigger to the block's
closing tag every token follows the grammar of the offered tools' calls; then the text is free
again (another block, or the end). A trigger inside the think block is reasoning, not a call: it
does not trigger.

When the prompt opens a think block (Qwen3.5's generation prompt ends with `<think>\n`), a
`response_format` or a forced call constrains the answer after the block, not the block
(`AfterThinking`): as llama-server's parser (common/chat-auto-parser-generator.cpp: the reasoning,
then optional blank space, then the schema's JSON), the model thinks freely, closes the block (or
a thinking budget closes it), may write the newlines the template puts after it, and then the
grammar holds. Constrained from the first token, the JSON was written inside the block and came
back as reasoning, with no content.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any

import llguidance
import numpy as np

from deltarun.apps.serve.output import (KIMI_ARGS, KIMI_CALL_CLOSE, KIMI_CALL_OPEN, KIMI_SECTION_CLOSE,
                                        KIMI_SECTION_OPEN, TOOL_CLOSE, TOOL_OPEN)
from deltarun.apps.serve.protocol import ApiError
from deltarun.runner.reasoning import ThinkingState, ThinkingTags

#: Compact JSON: a model with random weights could otherwise emit whitespace forever.
_JSON_OPTIONS = {"whitespace_flexible": False}
#: A JSON tool call as the Qwen3 templates write one (`tojson`'s separators: ", " and ": "): a
#: call renders back in the next turn's prompt as it was generated, so the prompt cache reaches
#: past it (and a real model writes it as it was trained to)
_CALL_JSON_OPTIONS = {**_JSON_OPTIONS, "item_separator": ", ", "key_separator": ": "}
TOKEN_TYPE_NORMAL = 1
#: a Kimi call's index (`functions.NAME:INDEX`, the call's number in the answer: 0, 1, ...):
#: digits without a leading zero, at most two (random weights could write digits forever)
KIMI_INDEX = "/0|[1-9][0-9]?/"
#: tool-call grammars kept, by their tools (an agent sends the same tools on every turn), and
#: compiled matchers kept, by their grammar: a request's matcher is a copy of one (llguidance's
#: deep_copy: 0.06 ms where compiling 20 tools' call grammar takes about 10 ms on the Xeon)
TOOL_GRAMMARS = 64
MATCHERS = 64
#: newline tokens allowed between a think block and a constrained answer: the templates write one
#: ("\n\n"), and a model may split it in two (newlines only: the answer's content drops them, as
#: llama-server's parser leaves the space before the JSON out of the content)
BLANK_LEAD = 2
NL = "\n"          # a newline inside f-string expressions (no backslash there before Python 3.12)


class _Vocabulary:
    """The shape llguidance.TokenizerWrapper reads: token bytes, eos/bos ids, and an encoder."""

    def __init__(self, tokenizer: Any, n_vocab: int):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(n_vocab):
            if i >= tokenizer.n_vocab:
                self.tokens.append(b"")
                continue
            b = tokenizer.token_bytes(i)
            if tokenizer.token_type(i) != TOKEN_TYPE_NORMAL:
                b = b"\xff" + b
                self.special_token_ids.append(i)
            self.tokens.append(b)

    def __call__(self, s: bytes | str) -> list[int]:
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, parse_special=False)


class CallSyntax:
    """How a template's model writes one tool call, for its grammar: JSON (Qwen3, Qwen3-Next) or
    XML (Qwen3-Coder, Qwen3.5) in a `<tool_call>` block, or Kimi's section of calls."""

    JSON, XML, KIMI = "json", "xml", "kimi"   # Kimi: output.KIMI_* markers, `functions.NAME:INDEX` ids

    @staticmethod
    def trigger(syntax: str) -> str:
        """The token a call block opens with (a lazy grammar's trigger)."""
        return KIMI_SECTION_OPEN if syntax == CallSyntax.KIMI else TOOL_OPEN


class GrammarFactory:
    """Builds one matcher per request from the model's tokenizer (converted once, on first use)."""

    def __init__(self, tokenizer: Any, n_vocab: int, eog_ids: list[int]):
        self._tokenizer, self.n_vocab, self._eog = tokenizer, n_vocab, eog_ids
        self._ll: Any = None
        self._tool_grammars = _Kept(TOOL_GRAMMARS)     # tool_call runs in the handlers' thread pool
        self._matchers = _Kept(MATCHERS)               # compiled, never advanced (the worker's thread)
        self._blank: np.ndarray | None = None

    def lazy_tool_call(self, tools: list[dict[str, Any]], syntax: str) -> tuple[str, int] | None:
        """The grammar of a call block of `tools` in `syntax` (a `CallSyntax`) and the token it starts
        at, for `tool_choice: auto` (see the module). None, and the calls unconstrained as before,
        when the vocabulary has no single special token for the block's opening or a tool's schema
        has no grammar (an agent's request is not refused for what `tool_choice: required` would
        refuse)."""
        ids = self._tokenizer.encode(CallSyntax.trigger(syntax), add_special=False, parse_special=True)
        if len(ids) != 1 or self._tokenizer.token_type(ids[0]) == TOKEN_TYPE_NORMAL:
            return None
        try:
            return self.tool_call(tools, syntax, "tools", several=True), ids[0]
        except ApiError:
            return None

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll is None:
            wrapper = llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer, self.n_vocab))
            self._ll = llguidance.LLTokenizer(wrapper, n_vocab=self.n_vocab, eos_token=self._eog)
        return self._ll

    def json_schema(self, schema: dict[str, Any] | None, param: str) -> str:
        """The grammar of a JSON schema (None: any JSON object), checked now so errors are a 400."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema if schema is not None else {"type": "object"}, overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ApiError(f"invalid JSON schema: {e}", param=param) from e
        return self._checked(grammar, param)

    def tool_call(self, tools: list[dict[str, Any]], syntax: str, param: str = "tool_choice",
                  several: bool = False) -> str:
        """A grammar that forces a block of one call of `tools` in `syntax` (a `CallSyntax`, the
        model's), or, `several` (a lazy grammar's block, where the model chose to call), of as many
        as the model writes where the syntax puts several calls in one block (Kimi's section).

        JSON: the arguments follow the function's parameter schema. XML: the parameters in the
        schema's order, the required ones always, each at most once; a value is one of a string
        `enum`, else text without `<` (at most `maxLength` characters when the schema says so),
        since XML values carry no JSON types. Kimi: `functions.NAME:INDEX` and JSON arguments
        following the schema. The grammars of the last TOOL_GRAMMARS tool lists are kept.
        """
        several = several and syntax == CallSyntax.KIMI          # one grammar for both where a block holds one call
        key = json.dumps([tools, syntax, several], sort_keys=True)
        grammar = self._tool_grammars.get(key)
        if grammar is None:
            grammar = self._tool_grammars.put(key, self._tool_call(tools, syntax, param, several))
        return grammar

    def _tool_call(self, tools: list[dict[str, Any]], syntax: str, param: str, several: bool) -> str:
        alternatives = []
        for i, tool in enumerate(tools):
            fn = tool["function"]
            name, params = fn["name"], fn.get("parameters") or {"type": "object"}
            if syntax == CallSyntax.KIMI:
                arguments = {**params, "x-guidance": _CALL_JSON_OPTIONS}
                alternatives.append(f'{json.dumps(f"functions.{name}:")} {KIMI_INDEX} '
                                    f'{self._tag(KIMI_ARGS)} %json {json.dumps(arguments)}')
            elif syntax == CallSyntax.XML:
                props = params.get("properties") or {}
                required = params.get("required") or []
                if not isinstance(props, dict) or not isinstance(required, list) \
                        or not all(isinstance(n, str) for n in required):
                    raise ApiError(f"the parameters of tool {name!r} need 'properties' as an object and "
                                   f"'required' as a list of names", param=param)
                # the tags as JSON strings (Lark reads those): any name, quotes and newlines included
                body = "".join(f' ({json.dumps(f"<parameter={n}>{NL}")} {_xml_value_and_close(v, param)})'
                               + ("" if n in required else "?") for n, v in props.items())
                alternatives.append(f'{json.dumps(f"<function={name}>{NL}")}{body} "</function>"')
            else:
                schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                          "required": ["name", "arguments"], "additionalProperties": False,
                          "x-guidance": _CALL_JSON_OPTIONS}
                alternatives.append(f"%json {json.dumps(schema)}")
        if syntax == CallSyntax.KIMI:
            lines = [f"start: {self._tag(KIMI_SECTION_OPEN)} call{'+' if several else ''} {self._tag(KIMI_SECTION_CLOSE)}",
                     f"call: {self._tag(KIMI_CALL_OPEN)} function {self._tag(KIMI_CALL_CLOSE)}",
                     "function: " + " | ".join(alternatives)]
        else:
            lines = [f'start: {self._tag(TOOL_OPEN)} "\\n" call "\\n" {self._tag(TOOL_CLOSE)}',
                     "call: " + " | ".join(alternatives)]
        grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(lines))
        return self._checked(grammar, param)

    def _tag(self, tag: str) -> str:
        """A tool-call tag in a Lark grammar: the special token where the vocabulary has one, else
        its text (the Qwen2 vocabulary has no `<tool_call>` token: the tag is written as text)."""
        ids = self._tokenizer.encode(tag, add_special=False, parse_special=True)
        if len(ids) == 1 and self._tokenizer.token_type(ids[0]) != TOKEN_TYPE_NORMAL:
            return tag
        return json.dumps(tag)

    def _checked(self, grammar: str, param: str) -> str:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise ApiError(f"cannot build a grammar: {messages[0] if messages else 'invalid'}", param=param)
        return grammar

    @property
    def blank_ids(self) -> np.ndarray:
        """The ids of the ordinary tokens that are only newlines (computed once)."""
        if self._blank is None:
            tok = self._tokenizer
            self._blank = np.array([i for i in range(min(self.n_vocab, tok.n_vocab))
                                    if tok.token_type(i) == TOKEN_TYPE_NORMAL
                                    and (b := tok.token_bytes(i)) and not b.strip(b"\n")], dtype=np.int64)
        return self._blank

    def matcher(self, grammar: str, trigger: int | None = None, thinking: ThinkingTags | None = None,
                starts_thinking: bool = False) -> "Constraint | LazyConstraint | AfterThinking":
        """One request's grammar state; with a `trigger`, a lazy one (see the module) that follows
        the think block with `thinking` (the prompt opened it: `starts_thinking`); without, one
        that holds from the first token, or after the think block the prompt opened."""
        if trigger is None:
            compiled = self._matchers.get(grammar)
            if compiled is None:
                compiled = self._matchers.put(grammar, llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0))
            constraint = Constraint(compiled.deep_copy(), self.n_vocab)
            if thinking is not None and starts_thinking:
                return AfterThinking(constraint, ThinkingState(thinking, True), self.blank_ids)
            return constraint
        return LazyConstraint(lambda: self.matcher(grammar), trigger,
                              ThinkingState(thinking, starts_thinking) if thinking is not None else None)


class _Kept:
    """The last `size` values by key (least recently used out), for several threads."""

    def __init__(self, size: int):
        self.size = size
        self._values: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: str, value: Any) -> Any:
        with self._lock:
            self._values[key] = value
            while len(self._values) > self.size:
                self._values.popitem(last=False)
        return value


#: what ends an XML parameter: a newline and the closing tag (the templates write it so)
XML_PARAMETER_CLOSE = "\n</parameter>\n"


def _xml_value_and_close(schema: Any, param: str) -> str:
    """The Lark expression of one XML parameter value and its closing tag: a string's text as it is
    (one of its `enum`, or without `<`, at most `maxLength` characters); a value of another JSON
    type (a number, a boolean, an array, an object, or an enum of such) as JSON that follows its
    schema, which the parser reads back as that type (output._xml_value) and the templates write
    back with `tojson`'s separators (Qwen3.5: `args_value | tojson` for arrays and objects, the
    number's text else).

    A free text and its closing are one lexeme: as two, the text's lexeme (newlines allowed in it)
    took the newline before `</parameter>` greedily and the closing then wanted another one, so
    `Paris\n</parameter>` was refused at `</` and the value came back as "Paris\n"."""
    close = json.dumps(XML_PARAMETER_CLOSE)
    if isinstance(schema, dict):
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) and "<" not in v for v in enum):
            return "(" + " | ".join(json.dumps(v) for v in enum) + f") {close}"
        kind = schema.get("type")
        if kind is not None and not isinstance(kind, str) and not (
                isinstance(kind, list) and all(isinstance(k, str) for k in kind)):
            raise ApiError(f"invalid JSON schema: 'type' must be a string or a list of strings, not {json.dumps(kind)}",
                           param=param)
        kinds = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()
        if (kinds and "string" not in kinds) or (isinstance(enum, list) and enum and not kinds):
            return f"%json {json.dumps({**schema, 'x-guidance': _CALL_JSON_OPTIONS})} {close}"
        n = schema.get("maxLength")
        if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
            return f"/[^<]{{1,{n}}}\\n<\\/parameter>\\n/"
    return "/[^<]+\\n<\\/parameter>\\n/"


class Constraint:
    """One request's grammar state: masks logits before sampling, advances on each token."""

    lazy = False

    def __init__(self, matcher: Any, n_vocab: int):
        self.matcher, self.n_vocab = matcher, n_vocab

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """Logits with every token the grammar forbids at -inf (a new array)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        self._check()
        allowed = bits[:logits.shape[0]].astype(bool)
        return np.where(allowed, logits, -np.inf).astype(np.float32)

    def accept(self, token: int) -> None:
        self.matcher.consume_token(int(token))
        self._check()

    def _check(self) -> None:
        """A matcher that failed (a schema whose regular expressions outgrow llguidance's lexer, met
        only once the output reaches them, or at the first mask of a copy whose compiled grammar
        failed so before) allows nothing but the end: the request fails with llguidance's reason
        instead of ending an answer that does not follow its schema."""
        if self.matcher.is_error():
            reason = self.matcher.get_error().splitlines()[0]
            raise ApiError(f"the output's grammar cannot go on: {reason}", code="grammar_error")

    def fork(self) -> "Constraint":
        """A copy of the matcher's state (llguidance's deep_copy, about 0.06 ms): drafts are verified
        on one (`LogitsProcessors.fork`)."""
        return Constraint(self.matcher.deep_copy(), self.n_vocab)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing more may follow."""
        return self.matcher.is_stopped()


class LazyConstraint:
    """A tool-call grammar that waits for its trigger token (see the module): no mask before it,
    the grammar's from the trigger to the end of the call."""

    lazy = True
    done = False                  # the answer goes on after a call: the model ends it

    def __init__(self, new: Any, trigger: int, thinking: ThinkingState | None):
        self._new, self.trigger, self.thinking = new, trigger, thinking
        self.active: Constraint | None = None     # the grammar of the call being written

    def mask(self, logits: np.ndarray) -> np.ndarray:
        return logits if self.active is None else self.active.mask(logits)

    def accept(self, token: int) -> None:
        if self.active is not None:
            self.active.accept(token)
            if self.active.done:              # the call's closing tag: free text again
                self.active = None
            return
        thinking = self.thinking is not None and self.thinking.inside
        if self.thinking is not None:
            self.thinking.accept(token)
        if token == self.trigger and not thinking:
            self.active = self._new()
            self.active.accept(token)

    def fork(self) -> "LazyConstraint":
        twin = LazyConstraint(self._new, self.trigger, self.thinking.fork() if self.thinking is not None else None)
        twin.active = self.active.fork() if self.active is not None else None
        return twin


class AfterThinking:
    """A grammar that holds after the think block the prompt opened (see the module): no mask
    inside the block, then up to BLANK_LEAD newline tokens (`blank`: their ids) or the grammar's
    first token, then the grammar's mask to its end."""

    lazy = False

    def __init__(self, constraint: Constraint, thinking: ThinkingState, blank: np.ndarray):
        self.constraint, self.thinking, self._blank = constraint, thinking, blank
        self.started = False             # the grammar took its first token
        self.n_blank = 0                 # blank tokens between the block and the answer

    def mask(self, logits: np.ndarray) -> np.ndarray:
        if self.thinking.inside:
            return logits
        x = self.constraint.mask(logits)
        if not self.started and self.n_blank < BLANK_LEAD:
            x[self._blank] = np.asarray(logits, dtype=np.float32)[self._blank]
        return x

    def accept(self, token: int) -> None:
        if self.started:
            self.constraint.accept(token)
        elif self.thinking.inside:
            self.thinking.accept(token)           # reasoning, or the closing tag
        elif self.n_blank < BLANK_LEAD and token in self._blank:
            self.n_blank += 1
        else:
            self.started = True
            self.constraint.accept(token)

    def fork(self) -> "AfterThinking":
        twin = AfterThinking(self.constraint.fork(), self.thinking.fork(), self._blank)
        twin.started, twin.n_blank = self.started, self.n_blank
        return twin

    @property
    def done(self) -> bool:
        return self.started and self.constraint.done
