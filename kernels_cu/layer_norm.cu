// LayerNorm over the last axis: rows of C elements, affine parameters gamma, beta of C elements.
//
//   forward   mu = mean(x)                 var = mean((x - mu)^2)        r = 1 / sqrt(var + eps)
//             xh = (x - mu) * r            y = xh * gamma + beta         (mu, r: one fp32 each per row, saved)
//   backward  g = dy * gamma
//             dx = r * (g - mean(g) - xh * mean(g * xh))
//             dgamma = sum over rows of dy * xh          dbeta = sum over rows of dy
//
// Design (numbers for 8192 x 2048 on an H200, copy ceiling ~4.2 TB/s; the structure is rms_norm.cu's):
// - "reg" kernels keep the row in registers, so x (and dy) are read exactly once: forward moves
//   2 * C * sizeof(T) per row (+ 8 B of stats), backward 3 * C * sizeof(T) (+ 8 B). A row is split over
//   TPR = blockDim.x threads (1 .. 1024, a power of two) with VPT packs of 16 bytes each; rows of fewer than
//   256 threads share a block (TPR x RPB = 256), and below 32 threads several rows share a warp
//   (common/rows.cuh reduces within a row's lanes), so C = 1 .. 64 still fills the machine.
//   8192 x 2048: forward bf16 TPR 64 x VPT 4 (4 rows a block; the launcher's bf16 forward target, session 12:
//   fewer threads a row, fewer cross-warp reduction steps), fp32 TPR 256 x VPT 2; backward bf16 TPR 128 x VPT 2,
//   fp32 TPR 256 x VPT 2.
//   Backward blocks stop at 512 threads (128 registers: packs of x and dy plus the dgamma/dbeta accumulators,
//   2 * VPT * 8 floats); vector packs stop at 4 a thread (element packs at 8). In registers: forward up to
//   1024 x 4 packs (fp32 C <= 16384, bf16 C <= 32768), backward 512 x 4 packs (fp32 8192, bf16 16384).
// - Mean and variance from registers: the exact two-level form (sum, then sum of (x - mu)^2 over the same
//   registers) is as stable as Welford and costs one extra in-register pass. The "loop" kernels (longer
//   rows, one 1024-thread block per row) merge per-pack (count, mean, M2) with Chan's formula in one pass and
//   write in a second pass that mostly hits L2.
// - Rows are visited in groups of RPB with a block-uniform trip count (rows past the end are masked, not
//   skipped), so every thread reaches every shuffle and barrier.
// - VEC=true: 16-byte loads/stores, needs C % (16 / sizeof(T)) == 0 and 16-byte aligned x / y (dy, dx):
//   checked by the launcher. VEC=false: element accesses, any C, any alignment. gamma/beta take 16-byte
//   loads when `w_vec` (their own alignment) says so.
// - dgamma/dbeta are deterministic, two stages: each block accumulates its rows' dy * xh and dy in
//   registers (a thread owns the same columns for every row it visits), writes one fp32 partial row of each
//   per block (part[blk] and part[nblocks + blk]), and ln_finalize sums the partials in a fixed order. The
//   launcher sizes the grid to one wave (~264 blocks at 8192 x 2048): 2 x 264 x C x 4 B = 4.3 MB of
//   partials, written and re-read through L2 (4 % of the fp32 backward's bytes, 8 % of bf16's).
//   The loop kernel accumulates into its (memset-zeroed) partial rows instead, one block per SM.
// - Issue 17: on the 16-byte path with >= 32 threads a row the launcher takes ln_bwd_pipe instead of
//   ln_bwd_reg (cp.async pipeline, blocks of 256 threads, three per SM: 2 x 396 partial rows), except bf16 rows of
//   C 520..1024, which take ln_bwd_warp (one warp a row, session 14).
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/rows.cuh"
#include "common/pipe.cuh"
#include "common/pdl.cuh"

template <typename T, typename W, int VPT, bool VEC>
__device__ __forceinline__ void ln_fwd_reg(const T* __restrict__ x, const W* __restrict__ gamma,
                                           const W* __restrict__ beta, T* __restrict__ y,
                                           float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                           long long rows, int C, float eps, bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[16 * 32];
  const int units = C / E;
  const float inv_c = 1.f / (float)C;
  for (long long base = (long long)blockIdx.x * blockDim.y; base < rows; base += (long long)gridDim.x * blockDim.y) {
    const long long row = base + threadIdx.y;
    const bool ok = row < rows;
    const T* xr = x + row * C;
    Pack<T, E> xv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (ok && u < units) xv[k] = load_pack<T, E>(xr + u * E);
    }
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k)
      if (ok && threadIdx.x + k * blockDim.x < units)
#pragma unroll
        for (int i = 0; i < E; ++i) s += to_f32(xv[k].v[i]);
    const float mu = seg_sum(s, scratch) * inv_c;
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k)
      if (ok && threadIdx.x + k * blockDim.x < units)
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const float d = to_f32(xv[k].v[i]) - mu;
          q += d * d;
        }
    const float r = rsqrtf(seg_sum(q, scratch) * inv_c + eps);
    if (!ok) continue;  // block-uniform from here on: no barrier below
    if (threadIdx.x == 0) {
      if (mean_out != nullptr) mean_out[row] = mu;
      if (rstd_out != nullptr) rstd_out[row] = r;
    }
    T* yr = y + row * C;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (u < units) {
        float gf[E], bf[E];
        load_f32<E>(gamma + u * E, gf, w_vec);
        load_f32<E>(beta + u * E, bf, w_vec);
        Pack<T, E> o;
#pragma unroll
        for (int i = 0; i < E; ++i) o.v[i] = from_f32<T>((to_f32(xv[k].v[i]) - mu) * r * gf[i] + bf[i]);
        store_pack<T, E>(yr + u * E, o);
      }
    }
  }
}

// Chan et al.'s merge of (count, mean, M2) statistics: (n, m, M2) <- (n, m, M2) + (nb, mb, M2b).
__device__ __forceinline__ void chan_merge(float& n, float& m, float& M2, float nb, float mb, float M2b) {
  if (nb == 0.f) return;
  const float nn = n + nb;
  const float f = __fdividef(nb, nn);  // counts <= C < 2^31: no slow-path IEEE division (it costs a stack frame)
  const float d = mb - m;
  m += d * f;
  M2 += M2b + d * d * n * f;
  n = nn;
}

// Long rows: one block per row (block-stride over rows), blockDim.x threads, blockDim.y == 1.
// Pass 1 merges per-pack statistics; pass 2 re-reads the row (L2) and writes y.
template <typename T, typename W, bool VEC>
__device__ __forceinline__ void ln_fwd_loop(const T* __restrict__ x, const W* __restrict__ gamma,
                                            const W* __restrict__ beta, T* __restrict__ y,
                                            float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                            long long rows, int C, float eps, bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float3 red[32];
  const int units = C / E;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * C;
    float n = 0.f, m = 0.f, M2 = 0.f;
#pragma unroll 4
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const Pack<T, E> v = load_pack<T, E>(xr + u * E);
      float pm = 0.f;
#pragma unroll
      for (int i = 0; i < E; ++i) pm += to_f32(v.v[i]);
      pm *= 1.f / E;
      float pq = 0.f;
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const float d = to_f32(v.v[i]) - pm;
        pq += d * d;
      }
      chan_merge(n, m, M2, (float)E, pm, pq);
    }
    // Warp: butterfly with the lower lane's statistics always merged first, so both lanes of a pair compute
    // the same bits. Then every thread merges the warps' results in warp order.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float n2 = __shfl_xor_sync(0xffffffffu, n, o), m2 = __shfl_xor_sync(0xffffffffu, m, o),
                  q2 = __shfl_xor_sync(0xffffffffu, M2, o);
      if (lane & o) {
        float a = n2, b = m2, c = q2;
        chan_merge(a, b, c, n, m, M2);
        n = a, m = b, M2 = c;
      } else {
        chan_merge(n, m, M2, n2, m2, q2);
      }
    }
    __syncthreads();  // red may still be read for the previous row
    if (lane == 0) red[warp] = make_float3(n, m, M2);
    __syncthreads();
    n = 0.f, m = 0.f, M2 = 0.f;
    for (int w = 0; w < nwarps; ++w) {
      const float3 t = red[w];
      chan_merge(n, m, M2, t.x, t.y, t.z);
    }
    const float mu = m;
    const float r = rsqrtf(M2 / (float)C + eps);
    if (threadIdx.x == 0) {
      if (mean_out != nullptr) mean_out[row] = mu;
      if (rstd_out != nullptr) rstd_out[row] = r;
    }
    T* yr = y + row * C;
#pragma unroll 4
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const Pack<T, E> v = load_pack<T, E>(xr + u * E);
      float gf[E], bf[E];
      load_f32<E>(gamma + u * E, gf, w_vec);
      load_f32<E>(beta + u * E, bf, w_vec);
      Pack<T, E> o;
#pragma unroll
      for (int i = 0; i < E; ++i) o.v[i] = from_f32<T>((to_f32(v.v[i]) - mu) * r * gf[i] + bf[i]);
      store_pack<T, E>(yr + u * E, o);
    }
  }
}

// part: 2 * gridDim.x fp32 rows of C: dgamma partials, then dbeta partials; fully overwritten.
template <typename T, typename W, int VPT, bool VEC>
__device__ __forceinline__ void ln_bwd_reg(const T* __restrict__ dy, const T* __restrict__ x,
                                           const W* __restrict__ gamma, const float* __restrict__ mean,
                                           const float* __restrict__ rstd, T* __restrict__ dx,
                                           float* __restrict__ part, long long rows, int C, bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float2 scratch[16 * 32];
  __shared__ float combine[256 * 8];
  const int units = C / E;
  const float inv_c = 1.f / (float)C;
  float acc_g[VPT][E], acc_b[VPT][E];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int i = 0; i < E; ++i) acc_g[k][i] = acc_b[k][i] = 0.f;

  for (long long base = (long long)blockIdx.x * blockDim.y; base < rows; base += (long long)gridDim.x * blockDim.y) {
    const long long row = base + threadIdx.y;
    const bool ok = row < rows;
    const long long off = row * C;
    Pack<T, E> xv[VPT], gv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (ok && u < units) {
        xv[k] = load_pack<T, E>(x + off + u * E);
        gv[k] = load_pack<T, E>(dy + off + u * E);
      }
    }
    const float mu = ok ? mean[row] : 0.f, r = ok ? rstd[row] : 0.f;
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (ok && u < units) {
        float wf[E];
        load_f32<E>(gamma + u * E, wf, w_vec);
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const float g = to_f32(gv[k].v[i]) * wf[i];
          sg += g;
          sgx += g * ((to_f32(xv[k].v[i]) - mu) * r);
        }
      }
    }
    seg_sum2(sg, sgx, scratch);
    const float a = sg * inv_c, b = sgx * inv_c;
    if (ok) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int u = threadIdx.x + k * blockDim.x;
        if (u < units) {
          float wf[E];
          load_f32<E>(gamma + u * E, wf, w_vec);
          Pack<T, E> o;
#pragma unroll
          for (int i = 0; i < E; ++i) {
            const float xh = (to_f32(xv[k].v[i]) - mu) * r, d = to_f32(gv[k].v[i]);
            o.v[i] = from_f32<T>(r * (d * wf[i] - a - xh * b));
            acc_g[k][i] += d * xh;
            acc_b[k][i] += d;
          }
          store_pack<T, E>(dx + off + u * E, o);
        }
      }
    }
  }
  write_block_partial<VPT, E>(acc_g, part + (long long)blockIdx.x * C, units, combine);
  write_block_partial<VPT, E>(acc_b, part + (long long)(gridDim.x + blockIdx.x) * C, units, combine);
}

// Backward, 16-byte path (issue 17): ln_bwd_reg's math fed by a cp.async pipeline.
// Why: ln_bwd_reg holds x and dy in registers across the row reduction, so a block cannot load its next row
// group before the current one is written; its one-wave grid of 128-register blocks alternates between waiting
// on DRAM and computing, in step: 1.97 TB/s (47 % of copy) at 8192 x 2048 bf16 (NOTES.md run 4). And its
// partials are 2 rows (dgamma, dbeta) per block of 256 threads: 2 x 264+ x C x 4 B, written and re-read.
// Here each thread copies its own packs of x and dy for the next nstages - 1 row groups (a kernel argument,
// 2..4) into shared memory with cp.async while it computes the current one; packs are read back from shared
// memory (twice) instead of being held in registers. Blocks of NTH threads (512: one per SM at ~96 registers;
// 256: three per SM, so one block's barriers overlap the others' work).
// A thread reads back only the packs it copied itself: no barrier per stage (see rms_norm.cu, rms_bwd_pipe).
// Stage layout: [tensor][k][thread] 16-byte packs (no bank conflicts).
// The row's mean and rstd are loaded one group ahead (session 8: loaded after the wait they cost one exposed
// global round trip a group) and the gamma row is prefetched into L1 before the first wait.
template <typename T, typename W, int VPT>
__device__ __forceinline__ void ln_bwd_pipe(const T* __restrict__ dy, const T* __restrict__ x,
                                            const W* __restrict__ gamma, const float* __restrict__ mean,
                                            const float* __restrict__ rstd, T* __restrict__ dx,
                                            float* __restrict__ part, long long rows, int C, int nstages,
                                            bool w_vec) {
  constexpr int E = 16 / sizeof(T);
  extern __shared__ __align__(16) unsigned char ln_dyn_smem[];
  __shared__ float2 scratch[16 * 32];
  Pack<T, E>* const stages = reinterpret_cast<Pack<T, E>*>(ln_dyn_smem);
  const int nth = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int units = C / E;
  const int stage_packs = 2 * VPT * nth;
  const float inv_c = 1.f / (float)C;
  const long long groups = (rows + blockDim.y - 1) / blockDim.y;
  const long long n = (long long)blockIdx.x < groups ? (groups - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  float acc_g[VPT][E], acc_b[VPT][E];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int i = 0; i < E; ++i) acc_g[k][i] = acc_b[k][i] = 0.f;

  const long long row0 = (long long)blockIdx.x * blockDim.y + threadIdx.y, row_step = (long long)gridDim.x * blockDim.y;
  auto row_of = [&](long long i) { return row0 + i * row_step; };
  // Copies group i into stage `s` (nothing past the end) and commits one cp.async group either way.
  auto issue = [&](long long i, int s) {
    const long long row = row_of(i);
    if (i < n && row < rows) {
      Pack<T, E>* st = stages + s * stage_packs + tid;
      const long long off = row * C;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int u = threadIdx.x + k * blockDim.x;
        if (u < units) {
          cpa16(st + k * nth, x + off + u * E);
          cpa16(st + (VPT + k) * nth, dy + off + u * E);
        }
      }
    }
    cpa_commit();
  };
  // (mean, rstd) of group i's row, or zeros past the end.
  auto stats_of = [&](long long i) {
    const long long row = row_of(i);
    return i < n && row < rows ? make_float2(mean[row], rstd[row]) : make_float2(0.f, 0.f);
  };

  for (int j = 0; j < nstages - 1; ++j) issue(j, j);
  prefetch_row_l1<VPT, E>(gamma, units);
  float2 st_next = stats_of(0);
  int s_use = 0, s_fill = nstages - 1;  // stages of groups i and i + nstages - 1
  for (long long i = 0; i < n; ++i) {
    issue(i + nstages - 1, s_fill);
    s_fill = ring_next(s_fill, nstages);
    const float mu = st_next.x, r = st_next.y;
    st_next = stats_of(i + 1);
    cpa_wait_n(nstages - 1);  // all but the newest nstages - 1 groups are complete: group i landed
    const long long row = row_of(i);
    const bool ok = row < rows;
    const Pack<T, E>* st = stages + s_use * stage_packs + tid;
    s_use = ring_next(s_use, nstages);
    // Per element: 2 unpacks (1 instruction each); sums: xh = x r - mu r (1), g = dy w (1), 2 adds; dx, dgamma,
    // dbeta: xh (1), dx = dy (w r) - (r a + r b xh) (3), 2 accumulations, and half a pack.
    const float mur = mu * r;
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (ok && u < units) {
        float xf[E], df[E], wf[E];
        unpack_f32<T, E>(st[k * nth], xf);
        unpack_f32<T, E>(st[(VPT + k) * nth], df);
        load_f32<E>(gamma + u * E, wf, w_vec);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float g = df[e] * wf[e];
          sg += g;
          sgx = fmaf(g, fmaf(xf[e], r, -mur), sgx);
        }
      }
    }
    seg_sum2(sg, sgx, scratch);
    const float ra = r * sg * inv_c, rb = r * sgx * inv_c;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (ok && u < units) {
        float xf[E], df[E], wf[E], o[E];
        unpack_f32<T, E>(st[k * nth], xf);
        unpack_f32<T, E>(st[(VPT + k) * nth], df);
        load_f32<E>(gamma + u * E, wf, w_vec);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float xh = fmaf(xf[e], r, -mur), d = df[e];
          o[e] = fmaf(d, wf[e] * r, -fmaf(rb, xh, ra));
          acc_g[k][e] = fmaf(d, xh, acc_g[k][e]);
          acc_b[k][e] += d;
        }
        store_pack<T, E>(dx + row * C + u * E, pack_f32<T, E>(o));
      }
    }
  }
  cpa_wait_n(0);

  // Partial rows part[blk] (dgamma) and part[gridDim.x + blk] (dbeta): the row slots summed in threadIdx.y
  // order through the idle stages (2 x E x NTH floats <= one stage); 16-byte stores (C % E == 0 here).
  float* comb = reinterpret_cast<float*>(ln_dyn_smem);
  float* pg = part + (long long)blockIdx.x * C;
  float* pb = part + (long long)(gridDim.x + blockIdx.x) * C;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    __syncthreads();
#pragma unroll
    for (int e = 0; e < E; ++e) {
      comb[e * nth + tid] = acc_g[k][e];
      comb[(E + e) * nth + tid] = acc_b[k][e];
    }
    __syncthreads();
    const int u = threadIdx.x + k * blockDim.x;
    if (threadIdx.y == 0 && u < units) {
      float sgm[E], sbt[E];
#pragma unroll
      for (int e = 0; e < E; ++e) sgm[e] = sbt[e] = 0.f;
      for (int j = 0; j < (int)blockDim.y; ++j)
#pragma unroll
        for (int e = 0; e < E; ++e) {
          sgm[e] += comb[e * nth + j * blockDim.x + threadIdx.x];
          sbt[e] += comb[(E + e) * nth + j * blockDim.x + threadIdx.x];
        }
#pragma unroll
      for (int e = 0; e < E; e += 4) {
        *reinterpret_cast<float4*>(pg + u * E + e) = make_float4(sgm[e], sgm[e + 1], sgm[e + 2], sgm[e + 3]);
        *reinterpret_cast<float4*>(pb + u * E + e) = make_float4(sbt[e], sbt[e + 1], sbt[e + 2], sbt[e + 3]);
      }
    }
  }
}

// common/vec.cuh's write_block_partial for ln_bwd_warp (blockDim = (32, warps), lane owns packs lane + 32 k, E
// elements each, E a multiple of 4): the warps' accumulators are summed in warp order through shared memory `comb`
// (one float per column, 16-byte aligned), then the block writes its partial row with 16-byte stores (C % E == 0
// on that path, so `part` is 16-byte aligned). blockDim.y + 1 barriers, once a kernel. Every thread of the block
// calls it. Deterministic.
// The barrier on entry: ln_bwd_warp calls this twice in a row (dgamma, then dbeta) through the same `comb`, and
// without it warp 0 of the second call overwrote columns the other warps were still copying out for the first
// (session 15: dgamma wrong in 102 of 1024 columns at 8195 rows, once in a whole-suite run; timing-dependent).
template <int VPT, int E>
__device__ __forceinline__ void write_warps_partial(const float (&acc)[VPT][E], float* __restrict__ part, int units,
                                                    float* comb) {
  static_assert(E % 4 == 0, "16-byte path only");
  const int lane = threadIdx.x, warp = threadIdx.y;
  __syncthreads();  // comb's previous readers (the last call's copy loop) are done
  for (int j = 0; j < (int)blockDim.y; ++j) {
    if (warp == j) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int u = lane + 32 * k;
        if (u < units) {
#pragma unroll
          for (int q = 0; q < E; q += 4) {
            float4* c4 = reinterpret_cast<float4*>(comb + u * E + q);
            float4 v = make_float4(acc[k][q], acc[k][q + 1], acc[k][q + 2], acc[k][q + 3]);
            if (j > 0) {
              const float4 o = *c4;
              v.x += o.x;
              v.y += o.y;
              v.z += o.z;
              v.w += o.w;
            }
            *c4 = v;
          }
        }
      }
    }
    __syncthreads();
  }
  const int n = units * E, nth = 32 * blockDim.y;
  for (int i = 4 * (warp * 32 + lane); i < n; i += 4 * nth)
    *reinterpret_cast<float4*>(part + i) = *reinterpret_cast<const float4*>(comb + i);
}

// ln_bwd_warp's gamma row, staged once a block into shared memory as fp32 (C floats): every row reads it twice.
// Read from global memory, each pack's load sat behind its own `u < units` branch right before its use, so a row's
// 2 x VPT loads ran in series, an L1 or L2 round trip each. The staging loads of a thread (up to 8 a pass) are
// issued together: the index is clamped, so none sits behind a branch. Ends with a barrier.
template <typename W> __device__ __forceinline__ void stage_row_f32(const W* __restrict__ w, float* w_s, int C) {
  const int nth = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
  for (int base = tid; base < C; base += 8 * nth) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_f32(w[min(base + j * nth, C - 1)]);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (base + j * nth < C) w_s[base + j * nth] = v[j];
  }
  __syncthreads();
}
// E (a multiple of 4) consecutive fp32 of a 16-byte aligned shared-memory row.
template <int E> __device__ __forceinline__ void load_smem_f32(const float* p, float (&f)[E]) {
#pragma unroll
  for (int q = 0; q < E; q += 4) {
    const float4 v = *reinterpret_cast<const float4*>(p + q);
    f[q] = v.x;
    f[q + 1] = v.y;
    f[q + 2] = v.z;
    f[q + 3] = v.w;
  }
}

// Backward, one warp a row (issue 17, session 14): bf16 rows of 65..128 packs (C 520..1024: GPT-2's 768), where
// ln_bwd_pipe ran at 40 % of copy. A warp holds its row's x and dy packs in registers (lane l: packs l + 32 k),
// reduces mean(g) and mean(g xh) with one butterfly of paired shuffles and meets no barrier until the block's final
// combine. Blocks of 4 warps, 4 rows a warp (ck.settings.layer_norm_warp_rows), up to 4 blocks an SM: 8192 x 768
// bf16 18.2 us (49 % of copy) against ln_bwd_pipe's 22.1 (run E). Measured and not kept (NOTES.md, session 14):
// the same kernel at VPT 2 / 8, for fp32 rows, as a persistent one-wave grid, and rms_norm's twin; at 8192 x 2048
// bf16 it matched the pipelined kernels (~35-39 us) instead of beating them. dgamma and dbeta accumulate in
// registers, one partial row of each per block: part[blk] and part[gridDim.x + blk], as ln_bwd_reg's.
template <typename T, typename W, int VPT>
__device__ __forceinline__ void ln_bwd_warp(const T* __restrict__ dy, const T* __restrict__ x,
                                            const W* __restrict__ gamma, const float* __restrict__ mean,
                                            const float* __restrict__ rstd, T* __restrict__ dx,
                                            float* __restrict__ part, long long rows, int C) {
  constexpr int E = 16 / sizeof(T);
  __shared__ __align__(16) float comb[32 * VPT * E], w_s[32 * VPT * E];
  const int lane = threadIdx.x;
  const int units = C / E;
  // Row r goes to block r % gridDim.x (then warp, then trip): when the grid is capped (more than 4 waves of
  // blocks' rows) the warps loop, and a partial last trip spreads over every block.
  const long long row0 = blockIdx.x + (long long)gridDim.x * threadIdx.y, step = (long long)gridDim.x * blockDim.y;
  // The warp's first row on its way to L2 while the block stages the weight row (common/pdl.cuh: prefetch_l2).
  if (row0 < rows) {
    const long long off = row0 * C;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + 32 * k;
      if (u < units) {
        prefetch_l2(x + off + u * E);
        prefetch_l2(dy + off + u * E);
      }
    }
  }
  stage_row_f32<W>(gamma, w_s, C);  // (above: why)
  const float inv_c = 1.f / (float)C;
  float acc_g[VPT][E], acc_b[VPT][E];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int e = 0; e < E; ++e) acc_g[k][e] = acc_b[k][e] = 0.f;

  for (long long row = row0; row < rows; row += step) {
    const long long off = row * C;
    Pack<T, E> xv[VPT], gv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = lane + 32 * k;
      if (u < units) {
        xv[k] = load_pack<T, E>(x + off + u * E);
        gv[k] = load_pack<T, E>(dy + off + u * E);
      }
    }
    const float mu = mean[row], r = rstd[row];
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = lane + 32 * k;
      if (u < units) {
        float xf[E], df[E], wf[E];
        unpack_f32<T, E>(xv[k], xf);
        unpack_f32<T, E>(gv[k], df);
        load_smem_f32<E>(w_s + u * E, wf);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float g = df[e] * wf[e];
          sg += g;
          sgx = fmaf(g, (xf[e] - mu) * r, sgx);
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sg += __shfl_xor_sync(0xffffffffu, sg, o);
      sgx += __shfl_xor_sync(0xffffffffu, sgx, o);
    }
    const float a = sg * inv_c, b = sgx * inv_c;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = lane + 32 * k;
      if (u < units) {
        float xf[E], df[E], wf[E], o[E];
        unpack_f32<T, E>(xv[k], xf);
        unpack_f32<T, E>(gv[k], df);
        load_smem_f32<E>(w_s + u * E, wf);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float xh = (xf[e] - mu) * r;
          o[e] = r * (df[e] * wf[e] - a - xh * b);
          acc_g[k][e] = fmaf(df[e], xh, acc_g[k][e]);
          acc_b[k][e] += df[e];
        }
        store_pack<T, E>(dx + off + u * E, pack_f32<T, E>(o));
      }
    }
  }
  write_warps_partial<VPT, E>(acc_g, part + (long long)blockIdx.x * C, units, comb);
  write_warps_partial<VPT, E>(acc_b, part + (long long)(gridDim.x + blockIdx.x) * C, units, comb);
}

// Long rows (the register plan does not fit): two kernels, no read-modify-write of partials.
// 1) ln_bwd_rowsums: a block per row (block-stride) reduces a = mean(g), b = mean(g * x_hat), g = dy * gamma,
//    into `sums` (two floats per row). Reads dy and x once.
// 2) ln_bwd_cols: grid (column chunks of 256 packs, row groups); a thread owns one pack of columns and walks the
//    rows of its group: dx from the row's mean, rstd, a, b; dgamma / dbeta accumulate in registers and go to
//    the group's partial rows (2 * groups x C, fully overwritten; ln_finalize sums them in order).
//    Reads dy and x again (from HBM: a 64 KB row does not stay in L2 between the kernels at 2048 rows), so the
//    long-row backward moves 5 * N * C * s instead of 3: still ~5x faster than the earlier single kernel that
//    updated global partial rows per row (0.17x PyTorch at 2048 x 32768 bf16, NOTES.md).
template <typename T, typename W, bool VEC>
__device__ __forceinline__ void ln_bwd_rowsums(const T* __restrict__ dy, const T* __restrict__ x,
                                               const W* __restrict__ gamma, const float* __restrict__ mean,
                                               const float* __restrict__ rstd, float2* __restrict__ sums,
                                               long long rows, int C, bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float2 scratch[16 * 32];
  const int units = C / E;
  const float inv_c = 1.f / (float)C;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const long long off = row * C;
    const float mu = mean[row], r = rstd[row];
    float sg = 0.f, sgx = 0.f;
#pragma unroll 4
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const Pack<T, E> xv = load_pack<T, E>(x + off + u * E), gv = load_pack<T, E>(dy + off + u * E);
      float wf[E];
      load_f32<E>(gamma + u * E, wf, w_vec);
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const float g = to_f32(gv.v[i]) * wf[i];
        sg += g;
        sgx += g * ((to_f32(xv.v[i]) - mu) * r);
      }
    }
    seg_sum2(sg, sgx, scratch);
    if (threadIdx.x == 0) sums[row] = make_float2(sg * inv_c, sgx * inv_c);
  }
}

template <typename T, typename W, bool VEC>
__device__ __forceinline__ void ln_bwd_cols(const T* __restrict__ dy, const T* __restrict__ x,
                                            const W* __restrict__ gamma, const float* __restrict__ mean,
                                            const float* __restrict__ rstd, const float2* __restrict__ sums,
                                            T* __restrict__ dx, float* __restrict__ part, long long rows, int C,
                                            int rows_per_group, bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  const int units = C / E;
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  const long long r0 = (long long)blockIdx.y * rows_per_group;
  const long long r1 = r0 + rows_per_group < rows ? r0 + rows_per_group : rows;
  if (u >= units) return;  // no barriers below: idle threads may leave
  float wf[E], ag[E], ab[E];
  load_f32<E>(gamma + u * E, wf, w_vec);
#pragma unroll
  for (int i = 0; i < E; ++i) ag[i] = ab[i] = 0.f;
#pragma unroll 4
  for (long long row = r0; row < r1; ++row) {
    const long long off = row * C + (long long)u * E;
    const Pack<T, E> xv = load_pack<T, E>(x + off), gv = load_pack<T, E>(dy + off);
    const float mu = mean[row], r = rstd[row];
    const float2 s = sums[row];
    Pack<T, E> o;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const float xh = (to_f32(xv.v[i]) - mu) * r, d = to_f32(gv.v[i]);
      o.v[i] = from_f32<T>(r * (d * wf[i] - s.x - xh * s.y));
      ag[i] += d * xh;
      ab[i] += d;
    }
    store_pack<T, E>(dx + off, o);
  }
  float* pg = part + (long long)blockIdx.y * C + (long long)u * E;
  float* pb = part + (long long)(gridDim.y + blockIdx.y) * C + (long long)u * E;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    pg[i] = ag[i];
    pb[i] = ab[i];
  }
}

// dgamma[c] = sum_p part[p, c] (blockIdx.y == 0), dbeta[c] = sum_p part[nparts + p, c] (blockIdx.y == 1), p
// in order (common/vec.cuh: column_sums).
template <typename W>
__device__ __forceinline__ void ln_finalize(const float* __restrict__ part, W* __restrict__ dgamma,
                                            W* __restrict__ dbeta, int nparts, int C) {
  column_sums<W>(part + (long long)blockIdx.y * nparts * C, blockIdx.y == 0 ? dgamma : dbeta, nparts, C);
}

// ---- extern "C" entry points, one per instantiation (CuPy's disk cache keeps these; name_expressions are
// reported not to be kept, cupy/cupy#9667). Names: ln_<fwd|bwd>_<x dtype>_<param dtype>_<VPT><v|s>.
// Forward blocks go up to 1024 threads (64 registers: the row is VPT x 4 registers of packs); backward up to
// 512 (128 registers: packs of x and dy plus the two accumulators).
#define LN_FWD(T, W, TN, WN, VPT, VEC, VS)                                                                      \
  CK_ENTRY(__launch_bounds__(1024),                                                                            \
      ln_fwd_##TN##_##WN##_##VPT##VS)(const T* x, const W* gamma, const W* beta, T* y, float* mean, float* rstd, \
                                     long long rows, int C, float eps, bool w_vec) {                           \
    ln_fwd_reg<T, W, VPT, VEC>(x, gamma, beta, y, mean, rstd, rows, C, eps, w_vec);                            \
  }
#define LN_BWD(T, W, TN, WN, VPT, VEC, VS)                                                                      \
  CK_ENTRY(__launch_bounds__(512),                                                                             \
      ln_bwd_##TN##_##WN##_##VPT##VS)(const T* dy, const T* x, const W* gamma, const float* mean,               \
                                     const float* rstd, T* dx, float* part, long long rows, int C,            \
                                     bool w_vec) {                                                             \
    ln_bwd_reg<T, W, VPT, VEC>(dy, x, gamma, mean, rstd, dx, part, rows, C, w_vec);                            \
  }
#define LN_LOOP(T, W, TN, WN, VEC, VS)                                                                          \
  CK_ENTRY(__launch_bounds__(1024),                                                                            \
      ln_fwd_loop_##TN##_##WN##_##VS)(const T* x, const W* gamma, const W* beta, T* y, float* mean,             \
                                     float* rstd, long long rows, int C, float eps, bool w_vec) {              \
    ln_fwd_loop<T, W, VEC>(x, gamma, beta, y, mean, rstd, rows, C, eps, w_vec);                                \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(512),                                                                             \
      ln_bwd_rowsums_##TN##_##WN##_##VS)(const T* dy, const T* x, const W* gamma, const float* mean,            \
                                        const float* rstd, float2* sums, long long rows, int C, bool w_vec) {  \
    ln_bwd_rowsums<T, W, VEC>(dy, x, gamma, mean, rstd, sums, rows, C, w_vec);                                 \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(256),                                                                             \
      ln_bwd_cols_##TN##_##WN##_##VS)(const T* dy, const T* x, const W* gamma, const float* mean,               \
                                     const float* rstd, const float2* sums, T* dx, float* part, long long rows, \
                                     int C, int rows_per_group, bool w_vec) {                                  \
    ln_bwd_cols<T, W, VEC>(dy, x, gamma, mean, rstd, sums, dx, part, rows, C, rows_per_group, w_vec);          \
  }
// VPT 8 only on the element path (forward: the launcher reaches VPT 8 only at 1024 threads per row, where
// vector packs stop at 4; backward: E = 1 keeps 16 accumulators); vector packs stop at VPT 4 forward and 2
// backward (at 4, x, dy and the two accumulators spilled past 128 registers).
#define LN_ALL_VEC(T, W, TN, WN)                                                                                \
  LN_FWD(T, W, TN, WN, 1, true, v) LN_FWD(T, W, TN, WN, 2, true, v) LN_FWD(T, W, TN, WN, 4, true, v)            \
  LN_BWD(T, W, TN, WN, 1, true, v) LN_BWD(T, W, TN, WN, 2, true, v)                                            \
  LN_LOOP(T, W, TN, WN, true, v)
#define LN_ALL_SCALAR(T, W, TN, WN)                                                                             \
  LN_FWD(T, W, TN, WN, 1, false, s) LN_FWD(T, W, TN, WN, 2, false, s) LN_FWD(T, W, TN, WN, 4, false, s)         \
  LN_FWD(T, W, TN, WN, 8, false, s)                                                                            \
  LN_BWD(T, W, TN, WN, 1, false, s) LN_BWD(T, W, TN, WN, 2, false, s) LN_BWD(T, W, TN, WN, 4, false, s)         \
  LN_BWD(T, W, TN, WN, 8, false, s)                                                                            \
  LN_LOOP(T, W, TN, WN, false, s)
// Pipelined backward (16-byte path, VPT 1 and 2: the plan's vector cap): blocks of 512 threads (one per SM) or
// 256 (three per SM: __launch_bounds__ caps them at 85 registers, no spills; compiled for two per SM, 101
// registers, they ran 8-10 % slower at 8192 x 2048 bf16, NOTES.md session 8); names
// ln_bwdp_<x>_<param>_<VPT>_<threads>x<blocks per SM>.
#define LN_PIPE(T, W, TN, WN, VPT, NTH, MINB)                                                                   \
  CK_ENTRY(__launch_bounds__(NTH, MINB),                                                                       \
      ln_bwdp_##TN##_##WN##_##VPT##_##NTH##x##MINB)(const T* dy, const T* x, const W* gamma, const float* mean, \
                                                   const float* rstd, T* dx, float* part, long long rows,     \
                                                   int C, int nstages, bool w_vec) {                          \
    ln_bwd_pipe<T, W, VPT>(dy, x, gamma, mean, rstd, dx, part, rows, C, nstages, w_vec);                       \
  }
// One warp a row (bf16 x, VPT 4): blocks of 4 warps, 4 an SM (<= 128 registers: x and dy packs and 64
// accumulators, no spills); ops/layer_norm.py's WARP_WARPS mirrors the 128 (tests/test_layer_norm.py checks).
#define LN_WARP(T, W, TN, WN, VPT, NTH, MINB)                                                                  \
  CK_ENTRY(__launch_bounds__(NTH, MINB),                                                                       \
      ln_bwdw_##TN##_##WN##_##VPT)(const T* dy, const T* x, const W* gamma, const float* mean, const float* rstd, \
                                  T* dx, float* part, long long rows, int C) {                                 \
    ln_bwd_warp<T, W, VPT>(dy, x, gamma, mean, rstd, dx, part, rows, C);                                       \
  }
#define LN_ALL(T, W, TN, WN) LN_ALL_VEC(T, W, TN, WN) LN_ALL_SCALAR(T, W, TN, WN) \
  LN_PIPE(T, W, TN, WN, 1, 512, 1) LN_PIPE(T, W, TN, WN, 2, 512, 1)                                             \
  LN_PIPE(T, W, TN, WN, 1, 256, 3) LN_PIPE(T, W, TN, WN, 2, 256, 3)

LN_ALL(float, float, f32, f32)
LN_ALL(float, bf16, f32, bf16)
LN_ALL(bf16, float, bf16, f32)
LN_ALL(bf16, bf16, bf16, bf16)
LN_WARP(bf16, float, bf16, f32, 4, 128, 4)
LN_WARP(bf16, bf16, bf16, bf16, 4, 128, 4)

CK_ENTRY(__launch_bounds__(512), ln_finalize_f32)(const float* part, float* dgamma, float* dbeta,
                                                  int nparts, int C) {
  ln_finalize<float>(part, dgamma, dbeta, nparts, C);
}
CK_ENTRY(__launch_bounds__(512), ln_finalize_bf16)(const float* part, bf16* dgamma, bf16* dbeta,
                                                   int nparts, int C) {
  ln_finalize<bf16>(part, dgamma, dbeta, nparts, C);
}
