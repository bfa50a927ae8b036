"""The auto draft length's step-time table: what is measured, the on-disk cache, and how
long an engine with draft_len_schedule="auto" takes to start on the demo pair."""
from __future__ import annotations

import glob
import json
import os
import time

import pytest

from onespec import LLM, Eagle3Config
from onespec.engine.calibrate import (CACHE_DIR_ENV, batch_buckets, interpolate, load_table,
                                      measured_buckets, save_table)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(REPO, "onespec", "_demo", "target")
DEMO_HEAD = os.path.join(REPO, "onespec", "_demo", "eagle3")


def test_measured_buckets_are_those_reached_spaced_by_four():
    assert measured_buckets(batch_buckets(64)) == [1, 4, 16, 64]
    assert measured_buckets(batch_buckets(6)) == [1, 4, 6]
    assert measured_buckets(batch_buckets(1)) == [1]
    assert measured_buckets(batch_buckets(20)) == [1, 4, 16, 20]


def test_unmeasured_buckets_are_interpolated_in_the_batch_size():
    """Bucket 8 lies 4/12 of the way from 4 to 16: 10 + (40 - 10) / 3 = 20 ms at K = 0."""
    table = {(4, 0): 0.010, (4, 1): 0.020, (16, 0): 0.040, (16, 1): 0.050,
             (1, 0): 0.005, (1, 1): 0.006}
    full = interpolate(table, [1, 2, 4, 8, 16], 1)
    assert full[(8, 0)] == pytest.approx(0.020) and full[(8, 1)] == pytest.approx(0.030)
    assert full[(2, 0)] == pytest.approx(0.005 + 0.005 / 3)
    assert {b for b, _ in full} == {1, 2, 4, 8, 16}


def test_a_table_stored_under_another_key_is_not_read(tmp_path):
    path = str(tmp_path / "t.json")
    save_table(path, {"device": "a"}, {(1, 0): 0.5, (1, 1): 0.75})
    assert load_table(path, {"device": "a"}) == {(1, 0): 0.5, (1, 1): 0.75}
    assert load_table(path, {"device": "b"}) is None
    with open(path, "w") as f:
        f.write("{not json")
    assert load_table(path, {"device": "a"}) is None


def auto_llm(**kwargs) -> LLM:
    return LLM(DEMO_TARGET, device="cpu",
               speculative_config=Eagle3Config(DEMO_HEAD, draft_len_schedule="auto"), **kwargs)


def test_auto_on_the_demo_pair_starts_in_20_s_and_in_3_s_from_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    start = time.perf_counter()
    with auto_llm() as llm:
        first = time.perf_counter() - start
        table = dict(llm.engine.policy.step_times)
    assert first < 20.0
    assert {b for b, _ in table} == set(batch_buckets(64)) and len(table) == 9 * 4
    files = glob.glob(str(tmp_path / "draft_len" / "*.json"))
    assert len(files) == 1
    stored = json.load(open(files[0]))
    assert stored["key"]["dtype"] == "torch.float32" and "cores" in stored["key"]["device"]
    start = time.perf_counter()
    with auto_llm() as llm:
        cached = time.perf_counter() - start
        assert llm.engine.policy.step_times == pytest.approx(table)
    assert cached < 3.0
    # another K is another table
    with LLM(DEMO_TARGET, device="cpu", max_batch_size=2,
             speculative_config=Eagle3Config(DEMO_HEAD, max_draft_len=1,
                                             draft_len_schedule="auto")) as llm:
        assert set(llm.engine.policy.step_times) == {(b, k) for b in (1, 2) for k in (0, 1)}
    assert len(glob.glob(str(tmp_path / "draft_len" / "*.json"))) == 2
