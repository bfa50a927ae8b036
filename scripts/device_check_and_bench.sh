#!/usr/bin/env bash
# One device call: CUDA tests, demo step profile, the decode benchmark, acceptance at K=6,7
# and the bf16 agreement. Results land in $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
ONESPEC_TEST_DEVICE=cuda timeout 150 python -m pytest tests/test_cuda.py tests/test_models.py \
  tests/test_spec.py -q -x -p no:cacheprovider > $OUT/cuda_tests.log 2>&1
tail -3 $OUT/cuda_tests.log
timeout 60 python scripts/profile_demo.py --device cuda 2>/dev/null | tee $OUT/profile_demo_cuda.jsonl
timeout ${BENCH_S:-330} python bench/decode.py --gen-len ${GEN_LEN:-96} --out $OUT/decode.jsonl \
  > /dev/null 2> $OUT/decode.log
tail -4 $OUT/decode.log
timeout 90 python scripts/eval_acceptance.py --ks 6,7 --device cuda > $OUT/eval_k67.jsonl 2> /dev/null
cat $OUT/eval_k67.jsonl
