"""DFlash block drafters (docs/DECODING.md, "DFlash block drafters"): a checkpoint in
SpecForge's DFlashDraftModel layout, written here by hand, drafts what a cache-free
reference computed from its tensors drafts; one drafter forward a step; greedy output
equal to plain output; sampled output keeps the target's distribution; clear errors."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import TEST_DEVICE, assert_drafts_match_reference, assert_pool_full, \
    assert_schedule_keeps_output, make_hf_model
from onespec import LLM, DFlashConfig, SamplingParams
from onespec.combinations import UnsupportedCombination
from onespec.config import speculative_config_from_dict
from test_parallel_draft import _rms, _rope, assert_lossless_one_forward_per_step, \
    assert_samples_keep_target, token_ids

VOCAB, HIDDEN, LAYERS, BLOCK = 128, 64, 2, 8
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
MASK = 3                         # a token of the target's vocabulary, as published drafters
TARGET_LAYERS = [1, 3]           # outputs of target layers 1 and 3 (of 5)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 30, [40, 41],
           list(range(20, 45))]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def write_dflash_checkpoint(path, seed: int = 3, hidden: int = HIDDEN, vocab: int = VOCAB,
                            **config):
    """A random drafter in the published layout: config.json with architectures
    ['DFlashDraftModel'], Qwen3 layer fields, block_size and dflash_config {mask_token_id,
    target_layer_ids}; weights fc, hidden_norm, norm and layers.{i}.* with q/k norms (no
    embedding, no LM head: the target's)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, scale=0.08: torch.randn(*shape, generator=g) * scale  # noqa: E731
    inter = 2 * hidden + 16
    w = {"fc.weight": rnd(hidden, len(TARGET_LAYERS) * hidden, scale=0.1),
         "hidden_norm.weight": 1 + rnd(hidden, scale=0.1),
         "norm.weight": 1 + rnd(hidden, scale=0.1)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, hidden),
              p + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, hidden),
              p + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, hidden, scale=0.3),
              p + "self_attn.o_proj.weight": rnd(hidden, HEADS * HEAD_DIM),
              p + "self_attn.q_norm.weight": 1 + rnd(HEAD_DIM, scale=0.1),
              p + "self_attn.k_norm.weight": 1 + rnd(HEAD_DIM, scale=0.1),
              p + "mlp.gate_proj.weight": rnd(inter, hidden),
              p + "mlp.up_proj.weight": rnd(inter, hidden),
              p + "mlp.down_proj.weight": rnd(hidden, inter),
              p + "input_layernorm.weight": 1 + rnd(hidden, scale=0.1),
              p + "post_attention_layernorm.weight": 1 + rnd(hidden, scale=0.1)}
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "attention_bias": False,
           "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": LAYERS,
           "num_target_layers": 5, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 256, "vocab_size": vocab, "hidden_act": "silu",
           "tie_word_embeddings": False, "use_sliding_window": False,
           "layer_types": ["full_attention"] * LAYERS, "block_size": BLOCK,
           "dflash_config": {"mask_token_id": MASK, "target_layer_ids": TARGET_LAYERS},
           **config}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tdir = tmp_path_factory.mktemp("target")
    hf = make_hf_model(tdir, "llama", num_layers=5)
    head = write_dflash_checkpoint(tmp_path_factory.mktemp("dflash"))
    plain = LLM(str(tdir), device=TEST_DEVICE, dtype="float32").generate(PROMPTS, GREEDY)
    return str(tdir), hf, head, token_ids(plain)


def dflash_llm(target, head, k=None, device=TEST_DEVICE, spec=None, **kw):
    return LLM(target, device=device, dtype="float32", speculative_config=dict(
        method="dflash", model=head, num_speculative_tokens=k, **(spec or {})), **kw)


@pytest.mark.parametrize("k,engine_kw", [(BLOCK - 1, {}), (3, {"max_num_tokens": 9}),
                                         (1, {"num_kv_blocks": 20, "block_size": 4,
                                              "max_model_len": 64})],
                         ids=["batch-K7", "chunked-K3", "preempt-K1"])
def test_greedy_lossless_one_drafter_forward_per_step(pair, k, engine_kw):
    target, _, head, plain = pair
    llm = dflash_llm(target, head, k, **engine_kw)
    assert_lossless_one_forward_per_step(llm, plain, "num_kv_blocks" in engine_kw)


def test_default_k_is_the_block_and_schedule_cycles(pair):
    """K defaults to block_size - 1; a schedule changing K every step (0 included: the
    context keys are still written) keeps greedy output."""
    target, _, head, plain = pair
    llm = dflash_llm(target, head)
    assert llm.engine.max_draft_len == BLOCK - 1
    assert_schedule_keeps_output(llm, [7, 0, 2, 5, 0, 1], PROMPTS, GREEDY, plain)


def test_suffix_enhancer_over_block_drafts(pair):
    """The suffix automaton replaces block drafts where the request repeats itself."""
    target, _, head, plain = pair
    llm = dflash_llm(target, head, 4, spec=dict(use_sa_enhancer=True))
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
    assert_pool_full(llm)


# ---- drafts against a cache-free reference read from the checkpoint file ----------------
# (_rms and _rope: test_parallel_draft's reference formulas)

@torch.no_grad()
def reference_drafts(hf, w, tokens: list[int], k: int):
    """The drafts after committed `tokens` (the last one not yet verified: the anchor),
    straight from the formulas: context = hidden_norm(fc(target layers' outputs at every
    verified position)); one block [anchor, mask x 7] right after them, whose queries see
    the context's keys and the whole block's; drafts read at block rows 1..k with the
    target's LM head. Returns the drafts and each one's top-2 logit margin."""
    n = len(tokens)
    hs = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1][0] for i in TARGET_LAYERS], -1)            # [n-1, 2H]
    c = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = hf.model.embed_tokens.weight[torch.tensor([tokens[-1]] + [MASK] * (BLOCK - 1))]
    ctx_pos, pos = torch.arange(n - 1), torch.arange(n - 1, n - 1 + BLOCK)
    for i in range(LAYERS):
        p = f"layers.{i}.self_attn."
        proj = lambda name, t, h: (t @ w[p + name].T).view(t.shape[0], h, HEAD_DIM)  # noqa
        xn = _rms(x, w[f"layers.{i}.input_layernorm.weight"])
        q = _rope(_rms(proj("q_proj.weight", xn, HEADS), w[p + "q_norm.weight"]), pos)
        both = torch.cat([c, xn])
        k_ = _rope(_rms(proj("k_proj.weight", both, KV_HEADS), w[p + "k_norm.weight"]),
                   torch.cat([ctx_pos, pos]))
        v = proj("v_proj.weight", both, KV_HEADS)
        k_, v = (t.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1) for t in (k_, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k_, v)     # no mask at all
        x = x + out.transpose(0, 1).reshape(BLOCK, -1) @ w[p + "o_proj.weight"].T
        m = _rms(x, w[f"layers.{i}.post_attention_layernorm.weight"])
        g, u = (m @ w[f"layers.{i}.mlp.{n_}_proj.weight"].T for n_ in ("gate", "up"))
        x = x + (F.silu(g) * u) @ w[f"layers.{i}.mlp.down_proj.weight"].T
    logits = _rms(x[1:k + 1], w["norm.weight"]) @ hf.lm_head.weight.T       # [k, V]
    top = logits.topk(2, -1)
    return top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()


def test_drafts_match_cache_free_reference(pair):
    """Batched, with prompt chunks (max_num_tokens 10) and a prefix-cache hit on the
    second run (the drafter's context keys in cached blocks are what its own would be),
    K = 5 of the block's 7 drafts."""
    target, hf, head, _ = pair
    k = 5
    w = load_file(os.path.join(head, "model.safetensors"))
    llm = dflash_llm(target, head, k, device="cpu", max_num_tokens=10, block_size=4)
    assert llm.engine.drafter.capture_layers == tuple(TARGET_LAYERS)
    ref = lambda ids: reference_drafts(hf, w, ids, k)  # noqa: E731
    assert_drafts_match_reference(llm, PROMPTS[:4], GREEDY, ref, k)
    base = PROMPTS[4]
    assert_drafts_match_reference(llm, [base, base[:13] + [9]], GREEDY, ref, k)
    assert llm.stats()["num_cached_tokens"] >= 12


# ---- sampled output keeps the target's distribution --------------------------------------

SMALL_VOCAB, SAMPLE_PROMPT, NUM_SAMPLES = 6, [3, 1, 4, 1, 5], 2000


def test_rejection_sampling_keeps_target_distribution(tmp_path):
    """Three-token outputs of rejection-sampled block drafts (K = 2) against the exact
    joint distribution from transformers (chi-square), drafts at both positions accepted."""
    hf = make_hf_model(tmp_path / "t", "llama", num_layers=5, vocab_size=SMALL_VOCAB, seed=4)
    head = write_dflash_checkpoint(tmp_path / "h", seed=5, vocab=SMALL_VOCAB)
    llm = dflash_llm(str(tmp_path / "t"), head, 2, device="cpu", max_batch_size=256, seed=11,
                     spec=dict(use_rejection_sampling=True))
    assert_samples_keep_target(llm, hf, SAMPLE_PROMPT, NUM_SAMPLES, SMALL_VOCAB)


# ---- configuration and errors -------------------------------------------------------------

def test_dictionary_form_and_refusals(pair, tmp_path):
    target, _, head, _ = pair
    spec = speculative_config_from_dict({"method": "dflash", "model": head,
                                         "num_speculative_tokens": 4})
    assert isinstance(spec, DFlashConfig) and spec.max_draft_len == 4
    with pytest.raises(ValueError, match="method 'dflash' needs 'model'"):
        speculative_config_from_dict({"method": "dflash", "num_speculative_tokens": 4})
    with pytest.raises(UnsupportedCombination, match="DFlashConfig cannot be combined with "
                                                     "use_dynamic_tree=True"):
        DFlashConfig(head, use_dynamic_tree=True)
    with pytest.raises(UnsupportedCombination, match="tensor_parallel_size"):
        LLM(target, device="cpu", tensor_parallel_size=2,
            speculative_config=DFlashConfig(head, max_draft_len=2))
    with pytest.raises(ValueError, match=r"block_size - 1 \(7\), got 8"):
        dflash_llm(target, head, 8, device="cpu")
    # an EAGLE-3 config pointed at a DFlash drafter names the right config
    from onespec import Eagle3Config
    with pytest.raises(ValueError, match="DFlashConfig"):
        LLM(target, device="cpu", speculative_config=Eagle3Config(head, max_draft_len=2))


@pytest.mark.parametrize("change,message", [
    (dict(block_size=1), "block_size must be an integer >= 2"),
    (dict(dflash_config={"target_layer_ids": [1, 3]}), "mask_token_id is required"),
    (dict(dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 4]}),
     r"must lie in 0 \.\. 3"),
    (dict(dflash_config={"mask_token_id": 500, "target_layer_ids": [1, 3]}),
     "outside the target's vocabulary"),
    (dict(dflash_config={"mask_token_id": 3, "attention_mode": "mla"}),
     "attention_mode='mla' is not supported"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(architectures=["Qwen3ForCausalLM"]), "architectures must hold 'DFlashDraftModel'"),
    (dict(model_type="dspark", markov_rank=8), "DSpark drafters"),
], ids=["block", "no-mask", "layer-ids", "mask-range", "mla", "sliding", "arch", "dspark"])
def test_bad_checkpoints_are_refused(pair, tmp_path, change, message):
    from onespec.models.dflash import load_dflash_head
    from onespec.models.llama import DecoderConfig
    from onespec.models.loader import read_config
    target = DecoderConfig.from_hf(read_config(pair[0]))
    head = write_dflash_checkpoint(tmp_path / "h", **change)
    with pytest.raises(ValueError, match=message):
        load_dflash_head(head, target, "cpu", torch.float32)


def test_default_target_layers_and_own_lm_head(pair, tmp_path):
    """No target_layer_ids: SpecForge's spread over 1 .. L - 3; a checkpoint with its own
    LM head is refused (the layout uses the target's)."""
    from onespec.models.dflash import default_target_layer_ids
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(5, 2) == [1, 2] and default_target_layer_ids(8, 1) == [4]
    target = pair[0]
    head = write_dflash_checkpoint(tmp_path / "h", dflash_config={"mask_token_id": MASK})
    assert dflash_llm(target, head, 2, device="cpu").engine.drafter.capture_layers == (1, 2)
    w = load_file(os.path.join(head, "model.safetensors"))
    w["lm_head.weight"] = torch.zeros(VOCAB, HIDDEN)
    save_file(w, os.path.join(head, "model.safetensors"))
    with pytest.raises(ValueError, match="own lm_head.weight"):
        dflash_llm(target, head, 2, device="cpu")


# ---- the non-causal block on both attention backends ---------------------------------------

@torch.inference_mode()
def test_block_rows_see_their_whole_block_on_both_backends():
    """Block rows whose metadata carries the block's last position see every key up to it
    (their own block's later rows too) and no further, on the PyTorch path and in the
    Triton kernel (its interpreter without CUDA): both equal dense attention over the
    request's keys 0 .. end."""
    pytest.importorskip("triton")
    from onespec.kernels.settings import KernelSettings
    from onespec.layers.attention import metadata_for_rows
    from onespec.layers.ops import TORCH_OPS, make_ops
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    bsz, heads, kv_heads, d, rows = 4, 4, 2, 16, 2       # (the interpreter is slow)
    tables = torch.tensor([[3, 0, 5, 7, 1], [2, 6, 4, 8, 9]], device=dev)
    kc = torch.randn(10 * bsz, kv_heads, d, generator=g).to(dev)
    vc = torch.randn(10 * bsz, kv_heads, d, generator=g).to(dev)
    ends = [13, 9]                              # each request's block: end - 1 .. end
    q = torch.randn(2 * rows, heads, d, generator=g).to(dev)
    req = torch.arange(2, device=dev).repeat_interleave(rows)
    seen = torch.tensor(ends, device=dev).repeat_interleave(rows)
    idx = torch.arange(rows, device=dev).repeat(2)
    outs = []
    for backend, ops in (("torch", TORCH_OPS), ("triton", make_ops(KernelSettings(True)))):
        meta = metadata_for_rows(tables, req, idx, seen, bsz, rows, max(ends) + 1, None,
                                 backend)
        outs.append(ops.cached_attention(q, kc, vc, meta, d ** -0.5).float())
    for r, end in enumerate(ends):
        pos = torch.arange(end + 1, device=dev)
        slots = tables[r, pos // bsz] * bsz + pos % bsz
        k, v = (c[slots].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
                for c in (kc, vc))
        want = F.scaled_dot_product_attention(q[r * rows:(r + 1) * rows].transpose(0, 1), k, v,
                                              scale=d ** -0.5).transpose(0, 1)
        for out in outs:
            torch.testing.assert_close(out[r * rows:(r + 1) * rows], want, atol=2e-5,
                                       rtol=2e-5)
