"""Programmatic Dependent Launch (kernels/pdl.py): where the switch turns it on, that every kernel waits for
its predecessor before touching memory, and that requesting it on CPU / under the interpreter changes nothing."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from spmd_engine.kernels import pdl
from tests.kernels.paged_batch import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # triton interpreter noise

REPO = Path(__file__).resolve().parents[2]
# every module whose kernels run in a decode / mixed step or the sampler
KERNEL_MODULES = ("gemv", "rms_norm", "qk_norm_rope_store", "decode_attention", "decode_rotary_attention",
                  "mixed_attention", "prefill_attention", "kv_store", "kv_int8", "silu_and_mul", "rotary",
                  "sampling_noise")


@pytest.fixture(autouse=True)
def pdl_off_afterwards():
    yield
    pdl.set_pdl(False)


def _is_triton_jit(node: ast.FunctionDef) -> bool:
    return any("triton.jit" in ast.unparse(d) for d in node.decorator_list)


def test_every_kernel_waits_for_its_predecessor_before_anything_else():
    """The rule that makes PDL safe: each @triton.jit entry point (`*_kernel`) takes USE_PDL and its first
    statement (after the docstring) is `pdl_prologue(USE_PDL)`, so no load, store or atomic runs before the
    previous kernel has completed."""
    kernels = 0
    for name in KERNEL_MODULES:
        tree = ast.parse((REPO / "kernels" / f"{name}.py").read_text())
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and _is_triton_jit(node)):
                continue
            kernels += 1
            params = [a.arg for a in node.args.args]
            assert "USE_PDL" in params, f"{name}.{node.name} takes no USE_PDL"
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(
                node.body[0].value, ast.Constant) else node.body
            assert ast.unparse(body[0]) == "pdl_prologue(USE_PDL)", f"{name}.{node.name} starts with something else"
    assert kernels == 20  # gemv 1, rms_norm 2, qk 1, decode 2, rotary decode 1, mixed 1, prefill 1, kv 1, kv_int8 2,
    # silu 1, rotary 1, sampling 6


def test_off_on_cpu_and_under_the_interpreter_whatever_is_requested(monkeypatch):
    pdl.set_pdl(True)
    assert dict(pdl.pdl_launch(torch.device("cpu"))) == {"USE_PDL": False}
    assert not pdl.pdl_enabled("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pdl.set_pdl(True)  # a CUDA device under the interpreter: still off (the interpreter cannot run gdc_wait)
    assert not pdl.pdl_supported(torch.device("cuda:0")) and not pdl.pdl_enabled("cuda:0")


def test_on_only_where_requested_and_supported(monkeypatch):
    """The decision alone (no GPU here): a capable CUDA device gets `launch_pdl` with the constexpr, until
    the switch is turned off; a ROCm device never does, whatever its capability reads."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(pdl, "_launch_option_exists", lambda: True)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    cuda = torch.device("cuda:0")
    pdl.set_pdl(False)
    assert dict(pdl.pdl_launch(cuda)) == {"USE_PDL": False}  # off by default until set
    pdl.set_pdl(True)
    assert dict(pdl.pdl_launch(cuda)) == {"USE_PDL": True, "launch_pdl": True} and pdl.pdl_enabled(cuda)
    assert dict(pdl.pdl_launch(torch.device("cpu"))) == {"USE_PDL": False}
    pdl.set_pdl(False)
    assert dict(pdl.pdl_launch(cuda)) == {"USE_PDL": False}
    monkeypatch.undo()
    monkeypatch.setattr(torch.version, "hip", "6.2")
    pdl._device_supports.cache_clear()
    try:
        assert not pdl._device_supports(0)  # without asking the (absent) GPU
    finally:
        pdl._device_supports.cache_clear()


def test_triton_has_the_grid_dependency_control_the_kernels_use():
    """This Triton (CI's) has gdc_wait / gdc_launch_dependents and the launch_pdl option; without them the
    switch would be a silent no-op everywhere."""
    assert pdl.GDC_AVAILABLE and pdl._launch_option_exists()


def test_kernels_requested_with_pdl_on_cpu_give_the_same_bits():
    """cuda_pdl=true on a CPU run: the interpreter never sees USE_PDL=True (it would fail on gdc_wait)."""
    from spmd_engine.kernels.gemv import gemv
    from spmd_engine.kernels.rms_norm import rms_norm
    from spmd_engine.kernels.rotary import apply_rotary
    from spmd_engine.kernels.silu_and_mul import silu_and_mul

    gen = torch.Generator().manual_seed(0)
    x, res = torch.randn(3, 64, generator=gen).to(DEVICE), torch.randn(3, 64, generator=gen).to(DEVICE)
    w, mat = torch.randn(64, generator=gen).to(DEVICE), torch.randn(40, 32, generator=gen).to(DEVICE)
    cos, sin = torch.randn(3, 8, generator=gen).to(DEVICE), torch.randn(3, 8, generator=gen).to(DEVICE)

    def run():
        return [*rms_norm(x, w, 1e-6, res), silu_and_mul(x), gemv(x, mat, gated=True),
                apply_rotary(x.view(3, 4, 16), cos, sin)]

    pdl.set_pdl(False)
    off = run()
    pdl.set_pdl(True)
    on = run()
    assert all(torch.equal(a, b) for a, b in zip(off, on))


_PTX_CHECK = textwrap.dedent("""
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from spmd_engine.kernels.gemv import _gemv_kernel
    from spmd_engine.kernels.rms_norm import _rms_norm_kernel

    def ptx(kernel, signature, constants, options):
        source = ASTSource(kernel, {**signature, **{c: "constexpr" for c in constants}}, constexprs=constants)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    P = "*bf16"
    rms = ({"x": P, "residual": P, "weight": P, "out": P, "residual_out": P, "heads": "i32", "stride_x_tok": "i32",
            "stride_x_head": "i32", "stride_res_row": "i32", "num_cols": "i32", "eps": "fp32"},
           dict(HAS_RESIDUAL=True, BLOCK=1024))
    gemv = ({"x": P, "w": P, "bias": P, "out": P, "partial": "*fp32", "counters": "*i32", "M": "i32", "N": "i32",
             "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32", "k_per_split": "i32"},
            dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT=4, ONE_LAUNCH=True, HAS_BIAS=False, EVEN_K=True,
                 EVEN_N=True, PRECISION=None, GATED=True))
    try:  # can this machine compile for a CUDA target at all (LLVM, ptxas)? else nothing to check
        ptx(_rms_norm_kernel, rms[0], {**rms[1], "USE_PDL": False}, {"num_warps": 4})
    except Exception as err:
        print(json.dumps({"skip": f"{type(err).__name__}: {err}"[:300]}))
        sys.exit(0)
    result = {}
    for name, kernel, (signature, constants), options in (
            ("rms_norm", _rms_norm_kernel, rms, {"num_warps": 4}),
            ("gemv", _gemv_kernel, gemv, {"num_warps": 4, "num_stages": 4})):
        for on in (False, True):
            lines = ptx(kernel, signature, {**constants, "USE_PDL": on}, {**options, "launch_pdl": on}).splitlines()
            first = lambda pattern: next((i for i, l in enumerate(lines) if re.search(pattern, l)), None)
            result[f"{name} {on}"] = {"wait": first(r"griddepcontrol\\.wait"),
                                      "launch": first(r"griddepcontrol\\.launch_dependents"),
                                      "memory": first(r"\\b(ld|st|atom|red)\\.global|cp\\.async")}
    print(json.dumps(result))
""")


def test_compiled_for_sm90_the_wait_precedes_every_global_memory_access():
    """The PTX Triton makes for an H200 (compiled here, nothing launched): with USE_PDL the kernel's first
    grid-dependency wait comes before its first global load / store / atomic / async copy, then the
    launch of dependents; without it there is no griddepcontrol at all."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO), "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", _PTX_CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"cannot compile for a CUDA target here: {result['skip']}")
    for name in ("rms_norm", "gemv"):
        off, on = result[f"{name} False"], result[f"{name} True"]
        assert off["wait"] is None and off["launch"] is None and off["memory"] is not None, (name, off)
        assert on["memory"] is not None and on["wait"] is not None and on["launch"] is not None, (name, on)
        assert on["wait"] < on["launch"] and on["wait"] < on["memory"], (name, on)
