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
    stats = re.search(r"\[(\d+) tokens in [\d.]+s, [\d.]+ tok/s, target steps (\d+), "
                      r"finish_reason length\]",
                      proc.stderr)
    assert stats, proc.stderr
    assert stats.groups() == ("8", "8")


@pytest.mark.parametrize("damage", ["missing", "corrupt-weights"])
def test_bad_model_dir_is_a_readable_error(tiny_models, tmp_path, damage):
    model = tmp_path / "model"
    if damage == "missing":
        pattern = r"onespec generate: error: --model directory .*model.* does not exist"
    else:
        shutil.copytree(tiny_models["llama"][0], model)
        (model / "model.safetensors").write_bytes(b"\0" * 64)
        pattern = r"onespec generate: error: cannot read weights file .*model.safetensors"
    proc = run_cli("generate", "--model", str(model), "--prompt-ids", "1,2", "--device", "cpu")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert re.search(pattern, proc.stderr), proc.stderr
    assert proc.stdout == ""


def test_attention_backend_reaches_the_engine(tiny_models):
    """--attention-backend is the engine's: triton on a CPU is its one-line error."""
    path, _ = tiny_models["llama"]
    proc = run_cli("generate", "--model", path, "--device", "cpu", "--prompt-ids", "1,2",
                   "--attention-backend", "triton")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert re.search(r"onespec generate: error: attention_backend='triton' needs a CUDA "
                     r"device", proc.stderr), proc.stderr
    assert proc.stdout == ""


def test_bad_prompt_is_a_readable_error(tiny_models):
    path, _ = tiny_models["llama"]
    proc = run_cli("generate", "--model", path, "--device", "cpu", "--prompt-ids", "1,999")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert re.search(r"onespec generate: error: .*token-id prompt must be .* \[0, 128\)",
                     proc.stderr), proc.stderr
    assert proc.stdout == ""


def test_output_cut_by_max_model_len_is_announced(tiny_models):
    path, hf = tiny_models["llama"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(       # stdout and stderr in one pipe, as a terminal shows them
        [sys.executable, "-m", "onespec", "generate", "--model", path, "--prompt-ids",
         "1,2,3,4,5", "--max-model-len", "16", "--max-tokens", "64", "--ignore-eos",
         "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout
    warning = ("onespec generate: warning: the prompt's 5 tokens + --max-tokens 64 exceed "
               "--max-model-len 16: the output stops after at most 11 tokens "
               "(finish_reason length)\n")
    assert proc.stdout.startswith(warning), proc.stdout
    tokens, stats = proc.stdout[len(warning):].split("\n")[:2]
    assert [int(t) for t in tokens.split()] == hf_greedy(hf, [1, 2, 3, 4, 5], 11)
    assert re.fullmatch(r"\[11 tokens in .*, finish_reason length\]", stats), proc.stdout


@pytest.mark.parametrize("argv, usage, message", [
    (["generate", "--model", "M", "--prompt", "x", "--max-tokns", "3"], "onespec generate",
     "unrecognized arguments: --max-tokns (did you mean --max-tokens?)"),
    (["serve", "--model", "M", "--prot", "8000"], "onespec serve",
     "(did you mean --port?)"),
    (["train", "eagle3", "--target", "T", "--data", "D", "--out", "O", "--max-stepz", "2"],
     "onespec train eagle3", "(did you mean --max-steps?)"),
    (["demo", "--smoek"], "onespec demo", "(did you mean --smoke?)"),
    (["bench", "--batchsizes", "1"], "onespec bench", "(did you mean --batch-sizes?)"),
    (["gen"], "onespec", "unknown command 'gen' (did you mean generate?)"),
    (["generate", "--model", "M"], "onespec generate",
     "one of the arguments --prompt --prompt-ids is required"),
    (["generate", "--model", "M", "--prompt-ids", "a,b"], "onespec generate",
     "argument --prompt-ids: expected comma-separated integer token ids such as 1,2,3, "
     "got 'a,b'"),
    (["generate", "--model", "M", "--prompt", "x", "--k", "4"], "onespec generate",
     "--k 4 needs --draft"),
    (["serve", "--model", "M", "--k", "2"], "onespec serve", "--k 2 needs --draft"),
    (["generate", "--model", "M", "--draft", "D", "--k", "0", "--prompt", "x"],
     "onespec generate", "--k must be >= 1 with --draft, got 0"),
    (["demo", "--rounds", "0"], "onespec demo", "argument --rounds: must be an integer >= 1"),
])
def test_usage_errors_name_the_command_and_the_fix(argv, usage, message, capsys):
    from onespec.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} ["), err
    assert err.splitlines()[-1].startswith(f"{usage}: error: ") and message in err, err


def test_a_prompt_may_start_with_dashes():
    from onespec.cli import generate_parser
    args = generate_parser().parse_args(["--model", "M", "--prompt", "-- a SQL comment"])
    assert args.prompt == "-- a SQL comment"


def test_missing_draft_and_uncached_hub_id(tiny_models, capsys):
    from onespec.cli import main
    path, _ = tiny_models["llama"]
    code = main(["generate", "--model", path, "--draft", "/no/such/head", "--prompt-ids", "1"])
    assert code == 2
    assert capsys.readouterr().err == \
        "onespec generate: error: --draft directory '/no/such/head' does not exist\n"
    assert main(["generate", "--model", "onespec-tests/no-such-model", "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert "onespec loads local directories" in err, err
    assert "`hf download onespec-tests/no-such-model --local-dir DIR`) and pass --model DIR" in err


def test_hub_id_loads_from_the_local_cache(tiny_models, tmp_path):
    path, hf = tiny_models["qwen2"]
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--onespec-tests--tiny-qwen2"
    shutil.copytree(path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_CACHE": str(tmp_path),
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "onespec", "generate", "--model", "onespec-tests/tiny-qwen2",
         "--prompt-ids", "1,2,3", "--max-tokens", "6", "--ignore-eos", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert [int(t) for t in proc.stdout.split()] == hf_greedy(hf, [1, 2, 3], 6)


def test_prompt_over_the_limit_is_one_error_line():
    from onespec.demo import TARGET_DIR
    proc = run_cli("generate", "--model", TARGET_DIR, "--device", "cpu",
                   "--prompt", "x = 1\n" * 1000)           # past the tokenizer's 2048 too
    assert proc.returncode == 2
    assert re.fullmatch(r"onespec generate: error: prompt has \d+ tokens; max_model_len is "
                        r"2048, so it must be at most 2047\n", proc.stderr), proc.stderr
