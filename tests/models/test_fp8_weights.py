"""quantization=fp8 on CPU (the reference math): FP8 block-scaled checkpoints load exactly (their dequantized
twin with the same activation quantization gives the same logits), 16-bit checkpoints are quantized at load,
2 tensor-parallel ranks give 1 rank's logits, and bad combinations fail with one line."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spmd_engine.kernels.reference import fp8_act_quant_reference
from spmd_engine.models.layers.fp8_linear import ONLINE_RECIPE, resolve_quantization
from spmd_engine.models.loader import apply_update, load_safetensors_weights, plan_update
from spmd_engine.models.parallel import TensorParallel
from spmd_engine.models.registry import build_model
from tests.helpers.fp8_checkpoints import write_dequantized_twin, write_fp8_checkpoint
from tests.helpers.spawned_ranks import run_on_ranks
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint
from tests.models.hf_parity import PROMPTS, relative_error
from tests.models.paged_runner import run_paged

# big enough for several 128 x 128 blocks per projection: q 256 rows (2 blocks), k/v 128 rows (one block,
# 64 rows per rank at tp=2: a rank's rows start inside a block), gate/up 512 rows, down K = 512
SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, head_dim=64, num_kv_heads=2, vocab_size=300,
             max_position_embeddings=128, tokenizer=False)
STEPS = 2
FORCED = [[11 * b + 3 * s + 4 for s in range(STEPS)] for b in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny_checkpoint(root / "src", arch="qwen3", **SHAPE)
    fp8 = write_fp8_checkpoint(src, root / "fp8")
    return {"src": src, "fp8": fp8, "twin": write_dequantized_twin(fp8, root / "twin")}


def config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def load(path: Path, quantization: str, tp: TensorParallel | None = None):
    model = build_model(config(path), tp or TensorParallel.single(), quantization=quantization)
    load_safetensors_weights(model, path)
    return model.eval()


def logits(model) -> list[torch.Tensor]:
    run = run_paged(model, PROMPTS, STEPS, forced_tokens=FORCED)
    return ([torch.cat(run.prefill_logits)] if run.prefill_logits else []) + run.decode_logits


def quantize_inputs_like_fp8(model, group: int = 128) -> None:
    """Each linear layer of a 16-bit model rounds its input through the fp8 activation quantization first."""
    for module in model.modules():
        if hasattr(module, "matmul") and hasattr(module, "small_batch_gemv"):
            plain = module.matmul

            def matmul(x, bias, out_dtype=None, gated=False, plain=plain):
                if gated:
                    gate, up = x.chunk(2, dim=-1)
                    x, gated = torch.nn.functional.silu(gate) * up, False
                q, scale = fp8_act_quant_reference(x.reshape(-1, x.shape[-1]), group)
                x = (q.float() * scale.repeat_interleave(group, 1)).view(x.shape).to(x.dtype)
                return plain(x, bias, out_dtype, gated)

            module.matmul = matmul


def test_fp8_checkpoint_gives_the_logits_of_its_dequantized_twin(checkpoints):
    fp8 = load(checkpoints["fp8"], "auto")
    assert fp8.fp8_scheme.from_checkpoint and fp8.fp8_scheme.block_n == 128
    layer = fp8.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (512, 2)  # one per row
    assert fp8.lm_head.weight.dtype == torch.float32  # the head and embeddings stay unquantized
    twin = load(checkpoints["twin"], "none")
    quantize_inputs_like_fp8(twin)
    for step, (a, b) in enumerate(zip(logits(fp8), logits(twin))):
        assert relative_error(a, b) < 1e-5, f"step {step}"
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_online_quantization_of_a_16_bit_checkpoint(checkpoints):
    model = load(checkpoints["src"], "fp8")
    assert model.fp8_scheme == ONLINE_RECIPE
    layer = model.model.layers[1].mlp.down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (256, 1)
    full = load_file(str(checkpoints["src"] / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    dequantized = layer.weight.float() * layer.weight_scale_inv
    assert (dequantized - full).abs().max() <= full.abs().max() / 16
    assert all(torch.isfinite(t).all() for t in logits(model))


def test_a_16_bit_update_of_an_fp8_checkpoint_is_quantized_with_its_recipe(checkpoints):
    """In-place weight updates (RL loops) send 16-bit tensors: they land as the checkpoint's own bytes."""
    fp8 = load(checkpoints["fp8"], "auto")
    twin = load_file(str(checkpoints["twin"] / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    layer = fp8.model.layers[0].self_attn.qkv_proj
    before = layer.weight.clone(), layer.weight_scale_inv.clone()
    layer.weight.data.zero_()
    layer.weight_scale_inv.data.fill_(3.0)
    targets = plan_update(fp8, [(name, tuple(twin[name].shape))])
    assert apply_update(targets, [(name, twin[name])]) == 1
    rows = slice(256, 384)  # k rows of the packed q | k | v
    assert torch.equal(layer.weight[rows].view(torch.uint8), before[0][rows].view(torch.uint8))
    torch.testing.assert_close(layer.weight_scale_inv[rows], before[1][rows], rtol=1e-6, atol=0)


def _tp_worker(rank: int, checkpoints: dict[str, Path], out: Path) -> None:
    results = {name: logits(load(path, quantization, TensorParallel.from_default_group()))
               for name, (path, quantization) in checkpoints.items()}
    if rank == 0:
        torch.save(results, out)


def test_two_ranks_give_one_rank_logits(checkpoints, tmp_path):
    cases = {"fp8-checkpoint": (checkpoints["fp8"], "auto"), "online": (checkpoints["src"], "fp8")}
    out = tmp_path / "tp2.pt"
    run_on_ranks(_tp_worker, (cases, out))
    sharded = torch.load(out)
    for name, (path, quantization) in cases.items():
        single = logits(load(path, quantization))
        assert len(sharded[name]) == STEPS + 1
        for step, (a, b) in enumerate(zip(sharded[name], single)):
            assert relative_error(a, b) < 1e-5, f"{name} step {step}"


def test_bad_combinations_fail_with_one_line():
    plain = {"architectures": ["Qwen3ForCausalLM"]}
    assert resolve_quantization("auto", plain) is None and resolve_quantization("none", plain) is None
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                   "activation_scheme": "dynamic"}}
    assert resolve_quantization("auto", fp8).block_k == 128
    with pytest.raises(ValueError, match="quantization=none cannot load this FP8 checkpoint"):
        resolve_quantization("none", fp8)
    with pytest.raises(ValueError, match=r"quantization must be one of auto\|fp8\|none, got 'int4'"):
        resolve_quantization("int4", plain)
    with pytest.raises(ValueError, match="quant_method='awq' is not supported"):
        resolve_quantization("auto", {"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="activation_scheme='static' is not supported"):
        resolve_quantization("fp8", {"quantization_config": {**fp8["quantization_config"],
                                                             "activation_scheme": "static"}})
    with pytest.raises(ValueError, match="weight_block_size must be"):
        resolve_quantization("fp8", {"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}})


def test_row_parallel_shards_must_hold_whole_blocks(checkpoints):
    """intermediate 512 over 8 ranks would be 64 columns per rank: half a 128-column block."""
    tp = TensorParallel(rank=0, world_size=8, group=None)
    cfg = {**config(checkpoints["fp8"]), "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32}
    with pytest.raises(ValueError, match="not a multiple of the weight block 128"):
        build_model(cfg, tp)


def test_the_engine_runs_an_fp8_checkpoint_and_rejects_a_bad_key(checkpoints, tmp_path):
    from spmd_engine.config import ConfigError, engine_config_from_dict
    from spmd_engine.llm import compose_config
    from tests.e2e.engine_args import tiny_args, write_prompts_file
    from tests.helpers.run_engine import generate_in_process

    prompts = write_prompts_file(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in PROMPTS])
    tokens = generate_in_process(tiny_args(checkpoints["fp8"], None, prompts, **{"sampling.max_tokens": 4}))
    assert [len(t) for t in tokens] == [4] * len(PROMPTS)
    with pytest.raises(ConfigError, match=r"^quantization must be one of auto\|fp8\|none, got 'int4'$"):
        engine_config_from_dict(compose_config("qwen3", {"quantization": "int4"})).validate(1)
