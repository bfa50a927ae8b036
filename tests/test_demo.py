"""The bundled demo pair and `onespec demo` (smoke mode)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

from onespec import LLM, Eagle3Config, SamplingParams
from onespec.demo import DEMO_DIR, HEAD_DIR, TARGET_DIR, report_speedup


def test_bundled_pair_fits_and_loads_in_transformers():
    size = sum(os.path.getsize(os.path.join(root, f))
               for d in (TARGET_DIR, HEAD_DIR) for root, _, files in os.walk(d) for f in files)
    assert size <= 40 * 1000 * 1000, size
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    hf = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32)
    prompt = tok.encode("def add(a, b):\n")
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                      do_sample=False, pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    llm = LLM(TARGET_DIR, device="cpu", dtype="float32", max_batch_size=4,
              speculative_config=Eagle3Config(HEAD_DIR, max_draft_len=4))
    out = llm.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert out.outputs[0].token_ids == ref[:len(out.outputs[0].token_ids)]
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert llm.stats()["num_draft_tokens"] > 0


def test_demo_smoke_runs():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "onespec", "demo", "--smoke", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "identical output to plain decoding: yes" in proc.stdout
    chosen = re.search(r"draft length: K=(\d), the fastest here \(speculative tok/s over a short "
                       r"trial: K=2: \d+, K=3: \d+, K=4: \d+, K=5: \d+, K=6: \d+\)", proc.stdout)
    assert chosen and 2 <= int(chosen.group(1)) <= 6, proc.stdout
    assert f"tokens per target step at K={chosen.group(1)} " in proc.stdout
    assert re.search(r"layer code model \+ EAGLE-3 head on cpu \(eager\)", proc.stdout)
    assert "acceptance length:" in proc.stdout
    assert re.search(r"plain decoding: +[\d.]+ tok/s  \(median of 3 rounds of 16 tokens\)\n"
                     r"speculative decoding: +[\d.]+ tok/s\n"
                     r"speedup: [\d.]+x \(median of 3 rounds; spread [\d.]+x-[\d.]+x\)\n",
                     proc.stdout), proc.stdout
    assert "\033[" not in proc.stdout                    # no terminal codes in a pipe
    assert os.path.isdir(DEMO_DIR)


def test_demo_speedup_reports_median_spread_and_unreliable_figures(capsys):
    report_speedup([1.5, 1.0, 1.1])
    assert capsys.readouterr().out == (
        "speedup: 1.10x (median of 3 rounds; spread 1.00x-1.50x)\n"
        "warning: the speedup varied by more than 20% between rounds, so this figure is "
        "unreliable: another program is probably using the CPU. Run again on an idle machine "
        "or with more --rounds.\n")
    report_speedup([1.0, 1.05, 1.1])                          # spread 0.1 / 1.05 < 20 %
    assert capsys.readouterr().out == "speedup: 1.05x (median of 3 rounds; spread 1.00x-1.10x)\n"
    report_speedup([0.9])
    assert capsys.readouterr().out.startswith("speedup: 0.90x (one round: no spread measured")
