"""EAGLE-3 head training: vocab maps, TTT mask and forward, data masks, training, engine, CLI."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import make_hf_model
from onespec import LLM, Eagle3Config, SamplingParams
from onespec.models.registry import load_target, load_tokenizer
from onespec.models.eagle3_io import save_eagle3_head
from onespec.train.data import Sample, chat_tokens, make_batches, records_to_samples
from onespec.train.features import TargetBatch, dense_forward, project_qkv, target_batch
from onespec.train.head import build_head
from onespec.train.ttt import ttt_attention_mask, ttt_forward, ttt_logits
from onespec.train.vocab import count_tokens, draft_vocab_maps
from train_utils import make_char_tokenizer, train_tiny, write_jsonl

NUM_LAYERS = 5


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    """A 5-layer hidden-64 random Llama (vocab 128) with a character tokenizer."""
    path = tmp_path_factory.mktemp("train_target")
    make_hf_model(path, num_layers=NUM_LAYERS)
    make_char_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def trained(target_dir, tmp_path_factory):
    """(head, history) of ~150 steps on the target's own greedy text (train_utils)."""
    return train_tiny(target_dir, str(tmp_path_factory.mktemp("train_work")))


# ---- draft vocabulary ---------------------------------------------------------------------
def test_draft_vocab_maps_worked_example():
    # loss tokens: 1, 5, 3, 5, 3 -> counts {3: 2, 5: 2, 1: 1}; 0 and the unmasked 5 don't count
    samples = [Sample([5, 1, 5, 3, 5, 3, 0], [False, True, True, True, True, True, False])]
    counts = count_tokens(samples, 8)
    assert counts.tolist() == [0, 1, 0, 2, 0, 2, 0, 0]
    ids, d2t, t2d = draft_vocab_maps(counts, 3)
    assert ids.tolist() == [1, 3, 5]
    assert d2t.tolist() == [1, 2, 3]                       # target id = draft id + d2t
    assert t2d.tolist() == [False, True, False, True, False, True, False, False]
    assert draft_vocab_maps(counts, 1)[0].tolist() == [3]  # tie 3 vs 5: the lower id wins
    assert draft_vocab_maps(counts, 4)[0].tolist() == [0, 1, 3, 5]
    assert draft_vocab_maps(counts, 8) == (None, None, None)


# ---- TTT ---------------------------------------------------------------------------------
def test_ttt_attention_mask_worked_example():
    # columns: step-0 keys of rows 0..2 | step-1 keys | step-2 keys
    expected = torch.tensor([
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ttt_attention_mask(3, 2), expected)
    assert torch.equal(ttt_attention_mask(3, 0), expected[:, :3])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dense_forward_matches_transformers(tmp_path, arch):
    hf = make_hf_model(tmp_path, arch, num_layers=4)
    target = load_target(str(tmp_path), "cpu", torch.float32)
    target.setup_rotary(32, "cpu")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    padded = ids.clone()
    padded[1, 7:] = 0                                 # row 1 is 7 tokens, right-padded
    hidden, captured = dense_forward(target, padded, (2, 0))
    with torch.no_grad():
        full = hf(ids[:1], output_hidden_states=True)
        short = hf(ids[1:, :7], output_hidden_states=True)
    # hidden_states[i + 1] is the residual stream after layer i
    ref0 = torch.cat([full.hidden_states[3], full.hidden_states[1]], -1)[0]
    ref1 = torch.cat([short.hidden_states[3], short.hidden_states[1]], -1)[0]
    torch.testing.assert_close(captured[0], ref0, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(captured[1, :7], ref1, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(target.compute_logits(hidden[0]), full.logits[0], atol=1e-5,
                               rtol=1e-4)
    draft_ids = torch.tensor([0, 5, 9, 100])
    tb = target_batch(target, padded, (2, 0), draft_ids)
    torch.testing.assert_close(tb.target_logp[1, :7],
                               torch.log_softmax(short.logits[0][:, draft_ids], -1),
                               atol=1e-5, rtol=1e-4)
    assert torch.equal(tb.target_ids[0], full.logits[0].argmax(-1))


def _inference_step_logits(head, embed, features, ids, row, num_steps):
    """The inference draft loop at position `row`, with a growing KV list as the cache:
    step 0 over rows 0..row (causal), then one token per step at row+1, row+2, ..."""
    layer, attn = head.layers[0], head.layers[0].self_attn
    cache_k, cache_v = [], []

    def cached_attention(a, positions, rotary, meta):
        q, k, v = project_qkv(attn, a[None], positions[None], rotary)      # [1, heads, n, D]
        cache_k.append(k)
        cache_v.append(v)
        keys, values = torch.cat(cache_k, 2), torch.cat(cache_v, 2)
        n, s = q.shape[2], keys.shape[2]
        mask = torch.arange(s)[None, :] <= (s - n + torch.arange(n))[:, None]
        rep = attn.num_heads // attn.num_kv_heads
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1), attn_mask=mask)
        return out.transpose(1, 2).reshape(n, attn.q_size)

    h = layer(embed(ids[1:row + 2]), head.fc(features[:row + 1]), torch.arange(row + 1),
              head.rotary, None, attn_fn=cached_attention)[row:]
    logits = [head.compute_logits(h)]
    for step in range(1, num_steps):
        h = layer(embed(ids[row + 1 + step:row + 2 + step]), h, torch.tensor([row + step]),
                  head.rotary, None, attn_fn=cached_attention)
        logits.append(head.compute_logits(h))
    return torch.cat(logits)                                                # [steps, Vd]


def test_ttt_forward_equals_inference_draft_loop(target_dir):
    torch.manual_seed(0)
    target = load_target(target_dir, "cpu", torch.float32)
    target.setup_rotary(64, "cpu")
    ids = torch.randint(3, 128, (1, 12))
    _, features = dense_forward(target, ids, (1, 2, 3))
    head = build_head(target, (1, 2, 3), None)
    head.setup_rotary(64, "cpu")
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)       # away from symmetric init
        steps = list(ttt_logits(head, target.model.embed_tokens, head.rotary, ids, features, 3))
        for row in range(12 - 3):                     # rows whose 3 input tokens all exist
            ref = _inference_step_logits(head, target.model.embed_tokens, features[0], ids[0],
                                         row, 3)
            got = torch.stack([s[0, row] for s in steps])
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_ttt_scoring_rows_worked_example(target_dir):
    """Prompt x0 x1, answer x2 x3 x4, one padding slot: step i scores rows t with x(t+2+i)
    in the loss; rows whose target argmax (at t+1+i) is outside the draft vocab drop out."""
    target = load_target(target_dir, "cpu", torch.float32)
    target.setup_rotary(32, "cpu")
    ids = torch.tensor([[5, 6, 7, 8, 9, 0]])
    loss_mask = torch.tensor([[False, False, True, True, True, False]])
    draft_ids = torch.arange(64)
    d2t, t2d = torch.zeros(64, dtype=torch.int64), torch.arange(128) < 64
    head = build_head(target, (1, 2, 3), draft_ids, d2t, t2d)
    head.setup_rotary(32, "cpu")
    tb = target_batch(target, ids, (1, 2, 3), draft_ids)
    tb = TargetBatch(tb.features, tb.target_logp, torch.tensor([[1, 2, 100, 3, 4, 5]]))
    with torch.no_grad():
        stats = ttt_forward(head, target.model.embed_tokens, head.rotary, ids, loss_mask, tb, 3)
    assert [int(s.num_scored) for s in stats] == [3, 2, 1]   # rows {0,1,2}, {0,1}, {0}
    # target argmax 100 sits at position 2: step 0 row 1, step 1 row 0 drop out of the loss
    assert [int(s.num_rows) for s in stats] == [2, 1, 1]


# ---- data ----------------------------------------------------------------------------------
def test_chat_loss_mask_covers_assistant_turns(target_dir):
    tok = load_tokenizer(target_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "ok"}, {"role": "assistant", "content": "b"}]
    ids, mask = chat_tokens(tok, messages)
    pieces = tok.convert_ids_to_tokens(ids)
    assert "".join(pieces) == "<s><|user|>hi<|end|><|assistant|>yo<|end|><|user|>ok<|end|>" \
                              "<|assistant|>b<|end|>"
    learned = [p for p, m in zip(pieces, mask) if m]
    assert learned == ["y", "o", "<|end|>", "b", "<|end|>"]


def test_chat_loss_mask_when_prefixes_do_not_line_up(target_dir):
    """A template that closes a turn only when another follows: rendered prefixes differ
    from the full chat, so turns are found by their content (end tokens get no loss)."""
    tok = load_tokenizer(target_dir)
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
                         "{{ m['content'] }}{% if not loop.last %}<|end|>{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "ok"}, {"role": "assistant", "content": "b"}]
    ids, mask = chat_tokens(tok, messages)
    pieces = tok.convert_ids_to_tokens(ids)
    assert [p for p, m in zip(pieces, mask) if m] == ["y", "o", "b"]


def test_text_records_window_and_batches(target_dir):
    tok = load_tokenizer(target_dir)
    samples = records_to_samples([{"text": "abcdefghij" * 3, "path": "x.py"}], tok, 12, 128)
    assert [len(s.input_ids) for s in samples] == [12, 12, 7]   # <s> + 30 chars = 31 tokens
    assert samples[0].input_ids[0] == tok.bos_token_id and all(samples[0].loss_mask)
    batches = make_batches([12, 12, 7, 3, 12], batch_tokens=24, seed=0, epoch=0)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    lengths = [12, 12, 7, 3, 12]
    assert all(len(b) * max(lengths[i] for i in b) <= 24 for b in batches)
    assert make_batches(lengths, 24, 0, 1) == make_batches(lengths, 24, 0, 1)


# ---- training ------------------------------------------------------------------------------
def test_training_lowers_loss_and_raises_accuracy(trained):
    head, history = trained
    first, last = history[0], history[-1]
    assert last["step"] == 150
    assert last["loss"] < 0.5 * first["loss"], (first, last)
    assert last["acc_per_step"][0] > first["acc_per_step"][0] + 0.2, (first, last)
    assert all(a > 0.25 for a in last["acc_per_step"]), last
    assert head.config.draft_vocab_size == 96 and int(head.t2d.sum()) == 96


def test_trained_head_in_engine_both_formats(target_dir, trained, tmp_path):
    head, _ = trained
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, 128, (6, 8), generator=g).tolist()
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(target_dir, device="cpu")
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    results = {}
    for fmt in ("safeailab", "speculators"):
        out = tmp_path / fmt
        save_eagle3_head(head, str(out), fmt)
        cfg = json.loads((out / "config.json").read_text())
        aux = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] if fmt == "safeailab" \
            else cfg["eagle_aux_hidden_state_layer_ids"]
        assert aux == [2, 2, 2]           # outputs of layers (1, 1, 1), written as inputs-to
        llm = LLM(target_dir, speculative_config=Eagle3Config(str(out), max_draft_len=3),
                  device="cpu")
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        assert outs == ref
        results[fmt] = llm.stats()
    assert results["safeailab"] == results["speculators"]
    assert results["safeailab"]["acceptance_length"] > 1.3, results["safeailab"]


# ---- CLI and regeneration ------------------------------------------------------------------
def test_cli_train_resume_and_load(target_dir, tmp_path):
    from onespec.cli import main
    data = tmp_path / "data.jsonl.gz"
    with gzip.open(data, "wt") as f:
        for i in range(6):
            f.write(json.dumps({"path": f"f{i}.py", "text": "def f(x):\n    return x, y\n" * 2})
                    + "\n")
    out = tmp_path / "head"
    args = ["train", "eagle3", "--target", target_dir, "--data", str(data), "--out", str(out),
            "--device", "cpu", "--max-len", "32", "--batch-tokens", "64", "--ttt-steps", "2",
            "--draft-vocab", "30", "--capture-layers", "0,2,4", "--format", "speculators",
            "--save-every", "2", "--log-every", "1", "--eval-data", str(data), "--no-progress"]
    assert main(args + ["--max-steps", "3"]) == 0
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == 3
    assert main(args + ["--max-steps", "5", "--resume"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if not e.get("eval")] == [1, 2, 3, 4, 5]
    assert [e["step"] for e in log if e.get("eval")] == [2, 3, 4, 5]     # at checkpoints
    assert len(log[-1]["acc_per_step"]) == 2
    assert torch.load(out / "checkpoint" / "state.pt", weights_only=True)["step"] == 5
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 30
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    llm = LLM(target_dir, speculative_config=Eagle3Config(str(out), max_draft_len=2),
              device="cpu")
    plain = LLM(target_dir, device="cpu")
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    assert llm.generate([[4, 5, 6]], sp)[0].outputs[0].token_ids == \
        plain.generate([[4, 5, 6]], sp)[0].outputs[0].token_ids
    assert main(args[:-1] + ["--epochs", "0"]) == 2        # bad setting: message, exit 2


def test_regenerate_rewrites_chats_and_text(target_dir, tmp_path):
    from onespec.train.regen import regenerate
    tok = load_tokenizer(target_dir)
    records = [{"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "hello there"},
                             {"role": "user", "content": "more"},
                             {"role": "assistant", "content": "sure"}]},
               {"input_ids": list(range(10, 30))}]
    out = regenerate(records, target_dir, tok, max_len=40, device="cpu")
    chat, text = out
    # the random target rarely stops: when turn 1 fills max_len, the chat ends after it
    roles = [m["role"] for m in chat["messages"]]
    assert roles in (["user", "assistant", "user"], ["user", "assistant", "user", "assistant"])
    assert chat["messages"][0]["content"] == "hi" and chat["messages"][2]["content"] == "more"
    plain = LLM(target_dir, device="cpu")
    prompt = tok(tok.apply_chat_template(chat["messages"][:1], tokenize=False,
                                         add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    first = plain.generate([prompt], SamplingParams(max_tokens=40 - len(prompt),
                                                    stop_token_ids=[tok.eos_token_id]))
    assert chat["messages"][1]["content"] == first[0].outputs[0].text
    cont = plain.generate([list(range(10, 20))], SamplingParams(max_tokens=10, ignore_eos=True))
    assert text["input_ids"] == list(range(10, 20)) + cont[0].outputs[0].token_ids
    samples = records_to_samples(out, tok, 40, 128)
    assert samples and any(any(s.loss_mask) for s in samples)


def test_train_with_regenerate_caches_the_data(target_dir, tmp_path, monkeypatch):
    from onespec.train import TrainConfig, train_eagle3
    data = tmp_path / "data.jsonl"
    write_jsonl(data, [{"text": "import os\nprint(os.sep)\n" * 2},
                       {"messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "hello"}]}])
    cfg = dict(target=target_dir, data=str(data), out=str(tmp_path / "head"), max_len=24,
               batch_tokens=48, ttt_steps=2, draft_vocab=64, device="cpu", max_steps=2,
               epochs=5, regenerate=True, progress=False)
    head, history = train_eagle3(TrainConfig(**cfg))
    cached = tmp_path / "head" / "regenerated.jsonl"
    records = [json.loads(line) for line in cached.read_text().splitlines()]
    assert [("messages" in r, "input_ids" in r) for r in records] == \
        [(True, False), (False, True), (False, True)]       # a chat, then 2 text windows
    assert history[-1]["step"] == 2

    def no_regeneration(*args, **kwargs):
        raise AssertionError("--resume must reuse regenerated.jsonl")
    monkeypatch.setattr("onespec.train.regen.regenerate", no_regeneration)
    _, history = train_eagle3(TrainConfig(**{**cfg, "resume": True, "max_steps": 3}))
    assert history[-1]["step"] == 3


def test_cli_small_run_explains_its_length_and_writes_no_state(target_dir, tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n"
                for i in range(6)))
    common = ["--device", "cpu", "--max-len", "32", "--ttt-steps", "2", "--draft-vocab", "30",
              "--capture-layers", "0,2,4", "--max-steps", "2"]
    relative = ["--target", os.path.relpath(target_dir, tmp_path), "--data", "data.jsonl",
                "--out", "head"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo}
    proc = subprocess.run([sys.executable, "-m", "onespec", "train", "eagle3", *relative,
                           *common], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert ("onespec train: note: --max-steps 2, but the data makes 1 batch of --batch-tokens "
            "8192 per epoch (6 samples, ") in proc.stderr
    assert "x --epochs 1: training stops after 1 step; lower --batch-tokens or raise " \
        "--epochs for more" in proc.stderr
    assert "train eagle3" not in proc.stderr and "loading" not in proc.stderr  # no bars
    assert "saved safeailab head to head after 1 steps" in proc.stdout
    out = tmp_path / "head"
    assert not (out / "checkpoint").exists()               # 1 step: no resumable state
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out / "model.safetensors").st_mode & 0o777 == 0o666 & ~umask
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["target"] == target_dir and saved["data"] == str(tmp_path / "data.jsonl")
    from onespec.cli import main
    assert main(["train", "eagle3", "--target", target_dir, "--data",
                 str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "kept"), *common,
                 "--save-state", "--no-progress"]) == 0
    assert torch.load(tmp_path / "kept" / "checkpoint" / "state.pt",
                      weights_only=True)["step"] == 1


def test_max_seconds_stops_the_run_and_decays_the_rate_over_that_time(target_dir, tmp_path):
    from onespec.train import TrainConfig, train_eagle3
    from onespec.train.trainer import lr_at
    assert lr_at(50, 1000, 1.0, 10, time_progress=1.0) == pytest.approx(0.0)
    assert lr_at(50, 1000, 1.0, 10, time_progress=0.5) == pytest.approx(0.5)
    assert lr_at(5, 1000, 1.0, 10, time_progress=0.9) == pytest.approx(0.6)   # still warming up
    with pytest.raises(ValueError, match="max_seconds must be > 0"):
        TrainConfig(target=target_dir, data="x", out="y", max_seconds=0)
    data = tmp_path / "data.jsonl"
    write_jsonl(data, [{"text": f"def f{i}(x):\n    return x * {i}\n" * 3} for i in range(8)])
    cfg = TrainConfig(target=target_dir, data=str(data), out=str(tmp_path / "head"), max_len=32,
                      batch_tokens=64, ttt_steps=2, draft_vocab=64, device="cpu", epochs=10000,
                      warmup_ratio=0.0, log_every=1000, max_seconds=2.0, progress=False)
    _, history = train_eagle3(cfg)
    steps = [h for h in history if not h.get("eval")]
    assert steps and 1 <= steps[-1]["step"] < 10000 * 4            # stopped by time, logged
    assert steps[-1]["lr"] < 0.5 * cfg.lr                          # decayed over the time
    assert os.path.isfile(tmp_path / "head" / "model.safetensors")
