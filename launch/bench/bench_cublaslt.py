"""Every cuBLASLt algorithm its heuristic offers for the decode step's projections, timed in CUDA graphs.

Why: at 32-256 rows the four projections of a Qwen3-0.6B layer take ~27 µs (`launch/bench/bench_l2_weights.py`:
latency-bound in cuBLAS, not by HBM) against ~8 µs of weight bytes, and torch offers no choice of GEMM
algorithm on this build (TunableOp lists only `Default` on torch 2.11 + CUDA 13.0). cuBLASLt's own API ranks many
candidates per shape (tile, split-K, stages); this times each one as the engine runs it (28 layers of
distinct weights per graph, so the weights come from HBM) against `F.linear`, and says whether its output
is bit for bit `F.linear`'s. The library is reached by ctypes from torch's own CUDA wheels, as
kernels/cuda_rtc.py reaches NVRTC. H200, 129 rows: the best candidates 26.60 µs a layer against F.linear's
26.89, 8 µs a step (0.2 %): no cuBLASLt path of our own. CUDA only:

    python launch/bench/bench_cublaslt.py [--rows 32 129 256] [--algos 32]
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys

import torch
import torch.nn.functional as F

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from bench_fused_ops import graph_ms

# cublasLt.h / library_types.h values (CUDA 12 and 13)
CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLASLT_MATMUL_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSB = 3, 4
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1
CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_SPLITK_NUM = 0, 1, 2
WORKSPACE_BYTES = 32 << 20
LAYERS = 28
SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}  # (N, K)


class Algo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: 8 opaque uint64."""
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t (96 bytes)."""
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library() -> ctypes.CDLL:
    major = (torch.version.cuda or "12").split(".")[0]
    names = [f"libcublasLt.so.{major}"]
    for root in sys.path:
        for pattern in ("nvidia/cublas/lib/libcublasLt.so*", "nvidia/cu*/lib/libcublasLt.so*"):
            names += sorted(glob.glob(os.path.join(root, pattern)))
    names += sorted(glob.glob(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64", "libcublasLt.so*")))
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise SystemExit("cuBLASLt not found: " + "; ".join(errors[-3:]))


LT = None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cublasStatus {status}")


class Gemm:
    """y [M, N] = x [M, K] @ w[N, K]^T in bf16 with float32 accumulation, as F.linear: column-major
    D [N, M] = op_T(A = w as K x N) * B (= x as K x M)."""

    def __init__(self, handle: ctypes.c_void_p, rows: int, n: int, k: int) -> None:
        self.handle, self.m, self.n, self.k = handle, rows, n, k
        self.desc = ctypes.c_void_p()
        _check(LT.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        for attr, op in ((CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T), (CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N)):
            value = ctypes.c_int32(op)
            _check(LT.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.c_size_t(4)),
                   "desc attribute")
        self.a, self.b, self.d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for layout, (r, c, ld) in ((self.a, (k, n, k)), (self.b, (k, rows, k)), (self.d, (n, rows, n))):
            _check(LT.cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_R_16BF, ctypes.c_uint64(r),
                                                 ctypes.c_uint64(c), ctypes.c_int64(ld)), "layout")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def candidates(self, count: int) -> list[HeuristicResult]:
        pref = ctypes.c_void_p()
        _check(LT.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(LT.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                        ctypes.byref(ws), ctypes.c_size_t(8)), "preference attribute")
        results = (HeuristicResult * count)()
        returned = ctypes.c_int(0)
        _check(LT.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d, pref, count,
                                                 results, ctypes.byref(returned)), "heuristic")
        LT.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def run(self, algo: Algo, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, workspace: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        _check(LT.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()),
                                 self.a, ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta),
                                 ctypes.c_void_p(y.data_ptr()), self.d, ctypes.c_void_p(y.data_ptr()), self.d,
                                 ctypes.byref(algo), ctypes.c_void_p(workspace.data_ptr()),
                                 ctypes.c_size_t(WORKSPACE_BYTES), ctypes.c_void_p(stream)), "matmul")


def algo_config(algo: Algo) -> str:
    parts = []
    for name, attr in (("id", CUBLASLT_ALGO_CONFIG_ID), ("tile", CUBLASLT_ALGO_CONFIG_TILE_ID),
                       ("splitk", CUBLASLT_ALGO_CONFIG_SPLITK_NUM)):
        value, written = ctypes.c_int32(0), ctypes.c_size_t(0)
        status = LT.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                         ctypes.c_size_t(4), ctypes.byref(written))
        parts.append(f"{name} {value.value}" if status == 0 else f"{name} ?")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 129, 256])
    parser.add_argument("--algos", type=int, default=32, help="candidates asked of the heuristic per shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cublaslt.py needs a CUDA GPU")
    global LT
    LT = _library()
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")  # torch's context first
    handle = ctypes.c_void_p()
    _check(LT.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}; µs per layer's GEMM, {LAYERS} layers of "
          "distinct weights per graph")
    for rows in args.rows:
        for name, (n, k) in SHAPES.items():
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            reference = F.linear(x, weights[0])
            base = graph_ms(lambda: [torch.mm(x, w.t(), out=y) for w in weights]) * 1e3 / LAYERS  # F.linear's GEMM
            gemm = Gemm(handle, rows, n, k)
            timed = []
            for i, result in enumerate(gemm.candidates(args.algos)):
                try:
                    gemm.run(result.algo, x, weights[0], y, workspace)
                    torch.cuda.synchronize()
                    same = torch.equal(y, reference)
                    close = (y.float() - reference.float()).abs().max().item()
                    us = graph_ms(lambda: [gemm.run(result.algo, x, w, y, workspace) for w in weights]) * 1e3 / LAYERS
                    timed.append((us, i, algo_config(result.algo), same, close, result.workspace_size))
                except RuntimeError as exc:
                    timed.append((float("inf"), i, f"failed: {exc}", False, float("nan"), 0))
            timed.sort()
            print(f"\n{rows} rows x {name} [N {n}, K {k}]: F.linear {base:.2f} µs; heuristic's first "
                  f"{next((t[0] for t in timed if t[1] == 0), float('nan')):.2f} µs; {len(timed)} candidates")
            for us, i, config, same, close, ws in timed[:5]:
                print(f"   #{i:2d} {us:7.2f} µs  {config}  workspace {ws >> 10} KiB  "
                      f"{'bitwise F.linear' if same else f'max |diff| {close:.2e}'}")


if __name__ == "__main__":
    main()
