"""Engine: one rank's engine: start-up agreed across ranks, the model and its runner, and `generate`
(the public `spmd_engine.LLM` wraps it).

Every rank constructs an Engine and calls `generate` with the same arguments. The replica's leader
runs the step loop (step_loop.py: schedule -> plan -> broadcast -> stage -> launch -> sample ->
postprocess); the other ranks follow its plans (`_follow_plans`) until the stop plan.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from spmd_engine.models.model_config import ModelShape
from spmd_engine.models.moe_shape import MOE_TP_SPLIT_KEY
from spmd_engine.config import ConfigError, EngineConfig
from spmd_engine.core.plan import COMMAND_STOP
from spmd_engine.core.requests import PolledRequests, PromptRequest, RequestOutput
from spmd_engine.core.scheduler import Scheduler, SchedulerConfig
from spmd_engine.distributed import RankInfo, Replica, all_reduce_min, gather_errors, make_replica
from spmd_engine.executor.kv_cache import CudaMemoryBudget, KVCacheSpec, KVCapacity, planned_num_blocks
from spmd_engine.executor.model_runner import ModelRunner, RunnerSettings
from spmd_engine.executor.model_source import ModelSource, resolve_model_source
from spmd_engine.executor.tp_allreduce import (ProcessGroupAllReduce, SymmMemAllReduce, TpAllReduceUnavailable,
                                               TpGroup, make_tp_allreduce, symm_mem_buffer_bytes)
from spmd_engine.faults.preflight import check_checkpoint_files
from spmd_engine.faults.progress import StepProgress
from spmd_engine.step_loop import GenerateCall, LoopParts, StepLoop

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


def _power_of_two_head_dim(head_dim: int) -> None:
    if head_dim & (head_dim - 1):
        raise ConfigError(f"kv_cache_dtype=int8 needs a power-of-two head_dim (its Hadamard rotation), got {head_dim}")


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
        if cfg.kv_cache_dtype == "int8":  # torch on CPU, the Triton kernels on CUDA (kernels/kv_int8.py)
            agreed(lambda: _power_of_two_head_dim(self.shape.head_dim))
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
                model = agreed(lambda: build_model(self.source.hf_config, tp, backend, moe_tp_split=cfg.moe_tp_split,
                                                   quantization=cfg.quantization))
        finally:
            torch.set_default_dtype(previous_dtype)
        self.weight_aliases: dict[str, str] | None = None  # the head loaded from the embedding (update_weights)
        if self.source.checkpoint_dir is None:
            load_dummy_weights(model, cfg.seed)
        else:
            self.weight_aliases = load_safetensors_weights(model, self.source.checkpoint_dir)
        model.eval()
        set_small_batch_gemv(model, cfg.debug.small_batch_gemv)
        use_attention_backend(model, select_attention_backend(backend, self.device, cfg.kv_cache_dtype,
                                                              cfg.debug.cuda_decode, cfg.debug.cuda_fp8_decode))
        log.info("model %s loaded (%s, %s, attention=%s, tp=%d) in %.1f s", cfg.model.name,
                 self.source.checkpoint_dir or "dummy weights", str(self.dtype).replace("torch.", ""),
                 backend, replica.tp_size, time.perf_counter() - started)
        if getattr(model, "fp8_scheme", None) is not None:
            log.info("quantization: %s", model.fp8_scheme.describe())
        return model

    def _start_runner(self) -> ModelRunner:
        """The runner over the loaded model: KV pool sized (and agreed to hold one sequence), graphs captured."""
        cfg = self.cfg
        settings = RunnerSettings(cfg.block_size, self.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                  cfg.enforce_eager, cfg.gpu_memory_utilization, cfg.cpu_kv_cache_gib,
                                  cfg.num_kv_blocks, cfg.kv_cache_dtype, cfg.debug.cuda_pdl,
                                  cfg.debug.sampler_graphs)
        runner = ModelRunner(self.model, self.shape, settings, self.device, self.dtype, self.replica.tp_size,
                             self.replica)
        self.kv_capacity = KVCapacity(runner.num_blocks, cfg.block_size, runner.spec.bytes_per_block)
        agreed(lambda: self._check_kv_capacity(self.kv_capacity.num_blocks, runner.memory_budget))
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
        enabled = self.cfg.debug.cuda_fp8_decode if fp8 else self.cfg.debug.cuda_decode
        if not (enabled and self.device.type == "cuda" and fp8_cache == fp8):
            return False
        if fp8:
            from spmd_engine.kernels.decode_attention_fp8_cuda import usable
        else:
            from spmd_engine.kernels.decode_attention_cuda import usable
        return usable(self.device)

    def _checked_shape(self) -> ModelShape:
        shape = ModelShape.from_hf_config({**self.source.hf_config, MOE_TP_SPLIT_KEY: self.cfg.moe_tp_split})
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
                 token_text: Callable[[int], str] | None = None, keep_outputs: bool = True,
                 grammars: Any = None) -> list[RequestOutput]:
        """Collective over the replica: its leader returns one RequestOutput per request (submission
        order); the other ranks [].

        `requests` is pulled lazily, as the batch has room (a generator may read and tokenize on demand;
        a `PolledRequests` may answer "not yet" while the batch runs, e.g. work not yet handed out to
        this replica). `keep_outputs=False` returns [] on the leader too:
        the outputs go to `on_finish` only, so a job of any size holds only the requests in flight.
        `token_text(id)`: one token's text, for the alternatives of logprobs (None: decode([id])).
        `grammars`: the tokenizer's GrammarCompilerPool (structured outputs; None: such requests are errors)."""
        if self.runner.is_asleep:  # every rank alike: sleep is collective
            raise ConfigError("the engine is asleep (LLM.sleep): call wake_up() before generating")
        if not self.replica.is_leader:
            self._follow_plans()
            return []
        if self.scheduler.has_unfinished() or self.scheduler.block_manager.num_used_blocks:
            # an earlier call ended half-way (an exception): start from a clean pool
            self.scheduler = new_scheduler(self.cfg, self.max_model_len, self.runner.num_blocks,
                                           self.shape.eos_token_ids)
        parts = LoopParts(self.cfg, self.scheduler, self.runner, self.replica, self.step_progress, self.device,
                          self.shape.vocab_size, self.max_model_len)
        loop = StepLoop(parts, GenerateCall.of(requests, on_finish, decode, token_text, progress, keep_outputs,
                                               grammars), self.step)
        try:
            outputs = loop.run()
        finally:
            self.step = loop.step  # a failed call's steps count too: step numbers never repeat
        self.last_run = loop.summary
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

    # --- in-place weight updates, sleep and wake-up (RL loops) ----------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (HF name, FULL tensor) pairs into this rank's shards in place, as the loader does at start-up
        (TP slicing, q/k/v and gate/up packing, the tied head, dtype cast); returns the tensors copied.

        Collective: every rank passes the same names. Every name and shape is checked on every rank before
        anything is copied, and a bad one raises the same one-line ConfigError everywhere, weights untouched.
        In place, so the CUDA graphs stay valid; the prefix cache is reset (its KV came from the old weights).
        """
        from spmd_engine.models.loader import apply_update, head_aliases, plan_update

        batch = list(named_tensors)
        aliases = None
        if self.weight_aliases:  # the head was the embedding's copy at load: it follows the embedding
            aliases = head_aliases(self.model, {item[0] for item in batch if isinstance(item, tuple) and item})
        targets = agreed(lambda: plan_update(self.model, _named_shapes(batch), aliases))
        return self._applied(lambda: apply_update(targets, batch, aliases))

    def update_weights_from_path(self, path: str | Path) -> int:
        """`update_weights` with every tensor of a safetensors checkpoint dir (single file, sharded with its
        index, or every *.safetensors), read one tensor at a time; names and shapes come from the files'
        headers and are checked before anything is read. Collective."""
        from spmd_engine.models.loader import (apply_update, head_aliases, plan_update, safetensors_files,
                                               stream_safetensors, tensor_shapes)

        def planned():
            files = safetensors_files(path)
            shapes = tensor_shapes(files)
            aliases = head_aliases(self.model, set(shapes))
            return files, aliases, plan_update(self.model, shapes.items(), aliases)

        files, aliases, targets = agreed(planned)
        return self._applied(lambda: apply_update(targets, stream_safetensors(files), aliases))

    def _applied(self, copy: Callable[[], int]) -> int:
        started = time.perf_counter()
        copied = copy()
        if self.device.type == "cuda":  # a source on the device is copied on the stream: done before any step
            torch.cuda.synchronize(self.device)
        self.runner.weights_changed()
        self.reset_prefix_cache()
        log.info("weights: %d tensors updated in place in %.2f s", copied, time.perf_counter() - started)
        return copied

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (the replica's leader holds them); the others have none."""
        if self.scheduler is not None:
            self.scheduler.block_manager.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back: level 1 frees the KV cache, level 2 also moves the weights to host
        memory. Collective. generate raises until `wake_up`; update_weights works while asleep."""
        if level not in (1, 2):
            raise ConfigError(f"sleep level must be 1 (free the KV cache) or 2 (and move the weights to host), "
                              f"got {level!r}")
        if self.runner.is_asleep:
            raise ConfigError("the engine is asleep already: call wake_up() first")
        self.runner.sleep(offload_weights=level == 2)

    def wake_up(self) -> None:
        """Undo `sleep`: the weights back on the device, a KV cache of the same size (the CUDA graphs captured
        again where an address moved), the prefix cache reset. Collective; nothing to do when awake.
        If the memory is not there, every rank raises the same one-line ConfigError and stays asleep."""
        if not self.runner.is_asleep:
            return
        try:
            agreed(self.runner.reclaim_memory)
        except ConfigError:
            self.runner.sleep(offload_weights=False)  # what this rank got back goes again: every rank asleep alike
            raise
        # one rank's cache may come back at its old address and another's not: they capture together
        self.runner.refresh_after_wake(recapture=all_reduce_min(0 if self.runner.graphs_stale else 1) == 0)
        self.reset_prefix_cache()

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


def _named_shapes(batch: list) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each (HF name, tensor) pair; ValueError for anything else."""
    for item in batch:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            shown = repr(item) if len(repr(item)) <= 60 else repr(item)[:60] + "..."
            raise ValueError(f"update_weights takes (HF checkpoint name, tensor) pairs, got {shown}")
        yield item[0], tuple(item[1].shape)
