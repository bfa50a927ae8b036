#!/usr/bin/env bash
# One device call (this session's final): GPU tests of the new kernels and the lossless
# CUDA tests, decode attention by context (split vs not), the phase profile of a graph
# step, and the batch-1/32 decode benchmark with transformers. Results in $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
ONESPEC_TEST_DEVICE=cuda timeout ${TESTS_S:-170} python -m pytest tests/test_cuda.py \
  tests/test_triton_kernels.py -q -p no:cacheprovider \
  -k "not small_linear_matches and not rope_and_cache and not compile and not rms_norm_split" \
  > $OUT/cuda_tests.log 2>&1
tail -3 $OUT/cuda_tests.log
timeout 60 python scripts/bench_attention.py 2>/dev/null | tee $OUT/attention.jsonl
timeout 130 python scripts/profile_graph_step.py > $OUT/profile_graph.jsonl 2>/dev/null
timeout ${BENCH_S:-200} python bench/decode.py --gen-len 96 --batch-sizes 1,32 --ks 0,3 \
  --acceptance 3.0 --out $OUT/decode.jsonl > /dev/null 2> $OUT/decode.log
python -c "
import json
for l in open('$OUT/decode.jsonl'):
    d = json.loads(l)
    print(d.get('engine'), d.get('batch'), d.get('k'), d.get('step_ms'), d.get('floor_ms'),
          d.get('hbm_fraction'), d.get('tok_s'), d.get('speedup'), d.get('speedup_vs_hf'),
          d.get('error'))"
exit 0
