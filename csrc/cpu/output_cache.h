// Output buffers of the CPU kernels, kept for reuse once their tensors are freed.
//
// Why: glibc returns large freed blocks to the kernel (munmap, or a trimmed heap top) by its
// own heuristics, and whether it does for a given call depends on the rest of the process's
// allocations. Where it does, every call's outputs (a rel_attention backward at B2 H8 T128:
// 3.5 MB) are fresh pages, and first touching them (a page fault and a zeroed page each)
// made that backward 2.9 -> 3.6 ms in some processes and not in others (2 cores, KVM). Like
// the CUDA caching allocator, freed blocks of at least kMinBytes wait here for the next
// request of the same size (rounded to 4 KiB); the least recently freed go back to the
// system when the cache would hold more than its cap.
//
// CTXFAST_CPU_CACHE_MB (read once): the cap in MiB, default 256; 0 turns the cache off
// (outputs from at::empty). torch.ops.ctxfast.cpu_cache_release() frees every cached block.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ctxfast {
namespace cpu {

// An uninitialised CPU tensor of `sizes` (contiguous) and options' dtype, its storage from
// the cache where the cache is on and the tensor has at least kMinBytes; else at::empty.
at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options);

// Frees every cached block; returns the bytes freed.
int64_t cache_release();

// Bytes held by the cache now (blocks waiting for reuse).
int64_t cache_held();

}  // namespace cpu
}  // namespace ctxfast
