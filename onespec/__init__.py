"""onespec: one-model speculative decoding (EAGLE-3) in plain PyTorch."""
from onespec.config import DFlashConfig, Eagle3Config, EngineConfig, MTPConfig, NGramConfig
from onespec.sampling_params import SamplingParams
from onespec.structured import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "Eagle3Config", "DFlashConfig", "MTPConfig", "NGramConfig",
           "EngineConfig",
           "RequestOutput", "CompletionOutput", "StructuredOutputsParams"]
__version__ = "0.1.0"

# imported on first use: they import torch, which the command line does not need before it
# has checked its arguments (a busy port fails in well under the time torch takes to load)
_LAZY = {"LLM": "onespec.llm", "RequestOutput": "onespec.outputs",
         "CompletionOutput": "onespec.outputs"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'onespec' has no attribute {name!r}")
