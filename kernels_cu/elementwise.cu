// Mixed-dtype elementwise ops in fp32 registers, and casts.
//
//   add   out = a + alpha * b      (each operand fp32 or bf16, converted to fp32 on load, rounded once on store)
//   mul   out = a * b
//   cast  y = x converted to y's dtype; fp32 -> bf16 rounds to nearest even, bit-for-bit what ml_dtypes does,
//         NaN included (any NaN -> 0x7fc0 with the sign kept, as ml_dtypes); bf16 -> fp32 is exact.
//   backward: d(a + alpha b) = (dy, alpha dy), d(a * b) = (dy * b, dy * a): the caller composes them from mul
//   and a cast, so there is no backward kernel here.
//
// add/mul use __fadd_rn / __fmul_rn (no FMA contraction), so the fp32 result is the same bits as NumPy's
// float32 a + float32(alpha) * b, and the rounded bf16 result equals ml_dtypes' rounding of it: the GPU tests
// compare bit for bit.
//
// Layout: same-shape operands are flat arrays (run_flat, common/pointwise.cuh: any n, a 16-byte body plus a
// scalar tail). b broadcast along the last axis (b.shape == a.shape[-1:], "bcast" kernels): run_rows over
// rows of C with b's row stride 0, so b (C elements) stays in L1/L2 and only a and out move through HBM; the
// 16-byte path then needs C % E == 0 (else element accesses). E = 16 / (smallest itemsize): a unit is 8
// elements when any operand is bf16 (one 16-byte access per bf16 operand, two per fp32 operand), 4 when all are
// fp32. Bytes: the residual-add case (fp32 += bf16) moves 10 B/element; at ~4.2 TB/s, 0.42 G elements/ms.
// Each thread holds U = 4 units per operand in flight; __launch_bounds__(256, 2) caps registers at 128 (ptxas
// sm_90: <= 102, no spills), so >= 2 blocks of 256 threads per SM keep ~100 KB per SM in flight.
// In place (out = a, or out = b when b is not broadcast) is safe: each element is read and then written by one
// thread, and no pointer is __restrict__.
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/pointwise.cuh"

template <typename A, typename Bt, typename O, int E, bool VEC, int U>
struct Binary {
  const A* a;
  const Bt* b;
  O* out;
  long long ld_a, ld_b;  // row strides (elements); ld_b = 0 broadcasts b along the rows
  float alpha;
  bool is_mul;
  Chunk<A, E, VEC> ca[U];
  Chunk<Bt, E, VEC> cb[U];
  __device__ __forceinline__ void load(int k, long long r, long long c) {
    ca[k].load(a + r * ld_a + c);
    cb[k].load(b + r * ld_b + c);
  }
  __device__ __forceinline__ void store(int k, long long r, long long c) {
    float f[E];
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const float x = ca[k].get(i), y = cb[k].get(i);
      f[i] = is_mul ? __fmul_rn(x, y) : __fadd_rn(x, __fmul_rn(alpha, y));
    }
    Chunk<O, E, VEC> o;
    o.pack(f);
    o.store(out + r * ld_a + c);
  }
};

template <typename I, typename O, int E, bool VEC, int U>
struct Cast {
  const I* x;
  O* y;
  Chunk<I, E, VEC> cx[U];
  __device__ __forceinline__ void load(int k, long long, long long c) { cx[k].load(x + c); }
  __device__ __forceinline__ void store(int k, long long, long long c) {
    float f[E];
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = cx[k].get(i);
    Chunk<O, E, VEC> o;
    o.pack_exact(f);
    o.store(y + c);
  }
};

constexpr int EW_U = 4;

__host__ __device__ constexpr int min_size(int x, int y) { return x < y ? x : y; }

// Entry points: binary_<a>_<b>_<out>_<v|s> (same shape, flat), bcast_<a>_<b>_<out>_<v|s> (b [C] broadcast
// over rows of C), cast_<in>_<out>_<v|s>.
#define EW_BINARY(A, Bt, O, AN, BN, ON, VEC, VS)                                                             \
  CK_ENTRY(__launch_bounds__(256, 2), binary_##AN##_##BN##_##ON##_##VS)(                                       \
      const A* a, const Bt* b, O* out, long long n, float alpha, bool is_mul) {                             \
    constexpr int E = VEC ? 16 / min_size(sizeof(A), min_size(sizeof(Bt), sizeof(O))) : 1;                  \
    Binary<A, Bt, O, E, VEC, EW_U> op{a, b, out, 0, 0, alpha, is_mul};                                      \
    Binary<A, Bt, O, 1, false, 1> tail{a, b, out, 0, 0, alpha, is_mul};                                     \
    run_flat<E, EW_U>(op, tail, n);                                                                         \
  }                                                                                                         \
  CK_ENTRY(__launch_bounds__(256, 2), bcast_##AN##_##BN##_##ON##_##VS)(                                        \
      const A* a, const Bt* b, O* out, unsigned int rows, unsigned int C, float alpha, bool is_mul) {       \
    constexpr int E = VEC ? 16 / min_size(sizeof(A), min_size(sizeof(Bt), sizeof(O))) : 1;                  \
    Binary<A, Bt, O, E, VEC, EW_U> op{a, b, out, C, 0, alpha, is_mul};                                      \
    run_rows<E, EW_U>(op, rows, C);                                                                         \
  }
#define EW_CAST(I, O, IN, ON, VEC, VS)                                                                       \
  CK_ENTRY(__launch_bounds__(256, 2), cast_##IN##_##ON##_##VS)(const I* x, O* y, long long n) {                 \
    constexpr int E = VEC ? 16 / min_size(sizeof(I), sizeof(O)) : 1;                                        \
    Cast<I, O, E, VEC, EW_U> op{x, y};                                                                      \
    Cast<I, O, 1, false, 1> tail{x, y};                                                                     \
    run_flat<E, EW_U>(op, tail, n);                                                                         \
  }
#define EW_BINARY_OUT(A, Bt, AN, BN, VEC, VS)                                                                \
  EW_BINARY(A, Bt, float, AN, BN, f32, VEC, VS)                                                             \
  EW_BINARY(A, Bt, bf16, AN, BN, bf16, VEC, VS)
#define EW_ALL(VEC, VS)                                                                                      \
  EW_BINARY_OUT(float, float, f32, f32, VEC, VS)                                                            \
  EW_BINARY_OUT(float, bf16, f32, bf16, VEC, VS)                                                            \
  EW_BINARY_OUT(bf16, float, bf16, f32, VEC, VS)                                                            \
  EW_BINARY_OUT(bf16, bf16, bf16, bf16, VEC, VS)                                                            \
  EW_CAST(float, float, f32, f32, VEC, VS)                                                                  \
  EW_CAST(float, bf16, f32, bf16, VEC, VS)                                                                  \
  EW_CAST(bf16, float, bf16, f32, VEC, VS)                                                                  \
  EW_CAST(bf16, bf16, bf16, bf16, VEC, VS)

EW_ALL(true, v)
EW_ALL(false, s)
