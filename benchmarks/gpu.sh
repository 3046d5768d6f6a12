#!/usr/bin/env bash
# Runs the overhead, memory, BMUF, demo, copies and dispatch benchmarks on this machine's
# CUDA GPU(s) and writes their tables to a folder. Installs nothing: it needs a Python that already
# has jax with CUDA, flax, optax, orbax-checkpoint, scikit-learn, tqdm and
# matplotlib; jdp itself is used from this checkout (PYTHONPATH), installed or not.
# Every step has a time limit; the whole script stays under 8 minutes.
#
#   benchmarks/gpu.sh OUTDIR              # on a CUDA machine
#   PYTHON=/path/to/python benchmarks/gpu.sh OUTDIR
#   benchmarks/gpu.sh --cpu-dry-run OUTDIR   # the same steps, quick, on CPU
#
# OUTDIR receives machine.txt (GPUs, driver, versions), overhead.txt, memory.txt, bmuf.txt,
# demo.txt (the demo's summary table for sync, bmuf and zero), copies.txt, dispatch.txt
# and gpu.log (all output). Exit status: 0 if every step passed, 1 otherwise, 2 for bad usage or no GPU.
set -u

dry_run=0
if [ "${1:-}" = "--cpu-dry-run" ]; then
    dry_run=1
    shift
fi
if [ $# -ne 1 ]; then
    echo "usage: benchmarks/gpu.sh [--cpu-dry-run] OUTDIR" >&2
    exit 2
fi
out=$1
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out" || { echo "gpu.sh: cannot create $out" >&2; exit 2; }
out=$(cd "$out" && pwd)
log="$out/gpu.log"
: >"$log"

if [ -z "${PYTHON:-}" ]; then
    if [ -x "$root/.venv/bin/python" ]; then PYTHON=$root/.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MPLBACKEND=Agg
if [ $dry_run = 1 ]; then
    export JAX_PLATFORMS=cpu
    # Whether each step runs, not how fast: LLVM's -O3 would cost more than the
    # few calls of each program save.
    export JAX_DISABLE_MOST_OPTIMIZATIONS=1
    # XLA:CPU's older fusion emitters: the same fusions, compiled in less time.
    export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_cpu_use_fusion_emitters=false"
else
    export JAX_PLATFORMS=cuda,cpu # CUDA first: jax.devices() are the GPUs
fi
cd "$root" || exit 2

budget_s=470 # 8 minutes, less a margin for start-up
step_status=0

# run NAME LIMIT_S COMMAND...: runs COMMAND with a time limit (cut to what is left of
# the budget), output to the console, gpu.log and OUTDIR/NAME.txt (appended).
run() {
    local name=$1 limit=$2
    shift 2
    local left=$((budget_s - SECONDS))
    # A dry run checks that each step runs, not how fast: on a busy CPU a step
    # may take what is left of the whole budget.
    [ $dry_run = 1 ] && limit=$left
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        echo "gpu.sh: skipping $name: out of time" | tee -a "$log" "$out/$name.txt"
        step_status=1
        return
    fi
    {
        echo "\$ $*"
        echo "# $(date '+%Y-%m-%d %H:%M %Z'), limit ${limit} s"
    } | tee -a "$log" "$out/$name.txt"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log" "$out/$name.txt"
    local code=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    if [ "$code" -ne 0 ]; then
        step_status=1
        echo "# FAILED: exit $code after ${took} s (124: out of time)" | tee -a "$log" "$out/$name.txt"
    else
        echo "# ok, ${took} s" | tee -a "$log" "$out/$name.txt"
    fi
    echo | tee -a "$log" "$out/$name.txt" >/dev/null
}

# -- the machine ------------------------------------------------------------------
{
    echo "date: $(date '+%Y-%m-%d %H:%M %Z')"
    echo "host: $(uname -srm), $(nproc) CPU cores"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
    fi
    timeout 120 "$PYTHON" - <<'EOF'
import sys
import jax
import jdp
ds = jax.devices()
print(f"python {sys.version.split()[0]} ({sys.executable}); jax {jax.__version__}; "
      f"jdp {jdp.__version__}")
print(f"jax devices: {len(ds)} x {ds[0].device_kind} ({ds[0].platform})")
EOF
} >"$out/machine.txt" 2>&1
code=$?
cat "$out/machine.txt" | tee -a "$log"
if [ $code -ne 0 ]; then
    echo "gpu.sh: $PYTHON cannot import jax and jdp (see above); set PYTHON." | tee -a "$log" >&2
    exit 2
fi
if [ $dry_run = 0 ] && ! grep -q "^jax devices: .*(gpu)$" "$out/machine.txt"; then
    echo "gpu.sh: jax sees no CUDA GPU here (see $out/machine.txt);" \
        "use --cpu-dry-run to try the steps on CPU." | tee -a "$log" >&2
    exit 2
fi
num=$(sed -n 's/^jax devices: \([0-9]*\) x.*/\1/p' "$out/machine.txt")

# -- the benchmarks ----------------------------------------------------------------
if [ $dry_run = 1 ]; then
    run overhead 150 "$PYTHON" benchmarks/overhead.py --devices 2 --quick
    run memory 150 "$PYTHON" benchmarks/memory.py --params 2e6 --steps 1 --rounds 1 \
        --only plain ZeRO
    run bmuf 150 "$PYTHON" benchmarks/bmuf.py --devices 2 --quick --rounds 1 --steps 12
    # The demo's algorithms have their own tests (tests/test_demo.py): one here.
    demo_args=(--devices 2 --steps 20)
    algos=(sync)
else
    run overhead 120 "$PYTHON" benchmarks/overhead.py --devices "$num"
    run memory 150 "$PYTHON" benchmarks/memory.py
    run bmuf 120 "$PYTHON" benchmarks/bmuf.py --devices "$num" --rounds 3
    demo_args=()
    algos=(sync bmuf zero)
fi
demo_out=$(mktemp -d)
for algo in "${algos[@]}"; do
    run demo 60 "$PYTHON" -m jdp.demo --algo "$algo" --no-progress \
        --out "$demo_out/$algo" ${demo_args[@]+"${demo_args[@]}"}
done
rm -rf "$demo_out"
# Which copies XLA leaves in each compiled step (in-place updates on this backend).
run copies 90 "$PYTHON" benchmarks/copies.py --quick
# Last, so that it cannot take the demo's time: the host's cost per call.
if [ $dry_run = 1 ]; then
    run dispatch 60 "$PYTHON" benchmarks/dispatch.py --devices 2 --rounds 1 --calls 3 \
        --dict-leaves 10
else
    run dispatch 60 "$PYTHON" benchmarks/dispatch.py --devices "$num" --quick
fi

echo "gpu.sh: done in ${SECONDS} s; tables in $out" | tee -a "$log"
exit $step_status
