import json
import threading
import time

from spmd_engine.job.outputs import OutputsWriter, RequestOutput, read_outputs


def out(i):
    return RequestOutput(i, None, [1, 2], "é", [3, 4], "length")


def test_resume_rewrites_kept_rows_so_a_torn_line_cannot_swallow_the_next(tmp_path):
    path = tmp_path / "outputs.jsonl"
    first = OutputsWriter(path)
    first.write(out(0))
    first.write(out(2))
    first.close()
    kept_text = path.read_text()
    with open(path, "ab") as f:  # the crash tore the next line, even inside a multi-byte character
        f.write(json.dumps(out(1).to_json(), ensure_ascii=False).encode()[:-12])
    done = read_outputs(path)
    assert [r["index"] for r in done] == [0, 2]
    resumed = OutputsWriter(path, keep=done)
    assert path.read_text() == kept_text  # the complete lines, byte for byte
    resumed.write(out(1))
    resumed.write(out(0))  # a duplicate index never survives finalize (the first row wins)
    resumed.finalize()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2] and rows[0] == out(0).to_json()


def test_non_rows_are_skipped(tmp_path):
    path = tmp_path / "outputs.jsonl"
    path.write_text('[1]\n{"index": "3"}\n{"index": true}\n{"no": 1}\n{"index": 4}\n\n')
    assert read_outputs(path) == [{"index": 4}]
    assert read_outputs(tmp_path / "missing.jsonl") == []


def test_quiesce_waits_for_the_line_being_written_then_blocks_writes(tmp_path):
    writer = OutputsWriter(tmp_path / "outputs.jsonl")
    writer.quiesce()
    late = threading.Thread(target=writer.write, args=(out(5),), daemon=True)
    late.start()
    time.sleep(0.1)
    assert late.is_alive() and read_outputs(tmp_path / "outputs.jsonl") == []
