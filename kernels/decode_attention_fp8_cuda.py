"""Paged decode attention over a float8 e4m3 KV cache, as a CUDA C++ kernel (NVRTC, kernels/cuda_rtc.py).

Why not Triton: Triton gives both operands of a dot fed from 8-bit data its own register layout, so the
fp8 tiles reach the MMA through byte loads from shared memory and register shuffles; that kernel is
bound by instruction issue at 71 % of the copy rate where the bf16 kernel reaches ~96 %
(`python launch/bench/bench_attention.py`). This one, H200, Qwen3-0.6B heads, one layer: 129 rows x 200..2000
keys 83.6 us against Triton's 118.5, 256 x 2048 260 us (4.13 TB/s of K/V) against 300; the engine's fp8
bench 37,160-38,060 output tok/s against 32,600-32,780 (`python launch/bench/bench_fp8_decode.py`,
`python run.py workload=bench kv_cache_dtype=fp8`).

Here each warp converts the bytes once into the MMA's own fragments: K and V tiles arrive by `cp.async`
into swizzled shared memory, `ldmatrix` (V transposed) hands every lane exactly the four e4m3 bytes it
needs, and one `cvt.rn.f16x2.e4m3x2` per pair gives the float16 operand. The dot products stay in float16
with float32 accumulation, as in the Triton fp8 path (kernels/paged_kv_tile.fp8_dot_in_f16); the
dequantization scales are folded into the softmax scale (K) and the output (V).

One warp is one (sequence, KV head, split) program, the Triton split kernel's grid, partials and merge
(`decode_attention_cuda.run_split_kernel`), so a step may mix the two. Same math, not the same
bits: the Triton kernel stays the reference the GPU tests compare this one against.

Shapes it takes (`supports`): head_dim 128, at most 8 query heads per KV head, block_size a power of
two >= 4, a bf16/fp16 model; everything else runs the Triton kernel.

On a decode step it prepares its own q and new K/V as the bf16 kernel does (`DecodePrologue`,
decode_attention_cuda's module doc), quantizing the new row as kernels/kv_store.py does (x / scale, the
nearest e4m3, saturating) and writing it into the K row and the V pair of positions.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

import spmd_engine.kernels.cuda_rtc as cuda_rtc
import spmd_engine.kernels.decode_attention_cuda as cuda16
import spmd_engine.kernels.decode_attention as da

# keys per tile, and tiles in flight per warp (shared memory: STAGES x 16 KB). H200, one layer, us: 64 / 2 ties
# 64 / 3 in the engine (37,611 / 38,063 against 37,655 / 37,674 tok/s); 32-key tiles are slower alone
BLOCK_N = 64
STAGES = 2
PROGRAMS_PER_SM = 6  # resident warps per SM (shared memory: STAGES x 16 KB each) when choosing the split count
HEAD_DIM = 128

# decode_attention_fp8.cu with the headers it shares with the bf16/fp16 kernel (decode_attention_cuda.SOURCE_FILE)
SOURCE_FILE = "decode_attention_fp8.cu"

_ARG_TYPES = (
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    *cuda16.PROLOGUE_ARG_TYPES,
)
DecodePrologue = cuda16.DecodePrologue


@lru_cache(maxsize=None)
def usable(device: torch.device) -> bool:
    """sm_89+ (the e4m3 converts) where NVRTC builds this kernel (`decode_attention_cuda.builds_on`)."""
    return cuda16.builds_on(device, (8, 9), lambda index: _kernel(index, 1, 16, 1, True, 2), "cuda_fp8_decode")


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Shapes and dtypes this kernel takes (see the module doc); False sends the call to Triton."""
    return (query.device.type == "cuda" and query.dtype in (torch.bfloat16, torch.float16) and usable(query.device)
            and cuda16.shapes_fit(query, k_cache, v_cache, min_block_size=4, query_align=4))


@lru_cache(maxsize=None)
def _kernel(device_index: int, group: int, block_size: int, num_kv_heads: int, out_bf16: bool,
            prologue: int = 0) -> cuda_rtc.CudaKernel:
    """`prologue`: as decode_attention_cuda._kernel's (0 none, 1 rotary, 2 norm and rotary)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    defines = {"GROUP": group, "BLOCK_SIZE": block_size, "STRIDE_POS": num_kv_heads * HEAD_DIM,
               "OUT_BF16": int(out_bf16), "STAGES": STAGES, "BN": BLOCK_N, "FUSED_QK": int(prologue > 0),
               "HAS_NORM": int(prologue == 2)}
    cubin = cuda_rtc.nvrtc_compile(cuda_rtc.read_source(SOURCE_FILE), "fp8_paged_decode", f"sm_{major}{minor}", defines)
    with torch.cuda.device(device_index):
        return cuda_rtc.load_kernel(cubin, "fp8_paged_decode", _ARG_TYPES, threads=32,
                                    shared_bytes=STAGES * 2 * BLOCK_N * HEAD_DIM)


def decode_config() -> da.DecodeConfig:
    """This kernel's tile as a `decode_attention.DecodeConfig` (the split rule reads its programs per SM)."""
    return da.DecodeConfig(block_n=BLOCK_N, num_warps=1, num_stages=STAGES, programs_per_sm=PROGRAMS_PER_SM)


def paged_decode_attention_fp8(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
    k_scale: torch.Tensor, v_scale: torch.Tensor, num_splits: int | None = None,
    prologue: cuda16.DecodePrologue | None = None,
) -> torch.Tensor:
    """`decode_attention.paged_decode_attention` for the shapes `supports` accepts: same arguments and result.
    With `prologue`, as `decode_attention_cuda.paged_decode_attention_cuda`'s (the new K/V quantized as
    kernels/kv_store.py does it)."""
    if not da.check_kv_scales("paged_decode_attention_fp8", k_cache, k_scale, v_scale):
        raise ValueError("paged_decode_attention_fp8: the cache must be float8_e4m3fn")
    if prologue is not None and not prologue.fits(query):
        raise ValueError("paged_decode_attention_fp8: the prologue's k/v/cos/sin/weights/slots do not fit "
                         f"(DecodePrologue.fits) for query {tuple(query.shape)} {query.dtype}")
    num_q_heads, (block_size, num_kv_heads) = query.shape[1], k_cache.shape[1:3]
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    kind = 0 if prologue is None else 1 if prologue.q_weight is None else 2
    kernel = _kernel(index, num_q_heads // num_kv_heads, block_size, num_kv_heads, query.dtype == torch.bfloat16,
                     kind)
    return cuda16.run_split_kernel("paged_decode_attention_fp8", kernel, query, k_cache, v_cache, seq_lens,
                                   block_tables, scale, out, num_splits, decode_config(), (k_scale, v_scale),
                                   cuda16.NO_PROLOGUE_ARGS if prologue is None else prologue.args())
