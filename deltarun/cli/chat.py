"""`deltarun chat`: a multi-turn conversation, interactive or driven through stdin.

The conversation logic is `deltarun.apps.chat.ChatSession`; this module reads lines, runs the
slash commands and prints the streamed answers (thinking dimmed or hidden).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import click

from deltarun.base.errors import ContextFullError, DeltarunError
from deltarun.cli.options import (draft_options, model_argument, model_options, open_with_draft,
                                  reasoning_budget_option, sampling_options, sampling_params)
from deltarun.cli.text_io import silence_stdout

HELP = """\
Commands:
  /help           this list
  /reset          forget the conversation (the system prompt stays)
  /system [TEXT]  set the system prompt (without TEXT: show it; /system - removes it)
  /save FILE      write the conversation as JSON
  /load FILE      read a conversation written by /save
  /stats          tokens, speed and context used
  /image PATH     attach an image (PNG, JPEG, WebP, GIF) to the next message (needs --mmproj)
  /exit           quit (Ctrl-D does too)
Ctrl-C stops an answer. A line starting with // sends it as a message beginning with /.
End a line with \\ to continue the message on the next line."""


def _err(text: str) -> None:
    click.echo(text, err=True)


def _tps(n: int, seconds: float) -> str:
    return f"{n / seconds:.2f} t/s" if seconds > 0 and n else "-"


class ChatUI:
    """Prints answers and runs slash commands for one ChatSession."""

    def __init__(self, session: Any, hide_thinking: bool = False, context_shift: bool = False):
        self.session = session
        self.hide_thinking = hide_thinking
        self.context_shift = context_shift
        self._after_think = False

    # --- answers -------------------------------------------------------------------------------
    def answer(self, text: str, raise_errors: bool = False) -> bool:
        """Stream the answer to `text`; False when Ctrl-C stopped it or the context had no room.

        A full context is reported (or raised with raise_errors).
        """
        from deltarun.apps.chat import ThinkingSplitter

        session = self.session
        stream = session.send(text)
        splitter = None
        self._after_think = False
        try:
            try:
                for piece in stream:
                    if splitter is None:
                        splitter = ThinkingSplitter(session.turn_opens_thinking)
                    self._show(splitter.push(piece))
                if splitter is not None:
                    self._show(splitter.flush())
            finally:
                if splitter is not None or session.last_stop_reason in ("eog", "stop", "length", "context"):
                    click.echo("")
        except KeyboardInterrupt:
            stream.close()  # records the partial answer if the interrupt came while printing
            _err("[interrupted]")
            return False
        except ContextFullError as e:
            if raise_errors:
                raise
            _err(f"{e}. Type /reset to start over" +
                 ("." if self.context_shift else " (or restart with --context-shift to drop old turns)."))
            return False
        if session.last_stop_reason == "context":
            _err(f"[context full: {session.n_past}/{session.model.n_ctx} tokens used; the answer was cut. "
                 "Type /reset to start over" +
                 ("]" if self.context_shift else " or restart with --context-shift]"))
        if session.last_turn.dropped_messages:
            _err(f"[context shift: dropped the {session.last_turn.dropped_messages} oldest messages]")
        return True

    def _show(self, parts: list[tuple[bool, str]]) -> None:
        for thinking, text in parts:
            if thinking:
                if self.hide_thinking:
                    self._after_think = True
                else:
                    click.echo(click.style(text, dim=True), nl=False)
                continue
            if self._after_think:
                text = text.lstrip("\n")
                if not text:
                    continue
                self._after_think = False
            click.echo(text, nl=False)

    # --- lines and commands ----------------------------------------------------------------------
    def handle(self, line: str) -> bool:
        """Run one input line (a message or a /command); False means quit."""
        if line.startswith("//"):
            line = line[1:]
        elif line.startswith("/"):
            name, _, arg = line[1:].partition(" ")
            command = COMMANDS.get(name.lower())
            if command is None:
                _err(f"unknown command /{name}; /help lists the commands")
                return True
            try:
                return command(self, arg.strip()) is not False
            except DeltarunError as e:
                _err(f"error: {e}")
                return True
        if not line.strip():
            return True
        try:
            self.answer(line)
        except DeltarunError as e:
            _err(f"error: {e}")
        return True

    def cmd_help(self, arg: str) -> None:
        _err(HELP)

    def cmd_exit(self, arg: str) -> bool:
        return False

    def cmd_reset(self, arg: str) -> None:
        self.session.reset()
        _err("[conversation reset]")

    def cmd_system(self, arg: str) -> None:
        if not arg:
            current = self.session.system
            _err(f"system prompt: {current!r}" if current is not None else "no system prompt")
            return
        self.session.set_system(None if arg == "-" else arg)
        _err("[system prompt removed]" if arg == "-" else "[system prompt set]")

    def cmd_save(self, arg: str) -> None:
        if not arg:
            _err("usage: /save FILE")
            return
        path = Path(arg).expanduser()
        self.session.save(path)
        _err(f"[saved {len(self.session.messages)} messages to {path}]")

    def cmd_load(self, arg: str) -> None:
        if not arg:
            _err("usage: /load FILE")
            return
        path = Path(arg).expanduser()
        self.session.load(path)
        _err(f"[loaded {len(self.session.messages)} messages from {path}]")

    def cmd_image(self, arg: str) -> None:
        if not arg:
            _err("usage: /image PATH")
            return
        image = self.session.attach_image(arg)
        h, w = image.merged_hw
        _err(f"[image {arg} attached to the next message: {h * w} tokens ({h} x {w})]")

    def cmd_stats(self, arg: str) -> None:
        s = self.session
        n_ctx, n_past = s.model.n_ctx, s.n_past
        t, tot = s.last_turn, s.totals
        lines = [f"context: {n_past} / {n_ctx} tokens ({100.0 * n_past / n_ctx:.1f}%), "
                 f"{len(s.messages)} messages"]
        if tot.turns:
            how = " (recomputed)" if t.recomputed else (f" (rolled back {t.rolled_back})" if t.rolled_back else "")
            lines.append(f"last turn: prompt {t.prefill_tokens} tokens evaluated, {t.reused_tokens} reused{how}, "
                         f"{_tps(t.prefill_tokens, t.prefill_seconds)}; generated {t.generated_tokens} tokens, "
                         f"{_tps(t.generated_tokens, t.generate_seconds)}; stop: {t.stop_reason}")
            spec = s.draft_stats
            if spec is not None:
                lines.append(f"speculative: {spec.n_accepted}/{spec.n_drafted} drafts accepted "
                             f"({spec.acceptance:.1%}), {spec.tokens_per_step:.2f} tokens per verification step")
            lines.append(f"session: {tot.turns} turns; prompt {tot.prefill_tokens} tokens, "
                         f"{_tps(tot.prefill_tokens, tot.prefill_seconds)} (and {tot.ahead_tokens} evaluated "
                         f"while you typed); generated {tot.generated_tokens} "
                         f"tokens, {_tps(tot.generated_tokens, tot.generate_seconds)}; "
                         f"{tot.recomputes} recomputes, {tot.rollbacks} rollbacks")
        _err("\n".join(lines))


COMMANDS: dict[str, Callable[[ChatUI, str], Any]] = {
    "help": ChatUI.cmd_help, "?": ChatUI.cmd_help, "exit": ChatUI.cmd_exit, "quit": ChatUI.cmd_exit,
    "reset": ChatUI.cmd_reset, "system": ChatUI.cmd_system, "save": ChatUI.cmd_save, "load": ChatUI.cmd_load,
    "stats": ChatUI.cmd_stats, "image": ChatUI.cmd_image,
}


# --- interactive input -------------------------------------------------------------------------
def _history_path() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "deltarun" / "chat_history"


def _setup_readline() -> Callable[[], None]:
    """Line editing and a persistent history; returns the function that saves the history."""
    try:
        import readline
    except ImportError:  # pragma: no cover - no readline (Windows)
        return lambda: None
    path = _history_path()
    try:
        readline.read_history_file(path)
    except (OSError, ValueError):
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass

    return save


def _read_message() -> str:
    line = input("> ")
    while line.endswith("\\"):
        line = line[:-1] + "\n" + input("… ")
    return line


def _repl(ui: ChatUI) -> None:
    """Read and run lines until Ctrl-D or /exit. While the user types, a thread evaluates the start
    of the next turn's prompt (`ChatSession.prefill_next_turn`); the line waits for it."""
    save_history = _setup_readline()
    _err("Type a message; /help lists the commands, Ctrl-C stops an answer, Ctrl-D or /exit quits.")
    ahead: threading.Thread | None = None
    try:
        while True:
            if ahead is None:
                ahead = threading.Thread(target=_prefill_next_turn, args=(ui.session,), daemon=True)
                ahead.start()
            try:
                line = _read_message()
            except EOFError:
                click.echo("")
                break
            except KeyboardInterrupt:
                click.echo("")
                _err("(Ctrl-D or /exit quits)")
                continue
            ahead.join()
            ahead = None
            if not ui.handle(line):
                break
    finally:
        if ahead is not None:
            ahead.join()
        save_history()


def _prefill_next_turn(session: Any) -> None:
    try:
        session.prefill_next_turn()
    except DeltarunError:        # the turn itself will meet and report whatever this was
        pass


def _open_vision(mmproj: Path, model: Any) -> Any:
    """The vision tower of `mmproj`, checked against the text model (hidden size, architecture)."""
    from deltarun.runner.multimodal import vision_token_ids
    from deltarun.runner.vision import VisionEncoder

    enc = VisionEncoder(mmproj, backend=model.backend)
    try:
        enc.check_text_model(model.hp.n_embd, model.family.arch)
        vision_token_ids(model)
    except BaseException:
        enc.close()
        raise
    return enc


@click.command("chat")
@model_argument()
@click.option("--system", default=None, metavar="TEXT", help="System prompt.")
@click.option("--think/--no-think", default=None,
              help="Qwen3 thinking switch (enable_thinking) [default: the template's, thinking on].")
@click.option("--hide-thinking", is_flag=True, help="Do not show the <think>...</think> part of answers.")
@click.option("--n-predict", "-n", type=click.IntRange(min=-1), default=-1, show_default=True,
              help="Most tokens per answer (-1: until the end of the turn or a full context).")
@click.option("--stop", multiple=True, metavar="TEXT",
              help="End the answer at this text (not shown); may be given several times.")
@click.option("--context-shift", is_flag=True,
              help="When the context is full, drop the oldest turns (the system prompt stays) and go on.")
@click.option("--single", is_flag=True, help="Read all of stdin as one message, answer it and exit.")
@click.option("--mmproj", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The model's vision tower (mmproj-*.gguf): /image PATH attaches an image to the next message.")
@draft_options
@reasoning_budget_option
@sampling_options
@model_options
def chat(model: Path | None, system: str | None, think: bool | None, hide_thinking: bool, n_predict: int,
         stop: tuple[str, ...], context_shift: bool, single: bool, draft: str | None, draft_max: int,
         mmproj: Path | None = None, reasoning_budget: int = -1, **opts: Any) -> None:
    """Chat with MODEL.gguf using the chat template stored in the file.

    On a terminal this is an interactive prompt with line editing and history. Otherwise stdin is
    read one message (or /command) per line, or as a single message with --single, and the
    answers are printed one after the other. Without MODEL the built-in model (a small Qwen3-Next
    trained on Shakespeare) is used.
    """
    from deltarun.apps.chat import ChatSession
    from deltarun.base.chat_template import ChatTemplate
    from deltarun.runner.sampling import Sampler

    stdin = sys.stdin
    if stdin is None or stdin.closed:
        raise DeltarunError("stdin is closed: chat reads its messages from stdin (a terminal, a pipe or a file)")
    interactive = not single and stdin.isatty()
    if single:
        message = stdin.read().rstrip("\n")
        if not message.strip():
            raise DeltarunError("--single: no message on stdin")
    elif not interactive:
        first = stdin.readline()
        if not first:
            raise DeltarunError("no message on stdin: pipe the messages one per line (or run chat on a terminal)")
        lines = itertools.chain([first], stdin)
    params = sampling_params(**opts)
    if interactive:
        _err(f"loading {model or 'the built-in model'} ...")
    t_load = time.perf_counter()
    m, source = open_with_draft(model, draft, draft_max, **opts)
    with m, contextlib.ExitStack() as stack:
        vision = stack.enter_context(_open_vision(mmproj, m)) if mmproj is not None else None
        template = ChatTemplate.from_model(m)
        if template.is_builtin:
            _err("the model file has no chat template: using the built-in Qwen3 ChatML template")
        session = ChatSession(m, template, Sampler(params), system=system, enable_thinking=think,
                              n_predict=n_predict, stop=stop, context_shift=context_shift, draft=source,
                              draft_max=draft_max, vision=vision, reasoning_budget=reasoning_budget)
        if interactive:
            _err(f"{m.path} loaded in {time.perf_counter() - t_load:.2f} s ({m.n_ctx} ctx, {m.backend.name})")
        ui = ChatUI(session, hide_thinking=hide_thinking, context_shift=context_shift)
        try:
            if single:
                if not ui.answer(message, raise_errors=True):
                    raise SystemExit(130)
            elif interactive:
                _repl(ui)
            else:
                for raw in lines:
                    if not ui.handle(raw.rstrip("\r\n")):
                        break
        except BrokenPipeError:
            silence_stdout()
            raise SystemExit(0)
        except KeyboardInterrupt:   # while reading input
            click.echo("", err=True)
            raise SystemExit(130)
        finally:
            if source is not None:
                source.close()
        tot = session.totals
        if not interactive and tot.turns:
            _err(f"chat: {tot.turns} turns; prompt {tot.prefill_tokens} tokens ({_tps(tot.prefill_tokens, tot.prefill_seconds)}), "
                 f"generated {tot.generated_tokens} tokens ({_tps(tot.generated_tokens, tot.generate_seconds)})"
                 + ("" if params.greedy else f"; seed {params.seed}"))
