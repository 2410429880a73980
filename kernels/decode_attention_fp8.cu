#include "decode_attention_ptx.cuh"

#define K_TILE (BN * D)          /* bytes: BN key rows of 128 */
#define STAGE_BYTES (2 * K_TILE) /* K tile, then V tile (BN / 2 pair rows of 256) */

/* P and the MMA operands are float16 (exact for e4m3); the output is in the model's dtype */
#define pack_p pack_f16x2
#if OUT_BF16
#define pack_out pack_bf16x2
#else
#define pack_out pack_f16x2
#endif
#define mma16816 mma_f16

__device__ __forceinline__ float in_to_f32(u16 bits) {
#if OUT_BF16
  return __uint_as_float(((u32)bits) << 16);
#else
  float f;
  asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(bits));
  return f;
#endif
}
__device__ __forceinline__ float clamp_f16(float x) { return fminf(fmaxf(x, -65504.f), 65504.f); }

/* q[head][16 ks + 4 t .. + 3] of one query head as the two f16x2 of k-step ks (zeros past GROUP) */
__device__ __forceinline__ void load_q(const u16* row, bool valid, int t, u32* lo, u32* hi) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    u64 v = valid ? *(const u64*)(row + 16 * ks + 4 * t) : 0ull;
    lo[ks] = pack_f16x2(clamp_f16(in_to_f32((u16)v)), clamp_f16(in_to_f32((u16)(v >> 16))));
    hi[ks] = pack_f16x2(clamp_f16(in_to_f32((u16)(v >> 32))), clamp_f16(in_to_f32((u16)(v >> 48))));
  }
}

/* two f16x2 of the four e4m3 bytes of x: bytes (0, 1) -> lo, (2, 3) -> hi */
__device__ __forceinline__ void e4m3x4_f16x2(u32 x, u32& lo, u32& hi) {
  asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.rn.f16x2.e4m3x2 %0, a; cvt.rn.f16x2.e4m3x2 %1, b; }"
      : "=r"(lo), "=r"(hi) : "r"(x));
}

#define IS_BF16 OUT_BF16
#include "decode_attention_split.cuh"

/* FUSED_QK (`DecodePrologue`), this kernel's part: q in `load_q`'s order (dims 16 ks + 4t .. + 3 of k-step ks)
   and the new row quantized as kernels/kv_store.py quantizes it (x / scale, IEEE division, rounded to the
   nearest e4m3 with saturation at +-448), in the fp8 cache's layout (K rows; V pairs of positions). */
struct QInputs8 {
  u64 x[D / 16], w[D / 16], c[D / 32], s[D / 32];
};
__device__ __forceinline__ u64 ld_u64(const u16* p) { return *(const u64*)p; }
__device__ __forceinline__ float quad_f(u64 q, int i) {
  const u32 half = (u32)(q >> (32 * (i >> 1)));
  return (i & 1) ? hi_f(half) : lo_f(half);
}
__device__ __forceinline__ void load_q_inputs8(QInputs8& in, const u16* row, bool live, const u16* weight,
                                               const u16* cos_row, const u16* sin_row, int t) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    in.x[ks] = live ? ld_u64(row + 16 * ks + 4 * t) : 0ull;
#if HAS_NORM
    in.w[ks] = ld_u64(weight + 16 * ks + 4 * t);
#endif
  }
#pragma unroll
  for (int ks = 0; ks < D / 32; ++ks) {
    in.c[ks] = ld_u64(cos_row + 16 * ks + 4 * t);
    in.s[ks] = ld_u64(sin_row + 16 * ks + 4 * t);
  }
}

/* -> qlo/qhi as `load_q` makes them from a rotated q: (norm,) rotary rounded to the model dtype, then float16 */
__device__ __forceinline__ void rotated_q_f16(u32 (&qlo)[D / 16], u32 (&qhi)[D / 16], const QInputs8& in,
                                              float eps) {
  float x[D / 4];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[4 * ks + i] = quad_f(in.x[ks], i);
  }
#if HAS_NORM
  {
    float w[D / 4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int i = 0; i < 4; ++i) w[4 * ks + i] = quad_f(in.w[ks], i);
    }
    norm_values(x, w, eps, 4);  /* a head's 128 dims are the 4 lanes of one g */
  }
#endif
#pragma unroll
  for (int ks = 0; ks < D / 32; ++ks) {
    float o1[4], o2[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float c = quad_f(in.c[ks], i), s = quad_f(in.s[ks], i);
      const float x1 = x[4 * ks + i], x2 = x[4 * (ks + D / 32) + i];
      o1[i] = clamp_f16(round_model(x1 * c - x2 * s));
      o2[i] = clamp_f16(round_model(x2 * c + x1 * s));
    }
    qlo[ks] = pack_f16x2(o1[0], o1[1]);
    qhi[ks] = pack_f16x2(o1[2], o1[3]);
    qlo[ks + D / 32] = pack_f16x2(o2[0], o2[1]);
    qhi[ks + D / 32] = pack_f16x2(o2[2], o2[3]);
  }
}

/* two floats -> two e4m3 bytes (lo in the low byte), nearest even, saturating at +-448 */
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

/* The lane's bytes of the new row: K dims 2l, 2l + 1 (k[0]) and D/2 + 2l, +1 (k[1]); V dims 4l .. 4l + 3 (v) */
struct NewRow8 {
  u32 k[2], v;
};
__device__ __forceinline__ void quantized_new_row(NewRow8& r, const NewKv& in, float eps, float k_scale,
                                                  float v_scale) {
  float k[4];
  rotated_new_k(k, in, eps);
#pragma unroll
  for (int i = 0; i < 4; ++i) k[i] = __fdiv_rn(round_model(k[i]), k_scale);
  r.k[0] = e4m3x2(k[0], k[1]);
  r.k[1] = e4m3x2(k[2], k[3]);
  r.v = e4m3x2(__fdiv_rn(lo_f(in.v[0]), v_scale), __fdiv_rn(hi_f(in.v[0]), v_scale))
        | (e4m3x2(__fdiv_rn(lo_f(in.v[1]), v_scale), __fdiv_rn(hi_f(in.v[1]), v_scale)) << 16);
}

/* ... stored at the slot: K row `k_row` (bytes), V pair row `v_pair` (bytes, the position's parity added) */
__device__ __forceinline__ void store_new_row8(const NewRow8& r, unsigned char* k_row, unsigned char* v_pair,
                                               int lane) {
  *(unsigned short*)(k_row + 2 * lane) = (unsigned short)r.k[0];
  *(unsigned short*)(k_row + D / 2 + 2 * lane) = (unsigned short)r.k[1];
#pragma unroll
  for (int i = 0; i < 4; ++i) v_pair[2 * (4 * lane + i)] = (unsigned char)(r.v >> (8 * i));
}

/* ... and written over position `rr` of a landed tile: K row rr (chunk c at c ^ (rr & 7)), V pair row rr / 2
   (chunk c at c ^ (pair & 7)), byte 2 d + (rr & 1) for dim d */
__device__ __forceinline__ void put_new_row8(u32 ks, u32 vs, int rr, const NewRow8& r, int lane) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const u32 b = j * (D / 2) + 2 * lane;
    const u32 a = ks + rr * 128 + (((b >> 4) ^ (u32)(rr & 7)) << 4) + (b & 15);
    asm volatile("st.shared.u16 [%0], %1;" :: "r"(a), "h"((unsigned short)r.k[j]) : "memory");
  }
  const int pair = rr >> 1;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 b = 2 * (4 * lane + i) + (rr & 1);
    const u32 a = vs + pair * 256 + (((b >> 4) ^ (u32)(pair & 7)) << 4) + (b & 15);
    asm volatile("st.shared.u8 [%0], %1;" :: "r"(a), "h"((unsigned short)((r.v >> (8 * i)) & 0xff)) : "memory");
  }
}

/* One warp = one (sequence, KV head, split). The MMAs run transposed (S^T = K q^T, O^T = V^T P^T): keys
   and dims fill the MMA's 16 rows, the GROUP query heads its 8 columns, so no MMA row is padding and the
   accumulator is [128 dims x 8 heads] (32 registers a lane). */
extern "C" __global__ void __launch_bounds__(32, 1) fp8_paged_decode(
    const u16* __restrict__ query, unsigned char* __restrict__ k_cache,
    unsigned char* __restrict__ v_cache, u16* __restrict__ out, float* __restrict__ partial_out,
    float* __restrict__ partial_lse, int* __restrict__ counters, const int* __restrict__ seq_lens,
    const int* __restrict__ block_tables,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, float scale_log2,
    int stride_q_seq, int stride_q_head, int stride_o_seq, int stride_o_head,
    long long stride_block, int stride_table, int num_q_heads, int num_splits,
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
  const float sl2 = scale_log2 * k_scale[kv_head];

  /* B fragments of q^T (column g = query head g of the group): k-slot (2t, 2t+1) of step ks is dim
     16 ks + 4t + (0, 1), slots (2t+8, 2t+9) dims + (2, 3), the order ldmatrix hands out K's bytes */
  u32 qlo[D / 16], qhi[D / 16];
#if FUSED_QK
  /* as in paged_decode16: the split holding the new token makes, stores and hands its tile that row */
  const bool holds_new = end == seq_len && start < end;
  NewRow8 new_row = {{0u, 0u}, 0u};
  bool put_new = false;  /* set by `ready`, which runs before the first tile is attended */
  const int fresh = 0x7fffffff;
#else
  const int fresh = seq_len - 1;  /* the predecessor stores this row: its tile is issued after `ready` */
#endif
  auto ready = [&]() {  /* once the predecessor that writes q (and this step's K/V row) has completed */
    pdl_wait();
    const u16* row = query + (long long)seq * stride_q_seq + (long long)(kv_head * GROUP + g) * stride_q_head;
#if FUSED_QK
    const u16* cos_row = cos_table + (long long)seq * stride_cs_seq;
    const u16* sin_row = sin_table + (long long)seq * stride_cs_seq;
    QInputs8 q_in;
    NewKv kv_in;
    load_q_inputs8(q_in, row, g < GROUP, q_weight, cos_row, sin_row, t);
    if (holds_new) {
      load_new_kv(kv_in, k_new + (long long)seq * stride_k_seq + kv_head * D,
                  v_new + (long long)seq * stride_v_seq + kv_head * D, k_weight, cos_row, sin_row,
                  slot_mapping + seq, lane);
      quantized_new_row(new_row, kv_in, eps, k_scale[kv_head], v_scale[kv_head]);
      const long long slot = kv_in.slot;
      if (slot >= 0) {  /* slot -1 (padding): stored nowhere, attended as the cache holds it, as before */
        const long long block = (slot / BLOCK_SIZE) * stride_block, pos = slot % BLOCK_SIZE;
        store_new_row8(new_row, k_cache + block + pos * STRIDE_POS + (long long)kv_head * D,
                       v_cache + block + (pos & ~1ll) * STRIDE_POS + 2ll * kv_head * D + (pos & 1), lane);
        put_new = true;
      }
    }
    rotated_q_f16(qlo, qhi, q_in, eps);
#else
    load_q(row, g < GROUP, t, qlo, qhi);
#endif
  };

  /* Loads: K row r = kr + 4 i (16-byte chunk kc), V pair row p = vr + 2 i (chunk vc), i < BN / 4; both
     start at tile position 4 i (+ 0..3), in table entry (tile + 4 i) / BLOCK_SIZE (a power of two >= 4) */
  const int kc = lane & 7, kr = lane >> 3, vc = lane & 15, vr = lane >> 4;
  const int* table = block_tables + (long long)seq * stride_table;
  const unsigned char* k_lane = k_cache + (long long)kv_head * D + kr * STRIDE_POS + kc * 16;
  const unsigned char* v_lane = v_cache + (long long)kv_head * 2 * D + 2 * vr * STRIDE_POS + vc * 16;
  const u32 smem0 = smem_addr(smem);
  const u32 kd0 = kr * 128 + ((kc ^ kr) << 4), kd1 = kr * 128 + ((kc ^ (kr + 4)) << 4);
  u32 vd[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) vd[q] = vr * 256 + ((vc ^ (vr + 2 * q)) << 4);

  auto issue = [&](int tile, int stage) {
    const u32 ks = smem0 + stage * STAGE_BYTES, vs = ks + K_TILE;
    const bool full = tile + BN <= end;
    constexpr int ENTRIES = BLOCK_SIZE >= BN ? 1 : BN / BLOCK_SIZE;
    long long off[ENTRIES];
    tile_blocks(off, table, tile, end, full, stride_block, STRIDE_POS);
#pragma unroll
    for (int i = 0; i < BN / 4; ++i) {
      const int b = (4 * i) / BLOCK_SIZE, row_off = ((4 * i) % BLOCK_SIZE) * STRIDE_POS;
      const u32 kbytes = full || tile + kr + 4 * i < end ? 16u : 0u;
      const u32 vbytes = full || tile + 2 * vr + 4 * i < end ? 16u : 0u;
      cp_async16(ks + (i & 1 ? kd1 : kd0) + 512 * i, k_lane + off[b] + row_off, kbytes);
      cp_async16(vs + vd[i & 3] + 512 * i, v_lane + off[b] + row_off, vbytes);
    }
  };

  /* acc[mt] = O^T rows (dims) 16 mt + g, 16 mt + g + 8; columns (heads) 2t, 2t + 1 */
  float acc[D / 16][4];
#pragma unroll
  for (int j = 0; j < D / 16; ++j) { acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f; }
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  /* heads 2t and 2t + 1 */

  pipeline_tiles(start, end, fresh, issue, ready, [&](int tile, int stage) {
    const u32 ks = smem0 + stage * STAGE_BYTES, vs = ks + K_TILE;
    const bool tail = tile + BN > end;
#if FUSED_QK
    if (put_new && tile + BN >= seq_len) {  /* its bytes, not the pair partner's the block below zeroes */
      put_new_row8(ks, vs, seq_len - 1 - tile, new_row, lane);
      __syncwarp();
    }
#endif
    if (tail && (end & 1)) {
      /* the pair of the last position holds an unwritten partner byte (maybe an e4m3 NaN: 0 * NaN is NaN
         in the P V product even where p is 0): zero it, one dim per lane and step */
      const int prow = (end - 1 - tile) >> 1;
#pragma unroll
      for (int d = lane; d < D; d += 32) {
        const u32 a = vs + prow * 256 + ((((2 * d) >> 4) ^ (prow & 7)) << 4) + ((2 * d + 1) & 15);
        asm volatile("st.shared.u8 [%0], %1;" :: "r"(a), "h"((u16)0) : "memory");
      }
      __syncwarp();
    }

    /* S^T = K q^T: m-tile mt is keys 16 mt .. + 15; ldmatrix x4 matrix m: keys 16 mt + 8 (m & 1) + L % 8,
       16-byte chunk 2 c + m / 2 */
    float sc[BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < BN / 16; ++mt) {
      sc[mt][0] = sc[mt][1] = sc[mt][2] = sc[mt][3] = 0.f;
#pragma unroll
      for (int c = 0; c < D / 32; ++c) {
        const int row = 16 * mt + 8 * ((lane >> 3) & 1) + (lane & 7), chunk = 2 * c + (lane >> 4);
        u32 r[4];
        ldsm_x4(ks + row * 128 + ((chunk ^ (row & 7)) << 4), r);
        u32 a[4];
        e4m3x4_f16x2(r[0], a[0], a[2]);
        e4m3x4_f16x2(r[1], a[1], a[3]);
        mma16816(sc[mt], a, qlo[2 * c], qhi[2 * c]);
        e4m3x4_f16x2(r[2], a[0], a[2]);
        e4m3x4_f16x2(r[3], a[1], a[3]);
        mma16816(sc[mt], a, qlo[2 * c + 1], qhi[2 * c + 1]);
      }
    }
    u32 pb[BN / 16][2];
    softmax_tile<BN / 16>(sc, pb, acc, m0, m1, l0, l1, sl2, tile, end, tail, g);

    /* O^T += V^T P^T: k-step s is keys 16 s .. + 15 (pair rows 8 s ..); matrix row r of ldmatrix.trans is
       pair row 8 s + r / 2 + 4 (r % 2), so lane t receives pair rows 8 s + t (keys 2t, 2t+1) and 8 s + 4 + t
       (keys 8 + 2t, 9 + 2t) of dim 8 (4 jj + m) + g from matrix m */
#pragma unroll
    for (int s = 0; s < BN / 16; ++s) {
      const int prow = 8 * s + ((lane & 7) >> 1) + 4 * (lane & 1);
#pragma unroll
      for (int jj = 0; jj < D / 32; ++jj) {
        const int chunk = 4 * jj + (lane >> 3);
        u32 r[4];
        ldsm_x4_t(vs + prow * 256 + ((chunk ^ (prow & 7)) << 4), r);
        u32 a[4];
        e4m3x4_f16x2(r[0], a[0], a[2]);  /* dims 32 jj + g */
        e4m3x4_f16x2(r[1], a[1], a[3]);  /* dims 32 jj + 8 + g */
        mma16816(acc[2 * jj], a, pb[s][0], pb[s][1]);
        e4m3x4_f16x2(r[2], a[0], a[2]);
        e4m3x4_f16x2(r[3], a[1], a[3]);
        mma16816(acc[2 * jj + 1], a, pb[s][0], pb[s][1]);
      }
    }
  });
  write_output(acc, m0, m1, l0, l1, v_scale[kv_head], out, partial_out, partial_lse, counters,
               seq_len > 0 ? (seq_len + split_len - 1) / split_len : 1, seq, kv_head, split, num_splits, num_q_heads,
               stride_o_seq, stride_o_head, lane);
}
