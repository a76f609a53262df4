// RMSNorm over the last axis: rows of C elements.
//
//   forward   r = 1 / sqrt(mean(x^2) + eps)          (one fp32 per row, saved for backward)
//             y = x * r * w
//   backward  g = dy * w
//             dx = r * (g - x * r^2 * mean(g * x))
//             dw = sum over rows of dy * x * r
//
// Design (numbers for 8192 x 2048 on an H200, copy ceiling ~4.2 TB/s):
// - "reg" kernels keep the row in registers between the reduction and the write, so x (and dy) are read
//   exactly once: forward moves 2 * C * sizeof(T) per row, backward 3 * C * sizeof(T). A row is split over
//   TPR threads with VPT packs of 16 bytes each; the launcher aims at 2 packs per thread (measured best of
//   1/2/4/8 on the H200: benchmarks/tune_rms_norm.py), TPR <= 512 forward / 256 backward, VPT <= 8. Rows
//   of fewer than 256 threads share a block (TPR x RPB = 256).
// - Backward holds x, dy and the dw accumulator (VPT x 16 floats) live at once, so its blocks are capped at
//   256 threads (__launch_bounds__(256)). No kernel spills (tests/test_compile.py checks ptxas).
// - VEC=true: 16-byte loads/stores, needs C % (16 / sizeof(T)) == 0 and 16-byte aligned pointers (the
//   launcher checks); VEC=false: element accesses, any C, any alignment (misaligned views).
// - Rows too long for registers (forward: fp32 C > 16384, bf16 C > 32768, unaligned C > 4096; backward:
//   fp32 C > 8192, bf16 C > 16384, unaligned C > 2048): the forward "loop" kernel makes two passes over the
//   row, the second mostly from L2 (a 256 KB row x 2 blocks x 132 SMs fits in the 60 MB L2); the backward
//   splits into per-row sums and column-chunk blocks (below).
// - dw is deterministic: each block accumulates its rows' dy * x * r in registers (the thread owns the same
//   columns for every row it visits), writes one fp32 partial row per block, and rms_dw_finalize sums the
//   partials in a fixed order. The launcher sizes the grid to one wave, ~2 blocks/SM x 132 SMs, so the
//   partials (264 x C x 4 B written and read) are ~2 % of the backward traffic at 8192 x 2048.
#include "common/vec.cuh"

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
template <typename T, typename W, int VPT, bool VEC>
__device__ __forceinline__ void rms_fwd_reg(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y,
                                            float* __restrict__ rstd, long long rows, int C, float eps, bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[32 * 32];
  const int units = C / E;
  const long long stride = (long long)gridDim.x * blockDim.y;
  Pack<T, E> xv[VPT];
  for (long long base = (long long)blockIdx.x * blockDim.y; base < rows; base += stride) {
    const long long row = base + threadIdx.y;
    load_row<T, E, VPT>(xv, x, row, rows, C, units);
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
        }
      }
    }
  }
}

template <typename T, typename W, bool VEC>
__device__ __forceinline__ void rms_fwd_loop(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y,
                                             float* __restrict__ rstd, long long rows, int C, float eps, bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[32];
  const int units = C / E;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * C;
    float ss = 0.f;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const Pack<T, E> v = load_pack<T, E>(xr + u * E);
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
template <typename T, typename W, int VPT, bool VEC>
__device__ __forceinline__ void rms_bwd_reg(const T* __restrict__ dy, const T* __restrict__ x,
                                            const W* __restrict__ w, const float* __restrict__ rstd,
                                            T* __restrict__ dx, float* __restrict__ dw_part, long long rows, int C,
                                            bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  __shared__ float scratch[32 * 32];
  __shared__ float combine[256 * 8];  // write_block_partial: TPR * RPB <= 256 threads, E <= 8 floats each
  const int units = C / E;
  float acc[VPT][E];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int i = 0; i < E; ++i) acc[k][i] = 0.f;

  const long long stride = (long long)gridDim.x * blockDim.y;
  Pack<T, E> xv[VPT], gv[VPT];
  for (long long base = (long long)blockIdx.x * blockDim.y; base < rows; base += stride) {
    const long long row = base + threadIdx.y;
    const bool active = row < rows;
    load_row<T, E, VPT>(xv, x, row, rows, C, units);
    load_row<T, E, VPT>(gv, dy, row, rows, C, units);
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
          o.v[i] = from_f32<T>(r * (gf * wf[i] - xf * c));
          acc[k][i] += gf * xf * r;
        }
        store_pack<T, E>(dx + row * C + u * E, o);
      }
    }
  }

  write_block_partial<VPT, E>(acc, dw_part + (long long)blockIdx.x * C, units, combine);
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
__device__ __forceinline__ void rms_bwd_cols(const T* __restrict__ dy, const T* __restrict__ x,
                                             const W* __restrict__ w, const float* __restrict__ rstd,
                                             const float* __restrict__ coef, T* __restrict__ dx,
                                             float* __restrict__ dw_part, long long rows, int C, int rows_per_group,
                                             bool w_vec) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  const int units = C / E;
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  const long long r0 = (long long)blockIdx.y * rows_per_group;
  const long long r1 = r0 + rows_per_group < rows ? r0 + rows_per_group : rows;
  if (u >= units) return;  // no barriers below: idle threads may leave
  float wf[E], acc[E];
  load_f32<E>(w + u * E, wf, w_vec);
#pragma unroll
  for (int i = 0; i < E; ++i) acc[i] = 0.f;
#pragma unroll 4
  for (long long row = r0; row < r1; ++row) {
    const long long off = row * C + (long long)u * E;
    const Pack<T, E> xv = load_pack<T, E>(x + off), gv = load_pack<T, E>(dy + off);
    const float r = rstd[row], c = coef[row];
    Pack<T, E> o;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const float xf = to_f32(xv.v[i]), gf = to_f32(gv.v[i]);
      o.v[i] = from_f32<T>(r * (gf * wf[i] - xf * c));
      acc[i] += gf * xf * r;
    }
    store_pack<T, E>(dx + off, o);
  }
  float* part = dw_part + (long long)blockIdx.y * C + (long long)u * E;
#pragma unroll
  for (int i = 0; i < E; ++i) part[i] = acc[i];
}

// dw[c] = sum_p part[p, c], p in order (common/vec.cuh: column_sums).
template <typename W>
__device__ __forceinline__ void rms_dw_finalize(const float* __restrict__ part, W* __restrict__ dw, int nparts,
                                                int C) {
  column_sums<W>(part, dw, nparts, C);
}

// ---- extern "C" entry points, one per instantiation (CuPy's disk cache keeps these; name_expressions are
// reported not to be kept, cupy/cupy#9667). Names: <kernel>_<x dtype>_<w dtype>_<VPT><v|s>.
#define RMS_REG(T, W, TN, WN, VPT, VEC, VS)                                                                      \
  extern "C" __global__ void __launch_bounds__(512, 1)                                                          \
      rms_fwd_##TN##_##WN##_##VPT##VS(const T* x, const W* w, T* y, float* rstd, long long rows, int C,         \
                                      float eps, bool w_vec) {                                                 \
    rms_fwd_reg<T, W, VPT, VEC>(x, w, y, rstd, rows, C, eps, w_vec);                                           \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(256)                                                            \
      rms_bwd_##TN##_##WN##_##VPT##VS(const T* dy, const T* x, const W* w, const float* rstd, T* dx,            \
                                      float* dw_part, long long rows, int C, bool w_vec) {                     \
    rms_bwd_reg<T, W, VPT, VEC>(dy, x, w, rstd, dx, dw_part, rows, C, w_vec);                                  \
  }
#define RMS_LOOP(T, W, TN, WN, VEC, VS)                                                                         \
  extern "C" __global__ void __launch_bounds__(1024, 1)                                                         \
      rms_fwd_loop_##TN##_##WN##_##VS(const T* x, const W* w, T* y, float* rstd, long long rows, int C,         \
                                      float eps, bool w_vec) {                                                 \
    rms_fwd_loop<T, W, VEC>(x, w, y, rstd, rows, C, eps, w_vec);                                               \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(512)                                                            \
      rms_bwd_rowsums_##TN##_##WN##_##VS(const T* dy, const T* x, const W* w, const float* rstd, float* coef,   \
                                         long long rows, int C, bool w_vec) {                                  \
    rms_bwd_rowsums<T, W, VEC>(dy, x, w, rstd, coef, rows, C, w_vec);                                          \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(256)                                                            \
      rms_bwd_cols_##TN##_##WN##_##VS(const T* dy, const T* x, const W* w, const float* rstd,                   \
                                      const float* coef, T* dx, float* dw_part, long long rows, int C,         \
                                      int rows_per_group, bool w_vec) {                                        \
    rms_bwd_cols<T, W, VEC>(dy, x, w, rstd, coef, dx, dw_part, rows, C, rows_per_group, w_vec);                \
  }
#define RMS_ALL_VPT(T, W, TN, WN, VEC, VS)                                                                      \
  RMS_REG(T, W, TN, WN, 1, VEC, VS)                                                                             \
  RMS_REG(T, W, TN, WN, 2, VEC, VS)                                                                             \
  RMS_REG(T, W, TN, WN, 4, VEC, VS)                                                                             \
  RMS_REG(T, W, TN, WN, 8, VEC, VS)                                                                             \
  RMS_LOOP(T, W, TN, WN, VEC, VS)
#define RMS_ALL(T, W, TN, WN)                                                                                   \
  RMS_ALL_VPT(T, W, TN, WN, true, v)                                                                            \
  RMS_ALL_VPT(T, W, TN, WN, false, s)

RMS_ALL(float, float, f32, f32)
RMS_ALL(float, bf16, f32, bf16)
RMS_ALL(bf16, float, bf16, f32)
RMS_ALL(bf16, bf16, bf16, bf16)

extern "C" __global__ void __launch_bounds__(512) rms_dw_finalize_f32(const float* part, float* dw, int nparts,
                                                                      int C) {
  rms_dw_finalize<float>(part, dw, nparts, C);
}
extern "C" __global__ void __launch_bounds__(512) rms_dw_finalize_bf16(const float* part, bf16* dw, int nparts,
                                                                       int C) {
  rms_dw_finalize<bf16>(part, dw, nparts, C);
}
