"""Build ctxfast.

* ``ctxfast._C``    C++ CPU kernels (csrc/cpu) + their bindings: always built.
* ``ctxfast._cuda`` CUDA C++ kernels (csrc/cuda) + their bindings: built only when the
  installed torch has CUDA and nvcc is found; ``CTXFAST_SKIP_CUDA_BUILD=1`` skips it.
* ``kernels/``      Triton kernels, installed as the package ``ctxfast.kernels``.

Install against the torch already in the environment (never reinstalls it):

    pip install --no-build-isolation -e .

The outcome of the CUDA decision is written to ``ctxfast/_build_info.json`` so that
``ctxfast info`` and the backend errors can say why ``ctxfast._cuda`` is missing.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - a build without torch cannot work
    sys.exit("ctxfast: torch is not importable in the build environment (install torch "
             "first; pip's build isolation hides an installed torch: build with "
             "`pip install --no-build-isolation --no-deps -e .`)")


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _nvcc_major(nvcc: str):
    """nvcc's CUDA major version (``release 13.0`` -> 13), or None if it cannot tell."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def _cuda_decision():
    """Return (build_cuda: bool, reason: str)."""
    skip = os.environ.get("CTXFAST_SKIP_CUDA_BUILD", "0").strip().lower()
    if skip not in ("", "0", "false", "no", "off"):
        return False, "CTXFAST_SKIP_CUDA_BUILD is set"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build (torch.version.cuda is None)"
    nvcc = None
    if cpp_extension.CUDA_HOME:
        cand = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
        nvcc = cand if os.path.exists(cand) else None
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        return False, "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    # torch's build refuses another major version, before anything is built: ctxfast._C
    # would be lost with it, so ctxfast._cuda is skipped, saying why
    major = _nvcc_major(nvcc)
    if major is not None and str(major) != torch.version.cuda.split(".")[0]:
        return False, (f"nvcc at {nvcc} is CUDA {major}.x, torch was built with CUDA "
                       f"{torch.version.cuda} (set CUDA_HOME to a matching toolkit)")
    return True, f"torch CUDA {torch.version.cuda}, nvcc at {nvcc}"


# -g0: Python's own CFLAGS (which setuptools passes first) hold -g. Debug information
# for every torch template the bindings instantiate doubled their compile time
# (launch_key.cpp 34 -> 17 s here) and the module's size (30 MB -> 1.6 MB), on the
# critical path of every fresh install (the CI's and each GPU round's). Crash backtraces
# (module_cpu.cpp) use the dynamic symbols, which stay.
CXX_FLAGS = ["-O3", "-g0", "-std=c++17", "-fopenmp"]
# No --use_fast_math: it swaps expf/tanhf/division for approximate intrinsics and flushes
# denormals, which put the CUDA LSTM 10-100x further from the float64 reference than eager
# on the first H100 run (2026-11-22). tests/test_build_flags.py keeps it out.
# --threads 2: the two targets compiled side by side (lstm.cu here: 22.6 s -> 12.9 s), on
# the critical path of every GPU round's build on a fresh machine.
NVCC_FLAGS = [
    "-O3", "-std=c++17", "-lineinfo", "--threads", "2",
    "-gencode", "arch=compute_80,code=sm_80",
    "-gencode", "arch=compute_90,code=[sm_90,compute_90]",
]

# libstdc++ as a shared library, always: torch's own code in the process uses the shared
# one, and a second copy linked into our module binds some of its symbols to the shared
# library and keeps others: every number formatted into an error message crashed the
# process on the H200 (2026-11-26, twice: std::ostream << double inside c10::str of every
# refusal), and is silently dropped with GCC 12. A plain -lstdc++ is not enough: on the
# H200 the modules still came out with no libstdc++.so among their NEEDED entries (a
# linker that finds libstdc++.a first does that: a -L to a folder holding only the
# archive reproduces it here; what did it there is not known yet). So the module links the very libstdc++.so.6 this process (torch)
# has loaded, by its path: the linker sees a shared object, resolves every libstdc++
# symbol from it, and pulls no archive member. tests/test_build_flags.py checks the
# built modules.
def _shared_libstdcxx():
    """The linker argument that names the shared libstdc++: the file torch loaded, from
    /proc/self/maps (Linux), else what the compiler finds, else -lstdc++."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "/libstdc++.so" in path and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return "-lstdc++"


LINK_SHARED_LIBSTDCXX = [_shared_libstdcxx()]

ext_modules = [
    cpp_extension.CppExtension(
        name="ctxfast._C",
        sources=_rel(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp"))
                     + glob.glob(os.path.join(ROOT, "csrc", "bindings", "*_cpu.cpp"))
                     + [os.path.join(ROOT, "csrc", "bindings", "launch_key.cpp")]),
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=["-fopenmp", *LINK_SHARED_LIBSTDCXX],
    )
]

build_cuda, cuda_reason = _cuda_decision()
if build_cuda:
    ext_modules.append(
        cpp_extension.CUDAExtension(
            name="ctxfast._cuda",
            sources=_rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))
                         + glob.glob(os.path.join(ROOT, "csrc", "bindings", "*_cuda.cpp"))),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": ["-O3", "-g0", "-std=c++17"], "nvcc": NVCC_FLAGS},
            extra_link_args=LINK_SHARED_LIBSTDCXX,
        )
    )
    print(f"ctxfast: building ctxfast._cuda ({cuda_reason})")
else:
    print(f"ctxfast: skipping ctxfast._cuda: {cuda_reason}")

with open(os.path.join(ROOT, "ctxfast", "_build_info.json"), "w") as f:
    json.dump({"cuda_built": build_cuda, "cuda_reason": cuda_reason,
               "torch": torch.__version__}, f)



class _BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's build, which first removes a ``ctxfast._cuda`` module left by an earlier
    build when this one does not build it: it would be packed into the wheel (from
    build/lib) or imported in place, contradicting ``_build_info.json``."""

    def run(self):
        if not build_cuda:
            for d in (os.path.join(ROOT, "ctxfast"), os.path.join(self.build_lib, "ctxfast")):
                for stale in glob.glob(os.path.join(d, "_cuda.*")):
                    os.remove(stale)
        super().run()


packages = find_packages(include=["ctxfast", "ctxfast.*"]) + ["ctxfast.kernels"]

setup(
    name="ctxfast",
    version="0.1.0",
    description="Fused Triton and CUDA C++ kernels for context-based language models",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"ctxfast": "ctxfast", "ctxfast.kernels": "kernels"},
    package_data={"ctxfast": ["_build_info.json"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": _BuildExt},
    entry_points={"console_scripts": ["ctxfast=ctxfast.cli:main"]},
    # torch is deliberately not listed: the build uses the torch already installed
    # (CPU 2.13 on dev/CI machines, CUDA 2.11 on GPU machines) and must never replace it.
    install_requires=["numpy"],
    extras_require={"triton": ["triton>=3.6"],
                    "test": ["pytest", "pytest-benchmark", "hypothesis"],
                    "bench": ["pytest", "pytest-benchmark", "tqdm", "matplotlib"]},
    zip_safe=False,
)
