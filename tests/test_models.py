"""The target models against Hugging Face transformers, for every supported architecture:
greedy generation token for token (batched, chunked prefill, preemption), prefill logits,
captured residual streams, dtypes, checkpoint layouts and config.json styles."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from conftest import ARCH_CONFIGS, TEST_DEVICE, assert_pool_full, hf_greedy, make_hf_model
from onespec import LLM, SamplingParams

ARCHS = list(ARCH_CONFIGS)
PROMPT_LENS = (1, 7, 19, 40)
NEW_TOKENS = 16
BLOCK = 4


def make_prompts(lens=PROMPT_LENS, vocab: int = 128, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


PROMPTS = make_prompts()


_HF_REFS: dict[str, list[list[int]]] = {}


def hf_refs(tiny_models, arch: str) -> list[list[int]]:
    """transformers' greedy continuation of each of PROMPTS (computed once per arch)."""
    if arch not in _HF_REFS:
        model = tiny_models[arch][1]
        _HF_REFS[arch] = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    return _HF_REFS[arch]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def engine_prefill(llm, prompts: list[list[int]], capture: tuple[int, ...] = ()):
    """Prefills whole prompts in one engine step (one batched forward over the engine's paged
    KV pool), recording the target's output. Returns per prompt (logits [T, V] of every row,
    captured residual streams [T, len(capture)·H] or None)."""
    model = llm.engine.model
    original, seen = model.forward, []

    def recording(input_ids, positions, meta, engine_capture=()):
        hidden, captured = original(input_ids, positions, meta, capture)
        seen.append((input_ids.tolist(), positions.tolist(), hidden, captured))
        return hidden, None

    model.forward = recording
    try:
        llm.generate(prompts, SamplingParams(max_tokens=1))
    finally:
        del model.forward
    assert_pool_full(llm)
    (ids, positions, hidden, captured), = seen           # every prompt in one forward
    assert ids == [t for p in prompts for t in p]
    assert positions == [i for p in prompts for i in range(len(p))]
    with torch.no_grad():
        logits = model.compute_logits(hidden)
    out, start = [], 0
    for p in prompts:
        rows = slice(start, start + len(p))
        out.append((logits[rows], None if captured is None else captured[rows]))
        start += len(p)
    return out


@torch.no_grad()
def hf_forward(model, prompt: list[int]):
    return model(torch.tensor([prompt]), output_hidden_states=True)


def generate_ids(llm, prompts, max_tokens=NEW_TOKENS, **sp):
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp))
    return [o.outputs[0].token_ids for o in outs]


# ---- greedy generation ---------------------------------------------------------------------
ENGINE_MODES = {
    "batched": dict(),
    "chunked-prefill": dict(max_num_tokens=7),
    "preemption": dict(block_size=BLOCK, max_model_len=64, num_kv_blocks=-(-65 // BLOCK)),
}


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_models, arch, mode):
    path, _ = tiny_models[arch]
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, **ENGINE_MODES[mode])
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out, ref in zip(PROMPTS, outs, hf_refs(tiny_models, arch)):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == ref, f"{arch}/{mode}: prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"
    if mode == "preemption":
        assert llm.stats()["num_preemptions"] > 0
    assert_pool_full(llm)


def test_mistral_sliding_window_matches_transformers(tmp_path):
    window = 8                                         # shorter than most sequences here
    hf = make_hf_model(tmp_path, "mistral", num_layers=2, sliding_window=window)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    for kw in (dict(), dict(max_num_tokens=7), ENGINE_MODES["preemption"]):
        llm = LLM(str(tmp_path), dtype="float32", device=TEST_DEVICE, **kw)
        assert llm.engine.model.config.sliding_window == window
        assert generate_ids(llm, PROMPTS) == refs, kw
        assert_pool_full(llm)


# ---- logits and hidden states --------------------------------------------------------------
def small_pool_llm(path, **kw) -> LLM:
    """An engine with 4-slot blocks handed out in shuffled order (block tables are not
    contiguous ranges), without prefix caching (engine_prefill records whole prompts)."""
    llm = LLM(path, **{"dtype": "float32", "device": "cpu", "block_size": BLOCK,
                       "max_model_len": 64, "enable_prefix_caching": False, **kw})
    random.Random(0).shuffle(llm.engine.pool.free_blocks)
    return llm


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_models, arch):
    path, hf = tiny_models[arch]
    llm = small_pool_llm(path)
    for prompt, (logits, _) in zip(PROMPTS, engine_prefill(llm, PROMPTS)):
        ref = hf_forward(hf, prompt).logits[0]
        assert logits.shape == ref.shape
        assert rel_err(logits, ref) < 1e-4, f"{arch}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_captured_residual_streams_match_hidden_states(tiny_models, arch):
    path, hf = tiny_models[arch]
    llm = small_pool_llm(path)
    cfg = llm.engine.model.config
    capture = (0, 2, 1)                 # any order, all < L - 1 (HF's last state is normed)
    assert max(capture) < cfg.num_hidden_layers - 1
    prompts = PROMPTS[1:3]
    for prompt, (_, captured) in zip(prompts, engine_prefill(llm, prompts, capture)):
        states = hf_forward(hf, prompt).hidden_states
        assert captured.shape == (len(prompt), len(capture) * cfg.hidden_size)
        for slot, layer in enumerate(capture):
            got = captured[:, slot * cfg.hidden_size:(slot + 1) * cfg.hidden_size]
            assert rel_err(got, states[layer + 1][0]) < 1e-4, f"layer {layer}"
            # the residual stream after layer i is not the one after any other layer
            assert rel_err(got, states[layer][0]) > 1e-2
    (_, one), = engine_prefill(llm, [prompts[0]], (1,))
    assert rel_err(one, hf_forward(hf, prompts[0]).hidden_states[2][0]) < 1e-4
    (_, none), = engine_prefill(llm, [prompts[0]])
    assert none is None


# ---- dtypes --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_generates(tiny_models, dtype):
    path, _ = tiny_models["qwen2"]
    llm = LLM(path, dtype=dtype, device="cpu")
    model = llm.engine.model
    torch_dtype = getattr(torch, dtype)
    assert all(p.dtype == torch_dtype for p in model.parameters())
    assert model.model.layers[0].self_attn.k_cache.dtype == torch_dtype
    (logits, captured), = engine_prefill(llm, [PROMPTS[2]], (0, 1))
    assert logits.shape == (len(PROMPTS[2]), model.config.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert captured.dtype == torch_dtype and captured.shape == (len(PROMPTS[2]),
                                                                2 * model.config.hidden_size)
    outs = generate_ids(llm, PROMPTS[:2], max_tokens=8)
    assert [len(o) for o in outs] == [8, 8]
    assert all(0 <= t < model.config.vocab_size for o in outs for t in o)
    assert_pool_full(llm)


# ---- checkpoint layouts and config styles --------------------------------------------------
def copy_config(src: str, dst) -> None:
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))


def test_sharded_safetensors_load(tiny_models, tmp_path):
    _, hf = tiny_models["llama3-rope-tied"]
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    assert generate_ids(llm, PROMPTS) == hf_refs(tiny_models, "llama3-rope-tied")
    assert_pool_full(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])      # untied and tied lm_head
def test_pytorch_model_bin_loads(tiny_models, tmp_path, arch):
    path, hf = tiny_models[arch]
    copy_config(path, tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert not (tmp_path / "model.safetensors").exists()
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    assert generate_ids(llm, PROMPTS) == hf_refs(tiny_models, arch)
    assert_pool_full(llm)


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("style", ["transformers-5", "transformers-4"])
@pytest.mark.parametrize("rope", list(ROPE_CASES))
def test_config_styles_load(tmp_path, rope, style):
    theta = 1000.0                                   # not the 10000 default: must be read
    hf = make_hf_model(tmp_path / "hf", "llama", num_layers=2,
                       rope_parameters={**ROPE_CASES[rope], "rope_theta": theta})
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_theta"] == theta
    if style == "transformers-4":
        params = cfg.pop("rope_parameters")
        kind = params.pop("rope_type")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = {"type": kind, **params}
        (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path / "hf"), dtype="float32", device="cpu")
    assert llm.engine.model.config.rope_theta == theta
    prompt = PROMPTS[3]
    (logits, _), = engine_prefill(llm, [prompt])
    assert rel_err(logits, hf_forward(hf, prompt).logits[0]) < 1e-4


def test_directory_without_tokenizer_takes_token_ids(tiny_models):
    path, hf = tiny_models["mistral"]
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    assert not any(os.path.exists(os.path.join(path, n)) for n in names)
    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.tokenizer is None
    out, = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert out.outputs[0].token_ids == hf_refs(tiny_models, "mistral")[1]
    assert out.outputs[0].text == "" and out.prompt is None
    single, = llm.generate(PROMPTS[1], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert single.outputs[0].token_ids == out.outputs[0].token_ids
    assert_pool_full(llm)
