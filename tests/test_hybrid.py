"""Hybrid targets (gated DeltaNet: Qwen3-Next, Qwen3.5 dense and MoE; Mamba2: Nemotron-H): token for token equal
to transformers (batched, chunked prefill, preemption); the recurrent-state pool full again
after every exit path; speculation lossless (MTP, EAGLE-3, n-gram), with every committed
state equal to the one plain decoding reaches at the same position; MTP drafts equal a
cache-free reference; sampled speculation keeps the target's distribution."""
from __future__ import annotations

import logging

import pytest
import torch

from conftest import TEST_DEVICE, assert_pool_full, hf_greedy, make_eagle3_head
from hybrid_utils import HYBRID_ARCHS, make_hybrid_model, make_nemotron_h_model, mtp_weights
from onespec import LLM, Eagle3Config, MTPConfig, NGramConfig, SamplingParams
from onespec.combinations import UnsupportedCombination
from onespec.layers.recurrent import causal_conv, gated_delta_scan
from onespec.models.qwen3_next import HybridConfig
from test_spec_sampling import chi_square_pvalue

PROMPTS = [[5, 17, 33, 9, 60, 3, 44], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 90, 91],
           [100, 3]]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE_MODES = {
    "batched": dict(),
    "chunked-prefill": dict(max_num_tokens=5),
    "preemption": dict(block_size=4, max_model_len=32, num_kv_blocks=12),
}


ARCHS = list(HYBRID_ARCHS) + ["nemotron-h"]
MLP_KINDS = {"qwen3-next": ["SharedExpertMoe", "MLP"] + ["SharedExpertMoe"] * 2,
             "qwen3.5": ["MLP"] * 4, "qwen3.5-moe": ["SharedExpertMoe"] * 4}


def assert_states_free(llm):
    """The KV pool and the recurrent-state pool are full again."""
    assert_pool_full(llm)
    states = llm.engine.states
    assert states.num_free == states.num_slots
    assert sorted(states.free_slots) == list(range(states.num_slots))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{arch: (path, hf model, greedy references)}; qwen3-next carries an MTP module."""
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(arch)
        hf = make_nemotron_h_model(path) if arch == "nemotron-h" else \
            make_hybrid_model(path, arch, mtp=arch == "qwen3-next")
        out[arch] = (str(path), hf, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS])
    return out


def llm_for(path, device=TEST_DEVICE, **kw):
    """On ONESPEC_TEST_DEVICE (a GPU runs the verify rows' Triton recurrences)."""
    return LLM(path, dtype="float32", device=device, **kw)


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(models, arch, mode):
    path, hf, refs = models[arch]
    llm = llm_for(path, **ENGINE_MODES[mode])
    layers = llm.engine.model.model.layers
    if arch == "nemotron-h":
        assert [b.block_type for b in layers] == list(hf.config.layers_block_type)
    else:
        assert [type(layer.mlp).__name__ for layer in layers] == MLP_KINDS[arch]
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    if mode == "preemption":
        assert llm.stats()["num_preemptions"] > 0
    assert llm.engine.pool.cache is None          # prefix caching is off for hybrids
    # generation steps replay CUDA graphs on a GPU but Nemotron-H's (host-synced experts)
    assert llm.engine.uses_cuda_graphs == (TEST_DEVICE == "cuda" and arch != "nemotron-h")
    assert_states_free(llm)


@torch.no_grad()
def test_prefill_logits_match_transformers(models):
    path, hf, _ = models["qwen3.5-moe"]
    llm = llm_for(path)
    prompt = PROMPTS[1]
    req = llm.engine.add_request(prompt, SamplingParams(max_tokens=2, logprobs=5))
    llm.engine.step()
    ref = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    top = ref.topk(5)
    got = req.logprobs[0]
    assert set(got) >= set(top.indices.tolist())
    for tok, lp in zip(top.indices.tolist(), top.values.tolist()):
        assert abs(got[tok].logprob - lp) < 1e-4
    llm.engine.abort(req.request_id)
    assert_states_free(llm)


def test_state_pool_full_after_every_exit(models):
    """Finish, abort while running, abort while waiting, and the error exit."""
    path, _, _ = models["qwen3-next"]
    llm = llm_for(path, max_batch_size=2)
    eng = llm.engine
    assert eng.states.num_slots == 2
    from onespec.engine.summary import summary_lines
    assert any(line.startswith("recurrent state: 3 layers, 2 slots")
               for line in summary_lines(eng))
    reqs = [eng.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
            for p in PROMPTS + [[21, 22, 23]]]
    eng.step()                    # two admitted (one slot each), two waiting
    assert eng.states.num_free == 0
    assert [r.state_slot is not None for r in reqs] == [True, True, False, False]
    eng.abort(reqs[0].request_id)                       # running
    eng.abort(reqs[3].request_id)                       # waiting
    assert eng.states.num_free == 1
    eng.step()                                          # reqs[2] takes the freed slot
    eng._fail_request(reqs[2], RuntimeError("a failing step"))   # the error exit
    while eng.has_unfinished():
        eng.step()
    assert reqs[1].finish_reason == "length" and reqs[2].finish_reason == "error"
    assert all(r.state_slot is None for r in reqs)
    assert_states_free(llm)


SPEC_CONFIGS = {        # (model, config); the looping model's outputs soon cycle, so
    "mtp-k1": ("qwen3-next", lambda head: MTPConfig(num_nextn_predict_layers=1)),
    "mtp-k3": ("qwen3-next", lambda head: MTPConfig(num_nextn_predict_layers=3)),
    "eagle3-k3": ("qwen3-next", lambda head: Eagle3Config(head, max_draft_len=3)),
    "ngram-k3": ("looping", lambda head: NGramConfig(max_draft_len=3)),  # n-gram drafts hit
    "nemotron-eagle3-k2": ("nemotron-h", lambda head: Eagle3Config(head, max_draft_len=2)),
    "nemotron-ngram-k3": ("nemotron-looping", lambda head: NGramConfig(max_draft_len=3)),
}
LOOP_PROMPTS = [[5, 17, 3, 9, 6, 3, 4], [7, 8, 9, 10, 11, 12, 13, 14, 15, 1, 2, 9, 9], [10, 3],
                [1, 2, 3, 1, 2, 3, 1, 2]]


@pytest.fixture(scope="module")
def eagle_heads(models, tmp_path_factory):
    """{model: an EAGLE-3 head for it}."""
    out = {}
    for arch in ("qwen3-next", "nemotron-h"):
        path = tmp_path_factory.mktemp(f"{arch}-eagle3")
        make_eagle3_head(path, models[arch][1])
        out[arch] = str(path)
    return out


@pytest.fixture(scope="module")
def plain_runs(models, tmp_path_factory):
    """{model: (path, prompts, params, plain greedy outputs, every recurrent layer's state
    per (prompt, number of tokens with state))}, plain decoding run step by step."""
    loop = tmp_path_factory.mktemp("looping")
    make_hybrid_model(loop, "qwen3-next", vocab_size=24, embed_scale=10.0)
    nloop = tmp_path_factory.mktemp("nemotron-looping")
    make_nemotron_h_model(nloop, vocab_size=24, embed_scale=10.0)
    runs = {}
    longer = SamplingParams(max_tokens=24, ignore_eos=True)
    for name, path, prompts, params in [
            ("qwen3-next", models["qwen3-next"][0], PROMPTS, GREEDY),
            ("nemotron-h", models["nemotron-h"][0], PROMPTS, GREEDY),
            ("looping", str(loop), LOOP_PROMPTS, longer),
            ("nemotron-looping", str(nloop), LOOP_PROMPTS, longer)]:
        eng = llm_for(path).engine
        reqs = [eng.add_request(p, params) for p in prompts]
        seen = {}
        while eng.has_unfinished():
            for i, r in enumerate(reqs):
                if not r.is_finished and r.state_slot is not None:
                    seen[i, r.num_computed] = layer_states(eng, r.state_slot)
            eng.step()
        runs[name] = (path, prompts, params, [r.output_token_ids for r in reqs], seen)
    return runs


def layer_states(eng, slot: int) -> list[dict]:
    return [{n: t[slot].clone() for n, t in layer.states.items()}
            for layer in eng.states.layers]


@pytest.mark.parametrize("spec", list(SPEC_CONFIGS))
def test_speculation_lossless_and_states_equal_plain(plain_runs, eagle_heads, spec):
    """Greedy speculation emits plain decoding's tokens, and after every step (drafts
    rejected or not) each request's committed recurrent state equals the state plain
    decoding had with as many tokens computed."""
    model, make_config = SPEC_CONFIGS[spec]
    path, prompts, params, plain, seen = plain_runs[model]
    head = eagle_heads["nemotron-h" if model.startswith("nemotron") else "qwen3-next"]
    llm = llm_for(path, max_num_tokens=9, speculative_config=make_config(head))
    eng = llm.engine
    reqs = [eng.add_request(p, params) for p in prompts]
    compared = 0
    while eng.has_unfinished():
        eng.step()
        for i, r in enumerate(reqs):
            if r.is_finished or r.in_context:
                continue
            want = seen[i, r.num_computed]
            for got, ref in zip(layer_states(eng, r.state_slot), want):
                for name in ref:
                    torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5)
            compared += 1
    assert [r.output_token_ids for r in reqs] == plain
    stats = llm.stats()
    assert compared > 10 and stats["num_draft_tokens"] > stats["num_accepted_draft_tokens"]
    if "ngram" in spec:         # steps committing at row 1 .. K, not only row 0
        counts = stats["accepted_path_length_counts"]
        assert counts[1] > 0 and counts[-1] > 0, counts
    assert_states_free(llm)


def test_mtp_on_qwen3_5_lossless(models, tmp_path):
    """The MTP module on a dense Qwen3.5 target (its own checkpoint with mtp.*)."""
    import shutil
    from hybrid_utils import add_mtp_weights
    src, hf, refs = models["qwen3.5"]
    path = str(tmp_path / "with-mtp")
    shutil.copytree(src, path)
    add_mtp_weights(path, hf)
    llm = llm_for(path, speculative_config=MTPConfig(num_nextn_predict_layers=2),
                  **ENGINE_MODES["preemption"])
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_preemptions"] > 0
    assert_states_free(llm)


class CacheFreeMTP:
    """The drafting loop of the cache-free MTP references: subclasses give layer_input
    (embedding and hidden state -> the block input), run_blocks (causal, [n, H] -> [n, H]),
    the final norm's name in self.norms, self.hf (the target)."""

    final_norm = "norm"

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int):
        """MTP drafts after `tokens` and each step's top-2 logit margin."""
        final = self.hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        xs = self.layer_input(torch.tensor(tokens[1:]), final)
        drafts, margins = [], []
        for _ in range(k):
            n = xs.shape[0]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            last = self.norms[self.final_norm](self.run_blocks(xs, mask)[-1:])
            top2 = self.hf.lm_head(last)[0].topk(2)
            drafts.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            xs = torch.cat([xs, self.layer_input(torch.tensor(drafts[-1:]), last)])
        return drafts, margins


class MTPReference(CacheFreeMTP):
    """The checkpoint's MTP module as transformers modules (cache-free): fc, the two
    zero-centred pre-fc norms, a full-attention decoder layer of the target's class, norm."""

    def __init__(self, hf):
        import transformers.models.qwen3_next.modeling_qwen3_next as m
        cfg = hf.config
        self.hf = hf
        weights = mtp_weights(hf, 0)
        full = cfg.layer_types.index("full_attention")
        self.block = m.Qwen3NextDecoderLayer(cfg, full).float().eval()
        self.block.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in weights.items()
                                    if k.startswith("mtp.layers.0.")})
        self.fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.fc.weight.data = weights["mtp.fc.weight"]
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norm = m.Qwen3NextRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            norm.weight.data = weights[f"mtp.{name}.weight"]
            self.norms[name] = norm

    def layer_input(self, ids, hidden):
        e = self.norms["pre_fc_norm_embedding"](self.hf.model.embed_tokens(ids))
        return self.fc(torch.cat([e, self.norms["pre_fc_norm_hidden"](hidden)], -1))

    def run_blocks(self, xs, mask):
        pos = torch.arange(xs.shape[0])[None]
        return self.block(xs[None], attention_mask=mask, position_ids=pos,
                          position_embeddings=self.hf.model.rotary_emb(xs[None], pos))[0]


def test_mtp_drafts_match_cache_free_reference(models):
    from conftest import assert_drafts_match_reference
    path, hf, _ = models["qwen3-next"]
    ref = MTPReference(hf)
    k = 3
    llm = llm_for(path, max_num_tokens=9, device="cpu",      # compared on the CPU
                  speculative_config=MTPConfig(num_nextn_predict_layers=k))
    assert_drafts_match_reference(llm, PROMPTS[:3], GREEDY, lambda ids: ref.drafts(ids, k), k)
    assert_states_free(llm)


VOCAB, SAMPLES = 8, 3000


def test_rejection_sampling_keeps_distribution(tmp_path):
    """Sampled MTP drafts with rejection sampling on a hybrid target: the first three
    tokens' joint distribution is the target's (chi-square against transformers). With
    K = 1 a third token after a rejected draft comes from a step after a commit."""
    from onespec.layers.sampler import probs_from_logits
    hf = make_hybrid_model(tmp_path, "qwen3-next", vocab_size=VOCAB, mtp=True, seed=3)
    prompt = [3, 7, 1, 5, 2]
    llm = llm_for(str(tmp_path), max_batch_size=256, seed=11,
                  speculative_config=MTPConfig(num_nextn_predict_layers=1,
                                               use_rejection_sampling=True))
    sp = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    samples = [o.outputs[0].token_ids for o in llm.generate([prompt] * SAMPLES, sp)]
    assert_states_free(llm)
    assert llm.stats()["num_accepted_draft_tokens"] > 0.05 * SAMPLES

    def probs(seqs):
        with torch.no_grad():
            logits = hf(torch.tensor(seqs)).logits[:, -1].float()
        n = len(seqs)
        return probs_from_logits(logits, torch.ones(n), torch.zeros(n, dtype=torch.long),
                                 torch.ones(n))
    v = range(VOCAB)
    p1 = probs([prompt])[0]
    p2 = probs([prompt + [a] for a in v])
    p3 = probs([prompt + [a, b] for a in v for b in v]).view(VOCAB, VOCAB, VOCAB)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    assert chi_square_pvalue(samples, joint, VOCAB) > 1e-4
    # control: the same samples fail against a different distribution
    assert chi_square_pvalue(samples, joint.flip(0), VOCAB) < 1e-6


def test_refused_combinations_and_config(models, eagle_heads, tmp_path, caplog):
    path, _, _ = models["qwen3-next"]
    logger = logging.getLogger("onespec.engine")
    logger.addHandler(caplog.handler)          # (its parent may not propagate: serve)
    try:
        with caplog.at_level("INFO", logger="onespec.engine"):
            assert llm_for(path).engine.pool.cache is None
    finally:
        logger.removeHandler(caplog.handler)
    assert "prefix caching is off for Qwen3NextForCausalLM" in caplog.text
    with pytest.raises(UnsupportedCombination, match="a hybrid target"):
        llm_for(path, speculative_config=Eagle3Config(eagle_heads["qwen3-next"], max_draft_len=2,
                                                      use_dynamic_tree=True))
    with pytest.raises(UnsupportedCombination, match="a hybrid target .* tensor_parallel"):
        llm_for(path, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        llm_for(path, speculative_config=MTPConfig(num_nextn_predict_layers=2,
                                                   use_mtp_vanilla=True))
    base = dict(architectures=["Qwen3_5ForConditionalGeneration"], tie_word_embeddings=False)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                linear_value_head_dim=8, full_attention_interval=3,
                rope_parameters={"rope_theta": 1e6, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "rope_type": "default"},
                mtp_num_hidden_layers=1)
    with pytest.raises(ValueError, match="not a Qwen3-Next / Qwen3.5 config"):
        HybridConfig.from_hf({**base, "architectures": ["Qwen3VLForConditionalGeneration"],
                              "text_config": text})
    assert HybridConfig.from_hf({**base, "text_config": text}).architecture == \
        "Qwen3_5ForCausalLM"
    cfg = HybridConfig.from_hf({**base, "architectures": ["Qwen3_5ForCausalLM"],
                                "text_config": text})
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2
    assert (cfg.rotary_dim, cfg.num_nextn_predict_layers, cfg.num_experts) == (4, 1, 0)
    with pytest.raises(ValueError, match="'layer_types' must list"):
        HybridConfig.from_hf({**base, "architectures": ["Qwen3_5ForCausalLM"],
                              **text, "layer_types": ["linear_attention", "mamba"]})


def test_per_row_states_equal_prefix_runs():
    """The scans' states after each row equal the final states of runs over each prefix,
    and a run split in two (state carried) equals one run: what chunked prefill and the
    per-position commit rely on."""
    g = torch.Generator().manual_seed(0)
    b, length, c, w = 2, 5, 6, 4
    x = torch.randn(b, length, c, generator=g)
    state = torch.randn(b, c, w - 1, generator=g)
    weight = torch.randn(c, w, generator=g)
    y, per_row = causal_conv(x, state, weight, keep_all=True)
    for j in range(length):
        yj, final = causal_conv(x[:, :j + 1], state, weight)
        torch.testing.assert_close(per_row[:, j], final)
        torch.testing.assert_close(y[:, :j + 1], yj)
    q, k = torch.randn(2, b, length, 1, 4, generator=g)
    v = torch.randn(b, length, 2, 3, generator=g)
    gl, beta = -torch.rand(b, length, 2, generator=g), torch.rand(b, length, 2, generator=g)
    s0 = torch.randn(b, 2, 4, 3, generator=g)
    o, states = gated_delta_scan(q, k, v, gl, beta, s0, keep_all=True)
    o1, s1 = gated_delta_scan(q[:, :2], k[:, :2], v[:, :2], gl[:, :2], beta[:, :2], s0)
    o2, s2 = gated_delta_scan(q[:, 2:], k[:, 2:], v[:, 2:], gl[:, 2:], beta[:, 2:], s1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o)
    torch.testing.assert_close(states[:, 1], s1)
    torch.testing.assert_close(states[:, -1], s2)


class NemotronMTPReference(CacheFreeMTP):
    """A Nemotron-H MTP step from transformers blocks (cache-free): eh_proj of the
    normed embedding and hidden state, an attention block, an MoE block,
    final_layernorm, the target's lm_head."""

    final_norm = "final_layernorm"

    def __init__(self, hf, weights):
        import copy

        import transformers.models.nemotron_h.modeling_nemotron_h as m
        cfg = copy.deepcopy(hf.config)
        cfg.layers_block_type = ["full_attention", "moe"]
        self.hf = hf
        self.blocks = []
        for i in range(2):
            block = m.NemotronHBlock(cfg, i).float().eval()
            block.load_state_dict(weights["blocks"][i])
            self.blocks.append(block)
        own = weights["own"]
        h = cfg.hidden_size
        self.norms = {}
        for name in ("enorm", "hnorm", "final_layernorm"):
            self.norms[name] = m.NemotronHRMSNorm(h, cfg.layer_norm_epsilon)
            self.norms[name].weight.data = own[f"{name}.weight"]
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.eh_proj.weight.data = own["eh_proj.weight"]

    def layer_input(self, ids, hidden):
        e = self.norms["enorm"](self.hf.model.embeddings(ids))
        return self.eh_proj(torch.cat([e, self.norms["hnorm"](hidden)], -1))

    def run_blocks(self, xs, mask):
        out = xs[None]
        for block in self.blocks:
            out = block(out, attention_mask=mask)
        return out[0]


def test_nemotron_h_mtp(models, tmp_path):
    """Nemotron-H's MTP step (attention + MoE blocks): drafts equal the cache-free
    reference, and greedy MTP output equals plain output."""
    import shutil

    from conftest import assert_drafts_match_reference
    from hybrid_utils import add_nemotron_mtp_weights
    src, hf, refs = models["nemotron-h"]
    path = str(tmp_path / "with-mtp")
    shutil.copytree(src, path)
    ref = NemotronMTPReference(hf, add_nemotron_mtp_weights(path, hf))
    k = 3
    llm = llm_for(path, max_num_tokens=9, device="cpu",      # compared on the CPU
                  speculative_config=MTPConfig(num_nextn_predict_layers=k))
    assert_drafts_match_reference(llm, PROMPTS[:3], GREEDY, lambda ids: ref.drafts(ids, k), k)
    assert_states_free(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert_states_free(llm)


def test_qwen3_5_vision_language_checkpoint(tmp_path):
    """A published-style Qwen3.5 checkpoint (Qwen3_5ForConditionalGeneration: text_config,
    model.language_model.*, a vision tower) serves text prompts as transformers does."""
    import transformers
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, max_position_embeddings=256, eos_token_id=2)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=4, spatial_merge_size=1,
                  temporal_patch_size=1, num_position_embeddings=16)
    torch.manual_seed(5)
    hf = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    hf.save_pretrained(tmp_path)
    refs = [hf_greedy(hf, p, 8) for p in PROMPTS[:2]]
    llm = llm_for(str(tmp_path))
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert_states_free(llm)


def test_bench_hybrid_shape_floor(tmp_path):
    """bench decode's hybrid shape: the dummy engine builds, and its floor counts each
    request's recurrent state read once and written after each of the K+1 verify rows."""
    from onespec.bench.models import step_floor_parts, write_model_dirs
    from onespec.engine.state_pool import state_bytes
    target, head = write_model_dirs("tiny-hybrid", str(tmp_path))
    assert head is None                      # drafted by its MTP layer
    llm = LLM(target, load_format="dummy", dtype="float32", device="cpu", max_batch_size=4,
              max_model_len=64, speculative_config=MTPConfig(num_nextn_predict_layers=3))
    eng = llm.engine
    per = state_bytes(eng.model.recurrent_layers(), torch.float32)
    assert per > 0 and len(eng.model.recurrent_layers()) == 3
    for batch, k in ((1, 0), (4, 3)):
        parts = step_floor_parts(eng, batch, k, kv_tokens=100.0)
        assert parts["state"] == batch * per * (k + 2)
        assert parts["target"] > 0 and parts["kv"] > 0
