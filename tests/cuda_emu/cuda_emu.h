// A CPU emulator of the small part of CUDA that ctxfast's persistent LSTM kernels use, so
// that the kernels themselves (csrc/cuda/lstm_kernels.cuh, compiled by the host compiler
// with CTXFAST_CUDA_EMULATION) run on a machine without a GPU: every CUDA thread is an OS
// thread; __syncthreads, cooperative groups' grid.sync() and the warp-collective
// operations (shuffles, WMMA) are barriers among them. Test-only (tests/test_lstm_cuda_emu.py).
//
// What it checks beyond the values: WMMA pointers 32-byte aligned and leading dimensions
// a multiple of 16 bytes (the CUDA C++ guide's rules: a GPU faults or reads garbage
// otherwise), the same pointer from every lane of a warp; shared memory is poisoned with
// 0xFF bytes (NaN in every float type) at launch, so a read of shared memory the kernel
// never wrote shows up as NaN; built with AddressSanitizer by the test, a read or write past
// any buffer (shared or global) stops the run.
//
// What it does not model: timing, memory ordering weaker than sequential consistency (the
// barriers order everything), warp divergence (lanes run independently; a shuffle or WMMA
// call that not all 32 lanes reach deadlocks here, as it hangs or misbehaves on a GPU),
// the hardware's accumulation order inside an MMA (products are summed in k order in
// float32: bf16/fp16 and tf32 products are exact in float32). A tf32 operand must hold a
// tf32 value (converted with __float_to_tf32, as the CUDA C++ guide requires): one that does
// not stops the run.
#pragma once

#define __host__
#define __device__
#define __global__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#undef __launch_bounds__
#define __launch_bounds__(...)
#define CTXFAST_DYNAMIC_SMEM(name) unsigned char* name = ::emu::dynamic_smem()

using std::max;
using std::min;

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda_emu: %s\n", what);
  std::abort();
}

struct Warp {
  explicit Warp(int n) : bar(n) {}
  std::barrier<> bar;
  float xch[32];
  const void* ptr[32];
};

struct Block {
  Block(int threads, size_t smem_bytes) : bar(threads), smem(smem_bytes + 128) {
    for (int w = 0; w < (threads + 31) / 32; ++w)
      warps.emplace_back(std::make_unique<Warp>(std::min(32, threads - 32 * w)));
    std::memset(smem.data(), 0xFF, smem.size());  // poison: NaN in every float type
  }
  std::barrier<> bar;
  std::vector<unsigned char> smem;
  std::vector<std::unique_ptr<Warp>> warps;
  unsigned char* base() {  // 128-byte aligned start
    const uintptr_t p = reinterpret_cast<uintptr_t>(smem.data());
    return smem.data() + ((128 - (p & 127)) & 127);
  }
};

struct Ctx {
  Block* block;
  Warp* warp;
  std::barrier<>* grid;
  int lane;
};
inline thread_local Ctx ctx;

inline unsigned char* dynamic_smem() { return ctx.block->base(); }

// clock64() and %globaltimer (the kernels' phase clock): a steady clock's nanoseconds.
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

template <typename... Args>
void launch(void (*kernel)(Args...), int grid, int threads, size_t smem_bytes,
            const Args&... args) {
  if (grid < 1 || threads < 1 || threads % 32 != 0) fail("launch: bad grid or block size");
  std::barrier<> grid_bar(grid * threads);
  std::vector<std::unique_ptr<Block>> blocks;
  for (int b = 0; b < grid; ++b) blocks.emplace_back(std::make_unique<Block>(threads, smem_bytes));
  std::vector<std::thread> pool;
  pool.reserve(size_t(grid) * threads);
  for (int b = 0; b < grid; ++b) {
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, b, t] {
        threadIdx = uint3{unsigned(t), 0, 0};
        blockIdx = uint3{unsigned(b), 0, 0};
        blockDim = dim3(threads, 1, 1);
        gridDim = dim3(grid, 1, 1);
        ctx = Ctx{blocks[b].get(), blocks[b]->warps[t / 32].get(), &grid_bar, t % 32};
        kernel(args...);
      });
    }
  }
  for (auto& th : pool) th.join();
}

inline void warp_sync() { ctx.warp->bar.arrive_and_wait(); }

// Every lane of the warp passes the same pointer (a warp-collective call).
inline void same_pointer(const void* p, const char* op) {
  ctx.warp->ptr[ctx.lane] = p;
  warp_sync();
  if (ctx.warp->ptr[0] != p) fail(op);
  warp_sync();
}

}  // namespace emu

inline void __syncthreads() { emu::ctx.block->bar.arrive_and_wait(); }

inline float __shfl_sync(unsigned, float v, int src) {
  emu::ctx.warp->xch[emu::ctx.lane] = v;
  emu::warp_sync();
  const float r = emu::ctx.warp->xch[src & 31];
  emu::warp_sync();
  return r;
}
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  return __shfl_sync(0xffffffffu, v, emu::ctx.lane ^ mask);
}

namespace cooperative_groups {
struct grid_group {
  void sync() const { emu::ctx.grid->arrive_and_wait(); }
};
inline grid_group this_grid() { return {}; }
}  // namespace cooperative_groups

// ---------------------------------------------------------------------------- WMMA
namespace nvcuda {
namespace wmma {
struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
namespace precision {
struct tf32 {};
}
enum layout_t { mem_row_major, mem_col_major };

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}
// cvt.rna.tf32.f32: nearest, ties away from zero, 10 mantissa bits kept.
inline float __float_to_tf32(float x) {
  if (!std::isfinite(x)) return x;
  return float_of((bits_of(x) + 0x1000u) & ~0x1FFFu);
}

template <typename T> struct elem_of { using type = T; };
template <> struct elem_of<precision::tf32> { using type = float; };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
  static constexpr int num_elements = rows * cols;
  using element_type = typename elem_of<T>::type;
  element_type x[num_elements];  // the whole tile, row-major (each lane holds all of it)
};

template <typename E>
inline void check_tile(const E* p, unsigned ldm, const char* op) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) emu::fail("WMMA: pointer not 32-byte aligned");
  if ((ldm * sizeof(E)) % 16 != 0) emu::fail("WMMA: ldm not a multiple of 16 bytes");
  emu::same_pointer(p, op);
}

template <typename Use, int M, int N, int K, typename T, typename Layout, typename E>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const E* p, unsigned ldm) {
  using F = fragment<Use, M, N, K, T, Layout>;
  check_tile(p, ldm, "WMMA load: lanes passed different pointers");
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c)
      f.x[r * F::cols + c] = std::is_same_v<Layout, row_major> ? p[size_t(r) * ldm + c]
                                                                : p[size_t(c) * ldm + r];
}

template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm,
                      layout_t layout) {
  check_tile(p, ldm, "WMMA load: lanes passed different pointers");
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      f.x[r * N + c] = layout == mem_row_major ? p[size_t(r) * ldm + c] : p[size_t(c) * ldm + r];
}

template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                       layout_t layout) {
  check_tile(p, ldm, "WMMA store: lanes passed different pointers");
  if (emu::ctx.lane == 0) {
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < N; ++c)
        (layout == mem_row_major ? p[size_t(r) * ldm + c] : p[size_t(c) * ldm + r]) =
            f.x[r * N + c];
  }
  emu::warp_sync();
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, float v) {
  for (auto& e : f.x) e = static_cast<typename fragment<Use, M, N, K, T, Layout>::element_type>(v);
}

// A tf32 operand must hold a tf32 value (the CUDA C++ guide: converted with __float_to_tf32
// before mma_sync); one with low mantissa bits set is a kernel error here (a GPU would
// silently drop them).
inline float operand(float x, bool tf32) {
  if (tf32 && (bits_of(x) & 0x1FFFu) != 0 && std::isfinite(x))
    emu::fail("WMMA: a tf32 operand was not converted with __float_to_tf32");
  return x;
}
inline float operand(__half x, bool) { return __half2float(x); }
inline float operand(__nv_bfloat16 x, bool) { return __bfloat162float(x); }

// d = a . b + c over the whole tile. A warp-collective call: every lane must reach it (a
// barrier here, so a divergent call hangs, as it would misbehave on a GPU).
template <int M, int N, int K, typename T, typename LayoutB>
void mma_sync(fragment<accumulator, M, N, K, float>& d,
              const fragment<matrix_a, M, N, K, T, row_major>& a,
              const fragment<matrix_b, M, N, K, T, LayoutB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  const bool tf32 = std::is_same_v<T, precision::tf32>;
  emu::warp_sync();
  float out[M * N];
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      float s = c.x[i * N + j];
      for (int k = 0; k < K; ++k)
        s = std::fma(operand(a.x[i * K + k], tf32), operand(b.x[k * N + j], tf32), s);
      out[i * N + j] = s;
    }
  }
  std::memcpy(d.x, out, sizeof(out));
}

}  // namespace wmma
}  // namespace nvcuda
