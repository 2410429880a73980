"""ModelRunner: owns the model and its KV cache on one rank and turns a StepPlan into logits.

Every rank runs this identically; only tensor-parallel rank 0 gets logits back.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from models.model_config import ModelShape
from spmd_engine.distributed import all_reduce_min
from spmd_engine.forward_batch import build_host_batch, to_device
from spmd_engine.kv_cache import (CudaMemoryBudget, KVCacheSpec, allocate_kv_cache,
                                  blocks_for_bytes)
from spmd_engine.plan import BlockTableMirror, StepPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerSettings:
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enforce_eager: bool
    gpu_memory_utilization: float
    cpu_kv_cache_gib: float
    num_kv_blocks: int | None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, shape: ModelShape, settings: RunnerSettings,
                 device: torch.device, dtype: torch.dtype, tp_size: int) -> None:
        self.model = model
        self.settings = settings
        self.device = device
        self.spec = KVCacheSpec(shape.num_layers, shape.kv_heads_per_rank(tp_size), shape.head_dim,
                                settings.block_size, dtype)
        self.memory_budget: CudaMemoryBudget | None = None
        self.num_blocks = all_reduce_min(self._fit_num_blocks())
        self.kv_caches = allocate_kv_cache(self.spec, self.num_blocks, device)
        model.bind_kv_cache(self.kv_caches)
        max_blocks = -(-settings.max_model_len // settings.block_size)
        self.mirror = BlockTableMirror(max_blocks)
        self.graphs = None
        if device.type == "cuda" and not settings.enforce_eager:
            from spmd_engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs.capture(self, max_blocks)

    # --- sizing -------------------------------------------------------------------------
    def _fit_num_blocks(self) -> int:
        s = self.settings
        if s.num_kv_blocks is not None:
            return s.num_kv_blocks
        if self.device.type != "cuda":
            return blocks_for_bytes(self.spec, s.cpu_kv_cache_gib * (1 << 30))
        self.memory_budget = self._measure_cuda_budget()
        return blocks_for_bytes(self.spec, self.memory_budget.kv_bytes)

    @torch.inference_mode()
    def _measure_cuda_budget(self) -> CudaMemoryBudget:
        """Run one forward at the step token budget without a KV cache and measure its peak."""
        s = self.settings
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        num_tokens = min(s.max_num_batched_tokens, s.max_num_seqs * s.max_model_len)
        seq_len = min(num_tokens, s.max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        self._warmup_forward(lens)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - baseline
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        reserve = 0 if s.enforce_eager else 512 << 20
        return CudaMemoryBudget(total, s.gpu_memory_utilization, total - free, peak, reserve)

    def _warmup_forward(self, seq_lens: list[int]) -> None:
        from models.attention_metadata import AttentionMetadata
        dev = self.device
        q = torch.tensor(seq_lens, dtype=torch.int32)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        cu[1:] = q.cumsum(0)
        positions = torch.cat([torch.arange(n) for n in seq_lens]).to(dev)
        attn = AttentionMetadata(
            slot_mapping=torch.full((int(cu[-1]),), -1, dtype=torch.int64, device=dev),
            cu_seqlens_q=cu.to(dev), seq_lens=q.to(dev),
            block_tables=torch.zeros(len(seq_lens), 1, dtype=torch.int32, device=dev),
            max_query_len=max(seq_lens), max_seq_len=max(seq_lens), block_size=self.settings.block_size,
            is_decode=False)
        input_ids = torch.zeros(int(cu[-1]), dtype=torch.int64, device=dev)
        hidden = self.model(input_ids, positions, attn)
        last = (cu[1:] - 1).to(dev).long()
        rows = last.repeat(-(-self.settings.max_num_seqs // len(seq_lens)))[: self.settings.max_num_seqs]
        self.model.compute_logits(hidden[rows])

    # --- the step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run one planned step; logits [num_sampled, vocab] on rank 0, None elsewhere."""
        tables = self.mirror.apply(plan)
        host = build_host_batch(plan, tables, self.settings.block_size)
        if self.graphs is not None and self.graphs.can_run(host):
            return self.graphs.run(host)
        batch = to_device(host, self.settings.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn)
        if batch.logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

    def close(self) -> None:
        """Free CUDA graphs before the process group goes (NCCL hangs on destroy otherwise)."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self.model.bind_kv_cache([(None, None)] * len(self.kv_caches))
        self.kv_caches = []
