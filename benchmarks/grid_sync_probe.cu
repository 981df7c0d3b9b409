// What one step of the persistent LSTM costs before any arithmetic: a grid barrier, and a
// grid barrier after every block has read the whole previous h from L2 and written its
// units' part of the next one (the forward's exchange of h_{t-1} / h_t).
//
//   nvcc -O3 -arch=sm_90 -o grid_sync_probe benchmarks/grid_sync_probe.cu && ./grid_sync_probe
//
// On the H200 the tensor-core forward takes 28 us a step in bf16 at the ULMFiT layer (B 64,
// H 1152, 128 blocks of 256 threads, 130 KB of shared memory each) and 82 us in float32,
// for a few us of products (benchmarks/NOTES.md, round 4); this says how much of a step is
// the barrier and the exchange alone. Plain CUDA runtime, no torch; one line per case:
//   <case> blocks <n> threads <n> bytes_per_block <n>: <us> us per step (median of 5 runs)
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace cg = cooperative_groups;

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t err_ = (x);                                                        \
    if (err_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

// steps grid barriers; with words > 0, before each: every block reads `words` 16-byte words
// of the current buffer (all of h) and writes its `mine` words of the other one.
__global__ void step_kernel(int steps, const uint4* __restrict__ h0, uint4* h1, int words,
                            int mine, unsigned* sink) {
  cg::grid_group grid = cg::this_grid();
  unsigned acc = 0;
  for (int s = 0; s < steps; ++s) {
    const uint4* cur = (s & 1) ? h1 : h0;
    uint4* nxt = const_cast<uint4*>((s & 1) ? h0 : h1);
    for (int w = threadIdx.x; w < words; w += blockDim.x) {
      const uint4 v = __ldcg(cur + w);  // L2, as the kernels' operand loads
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    for (int w = threadIdx.x; w < mine; w += blockDim.x) {
      nxt[int64_t(blockIdx.x) * mine + w] = make_uint4(acc, s, w, blockIdx.x);
    }
    grid.sync();
  }
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads
}

static float run_case(const char* name, int blocks, int threads, size_t smem, int steps,
                      int words, int mine) {
  uint4 *h0 = nullptr, *h1 = nullptr;
  unsigned* sink = nullptr;
  const size_t n = std::max<size_t>(size_t(words), size_t(blocks) * mine) + 1;
  CHECK(cudaMalloc(&h0, n * sizeof(uint4)));
  CHECK(cudaMalloc(&h1, n * sizeof(uint4)));
  CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  CHECK(cudaMemset(h0, 1, n * sizeof(uint4)));
  CHECK(cudaMemset(h1, 2, n * sizeof(uint4)));
  CHECK(cudaFuncSetAttribute(step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(smem)));
  void* args[] = {&steps, &h0, &h1, &words, &mine, &sink};
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> us;
  for (int rep = 0; rep < 6; ++rep) {  // the first is a warm-up
    CHECK(cudaEventRecord(a));
    CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(step_kernel), dim3(blocks),
                                      dim3(threads), args, smem, nullptr));
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (rep > 0) us.push_back(ms * 1000.0f / steps);
  }
  std::sort(us.begin(), us.end());
  std::printf("%-34s blocks %d threads %d bytes_per_block %zu: %.2f us per step\n", name,
              blocks, threads, size_t(words) * sizeof(uint4), us[us.size() / 2]);
  CHECK(cudaFree(h0));
  CHECK(cudaFree(h1));
  CHECK(cudaFree(sink));
  return us[us.size() / 2];
}

int main() {
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device %s, %d SMs\n", prop.name, sms);
  const int blocks = std::min(128, sms), threads = 256, steps = 1000;
  const size_t smem = 130 * 1024;             // one block per SM, as the LSTM kernels
  const int B = 64, H = 1152, U = 9;           // the ULMFiT layer: h [B, H], U units a block
  run_case("grid.sync alone", blocks, threads, smem, steps, 0, 0);
  for (int esize : {2, 4}) {                   // h in bf16 / float32 operands
    const int words = B * H * esize / 16, mine = std::max(1, B * U * esize / 16);
    char name[64];
    std::snprintf(name, sizeof(name), "h exchange, %s operands", esize == 2 ? "bf16" : "fp32");
    run_case(name, blocks, threads, smem, steps, words, mine);
  }
  return 0;
}
