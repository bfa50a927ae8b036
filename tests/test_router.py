"""Replicas behind the request routers users already run: two `onespec serve` replicas of
the demo pair, and sglang-router or vllm-router in front of them, all real processes on
127.0.0.1, driven by the official openai client through the router.

Checked: greedy answers through the router equal a direct call to a replica; both replicas
serve; requests sharing a long prefix land on the replica that cached it (its
usage.prompt_tokens_details.cached_tokens says so); and (sglang-router) killing a replica
while requests are in flight leaves the router answering from the other, with no request
hanging. Every wait is bounded; every process is killed in `finally`."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from onespec.demo import DEMO_DIR  # noqa: E402

MODEL = "target"                       # the demo target's served name (its directory's)
STARTUP_TIMEOUT_S = 120                # two replicas loading at once on a busy machine
REQUEST_TIMEOUT_S = 30                 # no request through a router may take longer
MAX_TOKENS = 6
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# a shared prefix long enough to fill several KV blocks (16 tokens each)
PREFIX = ("You are a careful assistant. Read the following notes about the project, then "
          "answer the question at the end in one short sentence. The notes: the engine "
          "drafts tokens with a small head and verifies them with the target model in one "
          "step; accepted tokens are appended, rejected ones are rewound. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process with its log; stop() always ends it (terminate, then kill)."""

    def __init__(self, name: str, args: list[str], log_dir, port: int):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **ONE_THREAD})

    def logs(self) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def wait_until(self, ready, what: str, timeout: float = STARTUP_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.logs()}")
            try:
                if ready():
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: {what} not within {timeout} s:\n{self.logs()}")

    def kill(self):
        """SIGKILL: the replica dies as a crashed machine would, without a goodbye."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


class Replica(Proc):
    def __init__(self, name: str, log_dir):
        port = free_port()
        super().__init__(name, [
            sys.executable, "-m", "onespec", "serve",
            "--model", os.path.join(DEMO_DIR, "target"),
            "--draft", os.path.join(DEMO_DIR, "eagle3"),
            "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1",
            "--port", str(port), "--no-access-log", "--log-stats-interval", "0"],
            log_dir, port)

    def wait_ready(self):
        return self.wait_until(
            lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200, "healthy")

    def wait_busy(self, timeout: float = 10.0) -> bool:
        """Waits until a request is in this replica (admitted, queued or running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = httpx.get(self.url + "/health", timeout=2).json()
            if h["num_requests_admitting"] + h["num_requests_waiting"] + \
                    h["num_requests_running"] > 0:
                return True
            time.sleep(0.02)
        return False

    def num_served(self) -> float:
        """Generation requests this replica has finished (its /metrics counter)."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(s.value for fam in text_string_to_metric_families(text)
                   for s in fam.samples if s.name == "onespec_requests_total")

    def client(self):
        return client_for(self.url)


def client_for(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                         timeout=REQUEST_TIMEOUT_S)


def complete(client, prompt: str, max_tokens: int = MAX_TOKENS):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0)


def cached_tokens(resp) -> int:
    details = resp.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two replicas of the demo pair, started at once; always stopped. The sglang-router
    test kills the second, so it runs last."""
    logs = tmp_path_factory.mktemp("router-logs")
    started = []
    try:
        started += [Replica("replica-a", logs), Replica("replica-b", logs)]
        for r in started:
            r.wait_ready()
        yield started
    finally:
        for r in started:
            r.stop()


def start_router(kind: str, replicas, log_dir) -> Proc:
    """sglang-router or vllm-router over the replicas, on free ports (its Prometheus
    listener too, which otherwise takes a fixed port)."""
    port, prom = free_port(), free_port()
    urls = [r.url for r in replicas]
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(prom),
              "--policy", "cache_aware", "--worker-urls", *urls]
    if kind == "sglang":
        args = [sys.executable, "-m", "sglang_router.launch_router", *common,
                "--log-level", "warn", "--health-check-interval-secs", "1",
                "--worker-startup-timeout-secs", "60"]
    else:
        args = [shutil.which("vllm-router"), *common, "--log-level", "warning",
                "--health-check-interval-secs", "1", "--worker-startup-timeout-secs", "60"]
    router = Proc(f"{kind}-router", args, log_dir, port)
    try:
        # ready: it lists the replicas' model (found through their /model_info or
        # /v1/models), and answers a completion
        router.wait_until(lambda: MODEL in httpx.get(router.url + "/v1/models",
                                                      timeout=2).text, "the model listed", 60)
        router.wait_until(lambda: complete(client_for(router.url), "warm up", 1).choices,
                          "a first completion", 60)
    except BaseException:
        router.stop()
        raise
    return router


def check_router(router: Proc, replicas, tag: str):
    """Concurrent greedy requests through the router equal direct calls; both replicas
    serve; a shared long prefix is served from the replica that cached it."""
    client = client_for(router.url)
    before = [r.num_served() for r in replicas]
    # prompts with nothing in common from their first character: the cache-aware policy
    # spreads them over the replicas
    prompts = [f"{i * 7 + 3} is the {tag} number; what is {i} times {i + 3}?"
               for i in range(4)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        routed = list(pool.map(lambda p: complete(client, p).choices[0].text, prompts))
    served = [r.num_served() - b for r, b in zip(replicas, before)]
    assert sum(served) >= len(prompts)
    assert all(n > 0 for n in served), f"one replica served nothing: {served}"

    # a long prefix, then follow-ups sharing it: each follow-up finds it cached
    first = complete(client, f"{tag}. {PREFIX} Question 0: what is drafted?")
    follow_ups = [complete(client, f"{tag}. {PREFIX} Question {i}: what is verified?")
                  for i in range(1, 3)]
    prefix_tokens = httpx.post(replicas[0].url + "/tokenize", timeout=10,
                               json={"prompt": f"{tag}. {PREFIX}"}).json()["count"]
    assert first.usage.prompt_tokens > prefix_tokens > 64
    for resp in follow_ups:     # whole blocks of the prefix (16 tokens each) were cached
        assert cached_tokens(resp) >= prefix_tokens - 32, \
            (cached_tokens(resp), prefix_tokens, router.logs())

    direct = replicas[0].client()
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert routed == list(pool.map(lambda p: complete(direct, p).choices[0].text,
                                       prompts))
    return client


@pytest.mark.skipif(shutil.which("vllm-router") is None, reason="vllm-router not installed")
def test_vllm_router_serves_both_replicas_and_keeps_prefixes(replicas, tmp_path):
    router = start_router("vllm", replicas, tmp_path)
    try:
        check_router(router, replicas, "vllm")
    finally:
        router.stop()


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                    reason="sglang-router not installed")
def test_sglang_router_serves_both_replicas_and_survives_a_killed_one(replicas, tmp_path):
    router = start_router("sglang", replicas, tmp_path)
    try:
        client = check_router(router, replicas, "sglang")
        # registration: the router found the model's name through /model_info
        workers = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
        assert sorted(w["model_id"] for w in workers) == [MODEL, MODEL]
        # loads come from the replicas' /get_load (-1: the router could not read one)
        loads = httpx.get(router.url + "/get_loads", timeout=5).json()["workers"]
        assert len(loads) == 2 and all(w["load"] >= 0 for w in loads), loads
        # the health check that goes through a replica's engine loop
        deep = httpx.get(replicas[0].url + "/health_generate", timeout=10)
        assert deep.status_code == 200 and deep.json()["status"] == "ok"
        # /flush_cache reaches every replica: the shared prefix is computed again
        flushed = httpx.post(router.url + "/flush_cache", timeout=10).json()
        assert flushed["workers_flushed"] == 2, flushed
        again = complete(client, f"sglang. {PREFIX} Question 1: what is verified?")
        assert cached_tokens(again) == 0

        # kill one replica while requests are in flight: none hangs, and the router
        # answers from the other replica from then on
        prompts = [f"{i * 11 + 5} after a crash: count to {i}" for i in range(6)]
        direct = replicas[0].client()
        with ThreadPoolExecutor(len(prompts)) as pool:
            expected = list(pool.map(lambda p: complete(direct, p).choices[0].text, prompts))

        def routed(prompt):
            try:
                return complete(client, prompt).choices[0].text
            except openai.APIStatusError as e:     # answered, with an error: not a hang
                return e

        start = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(routed, p) for p in prompts]
            assert replicas[1].wait_busy(), "the router sent the second replica nothing"
            replicas[1].kill()          # with requests of its own in flight
            in_flight = [f.result(timeout=REQUEST_TIMEOUT_S + 5) for f in futures]
        assert time.monotonic() - start < REQUEST_TIMEOUT_S
        answered = [(got, want) for got, want in zip(in_flight, expected)
                    if isinstance(got, str)]
        assert answered and all(got == want for got, want in answered), in_flight

        after = [complete(client, p).choices[0].text for p in prompts[:2]]
        assert after == expected[:2]
        assert time.monotonic() - start < REQUEST_TIMEOUT_S
    finally:
        router.stop()
