// Shared device helpers: our own bf16 storage type, 16-byte vector packs, warp/block reductions.
//
// Why no <cuda_bf16.h>: the kernels are compiled by NVRTC with no include path at all, both by CuPy on the
// GPU machine (CUDA 12 or 13) and by the CPU-only compile test (pip's NVRTC, no toolkit headers). A 2-byte
// struct plus two conversion instructions (sm_80+: cvt.rn.bf16.f32) is all the kernels need: every kernel
// loads bf16, computes in fp32 and rounds once on the store (round-to-nearest-even, NaN stays NaN), which is
// bit-for-bit what ml_dtypes does on the NumPy reference path.
#pragma once

// NVRTC without headers has no INFINITY macro.
#define CK_INF __int_as_float(0x7f800000)

struct __align__(2) bf16 { unsigned short bits; };

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __uint_as_float(((unsigned int)v.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float v) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
  return r;
}

// A pack of N elements of T moved as one access: 16 bytes (LDG.128/STG.128) when N * sizeof(T) == 16.
// Kernels keep packs of raw storage in registers (8 bf16 in 4 registers, not 8) and convert on use.
template <typename T, int N> struct __align__(sizeof(T) * N) Pack { T v[N]; };

template <typename T, int N> __device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}
template <typename T, int N> __device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// A pack to fp32 and back in the fewest instructions (issue 17, session 8: ncu counted ~37 instructions an element
// in the bf16 norm backwards, many of them to_f32 / from_f32 on single elements; with these and the other
// session 8 changes 32 an element, though the kernel time did not move: it was not issue-bound). bf16 pairs
// are read as 32-bit words: the low element is the word shifted left 16, the high one the word masked (one
// instruction each, where a per-element to_f32 costs a byte permute and a shift), and stored with one
// cvt.rn.bf16x2.f32 a pair (the same round-to-nearest-even as from_f32<bf16>, bit for bit).
template <typename T, int E> __device__ __forceinline__ void unpack_f32(const Pack<T, E>& p, float (&f)[E]) {
  if constexpr (sizeof(T) == 2 && E % 2 == 0) {
    const unsigned* w = reinterpret_cast<const unsigned*>(&p);
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = to_f32(p.v[i]);
  }
}
template <typename T, int E> __device__ __forceinline__ Pack<T, E> pack_f32(const float (&f)[E]) {
  Pack<T, E> p;
  if constexpr (sizeof(T) == 2 && E % 2 == 0) {
    unsigned* w = reinterpret_cast<unsigned*>(&p);
#pragma unroll
    for (int i = 0; i < E / 2; ++i)
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));
  } else {
#pragma unroll
    for (int i = 0; i < E; ++i) p.v[i] = from_f32<T>(f[i]);
  }
  return p;
}

// Load N consecutive elements of T (a different dtype from the activation's, e.g. an fp32 weight beside bf16
// x) as fp32. Uses 16-byte accesses when N * sizeof(T) is a multiple of 16 and `vec` says p is aligned;
// element loads otherwise.
template <int N, typename T> __device__ __forceinline__ void load_f32(const T* p, float (&f)[N], bool vec) {
  constexpr int PER = 16 / sizeof(T);
  if constexpr (N * sizeof(T) % 16 == 0) {
    if (vec) {
#pragma unroll
      for (int c = 0; c < N / PER; ++c) {
        Pack<T, PER> r = load_pack<T, PER>(p + c * PER);
#pragma unroll
        for (int i = 0; i < PER; ++i) f[c * PER + i] = to_f32(r.v[i]);
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = to_f32(p[i]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the threadIdx.x extent of a (blockDim.x, blockDim.y) block: each row of threads (same threadIdx.y)
// gets its own sum. `scratch` holds 32 floats per threadIdx.y. Every thread returns the row's total.
// blockDim.x is a multiple of 32.
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (blockDim.x <= 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float* s = scratch + threadIdx.y * 32;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) s[warp] = v;
  __syncthreads();
  v = lane < nwarps ? s[lane] : 0.f;
  return warp_sum(v);
}
__device__ __forceinline__ float row_max(float v, float* scratch) {
  v = warp_max(v);
  if (blockDim.x <= 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float* s = scratch + threadIdx.y * 32;
  __syncthreads();
  if (lane == 0) s[warp] = v;
  __syncthreads();
  v = lane < nwarps ? s[lane] : -CK_INF;
  return warp_max(v);
}

// Two-stage column reductions (dweight, dgamma, dbeta): writes `acc` (this thread's columns: packs k at
// threadIdx.x + k * blockDim.x, E elements each) into the block's fp32 partial row `part`, summing the block's
// blockDim.y row groups in threadIdx.y order through shared memory (`combine`: 256 * E floats; blockDim.y > 1
// only when blockDim.x * blockDim.y == 256). Every thread of the block calls it. Deterministic.
template <int VPT, int E>
__device__ __forceinline__ void write_block_partial(const float (&acc)[VPT][E], float* __restrict__ part, int units,
                                                 float* combine) {
  if (blockDim.y == 1) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int u = threadIdx.x + k * blockDim.x;
      if (u < units)
#pragma unroll
        for (int i = 0; i < E; ++i) part[u * E + i] = acc[k][i];
    }
    return;
  }
  // blockDim.y > 1 only when blockDim.x * blockDim.y == 256: combine holds 256 * E floats.
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    __syncthreads();
#pragma unroll
    for (int i = 0; i < E; ++i) combine[tid * E + i] = acc[k][i];
    __syncthreads();
    const int u = threadIdx.x + k * blockDim.x;
    if (threadIdx.y == 0 && u < units) {
#pragma unroll
      for (int i = 0; i < E; ++i) {
        float s = 0.f;
        for (int j = 0; j < (int)blockDim.y; ++j) s += combine[(j * blockDim.x + threadIdx.x) * E + i];
        part[u * E + i] = s;
      }
    }
  }
}

// Second stage of the two-stage column reductions: out[c] = sum_p part[p * C + c], p in order. Block (32, 16):
// a warp reads 32 consecutive columns of one partial row (128 B, coalesced); the 16 warps split the partial
// rows and are combined through shared memory in a fixed order (deterministic). Grid: ceil(C / 32) blocks.
template <typename W>
__device__ __forceinline__ void column_sums(const float* __restrict__ part, W* __restrict__ out, int nparts,
                                            int C) {
  __shared__ float s[16][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (c < C)
    for (int p = threadIdx.y; p < nparts; p += 16) acc += part[(long long)p * C + c];
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) t += s[j][threadIdx.x];
    out[c] = from_f32<W>(t);
  }
}

