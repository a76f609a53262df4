// RMSNorm over the last axis: rows of C elements.
//
//   forward   r = 1 / sqrt(mean(x^2) + eps)          (one fp32 per row, saved for backward)
//             y = x * r * w
//   backward  g = dy * w
//             dx = r * (g - x * r^2 * mean(g * x))   (+ dh: add_rms_norm, below)
//             dw = sum over rows of dy * x * r
//
//   add_rms_norm (issue 17): h = x + res (fp32 sum, rounded once to T), y = rmsnorm(h); writes h and y in one
//   pass (reads x, res: 4 * C * s per row instead of the two-launch 6 * C * s). Its backward is the backward
//   above on h with the residual stream's gradient dh added into dx in the same pass ("add" kernels).
//
// Design (numbers for 8192 x 2048 on an H200, copy ceiling ~4.2 TB/s):
// - "reg" kernels keep the row in registers between the reduction and the write, so x (and dy) are read
//   exactly once: forward moves 2 * C * sizeof(T) per row, backward 3 * C * sizeof(T). A row is split over
//   TPR threads with VPT packs of 16 bytes each; the launcher aims at 2 packs per thread (measured best of
//   1/2/4/8 on the H200: benchmarks/tune_rms_norm.py), TPR <= 512 forward / 256 backward, VPT <= 8. Rows
//   of fewer than 256 threads share a block (TPR x RPB = 256).
// - Backward holds x, dy and the dw accumulator (VPT x 16 floats) live at once, so its blocks are capped at
//   256 threads (__launch_bounds__(256)). No kernel spills (tests/test_compile.py checks ptxas).
//   On the 16-byte path with VPT <= 4 the launcher takes rms_bwd_pipe instead (cp.async double buffering,
//   packs re-read from shared memory, 512-thread blocks for VPT <= 2): see the comment above that kernel.
// - VEC=true: 16-byte loads/stores, needs C % (16 / sizeof(T)) == 0 and 16-byte aligned pointers (the
//   launcher checks); VEC=false: element accesses, any C, any alignment (misaligned views).
// - Rows too long for registers (forward: fp32 C > 16384, bf16 C > 32768, unaligned C > 4096; backward:
//   fp32 C > 8192, bf16 C > 16384, unaligned C > 2048): the forward "loop" kernel makes two passes over the
//   row, the second mostly from L2 (a 256 KB row x 2 blocks x 132 SMs fits in the 60 MB L2); the backward
//   splits into per-row sums and column-chunk blocks (below).
// - dw is deterministic: each block accumulates its rows' dy * x * r in registers (the thread owns the same
//   columns for every row it visits), writes one fp32 partial row per block, and rms_dw_finalize sums the
//   partials in a fixed order. The launcher sizes the grid to one wave, ~2 blocks/SM x 132 SMs, so the
//   partials (264 x C x 4 B written and read) are ~2 % of the backward traffic at 8192 x 2048. (Summing them in
//   the same kernel through sm_90 clusters was measured slower than this finalize launch: NOTES.md, session 8.)
// - amax (every backward that writes dx: a trailing nullable `unsigned* amax`): max |dx| of dx as stored (rounded
//   to T), the bits that ck.fp8_amax(dx) would give, maxed per thread as it stores, reduced once a block at the end
//   (block_amax_2d below, one atomicMax a block) into the 32-bit word the caller zeroed. Why: an FP8 linear whose
//   gradients are current-scaled needs max |dy| before it casts dy; a separate fp8_amax pass re-reads it (48
//   launches, 0.55 ms a step at the LLaMA-1B shape, 32 of them over the dx this kernel writes in add_rms_norm's
//   backward, rms_addbwdp at that shape). The max sits under a branch on the pointer (a kernel argument: uniform
//   across the grid), so a launch with amax null pays a compare and a uniform branch a pack, not the max (two
//   integer instructions an element). One argument rather than separate _amax entries: the family's 186 entries
//   stay 186 (compile time, wheel bytes), and ptxas (sm_80, sm_90) fits it in every entry's existing bounds with no
//   spill -- the 1B shape's rms_addbwdp_bf16_bf16_2 and rms_bwdp_bf16_bf16_2 stay at their 64-register cap.
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/fp8.cuh"

#include "common/pipe.cuh"

// max(m, |v|) over the elements of a stored pack, |v| as ordered bits (common/fp8.cuh's abs_bits: the fp32 bits
// of v with the sign cleared; NaN orders above inf, so a NaN in dx makes the amax NaN, as in ck.fp8_amax). bf16
// pairs are read as 32-bit words (two instructions an element; the low element is the word shifted left 16).
template <typename T, int E>
__device__ __forceinline__ unsigned pack_amax(const Pack<T, E>& p, unsigned m) {
  if constexpr (sizeof(T) == 2 && E % 2 == 0) {
    const unsigned* w = reinterpret_cast<const unsigned*>(&p);
#pragma unroll
    for (int i = 0; i < E / 2; ++i) m = max(m, max((w[i] << 16) & 0x7fffffffu, w[i] & 0x7fff0000u));
  } else {
#pragma unroll
    for (int i = 0; i < E; ++i) m = max(m, abs_bits(p.v[i]));
  }
  return m;
}

// Block max of m into *out: common/fp8.cuh's block_amax for the 2-D blocks here (threads per row x row slots:
// it numbers warps by threadIdx.x alone). Warps by the linear thread id; every thread of the block calls it (the
// block's thread count is a multiple of 32: every launch here has threads per row a multiple of 32, or 256).
// One atomicMax a block on the word (max is order-independent: the same bits every run); a zero max skips it.
__device__ __forceinline__ void block_amax_2d(unsigned m, unsigned* out) {
  __shared__ unsigned s[32];
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nwarps = (blockDim.x * blockDim.y + 31) >> 5;
  m = __reduce_max_sync(0xffffffffu, m);
  if ((tid & 31) == 0) s[tid >> 5] = m;
  __syncthreads();
  if (tid < 32) {
    m = __reduce_max_sync(0xffffffffu, tid < nwarps ? s[tid] : 0u);
    if (tid == 0 && m) atomicMax(out, m);
  }
}

// Loads this thread's packs of row `row` (nothing when the row is past the end).
template <typename T, int E, int VPT>
__device__ __forceinline__ void load_row(Pack<T, E> (&v)[VPT], const T* __restrict__ p, long long row,
                                         long long rows, int C, int units) {
  if (row >= rows) return;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int u = threadIdx.x + k * blockDim.x;
    if (u < units) v[k] = load_pack<T, E>(p + row * C + u * E);
  }
}

// The block walks row groups base, base + stride, ... (forward: one group per block, the hardware schedules
// the blocks; backward: a persistent one-wave grid). The loop bound is the same for every thread of the block
// (row_sum synchronises the block when a row spans several warps); threads whose row is past the end compute
// on garbage and store nothing. (A one-group prefetch was tried: 5-10 % slower, NOTES.md.)
// ADD (add_rms_norm): the normalised row is h = x + res, summed in fp32 and rounded once to T; h is stored
// and the rounded h is what gets normalised, so the backward (which reads h) sees exactly the forward's input.
template <typename T, typename W, int VPT, bool VEC, bool ADD>
__device__ __forceinline__ void rms_fwd_reg(const T* __restrict__ x, const T* __restrict__ res,
                                            const W* __restrict__ w, T* __restrict__ y, T* __restrict__ h,
                                            float* __restrict__ rstd, long long rows, int C, float eps, bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[32 * 32];
  const int units = C / E;
  const long long stride = (long long)gridDim.x * blockDim.y;
  Pack<T, E> xv[VPT];
  for (long long base = (long long)blockIdx.x * blockDim.y; base < rows; base += stride) {
    const long long row = base + threadIdx.y;
    load_row<T, E, VPT>(xv, x, row, rows, C, units);
    if constexpr (ADD) {
      Pack<T, E> rv[VPT];
      load_row<T, E, VPT>(rv, res, row, rows, C, units);
#pragma unroll
      for (int k = 0; k < VPT; ++k)
#pragma unroll
        for (int i = 0; i < E; ++i) xv[k].v[i] = from_f32<T>(to_f32(xv[k].v[i]) + to_f32(rv[k].v[i]));
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      if (threadIdx.x + k * blockDim.x < units) {
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const float f = to_f32(xv[k].v[i]);
          ss += f * f;
        }
      }
    }
    ss = row_sum(ss, scratch);
    const float r = rsqrtf(ss / (float)C + eps);
    if (row < rows) {
      if (rstd != nullptr && threadIdx.x == 0) rstd[row] = r;
      T* yr = y + row * C;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int u = threadIdx.x + k * blockDim.x;
        if (u < units) {
          float wf[E];
          load_f32<E>(w + u * E, wf, w_vec);
          Pack<T, E> o;
#pragma unroll
          for (int i = 0; i < E; ++i) o.v[i] = from_f32<T>(to_f32(xv[k].v[i]) * r * wf[i]);
          store_pack<T, E>(yr + u * E, o);
          if constexpr (ADD) store_pack<T, E>(h + row * C + u * E, xv[k]);
        }
      }
    }
  }
}

// ADD: pass 1 reads x and res, stores h and sums h^2; pass 2 re-reads h through the (non-restrict) output
// pointer: the same thread wrote those packs in pass 1, so program order makes them visible (mostly from L2).
template <typename T, typename W, bool VEC, bool ADD>
__device__ __forceinline__ void rms_fwd_loop(const T* __restrict__ x, const T* __restrict__ res,
                                             const W* __restrict__ w, T* __restrict__ y, T* h,
                                             float* __restrict__ rstd, long long rows, int C, float eps, bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[32];
  const int units = C / E;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = ADD ? h + row * C : x + row * C;
    float ss = 0.f;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      Pack<T, E> v = load_pack<T, E>(x + row * C + u * E);
      if constexpr (ADD) {
        const Pack<T, E> rv = load_pack<T, E>(res + row * C + u * E);
#pragma unroll
        for (int i = 0; i < E; ++i) v.v[i] = from_f32<T>(to_f32(v.v[i]) + to_f32(rv.v[i]));
        store_pack<T, E>(h + row * C + u * E, v);
      }
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const float f = to_f32(v.v[i]);
        ss += f * f;
      }
    }
    ss = row_sum(ss, scratch);
    const float r = rsqrtf(ss / (float)C + eps);
    if (rstd != nullptr && threadIdx.x == 0) rstd[row] = r;
    T* yr = y + row * C;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const Pack<T, E> v = load_pack<T, E>(xr + u * E);
      float wf[E];
      load_f32<E>(w + u * E, wf, w_vec);
      Pack<T, E> o;
#pragma unroll
      for (int i = 0; i < E; ++i) o.v[i] = from_f32<T>(to_f32(v.v[i]) * r * wf[i]);
      store_pack<T, E>(yr + u * E, o);
    }
  }
}

// dw_part: one fp32 row of C per block (gridDim.x rows), fully overwritten. Same block-uniform loop as the
// forward, over a persistent grid.
// ADD: dh (the gradient reaching x from the residual stream, add_rms_norm) is loaded with x and dy and added
// into dx before the one rounding. amax: nullable, max |dx| (the header's amax paragraph).
template <typename T, typename W, int VPT, bool VEC, bool ADD>
__device__ __forceinline__ void rms_bwd_reg(const T* __restrict__ dy, const T* __restrict__ x,
                                            const W* __restrict__ w, const float* __restrict__ rstd,
                                            const T* __restrict__ dh, T* __restrict__ dx,
                                            float* __restrict__ dw_part, long long rows, int C, bool w_vec,
                                            unsigned* __restrict__ amax) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[32 * 32];
  __shared__ float combine[256 * 8];  // write_block_partial: TPR * RPB <= 256 threads, E <= 8 floats each
  const int units = C / E;
  float acc[VPT][E];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int i = 0; i < E; ++i) acc[k][i] = 0.f;
  unsigned m = 0;

  const long long stride = (long long)gridDim.x * blockDim.y;
  Pack<T, E> xv[VPT], gv[VPT];
  for (long long base = (long long)blockIdx.x * blockDim.y; base < rows; base += stride) {
    const long long row = base + threadIdx.y;
    const bool active = row < rows;
    load_row<T, E, VPT>(xv, x, row, rows, C, units);
    load_row<T, E, VPT>(gv, dy, row, rows, C, units);
    Pack<T, E> hv[ADD ? VPT : 1];
    if constexpr (ADD) {
      // Zeroed first: left uninitialised for rows past the end, ptxas kept a 16-byte stack frame (bf16 x, fp32 w).
#pragma unroll
      for (int k = 0; k < VPT; ++k)
#pragma unroll
        for (int i = 0; i < E; ++i) hv[k].v[i] = from_f32<T>(0.f);
      load_row<T, E, VPT>(hv, dh, row, rows, C, units);
    }
    const float r = active ? rstd[row] : 0.f;
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (active && u < units) {
        float wf[E];
        load_f32<E>(w + u * E, wf, w_vec);
#pragma unroll
        for (int i = 0; i < E; ++i) dot += to_f32(gv[k].v[i]) * wf[i] * to_f32(xv[k].v[i]);
      }
    }
    dot = row_sum(dot, scratch);
    const float c = dot * r * r / (float)C;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (active && u < units) {
        float wf[E];
        load_f32<E>(w + u * E, wf, w_vec);
        Pack<T, E> o;
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const float xf = to_f32(xv[k].v[i]), gf = to_f32(gv[k].v[i]);
          float d = r * (gf * wf[i] - xf * c);
          if constexpr (ADD) d += to_f32(hv[ADD ? k : 0].v[i]);
          o.v[i] = from_f32<T>(d);
          acc[k][i] += gf * xf * r;
        }
        if (amax != nullptr) m = pack_amax<T, E>(o, m);
        store_pack<T, E>(dx + row * C + u * E, o);
      }
    }
  }

  write_block_partial<VPT, E>(acc, dw_part + (long long)blockIdx.x * C, units, combine);
  if (amax != nullptr) block_amax_2d(m, amax);
}

// Backward, 16-byte path (issue 17): the same math as rms_bwd_reg, fed by a two-stage cp.async pipeline.
// Why: rms_bwd_reg holds x and dy in registers across the row reduction, so a block cannot start the loads of
// its next row group before the current one is written; the blocks of its one-wave grid alternate between
// waiting on DRAM and computing, in step, and at 79 registers (bf16, VPT 2) only 3 blocks of 256 threads fit
// an SM: 2.58 TB/s, 61 % of copy, at 8192 x 2048 bf16 (NOTES.md run 6).
// Here each thread copies its own packs of x, dy (and dh) for row group i + 1 into shared memory with cp.async
// while it computes group i, so every block always has a group in flight (32 KB for VPT 2 at 512 threads: 2
// blocks per SM keep ~64 KB per SM in flight, > the ~25 KB that 4.2 TB/s x ~0.8 us latency asks per SM).
// The packs are read back from shared memory twice (dot pass, output pass) instead of being held in
// registers. A thread reads back only the packs it copied itself, so a stage needs no barrier
// (cp.async.wait_group orders the thread's own copies before its reads), and the stage is refilled by the
// thread's copy for group i + 2 only after it has consumed group i (program order).
// Stage layout: [tensor][k][thread] 16-byte packs (consecutive threads, consecutive 16 bytes: no bank
// conflicts). blockDim = (TPR, row slots), NTH = TPR x slots threads; persistent grid, one partial dw row per
// block, the row slots combined in fixed order at the end (deterministic). `nstages` (2..4, a kernel argument)
// row groups are in flight a block; group i uses stage i mod nstages. The row's rstd is loaded one group ahead
// (session 8: loaded after the wait it cost one exposed global round trip a group) and the weight row is
// prefetched into L1 before the first wait.
template <typename T, typename W, int VPT, bool ADD>
__device__ __forceinline__ void rms_bwd_pipe(const T* __restrict__ dy, const T* __restrict__ x,
                                             const W* __restrict__ w, const float* __restrict__ rstd,
                                             const T* __restrict__ dh, T* __restrict__ dx,
                                             float* __restrict__ dw_part, long long rows, int C, int nstages,
                                             bool w_vec, unsigned* __restrict__ amax) {
  constexpr int E = 16 / sizeof(T);
  constexpr int NT = ADD ? 3 : 2;  // tensors staged: x, dy (, dh)
  extern __shared__ __align__(16) unsigned char rms_dyn_smem[];
  __shared__ float scratch[32 * 32];
  Pack<T, E>* const stages = reinterpret_cast<Pack<T, E>*>(rms_dyn_smem);
  const int nth = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int units = C / E;
  const int stage_packs = NT * VPT * nth;
  const float inv_c = 1.f / (float)C;
  const long long groups = (rows + blockDim.y - 1) / blockDim.y;
  // Row groups of this block: blockIdx.x + i * gridDim.x, i < n (block-uniform: every thread meets every barrier).
  const long long n = (long long)blockIdx.x < groups ? (groups - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  float acc[VPT][E];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int i = 0; i < E; ++i) acc[k][i] = 0.f;
  unsigned m = 0;  // max |dx| bits (amax != nullptr)

  const long long row0 = (long long)blockIdx.x * blockDim.y + threadIdx.y, row_step = (long long)gridDim.x * blockDim.y;
  auto row_of = [&](long long i) { return row0 + i * row_step; };
  // Copies this thread's packs of group i into stage `s` (nothing for a row past the end) and commits one
  // cp.async group either way (wait_group counts groups).
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
          if constexpr (ADD) cpa16(st + (2 * VPT + k) * nth, dh + off + u * E);
        }
      }
    }
    cpa_commit();
  };
  auto rstd_of = [&](long long i) { const long long row = row_of(i); return i < n && row < rows ? rstd[row] : 0.f; };

  for (int j = 0; j < nstages - 1; ++j) issue(j, j);
  prefetch_row_l1<VPT, E>(w, units);
  float r_next = rstd_of(0);
  int s_use = 0, s_fill = nstages - 1;  // stages of groups i and i + nstages - 1
  for (long long i = 0; i < n; ++i) {
    issue(i + nstages - 1, s_fill);
    s_fill = ring_next(s_fill, nstages);
    const float r = r_next;
    r_next = rstd_of(i + 1);
    cpa_wait_n(nstages - 1);  // all but the newest nstages - 1 groups are complete: group i has landed
    const long long row = row_of(i);
    const bool active = row < rows;
    const Pack<T, E>* st = stages + s_use * stage_packs + tid;
    s_use = ring_next(s_use, nstages);
    // Per element: 2 unpacks (1 instruction each), then dot: 2; dx and dw: 5, with xr = x * r, dx = g * (w * r) -
    // xr * c', dw += g * xr (c' = r^2 * mean(g w x)), and half a pack.
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (active && u < units) {
        float xf[E], gf[E], wf[E];
        unpack_f32<T, E>(st[k * nth], xf);
        unpack_f32<T, E>(st[(VPT + k) * nth], gf);
        load_f32<E>(w + u * E, wf, w_vec);
#pragma unroll
        for (int e = 0; e < E; ++e) dot = fmaf(gf[e] * wf[e], xf[e], dot);
      }
    }
    dot = row_sum(dot, scratch);
    const float c = dot * r * r * inv_c;  // dx = r (g w - x c) = g (w r) - (x r) c
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (active && u < units) {
        float xf[E], gf[E], wf[E], d[E];
        unpack_f32<T, E>(st[k * nth], xf);
        unpack_f32<T, E>(st[(VPT + k) * nth], gf);
        load_f32<E>(w + u * E, wf, w_vec);
        if constexpr (ADD) unpack_f32<T, E>(st[(2 * VPT + k) * nth], d);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float xr = xf[e] * r;
          const float v = fmaf(gf[e], wf[e] * r, -xr * c);
          d[e] = ADD ? d[e] + v : v;
          acc[k][e] = fmaf(gf[e], xr, acc[k][e]);
        }
        const Pack<T, E> o = pack_f32<T, E>(d);
        if (amax != nullptr) m = pack_amax<T, E>(o, m);
        store_pack<T, E>(dx + row * C + u * E, o);
      }
    }
  }
  cpa_wait_n(0);

  // The block's partial dw row: the row slots (threadIdx.y) summed in order through the now idle stages
  // (E x NTH floats <= one stage). 16-byte stores: C % E == 0 on this path, so every offset is 16-byte aligned.
  float* comb = reinterpret_cast<float*>(rms_dyn_smem);
  float* part = dw_part + (long long)blockIdx.x * C;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    __syncthreads();
#pragma unroll
    for (int e = 0; e < E; ++e) comb[e * nth + tid] = acc[k][e];
    __syncthreads();
    const int u = threadIdx.x + k * blockDim.x;
    if (threadIdx.y == 0 && u < units) {
      float sum[E];
#pragma unroll
      for (int e = 0; e < E; ++e) sum[e] = 0.f;
      for (int j = 0; j < (int)blockDim.y; ++j)
#pragma unroll
        for (int e = 0; e < E; ++e) sum[e] += comb[e * nth + j * blockDim.x + threadIdx.x];
#pragma unroll
      for (int e = 0; e < E; e += 4)
        *reinterpret_cast<float4*>(part + u * E + e) = make_float4(sum[e], sum[e + 1], sum[e + 2], sum[e + 3]);
    }
  }
  if (amax != nullptr) block_amax_2d(m, amax);
}

// Long rows (the register plan does not fit): two kernels, no read-modify-write of partials (the layout of
// layer_norm.cu's long-row backward).
// 1) rms_bwd_rowsums: a block per row (block-stride): c = r^2 * mean(dy * w * x) into `coef` (one float per row).
// 2) rms_bwd_cols: grid (column chunks of 256 packs, row groups); a thread owns one pack of columns and walks
//    the rows of its group: dx = r * (dy * w - x * c); dw accumulates in registers and goes to the group's
//    partial row (groups x C, fully overwritten; rms_dw_finalize sums them in order). 5 * N * C * s bytes.
template <typename T, typename W, bool VEC>
__device__ __forceinline__ void rms_bwd_rowsums(const T* __restrict__ dy, const T* __restrict__ x,
                                                const W* __restrict__ w, const float* __restrict__ rstd,
                                                float* __restrict__ coef, long long rows, int C, bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[32];
  const int units = C / E;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const long long off = row * C;
    float dot = 0.f;
#pragma unroll 4
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const Pack<T, E> xv = load_pack<T, E>(x + off + u * E), gv = load_pack<T, E>(dy + off + u * E);
      float wf[E];
      load_f32<E>(w + u * E, wf, w_vec);
#pragma unroll
      for (int i = 0; i < E; ++i) dot += to_f32(gv.v[i]) * wf[i] * to_f32(xv.v[i]);
    }
    dot = row_sum(dot, scratch);
    const float r = rstd[row];
    if (threadIdx.x == 0) coef[row] = dot * r * r / (float)C;
  }
}

template <typename T, typename W, bool VEC>
__device__ __forceinline__ unsigned rms_bwd_cols(const T* __restrict__ dy, const T* __restrict__ x,
                                                 const W* __restrict__ w, const float* __restrict__ rstd,
                                                 const float* __restrict__ coef, const T* __restrict__ dh,
                                                 T* __restrict__ dx, float* __restrict__ dw_part, long long rows,
                                                 int C, int rows_per_group, bool w_vec, bool want_amax) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  const int units = C / E;
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  const long long r0 = (long long)blockIdx.y * rows_per_group;
  const long long r1 = r0 + rows_per_group < rows ? r0 + rows_per_group : rows;
  unsigned m = 0;  // max |dx| bits (want_amax), returned for the entry's block reduction
  if (u >= units) return m;  // no barriers in here: idle threads leave (the amax reduction is the caller's)
  float wf[E], acc[E];
  load_f32<E>(w + u * E, wf, w_vec);
#pragma unroll
  for (int i = 0; i < E; ++i) acc[i] = 0.f;
#pragma unroll 4
  for (long long row = r0; row < r1; ++row) {
    const long long off = row * C + (long long)u * E;
    const Pack<T, E> xv = load_pack<T, E>(x + off), gv = load_pack<T, E>(dy + off);
    Pack<T, E> hv;
    if (dh != nullptr) hv = load_pack<T, E>(dh + off);  // block-uniform branch: dh is a kernel argument
    const float r = rstd[row], c = coef[row];
    Pack<T, E> o;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const float xf = to_f32(xv.v[i]), gf = to_f32(gv.v[i]);
      float d = r * (gf * wf[i] - xf * c);
      if (dh != nullptr) d += to_f32(hv.v[i]);
      o.v[i] = from_f32<T>(d);
      acc[i] += gf * xf * r;
    }
    if (want_amax) m = pack_amax<T, E>(o, m);
    store_pack<T, E>(dx + off, o);
  }
  float* part = dw_part + (long long)blockIdx.y * C + (long long)u * E;
#pragma unroll
  for (int i = 0; i < E; ++i) part[i] = acc[i];
  return m;
}

// dw[c] = sum_p part[p, c] in a fixed order. Block (32, 32), grid ceil(C / 32): a warp reads 32 consecutive
// columns (128 B) of one partial row; warp j takes the partial rows j, j + 32, ... with up to 8 loads issued
// before the first add (264 partials at 8192 x 2048: 8 or 9 per thread, one L2 round trip instead of the 4-5
// of common/vec.cuh's (32, 16) x 4-deep column_sums: the finalize is ~2 us of a ~28 us backward), then a
// fixed binary tree over the 32 warps in shared memory. Deterministic.
template <typename W>
__device__ __forceinline__ void rms_dw_finalize(const float* __restrict__ part, W* __restrict__ dw, int nparts,
                                                int C) {
  __shared__ float s[32][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (c < C) {
    int p = threadIdx.y;
    for (; p + 7 * 32 < nparts; p += 8 * 32) {
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = part[(long long)(p + j * 32) * C + c];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc += v[j];
    }
    for (; p < nparts; p += 32) acc += part[(long long)p * C + c];
  }
  s[threadIdx.y][threadIdx.x] = acc;
#pragma unroll
  for (int h = 16; h > 0; h >>= 1) {
    __syncthreads();
    if ((int)threadIdx.y < h) s[threadIdx.y][threadIdx.x] += s[threadIdx.y + h][threadIdx.x];
  }
  if (threadIdx.y == 0 && c < C) dw[c] = from_f32<W>(s[0][threadIdx.x]);
}

// ---- extern "C" entry points, one per instantiation (CuPy's disk cache keeps these; name_expressions are
// reported not to be kept, cupy/cupy#9667). Names: <kernel>_<x dtype>_<w dtype>_<VPT><v|s>; "add" kernels are
// add_rms_norm's (forward: res in, h out; backward: dh in).
#define RMS_REG(T, W, TN, WN, VPT, VEC, VS)                                                                      \
  CK_ENTRY(__launch_bounds__(512, 1),                                                                           \
      rms_fwd_##TN##_##WN##_##VPT##VS)(const T* x, const W* w, T* y, float* rstd, long long rows, int C,        \
                                      float eps, bool w_vec) {                                                 \
    rms_fwd_reg<T, W, VPT, VEC, false>(x, nullptr, w, y, nullptr, rstd, rows, C, eps, w_vec);                  \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(512, 1),                                                                           \
      rms_addfwd_##TN##_##WN##_##VPT##VS)(const T* x, const T* res, const W* w, T* y, T* h, float* rstd,        \
                                         long long rows, int C, float eps, bool w_vec) {                       \
    rms_fwd_reg<T, W, VPT, VEC, true>(x, res, w, y, h, rstd, rows, C, eps, w_vec);                             \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(256),                                                                             \
      rms_bwd_##TN##_##WN##_##VPT##VS)(const T* dy, const T* x, const W* w, const float* rstd, T* dx,           \
                                      float* dw_part, long long rows, int C, bool w_vec, unsigned* amax) {     \
    rms_bwd_reg<T, W, VPT, VEC, false>(dy, x, w, rstd, nullptr, dx, dw_part, rows, C, w_vec, amax);            \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(256),                                                                             \
      rms_addbwd_##TN##_##WN##_##VPT##VS)(const T* dy, const T* x, const W* w, const float* rstd, const T* dh,  \
                                         T* dx, float* dw_part, long long rows, int C, bool w_vec,             \
                                         unsigned* amax) {                                                     \
    rms_bwd_reg<T, W, VPT, VEC, true>(dy, x, w, rstd, dh, dx, dw_part, rows, C, w_vec, amax);                  \
  }
#define RMS_LOOP(T, W, TN, WN, VEC, VS)                                                                         \
  CK_ENTRY(__launch_bounds__(1024, 1),                                                                          \
      rms_fwd_loop_##TN##_##WN##_##VS)(const T* x, const W* w, T* y, float* rstd, long long rows, int C,        \
                                      float eps, bool w_vec) {                                                 \
    rms_fwd_loop<T, W, VEC, false>(x, nullptr, w, y, nullptr, rstd, rows, C, eps, w_vec);                      \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(1024, 1),                                                                          \
      rms_addfwd_loop_##TN##_##WN##_##VS)(const T* x, const T* res, const W* w, T* y, T* h, float* rstd,        \
                                         long long rows, int C, float eps, bool w_vec) {                       \
    rms_fwd_loop<T, W, VEC, true>(x, res, w, y, h, rstd, rows, C, eps, w_vec);                                 \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(512),                                                                             \
      rms_bwd_rowsums_##TN##_##WN##_##VS)(const T* dy, const T* x, const W* w, const float* rstd, float* coef,  \
                                         long long rows, int C, bool w_vec) {                                  \
    rms_bwd_rowsums<T, W, VEC>(dy, x, w, rstd, coef, rows, C, w_vec);                                          \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(256),                                                                             \
      rms_bwd_cols_##TN##_##WN##_##VS)(const T* dy, const T* x, const W* w, const float* rstd,                  \
                                      const float* coef, const T* dh, T* dx, float* dw_part, long long rows,   \
                                      int C, int rows_per_group, bool w_vec, unsigned* amax) {                 \
    const unsigned m = rms_bwd_cols<T, W, VEC>(dy, x, w, rstd, coef, dh, dx, dw_part, rows, C, rows_per_group, \
                                               w_vec, amax != nullptr);                                       \
    if (amax != nullptr) block_amax_2d(m, amax);                                                               \
  }
// Pipelined backward (16-byte path only). Bounds: VPT <= 2 runs 512-thread blocks, 2 per SM (64 registers);
// VPT 4 runs 256-thread blocks (its 32 bf16 accumulators need more than 64 registers).
#define RMS_PIPE(T, W, TN, WN, VPT, NTH)                                                                        \
  CK_ENTRY(__launch_bounds__(NTH, 2),                                                                            \
      rms_bwdp_##TN##_##WN##_##VPT)(const T* dy, const T* x, const W* w, const float* rstd, T* dx,              \
                                   float* dw_part, long long rows, int C, int nstages, bool w_vec,             \
                                   unsigned* amax) {                                                           \
    rms_bwd_pipe<T, W, VPT, false>(dy, x, w, rstd, nullptr, dx, dw_part, rows, C, nstages, w_vec, amax);       \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(NTH, 2),                                                                            \
      rms_addbwdp_##TN##_##WN##_##VPT)(const T* dy, const T* x, const W* w, const float* rstd, const T* dh,     \
                                      T* dx, float* dw_part, long long rows, int C, int nstages, bool w_vec,   \
                                      unsigned* amax) {                                                        \
    rms_bwd_pipe<T, W, VPT, true>(dy, x, w, rstd, dh, dx, dw_part, rows, C, nstages, w_vec, amax);             \
  }
#define RMS_ALL_VPT(T, W, TN, WN, VEC, VS)                                                                      \
  RMS_REG(T, W, TN, WN, 1, VEC, VS)                                                                             \
  RMS_REG(T, W, TN, WN, 2, VEC, VS)                                                                             \
  RMS_REG(T, W, TN, WN, 4, VEC, VS)                                                                             \
  RMS_REG(T, W, TN, WN, 8, VEC, VS)                                                                             \
  RMS_LOOP(T, W, TN, WN, VEC, VS)
#define RMS_ALL(T, W, TN, WN)                                                                                   \
  RMS_ALL_VPT(T, W, TN, WN, true, v)                                                                            \
  RMS_ALL_VPT(T, W, TN, WN, false, s)                                                                           \
  RMS_PIPE(T, W, TN, WN, 1, 512) RMS_PIPE(T, W, TN, WN, 2, 512) RMS_PIPE(T, W, TN, WN, 4, 256)

RMS_ALL(float, float, f32, f32)
RMS_ALL(float, bf16, f32, bf16)
RMS_ALL(bf16, float, bf16, f32)
RMS_ALL(bf16, bf16, bf16, bf16)

CK_ENTRY(__launch_bounds__(1024), rms_dw_finalize_f32)(const float* part, float* dw, int nparts,
                                                       int C) {
  rms_dw_finalize<float>(part, dw, nparts, C);
}
CK_ENTRY(__launch_bounds__(1024), rms_dw_finalize_bf16)(const float* part, bf16* dw, int nparts,
                                                        int C) {
  rms_dw_finalize<bf16>(part, dw, nparts, C);
}
