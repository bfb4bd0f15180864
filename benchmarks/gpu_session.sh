#!/usr/bin/env bash
# One lease on a GPU machine, in phases that fit device commands (10 minutes each):
#   gpu     the gpu-marked tests (xdist)
#   suite   the rest of the suite (xdist); each failure named as it happens
#   probe   the FP8 GEMM probes at the 1B and 8B layer shapes
#   train   bench_train.py --device cuda at the 1B flavor (presets, impls, modes from BENCH_* variables)
# Logs and JSON go to $OUT (or ./gpu-out). Run from the repository root: PYTHONPATH=src, no install.
#   bash benchmarks/gpu_session.sh gpu probe
set -u -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
py=python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
for phase in "$@"; do
  echo "=== $phase"
  case $phase in
  gpu)
    timeout ${GPU_TIMEOUT:-200} $py -m pytest -q -m gpu -n 8 -p no:cacheprovider --timeout 180 -rfE tests 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" ;;
  suite)
    timeout ${SUITE_TIMEOUT:-540} $py -m pytest -v -m "not gpu" -n 14 -p no:cacheprovider --timeout 300 -rfE tests 2>&1 \
      | tee "$OUT/suite.log" | grep -E "FAILED|ERROR|passed|failed" ;;
  probe)
    timeout 120 $py benchmarks/fp8_gemm_probe.py --device cuda --flavors 1B,8B --json "$OUT/fp8_probe.json" 2>&1 \
      | tee "$OUT/fp8_probe.log" | tail -60 ;;
  train)
    timeout ${BENCH_TIMEOUT:-560} $py benchmarks/bench_train.py --device cuda --flavor 1B --seq-len 2048 \
      --batch ${BENCH_BATCH:-4} --steps ${BENCH_STEPS:-6} --presets ${BENCH_PRESETS:-bf16-mixed} \
      --impls ${BENCH_IMPLS:-plain,mixprec} --compile-modes ${BENCH_MODES:-eager,compiled} \
      --run-timeout ${BENCH_RUN_TIMEOUT:-240} --json "$OUT/train-${BENCH_TAG:-run}.json" --profile-dir "$OUT" \
      ${BENCH_PROFILE:+--profile "$BENCH_PROFILE"} ${BENCH_EXTRA:-} 2>&1 | tee "$OUT/train-${BENCH_TAG:-run}.log" ;;
  *) echo "phases: gpu suite probe train"; exit 2 ;;
  esac
done
