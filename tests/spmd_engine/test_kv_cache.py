import torch

from spmd_engine.executor.kv_cache import CudaMemoryBudget, KVCacheSpec, allocate_kv_cache, blocks_for_bytes

GIB = 1 << 30


def test_budget_keeps_the_larger_transient_peak_and_the_graph_pool():
    budget = CudaMemoryBudget(total=100 * GIB, utilization=0.5, in_use=10 * GIB, activation_peak=3 * GIB,
                              sampler_peak=2 * GIB, graph_pool=1 * GIB)
    assert budget.kv_bytes == 50 * GIB - 10 * GIB - 3 * GIB - 1 * GIB
    text = budget.describe()
    assert "gpu_memory_utilization 0.5" in text and "= 36.00 GiB for KV" in text and "graph pool 1.00" in text


def test_blocks_and_allocation():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.float16)
    assert spec.bytes_per_block == 2 * 2 * 8 * 2 * 4 * 2
    assert blocks_for_bytes(spec, 10 * spec.bytes_per_block + 1) == 10
    assert blocks_for_bytes(spec, -5) == 0
    caches = allocate_kv_cache(spec, 3, torch.device("cpu"))
    assert len(caches) == 2 and caches[1][0].shape == (3, 8, 2, 4)


def test_planned_blocks_fixed_then_cpu_budget_then_measured_on_cuda():
    from spmd_engine.executor.kv_cache import planned_num_blocks
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.float16)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert planned_num_blocks(spec, 7, 1.0, cuda) == 7
    assert planned_num_blocks(spec, None, 1.0, cpu) == (1 << 30) // spec.bytes_per_block
    assert planned_num_blocks(spec, None, 1.0, cuda) is None
