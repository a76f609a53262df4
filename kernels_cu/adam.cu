// Optimizer kernels: fused AdamW (dense and sparse rows), global gradient norm, clip scale, row zeroing,
// and the device-side step counter / LR schedule that keep a captured training step valid.
//
//   AdamW, step t >= 1 (decoupled weight decay, PyTorch's form; s = grad_scale or 1):
//     g  = s * grad
//     m  = beta1 * m + (1 - beta1) * g
//     v  = beta2 * v + (1 - beta2) * g^2
//     p  = p * (1 - lr * wd) - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//     shadow = bf16(p)                          (round to nearest even, optional)
//   Sparse rows ("lazy Adam"): the same update applied only to the rows listed in rows[0 : *row_count] of a
//   [V, D] parameter; the other rows keep param and moments bit-identical (their moments do not decay, and
//   they get no weight decay) -- unlike dense Adam, where every row's moments decay every step.
//   global_norm = sqrt(sum of x^2 over all arrays); clip_scale = min(1, max_norm / (norm + 1e-6)).
//   No backward: these are the end of the step.
//
// Design (numbers for 1.5e9 fp32 params on an H200, copy ceiling ~4.2 TB/s):
// - Dense Adam is a pure stream: 4 fp32 reads (p, g, m, v) + 3 fp32 writes = 28 B/param, +2 with the bf16
//   shadow (30 B), -2 with a bf16 grad (26 B): 42 GB -> ~10 ms at 4.2 TB/s, 11.1 ms at 3.8 TB/s.
// - VEC=true: a thread handles 8 consecutive elements per iteration: 2 x 16-byte loads of each fp32 stream,
//   one 16-byte load of a bf16 grad, one 16-byte store of 8 bf16 shadow values; so every stream moves in
//   LDG.128/STG.128 and each thread has 7-8 independent 16-byte loads in flight. Needs every pointer 16-byte
//   aligned (launcher checks); the last n % 8 elements go through the element path. VEC=false: element
//   accesses for any alignment (misaligned views).
// - Persistent grid-stride grid: one wave (sm_count x resident blocks of 256 threads); a thread computes the
//   step-dependent coefficients once (bias corrections in double: 1 - beta2^t for t = 1 loses 4 digits when
//   beta2 is rounded to fp32 first), then streams.
// - lr and step may live in device memory (pointer != null; step as int32, int64 or fp32), so a captured CUDA
//   graph of the training step stays valid as they change; so may grad_scale (clipping scale, inverse loss
//   scale). Each is a (pointer, value) pair: the pointer wins when not null.
// - Those device values cannot be checked on the host without a sync, so every thread checks them after
//   loading them (the same uniform values in every thread: 3 compares on floats and 3 on the double step, next
//   to the two double pow() the coefficients already cost) and, when lr or grad_scale is NaN, inf or negative,
//   or step is not an integer >= 1, returns before writing anything: params, moments and shadow stay
//   bit-identical, and thread 0 of block 0 ORs a bit per problem into the error word (1 lr, 2 step,
//   4 grad_scale; ck.adam_error()). Host numbers were checked by the launcher and always pass. The loads and
//   stores are unchanged (28-30 B/param), so the time is unchanged.
// - Sparse rows: a fixed grid (sized from the rows capacity, known on the host) reads row_count on the device
//   and blocks past it exit at once: no host sync between the embedding backward and the update. Rows of D
//   elements are split over blockDim.x threads (8-element units when D % 8 == 0 and pointers are aligned),
//   blockDim.y rows per block. Rows outside [0, V) are skipped; rows must be unique (a duplicate would be
//   updated twice, racing).
// - global_norm is two-stage and deterministic: one partial kernel per array (fixed grid from its size and
//   the SM count, fp32 per-thread sums, fixed-order block tree) writes its slots of a partials buffer; one
//   block sums all partials in fixed order in double and takes the sqrt. No atomics.
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/fp8.cuh"

struct AdamCoef {
  float b1, omb1, b2, omb2, step_size, inv_sqrt_bc2, eps, decay, gs;
  int bad;  // error bits: 1 lr, 2 step, 4 grad_scale (0: the update may be applied)
};

#define ADAM_ERR_LR 1
#define ADAM_ERR_STEP 2
#define ADAM_ERR_GRAD_SCALE 4

// x >= 0 and finite (false for NaN: every ordered compare with NaN is false).
__device__ __forceinline__ bool nonneg_finite(float x) { return x >= 0.f && x < CK_INF; }

// lr = *lr_ptr or lr_val; grad scale = *gs_ptr or gs_val;
// step_kind: 0 = step_val (host number), 1 = *(int*)step_ptr, 2 = *(long long*), 3 = *(float*).
__device__ __forceinline__ AdamCoef adam_coef(const float* lr_ptr, float lr_val, const void* step_ptr, int step_kind,
                                              double step_val, const float* gs_ptr, float gs_val, double beta1,
                                              double beta2, float eps, float wd) {
  const float lr_f = lr_ptr != nullptr ? *lr_ptr : lr_val;
  const double lr = (double)lr_f;
  double t = step_val;
  if (step_kind == 1) t = (double)*(const int*)step_ptr;
  else if (step_kind == 2) t = (double)*(const long long*)step_ptr;
  else if (step_kind == 3) t = (double)*(const float*)step_ptr;
  const double bc1 = 1.0 - pow(beta1, t), bc2 = 1.0 - pow(beta2, t);
  AdamCoef c;
  // step: an integer >= 1 (t <= 2^53: every such double is an integer, and t == floor(t) excludes NaN).
  c.bad = (nonneg_finite(lr_f) ? 0 : ADAM_ERR_LR) |
          ((t >= 1.0 && t <= 9007199254740992.0 && t == floor(t)) ? 0 : ADAM_ERR_STEP);
  c.b1 = (float)beta1;
  c.omb1 = (float)(1.0 - beta1);
  c.b2 = (float)beta2;
  c.omb2 = (float)(1.0 - beta2);
  c.step_size = (float)(lr / bc1);
  c.inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
  c.eps = eps;
  c.decay = (float)(1.0 - lr * (double)wd);
  c.gs = gs_ptr != nullptr ? *gs_ptr : gs_val;
  if (!nonneg_finite(c.gs)) c.bad |= ADAM_ERR_GRAD_SCALE;
  return c;
}

// Bad hyperparameters: block 0's first thread reports them (every thread saw the same values and returns).
__device__ __forceinline__ void adam_report(int* err, int bad) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) atomicOr(err, bad);
}

__device__ __forceinline__ void adam_elem(float& p, float g, float& m, float& v, const AdamCoef& c) {
  g *= c.gs;
  m = fmaf(c.b1, m, c.omb1 * g);
  v = fmaf(c.b2, v, c.omb2 * g * g);
  const float denom = fmaf(sqrtf(v), c.inv_sqrt_bc2, c.eps);
  p = fmaf(p, c.decay, -(c.step_size * (m / denom)));
}

// One element at offset o.
template <typename G>
__device__ __forceinline__ void adam_one(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                                         float* __restrict__ v, bf16* __restrict__ sh, long long o,
                                         const AdamCoef& c) {
  float pf = p[o], mf = m[o], vf = v[o];
  adam_elem(pf, to_f32(g[o]), mf, vf, c);
  p[o] = pf;
  m[o] = mf;
  v[o] = vf;
  if (sh != nullptr) sh[o] = from_f32<bf16>(pf);
}

// Eight elements at offset o (o % 8 == 0, every pointer 16-byte aligned): 16-byte accesses on every stream
// (the sparse-row kernel: one row's columns per group of threads).
template <typename G>
__device__ __forceinline__ void adam_eight(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                                           float* __restrict__ v, bf16* __restrict__ sh, long long o,
                                           const AdamCoef& c) {
  const Pack<float, 4> p0 = load_pack<float, 4>(p + o), p1 = load_pack<float, 4>(p + o + 4);
  const Pack<float, 4> m0 = load_pack<float, 4>(m + o), m1 = load_pack<float, 4>(m + o + 4);
  const Pack<float, 4> v0 = load_pack<float, 4>(v + o), v1 = load_pack<float, 4>(v + o + 4);
  float gf[8];
  load_f32<8>(g + o, gf, true);
  Pack<float, 4> po[2], mo[2], vo[2];
  Pack<bf16, 8> so;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float pf = i < 4 ? p0.v[i] : p1.v[i - 4];
    float mf = i < 4 ? m0.v[i] : m1.v[i - 4];
    float vf = i < 4 ? v0.v[i] : v1.v[i - 4];
    adam_elem(pf, gf[i], mf, vf, c);
    po[i / 4].v[i % 4] = pf;
    mo[i / 4].v[i % 4] = mf;
    vo[i / 4].v[i % 4] = vf;
    so.v[i] = from_f32<bf16>(pf);
  }
  store_pack<float, 4>(p + o, po[0]);
  store_pack<float, 4>(p + o + 4, po[1]);
  store_pack<float, 4>(m + o, mo[0]);
  store_pack<float, 4>(m + o + 4, mo[1]);
  store_pack<float, 4>(v + o, vo[0]);
  store_pack<float, 4>(v + o + 4, vo[1]);
  if (sh != nullptr) store_pack<bf16, 8>(sh + o, so);
}

// Two groups of four elements at offsets o0 and o1 (multiples of 4, every pointer 16-byte aligned): 16-byte
// accesses on the fp32 streams, 8 or 16 bytes on the grad and shadow. The launcher's threads take consecutive
// groups, so every load instruction of a warp covers 512 contiguous bytes (the first version gave each thread
// 8 consecutive elements, 32 bytes apart per instruction: 82 % of the copy bandwidth at 1.5e9 parameters).
// All loads of both groups are issued before any arithmetic (8 x 16-byte loads in flight per thread).
template <typename G>
__device__ __forceinline__ void adam_two_fours(float* __restrict__ p, const G* __restrict__ g,
                                               float* __restrict__ m, float* __restrict__ v,
                                               bf16* __restrict__ sh, long long o0, long long o1, bool has1,
                                               const AdamCoef& c) {
  Pack<float, 4> pp[2], mm[2], vv[2];
  Pack<G, 4> gg[2];
  const long long o[2] = {o0, o1};
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (j == 0 || has1) {
      pp[j] = load_pack<float, 4>(p + o[j]);
      mm[j] = load_pack<float, 4>(m + o[j]);
      vv[j] = load_pack<float, 4>(v + o[j]);
      gg[j] = load_pack<G, 4>(g + o[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (j == 0 || has1) {
      Pack<bf16, 4> so;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        adam_elem(pp[j].v[i], to_f32(gg[j].v[i]), mm[j].v[i], vv[j].v[i], c);
        so.v[i] = from_f32<bf16>(pp[j].v[i]);
      }
      store_pack<float, 4>(p + o[j], pp[j]);
      store_pack<float, 4>(m + o[j], mm[j]);
      store_pack<float, 4>(v + o[j], vv[j]);
      if (sh != nullptr) store_pack<bf16, 4>(sh + o[j], so);
    }
  }
}

template <typename G, bool VEC>
__device__ __forceinline__ void adam_dense(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                                           float* __restrict__ v, bf16* __restrict__ sh, long long n,
                                           const AdamCoef& c) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long done = 0;
  if constexpr (VEC) {
    const long long units = n >> 2;  // groups of 4; each iteration takes groups u and u + stride
    for (long long u = tid; u < units; u += 2 * stride)
      adam_two_fours<G>(p, g, m, v, sh, u << 2, (u + stride) << 2, u + stride < units, c);
    done = units << 2;
  }
  for (long long i = done + tid; i < n; i += stride) adam_one<G>(p, g, m, v, sh, i, c);
}

// rows[i] for i < min(*row_count, capacity); block (TX, RY): RY rows per block, TX threads across a row.
template <typename G, bool VEC>
__device__ __forceinline__ void adam_rows(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                                          float* __restrict__ v, bf16* __restrict__ sh, const int* __restrict__ rows,
                                          int count, long long V, int D, const AdamCoef& c) {
  constexpr int E = VEC ? 8 : 1;
  const int units = D / E;
  for (long long i = (long long)blockIdx.x * blockDim.y + threadIdx.y; i < count;
       i += (long long)gridDim.x * blockDim.y) {
    const int r = rows[i];
    if (r < 0 || r >= V) continue;
    const long long base = (long long)r * D;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      if constexpr (VEC) adam_eight<G>(p, g, m, v, sh, base + (long long)u * 8, c);
      else adam_one<G>(p, g, m, v, sh, base + u, c);
    }
  }
}

__device__ __forceinline__ int clamp_count(const int* row_count, int capacity) {
  const int n = *row_count;
  return n < 0 ? 0 : (n > capacity ? capacity : n);
}

// ---- extern "C" entry points: adam_<grad dtype>_<v|s>, adam_rows_<grad dtype>_<v|s>.
#define ADAM_ARGS                                                                                              \
  const float *lr_ptr, float lr_val, const void *step_ptr, int step_kind, double step_val, const float *gs_ptr, \
      float gs_val, double beta1, double beta2, float eps, float wd, int *err
#define ADAM_COEF adam_coef(lr_ptr, lr_val, step_ptr, step_kind, step_val, gs_ptr, gs_val, beta1, beta2, eps, wd)

#define ADAM_ENTRY(G, GN, VEC, VS)                                                                             \
  CK_ENTRY(__launch_bounds__(256),                                                                             \
      adam_##GN##_##VS)(float* p, const G* g, float* m, float* v, bf16* sh, long long n, ADAM_ARGS) {          \
    const AdamCoef c = ADAM_COEF;                                                                              \
    if (c.bad) return adam_report(err, c.bad);                                                                 \
    adam_dense<G, VEC>(p, g, m, v, sh, n, c);                                                                  \
  }                                                                                                            \
  CK_ENTRY(__launch_bounds__(256),                                                                             \
      adam_rows_##GN##_##VS)(float* p, const G* g, float* m, float* v, bf16* sh, const int* rows,              \
                            const int* row_count, int capacity, long long V, int D, ADAM_ARGS) {               \
    const int count = clamp_count(row_count, capacity);                                                        \
    const bool idle = (long long)blockIdx.x * blockDim.y >= count;                                             \
    if (idle && blockIdx.x != 0) return; /* block 0 stays to report bad values even with no rows */           \
    const AdamCoef c = ADAM_COEF;                                                                              \
    if (c.bad) return adam_report(err, c.bad);                                                                 \
    if (idle) return;                                                                                          \
    adam_rows<G, VEC>(p, g, m, v, sh, rows, count, V, D, c);                                                   \
  }

ADAM_ENTRY(float, f32, true, v)
ADAM_ENTRY(float, f32, false, s)
ADAM_ENTRY(bf16, bf16, true, v)
ADAM_ENTRY(bf16, bf16, false, s)

// ---- Adam with FP8 shadows (adam_fp8_*): the dense update, and inside each FP8 range k (elements [lo_k, hi_k) of
// p, sorted, disjoint, multiples of 16) q_k[i - lo_k] = e4m3(p_new * s_k) in place of the bf16 shadow, s_k from the
// amax the previous update of the range left (hist_k[0], fp8.cu's delayed rule), max |p_new| of the range into
// hist_k[1]. The last block to finish (ticket, as fp8.cu's block_amax) writes sinv_k = 1 / s_k -- the scale q_k was
// written with -- and rolls every history: one launch for every range. A weight moves by ~lr a step, so the amax of
// the previous update scales this one's to within ~0.1 % (values above it saturate at 448). Traffic: the bf16
// shadow's 2 bytes an element become 1 (the forward's weight cast, 2 + 2 bytes an element from the bf16 shadow, is
// gone; a 1 + 1 byte transpose serves the input gradient's GEMM). Blocks walk chunks of 8192 elements
// (block-strided; two units of 4 in flight a thread, as adam_two_fours); a chunk wholly inside one range or wholly
// outside all of them (all but at most two chunks a range) runs the uniform path: the thread's max is kept for the
// block's range and reduced with one atomicMax a block when the block moves to another range. A chunk across a
// boundary looks up each unit's range and maxes into its history directly.
#define ADAM_CHUNK 8192
struct Fp8Ranges {
  int n;
  const long long* __restrict__ lohi;        // [n][2]
  const unsigned long long* __restrict__ ptr;  // [n][3]: q (uint8 bits), hist (uint32[4]), sinv (float)
  float fmax_m;
  __device__ __forceinline__ unsigned char* q(int k) const { return reinterpret_cast<unsigned char*>(ptr[3 * k]); }
  __device__ __forceinline__ unsigned* hist(int k) const { return reinterpret_cast<unsigned*>(ptr[3 * k + 1]); }
  __device__ __forceinline__ float* sinv(int k) const { return reinterpret_cast<float*>(ptr[3 * k + 2]); }
  __device__ __forceinline__ long long lo(int k) const { return lohi[2 * k]; }
  __device__ __forceinline__ long long hi(int k) const { return lohi[2 * k + 1]; }
  __device__ __forceinline__ float scale(int k) const { return fp8_scale_of(hist(k), nullptr, 1.f, fmax_m); }
};

// E (4 or 1) consecutive elements at o: the update, then the FP8 codes into q + (o - lo) (k >= 0) or the bf16
// shadow; returns max |p_new| as ordered bits.
template <typename G, int E>
__device__ __forceinline__ unsigned adam_fp8_unit(float* __restrict__ p, const G* __restrict__ g,
                                                  float* __restrict__ m, float* __restrict__ v, bf16* __restrict__ sh,
                                                  long long o, const AdamCoef& c, unsigned char* q, float s) {
  unsigned mx = 0;
  if constexpr (E == 4) {
    Pack<float, 4> pp = load_pack<float, 4>(p + o), mm = load_pack<float, 4>(m + o);
    Pack<float, 4> vv = load_pack<float, 4>(v + o);
    const Pack<G, 4> gg = load_pack<G, 4>(g + o);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      adam_elem(pp.v[i], to_f32(gg.v[i]), mm.v[i], vv.v[i], c);
      mx = max(mx, abs_bits(pp.v[i]));
    }
    store_pack<float, 4>(p + o, pp);
    store_pack<float, 4>(m + o, mm);
    store_pack<float, 4>(v + o, vv);
    if (q != nullptr) {
      *reinterpret_cast<unsigned*>(q) =
          cast_pair<0>(pp.v[0], pp.v[1], s) | (cast_pair<0>(pp.v[2], pp.v[3], s) << 16);
    } else if (sh != nullptr) {
      Pack<bf16, 4> so;
#pragma unroll
      for (int i = 0; i < 4; ++i) so.v[i] = from_f32<bf16>(pp.v[i]);
      store_pack<bf16, 4>(sh + o, so);
    }
  } else {
    float pf = p[o], mf = m[o], vf = v[o];
    adam_elem(pf, to_f32(g[o]), mf, vf, c);
    p[o] = pf;
    m[o] = mf;
    v[o] = vf;
    mx = abs_bits(pf);
    if (q != nullptr) *q = (unsigned char)cast_code<0>(pf, s);
    else if (sh != nullptr) sh[o] = from_f32<bf16>(pf);
  }
  return mx;
}

template <typename G, bool VEC>
__device__ __forceinline__ void adam_fp8_dense(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                                               float* __restrict__ v, bf16* __restrict__ sh, long long n,
                                               const AdamCoef& c, const Fp8Ranges& R, unsigned* ticket) {
  constexpr int E = VEC ? 4 : 1, UNITS = ADAM_CHUNK / E / 256;  // units a thread a chunk: 8 (VEC) or 32
  __shared__ int s_at, s_kind;
  const long long chunks = (n + ADAM_CHUNK - 1) / ADAM_CHUNK;
  int cursor = 0;                 // thread 0: the first range that ends after the chunk's start
  int bk = -1;                    // the range the block's running max belongs to
  unsigned bm = 0;                // this thread's max |p_new| in range bk
  float bs = 1.f;
  unsigned char* bq = nullptr;
  long long blo = 0;
  for (long long ch = blockIdx.x; ch < chunks; ch += gridDim.x) {
    const long long base = ch * ADAM_CHUNK, end = min(base + (long long)ADAM_CHUNK, n);
    if (threadIdx.x == 0) {
      while (cursor < R.n && R.hi(cursor) <= base) ++cursor;
      int kind = 0;  // 0 outside every range, 1 inside range cursor, 2 across a boundary
      if (cursor < R.n && R.lo(cursor) < end) kind = (R.lo(cursor) <= base && R.hi(cursor) >= end) ? 1 : 2;
      s_at = cursor;
      s_kind = kind;
    }
    __syncthreads();
    const int at = s_at, kind = s_kind;
    __syncthreads();  // s_at / s_kind are rewritten next chunk
    if (kind != 2) {
      const int want = kind == 1 ? at : -1;
      if (want != bk) {
        if (bk >= 0) block_amax(bm, R.hist(bk) + 1, nullptr);
        bk = want;
        bm = 0;
        if (bk >= 0) {
          bs = R.scale(bk);
          bq = R.q(bk);
          blo = R.lo(bk);
        }
      }
#pragma unroll 2
      for (int u = 0; u < UNITS; ++u) {
        const long long o = base + ((long long)u * 256 + threadIdx.x) * E;
        if (o + E <= end) {
          bm = max(bm, adam_fp8_unit<G, E>(p, g, m, v, sh, o, c, bk >= 0 ? bq + (o - blo) : nullptr, bs));
        } else {  // the last chunk's tail (n % 4)
          for (long long i = o; i < end; ++i)
            bm = max(bm, adam_fp8_unit<G, 1>(p, g, m, v, sh, i, c, bk >= 0 ? bq + (i - blo) : nullptr, bs));
        }
      }
    } else {
      int k = at;
#pragma unroll 1
      for (int u = 0; u < UNITS; ++u) {
        const long long o = base + ((long long)u * 256 + threadIdx.x) * E;
        if (o >= end) break;
        while (k < R.n && R.hi(k) <= o) ++k;
        const bool in = k < R.n && R.lo(k) <= o;  // (a unit never straddles: bounds are multiples of 16)
        unsigned char* qk = in ? R.q(k) - R.lo(k) : nullptr;  // qk + i: element i's code
        const float sk = in ? R.scale(k) : 1.f;
        unsigned mx = 0;
        if (o + E <= end) {
          mx = adam_fp8_unit<G, E>(p, g, m, v, sh, o, c, in ? qk + o : nullptr, sk);
        } else {
          for (long long i = o; i < end; ++i)
            mx = max(mx, adam_fp8_unit<G, 1>(p, g, m, v, sh, i, c, in ? qk + i : nullptr, sk));
        }
        if (in && mx) atomicMax(R.hist(k) + 1, mx);
      }
    }
  }
  if (bk >= 0) block_amax(bm, R.hist(bk) + 1, nullptr);
  else __syncthreads();  // (block_amax's own barrier otherwise: every thread reaches the ticket after the maxes)
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int k = threadIdx.x; k < R.n; k += blockDim.x) {
    unsigned* h = R.hist(k);
    *R.sinv(k) = __frcp_rn(R.scale(k));
    const unsigned a = atomicExch(h + 1, 0u);
    atomicExch(h, a);
  }
  if (threadIdx.x == 0) atomicExch(ticket, 0u);
}

#define ADAM_FP8_ENTRY(G, GN, VEC, VS)                                                                         \
  CK_ENTRY(__launch_bounds__(256), adam_fp8_##GN##_##VS)(                                                       \
      float* p, const G* g, float* m, float* v, bf16* sh, long long n, int nseg, const long long* lohi,        \
      const unsigned long long* ptrs, float fmax_m, unsigned* ticket, ADAM_ARGS) {                             \
    const AdamCoef c = ADAM_COEF;                                                                              \
    if (c.bad) return adam_report(err, c.bad);                                                                 \
    adam_fp8_dense<G, VEC>(p, g, m, v, sh, n, c, Fp8Ranges{nseg, lohi, ptrs, fmax_m}, ticket);                 \
  }
ADAM_FP8_ENTRY(float, f32, true, v)
ADAM_FP8_ENTRY(float, f32, false, s)
ADAM_FP8_ENTRY(bf16, bf16, true, v)
ADAM_FP8_ENTRY(bf16, bf16, false, s)

// ---- zero_rows: buf[rows[i], :] = 0 for i < min(*row_count, capacity); same grid shape as adam_rows.
template <typename T, bool VEC>
__device__ __forceinline__ void zero_rows(T* __restrict__ buf, const int* __restrict__ rows, int count, long long V,
                                          int D) {
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  const int units = D / E;
  Pack<T, E> z;
#pragma unroll
  for (int i = 0; i < E; ++i) z.v[i] = from_f32<T>(0.f);
  for (long long i = (long long)blockIdx.x * blockDim.y + threadIdx.y; i < count;
       i += (long long)gridDim.x * blockDim.y) {
    const int r = rows[i];
    if (r < 0 || r >= V) continue;
    T* row = buf + (long long)r * D;
    for (int u = threadIdx.x; u < units; u += blockDim.x) store_pack<T, E>(row + (long long)u * E, z);
  }
}

#define ZERO_ROWS_ENTRY(T, TN, VEC, VS)                                                                       \
  CK_ENTRY(__launch_bounds__(256), zero_rows_##TN##_##VS)(                                                    \
      T* buf, const int* rows, const int* row_count, int capacity, long long V, int D) {                      \
    const int count = clamp_count(row_count, capacity);                                                       \
    if ((long long)blockIdx.x * blockDim.y >= count) return;                                                  \
    zero_rows<T, VEC>(buf, rows, count, V, D);                                                                \
  }
ZERO_ROWS_ENTRY(float, f32, true, v)
ZERO_ROWS_ENTRY(float, f32, false, s)
ZERO_ROWS_ENTRY(bf16, bf16, true, v)
ZERO_ROWS_ENTRY(bf16, bf16, false, s)

// ---- global_norm stage 1: part[blockIdx.x] = sum of x^2 over this block's grid-stride share (256 threads).
template <typename T, bool VEC>
__device__ __forceinline__ void sumsq_partial(const T* __restrict__ x, long long n, float* __restrict__ part) {
  __shared__ float scratch[32];
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  float acc = 0.f;
  long long done = 0;
  if constexpr (VEC) {
    const long long units = n / E;
#pragma unroll 4
    for (long long u = tid; u < units; u += stride) {
      const Pack<T, E> r = load_pack<T, E>(x + u * E);
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const float f = to_f32(r.v[i]);
        acc = fmaf(f, f, acc);
      }
    }
    done = units * E;
  }
  for (long long i = done + tid; i < n; i += stride) {
    const float f = to_f32(x[i]);
    acc = fmaf(f, f, acc);
  }
  acc = row_sum(acc, scratch);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

#define SUMSQ_ENTRY(T, TN, VEC, VS)                                                                           \
  CK_ENTRY(__launch_bounds__(256), sumsq_partial_##TN##_##VS)(const T* x, long long n, float* part) {         \
    sumsq_partial<T, VEC>(x, n, part);                                                                        \
  }
SUMSQ_ENTRY(float, f32, true, v)
SUMSQ_ENTRY(float, f32, false, s)
SUMSQ_ENTRY(bf16, bf16, true, v)
SUMSQ_ENTRY(bf16, bf16, false, s)

// ---- global_norm stage 1 over listed rows of a (V, D) matrix (a sparse-row embedding gradient, zero elsewhere):
// part[blockIdx.x] = sum of x[r, :]^2 over rows r = rows[i], i = blockIdx.x, blockIdx.x + gridDim.x, ... below
// min(*count, capacity); rows outside [0, V) are skipped (as the NumPy path). A B4 x T64 step touches ~256 of
// 128256 rows: 2 MB read instead of the whole 1.05 GB fp32 buffer (0.25 ms on an H200).
template <typename T, bool VEC>
__device__ __forceinline__ void sumsq_rows_partial(const T* __restrict__ x, const int* __restrict__ rows,
                                                   const int* __restrict__ count, int capacity, int V, int D,
                                                   float* __restrict__ part) {
  __shared__ float scratch[32];
  constexpr int E = VEC ? 16 / sizeof(T) : 1;
  const int n = min(max(*count, 0), capacity);
  float acc = 0.f;
  for (int i = blockIdx.x; i < n; i += gridDim.x) {
    const int r = rows[i];
    if (r < 0 || r >= V) continue;
    const T* row = x + (long long)r * D;
    for (int u = threadIdx.x; u < D / E; u += blockDim.x) {
      const Pack<T, E> p = load_pack<T, E>(row + u * E);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float f = to_f32(p.v[e]);
        acc = fmaf(f, f, acc);
      }
    }
  }
  acc = row_sum(acc, scratch);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

#define SUMSQ_ROWS_ENTRY(T, TN, VEC, VS)                                                                      \
  CK_ENTRY(__launch_bounds__(256), sumsq_rows_partial_##TN##_##VS)(                                           \
      const T* x, const int* rows, const int* count, int capacity, int V, int D, float* part) {               \
    sumsq_rows_partial<T, VEC>(x, rows, count, capacity, V, D, part);                                         \
  }
SUMSQ_ROWS_ENTRY(float, f32, true, v)
SUMSQ_ROWS_ENTRY(float, f32, false, s)
SUMSQ_ROWS_ENTRY(bf16, bf16, true, v)
SUMSQ_ROWS_ENTRY(bf16, bf16, false, s)

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- global_norm stage 2: one block of 1024 threads; out = sqrt(sum of part[0:nparts]) (0 when nparts == 0).
CK_ENTRY(__launch_bounds__(1024), sumsq_final)(const float* part, long long nparts, float* out) {
  __shared__ double s[32];
  double acc = 0.0;
  for (long long i = threadIdx.x; i < nparts; i += blockDim.x) acc += (double)part[i];
  acc = warp_sum_f64(acc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) s[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < (int)(blockDim.x >> 5) ? s[lane] : 0.0;
    acc = warp_sum_f64(acc);
    if (lane == 0) out[0] = (float)sqrt(acc);
  }
}

// ---- clip_scale: out = min(1, max_norm / (norm + 1e-6)) in fp32; a NaN norm gives NaN (as torch's clamp).
CK_ENTRY(, adam_clip_scale)(const float* norm, float* out, float max_norm) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const float s = max_norm / (norm[0] + 1e-6f);
  out[0] = s > 1.f ? 1.f : s;
}

// ---- the optimizer's device clock: step += increment; with schedule != 0, lr = warmup-cosine(step).
//   t <= warmup:  lr = max_lr * t / warmup
//   else:         q = clamp((t - warmup) / (total - warmup), 0, 1); lr = min_lr + (max_lr - min_lr) (1 + cos(pi q)) / 2  (cospi: no big-argument reduction, no local memory)
CK_ENTRY(, adam_tick)(int* step, float* lr, int increment, int schedule, double max_lr,
                      double min_lr, long long warmup, long long total) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const int t = *step + increment;
  *step = t;
  if (schedule == 0) return;
  double r;
  if (warmup > 0 && t <= warmup) {
    r = max_lr * (double)t / (double)warmup;
  } else {
    const long long span = total - warmup;
    double q = span > 0 ? (double)(t - warmup) / (double)span : 1.0;
    q = q < 0.0 ? 0.0 : (q > 1.0 ? 1.0 : q);
    r = min_lr + (max_lr - min_lr) * 0.5 * (1.0 + cospi(q));
  }
  *lr = (float)r;
}
