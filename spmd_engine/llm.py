"""The public Python API, shaped like vLLM's: `LLM(model=...)`, `generate`, `chat`, `SamplingParams`.

Why: users already know vLLM's offline API, and a library call should not need a Hydra command
line. The config is composed from the same `conf/` that `run.py` uses (Hydra's compose API), so
defaults have one source and a bad keyword fails with the same one-line error as a bad CLI key.
Under torchrun/srun every rank builds the same LLM and makes the same calls: rank 0 tokenizes and hands
the requests out to the data-parallel replicas as they have room (as `run.py` does), each replica's
leader plans its share, every rank runs the forward, and every rank returns every output in order.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import Any, Union

from spmd_engine.cpu_threads import apply_cpu_threads
from spmd_engine.config import (ConfigError, EngineConfig, engine_config_from_dict, startup_settings,
                                store_config_defaults)
from spmd_engine.core.requests import PolledRequests, PromptRequest, RequestOutput
from spmd_engine.core.sequence import SamplingParams
from spmd_engine.distributed import (RankInfo, destroy_process_group, discover_ranks, init_process_group,
                                     is_distributed)
from spmd_engine.engine import Engine, agreed
from spmd_engine.faults.progress import StepProgress
from spmd_engine.generation_defaults import checkpoint_sampling
from spmd_engine.replica_generate import generate_on_replicas
from spmd_engine.tokenizer import load_tokenizer
from spmd_engine.structured.grammars import GrammarCompilerPool, warm_up_mask_kernel
from spmd_engine.structured.params import StructuredOutputsParams  # noqa: F401 (spmd_engine's export)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
Prompt = Union[str, dict[str, Any]]  # "text", {"prompt": "text"} or {"prompt_token_ids": [...]}
Message = dict[str, str]  # {"role": "user", "content": "..."}


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's `outputs[0]`)."""

    index: int
    text: str | None  # None without a tokenizer, or for an error
    token_ids: list[int]
    finish_reason: str  # stop | length | error
    error: str | None = None  # the one-line reason a request could not run (finish_reason "error")


@dataclass
class GenerationOutput:
    """One request's result: its prompt and its completions (vLLM's RequestOutput)."""

    request_id: int  # position in the generate call's prompt list
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]

    @classmethod
    def from_engine(cls, outs: list[RequestOutput]) -> list[GenerationOutput]:
        """The engine's rows (one per completion, in request then completion order) as one output per
        request, its `n` completions in `outputs`."""
        results: list[GenerationOutput] = []
        for out in outs:
            if not results or results[-1].request_id != out.index:
                results.append(cls(out.index, out.prompt, out.prompt_token_ids, []))
            results[-1].outputs.append(CompletionOutput(out.sample_index or 0, out.text, list(out.token_ids),
                                                        out.finish_reason, out.error))
        return results


MODEL_KEYWORDS = ("load_format",)  # model.* keys that LLM(...) takes as plain keywords


def compose_config(model: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """conf/ composed for `model` (a conf/model group name, else a checkpoint dir or hub id), with
    engine keys replaced by `overrides`; a plain dict, checked later by engine_config_from_dict."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    store_config_defaults()
    group = model if (CONF_DIR / "model" / f"{model}.yaml").is_file() else None
    hydra_overrides = [f"model={group}"] if group else []
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: its search path is this conf/
        cfg = compose(config_name="config", overrides=hydra_overrides)
    else:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=hydra_overrides)
    raw = OmegaConf.to_container(cfg, resolve=True)
    if group is None:
        raw["model"]["path"] = model
    for key in MODEL_KEYWORDS:  # vLLM's LLM(model, load_format="dummy"): `model` is taken by the name
        if key in overrides:
            raw["model"][key] = overrides[key]
    for key, value in ((k, v) for k, v in overrides.items() if k not in MODEL_KEYWORDS):
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}  # e.g. sampling={"max_tokens": 8}
        else:
            raw[key] = value  # unknown keys stay: the config check names them
    return raw


class LLM:
    """An offline engine: `LLM(model="smollm2", block_size=32).generate(prompts, SamplingParams(...))`.

    `model` is a conf/model group name (`smollm2`, `qwen3`, ...) or a checkpoint directory / hub id;
    every other keyword is an engine key (`EngineConfig`, README "Keys": `block_size`, `gpu_memory_utilization`,
    `enforce_eager`, `device`, `sampling={...}`, ...). Collective: every rank constructs it the same.
    """

    def __init__(self, model: str = "smollm2", **engine_keys: Any) -> None:
        raw = compose_config(model, engine_keys)
        ranks = discover_ranks()
        startup = startup_settings(raw)
        self._owns_group = ranks.world_size > 1 and not is_distributed()  # torchrun/srun: this LLM makes it
        init_process_group(ranks, startup.device != "cpu" and _cuda_available(), startup.timeout_s,
                           startup.rendezvous_timeout_s)
        cfg = agreed(lambda: engine_config_from_dict(raw))
        # the checkpoint's generation_config.json under the conf defaults, as the job applies it (vLLM's default)
        cfg.sampling = agreed(lambda: checkpoint_sampling(cfg, _explicit_sampling(engine_keys), "LLM(sampling=...)"))
        if cfg.cpu_threads is not None:  # null: the program that embeds the LLM owns its process's threads
            apply_cpu_threads(cfg, ranks)
        self._init(cfg, ranks)

    @classmethod
    def from_config(cls, cfg: EngineConfig, ranks: RankInfo, step_progress: StepProgress | None = None) -> LLM:
        """An LLM over a config already composed and agreed on, in a process group already made: the
        Hydra job's way in (its supervisor's watchdog reads `step_progress`). Collective."""
        llm = cls.__new__(cls)
        llm._owns_group = False
        llm._init(cfg, ranks, step_progress)
        return llm

    def _init(self, cfg: EngineConfig, ranks: RankInfo, step_progress: StepProgress | None = None) -> None:
        self._engine = engine = Engine(cfg, ranks, step_progress=step_progress)
        self.ranks: RankInfo = ranks
        # how many requests each data-parallel replica ran in the last generate/chat call (index: replica)
        self.requests_per_replica: list[int] = []
        tokenizer_dir = engine.source.tokenizer_dir
        try:  # every replica's leader decodes its own outputs (a data-parallel job's replicas write their rows)
            self.tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir and engine.replica.is_leader else None
        except BaseException:
            engine.close()
            raise
        # structured outputs: grammars over the tokenizer's vocabulary (read at the first structured request)
        self._grammars = (GrammarCompilerPool(self.tokenizer, engine.shape.vocab_size, engine.shape.eos_token_ids)
                          if self.tokenizer is not None else None)
        if self._grammars is not None:
            warm_up_mask_kernel(engine.shape.vocab_size, engine.device)  # nothing compiles mid-job

    @property
    def engine(self) -> Engine:
        """The engine under this LLM, for what a job reports about it (`shape`, `replica`, `kv_capacity`,
        `max_model_len`, `last_run`, ...); generate through the LLM's methods, not the engine's."""
        return self._engine

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[GenerationOutput]:
        """Complete each prompt (text as given, no chat template); one output per prompt, in order.

        `sampling_params`: one for all prompts, one per prompt, or None for conf's `sampling` defaults.
        A request that cannot run (empty, too long, ids outside the vocabulary, bad sampling values)
        comes back with finish_reason "error" and a one-line `error`; the others still run.
        """
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        requests = [self._request(i, p, _params_at(sampling_params, i, len(prompts))) for i, p in enumerate(prompts)]
        return self._run(requests, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[GenerationOutput]:
        """Like `generate`, for conversations: each one rendered by the tokenizer's chat template
        with the assistant's generation prompt appended."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        requests = []
        for i, conversation in enumerate(conversations):
            params = _params_at(sampling_params, i, len(conversations))
            requests.append(self._chat_request(i, conversation, params))
        return self._run(requests, use_tqdm)

    def stream(self, requests: Iterable[PromptRequest] | PolledRequests,
               on_finish: Callable[[RequestOutput], None] | None = None, keep_outputs: bool = True,
               progress: bool = False) -> list[RequestOutput]:
        """Run already-tokenized requests, handing each finished one to `on_finish` as it finishes:
        `generate` and `chat` run through it, and so does the Hydra job (`run.py`).

        Why it exists beside `generate` (vLLM has no such call): an offline job of any size. `requests`
        is pulled lazily, only as the batch has room, so a generator may read and tokenize a file as it
        goes, or wait for work handed to this replica; each finished request (text decoded with this
        LLM's tokenizer, if it has one) goes to `on_finish` at once, e.g. a row of outputs.jsonl; with
        `keep_outputs=False` nothing is kept, so memory holds only the requests in flight, and the call
        returns []. Otherwise the replica's leader returns one engine `RequestOutput` per request, in
        submission order. Collective over the replica: its other ranks pass anything (they follow
        the leader's plans) and get []. Nothing is broadcast: `generate` does that for its outputs.
        """
        decode = (lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)) if self.tokenizer else None
        return self._engine.generate(requests, on_finish=on_finish, decode=decode, progress=progress,
                                     keep_outputs=keep_outputs, grammars=self._grammars)

    def close(self) -> None:
        """Free the model, the KV cache and the CUDA graphs, and the process group if this LLM made it
        (collective: a process that exits with a live gloo/NCCL group may abort at interpreter exit)."""
        self._engine.close()
        if getattr(self, "_grammars", None) is not None:
            self._grammars.close()
        if self._owns_group:
            destroy_process_group()
            self._owns_group = False

    # --- RL loops: new weights in place, device memory handed back between rounds --------------
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load (HF checkpoint name, full tensor) pairs into the running engine, in place: each rank keeps its
        TP shard, cast to the engine's dtype, as at start-up; any subset of the checkpoint's tensors. The CUDA
        graphs stay valid; the prefix cache is reset. A name or shape that does not match raises a one-line
        ConfigError before anything is copied. Collective: every rank passes the same names."""
        self._engine.update_weights(named_tensors)

    def update_weights_from_path(self, path: str | Path) -> None:
        """`update_weights` with the tensors of a safetensors checkpoint directory. Collective."""
        self._engine.update_weights_from_path(path)

    def sleep(self, level: int = 1) -> None:
        """Hand the device memory back until `wake_up`: level 1 frees the KV cache, level 2 also moves the
        weights to host memory. generate raises while asleep; update_weights works. Collective."""
        self._engine.sleep(level)

    def wake_up(self) -> None:
        """Weights and KV cache back on the device (CUDA graphs captured again where an address moved), the
        prefix cache reset. Collective."""
        self._engine.wake_up()

    # --- rank 0 builds the requests; every rank runs them ------------------------------------
    def _request(self, index: int, prompt: Prompt, params: SamplingParams | None) -> PromptRequest:
        request = PromptRequest(index, None, None, _overrides(params))
        if not self.ranks.is_first:
            return request  # only rank 0's requests are read
        if isinstance(prompt, dict) and prompt.get("prompt_token_ids") is not None:
            request.prompt, request.prompt_token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return request
        request.prompt = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(request.prompt, str):
            request.error = "a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}"
        elif self.tokenizer is None:
            request.error = "prompt text given but the checkpoint has no tokenizer; pass prompt_token_ids"
        else:
            request.prompt_token_ids = list(self.tokenizer.encode(request.prompt))
        return request

    def _chat_request(self, index: int, conversation: list[Message], params: SamplingParams | None) -> PromptRequest:
        request = PromptRequest(index, None, None, _overrides(params))
        if not self.ranks.is_first:
            return request
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            request.error = "chat needs a tokenizer with a chat template"
            return request
        request.prompt = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        # the rendered template holds the special tokens already
        request.prompt_token_ids = list(self.tokenizer.encode(request.prompt, add_special_tokens=False))
        return request

    def _run(self, requests: list[PromptRequest], use_tqdm: bool) -> list[GenerationOutput]:
        """Rank 0's `requests` handed out over the replicas; every rank returns every output, in order."""
        results, self.requests_per_replica = generate_on_replicas(
            self.stream, self._engine, requests, use_tqdm,
            GenerationOutput.from_engine)
        return results


def _explicit_sampling(engine_keys: dict[str, Any]) -> set[str]:
    """The sampling keys `LLM(sampling=...)` sets: they win over the checkpoint's generation_config.json."""
    given = engine_keys.get("sampling")
    return set(given) if isinstance(given, dict) else set()


def _overrides(params: SamplingParams | None) -> dict[str, Any]:
    """A request's sampling as the engine takes it: every field of `params`, or none (conf's defaults)."""
    return dataclasses.asdict(params) if params is not None else {}


def _params_at(params: SamplingParams | list[SamplingParams] | None, index: int, count: int) -> SamplingParams | None:
    if not isinstance(params, list):
        return params
    if len(params) != count:
        raise ConfigError(f"sampling_params has {len(params)} entries for {count} prompts")
    return params[index]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
