// Pointwise building blocks shared by activations.cu and elementwise.cu (rope.cu uses Chunk only).
//
// Chunk<T, E, VEC>: E consecutive elements of T kept as raw storage in registers (8 bf16 in 4 registers),
// moved with 16-byte accesses when VEC (E * sizeof(T) is then a multiple of 16 and the launcher has checked
// that every pointer is 16-byte aligned), element accesses otherwise.
//
// run_rows<E, U>(op, tail, rows, F): the grid-stride loop every pointwise kernel uses. The work is `rows` rows
// of F elements, cut into units of E elements (E divides F when rows > 1: the launcher guarantees it). Unit j
// is (row r = j / (F/E), column c = (j mod F/E) * E); the op turns (r, c) into addresses with its own row
// strides, which is how one kernel serves a flat array (rows = 1), the packed [.., 2F] SwiGLU layout (gate
// and up rows 2F apart) and a bias broadcast along the last axis (row stride 0). Each thread loads U units
// (U * E elements per operand) before it computes and stores any of them, so U independent 16-byte loads per
// operand are in flight even though nothing is __restrict__ (out may alias an input: each element is read
// and written by the same thread). With rows == 1 and F % E != 0, the last F % E elements are done one by
// one by the first threads of block 0 (`tail`, the same op with E = 1).
#pragma once
#include "vec.cuh"

template <typename T, int E, bool VEC>
struct Chunk {
  static constexpr int PER = (VEC && (E * sizeof(T)) % 16 == 0) ? int(16 / sizeof(T)) : 1;
  Pack<T, PER> p[E / PER];

  __device__ __forceinline__ void load(const T* s) {
#pragma unroll
    for (int c = 0; c < E / PER; ++c) p[c] = load_pack<T, PER>(s + c * PER);
  }
  __device__ __forceinline__ void store(T* d) const {
#pragma unroll
    for (int c = 0; c < E / PER; ++c) store_pack<T, PER>(d + c * PER, p[c]);
  }
  __device__ __forceinline__ float get(int i) const { return to_f32(p[i / PER].v[i % PER]); }
  __device__ __forceinline__ void set(int i, float f) { p[i / PER].v[i % PER] = from_f32<T>(f); }
};

// Row of unit j. rows == 1 needs no division; otherwise a 32-bit division when every unit index fits in
// 32 bits (~20 instructions instead of the ~70 of a 64-bit one; both are branches uniform over the grid).
__device__ __forceinline__ long long unit_row(long long j, long long Fu, bool one_row, bool small) {
  if (one_row) return 0;
  if (small) return (long long)((unsigned int)j / (unsigned int)Fu);
  return j / Fu;
}

template <int E, int U, class Op, class Tail>
__device__ __forceinline__ void run_rows(Op& op, Tail& tail, long long rows, long long F) {
  const long long Fu = F / E, n = rows * Fu;
  const bool one_row = rows == 1, small = n <= 0xffffffffLL;
  const long long step = (long long)gridDim.x * blockDim.x * U;
  for (long long base = (long long)blockIdx.x * blockDim.x * U + threadIdx.x; base < n; base += step) {
    long long r[U], c[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const long long j = base + (long long)k * blockDim.x;
      if (j < n) {
        r[k] = unit_row(j, Fu, one_row, small);
        c[k] = (j - r[k] * Fu) * E;
        op.load(k, r[k], c[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (base + (long long)k * blockDim.x < n) op.store(k, r[k], c[k]);
  }
  if (one_row && blockIdx.x == 0) {
    const long long c = Fu * E + threadIdx.x;  // fewer than E < blockDim.x elements are left
    if (c < F) {
      tail.load(0, 0, c);
      tail.store(0, 0, c);
    }
  }
}

// sigmoid(z) = 1 / (1 + e^-z) and 1 - sigmoid(z) = e^-z * sigmoid(z), both without cancellation and without
// NaN for any finite z: e^-z overflows to +inf for z < -88, giving s = 0 and (1 - s) = 1 exactly.
__device__ __forceinline__ void sigmoid2(float z, float& s, float& oms) {
  const float e = __expf(-z);
  s = 1.f / (1.f + e);
  oms = e < CK_INF ? e * s : 1.f;
}
