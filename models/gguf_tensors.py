"""What the llama (models/gguf.py) and Gemma 3 (models/gguf_gemma3.py) GGUF converters read alike: a metadata
field, and a tensor's Hugging Face name from the family's name tables."""
from __future__ import annotations


def gguf_field(reader, key: str, default=None):
    """A metadata field's value, `default` where the file has none."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def mapped_tensor_name(gguf_name: str, global_names: dict[str, str], layer_names: dict[str, str], family: str) -> str:
    """HF parameter name of a GGUF tensor: a global one by `global_names`, `blk.N.x` as `model.layers.N.` +
    `layer_names[x]` (ValueError naming `family` if unknown)."""
    if gguf_name in global_names:
        return global_names[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face {family} equivalent")
