"""A multi-turn chat with a model: the conversation, incremental prefill, stop strings, save/load.

    session = ChatSession(model, ChatTemplate.from_model(model), Sampler(params), system="Be brief.")
    for piece in session.send("Hello!"):          # text pieces as the tokens are generated
        print(piece, end="", flush=True)
    session.last_prefill_tokens                    # tokens evaluated for this turn's prompt
    session.save("chat.json"); session.load("chat.json"); session.reset()

How the model's memory follows the conversation
-----------------------------------------------
The model always holds a token prefix of the rendered conversation. Each turn renders the whole
conversation with the chat template, tokenizes it, and compares it with the tokens the model holds:
the longest common prefix is kept and only the rest is evaluated. Usually that is exactly the new
user message (plus the end of the previous answer). When the template renders earlier turns
differently (Qwen3 drops the thinking of earlier answers) or a stop string / interruption left
tokens that are not part of the conversation, the extra tokens are undone with `Memory.rollback`
when the recurrent rollback slots reach back far enough (they cover the last ubatch only, so in
practice a prompt whose answer was cancelled before its first token, with --rs-slots > 1), and
otherwise the model returns to the checkpoint of its recurrent state taken during the previous
prompt where the template can change its mind about it (right after the assistant header, before
any think block: Qwen3 and Qwen3.5 drop the thinking of earlier answers and leave out the empty
think block that a prompt without thinking holds; see `_checkpoint_position`), and only when that
does not reach either is the model reset and the prompt recomputed (`last_recomputed`); the
choice is the resume planner's (runner/resume.py), which the server's prompt cache asks too. The
interactive chat calls `prefill_next_turn` while the user types: it evaluates the conversation as
the next turn will render it up to where the next message's text begins (the answer just given,
re-rendered; before the first turn the system prompt), so the next turn evaluates only the new
message. Generated tokens
that decode and re-tokenize to other ids also count as a difference. Because the model state is
derived from `messages` this way, `messages` may also be edited directly between turns.

Ctrl-C: SIGINT is deferred while the model evaluates (so an interrupt never lands between a
graph compute and its bookkeeping); a KeyboardInterrupt anywhere else in a turn (or closing the
`send` iterator early) ends the turn with the partial answer kept in the conversation. An
interrupt before the first token cancels the turn: the user message is removed again.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import jinja2
import numpy as np

from deltarun.base.chat_template import ChatTemplate
from deltarun.base.errors import ContextFullError, DeltarunError, ImageError
from deltarun.base.tokenizer import StreamDecoder
from deltarun.runner.files import write_atomically
from deltarun.runner.generation import GenerationStats, decode_tokens
from deltarun.runner.reasoning import NO_BUDGET, THINK_CLOSE, THINK_OPEN, ThinkingTags, check_budget, thinking_budget
from deltarun.runner.resume import Held, Saved, common_prefix_length, plan_resume
from deltarun.runner.sampling import GREEDY, LogitsProcessors, Sampler
from deltarun.runner.speculative import MtpFeed

if TYPE_CHECKING:  # annotations only: the applications open models lazily
    from deltarun.runner.model import Model

FILE_FORMAT = "deltarun-chat"
FILE_VERSION = 1
ROLES = ("system", "user", "assistant", "tool")
#: Stands for a message's text not known yet when probing how the template renders a conversation
#: (`followed_by_a_message`, `followed_by_a_turn`): a character no prompt has, and not whitespace,
#: which templates trim away.
STAND_IN = "\u0001"

#: Why a turn ended: end-of-generation token, a stop string, the n_predict limit, a full context,
#: Ctrl-C / the iterator closed, an exception.
STOP_REASONS = ("eog", "stop", "length", "context", "interrupted", "error")


class ChatFileError(DeltarunError):
    """A conversation file cannot be written, read, or understood."""


@dataclass
class TurnStats:
    """What one turn cost."""

    prefill_tokens: int = 0       # prompt tokens evaluated (new ones, and any recomputed)
    reused_tokens: int = 0        # prompt tokens the model already held
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    stop_reason: str = ""
    recomputed: bool = False      # the model was reset and the prompt evaluated from the start
    rolled_back: int = 0          # tokens undone with Model.rollback
    restored: bool = False        # the model returned to the checkpoint taken after an earlier prompt
    dropped_messages: int = 0     # messages dropped by context shift

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def generate_tps(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0


@dataclass
class SessionTotals:
    turns: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    recomputes: int = 0
    rollbacks: int = 0
    dropped_messages: int = 0
    ahead_tokens: int = 0        # evaluated by prefill_next_turn, while the user typed

    def add(self, t: TurnStats) -> None:
        self.turns += 1
        self.prefill_tokens += t.prefill_tokens
        self.prefill_seconds += t.prefill_seconds
        self.generated_tokens += t.generated_tokens
        self.generate_seconds += t.generate_seconds
        self.recomputes += int(t.recomputed)
        self.rollbacks += int(t.rolled_back > 0)
        self.dropped_messages += t.dropped_messages


# --------------------------------------------------------------------------------------------- helpers
def followed_by_a_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` and a user message with the STAND_IN text: rendered, it shows where the template
    puts a next message's text, and, the messages rendered as not the last, how they look then."""
    return messages + [{"role": "user", "content": STAND_IN}]


def followed_by_a_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (ending with the user message a prompt asks an answer to), an answer and a next
    message, both STAND_IN: rendered, it shows where the answer's history rendering departs from
    the prompt's generation prompt (Qwen3 without thinking puts an empty think block into the
    latter only)."""
    return messages + [{"role": "assistant", "content": STAND_IN}, {"role": "user", "content": STAND_IN}]


def with_end_marked(message: dict[str, Any]) -> dict[str, Any]:
    """`message` (an assistant's) with STAND_IN after its text, or after its reasoning when it has
    reasoning and no text: rendered, it shows where a continuation of that message begins (the
    answer then continues the text, or the thinking)."""
    marked = dict(message)
    if message.get("reasoning_content") and not message.get("content"):
        marked["reasoning_content"] = message["reasoning_content"] + STAND_IN
    else:
        marked["content"] = (message.get("content") or "") + STAND_IN
    return marked


def common_text_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two texts, found by comparing halving slices (each
    character compared about once, in C): os.path.commonprefix compares them one by one in Python,
    1.3 ms for two renderings of an 8,000-token agent prompt, and `serve` compares up to 9 pairs a
    request (9 us each this way)."""
    lo, hi = 0, min(len(a), len(b))          # a[:lo] == b[:lo]; the prefix is at most hi long
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def tokens_before(tokenize: Callable[[str], list[int]], text: str, end: int, tokens: Sequence[int]) -> int:
    """How many of `tokens` (the tokenization of `text`) the text before character `end` keeps:
    the tokens its own tokenization shares with them."""
    return common_prefix_length(tokenize(text[:end]), tokens) if end > 0 else 0


def partial_suffix(text: str, needles: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `needles`."""
    best = 0
    for s in needles:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopMatcher:
    """Finds stop strings in streamed text, holding back text that may be the start of one.

    `push` returns the text that is safe to show; once a stop string appears, `hit` names it and
    `kept` is the text before it. `kept` always holds everything accepted so far.
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.kept = ""
        self.hit: str | None = None

    def push(self, text: str) -> str:
        if self.hit is not None or not text:
            return ""
        if not self.stops:
            self.kept += text
            return text
        buf = self.pending + text
        found = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            i, s = min(found, key=lambda f: (f[0], -len(f[1])))
            self.hit, self.pending = s, ""
            self.kept += buf[:i]
            return buf[:i]
        hold = partial_suffix(buf, self.stops)
        out, self.pending = buf[:len(buf) - hold], buf[len(buf) - hold:]
        self.kept += out
        return out

    def flush(self) -> str:
        """The held-back text (no stop string followed it)."""
        out, self.pending = self.pending, ""
        if self.hit is None:
            self.kept += out
            return out
        return ""


class ThinkingSplitter:
    """Splits streamed answer text into thinking (`<think>...</think>`, tags included) and answer.

    `push(text)` returns (is_thinking, text) parts; tags split across pieces are held back.
    Start with `thinking=True` when the prompt already opened the think block.
    """

    def __init__(self, thinking: bool = False):
        self.thinking = thinking
        self.pending = ""

    def push(self, text: str) -> list[tuple[bool, str]]:
        buf = self.pending + text
        out: list[tuple[bool, str]] = []
        while True:
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            i = buf.find(tag)
            if i < 0:
                break
            if self.thinking:
                out.append((True, buf[:i + len(tag)]))
            else:
                out += [(False, buf[:i]), (True, tag)]
            buf = buf[i + len(tag):]
            self.thinking = not self.thinking
        hold = partial_suffix(buf, [THINK_CLOSE if self.thinking else THINK_OPEN])
        out.append((self.thinking, buf[:len(buf) - hold]))
        self.pending = buf[len(buf) - hold:]
        return [(k, t) for k, t in out if t]

    def flush(self) -> list[tuple[bool, str]]:
        out, self.pending = self.pending, ""
        return [(self.thinking, out)] if out else []


def opens_thinking(prompt_text: str) -> bool:
    """True when the prompt ends inside an open think block (the answer starts with thinking)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


@contextmanager
def deferred_sigint() -> Iterator[None]:
    """Hold SIGINT until the block is done, then raise KeyboardInterrupt.

    Model.eval updates its bookkeeping after the graph computed; an interrupt in between would
    leave the memory and the token list disagreeing. Only the main thread can handle signals, and
    a handler someone else installed is left alone.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _check_messages(data: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(data, dict):
        fmt = data.get("format", FILE_FORMAT)
        if fmt != FILE_FORMAT:
            raise ChatFileError(f"{where}: not a deltarun conversation (format {fmt!r})")
        version = data.get("version", FILE_VERSION)
        if not isinstance(version, int) or version > FILE_VERSION:
            raise ChatFileError(f"{where}: conversation file version {version!r} is newer than this deltarun "
                                f"understands ({FILE_VERSION})")
        data = data.get("messages")
    if not isinstance(data, list):
        raise ChatFileError(f"{where}: expected a list of messages (or an object with 'messages')")
    out = []
    for i, m in enumerate(data, 1):
        if not isinstance(m, dict):
            raise ChatFileError(f"{where}: message {i} is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatFileError(f"{where}: message {i} has role {role!r} (expected one of {', '.join(ROLES)})")
        if isinstance(content, list):        # a message with images, as `ChatSession.save` writes it
            for part in content:
                if not (isinstance(part, dict) and (
                        (part.get("type") == "text" and isinstance(part.get("text"), str))
                        or (part.get("type") == "image" and isinstance(part.get("image"), str)
                            and isinstance(part.get("digest"), str)))):
                    raise ChatFileError(f"{where}: message {i} has a content part that is neither text nor an "
                                        f"image with its file and digest")
        elif not isinstance(content, str):
            raise ChatFileError(f"{where}: message {i} has no text 'content'")
        out.append(dict(m))
    return out


# --------------------------------------------------------------------------------------------- session
class ChatSession:
    """A conversation with a model; see the module docstring."""

    def __init__(self, model: Model, template: ChatTemplate | None = None, sampler: Sampler | None = None, *,
                 system: str | None = None, enable_thinking: bool | None = None, n_predict: int = -1,
                 stop: Sequence[str] = (), context_shift: bool = False, seq: int = 0,
                 draft: Any = None, draft_max: int = 8, vision: Any = None, reasoning_budget: int = NO_BUDGET):
        self.model = model
        self.template = template if template is not None else ChatTemplate.from_model(model)
        self.sampler = sampler if sampler is not None else Sampler(GREEDY)
        self.enable_thinking = enable_thinking
        self.n_predict = n_predict
        self.stop = [s for s in stop if s]
        self.context_shift = context_shift
        self.seq = seq
        self.draft = draft            # a speculative DraftSource, or None for plain decoding
        self.draft_max = draft_max
        self.draft_stats: Any = None  # GenerationStats of the last turn with a draft
        #: tokens an answer may think before the template's end-of-thinking marker is forced
        #: (llama.cpp's --reasoning-budget: -1 no limit, 0 none); each turn gets a fresh budget
        self.reasoning_budget = check_budget(reasoning_budget)
        self._thinking_tags: ThinkingTags | None = None
        self.messages: list[dict[str, Any]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.last_turn = TurnStats()
        self.totals = SessionTotals()
        self.turn_opens_thinking = False   # set before the first piece of each turn
        self._active: Iterator[str] | None = None
        self._logits: tuple[int, int, np.ndarray] | None = None   # (eval calls, n_past, logits)
        self._checkpoint: Any = None   # recurrent state at the end of the last prompt (Model.checkpoint)
        self.vision = vision           # a VisionEncoder (the mmproj), for attach_image
        self.pending_images: list[Any] = []     # PreparedImages attached to the next message
        self._images: dict[int, Any] = {}       # image token -> PreparedImage, of the messages' images
        self._image_rows: dict[int, np.ndarray] = {}   # image token -> its embedding rows, once encoded
        self._image_files: dict[str, str] = {}  # digest -> the file it was read from (for the saved conversation)
        #: with an MTP draft: what hands it the prompt's hidden rows (`_eval`), and the hidden row
        #: before the checkpoint (`_checkpoint`), whose MTP row a turn resuming there commits again
        #: with the token that follows it in the new prompt
        self._mtp_feed: MtpFeed | None = None
        self._checkpoint_row: tuple[np.ndarray, int] | None = None

    # --- counters ----------------------------------------------------------------------------------
    @property
    def last_prefill_tokens(self) -> int:
        return self.last_turn.prefill_tokens

    @property
    def last_reused_tokens(self) -> int:
        return self.last_turn.reused_tokens

    @property
    def last_generated_tokens(self) -> int:
        return self.last_turn.generated_tokens

    @property
    def last_stop_reason(self) -> str:
        return self.last_turn.stop_reason

    @property
    def last_recomputed(self) -> bool:
        return self.last_turn.recomputed

    @property
    def n_past(self) -> int:
        """Tokens the model holds for this conversation (context used)."""
        return self.model.n_past(self.seq)

    def stats(self) -> dict[str, Any]:
        return {"n_ctx": self.model.n_ctx, "n_past": self.n_past, "messages": len(self.messages),
                "last_turn": asdict(self.last_turn), "totals": asdict(self.totals)}

    # --- conversation ------------------------------------------------------------------------------
    @property
    def system(self) -> str | None:
        if self.messages and self.messages[0].get("role") == "system":
            return self.messages[0]["content"]
        return None

    def set_system(self, text: str | None) -> None:
        """Set (or with None / "" remove) the system prompt; the history is kept."""
        self._finish_active()
        if self.system is not None:
            del self.messages[0]
        if text:
            self.messages.insert(0, {"role": "system", "content": text})

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and the model's memory."""
        self._finish_active()
        self.messages = [m for m in self.messages[:1] if m.get("role") == "system"]
        self.model.reset()
        self._logits = None
        self._mtp_feed = None
        self._checkpoint_row = None
        self.pending_images.clear()
        self._images.clear()
        self._image_rows.clear()

    def save(self, path: str | Path) -> None:
        """Write the conversation as JSON, atomically (a temporary file renamed over `path`)."""
        self._finish_active()
        data = {"format": FILE_FORMAT, "version": FILE_VERSION, "messages": self.messages}
        payload = (json.dumps(data, ensure_ascii=False, indent=2) + "\n").encode("utf-8")
        try:
            write_atomically(path, payload)
        except OSError as e:
            raise ChatFileError(f"cannot save the conversation to {path}: {e.strerror or e}") from e

    def load(self, path: str | Path) -> None:
        """Replace the conversation with the one in `path`; the model catches up on the next turn."""
        self._finish_active()
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            raise ChatFileError(f"cannot load {path}: no such file") from None
        except OSError as e:
            raise ChatFileError(f"cannot load {path}: {e.strerror or e}") from e
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ChatFileError(f"cannot load {path}: not UTF-8 text") from e
        except json.JSONDecodeError as e:
            raise ChatFileError(f"cannot load {path}: not valid JSON ({e.msg} at line {e.lineno} "
                                f"column {e.colno})") from e
        messages = _check_messages(data, str(path))
        self._reattach_images(messages, Path(path))
        self.messages = messages

    # --- prompts -----------------------------------------------------------------------------------
    def render(self, messages: Sequence[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> str:
        return self.template.render(self.messages if messages is None else messages,
                                    add_generation_prompt=add_generation_prompt,
                                    enable_thinking=self.enable_thinking, images=self.vision is not None)

    def tokenize(self, text: str) -> list[int]:
        tok = self.model.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
        add_special = not (bos and text.startswith(bos))   # the template may have written bos itself
        tokens = tok.encode(text, add_special=add_special, parse_special=True)
        images = self._message_images()
        if not images:
            return tokens
        from deltarun.runner.multimodal import place_images, vision_token_ids

        return place_images(tokens, vision_token_ids(self.model)[1], images)[0]

    # --- images ------------------------------------------------------------------------------------
    def attach_image(self, path: str | Path) -> Any:
        """Read an image (PNG, JPEG, WebP, GIF) and attach it to the next message; the PreparedImage."""
        from deltarun.runner.images import load_image

        if self.vision is None:
            raise ImageError("images need the model's vision tower: start chat with --mmproj FILE")
        from deltarun.runner.model import image_token

        image = load_image(Path(path).expanduser(), self.vision.hp)
        self.pending_images.append(image)
        self._images[image_token(image.digest)] = image   # messages name it by its digest
        self._image_files[image.digest] = str(path)
        return image

    def _reattach_images(self, messages: list[dict[str, Any]], saved: Path) -> None:
        """Read again the images a loaded conversation names (each part holds its file and digest):
        a file that is gone or whose pixels changed since the conversation was saved is an error, as
        is a conversation with images in a chat without the vision tower. A relative file is looked
        for where chat ran, then beside the conversation file."""
        from deltarun.runner.images import load_image
        from deltarun.runner.model import image_token

        parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
        if parts and self.vision is None:
            raise ChatFileError(f"cannot load {saved}: the conversation has images; start chat with --mmproj FILE")
        found: dict[str, tuple[Any, str]] = {}
        for part in parts:
            name = Path(part["image"]).expanduser()
            if not name.is_absolute() and not name.exists() and (saved.parent / name).exists():
                name = saved.parent / name
            try:
                image = load_image(name, self.vision.hp)
            except ImageError as e:
                raise ChatFileError(f"cannot load {saved}: {e}") from None
            if image.digest != part["digest"]:
                raise ChatFileError(f"cannot load {saved}: the image {name} has changed since the conversation "
                                    f"was saved")
            found[image.digest] = (image, part["image"])
        for digest, (image, name) in found.items():
            self._images[image_token(digest)] = image
            self._image_files[digest] = name

    def _message_images(self) -> list[Any]:
        """The images of the conversation's messages in the order the template renders them."""
        from deltarun.runner.model import image_token

        out = []
        for m in self.messages:
            content = m.get("content")
            if isinstance(content, list):
                for p in content:
                    if p.get("type") == "image":
                        image = self._images.get(image_token(p.get("digest", "")))
                        if image is None:
                            raise ImageError(f"an image part of the conversation names no attached image "
                                             f"({p.get('image') or p.get('digest')})")
                        out.append(image)
        return out

    def _user_content(self, user_text: str) -> str | list[dict[str, Any]]:
        """The next user message's content: its text, or image parts followed by the text when images
        are attached (the template renders each as <|vision_start|><|image_pad|><|vision_end|>)."""
        if not self.pending_images:
            return user_text
        parts: list[dict[str, Any]] = []
        for img in self.pending_images:
            parts.append({"type": "image", "image": self._image_files.get(img.digest, ""), "digest": img.digest})
        self.pending_images = []
        return parts + [{"type": "text", "text": user_text}]

    def prompt_tokens(self, messages: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Tokens of the conversation rendered with the generation prompt (what a turn evaluates)."""
        return self.tokenize(self.render(messages))

    # --- turns -------------------------------------------------------------------------------------
    def send(self, user_text: str) -> Iterator[str]:
        """Add a user message and stream the answer as text pieces.

        The turn runs while the iterator is consumed; the answer is added to `messages` when it
        ends (or is interrupted). Raises ContextFullError (before any piece) when the conversation
        does not fit, in which case the user message is not kept.
        """
        self._finish_active()
        turn = self._turn(user_text)
        self._active = turn
        return turn

    def ask(self, user_text: str) -> str:
        """`send` and collect the answer."""
        return "".join(self.send(user_text))

    def _finish_active(self) -> None:
        """Close a turn the caller stopped consuming, so its partial answer is recorded."""
        active, self._active = self._active, None
        if active is not None:
            active.close()  # type: ignore[attr-defined]

    def _turn(self, user_text: str) -> Iterator[str]:
        model = self.model
        attached = list(self.pending_images)
        content = self._user_content(user_text)
        self.messages.append({"role": "user", "content": content})
        stats = self.last_turn = TurnStats()
        self.turn_opens_thinking = False
        decoder = StreamDecoder(model.tokenizer)
        stopper = StopMatcher(self.stop)
        answer: list[int] = []
        generating = False
        reason = ""
        decoding: GenerationStats = GenerationStats()
        stream: Iterator[int] | None = None
        prefill_before = 0.0
        try:
            prompt_text, prompt = self._fit_prompt(stats)
            stats.reused_tokens = self._prefill(prompt, stats, self._checkpoint_position(prompt_text, prompt))
            self.turn_opens_thinking = opens_thinking(prompt_text)
            generating = True
            prefill_before = stats.prefill_seconds
            assert self._logits is not None
            logits = self._logits[2]
            how, decoding = self._decoding(answer, stats)
            stream = decode_tokens(model, logits, self.n_predict, self.sampler, seq=self.seq,
                                   stats=decoding, on_token=lambda _: stopper.hit is not None, **how)
            while True:
                with deferred_sigint():   # a step (eval, or eval + rollback) is never cut in half
                    token = next(stream, None)
                if token is None:
                    break
                answer.append(token)
                shown = stopper.push(decoder.push(token))
                if shown:
                    yield shown
            tail = stopper.push(decoder.flush())
            tail += stopper.flush()
            if tail:
                yield tail
            reason = "stop" if stopper.hit is not None else decoding.stop_reason
        except (KeyboardInterrupt, GeneratorExit):
            reason = "interrupted"
            raise
        except BaseException:
            reason = "error"
            raise
        finally:
            if stream is not None:
                stream.close()   # type: ignore[attr-defined]
            stats.generated_tokens = len(answer)
            if generating:   # a context shift's re-evaluation counts as prefill, not generation
                stats.generate_seconds = decoding.generate_seconds - (stats.prefill_seconds - prefill_before)
            stats.stop_reason = reason or "error"
            if generating and (answer or reason not in ("interrupted", "error")):
                stopper.push(decoder.flush())
                stopper.flush()
                self.messages.append({"role": "assistant", "content": stopper.kept})
            elif self.messages and self.messages[-1].get("role") == "user" \
                    and self.messages[-1].get("content") is content:
                self.messages.pop()      # cancelled before the first token: the turn did not happen
                self.pending_images = attached + self.pending_images   # its images wait for the next one
            self.totals.add(stats)

    def _decoding(self, answer: list[int], stats: TurnStats) -> tuple[dict[str, Any], GenerationStats]:
        """`decode_tokens`' arguments for this turn (plain or speculative) and the counters it fills."""
        decoding = GenerationStats()
        processors = self._processors()
        if self.draft is not None:
            self.draft_stats = decoding
            how = {"draft": self.draft, "draft_max": self.draft_max, "processors": processors}
            feed = self._feed()
            if feed is not None:                     # the prompt's last row meets the first token
                how["context"] = feed.context(self.model.n_past(self.seq))
            return how, decoding

        def make_room() -> np.ndarray | None:
            if self.context_shift and self._shift_during_answer(answer, stats):
                assert self._logits is not None
                return self._logits[2]      # the shift evaluated the conversation and the answer so far
            return None

        return {"on_full": make_room, "processors": processors}, decoding

    def _processors(self) -> LogitsProcessors | None:
        """This turn's thinking budget (`reasoning_budget`), from where the prompt leaves the block."""
        if self.reasoning_budget == NO_BUDGET:
            return None
        if self._thinking_tags is None:
            self._thinking_tags = ThinkingTags.of_tokenizer(self.model.tokenizer, self.template.reasoning_separator())
        return LogitsProcessors(budget=thinking_budget(self.reasoning_budget, self._thinking_tags,
                                                       self.turn_opens_thinking, self.model.tokenizer.token_bytes))

    def prefill_next_turn(self) -> int:
        """Evaluate the start of the next turn's prompt now: the conversation followed by a user
        message, rendered and cut where that message's text begins. The template may render the
        answer just given differently from how it was generated (see `_checkpoint_position`), so
        without this the next turn evaluates that answer again before its new message; before the
        first turn it is the system prompt. Meant for the pause while the user types (the
        interactive chat runs it in a thread and waits for it before the next turn). Returns the
        tokens evaluated; 0 when there was nothing to do or the conversation cannot be rendered so
        or does not fit."""
        self._finish_active()
        if self.messages and self.messages[-1].get("role") == "user":
            return 0
        try:
            text = self.render(followed_by_a_message(self.messages), add_generation_prompt=False)
        except (jinja2.TemplateError, DeltarunError):
            return 0
        tokens = self.tokenize(text)
        start = tokens_before(self.tokenize, text, text.rfind(STAND_IN), tokens)
        if start == 0 or start >= self.model.n_ctx:
            return 0
        stats = TurnStats()
        self._prefill(tokens[:start], stats)
        self.totals.ahead_tokens += stats.prefill_tokens
        return stats.prefill_tokens

    # --- model memory ------------------------------------------------------------------------------
    def _reserve(self) -> int:
        """Room for the answer that a context shift tries to leave free."""
        quarter = max(1, self.model.n_ctx // 4)
        return quarter if self.n_predict < 0 else max(1, min(self.n_predict, quarter))

    def _drop_oldest_turn(self) -> int:
        """Drop the oldest exchange (keeping system prompts and the last user message); messages dropped."""
        msgs = self.messages
        start = 0
        while start < len(msgs) and msgs[start].get("role") == "system":
            start += 1
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=-1)
        if start >= last_user:
            return 0
        end = start + 1
        while end < last_user and msgs[end].get("role") != "user":
            end += 1
        del msgs[start:end]
        return end - start

    def _fit_prompt(self, stats: TurnStats) -> tuple[str, list[int]]:
        n_ctx = self.model.n_ctx
        text = self.render()
        prompt = self.tokenize(text)
        if not prompt:
            raise DeltarunError(f"the {self.template.name} rendered an empty prompt")
        saved = list(self.messages)
        if self.context_shift:
            while len(prompt) + self._reserve() > n_ctx:
                dropped = self._drop_oldest_turn()
                if not dropped:
                    break
                stats.dropped_messages += dropped
                text = self.render()
                prompt = self.tokenize(text)
        if len(prompt) > n_ctx:
            what = "this message" if len(self.messages) <= 2 else "the conversation"
            self.messages[:] = saved          # dropping turns did not help: keep the history
            stats.dropped_messages = 0
            raise ContextFullError(f"context full: {what} needs {len(prompt)} tokens but the context holds "
                                   f"{n_ctx}")
        return text, prompt

    def _shift_during_answer(self, answer: list[int], stats: TurnStats) -> bool:
        """Drop old turns so the answer can go on; re-evaluates the shortened conversation."""
        saved = list(self.messages)
        dropped = 0
        while True:
            prompt = self.prompt_tokens()
            if len(prompt) + len(answer) + self._reserve() <= self.model.n_ctx:
                break
            d = self._drop_oldest_turn()
            if not d:
                break
            dropped += d
        if not dropped or len(prompt) + len(answer) >= self.model.n_ctx:
            self.messages = saved
            return False
        stats.dropped_messages += dropped
        self._prefill(prompt + answer, stats)
        return True

    def _feed(self) -> MtpFeed | None:
        """The `MtpFeed` of a draft source that reads the prompt's hidden rows (an MTP block's KV
        rows), else None."""
        if self.draft is None or not getattr(self.draft, "needs_hidden", False):
            return None
        if self._mtp_feed is None or self._mtp_feed.draft is not self.draft:
            self._mtp_feed = MtpFeed(self.draft)
        return self._mtp_feed

    def _eval(self, prompt: list[int], step: tuple[int, int, Any]) -> np.ndarray:
        """Evaluate prompt positions step[0]..step[1] (text, or an image: `prompt_steps`); with an
        MTP draft its rows are handed over (`MtpFeed`)."""
        feed = self._feed()
        wants = feed is not None
        with deferred_sigint():
            if step[2] is None:
                logits = self.model.eval(prompt[step[0]:step[1]], self.seq, all_hidden=wants)
            else:
                from deltarun.runner.multimodal import eval_step, vision_token_ids

                logits = eval_step(self.model, prompt, step, self.seq, self._rows_of,
                                   vision_token_ids(self.model)[1], all_hidden=wants)
            self._logits = (self.model.stats.n_eval_calls, self.model.n_past(self.seq), logits)
            if feed is not None:
                feed.feed(prompt, self.model.last_hidden[0][-(step[1] - step[0]):], step[0])
        return logits

    def _logits_valid(self) -> bool:
        return (self._logits is not None and self._logits[0] == self.model.stats.n_eval_calls
                and self._logits[1] == self.model.n_past(self.seq))

    def _sync(self, prompt: list[int], stats: TurnStats) -> int:
        """Make the model hold a prefix of `prompt`; returns its length (tokens reused). Where it
        resumes (live, rollback, the checkpoint, from scratch) is `runner.resume.plan_resume`'s
        choice; only the one checkpoint of the last prompt is chat's own."""
        memory = self.model.memory
        cp = self._checkpoint
        saved = [Saved("checkpoint", cp.tokens, {cp.n_past: cp}, restorable=memory.can_restore)] \
            if cp is not None else []
        held = Held.of(memory, self.seq, self._logits[2] if self._logits_valid() else None, saved)
        plan = plan_resume(prompt, [held])
        n_held = len(held.tokens)
        if n_held > plan.pos:
            self._logits = None
        if plan.kind == "rollback":
            memory.rollback(plan.n_rollback, self.seq)
            stats.rolled_back += plan.n_rollback
        elif plan.kind == "checkpoint":
            memory.restore(plan.state)     # e.g. Qwen3 re-rendered the last answer without its thinking
            stats.restored = True
        elif plan.kind == "fresh" and n_held:
            memory.clear()
            stats.recomputed = True
        return plan.pos

    def _placed(self, prompt: list[int]) -> list[Any]:
        """Where the conversation's images lie in `prompt` (none without images)."""
        if not self._images:
            return []
        from deltarun.runner.multimodal import find_images

        return find_images(prompt, self._images)

    def _rows_of(self, image: Any) -> np.ndarray:
        """An image's embedding rows, encoded by the vision tower once per conversation."""
        from deltarun.runner.model import image_token

        key = image_token(image.digest)
        if key not in self._image_rows:
            self._image_rows[key] = self.vision.encode(image)
        return self._image_rows[key]

    def _checkpoint_position(self, prompt_text: str, prompt: list[int]) -> int | None:
        """How many tokens of `prompt` the next turn's rendering will surely repeat.

        The template may render this turn's answer differently once it is history: Qwen3 without
        thinking puts an empty think block into the generation prompt but not into earlier
        answers, Qwen3 and Qwen3.5 drop the thinking of earlier answers. Rendering the
        conversation followed by a placeholder answer and message shows where that starts
        (usually right after the assistant header); the state checkpoint is taken there, so the
        next turn goes back to it and evaluates only what follows (llama.cpp likewise keeps a
        checkpoint a few tokens before the end of the prompt).
        """
        try:
            text = self.render(followed_by_a_turn(self.messages), add_generation_prompt=False)
        except (jinja2.TemplateError, DeltarunError):
            return None
        same = common_text_prefix(prompt_text, text)
        if same == len(prompt_text):
            return len(prompt)
        return tokens_before(self.tokenize, prompt_text, same, prompt) if same else None

    def _prefill(self, prompt: list[int], stats: TurnStats, checkpoint_at: int | None = None) -> int:
        """Evaluate what the model lacks of `prompt`; returns the tokens reused. With checkpoint_at,
        the recurrent state is checkpointed after that many prompt tokens (when they are new)."""
        t0 = time.perf_counter()
        n = self._sync(prompt, stats)
        feed = self._feed()
        if feed is not None and self._checkpoint_row is not None and self._checkpoint_row[1] == n - 1:
            # resumed at the checkpoint: the row before it meets this prompt's next token (a resume by
            # rollback into an answer leaves that row with the token it was committed with: drafts
            # only, never the output)
            feed.resume(*self._checkpoint_row)
        cut = checkpoint_at if checkpoint_at is not None and 0 < checkpoint_at and n <= checkpoint_at <= len(prompt) \
            else None
        done = 0
        try:
            from deltarun.runner.multimodal import prompt_steps

            placed = self._placed(prompt)
            for begin, end in ((n, cut), (cut, len(prompt))) if cut is not None else ((n, len(prompt)),):
                # one eval per ubatch (the same split Model.eval makes), so Ctrl-C can stop a long
                # prefill; an image is one step
                for step in prompt_steps(begin, end, placed, self.model.split_ubatches) if end > begin else []:
                    self._eval(prompt, step)
                    done += step[1] - step[0]
                if end == cut and hasattr(self.model, "checkpoint"):
                    self._checkpoint = self.model.checkpoint(self.seq)
                    if feed is not None and feed.tail is not None and feed.tail[1] == cut - 1:
                        self._checkpoint_row = feed.tail
        finally:
            stats.prefill_tokens += done
            stats.prefill_seconds += time.perf_counter() - t0
        return n
