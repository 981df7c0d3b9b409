// LSTM recurrence on the CPU (see csrc/cpu/lstm.h for the math and the contract).
//
// Forward, per step: one GEMM writes z_t = xw_t + h_{t-1} @ W^T straight into gates[t]
// (the weight packed once per call with the DropConnect mask applied while packing, then an
// AVX2 micro-kernel; see StepGemm); one fused loop (at::parallel_for) turns z into the
// activations in place and computes c_t, tanh(c_t), o * tanh(c_t) (and h_t without
// projection); with a projection one more GEMM and the clip.
// Backward, per step (last step first): the fused cell-backward loop writes dz_t into
// grad_xw[t] and carries dc; one GEMM gives dh_{t-1} = dz_t @ W. The weight gradients are
// one GEMM over all steps at the end (dZ^T @ H_prev), not T small ones.
#include "cpu/lstm.h"
#include "cpu/cpu_gemm.h"
#include "cpu/tile_avx2.h"
#include "cpu/tile_avx512.h"

#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <optional>
#include <type_traits>

namespace ctxfast {
namespace cpu {
namespace {

using at::Tensor;

// Elements of the [B, H] cell grid per task: a few microseconds of work each.
constexpr int64_t kGrain = 2048;

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define CTXFAST_LSTM_AVX2 1
#endif

// AVX2 + FMA kernels (the recurrent GEMM, the float32 cell loops) are compiled for that
// target only (function attributes) and used where the CPU has both, checked at run time;
// scalar/ATen code otherwise. CTXFAST_LSTM_CPU_GEMM=aten turns them off, =avx2 keeps the
// recurrent GEMM on the AVX2 kernel where the CPU has AVX-512 (comparisons, tests).
bool cpu_has_avx2() {
#ifdef CTXFAST_LSTM_AVX2
  static const bool ok = [] {
    if (env_setting("CTXFAST_LSTM_CPU_GEMM") == "aten") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
#else
  return false;
#endif
}

// The recurrent GEMM on the AVX-512 kernel (tile_avx512.h) where the CPU has AVX-512
// (and CTXFAST_LSTM_CPU_GEMM is not avx2 or aten).
bool cpu_has_avx512() {
#ifdef CTXFAST_LSTM_AVX2
  static const bool ok = [] {
    const std::string v = env_setting("CTXFAST_LSTM_CPU_GEMM");
    if (v == "aten" || v == "avx2") return false;
    __builtin_cpu_init();
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f");
  }();
  return ok;
#else
  return false;
#endif
}

// Float transcendentals without libm calls. exp_approx is a Cephes-style range reduction
// (x = n ln2 + r) with a degree-6 polynomial: relative error ~2 ulp over the clamped range.
// Double keeps std::exp/std::tanh (float64 is the accuracy reference, not the fast path).
constexpr float kExpHi = 88.0f, kExpLo = -87.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

inline float exp_approx(float x) {
  x = std::min(std::max(x, kExpLo), kExpHi);
  const float n = std::nearbyint(x * kLog2e);
  float r = x - n * kLn2Hi;  // ln2 split in two for an exact reduction
  r = r - n * kLn2Lo;
  float p = kP0;
  p = p * r + kP1;
  p = p * r + kP2;
  p = p * r + kP3;
  p = p * r + kP4;
  p = p * r + kP5;
  p = p * r * r + r + 1.0f;
  // 2^n by building the exponent bits (n in [-126, 127] after the clamp).
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float sigmoid_of(float x) { return 1.0f / (1.0f + exp_approx(-x)); }
inline double sigmoid_of(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// tanh: for |x| >= 0.625, sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.29 (no
// overflow, no cancellation); below, Cephes' odd polynomial, which keeps the relative
// accuracy near 0 (the exp form loses ~eps/|x| there: small cells and gates).
constexpr float kT0 = -5.70498872745e-3f, kT1 = 2.06390887954e-2f, kT2 = -5.37397155531e-2f,
                kT3 = 1.33314422036e-1f, kT4 = -3.33332819422e-1f, kTanhSmall = 0.625f;

inline float tanh_of(float x) {
  const float ax = std::fabs(x);
  if (ax < kTanhSmall) {
    const float z = x * x;
    return ((((kT0 * z + kT1) * z + kT2) * z + kT3) * z + kT4) * z * x + x;
  }
  const float e = exp_approx(-2.0f * ax);
  return std::copysign((1.0f - e) / (1.0f + e), x);
}
inline double tanh_of(double x) { return std::tanh(x); }

// clamp(x, -c, c); NaN stays NaN.
template <typename S>
inline S clip_to(S x, S c) { return std::min(std::max(x, -c), c); }

// Gradient of a clamp at its stored (post-clip) output y: g where |y| < clip, else 0.
template <typename S>
inline S clip_grad(S g, S y, S c) { return std::fabs(y) < c ? g : S(0); }

#ifdef CTXFAST_LSTM_AVX2
// The same functions on 8 floats.
#define CTXFAST_AVX2 __attribute__((target("avx2,fma")))

CTXFAST_AVX2 inline __m256 exp8(__m256 x) {
  // max/min return their second operand when one is NaN: x second, so NaN stays NaN.
  x = _mm256_min_ps(_mm256_set1_ps(kExpHi), _mm256_max_ps(_mm256_set1_ps(kExpLo), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

CTXFAST_AVX2 inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

CTXFAST_AVX2 inline __m256 abs8(__m256 x) {
  return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
}

CTXFAST_AVX2 inline __m256 tanh8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 ax = abs8(x);
  const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), ax));
  __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  big = _mm256_or_ps(big, _mm256_and_ps(x, _mm256_set1_ps(-0.0f)));  // sign of x
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kT0), z, _mm256_set1_ps(kT1));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kT2));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kT3));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kT4));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
  return _mm256_blendv_ps(big, small, _mm256_cmp_ps(ax, _mm256_set1_ps(kTanhSmall), _CMP_LT_OQ));
}

// clamp(x, -c, c) with NaN kept: max/min return their second operand when one is NaN.
CTXFAST_AVX2 inline __m256 clip8(__m256 x, __m256 c) {
  return _mm256_min_ps(c, _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), c), x));
}

// Forward cell over j in [j0, j1) of one batch row, 8 at a time; returns where it stopped.
CTXFAST_AVX2 int64_t cell_forward_avx2(float* gi, float* gf, float* gg, float* go,
                                       const float* cp, float* cr, float* hr, int64_t j0,
                                       int64_t j1, float cell_clip) {
  const __m256 clip = _mm256_set1_ps(cell_clip);
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8) {
    const __m256 i = sigmoid8(_mm256_loadu_ps(gi + j));
    const __m256 f = sigmoid8(_mm256_loadu_ps(gf + j));
    const __m256 g = tanh8(_mm256_loadu_ps(gg + j));
    const __m256 o = sigmoid8(_mm256_loadu_ps(go + j));
    _mm256_storeu_ps(gi + j, i);
    _mm256_storeu_ps(gf + j, f);
    _mm256_storeu_ps(gg + j, g);
    _mm256_storeu_ps(go + j, o);
    const __m256 c = clip8(_mm256_fmadd_ps(f, _mm256_loadu_ps(cp + j), _mm256_mul_ps(i, g)), clip);
    _mm256_storeu_ps(cr + j, c);
    _mm256_storeu_ps(hr + j, _mm256_mul_ps(o, tanh8(c)));
  }
  return j;
}

// Backward cell over j in [j0, j1) of one batch row (see cell_backward); dhb may be null.
CTXFAST_AVX2 int64_t cell_backward_avx2(const float* gi, const float* gf, const float* gg,
                                        const float* go, const float* cr, const float* cp,
                                        const float* gcr, const float* dha, const float* dhb,
                                        float* dcr, float* dzi, float* dzf, float* dzg,
                                        float* dzo, float* hpr, int64_t j0, int64_t j1,
                                        float cell_clip) {
  const __m256 one = _mm256_set1_ps(1.0f), clip = _mm256_set1_ps(cell_clip);
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8) {
    const __m256 i = _mm256_loadu_ps(gi + j), f = _mm256_loadu_ps(gf + j);
    const __m256 g = _mm256_loadu_ps(gg + j), o = _mm256_loadu_ps(go + j);
    const __m256 c = _mm256_loadu_ps(cr + j);
    const __m256 tc = tanh8(c);
    __m256 dhp = _mm256_loadu_ps(dha + j);
    if (dhb) dhp = _mm256_add_ps(dhp, _mm256_loadu_ps(dhb + j));
    if (hpr) _mm256_storeu_ps(hpr + j, _mm256_mul_ps(o, tc));
    __m256 dc = _mm256_add_ps(_mm256_loadu_ps(dcr + j), _mm256_loadu_ps(gcr + j));
    dc = _mm256_fmadd_ps(_mm256_mul_ps(dhp, o), _mm256_fnmadd_ps(tc, tc, one), dc);
    dc = _mm256_and_ps(dc, _mm256_cmp_ps(abs8(c), clip, _CMP_LT_OQ));  // clip gradient
    _mm256_storeu_ps(dcr + j, _mm256_mul_ps(dc, f));
    _mm256_storeu_ps(dzi + j, _mm256_mul_ps(_mm256_mul_ps(dc, g),
                                            _mm256_mul_ps(i, _mm256_sub_ps(one, i))));
    _mm256_storeu_ps(dzf + j, _mm256_mul_ps(_mm256_mul_ps(dc, _mm256_loadu_ps(cp + j)),
                                            _mm256_mul_ps(f, _mm256_sub_ps(one, f))));
    _mm256_storeu_ps(dzg + j, _mm256_mul_ps(_mm256_mul_ps(dc, i), _mm256_fnmadd_ps(g, g, one)));
    _mm256_storeu_ps(dzo + j, _mm256_mul_ps(_mm256_mul_ps(dhp, tc),
                                            _mm256_mul_ps(o, _mm256_sub_ps(one, o))));
  }
  return j;
}
#endif  // CTXFAST_LSTM_AVX2

// One forward step of the cell. g [B, 4H] holds z on entry and the activations on exit;
// c_prev, c [B, H]; hp [B, H] receives o * tanh(c).
template <typename S>
void cell_forward(S* __restrict__ g, const S* __restrict__ c_prev, S* __restrict__ c,
                  S* __restrict__ hp, int64_t B, int64_t H, S cell_clip) {
  at::parallel_for(0, B * H, kGrain, [&](int64_t begin, int64_t end) {
    int64_t e = begin;
    while (e < end) {
      const int64_t b = e / H;
      const int64_t j0 = e - b * H;
      const int64_t j1 = std::min(H, j0 + (end - e));
      S* gi = g + b * 4 * H;
      S* gf = gi + H;
      S* gg = gi + 2 * H;
      S* go = gi + 3 * H;
      const S* cp = c_prev + b * H;
      S* cr = c + b * H;
      S* hr = hp + b * H;
      int64_t j = j0;
#ifdef CTXFAST_LSTM_AVX2
      if constexpr (std::is_same_v<S, float>) {
        if (cpu_has_avx2()) j = cell_forward_avx2(gi, gf, gg, go, cp, cr, hr, j0, j1, cell_clip);
      }
#endif
      for (; j < j1; ++j) {
        const S i = sigmoid_of(gi[j]);
        const S f = sigmoid_of(gf[j]);
        const S gv = tanh_of(gg[j]);
        const S o = sigmoid_of(go[j]);
        gi[j] = i;
        gf[j] = f;
        gg[j] = gv;
        go[j] = o;
        const S cv = clip_to(f * cp[j] + i * gv, cell_clip);
        cr[j] = cv;
        hr[j] = o * tanh_of(cv);
      }
      e += j1 - j0;
    }
  });
}

// One backward step of the cell. The gradient w.r.t. hp_t [B, H] is dh_a with a projection
// (Proj), else dh_a + dh_b (grad_out[t] + the carried dL/dh_t); dc [B, H] carries dL/dc_t
// from the later step in and dL/dc_{t-1} out; dz [B, 4H] receives dL/dz_t; with Proj,
// hp_out [B, H] receives o * tanh(c_t) (for the gradient of w_hr).
template <typename S, bool Proj>
void cell_backward(const S* __restrict__ g, const S* __restrict__ c,
                   const S* __restrict__ c_prev, const S* __restrict__ grad_c,
                   const S* __restrict__ dh_a, const S* __restrict__ dh_b, S* __restrict__ dc,
                   S* __restrict__ dz, S* __restrict__ hp_out, int64_t B, int64_t H,
                   S cell_clip) {
  at::parallel_for(0, B * H, kGrain, [&](int64_t begin, int64_t end) {
    int64_t e = begin;
    while (e < end) {
      const int64_t b = e / H;
      const int64_t j0 = e - b * H;
      const int64_t j1 = std::min(H, j0 + (end - e));
      const S* gi = g + b * 4 * H;
      const S* gf = gi + H;
      const S* gg = gi + 2 * H;
      const S* go = gi + 3 * H;
      S* dzi = dz + b * 4 * H;
      S* dzf = dzi + H;
      S* dzg = dzi + 2 * H;
      S* dzo = dzi + 3 * H;
      const S* cr = c + b * H;
      const S* cp = c_prev + b * H;
      const S* gcr = grad_c + b * H;
      const S* dha = dh_a + b * H;
      const S* dhb = Proj ? nullptr : dh_b + b * H;
      S* dcr = dc + b * H;
      S* hpr = Proj ? hp_out + b * H : nullptr;
      int64_t j = j0;
#ifdef CTXFAST_LSTM_AVX2
      if constexpr (std::is_same_v<S, float>) {
        if (cpu_has_avx2()) {
          j = cell_backward_avx2(gi, gf, gg, go, cr, cp, gcr, dha, dhb, dcr, dzi, dzf, dzg, dzo,
                                 hpr, j0, j1, cell_clip);
        }
      }
#endif
      for (; j < j1; ++j) {
        const S i = gi[j], f = gf[j], gv = gg[j], o = go[j];
        const S cv = cr[j];
        const S tc = tanh_of(cv);
        S dhp;
        if constexpr (Proj) {
          dhp = dha[j];
          hpr[j] = o * tc;
        } else {
          dhp = dha[j] + dhb[j];
        }
        const S dcv = clip_grad(dcr[j] + gcr[j] + dhp * o * (S(1) - tc * tc), cv, cell_clip);
        dcr[j] = dcv * f;
        dzi[j] = dcv * gv * i * (S(1) - i);
        dzf[j] = dcv * cp[j] * f * (S(1) - f);
        dzg[j] = dcv * i * (S(1) - gv * gv);
        dzo[j] = dhp * tc * o * (S(1) - o);
      }
      e += j1 - j0;
    }
  });
}

// dst = (a + b) * [|y| < clip], elementwise over n values (the projection's clipped grad).
template <typename S>
void add_clip_grad(const S* a, const S* b, const S* y, S* dst, int64_t n, S clip) {
  at::parallel_for(0, n, 4 * kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) dst[e] = clip_grad(a[e] + b[e], y[e], clip);
  });
}

template <typename S>
void clip_inplace(S* x, int64_t n, S clip) {
  if (std::isinf(clip)) return;
  at::parallel_for(0, n, 4 * kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) x[e] = clip_to(x[e], clip);
  });
}

// ------------------------------------------------------------------ recurrent GEMM
// The recurrent GEMMs have a small M (the batch) and a large B operand (the weight) that
// stays the same for all T steps. A library sgemm re-packs that operand at every call and
// is tuned for large M: measured on the 2-core AMD EPYC (Zen 3, AVX2) dev machine, one
// thread, B 16 x H 1152 (M 16, N 4608, K 1152): ATen/MKL sgemm 27 GFLOP/s, MKL's packed
// sgemm (pack once, compute per step) 34 GFLOP/s, against 70-86 GFLOP/s for large GEMMs.
// So the weight is packed once per call into panels of 16 columns (Bp[panel][k][0..15],
// contiguous, read once per step from L2/L3) and the AVX2/FMA micro-kernel the attention
// kernels share (tile_avx2.h) computes 6 x 16 tiles of C with 12 accumulator registers
// (the classic broadcast-A form): ~60 GFLOP/s on
// the same machine and sizes (the forward recurrence of T 70 went from 478 to 236 ms).
// Used for float32 with M <= kMaxM where the CPU has AVX2 and FMA (checked at run time),
// for any M where it has AVX-512 and MKL runs AVX2 code on it (cpu_gemm.h: AMD); ATen's mm
// otherwise (float64, large batches elsewhere, other CPUs). At B 128 on a Zen 5 host (AVX-512; MKL runs its AVX2
// code there) the AVX-512 kernel took a ULMFiT layer's forward from 691 to 401 ms and
// forward+backward from 1882 to 1280 ms against ATen (nn.LSTM: 299-312 / 1000-1020).
constexpr int64_t kNR = 16;  // columns per panel (two 8-float registers)
constexpr int64_t kMaxM = 64;  // larger batches on AVX2: A leaves L2, a library GEMM did better


#ifdef CTXFAST_LSTM_AVX2
// One panel of StepGemm's transposed pack for k < K8 (a multiple of 8): dst[k][i] =
// W[n0 + i][k] (times msk * sc when msk), i < 16, rows i >= nv zero; W's rows ld apart.
// In 8 x 8 blocks transposed in registers: the scalar loop wrote one float per cache line
// and took ~9 ms for the 4608 x 1152 weight on one thread (1.7 ns per element).
CTXFAST_AVX2 void pack_panel_trans_avx2(const float* src, const float* msk, float sc,
                                        int64_t ld, int64_t n0, int64_t nv, int64_t K8,
                                        float* dst) {
  const __m256 vs = _mm256_set1_ps(sc);
  for (int64_t k0 = 0; k0 < K8; k0 += 8) {
    for (int64_t half = 0; half < 2; ++half) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t row = 8 * half + i;
        if (row >= nv) {
          r[i] = _mm256_setzero_ps();
          continue;
        }
        const int64_t o = (n0 + row) * ld + k0;
        r[i] = _mm256_loadu_ps(src + o);
        if (msk != nullptr) r[i] = _mm256_mul_ps(_mm256_mul_ps(r[i], _mm256_loadu_ps(msk + o)), vs);
      }
      avx2::transpose8x8(r);
      float* d = dst + k0 * kNR + 8 * half;
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(d + c * kNR, r[c]);  // dst row k0 + c
    }
  }
}

// One full panel (16 columns) of StepGemm's plain pack: dst[k][i] = W[k][n0 + i] (times
// msk * sc when msk), k < K; W's rows ld apart. Two 8-float loads per row of the panel
// (the scalar loop, with its mask and bounds tests per element, did not vectorise).
CTXFAST_AVX2 void pack_panel_avx2(const float* src, const float* msk, float sc, int64_t ld,
                                  int64_t n0, int64_t K, float* dst) {
  const __m256 vs = _mm256_set1_ps(sc);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t o = k * ld + n0;
    __m256 lo = _mm256_loadu_ps(src + o), hi = _mm256_loadu_ps(src + o + 8);
    if (msk != nullptr) {
      lo = _mm256_mul_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(msk + o)), vs);
      hi = _mm256_mul_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(msk + o + 8)), vs);
    }
    _mm256_storeu_ps(dst + k * kNR, lo);
    _mm256_storeu_ps(dst + k * kNR + 8, hi);
  }
}
#endif

// W = w_hh * mask * scale as a tensor, for the ATen GEMMs (MKL cannot apply a mask on the
// fly); the module's parameter is never written. Without a mask, W = w_hh and scale is
// not used (as in ctxfast/reference/lstm.py).
Tensor masked_weight(const Tensor& w_hh, const Tensor& mask, double scale) {
  if (!mask.defined()) return w_hh;
  Tensor w = at::mul(w_hh, mask);
  if (scale != 1.0) w.mul_(scale);
  return w;
}

// c [M, N] (+)= a [M, K] @ op(W), W = b * mask * scale (mask undefined: W = b), op(W) =
// W^T (b [N, K] row-major) when trans, else W (b [K, N]). W is the same at every step: it
// is packed once at construction, the mask and scale applied while packing (no masked copy
// of the weight is formed); on the ATen path a masked temporary is formed once instead.
class StepGemm {
 public:
  // M: the rows of every a (the batch); b is packed only where the micro-kernel will run.
  StepGemm(const Tensor& b, const Tensor& mask, double scale, bool trans, int64_t M)
      : trans_(trans) {
    N_ = trans ? b.size(0) : b.size(1);
    K_ = trans ? b.size(1) : b.size(0);
    if (b.scalar_type() != at::kFloat || !cpu_has_avx2() || N_ == 0 || K_ == 0 || M == 0 ||
        (M > kMaxM && !(cpu_has_avx512() && blas_below_cpu()))) {
      w_ = masked_weight(b, mask, scale);
      return;
    }
    const int64_t panels = (N_ + kNR - 1) / kNR;
    packed_ = at::empty({panels * K_ * kNR + 8}, b.options());  // +8: 32-byte alignment slack
    float* bp = aligned(packed_.data_ptr<float>());
    const float* src = b.data_ptr<float>();
    const float* msk = mask.defined() ? mask.data_ptr<float>() : nullptr;
    const float sc = static_cast<float>(scale);
    const int64_t N = N_, K = K_;
    // W[r][c] of b's layout ([N, K] when trans, else [K, N]; row length ld).
    const int64_t ld = trans ? K : N;
    auto w_at = [&](int64_t r, int64_t c) {
      const int64_t o = r * ld + c;
      return msk ? src[o] * msk[o] * sc : src[o];
    };
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        float* dst = bp + p * K * kNR;
        const int64_t n0 = p * kNR, nv = std::min(kNR, N - n0);
        if (trans) {  // dst[k][i] = W[n0 + i][k]
          int64_t k_done = 0;
#ifdef CTXFAST_LSTM_AVX2
          k_done = K - K % 8;  // (packing happens only where the CPU has AVX2)
          pack_panel_trans_avx2(src, msk, sc, ld, n0, nv, k_done, dst);
#endif
          for (int64_t i = 0; i < kNR; ++i) {
            for (int64_t k = k_done; k < K; ++k)
              dst[k * kNR + i] = i < nv ? w_at(n0 + i, k) : 0.0f;
          }
        } else {  // dst[k][i] = W[k][n0 + i]
#ifdef CTXFAST_LSTM_AVX2
          if (nv == kNR) {
            pack_panel_avx2(src, msk, sc, ld, n0, K, dst);
            continue;
          }
#endif
          for (int64_t k = 0; k < K; ++k) {
            for (int64_t i = 0; i < kNR; ++i) dst[k * kNR + i] = i < nv ? w_at(k, n0 + i) : 0.0f;
          }
        }
      }
    });
  }

  // C = addend + A @ op(W), or A @ op(W) when addend is null; A [M, K], C and addend
  // [M, N], contiguous rows (C may be gates[t], addend xw[t]): raw pointers, so that the
  // step loop builds no Tensor per step. S is the weight's dtype.
  template <typename S>
  void run(int64_t M, const S* a, S* c, const S* addend = nullptr) const {
#ifdef CTXFAST_LSTM_AVX2
    if constexpr (std::is_same_v<S, float>) {
      if (packed_.defined()) {
        run_packed(M, a, c, addend);
        return;
      }
    }
#endif
    const auto opts = w_.options();
    const Tensor A = at::from_blob(const_cast<S*>(a), {M, K_}, opts);
    Tensor C = at::from_blob(c, {M, N_}, opts);
    const Tensor bop = trans_ ? w_.t() : w_;
    if (addend != nullptr) {
      at::addmm_out(C, at::from_blob(const_cast<S*>(addend), {M, N_}, opts), A, bop);
    } else {
      at::mm_out(C, A, bop);
    }
  }

 private:
#ifdef CTXFAST_LSTM_AVX2
  void run_packed(int64_t M, const float* A, float* C, const float* Cin) const {
    {
      const int64_t N = N_, K = K_;
      const float* bp = aligned(packed_.data_ptr<float>());
      const int64_t panels = (N + kNR - 1) / kNR;
      // Panels split over the threads; every thread sweeps all M rows of its panels, so a
      // panel (K x 16 floats) is read from memory once and from L1/L2 for the other tiles.
      // The first tile of a panel prefetches the thread's next panel into L2: the packed
      // weight (21 MB at H 1152) does not stay in the cache from one step to the next, and
      // the hardware prefetcher alone left the recurrence at ~56 GFLOP/s per thread at
      // H 1152 against ~90 at H 512 (whose 4 MB stays cached); with it, ~88 (2-core AMD
      // EPYC, T 70, B 16: 97 -> 67-73 ms on 2 threads).
      // The rows in blocks of avx2::row_block (M 8: 4 + 4, not 6 + 2: a block of 2 rows
      // has 4 accumulators, fewer than the FMA latency needs to keep both FMA pipes busy).
      if (cpu_has_avx512()) return run_packed512(M, A, C, Cin);
      at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
          const int64_t n0 = p * kNR, nv = std::min(kNR, N - n0);
          const float* next = p + 1 < end ? bp + (p + 1) * K * kNR : nullptr;
          for (int64_t m0 = 0, mr = 0; m0 < M; m0 += mr) {
            mr = avx2::row_block(M, m0);
            avx2::kernel_rows<false>(mr, A + m0 * K, K, bp + p * K * kNR, kNR, K, 1.0f,
                                     Cin != nullptr ? Cin + m0 * N + n0 : nullptr, N,
                                     C + m0 * N + n0, N, nv, m0 == 0 ? next : nullptr);
          }
        }
      });
    }
  }

  // run_packed on the AVX-512 kernel: pairs of panels (32 columns, two zmm registers a
  // row, the second panel K x 16 floats after the first), row blocks of avx512::row_block
  // (at most 12), the next pair prefetched into L2 by the first block.
  static CTXFAST_TILE512_FN void run_pairs512(int64_t M, int64_t N, int64_t K,
                                              const float* bp, const float* A, float* C,
                                              const float* Cin, int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t n0 = q * 2 * kNR, nv = std::min(2 * kNR, N - n0);
      const float* b = bp + q * 2 * K * kNR;
      const float* next = q + 1 < end ? b + 2 * K * kNR : nullptr;
      for (int64_t m0 = 0, mr = 0; m0 < M; m0 += mr) {
        mr = avx512::row_block(M, m0);
        avx512::block<false>(mr, A + m0 * K, K, b, kNR, K * kNR, K, 1.0f,
                             Cin != nullptr ? Cin + m0 * N + n0 : nullptr, N,
                             C + m0 * N + n0, N, nv, m0 == 0 ? next : nullptr);
      }
    }
  }

  void run_packed512(int64_t M, const float* A, float* C, const float* Cin) const {
    const int64_t N = N_, K = K_;
    const float* bp = aligned(packed_.data_ptr<float>());
    const int64_t pairs = (N + 2 * kNR - 1) / (2 * kNR);
    at::parallel_for(0, pairs, 2, [&](int64_t begin, int64_t end) {
      run_pairs512(M, N, K, bp, A, C, Cin, begin, end);
    });
  }
#endif

  static float* aligned(float* p) {
    const auto u = reinterpret_cast<uintptr_t>(p);
    return reinterpret_cast<float*>((u + 31) & ~uintptr_t(31));
  }
  static const float* aligned(const float* p) { return aligned(const_cast<float*>(p)); }

  Tensor w_, packed_;  // the masked weight (ATen path) or its packed panels
  bool trans_;
  int64_t N_ = 0, K_ = 0;
};

inline int64_t time_index(int64_t s, int64_t T, bool reverse) { return reverse ? T - 1 - s : s; }

template <typename S>
void forward_impl(const Tensor& xw, const Tensor& h0, const Tensor& c0, const Tensor& w_hh,
                  const Tensor& mask, double scale, const Tensor& w_hr, double cell_clip,
                  double proj_clip, bool reverse, Tensor& out, Tensor& cells, Tensor& gates) {
  const int64_t T = xw.size(0), B = xw.size(1), H = xw.size(2) / 4;
  const bool proj = w_hr.defined();
  const StepGemm rec(w_hh, mask, scale, /*trans=*/true, B);  // h [B, P] @ W^T [P, 4H]
  std::optional<StepGemm> prj;                               // hp [B, H] @ w_hr^T [H, P]
  if (proj) prj.emplace(w_hr, Tensor(), 1.0, /*trans=*/true, B);
  Tensor hp = proj ? at::empty({B, H}, xw.options()) : Tensor();  // [B, H]
  // Step t's rows as pointers (every tensor here is contiguous): no Tensor per step.
  const int64_t G = 4 * H, P = out.size(2);
  const S* xwp = xw.data_ptr<S>();                          // [T, B, 4H]
  S* outp = out.data_ptr<S>();                              // [T, B, P]
  S* cellp = cells.data_ptr<S>();                           // [T, B, H]
  S* gatep = gates.data_ptr<S>();                           // [T, B, 4H]
  S* hpp = proj ? hp.data_ptr<S>() : nullptr;
  for (int64_t s = 0; s < T; ++s) {
    const int64_t t = time_index(s, T, reverse);
    const int64_t tp = reverse ? t + 1 : t - 1;
    const S* h_prev = s == 0 ? h0.data_ptr<S>() : outp + tp * B * P;    // [B, P]
    const S* c_prev = s == 0 ? c0.data_ptr<S>() : cellp + tp * B * H;   // [B, H]
    S* z = gatep + t * B * G;                                            // [B, 4H]
    rec.run<S>(B, h_prev, z, xwp + t * B * G);              // z = xw_t + h_{t-1} @ W^T
    S* hp_t = proj ? hpp : outp + t * B * P;                // [B, H]
    cell_forward<S>(z, c_prev, cellp + t * B * H, hp_t, B, H, static_cast<S>(cell_clip));
    if (proj) {
      S* o = outp + t * B * P;                              // [B, P]
      prj->run<S>(B, hpp, o);
      clip_inplace<S>(o, B * P, static_cast<S>(proj_clip));
    }
  }
}

template <typename S>
void backward_impl(const Tensor& grad_out, const Tensor& grad_cells, const Tensor& c0,
                   const Tensor& w_hh, const Tensor& mask, double scale, const Tensor& w_hr,
                   double cell_clip, double proj_clip, bool reverse, const Tensor& out,
                   const Tensor& cells, const Tensor& gates, Tensor& grad_xw, Tensor& carry,
                   Tensor& dc, Tensor& dh_pre, Tensor& hp_all) {
  const int64_t T = gates.size(0), B = gates.size(1), H = gates.size(2) / 4;
  const bool proj = w_hr.defined();
  Tensor dhp = proj ? at::empty({B, H}, gates.options()) : Tensor();  // [B, H]
  const StepGemm rec(w_hh, mask, scale, /*trans=*/false, B);  // dz [B, 4H] @ W [4H, P]
  std::optional<StepGemm> prj;                                // dpre [B, P] @ w_hr [P, H]
  if (proj) prj.emplace(w_hr, Tensor(), 1.0, /*trans=*/false, B);
  // Step t's rows as pointers (every tensor here is contiguous): no Tensor per step.
  const int64_t G = 4 * H, P = out.size(2);
  const S* gop = grad_out.data_ptr<S>();                    // [T, B, P]
  const S* gcp = grad_cells.data_ptr<S>();                  // [T, B, H]
  const S* outp = out.data_ptr<S>();                        // [T, B, P]
  const S* cellp = cells.data_ptr<S>();                     // [T, B, H]
  const S* gatep = gates.data_ptr<S>();                     // [T, B, 4H]
  S* dzp = grad_xw.data_ptr<S>();                           // [T, B, 4H]
  S* carryp = carry.data_ptr<S>();                          // [B, P]
  S* dcp = dc.data_ptr<S>();                                // [B, H]
  S* dprep = proj ? dh_pre.data_ptr<S>() : nullptr;         // [T, B, P]
  S* hpallp = proj ? hp_all.data_ptr<S>() : nullptr;        // [T, B, H]
  S* dhpp = proj ? dhp.data_ptr<S>() : nullptr;             // [B, H]
  auto cell_bwd = proj ? cell_backward<S, true> : cell_backward<S, false>;
  for (int64_t s = T - 1; s >= 0; --s) {
    const int64_t t = time_index(s, T, reverse);
    const int64_t tp = reverse ? t + 1 : t - 1;
    const S* c_prev = s == 0 ? c0.data_ptr<S>() : cellp + tp * B * H;   // [B, H]
    const S* dh_a;
    const S* dh_b;
    if (proj) {
      // dL/d(hp_t @ w_hr^T) = (grad_out[t] + dh_t) * [|h_t| < proj_clip], then @ w_hr.
      S* dpre = dprep + t * B * P;                          // [B, P]
      add_clip_grad<S>(gop + t * B * P, carryp, outp + t * B * P, dpre, B * P,
                       static_cast<S>(proj_clip));
      prj->run<S>(B, dpre, dhpp);
      dh_a = dhpp;
      dh_b = nullptr;
    } else {
      dh_a = gop + t * B * P;
      dh_b = carryp;
    }
    S* dz = dzp + t * B * G;                                // [B, 4H]
    cell_bwd(gatep + t * B * G, cellp + t * B * H, c_prev, gcp + t * B * H, dh_a, dh_b, dcp,
             dz, proj ? hpallp + t * B * H : nullptr, B, H, static_cast<S>(cell_clip));
    rec.run<S>(B, dz, carryp);                              // dL/dh_{t-1} [B, P]
  }
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> lstm_recurrence_forward(
    const Tensor& xw, const Tensor& h0, const Tensor& c0, const Tensor& w_hh,
    const Tensor& w_hr, const Tensor& mask, double scale, double cell_clip, double proj_clip,
    bool reverse) {
  const int64_t T = xw.size(0), B = xw.size(1), H4 = xw.size(2), P = w_hh.size(1);
  Tensor out = at::empty({T, B, P}, xw.options());
  Tensor cells = at::empty({T, B, H4 / 4}, xw.options());
  Tensor gates = at::empty({T, B, H4}, xw.options());
  if (T == 0) return {out, cells, gates};
  if (xw.scalar_type() == at::kDouble) {
    forward_impl<double>(xw, h0, c0, w_hh, mask, scale, w_hr, cell_clip, proj_clip, reverse,
                         out, cells, gates);
  } else {
    forward_impl<float>(xw, h0, c0, w_hh, mask, scale, w_hr, cell_clip, proj_clip, reverse,
                        out, cells, gates);
  }
  return {out, cells, gates};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> lstm_recurrence_backward(
    const Tensor& grad_out, const Tensor& grad_cells, const Tensor& h0, const Tensor& c0,
    const Tensor& w_hh, const Tensor& w_hr, const Tensor& mask, double scale, double cell_clip,
    double proj_clip, bool reverse, const Tensor& out, const Tensor& cells,
    const Tensor& gates) {
  const int64_t T = gates.size(0), B = gates.size(1), H4 = gates.size(2), H = H4 / 4;
  const int64_t P = w_hh.size(1);
  const bool proj = w_hr.defined();
  const auto opts = gates.options();
  Tensor grad_xw = at::empty({T, B, H4}, opts);
  Tensor carry = at::zeros({B, P}, opts);   // dL/dh of the step before; grad_h0 at the end
  Tensor dc = at::zeros({B, H}, opts);      // dL/dc likewise; grad_c0 at the end
  Tensor dh_pre = proj ? at::empty({T, B, P}, opts) : Tensor();  // grad before the proj clip
  Tensor hp_all = proj ? at::empty({T, B, H}, opts) : Tensor();  // o * tanh(c), all steps
  if (T > 0) {
    if (gates.scalar_type() == at::kDouble) {
      backward_impl<double>(grad_out, grad_cells, c0, w_hh, mask, scale, w_hr, cell_clip,
                            proj_clip, reverse, out, cells, gates, grad_xw, carry, dc, dh_pre,
                            hp_all);
    } else {
      backward_impl<float>(grad_out, grad_cells, c0, w_hh, mask, scale, w_hr, cell_clip,
                           proj_clip, reverse, out, cells, gates, grad_xw, carry, dc, dh_pre,
                           hp_all);
    }
  }
  // dL/dW = sum_t dz_t^T @ h_{t-1}: one GEMM over the steps whose h_{t-1} is an output,
  // plus the step that starts from h0.
  Tensor grad_w;
  if (T == 0) {
    grad_w = at::zeros({H4, P}, opts);
  } else {
    const int64_t first = reverse ? T - 1 : 0;
    grad_w = at::mm(grad_xw[first].t(), h0);                // [4H, P]
    if (T > 1) {
      // Steps other than the first, as [(T-1) B, 4H] and their h_{t-1} as [(T-1) B, P].
      const Tensor dz_rest = (reverse ? grad_xw.narrow(0, 0, T - 1) : grad_xw.narrow(0, 1, T - 1))
                                 .reshape({(T - 1) * B, H4});
      const Tensor h_rest = (reverse ? out.narrow(0, 1, T - 1) : out.narrow(0, 0, T - 1))
                                .reshape({(T - 1) * B, P});
      if (linear_path() == "onednn") grad_w.add_(linear_nt(dz_rest.t(), h_rest.t()));
      else grad_w.addmm_(dz_rest.t(), h_rest);
    }
    if (mask.defined()) {
      grad_w.mul_(mask);
      if (scale != 1.0) grad_w.mul_(scale);
    }
  }
  Tensor grad_w_hr;
  if (!proj) {
    grad_w_hr = at::empty({0}, opts);
  } else if (T == 0) {
    grad_w_hr = at::zeros({P, H}, opts);
  } else {
    grad_w_hr = linear_nt(dh_pre.reshape({T * B, P}).t(), hp_all.reshape({T * B, H}).t());  // [P, H]
  }
  return {grad_xw, carry, dc, grad_w, grad_w_hr};
}

std::string lstm_gemm_path() {
  return cpu_has_avx512() ? "AVX-512" : cpu_has_avx2() ? "AVX2" : "ATen";
}

void check_lstm_settings() {
  static const std::string gemm = env_setting("CTXFAST_LSTM_CPU_GEMM");
  TORCH_CHECK_VALUE(gemm.empty() || gemm == "avx2" || gemm == "aten",
                    "CTXFAST_LSTM_CPU_GEMM must be 'avx2', 'aten' or unset, got '", gemm, "'");
  const std::string& linear = linear_path();
  if (linear.rfind("bad: ", 0) == 0) TORCH_CHECK_VALUE(false, linear.substr(5));
}

}  // namespace cpu
}  // namespace ctxfast
