"""DeepSeek-V3.2 (DSA: MLA over the lightning indexer's top-k tokens) against Hugging Face
transformers: greedy generation token for token (batched, chunked prefill, preemption), the
selection really sparse, the indexer's key cache in the pool; MTP with and without index
sharing: greedy output equals plain output, drafts equal cache-free references of both
rules; the Triton backend and bad configs refused."""
from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE, assert_drafts_match_reference, assert_greedy_matches, \
    assert_pool_full, hf_greedy
from moe_utils import YARN, _randomize, add_mtp_layers
from onespec import LLM, MTPConfig, SamplingParams
from onespec.models.deepseek_v3 import DeepseekV3Config
from test_mtp import reference_drafts

NEW_TOKENS = 12
TOPK = 6
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 30, [40, 41],
           list(range(20, 45))]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE_MODES = {"batched": {}, "chunked": {"max_num_tokens": 9},
                "preempt": {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 64}}
FIELDS = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
              topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
              qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16,
              max_position_embeddings=256, rope_parameters=YARN, index_n_heads=8,
              index_head_dim=24, index_topk=TOPK, num_nextn_predict_layers=1,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(path, hf model, greedy references, MTP layer reference); the checkpoint carries one
    MTP layer (with its own indexer) at model.layers.3."""
    import transformers
    path = tmp_path_factory.mktemp("dsv32")
    torch.manual_seed(0)
    hf = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**FIELDS))
    hf = hf.float().eval()
    _randomize(hf, 0)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.indexer.k_norm.bias.normal_(0, 0.1)
    hf.save_pretrained(path)
    mtp = add_mtp_layers(path, hf, 1, family="deepseek_v32")
    return str(path), hf, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS], mtp


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_greedy_matches_transformers(model, mode):
    path, _, refs, _ = model
    assert_greedy_matches(path, refs, PROMPTS, GREEDY, **ENGINE_MODES[mode])


@pytest.mark.parametrize("absorb_max_rows", [0, 1000])
def test_both_attention_forms_match_transformers(model, monkeypatch, absorb_max_rows):
    """Every step expanded over the selection as a mask (0), or every step, prefill too,
    absorbed over the gathered selected latents only (1000)."""
    from onespec.models import deepseek_v3
    path, _, refs, _ = model
    monkeypatch.setattr(deepseek_v3, "ABSORB_MAX_ROWS", absorb_max_rows)
    llm = LLM(path, dtype="float32", device=TEST_DEVICE)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert_pool_full(llm)


def test_prefix_cache_reuses_indexer_keys(model):
    """A prompt whose first blocks are cached attends through the cached indexer keys as
    through freshly computed ones: the same tokens as transformers."""
    path, hf, refs, _ = model
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    llm.generate([PROMPTS[4]], GREEDY)
    prompt = PROMPTS[4][:20] + [7, 9, 11]
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens >= 16
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
    assert_pool_full(llm)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_planted_drafts_verify_as_transformers(model, tmp_path, shape):
    """Drafts planted each step with a known accepted prefix (chain: MTP with K = 3;
    tree: an EAGLE-3 dynamic tree, rows masked to their ancestors, the accepted path's
    latents and indexer keys moved by compact_cache): exactly that prefix is accepted and
    the output equals transformers'."""
    import random

    from conftest import make_eagle3_head
    from onespec import Eagle3Config
    from test_tree import plant_tree
    path, hf, refs, _ = model
    if shape == "tree":
        make_eagle3_head(tmp_path, hf, "safeailab", seed=3, aux_layer_ids=[1, 2, 3])
        spec = Eagle3Config(str(tmp_path), max_draft_len=3, use_dynamic_tree=True,
                            dynamic_tree_max_topK=2, max_total_draft_tokens=6)
    else:
        spec = MTPConfig(num_nextn_predict_layers=3)
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, speculative_config=spec)
    eng, rng = llm.engine, random.Random(0)
    reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
    lengths = set()
    while eng.has_unfinished():
        planned = {}
        for r, want in zip(reqs, refs):
            if r in eng.scheduler.running and not r.in_context:
                truth = want[len(r.output_token_ids):][:3]
                if shape == "tree":
                    r.draft_tokens, r.draft_parents, n = plant_tree(rng, truth, 6, 3, 128)
                else:
                    n = rng.randint(0, len(truth))
                    r.draft_tokens = truth[:n] + [(t + 1) % 128 for t in want[:3 - n]]
                    if n < len(truth):      # the first wrong draft differs from the truth
                        r.draft_tokens[n] = (truth[n] + 1) % 128
                planned[r.request_id] = n, len(r.output_token_ids)
        for r in eng.step():
            if r.request_id in planned and not r.is_finished:
                n, before = planned[r.request_id]
                assert len(r.output_token_ids) - before == n + 1
                lengths.add(n)
    assert [llm.to_output(r).outputs[0].token_ids for r in reqs] == refs
    assert lengths == {0, 1, 2, 3}
    assert_pool_full(llm)


def test_selection_is_sparse(model):
    """Attending to every key instead (top-k past any length) changes the output: the
    agreement above comes from the selection itself."""
    path, _, refs, _ = model
    llm = LLM(path, dtype="float32", device="cpu")
    layers = [layer.self_attn for layer in llm.engine.model.model.layers]
    for a in layers:
        assert a.indexer.topk == TOPK
        a.indexer.topk = 10 ** 6
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert outs != refs


def test_indexer_keys_live_in_the_pool(model):
    """In bfloat16: the indexer's keys beside the latents in the model dtype, its head
    weights float32 (as the checkpoints keep them); MTP runs over them."""
    path, _, _, _ = model
    llm = LLM(path, dtype="bfloat16", device="cpu", num_kv_blocks=20, block_size=4,
              max_model_len=64, speculative_config=MTPConfig(num_nextn_predict_layers=2))
    layers = [layer.self_attn for layer in llm.engine.model.model.layers]
    for a in layers + llm.engine.drafter.attention_layers:
        assert a.index_cache.shape == (21 * 4, 24)        # one scratch block past the pool
        assert a.latent_cache.shape == (21 * 4, 32 + 16)
        assert a.index_cache.dtype == a.latent_cache.dtype == torch.bfloat16
        assert a.cache_bytes_per_token() == (24 + 32 + 16) * 2
        assert a.indexer.weights_proj.weight.dtype == torch.float32
    out = llm.generate([PROMPTS[4]], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == NEW_TOKENS
    assert_pool_full(llm)
    llm.close()
    assert all(a.index_cache is None for a in layers)     # close() drops the pool


def test_triton_backend_refused(model):
    path, _, _, _ = model
    with pytest.raises(ValueError, match="attention_backend='triton' is not available for "
                                         "DeepseekV32ForCausalLM"):
        LLM(path, dtype="float32", device="cpu", attention_backend="triton")


def test_config_errors():
    base = {k: v for k, v in FIELDS.items() if k != "rope_parameters"}
    base["architectures"] = ["DeepseekV32ForCausalLM"]
    assert DeepseekV3Config.from_hf(base).sparse
    with pytest.raises(ValueError, match="'index_topk'"):
        DeepseekV3Config.from_hf({k: v for k, v in base.items() if k != "index_topk"})
    with pytest.raises(ValueError, match="needs 'q_lora_rank'"):
        DeepseekV3Config.from_hf({**base, "q_lora_rank": None})
    with pytest.raises(ValueError, match="'index_head_dim'"):
        DeepseekV3Config.from_hf({**base, "index_head_dim": 8})
    dense = DeepseekV3Config.from_hf({**base, "architectures": ["DeepseekV3ForCausalLM"]})
    assert not dense.sparse


# ---- MTP with and without index sharing ---------------------------------------------------
def mtp_llm(path, k, share, device=TEST_DEVICE, **kw):
    return LLM(path, dtype="float32", device=device, **kw, speculative_config=MTPConfig(
        num_nextn_predict_layers=k, use_index_share=share))


@pytest.mark.parametrize("share,engine_kw", [(True, "batched"), (True, "chunked"),
                                             (True, "preempt"), (False, "batched")])
def test_mtp_greedy_lossless(model, share, engine_kw):
    path, _, refs, _ = model
    llm = mtp_llm(path, 3, share, **ENGINE_MODES[engine_kw])
    assert (llm.engine.drafter.index_share is not None) == share
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.stats()["num_draft_tokens"] > 0
    assert_pool_full(llm)


def shared_reference_drafts(hf, mtp, tokens: list[int], k: int):
    """reference_drafts under the sharing rule: in draft step j >= 1 the last row (the one
    drafting) attends to the keys step 0's last row selected plus every key after it;
    the indexer of the transformers block is wrapped to say so."""
    indexer = mtp.block.self_attn.indexer
    original = indexer.forward
    state = {}

    def forward(*args, **kwargs):
        picked = original(*args, **kwargs)                    # [1, S, k] int32
        s = picked.shape[1]
        if "root" not in state:           # step 0: the row the draft loop continues from
            state["root"] = (s - 1, picked[0, -1].tolist())
            return picked
        root, chosen = state["root"]
        keep = sorted(set(chosen) & set(range(root + 1)) | set(range(root + 1, s)))
        width = max(picked.shape[2], len(keep))
        out = torch.cat([picked, picked[:, :, :1].expand(-1, -1, width - picked.shape[2])], -1)
        out[0, -1] = torch.tensor(keep + keep[:1] * (width - len(keep)))
        return out

    indexer.forward = forward
    try:
        return reference_drafts(hf, mtp, tokens, k)
    finally:
        indexer.forward = original


@pytest.mark.parametrize("share", [True, False])
def test_mtp_drafts_match_cache_free_reference(model, share):
    path, hf, _, mtp = model
    k = 3
    llm = mtp_llm(path, k, share, device="cpu", max_num_tokens=10)
    reference = shared_reference_drafts if share else reference_drafts
    assert_drafts_match_reference(llm, PROMPTS[1:3], SamplingParams(max_tokens=14,
                                                                    ignore_eos=True),
                                  lambda ids: reference(hf, mtp[0], ids, k), k)


def test_index_sharing_changes_drafts(model):
    """The two rules draft differently somewhere once contexts pass top-k (so each
    reference test above checks its own rule)."""
    path, hf, _, mtp = model
    g = torch.Generator().manual_seed(1)
    differ = 0
    for n in (17, 19, 22, 23, 27, 28):
        tokens = torch.randint(3, 128, (n,), generator=g).tolist()
        differ += reference_drafts(hf, mtp[0], tokens, 3)[0] != \
            shared_reference_drafts(hf, mtp[0], tokens, 3)[0]
    assert differ > 0


def test_bench_shape_compares_index_sharing(capsys):
    """`onespec bench --shape tiny-dsa` (the deepseek-v3.2 shape's architecture in
    miniature) runs plain and MTP rows with index sharing off as asked (on is the
    default), and says so in its rows."""
    share = False
    import json

    from onespec.bench import decode
    from onespec.bench.moe import mtp_target_config
    big = mtp_target_config("deepseek-v3.2")
    assert big["architectures"] == ["DeepseekV32ForCausalLM"] and big["hidden_size"] == 7168
    assert big["index_topk"] == 2048 and big["num_nextn_predict_layers"] == 1
    argv = ["--shape", "tiny-dsa", "--device", "cpu", "--dtype", "float32", "--batch-sizes",
            "1", "--ks", "2", "--acceptance", "max", "--gen-len", "6", "--trials", "1",
            "--warmup-steps", "1", "--no-hf", "--prompt-len", "24"]
    assert decode.main(argv + ["--no-mtp-index-share"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["k"] for r in rows} == {0, 2}
    assert all(r["model"] == "tiny-dsa-shape" and r["mtp_index_share"] == share
               and "error" not in r for r in rows)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("share", [None, True, False])
def test_cuda_portable_path_matches_transformers(model, share):
    """On a GPU the default backend for V3.2 is the PyTorch path (auto); plain and MTP
    (index sharing on and off) decoding give transformers' tokens."""
    path, _, refs, _ = model
    spec = None if share is None else MTPConfig(num_nextn_predict_layers=3,
                                                use_index_share=share)
    llm = LLM(path, dtype="float32", device="cuda", speculative_config=spec)
    assert not llm.engine.kernel_settings.triton
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert_pool_full(llm)
