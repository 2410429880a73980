"""One Hydra job on one rank: config -> engine -> requests -> generate -> outputs and metrics.

Rank 0 alone reads prompts, tokenizes and writes files; user errors end every rank with one
line on rank 0 (exit code 2), and inside a multirun they mark the job failed and the sweep goes on.
Any other failure of a distributed job goes to the Supervisor, which stops every rank and has one
of them say why.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from spmd_engine.config import ConfigError, EngineConfig, engine_config_from_dict, startup_settings
from spmd_engine.distributed import RankInfo, all_reduce_min, init_process_group
from spmd_engine.engine import Engine, agreed
from spmd_engine.faults.error_line import error_line, report_error, write_error_file
from spmd_engine.job.metrics import summarize, write_metrics
from spmd_engine.job.outputs import OutputsWriter, RequestOutput, read_outputs, resume_mismatch
from spmd_engine.faults.preflight import check_prompts_file
from spmd_engine.job.run_dir import RunDirLock, RunDirRefused, claim_run_dir
from spmd_engine.faults.supervisor import Supervisor
from spmd_engine.job.workloads import build_requests, run_bench_warmup

log = logging.getLogger("spmd_engine")
EXIT_USER_ERROR = 2


def setup_logging(ranks: RankInfo, level: str) -> None:
    """Rank 0 logs at `level`; other ranks only WARNING and above, prefixed with their rank."""
    root = logging.getLogger()
    prefix = "" if ranks.is_first else f"[rank{ranks.rank}] "
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(f"{prefix}[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    root.setLevel(getattr(logging, str(level).upper(), logging.INFO) if ranks.is_first else logging.WARNING)


def run_job(raw_cfg: dict[str, Any], overrides: list[str], ranks: RankInfo, output_dir: Path | None,
            multirun: bool, supervisor: Supervisor | None = None) -> dict | None:
    """Returns the metrics dict on rank 0 (None elsewhere); raises SystemExit on user errors.

    `supervisor` (one per process; run.py's has the signal handlers) watches the steps; in a
    distributed job any error other than a user error ends the process through it.
    """
    setup_logging(ranks, raw_cfg.get("log_level", "INFO"))
    supervisor = supervisor or Supervisor(ranks)
    started = time.time()
    metrics: dict[str, Any] = {"overrides": overrides, "status": "failed", "world_size": ranks.world_size}
    llm: Engine | None = None
    run_dir_lock: RunDirLock | None = None
    refused: list[str] = []  # rank 0's run dir was refused: write nothing into it (metrics.json neither)
    try:
        # the ranks meet first, then agree on the config: a bad key ends them together (after rank 0's files)
        startup = startup_settings(raw_cfg)
        init_process_group(ranks, startup.device != "cpu" and torch.cuda.is_available(), startup.timeout_s,
                           startup.rendezvous_timeout_s)
        supervisor.attach(startup.dist_timeout_s)
        cfg = agreed(lambda: engine_config_from_dict(raw_cfg))
        run_dir_lock = agreed(lambda: _start_checks(cfg, output_dir, refused) if ranks.is_first else None)
        llm = Engine(cfg, ranks, step_progress=supervisor.progress)
        metrics.update(_generate(llm, cfg, ranks, output_dir, supervisor, overrides))
        metrics["status"] = "ok"
    except ConfigError as exc:  # every rank raises it (engine.agreed) or none does
        supervisor.detach()
        if isinstance(exc, RunDirRefused):
            refused.append(str(exc))
        metrics["error"] = str(exc)
        if ranks.is_first:
            report_error(str(exc))
        else:
            write_error_file(error_line(str(exc)))  # torchrun's summary: every rank's entry says why
        if not multirun:
            _write(metrics, raw_cfg, ranks, None if refused else output_dir, started)
            if ranks.world_size > 1:
                if run_dir_lock is not None:
                    run_dir_lock.release()
                _leave_together(supervisor, EXIT_USER_ERROR)
            raise SystemExit(EXIT_USER_ERROR)
    except Exception as exc:
        if ranks.world_size > 1:
            supervisor.fail(exc)  # ends this process; the others follow within seconds
        raise
    finally:
        supervisor.detach()
        if llm is not None:
            llm.close()
        if run_dir_lock is not None:
            run_dir_lock.release()
    _write(metrics, raw_cfg, ranks, None if refused else output_dir, started)
    return metrics if ranks.is_first else None


def _leave_together(supervisor: Supervisor, code: int) -> None:
    """Every rank agreed on a user error: leave together, after rank 0 wrote its files, with `code`.

    Why os._exit right after the collective: torchrun SIGTERMs the ranks still running as soon as one
    has exited, and a rank still in Python's shutdown (whose signal handlers are back to the default by
    then) would die of it, so its summary showed -15 instead of 2. Leaving the collective together and
    exiting at once, with the handler that maps a late SIGTERM to `code` still in place, keeps 2 on
    every rank. Nothing is left to clean up: the files are written and the OS drops the rest."""
    supervisor.leaving(code)
    all_reduce_min(0)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _start_checks(cfg: EngineConfig, output_dir: Path | None, refused: list[str]) -> RunDirLock | None:
    """Rank 0's start-up checks (inside `agreed`): the prompts file is there, the run dir is writable,
    no other job writes it, and a rerun without resume=true would not drop finished rows."""
    check_prompts_file(cfg.prompts_file)
    if output_dir is None:
        return None
    try:
        return claim_run_dir(output_dir, cfg.resume)
    except ConfigError as exc:
        refused.append(str(exc))
        raise


def _write(metrics: dict, raw_cfg: dict, ranks: RankInfo, output_dir: Path | None, started: float) -> None:
    if ranks.is_first and output_dir is not None:
        metrics.setdefault("config", {k: v for k, v in raw_cfg.items() if k != "hydra"})
        metrics["job_time_s"] = time.time() - started
        if torch.cuda.is_available():
            metrics["peak_gpu_memory_gib"] = torch.cuda.max_memory_reserved() / (1 << 30)
        write_metrics(output_dir / "metrics.json", metrics)


def _generate(llm: Engine, cfg: EngineConfig, ranks: RankInfo, output_dir: Path | None,
              supervisor: Supervisor, overrides: list[str] | None = None) -> dict:
    from spmd_engine.job.generation_defaults import apply_generation_config, explicit_sampling_keys
    # the checkpoint's generation_config.json under the command line's sampling.* keys (every rank alike)
    cfg.sampling = agreed(lambda: apply_generation_config(cfg.sampling, llm.source.checkpoint_dir,
                                                          explicit_sampling_keys(overrides or [])))
    gate = supervisor.start_gate()
    llm.faults.before_requests()
    if not ranks.is_first:
        refusal = gate.wait() if gate is not None else None  # rank 0 reads and tokenizes first
        if refusal is not None:
            raise ConfigError(refusal)  # rank 0 refused the requests (a user error): leave with it
        if cfg.workload.name == "bench" and cfg.workload.params.get("warmup", True):
            llm.generate([])
        llm.generate([])
        return {}
    from spmd_engine.job.prompts import load_tokenizer
    tokenizer = load_tokenizer(llm.source.tokenizer_dir) if llm.source.tokenizer_dir else None
    requests = build_requests(cfg, tokenizer, llm.shape.vocab_size)
    sampling = {r.index: {**vars(cfg.sampling), **r.overrides} for r in requests}
    done: list[dict] = []
    outputs_path = output_dir / "outputs.jsonl" if output_dir else None
    if cfg.resume and outputs_path is not None:
        done = read_outputs(outputs_path)
        mismatch = resume_mismatch(done, requests, sampling.get)
        if mismatch is not None:
            error = RunDirRefused(f"resume=true: {mismatch}; the prompts or sampling changed since that run, so its "
                                "rows can't stand in for this job's: use another hydra.run.dir")
            if gate is not None:
                gate.refuse(str(error))
            raise error
        finished = {row["index"] for row in done}
        requests = [r for r in requests if r.index not in finished]
        log.info("resume: %d requests already in %s, %d to run", len(finished), outputs_path, len(requests))
    final_form = None
    if cfg.output_format == "openai":
        from spmd_engine.job.openai_batch import batch_output
        kinds = {r.index: r.api for r in requests}
        final_form = lambda row: batch_output(row, kinds.get(row["index"]), cfg.model.name)  # noqa: E731
    writer = (OutputsWriter(outputs_path, keep=done, sampling_of=sampling.get, final_form=final_form)
              if outputs_path else None)
    if gate is not None:
        gate.open()  # everything slow on rank 0 alone is done: the plans follow
    if cfg.workload.name == "bench" and cfg.workload.params.get("warmup", True):
        run_bench_warmup(llm)
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else None
    token_text = (lambda token: tokenizer.decode([token])) if tokenizer else None  # logprobs' alternatives
    t0 = time.perf_counter()
    try:
        with supervisor.before_exit(writer.quiesce if writer else lambda: None):
            outputs = llm.generate(requests, on_finish=writer.write if writer else None, decode=decode,
                                   progress=len(requests) > 1, token_text=token_text)
    finally:
        if writer is not None:
            writer.close()
    wall = time.perf_counter() - t0
    if writer is not None:
        writer.finalize()
    if cfg.workload.name == "chat":
        _print_completions(outputs)
    stats = summarize(outputs, wall)
    log.info("%d requests, %d prompt + %d output tokens in %.2f s: %.1f output tok/s, TTFT p50 %.1f ms, "
             "ITL p50 %.2f ms", stats["num_requests"], stats["prompt_tokens"], stats["output_tokens"], wall,
             stats["output_tokens_per_s"], stats["ttft"].get("p50_ms", 0.0), stats["itl"].get("p50_ms", 0.0))
    stats["kv_capacity"] = llm.kv_capacity.as_dict()
    stats["max_model_len"] = llm.max_model_len
    stats["engine"] = llm.last_run  # steps, decode steps, preemptions, prefix-cache tokens, step timing
    if cfg.workload.name == "bench":
        from spmd_engine.job.bench_report import bench_report
        stats["bench"] = bench_report(llm, outputs, wall)
    return stats


def _print_completions(outputs: list[RequestOutput]) -> None:
    for out in outputs:
        shown = out.prompt if out.prompt is not None else f"<{len(out.prompt_token_ids or [])} prompt tokens>"
        print(f"\n### prompt {out.index}: {shown}")
        if out.error:
            print(f"!!! error: {out.error}")
        else:
            body = out.text if out.text is not None else str(out.token_ids)
            print(f">>> {body}  [{out.finish_reason}, {len(out.token_ids)} tokens]")
    sys.stdout.flush()
