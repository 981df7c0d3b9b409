"""What ctxfast adds to Triton's interpreter (``kernels/_interpreter.py``): the two skips of
work that changes no result (integer overflow checks that assert nothing; the language
patched again on every helper call), types built once per shape instead of per value,
bfloat16 conversions rounded as a GPU rounds them, and the bulk-reduction shim. The suite
runs through them everywhere under the interpreter; these tests check that they are
installed, that they skip what they say and nothing more (the types built once are Triton's
own, field by field), and that a launch that fails leaves nothing behind."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl

from ctxfast.kernels import _interpreter, _launch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton's interpreter only (TRITON_INTERPRET=1)")


@triton.jit
def _scaled_row(x_ptr, row, n, W: tl.constexpr):
    offs = tl.arange(0, W)
    x = tl.load(x_ptr + row * n + offs, mask=offs < n, other=float("-inf"))
    return x - tl.max(x, axis=0)             # tl.max: a helper of Triton's own (tl.core)


@triton.jit
def _rows_kernel(x_ptr, y_ptr, n, ROWS: tl.constexpr, W: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, W)
    for i in tl.static_range(ROWS):           # ROWS calls of the helper in one program
        row = pid * ROWS + i
        tl.store(y_ptr + row * n + offs, _scaled_row(x_ptr, row, n, W), mask=offs < n)


@triton.jit
def _refuses_kernel(x_ptr):
    tl.static_assert(False, "refused on purpose")


def _run_rows(rows_per_program: int, programs: int = 2, n: int = 13):
    x = torch.randn(programs * rows_per_program, n)
    y = torch.empty_like(x)
    _launch.fast(_rows_kernel)[(programs,)](x, y, n, ROWS=rows_per_program, W=16)
    torch.testing.assert_close(y, x - x.amax(dim=1, keepdim=True), rtol=0, atol=0)


def _count_language_walks(monkeypatch):
    """The number of times the interpreter walks a module's builtins to patch them (one
    ``_patch_builtin`` call per module) from now on."""
    from triton.runtime import interpreter
    calls = []
    walk = interpreter._patch_builtin

    def counted(*args, **kwargs):
        calls.append(args[0])
        return walk(*args, **kwargs)
    monkeypatch.setattr(interpreter, "_patch_builtin", counted)
    return calls


def test_installed_by_the_first_launch():
    from triton.runtime import interpreter
    _run_rows(1)
    assert _interpreter.skip_dead_work() is True
    assert getattr(interpreter._patch_lang, "_ctxfast", False)
    options = interpreter.interpreter_builder.options
    # the checks would feed device_assert, a no-op without debug: only then are they skipped
    assert options.debug is False and options.sanitize_overflow is False
    assert getattr(tl.core.block_type.__init__, "_ctxfast", False)      # reuse_types


def test_helpers_do_not_walk_the_language_again(monkeypatch):
    # The kernel calls its helper ROWS times per program, and the helper calls tl.max
    # (Triton's own helper, in tl.core, which the kernel's module does not name): the
    # walks per launch must not grow with the calls, and the results stay exact.
    _run_rows(1)
    walks = _count_language_walks(monkeypatch)
    counts = []
    for rows in (1, 6):
        walks.clear()
        _run_rows(rows)
        counts.append(len(walks))
    assert counts[0] == counts[1] and counts[0] > 0, counts


def _in_a_fresh_process(code: str, path=None) -> None:
    """Runs `code` (which prints "ok" at its end) in a fresh interpreter-mode process, with
    `path` (a folder of helper modules) put before PYTHONPATH: Triton never restores a
    helper's patch, so what a first launch patches shows only in a new process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(path), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_a_helper_that_reaches_an_unpatched_module_patches_it():
    # tl.ravel is Triton's own helper (standard.py, whose globals name tl.core only): its
    # core.reshape is a builtin the kernel's own patch (of tl) does not wrap. Triton never
    # restores a helper's patch, so only a fresh process shows that it is still made.
    code = textwrap.dedent("""
        import torch, triton, triton.language as tl
        from ctxfast.kernels import _launch

        @triton.jit
        def _flat(x_ptr, y_ptr, W: tl.constexpr):
            offs = tl.arange(0, W)[:, None] * W + tl.arange(0, W)[None, :]
            tl.store(y_ptr + tl.arange(0, W * W), tl.ravel(tl.load(x_ptr + offs)) * 2)

        x = torch.randn(4, 4)
        y = torch.empty(16)
        _launch.fast(_flat)[(1,)](x, y, W=4)
        assert torch.equal(y, x.reshape(-1) * 2), (x, y)
        print("ok")
    """)
    _in_a_fresh_process(code)


def test_a_helper_naming_a_patched_and_an_unpatched_module_patches_it(tmp_path):
    # A helper whose module names both tl (which the kernel's launch patched) and tl.core
    # (which it did not): only a helper whose modules were all patched may skip the patch.
    # In a fresh process (Triton never restores a helper's patch).
    (tmp_path / "_two_langs.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl
        import triton.language.core as core

        @triton.jit
        def flat_doubled(x, W: tl.constexpr):
            return core.reshape(x, [W * W]) * 2
    """))
    code = textwrap.dedent("""
        import torch, triton, triton.language as tl
        from ctxfast.kernels import _launch
        from _two_langs import flat_doubled

        @triton.jit
        def _flat(x_ptr, y_ptr, W: tl.constexpr):
            offs = tl.arange(0, W)[:, None] * W + tl.arange(0, W)[None, :]
            tl.store(y_ptr + tl.arange(0, W * W), flat_doubled(tl.load(x_ptr + offs), W))

        x = torch.randn(4, 4)
        y = torch.empty(16)
        _launch.fast(_flat)[(1,)](x, y, W=4)
        assert torch.equal(y, x.reshape(-1) * 2), (x, y)
        print("ok")
    """)
    _in_a_fresh_process(code, tmp_path)


def test_a_module_that_names_a_language_module_later_is_seen_again(tmp_path):
    # The language modules a helper's globals name are kept per module while its globals
    # stay as they were: a module that binds tl.core after a first launch (a lazy import)
    # is read again, and its helper that calls core's builtins patches them.
    (tmp_path / "_late_core.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def doubled(x, W: tl.constexpr):
            return tl.reshape(x, [W * W]) * 2

        @triton.jit
        def doubled_core(x, W: tl.constexpr):
            return core.reshape(x, [W * W]) * 2     # noqa: F821 (bound by bind_core)

        def bind_core():
            global core
            import triton.language.core as core
    """))
    code = textwrap.dedent("""
        import torch, triton, triton.language as tl
        from ctxfast.kernels import _launch
        import _late_core

        @triton.jit
        def _flat(x_ptr, y_ptr, W: tl.constexpr):
            offs = tl.arange(0, W)[:, None] * W + tl.arange(0, W)[None, :]
            tl.store(y_ptr + tl.arange(0, W * W), _late_core.doubled(tl.load(x_ptr + offs), W))

        @triton.jit
        def _flat_core(x_ptr, y_ptr, W: tl.constexpr):
            offs = tl.arange(0, W)[:, None] * W + tl.arange(0, W)[None, :]
            tl.store(y_ptr + tl.arange(0, W * W),
                     _late_core.doubled_core(tl.load(x_ptr + offs), W))

        x = torch.randn(4, 4)
        for kernel in (_flat, _flat_core):
            if kernel is _flat_core:
                _late_core.bind_core()
            y = torch.empty(16)
            _launch.fast(kernel)[(1,)](x, y, W=4)
            assert torch.equal(y, x.reshape(-1) * 2), (kernel, x, y)
        print("ok")
    """)
    _in_a_fresh_process(code, tmp_path)


def test_the_language_is_restored_after_each_launch():
    _run_rows(2)
    assert tl.core.is_builtin(tl.arange) and tl.core.is_builtin(tl.load)
    assert tl.core.is_builtin(tl.tensor.__add__)


def test_a_launch_that_fails_leaves_the_next_one_whole(monkeypatch):
    _run_rows(1)
    with pytest.raises(Exception, match="refused on purpose"):
        _launch.fast(_refuses_kernel)[(1,)](torch.zeros(1))
    assert tl.core.is_builtin(tl.arange)
    walks = _count_language_walks(monkeypatch)
    _run_rows(3)                 # patched afresh: the failed launch's modules are not kept
    assert walks


def test_overflow_checks_were_dead_before_they_were_skipped():
    # What makes the skip safe: the check ends in device_assert, which builds nothing
    # without the interpreter's debug option (never set in Triton 3.6-3.9).
    from triton.runtime import interpreter
    semantic = interpreter.TritonSemantic(interpreter.interpreter_builder)
    assert semantic.builder.options.debug is False
    cond = tl.tensor(interpreter.TensorHandle(torch.zeros(1, dtype=torch.bool).numpy(),
                                              tl.int1), tl.int1)
    assert semantic.device_assert(cond, "would fail", None) is None


@triton.jit
def _bf16_casts_kernel(x_ptr, flag_ptr, int_ptr, half_ptr, out_ptr, N: tl.constexpr):
    # out rows: fp32 -> bf16 (RNE), bool -> bf16, int32 -> bf16, fp16 -> bf16,
    # fp32 -> bf16 with rounding "rtne" and "rtz", bf16 -> int32 / fp32 / fp16 (as fp32)
    o = tl.arange(0, N)
    x = tl.load(x_ptr + o)
    b = x.to(tl.bfloat16)
    tl.store(out_ptr + o, b.to(tl.float32))
    tl.store(out_ptr + N + o, tl.load(flag_ptr + o).to(tl.bfloat16).to(tl.float32))
    tl.store(out_ptr + 2 * N + o, tl.load(int_ptr + o).to(tl.bfloat16).to(tl.float32))
    tl.store(out_ptr + 3 * N + o, tl.load(half_ptr + o).to(tl.bfloat16).to(tl.float32))
    tl.store(out_ptr + 4 * N + o,
             x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32))
    tl.store(out_ptr + 5 * N + o,
             x.to(tl.bfloat16, fp_downcast_rounding="rtz").to(tl.float32))
    tl.store(out_ptr + 6 * N + o, b.to(tl.int32).to(tl.float32))
    tl.store(out_ptr + 7 * N + o, b.to(tl.float16).to(tl.float32))


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_bf16_conversions_round_as_a_gpu_does():
    # torch's conversions round to nearest even (cvt.rn.bf16.f32 on a GPU); "rtz" truncates.
    # Triton's interpreter truncated every float32 -> bf16 and turned bool / int -> bf16
    # into bit patterns (True -> 9.2e-41).
    n = 256
    x = torch.randn(n) * torch.logspace(-3, 3, n)
    # ties in bf16 (the low 16 bits 0x8000: even and odd kept mantissas), overflow to inf,
    # inf, NaN
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF], dtype=torch.int32)
    x[:3] = ties.view(torch.float32)
    x[3:6] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    flags = torch.rand(n) > 0.5
    ints = torch.randint(-300000, 300000, (n,), dtype=torch.int32)
    half = torch.randn(n).half()
    out = torch.empty(8, n)
    _launch.fast(_bf16_casts_kernel)[(1,)](x, flags, ints, half, out, N=n)
    rne = x.bfloat16().float()
    rtz = (x.view(torch.int32) & -65536).view(torch.float32)
    for row, want in ((0, rne), (1, flags.bfloat16().float()), (2, ints.bfloat16().float()),
                      (3, half.bfloat16().float()), (4, rne), (5, rtz)):
        torch.testing.assert_close(out[row], want, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, row=row: f"row {row}: {m}")
    finite = slice(6, None)
    torch.testing.assert_close(out[6, finite], rne[finite].int().float(), rtol=0, atol=0)
    torch.testing.assert_close(out[7, finite], rne[finite].half().float(), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_bf16_conversion_keeps_every_nan_a_nan():
    # NaNs whose payload lies in the low 16 bits only (signalling NaNs, 0x7F800001): their
    # top 16 bits alone are an infinity, so the conversion must set a mantissa bit, as torch
    # and a GPU do (quiet NaN); truncated or rounded as a number they would come back inf.
    n = 16
    bits = torch.tensor([0x7F800001, -0x007FFFFF, 0x7F80FFFF, -0x007F0001, 0x7FC00000,
                         0x7FBFFFFF], dtype=torch.int32)           # 0xFF800001, 0xFF80FFFF
    x = torch.randn(n)
    x[:len(bits)] = bits.view(torch.float32)
    assert torch.isnan(x[:len(bits)]).all()
    out = torch.empty(8, n)
    _launch.fast(_bf16_casts_kernel)[(1,)](x, torch.rand(n) > 0.5,
                                            torch.randint(-9, 9, (n,), dtype=torch.int32),
                                            torch.randn(n).half(), out, N=n)
    for row in (0, 4):                           # x.to(bf16), and with rounding "rtne"
        got = out[row, :len(bits)]
        assert torch.isnan(got).all(), f"row {row}: NaNs converted to {got.tolist()}"
        torch.testing.assert_close(out[row], x.bfloat16().float(), rtol=0, atol=0,
                                   equal_nan=True, msg=lambda m, row=row: f"row {row}: {m}")


def _fields(value) -> dict:
    """A Triton type's or tensor's fields, with its tuples and constexprs as plain values."""
    def plain(v):
        if isinstance(v, tl.core.tuple):
            return ("tuple", [plain(x) for x in v.values], str(v.type))
        if isinstance(v, tl.constexpr):
            return ("constexpr", v.value)
        return v
    return {k: plain(v) for k, v in vars(value).items()}


def _tritons_own(cls, *args):
    """An instance of ``cls`` built by Triton's own constructor, which reuse_types keeps."""
    value = cls.__new__(cls)
    cls.__init__.triton(value, *args)
    return value


_SHAPES = ([4], [2, 8], [16, 1, 4], [tl.constexpr(8), 2], tl.core.tuple([1, 32]))


@pytest.mark.parametrize("element", ["float32", "bfloat16", "int1", "pointer"])
def test_reused_types_are_tritons_own(element):
    # Built twice (the first builds and keeps, the second reuses) and compared field by
    # field with Triton's own; every one has a shape tuple (and list) of its own.
    assert _interpreter.reuse_types() is True
    elem = tl.pointer_type(tl.float16) if element == "pointer" else getattr(tl, element)
    for shape in _SHAPES:
        want = _tritons_own(tl.block_type, elem, shape)
        types = [tl.block_type(elem, shape) for _ in range(3)]
        for got in types:
            assert _fields(got) == _fields(want) and got.element_ty is elem, (shape, got)
        want_t = _tritons_own(tl.tensor, "handle", want)
        tensors = [tl.tensor("handle", ty) for ty in types]
        for got in tensors:
            assert _fields(got) == {**_fields(want_t), "type": got.type}, (shape, got)
        for made in (types, tensors):               # each a shape tuple and list of its own
            assert len({id(x.shape) for x in made}) == 3, shape
            assert len({id(x.shape.values) for x in made}) == 3, shape
    want_s = _tritons_own(tl.tensor, "handle", elem)
    scalars = [tl.tensor("handle", elem) for _ in range(3)]       # scalars: kept the same way
    for got in scalars:
        assert _fields(got) == _fields(want_s) and type(got.shape.values) is list, got
    assert len({id(x.shape) for x in scalars}) == len({id(x.shape.values) for x in scalars}) == 3


def test_shapes_triton_refuses_are_still_refused():
    assert _interpreter.reuse_types() is True
    for _ in range(2):
        with pytest.raises(ValueError, match="power of 2"):
            tl.block_type(tl.float32, [3])
        with pytest.raises(TypeError, match="0d block_type"):
            tl.block_type(tl.float32, [])
        tl.block_type(tl.float32, [2, 4])
        with pytest.raises(AssertionError):      # a Python tuple: Triton asserts a list
            tl.block_type(tl.float32, (2, 4))


def test_unwrap_and_numpy_dtypes_are_tritons_own():
    from triton.runtime import interpreter
    assert _interpreter.reuse_types() is True
    unwrap = tl.core._unwrap_if_constexpr
    t = tl.tensor("handle", tl.float32)
    for value in (tl.constexpr(3), tl.constexpr(2.5), 7, t, [tl.constexpr(1), 2], 1.5, None,
                  (tl.constexpr(4), 5)):
        got, want = unwrap(value), unwrap.triton(value)
        assert (type(got), repr(got)) == (type(want), repr(want)), (value, got, want)
    types = [getattr(tl, n) for n in ("int1", "int8", "int16", "int32", "int64", "uint8",
                                      "uint16", "uint32", "uint64", "float16", "bfloat16",
                                      "float32", "float64")]
    types += [tl.pointer_type(tl.float32), tl.block_type(tl.bfloat16, [4, 2]),
              tl.block_type(tl.pointer_type(tl.int8), [8])]
    for ty in types + types:
        assert interpreter._get_np_dtype(ty) == interpreter._get_np_dtype.triton(ty), ty


@triton.jit
def _broadcasts_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr):
    rows, cols = tl.arange(0, M), tl.arange(0, N)
    a = tl.load(a_ptr + rows)
    b = tl.load(b_ptr + cols)
    outer = a[:, None] * b[None, :] + 1.5          # [M, 1] x [1, N], then a scalar
    same = outer - outer * 0.25                     # two operands of one shape
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], same + a[:, None])


def test_broadcasts_of_every_kind_are_exact():
    assert _interpreter.reuse_types() is True
    a, b = torch.randn(8), torch.randn(16)
    out = torch.empty(8, 16)
    _launch.fast(_broadcasts_kernel)[(1,)](a, b, out, M=8, N=16)
    outer = a[:, None] * b[None, :] + 1.5
    torch.testing.assert_close(out, outer - outer * 0.25 + a[:, None], rtol=0, atol=0)


def test_a_second_launch_builds_no_block_type_anew(monkeypatch):
    # Triton's own constructor validates every shape (validate_block_shape); with the types
    # reused, a launch whose shapes were all seen before validates none.
    _run_rows(2)
    calls = []
    validate = tl.core.validate_block_shape
    monkeypatch.setattr(tl.core, "validate_block_shape",
                        lambda shape: calls.append(shape) or validate(shape))
    _run_rows(2)
    assert calls == []


def test_reuse_types_leaves_a_triton_it_does_not_know_alone():
    # A block type whose constructor sets a field this was not written for: not installed.
    code = textwrap.dedent("""
        import triton.language.core as core
        from ctxfast.kernels import _interpreter
        own = core.block_type.__init__
        def init(self, *args):
            own(self, *args)
            self.layout = None
        core.block_type.__init__ = init
        assert _interpreter.reuse_types() is False
        assert core.block_type.__init__ is init and core.tensor.__init__.__module__ != \\
            _interpreter.__name__
        print("ok")
    """)
    _in_a_fresh_process(code)


# --- the type checks and broadcasts of a binary operation, against Triton's own ---------

_ELEMENTS = ("int1", "int8", "int32", "int64", "uint8", "uint32", "float16", "bfloat16",
             "float32", "float64", "float8e5", "pointer<fp32>", "pointer<fp16>")
# (lhs shape, rhs shape); None: a scalar tensor, int / float: a Python number
_OPERAND_SHAPES = (((4, 8), (4, 8)), ((4, 1), (1, 8)), ((1, 8), (4, 8)), ((2, 1, 4), (2, 8, 1)),
                   ((4, 8), None), (None, (8,)), (None, None), ((8,), (4, 8)), ((4,), (8,)),
                   ((4, 8), 3), (2.5, (8,)), (None, -1))
# (allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
_FLAGS = ((False, False, True, False), (False, False, True, True), (True, False, True, False),
          (False, True, True, False), (False, False, False, False), (True, True, False, True))


def _element(name):
    return (tl.pointer_type(getattr(tl, {"fp32": "float32", "fp16": "float16"}[name[8:-1]]))
            if name.startswith("pointer") else getattr(tl, name))


def _operand(element, shape, rng):
    """A tensor of ``element`` (a block of ``shape``; a scalar for None) holding random
    values, or ``shape`` itself where it is a Python number."""
    from triton.runtime import interpreter
    if isinstance(shape, (int, float)):
        return shape
    np_type = interpreter._get_np_dtype(element)
    data = rng.integers(1, 100, size=shape or (1,)).astype(np_type)
    handle = interpreter.TensorHandle(data, element)
    return tl.tensor(handle, tl.block_type(element, list(shape)) if shape else element)


def _outcome(check, sem, lhs, rhs, flags):
    """What ``check`` returns (types, handle data, whether each operand came back as it
    was), or the error it raises."""
    try:
        results = check(sem, lhs, rhs, *flags)
    except Exception as err:                   # noqa: BLE001 (compared with Triton's own)
        return ("raises", type(err).__name__, str(err))
    return [(_fields(r.type) if r.type.is_block() else str(r.type), str(r.handle.dtype),
             r.handle.data.shape, r.handle.data.dtype, r.handle.data.tobytes(), r is op)
            for r, op in zip(results, (lhs, rhs))]


@pytest.mark.parametrize("lhs_element", _ELEMENTS)
def test_binary_type_checks_and_broadcasts_are_tritons_own(lhs_element, monkeypatch):
    # Every pair of element types, shapes (equal, broadcast on either side, another rank,
    # incompatible, scalars, Python numbers) and flags, checked by ctxfast's fast paths and
    # by Triton's own: the same types, the same data, the same operands returned as they
    # were, the same errors.
    import numpy as np
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter
    assert _interpreter.reuse_types() is True
    sem = TritonSemantic(interpreter.interpreter_builder)
    check, broadcast = (TritonSemantic.binary_op_type_checking_impl,
                        TritonSemantic.broadcast_impl_value)
    rng = np.random.default_rng(0)
    compared = 0
    for rhs_element in _ELEMENTS:
        for lhs_shape, rhs_shape in _OPERAND_SHAPES:
            lhs = _operand(_element(lhs_element), lhs_shape, rng)
            rhs = _operand(_element(rhs_element), rhs_shape, rng)
            for flags in _FLAGS:
                got = _outcome(check, sem, lhs, rhs, flags)
                with monkeypatch.context() as own:
                    own.setattr(TritonSemantic, "broadcast_impl_value", broadcast.triton)
                    want = _outcome(check.triton, sem, lhs, rhs, flags)
                assert got == want, (lhs_element, rhs_element, lhs_shape, rhs_shape, flags,
                                     got, want)
                compared += 1
    assert compared == len(_ELEMENTS) * len(_OPERAND_SHAPES) * len(_FLAGS)


def test_binary_operands_of_one_type_skip_the_promotion_rules(monkeypatch):
    # fp32 with fp32 (and bf16 with bf16, but for a division) needs no promotion and no
    # cast; bf16 divided promotes to fp32 as Triton says, and mixed types take Triton's path.
    from triton.language.semantic import TritonSemantic
    assert _interpreter.reuse_types() is True
    calls = []
    promote = TritonSemantic.computation_type_impl
    monkeypatch.setattr(TritonSemantic, "computation_type_impl",
                        lambda self, *args: calls.append(args[0].name) or promote(self, *args))
    # Triton's broadcast reads the shapes of two blocks through get_block_shapes
    shapes_read = []
    own_shapes = tl.block_type.get_block_shapes
    monkeypatch.setattr(tl.block_type, "get_block_shapes",
                        lambda self: shapes_read.append(self) or own_shapes(self))
    a, b = torch.randn(8), torch.randn(16)
    out = torch.empty(8, 16)
    _launch.fast(_broadcasts_kernel)[(1,)](a, b, out, M=8, N=16)
    assert "fp32" in calls                      # its Python floats (1.5, 0.25) are promoted
    assert shapes_read == []                    # every broadcast of it taken on ints
    calls.clear()
    x, y = torch.randn(32).bfloat16(), torch.randn(32).bfloat16()
    out = torch.empty(3, 32)
    _launch.fast(_bf16_ops_kernel)[(1,)](x, y, out, N=32)
    assert calls == ["bf16"]                    # the division alone
    # (the interpreter's bf16 products and sums are wrong: module docstring; its quotient
    # is taken in fp32)
    torch.testing.assert_close(out[1], x.float() / y.float(), rtol=0, atol=0)


@triton.jit
def _bf16_ops_kernel(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x, y = tl.load(x_ptr + offs), tl.load(y_ptr + offs)
    tl.store(out_ptr + offs, (x * y).to(tl.float32))
    tl.store(out_ptr + N + offs, (x / y).to(tl.float32))
    tl.store(out_ptr + 2 * N + offs, ((x + y) - x).to(tl.float32))
