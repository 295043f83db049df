// Low-bit weights times activations rounded to int8, on integer dot-product instructions (the numerics and the
// layout are described in kernels/act_int8_cpu.py). One call:
//
//   1. each row of x is rounded to int8 per block of 32 values: d = max|x| / 127, q = round(x * (127 / max|x|))
//      (to nearest, ties to even), and laid out for the weight's code order (below); per block the sum of q;
//   2. each output row n (rows split across threads) reads its codes as stored, 64 (AVX-512) or 32 (AVX2) bytes
//      at a time, and multiplies them with q in int32 (vpdpbusd: unsigned codes x signed q, four products per
//      lane); each lane's sums are scaled by its block's d and its group's scale (read as stored, fp16);
//   3. the zero points come in once per group: y -= sum_g s[g] z[g] sum_{b in g} d_b qsum_b.
//
// Code order: a row of 4-bit codes holds code 2j in the low nibble of byte j and code 2j + 1 in the high one, so
// q is given as the even codes of a chunk's bytes followed by its odd ones (one AND and one shift per chunk put
// the nibbles in front of their activations). 8-bit codes meet q in order. A lane (four bytes of a chunk) lies in
// one block of 32 codes, so each lane's int32 sum has one block scale d and one group scale s.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define WB_X86 1
#include <immintrin.h>
#define WB_TARGET(isa) __attribute__((target(isa)))
#else
#define WB_X86 0
#define WB_TARGET(isa)
#endif

#include "cpu_isa.h"   // Isa, isa_cap

namespace {

// Isa (cpu_isa.h) Avx512 here: F + BW + VL + VNNI (the int8 dot product in 512 bits)

constexpr int64_t kPrefetchBytes = 4096;   // how far ahead of the codes being read the next ones are fetched
constexpr int kMaxRowsX = 4;               // rows of x per sweep of a weight row

inline float half_to_float(uint16_t h) {   // IEEE binary16 -> binary32 (exact)
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {   // subnormal: normalise
      int e = -1;
      uint32_t m = man;
      do { m <<= 1; ++e; } while (!(m & 0x400));
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The stored weight, as one call sees it.
struct Weight {
  const uint8_t* q;        // (N, row_bytes) codes, lowest bits first
  const uint16_t* scale;   // (N, G) fp16
  const void* zero;        // (N, G) uint8 or fp16, or nullptr: every zero point is zconst
  bool zero_half;          // zero holds fp16 (HQQ's real-valued zero points) rather than uint8 codes
  float zconst;
  int64_t N, K, G, group, row_bytes;
  int bits;                // 4 or 8
  // symmetric codes (one integer zero point): z * sum(q) is taken off each lane's int32 sum (RowX::zq) instead of
  // the per-group zero term after the row
  bool fold_zero() const { return !zero && zconst == std::nearbyint(zconst); }
  float zero_at(int64_t n, int64_t g) const {
    if (!zero) return zconst;
    const int64_t i = n * G + g;
    return zero_half ? half_to_float(static_cast<const uint16_t*>(zero)[i]) : static_cast<const uint8_t*>(zero)[i];
  }
};

// Where each lane of each chunk of a row falls: its group (relative to the chunk's first) - the same for every row.
struct Chunks {
  int64_t CB = 0, C = 0, lanes = 0;   // bytes per chunk, chunks per row, int32 lanes per chunk (CB / 4)
  int32_t offset = 0;   // the kernel multiplies u - offset, not u (AVX2, 8-bit codes: signed bytes for vpmaddubsw)
  std::vector<int32_t> gfirst, gcount, idx;   // per chunk: first group, groups touched; per lane: group - gfirst
  Chunks(const Weight& W, int64_t cb) : CB(cb), C((W.row_bytes + cb - 1) / cb), lanes(cb / 4) {
    gfirst.resize(C);
    gcount.resize(C);
    idx.assign(C * lanes, 0);
    const int64_t bytes_per_block = W.bits == 4 ? 16 : 32;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t first_block = c * CB / bytes_per_block;
      const int64_t g0 = first_block * 32 / W.group;
      int64_t glast = g0;
      for (int64_t L = 0; L < lanes; ++L) {
        const int64_t byte = c * CB + 4 * L;
        if (byte >= W.row_bytes) break;
        const int64_t g = byte / bytes_per_block * 32 / W.group;
        idx[c * lanes + L] = static_cast<int32_t>(g - g0);
        glast = g;
      }
      gfirst[c] = static_cast<int32_t>(g0);
      gcount[c] = static_cast<int32_t>(glast - g0 + 1);
    }
  }
};

// The chunk layout of a weight shape, built once per (row bytes, group, bits, chunk bytes, offset) in the process
// (its per-lane divisions cost ~2 us a call on a 320-wide layer, more than the layer's dot products) and kept: a
// model has a few such shapes.
const Chunks& chunks_for(const Weight& W, int64_t cb, int32_t offset) {
  using Key = std::tuple<int64_t, int64_t, int, int64_t, int32_t>;
  static std::mutex mu;
  static std::map<Key, std::unique_ptr<const Chunks>> cache;
  const Key key{W.row_bytes, W.group, W.bits, cb, offset};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    auto made = std::make_unique<Chunks>(W, cb);
    made->offset = offset;
    it = cache.emplace(key, std::move(made)).first;
  }
  return *it->second;
}

// Row of x rounded to int8 per block of 32, in the chunk layout: xq (C * CB * (4-bit ? 2 : 1) bytes, zero past K),
// dl (C * lanes: each lane's block scale d, zero past K), and T[g] = sum_{b in g} d_b * sum(q in b).
struct RowX {
  std::vector<int8_t> xq;
  std::vector<float> dl, T;
  std::vector<int32_t> zq;   // fold_zero: z * (sum of the q each lane multiplies), per lane
};

// One block of 32 values of x rounded to int8: q (32 bytes), returns d = max|x| / 127 and the sum of q in *sum.
// q = round(x * (127 / max|x|)) to nearest, ties to even (the default rounding mode); 0 for an all-zero block.
float quantize_block32_scalar(const float* x, int8_t* q, int32_t* sum) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t s = 0;
  for (int i = 0; i < 32; ++i) {
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[i] * inv)));
    q[i] = static_cast<int8_t>(v);
    s += static_cast<int32_t>(v);
  }
  *sum = s;
  return amax / 127.f;
}

#if WB_X86
// The same with AVX2: vcvtps2dq rounds as nearbyint does (MXCSR's default mode), the products are the same fp32
// products, so q is bit for bit the scalar loop's.
WB_TARGET("avx2,fma") float quantize_block32_avx2(const float* x, int8_t* q, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i r[4], acc = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv))));
    acc = _mm256_add_epi32(acc, r[i]);
  }
  // packs work within 128-bit halves: [r0 0-3, r1 0-3, r2 0-3, r3 0-3 | r0 4-7, ...] -> back to order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i a = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1));
  *sum = _mm_cvtsi128_si32(a);
  return amax / 127.f;
}
#endif

using QuantizeBlock = float (*)(const float*, int8_t*, int32_t*);
QuantizeBlock quantize_block32(bool vector) {
#if WB_X86
  if (vector) return quantize_block32_avx2;
#endif
  (void)vector;
  return quantize_block32_scalar;
}

void quantize_row(const float* x, const Weight& W, const Chunks& ch, RowX& r, QuantizeBlock quantize) {
  const int64_t K = W.K, nb = K / 32;
  const int64_t xbytes = ch.CB * (W.bits == 4 ? 2 : 1);
  const int block_shift = W.bits == 4 ? 4 : 5;   // a block of 32 codes: 16 bytes of 4-bit codes, 32 of 8-bit ones
  r.xq.assign(ch.C * xbytes, 0);
  r.dl.assign(ch.C * ch.lanes, 0.f);
  r.T.assign(W.G, 0.f);
  r.zq.assign(ch.C * ch.lanes, 0);
  thread_local std::vector<int8_t> q;   // (kept between calls: no allocation once warm)
  thread_local std::vector<float> d;
  q.resize(K);
  d.resize(nb);
  const int64_t blocks_per_group = W.group / 32;
  for (int64_t b = 0, g = 0, in_group = 0; b < nb; ++b) {
    int32_t sum = 0;
    d[b] = quantize(x + b * 32, q.data() + b * 32, &sum);
    r.T[g] += d[b] * static_cast<float>(sum);
    if (++in_group == blocks_per_group) {
      in_group = 0;
      ++g;
    }
  }
  const int32_t z = W.fold_zero() ? static_cast<int32_t>(W.zconst) : 0;
  for (int64_t c = 0; c < ch.C; ++c) {
    int8_t* out = r.xq.data() + c * xbytes;
    const int64_t end = std::min(ch.CB, W.row_bytes - c * ch.CB);   // the chunk's bytes within the row
    const int8_t* qc = q.data() + (W.bits == 4 ? 2 : 1) * c * ch.CB;
    if (W.bits == 4) {
      for (int64_t j = 0; j < end; ++j) {
        out[j] = qc[2 * j];
        out[ch.CB + j] = qc[2 * j + 1];
      }
    } else {
      std::memcpy(out, qc, static_cast<size_t>(end));
    }
    for (int64_t L = 0; L < ch.lanes; ++L) {
      const int64_t byte = c * ch.CB + 4 * L;
      if (byte >= W.row_bytes) break;
      r.dl[c * ch.lanes + L] = d[byte >> block_shift];
      // what each lane's int32 sum of (u - offset) q must lose to be the sum of (u - z) q - or of u q when the
      // zero points come in after the row (zero_term)
      if (z != ch.offset) {
        int32_t sum = 0;
        for (int64_t i = byte; i < std::min(byte + 4, W.row_bytes); ++i)
          sum += W.bits == 4 ? q[2 * i] + q[2 * i + 1] : q[i];
        r.zq[c * ch.lanes + L] = (z - ch.offset) * sum;
      }
    }
  }
}

// sum_g s[n, g] z[n, g] T[g]: the zero points' share of output n.
float zero_term(const Weight& W, int64_t n, const float* T) {
  const uint16_t* s = W.scale + n * W.G;
  float acc = 0.f;
  if (!W.zero) {
    for (int64_t g = 0; g < W.G; ++g) acc += half_to_float(s[g]) * T[g];
    return acc * W.zconst;
  }
  for (int64_t g = 0; g < W.G; ++g) acc += half_to_float(s[g]) * W.zero_at(n, g) * T[g];
  return acc;
}

// ---------------------------------------------------------------------------------------------------------
// Scalar (any CPU): the same sums lane by lane - the definition the vector paths must match.
void rows_scalar(const Weight& W, const Chunks& ch, const RowX* xs, int rows, int64_t n, float* out) {
  const uint8_t* qr = W.q + n * W.row_bytes;
  const uint16_t* s = W.scale + n * W.G;
  const int64_t xbytes = ch.CB * (W.bits == 4 ? 2 : 1);
  for (int m = 0; m < rows; ++m) {
    float acc = 0.f;
    for (int64_t c = 0; c < ch.C; ++c) {
      const int8_t* xq = xs[m].xq.data() + c * xbytes;
      for (int64_t L = 0; L < ch.lanes; ++L) {
        int32_t isum = 0;
        for (int i = 0; i < 4; ++i) {
          const int64_t j = 4 * L + i, byte = c * ch.CB + j;
          if (byte >= W.row_bytes) break;
          if (W.bits == 4) {
            isum += (qr[byte] & 0x0F) * xq[j] + (qr[byte] >> 4) * xq[ch.CB + j];
          } else {
            isum += qr[byte] * xq[j];
          }
        }
        isum -= xs[m].zq[c * ch.lanes + L];   // (zero unless fold_zero)
        const float sc = half_to_float(s[ch.gfirst[c] + ch.idx[c * ch.lanes + L]]);
        acc += static_cast<float>(isum) * (sc * xs[m].dl[c * ch.lanes + L]);
      }
    }
    out[m] = acc - (W.fold_zero() ? 0.f : zero_term(W, n, xs[m].T.data()));
  }
}

#if WB_X86
// ---------------------------------------------------------------------------------------------------------
// AVX2: 32-byte chunks; unsigned codes x signed q by vpmaddubsw (pairs into int16) and vpmaddwd (into int32). 4-bit
// codes: |pair| <= 2 * 15 * 127, no saturation; 8-bit codes would saturate (2 * 255 * 127) and are shifted to signed
// bytes first.
WB_TARGET("avx2,fma,f16c") inline __m256 scales8(const Weight& W, const Chunks& ch, int64_t n, int64_t c) {
  const uint16_t* s = W.scale + n * W.G + ch.gfirst[c];   // a 32-byte chunk touches one or two groups
  const uint32_t two = s[0] | (ch.gcount[c] > 1 ? static_cast<uint32_t>(s[1]) << 16 : 0u);
  const __m256 v = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(two))));
  return _mm256_permutevar8x32_ps(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&ch.idx[c * 8])));
}

WB_TARGET("avx2,fma,f16c") inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The zero points' share (zero_term) eight groups at a time, fp16 scales widened by F16C.
WB_TARGET("avx2,fma,f16c") float zero_term_avx2(const Weight& W, int64_t n, const float* T) {
  const uint16_t* s = W.scale + n * W.G;
  const int64_t G = W.G;
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g)));
    if (W.zero) {
      const __m256 zv = W.zero_half
          ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                static_cast<const uint16_t*>(W.zero) + n * G + g)))
          : _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                static_cast<const uint8_t*>(W.zero) + n * G + g))));
      sv = _mm256_mul_ps(sv, zv);
    }
    acc = _mm256_fmadd_ps(sv, _mm256_loadu_ps(T + g), acc);
  }
  float r = hsum256(acc);
  for (; g < G; ++g) r += _cvtsh_ss(s[g]) * (W.zero ? W.zero_at(n, g) : 1.f) * T[g];
  return W.zero ? r : r * W.zconst;
}

template <int ROWS>
WB_TARGET("avx2,fma,f16c") void rows_avx2(const Weight& W, const Chunks& ch, const RowX* xs, int64_t n,
                                         float* out) {
  const uint8_t* qr = W.q + n * W.row_bytes;
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t full = W.row_bytes / 32;
  for (int64_t c = 0; c < ch.C; ++c) {
    __m256i w;
    if (c < full) {
      _mm_prefetch(reinterpret_cast<const char*>(qr + c * 32 + kPrefetchBytes), _MM_HINT_T0);
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + c * 32));
    } else {   // the row's last, partial chunk: the bytes it has, zeros after
      alignas(32) uint8_t tail[32] = {0};
      std::memcpy(tail, qr + c * 32, static_cast<size_t>(W.row_bytes - c * 32));
      w = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
    }
    const __m256 sw = scales8(W, ch, n, c);
    if (W.bits == 4) {
      const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
      for (int m = 0; m < ROWS; ++m) {
        const int8_t* xq = xs[m].xq.data() + c * 64;
        const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
        const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32)));
        const __m256i ai = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones),
                                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xs[m].zq[c * 8])));
        const __m256 sc = _mm256_mul_ps(sw, _mm256_loadu_ps(xs[m].dl.data() + c * 8));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai), sc, acc[m]);
      }
    } else {
      // 8-bit codes as signed bytes u - 128 (Chunks::offset): vpmaddubsw takes |u - 128| <= 128 (unsigned) times
      // q with u - 128's sign (|pair| <= 2 * 128 * 127: no saturation), vpmaddwd adds the pairs into int32 lanes
      const __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256i wa = _mm256_abs_epi8(ws);
      for (int m = 0; m < ROWS; ++m) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[m].xq.data() + c * 32));
        const __m256i h = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(xq, ws)), ones),
                                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xs[m].zq[c * 8])));
        const __m256 sc = _mm256_mul_ps(sw, _mm256_loadu_ps(xs[m].dl.data() + c * 8));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), sc, acc[m]);
      }
    }
  }
  for (int m = 0; m < ROWS; ++m)
    out[m] = hsum256(acc[m]) - (W.fold_zero() ? 0.f : zero_term_avx2(W, n, xs[m].T.data()));
}

// ---------------------------------------------------------------------------------------------------------
// AVX-512 VNNI: 64-byte chunks, vpdpbusd (four unsigned-code x signed-q products per int32 lane). The chunk's
// group scales: up to four fp16 values loaded under a mask, widened and spread over the lanes by one permute.
WB_TARGET("avx512f,avx512bw,avx512vl,avx512vnni,f16c") inline __m512 scales16(const Weight& W, const Chunks& ch,
                                                                              int64_t n, int64_t c) {
  const uint16_t* s = W.scale + n * W.G + ch.gfirst[c];
  const __m128i h = _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << ch.gcount[c]) - 1), s);
  return _mm512_permutexvar_ps(_mm512_loadu_si512(&ch.idx[c * 16]), _mm512_castps256_ps512(_mm256_cvtph_ps(h)));
}

template <int ROWS, int BITS>
WB_TARGET("avx512f,avx512bw,avx512vl,avx512vnni,f16c") void rows_avx512(const Weight& W, const Chunks& ch,
                                                                        const RowX* xs, int64_t n, float* out) {
  const uint8_t* qr = W.q + n * W.row_bytes;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t full = W.row_bytes / 64;
  for (int64_t c = 0; c < ch.C; ++c) {
    __m512i w;
    if (c < full) {
      _mm_prefetch(reinterpret_cast<const char*>(qr + c * 64 + kPrefetchBytes), _MM_HINT_T0);
      w = _mm512_loadu_si512(qr + c * 64);
    } else {
      const int64_t left = W.row_bytes - c * 64;   // 16, 32 or 48 bytes
      w = _mm512_maskz_loadu_epi8(static_cast<__mmask64>((uint64_t{1} << left) - 1), qr + c * 64);
    }
    const __m512 sw = scales16(W, ch, n, c);
    if (BITS == 4) {
      const __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
      for (int m = 0; m < ROWS; ++m) {
        const int8_t* xq = xs[m].xq.data() + c * 128;
        __m512i ai = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq));
        ai = _mm512_dpbusd_epi32(ai, hi, _mm512_loadu_si512(xq + 64));
        ai = _mm512_sub_epi32(ai, _mm512_loadu_si512(&xs[m].zq[c * 16]));
        const __m512 sc = _mm512_mul_ps(sw, _mm512_loadu_ps(xs[m].dl.data() + c * 16));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai), sc, acc[m]);
      }
    } else {
      for (int m = 0; m < ROWS; ++m) {
        const int8_t* xq = xs[m].xq.data() + c * 64;
        const __m512i ai = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xq)),
                                            _mm512_loadu_si512(&xs[m].zq[c * 16]));
        const __m512 sc = _mm512_mul_ps(sw, _mm512_loadu_ps(xs[m].dl.data() + c * 16));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai), sc, acc[m]);
      }
    }
  }
  for (int m = 0; m < ROWS; ++m)
    out[m] = _mm512_reduce_add_ps(acc[m]) - (W.fold_zero() ? 0.f : zero_term_avx2(W, n, xs[m].T.data()));
}
// One row of x against NR weight rows at once (decode): the activations, their block scales and the lane map are
// loaded once for NR rows, and NR independent streams of codes are in flight.
template <int NR, int BITS>
WB_TARGET("avx512f,avx512bw,avx512vl,avx512vnni,f16c") void wrows_avx512(const Weight& W, const Chunks& ch,
                                                                         const RowX& x, int64_t n, float* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t full = W.row_bytes / 64;
  for (int64_t c = 0; c < ch.C; ++c) {
    const __m512 dl = _mm512_loadu_ps(x.dl.data() + c * 16);
    const __m512i idx = _mm512_loadu_si512(&ch.idx[c * 16]);
    const __mmask8 gm = static_cast<__mmask8>((1u << ch.gcount[c]) - 1);
    const int8_t* xq = x.xq.data() + c * (BITS == 4 ? 128 : 64);
    const __m512i x0 = _mm512_loadu_si512(xq);
    const __m512i x1 = BITS == 4 ? _mm512_loadu_si512(xq + 64) : x0;
    const __m512i zq = _mm512_loadu_si512(&x.zq[c * 16]);
    const __mmask64 wm = c < full ? ~__mmask64{0} : static_cast<__mmask64>((uint64_t{1} << (W.row_bytes - c * 64)) - 1);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* qr = W.q + (n + r) * W.row_bytes + c * 64;
      _mm_prefetch(reinterpret_cast<const char*>(qr + kPrefetchBytes), _MM_HINT_T0);
      const __m512i w = _mm512_maskz_loadu_epi8(wm, qr);
      const __m128i h = _mm_maskz_loadu_epi16(gm, W.scale + (n + r) * W.G + ch.gfirst[c]);
      const __m512 sw = _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(_mm256_cvtph_ps(h)));
      __m512i ai;
      if (BITS == 4) {
        ai = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(w, m4), x0);
        ai = _mm512_dpbusd_epi32(ai, _mm512_and_si512(_mm512_srli_epi16(w, 4), m4), x1);
      } else {
        ai = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x0);
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ai, zq)), _mm512_mul_ps(sw, dl), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r)
    out[r] = _mm512_reduce_add_ps(acc[r]) - (W.fold_zero() ? 0.f : zero_term_avx2(W, n + r, x.T.data()));
}
#endif  // WB_X86

Isa best_isa() {
  static const Isa best = [] {
    Isa found = Isa::Scalar;
#if WB_X86
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
      found = Isa::Avx512;
    else if (avx2)
      found = Isa::Avx2;
#endif
    return std::min(found, isa_cap());
  }();
  return best;
}

Isa parse_isa(const std::string& name) {
  if (name.empty() || name == "auto") return best_isa();
  TORCH_CHECK(name == "avx512" || name == "avx2" || name == "scalar",
              "act_int8_linear_cpu: isa must be 'auto', 'avx512', 'avx2' or 'scalar', got '", name, "'");
  const Isa want = name == "avx512" ? Isa::Avx512 : name == "avx2" ? Isa::Avx2 : Isa::Scalar;
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best_isa()), "act_int8_linear_cpu: isa='", name,
              "' is not supported by this CPU (AVX-512 here means F / BW / VL / VNNI)");
  return want;
}

std::string cpu_isa() {
  const Isa i = best_isa();
  return i == Isa::Avx512 ? "avx512" : i == Isa::Avx2 ? "avx2" : "scalar";
}

using RowsFn = void (*)(const Weight&, const Chunks&, const RowX*, int64_t, float*);

RowsFn rows_fn(Isa isa, int rows, int bits) {
#if WB_X86
  if (isa == Isa::Avx512) {
    static constexpr RowsFn f4[kMaxRowsX] = {rows_avx512<1, 4>, rows_avx512<2, 4>, rows_avx512<3, 4>,
                                             rows_avx512<4, 4>};
    static constexpr RowsFn f8[kMaxRowsX] = {rows_avx512<1, 8>, rows_avx512<2, 8>, rows_avx512<3, 8>,
                                             rows_avx512<4, 8>};
    return (bits == 4 ? f4 : f8)[rows - 1];
  }
  if (isa == Isa::Avx2) {
    static constexpr RowsFn f[kMaxRowsX] = {rows_avx2<1>, rows_avx2<2>, rows_avx2<3>, rows_avx2<4>};
    return f[rows - 1];
  }
#endif
  (void)bits;
  return nullptr;
}

// One call's weight from its tensors, checked: codes, fp16 scales, zero points (or nullptr: zconst for all).
Weight weight_of(const torch::Tensor& q, const torch::Tensor& scale, const c10::optional<torch::Tensor>& zero,
                 double zconst, int64_t bits, int64_t group, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 8, "act_int8_linear_cpu: codes of 4 or 8 bits, got ", bits);
  TORCH_CHECK(K % 32 == 0 && group % 32 == 0 && group > 0,
              "act_int8_linear_cpu: K and the group size must be multiples of 32, got K = ", K, ", group ", group);
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.dim() == 2 && q.is_contiguous() && q.size(1) == K * bits / 8,
              "act_int8_linear_cpu: codes must be a contiguous uint8 (N, ", K * bits / 8, ") tensor");
  const int64_t N = q.size(0), G = (K + group - 1) / group;
  TORCH_CHECK(scale.dtype() == torch::kHalf && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == N &&
                  scale.size(1) == G,
              "act_int8_linear_cpu: scales must be a contiguous fp16 (", N, ", ", G, ") tensor");
  Weight W{q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()), nullptr, false,
           static_cast<float>(zconst), N, K, G, group, K * bits / 8, static_cast<int>(bits)};
  if (zero.has_value()) {
    const auto& z = *zero;
    TORCH_CHECK((z.dtype() == torch::kUInt8 || z.dtype() == torch::kHalf) && z.is_contiguous() && z.dim() == 2 &&
                    z.size(0) == N && z.size(1) == G,
                "act_int8_linear_cpu: zero points must be a contiguous uint8 or fp16 (", N, ", ", G, ") tensor");
    W.zero = z.data_ptr();
    W.zero_half = z.dtype() == torch::kHalf;
  }
  return W;
}

// A bias as fp32 values (kept alive in *keep), or nullptr.
const float* bias_of(const c10::optional<torch::Tensor>& bias, int64_t N, torch::Tensor* keep) {
  if (!bias.has_value()) return nullptr;
  *keep = bias->to(torch::kFloat).contiguous();
  TORCH_CHECK(keep->numel() == N, "act_int8_linear_cpu: bias must have ", N, " values");
  return keep->data_ptr<float>();
}

const Chunks& chunks_of(const Weight& W, Isa isa) {
  return chunks_for(W, isa == Isa::Avx2 ? 32 : 64, isa == Isa::Avx2 && W.bits == 8 ? 128 : 0);
}

// The M rows of x rounded in the chunk layout: up to kKeptRows rows in buffers of this thread kept between calls
// (no allocation a decode step once warm), more in `many` (the caller's, freed after the call).
constexpr int64_t kKeptRows = 64;
const RowX* quantize_rows(const torch::Tensor& x, const Weight& W, const Chunks& ch, Isa isa,
                          std::vector<RowX>& many) {
  thread_local std::vector<RowX> kept;
  const int64_t M = x.size(0);
  std::vector<RowX>& xs = M <= kKeptRows ? kept : many;
  if (static_cast<int64_t>(xs.size()) < M) xs.resize(M);
  const QuantizeBlock quantize = quantize_block32(isa >= Isa::Avx2);
  for (int64_t m = 0; m < M; ++m) quantize_row(x.data_ptr<float>() + m * W.K, W, ch, xs[m], quantize);
  return xs.data();
}

// y[m, n] for output rows n in [n0, n1) of one weight: y (M, N) row-major, b (N) or nullptr.
void rows_range(const Weight& W, const Chunks& ch, const RowX* xs, int64_t M, Isa isa, int64_t n0, int64_t n1,
                const float* b, float* yp) {
  const int64_t N = W.N;
  float out[kMaxRowsX];
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsX) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRowsX, M - m0));
    const RowsFn f = rows_fn(isa, rows, W.bits);
    int64_t n = n0;
#if WB_X86
    if (rows == 1 && isa == Isa::Avx512) {   // decode: weight rows in fours, then the rest one by one
      constexpr int NR = 4;
      for (; n + NR <= n1; n += NR) {
        float o[NR];
        (W.bits == 4 ? wrows_avx512<NR, 4> : wrows_avx512<NR, 8>)(W, ch, xs[m0], n, o);
        for (int r = 0; r < NR; ++r) yp[m0 * N + n + r] = o[r] + (b ? b[n + r] : 0.f);
      }
    }
#endif
    for (; n < n1; ++n) {
      if (f) {
        f(W, ch, xs + m0, n, out);
      } else {
        rows_scalar(W, ch, xs + m0, rows, n, out);
      }
      for (int i = 0; i < rows; ++i) yp[(m0 + i) * N + n] = out[i] + (b ? b[n] : 0.f);
    }
  }
}

// ~64 k codes of work per share: below that a second thread's wake-up costs more than it saves
int64_t grain_for(int64_t K, int64_t M) { return std::max<int64_t>(4, (int64_t{1} << 16) / std::max<int64_t>(K * M, 1)); }

// y (M, N) = round_int8(x) (M, K) @ W^T + bias, in x's dtype (computed in fp32).
torch::Tensor linear(const torch::Tensor& x_in, const torch::Tensor& q, const torch::Tensor& scale,
                     const c10::optional<torch::Tensor>& zero, double zconst, int64_t bits, int64_t group, int64_t K,
                     const c10::optional<torch::Tensor>& bias, const std::string& isa_name) {
  const Weight W = weight_of(q, scale, zero, zconst, bits, group, K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K && x_in.device().is_cpu(),
              "act_int8_linear_cpu: x must be a 2-D CPU tensor (M, ", K, ")");
  const torch::Tensor x = x_in.to(torch::kFloat).contiguous();
  const int64_t M = x.size(0), N = W.N;
  torch::Tensor bf;
  const float* b = bias_of(bias, N, &bf);
  const Isa isa = parse_isa(isa_name);
  const Chunks& ch = chunks_of(W, isa);
  std::vector<RowX> many;
  const RowX* xs = quantize_rows(x, W, ch, isa, many);
  torch::Tensor y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain_for(K, M), [&](int64_t n0, int64_t n1) { rows_range(W, ch, xs, M, isa, n0, n1, b, yp); });
  return x_in.scalar_type() == torch::kFloat ? y : y.to(x_in.scalar_type());
}

// x rounded to int8 per block of 32 and back (d * q): what the kernel multiplies, for tests and the reference.
torch::Tensor round_activations(const torch::Tensor& x_in) {
  const torch::Tensor x = x_in.to(torch::kFloat).contiguous();
  TORCH_CHECK(x.numel() % 32 == 0 && x.size(-1) % 32 == 0, "round_activations: rows of whole blocks of 32");
  torch::Tensor out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const QuantizeBlock quantize = quantize_block32(best_isa() >= Isa::Avx2);
  int8_t q[32];
  for (int64_t b = 0; b < x.numel() / 32; ++b) {
    int32_t sum = 0;
    const float d = quantize(xp + b * 32, q, &sum);
    for (int i = 0; i < 32; ++i) op[b * 32 + i] = static_cast<float>(q[i]) * d;
  }
  return out;
}

// The op workbench::act_int8_linear_cpu (schema in kernels/ops.py): x (..., K) -> (..., N), registered here so
// that a compiled graph reaches the kernel through the dispatcher alone (no Python implementation in between).
torch::Tensor linear_op(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& zero, double zconst, int64_t bits, int64_t group,
                        int64_t K, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "act_int8_linear_cpu: x must have shape (..., K = ", K, ")");
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = q.size(0);
  return linear(x.reshape({-1, K}), q, scale, zero, zconst, bits, group, K, bias, "auto").view(shape);
}


}  // namespace

TORCH_LIBRARY_IMPL(workbench, CPU, m) { m.impl("act_int8_linear_cpu", &linear_op); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = round_int8(x) @ W^T + bias (4- or 8-bit codes, fp16 scales)");
  m.def("round_activations", &round_activations, "x rounded to int8 per block of 32 and back");
  m.def("cpu_isa", &cpu_isa, "the vector ISA used here: avx512 (VNNI), avx2 or scalar");
}
