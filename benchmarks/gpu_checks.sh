#!/usr/bin/env bash
# Issue 38's GPU checks in one run (the `device` tool's machine: Python 3.12, its own PyTorch,
# timm and safetensors). Carries the missing small packages as cp312 wheels in .whl/ (see the
# README's GPU section), then, each stage under its own time limit, each result written to $OUT
# as soon as it is measured:
#   1. the tests that need CUDA (-k cuda), then the test files named in GPU_TESTS whole (the
#      DP engine's rounding and noise tests, which check CUDA where it is present);
#   2. benchmarks/dp_step.py: vip-base, 224 px, bf16 autocast, (a) non-private, (b) DP, (d) DP
#      with the audit, as shipped, at the batch sizes in GPU_BATCHES (issue 52's target: b/a <=
#      1.5 at 32, 128 and 512); `dp_order` runs (a), (d), (b) instead, to tell whether (b)'s
#      time after (a) is its own or the allocator's (issue 52: (d) ran faster than (b));
#   3. benchmarks/serve.py --device cuda: vip-base at 224 px, concurrency 64;
#   4. benchmarks/noise.py --device cuda: issue 52's noise drawn on the device (Philox4x64-10,
#      Box-Muller) against the CPU ziggurat copied over, on vip-base's 86 M coordinates (the
#      CUDA tests of stage 1 check its words, uniforms and Gaussians against the CPU's);
#   5. `utility` (not in the default): issue 56's next trial, benchmarks/utility.py's (Syn)-ViP
#      row and its DP fine-tuning row at a schedule the CPU cannot run (GPU_FINETUNE_STEPS, 300;
#      GPU_FINETUNE_PARAMETERS, all), each beside its non-private reference, on the four
#      Fashion-MNIST IDX files in GPU_DATA (var/fashion-mnist, carried: the machine has no
#      Debian package).
#       bash benchmarks/gpu_checks.sh [tests|noise|dp_step|dp_order|serve|utility ...]
#   (default: tests noise dp_step dp_order serve)
set -u
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir . >/dev/null \
    || exit 1  # the vip-hub command and its entry points (serve.py starts `vip-hub serve`)
export PYTHONPATH=/tmp/site:$PWD
{ date -u; git log -1 --format='%H %s' 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c 'import torch, timm; print("torch", torch.__version__, "timm", timm.__version__)'; } \
    | tee "$OUT/machine.txt"
stages=${*:-tests noise dp_step dp_order serve}
# the test files whose CUDA cases need the device (issue 52: the clipped sums' rounding, the noise)
GPU_TESTS=${GPU_TESTS-tests/training/dp/test_rounded_sums.py tests/training/dp/test_noise_streams.py tests/training/recipes/test_training_units.py}
for stage in $stages; do
  case $stage in
    tests)
      { timeout "${GPU_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
          -k cuda tests/ 2>&1 | tail -40
        [ -z "${GPU_TESTS:-}" ] || timeout "${GPU_TESTS_S:-200}" python3 -m pytest -q \
          -p no:cacheprovider -o addopts="" -m "not slow" $GPU_TESTS 2>&1 | tail -40
      } | tee "$OUT/tests.txt" ;;
    dp_step)
      timeout "${GPU_DP_STEP_S:-260}" python3 benchmarks/dp_step.py --arch vip-base \
          --img-size 224 --batch "${GPU_BATCHES:-32,128,512}" --rounds "${GPU_ROUNDS:-5}" \
          --variants abd 2>&1 | tee "$OUT/dp_step.txt" ;;
    dp_order)
      timeout "${GPU_DP_ORDER_S:-120}" python3 benchmarks/dp_step.py --arch vip-base \
          --img-size 224 --batch 32 --rounds "${GPU_ROUNDS:-5}" --variants adb 2>&1 \
          | tee "$OUT/dp_order.txt" ;;
    noise)
      timeout "${GPU_NOISE_S:-150}" python3 benchmarks/noise.py --device cuda \
          --numel "${GPU_NOISE_NUMEL:-86000000}" --rounds "${GPU_ROUNDS:-5}" 2>&1 \
          | tee "$OUT/noise.txt" ;;
    serve)
      timeout "${GPU_SERVE_S:-150}" python3 benchmarks/serve.py --device cuda --arch vip-base \
          --img-size 224 --concurrency 64 --seconds 8 2>&1 | tee "$OUT/serve.txt" ;;
    utility)
      timeout "${GPU_UTILITY_S:-480}" python3 benchmarks/utility.py --device cuda \
          --data "${GPU_DATA:-var/fashion-mnist}" --work /tmp/utility --rows syn,finetune \
          --finetune-steps "${GPU_FINETUNE_STEPS:-300}" \
          --finetune-parameters "${GPU_FINETUNE_PARAMETERS:-all}" 2>&1 | tee "$OUT/utility.txt" ;;
  esac
done
