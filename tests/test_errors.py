"""Clear errors: each message names the bad field or key and what would have been allowed."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_pool_full
from onespec import LLM, EngineConfig, SamplingParams
from onespec.models.llama import ARCHITECTURES

ARCH = "llama"


@pytest.fixture
def model_copy(tiny_models, tmp_path):
    """A writable copy of the tiny llama checkpoint."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_models[ARCH][0], dst)
    return dst


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models[ARCH][0], dtype="float32", device="cpu", max_model_len=16)


def load(path, **kw):
    return LLM(str(path), **{"dtype": "float32", "device": "cpu", **kw})


def edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_weights(path, fn):
    file = path / "model.safetensors"
    weights = load_file(file)
    fn(weights)
    save_file(weights, file)


# ---- model directory -----------------------------------------------------------------------
def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing)) + ".*does not exist"):
        load(missing)


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load(tmp_path)


def test_malformed_config_json(model_copy):
    (model_copy / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load(model_copy)


def test_config_json_not_an_object(model_copy):
    (model_copy / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load(model_copy)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_hidden_layers",
                                   "num_attention_heads", "intermediate_size"])
def test_config_missing_required_field(model_copy, field):
    edit_config(model_copy, lambda c: c.pop(field))
    with pytest.raises(ValueError, match=f"required field '{field}'"):
        load(model_copy)


def test_unsupported_architecture(model_copy):
    edit_config(model_copy, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="unsupported architecture") as e:
        load(model_copy)
    assert "GPT2LMHeadModel" in str(e.value)
    assert all(a in str(e.value) for a in ARCHITECTURES)


def test_unsupported_rope_type(model_copy):
    edit_config(model_copy, lambda c: c.update(rope_parameters={"rope_type": "yarn",
                                                                "factor": 2.0}))
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported.*llama3"):
        load(model_copy)


def test_missing_weights_file(model_copy):
    os.remove(model_copy / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="holds no weights.*model.safetensors"):
        load(model_copy)


@pytest.mark.parametrize("damage", ["truncated", "garbage-bin"])
def test_unreadable_weights_file(model_copy, damage):
    file = model_copy / "model.safetensors"
    if damage == "truncated":
        os.truncate(file, os.path.getsize(file) - 100)
    else:
        os.remove(file)
        file = model_copy / "pytorch_model.bin"
        file.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="cannot read weights file") as e:
        load(model_copy)
    assert repr(str(file)) in str(e.value)


@pytest.mark.parametrize("key", ["model.layers.1.mlp.down_proj.weight",
                                 "model.layers.0.self_attn.k_proj.weight"])   # packed or not
def test_weight_of_wrong_shape(model_copy, key):
    def shrink(w):
        w[key] = w[key][:, :-1].contiguous()
    edit_weights(model_copy, shrink)
    rows, cols = load_file(model_copy / "model.safetensors")[key].shape
    with pytest.raises(ValueError) as e:
        load(model_copy)
    msg = str(e.value)
    assert repr(key) in msg
    assert f"({rows}, {cols})" in msg and f"({rows}, {cols + 1})" in msg


@pytest.mark.parametrize("key", ["model.norm.weight", "lm_head.weight",
                                 "model.layers.2.self_attn.v_proj.weight",
                                 "model.layers.3.mlp.up_proj.weight"])
def test_missing_weight(model_copy, key):
    edit_weights(model_copy, lambda w: w.pop(key))
    with pytest.raises(ValueError, match="missing weights") as e:
        load(model_copy)
    assert key in str(e.value)


def test_unexpected_weight(model_copy):
    edit_weights(model_copy, lambda w: w.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected weights.*model.extra.weight"):
        load(model_copy)


# ---- prompts -------------------------------------------------------------------------------
def test_prompt_over_max_model_len(llm):
    with pytest.raises(ValueError, match="16 tokens; max_model_len is 16.*at most 15"):
        llm.generate([list(range(3, 19))])
    assert_pool_full(llm)


def test_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5, 6, 7], list(range(3, 30))])
    assert_pool_full(llm)
    out, = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert len(out.outputs[0].token_ids) <= 2         # only the new request ran


@pytest.mark.parametrize("prompt", [[], [5, 128], [5, -1], [5, 2.0]])
def test_bad_token_id_prompts(llm, prompt):
    with pytest.raises(ValueError, match=r"non-empty list of ints in \[0, 128\)"):
        llm.generate([prompt])
    with pytest.raises(ValueError, match=r"non-empty list of ints in \[0, 128\)"):
        llm.engine.add_request(prompt)
    assert_pool_full(llm)


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="no tokenizer files.*token ids"):
        llm.generate("hello")
    assert_pool_full(llm)


def test_mismatched_sampling_params(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams()])
    assert_pool_full(llm)


# ---- parameters ----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,pattern", [
    (dict(max_tokens=0), r"max_tokens must be an integer >= 1, got 0"),
    (dict(temperature=-1.0), r"temperature must be >= 0.*got -1.0"),
    (dict(temperature=float("nan")), r"temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-2), r"top_k must be an integer >= 0.*got -2"),
    (dict(seed="1"), r"seed must be an integer"),
    (dict(stop_token_ids=[-3]), r"stop_token_ids must be non-negative integers, got -3"),
])
def test_invalid_sampling_params(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_unknown_llm_argument(tiny_models):
    with pytest.raises(TypeError, match=r"unknown LLM arguments \['max_seqs'\]") as e:
        LLM(tiny_models[ARCH][0], max_seqs=4)
    assert "max_batch_size" in str(e.value)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(block_size=0), r"block_size must be an integer in \[1, 4096\], got 0"),
    (dict(dtype="int8"), r"dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\), "
                         r"got 'int8'"),
    (dict(max_num_tokens=0), r"max_num_tokens must be an integer >= 1, got 0"),
    (dict(max_model_len=1), r"max_model_len must be an integer >= 2, got 1"),
    (dict(kv_cache_memory_fraction=0.0), r"kv_cache_memory_fraction must be in \(0, 1\]"),
    (dict(overlap_scheduler="yes"), r"overlap_scheduler must be True or False, got 'yes'"),
    (dict(programmatic_launch=1), r"programmatic_launch must be True or False, got 1"),
])
def test_invalid_engine_config(tiny_models, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        EngineConfig(model=tiny_models[ARCH][0], **kwargs)
    with pytest.raises(ValueError, match=pattern):
        load(tiny_models[ARCH][0], **kwargs)


def test_kv_pool_too_small_for_one_request(tiny_models):
    with pytest.raises(ValueError, match=r"num_kv_blocks=3 cannot hold one request.*>= 5 blocks"):
        load(tiny_models[ARCH][0], num_kv_blocks=3, block_size=16, max_model_len=64)


@pytest.fixture
def with_tokenizer(model_copy):
    """The tiny checkpoint plus a word-level tokenizer (ids < 128)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = "the a cat dog sat on mat".split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model_copy / "tokenizer.json"))
    (model_copy / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
         "bos_token": "<s>", "eos_token": "</s>"}))
    return load(model_copy)


def test_empty_text_prompt(with_tokenizer):
    llm = with_tokenizer
    assert llm.tokenizer is not None
    for bad in ("", "   "):
        with pytest.raises(ValueError, match="the prompt is empty"):
            llm.generate(bad)
        with pytest.raises(ValueError, match="the prompt is empty"):
            llm.engine.add_request(bad)
    assert_pool_full(llm)
    text, = llm.generate("the cat sat", SamplingParams(max_tokens=4, ignore_eos=True))
    ids, = llm.generate([[3, 5, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert text.prompt_token_ids == [3, 5, 7] and text.prompt == "the cat sat"
    assert text.outputs[0].token_ids == ids.outputs[0].token_ids
    assert text.outputs[0].text == llm.tokenizer.decode(ids.outputs[0].token_ids,
                                                        skip_special_tokens=True)
