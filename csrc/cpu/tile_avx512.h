// AVX-512 form of tile_avx2.h's broadcast-A micro-kernel, for the attention kernels' tile
// products (where the own kernels run at all: see own_gemm in attention.cpp) and the LSTM's
// recurrent GEMM (lstm.cpp), where the CPU has AVX-512. Same contract as avx2::kernel, 16 lanes to a register: C blocks of up to
// 12 rows x 32 columns in 24 of the 32 zmm registers (2 per row; 1 where the block is at
// most 16 columns wide), op(A) entries broadcast, B's rows read in place, lanes past the
// columns masked (a masked-off lane is neither read nor written, so no tail can fault).
// Compiled for that target by function attribute; callers check the CPU at run time.
#pragma once

#include "cpu/tile_avx2.h"  // CTXFAST_TILE_AVX2: x86-64 with GCC or Clang

#ifdef CTXFAST_TILE_AVX2
#define CTXFAST_TILE512_FN __attribute__((target("avx512f")))

namespace ctxfast {
namespace cpu {
namespace avx512 {

// Lanes [0, n) of 16 set (n clamped to [0, 16]).
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1u);
}

// C[0:MR, 0:nv] = alpha sum_k A(m, k) B(k, 0:nv), plus Cin[0:MR, 0:nv] where Cin is not
// null (Cin == C, ldi == ldc accumulates in place); nv <= 16 NV. A(m, k) is A[m lda + k] (TA
// false) or A[k lda + m] (TA true). B(k, 0:16) is B[k ldb + 0:16] and B(k, 16:32) is
// B[hoff + k ldb + 0:16]: a row-major B has hoff 16, the LSTM's packed 16-column panels
// the panel's size. `next` (used where PF): another B of the same layout to prefetch into
// L2, row k at step k. FULL (nv == 16 NV) and PF are template arguments so that the k loop
// tests nothing.
template <int MR, int NV, bool TA, bool FULL, bool PF = false>
CTXFAST_TILE512_FN inline void kernel(const float* __restrict__ A, int64_t lda,
                                      const float* __restrict__ B, int64_t ldb, int64_t hoff,
                                      int64_t K, float alpha, const float* Cin, int64_t ldi,
                                      float* C, int64_t ldc, int64_t nv,
                                      const float* next = nullptr) {
  static_assert(NV == 1 || NV == 2, "one or two registers a row");
  __m512 c0[MR], c1[MR];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) c0[m] = c1[m] = _mm512_setzero_ps();
  const __mmask16 k0 = lanes(nv), k1 = lanes(nv - 16);
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (PF) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * ldb), _MM_HINT_T1);
      if constexpr (NV == 2)
        _mm_prefetch(reinterpret_cast<const char*>(next + hoff + k * ldb), _MM_HINT_T1);
    }
    const float* b = B + k * ldb;
    __m512 b0, b1 = _mm512_setzero_ps();
    if constexpr (FULL) {
      b0 = _mm512_loadu_ps(b);
      if constexpr (NV == 2) b1 = _mm512_loadu_ps(b + hoff);
    } else {
      b0 = _mm512_maskz_loadu_ps(k0, b);
      if constexpr (NV == 2) b1 = _mm512_maskz_loadu_ps(k1, b + hoff);
    }
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(TA ? A[k * lda + m] : A[m * lda + k]);
      c0[m] = _mm512_fmadd_ps(a, b0, c0[m]);
      if constexpr (NV == 2) c1[m] = _mm512_fmadd_ps(a, b1, c1[m]);
    }
  }
  const __m512 al = _mm512_set1_ps(alpha);
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    float* cr = C + m * ldc;
    __m512 y0 = _mm512_mul_ps(al, c0[m]);
    if (Cin != nullptr) y0 = _mm512_add_ps(y0, _mm512_maskz_loadu_ps(k0, Cin + m * ldi));
    if constexpr (FULL) _mm512_storeu_ps(cr, y0);
    else _mm512_mask_storeu_ps(cr, k0, y0);
    if constexpr (NV == 2) {
      __m512 y1 = _mm512_mul_ps(al, c1[m]);
      if (Cin != nullptr)
        y1 = _mm512_add_ps(y1, _mm512_maskz_loadu_ps(k1, Cin + m * ldi + 16));
      if constexpr (FULL) _mm512_storeu_ps(cr + 16, y1);
      else _mm512_mask_storeu_ps(cr + 16, k1, y1);
    }
  }
}

// One block of C [MR, nv] (nv <= 32) from B in the layout of `kernel` (hoff), prefetching
// `next` where not null: the kernel for nv and next chosen once for the block.
template <int MR, bool TA>
CTXFAST_TILE512_FN inline void block_mr(const float* A, int64_t lda, const float* B,
                                        int64_t ldb, int64_t hoff, int64_t K, float alpha,
                                        const float* Cin, int64_t ldi, float* C, int64_t ldc,
                                        int64_t nv, const float* next) {
#define CTXFAST_BLOCK512(NV, FULL, PF) \
  kernel<MR, NV, TA, FULL, PF>(A, lda, B, ldb, hoff, K, alpha, Cin, ldi, C, ldc, nv, next)
  if (next != nullptr) {
    if (nv == 32) CTXFAST_BLOCK512(2, true, true);
    else if (nv > 16) CTXFAST_BLOCK512(2, false, true);
    else if (nv == 16) CTXFAST_BLOCK512(1, true, true);
    else CTXFAST_BLOCK512(1, false, true);
  } else {
    if (nv == 32) CTXFAST_BLOCK512(2, true, false);
    else if (nv > 16) CTXFAST_BLOCK512(2, false, false);
    else if (nv == 16) CTXFAST_BLOCK512(1, true, false);
    else CTXFAST_BLOCK512(1, false, false);
  }
#undef CTXFAST_BLOCK512
}

// block_mr for a run-time mr in [1, 12].
template <bool TA>
CTXFAST_TILE512_FN inline void block(int64_t mr, const float* A, int64_t lda, const float* B,
                                     int64_t ldb, int64_t hoff, int64_t K, float alpha,
                                     const float* Cin, int64_t ldi, float* C, int64_t ldc,
                                     int64_t nv, const float* next) {
#define CTXFAST_ROWS512(R)                                                                 \
  case R:                                                                                  \
    block_mr<R, TA>(A, lda, B, ldb, hoff, K, alpha, Cin, ldi, C, ldc, nv, next);           \
    break;
  switch (mr) {
    CTXFAST_ROWS512(12)
    CTXFAST_ROWS512(11)
    CTXFAST_ROWS512(10)
    CTXFAST_ROWS512(9)
    CTXFAST_ROWS512(8)
    CTXFAST_ROWS512(7)
    CTXFAST_ROWS512(6)
    CTXFAST_ROWS512(5)
    CTXFAST_ROWS512(4)
    CTXFAST_ROWS512(3)
    CTXFAST_ROWS512(2)
    default: block_mr<1, TA>(A, lda, B, ldb, hoff, K, alpha, Cin, ldi, C, ldc, nv, next); break;
  }
#undef CTXFAST_ROWS512
}

// C[0:mr, 0:N] for one block of mr rows (mr in [1, 12]), every 32-column panel of a
// row-major B in turn (the last one masked where N is not a multiple of 32).
template <bool TA>
CTXFAST_TILE512_FN inline void row_panels(int64_t mr, const float* A, int64_t lda,
                                          const float* B, int64_t ldb, int64_t K, float alpha,
                                          const float* Cin, int64_t ldi, float* C,
                                          int64_t ldc, int64_t N) {
  for (int64_t n0 = 0; n0 < N; n0 += 32)
    block<TA>(mr, A, lda, B + n0, ldb, 16, K, alpha, Cin != nullptr ? Cin + n0 : nullptr, ldi,
              C + n0, ldc, std::min<int64_t>(32, N - n0), nullptr);
}

// Rows of C in the block that starts at row m0 of M: M split into ceil(M / 12) blocks of
// near-equal height (64: 11, 11, 11, 11, 10, 10; 16: 8, 8), so that no block is left with
// the few accumulators of a short remainder.
inline int64_t row_block(int64_t M, int64_t m0) {
  const int64_t nb = (M + 11) / 12, lo = M / nb, big = M % nb;  // `big` blocks of lo + 1
  return m0 < big * (lo + 1) ? lo + 1 : lo;
}

}  // namespace avx512
}  // namespace cpu
}  // namespace ctxfast
#endif
