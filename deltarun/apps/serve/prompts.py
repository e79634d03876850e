"""Checked requests -> the worker's `GenParams`: chat template, tokens, limits, grammar, checkpoints.

Runs in the handlers' thread pool (rendering and tokenizing are CPU work), reading only the
model's tokenizer, hyperparameters and chat template, which never change after loading.

Checkpoint positions are found by rendering, not by knowing the template: a message boundary
is where the prompt and the rendering of the first i messages and a stand-in message stop
agreeing; the answer boundary is where the prompt and the rendering of the conversation followed
by an answer and another user message stop agreeing, which is exactly where the next turn's
prompt will differ from this one (Qwen3 templates render an earlier answer without its think
block).

The next turn's start is predicted the same way (`next_turn`): the conversation with the answer
as the client will send it back, followed by a stand-in message, rendered and cut where the
stand-in's text begins. The worker evaluates that ahead while idle (`Worker.prefill_ahead`), and
the rendering is the one the next turn's boundaries are found with, so it is not done twice.

A request that ends with an assistant message may ask the answer to continue it (`continues`): the
conversation is rendered with that message last and cut right after its text, found by a STAND_IN
mark appended to it, so the template decides how the message opens (its think block included)
and only its closing is left out, as transformers' `continue_final_message` does.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from typing import Any

import numpy as np

from deltarun.apps.chat import (STAND_IN, common_text_prefix, followed_by_a_message, followed_by_a_turn, opens_thinking,
                                tokens_before, with_end_marked)
from deltarun.apps.serve.grammar import CallSyntax
from deltarun.apps.serve.output import KIMI_TOOLS, tool_format_of
from deltarun.apps.serve.infill import FimTokens, infill_prompt
from deltarun.apps.serve.protocol import ApiError, ChatRequest, CompletionRequest, InfillRequest
from deltarun.apps.serve.worker import GenParams
from deltarun.base.chat_template import ChatTemplate
from deltarun.runner.reasoning import NO_BUDGET, ThinkingTags, check_budget
from deltarun.apps.serve.images import prepare_images
from deltarun.base.errors import ImageError, TokenizerError
from deltarun.base.vision import VisionHParams
from deltarun.runner.multimodal import PlacedImage, outside_images, place_images, placed_position, vision_token_ids

#: Message boundaries are looked for among the last this many messages only (each costs a render).
BOUNDARY_MESSAGES = 8
#: Stand-in renderings remembered (least recently used dropped): a few per conversation turn.
RENDER_CACHE = 1024


class PromptBuilder:
    def __init__(self, model: Any, template: ChatTemplate, grammars: Any, checkpoint_every: int = 1024,
                 vision: VisionHParams | None = None, reasoning_budget: int = NO_BUDGET,
                 prefill_assistant: bool = True):
        self.tokenizer = model.tokenizer
        #: the vision tower's hyper-parameters (serve --mmproj): images are prepared for it; None: refused
        self.vision = vision
        self._image_pad = vision_token_ids(model)[1] if vision is not None else -1
        self.n_ctx = model.n_ctx
        self.n_vocab = model.hp.n_vocab
        self.template = template
        self.grammars = grammars
        self.checkpoint_every = checkpoint_every
        #: the tool-call format the template teaches (Qwen's or Kimi's): the answers are parsed in it
        self.tool_format = tool_format_of(template.source)
        #: the calls' syntax in that format, for their grammars
        self.call_syntax = CallSyntax.KIMI if self.tool_format is KIMI_TOOLS else \
            CallSyntax.XML if "<function=" in template.source and "<parameter=" in template.source else CallSyntax.JSON
        #: the think block's tags and the end-of-thinking marker a reasoning budget forces
        self.thinking_tags = ThinkingTags.of_tokenizer(self.tokenizer, template.reasoning_separator())
        #: the budget of a request that names none (`serve --reasoning-budget`; None: no limit)
        self.reasoning_budget = None if check_budget(reasoning_budget) == NO_BUDGET else reasoning_budget
        #: a request ending with an assistant message continues it unless it says otherwise
        #: (`serve --prefill-assistant`, llama-server's default)
        self.prefill_assistant = prefill_assistant
        #: the vocabulary's fill-in-the-middle tokens (`/infill`); None: it has none
        self.fim = FimTokens.of(self.tokenizer)
        self._byte_lengths: dict[int, int] = {}     # token id -> bytes (see _token_ends)
        self._renders: collections.OrderedDict[bytes, str] = collections.OrderedDict()   # _stand_in_render
        self._lock = threading.Lock()               # chat() runs in the handlers' thread pool

    def tokenize(self, text: str) -> list[int]:
        tok = self.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
        add_special = not (bos and text.startswith(bos))   # the template may have written bos itself
        return tok.encode(text, add_special=add_special, parse_special=True)

    def _render(self, messages: list[dict[str, Any]], req: ChatRequest, tools: list | None, gen: bool) -> str:
        kwargs = dict(req.template_kwargs)
        thinking = kwargs.pop("enable_thinking", None)
        return self.template.render(messages, add_generation_prompt=gen, enable_thinking=thinking, tools=tools,
                                    images=self.vision is not None, **kwargs)

    def _check_length(self, prompt: list[int], param: str) -> None:
        if len(prompt) >= self.n_ctx:
            raise ApiError(f"the prompt has {len(prompt)} tokens but the context holds {self.n_ctx} (and at least "
                           f"one token must be generated)", param=param, code="context_length_exceeded",
                           type="exceed_context_size_error", extra={"n_prompt_tokens": len(prompt), "n_ctx": self.n_ctx})

    def _max_tokens(self, requested: int | None, n_prompt: int) -> int:
        room = self.n_ctx - n_prompt
        return room if requested is None else min(requested, room)

    def _prefix_keys(self, msgs: list[dict[str, Any]], req: ChatRequest, tools: list | None) -> list[bytes]:
        """keys[i] identifies msgs[:i] with the template options: what a stand-in render depends on."""
        h = hashlib.blake2b(json.dumps([req.template_kwargs, tools], sort_keys=True, default=str).encode(),
                            digest_size=16)
        keys = [h.digest()]
        for m in msgs:
            h.update(json.dumps(m, sort_keys=True, default=str).encode())
            keys.append(h.digest())
        return keys

    def _stand_in_render(self, key: bytes, msgs: list[dict[str, Any]], req: ChatRequest, tools: list | None) -> str:
        """The rendering of `followed_by_a_message(msgs)`, remembered: a conversation's next turn
        re-sends the same earlier messages, so only the boundaries of its new ones are rendered."""
        with self._lock:
            text = self._renders.get(key)
            if text is not None:
                self._renders.move_to_end(key)
                return text
        text = self._render(followed_by_a_message(msgs), req, tools, False)
        with self._lock:
            self._renders[key] = text
            while len(self._renders) > RENDER_CACHE:
                self._renders.popitem(last=False)
        return text

    def _token_ends(self, text: str, prompt: list[int]) -> np.ndarray | None:
        """Byte offset in `text` where each prompt token ends, or None if the tokens' bytes are not
        the text's (a BOS the tokenizer added counts as empty)."""
        tok, lengths = self.tokenizer, self._byte_lengths
        for t in prompt:
            if t not in lengths:
                lengths[t] = len(tok.token_bytes(t))
        sizes = np.fromiter((lengths[t] for t in prompt), dtype=np.int64, count=len(prompt))
        data = text.encode("utf-8")
        if prompt and tok.bos_id is not None and prompt[0] == tok.bos_id and not data.startswith(tok.token_bytes(prompt[0])):
            sizes[0] = 0
        ends = np.cumsum(sizes)
        return ends if len(ends) and int(ends[-1]) == len(data) else None

    def _boundary(self, text: str, other: str, prompt: list[int], ends: np.ndarray | None) -> int:
        """Tokens of the prompt up to where `other` (another rendering) stops agreeing with `text`:
        those whose bytes end there or before (the text is not tokenized again)."""
        k = common_text_prefix(text, other)
        if k == len(text):
            return len(prompt)
        if ends is None:
            return tokens_before(self.tokenize, text, k, prompt)
        return int(np.searchsorted(ends, len(text[:k].encode("utf-8")), side="right"))

    def _checkpoints(self, n: int, boundaries: list[int], placed: list[PlacedImage] = ()) -> list[int]:
        every = list(range(self.checkpoint_every, n, self.checkpoint_every)) if self.checkpoint_every > 0 else []
        return sorted({outside_images(b, placed) for b in boundaries + every if 0 < b <= n} | {n})

    def _place_images(self, req: ChatRequest, tokens: list[int]) -> tuple[list[int], list[PlacedImage]]:
        """The request's images prepared (a 400 for a bad one, or for any without --mmproj) and put in
        place of the pad tokens the template wrote (`place_images`); tokens unchanged without images."""
        images = prepare_images(req, self.vision, self.n_ctx - 1)
        if not images:
            return tokens, []
        try:
            return place_images(tokens, self._image_pad, images)
        except ImageError as e:
            raise ApiError(str(e), param="messages", code="invalid_image") from None

    def continues(self, req: ChatRequest) -> bool:
        """Whether the answer continues the request's final assistant message (its text is the
        answer's start: llama-server's assistant prefill, Anthropic's Messages API): as the request
        says (`continue_final_message`), else when the messages end with one and this server
        prefills. A 400 where that cannot be: the message has tool calls, or a grammar (a JSON
        schema, a forced tool call) would constrain the answer from before its continued text."""
        last = req.messages[-1]
        if not (req.continue_final if req.continue_final is not None
                else self.prefill_assistant and last["role"] == "assistant"):
            return False
        if last.get("tool_calls"):
            raise ApiError("the final assistant message has tool calls, so it cannot be continued: send the calls' "
                           "results after it", param="messages", code="invalid_value")
        if req.response_format is not None or (req.tools and req.tool_choice not in ("auto", "none")):
            raise ApiError("the final assistant message cannot be continued under response_format or a forced "
                           "tool_choice: their grammar constrains the whole answer", param="messages",
                           code="invalid_value")
        return True

    def _prompt_text(self, req: ChatRequest) -> tuple[str, list | None]:
        """The rendered prompt of a chat request, and the tools rendered into it (None: none)."""
        prepare_images(req, self.vision, self.n_ctx - 1)     # first: a 400 for an image without --mmproj
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        try:
            if not self.continues(req):
                return self._render(req.messages, req, tools, True), tools
            text = self._render(req.messages[:-1] + [with_end_marked(req.messages[-1])], req, tools, False)
        except TokenizerError as e:
            raise ApiError(str(e), param="messages", code="template_error") from e
        cut = text.rfind(STAND_IN)
        if cut < 0:
            raise ApiError("the chat template does not write the final assistant message's text (its reasoning, "
                           "when it has no text), so it cannot be continued", param="messages", code="template_error")
        return text[:cut], tools

    def prompt_text(self, req: ChatRequest) -> str:
        """The prompt a chat request is answered after, as text (`POST /apply-template`)."""
        return self._prompt_text(req)[0]

    def prompt_length(self, req: ChatRequest) -> int:
        """Tokens of the prompt `chat(req)` builds, with no limit (token counting endpoints answer
        for prompts longer than the context too)."""
        return len(self._place_images(req, self.tokenize(self._prompt_text(req)[0]))[0])

    def chat(self, req: ChatRequest) -> GenParams:
        text, tools = self._prompt_text(req)
        use_tools = tools is not None
        rendered = self.tokenize(text)           # one pad token per image: the boundaries are found in it
        prompt, placed = self._place_images(req, rendered)
        self._check_length(prompt, "messages")
        boundaries = []
        ends = self._token_ends(text, rendered)
        msgs = req.messages
        first = max(1, len(msgs) - BOUNDARY_MESSAGES)
        keys = self._prefix_keys(msgs, req, tools)
        for i in range(first, len(msgs)):
            # msgs[:i] followed by a stand-in message: rendered as not the last, message i-1 looks as
            # it does in the prompt (the Qwen3 templates give the last assistant message a think
            # block, earlier ones none), so the two agree up to where message i's content starts
            try:
                boundaries.append(self._boundary(text, self._stand_in_render(keys[i], msgs[:i], req, tools),
                                                 rendered, ends))
            except TokenizerError:
                pass
        try:             # a continued message is the answer's start: the next turn departs where it does
            asked = msgs[:-1] if self.continues(req) else msgs
            answer_start = self._boundary(text, self._render(followed_by_a_turn(asked), req, tools, False), rendered,
                                          ends)
        except TokenizerError:
            answer_start = len(rendered)
        boundaries = [placed_position(b, placed) for b in boundaries]
        answer_start = placed_position(answer_start, placed)
        grammar, trigger = None, None
        if req.response_format is not None:
            grammar = self.grammars.json_schema(req.response_format["schema"], "response_format")
        elif use_tools and req.tool_choice != "auto":
            chosen = req.tools if req.tool_choice == "required" else \
                [t for t in req.tools if t["function"]["name"] == req.tool_choice["function"]["name"]]
            grammar = self.grammars.tool_call(chosen, self.call_syntax)
        elif use_tools:                    # auto: a lazy grammar, from the call block's first token on
            grammar, trigger = self.grammars.lazy_tool_call(req.tools, self.call_syntax) or (None, None)
        return GenParams(prompt=prompt, max_tokens=self._max_tokens(req.max_tokens, len(prompt)), req=req,
                         grammar=grammar, trigger=trigger, thinking_tags=self.thinking_tags,
                         thinking_budget=req.reasoning_budget if req.reasoning_budget is not None
                         else self.reasoning_budget, reasoning=True,
                         starts_thinking=opens_thinking(text), tools=use_tools, tool_format=self.tool_format,
                         checkpoints=self._checkpoints(len(prompt), boundaries + [answer_start], placed),
                         answer_start=answer_start, images=placed)

    def next_turn(self, req: ChatRequest, content: str) -> GenParams | None:
        """The start of this conversation's next prompt, when the client sends back `content` (the
        answer's text; OpenAI clients do not send reasoning back) and then one more message: up to
        where that message's text begins. None when it cannot be rendered or would not fit."""
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        if self.continues(req):        # the client sends the continued message back whole
            msgs = req.messages[:-1] + [{"role": "assistant", "content": req.messages[-1]["content"] + content}]
        else:
            msgs = req.messages + [{"role": "assistant", "content": content}]
        try:
            text = self._stand_in_render(self._prefix_keys(msgs, req, tools)[-1], msgs, req, tools)
        except TokenizerError:
            return None
        cut = text.rfind(STAND_IN)
        if cut < 0:
            return None
        tokens = self.tokenize(text)
        n = self._boundary(text, text[:cut], tokens, self._token_ends(text, tokens))
        prompt, placed = self._place_images(req, tokens[:n])
        n = len(prompt)
        if not 0 < n < self.n_ctx:
            return None
        return GenParams(prompt=prompt, max_tokens=0, req=req, checkpoints=self._checkpoints(n, [], placed),
                         answer_start=n, ahead=True, images=placed)

    def infill(self, req: InfillRequest) -> GenParams:
        """The fill-in-the-middle prompt of an `/infill` request (`infill.infill_prompt`), as a
        completion of its tokens; a 501 for a vocabulary without FIM tokens (as llama-server)."""
        if self.fim is None:
            raise ApiError("infill is not supported by this model: its vocabulary has no fill-in-the-middle tokens "
                           "(<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>)", status=501,
                           type="not_supported_error")
        req.prompt = infill_prompt(self.tokenizer, self.fim, req.input_prefix, req.input_suffix, req.input_extra,
                                   req.fim_prompt, self.n_ctx, req.max_tokens or 0)
        return self.completion(req)

    def completion(self, req: CompletionRequest) -> GenParams:
        if isinstance(req.prompt, str):
            prompt = self.tokenize(req.prompt)
        else:
            prompt = list(req.prompt)
            bad = [t for t in prompt if not 0 <= t < self.n_vocab]
            if bad:
                raise ApiError(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})", param="prompt",
                               code="invalid_value")
        if not prompt:
            raise ApiError("the prompt has no tokens", param="prompt", code="invalid_value")
        self._check_length(prompt, "prompt")
        max_tokens = self._max_tokens(req.default_max_tokens if req.max_tokens is None else req.max_tokens, len(prompt))
        return GenParams(prompt=prompt, max_tokens=max_tokens, req=req,
                         checkpoints=self._checkpoints(len(prompt), []), answer_start=len(prompt),
                         prompt_logprobs=req.top_logprobs if req.echo and req.logprobs else None)
