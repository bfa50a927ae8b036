#!/usr/bin/env bash
# Last device call of a session: GPU equivalence + lossless tests, 8B step profile, demo.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
ONESPEC_TEST_DEVICE=cuda timeout 150 python -m pytest tests/test_models.py tests/test_spec.py \
  tests/test_cuda.py -q -p no:cacheprovider > $OUT/cuda_tests.log 2>&1
tail -3 $OUT/cuda_tests.log
timeout 90 python scripts/profile_8b_step.py 2>/dev/null | tee $OUT/profile_8b_step.jsonl
timeout 60 python -m onespec demo > $OUT/demo_cuda.log 2>&1; tail -7 $OUT/demo_cuda.log
