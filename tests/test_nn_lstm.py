"""ctxfast.nn.WeightDropLSTM against torch.nn.LSTM (same weights), against a hand-written
AllenNLP LstmCellWithProjection step (ELMo: projection, clipped cell, clipped projection),
its DropConnect masks, and the AWD-LSTM checkpoint loader.

Every backend of ``ctxfast.lstm`` that runs on CPU tensors here is exercised (the op's
registered backends that ``tests/utils.py`` CPU_BACKENDS can run); the rest of the file
uses the default backend. Tolerances: tests/utils.py REL_TOL of the dtype.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import ctxfast
from ctxfast import _dispatch
from ctxfast.nn import WeightDropLSTM, load_awd_lstm
from utils import CPU_BACKENDS, REL_TOL, assert_close, assert_within_2x_eager

LSTM_BACKENDS = [b for b in CPU_BACKENDS if b in _dispatch.registered_ops()["lstm"]]
# The Triton interpreter takes seconds per LSTM: "triton" runs a subset of the cases (one
# per feature: stacking + bidirectional + projection + batch_first + hx, masks, clips).
SLOW = {"triton"}

# nn.LSTM configurations: 1 and 3 layers, bidirectional, projection, batch_first, no bias.
CONFIGS = {
    "L1": dict(input_size=5, hidden_size=6),
    "L3-bi-proj": dict(input_size=5, hidden_size=6, num_layers=3, bidirectional=True,
                       proj_size=4),
    "L3-batch_first-nobias": dict(input_size=3, hidden_size=7, num_layers=3, batch_first=True,
                                  bias=False),
    "L2-bi-batch_first-proj": dict(input_size=4, hidden_size=5, num_layers=2,
                                   bidirectional=True, batch_first=True, proj_size=3),
}
T, B = 4, 3


def _cases(full, slow):
    """pytest params (*case, backend): every case of `full` on the fast backends, the
    cases of `slow` on the slow ones."""
    return [pytest.param(*c, b, id="-".join(map(str, (*c, b))))
            for b in LSTM_BACKENDS for c in (slow if b in SLOW else full)]


def _pair(cfg, dtype=torch.float64, backend=None, **extra):
    """(ours, nn.LSTM) with the same weights (nn.LSTM's state_dict loaded into ours)."""
    ref = torch.nn.LSTM(**cfg, dtype=dtype)
    ours = WeightDropLSTM(**cfg, backend=backend, dtype=dtype, **extra)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


def _sizes(cfg):
    D = 2 if cfg.get("bidirectional") else 1
    H = cfg["hidden_size"]
    P = cfg.get("proj_size") or H
    return D, H, P


def _inputs(cfg, dtype, given_hx, unbatched=False):
    """x (non-contiguous: every other feature of a wider tensor) and hx, all leaves."""
    D, H, P = _sizes(cfg)
    LD = cfg.get("num_layers", 1) * D
    I = cfg["input_size"]
    if unbatched:
        shape, hs, cs = (T, 2 * I), (LD, P), (LD, H)
    else:
        shape = (B, T, 2 * I) if cfg.get("batch_first") else (T, B, 2 * I)
        hs, cs = (LD, B, P), (LD, B, H)
    x = torch.randn(shape, dtype=dtype)[..., ::2].requires_grad_(True)
    hx = None
    if given_hx:
        hx = (torch.randn(hs, dtype=dtype, requires_grad=True),
              torch.randn(cs, dtype=dtype, requires_grad=True))
    return x, hx


def _check_same(ours, ref, x, hx, tol=None, weight_masks=None, ref_hh_scale=None):
    """Forward both, backward the same random cotangents; compare out, h_n, c_n and the
    gradients of x, hx and every parameter (by name). ``ref_hh_scale[name]`` is the factor
    ref's weight_hh carries (mask / (1 - p)): ours' gradient is ref's times that factor."""
    out, (h, c) = ours(x, hx, weight_masks=weight_masks)
    out_r, (h_r, c_r) = ref(x, hx)
    for name, a, b in (("out", out, out_r), ("h_n", h, h_r), ("c_n", c, c_r)):
        assert a.dtype == b.dtype, name
        assert_close(a, b, tol, name)
    gs = [torch.randn_like(t) for t in (out, h, c)]
    names = [n for n, _ in ours.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]
    leaves = [x] + ([] if hx is None else list(hx))
    g_ours = torch.autograd.grad((out, h, c), leaves + list(ours.parameters()), gs)
    g_ref = torch.autograd.grad((out_r, h_r, c_r), leaves + list(ref.parameters()), gs)
    labels = ["grad x", "grad h_0", "grad c_0"][:len(leaves)] + [f"grad {n}" for n in names]
    for label, a, b in zip(labels, g_ours, g_ref):
        name = label[5:]
        if ref_hh_scale is not None and name in ref_hh_scale:
            b = b * ref_hh_scale[name]                    # chain rule through W * mask * s
        assert_close(a, b, tol, label)


# --------------------------------------------------------------------------- nn.LSTM parity

@pytest.mark.parametrize("name", list(CONFIGS))
def test_weight_views_are_nn_lstms(name):
    # code written for nn.LSTM reads all_weights / _flat_weights / their names
    ours, ref = _pair(CONFIGS[name])
    assert ours._flat_weights_names == ref._flat_weights_names
    assert ours._all_weights == ref._all_weights
    for a, b in zip(ours._flat_weights + sum(ours.all_weights, []),
                    ref._flat_weights + sum(ref.all_weights, [])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameters_and_init_are_nn_lstms(name):
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    ref = torch.nn.LSTM(**cfg)
    torch.manual_seed(0)
    ours = WeightDropLSTM(**cfg, weight_dropout=0.3)
    got = [(n, tuple(p.shape)) for n, p in ours.named_parameters()]
    assert got == [(n, tuple(p.shape)) for n, p in ref.named_parameters()]
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), f"{n}: nn.LSTM's init under the same seed"
    assert list(ours.state_dict()) == list(ref.state_dict())
    ref.load_state_dict(ours.state_dict())                 # and the other way round


_F32, _F64 = torch.float32, torch.float64


@pytest.mark.parametrize("name, given_hx, dtype, backend", _cases(
    [(n, hx, dt) for n in CONFIGS for hx in (False, True) for dt in (_F64, _F32)],
    [("L2-bi-batch_first-proj", True, _F32)]))
def test_matches_nn_lstm(name, given_hx, dtype, backend):
    cfg = CONFIGS[name]
    ours, ref = _pair(cfg, dtype, backend, weight_dropout=0.5)
    ours.eval()                                            # eval: weight_dropout unused
    ref.eval()
    x, hx = _inputs(cfg, dtype, given_hx)
    _check_same(ours, ref, x, hx)


@pytest.mark.parametrize("name, given_hx, sorted_, backend", _cases(
    [(n, hx, st) for n in CONFIGS for hx, st in ((False, False), (True, False), (True, True))],
    [("L2-bi-batch_first-proj", True, False)]))
def test_packed_sequence_matches_nn_lstm(name, given_hx, sorted_, backend):
    """A PackedSequence (several lengths; sorted or not): the packed output (data, batch
    sizes, indices), h_n, c_n at each sequence's own last step, and every gradient, as
    nn.LSTM's; batch_first does not apply to a packed input."""
    from torch.nn.utils.rnn import pack_padded_sequence
    cfg = CONFIGS[name]
    ours, ref = _pair(cfg, torch.float64, backend)
    D, H, P = _sizes(cfg)
    LD = cfg.get("num_layers", 1) * D
    n = 5
    x = torch.randn(6, n, cfg["input_size"], dtype=torch.float64, requires_grad=True)
    lengths = [6, 5, 3, 3, 1] if sorted_ else [3, 6, 1, 5, 3]
    packed = pack_padded_sequence(x, lengths, enforce_sorted=sorted_)
    hx = None
    if given_hx:
        hx = (torch.randn(LD, n, P, dtype=torch.float64, requires_grad=True),
              torch.randn(LD, n, H, dtype=torch.float64, requires_grad=True))
    out, (h, c) = ours(packed, hx)
    out_r, (h_r, c_r) = ref(packed, hx)
    assert isinstance(out, torch.nn.utils.rnn.PackedSequence)
    assert torch.equal(out.batch_sizes, out_r.batch_sizes)
    for a, b in ((out.sorted_indices, out_r.sorted_indices),
                 (out.unsorted_indices, out_r.unsorted_indices)):
        assert (a is None and b is None) or torch.equal(a, b)
    for label, a, b in (("out", out.data, out_r.data), ("h_n", h, h_r), ("c_n", c, c_r)):
        assert_close(a, b, name=label)
    gs = [torch.randn_like(t) for t in (out.data, h, c)]
    leaves = [x] + ([] if hx is None else list(hx))
    g = torch.autograd.grad((out.data, h, c), leaves + list(ours.parameters()), gs,
                            retain_graph=True)       # (the packing's graph, shared)
    g_r = torch.autograd.grad((out_r.data, h_r, c_r), leaves + list(ref.parameters()), gs)
    names = ["x", "h_0", "c_0"][:len(leaves)] + [n for n, _ in ours.named_parameters()]
    for label, a, b in zip(names, g, g_r):
        assert_close(a, b, name=f"grad {label}")


@pytest.mark.parametrize("given_hx, backend", _cases([(False,), (True,)], []))
def test_unbatched_input_matches_nn_lstm(given_hx, backend):
    cfg = CONFIGS["L2-bi-batch_first-proj"]
    ours, ref = _pair(cfg, torch.float64, backend)
    x, hx = _inputs(cfg, torch.float64, given_hx, unbatched=True)
    assert x.dim() == 2
    _check_same(ours, ref, x, hx)


def test_empty_batch_matches_nn_lstm():
    cfg = CONFIGS["L3-bi-proj"]
    ours, ref = _pair(cfg)
    x = torch.randn(T, 0, cfg["input_size"], dtype=torch.float64)
    out, (h, c) = ours(x)
    out_r, (h_r, c_r) = ref(x)
    assert out.shape == out_r.shape and h.shape == h_r.shape and c.shape == c_r.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_close_to_float64(dtype):
    """Ours in fp16/bf16 against nn.LSTM in float64 on the same (rounded) weights and
    inputs, forward and every gradient: within 2x the error of the eager backend at the
    same dtype, plus the dtype's floor (the ops' rule; a fixed REL_TOL failed bf16 at
    CTXFAST_TEST_SEED=7: one weight gradient 1.26e-2 against 1e-2)."""
    cfg = CONFIGS["L2-bi-batch_first-proj"]
    ours, ref = _pair(cfg, dtype)
    same = WeightDropLSTM(**cfg, backend="eager", dtype=dtype)
    same.load_state_dict(ours.state_dict())
    ref = ref.double()
    x, hx = _inputs(cfg, dtype, True)
    x64 = x.detach().double().requires_grad_(True)
    hx64 = tuple(s.detach().double().requires_grad_(True) for s in hx)
    out_r, (h_r, c_r) = ref(x64, hx64)
    gs = [torch.randn_like(t) for t in (out_r, h_r, c_r)]
    g_r = torch.autograd.grad((out_r, h_r, c_r), [x64, *hx64, *ref.parameters()], gs)
    res = []
    for mod in (ours, same):
        out, (h, c) = mod(x, hx)
        assert out.dtype == dtype
        g = torch.autograd.grad((out, h, c), [x, *hx, *mod.parameters()],
                                [t.to(dtype) for t in gs])
        res.append((out, h, c) + g)
    floor = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for k, (a, e, b) in enumerate(zip(*res, (out_r, h_r, c_r) + g_r)):
        assert a.dtype == dtype, k
        assert_within_2x_eager(a, e, b, floor, name=f"output/gradient {k}")


def test_autocast_runs_in_the_autocast_dtype():
    cfg = CONFIGS["L1"]
    ours, ref = _pair(cfg, torch.float32)
    x = torch.randn(T, B, cfg["input_size"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, (h, c) = ours(x)
    assert out.dtype == h.dtype == c.dtype == torch.bfloat16
    assert_close(out.float(), ref(x)[0], REL_TOL[torch.bfloat16], "out under autocast")


def test_autocast_takes_a_state_of_another_float_dtype():
    # nn.LSTM under autocast takes an fp32 input with the bf16 state it returned (both cast
    # to the autocast dtype): the drop-in must too (it refused the state's dtype); outside
    # autocast a mismatch is still refused by name
    cfg = CONFIGS["L1"]
    ours, ref = _pair(cfg, torch.float32)
    x = torch.randn(T, B, cfg["input_size"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, hx = ours(x)
        _, hx_ref = ref(x)
        assert hx[0].dtype == torch.bfloat16
        out, _ = ours(x, hx)
        out_ref, _ = ref(x, hx_ref)
    assert_close(out.float(), out_ref.float(), REL_TOL[torch.bfloat16], "out with a bf16 state")
    with pytest.raises(TypeError, match=r"hx\[0\] \(h_0\) must match the input's dtype"):
        ours(x, hx)


def test_autocast_leaves_a_float64_module_in_float64():
    # autocast casts float32 only: nn.LSTM in float64 runs in float64 under it, so must ours
    cfg = CONFIGS["L1"]
    ours, ref = _pair(cfg, torch.float64)
    x, hx = _inputs(cfg, torch.float64, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, (h, c) = ours(x, hx)
        out_r, (h_r, c_r) = ref(x, hx)
    for name, a, b in (("out", out, out_r), ("h_n", h, h_r), ("c_n", c, c_r)):
        assert a.dtype == torch.float64, f"{name}: {a.dtype} under autocast"
        assert_close(a, b, None, f"{name} under autocast")


def test_inter_layer_dropout_is_nn_lstms():
    """``dropout`` acts on every layer's output but the last, as nn.LSTM's: on CPU the same
    seed gives nn.LSTM's very masks (same shapes, same order, at::dropout both)."""
    cfg = dict(CONFIGS["L3-bi-proj"], dropout=0.4)
    ours, ref = _pair(cfg)
    x, hx = _inputs(cfg, torch.float64, True)
    torch.manual_seed(5)
    out, (h, c) = ours(x, hx)
    torch.manual_seed(5)
    out_r, (h_r, c_r) = ref(x, hx)
    for name, a, b in (("out", out, out_r), ("h_n", h, h_r), ("c_n", c, c_r)):
        assert_close(a, b, None, name)
    ours.eval()
    ref.eval()
    assert_close(ours(x, hx)[0], ref(x, hx)[0], None, "eval: no dropout")
    assert not torch.allclose(ours(x, hx)[0], out), "training and eval differ"


# --------------------------------------------------------------------------- DropConnect

def _dropped_reference(ref, masks, p):
    """nn.LSTM whose weight_hh_* are multiplied by mask / (1 - p), and those factors."""
    scales = {n: m.to(ref.weight_hh_l0.dtype) / (1 - p) for n, m in masks.items()}
    with torch.no_grad():
        for n, s in scales.items():
            getattr(ref, n).mul_(s)
    return scales


@pytest.mark.parametrize("name, backend", _cases(
    [("L1",), ("L3-bi-proj",), ("L2-bi-batch_first-proj",)], [("L1",)]))
def test_given_masks_equal_nn_lstm_with_dropped_weights(name, backend):
    # p = 0.5: scale 2 is exact in every float format (Triton passes the scale as an fp32
    # scalar, which would put a 1e-8 error into the float64 comparison for other p)
    cfg, p = CONFIGS[name], 0.5
    ours, ref = _pair(cfg, torch.float64, backend, weight_dropout=p)
    ours.train()
    masks = {n: torch.rand(getattr(ours, n).shape) >= p for n in ours.weight_hh_names()}
    masks[ours.weight_hh_names()[0]] = masks[ours.weight_hh_names()[0]].double()  # float works too
    scales = _dropped_reference(ref, masks, p)
    x, hx = _inputs(cfg, torch.float64, True)
    _check_same(ours, ref, x, hx, weight_masks=masks, ref_hh_scale=scales)


@pytest.mark.parametrize("backend", [b for b in LSTM_BACKENDS if b not in SLOW])
def test_sampled_mask_is_one_mask_for_all_time_steps(backend):
    """Re-create the masks forward sampled (same seed: forward samples them first, in
    weight_hh_names order, like sample_weight_masks) and compare against nn.LSTM with
    those masks baked in: equal over all 12 steps only if each layer/direction used one
    mask at every step. A second forward draws new masks."""
    cfg, p = CONFIGS["L3-bi-proj"], 0.5
    ours, ref = _pair(cfg, torch.float64, backend, weight_dropout=p)
    x = torch.randn(12, B, cfg["input_size"], dtype=torch.float64)
    torch.manual_seed(11)
    out, (h, c) = ours(x)
    torch.manual_seed(11)
    masks = ours.sample_weight_masks()
    assert list(masks) == ours.weight_hh_names()
    _dropped_reference(ref, masks, p)
    out_r, (h_r, c_r) = ref(x)
    for name, a, b in (("out", out, out_r), ("h_n", h, h_r), ("c_n", c, c_r)):
        assert_close(a, b, None, name)
    out2, _ = ours(x)                                      # new forward, new masks
    assert (out2 - out).abs().max() > 1e-3


@pytest.mark.parametrize("backend", [b for b in LSTM_BACKENDS if b not in SLOW])
def test_weight_dropout_names_drop_those_weights_only(backend):
    """weight_dropout_names=("weight_hh_l0",) in a bidirectional layer (fastai's
    WeightDropout): the forward weight dropped and scaled, the reverse one run as it is
    (the module dropped and scaled both, with no way to leave one alone); masks given or
    sampled for those names only; unknown names refused by name."""
    cfg, p = CONFIGS["L3-bi-proj"], 0.5
    ours, ref = _pair(cfg, torch.float64, backend, weight_dropout=p,
                      weight_dropout_names=("weight_hh_l0",))
    assert ours.weight_dropout_names == ("weight_hh_l0",)
    assert "weight_dropout_names=('weight_hh_l0',)" in repr(ours)
    x = torch.randn(6, B, cfg["input_size"], dtype=torch.float64)
    torch.manual_seed(11)
    out, _ = ours(x)
    torch.manual_seed(11)
    masks = ours.sample_weight_masks()
    assert list(masks) == ["weight_hh_l0"]
    _dropped_reference(ref, masks, p)
    assert_close(out, ref(x)[0], None, "out, the forward weight alone dropped")
    assert_close(ours(x, weight_masks=masks)[0], out, None, "the same masks given")
    with pytest.raises(ValueError, match=r"unknown \['weight_hh_l0_reverse'\]"):
        ours(x, weight_masks={**masks, "weight_hh_l0_reverse": masks["weight_hh_l0"]})
    with pytest.raises(ValueError, match=r"weight_dropout_names must be among .* "
                                         r"unknown \['weight_hh_l9'\]"):
        WeightDropLSTM(4, 8, weight_dropout=0.1, weight_dropout_names=["weight_hh_l9"])
    with pytest.raises(ValueError, match="weight_dropout_names must be a sequence"):
        WeightDropLSTM(4, 8, weight_dropout=0.1, weight_dropout_names="weight_hh_l0")


def test_weight_dropout_names_in_any_order_are_weight_hh_order():
    """weight_dropout_names given in another order (a set, a reversed list): the module keeps
    them in weight_hh_names order, which is the order masks are drawn in, so under one seed
    the masks are those of the module that drops every weight by default."""
    cfg = dict(input_size=4, hidden_size=5, num_layers=2, bidirectional=True)
    every = WeightDropLSTM(**cfg, weight_dropout=0.3)
    names = every.weight_hh_names()
    backwards = WeightDropLSTM(**cfg, weight_dropout=0.3, weight_dropout_names=names[::-1])
    assert backwards.weight_dropout_names == tuple(names), backwards.weight_dropout_names
    assert "weight_dropout_names" not in repr(backwards), "every name given: the default"
    torch.manual_seed(4)
    want = every.sample_weight_masks()
    torch.manual_seed(4)
    got = backwards.sample_weight_masks()
    assert list(got) == names, list(got)
    for n in names:
        assert torch.equal(got[n], want[n]), f"{n}: drawn out of weight_hh_names order"


def test_dropout_one_is_accepted_as_by_nn_lstm():
    """nn.LSTM takes dropout in [0, 1], 1 included (every layer but the last then reads
    zeros in training): so does the drop-in, with nn.LSTM's result."""
    cfg = dict(input_size=3, hidden_size=4, num_layers=2, dropout=1.0)
    ours, ref = _pair(cfg)
    x, hx = _inputs(cfg, torch.float64, True)
    out, (h, c) = ours(x, hx)
    out_r, (h_r, c_r) = ref(x, hx)
    for name, a, b in (("out", out, out_r), ("h_n", h, h_r), ("c_n", c, c_r)):
        assert_close(a, b, None, f"dropout=1: {name}")


def test_sampled_masks_keep_rate_and_independence():
    p = 0.3
    m = WeightDropLSTM(8, 32, num_layers=2, bidirectional=True, weight_dropout=p)
    masks = m.sample_weight_masks()
    assert list(masks) == ["weight_hh_l0", "weight_hh_l0_reverse", "weight_hh_l1",
                           "weight_hh_l1_reverse"]
    flat = []
    for n, mask in masks.items():
        w = getattr(m, n)
        assert mask.shape == w.shape and mask.dtype == w.dtype and not mask.requires_grad
        assert set(mask.unique().tolist()) <= {0.0, 1.0}
        flat.append(mask.flatten())
    allm = torch.cat(flat)
    n = allm.numel()                                       # 4 masks of 128 x 32 = 16384
    sigma = math.sqrt(p * (1 - p) / n)
    # 6 sigma: a false alarm about once in 5e8 runs
    assert abs(allm.mean().item() - (1 - p)) < 6 * sigma, allm.mean().item()
    for a in range(len(flat)):                             # different draws per layer/direction
        for b in range(a):
            assert not torch.equal(flat[a], flat[b])
    g = torch.Generator().manual_seed(3)
    again = m.sample_weight_masks(generator=torch.Generator().manual_seed(3))
    first = m.sample_weight_masks(generator=g)
    assert all(torch.equal(again[k], first[k]) for k in again)


def test_eval_uses_no_mask_and_training_without_dropout_none():
    cfg = CONFIGS["L3-bi-proj"]
    ours, ref = _pair(cfg, torch.float64, weight_dropout=0.6)
    x, hx = _inputs(cfg, torch.float64, True)
    ours.eval()
    masks = {n: torch.zeros(getattr(ours, n).shape, dtype=torch.bool)
             for n in ours.weight_hh_names()}
    state = torch.random.get_rng_state()
    a = ours(x, hx)[0]
    assert torch.equal(state, torch.random.get_rng_state()), "eval must draw no mask"
    assert_close(a, ref(x, hx)[0], None, "eval")
    assert_close(ours(x, hx, weight_masks=masks)[0], ref(x, hx)[0], None, "eval ignores masks")
    ours0 = WeightDropLSTM(**cfg, dtype=torch.float64)     # weight_dropout = 0, training
    ours0.load_state_dict(ref.state_dict())
    ours0.train()
    state = torch.random.get_rng_state()
    assert_close(ours0(x, hx)[0], ref(x, hx)[0], None, "p = 0")
    assert torch.equal(state, torch.random.get_rng_state())


def test_bad_masks_are_refused_in_eval_mode_too():
    """weight_masks are checked in eval mode as in training (they are unused there, but a
    mask of the wrong shape is a bug in the caller's code either way), and an integer mask
    is refused by name (bool or floating point 0/1 only)."""
    cfg = CONFIGS["L1"]
    m = WeightDropLSTM(**cfg, weight_dropout=0.4, dtype=torch.float64)
    x, _ = _inputs(cfg, torch.float64, False)
    good = m.sample_weight_masks()
    wrong_shape = {"weight_hh_l0": torch.ones(3, 3, dtype=torch.float64)}
    integer = {"weight_hh_l0": good["weight_hh_l0"].long()}
    for mode in ("train", "eval"):
        m.train(mode == "train")
        with pytest.raises(ValueError, match=r"weight_masks\['weight_hh_l0'\] must have the "
                                             r"shape"):
            m(x, weight_masks=wrong_shape)
        with pytest.raises(TypeError, match=r"weight_masks\['weight_hh_l0'\] must be bool or "
                                            r"floating point"):
            m(x, weight_masks=integer)
        with pytest.raises(ValueError, match="missing"):
            m(x, weight_masks={})


def test_forward_never_writes_parameters():
    cfg = CONFIGS["L3-bi-proj"]
    m = WeightDropLSTM(**cfg, weight_dropout=0.5, dtype=torch.float64)
    before = {n: (p.detach().clone(), p._version) for n, p in m.named_parameters()}
    x, hx = _inputs(cfg, torch.float64, True)
    out, (h, c) = m(x, hx)
    (out.sum() + h.sum() + c.sum()).backward()
    m.eval()
    m(x, hx)
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n][0]) and p._version == before[n][1], n
        assert p.grad is not None and p.grad.abs().sum() > 0, n


# --------------------------------------------------------------------------- ELMo (AllenNLP)

def _allennlp_step(x_t, h, c, w_in, w_state, b_state, w_proj, cell_clip, proj_clip):
    """One step of AllenNLP's LstmCellWithProjection (its equations, written here): input
    and state linearities, gates i, f, g, o, memory clipped, projected, projection clipped."""
    H = c.shape[1]
    proj_in = x_t @ w_in.t()
    proj_state = h @ w_state.t() + b_state
    gate = lambda k: proj_in[:, k * H:(k + 1) * H] + proj_state[:, k * H:(k + 1) * H]  # noqa
    i, f = torch.sigmoid(gate(0)), torch.sigmoid(gate(1))
    g, o = torch.tanh(gate(2)), torch.sigmoid(gate(3))
    mem = torch.clamp(i * g + f * c, -cell_clip, cell_clip)
    out = torch.clamp((o * torch.tanh(mem)) @ w_proj.t(), -proj_clip, proj_clip)
    return out, mem


def _allennlp_stack(m, x, cell_clip, proj_clip):
    """m's layers and directions run step by step with _allennlp_step (x [T, B, I]):
    forward direction t = 0..T-1, backward (go_forward=False) t = T-1..0; layer k+1 reads
    both directions' outputs, as nn.LSTM stacks them. -> (out, h_n, c_n)."""
    D = 2 if m.bidirectional else 1
    hs, cs, layer_in = [], [], x
    for k in range(m.num_layers):
        outs = []
        for d, sfx in enumerate(["", "_reverse"][:D]):
            w = lambda n: getattr(m, f"{n}_l{k}{sfx}")  # noqa: E731
            h = x.new_zeros(x.shape[1], m.proj_size)
            c = x.new_zeros(x.shape[1], m.hidden_size)
            steps = [None] * x.shape[0]
            for t in (range(x.shape[0]) if d == 0 else range(x.shape[0] - 1, -1, -1)):
                h, c = _allennlp_step(layer_in[t], h, c, w("weight_ih"), w("weight_hh"),
                                      w("bias_ih") + w("bias_hh"), w("weight_hr"),
                                      cell_clip, proj_clip)
                steps[t] = h
            outs.append(torch.stack(steps))
            hs.append(h)
            cs.append(c)
        layer_in = torch.cat(outs, -1)
    return layer_in, torch.stack(hs), torch.stack(cs)


@pytest.mark.parametrize("layers, backend", _cases([(2,)], [(1,)]))
def test_elmo_config_matches_allennlp_cell(layers, backend):
    """proj_size + cell_clip + proj_clip + bidirectional, float64: out, h_n, c_n and every
    gradient; the clips are small enough to act (checked)."""
    I, H, P, cell_clip, proj_clip = 6, 8, 5, 0.6, 0.15
    m = WeightDropLSTM(I, H, layers, bidirectional=True, proj_size=P, cell_clip=cell_clip,
                       proj_clip=proj_clip, backend=backend, dtype=torch.float64)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3)                                      # larger gates: clips bite
    x = torch.randn(7, B, I, dtype=torch.float64, requires_grad=True)
    out, (h, c) = m(x)
    out_r, h_r, c_r = _allennlp_stack(m, x, cell_clip, proj_clip)
    assert (out_r.abs() == proj_clip).float().mean() > 0.05, "projection clip never acts"
    assert (c_r.abs() == cell_clip).float().mean() > 0.05, "cell clip never acts"
    for name, a, b in (("out", out, out_r), ("h_n", h, h_r), ("c_n", c, c_r)):
        assert_close(a, b, None, name)
    gs = [torch.randn_like(t) for t in (out, h, c)]
    leaves = [x, *m.parameters()]
    g = torch.autograd.grad((out, h, c), leaves, gs)
    g_r = torch.autograd.grad((out_r, h_r, c_r), leaves, gs)
    for (name, _), a, b in zip([("x", None)] + list(m.named_parameters()), g, g_r):
        assert_close(a, b, None, f"grad {name}")


# --------------------------------------------------------------------------- AWD-LSTM loader

def _awd_layers(emb=6, hid=10, n=3, bidir=False):
    """AWD-LSTM's layers: emb -> hid -> ... -> emb (per direction: size // n_dir)."""
    D = 2 if bidir else 1
    return [torch.nn.LSTM(emb if k == 0 else hid, (hid if k != n - 1 else emb) // D,
                          bidirectional=bidir, batch_first=True, dtype=torch.float64)
            for k in range(n)]


def _awd_state_dict(layers, layout, prefix):
    """The checkpoint keys of an AWD-LSTM language model (fastai: a SequentialRNN with the
    encoder as module 0) holding `layers`, in `layout`."""
    sd = {f"{prefix}encoder.weight": torch.randn(20, 6), "1.decoder.weight": torch.randn(20, 6),
          f"{prefix}encoder_dp.emb.weight": torch.randn(20, 6)}
    for k, lstm in enumerate(layers):
        base = f"{prefix}rnns.{k}."
        for name, t in lstm.state_dict().items():
            if name == "weight_hh_l0":
                raw = base + ("module.weight_hh_l0_raw" if layout == "salesforce"
                              else "weight_hh_l0_raw")
                sd[raw] = t.clone()
                if layout == "fastai-v1":                  # a dropped copy: must be ignored
                    sd[base + "module.weight_hh_l0"] = F.dropout(t, 0.5)
            else:
                sd[base + "module." + name] = t.clone()
    return sd


@pytest.mark.parametrize("layout, prefix, bidir", [
    ("fastai-v2", "0.", False), ("fastai-v1", "0.", False), ("salesforce", "", False),
    ("fastai-v2", "0.module.", True)])
def test_load_awd_lstm(layout, prefix, bidir):
    layers = _awd_layers(bidir=bidir)
    sd = _awd_state_dict(layers, layout, prefix)
    mods = load_awd_lstm(sd, weight_dropout=0.2)
    assert len(mods) == 3
    batch_first = layout != "salesforce"
    D = 2 if bidir else 1
    x = torch.randn(2, 5, 6, dtype=torch.float64)                       # [B, T, emb]
    for k, (m, ref) in enumerate(zip(mods, layers)):
        assert isinstance(m, WeightDropLSTM) and m.num_layers == 1
        assert (m.input_size, m.hidden_size * D) == ((6, 10, 10)[k], (10, 10, 6)[k])
        assert m.batch_first == batch_first and m.bidirectional == bidir
        assert m.weight_dropout == 0.2 and m.weight_ih_l0.dtype == torch.float64
        assert m.weight_dropout_names == ("weight_hh_l0",)        # fastai's, bidir too
        m.eval()
        out = m(x if batch_first else x.transpose(0, 1))[0]
        out = out if batch_first else out.transpose(0, 1)
        assert_close(out, ref(x)[0], None, f"layer {k}")
        x = out.detach()
    forced = load_awd_lstm(sd, prefix=prefix, batch_first=not batch_first)
    assert all(m.batch_first != batch_first for m in forced)


def test_load_awd_lstm_rejects_what_it_cannot_read():
    layers = _awd_layers()
    with pytest.raises(ValueError, match="no AWD-LSTM layers"):
        load_awd_lstm({"encoder.weight": torch.randn(3, 3)})
    two = {**_awd_state_dict(layers, "fastai-v2", "0."),
           **_awd_state_dict(layers, "fastai-v2", "enc2.")}
    with pytest.raises(ValueError, match="prefix"):
        load_awd_lstm(two)
    assert len(load_awd_lstm(two, prefix="enc2.")) == 3
    bad = _awd_state_dict(layers, "fastai-v2", "")
    del bad["rnns.1.weight_hh_l0_raw"]
    with pytest.raises(ValueError, match="layer 1"):
        load_awd_lstm(bad)
    gap = {k: v for k, v in _awd_state_dict(layers, "fastai-v2", "").items()
           if not k.startswith("rnns.1.")}
    with pytest.raises(ValueError, match="numbered"):
        load_awd_lstm(gap)


# --------------------------------------------------------------------------- bad inputs

def test_bad_inputs_raise_naming_the_argument():
    cfg = CONFIGS["L3-bi-proj"]                            # I 5, H 6, P 4, 3 layers x 2
    m = WeightDropLSTM(**cfg, weight_dropout=0.2)
    x = torch.randn(T, B, 5)
    with pytest.raises(ValueError, match=r"input must have size\(-1\) == input_size = 5"):
        m(torch.randn(T, B, 4))
    with pytest.raises(ValueError, match="input must be 3-D"):
        m(torch.randn(2, T, B, 5))
    with pytest.raises(ValueError, match="at least one time step"):
        m(torch.randn(0, B, 5))
    with pytest.raises(ValueError, match=r"hx\[0\] \(h_0\) must have shape \[6, 3, 4\]"):
        m(x, (torch.randn(6, B, 6), torch.randn(6, B, 6)))
    with pytest.raises(ValueError, match=r"hx\[1\] \(c_0\) must have shape \[6, 3, 6\]"):
        m(x, (torch.randn(6, B, 4), torch.randn(3, B, 6)))
    with pytest.raises(ValueError, match=r"hx\[0\] \(h_0\) must have shape \[6, 4\]"):
        m(torch.randn(T, 5), (torch.randn(6, B, 4), torch.randn(6, B, 6)))
    with pytest.raises(TypeError, match="hx must be None or a tuple"):
        m(x, torch.randn(6, B, 4))
    with pytest.raises(TypeError, match="dtype"):
        m(x.double())
    good = m.sample_weight_masks()
    with pytest.raises(ValueError, match="missing"):
        m(x, weight_masks={"weight_hh_l0": good["weight_hh_l0"]})
    with pytest.raises(ValueError, match=r"weight_masks\['weight_hh_l1'\] must have the shape"):
        m(x, weight_masks={**good, "weight_hh_l1": torch.ones(24, 5)})
    with pytest.raises(TypeError, match="dict"):
        m(x, weight_masks=list(good.values()))
    with pytest.raises(ValueError, match="proj_size must be smaller"):
        WeightDropLSTM(5, 6, proj_size=6)
    with pytest.raises(ValueError, match="weight_dropout"):
        WeightDropLSTM(5, 6, weight_dropout=1.0)
    with pytest.raises(ValueError, match="proj_clip"):
        WeightDropLSTM(5, 6, proj_clip=1.0)
    with pytest.raises(ValueError, match="cell_clip"):
        WeightDropLSTM(5, 6, cell_clip=-1.0)


def test_explicit_backend_that_cannot_run_raises():
    """No silent fallback: the cuda backend asked for on CPU tensors says why."""
    m = WeightDropLSTM(3, 4, backend="cuda")
    with pytest.raises(ctxfast.BackendUnavailable, match="cuda"):
        m(torch.randn(2, 1, 3))
