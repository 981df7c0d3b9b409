// LSTM recurrence, CUDA launches (contract and math in csrc/cuda/lstm.h; the persistent
// kernels and their launch shapes in csrc/cuda/lstm_kernels.cuh).
//
// Per-step path (weights too large for shared memory): cuBLAS GEMMs from the binding and
// the fused elementwise cell kernels below.
#include "cuda/lstm_kernels.cuh"

namespace ctxfast {
namespace cuda {
namespace {

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
template <typename T>
const void* fwd_kernel(LstmKernel k) {
  return k == LstmKernel::kMma ? reinterpret_cast<const void*>(&lstm_fwd_mma_kernel<T>)
                               : reinterpret_cast<const void*>(&lstm_fwd_persistent_kernel<T>);
}
template <typename T>
const void* bwd_kernel(LstmKernel k) {
  if (k == LstmKernel::kMmaGrouped)
    return reinterpret_cast<const void*>(&lstm_bwd_mma_grouped_kernel<T>);
  return k == LstmKernel::kMma ? reinterpret_cast<const void*>(&lstm_bwd_mma_kernel<T>)
                               : reinterpret_cast<const void*>(&lstm_bwd_persistent_kernel<T>);
}

const void* kernel_for(LstmDtype dt, bool backward, LstmKernel k) {
  switch (dt) {
    case LstmDtype::kFloat32: return backward ? bwd_kernel<float>(k) : fwd_kernel<float>(k);
    case LstmDtype::kFloat16: return backward ? bwd_kernel<__half>(k) : fwd_kernel<__half>(k);
    case LstmDtype::kBFloat16:
      return backward ? bwd_kernel<__nv_bfloat16>(k) : fwd_kernel<__nv_bfloat16>(k);
  }
  return nullptr;
}

LstmPlan make_plan(const LstmDims& d, LstmDtype dt, int device, bool backward, LstmKernel k) {
  LstmPlan plan{false, 0, 0, 0, 0, nullptr};
  plan.kernel = k;
  int sms = 0, optin = 0, coop = 0, major = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    plan.why = "could not query the device attributes";
    return plan;
  }
  if (!coop) {
    plan.why = "the device does not support cooperative launches";
    return plan;
  }
  if (k != LstmKernel::kFma && major < 8) {
    plan.why = "the tensor-core kernels need compute capability 8.0 or newer";
    return plan;
  }
  plan = persistent_shape(d, dt, backward, k, sms, static_cast<size_t>(optin));
  if (!plan.ok) return plan;
  const void* kernel = kernel_for(dt, backward, k);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(plan.smem_bytes)) != cudaSuccess) {
    cudaGetLastError();
    return LstmPlan{false, 0, 0, 0, 0, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize) failed"};
  }
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, plan.threads,
                                                    plan.smem_bytes) != cudaSuccess) {
    cudaGetLastError();
    return LstmPlan{false, 0, 0, 0, 0, "the occupancy query failed"};
  }
  if (static_cast<int64_t>(per_sm) * sms < plan.blocks) {
    return LstmPlan{false, 0, 0, 0, 0,
                    "not all blocks of the persistent grid can be resident at once"};
  }
  return plan;
}

template <typename Params>
cudaError_t launch_cooperative(const void* kernel, const LstmPlan& plan, Params& p,
                               cudaStream_t stream) {
  void* args[] = {&p};
  return cudaLaunchCooperativeKernel(kernel, dim3(plan.blocks), dim3(plan.threads), args,
                                     plan.smem_bytes, stream);
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
  set_common(p, plan, d);
  set_clips(p, d);
  return launch_cooperative(fwd_kernel<T>(LstmKernel::kFma), plan, p, stream);
}

template <typename T>
cudaError_t launch_bwd(const LstmPlan& plan, const LstmDims& d, const void* grad_out,
                       const void* grad_cells, const void* out, const void* cells,
                       const void* gates, const void* c0, const void* w_hh, const void* mask,
                       const void* w_hr_t, float* dh_in, float* dc, float* part, float* dz,
                       float* hp, float* grad_h0, cudaStream_t stream) {
  BwdParams<T> p;
  set_bwd_inputs(p, grad_out, grad_cells, out, cells, gates, c0, w_hh, mask);
  p.w_hr_t = static_cast<const T*>(w_hr_t);
  p.dh_in = dh_in; p.dc = dc; p.part = part; p.dz = dz; p.hp = hp; p.grad_h0 = grad_h0;
  set_common(p, plan, d);
  p.cell_clip_s = d.cell_clip_s; p.proj_clip_s = d.proj_clip_s;
  return launch_cooperative(bwd_kernel<T>(LstmKernel::kFma), plan, p, stream);
}

template <typename T>
cudaError_t launch_fwd_mma(const LstmPlan& plan, const LstmDims& d, const void* xw,
                           const void* w_hh, const void* mask, const void* w_hr,
                           const float* h0, void* hop, float* c32, float* ypart, void* out,
                           void* cells, void* gates, cudaStream_t stream) {
  FwdMmaParams<T> p;
  p.xw = static_cast<const T*>(xw);
  p.w_hh = static_cast<const T*>(w_hh);
  p.mask = static_cast<const T*>(mask);
  p.w_hr = static_cast<const T*>(w_hr);
  p.h0 = h0;
  p.hop = static_cast<typename MmaOperand<T>::Op*>(hop);
  p.c32 = c32;
  p.ypart = ypart;
  p.out = static_cast<T*>(out); p.cells = static_cast<T*>(cells); p.gates = static_cast<T*>(gates);
  set_common(p, plan, d);
  set_clips(p, d);
  set_mma_shape(p, plan);
  p.ring = d.ring;
  return launch_cooperative(fwd_kernel<T>(LstmKernel::kMma), plan, p, stream);
}

template <typename T>
cudaError_t launch_bwd_mma(const LstmPlan& plan, const LstmDims& d, const void* grad_out,
                           const void* grad_cells, const void* out, const void* cells,
                           const void* gates, const void* c0, const void* w_hh,
                           const void* mask, const void* w_hr, float* dh_in, float* dc,
                           float* part, void* dhop, void* dzop, float* dz, float* hp,
                           float* grad_h0, cudaStream_t stream) {
  BwdMmaParams<T> p;
  set_bwd_inputs(p, grad_out, grad_cells, out, cells, gates, c0, w_hh, mask);
  p.w_hr = static_cast<const T*>(w_hr);
  p.dh_in = dh_in; p.dc = dc; p.part = part; p.dz = dz; p.hp = hp; p.grad_h0 = grad_h0;
  p.dhop = static_cast<typename MmaOperand<T>::Op*>(dhop);
  p.dzop = static_cast<typename MmaOperand<T>::Op*>(dzop);
  set_common(p, plan, d);
  p.cell_clip_s = d.cell_clip_s; p.proj_clip_s = d.proj_clip_s;
  set_mma_shape(p, plan);
  set_groups(p, plan);
  return launch_cooperative(bwd_kernel<T>(plan.kernel), plan, p, stream);
}

}  // namespace

LstmPlan lstm_forward_persistent_plan(const LstmDims& d, LstmDtype dt, int device,
                                      LstmKernel kernel) {
  return make_plan(d, dt, device, /*backward=*/false, kernel);
}

LstmPlan lstm_backward_persistent_plan(const LstmDims& d, LstmDtype dt, int device,
                                       LstmKernel kernel) {
  return make_plan(d, dt, device, /*backward=*/true, kernel);
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
  if (!plan.ok || plan.kernel != LstmKernel::kFma) return cudaErrorInvalidConfiguration;
  CTXFAST_LSTM_DISPATCH(dt, return launch_fwd<T>(plan, d, xw, w_hh, mask, w_hr, h32, c32, hp32,
                                                 out, cells, gates, stream))
}

cudaError_t lstm_backward_persistent(const LstmPlan& plan, const LstmDims& d, LstmDtype dt,
                                     const void* grad_out, const void* grad_cells,
                                     const void* out, const void* cells, const void* gates,
                                     const void* c0, const void* w_hh, const void* mask,
                                     const void* w_hr_t, float* dh_in, float* dc, float* part,
                                     float* dz, float* hp, float* grad_h0, cudaStream_t stream) {
  if (!plan.ok || plan.kernel != LstmKernel::kFma) return cudaErrorInvalidConfiguration;
  CTXFAST_LSTM_DISPATCH(dt, return launch_bwd<T>(plan, d, grad_out, grad_cells, out, cells, gates,
                                                 c0, w_hh, mask, w_hr_t, dh_in, dc, part, dz, hp,
                                                 grad_h0, stream))
}

cudaError_t lstm_forward_persistent_mma(const LstmPlan& plan, const LstmDims& d, LstmDtype dt,
                                        const void* xw, const void* w_hh, const void* mask,
                                        const void* w_hr, const float* h0, void* hop,
                                        float* c32, float* ypart, void* out, void* cells,
                                        void* gates, cudaStream_t stream) {
  if (!plan.ok || plan.kernel != LstmKernel::kMma) return cudaErrorInvalidConfiguration;
  if (d.ring != 4 && d.ring != 8) return cudaErrorInvalidValue;
  CTXFAST_LSTM_DISPATCH(dt, return launch_fwd_mma<T>(plan, d, xw, w_hh, mask, w_hr, h0, hop, c32,
                                                     ypart, out, cells, gates, stream))
}

cudaError_t lstm_backward_persistent_mma(const LstmPlan& plan, const LstmDims& d, LstmDtype dt,
                                         const void* grad_out, const void* grad_cells,
                                         const void* out, const void* cells, const void* gates,
                                         const void* c0, const void* w_hh, const void* mask,
                                         const void* w_hr, float* dh_in, float* dc, float* part,
                                         void* dhop, void* dzop, float* dz, float* hp,
                                         float* grad_h0, cudaStream_t stream) {
  if (!plan.ok || plan.kernel == LstmKernel::kFma) return cudaErrorInvalidConfiguration;
  if (plan.kernel == LstmKernel::kMmaGrouped && dzop == nullptr) return cudaErrorInvalidValue;
  CTXFAST_LSTM_DISPATCH(dt, return launch_bwd_mma<T>(plan, d, grad_out, grad_cells, out, cells,
                                                     gates, c0, w_hh, mask, w_hr, dh_in, dc, part,
                                                     dhop, dzop, dz, hp, grad_h0, stream))
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
