"""Compile facts of the rel_attention kernels for sm_90 (H100/H200), without a GPU.

For every rel_attention case of tests/test_triton_compile.py (the launches the launchers
make on CUDA, specialised as Triton's JIT does) plus fp32 with torch's default precision
(``tf32x3``, not in that test), compiles each kernel for sm_90 and reports: shared memory
(``metadata.shared``, limit 232448 bytes a block), registers and spill bytes (Triton's
bundled ``ptxas-blackwell -v -arch=sm_90a`` on the PTX: Triton 3.9's PTX is too new for
nvcc 13.0's ptxas, see docs/ARCHITECTURE.md) and whether the PTX uses ``wgmma.mma_async`` (Hopper's
tensor-core instruction) or only ``mma.sync``.

    .venv/bin/python benchmarks/rel_attention_compile_facts.py [--out table.md] [-k substring]

Run without TRITON_INTERPRET (the script unsets it before importing triton). Prints a
markdown table (one row per distinct compile); a cold compile takes seconds to a minute per
kernel on this project's 2-core machines.
"""
import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _compile_test_module():
    spec = importlib.util.spec_from_file_location(
        "ctxfast_test_triton_compile", ROOT / "tests" / "test_triton_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cases(ct):
    """[(name, fn)]: the compile test's rel_attention cases, and fp32 with tf32x3."""
    import torch

    from ctxfast.kernels import rel_attention

    cases = [(name, fn) for name, _, fn in ct._cases() if name.startswith("rel_attention")]

    def tf32x3(D, **flags):
        def run():
            old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            try:
                B, H, Tq, Tk = 2, 2, 128, 256
                q, k, v = (torch.randn(B, H, T, D) for T in (Tq, Tk, Tk))
                r, u, w = torch.randn(H, Tk, D), torch.randn(H, D), torch.randn(H, D)
                out, lse = rel_attention.rel_attention_forward(q, k, v, r, u, w, num_splits=1,
                                                               **flags)
                rel_attention.rel_attention_backward(torch.randn_like(out), q, k, v, r, u, w,
                                                     out, lse, **flags)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = old
        return run

    cases.append(("rel_attention fp32/tf32x3 D=64 causal+window", tf32x3(64, window=100)))
    cases.append(("rel_attention fp32/tf32x3 D=128 causal", tf32x3(128)))
    return cases


def _ptxas(ptx: str):
    """(registers, spill store bytes, spill load bytes) of the PTX's kernel, sm_90a."""
    import triton
    exe = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([str(exe), "-v", "-arch=sm_90a", str(src), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    log = res.stdout + res.stderr
    if res.returncode:
        raise RuntimeError(f"ptxas failed:\n{log}")
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                       log).groups())
    return regs, stores, loads


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    args = parser.parse_args()
    import torch

    ct = _compile_test_module()
    rows, seen = [], set()
    for name, fn in _cases(ct):
        if args.k not in name:
            continue
        torch.manual_seed(0)
        for kernel, kargs, kwargs in ct._record(fn):
            if not kernel.__name__.startswith("_rel_attn"):
                continue
            spec = ct._specialise(kernel, kargs, kwargs)
            key = (kernel.__name__, repr(spec))
            if key in seen:
                continue
            seen.add(key)
            t0 = time.time()
            compiled = ct._compile(kernel, *spec, 90)
            ptx = compiled.asm["ptx"]
            regs, stores, loads = _ptxas(ptx)
            const = {n: spec[1][(i,)] for i, n in enumerate(kernel.arg_names)
                     if (i,) in spec[1] and n in ("BLOCK_M", "BLOCK_N", "BAND", "PRECISION")}
            rows.append(dict(
                kernel=kernel.__name__, case=name, shared=compiled.metadata.shared,
                regs=regs, spill=f"{stores}/{loads}", wgmma="wgmma.mma_async" in ptx,
                tile=f"{const.get('BLOCK_M')}x{const.get('BLOCK_N')} band {const.get('BAND')}",
                warps=spec[3].get("num_warps"), stages=spec[3].get("num_stages"),
                precision=const.get("PRECISION"), seconds=time.time() - t0))
            print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    lines = ["| kernel | case | tile | warps/stages | precision | shared (B) | registers | "
             "spill st/ld (B) | wgmma |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['case']} | {r['tile']} | {r['warps']}/{r['stages']} "
                     f"| {r['precision']} | {r['shared']} | {r['regs']} | {r['spill']} | "
                     f"{'yes' if r['wgmma'] else 'no'} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
