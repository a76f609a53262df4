// FP8 conversion and scaling helpers shared by the kernels that write FP8 (fp8.cu: the casts; adam.cu: the FP8
// shadow of a weight written in the update's pass; activations.cu: the producers' amax). The formats, the
// rounding, the scale rule and the amax reduction are described at the top of fp8.cu; keeping them in one place
// is what makes every writer's codes the same bits as the ml_dtypes reference.
#pragma once
#include "common/vec.cuh"

#define FP8_FLT_MIN 1.17549435e-38f
#define FP8_FLT_MAX 3.40282347e+38f
// The largest scale: 2^126, so that scale_inv = 1 / scale stays a normal float (the kernels flush subnormals: a
// 1 / FLT_MAX of 2.9e-39 read back as 0 on the H200, an all-zero dequantised product).
#define FP8_SCALE_MAX 8.50705917e+37f

// FMT 0: E4M3 "fn" (bias 7, no inf, S.1111.111 is NaN, max 448 = 0x7e); FMT 1: E5M2 (bias 15, inf 0x7c, max
// 57344 = 0x7b). MAX_BITS: the fp32 bits of the largest finite value.
template <int FMT> struct Fp8Fmt;
template <> struct Fp8Fmt<0> {
  static constexpr int M = 3, BIAS = 7;
  static constexpr unsigned MAX_CODE = 0x7eu, NAN_CODE = 0x7fu, MAX_BITS = 0x43e00000u;
  static constexpr bool HAS_INF = false;
};
template <> struct Fp8Fmt<1> {
  static constexpr int M = 2, BIAS = 15;
  static constexpr unsigned MAX_CODE = 0x7bu, NAN_CODE = 0x7eu, MAX_BITS = 0x47600000u;
  static constexpr bool HAS_INF = true;
};

// fp32 -> FP8 code (low 8 bits), saturating to +-max, round to nearest even.
template <int FMT> __device__ __forceinline__ unsigned f32_to_fp8(float v) {
  using F = Fp8Fmt<FMT>;
  const unsigned u = __float_as_uint(v), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | F::NAN_CODE;
  if (a >= F::MAX_BITS) return sign | F::MAX_CODE;  // beyond max, inf included: saturate
  constexpr unsigned MIN_NORMAL = (unsigned)(127 + 1 - F::BIAS) << 23;
  if (a < MIN_NORMAL) {  // an FP8 subnormal or zero: |v| in units of the smallest subnormal, 2^(1 - BIAS - M)
    const float units = __uint_as_float(a) * __uint_as_float((unsigned)(127 + F::BIAS + F::M - 1) << 23);
    return sign | (unsigned)__float2int_rn(units);  // 2^M (a carry) is the smallest normal's code, as wanted
  }
  constexpr int SH = 23 - F::M;
  const unsigned r = (a + ((1u << (SH - 1)) - 1u) + ((a >> SH) & 1u)) >> SH;  // nearest even, carry included
  return sign | (r - ((unsigned)(127 - F::BIAS) << F::M));
}

// sm_89+ converts two fp32 to two FP8 codes in one instruction, saturating and nearest-even as f32_to_fp8 does
// (inf -> +-max: .satfinite), low byte from lo. The integer code above costs ~20 instructions an element and held
// the casts to 2.4 TB/s, 56 % of the H200's copy rate (benchmarks/NOTES.md, FP8); NaN inputs never reach it (the
// callers take the integer path for them: the hardware's NaN code drops the sign, ml_dtypes' keeps it).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FP8_HW_CVT 1
template <int FMT> __device__ __forceinline__ unsigned cvt_pair(float lo, float hi) {
  unsigned short d;
  if constexpr (FMT == 0) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  else asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}
#endif

// The cast of one element: fp8(x * s). A NaN x keeps its sign (the GPU's multiply would return the canonical NaN,
// sign cleared, where NumPy's -- and so the reference's -- keeps the operand's).
template <int FMT> __device__ __forceinline__ unsigned cast_code(float x, float s) {
  const unsigned u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 24) & 0x80u) | Fp8Fmt<FMT>::NAN_CODE;
#ifdef FP8_HW_CVT
  return cvt_pair<FMT>(__fmul_rn(x, s), 0.f) & 0xffu;
#else
  return f32_to_fp8<FMT>(__fmul_rn(x, s));
#endif
}

// Two elements -> two codes (a in the low byte); one instruction on sm_89+ unless one is NaN.
template <int FMT> __device__ __forceinline__ unsigned cast_pair(float a, float b, float s) {
#ifdef FP8_HW_CVT
  if ((__float_as_uint(a) & 0x7fffffffu) <= 0x7f800000u && (__float_as_uint(b) & 0x7fffffffu) <= 0x7f800000u)
    return cvt_pair<FMT>(__fmul_rn(a, s), __fmul_rn(b, s));
#endif
  return cast_code<FMT>(a, s) | (cast_code<FMT>(b, s) << 8);
}

// FP8 code -> fp32 (exact; NaN -> sign | 0x7fc00000).
template <int FMT> __device__ __forceinline__ float fp8_to_f32(unsigned c) {
  using F = Fp8Fmt<FMT>;
  constexpr unsigned EMAX = (1u << (7 - F::M)) - 1u;
  const unsigned sign = (c & 0x80u) << 24, mag = c & 0x7fu, e = mag >> F::M, m = mag & ((1u << F::M) - 1u);
  if (F::HAS_INF ? e == EMAX : mag == 0x7fu) return __uint_as_float(sign | ((F::HAS_INF && m == 0) ? 0x7f800000u : 0x7fc00000u));
  if (e == 0) {
    const float v = (float)m * __uint_as_float((unsigned)(127 + 1 - F::BIAS - F::M) << 23);
    return __uint_as_float(sign | __float_as_uint(v));
  }
  return __uint_as_float(sign | ((e + 127u - F::BIAS) << 23) | (m << (23 - F::M)));
}

// |x| as ordered bits (see the header).
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }
__device__ __forceinline__ unsigned abs_bits(bf16 v) { return ((unsigned)v.bits & 0x7fffu) << 16; }

// The cast's scale (see the header): amax_src wins, then scale_ptr, then scale_val.
__device__ __forceinline__ float fp8_scale_of(const unsigned* amax_src, const float* scale_ptr, float scale_val,
                                              float fmax_m) {
  if (amax_src != nullptr) {
    const float a = __uint_as_float(*amax_src);
    if (!(a >= FP8_FLT_MIN) || a > FP8_FLT_MAX) return 1.f;  // 0, subnormal, NaN, inf: no information
    const float s = __fdiv_rn(fmax_m, a);
    return s < FP8_SCALE_MAX ? s : FP8_SCALE_MAX;
  }
  return scale_ptr != nullptr ? *scale_ptr : scale_val;
}

// Block max of m into *out (one atomicMax a block); every thread of the block calls it. Then, with a history
// word (delayed scaling), the last block rolls it.
__device__ __forceinline__ void block_amax(unsigned m, unsigned* out, unsigned* hist) {
  __shared__ unsigned s[32];
  __shared__ bool last;
  m = __reduce_max_sync(0xffffffffu, m);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) s[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < (int)((blockDim.x + 31) >> 5) ? s[lane] : 0u;
    m = __reduce_max_sync(0xffffffffu, m);
    if (lane == 0) {
      if (m) atomicMax(out, m);
      if (hist != nullptr) {
        __threadfence();
        last = atomicAdd(&hist[2], 1u) == gridDim.x - 1;
      }
    }
  }
  if (hist == nullptr) return;
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();
    const unsigned a = atomicExch(&hist[1], 0u);
    atomicExch(&hist[0], a);
    atomicExch(&hist[2], 0u);
  }
}
