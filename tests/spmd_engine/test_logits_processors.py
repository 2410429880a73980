"""Penalties and min_p (vLLM semantics) applied to logits before the sampler, per row."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmd_engine.config import engine_config_from_dict
from spmd_engine.distributed import RankInfo
from spmd_engine.engine import Engine
from spmd_engine.executor.logits_processors import apply_penalties_and_min_p
from spmd_engine.job.prompts import PromptRequest
from spmd_engine.core.sequence import SamplingParams, Sequence
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

SINGLE = RankInfo(0, 1, 0, "127.0.0.1", 0, "single")


def _reference(z: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's transforms written out token by token."""
    z = z.clone()
    for t in set(prompt) | set(output):
        z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
    for t in set(output):
        z[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    if p.min_p > 0 and p.temperature > 0:
        probs = torch.softmax(z / p.temperature, dim=-1)
        z[probs < p.min_p * probs.max()] = float("-inf")
    return z


def test_transforms_equal_the_reference_and_leave_other_rows_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=-0.3, min_p=0.05,
                             temperature=0.8),
              SamplingParams(),
              SamplingParams(min_p=0.2, temperature=1.3)]
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(i, [1, 2, 3, 7], p)
        for t in [7, 9, 9, 11]:
            seq.append_token(t)
        seqs.append(seq)
    picked = [(s, s.num_tokens) for s in seqs]  # drawing output token 4: all four outputs count
    out = apply_penalties_and_min_p(logits.clone(), picked)
    for i, s in enumerate(seqs):
        ref = _reference(logits[i], s.prompt_token_ids, s.output_token_ids, s.params)
        assert torch.equal(torch.isinf(out[i]), torch.isinf(ref))
        assert torch.allclose(out[i][~torch.isinf(ref)], ref[~torch.isinf(ref)], atol=1e-5)
    assert torch.equal(out[1], logits[1])
    # a draw planned before the last output token arrived counts only the tokens before it
    early = apply_penalties_and_min_p(logits[:1].clone(), [(seqs[0], seqs[0].num_tokens - 1)])
    ref = _reference(logits[0], seqs[0].prompt_token_ids, seqs[0].output_token_ids[:3], seqs[0].params)
    assert torch.allclose(early[0][~torch.isinf(ref)], ref[~torch.isinf(ref)], atol=1e-5)



@pytest.mark.parametrize("params", [
    [SamplingParams(min_p=0.1, temperature=0.7)] * 3,  # min_p alone, every row: in place, no gather
    [SamplingParams(repetition_penalty=1.3)] * 3,  # one penalty term, the others skipped
    [SamplingParams(frequency_penalty=0.4, presence_penalty=0.2, min_p=0.05, temperature=1.1),
     SamplingParams(repetition_penalty=0.8, min_p=0.2, temperature=0.6),
     SamplingParams(presence_penalty=-0.5)]])
def test_a_rows_transform_is_the_same_bits_alone_in_a_step_of_such_rows_and_beside_others(params):
    """Whether a step's rows all ask (transformed in place) or some do (gathered and scattered back), and
    whatever terms the other rows set, each row's logits come out bit for bit the same."""
    gen = torch.Generator().manual_seed(len(params))
    logits = torch.randn(len(params) + 1, 300, generator=gen) * 3
    seqs = []
    for i, p in enumerate(params + [SamplingParams()]):
        seq = Sequence(i, [1, 2, 3, 7, 250], p)
        for t in [7, 9, 9, 11, 299][:i + 2]:
            seq.append_token(t)
        seqs.append(seq)
    picked = [(s, s.num_tokens) for s in seqs]
    every = apply_penalties_and_min_p(logits[:-1].clone(), picked[:-1])
    beside = apply_penalties_and_min_p(logits.clone(), picked)
    alone = [apply_penalties_and_min_p(logits[i:i + 1].clone(), [picked[i]])[0] for i in range(len(params))]
    assert torch.equal(every, beside[:-1]) and torch.equal(every, torch.stack(alone))
    assert torch.equal(beside[-1], logits[-1])
    for i, s in enumerate(seqs[:-1]):
        ref = _reference(logits[i], s.prompt_token_ids, s.output_token_ids, s.params)
        assert torch.equal(torch.isinf(every[i]), torch.isinf(ref))
        assert torch.allclose(every[i][~torch.isinf(ref)], ref[~torch.isinf(ref)], atol=1e-5)

def test_penalty_keys_are_validated():
    for bad, name in [({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                      ({"presence_penalty": 3}, "presence_penalty"),
                      ({"frequency_penalty": -2.5}, "frequency_penalty")]:
        with pytest.raises(ValueError, match=f"sampling.{name}"):
            SamplingParams.from_dict(bad)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pen") / "ckpt", max_position_embeddings=128,
                                tokenizer=False, vocab_size=40)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_with_penalties_equals_a_step_by_step_reference(tiny, async_scheduling):
    """The engine's greedy tokens under penalties equal HF logits + the reference transforms, token by
    token (a penalty that missed the token still in flight under async scheduling would differ)."""
    from transformers import AutoModelForCausalLM

    prompt, overrides = [5, 6, 7, 8, 5], {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.2}
    raw = {"model": {"name": "t", "path": str(tiny), "load_format": "auto", "hf_config": {}},
           "workload": {"name": "chat"}, "sampling": {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True},
           "device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "async_scheduling": async_scheduling}
    llm = Engine(engine_config_from_dict(raw), SINGLE)
    try:
        [out, plain] = llm.generate([PromptRequest(0, None, prompt, overrides), PromptRequest(1, None, prompt)])
    finally:
        llm.close()
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    params = SamplingParams.from_dict({**overrides, "temperature": 0.0})
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            z = model(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int(_reference(z, prompt, ids[len(prompt):], params).argmax()))
    assert out.token_ids == ids[len(prompt):]
    assert out.token_ids != plain.token_ids  # the penalties changed something
