// W8A8 Linear on the CPU: per-token int8 activations x int8 per-channel weights, int32 accumulation.
// The math, the blocking and the build are described in kernels/w8a8_cpu.py; this file is the fast path.
//
// For each block of `rows` rows of x (the block is sized so that its int32 product stays in L2):
//   1. quantize: s[r] = max(max_k |x[r, k]| / 127.5, eps) (or the static scale), q = clamp(rne(x * (1 / s)))
//      into a per-thread int8 scratch buffer (one read of x; the row is in L1 for the second sweep);
//   2. multiply: at::_int_mm_out(acc, q, w) into a per-thread int32 scratch buffer (oneDNN's s8s8s32 GEMM);
//   3. rescale: out[r, n] = float(acc[r, n]) * s[r] * ws[n] + bias[n], written once into the output.
// Every float operation is the reference's, in the reference's order (built with -ffp-contract=off so no
// multiply-add is contracted), and rounding is round-half-to-even: the output equals the PyTorch reference
// bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
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

constexpr float kEps = 1.1920928955078125e-07f;  // torch.finfo(torch.float32).eps
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();


// ---------------------------------------------------------------------------------------------------------
// Scalar path (any CPU): the definition the vector paths must match.
float absmax_scalar(const float* x, int64_t K) {
  float m = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float a = std::fabs(x[k]);
    if (std::isnan(a)) return kNaN;  // a NaN makes the row's scale NaN, as torch.amax does
    m = a > m ? a : m;
  }
  return m;
}

void quantize_row_scalar(const float* x, int64_t K, float inv, int8_t* q) {
  for (int64_t k = 0; k < K; ++k) {
    float v = std::nearbyint(x[k] * inv);  // the default rounding mode: half to even
    v = v >= -128.f ? v : -128.f;          // NaN -> -128, as the vector paths' max_ps (the row's scale is NaN then)
    v = v <= 127.f ? v : 127.f;
    q[k] = static_cast<int8_t>(static_cast<int32_t>(v));
  }
}

void rescale_row_scalar(const int32_t* acc, int64_t N, float s, const float* ws, const float* bias, float* out,
                        bool /*stream*/) {
  for (int64_t n = 0; n < N; ++n) {
    const float v = static_cast<float>(acc[n]) * s * ws[n];
    out[n] = bias ? v + bias[n] : v;
  }
}

#if WB_X86
// ---------------------------------------------------------------------------------------------------------
// AVX2 (x86-64 since 2013): 8 lanes.
WB_TARGET("avx2") float absmax_avx2(const float* x, int64_t K) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, a);
  }
  if (_mm256_movemask_ps(nan)) return kNaN;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float r = 0.f;
  for (float v : lanes) r = v > r ? v : r;
  const float tail = absmax_scalar(x + k, K - k);
  return std::isnan(tail) ? kNaN : std::max(r, tail);
}

WB_TARGET("avx2") void quantize_row_avx2(const float* x, int64_t K, float inv, int8_t* q) {
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(i16, i16));
  }
  quantize_row_scalar(x + k, K - k, inv, q + k);
}

WB_TARGET("avx2") void rescale_row_avx2(const int32_t* acc, int64_t N, float s, const float* ws, const float* bias,
                                        float* out, bool stream) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    __m256 v = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + n)));
    v = _mm256_mul_ps(_mm256_mul_ps(v, vs), _mm256_loadu_ps(ws + n));
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n));
    if (stream && (reinterpret_cast<uintptr_t>(out + n) & 31) == 0) {
      _mm256_stream_ps(out + n, v);
    } else {
      _mm256_storeu_ps(out + n, v);
    }
  }
  rescale_row_scalar(acc + n, N - n, s, ws + n, bias ? bias + n : nullptr, out + n, false);
}

// ---------------------------------------------------------------------------------------------------------
// AVX-512 (Skylake-SP and later, Zen 4 and later): 16 lanes, saturating int32 -> int8 down-conversion.
WB_TARGET("avx512f") float absmax_avx512(const float* x, int64_t K) {
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + k));
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, a);
  }
  if (nan) return kNaN;
  const float r = _mm512_reduce_max_ps(m);
  const float tail = absmax_scalar(x + k, K - k);
  return std::isnan(tail) ? kNaN : std::max(r, tail);
}

WB_TARGET("avx512f") void quantize_row_avx512(const float* x, int64_t K, float inv, int8_t* q) {
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + k), vinv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i i32 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(i32));
  }
  quantize_row_scalar(x + k, K - k, inv, q + k);
}

WB_TARGET("avx512f") void rescale_row_avx512(const int32_t* acc, int64_t N, float s, const float* ws,
                                             const float* bias, float* out, bool stream) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) {
    __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + n));
    v = _mm512_mul_ps(_mm512_mul_ps(v, vs), _mm512_loadu_ps(ws + n));
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
    if (stream && (reinterpret_cast<uintptr_t>(out + n) & 63) == 0) {
      _mm512_stream_ps(out + n, v);
    } else {
      _mm512_storeu_ps(out + n, v);
    }
  }
  rescale_row_scalar(acc + n, N - n, s, ws + n, bias ? bias + n : nullptr, out + n, false);
}
#endif  // WB_X86

Isa detect_isa() {
  Isa found = Isa::Scalar;
#if WB_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) found = Isa::Avx512;
  else if (__builtin_cpu_supports("avx2")) found = Isa::Avx2;
#endif
  return std::min(found, isa_cap());
}

Isa best_isa() {
  static const Isa best = detect_isa();  // once per process, not per call
  return best;
}

Isa parse_isa(const std::string& name) {
  const Isa best = best_isa();
  if (name.empty() || name == "auto") return best;
  const Isa want = name == "avx512" ? Isa::Avx512 : name == "avx2" ? Isa::Avx2 : Isa::Scalar;
  TORCH_CHECK(name == "avx512" || name == "avx2" || name == "scalar",
              "w8a8_linear_cpu: isa must be 'auto', 'avx512', 'avx2' or 'scalar', got '", name, "'");
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best),
              "w8a8_linear_cpu: isa='", name, "' is not supported by this CPU");
  return want;
}

struct Kernels {
  float (*absmax)(const float*, int64_t);
  void (*quantize_row)(const float*, int64_t, float, int8_t*);
  void (*rescale_row)(const int32_t*, int64_t, float, const float*, const float*, float*, bool);
};

Kernels kernels_for(Isa isa) {
#if WB_X86
  if (isa == Isa::Avx512) return {absmax_avx512, quantize_row_avx512, rescale_row_avx512};
  if (isa == Isa::Avx2) return {absmax_avx2, quantize_row_avx2, rescale_row_avx2};
#endif
  return {absmax_scalar, quantize_row_scalar, rescale_row_scalar};
}

}  // namespace

std::string cpu_isa() {
  switch (best_isa()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "scalar";
  }
}

// Whether oneDNN's s8 x s8 -> s32 GEMM behind _int_mm gives exact sums in this process. With an int8 dot product
// (AVX-512 VNNI, AVX-VNNI, AMX) it does; without one (AVX2, AVX-512 without VNNI - or ONEDNN_MAX_CPU_ISA set below
// VNNI) it multiplies u8 x s8 pairs with vpmaddubsw, whose 16-bit pair sums saturate: measured, a 64 x 256 x 96
// product off by up to 8e4. Asked once by a product that saturates there (every code 127: 2 x 255 x 127 > 2^15).
bool int_mm_exact() {
  static const bool exact = [] {
    const auto a = torch::full({16, 64}, 127, torch::dtype(torch::kChar));
    const auto b = torch::full({64, 16}, 127, torch::dtype(torch::kChar));
    return at::_int_mm(a, b).eq(64 * 127 * 127).all().item<bool>();
  }();
  return exact;
}

// acc = q w, exactly: oneDNN's int8 GEMM where it is exact, else an fp64 GEMM (every int8 x int8 sum of fewer than
// 2^38 terms is an integer below 2^53, so exact too; slower, and kernel="auto" does not choose this kernel there).
void int_mm_into(torch::Tensor& acc, const torch::Tensor& q, const torch::Tensor& w) {
  if (int_mm_exact()) {
    at::_int_mm_out(acc, q, w);
  } else {
    acc.copy_(at::mm(q.to(torch::kDouble), w.to(torch::kDouble)));
  }
}

// x (M, K) fp32 contiguous; wt (K, N) int8 (any strides _int_mm accepts); ws (N,) fp32; bias (N,) fp32 or
// undefined; act_scale: one fp32 value (static activations) or undefined (per token). block_rows = 0 picks
// the block from N. Returns (M, N) fp32.
torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& wt, const torch::Tensor& ws,
                          const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& act_scale,
                          int64_t block_rows, const std::string& isa_name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "w8a8_linear_cpu: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(wt.dim() == 2 && wt.scalar_type() == torch::kChar && wt.size(0) == x.size(1),
              "w8a8_linear_cpu: qweight_t must be int8 (K, N) with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), N = wt.size(1);
  TORCH_CHECK(ws.scalar_type() == torch::kFloat && ws.is_contiguous() && ws.numel() == N,
              "w8a8_linear_cpu: scale must be a contiguous float32 tensor of N values");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N),
              "w8a8_linear_cpu: bias must be a contiguous float32 tensor of N values");
  const bool is_static = act_scale.has_value() && act_scale->defined();
  TORCH_CHECK(!is_static || (act_scale->scalar_type() == torch::kFloat && act_scale->numel() == 1),
              "w8a8_linear_cpu: act_scale must be one float32 value");
  const Kernels kern = kernels_for(parse_isa(isa_name));
  // _int_mm wants a weight with one unit stride (row-major or its transpose); anything else (a zero-stride
  // expand gives wrong sums on torch 2.13's CPU build) is copied first.
  const torch::Tensor w = wt.is_contiguous() || wt.t().is_contiguous() ? wt : wt.contiguous();

  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wsp = ws.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  const float static_scale = is_static ? act_scale->item<float>() : 0.f;
  float* op = out.data_ptr<float>();

  // Rows per block: 64..512, the int32 block (rows x N x 4 bytes) at most 3 MB. Measured on MiniLM's shapes
  // (one thread, 4096 rows): oneDNN's GEMM alone is 5-8 % slower in 128-row blocks and ~4 % in 256-row ones
  // than on the whole matrix; the whole kernel with 512 rows of N = 1536 (3 MB, L2 is 2 MB here) beat 256
  // (L2-resident) by ~2 %.
  int64_t block = block_rows > 0 ? block_rows
                                 : std::clamp<int64_t>((int64_t{3} << 20) / (4 * N) / 32 * 32, 64, 512);
  // An output larger than a core's L2 is written with non-temporal stores: no read-for-ownership of lines
  // that are about to be overwritten, and the writes drain while the next block's GEMM computes (measured on
  // MiniLM's 4096 x 1536 FFN output: -8 %, including the GELU that reads it next). Small outputs (decode)
  // stay in cache for the next layer.
  const bool stream = M * N * 4 >= (int64_t{2} << 20);
  const int threads = at::get_num_threads();
  // With several threads, each takes whole row blocks (the GEMM inside runs single-threaded); too few rows
  // for that (decode) and one thread runs the blocks, its GEMM using every thread.
  const bool split = threads > 1 && M >= 2 * 16 * threads;
  if (split) block = std::min(block, (M + threads - 1) / threads);
  const int64_t nblocks = (M + block - 1) / block;

  auto run = [&](int64_t b0, int64_t b1) {
    const int64_t cap = std::min(block, M);
    thread_local std::vector<int8_t> q_scratch;
    thread_local std::vector<int32_t> acc_scratch;
    thread_local std::vector<float> s_scratch;
    if (static_cast<int64_t>(q_scratch.size()) < cap * K) q_scratch.resize(cap * K);
    if (static_cast<int64_t>(acc_scratch.size()) < cap * N) acc_scratch.resize(cap * N);
    if (static_cast<int64_t>(s_scratch.size()) < cap) s_scratch.resize(cap);
    int8_t* q = q_scratch.data();
    int32_t* acc = acc_scratch.data();
    float* s = s_scratch.data();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * block, rows = std::min(block, M - r0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xp + (r0 + r) * K;
        // A row holding NaN or Inf gets a NaN scale, so its whole output row is NaN (as in the reference); a
        // static scale needs the row's max |x| only for that check.
        const float m = kern.absmax(xr, K);
        s[r] = !std::isfinite(m) ? kNaN : is_static ? static_scale : std::max(m / 127.5f, kEps);
        kern.quantize_row(xr, K, 1.0f / s[r], q + r * K);
      }
      auto qt = torch::from_blob(q, {rows, K}, x.options().dtype(torch::kChar));
      auto acct = torch::from_blob(acc, {rows, N}, x.options().dtype(torch::kInt));
      int_mm_into(acct, qt, w);
      for (int64_t r = 0; r < rows; ++r) kern.rescale_row(acc + r * N, N, s[r], wsp, bp, op + (r0 + r) * N, stream);
    }
#if WB_X86
    if (stream) _mm_sfence();  // order the non-temporal stores before anything that reads the output
#endif
  };
  if (split) {
    at::parallel_for(0, nblocks, 1, run);
  } else {
    run(0, nblocks);
  }
  return out;
}

// The whole call of a W8A8Linear: x of any shape (..., K) and float dtype, the result in x's dtype and shape; the
// scale, bias and static activation scale taken as fp32 whatever their dtype and shape. One C++ call instead of
// the Python that did the same reshapes and casts: on the layers of a small MLP (64 rows, 64-256 wide) that
// Python was about half the layer's time (docs/kernels.md). No autograd graph is recorded.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& wt, const torch::Tensor& ws,
                     const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& act_scale,
                     int64_t block_rows, const std::string& isa_name) {
  torch::NoGradGuard no_grad;
  const int64_t K = wt.size(0), N = wt.size(1);
  auto f32 = [](const torch::Tensor& t) {
    return t.scalar_type() == torch::kFloat && t.is_contiguous() ? t : t.to(torch::kFloat).contiguous();
  };
  auto x2 = x.reshape({-1, K});
  if (x2.scalar_type() != torch::kFloat || !x2.is_contiguous()) x2 = x2.to(torch::kFloat).contiguous();
  c10::optional<torch::Tensor> b, a;
  if (bias.has_value() && bias->defined()) b = f32(*bias);
  if (act_scale.has_value() && act_scale->defined()) a = f32(*act_scale).reshape({1});
  auto y = w8a8_linear(x2, wt, f32(ws).reshape({-1}), b, a, block_rows, isa_name);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  y = y.view(shape);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w8a8_linear", &w8a8_linear, "W8A8 Linear on the CPU (see kernels/w8a8_cpu.py)");
  m.def("linear", &linear, "a W8A8 Linear: x (..., K) of any float dtype, fp32 math, the result in x's dtype");
  m.def("int_mm_exact", &int_mm_exact, "whether oneDNN's int8 GEMM (torch._int_mm) sums exactly in this process");
  m.def("cpu_isa", &cpu_isa, "the widest vector ISA this CPU supports among avx512 / avx2 / scalar");
}
