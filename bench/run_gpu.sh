#!/usr/bin/env bash
# All of tandem's GPU benchmarks in one device call (bench/README.md).
#
# On the GPU machine, from the repository root (the device tool's `run`, with
# carry [".whl"] holding mctx, pgx, svgwrite and chex wheels):
#
#   TANDEM_COMMIT=<git rev-parse HEAD here> bash bench/run_gpu.sh
#
# runs mcts_peer, mcts_latency, mcts_throughput and search_quality with their
# full sizes, writes the result files into $OUT (else bench/results), a log
# beside them (run_gpu.log), and prints the tables last. Arguments, if any,
# replace that list: each is one benchmark with its options, e.g.
#
#   bash bench/run_gpu.sh "mcts_peer --systems mctx" "mcts_latency --backend cpu"
#
# A benchmark that fails (or runs past $BENCH_TIMEOUT_S, default 570 s) does
# not stop the others; the script exits non-zero if any failed. Locally, `bash bench/run_gpu.sh --quick` runs every benchmark
# with --quick (CPU sizes) into bench/results: the smoke test of this script.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SITE=${WHEEL_SITE:-/tmp/site}  # where the carried wheels are installed
OUTDIR=${OUT:-bench/results}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/run_gpu.log"
: >"$LOG"
log() { echo "$@" | tee -a "$LOG"; }

# Carried wheels (pure Python): mctx, pgx and svgwrite are not on the GPU
# machine; chex only if the machine's is older than mctx needs.
wheels=()
for name in mctx pgx svgwrite; do
    for f in .whl/${name}-*.whl; do [ -e "$f" ] && wheels+=("$f"); done
done
if ! $PY -c 'import importlib.metadata as m, sys; v = tuple(int(x) for x in m.version("chex").split(".")[:3]); sys.exit(v < (0, 1, 91))' 2>/dev/null; then
    for f in .whl/chex-*.whl; do [ -e "$f" ] && wheels+=("$f"); done
fi
if [ ${#wheels[@]} -gt 0 ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
        && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} \
        || log "wheel install failed: ${wheels[*]}"
fi

log "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi') commit=${TANDEM_COMMIT:-?}"

quick=()
if [ "${1:-}" = "--quick" ]; then quick=(--quick); shift; fi
if [ $# -eq 0 ]; then set -- mcts_peer mcts_latency mcts_throughput search_quality; fi

failed=()
for spec in "$@"; do
    read -r -a words <<<"$spec"
    log "== ${words[*]} ${quick[*]:-} (start $(date -u +%T))"
    SECONDS=0
    timeout "${BENCH_TIMEOUT_S:-570}" $PY -m "bench.${words[0]}" "${words[@]:1}" "${quick[@]}" --out "$OUTDIR" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    log "== ${words[0]}: rc=$rc, ${SECONDS}s"
    [ "$rc" -eq 0 ] || failed+=("${words[0]}")
done

$PY -m bench.tables --results "$OUTDIR" | tee -a "$LOG"
if [ ${#failed[@]} -gt 0 ]; then
    log "FAILED: ${failed[*]}"
    exit 1
fi
