// CPU implementation of ctxfast::rel_attention_fwd_cpu / rel_attention_bwd_cpu:
// checks, then csrc/cpu/attention.cpp (rel_attention_forward / _backward), which computes
// Transformer-XL's position term from the band of r each tile needs (no [Tq, Tk] buffer).
// Segments (XLNet's segment term) are not here: ctxfast.rel_attention runs them on eager.
//
// Dtypes and layouts as csrc/bindings/attention_cpu.cpp: float32/float64 in their own
// precision, float16/bfloat16 computed in float32; unit stride in D used in place.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cpu/attention.h"

namespace ctxfast {
namespace {

using at::Tensor;

constexpr const char* kFwd = "rel_attention_fwd_cpu";
constexpr const char* kBwd = "rel_attention_bwd_cpu";

at::ScalarType compute_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

Tensor prep(const Tensor& x, at::ScalarType ct) {
  Tensor y = x.scalar_type() == ct ? x : x.to(ct);
  if (y.stride(-1) != 1 || y.stride(-2) < y.size(-1)) y = y.contiguous();
  return y;
}

Tensor back_to(const Tensor& x, at::ScalarType dt) {
  return x.scalar_type() == dt ? x : x.to(dt);
}

void check(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& r,
           const Tensor& u, const Tensor& w, const std::optional<Tensor>& kpm,
           const std::optional<Tensor>& rank, bool causal, int64_t pos_start) {
  for (const Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK_VALUE(t->dim() == 4 && t->device().is_cpu(), op,
                      ": q, k, v must be CPU tensors [B, H, T, D], got ", t->sizes());
    TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type() && at::isFloatingType(t->scalar_type()),
                     op, ": q, k, v must have one floating dtype");
  }
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(),
                    op, ": k, v must have shape [", B, ", ", H, ", Tk, ", D, "]");
  TORCH_CHECK_VALUE(Tk >= Tq, op, ": Tk >= Tq is needed (keys are [memory; current])");
  TORCH_CHECK_VALUE(r.dim() == 3 && r.size(0) == H && r.size(2) == D, op,
                    ": r must have shape [", H, ", R, ", D, "], got ", r.sizes());
  TORCH_CHECK_VALUE(u.dim() == 2 && u.size(0) == H && u.size(1) == D && w.sizes() == u.sizes(),
                    op, ": r_w_bias and r_r_bias must have shape [", H, ", ", D, "]");
  const int64_t R = r.size(1);
  const int64_t lowest = pos_start - (Tk - 1), highest = causal ? pos_start : pos_start + Tq - 1;
  TORCH_CHECK_VALUE(lowest >= 0 && highest < R, op, ": r too short: rows ", lowest, "..",
                    highest, " are needed, r has R=", R);
  if (kpm && kpm->defined())
    TORCH_CHECK_VALUE(kpm->scalar_type() == at::kBool && kpm->dim() == 2 && kpm->size(0) == B &&
                          kpm->size(1) == Tk,
                      op, ": key_padding_mask must be bool [", B, ", ", Tk, "]");
  if (rank && rank->defined())
    TORCH_CHECK_VALUE(rank->dim() == 2 && rank->size(0) == B && rank->size(1) == Tq &&
                          at::isIntegralType(rank->scalar_type(), false),
                      op, ": perm_rank must be an integer tensor [", B, ", ", Tq, "]");
}

Tensor opt_kpm(const std::optional<Tensor>& kpm) {
  return kpm && kpm->defined() ? kpm->contiguous() : Tensor();
}

Tensor opt_rank(const std::optional<Tensor>& rank) {
  return rank && rank->defined() ? rank->to(at::kLong).contiguous() : Tensor();
}

// q + bias[None, :, None, :] in the compute dtype (contiguous).
Tensor add_bias(const Tensor& q, const Tensor& bias, at::ScalarType ct) {
  return q.to(ct).add(bias.to(ct).unsqueeze(0).unsqueeze(2));
}

std::tuple<Tensor, Tensor> rel_attention_fwd_cpu(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& r, const Tensor& r_w_bias,
    const Tensor& r_r_bias, const std::optional<Tensor>& key_padding_mask,
    const std::optional<Tensor>& perm_rank, bool causal, int64_t pos_start, int64_t window,
    bool perm_strict, double scale) {
  check(kFwd, q, k, v, r, r_w_bias, r_r_bias, key_padding_mask, perm_rank, causal, pos_start);
  const at::ScalarType dt = q.scalar_type(), ct = compute_type(dt);
  auto [out, lse] = cpu::rel_attention_forward(
      add_bias(q, r_w_bias, ct), add_bias(q, r_r_bias, ct), prep(k, ct), prep(v, ct),
      prep(r, ct), opt_kpm(key_padding_mask), opt_rank(perm_rank), causal, perm_strict,
      pos_start, window, scale);
  return {back_to(out, dt), lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> rel_attention_bwd_cpu(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& r,
    const Tensor& r_w_bias, const Tensor& r_r_bias, const Tensor& out, const Tensor& lse,
    const std::optional<Tensor>& key_padding_mask, const std::optional<Tensor>& perm_rank,
    bool causal, int64_t pos_start, int64_t window, bool perm_strict, double scale) {
  check(kBwd, q, k, v, r, r_w_bias, r_r_bias, key_padding_mask, perm_rank, causal, pos_start);
  TORCH_CHECK_VALUE(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(), kBwd,
                    ": grad_out and out must have q's shape ", q.sizes());
  TORCH_CHECK_VALUE(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                        lse.size(2) == q.size(2),
                    kBwd, ": lse must have shape [B, H, Tq]");
  const at::ScalarType dt = q.scalar_type(), ct = compute_type(dt);
  auto [dqu, dqw, dk, dv, dr] = cpu::rel_attention_backward(
      prep(grad_out, ct), add_bias(q, r_w_bias, ct), add_bias(q, r_r_bias, ct), prep(k, ct),
      prep(v, ct), prep(r, ct), prep(out, ct), lse.to(ct).contiguous(),
      opt_kpm(key_padding_mask), opt_rank(perm_rank), causal, perm_strict, pos_start, window,
      scale);
  Tensor du = dqu.sum({0, 2}), dw = dqw.sum({0, 2});
  return {back_to(dqu.add_(dqw), dt), back_to(dk, dt), back_to(dv, dt), back_to(dr, dt),
          back_to(du, dt), back_to(dw, dt)};
}

}  // namespace

TORCH_LIBRARY_IMPL(ctxfast, CPU, m) {
  m.impl("rel_attention_fwd_cpu", &rel_attention_fwd_cpu);
  m.impl("rel_attention_bwd_cpu", &rel_attention_bwd_cpu);
}

}  // namespace ctxfast
