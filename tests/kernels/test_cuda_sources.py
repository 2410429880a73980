"""The CUDA decode kernels' sources, read from kernels/*.cu with their shared headers pasted in, are the code
the kernels were built from when it lived in Python strings (commit 5cf8b49), comments and blank lines aside:
moving it changed no kernel. A deliberate change to the code of a .cu/.cuh file updates the digest here (and is
checked on a GPU by tests/gpu)."""
from __future__ import annotations

import hashlib
import re

import pytest

from spmd_engine.kernels import cuda_rtc, decode_attention_cuda, decode_attention_fp8_cuda

# sha256 and length of each kernel's NVRTC input without its comments and blank lines (`code_only`), as the
# Python strings of commit 5cf8b49 made it
EXPECTED = {
    decode_attention_cuda: ("17ee79e223ff811c3332ccced02eb426e9c7b186042d6f9ebf81c54bda8e6b60", 21201),
    decode_attention_fp8_cuda: ("738f2ac6a4d5ad5280e0fe1f0ce3bb83769d9ab987a34d4c656f959e9d1fe15c", 23703),
}


def code_only(source: str) -> str:
    """The source without /* */ and // comments, trailing blanks and empty lines (the sources hold no strings)."""
    source = re.sub(r"/\*.*?\*/", "", source, flags=re.S)
    source = re.sub(r"//[^\n]*", "", source)
    return "\n".join(line.rstrip() for line in source.splitlines() if line.strip())


@pytest.mark.parametrize("module", list(EXPECTED), ids=lambda m: m.__name__.rpartition(".")[2])
def test_each_kernel_compiles_the_source_it_always_did(module):
    source = cuda_rtc.read_source(module.SOURCE_FILE)
    digest, length = EXPECTED[module]
    code = code_only(source)
    assert (hashlib.sha256(code.encode()).hexdigest(), len(code)) == (digest, length)
    assert '#include "' not in source  # every local header pasted in: NVRTC gets no include path


def test_both_kernels_share_their_headers():
    sources = [cuda_rtc.read_source(module.SOURCE_FILE) for module in EXPECTED]
    for header in ("decode_attention_ptx.cuh", "decode_attention_split.cuh"):
        text = cuda_rtc.read_source(header)
        assert all(source.count(text) == 1 for source in sources)
