#!/usr/bin/env bash
# One device call: train the demo EAGLE-3 head, run the CUDA tests, measure acceptance and
# the demo on the GPU. Results land in $OUT. (Used through the device tool; see docs.)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p $OUT/eagle3
python -m onespec train eagle3 --target onespec/_demo/target --data data/stdlib/train.jsonl.gz \
  --out /tmp/eagle3 --draft-vocab 4096 --max-len 1024 --batch-tokens 32768 --epochs 40 \
  --max-steps ${HEAD_STEPS:-1200} --lr ${HEAD_LR:-1e-3} --save-every 0 --device cuda --no-progress \
  --log $OUT/eagle3_train_log.jsonl > $OUT/train.log 2>&1 &
TRAIN=$!
ONESPEC_TEST_DEVICE=cuda python -m pytest tests/test_cuda.py tests/test_models.py tests/test_spec.py \
  -q -x -p no:cacheprovider > $OUT/cuda_tests.log 2>&1
tail -5 $OUT/cuda_tests.log
wait $TRAIN; tail -3 $OUT/train.log
cp /tmp/eagle3/config.json /tmp/eagle3/model.safetensors $OUT/eagle3/
rm -rf onespec/_demo/eagle3; cp -r $OUT/eagle3 onespec/_demo/eagle3
python scripts/eval_acceptance.py --data data/stdlib/heldout.jsonl.gz --device cuda > $OUT/eval.jsonl 2> $OUT/eval.log
cat $OUT/eval.jsonl
python -m onespec demo > $OUT/demo.log 2>&1; tail -8 $OUT/demo.log
