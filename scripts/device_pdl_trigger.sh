#!/usr/bin/env bash
# One device call: GPU kernel/graph tests, then the goal configurations of the decode
# benchmark (batch 1 and 32, K 0 and 3 at acceptance 3) with the GEMVs releasing their
# PDL successors late (after the weight stream) and early (at start). Results in $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
ONESPEC_TEST_DEVICE=cuda timeout ${TESTS_S:-170} python -m pytest tests/test_triton_kernels.py \
  tests/test_cuda.py -q -x -p no:cacheprovider > $OUT/cuda_tests.log 2>&1
tail -3 $OUT/cuda_tests.log
for trig in late early; do
  ONESPEC_PDL_TRIGGER=$trig timeout 70 python bench/decode.py --gen-len 96 --batch-sizes 1,32 \
    --ks 0,3 --acceptance 3.0 --no-hf --out $OUT/decode_$trig.jsonl > /dev/null 2> $OUT/decode_$trig.log
  echo "trigger=$trig"; grep -a "^\[b=" $OUT/decode_$trig.log | sed 's/.*\[b=/[b=/'
done
exit 0
