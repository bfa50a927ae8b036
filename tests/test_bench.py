"""`onespec bench decode` on the tiny shape, CPU, float32: every JSON line has the
documented keys with sane values, forced acceptance shows up as the measured acceptance length."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from onespec import cli
from onespec.bench.decode import main, spec_configs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN_KEYS = ("bench", "model", "weights", "dtype", "batch", "k", "forced_acceptance_length",
               "acceptance_length", "tok_s", "step_ms", "floor_ms", "hbm_fraction", "baseline",
               "speedup", "device")
TINY = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32"]


def parse_lines(text: str) -> list[dict]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return [json.loads(ln) for ln in lines]


def check_row(row: dict):
    assert "error" not in row, row
    for key in DESIGN_KEYS:
        assert key in row, (key, row)
    assert row["bench"] == "decode" and row["weights"] == "random"
    assert row["model"] == "tiny-shape" and row["dtype"] == "float32" and row["device"] == "cpu"
    assert row["step_ms"] > 0 and row["tok_s"] > 0 and row["floor_ms"] > 0
    assert 0 < row["hbm_fraction"] == pytest.approx(row["floor_ms"] / row["step_ms"], rel=1e-3)
    assert row["tok_s"] == pytest.approx(
        row["batch"] * row["acceptance_length"] / row["step_ms"] * 1e3, rel=1e-3)
    assert row["speedup"] is not None and row["speedup"] > 0


def test_spec_configs_worked_example():
    assert spec_configs([0, 3], ["1.0", "3.0", "max"]) == [(3, 1.0), (3, 3.0), (3, 4.0)]
    # a > K+1 is skipped; 'max' equal to a listed value is not run twice
    assert spec_configs([2], ["1.0", "3.0", "4.0", "max"]) == [(2, 1.0), (2, 3.0)]
    assert spec_configs([0], ["2.0", "max"]) == []


def test_bench_decode_tiny_cpu(tmp_path):
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, os.path.join(REPO, "bench", "decode.py"), *TINY,
           "--batch-sizes", "1,2", "--ks", "0,2", "--acceptance", "1.0,2.0", "--gen-len", "8",
           "--no-hf", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}     # tiny matmuls: threads only contend
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed < 60, f"tiny benchmark took {elapsed:.1f} s"
    rows = parse_lines(proc.stdout)
    assert parse_lines(out.read_text()) == rows
    got = sorted((r["batch"], r["k"], r["forced_acceptance_length"]) for r in rows)
    assert got == [(b, k, a) for b in (1, 2) for k, a in ((0, 1.0), (2, 1.0), (2, 2.0))]
    by_key = {}
    for row in rows:
        check_row(row)
        assert row["baseline"] == "onespec-plain"
        assert abs(row["acceptance_length"] - row["forced_acceptance_length"]) <= 0.35
        assert len(row["step_ms_trials"]) == 3           # --trials' default; the median
        assert row["step_ms"] == pytest.approx(statistics.median(row["step_ms_trials"]),
                                               rel=1e-3)
        by_key[row["batch"], row["k"], row["forced_acceptance_length"]] = row
    for b in (1, 2):
        plain = by_key[b, 0, 1.0]
        assert plain["speedup"] == 1.0
        for a in (1.0, 2.0):
            spec = by_key[b, 2, a]
            assert spec["speedup"] == pytest.approx(spec["tok_s"] / plain["tok_s"], rel=1e-3)
            assert spec["floor_ms"] > plain["floor_ms"]      # head weights move too
    assert "copy bandwidth" in proc.stderr


def test_bench_hf_baseline_in_process(capsys):
    code = main(["decode", *TINY, "--batch-sizes", "1", "--ks", "0", "--gen-len", "4",
                 "--prompt-len", "16", "--warmup-steps", "1", "--trials", "1",
                 "--hf-runs", "dynamic:1"])
    assert code == 0
    rows = parse_lines(capsys.readouterr().out)
    assert [r["baseline"] for r in rows] == ["hf-transformers", "onespec-plain"]
    for row in rows:
        check_row(row)
        assert row["acceptance_length"] == 1.0
    hf, plain = rows
    assert plain["step_ms_trials"] == [plain["step_ms"]]
    assert hf["cache"] == "dynamic" and hf["engine"] == "hf-transformers"
    assert plain["speedup_vs_hf"] == pytest.approx(plain["tok_s"] / hf["tok_s"], rel=1e-3)


def test_cli_dispatches_bench(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0
    assert "--batch-sizes" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--trials", "0"], ["--gen-len", "0"], ["--batch-sizes", "0"],
                                 ["--warmup-steps", "-1"]])
def test_bench_rejects_bad_counts(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["decode", *TINY, *bad])
    assert e.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_bench_auto_and_rates_with_plot(tmp_path, capsys):
    """--ks with auto and --acceptance-rates: one row per fixed K at the rates' expected
    acceptance, one auto row with the Ks it chose, and the plot file."""
    plot = tmp_path / "auto.png"
    code = main(["decode", *TINY, "--batch-sizes", "1,2", "--ks", "0,1,2,auto",
                 "--acceptance-rates", "1.0,0.0", "--gen-len", "6", "--prompt-len", "16",
                 "--warmup-steps", "1", "--trials", "1", "--no-hf", "--plot", str(plot)])
    assert code == 0
    rows = parse_lines(capsys.readouterr().out)
    assert sorted((r["batch"], str(r["k"])) for r in rows) == \
        [(b, k) for b in (1, 2) for k in ("0", "1", "2", "auto")]
    for row in rows:
        check_row(row)
        if row["k"] in (1, 2):        # rates [1, 0]: the first draft always, never the second
            assert row["acceptance_length"] == 2.0 == row["forced_acceptance_length"]
            assert row["forced_acceptance_rates"] == [1.0, 0.0]
    for row in (r for r in rows if r["k"] == "auto"):
        assert sum(row["k_histogram"].values()) > 0
        assert 0 <= row["mean_k"] <= 2
        assert row["forced_acceptance_length"] is None
    assert plot.stat().st_size > 1000


def test_bench_plot_series_and_missing_matplotlib(monkeypatch, capsys):
    from onespec.bench import plot as bench_plot
    rows = [{"engine": "onespec", "batch": b, "k": k, "tok_s": t, "floor_ms": 1.0,
             "forced_acceptance_length": a, "forced_acceptance_rates": None}
            for b, k, t, a in ((1, 0, 10.0, 1.0), (2, 0, 18.0, 1.0), (1, 3, 20.0, 3.0),
                               (1, "auto", 19.0, 3.0))]
    series = bench_plot.throughput_series(rows)
    assert series == {"plain": [(1, 10.0), (2, 18.0)], "K=3 a=3": [(1, 20.0)],
                      "auto a=3": [(1, 19.0)],
                      "plain at the bandwidth floor": [(1, 1000.0), (2, 2000.0)]}
    monkeypatch.setattr(bench_plot.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as e:
        main(["decode", *TINY, "--plot", "x.png"])
    assert e.value.code == 2
    assert "onespec[plot]" in capsys.readouterr().err


def test_bench_rejects_short_acceptance_rates(capsys):
    with pytest.raises(SystemExit):
        main(["decode", *TINY, "--ks", "0,3", "--acceptance-rates", "0.7,0.5"])
    assert "--acceptance-rates" in capsys.readouterr().err


def test_the_default_shape_fits_the_device():
    """Llama-3-8B's 8,030,261,248 parameters; on a CPU the default is the tiny shape."""
    import torch

    from onespec.bench.models import default_shape, llama_weight_bytes
    assert llama_weight_bytes("llama3-8b", torch.bfloat16) == 2 * 8_030_261_248
    assert default_shape("cpu", torch.float32)[0] == "tiny"


def test_bench_exits_non_zero_when_a_configuration_fails(capsys):
    """Prompts longer than the shape's 131072 positions: every engine fails to build."""
    code = main(["decode", "--device", "cpu", "--batch-sizes", "1", "--ks", "0",
                 "--gen-len", "2", "--trials", "1", "--no-hf", "--prompt-len", "200000"])
    out, err = capsys.readouterr()
    assert code == 1
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows and all("error" in r for r in rows) and rows[0]["model"] == "tiny-shape"
    assert "[--shape tiny: " in err
    assert f"onespec bench: error: {len(rows)} of {len(rows)} configurations failed" in err
