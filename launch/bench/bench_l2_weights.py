"""Do the decode step's projections run faster with their weights in L2, and does an L2 prefetch pay?

Why: at 32-256 rows the four projections of a Qwen3-0.6B layer take ~27 µs for ~8 µs of weight bytes. If
HBM latency were the cause, prefetching a layer's weights into L2 (during attention, which streams the
KV cache with an evict-first policy) would pay. Times, per layer, CUDA graphs of 28 layers with distinct
weights: the GEMMs cold, the GEMMs on one layer's weights (hot in L2), a 400 MB evict-first read standing
for attention, and three prefetches (bulk `cp.async.bulk.prefetch.L2`, per-line `prefetch.global.L2::evict_last`,
evict-last loads) before or after that read. H200, 32-256 rows: hot saves 2-3 µs a layer, a prefetch
costs 6.7: no. CUDA only (NVRTC, sm_90):

    python launch/bench/bench_l2_weights.py
"""
import ctypes

import torch
import torch.nn.functional as F

import repo_root  # noqa: F401  (this checkout's engine, before any import of it)
from spmd_engine.kernels.cuda_rtc import load_kernel, nvrtc_compile

SRC = r'''
extern "C" __global__ void prefetch_l2(const char* base, unsigned long long bytes, int mode) {
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (mode == 0) {  // bulk prefetch, 4 KB per thread
        for (unsigned long long off = i * 4096ull; off < bytes; off += step * 4096ull) {
            unsigned long long n = bytes - off < 4096ull ? bytes - off : 4096ull;
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(base + off), "r"((unsigned)n) : "memory");
        }
    } else if (mode == 1) {  // line prefetch
        for (unsigned long long off = i * 128ull; off < bytes; off += step * 128ull)
            asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(base + off));
    } else {  // loads that wait (evict_last), result kept
        unsigned long long pol;
        asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
        unsigned acc = 0;
        for (unsigned long long off = i * 16ull; off < bytes; off += step * 16ull) {
            unsigned a, b, c, d;
            asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                         : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(base + off), "l"(pol));
            acc ^= a ^ b ^ c ^ d;
        }
        if (acc == 0x12345679u) ((unsigned*)base)[0] = acc;
    }
}
extern "C" __global__ void stream_read(const int4* base, unsigned long long n, int* sink) {
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    int acc = 0;
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        int4 v;
        asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.s32 {%0,%1,%2,%3}, [%4], %5;"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(base + i), "l"(pol));
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x7777777) sink[0] = acc;
}
'''


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_l2_weights.py needs a CUDA GPU")
    cubin = nvrtc_compile(SRC, "pf", "sm_90", {})
    pf = load_kernel(cubin, "prefetch_l2", (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int), 256, 0)
    sr = load_kernel(cubin, "stream_read", (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p), 512, 0)
    dev = "cuda"
    L = 28
    shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
    # one contiguous buffer per layer holding its 4 weights, so one prefetch covers a layer
    layers = []
    for _ in range(L):
        flat = torch.randn(sum(n * k for n, k in shapes.values()), device=dev, dtype=torch.bfloat16) * 0.02
        ws, off = {}, 0
        for name, (n, k) in shapes.items():
            ws[name] = flat[off:off + n * k].view(n, k)
            off += n * k
        layers.append((flat, ws))
    kv = torch.empty(512 << 20, dtype=torch.uint8, device=dev)  # 512 MB "attention" stream (~120 us)
    sink = torch.zeros(4, dtype=torch.int32, device=dev)
    STREAM_BYTES = 400 << 20

    def timeit(fn, reps=10):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                fn()
        torch.cuda.synchronize()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(5):
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record()
            for _ in range(reps):
                g.replay()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / reps)
        return best * 1e3  # us per replay

    for M in (32, 129, 256):
        xs = {name: torch.randn(M, k, device=dev, dtype=torch.bfloat16) for name, (n, k) in shapes.items()}
        def gemms(ws):
            for name in shapes:
                F.linear(xs[name], ws[name])
        def cold():
            for flat, ws in layers:
                gemms(ws)
        def hot():
            for _ in range(L):
                gemms(layers[0][1])
        def stream():
            for _ in range(L):
                sr.launch((132 * 4, 1, 1), [kv, STREAM_BYTES // 16, sink])
        def stream_cold():
            for flat, ws in layers:
                sr.launch((132 * 4, 1, 1), [kv, STREAM_BYTES // 16, sink])
                gemms(ws)
        def pf_mode(mode, before_stream):
            def f():
                for flat, ws in layers:
                    if before_stream:
                        pf.launch((132, 1, 1), [flat, flat.numel() * 2, mode])
                    sr.launch((132 * 4, 1, 1), [kv, STREAM_BYTES // 16, sink])
                    if not before_stream:
                        pf.launch((132, 1, 1), [flat, flat.numel() * 2, mode])
                    gemms(ws)
            return f
        def pf_only(mode):
            def f():
                for flat, ws in layers:
                    pf.launch((132, 1, 1), [flat, flat.numel() * 2, mode])
            return f
        t = {}
        t["gemms cold"] = timeit(cold)
        t["gemms hot (layer 0 x28)"] = timeit(hot)
        t["stream 400MB x28"] = timeit(stream)
        t["stream+gemms cold"] = timeit(stream_cold)
        for mode in (0, 1, 2):
            t[f"prefetch mode {mode} alone"] = timeit(pf_only(mode))
            t[f"stream, prefetch m{mode}, gemms"] = timeit(pf_mode(mode, False))
            t[f"prefetch m{mode}, stream, gemms"] = timeit(pf_mode(mode, True))
        print(f"--- M={M}: us per layer")
        for k, v in t.items():
            print(f"  {k:40s} {v / L:8.2f}")


if __name__ == "__main__":
    main()
