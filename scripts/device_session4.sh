#!/usr/bin/env bash
# Session 4 device call: the kernel-knob sweep of a graph step (attention preload, attention
# rotating for itself, attention and GEMV tilings), the batch-1/32 benchmark, then the
# CUDA tests of the changed kernels and of the captured-copy graph runner. Results in $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
VARIANTS=${VARIANTS:-default,preload=0}
if [ "${PROFILE:-1}" = 1 ]; then
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
fi
if [ "${BENCH:-1}" = 1 ]; then
for run in ${BENCH_RUNS:-1}; do
timeout ${BENCH_S:-150} python bench/decode.py --gen-len 96 --batch-sizes 1,32 --ks 0,3 \
  --acceptance 3.0 --no-hf --out $OUT/decode_run$run.jsonl > /dev/null 2> $OUT/decode.log
python -c "
import json
for l in open('$OUT/decode_run$run.jsonl'):
    d = json.loads(l)
    print(d.get('engine'), d.get('batch'), d.get('k'), d.get('step_ms'), d.get('floor_ms'),
          d.get('hbm_fraction'), d.get('tok_s'), d.get('speedup'), d.get('error'))"
done
fi
if [ "${TESTS:-1}" = 1 ]; then
ONESPEC_TEST_DEVICE=cuda timeout ${TESTS_S:-200} python -m pytest tests/test_cuda.py \
  tests/test_triton_kernels.py -q -x -p no:cacheprovider \
  -k "${TEST_K:-not compile}" \
  > $OUT/cuda_tests.log 2>&1
tail -4 $OUT/cuda_tests.log
fi
exit 0
