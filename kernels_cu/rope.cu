// Rotary position embedding on x [batch, seq, heads, D] (D even), cos/sin tables [L, D/2] fp32.
//
// For token (b, s) at position p = positions[b, s] (or positions[s], or s) and frequency i < D/2, with
// c = cos[p, i], sn = sin[p, i], each pair (x1, x2) of x is rotated by the angle p * inv_freq[i]:
//   y1 = x1 c - x2 sn
//   y2 = x2 c + x1 sn
//   rotate-half layout (Hugging Face, interleaved = false): pair i = elements (i, i + D/2)
//   interleaved layout (original RoPE / Meta):              pair i = elements (2i, 2i + 1)
//   backward: the rotation is orthogonal, so dx = R^T dy = rotation by -angle: the same kernel with sn -> -sn
//   (argument sgn = -1).
//
// Design: a thread owns one unit = P pairs of one token (P = 8 bf16 / 4 fp32 pairs in rotate-half: a 16-byte
// pack of x1 and the matching 16-byte pack of x2; P = 4 bf16 / 2 fp32 pairs interleaved: one 16-byte pack),
// reads its P cos and P sin values once, and loops over all heads of the token (U = 4 heads' packs loaded
// before any is stored), so the cos/sin table is read once per token rather than once per head: HBM traffic
// is x once and y once (bf16 LLaMA-3.2-1B q, 32 heads x 64: 4 KB + 4 KB per token) and the tables
// (seq x D/2 x 8 B) stay in L2. Consecutive threads take consecutive units of a token, so a warp's access for
// one head covers whole 32-byte sectors. The unit index j is split into (token, unit in token) with one
// 64-bit division per thread per token, amortised over the heads. <= 93 registers (ptxas sm_90, bf16
// rotate-half: 2 x 4 packs in flight), so >= 2 blocks of 256 threads per SM.
// VEC = false: element accesses (P = 1) for misaligned pointers or D/2 (rotate-half) / D (interleaved) not a
// multiple of 16 / sizeof(T). Positions outside [0, L) are clamped to the table (never a read outside it;
// the NumPy reference rejects them). In place (y == x) is safe: a thread reads its elements before writing
// them and no other thread touches them; no pointer to x or y is __restrict__.
// Token strides: x and y are [tokens, H, D] with the heads of a token contiguous and tokens xs / ys elements
// apart (H * D for a C-contiguous array; (H + 2 Hkv) * D for the q and k heads of a packed qkv projection, which
// one launch rotates in place: q and k are the first H + Hkv heads of each token).
#include "common/entry.cuh"
#include "common/vec.cuh"
#include "common/pointwise.cuh"

template <typename T, typename PT, bool IL, bool VEC>
__device__ __forceinline__ void rope_impl(const T* x, T* y, const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, const PT* __restrict__ positions,
                                          long long ntok, int S, int H, int D, int L, int pos_mode, float sgn,
                                          bool cs_vec, int hsplit, long long xs, long long ys) {
  constexpr int E = VEC ? 16 / sizeof(T) : (IL ? 2 : 1);  // elements per pack
  constexpr int P = IL ? E / 2 : E;                       // pairs per unit
  constexpr int U = 4;                                    // heads in flight
  const int half = D / 2;
  const int Du = IL ? D / E : half / E;  // units per token
  // A unit is (token, pack, head chunk): few tokens (B4 x T64 = 256 tokens x 4 packs) would otherwise give
  // 1024 threads that each walk 32 heads -- a latency-bound 6 us launch; the launcher splits the heads into
  // `hsplit` chunks so that a wave's threads are busy.
  const int hc = (H + hsplit - 1) / hsplit;
  const long long n = ntok * Du * hsplit;
  for (long long jj = (long long)blockIdx.x * blockDim.x + threadIdx.x; jj < n;
       jj += (long long)gridDim.x * blockDim.x) {
    const int hs = (int)(jj % hsplit);
    const long long j = jj / hsplit;
    const long long tok = j / Du;
    const int cu = (int)(j - tok * Du);
    const int hb = hs * hc, he = min(H, hb + hc);
    long long p;
    if (pos_mode == 0) p = tok % S;                       // arange(seq)
    else if (pos_mode == 1) p = (long long)positions[tok % S];  // positions [seq]
    else p = (long long)positions[tok];                   // positions [batch, seq]
    p = p < 0 ? 0 : (p >= L ? L - 1 : p);
    float c[P], sn[P];
    load_f32<P>(cos_t + p * half + cu * P, c, cs_vec);
    load_f32<P>(sin_t + p * half + cu * P, sn, cs_vec);
#pragma unroll
    for (int i = 0; i < P; ++i) sn[i] *= sgn;
    const long long xo = tok * xs + (long long)cu * E, yo = tok * ys + (long long)cu * E;  // head 0's pack
    for (int h0 = hb; h0 < he; h0 += U) {
      Chunk<T, E, VEC> a[U], b[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        if (h0 + k < he) {
          const T* src = x + xo + (long long)(h0 + k) * D;
          a[k].load(src);
          if (!IL) b[k].load(src + half);
        }
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        if (h0 + k < he) {
          T* dst = y + yo + (long long)(h0 + k) * D;
          if (IL) {
            float f[E];
#pragma unroll
            for (int i = 0; i < P; ++i) {
              const float x1 = a[k].get(2 * i), x2 = a[k].get(2 * i + 1);
              f[2 * i] = x1 * c[i] - x2 * sn[i];
              f[2 * i + 1] = x2 * c[i] + x1 * sn[i];
            }
            Chunk<T, E, VEC> o;
            o.pack(f);
            o.store(dst);
          } else {
            float f1[E], f2[E];
#pragma unroll
            for (int i = 0; i < P; ++i) {
              const float x1 = a[k].get(i), x2 = b[k].get(i);
              f1[i] = x1 * c[i] - x2 * sn[i];
              f2[i] = x2 * c[i] + x1 * sn[i];
            }
            Chunk<T, E, VEC> o1, o2;
            o1.pack(f1);
            o2.pack(f2);
            o1.store(dst);
            o2.store(dst + half);
          }
        }
      }
    }
  }
}

// Entry points: rope_<dtype>_<positions dtype>_<h|i>_<v|s>; h = rotate-half, i = interleaved. pos_mode: 0 =
// no positions (positions may be NULL), 1 = positions[seq], 2 = positions[batch, seq]. sgn = +1 forward,
// -1 backward.
#define ROPE_ONE(T, PT, TN, PN, IL, HI, VEC, VS)                                                              \
  CK_ENTRY(__launch_bounds__(256, 2), rope_##TN##_##PN##_##HI##_##VS)(                                         \
      const T* x, T* y, const float* cos_t, const float* sin_t, const PT* positions, long long ntok, int S,  \
      int H, int D, int L, int pos_mode, float sgn, bool cs_vec, int hsplit, long long xs, long long ys) {  \
    rope_impl<T, PT, IL, VEC>(x, y, cos_t, sin_t, positions, ntok, S, H, D, L, pos_mode, sgn, cs_vec, hsplit,  \
                              xs, ys);                                                                       \
  }
#define ROPE_LAYOUTS(T, PT, TN, PN)                                                                           \
  ROPE_ONE(T, PT, TN, PN, false, h, true, v)                                                                \
  ROPE_ONE(T, PT, TN, PN, false, h, false, s)                                                               \
  ROPE_ONE(T, PT, TN, PN, true, i, true, v)                                                                 \
  ROPE_ONE(T, PT, TN, PN, true, i, false, s)

ROPE_LAYOUTS(float, int, f32, i32)
ROPE_LAYOUTS(float, long long, f32, i64)
ROPE_LAYOUTS(bf16, int, bf16, i32)
ROPE_LAYOUTS(bf16, long long, bf16, i64)
