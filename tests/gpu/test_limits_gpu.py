"""Limits a GPU has and the interpreter does not (tests/test_gpu_limits.py tests the same
code paths on CPU with a lowered chunk size): a call with more (batch, head) pairs than a
CUDA grid holds along y (65535) runs, in chunks, and equals, bit for bit, the same call
made on slices of the batch small enough for one launch each (no dropout: every pair's
result depends on its own rows only). Before the chunks it failed with CUDA's "invalid
argument". Skipped without CUDA."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import ctxfast  # noqa: E402

B, H, T, D = 4100, 16, 8, 16            # B * H = 65,600 > 65,535
SLICES = [slice(0, 2048), slice(2048, 4100)]


def _grads(fn, ins):
    ins = [t.detach().requires_grad_() for t in ins]
    out = fn(*ins)
    return [out, *torch.autograd.grad(out, ins, torch.ones_like(out))]


def _check(fn, batched, shared=()):
    """fn(*batched, *shared) on the whole batch against the same on SLICES (batched inputs
    cut along dim 0; shared ones whole; their gradients summed over the slices)."""
    whole = _grads(fn, [*batched, *shared])
    parts = [_grads(fn, [*(t[s] for t in batched), *shared]) for s in SLICES]
    n = 1 + len(batched)
    for i in range(n):                          # out and the batched inputs' gradients
        assert torch.equal(whole[i], torch.cat([p[i] for p in parts])), i
    for i in range(n, len(whole)):              # shared inputs: sums over the slices
        torch.testing.assert_close(whole[i], sum(p[i] for p in parts), rtol=1e-2,
                                   atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_attention_past_the_grid_limit(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=g).to(dtype)
               for _ in range(3))
    _check(lambda q, k, v: ctxfast.attention(q, k, v, causal=True, backend="triton"),
           [q, k, v])


def test_rel_attention_past_the_grid_limit():
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=g).bfloat16()
               for _ in range(3))
    r = torch.randn(H, T, D, device="cuda", generator=g).bfloat16()
    u, w = (torch.randn(H, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    _check(lambda q, k, v, r, u, w: ctxfast.rel_attention(q, k, v, r, u, w, causal=True,
                                                          backend="triton"),
           [q, k, v], [r, u, w])
