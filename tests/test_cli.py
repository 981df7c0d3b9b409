"""`ctxfast info` and `ctxfast smoke` (the main job's first steps)."""
import os
import subprocess
import sys

import ctxfast


def _run(*args):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "ctxfast.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_info_lists_versions_extensions_and_backends():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"ctxfast {ctxfast.__version__}" in out
    assert "torch" in out and "ctxfast._C     built" in out
    assert "ctxfast._cuda" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("rel_shift")]
    assert [r[1] for r in rows] == list(ctxfast.BACKENDS)
    cpu_row = next(r for r in rows if r[1] == "cpu")
    assert cpu_row[2] == "yes*"  # the default on CPU tensors


def test_info_into_a_closed_pipe_ends_quietly():
    """`ctxfast info | head -3`: the reader goes away before the output is written; no
    BrokenPipeError traceback (the read end is closed before the child writes anything)."""
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "ctxfast.cli", "info"], stdout=w,
                            stderr=subprocess.PIPE, text=True)
    os.close(w)
    os.close(r)
    _, err = proc.communicate(timeout=300)
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
    assert proc.returncode == 0, err


def test_smoke_passes():
    r = _run("smoke")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "smoke: all ok" in r.stdout
    assert "rel_shift        cpu     cpu   ok" in r.stdout
    assert "attention        eager   cpu   ok" in r.stdout


def test_unknown_arguments_fail():
    r = _run("info", "--bogus")
    assert r.returncode != 0 and "unrecognized arguments" in r.stderr
