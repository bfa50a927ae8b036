"""The command line as vLLM users type it: a positional model, --gpu-memory-utilization,
--seed, --version, and a busy port refused before anything loads."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from onespec import __version__
from onespec.cli import build_llm, check_engine_args, generate_parser
from onespec.serve.cli import build_parser as serve_parser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(REPO, "onespec", "_demo", "target")


def run_onespec(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "onespec", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def parse(parser, argv):
    args = parser.parse_args(argv)
    check_engine_args(parser, args)
    return args


def test_version():
    proc = run_onespec("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"onespec {__version__}"


@pytest.mark.parametrize("parser", [serve_parser, generate_parser])
def test_the_model_is_positional_or_an_option(parser):
    extra = [] if parser is serve_parser else ["--prompt", "x"]
    assert parse(parser(), ["M", *extra]).model == "M"
    assert parse(parser(), ["--model", "M", *extra]).model == "M"
    assert parse(parser(), ["M", "--model", "M", *extra]).model == "M"


@pytest.mark.parametrize("argv, message", [
    ([], "the model is missing: onespec serve MODEL"),
    (["A", "--model", "B"], "the model is given twice, as MODEL 'A' and --model 'B'"),
])
def test_a_missing_or_doubled_model_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(serve_parser(), argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_generate_takes_the_model_positionally():
    proc = run_onespec("generate", DEMO_TARGET, "--prompt-ids", "1,2,3", "--max-tokens", "4",
                       "--max-model-len", "64", "--device", "cpu", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.split()) >= 1 and "[4 tokens in" in proc.stderr


def test_a_missing_positional_model_directory_is_named_as_model():
    proc = run_onespec("generate", "/no/such/model", "--prompt-ids", "1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("onespec generate: error: MODEL directory '/no/such/model' "
                                   "does not exist")


def test_gpu_memory_utilization_and_seed_reach_the_engine_config():
    args = parse(serve_parser(), [DEMO_TARGET, "--gpu-memory-utilization", "0.5", "--seed",
                                  "7", "--max-model-len", "64", "--device", "cpu"])
    with build_llm(args) as llm:
        assert llm.engine.config.kv_cache_memory_fraction == 0.5
        assert llm.engine.config.seed == 7


def test_a_bad_gpu_memory_utilization_names_the_engine_field():
    proc = run_onespec("generate", DEMO_TARGET, "--gpu-memory-utilization", "1.5",
                       "--prompt-ids", "1", "--device", "cpu")
    assert proc.returncode == 2
    assert "kv_cache_memory_fraction must be in (0, 1], got 1.5" in proc.stderr


def test_a_busy_port_fails_in_under_2_s_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        proc = run_onespec("serve", DEMO_TARGET, "--port", str(port), timeout=30)
        elapsed = time.monotonic() - start
    assert proc.returncode == 2
    assert proc.stderr == (f"onespec serve: error: cannot listen on 127.0.0.1:{port}: Address "
                           "already in use (another process listens there: stop it or pass "
                           "another --port)\n")
    assert elapsed < 2.0


@pytest.mark.parametrize("text, schedule", [("auto", "auto"), ("1:4,8:2,32:1", {1: 4, 8: 2, 32: 1}),
                                            ('{"1": 3, "16": 1}', {1: 3, 16: 1})])
def test_draft_len_schedule_forms(text, schedule):
    args = parse(serve_parser(), ["M", "--draft", "D", "--draft-len-schedule", text])
    assert args.draft_len_schedule == schedule


def test_draft_len_schedule_and_rejection_sampling_need_a_drafter(capsys):
    for flag in (["--draft-len-schedule", "auto"], ["--rejection-sampling"]):
        with pytest.raises(SystemExit):
            parse(serve_parser(), ["M", *flag])
        assert "pass a drafter (--draft, --mtp or --ngram)" in capsys.readouterr().err


def test_auto_draft_length_and_rejection_sampling_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv("ONESPEC_CACHE_DIR", str(tmp_path))
    head = os.path.join(REPO, "onespec", "_demo", "eagle3")
    args = parse(serve_parser(), [DEMO_TARGET, "--draft", head, "--k", "2", "--device", "cpu",
                                  "--draft-len-schedule", "auto", "--rejection-sampling",
                                  "--max-batch-size", "2", "--max-model-len", "256"])
    with build_llm(args) as llm:
        sc = llm.engine.spec_config
        assert sc.draft_len_schedule == "auto" and sc.use_rejection_sampling
        assert set(llm.engine.policy.step_times) == {(b, k) for b in (1, 2) for k in range(3)}


def test_flags_show_no_default_in_help():
    """`--no-progress (default: True)` read as if the flag were on by default."""
    from onespec.train.cli import eagle3_parser
    text = " ".join(eagle3_parser().format_help().split())
    assert "--no-progress no progress bar" in text and "(default: True)" not in \
        text.split("--no-progress no progress bar", 1)[1][:80]
    text = " ".join(serve_parser().format_help().split())
    assert "reuse the KV of prompt prefixes seen before (default: True)" in text
