import json

from spmd_engine.metrics import summarize
from spmd_engine.outputs import OutputsWriter, RequestOutput, read_outputs


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
