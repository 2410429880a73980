"""CUDA C++ kernels compiled at run time with NVRTC and launched through the driver API (ctypes).

Why: a kernel that must choose its own register layouts (the fp8 decode attention: e4m3 operands
converted straight into the MMA fragments) cannot be written in Triton, and a torch C++ extension
needs nvcc, a host compiler and a minute of build per machine. NVRTC ships with every CUDA build of
torch (`libnvrtc`), compiles one kernel in about a second, and the driver launch goes on torch's
current stream, so CUDA graphs capture it like any other kernel. The sources are `.cu` files next to this
module; their `#include "x.cuh"` lines name headers beside them, which `read_source` pastes in before NVRTC sees
the text (no include paths, no system headers: inline PTX and builtins only), so nothing but the two libraries
is needed.
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
from functools import lru_cache

import torch

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
_LOCAL_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.]+)"\n', re.M)
_NVRTC_SUCCESS = 0
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_FUNC_ATTRIBUTE_NUM_REGS = 4
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuLaunchKernelEx)."""
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


class CudaRtcUnavailable(RuntimeError):
    """NVRTC or the CUDA driver library cannot be loaded here (callers fall back to Triton)."""


def _candidate_nvrtc_paths() -> list[str]:
    major = (torch.version.cuda or "12").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    for root in sys.path:  # the pip wheels' layouts: nvidia/cuda_nvrtc/lib (cu12), nvidia/cu13/lib (cu13)
        for pattern in ("nvidia/cuda_nvrtc/lib/libnvrtc.so*", "nvidia/cu*/lib/libnvrtc.so*"):
            names += sorted(p for p in glob.glob(os.path.join(root, pattern)) if "builtins" not in p
                            and ".alt." not in p)
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    names += sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")))
    return names


@lru_cache(maxsize=1)
def _nvrtc() -> ctypes.CDLL:
    errors = []
    for name in _candidate_nvrtc_paths():
        try:
            return ctypes.CDLL(name)
        except OSError as err:
            errors.append(str(err))
    raise CudaRtcUnavailable("NVRTC not found: " + "; ".join(errors[-3:]))


@lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise CudaRtcUnavailable(f"libcuda.so.1 not loadable: {err}") from err


@lru_cache(maxsize=1)
def available() -> bool:
    """NVRTC and the driver library both load here (a CPU-only machine usually has neither)."""
    try:
        _nvrtc()
        _driver()
    except CudaRtcUnavailable:
        return False
    return True


def _check_driver(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(name))
        raise RuntimeError(f"{what}: CUDA driver error {result} ({(name.value or b'?').decode()})")


@lru_cache(maxsize=None)
def read_source(name: str) -> str:
    """The text of kernels/`name` with each `#include "x.cuh"` line (a header beside it, itself read the same
    way) replaced by that header's text: the one self-contained source NVRTC compiles."""
    with open(os.path.join(SOURCE_DIR, name), encoding="utf-8") as handle:
        text = handle.read()
    return _LOCAL_INCLUDE.sub(lambda match: read_source(match.group(1)), text)


def nvrtc_compile(source: str, name: str, arch: str, defines: dict[str, int | str]) -> bytes:
    """Source -> cubin for `arch` (e.g. "sm_90"); one clear error with NVRTC's log on failure."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None):
        raise RuntimeError(f"nvrtcCreateProgram failed for {name}")
    options = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", "--use_fast_math"]
    options += [f"-D{key}={value}" for key, value in sorted(defines.items())]
    encoded = [o.encode() for o in options]
    array = (ctypes.c_char_p * len(encoded))(*encoded)
    try:
        result = lib.nvrtcCompileProgram(prog, len(encoded), array)
        if result != _NVRTC_SUCCESS:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name} ({' '.join(options)}):\n{log.value.decode()}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class CudaKernel:
    """One loaded kernel: `launch(grid, args)` on torch's current stream. `arg_types` are ctypes types
    in the kernel's parameter order (pointers as c_void_p: pass tensors or ints). The parameter block
    is built once and refilled per launch (the driver copies it at launch: a graph keeps its values)."""

    def __init__(self, function: ctypes.c_void_p, module: ctypes.c_void_p, arg_types: tuple, threads: int,
                 shared_bytes: int, registers: int) -> None:
        self.function, self.module = function, module
        self.threads, self.shared_bytes, self.registers = threads, shared_bytes, registers
        self._values = [kind() for kind in arg_types]
        self._params = (ctypes.c_void_p * len(arg_types))(*[ctypes.addressof(v) for v in self._values])
        self._pdl_attribute = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._pdl_config = _LaunchConfig(block_x=threads, block_y=1, block_z=1, shared_bytes=shared_bytes,
                                         attrs=ctypes.pointer(self._pdl_attribute), num_attrs=1)

    def launch(self, grid: tuple[int, int, int], args: list, pdl: bool = False) -> None:
        """`pdl`: launch with Programmatic Dependent Launch (sm_90+; kernels/pdl.py's rule: the kernel's
        first statement waits for its predecessor), so its launch overlaps the predecessor's tail."""
        if len(args) != len(self._values):
            raise TypeError(f"kernel takes {len(self._values)} arguments, got {len(args)}")
        for value, arg in zip(self._values, args):
            value.value = arg.data_ptr() if isinstance(arg, torch.Tensor) else arg
        stream = torch.cuda.current_stream().cuda_stream
        if not pdl:
            _check_driver(_driver().cuLaunchKernel(
                self.function, grid[0], grid[1], grid[2], self.threads, 1, 1, self.shared_bytes,
                ctypes.c_void_p(stream), self._params, None,
            ), "cuLaunchKernel")
            return
        config = self._pdl_config
        config.grid_x, config.grid_y, config.grid_z = grid
        config.stream = stream
        _check_driver(_driver().cuLaunchKernelEx(ctypes.byref(config), self.function, self._params, None),
                      "cuLaunchKernelEx")


def load_kernel(cubin: bytes, name: str, arg_types: tuple, threads: int, shared_bytes: int) -> CudaKernel:
    """Load `cubin` into the current context (torch's, on its current device) and fetch `name`."""
    torch.ones(1, device=torch.cuda.current_device())  # the device's primary context exists and is current
    driver = _driver()
    module = ctypes.c_void_p()
    _check_driver(driver.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)), f"loading {name}")
    function = ctypes.c_void_p()
    _check_driver(driver.cuModuleGetFunction(ctypes.byref(function), module, name.encode()), f"finding {name}")
    if shared_bytes > 48 * 1024:
        _check_driver(driver.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                shared_bytes), f"shared memory of {name}")
    registers = ctypes.c_int()
    _check_driver(driver.cuFuncGetAttribute(ctypes.byref(registers), _CU_FUNC_ATTRIBUTE_NUM_REGS, function),
                  f"registers of {name}")
    return CudaKernel(function, module, arg_types, threads, shared_bytes, registers.value)
