// Large float32 GEMMs of the CPU ops (the LSTM's weight gradients; the input projection
// from Python through torch.ops.ctxfast.cpu_linear_path) on oneDNN where it is faster than
// the BLAS ATen calls, else on ATen.
//
// Why: ATen's fp32 matmul on the CPU is MKL, which runs its AVX2 code on AMD CPUs even
// where they have AVX-512 (Zen 4 / 5); oneDNN (in every x86 torch wheel, behind
// `mkldnn::_linear_pointwise`) runs AVX-512 there: 444 against 208 GFLOP/s on a
// [1120, 1152] x [1152, 4608] product, 2 threads of a Zen 5 EPYC (benchmarks/NOTES.md,
// sixteenth session). On an Intel CPU, or one without AVX-512, ATen stays (MKL runs its
// best code there; unmeasured against oneDNN).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace ctxfast {
namespace cpu {

// The value of the environment variable `name`, "" when unset. The CPU kernels' settings
// (CTXFAST_ATTN_CPU_*, CTXFAST_LSTM_CPU_GEMM, CTXFAST_CPU_LINEAR) are read through this,
// each once per process into a function-local static where it is used.
std::string env_setting(const char* name);

// Whether ATen's BLAS (MKL) runs below this CPU: AVX2 code on a CPU with AVX-512 that is
// not Intel's (decided once).
bool blas_below_cpu();

// "onednn" or "aten": where large fp32 products go (decided once per process). Setting
// CTXFAST_CPU_LINEAR=onednn / aten forces either; any other value, or onednn where the
// torch build has no oneDNN linear, comes back as "bad: <reason>" (callers refuse it with a
// ValueError before any kernel runs; never replaced silently).
const std::string& linear_path();

// a [M, K] @ b [N, K]^T -> [M, N], fp32 (any strides), on the path linear_path() names
// (ATen where it is bad: callers check first).
at::Tensor linear_nt(const at::Tensor& a, const at::Tensor& b);

}  // namespace cpu
}  // namespace ctxfast
