// ctxfast._C: the Python module, and the schemas of every C++ op (one TORCH_LIBRARY
// block for the namespace). CPU implementations are registered next to their checks in
// csrc/bindings/<op>_cpu.cpp; CUDA implementations in csrc/bindings/<op>_cuda.cpp, which
// are built into ctxfast._cuda.
#include <Python.h>
#include <torch/library.h>

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <sstream>
#include <stdexcept>

#include "cpu/attention.h"
#include "cpu/cpu_gemm.h"
#include "cpu/lstm.h"
#include "cpu/output_cache.h"

namespace ctxfast {
extern PyMethodDef kLaunchKeyMethod;  // csrc/bindings/launch_key.cpp
}

extern "C" {
// The module: one Python function (launch_key, host glue of kernels/_launch.py); importing
// it runs the static registrations of the ops below.
PyMODINIT_FUNC PyInit__C(void) {
  static PyMethodDef methods[] = {ctxfast::kLaunchKeyMethod, {nullptr, nullptr, 0, nullptr}};
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "ctxfast C++ CPU kernels (ops under torch.ops.ctxfast)",
      -1, methods};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(ctxfast, m) {
  // Transformer-XL relative shift (see csrc/cpu/rel_shift.h for the formula). The
  // "native" op runs csrc/cpu on CPU tensors and csrc/cuda on CUDA tensors.
  m.def("rel_shift_native(Tensor x, bool inverse=False) -> Tensor");
  m.def("rel_shift_native.out(Tensor x, bool inverse=False, *, Tensor(a!) out) -> Tensor(a!)");
  // LSTM recurrence, one layer and direction, all T steps (contract: ctxfast/ops/lstm.py; math in
  // csrc/cpu/lstm.h): returns out [T,B,P], cells [T,B,H], gates [T,B,4H]; the backward
  // returns grad_xw, grad_h0, grad_c0, grad_w_hh (unmasked), grad_w_hr ([0] without w_hr).
  m.def("lstm_recurrence_native(Tensor xw, Tensor h0, Tensor c0, Tensor w_hh, Tensor? w_hr, "
        "Tensor? mask, float scale, float cell_clip, float proj_clip, bool reverse) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("lstm_recurrence_backward_native(Tensor grad_out, Tensor grad_cells, Tensor h0, "
        "Tensor c0, Tensor w_hh, Tensor? w_hr, Tensor? mask, float scale, float cell_clip, "
        "float proj_clip, bool reverse, Tensor out, Tensor cells, Tensor gates) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // DropConnect keep-mask (csrc/cpu/attention.h keep_mask): 0/1 of like's shape and dtype,
  // element e kept iff the Philox uniform of (seed, e) >= p; seed int64 [1], CPU.
  m.def("keep_mask_cpu(Tensor like, Tensor seed, float p) -> Tensor");
  // Fused attention (math in csrc/cpu/attention.h): the `cpu` backend of ctxfast.attention
  // and ctxfast.attention_varlen. lse is float64 for float64 inputs, else float32.
  // dropout_p > 0 needs seed (int64 [1], CPU): the triton backend's Philox mask.
  m.def("attention_fwd_cpu(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, "
        "Tensor? perm_rank, bool causal, bool perm_strict, float scale, float dropout_p, "
        "Tensor? seed) -> (Tensor, Tensor)");
  m.def("attention_bwd_cpu(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, Tensor? key_padding_mask, Tensor? perm_rank, bool causal, "
        "bool perm_strict, float scale, float dropout_p, Tensor? seed) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("attention_varlen_fwd_cpu(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, bool causal, float scale, SymInt max_seqlen_q, SymInt max_seqlen_k, "
        "float dropout_p, Tensor? seed) -> (Tensor, Tensor)");
  m.def("attention_varlen_bwd_cpu(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, bool causal, float scale, "
        "SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, Tensor? seed) "
        "-> (Tensor, Tensor, Tensor)");
  // The CPU kernels' cache of freed output buffers (csrc/cpu/output_cache.h; cap
  // CTXFAST_CPU_CACHE_MB): free every cached block (returns the bytes), or the bytes held.
  m.def("cpu_cache_release() -> int", [] { return ctxfast::cpu::cache_release(); });
  m.def("cpu_cache_held() -> int", [] { return ctxfast::cpu::cache_held(); });
  // Where large fp32 products go (csrc/cpu/cpu_gemm.h): "onednn", "aten", or "bad: ..."
  // (an unusable CTXFAST_CPU_LINEAR, which the callers refuse).
  m.def("cpu_linear_path() -> str", [] { return ctxfast::cpu::linear_path(); });
  // What code the CPU kernels run on in this process, one line (`ctxfast info`).
  m.def("cpu_code_paths() -> str", [] {
    return "attention tiles: " + ctxfast::cpu::attention_tile_path() +
           "; LSTM recurrence: " + ctxfast::cpu::lstm_gemm_path() +
           "; LSTM projections and weight gradients: " + ctxfast::cpu::linear_path();
  });
  // Diagnostics (benchmarks/exception_probe.py): raise on purpose, three ways, so a machine
  // where our refusals crash the process says which part crashes. kind 0: TORCH_CHECK_VALUE
  // (c10::ValueError, the backtrace captured at the throw, as every check here does);
  // 1: c10::ValueError with no backtrace captured; 2: std::invalid_argument (no c10).
  // 3-5: TORCH_CHECK_VALUE with a double / an int64 / sizes in the message (what every op's
  // refusal formats; 0 formats a literal only); 6: a double through std::ostringstream,
  // then std::invalid_argument (formatting with no c10 involved).
  m.def("probe_throw(int kind) -> ()", [](int64_t kind) {
    if (kind == 1) throw c10::ValueError("probe_throw: c10::ValueError, no backtrace", nullptr);
    if (kind == 2) throw std::invalid_argument("probe_throw: std::invalid_argument");
    if (kind == 3) TORCH_CHECK_VALUE(false, "probe_throw: a double ", 0.5);
    if (kind == 4) TORCH_CHECK_VALUE(false, "probe_throw: an int64 ", kind);
    if (kind == 5) {
      const std::vector<int64_t> sizes{2, 3};
      TORCH_CHECK_VALUE(false, "probe_throw: sizes ", at::IntArrayRef(sizes));
    }
    if (kind == 6) {
      std::ostringstream os;
      os << "probe_throw: ostringstream " << 0.5;
      throw std::invalid_argument(os.str());
    }
    TORCH_CHECK_VALUE(false, "probe_throw: TORCH_CHECK_VALUE");
  });
  // Diagnostics: on SIGSEGV print the native stack (glibc backtrace, to stderr), then die
  // of the signal as before. The probe installs it in each case's process: Python's
  // faulthandler names only the Python frames.
  m.def("probe_segv_backtrace() -> ()", [] {
    struct sigaction sa = {};
    sa.sa_handler = [](int sig) {
      void* frames[64];
      const int n = backtrace(frames, 64);
      static const char head[] = "native stack at the fault:\n";
      if (write(STDERR_FILENO, head, sizeof(head) - 1) < 0) {}
      backtrace_symbols_fd(frames, n, STDERR_FILENO);
      signal(sig, SIG_DFL);
      raise(sig);
    };
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, nullptr);
  });
  // Transformer-XL / XLNet relative attention (csrc/bindings/rel_attention_cpu.cpp): the
  // `cpu` backend of ctxfast.rel_attention; window 0 = none; the four segment tensors all
  // given or none. The backward returns dq, dk, dv, dr, d_r_w_bias, d_r_r_bias,
  // d_seg_embed, d_r_s_bias (the last two empty without segments).
  m.def("rel_attention_fwd_cpu(Tensor q, Tensor k, Tensor v, Tensor r, Tensor r_w_bias, "
        "Tensor r_r_bias, Tensor? key_padding_mask, Tensor? perm_rank, Tensor? seg_q, "
        "Tensor? seg_k, Tensor? seg_embed, Tensor? r_s_bias, bool causal, SymInt pos_start, "
        "SymInt window, bool perm_strict, float scale, float dropout_p, Tensor? seed) "
        "-> (Tensor, Tensor)");
  m.def("rel_attention_bwd_cpu(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor r, "
        "Tensor r_w_bias, Tensor r_r_bias, Tensor out, Tensor lse, Tensor? key_padding_mask, "
        "Tensor? perm_rank, Tensor? seg_q, Tensor? seg_k, Tensor? seg_embed, "
        "Tensor? r_s_bias, bool causal, SymInt pos_start, SymInt window, bool perm_strict, "
        "float scale, float dropout_p, Tensor? seed) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // rel_attention_fwd_cpu with its gradient as a C++ autograd Function (the eager path
  // where an input requires grad; csrc/bindings/rel_attention_cpu.cpp). Autograd kernel
  // only: not for torch.compile, which takes rel_attention_fwd_cpu and its formula.
  m.def("rel_attention_cpu_grad(Tensor q, Tensor k, Tensor v, Tensor r, Tensor r_w_bias, "
        "Tensor r_r_bias, Tensor? key_padding_mask, Tensor? perm_rank, Tensor? seg_q, "
        "Tensor? seg_k, Tensor? seg_embed, Tensor? r_s_bias, bool causal, SymInt pos_start, "
        "SymInt window, bool perm_strict, float scale, float dropout_p, Tensor? seed) "
        "-> (Tensor, Tensor)");
}
