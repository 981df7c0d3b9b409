"""The fast launch path (``kernels/_launch.py``), checked without a GPU.

A remembered compiled kernel is only right if every call that reuses it is one Triton's own
JIT would have given the same kernel. So: (1) the key of an argument is at least as fine as
Triton's specialisation of it (``native_specialize_impl``, Triton's own function), on chosen
values and on every launch the launchers make in the compile test's cases (bound by
Triton's own binder for sm_90); (2) a reused kernel gets exactly the arguments Triton would
pass it (the binder's ``bound_args``, in order); (3) the wrapper keeps Triton's path for
the first call, a new key, a launch hook, a changed global, or a grid that is not a
tuple, and is off under the interpreter and with ``LAUNCH = "jit"``. Whether the GPU's
launcher takes the arguments is checked on a GPU (``tests/gpu/test_launch_gpu.py``).
"""
import collections
import itertools
import os
import subprocess
import sys
import threading

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from ctxfast.kernels import _launch

native_specialize_impl = pytest.importorskip("triton._C.libtriton").native_specialize_impl


def _toy(x_ptr, n, scale, flag, W: tl.constexpr, BLOCK: tl.constexpr = 16,
         EXTRA: tl.constexpr = None):
    pass


# A JITFunction even where the suite runs with TRITON_INTERPRET=1 (where @triton.jit makes
# an InterpretedFunction, which fast() never wraps).
_toy_kernel = JITFunction(_toy)


def _triton_spec(a):
    return native_specialize_impl(BaseBackend, a, False, True, True)


INTS = [0, 1, 2, 15, 16, 17, 32, -1, -15, -16, -17, 2**31 - 16, 2**31 - 1, 2**31,
        2**31 + 16, -2**31, -2**31 + 1, -2**31 - 16, -2**31 - 1, 2**63 - 16, 2**63 - 1,
        -2**63, 2**63, 2**63 + 16, 2**64 - 1]


def _values():
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], base[2:], torch.zeros(8, dtype=torch.bfloat16),
               torch.zeros(16, dtype=torch.bfloat16)[1:], torch.zeros(4, dtype=torch.int32),
               torch.zeros(4, dtype=torch.bool)]
    return INTS + [True, False, None, 0.5, 1.0, 2.0, -3.0] + tensors


KEY_FUNCTIONS = {"python": _launch._args_key_py, "C": _launch._c_args_key()}


@pytest.mark.parametrize("impl", sorted(KEY_FUNCTIONS))
def test_argument_key_is_at_least_as_fine_as_triton(impl):
    """Equal keys -> equal Triton specialisation (else a reused kernel could be the wrong
    one: e.g. a kernel specialised for n = 1 reused for n = 17), for the C key and its
    Python fallback."""
    args_key = KEY_FUNCTIONS[impl]
    if args_key is None:
        pytest.fail("ctxfast._C has no launch_key: the extension is not built")
    groups = {}
    for a in _values():
        groups.setdefault(repr(args_key((a,))[0]), []).append(a)
    for members in groups.values():
        specs = {repr(_triton_spec(a)) for a in members}
        assert len(specs) == 1, f"one key {args_key((members[0],))!r} for {members}: {specs}"
    # and the ints land in different classes where Triton's do
    one, seventeen, sixteen, true = args_key((1, 17, 16, True))
    assert one != seventeen != sixteen and one != true


def test_c_key_is_used_and_refuses_what_is_not_a_tuple():
    assert _launch.args_key is KEY_FUNCTIONS["C"]
    with pytest.raises(TypeError, match="tuple"):
        _launch.args_key([1, 2])


def _binder(fn):
    from triton.compiler import make_backend
    from triton.backends.compiler import GPUTarget
    return create_function_from_signature(fn.signature, fn.params,
                                          make_backend(GPUTarget("cuda", 90, 32)))


def _check_real_launches():
    """Run as a script (no TRITON_INTERPRET, so the kernels are JITFunctions and the compile
    test's recorders replace them): on every launch of the compile test's cases, and on
    variants of each, a FastKernel's key is equal only where Triton's binder gives the same
    specialisation and options, and the arguments it would pass a reused kernel are the
    binder's, in order. Prints the count of launches checked."""
    import test_triton_compile as tc
    torch.manual_seed(0)
    launches = [launch for _, _, case in tc._cases() for launch in tc._record(case)]
    names = {fn.__name__ for fn, _, _ in launches}
    want = {"_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel",
            "_bwd_delta_kernel", "_attn_combine_kernel", "_rel_attn_fwd_kernel",
            "_rel_attn_bwd_dq_kernel", "_lstm_fwd_kernel", "_lstm_bwd_kernel",
            "_rel_shift_kernel"}
    assert names >= want, f"no launch of {want - names}"
    assert _launch.args_key is not _launch._args_key_py, "ctxfast._C.launch_key missing"
    checked = 0
    binders = {}
    for (impl, args_key), (fn, args, kwargs) in itertools.product(
            [("C", _launch.args_key), ("python", _launch._args_key_py)], launches):
        _launch.args_key = args_key
        fk = _launch.FastKernel(fn)
        binder = binders.get(fn) or binders.setdefault(fn, _binder(fn))
        bound, spec, options = binder(*args, **kwargs)
        assert [*args, *fk.tail(args, kwargs)] == list(bound.values()), fn.__name__
        seen = {}
        for variant in itertools.chain([args], _variants(args)):
            key = fk.key(variant, kwargs, ("knobs",))
            _, vspec, voptions = binder(*variant, **kwargs)
            triton_key = (repr(vspec), repr(sorted(voptions.items())))
            assert seen.setdefault(key, triton_key) == triton_key, (
                f"{fn.__name__} ({impl} key): one key, two Triton specialisations")
            checked += 1
    print(f"checked {checked} keys of {len(launches)} launches")


def _variants(args):
    """The launch's arguments with one int at a time moved by 16 and by 1, and one tensor
    at a time moved off its 16-byte alignment: calls whose keys may or may not change."""
    for i, a in enumerate(args):
        if type(a) is int:
            for d in (16, 1, -1):
                yield args[:i] + (a + d,) + args[i + 1:]
        elif isinstance(a, torch.Tensor) and a.numel() > 1:
            yield args[:i] + (a.flatten()[1:],) + args[i + 1:]


def test_keys_of_real_launches_imply_tritons():
    """:func:`_check_real_launches` in a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.path.dirname(here),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checked = int(proc.stdout.split()[-5])
    assert checked > 500, proc.stdout


class _FakeCompiled:
    """What JITFunction.run returns: records the launches made through its launcher."""

    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "function-handle", "packed"

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, exit_, *values):
        self.log.append(("launch", (gx, gy, gz), stream, function, packed, values))


@pytest.fixture
def toy(monkeypatch):
    """A FastKernel around _toy_kernel whose Triton path is faked: Triton's binder picks the
    arguments, the fake kernel records the launch and the 'slow' calls are logged."""
    log = []
    compiled = {}
    binder = _binder(_toy_kernel)

    def jit_run(*args, grid, warmup, **kwargs):
        bound, spec, options = binder(*args, **kwargs)
        key = (repr(spec), repr(sorted(options.items())))
        kernel = compiled.setdefault(key, _FakeCompiled(log))
        log.append(("jit", key))
        g = tuple(grid(bound) if callable(grid) else grid) + (1, 1)
        kernel.run(g[0], g[1], g[2], 99, kernel.function, kernel.packed_metadata, None, None,
                   None, *bound.values())
        return kernel

    monkeypatch.setattr(_toy_kernel, "run", jit_run, raising=False)
    monkeypatch.setattr(_launch, "_interpreting", lambda: False)
    monkeypatch.setattr(_launch, "LAUNCH", "fast")
    monkeypatch.setattr(_launch, "_device_stream", (lambda: 0, lambda device: 99))
    monkeypatch.setattr(_launch, "_WRAPPED", {})
    fk = _launch.fast(_toy_kernel)
    assert isinstance(fk, _launch.FastKernel)
    return fk, log


def _x(offset=0):
    return torch.zeros(32)[offset:]


def test_reused_kernel_gets_what_triton_passes(toy):
    fk, log = toy
    x = _x()
    fk[(3, 2)](x, 64, 0.5, True, W=4)
    fk[(3, 2)](x, 80, 0.5, True, W=4)        # 80: same class as 64 (i32, multiple of 16)
    jit_calls = [e for e in log if e[0] == "jit"]
    launches = [e for e in log if e[0] == "launch"]
    assert len(jit_calls) == 1 and fk.hits == 1 and fk.misses == 1
    assert launches[1] == ("launch", (3, 2, 1), 99, "function-handle", "packed",
                           (x, 80, 0.5, True, 4, 16, None))


@pytest.mark.parametrize("change", ["n=1", "n not a multiple of 16", "misaligned x",
                                    "x dtype", "constexpr", "num_warps", "scale type",
                                    "debug knob", "instrumentation knob",
                                    "constexpr int as float"])
def test_a_new_key_goes_through_triton(toy, change, monkeypatch):
    fk, log = toy
    fk[(1,)](_x(), 64, 0.5, True, W=4)
    args, kwargs = [_x(), 64, 0.5, True], dict(W=4)
    if change == "n=1":
        args[1] = 1
    elif change == "n not a multiple of 16":
        args[1] = 65
    elif change == "misaligned x":
        args[0] = _x(1)
    elif change == "x dtype":
        args[0] = torch.zeros(32, dtype=torch.float16)
    elif change == "constexpr":
        kwargs["W"] = 8
    elif change == "constexpr int as float":    # equal, but Triton keys the value's text
        kwargs["W"] = 4.0
    elif change == "num_warps":
        kwargs["num_warps"] = 8
    elif change == "debug knob":                 # enters Triton's options
        monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    elif change == "instrumentation knob":       # enters Triton's options (proton, gsan)
        monkeypatch.setattr(triton.knobs.compilation, "instrumentation_mode", "gsan")
    else:
        args[2] = 2                            # an int where a float was
    fk[(1,)](*args, **kwargs)
    assert fk.misses == 2 and fk.hits == 0
    assert [e[0] for e in log].count("jit") == 2


def test_compile_only_warms_up_and_launches_nothing(toy, monkeypatch):
    """Under compile_only (this thread only) both launch paths ask Triton for a warm-up
    (compile, cache, no launch) with the options every launch passes, the kernel's tables
    for the current device made first, and the fast path remembers nothing; outside it
    they launch again."""
    fk, log = toy
    calls = []

    compiled = _FakeCompiled(log)

    def jit_run(*args, grid, warmup, **kwargs):
        calls.append((threading.current_thread().name, warmup, kwargs.get("enable_fp_fusion")))
        return compiled

    monkeypatch.setattr(_toy_kernel, "run", jit_run, raising=False)
    tables = collections.defaultdict(lambda: "tables")      # Triton's per-device tables
    monkeypatch.setattr(_toy_kernel, "device_caches", tables)
    plain = _launch.WithOptions(_toy_kernel)
    me = threading.current_thread().name
    with _launch.compile_only():
        assert _launch.compiling_only()
        assert fk[(3, 2)](_x(), 64, 0.5, True, W=4) is compiled
        assert plain[(3,)](_x(), 64, 0.5, True, W=4) is compiled
        other = threading.Thread(target=lambda: fk[(1,)](_x(), 64, 0.5, True, W=4),
                                 name="other")
        other.start()
        other.join()
    assert not _launch.compiling_only()
    assert calls[:2] == [(me, True, True), (me, True, True)]
    assert list(tables) == [0]          # made before the warm-up (under the tables' lock)
    assert [c for c in calls if c[0] == "other"][0][1] is False    # not that thread's mode
    assert fk.hits == 0 and fk.misses == 1 and len(fk.cache) == 1  # 'other' only
    calls.clear()
    plain[(3,)](_x(), 64, 0.5, True, W=4)
    assert calls == [(me, False, True)]


def _toy_desc(x_ptr, n, W: tl.constexpr, D=None, TMA: tl.constexpr = False):
    pass


_toy_desc_kernel = JITFunction(_toy_desc)


def _desc_toy(toy, monkeypatch):
    """(FastKernel around _toy_desc_kernel, the toy's log), its Triton path faked as the
    toy fixture's: each 'slow' launch logged as ("jit",)."""
    _, log = toy
    compiled = {}
    binder = _binder(_toy_desc_kernel)

    def jit_run(*args, grid, warmup, **kwargs):
        bound, spec, options = binder(*args, **kwargs)
        kernel = compiled.setdefault((repr(spec), repr(sorted(options.items()))),
                                     _FakeCompiled(log))
        log.append(("jit",))
        kernel.run(grid[0], 1, 1, 99, kernel.function, kernel.packed_metadata, None, None,
                   None, *bound.values())
        return kernel
    monkeypatch.setattr(_toy_desc_kernel, "run", jit_run, raising=False)
    return _launch.fast(_toy_desc_kernel), log


def test_descriptor_keywords_are_each_calls_own(toy, monkeypatch):
    """A tensor descriptor passed by keyword (the attention kernels' KD / VD / QD / DOD) is
    keyed as Triton specialises it (dtype and block: kernels._common.RowTiles), so two
    calls on different tensors share the compiled kernel; the second launch must get the
    second call's descriptor, not the first's (which the table does not keep alive)."""
    from ctxfast.kernels._common import row_tiles
    fk, log = _desc_toy(toy, monkeypatch)
    a, b = (torch.randn(2, 3, 40, 16, dtype=torch.float16) for _ in range(2))
    da, db = row_tiles(a, 16, 16), row_tiles(b, 16, 16)
    x = _x()
    fk[(1,)](x, 64, W=4, D=da, TMA=True)
    assert all(v is not da for v in fk.cache[next(iter(fk.cache))][4])   # not kept
    fk[(2,)](x, 80, W=4, D=db, TMA=True)
    assert fk.misses == 1 and fk.hits == 1
    launches = [e for e in log if e[0] == "launch"]
    assert launches[0][-1][3] is da and launches[1][-1][3] is db, launches
    assert launches[1][-1] == (x, 80, 4, db, True)
    fk[(1,)](x, 64, W=4, D=row_tiles(b, 32, 16), TMA=True)          # another block: new key
    assert fk.misses == 2


def test_keyword_tensors_are_keyed_by_class_and_not_kept(toy, monkeypatch):
    """The table's keys hold no tensor: a descriptor keyword's key is its dtype and block,
    not the descriptor (which holds its tensor: on a GPU the first call's k and v stayed
    alive for the table's life), and a plain tensor keyword (rel_attention's DS_SPAN) is
    keyed by its class, not its identity (each call was a new key, up to MAX_KEYS entries
    each holding its call's tensors)."""
    import gc
    import weakref
    from ctxfast.kernels._common import row_tiles
    fk, log = _desc_toy(toy, monkeypatch)
    x = _x()
    a = torch.randn(2, 3, 40, 16, dtype=torch.float16)
    gone = weakref.ref(a)
    fk[(1,)](x, 64, W=4, D=row_tiles(a, 16, 16), TMA=True)
    log.clear()
    del a
    gc.collect()
    assert gone() is None, "the launch table keeps the descriptor's tensor alive"
    for _ in range(3):                      # a new tensor each call: one compiled kernel
        t = torch.zeros(8, dtype=torch.int32)
        fk[(1,)](x, 64, W=4, D=t)
        assert log[-1][-1][3] is t          # this call's own tensor
    assert fk.misses == 2 and fk.hits == 2 and len(fk.cache) == 2
    fk[(1,)](x, 64, W=4, D=64)              # an int keyword: by its class, as Triton
    fk[(1,)](x, 64, W=4, D=80)
    assert fk.misses == 3 and fk.hits == 3 and log[-1][-1][3] == 80
    assert all(not isinstance(v, torch.Tensor)
               for key in fk.cache for part in key[1][1] for v in part)


def test_constexpr_passed_by_position_is_keyed_by_value(toy):
    fk, log = toy
    fk[(1,)](_x(), 64, 0.5, True, 4)
    fk[(1,)](_x(), 64, 0.5, True, 20)          # same int class, another constexpr value
    assert fk.misses == 2
    assert log[-1][-1][4] == 20


@pytest.mark.parametrize("which", ["launch_enter_hook", "launch_exit_hook"])
def test_a_launch_hook_keeps_tritons_path(toy, which):
    # Triton calls enter and exit hooks (a profiler's) with its launch metadata
    fk, log = toy
    fk[(1,)](_x(), 64, 0.5, True, W=4)
    hooks = getattr(triton.knobs.runtime, which)
    hook = lambda *a: None                      # noqa: E731
    hooks.add(hook)
    try:
        fk[(1,)](_x(), 64, 0.5, True, W=4)
    finally:
        hooks.remove(hook)
    assert fk.hits == 0 and [e[0] for e in log].count("jit") == 2
    fk[(1,)](_x(), 64, 0.5, True, W=4)          # the hook removed: the fast path again
    assert fk.hits == 1


def test_globals_and_grids_keep_tritons_path(toy, monkeypatch):
    fk, log = toy
    fk[(1,)](_x(), 64, 0.5, True, W=4)
    fk[lambda meta: (1,)](_x(), 64, 0.5, True, W=4)   # a callable grid
    assert fk.hits == 0
    monkeypatch.setitem(_toy_kernel.used_global_vals, ("G", 0), (1, {"G": 2}))
    fk[(1,)](_x(), 64, 0.5, True, W=4)
    assert fk.hits == 0
    monkeypatch.delitem(_toy_kernel.used_global_vals, ("G", 0))
    fk[(1,)](_x(), 64, 0.5, True, W=4)
    assert fk.hits == 1
    assert [e[0] for e in log].count("jit") == 3


def test_an_unhashable_argument_takes_tritons_path(toy):
    fk, log = toy
    fk[(1,)](_x(), 64, 0.5, True, W=4, EXTRA=[1])      # a list: no key can hold it
    assert fk.misses == 0 and fk.hits == 0
    assert [e[0] for e in log] == ["jit", "launch"]


def test_a_tensor_without_storage_takes_tritons_path(toy, monkeypatch):
    fk, log = toy
    monkeypatch.setattr(_launch, "args_key", KEY_FUNCTIONS["C"])
    with pytest.raises(ValueError, match="no storage"):
        _launch.args_key((torch.zeros(4).to_sparse(),))
    with pytest.raises(RuntimeError, match="data pointer"):     # Triton's binder's own error
        fk[(1,)](torch.zeros(32).to_sparse(), 64, 0.5, True, W=4)
    assert fk.misses == 0 and fk.hits == 0 and log == []


def test_a_launcher_that_refuses_the_arguments_turns_the_path_off(toy, monkeypatch):
    fk, log = toy
    fk[(1,)](_x(), 64, 0.5, True, W=4)                   # remembered
    kernel = fk.cache[next(iter(fk.cache))]

    def refuse(*a):
        raise TypeError("function takes exactly 13 arguments")
    fk.cache[next(iter(fk.cache))] = (kernel[0], refuse, *kernel[2:])
    with pytest.warns(RuntimeWarning, match="fast Triton launch path failed"):
        fk[(1,)](_x(), 64, 0.5, True, W=4)               # Triton's path instead
    assert _launch.LAUNCH == "jit" and fk.hits == 0
    assert [e[0] for e in log] == ["jit", "launch", "jit", "launch"]
    assert isinstance(_launch.fast(_toy_kernel), _launch.WithOptions)   # and from now on


def test_table_is_bounded(toy, monkeypatch):
    fk, _ = toy
    monkeypatch.setattr(_launch, "MAX_KEYS", 3)
    for w in range(5):
        fk[(1,)](_x(), 64, 0.5, True, W=w)
    assert len(fk.cache) <= 3 and fk.misses == 5


def test_off_under_the_interpreter_with_jit_and_for_non_kernels(monkeypatch):
    monkeypatch.setattr(_launch, "_interpreting", lambda: True)
    assert _launch.fast(_toy_kernel) is _toy_kernel
    monkeypatch.setattr(_launch, "_interpreting", lambda: False)
    monkeypatch.setattr(_launch, "LAUNCH", "jit")
    assert _launch.fast(_toy_kernel).fn is _toy_kernel
    monkeypatch.setattr(_launch, "LAUNCH", "fast")
    spy = object()
    assert _launch.fast(spy) is spy
    monkeypatch.setattr(_launch, "LAUNCH", "quick")
    with pytest.raises(ValueError, match="CTXFAST_TRITON_LAUNCH"):
        _launch.fast(_toy_kernel)


@pytest.mark.parametrize("path", ["fast", "jit"])
def test_every_launch_asks_for_fp_fusion(toy, path, monkeypatch):
    """Both launch paths pass ``enable_fp_fusion=True`` (Triton 3.10's default is off: the
    backward's exponents would lose their FMAs), and a call's own option wins."""
    _, log = toy
    monkeypatch.setattr(_launch, "LAUNCH", path)
    launcher = _launch.fast(_toy_kernel)
    assert isinstance(launcher, _launch.FastKernel if path == "fast" else _launch.WithOptions)
    launcher[(1,)](_x(), 64, 0.5, True, W=4)
    launcher[(1,)](_x(), 64, 0.5, True, W=4, enable_fp_fusion=False)
    options = [e[1][1] for e in log if e[0] == "jit"]
    assert len(options) == 2
    assert "('enable_fp_fusion', True)" in options[0], options[0]
    assert "('enable_fp_fusion', False)" in options[1], options[1]


def test_every_launch_site_goes_through_fast():
    """A launch written as ``kernel[grid](...)`` would skip the fast path unseen."""
    import pathlib
    import re
    root = pathlib.Path(_launch.__file__).resolve().parent
    bare = []
    for path in sorted(root.glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(?<![\w(])_\w+_kernel\[", line):
                bare.append(f"{path.name}:{n}: {line.strip()}")
    assert not bare, "launches not wrapped in fast(...):\n" + "\n".join(bare)


if __name__ == "__main__":
    _check_real_launches()
