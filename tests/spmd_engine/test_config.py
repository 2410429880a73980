import dataclasses

import pytest

from spmd_engine.config import ConfigError, engine_config_from_dict


def base(**over):
    d = {"model": {"name": "qwen3", "path": None, "load_format": "dummy", "hf_config": {}},
         "workload": {"name": "chat"}, "sampling": {}, "prompts": None, "prompts_file": None}
    d.update(over)
    return d


@pytest.mark.parametrize("key,value,needle", [
    ("block_size", 24, "block_size must be a power of two, got 24"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in (0, 1], got 1.5"),
    ("gpu_memory_utilization", 0.0, "gpu_memory_utilization must be in (0, 1]"),
    ("max_num_seqs", 0, "max_num_seqs must be >= 1"),
    ("max_num_seqs", 65536, "max_num_seqs must be <= 65535, got 65536"),
    ("device", "tpu", "device must be one of"),
    ("attention_backend", "xformers", "attention_backend must be one of"),
    ("attention_backend", "flash_attn", "attention_backend must be one of auto|triton|torch, got 'flash_attn'"),
    ("tensor_parallel_size", 4, "tensor_parallel_size=4 must divide the number of ranks (1)"),
    ("data_parallel_size", 2, "data_parallel_size=2 must divide the number of ranks (1)"),
    ("data_parallel_size", 0, "data_parallel_size must be >= 1 or null, got 0"),
    ("tp_reduce_dtype", "bfloat16", "tp_reduce_dtype must be one of float32|model, got 'bfloat16'"),
    ("tp_allreduce", "custom_ar", "tp_allreduce must be one of auto|nccl|symm_mem, got 'custom_ar'"),
    ("moe_tp_split", "rows", "moe_tp_split must be one of experts|intermediate, got 'rows'"),
])
def test_bad_engine_keys_name_the_key_and_limit(key, value, needle):
    cfg = engine_config_from_dict(base(**{key: value}))
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=1)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("dp,tp,world,sizes", [
    (None, None, 4, (1, 4)), (2, None, 4, (2, 2)), (None, 2, 4, (2, 2)), (4, 1, 4, (4, 1)), (None, None, 1, (1, 1)),
    (3, None, 3, (3, 1)), (2, 2, 4, (2, 2)),
])
def test_replicas_and_tensor_parallel_size_are_derived_from_the_world_size(dp, tp, world, sizes):
    cfg = engine_config_from_dict(base(data_parallel_size=dp, tensor_parallel_size=tp))
    cfg.validate(world_size=world)
    assert cfg.parallel_sizes(world) == sizes


def test_a_product_that_is_not_the_world_size_names_both_keys():
    cfg = engine_config_from_dict(base(data_parallel_size=2, tensor_parallel_size=2))
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=2)
    assert str(err.value) == ("data_parallel_size=2 x tensor_parallel_size=2 = 4 must equal the number of ranks (2); "
                              "launch 4 ranks")


@pytest.mark.parametrize("over,line", [
    ({"blocksize": 16}, "unknown config key blocksize; did you mean block_size?"),
    ({"block_sise": 16}, "unknown config key block_sise; did you mean block_size?"),
    ({"sampling": {"temprature": 0}}, "unknown config key sampling.temprature; did you mean sampling.temperature?"),
    ({"model": {"name": "qwen3", "pth": "/x"}}, "unknown config key model.pth; did you mean model.path?"),
    ({"workload": {"name": "bench", "num_seq": 2}}, "unknown config key workload.num_seq; did you mean "
                                                    "workload.num_seqs?"),
    ({"workload": {"name": "chat", "num_seqs": 2}}, "unknown config key workload.num_seqs (workload=chat"),
])
def test_unknown_key_is_named_with_its_near_miss(over, line):
    with pytest.raises(ConfigError) as err:
        engine_config_from_dict(base(**over))
    assert str(err.value).startswith(line) and "__init__" not in str(err.value), err.value


def test_unknown_key_without_a_near_miss_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"^unknown config key zzz \(known: prompts, .*block_size"):
        engine_config_from_dict(base(zzz=1))


@pytest.mark.parametrize("sampling,line", [
    ({"max_tokens": 0}, "sampling.max_tokens must be >= 1, got 0"),
    ({"max_tokens": "abc"}, "sampling.max_tokens must be an integer, got 'abc'"),
    ({"temperature": "abc"}, "sampling.temperature must be a number, got 'abc'"),
    ({"temperature": -1}, "sampling.temperature must be >= 0, got -1"),
    ({"top_p": 1.5}, "sampling.top_p must be in (0, 1], got 1.5"),
    ({"top_k": -2}, "sampling.top_k must be -1 or 0 (off) or >= 1, got -2"),
    ({"seed": 2**64}, "sampling.seed must be an integer in [-2**63, 2**64 - 1] or null"),
])
def test_bad_sampling_defaults_are_config_errors(sampling, line):
    with pytest.raises(ConfigError) as err:
        engine_config_from_dict(base(sampling=sampling))
    assert str(err.value).startswith(line), err.value


def test_sampling_defaults_and_request_values_share_one_check(monkeypatch):
    """The job-wide defaults go through SamplingParams.validate, the check every request's values get."""
    from spmd_engine.core.sequence import SamplingParams

    def refuse(self):
        raise ValueError("checked by SamplingParams.validate")

    monkeypatch.setattr(SamplingParams, "validate", refuse)
    with pytest.raises(ConfigError, match="checked by SamplingParams.validate"):
        engine_config_from_dict(base())


def test_sampling_defaults_keep_float_fields_float():
    cfg = engine_config_from_dict(base(sampling={"temperature": 1, "top_p": 1}))
    assert cfg.sampling.temperature == 1.0 and isinstance(cfg.sampling.temperature, float)
    assert isinstance(cfg.sampling.top_p, float) and cfg.sampling.max_tokens == 256


@pytest.mark.parametrize("key,value,line", [
    ("block_size", "abc", "block_size must be an integer, got 'abc'"),
    ("max_num_seqs", 2.5, "max_num_seqs must be an integer, got 2.5"),
    ("num_kv_blocks", "x", "num_kv_blocks must be an integer or null, got 'x'"),
    ("enable_prefix_caching", "maybe", "enable_prefix_caching must be true or false, got 'maybe'"),
    ("gpu_memory_utilization", "high", "gpu_memory_utilization must be a number, got 'high'"),
    ("dist_timeout_s", True, "dist_timeout_s must be a number, got True"),
    ("attention_backend", ["torch"], "attention_backend must be a string, got ['torch']"),
])
def test_values_of_the_wrong_type_are_named(key, value, line):
    with pytest.raises(ConfigError) as err:
        engine_config_from_dict(base(**{key: value}))
    assert str(err.value) == line


def test_bench_workload_keys_are_checked():
    from omegaconf import OmegaConf

    from tests.helpers.run_engine import REPO

    bench = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "workload" / "bench.yaml"))
    assert engine_config_from_dict(base(workload=bench)).workload.params["num_seqs"] == 256
    with pytest.raises(ConfigError, match=r"^workload.num_seqs must be an integer, got 'abc'$"):
        engine_config_from_dict(base(workload={**bench, "num_seqs": "abc"}))
    with pytest.raises(ConfigError, match=r"^workload.max_output_len must be >= workload.min_output_len \(100\)"):
        engine_config_from_dict(base(workload={**bench, "max_output_len": 1}))
    # the sampling path of the bench (workload.top_p / top_k): sampling.*'s limits
    params = engine_config_from_dict(base(workload={**bench, "top_p": 0.95, "top_k": 20})).workload.params
    assert (params["top_p"], params["top_k"]) == (0.95, 20)
    for key, value, line in (("top_p", 0.0, r"^workload.top_p must be in \(0, 1\], got 0.0$"),
                             ("top_p", 1.5, r"^workload.top_p must be in \(0, 1\], got 1.5$"),
                             ("top_k", -2, r"^workload.top_k must be >= -1, got -2$")):
        with pytest.raises(ConfigError, match=line):
            engine_config_from_dict(base(workload={**bench, key: value}))


def test_prompts_and_file_exclusive():
    cfg = engine_config_from_dict(base(prompts=["a"], prompts_file="x.jsonl"))
    with pytest.raises(ConfigError, match="either prompts or prompts_file"):
        cfg.validate(1)


def test_valid_defaults_pass():
    cfg = engine_config_from_dict(base(prompts="hello"))
    cfg.validate(1)
    assert cfg.prompts == ["hello"] and cfg.block_size == 16


@pytest.mark.parametrize("value", ["float32", "model"])
def test_tp_reduce_dtype_accepts_float32_and_model(value):
    engine_config_from_dict(base(tp_reduce_dtype=value)).validate(2)


def test_tp_reduce_dtype_defaults_to_float32_in_code_and_the_composed_config():
    from spmd_engine.llm import compose_config

    assert engine_config_from_dict(base()).tp_reduce_dtype == "float32"
    assert compose_config("smollm2", {})["tp_reduce_dtype"] == "float32"


@pytest.mark.parametrize("value", ["auto", "nccl", "symm_mem"])
def test_tp_allreduce_accepts_its_three_paths(value):
    engine_config_from_dict(base(tp_allreduce=value)).validate(2)


SWITCHES = ("small_batch_gemv", "cuda_pdl", "cuda_fp8_decode", "cuda_decode", "sampler_graphs")


def test_debug_switches_are_on_by_default_and_take_only_a_boolean():
    """The five per-kernel paths are the engine's to pick (true: wherever hardware and shapes allow);
    `debug.KEY=false` forces the fallback for an A/B bench."""
    from spmd_engine.llm import compose_config

    cfg = engine_config_from_dict(base())
    assert all(getattr(cfg.debug, key) is True for key in SWITCHES)
    assert compose_config("smollm2", {})["debug"] == dict.fromkeys(SWITCHES, True)
    assert engine_config_from_dict(base(debug={"cuda_pdl": False})).debug.cuda_pdl is False
    assert engine_config_from_dict(base(debug={"sampler_graphs": False})).debug.sampler_graphs is False
    with pytest.raises(ConfigError, match=r"^debug.cuda_pdl must be true or false, got 'fast'$"):
        engine_config_from_dict(base(debug={"cuda_pdl": "fast"}))
    with pytest.raises(ConfigError, match=r"^debug must be a group of keys"):
        engine_config_from_dict(base(debug=5))


def test_an_unknown_debug_key_is_named_with_its_near_miss():
    with pytest.raises(ConfigError) as err:
        engine_config_from_dict(base(debug={"cuda_pld": False}))
    assert str(err.value) == "unknown config key debug.cuda_pld; did you mean debug.cuda_pdl?"
    with pytest.raises(ConfigError, match=r"^unknown config key debug.zzz \(known: debug.small_batch_gemv, "):
        engine_config_from_dict(base(debug={"zzz": 1}))


@pytest.mark.parametrize("key", SWITCHES)
def test_an_old_switch_spelling_sets_debug_with_one_warning(key, caplog):
    with caplog.at_level("WARNING"):
        cfg = engine_config_from_dict(base(**{key: False}))
    assert getattr(cfg.debug, key) is False and not hasattr(cfg, key)
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert lines == [f"{key} is deprecated; use debug.{key} (the engine picks the path itself)"]


def test_old_switch_spellings_compose_as_unset_and_a_bad_value_names_the_key(caplog):
    """conf keeps the old keys as null (Hydra refuses `cuda_pdl=false` for a key it lacks); null warns nothing."""
    from spmd_engine.llm import compose_config

    composed = compose_config("smollm2", {})
    assert all(composed[key] is None for key in SWITCHES)
    with caplog.at_level("WARNING"):
        assert engine_config_from_dict(composed).debug.cuda_pdl is True
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]
    with pytest.raises(ConfigError, match=r"^sampler_graphs must be true or false, got 'yes'$"):
        engine_config_from_dict(base(sampler_graphs="yes"))
    # the Python API's keywords take the old spelling too (LLM(..., cuda_pdl=False) composes it like this)
    assert engine_config_from_dict(compose_config("smollm2", {"cuda_pdl": False})).debug.cuda_pdl is False
    assert engine_config_from_dict(compose_config("smollm2", {"debug": {"cuda_decode": False}})).debug.cuda_decode \
        is False


def test_fault_is_not_an_engine_key():
    """Test-only fault injection belongs to the Hydra job (spmd_engine/job/hydra_job.py), not EngineConfig."""
    from spmd_engine.config import EngineConfig
    from spmd_engine.llm import compose_config

    assert "fault" not in {f.name for f in dataclasses.fields(EngineConfig)}
    assert "fault" not in compose_config("smollm2", {})


@pytest.mark.parametrize("value,line", [
    (0, "cpu_threads must be >= 1 or null (null: cores available / ranks on the node), got 0"),
    (-2, "cpu_threads must be >= 1 or null (null: cores available / ranks on the node), got -2"),
])
def test_cpu_threads_below_one_is_named(value, line):
    with pytest.raises(ConfigError) as err:
        engine_config_from_dict(base(cpu_threads=value)).validate(1)
    assert str(err.value) == line


def test_cpu_threads_takes_an_integer_or_null():
    assert engine_config_from_dict(base()).cpu_threads is None
    engine_config_from_dict(base(cpu_threads=3)).validate(1)
    with pytest.raises(ConfigError, match=r"^cpu_threads must be an integer or null, got 'many'$"):
        engine_config_from_dict(base(cpu_threads="many"))


@pytest.mark.parametrize("cores,ranks,threads", [(2, 1, 1), (2, 2, 1), (2, 4, 1), (16, 1, 15), (16, 4, 3), (17, 4, 4),
                                                 (16, 3, 5), (1, 1, 1)])
def test_auto_cpu_threads_shares_all_cores_but_one_among_the_ranks_on_the_node(cores, ranks, threads):
    from spmd_engine.cpu_threads import auto_cpu_threads

    assert auto_cpu_threads(cores, ranks) == threads


def test_cpu_threads_choice_key_then_omp_then_auto():
    from spmd_engine.cpu_threads import choose_cpu_threads, ranks_on_node

    assert choose_cpu_threads(3, 16, 2, {"OMP_NUM_THREADS": "1"}).threads == 3
    omp = choose_cpu_threads(None, 16, 2, {"OMP_NUM_THREADS": "1"})
    assert omp.threads is None and omp.reason == "OMP_NUM_THREADS=1"  # torch already follows it
    auto = choose_cpu_threads(None, 16, 2, {})
    assert (auto.threads, auto.reason) == (7, "auto: 16 cores available / 2 ranks on this node")
    assert ranks_on_node({"LOCAL_WORLD_SIZE": "2"}, world_size=8) == 2
    assert ranks_on_node({"SLURM_NTASKS_PER_NODE": "4(x2)"}, world_size=8) == 4
    assert ranks_on_node({}, world_size=3) == 3


def test_tp_allreduce_defaults_to_nccl_in_code_and_the_composed_config():
    from spmd_engine.llm import compose_config

    assert engine_config_from_dict(base()).tp_allreduce == "nccl"
    assert compose_config("smollm2", {})["tp_allreduce"] == "nccl"


def test_a_number_where_text_is_wanted_is_text():
    """Hydra reads prompts_file=123 as an int; it is still a file name (and dtype=16 is named by validate)."""
    assert engine_config_from_dict(base(prompts_file=123)).prompts_file == "123"
    with pytest.raises(ConfigError) as err:
        engine_config_from_dict(base(dtype=16)).validate(1)
    assert str(err.value) == "dtype must be one of auto|bfloat16|float16|float32, got '16'"


def test_startup_settings_read_leniently():
    from spmd_engine.config import startup_settings

    assert startup_settings({"device": "cpu", "dist_timeout_s": 5, "startup_timeout_s": 60}) == \
        startup_settings({"device": "cpu", "dist_timeout_s": 5.0, "startup_timeout_s": 60.0})
    good = startup_settings({"device": "cpu", "dist_timeout_s": 5, "startup_timeout_s": 60})
    assert (good.device, good.dist_timeout_s, good.timeout_s) == ("cpu", 5.0, 60.0)
    bad = startup_settings({"device": "tpu", "dist_timeout_s": "abc", "startup_timeout_s": -1})
    assert (bad.device, bad.dist_timeout_s, bad.timeout_s) == ("auto", 45.0, 600.0)  # the defaults


def test_the_composed_config_takes_every_default_from_the_dataclasses():
    """One set of defaults: conf/config.yaml repeats none (it picks groups and sets Hydra); the composed
    config's engine keys and `sampling.*` are the dataclasses' defaults, and so is what the CLI runs with."""
    import dataclasses
    from pathlib import Path

    import yaml

    from spmd_engine import SamplingParams
    from spmd_engine.config import DebugConfig, EngineConfig
    from spmd_engine.llm import compose_config

    conf = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "config.yaml").read_text())
    assert set(conf) == {"defaults", "hydra"}
    composed = compose_config("qwen3", {})
    assert composed["sampling"] == dataclasses.asdict(SamplingParams())
    engine_keys = {f.name: f.default for f in dataclasses.fields(EngineConfig)
                   if f.name not in ("model", "workload", "sampling", "debug")}
    assert {key: composed[key] for key in engine_keys} == engine_keys
    assert composed["debug"] == dataclasses.asdict(DebugConfig())
    cfg = engine_config_from_dict(composed)
    assert cfg.sampling == SamplingParams() and cfg.block_size == EngineConfig.block_size
    # a key Hydra does not know (given with +) still fails with our one line, not at composition
    with pytest.raises(ConfigError, match=r"^unknown config key block_sise; did you mean block_size\?$"):
        engine_config_from_dict(compose_config("qwen3", {"block_sise": 16}))


def test_llm_keyword_load_format_sets_model_load_format():
    """vLLM's LLM(model, load_format="dummy"): `model` is the name, so the model key comes as a keyword."""
    from spmd_engine.llm import compose_config

    raw = compose_config("qwen3", {"load_format": "dummy", "block_size": 32})
    assert raw["model"]["load_format"] == "dummy" and "load_format" not in raw and raw["block_size"] == 32
    engine_config_from_dict(raw)  # and it is a valid config


def test_a_sampling_key_without_its_prefix_names_sampling():
    with pytest.raises(ConfigError, match=r"^unknown config key max_tokens; did you mean sampling\.max_tokens\?$"):
        engine_config_from_dict(base(max_tokens=16))


def test_plain_overrides_of_keys_the_config_lacks_get_a_plus():
    """run.py hands Hydra `+key=value` for such keys: the config check then says the one line."""
    from spmd_engine.config import plus_unknown_overrides

    args = ["max_tokens=16", "sampling.max_token=2", "debug.cuda_pd=false", "block_sise=3", "+x=1", "~seed",
            "block_size=16", "sampling.max_tokens=8", "debug.cuda_pdl=false", "model=qwen3", "model.path=/x",
            "workload.num_seqs=2", "hydra.run.dir=/tmp/x", "hydra/launcher=basic", "-m", "--cfg", "job",
            "prompts=[\"a=b\"]", "cuda_pdl=false"]
    assert plus_unknown_overrides(args) == ["+max_tokens=16", "+sampling.max_token=2", "+debug.cuda_pd=false",
                                            "+block_sise=3", *args[4:]]
