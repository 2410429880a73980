"""Attention backends: the engine picks one at start-up (`select_attention_backend`) and every attention layer
holds it (models/layers/attention.py)."""
from __future__ import annotations

import torch

from spmd_engine.models.layers.attention_backends.base import AttentionBackend

ATTENTION_BACKENDS = ("torch", "triton")


def select_attention_backend(name: str, device: torch.device | None = None, kv_cache_dtype: str = "auto",
                             cuda_decode: bool = True, cuda_fp8_decode: bool = True) -> AttentionBackend:
    """The backend for `attention_backend=name` on `device` with this cache (`kv_cache_dtype` auto | fp8 | int8).
    On a CUDA device the Triton backend's decode rows go to the cache's CUDA decode kernel unless its switch
    (`cuda_decode`: bf16/fp16 caches, `cuda_fp8_decode`: fp8 caches) is off; the kernel still checks each
    call's shapes and hands back the ones it does not take."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch":
        from spmd_engine.models.layers.attention_backends.torch_reference import TorchAttentionBackend

        return TorchAttentionBackend()
    from spmd_engine.models.layers.attention_backends.triton import TritonAttentionBackend

    fp8 = kv_cache_dtype == "fp8"
    if device is None or device.type != "cuda" or kv_cache_dtype == "int8" \
            or not (cuda_fp8_decode if fp8 else cuda_decode):  # int8: no CUDA decode kernel reads it
        return TritonAttentionBackend()
    from spmd_engine.models.layers.attention_backends.cuda_decode import CudaDecodeAttentionBackend, CudaDecodeKernel

    kernel = CudaDecodeKernel.for_fp8_cache() if fp8 else CudaDecodeKernel.for_16_bit_cache()
    return CudaDecodeAttentionBackend(kernel)
