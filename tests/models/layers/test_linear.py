import pytest
import torch
import torch.nn.functional as F

from spmd_engine.kernels import gemv as gemv_module
from spmd_engine.models.layers import linear as linear_module
from spmd_engine.models.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                  RowParallelLinear, SmallBatchSwitch, matmul_fp32_out, set_small_batch_gemv)
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.registry import build_model

GEN = torch.Generator().manual_seed(0)


def ranks(world_size: int) -> list[TensorParallel]:
    return [TensorParallel(rank, world_size) for rank in range(world_size)]


def test_column_parallel_shards_output_rows():
    weight, bias, x = torch.randn(8, 5, generator=GEN), torch.randn(8, generator=GEN), torch.randn(3, 5, generator=GEN)
    outputs = []
    for tp in ranks(2):
        layer = ColumnParallelLinear(5, 8, tp, bias=True)
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        outputs.append(layer(x))
    torch.testing.assert_close(torch.cat(outputs, dim=-1), F.linear(x, weight, bias))


def test_merged_column_packs_each_ranks_share_of_every_projection():
    gate, up = torch.randn(6, 4, generator=GEN), torch.randn(6, 4, generator=GEN)
    for tp in ranks(2):
        layer = MergedColumnParallelLinear(4, [6, 6], tp)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        rows = slice(3 * tp.rank, 3 * tp.rank + 3)
        torch.testing.assert_close(layer.weight.data, torch.cat([gate[rows], up[rows]]))


@pytest.mark.parametrize("world_size, kv_head_of_rank", [(1, [[0, 1]]), (2, [[0], [1]]), (4, [[0], [0], [1], [1]])])
def test_qkv_splits_or_replicates_kv_heads(world_size, kv_head_of_rank):
    d, heads, kv_heads, hidden = 2, 4, 2, 3
    q = torch.randn(heads * d, hidden, generator=GEN)
    k = torch.randn(kv_heads * d, hidden, generator=GEN)
    v = torch.randn(kv_heads * d, hidden, generator=GEN)
    for tp in ranks(world_size):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, tp, bias=False)
        for shard_id, full in zip("qkv", (q, k, v)):
            layer.weight.weight_loader(layer.weight, full, shard_id)
        q_part, k_part, v_part = layer.split(layer.weight.data.T)
        q_rows = slice(tp.rank * layer.q_size, (tp.rank + 1) * layer.q_size)
        kv_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kv_head_of_rank[tp.rank]])
        torch.testing.assert_close(q_part.T, q[q_rows])
        torch.testing.assert_close(k_part.T, k[kv_rows])
        torch.testing.assert_close(v_part.T, v[kv_rows])
        assert layer.num_kv_heads == len(kv_head_of_rank[tp.rank])


def test_qkv_rejects_tp_that_does_not_divide_kv_heads():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(8, 2, 6, 3, TensorParallel(0, 2))


def test_row_parallel_partial_products_sum_to_full_output():
    weight, bias, x = torch.randn(5, 8, generator=GEN), torch.randn(5, generator=GEN), torch.randn(3, 8, generator=GEN)
    total = torch.zeros(3, 5)
    for tp in ranks(2):
        layer = RowParallelLinear(8, 5, tp, bias=True)
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        cols = slice(4 * tp.rank, 4 * tp.rank + 4)
        # what forward computes before its all-reduce: bias only on rank 0
        total += F.linear(x[:, cols], layer.weight, layer.bias if tp.is_first else None)
    torch.testing.assert_close(total, F.linear(x, weight, bias))
    single = RowParallelLinear(8, 5, TensorParallel.single(), bias=True)
    single.weight.weight_loader(single.weight, weight)
    single.bias.weight_loader(single.bias, bias)
    torch.testing.assert_close(single(x), F.linear(x, weight, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matmul_fp32_out_keeps_any_leading_shape_and_is_never_rounded(dtype):
    x, weight = torch.randn(2, 3, 8, generator=GEN).to(dtype), torch.randn(5, 8, generator=GEN).to(dtype)
    y = matmul_fp32_out(x, weight)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 5)
    torch.testing.assert_close(y, x.float() @ weight.float().T, rtol=1e-6, atol=1e-6)
    assert not torch.equal(y, y.to(dtype).float())  # values a rounding to `dtype` would have changed


def test_loader_rejects_wrong_checkpoint_shape():
    layer = ColumnParallelLinear(5, 8, TensorParallel.single())
    with pytest.raises(ValueError, match=r"shape \(8, 4\), expected \(8, 5\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 4))


@pytest.fixture
def gemv_calls(monkeypatch):
    """Let CPU tensors take the GEMV route (the kernel runs under TRITON_INTERPRET); record each call."""
    calls, real = [], gemv_module.gemv

    def spy(x, weight, bias=None, out_dtype=None, gated=False):
        calls.append((x.shape[0], out_dtype) + (("gated",) if gated else ()))
        return real(x, weight, bias, out_dtype, gated=gated)

    monkeypatch.setattr(gemv_module, "gemv", spy)
    monkeypatch.setattr(linear_module, "_gemv_device", lambda x: True)
    return calls


def half_layer(cls, tp, in_features=32, out_features=24):
    layer = cls(in_features, out_features, tp, bias=True).half()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=GEN) / in_features**0.5)
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=GEN))
    return layer


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_small_half_batches_take_the_gemv_unless_switched_off(gemv_calls):
    layer = half_layer(ColumnParallelLinear, TensorParallel.single())
    x = torch.randn(3, 32, generator=GEN).half()
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(layer(x).float(), ref, atol=2e-3, rtol=2e-3)
    assert gemv_calls == [(3, None)]
    layer(torch.randn(linear_module.SMALL_BATCH_MAX_M + 1, 32, generator=GEN).half())  # too many rows
    layer.float()(x.float())  # float32: cuBLAS
    layer.half().small_batch_gemv = False
    layer(x)
    assert gemv_calls == [(3, None)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_row_parallel_float32_partials_take_the_gemv_with_float32_out(gemv_calls, monkeypatch):
    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: x)  # one rank's share, no process group
    tp = TensorParallel(0, 2, reduce_dtype=torch.float32)
    layer = half_layer(RowParallelLinear, tp)
    x = torch.randn(2, 16, generator=GEN).half()
    out = layer(x)
    assert gemv_calls == [(2, torch.float32)] and out.dtype == torch.float16
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())  # rank 0 adds the bias
    torch.testing.assert_close(out, ref.half(), atol=1e-3, rtol=1e-3)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_down_proj_applies_the_swiglu_activation_itself(gemv_calls):
    """`gated`: the GEMV fuses silu(gate) * up at small batch; other batches apply it first."""
    layer = half_layer(RowParallelLinear, TensorParallel.single())
    gate_up = torch.randn(20, 64, generator=GEN).half()
    gate, up = gate_up.float().chunk(2, dim=-1)
    ref = F.linear(F.silu(gate) * up, layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(layer(gate_up[:2], gated=True).float(), ref[:2], atol=3e-3, rtol=3e-3)
    assert gemv_calls == [(2, None, "gated")]
    torch.testing.assert_close(layer(gate_up, gated=True).float(), ref, atol=3e-3, rtol=3e-3)  # 20 rows: torch
    assert len(gemv_calls) == 1


def test_the_switch_reaches_every_matmul_layer_and_the_lm_head():
    tiny = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50,
            "max_position_embeddings": 32}
    model = build_model(tiny, TensorParallel.single())
    switches = [m for m in model.modules() if isinstance(m, SmallBatchSwitch)]
    assert len(switches) == 4 * 2 + 1 and model.lm_head in switches  # qkv, o, gate_up, down per layer
    set_small_batch_gemv(model, False)
    assert not any(m.small_batch_gemv for m in switches)
    set_small_batch_gemv(model, True)
    assert all(m.small_batch_gemv for m in switches)
