#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go, each stage under its own time limit so that one slow stage cannot
# starve the rest: the CUDA variants of the tests and torch's own pruning suite with a GPU visible (tests), the
# 2:4 semi-structured and compact-transformer speeds (speed), the engine at 134M and 1B and the training step
# (engine), a global selection's warm time split into its passes at several chunk sizes (select), the training
# step alone (train), and the fast part of the whole suite with the GPU visible, so that every Trainer left on
# Lightning's "auto" accelerator trains on it (suite).
#
# Usage: bash benchmarks/gpu_run.sh OUT_DIR [STAGE...]   (from the repository root, lightprune importable, e.g.
#        PYTHONPATH=src; STAGE: tests, speed, engine, select, train, suite; default: tests speed engine)
# Writes OUT_DIR/gpu/gpu_speed.{json,md}, OUT_DIR/engine_cuda_{134M,train,1B}.json, OUT_DIR/gpu_select.json and
# OUT_DIR/suite.log; prints everything.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_run.sh OUT_DIR [tests|speed|engine]...}
shift
stages=${*:-tests speed engine}
suite_workers=${SUITE_WORKERS:-12}
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
    stage "CUDA tests" 150 python -m pytest -q -p no:cacheprovider -o addopts="" -n 4 -k cuda -rfEs \
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
fi
if wanted select; then
    stage "global selection, warm" 120 python benchmarks/gpu_select.py --out "$out"
fi
if wanted train || wanted engine; then
    stage "engine training step" 150 python benchmarks/engine.py --device cuda --train-only --repeats 2 --timeout 30 \
        --out "$out/engine_cuda_train.json"
fi
if wanted suite; then
    stage "suite, not slow, GPU visible" "${SUITE_SECONDS:-240}" bash -c "python -m pytest -p no:cacheprovider -n \
        $suite_workers -m 'not slow' -rfE -v tests 2>&1 | tee '$out/suite.log' | grep -a 'FAILED\|ERROR\| passed'"
fi
exit "$status"
