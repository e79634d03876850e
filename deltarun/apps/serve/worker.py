"""The model worker: one thread owns the Model and schedules every request's sequence.

Request handlers (on the event loop) submit a `Job` and read `Event`s back; nothing else touches
the model. The worker loops over steps; each step

1. admits waiting jobs into idle sequences, resuming each from the prompt cache;
2. evaluates one prompt chunk of the oldest job still prefilling, so a long prompt delays the
   running streams by one chunk. While others decode the chunk rides along their decode step
   (step 3: one graph, `Worker._ride`, `Engine.step(..., ride=...)`): its rows share the step's
   reads of the weights, sized first to fill the engine's row budget, then halved or doubled
   with what riding adds to the step (`_adapt_ride`), and the prompt's last chunk brings its
   logits (the first token). Riding or apart (nobody decoding, an image): the checkpoint
   positions inside a chunk (message boundaries) are captured by the same graph evaluation when
   the model has capture slots (`serve` opens it with CAPTURE_SLOTS; a chunk then ends early only
   past that many), else the chunk ends there. With nobody decoding a chunk is `chunk`
   tokens; while others decode, its size (a power of two, >= MIN_CHUNK, so few graph shapes) is
   adjusted after each chunk so that it takes about STALL_FACTOR decode steps: the streams'
   inter-token latency stays within about (1 + STALL_FACTOR) x what it is without the prefill;
3. decodes one token for every generating job: their last tokens go into one ubatch
   (`Model.eval_batch` evaluates equal-length token lists of consecutive seqs together; when
   they are not consecutive, because a finished job left a hole or a job reading its prompt sits
   between them, the running sequences are first rearranged with `PromptCache.swap`), then each
   job samples its next token. With `--draft` (speculative decoding) each generating job first
   gets its own drafts (as many as it had accepted last time plus one, up to draft_max), and the
   ubatch verifies every job's pending token plus its drafts: all rows hold the same number L of
   tokens (1 + the most drafts any job has, within the context and the rollback slots), a job
   with fewer drafts (or none: its source paused) is padded with filler tokens, and after
   verification each job rolls back what it did not keep (rejected drafts and filler, at most
   L-1 <= rs_slots-1 tokens). While decoding is bound by reading the weights, one ubatch of
   L x n_seqs tokens costs little more than one of n_seqs tokens, which is why padding is chosen
   over a second ubatch for the jobs without drafts this step (on a small model on the CPU rows are
   not free: hence the adaptive draft length).

A job whose client went away (`cancel()`) is dropped at the next step and its seq freed; the
tokens it evaluated stay in the seq for the prompt cache.

**Prefill ahead.** When nothing else is to be done, the worker evaluates what the app predicts a
conversation's next prompt will start with (`prefill_ahead`; `PromptBuilder.next_turn` renders the
conversation with the answer just given, as the client will send it back, up to where the next
message's text begins). A chat client re-sends the history each turn, and the Qwen templates render
an earlier answer differently from how it was generated (without its think block), so otherwise the
whole previous answer is evaluated again after the next request arrives. Such work runs as a
background job in the conversation's seq, only while no request waits or runs, in the chunks a
prompt gets while others decode (each takes about one decode step): a request that arrives stops it
after the chunk in progress, and resumes from what it reached (the seq's live state, when the
request's prompt extends it). Nothing is sent for it; its tokens are counted apart
(`Metrics.ahead_tokens`). The prompt cache keeps the tail it replaces aside, so a regeneration of
the answer still resumes from the end of its prompt.

**Copy ahead.** When nothing runs or waits and every seq is taken, the worker copies the
conversation a new one would push out next to host RAM (`PromptCache.copy_ahead`), so the request
that pushes it out does not wait for that copy (about 1 ms on the built-in model, more with long
contexts on large models). Only while the copy fits beside what host RAM holds already.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from deltarun.apps.serve.metrics import Metrics
from deltarun.apps.serve.output import QWEN_TOOLS, Delta, OutputStream, ToolFormat
from deltarun.apps.serve.prompt_cache import PromptCache, Resume
from deltarun.apps.serve.protocol import ApiError, SamplingRequest
from deltarun.base.errors import DeltarunError
from deltarun.runner.engine import Engine, Outcome, Running
from deltarun.runner.model import PromptChunk
from deltarun.runner.reasoning import ThinkingBudget, ThinkingTags
from deltarun.runner.multimodal import PlacedImage, eval_step, vision_token_ids
from deltarun.runner.sampling import LogitsProcessors, Sampler, SamplingParams, k_best, log_softmax
from deltarun.runner.speculative import (DraftLength, DraftSource, ModelDraft, MtpDraft, MtpFeed, NgramDraft,
                                         check_draft_vocab, draft_limit, text_tokens)
from deltarun.runner.vision import VisionEncoder

_ids = itertools.count(1)
#: the smallest prompt chunk while others decode. On the 0.8B bench model (Q8_0, 151k vocabulary,
#: 2 threads, 3 streams during a 2.3k-token prompt, bench/RESULTS.md "Streams during a long
#: prefill") the streams' inter-token p99 over idle was 3.1x with 16, 2.2x with 8, 2.0x with 4,
#: and the prompt took 28.5 s, 41.9 s, 72.9 s: 8 is the balance
MIN_CHUNK = 8
#: the smallest prompt chunk riding along a decode step (`Worker._ride`): what it adds to the
#: step is the rows' share of the products, not a second pass over the weights
RIDE_MIN = 4
#: Capture slots `serve` opens its model with: the checkpoints a prompt chunk takes inside one graph
#: evaluation (a turn's new user message and answer start are two; each slot holds one sequence's
#: recurrent state on the device)
CAPTURE_SLOTS = 4
STALL_FACTOR = 0.8
STEP_GRAPHS = 2      # decode graphs kept allocated at once (see Model.keep_step_graphs)
#: prompt tokens a chunk evaluates when the request wants their logprobs: every row's logits come
#: back (151,936 floats a row at Qwen3.5's vocabulary: 39 MB for 64 rows)
PROMPT_LOGPROBS_CHUNK = 64


@dataclass
class GenParams:
    """Everything the worker needs to run one request."""

    prompt: list[int]
    max_tokens: int
    req: SamplingRequest
    grammar: str | None = None          # llguidance grammar (json_schema / tool call)
    trigger: int | None = None          # the token a lazy grammar starts at (tool_choice auto)
    thinking_tags: ThinkingTags | None = None   # the think block's tags and end marker
    thinking_budget: int | None = None  # tokens the think block may take before its end is forced
    reasoning: bool = False             # split <think> blocks into reasoning_content
    starts_thinking: bool = False       # the prompt opened a think block
    tools: bool = False                 # parse tool calls
    tool_format: ToolFormat = QWEN_TOOLS   # how the template's model writes them
    checkpoints: list[int] = field(default_factory=list)   # prompt positions to checkpoint at
    answer_start: int = 0               # where the next turn will diverge from this prompt
    ahead: bool = False                 # a prompt start evaluated ahead of its request (`Worker.prefill_ahead`)
    images: list[PlacedImage] = field(default_factory=list)   # where the prompt's images lie (serve --mmproj)
    #: the prompt's own logprobs with this many alternatives each (/v1/completions with echo and
    #: logprobs); None: not asked. Every prompt token's row is needed, so the prompt is evaluated
    #: from its start (not resumed from the cache), in chunks apart
    prompt_logprobs: int | None = None
    #: a request's choices (OpenAI's `n`): jobs of one group share its prompt. Choice 0 reads it;
    #: a later choice admitted while choice 0 still reads it takes a seq and waits (state "fork"),
    #: then starts from a copy of choice 0's seq at the prompt's end (`Worker._fork`; admitted once
    #: choice 0 has read it, at once): the prompt is evaluated once. Admitted when choice 0 no
    #: longer runs (no seq was free), it reads the prompt as any request does.
    group: str | None = None
    choice: int = 0


@dataclass
class Event:
    """One message from the worker to a handler."""

    delta: Delta | None = None
    logprobs: list[dict[str, Any]] | None = None
    #: the prompt's tokens, each with its logprob (the first with None: nothing precedes it), once
    #: the prompt is evaluated (GenParams.prompt_logprobs)
    prompt_logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    result: dict[str, Any] | None = None
    error: ApiError | None = None


class Job:
    def __init__(self, params: GenParams, emit: Callable[[Event], None]):
        self.id = next(_ids)
        self.params = params
        self.emit = emit
        self._cancelled = threading.Event()
        self._withdraw: Callable[["Job"], None] | None = None   # takes it off the queue it waits in
        self.seq: int | None = None
        self.state = "waiting"            # waiting | prefill | decode | done
        self.pos = 0                      # prompt tokens the seq holds
        self.n_cached = 0
        self.n_evaluated = 0
        self.draft: DraftSource | None = None   # its draft source (speculative decoding), see Worker._attach_draft
        self.mtp_feed: MtpFeed | None = None   # hands an MTP draft the prompt's hidden rows, chunk by chunk
        #: what the engine decodes: the seq, sampler, logits processors, history and drafts
        self.running: Running | None = None
        self.generated: list[int] = []
        self.prompt_entries: list[dict[str, Any]] = []   # the prompt's logprobs so far (GenParams.prompt_logprobs)
        self.forks: list[Job] = []        # later choices of its group waiting for its prompt (state "fork")
        self.output: OutputStream | None = None
        self.constraint: Any = None       # its grammar (apps.serve.grammar.Constraint)
        self.t_submit = time.perf_counter()
        self.t_admit = self.t_first = self.t_end = 0.0

    def cancel(self) -> None:
        """Called from any thread: the client is gone. A job still waiting for a sequence leaves the
        queue at once (`Worker.submit` gave it the way out), so it holds no queue place meanwhile."""
        self._cancelled.set()
        withdraw, self._withdraw = self._withdraw, None
        if withdraw is not None:
            withdraw(self)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Worker:
    def __init__(self, open_model: Callable[[], Any], n_parallel: int, *, max_queue: int = 64,
                 cache_bytes: int = 2 << 30, chunk: int = 512, checkpoint_every: int = 1024,
                 metrics: Metrics | None = None, grammar_factory: Callable[[Any], Any] | None = None,
                 draft: str | None = None, draft_max: int = 8, open_draft: Callable[[], Any] | None = None,
                 mmproj: str | Path | None = None):
        self._open_model = open_model
        #: the vision tower's file (serve --mmproj), opened on the model's backend with the model
        self.mmproj = mmproj
        self.vision: VisionEncoder | None = None
        self._image_pad = -1              # the <|image_pad|> id the image rows are evaluated as
        self.n_parallel = n_parallel
        self.max_queue = max_queue
        self.cache_bytes = cache_bytes
        self.chunk = chunk
        self._shared_chunk = min(chunk, MIN_CHUNK)   # chunk size while others decode: grows as it can
        self._ride_chunk: int | None = None          # a riding chunk's size, once adapted (`_ride_size`)
        self._ride_planned = 0                       # the size the last riding chunk was cut to
        self._ride_ceiling: int | None = None        # the smallest riding size found too costly
        self._ride_job = 0                           # the job whose prompt those are about
        self._ride_opening = False                   # no chunk of that prompt has ridden yet
        self._ride_start = 0                         # what the last prompt's first chunk adapted to
        self._decode_s = 0.0              # moving average of one decode step's wall time
        self.checkpoint_every = checkpoint_every
        self.metrics = metrics or Metrics()
        self._grammar_factory = grammar_factory
        if draft not in (None, "ngram", "mtp") and open_draft is None:
            raise ValueError(f"--draft {draft!r}: a draft model needs open_draft (a function opening it "
                             f"with one sequence per serving sequence)")
        #: what --draft named: None, "ngram", "mtp" or the draft model's path (a job's `draft` is its
        #: DraftSource, made from this)
        self.draft_spec = draft
        self._open_draft = open_draft
        self.draft_model: Any = None      # the draft GGUF, opened with one sequence per serving sequence
        self.draft_max = draft_max
        self.k_max = 0                    # drafts per verification: min(draft_max, rs_slots - 1)
        self.n_drafted = self.n_accepted = 0
        self.grammars: Any = None
        self.model: Any = None
        self.engine: Engine | None = None
        self.cache: PromptCache | None = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        #: prompt starts to evaluate while idle (`prefill_ahead`), newest last; one per sequence at most
        self._ahead: collections.deque[GenParams] = collections.deque(maxlen=n_parallel)
        #: a step is under way (see `idle`): the jobs it took may have left `_active` already while it
        #: still writes for them (an answer's deferred MTP rows, the copy to host RAM ahead)
        self._stepping = False
        self._calls: list[tuple[Callable[[Any], Any], concurrent.futures.Future]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="deltarun-model", daemon=True)
        #: called at the end of every step (the app delivers the step's events then, in one go)
        self.after_step: Callable[[], None] | None = None
        #: set to a list to record each step's work: ("prefill", job id, tokens) / ("decode", job ids)
        self.trace: list[tuple[Any, ...]] | None = None

    # --- handler side ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise ApiError("the server is shutting down", status=503, type="unavailable_error",
                               code="shutting_down")
            free = max(0, self.n_parallel - len(self._active))     # jobs the next step admits at once
            if len(self._waiting) >= self.max_queue + free:
                raise ApiError(f"the server is busy: {len(self._active)} requests running and "
                               f"{len(self._waiting)} waiting", status=503, type="unavailable_error",
                               code="queue_full", headers={"Retry-After": "1"})
            self._waiting.append(job)
            job._withdraw = self._withdraw
            self.metrics.queued.set(len(self._waiting))
            self._cond.notify()

    def _withdraw(self, job: Job) -> None:
        """A waiting job was cancelled: off the queue now, not when its turn would have come."""
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:            # admitted meanwhile: the step drops it (it is cancelled)
                return
            self.metrics.queued.set(len(self._waiting))

    def prefill_ahead(self, params: GenParams) -> None:
        """Evaluate `params.prompt` (the likely start of a conversation's next prompt) when the worker
        has nothing else to do; see the module docstring. Dropped silently while shutting down."""
        with self._cond:
            if self._stopping:
                return
            self._ahead.append(dataclasses.replace(params, ahead=True, max_tokens=0))
            self._cond.notify()

    @property
    def idle(self) -> bool:
        """Nothing waiting, running or to be prefilled ahead, and no step under way (a snapshot)."""
        return not self._waiting and not self._active and not self._ahead and not self._stepping

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run `fn(model)` on the model thread between two steps (e.g. a graph dump for /graph)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise ApiError("the server is shutting down", status=503, type="unavailable_error",
                               code="shutting_down")
            self._calls.append((fn, fut))
            self._cond.notify()
        return fut

    def shutdown(self, wait: float | None = None) -> None:
        """End every stream (finish_reason "stop"), refuse waiting jobs, stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if wait is not None and self._thread.is_alive():
            self._thread.join(wait)

    @property
    def counts(self) -> tuple[int, int]:
        return sum(not j.params.ahead for j in self._active), len(self._waiting)

    # --- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.model = self._open_model()
            keep = getattr(self.model, "keep_step_graphs", None)
            if keep is not None:         # decode steps between prompt chunks, runs of seqs: no re-allocation
                keep(STEP_GRAPHS)
            self.engine = Engine(self.model)
            self.cache = PromptCache(self.model, self.model.memory.n_seq_max, self.cache_bytes)
            self._warm_up()
            if self._grammar_factory is not None:
                self.grammars = self._grammar_factory(self.model)
            if self.mmproj is not None:
                self._open_vision()
            if self.draft_spec is not None:
                self._open_drafts()
        except BaseException as e:   # reported by /health and the CLI
            self.load_error = e
            for opened in (self.draft_model, self.vision):
                if opened is not None:
                    opened.close()
            self.ready.set()
            return
        self.ready.set()
        try:
            while True:
                go_on = self._step()
                if self.after_step is not None:
                    self.after_step()
                if not go_on:
                    break
        finally:
            for opened in (self.vision, self.model, self.draft_model):
                if opened is not None:
                    opened.close()

    def _warm_up(self) -> None:
        """Evaluate two tokens in seq 0 and forget them, and make one sampler, before the first
        request (llama.cpp warms up the same way): the first graph build and compute allocation and
        the first random generator's set-up from OS entropy are one-time costs, about 10 ms on the
        built-in model, that the first request's time to first token would otherwise pay."""
        m, tok = self.model, self.model.tokenizer
        token = next((t for t in (tok.bos_id, tok.eos_id) if t is not None and t < m.hp.n_vocab), 0)
        m.eval([token, token], 0)
        m.memory.clear_seq(0)
        Sampler(SamplingParams(temperature=1.0))

    def _open_vision(self) -> None:
        """Open the vision tower on the model's backend, checked against the text model."""
        self.vision = VisionEncoder(self.mmproj, backend=self.model.backend)
        self.vision.check_text_model(self.model.hp.n_embd, self.model.family.arch)
        self._image_pad = vision_token_ids(self.model)[1]

    def _open_drafts(self) -> None:
        """Check the model can verify drafts and open the draft model (one sequence per serving sequence)."""
        self.k_max = draft_limit(self.model, self.draft_max)
        if self.draft_spec == "mtp" and not self.model.memory.mtp_layers:
            raise DeltarunError("--draft mtp needs the model opened with its MTP block (mtp=True)")
        if self.draft_spec not in ("ngram", "mtp"):
            self.draft_model = self._open_draft()
            check_draft_vocab(self.draft_model.hp.n_vocab, self.model.hp.n_vocab)
            if self.draft_model.memory.n_seq_max < self.n_parallel:
                raise DeltarunError(f"the draft model must be opened with n_seq_max={self.n_parallel} "
                                    f"(one sequence per serving sequence)")

    def _step(self) -> bool:
        with self._cond:
            while not self._waiting and not self._active and not self._calls and not self._stopping \
                    and not self._ahead:
                self._cond.wait()
            self._stepping = True
        try:
            return self._step_taken()
        finally:
            self._stepping = False

    def _step_taken(self) -> bool:
        """One step, `_stepping` set: run the calls, admit what fits, evaluate one prompt chunk
        and/or one decode step, and copy ahead when nothing runs."""
        with self._cond:
            calls, self._calls = self._calls, []
            if self._stopping:
                stopping = list(self._waiting)
                self._waiting.clear()
            else:
                stopping = None
            if self._waiting:         # a request came: work done ahead stops after its last chunk
                for job in self._active:
                    if job.params.ahead:
                        job.cancel()
            admitted = []
            free = self.n_parallel - sum(not (j.params.ahead and j.cancelled) for j in self._active)
            while free > 0 and self._waiting:
                job = self._waiting.popleft()
                if not job.cancelled:
                    admitted.append(job)
                    free -= 1
            if not admitted and not self._active and not self._waiting and self._ahead:
                admitted.append(Job(self._ahead.popleft(), lambda ev: None))
            self.metrics.queued.set(len(self._waiting))
        for fn, fut in calls:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.model))
                except BaseException as e:   # handed to the caller
                    fut.set_exception(e)
        if stopping is not None:
            for job in stopping:
                job.emit(Event(error=ApiError("the server is shutting down", status=503, type="unavailable_error",
                                              code="shutting_down")))
            for job in list(self._active):
                if job.params.ahead:
                    self._release(job)
                else:
                    self._finish(job, "stop")
            return False
        for job in list(self._active):
            if job.cancelled:
                self._release(job)
        for job in admitted:
            self._guard(job, self._admit_ahead if job.params.ahead else self._admit)
        self.metrics.running.set(self.counts[0])
        waited_for = {id(f) for j in self._active if j.state == "prefill" for f in j.forks}
        for j in self._active:            # never waits for a prompt nobody reads: reads it itself
            if j.state == "fork" and id(j) not in waited_for:
                j.state = "prefill"
        prefilling = [j for j in self._active if j.state == "prefill"]
        decoding = [j for j in self._active if j.state == "decode"]
        riding = None                     # a prompt chunk that goes into the decode step's graph
        if prefilling and decoding and not prefilling[0].cancelled:
            riding = self._ride(prefilling[0])
        if prefilling and riding is None:
            self._guard(prefilling[0], self._prefill_chunk)
        decoding = [j for j in self._active if j.state == "decode"]
        if decoding:
            self._decode(decoding, prefilling[0] if riding is not None else None)
        if not self._active:
            self._copy_ahead()
        return True

    def _copy_ahead(self) -> None:
        """Nothing runs: copy to host RAM the conversation a new one would push out of its seq
        (`PromptCache.copy_ahead`), unless something waits to be done."""
        with self._cond:
            if self._waiting or self._ahead or self._calls or self._stopping:
                return
        self.cache.copy_ahead(list(range(self.n_parallel)))

    def _guard(self, job: Job, fn: Callable[[Job], None]) -> None:
        """Run one job's step; an error ends that job (its ApiError, else HTTP 500; an error event
        once streaming), never the worker."""
        try:
            fn(job)
        except ApiError as e:             # the request's own fault, found while it ran (its grammar)
            self._fail(job, e)
        except Exception as e:  # noqa: BLE001 - reported to the client, logged, and the worker goes on
            self._fail(job, _server_error(e))

    def _fail(self, job: Job, err: ApiError) -> None:
        job.emit(Event(error=err))
        self._release(job)

    def _release(self, job: Job) -> None:
        if job.state in ("prefill", "fork"):      # its waiting choices read the prompt themselves
            for f in job.forks:
                if f.state == "fork":
                    f.state = "prefill"
            job.forks = []
        # (a job done at its first token forks its choices after this: `_chunk_done`)
        job.state = "done"
        if job in self._active:
            self._active.remove(job)
        if isinstance(job.draft, MtpDraft) and job.draft.deferred:
            # the rows a paused source kept waiting (`Running.drafts_next_step`): the seq's MTP KV
            # rows complete before the prompt cache offers it to a later request
            # (those rows only steer later drafts, which verification keeps from changing answers:
            # a failure is logged, not the request's)
            try:
                job.draft.evaluate_deferred()
            except Exception as e:  # noqa: BLE001
                _server_error(e)
        if job.seq is not None and self.cache is not None:
            self.cache.finished(job.seq, job.params.answer_start)
        self.metrics.running.set(self.counts[0])

    # --- admission and prefill ---------------------------------------------------------------------
    def _admit(self, job: Job) -> None:
        model, p = self.model, job.params
        busy = {j.seq for j in self._active}
        idle = [c for c in range(self.n_parallel) if c not in busy]
        reader = self._choice_zero(p)
        if reader is not None:            # starts from choice 0's prompt (see GenParams.group)
            resume = Resume()
        elif p.prompt_logprobs is None:
            resume = self.cache.lookup(p.prompt, idle)
        else:                             # every prompt row is evaluated (see GenParams.prompt_logprobs)
            resume = Resume()
        if p.prompt_logprobs is not None:
            job.prompt_entries = [_logprob_entry(model.tokenizer, p.prompt[0], None, 0)]
        seq = resume.seq if resume.seq is not None else self.cache.pick_seq(idle)
        try:
            self.cache.apply(resume, seq)
        except DeltarunError:            # e.g. a rollback the slots no longer cover: start over
            resume = Resume()
            self.cache.apply(resume, seq)
        job.seq, job.pos, job.n_cached = seq, resume.pos, resume.pos
        job.t_admit = time.perf_counter()
        job.output = OutputStream(model.tokenizer, p.req.stops, reasoning=p.reasoning,
                                  starts_thinking=p.starts_thinking, tools=p.tools, tool_format=p.tool_format)
        if p.grammar is not None:
            job.constraint = self.grammars.matcher(p.grammar, p.trigger, p.thinking_tags, p.starts_thinking)
        budget = None
        if p.thinking_budget is not None and p.thinking_tags is not None:
            budget = ThinkingBudget(p.thinking_tags, p.thinking_budget, p.starts_thinking, model.tokenizer.token_bytes)
        r = p.req
        processors = LogitsProcessors(
            presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty, logit_bias=r.logit_bias,
            banned=end_of_generation_ids(model) if r.ignore_eos else (), grammar=job.constraint, budget=budget)
        job.running = Running(seq, Sampler(r.sampling), list(p.prompt), processors)
        self._attach_draft(job, resume.hidden)
        self._active.append(job)
        if reader is not None:
            job.state = "fork"
            reader.forks.append(job)
            if reader.state == "decode":  # it has read the prompt (from the cache): fork now
                n = len(p.prompt)
                tail = self.cache.seqs[reader.seq].hidden.get(n)
                self._fork(reader, self.cache.seqs[reader.seq].checkpoints[n].logits,
                           None if tail is None else (tail, n - 1))
            return
        self.metrics.prompt_done(len(p.prompt), job.n_cached)
        if resume.logits is not None and p.max_tokens == 0:    # the prompt alone, cached whole
            self._finish(job, "length")
        elif resume.logits is not None:     # the whole prompt was cached with its logits
            job.state = "decode"
            self._first(job, resume.logits)
        else:
            job.state = "prefill"

    def _admit_ahead(self, job: Job) -> None:
        """Start evaluating a prompt start ahead, in the seq of the conversation it continues; not
        when that conversation left the seqs (host RAM) or when the seq already holds it."""
        p = job.params
        idle = [c for c in range(self.n_parallel) if c not in {j.seq for j in self._active}]
        resume = self.cache.lookup(p.prompt, idle)
        if resume.seq is None or resume.pos >= len(p.prompt) or resume.how == "aside" \
                or resume.pos < self.cache.seqs[resume.seq].answer_start:
            return
        self.cache.apply(resume, resume.seq, keep_tail=True)
        job.seq, job.pos, job.n_cached = resume.seq, resume.pos, resume.pos
        job.t_admit = time.perf_counter()
        if self.draft_spec == "mtp":            # the MTP block's KV rows follow the prompt, as for a request
            job.draft = MtpDraft(self.model, seq=job.seq)
            job.mtp_feed = MtpFeed(job.draft)
            job.mtp_feed.resume(resume.hidden, job.pos - 1)
        job.state = "prefill"
        self._active.append(job)

    # --- draft sources -------------------------------------------------------------------------------
    def _attach_draft(self, job: Job, resume_hidden: np.ndarray | None) -> None:
        """Give an admitted job its draft source.

        ngram: one of its own (it keeps the job's history as an array). mtp: an MtpDraft on the job's
        seq, for every job (one that does not draft, with draft-max 0, still fills the MTP block's KV
        rows of its seq, so a later request resuming from this seq through the prompt cache finds
        them as a fresh evaluation leaves them); the row before the resume point is filled from the
        hidden row the cache kept.
        A draft model: the free sequence of the draft model holding the longest prefix of the
        prompt (a returning conversation only evaluates what is new to the draft model; any other
        sequence is evaluated again from the start by `ModelDraft.propose`).
        """
        speculates = self._can_speculate(job)
        if self.draft_spec == "mtp":
            job.draft = MtpDraft(self.model, seq=job.seq)
            job.mtp_feed = MtpFeed(job.draft)
            job.mtp_feed.resume(resume_hidden, job.pos - 1)
        elif not speculates:
            return
        elif self.draft_spec == "ngram":
            job.draft = NgramDraft()
        else:
            m = self.draft_model
            taken = {j.draft.seq for j in self._active if isinstance(j.draft, ModelDraft)}
            free = [s for s in range(self.n_parallel) if s not in taken]

            text = text_tokens(job.params.prompt)     # what the draft model reads (no image rows)

            def reuse(s: int) -> int:
                held = m.tokens(s)
                return len(held) if held == text[:len(held)] else -1
            job.draft = ModelDraft(m, self.model.hp.n_vocab, seq=max(free, key=reuse))
        job.running.draft = job.draft
        if speculates:
            job.running.length = DraftLength(self.k_max)

    def _feed_mtp(self, job: Job, rows: np.ndarray, start: int) -> None:
        """Hand the MTP draft the hidden rows of positions start.. of the job's prompt (`MtpFeed`: the
        chunk's last row waits for the next chunk or the first sampled token)."""
        job.mtp_feed.feed(job.params.prompt, rows, start)

    def _first(self, job: Job, logits: np.ndarray) -> None:
        """The prompt is evaluated: sample the first token (the prompt's last row, waiting in the
        job's `MtpFeed`, gets its MTP KV row and the first draft with it) and stream it."""
        if job.cancelled:
            self._release(job)
            return
        context = job.mtp_feed.context(self.model.n_past(job.seq)) if job.mtp_feed is not None else None
        token = self.engine.first(job.running, logits, context)
        self._take(job, token, self._logprobs(job, logits, token))
        # handed over now, not at the step's end: the step goes on to decode every stream, the new
        # one too (with drafts a verification of up to 16 rows: 60-100 ms on the 0.8B bench model)
        if self.after_step is not None:
            self.after_step()

    def _chunk_bounds(self, job: Job, size: int | None = None) -> tuple[int, list[int], PlacedImage | None]:
        """The end of `job`'s next prompt chunk (of `size` tokens at most: a riding chunk's; else
        the chunk a prompt gets apart), the checkpoints inside it to capture, and the image it
        evaluates (None for text)."""
        p = job.params
        n = len(p.prompt)
        if size is None:
            # work ahead takes the chunks a prompt gets while others decode (about one decode step):
            # a request arriving meanwhile waits for one such chunk, not for a whole `chunk`
            others = p.ahead or any(j.state == "decode" for j in self._active)
            size = self._shared_chunk if others else self.chunk
            if p.prompt_logprobs is not None:
                size = min(size, PROMPT_LOGPROBS_CHUNK)
        end = min(job.pos + size, n)
        inside = [c for c in p.checkpoints if job.pos < c < end]
        slots = self.model.memory.n_capture
        if len(inside) > slots:            # the chunk ends at the first checkpoint it cannot capture
            end, inside = inside[slots], inside[:slots]
        image = next((img for img in p.images if img.start <= job.pos < img.end), None)
        if image is None:                  # text chunks end where an image starts
            end = min([end] + [img.start for img in p.images if img.start > job.pos])
            inside = [c for c in inside if c < end]
        else:                              # an image (or the rest of one) is one step, its rows from the tower
            end, inside = image.end, []
        return end, inside, image

    def _ride(self, job: Job) -> PromptChunk | None:
        """`job`'s next prompt chunk when it can ride along the decode step (`Engine.step(...,
        ride=...)`: the layers read each weight once for both): text, the checkpoints inside it
        captured by the same graph evaluation (as a chunk apart; a chat prompt's message
        boundaries are 3-4 checkpoints in its last 12 tokens, and a chunk ending at each took a
        step each: 4 requests arriving together waited 6 steps each for their prompts), with its
        hidden rows when an MTP block reads them, on a family whose graphs take it; else None
        (evaluated apart)."""
        if not self.model.family.rides or job.params.ahead or job.params.prompt_logprobs is not None:
            return None
        if job.id != self._ride_job:      # another prompt: its rides start afresh
            self._ride_job, self._ride_chunk, self._ride_ceiling = job.id, None, None
            self._ride_opening = True
        self._ride_planned = self._ride_size()
        end, inside, image = self._chunk_bounds(job, self._ride_planned)
        if image is not None:
            return None
        n = len(job.params.prompt)
        return PromptChunk(job.seq, job.params.prompt[job.pos:end], logits=end == n,
                           hidden=job.draft is not None and job.draft.needs_hidden,
                           captures=tuple(c - job.pos for c in inside))

    def _prefill_chunk(self, job: Job) -> None:
        p = job.params
        n = len(p.prompt)
        others = p.ahead or any(j.state == "decode" for j in self._active)
        end, inside, image = self._chunk_bounds(job)
        t0 = time.perf_counter()
        wants_hidden = job.draft is not None and job.draft.needs_hidden
        if image is not None:
            logits = eval_step(self.model, p.prompt, (job.pos, end, image), job.seq, self.vision.encode,
                               self._image_pad, all_hidden=wants_hidden)
        elif p.prompt_logprobs is not None:
            rows = self.model.eval(p.prompt[job.pos:end], job.seq, all_logits=True, all_hidden=wants_hidden,
                                   captures=[c - job.pos for c in inside])
            # row i is the distribution of the token after position job.pos + i
            for t, row in zip(p.prompt[job.pos + 1:end + 1], rows):
                job.prompt_entries.append(_logprob_entry(self.model.tokenizer, t, log_softmax(row),
                                                         p.prompt_logprobs))
            logits = rows[-1]
        else:
            logits = self.model.eval(p.prompt[job.pos:end], job.seq, all_hidden=wants_hidden,
                                     captures=[c - job.pos for c in inside], continued=end < n)
        for c in inside:
            self.cache.checkpoint(job.seq, state=self.model.last_captures[c])
        if wants_hidden:                   # the MTP block's KV rows follow the prompt chunk by chunk
            rows = self.model.last_hidden[0]
            self._feed_mtp(job, rows, job.pos)
            self.cache.note_hidden(job.seq, rows)
        if others and self._decode_s > 0 and image is None:
            self._adapt_chunk(end - job.pos, time.perf_counter() - t0)
        self._chunk_done(job, end, logits, time.perf_counter() - t0)

    def _chunk_done(self, job: Job, end: int, logits: np.ndarray | None, seconds: float,
                    ridden: bool = False) -> None:
        """Bookkeeping after `job`'s prompt was evaluated up to `end` (apart, or `ridden` along a
        decode step)."""
        p = job.params
        n = len(p.prompt)
        if self.trace is not None:
            self.trace.append(("ahead" if p.ahead else "prefill", job.id, end - job.pos))
        self.metrics.prefill_step(end - job.pos, seconds, ahead=p.ahead, ridden=ridden)
        job.n_evaluated += end - job.pos
        job.pos = end
        if end == n and not p.ahead:
            if p.prompt_logprobs is not None:
                job.emit(Event(prompt_logprobs=job.prompt_entries))
            if p.max_tokens == 0:         # the prompt alone (/v1/completions, max_tokens 0)
                self._checkpoint(job.seq, logits)
                self._fork(job, logits, None)
                self._finish(job, "length")
                return
            # the first token goes out before the prompt's end is checkpointed: sampling it evaluates
            # nothing, so the seq still holds the prompt's state, and the copy (a recurrent state
            # to host memory: 9-55 ms on a VM that backs new memory lazily) leaves the time to
            # first token
            job.state = "decode"
            tail = job.mtp_feed.tail if job.mtp_feed is not None else None   # (the first token takes it)
            try:
                self._first(job, logits)
            finally:
                self._checkpoint(job.seq, logits)
                self._fork(job, logits, tail)
            return
        if end in p.checkpoints or end == n:
            self._checkpoint(job.seq, logits if end == n else None)
        if end == n:                      # work ahead: its prompt is all it evaluates
            self._release(job)

    def _choice_zero(self, p: GenParams) -> Job | None:
        """For a later choice of a group: its choice 0 when it reads the prompt, or has read it (its
        seq holds the prompt, whose end checkpoint keeps the logits: the later choices may come a
        step or more after it, their submissions are not one); else None (the choice reads the
        prompt itself)."""
        if not p.choice or p.group is None:
            return None
        n = len(p.prompt)
        for j in self._active:
            if j.params.group != p.group or j.params.choice != 0:
                continue
            if j.state == "prefill":
                return j
            end = self.cache.seqs[j.seq].checkpoints.get(n) if j.state == "decode" else None
            if end is not None and end.logits is not None and self.model.tokens(j.seq)[:n] == p.prompt:
                return j
        return None

    def _fork(self, job: Job, logits: np.ndarray, tail: tuple[np.ndarray, int] | None) -> None:
        """`job` (choice 0) has read its prompt: each choice waiting for it starts from a copy of its
        seq (KV rows, MTP KV rows and recurrent state at the prompt's end; sampling the first token
        evaluated nothing; past the prompt, the KV rows of the prompt's positions and the prompt-end
        checkpoint's state), the checkpoint shared, and samples its own first token."""
        forks, job.forks = job.forks, []
        n = len(job.params.prompt)
        memory = self.model.memory
        end = self.cache.seqs[job.seq].checkpoints.get(n)
        for f in forks:
            if f.state != "fork":
                continue
            if end is None and self.model.n_past(job.seq) != n:
                f.state = "prefill"       # (nothing to copy: it reads the prompt itself)
                continue
            memory.copy_seq(job.seq, f.seq)
            if self.model.n_past(job.seq) != n:
                memory.write_recurrent(f.seq, end.state)
                memory.set_tokens(f.seq, list(job.params.prompt))
            if end is not None:
                self.cache.seqs[f.seq].checkpoints[n] = end
            f.pos = f.n_cached = n
            self.metrics.prompt_done(n, n)
            if f.mtp_feed is not None and tail is not None:
                f.mtp_feed.resume(tail[0], tail[1])
            if f.params.prompt_logprobs is not None:
                f.emit(Event(prompt_logprobs=job.prompt_entries))
            if f.params.max_tokens == 0:
                self._finish(f, "length")
                continue
            f.state = "decode"
            self._guard(f, lambda f: self._first(f, logits))

    def _checkpoint(self, seq: int, logits: np.ndarray | None) -> None:
        """Checkpoint the live state of `seq` in the prompt cache (with the prompt's last logits at
        its end) and report the cache's new size."""
        self.cache.checkpoint(seq, logits)
        self.metrics.cache_bytes.set(self.cache.nbytes())

    def _adapt_chunk(self, n: int, seconds: float) -> None:
        """Halve or double the shared chunk so that one takes about STALL_FACTOR decode steps."""
        self._shared_chunk = self._adapted(self._shared_chunk, n, seconds, MIN_CHUNK)

    def _adapted(self, size: int, n: int, seconds: float, least: int) -> int:
        """A chunk size after a chunk of n tokens (of `size`, else it stays) took `seconds` (its own
        time, or what riding added to a step): halved (not below `least`) past STALL_FACTOR decode
        steps, doubled (up to `chunk`) below 1/2.2 of that."""
        target = STALL_FACTOR * self._decode_s
        if n == size and seconds > target and n > least:
            return max(least, size // 2)
        if n == size and seconds * 2.2 < target and 2 * n <= self.chunk:
            return 2 * n
        return size

    def _ride_size(self) -> int:
        """Tokens of a prompt chunk riding along the decode step: first those that fill the
        engine's row budget beside one row per decoding job (a step of up to `Engine.max_rows` rows
        costs little more than one of a few: at the 0.8B bench shapes, Q8_0 on AMX tiles, 3
        decoding rows take 40 ms, with 2 prompt rows riding 52 ms, with 13 64 ms, with 16 87 ms;
        the engine cuts the jobs' drafts to leave the chunk its rows: a queued request's first token
        waits for its prompt, while drafts only speed up tokens that come anyway), or the shared
        chunk where no rows are budgeted (a GPU); then as `_adapt_ride` leaves it.

        A prompt starts from what the last prompt's first chunk adapted to where that is more: a
        chat prompt of a few dozen tokens ends before its own chunks can adapt, and at MTP's steps
        (16 rows, 80 ms) a 27-token prompt took two steps of 13 and 14 rows, each leaving the other
        streams one token instead of four, where one step of 30 rows takes about 1.6 steps' time
        (twenty-seventh session: four MTP streams of 64-token answers 1.05-1.07x faster,
        bench/RESULTS.md)."""
        if self._ride_chunk is not None:
            return self._ride_chunk
        if not self.engine.max_rows:
            return self._shared_chunk
        decoding = sum(j.state == "decode" for j in self._active)
        return max(RIDE_MIN, self.engine.max_rows - decoding, self._ride_start)

    def _adapt_ride(self, n: int, added: float) -> None:
        """After a riding chunk of n tokens added `added` seconds to its step: halved (and that
        size never tried again for this prompt) past STALL_FACTOR decode steps (the attention over
        a long prompt's positions grows), doubled below 1/2.2 of that (a small model's rows cost
        little), kept else. The ceiling keeps a size that costs a second pass over the weights
        (past the row budget) from being tried again and again. The size a prompt's first chunk
        adapts to is where the next prompt starts (`_ride_size`)."""
        opening, self._ride_opening = self._ride_opening, False
        if n != self._ride_planned:       # cut short (a checkpoint, the prompt's end): says nothing
            return
        adapted = self._adapted(n, n, added, RIDE_MIN)
        if adapted < n:
            self._ride_ceiling = n
        elif adapted > n and self._ride_ceiling is not None and adapted >= self._ride_ceiling:
            adapted = n
        self._ride_chunk = adapted
        if opening:
            self._ride_start = adapted

    # --- decoding ----------------------------------------------------------------------------------
    def _compact(self) -> None:
        """Move the running jobs into the lowest seqs, generating ones first, then the ones still
        reading their prompt (in admission order), so the generating ones form one run and the next
        to finish its prompt joins its end.

        With as few moves as that takes (each is a `PromptCache.swap`: two seqs' KV rows and
        states through the host): a generating job already in the first seqs stays where it is,
        one outside them swaps with the lowest seq there no generating job holds. When a request
        took the seq a finished one left in the middle, that is one swap (with the last
        generating job), not a cascade through every seq after the hole.
        """
        decoding = sorted((j for j in self._active if j.state == "decode"), key=lambda j: j.seq)
        reading = [j for j in self._active if j.state != "decode"]
        n = len(decoding)
        held = {j.seq for j in decoding if j.seq < n}
        free = iter(c for c in range(n) if c not in held)
        for job in decoding:
            if job.seq >= n:
                self._move(job, next(free))
        for target, job in enumerate(reading, start=n):
            if job.seq != target:
                self._move(job, target)

    def _move(self, job: Job, target: int) -> None:
        """Swap `job`'s seq with seq `target` (and whichever running job holds it)."""
        src = job.seq
        other = next((j for j in self._active if j.seq == target), None)
        self.cache.swap(src, target)
        job.seq = target
        if other is not None:
            other.seq = src
        for j in (job, other):        # the sequence (and an MTP draft's KV rows) moved with the seq
            if j is not None and j.running is not None:
                j.running.seq = j.seq
            if j is not None and j.draft is not None and j.draft.needs_hidden:
                j.draft.seq = j.seq
        if self.trace is not None:
            self.trace.append(("move", job.id, target))

    def _decode(self, jobs: list[Job], rider: Job | None = None) -> None:
        """One engine step for every generating job (see the module docstring): their seqs made
        consecutive first, then each job's budget, the step, and each job's kept tokens streamed.
        `rider`: a job whose next prompt chunk rides along the step (`_ride`)."""
        for j in list(jobs):
            if j.cancelled:
                self._release(j)
        seqs = sorted(j.seq for j in jobs if j.state == "decode")
        if seqs and seqs[-1] - seqs[0] + 1 != len(seqs):
            try:
                self._compact()
            except Exception as e:  # noqa: BLE001 - a failed move ends the jobs involved, not the server
                for j in list(self._active):
                    self._fail(j, _server_error(e))
                return
        jobs = sorted((j for j in jobs if j.state == "decode"), key=lambda j: j.seq)
        ride = self._ride(rider) if rider is not None and rider in self._active else None
        if not jobs:
            if ride is not None:
                self._guard(rider, self._prefill_chunk)
            return
        for j in jobs:
            j.running.budget = j.params.max_tokens - len(j.generated)
        before_ride = self.model.n_past(ride.seq) if ride is not None else 0
        t0 = time.perf_counter()
        outcomes = self.engine.step([j.running for j in jobs], ride=ride)
        seconds = time.perf_counter() - t0
        if ride is not None:
            self._ridden(rider, ride, before_ride, seconds)
        if self.trace is not None:
            by_seq = {j.seq: j.id for j in jobs}
            self.trace.extend(("batch", tuple(by_seq[s.seq] for s in run), width)
                              for run, width in self.engine.last_runs)
        before = sum(len(j.generated) for j in jobs)
        for j, o in zip(jobs, outcomes):
            self._guard(j, lambda job, o=o: self._settle(job, o))
        self.metrics.decode_step(sum(len(j.generated) for j in jobs) - before, seconds)
        if ride is None:                  # the plain step's time: what a chunk's cost is weighed by
            self._decode_s = seconds if self._decode_s == 0 else 0.8 * self._decode_s + 0.2 * seconds

    def _ridden(self, job: Job, ride: PromptChunk, before: int, seconds: float) -> None:
        """After a step `job`'s chunk rode along: its bookkeeping (the first token when it ended
        the prompt; the MTP block's rows), and the riding size adapted to the time the chunk added
        to the step (`_adapt_ride`); an evaluation that failed fails the job."""
        if self.model.n_past(ride.seq) != before + len(ride.tokens):
            self._fail(job, ApiError("evaluating the prompt failed", status=500, type="server_error"))
            return
        added = max(0.0, seconds - self._decode_s)
        if self._decode_s > 0:
            self._adapt_ride(len(ride.tokens), added)
        logits, rows = self.model.last_ride_logits, self.model.last_ride_hidden
        captured = [self.model.last_ride_captures[job.pos + t] for t in ride.captures]

        def done(j: Job) -> None:
            for state in captured:
                self.cache.checkpoint(j.seq, state=state)
            if ride.hidden:                # the MTP block's KV rows follow the prompt chunk by chunk
                self._feed_mtp(j, rows, j.pos)
                self.cache.note_hidden(j.seq, rows)
            self._chunk_done(j, j.pos + len(ride.tokens), logits, added, ridden=True)

        self._guard(job, done)

    def _settle(self, job: Job, o: Outcome) -> None:
        """A job's outcome of an engine step: counted, its MTP rows noted for the prompt cache, its
        kept tokens streamed."""
        if o.error is not None:
            raise o.error
        if o.full:                        # `_take` ends a job before its context is full: not expected
            self._finish(job, "length")
            return
        if o.hidden is not None:         # the MTP block's rows follow the kept tokens
            self.cache.note_hidden(job.seq, o.hidden)
        if job.running.length is not None:
            self.n_drafted += o.n_drafted
            self.n_accepted += o.n_accepted
            self.metrics.drafts(o.n_drafted, o.n_accepted)
            if self.trace is not None:
                self.trace.append(("verify", job.id, o.n_drafted, o.n_accepted))
        if job.cancelled:
            self._release(job)
            return
        for i, (t, row) in enumerate(zip(o.tokens, o.logits)):
            if not self._take(job, t, self._logprobs(job, row, t), last=i == len(o.tokens) - 1):
                return

    def _logprobs(self, job: Job, logits: np.ndarray, token: int) -> dict[str, Any] | None:
        """The logprobs entry of a sampled token (from the model's logits), when the request asks."""
        r = job.params.req
        if not r.logprobs:
            return None
        return _logprob_entry(self.model.tokenizer, token, log_softmax(logits), r.top_logprobs)

    def _take(self, job: Job, token: int, info: dict[str, Any] | None, last: bool = True) -> bool:
        """Stream one kept token; True when the job goes on. `last`: the last token the step kept.
        The grammar has already walked every token the step kept (`Engine._keep`), so whether it
        is complete is asked at the last one only: a step keeps no token past the point where it
        completes (`sampling.accept_draft`)."""
        p, model = job.params, self.model
        if job.t_first == 0.0:
            job.t_first = time.perf_counter()
        if model.tokenizer.is_eog(token) and not p.req.ignore_eos:
            self._finish(job, "stop")
            return False
        job.generated.append(token)
        delta = job.output.push(token)
        reason = None
        if job.output.stopped or (last and job.constraint is not None and job.constraint.done):
            reason = "stop"
        elif len(job.generated) >= p.max_tokens or model.n_past(job.seq) + 1 > model.n_ctx:
            reason = "length"
        if delta or info is not None:
            job.emit(Event(delta=delta, logprobs=[info] if info is not None else None))
        if reason is not None:
            self._finish(job, reason)
            return False
        return True

    # --- speculative decoding ------------------------------------------------------------------------
    def _can_speculate(self, job: Job) -> bool:
        """Every request drafts when the server does: drafts are verified under the request's
        sampler and processors (its grammar, penalties, logit_bias and thinking budget walk each
        draft on a fork: `sampling.accept_draft`), and logprobs are read from each kept token's
        own row of the verification."""
        return self.draft_spec is not None and self.k_max > 0

    def _finish(self, job: Job, reason: str) -> None:
        job.t_end = time.perf_counter()
        tail = job.output.flush()
        if job.output.n_tool_calls and reason == "stop":
            reason = "tool_calls"
        prompt_s = (job.t_first or job.t_end) - job.t_admit
        gen_s = job.t_end - (job.t_first or job.t_end)
        result = {"n_prompt": len(job.params.prompt), "n_cached": job.n_cached, "n_evaluated": job.n_evaluated,
                  "prompt_s": prompt_s, "n_generated": len(job.generated), "generate_s": gen_s,
                  "text": job.output.text, "content": job.output.content, "tokens": list(job.generated),
                  "stop_word": job.output.stopper.hit or "",
                  "n_drafted": job.running.n_drafted if job.running else 0,
                  "n_accepted": job.running.n_accepted if job.running else 0}
        job.emit(Event(delta=tail if tail else None, finish_reason=reason, result=result))
        self._release(job)


def end_of_generation_ids(model: Any) -> list[int]:
    """The tokenizer's end-of-generation ids within the model's vocabulary, in order (ignore_eos
    bans them; a grammar ends with one)."""
    return sorted(i for i in model.tokenizer.eog_ids if i < model.hp.n_vocab)


def _server_error(e: Exception) -> ApiError:
    if not isinstance(e, DeltarunError):      # a bug: keep the traceback in the server's log
        traceback.print_exception(e)
    return ApiError(str(e) if isinstance(e, DeltarunError) else f"{type(e).__name__}: {e}", status=500,
                    type="server_error")


def _logprob_entry(tok: Any, token: int, logprobs: np.ndarray | None, top: int) -> dict[str, Any]:
    """A token's logprobs entry with its `top` most likely alternatives; with logprobs None (a
    prompt's first token: nothing precedes it) the token alone, its logprob and alternatives None."""
    def one(t: int) -> dict[str, Any]:
        b = tok.token_bytes(int(t)) if int(t) < tok.n_vocab else b""
        return {"token": b.decode("utf-8", errors="replace"), "logprob": None if logprobs is None else float(logprobs[t]),
                "bytes": list(b)}

    entry = one(token)
    if logprobs is None:
        entry["top_logprobs"] = None
        return entry
    best = k_best(logprobs, top) if top else []
    entry["top_logprobs"] = [one(int(t)) for t in best]
    return entry
