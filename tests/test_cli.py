"""`python -m onespec generate` as a user runs it: a subprocess, its output and exit code."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import hf_greedy


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}      # tiny model: one thread is fastest
    return subprocess.run([sys.executable, "-m", "onespec", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_generate_prints_tokens_and_stats(tiny_models):
    path, hf = tiny_models["qwen2"]
    proc = run_cli("generate", "--model", path, "--prompt-ids", "1,2,3", "--max-tokens", "8",
                   "--device", "cpu", "--dtype", "float32", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    printed = [int(t) for t in proc.stdout.split()]
    assert printed == hf_greedy(hf, [1, 2, 3], 8)
    stats = re.search(r"\[(\d+) tokens in [\d.]+s, [\d.]+ tok/s, target steps (\d+)\]",
                      proc.stderr)
    assert stats, proc.stderr
    assert stats.groups() == ("8", "8")


@pytest.mark.parametrize("damage", ["missing", "corrupt-weights"])
def test_bad_model_dir_is_a_readable_error(tiny_models, tmp_path, damage):
    model = tmp_path / "model"
    if damage == "missing":
        pattern = r"onespec: error: .*model.* does not exist"
    else:
        shutil.copytree(tiny_models["llama"][0], model)
        (model / "model.safetensors").write_bytes(b"\0" * 64)
        pattern = r"onespec: error: cannot read weights file .*model.safetensors"
    proc = run_cli("generate", "--model", str(model), "--prompt-ids", "1,2", "--device", "cpu")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert re.search(pattern, proc.stderr), proc.stderr
    assert proc.stdout == ""


def test_bad_prompt_is_a_readable_error(tiny_models):
    path, _ = tiny_models["llama"]
    proc = run_cli("generate", "--model", path, "--device", "cpu", "--prompt-ids", "1,999")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert re.search(r"onespec: error: .*token-id prompt must be .* \[0, 128\)", proc.stderr), \
        proc.stderr
    assert proc.stdout == ""
