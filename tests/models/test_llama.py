import pytest

from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.models.hf_parity import DYNAMIC, LLAMA3, NO_SCALING, YARN, assert_matches_hf

CASES = {
    "kv2-tied-plain": dict(num_kv_heads=2, tie=True, rope_scaling=NO_SCALING),
    "kv1-untied-llama3": dict(num_kv_heads=1, tie=False, rope_scaling=LLAMA3, rope_theta=500_000.0),
    "kv2-untied-yarn-biases": dict(num_kv_heads=2, tie=False, rope_scaling=YARN, attention_bias=True,
                                   mlp_bias=True),
    "kv1-tied-dynamic": dict(num_kv_heads=1, tie=True, rope_scaling=DYNAMIC),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_llama_logits_match_transformers(tmp_path, case):
    assert_matches_hf(make_tiny_checkpoint(tmp_path, arch="llama", tokenizer=False, **case))
