#!/usr/bin/env bash
# Session 4 device call: the kernel-knob sweep of a graph step (attention preload, attention
# rotating for itself, attention and GEMV tilings), the batch-1/32 benchmark, then the
# CUDA tests of the changed kernels and of the captured-copy graph runner. Results in $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
VARIANTS=${VARIANTS:-default,rope_attn=0,preload=0}
timeout ${PROFILE_S:-200} python scripts/profile_graph_step.py --modes ${MODES:-plain,spec} \
  --variants "$VARIANTS" > $OUT/profile_graph.jsonl 2> $OUT/profile_graph.log
tail -2 $OUT/profile_graph.log
python -c "
import json
for l in open('$OUT/profile_graph.jsonl'):
    d = json.loads(l)
    print(d['mode'], 'step', d['step_ms'], 'replay', d['replay_ms'], 'host', d['host_ms'])
    for v in d['sweep']:
        print('   ', v)
    print('   layer', d['layer_kernels'])"
if [ "${BENCH:-1}" = 1 ]; then
timeout ${BENCH_S:-150} python bench/decode.py --gen-len 96 --batch-sizes 1,32 --ks 0,3 \
  --acceptance 3.0 --no-hf --out $OUT/decode.jsonl > /dev/null 2> $OUT/decode.log
python -c "
import json
for l in open('$OUT/decode.jsonl'):
    d = json.loads(l)
    print(d.get('engine'), d.get('batch'), d.get('k'), d.get('step_ms'), d.get('floor_ms'),
          d.get('hbm_fraction'), d.get('tok_s'), d.get('speedup'), d.get('error'))"
fi
if [ "${TESTS:-1}" = 1 ]; then
ONESPEC_TEST_DEVICE=cuda timeout ${TESTS_S:-200} python -m pytest tests/test_cuda.py \
  tests/test_triton_kernels.py -q -x -p no:cacheprovider \
  -k "${TEST_K:-not small_linear_matches and not rope_and_cache_matches and not compile and not rms_norm_split and not argmax_matches}" \
  > $OUT/cuda_tests.log 2>&1
tail -4 $OUT/cuda_tests.log
fi
exit 0
