"""One Hydra job on one rank: config -> `LLM` (the public API, over the engine) -> requests streamed
through `LLM.stream` -> outputs and metrics.

Rank 0 alone reads prompts, tokenizes and writes files; user errors end every rank with one
line on rank 0 (exit code 2), and inside a multirun they mark the job failed and the sweep goes on.
Any other failure of a distributed job goes to the Supervisor, which stops every rank and has one
of them say why.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from spmd_engine.config import ConfigError, EngineConfig, engine_config_from_dict, startup_settings
from spmd_engine.distributed import RankInfo, all_reduce_min, init_process_group
from spmd_engine.engine import agreed
from spmd_engine.faults.error_line import error_line, report_error, write_error_file
from spmd_engine.faults.injection import FaultInjector
from spmd_engine.cpu_threads import apply_cpu_threads
from spmd_engine.job.dispatch import DISPATCH_POLL_S, ChunkBoard, ClaimedRequests, Dispatcher, RowPoster
from spmd_engine.job.feed import RequestFeed, chunk_size, source_requests
from spmd_engine.job.generation_defaults import job_sampling
from spmd_engine.job.metrics import RunningStats, replicas_engine, write_metrics
from spmd_engine.job.outputs import OutputsWriter, RequestOutput, read_outputs
from spmd_engine.job.resumed_metrics import earlier_runs, with_earlier_runs
from spmd_engine.faults.preflight import check_prompts_file
from spmd_engine.job.run_dir import RunDirLock, RunDirRefused, claim_run_dir
from spmd_engine.faults.supervisor import Supervisor
from spmd_engine.job.workloads import run_bench_warmup
from spmd_engine.llm import LLM

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
    record = _JobRecord(raw_cfg, ranks, output_dir,
                        {"overrides": overrides, "status": "failed", "world_size": ranks.world_size})
    llm: LLM | None = None
    run_dir_lock: RunDirLock | None = None
    try:
        cfg, faults = _join(raw_cfg, ranks, supervisor)
        run_dir_lock = agreed(lambda: _start_checks(cfg, output_dir, record.refused) if ranks.is_first else None)
        with supervisor.before_exit(lambda: record.stopped(run_dir_lock)):  # a signal or fault ends the process
            cfg.sampling = agreed(lambda: job_sampling(cfg, overrides))  # every rank alike, before the engine
            llm = LLM.from_config(cfg, ranks, step_progress=supervisor.progress)
            faults.install(llm.engine.runner)  # test-only: a configured step fault wraps the runner's launch
            record.metrics.update(_generate(llm, cfg, ranks, output_dir, supervisor, faults, record))
        record.metrics["status"] = "ok"
    except ConfigError as exc:  # every rank raises it (engine.agreed) or none does
        supervisor.detach()
        record.user_error(exc)
        if not multirun:
            record.write()
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
    record.write()
    if ranks.is_first and output_dir is not None and not record.refused:
        print(f"outputs: {output_dir / 'outputs.jsonl'} (metrics: {output_dir / 'metrics.json'})", flush=True)
    return record.metrics if ranks.is_first else None


def _join(raw_cfg: dict[str, Any], ranks: RankInfo, supervisor: Supervisor) -> tuple[EngineConfig, FaultInjector]:
    """The ranks meet first, then agree on the config: a bad key ends them together (after rank 0's files).

    `+fault.*` (test-only fault injection) is the job's, not an engine key: it becomes this rank's injector."""
    startup = startup_settings(raw_cfg)
    init_process_group(ranks, startup.device != "cpu" and torch.cuda.is_available(), startup.timeout_s,
                       startup.rendezvous_timeout_s)
    supervisor.attach(startup.dist_timeout_s)
    engine_keys = {key: value for key, value in raw_cfg.items() if key != "fault"}
    cfg = agreed(lambda: engine_config_from_dict(engine_keys))
    faults = agreed(lambda: FaultInjector.from_config(raw_cfg.get("fault"), ranks.rank))
    apply_cpu_threads(cfg, ranks)
    return cfg, faults


@dataclass
class _JobRecord:
    """What rank 0 writes to metrics.json at the end of a job, ok or not, and whether it may."""

    raw_cfg: dict[str, Any]
    ranks: RankInfo
    output_dir: Path | None
    metrics: dict[str, Any]
    started: float = field(default_factory=time.time)
    refused: list[str] = field(default_factory=list)  # the run dir was refused: write nothing into it
    # while requests run (rank 0): hold the outputs file still, and the figures so far
    quiesce: Callable[[], None] = lambda: None
    so_far: Callable[[], dict] = dict
    previous_runs: list[dict] | None = None  # resume=true: the earlier metrics.json's runs, read before replacing it

    def user_error(self, exc: ConfigError) -> None:
        """Record a user error and say it: one line on rank 0, each other rank's error file for torchrun."""
        if isinstance(exc, RunDirRefused):
            self.refused.append(str(exc))
        self.metrics["error"] = str(exc)
        if self.ranks.is_first:
            report_error(str(exc))
        else:
            write_error_file(error_line(str(exc)))  # torchrun's summary: every rank's entry says why

    def stopped(self, lock: RunDirLock | None) -> None:
        """The process is being ended (a stop signal, a fault, the watchdog): let the row being written
        finish, write metrics.json with the figures so far (status stopped) and drop the run dir's lock
        file, so nothing stale is left for the resume."""
        self.quiesce()
        self.metrics.update(self.so_far())
        self.metrics["status"] = "stopped"
        self.metrics.setdefault("error", "stopped before the end (a stop signal or a fault: the job's error line "
                                         "says which); the figures cover the requests finished by then")
        self.write()
        if lock is not None:
            lock.release()

    def write(self) -> None:
        """Rank 0's metrics.json; nothing on other ranks, without a run dir, or into a refused one."""
        if not self.ranks.is_first or self.output_dir is None or self.refused:
            return
        self.metrics.setdefault("config", {k: v for k, v in self.raw_cfg.items() if k != "hydra"})
        self.metrics["job_time_s"] = time.time() - self.started
        if torch.cuda.is_available():
            self.metrics["peak_gpu_memory_gib"] = torch.cuda.max_memory_reserved() / (1 << 30)
        path = self.output_dir / "metrics.json"
        if self.raw_cfg.get("resume") is True:
            if self.previous_runs is None:
                self.previous_runs = earlier_runs(path)
            write_metrics(path, with_earlier_runs(self.metrics, self.previous_runs))
            return
        write_metrics(path, self.metrics)


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


PRINT_LIMIT = 64  # a chat job of at most this many requests prints its completions at the end


@dataclass
class _RowSink:
    """Rank 0: every finished request of every replica lands here once: outputs.jsonl, the progress
    bar (done of total, with an ETA) and, for a small chat job, the completions printed at the end."""

    writer: OutputsWriter | None
    bar: Any
    shown: list[dict] | None
    located: Callable[[dict], dict] = lambda row: row  # the row with its error naming the request's line
    stats: RunningStats = field(default_factory=RunningStats)  # rank 0's own replica
    lock: threading.Lock = field(default_factory=threading.Lock)
    rows: int = 0  # rows written, every replica's

    def output(self, out: RequestOutput) -> None:
        """One of rank 0's own replica's requests finished."""
        self.stats.add(out)
        self.row(out.to_json())

    def row(self, row: dict) -> None:
        row = self.located(row)
        with self.lock:
            if self.writer is not None:
                self.writer.write_row(row)
            if self.shown is not None:
                self.shown.append(row)
            self.rows += 1
            self.bar.update(1)


def _generate(llm: LLM, cfg: EngineConfig, ranks: RankInfo, output_dir: Path | None,
              supervisor: Supervisor, faults: FaultInjector, record: _JobRecord) -> dict:
    engine = llm.engine
    gate = supervisor.start_gate()
    faults.before_requests()
    board = _board(supervisor) if engine.replica.count > 1 else None
    # every replica's leader decodes its outputs with llm.tokenizer, loaded with the LLM: before the gate,
    # so all start claiming together
    if not ranks.is_first:
        refusal = gate.wait() if gate is not None else None  # rank 0 prepares the requests first
        if refusal is not None:
            raise ConfigError(refusal)  # rank 0 refused the requests (a user error): leave with it
        _serve_replica(llm, cfg, board)
        return {}
    feed, writer = _open_requests(llm, cfg, output_dir, gate)
    if gate is not None:
        gate.open()  # everything slow on rank 0 alone is done: the plans follow
    return _lead(llm, cfg, feed, writer, board, record)


def _board(supervisor: Supervisor) -> ChunkBoard:
    """This job's dispatch keys in the rendezvous store (apart from other jobs of a multirun, and restarts)."""
    return ChunkBoard(supervisor.board.store, f"spmd_engine/dp/{supervisor.ranks.restart_count}/{supervisor.jobs}")


def _serve_replica(llm: LLM, cfg: EngineConfig, board: ChunkBoard | None) -> None:
    """Every rank but 0: follow the replica's plans, or (a replica's leader) claim chunks, generate and
    post the rows to rank 0; with replicas, stay until rank 0 has every row (leaving early would look
    like a dead peer to the others' watchdogs)."""
    bench_warmup = cfg.workload.name == "bench" and cfg.workload.params.get("warmup", True)
    replica = llm.engine.replica
    if not replica.is_leader or board is None:
        if bench_warmup:
            llm.stream([])
        llm.stream([])
    else:
        if bench_warmup:
            run_bench_warmup(llm)
        claimed, poster = ClaimedRequests(board, replica.count), RowPoster(board, replica.index)
        bench = cfg.workload.name == "bench"  # the bench report's floor needs this replica's outputs
        t0 = time.perf_counter()
        outputs = llm.stream(claimed, on_finish=poster, keep_outputs=bench)
        busy = time.perf_counter() - t0 - claimed.waited_s
        work = None
        if bench:
            from spmd_engine.job.bench_report import bench_work
            work = bench_work(llm.engine, outputs)
        board.post_done(replica.index, poster.posted, poster.stats, busy, _engine_record(llm), work)
    if board is not None:
        _wait_for(board.is_finished, llm)


def _wait_for(done: Callable[[], bool], llm: LLM, check: Callable[[], None] = lambda: None) -> None:
    """Wait for the other replicas, watched like a plan wait: a dead or hung peer still ends the job."""
    progress = llm.engine.step_progress
    progress.wait_plan(first=False)
    while not done():
        check()
        time.sleep(DISPATCH_POLL_S)
    progress.idle()


def _open_requests(llm: LLM, cfg: EngineConfig, output_dir: Path | None,
                   gate) -> tuple[RequestFeed, OutputsWriter | None]:
    """Rank 0: the lazy request feed (a resumed job's finished indices checked and skipped) and the writer."""
    tokenizer, replicas = llm.tokenizer, llm.engine.replica.count
    has_tokenizer, vocab = tokenizer is not None, llm.engine.shape.vocab_size
    requests, total = source_requests(cfg, has_tokenizer, vocab)
    feed = RequestFeed(cfg, tokenizer, requests, total, chunk_size(total, replicas, cfg.max_num_seqs),
                       max_model_len=llm.engine.max_model_len)
    done: list[dict] = []
    outputs_path = output_dir / "outputs.jsonl" if output_dir else None
    if cfg.resume and outputs_path is not None:
        done = read_outputs(outputs_path)
        mismatch = feed.resume_from(done, source_requests(cfg, has_tokenizer, vocab)[0])
        if mismatch is not None:
            error = RunDirRefused(f"resume=true: {mismatch}; the prompts or sampling changed since that run, so its "
                                  "rows can't stand in for this job's: use another hydra.run.dir")
            if gate is not None:
                gate.refuse(str(error))
            raise error
        log.info("resume: %d requests already in %s, %d to run", len(feed.finished), outputs_path, feed.remaining)
    log.info("%d requests, read and tokenized %d at a time as %s", feed.remaining, feed.chunk_size,
             "the batch has room" if replicas == 1 else f"{replicas} replicas ask for them")
    final_form = None
    if cfg.output_format == "openai":
        from spmd_engine.job.openai_batch import batch_output
        final_form = lambda rows: batch_output(rows, feed.kinds.get(rows[0]["index"]), cfg.model.name)  # noqa: E731
    writer = (OutputsWriter(outputs_path, keep=done, sampling_of=feed.sampling_of, final_form=final_form)
              if outputs_path else None)
    return feed, writer


def _lead(llm: LLM, cfg: EngineConfig, feed: RequestFeed, writer: OutputsWriter | None,
          board: ChunkBoard | None, record: _JobRecord) -> dict:
    """Rank 0: hand out the requests (to the other replicas too), run replica 0's share, write every row."""
    if cfg.workload.name == "bench" and cfg.workload.params.get("warmup", True):
        run_bench_warmup(llm)
    sink = _RowSink(writer, _progress_bar(feed.remaining),
                    [] if cfg.workload.name == "chat" and feed.remaining <= PRINT_LIMIT else None, feed.located)
    replicas = llm.engine.replica.count
    dispatcher = Dispatcher(board, feed.chunks(), replicas, sink.row) if board is not None else None
    requests = ClaimedRequests(board, replicas, dispatcher.check) if dispatcher is not None else feed
    keep = cfg.workload.name == "bench"  # the bench report reads the outputs; a chat job keeps none
    t0 = time.perf_counter()
    record.quiesce = lambda: _quiesce(dispatcher, writer)  # the process is being stopped: see _JobRecord.stopped
    record.so_far = lambda: {**sink.stats.summary(time.perf_counter() - t0), "rows_written": sink.rows,
                             "figures": "rank 0's replica's finished requests (rows_written: every replica's)"}
    try:
        if dispatcher is not None:
            dispatcher.start()
        outputs = llm.stream(requests, on_finish=sink.output, keep_outputs=keep)
        busy = time.perf_counter() - t0 - getattr(requests, "waited_s", 0.0)
        if dispatcher is not None:
            _wait_for(dispatcher.all_done, llm, dispatcher.check)
            dispatcher.stop()
            dispatcher.check()
    finally:
        record.quiesce, record.so_far = (lambda: None), dict
        if dispatcher is not None:
            dispatcher.stop()
        sink.bar.close()
        if writer is not None:
            writer.close()
    wall = time.perf_counter() - t0
    if board is not None:
        board.finish()  # every row is appended to outputs.jsonl: the other ranks may leave (not watched after)
    if writer is not None:
        writer.finalize()
    if sink.shown is not None:
        _print_completions(sorted(sink.shown, key=lambda row: row["index"]))
    return _job_stats(llm, cfg, sink, dispatcher, busy, wall, outputs)


def _quiesce(dispatcher: Dispatcher | None, writer: OutputsWriter | None) -> None:
    """The process is being stopped: write the rows other replicas already posted, then hold the file."""
    if dispatcher is not None:
        dispatcher.drain()
    if writer is not None:
        writer.quiesce()


def _engine_record(llm: LLM) -> dict:
    """A replica leader's engine figures for metrics.json: its last generate call's and its KV pool."""
    return {**llm.engine.last_run, "kv_capacity": llm.engine.kv_capacity.as_dict()}


def _job_stats(llm: LLM, cfg: EngineConfig, sink: _RowSink, dispatcher: Dispatcher | None, busy: float,
               wall: float, outputs: list[RequestOutput]) -> dict:
    """metrics.json's job part: totals over every replica (requests, tokens, throughput, busy time, engine
    steps), and each replica's share (`replicas`, `engine.per_replica`)."""
    total = RunningStats()
    total.merge(vars(sink.stats))
    engine = llm.engine
    replicas = [_replica_row(0, vars(sink.stats), busy, engine.last_run)]
    runs = [engine.last_run if dispatcher is None else _engine_record(llm)]
    reports = sorted((dispatcher.reports if dispatcher is not None else {}).items())
    for replica, report in reports:
        total.merge(report["stats"])
        replicas.append(_replica_row(replica, report["stats"], report["busy_s"], report["engine"]))
        runs.append(report["engine"])
    stats = total.summary(wall)
    world_size = engine.replica.count * engine.replica.tp_size
    stats["output_tokens_per_s_per_gpu"] = stats["output_tokens_per_s"] / world_size
    log.info("%d requests, %d prompt + %d output tokens in %.2f s: %.1f output tok/s (%.1f per GPU), TTFT p50 "
             "%.1f ms, ITL p50 %.2f ms", stats["num_requests"], stats["prompt_tokens"], stats["output_tokens"], wall,
             stats["output_tokens_per_s"], stats["output_tokens_per_s_per_gpu"], stats["ttft"].get("p50_ms", 0.0),
             stats["itl"].get("p50_ms", 0.0))
    stats["data_parallel_size"], stats["tensor_parallel_size"] = engine.replica.count, engine.replica.tp_size
    stats["busy_s"] = sum(row["busy_s"] for row in replicas)  # summed over replicas (replica-seconds)
    stats["replicas"] = replicas
    stats["kv_capacity"] = engine.kv_capacity.as_dict()  # per rank (rank 0's; every replica's in engine.per_replica)
    stats["max_model_len"] = engine.max_model_len
    # steps, decode steps, preemptions, prefix-cache tokens, step timing: the one replica's, or summed / merged
    # over the replicas with each one's own in engine.per_replica
    stats["engine"] = replicas_engine(runs)
    stats["tp_allreduce"] = engine.tp_allreduce_info  # replica 0's: nccl | symm_mem | gloo | none, and why
    if cfg.workload.name == "bench":
        from spmd_engine.job.bench_report import bench_report, bench_work
        works = [bench_work(engine, outputs)] + [report["bench"] for _, report in reports]
        stats["bench"] = bench_report(engine, works, stats["engine"], wall, stats["output_tokens"], world_size)
    return stats


def _replica_row(replica: int, stats: dict, busy_s: float, engine: dict) -> dict:
    return {"replica": replica, "requests": stats["num_requests"], "errors": stats["num_errors"],
            "prompt_tokens": stats["prompt_tokens"], "output_tokens": stats["output_tokens"], "busy_s": busy_s,
            "steps": engine.get("steps", 0)}


def _progress_bar(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", unit="req", disable=total < 2, dynamic_ncols=True)


def _print_completions(rows: list[dict]) -> None:
    for row in rows:
        ids = row.get("prompt_token_ids") or []
        shown = row["prompt"] if row.get("prompt") is not None else f"<{row.get('prompt_num_tokens', len(ids))} " \
                                                                    f"prompt tokens>"
        print(f"\n### prompt {row['index']}: {shown}")
        if row.get("error"):
            print(f"!!! error: {row['error']}")
        else:
            body = row["text"] if row.get("text") is not None else str(row["token_ids"])
            print(f">>> {body}  [{row['finish_reason']}, {len(row['token_ids'])} tokens]")
    sys.stdout.flush()
