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


def test_smoke_passes():
    r = _run("smoke")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "smoke: all ok" in r.stdout
    assert "rel_shift        cpu     cpu   ok" in r.stdout
    assert "attention        eager   cpu   ok" in r.stdout


def test_unknown_arguments_fail():
    r = _run("info", "--bogus")
    assert r.returncode != 0 and "unrecognized arguments" in r.stderr
