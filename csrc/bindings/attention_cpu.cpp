// CPU implementation of ctxfast::attention_fwd_cpu / attention_bwd_cpu and
// ctxfast::attention_varlen_fwd_cpu / attention_varlen_bwd_cpu: checks, then
// csrc/cpu/attention.cpp.
//
// Dtypes: float32 and float64 run in their own precision (lse in that dtype); float16 and
// bfloat16 are computed in float32 (upcast here, outputs rounded back; lse stays float32).
// Layout: any strides with unit stride in D (and a row stride >= D) are used in place;
// others are copied to contiguous first.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "bindings/attention_args.h"
#include "cpu/attention.h"

namespace ctxfast {
namespace {

using at::Tensor;

at::ScalarType compute_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// In the compute dtype, unit stride in the last dim and a row stride (dim `row`) >= D.
Tensor prep(const Tensor& x, at::ScalarType ct, int64_t row) {
  Tensor y = x.scalar_type() == ct ? x : x.to(ct);
  const int64_t D = y.size(-1);
  if (y.stride(-1) != 1 || y.stride(row) < D) y = y.contiguous();
  return y;
}

Tensor back_to(const Tensor& x, at::ScalarType dt) {
  return x.scalar_type() == dt ? x : x.to(dt);
}

void check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
               int64_t rank) {
  for (const Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK_VALUE(t->dim() == rank, op, ": q, k, v must have rank ", rank, ", got ",
                      t->sizes());
    TORCH_CHECK_VALUE(t->device().is_cpu(), op, ": q, k, v must be CPU tensors");
    TORCH_CHECK_TYPE(at::isFloatingType(t->scalar_type()), op,
                     ": q, k, v must be floating point, got ", t->scalar_type());
    TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type(), op, ": q, k, v must have one dtype");
  }
}

void check_masks(const char* op, int64_t B, int64_t Tq, int64_t Tk, bool causal,
                 const std::optional<Tensor>& kpm, const std::optional<Tensor>& rank) {
  if ((causal || (rank && rank->defined())))
    TORCH_CHECK_VALUE(Tk >= Tq, op, ": with causal or perm_rank Tk >= Tq is needed, got Tq ",
                      Tq, ", Tk ", Tk);
  if (kpm && kpm->defined()) {
    TORCH_CHECK_TYPE(kpm->scalar_type() == at::kBool, op,
                     ": key_padding_mask must be bool [B, Tk]");
    TORCH_CHECK_VALUE(kpm->dim() == 2 && kpm->size(0) == B && kpm->size(1) == Tk, op,
                      ": key_padding_mask must have shape [", B, ", ", Tk, "], got ",
                      kpm->sizes());
  }
  if (rank && rank->defined()) {
    TORCH_CHECK_TYPE(at::isIntegralType(rank->scalar_type(), /*includeBool=*/false), op,
                     ": perm_rank must be an integer tensor [B, Tq]");
    TORCH_CHECK_VALUE(rank->dim() == 2 && rank->size(0) == B && rank->size(1) == Tq, op,
                      ": perm_rank must have shape [", B, ", ", Tq, "], got ", rank->sizes());
  }
}

Tensor opt_kpm(const std::optional<Tensor>& kpm) {
  return kpm && kpm->defined() ? kpm->contiguous() : Tensor();
}

Tensor opt_rank(const std::optional<Tensor>& rank) {
  return rank && rank->defined() ? rank->to(at::kLong).contiguous() : Tensor();
}

constexpr const char* kFwd = "attention_fwd_cpu";
constexpr const char* kBwd = "attention_bwd_cpu";

std::tuple<Tensor, Tensor> attention_fwd_cpu(const Tensor& q, const Tensor& k,
                                             const Tensor& v,
                                             const std::optional<Tensor>& key_padding_mask,
                                             const std::optional<Tensor>& perm_rank,
                                             bool causal, bool perm_strict, double scale,
                                             double dropout_p,
                                             const std::optional<Tensor>& seed) {
  check_qkv(kFwd, q, k, v, 4);
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(),
                    kFwd, ": k, v must have shape [", B, ", ", H, ", Tk, ", D, "], got k ",
                    k.sizes(), ", v ", v.sizes());
  check_masks(kFwd, B, Tq, Tk, causal, key_padding_mask, perm_rank);
  const at::ScalarType dt = q.scalar_type(), ct = compute_type(dt);
  auto [out, lse] = cpu::attention_forward(prep(q, ct, 2), prep(k, ct, 2), prep(v, ct, 2),
                                           opt_kpm(key_padding_mask), opt_rank(perm_rank),
                                           causal, perm_strict, scale,
                                           dropout_args(kFwd, dropout_p, seed));
  return {back_to(out, dt), lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd_cpu(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& lse, const std::optional<Tensor>& key_padding_mask,
    const std::optional<Tensor>& perm_rank, bool causal, bool perm_strict, double scale,
    double dropout_p, const std::optional<Tensor>& seed) {
  check_qkv(kBwd, q, k, v, 4);
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2);
  TORCH_CHECK_VALUE(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(), kBwd,
                    ": grad_out and out must have q's shape ", q.sizes());
  TORCH_CHECK_VALUE(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == H && lse.size(2) == Tq,
                    kBwd, ": lse must have shape [B, H, Tq], got ", lse.sizes());
  check_masks(kBwd, B, Tq, Tk, causal, key_padding_mask, perm_rank);
  const at::ScalarType dt = q.scalar_type(), ct = compute_type(dt);
  auto [dq, dk, dv] = cpu::attention_backward(
      prep(grad_out, ct, 2), prep(q, ct, 2), prep(k, ct, 2), prep(v, ct, 2), prep(out, ct, 2),
      lse.to(ct).contiguous(), opt_kpm(key_padding_mask), opt_rank(perm_rank), causal,
      perm_strict, scale, dropout_args(kBwd, dropout_p, seed));
  return {back_to(dq, dt), back_to(dk, dt), back_to(dv, dt)};
}

std::vector<int64_t> host_offsets(const char* op, const char* name, const Tensor& cu,
                                  int64_t total) {
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.numel() >= 1 && cu.device().is_cpu(), op, ": ", name,
                    " must be a CPU tensor [B + 1]");
  TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, op, ": ",
                   name, " must be int32 or int64");
  const Tensor c = cu.to(at::kLong).contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  std::vector<int64_t> v(p, p + c.numel());
  TORCH_CHECK_VALUE(v[0] == 0 && v.back() <= total, op, ": ", name,
                    " must start at 0 and end at most at ", total);
  for (size_t i = 1; i < v.size(); ++i)
    TORCH_CHECK_VALUE(v[i] >= v[i - 1], op, ": ", name, " must not decrease");
  return v;
}

// Dropout of the varlen ops: its counters are laid out by max_seqlen_q / _k, which must
// bound every sequence (as the Triton kernels assume).
cpu::Dropout varlen_dropout(const char* op, const std::vector<int64_t>& cq,
                            const std::vector<int64_t>& ck, int64_t max_q, int64_t max_k,
                            double dropout_p, const std::optional<Tensor>& seed) {
  const cpu::Dropout d = dropout_args(op, dropout_p, seed);
  if (d.p > 0) {
    for (size_t b = 0; b + 1 < cq.size(); ++b)
      TORCH_CHECK_VALUE(cq[b + 1] - cq[b] <= max_q && ck[b + 1] - ck[b] <= max_k, op,
                        ": with dropout, max_seqlen_q / max_seqlen_k must bound every "
                        "sequence; sequence ", b, " has ", cq[b + 1] - cq[b], " / ",
                        ck[b + 1] - ck[b]);
  }
  return d;
}

constexpr const char* kVFwd = "attention_varlen_fwd_cpu";
constexpr const char* kVBwd = "attention_varlen_bwd_cpu";

std::tuple<Tensor, Tensor> attention_varlen_fwd_cpu(const Tensor& q, const Tensor& k,
                                                    const Tensor& v, const Tensor& cu_seqlens_q,
                                                    const Tensor& cu_seqlens_k, bool causal,
                                                    double scale, int64_t max_seqlen_q,
                                                    int64_t max_seqlen_k, double dropout_p,
                                                    const std::optional<Tensor>& seed) {
  check_qkv(kVFwd, q, k, v, 3);
  TORCH_CHECK_VALUE(k.size(1) == q.size(1) && k.size(2) == q.size(2) && v.sizes() == k.sizes(),
                    kVFwd, ": k, v must have shape [total_k, H, D] matching q");
  auto cq = host_offsets(kVFwd, "cu_seqlens_q", cu_seqlens_q, q.size(0));
  auto ck = host_offsets(kVFwd, "cu_seqlens_k", cu_seqlens_k, k.size(0));
  TORCH_CHECK_VALUE(cq.size() == ck.size(), kVFwd,
                    ": cu_seqlens_q and cu_seqlens_k must have one length");
  const at::ScalarType dt = q.scalar_type(), ct = compute_type(dt);
  const cpu::Dropout drop = varlen_dropout(kVFwd, cq, ck, max_seqlen_q, max_seqlen_k,
                                           dropout_p, seed);
  auto [out, lse] = cpu::attention_varlen_forward(prep(q, ct, 0), prep(k, ct, 0),
                                                  prep(v, ct, 0), cq, ck, causal, scale,
                                                  max_seqlen_q, max_seqlen_k, drop);
  return {back_to(out, dt), lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_varlen_bwd_cpu(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_k, bool causal, double scale, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double dropout_p, const std::optional<Tensor>& seed) {
  check_qkv(kVBwd, q, k, v, 3);
  TORCH_CHECK_VALUE(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(), kVBwd,
                    ": grad_out and out must have q's shape ", q.sizes());
  TORCH_CHECK_VALUE(lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
                    kVBwd, ": lse must have shape [H, total_q], got ", lse.sizes());
  auto cq = host_offsets(kVBwd, "cu_seqlens_q", cu_seqlens_q, q.size(0));
  auto ck = host_offsets(kVBwd, "cu_seqlens_k", cu_seqlens_k, k.size(0));
  TORCH_CHECK_VALUE(cq.size() == ck.size(), kVBwd,
                    ": cu_seqlens_q and cu_seqlens_k must have one length");
  const at::ScalarType dt = q.scalar_type(), ct = compute_type(dt);
  auto [dq, dk, dv] = cpu::attention_varlen_backward(
      prep(grad_out, ct, 0), prep(q, ct, 0), prep(k, ct, 0), prep(v, ct, 0), prep(out, ct, 0),
      lse.to(ct).contiguous(), cq, ck, causal, scale, max_seqlen_q, max_seqlen_k,
      varlen_dropout(kVBwd, cq, ck, max_seqlen_q, max_seqlen_k, dropout_p, seed));
  return {back_to(dq, dt), back_to(dk, dt), back_to(dv, dt)};
}

// ctxfast::keep_mask_cpu: checks, then cpu::keep_mask.
Tensor keep_mask_cpu(const Tensor& like, const Tensor& seed, double p) {
  constexpr const char* op = "keep_mask_cpu";
  TORCH_CHECK_VALUE(like.device().is_cpu(), op, ": like must be a CPU tensor");
  TORCH_CHECK_TYPE(at::isFloatingType(like.scalar_type()), op,
                   ": like must be floating point, got ", like.scalar_type());
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, op, ": p must be in [0, 1), got ", p);
  TORCH_CHECK_VALUE(seed.scalar_type() == at::kLong && seed.numel() == 1 &&
                        seed.device().is_cpu(),
                    op, ": seed must be an int64 CPU tensor of one element");
  return cpu::keep_mask(like, static_cast<uint64_t>(seed.item<int64_t>()), p);
}

}  // namespace

TORCH_LIBRARY_IMPL(ctxfast, CPU, m) {
  m.impl("keep_mask_cpu", &keep_mask_cpu);
  m.impl("attention_fwd_cpu", &attention_fwd_cpu);
  m.impl("attention_bwd_cpu", &attention_bwd_cpu);
  m.impl("attention_varlen_fwd_cpu", &attention_varlen_fwd_cpu);
  m.impl("attention_varlen_bwd_cpu", &attention_varlen_bwd_cpu);
}

}  // namespace ctxfast
