"""Engine and speculative-decoding configuration, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass

from onespec.combinations import DFLASH, TREE, check_combinations, spec_features
from onespec.quant.kv_fp8 import check_kv_cache_dtype

DTYPES = ("auto", "float32", "bfloat16", "float16")
# what weights may be quantized to at load (quant/fp8.py): None keeps the checkpoint's
QUANTIZATIONS = ("fp8",)
# a drafter's weights: a dtype, or "fp8" (e4m3 weights per output channel, computing in
# the target's dtype)
DRAFT_DTYPES = DTYPES + ("fp8",)
LOAD_FORMATS = ("auto", "dummy")
AUTO_DRAFT_LEN = "auto"      # draft_len_schedule chosen per step by the cost model


def _check_int(name: str, value, low: int, high: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {rng}, got {value!r}")


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_num_tokens: int = 2048        # tokens per engine step (chunked prefill budget)
    max_batch_size: int = 64          # requests per step
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # default: from kv_cache_memory_fraction
    block_size: int = 16
    kv_cache_memory_fraction: float = 0.85
    seed: int = 0
    load_format: str = "auto"          # "dummy": random weights from config.json (benchmarks)
    # "torch" (portable) | "triton" (Triton attention, plus fused Triton linear, norm and
    # rotary kernels for decode-sized batches); auto = triton on CUDA
    attention_backend: str = "auto"
    cuda_graphs: bool = True           # graph the generation step (CUDA + triton only)
    # launch graph step n+1 before reading step n's results (engine.Engine.step)
    overlap_scheduler: bool = True
    # the Triton kernels with programmatic dependent launch where the GPU has it (Hopper+)
    programmatic_launch: bool = True
    # reuse the KV of full blocks of earlier prompts and outputs (engine/prefix_cache.py)
    enable_prefix_caching: bool = True
    # ranks the target is split over (torch.distributed: NCCL on CUDA, gloo on the CPU)
    tensor_parallel_size: int = 1
    # attention data-parallel over the tensor-parallel ranks (TensorRT-LLM's name): each
    # rank attends for its own requests and keeps their KV (num_kv_blocks: per rank), the
    # MoE / dense layers tensor-parallel (distributed/attention_dp.py, docs/SCALING.md)
    enable_attention_dp: bool = False
    # "fp8": quantize a bf16/fp32 checkpoint's linears and experts to e4m3 per output
    # channel at load (an FP8 checkpoint loads as it is quantized either way)
    quantization: str | None = None
    # the paged KV cache's dtype: "auto" (the model's) or "fp8" (e4m3 with per-tensor k
    # and v scales per layer, from the checkpoint or 1.0; quant/kv_fp8.py), as vLLM spells it
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check_int("max_num_tokens", self.max_num_tokens, 1)
        _check_int("max_batch_size", self.max_batch_size, 1)
        _check_int("max_model_len", self.max_model_len, 2, allow_none=True)
        _check_int("num_kv_blocks", self.num_kv_blocks, 1, allow_none=True)
        _check_int("block_size", self.block_size, 1, 4096)
        _check_int("seed", self.seed, 0)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 64)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got "
                             f"{self.quantization!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("attention_backend must be 'auto', 'torch' or 'triton', "
                             f"got {self.attention_backend!r}")
        for name in ("cuda_graphs", "overlap_scheduler", "programmatic_launch",
                     "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.enable_attention_dp, bool):
            raise ValueError(f"enable_attention_dp must be True or False, got "
                             f"{self.enable_attention_dp!r}")
        if self.enable_attention_dp and self.tensor_parallel_size < 2:
            raise ValueError("enable_attention_dp=True splits requests over the tensor-"
                             "parallel ranks: it needs tensor_parallel_size > 1, got "
                             f"{self.tensor_parallel_size}")
        if not (0.0 < self.kv_cache_memory_fraction <= 1.0):
            raise ValueError("kv_cache_memory_fraction must be in (0, 1], "
                             f"got {self.kv_cache_memory_fraction!r}")


def _check_drafting_options(cfg):
    """Validates the options every drafter shares (schedule, gate, forced acceptance)."""
    if cfg.draft_len_schedule is not None and cfg.max_concurrency is not None:
        raise ValueError("set draft_len_schedule or max_concurrency, not both")
    if cfg.max_concurrency is not None:
        _check_int("max_concurrency", cfg.max_concurrency, 1)
        cfg.draft_len_schedule = {cfg.max_concurrency: cfg.max_draft_len}
    if isinstance(cfg.draft_len_schedule, str):
        if cfg.draft_len_schedule != AUTO_DRAFT_LEN:
            raise ValueError(f"draft_len_schedule must be a {{batch_size: K}} dict or "
                             f"{AUTO_DRAFT_LEN!r}, got {cfg.draft_len_schedule!r}")
    elif cfg.draft_len_schedule is not None:
        if not isinstance(cfg.draft_len_schedule, dict) or not cfg.draft_len_schedule:
            raise ValueError("draft_len_schedule must be a non-empty {batch_size: K} dict "
                             f"or {AUTO_DRAFT_LEN!r}")
        sched = {}
        for bs, k in cfg.draft_len_schedule.items():
            if isinstance(bs, str) and bs.isdigit():      # JSON object keys are strings
                bs = int(bs)
            _check_int("draft_len_schedule key (batch size)", bs, 1)
            _check_int("draft_len_schedule value (draft length)", k, 0, cfg.max_draft_len)
            sched[bs] = k
        cfg.draft_len_schedule = dict(sorted(sched.items()))
    if (cfg.acceptance_window is None) != (cfg.acceptance_length_threshold is None):
        raise ValueError("acceptance_window and acceptance_length_threshold go together")
    if cfg.acceptance_window is not None:
        _check_int("acceptance_window", cfg.acceptance_window, 1)
        if not (cfg.acceptance_length_threshold >= 0.0):
            raise ValueError("acceptance_length_threshold must be >= 0, "
                             f"got {cfg.acceptance_length_threshold!r}")
    if cfg.force_acceptance_length is not None:
        a = cfg.force_acceptance_length
        if not (1.0 <= a <= cfg.max_draft_len + 1):
            raise ValueError("force_acceptance_length must be in "
                             f"[1, max_draft_len + 1 = {cfg.max_draft_len + 1}], got {a!r}")
    if cfg.force_acceptance_rates is not None:
        _check_acceptance_rates(cfg)


def _check_acceptance_rates(cfg):
    if cfg.force_acceptance_length is not None:
        raise ValueError("set force_acceptance_length or force_acceptance_rates, not both")
    rates = cfg.force_acceptance_rates
    if isinstance(rates, (str, bytes)) or not hasattr(rates, "__len__"):
        raise ValueError(f"force_acceptance_rates must be a sequence of numbers, got {rates!r}")
    cfg.force_acceptance_rates = rates = tuple(rates)
    if len(rates) < max(cfg.max_draft_len, 1):
        raise ValueError(f"force_acceptance_rates needs a rate for each of the "
                         f"max_draft_len = {cfg.max_draft_len} draft positions, got {len(rates)}")
    if not all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0.0 <= a <= 1.0
               for a in rates):
        raise ValueError(f"force_acceptance_rates must each be in [0, 1], got {rates!r}")


def _check_bools(cfg, *names: str):
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(cfg, name)!r}")


def _check_relaxed_options(cfg):
    """Relaxed acceptance inside a thinking phase (docs/DECODING.md, "Acceptance")."""
    _check_int("relaxed_topk", cfg.relaxed_topk, 1, 64)
    if not (isinstance(cfg.relaxed_delta, (int, float)) and 0.0 <= cfg.relaxed_delta <= 1.0):
        raise ValueError(f"relaxed_delta must be a number in [0, 1], got {cfg.relaxed_delta!r}")
    _check_int("begin_thinking_phase_token", cfg.begin_thinking_phase_token, 0, allow_none=True)
    _check_int("end_thinking_phase_token", cfg.end_thinking_phase_token, 0, allow_none=True)
    if cfg.use_relaxed_acceptance_for_thinking and cfg.begin_thinking_phase_token is None:
        raise ValueError("use_relaxed_acceptance_for_thinking needs "
                         "begin_thinking_phase_token (and usually end_thinking_phase_token)")


def _check_tree_options(cfg):
    """Validates a dynamic tree's shape (the features it cannot combine with are in
    combinations.py)."""
    _check_int("max_draft_len (the tree's depth)", cfg.max_draft_len, 1, 32)
    _check_int("dynamic_tree_max_topK", cfg.dynamic_tree_max_topK, 1, 16)
    top_k, depth = cfg.dynamic_tree_max_topK, cfg.max_draft_len
    most = top_k + (depth - 1) * top_k * top_k     # every node the expansion scores
    if cfg.max_total_draft_tokens is None:
        cfg.max_total_draft_tokens = top_k * depth
    _check_int("max_total_draft_tokens", cfg.max_total_draft_tokens, depth, most)
    schedule = cfg.draft_len_schedule if isinstance(cfg.draft_len_schedule, dict) else {}
    if any(k not in (0, depth) for k in schedule.values()):
        raise ValueError("with use_dynamic_tree, draft_len_schedule values must be 0 or "
                         f"max_draft_len = {depth} (a step drafts the whole tree or nothing)")


@dataclass(kw_only=True)
class SpeculativeConfig:
    """The options every drafter shares: when to draft (draft_len_schedule,
    max_concurrency, the acceptance gate), how drafts are accepted (rejection sampling,
    relaxed acceptance inside a thinking phase, forced acceptance for benchmarks) and the
    suffix-automaton enhancer. Subclasses add their drafter's own fields and define
    max_draft_len; combinations.py says which options go together."""
    draft_len_schedule: dict[int, int] | str | None = None   # {batch_size: K} | "auto"
    max_concurrency: int | None = None                 # == {N: max_draft_len}
    use_rejection_sampling: bool = False
    acceptance_window: int | None = None
    acceptance_length_threshold: float | None = None
    force_acceptance_length: float | None = None       # benchmarks only (tokens per step)
    # benchmarks only: conditional acceptance rate of each draft position
    force_acceptance_rates: tuple[float, ...] | None = None
    # relaxed acceptance inside a thinking phase (docs/DECODING.md, "Acceptance"; lossy,
    # greedy requests only): a draft in the target's top relaxed_topk within relaxed_delta
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: int = 1
    relaxed_delta: float = 0.0
    begin_thinking_phase_token: int | None = None
    end_thinking_phase_token: int | None = None
    # suffix-automaton enhancer: drafts from the request's own earlier tokens replace the
    # model's when the current suffix occurred before with at least sa_min_match_len tokens
    use_sa_enhancer: bool = False
    sa_min_match_len: int = 4

    def __post_init__(self):
        self._check_own()
        _check_bools(self, "use_rejection_sampling", "use_relaxed_acceptance_for_thinking",
                     "use_sa_enhancer")
        _check_drafting_options(self)
        _check_relaxed_options(self)
        _check_int("sa_min_match_len", self.sa_min_match_len, 1)
        if getattr(self, "use_dynamic_tree", False):
            _check_tree_options(self)
        check_combinations(spec_features(self))

    def _check_own(self):
        """The drafter's own fields (each subclass)."""
        raise NotImplementedError

    @property
    def is_forced(self) -> bool:
        return self.force_acceptance_length is not None or self.force_acceptance_rates is not None


@dataclass
class Eagle3Config(SpeculativeConfig):
    """One-model EAGLE-3 drafting (docs/DECODING.md, "EAGLE-3 head", "around the loop")."""
    draft_model: str
    max_draft_len: int = 3
    layers_to_capture: tuple[int, ...] | None = None   # outputs-of layer ids; None = head/default
    draft_dtype: str = "auto"      # head precision; auto = the target's; "fp8": e4m3 weights
    # dynamic tree (docs/DECODING.md, "dynamic trees"): max_draft_len is the tree's depth
    use_dynamic_tree: bool = False
    dynamic_tree_max_topK: int = 4                     # frontier width and children per node
    max_total_draft_tokens: int | None = None          # nodes verified; None = topK * depth
    # one head forward proposes all K drafts (P-EAGLE heads: docs/DECODING.md, "Parallel
    # drafting"); vLLM's {"method": "eagle3", "parallel_drafting": true}
    parallel_drafting: bool = False

    def _check_own(self):
        if not isinstance(self.draft_model, str) or not self.draft_model:
            raise ValueError("draft_model must be a path to an EAGLE-3 head directory")
        _check_int("max_draft_len", self.max_draft_len, 0, 32)
        if self.layers_to_capture is not None:
            self.layers_to_capture = tuple(self.layers_to_capture)
            if len(self.layers_to_capture) == 0 or not all(
                    isinstance(i, int) and i >= 0 for i in self.layers_to_capture):
                raise ValueError("layers_to_capture must be a non-empty tuple of layer ids >= 0, "
                                 f"got {self.layers_to_capture!r}")
        _check_bools(self, "use_dynamic_tree", "parallel_drafting")
        if self.draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"draft_dtype must be one of {DRAFT_DTYPES}, "
                             f"got {self.draft_dtype!r}")


@dataclass
class DFlashConfig(SpeculativeConfig):
    """DFlash block drafting (docs/DECODING.md, "DFlash block drafters"): one forward of a
    SpecForge-layout block drafter proposes max_draft_len drafts; the dictionary form is
    {"method": "dflash", "model": DIR, "num_speculative_tokens": K} (SGLang's algorithm
    "DFLASH"). K defaults to the drafter's block_size - 1, its most."""
    draft_model: str
    max_draft_len: int | None = None
    draft_dtype: str = "auto"      # drafter precision; auto = the target's
    use_dynamic_tree: bool = False     # (refused: combinations.py)

    def _check_own(self):
        if not isinstance(self.draft_model, str) or not self.draft_model:
            raise ValueError("draft_model must be a path to a DFlash drafter directory")
        _check_bools(self, "use_dynamic_tree")
        if self.use_dynamic_tree:
            check_combinations({DFLASH, TREE})
        if self.max_draft_len is None:
            from onespec.models.dflash import DFlashHeadConfig
            from onespec.models.loader import read_config
            self.max_draft_len = DFlashHeadConfig.from_hf(
                read_config(self.draft_model)).block_size - 1
        _check_int("max_draft_len", self.max_draft_len, 0, 64)
        if self.draft_dtype not in DTYPES:
            raise ValueError(f"draft_dtype must be one of {DTYPES} for DFlash drafters, "
                             f"got {self.draft_dtype!r}")


@dataclass
class MTPConfig(SpeculativeConfig):
    """Drafting with the target's own multi-token-prediction layers (docs/DECODING.md, "MTP")."""
    num_nextn_predict_layers: int = 1      # K: drafts per step
    use_mtp_vanilla: bool = False          # layer i drafts token i (else layer 0, K times)
    draft_dtype: str = "auto"              # "auto": as the checkpoint; "fp8": e4m3 weights
    # DeepSeek-V3.2 (sparse attention): draft steps after the first reuse its indexer
    # selection instead of scoring again (docs/DECODING.md); no effect on dense targets
    use_index_share: bool = True

    @property
    def max_draft_len(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def num_mtp_layers(self) -> int:
        """MTP layers read from the checkpoint."""
        return self.num_nextn_predict_layers if self.use_mtp_vanilla else 1

    def _check_own(self):
        _check_int("num_nextn_predict_layers", self.num_nextn_predict_layers, 1, 32)
        _check_bools(self, "use_mtp_vanilla", "use_index_share")
        if self.draft_dtype not in ("auto", "fp8"):
            raise ValueError(f"draft_dtype must be 'auto' or 'fp8' for MTP layers (they run "
                             f"in the target's dtype), got {self.draft_dtype!r}")


@dataclass
class NGramConfig(SpeculativeConfig):
    """Model-free drafting by prompt lookup, for any target (docs/DECODING.md, "model-free
    drafts"): the tokens that followed the latest earlier occurrence of the longest
    matching n-gram of the request's tokens, n from max_matching_ngram_size down to
    min_matching_ngram_size. (Rejection sampling sees its drafts' q as one-hot.)"""
    max_draft_len: int = 3
    max_matching_ngram_size: int = 3
    min_matching_ngram_size: int = 1

    def _check_own(self):
        _check_int("max_draft_len", self.max_draft_len, 1, 32)
        _check_int("min_matching_ngram_size", self.min_matching_ngram_size, 1, 64)
        _check_int("max_matching_ngram_size", self.max_matching_ngram_size,
                   self.min_matching_ngram_size, 64)


# vLLM's speculative_config dictionary: {"method", "model", "num_speculative_tokens", ...}
SPEC_METHODS = {"eagle3": Eagle3Config, "mtp": MTPConfig, "ngram": NGramConfig,
                "dflash": DFlashConfig}
# vLLM's key -> the typed config's field, per method (every typed field is accepted too)
VLLM_KEYS = {
    "eagle3": {"model": "draft_model", "num_speculative_tokens": "max_draft_len"},
    "dflash": {"model": "draft_model", "num_speculative_tokens": "max_draft_len"},
    "mtp": {"num_speculative_tokens": "num_nextn_predict_layers"},
    "ngram": {"num_speculative_tokens": "max_draft_len",
              "prompt_lookup_max": "max_matching_ngram_size",
              "prompt_lookup_min": "min_matching_ngram_size"},
}


def speculative_config_from_dict(spec: dict) -> SpeculativeConfig:
    """The typed config of a vLLM-style dictionary, e.g. {"method": "eagle3", "model": PATH,
    "num_speculative_tokens": 3}. Besides vLLM's keys, the typed config's own field names
    are accepted (e.g. "use_dynamic_tree"); any other key is refused by name."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict or a config object, got {spec!r}")
    method = spec.get("method")
    if method not in SPEC_METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {sorted(SPEC_METHODS)}, "
                         f"got {method!r}")
    cls, renames = SPEC_METHODS[method], VLLM_KEYS[method]
    fields = {name for name, f in cls.__dataclass_fields__.items() if f.init}
    kwargs = {}
    for key, value in spec.items():
        if key == "method":
            continue
        if method == "mtp" and key == "model" and value is None:
            continue        # (vLLM's MTP reads its layers from the target too)
        name = renames.get(key, key)
        if name not in fields:
            allowed = sorted(set(renames) | fields)
            raise ValueError(f"speculative_config key {key!r} is not known for method "
                             f"{method!r}; allowed keys: method, {', '.join(allowed)}")
        if name in kwargs:
            raise ValueError(f"speculative_config gives {name} twice ({key!r} and its other "
                             "name): pass one")
        kwargs[name] = value
    if cls in (Eagle3Config, DFlashConfig) and "draft_model" not in kwargs:
        what = "EAGLE-3 head" if cls is Eagle3Config else "DFlash drafter"
        raise ValueError(f"speculative_config with method {method!r} needs 'model': the "
                         f"{what} directory")
    return cls(**kwargs)


def as_speculative_config(spec) -> SpeculativeConfig | None:
    """None, a typed config as it is, or a vLLM-style dictionary mapped onto its config."""
    if spec is None or isinstance(spec, SpeculativeConfig):
        return spec
    return speculative_config_from_dict(spec)
