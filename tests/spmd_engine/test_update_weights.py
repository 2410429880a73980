"""In-place weight updates and sleep / wake-up (README, "Python API"): an engine updated to a second
checkpoint's tensors generates what a fresh engine of that checkpoint generates, recomputes prompts it had
cached, refuses a bad name or shape before copying anything, and comes back from sleep unchanged."""
from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from safetensors.torch import load_file

from spmd_engine.config import ConfigError
from tests.helpers.run_engine import REPO, _run_all, engine_env
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13]}, {"prompt_token_ids": [40, 41, 42, 43, 44]}]
KEYS = dict(device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64, max_num_seqs=4)


def greedy(max_tokens: int = 6):
    from spmd_engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(llm) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, greedy())]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    """Two tiny Qwen3 of one shape, different weights (untied head: the embedding and the head apart)."""
    root = tmp_path_factory.mktemp("weights")
    return {name: make_tiny_checkpoint(root / name, arch="qwen3", seed=seed, init_std=0.3, tokenizer=False)
            for name, seed in (("a", 0), ("b", 1))}


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[list[int]]]:
    from spmd_engine import LLM

    outputs = {}
    for name, path in checkpoints.items():
        llm = LLM(model=str(path), **KEYS)
        outputs[name] = token_ids(llm)
        llm.close()
    assert outputs["a"] != outputs["b"]  # the test can tell the weights apart
    return outputs


@pytest.fixture
def llm_a(checkpoints):
    from spmd_engine import LLM

    llm = LLM(model=str(checkpoints["a"]), **KEYS)
    yield llm
    llm.close()


def cached_tokens(llm, prompt) -> int:
    """Prompt tokens the prefix cache supplied to one request (`stream` keeps the engine's counters)."""
    from spmd_engine import PromptRequest

    [out] = llm.stream([PromptRequest(0, None, list(prompt["prompt_token_ids"]), {"max_tokens": 1})])
    return out.num_cached_tokens


def test_update_gives_the_second_checkpoints_outputs_and_recomputes_cached_prompts(llm_a, checkpoints, expected):
    assert token_ids(llm_a) == expected["a"]
    assert cached_tokens(llm_a, PROMPTS[0]) == 8  # two full 4-token blocks of the 9-token prompt: cached
    tensors = load_file(checkpoints["b"] / "model.safetensors")
    llm_a.update_weights((name, t.to(torch.bfloat16).float()) for name, t in tensors.items())  # any dtype: cast
    assert llm_a.engine.scheduler.block_manager.num_free_blocks == KEYS["num_kv_blocks"]
    assert cached_tokens(llm_a, PROMPTS[0]) == 0  # KV of the old weights is never reused
    llm_a.update_weights(tensors.items())
    assert token_ids(llm_a) == expected["b"]
    assert cached_tokens(llm_a, PROMPTS[0]) == 8  # computed with the new weights: cached again


def test_update_from_path_gives_the_second_checkpoints_outputs(llm_a, checkpoints, expected):
    assert token_ids(llm_a) == expected["a"]
    llm_a.update_weights_from_path(checkpoints["b"])
    assert token_ids(llm_a) == expected["b"]
    assert cached_tokens(llm_a, PROMPTS[1]) == 4  # the update's generate call cached it, not the first one's
    llm_a.update_weights_from_path(str(checkpoints["a"]))
    assert token_ids(llm_a) == expected["a"]


def test_a_partial_update_changes_only_its_tensors(llm_a, checkpoints):
    model = llm_a.engine.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    tensors = load_file(checkpoints["b"] / "model.safetensors")
    k_name = "model.layers.1.self_attn.k_proj.weight"
    llm_a.update_weights([(k_name, tensors[k_name])])
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == {"model.layers.1.self_attn.qkv_proj.weight"}
    qkv = model.model.layers[1].self_attn.qkv_proj
    k_rows = qkv.weight[qkv.q_size: qkv.q_size + qkv.kv_size]
    assert torch.equal(k_rows, tensors[k_name])


@pytest.mark.parametrize("bad, message", [
    (("model.layers.0.mlp.up_proj.weight_x", (128, 64)), r"'model\.layers\.0\.mlp\.up_proj\.weight_x' is not part of"),
    (("model.layers.1.mlp.up_proj.weight", (64, 64)), r"'model\.layers\.1\.mlp\.up_proj\.weight' has shape \(64, 64\), "
                                                      r"expected \(128, 64\)"),
])
def test_a_bad_name_or_shape_is_one_line_and_leaves_every_weight_as_it_was(llm_a, checkpoints, expected, bad, message):
    model = llm_a.engine.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    good = list(load_file(checkpoints["b"] / "model.safetensors").items())
    name, shape = bad
    with pytest.raises(ConfigError, match=message) as error:
        llm_a.update_weights([*good, (name, torch.zeros(shape))])  # the bad one last: the good ones came first
    assert "\n" not in str(error.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ConfigError, match="pairs"):
        llm_a.update_weights([("model.norm.weight", [1.0] * 64)])
    assert token_ids(llm_a) == expected["a"]


def test_update_from_a_path_with_a_bad_tensor_changes_nothing(llm_a, checkpoints, expected, tmp_path):
    from safetensors.torch import save_file

    tensors = load_file(checkpoints["b"] / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"'model\.norm\.weight' has shape \(65,\)"):
        llm_a.update_weights_from_path(tmp_path)
    with pytest.raises(ConfigError, match="holds no .safetensors files"):
        llm_a.update_weights_from_path(tmp_path / "missing")
    assert token_ids(llm_a) == expected["a"]


def test_the_head_loaded_from_the_embedding_follows_it(checkpoints, tmp_path):
    """An untied model whose checkpoint has no lm_head gets the embedding as its head at load; so does an update."""
    from safetensors.torch import save_file

    from spmd_engine import LLM

    for name in ("a", "b"):
        tensors = load_file(checkpoints[name] / "model.safetensors")
        del tensors["lm_head.weight"]
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
    (tmp_path / "a" / "config.json").write_text((checkpoints["a"] / "config.json").read_text())
    llm = LLM(model=str(tmp_path / "a"), **KEYS)
    try:
        embedding = load_file(tmp_path / "b" / "model.safetensors")["model.embed_tokens.weight"]
        llm.update_weights([("model.embed_tokens.weight", embedding)])
        assert torch.equal(llm.engine.model.lm_head.weight, embedding)
        llm.update_weights_from_path(tmp_path / "a")
        assert torch.equal(llm.engine.model.lm_head.weight, llm.engine.model.model.embed_tokens.weight)
    finally:
        llm.close()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_give_the_same_outputs(llm_a, checkpoints, expected, level):
    runner = llm_a.engine.runner
    assert token_ids(llm_a) == expected["a"]
    llm_a.sleep(level)
    assert runner.kv_caches == [] and all(layer.k_cache is None for layer in llm_a.engine.model.attention_layers())
    with pytest.raises(ConfigError, match=r"asleep \(LLM\.sleep\): call wake_up\(\)"):
        llm_a.generate(PROMPTS, greedy())
    with pytest.raises(ConfigError, match="asleep already"):
        llm_a.sleep(1)
    llm_a.update_weights_from_path(checkpoints["b"])  # while asleep (level 2: into the host copies)
    llm_a.wake_up()
    llm_a.wake_up()  # awake: nothing to do
    assert cached_tokens(llm_a, PROMPTS[0]) == 0  # nothing computed before the sleep is reused
    assert token_ids(llm_a) == expected["b"]


def test_sleep_level_must_be_1_or_2(llm_a):
    with pytest.raises(ConfigError, match="sleep level must be 1 .* or 2"):
        llm_a.sleep(3)


def test_fp8_scales_follow_the_weights(checkpoints, tmp_path):
    """The fp8 KV scales depend only on the weights: an update recalibrates them, as a fresh engine would."""
    import shutil

    from safetensors.torch import save_file

    from spmd_engine import LLM

    louder = tmp_path / "louder"  # checkpoint b with K and V 8x as large: other power-of-two scales
    shutil.copytree(checkpoints["b"], louder)
    tensors = load_file(louder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("k_proj.weight", "v_proj.weight"))]:
        tensors[name] = tensors[name] * 8
    save_file(tensors, louder / "model.safetensors")
    fresh = LLM(model=str(louder), kv_cache_dtype="fp8", **KEYS)
    scales_b, outputs_b = fresh.engine.runner.kv_scales.clone(), token_ids(fresh)
    fresh.close()
    llm = LLM(model=str(checkpoints["a"]), kv_cache_dtype="fp8", **KEYS)
    try:
        scales = llm.engine.runner.kv_scales
        assert not torch.equal(scales, scales_b)
        llm.update_weights_from_path(louder)
        assert llm.engine.runner.kv_scales is scales and torch.equal(scales, scales_b)  # in place: graphs read it
        assert token_ids(llm) == outputs_b
    finally:
        llm.close()


def test_block_manager_reset_forgets_every_hash_and_keeps_held_blocks():
    from spmd_engine.core.block_manager import BlockManager
    from spmd_engine.core.sequence import Sequence

    bm = BlockManager(8, 4, True)
    running = Sequence(0, list(range(10)))
    bm.allocate_prefix(running)
    bm.ensure_slots(running, 10)
    bm.cache_full_blocks(running, 8)
    assert bm.reset_prefix_cache() == 2
    assert not any(bm.is_cached(b) for b in range(8)) and bm.num_used_blocks == 3
    running.token_ids.extend([10, 11])
    bm.ensure_slots(running, 12)
    bm.cache_full_blocks(running, 12)  # its third block reads stale KV: never registered
    assert not any(bm.is_cached(b) for b in range(8))
    again = Sequence(1, list(range(13)))
    assert bm.allocate_prefix(again) == 0


def readme_rl_example() -> str:
    """The README's ```python block that calls update_weights."""
    readme = (REPO / "README.md").read_text()
    return next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "update_weights" in block)


def test_readme_rl_loop_runs_on_cpu(checkpoints, expected):
    source = readme_rl_example()
    assert "llm.generate(" in source and "llm.update_weights(" in source and "llm.wake_up()" in source
    second = load_file(checkpoints["b"] / "model.safetensors")
    rounds = []

    def train_step(outputs):  # the trainer of the example: here, the second checkpoint's tensors
        rounds.append([out.outputs[0].token_ids for out in outputs])
        return second.items()

    source = re.sub(r'LLM\(model="[^"]*"\)', f"LLM(model={str(checkpoints['a'])!r}, **KEYS)", source)
    from spmd_engine import LLM, SamplingParams

    scope = {"train_step": train_step, "prompts": PROMPTS, "KEYS": KEYS, "LLM": LLM, "SamplingParams": SamplingParams}
    exec(compile(source, "README.md", "exec"), scope)
    scope["llm"].close()
    assert len(rounds) >= 2 and len(rounds[0]) == len(PROMPTS)
    assert all(len(ids) > 0 for ids in rounds[0])


def test_two_rank_update_gives_the_single_rank_outputs(checkpoints, expected, tmp_path):
    """Tensor parallel over 2 gloo ranks: every rank loads its shard of the update (packed q/k/v of 2 KV heads
    split, gate/up, row-parallel, the vocabulary), and a bad name raises on both ranks without hanging."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "helpers" / "update_ranks.py"), str(checkpoints["a"]), str(checkpoints["b"]),
           str(out_dir)]
    [run] = _run_all([(cmd, engine_env())], tmp_path, timeout_s=240)
    run.check()
    rank0, rank1 = (json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
    assert rank0["before"] == expected["a"] and rank0["after"] == expected["b"]
    assert "is not part of" in rank0["error"] and "\n" not in rank0["error"]
