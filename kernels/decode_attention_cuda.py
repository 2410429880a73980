"""Paged decode attention over a bf16/fp16 KV cache, as a CUDA C++ kernel (NVRTC, kernels/cuda_rtc.py).

Why: decode attention is ~75 % of a large batch's decode step, and there the Triton kernel reads K/V at
~93 % of the copy rate. This kernel reads 1-2 % faster at large batch (H200, one layer: 256 rows x
100..1500 keys 187.7 us against 191.8) and the engine's nano bench gains 3 %: 27,320-27,520 output
tok/s against 26,600 (docs/BENCHMARKS.md, session 17). It is the fp8 one's design
(kernels/decode_attention_fp8_cuda.py) without the byte converts: one warp per (sequence, KV head,
split), K/V tiles by `cp.async` into swizzled shared memory, `ldmatrix` straight into the MMA fragments
(V transposed), transposed MMAs (S^T = K q^T, O^T = V^T P^T) so the GROUP query heads fill the MMA's
8 columns and no row is padding.

Same grid, partials and merge (by the last split to finish) as the Triton split kernel; this module
also holds what both CUDA decode kernels share (device code, `builds_on`, `shapes_fit`,
`run_split_kernel`). Shapes it takes (`supports`): head_dim 128, at most 8 query heads per KV head,
block_size a power of two >= 2, the cache in the model's dtype (bf16 or fp16).

On a decode step it also prepares its own inputs (`DecodePrologue`): each warp norms and rotates its GROUP
query heads from the qkv projection's raw q while its first K/V tile lands, and the split holding the new
token norms, rotates and stores that token's K/V row, handing it to its tile in shared memory rather than
waiting for the store: qk_norm_rope_store's launch before attention goes (28 launches a Qwen3-0.6B step), for
the same cache and, within the norm's last bit, the same q. H200, `python run.py workload=bench` and
`workload.num_seqs=1`: batch 1 +3.7 % tok/s (ITL p50 1.02 -> 0.98 ms), 32 requests +2.2 %, 256 requests
+0.2-0.4 % (the prologue a warp runs while its first tile lands about pays there).
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import lru_cache

import torch

import spmd_engine.kernels.cuda_rtc as cuda_rtc
import spmd_engine.kernels.decode_attention as da
from spmd_engine.kernels.pdl import pdl_enabled

BLOCK_N = 64  # keys per tile
STAGES = 2  # tiles in flight per warp (shared memory: STAGES x 32 KB)
PROGRAMS_PER_SM = 3  # resident warps per SM when choosing the split count
# A split fewer where the count that fills the SMs' resident warps would overshoot them by at most 15 %: the
# few warps past them would run alone after the rest. H200, CUDA graphs (docs/BENCHMARKS.md, session 21): 8 rows
# x 1,024 keys 7 splits 12.4 us -> 6 splits 10.5 (600..2,048 keys 14.7 -> 13.2), 4 rows 13 -> 12 splits 8.8 -> 7.8
# (9.5 -> 9.3); 12 rows and up, where the overshoot is larger, keep the count that fills the GPU.
SMALL_SECOND_WAVE = 0.15
HEAD_DIM = 128
log = logging.getLogger(__name__)

# Device code both CUDA decode kernels share (this one and kernels/decode_attention_fp8_cuda.py): PTX wrappers,
# then (after the kernel's own `pack_p` / `pack_out`) one tile's online softmax and the output epilogue.
DEVICE_HELPERS = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define D 128
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(u32 addr, u32* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
/* two floats -> f16x2 / bf16x2 (lo in the low half) */
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* L2 loads: never a stale L1 line of a partial another warp stored */
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float4 ld_cg4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
/* PDL in two halves (kernels/pdl.py: the decode kernels' exception to the first-statement rule). The first
   statement lets the successor launch; `pdl_wait` (a no-op unless launched with PDL) waits for the predecessor
   to complete and its memory to be visible, and comes before reading anything the predecessor writes (this
   step's q and new K/V row) and before any write. */
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ u32 transpose8x8(u32 x) {
  u32 r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}
"""

SHARED_DECODE = r"""
/* The split's tiles through the cp.async pipeline, STAGES - 1 tiles in flight ahead of the one attended:
   issue(tile, stage) starts a tile's copies into `stage`, attend(tile, stage) consumes it once landed.
   ready() (pdl_wait, then the q fragments) runs once, before the first attend and before issuing a tile that
   reaches position `fresh` (this step's new key, which the predecessor kernel stores): under PDL the first
   tiles of older keys stream in while the predecessor finishes. */
template <typename Issue, typename Ready, typename Attend>
__device__ __forceinline__ void pipeline_tiles(int start, int end, int fresh, Issue&& issue, Ready&& ready,
                                               Attend&& attend) {
  const int num_tiles = end > start ? (end - start + BN - 1) / BN : 0;
  bool is_ready = false;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_tiles) {
      if (start + (s + 1) * BN > fresh && !is_ready) { ready(); is_ready = true; }
      issue(start + s * BN, s);
    }
    cp_async_commit();
  }
  if (!is_ready) ready();
  for (int it = 0; it < num_tiles; ++it) {
    {  /* the tile STAGES - 1 ahead goes into the stage freed at the end of the previous iteration */
      const int ahead = it + STAGES - 1;
      if (ahead < num_tiles) issue(start + ahead * BN, ahead % STAGES);
      cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    attend(start + it * BN, it % STAGES);
    __syncwarp();  /* every lane is done with this stage before the next iteration refills it */
  }
  cp_async_wait<0>();
}

/* Byte offsets of the cache blocks one tile reads (ENTRIES table entries; with BLOCK_SIZE >= BN one, plus the
   tile's first slot in it). An entry wholly past `end` reads nothing: its copies are zero-filled. */
template <int ENTRIES>
__device__ __forceinline__ void tile_blocks(long long (&off)[ENTRIES], const int* table, int tile, int end, bool full,
                                            long long stride_block_bytes, long long stride_pos_bytes) {
  const long long slot0 = (long long)(tile % BLOCK_SIZE) * stride_pos_bytes;  /* 0 unless BLOCK_SIZE > BN */
#pragma unroll
  for (int b = 0; b < ENTRIES; ++b) {
    const bool live = full || tile + b * BLOCK_SIZE < end;
    off[b] = (live ? (long long)table[tile / BLOCK_SIZE + b] * stride_block_bytes : 0ll) + slot0;
  }
}

/* One tile's online softmax per head column. sc[mt] holds S^T's fragments (key g, head 2t), (key g, 2t+1),
   (key g+8, 2t), (key g+8, 2t+1) of keys tile + 16 mt ..; keys >= end count as -inf. Rescales acc and l,
   and gives P^T's B fragments for k-step mt: (head g, keys 2t, 2t+1) and (keys 8 + 2t, 9 + 2t). */
template <int NT>
__device__ __forceinline__ void softmax_tile(float (&sc)[NT][4], u32 (&pb)[NT][2], float (&acc)[D / 16][4],
                                             float& m0, float& m1, float& l0, float& l1, float scale_log2,
                                             int tile, int end, bool tail, int g) {
  float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
  for (int mt = 0; mt < NT; ++mt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float x = sc[mt][c] * scale_log2;
      if (tail && tile + 16 * mt + g + 8 * (c >> 1) >= end) x = NEG_INF;
      sc[mt][c] = x;
    }
    mx0 = fmaxf(mx0, fmaxf(sc[mt][0], sc[mt][2]));
    mx1 = fmaxf(mx1, fmaxf(sc[mt][1], sc[mt][3]));
  }
#pragma unroll
  for (int x = 4; x < 32; x <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
  }
  const float n0 = fmaxf(m0, mx0), a0 = ex2(m0 - n0);
  const float n1 = fmaxf(m1, mx1), a1 = ex2(m1 - n1);
  m0 = n0;
  m1 = n1;
  float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
  for (int mt = 0; mt < NT; ++mt) {
    const float p0 = ex2(sc[mt][0] - n0), p1 = ex2(sc[mt][1] - n1);
    const float p2 = ex2(sc[mt][2] - n0), p3 = ex2(sc[mt][3] - n1);
    sum0 += p0 + p2;
    sum1 += p1 + p3;
    pb[mt][0] = transpose8x8(pack_p(p0, p1));
    pb[mt][1] = transpose8x8(pack_p(p2, p3));
  }
  l0 = l0 * a0 + sum0;
  l1 = l1 * a1 + sum1;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) { acc[j][0] *= a0; acc[j][1] *= a1; acc[j][2] *= a0; acc[j][3] *= a1; }
}

/* acc[j] = O^T rows (dims) 16 j + g, 16 j + g + 8, columns (heads) 2t, 2t + 1 -> `out` in the model dtype
   (one split) or the float32 partial and log-sum-exp of this split (decode_attention._split_partials) */
/* The last-arriving split of (seq, kv_head) merges the `live` splits' partials of its GROUP heads into `out`,
   weighted by their log-sum-exps (decode_attention._merge_partials's math; lane = 4 dims) */
__device__ __forceinline__ void merge_splits(const float* partial_out, const float* partial_lse, u16* out, int seq,
                                             int kv_head, int num_splits, int live, int num_q_heads,
                                             int stride_o_seq, int stride_o_head, int lane) {
#pragma unroll 1
  for (int h = 0; h < GROUP; ++h) {
    const int head = kv_head * GROUP + h;
    const long long slot0 = ((long long)seq * num_q_heads + head) * num_splits;
    float mx = NEG_INF;
    for (int s = 0; s < live; ++s) mx = fmaxf(mx, ld_cg(partial_lse + slot0 + s));
    if (mx == NEG_INF) mx = 0.f;  /* every split empty: weights 0 */
    float total = 0.f, a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    for (int s = 0; s < live; ++s) {
      const float w = ex2(ld_cg(partial_lse + slot0 + s) - mx);
      const float4 p = ld_cg4(partial_out + (slot0 + s) * D + 4 * lane);
      total += w;
      a0 += p.x * w;
      a1 += p.y * w;
      a2 += p.z * w;
      a3 += p.w * w;
    }
    const float inv = total == 0.f ? 1.f : 1.f / total;
    u32* o = (u32*)(out + (long long)seq * stride_o_seq + (long long)head * stride_o_head + 4 * lane);
    o[0] = pack_out(a0 * inv, a1 * inv);
    o[1] = pack_out(a2 * inv, a3 * inv);
  }
}

/* counters: null, or the arrival counters (one per (sequence, KV head), zero between launches) by which the
   last split to finish merges the splits itself (decode_attention.DECODE_FUSED_MERGE); `live` = the splits
   that hold keys */
__device__ __forceinline__ void write_output(const float (&acc)[D / 16][4], float m0, float m1, float l0, float l1,
                                             float out_scale, u16* out, float* partial_out, float* partial_lse,
                                             int* counters, int live, int seq, int kv_head, int split, int num_splits,
                                             int num_q_heads, int stride_o_seq, int stride_o_head, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int x = 4; x < 32; x <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, x);
    l1 += __shfl_xor_sync(0xffffffffu, l1, x);
  }
#pragma unroll
  for (int col = 0; col < 2; ++col) {
    const int row = 2 * t + col;  /* the query head of this column, within the group */
    if (row >= GROUP) continue;
    const int head = kv_head * GROUP + row;
    const float l = col ? l1 : l0, m = col ? m1 : m0;
    const bool empty = l == 0.f;
    const float inv = empty ? 0.f : out_scale / l;
    if (num_splits == 1) {
      u16* o = out + (long long)seq * stride_o_seq + (long long)head * stride_o_head + g;
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        const u32 pair = pack_out(acc[j][col] * inv, acc[j][2 + col] * inv);
        o[16 * j] = (u16)pair;
        o[16 * j + 8] = (u16)(pair >> 16);
      }
    } else {
      const long long slot = ((long long)seq * num_q_heads + head) * num_splits + split;
      float* o = partial_out + slot * D + g;
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        o[16 * j] = acc[j][col] * inv;
        o[16 * j + 8] = acc[j][2 + col] * inv;
      }
      if (g == 0) partial_lse[slot] = empty ? NEG_INF : m + __log2f(l);
    }
  }
  if (num_splits > 1 && counters != nullptr) {
    int* counter = counters + (long long)seq * (num_q_heads / GROUP) + kv_head;
    __threadfence();  /* release: every lane's partials are visible device-wide before the arrival counts */
    __syncwarp();
    int arrived = 0;
    if (lane == 0) arrived = atomicAdd(counter, 1);
    arrived = __shfl_sync(0xffffffffu, arrived, 0);
    if (arrived == num_splits - 1) {
      __threadfence();  /* acquire: the other splits' partials (read from L2) */
      merge_splits(partial_out, partial_lse, out, seq, kv_head, num_splits, live, num_q_heads, stride_o_seq,
                   stride_o_head, lane);
      if (lane == 0) *counter = 0;  /* ready for the next launch (and graph replay) */
    }
  }
}
"""

# FUSED_QK: the kernel prepares its own inputs from the qkv projection (`DecodePrologue`), replacing the
# qk_norm_rope_store launch before it. Every rounding of that kernel is kept (the norm rounded to the model
# dtype before its weight, the weighted row rounded, rotary in float32 rounded once); the norm's float32 sum
# runs in this warp's own order, so a q/k element may differ from the store kernel's in its last bit.
QK_COMMON = r"""
#if IS_BF16
__device__ __forceinline__ float lo_f(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float hi_f(u32 x) { return __uint_as_float(x & 0xffff0000u); }
#else
__device__ __forceinline__ float lo_f(u32 x) {
  float r;
  asm("{ .reg .f16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }" : "=f"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ float hi_f(u32 x) {
  float r;
  asm("{ .reg .f16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }" : "=f"(r) : "r"(x));
  return r;
}
#endif
__device__ __forceinline__ float round_model(float x) { return lo_f(pack_out(x, 0.f)); }
__device__ __forceinline__ u32 ld_u32(const u16* p) { return *(const u32*)p; }

/* x (one head's values this lane holds, `lanes` lanes a head: xor-shuffle partners below `lanes`) ->
   rmsnorm(x) * weight, each product rounded as the store kernel rounds it; w = the weights of x's dims */
template <int N>
__device__ __forceinline__ void norm_values(float (&x)[N], const float (&w)[N], float eps, int lanes) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) ss += x[i] * x[i];
  for (int m = 1; m < lanes; m <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  const float inv = rsqrtf(ss / (float)D + eps);
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = round_model(round_model(x[i] * inv) * w[i]);
}

/* The new token's K/V inputs for one KV head as a lane's raw pairs (K dims 2l, 2l + 1 and their rotary
   partners D/2 + 2l, +1; V dims 4l .. 4l + 3) and the row's slot. */
struct NewKv {
  u32 k[2], v[2], w[2], c, s;
  long long slot;
};
__device__ __forceinline__ void load_new_kv(NewKv& in, const u16* k_row, const u16* v_row, const u16* weight,
                                            const u16* cos_row, const u16* sin_row, const long long* slot, int lane) {
  in.slot = *slot;
  in.v[0] = ld_u32(v_row + 4 * lane);
  in.v[1] = ld_u32(v_row + 4 * lane + 2);
  in.k[0] = ld_u32(k_row + 2 * lane);
  in.k[1] = ld_u32(k_row + D / 2 + 2 * lane);
#if HAS_NORM
  in.w[0] = ld_u32(weight + 2 * lane);
  in.w[1] = ld_u32(weight + D / 2 + 2 * lane);
#endif
  in.c = ld_u32(cos_row + 2 * lane);
  in.s = ld_u32(sin_row + 2 * lane);
}

/* The lane's K values (dims 2l, 2l + 1, D/2 + 2l, D/2 + 2l + 1): (norm,) rotary in float32, before the one
   rounding to the model dtype (the caller's: packed, or `round_model`) */
__device__ __forceinline__ void rotated_new_k(float (&k)[4], const NewKv& in, float eps) {
  float x[4] = {lo_f(in.k[0]), hi_f(in.k[0]), lo_f(in.k[1]), hi_f(in.k[1])};
#if HAS_NORM
  {
    const float w[4] = {lo_f(in.w[0]), hi_f(in.w[0]), lo_f(in.w[1]), hi_f(in.w[1])};
    norm_values(x, w, eps, 32);
  }
#endif
  const float c0 = lo_f(in.c), c1 = hi_f(in.c), s0 = lo_f(in.s), s1 = hi_f(in.s);
  k[0] = x[0] * c0 - x[2] * s0;
  k[1] = x[1] * c1 - x[3] * s1;
  k[2] = x[2] * c0 + x[0] * s0;
  k[3] = x[3] * c1 + x[1] * s1;
}
"""

# The bf16/fp16 kernel's own part: q in its MMA fragment order, the new row in its tile layout.
QK_PROLOGUE = QK_COMMON + r"""
/* A lane's q inputs (query head g of the group; k-step ks: dims 16 ks + 2t, +1 and 16 ks + 8 + 2t, +1, the MMA's
   b0/b1 order) as raw pairs: the projection's q, the norm weights, and cos/sin of the first half's dims. Loaded
   together with `NewKv`'s before either is used: the prologue waits for memory once. */
struct QInputs {
  u32 x[D / 8], w[D / 8], c[D / 16], s[D / 16];
};
__device__ __forceinline__ void load_q_inputs(QInputs& in, const u16* row, bool live, const u16* weight,
                                              const u16* cos_row, const u16* sin_row, int t) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    in.x[2 * ks] = live ? ld_u32(row + 16 * ks + 2 * t) : 0u;
    in.x[2 * ks + 1] = live ? ld_u32(row + 16 * ks + 8 + 2 * t) : 0u;
#if HAS_NORM
    in.w[2 * ks] = ld_u32(weight + 16 * ks + 2 * t);
    in.w[2 * ks + 1] = ld_u32(weight + 16 * ks + 8 + 2 * t);
#endif
  }
#pragma unroll
  for (int ks = 0; ks < D / 32; ++ks) {
    in.c[2 * ks] = ld_u32(cos_row + 16 * ks + 2 * t);
    in.c[2 * ks + 1] = ld_u32(cos_row + 16 * ks + 8 + 2 * t);
    in.s[2 * ks] = ld_u32(sin_row + 16 * ks + 2 * t);
    in.s[2 * ks + 1] = ld_u32(sin_row + 16 * ks + 8 + 2 * t);
  }
}

/* -> the q fragments: (norm,) then rotary on the NeoX halves, dim d with d + D/2, i.e. k-step ks with
   ks + D/32, which the same lane holds */
__device__ __forceinline__ void rotated_q_fragments(u32 (&qb0)[D / 16], u32 (&qb1)[D / 16], const QInputs& in,
                                                    float eps) {
  float x[D / 4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) { x[2 * i] = lo_f(in.x[i]); x[2 * i + 1] = hi_f(in.x[i]); }
#if HAS_NORM
  {
    float w[D / 4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) { w[2 * i] = lo_f(in.w[i]); w[2 * i + 1] = hi_f(in.w[i]); }
    norm_values(x, w, eps, 4);  /* a head's 128 dims are the 4 lanes of one g */
  }
#endif
#pragma unroll
  for (int ks = 0; ks < D / 32; ++ks) {
    const float c[4] = {lo_f(in.c[2 * ks]), hi_f(in.c[2 * ks]), lo_f(in.c[2 * ks + 1]), hi_f(in.c[2 * ks + 1])};
    const float s[4] = {lo_f(in.s[2 * ks]), hi_f(in.s[2 * ks]), lo_f(in.s[2 * ks + 1]), hi_f(in.s[2 * ks + 1])};
    float o1[4], o2[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float x1 = x[4 * ks + i], x2 = x[4 * (ks + D / 32) + i];
      o1[i] = x1 * c[i] - x2 * s[i];
      o2[i] = x2 * c[i] + x1 * s[i];
    }
    qb0[ks] = pack_out(o1[0], o1[1]);
    qb1[ks] = pack_out(o1[2], o1[3]);
    qb0[ks + D / 32] = pack_out(o2[0], o2[1]);
    qb1[ks + D / 32] = pack_out(o2[2], o2[3]);
  }
}

/* -> the lane's share of the K row (norm,) rotated and of the V row: 4 bytes at byte 4 lane and at D + 4 lane
   of the K row, 8 bytes at byte 8 lane of the V row; also stored at k_dst / v_dst (null: not stored) */
__device__ __forceinline__ void new_kv_row(u32 (&kv)[4], const NewKv& in, float eps, unsigned char* k_dst,
                                           unsigned char* v_dst, int lane) {
  float k[4];
  rotated_new_k(k, in, eps);
  kv[0] = pack_out(k[0], k[1]);
  kv[1] = pack_out(k[2], k[3]);
  kv[2] = in.v[0];
  kv[3] = in.v[1];
  if (k_dst != nullptr) {
    ((u32*)k_dst)[lane] = kv[0];
    ((u32*)k_dst)[D / 4 + lane] = kv[1];
    ((u32*)v_dst)[2 * lane] = kv[2];
    ((u32*)v_dst)[2 * lane + 1] = kv[3];
  }
}

/* Puts the new row (`new_kv_row`'s shares) at row r of a landed K/V tile in shared memory (chunk c of row r
   at c ^ (r & 7)), over whatever the copy brought: the tile never waits for the row's global store. */
__device__ __forceinline__ void put_new_row(u32 ks, u32 vs, int r, const u32 (&kv)[4], int lane) {
  const u32 k_row = ks + r * ROW_BYTES, v_row = vs + r * ROW_BYTES, swz = r & 7;
  const u32 k0 = k_row + (((u32)(lane >> 2) ^ swz) << 4) + 4 * (lane & 3);
  const u32 k1 = k_row + (((u32)(8 + (lane >> 2)) ^ swz) << 4) + 4 * (lane & 3);
  const u32 v0 = v_row + (((u32)(lane >> 1) ^ swz) << 4) + 8 * (lane & 1);
  asm volatile("st.shared.u32 [%0], %1;" :: "r"(k0), "r"(kv[0]) : "memory");
  asm volatile("st.shared.u32 [%0], %1;" :: "r"(k1), "r"(kv[1]) : "memory");
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};" :: "r"(v0), "r"(kv[2]), "r"(kv[3]) : "memory");
}
"""

_SOURCE = DEVICE_HELPERS + r"""
#define ROW_BYTES (2 * D)        /* one position of one KV head */
#define TILE_BYTES (BN * ROW_BYTES)
#define STAGE_BYTES (2 * TILE_BYTES) /* K tile, then V tile */

/* P, the MMA operands and the output are all in the model's dtype */
#if IS_BF16
#define pack_p pack_bf16x2
#define pack_out pack_bf16x2
#define mma16816 mma_bf16
#else
#define pack_p pack_f16x2
#define pack_out pack_f16x2
#define mma16816 mma_f16
#endif
""" + SHARED_DECODE + QK_PROLOGUE + r"""
/* One warp = one (sequence, KV head, split). S^T = K q^T and O^T = V^T P^T: keys and dims fill the MMA's
   16 rows, the GROUP query heads its 8 columns; the accumulator is [128 dims x 8 heads] (32 floats a lane). */
extern "C" __global__ void __launch_bounds__(32, 1) paged_decode16(
    const u16* __restrict__ query, unsigned char* __restrict__ k_cache,
    unsigned char* __restrict__ v_cache, u16* __restrict__ out, float* __restrict__ partial_out,
    float* __restrict__ partial_lse, int* __restrict__ counters, const int* __restrict__ seq_lens,
    const int* __restrict__ block_tables,
    float scale_log2, int stride_q_seq, int stride_q_head, int stride_o_seq, int stride_o_head,
    long long stride_block_bytes, int stride_table, int num_q_heads, int num_splits,
    /* FUSED_QK only (`DecodePrologue`): the projection's new k/v rows, rotary tables, norm weights, slots */
    const u16* __restrict__ k_new, const u16* __restrict__ v_new, const u16* __restrict__ cos_table,
    const u16* __restrict__ sin_table, const u16* __restrict__ q_weight, const u16* __restrict__ k_weight,
    const long long* __restrict__ slot_mapping, float eps, int stride_k_seq, int stride_v_seq, int stride_cs_seq) {
  pdl_launch_dependents();
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
  const int seq_len = seq_lens[seq];
  const int split_len = (seq_len + num_splits * BN - 1) / (num_splits * BN) * BN;
  const int start = split * split_len;
  const int end = min(start + split_len, seq_len);

  /* B fragments of q^T (column g = query head g of the group): k-step ks holds dims 16 ks + 2t, +1 (b0)
     and 16 ks + 8 + 2t, +1 (b1); loaded by `ready`, once the predecessor that writes q has completed */
  u32 qb0[D / 16], qb1[D / 16];
#if FUSED_QK
  /* the split holding the new token (position seq_len - 1) makes its K/V row (`new_kv_row`) and hands it to
     its tile in shared memory: no tile waits for it, so `ready` may come after the first tiles' copies */
  const bool holds_new = end == seq_len && start < end;
  u32 new_kv[4] = {0u, 0u, 0u, 0u};
  bool put_new = false;  /* set by `ready`, which runs before the first tile is attended */
  const int fresh = 0x7fffffff;
#else
  const int fresh = seq_len - 1;  /* the predecessor stores this row: its tile is issued after `ready` */
#endif
  auto ready = [&]() {
    pdl_wait();
    const u16* row = query + (long long)seq * stride_q_seq + (long long)(kv_head * GROUP + g) * stride_q_head;
#if FUSED_QK
    const u16* cos_row = cos_table + (long long)seq * stride_cs_seq;
    const u16* sin_row = sin_table + (long long)seq * stride_cs_seq;
    QInputs q_in;
    NewKv kv_in;
    load_q_inputs(q_in, row, g < GROUP, q_weight, cos_row, sin_row, t);
    if (holds_new) {  /* this split holds the new token: it makes and stores its K/V row */
      load_new_kv(kv_in, k_new + (long long)seq * stride_k_seq + kv_head * D,
                  v_new + (long long)seq * stride_v_seq + kv_head * D, k_weight, cos_row, sin_row,
                  slot_mapping + seq, lane);
      const long long slot = kv_in.slot;
      const long long dst = (slot / BLOCK_SIZE) * stride_block_bytes + (slot % BLOCK_SIZE) * STRIDE_POS_BYTES
                            + (long long)kv_head * ROW_BYTES;
      new_kv_row(new_kv, kv_in, eps, slot >= 0 ? k_cache + dst : nullptr, v_cache + dst, lane);
      put_new = slot >= 0;  /* slot -1 (padding): stored nowhere, attended as the cache holds it, as before */
    }
    rotated_q_fragments(qb0, qb1, q_in, eps);
#else
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      qb0[ks] = g < GROUP ? *(const u32*)(row + 16 * ks + 2 * t) : 0u;
      qb1[ks] = g < GROUP ? *(const u32*)(row + 16 * ks + 8 + 2 * t) : 0u;
    }
#endif
  };

  /* Loads: K and V row r = cr + 2 i (16-byte chunk cc), i < BN / 2: tile position 2 i + cr, in table entry
     (tile + 2 i) / BLOCK_SIZE (BLOCK_SIZE a power of two >= 2). Chunk c of row r lands at c ^ (r & 7). */
  const int cc = lane & 15, cr = lane >> 4;
  const int* table = block_tables + (long long)seq * stride_table;
  const long long lane_off = (long long)kv_head * ROW_BYTES + (long long)cr * STRIDE_POS_BYTES + cc * 16;
  const unsigned char* k_lane = k_cache + lane_off;
  const unsigned char* v_lane = v_cache + lane_off;
  const u32 smem0 = smem_addr(smem);
  u32 dst[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) dst[q] = cr * ROW_BYTES + ((cc ^ ((cr + 2 * q) & 7)) << 4);

  auto issue = [&](int tile, int stage) {
    const u32 ks = smem0 + stage * STAGE_BYTES, vs = ks + TILE_BYTES;
    const bool full = tile + BN <= end;
    constexpr int ENTRIES = BLOCK_SIZE >= BN ? 1 : BN / BLOCK_SIZE;
    long long off[ENTRIES];
    tile_blocks(off, table, tile, end, full, stride_block_bytes, STRIDE_POS_BYTES);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int b = (2 * i) / BLOCK_SIZE;
      const long long row_off = (long long)((2 * i) % BLOCK_SIZE) * STRIDE_POS_BYTES;
      const u32 bytes = full || tile + cr + 2 * i < end ? 16u : 0u;  /* 0: zero-filled, never read from HBM */
      cp_async16(ks + dst[i & 3] + 2 * ROW_BYTES * i, k_lane + off[b] + row_off, bytes);
      cp_async16(vs + dst[i & 3] + 2 * ROW_BYTES * i, v_lane + off[b] + row_off, bytes);
    }
  };

  float acc[D / 16][4];
#pragma unroll
  for (int j = 0; j < D / 16; ++j) { acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f; }
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  /* heads 2t and 2t + 1 */

  pipeline_tiles(start, end, fresh, issue, ready, [&](int tile, int stage) {
    const u32 ks = smem0 + stage * STAGE_BYTES, vs = ks + TILE_BYTES;
#if FUSED_QK
    if (put_new && tile + BN >= seq_len) {
      put_new_row(ks, vs, seq_len - 1 - tile, new_kv, lane);
      __syncwarp();
    }
#endif

    /* S^T = K q^T: m-tile mt is keys 16 mt .. + 15; ldmatrix matrix m = lane / 8: keys + 8 (m & 1),
       chunk 2 ks + m / 2 (the A fragment's order) */
    float sc[BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < BN / 16; ++mt) {
      sc[mt][0] = sc[mt][1] = sc[mt][2] = sc[mt][3] = 0.f;
      const int row = 16 * mt + 8 * ((lane >> 3) & 1) + (lane & 7);
#pragma unroll
      for (int kstep = 0; kstep < D / 16; ++kstep) {
        const int chunk = 2 * kstep + (lane >> 4);
        u32 a[4];
        ldsm_x4(ks + row * ROW_BYTES + ((chunk ^ (row & 7)) << 4), a);
        mma16816(sc[mt], a, qb0[kstep], qb1[kstep]);
      }
    }
    u32 pb[BN / 16][2];
    softmax_tile<BN / 16>(sc, pb, acc, m0, m1, l0, l1, scale_log2, tile, end, tile + BN > end, g);

    /* O^T += V^T P^T: k-step s is keys 16 s .. + 15; ldmatrix.trans matrix m = lane / 8: keys + 8 (m / 2),
       chunk 2 j + (m & 1) (the A fragment of V^T: dims 16 j + g (+ 8), keys 2t, 2t + 1 (+ 8)) */
#pragma unroll
    for (int s = 0; s < BN / 16; ++s) {
      const int row = 16 * s + 8 * (lane >> 4) + (lane & 7);
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        const int chunk = 2 * j + ((lane >> 3) & 1);
        u32 a[4];
        ldsm_x4_t(vs + row * ROW_BYTES + ((chunk ^ (row & 7)) << 4), a);
        mma16816(acc[j], a, pb[s][0], pb[s][1]);
      }
    }
  });
  write_output(acc, m0, m1, l0, l1, 1.f, out, partial_out, partial_lse, counters,
               seq_len > 0 ? (seq_len + split_len - 1) / split_len : 1, seq, kv_head, split, num_splits, num_q_heads,
               stride_o_seq, stride_o_head, lane);
}
"""

_ARG_TYPES = (
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    *(ctypes.c_void_p,) * 7, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # the FUSED_QK inputs
)
PROLOGUE_ARG_TYPES = _ARG_TYPES[-11:]  # both CUDA decode kernels end their parameters with these
NO_PROLOGUE_ARGS = (0,) * 7 + (0.0, 0, 0, 0)


@dataclass(frozen=True)
class DecodePrologue:
    """What the kernel needs to prepare its own q and the new K/V (replacing the qk_norm_rope_store launch
    before it on a decode step): the qkv projection's k and v [B, Hkv, D] (query is then its raw q), the
    step's rotary tables [B, D/2], each row's cache slot (int64, -1: not stored) and the per-head RMSNorm
    weights [D] with eps (Qwen3; None: rotary only, as Llama)."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0

    def fits(self, query: torch.Tensor) -> bool:
        """The layout the prologue reads: heads of D contiguous values, 4-byte aligned rows (its u32 loads),
        rotary tables of D/2 per row, weights [D] in the model dtype."""
        num_seqs = query.shape[0]
        if (self.q_weight is None) != (self.k_weight is None):
            return False
        rows = (self.k, self.v, self.cos, self.sin)
        weights = () if self.q_weight is None else (self.q_weight, self.k_weight)
        return (all(x.dtype == query.dtype and x.device == query.device and x.data_ptr() % 4 == 0
                    for x in rows + weights)
                and self.k.shape == self.v.shape and self.k.shape[0] == num_seqs and self.k.shape[2] == HEAD_DIM
                and self.k.stride()[1:] == (HEAD_DIM, 1) and self.v.stride()[1:] == (HEAD_DIM, 1)
                and self.k.stride(0) % 2 == 0 and self.v.stride(0) % 2 == 0
                and self.cos.shape == (num_seqs, HEAD_DIM // 2) and self.sin.stride() == self.cos.stride()
                and self.sin.shape == self.cos.shape and self.cos.stride(1) == 1 and self.cos.stride(0) % 2 == 0
                and all(w.shape == (HEAD_DIM,) and w.stride(0) == 1 for w in weights)
                and self.slot_mapping.dtype == torch.int64 and self.slot_mapping.shape == (num_seqs,)
                and self.slot_mapping.is_contiguous())

    def args(self) -> tuple:
        norm = self.q_weight is not None
        return (self.k, self.v, self.cos, self.sin, self.q_weight if norm else 0, self.k_weight if norm else 0,
                self.slot_mapping, float(self.eps), self.k.stride(0), self.v.stride(0), self.cos.stride(0))


def builds_on(device: torch.device, min_capability: tuple[int, int], build, key: str) -> bool:
    """Whether a CUDA device of `min_capability`+ with NVRTC compiles and loads a decode kernel: `build(device
    index)` is tried once; a failure logs one line naming the engine `key` and leaves every call to Triton."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < min_capability or not cuda_rtc.available():
        return False
    try:
        build(device.index if device.index is not None else torch.cuda.current_device())
    except RuntimeError as err:
        log.warning("%s: the CUDA kernel did not build here, decode stays on Triton: %s", key, err)
        return False
    return True


def shapes_fit(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, min_block_size: int,
               query_align: int) -> bool:
    """The layout both CUDA decode kernels take: head_dim 128, at most 8 query heads per KV head, a
    power-of-two block_size >= `min_block_size`, contiguous cache heads, query rows `query_align`-element
    aligned (their vector loads)."""
    _, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    align_bytes = query_align * query.element_size()
    return (head_dim == HEAD_DIM and cache_dim == HEAD_DIM and num_q_heads // num_kv_heads <= 8
            and block_size >= min_block_size and block_size & (block_size - 1) == 0 and query.stride(2) == 1
            and query.stride(1) % query_align == 0 and query.stride(0) % query_align == 0
            and query.data_ptr() % align_bytes == 0
            and k_cache.stride()[1:] == (num_kv_heads * HEAD_DIM, HEAD_DIM, 1) and v_cache.stride() == k_cache.stride()
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)


@lru_cache(maxsize=None)
def usable(device: torch.device) -> bool:
    """sm_80+ (bf16 MMAs, cp.async, ldmatrix) where NVRTC builds this kernel (`builds_on`)."""
    return builds_on(device, (8, 0), lambda index: _kernel(index, 1, 16, 1, True, 2), "cuda_decode")


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Shapes and dtypes this kernel takes (see the module doc); False sends the call to Triton."""
    return (query.device.type == "cuda" and query.dtype in (torch.bfloat16, torch.float16)
            and k_cache.dtype == query.dtype and v_cache.dtype == query.dtype and usable(query.device)
            and shapes_fit(query, k_cache, v_cache, min_block_size=2, query_align=2))


@lru_cache(maxsize=None)
def _kernel(device_index: int, group: int, block_size: int, num_kv_heads: int, is_bf16: bool,
            prologue: int = 0) -> cuda_rtc.CudaKernel:
    """`prologue`: 0 none (q rotated, K/V stored by a kernel before), 1 rotary, 2 norm and rotary (FUSED_QK)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    defines = {"GROUP": group, "BLOCK_SIZE": block_size, "STRIDE_POS_BYTES": num_kv_heads * HEAD_DIM * 2,
               "IS_BF16": int(is_bf16), "STAGES": STAGES, "BN": BLOCK_N, "FUSED_QK": int(prologue > 0),
               "HAS_NORM": int(prologue == 2)}
    cubin = cuda_rtc.nvrtc_compile(_SOURCE, "paged_decode16", f"sm_{major}{minor}", defines)
    with torch.cuda.device(device_index):
        return cuda_rtc.load_kernel(cubin, "paged_decode16", _ARG_TYPES, threads=32,
                                    shared_bytes=STAGES * 2 * BLOCK_N * HEAD_DIM * 2)


def decode_config() -> da.DecodeConfig:
    """This kernel's tile as a `decode_attention.DecodeConfig` (the split rule reads its programs per SM)."""
    return da.DecodeConfig(block_n=BLOCK_N, num_warps=1, num_stages=STAGES, programs_per_sm=PROGRAMS_PER_SM,
                           small_second_wave=SMALL_SECOND_WAVE)


def run_split_kernel(name: str, kernel: cuda_rtc.CudaKernel, query: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     out: torch.Tensor | None, num_splits: int | None, cfg: da.DecodeConfig,
                     cache_args: tuple = (), tail_args: tuple = ()) -> torch.Tensor:
    """Both CUDA decode kernels' launch: the split count (`decode_attention.split_count`), the partials,
    grid (splits x KV heads x sequences), PDL where the engine asks for it (kernels/pdl.py), and the merge
    by the last split to finish (its arrival counters, `decode_attention.merge_counters`). `cache_args`
    follow the block tables in the kernel's parameters (the fp8 scales), `tail_args` end them."""
    da.check_attention_inputs(name, query, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(query)
    num_seqs, num_q_heads, _ = query.shape
    if num_seqs == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    num_splits = da.split_count(name, num_splits, num_seqs, k_cache, block_tables, cfg)
    partial_out, partial_lse = da._split_partials(query, out, num_splits)
    counters = da.merge_counters(query.device, num_seqs * num_kv_heads) if num_splits > 1 else 0
    kernel.launch((num_splits, num_kv_heads, num_seqs), [
        query, k_cache, v_cache, out, partial_out, partial_lse, counters, seq_lens, block_tables, *cache_args,
        scale * da._LOG2_E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0) * k_cache.element_size(), block_tables.stride(0), num_q_heads, num_splits, *tail_args,
    ], pdl=pdl_enabled(query.device))
    return out


def paged_decode_attention_cuda(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None, *, num_splits: int | None = None,
    prologue: DecodePrologue | None = None,
) -> torch.Tensor:
    """`decode_attention.paged_decode_attention` for the shapes `supports` accepts: same arguments and result.
    With `prologue` (its `fits` holds), query is the projection's raw q: the kernel norms and rotates it, and
    stores each row's new K/V at its slot before attending (the cache afterwards as qk_norm_rope_store
    leaves it)."""
    num_q_heads, (block_size, num_kv_heads) = query.shape[1], k_cache.shape[1:3]
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    if prologue is not None and not prologue.fits(query):
        raise ValueError("paged_decode_attention_cuda: the prologue's k/v/cos/sin/weights/slots do not fit "
                         f"(DecodePrologue.fits) for query {tuple(query.shape)} {query.dtype}")
    kind = 0 if prologue is None else 1 if prologue.q_weight is None else 2
    kernel = _kernel(index, num_q_heads // num_kv_heads, block_size, num_kv_heads, query.dtype == torch.bfloat16,
                     kind)
    return run_split_kernel("paged_decode_attention_cuda", kernel, query, k_cache, v_cache, seq_lens, block_tables,
                            scale, out, num_splits, decode_config(),
                            tail_args=NO_PROLOGUE_ARGS if prologue is None else prologue.args())
