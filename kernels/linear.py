"""float32 GEMMs on the tensor cores: one TF32 product per MMA, or three (``tf32x3``, about
float32's accuracy). Two users:

* the LSTM's input projection and weight gradients where ``nn.LSTM`` (cuDNN) would run them
  with TF32: cuDNN's RNNs take TF32 for every float32 GEMM while torch allows TF32 for them
  (``torch.backends.cudnn.allow_tf32`` / ``cudnn.rnn.fp32_precision``, allowed by default),
  but cuBLAS, which ``F.linear`` calls, has its own setting, off by default
  (``torch.backends.cuda.matmul.allow_tf32`` / ``matmul.fp32_precision``). At ULMFiT's
  layer size (T·B 4,480 rows, 4H 4,608, I 1,152) each GEMM is 47.6 GFLOP, about 1 ms on the
  CUDA cores of an H200 (round 5: the CUDA LSTM's float32 forward took 6.04 ms where its
  recurrence kernel's own clock read 5.07 ms; the difference is mostly this GEMM, an
  inference);
* ``ctxfast.linear`` (a language model's decoder), whose float32 products must keep
  float32's accuracy where torch does not allow TF32: ``tf32x3`` splits each operand into
  a TF32 head and the TF32 rounding of its remainder, and sums head·head, head·tail and
  tail·head on the tensor cores (the product lost is tail·tail, ~2^-22 of the product;
  H100 SXM datasheet, dense: 495 TFLOP/s TF32 against 67 TFLOP/s float32 FMA, so three
  products have ~2.5x float32's peak; not measured).

The setting is process-global and flipping it around a call would change other threads'
products; this kernel takes the precision per call instead.

    c [M, N] = a [M, K] @ b [K, N] (+ bias [N])        any strides, one float dtype

16-bit and float64 operands run too (``ctxfast.linear``'s triton backend takes every float
dtype): 16-bit products on the tensor cores with float32 accumulation, float64 exact.

Tiles: BLOCK_M x BLOCK_N outputs per program, a K loop of BLOCK_K steps (pipelined), the
programs ordered in groups of GROUP_M row blocks so that a group's programs share their
``b`` tiles in L2 (the Triton matmul tutorial's ordering). Not yet timed on a GPU
(``benchmarks/linear_compare.py`` times it against cuBLAS).
"""
import torch
import triton
import triton.language as tl

from ._common import _interpreting
from ._launch import fast


@triton.jit
def _linear_kernel(
    a_ptr,       # [M, K] (strides sam, sak), any float dtype
    b_ptr,       # [K, N] (strides sbk, sbn), a's dtype
    bias_ptr,    # [N], a's dtype (read only if HAS_BIAS)
    c_ptr,       # [M, N] out, a's dtype (strides scm, scn)
    M, N, K,
    sam, sak, sbk, sbn, scm, scn,
    zero,        # 0.0 (PROMOTE's fresh accumulator, a value the compiler cannot fold)
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,   # float32 operands: "tf32" or "tf32x3"; fp64 "ieee"
    ACC: tl.constexpr,         # accumulator: tl.float64 for fp64, else tl.float32
    UPCAST: tl.constexpr,      # 16-bit operands to float32 before the dot (interpreter)
    PROMOTE: tl.constexpr,     # sum each K step apart, then into acc on the CUDA cores
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)                     # row blocks of this group
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_in = offs_m < M
    n_in = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_in = offs_k < K
        offs_k = offs_k.to(tl.int64)           # x a stride: past 2^31 at 16k rows x 131k
        a = tl.load(a_ptr + offs_m[:, None] * sam + offs_k[None, :] * sak,
                    mask=m_in[:, None] & k_in[None, :], other=0.0)        # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptr + offs_k[:, None] * sbk + offs_n[None, :] * sbn,
                    mask=k_in[:, None] & n_in[None, :], other=0.0)        # [BLOCK_K, BLOCK_N]
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if PROMOTE:     # this step's products in their own MMA sum, added here (RN);
            # a zero the compiler cannot see (the argument `zero`) keeps it from folding the
            # add back into the dot's accumulator (dot(a, b, 0) + acc -> dot(a, b, acc))
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC) + zero
            acc += tl.dot(a, b, part, input_precision=PRECISION, out_dtype=ACC)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(ACC)[None, :]
    tl.store(c_ptr + offs_m[:, None] * scm + offs_n[None, :] * scn,
             acc.to(c_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


#: The products a call may ask for (``tl.dot``'s ``input_precision``; the interpreter computes
#: float32 dots exactly whatever the string).
PRECISIONS = ("tf32", "tf32x3")

#: float32: sum each K step's products in an MMA accumulator of their own and add it to the
#: running sum on the CUDA cores (one rounding to nearest a step), instead of accumulating
#: every step in the MMAs. Tensor cores align and normalise their sums with truncation
#: (studies of V100 / A100 tensor cores: products exact, the adder truncates), a bias that
#: grows with K; the decoder's gradient GEMMs sum 4,480 and 60,000 terms. Off by default:
#: ``benchmarks/linear_compare.py`` ("triton tf32x3 promote") measures both the error and
#: the cost on a GPU. The interpreter computes the same sums either way.
PROMOTE: bool = False

#: Keys of :func:`_config`'s dict that replace its choice (``benchmarks/linear_compare.py``'s
#: sweep on a GPU), e.g. ``{"BLOCK_K": 16, "num_stages": 4}``. None: the table.
CONFIG_OVERRIDE = None

_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _config(dtype: torch.dtype = torch.float32) -> dict:
    """Tiles and warps: the interpreter's small blocks; else 128 x 128 x 32 with 8 warps and
    3 stages (float32: two 16 KB operand tiles a stage; every dot a wgmma on sm_90; tf32:
    161 registers, tf32x3: 255, 16-bit: 238, none spills, Triton 3.9; 16-bit at BLOCK_K 64
    spilled 4 B), float64 64 x 64 x 16 with 4 warps (186 registers, mma.sync: DMMA). First
    choices from the tutorials' Hopper rows, not tuned; :data:`CONFIG_OVERRIDE` replaces any
    of it."""
    if _interpreting():
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1)
    elif dtype == torch.float64:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, GROUP_M=8, num_warps=4, num_stages=3)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8,
                   num_stages=3)
    if CONFIG_OVERRIDE:
        bad = sorted(set(CONFIG_OVERRIDE) - set(_CONFIG_KEYS))
        if bad:
            raise ValueError(f"kernels.linear.CONFIG_OVERRIDE: unknown keys {bad}; expected "
                             f"some of {list(_CONFIG_KEYS)}")
        cfg.update(CONFIG_OVERRIDE)
    return cfg


def matmul(a: torch.Tensor, b: torch.Tensor, bias=None, *,
           precision: str = "tf32") -> torch.Tensor:
    """``a [M, K] @ b [K, N] (+ bias [N])`` -> a new contiguous ``[M, N]`` in a's dtype (any
    float dtype; float32 accumulation, float64's in float64). float32 operands take
    ``precision``'s products (one of :data:`PRECISIONS`; exact under the interpreter);
    others ignore it. Any strides (transposed views are read as they are)."""
    if precision not in PRECISIONS:
        raise ValueError(f"matmul: precision must be one of {PRECISIONS}, got {precision!r}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: a must be [M, K] and b [K, N], got a {list(a.shape)} "
                         f"and b {list(b.shape)}")
    if a.dtype not in _DTYPES:
        raise TypeError(f"matmul: a must be float16, bfloat16, float32 or float64, got "
                        f"{a.dtype}")
    for name, t in (("b", b), ("bias", bias)):
        if t is not None and (t.dtype != a.dtype or t.device != a.device):
            raise TypeError(f"matmul: {name} must be {a.dtype} on {a.device} (a's), got "
                            f"{t.dtype} on {t.device}")
    if bias is not None and tuple(bias.shape) != (b.shape[1],):
        raise ValueError(f"matmul: bias must have shape [N] = [{b.shape[1]}], got "
                         f"{list(bias.shape)}")
    M, K = a.shape
    N = b.shape[1]
    if bias is not None:
        bias = bias.contiguous()             # the kernel reads it with unit stride
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_() if bias is None else c.copy_(bias.expand(M, N))
    f64, half = a.dtype == torch.float64, a.dtype.itemsize == 2
    cfg = _config(a.dtype)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    fast(_linear_kernel)[grid](
        a, b, bias if bias is not None else c, c, M, N, K, a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), c.stride(0), c.stride(1), 0.0,
        HAS_BIAS=bias is not None, PRECISION="ieee" if f64 else precision,
        ACC=tl.float64 if f64 else tl.float32, UPCAST=half and _interpreting(),
        PROMOTE=PROMOTE and a.dtype == torch.float32, **cfg)
    return c


def linear_forward(x2: torch.Tensor, w: torch.Tensor, b=None, *,
                   precision: str = "tf32") -> torch.Tensor:
    """``x2 [M, I] @ w [N, I]ᵀ + b [N]`` -> ``[M, N]`` (``precision``'s products)."""
    return matmul(x2, w.t(), b, precision=precision)
