"""The CUDA bindings (csrc/bindings/*_cuda.cpp) cannot be built here (CPU torch, no GPU),
but they can be syntax-checked against torch's headers and the CUDA toolkit's, so that a
mistake in them shows up in CI rather than on the next GPU machine.

The CPU wheel of torch lacks one generated header (c10/cuda/impl/cuda_cmake_macros.h;
see docs/ARCHITECTURE.md, measured facts); the test writes a stand-in for it.
"""
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

ROOT = Path(__file__).resolve().parents[1]
BINDINGS = sorted((ROOT / "csrc" / "bindings").glob("*_cuda.cpp"))


def _cuda_include():
    nvcc = shutil.which("nvcc")
    candidates = [Path("/usr/local/cuda/include")]
    if nvcc:
        candidates.insert(0, Path(nvcc).resolve().parents[1] / "include")
    return next((c for c in candidates if (c / "cuda_runtime.h").is_file()), None)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.skipif(_cuda_include() is None, reason="CUDA toolkit headers (cuda_runtime.h) not found")
@pytest.mark.parametrize("src", BINDINGS, ids=lambda p: p.name)
def test_cuda_binding_compiles(tmp_path, src):
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = ["g++", "-std=c++17", "-fsyntax-only", f"-I{tmp_path}",
           *(f"-I{p}" for p in include_paths()), f"-I{_cuda_include()}", f"-I{ROOT / 'csrc'}",
           f"-I{sysconfig.get_paths()['include']}", str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{src.name} does not compile:\n{r.stderr[-4000:]}"


def test_there_are_cuda_bindings():
    assert BINDINGS, "csrc/bindings/*_cuda.cpp not found"


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None,
                    reason="g++ and nm needed")
def test_symbols_looked_up_at_run_time_are_spelled_as_the_compiler_mangles(tmp_path):
    """csrc/bindings/lstm_cuda.cpp finds ATen's cuBLAS handle by its mangled name with
    dlsym (the extension links no cuBLAS; a wrong spelling silently leaves the float32
    weight gradients on at::mm): the name must be the one g++ gives the declaration."""
    import re
    src = (ROOT / "csrc" / "bindings" / "lstm_cuda.cpp").read_text()
    looked_up = re.findall(r'dlsym\(lib, "(_Z\w+)"\)', src)
    assert looked_up, "no mangled name looked up"
    decl = tmp_path / "decl.cpp"
    decl.write_text(
        "struct cublasContext;\n"
        "namespace at { namespace cuda {\n"
        "cublasContext* getCurrentCUDABlasHandle();\n"
        "} }\n"
        "void* take() { return reinterpret_cast<void*>(&at::cuda::getCurrentCUDABlasHandle); }\n")
    obj = tmp_path / "decl.o"
    subprocess.run(["g++", "-c", str(decl), "-o", str(obj)], check=True, timeout=120)
    symbols = subprocess.run(["nm", str(obj)], capture_output=True, text=True, timeout=60).stdout
    for name in looked_up:
        assert name in symbols, (name, symbols)
