"""ModelRunner: owns the model and its KV cache on one rank and turns a StepPlan into logits.

Every rank runs this identically; only tensor-parallel rank 0 gets logits back. On CUDA a step's
inputs go through persistent pinned buffers (one host->device copy) and decode steps replay CUDA
graphs captured over those same buffers.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import numpy as np
import torch

from spmd_engine.config import ConfigError
from spmd_engine.models.model_config import ModelShape
from spmd_engine.distributed import Replica, all_reduce_min, broadcast_tensor, is_distributed
from spmd_engine.executor.cuda_graphs import PDL_MAX_ROWS, DecodeGraphs, graph_batch_sizes
from spmd_engine.executor.forward_batch import ForwardBatch, HostBatch, build_host_batch, to_device
from spmd_engine.executor.input_buffers import InputBuffers
from spmd_engine.executor.sampler_graphs import SamplerGraphs, sampler_graph_bytes
from spmd_engine.executor.piecewise_graphs import CudaGraphCapture, PiecewiseGraphs, piecewise_token_buckets
from spmd_engine.executor.kv_cache import (FP8_CALIBRATION_TOKENS, CudaMemoryBudget, KVCacheSpec, allocate_kv_cache,
                                           bind_kv_scales, blocks_for_bytes, calibrate_fp8_kv_scales, copy_kv_blocks,
                                           planned_num_blocks)
from spmd_engine.core.plan import StepPlan
from spmd_engine.executor.block_table import BlockTableMirror
from spmd_engine.executor.logprobs import host_to_device, prompt_logit_rows

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
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8 (float8_e4m3fn, calibrated per-head scales)
    cuda_pdl: bool = True  # debug.cuda_pdl: small decode graphs launch Triton kernels with PDL where it runs
    sampler_graphs: bool = True  # debug.sampler_graphs: rank 0 samples all-greedy / all-plain decode steps by graphs


@dataclass
class StagedStep:
    """A plan's inputs already on the device, waiting only for the previous step's sampled tokens."""

    plan: StepPlan
    host: HostBatch
    batch: ForwardBatch
    graph_rows: int | None  # the padded decode graph to replay; None: no decode graph
    piecewise_tokens: int | None = None  # the piecewise graphs' token bucket to replay; None: no piecewise graph

    @property
    def launch_kind(self) -> str:
        """How `launch` runs it (telemetry.step_timing.LAUNCHES)."""
        if self.graph_rows is not None:
            return "decode_graph"
        return "eager" if self.piecewise_tokens is None else "piecewise_graph"


class ModelRunner:
    def __init__(self, model: torch.nn.Module, shape: ModelShape, settings: RunnerSettings,
                 device: torch.device, dtype: torch.dtype, tp_size: int, replica: Replica | None = None) -> None:
        # PDL only inside the decode graphs of at most PDL_MAX_ROWS rows (DecodeGraphs.capture); every other
        # launch without it. CPU: nothing to set (no Triton launch but the interpreter's; Triton not imported)
        self.pdl = False  # whether this rank's small decode graphs launch their Triton kernels with PDL
        if device.type == "cuda":
            from spmd_engine.kernels.pdl import set_pdl

            set_pdl(False)  # whatever an earlier engine or caller in this process asked for
        self.model = model
        if device.type == "cuda":  # requests stay below max_model_len; warm-ups below the token and row budgets
            model.tabulate_rotary(max(settings.max_model_len, settings.max_num_batched_tokens,
                                      settings.max_num_seqs), dtype)
        self.replica = replica  # the sampled tokens go to this replica's ranks (None: every rank)
        self.shape = shape
        self.settings = settings
        self.device = device
        self.spec = KVCacheSpec.for_model(shape, tp_size, settings.block_size, dtype, settings.kv_cache_dtype)
        max_blocks = -(-settings.max_model_len // settings.block_size)
        self.use_graphs = (device.type == "cuda" and not settings.enforce_eager
                           and all(layer.backend == "triton" for layer in model.attention_layers()))
        self.memory_budget: CudaMemoryBudget | None = None
        self.num_blocks = all_reduce_min(self._fit_num_blocks())
        # [num_layers, 2 (K, V), num_kv_heads] float32 with an fp8 cache; every rank calibrates (TP collectives)
        self.kv_scales: torch.Tensor | None = None
        self.calibration_tokens = min(FP8_CALIBRATION_TOKENS, settings.max_model_len, settings.max_num_batched_tokens)
        if self.spec.is_fp8:
            self.kv_scales = calibrate_fp8_kv_scales(model, shape.vocab_size, self.calibration_tokens, device)
            if device.type == "cuda":  # hand the calibration's activations back before the pool is carved out
                torch.cuda.empty_cache()
        self.kv_caches = allocate_kv_cache(self.spec, self.num_blocks, device)
        model.bind_kv_cache(self.kv_caches)
        bind_kv_scales(model, self.kv_scales)
        self.mirror = BlockTableMirror(max_blocks, settings.block_size)
        self.inputs: InputBuffers | None = None
        if device.type == "cuda":
            self.inputs = InputBuffers(max(settings.max_num_batched_tokens, settings.max_num_seqs),
                                       settings.max_num_seqs, max_blocks, settings.block_size, device)
        # the token feed: where a decode graph takes its deferred inputs from (the previous step's sampled
        # tokens: drawn into it by the sampler graphs, broadcast into it under TP, copied into it otherwise)
        self.feed = torch.zeros(settings.max_num_seqs, dtype=torch.int64, device=device)
        # rank 0: float32 logits of the last launch's prompt-logprob rows (StepPlan.prompt_logits), or None
        self.last_prompt_logits: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None  # mixed and prefill steps
        self.sampler_graphs: SamplerGraphs | None = None  # the sampling rank's draws of decode steps
        # sleep(): the weights' host copies while they are off the device (None: on it); weights_changed()
        # while the cache is gone leaves the fp8 scales to recalibrate at wake_up
        self.host_weights: list[tuple[torch.nn.Parameter, torch.Tensor]] | None = None
        self.scales_stale = False
        self.graphs_stale = False  # the weights or the cache moved since the graphs were captured
        self._slept_kv_address: int | None = None
        # a pool smaller than one sequence is refused by the engine right after this; capture nothing
        if self.use_graphs and self.num_blocks * settings.block_size >= settings.max_model_len:
            self._capture_graphs()
        self._compile_step_kernels()

    def _capture_graphs(self) -> None:
        """The decode, sampler and piecewise CUDA graphs over the model's weights and KV cache as they are
        now (their addresses are baked in: see `reclaim_memory`)."""
        from spmd_engine.kernels.pdl import pdl_supported

        settings, model = self.settings, self.model
        pool = torch.cuda.graph_pool_handle()  # one pool: the decode graphs' logits first, then the pieces
        self.graphs = DecodeGraphs.capture(model, self.inputs, settings.max_num_seqs, self.feed, pool,
                                           PDL_MAX_ROWS if settings.cuda_pdl else 0)
        self.pdl = settings.cuda_pdl and pdl_supported(self.device)
        static_logits = self.graphs.static_logits()  # empty on the ranks that do not sample
        if settings.sampler_graphs and static_logits:  # their own pool: see SamplerGraphs.capture
            self.sampler_graphs = SamplerGraphs.capture(static_logits, out=self.feed)
        self.piecewise = PiecewiseGraphs.capture(model, self.inputs, settings.max_num_seqs,
                                                 piecewise_token_buckets(settings.max_num_batched_tokens),
                                                 CudaGraphCapture(pool))

    # --- sizing -------------------------------------------------------------------------
    def _fit_num_blocks(self) -> int:
        s = self.settings
        planned = planned_num_blocks(self.spec, s.num_kv_blocks, s.cpu_kv_cache_gib, self.device)
        if planned is not None:
            return planned
        self.memory_budget = self._measure_cuda_budget()
        return blocks_for_bytes(self.spec, self.memory_budget.kv_bytes)

    @torch.inference_mode()
    def _measure_cuda_budget(self) -> CudaMemoryBudget:
        """Warm-up forwards without a KV cache: the eager step at the token budget, the largest
        decode graph, and sampling max_num_seqs rows; each one's peak above what stays allocated."""
        s = self.settings
        num_tokens = min(s.max_num_batched_tokens, s.max_num_seqs * s.max_model_len)
        seq_len = min(num_tokens, s.max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        activation_peak = self._peak_of(lambda: self._warmup_forward(lens))
        graph_pool = 0
        if self.use_graphs:
            graph_tokens = min(s.max_num_seqs, max(s.max_num_batched_tokens, s.max_num_seqs))
            decode_pool = self._peak_of(lambda: self._warmup_forward([graph_tokens]))
            # the piecewise graphs' largest bucket is the token budget: its pieces' temporaries are those of
            # the eager step above (attention, outside the graphs, aside); they share the decode graphs' pool
            graph_pool = max(decode_pool, activation_peak) + self._piecewise_static_bytes(s.max_num_batched_tokens)
            # every decode graph keeps its own float32 logits output alive in the pool
            graph_pool += sum(graph_batch_sizes(s.max_num_seqs)) * self.shape.vocab_size * 4
            if s.sampler_graphs:  # their keys, tokens and race temporaries (counted on every rank: tiny)
                graph_pool += sampler_graph_bytes(graph_batch_sizes(s.max_num_seqs), self.shape.vocab_size)
        sampler_peak = self._peak_of(self._warmup_sampler)
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return CudaMemoryBudget(total, s.gpu_memory_utilization, total - free, activation_peak, sampler_peak,
                                graph_pool)

    def _piecewise_static_bytes(self, max_tokens: int) -> int:
        """The piecewise graphs' static buffers: q and attention output (this rank's heads), residual
        stream, rotary cos/sin (at most head_dim each) per token, float32 logits per sampled row."""
        attn = self.model.attention_layers()[0]
        item = next(self.model.parameters()).element_size()
        per_token = (2 * attn.num_heads * attn.head_dim + self.shape.hidden_size + 2 * self.shape.head_dim) * item
        return max_tokens * per_token + min(max_tokens, self.settings.max_num_seqs) * self.shape.vocab_size * 4

    def _peak_of(self, fn) -> int:
        gc.collect()  # an earlier job's model in this process (multirun) must not count as in use
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - baseline

    def _warmup_forward(self, seq_lens: list[int]) -> None:
        host = HostBatch.unstored_prefill(seq_lens)
        batch = to_device(host, self.settings.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn)
        # logits for max_num_seqs rows (the sampled rows of the largest step): the last tokens, repeated
        last = batch.logits_indices
        rows = last.repeat(-(-self.settings.max_num_seqs // len(seq_lens)))[: self.settings.max_num_seqs]
        self.model.compute_logits(hidden[rows])

    def _warmup_sampler(self) -> None:
        """Sample max_num_seqs rows of fake logits through every sampler path (the sort of a top-k past
        TOP_K_FAST_MAX is the costliest in memory; topk; top-p alone; the plain race), on rank 0's memory
        only during sampling."""
        from spmd_engine.executor.sampler import TOP_K_FAST_MAX, Sampler, SamplingRow
        n = self.settings.max_num_seqs
        logits = torch.randn(n, self.shape.vocab_size, device=self.device)
        for top_k, top_p in ((TOP_K_FAST_MAX + 1, 0.9), (50, 0.9), (-1, 0.9), (-1, 1.0)):
            Sampler(self.device).sample(logits, [SamplingRow(i, 1.0, top_p, top_k, i, 0) for i in range(n)])

    @torch.inference_mode()
    def _compile_step_kernels(self) -> None:
        """A prefill step and a mixed step (one decode row + one prompt chunk) through the engine's own
        path, once, at start-up. Why: Triton compiles a kernel at its first launch, and these two steps'
        attention kernels are met by no warm-up or capture before (the one-launch mixed kernel takes ~2 s
        to compile: it was inside the first mixed step of every job on a fresh machine). They write K/V
        into the first few blocks, which a sequence reads only after writing them itself (on CPU too, so
        the HF parity tests check that)."""
        s = self.settings
        if self.device.type == "cuda":  # kernels with per-size tile configurations (MoE experts) compile them all
            for module in self.model.modules():
                if hasattr(module, "warm_up_kernels"):
                    module.warm_up_kernels(s.max_num_batched_tokens)
        prompt_blocks = -(-3 // s.block_size)  # a 3-token prompt chunk; the decode row has block_size + 1 tokens
        if (self.num_blocks < 2 + prompt_blocks or s.max_num_seqs < 2 or s.max_num_batched_tokens < 4
                or s.max_model_len < max(3, s.block_size + 1)):
            return
        steps = (  # seq_ids, tokens already in KV, query lengths, new blocks
            ([-1], [0], [3], [prompt_blocks]),
            ([-2, -1], [s.block_size, 0], [1, 3], [2, prompt_blocks]),
        )
        for seq_ids, computed, query_lens, blocks in steps:
            n = len(seq_ids)
            ids = np.asarray(seq_ids, dtype=np.int64)
            plan = StepPlan(step=-1, seq_ids=ids, num_computed=np.asarray(computed, dtype=np.int32),
                            query_lens=np.asarray(query_lens, dtype=np.int32),
                            input_ids=np.zeros(sum(query_lens), dtype=np.int32), sample=np.ones(n, dtype=np.bool_),
                            reset_tables=np.ones(n, dtype=np.bool_),
                            new_block_counts=np.asarray(blocks, dtype=np.int32),
                            new_block_ids=np.arange(sum(blocks), dtype=np.int32))
            self.execute(plan)
            self.mirror.apply(StepPlan(step=-1, dropped_seq_ids=ids))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- the step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Stage and launch one planned step (see `launch`); the other ranks' path."""
        return self.launch(self.stage(plan))

    @torch.inference_mode()
    def stage(self, plan: StepPlan) -> StagedStep:
        """Turn the plan into device inputs; the copy is queued behind whatever the GPU is running."""
        tables = self.mirror.apply(plan)
        host = build_host_batch(plan, tables, self.settings.block_size)
        if self.graphs is not None and not plan.has_prompt_logits and self.graphs.can_run(host):
            rows, batch = self.graphs.stage(host)
            return StagedStep(plan, host, batch, rows)
        if self.piecewise is not None and not plan.has_prompt_logits and self.piecewise.can_run(host):
            tokens, batch = self.piecewise.stage(host)
            return StagedStep(plan, host, batch, None, tokens)
        if self.inputs is not None and self.inputs.fits(host):
            return StagedStep(plan, host, self.inputs.load(host, wait=False), None)
        return StagedStep(plan, host, to_device(host, self.settings.block_size, self.device), None)

    @torch.inference_mode()
    def launch(self, staged: StagedStep, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Fill the deferred inputs and launch the forward; logits [num_sampled, vocab] on rank 0,
        None elsewhere. `prev_tokens`: rank 0's tokens of the previous step (None on other ranks).

        Logits from a CUDA graph are a view of its static output: use them before the next step.
        """
        batch, plan = staged.batch, staged.plan
        if self.inputs is not None:  # the staged copy ran beside the step in flight's sampling
            self.inputs.wait_copied()
        if plan.block_copies.shape[0]:  # after every step queued before this one wrote its source blocks
            copy_kv_blocks(self.kv_caches, torch.from_numpy(plan.block_copies).to(self.device, torch.int64))
        if plan.num_prev_sampled:
            prev = self._share_tokens(prev_tokens, plan.num_prev_sampled)
            if staged.graph_rows is None:
                batch.fill_deferred(prev)
            else:  # the graph reads the feed
                self._to_feed(prev, prev.numel())
        self.last_prompt_logits = None
        if staged.graph_rows is not None:
            return self.graphs.replay(staged.graph_rows, staged.host)
        if staged.piecewise_tokens is not None:
            return self.piecewise.replay(staged.piecewise_tokens, staged.host, batch)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn)
        if plan.has_prompt_logits:  # one LM head call for the sampled rows and the prompt-logprob rows
            return self._logits_with_prompt_rows(hidden, batch.logits_indices, staged)
        if batch.logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

    def sampler_graph_rows(self, staged: StagedStep) -> int | None:
        """The decode graph size whose static logits hold a launched step's sampled rows (the first
        num_seqs rows: a pure decode step replayed from a graph) when the sampler graphs can draw it;
        None: the logits are no static output, or there are no sampler graphs (sample eagerly)."""
        if self.sampler_graphs is None or staged.graph_rows is None:
            return None
        return staged.graph_rows if DecodeGraphs.samples_every_row(staged.host) else None

    def _logits_with_prompt_rows(self, hidden: torch.Tensor, sample_rows: torch.Tensor, staged: StagedStep
                                 ) -> torch.Tensor | None:
        """Sampled rows' logits (returned) and the prompt rows' (kept in last_prompt_logits on rank 0);
        every rank runs the same LM head rows (a collective gather under tensor parallelism)."""
        plan, token_rows = staged.plan, staged.host.token_rows
        rows = prompt_logit_rows(plan.query_lens, plan.prompt_logits)  # plan token order
        prompt_rows = host_to_device(rows if token_rows is None else token_rows[rows], self.device)
        num_sampled = sample_rows.numel()
        logits = self.model.compute_logits(hidden.index_select(0, torch.cat([sample_rows, prompt_rows])))
        if logits is None:
            return None
        self.last_prompt_logits = logits[num_sampled:]
        return logits[:num_sampled] if num_sampled else None

    def _share_tokens(self, mine: torch.Tensor | None, count: int) -> torch.Tensor:
        """The previous step's sampled tokens on every rank: rank 0 broadcasts them as a device tensor
        (NCCL on GPU, queued like any kernel: the host never waits for them)."""
        if not is_distributed() or (self.replica is not None and self.replica.tp_size == 1):
            if mine is None:
                raise RuntimeError("a single rank must pass its own sampled tokens")
            return mine
        shared = self._to_feed(self.feed if mine is None else mine, count)  # ranks > 0: the broadcast fills it
        if self.replica is not None:
            self.replica.broadcast_tensor(shared)
        else:
            broadcast_tensor(shared)
        return shared

    def _to_feed(self, tokens: torch.Tensor, count: int) -> torch.Tensor:
        """The first `count` of `tokens` as the feed's first rows, copied unless a sampler graph drew them there."""
        if count > self.feed.numel():
            raise RuntimeError(f"{count} sampled tokens for a feed of {self.feed.numel()} (max_num_seqs)")
        if tokens.data_ptr() != self.feed.data_ptr():
            self.feed[:count].copy_(tokens[:count])
        return self.feed[:count]

    def apply_stop(self, plan: StepPlan) -> None:
        """The end of a generate call: forget the tables of the sequences it ran."""
        self.mirror.apply(plan)

    def _release_graphs(self) -> None:
        if self.sampler_graphs is not None:
            self.sampler_graphs.close()
            self.sampler_graphs = None
        if self.piecewise is not None:
            self.piecewise.close()
            self.piecewise = None
        if self.graphs is not None:
            self.graphs.close()
            self.graphs: DecodeGraphs | None = None

    # --- weights replaced in place, sleep and wake-up ---------------------------------------
    @property
    def is_asleep(self) -> bool:
        """The KV cache is freed (or the weights are on the host): no step can run."""
        return not self.kv_caches or self.host_weights is not None

    def weights_changed(self) -> None:
        """After the weights were copied in place: the fp8 KV scales depend on them, so they are calibrated
        again (collective under TP, like at start-up) and copied into the tensors the graphs read; while
        asleep, at wake_up."""
        if self.kv_scales is None:
            return
        if self.is_asleep:
            self.scales_stale = True
            return
        caches = self.kv_caches
        self.model.bind_kv_cache([(None, None)] * len(caches))  # the calibration forward stores nothing
        try:
            scales = calibrate_fp8_kv_scales(self.model, self.shape.vocab_size, self.calibration_tokens, self.device)
        finally:
            self.model.bind_kv_cache(caches)
        self.kv_scales.copy_(scales)
        self.scales_stale = False

    def sleep(self, offload_weights: bool) -> None:
        """Free the KV cache and, with `offload_weights`, move every parameter to host memory (pinned on
        CUDA), giving the device memory back to the process (the CUDA graphs are kept: `reclaim_memory`)."""
        self.model.bind_kv_cache([(None, None)] * len(self.model.attention_layers()))
        self._slept_kv_address = self.kv_caches[0][0].data_ptr() if self.kv_caches else None
        self.kv_caches = []
        if offload_weights and self.host_weights is None:
            self.host_weights = offload_parameters(self.model)
        self._give_back_memory()

    def reclaim_memory(self) -> None:
        """The first half of waking up: the weights back on the device and a new KV cache of the same shape
        (its contents are garbage: the prefix cache must be reset). ConfigError (one line) if the memory is
        not there. A CUDA graph replays the addresses it was captured with: `graphs_stale` says whether
        one moved (the cache rarely comes back at its old address)."""
        if self.host_weights is not None:
            restore_parameters(self.host_weights, self.device)
            self.host_weights, self.graphs_stale = None, True
        if not self.kv_caches:
            self.kv_caches = _allocated_or_config_error(self.spec, self.num_blocks, self.device)
            self.model.bind_kv_cache(self.kv_caches)
            self.graphs_stale |= self.kv_caches[0][0].data_ptr() != self._slept_kv_address

    def refresh_after_wake(self, recapture: bool) -> None:
        """The second half (collective under TP): the graphs captured again if `recapture` (some rank's
        `graphs_stale`), the fp8 scales calibrated if the weights changed while asleep."""
        if recapture and self.graphs is not None:
            self._release_graphs()
            self._capture_graphs()
        self.graphs_stale = False
        if self.scales_stale:
            self.weights_changed()

    def _give_back_memory(self) -> None:
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Free CUDA graphs before the process group goes (NCCL hangs on destroy otherwise)."""
        self._release_graphs()
        self.inputs = None
        self.model.bind_kv_cache([(None, None)] * len(self.model.attention_layers()))
        bind_kv_scales(self.model, None)
        self.kv_caches = []
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


def offload_parameters(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Every parameter's data moved to host memory (pinned on CUDA, for the copy back); a tied parameter
    once. The Parameter objects stay, so an in-place weight update while asleep lands in the host copy."""
    moved = []
    for param in model.parameters():  # deduplicated: the tied head is the embedding's parameter
        host = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=param.is_cuda)
        host.copy_(param.data)
        moved.append((param, host))
        param.data = host
    return moved


def restore_parameters(moved: list[tuple[torch.nn.Parameter, torch.Tensor]], device: torch.device) -> None:
    for param, host in moved:
        try:
            param.data = host.to(device, non_blocking=True)
        except torch.OutOfMemoryError:
            raise _wake_up_oom("the weights") from None
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated_or_config_error(spec: KVCacheSpec, num_blocks: int, device: torch.device
                               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    try:
        return allocate_kv_cache(spec, num_blocks, device)
    except torch.OutOfMemoryError:
        gib = num_blocks * spec.bytes_per_block / (1 << 30)
        raise _wake_up_oom(f"the KV cache ({num_blocks} blocks, {gib:.2f} GiB)") from None


def _wake_up_oom(what: str) -> ConfigError:
    return ConfigError(f"wake_up: {what} no longer fit in device memory; free memory and call wake_up() again")
