// CPU implementation of ctxfast::lstm_recurrence_native and
// ctxfast::lstm_recurrence_backward_native: checks, then csrc/cpu/lstm.cpp.
//
// Dtypes: float32 and float64 run in their own precision. float16 and bfloat16 inputs are
// computed in float32 (upcast here, outputs rounded back to the input dtype), as the
// contract asks ("compute in fp32, store in xw's dtype"); CPUs have no fast half GEMM.
// The forward clips at the given clip in float32; an unclipped value is never stored as
// the clip rounded to the dtype (lstm::clip_below), and the backward compares the stored
// values with that rounded clip (lstm::storage_clip), so its clip test is exact.
// Layout: non-contiguous inputs are accepted; they are made contiguous here (a copy only
// where needed).
#include <ATen/core/Tensor.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "bindings/lstm_checks.h"
#include "bindings/no_autocast.h"
#include "cpu/lstm.h"

namespace ctxfast {
namespace {

using at::Tensor;

constexpr const char* kFwd = "lstm_recurrence_native (CPU)";
constexpr const char* kBwd = "lstm_recurrence_backward_native (CPU)";

at::ScalarType compute_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// In the compute dtype and contiguous; an undefined tensor stays undefined.
Tensor prep(const Tensor& x, at::ScalarType ct) {
  return x.defined() ? x.to(ct).contiguous() : x;
}

Tensor back_to(const Tensor& x, at::ScalarType dt) { return x.scalar_type() == dt ? x : x.to(dt); }

// A clipped float32 output (cells or the projection, clipped at +-clip) rounded to dt,
// where an unclipped value that rounds onto +-storage_clip is stored one ulp inside
// instead (see lstm::clip_below), so that the backward's |stored| < storage_clip test
// tells clipped from unclipped values exactly.
Tensor back_to_clipped(const Tensor& x, at::ScalarType dt, double clip) {
  Tensor r = back_to(x, dt);
  if (r.scalar_type() == x.scalar_type() || !std::isfinite(clip)) return r;
  const double clip_s = lstm::storage_clip(clip, dt);
  const Tensor onto_clip =
      r.abs().ge(clip_s).logical_and_(x.abs().lt(static_cast<float>(clip)));
  return at::where(onto_clip, x.sign().mul_(lstm::clip_below(clip_s, dt)).to(dt), r);
}

std::tuple<Tensor, Tensor, Tensor> lstm_recurrence_cpu(
    const Tensor& xw, const Tensor& h0, const Tensor& c0, const Tensor& w_hh,
    const std::optional<Tensor>& w_hr, const std::optional<Tensor>& mask, double scale,
    double cell_clip, double proj_clip, bool reverse) {
  const NoAutocast no_autocast;
  cpu::check_lstm_settings();
  lstm::check_common(kFwd, xw, "xw", h0, c0, w_hh, w_hr, mask, scale, cell_clip, proj_clip);
  TORCH_CHECK_VALUE(xw.device().is_cpu(), kFwd, ": xw must be a CPU tensor, got ", xw.device());
  const at::ScalarType dt = xw.scalar_type(), ct = compute_type(dt);
  auto [out, cells, gates] = cpu::lstm_recurrence_forward(
      prep(xw, ct), prep(h0, ct), prep(c0, ct), prep(w_hh, ct),
      prep(lstm::opt_or_undefined(w_hr), ct), prep(lstm::opt_or_undefined(mask), ct), scale,
      cell_clip, proj_clip, reverse);
  const bool proj = w_hr.has_value() && w_hr->defined();
  return {proj ? back_to_clipped(out, dt, proj_clip) : back_to(out, dt),
          back_to_clipped(cells, dt, cell_clip), back_to(gates, dt)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> lstm_recurrence_backward_cpu(
    const Tensor& grad_out, const Tensor& grad_cells, const Tensor& h0, const Tensor& c0,
    const Tensor& w_hh, const std::optional<Tensor>& w_hr, const std::optional<Tensor>& mask,
    double scale, double cell_clip, double proj_clip, bool reverse, const Tensor& out,
    const Tensor& cells, const Tensor& gates) {
  const NoAutocast no_autocast;
  cpu::check_lstm_settings();
  const lstm::Dims d = lstm::check_common(kBwd, gates, "gates", h0, c0, w_hh, w_hr, mask,
                                          scale, cell_clip, proj_clip);
  lstm::check_backward_extra(kBwd, d, gates, grad_out, grad_cells, out, cells);
  TORCH_CHECK_VALUE(gates.device().is_cpu(), kBwd, ": gates must be a CPU tensor, got ",
                    gates.device());
  const at::ScalarType dt = gates.scalar_type(), ct = compute_type(dt);
  auto [gxw, gh0, gc0, gwhh, gwhr] = cpu::lstm_recurrence_backward(
      prep(grad_out, ct), prep(grad_cells, ct), prep(h0, ct), prep(c0, ct), prep(w_hh, ct),
      prep(lstm::opt_or_undefined(w_hr), ct), prep(lstm::opt_or_undefined(mask), ct), scale,
      lstm::storage_clip(cell_clip, dt), lstm::storage_clip(proj_clip, dt), reverse,
      prep(out, ct), prep(cells, ct), prep(gates, ct));
  return {back_to(gxw, dt), back_to(gh0, dt), back_to(gc0, dt), back_to(gwhh, dt),
          back_to(gwhr, dt)};
}

}  // namespace

TORCH_LIBRARY_IMPL(ctxfast, CPU, m) {
  m.impl("lstm_recurrence_native", &lstm_recurrence_cpu);
  m.impl("lstm_recurrence_backward_native", &lstm_recurrence_backward_cpu);
}

}  // namespace ctxfast
