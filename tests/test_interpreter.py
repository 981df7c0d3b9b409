"""What ctxfast adds to Triton's interpreter (``kernels/_interpreter.py``): the two skips of
work that changes no result (integer overflow checks that assert nothing; the language
patched again on every helper call) and the bulk-reduction shim. The suite runs through
them everywhere under the interpreter; these tests check that they are installed, that they
skip what they say and nothing more, and that a launch that fails leaves nothing behind."""
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
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


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
