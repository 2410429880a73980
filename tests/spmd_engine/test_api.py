"""The public Python API (README, "Python API"): the README's example as written, on the embedded
SmolLM2, and every rank of a 2-rank torchrun getting the same outputs back."""
from __future__ import annotations

import json
import re
import sys

import pytest

from spmd_engine.config import ConfigError
from tests.helpers.run_engine import REPO, _run_all, engine_env
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint


def readme_api_example() -> str:
    """The first ```python block of the README's "Python API" section."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_api_example_runs_on_cpu(smollm2_dir, capsys):
    source = readme_api_example()
    assert 'LLM(model="smollm2")' in source and "llm.chat(" in source and "llm.generate(" in source
    scope: dict = {}
    exec(compile(source.replace("max_tokens=64", "max_tokens=4"), "README.md", "exec"), scope)
    outs, chats = scope["outs"], scope["chats"]
    assert [o.prompt for o in outs] == ["Hello", None]
    assert outs[1].prompt_token_ids == [1, 2, 3] and outs[0].prompt_token_ids  # the text was tokenized
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 4 and completion.finish_reason == "length", completion
        assert isinstance(completion.text, str) and completion.text
    reply = chats[0].outputs[0]  # the sampling.* defaults: SmolLM2 says hello and stops
    assert reply.finish_reason == "stop" and reply.text.strip(), reply
    assert chats[0].prompt.rstrip().endswith("assistant")  # the chat template, with the generation prompt
    scope["llm"].close()


def test_unknown_engine_keyword_is_one_line_with_its_near_miss():
    from spmd_engine import LLM

    with pytest.raises(ConfigError, match="block_sise.*did you mean block_size"):
        LLM(model="smollm2", block_sise=16)


@pytest.fixture(scope="module")
def api_launches(tmp_path_factory):
    """One 2-rank launch (the default layout, then data_parallel_size=2 in its group) and one 4-rank launch
    (2 replicas x 2 tensor-parallel ranks), run at once; every rank's answers under the returned dir."""
    root = tmp_path_factory.mktemp("api_ranks")
    checkpoint = make_tiny_checkpoint(root / "tiny", arch="qwen3", max_position_embeddings=64)
    out_dir = root / "out"
    out_dir.mkdir()
    helper = str(REPO / "tests" / "helpers" / "api_ranks.py")

    def launch(nproc: int, *layouts: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", helper,
                str(checkpoint), str(out_dir), *layouts]

    for run in _run_all([(launch(2, "tp", "dp"), engine_env()), (launch(4, "dp_tp"), engine_env())], root,
                        timeout_s=360):
        run.check()
    return checkpoint, out_dir


def test_every_rank_returns_the_same_outputs(api_launches):
    _, out_dir = api_launches
    rank0, rank1 = (json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
    assert [o["prompt"] for o in rank0] == ["hello", None, None]
    ok, error = rank0[1]["outputs"][0], rank0[2]["outputs"][0]
    assert len(ok["token_ids"]) == 6 and ok["finish_reason"] == "length" and isinstance(ok["text"], str)
    assert rank0[0]["prompt_token_ids"] and rank0[0]["outputs"][0]["text"] is not None
    assert error["finish_reason"] == "error" and error["error"] == "prompt is empty"


@pytest.mark.parametrize("layout,nproc", [("dp", 2), ("dp_tp", 4)], ids=["dp2", "dp2xtp2"])
def test_replicas_share_a_generate_call_and_every_rank_returns_the_one_process_outputs(api_launches, layout, nproc):
    """Every rank calls generate / chat alike under data_parallel_size=2: the requests are handed out over
    both replicas (each ran some), and every rank returns the one-process outputs (greedy and seeded),
    in submission order."""
    from spmd_engine import LLM
    from tests.helpers.api_ranks import REPLICA_KEYS, REPLICA_PROMPTS, replica_calls

    checkpoint, out_dir = api_launches
    llm = LLM(model=str(checkpoint), **REPLICA_KEYS)
    try:
        reference = replica_calls(llm)
    finally:
        llm.close()
    assert reference["requests_per_replica"] == [len(REPLICA_PROMPTS)]
    ranks = [json.loads((out_dir / f"rank{r}-{layout}.json").read_text()) for r in range(nproc)]
    for rank, got in enumerate(ranks):
        assert got["generate"] == reference["generate"], rank
        assert got["chat"] == reference["chat"], rank
        assert [o["request_id"] for o in got["generate"]] == list(range(len(REPLICA_PROMPTS)))
    counts = ranks[0]["requests_per_replica"]
    assert all(r["requests_per_replica"] == counts for r in ranks)
    assert len(counts) == 2 and sum(counts) == len(REPLICA_PROMPTS) and min(counts) > 0, counts
    outputs = [o["outputs"][0] for o in reference["generate"]]
    assert outputs[-1]["error"] == "prompt is empty"  # an error request is handed out and comes back too
    assert all(len(o["token_ids"]) == 3 + i for i, o in enumerate(outputs[:-1]))


def _tiny_llm(tmp_path, max_num_seqs: int = 2, **keys):
    from spmd_engine import LLM

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", arch="qwen3", max_position_embeddings=64)
    return LLM(model=str(checkpoint), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64,
               max_num_seqs=max_num_seqs, **keys)


def test_stream_pulls_a_lazy_source_and_hands_every_row_to_the_callback(tmp_path):
    """`LLM.stream` (the offline-job path) with keep_outputs=False: a generator is read only as the
    batch has room, every request reaches `on_finish` once, and nothing is kept."""
    from spmd_engine import PromptRequest

    llm = _tiny_llm(tmp_path, max_num_seqs=2)
    pulled, rows, in_flight = [0], [], []

    def requests():
        for i in range(9):
            pulled[0] += 1
            yield PromptRequest(i, None, [5 + i, 6, 7], {"max_tokens": 3, "ignore_eos": True})

    def on_finish(out):
        in_flight.append(pulled[0] - len(rows))  # pulled but not yet finished, this one included
        rows.append(out)

    assert llm.stream(requests(), on_finish=on_finish, keep_outputs=False) == []
    llm.close()
    assert sorted(out.index for out in rows) == list(range(9))
    assert all(len(out.token_ids) == 3 and out.finish_reason == "length" for out in rows)
    assert isinstance(rows[0].text, str)  # decoded with the LLM's tokenizer
    assert max(in_flight) <= 2, in_flight  # bounded by max_num_seqs, not by the source's length


def test_generate_shows_a_progress_bar_by_default(tmp_path, capsys):
    """vLLM's use_tqdm=True: a bar of the requests on stderr unless use_tqdm=False."""
    from spmd_engine import SamplingParams

    llm = _tiny_llm(tmp_path)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    try:
        capsys.readouterr()
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}], params)
        shown = capsys.readouterr().err
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}], params, use_tqdm=False)
        quiet = capsys.readouterr().err
    finally:
        llm.close()
    assert "requests" in shown and "2/2" in shown, shown
    assert "requests" not in quiet, quiet


def test_generate_and_the_hydra_job_both_run_through_stream(tmp_path, monkeypatch):
    from spmd_engine.distributed import discover_ranks
    from spmd_engine.job.hydra_job import run_job
    from spmd_engine.llm import LLM, compose_config

    calls = []
    stream = LLM.stream

    def spy(self, requests, *args, **kwargs):
        calls.append(kwargs.get("keep_outputs", True))
        return stream(self, requests, *args, **kwargs)

    monkeypatch.setattr(LLM, "stream", spy)
    llm = _tiny_llm(tmp_path)
    [out] = llm.generate([{"prompt_token_ids": [5, 6, 7]}])
    llm.close()
    assert calls == [True] and out.outputs[0].finish_reason in ("length", "stop")

    calls.clear()
    raw = compose_config(str(tmp_path / "tiny"), {"device": "cpu", "block_size": 4, "num_kv_blocks": 64,
                                                  "max_model_len": 64, "prompts": ["hi", "there"],
                                                  "sampling": {"max_tokens": 2}})
    metrics = run_job(raw, [], discover_ranks(), tmp_path / "job", multirun=False)
    assert metrics["status"] == "ok" and calls == [False]  # the chat workload keeps no outputs
    rows = [json.loads(line) for line in (tmp_path / "job" / "outputs.jsonl").read_text().splitlines()]
    assert [row["index"] for row in rows] == [0, 1] and all(row["text"] is not None for row in rows)



def test_cpu_threads_given_to_the_api_is_applied_and_null_leaves_the_process_alone(tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _tiny_llm(tmp_path).close()  # cpu_threads null: the embedding program owns its threads
        assert torch.get_num_threads() == 2
        _tiny_llm(tmp_path, cpu_threads=1).close()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_checkpoints_generation_config_sets_the_api_defaults_under_explicit_keys(tmp_path, caplog):
    """LLM(...) takes the checkpoint's generation_config.json sampling as the job does (vLLM's default):
    a generate call without SamplingParams samples with it; LLM(sampling={...}) keys win over it."""
    from spmd_engine import LLM, SamplingParams

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", arch="qwen3", max_position_embeddings=64)
    gen = json.loads((checkpoint / "generation_config.json").read_text())
    gen.update(temperature=1.3, top_p=0.8, top_k=5, repetition_penalty=1.5, do_sample=True)
    (checkpoint / "generation_config.json").write_text(json.dumps(gen))
    keys = {"device": "cpu", "block_size": 4, "num_kv_blocks": 64, "max_model_len": 64}
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    shared = {"max_tokens": 8, "seed": 5, "ignore_eos": True}
    caplog.set_level("INFO", logger="spmd_engine")
    llm = LLM(model=str(checkpoint), sampling=shared, **keys)
    try:
        defaults = [o.outputs[0].token_ids for o in llm.generate(prompts)]
        as_checkpoint = SamplingParams(temperature=1.3, top_p=0.8, top_k=5, repetition_penalty=1.5, **shared)
        conf_only = SamplingParams(**shared)  # the config's own defaults (temperature 0.6, top_p 0.95, no top_k)
        assert defaults == [o.outputs[0].token_ids for o in llm.generate(prompts, as_checkpoint)]
        assert defaults != [o.outputs[0].token_ids for o in llm.generate(prompts, conf_only)]
    finally:
        llm.close()
    assert "sampling defaults from" in caplog.text and "top_k=5" in caplog.text
    caplog.clear()
    llm = LLM(model=str(checkpoint), sampling={"temperature": 0.0, "top_k": -1}, **keys)
    assert "LLM(sampling=...) keeps temperature, top_k" in caplog.text
    sampling = llm.engine.cfg.sampling
    llm.close()
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty) == (0.0, -1, 0.8, 1.5)
