// Row reductions for kernels that give each row TPR = blockDim.x threads (a power of two, 1 .. 1024) and stack
// RPB = blockDim.y rows per block (used by layer_norm.cu and softmax.cu).
//
// Why not vec.cuh's row_sum: it needs blockDim.x >= 32. Short rows (C <= ~64 elements) run best with 1..16
// threads per row and several rows per warp; the shuffles below only cross lanes of the same row (xor offsets
// < blockDim.x stay inside an aligned group of blockDim.x lanes).
//
// Contract: EVERY thread of the block calls these the same number of times (the kernels loop over groups of
// rows with a block-uniform trip count and mask rows past the end), because the shuffles use the full mask
// and the cross-warp step uses __syncthreads. blockDim.x * blockDim.y is a multiple of 32. When
// blockDim.x > 32 it is a multiple of 32 and blockDim.y <= 16 (<= 1024 threads), so `scratch` needs 16 * 32
// entries.
//
// Butterfly (xor) reductions with commutative combines give every lane of a row the bit-identical result,
// and the fixed shape makes the result identical from run to run.
#pragma once

struct CkSum {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct CkMax {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <class Op>
__device__ __forceinline__ float seg_reduce(float v, float* scratch, float ident, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    if (o < (int)blockDim.x) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (blockDim.x <= 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float* s = scratch + threadIdx.y * 32;
  __syncthreads();  // scratch may still be read by the previous call
  if (lane == 0) s[warp] = v;
  __syncthreads();
  v = lane < nwarps ? s[lane] : ident;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float seg_sum(float v, float* scratch) { return seg_reduce(v, scratch, 0.f, CkSum()); }
__device__ __forceinline__ float seg_max(float v, float* scratch) {
  return seg_reduce(v, scratch, -__int_as_float(0x7f800000), CkMax());
}

// Two sums at once (one set of barriers instead of two). scratch: 16 * 32 float2.
__device__ __forceinline__ void seg_sum2(float& a, float& b, float2* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    if (o < (int)blockDim.x) {
      a += __shfl_xor_sync(0xffffffffu, a, o);
      b += __shfl_xor_sync(0xffffffffu, b, o);
    }
  if (blockDim.x <= 32) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float2* s = scratch + threadIdx.y * 32;
  __syncthreads();
  if (lane == 0) s[warp] = make_float2(a, b);
  __syncthreads();
  const float2 t = lane < nwarps ? s[lane] : make_float2(0.f, 0.f);
  a = t.x;
  b = t.y;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
}
