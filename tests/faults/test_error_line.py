import logging

from spmd_engine.faults.error_line import report_error


def test_one_line_on_stderr_and_in_the_log_file_only(tmp_path, capsys):
    root = logging.getLogger()
    file_handler = logging.FileHandler(tmp_path / "job.log")
    root.addHandler(file_handler)
    try:
        report_error("rank 1 failed\n  at step 3", fresh_line=True)
    finally:
        root.removeHandler(file_handler)
        file_handler.close()
    captured = capsys.readouterr()
    assert captured.err == "\nerror: rank 1 failed at step 3\n" and captured.out == ""
    assert (tmp_path / "job.log").read_text() == "error: rank 1 failed at step 3\n"


def test_under_torchrun_the_line_is_the_root_cause_of_its_summary(tmp_path, monkeypatch, capsys):
    """torchrun's ChildFailedError summary, built by torch's own code from the error file report_error
    writes, ends with the job's line (just above the closing border), not a link to torch's docs."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    report_error("sampling.top_p must be in (0, 1],\n got 1.5")
    assert capsys.readouterr().err == "error: sampling.top_p must be in (0, 1], got 1.5\n"
    failure = ProcessFailure(local_rank=0, pid=1234, exitcode=2, error_file=str(error_file))
    lines = [line for line in ChildFailedError("run.py", {0: failure}).format_msg().splitlines() if line.strip()]
    assert lines[-2].strip() == "traceback : error: sampling.top_p must be in (0, 1], got 1.5", lines
    assert set(lines[-1]) == {"="}, lines


def test_without_torchrun_no_error_file_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    report_error("bad key")
    assert capsys.readouterr().err == "error: bad key\n" and list(tmp_path.iterdir()) == []
