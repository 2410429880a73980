import pytest
import torch

from spmd_engine.models.attention_metadata import AttentionMetadata
from spmd_engine.models.layers.attention import Attention

HQ, HKV, D, BLOCK = 4, 2, 16, 4
LENS = [5, 9]  # two sequences; 9 crosses two block boundaries


def metadata(chunks: list[tuple[int, int]], tables: torch.Tensor) -> AttentionMetadata:
    """chunks[b] = (first position, number of new tokens) of sequence b."""
    slots = [int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for b, (s, n) in enumerate(chunks) for p in range(s, s + n)]
    q_lens = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    seq_lens = torch.tensor([s + n for s, n in chunks], dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)])
    return AttentionMetadata(torch.tensor(slots, dtype=torch.int64), cu, seq_lens, tables, int(q_lens.max()),
                             int(seq_lens.max()), BLOCK, is_decode=bool((q_lens == 1).all()))


def qkv(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, HQ * D, generator=gen), torch.randn(num_tokens, HKV * D, generator=gen),
            torch.randn(num_tokens, HKV * D, generator=gen))


def bound_layer(backend: str) -> Attention:
    layer = Attention(HQ, HKV, D, D**-0.5, backend)
    layer.k_cache, layer.v_cache = torch.zeros(2, 12, BLOCK, HKV, D).unbind(0)
    return layer


# the Triton cases take CPU tensors: they run under TRITON_INTERPRET (CPU machines); on a GPU machine the
# kernels' own tests (tests/kernels, tests/gpu) cover them on the device
ON_CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors needs TRITON_INTERPRET")

TABLES = torch.tensor([[7, 2, 0], [3, 10, 5]], dtype=torch.int32)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of one whole sequence, written out directly."""
    qh, kh, vh = (x.view(x.shape[0], -1, D).transpose(0, 1) for x in (q, k, v))
    kh, vh = kh.repeat_interleave(HQ // HKV, 0), vh.repeat_interleave(HQ // HKV, 0)
    scores = qh @ kh.transpose(1, 2) * D**-0.5
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(0, 1).reshape(q.shape[0], -1)


def test_without_cache_attends_causally_within_each_sequence():
    q, k, v = qkv(sum(LENS), seed=0)
    out = Attention(HQ, HKV, D, D**-0.5, "torch")(q, k, v, metadata([(0, n) for n in LENS], TABLES))
    first = LENS[0]
    torch.testing.assert_close(out[:first], full_attention(q[:first], k[:first], v[:first]))
    torch.testing.assert_close(out[first:], full_attention(q[first:], k[first:], v[first:]))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=ON_CPU_ONLY)])
def test_chunked_prefill_then_decode_over_paged_cache(backend):
    """Prefill in two chunks, then one decode token: each matches attention over the whole sequence."""
    total = [n + 1 for n in LENS]
    q, k, v = qkv(sum(total), seed=1)
    per_seq = [(q[s:s + n], k[s:s + n], v[s:s + n]) for s, n in zip([0, total[0]], total)]
    expected = [full_attention(*seq) for seq in per_seq]
    layer = bound_layer(backend)
    split = 3  # first chunk: 3 tokens of each sequence; then the rest of the prompt; then 1 decode token
    steps = [[(0, split)] * 2, [(split, n - split) for n in LENS], [(n, 1) for n in LENS]]
    for chunks in steps:
        rows = [slice(s, s + n) for s, n in chunks]
        out = layer(torch.cat([seq[0][r] for seq, r in zip(per_seq, rows)]),
                    torch.cat([seq[1][r] for seq, r in zip(per_seq, rows)]),
                    torch.cat([seq[2][r] for seq, r in zip(per_seq, rows)]), metadata(chunks, TABLES))
        torch.testing.assert_close(out, torch.cat([exp[r] for exp, r in zip(expected, rows)]), rtol=1e-4, atol=1e-4)


@ON_CPU_ONLY
def test_mixed_batch_split_into_decode_and_prefill_kernels_equals_all_prefill():
    """Decode rows first (query length 1) through the decode kernel, the prompt chunks through the
    prefill kernel: the same output as every row through the prefill kernel, and as the reference."""
    tables = torch.tensor([[7, 2, 0], [3, 10, 5], [1, 4, 6], [8, 9, 11]], dtype=torch.int32)
    cached = [(0, 6), (0, 9), (0, 4), (0, 3)]  # earlier steps' K/V
    step = [(6, 1), (9, 1), (4, 5), (3, 2)]  # two decodes, then two prompt chunks
    layer = bound_layer("triton")
    q, k, v = qkv(sum(n for _, n in cached), seed=3)
    layer(q, k, v, metadata(cached, tables))
    q, k, v = qkv(sum(n for _, n in step), seed=4)
    layer.store(k, v, metadata(step, tables))
    split = metadata(step, tables)
    split.num_decode_seqs = 2
    all_prefill = layer.attend(q, None, None, metadata(step, tables))
    out = torch.full_like(q, float("nan"))
    assert layer.attend(q, None, None, split, out=out) is out
    torch.testing.assert_close(out, all_prefill, rtol=1e-5, atol=1e-5)
    reference = bound_layer("torch")
    reference.k_cache, reference.v_cache = layer.k_cache, layer.v_cache
    torch.testing.assert_close(out, reference.attend(q, None, None, split), rtol=1e-4, atol=1e-4)


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="attention_backend must be one of torch, triton"):
        Attention(HQ, HKV, D, 1.0, "flash")


MIXED_TABLES = torch.tensor([[7, 2, 0], [3, 10, 5], [1, 4, 6], [8, 9, 11]], dtype=torch.int32)
MIXED_STEP = [(6, 1), (9, 1), (4, 5), (3, 2)]  # two decodes, then two prompt chunks


def mixed_step_layers(count: int, seed: int) -> tuple[list[Attention], AttentionMetadata]:
    """`count` bound Triton layers holding four sequences' earlier K/V, and the metadata of MIXED_STEP."""
    cached = [(0, 6), (0, 9), (0, 4), (0, 3)]
    layers = [bound_layer("triton") for _ in range(count)]
    for i, layer in enumerate(layers):
        layer(*qkv(sum(n for _, n in cached), seed=seed + i), metadata(cached, MIXED_TABLES))
    attn = metadata(MIXED_STEP, MIXED_TABLES)
    attn.num_decode_seqs = 2
    return layers, attn


def two_kernel_attention(layer: Attention, q: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
    """The decode kernel on MIXED_STEP's two decode rows, the prefill kernel on its prompt chunks."""
    from spmd_engine.kernels.decode_attention import paged_decode_attention
    from spmd_engine.kernels.prefill_attention import paged_prefill_attention

    qh = q.view(-1, HQ, D)
    expected = torch.empty_like(qh)
    paged_decode_attention(qh[:2], layer.k_cache, layer.v_cache, attn.seq_lens[:2], MIXED_TABLES[:2], layer.scale,
                           expected[:2])
    paged_prefill_attention(qh, layer.k_cache, layer.v_cache, attn.cu_seqlens_q[2:].clone(), attn.seq_lens[2:].clone(),
                            MIXED_TABLES[2:], layer.scale, attn.max_query_len, expected)
    return expected.view(q.shape)


def record_triton_launches(monkeypatch) -> list[str]:
    """The names of the Triton kernels launched from now on, in order."""
    from spmd_engine.kernels import mixed_attention

    launches: list[str] = []
    kernel_type = type(mixed_attention._mixed_paged_attention_kernel)
    getitem = kernel_type.__getitem__
    monkeypatch.setattr(kernel_type, "__getitem__", lambda k, grid: launches.append(k.fn.__name__) or getitem(k, grid))
    return launches


@ON_CPU_ONLY
@pytest.mark.parametrize("one_launch", [True, False])
def test_mixed_step_is_planned_once_and_launched_once_per_layer(monkeypatch, one_launch):
    """Every layer of a mixed step reuses the plan the first one built (checks, split count, grids
    computed once per step) and launches one kernel (or, with a decode tile whose num_warps differ from the
    prefill tile's, the decode and prefill kernels); each layer's output has the bits of the decode-kernel +
    prefill-kernel path."""
    import dataclasses

    from spmd_engine.kernels import mixed_attention
    from spmd_engine.kernels.decode_attention import default_decode_config
    from spmd_engine.kernels.prefill_attention import default_prefill_config

    layers, attn = mixed_step_layers(3, seed=10)
    plans, launches = [], record_triton_launches(monkeypatch)
    build = mixed_attention.plan_paged_attention
    cpu = torch.device("cpu")
    apart = dataclasses.replace(default_decode_config(D, cpu), num_warps=2 * default_prefill_config(D, cpu).num_warps)
    tiles = {} if one_launch else {"decode_config": apart}  # other warps, the same bits under the interpreter
    monkeypatch.setattr(mixed_attention, "plan_paged_attention",
                        lambda *a, **k: plans.append(build(*a, **k, **tiles)) or plans[-1])
    for i, layer in enumerate(layers):
        q, k, v = qkv(sum(n for _, n in MIXED_STEP), seed=20 + i)
        out = layer(q, k, v, attn)
        assert torch.equal(out, two_kernel_attention(layer, q, attn))
    assert len(plans) == 1
    # per layer: its one launch, then the two reference launches of the check
    launches = [name for name in launches if "store" not in name]  # the layer's KV store is one launch too
    layer_launches = (["_mixed_paged_attention_kernel"] if one_launch
                      else ["_decode_any_splits_kernel", "_paged_prefill_kernel"])
    assert launches == (layer_launches + ["_decode_split_kernel", "_paged_prefill_kernel"]) * 3


class _CudaDecodeStandIn:
    """Stands in for kernels/decode_attention_cuda on CPU: takes every shape and attends with the Triton decode
    kernel; records what each call was handed."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @staticmethod
    def supports(query, k_cache, v_cache) -> bool:
        return True

    def paged_decode_attention_cuda(self, query, k_cache, v_cache, seq_lens, block_tables, scale, out=None, *,
                                    num_splits=None, prologue=None):
        from spmd_engine.kernels.decode_attention import paged_decode_attention

        self.calls.append((query, seq_lens, block_tables, out))
        return paged_decode_attention(query, k_cache, v_cache, seq_lens, block_tables, scale, out)


@ON_CPU_ONLY
@pytest.mark.parametrize("on_cuda", [True, False])
def test_a_mixed_step_hands_its_decode_rows_to_the_cuda_decode_kernel(monkeypatch, on_cuda):
    """On the CUDA decode backend a mixed step's decode rows go to the cache's CUDA decode kernel (here a
    stand-in) and the prompt chunks to the Triton prefill kernel, in place of the mixed kernel: the same output
    as the decode kernel + prefill kernel, every layer; on the Triton backend the mixed kernel takes both.
    Decode steps keep their own path."""
    from spmd_engine.models.layers.attention import use_attention_backend
    from spmd_engine.models.layers.attention_backends.cuda_decode import CudaDecodeAttentionBackend, CudaDecodeKernel

    stand_in = _CudaDecodeStandIn()
    layers, attn = mixed_step_layers(2, seed=30)
    if on_cuda:
        backend = CudaDecodeAttentionBackend(CudaDecodeKernel(stand_in, "paged_decode_attention_cuda", False))
        for layer in layers:
            use_attention_backend(layer, backend)
    launches = record_triton_launches(monkeypatch)
    for i, layer in enumerate(layers):
        q, k, v = qkv(sum(n for _, n in MIXED_STEP), seed=40 + i)
        out = layer(q, k, v, attn)
        torch.testing.assert_close(out, two_kernel_attention(layer, q, attn), rtol=1e-6, atol=1e-6)
    launches = [name for name in launches if "store" not in name]
    if on_cuda:
        assert len(stand_in.calls) == len(layers)
        for query, seq_lens, block_tables, into in stand_in.calls:  # the first two rows, written in place
            assert query.shape == (2, HQ, D) and into.shape == (2, HQ, D)
            assert torch.equal(seq_lens, attn.seq_lens[:2]) and torch.equal(block_tables, MIXED_TABLES[:2])
        # the stand-in's decode launch, the prefill kernel; then the check's two
        assert launches == ["_decode_split_kernel", "_paged_prefill_kernel"] * 2 * len(layers)
    else:
        assert not stand_in.calls
        assert launches == ["_mixed_paged_attention_kernel", "_decode_split_kernel", "_paged_prefill_kernel"] * 2
    decode_step = metadata([(7, 1), (10, 1)], MIXED_TABLES[:2])
    layers[0](*qkv(2, seed=50), decode_step)
    assert len(stand_in.calls) == (len(layers) if on_cuda else 0)  # a decode step: not through this path


def test_the_engine_picks_the_backend_once_for_every_attention_layer():
    """`select_attention_backend`: the CUDA decode kernel of the cache's dtype on a CUDA device unless its switch
    (engine keys cuda_decode, cuda_fp8_decode) is off, the Triton kernels alone elsewhere; `use_attention_backend`
    hands the one object to every layer. On CPU the CUDA kernels never apply (they take CUDA tensors only)."""
    from spmd_engine.kernels.decode_attention_cuda import supports as supports_16
    from spmd_engine.kernels.decode_attention_fp8_cuda import supports as supports_fp8
    from spmd_engine.kernels.kv_quant import FP8_DTYPE
    from spmd_engine.models.layers.attention import use_attention_backend
    from spmd_engine.models.layers.attention_backends import select_attention_backend
    from spmd_engine.models.layers.attention_backends.cuda_decode import CudaDecodeAttentionBackend
    from spmd_engine.models.layers.attention_backends.torch_reference import TorchAttentionBackend
    from spmd_engine.models.layers.attention_backends.triton import TritonAttentionBackend
    from spmd_engine.models.parallel import TensorParallel
    from spmd_engine.models.registry import build_model

    cuda = torch.device("cuda")
    fp8 = select_attention_backend("triton", cuda, "fp8", cuda_decode=False, cuda_fp8_decode=True)
    bf16 = select_attention_backend("triton", cuda, "auto", cuda_decode=True, cuda_fp8_decode=False)
    assert type(fp8) is CudaDecodeAttentionBackend and fp8.kernel.module.supports is supports_fp8
    assert type(bf16) is CudaDecodeAttentionBackend and bf16.kernel.module.supports is supports_16
    for off in (select_attention_backend("triton", cuda, "fp8", cuda_decode=True, cuda_fp8_decode=False),
                select_attention_backend("triton", cuda, "auto", cuda_decode=False, cuda_fp8_decode=True),
                select_attention_backend("triton", cuda, "int8"),  # no CUDA decode kernel reads an int8 cache
                select_attention_backend("triton", torch.device("cpu"), "auto"), select_attention_backend("triton")):
        assert type(off) is TritonAttentionBackend
    assert type(select_attention_backend("torch", cuda, "fp8")) is TorchAttentionBackend
    assert fp8.name == bf16.name == "triton"

    tiny = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "max_position_embeddings": 32}
    layers = [m for m in build_model(tiny, TensorParallel.single()).modules() if isinstance(m, Attention)]
    assert len(layers) == 3 and len({id(layer.attention_backend) for layer in layers}) == 3
    use_attention_backend(layers[1], fp8)  # a layer is a module too: the choice walks whatever it is given
    assert [layer.attention_backend is fp8 for layer in layers] == [False, True, False]
    query = torch.zeros(2, 16, 128, dtype=torch.bfloat16)
    cache16, cache8 = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16), torch.zeros(4, 16, 8, 128, dtype=FP8_DTYPE)
    assert not supports_16(query, cache16, cache16) and not supports_16(query, cache8, cache8)
    assert not supports_fp8(query, cache8, cache8)
