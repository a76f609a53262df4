// Pointwise building blocks shared by activations.cu and elementwise.cu (rope.cu uses Chunk only).
//
// Chunk<T, E, VEC>: E consecutive elements of T kept as raw storage in registers (8 bf16 in 4 registers),
// moved with 16-byte accesses when VEC (E * sizeof(T) is then a multiple of 16 and the launcher has checked
// that every pointer is 16-byte aligned), element accesses otherwise. get(i) widens element i to fp32;
// pack(f) rounds E fp32 values into the chunk (pack_exact: ml_dtypes' NaN pattern too, for ck.cast).
//
// run_flat<E, U>(op, tail, n) and run_rows<E, U>(op, rows, F): the grid-stride loops every pointwise kernel
// uses. The work is cut into units of E elements; unit j is (row r, column c) and the op turns (r, c) into
// addresses with its own row strides, which is how one op serves a flat array (run_flat: r = 0), the packed
// [.., 2F] SwiGLU layout (gate and up rows 2F apart) and a bias broadcast along the last axis (row stride 0).
// Each thread loads U units (U * E elements per operand) before it computes and stores any of them, so U
// independent 16-byte loads per operand are in flight even though nothing is __restrict__ (out may alias an
// input: each element is read and written by the same thread).
#pragma once
#include "vec.cuh"

// fp32 -> T with ml_dtypes' exact rounding (integer round-to-nearest-even; NaN -> quiet NaN 0x7fc0 | sign).
// For non-NaN values this equals from_f32 (cvt.rn); only the NaN bit pattern can differ.
__device__ __forceinline__ unsigned int bf16_bits_exact(float v) {
  const unsigned int u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) & 0x8000u) | 0x7fc0u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
template <typename T> __device__ __forceinline__ T round_exact(float v);
template <> __device__ __forceinline__ float round_exact<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 round_exact<bf16>(float v) {
  bf16 r;
  r.bits = (unsigned short)bf16_bits_exact(v);
  return r;
}

// Element accesses: any alignment (VEC = false, or a size that is no multiple of 16 bytes).
template <typename T, int E, bool VEC>
struct Chunk {
  T v[E];
  __device__ __forceinline__ void load(const T* s) {
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] = s[i];
  }
  __device__ __forceinline__ void store(T* d) const {
#pragma unroll
    for (int i = 0; i < E; ++i) d[i] = v[i];
  }
  __device__ __forceinline__ float get(int i) const { return to_f32(v[i]); }
  __device__ __forceinline__ void pack(const float (&f)[E]) {
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] = from_f32<T>(f[i]);
  }
  __device__ __forceinline__ void pack_exact(const float (&f)[E]) {
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] = round_exact<T>(f[i]);
  }
};

// bf16, 16-byte accesses. Kept as 32-bit words holding two bf16 each (a 16-bit value would take a whole
// register: twice the registers, half the occupancy); get() widens with one shift or mask, pack() rounds a
// pair with one cvt.rn.bf16x2.f32 (sm_80+; same round-to-nearest-even as cvt.rn.bf16.f32).
template <int E>
struct Chunk<bf16, E, true> {
  static_assert(E % 8 == 0, "16-byte bf16 chunks hold multiples of 8 elements");
  Pack<unsigned int, 4> w[E / 8];
  __device__ __forceinline__ void load(const bf16* s) {
#pragma unroll
    for (int c = 0; c < E / 8; ++c) w[c] = load_pack<unsigned int, 4>(reinterpret_cast<const unsigned int*>(s) + 4 * c);
  }
  __device__ __forceinline__ void store(bf16* d) const {
#pragma unroll
    for (int c = 0; c < E / 8; ++c) store_pack<unsigned int, 4>(reinterpret_cast<unsigned int*>(d) + 4 * c, w[c]);
  }
  __device__ __forceinline__ float get(int i) const {
    const unsigned int x = w[i / 8].v[(i % 8) / 2];
    return __uint_as_float((i & 1) ? (x & 0xffff0000u) : (x << 16));
  }
  __device__ __forceinline__ void pack(const float (&f)[E]) {
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {
      unsigned int x;
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(x) : "f"(f[2 * i + 1]), "f"(f[2 * i]));  // (hi, lo)
      w[i / 4].v[i % 4] = x;
    }
  }
  __device__ __forceinline__ void pack_exact(const float (&f)[E]) {
#pragma unroll
    for (int i = 0; i < E / 2; ++i) w[i / 4].v[i % 4] = bf16_bits_exact(f[2 * i]) | (bf16_bits_exact(f[2 * i + 1]) << 16);
  }
};

// fp32, 16-byte accesses.
template <int E>
struct Chunk<float, E, true> {
  static_assert(E % 4 == 0, "16-byte fp32 chunks hold multiples of 4 elements");
  Pack<float, 4> p[E / 4];
  __device__ __forceinline__ void load(const float* s) {
#pragma unroll
    for (int c = 0; c < E / 4; ++c) p[c] = load_pack<float, 4>(s + 4 * c);
  }
  __device__ __forceinline__ void store(float* d) const {
#pragma unroll
    for (int c = 0; c < E / 4; ++c) store_pack<float, 4>(d + 4 * c, p[c]);
  }
  __device__ __forceinline__ float get(int i) const { return p[i / 4].v[i % 4]; }
  __device__ __forceinline__ void pack(const float (&f)[E]) {
#pragma unroll
    for (int i = 0; i < E; ++i) p[i / 4].v[i % 4] = f[i];
  }
  __device__ __forceinline__ void pack_exact(const float (&f)[E]) { pack(f); }
};

// Flat arrays: n elements in units of E (any n: the last n % E elements are done one by one by the first
// threads of block 0 with `tail`, the same op with E = 1). No division anywhere; offsets are 64-bit.
template <int E, int U, class Op, class Tail>
__device__ __forceinline__ void run_flat(Op& op, Tail& tail, long long n) {
  const long long nu = n / E;
  const long long step = (long long)gridDim.x * blockDim.x * U;
  for (long long base = (long long)blockIdx.x * blockDim.x * U + threadIdx.x; base < nu; base += step) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const long long j = base + (long long)k * blockDim.x;
      if (j < nu) op.load(k, 0, j * E);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const long long j = base + (long long)k * blockDim.x;
      if (j < nu) op.store(k, 0, j * E);
    }
  }
  if (blockIdx.x == 0) {
    const long long c = nu * E + threadIdx.x;  // fewer than E <= blockDim.x elements are left
    if (c < n) {
      tail.load(0, 0, c);
      tail.store(0, 0, c);
    }
  }
}

// rows x F elements, E | F, rows * (F / E) < 2^32 (the launcher splits bigger launches into row chunks), so
// the row of unit j is one 32-bit division.
template <int E, int U, class Op>
__device__ __forceinline__ void run_rows(Op& op, unsigned int rows, unsigned int F) {
  const unsigned int Fu = F / E, n = rows * Fu;
  const unsigned int step = gridDim.x * blockDim.x * U;
  for (unsigned int base = blockIdx.x * blockDim.x * U + threadIdx.x; base < n; base += step) {
    unsigned int r[U], c[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const unsigned int j = base + k * blockDim.x;
      if (j < n) {
        r[k] = j / Fu;
        c[k] = (j - r[k] * Fu) * E;
        op.load(k, r[k], c[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (base + k * blockDim.x < n) op.store(k, r[k], c[k]);
    if (step > 0xffffffffu - base) break;  // base + step would wrap around
  }
}

// sigmoid(z) = 1 / (1 + e^-z) and 1 - sigmoid(z) = e^-z * sigmoid(z), both without cancellation and without
// NaN for any finite z: e^-z overflows to +inf for z < -88, giving s = 0 and (1 - s) = 1 exactly.
__device__ __forceinline__ void sigmoid2(float z, float& s, float& oms) {
  const float e = __expf(-z);
  // Fast reciprocal (MUFU.RCP + one multiply, <= 2 ulp): the IEEE division's refinement and slow-path check
  // made GELU forward issue-bound (2.9 TB/s bf16, slower than PyTorch, run 4 in benchmarks/NOTES.md).
  // e = inf gives 1 / inf = 0, as needed.
  s = __fdividef(1.f, 1.f + e);
  oms = e < CK_INF ? e * s : 1.f;
}

// silu(g) = g * sigmoid(g): SwiGLU's gate (activations.cu; fp8.cu's fused SwiGLU cast: the same bits).
__device__ __forceinline__ float silu_of(float g) {
  float s, oms;
  sigmoid2(g, s, oms);
  return g * s;
}
