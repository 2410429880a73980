"""Paged decode attention over a bf16/fp16 KV cache, as a CUDA C++ kernel (NVRTC, kernels/cuda_rtc.py).

Why: decode attention is ~75 % of a large batch's decode step, and there the Triton kernel reads K/V at
~93 % of the copy rate. This kernel reads 1-2 % faster at large batch (H200, one layer: 256 rows x
100..1500 keys 187.7 us against 191.8, `python launch/bench/bench_fp8_decode.py --bf16`) and the engine's nano
bench gains 3 %: 27,320-27,520 output tok/s against 26,600 (`python run.py workload=bench`). It is the fp8 one's design
(kernels/decode_attention_fp8_cuda.py) without the byte converts: one warp per (sequence, KV head,
split), K/V tiles by `cp.async` into swizzled shared memory, `ldmatrix` straight into the MMA fragments
(V transposed), transposed MMAs (S^T = K q^T, O^T = V^T P^T) so the GROUP query heads fill the MMA's
8 columns and no row is padding.

Same grid, partials and merge (by the last split to finish) as the Triton split kernel; this module
also holds what both CUDA decode kernels share (device code, `builds_on`, `shapes_fit`,
`run_split_kernel`). Shapes it takes (`supports`): head_dim 128, at most 8 query heads per KV head,
block_size a power of two >= 2, the cache in the model's dtype (bf16 or fp16).

On a decode step it also prepares its own inputs (`DecodePrologue`): each warp norms and rotates its GROUP
query heads from the qkv projection's raw q while its first K/V tile lands, and the split holding the new
token norms, rotates and stores that token's K/V row, handing it to its tile in shared memory rather than
waiting for the store: qk_norm_rope_store's launch before attention goes (28 launches a Qwen3-0.6B step), for
the same cache and, within the norm's last bit, the same q. H200, `python run.py workload=bench` and
`workload.num_seqs=1`: batch 1 +3.7 % tok/s (ITL p50 1.02 -> 0.98 ms), 32 requests +2.2 %, 256 requests
+0.2-0.4 % (the prologue a warp runs while its first tile lands about pays there). Every rounding of the
store kernel is kept (the norm rounded to the model dtype before its weight, the weighted row rounded, rotary in
float32 rounded once); the norm's float32 sum runs in the warp's own order, so a q/k element may differ from
the store kernel's in its last bit.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import lru_cache

import torch

import spmd_engine.kernels.cuda_rtc as cuda_rtc
import spmd_engine.kernels.decode_attention as da
from spmd_engine.kernels.pdl import pdl_enabled

BLOCK_N = 64  # keys per tile
STAGES = 2  # tiles in flight per warp (shared memory: STAGES x 32 KB)
PROGRAMS_PER_SM = 3  # resident warps per SM when choosing the split count
# A split fewer where the count that fills the SMs' resident warps would overshoot them by at most 15 %: the
# few warps past them would run alone after the rest. H200, CUDA graphs
# (`python launch/bench/bench_decode_splits.py --small`): 8 rows x 1,024 keys 7 splits 12.4 us -> 6 splits 10.5
# (600..2,048 keys 14.7 -> 13.2), 4 rows 13 -> 12 splits 8.8 -> 7.8 (9.5 -> 9.3); 12 rows and up, where the
# overshoot is larger, keep the count that fills the GPU.
SMALL_SECOND_WAVE = 0.15
HEAD_DIM = 128
log = logging.getLogger(__name__)

# The kernel's source: decode_attention_16.cu with the two headers it shares with the fp8 kernel
# (decode_attention_ptx.cuh: PTX wrappers; decode_attention_split.cuh: the tile pipeline, one tile's online
# softmax, the output epilogue with the last split's merge, and the FUSED_QK prologue's common part)
SOURCE_FILE = "decode_attention_16.cu"

_ARG_TYPES = (
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    *(ctypes.c_void_p,) * 7, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # the FUSED_QK inputs
)
PROLOGUE_ARG_TYPES = _ARG_TYPES[-11:]  # both CUDA decode kernels end their parameters with these
NO_PROLOGUE_ARGS = (0,) * 7 + (0.0, 0, 0, 0)


@dataclass(frozen=True)
class DecodePrologue:
    """What the kernel needs to prepare its own q and the new K/V (replacing the qk_norm_rope_store launch
    before it on a decode step): the qkv projection's k and v [B, Hkv, D] (query is then its raw q), the
    step's rotary tables [B, D/2], each row's cache slot (int64, -1: not stored) and the per-head RMSNorm
    weights [D] with eps (Qwen3; None: rotary only, as Llama)."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0

    def fits(self, query: torch.Tensor) -> bool:
        """The layout the prologue reads: heads of D contiguous values, 4-byte aligned rows (its u32 loads),
        rotary tables of D/2 per row, weights [D] in the model dtype."""
        num_seqs = query.shape[0]
        if (self.q_weight is None) != (self.k_weight is None):
            return False
        rows = (self.k, self.v, self.cos, self.sin)
        weights = () if self.q_weight is None else (self.q_weight, self.k_weight)
        return (all(x.dtype == query.dtype and x.device == query.device and x.data_ptr() % 4 == 0
                    for x in rows + weights)
                and self.k.shape == self.v.shape and self.k.shape[0] == num_seqs and self.k.shape[2] == HEAD_DIM
                and self.k.stride()[1:] == (HEAD_DIM, 1) and self.v.stride()[1:] == (HEAD_DIM, 1)
                and self.k.stride(0) % 2 == 0 and self.v.stride(0) % 2 == 0
                and self.cos.shape == (num_seqs, HEAD_DIM // 2) and self.sin.stride() == self.cos.stride()
                and self.sin.shape == self.cos.shape and self.cos.stride(1) == 1 and self.cos.stride(0) % 2 == 0
                and all(w.shape == (HEAD_DIM,) and w.stride(0) == 1 for w in weights)
                and self.slot_mapping.dtype == torch.int64 and self.slot_mapping.shape == (num_seqs,)
                and self.slot_mapping.is_contiguous())

    def args(self) -> tuple:
        norm = self.q_weight is not None
        return (self.k, self.v, self.cos, self.sin, self.q_weight if norm else 0, self.k_weight if norm else 0,
                self.slot_mapping, float(self.eps), self.k.stride(0), self.v.stride(0), self.cos.stride(0))


def builds_on(device: torch.device, min_capability: tuple[int, int], build, key: str) -> bool:
    """Whether a CUDA device of `min_capability`+ with NVRTC compiles and loads a decode kernel: `build(device
    index)` is tried once; a failure logs one line naming the engine `key` and leaves every call to Triton."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < min_capability or not cuda_rtc.available():
        return False
    try:
        build(device.index if device.index is not None else torch.cuda.current_device())
    except RuntimeError as err:
        log.warning("%s: the CUDA kernel did not build here, decode stays on Triton: %s", key, err)
        return False
    return True


def shapes_fit(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, min_block_size: int,
               query_align: int) -> bool:
    """The layout both CUDA decode kernels take: head_dim 128, at most 8 query heads per KV head, a
    power-of-two block_size >= `min_block_size`, contiguous cache heads, query rows `query_align`-element
    aligned (their vector loads)."""
    _, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    align_bytes = query_align * query.element_size()
    return (head_dim == HEAD_DIM and cache_dim == HEAD_DIM and num_q_heads // num_kv_heads <= 8
            and block_size >= min_block_size and block_size & (block_size - 1) == 0 and query.stride(2) == 1
            and query.stride(1) % query_align == 0 and query.stride(0) % query_align == 0
            and query.data_ptr() % align_bytes == 0
            and k_cache.stride()[1:] == (num_kv_heads * HEAD_DIM, HEAD_DIM, 1) and v_cache.stride() == k_cache.stride()
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)


@lru_cache(maxsize=None)
def usable(device: torch.device) -> bool:
    """sm_80+ (bf16 MMAs, cp.async, ldmatrix) where NVRTC builds this kernel (`builds_on`)."""
    return builds_on(device, (8, 0), lambda index: _kernel(index, 1, 16, 1, True, 2), "cuda_decode")


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Shapes and dtypes this kernel takes (see the module doc); False sends the call to Triton."""
    return (query.device.type == "cuda" and query.dtype in (torch.bfloat16, torch.float16)
            and k_cache.dtype == query.dtype and v_cache.dtype == query.dtype and usable(query.device)
            and shapes_fit(query, k_cache, v_cache, min_block_size=2, query_align=2))


@lru_cache(maxsize=None)
def _kernel(device_index: int, group: int, block_size: int, num_kv_heads: int, is_bf16: bool,
            prologue: int = 0) -> cuda_rtc.CudaKernel:
    """`prologue`: 0 none (q rotated, K/V stored by a kernel before), 1 rotary, 2 norm and rotary (FUSED_QK)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    defines = {"GROUP": group, "BLOCK_SIZE": block_size, "STRIDE_POS_BYTES": num_kv_heads * HEAD_DIM * 2,
               "IS_BF16": int(is_bf16), "STAGES": STAGES, "BN": BLOCK_N, "FUSED_QK": int(prologue > 0),
               "HAS_NORM": int(prologue == 2)}
    cubin = cuda_rtc.nvrtc_compile(cuda_rtc.read_source(SOURCE_FILE), "paged_decode16", f"sm_{major}{minor}", defines)
    with torch.cuda.device(device_index):
        return cuda_rtc.load_kernel(cubin, "paged_decode16", _ARG_TYPES, threads=32,
                                    shared_bytes=STAGES * 2 * BLOCK_N * HEAD_DIM * 2)


def decode_config() -> da.DecodeConfig:
    """This kernel's tile as a `decode_attention.DecodeConfig` (the split rule reads its programs per SM)."""
    return da.DecodeConfig(block_n=BLOCK_N, num_warps=1, num_stages=STAGES, programs_per_sm=PROGRAMS_PER_SM,
                           small_second_wave=SMALL_SECOND_WAVE)


def run_split_kernel(name: str, kernel: cuda_rtc.CudaKernel, query: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     out: torch.Tensor | None, num_splits: int | None, cfg: da.DecodeConfig,
                     cache_args: tuple = (), tail_args: tuple = ()) -> torch.Tensor:
    """Both CUDA decode kernels' launch: the split count (`decode_attention.split_count`), the partials,
    grid (splits x KV heads x sequences), PDL where the engine asks for it (kernels/pdl.py), and the merge
    by the last split to finish (its arrival counters, `decode_attention.merge_counters`). `cache_args`
    follow the block tables in the kernel's parameters (the fp8 scales), `tail_args` end them."""
    da.check_attention_inputs(name, query, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(query)
    num_seqs, num_q_heads, _ = query.shape
    if num_seqs == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    num_splits = da.split_count(name, num_splits, num_seqs, k_cache, block_tables, cfg)
    partial_out, partial_lse = da._split_partials(query, out, num_splits)
    counters = da.merge_counters(query.device, num_seqs * num_kv_heads) if num_splits > 1 else 0
    kernel.launch((num_splits, num_kv_heads, num_seqs), [
        query, k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables, *cache_args,
        scale * da._LOG2_E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0) * k_cache.element_size(), block_tables.stride(0), num_q_heads, num_splits, *tail_args,
    ], pdl=pdl_enabled(query.device))
    return out


def paged_decode_attention_cuda(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None, *, num_splits: int | None = None,
    prologue: DecodePrologue | None = None,
) -> torch.Tensor:
    """`decode_attention.paged_decode_attention` for the shapes `supports` accepts: same arguments and result.
    With `prologue` (its `fits` holds), query is the projection's raw q: the kernel norms and rotates it, and
    stores each row's new K/V at its slot before attending (the cache afterwards as qk_norm_rope_store
    leaves it)."""
    num_q_heads, (block_size, num_kv_heads) = query.shape[1], k_cache.shape[1:3]
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    if prologue is not None and not prologue.fits(query):
        raise ValueError("paged_decode_attention_cuda: the prologue's k/v/cos/sin/weights/slots do not fit "
                         f"(DecodePrologue.fits) for query {tuple(query.shape)} {query.dtype}")
    kind = 0 if prologue is None else 1 if prologue.q_weight is None else 2
    kernel = _kernel(index, num_q_heads // num_kv_heads, block_size, num_kv_heads, query.dtype == torch.bfloat16,
                     kind)
    return run_split_kernel("paged_decode_attention_cuda", kernel, query, k_cache, v_cache, seq_lens, block_tables,
                            scale, out, num_splits, decode_config(),
                            tail_args=NO_PROLOGUE_ARGS if prologue is None else prologue.args())
