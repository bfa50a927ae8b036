"""Robustness of the server, as an attacker or a careless client would probe it: one real
`python -m onespec serve` process (with an API key and a 1 MiB body limit) keeps its
concurrent streams right and /health answering within a second while bad requests
arrive: out-of-range numbers, oversized bodies and prompts, stop strings without bounds,
uploads cut short. Also: a request that fails inside the engine loop fails alone, and a
broken config.json ends `onespec serve` with one line and exit status 2."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import assert_pool_full, make_hf_model  # noqa: E402
from onespec import LLM, SamplingParams  # noqa: E402
from onespec.serve.async_engine import EngineError, EngineLoop  # noqa: E402
from test_serve import API_KEY, ONE_THREAD, Server, write_tokenizer  # noqa: E402

MODEL_NAME = "tiny-llama"
VOCAB_SIZE = 300
BODY_LIMIT = 1 << 20
STREAM_PROMPTS = [[5, 17, 42], [7, 8, 9, 10], "hello world", [100, 3, 250, 12, 40]]
STREAM_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    target = tmp_path_factory.mktemp("robust-serve") / MODEL_NAME
    make_hf_model(target, "llama", vocab_size=VOCAB_SIZE)
    write_tokenizer(target)
    return str(target)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("robust-serve-log") / "server.log"
    s = Server(["--model", model_dir, "--max-request-body-bytes", str(BODY_LIMIT)], log)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def expected_streams(server) -> list[str]:
    client = server.client()
    return [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=STREAM_TOKENS,
                                      temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
            for p in STREAM_PROMPTS]


class UnderLoad:
    """Greedy streams running and /health polled while the body of a `with` block sends
    bad requests; on exit the streams must have their expected text, /health must have
    answered every poll within a second, and the KV pool must be full again."""

    def __init__(self, server, expected: list[str]):
        self.server, self.expected = server, expected
        self.pool = ThreadPoolExecutor(max_workers=len(expected) + 1)
        self.done = threading.Event()
        self.latencies: list[float] = []

    def _stream(self, prompt) -> str:
        chunks = self.server.client(timeout=60).completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=STREAM_TOKENS, stream=True,
            temperature=0, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks)

    def _poll_health(self):
        while not self.done.is_set():
            start = time.monotonic()
            assert httpx.get(self.server.url + "/health", timeout=5).status_code == 200
            self.latencies.append(time.monotonic() - start)
            time.sleep(0.02)

    def __enter__(self):
        self.health = self.pool.submit(self._poll_health)
        self.streams = [self.pool.submit(self._stream, p) for p in STREAM_PROMPTS]
        return self

    def __exit__(self, exc_type, *_):
        texts = [f.result(timeout=60) for f in self.streams]
        self.done.set()
        self.health.result(timeout=10)
        self.pool.shutdown()
        if exc_type is None:
            assert texts == self.expected
            assert self.latencies and max(self.latencies) < 1.0, max(self.latencies)
            h = self.server.wait_pool_full()
            assert h["kv_blocks_free"] == h["kv_blocks_total"]


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, **fields}


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 message: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    assert message in err["message"], err
    return err


# ---- 1, 6. numeric fields ----------------------------------------------------------------
BAD_NUMBERS = [
    ("top_k 2**63", completion(top_k=2**63), "top_k"),
    ("seed 2**64", completion(seed=2**64), "seed"),
    ("seed -2**63-1", completion(seed=-2**63 - 1), "seed"),
    ("seed true", completion(seed=True), "seed"),
    ("stop_token_ids 2**63", completion(stop_token_ids=[2**63]), "stop_token_ids"),
    ("stop_token_ids past vocab", completion(stop_token_ids=[VOCAB_SIZE]), "stop_token_ids"),
    ("stop_token_ids [true]", completion(stop_token_ids=[True]), "stop_token_ids"),
    ("max_tokens 2**63", completion(max_tokens=2**63), "max_tokens"),
    ("temperature 1e308", completion(temperature=1e308), "temperature"),
    ("temperature '0.5'", completion(temperature="0.5"), "temperature"),
    ("top_p 0", completion(top_p=0.0), "top_p"),
    ("chat max_completion_tokens 0", chat(max_tokens=None, max_completion_tokens=0),
     "max_completion_tokens"),
]


def test_bad_numbers_answer_400_and_streams_go_on(server, expected_streams):
    with UnderLoad(server, expected_streams):
        for name, body, param in BAD_NUMBERS:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            err = assert_error(server.post(path, json=body), 400, param)
            assert err["message"].startswith(param), (name, err)
        r = server.post("/v1/completions", json=completion(temperature=1e-40, max_tokens=4))
        assert r.status_code == 200                          # below the floor: greedy


# ---- 3. request size -----------------------------------------------------------------------
def test_oversized_bodies_answer_413(server, expected_streams):
    big = json.dumps(completion(prompt="a" * BODY_LIMIT)).encode()

    def chunked():
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + 1 << 16]

    with UnderLoad(server, expected_streams):
        assert_error(server.post("/v1/completions", content=big), 413,
                     message=f"at most {BODY_LIMIT}")
        assert_error(server.post("/v1/completions", content=chunked()), 413,
                     message=f"more than {BODY_LIMIT} bytes")
        ok = server.post("/v1/completions", content=json.dumps(completion()).encode())
        assert ok.status_code == 200


def test_long_prompts_rejected_before_tokenizing(server, expected_streams):
    huge = "the quick brown fox " * 45_000            # 900k characters, under the body cap
    long_ = "zq" * 1500                              # 3000: tokenized in part, rejected
    client = server.client()
    body = json.dumps(completion(prompt=huge)).encode()
    with UnderLoad(server, expected_streams):
        with ThreadPoolExecutor(max_workers=4) as pool:
            rs = list(pool.map(lambda b: server.post("/v1/completions", content=b), [body] * 4))
        for r in rs:
            err = assert_error(r, 400, "prompt", "900000 characters")
            assert err["code"] == "context_length_exceeded"
        assert_error(server.post("/v1/completions", json=completion(prompt=long_)), 400,
                     "prompt", "more than")
        messages = [{"role": "user", "content": huge}]
        with pytest.raises(openai.BadRequestError, match="characters"):
            client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)


# ---- 4. stop strings -----------------------------------------------------------------------
def test_stop_strings_are_bounded(server, expected_streams):
    with UnderLoad(server, expected_streams):
        assert_error(server.post("/v1/completions", json=completion(stop=["x"] * 65)), 400,
                     "stop", "at most 64 strings")
        assert_error(server.post("/v1/completions", json=completion(stop=["x" * 1025])), 400,
                     "stop", "at most 1024 characters")
        stops = [chr(0x4E00 + i) * 1024 for i in range(64)]        # the most allowed
        start = time.monotonic()
        r = server.post("/v1/completions", json=completion(
            stop=stops, max_tokens=64, ignore_eos=True))
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - start < 10


# ---- 8. an upload cut short ----------------------------------------------------------------
def test_disconnect_mid_upload_is_one_log_line(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                  b'{"model": "tiny-llama", "prompt": "')
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while "client disconnected" not in server.logs() and time.monotonic() < deadline:
        time.sleep(0.05)
    logs = server.logs()
    assert logs.count("client disconnected") == 1
    assert "Traceback" not in logs and "internal error" not in logs
    assert server.health()["status"] == "ok"


# ---- 9. API key ----------------------------------------------------------------------------
def test_api_key_hides_docs_and_takes_any_case_of_bearer(server):
    for page in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + page, timeout=5).status_code == 404
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        r = httpx.post(server.url + "/v1/completions", json=completion(),
                       headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=30)
        assert r.status_code == 200, (scheme, r.text)
    for header in (f"Basic {API_KEY}", f"Bearer {API_KEY}x", API_KEY):
        r = httpx.post(server.url + "/v1/completions", json=completion(),
                       headers={"Authorization": header}, timeout=30)
        assert_error(r, 401)


# ---- 1. a request that fails in the engine loop fails alone --------------------------------
def test_engine_loop_fails_only_the_failing_request(model_dir):
    llm = LLM(model_dir, dtype="float32", device="cpu")
    sps = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True)
           for i in range(4)]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, sps)]
    poisoned = SamplingParams(max_tokens=12, temperature=0.8)
    poisoned.seed = 2**80                   # set past validation: fails inside the step
    loop = EngineLoop(llm.engine)

    async def one(request_id, prompt, sp):
        queue = await loop.add(prompt, sp, request_id)
        return [t async for u in loop.updates(request_id, queue) for t in u.new_token_ids]

    async def main():
        loop.start()
        try:
            return await asyncio.gather(
                *(one(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))),
                one("bad", [5, 6, 7], poisoned), return_exceptions=True)
        finally:
            await loop.stop()

    results = asyncio.run(main())
    assert results[:4] == expected
    assert isinstance(results[4], EngineError)
    assert "the engine failed on this request" in str(results[4])
    assert_pool_full(llm)


# ---- 6. a broken config ends `onespec serve` with one line ---------------------------------
def test_serve_with_broken_config_exits_2_with_one_line(model_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = "256"
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "onespec", "serve", "--model", str(bad),
                           "--device", "cpu"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **ONE_THREAD})
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"onespec serve: error: {bad / 'config.json'}: field 'hidden_size' must "
                     "be a positive integer, got '256'"], proc.stderr
