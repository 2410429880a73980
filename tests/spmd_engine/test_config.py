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
    ("device", "tpu", "device must be one of"),
    ("attention_backend", "xformers", "attention_backend must be one of"),
    ("tensor_parallel_size", 4, "tensor_parallel_size=4 must equal the number of ranks (1)"),
    ("tp_reduce_dtype", "bfloat16", "tp_reduce_dtype must be one of float32|model, got 'bfloat16'"),
])
def test_bad_engine_keys_name_the_key_and_limit(key, value, needle):
    cfg = engine_config_from_dict(base(**{key: value}))
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=1)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_unknown_key_is_rejected():
    with pytest.raises(ConfigError, match="bad config key"):
        engine_config_from_dict(base(blocksize=16))


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


def test_tp_reduce_dtype_defaults_to_float32_in_code_and_yaml():
    from omegaconf import OmegaConf

    from tests.helpers.run_engine import REPO

    assert engine_config_from_dict(base()).tp_reduce_dtype == "float32"
    assert OmegaConf.load(REPO / "conf" / "config.yaml").tp_reduce_dtype == "float32"
