"""What an operator sees of `onespec serve` on the demo pair, started with a positional
MODEL: the start-up summary, the periodic stats line, and /metrics latency histograms
whose counts match the requests sent."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(REPO, "onespec", "_demo", "target")
DEMO_HEAD = os.path.join(REPO, "onespec", "_demo", "eagle3")
NUM_REQUESTS = 3
HISTOGRAMS = ("onespec_time_to_first_token_seconds", "onespec_e2e_request_latency_seconds",
              "onespec_request_queue_time_seconds")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base url, log path, /metrics samples after NUM_REQUESTS completions)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "onespec", "serve", DEMO_TARGET, "--draft", DEMO_HEAD,
             "--k", "2", "--port", str(port), "--device", "cpu", "--max-model-len", "256",
             "--max-batch-size", "4", "--log-stats-interval", "0.5", "--no-access-log"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, open(log_path).read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, open(log_path).read()
            time.sleep(0.2)
        for i in range(NUM_REQUESTS):
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": "target", "prompt": f"def f{i}(x):", "max_tokens": 12,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        time.sleep(1.2)                   # a stats line covers the requests
        samples = {}
        for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        yield url, log_path, samples
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_start_up_summary_names_the_model_drafter_and_k(served):
    log = open(served[1]).read()
    assert f"model {DEMO_TARGET}: LlamaForCausalLM, 24 layers" in log
    assert f"drafter: EAGLE-3 head {DEMO_HEAD}, K = 2" in log
    assert "KV cache: " in log and "blocks of 16 tokens" in log
    assert "prefix caching: on" in log and "CUDA graphs: off" in log


def test_latency_histograms_count_the_requests_sent(served):
    samples = served[2]
    for name in HISTOGRAMS:
        assert samples[f"{name}_count"] == NUM_REQUESTS, name
        assert samples[f"{name}_sum"] >= 0.0
    # each request's 12 tokens came in at least 2 steps and at most 12 (K = 2)
    itl = samples["onespec_inter_token_latency_seconds_count"]
    assert NUM_REQUESTS <= itl <= NUM_REQUESTS * 11
    assert samples["onespec_time_to_first_token_seconds_sum"] <= \
        samples["onespec_e2e_request_latency_seconds_sum"]


def test_per_position_acceptance_counters(served):
    samples = served[2]
    drafted = [samples[f"onespec_spec_decode_num_draft_tokens_per_pos_total{{position={j}}}"]
               for j in (1, 2)]
    accepted = [samples[f"onespec_spec_decode_num_accepted_tokens_per_pos_total"
                        f"{{position={j}}}"] for j in (1, 2)]
    assert drafted[0] > 0 and all(a <= d for a, d in zip(accepted, drafted))
    assert accepted[1] <= accepted[0]      # position 2 is accepted only after position 1
    assert samples["onespec_spec_decode_num_drafts_total"] == drafted[0]
    # (the requests' counters leave out drafts accepted past max_tokens, which are cut)
    assert sum(accepted) >= samples["onespec_accepted_draft_tokens_total"]


def test_a_stats_line_is_logged_while_there_is_work(served):
    lines = [line for line in open(served[1]).read().splitlines() if "engine: " in line]
    assert lines, open(served[1]).read()
    assert "tokens/s" in lines[0] and "KV cache" in lines[0] and "acceptance length" in \
        " ".join(lines)


def test_served_stop_strings_end_where_offline_ones_do(served):
    from onespec import LLM, SamplingParams
    url = served[0]
    body = {"model": "target", "prompt": "def fib(n):", "max_tokens": 30, "temperature": 0,
            "ignore_eos": True}
    full = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    text = full["choices"][0]["text"]
    stop = next(text[i:i + 3] for i in range(6, len(text) - 3)
                if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)
    served_out = httpx.post(url + "/v1/completions", json={**body, "stop": [stop]},
                            timeout=60).json()["choices"][0]
    with LLM(DEMO_TARGET, device="cpu", max_model_len=256, max_batch_size=1) as llm:
        offline = llm.generate("def fib(n):", SamplingParams(
            max_tokens=30, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert (served_out["text"], served_out["finish_reason"]) == \
        (offline.text, offline.finish_reason) == (text[:text.find(stop)], "stop")
