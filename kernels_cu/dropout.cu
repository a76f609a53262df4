// Dropout with a counter-based generator (Philox4x32-10): the mask is a pure function of (seed, offset, flat
// element index), so it is never stored -- the backward draws it again -- and a captured CUDA graph whose
// step advances a device-side offset gets fresh masks on every replay.
//
//   generator  Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
//              SC11; the generator cuRAND's Philox4_32_10 and PyTorch use). key = seed (k0 = low word,
//              k1 = high word); 128-bit counter = offset * 2^64 + i / 4, i.e. (c0, c1) = the 64-bit group
//              index i / 4, (c2, c3) = the 64-bit offset (the layout of cuRAND's state: the position in the
//              low words, the subsequence in the high words). One call gives 4 uint32: word i % 4 is element
//              i's. The NumPy reference (cukernels/ops/dropout.py) is the same function, bit for bit, and is
//              checked against Random123's published known-answer vectors.
//   keep       keep_i = (u_i >= threshold), threshold = round(p * 2^32) (host; uint32 compare, so both paths
//              agree exactly; P(keep) = 1 - threshold / 2^32 = 1 - p to within 2^-33).
//   dropout    y = keep ? x * scale : 0,   scale = fp32(1 / (1 - p))
//   backward   dx = keep ? dy * scale : 0  -- the same function of (dy, seed, offset): the same kernel.
//   add        out = r + (keep ? x * scale : 0)     (GPT-2's residual path: h + dropout(branch))
// A select, not a multiply by the 0/1 mask: a dropped element is exactly 0 even when x is inf or NaN (as
// flax's lax.select; PyTorch's multiply gives NaN there), and its gradient is exactly 0.
// __fmul_rn / __fadd_rn (no FMA contraction): the fp32 results are NumPy's float32 x * scale and
// r + (x * scale) bit for bit; bf16 outputs are rounded once (cvt.rn, = ml_dtypes for every non-NaN value).
//
// seed and offset come by value or from device memory (pointer != null: a 0-d uint64/int64 array, read as 64
// bits by every thread -- one broadcast load): a captured graph that increments the offset on the device
// draws a new mask each replay, with no host sync and no re-capture.
//
// Layout: flat arrays through run_flat (common/pointwise.cuh). Vector path: a unit is E = 16 / (smallest
// itemsize) elements (4 fp32 or 8 when any operand is bf16) moved with 16-byte accesses; E is a multiple of 4,
// so a unit starts on a Philox group and takes E / 4 whole Philox calls. Scalar path (a misaligned pointer):
// units of 4 elements with element accesses (one Philox call each); the last n % E elements one by one
// (a Philox call each, the word picked by select, never by a run-time register index).
//
// Compute vs memory (H200: 132 SMs, ~1.98 GHz; 67 TFLOP/s fp32 = 132 x 128 lanes x 2 x 1.98 GHz; 32-bit integer
// multiplies run on half the lanes, 64 /clk/SM = 16.7 T/s). A Philox call is 10 rounds of two 32x32 -> 64-bit
// products (counted as 2 integer-multiply issues each, lo and hi: IMAD + IMAD.HI or one IMAD.WIDE) and two
// three-input XORs (LOP3, ALU pipe, also 64 /clk/SM): 40 multiply + 20 ALU lane-ops per 4 elements, i.e. 10 + 5
// per element, plus ~3 per element for compare, select, multiply, convert. The multiply pipe then sustains
// 64 / 10 = 6.4 elements/clk/SM = 1.7 T elements/s. bf16 dropout moves 4 B/element: at 4.2 TB/s that is
// 1.05 T elements/s (~63 % of the pipe), fp32 0.53 T (~31 %), bf16 dropout_add 0.7 T (~42 %): every kernel
// should stay memory-bound, bf16 forward/backward with the least margin (benchmarks/NOTES.md, dropout).
// Each thread keeps U = 4 units per operand in flight; the Philox work of a unit does not depend on its loads,
// so it overlaps their latency. __launch_bounds__(256, 2): <= 128 registers.
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/pointwise.cuh"

// ---- generator begin: plain C++ apart from __device__ / __forceinline__ / __umulhi, so that
// tests/test_dropout.py compiles this section with the host compiler and checks it on the CPU against the
// known answers and the NumPy reference (vector, scalar and tail paths of keep()).
constexpr unsigned int PHILOX_M0 = 0xD2511F53u;  // Random123's PHILOX_M4x32_0 / _1 multipliers
constexpr unsigned int PHILOX_M1 = 0xCD9E8D57u;
constexpr unsigned int PHILOX_W0 = 0x9E3779B9u;  // key increments: golden ratio, sqrt(3) - 1 (Weyl sequence)
constexpr unsigned int PHILOX_W1 = 0xBB67AE85u;

struct Philox4 { unsigned int x, y, z, w; };

// The key schedule: round r uses (k0 + r * W0, k1 + r * W1) mod 2^32. It depends on the seed only, so each
// thread computes it once (20 registers) instead of 2 adds per round per call: that takes the ALU pipe from
// ~10 to ~5 lane-ops per element (the XORs), well under the multiply pipe's 10.
struct PhiloxKey {
  unsigned int k0[10], k1[10];
  __device__ __forceinline__ void init(unsigned int a, unsigned int b) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
      k0[r] = a + (unsigned int)r * PHILOX_W0;
      k1[r] = b + (unsigned int)r * PHILOX_W1;
    }
  }
};

// Philox4x32-10 of counter (c0..c3): 10 rounds, round r keyed by (k0[r], k1[r]).
__device__ __forceinline__ Philox4 philox4x32_10(unsigned int c0, unsigned int c1, unsigned int c2, unsigned int c3,
                                                 const PhiloxKey& key) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const unsigned int lo0 = PHILOX_M0 * c0, hi0 = __umulhi(PHILOX_M0, c0);
    const unsigned int lo1 = PHILOX_M1 * c2, hi1 = __umulhi(PHILOX_M1, c2);
    c0 = hi1 ^ c1 ^ key.k0[r];
    c1 = lo1;
    c2 = hi0 ^ c3 ^ key.k1[r];
    c3 = lo0;
  }
  return {c0, c1, c2, c3};
}

// The per-launch generator state: key schedule, offset, threshold, scale.
struct DropRng {
  PhiloxKey key;
  unsigned int o0, o1, threshold;
  float scale;
  __device__ __forceinline__ Philox4 group(unsigned long long g) const {
    return philox4x32_10((unsigned int)g, (unsigned int)(g >> 32), o0, o1, key);
  }
  // keep[i] for elements c .. c + E - 1 (E a multiple of 4 with c % 4 == 0, or E == 1 at any c).
  // threshold == 0 (p == 0) keeps everything without drawing: a launch-uniform branch.
  template <int E>
  __device__ __forceinline__ void keep(long long c, bool (&k)[E]) const {
    if (threshold == 0) {
#pragma unroll
      for (int i = 0; i < E; ++i) k[i] = true;
      return;
    }
    if constexpr (E == 1) {
      const Philox4 r = group((unsigned long long)c >> 2);
      const int w = (int)(c & 3);
      const unsigned int u = w == 0 ? r.x : (w == 1 ? r.y : (w == 2 ? r.z : r.w));
      k[0] = u >= threshold;
    } else {
      static_assert(E % 4 == 0, "vector units hold whole Philox groups");
#pragma unroll
      for (int q = 0; q < E / 4; ++q) {
        const Philox4 r = group(((unsigned long long)c >> 2) + q);
        k[4 * q + 0] = r.x >= threshold;
        k[4 * q + 1] = r.y >= threshold;
        k[4 * q + 2] = r.z >= threshold;
        k[4 * q + 3] = r.w >= threshold;
      }
    }
  }
};

__device__ __forceinline__ DropRng make_rng(const unsigned long long* seed_ptr, unsigned long long seed,
                                            const unsigned long long* off_ptr, unsigned long long offset,
                                            unsigned int threshold, float scale) {
  if (seed_ptr != nullptr) seed = *seed_ptr;
  if (off_ptr != nullptr) offset = *off_ptr;
  DropRng g;
  g.key.init((unsigned int)seed, (unsigned int)(seed >> 32));
  g.o0 = (unsigned int)offset;
  g.o1 = (unsigned int)(offset >> 32);
  g.threshold = threshold;
  g.scale = scale;
  return g;
}

// ---- generator end

// y = keep ? x * scale : 0 (forward and backward).
template <typename I, typename O, int E, bool VEC, int U>
struct DropoutOp {
  const I* x;
  O* y;
  DropRng g;
  Chunk<I, E, VEC> cx[U];
  __device__ __forceinline__ void load(int k, long long, long long c) { cx[k].load(x + c); }
  __device__ __forceinline__ void store(int k, long long, long long c) {
    bool kp[E];
    g.keep<E>(c, kp);
    float f[E];
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = kp[i] ? __fmul_rn(cx[k].get(i), g.scale) : 0.f;
    Chunk<O, E, VEC> o;
    o.pack(f);
    o.store(y + c);
  }
};

// out = r + (keep ? x * scale : 0).
template <typename X, typename R, typename O, int E, bool VEC, int U>
struct DropoutAddOp {
  const X* x;
  const R* r;
  O* out;
  DropRng g;
  Chunk<X, E, VEC> cx[U];
  Chunk<R, E, VEC> cr[U];
  __device__ __forceinline__ void load(int k, long long, long long c) {
    cx[k].load(x + c);
    cr[k].load(r + c);
  }
  __device__ __forceinline__ void store(int k, long long, long long c) {
    bool kp[E];
    g.keep<E>(c, kp);
    float f[E];
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = __fadd_rn(cr[k].get(i), kp[i] ? __fmul_rn(cx[k].get(i), g.scale) : 0.f);
    Chunk<O, E, VEC> o;
    o.pack(f);
    o.store(out + c);
  }
};

constexpr int DO_U = 4;  // units in flight per thread (UNROLL in cukernels/ops/dropout.py)

__host__ __device__ constexpr int dmin(int a, int b) { return a < b ? a : b; }

#define DROPOUT_ARGS                                                                                         \
  long long n, const unsigned long long *seed_ptr, unsigned long long seed, const unsigned long long *off_ptr, \
      unsigned long long offset, unsigned int threshold, float scale
#define DROPOUT_RNG make_rng(seed_ptr, seed, off_ptr, offset, threshold, scale)

// Entry points: dropout_<x>_<y>_<v|s>, dropout_add_<x>_<r>_<out>_<v|s> (v: 16-byte accesses, every pointer
// aligned; s: element accesses, any alignment).
#define DO_UNARY(I, O, IN, ON, VEC, VS)                                                                      \
  CK_ENTRY(__launch_bounds__(256, 2), dropout_##IN##_##ON##_##VS)(const I* x, O* y, DROPOUT_ARGS) {                 \
    constexpr int E = VEC ? 16 / dmin(sizeof(I), sizeof(O)) : 4;                                            \
    const DropRng g = DROPOUT_RNG;                                                                          \
    DropoutOp<I, O, E, VEC, DO_U> op{x, y, g};                                                              \
    DropoutOp<I, O, 1, false, 1> tail{x, y, g};                                                             \
    run_flat<E, DO_U>(op, tail, n);                                                                         \
  }
#define DO_ADD(X, R, O, XN, RN, ON, VEC, VS)                                                                 \
  CK_ENTRY(__launch_bounds__(256, 2), dropout_add_##XN##_##RN##_##ON##_##VS)(                                  \
      const X* x, const R* r, O* out, DROPOUT_ARGS) {                                                       \
    constexpr int E = VEC ? 16 / dmin(sizeof(X), dmin(sizeof(R), sizeof(O))) : 4;                           \
    const DropRng g = DROPOUT_RNG;                                                                          \
    DropoutAddOp<X, R, O, E, VEC, DO_U> op{x, r, out, g};                                                   \
    DropoutAddOp<X, R, O, 1, false, 1> tail{x, r, out, g};                                                  \
    run_flat<E, DO_U>(op, tail, n);                                                                         \
  }
#define DO_ADD_OUT(X, R, XN, RN, VEC, VS)                                                                    \
  DO_ADD(X, R, float, XN, RN, f32, VEC, VS)                                                                 \
  DO_ADD(X, R, bf16, XN, RN, bf16, VEC, VS)
#define DO_ALL(VEC, VS)                                                                                      \
  DO_UNARY(float, float, f32, f32, VEC, VS)                                                                 \
  DO_UNARY(float, bf16, f32, bf16, VEC, VS)                                                                 \
  DO_UNARY(bf16, float, bf16, f32, VEC, VS)                                                                 \
  DO_UNARY(bf16, bf16, bf16, bf16, VEC, VS)                                                                 \
  DO_ADD_OUT(float, float, f32, f32, VEC, VS)                                                               \
  DO_ADD_OUT(float, bf16, f32, bf16, VEC, VS)                                                               \
  DO_ADD_OUT(bf16, float, bf16, f32, VEC, VS)                                                               \
  DO_ADD_OUT(bf16, bf16, bf16, bf16, VEC, VS)

DO_ALL(true, v)
DO_ALL(false, s)
