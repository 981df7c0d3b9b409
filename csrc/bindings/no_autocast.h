// The C++ ops pick their own compute dtypes (fp16/bf16 operands computed in fp32); under
// torch.autocast the Python wrappers (ctxfast/ops) cast the inputs before the call. The ATen
// calls an op makes inside itself (einsum, mm) must not be recast by autocast: it would run
// them in the autocast dtype and hand the kernels a dtype they do not expect (rel_attention's
// segment term on the CPU failed so under bf16 autocast: "expected scalar type Float but
// found BFloat16"). Every op entry that calls ATen math holds one of these.
#pragma once
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace ctxfast {

struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

}  // namespace ctxfast
