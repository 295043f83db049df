// Weight-only Linear on the CPU: low-bit weights in the package's storage layout, fp32 activations.
// The math, the two paths and the build are described in kernels/weight_only_cpu.py; this file is the fast path.
//
// decode_row: one output row's codes -> fp32 weights w[k] = (u[k] - z[g]) * s[g] (integer formats) or
//             lut[u[k]] * s[g] (NF4), exactly the reference's fp32 operations (built with -ffp-contract=off).
// gemv:       for each output row n (rows split across threads): decode it into an L1-resident buffer, then
//             y[m, n] = dot(w, x[m]) + bias[n] for every row m of x (four rows of x per sweep of w).
// decode:     every row into an (N, K) fp32 matrix (the prefill path multiplies it with a float GEMM).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define WB_X86 1
#include <immintrin.h>
#define WB_TARGET(isa) __attribute__((target(isa)))
#else
#define WB_X86 0
#endif

#include "cpu_isa.h"   // Isa, isa_cap

namespace {


struct Weight {          // one call's view of the stored weight
  const uint8_t* q;      // (N, row_bytes) packed codes, lowest bits first
  const float* scale;    // (N, G)
  const float* zero;     // (N, G): integer formats (the implicit 2^(bits-1) of symmetric ones included)
  const float* lut;      // 16 values (NF4) or nullptr
  int64_t N, K, G, group, row_bytes;
  int bits;              // code slot width: 2, 4 or 8
  // integer codes of 4 or 8 bits in whole 32-value groups: what the one-pass vector decodes take
  bool whole32() const { return !lut && (bits == 4 || bits == 8) && group % 32 == 0 && K % 32 == 0; }
};

// Rows per thread's share in at::parallel_for: at least `least`, and enough rows of `per_row` values each for
// ~64 k values of work - below that, waking a second thread costs more than it saves (measured: a 192 x 192
// layer at 4 rows took 11 us on one thread and 23.5 us on two with 8-row shares).
inline int64_t rows_grain(int64_t per_row, int64_t least) {
  return std::max<int64_t>(least, (int64_t{1} << 16) / std::max<int64_t>(per_row, 1));
}

// ---------------------------------------------------------------------------------------------------------
// Codes of one row (K values) into c[0 .. K) as bytes. SSE2 (every x86-64) for whole 16-byte chunks.
void unpack_row(const uint8_t* q, int bits, int64_t K, uint8_t* c) {
  if (bits == 8) {
    std::copy(q, q + K, c);
    return;
  }
  const int per = 8 / bits;
  const uint8_t mask = static_cast<uint8_t>((1 << bits) - 1);
  int64_t j = 0;  // bytes done
  const int64_t bytes = (K + per - 1) / per;
#if WB_X86
  const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(0x03);
  for (; (j + 16) * per <= K; j += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j));
    __m128i* out = reinterpret_cast<__m128i*>(c + j * per);
    if (bits == 4) {
      const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
      _mm_storeu_si128(out, _mm_unpacklo_epi8(lo, hi));       // byte b -> codes 2b (low nibble), 2b + 1
      _mm_storeu_si128(out + 1, _mm_unpackhi_epi8(lo, hi));
    } else {  // 2 bits: byte b -> codes 4b .. 4b + 3
      const __m128i c0 = _mm_and_si128(v, m2), c1 = _mm_and_si128(_mm_srli_epi16(v, 2), m2);
      const __m128i c2 = _mm_and_si128(_mm_srli_epi16(v, 4), m2), c3 = _mm_and_si128(_mm_srli_epi16(v, 6), m2);
      const __m128i a = _mm_unpacklo_epi8(c0, c1), b = _mm_unpacklo_epi8(c2, c3);
      const __m128i a2 = _mm_unpackhi_epi8(c0, c1), b2 = _mm_unpackhi_epi8(c2, c3);
      _mm_storeu_si128(out, _mm_unpacklo_epi16(a, b));
      _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(a, b));
      _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(a2, b2));
      _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(a2, b2));
    }
  }
#endif
  for (; j < bytes; ++j)
    for (int t = 0; t < per && j * per + t < K; ++t) c[j * per + t] = (q[j] >> (t * bits)) & mask;
}

// ---------------------------------------------------------------------------------------------------------
// Scalar path (any CPU): the definition the vector path must match.
void dequant_scalar(const uint8_t* c, int64_t n, float s, float z, const float* lut, float* w) {
  if (lut) {
    for (int64_t k = 0; k < n; ++k) w[k] = lut[c[k]] * s;
  } else {
    for (int64_t k = 0; k < n; ++k) w[k] = (static_cast<float>(c[k]) - z) * s;
  }
}

// out[i] = dot(w, x + i * ldx) for i < rows
void dot_scalar(const float* w, const float* x, int64_t ldx, int rows, int64_t K, float* out) {
  for (int i = 0; i < rows; ++i) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += w[k] * x[i * ldx + k];
    out[i] = acc;
  }
}

#if WB_X86
// Codes k .. k + 31 of a row of 4- or 8-bit codes (k a multiple of 32) as bytes, in order, in c0 and c1 (SSE2).
inline void codes32_in_order(const uint8_t* q, int64_t k, int bits, __m128i& c0, __m128i& c1) {
  if (bits == 4) {  // byte b holds codes 2b (low nibble) and 2b + 1
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2));
    const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    c0 = _mm_unpacklo_epi8(lo, hi);
    c1 = _mm_unpackhi_epi8(lo, hi);
  } else {
    c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
    c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + 16));
  }
}

// Decode paths read the weight as one stream (rows are contiguous) and prefetch this far ahead of it: one core's
// stream of a weight that is not in cache otherwise stalls on memory latency at a fraction of the bandwidth
// (4096 x 4096 int4 g128 at M = 1 from DRAM: 2.9 ms without, 1.0 ms with; docs/kernels.md).
constexpr int64_t kPrefetchBytes = 4096;

// ---------------------------------------------------------------------------------------------------------
// AVX2 + FMA: 8 lanes.
WB_TARGET("avx2,fma") void dequant_avx2(const uint8_t* c, int64_t n, float s, float z, const float* lut, float* w) {
  const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
  int64_t k = 0;
  if (lut) {  // 16-entry table: two 8-lane permutes, chosen by bit 3 of the code
    const __m256 lo = _mm256_loadu_ps(lut), hi = _mm256_loadu_ps(lut + 8);
    const __m256i seven = _mm256_set1_epi32(7);
    for (; k + 8 <= n; k += 8) {
      const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + k)));
      const __m256 a = _mm256_permutevar8x32_ps(lo, u), b = _mm256_permutevar8x32_ps(hi, u);
      const __m256 v = _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_cmpgt_epi32(u, seven)));
      _mm256_storeu_ps(w + k, _mm256_mul_ps(v, vs));
    }
  } else {
    for (; k + 8 <= n; k += 8) {
      const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + k)));
      _mm256_storeu_ps(w + k, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(u), vz), vs));
    }
  }
  dequant_scalar(c + k, n - k, s, z, lut, w + k);
}

WB_TARGET("avx2,fma") inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

WB_TARGET("avx2,fma") void dot_avx2(const float* w, const float* x, int64_t ldx, int rows, int64_t K, float* out) {
  if (rows == 1) {  // four independent chains over k hide the FMA latency
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    float acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; ++k) acc += w[k] * x[k];
    out[0] = acc;
    return;
  }
  // 2..4 rows of x: one load of w feeds every row (one chain per row, two vectors per step)
  __m256 a[4][2];
  for (int i = 0; i < 4; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
    for (int i = 0; i < rows; ++i) {
      a[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * ldx + k), a[i][0]);
      a[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * ldx + k + 8), a[i][1]);
    }
  }
  for (int i = 0; i < rows; ++i) {
    float acc = hsum(_mm256_add_ps(a[i][0], a[i][1]));
    for (int64_t kk = k; kk < K; ++kk) acc += w[kk] * x[i * ldx + kk];
    out[i] = acc;
  }
}

// sum_g s[g] z[g] xsum[g], the zero points' share of a row's product, or zc * sum_g s[g] xsum[g] when z is null (one
// zero point for the whole weight: symmetric formats). Vectorised: one row of a g32 weight has K / 32 groups, and a
// scalar loop is one dependent add per group - as long as the row's own product on AVX-512.
WB_TARGET("avx2,fma") inline float zero_sum_avx2(const float* s, const float* z, float zc, const float* xsum,
                                                 int64_t G) {
  __m256 a = _mm256_setzero_ps();
  int64_t g = 0;
  if (z) {
    for (; g + 8 <= G; g += 8)
      a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + g), _mm256_loadu_ps(z + g)), _mm256_loadu_ps(xsum + g),
                          a);
  } else {
    for (; g + 8 <= G; g += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(s + g), _mm256_loadu_ps(xsum + g), a);
  }
  float t = hsum(a);
  for (; g < G; ++g) t += z ? s[g] * z[g] * xsum[g] : s[g] * xsum[g];
  return z ? t : zc * t;
}

// Decode path for 4- and 8-bit integer codes in whole 32-value chunks (group_size a multiple of 32): the codes
// are widened in registers, never written out. With u the codes, per output row and row m of x:
//   y[m] = sum_g s[g] * sum_{k in g} u[k] x[m, k]  -  sum_g s[g] z[g] xsum[m, g]
// (xsum: x's per-group sums, once per call) - the reference's sum of (u - z) s x, regrouped. One row of x
// (decode) scales each group's sums once; several rows scale the widened codes once for all of them.
// FOLD (symmetric formats, one integer zero point zc that keeps u - zc within a byte: 4-bit codes, or 8-bit codes
// with zc = 128): the codes become u - zc in their bytes (one byte subtraction, then a signed widening) and the
// zero points' share vanishes - no per-group sums of x, and no large sum of u x cancelled by a large zero share
// (closer to the reference's sum of (u - z) s x).
template <int ROWS, int BITS, bool FOLD>
WB_TARGET("avx2,fma") void gemv_row_avx2(const uint8_t* q, const float* s, const float* z, float zc, const float* x,
                                         int64_t K, int64_t group, int64_t G, const float* xsum, float* out) {
  const __m128i zb = _mm_set1_epi8(static_cast<char>(FOLD ? static_cast<int>(zc) : 0));
  constexpr int A = ROWS == 1 ? 4 : 2;  // independent FMA chains per row of x
  __m256 acc[ROWS][A];
  for (int i = 0; i < ROWS; ++i)
    for (int a = 0; a < A; ++a) acc[i][a] = _mm256_setzero_ps();
  __m256 gacc[4];  // one row of x: the current group's unscaled sums
  for (int j = 0; j < 4; ++j) gacc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m256 vs = _mm256_set1_ps(s[g]);
    const int64_t k1 = std::min(K, (g + 1) * group);
    for (int64_t k = g * group; k < k1; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(q + k * BITS / 8 + kPrefetchBytes), _MM_HINT_T0);  // see avx512
      __m128i c0, c1;  // codes k .. k + 15 and k + 16 .. k + 31 as bytes
      codes32_in_order(q, k, BITS, c0, c1);
      __m256 w[4];
      if (FOLD) {
        c0 = _mm_sub_epi8(c0, zb);
        c1 = _mm_sub_epi8(c1, zb);
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c0));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c0, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c1));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c1, 8)));
      } else {
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c0));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c0, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c1));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c1, 8)));
      }
      if (ROWS == 1) {  // the group's scale is applied once, when the group is done (below)
        for (int j = 0; j < 4; ++j) gacc[j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + k + 8 * j), gacc[j]);
        continue;
      }
      for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(w[j], vs);
      for (int i = 0; i < ROWS; ++i)
        for (int j = 0; j < 4; ++j)
          acc[i][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + i * K + k + 8 * j), acc[i][j % A]);
    }
    if (ROWS == 1) {
      for (int j = 0; j < 4; ++j) {
        acc[0][j % A] = _mm256_fmadd_ps(gacc[j], vs, acc[0][j % A]);
        gacc[j] = _mm256_setzero_ps();
      }
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    __m256 t = acc[i][0];
    for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[i][a]);
    out[i] = FOLD ? hsum(t) : hsum(t) - zero_sum_avx2(s, z, zc, xsum + i * G, G);
  }
}


// ---------------------------------------------------------------------------------------------------------
// AVX-512 (F) decode path, same math as gemv_row_avx2 with 16 lanes. 4-bit codes are not put back in order:
// the low nibbles of a 32-code chunk's 16 bytes are codes k, k+2, .., k+30 and the high ones k+1, .., k+31, so
// x is given with each 32-value chunk reordered the same way (`deinterleave32`, once per call) and each nibble
// vector meets its own 16 values of x - one AND, one shift and two widenings per 32 codes.
void deinterleave32(const float* x, int64_t K, float* out) {   // K a multiple of 32
  for (int64_t k = 0; k < K; k += 32)
    for (int i = 0; i < 16; ++i) {
      out[k + i] = x[k + 2 * i];
      out[k + 16 + i] = x[k + 2 * i + 1];
    }
}

template <int BITS, bool FOLD = false>   // FOLD: the codes less zb (bytes), widened signed (see gemv_row_avx2)
WB_TARGET("avx512f") inline void codes32_avx512(const uint8_t* q, int64_t k, __m512& w0, __m512& w1,
                                                __m128i zb = __m128i()) {
  __m128i c0, c1;
  if (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    c0 = _mm_and_si128(v, m4);
    c1 = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
  } else {
    c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
    c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + 16));
  }
  if (FOLD) {
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(c0, zb)));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(c1, zb)));
  } else {
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c0));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c1));
  }
}

WB_TARGET("avx512f") inline float zero_sum_avx512(const float* s, const float* z, float zc, const float* xsum,
                                                   int64_t G) {  // as zero_sum_avx2
  __m512 a = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g < G; g += 16) {
    const __mmask16 m = G - g >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (G - g)) - 1);
    const __m512 sv = _mm512_maskz_loadu_ps(m, s + g);
    a = _mm512_fmadd_ps(z ? _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(m, z + g)) : sv, _mm512_maskz_loadu_ps(m, xsum + g),
                        a);
  }
  const float t = _mm512_reduce_add_ps(a);
  return z ? t : zc * t;
}

template <int ROWS, int BITS, bool FOLD>
WB_TARGET("avx512f") void gemv_row_avx512(const uint8_t* q, const float* s, const float* z, float zc, const float* x,
                                          int64_t K, int64_t group, int64_t G, const float* xsum, float* out) {
  const __m128i zb = _mm_set1_epi8(static_cast<char>(FOLD ? static_cast<int>(zc) : 0));
  __m512 acc[ROWS][2];
  for (int i = 0; i < ROWS; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (ROWS == 1 && group == 32) {  // groups of 32: two groups per step, each scaled as it is done
      for (; g + 2 <= G; g += 2) {
        const int64_t k = g * 32;
        __m512 w0, w1, w2, w3;
        _mm_prefetch(reinterpret_cast<const char*>(q + k * BITS / 8 + kPrefetchBytes), _MM_HINT_T0);
        codes32_avx512<BITS, FOLD>(q, k, w0, w1, zb);
        codes32_avx512<BITS, FOLD>(q, k + 32, w2, w3, zb);
        const __m512 p0 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + k + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(x + k)));
        const __m512 p1 = _mm512_fmadd_ps(w3, _mm512_loadu_ps(x + k + 48),
                                          _mm512_mul_ps(w2, _mm512_loadu_ps(x + k + 32)));
        acc[0][0] = _mm512_fmadd_ps(p0, _mm512_set1_ps(s[g]), acc[0][0]);
        acc[0][1] = _mm512_fmadd_ps(p1, _mm512_set1_ps(s[g + 1]), acc[0][1]);
      }
      if (g == G) break;
    }
    const __m512 vs = _mm512_set1_ps(s[g]);
    const int64_t k0 = g * group, k1 = std::min(K, k0 + group);
    if (ROWS == 1) {  // the group's unscaled sums in four chains (two chunks per step), scaled once at its end
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      int64_t k = k0;
      for (; k + 64 <= k1; k += 64) {
        __m512 w0, w1, w2, w3;
        _mm_prefetch(reinterpret_cast<const char*>(q + k * BITS / 8 + kPrefetchBytes), _MM_HINT_T0);
        codes32_avx512<BITS, FOLD>(q, k, w0, w1, zb);
        codes32_avx512<BITS, FOLD>(q, k + 32, w2, w3, zb);
        a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + k + 16), a1);
        a2 = _mm512_fmadd_ps(w2, _mm512_loadu_ps(x + k + 32), a2);
        a3 = _mm512_fmadd_ps(w3, _mm512_loadu_ps(x + k + 48), a3);
      }
      if (k < k1) {
        __m512 w0, w1;
        _mm_prefetch(reinterpret_cast<const char*>(q + k * BITS / 8 + kPrefetchBytes), _MM_HINT_T0);
        codes32_avx512<BITS, FOLD>(q, k, w0, w1, zb);
        a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + k + 16), a1);
      }
      acc[0][0] = _mm512_fmadd_ps(_mm512_add_ps(a0, a2), vs, acc[0][0]);
      acc[0][1] = _mm512_fmadd_ps(_mm512_add_ps(a1, a3), vs, acc[0][1]);
      continue;
    }
    for (int64_t k = k0; k < k1; k += 32) {  // several rows of x: the codes are scaled once for all of them
      __m512 w0, w1;
      codes32_avx512<BITS, FOLD>(q, k, w0, w1, zb);
      w0 = _mm512_mul_ps(w0, vs);
      w1 = _mm512_mul_ps(w1, vs);
      for (int i = 0; i < ROWS; ++i) {
        acc[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * K + k), acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i * K + k + 16), acc[i][1]);
      }
    }
  }
  for (int i = 0; i < ROWS; ++i)
    out[i] = FOLD ? _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]))
                  : _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1])) - zero_sum_avx512(s, z, zc, xsum + i * G, G);
}

// Row n of the weight decoded straight from its 4- or 8-bit codes (whole 32-value groups) into fp32 - the
// reference's (u - z) * s, bit for bit (no FMA contraction) - or, for the bf16 prefill, rounded to bf16 to nearest
// even as PyTorch rounds (no fp32 row written in between). The bf16 variant runs only where the CPU has AVX512_BF16.
template <bool BF16>
WB_TARGET("avx512f,avx512bf16") void decode_row_avx512(const Weight& W, int64_t n, void* dst) {
  const uint8_t* q = W.q + n * W.row_bytes;
  const float *s = W.scale + n * W.G, *z = W.zero + n * W.G;
  for (int64_t g = 0; g < W.G; ++g) {
    const __m512 vs = _mm512_set1_ps(s[g]), vz = _mm512_set1_ps(z[g]);
    const int64_t k1 = std::min(W.K, (g + 1) * W.group);
    for (int64_t k = g * W.group; k < k1; k += 32) {
      __m128i c0, c1;  // codes k .. k + 15 and k + 16 .. k + 31, in order
      if constexpr (BF16)  // the bf16 prefill streams the codes fast enough to wait on memory (int8: ~7 % faster)
        _mm_prefetch(reinterpret_cast<const char*>(q + k * W.bits / 8 + kPrefetchBytes), _MM_HINT_T0);
      codes32_in_order(q, k, W.bits, c0, c1);
      const __m512 w0 = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c0)), vz), vs);
      const __m512 w1 = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c1)), vz), vs);
      if constexpr (BF16) {
        auto* o = static_cast<uint16_t*>(dst) + k;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(w0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), (__m256i)_mm512_cvtneps_pbh(w1));
      } else {
        _mm512_storeu_ps(static_cast<float*>(dst) + k, w0);
        _mm512_storeu_ps(static_cast<float*>(dst) + k + 16, w1);
      }
    }
  }
}

// Row of 4- or 8-bit codes (whole 32-value groups) into bf16 integers u - z for the split path (exact: |u - z|
// <= 255 fits bf16's 8-bit significand).
WB_TARGET("avx512f,avx512bf16") void decode_row_int_bf16_avx512(const uint8_t* q, const float* z, int bits,
                                                                 int64_t K, int64_t group, uint16_t* a) {
  for (int64_t k = 0; k < K; k += 32) {
    const __m512 vz = _mm512_set1_ps(z[k / group]);
    __m128i c0, c1;
    codes32_in_order(q, k, bits, c0, c1);
    const __m512 w0 = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c0)), vz);
    const __m512 w1 = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c1)), vz);
    _mm512_storeu_si512(a + k, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
  }
}

Isa best_isa();

// AVX-512 BF16 conversions (the split path's and the bf16 decodes'): on the CPU, and not capped by WORKBENCH_CPU_ISA.
inline bool split_avx512() {
  static const bool ok = best_isa() == Isa::Avx512 && (__builtin_cpu_init(), __builtin_cpu_supports("avx512bf16"));
  return ok;
}

// The register-decode row kernels by rows of x (1 .. 4), for gemv's dispatch.
using RowFn = void (*)(const uint8_t*, const float*, const float*, float, const float*, int64_t, int64_t, int64_t,
                       const float*, float*);

// A row's fp16 scales (as stored) into fp32 (exact), for the row kernels: the weight's stream then carries 2 bytes
// a group instead of the fp32 copy's 4.
// (the tail through a small buffer, converted as one vector too: a scalar fp16 -> fp32 conversion is a dozen
// instructions, and a g32 row of K = 320 has 10 scales, all in the tail)
WB_TARGET("avx512f") void half_row_avx512(const at::Half* h, int64_t G, float* out) {
  int64_t g = 0;
  for (; g + 16 <= G; g += 16)
    _mm512_storeu_ps(out + g, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + g))));
  if (g < G) {
    alignas(32) uint16_t t[16] = {};
    alignas(64) float f[16];
    std::memcpy(t, h + g, (G - g) * sizeof(uint16_t));
    _mm512_store_ps(f, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(t))));
    std::memcpy(out + g, f, (G - g) * sizeof(float));
  }
}
WB_TARGET("avx2,fma,f16c") void half_row_avx2(const at::Half* h, int64_t G, float* out) {
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + g))));
  if (g < G) {
    alignas(16) uint16_t t[8] = {};
    alignas(32) float f[8];
    std::memcpy(t, h + g, (G - g) * sizeof(uint16_t));
    _mm256_store_ps(f, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(t))));
    std::memcpy(out + g, f, (G - g) * sizeof(float));
  }
}
template <int BITS, bool FOLD>
constexpr RowFn kAvx2Rows[4] = {gemv_row_avx2<1, BITS, FOLD>, gemv_row_avx2<2, BITS, FOLD>,
                                gemv_row_avx2<3, BITS, FOLD>, gemv_row_avx2<4, BITS, FOLD>};
template <int BITS, bool FOLD>
constexpr RowFn kAvx512Rows[4] = {gemv_row_avx512<1, BITS, FOLD>, gemv_row_avx512<2, BITS, FOLD>,
                                  gemv_row_avx512<3, BITS, FOLD>, gemv_row_avx512<4, BITS, FOLD>};
#endif  // WB_X86

Isa detect_isa() {
  Isa found = Isa::Scalar;
#if WB_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    found = Isa::Avx512;
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    found = Isa::Avx2;
#endif
  return std::min(found, isa_cap());
}

Isa best_isa() {
  static const Isa best = detect_isa();
  return best;
}

Isa parse_isa(const std::string& name) {
  if (name.empty() || name == "auto") return best_isa();
  TORCH_CHECK(name == "avx512" || name == "avx2" || name == "scalar",
              "weight_only_linear_cpu: isa must be 'auto', 'avx512', 'avx2' or 'scalar', got '", name, "'");
  const Isa want = name == "avx512" ? Isa::Avx512 : name == "avx2" ? Isa::Avx2 : Isa::Scalar;
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best_isa()),
              "weight_only_linear_cpu: isa='", name, "' is not supported by this CPU");
  return want;
}

struct Kernels {
  void (*dequant)(const uint8_t*, int64_t, float, float, const float*, float*);
  void (*dot)(const float*, const float*, int64_t, int, int64_t, float*);
};

Kernels kernels_for(Isa isa) {
#if WB_X86
  if (isa >= Isa::Avx2) return {dequant_avx2, dot_avx2};  // (AVX-512 CPUs: the AVX2 code off the decode path)
#endif
  return {dequant_scalar, dot_scalar};
}

// Row n of the weight into w[0 .. K) (c: K + 64 bytes of scratch for its codes).
void decode_row(const Weight& W, const Kernels& kern, int64_t n, uint8_t* c, float* w) {
  unpack_row(W.q + n * W.row_bytes, W.bits, W.K, c);
  const float* s = W.scale + n * W.G;
  const float* z = W.zero ? W.zero + n * W.G : nullptr;
  for (int64_t g = 0; g < W.G; ++g) {
    const int64_t k0 = g * W.group, len = std::min(W.group, W.K - k0);
    kern.dequant(c + k0, len, s[g], z ? z[g] : 0.f, W.lut, w + k0);
  }
}

Weight view(const torch::Tensor& q, const torch::Tensor& scale, const c10::optional<torch::Tensor>& zero,
            const c10::optional<torch::Tensor>& lut, int64_t bits, int64_t group, int64_t K) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "weight_only_linear_cpu: bits must be 2, 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kByte && q.is_contiguous() && q.device().is_cpu(),
              "weight_only_linear_cpu: qweight must be a contiguous 2-D uint8 CPU tensor");
  const int64_t per = 8 / bits, N = q.size(0), G = (K + group - 1) / group;
  TORCH_CHECK(group >= 1 && q.size(1) == (K + per - 1) / per, "weight_only_linear_cpu: qweight has ", q.size(1),
              " bytes per row, ", (K + per - 1) / per, " expected for K = ", K, " at ", bits, " bits");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == N * G,
              "weight_only_linear_cpu: scale must be contiguous float32 (N, G)");
  const bool has_lut = lut.has_value() && lut->defined();
  const bool has_zero = zero.has_value() && zero->defined();
  TORCH_CHECK(has_lut != has_zero, "weight_only_linear_cpu: give zero (integer formats) or lut (NF4), not both");
  TORCH_CHECK(!has_zero || (zero->scalar_type() == torch::kFloat && zero->is_contiguous() && zero->numel() == N * G),
              "weight_only_linear_cpu: zero must be contiguous float32 (N, G)");
  TORCH_CHECK(!has_lut || (bits == 4 && lut->scalar_type() == torch::kFloat && lut->is_contiguous() &&
                           lut->numel() == 16), "weight_only_linear_cpu: lut must be 16 contiguous float32 (4 bits)");
  return {q.data_ptr<uint8_t>(), scale.data_ptr<float>(), has_zero ? zero->data_ptr<float>() : nullptr,
          has_lut ? lut->data_ptr<float>() : nullptr, N, K, G, group, q.size(1), static_cast<int>(bits)};
}

}  // namespace

// bf16 arithmetic in hardware (AVX512_BF16 / AMX): oneDNN's bf16 GEMM is then faster than its fp32 one.
bool native_bf16() {
#if WB_X86
  __builtin_cpu_init();
  return best_isa() == Isa::Avx512 && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

std::string cpu_isa() {
  return best_isa() == Isa::Avx512 ? "avx512" : best_isa() == Isa::Avx2 ? "avx2" : "scalar";
}

// The checks of an fp32 path's arguments (x a contiguous 2-D fp32 CPU tensor, the bias fp32 (N,)) and the weight's
// view.
static Weight fp32_call(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& zero, const c10::optional<torch::Tensor>& lut, int64_t bits,
                        int64_t group, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "weight_only_linear_cpu: x must be a contiguous 2-D float32 CPU tensor");
  const Weight W = view(q, scale, zero, lut, bits, group, x.size(1));
  TORCH_CHECK(!(bias.has_value() && bias->defined()) ||
              (bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == W.N),
              "weight_only_linear_cpu: bias must be contiguous float32 (N,)");
  return W;
}

// y (M, N) fp32 = x (M, K) fp32 @ W^T + bias, one decoded row of W at a time (decode / small M). The register
// kernels of whole 32-value groups read the stored fp16 scales when given (``scale16``, (N, G): the values of the
// fp32 copy, so the same result) and, for a weight with one zero point (``zconst`` not NaN: symmetric formats), no
// zero points: the weight's stream is then its stored bytes (int4 g32: 4.5 bits a value instead of 6).
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                   const c10::optional<torch::Tensor>& zero, const c10::optional<torch::Tensor>& lut,
                   int64_t bits, int64_t group, const c10::optional<torch::Tensor>& bias, const std::string& isa,
                   const c10::optional<torch::Tensor>& scale16, double zconst) {
  const Weight W = fp32_call(x, q, scale, zero, lut, bits, group, bias);
  const bool has16 = scale16.has_value() && scale16->defined();
  TORCH_CHECK(!has16 || (scale16->scalar_type() == torch::kHalf && scale16->is_contiguous() &&
                         scale16->numel() == W.N * W.G),
              "weight_only_linear_cpu: scale16 must be contiguous float16 (N, G) like scale");
  const at::Half* s16 = has16 ? scale16->data_ptr<at::Half>() : nullptr;
  const bool one_zero = !std::isnan(zconst);
  const int64_t M = x.size(0), K = W.K, N = W.N;
  const bool has_bias = bias.has_value() && bias->defined();
  const Kernels kern = kernels_for(parse_isa(isa));
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
#if WB_X86
  // Whole 32-value chunks of 4- or 8-bit integer codes: decoded in registers (gemv_row_avx512 / _avx2).
  // AVX-512 where the CPU has it, at every M, since the two-groups-a-step g32 loop (with its prefetch) and the stored
  // fp16 scales: against the AVX2 row kernel, one row of x, one thread, Xeon with AMX, cold (a 1 GiB read between
  // calls) interleaved medians, same process: int4 g32 4096^2 2.1-2.3 -> 1.3-1.5 ms, 32000 x 2048 7.8-8.7 -> 5.3-5.8;
  // int8 g32 4096^2 2.4-2.6 -> 2.1-2.2, 2048 x 5632 1.9 -> 1.4-1.5, 32000 x 2048 within noise (before that loop the
  // AVX2 kernel streamed g32 and int8 faster: the 32-code tail it ran on had no prefetch).
  const Isa use = parse_isa(isa);
  if (use >= Isa::Avx2 && W.whole32()) {
    // one integer zero point that keeps u - zc within a signed byte: folded into the codes (gemv_row_avx2)
    const bool fold = one_zero && zconst == std::floor(zconst) &&
                      (W.bits == 4 ? zconst >= 0 && zconst <= 15 : zconst == 128);
    const RowFn* row_fns =
        use == Isa::Avx512
            ? (W.bits == 4 ? (fold ? kAvx512Rows<4, true> : kAvx512Rows<4, false>)
                           : (fold ? kAvx512Rows<8, true> : kAvx512Rows<8, false>))
            : (W.bits == 4 ? (fold ? kAvx2Rows<4, true> : kAvx2Rows<4, false>)
                           : (fold ? kAvx2Rows<8, true> : kAvx2Rows<8, false>));
    std::vector<float> xsum(fold ? 0 : M * W.G, 0.f);  // (M, G): x's per-group sums (not needed when folded)
    if (!fold)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xsum[m * W.G + k / W.group] += xp[m * K + k];
    std::vector<float> xd;                  // AVX-512, 4-bit codes: x in the nibble order (deinterleave32)
    const float* xs = xp;
    if (use == Isa::Avx512 && W.bits == 4) {
      xd.resize(M * K);
      for (int64_t m = 0; m < M; ++m) deinterleave32(xp + m * K, K, xd.data() + m * K);
      xs = xd.data();
    }
    const auto half_row = use == Isa::Avx512 ? half_row_avx512 : half_row_avx2;
    at::parallel_for(0, N, rows_grain(K * M, 16), [&](int64_t n0, int64_t n1) {
      float d[4];
      std::vector<float> srow(s16 ? W.G : 0);
      for (int64_t n = n0; n < n1; ++n) {
        const float* s = W.scale + n * W.G;
        if (s16) {
          half_row(s16 + n * W.G, W.G, srow.data());
          s = srow.data();
        }
        const float* z = one_zero ? nullptr : W.zero + n * W.G;
        for (int64_t m = 0; m < M; m += 4) {
          const int rows = static_cast<int>(std::min<int64_t>(4, M - m));
          row_fns[rows - 1](W.q + n * W.row_bytes, s, z, static_cast<float>(zconst), xs + m * K, K, W.group, W.G,
                            fold ? nullptr : xsum.data() + m * W.G, d);
          for (int i = 0; i < rows; ++i) op[(m + i) * N + n] = bp ? d[i] + bp[n] : d[i];
        }
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, N, rows_grain(K * M, 16), [&](int64_t n0, int64_t n1) {
    std::vector<uint8_t> c(K + 64);
    std::vector<float> w(K);
    float d[4];
    for (int64_t n = n0; n < n1; ++n) {
      decode_row(W, kern, n, c.data(), w.data());
      for (int64_t m = 0; m < M; m += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, M - m));
        kern.dot(w.data(), xp + m * K, K, rows, K, d);
        for (int i = 0; i < rows; ++i) op[(m + i) * N + n] = bp ? d[i] + bp[n] : d[i];
      }
    }
  });
  return out;
}

// The whole weight decoded: (N, K) fp32, bit for bit the reference's decode.
torch::Tensor decode(const torch::Tensor& q, const torch::Tensor& scale, const c10::optional<torch::Tensor>& zero,
                     const c10::optional<torch::Tensor>& lut, int64_t bits, int64_t group, int64_t K,
                     const std::string& isa) {
  const Weight W = view(q, scale, zero, lut, bits, group, K);
  const Kernels kern = kernels_for(parse_isa(isa));
  auto out = torch::empty({W.N, K}, scale.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, W.N, rows_grain(K, 16), [&](int64_t n0, int64_t n1) {
    std::vector<uint8_t> c(K + 64);
    for (int64_t n = n0; n < n1; ++n) decode_row(W, kern, n, c.data(), op + n * K);
  });
  return out;
}

// y (M, N) = x (M, K) @ W^T + bias for many rows of x: blocks of weight rows decoded (all threads) into a
// per-thread fp32 buffer of about 8 MB that is reused from call to call (no page faults), each block multiplied
// by PyTorch's GEMM: fp32, or for bf16 x (given only where the CPU has bf16 arithmetic) the block rounded to bf16
// and a bf16 GEMM - what the reference computes for bf16 inputs. fp32: 8 MB rather than 2: a weight up to 2 M
// values (every Linear of MiniLM, tiny-lm, tiny-llama) is one block - one GEMM, no output copy - and wider blocks
// keep the GEMM efficient on big layers. bf16: 2 MB blocks (1 M values) measured faster than 4 MB ones on big
// layers (docs/kernels.md).
torch::Tensor prefill(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                      const c10::optional<torch::Tensor>& zero, const c10::optional<torch::Tensor>& lut,
                      int64_t bits, int64_t group, const c10::optional<torch::Tensor>& bias, int64_t block_rows,
                      const std::string& isa) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || bf16) && x.is_contiguous() && x.device().is_cpu(),
              "weight_only_linear_cpu: x must be a contiguous 2-D float32 (or bfloat16) CPU tensor");
  const Weight W = view(q, scale, zero, lut, bits, group, x.size(1));
  const int64_t M = x.size(0), K = W.K, N = W.N;
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == x.scalar_type() && bias->numel() == N),
              "weight_only_linear_cpu: bias must have x's dtype and shape (N,)");
  const Isa use = parse_isa(isa);
  const Kernels kern = kernels_for(use);
  if (M == 0 || N == 0) return torch::empty({M, N}, x.options());
  // fp32 blocks of ~8 MB; bf16 blocks of ~2 MB (a core's L2 here): the bf16 GEMM runs ~4x faster than fp32 on
  // AMX, so the decoded block must still be in cache when it is read (measured in docs/kernels.md)
  const int64_t block_bytes = bf16 ? (int64_t{2} << 20) / 2 : (int64_t{8} << 20) / 4;
  const int64_t nb = std::min(N, block_rows > 0 ? block_rows : std::max<int64_t>(block_bytes / K / 16 * 16, 16));
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < nb * K) scratch.resize(nb * K);
  // AVX-512, 4- or 8-bit codes in whole 32-value groups: rows decoded in one pass (to bf16 directly for bf16 x)
  const bool direct = WB_X86 && use == Isa::Avx512 && W.whole32() && (!bf16 || native_bf16());
  auto out = nb == N ? torch::Tensor() : torch::empty({M, N}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t rows = std::min(nb, N - n0);
    float* buf = scratch.data();
    at::parallel_for(0, rows, rows_grain(K, 8), [&](int64_t r0, int64_t r1) {
#if WB_X86
      if (direct) {
        for (int64_t r = r0; r < r1; ++r) {
          if (bf16) decode_row_avx512<true>(W, n0 + r, reinterpret_cast<uint16_t*>(buf) + r * K);
          else decode_row_avx512<false>(W, n0 + r, buf + r * K);
        }
        return;
      }
#endif
      std::vector<uint8_t> c(K + 64);
      for (int64_t r = r0; r < r1; ++r) decode_row(W, kern, n0 + r, c.data(), buf + r * K);
    });
    torch::Tensor wb;
    if (direct && bf16) {
      wb = torch::from_blob(buf, {rows, K}, x.options());   // bf16 rows, already rounded
    } else {
      wb = torch::from_blob(buf, {rows, K}, x.options().dtype(torch::kFloat));
      if (bf16) wb = wb.to(torch::kBFloat16);
    }
    if (rows == N) return has_bias ? at::addmm(*bias, x, wb.t()) : at::mm(x, wb.t());  // one block: no copy
    auto ob = out.narrow(1, n0, rows);
    if (has_bias) {
      ob.copy_(at::addmm(bias->narrow(0, n0, rows), x, wb.t()));
    } else {
      ob.copy_(at::mm(x, wb.t()));
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// fp32 x on AMX, integer codes with integer zero points: the fp32 product without an fp32 GEMM. x is split into
// three bf16 parts, x = x1 + x2 + x3 exactly (each part holds the next 8 bits of x's 24-bit significand), and the
// weight enters as its integers u - z (|u - z| <= 255: exact in bf16), so every product x_i (u - z) is exact in
// fp32 and AMX accumulates it in fp32; each group's sums are then scaled by s[n, g] in fp32:
//   y[m, n] = sum_g s[n, g] * sum_{k in g} (x1 + x2 + x3)[m, k] (u[n, k] - z[n, g])      (+ bias[n])
// - the reference's sum of x (u - z) s in another order, with fp32 rounding (tests: as close to an fp64 result
// as the reference's own fp32 GEMM). Three bf16 passes on AMX cost less than one fp32 GEMM on AVX-512 here
// (docs/kernels.md). Orientation: the brgemm's A is a block of decoded weight rows (bf16 integers,
// row-major as stored), its B the parts of x packed in AMX's pair-interleaved (VNNI) layout, 64 rows of x at a
// time; C is y transposed, scaled per group into an (N, M) fp32 accumulator, transposed once at the end.
bool split_available() { return at::native::cpublas::could_pack(at::kBFloat16); }

namespace {
constexpr int64_t kSplitCols = 64;     // rows of x per brgemm (its N): AMX's packed B is at most 64 wide here
constexpr int64_t kSplitChunk = 512;   // K per brgemm call for one-group (per-channel) weights

// A buffer reused from call to call (a fresh allocation of these sizes is page faults on every call), 64-byte
// aligned for AMX's tile rows: with std::vector's 16-byte aligned buffers the same split call (4096 x 4096,
// M = 256) measured 29 to 68 ms from one process to the next, with these 29-32 ms.
template <typename T>
struct Scratch {
  T* p = nullptr;
  int64_t n = 0;
  T* get(int64_t want) {
    if (want > n) {
      std::free(p);
      p = nullptr;   // a failed allocation below leaves an empty buffer, not a stale size
      n = 0;
      const size_t bytes = (static_cast<size_t>(want) * sizeof(T) + 63) / 64 * 64;
      p = static_cast<T*>(std::aligned_alloc(64, bytes));
      TORCH_CHECK(p, "weight_only_linear_cpu: could not allocate ", bytes, " bytes of scratch");
      n = want;
    }
    return p;
  }
  // Kept for the next call up to `keep` bytes; a larger one (a long input) is given back after the call.
  void trim(size_t keep) {
    if (static_cast<size_t>(n) * sizeof(T) > keep) {
      std::free(p);
      p = nullptr;
      n = 0;
    }
  }
  ~Scratch() { std::free(p); }
};
constexpr size_t kScratchKeep = size_t{16} << 20;

inline uint16_t bf16_bits(float v) { return c10::BFloat16(v).x; }  // round to nearest even, as PyTorch does

// Row n's codes as bf16 integers u - z into a[0 .. K), a[K] = 0 when K is odd (the pad of an even K).
void decode_row_int_bf16(const Weight& W, int64_t n, uint8_t* c, uint16_t* a, int64_t Kp) {
  const uint8_t* q = W.q + n * W.row_bytes;
  const float* z = W.zero + n * W.G;
#if WB_X86
  if (W.whole32() && split_avx512()) {   // (integer codes: the split path takes no NF4)
    decode_row_int_bf16_avx512(q, z, W.bits, W.K, W.group, a);
    return;
  }
#endif
  unpack_row(q, W.bits, W.K, c);
  for (int64_t k = 0; k < W.K; ++k) a[k] = bf16_bits(static_cast<float>(c[k]) - z[k / W.group]);
  for (int64_t k = W.K; k < Kp; ++k) a[k] = 0;
}

// x (M, K) fp32 into its three bf16 parts, each row-major (M, Kp) at out + p * M * Kp (Kp > K: a zero pad).
void split_parts_scalar(const float* x, int64_t K, int64_t Kp, uint16_t* o1, uint16_t* o2, uint16_t* o3) {
  for (int64_t k = 0; k < K; ++k) {
    const c10::BFloat16 p1(x[k]);
    const float r1 = x[k] - static_cast<float>(p1);     // exact
    const c10::BFloat16 p2(r1);
    const float r2 = r1 - static_cast<float>(p2);       // exact, and exact in bf16: the last 8 bits
    o1[k] = p1.x;
    o2[k] = p2.x;
    o3[k] = bf16_bits(r2);
  }
  for (int64_t k = K; k < Kp; ++k) o1[k] = o2[k] = o3[k] = 0;
}

#if WB_X86
WB_TARGET("avx512f,avx512bf16") inline __m512 bf16_to_ps(__m256bh h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

WB_TARGET("avx512f,avx512bf16") void split_parts_avx512(const float* x, int64_t K, uint16_t* o1, uint16_t* o2,
                                                         uint16_t* o3) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    const __m256bh p1 = _mm512_cvtneps_pbh(v);
    const __m512 r1 = _mm512_sub_ps(v, bf16_to_ps(p1));
    const __m256bh p2 = _mm512_cvtneps_pbh(r1);
    const __m512 r2 = _mm512_sub_ps(r1, bf16_to_ps(p2));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o1 + k), (__m256i)p1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o2 + k), (__m256i)p2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o3 + k), (__m256i)_mm512_cvtneps_pbh(r2));
  }
  if (k < K) split_parts_scalar(x + k, K - k, K - k, o1 + k, o2 + k, o3 + k);
}
#endif

// dst[kp * lb + m] = src[m * P + kp] for m < rows (zeros up to lb, a multiple of 16), kp < P: the pairs of k of
// `rows` rows of x, transposed into AMX's pair-interleaved B layout.
void pack_pairs_scalar(const uint32_t* src, int64_t rows, int64_t P, int64_t lb, uint32_t* dst) {
  for (int64_t kp = 0; kp < P; ++kp) {
    uint32_t* d = dst + kp * lb;
    for (int64_t m = 0; m < rows; ++m) d[m] = src[m * P + kp];
    for (int64_t m = rows; m < lb; ++m) d[m] = 0;
  }
}

#if WB_X86
// r[i] (row i of a 16 x 16 block of 32-bit values) becomes column i, in registers.
WB_TARGET("avx512f") inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4a + b] now holds, per 128-bit lane L, column 4L + (b: 0, 1, 2, 3 -> 0, 1, 2, 3) of rows 4a .. 4a + 3
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);       // lanes 0, 2 of r[i], lanes 0, 2 of r[4 + i]
    t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xDD);   // lanes 1, 3
    t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);        // columns i, rows 0..15
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xDD);    // columns 8 + i
    r[4 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xDD);
  }
}

// 16 x 16 32-bit transposes in registers.
WB_TARGET("avx512f") void pack_pairs_avx512(const uint32_t* src, int64_t rows, int64_t P, int64_t lb, uint32_t* dst) {
  for (int64_t m0 = 0; m0 < lb; m0 += 16) {
    for (int64_t kp0 = 0; kp0 < P; kp0 += 16) {
      const int64_t nk = std::min<int64_t>(16, P - kp0);
      const __mmask16 km = static_cast<__mmask16>((1u << nk) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = m0 + i < rows ? _mm512_maskz_loadu_epi32(km, src + (m0 + i) * P + kp0) : _mm512_setzero_si512();
      transpose16(r);
      for (int i = 0; i < nk; ++i) _mm512_storeu_si512(dst + (kp0 + i) * lb + m0, r[i]);
    }
  }
}

// out[i * ldo + r] = s[r] * acc[r * lda + i] + bias[r] for r < rows, i < cols (s, bias: either may be null): a
// block of y^T stored into y, scaled (a one-group weight's scales) and the bias added in fp32 as it is stored - a
// multiply then an add, as the scalar code computes them.
WB_TARGET("avx512f") void store_transposed_avx512(const float* acc, int64_t rows, int64_t cols, int64_t lda,
                                                  const float* s, const float* bias, float* out, int64_t ldo) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t nr = std::min<int64_t>(16, rows - r0);
    const __mmask16 rm = static_cast<__mmask16>((1u << nr) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(rm, bias + r0) : _mm512_setzero_ps();
    const __m512 sv = s ? _mm512_maskz_loadu_ps(rm, s + r0) : _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < cols; i0 += 16) {
      const int64_t ni = std::min<int64_t>(16, cols - i0);
      const __mmask16 im = static_cast<__mmask16>((1u << ni) - 1);
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = j < nr ? _mm512_maskz_loadu_epi32(im, acc + (r0 + j) * lda + i0) : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < ni; ++j) {
        __m512 v = _mm512_castsi512_ps(r[j]);
        if (s) v = _mm512_mul_ps(sv, v);
        if (bias) v = _mm512_add_ps(v, b);
        _mm512_mask_storeu_ps(out + (i0 + j) * ldo + r0, rm, v);
      }
    }
  }
}

// acc[r, i] = s[r] * c[r, i] (first) or acc[r, i] += s[r] * c[r, i], r < rows, i < cols (lines of 64; s[r] at
// s + r * sstride): a group's sums scaled into the block's accumulator, a multiply then an add (no FMA), as the
// scalar loop computes them.
WB_TARGET("avx512f") void scale_rows_avx512(const float* c, int64_t rows, int64_t cols, const float* s,
                                            int64_t sstride, bool first, float* acc) {
  const __mmask16 tail = static_cast<__mmask16>(cols % 16 ? (1u << (cols % 16)) - 1 : 0xFFFF);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 sv = _mm512_set1_ps(s[r * sstride]);
    const float* cr = c + r * kSplitCols;
    float* ar = acc + r * kSplitCols;
    for (int64_t i = 0; i < cols; i += 16) {
      const __mmask16 k = i + 16 <= cols ? static_cast<__mmask16>(0xFFFF) : tail;
      __m512 v = _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(k, cr + i));
      if (!first) v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, ar + i), v);
      _mm512_mask_storeu_ps(ar + i, k, v);
    }
  }
}
#endif

void pack_pairs(const uint32_t* src, int64_t rows, int64_t P, int64_t lb, uint32_t* dst) {
#if WB_X86
  if (split_avx512()) {
    pack_pairs_avx512(src, rows, P, lb, dst);
    return;
  }
#endif
  pack_pairs_scalar(src, rows, P, lb, dst);
}

// A block of y^T (rows x cols, lines of 64) stored into y: out[i * ldo + r] = s[r] * acc[r, i] + bias[r] (s, bias:
// either may be null), by register transposes on AVX-512.
void store_y_block(const float* acc, int64_t rows, int64_t cols, const float* s, const float* bias, float* out,
                   int64_t ldo, bool avx512) {
#if WB_X86
  if (avx512) {
    store_transposed_avx512(acc, rows, cols, kSplitCols, s, bias, out, ldo);
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < cols; ++i) {
      float v = acc[r * kSplitCols + i];
      if (s) v = s[r] * v;
      out[i * ldo + r] = bias ? v + bias[r] : v;
    }
}

// Rows m0 .. m1 of x (x points at row m0) into the three parts of all M rows.
void split_parts(const float* x, int64_t M, int64_t m0, int64_t m1, int64_t K, int64_t Kp, uint16_t* out) {
  for (int64_t m = m0; m < m1; ++m) {
    uint16_t *o1 = out + m * Kp, *o2 = o1 + M * Kp, *o3 = o2 + M * Kp;
#if WB_X86
    if (split_avx512()) {
      split_parts_avx512(x + (m - m0) * K, K, o1, o2, o3);
      for (int64_t k = K; k < Kp; ++k) o1[k] = o2[k] = o3[k] = 0;
      continue;
    }
#endif
    split_parts_scalar(x + (m - m0) * K, K, Kp, o1, o2, o3);
  }
}
}  // namespace

torch::Tensor prefill_split(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                            const torch::Tensor& zero, int64_t bits, int64_t group,
                            const c10::optional<torch::Tensor>& bias) {
  namespace cb = at::native::cpublas;
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || bf16) && x.is_contiguous() && x.device().is_cpu(),
              "weight_only_linear_cpu: x must be a contiguous 2-D float32 or bfloat16 CPU tensor");
  const Weight W = view(q, scale, zero, c10::nullopt, bits, group, x.size(1));
  const int64_t M = x.size(0), K = W.K, N = W.N, G = W.G;
  TORCH_CHECK(G == 1 || group % 2 == 0, "weight_only_linear_cpu: the split path needs an even group size");
  TORCH_CHECK(split_available(), "weight_only_linear_cpu: the split path needs AMX bf16 (cpublas::could_pack)");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N),
              "weight_only_linear_cpu: bias must be contiguous float32 (N,)");
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  if (M == 0 || N == 0) return bf16 ? out.to(torch::kBFloat16) : out;
  if (K == 0) {   // an empty sum: the bias, or zeros
    if (has_bias) out.copy_(bias->expand({M, N})); else out.zero_();
    return bf16 ? out.to(torch::kBFloat16) : out;
  }
  const int64_t Kp = K + (K & 1);
  const int P = bf16 ? 1 : 3;                    // parts of x: bf16 x is its own single part
  // B: x's three parts, per block of 64 rows of x, pair-interleaved: part p, block j, element (k, m) at
  // ((k / 2) * ldb + m) * 2 + k % 2; padded rows of x and the pad of an odd K are zeros.
  const int64_t MB = (M + kSplitCols - 1) / kSplitCols;
  std::vector<int64_t> ldb(MB);
  for (int64_t j = 0; j < MB; ++j) ldb[j] = (std::min(kSplitCols, M - j * kSplitCols) + 15) / 16 * 16;
  const int64_t part_stride = Kp * kSplitCols;   // bf16 values per (part, block)
  // x's parts (rows m0 .. m1, row-major (M, Kp) each) and their packed blocks
  auto split_rows = [&](int64_t m0, int64_t m1, uint16_t* parts) {
    if (bf16) {
      const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
      for (int64_t m = m0; m < m1; ++m) {
        std::copy(xb + m * K, xb + (m + 1) * K, parts + m * Kp);
        if (Kp > K) parts[m * Kp + K] = 0;
      }
    } else {
      split_parts(x.data_ptr<float>() + m0 * K, M, m0, m1, K, Kp, parts);
    }
  };
  auto pack_block = [&](int64_t i, const uint16_t* parts, uint16_t* bx) {
    const int64_t p = i / MB, j = i % MB;
    const int64_t m0 = j * kSplitCols, cols = std::min(kSplitCols, M - m0), lb = ldb[j];
    const uint32_t* src = reinterpret_cast<const uint32_t*>(parts + (p * M + m0) * Kp);  // pairs of k
    pack_pairs(src, cols, Kp / 2, lb, reinterpret_cast<uint32_t*>(bx + (p * MB + j) * part_stride));
  };
  // A small x (up to 256 k values): every thread prepares its own copy inside the one parallel region of the
  // call; a shared copy costs a serial phase, two more fork-joins and a copy between the cores' caches, and on
  // small weights two threads ran slower than one. A larger x is prepared once, across the threads.
  const bool local = M * Kp <= (int64_t{1} << 18);
  thread_local Scratch<uint16_t> parts_buf, bx_buf;
  uint16_t* shared_bx = nullptr;
  if (!local) {
    uint16_t* parts = parts_buf.get(P * M * Kp);
    at::parallel_for(0, M, rows_grain(K, 16), [&](int64_t m0, int64_t m1) { split_rows(m0, m1, parts); });
    shared_bx = bx_buf.get(P * MB * part_stride);
    at::parallel_for(0, P * MB, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) pack_block(i, parts, shared_bx);
    });
  }
  float* op = out.data_ptr<float>();
  const float* biasp = has_bias ? bias->data_ptr<float>() : nullptr;
  // blocks of weight rows of ~1 MB decoded (16 to 256 rows); the threads share the rows in even ranges of whole
  // 16-row units (blocks of a fixed size would leave one thread most of a small weight: 576 rows in blocks of
  // 256 ran at 1.0x on two threads)
  const int64_t nb = std::min(N, std::clamp<int64_t>((int64_t{1} << 20) / (2 * Kp) / 16 * 16, 16, 256));
  // one chain per group; a one-group weight in chunks of K for fp32 x (three parts: shorter sums), whole for bf16
  const int64_t cg = G == 1 ? (bf16 ? Kp : kSplitChunk) : group, CG = (Kp + cg - 1) / cg;
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t u0, int64_t u1) {
    thread_local Scratch<uint16_t> a_buf;
    thread_local Scratch<uint8_t> c_buf;
    thread_local Scratch<float> cbuf_buf, acc_buf;
    uint16_t* a = a_buf.get(nb * Kp);
    uint8_t* c = c_buf.get(K + 64);
    float* cbuf = cbuf_buf.get(nb * kSplitCols);
    // the block's y^T for 64 rows of x: the group sums scaled and added up (one chain: C itself, scaled as it is
    // stored into y)
    float* acc = CG == 1 ? cbuf : acc_buf.get(nb * kSplitCols);
    const uint16_t* bx = shared_bx;
    thread_local Scratch<uint16_t> own_parts, own_bx;
    if (local) {
      uint16_t* parts = own_parts.get(P * M * Kp);
      uint16_t* b = own_bx.get(P * MB * part_stride);
      split_rows(0, M, parts);
      for (int64_t i = 0; i < P * MB; ++i) pack_block(i, parts, b);
      bx = b;
    }
    const int64_t end = std::min(N, u1 * 16);
    for (int64_t n0 = u0 * 16; n0 < end; n0 += nb) {
      const int64_t rows = std::min(nb, end - n0);
      for (int64_t r = 0; r < rows; ++r) decode_row_int_bf16(W, n0 + r, c, a + r * Kp, Kp);
      for (int64_t j = 0; j < MB; ++j) {
        const int64_t m0 = j * kSplitCols, cols = std::min(kSplitCols, M - m0), lb = ldb[j];
        // one brgemm chain per group (per 512 values of K for a one-group weight: shorter fp32 sums), then its
        // sums scaled: acc[r, i] (+)= s[n0 + r, g] * C[r, i]
        for (int64_t g = 0; g < CG; ++g) {
          const int64_t k0 = g * cg, len = std::min(cg, Kp - k0);
          // (at most 64 weight rows per brgemm: on 64-256-wide K, 128 and 256 rows in one call measured 1.3-1.5x
          // the time per row of 32-64)
          for (int64_t r0 = 0; r0 < rows; r0 += kSplitCols) {
            for (int p = 0; p < P; ++p) {
              const uint16_t* bp = bx + (p * MB + j) * part_stride + (k0 / 2) * lb * 2;
              cb::brgemm(std::min(kSplitCols, rows - r0), lb, len, Kp, lb, kSplitCols, p > 0,
                         reinterpret_cast<const at::BFloat16*>(a + r0 * Kp + k0),
                         reinterpret_cast<const at::BFloat16*>(bp), cbuf + r0 * kSplitCols, true);
            }
          }
          if (CG == 1) continue;   // (one chain: scaled as it is stored)
          const float* s = W.scale + n0 * G + (G == 1 ? 0 : g);   // (one group in chunks of K: its one scale)
#if WB_X86
          if (split_avx512()) {
            scale_rows_avx512(cbuf, rows, cols, s, G, g == 0, acc);
            continue;
          }
#endif
          for (int64_t r = 0; r < rows; ++r) {
            const float sr = s[r * G];
            const float* cr = cbuf + r * kSplitCols;
            float* ar = acc + r * kSplitCols;
            for (int64_t i = 0; i < cols; ++i) ar[i] = g == 0 ? sr * cr[i] : ar[i] + sr * cr[i];
          }
        }
        // y[m0 + i, n0 + r] = acc[r, i] + bias[n0 + r]
        store_y_block(acc, rows, cols, CG == 1 ? W.scale + n0 * G : nullptr, biasp ? biasp + n0 : nullptr,
                      op + m0 * N + n0, N, split_avx512());
      }
    }
    cb::brgemm_release(true);
    own_bx.trim(kScratchKeep);   // (its blocks are 64 columns wide whatever M: 3 x 128 K bytes)
  });
  parts_buf.trim(kScratchKeep);
  bx_buf.trim(kScratchKeep);
  return bf16 ? out.to(torch::kBFloat16) : out;   // bf16 x: the fp32 sums rounded once
}

// bf16 x on AMX, many rows: the reference's bf16 math (each weight row decoded in fp32 and rounded to bf16, an
// fp32-accumulated product rounded to bf16) without the reorder oneDNN's matmul makes of a plain weight on every
// call: blocks of 64 decoded rows are transposed straight into AMX's pair-interleaved layout and multiplied by
// brgemm with x as its A. 4- and 8-bit integer codes in whole 32-value groups (the one-pass AVX-512 decode).
namespace {
constexpr int64_t kAmxCols = 64;   // weight rows per block: the widest packed B here

#if WB_X86
// out[m, i] = bf16(C[m, i] + bias[i]) for i < cols (C: ld 64 fp32)
WB_TARGET("avx512f,avx512bw,avx512vl,avx512bf16") void store_bf16_rows(const float* C, int64_t M, int64_t cols, const float* bias,
                                                      uint16_t* out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    const float* c = C + m * kAmxCols;
    uint16_t* o = out + m * ldo;
    for (int64_t i = 0; i < cols; i += 16) {
      const __mmask16 k = static_cast<__mmask16>(cols - i >= 16 ? 0xFFFF : (1u << (cols - i)) - 1);
      __m512 v = _mm512_maskz_loadu_ps(k, c + i);
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + i));
      _mm256_mask_storeu_epi16(o + i, k, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}
#endif
}  // namespace

torch::Tensor prefill_amx(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          const torch::Tensor& zero, int64_t bits, int64_t group,
                          const c10::optional<torch::Tensor>& bias) {
  namespace cb = at::native::cpublas;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
              "weight_only_linear_cpu: x must be a contiguous 2-D bfloat16 CPU tensor");
  const Weight W = view(q, scale, zero, c10::nullopt, bits, group, x.size(1));
  const int64_t M = x.size(0), K = W.K, N = W.N;
  TORCH_CHECK(W.whole32() && split_available() && split_avx512(),
              "weight_only_linear_cpu: the AMX bf16 path needs 4- or 8-bit codes in groups of a multiple of 32 and "
              "AMX");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N),
              "weight_only_linear_cpu: bias must be contiguous float32 (N,)");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if WB_X86
  const auto* xb = reinterpret_cast<const at::BFloat16*>(x.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  const int64_t nblocks = (N + kAmxCols - 1) / kAmxCols;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    thread_local Scratch<uint16_t> rows_buf, b_buf;
    thread_local Scratch<float> c_buf;
    uint16_t* rows = rows_buf.get(kAmxCols * K);
    uint16_t* B = b_buf.get(K * kAmxCols);
    float* C = c_buf.get(std::min<int64_t>(M, kSplitCols) * kAmxCols);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kAmxCols, nr = std::min(kAmxCols, N - n0);
      for (int64_t r = 0; r < nr; ++r) decode_row_avx512<true>(W, n0 + r, rows + r * K);
      pack_pairs(reinterpret_cast<const uint32_t*>(rows), nr, K / 2, kAmxCols, reinterpret_cast<uint32_t*>(B));
      for (int64_t m0 = 0; m0 < M; m0 += kSplitCols) {
        const int64_t mr = std::min(kSplitCols, M - m0);
        cb::brgemm(mr, kAmxCols, K, K, kAmxCols, kAmxCols, false, xb + m0 * K,
                   reinterpret_cast<const at::BFloat16*>(B), C, true);
        store_bf16_rows(C, mr, nr, bp ? bp + n0 : nullptr, op + m0 * N + n0, N);
      }
    }
    cb::brgemm_release(true);
  });
#endif
  return out;
}

// fp32 x on weights that stay in cache: blocks of decoded fp32 weight rows - the reference's values bit for bit -
// times x^T by oneDNN's fp32 brgemm (PyTorch's cpublas), whose AVX-512 micro-kernels multiply these small shapes
// 1.2-4.6x faster than the fp32 GEMM behind F.linear (MKL; measured side by side in docs/kernels.md).
// Orientation as in the split path: A is a block of decoded weight rows as stored, B x transposed (64 rows of x at
// a time), C y transposed, stored into y with the bias. Every format the decode takes (any bits, group, NF4).
bool brgemm_f32_here() {
#if WB_X86
  // oneDNN's fp32 brgemm needs AVX-512 core (F, BW, VL, DQ); without it cpublas falls back to a plain GEMM
  static const bool ok = best_isa() == Isa::Avx512 && (__builtin_cpu_init(), __builtin_cpu_supports("avx512bw")) &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
#else
  return false;
#endif
}

torch::Tensor prefill_f32(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          const c10::optional<torch::Tensor>& zero, const c10::optional<torch::Tensor>& lut,
                          int64_t bits, int64_t group, const c10::optional<torch::Tensor>& bias,
                          const std::string& isa) {
  namespace cb = at::native::cpublas;
  const Weight W = fp32_call(x, q, scale, zero, lut, bits, group, bias);
  const int64_t M = x.size(0), K = W.K, N = W.N;
  const bool has_bias = bias.has_value() && bias->defined();
  const Isa use = parse_isa(isa);
  const Kernels kern = kernels_for(use);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return has_bias ? out.copy_(bias->expand({M, N})) : out.zero_();
  const bool direct = WB_X86 && use == Isa::Avx512 && W.whole32();
  // B: x^T per block of 64 rows of x, (K, ldb) at xt + j * K * 64, ldb = the block's rows rounded up to 16. Each
  // thread packs its own copy, in the one parallel region of the call: on small weights a shared copy cost a
  // serial phase, a second fork-join and a copy between the cores' caches, and two threads ran slower than one.
  const int64_t MB = (M + kSplitCols - 1) / kSplitCols;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* biasp = has_bias ? bias->data_ptr<float>() : nullptr;
  // blocks of up to 64 weight rows; the threads share the rows in even ranges of whole 16-row units
  const int64_t nb = std::min<int64_t>(N, kSplitCols);
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t u0, int64_t u1) {
    thread_local Scratch<float> w_buf, c_buf, xt_buf;
    thread_local Scratch<uint8_t> code_buf;
    float* wr = w_buf.get(nb * K);
    float* C = c_buf.get(nb * kSplitCols);
    uint8_t* c = code_buf.get(K + 64);
    float* xt = xt_buf.get(MB * K * kSplitCols);
    for (int64_t j = 0; j < MB; ++j) {
      const int64_t m0 = j * kSplitCols, cols = std::min(kSplitCols, M - m0);
      pack_pairs(reinterpret_cast<const uint32_t*>(xp + m0 * K), cols, K, (cols + 15) / 16 * 16,
                 reinterpret_cast<uint32_t*>(xt + j * K * kSplitCols));
    }
    const int64_t end = std::min(N, u1 * 16);
    for (int64_t n0 = u0 * 16; n0 < end; n0 += nb) {
      const int64_t rows = std::min(nb, end - n0);
      for (int64_t r = 0; r < rows; ++r) {
#if WB_X86
        if (direct) {
          decode_row_avx512<false>(W, n0 + r, wr + r * K);
          continue;
        }
#endif
        decode_row(W, kern, n0 + r, c, wr + r * K);
      }
      for (int64_t j = 0; j < MB; ++j) {
        const int64_t m0 = j * kSplitCols, cols = std::min(kSplitCols, M - m0), lb = (cols + 15) / 16 * 16;
        cb::brgemm(rows, lb, K, K, lb, kSplitCols, false, wr, xt + j * K * kSplitCols, C, false);
        store_y_block(C, rows, cols, nullptr, biasp ? biasp + n0 : nullptr, op + m0 * N + n0, N, use == Isa::Avx512);
      }
    }
    cb::brgemm_release(false);
    xt_buf.trim(kScratchKeep);
    w_buf.trim(kScratchKeep);
  });
  return out;
}

// The whole call of a weight-only Linear: x of any shape (..., K) and float dtype, the path picked by its rows and
// dtype (the rules and thresholds are worked out in weight_only_cpu.py, once per packed weight, and passed in),
// the result in x's dtype and shape. One C++ call instead of the Python it replaces (reshape, dtype and
// contiguity checks, view): ~3 us less per call, which on layers of a few hundred values wide is a measurable
// share of the call (docs/kernels.md). No autograd graph is recorded.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                     const c10::optional<torch::Tensor>& zero, const c10::optional<torch::Tensor>& lut, int64_t bits,
                     int64_t group, int64_t K, const c10::optional<torch::Tensor>& scale16, double zconst,
                     const c10::optional<torch::Tensor>& bias, int64_t prefill_rows,
                     int64_t split_rows, int64_t split_rows_bf16, bool split_ok, bool amx_ok, int64_t split_min_rows,
                     int64_t amx_bf16_rows, int64_t brgemm_rows, int64_t brgemm_rows_threads,
                     const std::string& isa) {
  torch::NoGradGuard no_grad;
  static const bool bf16_here = native_bf16();
  // asked on every call: oneDNN's answer follows torch.backends.mkldnn.enabled
  const bool amx_here = split_avx512() && split_available();
  const int64_t N = q.size(0);
  auto x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  const bool amx = amx_here && isa == "auto";
  const bool has_bias = bias.has_value() && bias->defined();
  // the AMX paths add the bias in fp32, taken in x's dtype (bf16) first as the reference takes it
  auto bias_bf16_fp32 = [&]() -> c10::optional<torch::Tensor> {
    if (!has_bias) return c10::nullopt;
    return bias->to(torch::kBFloat16).to(torch::kFloat).contiguous();
  };
  if (x2.scalar_type() == torch::kBFloat16) {
    if (amx && split_ok && M > split_min_rows && M <= split_rows_bf16) {
      // the exact products x (u - z), fp32 sums, one rounding
      return prefill_split(x2.contiguous(), q, scale, *zero, bits, group, bias_bf16_fp32()).view(shape);
    }
    // (above PREFILL_ROWS = 16 rows whatever the weight's size, weight_only_cpu.py: fewer bf16 rows compute in fp32)
    if (M > std::max<int64_t>(prefill_rows, 16) && bf16_here) {
      auto xc = x2.contiguous();
      if (amx && amx_ok && M <= amx_bf16_rows)
        return prefill_amx(xc, q, scale, *zero, bits, group, bias_bf16_fp32()).view(shape);
      c10::optional<torch::Tensor> b;
      if (has_bias) b = bias->to(torch::kBFloat16).contiguous();
      return prefill(xc, q, scale, zero, lut, bits, group, b, 0, isa).view(shape);
    }
  }
  // fp32 math from here; the bias taken in x's dtype first, as the reference takes it
  c10::optional<torch::Tensor> b;
  if (has_bias) {
    torch::Tensor bx = bias->scalar_type() == x.scalar_type() ? *bias : bias->to(x.scalar_type());
    b = (bx.scalar_type() == torch::kFloat && bx.is_contiguous()) ? bx : bx.to(torch::kFloat).contiguous();
  }
  if (x2.scalar_type() != torch::kFloat || !x2.is_contiguous()) x2 = x2.to(torch::kFloat).contiguous();
  torch::Tensor y;
  if (amx && split_ok && M > split_min_rows && M <= split_rows) {
    y = prefill_split(x2, q, scale, *zero, bits, group, b);
  } else if (M <= prefill_rows) {
    y = gemv(x2, q, scale, zero, lut, bits, group, b, isa, scale16, zconst);
  } else if (M <= (at::get_num_threads() > 1 ? brgemm_rows_threads : brgemm_rows) && isa == "auto" &&
             brgemm_f32_here()) {
    y = prefill_f32(x2, q, scale, zero, lut, bits, group, b, isa);
  } else {
    y = prefill(x2, q, scale, zero, lut, bits, group, b, 0, isa);
  }
  y = y.view(shape);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// ---------------------------------------------------------------------------------------------------------
// Dense fp32 weights at one row of x (the decode step's fp32 Linears and heads): y (1, N) = x (1, K) W^T + bias.
// A GEMV reads the weight once and computes little; PyTorch's fp32 GEMM at M = 1 reached 60-90 % of the stream
// this reaches on weights that are not in cache (prototype, 1 thread, Xeon: 5632 x 2048 9.0 -> 11.8 GB/s, 32000 x
// 2048 11.6 -> 12.4); on a whole model whose weights come from memory (llama-480m fp32, its decode step side by
// side with and without this kernel) no difference was measurable, on layers in cache it is ~2x (tiny-llama: a
// 864 x 320 layer 12 vs 25 us, the fp32 step 6.6 -> 5.5 ms). Four weight rows a step share each load of x; each
// row's stream is prefetched ahead.
constexpr int64_t kDensePrefetchBytes = 1024;

#if WB_X86
WB_TARGET("avx512f") void dense_rows_avx512(const float* x, const float* w, int64_t K, int64_t n0, int64_t n1,
                                            float* y) {
  const int64_t K16 = K & ~int64_t{15};
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - K16)) - 1);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float* r[4] = {w + n * K, w + (n + 1) * K, w + (n + 2) * K, w + (n + 3) * K};
    __m512 a[4], b[4];
    for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K16; k += 32) {
      const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
      for (int i = 0; i < 4; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(r[i] + k) + kDensePrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(r[i] + k) + kDensePrefetchBytes + 64, _MM_HINT_T0);
        a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(r[i] + k), x0, a[i]);
        b[i] = _mm512_fmadd_ps(_mm512_loadu_ps(r[i] + k + 16), x1, b[i]);
      }
    }
    for (; k < K16; k += 16) {
      const __m512 x0 = _mm512_loadu_ps(x + k);
      for (int i = 0; i < 4; ++i) a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(r[i] + k), x0, a[i]);
    }
    if (tail) {
      const __m512 x0 = _mm512_maskz_loadu_ps(tail, x + K16);
      for (int i = 0; i < 4; ++i) b[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, r[i] + K16), x0, b[i]);
    }
    for (int i = 0; i < 4; ++i) y[n + i] = _mm512_reduce_add_ps(_mm512_add_ps(a[i], b[i]));
  }
  for (; n < n1; ++n) {
    const float* r = w + n * K;
    __m512 a = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(r + k), _mm512_loadu_ps(x + k), a);
    if (tail) a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, r + K16), _mm512_maskz_loadu_ps(tail, x + K16), a);
    y[n] = _mm512_reduce_add_ps(a);
  }
}

WB_TARGET("avx2,fma") void dense_rows_avx2(const float* x, const float* w, int64_t K, int64_t n0, int64_t n1,
                                           float* y) {
  const int64_t K8 = K & ~int64_t{7};
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float* r[4] = {w + n * K, w + (n + 1) * K, w + (n + 2) * K, w + (n + 3) * K};
    __m256 a[4], b[4];
    for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K8; k += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      for (int i = 0; i < 4; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(r[i] + k) + kDensePrefetchBytes, _MM_HINT_T0);
        a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(r[i] + k), x0, a[i]);
        b[i] = _mm256_fmadd_ps(_mm256_loadu_ps(r[i] + k + 8), x1, b[i]);
      }
    }
    for (; k < K8; k += 8) {
      const __m256 x0 = _mm256_loadu_ps(x + k);
      for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(r[i] + k), x0, a[i]);
    }
    for (int i = 0; i < 4; ++i) {
      float t = hsum(_mm256_add_ps(a[i], b[i]));
      for (int64_t kk = K8; kk < K; ++kk) t += r[i][kk] * x[kk];
      y[n + i] = t;
    }
  }
  for (; n < n1; ++n) {
    const float* r = w + n * K;
    __m256 a = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(r + k), _mm256_loadu_ps(x + k), a);
    float t = hsum(a);
    for (int64_t kk = K8; kk < K; ++kk) t += r[kk] * x[kk];
    y[n] = t;
  }
}
#endif  // WB_X86

// y (..., N) = x (..., K) W^T + bias for fp32 x, W (N, K) and bias: the kernel above where x is one contiguous row
// of K values and W is contiguous on a CPU with AVX2 or AVX-512; otherwise at::linear (what the graph computed).
torch::Tensor dense_gemv(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), "dense_gemv_cpu: x (..., K = ", w.size(1),
              ") and a weight (N, K) are needed, got x ", x.sizes(), " and weight ", w.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  const Isa use = best_isa();
  const bool fast = use >= Isa::Avx2 && x.numel() == x.size(-1) && x.scalar_type() == torch::kFloat &&
                    w.scalar_type() == torch::kFloat && x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() &&
                    w.device().is_cpu() &&
                    (!has_bias || (bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                                   bias->numel() == w.size(0)));
  if (!fast) return at::linear(x, w, bias);
  torch::NoGradGuard no_grad;
  const int64_t N = w.size(0), K = w.size(1);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  auto out = torch::empty(shape, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = out.data_ptr<float>();
#if WB_X86
  const auto rows = use == Isa::Avx512 ? dense_rows_avx512 : dense_rows_avx2;
  at::parallel_for(0, (N + 3) / 4, rows_grain(4 * K, 4), [&](int64_t b0, int64_t b1) {
    rows(xp, wp, K, 4 * b0, std::min(N, 4 * b1), yp);
  });
#endif
  if (has_bias) out.add_(*bias);
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Attention of one query position (a decode step): q (B, Hq, 1, D), the cache's k / v (B, Hkv, L, D) with Hq a
// multiple of Hkv (query head h reads key / value head h / (Hq / Hkv)), a mask broadcastable to (B, Hq, 1, L) -
// bool (true: attend) or float (added to the scores) - and the scale. Per head: the scores of the positions the
// mask leaves (a static cache's unfilled tail is skipped, not computed and masked), their softmax in two passes,
// the weighted sum of v. A head with every position masked gives zeros (as PyTorch's CPU flash attention).
namespace {

#if WB_X86
WB_TARGET("avx512f,fma") float attn_dot_avx512(const float* a, const float* b, int64_t D) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d + 16), _mm512_loadu_ps(b + d + 16), s1);
  }
  for (; d < D; d += 16) {
    const __mmask16 m = D - d >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (D - d)) - 1);
    s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), s0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

// e[l] = exp(s[l] - top) for l < L (0 where s[l] is -inf: a masked position), their sum returned. exp as Cephes'
// expf: 2^n times a degree-7 polynomial of the remainder (within 2 ulp of expf over the softmax's range x <= 0).
WB_TARGET("avx512f,fma") float attn_exp_avx512(const float* s, int64_t L, float top, float* e) {
  const __m512 t = _mm512_set1_ps(top), lo = _mm512_set1_ps(-87.33654f), log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 c1 = _mm512_set1_ps(0.693359375f), c2 = _mm512_set1_ps(-2.12194440e-4f);
  const __m512 p0 = _mm512_set1_ps(1.9875691500e-4f), p1 = _mm512_set1_ps(1.3981999507e-3f),
               p2 = _mm512_set1_ps(8.3334519073e-3f), p3 = _mm512_set1_ps(4.1665795894e-2f),
               p4 = _mm512_set1_ps(1.6666665459e-1f), p5 = _mm512_set1_ps(5.0000001201e-1f), one = _mm512_set1_ps(1.f);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; l += 16) {
    const __mmask16 m = L - l >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (L - l)) - 1);
    const __m512 sv = _mm512_maskz_loadu_ps(m, s + l);
    const __mmask16 live = m & _mm512_cmp_ps_mask(sv, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                                    _CMP_NEQ_OQ);
    const __m512 x = _mm512_max_ps(_mm512_sub_ps(sv, t), lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, c2, _mm512_fnmadd_ps(n, c1, x));
    __m512 y = _mm512_fmadd_ps(p0, r, p1);
    y = _mm512_fmadd_ps(y, r, p2);
    y = _mm512_fmadd_ps(y, r, p3);
    y = _mm512_fmadd_ps(y, r, p4);
    y = _mm512_fmadd_ps(y, r, p5);
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, one));
    const __m512 ev = _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n));
    _mm512_mask_storeu_ps(e + l, m, ev);
    acc = _mm512_add_ps(acc, ev);
  }
  return _mm512_reduce_add_ps(acc);
}

// o[0 .. Dv) = sum over l of e[l] v[l] (rows of v vs apart; positions with e[l] = 0 skipped): 64 columns at a time
// in registers
WB_TARGET("avx512f,fma") void attn_pv_avx512(const float* e, const float* v, int64_t vs, int64_t L, int64_t Dv,
                                             float* o) {
  for (int64_t d0 = 0; d0 < Dv; d0 += 64) {
    __mmask16 mk[4];
    __m512 acc[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t rem = Dv - d0 - 16 * j;
      mk[j] = rem >= 16 ? __mmask16(0xFFFF) : rem > 0 ? __mmask16((1u << rem) - 1) : __mmask16(0);
      acc[j] = _mm512_setzero_ps();
    }
    for (int64_t l = 0; l < L; ++l) {
      if (e[l] == 0.f) continue;
      const __m512 w = _mm512_set1_ps(e[l]);
      const float* row = v + l * vs + d0;
      for (int j = 0; j < 4; ++j)
        if (mk[j]) acc[j] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(mk[j], row + 16 * j), acc[j]);
    }
    for (int j = 0; j < 4; ++j)
      if (mk[j]) _mm512_mask_storeu_ps(o + d0 + 16 * j, mk[j], acc[j]);
  }
}

WB_TARGET("avx2,fma") float attn_dot_avx2(const float* a, const float* b, int64_t D) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
  }
  for (; d + 8 <= D; d += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
  float t = hsum(_mm256_add_ps(s0, s1));
  for (; d < D; ++d) t += a[d] * b[d];
  return t;
}

WB_TARGET("avx2,fma") void attn_axpy_avx2(float w, const float* x, int64_t D, float* y) {
  const __m256 ww = _mm256_set1_ps(w);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(ww, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
  for (; d < D; ++d) y[d] += w * x[d];
}
#endif  // WB_X86

float attn_dot_scalar(const float* a, const float* b, int64_t D) {
  float t = 0.f;
  for (int64_t d = 0; d < D; ++d) t += a[d] * b[d];
  return t;
}

void attn_axpy_scalar(float w, const float* x, int64_t D, float* y) {
  for (int64_t d = 0; d < D; ++d) y[d] += w * x[d];
}

}  // namespace

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask, c10::optional<double> scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == k.size(0) && k.size(0) == v.size(0) &&
                  q.size(3) == k.size(3) && k.size(2) == v.size(2) && k.size(1) == v.size(1) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0,
              "decode_attention_cpu: q (B, Hq, T, D), k (B, Hkv, L, D) and v (B, Hkv, L, Dv) with Hq a multiple of "
              "Hkv are needed, got q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes());
  const bool has_mask = mask.has_value() && mask->defined();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k.size(1), L = k.size(2), Dv = v.size(3);
  const double s = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D));
  const Isa use = best_isa();
  auto f32 = [](const torch::Tensor& t) { return t.scalar_type() == torch::kFloat && t.device().is_cpu(); };
  const bool fast = q.size(2) == 1 && f32(q) && f32(k) && f32(v) && q.stride(3) == 1 && k.stride(3) == 1 &&
                    v.stride(3) == 1 &&
                    (!has_mask || ((mask->scalar_type() == torch::kFloat || mask->scalar_type() == torch::kBool) &&
                                   mask->device().is_cpu() && mask->dim() <= 4 && mask->size(-1) == L));
  if (!fast) {   // what the graph computed: PyTorch's CPU flash attention
    return std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, false, has_mask ? c10::optional<at::Tensor>(*mask) : c10::nullopt, s));
  }
  torch::NoGradGuard no_grad;
  torch::Tensor m;
  if (has_mask) m = mask->expand({B, Hq, 1, L});   // (a shape that does not broadcast: expand's error)
  auto out = torch::zeros({B, Hq, 1, Dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool is_bool = has_mask && m.scalar_type() == torch::kBool;
  const float* mf = has_mask && !is_bool ? m.data_ptr<float>() : nullptr;
  const bool* mb = is_bool ? m.data_ptr<bool>() : nullptr;
  const int64_t group = Hq / Hkv;
  const float fs = static_cast<float>(s);
  float (*dot)(const float*, const float*, int64_t) = attn_dot_scalar;
  void (*axpy)(float, const float*, int64_t, float*) = attn_axpy_scalar;
  void (*rows)(const float*, const float*, int64_t, int64_t, int64_t, float*) = nullptr;
#if WB_X86
  if (use == Isa::Avx512) dot = attn_dot_avx512, rows = dense_rows_avx512;
  else if (use == Isa::Avx2) dot = attn_dot_avx2, axpy = attn_axpy_avx2, rows = dense_rows_avx2;
#endif
  constexpr float kNegInf = -std::numeric_limits<float>::infinity(), kMaskedBelow = -1e30f;
  const int64_t per_head = std::max<int64_t>(L * (D + Dv), 1);
  at::parallel_for(0, B * Hq, std::max<int64_t>(1, (int64_t{1} << 16) / per_head), [&](int64_t h0, int64_t h1) {
    std::vector<float> p(static_cast<size_t>(L));
    for (int64_t bh = h0; bh < h1; ++bh) {
      const int64_t b = bh / Hq, h = bh % Hq, hk = h / group;
      const float* qr = qp + b * q.stride(0) + h * q.stride(1);
      const float* kr = kp + b * k.stride(0) + hk * k.stride(1);
      const float* vr = vp + b * v.stride(0) + hk * v.stride(1);
      const int64_t mo = has_mask ? b * m.stride(0) + h * m.stride(1) : 0, ms = has_mask ? m.stride(3) : 0;
      // scores of each run of positions the mask leaves: q times their key rows (the dense GEMV's rows where
      // the keys are contiguous rows of D), scaled, plus the mask's value. A position counts as masked where the
      // mask says false or -inf, and where its float value is at most -1e30 (transformers' masks use the lowest
      // float: exp of the difference to the top score is 0 in fp32) unless every position of the head is so.
      auto scores = [&](bool huge_masks) {
        auto masked = [&](int64_t l) {
          return (mb && !mb[mo + l * ms]) || (mf && (mf[mo + l * ms] == kNegInf ||
                                                     (huge_masks && mf[mo + l * ms] <= kMaskedBelow)));
        };
        float top = kNegInf;
        for (int64_t l = 0; l < L;) {
          if (masked(l)) {
            p[l++] = kNegInf;
            continue;
          }
          int64_t r = l + 1;
          while (r < L && !masked(r)) ++r;
          if (rows && k.stride(2) == D) {
            rows(qr, kr, D, l, r, p.data());
          } else {
            for (int64_t i = l; i < r; ++i) p[i] = dot(qr, kr + i * k.stride(2), D);
          }
          for (; l < r; ++l) {
            p[l] = p[l] * fs + (mf ? mf[mo + l * ms] : 0.f);
            top = std::max(top, p[l]);
          }
        }
        return top;
      };
      float top = scores(true);
      if (top == kNegInf && mf) top = scores(false);
      float* o = op + bh * Dv;
      if (top == kNegInf) continue;   // every position masked: zeros
      float sum = 0.f;
#if WB_X86
      if (use == Isa::Avx512) {
        sum = attn_exp_avx512(p.data(), L, top, p.data());
        attn_pv_avx512(p.data(), vr, v.stride(2), L, Dv, o);
      } else
#endif
      {
        for (int64_t l = 0; l < L; ++l) {
          if (p[l] == kNegInf) continue;
          const float e = std::exp(p[l] - top);
          sum += e;
          axpy(e, vr + l * v.stride(2), Dv, o);
        }
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
    }
  });
  return out;
}

// The op workbench::weight_only_linear_cpu (schema in kernels/ops.py): the default call of `linear`, its path rules
// as one int[] (CpuWeight.call_rules, the two bools as ints). Registered here, not in Python: a compiled decode step
// then reaches the kernel through the dispatcher alone (a Python implementation cost ~14 us a call, more than the
// kernel of a small layer).
static torch::Tensor linear_op(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& zero, const c10::optional<torch::Tensor>& lut,
                        const c10::optional<torch::Tensor>& bias, int64_t bits, int64_t group, int64_t K,
                        c10::IntArrayRef rules, const c10::optional<torch::Tensor>& scale16, double zconst) {
  TORCH_CHECK(rules.size() == 9, "weight_only_linear_cpu: rules must hold 9 ints (CpuWeight.call_rules), got ",
              rules.size());
  return linear(x, q, scale, zero, lut, bits, group, K, scale16, zconst, bias, rules[0], rules[1], rules[2],
                rules[3] != 0, rules[4] != 0, rules[5], rules[6], rules[7], rules[8], "auto");
}

TORCH_LIBRARY_IMPL(workbench, CPU, m) {
  m.impl("weight_only_linear_cpu", &linear_op);
  m.impl("dense_gemv_cpu", &dense_gemv);
  m.impl("decode_attention_cpu", &decode_attention);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "weight-only Linear, one decoded weight row at a time (see kernels/weight_only_cpu.py)");
  m.def("decode_attention", &decode_attention, "fp32 attention of one query position over a key / value cache");
  m.def("prefill", &prefill, "weight-only Linear for many rows: blocks of decoded rows times an fp32 GEMM");
  m.def("prefill_split", &prefill_split, "fp32 x times integer codes on AMX: x split into three exact bf16 parts");
  m.def("linear", &linear, "a weight-only Linear: x (..., K) of any float dtype, the path picked by rows and dtype");
  m.def("dense_gemv", &dense_gemv, "fp32 x (..., K) one row times a dense fp32 weight (N, K), plus bias");
  m.def("prefill_f32", &prefill_f32, "fp32 x, small weights: blocks of decoded fp32 rows times x^T by fp32 brgemm");
  m.def("brgemm_f32_here", &brgemm_f32_here, "whether oneDNN's fp32 brgemm micro-kernels run on this CPU");
  m.def("prefill_amx", &prefill_amx, "bf16 x, many rows: decoded bf16 weight blocks packed for AMX, brgemm");
  m.def("split_available", &split_available, "whether AMX bf16 brgemm is available (cpublas::could_pack)");
  m.def("decode", &decode, "the stored weight decoded to fp32 (N, K)");
  m.def("native_bf16", &native_bf16, "whether the CPU has bf16 arithmetic (AVX512_BF16)");
  m.def("cpu_isa", &cpu_isa, "the vector ISA used on this CPU: avx512, avx2 or scalar");
}
