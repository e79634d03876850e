"""Load one model file and evaluate one token, in a process of its own: a crash probe for tests.

`python -m deltarun.apps.fault_probe FILE` prints one line and exits with

- 0 and ``OK n_vocab=...`` when the model loaded and evaluated a token;
- the error's `exit_code` and ``ERROR <ClassName>: <message>`` when deltarun refused the file
  with a `DeltarunError`.

Anything else (a Python traceback, a signal from a GGML_ASSERT or a segfault, a hang) is a bug in
deltarun's validation, which is what the fault and fuzz tests look for. Other exceptions are left
to propagate on purpose, so they show up as a traceback on stderr.

``--max-memory-mb N`` caps the process's address space (RLIMIT_AS), so a file that makes the
loader try to allocate gigabytes fails loudly instead of swapping the machine.
"""

from __future__ import annotations

import argparse
import sys


def _limit_memory(mb: int) -> None:
    import resource

    limit = mb * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def probe(path: str, n_ctx: int = 64, n_threads: int = 1) -> str:
    """Load `path`, evaluate one token, and return the OK line; raises what the loader raises."""
    from deltarun.runner.model import Model

    with Model(path, n_ctx=n_ctx, n_threads=n_threads) as model:
        ids = model.tokenizer.encode("hi")
        token = ids[0] if ids else 0
        logits = model.eval([token])
        return f"OK n_vocab={model.hp.n_vocab} logits={logits.shape[0]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deltarun.apps.fault_probe", description=__doc__.split("\n")[0])
    parser.add_argument("path")
    parser.add_argument("--n-ctx", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-memory-mb", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_memory_mb:
        _limit_memory(args.max_memory_mb)

    from deltarun.base.errors import DeltarunError

    try:
        line = probe(args.path, args.n_ctx, args.threads)
    except DeltarunError as e:
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        return e.exit_code
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
