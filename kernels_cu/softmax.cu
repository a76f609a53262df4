// Softmax over the last axis, plain and attention-masked, forward and backward.
//
//   forward   z_j = fl(fl(x_j * scale) + add_j)    add_j: 0, -inf where a boolean keep-mask is False or where
//                                                  causal (or its sliding window) masks key j, or an additive
//                                                  float mask value
//             m = max_j z_j      y_j = exp(z_j - m) / sum_k exp(z_k - m)
//             a row with m = -inf (every key masked) is all zeros, never NaN.
//   backward  dx_j = scale * y_j * (dy_j - sum_k dy_k * y_k)      (masked keys have y = 0, so dx = 0 there)
//
// Plain softmax is the same kernel with scale 1, no mask, no causal. Attention rows: scores are
// [batch, heads, q_len, k_len] flattened to rows of C = k_len; row r has query q = r % q_len and batch
// b = r / (heads * q_len); key_mask is [batch, k_len]; causal keeps keys j <= q + (k_len - q_len), so the row
// has nvalid = min(C, q + k_len - q_len + 1) live keys; a sliding window W (window > 0, causal only: Hugging
// Face's kv_idx > q_idx - W) also drops keys j < lo = max(0, nvalid - W), so the live keys are [lo, nvalid),
// at most W of them.
//
// Design (numbers for [4, 32, 1024, 1024] on an H200, copy ceiling ~4.2 TB/s):
// - "reg" kernels keep the row in registers as fp32 z (at most 32 floats a thread), so x is read once and y
//   written once: 2 * C * sizeof(T) per row. A row gets TPR = blockDim.x threads (1 .. 1024) with VPT packs of
//   16 bytes; short rows share a block (TPR x RPB = 256) and rows below 32 threads share a warp
//   (common/rows.cuh). C = 1024: bf16 TPR 32 x VPT 4 (one warp per row: max and sum are 5 shuffles each, no
//   barrier), fp32 TPR 64 x VPT 4 (two warps per row, one barrier pair per reduction). Rows up to 16384
//   (fp32 and bf16) stay on chip, a block per row at the top end (kernels caching 32 floats a thread are
//   built for <= 512 threads, 128 registers; at 1024 threads per row the cache is 16 floats).
// - exp is exp2f((z - m) * log2 e) (MUFU ex2), once per live element: the fp32 z cache holds exp(z - m)
//   after the sum, so the write is a multiply.
// - Causal: packs entirely past nvalid are neither read nor exponentiated, only written as zeros; the pack
//   that straddles nvalid is masked per element. Reads drop to ~(k_len + 1) / 2 per row at q_len = k_len:
//   the op moves ~1.5 instead of 2 bytes of traffic per element. A window skips the packs entirely before lo
//   the same way (and their key-mask bytes): a row reads ~W keys (W = 4096 at k_len = 32768: 1/8 of the row),
//   every kernel below (reg, wide, loop, cluster) the same; the pack that straddles lo is masked per element.
// - The key mask (one byte per key for bool, 4 or 2 bytes for additive) is loaded with the row (8-, 4- or
//   16-byte loads when aligned); it is [batch, k_len], shared by heads x q_len rows, so it comes from L2.
// - "wide" kernels (no key mask; plain softmax and unmasked / causal attention rows) take the rows past that:
//   the row stays in registers as raw 16-byte packs (64 bf16 or 32 fp32 values a thread in 32 registers) and
//   z is recomputed in each pass; bf16 up to 65536 columns, fp32 up to 32768 (element path 16384); on sm_90 the
//   cluster kernels take the 16-byte rows instead (ops/softmax.py CLUSTER_FWD_FROM_*: past 16384 columns).
// - "cluster" kernels (sm_90+, 16-byte packs, no key mask; forward past 16384 columns, backward past the register
//   kernel) split a row over 2-8 CTAs of a thread-block cluster, each holding its slice in registers, the row
//   reductions exchanged through distributed shared memory: x (y, dy) read once, as the register kernels, up to
//   262144 columns (fp32 backward 131072). Design and numbers above their code below.
// - "loop" kernels take rows too long for registers: pass 1 keeps a running (max, sum) per thread (online
//   softmax: sum *= exp(old max - new max) when a pack raises the max) and merges threads; pass 2 re-reads
//   the row (mostly from L2: 512 threads x 132 SMs x one row in flight) and writes y. Three passes worth
//   of traffic are never needed.
// - Backward: y and dy in registers (VPT packs of each, up to 512 threads: 128 registers), one dot-product
//   reduction, one write: 3 * C * sizeof(T) per row; the loop variant re-reads y and dy in pass 2.
// - VEC=true: 16-byte loads/stores (C % (16 / sizeof(T)) == 0, x and y 16-byte aligned, checked by the
//   launcher); VEC=false: element accesses, any C, any alignment. In place (y == x) is safe: every element
//   is read before it is written, by the thread that writes it.
// - Rows are visited in groups of RPB with a block-uniform trip count (rows past the end are masked), so
//   every thread reaches every shuffle and barrier.
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/rows.cuh"

#define CK_LOG2E 1.4426950408889634f

// MASK: 0 none, 1 boolean keep-mask (1 byte per key, nonzero = keep), 2 additive fp32, 3 additive bf16.
// Fills add[E] for keys col0 .. col0 + E - 1 of the batch row that starts at `mask`.
template <int MASK, int E>
__device__ __forceinline__ void load_add(const void* mask, long long col0, bool mvec, float (&add)[E]) {
  if constexpr (MASK == 0) {
#pragma unroll
    for (int i = 0; i < E; ++i) add[i] = 0.f;
  } else if constexpr (MASK == 1) {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(mask) + col0;
    unsigned char b[E];
    if constexpr (E == 8) {
      if (mvec) {
        const unsigned long long v = *reinterpret_cast<const unsigned long long*>(p);
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = (unsigned char)(v >> (8 * i));
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = p[i];
      }
    } else if constexpr (E == 4) {
      if (mvec) {
        const unsigned int v = *reinterpret_cast<const unsigned int*>(p);
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = (unsigned char)(v >> (8 * i));
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = p[i];
      }
    } else {
#pragma unroll
      for (int i = 0; i < E; ++i) b[i] = p[i];
    }
#pragma unroll
    for (int i = 0; i < E; ++i) add[i] = b[i] ? 0.f : -CK_INF;
  } else if constexpr (MASK == 2) {
    load_f32<E>(reinterpret_cast<const float*>(mask) + col0, add, mvec);
  } else {
    load_f32<E>(reinterpret_cast<const bf16*>(mask) + col0, add, mvec);
  }
}

// Per-row geometry: the live keys [lo, nvalid) and the offset of the row's batch in the mask.
struct RowGeo {
  int lo;
  int nvalid;
  long long moff;
};
template <int MASK>
__device__ __forceinline__ RowGeo row_geo(long long row, int C, int Q, long long HQ, bool causal, int window) {
  RowGeo g;
  g.nvalid = C;
  g.lo = 0;
  if (causal) {
    g.nvalid = (int)min((long long)C, row % Q + (long long)(C - Q) + 1);
    if (window > 0) g.lo = max(0, g.nvalid - window);  // (the launcher passes 0 for no window, and for W >= C)
  }
  g.moff = MASK ? (row / HQ) * C : 0;
  return g;
}

// Key c of the row is live: lo <= c < nvalid, one unsigned compare (c - lo wraps past nvalid - lo when c < lo).
__device__ __forceinline__ bool live(int c, const RowGeo& g) {
  return (unsigned)(c - g.lo) < (unsigned)(g.nvalid - g.lo);
}

// z = fl(fl(x * scale) + add): never contracted to an FMA, so it matches the reference bit for bit.
__device__ __forceinline__ float make_z(float x, float scale, float add) {
  return __fadd_rn(__fmul_rn(x, scale), add);
}

template <typename T, int MASK, int VPT, bool VEC>
__device__ __forceinline__ void sm_fwd_reg(const T* __restrict__ x, const void* __restrict__ mask,
                                           T* __restrict__ y, long long rows, int C, int Q, long long HQ,
                                           float scale, bool causal, int window, bool mvec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[16 * 32];
  const int units = C / E;
  for (long long base = (long long)blockIdx.x * blockDim.y; base < rows; base += (long long)gridDim.x * blockDim.y) {
    const long long row = base + threadIdx.y;
    const bool ok = row < rows;
    RowGeo g{0, 0, 0};
    if (ok) g = row_geo<MASK>(row, C, Q, HQ, causal, window);
    // Packs holding at least one live key: [ulo, uvalid) (empty when !ok).
    const int ulo = g.lo / E, uvalid = (g.nvalid + E - 1) / E;
    const T* xr = x + row * C;
    Pack<T, E> raw[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (u >= ulo && u < uvalid) raw[k] = load_pack<T, E>(xr + u * E);
    }
    float z[VPT][E];
    float mx = -CK_INF;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (u >= ulo && u < uvalid) {
        float add[E];
        load_add<MASK, E>(mask, g.moff + (long long)u * E, mvec, add);
#pragma unroll
        for (int i = 0; i < E; ++i) {
          float v = make_z(to_f32(raw[k].v[i]), scale, add[i]);
          if (!live(u * E + i, g)) v = -CK_INF;  // the packs that straddle the diagonal / the window start
          z[k][i] = v;
          mx = fmaxf(mx, v);
        }
      }
    }
    mx = seg_max(mx, scratch);
    const float ms = mx == -CK_INF ? 0.f : mx;  // all keys masked: exp2f(-inf) = 0 below, sum 0, row of zeros
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const float e = u >= ulo && u < uvalid ? exp2f((z[k][i] - ms) * CK_LOG2E) : 0.f;
        z[k][i] = e;
        s += e;
      }
    }
    s = seg_sum(s, scratch);
    if (!ok) continue;  // the last group: every thread leaves the loop, no barrier follows
    const float inv = s > 0.f ? 1.f / s : 0.f;
    T* yr = y + row * C;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (u < units) {
        Pack<T, E> o;
#pragma unroll
        for (int i = 0; i < E; ++i) o.v[i] = from_f32<T>(z[k][i] * inv);
        store_pack<T, E>(yr + u * E, o);
      }
    }
  }
}

// Wide rows (past the fp32 cache above), no key mask: the row stays on chip as its raw 16-byte packs (bf16: 8
// values in 4 registers), not as fp32 z, and z is recomputed from the packs in each of the three passes (max,
// sum of exp, write). VPT 8 packs a thread: bf16 64 values in 32 registers, so 512 threads hold a 32768-column
// row and 1024 threads a 65536-column one; fp32 32 values, 1024 threads -> 32768 columns; the element path keeps
// VPT 16 single values (1024 threads -> 16384 columns). __launch_bounds__(1024, 1) caps the kernels at 64
// registers, so a 512-thread row gets two blocks (two rows, 128 KB of bf16) per SM: one block's loads stream
// while the other reduces and exponentiates. x is read from DRAM exactly once (2 * C * sizeof(T) per row, as
// in the register kernels; the loop kernel's second pass re-read 64 KB rows from an L2 that 4 blocks x 132 SMs
// x 64 KB = 34 MB of rows in flight mostly overflowed: 1.42 TB/s at 2048 x 32768 bf16, 0.67x PyTorch). The
// price is a second exp2f per element (MUFU ex2, 16 / clock / SM: 2 x 6.7e7 for that batch is ~32 us of the
// SFU, spread over a ~70 us memory-bound kernel).
template <typename T, int MASK, int VPT, bool VEC>
__device__ __forceinline__ void sm_fwd_wide(const T* __restrict__ x, const void* __restrict__ mask,
                                            T* __restrict__ y, long long rows, int C, int Q, long long HQ,
                                            float scale, bool causal, int window, bool mvec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[16 * 32];
  const int units = C / E;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {  // block-uniform: every thread reaches the barriers
    const RowGeo g = row_geo<MASK>(row, C, Q, HQ, causal, window);
    const int ulo = g.lo / E, uvalid = (g.nvalid + E - 1) / E;
    const T* xr = x + row * C;
    Pack<T, E> raw[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {  // all VPT loads issued before any use: VPT x 16 B in flight a thread
      const int u = threadIdx.x + k * blockDim.x;
      if (u >= ulo && u < uvalid) raw[k] = load_pack<T, E>(xr + u * E);
    }
    float mx = -CK_INF;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (u >= ulo && u < uvalid) {
        float add[E];
        load_add<MASK, E>(mask, g.moff + (long long)u * E, mvec, add);
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const float v = live(u * E + i, g) ? make_z(to_f32(raw[k].v[i]), scale, add[i]) : -CK_INF;
          mx = fmaxf(mx, v);
        }
      }
    }
    mx = seg_max(mx, scratch);
    const float ms = mx == -CK_INF ? 0.f : mx;  // all keys masked: exp2f(-inf) = 0 below, sum 0, row of zeros
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (u >= ulo && u < uvalid) {
        float add[E];
        load_add<MASK, E>(mask, g.moff + (long long)u * E, mvec, add);
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const float z = live(u * E + i, g) ? make_z(to_f32(raw[k].v[i]), scale, add[i]) : -CK_INF;
          s += exp2f((z - ms) * CK_LOG2E);
        }
      }
    }
    s = seg_sum(s, scratch);
    const float inv = s > 0.f ? 1.f / s : 0.f;
    T* yr = y + row * C;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (u < units) {
        Pack<T, E> o;
        if (u >= ulo && u < uvalid) {
          float add[E];
          load_add<MASK, E>(mask, g.moff + (long long)u * E, mvec, add);
#pragma unroll
          for (int i = 0; i < E; ++i) {
            const float z = live(u * E + i, g) ? make_z(to_f32(raw[k].v[i]), scale, add[i]) : -CK_INF;
            o.v[i] = from_f32<T>(exp2f((z - ms) * CK_LOG2E) * inv);
          }
        } else {
#pragma unroll
          for (int i = 0; i < E; ++i) o.v[i] = from_f32<T>(0.f);  // packs past the diagonal / before the window
        }
        store_pack<T, E>(yr + u * E, o);
      }
    }
  }
}

// Online (max, sum of exp) state merge with explicit roundings: no FMA contraction (which would round one product
// and not the other), so merge(a, b) and merge(b, a) agree bit for bit and the xor butterflies leave every lane
// with the same pair. The loop kernels and the cluster kernels share it.
__device__ __forceinline__ void ms_merge(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  if (mn == -CK_INF) {
    m = mn;
    s = 0.f;
    return;
  }
  s = __fadd_rn(__fmul_rn(s, exp2f((m - mn) * CK_LOG2E)), __fmul_rn(s2, exp2f((m2 - mn) * CK_LOG2E)));
  m = mn;
}

// Long rows: one block per row (block-stride over rows), blockDim = (threads, 1).
template <typename T, int MASK, bool VEC>
__device__ __forceinline__ void sm_fwd_loop(const T* __restrict__ x, const void* __restrict__ mask,
                                            T* __restrict__ y, long long rows, int C, int Q, long long HQ,
                                            float scale, bool causal, int window, bool mvec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float2 red[32];
  const int units = C / E;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const RowGeo g = row_geo<MASK>(row, C, Q, HQ, causal, window);
    const int ulo = g.lo / E, uvalid = (g.nvalid + E - 1) / E;
    const T* xr = x + row * C;
    float m = -CK_INF, s = 0.f;
#pragma unroll 4
    for (int u = ulo + threadIdx.x; u < uvalid; u += blockDim.x) {  // window: from its first pack
      const Pack<T, E> v = load_pack<T, E>(xr + u * E);
      float add[E], z[E];
      load_add<MASK, E>(mask, g.moff + (long long)u * E, mvec, add);
      float pm = -CK_INF;
#pragma unroll
      for (int i = 0; i < E; ++i) {
        z[i] = live(u * E + i, g) ? make_z(to_f32(v.v[i]), scale, add[i]) : -CK_INF;
        pm = fmaxf(pm, z[i]);
      }
      if (pm > m) {
        s *= exp2f((m - pm) * CK_LOG2E);  // m = -inf: s is 0 and stays 0
        m = pm;
      }
      if (m != -CK_INF)
#pragma unroll
        for (int i = 0; i < E; ++i) s += exp2f((z[i] - m) * CK_LOG2E);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      ms_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    __syncthreads();  // red may still be read for the previous row
    if (lane == 0) red[warp] = make_float2(m, s);
    __syncthreads();
    m = -CK_INF, s = 0.f;
    for (int w = 0; w < nwarps; ++w) ms_merge(m, s, red[w].x, red[w].y);  // same order in every thread
    const float ms = m == -CK_INF ? 0.f : m;
    const float inv = s > 0.f ? 1.f / s : 0.f;
    T* yr = y + row * C;
#pragma unroll 4
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      Pack<T, E> o;
      if (u >= ulo && u < uvalid) {
        const Pack<T, E> v = load_pack<T, E>(xr + u * E);
        float add[E];
        load_add<MASK, E>(mask, g.moff + (long long)u * E, mvec, add);
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const float z = live(u * E + i, g) ? make_z(to_f32(v.v[i]), scale, add[i]) : -CK_INF;
          o.v[i] = from_f32<T>(exp2f((z - ms) * CK_LOG2E) * inv);
        }
      } else {
#pragma unroll
        for (int i = 0; i < E; ++i) o.v[i] = from_f32<T>(0.f);
      }
      store_pack<T, E>(yr + u * E, o);
    }
  }
}

template <typename T, int VPT, bool VEC>
__device__ __forceinline__ void sm_bwd_reg(const T* __restrict__ yv_, const T* __restrict__ dy,
                                           T* __restrict__ dx, long long rows, int C, float scale) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[16 * 32];
  const int units = C / E;
  for (long long base = (long long)blockIdx.x * blockDim.y; base < rows; base += (long long)gridDim.x * blockDim.y) {
    const long long row = base + threadIdx.y;
    const bool ok = row < rows;
    const long long off = row * C;
    Pack<T, E> yv[VPT], gv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (ok && u < units) {
        yv[k] = load_pack<T, E>(yv_ + off + u * E);
        gv[k] = load_pack<T, E>(dy + off + u * E);
      }
    }
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k)
      if (ok && threadIdx.x + k * blockDim.x < units)
#pragma unroll
        for (int i = 0; i < E; ++i) dot += to_f32(yv[k].v[i]) * to_f32(gv[k].v[i]);
    dot = seg_sum(dot, scratch);
    if (!ok) continue;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (u < units) {
        Pack<T, E> o;
#pragma unroll
        for (int i = 0; i < E; ++i)
          o.v[i] = from_f32<T>(scale * to_f32(yv[k].v[i]) * (to_f32(gv[k].v[i]) - dot));
        store_pack<T, E>(dx + off + u * E, o);
      }
    }
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ void sm_bwd_loop(const T* __restrict__ yv_, const T* __restrict__ dy,
                                            T* __restrict__ dx, long long rows, int C, float scale) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[16 * 32];
  const int units = C / E;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const long long off = row * C;
    float dot = 0.f;
#pragma unroll 4
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const Pack<T, E> a = load_pack<T, E>(yv_ + off + u * E), b = load_pack<T, E>(dy + off + u * E);
#pragma unroll
      for (int i = 0; i < E; ++i) dot += to_f32(a.v[i]) * to_f32(b.v[i]);
    }
    dot = seg_sum(dot, scratch);
#pragma unroll 4
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const Pack<T, E> a = load_pack<T, E>(yv_ + off + u * E), b = load_pack<T, E>(dy + off + u * E);
      Pack<T, E> o;
#pragma unroll
      for (int i = 0; i < E; ++i) o.v[i] = from_f32<T>(scale * to_f32(a.v[i]) * (to_f32(b.v[i]) - dot));
      store_pack<T, E>(dx + off + u * E, o);
    }
  }
}

// ---- Rows over a thread-block cluster (sm_90+; compiled only there, the launcher asks for them only there).
// A row past the register kernels is split over the NC CTAs of a cluster (__cluster_dims__(NC, 1, 1), so a plain
// launch with gridDim.x = clusters x NC works): CTA rank r holds packs [r * upc, (r + 1) * upc) of the row in
// registers, x (y, dy) is read from DRAM once and the row's reductions cross the cluster through distributed
// shared memory (DSMEM).
// The exchange, one a row: each warp reduces its lanes with xor shuffles, then lanes 0 .. NC - 1 push the warp's
// partial into CTA `lane`'s slot [rank][warp] with st.async, which counts its bytes on that CTA's mbarrier
// (complete_tx); each CTA expects NC x nwarps partials, waits on its own mbarrier, and lane l merges warp l's
// partials of ranks 0, 1, ..., NC - 1 in that order, then the lanes with the same xor butterfly. Every CTA holds
// the same partials in the same places: the same bits in every thread of the cluster and from run to run,
// whatever the timing. Not a barrier.cluster: its arrive.release compiles to MEMBAR.ALL.GPU (ptxas sm_90), which
// waits for the previous row's outstanding global stores, and its wait.acquire to CCTL.IVALL (L1 invalidated
// every row); the mbarrier wait is a CTA-scope acquire of data that arrived in the CTA's own shared memory.
// Reuse: slots and mbarriers alternate by row (2 each). Slot p is written again two rows later, by a CTA that
// has received every CTA's partial of the row between, each sent after its sender had read slot p; the
// mbarrier's phase for row i completed (this CTA waited on it) before any partial of row i + 2 can arrive. A CTA
// exits only after receiving every partial sent to it, so no CTA writes into an exited one. One barrier.cluster
// before the first exchange: the mbarriers are initialised before any remote st.async reaches them.
// - forward: 32 fp32 values a thread (fp32: 8 packs of 4; bf16: 4 packs of 8, so the registers hold z, then
//   exp(z - m_t), never the raw packs past the load): each thread keeps (m_t, s_t = sum exp(z - m_t)) over its
//   own values and overwrites them with exp(z - m_t), the cluster merges the (m, s) pairs (online softmax), and
//   the write is y = e * (exp(m_t - m) / s): one exp2f an element, not the wide kernel's two.
// - backward: VPT 4 packs of y and of dy a thread (32 registers of row), one dot-product merge.
// __launch_bounds__(1024, 1) caps the registers at 64, so 512-thread CTAs run two a SM (the launcher's default:
// one CTA loads while the other reduces) and 1024-thread CTAs one. Bytes in flight a SM at 512 threads: the
// backward 2 x 512 x 4 x 2 x 16 B = 128 KB (the register backward's 97 %-of-copy point), the forward 2 x 512 x
// 32 x sizeof(T): 128 KB fp32, 64 KB bf16 (Little's law at 4.2 TB/s and ~1 us asks ~32 KB a SM).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned cl_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cl_id() {
  unsigned r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cl_count() {
  unsigned r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// The same shared offset in CTA `rank` of the cluster.
__device__ __forceinline__ unsigned cl_map(unsigned a, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ void cl_send(unsigned dst, unsigned bar, float v) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(dst),
               "r"(__float_as_uint(v)), "r"(bar) : "memory");
}
__device__ __forceinline__ void cl_send(unsigned dst, unsigned bar, float2 v) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(dst),
               "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(bar) : "memory");
}

// Shared state of the exchange: 2 row slots of NC x 32 warp partials (V: float or float2), 2 mbarriers.
template <int NC, typename V>
struct ClExchange {
  V slot[2][NC][32];
  unsigned long long bar[2];
};

// Before the first exchange, every thread: mbarriers initialised (one arrival a phase: thread 0's expect_tx) and
// published to the cluster. Called after the first row's loads are issued: the grid is a cluster a row, so
// this barrier comes once a row and its wait hides behind the loads.
template <int NC, typename V>
__device__ __forceinline__ void cl_init(ClExchange<NC, V>& x) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int p = 0; p < 2; ++p)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&x.bar[p])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // fence.mbarrier_init is the release the mbarriers need (CUTLASS's pipeline init pairs it with a relaxed
  // arrive): arrive.release would add a MEMBAR.ALL.GPU.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

// Row `it` (this CTA's count): v is the warp's partial, the same in every lane. Returns once slot it & 1 holds
// every CTA's partials of the row.
template <int NC, typename V>
__device__ __forceinline__ const V (*cl_exchange(ClExchange<NC, V>& x, V v, int it))[32] {
  if (it == 0) cl_init(x);
  const int p = it & 1, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned bar = smem_addr(&x.bar[p]);
  if (threadIdx.x == 0)  // this phase's one arrival, and the bytes it waits for
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                 "r"((unsigned)(NC * (blockDim.x >> 5) * sizeof(V))) : "memory");
  if (lane < NC)
    cl_send(cl_map(smem_addr(&x.slot[p][cl_rank()][warp]), lane), cl_map(bar, lane), v);
  const unsigned parity = (it >> 1) & 1;  // the mbarrier's phase: its (it / 2)-th use
  unsigned ok = 0;
  do {
    asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                 : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  } while (!ok);
  return x.slot[p];
}

__device__ __forceinline__ void ms_warp(float& m, float& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    ms_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
}

// The row's (max, sum) from every thread's (m, s). All threads call it, once a row.
template <int NC>
__device__ __forceinline__ void cl_reduce_ms(float& m, float& s, ClExchange<NC, float2>& x, int it) {
  ms_warp(m, s);
  const float2(*got)[32] = cl_exchange<NC, float2>(x, make_float2(m, s), it);
  m = -CK_INF, s = 0.f;
  if ((threadIdx.x & 31) < (blockDim.x >> 5))  // lane l: warp l's pairs of ranks 0, 1, ..., NC - 1, in that order
#pragma unroll
    for (int r = 0; r < NC; ++r) {
      const float2 v = got[r][threadIdx.x & 31];
      ms_merge(m, s, v.x, v.y);
    }
  ms_warp(m, s);
}

// The row's sum of every thread's v. All threads call it, once a row.
template <int NC>
__device__ __forceinline__ float cl_reduce_sum(float v, ClExchange<NC, float>& x, int it) {
  const float(*got)[32] = cl_exchange<NC, float>(x, warp_sum(v), it);
  v = 0.f;
  if ((threadIdx.x & 31) < (blockDim.x >> 5))
#pragma unroll
    for (int r = 0; r < NC; ++r) v += got[r][threadIdx.x & 31];
  return warp_sum(v);  // xor butterfly of a commutative add: the same bits in every lane
}

// Forward, no key mask (plain softmax, unmasked or causal attention rows), 16-byte packs only. The cluster
// (clusterid.x) takes rows clusterid.x, + nclusterid.x, ...; its CTAs agree on the trip count, so every CTA
// sends and expects the same exchanges (and every thread reaches the one barrier.cluster).
template <typename T, int NC>
__device__ __forceinline__ void sm_fwd_cluster(const T* __restrict__ x, T* __restrict__ y, long long rows, int C,
                                               int Q, long long HQ, float scale, bool causal, int window,
                                               int upc) {
  constexpr int E = 16 / sizeof(T);
  constexpr int VPT = 32 / E;  // 32 fp32 values a thread: fp32 8 packs, bf16 4
  __shared__ ClExchange<NC, float2> xch;
  const int units = C / E;
  // Warp w of rank r owns packs r * upc + w * 32 * VPT + [0, 32 * VPT): its k-th load is 32 consecutive packs
  // (512 B), and a thread's packs sit 512 B apart, immediate offsets from one address register (with a
  // blockDim.x stride each pack needs its own 64-bit address).
  const int u0 = (int)cl_rank() * upc + (int)(threadIdx.x >> 5) * (32 * VPT) + (threadIdx.x & 31);
  const int u1 = min((int)(cl_rank() + 1) * upc, units);
  int it = 0;  // rows done: picks the slot and the mbarrier phase
  for (long long row = cl_id(); row < rows; row += cl_count()) {
    const RowGeo g = row_geo<0>(row, C, Q, HQ, causal, window);
    // Packs past the diagonal or before the window are not read (whole CTAs of the cluster may hold none).
    const int ulo = g.lo / E, uvalid = min(u1, (g.nvalid + E - 1) / E);
    const T* xr = x + row * C;
    Pack<T, E> raw[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {  // all loads issued before any use: VPT x 16 B in flight a thread
      const int u = u0 + 32 * k;
      // Zeroed first: a pack left undefined on the skipped path was carried over from the previous row in its
      // registers (ptxas spilled them across the loop, fp32).
      raw[k] = Pack<T, E>{};
      if (u >= ulo && u < uvalid) raw[k] = load_pack<T, E>(xr + u * E);
    }
    // z = -inf past the slice, the diagonal or before the window (exp2f(-inf) = 0: written as zeros below).
    float z[VPT][E];
    float m = -CK_INF;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = u0 + 32 * k;
      const bool in = u >= ulo && u < uvalid;
      float f[E];
      unpack_f32<T, E>(raw[k], f);
#pragma unroll
      for (int i = 0; i < E; ++i) {
        z[k][i] = in && live(u * E + i, g) ? make_z(f[i], scale, 0.f) : -CK_INF;
        m = fmaxf(m, z[k][i]);
      }
    }
    const float ms = m == -CK_INF ? 0.f : m;
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k)
#pragma unroll
      for (int i = 0; i < E; ++i) {
        z[k][i] = exp2f((z[k][i] - ms) * CK_LOG2E);
        s += z[k][i];
      }
    float rm = m, rs = s;
    cl_reduce_ms<NC>(rm, rs, xch, it++);
    // rs > 0 implies rm finite; m = -inf (nothing live here) gives exp2f(-inf) = 0. A row with every key -inf:
    // rs = 0, zeros.
    const float fac = rs > 0.f ? exp2f((m - rm) * CK_LOG2E) * (1.f / rs) : 0.f;
    T* yr = y + row * C;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = u0 + 32 * k;
      if (u < u1) {
        float f[E];
#pragma unroll
        for (int i = 0; i < E; ++i) f[i] = z[k][i] * fac;
        store_pack<T, E>(yr + u * E, pack_f32<T, E>(f));
      }
    }
  }
}

template <typename T, int NC>
__device__ __forceinline__ void sm_bwd_cluster(const T* __restrict__ yv_, const T* __restrict__ dy,
                                               T* __restrict__ dx, long long rows, int C, float scale, int upc) {
  constexpr int E = 16 / sizeof(T);
  constexpr int VPT = 4;  // packs of y and of dy: 32 registers of row
  __shared__ ClExchange<NC, float> xch;
  const int units = C / E;
  const int u0 = (int)cl_rank() * upc + (int)(threadIdx.x >> 5) * (32 * VPT) + (threadIdx.x & 31);  // as forward
  const int u1 = min((int)(cl_rank() + 1) * upc, units);
  int it = 0;  // rows done: picks the slot and the mbarrier phase
  for (long long row = cl_id(); row < rows; row += cl_count()) {
    const long long off = row * C;
    Pack<T, E> yv[VPT], gv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = u0 + 32 * k;
      yv[k] = gv[k] = Pack<T, E>{};  // as forward: nothing carried over from the previous row
      if (u < u1) {
        yv[k] = load_pack<T, E>(yv_ + off + u * E);
        gv[k] = load_pack<T, E>(dy + off + u * E);
      }
    }
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k)
      if (u0 + 32 * k < u1) {
        float a[E], b[E];
        unpack_f32<T, E>(yv[k], a);
        unpack_f32<T, E>(gv[k], b);
#pragma unroll
        for (int i = 0; i < E; ++i) dot += a[i] * b[i];
      }
    dot = cl_reduce_sum<NC>(dot, xch, it++);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = u0 + 32 * k;
      if (u < u1) {
        float a[E], b[E], o[E];
        unpack_f32<T, E>(yv[k], a);
        unpack_f32<T, E>(gv[k], b);
#pragma unroll
        for (int i = 0; i < E; ++i) o[i] = scale * a[i] * (b[i] - dot);
        store_pack<T, E>(dx + off + u * E, pack_f32<T, E>(o));
      }
    }
  }
}
#endif  // __CUDA_ARCH__ >= 900

// ---- extern "C" entry points, one per instantiation (CuPy's disk cache keeps these; name_expressions are
// reported not to be kept, cupy/cupy#9667). Names: sm_fwd_<x dtype>_<mask>_<VPT><v|s> with mask one of
// none, u8 (bool keep-mask), f32, bf16 (additive); sm_bwd_<dtype>_<VPT><v|s>; *_loop_* for long rows.
// Backward blocks up to 512 threads (128 registers: VPT packs of y and of dy).
// Kernels caching 32 floats a thread get 128 registers (blocks of <= 512 threads); the others 64 (<= 1024).
#define SM_LB(T, VPT, VEC) ((VEC ? VPT * (16 / (int)sizeof(T)) : VPT) >= 32 ? 512 : 1024)
#define SM_FWD(T, TN, MASK, MN, VPT, VEC, VS)                                                                   \
  CK_ENTRY(__launch_bounds__(SM_LB(T, VPT, VEC)),                                                              \
      sm_fwd_##TN##_##MN##_##VPT##VS)(const T* x, const void* mask, T* y, long long rows, int C, int Q,         \
                                     long long HQ, float scale, bool causal, int window, bool mvec) {          \
    sm_fwd_reg<T, MASK, VPT, VEC>(x, mask, y, rows, C, Q, HQ, scale, causal, window, mvec);                    \
  }
#define SM_FWD_LOOP(T, TN, MASK, MN, VEC, VS)                                                                   \
  CK_ENTRY(__launch_bounds__(512),                                                                             \
      sm_fwd_loop_##TN##_##MN##_##VS)(const T* x, const void* mask, T* y, long long rows, int C, int Q,         \
                                     long long HQ, float scale, bool causal, int window, bool mvec) {          \
    sm_fwd_loop<T, MASK, VEC>(x, mask, y, rows, C, Q, HQ, scale, causal, window, mvec);                        \
  }
// Wide kernels, no key mask only: 16-byte packs VPT 8 (32 registers of row), element path VPT 16 (16 single
// values), <= 64 registers (__launch_bounds__(1024, 1)). With a mask, re-loading it in passes 2 and 3 pushed
// ptxas past 64 registers (4-150 bytes of spills, sm_80 / sm_90), so masked rows this long keep the loop kernel.
#define SM_FWD_WIDE(T, TN, MASK, MN, VPT, VEC, VS)                                                              \
  CK_ENTRY(__launch_bounds__(1024, 1),                                                                         \
      sm_fwd_wide_##TN##_##MN##_##VS)(const T* x, const void* mask, T* y, long long rows, int C, int Q,         \
                                     long long HQ, float scale, bool causal, int window, bool mvec) {          \
    sm_fwd_wide<T, MASK, VPT, VEC>(x, mask, y, rows, C, Q, HQ, scale, causal, window, mvec);                   \
  }
// z is cached as VPT * E floats: at most 32 (bf16 packs of 8 up to VPT 4; fp32 packs of 4 stop at VPT 4 too,
// because the launcher only reaches VPT 8 at 1024 threads per row, where 16 floats is the limit).
#define SM_FWD_MASK(T, TN, MASK, MN)                                                                            \
  SM_FWD(T, TN, MASK, MN, 1, true, v) SM_FWD(T, TN, MASK, MN, 2, true, v) SM_FWD(T, TN, MASK, MN, 4, true, v)   \
  SM_FWD(T, TN, MASK, MN, 1, false, s) SM_FWD(T, TN, MASK, MN, 2, false, s)                                     \
  SM_FWD(T, TN, MASK, MN, 4, false, s) SM_FWD(T, TN, MASK, MN, 8, false, s)                                     \
  SM_FWD_LOOP(T, TN, MASK, MN, true, v) SM_FWD_LOOP(T, TN, MASK, MN, false, s)
#define SM_BWD(T, TN, VPT, VEC, VS)                                                                             \
  CK_ENTRY(__launch_bounds__(512),                                                                             \
      sm_bwd_##TN##_##VPT##VS)(const T* y, const T* dy, T* dx, long long rows, int C, float scale) {            \
    sm_bwd_reg<T, VPT, VEC>(y, dy, dx, rows, C, scale);                                                        \
  }
#define SM_BWD_ALL(T, TN)                                                                                       \
  SM_BWD(T, TN, 1, true, v) SM_BWD(T, TN, 2, true, v) SM_BWD(T, TN, 4, true, v) SM_BWD(T, TN, 8, true, v)       \
  SM_BWD(T, TN, 1, false, s) SM_BWD(T, TN, 2, false, s) SM_BWD(T, TN, 4, false, s)                              \
  SM_BWD(T, TN, 8, false, s)                                                                                    \
  CK_ENTRY(__launch_bounds__(512),                                                                             \
      sm_bwd_loop_##TN##_v)(const T* y, const T* dy, T* dx, long long rows, int C, float scale) {               \
    sm_bwd_loop<T, true>(y, dy, dx, rows, C, scale);                                                           \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(512),                                                                             \
      sm_bwd_loop_##TN##_s)(const T* y, const T* dy, T* dx, long long rows, int C, float scale) {               \
    sm_bwd_loop<T, false>(y, dy, dx, rows, C, scale);                                                          \
  }

SM_FWD_MASK(float, f32, 0, none)
SM_FWD_WIDE(float, f32, 0, none, 8, true, v)
SM_FWD_WIDE(float, f32, 0, none, 16, false, s)
SM_FWD_WIDE(bf16, bf16, 0, none, 8, true, v)
SM_FWD_WIDE(bf16, bf16, 0, none, 16, false, s)
SM_FWD_MASK(float, f32, 1, u8)
SM_FWD_MASK(float, f32, 2, f32)
SM_FWD_MASK(bf16, bf16, 0, none)
SM_FWD_MASK(bf16, bf16, 1, u8)
SM_FWD_MASK(bf16, bf16, 2, f32)
SM_FWD_MASK(bf16, bf16, 3, bf16)
SM_BWD_ALL(float, f32)
SM_BWD_ALL(bf16, bf16)

// Cluster kernels (sm_90+ only: no entry point on sm_80, where the launcher never asks for one; __cluster_dims__
// stands before `void` so _loader's entry-point pattern, which every arch's PTX must match, skips them). Names:
// sm_fwd_cluster<NC>_<dtype>_none_v, sm_bwd_cluster<NC>_<dtype>_v; 16-byte packs only, no key mask. ptxas sm_90
// (NVRTC 12.9), no spills: forward fp32 56 / 60 / 62 registers (NC 2 / 4 / 8; 63 / 61 / 62 before the sliding
// window), bf16 55 / 64 / 63; backward 56 throughout. Shared memory 0.5-4 KB (the exchange slots), so registers set
// the occupancy: 2 CTAs of 512 threads a SM.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SM_FWD_CLUSTER(T, TN, NC)                                                                               \
  CK_ENTRY(__cluster_dims__(NC, 1, 1) __launch_bounds__(1024, 1),                                              \
      sm_fwd_cluster##NC##_##TN##_none_v)(const T* x, T* y, long long rows, int C, int Q, long long HQ,         \
                                         float scale, bool causal, int window, int upc) {                      \
    sm_fwd_cluster<T, NC>(x, y, rows, C, Q, HQ, scale, causal, window, upc);                                   \
  }
#define SM_BWD_CLUSTER(T, TN, NC)                                                                               \
  CK_ENTRY(__cluster_dims__(NC, 1, 1) __launch_bounds__(1024, 1),                                              \
      sm_bwd_cluster##NC##_##TN##_v)(const T* y, const T* dy, T* dx, long long rows, int C, float scale,        \
                                    int upc) {                                                                 \
    sm_bwd_cluster<T, NC>(y, dy, dx, rows, C, scale, upc);                                                     \
  }
#define SM_CLUSTER(T, TN)                                                                                       \
  SM_FWD_CLUSTER(T, TN, 2) SM_FWD_CLUSTER(T, TN, 4) SM_FWD_CLUSTER(T, TN, 8)                                   \
  SM_BWD_CLUSTER(T, TN, 2) SM_BWD_CLUSTER(T, TN, 4) SM_BWD_CLUSTER(T, TN, 8)
SM_CLUSTER(float, f32)
SM_CLUSTER(bf16, bf16)
#endif
