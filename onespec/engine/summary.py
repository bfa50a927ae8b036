"""What a built engine is: the lines logged when it starts (LLM construction, `onespec
serve`), so an operator sees the model, drafter, K, KV pool and graphs without reading
the code."""
from __future__ import annotations

import importlib.util

from onespec.config import AUTO_DRAFT_LEN, DFlashConfig, Eagle3Config, MTPConfig, NGramConfig
from onespec.engine.kv_cache import kv_bytes_per_block, target_attention_layers
from onespec.engine.state_pool import state_bytes


def describe_drafter(sc, max_draft_len: int) -> str:
    """'EAGLE-3 head DIR, K = 3' and the options that change what a step does."""
    if sc is None:
        return "none (plain decoding, K = 0)"
    if isinstance(sc, Eagle3Config):
        text = f"EAGLE-3 head {sc.draft_model}, K = {max_draft_len}"
        if sc.use_dynamic_tree:
            text += (f" (dynamic tree: depth {sc.max_draft_len}, top-{sc.dynamic_tree_max_topK}"
                     f", {sc.max_total_draft_tokens} nodes verified)")
    elif isinstance(sc, DFlashConfig):
        text = f"DFlash block drafter {sc.draft_model}, K = {max_draft_len}"
    elif isinstance(sc, MTPConfig):
        kind = "vanilla, one layer per draft" if sc.use_mtp_vanilla else "one layer, repeated"
        text = f"MTP ({kind}), K = {max_draft_len}"
    elif isinstance(sc, NGramConfig):
        text = (f"n-gram prompt lookup (n = {sc.min_matching_ngram_size}.."
                f"{sc.max_matching_ngram_size}), K = {max_draft_len}")
    else:
        text = f"{type(sc).__name__}, K = {max_draft_len}"
    schedule = sc.draft_len_schedule
    if schedule == AUTO_DRAFT_LEN:
        text += "; draft length chosen per step (auto, cost model)"
    elif schedule:
        text += f"; draft length by batch size {schedule}"
    text += "; rejection sampling" if sc.use_rejection_sampling else ""
    text += "; suffix-automaton enhancer" if getattr(sc, "use_sa_enhancer", False) else ""
    return text


def _bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def summary_lines(engine) -> list[str]:
    """The engine's start-up summary, one topic a line."""
    cfg, mcfg = engine.config, engine.model.config
    arch = type(engine.model).__name__
    draft_layers = engine.drafter.attention_layers if engine.drafter else []
    layers = target_attention_layers(engine.model) + list(draft_layers)
    per_block = kv_bytes_per_block(layers, cfg.block_size)
    num_blocks = engine.pool.num_blocks
    graphs = engine.runner.graphs
    if graphs is not None:
        ks = sorted({k for _, k, _ in graphs.graphs})
        graph_text = f"batch buckets {graphs.buckets}, K {ks}"
    else:
        graph_text = "off (" + ("not on CUDA" if engine.device.type != "cuda" else
                                "eager: rejection sampling, several ranks, a hybrid target "
                                "or cuda_graphs=False") + ")"
    if engine.tokenizer is None:
        structured = "off (the model has no tokenizer)"
    elif importlib.util.find_spec("xgrammar") is None:
        structured = "off (xgrammar is not installed)"
    else:
        structured = "xgrammar" + (" (chain drafts only: refused with dynamic trees)"
                                   if engine.tree is not None else "")
    ranks = engine.parallel.world_size if engine.parallel else 1
    return [
        f"model {cfg.model}: {arch}, {mcfg.num_hidden_layers} layers, vocabulary "
        f"{mcfg.vocab_size}, {str(engine.dtype).removeprefix('torch.')} on {engine.device}"
        + (f", tensor parallel over {ranks} ranks" if ranks > 1 else "")
        + (" (attention data-parallel: each rank attends for its own requests)"
           if cfg.enable_attention_dp else ""),
        f"drafter: {describe_drafter(engine.spec_config, engine.max_draft_len)}",
        f"KV cache: {num_blocks} blocks of {cfg.block_size} tokens "
        + (f"in {ranks} ranks' pools " if cfg.enable_attention_dp else "")
        + f"({num_blocks * cfg.block_size} tokens, {_bytes(num_blocks * per_block)}"
        + (", pages taken as blocks are written" if engine.device.type == "cpu" else "")
        + (", e4m3 with per-layer k/v scales" if cfg.kv_cache_dtype == "fp8" else "")
        + f"); max_model_len {engine.max_model_len}, max_batch_size {cfg.max_batch_size}, "
        f"max_num_tokens {cfg.max_num_tokens}",
        f"attention: {'triton' if engine.kernel_settings.triton else 'torch'}; "
        f"CUDA graphs: {graph_text}",
        f"prefix caching: {'on' if engine.pool.cache is not None else 'off'}"
        + (" (a hybrid target)" if engine.states is not None else "")
        + f"; structured outputs: {structured}",
    ] + ([_state_line(engine)] if engine.states is not None else [])


def _state_line(engine) -> str:
    """A hybrid target's recurrent-state pool (engine/state_pool.py)."""
    states = engine.states
    per = state_bytes(states.layers, engine.dtype)
    rows = next(iter(states.layers[0].snapshots.values())).shape[0] if states.layers else 0
    return (f"recurrent state: {len(states.layers)} layers, {states.num_slots} slots of "
            f"{_bytes(per)} and {rows} snapshot rows ({_bytes(per * (states.num_slots + rows))})")
