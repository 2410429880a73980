import os
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU, must precede @triton.jit


import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2-135M-Instruct as a HF directory, converted once into the shared cache."""
    from spmd_engine.models.gguf import embedded_model_dir

    return embedded_model_dir()
