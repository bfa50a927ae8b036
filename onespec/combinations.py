"""The one table of feature combinations: which pairs are refused, and which turn CUDA
graphs off, checked once when a configuration is built.

A feature is named as the user writes it (`use_dynamic_tree=True`, `NGramConfig`,
`tensor_parallel_size > 1`). `features(...)` lists the ones a configuration turns on;
`check_combinations` refuses the first refused pair among them, always in one format:

    use_dynamic_tree=True cannot be combined with use_sa_enhancer=True: the suffix
    automaton replaces chain drafts

The speculative configs check their own pairs in __post_init__; the engine (and so LLM,
the CLI and the server) checks the pairs with the engine's options and the target's
shape before it loads anything; a request with structured_outputs is checked against the
engine's features when it is added. Everything not refused below is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass

# ---- the features (as the user writes them) -------------------------------------------
EAGLE3 = "Eagle3Config"
MTP = "MTPConfig"
DFLASH = "DFlashConfig"
NGRAM = "NGramConfig"
TREE = "use_dynamic_tree=True"
PARALLEL = "parallel_drafting=True"
REJECTION = "use_rejection_sampling=True"
RELAXED = "use_relaxed_acceptance_for_thinking=True"
FORCED = "forced acceptance (force_acceptance_length or force_acceptance_rates)"
FORCED_RATES = "force_acceptance_rates"
SA = "use_sa_enhancer=True"
AUTO = "draft_len_schedule='auto'"
GRAMMAR = "structured_outputs"
TP = "tensor_parallel_size > 1"
ATTN_DP = "enable_attention_dp=True"
TRITON = "attention_backend='triton'"
SLIDING = "a target with a sliding window"
TRITON_NO_TREE_MASKS = "attention_backend='triton' on a target without tree masks (MLA)"
FP8_WEIGHTS = "FP8 weights (quantization='fp8' or an FP8 checkpoint)"
HYBRID = "a hybrid target (recurrent layers)"
HOST_SYNCED_EXPERTS = "a target whose experts sync with the host (Nemotron-H's ungated experts)"
FP8_KV = "kv_cache_dtype='fp8'"
MLA = "an MLA target (latent KV cache: DeepSeek-V3, Kimi, GLM-4.7-Flash)"


@dataclass(frozen=True)
class Refusal:
    a: str
    b: str
    reason: str

    def message(self) -> str:
        return f"{self.a} cannot be combined with {self.b}: {self.reason}"


REFUSED = (
    Refusal(TREE, REJECTION, "sampled requests use exact-match acceptance on the tree"),
    Refusal(TREE, RELAXED, "tree acceptance follows exact matches along one path"),
    Refusal(TREE, AUTO, "the cost model times chains of K drafts"),
    Refusal(TREE, FORCED_RATES, "use force_acceptance_length"),
    Refusal(TREE, SA, "the suffix automaton replaces chain drafts"),
    Refusal(TREE, GRAMMAR, "tree drafts are not grammar-masked; use chain drafting"),
    Refusal(TREE, TP, "tree steps run on one rank"),
    Refusal(TREE, SLIDING, "tree masks assume every key of the request is kept"),
    Refusal(TREE, TRITON_NO_TREE_MASKS, "use_dynamic_tree runs on attention_backend='torch' "
                                        "there"),
    Refusal(PARALLEL, TREE, "one parallel forward proposes one chain of K drafts"),
    Refusal(PARALLEL, TP, "parallel drafting runs on one rank for now"),
    Refusal(DFLASH, TREE, "one block forward proposes one chain of K drafts"),
    Refusal(DFLASH, TP, "DFlash drafting runs on one rank for now"),
    Refusal(DFLASH, SLIDING, "its context attention keeps every key of the request"),
    Refusal(RELAXED, REJECTION, "relaxed acceptance is for greedy requests"),
    Refusal(RELAXED, FORCED, "forced acceptance sets the accepted counts itself"),
    Refusal(REJECTION, FORCED, "forced acceptance sets the accepted counts itself"),
    Refusal(NGRAM, AUTO, "the auto draft length needs a model drafter (Eagle3Config or "
                         "MTPConfig); give NGramConfig a {batch_size: K} dict or None"),
    Refusal(NGRAM, SA, "the n-gram drafter already drafts from the request's own tokens"),
    Refusal(NGRAM, RELAXED, "relaxed acceptance goes with a model drafter"),
    Refusal(AUTO, TP, "its start-up timing runs on one rank; give a {batch_size: K} dict or "
                      "None"),
    Refusal(GRAMMAR, TP, "grammar masks are applied on one rank"),
    Refusal(FP8_WEIGHTS, TP, "FP8 weights are loaded on one rank"),
    Refusal(TREE, HYBRID, "a tree verify would need a recurrent state per tree node; use "
                          "chain drafting"),
    Refusal(HYBRID, TP, "recurrent layers are not split over ranks yet"),
    Refusal(ATTN_DP, EAGLE3, "the EAGLE-3 head's KV is not split over the ranks; use "
                             "MTPConfig or NGramConfig"),
    Refusal(ATTN_DP, TRITON, "each rank finds its requests' rows in the portable backend's "
                             "metadata; use attention_backend='torch'"),
    Refusal(FP8_KV, MLA, "the latent cache is kept in the model's dtype; use "
                         "kv_cache_dtype='auto'"),
)

# features under which the generation step runs eagerly (cuda_graphs is then ignored)
RUNS_EAGERLY = {
    REJECTION: "q of every draft is sampled per request",
    TP: "a replay would have to be mirrored rank by rank",
    HOST_SYNCED_EXPERTS: "its experts' rows are picked on the host",
}


class UnsupportedCombination(ValueError):
    """Two features that do not go together (the message names both)."""


def spec_features(sc) -> set[str]:
    """The features a speculative config (Eagle3Config, DFlashConfig, MTPConfig,
    NGramConfig) turns on."""
    if sc is None:
        return set()
    on = {type(sc).__name__}
    flags = {TREE: "use_dynamic_tree", PARALLEL: "parallel_drafting",
             REJECTION: "use_rejection_sampling",
             RELAXED: "use_relaxed_acceptance_for_thinking", SA: "use_sa_enhancer"}
    on |= {name for name, field in flags.items() if getattr(sc, field, False)}
    if sc.force_acceptance_length is not None or sc.force_acceptance_rates is not None:
        on.add(FORCED)
    if sc.force_acceptance_rates is not None:
        on.add(FORCED_RATES)
    if sc.draft_len_schedule == "auto":
        on.add(AUTO)
    return on


def engine_features(engine_config, target_cls=None, sliding_window=None,
                    fp8_checkpoint: bool = False, recurrent: bool = False,
                    host_synced_experts: bool = False, latent_cache: bool = False) -> set[str]:
    """The features of the engine's options and of the target (its class, its window,
    whether its checkpoint is FP8, whether it has recurrent layers, whether its experts
    sync with the host, whether its layers keep MLA latents)."""
    on = set()
    if getattr(engine_config, "kv_cache_dtype", "auto") == "fp8":
        on.add(FP8_KV)
    if latent_cache:
        on.add(MLA)
    if getattr(engine_config, "quantization", None) is not None or fp8_checkpoint:
        on.add(FP8_WEIGHTS)
    if recurrent or getattr(target_cls, "recurrent", False):
        on.add(HYBRID)
    if host_synced_experts:
        on.add(HOST_SYNCED_EXPERTS)
    if engine_config.tensor_parallel_size > 1:
        on.add(TP)
    if getattr(engine_config, "enable_attention_dp", False):
        on.add(ATTN_DP)
    if engine_config.attention_backend == "triton":
        on.add(TRITON)
    if sliding_window is not None:
        on.add(SLIDING)
    if engine_config.attention_backend == "triton" and target_cls is not None and \
            not getattr(target_cls, "triton_tree_masks", False):
        on.add(TRITON_NO_TREE_MASKS)
    return on


def target_window(model_config) -> int | None:
    """The target's window for SLIDING: the window of every layer (`sliding_window`) or of
    some layers (`layer_window`: gpt-oss alternates sliding and full layers)."""
    return model_config.sliding_window or getattr(model_config, "layer_window", None)


def check_combinations(on: set[str]):
    """Raises UnsupportedCombination for the first refused pair among the features `on`."""
    for refusal in REFUSED:
        if refusal.a in on and refusal.b in on:
            raise UnsupportedCombination(refusal.message())


def graphs_allowed(on: set[str]) -> bool:
    """Whether the generation step may replay CUDA graphs with these features."""
    return not any(name in on for name in RUNS_EAGERLY)
