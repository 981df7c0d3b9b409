"""How many operations one training step of a model dispatches, per backend and phase:
every aten op and every ctxfast op that reaches the dispatcher (on a GPU each is at least
one kernel launch, and at small sizes the host's time per launch is what a step costs),
counted with a TorchDispatchMode on the CPU.

For the AWD-LSTM train step (forward + loss, backward, AdamW) this answers the question of
the LSTM speed issue ("on CPU, count the launches per step that each path makes"): fastai's
way (``nn.LSTM`` wrapped in ``WeightDropout``, which writes a dropped copy of ``W_hh`` into
the module before each forward), our ``eager`` backend (a Python loop over time steps) and
``ctxfast`` (the model's fused path: one op per layer and direction for the recurrence,
each way; on the CPU that op is the ``cpu`` backend's, and the ``cuda`` backend makes the
same calls at this level, its kernels inside).

    python benchmarks/count_dispatches.py                      # awd_lstm 200-576, 3 ways
    python benchmarks/count_dispatches.py --case ULMFiT --top 12
    python benchmarks/count_dispatches.py --json out.json

Counts, not times; the op names say what each path does per step. ``host reads`` counts
the ops that bring a tensor's value to the host (``.item()``, ``int(t)``, ``bool(t)``,
``torch.equal``, and ``nonzero`` / boolean-mask indexing, whose output size is data): on a GPU each is a host-device synchronisation, which stalls the queue
of launches. ``--as-on-gpu`` turns off the value checks the models and ops make on CPU
tensors only (``ctxfast.ops._common.VALUE_CHECK_DEVICES``), so that the reads left are
those a GPU step would make (the optimizer's are its step counters, CPU tensors there).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models as BM  # noqa: E402


#: Ops that read a value to the host: a synchronisation on a GPU.
HOST_READS = ("aten._local_scalar_dense", "aten.equal", "aten.is_nonzero", "aten.item",
              "aten.nonzero", "aten.masked_select")    # the last two: an output sized by data


class CountOps(TorchDispatchMode):
    """Counts the ops dispatched inside the block, by name (``aten.mm``, ``ctxfast.…``)."""

    def __init__(self):
        super().__init__()
        self.counts: Dict[str, int] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(getattr(func, "overloadpacket", func))] += 1
        return func(*args, **(kwargs or {}))


def _case(model: str, name: str) -> BM.Case:
    for case in BM.QUICK_CASES + BM.FULL_CASES:
        if case.model == model and case.label == name:
            return case
    names = sorted({c.label for c in BM.QUICK_CASES + BM.FULL_CASES if c.model == model})
    raise SystemExit(f"no {model} case {name!r} (cases: {', '.join(names)})")


def count_step(case: BM.Case, backend: str) -> Dict[str, Dict[str, int]]:
    """{phase: {op: count}} of one training step (after an uncounted one), on the CPU."""
    device = torch.device("cpu")
    wl = BM.WORKLOADS[case.model]
    model, _ = BM._models(case, backend, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(1)
    batch = wl.batch(case, device, torch.float32)

    def step(count: bool):
        phases = {}

        def phase(name, fn):
            if not count:
                return fn()
            with CountOps() as mode:
                out = fn()
            phases[name] = dict(mode.counts)
            return out

        phase("zero_grad", lambda: opt.zero_grad(set_to_none=True))
        loss = phase("forward + loss", lambda: wl.run(model, batch)[0])
        phase("backward", loss.backward)
        phase("optimizer", opt.step)
        return phases

    step(False)
    return step(True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", default=["awd_lstm"], choices=sorted(BM.WORKLOADS))
    ap.add_argument("--case", default="200-576")
    ap.add_argument("--backends", nargs="+", default=None,
                    help="model backends (ctxfast, eager; fastai for awd_lstm); default all")
    ap.add_argument("--top", type=int, default=8, help="ops listed per backend and phase")
    ap.add_argument("--as-on-gpu", action="store_true",
                    help="no value checks of CPU tensors (what a GPU step runs)")
    ap.add_argument("--json", help="write [{model, case, counts: {backend: {phase: {op: "
                                   "count}}}}] here")
    args = ap.parse_args(argv)
    if args.as_on_gpu:
        from ctxfast.ops import _common as ops_common
        ops_common.VALUE_CHECK_DEVICES = ()
    records = []
    for model in args.model:
        case = _case(model, args.case)
        backends = args.backends or (["fastai", "eager", "ctxfast"] if model == "awd_lstm"
                                     else ["eager", "ctxfast"])
        result = {}
        print(f"{case.name}: ops dispatched per train step")
        for backend in backends:
            phases = count_step(case, backend)
            result[backend] = phases
            total = sum(sum(c.values()) for c in phases.values())
            reads = {p: sum(n for op, n in ops.items() if op in HOST_READS)
                     for p, ops in phases.items()}
            print(f"  {backend}: {total} ops; host reads " +
                  ", ".join(f"{p} {n}" for p, n in reads.items()))
            for phase, ops in phases.items():
                top = sorted(ops.items(), key=lambda kv: -kv[1])[:args.top]
                print(f"    {phase:15s} {sum(ops.values()):6d}  " +
                      ", ".join(f"{op} x{n}" for op, n in top))
        records.append(dict(model=case.model, case=case.name, B=case.B, T=case.T,
                            counts=result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
