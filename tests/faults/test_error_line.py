import logging

from spmd_engine.error_line import report_error


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
