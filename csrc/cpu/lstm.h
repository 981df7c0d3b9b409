// LSTM recurrence (one layer, one direction, all time steps) on the CPU: ATen GEMMs for
// the recurrent products, fused cell loops (at::parallel_for / OpenMP) for the rest.
//
// Math per step (gate order i, f, g, o as torch.nn.LSTM; the spec is ctxfast/reference/lstm.py):
//   W     = w_hh * mask * scale                    (mask undefined: W = w_hh, no scale)
//   z_t   = xw_t + h_{t-1} @ W^T
//   i,f,o = sigmoid(z_i, z_f, z_o),  g = tanh(z_g)
//   c_t   = clamp(f * c_{t-1} + i * g, -cell_clip, cell_clip)
//   hp_t  = o * tanh(c_t)
//   h_t   = clamp(hp_t @ w_hr^T, -proj_clip, proj_clip)  if w_hr is defined, else hp_t
// reverse == true runs t = T-1 .. 0; outputs stay in the original time order.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>

namespace ctxfast {
namespace cpu {

// Preconditions (checked by csrc/bindings/lstm_cpu.cpp): CPU, contiguous, one dtype
// (float32 or float64) for every tensor, H >= 1, P >= 1, shapes
//   xw [T, B, 4H], h0 [B, P], c0 [B, H], w_hh [4H, P],
//   w_hr [P, H] or undefined (then P == H), mask [4H, P] or undefined.
// Returns (out [T, B, P], cells [T, B, H] post-clip, gates [T, B, 4H] post-activation).
// The process's CPU settings for these kernels (read once): CTXFAST_LSTM_CPU_GEMM (unset,
// "avx2" or "aten") and CTXFAST_CPU_LINEAR (cpu_gemm.h). Any other value is a ValueError
// naming the variable, raised by the entry points before any kernel runs.
void check_lstm_settings();

// The code this process's recurrent GEMM runs on: "AVX-512", "AVX2" or "ATen" (for fp32
// batches up to 64; `ctxfast info` prints it).
std::string lstm_gemm_path();

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_recurrence_forward(
    const at::Tensor& xw, const at::Tensor& h0, const at::Tensor& c0, const at::Tensor& w_hh,
    const at::Tensor& w_hr, const at::Tensor& mask, double scale, double cell_clip,
    double proj_clip, bool reverse);

// Backward through time of lstm_recurrence_forward. Same preconditions, plus
//   grad_out [T, B, P], grad_cells [T, B, H], out/cells/gates as returned by the forward.
// Returns (grad_xw [T, B, 4H], grad_h0 [B, P], grad_c0 [B, H],
//          grad_w_hh [4H, P] (w.r.t. the unmasked w_hh: dW * mask * scale, or dW),
//          grad_w_hr [P, H], or an empty tensor of shape [0] when w_hr is undefined).
// A clamp passes the gradient where |stored value| < clip.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lstm_recurrence_backward(
    const at::Tensor& grad_out, const at::Tensor& grad_cells, const at::Tensor& h0,
    const at::Tensor& c0, const at::Tensor& w_hh, const at::Tensor& w_hr,
    const at::Tensor& mask, double scale, double cell_clip, double proj_clip, bool reverse,
    const at::Tensor& out, const at::Tensor& cells, const at::Tensor& gates);

}  // namespace cpu
}  // namespace ctxfast
