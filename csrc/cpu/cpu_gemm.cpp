// Large float32 GEMMs on oneDNN or ATen (see cpu_gemm.h).
#include "cpu/cpu_gemm.h"

#include <ATen/ops/mm.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstdlib>
#include <optional>

namespace ctxfast {
namespace cpu {
namespace {

// oneDNN's linear as torch registers it (mkldnn::_linear_pointwise(Tensor X, Tensor W,
// Tensor? B, str attr, Scalar?[] scalars, str? algorithm) -> Tensor: X @ W^T + B), or
// nullopt where this torch build has none.
const std::optional<c10::OperatorHandle>& onednn_linear() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return op;
}

}  // namespace

std::string env_setting(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

bool blas_below_cpu() {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  static const bool below = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && !__builtin_cpu_is("intel");
  }();
  return below;
#else
  return false;
#endif
}

const std::string& linear_path() {
  static const std::string path = []() -> std::string {
    const std::string s = env_setting("CTXFAST_CPU_LINEAR");
    const bool have = onednn_linear().has_value();
    if (s == "aten") return "aten";
    if (s == "onednn")
      return have ? "onednn"
                  : "bad: CTXFAST_CPU_LINEAR=onednn, but this torch build has no oneDNN "
                    "linear (mkldnn::_linear_pointwise); unset it or set 'aten'";
    if (!s.empty())
      return "bad: CTXFAST_CPU_LINEAR must be 'onednn', 'aten' or unset, got '" + s + "'";
    return have && blas_below_cpu() ? "onednn" : "aten";
  }();
  return path;
}

at::Tensor linear_nt(const at::Tensor& a, const at::Tensor& b) {
  if (linear_path() != "onednn" || a.scalar_type() != at::kFloat || a.size(0) == 0 ||
      b.size(0) == 0 || a.size(1) == 0)
    return at::mm(a, b.t());
  torch::jit::Stack stack{a, b, c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  onednn_linear()->callBoxed(stack);
  return stack[0].toTensor();
}

}  // namespace cpu
}  // namespace ctxfast
