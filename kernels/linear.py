"""float32 products with one TF32 product per MMA, for the LSTM's input projection where
``nn.LSTM`` (cuDNN) would run it so.

Why a kernel: cuDNN's RNNs take TF32 for every float32 GEMM while torch allows TF32 for
them (``torch.backends.cudnn.allow_tf32`` / ``cudnn.rnn.fp32_precision``, allowed by
default), but cuBLAS, which ``F.linear`` calls, has its own setting, off by default
(``torch.backends.cuda.matmul.allow_tf32`` / ``matmul.fp32_precision``). A drop-in LSTM
that runs its input projection ``x @ w_ihᵀ`` and its two gradients as exact float32 GEMMs
does three times the work at a fraction of the tensor cores' rate: at ULMFiT's layer size
(T·B 4,480 rows, 4H 4,608, I 1,152) each is 47.6 GFLOP, about 1 ms on the CUDA cores of an
H200 (round 5: the CUDA LSTM's float32 forward took 6.04 ms where its recurrence kernel's
own clock read 5.07 ms; the difference is mostly this GEMM, an inference). The setting is process-global and flipping it around a call would change other
threads' products; this kernel takes the precision per call instead.

    c [M, N] = a [M, K] @ b [K, N] (+ bias [N])        any strides, float32 in and out

Tiles: BLOCK_M x BLOCK_N outputs per program, a K loop of BLOCK_K steps (pipelined), the
programs ordered in groups of GROUP_M row blocks so that a group's programs share their
``b`` tiles in L2 (the Triton matmul tutorial's ordering). Not yet timed on a GPU.
"""
import torch
import triton
import triton.language as tl

from ._common import _interpreting
from ._launch import fast


@triton.jit
def _linear_kernel(
    a_ptr,       # [M, K] float32 (strides sam, sak)
    b_ptr,       # [K, N] float32 (strides sbk, sbn)
    bias_ptr,    # [N] float32 (read only if HAS_BIAS)
    c_ptr,       # [M, N] float32 out (strides scm, scn)
    M, N, K,
    sam, sak, sbk, sbn, scm, scn,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_in = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * sam + offs_k[None, :] * sak,
                    mask=m_in[:, None] & k_in[None, :], other=0.0)        # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptr + offs_k[:, None] * sbk + offs_n[None, :] * sbn,
                    mask=k_in[:, None] & n_in[None, :], other=0.0)        # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0)[None, :]
    tl.store(c_ptr + offs_m[:, None] * scm + offs_n[None, :] * scn, acc,
             mask=m_in[:, None] & n_in[None, :])


def _config() -> dict:
    """Tiles and warps: the interpreter's small blocks, else 128 x 128 x 32 with 8 warps and
    3 stages (two 16 KB float32 operand tiles a stage; every dot a wgmma on sm_90). A first
    choice from the tutorials' Hopper rows, not tuned."""
    if _interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)


def tf32_matmul(a: torch.Tensor, b: torch.Tensor, bias=None) -> torch.Tensor:
    """``a [M, K] @ b [K, N] (+ bias [N])`` in float32 with TF32 products (exact float32
    products under the interpreter): a new contiguous ``[M, N]``. Any strides (transposed
    views are read as they are)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"tf32_matmul: a must be [M, K] and b [K, N], got a {list(a.shape)} "
                         f"and b {list(b.shape)}")
    for name, t in (("a", a), ("b", b), ("bias", bias)):
        if t is not None and (t.dtype != torch.float32 or t.device != a.device):
            raise TypeError(f"tf32_matmul: {name} must be float32 on {a.device}, got "
                            f"{t.dtype} on {t.device}")
    if bias is not None and tuple(bias.shape) != (b.shape[1],):
        raise ValueError(f"tf32_matmul: bias must have shape [N] = [{b.shape[1]}], got "
                         f"{list(bias.shape)}")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=torch.float32, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_() if bias is None else c.copy_(bias.expand(M, N))
    cfg = _config()
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    fast(_linear_kernel)[grid](
        a, b, bias if bias is not None else c, c, M, N, K, a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, PRECISION="tf32", **cfg)
    return c


def linear_forward(x2: torch.Tensor, w: torch.Tensor, b=None) -> torch.Tensor:
    """``x2 [M, I] @ w [N, I]ᵀ + b [N]`` -> ``[M, N]`` (TF32 products)."""
    return tf32_matmul(x2, w.t(), b)
