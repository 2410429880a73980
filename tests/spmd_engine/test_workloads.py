from spmd_engine.job.workloads import bench_requests


def test_bench_reproduces_the_nano_vllm_workload_to_the_token():
    requests = bench_requests({})
    assert len(requests) == 256
    assert sum(len(r.prompt_token_ids) for r in requests) == 142_827
    assert sum(r.overrides["max_tokens"] for r in requests) == 133_966
    assert all(0 <= t <= 10_000 for r in requests for t in r.prompt_token_ids)
    assert requests[0].overrides == {"temperature": 0.6, "top_p": 1.0, "top_k": -1, "ignore_eos": True,
                                     "min_p": 0.0, "repetition_penalty": 1.0,
                                     "max_tokens": requests[0].overrides["max_tokens"]}


def test_bench_can_measure_the_default_sampling_path():
    """workload.top_p / top_k set every bench request's sampling (the prompts stay the same)."""
    plain, nucleus = bench_requests({}), bench_requests({"top_p": 0.95, "top_k": 20})
    assert all(r.overrides["top_p"] == 0.95 and r.overrides["top_k"] == 20 for r in nucleus)
    assert [r.prompt_token_ids for r in nucleus] == [r.prompt_token_ids for r in plain]


def test_latency_mode_is_one_sequence():
    assert len(bench_requests({"num_seqs": 1})) == 1


def _chat_cfg(**over):
    from spmd_engine.config import engine_config_from_dict

    raw = {"model": {"name": "qwen3", "path": None, "load_format": "dummy", "hf_config": {}},
           "workload": {"name": "chat"}, "sampling": {}, **over}
    return engine_config_from_dict(raw)


def test_no_tokenizer_turns_the_built_in_prompts_into_token_ids(caplog):
    """Dummy weights of a shape have no tokenizer: the default job still generates (token-id prompts)."""
    import logging

    from spmd_engine.job.prompts import DEFAULT_PROMPTS
    from spmd_engine.job.workloads import build_requests

    with caplog.at_level(logging.INFO, logger="spmd_engine"):
        requests = build_requests(_chat_cfg(), None, vocab_size=500)
    assert len(requests) == len(DEFAULT_PROMPTS) and [r.index for r in requests] == list(range(len(requests)))
    assert all(r.error is None and r.prompt is None and 8 <= len(r.prompt_token_ids) <= 32 for r in requests)
    assert all(0 <= t < 500 for r in requests for t in r.prompt_token_ids)
    assert "no tokenizer" in caplog.text and "token-id prompts" in caplog.text
    again = build_requests(_chat_cfg(), None, vocab_size=500)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]  # seeded by `seed`
    other_seed = build_requests(_chat_cfg(seed=1), None, vocab_size=500)
    assert [r.prompt_token_ids for r in other_seed] != [r.prompt_token_ids for r in requests]


def test_text_the_user_gave_still_needs_a_tokenizer():
    from spmd_engine.job.prompts import NO_TOKENIZER_ERROR
    from spmd_engine.job.workloads import build_requests

    requests = build_requests(_chat_cfg(prompts=["hello"]), None, vocab_size=500)
    assert [r.error for r in requests] == [NO_TOKENIZER_ERROR]


def test_steady_state_bench_preset_is_the_bench_with_2048_requests():
    """workload=bench_steady (issue #15): the bench's lengths, 2048 requests; the first 256 prompts are the bench's."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from spmd_engine.config import engine_config_from_dict, store_config_defaults

    store_config_defaults()  # conf/config.yaml's `engine_defaults` (what run.py and LLM register first)
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        raw = OmegaConf.to_container(compose(config_name="config", overrides=["workload=bench_steady"]), resolve=True)
    cfg = engine_config_from_dict(raw)
    assert cfg.workload.name == "bench" and cfg.workload.params["num_seqs"] == 2048
    requests = bench_requests(cfg.workload.params)
    assert len(requests) == 2048
    assert [r.prompt_token_ids for r in requests[:256]] == [r.prompt_token_ids for r in bench_requests({})]


def test_bench_n_preset_is_n_completions_or_the_same_work_as_separate_requests():
    """workload=bench_n: 256 prompts of 512-1024 tokens, n=8, 256 output tokens; n_as_separate_requests=true
    gives the same prompts as 8 adjacent n=1 requests each."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from spmd_engine.config import engine_config_from_dict, store_config_defaults

    store_config_defaults()  # conf/config.yaml's `engine_defaults` (what run.py and LLM register first)
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        raw = OmegaConf.to_container(compose(config_name="config", overrides=["workload=bench_n"]), resolve=True)
    params = engine_config_from_dict(raw).workload.params
    grouped = bench_requests(params)
    assert len(grouped) == 256 and {r.overrides["n"] for r in grouped} == {8}
    assert all(512 <= len(r.prompt_token_ids) <= 1024 and r.overrides["max_tokens"] == 256 for r in grouped)
    separate = bench_requests({**params, "n_as_separate_requests": True})
    assert len(separate) == 8 * 256 and [r.index for r in separate] == list(range(2048))
    assert all("n" not in r.overrides for r in separate)
    assert [r.prompt_token_ids for r in separate[::8]] == [r.prompt_token_ids for r in grouped]
    assert [r.prompt_token_ids for r in separate[5::8]] == [r.prompt_token_ids for r in grouped]
