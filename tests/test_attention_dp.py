"""Attention data parallelism is not built: asking for it is refused at once, before any
weights load or rank starts, with what is missing and what to use instead."""
import pytest

from onespec import LLM
from onespec.config import EngineConfig


def test_attention_dp_is_refused_with_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match=r"enable_attention_dp=True is not supported.*"
                                         r"KV pool per rank.*tensor_parallel_size"):
        LLM(str(tmp_path / "no-model-needed"), tensor_parallel_size=2, enable_attention_dp=True)
    with pytest.raises(ValueError, match="enable_attention_dp must be True or False"):
        EngineConfig(model="m", enable_attention_dp="yes")
    assert EngineConfig(model="m").enable_attention_dp is False
