"""What first-call tuning (``CTXFAST_AUTOTUNE=on``, kernels/_tune.py) gives on this GPU:
per case, ctxfast.attention and ctxfast.rel_attention (triton) with the table rows and with
the rows the tuner chose (attention also against SDPA), forward and forward + backward, and
which rows won.

For each case of ``CASES`` (the benchmark's headline CUDA cases, bf16): time the op with
tuning off (the tables), call it once with tuning on (which tunes its forward and its
backward: every candidate compiled, run on these inputs, checked against the table row's
outputs, timed), time it tuned, then time the table rows again and SDPA (where SDPA can
express the mask). Timing is the tuner's own (``_tune._time_us``: CUDA events over
back-to-back calls queued behind a spin kernel, best of 3 rounds of ~5 ms), the same for
every column; "table" is the better of the two table timings (before and after), so a
drift between them shows in ``table_us_runs``. The tuned rows' outputs are checked only
against the table row's (the tuner's agreement rule); the table rows are the ones the
tests check against float64.

    python benchmarks/tune_report.py --out tune.json [--time-budget 240]
    TRITON_INTERPRET=1 python benchmarks/tune_report.py --quick     # CPU: the steps run

Output: a printed table (µs, and tuned / table, tuned / SDPA speedups) and with --out a
JSON of the cases, the rows chosen per kind and every trial run's record (kernel,
candidate, µs, agreement, error): the rows to adopt into the tables come from it. The JSON
is rewritten after each case, and on SIGTERM (a step's ``timeout``) with every trial timed
so far (``"killed": true``): a case's tuning can take minutes of compiles.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ctxfast  # noqa: E402
from bench_attention import Case, _mask_kwargs, _op, flops  # noqa: E402
from ctxfast.kernels import _tune  # noqa: E402

class RelCase(tuple):
    """A rel_attention case: (B, H, Tq, mem, D, dtype, modes)."""

    @property
    def name(self):
        B, H, Tq, mem, D, dtype, _ = self
        return f"rel_attention {str(dtype)[6:]} B{B} H{H} Tq{Tq} mem{mem} D{D}"


#: In the order a budget-cut report should have them: Transformer-XL training first
#: (rel_attention bf16: the furthest from its goal, 5x ctxfast.attention's time at its shape
#: in round 5, and the most untimed candidates: the row bias product, the register-capped
#: rows, the stored-dS backward at two stages), attention's GPT-2 and long causal D 128 cases
#: (D 128's backward is the widest gap to SDPA), ctxfast.attention at the rel_attention
#: shape (the position term's cost, which should stay within 1.6x),
#: long causal D 64 and XL evaluation's forward (fp32, 128 queries against 3,800 keys),
#: then BERT, Transformer-XL's attention with memory, XLNet.
CASES = (
    RelCase((4, 16, 512, 1024, 64, torch.bfloat16, ("fwd", "fwd+bwd"))),
    Case("causal", (16, 12, 1024, 1024, 64), "GPT-2", ("cuda",)),
    Case("causal", (4, 16, 4096, 4096, 128), "sweep", ("cuda",)),
    Case("causal-memory", (4, 16, 512, 1536, 64), "rel-shape", ("cuda",)),
    Case("causal", (4, 32, 4096, 4096, 64), "sweep", ("cuda",)),
    RelCase((8, 8, 128, 3672, 64, torch.float32, ("fwd",))),
    Case("padding", (32, 12, 512, 512, 64), "BERT-base", ("cuda",)),
    Case("causal-memory", (22, 8, 512, 1024, 64), "TXL-enwik8", ("cuda",)),
    Case("perm-query", (32, 12, 512, 512, 64), "XLNet-base", ("cuda",)),
)
QUICK_CASES = (Case("causal", (1, 2, 40, 40, 32)), Case("padding", (1, 2, 24, 24, 32)),
               RelCase((1, 2, 24, 16, 16, torch.float32, ("fwd", "fwd+bwd"))))


def _fwd_and_bwd(op, ins, g):
    """(fwd, fwd+bwd) callables of op(*ins) with upstream gradient g."""
    def fwd():
        with torch.no_grad():
            op(*ins)

    def fwd_bwd():
        torch.autograd.grad(op(*ins), ins, g)
    return fwd, fwd_bwd


def _rel_calls(case, device):
    from kernel_breakdown import make_inputs
    B, H, Tq, mem, D, dtype, _ = case
    ins, g = make_inputs("rel_attention", B, H, Tq, mem, D, device, dtype)
    return {"triton": _fwd_and_bwd(lambda *a: ctxfast.rel_attention(*a, backend="triton"),
                                   ins, g)}


def _calls(case, device, dtype):
    """{name: (fwd, fwd+bwd)} callables on one set of inputs: ctxfast.attention (triton)
    and SDPA (None where it cannot take the mask); rel_attention (triton) for a RelCase."""
    if isinstance(case, RelCase):
        return _rel_calls(case, device)
    B, H, Tq, Tk, D = case.shape
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True)
               for T in (Tq, Tk, Tk))
    g = torch.randn(B, H, Tq, D, device=device, dtype=dtype)
    mask_kw = _mask_kwargs(case, device)
    ops = {"triton": _op("triton", case, mask_kw, device)[0]}
    if not case.mask.startswith("perm"):
        ops["sdpa"] = _op("sdpa", case, mask_kw, device)[0]
    return {name: _fwd_and_bwd(op, (q, k, v), g) for name, op in ops.items()}


def _time(fn, device):
    fn()                                           # compiled (and tuned) before timing
    return _tune._time_us(fn, {}, device)


def report(device, dtype, cases, budget_s, rows=None, written=lambda rows: None):
    """The rows of ``cases`` (appended to ``rows`` as each case ends, ``written(rows)``
    called then: the JSON is rewritten after every case)."""
    start = time.monotonic()
    rows = [] if rows is None else rows
    for case in cases:
        if time.monotonic() - start > budget_s:
            rows.append({"case": case.name, "error": "not run: time budget"})
            continue
        calls = _calls(case, device, dtype)
        row = {"case": case.name, "us": {}, "table_us_runs": {}}
        saved = _tune.MODE
        modes = case[6] if isinstance(case, RelCase) else case.modes
        try:
            for i, mode in enumerate(("fwd", "fwd+bwd")):
                if mode not in modes:
                    continue
                _tune.MODE = "off"
                before = _time(calls["triton"][i], device)
                _tune.MODE = "on"
                n = len(_tune.records())
                tuned = _time(calls["triton"][i], device)   # the first call tunes
                row.setdefault("trials", 0)
                row["trials"] += len(_tune.records()) - n
                _tune.MODE = "off"
                after = _time(calls["triton"][i], device)
                row["table_us_runs"][mode] = [before, after]
                row["us"][mode] = {"table": min(before, after), "tuned": tuned}
                if "sdpa" in calls:
                    row["us"][mode]["sdpa"] = _time(calls["sdpa"][i], device)
                if not isinstance(case, RelCase):
                    row["us"][mode]["tflops_tuned"] = flops(case, mode) / tuned / 1e6
        except Exception as e:  # noqa: BLE001  (one case's failure must not end the report)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        finally:
            _tune.MODE = saved
        rows.append(row)
        written(rows)                   # (before the line: a reader of the log finds it)
        print(_line(row))
        sys.stdout.flush()
    return rows


def _line(row):
    """The case's lines: "case <name>" (gpu_round.sh's summary keeps it: "^case "), then one
    indented line per mode with its times and ratios."""
    if "error" in row:
        return f"case {row['case']:44s} {row['error']}"
    parts = [f"case {row['case']:44s}"]
    for mode, us in row["us"].items():
        part = (f"{mode:7s} table {us['table']:9.1f} tuned {us['tuned']:9.1f} us "
                f"({us['table'] / us['tuned']:.2f}x)")
        if "sdpa" in us:
            part += f" sdpa {us['sdpa']:9.1f} ({us['sdpa'] / us['tuned']:.2f}x)"
        parts.append(part)
    return "\n    ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny cases (the CPU interpreter)")
    ap.add_argument("--time-budget", type=float, default=240.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        _tune.ON_CPU = True
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    quick = args.quick or device.type != "cuda"
    rows = []

    def write(rows, killed=False):
        """The JSON so far: the finished cases, the rows chosen, every trial recorded (a
        case cut by a timeout keeps the candidates it timed)."""
        if args.out:
            _write(args.out, device, rows, killed)

    def on_term(signum, frame):     # gpu_round's step timeout: keep what was measured
        write(rows, killed=True)
        print(f"tune_report: stopped by signal {signum}; {len(_tune.records())} trials kept")
        sys.stdout.flush()
        os._exit(124)
    signal.signal(signal.SIGTERM, on_term)
    report(device, dtype, QUICK_CASES if quick else CASES, args.time_budget, rows, write)
    for c in _chosen():
        print("chosen", " ".join(c["kind"][:9]), c["rows"] or "table rows")
    write(rows)
    return 0


def _chosen():
    return [{"kind": [str(x) for x in kind], "rows": {k: list(v) if isinstance(v, tuple)
                                                     else v for k, v in r.items()}}
            for kind, r in _tune.tuned().items()]


def _write(path, device, rows, killed=False):
    records = [dict(r, kind=[str(x) for x in r["kind"]],
                    candidate={k: list(v) if isinstance(v, tuple) else v
                               for k, v in r["candidate"].items()})
               for r in _tune.records()]
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda"
                   else "cpu", "torch": torch.__version__,
                   "triton": __import__("triton").__version__, "rows": rows,
                   "chosen": _chosen(), "records": records, "killed": killed}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
