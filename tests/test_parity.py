"""Offline as served: stop strings in SamplingParams end LLM.generate's outputs as the
server's detokenizer ends a response; the server's sampling defaults come from the
model's generation config."""
from __future__ import annotations

import json
import os

import pytest

from onespec import LLM, Eagle3Config, SamplingParams
from onespec.serve.protocol import CompletionRequest
from onespec.serve.admission import generation_defaults

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(REPO, "onespec", "_demo", "target")
DEMO_HEAD = os.path.join(REPO, "onespec", "_demo", "eagle3")
PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def demo():
    with LLM(DEMO_TARGET, device="cpu", max_model_len=128, max_batch_size=4) as llm:
        full = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))[0]
        yield llm, full.outputs[0]


def stop_inside(text: str) -> tuple[str, int]:
    """A stop string first occurring well inside text, and where."""
    for start in range(8, len(text) - 3):
        s = text[start:start + 3]
        if s.strip() and text.find(s) == start:
            return s, start
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_end_the_output_before_them(demo):
    llm, full = demo
    stop, at = stop_inside(full.text)
    for value in (stop, [stop, "never seen"]):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True,
                                                  stop=value))[0].outputs[0]
        assert (out.text, out.finish_reason) == (full.text[:at], "stop")
        assert out.token_ids == full.token_ids[:len(out.token_ids)]
        assert len(out.token_ids) < len(full.token_ids)
        assert llm.decode(out.token_ids).startswith(full.text[:at] + stop)
    eng = llm.engine
    assert not eng.has_unfinished() and eng.pool.num_free_blocks == eng.pool.num_blocks


def test_a_stop_string_not_reached_changes_nothing(demo):
    llm, full = demo
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True,
                                              stop=["\x00never"]))[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == (full.text, full.token_ids,
                                                            "length")


def test_stop_strings_with_a_drafter_stop_where_plain_decoding_does(demo):
    _, full = demo
    stop, at = stop_inside(full.text)
    with LLM(DEMO_TARGET, device="cpu", max_model_len=128, max_batch_size=2,
             speculative_config=Eagle3Config(DEMO_HEAD, max_draft_len=4)) as spec:
        out = spec.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True,
                                                   stop=[stop]))[0].outputs[0]
    assert (out.text, out.finish_reason) == (full.text[:at], "stop")


@pytest.mark.parametrize("stop", [[""], [1], 5, ["ok", None]])
def test_bad_stop_values_name_the_field(stop):
    with pytest.raises(ValueError, match="stop must be a string or a list of non-empty "):
        SamplingParams(stop=stop)


def test_server_defaults_come_from_the_generation_config(tmp_path):
    assert generation_defaults(str(tmp_path)) == {"temperature": 1.0}     # no file
    assert generation_defaults(DEMO_TARGET) == {"temperature": 1.0}       # no sampling keys
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}, f)
    defaults = generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    omitted = CompletionRequest(model="m", prompt="x").sampling_params(16, None, defaults)
    assert (omitted.temperature, omitted.top_p, omitted.top_k) == (0.6, 0.95, 20)
    given = CompletionRequest(model="m", prompt="x", temperature=0,
                              top_p=0.5).sampling_params(16, None, defaults)
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.5, 20)
