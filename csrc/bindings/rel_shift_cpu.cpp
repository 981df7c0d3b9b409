// CPU implementation of ctxfast::rel_shift_native: checks, then csrc/cpu/rel_shift.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bindings/checks.h"
#include "cpu/rel_shift.h"

namespace ctxfast {
namespace {

at::Tensor& rel_shift_out_cpu(const at::Tensor& x, bool inverse, at::Tensor& out) {
  check_rel_shift_out(x, out);
  TORCH_CHECK(x.device().is_cpu(), "rel_shift_native (CPU): x must be a CPU tensor");
  if (x.numel() == 0) return out;
  const at::Tensor x3 = as_3d(x);
  cpu::rel_shift(x3.data_ptr(), out.data_ptr(), x3.size(0), x3.size(1), x3.size(2),
                 x3.stride(0), x3.stride(1), x3.stride(2), x3.element_size(), inverse);
  return out;
}

at::Tensor rel_shift_cpu(const at::Tensor& x, bool inverse) {
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  rel_shift_out_cpu(x, inverse, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ctxfast, CPU, m) {
  m.impl("rel_shift_native", &rel_shift_cpu);
  m.impl("rel_shift_native.out", &rel_shift_out_cpu);
}

}  // namespace ctxfast
