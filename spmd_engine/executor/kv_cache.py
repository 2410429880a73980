"""KV cache sizing and allocation: one tensor for all layers, viewed per layer as (K, V).

Sizing is the only place that depends on the device: a fixed `num_kv_blocks`, a GiB budget on
CPU, or what is left of `gpu_memory_utilization` after weights and the measured activation peak.
Blocks are counted with the cache's element size, so `kv_cache_dtype=fp8` (1 byte) holds twice
the tokens of a bf16 cache in the same bytes.

fp8 scales (per layer and KV head, K and V apart) are calibrated once at start-up: every rank runs
the same fixed pseudo-random token sequence (`fp8_calibration_ids`) through the model before the
cache is bound, each layer records max |K| and |V| per head, and the scale is the smallest power of
two that maps FP8_SCALE_HEADROOM x that maximum into e4m3's +-448. It depends only on the weights
(never on a job's prompts or batch), so runs are repeatable and a TP rank's shard gets the same
scales whoever else runs; values beyond the headroom saturate at +-448 instead of overflowing.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from spmd_engine.kernels.kv_quant import FP8_DTYPE, pow2_scale_for_absmax
from spmd_engine.models.model_config import ModelShape
from spmd_engine.executor.forward_batch import HostBatch, to_device

log = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("auto", "fp8", "int8")  # auto: the model dtype; fp8: float8_e4m3fn with per-head scales;
# int8: Hadamard-rotated int8 rows with a float32 scale per (token, KV head) at each row's end (kernels/reference.py)
KV_INT8_SCALE_BYTES = 4
FP8_CALIBRATION_TOKENS = 512
FP8_CALIBRATION_SEED = 0
# x4 (x4..x8 after rounding to a power of two) over the calibration maximum: real text reaches up
# to ~1.5x the random-token maximum on SmolLM2, and e4m3 keeps full relative precision down to
# 2**-6 of its range, so the headroom costs nothing measurable (`python launch/bench/fp8_kv_accuracy.py`:
# real-text max |K|, |V| at most 2.13x the calibration max, no (layer, head) saturates; a fixed scale
# of 1.0 flips the same positions)
FP8_SCALE_HEADROOM = 4.0


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`kv_cache_dtype` -> the dtype the cache is stored in."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {'|'.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name == "int8":
        return torch.int8
    return FP8_DTYPE if name == "fp8" else model_dtype


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the stored element type (float8_e4m3fn with kv_cache_dtype=fp8)

    @classmethod
    def for_model(cls, shape: ModelShape, tp_size: int, block_size: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto") -> "KVCacheSpec":
        """`dtype` is the model's; `kv_cache_dtype` (auto | fp8) picks what the cache stores."""
        return cls(shape.num_layers, shape.kv_heads_per_rank(tp_size), shape.head_dim, block_size,
                   resolve_kv_cache_dtype(kv_cache_dtype, dtype))

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    @property
    def row_width(self) -> int:
        """Elements of one stored (token, KV head) row: head_dim, plus the row's 4 scale bytes in an int8 cache."""
        return self.head_dim + (KV_INT8_SCALE_BYTES if self.dtype == torch.int8 else 0)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row_width * elem


@dataclass(frozen=True)
class CudaMemoryBudget:
    """The numbers behind a CUDA KV sizing decision (logged, and quoted in errors).

    The eager activations of a step and the sampler's temporaries never live at the same time, so
    only the larger one is kept free; the CUDA graphs' memory pool stays allocated for good.
    """

    total: int
    utilization: float
    in_use: int  # weights, CUDA context, NCCL, other processes: total - free after the warm-up
    activation_peak: int  # extra bytes the warm-up forward at max_num_batched_tokens needed
    sampler_peak: int  # extra bytes sampling max_num_seqs rows needed (rank 0)
    graph_pool: int  # decode + piecewise CUDA graphs (one pool): warm-up peaks, static outputs and buffers

    @property
    def kv_bytes(self) -> int:
        return (int(self.total * self.utilization) - self.in_use - max(self.activation_peak, self.sampler_peak)
                - self.graph_pool)

    def describe(self) -> str:
        gib = 1 << 30
        return (f"total {self.total / gib:.2f} GiB x gpu_memory_utilization {self.utilization} - in use "
                f"{self.in_use / gib:.2f} GiB - max(activation peak {self.activation_peak / gib:.2f}, sampler peak "
                f"{self.sampler_peak / gib:.2f}) GiB - CUDA graph pool {self.graph_pool / gib:.2f} GiB = "
                f"{self.kv_bytes / gib:.2f} GiB for KV")


def blocks_for_bytes(spec: KVCacheSpec, num_bytes: float) -> int:
    return max(0, int(num_bytes // spec.bytes_per_block))


def planned_num_blocks(spec: KVCacheSpec, num_kv_blocks: int | None, cpu_kv_cache_gib: float,
                       device: torch.device) -> int | None:
    """The pool size known without running the model: fixed, or the CPU budget; None on CUDA (measured)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if device.type != "cuda":
        return blocks_for_bytes(spec, cpu_kv_cache_gib * (1 << 30))
    return None


def fp8_calibration_ids(vocab_size: int, num_tokens: int) -> torch.Tensor:
    """The calibration sequence: the same token ids on every rank, machine and run (CPU generator)."""
    gen = torch.Generator().manual_seed(FP8_CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (num_tokens,), generator=gen, dtype=torch.int64)


def fp8_scales_from_absmax(absmax: torch.Tensor, headroom: float = FP8_SCALE_HEADROOM) -> torch.Tensor:
    """absmax [..., Hkv] (max |K| or |V| per head) -> power-of-two float32 scales of the same shape."""
    flat = [pow2_scale_for_absmax(float(a), headroom) for a in absmax.detach().cpu().reshape(-1).tolist()]
    if not all(math.isfinite(s) and s > 0 for s in flat):
        raise ValueError(f"fp8 KV calibration produced unusable scales {flat}")
    return torch.tensor(flat, dtype=torch.float32).reshape(absmax.shape)


@torch.inference_mode()
def measure_kv_absmax(model: torch.nn.Module, token_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """max |K| and |V| per (layer, KV head) over one fresh sequence: [num_layers, 2, num_kv_heads] float32.

    Runs the sequence through the model while no KV cache is bound (a collective forward under
    tensor parallelism: every rank must call it at the same point).
    """
    layers = model.attention_layers()
    if any(layer.k_cache is not None for layer in layers):
        raise RuntimeError("measure the KV absmax before the KV cache is bound")
    num_tokens = token_ids.numel()
    for layer in layers:
        layer.kv_absmax = torch.zeros(2, layer.num_kv_heads, dtype=torch.float32, device=device)
    try:
        batch = to_device(HostBatch.unstored_prefill([num_tokens]), 1, device)  # stores nothing
        model(token_ids.to(device), batch.positions, batch.attn)
        return torch.stack([layer.kv_absmax for layer in layers])
    finally:
        for layer in layers:
            layer.kv_absmax = None


def calibrate_fp8_kv_scales(model: torch.nn.Module, vocab_size: int, num_tokens: int,
                            device: torch.device) -> torch.Tensor:
    """Per-(layer, KV head) scales for K and V, [num_layers, 2, num_kv_heads] float32 on `device`,
    from the fixed calibration sequence (every rank calls this at the same point)."""
    absmax = measure_kv_absmax(model, fp8_calibration_ids(vocab_size, num_tokens), device)
    scales = fp8_scales_from_absmax(absmax)
    log.info("fp8 KV cache: scales calibrated on %d tokens: K 2^%d..2^%d, V 2^%d..2^%d", num_tokens,
             *(int(f(scales[:, i]).log2()) for i in (0, 1) for f in (torch.min, torch.max)))
    return scales.to(device)


def bind_kv_scales(model: torch.nn.Module, scales: torch.Tensor | None) -> None:
    """Give layer i its (k_scale, v_scale) = scales[i]; None unbinds (a cache in the model dtype)."""
    for i, layer in enumerate(model.attention_layers()):
        layer.k_scale, layer.v_scale = (None, None) if scales is None else (scales[i, 0], scales[i, 1])


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = torch.empty(spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.row_width,
                        dtype=spec.dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(spec.num_layers)]


def copy_kv_blocks(caches: list[tuple[torch.Tensor, torch.Tensor]], copies: torch.Tensor) -> None:
    """Copy whole KV blocks, every layer, K and V: `copies` [C, 2] int64 (source, destination) rows on the
    cache's device. Byte views, so any stored dtype (fp8 included) copies bit for bit."""
    src, dst = copies[:, 0], copies[:, 1]
    for k, v in caches:
        for cache in (k.view(torch.uint8), v.view(torch.uint8)):
            cache.index_copy_(0, dst, cache.index_select(0, src))


@dataclass(frozen=True)
class KVCapacity:
    """The pool a job got, as metrics.json reports it (blocks, tokens, bytes)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int

    def as_dict(self) -> dict:
        return {"blocks": self.num_blocks, "tokens": self.num_blocks * self.block_size,
                "bytes": self.num_blocks * self.bytes_per_block,
                "gib": round(self.num_blocks * self.bytes_per_block / (1 << 30), 4)}
