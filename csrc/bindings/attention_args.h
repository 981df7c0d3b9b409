// Arguments shared by the CPU attention bindings (attention_cpu.cpp, rel_attention_cpu.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "cpu/attention.h"

namespace ctxfast {

// dropout_p in [0, 1); p > 0 needs seed: an int64 CPU tensor of one element.
inline cpu::Dropout dropout_args(const char* op, double dropout_p,
                                 const std::optional<at::Tensor>& seed) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, op,
                    ": dropout_p must be in [0, 1), got ", dropout_p);
  cpu::Dropout d;
  if (dropout_p == 0.0) return d;
  TORCH_CHECK_VALUE(seed && seed->defined() && seed->scalar_type() == at::kLong &&
                        seed->numel() == 1 && seed->device().is_cpu(),
                    op, ": dropout needs seed: an int64 CPU tensor of one element");
  d.p = dropout_p;
  d.seed = static_cast<uint64_t>(seed->item<int64_t>());
  return d;
}

}  // namespace ctxfast
