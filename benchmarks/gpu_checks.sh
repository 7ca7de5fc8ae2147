#!/usr/bin/env bash
# Every check and figure that needs a CUDA GPU, in one run, on one GPU:
#   - the GPU tests (tests/gpu: NCCL parity at world size 1, offload copies on a side stream,
#     sharded checkpoints of an offloaded model kept on the host, DDP streams, clipping and the
#     grad scaler's CUDA kernels, torch.compile with inductor against eager training, a torch FSDP1
#     script with only the wrapper's import changed against torch FSDP1 itself) and
#     OffloadModel's CUDA tests (parity and peak memory);
#   - benchmarks/offload_memory.py: peak device memory and step time of OffloadModel and of FSDP with
#     move_params_to_cpu, against the plain model on the device;
#   - benchmarks/peers.py at world size 1: step time against the unwrapped model, torch FSDP2, DDP and
#     (when it is importable) fairscale's FSDP, and peak CUDA memory.
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR] [peers.py arguments...]     (OUT_DIR defaults to out/gpu)
#
# Writes OUT_DIR/gpu_checks.log (everything printed), offload_memory.json and peers/peers.{json,md,png}.
# Exits non-zero if any part failed; the others still run. Needs python3 with a CUDA build of torch,
# pytest and matplotlib. fairscale is optional; on a machine without network access, build its wheel
# elsewhere (pip wheel --no-deps fairscale==0.4.13) and install it with pip install --no-index.
set -uo pipefail
cd "$(dirname "$0")/.."
out=out/gpu
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then  # a first argument not starting with "-" is OUT_DIR
    out=$1
    shift
fi
mkdir -p "$out"
log="$out/gpu_checks.log"
: >"$log"
python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_checks: torch sees no CUDA device")' || exit 1
export PYTHONUNBUFFERED=1
failed=()
step() {
    local name=$1
    shift
    echo "=== $name: $*" | tee -a "$log"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
    [ "$rc" -eq 0 ] || failed+=("$name")
}
python3 -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name())' | tee -a "$log"
python3 -c 'import fairscale; print("fairscale", fairscale.__version__)' 2>&1 | tail -1 | tee -a "$log"
step gpu-tests python3 -m pytest -q -p no:cacheprovider -rs tests/gpu
step offload-model-tests python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_offload_model.py -k cuda
step offload-memory python3 benchmarks/offload_memory.py --out "$out/offload_memory.json"
step peers python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m benchmarks.peers --out "$out/peers" "$@"
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_checks: failed: ${failed[*]}" | tee -a "$log"
    exit 1
fi
echo "gpu_checks: all parts passed" | tee -a "$log"
