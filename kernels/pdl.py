"""Programmatic Dependent Launch (PDL) for the Triton kernels: the one place that decides whether it is on.

Why: at decode batch 1 a step is ~230 small dependent kernels replayed from one CUDA graph, and the gap
between two of them (launch, CTA dispatch, ramp: ~1-1.5 us) is a large share of the step. On Hopper
(sm_90+) a kernel launched with PDL may start while its predecessor still runs; it blocks at
`griddepcontrol.wait` until the predecessor has completed and its memory is visible. CUDA graphs
captured from a stream keep the launches' PDL attribute as programmatic edges.

The rule every kernel here keeps: `pdl_prologue(USE_PDL)` is the kernel's FIRST statement, so nothing
(no load, no store, no atomic) runs before the predecessor has completed (read-after-write and
write-after-read hazards alike), and only then it lets its own successor launch. Completion is
therefore transitive down the stream and every kernel's bits are the same with PDL on or off; what
overlaps is only the successor's launch and CTA dispatch with the predecessor's tail.

The one exception, the CUDA decode kernels (kernels/decode_attention_cuda.py `pipeline_tiles`): they let
their successor launch first and start copying tiles of older keys before `griddepcontrol.wait`. Those
keys were written by earlier steps, whose kernels had completed before the predecessor passed its own
wait (the only way it could let this kernel launch); q and the step's new K/V row, which the predecessor
writes (or the qkv rows the kernel prepares them from, `DecodePrologue`), and every write of the kernel
(that row's store among them) come after the wait. So the bits stay the same and completion stays
transitive, and the K/V stream overlaps the kernel before it.

The switch (`set_pdl`, or `pdl_launches` around a block: the engine asks for it per captured decode
graph, see executor/cuda_graphs.PDL_MAX_ROWS) is a request; a launch uses PDL only where it can run:
a CUDA (not ROCm) device of compute capability >= 9.0, not under TRITON_INTERPRET, and a Triton that
has `triton.language.extra.cuda.gdc_wait` / `gdc_launch_dependents` and the `launch_pdl` launch
option. Anywhere else the request is a silent no-op (the start-up log says whether it is on).
Every call site spreads `**pdl_launch(device)` into its launch: `USE_PDL` (the kernel's constexpr) and,
when on, `launch_pdl=True`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import types
from collections.abc import Iterator, Mapping

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3 (the GPU's 3.6, this machine's 3.9); older Triton: no PDL, kernels unchanged
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    GDC_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    gdc_launch_dependents = gdc_wait = None
    GDC_AVAILABLE = False


if GDC_AVAILABLE:
    @triton.jit
    def pdl_prologue(USE_PDL: tl.constexpr):
        """Wait for the predecessor kernel to complete (its writes visible), then let the successor launch.
        A kernel's first statement; with USE_PDL False it compiles (and interprets) to nothing."""
        if USE_PDL:
            gdc_wait()
            gdc_launch_dependents()
else:  # pragma: no cover - depends on the installed Triton
    @triton.jit
    def pdl_prologue(USE_PDL: tl.constexpr):
        """No grid-dependency control in this Triton: PDL is never enabled (`pdl_supported`)."""
        pass


_ON: Mapping[str, bool] = types.MappingProxyType({"USE_PDL": True, "launch_pdl": True})
_OFF: Mapping[str, bool] = types.MappingProxyType({"USE_PDL": False})

_requested = False  # set_pdl's last request (off outside the small decode graphs' capture)


def triton_interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (which has no PTX: no PDL, no libdevice)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _launch_option_exists() -> bool:
    """Whether this Triton's CUDA backend takes the `launch_pdl` launch option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


@functools.cache
def _device_supports(index: int) -> bool:
    """CUDA (not ROCm, whose capabilities also read 9.x) of compute capability >= 9.0."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_supported(device: torch.device | str) -> bool:
    """Whether kernels on `device` could launch with PDL (whatever the switch says)."""
    device = torch.device(device)
    if device.type != "cuda" or not GDC_AVAILABLE or triton_interpreting() or not _launch_option_exists():
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def set_pdl(enabled: bool) -> None:
    """Request PDL (or not) for every later launch until the next request; a captured graph keeps the
    launches it recorded. A no-op where `pdl_supported` is False."""
    global _requested
    _requested = bool(enabled)
    _cache.clear()


_cache: dict[torch.device, Mapping[str, bool]] = {}


@contextlib.contextmanager
def pdl_launches(enabled: bool) -> Iterator[None]:
    """The launches (and captures) inside the block use PDL as `enabled` says, where it can run; the
    request before it holds again after. Why: PDL pays for small launches only (a decode graph of few
    rows) and costs a little at 256 rows, so the engine asks for it per captured graph."""
    before = _requested
    set_pdl(enabled)
    try:
        yield
    finally:
        set_pdl(before)


def pdl_launch(device: torch.device) -> Mapping[str, bool]:
    """The launch keywords for a kernel on `device`: `{"USE_PDL": True, "launch_pdl": True}` when PDL is
    requested and can run there, else `{"USE_PDL": False}`. One dict lookup per launch (host cost matters
    at batch 1 outside the graphs)."""
    kwargs = _cache.get(device)
    if kwargs is None:
        kwargs = _ON if _requested and pdl_supported(device) else _OFF
        _cache[device] = kwargs
    return kwargs


def pdl_enabled(device: torch.device | str) -> bool:
    """Whether launches on `device` use PDL now."""
    return pdl_launch(torch.device(device))["USE_PDL"]
