"""Typed engine configuration, built from the composed Hydra config and validated up front.

Every check here runs before any heavy work (model build, KV allocation) so that a bad key costs
one clear line, not a traceback after minutes of loading.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from spmd_engine.core.sequence import SamplingParams

log = logging.getLogger("spmd_engine")
MAX_SEQS_PER_STEP = 65535  # a CUDA grid's y / z limit (see the max_num_seqs check)


class ConfigError(ValueError):
    """A user-caused configuration problem; the message is one line naming the key and limit."""


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
class DebugConfig:
    """Developer overrides (`debug.KEY=false`) for A/B benches, kept out of the README's key table.

    Why a group of its own: each path below is taken wherever the hardware and shapes allow it, so a
    user has nothing to choose; true (the default) lets the engine decide, false forces the fallback
    everywhere. The start-up log line says which paths act."""

    # CUDA, bf16/fp16: matmuls of <= 16 rows (small-batch decode) and the LM head by a Triton split-K GEMV
    # (kernels/gemv.py) reading the weights near bandwidth; false: cuBLAS at every size
    small_batch_gemv: bool = True
    # CUDA sm_90+: the decode CUDA graphs of at most 128 rows (executor/cuda_graphs.PDL_MAX_ROWS) launch their
    # Triton kernels with Programmatic Dependent Launch (kernels/pdl.py; same bits); false: no PDL anywhere
    cuda_pdl: bool = True
    # CUDA sm_89+ with kv_cache_dtype=fp8: decode steps attend with the NVRTC-compiled CUDA kernel
    # (kernels/decode_attention_fp8_cuda.py; head_dim 128, <= 8 query heads per KV head, block_size >= 4);
    # other shapes, no NVRTC, or false: Triton
    cuda_fp8_decode: bool = True
    # CUDA sm_80+ with a bf16/fp16 cache: decode steps attend with the CUDA kernel of the same design
    # (kernels/decode_attention_cuda.py; head_dim 128, <= 8 query heads per KV head, block_size >= 2);
    # other shapes, no NVRTC, or false: Triton
    cuda_decode: bool = True
    # CUDA: rank 0 draws an all-greedy or all-plain-temperature decode step by replaying a CUDA graph of the
    # sampler (executor/sampler_graphs.py: the same kernels and tokens); CPU / enforce_eager: eager anyway
    sampler_graphs: bool = True


# the five switches' old top-level spellings: still accepted (null = unset), folded into debug.* with a warning
DEPRECATED_DEBUG_KEYS = tuple(f.name for f in dataclasses.fields(DebugConfig))


@dataclass
class EngineConfig:
    model: ModelConfig
    workload: WorkloadConfig
    sampling: SamplingParams = field(default_factory=SamplingParams)  # every request's defaults (sampling.*)
    # input
    prompts: list[str] | None = None  # e.g. prompts='["Hello", "Why is the sky blue?"]'
    prompts_file: str | None = None  # JSONL: {"prompt": ...} or {"prompt_token_ids": [...]} (+ per-request sampling)
    chat_template: bool = True  # wrap text prompts in the tokenizer's chat template
    chat_template_kwargs: dict[str, Any] | None = None  # options for the chat template, e.g. enable_thinking
    resume: bool = False  # skip requests already present in this job's outputs.jsonl
    output_format: str = "rows"  # rows (our outputs.jsonl rows) | openai (OpenAI batch output objects)
    # engine
    block_size: int = 16  # tokens per KV block (power of two)
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may use (CUDA)
    cpu_kv_cache_gib: float = 2.0  # KV pool size on CPU, in GiB
    num_kv_blocks: int | None = None  # fix the KV pool size in blocks on any device (overrides the two above)
    max_num_seqs: int = 256  # sequences per step
    max_num_batched_tokens: int = 8192  # tokens per step (prefill chunks + decodes)
    # prompt tokens in a step that also decodes; None: no cap (the step's token budget only)
    max_prompt_tokens_per_mixed_step: int | None = None
    max_model_len: int | None = None  # prompt + output limit; None = min(max_position_embeddings, 4096)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # true = no CUDA graphs
    async_scheduling: bool = True  # plan step N+1 while the GPU runs step N
    attention_backend: str = "auto"  # auto | triton | torch
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    # auto (the model dtype) | fp8 (float8_e4m3fn, per-head scales) | int8 (per token and head, Hadamard-rotated;
    # Triton kernels on CUDA, torch on CPU)
    kv_cache_dtype: str = "auto"
    # auto | fp8 | none: fp8 = e4m3 weights and activations in the linear layers (an FP8 checkpoint's block
    # scales, or a 16-bit checkpoint quantized at load); auto = fp8 for an FP8 checkpoint, else none
    quantization: str = "auto"
    # float32 | model: dtype of the row-parallel all-reduce sums; bf16 partial sums rounded on every rank make
    # N ranks pick other greedy tokens than one rank, float32 rounds once (2x the all-reduce bytes)
    tp_reduce_dtype: str = "float32"
    # auto | nccl | symm_mem: how those all-reduces run; symm_mem = torch symmetric memory one-shot kernels
    # (small messages, CUDA graphs; NCCL above its buffer), auto = symm_mem where the GPUs can map each other
    tp_allreduce: str = "nccl"  # auto (symm_mem where it runs) becomes the default once measured on 2 GPUs
    # experts | intermediate: how an MoE model's experts split over tensor-parallel ranks (models/moe_shape.py)
    moe_tp_split: str = "experts"
    seed: int = 0
    tensor_parallel_size: int | None = None  # ranks per replica; None: derived from the world size
    data_parallel_size: int | None = None  # replicas of tensor_parallel_size ranks each; None: derived
    dist_timeout_s: float = 45.0  # no rank making progress (computing, a new step) this long ends the job
    startup_timeout_s: float = 600.0  # rendezvous wait and collectives before generation
    log_level: str = "INFO"
    cpu_threads: int | None = None  # torch intra-op threads per rank on CPU; None: cores available / ranks on the node
    debug: DebugConfig = field(default_factory=DebugConfig)  # developer overrides for A/B benches (debug.*)

    def validate(self, world_size: int) -> None:
        """Raise ConfigError on the first bad key (checks that need no model or device)."""
        _check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
               f"block_size must be a power of two, got {self.block_size}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.cpu_kv_cache_gib > 0, f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
               f"num_kv_blocks must be >= 1 or null, got {self.num_kv_blocks}")
        _check(self.max_prompt_tokens_per_mixed_step is None or self.max_prompt_tokens_per_mixed_step >= 1,
               f"max_prompt_tokens_per_mixed_step must be >= 1 or null, got {self.max_prompt_tokens_per_mixed_step}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        # the attention kernels' CUDA grids hold a step's sequences on their z axis (prefill; decode, which
        # starts them longest first: kernels/decode_attention.py), whose limit is 65,535
        _check(self.max_num_seqs <= MAX_SEQS_PER_STEP,
               f"max_num_seqs must be <= {MAX_SEQS_PER_STEP}, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_model_len is None or self.max_model_len >= 2,
               f"max_model_len must be >= 2 or null, got {self.max_model_len}")
        _check(self.attention_backend in ("auto", "triton", "torch"),
               f"attention_backend must be one of auto|triton|torch, got {self.attention_backend!r}")
        _check(self.device in ("auto", "cuda", "cpu"), f"device must be one of auto|cuda|cpu, got {self.device!r}")
        _check(self.dtype in ("auto", "bfloat16", "float16", "float32"),
               f"dtype must be one of auto|bfloat16|float16|float32, got {self.dtype!r}")
        _check(self.kv_cache_dtype in ("auto", "fp8", "int8"),
               f"kv_cache_dtype must be one of auto|fp8|int8, got {self.kv_cache_dtype!r}")
        _check(self.kv_cache_dtype != "fp8" or self.block_size >= 2,
               f"kv_cache_dtype=fp8 needs block_size >= 2 (its V cache stores pairs of positions), "
               f"got {self.block_size}")
        _check(self.quantization in ("auto", "fp8", "none"),
               f"quantization must be one of auto|fp8|none, got {self.quantization!r}")
        _check(self.tp_reduce_dtype in ("float32", "model"),
               f"tp_reduce_dtype must be one of float32|model, got {self.tp_reduce_dtype!r}")
        _check(self.tp_allreduce in ("auto", "nccl", "symm_mem"),
               f"tp_allreduce must be one of auto|nccl|symm_mem, got {self.tp_allreduce!r}")
        _check(self.moe_tp_split in ("experts", "intermediate"),
               f"moe_tp_split must be one of experts|intermediate, got {self.moe_tp_split!r}")
        _check(self.model.load_format in ("auto", "dummy"),
               f"model.load_format must be auto or dummy, got {self.model.load_format!r}")
        self.parallel_sizes(world_size)
        _check(self.dist_timeout_s > 0, f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")
        _check(self.startup_timeout_s > 0, f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        _check(self.cpu_threads is None or self.cpu_threads >= 1,
               f"cpu_threads must be >= 1 or null (null: cores available / ranks on the node), got {self.cpu_threads}")
        _check(not (self.prompts is not None and self.prompts_file is not None),
               "give either prompts or prompts_file, not both")
        _check(self.chat_template_kwargs is None or isinstance(self.chat_template_kwargs, dict),
               f"chat_template_kwargs must be a group of keys, "
               f"e.g. '+chat_template_kwargs={{enable_thinking: false}}', got {self.chat_template_kwargs!r}")
        _check(self.output_format in ("rows", "openai"),
               f"output_format must be rows or openai, got {self.output_format!r}")
        _check(not (self.resume and self.output_format == "openai"),
               "resume=true needs output_format=rows (a resumed job checks its kept rows' prompts and sampling)")
        _check(self.workload.name in ("chat", "bench"), f"workload must be chat or bench, got {self.workload.name!r}")


    def parallel_sizes(self, world_size: int) -> tuple[int, int]:
        """(data_parallel_size, tensor_parallel_size) for `world_size` ranks, or ConfigError.

        Why derived here: neither set keeps the old meaning (one replica over every rank); one set
        gives the other; both must multiply to the number of ranks."""
        dp, tp = self.data_parallel_size, self.tensor_parallel_size
        _check(dp is None or dp >= 1, f"data_parallel_size must be >= 1 or null, got {dp}")
        _check(tp is None or tp >= 1, f"tensor_parallel_size must be >= 1 or null, got {tp}")
        if dp is None and tp is None:
            return 1, world_size
        if tp is None:
            _check(world_size % dp == 0, f"data_parallel_size={dp} must divide the number of ranks ({world_size}); "
                                         f"launch a multiple of {dp} ranks or set tensor_parallel_size")
            return dp, world_size // dp
        if dp is None:
            _check(world_size % tp == 0, f"tensor_parallel_size={tp} must divide the number of ranks ({world_size}); "
                                         f"launch with torchrun --nproc_per_node={tp} (or a multiple of it)")
            return world_size // tp, tp
        _check(dp * tp == world_size, f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp} must equal "
                                      f"the number of ranks ({world_size}); launch {dp * tp} ranks")
        return dp, tp


@dataclass(frozen=True)
class StartupSettings:
    """What the process group and the watchdog need before the config is checked: the ranks first meet,
    then agree on the config (one rank's error ends every rank together, each after rank 0 wrote its files)."""

    device: str
    dist_timeout_s: float
    timeout_s: float  # the process group's collective timeout
    rendezvous_timeout_s: float  # how long ranks wait for rank 0's store (startup_timeout_s)


def startup_settings(raw: dict[str, Any]) -> StartupSettings:
    """Lenient read of `device` and the timeouts from a raw config (a bad value: the default; the strict
    check that names it follows once the ranks have met)."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}

    def seconds(key: str) -> float:
        value = raw.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
        return float(value) if ok else float(defaults[key])

    device = raw.get("device") if raw.get("device") in ("auto", "cuda", "cpu") else defaults["device"]
    dist_timeout_s, startup_timeout_s = seconds("dist_timeout_s"), seconds("startup_timeout_s")
    return StartupSettings(device, dist_timeout_s, max(dist_timeout_s, startup_timeout_s), startup_timeout_s)


DEFAULTS_CONFIG = "engine_defaults"  # the ConfigStore entry conf/config.yaml's defaults list starts with
_GROUP_KEYS = ("model", "workload")  # chosen by conf/'s config groups


def config_defaults() -> dict[str, Any]:
    """Every engine key of the composed config with its default, read from the dataclasses above (and
    SamplingParams for sampling.*): the one place a default is written down; conf/ holds none.

    The deprecated top-level switches are there as null (unset) so that `cuda_pdl=false` still composes
    (Hydra refuses a key its config lacks) and a multirun can still sweep them."""
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name in _GROUP_KEYS:
            continue
        value = f.default_factory() if f.default is dataclasses.MISSING else f.default
        defaults[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    defaults.update(dict.fromkeys(DEPRECATED_DEBUG_KEYS))
    return defaults


def store_config_defaults() -> None:
    """Register `config_defaults()` in Hydra's ConfigStore as the base conf/config.yaml extends; call it
    before composing conf/ (run.py does on import, `spmd_engine.llm.compose_config` before composing).

    A plain node, not the dataclasses as a typed schema: see docs/ARCHITECTURE.md, "Config"."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=DEFAULTS_CONFIG, node=config_defaults())


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


_SECTIONS = ("model", "workload", "sampling", "debug")  # nested groups; every other key is an EngineConfig field
_MODEL_KEYS = ("name", "path", "load_format", "hf_config")
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _reject_unknown(keys: Iterable[str], known: Iterable[str], prefix: str = "") -> None:
    """One line naming the first unknown key (with its near miss in `known`), never a Python signature."""
    known = list(known)
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = (f"; did you mean {prefix}{close[0]}?" if close
                    else f" (known: {', '.join(prefix + k for k in known)})")
            raise ConfigError(f"unknown config key {prefix}{key}{hint}")


def _sampling_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(SamplingParams)]


def _reject_sampling_key_at_top(keys: Iterable[str], top_level: list[str]) -> None:
    """`max_tokens=16` meant `sampling.max_tokens=16`: say so (a near miss among top-level keys would not)."""
    for key in keys:
        if key not in top_level and key in _sampling_fields():
            raise ConfigError(f"unknown config key {key}; did you mean sampling.{key}?")


def _is_known_override(key: str) -> bool:
    """Whether the composed config has `key` (a top-level engine key, a group, sampling.* or debug.*);
    keys inside model.* / workload.* depend on the group chosen and count as known."""
    head, _, rest = key.partition(".")
    if not rest:
        return head in config_defaults() or head in (*_GROUP_KEYS, "hydra")
    if head == "sampling":
        return rest in _sampling_fields()
    if head == "debug":
        return rest in DEPRECATED_DEBUG_KEYS
    return True


def plus_unknown_overrides(args: list[str]) -> list[str]:
    """Command-line overrides with `+` put before each plain `key=value` whose key the config lacks.

    Why: Hydra refuses such a key while composing, in its own words ("Key 'max_tokens' is not in
    struct", exit 1) before the job runs; added with `+`, it reaches the config check, which names it
    in one line with its near miss (`did you mean sampling.max_tokens?`), exit 2, as for `+block_sise=16`."""
    out = []
    for arg in args:
        key, eq, _ = arg.partition("=")
        plain = eq and key and not key.startswith(("+", "~", "-")) and not any(c in key for c in "/@ ")
        out.append(f"+{arg}" if plain and not _is_known_override(key) else arg)
    return out


def _scalar_type(annotation: Any) -> tuple[type | None, bool]:
    """(int/float/bool/str or None for anything else, whether null is allowed) of a field annotation."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    optional = type(None) in args
    inner = [a for a in args if a is not type(None)] if args else [annotation]
    kind = inner[0] if len(inner) == 1 and inner[0] in _TYPE_NAMES else None
    return kind, optional


def _typed(name: str, value: Any, annotation: Any) -> Any:
    """`value` as the field's scalar type (an int where a float is wanted becomes a float), or ConfigError.

    Why: Hydra hands over `block_size=abc` as the string 'abc'; it must be named here, not surface
    as a TypeError deep in a check or in the model build.
    """
    kind, optional = _scalar_type(annotation)
    if kind is None or (value is None and optional):
        return value
    is_bool = isinstance(value, bool)
    if kind is float and isinstance(value, int) and not is_bool:
        return float(value)
    if kind is str and isinstance(value, (int, float)) and not is_bool:
        return str(value)  # Hydra reads prompts_file=123 as a number; the name is still text
    if isinstance(value, kind) and (kind is bool or not is_bool):
        return value
    null = " or null" if optional else ""
    raise ConfigError(f"{name} must be {_TYPE_NAMES[kind]}{null}, got {value!r}")


# workload=bench keys (conf/workload/bench.yaml) -> (type, lower limit, the key whose value is the lower limit)
BENCH_PARAMS: dict[str, tuple[type, float | None, str | None]] = {
    "num_seqs": (int, 1, None), "min_input_len": (int, 1, None), "max_input_len": (int, None, "min_input_len"),
    "min_output_len": (int, 1, None), "max_output_len": (int, None, "min_output_len"),
    "token_id_max": (int, 0, None), "random_seed": (int, None, None), "temperature": (float, 0, None),
    "warmup": (bool, None, None), "top_p": (float, None, None), "top_k": (int, -1, None),
    "n": (int, 1, None), "n_as_separate_requests": (bool, None, None),  # workload=bench_n
}


def _workload_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """`workload.*` keys of the chosen workload, typed and within limits (chat takes none but its name)."""
    known = BENCH_PARAMS if name == "bench" else {}
    if params and not known:
        raise ConfigError(f"unknown config key workload.{next(iter(params))} (workload={name} takes no other keys)")
    _reject_unknown(params, known, "workload.")
    checked = {key: _typed(f"workload.{key}", value, known[key][0]) for key, value in params.items()}
    for key, (_, low, low_key) in known.items():
        if key not in checked:
            continue
        limit = checked.get(low_key, low) if low_key else low
        if limit is not None and checked[key] < limit:
            raise ConfigError(f"workload.{key} must be >= {f'workload.{low_key} ({limit})' if low_key else limit}, "
                              f"got {checked[key]}")
    if "top_p" in checked and not 0 < checked["top_p"] <= 1:  # the bench's sampling keys: sampling.*'s limits
        raise ConfigError(f"workload.top_p must be in (0, 1], got {checked['top_p']}")
    return checked


def sampling_defaults_from_dict(sampling: dict[str, Any]) -> SamplingParams:
    """The job-wide `sampling.*` defaults, checked by the same SamplingParams.validate that checks each
    request's own values (a bad one here fails the job before the model loads; in a prompts file, one row)."""
    _reject_unknown(sampling, [f.name for f in dataclasses.fields(SamplingParams)], "sampling.")
    try:
        return SamplingParams.from_dict(sampling)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def debug_from_dict(debug: dict[str, Any], old: dict[str, Any]) -> DebugConfig:
    """`debug.*` typed, with the old top-level spellings in `old` (null: unset) laid over it, each said once."""
    _reject_unknown(debug, DEPRECATED_DEBUG_KEYS, "debug.")
    merged = {key: _typed(f"debug.{key}", value, bool) for key, value in debug.items()}
    for key, value in old.items():
        if value is not None:
            merged[key] = _typed(key, value, bool)
            _warn_deprecated(key)
    return DebugConfig(**merged)


def _warn_deprecated(key: str) -> None:
    """One line per old spelling, on the first rank only (every rank builds the same config)."""
    from spmd_engine.distributed import discover_ranks

    if discover_ranks().is_first:
        log.warning("%s is deprecated; use debug.%s (the engine picks the path itself)", key, key)


def engine_config_from_dict(cfg: dict[str, Any]) -> EngineConfig:
    """Build an EngineConfig from the plain dict of a composed Hydra config.

    Unknown keys, values of the wrong type and bad sampling defaults raise ConfigError here, on
    every rank alike and before anything is loaded.
    """
    cfg = dict(cfg)
    cfg.pop("hydra", None)
    cfg.pop("repeat", None)  # a sweep's repeat label (`+repeat=0,1,2`): names a job, changes nothing
    for section in _SECTIONS:
        if cfg.get(section) is not None and not isinstance(cfg[section], dict):
            raise ConfigError(f"{section} must be a group of keys ({section}.KEY=VALUE), got {cfg[section]!r}")
    model = dict(cfg.pop("model", None) or {})
    workload = dict(cfg.pop("workload", None) or {"name": "chat"})
    sampling = dict(cfg.pop("sampling", None) or {})
    debug = dict(cfg.pop("debug", None) or {})
    old_switches = {key: cfg.pop(key) for key in DEPRECATED_DEBUG_KEYS if key in cfg}
    hints = typing.get_type_hints(EngineConfig)
    top_level = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in _SECTIONS]
    _reject_sampling_key_at_top(cfg, top_level)
    _reject_unknown(cfg, top_level + list(_SECTIONS))
    _reject_unknown(model, _MODEL_KEYS, "model.")
    for key, value in list(cfg.items()):
        cfg[key] = _typed(key, value, hints[key])
    hf_config = model.get("hf_config") or {}
    if not isinstance(hf_config, dict):
        raise ConfigError(f"model.hf_config must be a group of keys, got {hf_config!r}")
    model_cfg = ModelConfig(
        name=str(model.get("name", "custom")),
        path=None if model.get("path") in (None, "") else str(model["path"]),
        load_format=str(model.get("load_format", "auto")),
        hf_config=dict(hf_config),
    )
    sampling_cfg = sampling_defaults_from_dict(sampling)
    debug_cfg = debug_from_dict(debug, old_switches)
    workload_name = str(workload.pop("name", "chat"))
    workload_cfg = WorkloadConfig(name=workload_name, params=_workload_params(workload_name, workload))
    if cfg.get("prompts") is not None:
        prompts = cfg["prompts"]
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ConfigError("prompts must be a list of strings, e.g. prompts='[\"Hello\"]'")
        cfg["prompts"] = prompts
    return EngineConfig(model=model_cfg, workload=workload_cfg, sampling=sampling_cfg, debug=debug_cfg, **cfg)
