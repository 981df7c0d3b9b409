// Input checks of ctxfast::lstm_recurrence_native / lstm_recurrence_backward_native, shared
// by the CPU (lstm_cpu.cpp) and CUDA (lstm_cuda.cpp) bindings. Every check runs before any
// kernel launch and names the argument and the expected shape; shape errors raise
// ValueError, dtype errors TypeError (TORCH_CHECK_VALUE / TORCH_CHECK_TYPE).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <optional>
#include <vector>

namespace ctxfast {
namespace lstm {

// The sizes every LSTM tensor is checked against.
struct Dims {
  int64_t T, B, H, P;
  bool proj;
};

inline bool is_lstm_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline void check_tensor(const char* op, const char* name, const at::Tensor& x,
                         std::vector<int64_t> shape, const char* shape_text,
                         const at::Tensor& like, const char* like_name) {
  TORCH_CHECK_VALUE(x.dim() == static_cast<int64_t>(shape.size()) && x.sizes() == shape, op,
                    ": ", name, " must have shape ", shape_text, " = ", at::IntArrayRef(shape),
                    ", got ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == like.scalar_type(), op, ": ", name,
                   " must have ", like_name, "'s dtype ", like.scalar_type(), ", got ",
                   x.scalar_type());
  TORCH_CHECK_VALUE(x.device() == like.device(), op, ": ", name, " must be on ", like_name,
                    "'s device ", like.device(), ", got ", x.device());
}

inline void check_scalars(const char* op, double scale, double cell_clip, double proj_clip) {
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  TORCH_CHECK_VALUE(cell_clip > 0, op, ": cell_clip must be > 0 (math.inf for no clip), got ",
                    cell_clip);
  TORCH_CHECK_VALUE(proj_clip > 0, op, ": proj_clip must be > 0 (math.inf for no clip), got ",
                    proj_clip);
}

// Checks xw, h0, c0, w_hh, w_hr, mask and the scalars; returns T, B, H, P. `ref` is the
// tensor that fixes dtype and device (xw in the forward, gates in the backward).
inline Dims check_common(const char* op, const at::Tensor& ref, const char* ref_name,
                         const at::Tensor& h0, const at::Tensor& c0, const at::Tensor& w_hh,
                         const std::optional<at::Tensor>& w_hr,
                         const std::optional<at::Tensor>& mask, double scale,
                         double cell_clip, double proj_clip) {
  TORCH_CHECK_TYPE(is_lstm_float(ref.scalar_type()), op, ": ", ref_name,
                   " must be float16, bfloat16, float32 or float64, got ", ref.scalar_type());
  TORCH_CHECK_VALUE(ref.dim() == 3 && ref.size(2) % 4 == 0 && ref.size(2) > 0, op, ": ",
                    ref_name, " must have shape [T, B, 4H] with H >= 1, got ", ref.sizes());
  Dims d{ref.size(0), ref.size(1), ref.size(2) / 4, 0, w_hr.has_value() && w_hr->defined()};
  TORCH_CHECK_VALUE(w_hh.dim() == 2 && w_hh.size(0) == 4 * d.H && w_hh.size(1) > 0, op,
                    ": w_hh must have shape [4H, P] = [", 4 * d.H, ", P] with P >= 1, got ",
                    w_hh.sizes());
  d.P = w_hh.size(1);
  check_tensor(op, "w_hh", w_hh, {4 * d.H, d.P}, "[4H, P]", ref, ref_name);
  if (d.proj) {
    check_tensor(op, "w_hr", *w_hr, {d.P, d.H}, "[P, H]", ref, ref_name);
  } else {
    TORCH_CHECK_VALUE(d.P == d.H, op, ": without w_hr, w_hh must have shape [4H, H] = [",
                      4 * d.H, ", ", d.H, "], got ", w_hh.sizes());
  }
  if (mask.has_value() && mask->defined()) {
    check_tensor(op, "mask", *mask, {4 * d.H, d.P}, "[4H, P] (w_hh's shape)", ref, ref_name);
  }
  check_tensor(op, "h0", h0, {d.B, d.P}, "[B, P]", ref, ref_name);
  check_tensor(op, "c0", c0, {d.B, d.H}, "[B, H]", ref, ref_name);
  check_scalars(op, scale, cell_clip, proj_clip);
  return d;
}

// The extra tensors of the backward: the incoming gradients and the saved forward outputs.
inline void check_backward_extra(const char* op, const Dims& d, const at::Tensor& gates,
                                 const at::Tensor& grad_out, const at::Tensor& grad_cells,
                                 const at::Tensor& out, const at::Tensor& cells) {
  check_tensor(op, "grad_out", grad_out, {d.T, d.B, d.P}, "[T, B, P]", gates, "gates");
  check_tensor(op, "grad_cells", grad_cells, {d.T, d.B, d.H}, "[T, B, H]", gates, "gates");
  check_tensor(op, "out", out, {d.T, d.B, d.P}, "[T, B, P]", gates, "gates");
  check_tensor(op, "cells", cells, {d.T, d.B, d.H}, "[T, B, H]", gates, "gates");
}

// The clip as the storage dtype `dt` represents it. A value clipped at +-clip (in float32)
// is stored as exactly +-storage_clip, so the backward's test |stored| < storage_clip
// blocks its gradient (with the unrounded clip, a float16 cell clipped at 0.9 is stored as
// 0.8999 and its gradient would pass). The backward kernels compare against this value.
inline double storage_clip(double clip, at::ScalarType dt) {
  switch (dt) {
    case at::kHalf: return static_cast<float>(c10::Half(static_cast<float>(clip)));
    case at::kBFloat16: return static_cast<float>(c10::BFloat16(static_cast<float>(clip)));
    case at::kFloat: return static_cast<float>(clip);
    default: return clip;
  }
}

// The largest value of dtype `dt` below clip_s = storage_clip(clip, dt), as a float. A
// kernel that stores an UNclipped value v (|v| < clip) which rounds onto +-clip_s in
// float16/bfloat16 stores +-clip_below instead (one ulp off, within the dtype's rounding),
// so that a stored +-clip_s always means "clipped" and the backward's |stored| < clip_s
// test is exact. float32/float64 never need it (returns clip_s).
inline double clip_below(double clip_s, at::ScalarType dt) {
  if (!std::isfinite(clip_s) || clip_s <= 0) return clip_s;
  if (dt == at::kHalf) {
    c10::Half h(static_cast<float>(clip_s));
    h.x = static_cast<uint16_t>(h.x - 1);  // positive finite: one ulp toward zero
    return static_cast<float>(h);
  }
  if (dt == at::kBFloat16) {
    c10::BFloat16 h(static_cast<float>(clip_s));
    h.x = static_cast<uint16_t>(h.x - 1);
    return static_cast<float>(h);
  }
  return clip_s;
}

inline at::Tensor opt_or_undefined(const std::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? *t : at::Tensor();
}

}  // namespace lstm
}  // namespace ctxfast
