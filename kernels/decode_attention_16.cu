#include "decode_attention_ptx.cuh"

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
#include "decode_attention_split.cuh"

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
