// The CPU kernels' output cache (contract in output_cache.h).
#include "cpu/output_cache.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace ctxfast {
namespace cpu {
namespace {

// Smaller blocks come from malloc's own free lists without fresh pages.
constexpr size_t kMinBytes = size_t(256) << 10;
constexpr size_t kRound = size_t(4) << 10;
constexpr size_t kAlign = 64;  // as c10's CPU allocator

size_t cap_bytes() {
  static const size_t cap = [] {
    const char* v = std::getenv("CTXFAST_CPU_CACHE_MB");
    long mb = 256;
    if (v != nullptr && *v != '\0') {
      char* end = nullptr;
      const long x = std::strtol(v, &end, 10);
      TORCH_CHECK_VALUE(end != v && *end == '\0' && x >= 0,
                        "CTXFAST_CPU_CACHE_MB must be a whole number of MiB >= 0 (0: no "
                        "cache), got '", v, "'");
      mb = x;
    }
    return static_cast<size_t>(mb) << 20;
  }();
  return cap;
}

void release_block(void* p);

// Blocks in use (pointer -> rounded size) and blocks waiting, oldest first. A few dozen
// blocks at most in practice (a model's outputs of a step), so the scans are short.
class OutputCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBytes) return at::getCPUAllocator()->allocate(n);
    const size_t bytes = (n + kRound - 1) / kRound * kRound;
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = free_.size(); i-- > 0;) {  // the most recently freed of this size
        if (free_[i].bytes == bytes) {
          p = free_[i].p;
          held_ -= bytes;
          free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
          break;
        }
      }
      if (p != nullptr) live_[p] = bytes;
    }
    if (p == nullptr) {
      if (posix_memalign(&p, kAlign, bytes) != 0 || p == nullptr) {
        release();  // what waits here may be what the system lacks
        TORCH_CHECK(posix_memalign(&p, kAlign, bytes) == 0 && p != nullptr,
                    "ctxfast: out of CPU memory allocating ", bytes, " bytes");
      }
      std::lock_guard<std::mutex> lock(mu_);
      live_[p] = bytes;
    }
    return {p, p, &release_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // A block's tensor was freed: keep it (evicting the oldest past the cap) or free it.
  void give_back(void* p) {
    std::vector<void*> to_free;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(p);
      const size_t bytes = it->second;
      live_.erase(it);
      const size_t cap = cap_bytes();
      if (bytes > cap) {
        to_free.push_back(p);
      } else {
        free_.push_back({p, bytes});
        held_ += bytes;
        size_t drop = 0;
        while (held_ > cap) {
          held_ -= free_[drop].bytes;
          to_free.push_back(free_[drop].p);
          ++drop;
        }
        free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(drop));
      }
    }
    for (void* q : to_free) std::free(q);
  }

  int64_t release() {
    std::vector<Block> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(free_);
      held_ = 0;
    }
    int64_t n = 0;
    for (const Block& b : blocks) {
      n += static_cast<int64_t>(b.bytes);
      std::free(b.p);
    }
    return n;
  }

  int64_t held() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(held_);
  }

 private:
  struct Block {
    void* p;
    size_t bytes;
  };
  std::mutex mu_;
  std::unordered_map<void*, size_t> live_;
  std::vector<Block> free_;
  size_t held_ = 0;
};

// Never destroyed: tensors freed while the process exits still find it.
OutputCache& cache() {
  static OutputCache* c = new OutputCache();
  return *c;
}

void release_block(void* p) { cache().give_back(p); }

}  // namespace

at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (cap_bytes() == 0) return at::empty(sizes, options);
  return at::detail::empty_generic(sizes, &cache(),
                                   c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), std::nullopt);
}

int64_t cache_release() { return cache().release(); }

int64_t cache_held() { return cache().held(); }

}  // namespace cpu
}  // namespace ctxfast
