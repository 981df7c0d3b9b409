"""kernels/_tune.py: launch rows timed at a first call (``CTXFAST_AUTOTUNE=on``).

The tuner runs each candidate row of each kernel on the call's own inputs, keeps the
fastest whose outputs agree with the table row's, and launches later calls of the same
kind with it. On CPU the interpreter's kernels are tuned (``_tune.ON_CPU``) with their own
small candidate rows; where a test needs a given row to win, a stand-in timer
(``_tune.TIMER``) says which. Every tuned call is checked against the float64 reference
(the 2x-eager rule of tests/test_attention.py).
"""
import contextlib
import math
import os
import threading
import zlib

import pytest
import torch

import ctxfast
import test_attention as ta
from ctxfast import reference
from ctxfast.kernels import _launch, _tune
from ctxfast.kernels import attention as kattn
from utils import DEVICE, assert_within_2x_eager, needs_interpreter, spy_launches

pytestmark = ta.needs_triton

#: The dtype of the tests that need candidates: a GPU tunes 16-bit calls only (its fp32
#: rows are kept); the interpreter tunes every dtype, and its fp32 is exact.
DTYPE = torch.float16 if DEVICE == "cuda" else torch.float32


def _stand_in_time(once, rows):
    """A timer that runs nothing (the trial run has checked the candidate already) and
    ranks the rows in a fixed, arbitrary order, so that table and other rows both win
    somewhere and the calls after tuning run them."""
    return float(zlib.crc32(repr(sorted(rows.items())).encode()) % 1000)


@pytest.fixture
def tuning(monkeypatch):
    """Tuning on for this test (CPU tensors too; timed by :func:`_stand_in_time`: the
    interpreter's wall clock says nothing), from an empty table, emptied after."""
    monkeypatch.setattr(_tune, "MODE", "on")
    monkeypatch.setattr(_tune, "ON_CPU", True)
    monkeypatch.setattr(_tune, "TIMER", _stand_in_time)
    _tune.reset()
    yield
    _tune.reset()


def _call(B=1, H=2, Tq=40, Tk=40, D=32, dtype=DTYPE, **kw):
    """ctxfast.attention forward + backward on fresh inputs: (inputs, out, grads)."""
    q, k, v = (t.requires_grad_() for t in ta._inputs(B, H, Tq, Tk, D, dtype=dtype))
    out = ctxfast.attention(q, k, v, backend="triton", **kw)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    return (q, k, v), out, grads


def _kinds():
    return {r["kind"] for r in _tune.records()}


def test_off_by_default():
    if "CTXFAST_AUTOTUNE" not in os.environ:
        assert _tune.MODE == "off"            # opt-in: a first call compiles every candidate
    assert not _tune.wanted(torch.device("cpu")) or _tune.ON_CPU


@pytest.mark.parametrize("check", ["odd_lengths", "rows_that_see_no_key", "dropout", "dtypes",
                                   "varlen"])
def test_tuned_calls_against_reference(tuning, check):
    """The module's own reference checks with tuning on: every call of a new kind tunes
    (several candidates run, each checked against the table row's outputs), and what the
    call returns is within 2x eager of float64, forward and every gradient."""
    if check == "odd_lengths":
        for Tq, Tk, kind in ((37, 53, "causal-pad"), (17, 33, "perm-query"), (1, 97, "pad")):
            ta.test_odd_lengths(Tq, Tk, kind)
    elif check == "rows_that_see_no_key":
        for how in ("all-padding", "query-stream-lowest-rank"):
            ta.test_rows_that_see_no_key(how)
    elif check == "dropout":
        ta.test_dropout_matches_reference_with_the_same_mask("causal-pad")
    elif check == "dtypes":
        for dtype in (torch.float16, torch.bfloat16):
            ta.test_dtypes(dtype)
    else:
        import test_attention_varlen as tv
        tv.test_varlen_matches_per_sequence_reference(True, [9, 5], [4, 5])
        tv.test_varlen_matches_per_sequence_reference(False, [7, 0, 12], [7, 4, 12])
    runs = {}
    for r in _tune.records():
        runs[r["kind"]] = runs.get(r["kind"], 0) + 1
    if DEVICE == "cpu" or check == "dtypes":          # (a GPU tunes 16-bit calls only)
        assert runs and min(runs.values()) >= 3, runs  # candidates of every kind ran
    assert all(r["gap"] is not None and r["gap"] <= 1 for r in _tune.records()
               if r["error"] is None), "a candidate ran outside the agreement bound"


def _favour(rows_wanted):
    """A stand-in timer under which the trial with exactly ``rows_wanted`` in force is the
    fastest (1 µs) and every other 10 µs."""
    return lambda once, rows: 1.0 if rows == rows_wanted else 10.0


def _fwd_candidates(D=32, dtype=DTYPE):
    return kattn._candidates("fwd", D, dtype, "none", False, True,
                             kattn._tma_possible(dtype, torch.device(DEVICE), None, None))


def _tiled_fwd_candidate(D=32, dtype=DTYPE):
    """The last forward candidate with its own tile (a 16-bit list ends with options that
    keep the table's tile, e.g. ``{"fwd:exp_emu": True}``: the first GPU round of it failed
    a test that took the list's last entry)."""
    return [c for c in _fwd_candidates(D, dtype) if c.get("fwd")][-1]


def test_fastest_agreeing_row_is_chosen_and_launched(tuning, monkeypatch):
    favourite = _tiled_fwd_candidate()
    monkeypatch.setattr(_tune, "TIMER", _favour(favourite))
    _call(causal=True)
    chosen = [r for r in _tune.records() if r["chosen"] and r["kernel"] == "fwd"]
    assert [r["candidate"] for r in chosen] == [favourite]
    # the next call of the kind launches the forward with that row, without tuning again
    n = len(_tune.records())
    seen = spy_launches(monkeypatch, kattn, ["_attn_fwd_kernel"],
                        lambda a, kw: (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"],
                                       kw["num_stages"]), with_name=False)
    (q, k, v), out, _ = _call(causal=True)
    assert seen == [favourite["fwd"]]
    assert len(_tune.records()) == n
    assert _tune.current() == {}                   # nothing left in force after the call
    ref = reference.attention(q.double(), k.double(), v.double(), causal=True)
    same = reference.attention(q, k, v, causal=True)
    assert_within_2x_eager(out, same, ref, ta.FLOOR[q.dtype])


@pytest.mark.parametrize("fault", ["one element", "every element"])
def test_row_whose_outputs_disagree_is_never_chosen(tuning, monkeypatch, fault):
    """A candidate computing a wrong answer (as the H200 found a miscompiled launch do:
    here the forward's output changed under it, in one element or everywhere) is turned
    away even when it is the fastest, and the call's output is right."""
    favourite = _fwd_candidates()[-1]
    monkeypatch.setattr(_tune, "TIMER", _favour(favourite))
    real = kattn._launch_forward

    def launch(q, k, v, out, *args, **kwargs):
        real(q, k, v, out, *args, **kwargs)
        if _tune.current() == favourite:
            if fault == "one element":
                out[0, 0, -1, 0] += 0.5
            else:
                out.mul_(1.01)
    monkeypatch.setattr(kattn, "_launch_forward", launch)
    (q, k, v), out, _ = _call(causal=True)
    rec = next(r for r in _tune.records() if r["candidate"] == favourite)
    assert rec["error"] == "outputs disagree with the table row's" and rec["gap"] > 1
    assert not rec["chosen"]
    assert not any(r["candidate"] == favourite and r["chosen"] for r in _tune.records())
    ref = reference.attention(q.double(), k.double(), v.double(), causal=True)
    same = reference.attention(q, k, v, causal=True)
    assert_within_2x_eager(out, same, ref, ta.FLOOR[q.dtype])


def test_row_that_cannot_run_is_skipped_but_the_table_row_raises(tuning, monkeypatch):
    from triton.runtime.errors import OutOfResources
    favourite = _fwd_candidates()[-1]
    monkeypatch.setattr(_tune, "TIMER", _favour(favourite))
    real = kattn._launch_forward

    def launch(*args, **kwargs):
        if _tune.current() == favourite:
            raise OutOfResources(300000, 232448, "shared memory")
        real(*args, **kwargs)
    monkeypatch.setattr(kattn, "_launch_forward", launch)
    _call(causal=True)
    rec = next(r for r in _tune.records() if r["candidate"] == favourite)
    assert rec["error"].startswith("OutOfResources") and rec["us"] is None
    assert any(r["chosen"] and r["kernel"] == "fwd" for r in _tune.records())

    _tune.reset()

    def broken(*args, **kwargs):
        raise RuntimeError("the table row fails")
    monkeypatch.setattr(kattn, "_launch_forward", broken)
    with pytest.raises(RuntimeError, match="the table row fails"):
        _call(causal=True)


def test_a_table_row_that_fails_raises_where_a_candidate_would_run(tuning):
    # The table row is what runs untuned: its error is the call's, never skipped as a
    # candidate's is (nor a candidate chosen in its place, compared with nothing).
    out = torch.empty(3)

    def run():
        if not _tune.current():
            raise RuntimeError("the table row fails")
        out.fill_(1.0)
    kind = ("table row fails",)
    with pytest.raises(RuntimeError, match="the table row fails"):
        _tune.call(kind, [("k", [{}, {"row": 1}])], run, [out], torch.device("cpu"),
                   torch.float32)
    assert kind not in _tune.tuned()


def test_one_tuning_per_kind(tuning):
    """Calls of one kind tune once; a new size class (queries, keys or batch x heads to the
    next power of two), dtype or mask kind tunes again."""
    _call(Tq=40, Tk=40)
    kinds = _kinds()
    assert len(kinds) == 2                                   # forward, backward
    n = len(_tune.records())
    _call(Tq=33, Tk=60)                                      # same classes: 64, 64
    assert len(_tune.records()) == n
    for kw in (dict(Tq=70, Tk=70), dict(B=3), dict(causal=True), dict(dtype=torch.bfloat16)):
        before = _kinds()
        _call(**kw)
        assert len(_kinds() - before) == 2, kw


@pytest.mark.parametrize("mode", ["atomic", "bulk"])
def test_atomic_dq_is_a_candidate_and_dq_is_not_tuned_after_it(tuning, monkeypatch, mode):
    """dK/dV's candidates include dQ by atomic adds, element-wise or a tile at a time by TMA
    bulk reductions (no dQ kernel); when one wins, the dQ kernel's rows are not timed (it
    does not run), the chosen adds are the ones launched, and the call is right."""
    atomic = {"dq_mode": mode}
    monkeypatch.setattr(kattn, "TUNE_ATOMIC_DQ", True)
    monkeypatch.setattr(_tune, "TIMER", _favour(atomic))
    seen = spy_launches(monkeypatch, kattn, ["_attn_bwd_dq_kernel", "_attn_bwd_dkdv_kernel"],
                        lambda a, kw: (kw.get("ATOMIC_DQ", False), kw.get("DQ_BULK", False)))
    (q, k, v), out, grads = _call(causal=True, dtype=torch.float16)
    assert any(r["candidate"] == atomic and r["chosen"] for r in _tune.records())
    assert not any(r["kernel"] == "dq" for r in _tune.records())
    seen.clear()
    _, _, grads = _call(causal=True, dtype=torch.float16)
    assert seen == [("_attn_bwd_dkdv_kernel", (True, mode == "bulk"))]


def test_no_atomic_candidates_under_deterministic_algorithms(monkeypatch):
    """With torch's deterministic algorithms on, the tuner offers neither attention's dQ nor
    rel_attention's dr by atomic adds (sums in no fixed order), and a kind tuned with them
    off is another kind (its rows may hold an atomic mode)."""
    from ctxfast.kernels import rel_attention as krel
    monkeypatch.setattr(kattn, "_interpreting", lambda: False)
    monkeypatch.setattr(krel, "_interpreting", lambda: False)
    monkeypatch.setattr(krel, "DR_MODE", "kernel")
    monkeypatch.setattr(kattn, "TUNE_ATOMIC_DQ", True)
    bf16 = torch.bfloat16

    def atomic_offered():
        attn = [c for D in (64, 128)
                for c in kattn._candidates("dkdv", D, bf16, "none", False, True, True)
                if c.get("dq_mode") in ("atomic", "bulk")]
        rel = [c for c in krel._candidates("dq", 64, bf16, True) if c.get("dr_mode") == "atomic"]
        return attn, rel

    attn, rel = atomic_offered()
    assert attn and rel                       # offered normally: the check below can fail
    assert {c["dq_mode"] for c in attn} == {"atomic", "bulk"}
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True)
        assert atomic_offered() == ([], [])
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def test_stored_modes_offered_only_where_their_buffers_fit(monkeypatch):
    """rel_attention's dr modes over a stored dS ("gemm": one score-sized buffer; "stored":
    two) are tuner candidates at the GPU's 16-bit D 64 rows while the buffers stay within
    STORED_TUNE_BYTES, and not beyond (a first call would allocate them only to time a
    candidate); the other candidates stay, and dR's list (a function) is filtered too."""
    from ctxfast.kernels import rel_attention as krel
    monkeypatch.setattr(krel, "_interpreting", lambda: False)
    monkeypatch.setattr(krel, "DR_MODE", "atomic")
    bf16 = torch.bfloat16
    dq = krel._candidates("dq", 64, bf16, True)

    def modes(cands):
        return sorted({c.get("dr_mode") for c in cands if c.get("dr_mode")})
    cap = krel.STORED_TUNE_BYTES
    assert modes(dq) == ["bulk", "gemm", "kernel", "stored"]      # all offered here
    assert modes(krel._fitting(dq, cap // 4, 2)) == ["bulk", "gemm", "kernel", "stored"]
    assert modes(krel._fitting(dq, cap // 3, 2)) == ["bulk", "gemm", "kernel"]
    assert modes(krel._fitting(dq, cap, 2)) == ["bulk", "kernel"]
    assert len(krel._fitting(dq, cap, 2)) == len(dq) - 6       # four gemm rows, two stored
    dr = krel._fitting(lambda chosen: [{}, {"dr_mode": "stored"}], cap, 2)
    assert dr({}) == [{}]


@pytest.mark.parametrize("mask", ["none", "kpm", "perm"])
def test_gpu_candidates_time_each_launch_once(monkeypatch, mask):
    """The GPU candidates (as an sm_90 call with TMA gets them): no two candidates of a kernel
    launch the same row with the same tiles, and none repeats the table's launch (the
    table's winners are its rows now; timing them twice is a compile and trials for
    nothing). rel_attention's likewise repeat neither the table's TMA nor its dr mode."""
    monkeypatch.setattr(kattn, "_interpreting", lambda: False)
    monkeypatch.setattr(kattn, "TUNE_ATOMIC_DQ", True)      # the lists with every option
    monkeypatch.setattr(kattn, "TUNE_EXP_EMU", True)
    for D in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            for kernel in ("fwd", "dkdv", "dq"):
                cands = kattn._candidates(kernel, D, dtype, mask, False, True, mask != "perm",
                                          mask == "none")
                cands = cands({}) if callable(cands) else cands
                bm, bn, _, warps, stages = kattn._config_of(kernel, D, dtype, False, mask,
                                                           False, False)
                table = ((bm, bn, warps, stages),
                         kattn.check_tma_mode(kattn.TMA_MODE,
                                              kattn._table_tma(kernel, D, dtype, False))
                         and mask != "perm")
                launches = [table]
                # table tiles with other math, or with a register cap
                math = ("dq_mode", kernel + ":exp_emu", "fwd:fold", kernel + ":maxnreg")
                for c in cands[1:]:
                    if any(name in c for name in math):
                        continue
                    if kernel + ":ws" in c:    # the warp-specialised kernel: its own launches
                        launches.append((c[kernel], "ws"))
                        continue
                    launches.append((c.get(kernel, table[0]), c.get(kernel + ":tma", table[1])))
                assert len(set(launches)) == len(launches), (D, dtype, kernel, launches)
                emu = [c for c in cands if kernel + ":exp_emu" in c]   # the table's row
                assert emu == [{kernel + ":exp_emu": True}], emu
                fold = [c for c in cands if "fwd:fold" in c]           # the table's row
                assert fold == ([{"fwd:fold": False}] if kernel == "fwd" else []), fold
                ws = [c[kernel] for c in cands if kernel + ":ws" in c]   # where it can serve
                assert ws == (kattn._WS_CANDIDATES[(kernel, D)] if mask == "none" else []), \
                    (D, kernel, mask, ws)
                # dQ by atomic adds (element-wise, bulk): per mode the dK/dV-with-dQ table
                # row first, then other rows
                for mode in ("atomic", "bulk"):
                    atomic = [c.get("dkdv_atomic") for c in cands if c.get("dq_mode") == mode]
                    if kernel == "dkdv" and mask != "perm":
                        bm, bn, _, warps, stages = kattn._config_of("dkdv_atomic", D, dtype,
                                                                   False, mask, False, False)
                        rows = [(bm, bn, warps, stages)] + atomic[1:]
                        assert atomic[0] is None and len(set(rows)) == len(rows), (D, rows)
                    else:
                        assert not atomic, (D, kernel, mask, atomic)
    from ctxfast.kernels import rel_attention as krel
    monkeypatch.setattr(krel, "_interpreting", lambda: False)
    monkeypatch.setattr(krel, "TMA_MODE", "auto")
    monkeypatch.setattr(krel, "DR_MODE", "auto")
    for kernel in ("fwd", "dkdv", "dq"):
        cands = krel._candidates(kernel, 64, torch.bfloat16, True)
        assert len(cands) == len({repr(sorted(c.items())) for c in cands}), cands
        if kernel == "fwd":                   # the table's forward reads descriptors
            assert {"tma": "on"} not in cands and {"tma": "off"} in cands, cands
            # three CTAs an SM (a register cap, two stages), with and without the row bias
            # as a product; without descriptors (or with the product already on) that one
            # would repeat the first
            three = {"fwd": (4, 2), "fwd_maxnreg": krel.FWD_MAXNREG_3CTA}
            assert three in cands and {**three, "rb_mma": True} in cands, cands
            plain = krel._candidates(kernel, 64, torch.bfloat16, False)
            assert three in plain and {**three, "rb_mma": True} not in plain, plain
            monkeypatch.setattr(krel, "RB_MMA", "1")
            on = krel._candidates(kernel, 64, torch.bfloat16, True)
            assert three in on and {**three, "rb_mma": True} not in on, on
            monkeypatch.setattr(krel, "RB_MMA", "0")
        if kernel == "dq":                    # the table's dr is atomic (16-bit D 64)
            assert {"dr_mode": "atomic", "dq": (8, 1)} not in cands, cands
            assert {"dr_mode": "kernel", "dq": (4, 1)} in cands, cands


def test_register_caps_offered_where_registers_set_the_ctas(monkeypatch):
    """attention's register-capped candidates (one more CTA an SM, kernels/attention.
    _TUNE_REG_CAPS) are offered for 16-bit D 64 dK/dV and dQ with no mask and no dropout,
    on the table's row, and nowhere else (the forward, D 128, padding or permutation
    masks, dropout, float32); rel_attention's for its forward, dK/dV and dQ."""
    monkeypatch.setattr(kattn, "_interpreting", lambda: False)
    bf16 = torch.bfloat16

    def caps(kernel, D=64, dtype=bf16, mask="none", dropout=False):
        cands = kattn._candidates(kernel, D, dtype, mask, dropout, True, True)
        cands = cands({}) if callable(cands) else cands
        return [c for c in cands if any(k.endswith(":maxnreg") for k in c)]
    assert caps("dkdv") == [{"dkdv:maxnreg": 168}] and caps("dq") == [{"dq:maxnreg": 128}]
    assert not caps("fwd") and not caps("dkdv", D=128) and not caps("dq", D=128)
    assert not caps("dq", mask="kpm") and not caps("dkdv", mask="perm")
    assert not caps("dkdv", dropout=True) and not caps("dq", dtype=torch.float32)
    from ctxfast.kernels import rel_attention as krel
    monkeypatch.setattr(krel, "_interpreting", lambda: False)
    for kernel, key in (("fwd", "fwd_maxnreg"), ("dkdv", "dkdv_maxnreg"), ("dq", "dq_maxnreg")):
        assert [c for c in krel._candidates(kernel, 64, bf16, True) if key in c], kernel
    for kernel, cap in (("fwd", krel.FWD_MAXNREG_3CTA), ("dkdv", krel.DKDV128_MAXNREG_2CTA)):
        assert {kernel + "_maxnreg": cap} in krel._candidates(kernel, 128, bf16, True), kernel


def test_warp_specialised_kernels_are_tuned_where_they_can_serve(tuning, monkeypatch):
    """An eligible call (dense, 16-bit, no padding / permutation mask / dropout: kernels/
    attention._ws_possible) times the warp-specialised forward, dK/dV and dQ kernels
    (``"<kernel>:ws"``) among its candidates, and where they are the fastest the next call
    of the kind launches them; an ineligible call (padding) never tries them. Their outputs
    agree with the table rows'."""
    monkeypatch.setattr(_tune, "TIMER", lambda once, rows: 10.0 - sum(   # more: faster
        bool(on) for name, on in rows.items() if name.endswith(":ws")))
    _call(causal=True, dtype=torch.float16)
    chosen = {r["kernel"]: r["candidate"] for r in _tune.records() if r["chosen"]}
    assert chosen == {"fwd": {"fwd:ws": True}, "dkdv": {"dkdv:ws": True},
                      "dq": {"dq:ws": True}}, chosen
    assert all(r["error"] is None and r["gap"] <= 1 for r in _tune.records()), _tune.records()
    names = ("_attn_fwd_kernel", "_attn_fwd_ws_kernel", "_attn_bwd_dkdv_kernel",
             "_attn_bwd_dkdv_ws_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_dq_ws_kernel")
    seen = spy_launches(monkeypatch, kattn, names, lambda a, kw: None)
    (q, k, v), out, grads = _call(causal=True, dtype=torch.float16)
    assert [n for n, _ in seen] == list(names[1::2]), seen
    ref = reference.attention(q.double(), k.double(), v.double(), causal=True)
    same = reference.attention(q, k, v, causal=True)
    assert_within_2x_eager(out, same, ref, ta.FLOOR[q.dtype])
    _tune.reset()
    kpm = torch.zeros(1, 40, dtype=torch.bool, device=DEVICE)
    kpm[:, -5:] = True
    _call(key_padding_mask=kpm, dtype=torch.float16)
    assert not [r for r in _tune.records() if any(n.endswith(":ws") for n in r["candidate"])]
    monkeypatch.setattr(kattn, "_interpreting", lambda: False)      # an sm_90 call's rows
    for kernel in ("fwd", "dkdv", "dq"):
        cands = kattn._candidates(kernel, 64, torch.bfloat16, "none", False, True, True, True)
        cands = cands({}) if callable(cands) else cands
        rows = [c[kernel] for c in cands if kernel + ":ws" in c]
        assert rows == kattn._WS_CANDIDATES[(kernel, 64)], kernel
        cands = kattn._candidates(kernel, 64, torch.bfloat16, "none", False, True, True, False)
        cands = cands({}) if callable(cands) else cands
        assert not [c for c in cands if kernel + ":ws" in c], kernel


def test_warp_specialised_kernels_left_out_by_setting(tuning, monkeypatch):
    """``CTXFAST_TUNE_WS=0`` (kernels/attention.TUNE_WS, read at import): an eligible call
    tunes without the warp-specialised kernels; a value other than "0" / "1" is refused by
    name before any launch."""
    monkeypatch.setattr(kattn, "TUNE_WS", "0")
    _call(causal=True, dtype=torch.float16)
    assert _tune.records()
    assert not [r for r in _tune.records() if any(n.endswith(":ws") for n in r["candidate"])]
    _tune.reset()
    monkeypatch.setattr(kattn, "TUNE_WS", "yes")
    seen = spy_launches(monkeypatch, kattn, ("_attn_fwd_kernel", "_attn_fwd_ws_kernel"),
                        lambda a, kw: None)
    with pytest.raises(ValueError, match="CTXFAST_TUNE_WS must be '0' or '1'"):
        _call(causal=True, dtype=torch.float16)
    with pytest.raises(ValueError, match="CTXFAST_TUNE_WS must be '0' or '1'"):
        _call(dtype=torch.float32)              # also a call the kernels could not serve
    assert not seen


def test_options_timed_slower_are_not_candidates_by_default(monkeypatch):
    """dQ by atomic adds and the FMA exponentials, both timed slower than the table rows in
    every case the H200 reached (kernels/attention.py TUNE_ATOMIC_DQ, TUNE_EXP_EMU), cost a
    first call compiles and trials for nothing: not offered unless asked for. dQ by TMA bulk
    reductions, not yet timed, is (TUNE_BULK_DQ), where the call can use descriptors."""
    monkeypatch.setattr(kattn, "_interpreting", lambda: False)
    for D in (64, 128):
        for kernel in ("fwd", "dkdv", "dq"):
            cands = kattn._candidates(kernel, D, torch.bfloat16, "none", False, True, True)
            cands = cands({}) if callable(cands) else cands
            assert cands[0] == {} and len(cands) > 1, cands
            assert not [c for c in cands if c.get("dq_mode") == "atomic"
                        or kernel + ":exp_emu" in c], cands
            # dQ by TMA bulk reductions (untimed) is offered where descriptors can be used
            bulk = [c for c in cands if c.get("dq_mode") == "bulk"]
            assert bool(bulk) == (kernel == "dkdv"), cands
            if kernel == "dkdv":              # a call without descriptors: none
                assert not [c for c in kattn._candidates(kernel, D, torch.bfloat16, "none",
                                                         False, True, False) if "dq_mode" in c]


def test_gpu_table_rows_follow_the_h200_round(monkeypatch):
    """The launch tables as an sm_90 call reads them (rows from the H200's round 4, which
    the tuner chose there): 16-bit D 64 forward and dK/dV 64 x 64 x 4 x 3, dQ 128 x 64;
    with a padding mask the forward's 128-row block and dQ 64 x 64 x 4 x 2; D 128 dQ with
    3 stages (and round 5's dK/dV D 128 with 3); with dropout its own rows. rel_attention: dQ at (8, 1) when dr is added
    with atomics (16-bit 64 x 64 tiles), (4, 1) with the dR kernel."""
    bf16 = torch.bfloat16

    def row(kernel, D, mask="none", dropout=False):
        bm, bn, _, warps, stages = kattn._config_of(kernel, D, bf16, False, mask, dropout,
                                                    False)
        return bm, bn, warps, stages
    assert row("fwd", 64) == (64, 64, 4, 3) and row("dkdv", 64) == (64, 64, 4, 3)
    assert row("dq", 64) == (128, 64, 8, 3) and row("dq", 128) == (128, 64, 8, 3)
    assert row("fwd", 64, "kpm") == (128, 64, 8, 3) and row("dq", 64, "kpm") == (64, 64, 4, 2)
    assert row("dkdv", 64, "kpm") == (64, 64, 4, 3)
    assert row("dkdv", 64, "kpm", dropout=True) == (32, 128, 8, 2)
    assert row("dkdv", 128) == (32, 128, 8, 3)            # round 5: 1919 against 2013 us
    from ctxfast.kernels import rel_attention as krel
    monkeypatch.setattr(krel, "_interpreting", lambda: False)
    assert krel._bwd_launch(64, bf16, atomic=True)["dq"] == (8, 1)
    assert krel._bwd_launch(64, bf16, atomic=False)["dq"] == (4, 1)
    assert krel._bwd_launch(64, torch.float32, atomic=True)["dq"] == (8, 1)


@pytest.mark.parametrize("mask", ["none", "kpm"])
def test_gpu_table_rows_against_reference(monkeypatch, mask):
    """The sm_90 table rows' block shapes (16-bit D 64: the forward and dK/dV at 64 x 64,
    with a padding mask the forward at 128 x 64 and dQ at 64 x 64) forced on every kernel
    (the interpreter otherwise runs 16 x 16 blocks): odd lengths across and inside one block
    and rows that see no key, forward and every gradient within 2x eager of float64."""
    rows = {k: kattn._config_of(k, 64, torch.float16, False, mask, False, False)
            for k in ("fwd", "dkdv", "dq")}
    for kernel, (bm, bn, _, warps, stages) in rows.items():
        monkeypatch.setitem(kattn.LAUNCH_OVERRIDE, kernel, (bm, bn, warps, stages))
    kinds = ("causal", "none") if mask == "none" else ("causal-pad", "pad")   # (70, 9): none
    for (Tq, Tk), kind in zip(((37, 53), (1, 97), (130, 130), (70, 9)), kinds * 2):
        q, k, v = ta._inputs(1, 2, Tq, Tk, 64, dtype=torch.float16)
        ta.check_against_reference(q, k, v, **ta._masks(kind, 1, Tq, Tk))
    q, k, v = ta._inputs(2, 2, 20, 20, 64, dtype=torch.float16)
    kpm = torch.zeros(2, 20, dtype=torch.bool, device=DEVICE)
    kpm[0] = True                                               # batch 0 sees no key
    out, grads = ta.check_against_reference(q, k, v, key_padding_mask=kpm)
    assert (out[0] == 0).all() and all((g[0] == 0).all() for g in grads)


def test_agreement_measure():
    ref = torch.tensor([1.0, -2.0, float("inf"), 0.5])
    assert _tune._gap([ref.clone()], [ref]) == 0.0                  # equal infinities agree
    one_ulp = ref.clone()
    one_ulp[1] = -2.0 * (1 + 2 ** -9)                               # 2^-8 of max |ref|
    assert _tune._gap([one_ulp.half()], [ref.half()]) == pytest.approx(0.0, abs=1.0)
    wrong = ref.clone()
    wrong[3] = 0.6                                                  # 5% of max |ref|
    assert _tune._gap([wrong], [ref]) > 1
    nan = ref.clone()
    nan[0] = float("nan")
    assert _tune._gap([nan], [ref]) == math.inf
    assert _tune._gap([torch.ones(3), torch.empty(0)], [torch.ones(3), torch.empty(0)]) == 0


@pytest.mark.parametrize("dtype, agrees", [(torch.bfloat16, True), (torch.float32, False)],
                         ids=str)
def test_agreement_is_bounded_by_the_calls_dtype(tuning, monkeypatch, dtype, agrees):
    # A float32 output of a call whose inputs are `dtype` (attention's lse): a candidate
    # 2^-8 of the largest element away from the table row's is a quarter of bfloat16's
    # AGREE (chosen when fastest) but twice float32's (turned away).
    out = torch.empty(4)
    base = torch.tensor([1.0, -2.0, 0.5, 0.25])

    def run():
        out.copy_(base)
        if _tune.current().get("row") == 1:
            out[1] = -2.0 * (1 + 2 ** -8)
    monkeypatch.setattr(_tune, "TIMER", lambda once, rows: 1.0 if rows.get("row") else 2.0)
    _tune.call(("agreement", str(dtype)), [("k", [{}, {"row": 1}])], run, [out],
               torch.device("cpu"), dtype)
    want = base.clone()
    if agrees:                                     # the call ran with the row chosen
        want[1] = -2.0 * (1 + 2 ** -8)
    assert torch.equal(out, want), out
    rec = next(r for r in _tune.records() if r["candidate"] == {"row": 1})
    assert rec["chosen"] is agrees, rec
    assert rec["gap"] == pytest.approx(0.25 if agrees else 2.0), rec
    assert _tune.tuned()[("agreement", str(dtype))] == ({"row": 1} if agrees else {})


def test_size_classes_round_up_to_a_power_of_two():
    # A kind's size part: a power of two is its own class (64 queries tune apart from 65,
    # with 33..64), 0 and 1 stay.
    sizes = [0, 1, 2, 3, 4, 5, 16, 17, 63, 64, 65, 4096, 4097]
    assert [_tune.size_class(n) for n in sizes] == [0, 1, 2, 4, 4, 8, 16, 32, 64, 64, 128,
                                                    4096, 8192]


def test_when_calls_are_tuned(monkeypatch):
    monkeypatch.setattr(_tune, "MODE", "on")
    monkeypatch.setattr(_tune, "ON_CPU", False)
    assert not _tune.wanted(torch.device("cpu"))                    # a GPU's calls only
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not _tune.wanted(torch.device("cuda"))                   # never inside a graph
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert _tune.wanted(torch.device("cuda"))
    monkeypatch.setattr(_tune, "MODE", "yes")
    with pytest.raises(ValueError, match="CTXFAST_AUTOTUNE must be 'off' or 'on', got 'yes'"):
        _tune.wanted(torch.device("cpu"))
    with pytest.raises(ValueError, match="CTXFAST_AUTOTUNE"):
        _call()


def test_bad_setting_refused_before_any_backward_launch(monkeypatch):
    """A bad CTXFAST_AUTOTUNE is refused by both backwards before their first launch (the
    row term's kernel, which runs before the tuned launches)."""
    import ctxfast.kernels._common as kcommon
    import test_rel_attention as rel_tests
    from ctxfast.kernels import rel_attention as krel
    q, k, v = ta._inputs(1, 1, 5, 5, 16)
    out, lse = kattn.attention_forward(q, k, v)
    ts = rel_tests._inputs(1, 1, 5, 5, 16, 5)
    rout, rlse = krel.rel_attention_forward(*ts)
    monkeypatch.setattr(_tune, "MODE", "yes")
    monkeypatch.setattr(kcommon, "_bwd_delta_kernel", None)   # any launch would fail here
    with pytest.raises(ValueError, match="CTXFAST_AUTOTUNE"):
        kattn.attention_backward(torch.randn_like(out), q, k, v, out, lse)
    with pytest.raises(ValueError, match="CTXFAST_AUTOTUNE"):
        krel.rel_attention_backward(torch.randn_like(rout), *ts, rout, rlse)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    q1, k1, v1 = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))   # [5, 1, 16]
    monkeypatch.setattr(kattn, "_launch_backward", None)
    with pytest.raises(ValueError, match="CTXFAST_AUTOTUNE"):
        kattn.attention_varlen_backward(torch.randn_like(q1), q1, k1, v1, q1, lse[0], cu, cu,
                                        5, 5)


def test_rows_in_force_nest_and_are_per_thread():
    import threading
    assert _tune.current() == {}
    with _tune.active({"fwd": (1, 2, 3, 4)}):
        with _tune.active({"dq": (5, 6, 7, 8)}):
            assert _tune.current() == {"dq": (5, 6, 7, 8)}
        assert _tune.current() == {"fwd": (1, 2, 3, 4)}
        other = []
        t = threading.Thread(target=lambda: other.append(_tune.current()))
        t.start()
        t.join()
        assert other == [{}]
    assert _tune.current() == {}


def test_torch_compile_fullgraph_tuned(tuning):
    """A tuned call traces under torch.compile(fullgraph=True): the forward and the backward
    kinds are tuned once each, and the compiled result is within 2x eager of float64 (in
    DTYPE: a GPU does not tune fp32 calls)."""
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in ta._inputs(1, 2, 17, 20, 16, dtype=DTYPE))

    def f(q, k, v):
        return ctxfast.attention(q * 1.5, k, v, causal=True, backend="triton")

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert len(_kinds()) == 2, _kinds()
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ins = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(ins64[0] * 1.5, *ins64[1:], causal=True)
    same = reference.attention(ins[0] * 1.5, *ins[1:], causal=True)
    ref_g = torch.autograd.grad(ref, ins64, g.double())
    same_g = torch.autograd.grad(same, ins, g)
    assert_within_2x_eager(out, same, ref, ta.FLOOR[DTYPE])
    for name, a, b, c in zip("qkv", grads, same_g, ref_g):
        assert_within_2x_eager(a, b, c, ta.FLOOR[DTYPE], name=f"d{name}")


# --------------------------------------------------------------------------- rel_attention

def test_wall_clock_timing_on_a_cpu(tuning, monkeypatch):
    """Without a stand-in timer a CPU call is timed by the wall clock (one more run)."""
    monkeypatch.setattr(_tune, "TIMER", None)
    calls = []
    us = _tune._time_us(lambda: calls.append(1), {}, torch.device("cpu"))
    assert calls == [1] and us > 0


def test_gpu_timing_protocol(monkeypatch):
    """_time_us's CUDA path, with stand-in events and spin kernel: one call estimates the
    time per call (and the host's time to issue it); each of ROUNDS rounds queues a spin of
    1.5x the host time of its calls, then that many calls between two events; the best
    round's time per call comes back."""
    log, elapsed = [], iter([0.5, 5.0, 4.0, 6.0])   # ms: the estimate, then three rounds

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            log.append("event")

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return next(elapsed)
    monkeypatch.setattr(_tune, "TIMER", None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(cycles), raising=False)
    calls = []
    us = _tune._time_us(lambda: calls.append(1) or log.append("call"), {}, torch.device("cuda"))
    assert us == pytest.approx(4.0 / 10 * 1e3)                 # 10 calls a round (5 ms / 0.5)
    assert len(calls) == 1 + _tune.ROUNDS * 10
    spins = [x for x in log if isinstance(x, int)]
    assert len(spins) == _tune.ROUNDS
    assert all(c >= 10 * 20e-6 * _tune.HOLD_MARGIN * _tune.HOLD_CLOCK_HZ for c in spins)
    first_round = log[log.index(spins[0]):]
    assert first_round[:3] == [spins[0], "event", "call"]      # spin, start, the calls, end
    assert first_round[2:12] == ["call"] * 10 and first_round[12] == "event"


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_gpu_candidates_compile_side_by_side_before_they_are_timed(monkeypatch, device):
    """A GPU call's candidates of each kernel (each with the rows chosen before it) are
    compiled before the first is timed, on worker threads, each with its own rows in force
    and launches compiling only. A row that
    fails there is still run by the timed loop, which records its error; a CPU call
    compiles nothing ahead."""
    log = []
    out = torch.zeros(3)

    def run():
        rows = dict(_tune.current())
        log.append((threading.current_thread() is threading.main_thread(), rows,
                    _launch.compiling_only()))
        if rows.get("bad"):
            raise RuntimeError("no such row")
        if not _launch.compiling_only():
            out.fill_(1.0)

    monkeypatch.setattr(_tune, "TIMER", lambda once, rows: 10.0 - rows.get("a", 0)
                        - rows.get("b", 0))
    monkeypatch.setattr(_tune, "COMPILE_THREADS", 3)
    monkeypatch.setattr(_tune, "_sync", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    kernels = [("a", [{}, {"a": 1}, {"a": 2}, {"a": 3, "bad": True}]),
               ("b", lambda chosen: [{}, {"b": 1}])]
    _tune.reset()
    try:
        rows = _tune._tune("kind", kernels, run, [out], torch.device(device, 0)
                           if device == "cuda" else torch.device("cpu"), 1e-3)
        records = _tune.records()
    finally:
        _tune.reset()
    assert rows == {"a": 2, "b": 1}
    ahead = [(main, r) for main, r, only in log if only]
    timed = [r for main, r, only in log if not only and main]
    if device == "cpu":
        assert not ahead and len(timed) == 6
        return
    first_a = [{}, {"a": 1}, {"a": 2}, {"a": 3, "bad": True}]
    assert not any(main for main, _ in ahead)                   # all on worker threads
    rows_of = lambda part: sorted(map(repr, (r for _, r in part)))     # noqa: E731
    assert rows_of(ahead[:4]) == rows_of([(0, r) for r in first_a])
    assert log[:4] == [(m, r, True) for m, r in ahead[:4]]      # all before any timed run
    assert rows_of(ahead[4:]) == rows_of([(0, {"a": 2}), (0, {"a": 2, "b": 1})])  # a chosen
    assert timed == first_a + [{"a": 2}, {"a": 2, "b": 1}]
    assert [r["error"] for r in records if r["candidate"].get("bad")] == [
        "RuntimeError: no such row"]


def test_rel_attention_tuned_against_reference(tuning):
    """rel_attention's reference checks with tuning on (its forward and its backward's
    dK/dV, dQ and dR launches, the carried gather, TMA chunks, dr by atomic adds among the
    candidates): dr and every gradient against float64 within 2x eager with memory and
    odd sizes, a window and a longer r with causal off, XLNet's order with every mask,
    rows that see no key, dropout, and 16-bit (the interpreter's variant reference checks, cut to the calls of
    distinct kinds)."""
    import test_rel_attention as rel_tests
    import test_rel_attention_bwd as rel_bwd
    # (two batches and two heads: each plane is a program the interpreter runs in turn, and
    # each candidate re-runs the whole backward)
    rel_bwd.test_dr_against_float64(2, 2, 19, 14, 38, None, None, True)
    rel_bwd.test_dr_against_float64(2, 2, 17, 17, 54, 35, 7, False)
    rel_bwd.test_dr_bidirectional_with_every_mask()
    rel_tests.test_rows_that_see_no_key()
    rel_tests.check_dropout(2, 2, 13, 21, 16, 0.25, seed=5)
    rel_tests.test_half_dtypes(torch.float16)
    kinds = {r["kind"][:2] for r in _tune.records()}
    assert {("rel_attention", ("fwd",)), ("rel_attention", ("dkdv", "dq", "dr"))} <= kinds
    tried = [r["candidate"] for r in _tune.records() if r["kind"][0] == "rel_attention"]
    assert any("dr_mode" in c for c in tried) and any("carry" in c for c in tried)
    assert all(r["gap"] <= 1 for r in _tune.records() if r["error"] is None)


@needs_interpreter
def test_rel_attention_checks_every_gradient(tuning, monkeypatch):
    """dr is among the outputs a rel_attention candidate is checked on: a candidate whose
    dr alone is wrong (atomic dr, corrupted after its dQ kernel here) is turned away even
    when fastest, and the call's gradients are right."""
    import test_rel_attention_bwd as rel_bwd
    from ctxfast.kernels import rel_attention as krel
    atomic = {"dr_mode": "atomic"}
    monkeypatch.setattr(_tune, "TIMER", _favour(atomic))
    real = krel._rel_attn_bwd_dq_kernel

    class Corrupting:
        def __getitem__(self, grid):
            launch = real[grid]

            def run(*args, **kwargs):
                launch(*args, **kwargs)
                if kwargs["ATOMIC_DR"]:
                    args[real.arg_names.index("DR_ACC")].add_(1.0)    # the dr accumulator
            return run
    monkeypatch.setattr(krel, "_rel_attn_bwd_dq_kernel", Corrupting())
    rel_bwd.test_dr_against_float64(2, 2, 17, 17, 54, 35, None, True)
    rec = next(r for r in _tune.records() if r["candidate"] == atomic)
    assert rec["error"] == "outputs disagree with the table row's" and not rec["chosen"]
