#!/usr/bin/env bash
# One lease on a GPU machine, in phases that each fit one device command (10 minutes):
#   tests   the gpu-marked tests, then the rest of the suite (xdist), then the FP8 GEMM probes
#   train   bench_train.py --device cuda at the 1B flavor (presets, impls, modes from BENCH_* variables)
# Logs and JSON go to $OUT (or ./gpu-out). Run from the repository root: PYTHONPATH=src, no install.
set -u -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
py=python3
phase=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
case $phase in
tests)
  timeout 200 $py -m pytest -q -m gpu -n 8 -p no:cacheprovider --timeout 180 -rfE tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  timeout 270 $py -m pytest -q -m "not gpu" -n 14 -p no:cacheprovider --timeout 240 -rfE tests 2>&1 \
    | tee "$OUT/suite.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40
  timeout 90 $py benchmarks/fp8_gemm_probe.py --device cuda --flavors 1B,8B --json "$OUT/fp8_probe.json" 2>&1 \
    | tee "$OUT/fp8_probe.log" | tail -70
  ;;
train)
  timeout ${BENCH_TIMEOUT:-560} $py benchmarks/bench_train.py --device cuda --flavor 1B --seq-len 2048 \
    --batch ${BENCH_BATCH:-4} --steps ${BENCH_STEPS:-6} --presets ${BENCH_PRESETS:-bf16-mixed} \
    --impls ${BENCH_IMPLS:-plain,mixprec} --compile-modes ${BENCH_MODES:-eager,compiled} \
    --run-timeout ${BENCH_RUN_TIMEOUT:-240} --json "$OUT/train-${BENCH_TAG:-run}.json" --profile-dir "$OUT" \
    ${BENCH_PROFILE:+--profile "$BENCH_PROFILE"} ${BENCH_EXTRA:-} 2>&1 | tee "$OUT/train-${BENCH_TAG:-run}.log"
  ;;
*) echo "phase: tests or train"; exit 2 ;;
esac
