"""Typed engine configuration, built from the composed Hydra config and validated up front.

Every check here runs before any heavy work (model build, KV allocation) so that a bad key costs
one clear line, not a traceback after minutes of loading.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A user-caused configuration problem; the message is one line naming the key and limit."""


@dataclass
class SamplingDefaults:
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = -1
    max_tokens: int = 256
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class ModelConfig:
    name: str
    path: str | None
    load_format: str  # auto | dummy
    hf_config: dict[str, Any]


@dataclass
class WorkloadConfig:
    name: str  # chat | bench
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineConfig:
    model: ModelConfig
    workload: WorkloadConfig
    sampling: SamplingDefaults
    prompts: list[str] | None = None
    prompts_file: str | None = None
    chat_template: bool = True
    resume: bool = False
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 2.0
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    async_scheduling: bool = True
    attention_backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8 (float8_e4m3fn, per-head scales)
    tp_reduce_dtype: str = "float32"  # float32 | model: dtype of the row-parallel all-reduce sums
    seed: int = 0
    tensor_parallel_size: int | None = None
    dist_timeout_s: float = 45.0
    startup_timeout_s: float = 600.0
    log_level: str = "INFO"
    fault: dict[str, Any] | None = None  # test-only fault injection (see spmd_engine/faults.py)

    def validate(self, world_size: int) -> None:
        """Raise ConfigError on the first bad key (checks that need no model or device)."""
        _check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
               f"block_size must be a power of two, got {self.block_size}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.cpu_kv_cache_gib > 0, f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
               f"num_kv_blocks must be >= 1 or null, got {self.num_kv_blocks}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_model_len is None or self.max_model_len >= 2,
               f"max_model_len must be >= 2 or null, got {self.max_model_len}")
        _check(self.attention_backend in ("auto", "triton", "torch", "flash_attn"),
               f"attention_backend must be one of auto|triton|torch|flash_attn, got {self.attention_backend!r}")
        _check(self.device in ("auto", "cuda", "cpu"), f"device must be one of auto|cuda|cpu, got {self.device!r}")
        _check(self.dtype in ("auto", "bfloat16", "float16", "float32"),
               f"dtype must be one of auto|bfloat16|float16|float32, got {self.dtype!r}")
        _check(self.kv_cache_dtype in ("auto", "fp8"),
               f"kv_cache_dtype must be one of auto|fp8, got {self.kv_cache_dtype!r}")
        _check(self.tp_reduce_dtype in ("float32", "model"),
               f"tp_reduce_dtype must be one of float32|model, got {self.tp_reduce_dtype!r}")
        _check(self.model.load_format in ("auto", "dummy"),
               f"model.load_format must be auto or dummy, got {self.model.load_format!r}")
        _check(self.tensor_parallel_size in (None, world_size),
               f"tensor_parallel_size={self.tensor_parallel_size} must equal the number of ranks "
               f"({world_size}); launch with torchrun --nproc_per_node={self.tensor_parallel_size}")
        _check(self.dist_timeout_s > 0, f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")
        _check(self.startup_timeout_s > 0, f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        _check(not (self.prompts is not None and self.prompts_file is not None),
               "give either prompts or prompts_file, not both")
        _check(self.workload.name in ("chat", "bench"), f"workload must be chat or bench, got {self.workload.name!r}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def engine_config_from_dict(cfg: dict[str, Any]) -> EngineConfig:
    """Build an EngineConfig from the plain dict of a composed Hydra config (unknown keys rejected)."""
    cfg = dict(cfg)
    cfg.pop("hydra", None)
    model = dict(cfg.pop("model"))
    workload = dict(cfg.pop("workload", {"name": "chat"}))
    sampling = dict(cfg.pop("sampling", {}))
    try:
        model_cfg = ModelConfig(
            name=str(model.pop("name", "custom")),
            path=None if model.get("path") in (None, "") else str(model.pop("path")),
            load_format=str(model.pop("load_format", "auto")),
            hf_config=dict(model.pop("hf_config", {}) or {}),
        )
        model.pop("path", None)
        if model:
            raise ConfigError(f"unknown key(s) model.{', model.'.join(sorted(model))}")
        sampling_cfg = SamplingDefaults(**sampling)
        workload_cfg = WorkloadConfig(name=str(workload.pop("name", "chat")), params=workload)
        if cfg.get("prompts") is not None:
            prompts = cfg["prompts"]
            if isinstance(prompts, str):
                prompts = [prompts]
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise ConfigError("prompts must be a list of strings, e.g. prompts='[\"Hello\"]'")
            cfg["prompts"] = prompts
        return EngineConfig(model=model_cfg, workload=workload_cfg, sampling=sampling_cfg, **cfg)
    except TypeError as exc:  # unknown or missing dataclass field
        raise ConfigError(f"bad config key: {exc}") from None
