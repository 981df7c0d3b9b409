// Transformer-XL relative shift, CUDA launcher. Plain CUDA: no torch headers.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace ctxfast {
namespace cuda {

// Same contract as ctxfast::cpu::rel_shift (csrc/cpu/rel_shift.h):
//   forward: out[n, i, j] = x[n, i, j + s_i] (0 where j + s_i >= Tk),  s_i = Tq - 1 - i
//   inverse: out[n, i, j] = x[n, i, j - s_i] (0 where j - s_i <  0)
//   x   : device pointer, element (n, i, k) at x + (n*stride_n + i*stride_q + k*stride_k) elements
//   out : device pointer, contiguous [N, Tq, Tk]
// elem_size in {1, 2, 4, 8} bytes (the kernel moves bits; dtype does not matter).
// Launches on `stream`; returns the launch error (cudaSuccess when nothing to do).
cudaError_t rel_shift(const void* x, void* out, int64_t N, int64_t Tq, int64_t Tk,
                      int64_t stride_n, int64_t stride_q, int64_t stride_k,
                      int elem_size, bool inverse, cudaStream_t stream);

}  // namespace cuda
}  // namespace ctxfast
