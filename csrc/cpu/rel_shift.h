// Transformer-XL relative shift on the CPU: raw pointers, no tensor types.
#pragma once
#include <cstdint>

namespace ctxfast {
namespace cpu {

// For each of the N * Tq rows (n, i) with shift s_i = Tq - 1 - i:
//   forward (inverse == false): out[n, i, j] = x[n, i, j + s_i]  where j + s_i <  Tk, else 0
//   inverse (inverse == true) : out[n, i, j] = x[n, i, j - s_i]  where j - s_i >= 0,  else 0
// The inverse is the adjoint of the forward (its backward), and vice versa.
//   x   : element (n, i, k) at x + (n * stride_n + i * stride_q + k * stride_k) * elem_size
//   out : contiguous [N, Tq, Tk]
// The shift only moves elements, so the kernel works on any element size (1, 2, 4, 8).
void rel_shift(const void* x, void* out, int64_t N, int64_t Tq, int64_t Tk,
               int64_t stride_n, int64_t stride_q, int64_t stride_k,
               int64_t elem_size, bool inverse);

}  // namespace cpu
}  // namespace ctxfast
