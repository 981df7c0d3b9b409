// Shared tensor checks for the bindings. The Python layer (ctxfast/ops) validates user
// input with precise messages first; these guard the C++ entry points themselves.
#pragma once
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <vector>

namespace ctxfast {

// View `x` of shape [..., Tq, Tk] as [N, Tq, Tk] without copying when its strides allow.
inline at::Tensor as_3d(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 2, "ctxfast: x must have rank >= 2 ([..., Tq, Tk]), got shape ",
              x.sizes());
  const int64_t Tq = x.size(-2), Tk = x.size(-1);
  int64_t N = 1;
  for (int64_t d = 0; d < x.dim() - 2; ++d) N *= x.size(d);
  return x.reshape({N, Tq, Tk});
}

inline void check_rel_shift_out(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.dim() >= 2, "rel_shift: x must have rank >= 2 ([..., Tq, Tk]), got shape ",
              x.sizes());
  TORCH_CHECK(x.size(-1) >= x.size(-2), "rel_shift: x must have Tk >= Tq, got shape ",
              x.sizes());
  TORCH_CHECK(out.sizes() == x.sizes(), "rel_shift: out must have x's shape ", x.sizes(),
              ", got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "rel_shift: out must have x's dtype ",
              x.scalar_type(), ", got ", out.scalar_type());
  TORCH_CHECK(out.device() == x.device(), "rel_shift: out must be on x's device ",
              x.device(), ", got ", out.device());
  TORCH_CHECK(out.is_contiguous(), "rel_shift: out must be contiguous");
  // the kernels read x while writing out (__restrict__ on the GPU, memcpy on the CPU)
  // (a strided x's overlap torch cannot tell, "TooHard": refused where they share storage)
  const at::MemOverlapStatus overlap = at::get_overlap_status(out, x);
  TORCH_CHECK(overlap == at::MemOverlapStatus::No ||
                  (overlap == at::MemOverlapStatus::TooHard &&
                   !out.storage().is_alias_of(x.storage())),
              "rel_shift: out must not overlap x (the shift reads x while writing out)");
}

}  // namespace ctxfast
