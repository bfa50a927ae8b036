"""Memory an engine holds on the CPU, and what close() gives back (each measured in a
fresh process, whose resident memory no other test has touched)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from onespec.engine.kv_cache import BlockPool, zeros_on_write

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(REPO, "onespec", "_demo", "target")
DEMO_HEAD = os.path.join(REPO, "onespec", "_demo", "eagle3")

# Runs in a fresh interpreter: prints one JSON line of resident-memory readings (MiB).
SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(1)
from onespec import LLM, Eagle3Config, SamplingParams

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024

target, head, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
sp = SamplingParams(max_tokens=8, ignore_eos=True)
before = rss_mib()
open_rss, closed_rss, blocks, weights = [], [], 0, 0
for i in range(rounds):
    with LLM(target, speculative_config=Eagle3Config(head), device="cpu") as llm:
        llm.generate(["def fib(n):", "import os"], sp)
        open_rss.append(rss_mib())
        blocks = llm.engine.pool.num_blocks
        mods = [llm.engine.model, llm.engine.drafter.head]
        weights = sum(p.numel() * p.element_size() for m in mods for p in m.parameters())
        del mods
    closed_rss.append(rss_mib())
print(json.dumps(dict(before=before, open=open_rss, closed=closed_rss, num_blocks=blocks,
                      weight_mib=weights / 2**20)))
"""


def run_engines(rounds: int) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", SCRIPT, DEMO_TARGET, DEMO_HEAD, str(rounds)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ten_engines() -> dict:
    return run_engines(10)


def test_ten_engines_built_and_closed_stay_within_ten_percent_of_one(ten_engines):
    m = ten_engines
    one = m["open"][0]
    assert max(m["open"]) <= 1.10 * one, m
    assert max(m["closed"]) <= 1.10 * one, m


def test_close_gives_the_weights_back_without_a_collection_by_the_caller(ten_engines):
    m = ten_engines      # (the `with` block's exit calls close(); nobody calls gc.collect)
    for opened, closed in zip(m["open"], m["closed"]):
        assert opened - closed >= 0.5 * m["weight_mib"], m


def test_a_default_demo_engine_holds_under_1_gb_beyond_its_weights(ten_engines):
    m = ten_engines
    # the default pool is sized for 64 requests of max_model_len = 2048 (3.4 GB here), but
    # only the blocks written take memory
    assert m["num_blocks"] >= 64 * 2048 // 16, m
    assert m["open"][0] - m["before"] - m["weight_mib"] < 1024, m


def test_cpu_pool_memory_is_zero_and_writable():
    t = zeros_on_write((2, 3, 1000, 2, 8), torch_dtype(), "cpu")
    assert t.shape == (2, 3, 1000, 2, 8) and not t.any()
    t[1, 2, 999] = 5.0
    assert t.sum().item() == 80.0


def torch_dtype():
    import torch
    return torch.bfloat16


def test_freed_blocks_are_reused_first():
    """A freed block is allocated again before one never written (its pages are resident
    already): [0, 1] freed, then a request of two blocks gets them back."""
    pool = BlockPool(8, 4)
    table = []
    pool.allocate(table, 8)
    assert table == [0, 1]
    pool.free(table)
    again = []
    pool.allocate(again, 8)
    assert again == [0, 1]


def test_a_closed_engine_refuses_requests():
    from onespec import LLM
    llm = LLM(DEMO_TARGET, device="cpu", max_model_len=64)
    llm.close()
    llm.close()                                   # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]])
