import pytest

from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.models.hf_parity import DYNAMIC, LLAMA3, NO_SCALING, YARN, assert_matches_hf

CASES = {
    "kv2-untied-plain": dict(num_kv_heads=2, tie=False, rope_scaling=NO_SCALING, rope_theta=1e6),
    "kv1-tied-yarn": dict(num_kv_heads=1, tie=True, rope_scaling=YARN),
    "kv2-tied-dynamic": dict(num_kv_heads=2, tie=True, rope_scaling=DYNAMIC),
    "kv1-untied-llama3-bias": dict(num_kv_heads=1, tie=False, rope_scaling=LLAMA3, attention_bias=True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_qwen3_logits_match_transformers(tmp_path, case):
    assert_matches_hf(make_tiny_checkpoint(tmp_path, arch="qwen3", tokenizer=False, **case))


def test_parity_check_catches_a_wrong_rope(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, arch="qwen3", rope_scaling=YARN, tokenizer=False)
    with pytest.raises(AssertionError, match="relative error"):
        assert_matches_hf(checkpoint, config_override={"rope_parameters": {"rope_type": "default"}})

