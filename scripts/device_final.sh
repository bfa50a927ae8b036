#!/usr/bin/env bash
# Last device call of a session: the full decode benchmark (with transformers), the measured
# KV capacity of the 8B shape, then the GPU kernel/graph/lossless tests. Results in $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout ${BENCH_S:-300} python bench/decode.py --gen-len ${GEN_LEN:-96} --out $OUT/decode.jsonl \
  > /dev/null 2> $OUT/decode.log
grep -a "^\[b=\|bench done\|transformers" $OUT/decode.log | tail -40
timeout 60 python scripts/kv_capacity.py 2>/dev/null | tee $OUT/kv_capacity.jsonl
ONESPEC_TEST_DEVICE=cuda timeout ${TESTS_S:-170} python -m pytest tests/test_triton_kernels.py \
  tests/test_cuda.py ${TESTS} -q -p no:cacheprovider > $OUT/cuda_tests.log 2>&1
tail -3 $OUT/cuda_tests.log
exit 0
