"""Weight loading: stream FULL checkpoint tensors (HF names) into a model's sharded parameters.

Every source (safetensors files, seeded dummy weights, other formats converted to HF names) goes
through `load_weights`, which maps names to parameters, lets each parameter's `weight_loader`
keep this rank's shard, and checks that every expected tensor arrived exactly as shaped.
"""
from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from spmd_engine.models.causal_lm import CausalLM, ShardId

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# non-persistent buffers some exporters still save; recomputed here from the config
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: its parameter and, for a packed one, which part (q/k/v, gate/up)."""

    name: str  # the HF checkpoint name
    param: torch.nn.Parameter
    shard_id: ShardId


def weight_target(model: CausalLM, params: dict[str, torch.nn.Parameter], expected: dict[str, tuple[int, ...]],
                  name: str, shape: tuple[int, ...]) -> WeightTarget | None:
    """The parameter a FULL checkpoint tensor of `shape` loads into; None for a name the engine skips
    (non-persistent buffers, the head of a tied model). ValueError naming the tensor otherwise."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    if name == "lm_head.weight" and model.shape.tie_word_embeddings:
        return None  # tied: the head is the embedding
    if name not in expected:
        raise ValueError(f"checkpoint tensor {name!r} is not part of {model.shape.architecture}")
    if tuple(shape) != expected[name]:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(shape)}, expected {expected[name]}")
    param_name, shard_id = model.checkpoint_to_parameter(name)
    return WeightTarget(name, params[param_name], shard_id)


def load_into(target: WeightTarget, tensor: torch.Tensor) -> None:
    """This rank's shard of `tensor` copied into the target parameter (in place: its storage stays)."""
    if target.shard_id is None:
        target.param.weight_loader(target.param, tensor)
    else:
        target.param.weight_loader(target.param, tensor, target.shard_id)


def _with_aliases(named: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, str] | None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    for source_name, tensor in named:
        yield source_name, tensor
        if aliases and source_name in aliases:
            yield aliases[source_name], tensor


def expected_shapes(model: CausalLM) -> dict[str, tuple[int, ...]]:
    """The model's checkpoint tensors and, for an FP8 checkpoint (models/layers/fp8_linear.py), the block
    scales (`weight_scale_inv`) next to each quantized projection."""
    shapes = model.checkpoint_shapes()
    scheme = getattr(model, "fp8_scheme", None)
    if scheme is not None and scheme.from_checkpoint:
        from spmd_engine.models.layers.fp8_linear import scale_checkpoint_shapes

        shapes.update(scale_checkpoint_shapes(shapes, scheme))
    return shapes


def load_weights(
    model: CausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, str] | None = None
) -> None:
    """Load (HF name, full tensor) pairs; `aliases` loads a tensor under a second name as well.

    Raises ValueError on an unexpected name, a wrong shape or a tensor missing at the end. A projection of an
    FP8 model that arrives in 16 bits is quantized at load and needs no `weight_scale_inv`.
    """
    expected = expected_shapes(model)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for name, tensor in _with_aliases(named_tensors, aliases):
        target = weight_target(model, params, expected, name, tuple(tensor.shape))
        if target is not None:
            load_into(target, tensor)
            seen.add(name)
            if tensor.dtype != torch.float8_e4m3fn and name + "_scale_inv" in expected:
                seen.add(name + "_scale_inv")  # quantized at load: its scales were written with it
    missing = sorted(set(expected) - seen)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} tensors of {model.shape.architecture}: "
                         f"{', '.join(missing[:3])}{more}")


def plan_update(model: CausalLM, named_shapes: Iterable[tuple[str, tuple[int, ...]]],
                aliases: dict[str, str] | None = None) -> dict[str, WeightTarget]:
    """HF name -> target for an in-place update of some of the weights, every name and shape checked
    first (ValueError naming the first bad one), so a bad batch changes nothing."""
    expected = expected_shapes(model)
    params = dict(model.named_parameters())
    targets: dict[str, WeightTarget] = {}
    for name, shape in _with_aliases(named_shapes, aliases):
        target = weight_target(model, params, expected, name, tuple(shape))
        if target is not None:
            targets[name] = target
    return targets


@torch.no_grad()
def apply_update(targets: dict[str, WeightTarget], named_tensors: Iterable[tuple[str, torch.Tensor]],
                 aliases: dict[str, str] | None = None) -> int:
    """Copy each tensor of a batch `plan_update` checked into its parameter; the number of tensors copied."""
    copied = 0
    for name, tensor in _with_aliases(named_tensors, aliases):
        target = targets.get(name)
        if target is not None:
            load_into(target, tensor)
            copied += 1
    return copied


def head_aliases(model: CausalLM, names: set[str]) -> dict[str, str] | None:
    """An untied model whose checkpoint has no `lm_head.weight` gets the embedding as its head."""
    if model.shape.tie_word_embeddings or "lm_head.weight" in names or "model.embed_tokens.weight" not in names:
        return None
    return {"model.embed_tokens.weight": "lm_head.weight"}


def _check_shard_name(root: Path, name: object) -> None:
    """A shard the index names must be a file inside the checkpoint dir (no absolute path, no `..`).

    Why: the index comes with downloaded weights; it must not make the engine read files elsewhere.
    Symlinks inside the dir (the Hugging Face cache's snapshots) are the owner's own and allowed.
    """
    normal = os.path.normpath(name) if isinstance(name, str) and name and "\0" not in name else None
    inside = normal is not None and not os.path.isabs(normal) and normal.split(os.sep)[0] not in ("..", ".")
    if not inside:
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:80] + "..."
        raise ValueError(f"model.path {str(root)!r}: {INDEX_FILE} names shard {shown}, which is not a file "
                         "inside the checkpoint dir (weight_map values must be file names relative to it)")


def safetensors_files(checkpoint_dir: str | Path) -> list[Path]:
    """The checkpoint's .safetensors files: the index's shards, the single file, or every one."""
    root = Path(checkpoint_dir)
    if (root / INDEX_FILE).is_file():
        weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise ValueError(f"model.path {str(root)!r}: {INDEX_FILE}'s weight_map is not an object")
        names = set(weight_map.values())
        for name in sorted(names, key=repr):
            _check_shard_name(root, name)
        return [root / name for name in sorted(names)]
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.path {str(root)!r} holds no .safetensors files")
    return files


def stream_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files, one in memory at a time."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the files, from their headers (no tensor is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


@torch.no_grad()
def load_safetensors_weights(model: CausalLM, checkpoint_dir: str | Path) -> dict[str, str] | None:
    """Load an HF safetensors checkpoint (single file or sharded), one tensor in memory at a time.

    An untied model whose checkpoint has no `lm_head.weight` gets the embedding as its head: the
    aliases returned (None: none), which an in-place update of the embedding applies again.
    """
    files = safetensors_files(checkpoint_dir)
    aliases = None
    if not model.shape.tie_word_embeddings:
        aliases = head_aliases(model, set(tensor_shapes(files)))
    load_weights(model, stream_safetensors(files), aliases)
    return aliases


def _dummy_tensors(
    shapes: dict[str, tuple[int, ...]], seed: int, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    for name in sorted(shapes):
        generator = torch.Generator(device=device)
        # 32 bits (the CPU generator keeps no more), stable across processes unlike hash()
        generator.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        tensor = torch.randn(shapes[name], generator=generator, device=device, dtype=dtype).mul_(0.02)
        if name.endswith("norm.weight"):
            tensor.add_(1.0)
        yield name, tensor


@torch.no_grad()
def load_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights of the real shapes, identical for every tensor-parallel size.

    Each FULL checkpoint-shaped tensor comes from its own generator (seeded by `seed` and the
    tensor's name) on the parameters' device, then goes through the normal weight loaders: norms
    ~1, everything else ~N(0, 0.02).
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    first = next(model.parameters())
    load_weights(model, _dummy_tensors(model.checkpoint_shapes(), seed, first.device, first.dtype))
