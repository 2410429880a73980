"""Engine: one rank's engine and the SPMD step loop (the public `spmd_engine.LLM` wraps it).

Every rank constructs an Engine and calls `generate` with the same arguments. Rank 0 schedules,
broadcasts one StepPlan per step, samples and post-processes; the other ranks follow the plans
until the stop plan. The data path of one step, in order:
scheduler.schedule -> PlanBuilder.build -> broadcast -> ModelRunner.stage/launch -> Sampler
-> Scheduler.postprocess.

With async_scheduling (the default) rank 0 runs that path one step ahead of the GPU: while step N
runs it post-processes step N-1's tokens and plans, sends and stages step N+1; step N+1 takes the
tokens step N samples straight from the device, so the GPU never waits for the host's planning.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from spmd_engine.models.model_config import ModelShape
from spmd_engine.config import ConfigError, EngineConfig
from spmd_engine.core.detokenizer import OutputText
from spmd_engine.core.plan import COMMAND_STOP, PlanBuilder, StepPlan
from spmd_engine.core.requests import (NOT_YET, PolledRequests, PromptRequest, RequestOutput, polled,
                                       validate_prompt)
from spmd_engine.core.scheduler import ScheduleOutput, Scheduler, SchedulerConfig
from spmd_engine.core.sequence import SamplingParams, Sequence, SequenceStatus
from spmd_engine.distributed import RankInfo, Replica, gather_errors, make_replica
from spmd_engine.executor.kv_cache import CudaMemoryBudget, KVCacheSpec, KVCapacity, planned_num_blocks
from spmd_engine.executor.logits_processors import apply_min_tokens, apply_penalties_and_min_p
from spmd_engine.executor.logprobs import (PendingLogprobs, SampledLogprobRows, compute_logprobs, entry,
                                           host_to_device, prompt_logit_count)
from spmd_engine.executor.model_runner import ModelRunner, RunnerSettings, StagedStep
from spmd_engine.executor.model_source import ModelSource, resolve_model_source
from spmd_engine.executor.sampler import Sampler, SamplingBatch, request_seed, seed_bits
from spmd_engine.executor.token_readback import ReadbackBuffers, TokenReadback
from spmd_engine.executor.tp_allreduce import (ProcessGroupAllReduce, SymmMemAllReduce, TpAllReduceUnavailable,
                                               TpGroup, make_tp_allreduce, symm_mem_buffer_bytes)
from spmd_engine.faults.injection import FaultInjector
from spmd_engine.faults.preflight import check_checkpoint_files
from spmd_engine.faults.progress import StepProgress
from spmd_engine.telemetry.gpu_timeline import GpuTimeline
from spmd_engine.telemetry.step_timing import PhaseClock, StepTimer

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN_CAP = 4096


def agreed(fn: Callable[[], Any]) -> Any:
    """Run a start-up check on every rank; if any rank fails, every rank raises the same error."""
    error, result = None, None
    try:
        result = fn()
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    failures = gather_errors(error)
    if failures:
        rank, message = failures[0]
        raise ConfigError(message if rank == 0 else f"[rank {rank}] {message}")
    return result


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available on this machine; use device=cpu or auto")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


def resolve_max_model_len(requested: int | None, shape: ModelShape) -> int:
    """`requested` if the positions fit: max_position_embeddings, or with rope scaling up to
    original_max_position_embeddings x factor; null: min(max_position_embeddings, the cap)."""
    limit, rope = shape.max_position_embeddings, shape.rope
    if requested is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
    if requested <= limit:
        return requested
    if rope.rope_type == "default":
        raise ConfigError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit} "
                          f"and the model has no rope scaling to extend it")
    scaled = int((rope.original_max_position_embeddings or limit) * rope.factor)
    if requested > scaled:
        raise ConfigError(f"max_model_len={requested} exceeds {scaled} positions, the most the model's "
                          f"{rope.rope_type} rope scaling (factor {rope.factor:g}) extends "
                          f"max_position_embeddings={limit} to")
    return requested


def resolve_backend(name: str, device: torch.device, block_size: int, head_dim: int) -> str:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        if device.type != "cuda":
            raise ConfigError("attention_backend=triton needs device=cuda; use torch on CPU")
        from spmd_engine.kernels.attention_support import supports_shape
        if not supports_shape(block_size, head_dim):
            log.warning("triton kernels do not support block_size=%d head_dim=%d; using torch attention",
                        block_size, head_dim)
            return "torch"
    return name


class Engine:
    """One engine instance per rank; `generate` is collective (every rank calls it)."""

    def __init__(self, cfg: EngineConfig, ranks: RankInfo, step_progress: StepProgress | None = None) -> None:
        self.cfg, self.ranks = cfg, ranks
        self.step_progress = step_progress or StepProgress()  # stamped per step; the watchdog reads it
        backend = self._agree_on_setup()
        self.model = self._load_model(backend)
        self.runner = self._start_runner()
        self.step = 0
        self.last_run: dict[str, Any] = {}  # step counts and step timing of the last generate call (rank 0)
        # rank 0: the scheduler and its block manager live as long as the engine, so the prefix cache
        # still hits in the next generate call (the KV tensors it indexes live as long as the runner)
        self.scheduler: Scheduler | None = None
        if self.replica.is_leader:
            self.scheduler = new_scheduler(cfg, self.max_model_len, self.runner.num_blocks, self.shape.eos_token_ids)
        # Everything built so far lives as long as the engine: keep it out of the cyclic garbage
        # collector's full passes, which otherwise walk every KV block's bookkeeping object (tens of
        # ms at 100k+ blocks) in the middle of steps. `close` hands it back to the collector.
        gc.freeze()

    def _agree_on_setup(self) -> str:
        """The start-up checks that need no weights, agreed across ranks; returns the attention backend."""
        cfg, ranks = self.cfg, self.ranks
        agreed(lambda: cfg.validate(ranks.world_size))
        # replicas of tp consecutive ranks; each has its own group for the plans, tokens and TP sums
        self.replica: Replica = make_replica(ranks.rank, ranks.world_size, *cfg.parallel_sizes(ranks.world_size),
                                             max(cfg.dist_timeout_s, cfg.startup_timeout_s))
        self.device = agreed(lambda: resolve_device(cfg.device, ranks.local_rank))
        self.source: ModelSource = agreed(lambda: resolve_model_source(cfg.model))
        agreed(lambda: check_checkpoint_files(self.source.checkpoint_dir))  # weights missing on one node
        self.shape: ModelShape = agreed(lambda: self._checked_shape())
        self.max_model_len: int = agreed(lambda: resolve_max_model_len(cfg.max_model_len, self.shape))
        self.dtype = resolve_dtype(cfg.dtype, self.device, self.shape.torch_dtype)
        backend = agreed(lambda: resolve_backend(cfg.attention_backend, self.device, cfg.block_size,
                                                 self.shape.head_dim))
        agreed(self._check_planned_kv_capacity)  # before the weights load: a too-small pool fails fast
        # collective over the replica's group; tp_allreduce=symm_mem that cannot run fails every rank alike
        self.tp_allreduce = agreed(self._make_tp_allreduce)
        return backend

    def _make_tp_allreduce(self) -> ProcessGroupAllReduce | SymmMemAllReduce | None:
        """The replica's all-reduce (None with one rank per replica), sized for a step's largest message."""
        cfg, replica, shape = self.cfg, self.replica, self.shape
        reduce_itemsize = max(4 if cfg.tp_reduce_dtype == "float32" else 0, self.dtype.itemsize)
        nbytes = symm_mem_buffer_bytes(cfg.max_num_batched_tokens, shape.hidden_size, reduce_itemsize)
        try:
            reducer = make_tp_allreduce(cfg.tp_allreduce, self.device,
                                        TpGroup(replica.group, replica.tp_rank, replica.tp_size), nbytes)
        except TpAllReduceUnavailable as exc:
            raise ConfigError(str(exc)) from None
        if reducer is not None:
            info = reducer.describe()
            log.info("tensor-parallel all-reduce: %s (%s)%s", info["path"], reducer.reason,
                     f", symmetric buffer {info['buffer_bytes']} bytes (larger messages over NCCL)"
                     if info["path"] == "symm_mem" else "")
        return reducer

    @property
    def tp_allreduce_info(self) -> dict[str, Any]:
        """metrics.json's `tp_allreduce`: the path this replica's all-reduces take, and why."""
        info = {"requested": self.cfg.tp_allreduce}
        if self.tp_allreduce is None:
            return {**info, "path": "none", "reason": "one rank per replica: no all-reduce"}
        return {**info, **self.tp_allreduce.describe(), "reason": self.tp_allreduce.reason}

    def _load_model(self, backend: str) -> torch.nn.Module:
        """Build this rank's shard of the model in the engine's dtype and device, then load its weights."""
        from spmd_engine.models.layers.attention import use_attention_backend
        from spmd_engine.models.layers.attention_backends import select_attention_backend
        from spmd_engine.models.layers.linear import set_small_batch_gemv
        from spmd_engine.models.loader import load_dummy_weights, load_safetensors_weights
        from spmd_engine.models.parallel import TensorParallel
        from spmd_engine.models.registry import build_model

        cfg = self.cfg
        replica = self.replica
        tp = (TensorParallel(replica.tp_rank, replica.tp_size, replica.group,
                             torch.float32 if cfg.tp_reduce_dtype == "float32" else None, reduce=self.tp_allreduce)
              if replica.tp_size > 1 else TensorParallel.single())
        started = time.perf_counter()
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                # agreed: an unsupported architecture / activation / sliding window fails every rank alike
                model = agreed(lambda: build_model(self.source.hf_config, tp, backend))
        finally:
            torch.set_default_dtype(previous_dtype)
        if self.source.checkpoint_dir is None:
            load_dummy_weights(model, cfg.seed)
        else:
            load_safetensors_weights(model, self.source.checkpoint_dir)
        model.eval()
        set_small_batch_gemv(model, cfg.small_batch_gemv)
        use_attention_backend(model, select_attention_backend(backend, self.device, cfg.kv_cache_dtype, cfg.cuda_decode,
                                                              cfg.cuda_fp8_decode))
        log.info("model %s loaded (%s, %s, attention=%s, tp=%d) in %.1f s", cfg.model.name,
                 self.source.checkpoint_dir or "dummy weights", str(self.dtype).replace("torch.", ""),
                 backend, replica.tp_size, time.perf_counter() - started)
        return model

    def _start_runner(self) -> ModelRunner:
        """The runner over the loaded model: KV pool sized (and agreed to hold one sequence), graphs captured."""
        cfg = self.cfg
        settings = RunnerSettings(cfg.block_size, self.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                  cfg.enforce_eager, cfg.gpu_memory_utilization, cfg.cpu_kv_cache_gib,
                                  cfg.num_kv_blocks, cfg.kv_cache_dtype, cfg.cuda_pdl, cfg.sampler_graphs)
        runner = ModelRunner(self.model, self.shape, settings, self.device, self.dtype, self.replica.tp_size,
                             self.replica)
        self.kv_capacity = KVCapacity(runner.num_blocks, cfg.block_size, runner.spec.bytes_per_block)
        agreed(lambda: self._check_kv_capacity(self.kv_capacity.num_blocks, runner.memory_budget))
        self.faults = FaultInjector.from_config(cfg.fault, self.ranks.rank)
        self.faults.install(runner)  # test-only: a configured step fault wraps the runner's launch
        log.info("engine: block_size=%d max_model_len=%d max_num_seqs=%d max_num_batched_tokens=%d "
                 "prefix_caching=%s cuda_graphs=%s cuda_pdl=%s sampler_graphs=%s cuda_fp8_decode=%s cuda_decode=%s "
                 "device=%s",
                 cfg.block_size, self.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                 cfg.enable_prefix_caching, runner.graphs is not None, runner.pdl, runner.sampler_graphs is not None,
                 self._decode_cuda_usable(runner, fp8=True), self._decode_cuda_usable(runner, fp8=False), self.device)
        cap = self.kv_capacity.as_dict()
        log.info("KV cache: %d blocks, %d tokens, %.3f GiB per rank%s", cap["blocks"], cap["tokens"], cap["gib"],
                 f" ({runner.memory_budget.describe()})" if runner.memory_budget else "")
        return runner

    def _decode_cuda_usable(self, runner, fp8: bool) -> bool:
        """Whether `cuda_fp8_decode` (fp8: an fp8 cache) or `cuda_decode` (a bf16/fp16 cache) can act here, for
        the start-up log; each layer still checks its shapes."""
        fp8_cache = runner.spec.dtype == torch.float8_e4m3fn
        enabled = self.cfg.cuda_fp8_decode if fp8 else self.cfg.cuda_decode
        if not (enabled and self.device.type == "cuda" and fp8_cache == fp8):
            return False
        if fp8:
            from spmd_engine.kernels.decode_attention_fp8_cuda import usable
        else:
            from spmd_engine.kernels.decode_attention_cuda import usable
        return usable(self.device)

    def _checked_shape(self) -> ModelShape:
        shape = ModelShape.from_hf_config(self.source.hf_config)
        shape.validate_tensor_parallel(self.replica.tp_size)
        return shape

    def _check_planned_kv_capacity(self) -> None:
        """A fixed num_kv_blocks or a CPU GiB budget sizes the pool without the model; CUDA measures later."""
        cfg = self.cfg
        spec = KVCacheSpec.for_model(self.shape, self.replica.tp_size, cfg.block_size, self.dtype,
                                     cfg.kv_cache_dtype)
        planned = planned_num_blocks(spec, cfg.num_kv_blocks, cfg.cpu_kv_cache_gib, self.device)
        if planned is not None:
            self._check_kv_capacity(planned)

    def _check_kv_capacity(self, num_blocks: int, budget: CudaMemoryBudget | None = None) -> None:
        """`budget`: the measured CUDA budget that sized the pool, named in the error (None: planned)."""
        tokens = num_blocks * self.cfg.block_size
        if tokens < self.max_model_len:
            raise ConfigError(
                f"the KV pool holds {num_blocks} blocks x block_size {self.cfg.block_size} = "
                f"{tokens} tokens, less than one max_model_len={self.max_model_len} sequence; raise "
                f"gpu_memory_utilization / cpu_kv_cache_gib / num_kv_blocks or lower max_model_len"
                + (f" ({budget.describe()})" if budget is not None else ""))

    # --- generation -----------------------------------------------------------------------
    def generate(self, requests: Iterable[PromptRequest] | PolledRequests,
                 on_finish: Callable[[RequestOutput], None] | None = None,
                 decode: Callable[[list[int]], str] | None = None, progress: bool = False,
                 token_text: Callable[[int], str] | None = None, keep_outputs: bool = True) -> list[RequestOutput]:
        """Collective over the replica: its leader returns one RequestOutput per request (submission
        order); the other ranks [].

        `requests` is pulled lazily, as the batch has room (a generator may read and tokenize on demand;
        a `PolledRequests` may answer "not yet" while the batch runs, e.g. work not yet handed out to
        this replica). `keep_outputs=False` returns [] on the leader too:
        the outputs go to `on_finish` only, so a job of any size holds only the requests in flight.
        `token_text(id)`: one token's text, for the alternatives of logprobs (None: decode([id]))."""
        if not self.replica.is_leader:
            self._follow_plans()
            return []
        if self.scheduler.has_unfinished() or self.scheduler.block_manager.num_used_blocks:
            # an earlier call ended half-way (an exception): start from a clean pool
            self.scheduler = new_scheduler(self.cfg, self.max_model_len, self.runner.num_blocks,
                                           self.shape.eos_token_ids)
        generation = _Generation(self, requests, on_finish, decode, progress, keep_outputs)
        generation.token_text = token_text or ((lambda t: decode([t])) if decode else None)
        try:
            outputs = generation.run()
        finally:
            self.step = generation.step  # a failed call's steps count too: step numbers never repeat
        self.last_run = generation.summary
        return outputs

    def _follow_plans(self) -> None:
        first = True
        while True:
            self.step_progress.wait_plan(first)
            first = False
            plan = self.replica.broadcast_object(None)
            if plan.command == COMMAND_STOP:
                self.runner.apply_stop(plan)
                self.step_progress.idle()
                return
            self.step_progress.step(plan.step)
            self.runner.execute(plan)

    def close(self) -> None:
        gc.unfreeze()  # the model holds reference cycles (parameters' weight loaders): let them go
        self.runner.close()  # the graphs that replay the symmetric-memory kernels go first
        if self.tp_allreduce is not None:
            self.tp_allreduce.close()
        del self.model


def new_scheduler(cfg: EngineConfig, max_model_len: int, num_blocks: int, eos_token_ids) -> Scheduler:
    """Rank 0's scheduler over a fresh pool of `num_blocks` KV blocks."""
    return Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, max_model_len, cfg.block_size,
                                     num_blocks, cfg.enable_prefix_caching, cfg.max_prompt_tokens_per_mixed_step),
                     set(eos_token_ids))


class _Generation:
    """Rank 0's state for one generate call: scheduler, plans, sampler and the outputs."""

    def __init__(self, llm: Engine, requests: Iterable[PromptRequest] | PolledRequests, on_finish, decode,
                 progress: bool, keep_outputs: bool = True) -> None:
        cfg = llm.cfg
        self.llm = llm
        self.on_finish = on_finish or (lambda out: None)
        self.decode = decode
        self.progress = progress
        self.scheduler = llm.scheduler  # the engine's, for its life
        self.preemptions_before = self.scheduler.num_preemptions
        self.texts: dict[int, OutputText] = {}  # seq_id -> its followed text (requests with stop strings)
        self.token_text: Callable[[int], str] | None = None
        # seq_id -> entries of requests with logprobs / prompt_logprobs (spmd_engine/logprobs.py)
        self.logprobs: dict[int, list[dict]] = {}
        self.prompt_logprobs: dict[int, list[dict | None]] = {}
        self.builder = PlanBuilder()
        self.sampler = Sampler(llm.device)
        self.readback_buffers = ReadbackBuffers()  # the sampled tokens' pinned host buffers, reused (CUDA)
        self.generation = llm.step  # tells this generate call's unseeded request seeds from another's
        self.step = llm.step  # the engine's step counter, handed back at the end with `summary`
        self.summary: dict[str, Any] = {}
        self.defaults = cfg.sampling
        self.outputs: list[RequestOutput] = []
        self.live: dict[int, tuple[Sequence, RequestOutput]] = {}
        self.row_consts: dict[int, _RowConsts] = {}  # seq_id -> what its sampling rows need, fixed per request
        # finished since the last postprocess: the step in flight may still sample them once (and drop the token)
        self.consts_done: list[int] = []
        self.keep_outputs = keep_outputs
        self.total = len(requests) if hasattr(requests, "__len__") else None
        self.requests = polled(requests)  # pulled by `_refill` as the batch has room
        self.fed = 0  # requests pulled so far: the next one's seq_id
        self.fed_all = False
        self.cached_tokens = 0
        self.sampler_graph_steps = 0  # steps sampled by replaying a sampler graph (runner.sampler_graphs)

    def _admit(self, seq_id: int, req: PromptRequest) -> int:
        """Queue `req` as sequence `seq_id` (or finish it as an error row) -> the tokens it queued."""
        out = RequestOutput(req.index, req.prompt, req.prompt_token_ids, None, [], "error", req.error,
                            custom_id=getattr(req, "custom_id", None))
        if self.keep_outputs:
            self.outputs.append(out)
        if out.error is None:
            try:
                params = SamplingParams.from_dict(req.overrides, self.defaults)
                out.error = validate_prompt(req.prompt_token_ids, self.llm.shape.vocab_size, self.llm.max_model_len)
                if out.error is None and params.stop and self.decode is None:
                    out.error = "sampling.stop needs the checkpoint's tokenizer (stop strings are matched on the " \
                                "text); use stop_token_ids"
            except ValueError as exc:
                out.error = str(exc)
        if out.error is not None:
            out.text = None
            self.on_finish(out)
            self.bar.update(1)
            return 0
        seed = params.seed if params.seed is not None else request_seed(self.llm.cfg.seed, self.generation, req.index)
        seq = Sequence(seq_id, req.prompt_token_ids, params, sampling_seed=seed)
        if params.logprobs is not None:
            self.logprobs[seq_id] = []
        if params.prompt_logprobs is not None:
            self.prompt_logprobs[seq_id] = [None] * len(req.prompt_token_ids)
        if params.stop:
            self.texts[seq_id] = OutputText(self.decode, seq.prompt_token_ids, params.stop,
                                            params.include_stop_str_in_output)
        self.scheduler.add(seq)
        self.live[seq_id] = (seq, out)
        self.row_consts[seq_id] = _RowConsts(
            seed_bits(seed), params.temperature, params.top_p, params.top_k, seq.num_prompt_tokens,
            bool(params.logprobs is not None or params.min_tokens or params.has_penalties or params.min_p > 0))
        return self.scheduler.tokens_to_compute(seq)

    def run(self) -> list[RequestOutput]:
        self.start = time.perf_counter()
        self.bar = _progress_bar(self.total, self.progress)
        loop = _InFlight(StepTimer(), GpuTimeline(self.llm.device.type == "cuda"))
        while self._step(loop):
            pass
        self._stop(loop)
        self.outputs.sort(key=lambda o: o.index)
        return self.outputs

    def _step(self, loop: _InFlight) -> bool:
        """One turn of the loop: collect the step sampled last, plan the next one and send it, stage its
        inputs, sample the step in flight (its tokens are the new plan's deferred inputs), launch.
        False once nothing is left to run."""
        clock = loop.clock
        clock.lap("postprocess")  # the previous turn's bookkeeping (counting it, the loop) since its last lap
        self.llm.step_progress.step(self.step)
        tokens = loop.sampled.host_tokens() if loop.sampled is not None else None  # waits for the GPU
        clock.lap("wait")
        if loop.sampled is not None:
            self._postprocess(loop.sampled, tokens)
            loop.sampled = None
        self._refill()
        clock.lap("postprocess")
        if loop.launched is None and not self.scheduler.has_unfinished():
            return False
        schedule = self.scheduler.schedule()
        # every schedule goes through the builder, even one that runs nothing: it may still have
        # preempted or finished sequences, whose drops the builder sends with the next plan
        plan = self.builder.build(schedule, self.step)
        if plan is None:  # every running sequence waits for the step in flight
            if loop.launched is None:
                raise RuntimeError("scheduler made no progress (no sequence fits the KV pool)")
            self._sample_in_flight(loop)
            return True
        clock.lap("schedule")
        self.llm.replica.broadcast_object(plan)
        clock.lap("broadcast")
        staged = self.llm.runner.stage(plan)
        clock.lap("inputs")
        self._sample_in_flight(loop)
        clock.lap("sample")
        self._launch(loop, schedule, staged)
        clock.lap("forward")
        if not self.llm.cfg.async_scheduling:
            self._sample_in_flight(loop)
        clock.lap("sample")
        loop.count(plan, staged.launch_kind)
        self.step += 1
        return True

    def _launch(self, loop: _InFlight, schedule: ScheduleOutput, staged: StagedStep) -> None:
        """Launch a staged step's forward; its inputs deferred to the step in flight take that step's tokens."""
        loop.timeline.mark(loop.steps, "forward_start")
        logits = self.llm.runner.launch(staged, loop.sampled.tokens if loop.sampled is not None else None)
        loop.timeline.mark(loop.steps, "forward_end")
        self.llm.step_progress.forward_issued()
        loop.launched = _Launched(schedule, logits, loop.steps, self._queue_prompt_logprobs(schedule),
                                  self.llm.runner.sampler_graph_rows(staged))

    def _sample_in_flight(self, loop: _InFlight) -> None:
        """Queue sampling of the launched step, if any: it becomes the sampled step."""
        if loop.launched is not None:
            loop.sampled, loop.launched = self._sample(loop.launched, loop.timeline), None

    def _stop(self, loop: _InFlight) -> None:
        """Send every rank the stop plan, then summarise the call's steps into `summary`."""
        llm = self.llm
        stop = self.builder.stop_plan(self.step)
        llm.replica.broadcast_object(stop)
        llm.runner.apply_stop(stop)
        llm.step_progress.idle()
        self.bar.close()
        loop.timer.set_gpu_idle(loop.timeline.idle_ms(), loop.timeline.busy_ms())
        cached = self.cached_tokens
        preemptions = self.scheduler.num_preemptions - self.preemptions_before
        self.summary = {"steps": loop.steps, "decode_steps": loop.decode_steps,
                        "async_scheduling": llm.cfg.async_scheduling, "preemptions": preemptions,
                        "cached_prompt_tokens": cached, "sampler_graph_steps": self.sampler_graph_steps,
                        "step_timing": loop.timer.summary()}
        log.info("generate: %d steps (%d decode), %d preemptions, %d prompt tokens from the prefix cache",
                 loop.steps, loop.decode_steps, preemptions, cached)

    def _refill(self) -> None:
        """Pull requests until the batch could be full (waiting + running reach max_num_seqs) or the
        source ends: a lazy source is read, tokenized or handed out only as this replica has room.
        A polled source waits only while nothing runs; with sequences running, "not yet" ends the
        refill and the loop keeps stepping them (it asks again next step)."""
        scheduler, room = self.scheduler, self.llm.cfg.max_num_seqs
        # A step takes at most max_num_batched_tokens from the waiting queue, FCFS: admitting beyond that
        # changes no schedule and only puts host work before the first launch (256 bench requests: ~40 ms
        # of admission before step 0); later steps admit the rest while the GPU runs the one in flight.
        step_tokens, queued = self.llm.cfg.max_num_batched_tokens, None
        while not self.fed_all and scheduler.num_waiting + scheduler.num_running < room:
            queued = scheduler.num_waiting_tokens if queued is None else queued
            if queued >= step_tokens:
                return
            request = self.requests.poll(wait=not scheduler.has_unfinished())
            if request is NOT_YET:
                return
            if request is None:
                self.fed_all = True
                return
            queued += self._admit(self.fed, request)
            self.fed += 1

    def _sample(self, launched: _Launched, timeline: GpuTimeline) -> _Sampled:
        """Queue sampling of a launched step's logits and the copy of its tokens to the host."""
        schedule = launched.schedule
        flags = schedule.sample
        seqs = [s for s, flag in zip(schedule.seqs, flags) if flag]
        if not seqs:
            return _Sampled(schedule, [], None, None, prompt_logprobs=launched.prompt_logprobs)
        # the counter is the index of the drawn token within the output (its position minus the
        # prompt), fixed at scheduling: planning ahead, chunking or preemption cannot shift a draw
        positions = [before + num_new for before, num_new, flag in
                     zip(schedule.num_computed_before, schedule.num_new_tokens, flags) if flag]
        consts = self.row_consts
        seeds, temperatures, top_ps, top_ks, prompt_lens, transformed = zip(*[consts[s.seq_id] for s in seqs])
        rows = SamplingBatch(np.array(seeds, dtype=np.int64),
                             np.array(positions, dtype=np.int64) - np.array(prompt_lens, dtype=np.int64),
                             np.array(temperatures, dtype=np.float64), np.array(top_ps, dtype=np.float64),
                             np.array(top_ks, dtype=np.int64))
        wanted = None
        if any(transformed):  # some row asks for logprobs, min_tokens, penalties or min_p
            picked = list(zip(seqs, positions))
            # logprobs of the raw logits, before any transform (None and no work when no row asks)
            wanted = SampledLogprobRows.take(launched.logits, [s.params.logprobs for s in seqs])
            apply_min_tokens(launched.logits, picked, self.scheduler.eos_token_ids)
            apply_penalties_and_min_p(launched.logits, picked)
        timeline.mark(launched.index, "sample_start")
        tokens = None
        if launched.graph_rows is not None and not any(transformed):  # all greedy / all plain: one replay
            self.readback_buffers.fence()  # the replay overwrites the tokens an unread copy may still take
            tokens = self.llm.runner.sampler_graphs.sample(launched.graph_rows, rows)
            self.sampler_graph_steps += tokens is not None
        if tokens is None:
            tokens = self.sampler.sample_on_device(launched.logits, rows)
        timeline.mark(launched.index, "sample_end")
        pending = (wanted.rows, wanted.finish(tokens)) if wanted is not None else None
        return _Sampled(schedule, seqs, tokens, TokenReadback(tokens, self.readback_buffers), pending,
                        launched.prompt_logprobs)

    def _queue_prompt_logprobs(self, schedule: ScheduleOutput) -> "_PromptLogprobs | None":
        """Prompt logprobs of a launched step's prompt rows (rank 0; None when no request asked)."""
        logits = self.llm.runner.last_prompt_logits
        if logits is None:
            return None
        spans: list[tuple[Sequence, int, int]] = []
        targets: list[int] = []
        for seq, start, num_new in zip(schedule.seqs, schedule.num_computed_before, schedule.num_new_tokens):
            count = prompt_logit_count(seq, start, num_new)
            if count:
                spans.append((seq, start, count))
                targets.extend(seq.token_ids[start + 1:start + 1 + count])  # position p predicts token p + 1
        k = max(seq.params.prompt_logprobs for seq, _, _ in spans)
        tokens = host_to_device(targets, logits.device)
        return _PromptLogprobs(spans, compute_logprobs(logits, tokens, k))

    def _record_logprobs(self, sampled: "_Sampled", tokens: np.ndarray) -> None:
        """Read back a step's logprobs (only when some request asked: this waits for them); a token a
        finished sequence drops (a speculative step's) gets none."""
        if sampled.logprobs is not None:
            rows, pending = sampled.logprobs
            chosen, top_ids, top_lps = pending.host()
            for i, row in enumerate(rows):
                seq = sampled.seqs[row]
                entries = self.logprobs.get(seq.seq_id)
                if entries is not None and not seq.is_finished:
                    entries.append(entry(int(tokens[row]), chosen[i], top_ids[i], top_lps[i], seq.params.logprobs,
                                         self.token_text))
        if sampled.prompt_logprobs is not None:
            chosen, top_ids, top_lps = sampled.prompt_logprobs.pending.host()
            i = 0
            for seq, start, count in sampled.prompt_logprobs.spans:
                entries = self.prompt_logprobs.get(seq.seq_id)
                for p in range(start, start + count):
                    if entries is not None:
                        entries[p + 1] = entry(seq.token_ids[p + 1], chosen[i], top_ids[i], top_lps[i],
                                               seq.params.prompt_logprobs, self.token_text)
                    i += 1

    def _postprocess(self, sampled: _Sampled, tokens: np.ndarray) -> None:
        if sampled.logprobs is not None or sampled.prompt_logprobs is not None:
            self._record_logprobs(sampled, tokens)
        for seq_id in self.consts_done:  # sampled for the last time: the step in flight came after their finish
            del self.row_consts[seq_id]
        self.consts_done.clear()
        now = time.perf_counter() - self.start
        by_seq: dict[int, int] = {}
        live, finished = self.live, SequenceStatus.FINISHED
        for seq, token in zip(sampled.seqs, tokens.tolist()):  # Python ints at once, not one int() per row
            if seq.status is finished:
                continue
            out = live[seq.seq_id][1]
            if out.first_token_time is None:
                out.first_token_time = now
            out.token_times.append(now)
            by_seq[seq.seq_id] = token
        for seq in self.scheduler.postprocess(sampled.schedule, by_seq, self._stop_string):
            self._finish(seq)
            self.bar.update(1)

    def _stop_string(self, seq: Sequence, token: int) -> str | None:
        """The scheduler's stop-string hook: feed the token to the request's text, say what it matched."""
        text = self.texts.get(seq.seq_id)
        if text is None:
            return None
        match = text.add(token, seq.num_output_tokens >= seq.params.min_tokens)
        return match.stop if match is not None else None

    def _finish(self, seq: Sequence) -> None:
        _, out = self.live.pop(seq.seq_id)
        self.consts_done.append(seq.seq_id)
        out.token_ids = list(seq.output_token_ids)
        out.finish_reason = seq.finish_reason
        out.stop_reason = seq.stop_reason
        out.logprobs = self.logprobs.pop(seq.seq_id, None)
        out.prompt_logprobs = self.prompt_logprobs.pop(seq.seq_id, None)
        out.num_cached_tokens = seq.num_cached_tokens
        self.cached_tokens += seq.num_cached_tokens
        followed = self.texts.pop(seq.seq_id, None)
        if followed is not None and followed.match is not None:
            out.text = followed.match.text  # cut at the stop string (or just after it)
        else:
            out.text = self.decode(out.token_ids) if self.decode else None
        self.on_finish(out)


class _RowConsts(NamedTuple):
    """A request's sampling constants, gathered once at admission (a step reads them for every row)."""

    seed: int  # seed_bits of its noise seed
    temperature: float
    top_p: float
    top_k: int
    num_prompt_tokens: int
    transformed: bool  # logprobs, min_tokens, penalties or min_p: the logits processors look at it


@dataclass
class _InFlight:
    """The loop's steps between launch and collection, and its step counts (one generate call)."""

    timer: StepTimer
    timeline: GpuTimeline
    launched: _Launched | None = None  # forward queued, logits not sampled yet
    sampled: _Sampled | None = None  # tokens sampled on the device, not yet on the host
    steps: int = 0
    decode_steps: int = 0
    clock: PhaseClock = field(default_factory=PhaseClock)  # runs for the whole loop (PhaseClock.take)

    def count(self, plan: StepPlan, launch_kind: str) -> None:
        """Count a launched step and record its host phases and how it ran (decode graph, piecewise, eager)."""
        self.timer.add(plan.num_seqs, plan.num_tokens, plan.is_decode, num_decode_seqs=int((plan.query_lens == 1).sum()),
                       launch=launch_kind, **self.clock.take())
        self.steps += 1
        self.decode_steps += int(plan.is_decode)


@dataclass
class _Launched:
    """A step whose forward is queued; its logits are valid until the next launch."""

    schedule: ScheduleOutput
    logits: torch.Tensor | None
    index: int  # step number within this generate call
    prompt_logprobs: "_PromptLogprobs | None" = None  # queued on the device (requests with prompt_logprobs)
    # the decode graph whose static logits these are, for the sampler graphs (runner.sampler_graph_rows)
    graph_rows: int | None = None


@dataclass
class _PromptLogprobs:
    """A step's prompt logprobs: per sequence (seq, first position, count), rows in that order."""

    spans: list[tuple[Sequence, int, int]]
    pending: PendingLogprobs


@dataclass
class _Sampled:
    """A step whose tokens are sampled on the device and on their way to the host."""

    schedule: ScheduleOutput
    seqs: list[Sequence]  # the sampled rows, in order
    tokens: torch.Tensor | None  # [len(seqs)] on the device; None when the step sampled nothing
    readback: TokenReadback | None
    logprobs: tuple[list[int], PendingLogprobs] | None = None  # (rows of seqs, their logprobs) if any asked
    prompt_logprobs: _PromptLogprobs | None = None

    def host_tokens(self) -> np.ndarray:
        """Waits for the GPU up to this step's sampling."""
        return self.readback.numpy() if self.readback is not None else np.zeros(0, dtype=np.int64)


def _progress_bar(total: int | None, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", unit="req", disable=not enabled or (total or 0) < 2,
                dynamic_ncols=True)
