"""Stop conditions: stop strings across token boundaries (incremental detokenizer), stop_token_ids,
min_tokens, include_stop_str_in_output; each ends the sequence in the scheduler like EOS."""
from __future__ import annotations

from pathlib import Path

import pytest

from spmd_engine.config import engine_config_from_dict
from spmd_engine.core.detokenizer import IncrementalDetokenizer, StopStringMatcher
from spmd_engine.distributed import RankInfo
from spmd_engine.engine import Engine
from spmd_engine.job.prompts import PromptRequest
from spmd_engine.tokenizer import load_tokenizer
from spmd_engine.core.sequence import SamplingParams
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

SINGLE = RankInfo(0, 1, 0, "127.0.0.1", 0, "single")
TEXT = "Paris is the capital of France. Größe: 10 °C — naïve café 😀 ok\n\n  spaced  out"


def _llm(path: Path, max_tokens: int, **engine) -> Engine:
    raw = {"model": {"name": "t", "path": str(path), "load_format": "auto", "hf_config": {}},
           "workload": {"name": "chat"}, "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
           "device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256, **engine}
    return Engine(engine_config_from_dict(raw), SINGLE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("stop") / "ckpt", max_position_embeddings=256)


@pytest.mark.parametrize("which", ["smollm2", "bytes"])
def test_incremental_text_equals_full_decode(which, smollm2_dir, tiny):
    tokenizer = load_tokenizer(smollm2_dir if which == "smollm2" else tiny)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t, skip_special_tokens=True))
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == detok.text == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # a character split over byte tokens comes out whole


def test_matcher_finds_a_string_split_over_deltas():
    matcher = StopStringMatcher(["capital", "XYZ"], include_in_output=False)
    text = ""
    found = None
    for delta in ["Paris is the ca", "pi", "tal of", " France"]:
        text += delta
        found = found or matcher.check(text, len(delta))
    assert found is not None and found.stop == "capital" and found.text == "Paris is the "
    assert StopStringMatcher(["the"], True).check("Paris is the", 3).text == "Paris is the"
    assert StopStringMatcher(["is"], True).check("Paris is the", 1) is None  # old text was checked before


def test_sampling_params_validate_the_stop_keys():
    assert SamplingParams.from_dict({"stop": "x"}).stop == ["x"]
    for bad, field in [({"stop": [""]}, "sampling.stop"), ({"stop": [1]}, "sampling.stop"),
                       ({"stop_token_ids": [-1]}, "sampling.stop_token_ids"),
                       ({"min_tokens": 20, "max_tokens": 10}, "sampling.min_tokens"),
                       ({"include_stop_str_in_output": 1}, "sampling.include_stop_str_in_output"),
                       ({"logprobs": 21}, "sampling.logprobs"), ({"prompt_logprobs": -1}, "sampling.prompt_logprobs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams.from_dict(bad)


def _stop_string_case(llm: Engine, prompt: list[int], decode, max_tokens: int, pick) -> None:
    """Generate freely, take a stop string `pick` chooses from the output's pieces, generate again with it."""
    [free] = llm.generate([PromptRequest(0, None, prompt)], decode=decode)
    assert free.finish_reason == "length" and len(free.token_ids) == max_tokens
    pieces = [decode(free.token_ids[:i]) for i in range(max_tokens + 1)]
    stop = pick(pieces)
    first = free.text.find(stop)
    assert 0 <= first
    cut, kept = llm.generate([PromptRequest(0, None, prompt, {"stop": ["zzzqqq", stop]}),
                              PromptRequest(1, None, prompt, {"stop": stop, "include_stop_str_in_output": True})],
                             decode=decode)
    end = next(i for i in range(max_tokens + 1) if stop in pieces[i])  # the token completing the first match
    for out in (cut, kept):
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == free.token_ids[:end]  # a speculative step's token is dropped
    assert cut.text == free.text[:first]
    assert kept.text == free.text[:first + len(stop)]
    assert cut.to_json()["stop_reason"] == stop


def test_a_stop_string_spanning_two_tokens_ends_the_request(smollm2_dir):
    """Real multi-character tokens: the string takes the end of one token and the start of the next."""
    tokenizer = load_tokenizer(smollm2_dir)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731

    def pick(pieces: list[str]) -> str:
        k = next(i for i in range(2, len(pieces) - 2) if len(pieces[i]) - len(pieces[i - 1]) >= 2
                 and len(pieces[i + 1]) - len(pieces[i]) >= 2)
        return pieces[k][-2:] + pieces[k + 1][len(pieces[k]):][:2]

    llm = _llm(smollm2_dir, 10)
    try:
        _stop_string_case(llm, tokenizer.encode("The capital of France is Paris. The capital of Germany is"),
                          decode, 10, pick)
    finally:
        llm.close()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_stop_string_over_byte_tokens(tiny, async_scheduling):
    """One byte per token: a two-character stop string spans two tokens; both scheduling modes."""
    tokenizer = load_tokenizer(tiny)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731

    def pick(pieces: list[str]) -> str:
        k = next(i for i in range(1, len(pieces) - 1) if pieces[i + 1][-2:].isascii()
                 and pieces[i + 1][-2:].isprintable() and len(pieces[i + 1]) == len(pieces[i - 1]) + 2)
        return pieces[k + 1][-2:]

    llm = _llm(tiny, 32, async_scheduling=async_scheduling)
    try:
        _stop_string_case(llm, [40, 41, 42, 43], decode, 32, pick)
    finally:
        llm.close()


def test_stop_token_ids_and_min_tokens(tiny):
    prompt = [5, 6, 7, 8]
    llm = _llm(tiny, 16)
    try:
        [free] = llm.generate([PromptRequest(0, None, prompt)])
        stop_token = free.token_ids[2]
        first = free.token_ids.index(stop_token)
        stopped, later = llm.generate([PromptRequest(0, None, prompt, {"stop_token_ids": [stop_token]}),
                                       PromptRequest(1, None, prompt, {"stop_token_ids": [stop_token],
                                                                       "min_tokens": first + 2})])
    finally:
        llm.close()
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_token
    assert stopped.token_ids == free.token_ids[:first + 1]
    # min_tokens: the stop token is masked from the first min_tokens draws, then ends the request
    assert stop_token not in later.token_ids[:first + 2]
    assert later.finish_reason == "length" or later.token_ids[-1] == stop_token
    assert len(later.token_ids) >= first + 2


def test_job_wide_stop_keys_from_the_config():
    from spmd_engine.config import ConfigError
    base = {"model": {"name": "dummy", "load_format": "dummy", "hf_config": {}}}
    cfg = engine_config_from_dict({**base, "sampling": {"stop": "###", "stop_token_ids": [7], "min_tokens": 2,
                                                        "logprobs": 1}})
    assert (cfg.sampling.stop, cfg.sampling.stop_token_ids, cfg.sampling.min_tokens) == (["###"], [7], 2)
    with pytest.raises(ConfigError, match="sampling.min_tokens"):
        engine_config_from_dict({**base, "sampling": {"min_tokens": 300}})


def test_stop_strings_without_a_tokenizer_are_one_error_row(tiny):
    llm = _llm(tiny, 4)
    try:
        bad, good = llm.generate([PromptRequest(0, None, [5, 6], {"stop": "x"}), PromptRequest(1, None, [5, 6])])
    finally:
        llm.close()
    assert bad.finish_reason == "error" and "sampling.stop needs the checkpoint's tokenizer" in bad.error
    assert good.error is None and len(good.token_ids) == 4


@pytest.mark.parametrize("with_stop_strings", [False, True])
def test_a_stop_token_s_text_is_left_out_of_text(tiny, with_stop_strings):
    """vLLM's rule: the token that ended the request (a stop token id, here an ordinary byte token) stays
    in token_ids but its text is not in `text` unless include_stop_str_in_output."""
    tokenizer = load_tokenizer(tiny)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    prompt = [40, 41, 42, 43]
    llm = _llm(tiny, 16)
    try:
        [free] = llm.generate([PromptRequest(0, None, prompt)], decode=decode)
        stop_token = next(t for t in free.token_ids[2:] if decode([t]).strip())  # a token with text of its own
        first = free.token_ids.index(stop_token)
        stops = {"stop": ["zzzqqq"]} if with_stop_strings else {}
        cut, kept = llm.generate([PromptRequest(0, None, prompt, {"stop_token_ids": [stop_token], **stops}),
                                  PromptRequest(1, None, prompt, {"stop_token_ids": [stop_token], **stops,
                                                                  "include_stop_str_in_output": True})],
                                 decode=decode)
    finally:
        llm.close()
    for out in (cut, kept):
        assert out.finish_reason == "stop" and out.stop_reason == stop_token
        assert out.token_ids == free.token_ids[:first + 1]
    assert cut.text == decode(free.token_ids[:first])
    assert kept.text == decode(free.token_ids[:first + 1])
