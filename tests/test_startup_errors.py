"""Every start-up error is one line naming the field and its allowed range, with exit status
2 and no traceback: bad flags, config.json values past any real model's, weights that would
not fit, quantized weight dtypes, tokenizer files outside the model directory. Also the
offline side of the availability rules: grammars that admit nothing or reference remote
schemas are refused when the request is added, and `cache_salt` separates prefix-cache
namespaces for LLM.generate as it does for the server."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_hf_model
from onespec import LLM, SamplingParams, StructuredOutputsParams
from onespec.cli import main
from onespec.config import Eagle3Config

VOCAB = 300


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("startup") / "base"
    make_hf_model(path, "llama", vocab_size=VOCAB)
    return path


def variant(base, tmp_path, **config) -> str:
    """A copy of the base model with config.json fields replaced."""
    path = tmp_path / "variant"
    shutil.copytree(base, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **config}))
    return str(path)


def one_error_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]
    assert code == 2 and len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def generate(model: str, *flags: str) -> list[str]:
    return ["generate", "--model", model, "--device", "cpu", "--prompt-ids", "1,2,3",
            "--max-tokens", "2", *flags]


BAD_CONFIGS = [
    (dict(max_position_embeddings=2**63), "field 'max_position_embeddings' must be an integer "
                                          "in [1, 67108864], got 9223372036854775808"),
    (dict(hidden_size=2**20), "field 'hidden_size' must be an integer in [1, 131072]"),
    (dict(hidden_size=1 << 16, intermediate_size=1 << 18, num_hidden_layers=4000),
     "loading the model's weights in float32 (hidden_size=65536, num_hidden_layers=4000"),
    (dict(rope_parameters={"rope_type": "linear", "factor": -2.0, "rope_theta": 1e4}),
     "rope field 'factor' must be a positive finite number, got -2.0"),
    (dict(rope_parameters={"rope_type": "linear", "factor": "x", "rope_theta": 1e4}),
     "rope field 'factor' must be a positive finite number, got 'x'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
     "field 'rope_theta' must be a positive finite number, got nan"),
    (dict(eos_token_id=2**64), f"field 'eos_token_id' must hold token ids in [0, vocab_size = "
                               f"{VOCAB}), got 18446744073709551616"),
    (dict(eos_token_id=[2, VOCAB]), f"[0, vocab_size = {VOCAB}), got {VOCAB}"),
]


@pytest.mark.parametrize("config,message", BAD_CONFIGS, ids=[m[:40] for _, m in BAD_CONFIGS])
def test_bad_config_values_are_one_line(base, tmp_path, capsys, config, message):
    model = variant(base, tmp_path, **config)
    line = one_error_line(capsys, generate(model))
    assert line.startswith(f"onespec generate: error: {model}/config.json: "), line
    assert message in line, line


@pytest.mark.parametrize("flags,message", [
    (["--num-kv-blocks", str(10**11)], "num_kv_blocks=100000000000 (KV cache) needs "),
    (["--device", "tpu"], "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (["--device", "cuda:x"], "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"),
])
def test_bad_flags_are_one_line(base, capsys, flags, message):
    line = one_error_line(capsys, generate(str(base), *flags))     # the last --device wins
    assert message in line, line


def test_quantized_weights_are_refused(base, tmp_path, capsys):
    model = variant(base, tmp_path)
    file = os.path.join(model, "model.safetensors")
    weights = load_file(file)
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name].to(torch.int8)
    save_file(weights, file)
    line = one_error_line(capsys, generate(model))
    assert f"weight {name!r} is stored as int8, which onespec does not load" in line, line


def test_tokenizer_files_must_stay_inside_the_model_directory(base, tmp_path, capsys):
    model = variant(base, tmp_path)
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    os.symlink(outside, os.path.join(model, "tokenizer.json"))
    line = one_error_line(capsys, generate(model))
    assert "names 'tokenizer.json', which resolves to" in line and "outside the model" in line


def test_serve_limits_and_device_are_one_line_from_a_real_process(base):
    for flags, message in [(["--grammar-compile-timeout", "0"],
                            "--grammar-compile-timeout must be a number of seconds in "
                            "(0, 86400], got 0.0"),
                           (["--max-chat-messages", "0"],
                            "--max-chat-messages must be an integer >= 1, got 0"),
                           (["--device", "tpu"], "got 'tpu'")]:
        proc = subprocess.run([sys.executable, "-m", "onespec", "serve", "--model", str(base),
                               *flags], capture_output=True, text=True, timeout=120)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("onespec serve: error: ") and message in lines[0], lines


def test_draft_len_schedule_keys_must_be_integers(tmp_path):
    with pytest.raises(ValueError, match=r"draft_len_schedule key \(batch size\) must be an "
                                         r"integer >= 1, got 1\.5"):
        Eagle3Config(str(tmp_path), draft_len_schedule={1.5: 2})
    assert Eagle3Config(str(tmp_path), draft_len_schedule={"8": 2}).draft_len_schedule == {8: 2}


# ---- the offline side of admission ----------------------------------------------------------
@pytest.fixture(scope="module")
def demo_llm():
    from onespec.demo import TARGET_DIR
    llm = LLM(TARGET_DIR, device="cpu", dtype="float32", max_batch_size=4)
    yield llm
    llm.close()


@pytest.mark.parametrize("spec,message", [
    (dict(regex=r"[^\s\S]"), "admits no output at all"),
    (dict(grammar="root ::= root"), "admits no output at all"),
])
def test_grammars_that_admit_nothing_are_refused_when_added(demo_llm, spec, message):
    pytest.importorskip("xgrammar")
    sp = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=message):
        demo_llm.generate("x = ", sp)
    assert demo_llm.engine.pool.num_free_blocks == demo_llm.engine.pool.num_blocks


@pytest.mark.parametrize("ref", ["http://127.0.0.1:9/s.json", "file:///etc/passwd",
                                 "other.json#/defs/a"])
def test_schemas_referencing_outside_themselves_are_refused(ref):
    with pytest.raises(ValueError, match="points outside the schema"):
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": ref}}})
    StructuredOutputsParams(json={"$defs": {"a": {"type": "integer"}},
                                  "properties": {"a": {"$ref": "#/$defs/a"}}})


def test_cache_salt_separates_prefix_cache_namespaces_offline(demo_llm):
    prompt = "def read_config(path):\n    with open(path) as f:\n        return f.read()\n" * 3
    sp = SamplingParams(max_tokens=4)
    first = demo_llm.generate({"prompt": prompt, "cache_salt": "a"}, sp)[0]
    other = demo_llm.generate({"prompt": prompt, "cache_salt": "b"}, sp)[0]
    plain = demo_llm.generate(prompt, sp)[0]
    again = demo_llm.generate({"prompt": prompt, "cache_salt": "a"}, sp)[0]
    assert first.num_cached_tokens == other.num_cached_tokens == plain.num_cached_tokens == 0
    assert again.num_cached_tokens >= 32
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == \
        plain.outputs[0].token_ids == again.outputs[0].token_ids
    with pytest.raises(ValueError, match="exactly one of 'prompt' and 'prompt_token_ids'"):
        demo_llm.generate({"text": prompt}, sp)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        demo_llm.generate({"prompt": prompt, "cache_salt": ""}, sp)
