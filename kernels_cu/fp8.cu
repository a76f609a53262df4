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
// - cast_t: 64 x 64 tiles, 256 threads: thread t reads 16 consecutive elements of row t / 4 (16-byte
//   loads), writes them as one 16-byte store of q and into a shared byte tile (row pitch 68 bytes), then (VEC)
//   reads 4 words down the tile (4 rows x 4 columns), transposes them with byte permutes and writes 4 bytes into
//   each of 4 rows of qt (x's columns); 2-way bank conflicts at most. Global traffic 2 + 1 + 1 B/element (bf16);
//   shared memory 4.3 KB a tile. VEC needs rows and cols multiples of 16 and 16-byte aligned pointers (every
//   16-element segment is then wholly in or out of the matrix); otherwise element accesses with bounds checks.
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/pointwise.cuh"
#include "common/fp8.cuh"

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
  static constexpr bool CODES = false;
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
  static constexpr bool CODES = false;
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

// FP8 codes already cast (fp8_transpose: the weights' FP8 shadows, written by adam.cu): the tile moves bytes.
struct CodeSrc {
  static constexpr bool CODES = true;
  const unsigned char* __restrict__ q;
  int cols;
  __device__ __forceinline__ void codes16(int r, int c, unsigned (&w)[4]) const {
    const Pack<unsigned, 4> p = load_pack<unsigned, 4>(reinterpret_cast<const unsigned*>(q + (long long)r * cols + c));
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = p.v[k];
  }
  __device__ __forceinline__ unsigned code1(int r, int c) const { return q[(long long)r * cols + c]; }
};

// ---- cast_t: q [rows, cols] (optional) and qt [cols, rows] from x [rows, cols], 64 x 64 tiles.
// The byte transpose (CodeSrc, VEC) takes two tiles a pass (t and t + gridDim.x): both tiles' loads in flight before
// either is stored, one pair of barriers for both: 48.1 -> 44.2 us at 8192 x 8192 (66 -> 72 % of the copy rate).
// The casts keep one: two cost them 76 -> 67 % (the 16 floats a tile in registers twice: fewer blocks resident).
template <int FMT, bool VEC, class Src>
__device__ __forceinline__ void cast_t_tiles(const Src& x, unsigned char* __restrict__ q,
                                             unsigned char* __restrict__ qt, int rows, int cols, float s,
                                             unsigned* amax_out, unsigned* hist) {
  constexpr int TP = VEC && Src::CODES ? 2 : 1;
  __shared__ unsigned tile[TP][64 * 17];  // 64 rows of 68 bytes (17 words) a tile
  const int tr = (rows + 63) >> 6, tc = (cols + 63) >> 6;
  const long long tiles = (long long)tr * tc;
  const int lr = threadIdx.x >> 2, seg = (threadIdx.x & 3) << 4;
  unsigned m = 0;
  for (long long t0 = blockIdx.x; t0 < tiles; t0 += (long long)gridDim.x * TP) {
    int r0[TP], c0[TP];
    bool mine[TP];  // this thread's 16 elements x[r0 + lr, c0 + seg : +16] exist
    unsigned w[TP][4];
#pragma unroll
    for (int j = 0; j < TP; ++j) {
      const long long t = t0 + (long long)j * gridDim.x;
      r0[j] = t < tiles ? (int)(t / tc) << 6 : rows;  // (a tile past the end: every check fails)
      c0[j] = t < tiles ? (int)(t % tc) << 6 : cols;
      mine[j] = r0[j] + lr < rows && c0[j] + seg < cols;
#pragma unroll
      for (int k = 0; k < 4; ++k) w[j][k] = 0u;
    }
    if constexpr (VEC) {
      float f[TP][16];
#pragma unroll
      for (int j = 0; j < TP; ++j) {
        if (mine[j]) {
          if constexpr (Src::CODES) x.codes16(r0[j] + lr, c0[j] + seg, w[j]);
          else x.load16(r0[j] + lr, c0[j] + seg, f[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < TP; ++j) {
        if (!mine[j]) continue;
        if constexpr (!Src::CODES) cast16<FMT>(f[j], s, w[j], m);
        if (q != nullptr) {
          Pack<unsigned, 4> p;
#pragma unroll
          for (int k = 0; k < 4; ++k) p.v[k] = w[j][k];
          store_pack<unsigned, 4>(reinterpret_cast<unsigned*>(q + (long long)(r0[j] + lr) * cols + c0[j] + seg), p);
        }
      }
    } else {
      const int r = r0[0] + lr, c = c0[0] + seg;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (r < rows && c + i < cols) {
          const long long o = (long long)r * cols + c + i;
          unsigned code;
          if constexpr (Src::CODES) {
            code = x.code1(r, c + i);
          } else {
            const float f = x.load1(r, c + i);
            m = max(m, abs_bits(f));
            code = cast_code<FMT>(f, s);
          }
          w[0][i >> 2] |= code << (8 * (i & 3));
          if (q != nullptr) q[o] = (unsigned char)code;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < TP; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k) tile[j][lr * 17 + (seg >> 2) + k] = w[j][k];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < TP; ++j) {
      if constexpr (VEC) {
        // qt[c0 + 4 cw + k, r0 + 4 g : +4] = column k of the 4 x 4 bytes at tile rows 4 g.. and word cw: 4 word
        // loads and 8 byte permutes a thread, where reading 16 bytes down one column took 16 byte loads (the
        // read-out bounded cast_t at 76 % of the copy rate, the plain cast runs at 94 %: NOTES, FP8). g is the
        // fast index, so a warp's stores are 2 runs of 64 bytes in two rows of qt; its loads hit each bank twice
        // (rows 4 g, 4 g + 32 share a bank under the 17-word pitch).
        const int g = threadIdx.x & 15, cw = threadIdx.x >> 4;
        const int rr = r0[j] + 4 * g, cc = c0[j] + 4 * cw;
        unsigned a[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = tile[j][(4 * g + i) * 17 + cw];
        const unsigned t0 = __byte_perm(a[0], a[1], 0x5140), t1 = __byte_perm(a[0], a[1], 0x7362);
        const unsigned t2 = __byte_perm(a[2], a[3], 0x5140), t3 = __byte_perm(a[2], a[3], 0x7362);
        const unsigned o[4] = {__byte_perm(t0, t2, 0x5410), __byte_perm(t0, t2, 0x7632),
                               __byte_perm(t1, t3, 0x5410), __byte_perm(t1, t3, 0x7632)};
        if (rr < rows) {  // rows, cols multiples of 16 (VEC): the 4 rows and 4 columns are all in or all out
#pragma unroll
          for (int k = 0; k < 4; ++k)
            if (cc + k < cols) *reinterpret_cast<unsigned*>(qt + (long long)(cc + k) * rows + rr) = o[k];
        }
      } else {
        // qt[c0 + lr, r0 + seg : +16] = tile[seg : +16][lr], byte by byte with bounds checks (any shape)
        const unsigned char* tb = reinterpret_cast<const unsigned char*>(tile[j]);
        const int cc = c0[j] + lr, rr = r0[j] + seg;
        if (cc < cols) {
#pragma unroll
          for (int i = 0; i < 16; ++i)
            if (rr + i < rows) qt[(long long)cc * rows + rr + i] = tb[(seg + i) * 68 + lr];
        }
      }
    }
    __syncthreads();  // the tiles are rewritten by the next pass
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

// ---- transpose: qt [cols, rows] = q [rows, cols]^T of FP8 codes (any format: bytes), cast_t's tiles.
#define FP8_TRANSPOSE_ENTRY(VEC, VS)                                                                          \
  CK_ENTRY(__launch_bounds__(256), fp8_transpose_##VS)(const unsigned char* q, unsigned char* qt, int rows,     \
                                                      int cols) {                                           \
    cast_t_tiles<0, VEC>(CodeSrc{q, cols}, nullptr, qt, rows, cols, 1.f, nullptr, nullptr);                   \
  }
FP8_TRANSPOSE_ENTRY(true, v)
FP8_TRANSPOSE_ENTRY(false, s)

// ---- scale: (scale, scale_inv) from an amax on the device (one thread).
CK_ENTRY(, fp8_scale)(const unsigned* amax, float fmax_m, float* scale, float* scale_inv) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const float s = fp8_scale_of(amax, nullptr, 1.f, fmax_m);
  if (scale != nullptr) *scale = s;
  if (scale_inv != nullptr) *scale_inv = __frcp_rn(s);
}
