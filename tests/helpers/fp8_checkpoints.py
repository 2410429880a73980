"""FP8 block-scaled checkpoints made from a tiny 16/32-bit one with the recipe of Qwen's FP8 releases:
every decoder projection as float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block (the
block's largest magnitude / 448), everything else as it was, and `quantization_config` in config.json;
and the dequantized twin (the same weights as q * scale in float32, no quantization_config)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from spmd_engine.kernels.reference import fp8_dequantize_weight_reference, fp8_quantize_weight_reference


def _is_projection(name: str, tensor: torch.Tensor) -> bool:
    return ".layers." in name and name.endswith("_proj.weight") and tensor.dim() == 2


def _copy_dir(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.suffix != ".safetensors" and item.name != "model.safetensors.index.json" and item.is_file():
            shutil.copy(item, dst / item.name)


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """`src` (a one-file checkpoint) quantized into `dst`."""
    _copy_dir(src, dst)
    tensors = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if _is_projection(name, tensor):
            q, scale = fp8_quantize_weight_reference(tensor, *block)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
        else:
            tensors[name] = tensor
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def write_dequantized_twin(fp8_dir: Path, dst: Path) -> Path:
    """The FP8 checkpoint's weights as float32 q * scale, a plain checkpoint."""
    _copy_dir(fp8_dir, dst)
    config = json.loads((fp8_dir / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    loaded = load_file(str(fp8_dir / "model.safetensors"))
    tensors = {}
    for name, tensor in loaded.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = fp8_dequantize_weight_reference(tensor, loaded[name + "_scale_inv"], *block)
        tensors[name] = tensor
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
