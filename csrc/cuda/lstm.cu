// LSTM recurrence, CUDA kernels (contract and math in csrc/cuda/lstm.h).
//
// Persistent forward (one cooperative launch for all T steps)
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
// Persistent backward: the same row split of w_hh on chip. Per step (last first):
//   phase 1: each block runs the cell backward of its units (with a projection, dL/dhp =
//            dh_in @ w_hr is computed there by the same warp dot, w_hr^T rows from L2),
//            writes dz (float) and keeps its slice of dz in shared memory; then the
//            block's partial of dL/dh_{t-1} = dz @ W over its 4U rows, all B x P, goes to
//            its slot of a float workspace.  grid.sync()
//   phase 2: the grid sums the partials over the blocks and forms dh_in of the next step
//            (+ grad_out, projection clip mask), or grad_h0 after the first step.
//            grid.sync()
//   The weight gradients are one GEMM each over all steps, in the binding.
// Per-step path (weights too large for shared memory): cuBLAS GEMMs from the binding and
// the fused elementwise cell kernels at the end of this file.
//
// Arithmetic is float32 everywhere (FMA on the CUDA cores); h and c are carried in float32
// workspaces, so the stored outputs are only rounded, never re-read for the recurrence.
// Not tuned: written and compiled without a GPU (no tensor cores, no vector loads yet).
#include "cuda/lstm.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

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
__device__ __forceinline__ float clamp_f(float x, float c) { return fminf(fmaxf(x, -c), c); }

__host__ __device__ __forceinline__ size_t align16(size_t n) { return (n + 15) & ~size_t(15); }

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

// ------------------------------------------------------------------ persistent kernels
template <typename T>
struct FwdParams {
  const T* xw; const T* w_hh; const T* mask; const T* w_hr;
  float* h32; float* c32; float* hp32;
  T* out; T* cells; T* gates;
  int T_, B, H, P, units;
  bool proj, reverse;
  float scale_eff, cell_clip, cell_clip_s, cell_below, proj_clip, proj_clip_s, proj_below;
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
  extern __shared__ __align__(16) unsigned char smem[];
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
  float scale_eff, cell_clip_s, proj_clip_s;  // the clips as stored (see lstm.h)
};

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
lstm_bwd_persistent_kernel(const BwdParams<T> p) {
  extern __shared__ __align__(16) unsigned char smem[];
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
  const int64_t BP = int64_t(B) * P, BH = int64_t(B) * H, B4H = int64_t(B) * 4 * H;
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
          const int64_t go = int64_t(t) * B4H + int64_t(b) * 4 * H + j;
          const int64_t ci = int64_t(b) * H + j;
          const int64_t co = int64_t(t) * BH + ci;
          const CellGrads r = cell_backward(
              to_f(p.gates[go]), to_f(p.gates[go + H]), to_f(p.gates[go + 2 * H]),
              to_f(p.gates[go + 3 * H]), to_f(p.cells[co]), to_f(c_prev[ci]), dhp, p.dc[ci],
              to_f(p.grad_cells[co]), p.cell_clip_s);
          p.dc[ci] = r.dc_prev;
          if (p.proj) p.hp[co] = r.hp;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            p.dz[go + int64_t(q) * H] = r.dz[q];
            dzs[b * 4 * U + 4 * u + q] = r.dz[q];
          }
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

// ------------------------------------------------------------------ per-step kernels
template <typename T>
__global__ void cell_forward_step_kernel(const T* xw_t, const float* zacc, float* c32,
                                         T* gates_t, T* cells_t, float* hp32, T* out_t,
                                         float* h32, int B, int H, bool proj, float cell_clip,
                                         float cell_clip_s, float cell_below) {
  const int64_t n = int64_t(B) * H;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = e / H, j = e - b * H;
    const int64_t zo = b * 4 * H + j;
    const float i = sigmoid_f(to_f(xw_t[zo]) + zacc[zo]);
    const float f = sigmoid_f(to_f(xw_t[zo + H]) + zacc[zo + H]);
    const float g = tanhf(to_f(xw_t[zo + 2 * H]) + zacc[zo + 2 * H]);
    const float o = sigmoid_f(to_f(xw_t[zo + 3 * H]) + zacc[zo + 3 * H]);
    gates_t[zo] = from_f<T>(i);
    gates_t[zo + H] = from_f<T>(f);
    gates_t[zo + 2 * H] = from_f<T>(g);
    gates_t[zo + 3 * H] = from_f<T>(o);
    const float c = clamp_f(fmaf(f, c32[e], i * g), cell_clip);
    c32[e] = c;
    store_clipped(cells_t + e, c, cell_clip, cell_clip_s, cell_below);
    const float hp = o * tanhf(c);
    if (proj) {
      hp32[e] = hp;
    } else {
      out_t[e] = from_f<T>(hp);  // P == H: same index
      h32[e] = hp;
    }
  }
}

template <typename T>
__global__ void proj_step_kernel(const float* y32, T* out_t, float* h32, int64_t n,
                                 float proj_clip, float proj_clip_s, float proj_below) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const float y = clamp_f(y32[e], proj_clip);
    store_clipped(out_t + e, y, proj_clip, proj_clip_s, proj_below);
    h32[e] = y;
  }
}

template <typename T>
__global__ void dh_step_kernel(const T* grad_out_t, const float* carry, const T* out_t,
                               float* dh_in_t, int64_t n, bool proj, float proj_clip_s) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    dh_in_t[e] = dh_in_value(to_f(grad_out_t[e]), carry[e], to_f(out_t[e]), proj, proj_clip_s);
  }
}

template <typename T>
__global__ void cell_backward_step_kernel(const T* gates_t, const T* cells_t, const T* c_prev,
                                          const T* grad_cells_t, const float* dhp, float* dc,
                                          float* dz_t, float* hp_t, int B, int H,
                                          float cell_clip_s) {
  const int64_t n = int64_t(B) * H;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = e / H, j = e - b * H;
    const int64_t zo = b * 4 * H + j;
    const CellGrads r = cell_backward(to_f(gates_t[zo]), to_f(gates_t[zo + H]),
                                      to_f(gates_t[zo + 2 * H]), to_f(gates_t[zo + 3 * H]),
                                      to_f(cells_t[e]), to_f(c_prev[e]), dhp[e], dc[e],
                                      to_f(grad_cells_t[e]), cell_clip_s);
    dc[e] = r.dc_prev;
    if (hp_t) hp_t[e] = r.hp;
#pragma unroll
    for (int q = 0; q < 4; ++q) dz_t[zo + int64_t(q) * H] = r.dz[q];
  }
}

unsigned elem_blocks(int64_t n) {
  const int64_t b = (n + kElemThreads - 1) / kElemThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

// ------------------------------------------------------------------ plans
size_t fwd_smem(const LstmDims& d, int units, size_t esize) {
  return align16(esize * 4 * size_t(units) * d.P) + sizeof(float) * kBT * size_t(d.P);
}

size_t bwd_smem(const LstmDims& d, int units, size_t esize) {
  const size_t bpad = size_t((d.B + kBT - 1) / kBT) * kBT;
  return align16(esize * 4 * size_t(units) * d.P) + align16(sizeof(float) * bpad * 4 * units) +
         (d.proj ? sizeof(float) * kBT * size_t(d.P) : 0);
}

size_t elem_size(LstmDtype dt) { return dt == LstmDtype::kFloat32 ? 4 : 2; }

template <typename T>
const void* fwd_kernel() { return reinterpret_cast<const void*>(&lstm_fwd_persistent_kernel<T>); }
template <typename T>
const void* bwd_kernel() { return reinterpret_cast<const void*>(&lstm_bwd_persistent_kernel<T>); }

const void* kernel_for(LstmDtype dt, bool backward) {
  switch (dt) {
    case LstmDtype::kFloat32: return backward ? bwd_kernel<float>() : fwd_kernel<float>();
    case LstmDtype::kFloat16: return backward ? bwd_kernel<__half>() : fwd_kernel<__half>();
    case LstmDtype::kBFloat16:
      return backward ? bwd_kernel<__nv_bfloat16>() : fwd_kernel<__nv_bfloat16>();
  }
  return nullptr;
}

LstmPlan make_plan(const LstmDims& d, LstmDtype dt, int device, bool backward) {
  LstmPlan plan{false, 0, 0, 0, 0, nullptr};
  int sms = 0, optin = 0, coop = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device) != cudaSuccess) {
    cudaGetLastError();
    plan.why = "could not query the device attributes";
    return plan;
  }
  if (!coop) {
    plan.why = "the device does not support cooperative launches";
    return plan;
  }
  if (d.B < 1 || d.T < 1 || d.H < 1 || d.P < 1 || d.H > (1 << 24) || d.P > (1 << 24) ||
      d.B > (1 << 24) || d.T > (1 << 30)) {
    plan.why = "sizes out of the persistent kernel's range";
    return plan;
  }
  // One block per SM (the weight slice takes most of the shared memory): U units each.
  const int units = static_cast<int>((d.H + sms - 1) / sms);
  const int blocks = static_cast<int>((d.H + units - 1) / units);
  const size_t esize = elem_size(dt);
  const size_t smem = backward ? bwd_smem(d, units, esize) : fwd_smem(d, units, esize);
  if (smem > static_cast<size_t>(optin)) {
    plan.why = "the recurrent weight slices do not fit in shared memory";
    return plan;
  }
  // Forward: one unit per warp item; backward: 4 units per warp item.
  const int want = backward ? (units + 3) / 4 * ((d.B + kBT - 1) / kBT) : units;
  const int warps = want < 4 ? 4 : (want > kMaxWarps ? kMaxWarps : want);
  const int threads = warps * 32;
  const void* kernel = kernel_for(dt, backward);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem)) != cudaSuccess) {
    cudaGetLastError();
    plan.why = "cudaFuncSetAttribute(MaxDynamicSharedMemorySize) failed";
    return plan;
  }
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) !=
      cudaSuccess) {
    cudaGetLastError();
    plan.why = "the occupancy query failed";
    return plan;
  }
  if (static_cast<int64_t>(per_sm) * sms < blocks) {
    plan.why = "not all blocks of the persistent grid can be resident at once";
    return plan;
  }
  plan.ok = true;
  plan.blocks = blocks;
  plan.threads = threads;
  plan.units = units;
  plan.smem_bytes = smem;
  return plan;
}

template <typename T>
cudaError_t launch_fwd(const LstmPlan& plan, const LstmDims& d, const void* xw,
                       const void* w_hh, const void* mask, const void* w_hr, float* h32,
                       float* c32, float* hp32, void* out, void* cells, void* gates,
                       cudaStream_t stream) {
  FwdParams<T> p;
  p.xw = static_cast<const T*>(xw);
  p.w_hh = static_cast<const T*>(w_hh);
  p.mask = static_cast<const T*>(mask);
  p.w_hr = static_cast<const T*>(w_hr);
  p.h32 = h32; p.c32 = c32; p.hp32 = hp32;
  p.out = static_cast<T*>(out); p.cells = static_cast<T*>(cells); p.gates = static_cast<T*>(gates);
  p.T_ = static_cast<int>(d.T); p.B = static_cast<int>(d.B);
  p.H = static_cast<int>(d.H); p.P = static_cast<int>(d.P); p.units = plan.units;
  p.proj = d.proj; p.reverse = d.reverse;
  p.scale_eff = d.scale_eff;
  p.cell_clip = d.cell_clip; p.cell_clip_s = d.cell_clip_s; p.cell_below = d.cell_clip_below;
  p.proj_clip = d.proj_clip; p.proj_clip_s = d.proj_clip_s; p.proj_below = d.proj_clip_below;
  void* args[] = {&p};
  return cudaLaunchCooperativeKernel(fwd_kernel<T>(), dim3(plan.blocks), dim3(plan.threads),
                                     args, plan.smem_bytes, stream);
}

template <typename T>
cudaError_t launch_bwd(const LstmPlan& plan, const LstmDims& d, const void* grad_out,
                       const void* grad_cells, const void* out, const void* cells,
                       const void* gates, const void* c0, const void* w_hh, const void* mask,
                       const void* w_hr_t, float* dh_in, float* dc, float* part, float* dz,
                       float* hp, float* grad_h0, cudaStream_t stream) {
  BwdParams<T> p;
  p.grad_out = static_cast<const T*>(grad_out);
  p.grad_cells = static_cast<const T*>(grad_cells);
  p.out = static_cast<const T*>(out);
  p.cells = static_cast<const T*>(cells);
  p.gates = static_cast<const T*>(gates);
  p.c0 = static_cast<const T*>(c0);
  p.w_hh = static_cast<const T*>(w_hh);
  p.mask = static_cast<const T*>(mask);
  p.w_hr_t = static_cast<const T*>(w_hr_t);
  p.dh_in = dh_in; p.dc = dc; p.part = part; p.dz = dz; p.hp = hp; p.grad_h0 = grad_h0;
  p.T_ = static_cast<int>(d.T); p.B = static_cast<int>(d.B);
  p.H = static_cast<int>(d.H); p.P = static_cast<int>(d.P); p.units = plan.units;
  p.proj = d.proj; p.reverse = d.reverse;
  p.scale_eff = d.scale_eff; p.cell_clip_s = d.cell_clip_s; p.proj_clip_s = d.proj_clip_s;
  void* args[] = {&p};
  return cudaLaunchCooperativeKernel(bwd_kernel<T>(), dim3(plan.blocks), dim3(plan.threads),
                                     args, plan.smem_bytes, stream);
}

}  // namespace

LstmPlan lstm_forward_persistent_plan(const LstmDims& d, LstmDtype dt, int device) {
  return make_plan(d, dt, device, /*backward=*/false);
}

LstmPlan lstm_backward_persistent_plan(const LstmDims& d, LstmDtype dt, int device) {
  return make_plan(d, dt, device, /*backward=*/true);
}

// Runs the statement(s) with T bound to the storage type; they must return.
#define CTXFAST_LSTM_DISPATCH(dt, ...)                                   \
  switch (dt) {                                                          \
    case LstmDtype::kFloat32: { using T = float; __VA_ARGS__; }          \
    case LstmDtype::kFloat16: { using T = __half; __VA_ARGS__; }         \
    case LstmDtype::kBFloat16: { using T = __nv_bfloat16; __VA_ARGS__; } \
  }                                                                      \
  return cudaErrorInvalidValue;

cudaError_t lstm_forward_persistent(const LstmPlan& plan, const LstmDims& d, LstmDtype dt,
                                    const void* xw, const void* w_hh, const void* mask,
                                    const void* w_hr, float* h32, float* c32, float* hp32,
                                    void* out, void* cells, void* gates, cudaStream_t stream) {
  if (!plan.ok) return cudaErrorInvalidConfiguration;
  CTXFAST_LSTM_DISPATCH(dt, return launch_fwd<T>(plan, d, xw, w_hh, mask, w_hr, h32, c32, hp32,
                                                 out, cells, gates, stream))
}

cudaError_t lstm_backward_persistent(const LstmPlan& plan, const LstmDims& d, LstmDtype dt,
                                     const void* grad_out, const void* grad_cells,
                                     const void* out, const void* cells, const void* gates,
                                     const void* c0, const void* w_hh, const void* mask,
                                     const void* w_hr_t, float* dh_in, float* dc, float* part,
                                     float* dz, float* hp, float* grad_h0, cudaStream_t stream) {
  if (!plan.ok) return cudaErrorInvalidConfiguration;
  CTXFAST_LSTM_DISPATCH(dt, return launch_bwd<T>(plan, d, grad_out, grad_cells, out, cells, gates,
                                                 c0, w_hh, mask, w_hr_t, dh_in, dc, part, dz, hp,
                                                 grad_h0, stream))
}

cudaError_t lstm_cell_forward_step(const LstmDims& d, LstmDtype dt, const void* xw_t,
                                   const float* zacc, float* c32, void* gates_t,
                                   void* cells_t, float* hp32, void* out_t, float* h32,
                                   cudaStream_t stream) {
  const int64_t n = d.B * d.H;
  if (n == 0) return cudaSuccess;
  CTXFAST_LSTM_DISPATCH(dt, {
    cell_forward_step_kernel<T><<<elem_blocks(n), kElemThreads, 0, stream>>>(
        static_cast<const T*>(xw_t), zacc, c32, static_cast<T*>(gates_t),
        static_cast<T*>(cells_t), hp32, static_cast<T*>(out_t), h32, static_cast<int>(d.B),
        static_cast<int>(d.H), d.proj, d.cell_clip, d.cell_clip_s, d.cell_clip_below);
    return cudaGetLastError();
  })
}

cudaError_t lstm_proj_step(const LstmDims& d, LstmDtype dt, const float* y32, void* out_t,
                           float* h32, cudaStream_t stream) {
  const int64_t n = d.B * d.P;
  if (n == 0) return cudaSuccess;
  CTXFAST_LSTM_DISPATCH(dt, {
    proj_step_kernel<T><<<elem_blocks(n), kElemThreads, 0, stream>>>(
        y32, static_cast<T*>(out_t), h32, n, d.proj_clip, d.proj_clip_s, d.proj_clip_below);
    return cudaGetLastError();
  })
}

cudaError_t lstm_dh_step(const LstmDims& d, LstmDtype dt, const void* grad_out_t,
                         const float* carry, const void* out_t, float* dh_in_t,
                         cudaStream_t stream) {
  const int64_t n = d.B * d.P;
  if (n == 0) return cudaSuccess;
  CTXFAST_LSTM_DISPATCH(dt, {
    dh_step_kernel<T><<<elem_blocks(n), kElemThreads, 0, stream>>>(
        static_cast<const T*>(grad_out_t), carry, static_cast<const T*>(out_t), dh_in_t, n,
        d.proj, d.proj_clip_s);
    return cudaGetLastError();
  })
}

cudaError_t lstm_cell_backward_step(const LstmDims& d, LstmDtype dt, const void* gates_t,
                                    const void* cells_t, const void* c_prev,
                                    const void* grad_cells_t, const float* dhp, float* dc,
                                    float* dz_t, float* hp_t, cudaStream_t stream) {
  const int64_t n = d.B * d.H;
  if (n == 0) return cudaSuccess;
  CTXFAST_LSTM_DISPATCH(dt, {
    cell_backward_step_kernel<T><<<elem_blocks(n), kElemThreads, 0, stream>>>(
        static_cast<const T*>(gates_t), static_cast<const T*>(cells_t),
        static_cast<const T*>(c_prev), static_cast<const T*>(grad_cells_t), dhp, dc, dz_t,
        hp_t, static_cast<int>(d.B), static_cast<int>(d.H), d.cell_clip_s);
    return cudaGetLastError();
  })
}

#undef CTXFAST_LSTM_DISPATCH

}  // namespace cuda
}  // namespace ctxfast
