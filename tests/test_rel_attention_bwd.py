"""The backward of ctxfast.rel_attention (Triton): dr from its own kernel (a program per
block of r rows walking down the score matrix's diagonals, no atomics) against the float64
reference, and the whole backward deterministic (two runs, bitwise-equal gradients)."""
import inspect

import pytest
import torch

import ctxfast
from test_attention import DEVICE, needs_triton
from test_rel_attention import _inputs, check


@needs_triton
@pytest.mark.parametrize("B, H, Tq, mem, R, pos_start, window, causal", [
    (3, 3, 19, 14, 38, None, None, True),   # odd lengths, R = Tk + 5 (not a block multiple)
    (2, 3, 21, 0, 23, 22, 7, True),         # no memory, a window, R past the keys
    (3, 2, 7, 33, 45, 41, 19, True),        # long memory, pos_start inside a longer r
    (2, 2, 17, 17, 54, 35, None, False),    # both directions, spare rows at both ends
])
def test_dr_against_float64(B, H, Tq, mem, R, pos_start, window, causal):
    """Every gradient (dr among them) within 2x eager's error against float64."""
    check(B, H, Tq, Tq + mem, 16, R=R, pos_start=pos_start, window=window, causal=causal)


@needs_triton
def test_dr_bidirectional_with_every_mask():
    """XLNet's form (not causal, R = Tk + Tq, pos_start = Tk): padding, permutation,
    segments and a window; dr of diagonals on both sides of the main one."""
    B, Tq, Tk = 2, 13, 29
    kpm = torch.rand(B, Tk, device=DEVICE) < 0.2
    rank = torch.stack([torch.randperm(Tq) for _ in range(B)]).to(DEVICE)
    check(B, 3, Tq, Tk, 16, R=Tk + Tq, seg=True, causal=False, pos_start=Tk, window=9,
          key_padding_mask=kpm, perm_rank=rank)


@needs_triton
@pytest.mark.parametrize("causal, window", [(False, 35), (False, 51), (True, 52)])
def test_interior_tiles_at_the_window_edge(causal, window):
    """Tiles that every pair of sees skip the mask work (kernels/rel_attention.py:
    _interior_keys, _interior_queries). Long windows over several blocks, both directions,
    with windows that put the edge of the interior exactly on a block boundary (the CPU
    tests run 16-row blocks): forward and every gradient against float64."""
    Tq, mem = 64, 20
    kw = dict(causal=False, R=2 * Tq + mem, pos_start=Tq + mem) if not causal else {}
    check(1, 2, Tq, Tq + mem, 16, window=window, **kw)


@needs_triton
def test_backward_is_bitwise_deterministic():
    """Two backward runs on the same inputs (dropout with the same seed, segments, padding,
    window): every gradient bitwise equal."""
    B, H, Tq, Tk, D = 3, 2, 13, 30, 16
    ts = _inputs(B, H, Tq, Tk, D, Tk + 3, seg=True)
    kpm = torch.zeros(B, Tk, dtype=torch.bool, device=DEVICE)
    kpm[1, 26:] = True
    kw = dict(seg_q=torch.randint(0, 2, (B, Tq), device=DEVICE),
              seg_k=torch.randint(0, 2, (B, Tk), device=DEVICE), key_padding_mask=kpm,
              window=11, dropout_p=0.2, backend="triton")
    do = torch.randn(B, H, Tq, D, device=DEVICE)

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in ts]
        out = ctxfast.rel_attention(*leaves[:6], seg_embed=leaves[6], r_s_bias=leaves[7],
                                    generator=torch.Generator(DEVICE).manual_seed(3), **kw)
        return torch.autograd.grad(out, leaves, do)

    first, second = grads(), grads()
    for a, b in zip(first, second):
        assert a.abs().sum() > 0
        assert torch.equal(a, b)


def test_no_atomics_in_the_kernels():
    """The interpreter's atomics are sequential: the bitwise test above cannot catch a GPU
    race, so check the kernels do not use any."""
    pytest.importorskip("triton")
    from ctxfast.kernels import rel_attention
    src = inspect.getsource(rel_attention)
    assert "atomic_" not in src
