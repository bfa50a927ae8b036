"""`onespec serve --tensor-parallel-size 2` on the CPU: the official openai client gets
one rank's greedy text from two ranks, and Ctrl-C (SIGINT) stops the server and its
worker process."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from conftest import make_hf_model  # noqa: E402
from onespec import LLM, SamplingParams  # noqa: E402
from test_serve import MODEL_NAME, VOCAB_SIZE, Server, write_tokenizer  # noqa: E402

PROMPTS = ["hello world", "def fib(n):", [5, 17, 42, 99, 7]]


def spawned_children(pid: int) -> list[int]:
    """The multiprocessing-spawned children of process `pid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            out.append(int(entry))
    return out


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_two_rank_server_answers_openai_client_and_stops_on_ctrl_c(tmp_path):
    target = tmp_path / MODEL_NAME
    make_hf_model(target, "llama", vocab_size=VOCAB_SIZE)
    write_tokenizer(target)
    server = Server(["--model", str(target), "--tensor-parallel-size", "2",
                     "--max-num-tokens", "8"], tmp_path / "server.log")
    try:
        offline = LLM(str(target), device="cpu", dtype="float32")
        want = [o.outputs[0].text for o in
                offline.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0))]
        server.wait_ready()
        workers = spawned_children(server.proc.pid)
        assert len(workers) == 1, server.logs()
        client = server.client()

        def complete(prompt):
            return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                             temperature=0.0).choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:       # batched in the engine
            assert list(pool.map(complete, PROMPTS)) == want
        h = server.wait_pool_full()
        assert h["kv_blocks_free"] == h["kv_blocks_total"]
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=30) is not None
        deadline = time.monotonic() + 10
        while any(map(is_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(is_running, workers)), server.logs()
    finally:
        server.stop()


def test_dead_worker_fails_requests_and_health(tmp_path):
    """In-process app: once a worker dies, the request in hand gets an error, /health
    answers 503 and later requests are refused (the engine loop has ended)."""
    from fastapi.testclient import TestClient

    from onespec.serve import create_app
    make_hf_model(tmp_path, "llama", num_layers=1)
    body = {"model": "m", "prompt": [4, 5], "max_tokens": 3}
    with LLM(str(tmp_path), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        with TestClient(create_app(llm, "m")) as c:
            assert c.post("/v1/completions", json=body).status_code == 200
            proc = llm.engine.ranks.procs[0]
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            r = c.post("/v1/completions", json=body)
            assert r.status_code >= 500 and "rank 1" in r.text
            assert c.get("/health").status_code == 503
            assert c.post("/v1/completions", json=body).status_code >= 500
