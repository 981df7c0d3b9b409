// Transformer-XL relative shift, CPU kernel (ATen's parallel_for over rows, OpenMP).
#include "cpu/rel_shift.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace ctxfast {
namespace cpu {
namespace {

template <typename T>
void copy_strided(const char* src, char* dst, int64_t count, int64_t stride_k) {
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  for (int64_t j = 0; j < count; ++j) d[j] = s[j * stride_k];
}

void copy_row(const char* src, char* dst, int64_t count, int64_t stride_k, int64_t elem_size) {
  if (count <= 0) return;
  if (stride_k == 1) {
    std::memcpy(dst, src, static_cast<size_t>(count * elem_size));
    return;
  }
  switch (elem_size) {
    case 1: copy_strided<uint8_t>(src, dst, count, stride_k); break;
    case 2: copy_strided<uint16_t>(src, dst, count, stride_k); break;
    case 4: copy_strided<uint32_t>(src, dst, count, stride_k); break;
    case 8: copy_strided<uint64_t>(src, dst, count, stride_k); break;
    default:  // any other size: element by element
      for (int64_t j = 0; j < count; ++j)
        std::memcpy(dst + j * elem_size, src + j * stride_k * elem_size, elem_size);
  }
}

}  // namespace

void rel_shift(const void* x, void* out, int64_t N, int64_t Tq, int64_t Tk,
               int64_t stride_n, int64_t stride_q, int64_t stride_k,
               int64_t elem_size, bool inverse) {
  const int64_t rows = N * Tq;
  if (rows == 0 || Tk == 0) return;
  const char* xb = static_cast<const char*>(x);
  char* ob = static_cast<char*>(out);
  // About 64 KiB of output per task, at least one row.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, Tk * elem_size));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = r / Tq, i = r % Tq;
      const int64_t shift = std::min(Tq - 1 - i, Tk);
      // Output columns [lo, hi) read source columns [lo + d, hi + d), d = +-shift.
      const int64_t lo = inverse ? shift : 0;
      const int64_t hi = inverse ? Tk : Tk - shift;
      const int64_t d = inverse ? -shift : shift;
      char* orow = ob + r * Tk * elem_size;
      const char* xrow = xb + (n * stride_n + i * stride_q) * elem_size;
      std::memset(orow, 0, static_cast<size_t>(lo * elem_size));
      copy_row(xrow + (lo + d) * stride_k * elem_size, orow + lo * elem_size, hi - lo,
               stride_k, elem_size);
      std::memset(orow + hi * elem_size, 0, static_cast<size_t>((Tk - hi) * elem_size));
    }
  });
}

}  // namespace cpu
}  // namespace ctxfast
