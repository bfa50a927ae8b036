"""Training data: JSONL records -> token samples with loss masks -> padded batches.

Record kinds (one JSON object per line; `.jsonl` or `.jsonl.gz`):
    {"text": "..."}                       loss on every token; long texts become max_len windows
    {"input_ids": [...], "loss_mask": [...]}   pre-tokenized (loss_mask optional, default all)
    {"messages": [{"role", "content"}...]}     chat: loss on assistant turns only
    {"conversations": [{"from", "value"}...]}  ShareGPT chat, mapped onto messages
Other keys (e.g. "path") are ignored.
"""
from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass

import torch

MIN_SEQ_LEN = 3              # step 0 at row 0 predicts x(2): shorter samples carry no loss
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "system": "system"}
TOKENIZE_BATCH = 256


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[bool]     # True: this token is a prediction target


def read_records(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(rec, dict) or not (
                    {"text", "messages", "conversations", "input_ids"} & rec.keys()):
                raise ValueError(f"{path}:{lineno}: each line must be an object with 'text', "
                                 "'messages', 'conversations' or 'input_ids'")
            records.append(rec)
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def write_records(path: str, records: list[dict]):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


def chat_messages(rec: dict) -> list[dict] | None:
    """The record's chat as [{"role", "content"}], or None for a non-chat record."""
    if "messages" in rec:
        return [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
    if "conversations" in rec:
        return [{"role": SHAREGPT_ROLES[m["from"]], "content": m["value"]}
                for m in rec["conversations"]]
    return None


# ---- tokenization -----------------------------------------------------------------------
def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, with the tokenizer's BOS in front when it has one."""
    bos = tokenizer.bos_token_id
    out = []
    for i in range(0, len(texts), TOKENIZE_BATCH):
        enc = tokenizer(texts[i:i + TOKENIZE_BATCH], add_special_tokens=True,
                        verbose=False)["input_ids"]
        out += [ids if bos is None or (ids and ids[0] == bos) else [bos] + ids for ids in enc]
    return out


def windows(ids: list[int], mask: list[bool], max_len: int) -> list[Sample]:
    """Splits one long token sequence into consecutive max_len windows."""
    out = []
    for start in range(0, len(ids), max_len):
        s = Sample(ids[start:start + max_len], mask[start:start + max_len])
        if len(s.input_ids) >= MIN_SEQ_LEN and any(s.loss_mask[2:]):
            out.append(s)
    return out


def render_chat(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Renders the chat; returns (text, [(start, end) character span of each assistant turn]).

    A turn's span runs from the end of the prefix rendered with the generation prompt to the
    end of the prefix that includes the turn (so end-of-turn tokens are learned too). When a
    template renders a turn differently inside a longer chat (prefixes do not line up), the
    turn's content is searched for in the full rendering instead; a turn that cannot be
    found there either (e.g. reasoning stripped from earlier turns) gets no loss."""
    full = render_chat(tokenizer, messages)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        upto = render_chat(tokenizer, messages[:i + 1])
        if (full.startswith(upto) and upto.startswith(before) and len(before) >= cursor
                and len(upto) > len(before)):
            start, end = len(before), len(upto)
        else:
            start = full.find(m["content"], cursor) if m["content"] else -1
            if start < 0:
                continue
            end = start + len(m["content"])
        spans.append((start, end))
        cursor = end
    return full, spans


def chat_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """-> (ids, loss_mask) with the mask True on tokens that start inside an assistant span."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat data needs a tokenizer with a chat template; this target's "
                         "tokenizer has none (use {'text': ...} records)")
    if not tokenizer.is_fast:
        raise ValueError("chat data needs a fast tokenizer (tokenizer.json) for offsets")
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    mask = [e > s and any(a <= s < b for a, b in spans) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def records_to_samples(records: list[dict], tokenizer, max_len: int,
                       vocab_size: int) -> list[Sample]:
    samples: list[Sample] = []
    texts = [r["text"] for r in records if "text" in r and chat_messages(r) is None]
    if texts and tokenizer is None:
        raise ValueError("text records need a tokenizer, and the target has no tokenizer "
                         "files; pass pre-tokenized {'input_ids': [...]} records instead")
    for ids in encode_texts(tokenizer, texts) if texts else []:
        samples += windows(ids, [True] * len(ids), max_len)
    for rec in records:
        messages = chat_messages(rec)
        if messages is not None:
            if tokenizer is None:
                raise ValueError("chat records need a tokenizer; the target has none")
            ids, mask = chat_tokens(tokenizer, messages)
            samples += windows(ids[:max_len], mask[:max_len], max_len)
        elif "input_ids" in rec:
            ids = [int(t) for t in rec["input_ids"]]
            mask = [bool(m) for m in rec.get("loss_mask", [True] * len(ids))]
            if len(mask) != len(ids) or not all(0 <= t < vocab_size for t in ids):
                raise ValueError("an input_ids record needs ids in [0, vocab_size) and a "
                                 "loss_mask of the same length")
            samples += windows(ids, mask, max_len)
    if not samples:
        raise ValueError(f"the data gave no sample of >= {MIN_SEQ_LEN} tokens with a loss")
    return samples


# ---- batching ---------------------------------------------------------------------------
def make_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches of sample indices with num_samples · max_len <= batch_tokens,
    in a shuffled order that depends only on (seed, epoch)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    order.sort(key=lambda i: lengths[i])                # stable: equal lengths stay shuffled
    batches, current, longest = [], [], 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(samples: list[Sample], device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids [B, T] (right-padded with 0), loss_mask [B, T] (False on padding)."""
    t = max(len(s.input_ids) for s in samples)
    ids = torch.zeros(len(samples), t, dtype=torch.int64)
    mask = torch.zeros(len(samples), t, dtype=torch.bool)
    for row, s in enumerate(samples):
        ids[row, :len(s.input_ids)] = torch.tensor(s.input_ids)
        mask[row, :len(s.loss_mask)] = torch.tensor(s.loss_mask)
    return ids.to(device), mask.to(device)
