// Fused scaled-dot-product attention on the CPU (the `cpu` backend of ctxfast.attention
// and ctxfast.attention_varlen). Flash-style: no [Tq, Tk] tensor is ever allocated.
//
// Math, for one (sequence, head) with q [Tq, D], k, v [Tk, D], mem = Tk - Tq:
//   s_ij = scale * q_i . k_j, masked to -inf where key j is not visible to query i:
//     causal:   j <= i + mem (bottom-right aligned);
//     padding:  key_padding_mask[j] is false (true = padding);
//     perm:     j < mem, or rank[j - mem] <= rank[i] (content stream) / < (query stream).
//   Forward, over key blocks of kBlockK with an online softmax per row:
//     m_i = running max, l_i = running sum of exp(s_ij - m_i), acc_i = sum p_ij v_j,
//     o_i = acc_i / l_i, lse_i = m_i + log l_i (natural log; +inf for a row that sees no
//     key, whose output is 0).
//   Backward, from lse: p_ij = exp(s_ij - lse_i) (0 where masked and on empty rows),
//     Delta_i = do_i . o_i, dp_ij = do_i . v_j, ds_ij = p_ij (dp_ij - Delta_i),
//     dv_j = sum_i p_ij do_i, dk_j = scale sum_i ds_ij q_i, dq_i = scale sum_j ds_ij k_j.
// The block products: float32 on the project's AVX2/FMA kernel (6 x 16 register blocks,
// operands read in place, K, V and r transposed once per head for the products that take
// them transposed) where the CPU has AVX2 but not AVX-512; otherwise BLAS GEMMs
// (sgemm_/dgemm_ of the BLAS torch links; a plain loop where none is found). One-query
// products run on AVX2 row loops. exp is an AVX2/FMA (or AVX-512) polynomial for float32.
//
// Inputs are float32 or float64 (the bindings upcast half types), with unit stride in D.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

#include <cstdint>
#include <tuple>
#include <vector>

namespace ctxfast {
namespace cpu {

// Attention dropout on the probabilities (p > 0): keep (b, h, i, j) iff u >= p, u the
// uniform float of Philox-4x32-10 (key = seed, counter = ((b H + h) Tq + i) Tk + j, first
// word) as Triton's tl.rand draws it, so the keep mask equals the triton backend's for the
// same seed; kept probabilities are scaled by 1 / (1 - p). The normaliser l_i and lse are
// taken before dropout.
struct Dropout {
  double p = 0.0;
  uint64_t seed = 0;
};

// XLNet's segment term of rel_attention: the score adds ef[b, h, i, s],
// s = (seg_q[b, i] != seg_k[b, j]), with ef = scale (q + r_s_bias)·seg_embed[s]
// [B, H, Tq, 2] (contiguous, the compute dtype); seg_q [B, Tq], seg_k [B, Tk] int64
// contiguous. Undefined tensors: no segment term.
struct Segments {
  at::Tensor seg_q, seg_k, ef;
  bool defined() const { return ef.defined(); }
};

// q [B, H, Tq, D], k, v [B, H, Tk, D] (stride 1 in D), key_padding_mask bool [B, Tk]
// contiguous or undefined, perm_rank int64 [B, Tq] contiguous or undefined.
// Returns out [B, H, Tq, D] contiguous (q's dtype) and lse [B, H, Tq] (q's dtype).
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& key_padding_mask, const at::Tensor& perm_rank, bool causal,
    bool perm_strict, double scale, const Dropout& dropout = {});

// Gradients dq [B, H, Tq, D], dk, dv [B, H, Tk, D] (contiguous) of the forward above.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& key_padding_mask, const at::Tensor& perm_rank, bool causal,
    bool perm_strict, double scale, const Dropout& dropout = {});

// rel_attention (Transformer-XL, XLNet): q [B, H, Tq, D], k, v [B, H, Tk, D], r [H, R, D]
// (stride 1 in D), r_w_bias = u and r_r_bias = w [H, D] contiguous; the score is
// scale (q_i + u) . k_j + scale (q_i + w) . r[pos_start - (mem + i - j)] plus, with
// segments, their term; window > 0 also hides pairs with mem + i - j >= window. The biased
// query rows are formed per block inside the kernel. Returns out, lse as attention_forward.
std::tuple<at::Tensor, at::Tensor> rel_attention_forward(
    const at::Tensor& q, const at::Tensor& r_w_bias, const at::Tensor& r_r_bias,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& r,
    const at::Tensor& key_padding_mask, const at::Tensor& perm_rank, bool causal,
    bool perm_strict, int64_t pos_start, int64_t window, double scale,
    const Segments& seg = {}, const Dropout& dropout = {});

// Its gradients: dq [B, H, Tq, D] (both terms), du, dw [H, D] (the biases), dk, dv
// [B, H, Tk, D], dr [H, R, D], and with segments def = d(ef) / scale [B, H, Tq, 2], the
// sum over j of dS_ij where s(i, j) = s (undefined without segments).
struct RelGrads {
  at::Tensor dq, du, dw, dk, dv, dr, def;
};
RelGrads rel_attention_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                const at::Tensor& r_w_bias, const at::Tensor& r_r_bias,
                                const at::Tensor& k, const at::Tensor& v, const at::Tensor& r,
                                const at::Tensor& out, const at::Tensor& lse,
                                const at::Tensor& key_padding_mask, const at::Tensor& perm_rank,
                                bool causal, bool perm_strict, int64_t pos_start,
                                int64_t window, double scale, const Segments& seg = {},
                                const Dropout& dropout = {});

// Packed sequences: q [total_q, H, D], k, v [total_k, H, D] (stride 1 in D); sequence b
// is rows cu_q[b]:cu_q[b+1] of q and cu_k[b]:cu_k[b+1] of k, v. Causal is bottom-right
// aligned per sequence. Returns out [total_q, H, D] (0 outside every sequence) and
// lse [H, total_q]. Dropout's counter of (sequence b, head h, i, j) is
// ((b H + h) max_q + i) max_k + j, i and j counted within the sequence (as Triton's).
std::tuple<at::Tensor, at::Tensor> attention_varlen_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::vector<int64_t>& cu_q, const std::vector<int64_t>& cu_k, bool causal,
    double scale, int64_t max_q = 0, int64_t max_k = 0, const Dropout& dropout = {});

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const std::vector<int64_t>& cu_q, const std::vector<int64_t>& cu_k, bool causal,
    double scale, int64_t max_q = 0, int64_t max_k = 0, const Dropout& dropout = {});

// A 0/1 keep-mask shaped like `like` (its dtype, contiguous), from Philox-4x32-10 keyed by
// `seed`, all four words of each output used: element e = 32 b + 8 w + l (row-major) is
// word w of counter 8 b + l, kept iff its uniform (the attention dropout's conversion) is
// >= p. Filled in parallel (at::parallel_for over chunks), AVX2 where the CPU has it.
at::Tensor keep_mask(const at::Tensor& like, uint64_t seed, double p);

// The code this process's attention tile products run on: "own AVX-512", "own AVX2" or
// "BLAS" (own_gemm and the CPU's flags; `ctxfast info` prints it).
std::string attention_tile_path();

}  // namespace cpu
}  // namespace ctxfast
