"""A CUDA graph captured the way the engine captures its own: warm-up on a side stream, then the capture.

Why here: the PDL tests and the GPU benches in launch/bench/ replay the same kernels from graphs, and a
graph captured without the warm-up would time or compare Triton's first compilation instead.
"""
from __future__ import annotations

import torch


def capture(fn):
    """fn run once on a side stream (compiles and warms up, as the engine does before capture), then
    captured in a CUDA graph: (the graph, what fn returned during capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs
