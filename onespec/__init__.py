"""onespec: one-model speculative decoding (EAGLE-3) in plain PyTorch."""
from onespec.config import Eagle3Config, EngineConfig, MTPConfig, NGramConfig
from onespec.llm import LLM
from onespec.outputs import CompletionOutput, RequestOutput
from onespec.sampling_params import SamplingParams
from onespec.structured import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "Eagle3Config", "MTPConfig", "NGramConfig", "EngineConfig",
           "RequestOutput", "CompletionOutput", "StructuredOutputsParams"]
__version__ = "0.1.0"
