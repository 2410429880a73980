"""The CUDA KV pool is sized from measured memory, and a pool too small fails with its numbers."""
import pytest
import torch

from spmd_engine.config import ConfigError
from spmd_engine.executor.kv_cache import blocks_for_bytes
from tests.gpu.engine_setup import GPU, make_llm, tiny_bf16_checkpoint

pytestmark = GPU


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_bf16_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_pool_fills_the_measured_budget(checkpoint):
    llm = make_llm(checkpoint, num_kv_blocks=None, gpu_memory_utilization=0.3)
    try:
        budget = llm.runner.memory_budget
        assert budget is not None and budget.activation_peak > 0 and budget.sampler_peak > 0
        assert budget.graph_pool > 0  # graphs are on: their pool is set aside
        assert llm.runner.num_blocks == blocks_for_bytes(llm.runner.spec, budget.kv_bytes)
        total = torch.cuda.mem_get_info()[1]
        kv = llm.runner.num_blocks * llm.runner.spec.bytes_per_block
        assert 0.2 * total < kv < 0.3 * total
        assert torch.cuda.memory_allocated() >= kv
    finally:
        llm.close()


def test_too_small_a_pool_names_the_numbers(checkpoint):
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization 0.001 .* GiB for KV"):
        make_llm(checkpoint, num_kv_blocks=None, gpu_memory_utilization=0.001)
