// AVX2/FMA building blocks shared by the cpu kernels (attention.cpp, lstm.cpp): the
// broadcast-A micro-kernel of their register-blocked products, its row blocking, and an
// 8 x 8 transpose in registers. Compiled for that target by function attribute; callers
// check the CPU at run time. x86-64 with GCC or Clang only (CTXFAST_TILE_AVX2 defined).
#pragma once

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define CTXFAST_TILE_AVX2 1
#define CTXFAST_TILE_FN __attribute__((target("avx2,fma")))

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace ctxfast {
namespace cpu {
namespace avx2 {

// C[0:MR, 0:nv] = alpha sum_k A(m, k) B[k, 0:nv], plus Cin[0:MR, 0:nv] where Cin is not
// null (Cin == C, ldi == ldc accumulates in place), nv <= 16. A(m, k) is A[m lda + k] (TA
// false) or A[k lda + m] (TA true); B's rows are ldb apart and read in place (a packed
// 16-column panel: ldb 16); Cin's rows are ldi apart, C's ldc. Lanes past nv are neither
// read nor written. `next` (or nullptr): another B of the same layout to prefetch into L2, row k at
// step k. 2 MR accumulator registers (the classic broadcast-A form). FULL (nv == 16) and PF
// (next != nullptr) are template arguments so that the k loop tests neither (a run-time
// test there cost ~10 % of an attention call).
template <int MR, bool TA, bool FULL, bool PF>
CTXFAST_TILE_FN inline void kernel(const float* __restrict__ A, int64_t lda,
                                   const float* __restrict__ B, int64_t ldb, int64_t K,
                                   float alpha, const float* Cin, int64_t ldi, float* C,
                                   int64_t ldc, int64_t nv, const float* next) {
  __m256 c0[MR], c1[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) c0[m] = c1[m] = _mm256_setzero_ps();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nv)), lane);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nv) - 8), lane);
  // unrolled 8 times: rel_attention B2 H8 T128 raw ops, interleaved builds, forward
  // 1.183-1.196 -> 1.168-1.188 ms, backward 2.815-2.821 -> 2.783-2.799 (4 and 16: less)
#pragma GCC unroll 8
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(next + k * ldb), _MM_HINT_T1);
    const float* b = B + k * ldb;
    __m256 b0, b1;
    if constexpr (FULL) {
      b0 = _mm256_loadu_ps(b);
      b1 = _mm256_loadu_ps(b + 8);
    } else {
      b0 = _mm256_maskload_ps(b, m0);
      b1 = _mm256_maskload_ps(b + 8, m1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 a = _mm256_broadcast_ss(TA ? A + k * lda + m : A + m * lda + k);
      c0[m] = _mm256_fmadd_ps(a, b0, c0[m]);
      c1[m] = _mm256_fmadd_ps(a, b1, c1[m]);
    }
  }
  const __m256 al = _mm256_set1_ps(alpha);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    float* cr = C + m * ldc;
    __m256 y0 = _mm256_mul_ps(al, c0[m]), y1 = _mm256_mul_ps(al, c1[m]);
    if constexpr (FULL) {
      if (Cin != nullptr) {
        y0 = _mm256_add_ps(y0, _mm256_loadu_ps(Cin + m * ldi));
        y1 = _mm256_add_ps(y1, _mm256_loadu_ps(Cin + m * ldi + 8));
      }
      _mm256_storeu_ps(cr, y0);
      _mm256_storeu_ps(cr + 8, y1);
    } else {
      if (Cin != nullptr) {
        y0 = _mm256_add_ps(y0, _mm256_maskload_ps(Cin + m * ldi, m0));
        y1 = _mm256_add_ps(y1, _mm256_maskload_ps(Cin + m * ldi + 8, m1));
      }
      _mm256_maskstore_ps(cr, m0, y0);
      _mm256_maskstore_ps(cr + 8, m1, y1);
    }
  }
}

template <int MR, bool TA>
CTXFAST_TILE_FN inline void kernel_mr(const float* A, int64_t lda, const float* B, int64_t ldb,
                                      int64_t K, float alpha, const float* Cin, int64_t ldi,
                                      float* C, int64_t ldc, int64_t nv, const float* next) {
  if (nv == 16 && next != nullptr)
    kernel<MR, TA, true, true>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, nv, next);
  else if (nv == 16)
    kernel<MR, TA, true, false>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, nv, next);
  else if (next != nullptr)
    kernel<MR, TA, false, true>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, nv, next);
  else
    kernel<MR, TA, false, false>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, nv, next);
}

// kernel<mr, TA, ...> for a run-time mr in [1, 6], nv and next.
template <bool TA>
CTXFAST_TILE_FN inline void kernel_rows(int64_t mr, const float* A, int64_t lda,
                                        const float* B, int64_t ldb, int64_t K, float alpha,
                                        const float* Cin, int64_t ldi, float* C, int64_t ldc,
                                        int64_t nv, const float* next) {
  switch (mr) {
    case 6: kernel_mr<6, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, nv, next); break;
    case 5: kernel_mr<5, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, nv, next); break;
    case 4: kernel_mr<4, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, nv, next); break;
    case 3: kernel_mr<3, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, nv, next); break;
    case 2: kernel_mr<2, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, nv, next); break;
    default: kernel_mr<1, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, nv, next); break;
  }
}

// C[0:MR, 0:N] for one block of MR rows, every 16-column panel of B in turn (no
// prefetch): the kernel chosen once for the block, not once per panel.
template <int MR, bool TA>
CTXFAST_TILE_FN inline void row_panels_mr(const float* A, int64_t lda, const float* B,
                                          int64_t ldb, int64_t K, float alpha,
                                          const float* Cin, int64_t ldi, float* C, int64_t ldc,
                                          int64_t N) {
  int64_t n0 = 0;
  for (; n0 + 16 <= N; n0 += 16)
    kernel<MR, TA, true, false>(A, lda, B + n0, ldb, K, alpha,
                                Cin != nullptr ? Cin + n0 : nullptr, ldi, C + n0, ldc, 16,
                                nullptr);
  if (n0 < N)
    kernel<MR, TA, false, false>(A, lda, B + n0, ldb, K, alpha,
                                 Cin != nullptr ? Cin + n0 : nullptr, ldi, C + n0, ldc, N - n0,
                                 nullptr);
}

// row_panels_mr for a run-time mr in [1, 6].
template <bool TA>
CTXFAST_TILE_FN inline void row_panels(int64_t mr, const float* A, int64_t lda,
                                       const float* B, int64_t ldb, int64_t K, float alpha,
                                       const float* Cin, int64_t ldi, float* C, int64_t ldc,
                                       int64_t N) {
  switch (mr) {
    case 6: row_panels_mr<6, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, N); break;
    case 5: row_panels_mr<5, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, N); break;
    case 4: row_panels_mr<4, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, N); break;
    case 3: row_panels_mr<3, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, N); break;
    case 2: row_panels_mr<2, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, N); break;
    default: row_panels_mr<1, TA>(A, lda, B, ldb, K, alpha, Cin, ldi, C, ldc, N); break;
  }
}

// Rows of C in the block that starts at row m0 of M. Blocks of 6 and 5 rows where M allows
// (M = 6 a + 5 b, b < 6: every M >= 20 and 5, 6, 10-12, 15-18): 5 rows hold 10 accumulators,
// as many as the FMA latency (5 cycles, 2 pipes) needs, and ran at 94 % of the FMA peak in
// L1 against 98 % for 6 rows and 78 % for 4 (Zen 2, K 64). Other M as before: 6, except
// that a remainder of 1 or 2 rows goes with the last 6 as 4 + 3 or 4 + 4 (a block of 1-2
// rows has 2-4 accumulators; M 8: 4 + 4).
inline int64_t row_block(int64_t M, int64_t m0) {
  const int64_t fives = (6 - M % 6) % 6;
  if (5 * fives <= M) return m0 < M - 5 * fives ? 6 : 5;
  const int64_t n6 = M % 6 != 0 && M % 6 < 3 && M > 6 ? M / 6 - 1 : M / 6;
  return m0 < 6 * n6 ? 6 : std::min<int64_t>(M - m0, M - m0 > 6 ? 4 : 6);
}

// r[0..7] holds 8 rows of 8 floats; on return r[c] holds their column c.
CTXFAST_TILE_FN inline void transpose8x8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {  // rows i, i + 1 interleaved
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // columns c and c + 4 of rows i..i + 3
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {  // the low halves hold rows 0-3, the high ones rows 4-7
    t[c] = _mm256_permute2f128_ps(r[c], r[c + 4], 0x20);
    t[c + 4] = _mm256_permute2f128_ps(r[c], r[c + 4], 0x31);
  }
  for (int c = 0; c < 8; ++c) r[c] = t[c];
}

}  // namespace avx2
}  // namespace cpu
}  // namespace ctxfast
#endif
