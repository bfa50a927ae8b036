#!/usr/bin/env bash
# Plain batch-1 benchmark in alternating processes: the default GEMV tiling (rows per program
# spread over the SMs) against the previous fixed tiles (qkv 32 rows, gate_up 64), to see the
# tiling's effect beside the run-to-run spread of separate processes. Rows in $OUT/ab.jsonl.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for i in ${RUNS:-1 2 3}; do
  for tiles in ${ORDER:-new old}; do
    timeout ${RUN_S:-60} python - "$tiles" <<'PY' >> $OUT/ab.jsonl 2>> $OUT/ab.log
import json, sys
from onespec.layers import triton_linear as t
if sys.argv[1] == "old":
    t.CONFIGS.update({(6144, 4096, False): (32, 256, 4, 5), (14336, 4096, True): (64, 128, 4, 3)})
import contextlib, io
from onespec.bench_cli import main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    main(["decode", "--gen-len", "96", "--batch-sizes", "1", "--ks", "0", "--no-hf"])
for line in buf.getvalue().splitlines():
    row = json.loads(line)
    print(json.dumps({"tiles": sys.argv[1], "step_ms": row["step_ms"],
                      "trials": row["step_ms_trials"], "hbm_fraction": row["hbm_fraction"]}))
PY
  done
done
cat $OUT/ab.jsonl
