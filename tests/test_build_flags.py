"""The CUDA C++ extension's build flags keep the kernels' float32 math accurate.

The first H100 run (2026-11-22) found the CUDA LSTM 10-100x further from the float64
reference than eager: setup.py built with ``--use_fast_math``, which turns ``tanhf`` into
``tanh.approx.f32`` (relative error up to ~5e-4), division into approximate reciprocals and
flushes denormals. This test compiles csrc/cuda with the flags setup.py really uses (read
from setup.py, not copied here) to PTX with nvcc, no GPU needed, and fails if approximate
transcendentals or fast-math switches come back."""
import ast
import pathlib
import re
import shutil
import subprocess

import pytest

from utils import cached_build, keep_whole

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST_MATH_FLAGS = ("--use_fast_math", "-use_fast_math", "--ftz=true", "--prec-div=false",
                   "--prec-sqrt=false")


def _setup_nvcc_flags():
    """NVCC_FLAGS as assigned in setup.py (a literal list), without ``--threads N``: one
    target after the other keeps ptxas's per-kernel reports in order for the parser."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "NVCC_FLAGS" for t in node.targets):
            flags = ast.literal_eval(node.value)
            return [f for i, f in enumerate(flags)
                    if f != "--threads" and (i == 0 or flags[i - 1] != "--threads")]
    raise AssertionError("setup.py no longer assigns NVCC_FLAGS as a literal list")


def test_setup_builds_cuda_without_fast_math():
    flags = _setup_nvcc_flags()
    bad = [f for f in flags if f in FAST_MATH_FLAGS]
    assert not bad, f"setup.py's NVCC_FLAGS has {bad}: approximate math in the CUDA kernels"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("source", sorted(p.name for p in (ROOT / "csrc" / "cuda").glob("*.cu")))
def test_cuda_kernels_have_no_approximate_transcendentals(tmp_path, source):
    # The -gencode pairs of setup.py are replaced by one PTX target (PTX is what we read).
    flags, skip = [], False
    for f in _setup_nvcc_flags():
        if skip:
            skip = False
            continue
        if f == "-gencode":
            skip = True
            continue
        flags.append(f)
    ptx = tmp_path / (source + ".ptx")
    cmd = ["nvcc", "-ptx", *flags, f"-I{ROOT / 'csrc'}", "-arch=compute_90",
           str(ROOT / "csrc" / "cuda" / source), "-o", str(ptx)]
    run = cached_build(cmd, ptx, [ROOT / "csrc"], timeout=300)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}"
    text = ptx.read_text()
    found = sorted(set(re.findall(r"\b(tanh\.approx\.f32|div\.approx\.f32|div\.full\.f32|"
                                  r"sin\.approx\.f32|cos\.approx\.f32|lg2\.approx\.f32)", text)))
    assert not found, f"{source}: approximate float32 math in the PTX: {found}"
    # The tensor-core LSTM kernels: every instantiation's products are tensor-core MMAs.
    entries = {m.group(1): body for m, body in
               ((re.match(r"\s*(\S+)\(", chunk), chunk) for chunk in text.split(".entry")[1:])
               if m and "mma_kernel" in m.group(1)}
    if source == "lstm.cu":
        assert len(entries) == 6, sorted(entries)       # fwd and bwd x fp32, fp16, bf16
        for name, body in entries.items():
            assert "wmma.mma.sync" in body, f"{name}: no tensor-core MMA in the PTX"
            if "kernelIf" in name:                      # float32: tf32 operands, split in two
                assert ".tf32" in body and "cvt.rna.tf32.f32" in body, name


def _ptxas_facts(text):
    """[(arch, kernel, registers, spill store bytes, spill load bytes)] from `-Xptxas -v`."""
    facts, entry = [], None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+a?)'", line)
        if m:
            entry = [m.group(2), m.group(1), None, None, None]
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and entry is not None:
            entry[3], entry[4] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m and entry is not None:
            entry[2] = int(m.group(1))
            facts.append(tuple(entry))
            entry = None
    return facts


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("source", sorted(p.name for p in (ROOT / "csrc" / "cuda").glob("*.cu")))
def test_cuda_kernels_do_not_spill(tmp_path, source):
    """Every CUDA C++ kernel, built with setup.py's flags for sm_90 (the H100/H200 this
    project measures on): no register spills, registers within the 255 a thread can have.
    setup.py's other targets are left out (ptxas for each is most of the compile); the
    numbers are in benchmarks/NOTES.md ("CUDA C++ compile facts"): on sm_80 the persistent
    LSTM kernels spill 28-68 bytes under their 512-thread launch bound (recorded there, not
    asserted). Device code only (``-fatbin``): the host side is compiled by the build."""
    flags = _setup_nvcc_flags()
    pairs = [flags[i + 1] for i, f in enumerate(flags) if f == "-gencode"]
    # sm_90 machine code, and compute_90 PTX for the GPUs after it (sm_100, sm_120: with
    # only machine code they have no image, and every launch fails)
    assert "arch=compute_90,code=[sm_90,compute_90]" in pairs, \
        f"setup.py builds no sm_90 code and compute_90 PTX: {pairs}"
    flags = [f for i, f in enumerate(flags)
             if f != "-gencode" and (i == 0 or flags[i - 1] != "-gencode")]
    cmd = ["nvcc", "-fatbin", *flags, "-gencode", "arch=compute_90,code=sm_90", "-Xptxas",
           "-v", f"-I{ROOT / 'csrc'}", str(ROOT / "csrc" / "cuda" / source), "-o",
           str(tmp_path / "k.fatbin")]
    run = cached_build(cmd, tmp_path / "k.fatbin", [ROOT / "csrc"], timeout=300)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}"
    facts = _ptxas_facts(run.stdout + run.stderr)
    assert facts, f"no ptxas report parsed for {source}:\n{(run.stdout + run.stderr)[-2000:]}"
    assert {f[0] for f in facts} == {"sm_90"}, f"{source}: {facts}"
    spilling = [f for f in facts if f[0] == "sm_90" and (f[3] or f[4])]
    assert not spilling, f"{source}: kernels spill registers on sm_90: {spilling}"
    assert all(f[2] <= 255 for f in facts)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_grid_sync_probe_builds(tmp_path):
    """benchmarks/grid_sync_probe.cu (gpu_round.sh builds it with nvcc on the GPU machine)
    compiles for sm_90 here, so a round does not spend device time on a build error."""
    cmd = ["nvcc", "-O3", "-arch=sm_90", "-c", str(ROOT / "benchmarks" / "grid_sync_probe.cu"),
           "-o", str(tmp_path / "p.o")]
    run = cached_build(cmd, tmp_path / "p.o", [ROOT / "benchmarks" / "grid_sync_probe.cu"],
                       timeout=300)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}"


# --------------------------------------------------------------------------- libstdc++

def _built_modules():
    import importlib.util
    mods = []
    for name in ("ctxfast._C", "ctxfast._cuda"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            mods.append(pathlib.Path(spec.origin))
    return mods


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not found")
def test_extensions_link_the_shared_libstdcxx():
    """ctxfast._C and ctxfast._cuda need libstdc++.so and define none of its stream code.
    The GPU machines' toolchain linked a static copy into them (-static-libstdc++): with
    torch's shared copy in the same process, every refusal that formats a number killed
    the process (the H200, 2026-11-26). setup.py's LINK_SHARED_LIBSTDCXX prevents it."""
    mods = _built_modules()
    assert mods, "ctxfast._C is not built"
    for so in mods:
        dyn = subprocess.run(["readelf", "-d", "-W", str(so)], capture_output=True,
                             text=True, check=True).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
        assert any(n.startswith("libstdc++.so") for n in needed), (so.name, needed)
        syms = subprocess.run(["readelf", "--dyn-syms", "-W", str(so)], capture_output=True,
                              text=True, check=True).stdout
        own = [line.split()[-1] for line in syms.splitlines()
               if " UND " not in line and re.search(r"\s_ZNSo9_M_insert|\s_ZNSt6locale", line)]
        assert not own, f"{so.name} defines libstdc++'s own stream code: {own[:5]}"


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not found")
def test_extensions_carry_no_debug_information():
    """setup.py builds the C++ with -g0 after Python's CFLAGS (-g): debug information for
    the torch templates the bindings use doubled the build on a fresh install."""
    mods = _built_modules()
    assert mods, "ctxfast._C is not built"
    for so in mods:
        sections = subprocess.run(["readelf", "-S", "-W", str(so)], capture_output=True,
                                  text=True, check=True).stdout
        debug = sorted(set(re.findall(r"\.debug_\w+", sections)))
        assert not debug, f"{so.name} carries debug sections {debug}; is -g0 in CXX_FLAGS?"


def test_refusals_format_numbers_and_sizes():
    """A C++ refusal's message keeps the numbers and sizes it formats (a static libstdc++
    copy dropped them with GCC 12 and crashed with GCC 13)."""
    import torch
    import ctxfast  # noqa: F401  (loads ctxfast._C)
    for kind, text in ((3, "a double 0.5"), (4, "an int64 4"), (5, "sizes [2, 3]"),
                       (6, "ostringstream 0.5")):
        with pytest.raises(ValueError, match=re.escape(text)):
            torch.ops.ctxfast.probe_throw(kind)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got -0\.1"):
        torch.ops.ctxfast.keep_mask_cpu(torch.ones(4), torch.tensor([1]), -0.1)


def _setup_link_arg():
    """setup.py's ``_shared_libstdcxx()`` run in this process (which has torch loaded, as
    setup.py's has), read from setup.py's source rather than copied here."""
    import os
    import torch  # noqa: F401  (loads libstdc++.so, as setup.py's import of torch does)
    tree = ast.parse((ROOT / "setup.py").read_text())
    fn = next((n for n in tree.body
               if isinstance(n, ast.FunctionDef) and n.name == "_shared_libstdcxx"), None)
    assert fn is not None, "setup.py no longer defines _shared_libstdcxx()"
    scope = {"os": os}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "setup.py", "exec"), scope)
    return scope["_shared_libstdcxx"]()


def _needed(so):
    dyn = subprocess.run(["readelf", "-d", "-W", str(so)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)


@pytest.mark.skipif(shutil.which("readelf") is None or shutil.which("c++") is None,
                    reason="needs readelf and a C++ compiler")
def test_link_argument_survives_a_linker_that_finds_the_archive_first(tmp_path):
    """The H200's build linked libstdc++ statically even with an explicit -lstdc++: the
    linker found the archive first. Here a -L to a folder holding only libstdc++.a does the
    same to a plain -lstdc++ (the control: it must come out static, or this test proves
    nothing), and setup.py's link argument must still give a module that needs
    libstdc++.so, so that no second copy of the stream code can meet torch's."""
    archive = subprocess.run(["c++", "-print-file-name=libstdc++.a"], capture_output=True,
                             text=True).stdout.strip()
    if not pathlib.Path(archive).is_file():
        pytest.skip("the compiler has no libstdc++.a to simulate the static-first linker")
    only = tmp_path / "static-only"
    only.mkdir()
    (only / "libstdc++.a").symlink_to(archive)
    src = tmp_path / "m.cpp"
    src.write_text('#include <sstream>\n#include <string>\n'
                   'std::string fmt(double x) { std::ostringstream s; s << x; return s.str(); }\n')
    arg = _setup_link_arg()

    def link(name, lib):
        so = tmp_path / name
        subprocess.run(["c++", "-shared", "-fPIC", "-O1", f"-L{only}", str(src), "-o", str(so),
                        lib], check=True, capture_output=True)
        return _needed(so)
    assert not any(n.startswith("libstdc++.so") for n in link("plain.so", "-lstdc++")), \
        "control: with only the archive on the path, -lstdc++ should have linked it statically"
    needed = link("ours.so", arg)
    assert any(n.startswith("libstdc++.so") for n in needed), (arg, needed)


def test_cached_build_compiles_once_per_input(tmp_path, monkeypatch):
    # A stand-in compiler that counts its runs and writes its output: the same command and
    # inputs compile once (the output and log come back), a changed input or command again,
    # a failure is not kept, and CTXFAST_TEST_BUILD_CACHE=0 always compiles.
    runs, src = tmp_path / "runs", tmp_path / "src"
    src.mkdir()
    (src / "k.cu").write_text("one")
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho run >> {runs}\n"
                  "grep -q fail \"$1\" && exit 1\necho built; cat \"$1\" > \"$2\"\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CTXFAST_TEST_BUILD_CACHE", str(tmp_path / "cache"))

    def build(flag="-O1"):
        out = tmp_path / "out"
        out.unlink(missing_ok=True)
        run = cached_build([str(cc), str(src / "k.cu"), str(out), flag], out, [src])
        return run.returncode, run.stdout, out.read_text() if out.exists() else None

    def count():
        return len(runs.read_text().splitlines())

    assert build() == (0, "built\n", "one") and count() == 1
    assert build() == (0, "built\n", "one") and count() == 1
    (src / "k.cu").write_text("two")
    assert build() == (0, "built\n", "two") and count() == 2
    assert build("-O2") == (0, "built\n", "two") and count() == 3
    (src / "k.cu").write_text("fail")
    assert build()[0] == 1 and build()[0] == 1 and count() == 5
    (src / "k.cu").write_text("two")
    monkeypatch.setenv("CTXFAST_TEST_BUILD_CACHE", "0")
    assert build() == (0, "built\n", "two") and count() == 6


def test_keep_whole_writes_whole_or_not_at_all(tmp_path):
    # A file is replaced whole; a directory another process kept first stays as it was;
    # no staging copy is left beside either, and a fill that fails keeps nothing.
    log = tmp_path / "a" / "k.log"
    keep_whole(log, lambda staging: staging.write_text("first"))
    keep_whole(log, lambda staging: staging.write_text("second"))
    assert log.read_text() == "second"

    def fill_dir(text):
        def fill(staging):
            staging.mkdir()
            (staging / "run.json").write_text(text)
        return fill

    kept = tmp_path / "builds" / "key"
    keep_whole(kept, fill_dir("first"))
    keep_whole(kept, fill_dir("second"))
    assert (kept / "run.json").read_text() == "first"

    def fails(staging):
        staging.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        keep_whole(tmp_path / "b" / "k.log", fails)
    assert not (tmp_path / "b" / "k.log").exists()
    left = [p.name for p in tmp_path.rglob("*") if p.name.startswith(".")]
    assert left == [], left
