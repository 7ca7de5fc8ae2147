#!/usr/bin/env bash
# Every check and figure that needs a CUDA GPU, in one run on one GPU, within a time budget:
#   1. gpu-tests: tests/gpu but the inductor test (NCCL parity at world size 1, offload copies on a
#      side stream, sharded checkpoints of an offloaded model kept on the host, DDP streams, clipping
#      and the grad scaler's CUDA kernels, a torch FSDP1 script with only the wrapper's import changed
#      against torch FSDP1 itself);
#   2. gpu-compile-test: torch.compile with inductor against eager training (the slowest test);
#   3. offload-model-tests: OffloadModel's CUDA tests (parity and peak memory);
#   4. offload-memory: benchmarks/offload_memory.py, peak device memory and step time of OffloadModel
#      and of FSDP with move_params_to_cpu, against the plain model on the device;
#   5. peers: benchmarks/peers.py at world size 1, step time against the unwrapped model, torch FSDP2,
#      DDP and (when installed) fairscale's FSDP, and peak CUDA memory.
#
#   bash benchmarks/gpu_checks.sh [--dry-run] [--wheels DIR] [OUT_DIR] [peers.py arguments...]
#
# OUT_DIR (default out/gpu) receives summary.json (what passed, every test's outcome, the figures;
# see benchmarks/gpu_checks_summary.py), gpu_checks.log (everything printed), offload_memory.json
# and peers/peers.{json,md,png}: six files. Exits 0 when every step passed, else 1 (the other steps
# still run). Steps run in the order above; each has a budget (seconds) and all of them together
# FSDP_GPU_CHECKS_BUDGET_S (default 450: the run ends within 8 minutes); a step over its budget is
# stopped and counted "timeout", and a step with under 10 s left is "skipped".
#
# The machine: one CUDA GPU, python3 with a CUDA build of torch >= 2.11, no package index needed.
# The tests need pytest (pytest-timeout stops a hung test early); peers.py needs the example's
# imports (tqdm) and, for its plot, matplotlib. Without pytest the test steps are skipped, without
# matplotlib peers runs with --no-plot, and without fairscale it leaves fairscale's variants out;
# the summary says which. Packages missing there travel as wheels: --wheels DIR (default .whl when
# it exists) installs every DIR/*.whl with `pip install --no-index --no-deps --target` into a
# temporary directory put first on PYTHONPATH. fairscale has no wheel on PyPI; build one here, on a
# machine with a package index (it is pure Python, and needs torch and numpy, which are there):
#
#   python3 -m pip wheel fairscale==0.4.13 --no-deps -w .whl      # .whl/ is git-ignored
#
# On a GPU machine lent through the device tool `run` (it copies this working tree, runs one command
# and brings back what the command writes under $OUT), with the wheel built as above:
#
#   run(command='bash benchmarks/gpu_checks.sh "$OUT"', carry=[".whl"], timeout_s=540)
#
# then read $OUT/summary.json (and gpu_checks.log for the details).
#
# --dry-run (or FSDP_GPU_CHECKS_DRY_RUN=1) runs the same steps on the CPU with the GPUs hidden: tiny
# sizes, gloo, the GPU tests collected and skipped, budget FSDP_GPU_CHECKS_BUDGET_S (default 270).
# tests/unit/test_gpu_checks.py runs it, so the script keeps working while no GPU is at hand.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=${FSDP_GPU_CHECKS_DRY_RUN:-0}
[ "$dry_run" = 0 ] || dry_run=1
wheels=${FSDP_GPU_WHEELS:-}
while [ $# -gt 0 ]; do
    case $1 in
    --dry-run) dry_run=1 ;;
    --wheels)
        wheels=${2:?--wheels needs a directory}
        shift
        ;;
    *) break ;;
    esac
    shift
done
out=out/gpu
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then # a first argument not starting with "-" is OUT_DIR
    out=$1
    shift
fi
peers_args=("$@")
if [ -z "$wheels" ] && [ -d .whl ]; then
    wheels=.whl
fi
if [ "$dry_run" = 1 ]; then
    budget=${FSDP_GPU_CHECKS_BUDGET_S:-270}
    export CUDA_VISIBLE_DEVICES="" # CPU and gloo even on a GPU machine
else
    budget=${FSDP_GPU_CHECKS_BUDGET_S:-450}
fi
deadline=$((SECONDS + budget))

mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu_checks.log"
: >"$log"
rm -rf "$out/summary.json" "$out/offload_memory.json" "$out/peers"
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_checks.XXXXXX")
trap 'rm -rf "$work"' EXIT
# the interpreter that runs every step: $PYTHON when set (a test passes its own), else python3 on the PATH
export PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 FSDP_GPU_REPORTS="$work/gpu_reports.jsonl"
say() { echo "$*" | tee -a "$log"; }
record() { # record NAME STATUS EXIT SECONDS BUDGET NOTE
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$work/steps.tsv"
}
have() { "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

# every step: at most BUDGET seconds, and never past the deadline
step() { # step NAME BUDGET NOTE COMMAND...
    local name=$1 limit=$2 note=$3
    shift 3
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 10 ]; then
        say "=== $name: skipped, no time left in the ${budget} s budget"
        record "$name" skipped 0 0 0 "no time left in the ${budget} s budget${note:+; $note}"
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    say "=== $name (at most $limit s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log" "$work/$name.out"
    local rc=${PIPESTATUS[0]} status=passed
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status=timeout
        note="stopped after its $limit s${note:+; $note}"
    elif [ "$rc" -ne 0 ]; then
        status=failed
    fi
    say "=== $name: $status (exit $rc) after $((SECONDS - start)) s"
    record "$name" "$status" "$rc" "$((SECONDS - start))" "$limit" "$note"
}
skip() { # skip NAME NOTE
    say "=== $1: skipped, $2"
    record "$1" skipped 0 0 0 "$2"
}

# ------------------------------------------------------------------ the machine and its packages
installed=""
if [ -n "$wheels" ]; then
    if compgen -G "$wheels/*.whl" >/dev/null; then
        if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
            "$wheels"/*.whl >>"$log" 2>&1; then
            installed=$(cd "$wheels" && ls -- *.whl | tr '\n' ' ')
            export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
        else
            say "gpu_checks: installing the wheels in $wheels failed (see above); going on without them"
        fi
    else
        say "gpu_checks: no wheels in $wheels"
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" # this checkout's fsdp, also in subprocesses
"$PYTHON" - "$dry_run" "$installed" >"$work/env.json" <<'EOF'
import importlib.metadata as md, importlib.util, json, platform, sys
import torch
names = ["pytest", "pytest_timeout", "hypothesis", "fairscale", "matplotlib", "numpy", "tqdm"]
wheels = [w.split("-")[0].lower() for w in sys.argv[2].split()]
found = {}
for name in dict.fromkeys(names + wheels):
    if importlib.util.find_spec(name) is None:
        found[name] = None
        continue
    try:
        found[name] = md.version(name.replace("_", "-"))
    except md.PackageNotFoundError:
        found[name] = "found"
cuda = torch.cuda.is_available()
print(json.dumps({
    "dry_run": sys.argv[1] == "1",
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda": cuda,
    "device": torch.cuda.get_device_name() if cuda else "cpu",
    "wheels_installed": sys.argv[2].split(),
    "packages": found,
}))
EOF
say "gpu_checks: $(cat "$work/env.json")"
if [ "$dry_run" = 0 ] && ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    say "gpu_checks: torch sees no CUDA device (use --dry-run for the CPU version)"
    "$PYTHON" benchmarks/gpu_checks_summary.py --out "$out" --work "$work" --wall-s "$SECONDS" \
        --budget-s "$budget" | tee -a "$log"
    exit 1
fi

# ------------------------------------------------------------------ the steps
pytest_args=(-v -rfEs -p no:cacheprovider -o timeout=150)
if have pytest; then
    step gpu-tests 150 "" "$PYTHON" -m pytest "${pytest_args[@]}" tests/gpu -k "not inductor"
    step gpu-compile-test 120 "" "$PYTHON" -m pytest "${pytest_args[@]}" tests/gpu -k inductor
    step offload-model-tests 45 "" "$PYTHON" -m pytest "${pytest_args[@]}" tests/unit/test_offload_model.py -k cuda
else
    for name in gpu-tests gpu-compile-test offload-model-tests; do
        skip "$name" "pytest is not installed (carry its wheel with --wheels)"
    done
fi

# without CUDA (the dry run) the script measures a tiny model on the CPU by itself
step offload-memory 60 "" "$PYTHON" benchmarks/offload_memory.py --out "$out/offload_memory.json"

extra=()
note=""
if [ "$dry_run" = 1 ]; then
    extra+=(--sizes 1M --rounds 1 --warmup 1 --batch-size 2 --block-size 16 --fairscale no)
    note="dry run: size 1M, one round"
elif ! have fairscale; then
    extra+=(--fairscale no)
    note="fairscale is not installed: its variants left out (carry its wheel with --wheels)"
fi
if ! have matplotlib; then
    extra+=(--no-plot)
    note="${note:+$note; }matplotlib is not installed: no peers.png"
fi
step peers 130 "$note" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 \
    -m benchmarks.peers --out "$out/peers" ${extra[@]+"${extra[@]}"} ${peers_args[@]+"${peers_args[@]}"}

# ------------------------------------------------------------------ the summary
"$PYTHON" benchmarks/gpu_checks_summary.py --out "$out" --work "$work" --wall-s "$SECONDS" \
    --budget-s "$budget" $([ "$dry_run" = 1 ] && echo --dry-run) | tee -a "$log"
"$PYTHON" -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1]))["all_passed"])' "$out/summary.json"
