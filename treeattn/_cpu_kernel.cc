// treeattn's kernels for XLA:CPU, called through the XLA FFI: the "cpu" backend of
// treeattn.decode.flash_attention (fused attention with (out, lse)), the few-row matrix
// product of treeattn.models.matmul, SwiGLU's gate, a pre-norm block's MLP and a pre-norm
// attention's inputs (norm, q/k/v, rotary) on packed weights, and a KV cache's in-place write.
// treeattn compiles this file with the host's C++ compiler on first use (see _native.py).
//
// For each batch row and kv head, the query rows of that head (group * q_seq of them) walk the
// keys in blocks of kBlock with an online softmax: the logits of a block, then the rescaled
// accumulation of p * v. K and V are therefore streamed from memory exactly once, which is what
// decoding costs at best; XLA's dot kernels for the matrix-vector shapes of decoding stay well
// below memory speed on CPUs (docs/decode.md).
//
// Both passes work in register tiles of the target's vector width (GCC/Clang vector
// extensions, so one source serves AVX-512, AVX2 and SSE/NEON): the logits of kTile query rows
// against one key at a time for head dims of 64 and 128 (each K vector loaded once for the
// rows, the kTile dot products reduced together) and 4 keys at a time for the others (each Q
// vector also loaded once for the keys, the 4 * kTile dot products reduced together; keys of
// 32 on AVX-512 by lanes, the 128-bit lanes of the 4 keys transposed so that no sum is reduced
// across a whole vector; float32 keys of 32, when the rows come in whole tiles of 8, by rows:
// the rows in the lanes, each key element broadcast), and the values as kTile rows x NV vectors of
// accumulators held in registers across the keys of a block. With more rows than a tile, the
// tiles take turns over sub-blocks of a few KB, so the stream from memory runs through every
// tile's arithmetic.
// bfloat16 is widened as it is loaded, but with AVX512-BF16 the logits of keys of 32 and 64
// take the CPU's bfloat16 dot products 4 keys at a time, and values of a multiple of 32 with
// bfloat16 weights 2 keys at a time where no weight of the row tile is 0. A value row is read
// only if some query row gives it a nonzero weight, so masked slots (and weights that underflow
// to 0) never touch V: NaN in a slot no query sees stays out.
//
// Work items (batch row, kv head) are shared between the calling thread and XLA's intra-op
// thread pool through an atomic counter; the caller never waits for an item nobody started,
// so a saturated pool cannot deadlock it.

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 512;  // keys per block (a smaller block costs more per key)
// Vectors per step of the softmax's passes over a block's logits (timed alone in L1 with 8
// rows of 512 float32 logits: 0.86x the time of one vector per step).
constexpr int kUnroll = 4;
// Keys and values are prefetched this many slots ahead of the loads: the hardware prefetcher
// alone keeps too few lines in flight for the short rows of a head (a key of 64 bfloat16 is
// two cache lines) to stream at memory speed.
constexpr int64_t kAhead = 32;
// With more query rows than a register tile, the tiles take turns over sub-blocks of keys whose
// rows of keys or of values (the wider) fill this many bytes, at least 16 keys, so the first
// tile's pass streams a sub-block from memory and the others find it in L1, and the stream runs
// on through every tile's arithmetic rather than stopping while the later tiles re-read the
// block from L2. Timed in turns against whole blocks per tile (AVX-512, cold caches, 25
// rounds): 0.85-0.91x the time with 8 rows per kv head of 32 and 16 rows of 64 and 128 (there
// 16 keys, 8 KB) in float32, 0.96-1.00x in bfloat16; 2 KB and 6 KB did no better.
constexpr int64_t kSubBytes = 4096;

// A software prefetch of a row (a key, a value, a weight row) fills L2 (prefetcht1 on x86),
// except a row of at most one 64-byte cache line (bfloat16 keys and values of 32), which goes
// to L1. The likely cause: a prefetch into L1 holds one of L1's few miss buffers until its line
// arrives, and a product streaming several weight rows from memory stalls on them. Timed in
// turns on cold memory (AMD EPYC, AVX-512; the AVX2, SSE and NEON builds follow the same rule
// untimed), L2 against L1: products of 3 and 8 rows took 0.53-0.81x and 0.61-0.98x the time,
// of one row 0.88-1.04x; decode steps with float32 keys 0.91-1.00x, bfloat16 keys of 128 0.89x
// and of 64 1.00x; with bfloat16 keys of 32, L1 took 0.79-0.95x the time of L2. Past the end
// of a buffer: no fault.
inline void prefetch_row(const void* p, int64_t row_bytes) {
  if (row_bytes <= 64) {
    __builtin_prefetch(p, 0, 3);
  } else {
    __builtin_prefetch(p, 0, 2);
  }
}
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The vector width of the target (-march=native): kLanes floats per register, and kTile query
// rows per register tile (AVX-512 has 32 vector registers, AVX2 and SSE 16).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kTile = 4;
#elif defined(__AVX__)
constexpr int kLanes = 8;
constexpr int kTile = 2;
#else
constexpr int kLanes = 4;
constexpr int kTile = 2;
#endif

typedef float vf32 __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi32 __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vu16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// Lane permutations of two vectors with constant indices (Clang and GCC spell it differently).
#if defined(__clang__)
#define TREEATTN_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define TREEATTN_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi32{__VA_ARGS__})
#endif

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {  // bfloat16
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // bfloat16, round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof x);
  if (std::isnan(x)) {
    *p = 0x7FC0;
    return;
  }
  bits += 0x7FFF + ((bits >> 16) & 1);
  *p = static_cast<uint16_t>(bits >> 16);
}

// kLanes consecutive elements (unaligned), as float32.
inline vf32 vload(const float* p) {
  vf32 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline vf32 vload(const uint16_t* p) {  // bfloat16: the upper half of a float32
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  const vu32 bits = __builtin_convertvector(h, vu32) << 16;
  vf32 x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
inline void vstore(float* p, vf32 x) { std::memcpy(p, &x, sizeof x); }
// Every lane x. x - 0 is x for every x, so this is one broadcast; 0 + x is not (-0 + 0 = +0),
// and the compiler kept a scalar add before the broadcast of every weight in the value
// products.
inline vf32 splat(float x) { return x - vf32{}; }
inline vf32 as_float(vi32 x) {
  vf32 y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}
inline vi32 as_int(vf32 x) {
  vi32 y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}
// Lanes of a where mask (all ones or zeros per lane, as comparisons give) is set, else of b.
inline vf32 select(vi32 mask, vf32 a, vf32 b) {
  return as_float((mask & as_int(a)) | (~mask & as_int(b)));
}

// x as stored in T: float32 unchanged; bfloat16 rounded to nearest even (as `store`), NaN
// kept NaN.
inline vf32 vround(vf32 x, const float*) { return x; }
inline vf32 vround(vf32 x, const uint16_t*) {
  vu32 bits;
  std::memcpy(&bits, &x, sizeof bits);
  const vu32 r = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  vf32 y;
  std::memcpy(&y, &r, sizeof y);
  return select(x != x, splat(std::numeric_limits<float>::quiet_NaN()), y);
}
inline void vstore(uint16_t* p, vf32 x) {  // bfloat16, rounded as `store`
  vu32 bits;
  const vf32 r = vround(x, p);
  std::memcpy(&bits, &r, sizeof bits);
  const vu16 h = __builtin_convertvector(bits >> 16, vu16);
  std::memcpy(p, &h, sizeof h);
}

inline float hsum(vf32 x) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += x[i];
  return s;
}

// The sums of four vectors, reduced together: each step adds the two halves of a pair of
// vectors into one vector, so 4 reductions take log2(kLanes) + 1 shuffle-adds, not 4 * that.
inline void sum4(const vf32 (&x)[4], float* out) {
#if defined(__AVX512F__)
  const vf32 ab = TREEATTN_SHUFFLE(x[0], x[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                                   23) +
                  TREEATTN_SHUFFLE(x[0], x[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                   29, 30, 31);
  const vf32 cd = TREEATTN_SHUFFLE(x[2], x[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                                   23) +
                  TREEATTN_SHUFFLE(x[2], x[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                   29, 30, 31);
  // Quarters of 4 lanes: partial sums of x[0], x[1], x[2], x[3].
  vf32 q = TREEATTN_SHUFFLE(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           TREEATTN_SHUFFLE(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  q += TREEATTN_SHUFFLE(q, q, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  q += TREEATTN_SHUFFLE(q, q, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  out[0] = q[0], out[1] = q[4], out[2] = q[8], out[3] = q[12];
#elif defined(__AVX__)
  const vf32 ab = TREEATTN_SHUFFLE(x[0], x[1], 0, 1, 2, 3, 8, 9, 10, 11) +
                  TREEATTN_SHUFFLE(x[0], x[1], 4, 5, 6, 7, 12, 13, 14, 15);
  const vf32 cd = TREEATTN_SHUFFLE(x[2], x[3], 0, 1, 2, 3, 8, 9, 10, 11) +
                  TREEATTN_SHUFFLE(x[2], x[3], 4, 5, 6, 7, 12, 13, 14, 15);
  vf32 q = TREEATTN_SHUFFLE(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
           TREEATTN_SHUFFLE(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
  q += TREEATTN_SHUFFLE(q, q, 1, 0, 3, 2, 5, 4, 7, 6);
  out[0] = q[0], out[1] = q[2], out[2] = q[4], out[3] = q[6];
#else
  const vf32 ab = TREEATTN_SHUFFLE(x[0], x[1], 0, 1, 4, 5) + TREEATTN_SHUFFLE(x[0], x[1], 2, 3, 6, 7);
  const vf32 cd = TREEATTN_SHUFFLE(x[2], x[3], 0, 1, 4, 5) + TREEATTN_SHUFFLE(x[2], x[3], 2, 3, 6, 7);
  const vf32 q = TREEATTN_SHUFFLE(ab, cd, 0, 2, 4, 6) + TREEATTN_SHUFFLE(ab, cd, 1, 3, 5, 7);
  out[0] = q[0], out[1] = q[1], out[2] = q[2], out[3] = q[3];
#endif
}

// exp(x) for x <= 0 (logits minus their running max): Cephes' single-precision polynomial
// after a reduction by powers of 2 (relative error ~1e-7). Exactly 0 below -87.3 (and at
// -inf, a masked logit), exactly 1 at 0, NaN for NaN. With AVX-512 the reduction rounds by
// one instruction and 2^n is one scaling by n with the zeros masked in (14 vector operations,
// 23 in the portable form): the softmax of a block took 0.67x the time (alone, in L1).
inline vf32 exp_nonpositive(vf32 x) {
#if defined(__AVX512F__)
  __m512 v;
  std::memcpy(&v, &x, sizeof v);
  // Lanes kept: x >= -87.3, or NaN (which stays NaN).
  const __mmask16 kept = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.3f), _CMP_NLT_UQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512 e = _mm512_maskz_scalef_ps(kept, y, n);
  vf32 out;
  std::memcpy(&out, &e, sizeof out);
  return out;
#else
  const vi32 tiny = x < splat(-87.3f);
  const vf32 xc = select(tiny, splat(-87.3f), x);
  const vf32 t = xc * splat(1.44269504088896341f) + splat(0.5f);
  vf32 fx = __builtin_convertvector(__builtin_convertvector(t, vi32), vf32);  // trunc
  fx += as_float((fx > t) & as_int(splat(-1.0f)));  // floor
  vf32 r = xc - fx * splat(0.693359375f);
  r -= fx * splat(-2.12194440e-4f);
  vf32 y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * r * r + r + splat(1.0f);
  const vi32 scale = (__builtin_convertvector(fx, vi32) + 127) << 23;  // 2^fx
  return select(tiny, splat(0.0f), y * as_float(scale));
#endif
}

// Scalar fallbacks for head dims that are not a multiple of kLanes.
template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t d) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * load(k + i);
  return acc;
}

template <typename T>
inline void axpy(float a, const T* __restrict x, float* __restrict y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += a * load(x + i);
}

// acc[r][j] += x[r] . w[j] over the first n elements (rounded down to whole vectors) for R rows
// of x (stride xs) and N rows of w (stride ws): each w vector is loaded once for all R rows,
// each x vector once for all N. The memory `ahead` elements past each w load is prefetched.
// Both the logits (R query rows, N keys) and the few-row products (R input rows, N weight
// rows) are this loop.
template <int R, int N, typename T>
__attribute__((always_inline)) inline void tile_dots(const float* __restrict x, int64_t xs,
                                                     const T* __restrict w, int64_t ws, int64_t n,
                                                     int64_t ahead, vf32 (&acc)[R][4]) {
  const int64_t row_bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t c = 0; c + kLanes <= n; c += kLanes) {
    vf32 wv[N];
    for (int j = 0; j < N; ++j) {
      prefetch_row(w + j * ws + ahead + c, row_bytes);
      wv[j] = vload(w + j * ws + c);
    }
    for (int r = 0; r < R; ++r) {
      const vf32 xv = vload(x + r * xs + c);
      for (int j = 0; j < N; ++j) acc[r][j] += xv * wv[j];
    }
  }
}

// Logits of RT query rows (q: scaled, row stride qk) against NK keys (k: key stride ks) into
// s[r * kBlock + j]. DQ is qk when known at compile time (the common head dims), else 0.
template <int RT, int NK, int DQ, typename T>
inline void dots(const float* __restrict q, int64_t qk, const T* __restrict k, int64_t ks,
                 float* __restrict s) {
  vf32 acc[RT][4] = {};
  tile_dots<RT, NK>(q, qk, k, ks, DQ ? DQ : qk, kAhead * ks, acc);
  for (int r = 0; r < RT; ++r) {
    if constexpr (NK == 4) {
      sum4(acc[r], s + r * kBlock);
    } else {
      for (int j = 0; j < NK; ++j) s[r * kBlock + j] = hsum(acc[r][j]);
    }
  }
}

// The logits of RT <= 4 query rows against one key, the rows' sums reduced together.
template <int RT, int DQ, typename T>
inline void dots_one_key(const float* __restrict q, const T* __restrict k, int64_t ks,
                         float* __restrict s) {
  static_assert(RT <= 4, "one sum4 reduces the rows of a tile");
  vf32 acc[RT][4] = {};
  tile_dots<RT, 1>(q, DQ, k, ks, DQ, kAhead * ks, acc);
  vf32 rows[4] = {};  // the unused ones are zero
  for (int r = 0; r < RT; ++r) rows[r] = acc[r][0];
  float sums[4];
  sum4(rows, sums);
  for (int r = 0; r < RT; ++r) s[r * kBlock] = sums[r];
}

#if defined(__AVX512F__)
// Keys by lanes: the logits of RT <= 4 query rows against 4 keys with no reduction across a
// whole vector per (row, key). The 128-bit lanes of the 4 keys are transposed (u[i] holds lane
// i of every key: 8 shuffles per vector of a key, shared by the rows), and each row's lane i
// comes broadcast to all 4 lanes (qx, laid out once per call), so one multiply-add (a bfloat16
// dot product) per row and vector leaves each key's partial sums in its own 4 lanes; the
// 4 rows x 4 keys are then reduced together by 3 shuffle-adds, where `dots` reduces each
// (row, key) across 16 lanes. Keys of 32 only: timed in turns against `dots` / `dots_bf16`
// (cold caches, 41 rounds), 0.96-0.97x the time in float32 (8 rows per kv head, which now go
// by rows) and 0.85-0.98x in bfloat16 (3-8 rows); bfloat16 keys of 64 took 1.04x.
// qx: per row r, vector c of the key, lane i, the E / 4 elements of that lane repeated 4 times
// (E = 16 float32 or 32 bfloat16 elements per vector): qx[((r * C + c) * 4 + i) * E].
template <int RT, int C, typename T>
inline void dots_by_lanes(const T* __restrict qx, const T* __restrict k, int64_t ks,
                          float scale, float* __restrict s) {
  static_assert(RT <= 4, "one reduction takes 4 rows");
  constexpr int E = 64 / sizeof(T);
  constexpr int64_t row_bytes = C * 64;
  __m512 acc[4];
  for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_ps();
  for (int c = 0; c < C; ++c) {
    __m512i x[4];
    for (int j = 0; j < 4; ++j) {
      prefetch_row(k + (j + kAhead) * ks + c * E, row_bytes);
      x[j] = _mm512_loadu_si512(k + j * ks + c * E);
    }
    const __m512i t0 = _mm512_shuffle_i32x4(x[0], x[1], 0x88);  // lanes 0, 2 of keys 0, 1
    const __m512i t1 = _mm512_shuffle_i32x4(x[0], x[1], 0xDD);  // lanes 1, 3
    const __m512i t2 = _mm512_shuffle_i32x4(x[2], x[3], 0x88);
    const __m512i t3 = _mm512_shuffle_i32x4(x[2], x[3], 0xDD);
    const __m512i u[4] = {_mm512_shuffle_i32x4(t0, t2, 0x88), _mm512_shuffle_i32x4(t1, t3, 0x88),
                          _mm512_shuffle_i32x4(t0, t2, 0xDD), _mm512_shuffle_i32x4(t1, t3, 0xDD)};
    for (int i = 0; i < 4; ++i) {
      for (int r = 0; r < RT; ++r) {
        const __m512i qv = _mm512_loadu_si512(qx + ((r * C + c) * 4 + i) * E);
        if constexpr (std::is_same_v<T, uint16_t>) {
#if defined(__AVX512BF16__)
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)qv, (__m512bh)u[i]);
#else
          static_assert(!std::is_same_v<T, uint16_t>, "bfloat16 keys by lanes need AVX512-BF16");
#endif
        } else {
          acc[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(qv), _mm512_castsi512_ps(u[i]), acc[r]);
        }
      }
    }
  }
  vf32 a[4];
  for (int r = 0; r < 4; ++r) std::memcpy(&a[r], &acc[r], sizeof a[r]);
  // Each key's 4 lanes: pairs of lanes first (rows 0, 1 and rows 2, 3), then the pairs.
  const vf32 t01 = TREEATTN_SHUFFLE(a[0], a[1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                                    28, 29) +
                   TREEATTN_SHUFFLE(a[0], a[1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                                    30, 31);
  const vf32 t23 = TREEATTN_SHUFFLE(a[2], a[3], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                                    28, 29) +
                   TREEATTN_SHUFFLE(a[2], a[3], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                                    30, 31);
  // Lane 4 r + j: row r, key j.
  vf32 f = TREEATTN_SHUFFLE(t01, t23, 0, 4, 8, 12, 2, 6, 10, 14, 16, 20, 24, 28, 18, 22, 26, 30) +
           TREEATTN_SHUFFLE(t01, t23, 1, 5, 9, 13, 3, 7, 11, 15, 17, 21, 25, 29, 19, 23, 27, 31);
  if constexpr (std::is_same_v<T, uint16_t>) f *= scale;
  float sums[16];  // Clang takes no address of a vector's element
  std::memcpy(sums, &f, sizeof sums);
  for (int r = 0; r < RT; ++r) std::memcpy(s + r * kBlock, sums + 4 * r, 4 * sizeof(float));
}

// By rows: the logits of 8 query rows against 8 float32 keys of 32 with no sum reduced across
// lanes. Each element of a key, broadcast from memory, multiplies that dimension of the
// 8 rows (qt: the rows scaled and transposed, qt[c * 8 + r], one 8-lane vector per dimension,
// loaded once for the 8 keys), so the keys keep their [slots, d] rows; the 8 keys x 8 rows are
// then transposed into the rows of s (24 shuffles for 64 logits). 32 half-width multiply-adds
// per key, where `dots_by_lanes` adds 8 shuffles per key and the reductions. Timed alone in L1
// (8 rows, 512 keys): 19 cycles per key against 27; one attention call at 8:1 and 32K keys,
// warm in L3, in turns (13 rounds): 0.91x the time (median; 0.83-1.05x); from memory, no
// difference beyond the noise.
inline void dots_by_rows(const float* __restrict qt, const float* __restrict k, int64_t ks,
                         float* __restrict s) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) {
    prefetch_row(k + (j + kAhead) * ks, 128);
    prefetch_row(k + (j + kAhead) * ks + 16, 128);
    acc[j] = _mm256_setzero_ps();
  }
#pragma GCC unroll 32
  for (int c = 0; c < 32; ++c) {
    const __m256 qc = _mm256_loadu_ps(qt + c * 8);
    for (int j = 0; j < 8; ++j)
      acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(k + j * ks + c), qc, acc[j]);
  }
  const __m256 t0 = _mm256_unpacklo_ps(acc[0], acc[1]), t1 = _mm256_unpackhi_ps(acc[0], acc[1]);
  const __m256 t2 = _mm256_unpacklo_ps(acc[2], acc[3]), t3 = _mm256_unpackhi_ps(acc[2], acc[3]);
  const __m256 t4 = _mm256_unpacklo_ps(acc[4], acc[5]), t5 = _mm256_unpackhi_ps(acc[4], acc[5]);
  const __m256 t6 = _mm256_unpacklo_ps(acc[6], acc[7]), t7 = _mm256_unpackhi_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(s + 0 * kBlock, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(s + 1 * kBlock, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(s + 2 * kBlock, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(s + 3 * kBlock, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(s + 4 * kBlock, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(s + 5 * kBlock, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(s + 6 * kBlock, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(s + 7 * kBlock, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

// qx: the rows laid out for dots_by_lanes (float32 keys of 32 with AVX-512), else null.
template <int RT, int DQ, typename T>
void logits_tile(const float* q, const float* qx, int64_t qk, const T* k, int64_t ks, int64_t n,
                 float* s) {
  if constexpr (DQ >= 64) {
    // Head dims of 64 and 128 stream one key at a time: 4 keys at once read 4 rows in step,
    // 4 interleaved streams, which a cold cache serves more slowly than one. Timed in turns on
    // a cold cache (AVX-512), one key at a time took 0.71-0.96x the time of 4 (1 to 16 query
    // rows per kv head, float32 and bfloat16). Keys of 32 keep 4 per step, whose sums are
    // reduced together (one key at a time was mixed there: slightly faster in float32, slower
    // in bfloat16).
    for (int64_t i = 0; i < n; ++i) dots_one_key<RT, DQ>(q, k + i * ks, ks, s + i);
    return;
  }
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (DQ == 32 && std::is_same_v<T, float>) {
    if (qx)
      for (; i + 4 <= n; i += 4) dots_by_lanes<RT, 2>(qx, k + i * ks, ks, 1.0f, s + i);
  }
#endif
  for (; i + 4 <= n; i += 4) dots<RT, 4, DQ>(q, qk, k + i * ks, ks, s + i);
  switch (n - i) {
    case 3: dots<RT, 3, DQ>(q, qk, k + i * ks, ks, s + i); break;
    case 2: dots<RT, 2, DQ>(q, qk, k + i * ks, ks, s + i); break;
    case 1: dots<RT, 1, DQ>(q, qk, k + i * ks, ks, s + i); break;
    default: break;
  }
}

#if defined(__AVX512BF16__)
// The bfloat16 form of `tile_dots`, with the CPU's bfloat16 dot products (AVX512-BF16): each
// instruction multiplies 32 pairs and adds them into 16 float32 sums, so neither operand is
// widened. Over the first n elements rounded down to 32; the bfloat16 logits and the bfloat16
// few-row products are this loop.
template <int R, int N>
__attribute__((always_inline)) inline void tile_dots_bf16(const uint16_t* __restrict x,
                                                          int64_t xs,
                                                          const uint16_t* __restrict w,
                                                          int64_t ws, int64_t n, int64_t ahead,
                                                          __m512 (&acc)[R][4]) {
  const int64_t row_bytes = n * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t c = 0; c + 32 <= n; c += 32) {
    __m512bh wv[N];
    for (int j = 0; j < N; ++j) {
      prefetch_row(w + j * ws + ahead + c, row_bytes);
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * ws + c);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * xs + c);
      for (int j = 0; j < N; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
}

// Logits of RT <= 4 bfloat16 query rows (unscaled, row stride qk, a multiple of 32) against NK
// bfloat16 keys, with the CPU's bfloat16 dot products: each instruction multiplies 32 pairs
// exactly and adds them into 16 float32 sums, so neither operand is widened; the scale
// multiplies the reduced sums. NK = 1: the rows' sums are reduced together.
template <int RT, int NK>
inline void dots_bf16(const uint16_t* __restrict q, int64_t qk, const uint16_t* __restrict k,
                      int64_t ks, float scale, float* __restrict s) {
  static_assert(RT <= 4 && NK <= 4, "one sum4 reduces a tile's rows or keys");
  __m512 acc[RT][4];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  tile_dots_bf16<RT, NK>(q, qk, k, ks, qk, kAhead * ks, acc);
  float sums[4];
  if constexpr (NK == 1) {
    vf32 rows[4] = {};  // the unused ones are zero
    for (int r = 0; r < RT; ++r) std::memcpy(&rows[r], &acc[r][0], sizeof rows[r]);
    sum4(rows, sums);
    for (int r = 0; r < RT; ++r) s[r * kBlock] = scale * sums[r];
  } else {
    for (int r = 0; r < RT; ++r) {
      vf32 keys[4] = {};
      for (int j = 0; j < NK; ++j) std::memcpy(&keys[j], &acc[r][j], sizeof keys[j]);
      sum4(keys, sums);
      for (int j = 0; j < NK; ++j) s[r * kBlock + j] = scale * sums[j];
    }
  }
}

// The logits of RT rows against a block of n bfloat16 keys of 32 or 64 elements (rows of at
// most 2 cache lines), 4 keys at a time and a tail of one at a time. Timed in turns against
// widening the keys (cold caches, 1-16 query rows per kv head): 0.81-0.87x the time for keys
// of 32, 0.82-0.86x for keys of 64. Keys of 128 keep the widened form, one key at a time: with
// bfloat16 products 4 keys in step took 0.96-1.34x its time, one key 1.03-1.13x.
// qx: the rows laid out for dots_by_lanes (keys of 32), else null.
template <int RT>
void block_logits_bf16(const uint16_t* q, const uint16_t* qx, int64_t qk, const uint16_t* k,
                       int64_t ks, int64_t n, float scale, float* s) {
  int64_t i = 0;
  if (qx) {
    for (; i + 4 <= n; i += 4) dots_by_lanes<RT, 1>(qx, k + i * ks, ks, scale, s + i);
  } else {
    for (; i + 4 <= n; i += 4) dots_bf16<RT, 4>(q, qk, k + i * ks, ks, scale, s + i);
  }
  for (; i < n; ++i) dots_bf16<RT, 1>(q, qk, k + i * ks, ks, scale, s + i);
}
#endif

// qx: the rows laid out for dots_by_lanes (float32 keys of 32 with AVX-512), else null.
template <int RT, typename T>
void block_logits(const float* q, const float* qx, int64_t qk, const T* k, int64_t ks, int64_t n,
                  float* s) {
  if (qk == 32) return logits_tile<RT, 32>(q, qx, qk, k, ks, n, s);
  if (qk == 64) return logits_tile<RT, 64>(q, nullptr, qk, k, ks, n, s);
  if (qk == 128) return logits_tile<RT, 128>(q, nullptr, qk, k, ks, n, s);
  logits_tile<RT, 0>(q, nullptr, qk, k, ks, n, s);
}

// acc[r] += sum_i p[r][i] v[i] for RT rows (p: row stride kBlock; acc: row stride dv), in column
// tiles of NV vectors held in registers across the n keys. `dense`: no weight is 0, so no key
// is tested; otherwise a value row is loaded only for a key some row weighs, and only rows with
// a nonzero weight add it (0 * NaN would be NaN).
template <int RT, int NV, typename T>
void weigh_tile(const float* __restrict p, int64_t n, const T* __restrict v, int64_t vs,
                int64_t dv, bool dense, float* __restrict acc) {
  const int64_t row_bytes = dv * static_cast<int64_t>(sizeof(T));
  for (int64_t c0 = 0; c0 < dv; c0 += NV * kLanes) {
    vf32 a[RT][NV];
    for (int r = 0; r < RT; ++r)
      for (int t = 0; t < NV; ++t) a[r][t] = vload(acc + r * dv + c0 + t * kLanes);
    if (dense) {
      // With fewer than 8 sums in registers, the multiply-adds into each wait on the previous
      // one (4 cycles): even and odd keys then go into two sets of sums.
      constexpr int kSets = RT * NV < 8 ? 2 : 1;
      vf32 b[RT][NV] = {};
      int64_t i = 0;
      for (; i + kSets <= n; i += kSets) {
        for (int u = 0; u < kSets; ++u) {
          vf32 vv[NV];
          for (int t = 0; t < NV; ++t) {
            prefetch_row(v + (i + u + kAhead) * vs + c0 + t * kLanes, row_bytes);
            vv[t] = vload(v + (i + u) * vs + c0 + t * kLanes);
          }
          for (int r = 0; r < RT; ++r) {
            const vf32 w = splat(p[r * kBlock + i + u]);
            for (int t = 0; t < NV; ++t) {
              if (u == 0) {
                a[r][t] += w * vv[t];
              } else {
                b[r][t] += w * vv[t];
              }
            }
          }
        }
      }
      for (; i < n; ++i) {
        for (int r = 0; r < RT; ++r) {
          const vf32 w = splat(p[r * kBlock + i]);
          for (int t = 0; t < NV; ++t) a[r][t] += w * vload(v + i * vs + c0 + t * kLanes);
        }
      }
      if constexpr (kSets == 2) {
        for (int r = 0; r < RT; ++r)
          for (int t = 0; t < NV; ++t) a[r][t] += b[r][t];
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        bool any = false;
        for (int r = 0; r < RT; ++r) any |= p[r * kBlock + i] != 0.0f;
        if (!any) continue;
        vf32 vv[NV];
        for (int t = 0; t < NV; ++t) vv[t] = vload(v + i * vs + c0 + t * kLanes);
        for (int r = 0; r < RT; ++r) {
          const float w = p[r * kBlock + i];
          if (w == 0.0f) continue;
          for (int t = 0; t < NV; ++t) a[r][t] += splat(w) * vv[t];
        }
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int t = 0; t < NV; ++t) vstore(acc + r * dv + c0 + t * kLanes, a[r][t]);
  }
}

#if defined(__AVX512BF16__)
// acc[r] += sum_i p[r][i] v[i] for RT rows of bfloat16 weights (pb: row stride kBlock, zero past
// n) and bfloat16 values, by the CPU's bfloat16 dot products over pairs of keys: the rows of
// keys i and i + 1 are interleaved element by element (two shuffles per 32 elements), so that
// each 32-bit lane holds (v[i][e], v[i + 1][e]) and one instruction adds p[i] v[i][e] +
// p[i + 1] v[i + 1][e] into 16 float32 sums. The values are not widened and the weights are
// bfloat16, as a GPU's flash attention multiplies them; their normaliser stays float32. The
// shuffles work within 128-bit lanes, so the sums of a 32-element chunk sit in two vectors in a
// fixed order, permuted from and back to acc's once per block. Dense weights only (a pair adds
// 0 * v, which is NaN for a NaN value no row should see).
template <int RT, int NC>
void weigh_tile_bf16(const uint16_t* __restrict pb, int64_t n, const uint16_t* __restrict v,
                     int64_t vs, int64_t dv, float* __restrict acc) {
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi =
      _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i from_0 =
      _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i from_1 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const int64_t row_bytes = dv * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t c0 = 0; c0 < dv; c0 += NC * 32) {
    __m512 lo[RT][NC], hi[RT][NC];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < NC; ++c) {
        const __m512 a = _mm512_loadu_ps(acc + r * dv + c0 + c * 32);
        const __m512 b = _mm512_loadu_ps(acc + r * dv + c0 + c * 32 + 16);
        lo[r][c] = _mm512_permutex2var_ps(a, to_lo, b);
        hi[r][c] = _mm512_permutex2var_ps(a, to_hi, b);
      }
    auto pair = [&](int64_t i, bool second) {
      for (int c = 0; c < NC; ++c) {
        const uint16_t* row = v + i * vs + c0 + c * 32;
        prefetch_row(row + kAhead * vs, row_bytes);
        const __m512i a = _mm512_loadu_si512(row);
        const __m512i b = second ? _mm512_loadu_si512(row + vs) : _mm512_setzero_si512();
        if (second) prefetch_row(row + (kAhead + 1) * vs, row_bytes);
        const __m512bh l = (__m512bh)_mm512_unpacklo_epi16(a, b);
        const __m512bh h = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int r = 0; r < RT; ++r) {
          int32_t w;
          std::memcpy(&w, pb + r * kBlock + i, sizeof w);
          const __m512bh ws = (__m512bh)_mm512_set1_epi32(w);
          lo[r][c] = _mm512_dpbf16_ps(lo[r][c], l, ws);
          hi[r][c] = _mm512_dpbf16_ps(hi[r][c], h, ws);
        }
      }
    };
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) pair(i, true);
    if (i < n) pair(i, false);  // pb[n] is 0
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < NC; ++c) {
        _mm512_storeu_ps(acc + r * dv + c0 + c * 32,
                         _mm512_permutex2var_ps(lo[r][c], from_0, hi[r][c]));
        _mm512_storeu_ps(acc + r * dv + c0 + c * 32 + 16,
                         _mm512_permutex2var_ps(lo[r][c], from_1, hi[r][c]));
      }
  }
}

// weigh_tile_bf16 over rows of dv (a multiple of 32): whole rows in one pass where their sums
// fit in 16 registers (a second pass over a column tile re-reads the block's rows at a stride),
// else the widest tile of 8, 4, 2 or 1 chunks of 32 that divides the row and fits.
template <int RT>
void weigh_values_bf16(const uint16_t* pb, int64_t n, const uint16_t* v, int64_t vs, int64_t dv,
                       float* acc) {
  const int64_t chunks = dv / 32;
  if constexpr (RT == 1) {
    if (chunks % 8 == 0) return weigh_tile_bf16<RT, 8>(pb, n, v, vs, dv, acc);
  }
  if constexpr (RT <= 2) {
    if (chunks % 4 == 0) return weigh_tile_bf16<RT, 4>(pb, n, v, vs, dv, acc);
  }
  if (chunks % 2 == 0) return weigh_tile_bf16<RT, 2>(pb, n, v, vs, dv, acc);
  weigh_tile_bf16<RT, 1>(pb, n, v, vs, dv, acc);
}
#endif

template <int RT, typename T>
void weigh_values(const float* p, int64_t n, const T* v, int64_t vs, int64_t dv, bool dense,
                  float* acc) {
  // Whole value rows in one pass where the registers allow (a second pass over a column tile
  // re-reads the block's rows at a stride, slower than one sequential pass); otherwise the
  // widest tiles that divide the row.
  const int64_t nv = dv / kLanes;
  if constexpr (RT <= 2) {
    if (nv % 8 == 0) return weigh_tile<RT, 8>(p, n, v, vs, dv, dense, acc);
  }
  if (nv % 4 == 0) return weigh_tile<RT, 4>(p, n, v, vs, dv, dense, acc);
  if (nv == 3) return weigh_tile<RT, 3>(p, n, v, vs, dv, dense, acc);
  if (nv % 2 == 0) return weigh_tile<RT, 2>(p, n, v, vs, dv, dense, acc);
  weigh_tile<RT, 1>(p, n, v, vs, dv, dense, acc);
}

// Calls fn(std::integral_constant<int, RT>) for the rows of a tile of rt rows (1..kTile).
template <typename F>
inline void with_tile(int64_t rt, F fn) {
  switch (rt) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
#if defined(__AVX512F__)
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
#endif
    default: return;
  }
}

struct Dims {
  int64_t batch, q_seq, heads, qk, kv_heads, kv_seq, dv;
  bool bhsd, causal, has_pos;
  float scale;
  // A sliding window: a query at position i sees keys at i - left .. i + right (-1: no bound).
  int64_t left, right;
  int64_t group() const { return heads / kv_heads; }
  // Element offsets of (batch b, kv head h, slot s) in K (width w = qk or dv).
  int64_t kv_offset(int64_t b, int64_t h, int64_t s, int64_t w) const {
    return bhsd ? ((b * kv_heads + h) * kv_seq + s) * w : ((b * kv_seq + s) * kv_heads + h) * w;
  }
  // Elements from one slot to the next in K (width w).
  int64_t kv_stride(int64_t w) const { return bhsd ? w : kv_heads * w; }
};

// The running state of a (batch row, kv head) over a range of its keys, per query row r:
// max m[r], sum l[r], whether a NaN logit was seen, and the weighted values acc[r * dv ...].
struct Partial {
  float* m;
  float* l;
  char* nan_row;
  float* acc;
};

// The slots [first, end) a batch row with query offset `offset` and filled length `length`
// reads. Keys in position order (no kv_pos): slots past the filled length (or the last query,
// or the right edge of the last query's window) are not read, nor those before the first
// query's window. With kv_pos, every slot.
inline std::pair<int64_t, int64_t> read_slots(const Dims& d, int64_t offset, int64_t length) {
  if (d.has_pos) return {0, d.kv_seq};
  int64_t limit = length;
  if (d.causal) limit = std::min(limit, offset + d.q_seq);
  if (d.right >= 0) limit = std::min(limit, offset + d.q_seq + d.right);
  const int64_t end = std::clamp<int64_t>(limit, 0, d.kv_seq);
  const int64_t first = d.left >= 0 ? std::clamp<int64_t>(offset - d.left, 0, end) : 0;
  return {first, end};
}

// One (batch row, kv head), over split `split` of `splits` equal ranges of the keys it reads:
// rows r = j * q_seq + t for head h * group + j, query t.
template <typename T>
void attend(const Dims& d, int64_t b, int64_t h, int64_t split, int64_t splits, const T* q,
            const T* k, const T* v, const int32_t* q_offset, const int32_t* kv_length,
            const int32_t* kv_pos, const Partial& part) {
  const int64_t g = d.group(), rows = g * d.q_seq;
  const bool tiled_qk = d.qk % kLanes == 0, tiled_dv = d.dv % kLanes == 0;
  float* const m = part.m;
  float* const l = part.l;
  char* const nan_row = part.nan_row;
  float* const accp = part.acc;
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.0f);
  std::fill(nan_row, nan_row + rows, 0);
  std::fill(accp, accp + rows * d.dv, 0.0f);
  std::vector<float> qr(rows * d.qk);
#if defined(__AVX512BF16__)
  // bfloat16 queries as they are, for the bfloat16 dot products (head dims of 32 and 64).
  const bool bf16_dots = std::is_same_v<T, uint16_t> && (d.qk == 32 || d.qk == 64);
#else
  const bool bf16_dots = false;
#endif
  std::vector<uint16_t> qb(bf16_dots ? rows * d.qk : 0);
#if defined(__AVX512BF16__)
  // bfloat16 weights and values by the CPU's bfloat16 dot products (see weigh_tile_bf16).
  const bool bf16_values = std::is_same_v<T, uint16_t> && d.dv % 32 == 0;
  std::vector<uint16_t> pb(bf16_values ? rows * kBlock : 0);
#endif
  std::vector<float> s(rows * kBlock);  // logits, then weights: s[r * kBlock + i]
#if defined(__AVX512F__)
  // float32 keys of 32 with the rows in whole tiles of 8 go by rows (dots_by_rows); other keys
  // of 32 (float32, or bfloat16 by its dot products) by lanes (dots_by_lanes).
  const bool by_rows = std::is_same_v<T, float> && d.qk == 32 && rows % 8 == 0;
  const bool by_lanes = d.qk == 32 && !by_rows && (std::is_same_v<T, float> || bf16_dots);
#else
  const bool by_rows = false, by_lanes = false;
#endif
  std::vector<T> qx(by_lanes ? rows * d.qk * 4 : 0);
  std::vector<float> qt(by_rows ? rows * d.qk : 0);  // tile r0 / 8: qt[r0 * 32 + c * 8 + r]
  std::vector<int64_t> qpos(rows);
  std::vector<char> has_zero(rows);  // per row of the block: some weight is 0
  enum : char { kScalar, kSparse, kDense, kBf16 };
  std::vector<char> tile_weighs((rows + kTile - 1) / kTile);
  // Keys per sub-block (kSubBytes): a multiple of 16 (whole groups of 4 keys, even for the
  // bfloat16 pairs); one tile: the whole block.
  const int64_t row_bytes =
      std::max<int64_t>(std::max(d.qk, d.dv), 1) * static_cast<int64_t>(sizeof(T));
  const int64_t sub =
      rows > kTile ? std::clamp<int64_t>(kSubBytes / row_bytes / 16 * 16, 16, kBlock) : kBlock;
  const int64_t offset = q_offset[b], length = kv_length[b];
  for (int64_t j = 0; j < g; ++j) {
    for (int64_t t = 0; t < d.q_seq; ++t) {
      const int64_t r = j * d.q_seq + t;
      const T* src = q + ((b * d.q_seq + t) * d.heads + h * g + j) * d.qk;
      for (int64_t i = 0; i < d.qk; ++i) qr[r * d.qk + i] = load(src + i) * d.scale;
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (!qb.empty()) std::memcpy(qb.data() + r * d.qk, src, d.qk * sizeof(T));
      }
      qpos[r] = offset + t;
    }
  }
  if (by_lanes) {
    // qx[((r * C + c) * 4 + i) * E + m * E / 4 ...]: lane i of row r's vector c, in every m.
    constexpr int64_t E = 64 / sizeof(T), W = E / 4;
    const T* rows_in;
    if constexpr (std::is_same_v<T, float>) {
      rows_in = qr.data();
    } else {
      rows_in = qb.data();
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < d.qk / E; ++c)
        for (int64_t i = 0; i < 4; ++i)
          for (int64_t m = 0; m < 4; ++m)
            std::memcpy(qx.data() + ((r * (d.qk / E) + c) * 4 + i) * E + m * W,
                        rows_in + r * d.qk + c * E + i * W, W * sizeof(T));
  }
  for (int64_t r = 0; by_rows && r < rows; ++r)
    for (int64_t c = 0; c < d.qk; ++c) qt[(r / 8 * d.qk + c) * 8 + r % 8] = qr[r * d.qk + c];
  // Query positions run from offset to offset + q_seq - 1 in every head.
  const int64_t qmin = offset, qmax = offset + d.q_seq - 1;
  const auto [first, slots] = read_slots(d, offset, length);
  // This split's share of [first, slots).
  const int64_t per = (slots - first + splits - 1) / splits;
  const int64_t lo = std::min(slots, first + split * per), hi = std::min(slots, lo + per);
  const int32_t* pos_b = d.has_pos ? kv_pos + b * d.kv_seq : nullptr;
  const int64_t ks = d.kv_stride(d.qk), vs = d.kv_stride(d.dv);
  for (int64_t start = lo; start < hi; start += kBlock) {
    const int64_t n = std::min(kBlock, hi - start);
    const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
    const T* kb = k + d.kv_offset(b, h, start, d.qk);
    const T* vb = v + d.kv_offset(b, h, start, d.dv);
    // Without kv_positions, slot = position: a block every row sees from end to end needs no
    // per-key test (the common decoding case), one no row sees is skipped.
    const int64_t last = start + n - 1;
    bool whole = false;
    if (!d.has_pos) {
      if ((d.causal && start > qmax) || (d.left >= 0 && last < qmin - d.left) ||
          (d.right >= 0 && start > qmax + d.right))
        continue;
      whole = (!d.causal || last <= qmin) && (d.left < 0 || qmax - start <= d.left) &&
              (d.right < 0 || last - qmin <= d.right);
    }
    for (int64_t i0 = 0; i0 < n; i0 += sub) {
      const int64_t ns = std::min(sub, n - i0);
      const T* kbs = kb + i0 * ks;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {
        if (by_rows) {
          const int64_t whole8 = ns / 8 * 8;
          for (int64_t r0 = 0; r0 < rows; r0 += 8) {
            float* sr = s.data() + r0 * kBlock + i0;
            // Contiguous keys (the head-major cache) with the stride a constant: every load's
            // address is then one pointer plus a displacement. With the stride a variable the
            // compiler hoisted 256 offsets out of this loop, kept them on the stack and
            // reloaded one before each multiply-add (twice the loads of the products).
            if (ks == 32) {
              for (int64_t i = 0; i < whole8; i += 8)
                dots_by_rows(qt.data() + r0 * d.qk, kbs + i * 32, 32, sr + i);
            } else {
              for (int64_t i = 0; i < whole8; i += 8)
                dots_by_rows(qt.data() + r0 * d.qk, kbs + i * ks, ks, sr + i);
            }
            if (whole8 == ns) continue;
            for (int64_t t = 0; t < 8; t += 4)  // the last ns % 8 keys
              block_logits<4>(qr.data() + (r0 + t) * d.qk, nullptr, d.qk, kbs + whole8 * ks, ks,
                              ns - whole8, sr + t * kBlock + whole8);
          }
          continue;
        }
      }
#endif
      for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
        const int64_t rt = std::min<int64_t>(kTile, rows - r0);
        float* sr = s.data() + r0 * kBlock + i0;
        if (tiled_qk) {
          with_tile(rt, [&](auto tile) {
            constexpr int RT = decltype(tile)::value;
#if defined(__AVX512BF16__)
            if constexpr (std::is_same_v<T, uint16_t>) {
              if (bf16_dots) {
                const uint16_t* qxr = by_lanes ? qx.data() + r0 * d.qk * 4 : nullptr;
                return block_logits_bf16<RT>(qb.data() + r0 * d.qk, qxr, d.qk, kbs, ks, ns,
                                             d.scale, sr);
              }
            }
#endif
            const float* qxr = nullptr;
            if constexpr (std::is_same_v<T, float>) {
              if (by_lanes) qxr = qx.data() + r0 * d.qk * 4;
            }
            block_logits<RT>(qr.data() + r0 * d.qk, qxr, d.qk, kbs, ks, ns, sr);
          });
        } else {
          for (int64_t r = 0; r < rt; ++r)
            for (int64_t i = 0; i < ns; ++i)
              sr[r * kBlock + i] = dot(qr.data() + (r0 + r) * d.qk, kbs + i * ks, d.qk);
        }
      }
    }
    bool any = whole;
    if (!whole) {
      // Masked logits become -inf after the product, so a NaN in a slot no row sees is dropped.
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = pos_b ? pos_b[start + i] : start + i;
        for (int64_t r = 0; r < rows; ++r) {
          const bool visible = pos < length && (!d.causal || pos <= qpos[r]) &&
                               (d.left < 0 || qpos[r] - pos <= d.left) &&
                               (d.right < 0 || pos - qpos[r] <= d.right);
          if (!visible) s[r * kBlock + i] = kNegInf;
          any |= visible;
        }
      }
    }
    if (!any) continue;
    // The online softmax, one row at a time; lanes past n are padded with -inf (weight 0).
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s.data() + r * kBlock;
      std::fill(sr + n, sr + padded, kNegInf);
      // Four vectors per step into four maxima: one running max would wait on its own
      // compare and select every vector.
      vf32 vmax[kUnroll];
      for (int u = 0; u < kUnroll; ++u) vmax[u] = splat(kNegInf);
      vi32 nan = vi32{};
      for (int64_t i = 0; i < padded; i += kLanes * kUnroll) {
        for (int u = 0; u < kUnroll && i + u * kLanes < padded; ++u) {
          const vf32 x = vload(sr + i + u * kLanes);
          // A NaN logit (a NaN query or key the row sees) is recorded, so the row reads NaN
          // rather than "saw no key"; the max itself ignores it.
          nan |= x != x;
          vmax[u] = select(x > vmax[u], x, vmax[u]);
        }
      }
      // The four maxima merged lane-wise first: lane by lane they were a chain of 64 dependent
      // scalar maxima per row and block.
      for (int u = 1; u < kUnroll; ++u) vmax[0] = select(vmax[u] > vmax[0], vmax[u], vmax[0]);
      float block_max = kNegInf;
      bool has_nan = false;
      for (int i = 0; i < kLanes; ++i) {
        block_max = std::max(block_max, vmax[0][i]);
        has_nan |= nan[i] != 0;
      }
      if (has_nan) nan_row[r] = 1;
      const float m_new = std::max(m[r], block_max);
      if (m_new == kNegInf) {  // nothing visible to this row yet
        std::fill(sr, sr + padded, 0.0f);
        has_zero[r] = 1;
        continue;
      }
      if (m_new != m[r]) {
        const float alpha = std::exp(m[r] - m_new);  // 0 when m[r] was -inf
        float* a = accp + r * d.dv;
        for (int64_t i = 0; i < d.dv; ++i) a[i] *= alpha;
        l[r] *= alpha;
        m[r] = m_new;
      }
      // Four vectors per step, each exp a chain of dependent operations the core overlaps.
      vf32 total[kUnroll] = {};
      vi32 zeros = vi32{};  // -1 per weight that is 0 (masked, or underflowed)
      const vf32 shift = splat(m_new);
      for (int64_t i = 0; i < padded; i += kLanes * kUnroll) {
        for (int u = 0; u < kUnroll && i + u * kLanes < padded; ++u) {
          const vf32 p = exp_nonpositive(vload(sr + i + u * kLanes) - shift);
          vstore(sr + i + u * kLanes, p);
          total[u] += p;
          zeros += p == splat(0.0f);
        }
      }
      for (int u = 1; u < kUnroll; ++u) total[0] += total[u];
      l[r] += hsum(total[0]);
      int64_t zero = 0;
      for (int i = 0; i < kLanes; ++i) zero -= zeros[i];
      has_zero[r] = zero > padded - n;  // the padding past n is 0 by construction
    }
    // How each row tile weighs the values: kScalar (dv not a multiple of the vector width),
    // kSparse (some weight is 0), kDense, or kBf16 (the bfloat16 products, weights rounded once
    // for the whole block into pb).
    for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
      const int64_t rt = std::min<int64_t>(kTile, rows - r0);
      char& how = tile_weighs[r0 / kTile];
      if (!tiled_dv) {
        how = kScalar;
        continue;
      }
      bool dense = true;
      for (int64_t r = r0; r < r0 + rt; ++r) dense &= !has_zero[r];
      how = dense ? kDense : kSparse;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (dense && bf16_values) {
          const float* pr = s.data() + r0 * kBlock;
          uint16_t* pbr = pb.data() + r0 * kBlock;
          for (int64_t r = 0; r < rt; ++r)
            for (int64_t i = 0; i < padded; i += 16)
              _mm256_storeu_si256(
                  reinterpret_cast<__m256i*>(pbr + r * kBlock + i),
                  (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pr + r * kBlock + i)));
          how = kBf16;
        }
      }
#endif
    }
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      // Rows by rows (whole tiles of 8), float32 values of 32 and no weight 0: the sums of 8
      // rows fit in 16 registers, so each value row is loaded once for 8 rows rather than
      // once per tile of kTile, in one pass over the block (with more than 8 rows, by
      // sub-blocks the later tiles find in L1). With the keys' constant stride above and the
      // merged maxima, one attention call of 8 rows of 32 over 8K keys, warm in L3, took
      // 0.82x the time (8 rounds in turns, 0.64-0.89x). From memory the call is bound by the
      // stream: a decode step of 6 x 256 at 32K keys (8 query rows per kv head) read 0.94x
      // and 1.01x the time in two runs of 5 and 7 rounds, within the noise.
      bool dense8 = by_rows && d.dv == 2 * kLanes;
      for (int64_t r0 = 0; dense8 && r0 < rows; r0 += kTile)
        dense8 = tile_weighs[r0 / kTile] == kDense;
      if (dense8) {
        const int64_t step = rows == 8 ? n : sub;
        for (int64_t i0 = 0; i0 < n; i0 += step)
          for (int64_t r0 = 0; r0 < rows; r0 += 8)
            weigh_tile<8, 2>(s.data() + r0 * kBlock + i0, std::min(step, n - i0), vb + i0 * vs,
                             vs, d.dv, true, accp + r0 * d.dv);
        continue;
      }
    }
#endif
    for (int64_t i0 = 0; i0 < n; i0 += sub) {
      const int64_t ns = std::min(sub, n - i0);
      const T* vbs = vb + i0 * vs;
      for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
        const int64_t rt = std::min<int64_t>(kTile, rows - r0);
        const float* pr = s.data() + r0 * kBlock + i0;
        float* ar = accp + r0 * d.dv;
        const char how = tile_weighs[r0 / kTile];
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, uint16_t>) {
          if (how == kBf16) {
            const uint16_t* pbr = pb.data() + r0 * kBlock + i0;
            with_tile(rt, [&](auto tile) {
              weigh_values_bf16<decltype(tile)::value>(pbr, ns, vbs, vs, d.dv, ar);
            });
            continue;
          }
        }
#endif
        if (how == kScalar) {
          for (int64_t i = 0; i < ns; ++i)
            for (int64_t r = 0; r < rt; ++r) {
              const float w = pr[r * kBlock + i];
              if (w != 0.0f) axpy(w, vbs + i * vs, ar + r * d.dv, d.dv);
            }
        } else {
          with_tile(rt, [&](auto tile) {
            weigh_values<decltype(tile)::value>(pr, ns, vbs, vs, d.dv, how == kDense, ar);
          });
        }
      }
    }
  }
}

// The splits of (batch row b, kv head h) merged (each rescaled to the largest max) and
// normalised into its rows of `out` and `lse`.
template <typename T>
void finish(const Dims& d, int64_t b, int64_t h, int64_t splits, const Partial* parts, T* out,
            float* lse) {
  const int64_t g = d.group();
  std::vector<float> acc(d.dv);
  for (int64_t j = 0; j < g; ++j) {
    for (int64_t t = 0; t < d.q_seq; ++t) {
      const int64_t r = j * d.q_seq + t, head = h * g + j;
      float mx = kNegInf;
      bool bad = false;
      for (int64_t p = 0; p < splits; ++p) {
        mx = std::max(mx, parts[p].m[r]);
        bad |= parts[p].nan_row[r] != 0;
      }
      float total = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (mx != kNegInf) {
        for (int64_t p = 0; p < splits; ++p) {
          if (parts[p].m[r] == kNegInf) continue;  // this split saw nothing
          const float w = splits == 1 ? 1.0f : std::exp(parts[p].m[r] - mx);
          total += w * parts[p].l[r];
          const float* a = parts[p].acc + r * d.dv;
          for (int64_t i = 0; i < d.dv; ++i) acc[i] += w * a[i];
        }
      }
      const bool empty = !(total > 0.0f);
      const float inv = empty ? 0.0f : 1.0f / total;
      T* dst = out + ((b * d.q_seq + t) * d.heads + head) * d.dv;
      bad |= std::isnan(total);
      for (int64_t i = 0; i < d.dv; ++i) bad |= !std::isfinite(acc[i]);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int64_t i = 0; i < d.dv; ++i) store(dst + i, bad ? nan : acc[i] * inv);
      const float row_lse = empty ? kNegInf : mx + std::log(total);
      lse[(b * d.heads + head) * d.q_seq + t] = bad ? nan : row_lse;
    }
  }
}

// Runs fn(i) for i in [0, n) on the caller and up to (threads - 1) pool tasks. Items are
// claimed from an atomic counter; the caller, once no item is left to claim, waits only for
// items already claimed, spinning (an item is short: a kernel's share of one product or of one
// head's keys, and a sleeping caller costs a wake-up of several microseconds per call, which a
// decode step of a few hundred calls feels). A helper that starts after that claims nothing
// and returns without touching `fn` (which lives on the caller's stack); `state` is shared,
// so it outlives them.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F fn) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};  // the next item to claim
    std::atomic<int64_t> done{0};  // items finished
  };
  auto state = std::make_shared<State>();
  auto run = [state, n, &fn] {
    for (int64_t i; (i = state->next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      fn(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([run] { run(); });
  run();
  // Every item is claimed; wait for the ones still running (yielding now and then, in case
  // their thread was descheduled).
  for (int64_t spins = 0; state->done.load(std::memory_order_acquire) < n; ++spins) {
    if (spins % 1024 == 1023) {
      std::this_thread::yield();
    } else {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }
}

// Keys per split at least, for the row that reads the most keys (the split count is shared by
// every row of the call; a shorter row's splits are shorter, or empty): a split's fixed cost
// (its query rows, its partial state, the merge) stays small beside its keys.
constexpr int64_t kMinSplit = 1024;

template <typename T>
void run_all(const Dims& d, ffi::ThreadPool& pool, const void* q, const void* k, const void* v,
             const int32_t* q_offset, const int32_t* kv_length, const int32_t* kv_pos, void* out,
             float* lse) {
  // Work items are (batch row, kv head, split of its keys): with fewer (batch row, kv head)
  // pairs than a few per thread (one sequence with few kv heads), each one's keys are split so
  // that every thread streams its share, and the splits are merged after.
  // Splits are counted from the keys the rows read, not the cache's capacity: a short fill
  // of a long cache would otherwise start threads for empty splits on every step.
  const int64_t items = d.batch * d.kv_heads, threads = std::max<int64_t>(1, pool.num_threads());
  if (items == 0) return;  // no rows (XLA drops such calls; the split count divides by items)
  int64_t splits = 1;
  if (items < 4 * threads) {
    int64_t span = 0;
    for (int64_t b = 0; b < d.batch; ++b) {
      const auto [first, end] = read_slots(d, q_offset[b], kv_length[b]);
      span = std::max(span, end - first);
    }
    splits = std::clamp<int64_t>((4 * threads + items - 1) / items, 1,
                                 std::max<int64_t>(1, span / kMinSplit));
  }
  const int64_t rows = d.group() * d.q_seq, width = rows * (d.dv + 2);
  std::vector<float> state(items * splits * width);
  std::vector<char> nans(items * splits * rows);
  std::vector<Partial> parts(items * splits);
  for (int64_t i = 0; i < items * splits; ++i) {
    float* base = state.data() + i * width;
    parts[i] = {base, base + rows, nans.data() + i * rows, base + 2 * rows};
  }
  parallel_for(pool, items * splits, [&](int64_t i) {
    const int64_t item = i / splits;
    attend<T>(d, item / d.kv_heads, item % d.kv_heads, i % splits, splits,
              static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
              q_offset, kv_length, kv_pos, parts[i]);
  });
  for (int64_t item = 0; item < items; ++item) {
    finish<T>(d, item / d.kv_heads, item % d.kv_heads, splits, parts.data() + item * splits,
              static_cast<T*>(out), lse);
  }
}

ffi::Error Decode(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::Buffer<ffi::S32> q_offset, ffi::Buffer<ffi::S32> kv_length,
                  ffi::Buffer<ffi::S32> kv_pos, ffi::Result<ffi::AnyBuffer> out,
                  ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, bool causal,
                  int64_t window_left, int64_t window_right, std::string_view layout,
                  bool has_pos) {
  if (layout != "bshd" && layout != "bhsd") {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: layout must be bshd or bhsd, got " +
                                       std::string(layout));
  }
  const bool bhsd = layout == "bhsd";
  const auto qd = q.dimensions();
  // K and V of one batch row may come without their unit batch axis (rank 3): then the
  // operand is the cache buffer itself, not a reshape of it, which lets XLA update the cache
  // in place right before this call (a reshaped operand makes it copy the whole cache).
  auto with_batch = [](auto dims) {
    std::array<int64_t, 4> out{1, 0, 0, 0};
    const size_t skip = dims.size() == 3 ? 1 : 0;
    for (size_t i = 0; i < dims.size() && i + skip < 4; ++i) out[i + skip] = dims[i];
    return out;
  };
  const auto kd = with_batch(k.dimensions()), vd = with_batch(v.dimensions());
  const bool rank3 = k.dimensions().size() == 3 && v.dimensions().size() == 3 && qd.size() == 4 &&
                     qd[0] == 1;
  if (qd.size() != 4 || !(rank3 || (k.dimensions().size() == 4 && v.dimensions().size() == 4))) {
    return ffi::Error::InvalidArgument(
        "treeattn_cpu_decode: q must have rank 4, k and v rank 4 (or rank 3 for batch 1)");
  }
  Dims d{qd[0], qd[1], qd[2], qd[3], bhsd ? kd[1] : kd[2], bhsd ? kd[2] : kd[1], vd[3],
         bhsd,  causal, has_pos, scale,  window_left, window_right};
  if (d.kv_heads <= 0 || d.heads % d.kv_heads != 0 || kd[3] != d.qk) {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: inconsistent q/k shapes");
  }
  if (static_cast<int64_t>(q_offset.element_count()) != d.batch ||
      static_cast<int64_t>(kv_length.element_count()) != d.batch) {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: q_offset, kv_length must be [batch]");
  }
  if (has_pos && static_cast<int64_t>(kv_pos.element_count()) != d.batch * d.kv_seq) {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: kv_pos must be [batch, kv_seq]");
  }
  const auto dtype = q.element_type();
  if (k.element_type() != dtype || v.element_type() != dtype || out->element_type() != dtype) {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: q, k, v, out must share a dtype");
  }
  const int32_t* pos = has_pos ? kv_pos.typed_data() : nullptr;
  if (dtype == ffi::F32) {
    run_all<float>(d, pool, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                   q_offset.typed_data(), kv_length.typed_data(), pos, out->untyped_data(),
                   lse->typed_data());
  } else if (dtype == ffi::BF16) {
    run_all<uint16_t>(d, pool, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                      q_offset.typed_data(), kv_length.typed_data(), pos, out->untyped_data(),
                      lse->typed_data());
  } else {
    return ffi::Error::InvalidArgument("treeattn_cpu_decode: dtype must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// Few-row matrix products: y[r, o] = sum_i x[r, i] w[o, i], for the weights of a decode step
// ---------------------------------------------------------------------------------------------
//
// A decode step multiplies one row (or a batch's few rows) by every weight matrix: each weight
// is streamed from memory once, and that is what the step costs at best. Each thread takes its
// own range of output rows and streams them a tile of NO weight rows at a time against up to
// kMmRows input rows held with their sums in registers: every weight element is loaded once per
// group of input rows, so with a group covering all the rows the product reads the weight once
// and spends kMmRows multiply-adds on each element it loads. bfloat16 weights are widened as
// they are loaded, or, with AVX512-BF16, multiplied as they are by the CPU's bfloat16 dot
// products; sums run in float32.

#if defined(__AVX512F__)
constexpr int kMmRegisters = 32;
constexpr int kMmRows = 8;
#else
constexpr int kMmRegisters = 16;  // AVX2, SSE and NEON
constexpr int kMmRows = 4;
#endif

// Weight rows per tile for nr input rows: nr * NO sums, NO weight vectors and one input vector
// in registers, at most 4 (one `sum4`). One input row on AVX-512 streams one weight row at a
// time: tiles of several rows (several interleaved streams 1 KiB apart) read a cold weight at
// about half the speed of one sequential stream there (a 32,000 x 256 float32 weight: 3.6 ms
// against 1.6 ms on 2 cores of an AMD EPYC).
constexpr int mm_out_tile(int nr) {
#if defined(__AVX512F__)
  if (nr == 1) return 1;
#endif
  const int fit = (kMmRegisters - 2) / (nr + 1);
  return fit < 1 ? 1 : (fit > 4 ? 4 : fit);
}

// Below this many weight elements one thread streams the matrix faster than several start.
constexpr int64_t kMmParallel = 1 << 16;

// out[r * NO + o] = x[r] . w[o] for NR input rows (row stride `in`) and NO weight rows.
template <int NR, int NO, typename T>
inline void mm_tile(const float* __restrict x, int64_t in, const T* __restrict w,
                    float* __restrict out) {
  vf32 acc[NR][4] = {};
  // The next tile's rows, a tile ahead of the loads: the hardware prefetcher alone keeps fewer
  // of a tile's streams in flight (a 1-row product of a weight in memory streams 1.3-1.6x
  // faster with it).
  tile_dots<NR, NO>(x, in, w, in, in, NO * in, acc);
  const int64_t i = in - in % kLanes;
  for (int r = 0; r < NR; ++r) {
    float sums[4];
    sum4(acc[r], sums);  // the unused sums are zero
    for (int o = 0; o < NO; ++o) {
      float t = sums[o];
      for (int64_t j = i; j < in; ++j) t += x[r * in + j] * load(w + o * in + j);
      out[r * NO + o] = t;
    }
  }
}

#if defined(__AVX512BF16__)
// The same for bfloat16 rows and weights, with the CPU's bfloat16 dot products (AVX512-BF16,
// `tile_dots_bf16`): neither operand is widened first.
template <int NR, int NO>
inline void mm_tile_bf16(const uint16_t* __restrict x, int64_t in, const uint16_t* __restrict w,
                         float* __restrict out) {
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < 4; ++o) acc[r][o] = _mm512_setzero_ps();
  tile_dots_bf16<NR, NO>(x, in, w, in, in, NO * in, acc);  // the next tile prefetched, as above
  const int64_t i = in - in % 32;
  for (int r = 0; r < NR; ++r) {
    vf32 four[4];  // the four sums of a row reduced together (the unused ones are zero)
    std::memcpy(four, acc[r], sizeof four);
    float sums[4];
    sum4(four, sums);
    for (int o = 0; o < NO; ++o) {
      float t = sums[o];
      for (int64_t j = i; j < in; ++j) t += load(x + r * in + j) * load(w + o * in + j);
      out[r * NO + o] = t;
    }
  }
}
#endif

// Calls fn(std::integral_constant<int, N>) for n in 1..8.
template <typename F>
inline void with_count(int64_t n, F fn) {
  switch (n) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    case 8: return fn(std::integral_constant<int, 8>{});
    default: return;
  }
}

// Output rows [o0, o1) of y = x w^T for input rows [r0, r0 + NR) (x: float32 rows, or with
// AVX512-BF16 the bfloat16 rows themselves).
template <int NR, typename X, typename T>
void mm_group(const X* x, int64_t r0, int64_t in, const T* w, int64_t out, int64_t o0,
              int64_t o1, T* y) {
  constexpr int kOut = mm_out_tile(NR);
  float tile[NR * kOut];
  for (int64_t o = o0; o < o1; o += kOut) {
    const int64_t no = std::min<int64_t>(kOut, o1 - o);
    with_count(no, [&](auto NO) {
      constexpr int ko = decltype(NO)::value;
      if constexpr (ko <= kOut) {
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<X, uint16_t>) {
          mm_tile_bf16<NR, ko>(x + r0 * in, in, w + o * in, tile);
        }
#endif
        if constexpr (std::is_same_v<X, float>) {
          mm_tile<NR, ko>(x + r0 * in, in, w + o * in, tile);
        }
      }
    });
    for (int64_t a = 0; a < NR; ++a)
      for (int64_t b = 0; b < no; ++b) store(y + (r0 + a) * out + o + b, tile[a * no + b]);
  }
}

// Output rows [o0, o1) for every input row, in groups of at most kMmRows rows of equal size
// (12 rows are two groups of 6, not 8 and 4).
template <typename X, typename T>
void mm_rows(const X* x, int64_t rows, int64_t in, const T* w, int64_t out, int64_t o0,
             int64_t o1, T* y) {
  const int64_t groups = (rows + kMmRows - 1) / kMmRows;
  for (int64_t g = 0, r = 0; g < groups; ++g) {
    const int64_t nr = (rows - r) / (groups - g) + ((rows - r) % (groups - g) != 0);
    with_count(nr, [&](auto NR) {
      if constexpr (decltype(NR)::value <= kMmRows) {
        mm_group<decltype(NR)::value>(x, r, in, w, out, o0, o1, y);
      }
    });
    r += nr;
  }
}

// One weight of a product call: y = x w^T, w [out, in].
struct MmWeight {
  const void* w;
  void* y;
  int64_t out;
};

// The threads of one product call: the units of every weight (output rows, or panels of
// kPanel rows: `unit` rows each) cut into chunks of about equal size, a few per thread once
// `work` reaches kMmParallel, each a whole number of `tile` units, so that a thread that is late
// to start leaves its share to the others. fn(x, weight, u0, u1) runs a chunk, x as float32
// rows widened once where the CPU has no bfloat16 dot products.
template <typename T, typename F>
void run_chunks(ffi::ThreadPool& pool, const T* x, int64_t rows, int64_t in,
                const std::vector<MmWeight>& weights, int64_t work, int64_t unit, int64_t tile,
                F fn) {
  int64_t elements = 0;
  for (const auto& wt : weights) elements += wt.out * in;
  const int64_t chunks = work >= kMmParallel ? std::max<int64_t>(1, 4 * pool.num_threads()) : 1;
  const int64_t per =
      std::max<int64_t>(1, (elements + chunks - 1) / chunks / std::max<int64_t>(in * unit, 1));
  const int64_t step = (per + tile - 1) / tile * tile;
  struct Chunk {
    int64_t weight, u0, u1;
  };
  std::vector<Chunk> parts;
  for (int64_t j = 0; j < static_cast<int64_t>(weights.size()); ++j) {
    const int64_t units = (weights[j].out + unit - 1) / unit;
    for (int64_t u = 0; u < units; u += step)
      parts.push_back({j, u, std::min<int64_t>(units, u + step)});
  }
#if defined(__AVX512BF16__)
  const bool widen = false;  // bfloat16 rows go to the dot products as they are
#else
  const bool widen = !std::is_same_v<T, float>;
#endif
  std::vector<float> widened(widen ? rows * in : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(widened.size()); ++i) widened[i] = load(x + i);
  parallel_for(pool, static_cast<int64_t>(parts.size()), [&](int64_t c) {
    const Chunk& part = parts[c];
    const MmWeight& wt = weights[part.weight];
    if (widen) {
      fn(widened.data(), wt, part.u0, part.u1);
    } else {
      fn(x, wt, part.u0, part.u1);
    }
  });
}

// y_j = x w_j^T for every weight w_j of one call (a layer's q, k and v projections are one call:
// the threads start once for all three), in chunks of whole 4-row tiles.
template <typename T>
void matmul(ffi::ThreadPool& pool, const T* x, int64_t rows, int64_t in,
            const std::vector<MmWeight>& weights) {
  int64_t elements = 0;
  for (const auto& wt : weights) elements += wt.out * in;
  run_chunks(pool, x, rows, in, weights, elements, 1, 4,
             [&](const auto* xs, const MmWeight& wt, int64_t o0, int64_t o1) {
               using X = std::remove_cv_t<std::remove_pointer_t<decltype(xs)>>;
               mm_rows<X, T>(xs, rows, in, static_cast<const T*>(wt.w), wt.out, o0, o1,
                             static_cast<T*>(wt.y));
             });
}

// x [..., in] and weights w_j [out_j, in] (all float32 or all bfloat16) to y_j [..., out_j].
ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws,
                  ffi::RemainingRets ys) {
  const auto xd = x.dimensions();
  const auto dtype = x.element_type();
  if (xd.size() < 1 || ws.size() == 0 || ws.size() != ys.size()) {
    return ffi::Error::InvalidArgument(
        "treeattn_cpu_matmul: x [..., in], then weights [out, in], one result per weight");
  }
  if (dtype != ffi::F32 && dtype != ffi::BF16) {
    return ffi::Error::InvalidArgument("treeattn_cpu_matmul: dtype must be float32 or bfloat16");
  }
  const int64_t in = xd.back();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) rows *= xd[i];
  std::vector<MmWeight> weights;
  for (size_t j = 0; j < ws.size(); ++j) {
    auto w = ws.get<ffi::AnyBuffer>(j);
    auto y = ys.get<ffi::AnyBuffer>(j);
    if (!w.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("treeattn_cpu_matmul: weights and results are buffers");
    }
    const auto wd = w->dimensions();
    if (wd.size() != 2 || wd[1] != in || w->element_type() != dtype ||
        (*y)->element_type() != dtype || (*y)->element_count() != rows * wd[0]) {
      return ffi::Error::InvalidArgument(
          "treeattn_cpu_matmul: each weight must be [out, in] with x's in and dtype, its result "
          "[..., out]");
    }
    weights.push_back({w->untyped_data(), (*y)->untyped_data(), wd[0]});
  }
  if (dtype == ffi::F32) {
    matmul<float>(pool, static_cast<const float*>(x.untyped_data()), rows, in, weights);
  } else {
    matmul<uint16_t>(pool, static_cast<const uint16_t*>(x.untyped_data()), rows, in, weights);
  }
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// Few-row matrix products on packed weights: y[r, o] = sum_i x[r, i] w[o, i], w in panels
// ---------------------------------------------------------------------------------------------
//
// The same product with the weight laid out once (`treeattn.models.pack_weight`, done by a
// `Decoder` when it prepares a model) in panels of kPanel output rows: float32 [out / kPanel,
// in, kPanel], bfloat16 [out / kPanel, in / 2, kPanel, 2] (pairs of inputs side by side, as the
// CPU's bfloat16 dot products take them), the last panel padded with zeros. A panel's kPanel
// weights of one input are one vector, multiplied by that input of each row broadcast to every
// lane: the sums build up in the lanes of their outputs and need no reduction across lanes,
// and a tile of panels is one sequential stream each. With [out, in] rows, each tile of rows
// ends in such reductions (for 8 rows of 256 inputs: about a third of the tile's arithmetic).

constexpr int kPanel = 16;
constexpr int kPanelVectors = kPanel / kLanes;  // vectors per panel row: 1 on AVX-512

// Panels per tile for nr input rows: as many as keep nr * NP * kPanelVectors sums in half the
// registers (the rest hold the weight vectors and broadcast inputs), at most 4 streams.
constexpr int pk_tile(int nr) {
  const int fit = (kMmRegisters - 8) / (nr * kPanelVectors);
  return fit < 1 ? 1 : (fit > 4 ? 4 : fit);
}

// out[r][p * kPanel + o] for NR rows of float32 x (row stride `in`) and NP panels starting at
// w (panel stride `ps` elements). T: float32 weights, or bfloat16 pairs widened as loaded.
template <int NR, int NP, typename T>
inline void pk_tile_f32(const float* __restrict x, int64_t in, const T* __restrict w, int64_t ps,
                        float* __restrict out) {
  constexpr int V = NP * kPanelVectors;
  vf32 acc[NR][V] = {};
  // Prefetch distance along each panel's stream. With 4 or more float32 rows a step of the
  // stream takes NR x V FMAs, and 1 KB ahead came too late from memory: 2 KB took a cold call
  // of 8 rows to 0.85-0.92x (a step of 12 x 256 at batch 8 to 0.93x, in turns); with 1 row
  // it took 1.02-1.07x.
  constexpr int64_t kAheadBytes = std::is_same_v<T, float> && NR >= 4 ? 2048 : 1024;
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < in; ++i) {
      vf32 wv[V];
      for (int p = 0; p < NP; ++p) {
        const float* row = w + p * ps + i * kPanel;
        __builtin_prefetch(reinterpret_cast<const char*>(row) + kAheadBytes, 0, 2);
        for (int v = 0; v < kPanelVectors; ++v) wv[p * kPanelVectors + v] = vload(row + v * kLanes);
      }
      for (int r = 0; r < NR; ++r) {
        const vf32 xs = splat(x[r * in + i]);
        for (int k = 0; k < V; ++k) acc[r][k] += xs * wv[k];
      }
    }
  } else {  // bfloat16 pairs: lane o of a 32-bit word holds w[o, 2j] low, w[o, 2j + 1] high
    for (int64_t j = 0; j < in / 2; ++j) {
      vf32 even[V], odd[V];
      for (int p = 0; p < NP; ++p) {
        const uint16_t* row = w + p * ps + j * 2 * kPanel;
        __builtin_prefetch(reinterpret_cast<const char*>(row) + kAheadBytes, 0, 2);
        for (int v = 0; v < kPanelVectors; ++v) {
          vu32 u;
          std::memcpy(&u, row + 2 * v * kLanes, sizeof u);
          even[p * kPanelVectors + v] = as_float(vi32(u << 16));
          odd[p * kPanelVectors + v] = as_float(vi32(u & 0xFFFF0000u));
        }
      }
      for (int r = 0; r < NR; ++r) {
        const vf32 x0 = splat(x[r * in + 2 * j]), x1 = splat(x[r * in + 2 * j + 1]);
        for (int k = 0; k < V; ++k) acc[r][k] += x0 * even[k] + x1 * odd[k];
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < V; ++k) vstore(out + r * NP * kPanel + k * kLanes, acc[r][k]);
}

#if defined(__AVX512BF16__)
// The same for bfloat16 rows and pair-packed bfloat16 panels, by the CPU's bfloat16 dot
// products: each takes a panel's 16 pairs and a row's pair of inputs broadcast to every lane.
template <int NR, int NP>
inline void pk_tile_bf16(const uint16_t* __restrict x, int64_t in,
                         const uint16_t* __restrict w, int64_t ps, float* __restrict out) {
  static_assert(kPanelVectors == 1);
  __m512 acc[NR][NP];
  for (int r = 0; r < NR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t j = 0; j < in / 2; ++j) {
    __m512bh wv[NP];
    for (int p = 0; p < NP; ++p) {
      const uint16_t* row = w + p * ps + j * 2 * kPanel;
      __builtin_prefetch(reinterpret_cast<const char*>(row) + 1024, 0, 2);
      wv[p] = (__m512bh)_mm512_loadu_si512(row);
    }
    for (int r = 0; r < NR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * in + 2 * j, sizeof pair);
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xs, wv[p]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + (r * NP + p) * kPanel, acc[r][p]);
}
#endif

// Panels [p0, p1) of y = x w^T for input rows [r0, r0 + NR).
template <int NR, typename X, typename T>
void pk_group(const X* x, int64_t r0, int64_t in, const T* w, int64_t out, int64_t p0,
              int64_t p1, T* y) {
  constexpr int kNp = pk_tile(NR);
  const int64_t ps = in * kPanel;  // elements per panel (bfloat16: in / 2 pairs of kPanel x 2)
  float tile[NR * kNp * kPanel];
  for (int64_t p = p0; p < p1; p += kNp) {
    const int64_t np = std::min<int64_t>(kNp, p1 - p);
    with_count(np, [&](auto NP) {
      constexpr int kp = decltype(NP)::value;
      if constexpr (kp <= kNp) {
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<X, uint16_t>) {
          pk_tile_bf16<NR, kp>(x + r0 * in, in, w + p * ps, ps, tile);
        }
#endif
        if constexpr (std::is_same_v<X, float>) {
          pk_tile_f32<NR, kp, T>(x + r0 * in, in, w + p * ps, ps, tile);
        }
      }
    });
    const int64_t o0 = p * kPanel, width = std::min<int64_t>(np * kPanel, out - o0);
    for (int64_t a = 0; a < NR; ++a)
      for (int64_t b = 0; b < width; ++b)
        store(y + (r0 + a) * out + o0 + b, tile[a * np * kPanel + b]);
  }
}

// Panels [p0, p1) for every input row, in groups of at most kMmRows rows of equal size. With
// more than one group the panels go in blocks of at most 384 KiB (a multiple of 12 panels,
// whole tiles of 1-4, where 12 fit; else of 3, the tile of 8 rows; else one), each passed
// over by every group while it stays in L2: the weight is read from memory once however many
// rows there are (a panel of more than 384 KiB, 6,144 float32 inputs, once per group).
template <typename X, typename T>
void pk_rows(const X* x, int64_t rows, int64_t in, const T* w, int64_t out, int64_t p0,
             int64_t p1, T* y) {
  const int64_t groups = (rows + kMmRows - 1) / kMmRows;
  const int64_t panel_bytes = std::max<int64_t>(1, in * kPanel * static_cast<int64_t>(sizeof(T)));
  const int64_t fit = std::max<int64_t>(1, (int64_t{3} << 17) / panel_bytes);
  const int64_t whole = fit >= 12 ? fit / 12 * 12 : (fit >= 3 ? fit / 3 * 3 : 1);
  const int64_t block = groups == 1 ? p1 - p0 : whole;
  for (int64_t b0 = p0; b0 < p1; b0 += block) {
    const int64_t b1 = std::min(p1, b0 + block);
    for (int64_t g = 0, r = 0; g < groups; ++g) {
      const int64_t nr = (rows - r) / (groups - g) + ((rows - r) % (groups - g) != 0);
      with_count(nr, [&](auto NR) {
        if constexpr (decltype(NR)::value <= kMmRows) {
          pk_group<decltype(NR)::value>(x, r, in, w, out, b0, b1, y);
        }
      });
      r += nr;
    }
  }
}

template <typename T>
void matmul_packed(ffi::ThreadPool& pool, const T* x, int64_t rows, int64_t in,
                   const std::vector<MmWeight>& weights) {
  int64_t elements = 0;
  for (const auto& wt : weights) elements += wt.out * in;
  // Threads from kMmParallel weight elements, or as many multiply-adds over many rows; chunks
  // of whole tiles of the rows' groups (3 panels for 8 rows on AVX-512).
  const int64_t work = elements * std::max<int64_t>(1, rows / kMmRows);
  const int64_t groups = std::max<int64_t>(1, (rows + kMmRows - 1) / kMmRows);
  int64_t tile = 1;
  with_count(std::min<int64_t>(kMmRows, (rows + groups - 1) / groups),
             [&](auto NR) { tile = pk_tile(decltype(NR)::value); });
  run_chunks(pool, x, rows, in, weights, work, kPanel, tile,
             [&](const auto* xs, const MmWeight& wt, int64_t p0, int64_t p1) {
               using X = std::remove_cv_t<std::remove_pointer_t<decltype(xs)>>;
               pk_rows<X, T>(xs, rows, in, static_cast<const T*>(wt.w), wt.out, p0, p1,
                             static_cast<T*>(wt.y));
             });
}

// A packed weight's result: where it goes, its columns, and (checked) its type and size.
struct MmResult {
  void* data;
  int64_t out;
  ffi::DataType type;
  int64_t count;
};

// One packed weight (a buffer, or layer `layer` of a stack of them) of a product of `rows` rows
// of `in` inputs in `dtype` into `y`, checked; appended to `weights`. An empty message when it
// fits.
std::string packed_weight(const std::string& who, ffi::AnyBuffer w, int64_t layer, int64_t in,
                          int64_t rows, ffi::DataType dtype, const MmResult& y,
                          std::vector<MmWeight>& weights) {
  const bool pairs = dtype == ffi::BF16;
  const auto all = w.dimensions();
  const size_t lead = layer >= 0 ? 1 : 0;  // a stack's layer axis
  if (layer < -1 || all.size() < lead || (layer >= 0 && layer >= all[0])) {
    return who + ": a weight's layer index lies outside its stack";
  }
  const std::vector<int64_t> wd(all.begin() + lead, all.end());
  const int64_t per_layer = layer >= 0 ? w.element_count() / all[0] : 0;
  const bool shape_ok =
      pairs ? (wd.size() == 4 && in % 2 == 0 && wd[1] == in / 2 && wd[2] == kPanel && wd[3] == 2)
            : (wd.size() == 3 && wd[1] == in && wd[2] == kPanel);
  if (!shape_ok || wd[0] != (y.out + kPanel - 1) / kPanel || w.element_type() != dtype ||
      y.type != dtype || y.count != rows * y.out) {
    return who +
           ": each weight must be packed from [out, in] with its input's in and x's dtype "
           "(float32 [ceil(out / 16), in, 16], bfloat16 [ceil(out / 16), in / 2, 16, 2]), its "
           "result [..., out]";
  }
  const auto* base = static_cast<const char*>(w.untyped_data());
  const int64_t size = dtype == ffi::F32 ? 4 : 2;
  weights.push_back({base + std::max<int64_t>(layer, 0) * per_layer * size, y.data, y.out});
  return "";
}

// The rows of x [..., in]: the product of its leading axes.
int64_t leading_rows(ffi::AnyBuffer x) {
  int64_t rows = 1;
  const auto xd = x.dimensions();
  for (size_t i = 0; i + 1 < xd.size(); ++i) rows *= xd[i];
  return rows;
}

// The weights of a packed product call (weight j, or layer layers[j] of a stack of them,
// into results[j]) checked against x [..., in]; an empty message when they fit.
std::string packed_operands(std::string_view name, ffi::AnyBuffer x, ffi::RemainingArgs ws,
                            const std::vector<MmResult>& results,
                            ffi::Span<const int64_t> layers, std::vector<MmWeight>& weights) {
  const auto xd = x.dimensions();
  const auto dtype = x.element_type();
  const std::string who(name);
  if (xd.size() < 1 || ws.size() == 0 || ws.size() != results.size() ||
      layers.size() != ws.size()) {
    return who + ": x [..., in], then packed weights, one result and one layer index per weight";
  }
  if (dtype != ffi::F32 && dtype != ffi::BF16) return who + ": dtype must be float32 or bfloat16";
  const int64_t rows = leading_rows(x);
  for (size_t j = 0; j < ws.size(); ++j) {
    auto w = ws.get<ffi::AnyBuffer>(j);
    if (!w.has_value()) return who + ": weights and results are buffers";
    std::string bad =
        packed_weight(who, *w, layers[j], xd.back(), rows, dtype, results[j], weights);
    if (!bad.empty()) return bad;
  }
  return "";
}

template <typename F>
void with_dtype(ffi::AnyBuffer x, F fn) {
  if (x.element_type() == ffi::F32) {
    fn(static_cast<const float*>(x.untyped_data()));
  } else {
    fn(static_cast<const uint16_t*>(x.untyped_data()));
  }
}

// x [..., in] and packed weights (float32 [panels, in, kPanel], bfloat16 [panels, in / 2,
// kPanel, 2]) to y_j [..., out_j], panels = ceil(out_j / kPanel). Where layers[j] >= 0, weight j
// is a stack of such weights with a leading layer axis and the product reads its layer
// layers[j] in place (one argument for every layer's weight of a kind, no slice copied).
ffi::Error MatmulPacked(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws,
                        ffi::RemainingRets ys, ffi::Span<const int64_t> layers) {
  std::vector<MmResult> results;
  for (size_t j = 0; j < ys.size(); ++j) {
    auto y = ys.get<ffi::AnyBuffer>(j);
    if (!y.has_value()) {
      return ffi::Error::InvalidArgument(
          "treeattn_cpu_matmul_packed: weights and results are buffers");
    }
    const auto yd = (*y)->dimensions();
    results.push_back({(*y)->untyped_data(), yd.size() ? yd.back() : 0, (*y)->element_type(),
                       static_cast<int64_t>((*y)->element_count())});
  }
  std::vector<MmWeight> weights;
  const std::string bad =
      packed_operands("treeattn_cpu_matmul_packed", x, ws, results, layers, weights);
  if (!bad.empty()) return ffi::Error::InvalidArgument(bad);
  with_dtype(x, [&](const auto* xs) {
    matmul_packed(pool, xs, leading_rows(x), x.dimensions().back(), weights);
  });
  return ffi::Error::Success();
}

// silu(g) u = g sigmoid(g) u, the sigmoid from e^{-|g|} <= 1 (no overflow): 1 / (1 + e) for
// g >= 0, e / (1 + e) below; g times it first, so that a large u meets silu(g), not g.
inline vf32 silu_times(vf32 g, vf32 u) {
  const vi32 neg = g < splat(0.0f);
  const vf32 e = exp_nonpositive(select(neg, g, -g));
  return g * (select(neg, e, splat(1.0f)) / (splat(1.0f) + e)) * u;
}

// y = silu(x gate^T) * (x up^T), SwiGLU's gated product in one call: both products as one
// packed product (gate into y, up into a scratch row block), then the gate in float32 and one
// rounding to T, by the same threads.
template <typename T>
void matmul_gated(ffi::ThreadPool& pool, const T* x, int64_t rows, int64_t in,
                  std::vector<MmWeight>& weights) {
  const int64_t out = weights[0].out, n = rows * out;
  std::vector<T> up(n);
  weights[1].y = up.data();
  matmul_packed(pool, x, rows, in, weights);
  T* y = static_cast<T*>(weights[0].y);
  // Blocks of whole vectors, a few per thread once there are enough of them.
  constexpr int64_t kGateBlock = 1 << 14;
  parallel_for(pool, (n + kGateBlock - 1) / kGateBlock, [&](int64_t b) {
    const int64_t i0 = b * kGateBlock, i1 = std::min(n, i0 + kGateBlock);
    int64_t i = i0;
    for (; i + kLanes <= i1; i += kLanes) {
      vstore(y + i, silu_times(vload(y + i), vload(up.data() + i)));
    }
    if (i < i1) {  // the last few, through a vector of their own
      float g[kLanes] = {}, u[kLanes] = {}, r[kLanes];
      for (int64_t a = i; a < i1; ++a) g[a - i] = load(y + a), u[a - i] = load(up.data() + a);
      vstore(r, silu_times(vload(g), vload(u)));
      for (int64_t a = i; a < i1; ++a) store(y + a, r[a - i]);
    }
  });
}

// Rows per block of the row-wise passes (norm, residual): about 2^14 elements, so a decode
// step's few rows are one block, on the calling thread.
inline int64_t rows_per_block(int64_t in) {
  return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(in, 1));
}

// n = RMSNorm(x) with weight g, row by row: the statistics in float32, rounded to T as
// RMSNorm rounds (x / rms(x), then times its weight).
template <typename T>
void rms_norm_rows(ffi::ThreadPool& pool, const T* x, const T* g, float eps, int64_t rows,
                   int64_t in, T* n) {
  const int64_t per = rows_per_block(in), whole = in / kLanes * kLanes;
  const T* tag = nullptr;
  parallel_for(pool, (rows + per - 1) / per, [&](int64_t b) {
    for (int64_t r = b * per; r < std::min(rows, (b + 1) * per); ++r) {
      const T* xr = x + r * in;
      T* nr = n + r * in;
      vf32 acc{};
      for (int64_t i = 0; i < whole; i += kLanes) acc += vload(xr + i) * vload(xr + i);
      float ss = hsum(acc);
      for (int64_t i = whole; i < in; ++i) ss += load(xr + i) * load(xr + i);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(in) + eps);
      for (int64_t i = 0; i < whole; i += kLanes) {
        vstore(nr + i, vload(g + i) * vround(vload(xr + i) * splat(inv), tag));
      }
      for (int64_t i = whole; i < in; ++i) {
        store(nr + i, load(xr + i) * inv);
        store(nr + i, load(g + i) * load(nr + i));
      }
    }
  });
}

// out[i] = a[i] + b[i] for i in [i0, i1), in float32, rounded to T.
template <typename T>
inline void add_range(const T* a, const T* b, T* out, int64_t i0, int64_t i1) {
  int64_t i = i0;
  for (; i + kLanes <= i1; i += kLanes) vstore(out + i, vload(a + i) + vload(b + i));
  for (; i < i1; ++i) store(out + i, load(a + i) + load(b + i));
}

// A pre-norm block's MLP in one call, y = h + W_d(silu(W_g n) * W_u n) with n = RMSNorm(h),
// h = x, or x + a rounded to T (the block's first residual sum, where a is not null): the
// norm (rms_norm_rows), the gated product, the down product, the residual sum rounded to T.
template <typename T>
void mlp_block(ffi::ThreadPool& pool, const T* x, const T* a, const T* g, float eps,
               int64_t rows, int64_t in, std::vector<MmWeight>& gated, MmWeight down, T* y) {
  std::vector<T> normed(rows * in), act(rows * gated[0].out), sum(rows * in);
  std::vector<T> h(a ? rows * in : 0);
  if (a) {
    add_range(x, a, h.data(), 0, rows * in);
    x = h.data();
  }
  rms_norm_rows(pool, x, g, eps, rows, in, normed.data());
  gated[0].y = act.data();
  matmul_gated(pool, normed.data(), rows, in, gated);
  down.y = sum.data();
  std::vector<MmWeight> d{down};
  matmul_packed(pool, act.data(), rows, gated[0].out, d);
  const int64_t per = rows_per_block(in);
  parallel_for(pool, (rows + per - 1) / per, [&](int64_t b) {
    add_range(x, sum.data(), y, b * per * in, std::min(rows, (b + 1) * per) * in);
  });
}

// Rotary embedding in place: each head of `width` elements of each row of y [rows, width],
// its pairs (a, b) = (y[i], y[i + d/2]) turned to (a c - b s, b c + a s) with c, s the first
// half of the row's cos and sin tables [rows, d] (each angle twice, as RotaryEmbedding.angles
// gives them), in float32 from the stored values, rounded to T once.
template <typename T>
void rotate_rows(T* y, int64_t rows, int64_t width, int64_t d, const float* cos,
                 const float* sin) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * d;
    const float* s = sin + r * d;
    for (int64_t h0 = 0; h0 < width; h0 += d) {
      T* a = y + r * width + h0;
      T* b = a + half;
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes) {
        const vf32 av = vload(a + i), bv = vload(b + i), cv = vload(c + i), sv = vload(s + i);
        vstore(a + i, av * cv - bv * sv);
        vstore(b + i, bv * cv + av * sv);
      }
      for (; i < half; ++i) {
        const float av = load(a + i), bv = load(b + i);
        store(a + i, av * c[i] - bv * s[i]);
        store(b + i, bv * c[i] + av * s[i]);
      }
    }
  }
}

// A pre-norm attention's inputs in one call: n = RMSNorm(x) (rms_norm_rows), then q, k, v =
// n W_q^T, n W_k^T, n W_v^T (one packed product, rounded to T), then q and k turned by the
// rows' rotary angles (rotate_rows, heads of d).
template <typename T>
void qkv_block(ffi::ThreadPool& pool, const T* x, const T* g, float eps, int64_t rows,
               int64_t in, const float* cos, const float* sin, int64_t d,
               std::vector<MmWeight>& weights) {
  std::vector<T> normed(rows * in);
  rms_norm_rows(pool, x, g, eps, rows, in, normed.data());
  matmul_packed(pool, normed.data(), rows, in, weights);
  const int64_t per = rows_per_block(weights[0].out + weights[1].out);
  parallel_for(pool, (rows + per - 1) / per, [&](int64_t b) {
    const int64_t r0 = b * per, nr = std::min(rows, r0 + per) - r0;
    for (int j = 0; j < 2; ++j) {
      const int64_t w = weights[j].out;
      rotate_rows(static_cast<T*>(weights[j].y) + r0 * w, nr, w, d, cos + r0 * d, sin + r0 * d);
    }
  });
}

// x [..., in], the norm's weight [in] (x's dtype) and eps (float32 []), then optionally a of
// x's shape and dtype, then the packed gate, up ([hidden, in]) and down ([in, hidden])
// weights, as MatmulPacked takes them, to y [..., in] = h + down(silu(gate n) * up n),
// n = RMSNorm(h), h = x (+ a).
ffi::Error MlpBlock(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer g,
                    ffi::Buffer<ffi::F32> eps, ffi::RemainingArgs ws,
                    ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> layers) {
  const std::string who = "treeattn_cpu_mlp";
  const auto xd = x.dimensions();
  const auto dtype = x.element_type();
  const int64_t in = xd.size() ? xd.back() : 0, rows = leading_rows(x);
  const size_t first = ws.size() == 4 ? 1 : 0;  // the weights after the optional addend
  std::optional<ffi::AnyBuffer> a;
  if (first) {
    auto addend = ws.get<ffi::AnyBuffer>(0);
    if (!addend.has_value()) return ffi::Error::InvalidArgument(who + ": the addend is a buffer");
    a = *addend;
  }
  if (xd.size() < 1 || (dtype != ffi::F32 && dtype != ffi::BF16) || ws.size() != 3 + first ||
      (a && (a->element_type() != dtype || a->element_count() != x.element_count())) ||
      layers.size() != 3 || g.element_type() != dtype ||
      static_cast<int64_t>(g.element_count()) != in || eps.element_count() != 1 ||
      y->element_type() != dtype || y->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument(
        who + ": x [..., in] (float32 or bfloat16), the norm's weight [in] of x's dtype and "
              "eps, then optionally an addend as x, then the gate, up and down weights; the "
              "result as x");
  }
  auto gw = ws.get<ffi::AnyBuffer>(first), uw = ws.get<ffi::AnyBuffer>(first + 1);
  auto dw = ws.get<ffi::AnyBuffer>(first + 2);
  if (!gw.has_value() || !uw.has_value() || !dw.has_value()) {
    return ffi::Error::InvalidArgument(who + ": weights are buffers");
  }
  // The hidden size, from down's packed inputs ([panels, hidden, 16], or [panels, hidden / 2,
  // 16, 2] for bfloat16, after a stack's layer axis).
  const auto dd = dw->dimensions();
  const size_t lead = layers[2] >= 0 ? 1 : 0;
  if (dd.size() < lead + 2) return ffi::Error::InvalidArgument(who + ": down must be packed");
  const int64_t hidden = dd[lead + 1] * (dtype == ffi::BF16 ? 2 : 1);
  const MmResult mid{nullptr, hidden, dtype, rows * hidden};
  const MmResult out{nullptr, in, dtype, rows * in};
  std::vector<MmWeight> weights;
  for (std::string bad : {packed_weight(who, *gw, layers[0], in, rows, dtype, mid, weights),
                          packed_weight(who, *uw, layers[1], in, rows, dtype, mid, weights),
                          packed_weight(who, *dw, layers[2], hidden, rows, dtype, out, weights)}) {
    if (!bad.empty()) return ffi::Error::InvalidArgument(bad);
  }
  const MmWeight down = weights[2];
  weights.pop_back();
  with_dtype(x, [&](const auto* xs) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(xs)>>;
    const T* as = a ? static_cast<const T*>(a->untyped_data()) : nullptr;
    mlp_block(pool, xs, as, static_cast<const T*>(g.untyped_data()), *eps.typed_data(), rows,
              in, weights, down, static_cast<T*>(y->untyped_data()));
  });
  return ffi::Error::Success();
}

// x [..., in], the packed gate and up weights of SwiGLU (as MatmulPacked takes them, of one
// out) to y [..., out] = silu(x gate^T) * (x up^T).
ffi::Error MatmulGated(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int64_t> layers) {
  const auto yd = y->dimensions();
  const int64_t out = yd.size() ? yd.back() : 0, count = y->element_count();
  const MmResult result{y->untyped_data(), out, y->element_type(), count};
  if (ws.size() != 2) {
    return ffi::Error::InvalidArgument(
        "treeattn_cpu_matmul_gated: x, then the gate and up weights");
  }
  std::vector<MmWeight> weights;
  // Both checked against y's shape (up's result is a scratch block of the same shape).
  const std::string bad =
      packed_operands("treeattn_cpu_matmul_gated", x, ws, {result, result}, layers, weights);
  if (!bad.empty()) return ffi::Error::InvalidArgument(bad);
  with_dtype(x, [&](const auto* xs) {
    matmul_gated(pool, xs, leading_rows(x), x.dimensions().back(), weights);
  });
  return ffi::Error::Success();
}


// x [..., in], the norm's weight [in] (x's dtype) and eps (float32 []), the rotary tables cos
// and sin (float32 [..., d], a row per row of x), then the packed q, k and v weights (as
// MatmulPacked takes them) to q, k, v [..., out_j] of x's dtype: the projections of
// n = RMSNorm(x), q and k rotated in heads of d.
ffi::Error QkvBlock(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer g,
                    ffi::Buffer<ffi::F32> eps, ffi::Buffer<ffi::F32> cos,
                    ffi::Buffer<ffi::F32> sin, ffi::RemainingArgs ws, ffi::RemainingRets ys,
                    ffi::Span<const int64_t> layers) {
  const std::string who = "treeattn_cpu_qkv";
  const auto xd = x.dimensions(), cd = cos.dimensions();
  const auto dtype = x.element_type();
  const int64_t in = xd.size() ? xd.back() : 0, rows = leading_rows(x);
  const int64_t d = cd.size() ? cd.back() : 0;
  std::vector<MmResult> results;
  for (size_t j = 0; j < ys.size(); ++j) {
    auto y = ys.get<ffi::AnyBuffer>(j);
    if (!y.has_value()) return ffi::Error::InvalidArgument(who + ": results are buffers");
    // [..., out] or [..., heads, d]: a row's outputs are its elements over x's rows.
    const int64_t count = static_cast<int64_t>((*y)->element_count());
    results.push_back({(*y)->untyped_data(), rows > 0 ? count / rows : 0,
                       (*y)->element_type(), count});
  }
  const bool heads_ok = d > 0 && d % 2 == 0 && results.size() == 3 &&
                        results[0].out % d == 0 && results[1].out % d == 0;
  if (xd.size() < 1 || (dtype != ffi::F32 && dtype != ffi::BF16) || ws.size() != 3 ||
      g.element_type() != dtype || static_cast<int64_t>(g.element_count()) != in ||
      eps.element_count() != 1 || !heads_ok ||
      static_cast<int64_t>(cos.element_count()) != rows * d ||
      static_cast<int64_t>(sin.element_count()) != rows * d) {
    return ffi::Error::InvalidArgument(
        who + ": x [..., in] (float32 or bfloat16), the norm's weight [in] of x's dtype and "
              "eps, the rotary tables cos and sin [..., d] (a row per row of x, d even), then "
              "the q, k and v weights; q and k of whole heads of d. Got rows " +
        std::to_string(rows) + ", in " + std::to_string(in) + ", d " + std::to_string(d) +
        ", a norm weight of " + std::to_string(g.element_count()) + ", tables of " +
        std::to_string(cos.element_count()) + " and " + std::to_string(sin.element_count()) +
        ", " + std::to_string(ws.size()) + " weights, " + std::to_string(results.size()) +
        " results");
  }
  std::vector<MmWeight> weights;
  const std::string bad = packed_operands(who, x, ws, results, layers, weights);
  if (!bad.empty()) return ffi::Error::InvalidArgument(bad);
  with_dtype(x, [&](const auto* xs) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(xs)>>;
    qkv_block(pool, xs, static_cast<const T*>(g.untyped_data()), *eps.typed_data(), rows, in,
              cos.typed_data(), sin.typed_data(), d, weights);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Slice writes into a KV cache: y = x with update[r] at starts[r], for each r
// ---------------------------------------------------------------------------------------------
//
// XLA:CPU updates a slice of a 32-bit buffer in place, but a 16-bit float one (bfloat16,
// float16) through a pass over the whole buffer: a decode step would read and write all of a
// long cache to add one token. Here the buffer is the result (aliased; XLA copies it first
// only if it must keep the original), and only the updates' bytes are written. A batch's rows
// (of any dtype of whole bytes) are one call, where slice updates would be an operation each.
// Starts are clamped so that each update fits, as in XLA's dynamic-update-slice.

// The updates come as rows of their elements, [rows, prod(dims')], their shape [rows, *dims']
// an attribute: reshaped to the buffer's rank (unit axes added), XLA:CPU copied them first.
ffi::Error Write(ffi::AnyBuffer buffer, ffi::AnyBuffer updates, ffi::Buffer<ffi::S32> starts,
                 ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> ud) {
  const auto bd = buffer.dimensions(), sd = starts.dimensions();
  const size_t rank = bd.size();
  int64_t elements = 1;
  for (const int64_t e : ud) elements *= e;
  if (ud.size() != rank + 1 || sd.size() != 2 || sd[0] != ud[0] ||
      static_cast<int64_t>(updates.element_count()) != elements ||
      sd[1] != static_cast<int64_t>(rank) || updates.element_type() != buffer.element_type() ||
      out->element_type() != buffer.element_type()) {
    return ffi::Error::InvalidArgument(
        "treeattn_cpu_write: buffer [*dims], updates of its dtype, their shape [rows, *dims'] "
        "(attribute dims), starts [rows, rank]");
  }
  const int64_t size = static_cast<int64_t>(ffi::ByteWidth(buffer.element_type()));
  char* dst = static_cast<char*>(out->untyped_data());
  const char* src = static_cast<const char*>(updates.untyped_data());
  // Strides (elements) of the buffer and of one update, row-major.
  std::vector<int64_t> bstride(rank, 1), ustride(rank, 1);
  for (size_t d = rank; d-- > 1;) {
    bstride[d - 1] = bstride[d] * bd[d];
    ustride[d - 1] = ustride[d] * ud[d + 1];
  }
  for (size_t d = 0; d < rank; ++d) {
    if (ud[d + 1] > bd[d]) {
      return ffi::Error::InvalidArgument("treeattn_cpu_write: an update is larger than the buffer");
    }
  }
  int64_t count = 1;  // elements of one update
  for (size_t d = 0; d < rank; ++d) count *= ud[d + 1];
  // One contiguous run of bytes: the innermost dimensions an update spans whole, and the
  // next one out (dimension `inner`); the dimensions outside it are walked.
  size_t inner = rank;
  int64_t run = 1;
  while (inner > 0) {
    --inner;
    run *= ud[inner + 1];
    if (ud[inner + 1] != bd[inner]) break;
  }
  const int32_t* st = starts.typed_data();
  std::vector<int64_t> at(rank), idx(rank);
  for (int64_t r = 0; r < ud[0]; ++r) {
    for (size_t d = 0; d < rank; ++d) {
      at[d] = std::clamp<int64_t>(st[r * rank + d], 0, bd[d] - ud[d + 1]);
    }
    const char* from = src + r * count * size;
    // Walk the runs of this update in row-major order.
    std::fill(idx.begin(), idx.end(), 0);
    for (int64_t done = 0; done < count; done += run) {
      int64_t offset = 0;
      for (size_t d = 0; d < rank; ++d) offset += (at[d] + idx[d]) * bstride[d];
      std::memcpy(dst + offset * size, from + done * size, run * size);
      // Next run: advance the index over the dimensions outside the run.
      for (size_t d = inner; d-- > 0;) {
        if (++idx[d] < ud[d + 1]) break;
        idx[d] = 0;
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreeattnCpuDecode, Decode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<std::string_view>("layout")
                                  .Attr<bool>("has_pos"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreeattnCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreeattnCpuMatmulPacked, MatmulPacked,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("layers"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreeattnCpuMatmulGated, MatmulGated,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("layers"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreeattnCpuMlp, MlpBlock,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("layers"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreeattnCpuQkv, QkvBlock,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("layers"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TreeattnCpuWrite, Write,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("dims"));
