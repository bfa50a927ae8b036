"""Parallel drafting (P-EAGLE heads; docs/DECODING.md, "Parallel drafting"): one head
forward a step, lossless greedy and sampled output, drafts equal to a cache-free reference
read straight from a checkpoint in the speculators P-EAGLE layout, and clear errors."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import TEST_DEVICE, assert_drafts_match_reference, assert_pool_full, \
    assert_schedule_keeps_output, make_hf_model
from onespec import LLM, Eagle3Config, SamplingParams
from onespec.combinations import UnsupportedCombination
from test_spec_sampling import chi_square_pvalue, exact_joint

VOCAB, HIDDEN, DRAFT_VOCAB, DEPTH, LAYERS = 128, 64, 64, 4, 2
MASK = VOCAB                    # the mask token: one embedding row past the vocabulary
CAPTURE_AUX = (2, 3, 4)         # inputs-to ids in the checkpoint: outputs of layers 1, 2, 3
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 30, [40, 41],
           list(range(20, 45))]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def write_peagle_checkpoint(path, seed: int = 3):
    """A random P-EAGLE head written by hand in the speculators layout: config.json with
    speculators_model_type 'peagle', transformer_layer_config, mask_token_id and the
    proposal's speculative_tokens; weights fc, layers.{i}.*, norm, lm_head, embed_tokens
    (with the mask row), mask_hidden [1, 1, 3H], d2t and t2d."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, scale=0.08: torch.randn(*shape, generator=g) * scale  # noqa: E731
    heads, kv_heads, head_dim, inter = 4, 2, HIDDEN // 4, 2 * HIDDEN + 16
    w = {"fc.weight": rnd(HIDDEN, 3 * HIDDEN), "norm.weight": 1 + rnd(HIDDEN, scale=0.1),
         "lm_head.weight": rnd(DRAFT_VOCAB, HIDDEN),
         "embed_tokens.weight": rnd(VOCAB + 1, HIDDEN, scale=0.5),
         "mask_hidden": rnd(1, 1, 3 * HIDDEN, scale=1.0)}
    for i in range(LAYERS):
        width = 2 * HIDDEN if i == 0 else HIDDEN
        p = f"layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rnd(heads * head_dim, width),
              p + "self_attn.k_proj.weight": rnd(kv_heads * head_dim, width),
              p + "self_attn.v_proj.weight": rnd(kv_heads * head_dim, width),
              p + "self_attn.o_proj.weight": rnd(HIDDEN, heads * head_dim),
              p + "mlp.gate_proj.weight": rnd(inter, HIDDEN),
              p + "mlp.up_proj.weight": rnd(inter, HIDDEN),
              p + "mlp.down_proj.weight": rnd(HIDDEN, inter),
              p + "input_layernorm.weight": 1 + rnd(HIDDEN, scale=0.1),
              p + "post_attention_layernorm.weight": 1 + rnd(HIDDEN, scale=0.1)}
        if i == 0:
            w[p + "hidden_norm.weight"] = 1 + rnd(HIDDEN, scale=0.1)
    chosen = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
    w["d2t"] = chosen - torch.arange(DRAFT_VOCAB)
    w["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    w["t2d"][chosen] = True
    layer = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=HIDDEN,
                 intermediate_size=inter, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=LAYERS,
                 rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                 vocab_size=VOCAB, hidden_act="silu")
    cfg = {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
           "transformer_layer_config": layer, "draft_vocab_size": DRAFT_VOCAB,
           "norm_before_residual": False, "target_hidden_size": HIDDEN,
           "eagle_aux_hidden_state_layer_ids": list(CAPTURE_AUX), "mask_token_id": MASK,
           "speculators_config": {"algorithm": "peagle", "proposal_methods": [
               {"proposal_type": "greedy", "speculative_tokens": DEPTH}]}}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tdir = tmp_path_factory.mktemp("target")
    hf = make_hf_model(tdir, "llama", num_layers=5)
    head = str(tmp_path_factory.mktemp("peagle"))
    write_peagle_checkpoint(head)
    plain = LLM(str(tdir), device=TEST_DEVICE, dtype="float32").generate(PROMPTS, GREEDY)
    return str(tdir), hf, head, [o.outputs[0].token_ids for o in plain]


def parallel_llm(target, head, k, device=TEST_DEVICE, **kw):
    spec = kw.pop("spec", {})
    return LLM(target, device=device, dtype="float32", speculative_config=Eagle3Config(
        head, max_draft_len=k, parallel_drafting=True, **spec), **kw)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def count_calls(obj):
    """Counts obj's calls: a module's forward, or a worker's step (an instance attribute
    shadowing the class's method)."""
    calls = []
    name = "forward" if isinstance(obj, torch.nn.Module) else "step"
    forward = getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)
    setattr(obj, name, counted)
    return calls


@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("engine_kw", [{}, {"max_num_tokens": 9},
                                       {"num_kv_blocks": 20, "block_size": 4,
                                        "max_model_len": 64}],
                         ids=["batch", "chunked", "preempt"])
def test_greedy_lossless_one_head_forward_per_step(pair, k, engine_kw):
    target, _, head, plain = pair
    llm = parallel_llm(target, head, k, **engine_kw)
    assert_lossless_one_forward_per_step(llm, plain, "num_kv_blocks" in engine_kw)


def assert_lossless_one_forward_per_step(llm, plain, preempts: bool):
    """Greedy output of PROMPTS equals plain decoding's with one drafter-head forward per
    target step (SpecWorker.step), whatever K; drafts were made (preemptions too where
    `preempts`: a small pool); the pool is full again."""
    heads = count_calls(llm.engine.drafter.head)
    steps = count_calls(llm.engine.runner.worker)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
    assert len(steps) > 0 and len(heads) == len(steps)
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0
    if preempts:
        assert stats["num_preemptions"] > 0
    assert_pool_full(llm)


def test_schedule_cycling_k(pair):
    """K changes every step (4,4,2,2,0,0,1,1,...): drafts are truncated, padded, skipped."""
    target, _, head, plain = pair
    llm = parallel_llm(target, head, 4)
    assert_schedule_keeps_output(llm, [4, 4, 2, 2, 0, 0, 1, 1], PROMPTS, GREEDY, plain)


@pytest.mark.parametrize("spec", [dict(use_relaxed_acceptance_for_thinking=True,
                                       begin_thinking_phase_token=7),
                                  dict(use_sa_enhancer=True),
                                  dict(draft_len_schedule="auto")],
                         ids=["relaxed", "sa-enhancer", "auto-draft-len"])
def test_other_acceptors_lossless(pair, spec):
    """Relaxed acceptance with its defaults (delta 0: the strict rule), the suffix
    automaton over parallel drafts and the auto draft length (its start-up timing runs
    parallel steps) keep greedy output."""
    target, _, head, plain = pair
    llm = parallel_llm(target, head, 3, spec=spec)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
    assert_pool_full(llm)


def test_forced_acceptance_sets_tokens_per_step(pair):
    target, _, head, _ = pair
    llm = parallel_llm(target, head, 3, spec=dict(force_acceptance_length=3.0))
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=13, ignore_eos=True))
    for o in outs:
        m = o.metrics
        assert m.num_generated_tokens == 13 and m.target_steps == 1 + 4   # 1 + 4 steps of 3
    assert_pool_full(llm)


# ---- drafts against a cache-free reference read from the checkpoint file ----------------

def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]                       # [T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


def _layer(w, p, x, residual, positions):
    heads, kv_heads = 4, 2
    n = x.shape[0]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, -1)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, -1)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, -1)
    q, k = _rope(q, positions), _rope(k, positions)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), is_causal=True)
    h = residual + out.transpose(0, 1).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
    m = _rms(h, w[p + "post_attention_layernorm.weight"])
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    return h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


@torch.no_grad()
def reference_drafts(hf, w, tokens: list[int], k: int):
    """The K drafts for committed `tokens`, by one causal pass over every committed row
    (the target's features at p with token p + 1) and K - 1 mask rows after the last,
    computed from the checkpoint's tensors and transformers' hidden states; with each
    draft's top-2 logit margin."""
    n = len(tokens)
    hs = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i][0] for i in CAPTURE_AUX], -1)                  # [n-1, 3H]
    feats = torch.cat([feats, w["mask_hidden"].view(1, -1).expand(k - 1, -1)])
    ids = torch.tensor(tokens[1:] + [MASK] * (k - 1))
    positions = torch.arange(n - 1 + k - 1)
    h = feats @ w["fc.weight"].T
    e = _rms(w["embed_tokens.weight"][ids], w["layers.0.input_layernorm.weight"])
    a = torch.cat([e, _rms(h, w["layers.0.hidden_norm.weight"])], -1)
    h = _layer(w, "layers.0.", a, h, positions)
    for i in range(1, LAYERS):
        p = f"layers.{i}."
        h = _layer(w, p, _rms(h, w[p + "input_layernorm.weight"]), h, positions)
    logits = _rms(h[n - 2:], w["norm.weight"]) @ w["lm_head.weight"].T       # [K, Vd]
    top = logits.topk(2, -1)
    drafts = top.indices[:, 0] + w["d2t"][top.indices[:, 0]]
    return drafts.tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()


@pytest.mark.parametrize("k", [2, 4])
def test_drafts_match_cache_free_reference(pair, k):
    target, hf, head, _ = pair
    w = load_file(os.path.join(head, "model.safetensors"))
    llm = parallel_llm(target, head, k, device="cpu", max_num_tokens=10)
    assert llm.engine.drafter.capture_layers == tuple(i - 1 for i in CAPTURE_AUX)
    assert_drafts_match_reference(llm, PROMPTS[:4], GREEDY,
                                  lambda ids: reference_drafts(hf, w, ids, k), k)


def test_drafts_after_a_prefix_cache_hit_match_the_reference(pair):
    """The head's KV in cached blocks (written by another request's parallel forwards) is
    what this request's own would be: drafts after a hit equal the reference."""
    target, hf, head, _ = pair
    w = load_file(os.path.join(head, "model.safetensors"))
    llm = parallel_llm(target, head, 3, device="cpu", block_size=4)
    base = list(range(20, 45))
    llm.generate([base], GREEDY)
    assert_drafts_match_reference(llm, [base + [7, 8], base[:13] + [9]], GREEDY,
                                  lambda ids: reference_drafts(hf, w, ids, 3), 3)
    assert llm.stats()["num_cached_tokens"] >= 24 + 12


# ---- sampled output keeps the target's distribution --------------------------------------

SMALL_VOCAB, SAMPLE_PROMPT, NUM_SAMPLES = 16, [3, 7, 1, 12, 5], 4000


def test_rejection_sampling_keeps_target_distribution(tmp_path):
    """Three-token outputs of rejection-sampled parallel drafts (K = 2: the second token
    drafted at the root row, the third at a mask row) against the exact joint distribution
    from transformers (chi-square), with drafts at both positions really accepted."""
    hf = make_hf_model(tmp_path / "t", "llama", num_layers=5, vocab_size=SMALL_VOCAB,
                       hidden_size=64, seed=4)
    head = tmp_path / "h"
    _small_head(str(head))
    llm = LLM(str(tmp_path / "t"), device="cpu", dtype="float32", max_batch_size=256, seed=11,
              speculative_config=Eagle3Config(str(head), max_draft_len=2,
                                              parallel_drafting=True,
                                              use_rejection_sampling=True))
    assert_samples_keep_target(llm, hf, SAMPLE_PROMPT, NUM_SAMPLES, SMALL_VOCAB)


def assert_samples_keep_target(llm, hf, prompt: list[int], num_samples: int, vocab: int):
    """`num_samples` three-token outputs of `prompt` at temperature 1 follow the exact joint
    distribution of transformers' model `hf` (chi-square), with drafts at both positions
    really accepted; the test has power (a rolled distribution is refused)."""
    sp = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    samples = token_ids(llm.generate([prompt] * num_samples, sp))
    assert_pool_full(llm)
    stats = llm.stats()
    assert stats["num_accepted_draft_tokens"] > 0.05 * num_samples
    assert min(stats["acceptance_rate_per_position"]) > 0.02
    joint = exact_joint(hf, 1.0, 0, 1.0, prompt, vocab)                       # [V, V, V]
    assert chi_square_pvalue(samples, joint, vocab) > 1e-4
    assert chi_square_pvalue(samples, joint.roll(1, 2), vocab) < 1e-6


def _small_head(path, vocab: int = SMALL_VOCAB):
    """A random one-layer parallel head for a `vocab`-token target of hidden size 64, saved
    by onespec's writer (speculators layout), mask token inside the vocabulary."""
    from onespec.models.eagle3 import Eagle3Head, Eagle3HeadConfig
    from onespec.models.eagle3_io import save_eagle3_head
    layer = dict(hidden_size=64, intermediate_size=144, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=1, rms_norm_eps=1e-6,
                 vocab_size=vocab, max_position_embeddings=256)
    cfg = Eagle3HeadConfig.from_hf({"speculators_model_type": "peagle",
                                    "transformer_layer_config": layer, "mask_token_id": 0,
                                    "num_depths": 3})
    torch.manual_seed(5)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.normal_(1.0, 0.1)
    save_eagle3_head(head, path, "speculators")


def test_structured_outputs_follow_the_grammar(tmp_path):
    """Grammar masks apply to each parallel draft in turn (the worker's per-draft picks over
    the one forward's rows): constrained greedy output equals plain constrained output."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("jsonschema")
    from test_serve import write_tokenizer
    from test_structured import CASES, PROMPTS as TEXT_PROMPTS, \
        assert_constrained_spec_equals_plain
    make_hf_model(tmp_path, "llama", num_layers=5, vocab_size=300, seed=2)
    write_tokenizer(tmp_path, 300, chat_template=None)
    _small_head(str(tmp_path / "head"), vocab=300)
    cases = [CASES[0], CASES[5]]                 # a JSON schema and a regex
    prompts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(len(cases))]
    assert_constrained_spec_equals_plain(
        str(tmp_path), cases, prompts,
        Eagle3Config(str(tmp_path / "head"), max_draft_len=3, parallel_drafting=True))


# ---- configuration and formats -----------------------------------------------------------

def test_dictionary_form_and_refusals(pair, tmp_path):
    from onespec.config import as_speculative_config
    target, hf, head, _ = pair
    sc = as_speculative_config({"method": "eagle3", "model": head, "num_speculative_tokens": 3,
                                "parallel_drafting": True})
    assert sc.parallel_drafting and sc.max_draft_len == 3
    with pytest.raises(UnsupportedCombination, match="parallel_drafting=True cannot be "
                                                     "combined with use_dynamic_tree=True"):
        Eagle3Config(head, parallel_drafting=True, use_dynamic_tree=True)
    with pytest.raises(ValueError, match="parallel_drafting must be True or False"):
        Eagle3Config(head, parallel_drafting="yes")
    with pytest.raises(ValueError, match=r"trained parallel depth \(4\)"):
        parallel_llm(target, head, 5, device="cpu")
    from conftest import make_eagle3_head
    chain = str(tmp_path / "chain")
    make_eagle3_head(chain, hf)
    with pytest.raises(ValueError, match="is a chain EAGLE-3 head"):
        parallel_llm(target, chain, 2, device="cpu")


def test_vllm_flat_layout_drafts_alike(pair, tmp_path):
    """vLLM's converted P-EAGLE config (a flat LlamaForCausalLM config with draft_vocab_size
    and ptd_token_id, weights under "model.") drafts exactly as the speculators layout."""
    target, _, head, _ = pair
    with open(os.path.join(head, "config.json")) as f:
        cfg = json.load(f)
    flat = {**cfg["transformer_layer_config"], "architectures": ["LlamaForCausalLM"],
            "draft_vocab_size": DRAFT_VOCAB, "ptd_token_id": MASK,
            "eagle_aux_hidden_state_layer_ids": list(CAPTURE_AUX)}
    os.makedirs(tmp_path / "flat")
    with open(tmp_path / "flat" / "config.json", "w") as f:
        json.dump(flat, f)
    w = load_file(os.path.join(head, "model.safetensors"))
    save_file({("model." + k if k.startswith("layers.") else k): v for k, v in w.items()},
              str(tmp_path / "flat" / "model.safetensors"))
    runs = []
    for path in (head, str(tmp_path / "flat")):
        llm = parallel_llm(target, path, 4)
        outs = llm.generate(PROMPTS, GREEDY)
        runs.append((token_ids(outs), llm.stats()["acceptance_rate_per_position"]))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.pop("mask_token_id"), "needs a mask token"),
    (lambda c: c.update(norm_before_fc=True), "norm_before_fc=true is not supported"),
    (lambda c: c.update(speculators_model_type=None, architectures=["DFlashDraftModel"],
                        block_size=16, target_layer_ids=[1, 2]), "DFlash/DSpark"),
    (lambda c: c.update(mask_token_id=VOCAB + 1), "outside the embedding"),
])
def test_bad_checkpoints_fail_with_clear_errors(pair, tmp_path, edit, match):
    import shutil
    target, _, head, _ = pair
    bad = tmp_path / "bad"
    shutil.copytree(head, bad)
    with open(bad / "config.json") as f:
        cfg = json.load(f)
    edit(cfg)
    with open(bad / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=match):
        parallel_llm(target, str(bad), 2, device="cpu")


# ---- training ------------------------------------------------------------------------------

def test_cod_sampling_and_mask():
    """Depth d's anchors are a subset of depth d-1's, shrinking like ratio^d down to the
    floor; a row sees committed rows up to its anchor and its own rollout only."""
    from onespec.train.peagle import cod_anchors, peagle_mask, peagle_rows
    valid = torch.ones(100, dtype=torch.bool)
    valid[90:] = False
    anchors = cod_anchors(valid, 5, 0.5, 0.2, torch.Generator().manual_seed(0))
    assert [a.numel() for a in anchors] == [45, 22, 18, 18]      # of 90 valid
    for shallow, deep in zip(anchors, anchors[1:]):
        assert set(deep.tolist()) <= set(shallow.tolist())
    anchor, depth = peagle_rows(4, [torch.tensor([1, 2]), torch.tensor([2])], "cpu")
    mask = peagle_mask(anchor, depth)
    # rows: (0,0) (1,0) (2,0) (3,0) (1,1) (2,1) (2,2)
    assert mask[6].tolist() == [True, True, True, False, False, True, True]
    assert mask[4].tolist() == [True, True, False, False, True, False, False]


def test_train_peagle_lowers_loss_at_every_depth_and_drafts_losslessly(tmp_path):
    """`onespec train peagle` on a tiny corpus (the target's own greedy text): every
    depth's loss falls, the head is written in the speculators P-EAGLE layout, and the
    engine drafts with it in parallel, losslessly and with drafts accepted."""
    from onespec.train.cli import main
    from train_utils import self_generated_records, write_jsonl
    tdir = str(tmp_path / "target")
    make_hf_model(tdir, "llama", num_layers=5, hidden_size=32)
    data = str(tmp_path / "data.jsonl")
    write_jsonl(data, self_generated_records(tdir, num=48, seq_len=64))
    out = str(tmp_path / "head")
    assert main(["peagle", "--target", tdir, "--data", data, "--out", out, "--depth", "3",
                 "--layers", "2", "--draft-vocab", "96", "--max-len", "64",
                 "--batch-tokens", "256", "--lr", "3e-3", "--epochs", "50",
                 "--max-steps", "60", "--device", "cpu", "--save-every", "0",
                 "--log-every", "10", "--no-progress"]) == 0
    with open(os.path.join(out, "train_log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    first, last = log[0]["loss_per_step"], log[-1]["loss_per_step"]
    assert len(first) == 3 and all(b < 0.8 * a for a, b in zip(first, last)), (first, last)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["speculators_model_type"] == "peagle" and cfg["mask_token_id"] == 128
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    assert load_file(os.path.join(out, "model.safetensors"))["mask_hidden"].shape == (1, 1, 96)
    prompts = [r["input_ids"][:8] for r in self_generated_records(tdir, num=4, seed=7)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = token_ids(LLM(tdir, device="cpu", dtype="float32").generate(prompts, params))
    llm = parallel_llm(tdir, out, 3, device="cpu")
    assert token_ids(llm.generate(prompts, params)) == plain
    assert llm.stats()["num_accepted_draft_tokens"] > 0
    assert_pool_full(llm)


# ---- CUDA: the Triton backend, CUDA graphs and the overlap scheduler ----------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs, overlap", [(False, False), (True, False), (True, True)])
def test_parallel_drafting_on_cuda(pair, graphs, overlap):
    """On the Triton backend, eager and graphed (and overlapped) parallel steps give the
    plain output, with one head forward a step; graphs are replayed and chained."""
    target, _, head, plain = pair
    llm = LLM(target, device="cuda", dtype="float32", max_batch_size=8, cuda_graphs=graphs,
              overlap_scheduler=overlap, speculative_config=Eagle3Config(
                  head, max_draft_len=4, parallel_drafting=True))
    assert llm.engine.runner.worker.attn_backend == "triton"
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
    assert llm.stats()["num_accepted_draft_tokens"] >= 0
    if graphs:
        assert llm.engine.runner.graphs.num_replays > 0
        assert (llm.engine.runner.graphs.num_chained > 0) == overlap
    assert_pool_full(llm)


def test_bench_runs_parallel_drafting(capsys):
    """`onespec bench --parallel-drafting LAYERS`: a random P-EAGLE head's rows, marked."""
    from onespec.bench.decode import main
    code = main(["decode", "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                 "--batch-sizes", "1", "--ks", "3", "--acceptance", "2.0", "--gen-len", "6",
                 "--trials", "1", "--warmup-steps", "1", "--no-hf", "--parallel-drafting", "2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert code == 0 and [r["k"] for r in rows] == [0, 3]
    assert all("error" not in r and r["parallel_drafting_layers"] == 2 for r in rows)
    assert rows[1]["acceptance_length"] > 1.5
