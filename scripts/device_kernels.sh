#!/usr/bin/env bash
# One device call: kernel + CUDA tests, the decode-kernel tiling sweep (with and without
# programmatic dependent launch), the 8B step profile and the batch-1/32 decode benchmark.
# Results land in $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
ONESPEC_TEST_DEVICE=cuda timeout 200 python -m pytest tests/test_triton_kernels.py ${TESTS:-tests/test_cuda.py} \
  -q -x -p no:cacheprovider > $OUT/cuda_tests.log 2>&1
tail -3 $OUT/cuda_tests.log
if [ -z "$NO_SWEEP" ]; then
timeout ${SWEEP_S:-200} python scripts/sweep_small_linear.py --rows ${ROWS:-1,4,16} \
  --out $OUT/sweep.jsonl > /dev/null 2> $OUT/sweep.log
grep -h best $OUT/sweep.jsonl
ONESPEC_PDL=0 timeout 60 python scripts/sweep_small_linear.py --rows 1 --no-grid \
  --out $OUT/sweep_nopdl.jsonl > /dev/null 2>> $OUT/sweep.log
grep -h '"default"' $OUT/sweep_nopdl.jsonl | cut -c1-150
fi
timeout 80 python scripts/profile_8b_step.py 2>/dev/null | tee $OUT/profile_8b_step.jsonl
ONESPEC_PDL=0 timeout 80 python scripts/profile_8b_step.py 2>/dev/null | head -1 | tee $OUT/profile_8b_step_nopdl.jsonl
[ -n "$BENCH" ] && timeout ${BENCH_S:-150} python bench/decode.py --gen-len 96 \
  --batch-sizes 1,32 --ks 0,3 --acceptance 3.0 --no-hf --out $OUT/decode.jsonl \
  > /dev/null 2> $OUT/decode.log
[ -n "$BENCH" ] && tail -6 $OUT/decode.log
exit 0
