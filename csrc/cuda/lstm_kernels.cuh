// LSTM recurrence, CUDA kernels: the persistent kernels (CUDA cores and tensor cores),
// their shared device helpers, and the pure-host shape of their launches. Plain CUDA (no
// torch); included by csrc/cuda/lstm.cu, which owns the launches, the device queries and
// the per-step kernels, and by the CPU emulator test (tests/cuda_emu, built with
// CTXFAST_CUDA_EMULATION), which runs these same kernels on a machine without a GPU.
//
// Persistent forward, CUDA cores (one cooperative launch for all T steps)
//   Block k owns hidden units [k*U, k*U + U) and keeps their 4 gate rows of w_hh * mask
//   (4U x P, storage dtype) in shared memory for the whole call: the recurrent weight is
//   read from HBM once per call, not once per step, and the module's weight is never
//   written. Per step:
//   phase 1: for each batch tile of 8 rows, the block stages h_{t-1} (float32) in shared
//            memory; each warp takes one unit and computes its 4 gates x 8 batch rows
//            (32 dot products of length P, split over the lanes, then one 31-shuffle
//            reduce-scatter that leaves lane l with gate l/8 of batch row l%8), applies
//            the activations, gathers i, f, g, o into lanes 0..7 and updates c, h.
//   grid.sync()
//   phase 2 (projection only): the grid's warps split [P/4 row groups x B/8 batch tiles];
//            a warp computes 4 rows of hp_t @ w_hr^T for 8 batch rows (w_hr from L2), clips
//            and writes h_t.  grid.sync()
// Persistent backward, CUDA cores: the same row split of w_hh on chip. Per step (last first):
//   phase 1: each block runs the cell backward of its units (with a projection, dL/dhp =
//            dh_in @ w_hr is computed there by the same warp dot, w_hr^T rows from L2),
//            writes dz (float) and keeps its slice of dz in shared memory; then the
//            block's partial of dL/dh_{t-1} = dz @ W over its 4U rows, all B x P, goes to
//            its slot of a float workspace.  grid.sync()
//   phase 2: the grid sums the partials over the blocks and forms dh_in of the next step
//            (+ grad_out, projection clip mask), or grad_h0 after the first step.
//            grid.sync()
//   The weight gradients are one GEMM each over all steps, in the binding.
// Tensor-core kernels: see "tensor-core kernels" below.
//
// Arithmetic is float32 (FMA on the CUDA cores; float32 accumulation on the tensor cores);
// c and the gradients are carried in float32 workspaces.
#pragma once

#ifdef CTXFAST_CUDA_EMULATION
#include "cuda_emu.h"  // tests/cuda_emu: threads, barriers, shuffles and WMMA on the CPU
#else
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
// 128-byte aligned: WMMA tiles need 32-byte aligned shared-memory pointers, and the
// kernels place their regions at 128-byte offsets from this base.
#define CTXFAST_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/lstm.h"

namespace ctxfast {
namespace cuda {
namespace {

namespace cg = cooperative_groups;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kBT = 8;            // batch rows per tile (one warp item: 4 rows x 8 batch)
constexpr int kMaxWarps = 16;
constexpr int kMaxThreads = kMaxWarps * 32;
constexpr int kElemThreads = 256; // per-step elementwise kernels

// ------------------------------------------------------------------ dtype helpers
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Store a value v clipped at +-clip. An unclipped v (|v| < clip) that rounds onto the
// stored clip +-clip_s is stored as +-below, so that the backward's |stored| < clip_s test
// sees it as unclipped. (float32 storage: never, the rounding is exact.)
template <typename T>
__device__ __forceinline__ void store_clipped(T* dst, float v, float clip, float clip_s,
                                              float below) {
  T r = from_f<T>(v);
  if (fabsf(v) < clip && !(fabsf(to_f(r)) < clip_s)) r = from_f<T>(copysignf(below, v));
  *dst = r;
}

// Accurate activations (the extension is built without --use_fast_math: __expf, approximate
// division and tanh.approx put the first GPU run 10-100x further from the float64 reference
// than eager). sigmoid from exp of a non-positive argument only: no overflow, full relative
// accuracy for large |x| on both sides.
__device__ __forceinline__ float sigmoid_f(float x) {
  const float e = expf(-fabsf(x));             // in (0, 1]
  const float s = 1.0f / (1.0f + e);           // sigmoid(|x|)
  return x >= 0.0f ? s : e * s;                // sigmoid(-|x|) = e / (1 + e)
}
// clamp(x, ±c) with NaN kept, as torch.clamp and the CPU kernels: fminf / fmaxf return the
// other operand, so without the test a NaN cell or output became -c, a finite value.
__device__ __forceinline__ float clamp_f(float x, float c) {
  return x != x ? x : fminf(fmaxf(x, -c), c);
}

__host__ __device__ __forceinline__ size_t align16(size_t n) { return (n + 15) & ~size_t(15); }

// Ask for the line holding p in L2 (no register, no wait). A no-op under the emulator.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef CTXFAST_CUDA_EMULATION
  (void)p;
#else
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// The SM's cycle counter and the GPU's nanosecond timer (the emulator: a steady clock's ns).
__device__ __forceinline__ int64_t clock_cycles() {
#ifdef CTXFAST_CUDA_EMULATION
  return emu::now_ns();
#else
  return static_cast<int64_t>(clock64());
#endif
}
__device__ __forceinline__ int64_t global_ns() {
#ifdef CTXFAST_CUDA_EMULATION
  return emu::now_ns();
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<int64_t>(t);
#endif
}

// Phase clock (LstmDims::phase_clock; profiling). clk: [gridDim.x, rows, kLstmClockCols]
// or null. phase_stamp: once the block's threads reach it, thread 0 writes the block's
// clock at (row, col); nothing when clk is null (a uniform test: no barrier then).
__device__ __forceinline__ void phase_stamp(int64_t* clk, int rows, int row, int col) {
  if (clk == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0)
    clk[(int64_t(blockIdx.x) * rows + row) * kLstmClockCols + col] = clock_cycles();
}
// Row 0's entry stamps (clock, ns) and, at exit, its exit stamps.
__device__ __forceinline__ void clock_entry(int64_t* clk, int rows) {
  if (clk != nullptr && threadIdx.x == 0) {
    int64_t* r = clk + int64_t(blockIdx.x) * rows * kLstmClockCols;
    r[0] = clock_cycles();
    r[3] = global_ns();
  }
}
__device__ __forceinline__ void clock_exit(int64_t* clk, int rows) {
  if (clk == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t* r = clk + int64_t(blockIdx.x) * rows * kLstmClockCols;
    r[2] = clock_cycles();
    r[4] = global_ns();
  }
}

// rows x row_bytes (a multiple of 16) from global src (leading dimension src_ld bytes) to
// shared dst (dst_ld bytes), every address 16-byte aligned, the block's threads together:
// on the GPU each thread issues all its 16-byte units as cp.async copies through L2
// (cp.async.cg: no L1, so values other blocks wrote before a grid barrier are seen) and
// waits for them at the end; the caller's __syncthreads() then publishes the block's. With
// loads into registers and stores after them (4 in flight a thread) the grouped backward's
// 59 KB of dz columns a step took 4 L2 round trips (round 5: "dz staged" 3.7 us a step).
// Under the emulator: plain copies.
__device__ __forceinline__ void copy16_async(unsigned char* dst, const unsigned char* src) {
#ifdef CTXFAST_CUDA_EMULATION
  std::memcpy(dst, src, 16);
#else
  const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr), "l"(src) : "memory");
#endif
}
__device__ __forceinline__ void copy_async_wait_all() {
#ifndef CTXFAST_CUDA_EMULATION
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
__device__ __forceinline__ void copy_rows16(unsigned char* dst, int64_t dst_ld,
                                           const unsigned char* src, int64_t src_ld, int rows,
                                           int row_bytes) {
  const int upr = row_bytes / 16;
  const int total = rows * upr;
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    const int r = e / upr, u = e - r * upr;
    copy16_async(dst + r * dst_ld + u * 16, src + r * src_ld + u * 16);
  }
  copy_async_wait_all();
}

// ------------------------------------------------------------------ warp dot products
// One step of the reduce-scatter: the lane keeps the half of its HALF*2 partial sums whose
// index has bit log2(HALF) equal to its lane bit, adds the partner's copy of that half.
template <int HALF>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[32], int lane) {
  const bool upper = (lane & HALF) != 0;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float send = upper ? v[i] : v[i + HALF];
    const float keep = upper ? v[i + HALF] : v[i];
    v[i] = keep + __shfl_xor_sync(kFull, send, HALF);
  }
}

// 32 partial sums per lane in, the warp-wide total of sum index `lane` out (31 shuffles).
__device__ __forceinline__ float reduce_scatter32(float (&v)[32], int lane) {
  reduce_scatter_step<16>(v, lane);
  reduce_scatter_step<8>(v, lane);
  reduce_scatter_step<4>(v, lane);
  reduce_scatter_step<2>(v, lane);
  reduce_scatter_step<1>(v, lane);
  return v[0];
}

// Lane l returns dot(rows[l / 8], vecs[l % 8]) over k < K, for 4 rows (storage dtype TR)
// and 8 vectors (TV), in shared or global memory. All 32 lanes must call it.
template <typename TR, typename TV>
__device__ __forceinline__ float warp_dot_4x8(const TR* const (&rows)[4],
                                              const TV* const (&vecs)[kBT], int K, int lane) {
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
#pragma unroll 2
  for (int k = lane; k < K; k += 32) {
    float r[4], x[kBT];
#pragma unroll
    for (int q = 0; q < 4; ++q) r[q] = to_f(rows[q][k]);
#pragma unroll
    for (int b = 0; b < kBT; ++b) x[b] = to_f(vecs[b][k]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
#pragma unroll
      for (int b = 0; b < kBT; ++b) acc[q * kBT + b] = fmaf(r[q], x[b], acc[q * kBT + b]);
    }
  }
  return reduce_scatter32(acc, lane);
}

// ------------------------------------------------------------------ shared cell math
struct CellGrads {
  float dz[4];   // dL/dz for i, f, g, o
  float dc_prev; // dL/dc_{t-1}
  float hp;      // o * tanh(c)
};

// Backward of one cell. dhp = dL/dhp_t, dc = dL/dc_t from the later step, gc = grad_cells;
// cell_clip is the clip as stored (the gradient passes where |c| < cell_clip).
__device__ __forceinline__ CellGrads cell_backward(float i, float f, float g, float o, float c,
                                                   float c_prev, float dhp, float dc, float gc,
                                                   float cell_clip) {
  CellGrads r;
  const float tc = tanhf(c);
  r.hp = o * tc;
  float dcv = dc + gc + dhp * o * (1.0f - tc * tc);
  dcv = fabsf(c) < cell_clip ? dcv : 0.0f;
  r.dc_prev = dcv * f;
  r.dz[0] = dcv * g * i * (1.0f - i);
  r.dz[1] = dcv * c_prev * f * (1.0f - f);
  r.dz[2] = dcv * i * (1.0f - g * g);
  r.dz[3] = dhp * tc * o * (1.0f - o);
  return r;
}

// dL/dh_t as the step's input gradient: grad_out + carry, through the projection clip.
__device__ __forceinline__ float dh_in_value(float grad_out, float carry, float out, bool proj,
                                             float proj_clip) {
  const float d = grad_out + carry;
  return (!proj || fabsf(out) < proj_clip) ? d : 0.0f;
}

// The cell backward of step t, batch row b, unit j inside a persistent backward kernel
// (BwdParams or BwdMmaParams: the forward's gates and cells, grad_cells, the carried dc,
// hp and dz outputs): updates dc[b, j], writes hp (projection) and dz; returns the grads.
// What the cell backward of (t, b, j) reads: the forward's gates (i, f, g, o) and c_t,
// c_{t-1}, the carried dc and grad_cells.
struct CellIn {
  float gate[4], c, c_prev, dc, gc;
};

template <typename Params, typename T>
__device__ __forceinline__ CellIn cell_inputs_at(const Params& p, const T* c_prev, int t, int b,
                                                 int j) {
  const int64_t H = p.H, BH = int64_t(p.B) * H;
  const int64_t go = (int64_t(t) * p.B + b) * 4 * H + j;
  const int64_t ci = int64_t(b) * H + j;
  const int64_t co = int64_t(t) * BH + ci;
  CellIn in;
#pragma unroll
  for (int q = 0; q < 4; ++q) in.gate[q] = to_f(p.gates[go + int64_t(q) * H]);
  in.c = to_f(p.cells[co]);
  in.c_prev = to_f(c_prev[ci]);
  in.dc = p.dc[ci];
  in.gc = to_f(p.grad_cells[co]);
  return in;
}

// The cell backward of (t, b, j) from its inputs: updates dc[b, j], writes hp (projection)
// and dz; returns the grads.
template <typename Params>
__device__ __forceinline__ CellGrads cell_backward_from(const Params& p, const CellIn& in,
                                                        int t, int b, int j, float dhp) {
  const int64_t H = p.H, BH = int64_t(p.B) * H;
  const int64_t go = (int64_t(t) * p.B + b) * 4 * H + j;
  const int64_t ci = int64_t(b) * H + j;
  const int64_t co = int64_t(t) * BH + ci;
  const CellGrads r = cell_backward(in.gate[0], in.gate[1], in.gate[2], in.gate[3], in.c,
                                    in.c_prev, dhp, in.dc, in.gc, p.cell_clip_s);
  p.dc[ci] = r.dc_prev;
  if (p.proj) p.hp[co] = r.hp;
#pragma unroll
  for (int q = 0; q < 4; ++q) p.dz[go + int64_t(q) * H] = r.dz[q];
  return r;
}

template <typename Params, typename T>
__device__ __forceinline__ CellGrads cell_backward_at(const Params& p, const T* c_prev, int t,
                                                      int b, int j, float dhp) {
  return cell_backward_from(p, cell_inputs_at(p, c_prev, t, b, j), t, b, j, dhp);
}

// The cell inputs of step t (gates, cells, grad_cells) of batch row b, unit j, on their way
// to L2 (a persistent backward asks for the next step's while it runs this one).
template <typename Params>
__device__ __forceinline__ void prefetch_cell_inputs(const Params& p, int t, int b, int j) {
  const int64_t H = p.H;
  const int64_t go = (int64_t(t) * p.B + b) * 4 * H + j;
  const int64_t co = (int64_t(t) * p.B + b) * H + j;
#pragma unroll
  for (int q = 0; q < 4; ++q) prefetch_l2(p.gates + go + int64_t(q) * H);
  prefetch_l2(p.cells + co);
  prefetch_l2(p.grad_cells + co);
}

// ------------------------------------------------------------------ persistent kernels
template <typename T>
struct FwdParams {
  const T* xw; const T* w_hh; const T* mask; const T* w_hr;
  float* h32; float* c32; float* hp32;
  T* out; T* cells; T* gates;
  int T_, B, H, P, units;
  bool proj, reverse;
  bool tf32_one;  // unused by the CUDA-core kernels (LstmDims::tf32_one)
  float scale_eff, cell_clip, cell_clip_s, cell_below, proj_clip, proj_clip_s, proj_below;
  int64_t* clk;  // LstmDims::phase_clock (unused by the CUDA-core kernels)
};

// Shared memory of the persistent kernels: the block's rows of w_hh * mask, row-major
// [4U, P] with local row 4*u + gate (u = unit within the block).
template <typename T>
__device__ void load_weight_slice(T* ws, const T* w_hh, const T* mask, int j0, int nu, int H,
                                  int P) {
  const int64_t n = int64_t(4) * nu * P;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int rl = static_cast<int>(e / P);
    const int k = static_cast<int>(e - int64_t(rl) * P);
    const int64_t src = (int64_t((rl & 3)) * H + j0 + (rl >> 2)) * P + k;
    float w = to_f(w_hh[src]);
    if (mask) w *= to_f(mask[src]);  // 0/1: exact in the storage dtype
    ws[e] = from_f<T>(w);
  }
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
lstm_fwd_persistent_kernel(const FwdParams<T> p) {
  CTXFAST_DYNAMIC_SMEM(smem);
  const int P = p.P, H = p.H, B = p.B;
  T* ws = reinterpret_cast<T*>(smem);                                      // [4U, P]
  const size_t ws_bytes = align16(sizeof(T) * 4 * size_t(p.units) * P);
  float* hs = reinterpret_cast<float*>(smem + ws_bytes);                   // [8, P]
  const int j0 = blockIdx.x * p.units;
  const int nu = min(p.units, H - j0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int nbt = (B + kBT - 1) / kBT;
  load_weight_slice(ws, p.w_hh, p.mask, j0, nu, H, P);
  cg::grid_group grid = cg::this_grid();

  for (int s = 0; s < p.T_; ++s) {
    const int t = p.reverse ? p.T_ - 1 - s : s;
    const float* hprev = p.h32 + int64_t(s & 1) * B * P;
    float* hnext = p.h32 + int64_t((s + 1) & 1) * B * P;
    // ---- phase 1: gates and cell of the block's units
    for (int bt = 0; bt < nbt; ++bt) {
      const int b0 = bt * kBT;
      __syncthreads();  // the previous tile's readers are done (and the weights are loaded)
      for (int e = threadIdx.x; e < kBT * P; e += blockDim.x) {
        const int bb = e / P, k = e - bb * P;
        hs[e] = (b0 + bb < B) ? hprev[int64_t(b0 + bb) * P + k] : 0.0f;
      }
      __syncthreads();
      const float* const vecs[kBT] = {hs, hs + P, hs + 2 * P, hs + 3 * P,
                                      hs + 4 * P, hs + 5 * P, hs + 6 * P, hs + 7 * P};
      for (int u = warp; u < nu; u += nwarps) {  // warp-uniform
        const int j = j0 + u;
        const int q = lane >> 3, bb = lane & 7, b = b0 + bb;
        const bool valid = b < B;
        const int64_t zoff = (int64_t(t) * B + b) * 4 * H + int64_t(q) * H + j;
        const float xv = valid ? to_f(p.xw[zoff]) : 0.0f;  // issued before the dot
        const T* const rows[4] = {ws + int64_t(4 * u) * P, ws + int64_t(4 * u + 1) * P,
                                  ws + int64_t(4 * u + 2) * P, ws + int64_t(4 * u + 3) * P};
        const float acc = warp_dot_4x8(rows, vecs, P, lane);
        const float z = fmaf(p.scale_eff, acc, xv);
        const float a = (q == 2) ? tanhf(z) : sigmoid_f(z);
        if (valid) p.gates[zoff] = from_f<T>(a);
        const float ai = __shfl_sync(kFull, a, bb);
        const float af = __shfl_sync(kFull, a, 8 + bb);
        const float ag = __shfl_sync(kFull, a, 16 + bb);
        const float ao = __shfl_sync(kFull, a, 24 + bb);
        if (lane < kBT && valid) {
          const int64_t ci = int64_t(b) * H + j;
          const float c = clamp_f(fmaf(af, p.c32[ci], ai * ag), p.cell_clip);
          p.c32[ci] = c;
          store_clipped(p.cells + int64_t(t) * B * H + ci, c, p.cell_clip, p.cell_clip_s,
                        p.cell_below);
          const float hp = ao * tanhf(c);
          if (p.proj) {
            p.hp32[ci] = hp;
          } else {
            p.out[int64_t(t) * B * P + int64_t(b) * P + j] = from_f<T>(hp);
            hnext[int64_t(b) * P + j] = hp;
          }
        }
      }
    }
    grid.sync();
    if (!p.proj) continue;
    // ---- phase 2: h_t = clamp(hp_t @ w_hr^T), 4 rows x 8 batch rows per warp item
    const int npg = (P + 3) / 4;
    const int nitems = npg * nbt;
    const int gw = blockIdx.x * nwarps + warp, gstride = gridDim.x * nwarps;
    for (int it = gw; it < nitems; it += gstride) {  // warp-uniform
      const int pg = it / nbt, bt = it - pg * nbt, b0 = bt * kBT;
      const T* rows[4];
      const float* vecs[kBT];
#pragma unroll
      for (int r = 0; r < 4; ++r) rows[r] = p.w_hr + int64_t(min(pg * 4 + r, P - 1)) * H;
#pragma unroll
      for (int bb = 0; bb < kBT; ++bb) vecs[bb] = p.hp32 + int64_t(min(b0 + bb, B - 1)) * H;
      const float acc = warp_dot_4x8<T, float>(rows, vecs, H, lane);
      const int pi = pg * 4 + (lane >> 3), b = b0 + (lane & 7);
      if (pi < P && b < B) {
        const float y = clamp_f(acc, p.proj_clip);
        store_clipped(p.out + int64_t(t) * B * P + int64_t(b) * P + pi, y, p.proj_clip,
                      p.proj_clip_s, p.proj_below);
        hnext[int64_t(b) * P + pi] = y;
      }
    }
    grid.sync();
  }
}

template <typename T>
struct BwdParams {
  const T* grad_out; const T* grad_cells; const T* out; const T* cells; const T* gates;
  const T* c0; const T* w_hh; const T* mask; const T* w_hr_t;
  float* dh_in; float* dc; float* part; float* dz; float* hp; float* grad_h0;
  int T_, B, H, P, units;
  bool proj, reverse;
  bool tf32_one;  // unused by the CUDA-core kernels (LstmDims::tf32_one)
  float scale_eff, cell_clip_s, proj_clip_s;  // the clips as stored (see lstm.h)
  int64_t* clk;  // LstmDims::phase_clock (unused by the CUDA-core kernels)
};

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
lstm_bwd_persistent_kernel(const BwdParams<T> p) {
  CTXFAST_DYNAMIC_SMEM(smem);
  const int P = p.P, H = p.H, B = p.B, U = p.units;
  const int nbt = (B + kBT - 1) / kBT, Bpad = nbt * kBT;
  const size_t ws_bytes = align16(sizeof(T) * 4 * size_t(U) * P);
  const size_t dzs_bytes = align16(sizeof(float) * size_t(Bpad) * 4 * U);
  T* ws = reinterpret_cast<T*>(smem);                                  // [4U, P]
  float* dzs = reinterpret_cast<float*>(smem + ws_bytes);             // [Bpad, 4U]
  float* hs = reinterpret_cast<float*>(smem + ws_bytes + dzs_bytes);  // [8, P] (proj)
  const int j0 = blockIdx.x * U;
  const int nu = min(U, H - j0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int64_t BP = int64_t(B) * P, BH = int64_t(B) * H;
  load_weight_slice(ws, p.w_hh, p.mask, j0, nu, H, P);
  for (int e = threadIdx.x; e < Bpad * 4 * U; e += blockDim.x) dzs[e] = 0.0f;
  cg::grid_group grid = cg::this_grid();
  const int64_t gtid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t gthreads = int64_t(gridDim.x) * blockDim.x;

  // dh_in of the first step processed (the forward's last): no carry yet.
  {
    const int t = p.reverse ? 0 : p.T_ - 1;
    for (int64_t e = gtid; e < BP; e += gthreads) {
      const int64_t o = int64_t(t) * BP + e;
      p.dh_in[o] = dh_in_value(to_f(p.grad_out[o]), 0.0f, to_f(p.out[o]), p.proj, p.proj_clip_s);
    }
  }
  grid.sync();

  for (int s = p.T_ - 1; s >= 0; --s) {
    const int t = p.reverse ? p.T_ - 1 - s : s;
    const int tp = p.reverse ? t + 1 : t - 1;  // the forward's previous step (if s > 0)
    const T* c_prev = s > 0 ? p.cells + int64_t(tp) * BH : p.c0;
    const float* dh_t = p.dh_in + int64_t(t) * BP;
    // ---- phase 1: cell backward of the block's units; dz to global and shared memory
    const int ngroups = (nu + 3) / 4;
    for (int bt = 0; bt < nbt; ++bt) {
      const int b0 = bt * kBT;
      if (p.proj) {
        __syncthreads();
        for (int e = threadIdx.x; e < kBT * P; e += blockDim.x) {
          const int bb = e / P, k = e - bb * P;
          hs[e] = (b0 + bb < B) ? dh_t[int64_t(b0 + bb) * P + k] : 0.0f;
        }
        __syncthreads();
      }
      for (int g = warp; g < ngroups; g += nwarps) {  // warp-uniform
        const int u = g * 4 + (lane >> 3), b = b0 + (lane & 7);
        const bool valid = u < nu && b < B;
        const int j = j0 + u;
        float dhp;
        if (p.proj) {
          // dL/dhp[b, j] = sum_p dh_in[b, p] * w_hr[p, j] = dh_in[b] . w_hr_t[j]
          const T* rows[4];
          const float* vecs[kBT];
#pragma unroll
          for (int r = 0; r < 4; ++r) rows[r] = p.w_hr_t + int64_t(j0 + min(g * 4 + r, nu - 1)) * P;
#pragma unroll
          for (int bb = 0; bb < kBT; ++bb) vecs[bb] = hs + bb * P;
          dhp = warp_dot_4x8<T, float>(rows, vecs, P, lane);
        } else {
          dhp = valid ? dh_t[int64_t(b) * P + j] : 0.0f;  // P == H
        }
        if (valid) {
          const CellGrads r = cell_backward_at(p, c_prev, t, b, j, dhp);
#pragma unroll
          for (int q = 0; q < 4; ++q) dzs[b * 4 * U + 4 * u + q] = r.dz[q];
        }
      }
    }
    __syncthreads();
    // ---- block partial of dL/dh_{t-1}[b, k] = sum over the block's rows of dz[b, r] W[r, k]
    for (int bt = 0; bt < nbt; ++bt) {
      const int b0 = bt * kBT;
      for (int k = threadIdx.x; k < P; k += blockDim.x) {
        float acc[kBT];
#pragma unroll
        for (int bb = 0; bb < kBT; ++bb) acc[bb] = 0.0f;
        for (int r4 = 0; r4 < 4 * nu; r4 += 4) {
          const float w0 = to_f(ws[int64_t(r4) * P + k]);
          const float w1 = to_f(ws[int64_t(r4 + 1) * P + k]);
          const float w2 = to_f(ws[int64_t(r4 + 2) * P + k]);
          const float w3 = to_f(ws[int64_t(r4 + 3) * P + k]);
#pragma unroll
          for (int bb = 0; bb < kBT; ++bb) {
            const float4 d = *reinterpret_cast<const float4*>(dzs + (b0 + bb) * 4 * U + r4);
            acc[bb] = fmaf(d.x, w0, fmaf(d.y, w1, fmaf(d.z, w2, fmaf(d.w, w3, acc[bb]))));
          }
        }
#pragma unroll
        for (int bb = 0; bb < kBT; ++bb) {
          if (b0 + bb < B) p.part[int64_t(blockIdx.x) * BP + int64_t(b0 + bb) * P + k] = acc[bb];
        }
      }
    }
    grid.sync();
    // ---- phase 2: sum the partials; dh_in of the next step processed, or grad_h0
    for (int64_t e = gtid; e < BP; e += gthreads) {
      float carry = 0.0f;
      for (int blk = 0; blk < static_cast<int>(gridDim.x); ++blk) carry += p.part[blk * BP + e];
      carry *= p.scale_eff;
      if (s > 0) {
        const int64_t o = int64_t(tp) * BP + e;
        p.dh_in[o] = dh_in_value(to_f(p.grad_out[o]), carry, to_f(p.out[o]), p.proj,
                                 p.proj_clip_s);
      } else {
        p.grad_h0[e] = carry;
      }
    }
    grid.sync();
  }
}


// ------------------------------------------------------------------ tensor-core kernels
// The same persistent schedule as above, with each step's products on the tensor cores
// (WMMA 16 x 16 tiles; bf16/fp16 operands as stored, float32 as tf32x3), the projection's
// included.
//
// Block k owns units [k*U, k*U + U) as above: its 4U rows of w_hh * mask (row 4u + gate)
// are kept in shared memory as operands, [wrows, kld]: wrows = 4U rounded up to the MMA's
// K step (and at least 16), zero past P and past the last unit; kld = P rounded up to 16
// plus a 32-byte skew (rows fall on different banks; every tile start stays 32-byte
// aligned, as WMMA requires). 4U need not be a multiple of 16: the forward's row tiles
// start at min(16 m, max(4U, 16) - 16), so the last one overlaps its neighbour (the
// overlapped rows are computed twice, identically) instead of needing padding rows; this
// is what lets the float32 weights of a 1152-wide layer fit (U = 9 on 132 SMs).
//
// Forward. h_{t-1} lives in a global operand buffer hop[2][bpad][kld] (ping-pong by step
// parity, zero outside [B, P]), written by the step that computed it. Per step:
//   phase 1: z^T[4U, B] = W_slice . h_{t-1}^T. Warp items are (batch tile of 16, slice of
//            the K range); each holds its row tiles' accumulators, reads h's tiles from L2
//            (the next three K steps' tiles in flight while one multiplies) and the weight
//            tiles from shared memory, and writes its partial sums to a shared
//            [ksplit, max(4U, 16), bpad + 8] float buffer.  __syncthreads()
//   phase 2: one (batch row, unit) per thread: the K slices summed, + xw, gates, cell,
//            outputs, and h_t into the other operand buffer (the next step's xw is
//            prefetched into L2 meanwhile).  grid.sync()
//   with a projection, phase 2 keeps hp_t of the block's units as operands in shared
//   memory instead; phase 3: the block's partial of h_t = hp_t . w_hr^T over its units
//   (tensor cores, its columns of w_hr held in shared memory) into ypart[block];
//   grid.sync(); the partials summed, clipped, stored and written as h_t's operands.
//   grid.sync()
// Backward, per step: (with a projection, phase 0: dL/dhp of the block's units = dh_t .
// w_hr[:, units] on the tensor cores, from dh_t's operand copy, K sliced over the warps;
// __syncthreads()) phase 1 the cell backward of the block's (batch row, unit) pairs, dz to
// global memory and its operand copy to shared memory [bpad, wrows + skew] (zero columns
// past 4U); phase 2 the block's partial of dL/dh_{t-1} = dz_slice[B, wrows] .
// W_slice[wrows, P] on the tensor cores into its slot of part[blocks][bpad][kp];
// grid.sync(); phase 3 the partials summed (deterministically), dh_{t-1} and its operand
// copy written.  grid.sync()
// float32: every product as a_hi b_hi + a_hi b_lo + a_lo b_hi with tf32 halves (the
// a_lo b_lo term, ~2^-22 relative, dropped): float32-level error on the tensor cores; or,
// with tf32_one (torch allows TF32 for cuDNN's RNNs, as nn.LSTM reads it), one product
// a_hi b_hi: TF32's error, a third of the MMAs and no operand splits.
namespace wmma = nvcuda::wmma;

constexpr int kMmaMaxMT = 8;     // at most 8 row tiles per block: 4U <= 128 (U <= 32)
constexpr int kMmaMaxUnits = 4 * kMmaMaxMT;
constexpr int kMmaWarps = 8;
// (batch row, unit) pairs a thread of a cell phase loads together before computing them
constexpr int kCellBatch = 4;

// A cell phase over pairs e < n, one per thread, a thread's pairs kCellBatch at a time:
// load(k, e) for each pair of the batch (its global loads, into the caller's slot k), then
// use(k, e) for each (the math and the stores): every load of a batch goes out before its
// first store, so one L2 round trip per batch instead of one per pair (stores between
// pairs keep the compiler from moving a later pair's loads ahead).
template <typename Load, typename Use>
__device__ __forceinline__ void cell_batches(int n, Load&& load, Use&& use) {
  const int nt = static_cast<int>(blockDim.x);
  for (int e0 = static_cast<int>(threadIdx.x); e0 < n; e0 += kCellBatch * nt) {
#pragma unroll
    for (int k = 0; k < kCellBatch; ++k)
      if (e0 + k * nt < n) load(k, e0 + k * nt);
#pragma unroll
    for (int k = 0; k < kCellBatch; ++k) {
      if (e0 + k * nt >= n) break;
      use(k, e0 + k * nt);
    }
  }
}

template <typename T> struct MmaOperand;
template <> struct MmaOperand<__nv_bfloat16> {
  using Op = __nv_bfloat16;  // operand element in memory
  using Frag = __nv_bfloat16;  // WMMA element type
  static constexpr int K = 16;
  static constexpr bool kSplit = false;
};
template <> struct MmaOperand<__half> {
  using Op = __half;
  using Frag = __half;
  static constexpr int K = 16;
  static constexpr bool kSplit = false;
};
template <> struct MmaOperand<float> {
  using Op = float;
  using Frag = wmma::precision::tf32;
  static constexpr int K = 8;
  static constexpr bool kSplit = true;
};

template <typename T, typename Layout>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, MmaOperand<T>::K,
                             typename MmaOperand<T>::Frag, Layout>;
template <typename T, typename Layout>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, MmaOperand<T>::K,
                             typename MmaOperand<T>::Frag, Layout>;
template <typename T>
using FragC = wmma::fragment<wmma::accumulator, 16, 16, MmaOperand<T>::K, float>;

// x -> (hi, lo) tf32 halves, in place: hi = tf32(x), lo = tf32(x - hi).
template <typename F>
__device__ __forceinline__ void split_tf32(F& hi, F& lo) {
#pragma unroll
  for (int i = 0; i < hi.num_elements; ++i) {
    const float v = hi.x[i];
    const float h = wmma::__float_to_tf32(v);
    hi.x[i] = h;
    lo.x[i] = wmma::__float_to_tf32(v - h);
  }
}

// x -> tf32(x), in place (the one-product mode's operands).
template <typename F>
__device__ __forceinline__ void round_tf32(F& x) {
#pragma unroll
  for (int i = 0; i < x.num_elements; ++i) x.x[i] = wmma::__float_to_tf32(x.x[i]);
}

// A B operand as mma_step takes it (float32 only; nothing otherwise): split into tf32
// halves (b, b_lo), or rounded to tf32 when `one`.
template <typename T, typename FB>
__device__ __forceinline__ void prepare_b(FB& b, FB& b_lo, bool one) {
  if constexpr (MmaOperand<T>::kSplit) {
    if (one) {
      round_tf32(b);
    } else {
      split_tf32(b, b_lo);
    }
  }
}

// acc += a . b; b_lo is b's low tf32 half (float32 without `one` only; unused otherwise).
// a is split (or, with `one`, rounded) here.
template <typename T, typename FA, typename FB>
__device__ __forceinline__ void mma_step(FragC<T>& acc, FA& a, const FB& b, const FB& b_lo,
                                         bool one) {
  if constexpr (MmaOperand<T>::kSplit) {
    if (one) {
      round_tf32(a);
    } else {
      FA a_lo;
      split_tf32(a, a_lo);
      wmma::mma_sync(acc, a_lo, b, acc);
      wmma::mma_sync(acc, a, b_lo, acc);
    }
  }
  wmma::mma_sync(acc, a, b, acc);
}

// x as an operand in memory; float32 with `tf32`: already rounded to tf32 (cvt.rna), so
// that the MMAs can take it as it is (a stored operand read every step is rounded once).
template <typename Op>
__device__ __forceinline__ Op as_operand(float x, bool tf32) {
  if constexpr (std::is_same_v<Op, float>) {
    return tf32 ? wmma::__float_to_tf32(x) : x;
  } else {
    (void)tf32;
    return from_f<Op>(x);
  }
}

// Row skew of an operand matrix in shared memory, in elements: 32 bytes.
template <typename Op>
__host__ __device__ constexpr int mma_skew() { return 32 / static_cast<int>(sizeof(Op)); }

__host__ __device__ constexpr size_t align128(size_t n) { return (n + 127) & ~size_t(127); }

// Stored weight rows: 4U rounded up to the K step kk (the backward's products run over
// them), at least one 16-row tile.
__host__ __device__ constexpr int mma_weight_rows(int units, int kk) {
  return ((4 * units + kk - 1) / kk * kk) < 16 ? 16 : (4 * units + kk - 1) / kk * kk;
}

// The block's rows of w_hh * mask as operands, [wrows, kld], row 4u + gate; zero past P
// and for units past the last one (and in the rounding rows); tf32: rounded to tf32
// (float32 only; as_operand).
template <typename T, typename Op>
__device__ void load_weight_slice_mma(Op* ws, const T* w_hh, const T* mask, int j0, int nu,
                                      int wrows, int H, int P, int kld, bool tf32) {
  const int64_t n = int64_t(wrows) * kld;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int rl = static_cast<int>(e / kld);
    const int k = static_cast<int>(e - int64_t(rl) * kld);
    float w = 0.0f;
    if ((rl >> 2) < nu && k < P) {
      const int64_t src = (int64_t(rl & 3) * H + j0 + (rl >> 2)) * P + k;
      w = to_f(w_hh[src]);
      if (mask) w *= to_f(mask[src]);  // 0/1: exact
    }
    ws[e] = as_operand<Op>(w, tf32);
  }
}

template <typename T>
struct FwdMmaParams {
  const T* xw; const T* w_hh; const T* mask; const T* w_hr;  // w_hr [P, H] or null
  const float* h0;                      // [B, P]
  typename MmaOperand<T>::Op* hop;      // [2, bpad, kld], zero-filled by the caller
  float* c32;                           // [B, H]: c0 in, c_T out
  float* ypart;                         // projection: [blocks, bpad, kp] partial h_t
  T* out; T* cells; T* gates;
  int T_, B, H, P, units, bpad, kp, kld, ksplit;
  bool proj, reverse;
  bool tf32_one;  // float32: one tf32 product per MMA instead of tf32x3 (LstmDims::tf32_one)
  int ring;       // h tiles in flight + 1 in phase 1 (LstmDims::ring: 4 or 8)
  float scale_eff, cell_clip, cell_clip_s, cell_below, proj_clip, proj_clip_s, proj_below;
  int64_t* clk;  // LstmDims::phase_clock: [blocks, T + 1, kLstmClockCols] or null
};

// The projection's operand rows per block: its units rounded up to the K step (>= 16).
__host__ __device__ constexpr int mma_unit_rows(int units, int kk) {
  return ((units + kk - 1) / kk * kk) < 16 ? 16 : (units + kk - 1) / kk * kk;
}

// acc[m] += W rows of tile m . h tile b, for the block's row tiles (first row of tile m:
// min(16 m, mrows - 16)); kt: the K step. float32 with one tf32 product: both operands
// were stored rounded to tf32 (as_operand), so they go to the MMA as loaded.
template <typename T, typename Op, typename FB>
__device__ __forceinline__ void fwd_tile_products(FragC<T> (&acc)[kMmaMaxMT], const Op* ws,
                                                  int kld, int mrows, int MT, int kt, FB& b,
                                                  bool one) {
  FB b_lo;
  if (!one) prepare_b<T>(b, b_lo, one);  // (16-bit: nothing to prepare)
#pragma unroll
  for (int mt = 0; mt < kMmaMaxMT; ++mt) {
    if (mt < MT) {
      const int r0 = min(mt * 16, mrows - 16);
      FragA<T, wmma::row_major> a;
      wmma::load_matrix_sync(a, ws + int64_t(r0) * kld + kt * MmaOperand<T>::K, kld);
      if (one) {
        wmma::mma_sync(acc[mt], a, b, acc[mt]);
      } else {
        mma_step<T>(acc[mt], a, b, b_lo, one);
      }
    }
  }
}

// acc[m] += W rows of tile m . h tiles [k_lo, k_lo + n_k) (hk: the first, h^T tile (k, n)
// at hk[n * kld + k]), the h tiles loaded through a ring of R fragments: R - 1 loads in
// flight ahead of the tile being multiplied (each a dependent L2 load: Little's law says the
// bytes in flight, not the products, set the speed of this loop).
template <int R, typename T, typename Op>
__device__ __forceinline__ void fwd_ring_products(FragC<T> (&acc)[kMmaMaxMT], const Op* ws,
                                                  int kld, int mrows, int MT, int k_lo,
                                                  const Op* hk, int n_k, bool one) {
  constexpr int KK = MmaOperand<T>::K;
  FragB<T, wmma::col_major> ring[R];
#pragma unroll
  for (int r = 0; r < R - 1; ++r)
    if (r < n_k) wmma::load_matrix_sync(ring[r], hk + int64_t(r) * KK, kld);
  for (int i = 0; i < n_k; i += R) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (i + r >= n_k) break;
      if (i + r + R - 1 < n_k)  // into the slot of the tile the last step multiplied
        wmma::load_matrix_sync(ring[(r + R - 1) % R], hk + int64_t(i + r + R - 1) * KK, kld);
      fwd_tile_products<T>(acc, ws, kld, mrows, MT, k_lo + i + r, ring[r], one);
    }
  }
}

// out[MT x NT tiles of 16 x 16, ldo] = A[MT*16, KT*kk] (row-major, lda) . B[KT*kk, NT*16]
// (row-major, ldb); A and B operands in memory (float32 with one tf32 product: stored
// rounded to tf32, as_operand, and taken as loaded). A warp item is one row tile and up to
// G column tiles (the fewest per item that still give every warp an item): its K loop
// loads the A fragment once for the group and keeps that many independent accumulator
// chains in flight (one tile per item was one dependent load-MMA chain per warp: round 5's
// phase clock had the grouped backward's products at 12.7 us of a 29 us step). Each tile
// adds its K steps in the same order whatever G: the same bits. The backwards take
// kTileGroup; the forward's projection 1 (with 4 its kernel, which holds the ring of h
// tiles, spilled 8 B on sm_90).
constexpr int kTileGroup = 4;

template <typename T, int G = kTileGroup, typename Op>
__device__ __forceinline__ void block_tiles_product(const Op* A, int lda, const Op* Bm, int ldb,
                                                    int MT, int NT, int KT, float* out,
                                                    int64_t ldo, int warp, int nwarps,
                                                    bool one) {
  constexpr int KK = MmaOperand<T>::K;
  // column tiles per item: NT spread over the warps each row tile gets, at most kTileGroup
  const int per_row = nwarps / MT < 1 ? 1 : nwarps / MT;
  int nb = (NT + per_row - 1) / per_row;
  nb = nb < 1 ? 1 : (nb > G ? G : nb);
  const int groups = (NT + nb - 1) / nb;
  for (int it = warp; it < MT * groups; it += nwarps) {  // warp-uniform
    const int mt = it % MT, nt0 = (it / MT) * nb;
    const int cnt = NT - nt0 < nb ? NT - nt0 : nb;
    FragC<T> acc[G];
#pragma unroll
    for (int i = 0; i < G; ++i) wmma::fill_fragment(acc[i], 0.0f);
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      FragA<T, wmma::row_major> a, a_lo;
      wmma::load_matrix_sync(a, A + int64_t(mt) * 16 * lda + kt * KK, lda);
      // float32 tf32x3: a split once for the group (mma_step's order per tile: a_lo.b,
      // a.b_lo, a.b); with one tf32 product a was stored rounded and is taken as loaded
      if constexpr (MmaOperand<T>::kSplit) {
        if (!one) split_tf32(a, a_lo);
      }
#pragma unroll
      for (int i = 0; i < G; ++i) {
        if (i < cnt) {
          FragB<T, wmma::row_major> b, b_lo;
          wmma::load_matrix_sync(b, Bm + int64_t(kt) * KK * ldb + (nt0 + i) * 16, ldb);
          if constexpr (MmaOperand<T>::kSplit) {
            if (!one) {
              split_tf32(b, b_lo);
              wmma::mma_sync(acc[i], a_lo, b, acc[i]);
              wmma::mma_sync(acc[i], a, b_lo, acc[i]);
            }
          }
          wmma::mma_sync(acc[i], a, b, acc[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      if (i < cnt) {
        wmma::store_matrix_sync(out + int64_t(mt) * 16 * ldo + (nt0 + i) * 16, acc[i],
                                static_cast<unsigned>(ldo), wmma::mem_row_major);
      }
    }
  }
}

// sum over blk < n of x[blk * stride]: the per-block partials of one element, read 16 at a
// time, all 16 loads issued before the first add (predicated past n), then summed as a
// tree in a fixed order (deterministic). With 4 loads in flight and a remainder loop of
// dependent loads, the grouped backward's 10 partials (bf16, ULMFiT) took 4 L2 round
// trips and float32's 29 took 8 where they take 1 and 2 now; the per-block backward's 128
// 32 where they take 8.
__device__ __forceinline__ float sum_partials(const float* x, int64_t stride, int n) {
  constexpr int W = 16;
  float total = 0.0f;
  for (int blk = 0; blk < n; blk += W) {
    float v[W];
#pragma unroll
    for (int i = 0; i < W; ++i) v[i] = blk + i < n ? x[int64_t(blk + i) * stride] : 0.0f;
#pragma unroll
    for (int w = W / 2; w >= 1; w /= 2) {
#pragma unroll
      for (int i = 0; i < w; ++i) v[i] += v[i + w];
    }
    total += v[0];
  }
  return total;
}

// Shared memory of the tensor-core forward, in order: ws [wrows, kld] operands, zs
// [ksplit, mrows, bpad + 8] float, and with a projection wr [urows, kp + skew] operands
// (wr[u][p] = w_hr[p, j0 + u]) and hps [bpad, urows + skew] operands (hp of the block's
// units). Offsets of each, from the start; returns the total.
struct FwdMmaSmem {
  size_t zs, wr, hps, total;
};
__host__ __device__ inline FwdMmaSmem fwd_mma_smem(int units, int bpad, int kp, int kld,
                                                   int ksplit, bool proj, int esize, int kk) {
  const int wrows = mma_weight_rows(units, kk), mrows = 4 * units < 16 ? 16 : 4 * units;
  const int skew = 32 / esize, urows = mma_unit_rows(units, kk);
  FwdMmaSmem m;
  m.zs = align128(size_t(esize) * wrows * kld);
  m.wr = m.zs + align128(sizeof(float) * ksplit * mrows * (bpad + 8));
  m.hps = m.wr + (proj ? align128(size_t(esize) * urows * (kp + skew)) : 0);
  m.total = m.hps + (proj ? size_t(esize) * bpad * (urows + skew) : 0);
  return m;
}

template <typename T>
__global__ void __launch_bounds__(kMmaWarps * 32, 1)
lstm_fwd_mma_kernel(const FwdMmaParams<T> p) {
  using Op = typename MmaOperand<T>::Op;
  constexpr int KK = MmaOperand<T>::K;
  CTXFAST_DYNAMIC_SMEM(smem);
  const int H = p.H, B = p.B, P = p.P, U = p.units, rows = 4 * U;
  const int wrows = mma_weight_rows(U, KK), mrows = rows < 16 ? 16 : rows;
  const int kld = p.kld, bpad = p.bpad, kp = p.kp, nld = bpad + 8;
  const int MT = (mrows + 15) / 16, NT = bpad / 16, KT = kp / KK;
  const int urows = mma_unit_rows(U, KK), wld = kp + mma_skew<Op>(), hld = urows + mma_skew<Op>();
  const FwdMmaSmem lay = fwd_mma_smem(U, bpad, kp, kld, p.ksplit, p.proj, sizeof(Op), KK);
  Op* ws = reinterpret_cast<Op*>(smem);                  // [wrows, kld]
  float* zs = reinterpret_cast<float*>(smem + lay.zs);   // [ksplit, mrows, nld]
  Op* wr = reinterpret_cast<Op*>(smem + lay.wr);         // [urows, wld] (projection)
  Op* hps = reinterpret_cast<Op*>(smem + lay.hps);       // [bpad, hld] (projection)
  const int j0 = blockIdx.x * U;
  const int nu = min(U, H - j0);
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t gtid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t gthreads = int64_t(gridDim.x) * blockDim.x;
  const int crows = p.T_ + 1;  // the phase clock's rows (profiling)
  clock_entry(p.clk, crows);
  // float32 with one tf32 product: W and h stored as tf32 (rounded once, not per MMA)
  const bool pre = p.tf32_one && MmaOperand<T>::kSplit;
  load_weight_slice_mma(ws, p.w_hh, p.mask, j0, nu, wrows, H, P, kld, pre);
  if (p.proj) {
    for (int e = threadIdx.x; e < urows * wld; e += blockDim.x) {
      const int u = e / wld, k = e - u * wld;
      wr[e] = as_operand<Op>(u < nu && k < P ? to_f(p.w_hr[int64_t(k) * H + j0 + u]) : 0.0f,
                             pre);
    }
    for (int e = threadIdx.x; e < bpad * hld; e += blockDim.x) hps[e] = from_f<Op>(0.0f);
  }
  for (int64_t e = gtid; e < int64_t(B) * P; e += gthreads) {  // h0 as operands
    const int64_t b = e / P, k = e - b * P;
    p.hop[b * kld + k] = as_operand<Op>(p.h0[e], pre);
  }
  cg::grid_group grid = cg::this_grid();
  grid.sync();
  phase_stamp(p.clk, crows, 0, 1);
  const int items = NT * p.ksplit;

  for (int s = 0; s < p.T_; ++s) {
    const int t = p.reverse ? p.T_ - 1 - s : s;
    const Op* hprev = p.hop + int64_t(s & 1) * bpad * kld;
    Op* hnext = p.hop + int64_t((s + 1) & 1) * bpad * kld;
    // ---- phase 1: z^T = W_slice . h_{t-1}^T, warp items (batch tile, K slice)
    for (int it = warp; it < items; it += nwarps) {  // warp-uniform
      const int nt = it % NT, ks = it / NT;
      const int k_lo = ks * KT / p.ksplit, k_hi = (ks + 1) * KT / p.ksplit;
      const Op* hb = hprev + int64_t(nt) * 16 * kld;  // h^T tile (k, n) at hb[n * kld + k]
      FragC<T> acc[kMmaMaxMT];
#pragma unroll
      for (int mt = 0; mt < kMmaMaxMT; ++mt) wmma::fill_fragment(acc[mt], 0.0f);
      // h tiles in a ring of p.ring (LstmDims::ring): the loads of the next ring - 1 K
      // steps are in flight (from L2) while this step's tile multiplies the weight rows.
      const int n_k = k_hi - k_lo;
      const Op* hk = hb + int64_t(k_lo) * KK;
      if (p.ring == 8) {
        fwd_ring_products<8, T>(acc, ws, kld, mrows, MT, k_lo, hk, n_k, p.tf32_one);
      } else {
        fwd_ring_products<4, T>(acc, ws, kld, mrows, MT, k_lo, hk, n_k, p.tf32_one);
      }
#pragma unroll
      for (int mt = 0; mt < kMmaMaxMT; ++mt) {
        if (mt < MT) {
          const int r0 = min(mt * 16, mrows - 16);
          wmma::store_matrix_sync(zs + (int64_t(ks) * mrows + r0) * nld + nt * 16, acc[mt],
                                  nld, wmma::mem_row_major);
        }
      }
    }
    __syncthreads();
    phase_stamp(p.clk, crows, 1 + s, 0);
    // ---- phase 2: gates and cell, one (batch row, unit) per thread (cell_batches: xw and
    // c of a batch of pairs loaded before any is used)
    const int t_next = p.reverse ? t - 1 : t + 1;
    float xv[kCellBatch][4], cv[kCellBatch];
    cell_batches(B * nu, [&](int k, int e) {
      const int b = e / nu, j = j0 + (e - b * nu);
      const int64_t go = (int64_t(t) * B + b) * 4 * H + j;
#pragma unroll
      for (int q = 0; q < 4; ++q) xv[k][q] = to_f(p.xw[go + int64_t(q) * H]);
      cv[k] = p.c32[int64_t(b) * H + j];
    }, [&](int k, int e) {
      const int b = e / nu, u = e - b * nu, j = j0 + u;
      const int64_t go = (int64_t(t) * B + b) * 4 * H + j;
      if (s + 1 < p.T_) {  // the next step's xw on its way to L2 while this step runs
#pragma unroll
        for (int q = 0; q < 4; ++q)
          prefetch_l2(p.xw + (int64_t(t_next) * B + b) * 4 * H + int64_t(q) * H + j);
      }
      float z[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float acc = 0.0f;
        for (int ks = 0; ks < p.ksplit; ++ks)
          acc += zs[(int64_t(ks) * mrows + 4 * u + q) * nld + b];
        z[q] = fmaf(p.scale_eff, acc, xv[k][q]);
      }
      const float ai = sigmoid_f(z[0]), af = sigmoid_f(z[1]), ag = tanhf(z[2]),
                  ao = sigmoid_f(z[3]);
      p.gates[go] = from_f<T>(ai);
      p.gates[go + H] = from_f<T>(af);
      p.gates[go + 2 * H] = from_f<T>(ag);
      p.gates[go + 3 * H] = from_f<T>(ao);
      const int64_t ci = int64_t(b) * H + j;
      const float c = clamp_f(fmaf(af, cv[k], ai * ag), p.cell_clip);
      p.c32[ci] = c;
      store_clipped(p.cells + int64_t(t) * B * H + ci, c, p.cell_clip, p.cell_clip_s,
                    p.cell_below);
      const float hp = ao * tanhf(c);
      if (p.proj) {
        hps[b * hld + u] = as_operand<Op>(hp, pre);
      } else {
        p.out[int64_t(t) * B * P + int64_t(b) * P + j] = from_f<T>(hp);
        hnext[int64_t(b) * kld + j] = as_operand<Op>(hp, pre);
      }
    });
    phase_stamp(p.clk, crows, 1 + s, 1);
    if (p.proj) {
      // ---- phase 3: this block's part of h_t = hp_t . w_hr^T (its units), then the sum
      __syncthreads();
      block_tiles_product<T, 1>(hps, hld, wr, wld, bpad / 16, kp / 16, urows / KK,
                             p.ypart + int64_t(blockIdx.x) * bpad * kp, kp, warp, nwarps,
                             p.tf32_one);
      phase_stamp(p.clk, crows, 1 + s, 2);
      grid.sync();
      for (int64_t e = gtid; e < int64_t(B) * P; e += gthreads) {
        const int64_t b = e / P, k = e - b * P;
        float y = sum_partials(p.ypart + b * kp + k, int64_t(bpad) * kp, gridDim.x);
        y = clamp_f(y, p.proj_clip);
        store_clipped(p.out + int64_t(t) * B * P + e, y, p.proj_clip, p.proj_clip_s,
                      p.proj_below);
        hnext[b * kld + k] = as_operand<Op>(y, pre);
      }
      phase_stamp(p.clk, crows, 1 + s, 3);
    }
    grid.sync();
    phase_stamp(p.clk, crows, 1 + s, 4);
  }
  clock_exit(p.clk, crows);
}

template <typename T>
struct BwdMmaParams {
  const T* grad_out; const T* grad_cells; const T* out; const T* cells; const T* gates;
  const T* c0; const T* w_hh; const T* mask; const T* w_hr;  // w_hr [P, H] or null
  float* dh_in; float* dc; float* part; float* dz; float* hp; float* grad_h0;
  typename MmaOperand<T>::Op* dhop;  // projection: [bpad, kld] dh_in of the step, operands
  int T_, B, H, P, units, bpad, kp, kld, ksplit;  // part [blocks, bpad, kp]
  bool proj, reverse;
  bool tf32_one;  // float32: one tf32 product per MMA instead of tf32x3 (LstmDims::tf32_one)
  float scale_eff, cell_clip_s, proj_clip_s;
  // the grouped kernel only: dz's operands [bpad, dzld] (zero-filled by the caller), the
  // product blocks' shape (LstmPlan); part is [groups, bpad, chunks * gcolp] there
  typename MmaOperand<T>::Op* dzop;
  int groups, chunks, gunits, gcols, gcolp, dzld;
  int64_t* clk;  // LstmDims::phase_clock: [blocks, T + 1, kLstmClockCols] or null
};

// Shared memory of the tensor-core backward, in order: ws [wrows, kld], dzs [bpad, wrows +
// skew] operands, and with a projection wb [kp, uld] operands (wb[p][u] = w_hr[p, j0 + u],
// uld = units rounded up to 16 + skew) and dhs [ksplit, bpad, units16 + 8] float.
struct BwdMmaSmem {
  size_t dzs, wb, dhs, total;
};
__host__ __device__ inline BwdMmaSmem bwd_mma_smem(int units, int bpad, int kp, int kld,
                                                   int ksplit, bool proj, int esize, int kk) {
  const int wrows = mma_weight_rows(units, kk), skew = 32 / esize;
  const int u16 = (units + 15) / 16 * 16;
  BwdMmaSmem m;
  m.dzs = align128(size_t(esize) * wrows * kld);
  m.wb = m.dzs + align128(size_t(esize) * bpad * (wrows + skew));
  m.dhs = m.wb + (proj ? align128(size_t(esize) * kp * (u16 + skew)) : 0);
  m.total = m.dhs + (proj ? sizeof(float) * ksplit * bpad * (u16 + 8) : 0);
  return m;
}

template <typename T>
__global__ void __launch_bounds__(kMmaWarps * 32, 1)
lstm_bwd_mma_kernel(const BwdMmaParams<T> p) {
  using Op = typename MmaOperand<T>::Op;
  constexpr int KK = MmaOperand<T>::K;
  CTXFAST_DYNAMIC_SMEM(smem);
  const int H = p.H, B = p.B, P = p.P, U = p.units, wrows = mma_weight_rows(U, KK);
  const int kld = p.kld, bpad = p.bpad, kp = p.kp, dld = wrows + mma_skew<Op>();
  const int u16 = (U + 15) / 16 * 16, uld = u16 + mma_skew<Op>(), dhld = u16 + 8;
  const BwdMmaSmem lay = bwd_mma_smem(U, bpad, kp, kld, p.ksplit, p.proj, sizeof(Op), KK);
  Op* ws = reinterpret_cast<Op*>(smem);                  // [wrows, kld]
  Op* dzs = reinterpret_cast<Op*>(smem + lay.dzs);       // [bpad, dld]
  Op* wb = reinterpret_cast<Op*>(smem + lay.wb);         // [kp, uld] (projection)
  float* dhs = reinterpret_cast<float*>(smem + lay.dhs);  // [ksplit, bpad, dhld] (projection)
  const int j0 = blockIdx.x * U;
  const int nu = min(U, H - j0);
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t BP = int64_t(B) * P, BH = int64_t(B) * H;
  const int crows = p.T_ + 1;  // the phase clock's rows (profiling)
  clock_entry(p.clk, crows);
  // float32 with one tf32 product: the phase-2 operands stored as tf32 (block_tiles_product)
  const bool pre = p.tf32_one && MmaOperand<T>::kSplit;
  load_weight_slice_mma(ws, p.w_hh, p.mask, j0, nu, wrows, H, P, kld, pre);
  for (int e = threadIdx.x; e < bpad * dld; e += blockDim.x) dzs[e] = from_f<Op>(0.0f);
  if (p.proj) {
    for (int e = threadIdx.x; e < kp * uld; e += blockDim.x) {
      const int k = e / uld, u = e - k * uld;
      wb[e] = from_f<Op>(u < nu && k < P ? to_f(p.w_hr[int64_t(k) * H + j0 + u]) : 0.0f);
    }
  }
  cg::grid_group grid = cg::this_grid();
  const int64_t gtid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t gthreads = int64_t(gridDim.x) * blockDim.x;
  {  // dh_in of the first step processed (the forward's last): no carry yet
    const int t = p.reverse ? 0 : p.T_ - 1;
    for (int64_t e = gtid; e < BP; e += gthreads) {
      const int64_t o = int64_t(t) * BP + e;
      const float d = dh_in_value(to_f(p.grad_out[o]), 0.0f, to_f(p.out[o]), p.proj,
                                  p.proj_clip_s);
      p.dh_in[o] = d;
      if (p.proj) p.dhop[(e / P) * kld + e % P] = from_f<Op>(d);
    }
  }
  grid.sync();
  phase_stamp(p.clk, crows, 0, 1);
  const int dh_items = (bpad / 16) * (u16 / 16);

  for (int s = p.T_ - 1; s >= 0; --s) {
    const int crow = p.T_ - s;  // 1 + the steps processed before this one
    const int t = p.reverse ? p.T_ - 1 - s : s;
    const int tp = p.reverse ? t + 1 : t - 1;  // the forward's previous step (if s > 0)
    const T* c_prev = s > 0 ? p.cells + int64_t(tp) * BH : p.c0;
    const float* dh_t = p.dh_in + int64_t(t) * BP;
    if (p.proj) {
      // ---- phase 0: dL/dhp[b, u] = dh_t[b, :] . w_hr[:, j0 + u], K sliced over warps
      const int KT = kp / KK;
      for (int it = warp; it < dh_items * p.ksplit; it += nwarps) {  // warp-uniform
        const int tile = it % dh_items, ks = it / dh_items;
        const int mt = tile % (bpad / 16), nt = tile / (bpad / 16);
        const int k_lo = ks * KT / p.ksplit, k_hi = (ks + 1) * KT / p.ksplit;
        FragC<T> acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int kt = k_lo; kt < k_hi; ++kt) {
          FragA<T, wmma::row_major> a;
          FragB<T, wmma::row_major> b, b_lo;
          wmma::load_matrix_sync(a, p.dhop + int64_t(mt) * 16 * kld + kt * KK, kld);
          wmma::load_matrix_sync(b, wb + int64_t(kt) * KK * uld + nt * 16, uld);
          prepare_b<T>(b, b_lo, p.tf32_one);
          mma_step<T>(acc, a, b, b_lo, p.tf32_one);
        }
        wmma::store_matrix_sync(dhs + (int64_t(ks) * bpad + mt * 16) * dhld + nt * 16, acc,
                                dhld, wmma::mem_row_major);
      }
      __syncthreads();
      phase_stamp(p.clk, crows, crow, 0);
    }
    // ---- phase 1: cell backward, one (batch row, unit) per thread
    if (s > 0) {  // what phase 3 reads (grad_out, out of step tp) on its way to L2
      for (int64_t e = gtid; e < BP; e += gthreads) {
        prefetch_l2(p.grad_out + int64_t(tp) * BP + e);
        prefetch_l2(p.out + int64_t(tp) * BP + e);
      }
    }
    // (cell_batches: a batch of pairs' loads before their stores)
    CellIn in[kCellBatch];
    float dhp[kCellBatch];
    cell_batches(B * nu, [&](int k, int e) {
      const int b = e / nu, u = e - b * nu, j = j0 + u;
      if (p.proj) {
        dhp[k] = 0.0f;
        for (int ks = 0; ks < p.ksplit; ++ks) dhp[k] += dhs[(int64_t(ks) * bpad + b) * dhld + u];
      } else {
        dhp[k] = dh_t[int64_t(b) * P + j];
      }
      in[k] = cell_inputs_at(p, c_prev, t, b, j);
    }, [&](int k, int e) {
      const int b = e / nu, u = e - b * nu, j = j0 + u;
      if (s > 0) prefetch_cell_inputs(p, tp, b, j);  // the next step's, on their way to L2
      const CellGrads r = cell_backward_from(p, in[k], t, b, j, dhp[k]);
#pragma unroll
      for (int q = 0; q < 4; ++q) dzs[b * dld + 4 * u + q] = as_operand<Op>(r.dz[q], pre);
    });
    __syncthreads();
    phase_stamp(p.clk, crows, crow, 1);
    // ---- phase 2: part[block] = dz_slice[bpad, wrows] . W_slice[wrows, kp], 16 x 16 tiles
    block_tiles_product<T>(dzs, dld, ws, kld, bpad / 16, kp / 16, wrows / KK,
                           p.part + int64_t(blockIdx.x) * bpad * kp, kp, warp, nwarps,
                           p.tf32_one);
    phase_stamp(p.clk, crows, crow, 2);
    grid.sync();
    phase_stamp(p.clk, crows, crow, 3);
    // ---- phase 3: sum the partials; dh_in of the next step processed, or grad_h0
    for (int64_t e = gtid; e < BP; e += gthreads) {
      const int64_t b = e / P, k = e - b * P;
      float carry = sum_partials(p.part + b * kp + k, int64_t(bpad) * kp, gridDim.x);
      carry *= p.scale_eff;
      if (s > 0) {
        const int64_t o = int64_t(tp) * BP + e;
        const float d = dh_in_value(to_f(p.grad_out[o]), carry, to_f(p.out[o]), p.proj,
                                    p.proj_clip_s);
        p.dh_in[o] = d;
        if (p.proj) p.dhop[b * kld + k] = from_f<Op>(d);
      } else {
        p.grad_h0[e] = carry;
      }
    }
    phase_stamp(p.clk, crows, crow, 4);
    grid.sync();
    phase_stamp(p.clk, crows, crow, 5);
  }
  clock_exit(p.clk, crows);
}

// Grouped tensor-core backward (no projection). The kernel above sums, per step, one
// partial dL/dh_{t-1} of all B x P elements from every block (each holds all P columns of
// its 4U rows): 128 partials at ULMFiT size, 37.7 MB written and read per step. Here the
// product runs on a second distribution of W: product block (g, c) of groups x chunks holds
// W[rows of unit group g, columns of chunk c] in shared memory (rows 4u + gate of units
// [g*gunits, (g+1)*gunits), columns [c*gcols, (c+1)*gcols), zero past H, P and the chunk),
// copies the group's dz columns from a global operand buffer (L2) into shared memory, and
// writes part[g][:, chunk c]: `groups` partials per element (8 at ULMFiT size: ~2.4 MB written
// and read, plus ~9 MB of dz operand reads from L2, per step). The cell phase keeps each
// block's own units as above and sums the `groups` partials of its units' columns (P = H).
// Per step (last first): phase 1 the cell backward of the block's (batch row, unit)
// pairs: dL/dh_t = grad_out + scale * sum_g part[g], dz (float, an output) and its operand
// copy in dzop; grid.sync(); phase 2 the product blocks' tiles into part; grid.sync().
// After the first step: grad_h0 = scale * sum_g part[g]. Deterministic (fixed orders).
template <typename T>
__global__ void __launch_bounds__(kMmaWarps * 32, 1)
lstm_bwd_mma_grouped_kernel(const BwdMmaParams<T> p) {
  using Op = typename MmaOperand<T>::Op;
  constexpr int KK = MmaOperand<T>::K;
  CTXFAST_DYNAMIC_SMEM(smem);
  const int H = p.H, B = p.B, P = p.P, U = p.units, bpad = p.bpad;
  const int G = p.groups, C = p.chunks, grows = 4 * p.gunits;
  const int gld = p.gcolp + mma_skew<Op>(), pld = C * p.gcolp;  // part's row length
  const int64_t gstride = int64_t(bpad) * pld;                   // one group's partials
  const int dzsld = grows + mma_skew<Op>();
  Op* ws = reinterpret_cast<Op*>(smem);                          // [grows, gld]
  Op* dzs = reinterpret_cast<Op*>(smem + align128(sizeof(Op) * size_t(grows) * gld));  // [bpad, dzsld]
  const int j0 = blockIdx.x * U;
  const int nu = min(U, H - j0);
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const bool product = static_cast<int>(blockIdx.x) < G * C;
  // float32 with one tf32 product: W and dz stored as tf32 (block_tiles_product)
  const bool pre = p.tf32_one && MmaOperand<T>::kSplit;
  const int g = blockIdx.x / C, c = blockIdx.x - (blockIdx.x / C) * C;
  const int64_t BP = int64_t(B) * P, BH = int64_t(B) * H;
  const int crows = p.T_ + 1;  // the phase clock's rows (profiling)
  clock_entry(p.clk, crows);
  if (product) {  // W[rows of group g, columns of chunk c] as operands
    for (int64_t e = threadIdx.x; e < int64_t(grows) * gld; e += blockDim.x) {
      const int rl = static_cast<int>(e / gld), n = static_cast<int>(e - int64_t(rl) * gld);
      const int u = g * p.gunits + (rl >> 2), k = c * p.gcols + n;
      float w = 0.0f;
      if (u < H && n < p.gcols && k < P) {
        const int64_t src = (int64_t(rl & 3) * H + u) * P + k;
        w = to_f(p.w_hh[src]);
        if (p.mask) w *= to_f(p.mask[src]);  // 0/1: exact
      }
      ws[e] = as_operand<Op>(w, pre);
    }
  }
  cg::grid_group grid = cg::this_grid();
  const int64_t gtid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t gthreads = int64_t(gridDim.x) * blockDim.x;
  phase_stamp(p.clk, crows, 0, 1);  // no grid barrier before the first step: none needed

  for (int s = p.T_ - 1; s >= 0; --s) {
    const int t = p.reverse ? p.T_ - 1 - s : s;
    const int tp = p.reverse ? t + 1 : t - 1;  // the forward's previous step (if s > 0)
    const T* c_prev = s > 0 ? p.cells + int64_t(tp) * BH : p.c0;
    const bool first = s == p.T_ - 1;          // no carry into the forward's last step
    const int crow = p.T_ - s;                 // 1 + the steps processed before this one
    // ---- phase 1: cell backward, one (batch row, unit) per thread (cell_batches: the
    // partial sums, grad_out and the cell's inputs of a batch of pairs loaded first)
    CellIn in[kCellBatch];
    float dh[kCellBatch];
    cell_batches(B * nu, [&](int k, int e) {
      const int b = e / nu, j = j0 + (e - b * nu);
      float carry = 0.0f;
      if (!first) {
        const int cj = j / p.gcols, n = j - cj * p.gcols;
        carry = sum_partials(p.part + int64_t(b) * pld + int64_t(cj) * p.gcolp + n, gstride, G) *
                p.scale_eff;
      }
      const int64_t o = int64_t(t) * BP + int64_t(b) * P + j;
      dh[k] = dh_in_value(to_f(p.grad_out[o]), carry, 0.0f, false, 0.0f);
      in[k] = cell_inputs_at(p, c_prev, t, b, j);
    }, [&](int k, int e) {
      const int b = e / nu, j = j0 + (e - b * nu);
      if (s > 0) {  // the next step's inputs on their way to L2
        prefetch_cell_inputs(p, tp, b, j);
        prefetch_l2(p.grad_out + int64_t(tp) * BP + int64_t(b) * P + j);
      }
      p.dh_in[int64_t(t) * BP + int64_t(b) * P + j] = dh[k];
      const CellGrads r = cell_backward_from(p, in[k], t, b, j, dh[k]);
#pragma unroll
      for (int q = 0; q < 4; ++q)
        p.dzop[int64_t(b) * p.dzld + 4 * j + q] = as_operand<Op>(r.dz[q], pre);
    });
    phase_stamp(p.clk, crows, crow, 0);
    grid.sync();
    phase_stamp(p.clk, crows, crow, 1);
    // ---- phase 2: part[g][:, chunk c] = dz[:, rows of g] . W[rows of g, chunk c], the
    // group's dz columns staged in shared memory first (one pass over L2, many loads in
    // flight, instead of a dependent L2 load per MMA step)
    if (product) {
      copy_rows16(reinterpret_cast<unsigned char*>(dzs), int64_t(dzsld) * sizeof(Op),
                  reinterpret_cast<const unsigned char*>(p.dzop + int64_t(g) * grows),
                  int64_t(p.dzld) * sizeof(Op), bpad, grows * static_cast<int>(sizeof(Op)));
      __syncthreads();
    }
    phase_stamp(p.clk, crows, crow, 2);
    if (product) {
      block_tiles_product<T>(dzs, dzsld, ws, gld, bpad / 16,
                             p.gcolp / 16, grows / KK, p.part + g * gstride + int64_t(c) * p.gcolp,
                             pld, warp, nwarps, p.tf32_one);
    }
    phase_stamp(p.clk, crows, crow, 3);
    grid.sync();
    phase_stamp(p.clk, crows, crow, 4);
  }
  for (int64_t e = gtid; e < BP; e += gthreads) {  // grad_h0 = dL/dh_{-1}
    const int64_t b = e / P, k = e - b * P;
    const int64_t cj = k / p.gcols, n = k - cj * p.gcols;
    p.grad_h0[e] = sum_partials(p.part + b * pld + cj * p.gcolp + n, gstride, G) * p.scale_eff;
  }
  clock_exit(p.clk, crows);
}

// ------------------------------------------------------------------ launch shapes (host)
inline size_t fwd_smem(const LstmDims& d, int units, size_t esize) {
  return align16(esize * 4 * size_t(units) * d.P) + sizeof(float) * kBT * size_t(d.P);
}

inline size_t bwd_smem(const LstmDims& d, int units, size_t esize) {
  const size_t bpad = size_t((d.B + kBT - 1) / kBT) * kBT;
  return align16(esize * 4 * size_t(units) * d.P) + align16(sizeof(float) * bpad * 4 * units) +
         (d.proj ? sizeof(float) * kBT * size_t(d.P) : 0);
}

inline size_t elem_size(LstmDtype dt) { return dt == LstmDtype::kFloat32 ? 4 : 2; }

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The launch shape of a persistent kernel on a device with `sms` SMs and `smem_limit`
// bytes of opt-in shared memory per block (one block per SM), or ok == false and why.
// Pure host code: the device queries and the occupancy check are the caller's.
inline LstmPlan persistent_shape(const LstmDims& d, LstmDtype dt, bool backward,
                                 LstmKernel kernel, int sms, size_t smem_limit) {
  LstmPlan plan{false, 0, 0, 0, 0, nullptr};
  plan.kernel = kernel;
  if (d.B < 1 || d.T < 1 || d.H < 1 || d.P < 1 || d.H > (1 << 24) || d.P > (1 << 24) ||
      d.B > (1 << 24) || d.T > (1 << 30) || sms < 1) {
    plan.why = "sizes out of the persistent kernel's range";
    return plan;
  }
  const size_t esize = elem_size(dt);
  int units, threads;
  size_t smem;
  if (kernel == LstmKernel::kFma) {
    units = static_cast<int>((d.H + sms - 1) / sms);
    smem = backward ? bwd_smem(d, units, esize) : fwd_smem(d, units, esize);
    // Forward: one unit per warp item; backward: 4 units per warp item.
    const int want = backward ? (units + 3) / 4 * static_cast<int>((d.B + kBT - 1) / kBT) : units;
    const int warps = want < 4 ? 4 : (want > kMaxWarps ? kMaxWarps : want);
    threads = warps * 32;
  } else if (kernel == LstmKernel::kMmaGrouped) {
    if (!backward || d.proj) {
      plan.why = "the grouped tensor-core kernel is a backward for layers without a projection";
      return plan;
    }
    units = static_cast<int>((d.H + sms - 1) / sms);
    const int64_t blocks = (d.H + units - 1) / units;
    const int e = static_cast<int>(esize), skew = 32 / e;
    plan.bpad = static_cast<int>(round_up(d.B, 16));
    plan.kp = static_cast<int>(round_up(d.P, 16));
    plan.kld = plan.kp + skew;
    plan.ksplit = 1;
    // groups x chunks = the product blocks: the fewest bytes per batch row and step (the dz
    // operand reads, chunks x 4H, and the partials written and read, 2 x groups x P floats)
    // among the shapes whose weight tile fits; unit groups of a multiple of 4 units (the
    // group's dz columns start 32-byte aligned).
    int64_t best = -1;
    smem = smem_limit + 1;
    for (int64_t G = 1; G <= blocks; ++G) {
      const int64_t C = blocks / G;
      const int64_t gunits = round_up((d.H + G - 1) / G, 4), gcols = (d.P + C - 1) / C;
      const int64_t gcolp = round_up(gcols, 16);
      // the weight tile [4 gunits, gcolp + skew] and the staged dz [bpad, 4 gunits + skew]
      const size_t need = align128(size_t(esize) * 4 * gunits * (gcolp + skew)) +
                          size_t(esize) * plan.bpad * (4 * gunits + skew);
      const int64_t cost = C * 4 * d.H * e + 8 * G * d.P;
      if (need > smem_limit || (best >= 0 && cost >= best)) continue;
      best = cost;
      smem = need;
      plan.groups = static_cast<int>(G);
      plan.chunks = static_cast<int>(C);
      plan.gunits = static_cast<int>(gunits);
      plan.gcols = static_cast<int>(gcols);
      plan.gcolp = static_cast<int>(gcolp);
      plan.dzld = static_cast<int>(G * 4 * gunits + skew);
    }
    threads = kMmaWarps * 32;
  } else {
    units = static_cast<int>((d.H + sms - 1) / sms);
    if (units > kMmaMaxUnits) {
      plan.why = "more than 32 hidden units per block (H above 32 x the SM count)";
      return plan;
    }
    const int kk = dt == LstmDtype::kFloat32 ? 8 : 16;
    plan.bpad = static_cast<int>(round_up(d.B, 16));
    plan.kp = static_cast<int>(round_up(d.P, 16));
    plan.kld = plan.kp + static_cast<int>(32 / esize);
    const int kt = plan.kp / kk;
    // K slices: the forward's product has bpad/16 batch tiles; the backward's dL/dhp
    // (projection) bpad/16 x units/16 output tiles.
    const int items = backward ? plan.bpad / 16 * ((units + 15) / 16) : plan.bpad / 16;
    const int ks = kMmaWarps / items;
    plan.ksplit = ks < 1 ? 1 : (ks > kt ? kt : ks);
    const int e = static_cast<int>(esize);
    for (;;) {  // fewer K slices (smaller partial-sum buffers) where shared memory is short
      const int bp = plan.bpad, kp = plan.kp, kld = plan.kld, ksp = plan.ksplit;
      smem = backward ? bwd_mma_smem(units, bp, kp, kld, ksp, d.proj, e, kk).total
                      : fwd_mma_smem(units, bp, kp, kld, ksp, d.proj, e, kk).total;
      if (smem <= smem_limit || plan.ksplit == 1) break;
      --plan.ksplit;
    }
    threads = kMmaWarps * 32;
  }
  if (smem > smem_limit) {
    plan.why = "the recurrent weight slices do not fit in shared memory";
    return plan;
  }
  plan.ok = true;
  plan.blocks = static_cast<int>((d.H + units - 1) / units);
  plan.threads = threads;
  plan.units = units;
  plan.smem_bytes = smem;
  return plan;
}


// ------------------------------------------------------------------ kernel parameters (host)
// Filled the same way by the launchers (lstm.cu) and the emulator driver (tests/cuda_emu).

// The sizes and flags every persistent kernel's parameters carry.
template <typename Params>
void set_common(Params& p, const LstmPlan& plan, const LstmDims& d) {
  p.T_ = static_cast<int>(d.T); p.B = static_cast<int>(d.B);
  p.H = static_cast<int>(d.H); p.P = static_cast<int>(d.P); p.units = plan.units;
  p.proj = d.proj; p.reverse = d.reverse;
  p.tf32_one = d.tf32_one;
  p.scale_eff = d.scale_eff;
  p.clk = d.phase_clock;
}

// ... the forward kernels' clips.
template <typename Params>
void set_clips(Params& p, const LstmDims& d) {
  p.cell_clip = d.cell_clip; p.cell_clip_s = d.cell_clip_s; p.cell_below = d.cell_clip_below;
  p.proj_clip = d.proj_clip; p.proj_clip_s = d.proj_clip_s; p.proj_below = d.proj_clip_below;
}

// ... the tensor-core kernels' padded sizes.
template <typename Params>
void set_mma_shape(Params& p, const LstmPlan& plan) {
  p.bpad = plan.bpad; p.kp = plan.kp; p.kld = plan.kld; p.ksplit = plan.ksplit;
}

// ... the grouped backward's product blocks.
template <typename Params>
void set_groups(Params& p, const LstmPlan& plan) {
  p.groups = plan.groups; p.chunks = plan.chunks; p.gunits = plan.gunits;
  p.gcols = plan.gcols; p.gcolp = plan.gcolp; p.dzld = plan.dzld;
}

// ... the backward kernels' inputs from the forward and the upstream gradients.
template <typename Params>
void set_bwd_inputs(Params& p, const void* grad_out, const void* grad_cells, const void* out,
                    const void* cells, const void* gates, const void* c0, const void* w_hh,
                    const void* mask) {
  using T = std::remove_const_t<std::remove_pointer_t<decltype(p.gates)>>;
  p.grad_out = static_cast<const T*>(grad_out);
  p.grad_cells = static_cast<const T*>(grad_cells);
  p.out = static_cast<const T*>(out);
  p.cells = static_cast<const T*>(cells);
  p.gates = static_cast<const T*>(gates);
  p.c0 = static_cast<const T*>(c0);
  p.w_hh = static_cast<const T*>(w_hh);
  p.mask = static_cast<const T*>(mask);
}

}  // namespace
}  // namespace cuda
}  // namespace ctxfast
