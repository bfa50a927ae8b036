"""Multi-node launch on one machine: two `torchrun` "nodes" (--nnodes 2, --nproc-per-node 1,
a c10d rendezvous on 127.0.0.1) each run `onespec serve --tensor-parallel-size 2` over
gloo; rank 0 serves, the other rank runs its steps. The openai client's greedy answers
equal one rank's, and stopping rank 0's node ends the job."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import make_hf_model, stop_process  # noqa: E402
from onespec import LLM, SamplingParams  # noqa: E402
from test_serve import MODEL_NAME, VOCAB_SIZE, write_tokenizer  # noqa: E402

PROMPTS = ["hello world", "def fib(n):", [5, 17, 42, 99, 7]]
STARTUP_TIMEOUT_S = 120
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_node(node_rank: int, rdzv_port: int, args: list[str], log_path):
    """One torchrun agent ("node") with one process, meeting the other at rdzv_port."""
    log = open(log_path, "w")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
         "--nproc-per-node", "1", "--node-rank", str(node_rank),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}",
         "--rdzv-id", "onespec-test", "--max-restarts", "0", "-m", "onespec", *args],
        stdout=log, stderr=subprocess.STDOUT, env={**env, **ONE_THREAD})
    return proc, log


def test_two_torchrun_nodes_serve_one_ranks_greedy_text(tmp_path):
    target = tmp_path / MODEL_NAME
    make_hf_model(target, "llama", vocab_size=VOCAB_SIZE)
    write_tokenizer(target)
    port, rdzv = free_port(), free_port()
    args = ["serve", "--model", str(target), "--device", "cpu", "--dtype", "float32",
            "--tensor-parallel-size", "2", "--host", "127.0.0.1", "--port", str(port),
            "--no-access-log", "--log-stats-interval", "0"]
    nodes = [torchrun_node(r, rdzv, args, tmp_path / f"node{r}.log") for r in (0, 1)]

    def logs() -> str:
        return "\n".join(f"--- node {r}:\n" + (tmp_path / f"node{r}.log").read_text()[-3000:]
                         for r in (0, 1))
    try:
        offline = LLM(str(target), device="cpu", dtype="float32")
        want = [o.outputs[0].text for o in
                offline.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))]
        offline.close()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:             # whichever node's process became rank 0 listens on the port
            assert all(p.poll() is None for p, _ in nodes), logs()
            assert time.monotonic() < deadline, logs()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert httpx.get(url + "/server_info", timeout=5).json()["tp_size"] == 2
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=30)
        got = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=12,
                                         temperature=0).choices[0].text for p in PROMPTS]
        assert got == want

        # stopping the node that serves ends the other rank too, cleanly: rank 0 tells it
        # to stop (its torchrun agent then waits for the other agent at its exit barrier)
        serving = 0 if "Application startup complete" in \
            (tmp_path / "node0.log").read_text() else 1
        assert "Application startup complete" in (tmp_path / f"node{serving}.log").read_text()
        stop_process(nodes[serving][0])
        follower = tmp_path / f"node{1 - serving}.log"
        deadline = time.monotonic() + 30
        while "rank 1: rank 0 stopped, exiting" not in follower.read_text():
            assert time.monotonic() < deadline, logs()
            time.sleep(0.2)
    finally:
        for proc, log in nodes:
            stop_process(proc)
            log.close()


def test_launcher_environment_errors_name_what_is_wrong(monkeypatch, tmp_path):
    from onespec.distributed.launch import launched_env
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert launched_env(2) is None                  # no launcher: rank 0 spawns the ranks
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launched_env(2) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2 but not RANK, LOCAL_RANK, "
                                         "MASTER_ADDR, MASTER_PORT"):
        launched_env(2)
    env = {"RANK": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert (launched_env(2).rank, launched_env(2).local_rank) == (1, 0)
    # a job of 3 processes for a split over 2 is refused before any weight loads
    monkeypatch.setenv("WORLD_SIZE", "3")
    (tmp_path / "config.json").write_text(json.dumps({      # no weights needed
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 144,
        "num_hidden_layers": 2, "vocab_size": VOCAB_SIZE}))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 but the launcher started "
                                         r"WORLD_SIZE=3 processes"):
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=2)
