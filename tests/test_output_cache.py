"""The CPU kernels' cache of freed output buffers (csrc/cpu/output_cache.h): a freed output
of at least 256 KiB waits for the next output of the same size instead of going back to
the system (whose fresh pages cost a page fault each on first touch); the cap
(CTXFAST_CPU_CACHE_MB, read once per process) bounds what waits, 0 turns it off, and
torch.ops.ctxfast.cpu_cache_release() frees it. Values are checked by every kernel test,
which all run on cached buffers; here: reuse, lifetime, the cap, the switch, the setting's
check."""
import gc
import os
import subprocess
import sys

import pytest
import torch

import ctxfast

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.ctxfast, "cpu_cache_release"),
                                reason="ctxfast._C was built without the output cache")

CACHE_ON = os.environ.get("CTXFAST_CPU_CACHE_MB", "256") != "0"


@pytest.fixture(autouse=True)
def _no_collection():
    """The counts below are exact: no garbage collection frees a block in between."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def _big():  # out [2, 8, 128, 64] fp32: 512 KiB, cached
    return torch.randn(2, 8, 128, 64)


@pytest.mark.skipif(not CACHE_ON, reason="CTXFAST_CPU_CACHE_MB=0 in this process")
def test_freed_output_is_reused_and_released():
    torch.ops.ctxfast.cpu_cache_release()
    q = _big()
    out = ctxfast.attention(q, q, q, causal=True, backend="cpu")
    ptr, nbytes = out.data_ptr(), out.untyped_storage().nbytes()
    assert torch.ops.ctxfast.cpu_cache_held() == 0
    del out
    assert torch.ops.ctxfast.cpu_cache_held() == nbytes
    again = ctxfast.attention(q, q, q, causal=True, backend="cpu")
    assert again.data_ptr() == ptr and torch.ops.ctxfast.cpu_cache_held() == 0
    torch.testing.assert_close(again, ctxfast.attention(q, q, q, causal=True, backend="eager"))
    del again
    assert torch.ops.ctxfast.cpu_cache_release() == nbytes
    assert torch.ops.ctxfast.cpu_cache_held() == 0


@pytest.mark.skipif(not CACHE_ON, reason="CTXFAST_CPU_CACHE_MB=0 in this process")
def test_block_waits_until_its_storage_dies():
    """A view (or .grad, or a saved tensor) keeps the block in use: it is reused only after
    the last tensor on its storage is freed, never while its values can still be read."""
    torch.ops.ctxfast.cpu_cache_release()
    q, k, v = (_big().requires_grad_() for _ in range(3))
    r, u, w = torch.randn(8, 128, 64), torch.randn(8, 64), torch.randn(8, 64)
    out = ctxfast.rel_attention(q, k, v, r.requires_grad_(), u.requires_grad_(),
                                w.requires_grad_(), causal=True, backend="cpu")
    out.sum().backward()
    view = q.grad[:, :1]
    expect = view.clone()
    q.grad = None
    held = torch.ops.ctxfast.cpu_cache_held()
    other = ctxfast.attention(q.detach(), k.detach(), v.detach(), backend="cpu")  # same size
    assert other.data_ptr() != view.data_ptr()
    torch.testing.assert_close(view, expect, rtol=0, atol=0)
    del other
    base_bytes = view.untyped_storage().nbytes()
    del view
    assert torch.ops.ctxfast.cpu_cache_held() >= held + base_bytes
    torch.ops.ctxfast.cpu_cache_release()


@pytest.mark.skipif(not CACHE_ON, reason="CTXFAST_CPU_CACHE_MB=0 in this process")
def test_storage_of_a_cached_output_resizes():
    q = _big()
    out = ctxfast.attention(q, q, q, backend="cpu")
    expect = out.flatten()[:10].clone()
    storage = out.untyped_storage()
    storage.resize_(storage.nbytes() * 2)    # through the cache's allocator
    assert storage.nbytes() == 2 * q.numel() * 4
    torch.testing.assert_close(torch.tensor([], dtype=torch.float32).set_(storage)[:10], expect,
                               rtol=0, atol=0)
    storage.resize_(40)                      # small: the default allocator's block
    assert storage.nbytes() == 40


def _run(code, **env):
    """Runs `code` in a fresh process (the setting is read once per process) after the
    imports and q [2, 8, 128, 64] (a 512 KiB output, seeded: the same inputs every run);
    returns the exit code and the output."""
    code = ("import torch, ctxfast\ntorch.manual_seed(0)\nq = torch.randn(2, 8, 128, 64)\n"
            + code)
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                         capture_output=True, text=True, timeout=300)
    return run.returncode, run.stdout + run.stderr[-3000:]


def test_cap_bounds_what_waits():
    """With a 1 MiB cap, freeing six 512 KiB outputs keeps at most two of them."""
    code = ("outs = [ctxfast.attention(q, q, q, backend='cpu') for _ in range(6)]\n"
            "del outs\n"
            "print('held', torch.ops.ctxfast.cpu_cache_held())\n")
    rc, out = _run(code, CTXFAST_CPU_CACHE_MB="1")
    assert rc == 0 and "held 1048576" in out, out


def test_zero_turns_the_cache_off():
    code = ("out = ctxfast.attention(q, q, q, backend='cpu')\n"
            "ok = torch.allclose(out, ctxfast.attention(q, q, q, backend='eager'), atol=1e-5)\n"
            "del out\n"
            "print('held', torch.ops.ctxfast.cpu_cache_held(), ok)\n")
    rc, out = _run(code, CTXFAST_CPU_CACHE_MB="0")
    assert rc == 0 and "held 0 True" in out, out


def test_setting_is_checked_before_any_kernel():
    code = ("try:\n"
            "    ctxfast.attention(q, q, q, backend='cpu')\n"
            "except ValueError as e:\n"
            "    assert 'CTXFAST_CPU_CACHE_MB' in str(e) and 'lots' in str(e), str(e)\n"
            "    print('refused')\n")
    rc, out = _run(code, CTXFAST_CPU_CACHE_MB="lots")
    assert rc == 0 and "refused" in out, out
