"""Tiny random-weight Hugging Face checkpoints built by the tests themselves."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (set before any kernel is
# defined), so the CPU suite checks their indexing and arithmetic too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The auto draft length's cached step-time tables go to a directory of this run's own.
os.environ.setdefault("ONESPEC_CACHE_DIR", tempfile.mkdtemp(prefix="onespec-test-cache-"))

# Tiny models on a small CPU: one intra-op thread is several times faster than two.
torch.set_num_threads(1)

# The equivalence tests run on this device; ONESPEC_TEST_DEVICE=cuda runs them on a GPU
# (references stay on the CPU and are compared token by token).
TEST_DEVICE = os.environ.get("ONESPEC_TEST_DEVICE", "cpu")

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3-rope-tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
}


def make_hf_model(path, arch: str = "llama", num_layers: int = 4, vocab_size: int = 128,
                  hidden_size: int = 64, seed: int = 0, **overrides):
    import transformers
    cfg_name, model_name, extra = ARCH_CONFIGS[arch]
    fields = dict(vocab_size=vocab_size, hidden_size=hidden_size,
                  intermediate_size=2 * hidden_size + 16, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = getattr(transformers, cfg_name)(**{**fields, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).float().eval()
    with torch.no_grad():           # larger-than-default weights: sharper, less tied logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{arch: (path, hf_model)} for every supported architecture."""
    out = {}
    for arch in ARCH_CONFIGS:
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (str(path), make_hf_model(path, arch))
    return out


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def stop_process(proc):
    """Ends a subprocess.Popen the test started: terminate, and kill if it has not gone
    within 15 s."""
    import subprocess
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def assert_pool_full(llm):
    eng = llm.engine
    assert not eng.has_unfinished()
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


def assert_greedy_matches(path: str, refs, prompts, params, **engine_kw):
    """An engine on the checkpoint at `path` (float32, TEST_DEVICE, engine_kw) decodes
    `prompts` greedily to `refs` (transformers' token ids); a small pool (num_kv_blocks)
    preempts; the pool is full again. Returns the LLM."""
    from onespec import LLM
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, **engine_kw)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == refs
    if "num_kv_blocks" in engine_kw:
        assert llm.stats()["num_preemptions"] > 0
    assert_pool_full(llm)
    return llm


def assert_schedule_keeps_output(llm, cycle: list[int], prompts, params, plain):
    """A draft-length schedule that cycles through `cycle` (one entry a step) keeps the
    output `plain` (greedy plain decoding's token ids); it is consulted for more than one
    cycle, and the pool is full again."""
    seen = []

    def draft_len(batch_size):
        seen.append(cycle[len(seen) % len(cycle)])
        return seen[-1]

    llm.engine.set_draft_len(draft_len)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert len(seen) > len(cycle)
    assert_pool_full(llm)


def assert_drafts_match_reference(llm, prompts, params, reference, k: int):
    """Runs `prompts` to the end step by step; after every step each running request's
    drafts equal reference(token_ids) -> (drafts, top-2 logit margins) up to the first
    near-tie (where float noise may pick the other path), for at least 5 steps of k
    drafts a prompt; then the pool is full again."""
    eng = llm.engine
    reqs = [eng.add_request(p, params) for p in prompts]
    checked = 0
    while eng.has_unfinished():
        for req in eng.step():
            if req.is_finished or not req.draft_tokens:
                continue
            want, margins = reference(req.token_ids)
            for got, ref, margin in zip(req.draft_tokens, want, margins):
                if margin < 1e-3:
                    break
                assert got == ref, (req.request_id, len(req.token_ids), req.draft_tokens, want)
                checked += 1
    assert checked >= len(prompts) * 5 * k
    assert all(r.is_finished for r in reqs)
    assert_pool_full(llm)


def step_beside_one_rank(llm, one, prompts, params):
    """Steps a tensor-parallel engine and a one-rank engine in lockstep on the same requests,
    asserting the same drafts after every step; -> the parallel engine's requests."""
    engines = (llm.engine, one.engine)
    reqs = [[e.add_request(p, params) for p in prompts] for e in engines]
    num_drafts = 0
    while engines[1].has_unfinished():
        for e in engines:
            e.step()
        assert [r.draft_tokens for r in reqs[0]] == [r.draft_tokens for r in reqs[1]]
        num_drafts += sum(len(r.draft_tokens) for r in reqs[0])
    assert not engines[0].has_unfinished() and num_drafts > 0
    assert [r.metrics.target_steps for r in reqs[0]] == \
        [r.metrics.target_steps for r in reqs[1]]
    assert llm.stats() == one.stats()
    return reqs[0]


def make_eagle3_head(path, target_model, fmt: str = "safeailab", draft_vocab_size=None,
                     seed: int = 1, aux_layer_ids=None, norm_before_residual: bool = False,
                     own_embedding: bool = False, num_layers: int = 1):
    """A random EAGLE-3 head for `target_model` (an HF model), written in `fmt`."""
    from onespec.models.eagle3 import Eagle3Head, Eagle3HeadConfig, make_vocab_maps
    from onespec.models.eagle3_io import head_config_dict, save_eagle3_head
    tc = target_model.config
    vocab = tc.vocab_size
    draft_vocab = draft_vocab_size or vocab
    layer = dict(architectures=["LlamaForCausalLMEagle3"], hidden_size=tc.hidden_size,
                 intermediate_size=tc.intermediate_size, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=num_layers, rms_norm_eps=1e-6,
                 vocab_size=vocab, draft_vocab_size=draft_vocab, max_position_embeddings=256,
                 rope_theta=10000.0)
    if aux_layer_ids:
        layer["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    cfg = Eagle3HeadConfig.from_hf(layer)
    cfg.norm_before_residual = norm_before_residual
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(1.0, 0.1)
        if own_embedding:
            head.embed_tokens = torch.nn.Embedding(vocab, tc.hidden_size)
            head.embed_tokens.weight.normal_(0, 0.5)
        if draft_vocab != vocab:
            g = torch.Generator().manual_seed(seed)
            chosen = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
            d2t, t2d = make_vocab_maps(chosen, vocab)
            head.d2t.copy_(d2t)
            head.t2d.copy_(t2d)
    save_eagle3_head(head, str(path), fmt)
    assert head_config_dict(cfg, fmt)
    return head


def build_eagle_pair(tmp_path_factory, num_layers: int, prompts, params):
    """A random llama target of num_layers, a random EAGLE-3 head for it (draft vocabulary
    64 of 128), and the target's plain outputs for prompts: (target dir, HF model, head dir,
    token ids)."""
    from onespec import LLM
    tdir = tmp_path_factory.mktemp("target")
    hf = make_hf_model(tdir, "llama", num_layers=num_layers)
    head = str(tmp_path_factory.mktemp("head"))
    make_eagle3_head(head, hf, "safeailab", draft_vocab_size=64, seed=3)
    plain = LLM(str(tdir), device=TEST_DEVICE, dtype="float32").generate(prompts, params)
    return str(tdir), hf, head, [o.outputs[0].token_ids for o in plain]
