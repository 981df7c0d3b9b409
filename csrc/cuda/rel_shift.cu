// Transformer-XL relative shift, CUDA kernel.
//
// One warp per output row (n, i); its lanes stride over the Tk columns. The row's source
// is the same row of x moved by s_i = Tq - 1 - i columns (left for the forward shift,
// right for the inverse), with zeros where the source falls outside [0, Tk). Loads are
// coalesced along k when stride_k == 1; the shift misaligns them by s_i, which the L1/L2
// absorb (the op is a copy: bound by DRAM bandwidth, 2 * N * Tq * Tk * elem_size bytes).
#include "cuda/rel_shift.h"

namespace ctxfast {
namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * 32;

template <typename T>
__global__ void rel_shift_kernel(const T* __restrict__ x, T* __restrict__ out,
                                 int64_t rows, int64_t Tq, int64_t Tk,
                                 int64_t stride_n, int64_t stride_q, int64_t stride_k,
                                 bool inverse) {
  const int lane = threadIdx.x & 31;
  const int64_t warp_global =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = warp_global; r < rows; r += warp_stride) {
    const int64_t n = r / Tq;
    const int64_t i = r - n * Tq;
    const int64_t d = inverse ? -(Tq - 1 - i) : (Tq - 1 - i);
    const T* xrow = x + n * stride_n + i * stride_q;
    T* orow = out + r * Tk;
    for (int64_t j = lane; j < Tk; j += 32) {
      const int64_t src = j + d;
      orow[j] = (src >= 0 && src < Tk) ? xrow[src * stride_k] : T(0);
    }
  }
}

template <typename T>
cudaError_t launch(const void* x, void* out, int64_t rows, int64_t Tq, int64_t Tk,
                   int64_t stride_n, int64_t stride_q, int64_t stride_k, bool inverse,
                   cudaStream_t stream) {
  // Enough blocks to fill any current GPU several times over; the grid-stride loop
  // covers the rest (and keeps gridDim.x far below its 2^31 - 1 limit).
  const int64_t blocks_needed = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const unsigned blocks = static_cast<unsigned>(blocks_needed < 65536 ? blocks_needed : 65536);
  rel_shift_kernel<T><<<blocks, kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<T*>(out), rows, Tq, Tk, stride_n, stride_q,
      stride_k, inverse);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rel_shift(const void* x, void* out, int64_t N, int64_t Tq, int64_t Tk,
                      int64_t stride_n, int64_t stride_q, int64_t stride_k,
                      int elem_size, bool inverse, cudaStream_t stream) {
  const int64_t rows = N * Tq;
  if (rows == 0 || Tk == 0) return cudaSuccess;
  switch (elem_size) {
    case 1: return launch<uint8_t>(x, out, rows, Tq, Tk, stride_n, stride_q, stride_k, inverse, stream);
    case 2: return launch<uint16_t>(x, out, rows, Tq, Tk, stride_n, stride_q, stride_k, inverse, stream);
    case 4: return launch<uint32_t>(x, out, rows, Tq, Tk, stride_n, stride_q, stride_k, inverse, stream);
    case 8: return launch<uint64_t>(x, out, rows, Tq, Tk, stride_n, stride_q, stride_k, inverse, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace ctxfast
