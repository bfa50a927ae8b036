"""`--regenerate`: rewrite the training data with the target's own greedy outputs.

A draft head is judged by how often it agrees with the target on the target's own text, so
training on what the target actually generates matches what it sees at inference:
    chat records:  every assistant turn is regenerated in order (later turns see the new
                   earlier ones) through the chat template, stopping at the target's EOS;
    text records:  each max_len window keeps its first half as a prompt and the target
                   continues it greedily to the window's length.
Generation runs through the onespec engine (`LLM.generate`, greedy, batched).
"""
from __future__ import annotations

from onespec.sampling_params import SamplingParams
from onespec.train.data import chat_messages, encode_texts, render_chat

MIN_WINDOW = 4               # a text window needs >= 2 prompt and >= 2 continuation tokens


def regenerate(records: list[dict], target_path: str, tokenizer, max_len: int, device: str,
               dtype: str = "auto") -> list[dict]:
    """-> new records: {"messages": [...]} for chats, {"input_ids": [...]} for text windows."""
    from onespec.llm import LLM
    if tokenizer is None and any("text" in r or chat_messages(r) for r in records):
        raise ValueError("regenerating text or chat records needs the target's tokenizer, "
                         "and the target has no tokenizer files")
    llm = LLM(target_path, device=device, dtype=dtype, max_model_len=max_len,
              max_num_tokens=max(8192, max_len), max_batch_size=256)
    max_len = llm.engine.max_model_len
    stop = [tokenizer.eos_token_id] if tokenizer is not None and \
        tokenizer.eos_token_id is not None else []
    chats = [chat_messages(r) for r in records]
    out = [{"messages": m} for m in _regenerate_chats(llm, tokenizer, [c for c in chats if c],
                                                      max_len, stop)]
    text_windows = _token_windows([r for r, c in zip(records, chats) if c is None], tokenizer,
                                  max_len)
    prompts = [w[:len(w) // 2] for w in text_windows]
    params = [SamplingParams(max_tokens=len(w) - len(p), temperature=0.0, ignore_eos=True)
              for w, p in zip(text_windows, prompts)]
    if prompts:
        results = llm.generate(prompts, params, use_tqdm=True)
        out += [{"input_ids": p + r.outputs[0].token_ids} for p, r in zip(prompts, results)]
    del llm
    return out


def _token_windows(records: list[dict], tokenizer, max_len: int) -> list[list[int]]:
    texts = [r["text"] for r in records if "text" in r]
    seqs = encode_texts(tokenizer, texts) if texts else []
    seqs += [[int(t) for t in r["input_ids"]] for r in records if "text" not in r]
    return [ids[i:i + max_len] for ids in seqs for i in range(0, len(ids), max_len)
            if len(ids[i:i + max_len]) >= MIN_WINDOW]


def _regenerate_chats(llm, tokenizer, chats: list[list[dict]], max_len: int,
                      stop: list[int]) -> list[list[dict]]:
    """Regenerates assistant turns one turn index at a time across all chats (batched)."""
    chats = [list(c) for c in chats]
    alive = list(range(len(chats)))
    cursor = [0] * len(chats)                 # next message index to consider per chat
    while alive:
        jobs = []
        for c in alive:
            msgs = chats[c]
            i = next((j for j in range(cursor[c], len(msgs)) if msgs[j]["role"] == "assistant"),
                     None)
            if i is None:
                continue
            ids = tokenizer(render_chat(tokenizer, msgs[:i], add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"]
            if len(ids) >= max_len - 1:
                chats[c] = msgs[:i]           # no room left: the chat ends before this turn
                continue
            jobs.append((c, i, ids))
        if not jobs:
            break
        params = [SamplingParams(max_tokens=max_len - len(ids), temperature=0.0,
                                 stop_token_ids=stop) for _, _, ids in jobs]
        results = llm.generate([ids for _, _, ids in jobs], params, use_tqdm=True)
        for (c, i, _), r in zip(jobs, results):
            chats[c][i] = {"role": "assistant", "content": r.outputs[0].text}
            cursor[c] = i + 1
        alive = [c for c, _, _ in jobs]
    return [c for c in chats if any(m["role"] == "assistant" for m in c)]
