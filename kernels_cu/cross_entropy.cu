// Softmax cross-entropy over rows of logits [N, V], with ignore_index and label smoothing eps.
//
//   forward   lse_i  = log sum_j exp(x_ij)                                  (fp32, saved for backward)
//             loss_i = (1 - eps) (lse_i - x_i,t) + eps (lse_i - sum_j x_ij / V)     for a valid target t
//             loss_i = 0                      for an ignored row (t == ignore_index) or an invalid target
//             mean = sum_i loss_i / count(valid rows) (0 when no row is valid), sum = sum_i loss_i
//   backward  dx_ij = g_i (exp(x_ij - lse_i) - eps / V - (1 - eps) [j == t_i]),  0 on ignored rows
//             g_i = dloss (sum), dloss / count (mean), dloss_i (none)
//
// A target outside [0, V) that is not ignore_index is an error: the row is treated as ignored (no read at the
// target, nothing counted) and 1 is ORed into a device error word; nothing is read back to the host.
//
// Design (numbers for 4096 x 128256 bf16 on an H200: 1.05 GB of logits, copy ceiling ~4.2 TB/s):
// - One block per row (grid-stride over rows, one wave of blocks), up to 1024 threads striding over the
//   vocabulary, so any V works (>= 256k). A row is split into a scalar head (up to the first 16-byte boundary),
//   a body of 16-byte packs (4 packs in flight per thread) and a scalar tail: every row gets 16-byte loads
//   whatever V is (50257 or 128256) and whatever the row's alignment. With two pointers (logits and dlogits)
//   the body is used when both have the same address mod 16 (always for in-place), else element accesses.
// - Row strides (ldx for the logits, ldo for dx, in elements, by value): row r is x + r * ldx, so the logits may
//   be the first V columns of a wider buffer (GPT-2's [N, 50257] logits inside rows of 50304, which keeps
//   the LM-head GEMMs on cuBLAS' 16-byte-aligned kernels). Only columns [0, V) of a row are read or written.
//   The head / body / tail split is per row, from the row's own address: with ld * sizeof(T) a multiple of 16
//   every row starts aligned (head 0, V / E packs, a V % E tail), whatever V is. Two pointers share the split
//   when every row pair is congruent mod 16: x = o (mod 16) and (ldx - ldo) * sizeof(T) = 0 (mod 16).
// - Forward: one pass with an online max / sum-of-exp per thread (rescale only when a pack raises the
//   max; exp2 with a pre-scaled argument), plus sum_j x_ij for label smoothing, then one block reduction of
//   (max, sum, sum_x). Reads the row once: N V s bytes.
// - Fused forward + backward (llm.c's fused classifier): pass 1 as the forward, pass 2 re-reads the row
//   (256 KB for 128256 bf16; with one 1024-thread block per SM ~132 rows = 33 MB are in flight, so the
//   re-read comes mostly from the 50+ MB L2) and writes dx, possibly over the logits (out = logits): each
//   thread reads a pack before it writes the same pack, and x_t is read before the block reduction's barrier.
//   HBM traffic ~ 2 N V s = 2.1 GB -> ~0.5 ms at 4.2 TB/s (target 0.9 ms). Pass 2 loads and stores evict-first
//   (`hint`): the dx lines written back would otherwise push waiting rows out of L2 (session 15: 0.810 ->
//   0.727 ms at 4096 x 128256; by estimate, not measured, what remains is ~10 us of exp2 a row beside ~16 us of
//   memory, in series within a block). For mean, the divisor is needed
//   before writing: ce_count (a one-block kernel) counts the valid targets into a device int first.
// - FP8 dlogits (ce_fused_q8_*, for ck.linear_cross_entropy's grad_fp8): the fused kernel writes pass 2 as FP8 codes
//   into rows of their own, scaled by a power of two from the bound |dx| <= |g| (no amax pass): see row_grad_q8.
// - Reductions are deterministic: the per-row loss goes to a fp32 buffer and ce_reduce (one block) sums it in
//   a fixed order; no float atomics anywhere.
// - Logits of magnitude 1e4: everything is relative to the running max, so exp never overflows; lse and
//   the losses stay finite.
#include "common/entry.cuh"
#include "common/fp8.cuh"
#include "common/vec.cuh"

#define CE_ERR_TARGET 1
#define CE_LOG2E 1.4426950408889634f
#define CE_LN2 0.6931471805599453f
#define CE_LOWEST (-3.402823466e38f)  // finite "-inf": exp2((x - lowest) ...) never makes inf - inf = NaN

// Online (max, sum of exp) state of a thread, plus the plain sum of x.
struct Lse {
  float m, s, sx;
};

__device__ __forceinline__ void lse_add(Lse& a, float x) {
  if (x > a.m) {
    a.s = a.s * exp2f((a.m - x) * CE_LOG2E) + 1.f;
    a.m = x;
  } else {
    a.s += exp2f((x - a.m) * CE_LOG2E);
  }
  a.sx += x;
}

template <int E>
__device__ __forceinline__ void lse_add_pack(Lse& a, const float (&x)[E]) {
  float pm = x[0];
#pragma unroll
  for (int i = 1; i < E; ++i) pm = fmaxf(pm, x[i]);
  if (pm > a.m) {
    a.s *= exp2f((a.m - pm) * CE_LOG2E);
    a.m = pm;
  }
#pragma unroll
  for (int i = 0; i < E; ++i) {
    a.s += exp2f((x[i] - a.m) * CE_LOG2E);  // x - m first: exact near the max even at |x| ~ 1e4
    a.sx += x[i];
  }
}

__device__ __forceinline__ Lse lse_combine(const Lse& a, const Lse& b) {
  Lse r;
  r.m = fmaxf(a.m, b.m);
  r.s = a.s * exp2f((a.m - r.m) * CE_LOG2E) + b.s * exp2f((b.m - r.m) * CE_LOG2E);
  r.sx = a.sx + b.sx;
  return r;
}

__device__ __forceinline__ Lse warp_lse(Lse a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Lse b;
    b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
    b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
    b.sx = __shfl_xor_sync(0xffffffffu, a.sx, o);
    a = lse_combine(a, b);  // commutative: every lane ends with the same bits
  }
  return a;
}

// Block-wide combine; every thread returns the same total. sh: 3 x 32 floats. blockDim.x % 32 == 0.
__device__ __forceinline__ Lse block_lse(Lse a, float* sh) {
  a = warp_lse(a);
  const int nw = blockDim.x >> 5;
  if (nw == 1) return a;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __syncthreads();  // the previous row's readers are done with sh
  if (lane == 0) {
    sh[w] = a.m;
    sh[32 + w] = a.s;
    sh[64 + w] = a.sx;
  }
  __syncthreads();
  Lse b;
  b.m = lane < nw ? sh[lane] : CE_LOWEST;
  b.s = lane < nw ? sh[32 + lane] : 0.f;
  b.sx = lane < nw ? sh[64 + lane] : 0.f;
  return warp_lse(b);
}

// A 16-byte store of a pack built element by element, as one uint4 of explicitly assembled words: NVVM
// otherwise splits such a pack into 2- or 4-byte stores when the row offset is a run-time value (seen in
// the PTX).
__device__ __forceinline__ uint4 pack_words(const Pack<bf16, 8>& o) {
  uint4 w;
  w.x = (unsigned)o.v[0].bits | ((unsigned)o.v[1].bits << 16);
  w.y = (unsigned)o.v[2].bits | ((unsigned)o.v[3].bits << 16);
  w.z = (unsigned)o.v[4].bits | ((unsigned)o.v[5].bits << 16);
  w.w = (unsigned)o.v[6].bits | ((unsigned)o.v[7].bits << 16);
  return w;
}
__device__ __forceinline__ uint4 pack_words(const Pack<float, 4>& o) {
  uint4 w;
  w.x = __float_as_uint(o.v[0]);
  w.y = __float_as_uint(o.v[1]);
  w.z = __float_as_uint(o.v[2]);
  w.w = __float_as_uint(o.v[3]);
  return w;
}
template <typename T, int E>
__device__ __forceinline__ void store16(T* p, const Pack<T, E>& o) {
  __stwb(reinterpret_cast<uint4*>(p), pack_words(o));
}
// The fused kernel's pass 2 with `hint`: the re-read is the row's last use and dx is not read again here, so both
// go to L2 as evict-first (ld/st .cs). Without it the dx lines (written back, so they stay dirty in L2) and the
// re-read rows compete with the rows still waiting for their pass 2: 132 rows of 256 KB in flight are 34 MB of
// reads plus 34 MB of dirty writes against the H200's 50 MB L2 (issue 17, session 15).
template <typename T, int E>
__device__ __forceinline__ Pack<T, E> load_pack_hint(const T* p, bool hint) {
  if (!hint) return load_pack<T, E>(p);
  const uint4 w = __ldcs(reinterpret_cast<const uint4*>(p));
  Pack<T, E> r;
  *reinterpret_cast<uint4*>(&r) = w;
  return r;
}
template <typename T, int E>
__device__ __forceinline__ void store16_hint(T* p, const Pack<T, E>& o, bool hint) {
  if (hint)
    __stcs(reinterpret_cast<uint4*>(p), pack_words(o));
  else
    store16<T, E>(p, o);
}

// Row layout: [0, head) scalar, [head, head + units * E) packs of E, [tail0, V) scalar.
struct RowSplit {
  int head, units, tail0;
};
template <typename T>
__device__ __forceinline__ RowSplit split_row(const T* row, int V, bool vec) {
  constexpr int E = 16 / sizeof(T);
  int head = V;
  if (vec) {
    head = (int)(((16u - ((unsigned)(size_t)row & 15u)) & 15u) / sizeof(T));
    if (head > V) head = V;
  }
  RowSplit r;
  r.head = head;
  r.units = (V - head) / E;
  r.tail0 = head + r.units * E;
  return r;
}

template <typename T>
__device__ __forceinline__ bool target_ok(T t, long long V, long long ignore, int* err) {
  const long long tt = (long long)t;
  if (tt == ignore) return false;
  if (tt < 0 || tt >= V) {
    if (err != nullptr) atomicOr(err, CE_ERR_TARGET);
    return false;
  }
  return true;
}

// Pass 1 over a row: this thread's online state (elements [lo, hi) scalar, then the packs).
template <typename T>
__device__ __forceinline__ Lse row_lse_partial(const T* __restrict__ xr, int V, const RowSplit& sp) {
  constexpr int E = 16 / sizeof(T);
  constexpr int U = 4;
  Lse a{CE_LOWEST, 0.f, 0.f};
  // Scalar parts: the head (the whole row when not vectorised) and the tail; 4 loads in flight.
  for (int seg = 0; seg < 2; ++seg) {
    const int lo = seg == 0 ? 0 : sp.tail0, hi = seg == 0 ? sp.head : V;
    for (int j0 = lo + threadIdx.x; j0 < hi; j0 += U * blockDim.x) {
      float v[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int j = j0 + k * blockDim.x;
        v[k] = j < hi ? to_f32(xr[j]) : 0.f;
      }
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (j0 + k * blockDim.x < hi) lse_add(a, v[k]);
    }
  }
  const T* body = xr + sp.head;
  for (int u0 = threadIdx.x; u0 < sp.units; u0 += U * blockDim.x) {
    Pack<T, E> p[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = u0 + k * blockDim.x;
      if (u < sp.units) p[k] = load_pack<T, E>(body + (long long)u * E);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      if (u0 + k * blockDim.x < sp.units) {
        float f[E];
#pragma unroll
        for (int i = 0; i < E; ++i) f[i] = to_f32(p[k].v[i]);
        lse_add_pack<E>(a, f);
      }
    }
  }
  return a;
}

// Pass 2's loads: up to U packs of a row's body from unit u0 on, blockDim.x units apart (evict-first with hint).
template <typename T, int E, int U>
__device__ __forceinline__ void load_packs(Pack<T, E> (&p)[U], const T* body, int u0, int units, bool hint) {
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int u = u0 + k * blockDim.x;
    if (u < units) p[k] = load_pack_hint<T, E>(body + (long long)u * E, hint);
  }
}

// Pass 2: dx_j = g (exp(x_j - lse) - eps/V) - [j == t] g (1 - eps). `or_` may equal `xr` (in place): every
// element is read and written by the same thread, read first. t < 0: no target column (never used: invalid
// rows are zero-filled by row_zero).
template <typename T>
__device__ __forceinline__ void row_grad(const T* xr, T* or_, int V, const RowSplit& sp, float lse, int t, float g,
                                         float g_epsv, float g_tgt, bool hint = false) {
  constexpr int E = 16 / sizeof(T);
  constexpr int U = 4;
  for (int seg = 0; seg < 2; ++seg) {
    const int lo = seg == 0 ? 0 : sp.tail0, hi = seg == 0 ? sp.head : V;
    for (int j0 = lo + threadIdx.x; j0 < hi; j0 += U * blockDim.x) {
      float v[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int j = j0 + k * blockDim.x;
        v[k] = j < hi ? to_f32(xr[j]) : 0.f;
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int j = j0 + k * blockDim.x;
        if (j < hi) {
          float d = g * exp2f((v[k] - lse) * CE_LOG2E) - g_epsv;
          if (j == t) d -= g_tgt;
          or_[j] = from_f32<T>(d);
        }
      }
    }
  }
  const T* body = xr + sp.head;
  T* obody = or_ + sp.head;
  for (int u0 = threadIdx.x; u0 < sp.units; u0 += U * blockDim.x) {
    Pack<T, E> p[U];
    load_packs<T, E, U>(p, body, u0, sp.units, hint);
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = u0 + k * blockDim.x;
      if (u < sp.units) {
        const int j0 = sp.head + u * E;
        Pack<T, E> o;
#pragma unroll
        for (int i = 0; i < E; ++i) {
          float d = g * exp2f((to_f32(p[k].v[i]) - lse) * CE_LOG2E) - g_epsv;
          if (j0 + i == t) d -= g_tgt;
          o.v[i] = from_f32<T>(d);
        }
        store16_hint<T, E>(obody + (long long)u * E, o, hint);
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void row_zero(T* or_, int V, const RowSplit& sp) {
  constexpr int E = 16 / sizeof(T);
  const T z = from_f32<T>(0.f);
  for (int j = threadIdx.x; j < sp.head; j += blockDim.x) or_[j] = z;
  for (int j = sp.tail0 + threadIdx.x; j < V; j += blockDim.x) or_[j] = z;
  Pack<T, E> zp;
#pragma unroll
  for (int i = 0; i < E; ++i) zp.v[i] = z;
  T* obody = or_ + sp.head;
  for (int u = threadIdx.x; u < sp.units; u += blockDim.x) store16<T, E>(obody + (long long)u * E, zp);
}

// ---- FP8 dlogits (Q = 0: E4M3, Q = 1: E5M2; Q = -1: dlogits in the logits' dtype). The LM head's FP8 gradient
// GEMMs (ops/linear_cross_entropy.py, grad_fp8) read dlogits as FP8 codes; pass 2 writes them as q = fp8(T(d) s)
// into rows of their own: 1 byte an element, where bf16 dlogits in place took 2 and then an amax pass and a cast
// read them twice more (1.05 G elements a step at the LLaMA-3.2-1B head; predicted -1.6 ms, measured ~-0.5 on
// the H200 step: benchmarks/NOTES.md, FP8).
// The scale needs no amax: |d| = |g| |p_j - eps/V - (1 - eps)[j == t]| <= |g| for every element, so s is the
// largest power of two with s |g| <= the format's max (from the exponent bits: exact; 1 / s too). Against the
// amax rule this gives up less than 2 binades while the rows' largest |p - 1| stays above 1/2 (E5M2 has 32).
template <int Q>
__device__ __forceinline__ float ce_q8_scale(float g) {
  const unsigned a = __float_as_uint(g) & 0x7fffffffu, f = Fp8Fmt<Q>::MAX_BITS;
  if (a < 0x00800000u || a >= 0x7f800000u) return 1.f;  // 0, subnormal, inf, NaN: no information
  int e = (int)(f >> 23) - (int)(a >> 23) - ((a & 0x7fffffu) > (f & 0x7fffffu) ? 1 : 0);
  e = e < -126 ? -126 : (e > 126 ? 126 : e);
  return __uint_as_float((unsigned)(127 + e) << 23);
}

// Two codes (a in the low byte). Without cast_pair's NaN check: a NaN d comes only from NaN or inf logits, whose
// sign means nothing to match (and the check's fallback spilled the 1024-thread entries past 64 registers).
template <int Q>
__device__ __forceinline__ unsigned q8_pair(float a, float b, float s) {
#ifdef FP8_HW_CVT
  return cvt_pair<Q>(__fmul_rn(a, s), __fmul_rn(b, s));
#else
  return f32_to_fp8<Q>(__fmul_rn(a, s)) | (f32_to_fp8<Q>(__fmul_rn(b, s)) << 8);
#endif
}

// Pass 2 of row_grad writing FP8 codes: the same d, rounded to T first (the bf16 dlogits row_grad would write),
// times s, cast (nearest even, saturating). qr's body pack of E codes is stored as one E-byte word. U packs in
// flight a thread: row_grad's 4 spill at a 1024-thread block's 64 registers, and so do 2 with int64 targets (4
// bytes, sm_80 and sm_90): 2 for int32 targets (the trainer's), 1 for int64 and with B16 (2 spilled 24 bytes).
// B16: the bf16 dlogits too, into ob (in place over xr when ob == xr: each pack is read before it is written).
template <int Q, int U, bool B16, typename T>
__device__ __forceinline__ void row_grad_q8(const T* xr, unsigned char* qr, T* ob, int V, const RowSplit& sp,
                                            float lse, int t, float g, float g_epsv, float g_tgt, float s, bool hint) {
  constexpr int E = 16 / sizeof(T);
  static_assert(E == 8, "FP8 dlogits from bf16 logits only");
  for (int seg = 0; seg < 2; ++seg) {
    const int lo = seg == 0 ? 0 : sp.tail0, hi = seg == 0 ? sp.head : V;
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) {
      float d = g * exp2f((to_f32(xr[j]) - lse) * CE_LOG2E) - g_epsv;
      if (j == t) d -= g_tgt;
      const T db = from_f32<T>(d);
      if constexpr (B16) ob[j] = db;
      qr[j] = (unsigned char)(q8_pair<Q>(to_f32(db), 0.f, s) & 0xffu);
    }
  }
  const T* body = xr + sp.head;
  unsigned char* qbody = qr + sp.head;
  for (int u0 = threadIdx.x; u0 < sp.units; u0 += U * blockDim.x) {
    Pack<T, E> p[U];
    load_packs<T, E, U>(p, body, u0, sp.units, hint);
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = u0 + k * blockDim.x;
      if (u < sp.units) {
        const int it = t - (sp.head + u * E);  // the target's index in this pack (out of [0, E): none)
        unsigned c[E / 2];
        Pack<T, E> o;
#pragma unroll
        for (int i = 0; i < E; i += 2) {
          float d0 = g * exp2f((to_f32(p[k].v[i]) - lse) * CE_LOG2E) - g_epsv;
          float d1 = g * exp2f((to_f32(p[k].v[i + 1]) - lse) * CE_LOG2E) - g_epsv;
          if (it == i) d0 -= g_tgt;
          if (it == i + 1) d1 -= g_tgt;
          o.v[i] = from_f32<T>(d0);
          o.v[i + 1] = from_f32<T>(d1);
          c[i / 2] = q8_pair<Q>(to_f32(o.v[i]), to_f32(o.v[i + 1]), s);
        }
        if constexpr (B16) store16_hint<T, E>(ob + sp.head + (long long)u * E, o, hint);
        uint2 w;
        w.x = c[0] | (c[1] << 16);
        w.y = c[2] | (c[3] << 16);
        uint2* dst = reinterpret_cast<uint2*>(qbody + (long long)u * E);
        if (hint)
          __stcs(dst, w);
        else
          *dst = w;
      }
    }
  }
}

// Code 0 (+0) over [0, V) of an ignored row: 16-byte stores between a byte head and tail.
__device__ __forceinline__ void row_zero_q8(unsigned char* qr, int V) {
  int h = (int)((16u - ((unsigned)(size_t)qr & 15u)) & 15u);
  if (h > V) h = V;
  const int n16 = (V - h) >> 4, t0 = h + (n16 << 4);
  for (int j = threadIdx.x; j < h; j += blockDim.x) qr[j] = 0;
  for (int j = t0 + threadIdx.x; j < V; j += blockDim.x) qr[j] = 0;
  uint4* b = reinterpret_cast<uint4*>(qr + h);
  for (int u = threadIdx.x; u < n16; u += blockDim.x) b[u] = make_uint4(0u, 0u, 0u, 0u);
}

// The loss of a valid row from its (max, sum, sum_x) and x_t.
__device__ __forceinline__ float row_loss(const Lse& a, float xt, float eps, int V, float* lse_out) {
  const float lse = a.m + logf(a.s);  // a.s >= 1 (the max element contributes exp(0))
  *lse_out = lse;
  return (1.f - eps) * (lse - xt) + eps * (lse - a.sx / (float)V);
}

// ---------------------------------------------------------------- forward
template <typename T, typename I>
__device__ __forceinline__ void ce_fwd(const T* __restrict__ x, const I* __restrict__ tg, float* __restrict__ loss_row,
                                       float* __restrict__ lse_out, int* __restrict__ err, long long N, int V,
                                       long long ldx, long long ignore, float eps) {
  __shared__ float sh[96];
  for (long long row = blockIdx.x; row < N; row += gridDim.x) {
    const T* xr = x + row * ldx;
    const I t = tg[row];
    const bool ok = target_ok(t, (long long)V, ignore, threadIdx.x == 0 ? err : nullptr);
    const float xt = (ok && threadIdx.x == 0) ? to_f32(xr[(long long)t]) : 0.f;  // used by thread 0 only
    const RowSplit sp = split_row(xr, V, true);
    Lse a = row_lse_partial(xr, V, sp);
    a = block_lse(a, sh);
    if (threadIdx.x == 0) {
      float lse;
      const float l = row_loss(a, xt, eps, V, &lse);
      loss_row[row] = ok ? l : 0.f;
      if (lse_out != nullptr) lse_out[row] = lse;
    }
  }
}

// ---------------------------------------------------------------- fused forward + backward
// Q = -1: dx in T (possibly over the logits); Q = 0 / 1: FP8 codes (O = unsigned char) into their own rows, and
// 1 / s into *scale_inv (block 0) for the GEMMs that read them.
// B16 (with Q >= 0): the bf16 dlogits as well, into dx16 (row stride ld16; over the logits when dx16 == x).
template <typename T, typename I, int Q = -1, typename O = T, bool B16 = false>
__device__ __forceinline__ void ce_fused(const T* x, const I* __restrict__ tg, O* dx, float* __restrict__ loss_row,
                                         int* __restrict__ err, const int* __restrict__ count,
                                         const float* __restrict__ dloss, float dloss_scalar, long long N, int V,
                                         long long ldx, long long ldo, long long ignore, float eps, bool vec,
                                         bool hint, float* __restrict__ scale_inv = nullptr, T* dx16 = nullptr,
                                         long long ld16 = 0) {
  __shared__ float sh[96];
  const float cnt_scale = count != nullptr ? (*count > 0 ? 1.f / (float)*count : 0.f) : 1.f;
  const float gbase = (dloss != nullptr ? *dloss : dloss_scalar) * cnt_scale;
  float s = 1.f;
  if constexpr (Q >= 0) {
    s = ce_q8_scale<Q>(gbase);
    if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.f / s;  // a power of two: exact
  }
  for (long long row = blockIdx.x; row < N; row += gridDim.x) {
    const T* xr = x + row * ldx;
    O* orow = dx + row * ldo;
    const I t = tg[row];
    const bool ok = target_ok(t, (long long)V, ignore, threadIdx.x == 0 ? err : nullptr);
    const int ti = (int)t;  // < V once ok; an int from here on (a long long t held 2 more registers: i64 spilled)
    RowSplit sp = split_row(xr, V, vec);
    if (!ok) {  // uniform over the block
      if constexpr (Q >= 0) {
        row_zero_q8(orow, V);
        if constexpr (B16) row_zero(dx16 + row * ld16, V, sp);
      } else
        row_zero(orow, V, sp);
      if (threadIdx.x == 0) loss_row[row] = 0.f;
      continue;
    }
    const float xt = threadIdx.x == 0 ? to_f32(xr[ti]) : 0.f;  // used by thread 0 only
    Lse a = row_lse_partial(xr, V, sp);
    a = block_lse(a, sh);
    // x_t (and the whole row's pass 1) must be read before any thread overwrites the row (in place): the
    // block reduction's __syncthreads orders it; a one-warp block needs the warp barrier.
    if (blockDim.x == 32) __syncwarp();
    float lse;
    const float l = row_loss(a, xt, eps, V, &lse);
    if (threadIdx.x == 0) loss_row[row] = l;
    // FP8 rows: the packs of E codes need E-byte alignment where the logits' packs start, else pass 2 goes all
    // scalar. Pass 1 keeps the logits' split: its sums, and so the loss, are the bf16 kernel's bit for bit.
    if constexpr (Q >= 0)
      if (vec && ((unsigned)(size_t)(orow + sp.head) & (16u / sizeof(T) - 1u))) sp = split_row(xr, V, false);
    if constexpr (Q >= 0)
      row_grad_q8<Q, (B16 || sizeof(I) == 8) ? 1 : 2, B16>(xr, orow, B16 ? dx16 + row * ld16 : nullptr, V, sp,
                                                           lse, ti, gbase, gbase * eps / (float)V,
                                                           gbase * (1.f - eps), s, hint);
    else
      row_grad(xr, orow, V, sp, lse, ti, gbase, gbase * eps / (float)V, gbase * (1.f - eps), hint);
  }
}

// ---------------------------------------------------------------- backward from a saved lse
template <typename T, typename I>
__device__ __forceinline__ void ce_bwd(const T* x, const I* __restrict__ tg, const float* __restrict__ lse,
                                       T* dx, int* __restrict__ err, const int* __restrict__ count,
                                       const float* __restrict__ dloss, float dloss_scalar, bool per_row,
                                       long long N, int V, long long ldx, long long ldo, long long ignore, float eps,
                                       bool vec) {
  const float cnt_scale = count != nullptr ? (*count > 0 ? 1.f / (float)*count : 0.f) : 1.f;
  for (long long row = blockIdx.x; row < N; row += gridDim.x) {
    const T* xr = x + row * ldx;
    T* orow = dx + row * ldo;
    const I t = tg[row];
    const bool ok = target_ok(t, (long long)V, ignore, threadIdx.x == 0 ? err : nullptr);
    const RowSplit sp = split_row(xr, V, vec);
    if (!ok) {
      row_zero(orow, V, sp);
      continue;
    }
    const float g = (dloss != nullptr ? dloss[per_row ? row : 0] : dloss_scalar) * cnt_scale;
    row_grad(xr, orow, V, sp, lse[row], (int)t, g, g * eps / (float)V, g * (1.f - eps));
  }
}

// ---------------------------------------------------------------- tiny one-block kernels
// count = number of valid targets (t != ignore, 0 <= t < V).
template <typename I>
__device__ __forceinline__ void ce_count(const I* __restrict__ tg, long long N, long long V, long long ignore,
                                         int* __restrict__ count) {
  __shared__ int sh[32];
  int c = 0;
  for (long long i = threadIdx.x; i < N; i += blockDim.x) {
    const long long t = (long long)tg[i];
    c += (t != ignore && t >= 0 && t < V) ? 1 : 0;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) sh[w] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    int s = 0;
    for (int k = 0; k < nw; ++k) s += sh[k];
    *count = s;
  }
}

// loss = sum_i loss_row[i] (fixed order: per-thread strided sums, then a fixed tree), divided by *count when
// count is given (0 when *count == 0).
__device__ __forceinline__ void ce_reduce(const float* __restrict__ loss_row, long long N, const int* __restrict__ count,
                                          float* __restrict__ loss) {
  __shared__ float sh[32];
  float s = 0.f;
  for (long long i = threadIdx.x; i < N; i += blockDim.x) s += loss_row[i];
  s = warp_sum(s);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) sh[w] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int k = 0; k < nw; ++k) t += sh[k];
    if (count != nullptr) {
      const int c = *count;
      t = c > 0 ? t / (float)c : 0.f;
    }
    *loss = t;
  }
}

// ---- extern "C" entry points. Names: <kernel>_<logits dtype>_<targets dtype>. ldx / ldo: row strides in
// elements (V for contiguous rows).
#define CE_ALL(T, I, TN, IN)                                                                                    \
  CK_ENTRY(__launch_bounds__(1024),                                                                            \
      ce_fwd_##TN##_##IN)(const T* x, const I* tg, float* loss_row, float* lse, int* err, long long N, int V,   \
                         long long ldx, long long ignore, float eps) {                                         \
    ce_fwd<T, I>(x, tg, loss_row, lse, err, N, V, ldx, ignore, eps);                                           \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(1024),                                                                            \
      ce_fused_##TN##_##IN)(const T* x, const I* tg, T* dx, float* loss_row, int* err, const int* count,       \
                           const float* dloss, float dloss_scalar, long long N, int V, long long ldx,           \
                           long long ldo, long long ignore, float eps, bool vec, bool hint) {                  \
    ce_fused<T, I>(x, tg, dx, loss_row, err, count, dloss, dloss_scalar, N, V, ldx, ldo, ignore, eps, vec, hint); \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(1024),                                                                            \
      ce_bwd_##TN##_##IN)(const T* x, const I* tg, const float* lse, T* dx, int* err, const int* count,        \
                         const float* dloss, float dloss_scalar, bool per_row, long long N, int V,             \
                         long long ldx, long long ldo, long long ignore, float eps, bool vec) {                \
    ce_bwd<T, I>(x, tg, lse, dx, err, count, dloss, dloss_scalar, per_row, N, V, ldx, ldo, ignore, eps, vec);  \
  }
// ce_fused_q8_bf16_<targets>_<format>: the fused kernel writing FP8 dlogits (q: uint8 rows of stride ldq) and
// 1 / s into scale_inv.
#define CE_Q8(I, IN, Q, QN)                                                                                     \
  CK_ENTRY(__launch_bounds__(1024),                                                                            \
      ce_fused_q8_bf16_##IN##_##QN)(const bf16* x, const I* tg, unsigned char* q, float* loss_row, int* err,   \
                                    const int* count, const float* dloss, float dloss_scalar, long long N,     \
                                    int V, long long ldx, long long ldq, long long ignore, float eps, bool vec, \
                                    bool hint, float* scale_inv) {                                             \
    ce_fused<bf16, I, Q, unsigned char>(x, tg, q, loss_row, err, count, dloss, dloss_scalar, N, V, ldx, ldq,   \
                                        ignore, eps, vec, hint, scale_inv);                                    \
  }
// ce_fused_q8b_bf16_<targets>_<format>: the same, and the bf16 dlogits into dx16 (row stride ld16) as ce_fused
// writes them: the LM head with only its dx GEMM in FP8 reads the codes, its dW GEMM the bf16 values. dx16 must
// share x's row alignment (the op passes the logits themselves, in place): its packs are split by x's rows.
#define CE_Q8B(I, IN, Q, QN)                                                                                    \
  CK_ENTRY(__launch_bounds__(1024),                                                                            \
      ce_fused_q8b_bf16_##IN##_##QN)(const bf16* x, const I* tg, unsigned char* q, float* loss_row, int* err,  \
                                     const int* count, const float* dloss, float dloss_scalar, long long N,    \
                                     int V, long long ldx, long long ldq, long long ignore, float eps,          \
                                     bool vec, bool hint, float* scale_inv, bf16* dx16, long long ld16) {      \
    ce_fused<bf16, I, Q, unsigned char, true>(x, tg, q, loss_row, err, count, dloss, dloss_scalar, N, V, ldx,  \
                                              ldq, ignore, eps, vec, hint, scale_inv, dx16, ld16);             \
  }
CE_Q8B(int, i32, 0, e4m3)
CE_Q8B(int, i32, 1, e5m2)
CE_Q8B(long long, i64, 0, e4m3)
CE_Q8B(long long, i64, 1, e5m2)
CE_Q8(int, i32, 0, e4m3)
CE_Q8(int, i32, 1, e5m2)
CE_Q8(long long, i64, 0, e4m3)
CE_Q8(long long, i64, 1, e5m2)
CE_ALL(float, int, f32, i32)
CE_ALL(float, long long, f32, i64)
CE_ALL(bf16, int, bf16, i32)
CE_ALL(bf16, long long, bf16, i64)

CK_ENTRY(__launch_bounds__(1024), ce_count_i32)(const int* tg, long long N, long long V,
                                                long long ignore, int* count) {
  ce_count<int>(tg, N, V, ignore, count);
}
CK_ENTRY(__launch_bounds__(1024), ce_count_i64)(const long long* tg, long long N, long long V,
                                                long long ignore, int* count) {
  ce_count<long long>(tg, N, V, ignore, count);
}
CK_ENTRY(__launch_bounds__(1024), ce_reduce_loss)(const float* loss_row, long long N,
                                                  const int* count, float* loss) {
  ce_reduce(loss_row, N, count, loss);
}
