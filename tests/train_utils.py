"""Helpers for tests that need a *trained* EAGLE-3 head (real acceptance) in a few seconds.

    from train_utils import trained_head
    head_dir = trained_head(target_dir, out_dir, fmt="safeailab")

`target_dir` is a tiny random Llama-family target (e.g. conftest.make_hf_model(path,
num_layers=5)); no tokenizer is needed. The head is trained on the target's own greedy
continuations of random prompts: short repetitive loops, the text a tiny target's greedy
decoding produces, so acceptance lengths well above 1 follow (about 1.7 at K=3 on random
prompts). Training runs once per (target, settings) in a process; each call writes the
head in the asked format.
"""
from __future__ import annotations

import json
import os

import torch

CHAR_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>",
                 "<|end|>"]
CHAR_ALPHABET = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                 " \n\t.,:;!?'\"()[]{}<>=+-*/_#%&@")
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

_TRAINED: dict[tuple, object] = {}


def self_generated_records(target_dir: str, num: int = 128, prompt_len: int = 8,
                           seq_len: int = 96, seed: int = 0) -> list[dict]:
    """{"input_ids"} records: random prompts continued greedily by the target itself (with
    transformers' cached generate, fast on a CPU). A tiny random target's greedy text is
    repetitive (short loops), and it is exactly the text the engine then drafts for."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target_dir).float().eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (num, prompt_len), generator=g)
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             max_new_tokens=seq_len - prompt_len, eos_token_id=None,
                             pad_token_id=0)
    return [{"input_ids": row} for row in out.tolist()]


def write_jsonl(path, records: list[dict]):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def make_char_tokenizer(path, vocab_size: int = 128):
    """A character-level fast tokenizer with BOS <s>=1, EOS </s>=2, PAD 0 and a chat template
    "<s><|role|>content<|end|>...", saved into `path` (a target dir). Ids past the alphabet
    are filler tokens "<xN>", so every id of a vocab_size target decodes to something."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    pieces = CHAR_SPECIALS + list(CHAR_ALPHABET)
    pieces += [f"<x{i}>" for i in range(len(pieces), vocab_size)]
    vocab = {tok: i for i, tok in enumerate(pieces)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(CHAR_SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(path))
    return fast


def train_tiny(target_dir: str, work_dir: str, steps: int = 150, ttt_steps: int = 3,
               draft_vocab: int = 96, seed: int = 0, **overrides):
    """Trains a head on the target's own greedy text; returns (head, history). Cached per
    process. ~6 CPU-seconds of training on a 5-layer, hidden-64 target."""
    from onespec.train import TrainConfig, train_eagle3
    key = (os.path.abspath(target_dir), steps, ttt_steps, draft_vocab, seed,
           tuple(sorted(overrides.items())))
    if key not in _TRAINED:
        os.makedirs(work_dir, exist_ok=True)
        data = os.path.join(work_dir, "tiny_train.jsonl")
        write_jsonl(data, self_generated_records(target_dir, seed=seed))
        cfg = dict(target=target_dir, data=data, out=os.path.join(work_dir, "tiny_head"),
                   ttt_steps=ttt_steps, draft_vocab=draft_vocab, max_len=96,
                   batch_tokens=4 * 96, lr=3e-3, epochs=100, max_steps=steps, device="cpu",
                   seed=seed, save_every=0, progress=False, **overrides)
        torch.manual_seed(seed)
        _TRAINED[key] = train_eagle3(TrainConfig(**cfg))
    return _TRAINED[key]


def trained_head(target_dir, out_dir, fmt: str = "safeailab", **kwargs) -> str:
    """Writes a trained head for `target_dir` in `fmt` ("safeailab" | "speculators") to
    `out_dir`; returns out_dir. kwargs go to train_tiny (steps, ttt_steps, draft_vocab, seed,
    or TrainConfig fields such as capture_layers)."""
    from onespec.models.eagle3_io import save_eagle3_head
    head, _ = train_tiny(str(target_dir), os.path.join(str(out_dir), "_work"), **kwargs)
    save_eagle3_head(head, str(out_dir), fmt)
    return str(out_dir)
