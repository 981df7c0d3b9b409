"""The structure docs/ARCHITECTURE.md ("Layers") promises: build products, and the one-way imports."""
import ast
import json
from pathlib import Path

import torch

import ctxfast
from ctxfast import _dispatch

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield ("." * node.level) + (node.module or "")


def test_cpu_extension_is_built_and_registers_ops():
    assert _dispatch.c_available(), _dispatch._C_ERROR
    assert torch._C._dispatch_has_kernel_for_dispatch_key("ctxfast::rel_shift_native", "CPU")


def test_build_info_records_the_cuda_decision():
    info = _dispatch.build_info()
    assert set(info) >= {"cuda_built", "cuda_reason", "torch"}
    assert info["cuda_reason"]
    if torch.version.cuda is None:
        assert info["cuda_built"] is False and not _dispatch.cuda_ext_available()


def test_cuda_sources_include_no_torch_header():
    for f in [p for ext in ("*.cu", "*.cuh", "*.h") for p in (ROOT / "csrc" / "cuda").glob(ext)]:
        for line in f.read_text().splitlines():
            if line.strip().startswith("#include"):
                assert not any(t in line for t in ("torch/", "ATen/", "c10/", "pybind11")), \
                    f"{f.name}: {line.strip()} (csrc/cuda must stay plain CUDA)"


def test_only_bindings_include_torch():
    for f in (ROOT / "csrc" / "cpu").glob("*"):
        for line in f.read_text().splitlines():
            if line.strip().startswith("#include"):
                assert "torch/" not in line and "c10/" not in line, f"{f.name}: {line.strip()}"


def test_reference_imports_nothing_of_ctxfast():
    for f in (ROOT / "ctxfast" / "reference").glob("*.py"):
        for mod in _imports(f):
            assert not mod.startswith("ctxfast") and not mod.startswith(".."), f"{f.name}: {mod}"


def test_kernels_never_import_ops():
    for f in (ROOT / "kernels").glob("*.py"):
        for mod in _imports(f):
            assert "ops" not in mod.split(".") and not mod.startswith("ctxfast"), f"{f.name}: {mod}"


def test_kernels_package_is_installed_as_ctxfast_kernels():
    import importlib.util
    spec = importlib.util.find_spec("ctxfast.kernels")
    assert spec is not None and Path(spec.origin).parent == ROOT / "kernels"


def test_public_api():
    assert callable(ctxfast.rel_shift)
    assert ctxfast.BACKENDS == ("triton", "cuda", "cpu", "eager")
    assert json.loads(json.dumps(_dispatch.registered_ops()))["rel_shift"] == list(ctxfast.BACKENDS)
