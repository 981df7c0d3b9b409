// CUDA implementation of ctxfast::lstm_recurrence_native and
// ctxfast::lstm_recurrence_backward_native: checks, device guard, stream, workspaces, the
// choice of path, then the plain-CUDA launchers of csrc/cuda/lstm.cu. Built into
// ctxfast._cuda only.
//
// Paths (csrc/cuda/lstm.h):
//  * persistent_mma: one cooperative kernel for all T steps with the masked w_hh slices
//    held in shared memory and each step's products on the tensor cores
//    (csrc/cuda/lstm_kernels.cuh); chosen where lstm_*_persistent_plan says the slices fit
//    on chip and the grid is co-resident (cudaOccupancy, opt-in shared memory, SM count).
//    Measured on an H200 (benchmarks/results/nvidia-h200/2026-11-26-round3): faster than
//    the CUDA-core kernel at every measured size (ULMFiT bf16 forward 1.94 ms vs 8.02).
//  * persistent: the same schedule with the products on the CUDA cores (FMA), where the
//    tensor-core kernel's plan does not fit and this one does;
//  * per step: cuBLAS GEMMs (ATen, float32) + the fused cell kernels, otherwise.
// CTXFAST_LSTM_CUDA_KERNEL = auto (default: the first of the three that runs) |
// persistent | persistent_mma | per_step forces one; asking for a persistent kernel where
// it cannot run is an error, never a silent fallback.
// CTXFAST_LSTM_CUDA_RING = 8 | 4: how many h tiles the tensor-core forward's product loop
// holds (LstmDims::ring; default 8 for fp16/bf16, 4 for float32: ring_setting).
// CTXFAST_LSTM_CUDA_BWD_REDUCE = groups (default) | blocks: how the tensor-core backward
// sums its partial dL/dh_{t-1} per step: the grouped kernel (lstm_kernels.cuh: a 2-D
// distribution of w_hh, a few partials per element; layers without a projection where its
// plan fits, elsewhere blocks), or one partial per block (all P columns of the block's
// rows). groups is the default since the H200 timed it (benchmarks/results/nvidia-h200/
// 2026-11-27-round4: ULMFiT layer forward+backward bf16 4.36 ms against 5.93, fp32 12.40
// against 13.02).
// Dtypes: float32, float16, bfloat16 (float32 arithmetic and state); float64 is rejected
// (use the cpu or eager backend). Non-contiguous inputs are made contiguous here.
// Weight gradients are one GEMM each over all steps, after the recurrence (in the storage
// dtype: tensor cores for 16-bit, float32 accumulation).
// float32 on the tensor cores follows torch's TF32 setting for cuDNN's RNNs, which is what
// nn.LSTM reads (torch.backends.cudnn.rnn.fp32_precision, or cudnn.allow_tf32 before it;
// on by default): allowed, each product is one TF32 product (LstmDims::tf32_one); not
// allowed, tf32x3 (float32-level error). Read at every call (rnn_tf32_allowed).
// Profiling: ctxfast::lstm_cuda_phase_clock(enable) (defined here, with the CUDA module)
// turns on the tensor-core kernels' phase clock (LstmDims::phase_clock) for the calls that
// follow and returns the clocks recorded since its last call (benchmarks/lstm_phase_clock.py).
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/lstm_checks.h"
#include "bindings/no_autocast.h"
#include "cuda/lstm.h"

namespace ctxfast {
namespace {

using at::Tensor;

constexpr const char* kFwd = "lstm_recurrence_native (CUDA)";
constexpr const char* kBwd = "lstm_recurrence_backward_native (CUDA)";

cuda::LstmDtype lstm_dtype(const char* op, at::ScalarType t) {
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, op,
                   ": the CUDA kernels take float32, float16 or bfloat16, got ", t,
                   " (float64 runs on the cpu or eager backend)");
  if (t == at::kFloat) return cuda::LstmDtype::kFloat32;
  return t == at::kHalf ? cuda::LstmDtype::kFloat16 : cuda::LstmDtype::kBFloat16;
}

enum class Path { kAuto, kPersistent, kPersistentMma, kPerStep };

Path requested_path(const char* op) {
  const char* v = std::getenv("CTXFAST_LSTM_CUDA_KERNEL");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return Path::kAuto;
  if (std::strcmp(v, "persistent") == 0) return Path::kPersistent;
  if (std::strcmp(v, "persistent_mma") == 0) return Path::kPersistentMma;
  TORCH_CHECK_VALUE(std::strcmp(v, "per_step") == 0, op, ": CTXFAST_LSTM_CUDA_KERNEL must "
                    "be auto, persistent, persistent_mma or per_step, got '", v, "'");
  return Path::kPerStep;
}

// LstmDims::ring from CTXFAST_LSTM_CUDA_RING: 8 or 4 h tiles in the tensor-core forward's
// product loop. Default: 8 for fp16/bf16, 4 for float32 (H200 round 5, ULMFiT layer: fp32
// forward 5.08 ms with 4 against 6.04 ms with 8; bf16 1.90 / 1.88 ms, ELMo 1.59 / 1.57).
int ring_setting(const char* op, at::ScalarType dtype) {
  const char* v = std::getenv("CTXFAST_LSTM_CUDA_RING");
  if (v == nullptr || *v == '\0') return dtype == at::kFloat ? 4 : 8;
  if (std::strcmp(v, "8") == 0) return 8;
  TORCH_CHECK_VALUE(std::strcmp(v, "4") == 0, op, ": CTXFAST_LSTM_CUDA_RING must be 4 or 8, "
                    "got '", v, "'");
  return 4;
}

bool grouped_backward(const char* op) {
  const char* v = std::getenv("CTXFAST_LSTM_CUDA_BWD_REDUCE");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "groups") == 0) return true;
  TORCH_CHECK_VALUE(std::strcmp(v, "blocks") == 0, op, ": CTXFAST_LSTM_CUDA_BWD_REDUCE must be "
                    "groups or blocks, got '", v, "'");
  return false;
}

// The persistent plan of the requested kernel, or plan.ok == false for the per-step path.
// auto: the tensor-core kernel where it fits, else the CUDA-core one, else per step.
template <typename PlanFn>
cuda::LstmPlan choose(const char* op, Path path, PlanFn plan_for) {
  if (path == Path::kPerStep) return cuda::LstmPlan{false, 0, 0, 0, 0, "per_step requested"};
  if (path == Path::kAuto) {
    const cuda::LstmPlan mma = plan_for(cuda::LstmKernel::kMma);
    return mma.ok ? mma : plan_for(cuda::LstmKernel::kFma);
  }
  const cuda::LstmPlan plan = plan_for(path == Path::kPersistentMma ? cuda::LstmKernel::kMma
                                                                    : cuda::LstmKernel::kFma);
  TORCH_CHECK(plan.ok, op, ": CTXFAST_LSTM_CUDA_KERNEL=",
              path == Path::kPersistentMma ? "persistent_mma" : "persistent",
              ", but the persistent kernel cannot run at these sizes: ", plan.why);
  return plan;
}

// Whether torch allows TF32 in cuDNN's RNNs. The C++ API of that setting changed across the
// torch releases we support: allowTF32CuDNN(Float32Op) (enum, with at::str2op), before it
// allowTF32CuDNN(const std::string& op), before that allowTF32CuDNN() alone. Overloads
// ranked by the 0 argument (int, long, ...) pick the first that compiles here; str2op is
// looked up when the call is instantiated (a dependent call), so a torch without it drops
// that overload instead of failing to build.
namespace tf32_api {
using namespace at;  // str2op, where this torch has it
template <typename Ctx, typename S>
auto rnn(const Ctx& c, const S& op, int) -> decltype(c.allowTF32CuDNN(str2op(op))) {
  return c.allowTF32CuDNN(str2op(op));
}
template <typename Ctx, typename S>
auto rnn(const Ctx& c, const S& op, long) -> decltype(c.allowTF32CuDNN(op)) {
  return c.allowTF32CuDNN(op);
}
template <typename Ctx, typename S>
bool rnn(const Ctx& c, const S&, ...) {
  return c.allowTF32CuDNN();
}
}  // namespace tf32_api

bool rnn_tf32_allowed() { return tf32_api::rnn(at::globalContext(), std::string("rnn"), 0); }

// C = A^T B for float32 A [K, M] and B [K, N] with one TF32 product per MMA (cuBLAS's
// CUBLAS_COMPUTE_32F_FAST_TF32): the backward's weight gradients where torch allows TF32 for
// cuDNN's RNNs, the precision nn.LSTM's cuDNN GEMMs take. at::mm would follow cuBLAS's own
// setting instead (off by default, process-wide). The extension does not link cuBLAS:
// cublasGemmEx is looked up once in the libcublas that torch loaded, and ATen's handle for
// the current device and stream in libtorch_cuda; where either is missing, or the call
// fails, the product is at::mm's.
namespace tf32_gemm {
using Handle = void*;  // cublasHandle_t
// cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta,
//              C, Ctype, ldc, computeType, algo); the enums are C ints
using GemmEx = int (*)(Handle, int, int, int, int, int, const void*, const void*, int, int,
                       const void*, int, int, const void*, void*, int, int, int, int);
using GetHandle = Handle (*)();  // at::cuda::getCurrentCUDABlasHandle()
constexpr int kOpN = 0, kOpT = 1, kR32F = 0, kCompute32FFastTf32 = 77, kGemmDefault = -1;

struct Fns {
  GemmEx gemm = nullptr;
  GetHandle handle = nullptr;
};

const Fns& fns() {
  static const Fns found = [] {
    Fns f;
    for (const char* so : {"libcublas.so.13", "libcublas.so.12"}) {
      if (void* lib = dlopen(so, RTLD_NOW | RTLD_NOLOAD)) {
        f.gemm = reinterpret_cast<GemmEx>(dlsym(lib, "cublasGemmEx"));
        if (f.gemm) break;
      }
    }
    if (void* lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD)) {
      f.handle = reinterpret_cast<GetHandle>(
          dlsym(lib, "_ZN2at4cuda24getCurrentCUDABlasHandleEv"));
    }
    return f;
  }();
  return found;
}

// Whether the TF32 product is available here (tests and the GPU round read it).
bool available() { return fns().gemm != nullptr && fns().handle != nullptr; }

Tensor mm_tn(const Tensor& a, const Tensor& b, bool tf32) {
  const int64_t K = a.size(0), M = a.size(1), N = b.size(1);
  const bool fits = K > 0 && M > 0 && N > 0 && K < INT32_MAX && M < INT32_MAX && N < INT32_MAX;
  if (!tf32 || a.scalar_type() != at::kFloat || !fits || !available()) return at::mm(a.t(), b);
  const Tensor ac = a.contiguous(), bc = b.contiguous();
  Tensor c = at::empty({M, N}, ac.options());
  const float one = 1.0f, zero = 0.0f;
  // row-major C [M, N] is column-major C^T [N, M] = B^T A: B's storage read as the
  // column-major [N, K] (no transpose), A's as the column-major [M, K] (transposed)
  const int status = fns().gemm(fns().handle(), kOpN, kOpT, static_cast<int>(N),
                                static_cast<int>(M), static_cast<int>(K), &one,
                                bc.data_ptr<float>(), kR32F, static_cast<int>(N),
                                ac.data_ptr<float>(), kR32F, static_cast<int>(M), &zero,
                                c.data_ptr<float>(), kR32F, static_cast<int>(N),
                                kCompute32FFastTf32, kGemmDefault);
  return status == 0 ? c : at::mm(a.t(), b);
}
}  // namespace tf32_gemm

cuda::LstmDims make_dims(const lstm::Dims& d, at::ScalarType dt, bool has_mask, double scale,
                         double cell_clip, double proj_clip, bool reverse) {
  cuda::LstmDims r;
  r.T = d.T;
  r.B = d.B;
  r.H = d.H;
  r.P = d.P;
  r.proj = d.proj;
  r.reverse = reverse;
  r.scale_eff = has_mask ? static_cast<float>(scale) : 1.0f;  // no mask: W = w_hh
  const double cs = lstm::storage_clip(cell_clip, dt), ps = lstm::storage_clip(proj_clip, dt);
  r.cell_clip = static_cast<float>(cell_clip);
  r.cell_clip_s = static_cast<float>(cs);
  r.cell_clip_below = static_cast<float>(lstm::clip_below(cs, dt));
  r.proj_clip = static_cast<float>(proj_clip);
  r.proj_clip_s = static_cast<float>(ps);
  r.proj_clip_below = static_cast<float>(lstm::clip_below(ps, dt));
  r.tf32_one = dt == at::kFloat && rnn_tf32_allowed();
  return r;
}

// The phase clocks recorded while lstm_cuda_phase_clock is on: one int64 tensor [blocks,
// T + 1, kLstmClockCols] per tensor-core persistent launch, with its LstmClockKind.
struct PhaseClocks {
  std::mutex lock;
  bool on = false;
  std::vector<Tensor> clocks;
  std::vector<int64_t> kinds;
};
PhaseClocks& phase_clocks() {
  static PhaseClocks r;
  return r;
}

// dims with a phase clock buffer for this launch where recording is on, else dims as given.
cuda::LstmDims with_clock(cuda::LstmDims dims, const cuda::LstmPlan& plan,
                          cuda::LstmClockKind kind, const at::TensorOptions& opts) {
  PhaseClocks& r = phase_clocks();
  const std::lock_guard<std::mutex> g(r.lock);
  if (!r.on) return dims;
  Tensor c = at::zeros({plan.blocks, dims.T + 1, cuda::kLstmClockCols}, opts.dtype(at::kLong));
  r.clocks.push_back(c);
  r.kinds.push_back(static_cast<int64_t>(kind));
  dims.phase_clock = c.data_ptr<int64_t>();
  return dims;
}

std::tuple<std::vector<Tensor>, std::vector<int64_t>> lstm_cuda_phase_clock(bool enable) {
  PhaseClocks& r = phase_clocks();
  const std::lock_guard<std::mutex> g(r.lock);
  std::tuple<std::vector<Tensor>, std::vector<int64_t>> got{std::move(r.clocks),
                                                            std::move(r.kinds)};
  r.clocks.clear();
  r.kinds.clear();
  r.on = enable;
  return got;
}

void check_cuda(cudaError_t err, const char* op, const char* what) {
  TORCH_CHECK(err == cudaSuccess, op, ": ", what, " failed: ", cudaGetErrorString(err));
}

Tensor contig(const std::optional<Tensor>& t) {
  return (t.has_value() && t->defined()) ? t->contiguous() : Tensor();
}

const void* ptr_or_null(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
float* fptr_or_null(const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// W = w_hh * mask * scale in float32 for the per-step GEMMs, formed once per call (cuBLAS
// cannot apply a mask inside its GEMM); the module's parameter is never written.
Tensor masked_weight_f32(const Tensor& w_hh, const Tensor& mask, double scale) {
  Tensor w = w_hh.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  if (mask.defined()) {
    w.mul_(mask);
    if (scale != 1.0) w.mul_(scale);
  }
  return w;
}

std::tuple<Tensor, Tensor, Tensor> lstm_recurrence_cuda(
    const Tensor& xw, const Tensor& h0, const Tensor& c0, const Tensor& w_hh,
    const std::optional<Tensor>& w_hr, const std::optional<Tensor>& mask, double scale,
    double cell_clip, double proj_clip, bool reverse) {
  const NoAutocast no_autocast;
  const lstm::Dims d =
      lstm::check_common(kFwd, xw, "xw", h0, c0, w_hh, w_hr, mask, scale, cell_clip, proj_clip);
  TORCH_CHECK_VALUE(xw.is_cuda(), kFwd, ": xw must be a CUDA tensor, got ", xw.device());
  const cuda::LstmDtype cdt = lstm_dtype(kFwd, xw.scalar_type());
  const Path path = requested_path(kFwd);
  const int ring = ring_setting(kFwd, xw.scalar_type());
  const c10::cuda::CUDAGuard guard(xw.device());
  const auto opts = xw.options();
  Tensor out = at::empty({d.T, d.B, d.P}, opts);
  Tensor cells = at::empty({d.T, d.B, d.H}, opts);
  Tensor gates = at::empty({d.T, d.B, 4 * d.H}, opts);
  if (d.T == 0 || d.B == 0) return {out, cells, gates};

  const Tensor xw_c = xw.contiguous(), w_hh_c = w_hh.contiguous();
  const Tensor w_hr_c = contig(w_hr), mask_c = contig(mask);
  cuda::LstmDims cd =
      make_dims(d, xw.scalar_type(), mask_c.defined(), scale, cell_clip, proj_clip, reverse);
  cd.ring = ring;
  const int dev = xw.device().index();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  const auto f32 = opts.dtype(at::kFloat);
  Tensor c32 = at::empty({d.B, d.H}, f32);  // c_{t-1}, float32
  c32.copy_(c0);

  const cuda::LstmPlan plan = choose(kFwd, path, [&](cuda::LstmKernel k) {
    return cuda::lstm_forward_persistent_plan(cd, cdt, dev, k);
  });
  if (plan.ok && plan.kernel == cuda::LstmKernel::kMma) {
    // h_{t-1} as tensor-core operands, ping-pong, zero outside [B, P] (float32 storage:
    // float32, split into tf32 halves in the kernel).
    Tensor hop = at::zeros({2, plan.bpad, plan.kld}, opts);
    const Tensor h0f = h0.to(at::kFloat).contiguous();
    Tensor ypart = d.proj ? at::empty({plan.blocks, plan.bpad, plan.kp}, f32) : Tensor();
    check_cuda(cuda::lstm_forward_persistent_mma(
                   plan, with_clock(cd, plan, cuda::LstmClockKind::kForward, opts), cdt, xw_c.data_ptr(), w_hh_c.data_ptr(), ptr_or_null(mask_c),
                   ptr_or_null(w_hr_c), h0f.data_ptr<float>(), hop.data_ptr(),
                   c32.data_ptr<float>(), fptr_or_null(ypart), out.data_ptr(), cells.data_ptr(),
                   gates.data_ptr(), stream),
               kFwd, "the tensor-core persistent forward kernel launch");
    return {out, cells, gates};
  }
  if (plan.ok) {
    Tensor h32 = at::empty({2, d.B, d.P}, f32);  // ping-pong h_{t-1} / h_t
    h32[0].copy_(h0);
    Tensor hp32 = d.proj ? at::empty({d.B, d.H}, f32) : Tensor();
    check_cuda(cuda::lstm_forward_persistent(plan, cd, cdt, xw_c.data_ptr(), w_hh_c.data_ptr(),
                                             ptr_or_null(mask_c), ptr_or_null(w_hr_c),
                                             h32.data_ptr<float>(), c32.data_ptr<float>(),
                                             fptr_or_null(hp32), out.data_ptr(),
                                             cells.data_ptr(), gates.data_ptr(), stream),
               kFwd, "the persistent forward kernel launch");
    return {out, cells, gates};
  }

  // Per step: z_acc = h_{t-1} @ W^T (cuBLAS, float32), then the fused cell kernel.
  const Tensor W32 = masked_weight_f32(w_hh_c, mask_c, scale);      // [4H, P]
  const Tensor Wt = W32.t();                                        // [P, 4H]
  const Tensor w_hr_t32 = d.proj ? w_hr_c.to(at::kFloat).t() : Tensor();  // [H, P]
  Tensor h32 = at::empty({d.B, d.P}, f32);
  h32.copy_(h0);
  Tensor zacc = at::empty({d.B, 4 * d.H}, f32);
  Tensor hp32 = d.proj ? at::empty({d.B, d.H}, f32) : Tensor();
  Tensor y32 = d.proj ? at::empty({d.B, d.P}, f32) : Tensor();
  for (int64_t s = 0; s < d.T; ++s) {
    const int64_t t = reverse ? d.T - 1 - s : s;
    at::mm_out(zacc, h32, Wt);
    Tensor out_t = out[t];
    check_cuda(cuda::lstm_cell_forward_step(cd, cdt, xw_c[t].data_ptr(), zacc.data_ptr<float>(),
                                            c32.data_ptr<float>(), gates[t].data_ptr(),
                                            cells[t].data_ptr(), fptr_or_null(hp32),
                                            d.proj ? nullptr : out_t.data_ptr(),
                                            d.proj ? nullptr : h32.data_ptr<float>(), stream),
               kFwd, "the cell kernel launch");
    if (d.proj) {
      at::mm_out(y32, hp32, w_hr_t32);
      check_cuda(cuda::lstm_proj_step(cd, cdt, y32.data_ptr<float>(), out_t.data_ptr(),
                                      h32.data_ptr<float>(), stream),
                 kFwd, "the projection kernel launch");
    }
  }
  return {out, cells, gates};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> lstm_recurrence_backward_cuda(
    const Tensor& grad_out, const Tensor& grad_cells, const Tensor& h0, const Tensor& c0,
    const Tensor& w_hh, const std::optional<Tensor>& w_hr, const std::optional<Tensor>& mask,
    double scale, double cell_clip, double proj_clip, bool reverse, const Tensor& out,
    const Tensor& cells, const Tensor& gates) {
  const NoAutocast no_autocast;
  const lstm::Dims d = lstm::check_common(kBwd, gates, "gates", h0, c0, w_hh, w_hr, mask,
                                          scale, cell_clip, proj_clip);
  lstm::check_backward_extra(kBwd, d, gates, grad_out, grad_cells, out, cells);
  TORCH_CHECK_VALUE(gates.is_cuda(), kBwd, ": gates must be a CUDA tensor, got ",
                    gates.device());
  const at::ScalarType dt = gates.scalar_type();
  const cuda::LstmDtype cdt = lstm_dtype(kBwd, dt);
  const Path path = requested_path(kBwd);
  const bool grouped = grouped_backward(kBwd);
  const c10::cuda::CUDAGuard guard(gates.device());
  const auto opts = gates.options();
  const auto f32 = opts.dtype(at::kFloat);
  const Tensor w_hr_c = contig(w_hr), mask_c = contig(mask);
  if (d.T == 0 || d.B == 0) {
    return {at::zeros({d.T, d.B, 4 * d.H}, opts), at::zeros({d.B, d.P}, opts),
            at::zeros({d.B, d.H}, opts), at::zeros({4 * d.H, d.P}, opts),
            d.proj ? at::zeros({d.P, d.H}, opts) : at::empty({0}, opts)};
  }
  const Tensor go = grad_out.contiguous(), gc = grad_cells.contiguous();
  const Tensor out_c = out.contiguous(), cells_c = cells.contiguous();
  const Tensor gates_c = gates.contiguous(), c0_c = c0.contiguous(), w_hh_c = w_hh.contiguous();
  const cuda::LstmDims cd =
      make_dims(d, dt, mask_c.defined(), scale, cell_clip, proj_clip, reverse);
  const int dev = gates.device().index();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();

  Tensor dz = at::empty({d.T, d.B, 4 * d.H}, f32);               // dL/dz_t = grad_xw
  Tensor dh_in = at::empty({d.T, d.B, d.P}, f32);                // dL/d(projection or hp)
  Tensor dc = at::zeros({d.B, d.H}, f32);                        // carried dL/dc; grad_c0
  Tensor hp = d.proj ? at::empty({d.T, d.B, d.H}, f32) : Tensor();  // o tanh(c_t)
  Tensor gh0;

  const cuda::LstmPlan plan = choose(kBwd, path, [&](cuda::LstmKernel k) {
    if (k == cuda::LstmKernel::kMma && grouped) {  // where it applies, else the blocks' sums
      const cuda::LstmPlan g =
          cuda::lstm_backward_persistent_plan(cd, cdt, dev, cuda::LstmKernel::kMmaGrouped);
      if (g.ok) return g;
    }
    return cuda::lstm_backward_persistent_plan(cd, cdt, dev, k);
  });
  if (plan.ok && plan.kernel != cuda::LstmKernel::kFma) {
    const bool grp = plan.kernel == cuda::LstmKernel::kMmaGrouped;
    // partial dL/dh: per block [blocks, bpad, kp], or per unit group [groups, bpad, chunks x
    // gcolp]; the grouped kernel's dz operands [bpad, dzld], zero outside [B, 4H]
    Tensor part = grp ? at::empty({plan.groups, plan.bpad, int64_t(plan.chunks) * plan.gcolp}, f32)
                      : at::empty({plan.blocks, plan.bpad, plan.kp}, f32);
    Tensor dzop = grp ? at::zeros({plan.bpad, plan.dzld}, opts) : Tensor();
    Tensor dhop = d.proj ? at::zeros({plan.bpad, plan.kld}, opts) : Tensor();  // dh_in operands
    gh0 = at::empty({d.B, d.P}, f32);
    const cuda::LstmClockKind kind =
        grp ? cuda::LstmClockKind::kGrouped : cuda::LstmClockKind::kBackward;
    check_cuda(cuda::lstm_backward_persistent_mma(
                   plan, with_clock(cd, plan, kind, opts), cdt, go.data_ptr(), gc.data_ptr(), out_c.data_ptr(),
                   cells_c.data_ptr(), gates_c.data_ptr(), c0_c.data_ptr(), w_hh_c.data_ptr(),
                   ptr_or_null(mask_c), ptr_or_null(w_hr_c), dh_in.data_ptr<float>(),
                   dc.data_ptr<float>(), part.data_ptr<float>(), d.proj ? dhop.data_ptr() : nullptr,
                   grp ? dzop.data_ptr() : nullptr, dz.data_ptr<float>(), fptr_or_null(hp),
                   gh0.data_ptr<float>(), stream),
               kBwd, "the tensor-core persistent backward kernel launch");
  } else if (plan.ok) {
    const Tensor w_hr_t = d.proj ? w_hr_c.t().contiguous() : Tensor();  // [H, P]
    Tensor part = at::empty({plan.blocks, d.B, d.P}, f32);  // per-block partial dL/dh
    gh0 = at::empty({d.B, d.P}, f32);
    check_cuda(cuda::lstm_backward_persistent(
                   plan, cd, cdt, go.data_ptr(), gc.data_ptr(), out_c.data_ptr(),
                   cells_c.data_ptr(), gates_c.data_ptr(), c0_c.data_ptr(), w_hh_c.data_ptr(),
                   ptr_or_null(mask_c), ptr_or_null(w_hr_t), dh_in.data_ptr<float>(),
                   dc.data_ptr<float>(), part.data_ptr<float>(), dz.data_ptr<float>(),
                   fptr_or_null(hp), gh0.data_ptr<float>(), stream),
               kBwd, "the persistent backward kernel launch");
  } else {
    const Tensor W32 = masked_weight_f32(w_hh_c, mask_c, scale);    // [4H, P]
    const Tensor w_hr32 = d.proj ? w_hr_c.to(at::kFloat) : Tensor();  // [P, H]
    Tensor carry = at::zeros({d.B, d.P}, f32);                      // dL/dh_t from later steps
    Tensor dhp = d.proj ? at::empty({d.B, d.H}, f32) : Tensor();
    for (int64_t s = d.T - 1; s >= 0; --s) {
      const int64_t t = reverse ? d.T - 1 - s : s;
      const int64_t tp = reverse ? t + 1 : t - 1;
      Tensor dh_t = dh_in[t];                                       // [B, P]
      check_cuda(cuda::lstm_dh_step(cd, cdt, go[t].data_ptr(), carry.data_ptr<float>(),
                                    out_c[t].data_ptr(), dh_t.data_ptr<float>(), stream),
                 kBwd, "the dh kernel launch");
      if (d.proj) at::mm_out(dhp, dh_t, w_hr32);                   // [B, H]
      Tensor dz_t = dz[t];                                          // [B, 4H]
      check_cuda(cuda::lstm_cell_backward_step(
                     cd, cdt, gates_c[t].data_ptr(), cells_c[t].data_ptr(),
                     s > 0 ? cells_c[tp].data_ptr() : c0_c.data_ptr(), gc[t].data_ptr(),
                     d.proj ? dhp.data_ptr<float>() : dh_t.data_ptr<float>(),
                     dc.data_ptr<float>(), dz_t.data_ptr<float>(),
                     d.proj ? hp[t].data_ptr<float>() : nullptr, stream),
                 kBwd, "the cell backward kernel launch");
      at::mm_out(carry, dz_t, W32);                                 // dL/dh_{t-1} [B, P]
    }
    gh0 = carry;
  }

  // dL/dW = sum_t dz_t^T h_{t-1}: one GEMM over all steps (h_{t-1}: h0 for the first step
  // processed, the previous output otherwise), in the storage dtype: 16-bit operands on the
  // tensor cores with float32 accumulation and one rounding of the result (eager rounds
  // each step's product and every accumulation in that dtype); float32 in float32.
  const int64_t T = d.T, B = d.B;
  const Tensor dz_s = dz.to(dt);                                  // [T, B, 4H]; = grad_xw
  const Tensor h0_s = h0.to(dt).unsqueeze(0);                     // [1, B, P]
  const Tensor h_prev =                                           // [T, B, P], time order
      T == 1 ? h0_s
             : (reverse ? at::cat({out_c.narrow(0, 1, T - 1), h0_s}, 0)
                        : at::cat({h0_s, out_c.narrow(0, 0, T - 1)}, 0));
  // float32: one TF32 product per MMA where torch allows TF32 for cuDNN's RNNs (tf32_gemm)
  const bool tf32 = dt == at::kFloat && rnn_tf32_allowed();
  Tensor gw = tf32_gemm::mm_tn(dz_s.reshape({T * B, 4 * d.H}), h_prev.reshape({T * B, d.P}),
                               tf32);                             // [4H, P]
  if (mask_c.defined()) {                                         // [4H, P]
    gw.mul_(mask_c);
    if (scale != 1.0) gw.mul_(scale);
  }
  Tensor gw_hr = d.proj ? tf32_gemm::mm_tn(dh_in.reshape({T * B, d.P}).to(dt),  // [P, H]
                                           hp.reshape({T * B, d.H}).to(dt), tf32)
                        : at::empty({0}, opts);
  return {dz_s, gh0.to(dt), dc.to(dt), gw, gw_hr};
}

}  // namespace

TORCH_LIBRARY_IMPL(ctxfast, CUDA, m) {
  m.impl("lstm_recurrence_native", &lstm_recurrence_cuda);
  m.impl("lstm_recurrence_backward_native", &lstm_recurrence_backward_cuda);
}

// Profiling only; exists where the CUDA module is loaded.
TORCH_LIBRARY_FRAGMENT(ctxfast, m) {
  m.def("lstm_cuda_phase_clock(bool enable) -> (Tensor[], int[])", &lstm_cuda_phase_clock);
  // whether the backward's float32 weight gradients can take TF32 products (tf32_gemm)
  m.def("lstm_cuda_tf32_gemm_available() -> bool", [] { return tf32_gemm::available(); });
}

}  // namespace ctxfast
