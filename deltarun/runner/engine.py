"""The decode engine: one step for every running sequence, with or without drafts.

    engine = Engine(model)
    s = Running(seq=0, sampler=Sampler(params), history=model.tokens(0))
    engine.first(s, prompt_logits)          # the first token, from the prompt's last row
    while ...:
        outcome, = engine.step([s])         # evaluate the last token (and drafts), keep tokens

`generate`, `chat` and speculative decoding (`generation.decode_tokens`) are its one-sequence
case; the server's worker calls `step` with every generating request's sequence and keeps only
the scheduling (admission, prompt chunks, work ahead, cancellation, the prompt cache).

One step: each sequence that drafts (`Running.length` set) gets its drafts (`speculative.propose`;
its logits processors verify them on a fork that walks the drafts: `sampling.accept_draft`); the
sequences are evaluated in runs of consecutive memory sequences, one ubatch per run whose rows
all hold the same number of tokens: the last token plus the most drafts any of them has, a
sequence with fewer drafts padded with filler. Then per sequence: drafts accepted or not
(`speculative.verify`: the longest agreeing prefix, or speculative sampling's min(1, p/q) rule) or,
without drafts, the next token drawn from the first row (the plain rows of a run drawn together,
`sampling.sample_rows`); the rows past the kept ones rolled back; the draft source handed the kept
rows (an MTP source fills its KV rows for every sequence, drafting or not); the kept tokens counted
by the sequence's logits processors and appended to its history. While decoding is bound by
reading the weights, one ubatch of L x n_seqs tokens costs little more than one of n_seqs tokens,
which is why filler is chosen over a second ubatch for the sequences without drafts.

A failure (a grammar's mask, a draft source) ends that sequence's step with `Outcome.error`, never
the others'; an evaluation that fails fails its run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deltarun.base.errors import DeltarunError
from deltarun.base.ggml_compat import ggml, wide_columns
from deltarun.runner.model import Model, PromptChunk
from deltarun.runner.sampling import LogitsProcessors, Sampler, sample_rows
from deltarun.runner.speculative import (Draft, DraftLength, DraftSource, MtpDraft, commit_held, commit_kept,
                                         draft_count, propose_mtp, verify)

#: what a sequence that wants no limit has as its budget
NO_LIMIT = 1 << 31


@dataclass(eq=False)
class Running:
    """A sequence the engine decodes: its place in memory, how it samples, what it drafts with.

    `history` holds every token so far, prompt included; its last token (`pending`) is the one the
    next step evaluates. `draft` alone (no `length`): the source is handed the kept rows but no
    drafts are verified (the source still fills its cell's MTP rows).
    """

    seq: int
    sampler: Sampler
    history: list[int]
    processors: LogitsProcessors | None = None
    draft: DraftSource | None = None
    length: DraftLength | None = None     # drafts proposed and verified (None: no drafts)
    budget: int = NO_LIMIT                # tokens still wanted, the next one included (bounds the drafts)
    #: a plain step (one token, no drafts) saves the state it started from, so that the caller can
    #: still undo that token within the rollback slots (chat's stop strings, the server's prompt
    #: cache); `generate` never does and turns it off (a copy of every recurrent state per step)
    undoable: bool = True
    n_steps: int = 0                      # ubatches evaluated for it
    n_drafted: int = 0
    n_accepted: int = 0

    @property
    def pending(self) -> int:
        """The last token: sampled, not evaluated yet."""
        return self.history[-1]

    def drafts_next_step(self) -> bool:
        """Whether the next step may draft: not while `length` pauses drafting, never without one.
        Until then an MTP source's rows need no logits: they wait, and are evaluated together
        (one MTP ubatch) when drafting resumes or the sequence ends (`MtpDraft.evaluate_deferred`)."""
        return self.length is not None and self.length.paused == 0


@dataclass
class Outcome:
    """What one step kept for one sequence."""

    #: kept tokens: accepted drafts, then the next one (none when a draft completed the grammar:
    #: the output ends there and the sequence holds every kept token)
    tokens: list[int] = field(default_factory=list)
    logits: np.ndarray | None = None     # [len(tokens), vocab]: the row each kept token was drawn from
    hidden: np.ndarray | None = None     # [n_accepted + 1, n_embd]: the hidden rows the sequence kept
    n_drafted: int = 0
    n_accepted: int = 0
    full: bool = False                   # no room left in the context for the pending token
    error: Exception | None = None


class Engine:
    """Decoding steps on one model (see the module docstring)."""

    #: rows of one step (sequences x tokens each) a CPU evaluates for at most about twice the
    #: cost of one: the AVX-512 matrix kernels read the weights once for up to 8 columns (8 cost
    #: 1.5x one at Qwen3.5-0.8B's shapes, bench/RESULTS.md "Small ubatches"), and where most of a
    #: model's matrix bytes are of a type ggml multiplies 16 columns at once (`wide_columns`: AMX
    #: tiles of Q8_0, F16, BF16, Q4_K, Q6_K; Q8_0's column lanes on AVX-512 VNNI CPUs) 16 columns
    #: cost 1.2-2.1x one (`cpu_step_rows`)
    CPU_ROWS = 8
    WIDE_ROWS = 16

    def __init__(self, model: Model, max_rows: int | None = None):
        self.model = model
        #: drafts are cut so that a step's ubatch holds at most this many rows, when several
        #: sequences share it (None: no limit; default CPU_ROWS on the CPU, none on a GPU)
        self.max_rows = max_rows if max_rows is not None else (cpu_step_rows(model) if model.backend.is_cpu else None)
        #: the last step's ubatches: (its sequences, tokens per row), for traces and tests
        self.last_runs: list[tuple[list[Running], int]] = []

    def first(self, s: Running, logits: np.ndarray,
              context: tuple[list[int], np.ndarray | None, int] | None = None) -> int:
        """The token following the evaluated history (`logits`: its last row), appended to it.

        `context` = (tokens following each hidden row but the last, hidden rows, the first row's
        position) of what the draft source has not seen yet: it is handed them with the new token
        after the last row (an MTP source's KV rows for a prompt's last positions)."""
        token = s.sampler.sample(logits, s.history, s.processors)
        self._keep(s, [token])
        if context is not None and s.draft is not None:
            follow, rows, start = context
            if rows is not None or not s.draft.needs_hidden:
                s.draft.commit(follow + [token], rows, start)
        return token

    def step(self, running: list[Running], ride: PromptChunk | None = None) -> list[Outcome]:
        """One step for every sequence (see the module docstring); outcomes in `running`'s order.

        `ride`: a prompt chunk of another sequence (`Model.eval_batch(..., ride=...)`): it goes into
        the first ubatch that can take it (every weight read once for both), else it is evaluated
        apart; its logits, when asked for, are then in `Model.last_ride_logits`. An error evaluating
        it leaves its sequence short of the chunk (the caller checks `Model.n_past`)."""
        model = self.model
        outcomes = {id(s): Outcome() for s in running}
        if ride is not None:
            try:
                model.check_chunk(ride)
            except DeltarunError:         # not evaluated: its sequence stays short of it
                ride = None
        proposals: dict[int, Draft] = {}
        # drafts per sequence within the row budget: 4 sequences on a CPU draft 1 each, 8 none; a
        # riding prompt chunk's rows come first (a queued request's first token waits for them)
        budget = self.max_rows - len(ride.tokens) if self.max_rows and ride is not None else self.max_rows
        cap = max(0, budget // len(running) - 1) if self.max_rows and (len(running) > 1 or ride is not None) else None
        wanted: dict[int, int] = {}
        for s in running:
            room = model.n_ctx - model.n_past(s.seq) - 1
            if room < 0:
                outcomes[id(s)].full = True
                continue
            drafting = s.length is not None and s.draft is not None
            wanted[id(s)] = draft_count(s.length, s.budget, min(room, cap if cap is not None else room)) \
                if drafting else 0
        chained = self._chain_mtp_drafts([s for s in running if wanted.get(id(s), 0) > 1], wanted)
        for s in running:
            if id(s) not in wanted:
                continue
            try:
                k = wanted[id(s)]
                proposals[id(s)] = chained[id(s)] if id(s) in chained else \
                    s.draft.propose(s.history, k, s.sampler) if k else Draft([], [])
            except Exception as e:  # noqa: BLE001 - a failing draft source ends its sequence's step
                outcomes[id(s)].error = e
        live = sorted((s for s in running if id(s) in proposals), key=lambda s: s.seq)
        self.last_runs = []
        # the MTP sources that fill their rows at once fill them together, after every run; those
        # whose sequence does not draft next step keep them waiting (a paused source then costs
        # what plain decoding costs, as a deferring one does)
        held = [s for s in live if isinstance(s.draft, MtpDraft) and not s.draft.defer]
        for s in held:
            s.draft.hold = True
        try:
            for run in _runs(live):
                ride = self._run(run, proposals, outcomes, ride)
            if ride is not None:
                self._ride_apart(ride)
        finally:
            for s in held:
                s.draft.hold = False
        errors = commit_held(self.model, [s.draft for s in held if s.draft.deferred and s.drafts_next_step()])
        for s in held:
            if s.seq in errors and outcomes[id(s)].error is None:
                outcomes[id(s)].error = errors[s.seq]
        return [outcomes[id(s)] for s in running]

    def _chain_mtp_drafts(self, chaining: list[Running], wanted: dict[int, int]) -> dict[int, Draft]:
        """The chained drafts of the MTP sources among `chaining`, in lockstep (`propose_mtp`: one
        MTP ubatch per chain level for consecutive sequences), when there are several; {} when
        not, or when an evaluation fails (each then proposes alone and reports its own error)."""
        mtp = [s for s in chaining if isinstance(s.draft, MtpDraft)]
        if len(mtp) < 2:
            return {}
        try:
            drafts = propose_mtp(self.model, [(s.draft, s.history, wanted[id(s)], s.sampler) for s in mtp])
        except Exception:  # noqa: BLE001
            return {}
        return {id(s): d for s, d in zip(mtp, drafts)}

    # --- one ubatch ------------------------------------------------------------------------------
    def _ride_apart(self, ride: PromptChunk) -> None:
        try:
            self.model.eval_chunk(ride)
        except Exception:  # noqa: BLE001 - reported through the sequence's length (see step)
            pass

    def _run(self, run: list[Running], proposals: dict[int, Draft], outcomes: dict[int, Outcome],
             ride: PromptChunk | None = None) -> PromptChunk | None:
        """Evaluate a run of consecutive sequences in one ubatch and settle each; `ride` with it
        where it can go along (returned when it did not)."""
        model = self.model
        width = 1 + max(len(proposals[id(s)].tokens) for s in run)
        # within the context, and within the rollback slots: all drafts rejected undo width - 1 tokens
        width = min([width, model.rs_slots] + [model.n_ctx - model.n_past(s.seq) for s in run])
        for s in run:
            d = proposals[id(s)]
            proposals[id(s)] = Draft(d.tokens[:width - 1], d.probs[:width - 1])
        batch = {s.seq: ([s.pending] + proposals[id(s)].tokens + [s.pending] * width)[:width] for s in run}
        self.last_runs.append((run, width))
        only = run[0] if len(run) == 1 else None
        # a greedy MTP source: the verification graph also runs the MTP block on its argmax rows
        # (not without drafts when the source defers, holds rows waiting or its sequence does not
        # draft next step: the row joins those aside, one MTP ubatch for all; not beside a riding
        # prompt chunk: the chunk takes this graph, and the source fills its rows afterwards with
        # the other held sources, as in a run of several sequences, for one MTP ubatch of a few
        # rows instead of a second pass over every weight for the chunk alone)
        in_graph = ride is None and only is not None and isinstance(only.draft, MtpDraft) and \
            only.draft.wants_mtp_argmax(only.sampler) and \
            (bool(proposals[id(only)].tokens) or
             (only.drafts_next_step() and not only.draft.defer and not only.draft.deferred))
        # a verification ubatch undoes at most its drafted rows: the state it started from is not
        # saved (UbatchShape.keep_start), nor by a one-token step of sequences that draft (their
        # slots serve the drafts: a paused source's steps then cost what plain decoding costs); a
        # one-token step without drafts keeps it, so that the token it evaluated can still be
        # undone within the rollback slots (a stop string's leftover, chat.py), when a sequence of
        # the run may be rolled back (`Running.undoable`)
        keep_start = width == 1 and all(s.draft is None for s in run) and any(s.undoable for s in run)
        try:
            if only is not None and ride is None:
                out = {only.seq: model.eval(batch[only.seq], only.seq, all_logits=width > 1 or in_graph,
                                            mtp_argmax=in_graph, keep_start=keep_start)}
            else:
                out = model.eval_batch(batch, all_logits=width > 1, keep_start=keep_start, ride=ride)
        except Exception as e:  # noqa: BLE001 - the run's sequences fail, not the others
            for s in run:
                outcomes[id(s)].error = e
            return None
        ride = None
        hidden = model.last_hidden
        rows = {s.seq: np.atleast_2d(out[s.seq]) for s in run}
        plain = [s for s in run if not proposals[id(s)].tokens]
        drawn = self._draw_rows(plain, [rows[s.seq][0] for s in plain], outcomes)
        for i, s in enumerate(run):
            o = outcomes[id(s)]
            if o.error is not None:
                if width > 1:
                    model.rollback(width - 1, s.seq)
                continue
            h = hidden[i] if hidden is not None and s.draft is not None and s.draft.needs_hidden else None
            try:
                self._settle(s, proposals[id(s)], rows[s.seq], h, drawn.get(id(s)), o)
            except Exception as e:  # noqa: BLE001 - ends this sequence's step alone
                o.error = e

    def _draw_rows(self, plain: list[Running], rows: list[np.ndarray],
                   outcomes: dict[int, Outcome]) -> dict[int, int]:
        """The next token of each sequence without drafts: together (`sample_rows`) for those
        without a grammar (whose mask is the one processor that may fail), alone for the others."""
        drawn: dict[int, int] = {}
        together = [i for i, s in enumerate(plain) if s.processors is None or s.processors.grammar is None]
        if len(together) > 1:
            try:
                tokens = sample_rows([plain[i].sampler for i in together], np.stack([rows[i] for i in together]),
                                     [plain[i].history for i in together], [plain[i].processors for i in together])
                drawn = {id(plain[i]): t for i, t in zip(together, tokens)}
            except Exception:  # noqa: BLE001 - each then draws alone and reports its own error
                drawn = {}
        for s, row in zip(plain, rows):
            if id(s) not in drawn:
                try:
                    drawn[id(s)] = s.sampler.sample(row, s.history, s.processors)
                except Exception as e:  # noqa: BLE001
                    outcomes[id(s)].error = e
        return drawn

    def _settle(self, s: Running, proposal: Draft, rows: np.ndarray, hidden: np.ndarray | None,
                drawn: int | None, o: Outcome) -> None:
        """Accept (or draw), roll back the rest of the row, hand the draft source the kept rows."""
        model = self.model
        if proposal.tokens:
            n_ok, kept = verify(model, s.seq, rows, proposal, s.sampler, s.history, processors=s.processors,
                                source=s.draft, hidden=hidden, length=s.length)
        else:
            if len(rows) > 1:
                model.rollback(len(rows) - 1, s.seq)
            n_ok, kept = 0, [drawn]
            commit_kept(s.draft, model, s.seq, kept, hidden, 1)
        o.tokens, o.logits = kept, rows[:len(kept)]
        o.hidden = hidden[:n_ok + 1] if hidden is not None else None
        o.n_drafted, o.n_accepted = len(proposal.tokens), n_ok
        s.n_steps += 1
        s.n_drafted += o.n_drafted
        s.n_accepted += n_ok
        self._keep(s, kept)

    def _keep(self, s: Running, tokens: list[int]) -> None:
        """Kept tokens join the history and count for the logits processors (an end-of-generation
        token ends the sequence: the grammar is not moved past it)."""
        for t in tokens:
            s.history.append(t)
            if s.processors is not None and not self.model.tokenizer.is_eog(t):
                s.processors.accept(t)


def cpu_step_rows(model: Model) -> int:
    """`Engine.max_rows` on a CPU: WIDE_ROWS when most of the layers' matrix bytes are of a type this
    ggml multiplies by that many columns at once (`wide_columns`), else CPU_ROWS."""
    matrices = [info for name, info in model.file.tensors.items() if name.startswith("blk.") and len(info.ne) >= 2]
    wide = {t for t in {info.ggml_type for info in matrices} if wide_columns(t) >= Engine.WIDE_ROWS}
    covered = sum(info.nbytes for info in matrices if info.ggml_type in wide)
    return Engine.WIDE_ROWS if 2 * covered > sum(info.nbytes for info in matrices) else Engine.CPU_ROWS


def _runs(running: list[Running]) -> list[list[Running]]:
    """Sequences (sorted by memory sequence) grouped into runs of consecutive ones: one ubatch each."""
    runs: list[list[Running]] = []
    for s in running:
        if runs and runs[-1][-1].seq + 1 == s.seq:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs
