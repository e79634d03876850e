"""An answer as the block-based APIs see it: ordered blocks, and how it ended.

Chat Completions sends an answer as one message with three fields (`reasoning_content`, `content`,
`tool_calls`); Anthropic's Messages API and OpenAI's Responses API send it as a sequence of blocks
(thinking / text / tool use; reasoning / message / function call items), each opened, filled and
closed in turn. `BlockSplitter` turns the worker's `Delta`s into that sequence, for a stream and for
a whole answer alike, so both APIs cut an answer into the same blocks. Within one `Delta` the order
is reasoning, then content, then tool calls: the order `OutputStream` produces them in.

`Ending` reads what the worker's result does not say outright: which stop sequence ended the
answer (the worker reports "stop" for it, as for the end-of-generation token), whether "length"
meant the context was full rather than the token limit, and how many generated tokens were
reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from deltarun.apps.chat import THINK_CLOSE
from deltarun.apps.serve.output import Delta
from deltarun.apps.serve.protocol import ChatRequest, check_token_ids
from deltarun.apps.serve.worker import GenParams

THINKING, TEXT, TOOL_CALL = "thinking", "text", "tool_call"
R = TypeVar("R")


def _itself(r: Any) -> Any:
    return r


@dataclass
class Block:
    """One block of an answer: its position, kind, text so far, and (a tool call) the call."""

    index: int
    kind: str                               # THINKING | TEXT | TOOL_CALL
    text: str = ""
    call: dict[str, Any] | None = None      # {"id", "type", "function": {"name", "arguments"}}


@dataclass
class Step:
    """What happened to a block: "open", "delta" (with the piece added) or "close"."""

    what: str
    block: Block
    piece: str = ""


class BlockSplitter:
    """`Delta`s in, block steps out. A tool call is one block, opened, filled with its arguments and
    closed at once (the worker sends a call whole). With `max_calls` (a client that asked for no
    parallel calls), calls beyond it are left out of the answer."""

    def __init__(self, max_calls: int | None = None):
        self.blocks: list[Block] = []
        self.max_calls = max_calls
        self.n_calls = 0
        self._open: Block | None = None

    def push(self, d: Delta) -> list[Step]:
        steps: list[Step] = []
        if d.reasoning:
            steps += self._add(THINKING, d.reasoning)
        if d.content:
            steps += self._add(TEXT, d.content)
        for call in d.tool_calls:
            if self.max_calls is not None and self.n_calls >= self.max_calls:
                continue
            self.n_calls += 1
            steps += self.close()
            block = Block(len(self.blocks), TOOL_CALL, call["function"]["arguments"], call)
            self.blocks.append(block)
            steps += [Step("open", block), Step("delta", block, block.text), Step("close", block)]
        return steps

    def close(self) -> list[Step]:
        """Close the open block, if any (the answer ended, or another kind of block follows)."""
        block, self._open = self._open, None
        return [Step("close", block)] if block is not None else []

    def _add(self, kind: str, piece: str) -> list[Step]:
        steps: list[Step] = []
        if self._open is None or self._open.kind != kind:
            steps += self.close()
            self._open = Block(len(self.blocks), kind)
            self.blocks.append(self._open)
            steps.append(Step("open", self._open))
        self._open.text += piece
        steps.append(Step("delta", self._open, piece))
        return steps


@dataclass
class Ending:
    """How an answer ended, from the worker's finish reason and result."""

    reason: str                     # the worker's: stop | length | tool_calls
    stop_sequence: str | None       # the stop string that ended it
    context_full: bool              # "length" because the context was full, not the token limit
    reasoning_tokens: int           # generated tokens up to and including the end of thinking

    @classmethod
    def of(cls, tokenizer: Any, req: ChatRequest, reason: str, result: dict[str, Any],
           had_reasoning: bool) -> "Ending":
        tokens: list[int] = result["tokens"]
        stop = None
        if reason == "stop" and req.stops:
            # the worker's text ends where the stop string began; the tokens hold the string too
            rest = tokenizer.decode(tokens)[len(result["text"]):]
            hits = [s for s in req.stops if rest.startswith(s)]
            stop = max(hits, key=len) if hits else None
        full = reason == "length" and (req.max_tokens is None or len(tokens) < req.max_tokens)
        return cls(reason, stop, full, _reasoning_tokens(tokenizer, tokens) if had_reasoning else 0)


def _reasoning_tokens(tokenizer: Any, tokens: list[int]) -> int:
    """Tokens up to and including the one that closes the think block (all of them when it never
    closed). A vocabulary without a `</think>` token of its own counts the text's own tokens."""
    close = tokenizer.encode(THINK_CLOSE, add_special=False, parse_special=True)
    if len(close) == 1:
        return tokens.index(close[0]) + 1 if close[0] in tokens else len(tokens)
    text = tokenizer.decode(tokens)
    end = text.find(THINK_CLOSE)
    return len(tokens) if end < 0 else len(tokenizer.encode(text[:end + len(THINK_CLOSE)], add_special=False))


async def submit_chat(state: Any, parse: Callable[[], R], chat_of: Callable[[R], ChatRequest] = _itself,
                      ) -> tuple[R, GenParams, Any]:
    """What /v1/chat/completions does with a request, for a request of another API: `parse()` (its
    translation into a chat request), the same checks and prompt building, all off the event loop;
    then the job is submitted. Returns (what parse returned, params, relay)."""
    from deltarun.apps.serve.relay import Relay, check_prompt_size, run_cpu

    builder = state.builder

    def prepare() -> tuple[R, GenParams]:
        parsed = parse()
        req = chat_of(parsed)
        check_token_ids(req, builder.n_vocab)
        check_prompt_size(req, builder.n_ctx, "messages")
        return parsed, builder.chat(req)
    parsed, params = await run_cpu(prepare)
    return parsed, params, Relay(state, params)
