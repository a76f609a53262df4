// FP8 casts for the FP8 GEMMs: fp32 / bf16 -> E4M3 or E5M2 with a per-tensor scale that lives on the device, the
// tensor's amax in the same pass, a transposed copy for cuBLASLt's FP8 layout, and the way back.
//
//   amax       amax = max |x|                                     (NaN if any x is NaN)
//   scale      s = fp8_max * 2^-margin / amax, min(s, 2^126);  s = 1 when amax is 0, < 2^-126, inf or NaN
//              s_inv = 1 / s                                      (what a GEMM multiplies the FP8 product by)
//   cast       q = sat(x * s) rounded to nearest even; sat clamps to +-fp8_max (inf included), NaN stays NaN:
//              bit for bit ml_dtypes' astype of numpy.clip(x * s, -max, max) (NaN -> sign | 0x7f for E4M3,
//              sign | 0x7e for E5M2, whatever the payload, as ml_dtypes gives)
//   cast_t     q as cast, and qt = q^T ([cols, rows]) from the same tile: cuBLASLt on Hopper takes FP8 operands
//              K-major only ("TN"), so the weight gradient (K = tokens) needs x^T and dy^T, the input gradient W^T
//   dequant    y = float(q) * s_inv rounded to y's dtype
//   No backward: a cast of a GEMM operand is not differentiated (the FP8 linear's backward casts dy itself).
//
// Scales. The scale s comes from (first of) an amax in device memory (amax_src: current scaling, the amax pass ran
// just before; or delayed scaling, the amax the previous cast of the same tensor left), a device scalar
// (scale_ptr), or a host number. Every thread computes s from the same bits (IEEE division: __fdiv_rn), so the
// scale is one value and the NumPy reference computes the same float32. s_inv goes to scale_inv_out (block 0,
// thread 0) for the GEMM. No host synchronisation anywhere: a captured step replays with the scales it finds.
//
// amax. |x| as the bits of a non-negative float (sign bit cleared) orders like the value, NaN above inf, so the
// reduction is an unsigned max: per thread, warp (__reduce_max_sync), block, then one atomicMax per block on the
// 32-bit word. Max is order-independent: the result is the same bits every run (deterministic without a second
// stage). The caller zeroes the word first (cudaMemsetAsync) for a fresh amax.
//
// Delayed scaling with the history on the device (hist = uint32[4]: amax used, amax running, blocks done, pad):
// the cast takes s from hist[0] and maxes |x| into hist[1]; the last block to finish (atomic ticket after a
// __threadfence, the threadFenceReduction pattern) moves hist[1] to hist[0] and clears hist[1] and the ticket.
// Every block reads hist[0] before it takes its ticket, so none sees the new value. One launch, no roll kernel.
//
// Conversion. Written out in integer arithmetic (no cuda_fp8.h: NVRTC compiles these with no include path, and
// sm_80 has no cvt to e4m3/e5m2): saturate, then round the fp32 bits to M mantissa bits, nearest-even, carrying
// into the exponent; below the smallest normal, round |v| * 2^(bias + M - 1) to an integer with cvt.rni (exact:
// a power-of-two multiply). sm_89+ runs cvt.rn.satfinite.{e4m3,e5m2}x2.f32 instead (same results; cvt_pair).
// fp32 inputs below 2^-126 count as zero (CuPy compiles with -ftz=true); the NumPy reference flushes them too.
//
// Design (numbers: H200, ~4.0 TB/s copy bandwidth):
// - Flat kernels (amax, cast, dequant): persistent grid-stride, a unit of 16 elements a thread (one 16-byte FP8
//   store; bf16: two 16-byte loads, fp32: four), 4 units in flight a thread; the n % 16 tail element by element.
//   bf16 -> e4m3 moves 3 B/element: 8192 x 8192 in ~50 us at 4 TB/s; the amax pass 2 B/element.
// - cast_t: 64 x 64 tiles, 256 threads: thread t reads 16 consecutive elements of row t / 4 (16-byte loads),
//   writes them as one 16-byte store of q and into a shared byte tile (row pitch 68: the transposed reads, 16
//   bytes down a column, see 2-way bank conflicts at most), then writes 16 consecutive bytes of qt's row t / 4
//   (x's column). Global traffic 2 + 1 + 1 B/element (bf16); shared memory 4.3 KB a block. VEC needs rows and
//   cols multiples of 16 and 16-byte aligned pointers (every 16-element segment is then wholly in or out of the
//   matrix); otherwise element accesses with bounds checks (any shape).
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/pointwise.cuh"

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

// 16 consecutive elements of T as fp32 (VEC: 16-byte loads, p 16-byte aligned), their |x| max into m.
template <typename T, bool VEC> struct Load16;
template <bool VEC> struct Load16<float, VEC> {
  __device__ __forceinline__ static void run(const float* p, float (&f)[16]) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const Pack<float, 4> r = load_pack<float, 4>(p + 4 * c);
#pragma unroll
      for (int i = 0; i < 4; ++i) f[4 * c + i] = r.v[i];
    }
  }
};
template <bool VEC> struct Load16<bf16, VEC> {
  __device__ __forceinline__ static void run(const bf16* p, float (&f)[16]) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const Pack<unsigned, 4> r = load_pack<unsigned, 4>(reinterpret_cast<const unsigned*>(p) + 4 * c);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[8 * c + 2 * i] = __uint_as_float(r.v[i] << 16);
        f[8 * c + 2 * i + 1] = __uint_as_float(r.v[i] & 0xffff0000u);
      }
    }
  }
};

// 16 values -> 16 FP8 codes in 4 words (byte i of the 16 at address +i: little-endian words), and the |v| max.
template <int FMT> __device__ __forceinline__ void cast16(const float (&f)[16], float s, unsigned (&w)[4],
                                                        unsigned& m) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int i = 0; i < 4; ++i) m = max(m, abs_bits(f[4 * k + i]));
    w[k] = cast_pair<FMT>(f[4 * k], f[4 * k + 1], s) | (cast_pair<FMT>(f[4 * k + 2], f[4 * k + 3], s) << 16);
  }
}

// ---- amax: out = max(out, max |x|) over n elements.
template <typename T, bool VEC>
__device__ __forceinline__ void amax_flat(const T* __restrict__ x, long long n, unsigned* out) {
  const long long stride = (long long)gridDim.x * blockDim.x, tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned m = 0;
  long long done = 0;
  if constexpr (VEC) {
    const long long units = n >> 4;
#pragma unroll 4
    for (long long u = tid; u < units; u += stride) {
      float f[16];
      Load16<T, true>::run(x + (u << 4), f);
#pragma unroll
      for (int i = 0; i < 16; ++i) m = max(m, abs_bits(f[i]));
    }
    done = units << 4;
  }
  for (long long i = done + tid; i < n; i += stride) m = max(m, abs_bits(x[i]));
  block_amax(m, out, nullptr);
}

// ---- cast: q = fp8(x * s) over n elements (+ amax of x into amax_out, + the history roll).
template <typename T, int FMT, bool VEC>
__device__ __forceinline__ void cast_flat(const T* __restrict__ x, unsigned char* __restrict__ q, long long n,
                                          float s, unsigned* amax_out, unsigned* hist) {
  const long long stride = (long long)gridDim.x * blockDim.x, tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned m = 0;
  long long done = 0;
  if constexpr (VEC) {
    const long long units = n >> 4;
#pragma unroll 2
    for (long long u = tid; u < units; u += stride) {
      float f[16];
      Load16<T, true>::run(x + (u << 4), f);
      Pack<unsigned, 4> w;
      unsigned ww[4];
      cast16<FMT>(f, s, ww, m);
#pragma unroll
      for (int k = 0; k < 4; ++k) w.v[k] = ww[k];
      store_pack<unsigned, 4>(reinterpret_cast<unsigned*>(q + (u << 4)), w);
    }
    done = units << 4;
  }
  for (long long i = done + tid; i < n; i += stride) {
    const float f = to_f32(x[i]);
    m = max(m, abs_bits(f));
    q[i] = (unsigned char)cast_code<FMT>(f, s);
  }
  if (amax_out != nullptr) block_amax(m, amax_out, hist);
}

// What cast_t reads: load16(r, c, f) the 16 elements x[r, c : c + 16] (VEC: 16-byte aligned), load1 one.
template <typename T> struct PlainSrc {
  const T* __restrict__ x;
  int cols;
  __device__ __forceinline__ void load16(int r, int c, float (&f)[16]) const {
    Load16<T, true>::run(x + (long long)r * cols + c, f);
  }
  __device__ __forceinline__ float load1(int r, int c) const { return to_f32(x[(long long)r * cols + c]); }
};
// h = swiglu(gu) of the packed [rows, 2F] bf16 gate | up, rounded to bf16 as ck.swiglu_packed stores it, so that
// the fused cast of h is bit for bit the cast of swiglu_packed's output (the FP8 MLP's forward, delayed scaling:
// h is never written in bf16 -- 4 of the 10 bytes an element of the unfused pair, NOTES FP8).
struct SwigluSrc {
  const bf16* __restrict__ gu;
  int F;
  __device__ __forceinline__ static float h(float g, float u) {
    return to_f32(from_f32<bf16>(silu_of(g) * u));
  }
  __device__ __forceinline__ void load16(int r, int c, float (&f)[16]) const {
    float g[16];
    const bf16* row = gu + (long long)r * 2 * F + c;
    Load16<bf16, true>::run(row, g);
    Load16<bf16, true>::run(row + F, f);
#pragma unroll
    for (int i = 0; i < 16; ++i) f[i] = h(g[i], f[i]);
  }
  __device__ __forceinline__ float load1(int r, int c) const {
    const bf16* row = gu + (long long)r * 2 * F + c;
    return h(to_f32(row[0]), to_f32(row[F]));
  }
};

// ---- cast_t: q [rows, cols] (optional) and qt [cols, rows] from x [rows, cols], 64 x 64 tiles.
template <int FMT, bool VEC, class Src>
__device__ __forceinline__ void cast_t_tiles(const Src& x, unsigned char* __restrict__ q,
                                             unsigned char* __restrict__ qt, int rows, int cols, float s,
                                             unsigned* amax_out, unsigned* hist) {
  __shared__ unsigned tile[64 * 17];  // 64 rows of 68 bytes (17 words)
  unsigned char* tb = reinterpret_cast<unsigned char*>(tile);
  const int tr = (rows + 63) >> 6, tc = (cols + 63) >> 6;
  const long long tiles = (long long)tr * tc;
  const int lr = threadIdx.x >> 2, seg = (threadIdx.x & 3) << 4;
  unsigned m = 0;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int r0 = (int)(t / tc) << 6, c0 = (int)(t % tc) << 6;
    // x[r0 + lr, c0 + seg : +16] -> codes
    const int r = r0 + lr, c = c0 + seg;
    unsigned w[4] = {0u, 0u, 0u, 0u};
    if constexpr (VEC) {
      if (r < rows && c < cols) {
        float f[16];
        x.load16(r, c, f);
        cast16<FMT>(f, s, w, m);
        if (q != nullptr) {
          Pack<unsigned, 4> p;
#pragma unroll
          for (int k = 0; k < 4; ++k) p.v[k] = w[k];
          store_pack<unsigned, 4>(reinterpret_cast<unsigned*>(q + (long long)r * cols + c), p);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (r < rows && c + i < cols) {
          const long long o = (long long)r * cols + c + i;
          const float f = x.load1(r, c + i);
          m = max(m, abs_bits(f));
          const unsigned code = cast_code<FMT>(f, s);
          w[i >> 2] |= code << (8 * (i & 3));
          if (q != nullptr) q[o] = (unsigned char)code;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) tile[lr * 17 + (seg >> 2) + k] = w[k];
    __syncthreads();
    // qt[c0 + lr, r0 + seg : +16] = tile[seg : +16][lr]
    const int cc = c0 + lr, rr = r0 + seg;
    unsigned o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      unsigned word = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) word |= (unsigned)tb[(seg + 4 * k + i) * 68 + lr] << (8 * i);
      o[k] = word;
    }
    if constexpr (VEC) {
      if (cc < cols && rr < rows) {
        Pack<unsigned, 4> p;
#pragma unroll
        for (int k = 0; k < 4; ++k) p.v[k] = o[k];
        store_pack<unsigned, 4>(reinterpret_cast<unsigned*>(qt + (long long)cc * rows + rr), p);
      }
    } else {
      if (cc < cols) {
#pragma unroll
        for (int i = 0; i < 16; ++i)
          if (rr + i < rows) qt[(long long)cc * rows + rr + i] = (unsigned char)(o[i >> 2] >> (8 * (i & 3)));
      }
    }
    __syncthreads();  // the tile is rewritten by the next iteration
  }
  if (amax_out != nullptr) block_amax(m, amax_out, hist);
}

// ---- dequant: y = fp8_to_f32(q) * s_inv.
template <int FMT, typename O, bool VEC>
__device__ __forceinline__ void dequant_flat(const unsigned char* __restrict__ q, O* __restrict__ y, long long n,
                                             float sinv) {
  const long long stride = (long long)gridDim.x * blockDim.x, tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long done = 0;
  if constexpr (VEC) {
    constexpr int PER = 16 / sizeof(O);
    const long long units = n >> 4;
#pragma unroll 2
    for (long long u = tid; u < units; u += stride) {
      const Pack<unsigned, 4> w = load_pack<unsigned, 4>(reinterpret_cast<const unsigned*>(q + (u << 4)));
      float f[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) f[i] = __fmul_rn(fp8_to_f32<FMT>((w.v[i >> 2] >> (8 * (i & 3))) & 0xffu), sinv);
#pragma unroll
      for (int c = 0; c < 16 / PER; ++c) {
        float g[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) g[i] = f[c * PER + i];
        store_pack<O, PER>(y + (u << 4) + c * PER, pack_f32<O, PER>(g));
      }
    }
    done = units << 4;
  }
  for (long long i = done + tid; i < n; i += stride) y[i] = from_f32<O>(__fmul_rn(fp8_to_f32<FMT>(q[i]), sinv));
}

// ---- entry points. SCALE_ARGS: where the scale comes from, where s_inv and the amax go (nullable pointers).
#define FP8_SCALE_ARGS                                                                                        \
  const unsigned *amax_src, const float *scale_ptr, float scale_val, float fmax_m, float *scale_inv_out,     \
      unsigned *amax_out, unsigned *hist
#define FP8_SCALE_PRELUDE                                                                                     \
  const float s = fp8_scale_of(amax_src, scale_ptr, scale_val, fmax_m);                                       \
  if (scale_inv_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv_out = __frcp_rn(s);

#define FP8_AMAX_ENTRY(T, TN, VEC, VS)                                                                        \
  CK_ENTRY(__launch_bounds__(256), fp8_amax_##TN##_##VS)(const T* x, long long n, unsigned* out) {            \
    amax_flat<T, VEC>(x, n, out);                                                                             \
  }
#define FP8_CAST_ENTRY(T, TN, FMT, FN, VEC, VS)                                                               \
  CK_ENTRY(__launch_bounds__(256), fp8_cast_##TN##_##FN##_##VS)(const T* x, unsigned char* q, long long n,    \
                                                               FP8_SCALE_ARGS) {                             \
    FP8_SCALE_PRELUDE                                                                                        \
    cast_flat<T, FMT, VEC>(x, q, n, s, amax_out, hist);                                                       \
  }                                                                                                          \
  CK_ENTRY(__launch_bounds__(256), fp8_cast_t_##TN##_##FN##_##VS)(const T* x, unsigned char* q,               \
                                                                 unsigned char* qt, int rows, int cols,      \
                                                                 FP8_SCALE_ARGS) {                           \
    FP8_SCALE_PRELUDE                                                                                        \
    cast_t_tiles<FMT, VEC>(PlainSrc<T>{x, cols}, q, qt, rows, cols, s, amax_out, hist);                       \
  }
#define FP8_DEQUANT_ENTRY(FMT, FN, O, ON, VEC, VS)                                                            \
  CK_ENTRY(__launch_bounds__(256), fp8_dequant_##FN##_##ON##_##VS)(const unsigned char* q, O* y, long long n, \
                                                                  const float* sinv_ptr, float sinv_val) {   \
    dequant_flat<FMT, O, VEC>(q, y, n, sinv_ptr != nullptr ? *sinv_ptr : sinv_val);                           \
  }
// fp8_swiglu_cast_t: q / qt of h = swiglu(gu), gu [rows, 2F] bf16 (SwigluSrc), h [rows, F].
#define FP8_SWIGLU_ENTRY(FMT, FN, VEC, VS)                                                                     \
  CK_ENTRY(__launch_bounds__(256), fp8_swiglu_cast_t_bf16_##FN##_##VS)(const bf16* gu, unsigned char* q,        \
                                                                      unsigned char* qt, int rows, int F,    \
                                                                      FP8_SCALE_ARGS) {                      \
    FP8_SCALE_PRELUDE                                                                                        \
    cast_t_tiles<FMT, VEC>(SwigluSrc{gu, F}, q, qt, rows, F, s, amax_out, hist);                              \
  }
#define FP8_ALL(VEC, VS)                                                                                      \
  FP8_AMAX_ENTRY(float, f32, VEC, VS)                                                                         \
  FP8_AMAX_ENTRY(bf16, bf16, VEC, VS)                                                                         \
  FP8_CAST_ENTRY(float, f32, 0, e4m3, VEC, VS)                                                                \
  FP8_CAST_ENTRY(float, f32, 1, e5m2, VEC, VS)                                                                \
  FP8_CAST_ENTRY(bf16, bf16, 0, e4m3, VEC, VS)                                                                \
  FP8_CAST_ENTRY(bf16, bf16, 1, e5m2, VEC, VS)                                                                \
  FP8_DEQUANT_ENTRY(0, e4m3, float, f32, VEC, VS)                                                             \
  FP8_DEQUANT_ENTRY(0, e4m3, bf16, bf16, VEC, VS)                                                             \
  FP8_DEQUANT_ENTRY(1, e5m2, float, f32, VEC, VS)                                                             \
  FP8_DEQUANT_ENTRY(1, e5m2, bf16, bf16, VEC, VS)                                                             \
  FP8_SWIGLU_ENTRY(0, e4m3, VEC, VS)                                                                          \
  FP8_SWIGLU_ENTRY(1, e5m2, VEC, VS)

FP8_ALL(true, v)
FP8_ALL(false, s)

// ---- scale: (scale, scale_inv) from an amax on the device (one thread).
CK_ENTRY(, fp8_scale)(const unsigned* amax, float fmax_m, float* scale, float* scale_inv) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const float s = fp8_scale_of(amax, nullptr, 1.f, fmax_m);
  if (scale != nullptr) *scale = s;
  if (scale_inv != nullptr) *scale_inv = __frcp_rn(s);
}
