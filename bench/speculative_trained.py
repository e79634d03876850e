"""Speculative decoding on the built-in trained model: acceptance and tokens/s per draft setting.

    python bench/speculative_trained.py [--model PATH] [--threads 2] [-n 128] [--repeats 2]
                                        [--max-draft 6] [--drafts mtp,mtp-separate,ngram]

For each prompt, greedy decoding of n tokens plain, then with `--draft mtp` and `--draft ngram` at
draft-max 1..6 (rollback slots = draft-max + 1, as the CLI opens them). `mtp` runs the MTP block
inside each verification graph (MtpDraft's default for greedy decoding); `mtp-separate` evaluates
it in graphs of its own (in_graph=False, what sampled decoding does).

    python bench/speculative_trained.py --step-costs [--max-draft 6]

instead prints what one verification step costs by its size, in CPU time of one thread (ggml then
computes in the calling thread, so other processes' time slices do not count: stable under load):
a trunk ubatch of n = 1..max-draft+1 tokens with rs_slots = n, the same with the MTP block in its
graph, and a one-row MTP evaluation (a chained draft); the evaluation only (input set-up, compute,
outputs read back), not the rollback that follows a rejected draft. Speed-up of a draft setting is at most
tokens-per-step x cost(1) / cost(draft-max + 1). Every speculative run must
give the plain run's tokens (checked). Reports generated tokens/s (median over prompts and repeats), the share
of drafted tokens accepted, tokens per verification step, and the speed-up over plain. With
`--threads 1 --cpu-clock` tokens/s are per second of the thread's CPU time instead of wall time:
other processes' time slices do not count, so a loaded machine gives usable (1-thread) figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from deltarun.runner.speculative import MtpDraft, NgramDraft
from deltarun.runner.generation import GenerationStats, generate_tokens
from deltarun.runner.model import Model
from deltarun.runner.sampling import GREEDY, Sampler

PROMPTS = [
    "HAMLET.\nTo be, or not to be, that is the question:\n",
    "<|im_start|>user\nWhat news from the court, my lord?<|im_end|>\n<|im_start|>assistant\n",
    "KING.\nNow, good my lords, what say you to this war?\n\n",
]


def run(path: Path, prompt: str, n: int, threads: int, draft: str | None, draft_max: int) -> tuple[list[int], object, float]:
    """Tokens, stats, and generated tokens per second of the calling thread's CPU time (after the
    first token: the prompt excluded; with --threads 1 ggml computes in this thread)."""
    with Model(path, n_ctx=1024, n_threads=threads, rs_slots=draft_max + 1 if draft else 1,
               n_ubatch=512, mtp=draft in ("mtp", "mtp-separate")) as m:
        toks = m.tokenizer.encode(prompt)
        if draft is None:
            stats = GenerationStats()
            tokens = generate_tokens(m, toks, n, Sampler(GREEDY), stats=stats, stop_at_eog=False)
        else:
            source = MtpDraft(m, in_graph=draft == "mtp") if draft in ("mtp", "mtp-separate") else NgramDraft()
            stats = GenerationStats()
            tokens = generate_tokens(m, toks, n, Sampler(GREEDY), stats=stats, stop_at_eog=False, draft=source,
                                     draft_max=draft_max)
        out = [next(tokens)]
        t0 = time.thread_time()
        out += list(tokens)
        cpu_tps = (len(out) - 1) / max(time.thread_time() - t0, 1e-9)
        if draft is not None:
            source.close()
    return out, stats, cpu_tps


def step_costs(path: Path, max_draft: int, rounds: int = 5, repeats: int = 30) -> None:
    """Single-thread CPU milliseconds of verification ubatches by size (see the docstring): the two
    variants of a size alternate in rounds; each figure is the smallest of the rounds' medians."""
    def median_ms(fn, after=None) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.thread_time()
            fn()
            times.append(time.thread_time() - t0)
            if after is not None:
                after()
        return 1e3 * statistics.median(times)

    context = list(range(100, 160))
    print("| tokens in the ubatch | trunk ms | trunk + MTP in graph ms | vs 1-token plain |")
    print("|---|---|---|---|")
    base = chained = None
    for n in range(1, max_draft + 2):
        with Model(path, n_ctx=1024, n_threads=1, rs_slots=n) as trunk, \
                Model(path, n_ctx=1024, n_threads=1, rs_slots=n, mtp=True) as fused:
            steps = []
            for m, in_graph in ((trunk, False), (fused, True)):
                m.eval(context)

                def step(m=m, in_graph=in_graph):
                    m.eval([5] * n, all_logits=n > 1 or in_graph, mtp_argmax=in_graph)

                def back(m=m):      # untimed: to n_past + 1, as a step that keeps one token
                    if n > 1:
                        m.rollback(n - 1)
                step()
                back()
                steps.append((step, back))
            costs = [float("inf"), float("inf")]
            for _ in range(rounds):
                for i, (f, back) in enumerate(steps):
                    costs[i] = min(costs[i], median_ms(f, back))
            if n == 1:
                h = fused.last_hidden[0][-1:]
                chained = min(median_ms(lambda: fused.mtp_eval([5], h, 61)) for _ in range(rounds))
        base = base or costs[0]
        print(f"| {n} | {costs[0]:.3f} | {costs[1]:.3f} | {costs[0] / base:.2f}x / {costs[1] / base:.2f}x |")
    print(f"\none-row MTP evaluation (a chained draft): {chained:.3f} ms", file=sys.stderr)


def main() -> None:
    from deltarun.model_files.generate import ensure_default_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-draft", type=int, default=6)
    ap.add_argument("--drafts", default="mtp,mtp-separate,ngram", help="comma-separated: mtp, mtp-separate, ngram")
    ap.add_argument("--step-costs", action="store_true", help="single-thread CPU time of verification steps by size")
    ap.add_argument("--cpu-clock", action="store_true",
                    help="tokens per second of CPU time (needs --threads 1): stable on a loaded machine")
    args = ap.parse_args()
    path = args.model or ensure_default_model()
    if args.step_costs:
        step_costs(path, args.max_draft)
        return
    if args.cpu_clock and args.threads != 1:
        sys.exit("--cpu-clock measures the calling thread: use it with --threads 1")
    drafts = args.drafts.split(",")
    if not set(drafts) <= {"mtp", "mtp-separate", "ngram"}:
        sys.exit(f"unknown draft in --drafts {args.drafts}: choose from mtp, mtp-separate, ngram")
    settings = [(None, 0)] + [(d, k) for d in drafts for k in range(1, args.max_draft + 1)]
    plain_tokens: dict[int, list[int]] = {}
    results: dict[tuple, dict[str, list[float]]] = {s: {"tps": [], "acc": [], "per_step": []} for s in settings}
    for _ in range(args.repeats):      # settings interleaved, so load changes hit them alike
        for draft, k in settings:
            for i, prompt in enumerate(PROMPTS):
                out, st, cpu_tps = run(path, prompt, args.n, args.threads, draft, k)
                if draft is None:
                    plain_tokens[i] = out
                elif out != plain_tokens[i]:
                    sys.exit(f"{draft} draft-max {k}: greedy output differs from plain decoding on prompt {i}")
                r = results[(draft, k)]
                r["tps"].append(cpu_tps if args.cpu_clock else st.generate_tps)
                if draft:
                    r["acc"].append(st.acceptance)
                    r["per_step"].append(st.tokens_per_step)
    rows = []
    for (draft, k), r in results.items():
        rows.append((draft or "plain", k, statistics.median(r["tps"]), statistics.mean(r["acc"]) if r["acc"] else None,
                     statistics.mean(r["per_step"]) if r["per_step"] else 1.0))
        print(f"{rows[-1][0]:12} {k}  {rows[-1][2]:7.1f} tok/s  "
              f"accept {'-' if rows[-1][3] is None else f'{rows[-1][3]:.2f}'}  tokens/step {rows[-1][4]:.2f}",
              file=sys.stderr, flush=True)
    plain = rows[0][2]
    unit = "tg tokens / CPU-second" if args.cpu_clock else "tg tokens/s"
    print(f"| draft | draft-max | {unit} | acceptance | tokens / step | speed-up |")
    print("|---|---|---|---|---|---|")
    for name, k, t, a, s in rows:
        print(f"| {name} | {k or '-'} | {t:.1f} | {'-' if a is None else f'{a:.0%}'} | {s:.2f} | {t / plain:.2f}x |")


if __name__ == "__main__":
    main()
