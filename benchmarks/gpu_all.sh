#!/usr/bin/env bash
# Every GPU check in one command, in under 10 minutes (its steps' limits add up to 550 s), on a machine with CUDA and its own torch:
# the device-sensitive tests, every device-sensitive path, CPU against the GPU over 10 seeds, repeat-
# determinism (benchmarks/gpu_check.py), and sites in parallel on the GPU (benchmarks/gpu_speed.py).
#
#     benchmarks/gpu_all.sh [OUT_DIR]        # logs and RESULTS.md in OUT_DIR (default $OUT, else /tmp/gpu_all)
#
# On a machine without a registry, first run benchmarks/gpu_wheels.sh where pip works and bring .whl/ along:
# its wheels are installed with --no-deps beside the machine's torch (never protobuf or grpcio: the image's
# serve its tensorboard), and .whl/tree.tar, if present, is the commit to check (a working tree may hold
# unfinished work). Each step has its own time limit and log; a failing step does not stop the others.
set -u
out="${1:-${OUT:-/tmp/gpu_all}}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
root="$PWD"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1  # threads are set explicitly by each script
python=python3
summary="$out/summary.txt"
: > "$summary"

step() {  # step NAME LIMIT_SECONDS COMMAND...: runs it with its log in $out/NAME.log
    local name="$1" limit="$2" start rc
    shift 2
    start=$(date +%s)
    echo "== $name (limit ${limit} s): $*" | tee -a "$summary"
    timeout -k 10 "$limit" "$@" >> "$out/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$summary"
    grep -E '^(PASS|FAIL|control|seeded|moon|fedavg| *[0-9]+ of [0-9]+ items)|passed|failed|error' "$out/$name.log" \
        | tail -n 80 >> "$summary"
    return 0
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nproc
    $python -c "import sys, torch, torchvision, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'torchvision', torchvision.__version__, 'numpy', numpy.__version__)"
} > "$out/env.txt" 2>&1

if ls "$root"/.whl/*.whl > /dev/null 2>&1; then
    step install 40 $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$root"/.whl/*.whl
    export PYTHONPATH=/tmp/site
fi
if [ -f "$root/.whl/tree.tar" ]; then
    rm -rf /tmp/tree && mkdir -p /tmp/tree && tar -xf "$root/.whl/tree.tar" -C /tmp/tree && cd /tmp/tree
fi
step install 40 $python -m pip install -q --no-index --no-deps --no-build-isolation -e .
$python -c "import fedcontrast, opacus, ray, openfl; print('imports ok', fedcontrast.__file__)" >> "$out/env.txt" 2>&1

# NVIDIA MPS, where it exists: the kernels of the pooled runs and of Ray's sites run side by side on the GPU
if command -v nvidia-cuda-mps-control > /dev/null; then  # the sites' kernels side by side on the GPU
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d >> "$summary" 2>&1 || echo "MPS did not start" >> "$summary"
fi
step gpu_check 330 $python benchmarks/gpu_check.py --test-workers 12 --test-timeout 110 --seeds 10 \
    --cpu-workers 4 --device-workers 11 --agreement-budget 170 --control fedavg moon --write
cp benchmarks/RESULTS.md "$out/RESULTS.md" 2>/dev/null
step gpu_speed 140 $python benchmarks/gpu_speed.py --sites 10 50 --algorithm moon --rounds 4 --write
[ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo quit | nvidia-cuda-mps-control
cp benchmarks/RESULTS.md "$out/RESULTS.md" 2>/dev/null
cat "$summary"
