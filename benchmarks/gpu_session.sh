#!/usr/bin/env bash
# One lease on a GPU machine, in phases that fit device commands (10 minutes each):
#   gpu     the gpu-marked tests (xdist)
#   suite   the rest of the suite (xdist); each failure named as it happens
#   probe   the FP8 GEMM probes at the 1B and 8B layer shapes
#   train   bench_train.py --device cuda at the 1B flavor (presets, impls, modes from BENCH_* variables)
#   layers  one compiled Linear per FP8 recipe against bfloat16, and the microscaled emulated GEMMs
#           (bfloat16 and FP32 routes), at the 1B layer shapes; which compiled kernels copy FP8 into FP8
#   speed   the 1B flavor, 4 x 2048 tokens, compiled, the default loss: the plain compiled loop (SPEED_BASELINES=1),
#           then each of SPEED_PRESETS (PRESET:kernel: row-wise GEMMs on torch's row-wise kernel), each with its graph
#           breaks, synchronisation warnings, probe lines and a kernel table. ~1 minute a run, the plain loop up to
#           4: in two commands of under 8 minutes, each with bf16-mixed for its ratios:
#             RES=gpu-speed1 SPEED_PRESETS="bf16-mixed fp8-tensorwise fp8-rowwise fp8-rowwise:kernel" ... speed
#             RES=gpu-speed2 SPEED_BASELINES=0 SPEED_PRESETS="bf16-mixed fp8-blockwise mxfp8 nvfp4" ... speed
#   moe     one MoE layer (Qwen3-30B-A3B's shape: H 2048, I 768, 128 experts, top-8, 16384 tokens) forward and
#           backward per recipe against bf16-mixed, eager then compiled (benchmarks/moe_layer.py; ~3 minutes),
#           after its estimate (benchmarks/moe_roofline.py)
#   accuracy  the small flavor, ACC_STEPS (300) steps, seeds SEEDS (0 1 2 3 4): mixprec plan once (seed 0),
#           then mixprec compare per seed; the seed_spread table and plot after each seed (ACC_PLAN=0: no plan)
# Logs and JSON go to $RES (./gpu-out); where the device tool's $OUT is set, the whole of $RES is packed into
# $OUT/<name of $RES>.tgz after each run (every 20 s during the accuracy phase) (what comes back is at most 8 files, 2 folders deep, also from a command cut at its
# limit). Run from the repository root: PYTHONPATH=src, no install.
#   bash benchmarks/gpu_session.sh gpu probe
set -u -o pipefail
RES=${RES:-gpu-out}; mkdir -p "$RES"
pack() {
  local name; name=$(basename "$RES")
  [ -n "${DEVICE_OUT:-}" ] && tar czf "$DEVICE_OUT/.$name.tgz" -C "$RES" . 2>/dev/null \
    && mv "$DEVICE_OUT/.$name.tgz" "$DEVICE_OUT/$name.tgz"; true
}
DEVICE_OUT=${OUT:-}; OUT=$RES
export PYTHONPATH=src PYTHONUNBUFFERED=1
py=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
for phase in "$@"; do
  echo "=== $phase"
  case $phase in
  gpu)
    # -v: each failure named as it happens (a run cut at its limit printed no summary, 2026-11-27)
    timeout ${GPU_TIMEOUT:-200} $py -m pytest -v -m gpu -n 8 -p no:cacheprovider --timeout 180 -rfE tests 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" ;;
  suite)
    timeout ${SUITE_TIMEOUT:-540} $py -m pytest -v -m "not gpu" -n 14 -p no:cacheprovider --timeout 300 -rfE \
      --junitxml "$OUT/suite.xml" tests 2>&1 \
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
  layers)
    timeout ${LAYERS_TIMEOUT:-300} $py benchmarks/fp8_gemm_probe.py --device cuda --flavors 1B --layers \
      --recipes tensorwise,rowwise,blockwise --mx-recipes mxfp8,nvfp4,mxfp4 --json "$OUT/layers.json" 2>&1 \
      | tee "$OUT/layers.log" | grep -vE "^(1B|8B) "
    timeout 200 $py benchmarks/fp8_compiled_layouts.py --flavor debug 2>&1 | tee "$OUT/layouts.log" | grep -v Warn ;;
  speed)
    # ~1 minute a run (compile included), each alone on the GPU: the plain compiled loop, then every preset of
    # SPEED_PRESETS on the default loss (model.loss auto: the full logits where they fit 1/16 of the GPU), each with
    # its graph breaks, synchronising calls, mixprec's log lines (the probes) and a profiler table of its kernels;
    # SPEED_OPTIMIZER=1 adds the bfloat16-moment optimizer step against torch's fused AdamW
    common="--device cuda --flavor 1B --seq-len 2048 --batch 4 --steps ${SPEED_STEPS:-20} --compile-modes compiled"
    if [ "${SPEED_BASELINES:-1}" = 1 ]; then
      # torch.compile(model) compiles the whole unrolled model: 90 s was not enough on an H100 (2026-11-26)
      timeout 260 $py benchmarks/bench_train.py $common --presets bf16-mixed --impls plain --run-timeout 250 \
        --json "$OUT/speed-plain.json" 2>&1 | tee "$OUT/speed-plain.log" | grep -E "^    "; pack
    fi
    # PRESET:kernel runs the row-wise GEMMs on torch's row-wise kernel instead of unit scales and the row scales after
    for run in ${SPEED_PRESETS:-bf16-mixed fp8-tensorwise fp8-rowwise fp8-rowwise:kernel fp8-blockwise mxfp8 nvfp4}; do
      preset=${run%%:*}; route=auto; [ "$run" != "$preset" ] && route=${run#*:}; tag=${run/:/-}; mkdir -p "$OUT/$tag"
      timeout ${SPEED_RUN_TIMEOUT:-110} $py benchmarks/bench_train.py $common --presets $preset --impls mixprec \
        --run-timeout 100 --json "$OUT/speed-$tag.json" --profile "$preset mixprec compiled" --profile-dir "$OUT/$tag" \
        --rowwise-route $route ${SPEED_EXTRA:-} 2>&1 | tee "$OUT/speed-$tag.log" | grep -E "^    " \
        | grep -vE "^    INFO: fp8: (layer|skipped)"
      pack
    done
    if [ "${SPEED_OPTIMIZER:-0}" = 1 ]; then
      timeout 60 $py benchmarks/optimizer_step.py --device cuda --flavor 1B 2>&1 | tee "$OUT/optimizer_step.txt"; pack
    fi ;;
  accuracy)
    # the seeds run side by side on the GPU (the small flavor fills little of it; numbers, not timings): each seed's
    # compare of ACC_PRESETS beside the plan's measurement (seed 0), then each seed's run of the plan
    acc="$OUT/accuracy"; mkdir -p "$acc"
    cfg="--config configs/small.toml --training.device ${ACC_DEVICE:-cuda} --training.steps ${ACC_STEPS:-300} ${ACC_EXTRA:-}"
    plan=${PLAN_FILE:-gpu-plan.toml}  # kept in the tree between commands while the machine stays warm
    spread() {
      runs=$(for d in "$acc"/seed*/; do [ -f "$d/compare.json" ] && echo "${d%/}"; done
             for d in "$acc"/plan-seed*/; do [ -f "$d/compare.json" ] && echo "${d%/}:plan-${plan%.toml}"; done)
      [ -n "$runs" ] && $py benchmarks/seed_spread.py $runs --plot "$acc/seed_spread.png" > "$acc/spread.txt" 2>&1
      cat "$acc/spread.txt" 2>/dev/null; pack
    }
    (while sleep 20; do pack; done) & packer=$!; runs_=()
    if [ "${ACC_PLAN:-1}" = 1 ] && [ ! -f "$plan" ]; then
      (timeout ${PLAN_TIMEOUT:-180} $py -m mixprec plan $cfg --training.seed 0 --job.dump_folder "$acc/plan-run" \
        --plan.out "$plan" > "$acc/plan.log" 2>&1; echo "plan: exit $?") & runs_=($!)
    fi
    for seed in ${SEEDS:-0 1 2 3 4}; do
      (timeout ${ACC_RUN_TIMEOUT:-400} $py -m mixprec compare $cfg --training.seed $seed --job.dump_folder "$acc/seed$seed" \
        --presets ${ACC_PRESETS:-bf16-mixed,fp8-rowwise,fp8-blockwise,mxfp8,nvfp4} > "$acc/seed$seed.log" 2>&1
       echo "seed $seed: exit $? (1: a preset past compare's thresholds)") & runs_+=($!)
    done
    wait "${runs_[@]}"; spread
    if [ "${ACC_PLAN:-1}" = 1 ] && [ -f "$plan" ]; then
      cp "$plan" "$acc/plan.toml"
      runs_=()
      for seed in ${SEEDS:-0 1 2 3 4}; do
        (timeout ${ACC_RUN_TIMEOUT:-400} $py -m mixprec compare $cfg --training.seed $seed --presets "bf16-mixed,plan:$plan" \
          --job.dump_folder "$acc/plan-seed$seed" > "$acc/plan-seed$seed.log" 2>&1; echo "plan seed $seed: exit $?") & runs_+=($!)
      done
      wait "${runs_[@]}"; spread
    fi
    kill $packer ;;
  moe)
    # the estimate first (the CPU's count of every operator's bytes, 5 s), to set beside the measurement
    $py benchmarks/moe_roofline.py --tokens ${MOE_TOKENS:-16384} --ops 2>&1 | tee -a "$OUT/moe_roofline.log" | grep -E "^[|]"
    for mode in "" --compile; do
      timeout ${MOE_TIMEOUT:-240} $py benchmarks/moe_layer.py --device cuda --hidden 2048 --intermediate 768 \
        --experts 128 --top-k 8 --tokens ${MOE_TOKENS:-16384} --presets ${MOE_PRESETS:-bf16-mixed,fp8-tensorwise,fp8-rowwise,fp8-blockwise,mxfp8,nvfp4} \
        $mode 2>&1 | tee -a "$OUT/moe_layer.log" | grep -E "^[|#]"
    done ;;
  *) echo "phases: gpu suite probe train layers speed moe accuracy"; exit 2 ;;
  esac
  pack
done
