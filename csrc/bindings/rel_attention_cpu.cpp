// CPU implementation of ctxfast::rel_attention_fwd_cpu / rel_attention_bwd_cpu:
// checks, then csrc/cpu/attention.cpp (rel_attention_forward / _backward), which computes
// Transformer-XL's position term from the band of r each tile needs (no [Tq, Tk] buffer).
// XLNet's segment term enters the kernel as ef = scale (q + r_s_bias)·seg_embed[s]
// [B, H, Tq, 2]; its gradient comes back per (row, s) and becomes d_seg_embed and
// d_r_s_bias here (O(T D) work). Dropout: the triton backend's Philox mask.
//
// Dtypes and layouts as csrc/bindings/attention_cpu.cpp: float32/float64 in their own
// precision, float16/bfloat16 computed in float32; unit stride in D used in place.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include <ATen/ops/einsum.h>
#include <ATen/ops/empty.h>

#include "bindings/attention_args.h"
#include "bindings/no_autocast.h"
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
  TORCH_CHECK_VALUE(Tq == 0 || (lowest >= 0 && highest < R), op, ": r too short: rows ",
                    lowest, "..", highest, " are needed, r has R=", R);  // (no query: none)
  // dtype: TypeError, shape: ValueError (as the attention op's and the Python layer's)
  if (kpm && kpm->defined()) {
    TORCH_CHECK_TYPE(kpm->scalar_type() == at::kBool, op,
                     ": key_padding_mask must be bool [", B, ", ", Tk, "]");
    TORCH_CHECK_VALUE(kpm->dim() == 2 && kpm->size(0) == B && kpm->size(1) == Tk, op,
                      ": key_padding_mask must be bool [", B, ", ", Tk, "]");
  }
  if (rank && rank->defined()) {
    TORCH_CHECK_TYPE(at::isIntegralType(rank->scalar_type(), /*includeBool=*/false), op,
                     ": perm_rank must be an integer tensor [", B, ", ", Tq, "]");
    TORCH_CHECK_VALUE(rank->dim() == 2 && rank->size(0) == B && rank->size(1) == Tq, op,
                      ": perm_rank must be an integer tensor [", B, ", ", Tq, "]");
  }
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

// A bias [H, D] as the kernel reads it: compute dtype, contiguous.
Tensor bias(const Tensor& b, at::ScalarType ct) { return b.to(ct).contiguous(); }

// The four segment tensors, all or none: seg_q [B, Tq], seg_k [B, Tk] integer,
// seg_embed [2, H, D], r_s_bias [H, D]. Returns qs = q + r_s_bias (compute dtype; undefined
// without segments) and the kernel's Segments.
struct SegArgs {
  Tensor qs, seg_embed;  // compute dtype
  cpu::Segments seg;
};

SegArgs segment_args(const char* op, const Tensor& q, const Tensor& k,
                     const std::optional<Tensor>& seg_q, const std::optional<Tensor>& seg_k,
                     const std::optional<Tensor>& seg_embed,
                     const std::optional<Tensor>& r_s_bias, at::ScalarType ct, double scale) {
  SegArgs a;
  const bool any = (seg_q && seg_q->defined()) || (seg_k && seg_k->defined()) ||
                   (seg_embed && seg_embed->defined()) || (r_s_bias && r_s_bias->defined());
  if (!any) return a;
  TORCH_CHECK_VALUE(seg_q && seg_q->defined() && seg_k && seg_k->defined() && seg_embed &&
                        seg_embed->defined() && r_s_bias && r_s_bias->defined(),
                    op, ": seg_q, seg_k, seg_embed and r_s_bias go together");
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.size(2);
  TORCH_CHECK_VALUE(seg_q->dim() == 2 && seg_q->size(0) == B && seg_q->size(1) == Tq &&
                        !at::isFloatingType(seg_q->scalar_type()),
                    op, ": seg_q must be an integer tensor [", B, ", ", Tq, "]");
  TORCH_CHECK_VALUE(seg_k->dim() == 2 && seg_k->size(0) == B && seg_k->size(1) == Tk &&
                        !at::isFloatingType(seg_k->scalar_type()),
                    op, ": seg_k must be an integer tensor [", B, ", ", Tk, "]");
  TORCH_CHECK_VALUE(seg_embed->dim() == 3 && seg_embed->size(0) == 2 &&
                        seg_embed->size(1) == H && seg_embed->size(2) == D,
                    op, ": seg_embed must have shape [2, ", H, ", ", D, "]");
  TORCH_CHECK_VALUE(r_s_bias->dim() == 2 && r_s_bias->size(0) == H && r_s_bias->size(1) == D,
                    op, ": r_s_bias must have shape [", H, ", ", D, "]");
  a.qs = add_bias(q, *r_s_bias, ct);                                       // [B, H, Tq, D]
  a.seg_embed = seg_embed->to(ct);                                         // [2, H, D]
  a.seg.ef = at::einsum("bhid,shd->bhis", {a.qs, a.seg_embed}).mul_(scale).contiguous();
  a.seg.seg_q = seg_q->to(at::kLong).contiguous();
  a.seg.seg_k = seg_k->to(at::kLong).contiguous();
  return a;
}

std::tuple<Tensor, Tensor> rel_attention_fwd_cpu(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& r, const Tensor& r_w_bias,
    const Tensor& r_r_bias, const std::optional<Tensor>& key_padding_mask,
    const std::optional<Tensor>& perm_rank, const std::optional<Tensor>& seg_q,
    const std::optional<Tensor>& seg_k, const std::optional<Tensor>& seg_embed,
    const std::optional<Tensor>& r_s_bias, bool causal, int64_t pos_start, int64_t window,
    bool perm_strict, double scale, double dropout_p, const std::optional<Tensor>& seed) {
  const NoAutocast no_autocast;
  check(kFwd, q, k, v, r, r_w_bias, r_r_bias, key_padding_mask, perm_rank, causal, pos_start);
  const at::ScalarType dt = q.scalar_type(), ct = compute_type(dt);
  const cpu::Dropout drop = dropout_args(kFwd, dropout_p, seed);
  const SegArgs sa = segment_args(kFwd, q, k, seg_q, seg_k, seg_embed, r_s_bias, ct, scale);
  auto [out, lse] = cpu::rel_attention_forward(
      prep(q, ct), bias(r_w_bias, ct), bias(r_r_bias, ct), prep(k, ct), prep(v, ct),
      prep(r, ct), opt_kpm(key_padding_mask), opt_rank(perm_rank), causal, perm_strict,
      pos_start, window, scale, sa.seg, drop);
  return {back_to(out, dt), lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> rel_attention_bwd_cpu(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& r,
    const Tensor& r_w_bias, const Tensor& r_r_bias, const Tensor& out, const Tensor& lse,
    const std::optional<Tensor>& key_padding_mask, const std::optional<Tensor>& perm_rank,
    const std::optional<Tensor>& seg_q, const std::optional<Tensor>& seg_k,
    const std::optional<Tensor>& seg_embed, const std::optional<Tensor>& r_s_bias,
    bool causal, int64_t pos_start, int64_t window, bool perm_strict, double scale,
    double dropout_p, const std::optional<Tensor>& seed) {
  const NoAutocast no_autocast;
  check(kBwd, q, k, v, r, r_w_bias, r_r_bias, key_padding_mask, perm_rank, causal, pos_start);
  TORCH_CHECK_VALUE(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(), kBwd,
                    ": grad_out and out must have q's shape ", q.sizes());
  TORCH_CHECK_VALUE(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                        lse.size(2) == q.size(2),
                    kBwd, ": lse must have shape [B, H, Tq]");
  const at::ScalarType dt = q.scalar_type(), ct = compute_type(dt);
  const cpu::Dropout drop = dropout_args(kBwd, dropout_p, seed);
  const SegArgs sa = segment_args(kBwd, q, k, seg_q, seg_k, seg_embed, r_s_bias, ct, scale);
  cpu::RelGrads g = cpu::rel_attention_backward(
      prep(grad_out, ct), prep(q, ct), bias(r_w_bias, ct), bias(r_r_bias, ct), prep(k, ct),
      prep(v, ct), prep(r, ct), prep(out, ct), lse.to(ct).contiguous(),
      opt_kpm(key_padding_mask), opt_rank(perm_rank), causal, perm_strict, pos_start, window,
      scale, sa.seg, drop);
  Tensor dq = g.dq, dk = g.dk, dv = g.dv, dr = g.dr, du = g.du, dw = g.dw, def = g.def;
  Tensor dse = at::empty({0}, dq.options()), drsb = at::empty({0}, dq.options());
  if (sa.seg.defined()) {  // def [B, H, Tq, 2]: d(ef) / scale
    Tensor dqs = at::einsum("bhis,shd->bhid", {def, sa.seg_embed}).mul_(scale);
    // contiguous, as the op's fake declares it (under torch.compile inductor checks it)
    dse = at::einsum("bhis,bhid->shd", {def, sa.qs}).mul_(scale).contiguous();
    drsb = dqs.sum(at::IntArrayRef{0, 2});
    dq.add_(dqs);
  }
  return {back_to(dq, dt), back_to(dk, dt), back_to(dv, dt), back_to(dr, dt),
          back_to(du, dt), back_to(dw, dt), back_to(dse, dt), back_to(drsb, dt)};
}

// ctxfast::rel_attention_cpu_grad: rel_attention_fwd_cpu with its gradient as a C++
// autograd Function, for eager code (ops/_common.py GradCall takes it where grad mode is on
// and an input requires grad). The same formula as the op's registered Python one
// (ops/rel_attention.py): forward and backward are the two ops, dispatched below autograd,
// so dispatch modes still see them. A Python Function and its backward cost ~0.2 ms of a
// forward+backward at B2 H8 T128 (4.6 ms), most of it here in C++ no more.
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using FwdSig = std::tuple<Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const std::optional<Tensor>&, const std::optional<Tensor>&, const std::optional<Tensor>&,
    const std::optional<Tensor>&, const std::optional<Tensor>&, const std::optional<Tensor>&,
    bool, int64_t, int64_t, bool, double, double, const std::optional<Tensor>&);
using BwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
    const std::optional<Tensor>&, const std::optional<Tensor>&, const std::optional<Tensor>&,
    const std::optional<Tensor>&, const std::optional<Tensor>&, bool, int64_t, int64_t, bool,
    double, double, const std::optional<Tensor>&);

std::optional<Tensor> opt(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

struct RelAttentionCpuGrad : public torch::autograd::Function<RelAttentionCpuGrad> {
  static variable_list forward(
      AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& r,
      const Tensor& u, const Tensor& w, const std::optional<Tensor>& kpm,
      const std::optional<Tensor>& rank, const std::optional<Tensor>& seg_q,
      const std::optional<Tensor>& seg_k, const std::optional<Tensor>& seg_embed,
      const std::optional<Tensor>& r_s_bias, bool causal, int64_t pos_start, int64_t window,
      bool perm_strict, double scale, double dropout_p, const std::optional<Tensor>& seed) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ctxfast::rel_attention_fwd_cpu", "")
                         .typed<FwdSig>();
    Tensor out, lse;
    {
      at::AutoDispatchBelowAutograd below;
      std::tie(out, lse) = op.call(q, k, v, r, u, w, kpm, rank, seg_q, seg_k, seg_embed,
                                   r_s_bias, causal, pos_start, window, perm_strict, scale,
                                   dropout_p, seed);
    }
    auto val = [](const std::optional<Tensor>& t) { return t ? *t : Tensor(); };
    ctx->save_for_backward({q, k, v, r, u, w, out, lse, val(kpm), val(rank), val(seg_q),
                            val(seg_k), val(seg_embed), val(r_s_bias), val(seed)});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["pos_start"] = pos_start;
    ctx->saved_data["window"] = window;
    ctx->saved_data["perm_strict"] = perm_strict;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ctxfast::rel_attention_bwd_cpu", "")
                         .typed<BwdSig>();
    const variable_list s = ctx->get_saved_variables();
    variable_list g(19);
    if (!grads[0].defined()) return g;
    Tensor dq, dk, dv, dr, du, dw, dse, drsb;
    // A backward with create_graph=True: its gradients would need a derivative, which this
    // path cannot record (the Python formula marks them so, ops/_common.first_order_only)
    TORCH_CHECK_NOT_IMPLEMENTED(
        !at::GradMode::is_enabled(),
        "rel_attention: a second derivative (the gradient of its gradient: create_graph=True) "
        "is not implemented; its CPU backward refuses create_graph=True");
    at::AutoDispatchBelowAutograd below;
    std::tie(dq, dk, dv, dr, du, dw, dse, drsb) = op.call(
        grads[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], opt(s[8]), opt(s[9]),
        opt(s[10]), opt(s[11]), opt(s[12]), opt(s[13]), ctx->saved_data["causal"].toBool(),
        ctx->saved_data["pos_start"].toInt(), ctx->saved_data["window"].toInt(),
        ctx->saved_data["perm_strict"].toBool(), ctx->saved_data["scale"].toDouble(),
        ctx->saved_data["dropout_p"].toDouble(), opt(s[14]));
    g[0] = dq;
    g[1] = dk;
    g[2] = dv;
    g[3] = dr;
    g[4] = du;
    g[5] = dw;
    if (s[12].defined()) {  // segments: d_seg_embed, d_r_s_bias
      g[10] = dse;
      g[11] = drsb;
    }
    return g;
  }
};

// The op's kernel (its parameters are the schema's, as rel_attention_fwd_cpu's above).
std::tuple<Tensor, Tensor> rel_attention_cpu_grad(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& r, const Tensor& r_w_bias,
    const Tensor& r_r_bias, const std::optional<Tensor>& key_padding_mask,
    const std::optional<Tensor>& perm_rank, const std::optional<Tensor>& seg_q,
    const std::optional<Tensor>& seg_k, const std::optional<Tensor>& seg_embed,
    const std::optional<Tensor>& r_s_bias, bool causal, int64_t pos_start, int64_t window,
    bool perm_strict, double scale, double dropout_p, const std::optional<Tensor>& seed) {
  variable_list o = RelAttentionCpuGrad::apply(
      q, k, v, r, r_w_bias, r_r_bias, key_padding_mask, perm_rank, seg_q, seg_k, seg_embed,
      r_s_bias, causal, pos_start, window, perm_strict, scale, dropout_p, seed);
  return {o[0], o[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(ctxfast, CPU, m) {
  m.impl("rel_attention_fwd_cpu", &rel_attention_fwd_cpu);
  m.impl("rel_attention_bwd_cpu", &rel_attention_bwd_cpu);
}

TORCH_LIBRARY_IMPL(ctxfast, Autograd, m) {
  m.impl("rel_attention_cpu_grad", &rel_attention_cpu_grad);
}

}  // namespace ctxfast
