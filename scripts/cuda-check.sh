#!/usr/bin/env bash
# For a machine with an NVIDIA GPU: build the CUDA variant (scripts/install-cuda.sh, cached),
# then compare CPU against CUDA with `deltarun compare` and measure both with `deltarun bench` on
# the tiny models of every family and the bench-preset ones; prints one markdown table (and keeps
# the JSON reports).
#
#   scripts/cuda-check.sh [--venv DIR] [--out DIR] [--skip-install]
#
# Environment: BENCH_P (default 512), BENCH_N (default 128), BENCH_R (default 3), THREADS.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$HOME/.cache/deltarun-venv-cuda}
OUT=${OUT:-$(mktemp -d)}
INSTALL=1
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --skip-install) INSTALL=0; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
[ "$INSTALL" = 1 ] && scripts/install-cuda.sh --venv "$VENV"
PY=$VENV/bin/python
mkdir -p "$OUT"
DR=("$PY" -m deltarun)
THREADS=${THREADS:-$(nproc)}
echo "[cuda-check] reports in $OUT" >&2
"${DR[@]}" devices | tee "$OUT/devices.txt" >&2

MODELS=()
# every family: qwen3next (tiny, bench), qwen35, qwen35moe, kimi-linear, qwen4exp
for spec in tiny:f32 tiny:q8_0 tiny:q4_k tiny-tied:f32 tiny-qwen35:f32 tiny-qwen35moe:f32 tiny-kimi-linear:f32 \
            tiny-qwen4exp:f32 bench:f32 bench:q8_0; do
  preset=${spec%%:*}; type=${spec##*:}
  f=$OUT/$preset-$type.gguf
  [ -f "$f" ] || "${DR[@]}" make-tiny "$f" --preset "$preset" --type "$type" >/dev/null
  MODELS+=("$f")
done

HAVE_BENCH=0
"${DR[@]}" bench --help >/dev/null 2>&1 && HAVE_BENCH=1
status=0
for f in "${MODELS[@]}"; do
  name=$(basename "$f" .gguf)
  echo "[cuda-check] compare $name" >&2
  # GGML_CUDA_FORCE_CUBLAS off: the default kernels, as users run them
  if ! "${DR[@]}" compare "$f" --backends cpu,cuda --tokens 64 -n 16 -t "$THREADS" --json -q > "$OUT/compare-$name.json"; then
    status=1
  fi
  if [ "$HAVE_BENCH" = 1 ]; then
    echo "[cuda-check] bench $name" >&2
    "${DR[@]}" bench "$f" -p "${BENCH_P:-512}" -n "${BENCH_N:-128}" -r "${BENCH_R:-3}" -t "$THREADS" \
      --backend cpu,cuda -o json > "$OUT/bench-$name.json" || true
  fi
done

"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def fmt(x):
    return "-" if x is None else (x if isinstance(x, str) else f"{x:.3g}")
print("| model | nodes compared / failed | worst node NMSE (op) | first failure | logits NMSE | top-1 | KL mean | greedy | "
      "pp cpu t/s | pp cuda t/s | tg cpu t/s | tg cuda t/s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for rep_path in sorted(out.glob("compare-*.json")):
    name = rep_path.stem[len("compare-"):]
    try:
        rep = json.loads(rep_path.read_text())
    except ValueError:
        print(f"| {name} | (compare failed to run) |"); continue
    nodes = [n for g in rep["graphs"] for n in g["nodes"] if isinstance(n["nmse"], (int, float))]
    worst = max(nodes, key=lambda n: n["nmse"], default=None)
    comp = sum(g["n_compared"] for g in rep["graphs"]); failed = sum(g["n_failed"] for g in rep["graphs"])
    first = next((g["first_failure"] for g in rep["graphs"] if g["first_failure"]), None)
    lg, gr = rep["logits"], rep["greedy"]
    tps = {}
    bench = out / f"bench-{name}.json"
    if bench.exists():
        try:
            for r in json.loads(bench.read_text())["results"]:
                tps[(r["kind"], r["backend"].split(":")[0])] = f"{r['avg_tps']:.1f}"
        except (ValueError, KeyError):
            pass
    print(f"| {name} | {comp} / {failed} | {fmt(worst['nmse']) if worst else '-'} ({worst['op'] if worst else '-'}) | "
          f"{(first['name'] + ' ' + fmt(first['nmse'])) if first else '-'} | {fmt(lg['nmse'])} | "
          f"{lg['top1_agreement']:.3f} | {fmt(lg['kl_mean'])} | {'match' if gr['match'] else 'differ@' + str(gr['first_divergence'])} | "
          f"{tps.get(('pp', 'cpu'), '-')} | {tps.get(('pp', 'cuda'), '-')} | {tps.get(('tg', 'cpu'), '-')} | {tps.get(('tg', 'cuda'), '-')} |")
PY
exit $status
