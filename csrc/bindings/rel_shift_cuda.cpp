// CUDA implementation of ctxfast::rel_shift_native: checks, device guard, stream, then the
// plain-CUDA launcher in csrc/cuda/rel_shift.cu. Built into ctxfast._cuda only.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "bindings/checks.h"
#include "cuda/rel_shift.h"

namespace ctxfast {
namespace {

at::Tensor& rel_shift_out_cuda(const at::Tensor& x, bool inverse, at::Tensor& out) {
  check_rel_shift_out(x, out);
  TORCH_CHECK(x.is_cuda(), "rel_shift_native (CUDA): x must be a CUDA tensor");
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x3 = as_3d(x);
  const cudaError_t err = cuda::rel_shift(
      x3.data_ptr(), out.data_ptr(), x3.size(0), x3.size(1), x3.size(2), x3.stride(0),
      x3.stride(1), x3.stride(2), static_cast<int>(x3.element_size()), inverse,
      c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "rel_shift_native (CUDA): launch failed: ",
              cudaGetErrorString(err));
  return out;
}

at::Tensor rel_shift_cuda(const at::Tensor& x, bool inverse) {
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  rel_shift_out_cuda(x, inverse, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ctxfast, CUDA, m) {
  m.impl("rel_shift_native", &rel_shift_cuda);
  m.impl("rel_shift_native.out", &rel_shift_out_cuda);
}

}  // namespace ctxfast
