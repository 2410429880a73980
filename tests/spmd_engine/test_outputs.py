import json

from spmd_engine.job.metrics import summarize
from spmd_engine.job.outputs import OutputsWriter, RequestOutput, read_outputs


def out(i, n=3, reason="length"):
    return RequestOutput(i, f"p{i}", [1, 2], f"t{i}", list(range(n)), reason, None,
                         first_token_time=0.1 * (i + 1), token_times=[0.1 * (i + 1) + 0.01 * k for k in range(n)])


def test_lines_are_flushed_as_requests_finish_then_sorted(tmp_path):
    path = tmp_path / "outputs.jsonl"
    writer = OutputsWriter(path)
    for i in (2, 0, 1):
        writer.write(out(i))
        assert len(path.read_text().splitlines()) == [2, 0, 1].index(i) + 1  # on disk already
    writer.finalize()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) == {"index", "prompt", "prompt_token_ids", "text", "token_ids", "finish_reason", "error"}


def test_torn_last_line_is_ignored(tmp_path):
    path = tmp_path / "outputs.jsonl"
    path.write_text(json.dumps(out(0).to_json()) + "\n" + '{"index": 1, "pro')
    assert [r["index"] for r in read_outputs(path)] == [0]


def test_summary_counts_and_latencies():
    outs = [out(0, 4), out(1, 2), RequestOutput(2, "x", None, None, [], "error", "bad")]
    s = summarize(outs, wall_time_s=2.0)
    assert s["output_tokens"] == 6 and s["prompt_tokens"] == 4 and s["num_errors"] == 1
    assert s["output_tokens_per_s"] == 3.0
    assert s["itl"]["count"] == 4 and abs(s["itl"]["p50_ms"] - 10.0) < 1e-6
    assert s["ttft"]["count"] == 2


def test_an_error_row_echoes_a_capped_prompt_not_the_whole_input(tmp_path):
    from spmd_engine.job.outputs import ERROR_ECHO_CHARS, ERROR_ECHO_TOKENS

    text, ids = "x" * 5_000_000, list(range(1_300_000))  # a 5 MB line that tokenized to 1.3 M ids
    failed = RequestOutput(3, text, ids, None, [], "error", "prompt has 1300000 tokens; max_model_len=4096 "
                                                             "allows at most 4095")
    path = tmp_path / "outputs.jsonl"
    writer = OutputsWriter(path)
    writer.write(failed)
    writer.write(RequestOutput(4, "short", [1, 2], None, [], "error", "e" * 50_000))
    writer.finalize()
    assert path.stat().st_size < 5_000
    big, small = read_outputs(path)
    assert big["prompt"] == text[:ERROR_ECHO_CHARS] and big["prompt_chars"] == len(text)
    assert big["prompt_token_ids"] == ids[:ERROR_ECHO_TOKENS] and big["prompt_num_tokens"] == len(ids)
    assert big["error"] == failed.error and len(small["error"]) < 1_100
    assert small["prompt"] == "short" and small["prompt_token_ids"] == [1, 2] and "prompt_chars" not in small
    done = out(5, n=2)  # finished rows keep their whole prompt
    done.prompt = text[:1000]
    assert done.to_json()["prompt"] == text[:1000]


def test_a_row_that_cannot_be_utf8_is_written_escaped(tmp_path):
    path = tmp_path / "outputs.jsonl"
    writer = OutputsWriter(path)
    writer.write(RequestOutput(0, "a \ud800", None, None, [], "error", "bad"))  # would raise UnicodeEncodeError
    writer.write(out(1))
    writer.finalize()
    assert [r["index"] for r in read_outputs(path)] == [0, 1]


def test_resume_mismatch_names_the_first_row_that_is_not_its_request():
    from spmd_engine.job.outputs import resume_mismatch
    from spmd_engine.job.prompts import PromptRequest

    sampling = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 4}
    long_text = "y" * 1000
    requests = [PromptRequest(0, "hello", [1, 2], {}), PromptRequest(1, None, [7, 8], {}),
                PromptRequest(2, long_text, list(range(500)), {}), PromptRequest(3, None, None, {}, "bad line")]
    same = {i: dict(sampling) for i in range(4)}

    def row(request, error=False):
        output = RequestOutput(request.index, request.prompt, request.prompt_token_ids, None, [],
                               "error" if error else "length", "e" if error else None)
        return {**output.to_json(), "sampling": dict(sampling)}

    rows = [row(requests[0]), row(requests[1]), row(requests[2], error=True), row(requests[3], error=True)]
    assert resume_mismatch(rows, requests, same.get) is None  # capped error echoes still match their request
    assert resume_mismatch([{k: v for k, v in r.items() if k != "sampling"} for r in rows], requests,
                           same.get) is None  # rows written before `sampling` existed: prompts only
    other = [PromptRequest(0, "hello", [1, 2], {}), PromptRequest(1, None, [7, 9], {}),
             PromptRequest(2, long_text + "!", None, {}), requests[3]]
    assert resume_mismatch(rows, other, same.get) == (
        "outputs.jsonl row 1 is not this job's request 1: prompt_token_ids differ: kept [7, 8], now [7, 9]")
    why = resume_mismatch(rows[2:], other, same.get)
    assert why.startswith("outputs.jsonl row 2 is not this job's request 2: prompt differs: kept 'yyy")
    hotter = {**same, 0: {**sampling, "temperature": 0.7}}
    assert resume_mismatch(rows, requests, hotter.get) == (
        "outputs.jsonl row 0 is not this job's request 0: sampling.temperature differs: kept 0.0, now 0.7")
    assert resume_mismatch(rows, requests[:2], same.get) == (
        "outputs.jsonl row 2 has no request in this job (2 requests)")


def test_replicas_stats_merge_into_the_one_jobs_summary():
    """Each replica gathers its RunningStats one output at a time; rank 0 merges them: the totals and
    the latency samples equal one summary over all the outputs."""
    from spmd_engine.job.metrics import RunningStats, _sample_into

    outs = [out(0, 4), out(1, 2), RequestOutput(2, "x", None, None, [], "error", "bad"), out(3, 5)]
    parts = [RunningStats(), RunningStats()]
    for i, o in enumerate(outs):
        parts[i % 2].add(o)
    merged = RunningStats()
    for part in parts:
        merged.merge(vars(part))
    whole, summed = summarize(outs, 2.0), merged.summary(2.0)
    assert {k: v for k, v in summed.items() if k not in ("ttft", "itl")} == \
        {k: v for k, v in whole.items() if k not in ("ttft", "itl")}
    assert summed["itl"]["count"] == whole["itl"]["count"] == 8 and summed["ttft"] == whole["ttft"]
    # past the cap a uniform sample is kept, and the count of values seen stays exact
    kept: list[float] = []
    assert _sample_into(kept, 0, [float(v) for v in range(1000)], cap=100) == 1000 and len(kept) == 100
    assert 300 < sum(kept) / len(kept) < 700  # drawn from the whole range, not its start


def test_finalize_sorts_a_file_with_duplicates_and_a_torn_line_row_by_row(tmp_path):
    path = tmp_path / "outputs.jsonl"
    writer = OutputsWriter(path)
    for i in (5, 3, 4, 3, 0):
        writer.write(out(i, n=i + 1))
    writer._file.write('{"index": 9, "tok')  # a torn line, as a crash leaves it
    writer._file.flush()
    writer.finalize()
    rows = read_outputs(path)
    assert [r["index"] for r in rows] == [0, 3, 4, 5] and [len(r["token_ids"]) for r in rows] == [1, 4, 5, 6]


def test_a_row_holds_the_written_fields_in_order_and_copies_of_the_outputs_lists():
    """`to_json` is built field by field (asdict's deep copy cost ~1 ms per request on rank 0's step path):
    the same keys in declaration order, optional fields only when set, the timing fields never, and
    lists the caller may change without touching the output."""
    logprobs = [{"token_id": 5, "logprob": -0.5, "top": [[5, -0.5]]}]
    done = RequestOutput(3, None, [1, 2], "ab", [5, 6], "stop", first_token_time=0.1, token_times=[0.1, 0.2],
                         num_cached_tokens=16, stop_reason=6, logprobs=logprobs)
    row = done.to_json()
    assert list(row) == ["index", "prompt", "prompt_token_ids", "text", "token_ids", "finish_reason", "error",
                         "stop_reason", "logprobs"]
    assert row["token_ids"] == [5, 6] and row["logprobs"] == logprobs and row["stop_reason"] == 6
    row["token_ids"].append(7)
    row["prompt_token_ids"].append(3)
    row["logprobs"][0]["top"].append([9, -9.0])
    assert done.token_ids == [5, 6] and done.prompt_token_ids == [1, 2] and done.logprobs[0]["top"] == [[5, -0.5]]
    assert "custom_id" not in out(0).to_json() and "prompt_logprobs" not in out(0).to_json()


def test_rows_are_readable_at_once_and_fsynced_off_the_writing_thread(tmp_path, monkeypatch):
    """The step loop only flushes a finished row (another reader sees it at once); the fsync runs on
    the writer's own thread, and close fsyncs what is left before the file goes."""
    import os
    import threading
    import time

    import spmd_engine.job.outputs as outputs

    synced_on: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(outputs.os, "fsync", lambda fd: (synced_on.append(threading.current_thread().name),
                                                         real_fsync(fd))[1])
    path = tmp_path / "outputs.jsonl"
    writer = OutputsWriter(path)
    writer.write(RequestOutput(3, "p", [1], "t", [2], "length"))
    assert [json.loads(line)["index"] for line in path.read_text().splitlines()] == [3]
    deadline = time.monotonic() + 5
    while not synced_on and time.monotonic() < deadline:
        time.sleep(0.01)
    assert synced_on and threading.main_thread().name not in synced_on
    writer.close()
    assert synced_on[-1] == threading.main_thread().name  # the final fsync, after the thread stopped
