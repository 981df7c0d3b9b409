"""Instructions a tile: the loops of a Triton kernel's sm_90 SASS, counted without a GPU.

Compiles one launch of ``tests/test_triton_compile.py``'s cases (the launch rows the
launchers pick on CUDA), disassembles the cubin with the ``nvdisasm`` Triton bundles, and
prints, for each loop, its instructions by opcode (predicates and modifiers dropped:
``@!P0 FSEL.xx`` counts as ``FSEL``), with the kernel's registers and spills (the bundled
``ptxas -v``)::

    python benchmarks/sass_loops.py --list
    python benchmarks/sass_loops.py "rel_attention bf16 D=64 causal (training), TMA" _rel_attn_fwd
    python benchmarks/sass_loops.py "attention bf16 D=64 causal" dkdv --ops HGMMA,SHFL,LDL
    python benchmarks/sass_loops.py "rel_attention bf16 D=64 causal, gemm dr" _rel_attn_bwd_dq \
        --override 'rel_attention:{"dq": [4, 1]}'

A loop is a backward branch to a label and the instructions between them, that is, one
trip of the loop's body when nothing inside it branches. Not loops, and left out:

* a span with an ``EXIT`` in it. With TMA, the barrier waits (``SYNCS.PHASECHK``) that
  may spin are placed out of line after the kernel's ``EXIT``; each returns with a branch
  back to the middle of its loop, a backward branch whose span covers the rest of the
  kernel, epilogue included;
* the spin loops themselves (``--spin`` shows them): two or three instructions, a wait and
  its branch.

What the counts are: issue slots of a warp per trip (each instruction is issued once per
warp). They say nothing of latency, of the tensor cores' time, or of shared-memory bank
conflicts; a timing on a GPU does. Used for benchmarks/NOTES.md's "instructions a tile".

``--loads`` also lists the loads inside loops that Triton's pipeliner left in place (plain
``tt.load`` in the TTGIR; the staged ones are ``async_copy`` / TMA copies): it stages only
loads that feed a ``tl.dot`` operand, so a load whose value a loop adds, compares or stores
waits in the iteration that uses it (as rel_attention's row bias did)::

    python benchmarks/sass_loops.py "lstm bf16 ULMFiT B=64 H=1152 mask" lstm_fwd --loads
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def opcode(text: str) -> str:
    """``FSEL`` of ``@!P1 FSEL R108, R25, R24, !P1`` (predicate and modifiers dropped)."""
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    return text.split()[0].split(".")[0]


def loops(sass: str, spin: bool = False):
    """[(first line, last line, Counter of opcodes)] of the loops in ``sass`` (nvdisasm
    text), in order of their back branches."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) for m in [_LABEL.match(line)] if m}
    found = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if not m or labels.get(m.group(1), i) >= i:
            continue
        body = [_INSTR.search(x) for x in lines[labels[m.group(1)]:i + 1]]
        ops = collections.Counter(opcode(x.group(1)) for x in body if x)
        if ops["EXIT"] or (not spin and sum(ops.values()) <= 3):
            continue
        found.append((labels[m.group(1)], i, ops))
    return found


_LOAD = re.compile(r"^(%[\w#]+) = tt\.load ")


def plain_loads(ttgir: str):
    """[(value name, pointer type)] of the ``tt.load`` ops inside loops (``scf.for`` /
    ``scf.while`` regions, nested regions included) of a kernel's TTGIR: the loads the
    pipeliner did not stage."""
    found, regions = [], []             # regions: is each open region (a) loop's?
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith("}") and regions:
            regions.pop()
        m = _LOAD.search(text)
        if m and any(regions):           # the type: after the last " : ", before loc(...)
            ty = text.rsplit(" loc(", 1)[0].rsplit(" : ", 1)[-1]
            found.append((re.sub(r"_\d+$", "", m.group(1)), ty))
        if text.endswith("{"):
            regions.append("scf.for" in text or "scf.while" in text)
    return found


def compile_case(case_name: str, kernel_part: str, arch: int = 90):
    """(kernel name, compiled kernel) of the first launch of ``case_name`` whose kernel's
    name contains ``kernel_part``."""
    import torch

    import test_triton_compile as tc

    for case, _archs, fn in tc._cases():
        if case != case_name:
            continue
        torch.manual_seed(0)
        for kernel, args, kwargs in tc._record(fn):
            if kernel_part in kernel.__name__:
                return kernel.__name__, tc._compile(kernel, *tc._specialise(kernel, args, kwargs),
                                                    arch)
        raise SystemExit(f"case {case_name!r} launches no kernel named like {kernel_part!r}")
    raise SystemExit(f"no case {case_name!r} (--list shows them)")


def disassemble(cubin: bytes) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", nargs="?", help="a case of tests/test_triton_compile.py")
    p.add_argument("kernel", nargs="?", default="", help="part of the kernel's name")
    p.add_argument("--list", action="store_true", help="print the cases and stop")
    p.add_argument("--ops", default="", help="comma-separated opcodes to print (default: all)")
    p.add_argument("--spin", action="store_true", help="also print the barrier spin loops")
    p.add_argument("--sass", metavar="FILE", help="also write the whole SASS here")
    p.add_argument("--loads", action="store_true",
                   help="also list the loads inside loops the pipeliner left in place")
    p.add_argument("--override", action="append", default=[], metavar="MODULE:JSON",
                   help="launch rows for the recording: kernels.MODULE.LAUNCH_OVERRIDE "
                        "updated with the JSON dict (lists for tuples), e.g. "
                        "'rel_attention:{\"dq\": [4, 1]}'")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    import test_triton_compile as tc

    if args.list or not args.case:
        for case, _archs, _fn in tc._cases():
            print(case)
        return
    import importlib
    import json
    for item in args.override:
        module, _, rows = item.partition(":")
        table = importlib.import_module(f"ctxfast.kernels.{module}").LAUNCH_OVERRIDE
        table.update({k: tuple(v) if isinstance(v, list) else v
                      for k, v in json.loads(rows).items()})
    name, ck = compile_case(args.case, args.kernel)
    sass = disassemble(ck.asm["cubin"])
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    facts = tc._ptxas_facts(ck.asm["ptx"], 90)
    print(f"{name}: {facts['regs']} registers, spills {facts['spill_stores']} B stored / "
          f"{facts['spill_loads']} B loaded, {ck.metadata.shared} B shared memory")
    wanted = [o for o in args.ops.split(",") if o]
    for first, last, ops in loops(sass, args.spin):
        shown = [(o, ops[o]) for o in wanted] if wanted else ops.most_common()
        print(f"loop at SASS lines {first}-{last}: {sum(ops.values())} instructions; "
              + " ".join(f"{o} {n}" for o, n in shown))
    if args.loads:
        found = plain_loads(ck.asm["ttgir"])
        print(f"plain loads in loops (TTGIR): {len(found)}")
        for (name, ty), n in collections.Counter(found).most_common():
            print(f"  {n} x {name}: {ty}")


if __name__ == "__main__":
    main()
