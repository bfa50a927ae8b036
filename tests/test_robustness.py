"""Robustness offline: numeric fields at the edges of what the engine represents, tiny
temperatures, a failing request that must not take its batch down, seeded sampling that
preemption / chunking / batching / speculation cannot change, and model directories
written by a careless or hostile hand (wrong types, binary files, paths that leave the
directory, pickles that would run code)."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from conftest import assert_pool_full, make_eagle3_head
from onespec import LLM, Eagle3Config, SamplingParams
from onespec.layers.sampler import probs_from_logits

VOCAB = 128
NUM_SEEDED = 20


@pytest.fixture(scope="module")
def dirs(tiny_models, tmp_path_factory):
    """(target, EAGLE-3 head) directories: conftest's tiny llama and a random head for it."""
    target, hf = tiny_models["llama"]
    head = tmp_path_factory.mktemp("robust") / "head"
    make_eagle3_head(head, hf)
    return target, str(head)


@pytest.fixture(scope="module")
def llm(dirs):
    return LLM(dirs[0], dtype="float32", device="cpu")


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (int(torch.randint(3, 20, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---- 1. numeric fields -------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    (dict(top_k=2**63), "top_k"),
    (dict(seed=2**63), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-2**63 - 1), "seed"),
    (dict(seed=True), "seed"),
    (dict(max_tokens=2**63), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=[2**63]), "stop_token_ids"),
    (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(temperature="0.5"), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e308), "temperature"),
    (dict(temperature=100.5), "temperature"),
    (dict(top_p="0.9"), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(ignore_eos=1), "ignore_eos"),
])
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


def test_extreme_valid_values_run(llm):
    """The largest accepted values reach the sampling tensors without overflowing."""
    sps = [SamplingParams(max_tokens=4, temperature=100.0, top_k=2**63 - 1, seed=2**63 - 1),
           SamplingParams(max_tokens=4, temperature=0.5, seed=-2**63, top_p=1e-9),
           SamplingParams(max_tokens=2**63 - 1, stop_token_ids=[VOCAB - 1], ignore_eos=True)]
    outs = llm.generate([[5, 6, 7]] * 3, sps)
    assert [len(t) for t in token_ids(outs)[:2]] == [4, 4]
    assert outs[2].outputs[0].finish_reason in ("length", "stop")
    with pytest.raises(ValueError, match=rf"stop_token_ids must be token ids in \[0, {VOCAB}\)"):
        llm.generate([5, 6], SamplingParams(stop_token_ids=[VOCAB]))
    assert_pool_full(llm)


# ---- 2. tiny temperatures ------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-38, 3e-39, 1e-45, 9.9e-6])
def test_temperature_below_floor_is_greedy(llm, temperature):
    sp = SamplingParams(max_tokens=12, temperature=temperature, ignore_eos=True)
    assert sp.temperature == 0.0 and sp.greedy
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    ps = prompts(3)
    assert token_ids(llm.generate(ps, sp)) == token_ids(llm.generate(ps, greedy))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_distributions_stay_finite_at_the_edges(dtype):
    big = torch.finfo(dtype).max
    logits = torch.tensor([[big, -big, 0.0, 1.0], [3e4, 2e4, -3e4, 0.0],
                           [float("-inf"), 1.0, 2.0, 3.0]], dtype=dtype)
    for temperature in (1e-5, 1.0, 100.0):
        probs = probs_from_logits(logits, torch.full((3,), temperature),
                                  torch.zeros(3, dtype=torch.int64), torch.ones(3))
        assert torch.isfinite(probs).all()
        assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert probs_from_logits(logits, torch.full((3,), 1e-5), torch.zeros(3, dtype=torch.int64),
                             torch.ones(3)).argmax(-1).tolist() == [0, 0, 3]


# ---- 1. a failing request ends alone -------------------------------------------------------
def test_failing_request_ends_alone_and_the_others_finish(llm):
    ps = prompts(5)
    sps = [SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True)
           for i in range(5)]
    expected = token_ids(llm.generate(ps, sps))
    poisoned = SamplingParams(max_tokens=10, temperature=0.8, ignore_eos=True)
    poisoned.top_k = 2**70          # past validation: it overflows building the step's tensors
    outs = llm.generate(ps[:3] + [[9, 9, 9]] + ps[3:], sps[:3] + [poisoned] + sps[3:])
    assert outs[3].outputs[0].finish_reason == "error" and outs[3].outputs[0].token_ids == []
    assert token_ids(outs[:3] + outs[4:]) == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs[:3] + outs[4:])
    assert_pool_full(llm)
    assert token_ids(llm.generate(ps, sps)) == expected        # and the engine goes on


# ---- 5. seeded sampling depends on (seed, position) only -------------------------------
def seeded_params(max_tokens: int = 16) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=s, ignore_eos=True)
            for s in range(NUM_SEEDED)]


def test_seeded_outputs_survive_preemption_chunking_and_batching(dirs, llm):
    ps, sps = prompts(NUM_SEEDED), seeded_params()
    expected = token_ids(llm.generate(ps, sps))
    assert len({tuple(t) for t in expected}) == NUM_SEEDED

    tight = LLM(dirs[0], dtype="float32", device="cpu", block_size=4, max_model_len=48,
                num_kv_blocks=17)
    assert token_ids(tight.generate(ps, sps)) == expected
    assert tight.stats()["num_preemptions"] > 0
    assert_pool_full(tight)

    chunked = LLM(dirs[0], dtype="float32", device="cpu", max_num_tokens=7, max_batch_size=5)
    assert token_ids(chunked.generate(ps, sps)) == expected

    # other company: reversed order, unseeded and greedy requests interleaved
    others = prompts(NUM_SEEDED + 4)[NUM_SEEDED:]
    mixed = llm.generate(ps[::-1] + others, sps[::-1] + [
        SamplingParams(max_tokens=16, temperature=1.0), SamplingParams(max_tokens=5)] * 2)
    assert token_ids(mixed[:NUM_SEEDED])[::-1] == expected
    assert_pool_full(llm)


def test_seeded_outputs_do_not_depend_on_speculation(dirs, llm):
    """With exact-match acceptance every emitted token is the target's own draw at its
    position, so a seeded request gives the same text with or without drafts."""
    ps, sps = prompts(8), seeded_params(12)[:8]
    expected = token_ids(llm.generate(ps, sps))
    for k in (1, 3):
        spec = LLM(dirs[0], dtype="float32", device="cpu",
                   speculative_config=Eagle3Config(dirs[1], max_draft_len=k))
        assert token_ids(spec.generate(ps, sps)) == expected
        assert_pool_full(spec)


def test_seeded_rejection_sampling_independent_of_batch_and_chunking(dirs):
    """(Preemption can change it: the recomputed request samples its next token from p
    instead of verifying the draft it had.)"""
    ps, sps = prompts(8), seeded_params(12)[:8]
    spec = Eagle3Config(dirs[1], max_draft_len=2, use_rejection_sampling=True)
    roomy = LLM(dirs[0], dtype="float32", device="cpu", speculative_config=spec)
    expected = token_ids(roomy.generate(ps, sps))
    assert token_ids(roomy.generate(ps[::-1], sps[::-1]))[::-1] == expected
    chunked = LLM(dirs[0], dtype="float32", device="cpu", speculative_config=spec,
                  max_num_tokens=6, max_batch_size=3)
    assert token_ids(chunked.generate(ps, sps)) == expected
    assert_pool_full(chunked)


# ---- 6, 7. model directories ---------------------------------------------------------------
@pytest.fixture
def model_copy(dirs, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(dirs[0], dst)
    return dst


def load(path):
    return LLM(str(path), dtype="float32", device="cpu")


def edit_json(file, fn):
    data = json.loads(file.read_text())
    fn(data)
    file.write_text(json.dumps(data))


@pytest.mark.parametrize("field,value,want", [
    ("hidden_size", "256", "a positive integer"),
    ("num_hidden_layers", 2.0, "a positive integer"),
    ("num_attention_heads", 0, "a positive integer"),
    ("vocab_size", True, "a positive integer"),
    ("rms_norm_eps", "1e-6", "a positive number"),
    ("tie_word_embeddings", "false", "true or false"),
    ("eos_token_id", [2, "3"], "a token id"),
])
def test_config_field_of_wrong_type(model_copy, field, value, want):
    edit_json(model_copy / "config.json", lambda c: c.update({field: value}))
    cfg = re.escape(str(model_copy / "config.json"))
    with pytest.raises(ValueError, match=f"^{cfg}: field '{field}' must be {want}"):
        load(model_copy)


def test_head_config_field_of_wrong_type(dirs, tmp_path):
    head = tmp_path / "head"
    shutil.copytree(dirs[1], head)
    edit_json(head / "config.json", lambda c: c.update({"draft_vocab_size": "64"}))
    with pytest.raises(ValueError, match=re.escape(str(head / "config.json")) +
                       ": field 'draft_vocab_size' must be a positive integer"):
        LLM(dirs[0], dtype="float32", device="cpu",
            speculative_config=Eagle3Config(str(head)))


def test_binary_config_names_the_file(model_copy):
    (model_copy / "config.json").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=re.escape(str(model_copy / "config.json")) +
                       " is not valid JSON"):
        load(model_copy)


def shard(model_copy, weight_map) -> None:
    index = {"metadata": {}, "weight_map": weight_map}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))


def test_broken_weight_index_names_the_file(model_copy):
    index = model_copy / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": ')
    with pytest.raises(ValueError, match=re.escape(str(index)) + " is not valid JSON"):
        load(model_copy)
    index.write_text('{"weight_map": ["model.safetensors"]}')
    with pytest.raises(ValueError, match=re.escape(str(index)) + ' must hold .*"weight_map"'):
        load(model_copy)


def test_shard_paths_must_stay_in_the_directory(model_copy, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(model_copy / "model.safetensors", outside)
    (model_copy / "link.safetensors").symlink_to(outside)
    cases = [("../../../../etc/passwd", "outside the model directory"),
             ("/dev/urandom", "an absolute path"),
             ("sub/../../outside.safetensors", "outside the model directory"),
             ("link.safetensors", "outside the model directory")]
    for name, why in cases:
        shard(model_copy, {"model.embed_tokens.weight": name})
        with pytest.raises(ValueError, match=f"names '{re.escape(name)}'.*{why}.*refused"):
            load(model_copy)
    os.remove(model_copy / "model.safetensors.index.json")
    os.remove(model_copy / "config.json")
    (model_copy / "config.json").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="config.json.*outside the model directory"):
        load(model_copy)


def test_shards_inside_the_directory_load(model_copy, dirs):
    os.makedirs(model_copy / "weights")
    shutil.move(model_copy / "model.safetensors", model_copy / "weights" / "w.safetensors")
    shard(model_copy, {"model.embed_tokens.weight": "weights/../weights/w.safetensors"})
    outs = load(model_copy).generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    ref = LLM(dirs[0], dtype="float32", device="cpu").generate([[5, 6, 7]],
                                                               SamplingParams(max_tokens=4))
    assert token_ids(outs) == token_ids(ref)


def test_hugging_face_cache_links_into_blobs_load(dirs, tmp_path):
    """The hub's cache links snapshots/REV/* to ../../blobs/*: that way out is allowed."""
    repo = tmp_path / "models--tiny--llama"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    os.makedirs(snapshot)
    os.makedirs(blobs)
    for name in os.listdir(dirs[0]):
        shutil.copy(os.path.join(dirs[0], name), blobs / f"blob-{name}")
        (snapshot / name).symlink_to(f"../../blobs/blob-{name}")
    outs = load(snapshot).generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert token_ids(outs) == token_ids(load(dirs[0]).generate([[5, 6, 7]],
                                                              SamplingParams(max_tokens=4)))


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this should never run",))


def test_pickle_that_would_run_code_is_refused(model_copy):
    os.remove(model_copy / "model.safetensors")
    with open(model_copy / "pytorch_model.bin", "wb") as f:
        torch.save({"model.embed_tokens.weight": _RunsCode()}, f)
    with pytest.raises(ValueError, match="refused: this file would run code on load"):
        load(model_copy)
    torch.save({"w": torch.zeros(64)}, model_copy / "pytorch_model.bin")
    (model_copy / "pytorch_model.bin").write_bytes(
        (model_copy / "pytorch_model.bin").read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated, corrupt"):
        load(model_copy)
