"""Every op's forward + backward captured in a CUDA graph replays to the values of an
uncaptured call on the same inputs: what ``torch.compile(mode="reduce-overhead")`` and a
training loop's own ``torch.cuda.graph`` capture do with our ops. Capture needs every
launch on the current stream, no host synchronisation and no allocation outside the
graph's pool; the LSTM's persistent kernels are cooperative launches, which capture only
on a CUDA runtime that supports them in graphs. Inputs are static tensors refilled with
new values after the capture, so a replay that read stale copies (or a kernel argument
baked in at capture) disagrees. Skipped without CUDA."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import ctxfast  # noqa: E402


def _randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def _cases():
    """name -> (op(*leaves) -> output, leaves, dtype)."""
    B, H, T, D = 2, 4, 77, 64
    bf16 = torch.bfloat16
    q, k, v = (_randn(B, H, T, D, dtype=bf16) for _ in range(3))
    attn = (lambda q, k, v: ctxfast.attention(q, k, v, causal=True, backend="triton"),
            [q, k, v], bf16)
    mem = 40
    rq = _randn(B, H, T, D, dtype=bf16)
    rk, rv = (_randn(B, H, T + mem, D, dtype=bf16) for _ in range(2))
    r = _randn(H, T + mem, D, dtype=bf16)
    u, w = (_randn(H, D, dtype=bf16) for _ in range(2))
    rel = (lambda *a: ctxfast.rel_attention(*a, backend="triton"), [rq, rk, rv, r, u, w], bf16)
    Tl, Bl, I, Hl = 9, 5, 24, 48
    mask = (torch.rand(4 * Hl, Hl, device="cuda") > 0.3).float()
    lstm_in = [_randn(Tl, Bl, I), _randn(4 * Hl, I, scale=I ** -0.5),
               _randn(4 * Hl, Hl, scale=Hl ** -0.5), _randn(4 * Hl), _randn(4 * Hl)]
    lstm = (lambda x, w_ih, w_hh, b_ih, b_hh: ctxfast.lstm(
        x, None, w_ih, w_hh, b_ih, b_hh, weight_mask=mask, weight_dropout=0.3,
        cell_clip=3.0)[0], lstm_in, torch.float32)            # the default route on CUDA
    lin = (lambda x, w, b: ctxfast.linear(x, w, b, backend="triton"),
           [_randn(300, 96), _randn(500, 96, scale=96 ** -0.5), _randn(500)], torch.float32)
    return {"attention": attn, "rel_attention": rel, "lstm": lstm, "linear": lin}


CASES = ["attention", "rel_attention", "lstm", "linear"]


@pytest.mark.parametrize("name", CASES)
def test_forward_and_backward_replay_in_a_cuda_graph(name):
    op, leaves, dtype = _cases()[name]
    leaves = [t.requires_grad_() for t in leaves]
    with torch.no_grad():
        g = torch.randn_like(op(*leaves))

    def step():
        out = op(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, g)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # compiles, caches, parameter tensors
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():                         # new values in the same tensors
        for t in [*leaves, g]:
            t.copy_(torch.randn_like(t.float()).to(t.dtype) * t.float().std().to(t.dtype))
    want = step()
    graph.replay()
    torch.cuda.synchronize()
    for i, (got, ref) in enumerate(zip(captured, want)):
        err = ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
        # the same kernels on the same inputs: equal but for atomic sums (rel_attention's
        # 16-bit dr) and a tuner's choice, within the dtype's last bits
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert err.item() <= tol, (name, i, err.item())
