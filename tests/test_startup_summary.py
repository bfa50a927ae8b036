"""LLM construction logs what the engine is, at INFO (onespec/engine/summary.py)."""
from __future__ import annotations

import logging
import os

from onespec import LLM, MTPConfig, NGramConfig
from onespec.engine.summary import describe_drafter

DEMO_TARGET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "onespec", "_demo", "target")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_llm_construction_logs_the_summary_at_info():
    logger = logging.getLogger("onespec.llm")      # (its parent may not propagate: serve)
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        LLM(DEMO_TARGET, speculative_config=NGramConfig(max_draft_len=4), device="cpu",
            max_model_len=64, max_batch_size=2).close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    text = "\n".join(handler.lines)
    assert "engine ready in " in text
    assert "drafter: n-gram prompt lookup (n = 1..3), K = 4" in text
    # 2 requests of 64 tokens + max(K + 1, 2K)... rounded up to blocks: 5 blocks each
    assert "KV cache: 10 blocks of 16 tokens (160 tokens" in text
    assert "max_model_len 64, max_batch_size 2" in text


def test_describe_drafter_names_the_method_k_and_schedule():
    assert describe_drafter(None, 0) == "none (plain decoding, K = 0)"
    assert describe_drafter(MTPConfig(num_nextn_predict_layers=3, draft_len_schedule={4: 1}),
                            3) == ("MTP (one layer, repeated), K = 3; draft length by batch "
                                   "size {4: 1}")
