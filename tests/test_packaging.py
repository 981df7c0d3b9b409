"""What a user installing ctxfast meets: an sdist that carries every source it builds
from, setup.py's CUDA decision, and the cpu backend's refusal when ctxfast._C is missing."""
import ast
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _git_files():
    """The files git tracks, and the untracked ones it does not ignore (this tree)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the files an sdist must carry are git's)")
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (ROOT / f).is_file()]


def test_sdist_carries_every_source_it_builds_from(tmp_path):
    # Without MANIFEST.in the sdist held only the .cpp / .cu setup.py compiles (the CUDA
    # ones only where CUDA is built): no header, so building it failed at the first
    # #include "bindings/..." (and could never build ctxfast._cuda)
    src = tmp_path / "src"
    files = _git_files()
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    env = dict(os.environ, CTXFAST_SKIP_CUDA_BUILD="1")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                   cwd=src, env=env, check=True, capture_output=True, timeout=300)
    (sdist,) = (tmp_path / "dist").glob("ctxfast-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    want = [f for f in files if f.startswith(("csrc/", "kernels/", "ctxfast/"))
            and f.endswith((".h", ".cuh", ".cpp", ".cu", ".py"))]
    want += ["setup.py", "pyproject.toml", "Makefile", "README.md", "tests/utils.py"]
    missing = sorted(set(want) - names)
    assert not missing, f"the sdist lacks {missing[:10]} ({len(missing)} files)"


def _setup_functions(names, namespace):
    """The functions `names` of setup.py, defined in `namespace` (setup.py itself calls
    setup() when run, so it is not imported)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {f.name for f in funcs} == set(names)
    exec(compile(ast.Module(body=funcs, type_ignores=[]), "setup.py", "exec"), namespace)
    return namespace


def _decision(tmp_path, release, torch_cuda, skip=None, monkeypatch=None):
    import re
    import types
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir(exist_ok=True)
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    torch = types.SimpleNamespace(version=types.SimpleNamespace(cuda=torch_cuda),
                                  __version__="2.x")
    cpp_extension = types.SimpleNamespace(CUDA_HOME=str(tmp_path))
    ns = dict(os=os, re=re, shutil=shutil, subprocess=subprocess, torch=torch,
              cpp_extension=cpp_extension)
    _setup_functions(["_nvcc_major", "_cuda_decision"], ns)
    if skip is None:
        monkeypatch.delenv("CTXFAST_SKIP_CUDA_BUILD", raising=False)
    else:
        monkeypatch.setenv("CTXFAST_SKIP_CUDA_BUILD", skip)
    return ns["_cuda_decision"]()


def test_cuda_decision_skips_a_toolkit_of_another_major_version(tmp_path, monkeypatch):
    # torch's build refuses it before building anything, ctxfast._C included: the install
    # failed whole; now ctxfast._cuda is skipped, saying why
    build, why = _decision(tmp_path, "12.8", "13.0", monkeypatch=monkeypatch)
    assert not build and "CUDA 12.x" in why and "13.0" in why
    assert _decision(tmp_path, "13.0", "13.0", monkeypatch=monkeypatch)[0]


@pytest.mark.parametrize("value, skips", [("1", True), ("yes", True), ("0", False),
                                          ("false", False), ("", False), ("off", False)])
def test_skip_cuda_build_reads_false_as_false(tmp_path, monkeypatch, value, skips):
    build, why = _decision(tmp_path, "13.0", "13.0", skip=value, monkeypatch=monkeypatch)
    assert build is not skips and (("is set" in why) is skips)


@pytest.mark.parametrize("op", ["attention", "rel_attention", "lstm"])
def test_cpu_backend_without_the_extension_says_why(op):
    # with ctxfast._C failing to import, backend="cpu" said "not implemented for this op"
    # for attention and rel_attention (cpu was dropped from their backends); it names the
    # import failure now, as lstm, linear and rel_shift do
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "ctxfast._C":
            raise ImportError("hidden by the test")
sys.meta_path.insert(0, Block())
import torch, ctxfast
from ctxfast import BackendUnavailable
x = torch.randn(1, 1, 4, 8)
calls = dict(
    attention=lambda: ctxfast.attention(x, x, x, backend="cpu"),
    rel_attention=lambda: ctxfast.rel_attention(x, x, x, torch.randn(1, 4, 8),
                                                torch.randn(1, 8), torch.randn(1, 8),
                                                backend="cpu"),
    lstm=lambda: ctxfast.lstm(torch.randn(3, 2, 4), None, torch.randn(8, 4),
                              torch.randn(8, 2), backend="cpu"))
try:
    calls["{op}"]()
except BackendUnavailable as e:
    print(e)
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ctxfast._C" in run.stdout and "not implemented" not in run.stdout, run.stdout
