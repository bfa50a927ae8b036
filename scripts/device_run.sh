#!/usr/bin/env bash
# One device call, each part optional (results in $OUT):
#   TESTS=1      the CUDA tests first (TEST_FILES, TEST_K, TESTS_S)
#   VARIANTS=..  graph-replay sweep of kernel variants (scripts/profile_graph_step.py;
#                PROFILE=1 runs it without variants, PROFILE_ARGS appended, e.g. --trace)
#   AB=auto|v,w  the plain batch-1 benchmark of variants in alternating processes
#   BENCH=1      bench/decode.py at batch 1 and 32, K 0 and 3 (BENCH_ARGS appended)
#   CAPTURE=1    graph capture of every bucket up to 64 for K=3 with a cold Triton cache,
#                buckets warmed up in threads and (CAPTURE_SERIAL=1) one by one
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ "${TESTS:-0}" = 1 ]; then
ONESPEC_TEST_DEVICE=cuda timeout ${TESTS_S:-280} python -m pytest ${TEST_FILES:-tests/test_cuda.py tests/test_chain.py tests/test_triton_kernels.py} -q -x -p no:cacheprovider -k "${TEST_K:-not compile}" \
  > $OUT/cuda_tests.log 2>&1
tail -4 $OUT/cuda_tests.log
fi
if [ -n "$VARIANTS" ] || [ "${PROFILE:-0}" = 1 ]; then
timeout ${PROFILE_S:-300} python scripts/profile_graph_step.py --modes ${MODES:-plain} \
  --variants "$VARIANTS" $PROFILE_ARGS > $OUT/profile_graph.jsonl 2> $OUT/profile_graph.log
tail -2 $OUT/profile_graph.log
python -c "
import json
for l in open('$OUT/profile_graph.jsonl'):
    d = json.loads(l)
    print(d['mode'], 'step', d['step_ms'], 'replay', d['replay_ms'], 'host', d['host_ms'])
    for v in d['sweep']:
        print('   ', v)
    print('   layer', d['layer_kernels'])
    for r in d.get('trace', []):
        print('   ', r)"
fi
if [ "$AB" = auto ]; then   # the default against the sweep's fastest replay
AB=$(python -c "
import json
d = json.loads(open('$OUT/profile_graph.jsonl').readline())
best = min((v for v in d['sweep'] if v['variant'] != 'default'), key=lambda v: v['replay_ms'])
print('default,' + best['variant'])")
echo "AB: $AB"
fi
if [ -n "$AB" ]; then
timeout ${AB_S:-300} python scripts/ab_bench.py --variants "$AB" --runs ${AB_RUNS:-3} \
  > $OUT/ab.jsonl 2> $OUT/ab.log
cat $OUT/ab.jsonl
fi
if [ "${BENCH:-0}" = 1 ]; then
timeout ${BENCH_S:-150} python bench/decode.py --gen-len 96 --batch-sizes 1,32 --ks 0,3 \
  --acceptance 3.0 --no-hf $BENCH_ARGS --out $OUT/decode${BENCH_TAG}.jsonl > /dev/null 2> $OUT/decode${BENCH_TAG}.log
python -c "
import json
for l in open('$OUT/decode${BENCH_TAG}.jsonl'):
    d = json.loads(l)
    print(d.get('engine'), d.get('batch'), d.get('k'), d.get('step_ms'), d.get('floor_ms'),
          d.get('hbm_fraction'), d.get('tok_s'), d.get('speedup'), d.get('overlap_scheduler'), d.get('error'))"
fi
if [ "${CAPTURE:-0}" = 1 ]; then
for threads in 0 $([ "${CAPTURE_SERIAL:-0}" = 1 ] && echo 1); do
timeout ${CAPTURE_S:-200} python scripts/capture_time.py --max-batch 64 --k 3 --cold \
  --threads $threads >> $OUT/capture_time.jsonl 2>> $OUT/capture_time.log
done
cat $OUT/capture_time.jsonl
fi
exit 0
