"""Does an error raised inside ctxfast's C++ ops reach Python as an exception?

On the first H200 round (2026-11-26, torch 2.11.0+cu130, the extension built by
``/opt/gcc/bin/g++``) every C++ op that refused its input killed the process with a
segmentation fault instead of raising (``keep_mask_cpu``, ``attention_fwd_cpu``,
``rel_attention_fwd_cpu``, ``lstm_recurrence_native``), while the same code built on torch
2.11 and 2.13 with the system g++ raised ``ValueError``. This probe tells which side the
fault is on, each case in its own process (a crash ends only that case):

* ``torch``: an error raised by libtorch itself (ours not involved);
* ``_C``: a ``TORCH_CHECK_VALUE`` in ctxfast._C (CPU op);
* ``_cuda``: a ``TORCH_CHECK_TYPE`` in ctxfast._cuda (only where it is built and a GPU is
  present);

The ``torch`` and ``_cuda`` cases each run in a fresh process. The ``_C`` cases run in
processes forked from this one after it has imported torch and ctxfast once (what each
child would import first anyway; a fresh interpreter per case took ~2 s of the probe's
~2.5 s a case); a child that crashes still ends only itself.

It also prints the compilers on the PATH and which libstdc++ / libgcc_s / libgomp the process
loaded. ``gpu_round.sh`` runs it right after the build.

    python benchmarks/exception_probe.py        # exit 1 if any case crashed or did not raise
"""
from __future__ import annotations

import faulthandler
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Tuple

# Each ctxfast case first installs a SIGSEGV handler that prints the native stack
# (ctxfast::probe_segv_backtrace); the probe resolves its frames with addr2line.
_SETUP = "import torch, ctxfast\ntorch.ops.ctxfast.probe_segv_backtrace()\n"
CASES = {
    "torch": "import torch\ntorch.ones(2).view(3)",
    "_C": _SETUP + "torch.ops.ctxfast.keep_mask_cpu(torch.ones(4), torch.tensor([1]), -0.1)",
    # the same refusal three ways (csrc/bindings/module_cpu.cpp probe_throw): if only the
    # first crashes, capturing the backtrace at the throw is what fails there, and a check
    # that throws without one is the way out; if all three crash, unwinding through our
    # frames does
    "_C TORCH_CHECK": _SETUP + "torch.ops.ctxfast.probe_throw(0)",
    "_C c10 error, no backtrace": _SETUP + "torch.ops.ctxfast.probe_throw(1)",
    "_C std::invalid_argument": _SETUP + "torch.ops.ctxfast.probe_throw(2)",
    # the message formats a number or sizes, as the ops' refusals do (0 formats a literal)
    "_C TORCH_CHECK double": _SETUP + "torch.ops.ctxfast.probe_throw(3)",
    "_C TORCH_CHECK int64": _SETUP + "torch.ops.ctxfast.probe_throw(4)",
    "_C TORCH_CHECK sizes": _SETUP + "torch.ops.ctxfast.probe_throw(5)",
    "_C ostringstream double": _SETUP + "torch.ops.ctxfast.probe_throw(6)",
    "_C lstm (CPU)": _SETUP + ("torch.ops.ctxfast.lstm_recurrence_native(torch.zeros(2, 4), "
                               "torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(4, 1), None, "
                               "None, 1.0, float('inf'), float('inf'), False)"),
    "_cuda": (_SETUP +
              "x = torch.zeros(2, 1, 4, dtype=torch.float64, device='cuda')\n"
              "h = torch.zeros(1, 1, dtype=torch.float64, device='cuda')\n"
              "torch.ops.ctxfast.lstm_recurrence_native(x, h, h, torch.zeros(4, 1, "
              "dtype=torch.float64, device='cuda'), None, None, 1.0, float('inf'), "
              "float('inf'), False)"),
}

LIBS = ("libstdc++", "libgcc_s", "libgomp")


def _child(code: str) -> None:
    # this checkout's ctxfast (built in place), imported before the probe: an import that
    # fails is a failed probe, not an exception raised by an op
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    setup, call = code.rsplit("\n", 1)
    scope: dict = {}
    exec(compile(setup, "<probe setup>", "exec"), scope)
    try:
        exec(compile(call, "<probe>", "exec"), scope)
    except (ValueError, TypeError, RuntimeError) as e:  # the C++ error reached Python
        print(f"raised {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        maps = open("/proc/self/maps").read().split("\n") if os.path.exists("/proc/self/maps") else []
        loaded = sorted({line.split()[-1] for line in maps
                         if any(lib in line for lib in LIBS) and "/" in line})
        for path in loaded:
            print(f"  loaded {path}")
        sys.exit(0)
    print("did not raise")
    sys.exit(3)


#: Cases run in a process of their own: libtorch alone (ctxfast not loaded), and CUDA (a
#: CUDA context cannot be made in a process forked after the parent may have initialised
#: the driver).
FRESH = ("torch", "_cuda")
TIMEOUT_S = 120


def _fresh(name: str) -> Tuple[int, str, str]:
    """(exit status, stdout, stderr) of case `name` in a new Python process."""
    proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--child", name],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc.returncode, proc.stdout, proc.stderr


def _forked(name: str) -> Tuple[int, str, str]:
    """(exit status, negative for a signal, as subprocess gives it; stdout; stderr) of case
    `name` in a child forked from this process, which has imported torch and ctxfast."""
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:                                   # the child: never returns
            status = 4
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                faulthandler.enable()
                _child(CASES[name])
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else 4
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                _, wait_status = os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        code = (-os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status)
                else os.WEXITSTATUS(wait_status))
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()


def _resolve(line: str) -> str:
    """A glibc backtrace frame ``/path/lib.so(+0x1a2b) [0x7f..]`` with the function and
    source line addr2line gives for it (where addr2line is installed)."""
    m = re.match(r"\s*(/\S+?)\(([^)]*)\)\s*\[", line)
    tool = shutil.which("addr2line")
    if not m or not tool or not m.group(2).startswith("+"):
        return line
    try:
        out = subprocess.run([tool, "-f", "-C", "-i", "-e", m.group(1), m.group(2)[1:]],
                             capture_output=True, text=True, timeout=20).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return line
    return line + "".join(f"\n      {fn} at {loc}" for fn, loc in zip(out[::2], out[1::2]))


def _compilers() -> None:
    seen = set()
    for name in ("c++", "g++", "/opt/gcc/bin/g++", "/usr/bin/g++", os.environ.get("CXX", "")):
        path = shutil.which(name) if name else None
        if not path or os.path.realpath(path) in seen:
            continue
        seen.add(os.path.realpath(path))
        try:
            first = subprocess.run([path, "--version"], capture_output=True, text=True,
                                   timeout=10).stdout.splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError) as e:
            first = f"(no version: {e})"
        print(f"compiler {name}: {path} -> {first}")
    for var in ("CC", "CXX", "LDFLAGS", "LDSHARED", "CFLAGS", "CXXFLAGS"):
        if os.environ.get(var):
            print(f"env {var}={os.environ[var]}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for so in sorted(glob.glob(os.path.join(root, "ctxfast", "_*.so"))):
        try:
            out = subprocess.run(["ldd", so], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError) as e:
            out = f"(ldd failed: {e})"
        for line in out.splitlines():
            if any(lib in line for lib in LIBS):
                print(f"ldd {os.path.basename(so)}: {line.strip()}")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(CASES[sys.argv[2]])
    _compilers()
    bad = 0
    for name in CASES:
        if name == "_cuda":
            check = ("import torch, importlib.util, sys; sys.exit(0 if torch.cuda.is_available() "
                     "and importlib.util.find_spec('ctxfast._cuda') else 1)")
            if subprocess.run([sys.executable, "-c", check]).returncode != 0:
                print("probe _cuda: skipped (no GPU or ctxfast._cuda not built)")
                continue
        if name not in FRESH and "ctxfast" not in sys.modules:
            # what every forked case imports first (_child: this checkout's ctxfast)
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            import ctxfast  # noqa: F401
        code, out, err = (_fresh if name in FRESH else _forked)(name)
        ok = code == 0
        bad += not ok
        head = out.strip().splitlines() or ["(no output)"]
        status = "ok" if ok else f"FAILED (exit {code})"
        print(f"probe {name}: {status}: {head[0]}")
        for line in head[1:]:
            print(line)
        if not ok:
            print("\n".join(_resolve(line) for line in err.strip().splitlines()[:60]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
