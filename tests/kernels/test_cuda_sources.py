"""The CUDA decode kernels' sources, read from kernels/*.cu with their shared headers pasted in, are byte for
byte the text the kernels were built from when it lived in Python strings: moving it changed no kernel. A
deliberate change to a .cu/.cuh file updates the digest here (and is checked on a GPU by tests/gpu)."""
from __future__ import annotations

import hashlib

import pytest

from spmd_engine.kernels import cuda_rtc, decode_attention_cuda, decode_attention_fp8_cuda

# sha256 and length of each kernel's NVRTC input, as the Python strings of commit 5cf8b49 made it
EXPECTED = {
    decode_attention_cuda: ("0a28c3cb4dbcbc2a9cc06609b3c9b3072e33a7922e1ebf451607b11fa7ccbff3", 27252),
    decode_attention_fp8_cuda: ("04af0334d7e5658ee24303c98b96ac017a019c90e6df106fc16c1ebb2027e0dd", 30387),
}


@pytest.mark.parametrize("module", list(EXPECTED), ids=lambda m: m.__name__.rpartition(".")[2])
def test_each_kernel_compiles_the_source_it_always_did(module):
    source = cuda_rtc.read_source(module.SOURCE_FILE)
    digest, length = EXPECTED[module]
    assert (hashlib.sha256(source.encode()).hexdigest(), len(source)) == (digest, length)
    assert '#include "' not in source  # every local header pasted in: NVRTC gets no include path


def test_both_kernels_share_their_headers():
    sources = [cuda_rtc.read_source(module.SOURCE_FILE) for module in EXPECTED]
    for header in ("decode_attention_ptx.cuh", "decode_attention_split.cuh"):
        text = cuda_rtc.read_source(header)
        assert all(source.count(text) == 1 for source in sources)
