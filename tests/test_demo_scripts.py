"""End-to-end check of the demo-target scripts at a tiny scale (CPU, well under a minute).

Runs scripts/prepare_code_data.py --stdlib-only (twice, to check determinism) and
scripts/train_demo_target.py into a tmp dir, then loads the result with transformers.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PREPARE = REPO / "scripts" / "prepare_code_data.py"
TRAIN = REPO / "scripts" / "train_demo_target.py"


def _run(*args: str | Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{args[0]} failed:\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}"
    return proc


def _read(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    data_a, data_b = tmp / "data_a", tmp / "data_b"
    _run(PREPARE, "--out", data_a, "--stdlib-only", "--max-files", "12")
    _run(PREPARE, "--out", data_b, "--stdlib-only", "--max-files", "12")
    out = tmp / "target"
    log = tmp / "log.jsonl"
    proc = _run(
        TRAIN, "--data", data_a, "--out", out, "--device", "cpu",
        "--steps", "3", "--batch-size", "2", "--seq-len", "64", "--vocab-size", "512",
        "--eval-every", "2", "--eval-windows", "4", "--log-every", "1", "--log", log, "--no-progress",
    )
    return dict(data_a=data_a, data_b=data_b, out=out, log=log, stdout=proc.stdout)


def test_split_deterministic_and_disjoint(pipeline):
    a, b = pipeline["data_a"], pipeline["data_b"]
    for name in ("train.jsonl.gz", "heldout.jsonl.gz", "sources.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between runs"
    train, held = _read(a / "train.jsonl.gz"), _read(a / "heldout.jsonl.gz")
    assert len(train) == len(held) == 12
    tp, hp = {r["path"] for r in train}, {r["path"] for r in held}

    def module(path):                       # stdlib/<top-level module or package>/...
        return path.split("/")[1].removesuffix(".py")

    # whole top-level modules are held out, never single files of a trained one
    assert not {module(p) for p in tp} & {module(p) for p in hp}
    assert all(zlib.crc32(module(p).encode()) % 20 == 0 for p in hp)
    assert all(zlib.crc32(module(p).encode()) % 20 != 0 for p in tp)
    assert [r["path"] for r in train] == sorted(tp)
    for p in tp | hp:
        parts = p.split("/")
        assert parts[0] == "stdlib" and p.endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages", "_vendor"} & set(parts)
    assert all(r["text"] for r in train + held)
    sources = json.loads((a / "sources.json").read_text())
    assert [s["name"] for s in sources] == ["stdlib"] and sources[0]["licence"] == "PSF-2.0"


def test_packages_are_pinned_permissive_and_held_out_whole():
    """The PyPI part of the corpus (not installed here: that needs the network): exact
    versions, permissive licences, and held-out packages that no trained one vendors."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from prepare_code_data import PACKAGES
    finally:
        sys.path.pop(0)
    names = [name for name, *_ in PACKAGES]
    assert len(set(names)) == len(names)
    permissive = {"MIT", "BSD-2-Clause", "BSD-3-Clause", "Apache-2.0"}
    for name, version, licence, split in PACKAGES:
        assert version[0].isdigit() and split in ("train", "heldout"), name
        assert set(licence.split(" OR ")) <= permissive, (name, licence)
    held = {name for name, *_, split in PACKAGES if split == "heldout"}
    assert held and len(held) < len(names) / 2
    assert not {"pip", "setuptools"} & set(names)    # they vendor rich and more-itertools


def test_tokenizer_roundtrip(pipeline):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pipeline["out"])
    assert tok.bos_token == tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert tok.bos_token_id == tok.eos_token_id == 0 and tok.pad_token_id == 1
    assert len(tok) <= 512
    chat = tok.apply_chat_template([{"role": "user", "content": "Sort a list.\nIn place."},
                                    {"role": "assistant", "content": "xs.sort()"}], tokenize=False)
    assert chat == "# Sort a list.\n# In place.\nxs.sort()\n"
    recs = _read(pipeline["data_a"] / "train.jsonl.gz")[:3] + _read(pipeline["data_a"] / "heldout.jsonl.gz")[:1]
    samples = [r["text"] for r in recs] + ["\tdef f( a ,b ):\r\n    return  'é☃'  \n\n\n  ", " x", "\n"]
    for text in samples:
        ids = tok.encode(text, verbose=False)
        assert tok.decode(ids, clean_up_tokenization_spaces=False) == text


def test_model_loads_and_generates(pipeline):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = pipeline["out"]
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["vocab_size"] == 512 and cfg["tie_word_embeddings"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (256, 24, 4, 2)

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert model.config.bos_token_id == model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.stat().st_size for p in out.iterdir()) < 36 * 2**20

    enc = tok(["def main():\n", "import os"], return_tensors="pt", padding=True)
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert gen.shape[0] == 2 and gen.shape[1] > enc["input_ids"].shape[1]
    assert isinstance(tok.decode(gen[0], skip_special_tokens=True), str)

    lines = [json.loads(line) for line in pipeline["log"].read_text().splitlines()]
    steps = [r for r in lines if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    assert "heldout_loss" in steps[1] and "heldout_loss" in steps[2]
    assert lines[-1]["event"] == "done"


def test_max_seconds_fits_the_steps_to_the_budget(pipeline, tmp_path):
    """--max-seconds times steps 10..30, then keeps as many steps as fit what is left of the
    budget (here none: it stops right after the probe) and decays the learning rate over
    them."""
    log = tmp_path / "log.jsonl"
    _run(TRAIN, "--data", pipeline["data_a"], "--out", tmp_path / "target", "--device", "cpu",
         "--steps", "500", "--max-seconds", "0.01", "--batch-size", "1", "--seq-len", "16",
         "--vocab-size", "512", "--eval-every", "1000", "--eval-windows", "1", "--log-every", "1",
         "--log", log, "--no-progress")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    fixed = next(r for r in lines if r.get("event") == "steps")
    assert fixed["steps"] == 31 and fixed["ms_per_step"] > 0
    steps = [r for r in lines if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, 32))
    # the cosine ran over the 31 steps kept, not the 500 asked for (near the peak at step 31)
    assert steps[-1]["lr"] < 0.25 * max(r["lr"] for r in steps)
    assert lines[-1]["event"] == "done" and lines[-1]["steps"] == 31
