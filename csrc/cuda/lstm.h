// LSTM recurrence (one layer, one direction, all time steps), CUDA launchers. Plain CUDA:
// no torch headers. The binding (csrc/bindings/lstm_cuda.cpp) checks the inputs, allocates
// every output and workspace, picks the path and launches on the current stream.
//
// Math (gate order i, f, g, o; spec: ctxfast/reference/lstm.py):
//   z_t = xw_t + scale_eff * (h_{t-1} @ (w_hh * mask)^T)        (scale_eff = 1 without mask)
//   c_t = clamp(f c_{t-1} + i g, +-cell_clip);  hp_t = o tanh(c_t)
//   h_t = clamp(hp_t @ w_hr^T, +-proj_clip) with a projection, else hp_t
// All arithmetic in float32; stored tensors (xw, out, cells, gates, weights) in the storage
// dtype T (float32, float16 or bfloat16); recurrent state and gradients in float32
// workspaces. All pointers are device pointers to contiguous row-major tensors.
//
// Two paths:
//  * persistent: one cooperative kernel runs all T steps. Each block keeps the masked
//    rows of w_hh of its hidden units (4 gate rows each) in shared memory for the whole
//    call; grid.sync() separates the steps (and the projection phase). Used where the
//    weight slices fit on chip and all blocks are co-resident (lstm_*_persistent_plan).
//    Two kernels (LstmKernel): the step's products on the CUDA cores (kFma), or on the
//    tensor cores (kMma: WMMA tiles, bf16/fp16 operands as stored, float32 as tf32x3;
//    sm_80 or newer); both take the projection and the clips.
//  * per step: cuBLAS GEMMs issued by the binding (ATen) + the fused cell kernels below,
//    one launch each per step. Used where the weights do not fit on chip.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ctxfast {
namespace cuda {

enum class LstmDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Sizes and scalars of one call. Per clip (inf: no clip): `*_clip` is where the forward
// clamps (float32), `*_clip_s` the clip as the storage dtype represents it (the backward
// passes a gradient where |stored| < clip_s), `*_clip_below` the largest storage value
// under clip_s: an unclipped value that would round onto +-clip_s is stored as
// +-clip_below (see csrc/bindings/lstm_checks.h), so the backward's test is exact.
struct LstmDims {
  int64_t T, B, H, P;
  bool proj;
  bool reverse;
  float scale_eff;  // scale where a mask is given, else 1
  float cell_clip, cell_clip_s, cell_clip_below;
  float proj_clip, proj_clip_s, proj_clip_below;
  // float32 on the tensor cores (kMma, kMmaGrouped): each product as one tf32 product
  // (TF32's rounding of the operands, as cuDNN's RNNs where torch allows TF32 for them)
  // instead of tf32x3 (float32-level error, three products). Ignored otherwise.
  bool tf32_one = false;
  // kMma forward: how many of h_{t-1}'s tiles a warp's product loop holds, ring - 1 of them
  // loads in flight from L2 ahead of the one it multiplies: 8 (default) or 4 (the loop as
  // the H200 first timed it). CTXFAST_LSTM_CUDA_RING in the binding.
  int ring = 8;
  // Profiling only (null: off): the tensor-core persistent kernels write their blocks'
  // clocks here, int64 [blocks, T + 1, kLstmClockCols]. Row 0: clock64() at entry, after
  // the prologue (weights on chip, first grid barrier), at exit, then %globaltimer (ns) at
  // entry and at exit. Row 1 + i, the i-th step processed: clock64() when the block's
  // threads finish each phase of that step; columns by kernel (LstmClockKind), 0 where the
  // call has no such phase. benchmarks/lstm_phase_clock.py reads them.
  int64_t* phase_clock = nullptr;
};

constexpr int kLstmClockCols = 6;
// Which kernel wrote a phase clock, and its step columns:
//  kForward   lstm_fwd_mma_kernel: products, cell, projection products, projection barrier
//             and sums (projection only), barrier
//  kBackward  lstm_bwd_mma_kernel: projection dL/dhp (projection only), cell, products,
//             barrier, sums, barrier
//  kGrouped   lstm_bwd_mma_grouped_kernel: cell, barrier, dz staged, products, barrier
enum class LstmClockKind : int { kForward = 1, kBackward = 2, kGrouped = 3 };

// kMmaGrouped: the tensor-core backward with its product on a 2-D distribution of w_hh
// (groups of units x column chunks; backward only, no projection; lstm_kernels.cuh).
enum class LstmKernel : int { kFma = 0, kMma = 1, kMmaGrouped = 2 };

// Launch configuration of a persistent kernel; ok == false says why not in `why`.
struct LstmPlan {
  bool ok;
  int blocks;            // grid size (all co-resident)
  int threads;           // block size
  int units;             // hidden units per block (the last block may have fewer)
  size_t smem_bytes;     // dynamic shared memory per block
  const char* why;       // reason when !ok (static string)
  LstmKernel kernel = LstmKernel::kFma;
  // kMma only: B and P rounded up to 16, the operand rows' leading dimension (kp + a
  // 16-byte skew), the number of K slices of the forward's product.
  int bpad = 0, kp = 0, kld = 0, ksplit = 0;
  // kMmaGrouped only: `groups` x `chunks` product blocks; group g = units [g*gunits,
  // (g+1)*gunits), chunk c = columns [c*gcols, (c+1)*gcols) (gcolp: gcols rounded up to 16);
  // dzld: the leading dimension of the dz operand buffer [bpad, dzld].
  int groups = 0, chunks = 0, gunits = 0, gcols = 0, gcolp = 0, dzld = 0;
};

LstmPlan lstm_forward_persistent_plan(const LstmDims& d, LstmDtype dt, int device,
                                      LstmKernel kernel = LstmKernel::kFma);
LstmPlan lstm_backward_persistent_plan(const LstmDims& d, LstmDtype dt, int device,
                                       LstmKernel kernel = LstmKernel::kFma);

// ---------------------------------------------------------------- persistent kernels
// Forward. In: xw [T,B,4H], w_hh [4H,P], mask [4H,P] or null, w_hr [P,H] or null.
// State: h32 [2,B,P] float (h32[0] = h0 on entry), c32 [B,H] float (= c0 on entry; c_T on
// exit), hp32 [B,H] float (with a projection, else null).
// Out: out [T,B,P], cells [T,B,H], gates [T,B,4H] (post-activation).
cudaError_t lstm_forward_persistent(const LstmPlan& plan, const LstmDims& d, LstmDtype dt,
                                    const void* xw, const void* w_hh, const void* mask,
                                    const void* w_hr, float* h32, float* c32, float* hp32,
                                    void* out, void* cells, void* gates, cudaStream_t stream);

// Backward through time. In: grad_out [T,B,P], grad_cells [T,B,H], out, cells, gates (the
// forward's), c0 [B,H], w_hh, mask (or null), w_hr_t = w_hr^T contiguous [H,P] (or null).
// Workspaces (float): dh_in [T,B,P] (dL/dh_t before the projection clip, i.e. the
// projection's output gradient; = dL/dhp_t without projection), dc [B,H] (zero on entry,
// grad_c0 on exit), part [blocks,B,P].
// Out (float): dz [T,B,4H] (dL/dz_t = grad_xw), hp [T,B,H] (o tanh(c_t), with a
// projection, else null), grad_h0 [B,P].
cudaError_t lstm_backward_persistent(const LstmPlan& plan, const LstmDims& d, LstmDtype dt,
                                     const void* grad_out, const void* grad_cells,
                                     const void* out, const void* cells, const void* gates,
                                     const void* c0, const void* w_hh, const void* mask,
                                     const void* w_hr_t, float* dh_in, float* dc, float* part,
                                     float* dz, float* hp, float* grad_h0, cudaStream_t stream);

// Tensor-core forward (plan.kernel == kMma). In: as lstm_forward_persistent, w_hr [P,H]
// or null; h0 [B,P] float. Workspaces: hop [2, plan.bpad, plan.kld] in the operand dtype
// (float32 for float32 storage, else the storage dtype), zero-filled by the caller;
// c32 [B,H] float (c0 in, c_T out); ypart [plan.blocks, plan.bpad, plan.kp] float with a
// projection (else null). Out: out [T,B,P], cells [T,B,H], gates [T,B,4H].
cudaError_t lstm_forward_persistent_mma(const LstmPlan& plan, const LstmDims& d, LstmDtype dt,
                                        const void* xw, const void* w_hh, const void* mask,
                                        const void* w_hr, const float* h0, void* hop,
                                        float* c32, float* ypart, void* out, void* cells,
                                        void* gates, cudaStream_t stream);

// Tensor-core backward: as lstm_backward_persistent, with w_hr [P,H] (not transposed) or
// null, part [plan.blocks, plan.bpad, plan.kp] float, and with a projection dhop
// [plan.bpad, plan.kld] in the operand dtype (else null). With plan.kernel kMmaGrouped:
// part [plan.groups, plan.bpad, plan.chunks * plan.gcolp] float, dzop [plan.bpad,
// plan.dzld] in the operand dtype, zero-filled by the caller (dhop null).
cudaError_t lstm_backward_persistent_mma(const LstmPlan& plan, const LstmDims& d, LstmDtype dt,
                                         const void* grad_out, const void* grad_cells,
                                         const void* out, const void* cells, const void* gates,
                                         const void* c0, const void* w_hh, const void* mask,
                                         const void* w_hr, float* dh_in, float* dc, float* part,
                                         void* dhop, void* dzop, float* dz, float* hp,
                                         float* grad_h0, cudaStream_t stream);

// ---------------------------------------------------------------- per-step kernels
// Forward cell of one step: z = xw_t + zacc (zacc [B,4H] float = h_{t-1} @ W^T, scale
// included); c32 [B,H] float in/out; writes gates_t [B,4H], cells_t [B,H]; with a
// projection hp32 [B,H] float, else out_t [B,P=H] and h32 [B,H] float (the next h).
cudaError_t lstm_cell_forward_step(const LstmDims& d, LstmDtype dt, const void* xw_t,
                                   const float* zacc, float* c32, void* gates_t,
                                   void* cells_t, float* hp32, void* out_t, float* h32,
                                   cudaStream_t stream);

// Projection output of one step: y = clamp(y32, +-proj_clip) -> out_t [B,P] and h32 [B,P].
cudaError_t lstm_proj_step(const LstmDims& d, LstmDtype dt, const float* y32, void* out_t,
                           float* h32, cudaStream_t stream);

// dh_in_t [B,P] float = grad_out_t + carry, masked by |out_t| < proj_clip with a
// projection (carry: dL/dh_t from the later step, float [B,P]).
cudaError_t lstm_dh_step(const LstmDims& d, LstmDtype dt, const void* grad_out_t,
                         const float* carry, const void* out_t, float* dh_in_t,
                         cudaStream_t stream);

// Backward cell of one step: dhp [B,H] float (dL/dhp_t), dc [B,H] float in/out; writes
// dz_t [B,4H] float and, with a projection, hp_t [B,H] float (o tanh(c_t)).
// c_prev: cells[t_prev] or c0, [B,H] in the storage dtype.
cudaError_t lstm_cell_backward_step(const LstmDims& d, LstmDtype dt, const void* gates_t,
                                    const void* cells_t, const void* c_prev,
                                    const void* grad_cells_t, const float* dhp, float* dc,
                                    float* dz_t, float* hp_t, cudaStream_t stream);

}  // namespace cuda
}  // namespace ctxfast
