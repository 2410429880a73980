
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
   last split to finish merges the splits itself (what the engine runs; null: the splits' partials are left for
   a second merge launch); `live` = the splits that hold keys */
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
