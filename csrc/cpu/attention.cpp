// Fused attention on the CPU (math and contract in csrc/cpu/attention.h).
//
// Work split: the forward runs one task per (sequence, head, block of kBlockQ queries)
// under at::parallel_for; each task walks its key blocks (only those the masks leave
// visible) with S = scale Q Kᵀ and acc += P V as GEMMs on [kBlockQ, kBlockK] tiles and the
// masks and the online softmax in between, accumulating straight into the output rows.
// The backward runs one task per (sequence, head), which owns that head's dq, dk, dv (no
// reduction): per query block, over the forward's key range, it recomputes P from the
// saved lse and accumulates dV, dK (the tile's key rows) and dQ. rel_attention's position
// term comes from the query block's band of r (Band below), formed in chunks as the key
// tiles reach it and added to S by the score product; its gradient, dS written in place in
// the band, goes into dqw and dr in chunks as soon as it is complete.
// XLNet permutation masks run in rank order (RankOrder below): about half the tiles.
#include "cpu/attention.h"
#include "cpu/output_cache.h"
#include "cpu/cpu_gemm.h"
#include "cpu/tile_avx2.h"
#include "cpu/tile_avx512.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

// The Fortran BLAS torch links (MKL in the x86 wheels). Weak: where a torch build exports
// none, the plain loop below runs instead (correct, slower).
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b,
            const int* ldb, const double* beta, double* c, const int* ldc)
    __attribute__((weak));
}

namespace ctxfast {
namespace cpu {
namespace {

using at::Tensor;

// Tile sizes: kBlockQ queries x kBlockK keys. CTXFAST_ATTN_CPU_TILE="BQ,BK" overrides them
// (read once; for tuning). Any other value is kept in `bad` and refused by
// check_gemm_setting (a ValueError naming it), not ignored.
struct Tile {
  int64_t q = 64, k = 128;
  bool given = false;  // set by CTXFAST_ATTN_CPU_TILE
  std::string bad;     // CTXFAST_ATTN_CPU_TILE when it is not two positive integers
  Tile() {
    const char* v = std::getenv("CTXFAST_ATTN_CPU_TILE");
    if (v == nullptr || *v == '\0') return;
    long a = 0, b = 0;
    int end = 0;
    if (std::sscanf(v, "%ld,%ld%n", &a, &b, &end) == 2 && v[end] == '\0' && a > 0 && b > 0) {
      q = a;
      k = b;
      given = true;
    } else {
      bad = v;
    }
  }
};
const Tile& tile() {
  static const Tile t;
  return t;
}
#define kBlockQ (tile().q)
#define kBlockK (tile().k)
// Keys per tile on a causal diagonal (for_each_key_tile): 16 computes a quarter fewer hidden
// pairs there than 32; with the own tile kernel (no per-call packing) that measured 2-5 %
// faster (causal T 256-512, rel_attention and permutations at T 128), mostly forward. On
// the BLAS path (AVX-512 hosts) 32, as measured there before.
#define kDiagK (std::min<int64_t>(own_gemm() ? 16 : 32, kBlockK))

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// CTXFAST_ATTN_CPU_DEBUG (read once per process; for tests): a comma-separated list of
// * "poison": every output is filled with NaN before the kernels write it, and the rank
//   order's row copies before each task. An element that no task writes then reads NaN,
//   not a value from an earlier call (the output cache hands back used blocks, whose
//   stale contents may well be right);
// * "reverse": the tasks are handed out last first. With one thread, a task that writes
//   rows past its own end runs after the task that owns them, so that write is not
//   overwritten (in order it would be, and go unseen).
struct DebugSetting {
  bool poison = false, reverse = false;
  std::string value, bad;  // the variable, and its first unknown entry
};

const DebugSetting& debug_setting() {
  static const DebugSetting d = [] {
    DebugSetting r;
    r.value = env_setting("CTXFAST_ATTN_CPU_DEBUG");
    size_t at = 0;
    while (at <= r.value.size() && !r.value.empty()) {
      const size_t comma = std::min(r.value.find(',', at), r.value.size());
      const std::string item = r.value.substr(at, comma - at);
      if (item == "poison") r.poison = true;
      else if (item == "reverse") r.reverse = true;
      else if (r.bad.empty()) r.bad = item.empty() ? "(empty)" : item;
      at = comma + 1;
    }
    return r;
  }();
  return d;
}

// t filled with NaN under CTXFAST_ATTN_CPU_DEBUG=poison (floating outputs only).
Tensor poisoned(Tensor t) {
  if (debug_setting().poison && t.is_floating_point())
    t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

template <typename T>
void poison(std::vector<T>& v) {
  if (debug_setting().poison) std::fill(v.begin(), v.end(), std::numeric_limits<T>::quiet_NaN());
}

// Tasks [0, n) over the threads, handed out one at a time from a shared counter rather than
// as one contiguous range per thread (at::parallel_for's split): a thread slowed by other
// work on a shared machine, or given the heavier tasks, takes fewer of them. body(next) runs
// once per thread (its scratch built once); next() is the thread's next task, -1 when none.
template <typename Body>
void parallel_dynamic(int64_t n, const Body& body) {
  if (n <= 0) return;
  std::atomic<int64_t> counter{0};
  const bool reverse = debug_setting().reverse;
  auto next = [&counter, n, reverse]() -> int64_t {
    const int64_t t = counter.fetch_add(1, std::memory_order_relaxed);
    return t < n ? (reverse ? n - 1 - t : t) : -1;
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(next); });
}

// The forward's query block for n_heads sequences of at most max_tq queries: 32 for short
// causal sequences, or short ones with too few tasks for the threads (a causal block then
// ends earlier, and there are more tasks: measured on the 2-core dev machine, causal
// rel_attention B4 H4 Tq64 D32 150 -> 117 us, attention B8 H12 Tq128 D64 ~10 % faster);
// kBlockQ otherwise (non-causal Tq 100-128 with many heads was 5-12 % slower with 32:
// more passes over K and V, smaller GEMMs). The backward keeps kBlockQ.
int64_t forward_block_q(int64_t max_tq, bool causal, int64_t n_heads) {
  if (tile().given || max_tq > 128) return kBlockQ;
  const bool few = n_heads * cdiv(max_tq, kBlockQ) < 4 * at::get_num_threads();
  return causal || few ? std::min<int64_t>(32, kBlockQ) : kBlockQ;
}

// ---------------------------------------------------------------- GEMM on row-major tiles

// Plain loop: C[M, N] = alpha op(A) op(B) + beta C, row-major (beta == 0 ignores C).
template <typename T>
void gemm_loop(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
               int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      T acc = 0;
      for (int64_t p = 0; p < K; ++p) {
        const T a = ta ? A[p * lda + i] : A[i * lda + p];
        const T b = tb ? B[j * ldb + p] : B[p * ldb + j];
        acc += a * b;
      }
      C[i * ldc + j] = alpha * acc + (beta == T(0) ? T(0) : beta * C[i * ldc + j]);
    }
  }
}

// One-row products (decoding: a single query) without the BLAS, where the CPU has AVX2;
// defined with the row kernels below. Returns whether it computed C.
bool gemv_rm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
             int64_t lda, const float* B, int64_t ldb, float beta, float* C);
// Products on the project's AVX2 kernel (defined below). Returns whether it computed C.
bool gemm_bcast_rm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                   const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                   int64_t ldc);
// Whether float products run on that kernel (own_gemm's rule, at its definition); dst [K, N]
// (row stride ldd) <- src [N, K] transposed (rows ld apart; row n is src's row idx[n] where
// idx is given).
bool own_gemm();
// C = alpha A B + add on that kernel (gemm_add below). Returns whether it computed C.
bool gemm_add_own(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                  const float* B, int64_t ldb, const float* add, int64_t ldadd, float* C,
                  int64_t ldc);
void transpose_rows(const float* src, int64_t ld, int64_t N, int64_t K, float* dst, int64_t ldd);

// A thread's transposed copy [D, n] (row stride ld) of n rows of a head's K, V or r, for the
// products that take them as Bᵀ (Q Kᵀ, dO Vᵀ, qw rᵀ), which then read a row-major B instead
// of transposing each tile per call. Float on the own kernel only (nullptr otherwise: the
// products take the rows as they are). of() keeps the copy while the rows are the same
// (tasks of one head in a row); fresh() always rebuilds it (a scratch buffer refilled). The
// row stride is n padded past a multiple of 16 floats: with n a power of two (2048 keys: 8 KB)
// the kernel's reads down a column all fell in the same L1 sets (measured 3-5 % slower).
// Queries that share one transposed copy of a head, at least: the copy moves Tk D floats,
// the products it serves Tq Tk D FMAs each (a decoding step, Tq 1 over 1024 keys, ran at
// 0.87x SDPA with it, 1.39x without). Up to 16 queries the tile products transpose the
// queries and the result instead (gemm_bcast_rm): a decoding step of 16 queries over 1024
// keys, B1 H12, 0.52-0.54 -> 0.44 ms (interleaved builds); 20-24 queries measured the same
// either way.
constexpr int64_t kTransposeMinRows = 17;

// A scratch vector bigger than this is freed at the end of the call that used it (a thread
// keeps its scratch from call to call: thread_scratch below).
constexpr size_t kKeepBytes = size_t(4) << 20;

template <typename T>
void trim_vector(std::vector<T>& v) {
  if (v.capacity() * sizeof(T) > kKeepBytes) std::vector<T>().swap(v);
}

template <typename T>
struct Transposed {
  const T* src = nullptr;
  int64_t n = 0, ld = 0;
  std::vector<T> buf;
  // at a call's start: the rows at src may hold other values now
  void forget() {
    src = nullptr;
    n = 0;
  }
  void trim() {
    if (buf.capacity() * sizeof(T) > kKeepBytes) {
      forget();
      std::vector<T>().swap(buf);
    }
  }
  const T* fresh(const T* x, int64_t ldx, int64_t rows, int64_t D) {
    src = nullptr;
    return of(x, ldx, rows, D);
  }
  const T* of(const T* x, int64_t ldx, int64_t rows, int64_t D) {
    if constexpr (!std::is_same_v<T, float>) {
      return nullptr;
    } else {
      if (!own_gemm() || x == nullptr || rows <= 0 || D <= 0 || D > 256) return nullptr;
      if (x != src || rows != n) {
        ld = (rows + 15) / 16 * 16 + 16;
        buf.resize(static_cast<size_t>(ld * D));
        transpose_rows(x, ldx, rows, D, buf.data(), ld);
        src = x;
        n = rows;
      }
      return buf.data();
    }
  }
};

// Row-major C[M, N] = alpha op(A) op(B) + beta C, op(A) [M, K], op(B) [K, N]; A is stored
// [M, K] (ta false) or [K, M] (ta true) with leading dimension lda, B likewise. A
// column-major BLAS sees the row-major C as Cᵀ = op(B)ᵀ op(A)ᵀ, hence the swap.
template <typename T>
void gemm_rm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
             int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  // A matrix of one row may come with any row stride (a size-1 dimension's stride is
  // arbitrary, e.g. Tq = 1 after a permute); BLAS wants at least the row length (and
  // otherwise refuses the call and computes nothing).
  auto ld = [](int64_t ld_, int64_t rows, int64_t cols) {
    return std::max<int64_t>(rows == 1 ? std::max(ld_, cols) : ld_, 1);
  };
  lda = ta ? ld(lda, K, M) : ld(lda, M, K);
  ldb = tb ? ld(ldb, N, K) : ld(ldb, K, N);
  ldc = ld(ldc, M, N);
  const char tra = tb ? 'T' : 'N', trb = ta ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  if constexpr (std::is_same_v<T, float>) {
    if (gemv_rm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C)) return;
    if (gemm_bcast_rm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
    if (sgemm_ != nullptr && K > 0) {
      sgemm_(&tra, &trb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
      return;
    }
  } else {
    if (dgemm_ != nullptr && K > 0) {
      dgemm_(&tra, &trb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
      return;
    }
  }
  gemm_loop(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// ---------------------------------------------------------------- row kernels (exp, max)

// CTXFAST_ATTN_CPU_GEMM as the process first read it ("" when unset).
const std::string& gemm_setting() {
  static const std::string v = env_setting("CTXFAST_ATTN_CPU_GEMM");
  return v;
}

// Whether a row of scores holds a NaN (a NaN in q, k, r or the scale). The row maxima skip
// NaN, so a row of NaN scores would look like one that sees no key and give zeros; it gives
// NaN instead, as eager's softmax does, so that a diverging run is seen. Checked only
// where the maximum is -inf.
template <typename T>
bool any_nan(const T* row, int64_t n) {
  for (int64_t c = 0; c < n; ++c)
    if (std::isnan(row[c])) return true;
  return false;
}

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define CTXFAST_ATTN_AVX2 1
#define CTXFAST_AVX2_FN __attribute__((target("avx2,fma")))

bool has_avx2() {
  static const bool ok = [] {
    if (env_setting("CTXFAST_ATTN_CPU_SIMD") == "off") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
}

// exp(x) for 8 floats as 2^t, t = x log2(e) = n + f (n an integer, |f| <= 1/2): 2^f by a
// degree-5 polynomial (relative error 2.2e-7 on [-1/2, 1/2] evaluated in float; the
// degree-6 one it replaced gained nothing over the rounding of f), 2^n in the exponent
// field. f is formed with log2(e) in two parts, so it stays exact to ~1e-7 for any |x| <=
// 100 (relative error ~6e-7 over the softmax's range). For x <= ~0 only: every caller
// passes a score minus its row's max (or log-sum-exp), so there is no clamp above. x is
// clamped below at -100 and n at -127, where the exponent field is 0: exp(x) under
// ~2^-126.5 (x below ~-87.7, -inf included) is exactly 0, so masked entries need no test of
// their own.
CTXFAST_AVX2_FN inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-100.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f =
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.925963033500011e-08f),
                      _mm256_fmsub_ps(x, _mm256_set1_ps(1.44269502162933349609375f), n));
  __m256 p = _mm256_set1_ps(1.326697412878275e-3f);  // near-minimax for 2^f, |f| <= 1/2
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.675459936261177e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550742521882057e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022121727466583e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931469440460205e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000001192092896f));
  const __m256i ni = _mm256_max_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(-127));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

CTXFAST_AVX2_FN inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

CTXFAST_AVX2_FN float row_max_avx2(const float* x, int64_t n) {
  __m256 vm = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + c));
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  float m = _mm_cvtss_f32(s);
  for (; c < n; ++c) m = std::max(m, x[c]);
  return m;
}

// x[c] <- exp(x[c] - m), 0 where x[c] == -inf (or m == inf); returns the row's sum where
// SUM. The tail masked.
template <bool SUM>
CTXFAST_AVX2_FN inline float exp_row_of(float* x, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 s0 = _mm256_setzero_ps();
  int64_t c = 0;
  // one vector a step: two (for overlap) kept exp8's constants and both sums past the 16
  // registers, and one sum went through the stack every step; out-of-order execution
  // overlaps the independent steps anyway
  for (; c + 8 <= n; c += 8) {
    const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + c), vm));
    _mm256_storeu_ps(x + c, e0);
    if constexpr (SUM) s0 = _mm256_add_ps(s0, e0);
  }
  for (; c < n; c += 8) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - c)), lane);
    const __m256 e = _mm256_and_ps(
        exp8(_mm256_sub_ps(_mm256_maskload_ps(x + c, k), vm)), _mm256_castsi256_ps(k));
    _mm256_maskstore_ps(x + c, k, e);
    if constexpr (SUM) s0 = _mm256_add_ps(s0, e);
  }
  return SUM ? hsum8(s0) : 0.0f;
}

CTXFAST_AVX2_FN float exp_row_avx2(float* x, int64_t n, float m) {
  return exp_row_of<true>(x, n, m);
}

// ds[c] <- p[c] * (ds[c] - delta)
CTXFAST_AVX2_FN void ds_row_avx2(const float* p, float* ds, int64_t n, float delta) {
  const __m256 vd = _mm256_set1_ps(delta);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    _mm256_storeu_ps(ds + c, _mm256_mul_ps(_mm256_loadu_ps(p + c),
                                           _mm256_sub_ps(_mm256_loadu_ps(ds + c), vd)));
  for (; c < n; ++c) ds[c] = p[c] * (ds[c] - delta);
}

// Rows [0, nr) of x (ldx apart, D columns) plus the bias rows u and w: xu = x + u, xw = x + w
// (rows D apart).
CTXFAST_AVX2_FN void bias_rows_avx2(const float* x, int64_t ldx, int64_t nr, int64_t D,
                                    const float* u, const float* w, float* xu, float* xw) {
  for (int64_t r = 0; r < nr; ++r) {
    const float* xr = x + r * ldx;
    float* a = xu + r * D;
    float* b = xw + r * D;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
      const __m256 v = _mm256_loadu_ps(xr + d);
      _mm256_storeu_ps(a + d, _mm256_add_ps(v, _mm256_loadu_ps(u + d)));
      _mm256_storeu_ps(b + d, _mm256_add_ps(v, _mm256_loadu_ps(w + d)));
    }
    for (; d < D; ++d) {
      a[d] = xr[d] + u[d];
      b[d] = xr[d] + w[d];
    }
  }
}

// rel_attention's dq rows: o = a + c (rows [0, nr), a and c D apart, o ldo apart), and the
// biases' gradients du += column sums of a, dw += those of c.
CTXFAST_AVX2_FN void dq_rows_avx2(const float* a, const float* c, int64_t nr, int64_t D,
                                  float* o, int64_t ldo, float* du, float* dw) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    __m256 su = _mm256_loadu_ps(du + d), sw = _mm256_loadu_ps(dw + d);
    for (int64_t r = 0; r < nr; ++r) {
      const __m256 x = _mm256_loadu_ps(a + r * D + d), y = _mm256_loadu_ps(c + r * D + d);
      su = _mm256_add_ps(su, x);
      sw = _mm256_add_ps(sw, y);
      _mm256_storeu_ps(o + r * ldo + d, _mm256_add_ps(x, y));
    }
    _mm256_storeu_ps(du + d, su);
    _mm256_storeu_ps(dw + d, sw);
  }
  for (; d < D; ++d)
    for (int64_t r = 0; r < nr; ++r) {
      du[d] += a[r * D + d];
      dw[d] += c[r * D + d];
      o[r * ldo + d] = a[r * D + d] + c[r * D + d];
    }
}

// The forward's online softmax over rows [0, nr) of a score tile s [nr, n] (rows n apart),
// those of query rows m, l (running max and sum) and o (accumulator, rows ldo apart, D
// columns): s <- exp(s - m_new) (0 where -inf), l <- alpha l + rowsum, o <- alpha o with
// alpha = exp(m - m_new); a row that sees nothing yet is zeroed and keeps m, l, o. One call
// a tile: the per-row calls and std::exp cost the 16-key diagonal tiles more than their
// exponentials.
CTXFAST_AVX2_FN void softmax_rows_avx2(float* s, int64_t nr, int64_t n, float* m, float* l,
                                       float* o, int64_t ldo, int64_t D) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < nr; ++r) {
    float* row = s + r * n;
    float m_new = std::max(m[r], row_max_avx2(row, n));
    if (m_new == ninf) {
      if (!any_nan(row, n)) {
        std::fill(row, row + n, 0.0f);
        continue;
      }
      m_new = std::numeric_limits<float>::quiet_NaN();  // NaN scores: NaN out (see any_nan)
    }
    const float alpha =
        m[r] == ninf ? 0.0f : _mm256_cvtss_f32(exp8(_mm256_set1_ps(m[r] - m_new)));
    l[r] = l[r] * alpha + exp_row_avx2(row, n, m_new);
    m[r] = m_new;
    if (alpha != 1.0f) {
      float* orow = o + r * ldo;
      const __m256 va = _mm256_set1_ps(alpha);
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) _mm256_storeu_ps(orow + d, _mm256_mul_ps(va, _mm256_loadu_ps(orow + d)));
      for (; d < D; ++d) orow[d] *= alpha;
    }
  }
}

// The backward's P: s [nr, n] (rows n apart) <- exp(s - lse_r) per row (0 where -inf, and
// for a row that sees no key, lse inf: x - inf = -inf).
CTXFAST_AVX2_FN void exp_rows_avx2(float* s, int64_t nr, int64_t n, const float* lse) {
  for (int64_t r = 0; r < nr; ++r) exp_row_of<false>(s + r * n, n, lse[r]);
}

// The backward's P and dS in one pass over a tile: per row r, p = exp(s - lse_r) (as
// exp_rows_avx2) into s, and ds <- p (ds - delta_r) (as ds_row_avx2); s rows n apart, ds
// rows ldds apart.
CTXFAST_AVX2_FN void p_ds_rows_avx2(float* s, float* ds, int64_t ldds, int64_t nr, int64_t n,
                                    const float* lse, const float* delta) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = 0; r < nr; ++r) {
    float* x = s + r * n;
    float* d = ds + r * ldds;
    const __m256 vl = _mm256_set1_ps(lse[r]), vd = _mm256_set1_ps(delta[r]);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + c), vl));
      _mm256_storeu_ps(x + c, p);
      _mm256_storeu_ps(d + c, _mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(d + c), vd)));
    }
    if (c < n) {
      const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - c)), lane);
      const __m256 p = _mm256_and_ps(
          exp8(_mm256_sub_ps(_mm256_maskload_ps(x + c, k), vl)), _mm256_castsi256_ps(k));
      _mm256_maskstore_ps(x + c, k, p);
      _mm256_maskstore_ps(d + c, k,
                          _mm256_mul_ps(p, _mm256_sub_ps(_mm256_maskload_ps(d + c, k), vd)));
    }
  }
}

// c[j] = alpha a . B[j] (+ c[j] when acc), j < N: B's rows [N, K] ldb apart. Four rows at a
// time (four independent sums), each over K in vectors of 8.
CTXFAST_AVX2_FN void gemv_rows_avx2(int64_t N, int64_t K, float alpha, const float* a,
                                    const float* B, int64_t ldb, bool acc, float* c) {
  int64_t j = 0;
  for (; j + 4 <= N; j += 4) {
    const float* b0 = B + j * ldb;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 x = _mm256_loadu_ps(a + k);
      s0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b0 + k), s0);
      s1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b0 + ldb + k), s1);
      s2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b0 + 2 * ldb + k), s2);
      s3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b0 + 3 * ldb + k), s3);
    }
    float r[4] = {hsum8(s0), hsum8(s1), hsum8(s2), hsum8(s3)};
    for (; k < K; ++k)
      for (int i = 0; i < 4; ++i) r[i] += a[k] * b0[i * ldb + k];
    for (int i = 0; i < 4; ++i) c[j + i] = alpha * r[i] + (acc ? c[j + i] : 0.0f);
  }
  for (; j < N; ++j) {
    const float* bj = B + j * ldb;
    __m256 s = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(bj + k), s);
    float r = hsum8(s);
    for (; k < K; ++k) r += a[k] * bj[k];
    c[j] = alpha * r + (acc ? c[j] : 0.0f);
  }
}

// c[0:N] = alpha sum_k a[k] B[k] (+ c when acc): B's rows [K, N] ldb apart. Columns in
// chunks of 64 held in 8 registers over the whole K loop.
CTXFAST_AVX2_FN void gemv_cols_avx2(int64_t N, int64_t K, float alpha, const float* a,
                                    const float* B, int64_t ldb, bool acc, float* c) {
  int64_t n0 = 0;
  for (; n0 + 64 <= N; n0 += 64) {
    __m256 s[8];
    for (int i = 0; i < 8; ++i) s[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const __m256 x = _mm256_set1_ps(a[k]);
      const float* bk = B + k * ldb + n0;
      for (int i = 0; i < 8; ++i) s[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(bk + 8 * i), s[i]);
    }
    const __m256 al = _mm256_set1_ps(alpha);
    for (int i = 0; i < 8; ++i) {
      __m256 y = _mm256_mul_ps(al, s[i]);
      if (acc) y = _mm256_add_ps(y, _mm256_loadu_ps(c + n0 + 8 * i));
      _mm256_storeu_ps(c + n0 + 8 * i, y);
    }
  }
  for (; n0 + 8 <= N; n0 += 8) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k)
      s = _mm256_fmadd_ps(_mm256_set1_ps(a[k]), _mm256_loadu_ps(B + k * ldb + n0), s);
    __m256 y = _mm256_mul_ps(_mm256_set1_ps(alpha), s);
    if (acc) y = _mm256_add_ps(y, _mm256_loadu_ps(c + n0));
    _mm256_storeu_ps(c + n0, y);
  }
  for (; n0 < N; ++n0) {
    float r = 0.0f;
    for (int64_t k = 0; k < K; ++k) r += a[k] * B[k * ldb + n0];
    c[n0] = alpha * r + (acc ? c[n0] : 0.0f);
  }
}

// C [M, N] = alpha A op(B) + add, all row-major: A [M, K], op(B) [K, N] (B stored [K, N],
// or [N, K] with tb), add [M, N] with its own row stride ldadd (rel_attention passes its
// position band there, whose diagonal walk is a matrix of row stride one less than the
// band's). On the own kernel with a row-major B the addend is read where C is stored, with
// no pass of its own; otherwise a GEMM and then the sum.
template <typename T>
void gemm_add(bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda,
              const T* B, int64_t ldb, const T* add, int64_t ldadd, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if constexpr (std::is_same_v<T, float>) {
    if (!tb && M > 1 && gemm_add_own(M, N, K, alpha, A, lda, B, ldb, add, ldadd, C, ldc))
      return;
  }
  gemm_rm<T>(false, tb, M, N, K, alpha, A, lda, B, ldb, T(0), C, ldc);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] += add[i * ldadd + j];
}

// MKL's one-row path (its generic sgemv, no Zen kernel) ran a decoding step, B8 H12 Tq 1
// Tk 512 D64, at 1.46 ms against SDPA's 0.78 (dev machine, 2 threads); both stream K and V.
bool gemv_rm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
             int64_t lda, const float* B, int64_t ldb, float beta, float* C) {
  (void)lda;  // one row: its stride does not matter
  if (M != 1 || ta || K <= 0 || !(beta == 0.0f || beta == 1.0f) || !has_avx2()) return false;
  if (tb) gemv_rows_avx2(N, K, alpha, A, B, ldb, beta != 0.0f, C);
  else gemv_cols_avx2(N, K, alpha, A, B, ldb, beta != 0.0f, C);
  return true;
}

bool has_avx512();

// bcast_gemm below on the AVX-512 kernel (tile_avx512.h): blocks of avx512::row_block rows
// (at most 12) x 32 columns.
template <bool TA>
CTXFAST_TILE512_FN __attribute__((noinline)) void bcast_gemm512(
    int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
    int64_t ldb, const float* Cin, int64_t ldi, float* C, int64_t ldc) {
  for (int64_t m0 = 0, mr = 0; m0 < M; m0 += mr) {
    mr = avx512::row_block(M, m0);
    const float* a = TA ? A + m0 : A + m0 * lda;
    const float* ci = Cin != nullptr ? Cin + m0 * ldi : nullptr;
    avx512::row_panels<TA>(mr, a, lda, B, ldb, K, alpha, ci, ldi, C + m0 * ldc, ldc, N);
  }
}

// C [M, N] = alpha op(A) B (+ Cin [M, N], rows ldi apart, where not null; Cin == C
// accumulates) on the shared broadcast-A kernel (tile_avx2.h): blocks of avx2::row_block
// rows (which stay in L1 across the panels) x 16 columns; on the AVX-512 kernel where the
// CPU has it (bcast_gemm512).
template <bool TA>
CTXFAST_AVX2_FN void bcast_gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                                int64_t lda, const float* B, int64_t ldb, const float* Cin,
                                int64_t ldi, float* C, int64_t ldc) {
  if (has_avx512()) return bcast_gemm512<TA>(M, N, K, alpha, A, lda, B, ldb, Cin, ldi, C, ldc);
  for (int64_t m0 = 0, mr = 0; m0 < M; m0 += mr) {
    mr = avx2::row_block(M, m0);
    const float* a = TA ? A + m0 : A + m0 * lda;
    const float* ci = Cin != nullptr ? Cin + m0 * ldi : nullptr;
    avx2::row_panels<TA>(mr, a, lda, B, ldb, K, alpha, ci, ldi, C + m0 * ldc, ldc, N);
  }
}

// dst [K, N] (row stride ldd) <- the transpose of src [N, K] (rows ld apart), in 8 x 8
// blocks transposed in registers.
CTXFAST_AVX2_FN void transpose_rows(const float* src, int64_t ld, int64_t N, int64_t K,
                                    float* dst, int64_t ldd) {
  auto row = [&](int64_t n) { return src + n * ld; };
  int64_t n0 = 0;
  for (; n0 + 8 <= N; n0 += 8) {
    const float* x[8];
    for (int i = 0; i < 8; ++i) x[i] = row(n0 + i);
    int64_t k0 = 0;
    for (; k0 + 8 <= K; k0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(x[i] + k0);
      avx2::transpose8x8(r);
      float* d = dst + k0 * ldd + n0;
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(d + c * ldd, r[c]);  // dst row k0 + c
    }
    for (; k0 < K; ++k0)
      for (int64_t i = 0; i < 8; ++i) dst[k0 * ldd + n0 + i] = x[i][k0];
  }
  for (; n0 < N; ++n0) {
    const float* x = row(n0);
    for (int64_t k = 0; k < K; ++k) dst[k * ldd + n0] = x[k];
  }
}

// The own kernels (16 lanes where the CPU has AVX-512, else 8) run the tile products
// except on an Intel CPU with AVX-512: MKL runs 16 lanes there, and an in-place AVX-512
// kernel measured slower than it on such a host (benchmarks/NOTES.md). On an AMD CPU with
// AVX-512 MKL runs 8 lanes (blas_below_cpu, cpu_gemm.h: measured at AVX2 speed there,
// whatever MKL_ENABLE_INSTRUCTIONS says) and the own kernels won, the AVX2 one already.
// CTXFAST_ATTN_CPU_GEMM=blas / own forces either (own needs AVX2 and FMA); the entry points
// refuse any other value, and own on a CPU without them, before any kernel runs
// (check_gemm_setting).
bool own_gemm() {
  static const bool on = [] {
    const std::string& v = gemm_setting();
    if (v == "blas") return false;
    if (v == "own") return has_avx2();
    return has_avx2() && !(has_avx512() && !blas_below_cpu());
  }();
  return on;
}

// Tile products on the shared broadcast-A kernel instead of the BLAS, whose call packs both
// operands every time (~10 % of a short rel_attention backward's cycles went to MKL's
// copies): those with a row-major B ([K, N], op(B) = B: P V, Pᵀ dO, dSᵀ Q, dS K and the
// band's two: N the head dim) read it in place; those with op(B) = Bᵀ (Q Kᵀ, dO Vᵀ of a key
// tile, the band's qw rᵀ: K the head dim) transpose it first into the thread's scratch.
// Returns whether it computed C.

bool gemm_bcast_rm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                   const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                   int64_t ldc) {
  if (!own_gemm() || K <= 0 || N > 4096 || !(beta == 0.0f || beta == 1.0f)) return false;
  const float* cin = beta != 0.0f ? C : nullptr;
  if (tb) {
    if (ta || K > 256 || M < 8) return false;  // a few rows: the transpose would dominate
    if (M <= 16 && M < K && cin == nullptr) {
      // fewer rows than the head dim: Cᵀ [N, M] = B [N, K] Aᵀ, then Cᵀ transposed, moves
      // M K + N M floats where transposing B moves N K
      thread_local std::vector<float> a_t, ct;
      a_t.resize(static_cast<size_t>(K * M));
      ct.resize(static_cast<size_t>(N * M));
      transpose_rows(A, lda, M, K, a_t.data(), M);  // [K, M]
      bcast_gemm<false>(N, M, K, alpha, B, ldb, a_t.data(), M, nullptr, 0, ct.data(), M);
      transpose_rows(ct.data(), M, N, M, C, ldc);  // C [M, N]
      return true;
    }
    thread_local std::vector<float> bt;
    bt.resize(static_cast<size_t>(N * K));
    transpose_rows(B, ldb, N, K, bt.data(), N);
    bcast_gemm<false>(M, N, K, alpha, A, lda, bt.data(), N, cin, ldc, C, ldc);
  } else if (ta) {
    bcast_gemm<true>(M, N, K, alpha, A, lda, B, ldb, cin, ldc, C, ldc);
  } else {
    bcast_gemm<false>(M, N, K, alpha, A, lda, B, ldb, cin, ldc, C, ldc);
  }
  return true;
}

bool gemm_add_own(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                  const float* B, int64_t ldb, const float* add, int64_t ldadd, float* C,
                  int64_t ldc) {
  if (!own_gemm() || K <= 0 || N > 4096) return false;
  bcast_gemm<false>(M, N, K, alpha, A, lda, B, ldb, add, ldadd, C, ldc);
  return true;
}

#define CTXFAST_AVX512_FN __attribute__((target("avx512f")))

bool has_avx512() {
  static const bool ok = [] {
    const std::string v = env_setting("CTXFAST_ATTN_CPU_SIMD");
    if (v == "off" || v == "avx2") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return ok;
}

// exp8 on 16 lanes.
CTXFAST_AVX512_FN inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);  // p * 2^n
}

CTXFAST_AVX512_FN float row_max_avx512(const float* x, int64_t n) {
  __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + c));
  float m = _mm512_reduce_max_ps(vm);
  for (; c < n; ++c) m = std::max(m, x[c]);
  return m;
}

CTXFAST_AVX512_FN float exp_row_avx512(float* x, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vs = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 v = _mm512_loadu_ps(x + c);
    const __mmask16 keep = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_UQ);
    const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(v, vm)));
    _mm512_storeu_ps(x + c, e);
    vs = _mm512_add_ps(vs, e);
  }
  float s = _mm512_reduce_add_ps(vs);
  for (; c < n; ++c) {
    const float e = x[c] == -std::numeric_limits<float>::infinity() ? 0.0f
                                                                     : std::exp(x[c] - m);
    x[c] = e;
    s += e;
  }
  return s;
}
#else
bool has_avx2() { return false; }
bool gemv_rm(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
             const float*, int64_t, float, float*) {
  return false;
}
bool gemm_bcast_rm(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                   const float*, int64_t, float, float*, int64_t) {
  return false;
}
bool own_gemm() { return false; }
bool gemm_add_own(int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                  const float*, int64_t, float*, int64_t) {
  return false;
}
void transpose_rows(const float*, int64_t, int64_t, int64_t, float*, int64_t) {}
#endif

// CTXFAST_ATTN_CPU_GEMM (read once per process): unset or empty (the CPU decides), "blas",
// or "own" (needs AVX2 and FMA). Anything else, or own where the CPU lacks them, is a
// ValueError from every entry point below, before any kernel runs: a forced path is never
// replaced silently.
void check_gemm_setting() {
  TORCH_CHECK_VALUE(tile().bad.empty(), "CTXFAST_ATTN_CPU_TILE must be 'BQ,BK', two positive "
                    "integers (or unset), got '", tile().bad, "'");
  const DebugSetting& d = debug_setting();
  TORCH_CHECK_VALUE(d.bad.empty(), "CTXFAST_ATTN_CPU_DEBUG must be a comma-separated list of "
                    "'poison' and 'reverse' (or unset), got '", d.value, "'");
  static const std::string simd = env_setting("CTXFAST_ATTN_CPU_SIMD");
  TORCH_CHECK_VALUE(simd.empty() || simd == "avx2" || simd == "off",
                    "CTXFAST_ATTN_CPU_SIMD must be 'avx2', 'off' or unset, got '", simd, "'");
  const std::string& v = gemm_setting();
  if (v.empty() || v == "blas") return;
  TORCH_CHECK_VALUE(v == "own", "CTXFAST_ATTN_CPU_GEMM must be 'blas', 'own' or unset, got '",
                    v, "'");
  TORCH_CHECK_VALUE(has_avx2(), "CTXFAST_ATTN_CPU_GEMM=own needs a CPU with AVX2 and FMA, "
                    "which this one lacks (or CTXFAST_ATTN_CPU_SIMD=off turned them off); "
                    "unset it or set 'blas'");
}

template <typename T>
T row_max(const T* x, int64_t n) {
#ifdef CTXFAST_ATTN_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx512()) return row_max_avx512(x, n);
    if (has_avx2()) return row_max_avx2(x, n);
  }
#endif
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t c = 0; c < n; ++c) m = std::max(m, x[c]);
  return m;
}

template <typename T>
T exp_row(T* x, int64_t n, T m) {
#ifdef CTXFAST_ATTN_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx512()) return exp_row_avx512(x, n, m);
    if (has_avx2()) return exp_row_avx2(x, n, m);
  }
#endif
  T s = 0;
  for (int64_t c = 0; c < n; ++c) {
    const T e = x[c] == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(x[c] - m);
    x[c] = e;
    s += e;
  }
  return s;
}

template <typename T>
void ds_row(const T* p, T* ds, int64_t n, T delta) {
#ifdef CTXFAST_ATTN_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (has_avx2()) return ds_row_avx2(p, ds, n, delta);
#endif
  for (int64_t c = 0; c < n; ++c) ds[c] = p[c] * (ds[c] - delta);
}

// softmax_rows_avx2 / exp_rows_avx2 where the CPU has AVX2 (and not AVX-512, whose row
// kernels stay per row), else per row.
template <typename T>
void softmax_rows(T* s, int64_t nr, int64_t n, T* m, T* l, T* o, int64_t ldo, int64_t D) {
#ifdef CTXFAST_ATTN_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (has_avx2() && !has_avx512()) return softmax_rows_avx2(s, nr, n, m, l, o, ldo, D);
#endif
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < nr; ++r) {
    T* row = s + r * n;
    T m_new = std::max(m[r], row_max(row, n));
    if (m_new == ninf) {  // nothing visible yet: p = 0, acc stays 0
      if (!any_nan(row, n)) {
        std::fill(row, row + n, T(0));
        continue;
      }
      m_new = std::numeric_limits<T>::quiet_NaN();  // NaN scores: NaN out (see any_nan)
    }
    const T alpha = m[r] == ninf ? T(0) : std::exp(m[r] - m_new);
    l[r] = l[r] * alpha + exp_row(row, n, m_new);
    m[r] = m_new;
    if (alpha != T(1)) {
      T* orow = o + r * ldo;
      for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
    }
  }
}

template <typename T>
void exp_rows(T* s, int64_t nr, int64_t n, const T* lse) {
#ifdef CTXFAST_ATTN_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (has_avx2() && !has_avx512()) return exp_rows_avx2(s, nr, n, lse);
#endif
  for (int64_t r = 0; r < nr; ++r) {
    T* row = s + r * n;
    if (lse[r] == std::numeric_limits<T>::infinity()) std::fill(row, row + n, T(0));
    else exp_row(row, n, lse[r]);
  }
}

// s [nr, n] <- P = exp(s - lse) per row, then ds [nr, n] (rows ldds apart) <- P (ds - delta):
// one pass with AVX2 (as exp_rows), else exp_rows and ds_row.
template <typename T>
void p_ds_rows(T* s, T* ds, int64_t ldds, int64_t nr, int64_t n, const T* lse, const T* delta) {
#ifdef CTXFAST_ATTN_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (has_avx2() && !has_avx512()) return p_ds_rows_avx2(s, ds, ldds, nr, n, lse, delta);
#endif
  exp_rows(s, nr, n, lse);
  for (int64_t r = 0; r < nr; ++r) ds_row(s + r * n, ds + r * ldds, n, delta[r]);
}

// ---------------------------------------------------------------- dropout (Philox)

// Philox-4x32-10 as Triton's tl.rand runs it: counter (offset_lo, offset_hi, 0, 0), key
// (seed_lo, seed_hi); the first output word becomes a float in [0, 1) by
// (x < 0 ? ~x : x) * 4.6566127342e-10f with x the word read as int32.
constexpr uint32_t kPhiloxRoundA = 0xD2511F53u, kPhiloxRoundB = 0xCD9E8D57u;
constexpr uint32_t kPhiloxKeyA = 0x9E3779B9u, kPhiloxKeyB = 0xBB67AE85u;
constexpr float kUniformScale = 4.6566127342e-10f;

// The four output words of counter (counter_lo, counter_hi, 0, 0) under key (seed_lo,
// seed_hi).
inline void philox4(uint64_t seed, uint64_t counter, uint32_t out[4]) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t pb = static_cast<uint64_t>(kPhiloxRoundB) * c2;
    const uint64_t pa = static_cast<uint64_t>(kPhiloxRoundA) * c0;
    c0 = static_cast<uint32_t>(pb >> 32) ^ c1 ^ k0;
    c2 = static_cast<uint32_t>(pa >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(pb);
    c3 = static_cast<uint32_t>(pa);
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// A word as a float in [0, 1), as tl.rand converts it.
inline float word_uniform(uint32_t word) {
  int32_t x = static_cast<int32_t>(word);
  if (x < 0) x = ~x;
  return static_cast<float>(x) * kUniformScale;
}

inline float philox_uniform(uint64_t seed, uint64_t offset) {
  uint32_t w[4];
  philox4(seed, offset, w);
  return word_uniform(w[0]);
}

#ifdef CTXFAST_ATTN_AVX2
// High 32 bits of a * b for 8 unsigned lanes, b a broadcast constant.
CTXFAST_AVX2_FN inline __m256i mulhi_epu32(__m256i a, __m256i b) {
  const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(a, b), 32);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), _mm256_srli_epi64(b, 32));
  return _mm256_blend_epi32(even, odd, 0xAA);
}

// The ten rounds on 8 counters at once (c0..c3 in: the counters; out: the words).
CTXFAST_AVX2_FN inline void philox_rounds_avx2(uint64_t seed, __m256i& c0, __m256i& c1,
                                               __m256i& c2, __m256i& c3) {
  const __m256i ra = _mm256_set1_epi32(static_cast<int>(kPhiloxRoundA));
  const __m256i rb = _mm256_set1_epi32(static_cast<int>(kPhiloxRoundB));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m256i hb = mulhi_epu32(c2, rb), ha = mulhi_epu32(c0, ra);
    const __m256i lb = _mm256_mullo_epi32(c2, rb), la = _mm256_mullo_epi32(c0, ra);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hb, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c2 = _mm256_xor_si256(_mm256_xor_si256(ha, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c1 = lb;
    c3 = la;
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
}

// 8 words as floats in [0, 1) (word_uniform).
CTXFAST_AVX2_FN inline __m256 words_uniform_avx2(__m256i w) {
  const __m256i x = _mm256_xor_si256(w, _mm256_srai_epi32(w, 31));  // x < 0 ? ~x : x
  return _mm256_mul_ps(_mm256_cvtepi32_ps(x), _mm256_set1_ps(kUniformScale));
}

// f[c] = keep(offset + c) ? scale_kept : 0 for c < n (8 counters per step).
CTXFAST_AVX2_FN void keep_factors_avx2(uint64_t seed, uint64_t offset, int64_t n, float p,
                                       float scale_kept, float* f) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 vp = _mm256_set1_ps(p), vs = _mm256_set1_ps(scale_kept);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const uint64_t o = offset + static_cast<uint64_t>(c);
    const uint32_t lo = static_cast<uint32_t>(o);
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo)), lane);
    // the high word: + 1 in the lanes where the low word wrapped around
    const __m256i wrapped = _mm256_cmpgt_epi32(
        _mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(lo)), _mm256_set1_epi32(INT32_MIN)),
        _mm256_xor_si256(c0, _mm256_set1_epi32(INT32_MIN)));
    __m256i c1 = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(o >> 32)), wrapped);
    __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
    philox_rounds_avx2(seed, c0, c1, c2, c3);
    const __m256 u = words_uniform_avx2(c0);
    _mm256_storeu_ps(f + c, _mm256_and_ps(vs, _mm256_cmp_ps(u, vp, _CMP_GE_OQ)));
  }
  for (; c < n; ++c)
    f[c] = philox_uniform(seed, offset + static_cast<uint64_t>(c)) >= p ? scale_kept : 0.0f;
}
#endif

// f[c] = keep(offset + c) ? 1 / (1 - p) : 0 for c < n.
template <typename T>
void keep_factors(uint64_t seed, uint64_t offset, int64_t n, double p, T* f) {
  const float pf = static_cast<float>(p);  // the kernels compare in float32
  const T kept = static_cast<T>(1.0 / (1.0 - p));
#ifdef CTXFAST_ATTN_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2()) return keep_factors_avx2(seed, offset, n, pf, kept, f);
  }
#endif
  for (int64_t c = 0; c < n; ++c)
    f[c] = philox_uniform(seed, offset + static_cast<uint64_t>(c)) >= pf ? kept : T(0);
}

// ---------------------------------------------------------------- one (sequence, head)

template <typename T>
struct Head {
  const T* q;  int64_t ldq;   // [Tq, D], row stride ldq
  const T* k;  int64_t ldk;   // [Tk, D]
  const T* v;  int64_t ldv;   // [Tk, D]
  T* o;        int64_t ldo;   // out [Tq, D] (forward: written; backward: read)
  T* lse;                     // [Tq], unit stride
  const T* dout; int64_t lddo;  // backward: grad of out [Tq, D]
  const T* delta;             // backward: [Tq] rowsum(dout o), or nullptr (from dout and o)
  T* dq; int64_t lddq;        // backward outputs: dq written, dk and dv zeroed by the task
  T* dk; int64_t lddk;        // then accumulated
  T* dv; int64_t lddv;
  int64_t Tq, Tk, mem, D;
  const bool* kpm;            // [Tk] or nullptr (true = padding)
  int64_t kpm_end;            // keys from kpm_end on are all padding (Tk without kpm)
  const int64_t* rank;        // [Tq] or nullptr
  bool rank_sorted;           // rank is non-decreasing (queries and keys in rank order)
  bool causal, strict;
  int64_t window;             // > 0: pair (i, j) visible only if mem + i - j < window
  // rel_attention only (r == nullptr otherwise): the score is scale (q_i + u) . k_j plus
  // the position term scale qw_i . r[row], qw_i = q_i + w, row = pos_start - (mem + i - j),
  // of r [R, D]. The biased rows are formed per query block (query_rows), never stored whole.
  const T* r; int64_t ldr; int64_t R; int64_t pos_start;
  // transposed copies (Transposed above) or nullptr: kt, vt [D, Tk] row stride ldkt, rt
  // [D, R] row stride ldrt (keys and rows of r as columns)
  const T* kt; const T* vt; int64_t ldkt;
  const T* rt; int64_t ldrt;
  const T* u; const T* w;     // r_w_bias, r_r_bias of this head [D]
  T* du; T* dw;               // backward: their gradients [D] (accumulated; zero on entry)
  T* dr;                      // backward: grad of r [R, D], row stride D (zeroed by the task
  bool dr_zero;               // unless dr_zero is false: then accumulated into)
  // segments (segq == nullptr: none): the score adds ef[2 i + (segq[i] != segk[j])]
  const int64_t* segq;        // [Tq]
  const int64_t* segk;        // [Tk]
  const T* ef;                // [Tq, 2]: scale (q_i + r_s_bias)·seg_embed[s]
  T* def;                     // backward: [Tq, 2], sum over j of dS_ij by s (accumulated)
  // dropout (p_drop == 0: none): Philox counter (bh Tq_all + i) Tk_all + j
  double p_drop;
  uint64_t seed;
  int64_t bh, Tq_all, Tk_all;
};

// Permutation ranks of queries [i0, i0 + bq): (min, max).
template <typename T>
std::pair<int64_t, int64_t> query_rank_bounds(const Head<T>& h, int64_t i0, int64_t bq) {
  const auto mm = std::minmax_element(h.rank + i0, h.rank + i0 + bq);
  return {*mm.first, *mm.second};
}

// Whether a key of permutation rank rj is visible to a query of rank ri.
template <typename T>
inline bool rank_sees(const Head<T>& h, int64_t rj, int64_t ri) {
  return h.strict ? rj < ri : rj <= ri;
}

// Set to -inf the entries of tile s [bq, bk] (row stride bk; rows i0.., keys j0..) that
// the masks hide.
template <typename T>
void mask_tile(const Head<T>& h, int64_t i0, int64_t bq, int64_t j0, int64_t bk, T* s) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const bool causal_cut = h.causal && j0 + bk - 1 > i0 + h.mem;  // some row is cut
  const bool window_cut = h.window > 0 && h.mem + i0 + bq - 1 - j0 >= h.window;
  const bool* kpm = nullptr;  // only where this tile has a padding key
  if (h.kpm != nullptr && std::any_of(h.kpm + j0, h.kpm + j0 + bk, [](bool x) { return x; }))
    kpm = h.kpm;
  // permutation: only where some current key of the tile ranks above the block's lowest
  // query (with rank-sorted queries and keys, the tiles on the diagonal)
  bool rank_cut = false;
  if (h.rank != nullptr && j0 + bk > h.mem) {
    const int64_t t0 = std::max<int64_t>(j0 - h.mem, 0), t1 = j0 + bk - h.mem;
    const int64_t kmax = *std::max_element(h.rank + t0, h.rank + t1);
    rank_cut = !rank_sees(h, kmax, query_rank_bounds(h, i0, bq).first);
  }
  if (!causal_cut && !window_cut && kpm == nullptr && !rank_cut) return;
  for (int64_t r = 0; r < bq; ++r) {
    const int64_t i = i0 + r;
    T* row = s + r * bk;
    if (causal_cut) {
      for (int64_t c = std::max<int64_t>(i + h.mem - j0 + 1, 0); c < bk; ++c) row[c] = ninf;
    }
    if (window_cut) {  // keys j <= mem + i - window are too far
      const int64_t lim = std::min<int64_t>(h.mem + i - h.window - j0 + 1, bk);
      for (int64_t c = 0; c < lim; ++c) row[c] = ninf;
    }
    if (kpm != nullptr) {
      for (int64_t c = 0; c < bk; ++c)
        if (kpm[j0 + c]) row[c] = ninf;
    }
    if (rank_cut && h.rank_sorted) {  // the hidden keys are a suffix of the tile
      const int64_t ri = h.rank[i];
      const int64_t c0 = std::max<int64_t>(h.mem - j0, 0);
      for (int64_t c = bk - 1; c >= c0 && !rank_sees(h, h.rank[j0 + c - h.mem], ri); --c)
        row[c] = ninf;
    } else if (rank_cut) {
      const int64_t ri = h.rank[i];
      for (int64_t c = std::max<int64_t>(h.mem - j0, 0); c < bk; ++c)
        if (!rank_sees(h, h.rank[j0 + c - h.mem], ri)) row[c] = ninf;
    }
  }
}

// Keys [0, end) that queries [i0, i0 + bq) may see: causal cuts at the diagonal, padding
// after the last unpadded key, a permutation after the last current key that ranks low
// enough for the block's highest query (all of them for random ranks; half on average
// for rank-sorted ones).
template <typename T>
int64_t key_end(const Head<T>& h, int64_t i0, int64_t bq) {
  int64_t end = h.kpm_end;
  if (h.causal) end = std::min(end, std::max<int64_t>(i0 + bq + h.mem, 0));
  if (h.rank != nullptr) {
    const int64_t qmax = query_rank_bounds(h, i0, bq).second;
    int64_t t = h.Tq;
    while (t > 0 && !rank_sees(h, h.rank[t - 1], qmax)) --t;
    end = std::min(end, h.mem + t);
  }
  return end;
}

// Per row b of key_padding_mask [B, Tk]: one past its last non-padding key (trailing
// padding, BERT's usual layout, is then skipped block by block instead of masked).
std::vector<int64_t> padding_ends(const bool* kpm, int64_t B, int64_t Tk) {
  std::vector<int64_t> ends(B, Tk);
  if (kpm == nullptr) return ends;
  for (int64_t b = 0; b < B; ++b) {
    int64_t e = Tk;
    while (e > 0 && kpm[b * Tk + e - 1]) --e;
    ends[b] = e;
  }
  return ends;
}

// Per row b of perm_rank [B, Tq]: whether its ranks are non-decreasing.
std::vector<bool> ranks_sorted(const int64_t* rank, int64_t B, int64_t Tq) {
  std::vector<bool> out(B, false);
  for (int64_t b = 0; rank != nullptr && b < B; ++b)
    out[b] = std::is_sorted(rank + b * Tq, rank + (b + 1) * Tq);
  return out;
}

// First key that queries [i0, ...) may see (the window cuts the far ones).
template <typename T>
int64_t key_begin(const Head<T>& h, int64_t i0) {
  if (h.window <= 0) return 0;
  return std::min(h.Tk, std::max<int64_t>(h.mem + i0 - h.window + 1, 0));
}

// The query operands of rows [i0, i0 + bq): q itself for attention; for rel_attention
// qu = q + u (content term) and qw = q + w (position term), formed in buf [2 bq D].
template <typename T>
struct QRows {
  const T* q;  int64_t ldq;   // [bq, D]: the rows that meet k
  const T* qw; int64_t ldqw;  // [bq, D]: the rows that meet r (rel_attention only)
};

template <typename T>
QRows<T> query_rows(const Head<T>& h, int64_t i0, int64_t bq, T* buf) {
  const T* q = h.q + i0 * h.ldq;
  if (h.u == nullptr) return {q, h.ldq, nullptr, 0};
  const int64_t D = h.D;
  T* qu = buf;
  T* qw = buf + bq * D;
#ifdef CTXFAST_ATTN_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2()) {
      bias_rows_avx2(q, h.ldq, bq, D, h.u, h.w, qu, qw);
      return {qu, D, qw, D};
    }
  }
#endif
  for (int64_t rr = 0; rr < bq; ++rr) {
    const T* x = q + rr * h.ldq;
    for (int64_t d = 0; d < D; ++d) {
      qu[rr * D + d] = x[d] + h.u[d];
      qw[rr * D + d] = x[d] + h.w[d];
    }
  }
  return {qu, D, qw, D};
}

// How many leading columns of the position band of queries [i0, i0 + bq) from key jb (ng
// columns, layout below) the visible pairs read: row rr reads columns (bq - 1 - rr) + (j - jb)
// for its keys j, and with causal its last key is mem + i0 + rr, so every row ends at
// column bq + mem + i0 - jb - 1; the last bq - 1 columns serve only hidden pairs.
template <typename T>
int64_t band_needed(const Head<T>& h, int64_t i0, int64_t bq, int64_t jb, int64_t ng) {
  if (!h.causal) return ng;
  return std::min<int64_t>(std::max<int64_t>(bq + h.mem + i0 - jb, 0), ng);
}

// Calls f(first row, end row, first column) for the GEMMs of a chunk of a position band
// (layout below) from column c0 on. Row rr reads from column bq - 1 - rr on, so while c0 is
// below bq - bq / 2 the chunk runs on two row halves, the first from column bq - bq / 2 (a
// quarter of the bq x bq triangle that no row reads is not computed); past it, one GEMM
// over every row.
template <typename F>
void for_each_band_part(int64_t bq, int64_t c0, F&& f) {
  const int64_t half = bq >= 64 ? bq / 2 : 0;  // halves of fewer rows: slower GEMMs
  if (half > 0 && c0 < bq - half) {
    f(int64_t(0), half, bq - half);
    f(half, bq, c0);
  } else {
    f(int64_t(0), bq, c0);
  }
}

// rel_attention's position term for queries [i0, i0 + bq) against keys [jb, je):
// s[rr, c] += scale qw_{i0+rr} . r[row], row = pos_start - mem - (i0 + rr) + (j0 + c). The
// rows one query block needs form a band of ng = bq + (je - jb) - 1 consecutive rows of r
// starting at base = pos_start - mem - (i0 + bq - 1) + jb, so GEMMs give
// g[rr, t] = scale qw_{i0+rr} . r[base + t], and the entry of key j0 + c is
// g[rr, (bq - 1 - rr) + (j0 - jb) + c] (a diagonal walk; no [Tq, Tk] term is stored). Rows
// of r outside [0, R) only serve pairs that are never visible (rel_attention's check):
// they count as 0, as do the columns past band_needed() (only hidden pairs read them).
//
// g is formed in column chunks as the key tiles reach them (band_extend), and in the
// backward dg (same layout; each key tile computes its dS in place there) is consumed in
// chunks as soon as no later tile writes them (band_flush). Both live in windows of W
// columns (rows W apart) that slide along the band (band_slide_*): a long block's band (64 x
// 2 k columns at 1 k queries over 1 k memory: 540 KB) is never held whole, what the tiles
// touch stays in cache and in few pages, and the band's products have the tile products'
// shapes. Key tile [j0, j0 + bk), rows r0.., reads columns [j0 - jb, (bq - 1 - r0) + (j0 -
// jb) + bk); row rr of it only from (bq - 1 - rr) + (j0 - jb) on; columns below
// j0 + bk - jb are final after it.
template <typename T>
struct Band {
  int64_t ng = 0, base = 0;
  int64_t lo = 0, hi = 0;  // the columns that meet a row of r in range and are needed
  int64_t W = 0;           // the windows' width and row stride
  int64_t g0 = 0;          // g's window: column g0 at its column 0, columns [g0, done) formed
  int64_t done = 0;
  int64_t d0 = 0;          // dg's window: column d0 at its column 0
  int64_t flushed = 0;     // columns [0, flushed) of dg consumed
  int64_t dend = 0;        // columns [0, dend) of dg written by some tile
};

// The window is whole (W = ng: no slide) for up to two key tiles past the first.
template <typename T>
Band<T> band_of(const Head<T>& h, int64_t i0, int64_t bq, int64_t jb, int64_t je) {
  Band<T> b;
  b.ng = bq + (je - jb) - 1;
  b.base = h.pos_start - h.mem - (i0 + bq - 1) + jb;
  b.lo = std::max<int64_t>(-b.base, 0);
  b.hi = std::min<int64_t>(band_needed(h, i0, bq, jb, b.ng), h.R - b.base);
  b.hi = std::max(b.hi, b.lo);
  b.W = std::min<int64_t>(b.ng, bq + 2 * kBlockK);
  return b;
}

// Before a key tile that reads g's columns [c_lo, c_hi): where they pass the window, it
// restarts at c_lo, keeping what the rows still read (row rr: from c_lo + bq - 1 - rr on).
template <typename T>
void band_slide_g(Band<T>& b, int64_t bq, int64_t c_lo, int64_t c_hi, T* g) {
  if (std::min(c_hi, b.ng) - b.g0 <= b.W) return;
  for (int64_t rr = 0; rr < bq; ++rr) {
    const int64_t from = c_lo + (bq - 1 - rr);
    T* row = g + rr * b.W;
    if (from < b.done)
      std::memmove(row + (from - c_lo), row + (from - b.g0), sizeof(T) * (b.done - from));
  }
  b.g0 = c_lo;
}

// g columns [b.done, upto): from the GEMMs where they meet r (less what a half's rows
// never read, for_each_band_part), 0 elsewhere.
template <typename T>
void band_extend(const Head<T>& h, const QRows<T>& qr, int64_t bq, Band<T>& b, int64_t upto,
                 T scale, T* g) {
  upto = std::min(upto, b.ng);
  if (upto <= b.done) return;
  const int64_t c0 = b.done, z0 = std::min(b.lo, upto), z1 = std::max(b.hi, c0);
  for (int64_t rr = 0; rr < bq; ++rr) {
    if (c0 < z0) std::fill(g + rr * b.W + (c0 - b.g0), g + rr * b.W + (z0 - b.g0), T(0));
    if (z1 < upto) std::fill(g + rr * b.W + (z1 - b.g0), g + rr * b.W + (upto - b.g0), T(0));
  }
  const int64_t e = std::min(upto, b.hi);
  for_each_band_part(bq, std::max(c0, b.lo), [&](int64_t r0, int64_t r1, int64_t cs) {
    const int64_t a = std::max(cs, std::max(c0, b.lo));
    if (a >= e) return;
    T* out = g + r0 * b.W + (a - b.g0);
    if (h.rt != nullptr)
      gemm_rm<T>(false, false, r1 - r0, e - a, h.D, scale, qr.qw + r0 * qr.ldqw, qr.ldqw,
                 h.rt + b.base + a, h.ldrt, T(0), out, b.W);
    else
      gemm_rm<T>(false, true, r1 - r0, e - a, h.D, scale, qr.qw + r0 * qr.ldqw, qr.ldqw,
                 h.r + (b.base + a) * h.ldr, h.ldr, T(0), out, b.W);
  });
  b.done = upto;
}

// The band's backward for dg columns [b.flushed, upto) (complete: every key tile that
// writes them is done): dqw [bq, D] += scale dg r_band, dr_band += scale dgᵀ qw. Columns
// that no tile wrote (past dend) are 0 in every row and skipped.
template <typename T>
void band_flush(const Head<T>& h, const QRows<T>& qr, int64_t bq, Band<T>& b, int64_t upto,
                T scale, const T* dg, T* dqw) {
  upto = std::min(upto, b.ng);
  if (upto <= b.flushed) return;
  const int64_t c0 = std::max(b.flushed, b.lo), e = std::min({upto, b.hi, b.dend});
  for_each_band_part(bq, c0, [&](int64_t r0, int64_t r1, int64_t cs) {
    const int64_t a = std::max(cs, c0);
    if (a >= e) return;
    const T* dgh = dg + r0 * b.W + (a - b.d0);  // rows [r0, r1), columns [a, e)
    gemm_rm<T>(false, false, r1 - r0, h.D, e - a, scale, dgh, b.W, h.r + (b.base + a) * h.ldr,
               h.ldr, T(1), dqw + r0 * h.D, h.D);
    gemm_rm<T>(true, false, e - a, h.D, r1 - r0, scale, dgh, b.W, qr.qw + r0 * qr.ldqw,
               qr.ldqw, T(1), h.dr + (b.base + a) * h.D, h.D);
  });
  b.flushed = upto;
}

// Before a key tile that writes dg's columns [c_lo, c_hi): where they pass the window, the
// final columns before c_lo are flushed and the window restarts at c_lo, keeping what the
// rows hold there (row rr: c_lo up to c_lo + bq - 1 - rr, written by the earlier tiles or
// the block's leading 0s).
template <typename T>
void band_slide_dg(const Head<T>& h, const QRows<T>& qr, int64_t bq, Band<T>& b, int64_t c_lo,
                   int64_t c_hi, T scale, T* dg, T* dqw) {
  if (std::min(c_hi, b.ng) - b.d0 <= b.W) return;
  band_flush(h, qr, bq, b, c_lo, scale, dg, dqw);
  for (int64_t rr = 0; rr < bq; ++rr) {
    T* row = dg + rr * b.W;
    std::memmove(row, row + (c_lo - b.d0), sizeof(T) * (bq - 1 - rr));
  }
  b.d0 = c_lo;
}

// s [bq - r0, bk] (row stride bk) <- the masked scores of queries [i0 + r0, i0 + bq) (rows
// r0.. of the query block [i0, i0 + bq)) against keys [j0, j0 + bk): scale q kᵀ, plus for
// rel_attention the position term gt [bq - r0, bk] (rows ldgt apart; added by the product
// itself where it can).
template <typename T>
void scores_tile(const Head<T>& h, const QRows<T>& qr, int64_t i0, int64_t bq, int64_t r0,
                 int64_t j0, int64_t bk, T scale, const T* gt, int64_t ldgt, T* s) {
  const T* q = qr.q + r0 * qr.ldq;
  if (gt != nullptr) {
    if (h.kt != nullptr)
      gemm_add<T>(false, bq - r0, bk, h.D, scale, q, qr.ldq, h.kt + j0, h.ldkt, gt, ldgt, s, bk);
    else
      gemm_add<T>(true, bq - r0, bk, h.D, scale, q, qr.ldq, h.k + j0 * h.ldk, h.ldk, gt, ldgt, s,
                  bk);
  } else if (h.kt != nullptr) {
    gemm_rm<T>(false, false, bq - r0, bk, h.D, scale, q, qr.ldq, h.kt + j0, h.ldkt, T(0), s, bk);
  } else {
    gemm_rm<T>(false, true, bq - r0, bk, h.D, scale, q, qr.ldq, h.k + j0 * h.ldk, h.ldk, T(0), s,
               bk);
  }
  // A NaN scale gives NaN scores, as eager's (q·k)·scale: the products take the scale as
  // their alpha, and a BLAS product with alpha NaN came out as alpha 1 here
  if (scale != scale) std::fill(s, s + (bq - r0) * bk, scale);
  if (h.segq != nullptr) {
    for (int64_t rr = r0; rr < bq; ++rr) {
      const int64_t i = i0 + rr, sq = h.segq[i];
      const T same = h.ef[2 * i], other = h.ef[2 * i + 1];
      const int64_t* sk = h.segk + j0;
      T* row = s + (rr - r0) * bk;
      for (int64_t c = 0; c < bk; ++c) row[c] += sk[c] == sq ? same : other;
    }
  }
  mask_tile(h, i0 + r0, bq - r0, j0, bk, s);
}

// Current keys that query row i of a rank-sorted head sees: [0, n) (ranks non-decreasing,
// so n is non-decreasing in i).
template <typename T>
int64_t rank_seen(const Head<T>& h, int64_t i) {
  const int64_t* r = h.rank;
  return (h.strict ? std::lower_bound(r, r + h.Tq, r[i]) : std::upper_bound(r, r + h.Tq, r[i])) -
         r;
}

// First row rr of query block [i0, i0 + bq) of a rank-sorted head that sees current key t.
template <typename T>
int64_t first_row_seeing(const Head<T>& h, int64_t i0, int64_t bq, int64_t t) {
  const int64_t *r = h.rank + i0, rk = h.rank[t];
  return (h.strict ? std::upper_bound(r, r + bq, rk) : std::lower_bound(r, r + bq, rk)) - r;
}

// Calls f(j0, bk, r0) for the key tiles of query block [i0, i0 + bq) over keys [jb, end):
// tiles of kBlockK keys up to the diagonal (the keys every row of the block sees), then
// tiles of kDiagK keys, each for rows r0.. only, r0 the first row that sees one of its keys:
// about half the hidden pairs of the diagonal tile are not computed. The diagonal is that of
// causal (row rr sees keys up to mem + i0 + rr) or of rank-sorted permutation ranks (the
// rank order's causal-like mask: row i sees the current keys [0, rank_seen(i))).
template <typename T, typename F>
void for_each_key_tile(const Head<T>& h, int64_t i0, int64_t bq, int64_t jb, int64_t end,
                       F&& f) {
  const bool ranked = h.rank != nullptr && h.rank_sorted;
  // (a block of at most kDiagK rows gains nothing from the split)
  int64_t diag = end;
  if (bq > kDiagK && (h.causal || ranked)) {
    if (h.causal) diag = std::min(diag, h.mem + i0);
    if (ranked) diag = std::min(diag, h.mem + rank_seen(h, i0));
    diag = std::min(std::max(diag, jb), end);
  }
  for (int64_t j0 = jb; j0 < diag; j0 += kBlockK) f(j0, std::min(kBlockK, diag - j0), int64_t(0));
  for (int64_t j0 = diag; j0 < end; j0 += kDiagK) {
    int64_t r0 = 0;
    if (h.causal) r0 = std::max<int64_t>(j0 - h.mem - i0, 0);
    if (ranked && j0 >= h.mem) r0 = std::max(r0, first_row_seeing(h, i0, bq, j0 - h.mem));
    f(j0, std::min(kDiagK, end - j0), std::min(r0, bq - 1));
  }
}

// f [bq, bk] (row stride bk) <- the dropout factors of the tile: 1 / (1 - p) where kept,
// else 0.
template <typename T>
void dropout_tile(const Head<T>& h, int64_t i0, int64_t bq, int64_t j0, int64_t bk, T* f) {
  for (int64_t rr = 0; rr < bq; ++rr) {
    const uint64_t offset = static_cast<uint64_t>((h.bh * h.Tq_all + i0 + rr) * h.Tk_all + j0);
    keep_factors(h.seed, offset, bk, h.p_drop, f + rr * bk);
  }
}

// Forward of queries [i0, i0 + bq), bq = min(block, Tq - i0) with block <= kBlockQ: out
// rows and lse. `s` holds kBlockQ * kBlockK, m and l kBlockQ, qbuf 2 kBlockQ D.
template <typename T>
void forward_tile(const Head<T>& h, int64_t i0, int64_t block, T scale, T* s, T* m, T* l,
                  std::vector<T>& band, T* f, T* qbuf) {
  const int64_t bq = std::min(block, h.Tq - i0), D = h.D;
  const T ninf = -std::numeric_limits<T>::infinity();
  T* o = h.o + i0 * h.ldo;
  for (int64_t r = 0; r < bq; ++r) {
    m[r] = ninf;
    l[r] = 0;
    std::fill(o + r * h.ldo, o + r * h.ldo + D, T(0));
  }
  const int64_t end = key_end(h, i0, bq), jb = key_begin(h, i0);
  const QRows<T> qr = end > jb ? query_rows(h, i0, bq, qbuf) : QRows<T>{};
  Band<T> pb;
  if (h.r != nullptr && end > jb) {
    pb = band_of(h, i0, bq, jb, end);
    band.resize(static_cast<size_t>(bq * pb.W));
  }
  for_each_key_tile(h, i0, bq, jb, end, [&](int64_t j0, int64_t bk, int64_t r0) {
    // rows r0.. of the block (the others see none of these keys): s row r - r0
    const T* gt = nullptr;
    if (h.r != nullptr) {
      const int64_t c_lo = j0 - jb, c_hi = (bq - 1 - r0) + c_lo + bk;
      band_slide_g(pb, bq, c_lo, c_hi, band.data());
      // formed as far as the window reaches (c_hi at least), not just this tile's columns:
      // the diagonal's 16-key tiles made 16-column GEMMs (T 128: 15.8 -> 19.3 FMAs per
      // cycle over the band's products, per-call-site counts)
      band_extend(h, qr, bq, pb, pb.g0 + pb.W, scale, band.data());
      // row rr's entries g[rr, (bq - 1 - rr) + c_lo + c]: a matrix of row stride W - 1
      gt = band.data() + (bq - 1) + (c_lo - pb.g0) + r0 * (pb.W - 1);
    }
    scores_tile(h, qr, i0, bq, r0, j0, bk, scale, gt, pb.W - 1, s);
    softmax_rows(s, bq - r0, bk, m + r0, l + r0, o + r0 * h.ldo, h.ldo, D);
    if (h.p_drop > 0) {  // after the normaliser: P <- P keep / (1 - p)
      dropout_tile(h, i0 + r0, bq - r0, j0, bk, f);
      for (int64_t c = 0; c < (bq - r0) * bk; ++c) s[c] *= f[c];
    }
    gemm_rm<T>(false, false, bq - r0, D, bk, T(1), s, bk, h.v + j0 * h.ldv, h.ldv, T(1),
               o + r0 * h.ldo, h.ldo);
  });
  for (int64_t r = 0; r < bq; ++r) {
    T* orow = o + r * h.ldo;
    // l = 0: the row saw no key (zeros, lse +inf); NaN (a NaN in q, k, r or the scale)
    // goes on into out and lse, as eager's softmax takes it, and so into the gradients
    if (l[r] != 0) {
      const T inv = T(1) / l[r];
      for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
      h.lse[i0 + r] = m[r] + std::log(l[r]);
    } else {
      std::fill(orow, orow + D, T(0));
      h.lse[i0 + r] = std::numeric_limits<T>::infinity();
    }
  }
}

// Delta_i = dO_i . O_i, the backward's row term (both rows [D], unit stride).
template <typename T>
T row_dot(const T* dout, const T* o, int64_t D) {
#ifdef CTXFAST_ATTN_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2()) {  // a one-row product (a scalar sum ran one addition at a time: ~1.5 %
      float acc;       // of a short rel_attention backward went to Delta)
      gemv_rows_avx2(1, D, 1.0f, dout, o, D, false, &acc);
      return acc;
    }
  }
#endif
  T acc = 0;
  for (int64_t d = 0; d < D; ++d) acc += dout[d] * o[d];
  return acc;
}

// A thread's scratch of type S (FwdScratch, BwdScratch), kept from call to call: built per
// call, its vectors cost a zero fill of ~0.4 MB a thread (a rel_attention backward at T 128)
// and, where glibc had returned the thread's arena to the system, fresh pages. Its
// transposed copies are forgotten at each call's start; the caller trims it at the end.
template <typename S>
S& thread_scratch() {
  thread_local S s;
  s.forget();
  return s;
}

// Scratch of the forward's tasks on one thread.
template <typename T>
struct FwdScratch {
  std::vector<T> s, m, l, band, f, qbuf;
  Transposed<T> kt, rt;  // kept while this thread's tasks stay on one head
  void forget() {
    kt.forget();
    rt.forget();
  }
  void trim() {
    for (std::vector<T>* v : {&s, &m, &l, &band, &f, &qbuf}) trim_vector(*v);
    kt.trim();
    rt.trim();
  }
};

// Scratch of the backward's tasks on one thread.
template <typename T>
struct BwdScratch {
  std::vector<T> p, dp, f, delta, band, dband;
  Transposed<T> kt, vt, rt;
  std::vector<T> qbuf, dqb;  // the block's biased query rows [2 bq D]; its dq and dqw [2 bq D]
  std::vector<T> seg;  // [Tq, 3]: per row, sums over the keys of another segment of dS and
                       // of P, and the sum of dS over all keys
  void forget() {
    kt.forget();
    vt.forget();
    rt.forget();
  }
  void trim() {
    for (std::vector<T>* v : {&p, &dp, &f, &delta, &band, &dband, &qbuf, &dqb, &seg})
      trim_vector(*v);
    kt.trim();
    vt.trim();
    rt.trim();
  }
};

// The rank order's scratch (rank_order_forward / _backward): a head's rows in rank order,
// and the scratch of the tasks that run on them.
template <typename T>
struct RankFwdScratch {
  std::vector<T> qs, os, ls, ks, vs;  // [Tq, D], [Tq, D], [Tq], [keys, D] x 2
  FwdScratch<T> t;
  void forget() { t.forget(); }
  void trim() {
    for (std::vector<T>* v : {&qs, &os, &ls, &ks, &vs}) trim_vector(*v);
    t.trim();
  }
};

template <typename T>
struct RankBwdScratch {
  std::vector<T> qs, dos, dqs, ks, vs, dks, dvs, ls, delta;
  BwdScratch<T> w;
  void forget() { w.forget(); }
  void trim() {
    for (std::vector<T>* v : {&qs, &dos, &dqs, &ks, &vs, &dks, &dvs, &ls, &delta})
      trim_vector(*v);
    w.trim();
  }
};

// Backward of one head. The task owns the whole head, so the loop order is free: query
// blocks outer (the key range and the position band are the forward's, computed once per
// query block), key tiles inner. dk, dv (and dr) are zeroed here and accumulated over the
// query blocks; a block's dq (for rel_attention: d(qu) + d(qw), whose column sums are the
// biases' gradients) is complete when its key tiles are done and is written once.
template <typename T>
void backward_head(const Head<T>& head, T scale, BwdScratch<T>& w) {
  const int64_t D = head.D;
  Head<T> h = head;  // with K, V (and r) transposed once for the whole head
  const bool tr = h.Tq >= kTransposeMinRows;
  h.kt = tr ? w.kt.fresh(h.k, h.ldk, h.Tk, D) : nullptr;
  h.vt = tr ? w.vt.fresh(h.v, h.ldv, h.Tk, D) : nullptr;
  h.ldkt = w.kt.ld;  // the same for vt (same rows)
  if (h.r != nullptr && tr) {
    h.rt = w.rt.of(h.r, h.ldr, h.R, D);
    h.ldrt = w.rt.ld;
  }
  for (int64_t j = 0; j < h.Tk; ++j) {
    std::fill(h.dk + j * h.lddk, h.dk + j * h.lddk + D, T(0));
    std::fill(h.dv + j * h.lddv, h.dv + j * h.lddv + D, T(0));
  }
  if (h.r != nullptr && h.dr_zero) std::fill(h.dr, h.dr + h.R * D, T(0));
  w.qbuf.resize(static_cast<size_t>(2 * kBlockQ * D));
  w.dqb.resize(static_cast<size_t>(2 * kBlockQ * D));
  T* dqb = w.dqb.data();              // [bq, D]: the block's dq (d(qu) for rel_attention)
  T* dqwb = dqb + kBlockQ * D;        // [bq, D]: d(qw)
  w.delta.resize(std::max<int64_t>(h.Tq, 1));
  for (int64_t i = 0; i < h.Tq; ++i) {
    if (h.delta != nullptr) {
      w.delta[i] = h.delta[i];
      continue;
    }
    w.delta[i] = row_dot(h.dout + i * h.lddo, h.o + i * h.ldo, D);
  }
  T* s = w.p.data();
  if (h.segq != nullptr) w.seg.assign(static_cast<size_t>(3 * h.Tq), T(0));
  for (int64_t i0 = 0; i0 < h.Tq; i0 += kBlockQ) {
    const int64_t bq = std::min(kBlockQ, h.Tq - i0);
    const int64_t end = key_end(h, i0, bq), jb = key_begin(h, i0);
    std::fill(dqb, dqb + bq * D, T(0));
    if (end <= jb) {  // rows that see no key: zero gradient
      for (int64_t rr = 0; rr < bq; ++rr)
        std::fill(h.dq + (i0 + rr) * h.lddq, h.dq + (i0 + rr) * h.lddq + D, T(0));
      continue;
    }
    const QRows<T> qr = query_rows(h, i0, bq, w.qbuf.data());
    const int64_t ng = bq + (end - jb) - 1;
    Band<T> pb;
    if (h.r != nullptr) {
      pb = band_of(h, i0, bq, jb, end);
      w.band.resize(static_cast<size_t>(bq * pb.W));
      w.dband.resize(static_cast<size_t>(bq * pb.W));
      poison(w.dband);  // CTXFAST_ATTN_CPU_DEBUG=poison: a column no tile writes reads NaN
      std::fill(dqwb, dqwb + bq * D, T(0));
      // Row rr of dg takes dS of key j at column (bq - 1 - rr) + (j - jb): each key tile
      // below computes its dS there; the bq - 1 - rr columns before are 0 (and those after
      // its last key, before the last flush)
      for (int64_t rr = 0; rr < bq; ++rr)
        std::fill(w.dband.data() + rr * pb.W, w.dband.data() + rr * pb.W + (bq - 1 - rr), T(0));
    }
    for_each_key_tile(h, i0, bq, jb, end, [&](int64_t j0, int64_t bk, int64_t r0) {
      // rows r0.. of the block (the others see none of these keys): s and ds row r - r0.
      // The skipped rows' columns of dg for these keys are set to 0 below.
      const int64_t nr = bq - r0;
      const T* dout = h.dout + (i0 + r0) * h.lddo;
      const T* gt = nullptr;
      if (h.r != nullptr) {
        const int64_t c_lo = j0 - jb, c_hi = (bq - 1 - r0) + c_lo + bk;
        band_slide_g(pb, bq, c_lo, c_hi, w.band.data());
        band_extend(h, qr, bq, pb, pb.g0 + pb.W, scale, w.band.data());  // as the forward
        gt = w.band.data() + (bq - 1) + (c_lo - pb.g0) + r0 * (pb.W - 1);
        band_slide_dg(h, qr, bq, pb, c_lo, c_hi, scale, w.dband.data(), dqwb);
        pb.dend = std::max(pb.dend, std::min(c_hi, pb.ng));
      }
      // dS [nr, bk] (rows ldds apart): for rel_attention written straight into its place in
      // dg, dg[rr, (bq - 1 - rr) + (j0 - jb) + c] = dS[rr, c], a matrix of row stride W - 1
      // (as the tile reads g)
      T* ds = w.dp.data();
      int64_t ldds = bk;
      if (h.r != nullptr) {
        T* base = w.dband.data() + (bq - 1) + (j0 - jb - pb.d0);
        ldds = pb.W - 1;
        // rows before r0 see none of these keys: their dS here is 0, written (a ranked
        // head's skipped rows are inside band_needed(), and the scratch keeps the previous
        // block's or call's values: dq, dr and d(r_r_bias) were wrong with sorted ranks)
        for (int64_t rr = 0; rr < r0; ++rr)
          std::fill(base + rr * ldds, base + rr * ldds + bk, T(0));
        ds = base + r0 * ldds;
      }
      scores_tile(h, qr, i0, bq, r0, j0, bk, scale, gt, pb.W - 1, s);
      if (h.p_drop > 0) exp_rows(s, nr, bk, h.lse + i0 + r0);  // else with dS below
      // dP = dO_i V_jᵀ, then P and dS = P (dP - Delta); with dropout (F: the factors, keep /
      // (1 - p)) dP = F (dO_i V_jᵀ), dS = P (dP - Delta) and the dropped P F goes to dV
      if (h.vt != nullptr)
        gemm_rm<T>(false, false, nr, bk, D, T(1), dout, h.lddo, h.vt + j0, h.ldkt, T(0), ds,
                   ldds);
      else
        gemm_rm<T>(false, true, nr, bk, D, T(1), dout, h.lddo, h.v + j0 * h.ldv, h.ldv, T(0),
                   ds, ldds);
      const T* delta = w.delta.data() + i0 + r0;
      if (h.p_drop > 0) {
        dropout_tile(h, i0 + r0, nr, j0, bk, w.f.data());
        for (int64_t r = 0; r < nr; ++r) {
          const T* f = w.f.data() + r * bk;
          T* dsr = ds + r * ldds;
          for (int64_t c = 0; c < bk; ++c) dsr[c] = s[r * bk + c] * (dsr[c] * f[c] - delta[r]);
        }
      } else {
        p_ds_rows(s, ds, ldds, nr, bk, h.lse + i0 + r0, delta);
      }
      if (h.segq != nullptr) {  // per row: sums of dS and P over the other segment, dS over all
        for (int64_t rr = r0; rr < bq; ++rr) {
          const int64_t sq = h.segq[i0 + rr];
          const int64_t* sk = h.segk + j0;
          const T* prow = s + (rr - r0) * bk;
          const T* row = ds + (rr - r0) * ldds;
          T ds_other = 0, p_other = 0, ds_all = 0;
          for (int64_t c = 0; c < bk; ++c) {
            ds_all += row[c];
            if (sk[c] != sq) {
              ds_other += row[c];
              p_other += prow[c];
            }
          }
          T* acc = w.seg.data() + 3 * (i0 + rr);
          acc[0] += ds_other;
          acc[1] += p_other;
          acc[2] += ds_all;
        }
      }
      if (h.p_drop > 0)  // P after dropout, for dV
        for (int64_t c = 0; c < nr * bk; ++c) s[c] *= w.f[c];
      // dv_j += Pᵀ dO_i (P after dropout)
      gemm_rm<T>(true, false, bk, D, nr, T(1), s, bk, dout, h.lddo, T(1), h.dv + j0 * h.lddv,
                 h.lddv);
      // dk_j += scale dSᵀ Q_i ; dq_i += scale dS K_j
      gemm_rm<T>(true, false, bk, D, nr, scale, ds, ldds, qr.q + r0 * qr.ldq, qr.ldq, T(1),
                 h.dk + j0 * h.lddk, h.lddk);
      gemm_rm<T>(false, false, nr, D, bk, scale, ds, ldds, h.k + j0 * h.ldk, h.ldk, T(1),
                 dqb + r0 * D, D);
      // dg's columns before j0 + bk - jb are complete: their share of dqw and dr, in chunks
      // of at least half a key tile
      if (h.r != nullptr && j0 + bk - jb - pb.flushed >= kBlockK / 2)
        band_flush(h, qr, bq, pb, j0 + bk - jb, scale, w.dband.data(), dqwb);
    });
    T* dq = h.dq + i0 * h.lddq;
    if (h.r == nullptr) {
      for (int64_t rr = 0; rr < bq; ++rr)
        std::copy(dqb + rr * D, dqb + (rr + 1) * D, dq + rr * h.lddq);
      continue;
    }
    // the columns after each row's last key (up to the last any row wrote) are 0
    for (int64_t rr = 0; rr < bq; ++rr) {
      const int64_t c1 = std::min(pb.dend, pb.hi);
      for (int64_t c = std::max((bq - 1 - rr) + (end - jb), pb.flushed); c < c1; ++c)
        w.dband[rr * pb.W + (c - pb.d0)] = T(0);
    }
    band_flush(h, qr, bq, pb, ng, scale, w.dband.data(), dqwb);
#ifdef CTXFAST_ATTN_AVX2
    if constexpr (std::is_same_v<T, float>) {
      if (has_avx2()) {
        dq_rows_avx2(dqb, dqwb, bq, D, dq, h.lddq, h.du, h.dw);
        continue;
      }
    }
#endif
    for (int64_t rr = 0; rr < bq; ++rr) {  // d(u) += sum d(qu), d(w) += sum d(qw), dq = both
      const T* a = dqb + rr * D;
      const T* c = dqwb + rr * D;
      T* o = dq + rr * h.lddq;
      for (int64_t d = 0; d < D; ++d) {
        h.du[d] += a[d];
        h.dw[d] += c[d];
        o[d] = a[d] + c[d];
      }
    }
  }
  // The segment term's gradient per row: d(ef)[i, 1] / scale = sum of dS_ij over the keys
  // of the other segment, d(ef)[i, 0] the same over the own segment. Each row of dS sums to
  // 0 (sum_j P_ij dP_ij = Delta_i and sum_j P_ij = 1, with dropout too), so these are small
  // differences of large terms, and an error e in Delta_i shifts each dS_ij by -e P_ij. Taken
  // as (other - P_other all) and its negative, both are free of e and of the rounding of the
  // sum that cancels.
  if (h.segq != nullptr) {
    for (int64_t i = 0; i < h.Tq; ++i) {
      const T* acc = w.seg.data() + 3 * i;
      const T other = acc[0] - acc[1] * acc[2];
      h.def[2 * i + 1] = other;
      h.def[2 * i] = -other;
    }
  }
}


// Runs forward_tile over every (head index in [0, n_heads), query block), where
// make(index) builds the Head and its Tq bounds the blocks (max_tq bounds them all).
template <typename T, typename MakeHead>
void run_forward(int64_t n_heads, int64_t max_tq, T scale, const MakeHead& make) {
  if (n_heads == 0 || max_tq == 0) return;
  const int64_t bq = forward_block_q(max_tq, make(0).causal, n_heads);
  const int64_t nqb = cdiv(max_tq, bq);
  // A task takes a run of a head's query blocks: the whole head where there are heads
  // enough to keep every thread busy (4 tasks a thread), so that one thread transposes
  // the head's K (and r) once, where with one block a task the threads took turns on each
  // head and both transposed it.
  const int64_t runs = std::min(nqb, cdiv(4 * at::get_num_threads(), n_heads));
  const int64_t per = cdiv(nqb, runs);  // query blocks per task
  parallel_dynamic(n_heads * runs, [&](const auto& next) {
    FwdScratch<T>& w = thread_scratch<FwdScratch<T>>();
    w.s.resize(kBlockQ * kBlockK);
    w.m.resize(kBlockQ);
    w.l.resize(kBlockQ);
    w.f.resize(kBlockQ * kBlockK);
    std::vector<T>& band = w.band;
    std::vector<T>& qbuf = w.qbuf;
    Transposed<T>& kt = w.kt;
    Transposed<T>& rt = w.rt;
    for (int64_t t; (t = next()) >= 0;) {
      Head<T> h = make(t / runs);
      const int64_t b0 = (t % runs) * per;
      const bool tr = b0 * bq < h.Tq && h.Tq >= kTransposeMinRows;
      h.kt = tr ? kt.of(h.k, h.ldk, h.Tk, h.D) : nullptr;
      h.ldkt = kt.ld;
      if (h.r != nullptr && tr) {
        h.rt = rt.of(h.r, h.ldr, h.R, h.D);
        h.ldrt = rt.ld;
      }
      if (h.u != nullptr) qbuf.resize(static_cast<size_t>(2 * kBlockQ * h.D));
      for (int64_t i0 = b0 * bq; i0 < std::min(h.Tq, (b0 + per) * bq); i0 += bq)
        forward_tile(h, i0, bq, scale, w.s.data(), w.m.data(), w.l.data(), band, w.f.data(),
                     qbuf.data());
    }
    w.trim();
  });
}

// Runs backward_head over every head index in [0, n_heads), make(index) building the
// Head; one task takes per_task consecutive indices in order (heads that accumulate into
// the same dr).
template <typename T, typename MakeHead>
void run_backward(int64_t n_heads, T scale, const MakeHead& make, int64_t per_task = 1) {
  if (n_heads == 0) return;
  parallel_dynamic(n_heads / per_task, [&](const auto& next) {
    BwdScratch<T>& w = thread_scratch<BwdScratch<T>>();
    w.p.resize(kBlockQ * kBlockK);
    w.dp.resize(kBlockQ * kBlockK);
    w.f.resize(kBlockQ * kBlockK);
    for (int64_t g; (g = next()) >= 0;)
      for (int64_t t = g * per_task; t < (g + 1) * per_task; ++t) backward_head(make(t), scale, w);
    w.trim();
  });
}

template <typename T>
Head<T> empty_head() {
  Head<T> h{};
  h.kpm = nullptr;
  h.rank = nullptr;
  h.rank_sorted = false;
  h.window = 0;
  h.kpm_end = 0;
  h.r = nullptr;
  h.u = nullptr;
  h.w = nullptr;
  h.du = nullptr;
  h.dw = nullptr;
  h.dr = nullptr;
  h.dr_zero = true;
  h.segq = nullptr;
  h.segk = nullptr;
  h.ef = nullptr;
  h.def = nullptr;
  h.p_drop = 0.0;
  h.seed = 0;
  h.bh = 0;
  h.Tq_all = 0;
  h.Tk_all = 0;
  return h;
}

template <typename T>
void set_dropout(Head<T>& h, const Dropout& dropout, int64_t bh, int64_t Tq, int64_t Tk) {
  h.p_drop = dropout.p;
  h.seed = dropout.seed;
  h.bh = bh;
  h.Tq_all = Tq;
  h.Tk_all = Tk;
}

// def_p: the backward's d(ef) [B, H, Tq, 2] (nullptr in the forward).
template <typename T>
void set_segments(Head<T>& h, const Segments& seg, int64_t b, int64_t bh, int64_t Tq,
                  int64_t Tk, T* def_p) {
  if (!seg.defined()) return;
  h.segq = seg.seg_q.const_data_ptr<int64_t>() + b * Tq;
  h.segk = seg.seg_k.const_data_ptr<int64_t>() + b * Tk;
  h.ef = seg.ef.const_data_ptr<T>() + bh * Tq * 2;
  h.def = def_p ? def_p + bh * Tq * 2 : nullptr;
}

// XLNet's permutation mask depends on ranks only, and attention is invariant to the order
// of the keys and independent per query: sorting the queries and the current keys by rank
// (stable) turns the mask into a causal-like one (exactly causal for a permutation: j <= i
// for the content stream, j < i for the query stream; memory keys stay first, always
// visible), so key_end skips the key tiles above the diagonal and only the diagonal tiles
// take an element mask: about half the work of the current keys. The rows are put in rank
// order per head, by the task that then computes on them (rank_order_forward/backward):
// O(T D) copies that stay in the cache the tiles read, against the O(T² D) of the
// attention, and no [B, H, T, D] copy of any input or output.
struct RankOrder {
  int64_t B, Tq, mem;
  std::vector<int64_t> order;  // [B, Tq]: sorted place -> original row
  std::vector<int64_t> place;  // [B, Tq]: original row -> sorted place (order's inverse)
  at::Tensor rank;             // [B, Tq] int64: the ranks in sorted order

  RankOrder(const at::Tensor& perm_rank, int64_t Tk)
      : B(perm_rank.size(0)), Tq(perm_rank.size(1)), mem(Tk - perm_rank.size(1)),
        order(B * Tq), place(B * Tq), rank(at::empty({B, Tq}, perm_rank.options())) {
    const int64_t* r = perm_rank.const_data_ptr<int64_t>();
    int64_t* rs = rank.mutable_data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      int64_t* o = order.data() + b * Tq;
      for (int64_t t = 0; t < Tq; ++t) o[t] = t;
      const int64_t* rb = r + b * Tq;
      std::stable_sort(o, o + Tq, [rb](int64_t x, int64_t y) { return rb[x] < rb[y]; });
      for (int64_t t = 0; t < Tq; ++t) {
        rs[b * Tq + t] = rb[o[t]];
        place[b * Tq + o[t]] = t;
      }
    }
  }
  // Original row of sorted query t of sequence b; of sorted key j (memory keys stay).
  int64_t query(int64_t b, int64_t t) const { return order[b * Tq + t]; }
  int64_t key(int64_t b, int64_t j) const { return j < mem ? j : mem + query(b, j - mem); }
  // Sorted place of original query t; of original key j.
  int64_t query_place(int64_t b, int64_t t) const { return place[b * Tq + t]; }
  int64_t key_place(int64_t b, int64_t j) const {
    return j < mem ? j : mem + query_place(b, j - mem);
  }
  at::Tensor padding(const at::Tensor& kpm) const {  // [B, Tk] bool, keys in sorted order
    if (!kpm.defined()) return kpm;
    at::Tensor y = kpm.clone(at::MemoryFormat::Contiguous);
    const bool* src = kpm.const_data_ptr<bool>();  // contiguous (the binding's check)
    bool* dst = y.mutable_data_ptr<bool>();
    const int64_t Tk = mem + Tq;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tq; ++t) dst[b * Tk + mem + t] = src[b * Tk + key(b, mem + t)];
    return y;
  }
};

// The copies between a head's rows (original order, in memory) and the task's scratch (rank
// order, in cache) walk the original order: memory is read or written row after row, which
// the hardware prefetcher follows, and the random order falls on the scratch. (Reading the
// rows in rank order, with software prefetch 4 rows ahead, cost a perm-query backward at
// B8 H8 T128 ~20 % over the same call with an identity permutation.)
// dst [*, D] (row stride D): row place(t) <- row t of src (row stride ld), for each of the
// n rows t whose place is in [lo, hi).
template <typename T, typename Place>
void gather_rows(T* dst, const T* src, int64_t ld, int64_t n, int64_t D, int64_t lo,
                 int64_t hi, const Place& place) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = place(t);
    if (p >= lo && p < hi) std::memcpy(dst + p * D, src + t * ld, sizeof(T) * D);
  }
}
// Row t of dst (row stride ld) <- row place(t) of src [*, D] (row stride D), for each of the
// n rows t whose place is in [lo, hi).
template <typename T, typename Place>
void scatter_rows(T* dst, int64_t ld, const T* src, int64_t n, int64_t D, int64_t lo,
                  int64_t hi, const Place& place) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = place(t);
    if (p >= lo && p < hi) std::memcpy(dst + t * ld, src + p * D, sizeof(T) * D);
  }
}

// Sort only where nothing else depends on positions (causal does, and dropout's counter).
bool use_rank_order(const Tensor& perm_rank, bool causal, const Dropout& dropout) {
  return perm_rank.defined() && !causal && dropout.p <= 0 && perm_rank.size(1) > 1;
}

// A Head of sequence b in rank order over the thread's copies: q, out, dout [Tq, D], k, v
// [Tk, D] (row stride D), lse [Tq]; ranks and padding sorted likewise.
template <typename T>
Head<T> sorted_head(const RankOrder& o, int64_t b, int64_t Tk, int64_t D, const bool* kpm,
                    const std::vector<int64_t>& ends, bool strict) {
  Head<T> h = empty_head<T>();
  h.ldq = h.ldk = h.ldv = h.ldo = h.lddo = h.lddq = h.lddk = h.lddv = D;
  h.Tq = o.Tq;
  h.Tk = Tk;
  h.mem = o.mem;
  h.D = D;
  h.kpm = kpm ? kpm + b * Tk : nullptr;
  h.kpm_end = ends[b];
  h.rank = o.rank.const_data_ptr<int64_t>() + b * o.Tq;
  h.rank_sorted = true;
  h.causal = false;
  h.strict = strict;
  return h;
}

// Forward in rank order. Tasks: (head, run of query blocks), enough of them for every
// thread; each copies its queries and the keys they may see into its scratch, runs
// forward_tile there and writes its out rows and lse back in the original order.
std::tuple<Tensor, Tensor> rank_order_forward(const RankOrder& o, const Tensor& q,
                                              const Tensor& k, const Tensor& v,
                                              const Tensor& key_padding_mask, bool strict,
                                              double scale) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.size(2);
  Tensor out = poisoned(empty_output({B, H, Tq, D}, q.options()));
  Tensor lse = poisoned(at::empty({B, H, Tq}, q.options()));
  const Tensor kpm_sorted = o.padding(key_padding_mask);
  const bool* kpm = kpm_sorted.defined() ? kpm_sorted.const_data_ptr<bool>() : nullptr;
  const std::vector<int64_t> ends = padding_ends(kpm, B, Tk);
  if (B * H == 0 || Tq == 0) return {out, lse};
  // rank order is causal-like: the short-sequence block of causal applies
  const int64_t bq = forward_block_q(Tq, /*causal=*/true, B * H);
  const int64_t nqb = cdiv(Tq, bq);
  const int64_t runs = std::min(nqb, cdiv(2 * at::get_num_threads(), B * H));
  const int64_t per = cdiv(nqb, runs) * bq;  // queries per task
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_forward_cpu_rank_order", [&] {
    using T = scalar_t;
    const T sc = static_cast<T>(scale);
    parallel_dynamic(B * H * runs, [&](const auto& next) {
      RankFwdScratch<T>& w = thread_scratch<RankFwdScratch<T>>();
      std::vector<T>&qs = w.qs, &os = w.os, &ls = w.ls, &ks = w.ks, &vs = w.vs;
      std::vector<T>&s = w.t.s, &m = w.t.m, &l = w.t.l, &f = w.t.f, &band = w.t.band;
      std::vector<T>& qbuf = w.t.qbuf;
      Transposed<T>& kt = w.t.kt;
      qs.resize(Tq * D);
      os.resize(Tq * D);
      ls.resize(Tq);
      s.resize(kBlockQ * kBlockK);
      m.resize(kBlockQ);
      l.resize(kBlockQ);
      f.resize(kBlockQ * kBlockK);
      for (int64_t t; (t = next()) >= 0;) {
        const int64_t bh = t / runs, b = bh / H, hh = bh % H;
        const int64_t lo = (t % runs) * per, hi = std::min(Tq, lo + per);
        if (lo >= hi) continue;
        poison(os);  // CTXFAST_ATTN_CPU_DEBUG=poison: rows this task does not compute
        poison(ls);
        Head<T> h = sorted_head<T>(o, b, Tk, D, kpm, ends, strict);
        int64_t kend = 0;  // the keys these queries may see: [0, kend)
        for (int64_t i0 = lo; i0 < hi; i0 += bq)
          kend = std::max(kend, key_end(h, i0, std::min(bq, hi - i0)));
        ks.resize(static_cast<size_t>(std::max<int64_t>(kend, 1) * D));
        vs.resize(ks.size());
        const T* kh = k.const_data_ptr<T>() + b * k.stride(0) + hh * k.stride(1);
        const T* vh = v.const_data_ptr<T>() + b * v.stride(0) + hh * v.stride(1);
        const T* qh = q.const_data_ptr<T>() + b * q.stride(0) + hh * q.stride(1);
        auto key = [&](int64_t j) { return o.key_place(b, j); };
        auto query = [&](int64_t t) { return o.query_place(b, t); };
        gather_rows(ks.data(), kh, k.stride(2), Tk, D, 0, kend, key);
        gather_rows(vs.data(), vh, v.stride(2), Tk, D, 0, kend, key);
        gather_rows(qs.data(), qh, q.stride(2), Tq, D, lo, hi, query);
        // K also transposed where the products take that (from the sorted copy, in cache)
        h.kt = hi - lo >= kTransposeMinRows ? kt.fresh(ks.data(), D, kend, D) : nullptr;
        h.ldkt = kt.ld;
        h.q = qs.data();
        h.k = ks.data();
        h.v = vs.data();
        h.o = os.data();
        h.lse = ls.data();
        for (int64_t i0 = lo; i0 < hi; i0 += bq)
          forward_tile(h, i0, bq, sc, s.data(), m.data(), l.data(), band, f.data(),
                       qbuf.data());
        T* oh = out.mutable_data_ptr<T>() + bh * Tq * D;
        T* lh = lse.mutable_data_ptr<T>() + bh * Tq;
        scatter_rows(oh, D, os.data(), Tq, D, lo, hi, query);
        for (int64_t r = 0; r < Tq; ++r) {
          const int64_t p = query(r);
          if (p >= lo && p < hi) lh[r] = ls[p];
        }
      }
      w.trim();
    });
  });
  return {out, lse};
}

// Backward in rank order, one task per head (as run_backward): the head's rows are copied
// into the thread's scratch in rank order, backward_head runs there, and dq, dk, dv go back
// to the original rows.
std::tuple<Tensor, Tensor, Tensor> rank_order_backward(
    const RankOrder& o, const Tensor& grad_out, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& key_padding_mask,
    bool strict, double scale) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.size(2);
  Tensor dq = poisoned(empty_output({B, H, Tq, D}, q.options()));
  Tensor dk = poisoned(empty_output({B, H, Tk, D}, q.options()));
  Tensor dv = poisoned(empty_output({B, H, Tk, D}, q.options()));
  const Tensor kpm_sorted = o.padding(key_padding_mask);
  const bool* kpm = kpm_sorted.defined() ? kpm_sorted.const_data_ptr<bool>() : nullptr;
  const std::vector<int64_t> ends = padding_ends(kpm, B, Tk);
  if (B * H == 0) return {dq, dk, dv};
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_backward_cpu_rank_order", [&] {
    using T = scalar_t;
    const T sc = static_cast<T>(scale);
    parallel_dynamic(B * H, [&](const auto& next) {
      // [Tq, D] each: q, dout, dq; [Tk, D] each: k, v, dk, dv; [Tq]: lse, Delta
      RankBwdScratch<T>& rs = thread_scratch<RankBwdScratch<T>>();
      std::vector<T>&qs = rs.qs, &dos = rs.dos, &dqs = rs.dqs, &ks = rs.ks, &vs = rs.vs;
      std::vector<T>&dks = rs.dks, &dvs = rs.dvs, &ls = rs.ls, &delta = rs.delta;
      for (std::vector<T>* x : {&qs, &dos, &dqs}) x->resize(Tq * D);
      for (std::vector<T>* x : {&ks, &vs, &dks, &dvs}) x->resize(Tk * D);
      ls.resize(Tq);
      delta.resize(Tq);
      BwdScratch<T>& w = rs.w;
      w.p.resize(kBlockQ * kBlockK);
      w.dp.resize(kBlockQ * kBlockK);
      w.f.resize(kBlockQ * kBlockK);
      for (int64_t bh; (bh = next()) >= 0;) {
        const int64_t b = bh / H, hh = bh % H;
        auto key = [&](int64_t j) { return o.key_place(b, j); };
        auto query = [&](int64_t t) { return o.query_place(b, t); };
        auto at_head = [&](const Tensor& x) {
          return x.const_data_ptr<T>() + b * x.stride(0) + hh * x.stride(1);
        };
        gather_rows(qs.data(), at_head(q), q.stride(2), Tq, D, 0, Tq, query);
        gather_rows(dos.data(), at_head(grad_out), grad_out.stride(2), Tq, D, 0, Tq, query);
        gather_rows(ks.data(), at_head(k), k.stride(2), Tk, D, 0, Tk, key);
        gather_rows(vs.data(), at_head(v), v.stride(2), Tk, D, 0, Tk, key);
        // lse, and Delta_i = dO_i . O_i (out is needed for nothing else), in sorted places
        const T* lh = at_head(lse);
        const T* oh = at_head(out);
        const T* gh = at_head(grad_out);
        for (int64_t t = 0; t < Tq; ++t) {
          const int64_t p = query(t);
          ls[p] = lh[t * lse.stride(2)];
          delta[p] = row_dot(gh + t * grad_out.stride(2), oh + t * out.stride(2), D);
        }
        Head<T> h = sorted_head<T>(o, b, Tk, D, kpm, ends, strict);
        h.delta = delta.data();
        h.q = qs.data();
        h.k = ks.data();
        h.v = vs.data();
        h.o = nullptr;
        h.dout = dos.data();
        h.lse = ls.data();
        h.dq = dqs.data();
        h.dk = dks.data();
        h.dv = dvs.data();
        for (std::vector<T>* x : {&dqs, &dks, &dvs}) poison(*x);  // CTXFAST_ATTN_CPU_DEBUG
        backward_head(h, sc, w);
        scatter_rows(dq.mutable_data_ptr<T>() + bh * Tq * D, D, dqs.data(), Tq, D, 0, Tq, query);
        scatter_rows(dk.mutable_data_ptr<T>() + bh * Tk * D, D, dks.data(), Tk, D, 0, Tk, key);
        scatter_rows(dv.mutable_data_ptr<T>() + bh * Tk * D, D, dvs.data(), Tk, D, 0, Tk, key);
      }
      rs.trim();
    });
  });
  return {dq, dk, dv};
}

std::tuple<Tensor, Tensor> attention_forward_impl(const Tensor& q, const Tensor& k,
                                                  const Tensor& v,
                                                  const Tensor& key_padding_mask,
                                                  const Tensor& perm_rank, bool causal,
                                                  bool perm_strict, double scale,
                                                  const Dropout& dropout);
std::tuple<Tensor, Tensor, Tensor> attention_backward_impl(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& lse, const Tensor& key_padding_mask,
    const Tensor& perm_rank, bool causal, bool perm_strict, double scale,
    const Dropout& dropout);

}  // namespace

// ---------------------------------------------------------------- batched [B, H, T, D]

std::tuple<Tensor, Tensor> attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& key_padding_mask,
                                             const Tensor& perm_rank, bool causal,
                                             bool perm_strict, double scale,
                                             const Dropout& dropout) {
  check_gemm_setting();
  if (!use_rank_order(perm_rank, causal, dropout))
    return attention_forward_impl(q, k, v, key_padding_mask, perm_rank, causal, perm_strict,
                                  scale, dropout);
  return rank_order_forward(RankOrder(perm_rank, k.size(2)), q, k, v, key_padding_mask,
                            perm_strict, scale);
}

std::tuple<Tensor, Tensor, Tensor> attention_backward(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& lse, const Tensor& key_padding_mask,
    const Tensor& perm_rank, bool causal, bool perm_strict, double scale,
    const Dropout& dropout) {
  check_gemm_setting();
  if (!use_rank_order(perm_rank, causal, dropout))
    return attention_backward_impl(grad_out, q, k, v, out, lse, key_padding_mask, perm_rank,
                                   causal, perm_strict, scale, dropout);
  return rank_order_backward(RankOrder(perm_rank, k.size(2)), grad_out, q, k, v, out, lse,
                             key_padding_mask, perm_strict, scale);
}

namespace {

std::tuple<Tensor, Tensor> attention_forward_impl(const Tensor& q, const Tensor& k,
                                                  const Tensor& v,
                                                  const Tensor& key_padding_mask,
                                                  const Tensor& perm_rank, bool causal,
                                                  bool perm_strict, double scale,
                                                  const Dropout& dropout) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.size(2);
  Tensor out = poisoned(empty_output({B, H, Tq, D}, q.options()));
  Tensor lse = poisoned(at::empty({B, H, Tq}, q.options()));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_forward_cpu", [&] {
    using T = scalar_t;
    const T* qp = q.const_data_ptr<T>();
    const T* kp = k.const_data_ptr<T>();
    const T* vp = v.const_data_ptr<T>();
    T* op = out.mutable_data_ptr<T>();
    T* lp = lse.mutable_data_ptr<T>();
    const bool* kpm = key_padding_mask.defined() ? key_padding_mask.const_data_ptr<bool>()
                                                 : nullptr;
    const int64_t* rk = perm_rank.defined() ? perm_rank.const_data_ptr<int64_t>() : nullptr;
    const std::vector<int64_t> ends = padding_ends(kpm, B, Tk);
    const std::vector<bool> sorted = ranks_sorted(rk, B, Tq);
    auto make = [&](int64_t bh) {
      const int64_t b = bh / H, hh = bh % H;
      Head<T> h = empty_head<T>();
      h.q = qp + b * q.stride(0) + hh * q.stride(1);
      h.ldq = q.stride(2);
      h.k = kp + b * k.stride(0) + hh * k.stride(1);
      h.ldk = k.stride(2);
      h.v = vp + b * v.stride(0) + hh * v.stride(1);
      h.ldv = v.stride(2);
      h.o = op + bh * Tq * D;
      h.ldo = D;
      h.lse = lp + bh * Tq;
      h.Tq = Tq;
      h.Tk = Tk;
      h.mem = Tk - Tq;
      h.D = D;
      h.kpm = kpm ? kpm + b * Tk : nullptr;
      h.kpm_end = ends[b];
      h.rank = rk ? rk + b * Tq : nullptr;
      h.rank_sorted = rk && sorted[b];
      h.causal = causal;
      h.strict = perm_strict;
      set_dropout(h, dropout, bh, Tq, Tk);
      return h;
    };
    run_forward<T>(B * H, Tq, static_cast<T>(scale), make);
  });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_backward_impl(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& lse, const Tensor& key_padding_mask,
    const Tensor& perm_rank, bool causal, bool perm_strict, double scale,
    const Dropout& dropout) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.size(2);
  // every element written by its task
  Tensor dq = poisoned(empty_output({B, H, Tq, D}, q.options()));
  Tensor dk = poisoned(empty_output({B, H, Tk, D}, q.options()));
  Tensor dv = poisoned(empty_output({B, H, Tk, D}, q.options()));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_backward_cpu", [&] {
    using T = scalar_t;
    const T* qp = q.const_data_ptr<T>();
    const T* kp = k.const_data_ptr<T>();
    const T* vp = v.const_data_ptr<T>();
    const T* op = out.const_data_ptr<T>();
    const T* dop = grad_out.const_data_ptr<T>();
    const T* lp = lse.const_data_ptr<T>();
    T* dqp = dq.mutable_data_ptr<T>();
    T* dkp = dk.mutable_data_ptr<T>();
    T* dvp = dv.mutable_data_ptr<T>();
    const bool* kpm = key_padding_mask.defined() ? key_padding_mask.const_data_ptr<bool>()
                                                 : nullptr;
    const int64_t* rk = perm_rank.defined() ? perm_rank.const_data_ptr<int64_t>() : nullptr;
    const std::vector<int64_t> ends = padding_ends(kpm, B, Tk);
    const std::vector<bool> sorted = ranks_sorted(rk, B, Tq);
    auto make = [&](int64_t bh) {
      const int64_t b = bh / H, hh = bh % H;
      Head<T> h = empty_head<T>();
      h.q = qp + b * q.stride(0) + hh * q.stride(1);
      h.ldq = q.stride(2);
      h.k = kp + b * k.stride(0) + hh * k.stride(1);
      h.ldk = k.stride(2);
      h.v = vp + b * v.stride(0) + hh * v.stride(1);
      h.ldv = v.stride(2);
      h.o = const_cast<T*>(op + b * out.stride(0) + hh * out.stride(1));
      h.ldo = out.stride(2);
      h.dout = dop + b * grad_out.stride(0) + hh * grad_out.stride(1);
      h.lddo = grad_out.stride(2);
      h.lse = const_cast<T*>(lp + b * lse.stride(0) + hh * lse.stride(1));
      h.dq = dqp + bh * Tq * D;
      h.lddq = D;
      h.dk = dkp + bh * Tk * D;
      h.lddk = D;
      h.dv = dvp + bh * Tk * D;
      h.lddv = D;
      h.Tq = Tq;
      h.Tk = Tk;
      h.mem = Tk - Tq;
      h.D = D;
      h.kpm = kpm ? kpm + b * Tk : nullptr;
      h.kpm_end = ends[b];
      h.rank = rk ? rk + b * Tq : nullptr;
      h.rank_sorted = rk && sorted[b];
      h.causal = causal;
      h.strict = perm_strict;
      set_dropout(h, dropout, bh, Tq, Tk);
      return h;
    };
    run_backward<T>(B * H, static_cast<T>(scale), make);
  });
  return {dq, dk, dv};
}

}  // namespace

// ---------------------------------------------------------------- rel_attention [B, H, T, D]

std::tuple<Tensor, Tensor> rel_attention_forward(
    const Tensor& q, const Tensor& r_w_bias, const Tensor& r_r_bias, const Tensor& k,
    const Tensor& v, const Tensor& r, const Tensor& key_padding_mask, const Tensor& perm_rank,
    bool causal, bool perm_strict, int64_t pos_start, int64_t window, double scale,
    const Segments& seg, const Dropout& dropout) {
  check_gemm_setting();
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Tk = k.size(2), R = r.size(1);
  Tensor out = poisoned(empty_output({B, H, Tq, D}, q.options()));
  Tensor lse = poisoned(at::empty({B, H, Tq}, q.options()));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "rel_attention_forward_cpu", [&] {
    using T = scalar_t;
    T* def_p = nullptr;
    const bool* kpm = key_padding_mask.defined() ? key_padding_mask.const_data_ptr<bool>()
                                                 : nullptr;
    const int64_t* rk = perm_rank.defined() ? perm_rank.const_data_ptr<int64_t>() : nullptr;
    const std::vector<int64_t> ends = padding_ends(kpm, B, Tk);
    const std::vector<bool> sorted = ranks_sorted(rk, B, Tq);
    auto make = [&](int64_t bh) {
      const int64_t b = bh / H, hh = bh % H;
      Head<T> h = empty_head<T>();
      h.q = q.const_data_ptr<T>() + b * q.stride(0) + hh * q.stride(1);
      h.ldq = q.stride(2);
      h.u = r_w_bias.const_data_ptr<T>() + hh * D;
      h.w = r_r_bias.const_data_ptr<T>() + hh * D;
      h.k = k.const_data_ptr<T>() + b * k.stride(0) + hh * k.stride(1);
      h.ldk = k.stride(2);
      h.v = v.const_data_ptr<T>() + b * v.stride(0) + hh * v.stride(1);
      h.ldv = v.stride(2);
      h.r = r.const_data_ptr<T>() + hh * r.stride(0);
      h.ldr = r.stride(1);
      h.R = R;
      h.pos_start = pos_start;
      h.o = out.mutable_data_ptr<T>() + bh * Tq * D;
      h.ldo = D;
      h.lse = lse.mutable_data_ptr<T>() + bh * Tq;
      h.Tq = Tq;
      h.Tk = Tk;
      h.mem = Tk - Tq;
      h.D = D;
      h.kpm = kpm ? kpm + b * Tk : nullptr;
      h.kpm_end = ends[b];
      h.rank = rk ? rk + b * Tq : nullptr;
      h.rank_sorted = rk && sorted[b];
      h.causal = causal;
      h.strict = perm_strict;
      h.window = window;
      set_dropout(h, dropout, bh, Tq, Tk);
      set_segments(h, seg, b, bh, Tq, Tk, def_p);
      return h;
    };
    run_forward<T>(B * H, Tq, static_cast<T>(scale), make);
  });
  return {out, lse};
}

RelGrads rel_attention_backward(
    const Tensor& grad_out, const Tensor& q, const Tensor& r_w_bias, const Tensor& r_r_bias,
    const Tensor& k, const Tensor& v, const Tensor& r, const Tensor& out, const Tensor& lse,
    const Tensor& key_padding_mask, const Tensor& perm_rank, bool causal, bool perm_strict,
    int64_t pos_start, int64_t window, double scale, const Segments& seg,
    const Dropout& dropout) {
  check_gemm_setting();
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Tk = k.size(2), R = r.size(1);
  // dq, dk, dv and dr are written (or zeroed) by the task of their head. dr is shared by
  // the batch: with enough heads for the threads, one task takes a head's B sequences in
  // turn and accumulates into dr [H, R, D]; otherwise each (b, h) has its own and they
  // are summed over b below.
  const bool by_head = B > 1 && H >= 2 * at::get_num_threads();
  Tensor dq = poisoned(empty_output({B, H, Tq, D}, q.options()));
  Tensor dk = poisoned(empty_output({B, H, Tk, D}, q.options()));
  Tensor dv = poisoned(empty_output({B, H, Tk, D}, q.options()));
  Tensor drb = poisoned(by_head ? empty_output({H, R, D}, q.options())
                                : empty_output({B, H, R, D}, q.options()));
  Tensor dub = at::zeros({B, H, D}, q.options());     // bias gradients per (b, h)
  Tensor dwb = at::zeros({B, H, D}, q.options());
  Tensor def = seg.defined() ? at::zeros({B, H, Tq, 2}, q.options()) : Tensor();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "rel_attention_backward_cpu", [&] {
    using T = scalar_t;
    T* def_p = def.defined() ? def.mutable_data_ptr<T>() : nullptr;
    const bool* kpm = key_padding_mask.defined() ? key_padding_mask.const_data_ptr<bool>()
                                                 : nullptr;
    const int64_t* rk = perm_rank.defined() ? perm_rank.const_data_ptr<int64_t>() : nullptr;
    const std::vector<int64_t> ends = padding_ends(kpm, B, Tk);
    const std::vector<bool> sorted = ranks_sorted(rk, B, Tq);
    auto make = [&](int64_t t) {  // t = hh B + b by head, else b H + hh
      const int64_t b = by_head ? t % B : t / H, hh = by_head ? t / B : t % H;
      const int64_t bh = b * H + hh;
      Head<T> h = empty_head<T>();
      h.q = q.const_data_ptr<T>() + b * q.stride(0) + hh * q.stride(1);
      h.ldq = q.stride(2);
      h.u = r_w_bias.const_data_ptr<T>() + hh * D;
      h.w = r_r_bias.const_data_ptr<T>() + hh * D;
      h.k = k.const_data_ptr<T>() + b * k.stride(0) + hh * k.stride(1);
      h.ldk = k.stride(2);
      h.v = v.const_data_ptr<T>() + b * v.stride(0) + hh * v.stride(1);
      h.ldv = v.stride(2);
      h.r = r.const_data_ptr<T>() + hh * r.stride(0);
      h.ldr = r.stride(1);
      h.R = R;
      h.pos_start = pos_start;
      h.o = const_cast<T*>(out.const_data_ptr<T>() + b * out.stride(0) + hh * out.stride(1));
      h.ldo = out.stride(2);
      h.dout = grad_out.const_data_ptr<T>() + b * grad_out.stride(0) + hh * grad_out.stride(1);
      h.lddo = grad_out.stride(2);
      h.lse = const_cast<T*>(lse.const_data_ptr<T>() + b * lse.stride(0) + hh * lse.stride(1));
      h.dq = dq.mutable_data_ptr<T>() + bh * Tq * D;
      h.lddq = D;
      h.du = dub.mutable_data_ptr<T>() + bh * D;
      h.dw = dwb.mutable_data_ptr<T>() + bh * D;
      h.dk = dk.mutable_data_ptr<T>() + bh * Tk * D;
      h.lddk = D;
      h.dv = dv.mutable_data_ptr<T>() + bh * Tk * D;
      h.lddv = D;
      h.dr = drb.mutable_data_ptr<T>() + (by_head ? hh : bh) * R * D;
      h.dr_zero = !by_head || b == 0;
      h.Tq = Tq;
      h.Tk = Tk;
      h.mem = Tk - Tq;
      h.D = D;
      h.kpm = kpm ? kpm + b * Tk : nullptr;
      h.kpm_end = ends[b];
      h.rank = rk ? rk + b * Tq : nullptr;
      h.rank_sorted = rk && sorted[b];
      h.causal = causal;
      h.strict = perm_strict;
      h.window = window;
      set_dropout(h, dropout, bh, Tq, Tk);
      set_segments(h, seg, b, bh, Tq, Tk, def_p);
      return h;
    };
    run_backward<T>(B * H, static_cast<T>(scale), make, by_head ? B : 1);
  });
  RelGrads g;
  g.dq = dq;
  g.dk = dk;
  g.dv = dv;
  g.dr = by_head ? drb : B == 1 ? drb.select(0, 0) : drb.sum(0);
  g.du = B == 1 ? dub.select(0, 0) : dub.sum(0);
  g.dw = B == 1 ? dwb.select(0, 0) : dwb.sum(0);
  g.def = def;
  return g;
}

// ---------------------------------------------------------------- packed [total, H, D]

std::tuple<Tensor, Tensor> attention_varlen_forward(const Tensor& q, const Tensor& k,
                                                    const Tensor& v,
                                                    const std::vector<int64_t>& cu_q,
                                                    const std::vector<int64_t>& cu_k,
                                                    bool causal, double scale, int64_t max_q,
                                                    int64_t max_k, const Dropout& dropout) {
  check_gemm_setting();
  const int64_t total_q = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t nseq = static_cast<int64_t>(cu_q.size()) - 1;
  Tensor out = empty_output({total_q, H, D}, q.options()).zero_();
  Tensor lse = at::empty({H, total_q}, q.options());  // filled below, like out above
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_varlen_forward_cpu", [&] {
    using T = scalar_t;
    lse.fill_(std::numeric_limits<T>::infinity());
    const T* qp = q.const_data_ptr<T>();
    const T* kp = k.const_data_ptr<T>();
    const T* vp = v.const_data_ptr<T>();
    T* op = out.mutable_data_ptr<T>();
    T* lp = lse.mutable_data_ptr<T>();
    int64_t max_tq = 0;
    for (int64_t b = 0; b < nseq; ++b) max_tq = std::max(max_tq, cu_q[b + 1] - cu_q[b]);
    auto make = [&](int64_t bh) {
      const int64_t b = bh / H, hh = bh % H;
      Head<T> h = empty_head<T>();
      h.q = qp + cu_q[b] * q.stride(0) + hh * q.stride(1);
      h.ldq = q.stride(0);
      h.k = kp + cu_k[b] * k.stride(0) + hh * k.stride(1);
      h.ldk = k.stride(0);
      h.v = vp + cu_k[b] * v.stride(0) + hh * v.stride(1);
      h.ldv = v.stride(0);
      h.o = op + cu_q[b] * H * D + hh * D;
      h.ldo = H * D;
      h.lse = lp + hh * total_q + cu_q[b];
      h.Tq = cu_q[b + 1] - cu_q[b];
      h.Tk = cu_k[b + 1] - cu_k[b];
      h.mem = h.Tk - h.Tq;
      h.kpm_end = h.Tk;
      h.D = D;
      h.causal = causal;
      set_dropout(h, dropout, bh, max_q, max_k);
      return h;
    };
    run_forward<T>(nseq * H, max_tq, static_cast<T>(scale), make);
  });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_varlen_backward(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& lse, const std::vector<int64_t>& cu_q,
    const std::vector<int64_t>& cu_k, bool causal, double scale, int64_t max_q, int64_t max_k,
    const Dropout& dropout) {
  check_gemm_setting();
  const int64_t H = q.size(1), D = q.size(2), total_q = q.size(0);
  const int64_t nseq = static_cast<int64_t>(cu_q.size()) - 1;
  Tensor dq = empty_output(q.sizes(), q.options()).zero_();
  Tensor dk = empty_output(k.sizes(), q.options()).zero_();
  Tensor dv = empty_output(v.sizes(), q.options()).zero_();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_varlen_backward_cpu", [&] {
    using T = scalar_t;
    const T* qp = q.const_data_ptr<T>();
    const T* kp = k.const_data_ptr<T>();
    const T* vp = v.const_data_ptr<T>();
    const T* op = out.const_data_ptr<T>();
    const T* dop = grad_out.const_data_ptr<T>();
    const T* lp = lse.const_data_ptr<T>();
    T* dqp = dq.mutable_data_ptr<T>();
    T* dkp = dk.mutable_data_ptr<T>();
    T* dvp = dv.mutable_data_ptr<T>();
    auto make = [&](int64_t bh) {
      const int64_t b = bh / H, hh = bh % H;
      Head<T> h = empty_head<T>();
      h.q = qp + cu_q[b] * q.stride(0) + hh * q.stride(1);
      h.ldq = q.stride(0);
      h.k = kp + cu_k[b] * k.stride(0) + hh * k.stride(1);
      h.ldk = k.stride(0);
      h.v = vp + cu_k[b] * v.stride(0) + hh * v.stride(1);
      h.ldv = v.stride(0);
      h.o = const_cast<T*>(op + cu_q[b] * out.stride(0) + hh * out.stride(1));
      h.ldo = out.stride(0);
      h.dout = dop + cu_q[b] * grad_out.stride(0) + hh * grad_out.stride(1);
      h.lddo = grad_out.stride(0);
      h.lse = const_cast<T*>(lp + hh * lse.stride(0) + cu_q[b] * lse.stride(1));
      h.dq = dqp + cu_q[b] * H * D + hh * D;
      h.lddq = H * D;
      h.dk = dkp + cu_k[b] * H * D + hh * D;
      h.lddk = H * D;
      h.dv = dvp + cu_k[b] * H * D + hh * D;
      h.lddv = H * D;
      h.Tq = cu_q[b + 1] - cu_q[b];
      h.Tk = cu_k[b + 1] - cu_k[b];
      h.mem = h.Tk - h.Tq;
      h.kpm_end = h.Tk;
      h.D = D;
      h.causal = causal;
      set_dropout(h, dropout, bh, max_q, max_k);
      return h;
    };
    (void)total_q;
    run_backward<T>(nseq * H, static_cast<T>(scale), make);
  });
  return {dq, dk, dv};
}

// ---------------------------------------------------------------- keep masks

// A mask uses all four words of each Philox-4x32-10 output (a quarter of the rounds of the
// attention dropout's one-word stream): value e = 32 b + 8 w + l (block b, word w, lane l)
// is word w of counter 8 b + l, kept iff its uniform (as philox_uniform forms it) >= p.
// Values [32 b0, 32 b0 + n) of the mask into f (f[0] is value 32 b0).
template <typename T>
void mask_values_scalar(uint64_t seed, int64_t b0, int64_t n, float p, T* f) {
  for (int64_t i = 0; i < n; i += 32) {
    const uint64_t blk = static_cast<uint64_t>(b0 + i / 32);
    for (int64_t l = 0; l < 8; ++l) {
      uint32_t w[4];
      philox4(seed, 8 * blk + static_cast<uint64_t>(l), w);
      for (int64_t k = 0; k < 4; ++k) {
        const int64_t e = i + 8 * k + l;
        if (e < n) f[e] = word_uniform(w[k]) >= p ? T(1) : T(0);
      }
    }
  }
}

#ifdef CTXFAST_ATTN_AVX2
// The same for whole blocks (n a multiple of 32), 8 counters per step.
CTXFAST_AVX2_FN void mask_values_avx2(uint64_t seed, int64_t b0, int64_t n, float p,
                                      float* f) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 vp = _mm256_set1_ps(p), one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 32) {
    const uint64_t o = 8 * static_cast<uint64_t>(b0 + i / 32);  // counters o .. o + 7
    const uint32_t lo = static_cast<uint32_t>(o);  // a multiple of 8: no wrap in the lanes
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo)), lane);
    __m256i c1 = _mm256_set1_epi32(static_cast<int>(o >> 32));
    __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
    philox_rounds_avx2(seed, c0, c1, c2, c3);
    const __m256i words[4] = {c0, c1, c2, c3};
    for (int k = 0; k < 4; ++k) {
      const __m256 u = words_uniform_avx2(words[k]);
      _mm256_storeu_ps(f + i + 8 * k, _mm256_and_ps(one, _mm256_cmp_ps(u, vp, _CMP_GE_OQ)));
    }
  }
}
#endif

// Values [lo, lo + n) of the mask into f (f[0] is value lo; lo a multiple of 32).
template <typename T>
void mask_values(uint64_t seed, int64_t lo, int64_t n, float p, T* f) {
  int64_t done = 0;
#ifdef CTXFAST_ATTN_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2()) {
      done = n / 32 * 32;
      mask_values_avx2(seed, lo / 32, done, p, f);
    }
  }
#endif
  mask_values_scalar(seed, (lo + done) / 32, n - done, p, f + done);
}

Tensor keep_mask(const Tensor& like, uint64_t seed, double p) {
  const at::ScalarType ct = like.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  Tensor out = at::empty(like.sizes(), like.options().dtype(ct));  // contiguous
  const int64_t n = out.numel();
  const float pf = static_cast<float>(p);  // compared in float32, as the dropout kernels do
  constexpr int64_t kChunk = int64_t(1) << 15;  // values per task, a multiple of 32
  AT_DISPATCH_FLOATING_TYPES(ct, "keep_mask_cpu", [&] {
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, cdiv(n, kChunk), 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t lo = c * kChunk;
        mask_values(seed, lo, std::min(kChunk, n - lo), pf, o + lo);
      }
    });
  });
  return ct == like.scalar_type() ? out : out.to(like.scalar_type());
}

std::string attention_tile_path() {
  if (!own_gemm()) return "BLAS";
#ifdef CTXFAST_ATTN_AVX2
  if (has_avx512()) return "own AVX-512";
#endif
  return "own AVX2";
}

}  // namespace cpu
}  // namespace ctxfast
