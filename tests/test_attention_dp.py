"""Attention data parallelism over two gloo ranks on a tiny DeepSeek-V3 (MLA, a dense
layer then MoE layers with a shared expert, an MTP layer): requests of different lengths
are split over the ranks (each keeping its own requests' KV, so the ranks hold different
numbers of requests and the smaller rank's rows are padded), the MoE tensor-parallel; the
greedy tokens equal one rank's, plain and with MTP drafting (lossless); the pool is full
again after each run. Targets it does not support are refused before any rank starts.
One two-rank engine serves the module (spawning ranks is slow)."""
from __future__ import annotations

import pytest

from conftest import assert_pool_full, make_hf_model, step_beside_one_rank
from moe_utils import add_mtp_layers, make_deepseek_model, make_qwen3_moe_model
from onespec import LLM, Eagle3Config, MTPConfig, SamplingParams
from onespec.combinations import UnsupportedCombination
from onespec.config import EngineConfig
from onespec.distributed.attention_dp import DataParallelAttention
from onespec.engine.summary import summary_lines

PROMPTS = [[5, 6, 7], list(range(9, 22)), [3] * 7, [40, 41, 42, 43, 44], [70]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
# per rank: 12 blocks of 4 (three requests on rank 0 must share them)
OPTS = dict(dtype="float32", device="cpu", block_size=4, max_model_len=32, num_kv_blocks=12,
            max_num_tokens=16)
SPEC = MTPConfig(num_nextn_predict_layers=2)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def dp_pair(tmp_path_factory):
    """(checkpoint path, one rank's plain greedy tokens, the attention-DP LLM with MTP)."""
    path = tmp_path_factory.mktemp("attn-dp")
    hf = make_deepseek_model(path, num_layers=2, mtp_layers=1)
    add_mtp_layers(path, hf, 1)
    one = token_ids(LLM(str(path), **OPTS).generate(PROMPTS, GREEDY))
    with LLM(str(path), tensor_parallel_size=2, enable_attention_dp=True,
             speculative_config=SPEC, **OPTS) as llm:
        yield str(path), one, llm


def _run_tracking_ranks(llm):
    """Steps PROMPTS to the end; -> (tokens, the largest number of running requests
    each rank held at once)."""
    eng = llm.engine
    reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
    most = [0, 0]
    while eng.has_unfinished():
        eng.step()
        held = [0, 0]
        for r in reqs:
            if r.block_table:
                held[eng.pool.rank_of(r.block_table)] += 1
        most = [max(a, b) for a, b in zip(most, held)]
    return [r.output_token_ids for r in reqs], most


def test_greedy_equals_one_rank_with_requests_split(dp_pair):
    path, one, llm = dp_pair
    llm.engine.set_draft_len(0)              # plain steps, no drafting
    try:
        got, most = _run_tracking_ranks(llm)
        # one request: on rank 0, rank 1 attends for no row (it sends only padding)
        alone = token_ids(llm.generate([PROMPTS[1]], GREEDY))
    finally:
        llm.engine.set_draft_len(None)
    assert got == one and alone == [one[1]]
    assert min(most) >= 1 and most[0] != most[1], most      # both ranks, unevenly
    assert_pool_full(llm)
    # attention whole on rank 0 (all 4 heads), its cache of its own 12 blocks (+ scratch)
    attn = llm.engine.model.model.layers[0].self_attn
    assert isinstance(attn, DataParallelAttention) and attn.num_heads == 4
    assert attn.latent_cache.shape[0] == (12 + 1) * 4
    assert llm.engine.pool.num_blocks == 2 * 12
    lines = "\n".join(summary_lines(llm.engine))
    assert "attention data-parallel" in lines and "24 blocks of 4 tokens in 2 ranks' pools" \
        in lines and "prefix caching: off" in lines
    # the MoE stays split: half of every expert's rows
    moe = llm.engine.model.model.layers[1].mlp
    assert moe.experts.down_proj.shape[-1] == 32 // 2


def test_mtp_lossless_under_attention_dp(dp_pair):
    """Step by step beside a one-rank MTP engine holding as many blocks as both ranks: the
    same drafts after every step (the MTP layer's attention split by requests too), the
    same target steps, and plain greedy's tokens."""
    path, one, llm = dp_pair
    single = LLM(path, speculative_config=SPEC, **{**OPTS, "num_kv_blocks": 2 * 12})
    llm.engine.reset_stats()
    reqs = step_beside_one_rank(llm, single, PROMPTS, GREEDY)
    assert [r.output_token_ids for r in reqs] == one
    assert_pool_full(llm)


def test_preempted_requests_come_back_on_a_rank(dp_pair):
    """Twice the requests: a rank's pool runs out, requests are preempted and placed again
    (on whichever rank has room then), and the MTP output is still one rank's greedy."""
    path, one, llm = dp_pair
    before = llm.stats()["num_preemptions"]
    assert token_ids(llm.generate(PROMPTS * 2, GREEDY)) == one * 2
    assert llm.stats()["num_preemptions"] > before
    assert_pool_full(llm)


def test_unsupported_targets_and_settings_are_refused(tmp_path):
    make_hf_model(tmp_path, num_layers=1)
    with pytest.raises(ValueError, match=r"enable_attention_dp=True is not supported for "
                                         r"'LlamaForCausalLM'.*DeepseekV3ForCausalLM"):
        LLM(str(tmp_path), tensor_parallel_size=2, enable_attention_dp=True, device="cpu")
    dp = dict(tensor_parallel_size=2, enable_attention_dp=True, device="cpu")
    with pytest.raises(UnsupportedCombination, match=r"enable_attention_dp=True cannot be "
                                                     r"combined with Eagle3Config"):
        LLM(str(tmp_path), speculative_config=Eagle3Config("no-head-needed"), **dp)
    with pytest.raises(UnsupportedCombination, match=r"enable_attention_dp=True cannot be "
                                                     r"combined with attention_backend='triton'"):
        LLM(str(tmp_path), attention_backend="triton", **dp)
    with pytest.raises(ValueError, match=r"needs tensor_parallel_size > 1, got 1"):
        EngineConfig(model="m", enable_attention_dp=True)
    with pytest.raises(ValueError, match="enable_attention_dp must be True or False"):
        EngineConfig(model="m", enable_attention_dp="yes")
    assert EngineConfig(model="m").enable_attention_dp is False


def test_qwen3_moe_greedy_equals_one_rank(tmp_path):
    """GQA attention (q/k norm) split by requests the same way, a dense layer between MoE
    layers tensor-parallel."""
    make_qwen3_moe_model(tmp_path, num_hidden_layers=2)
    prompts = PROMPTS[:3]
    one = token_ids(LLM(str(tmp_path), **OPTS).generate(prompts, GREEDY))
    with LLM(str(tmp_path), tensor_parallel_size=2, enable_attention_dp=True, **OPTS) as llm:
        assert token_ids(llm.generate(prompts, GREEDY)) == one
        assert_pool_full(llm)
        attn = llm.engine.model.model.layers[0].self_attn
        assert isinstance(attn, DataParallelAttention) and attn.num_heads == 4
