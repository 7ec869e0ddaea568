#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go, each stage under its own time limit so that one slow stage cannot
# starve the rest: the CUDA variants of the tests and torch's own pruning suite with a GPU visible (tests), the
# 2:4 semi-structured and compact-transformer speeds (speed), the engine at 134M and 1B and the training step
# (engine).
#
# Usage: bash benchmarks/gpu_run.sh OUT_DIR [STAGE...]   (from the repository root, lightprune importable, e.g.
#        PYTHONPATH=src; STAGE: tests, speed, engine; default: all three)
# Writes OUT_DIR/gpu/gpu_speed.{json,md} and OUT_DIR/engine_cuda_{134M,train,1B}.json; prints everything.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_run.sh OUT_DIR [tests|speed|engine]...}
shift
stages=${*:-tests speed engine}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
stage() {  # stage NAME SECONDS COMMAND...: run COMMAND under a time limit, report how it ended
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - started))s"
    [ "$rc" -eq 0 ] || status=1
}
wanted() { [[ " $stages " == *" $1 "* ]]; }

python -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || true

if wanted tests; then
    stage "CUDA tests" 150 python -m pytest -q -p no:cacheprovider -o addopts="" -k cuda -rs \
        tests/prune/test_devices.py tests/callback/test_callback_devices.py tests/export/test_export_devices.py \
        tests/prune/test_methods.py tests/prune/test_defects.py tests/callback/test_callback.py
    stage "torch's pruning suite" 45 python -m pytest -q -p no:cacheprovider -o addopts="" \
        tests/prune/test_torch_suite.py
fi
if wanted speed; then
    stage "gpu_speed" 100 python benchmarks/gpu_speed.py --out "$out/gpu"
fi
if wanted engine; then
    stage "engine 134M" 110 python benchmarks/engine.py --device cuda --sizes 134M --torch-sizes 134M \
        --all-ops-sizes 134M --ops global_l1,l1_layerwise --repeats 2 --no-train --timeout 60 \
        --out "$out/engine_cuda_134M.json"
    stage "engine 1B" 70 python benchmarks/engine.py --device cuda --sizes 1B --repeats 2 --no-train --timeout 45 \
        --out "$out/engine_cuda_1B.json"
    stage "engine training step" 90 python benchmarks/engine.py --device cuda --train-only --repeats 2 --timeout 30 \
        --out "$out/engine_cuda_train.json"
fi
exit "$status"
