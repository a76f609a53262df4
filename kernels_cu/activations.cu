// Activations: SwiGLU (LLaMA's MLP) and GELU, tanh approximation (GPT-2's gelu_new) or exact (erf: BERT, HF "gelu").
//
//   silu(g)   = g * s,  s = sigmoid(g) = 1 / (1 + e^-g)
//   swiglu    y = silu(g) * u
//   backward  dg = dy * u * s * (1 + g * (1 - s))      (d silu / dg = s + g s (1 - s))
//             du = dy * silu(g)
//   gelu      y = 0.5 x (1 + tanh(k (x + 0.044715 x^3))),  k = sqrt(2 / pi)
//             = x * sigmoid(2 u), u = k (x + 0.044715 x^3)   (0.5 (1 + tanh u) = sigmoid(2u): no tanh, and no
//               cancellation in 1 + tanh u for u << 0)
//   backward  dx = dy * (s + 2 x s (1 - s) k (1 + 3 * 0.044715 x^2)),  s = sigmoid(2u)
//   gelu exact  y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))
//   backward    dx = dy * (Phi(x) + x phi(x)),  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
//     PyTorch's formula (approximate="none"), with CUDA's erff (<= 2 ulp) and __expf for phi. 1 + erf(x / sqrt 2)
//     cancels for x << 0: at x = -5 (Phi = 2.9e-7) it is good to ~2e-7 absolute, so y (~ -1.4e-6) carries ~3e-7
//     absolute error -- far below a bf16 activation's resolution and what PyTorch computes; erfcf(-x / sqrt 2)
//     would keep the relative accuracy at ~2x the instructions (a division and an exp), in an op whose tanh
//     twin already came out issue-bound (NOTES, run 4). x = +-1e4: erff = +-1 -> y = 1e4 / -0; phi's exp
//     underflows to 0 (x^2 -> inf in fp32 beyond 1.8e19: exp(-inf) = 0), so dx = 1 / 0, never NaN.
//
// Stability: sigmoid2() (common/pointwise.cuh) gives s and 1 - s = e^-z s without NaN for every finite z
// (e^-z = inf -> s = 0, 1 - s = 1), so inputs of +-1e4 (and far beyond for SwiGLU) give finite outputs:
// silu(-1e4) = -0, silu(1e4) = 1e4, gelu(+-1e4) = 1e4 / -0; x^3 stays finite up to |x| ~ 7e12.
//
// Layout: separate gate/up (any shape) are flat arrays: run_flat (common/pointwise.cuh), any n, a 16-byte body
// and a scalar tail. The packed gu [..., 2F] layout uses the same ops through run_rows: gate row r at
// gu + r * 2F, up row r F further, y/dy rows F apart (16-byte path when F % (16 / sizeof(T)) == 0, else element
// accesses). Memory-bound: bf16 SwiGLU forward moves 6 B/element, backward 10 B, GELU 4 B / 6 B; at ~4.2 TB/s
// that is ~0.7 G elements/ms forward, and the fp32 math (one __expf, one division, a few FMAs: ~25
// instructions/element) stays under the SM issue budget at that rate (~45 instructions/element forward, ~80
// backward, 132 SMs x 128 lanes x ~1.9 GHz).
// Each thread keeps U = 4 units of 16 bytes per operand in flight; bf16 stays packed two per 32-bit register
// and is rounded with cvt.rn.bf16x2 (Chunk), which with __launch_bounds__(256, 2) keeps every kernel at
// <= 96 registers (ptxas, sm_90): >= 2 blocks of 256 threads per SM, so >= 512 threads x 4 units x 16 B x
// operands (~100 KB for swiglu backward) are in flight per SM, ~3x what Little's law asks at 4.2 TB/s.
// grid = SMs x resident blocks (launcher), grid-stride beyond. GELU (forward and backward, both forms) runs
// the same loop software-pipelined (run_flat_pipe below: 2U slots, the next step's loads in flight during this
// step's math; ptxas sm_90 bf16: forward 72 registers -> 3 blocks of 256 a SM, backward 119 -> 2).
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/pointwise.cuh"
#include "common/fp8.cuh"

constexpr float GELU_K = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float GELU_C = 0.044715f;

__device__ __forceinline__ float silu_f(float g) { return silu_of(g); }
__device__ __forceinline__ void silu_grad(float g, float& silu, float& dsilu) {
  float s, oms;
  sigmoid2(g, s, oms);
  silu = g * s;
  dsilu = s * (1.f + g * oms);
}
__device__ __forceinline__ float gelu_f(float x) {
  float s, oms;
  sigmoid2(2.f * GELU_K * (x + GELU_C * x * x * x), s, oms);
  return x * s;
}
__device__ __forceinline__ float gelu_grad(float x) {
  float s, oms;
  const float x2 = x * x;
  sigmoid2(2.f * GELU_K * (x + GELU_C * x2 * x), s, oms);
  return s + 2.f * x * (s * oms) * GELU_K * (1.f + 3.f * GELU_C * x2);
}
constexpr float GELU_RSQRT2 = 0.7071067811865476f;    // 1 / sqrt(2)
constexpr float GELU_RSQRT2PI = 0.3989422804014327f;  // 1 / sqrt(2 pi)
__device__ __forceinline__ float gelu_erf_f(float x) { return 0.5f * x * (1.f + erff(x * GELU_RSQRT2)); }
__device__ __forceinline__ float gelu_erf_grad(float x) {
  const float cdf = 0.5f * (1.f + erff(x * GELU_RSQRT2));
  return cdf + x * (__expf(-0.5f * x * x) * GELU_RSQRT2PI);
}
// The form as a compile-time flag: EXACT = erf, else tanh.
template <bool EXACT>
__device__ __forceinline__ float gelu_fn(float x) { return EXACT ? gelu_erf_f(x) : gelu_f(x); }
template <bool EXACT>
__device__ __forceinline__ float gelu_dfn(float x) { return EXACT ? gelu_erf_grad(x) : gelu_grad(x); }

// AMAX: also max |y| of the rounded outputs into m (as ordered bits: |v|'s float bits, NaN above inf), for
// block_amax at the end (common/fp8.cuh): the FP8 linear that reads y takes its current scale from it, without the
// amax pass of its own (2 bytes an element of y: ~1.1 ms a step for the SwiGLU gradient at the 1B shape, NOTES FP8).

template <typename T, int E, bool VEC, int U, bool AMAX = false>
struct SwigluFwd {
  const T* g;
  const T* u;
  T* y;
  long long ld_in, ld_out;
  Chunk<T, E, VEC> cg[U], cu[U];
  unsigned m = 0;
  __device__ __forceinline__ void load(int k, long long r, long long c) {
    cg[k].load(g + r * ld_in + c);
    cu[k].load(u + r * ld_in + c);
  }
  __device__ __forceinline__ void store(int k, long long r, long long c) {
    float f[E];
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = silu_f(cg[k].get(i)) * cu[k].get(i);
    Chunk<T, E, VEC> o;
    o.pack(f);
    if constexpr (AMAX) {
#pragma unroll
      for (int i = 0; i < E; ++i) m = max(m, abs_bits(o.get(i)));
    }
    o.store(y + r * ld_out + c);
  }
};

template <typename T, int E, bool VEC, int U, bool AMAX = false>
struct SwigluBwd {
  const T* g;
  const T* u;
  const T* dy;
  T* dg;
  T* du;
  long long ld_in, ld_out;  // gate/up/dgate/dup rows ld_in apart, dy rows ld_out apart
  Chunk<T, E, VEC> cg[U], cu[U], cd[U];
  unsigned m = 0;
  __device__ __forceinline__ void load(int k, long long r, long long c) {
    cg[k].load(g + r * ld_in + c);
    cu[k].load(u + r * ld_in + c);
    cd[k].load(dy + r * ld_out + c);
  }
  __device__ __forceinline__ void store(int k, long long r, long long c) {
    float fg[E], fu[E];
#pragma unroll
    for (int i = 0; i < E; ++i) {
      float silu, dsilu;
      silu_grad(cg[k].get(i), silu, dsilu);
      const float d = cd[k].get(i);
      fg[i] = d * cu[k].get(i) * dsilu;
      fu[i] = d * silu;
    }
    Chunk<T, E, VEC> og, ou;
    og.pack(fg);
    ou.pack(fu);
    if constexpr (AMAX) {
#pragma unroll
      for (int i = 0; i < E; ++i) m = max(m, max(abs_bits(og.get(i)), abs_bits(ou.get(i))));
    }
    og.store(dg + r * ld_in + c);
    ou.store(du + r * ld_in + c);
  }
};

template <typename T, int E, bool VEC, int U, bool EXACT = false>
struct GeluFwd {
  const T* x;
  T* y;
  Chunk<T, E, VEC> cx[U];
  __device__ __forceinline__ void load(int k, long long, long long c) { cx[k].load(x + c); }
  __device__ __forceinline__ void store(int k, long long, long long c) {
    float f[E];
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = gelu_fn<EXACT>(cx[k].get(i));
    Chunk<T, E, VEC> o;
    o.pack(f);
    o.store(y + c);
  }
};

template <typename T, int E, bool VEC, int U, bool EXACT = false>
struct GeluBwd {
  const T* x;
  const T* dy;
  T* dx;
  Chunk<T, E, VEC> cx[U], cd[U];
  __device__ __forceinline__ void load(int k, long long, long long c) {
    cx[k].load(x + c);
    cd[k].load(dy + c);
  }
  __device__ __forceinline__ void store(int k, long long, long long c) {
    float f[E];
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = cd[k].get(i) * gelu_dfn<EXACT>(cx[k].get(i));
    Chunk<T, E, VEC> o;
    o.pack(f);
    o.store(dx + c);
  }
};

constexpr int ACT_U = 4;

// GELU's flat loop, software-pipelined: run_flat (common/pointwise.cuh) loads a thread's U units, waits for
// them, computes and stores, so a warp has no load in flight while it computes. GELU forward is the one
// activation whose math is heavy next to its bytes (bf16: 4 B and two MUFU ops (ex2, rcp) + ~15 other
// instructions an element; 2 x 1.34e8 MUFU for 16384 x 8192 is ~64 us of the SFU at 16 / clock / SM beside a
// 128 us memory floor), and it stalled at 3.55 TB/s (0.97x PyTorch, NOTES run 6) while bf16 add, with the same
// loop and no math, reached 3.96. Here the op holds 2U slots: the U units of the next grid-stride step are
// loaded into one half before the U units of this step (the other half) are computed and stored, so every
// thread keeps U x 16 B per operand in flight through its math. Out may alias an input: the prefetched units
// are other elements than the ones being stored (the next step), and each element is still read and written
// by one thread, read first. The main loop is unrolled twice so the slot halves are compile-time indices.
template <int S, int U, class Op>
__device__ __forceinline__ void pipe_load(Op& op, long long base, long long nu, int E) {
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const long long j = base + (long long)k * blockDim.x;
    if (j < nu) op.load(S + k, 0, j * E);
  }
}
template <int S, int U, class Op>
__device__ __forceinline__ void pipe_store(Op& op, long long base, long long nu, int E) {
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const long long j = base + (long long)k * blockDim.x;
    if (j < nu) op.store(S + k, 0, j * E);
  }
}
template <int E, int U, class Op, class Tail>
__device__ __forceinline__ void run_flat_pipe(Op& op, Tail& tail, long long n) {
  const long long nu = n / E;
  const long long step = (long long)gridDim.x * blockDim.x * U;
  long long base = (long long)blockIdx.x * blockDim.x * U + threadIdx.x;
  pipe_load<0, U>(op, base, nu, E);
  while (base < nu) {
    pipe_load<U, U>(op, base + step, nu, E);  // next step into slots U..2U-1, in flight during the math below
    pipe_store<0, U>(op, base, nu, E);
    base += step;
    if (base >= nu) break;
    pipe_load<0, U>(op, base + step, nu, E);
    pipe_store<U, U>(op, base, nu, E);
    base += step;
  }
  if (blockIdx.x == 0) {  // the last n % E elements, as in run_flat
    const long long c = nu * E + threadIdx.x;
    if (c < n) {
      tail.load(0, 0, c);
      tail.store(0, 0, c);
    }
  }
}

// Entry points: <op>_<dtype>_<v|s>; v = 16-byte body (+ scalar tail in the flat kernels), s = element
// accesses. swiglu_*_rows: the packed layout (run_rows; gate/up rows ld_in apart, y/dy rows F apart).
// gelu_*: tanh form, gelu_erf_*: exact form.
#define ACT_KERNELS(T, TN, VEC, VS)                                                                           \
  CK_ENTRY(__launch_bounds__(256, 2),                                                                          \
      swiglu_fwd_##TN##_##VS)(const T* g, const T* u, T* y, long long n) {                                  \
    constexpr int E = VEC ? 16 / sizeof(T) : 1;                                                             \
    SwigluFwd<T, E, VEC, ACT_U> op{g, u, y, 0, 0};                                                          \
    SwigluFwd<T, 1, false, 1> tail{g, u, y, 0, 0};                                                          \
    run_flat<E, ACT_U>(op, tail, n);                                                                        \
  }                                                                                                         \
  CK_ENTRY(__launch_bounds__(256, 2), swiglu_fwd_rows_##TN##_##VS)(                                             \
      const T* g, const T* u, T* y, unsigned int rows, unsigned int F, long long ld_in) {                   \
    constexpr int E = VEC ? 16 / sizeof(T) : 1;                                                             \
    SwigluFwd<T, E, VEC, ACT_U> op{g, u, y, ld_in, F};                                                      \
    run_rows<E, ACT_U>(op, rows, F);                                                                        \
  }                                                                                                         \
  CK_ENTRY(__launch_bounds__(256, 2), swiglu_fwd_rows_amax_##TN##_##VS)(                                        \
      const T* g, const T* u, T* y, unsigned int rows, unsigned int F, long long ld_in, unsigned* amax) {   \
    constexpr int E = VEC ? 16 / sizeof(T) : 1;                                                             \
    SwigluFwd<T, E, VEC, ACT_U, true> op{g, u, y, ld_in, F};                                                \
    run_rows<E, ACT_U>(op, rows, F);                                                                        \
    block_amax(op.m, amax, nullptr);                                                                      \
  }                                                                                                         \
  CK_ENTRY(__launch_bounds__(256, 2),                                                                          \
      swiglu_bwd_##TN##_##VS)(const T* g, const T* u, const T* dy, T* dg, T* du, long long n) {             \
    constexpr int E = VEC ? 16 / sizeof(T) : 1;                                                             \
    SwigluBwd<T, E, VEC, ACT_U> op{g, u, dy, dg, du, 0, 0};                                                 \
    SwigluBwd<T, 1, false, 1> tail{g, u, dy, dg, du, 0, 0};                                                 \
    run_flat<E, ACT_U>(op, tail, n);                                                                        \
  }                                                                                                         \
  CK_ENTRY(__launch_bounds__(256, 2), swiglu_bwd_rows_##TN##_##VS)(                                             \
      const T* g, const T* u, const T* dy, T* dg, T* du, unsigned int rows, unsigned int F, long long ld_in) { \
    constexpr int E = VEC ? 16 / sizeof(T) : 1;                                                             \
    SwigluBwd<T, E, VEC, ACT_U> op{g, u, dy, dg, du, ld_in, F};                                             \
    run_rows<E, ACT_U>(op, rows, F);                                                                        \
  }                                                                                                         \
  CK_ENTRY(__launch_bounds__(256, 2), swiglu_bwd_rows_amax_##TN##_##VS)(                                        \
      const T* g, const T* u, const T* dy, T* dg, T* du, unsigned int rows, unsigned int F, long long ld_in,  \
      unsigned* amax) {                                                                                     \
    constexpr int E = VEC ? 16 / sizeof(T) : 1;                                                             \
    SwigluBwd<T, E, VEC, ACT_U, true> op{g, u, dy, dg, du, ld_in, F};                                       \
    run_rows<E, ACT_U>(op, rows, F);                                                                        \
    block_amax(op.m, amax, nullptr);                                                                      \
  }                                                                                                         \
  CK_ENTRY(__launch_bounds__(256, 2), gelu_fwd_##TN##_##VS)(const T* x, T* y, long long n) {                   \
    constexpr int E = VEC ? 16 / sizeof(T) : 1;                                                             \
    GeluFwd<T, E, VEC, 2 * ACT_U> op{x, y};                                                                 \
    GeluFwd<T, 1, false, 1> tail{x, y};                                                                     \
    run_flat_pipe<E, ACT_U>(op, tail, n);                                                                   \
  }                                                                                                         \
  CK_ENTRY(__launch_bounds__(256, 2),                                                                          \
      gelu_bwd_##TN##_##VS)(const T* x, const T* dy, T* dx, long long n) {                                  \
    constexpr int E = VEC ? 16 / sizeof(T) : 1;                                                             \
    GeluBwd<T, E, VEC, 2 * ACT_U> op{x, dy, dx};                                                            \
    GeluBwd<T, 1, false, 1> tail{x, dy, dx};                                                                \
    run_flat_pipe<E, ACT_U>(op, tail, n);                                                                   \
  }                                                                                                         \
  CK_ENTRY(__launch_bounds__(256, 2),                                                                          \
      gelu_erf_fwd_##TN##_##VS)(const T* x, T* y, long long n) {                                            \
    constexpr int E = VEC ? 16 / sizeof(T) : 1;                                                             \
    GeluFwd<T, E, VEC, 2 * ACT_U, true> op{x, y};                                                           \
    GeluFwd<T, 1, false, 1, true> tail{x, y};                                                               \
    run_flat_pipe<E, ACT_U>(op, tail, n);                                                                   \
  }                                                                                                         \
  CK_ENTRY(__launch_bounds__(256, 2),                                                                          \
      gelu_erf_bwd_##TN##_##VS)(const T* x, const T* dy, T* dx, long long n) {                              \
    constexpr int E = VEC ? 16 / sizeof(T) : 1;                                                             \
    GeluBwd<T, E, VEC, 2 * ACT_U, true> op{x, dy, dx};                                                      \
    GeluBwd<T, 1, false, 1, true> tail{x, dy, dx};                                                          \
    run_flat_pipe<E, ACT_U>(op, tail, n);                                                                   \
  }

ACT_KERNELS(float, f32, true, v)
ACT_KERNELS(float, f32, false, s)
ACT_KERNELS(bf16, bf16, true, v)
ACT_KERNELS(bf16, bf16, false, s)
