"""The checkpoint's tokenizer, loaded for the public API and the job alike.

Why its own module: `LLM` and the Hydra job both need it, and the API must not depend on the job
package; transformers is imported only when a checkpoint ships tokenizer files, so ranks without
one never pay for it.
"""
from __future__ import annotations

import os


def load_tokenizer(model_dir: str | os.PathLike | None):
    """The checkpoint's HF tokenizer, or None when it ships no tokenizer files."""
    from spmd_engine.models.checkpoint import has_tokenizer

    if model_dir is None or not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
