import pytest

from spmd_engine.core.sequence import SamplingParams, Sequence, SequenceStatus


def test_defaults_are_valid():
    p = SamplingParams().validate()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.ignore_eos, p.seed) == (0.6, 0.95, -1, 256, False, None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "sampling.temperature must be >= 0, got -1"),
        ({"temperature": float("nan")}, "sampling.temperature must be a number, got nan"),
        ({"temperature": "abc"}, "sampling.temperature must be a number, got 'abc'"),
        ({"top_p": float("nan")}, "sampling.top_p must be a number, got nan"),
        ({"min_p": "x"}, "sampling.min_p must be a number, got 'x'"),
        ({"repetition_penalty": float("nan")}, "sampling.repetition_penalty must be a number, got nan"),
        ({"presence_penalty": None}, "sampling.presence_penalty must be a number, got None"),
        ({"max_tokens": "abc"}, "sampling.max_tokens must be an integer, got 'abc'"),
        ({"min_tokens": 1.5}, "sampling.min_tokens must be an integer, got 1.5"),
        ({"temperature": float("inf")}, "sampling.temperature must be >= 0 and finite, got inf"),
        ({"top_p": 0}, "sampling.top_p must be in (0, 1], got 0"),
        ({"top_p": 1.5}, "sampling.top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "sampling.top_k must be -1 or 0 (off) or >= 1, got -2"),
        ({"top_k": 2.5}, "sampling.top_k must be an integer, got 2.5"),
        ({"max_tokens": 0}, "sampling.max_tokens must be >= 1, got 0"),
        ({"ignore_eos": "yes"}, "sampling.ignore_eos must be true or false, got 'yes'"),
        ({"seed": 1.5}, "sampling.seed must be an integer in [-2**63, 2**64 - 1] or null, got 1.5"),
        ({"seed": 2**64}, "sampling.seed must be an integer in [-2**63, 2**64 - 1] or null, got 18446744073709551616"),
    ],
)
def test_validate_names_field_and_limit(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs).validate()
    assert str(err.value) == message
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_off_values_accepted(top_k):
    assert SamplingParams(top_k=top_k).validate().top_k == top_k


def test_from_dict_overrides_defaults():
    base = SamplingParams(temperature=0.5, max_tokens=7)
    p = SamplingParams.from_dict({"top_p": 1, "seed": 3}, defaults=base)
    assert p == SamplingParams(temperature=0.5, top_p=1.0, max_tokens=7, seed=3)
    assert isinstance(p.top_p, float)
    assert base.seed is None  # the defaults object is not modified
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_from_dict_rejects_unknown_key_and_bad_value():
    with pytest.raises(ValueError, match=r"^sampling\.top_q is not a sampling parameter"):
        SamplingParams.from_dict({"top_q": 0.5})
    with pytest.raises(ValueError, match=r"sampling\.max_tokens must be >= 1, got -3"):
        SamplingParams.from_dict({"max_tokens": -3})


def test_sequence_tokens():
    seq = Sequence(7, [1, 2, 3])
    assert seq.status is SequenceStatus.WAITING
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    seq.append_token(9)
    seq.append_token(4)
    assert seq.token_ids == [1, 2, 3, 9, 4]
    assert seq.output_token_ids == [9, 4]
    assert seq.prompt_token_ids == [1, 2, 3]
    assert (seq.num_computed_tokens, seq.block_table, seq.finish_reason) == (0, [], None)


def test_sequence_copies_prompt_and_rejects_empty():
    prompt = [5, 6]
    seq = Sequence(0, prompt)
    seq.append_token(1)
    assert prompt == [5, 6]
    with pytest.raises(ValueError, match="at least 1 token"):
        Sequence(1, [])


def test_every_accepted_seed_seeds_a_torch_generator():
    import torch

    for seed in (-(2**63), -1, 0, 2**63, 2**64 - 1):
        SamplingParams(seed=seed).validate()
        torch.Generator().manual_seed(seed)
