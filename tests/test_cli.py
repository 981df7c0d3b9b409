"""`ctxfast info` and `ctxfast smoke` (the main job's first steps)."""
import os
import subprocess
import sys

import pytest

import ctxfast


def _run(*args, **extra_env):
    env = dict(os.environ, **extra_env)
    return subprocess.run([sys.executable, "-m", "ctxfast.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


#: Settings that `ctxfast info` lists when set, given at once to one run of it (each run
#: is a new process: the package reads some of them at import).
_SETTINGS = dict(CTXFAST_LSTM_CUDA_KERNEL="persistent_mma", CTXFAST_TRITON_LAUNCH="jit",
                 CTXFAST_LINEAR_CUDA="triton", CTXFAST_ATTN_TMA="on", CTXFAST_AUTOTUNE="on")


@pytest.fixture(scope="module")
def info():
    """`ctxfast info`'s output, plain and with :data:`_SETTINGS` set (one run each)."""
    runs = {"plain": _run("info"), "settings": _run("info", **_SETTINGS)}
    for r in runs.values():
        assert r.returncode == 0, r.stderr
    return {k: r.stdout for k, r in runs.items()}


def test_info_lists_versions_extensions_and_backends(info):
    out = info["plain"]
    assert f"ctxfast {ctxfast.__version__}" in out
    assert "torch" in out and "ctxfast._C     built" in out
    assert "ctxfast._cuda" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("rel_shift")]
    assert [r[1] for r in rows] == list(ctxfast.BACKENDS)
    cpu_row = next(r for r in rows if r[1] == "cpu")
    assert cpu_row[2] == "yes*"  # the default on CPU tensors


def test_info_names_the_kernel_settings_that_are_set(info):
    """A log of `ctxfast info` says which kernel or path a setting chose (the GPU round
    prints it first); unset settings are not listed."""
    assert "CTXFAST_LSTM_CUDA_KERNEL=persistent_mma" in info["settings"]
    assert "CTXFAST_TRITON_LAUNCH=jit" in info["settings"]
    assert "CTXFAST_REL_BWD_DR=" not in _run("info", CTXFAST_REL_BWD_DR="").stdout


def test_info_lists_every_setting_the_package_reads(info):
    """Every ``CTXFAST_*`` variable that ctxfast's code reads (ctxfast/, kernels/) is one
    `ctxfast info` prints when set: CTXFAST_LINEAR_CUDA (the decoder's GEMM) was read and
    not listed, so a GPU round's log could not say which GEMM ran."""
    import re
    from ctxfast import cli
    root = os.path.join(os.path.dirname(__file__), "..")
    read = set()
    for pkg in ("ctxfast", "kernels"):
        for dirpath, _, names in os.walk(os.path.join(root, pkg)):
            for name in names:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name)) as f:
                        read |= set(re.findall(r'environ(?:\.get)?[\(\[]"(CTXFAST_[A-Z0-9_]+)"',
                                               f.read()))
    assert "CTXFAST_LINEAR_CUDA" in read and "CTXFAST_BACKEND" in read, read
    assert read <= set(cli._KERNEL_SETTINGS), read - set(cli._KERNEL_SETTINGS)
    assert "CTXFAST_LINEAR_CUDA=triton" in info["settings"]


def test_info_says_what_float32_rounds_to_on_a_gpu(info):
    """`ctxfast info` says whether float32 products may be TF32 on a GPU: attention follows
    cuBLAS's matmul setting, the LSTM cuDNN's RNN setting (torch's defaults: float32 and
    TF32); and lists CTXFAST_ATTN_TMA and CTXFAST_AUTOTUNE when set."""
    out = info["settings"]
    line = next(l for l in out.splitlines() if l.startswith("float32 on a GPU: "))
    assert line == ("float32 on a GPU: attention products float32 (cuBLAS's setting), "
                    "LSTM recurrence TF32 (cuDNN RNNs' setting)"), line
    assert "CTXFAST_ATTN_TMA=on" in out and "CTXFAST_AUTOTUNE=on" in out


def test_info_says_what_code_the_cpu_kernels_run(info):
    """`ctxfast info` names the code the CPU kernels chose in that process (own AVX-512 /
    AVX2 tiles or the BLAS, the recurrence's kernel, oneDNN or ATen for the LSTM's large
    products), and follows the settings that force them."""
    line = next(l for l in info["plain"].splitlines() if l.startswith("CPU code: "))
    assert any(f"attention tiles: {p};" in line for p in ("own AVX-512", "own AVX2", "BLAS"))
    assert any(f"LSTM recurrence: {p};" in line for p in ("AVX-512", "AVX2", "ATen"))
    assert line.endswith(("weight gradients: onednn", "weight gradients: aten")), line
    forced = _run("info", CTXFAST_ATTN_CPU_GEMM="blas", CTXFAST_LSTM_CPU_GEMM="aten",
                  CTXFAST_CPU_LINEAR="aten").stdout
    assert ("CPU code: attention tiles: BLAS; LSTM recurrence: ATen; LSTM projections and "
            "weight gradients: aten") in forced, forced


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


@pytest.mark.parametrize("bad", ["wrong", "raises"])
def test_smoke_fails_on_an_error_over_its_tolerance_or_an_exception(bad, monkeypatch, capsys):
    """The smoke run's verdict (in process, every op's run replaced by a stub): one
    backend over its tolerance, or raising, makes it print that and exit 1."""
    from ctxfast import _dispatch, cli

    def broken(backend, device):
        if bad == "raises":
            raise RuntimeError("kernel crashed")
        return 1.0
    ops = list(_dispatch.registered_ops())
    fake = {op: ((lambda backend, device: 0.0), 1e-4) for op in ops}
    monkeypatch.setattr(cli, "SMOKE", fake)
    assert cli.main(["smoke"]) == 0 and "smoke: all ok" in capsys.readouterr().out
    fake[ops[0]] = (broken, 1e-4)
    assert cli.main(["smoke"]) == 1
    out = capsys.readouterr().out
    assert ("WRONG" if bad == "wrong" else "FAILED: RuntimeError: kernel crashed") in out, out
    assert out.rstrip().endswith("FAILED") and "all ok" not in out, out


def test_unknown_arguments_fail(capsys):
    from ctxfast import cli                    # (in process: refused before anything runs)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["info", "--bogus"])
    assert exit_.value.code != 0 and "unrecognized arguments" in capsys.readouterr().err


# --------------------------------------------------------------------------- ctxfast bench

def test_bench_refuses_an_unusable_device_in_one_line(capsys):
    import torch
    from ctxfast import cli                    # (in process: refused before anything runs)
    bad = [("meta", "benchmarks run on cpu or cuda"), ("nonsense", "not a device name"),
           ("cuda:99", "CUDA device(s) here" if torch.cuda.is_available()
            else "CUDA is not available here")]
    for device, words in bad:
        assert cli.main(["bench", "--quick", "--device", device]) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ctxfast bench: --device {device}: ")
        assert words in lines[0] and "Traceback" not in captured.err


def test_bench_says_what_to_install_without_pytest_benchmark(monkeypatch, capsys):
    import importlib.util
    from ctxfast import cli
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pytest_benchmark" else real(name, *a))
    assert cli.main(["bench", "--quick", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "pytest-benchmark not installed" in err and "pip install" in err
    assert "'.[bench]'" in err


def test_bench_prints_compact_tables_and_where_the_report_is(tmp_path):
    # The default output: one table per op (ours against each peer), the report's path;
    # pytest-benchmark's raw tables only with --verbose.
    env = dict(os.environ, CTXFAST_BENCH_BUDGET_SCALE="0.05")
    r = subprocess.run([sys.executable, "-m", "ctxfast.cli", "bench", "--quick", "--ops",
                        "rel_shift", "--device", "cpu", "--threads", "1", "--no-plots",
                        "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "rel_shift: speedup = peer's time / ours" in out
    head = next(l for l in out.splitlines() if l.strip().startswith("case"))
    assert head.split() == ["case", "mode", "ours", "ms", "rate", "vs", "eager-pad-view",
                            "vs", "eager"]
    rows = [l for l in out.splitlines() if l.strip().startswith("B2 H4 Tq64 Tk128")]
    assert len(rows) == 2 and all(" cpu " in l and l.rstrip().endswith("x") for l in rows)
    assert "report (" in out and str(tmp_path) in out and ".md" in out
    assert "benchmark '" not in out and "Name (time in" not in out    # no raw tables
    assert "rel_shift" in r.stderr                                    # the progress bar


def test_xl_eval_with_a_bad_backend_setting_says_so_in_a_line(monkeypatch, capsys):
    """``CTXFAST_BACKEND`` that is not a backend, or one that cannot run here: xl-eval exits
    2 with one ``error:`` line naming the setting (it printed a traceback, exit 1)."""
    from ctxfast import cli
    monkeypatch.setenv("CTXFAST_BACKEND", "bogus")
    with pytest.raises(SystemExit) as e:
        cli.main(["xl-eval", "--quick"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "ctxfast xl-eval: error: CTXFAST_BACKEND: unknown backend 'bogus'" in err
    assert "Traceback" not in err
