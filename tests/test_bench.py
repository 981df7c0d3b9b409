"""The benchmark infrastructure (benchmarks/_common.py, report.py, plot.py,
readme_table.py): correctness of the pipeline, never speed.

Two tests run pytest subprocesses for real (the quick rel_shift suite on the CPU, ~10-20 s
on the 2-core machines; and a hand-made suite that runs out of memory, ~5 s); the others
check the timing helper, the OOM handling, the JSON-to-records conversion, the writer,
the plots and the README table on hand-made input.
"""
import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).parents[1] / "benchmarks"
REPORT_PY = BENCH_DIR / "report.py"
#: The scripts that run Triton kernels need a GPU or the interpreter.
needs_triton_kernels = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the Triton kernels need a GPU or the interpreter")
KEYS = {"op", "case", "mode", "backend", "baseline", "ms", "baseline_ms", "speedup",
        "tflops", "gbps", "tokens_per_s", "baseline_tokens_per_s", "peak_mem_bytes", "baseline_peak_mem_bytes", "ms_min", "ms_max",
        "spread", "baseline_spread", "T", "series", "note", "dtype", "device", "torch",
        "triton", "date", "timer", "reps", "op_backends", "profiler_ms", "relative_to",
        "relative", "paired_peer", "paired_speedup", "paired_q1", "paired_q3",
        "paired_rounds"}
TABLE_HEAD = ("| op | case | mode | backend | ms | min ms | baseline | baseline ms | speedup "
              "| rate | peak MiB | spread | note |")


def _load(name, filename):
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report():
    return _load("ctxfast_bench_report", "report.py")


@pytest.fixture(scope="module")
def common(report):
    return sys.modules["ctxfast_bench_common"]      # the instance report.py loaded


@pytest.fixture(scope="module")
def readme_table():
    return _load("ctxfast_bench_readme_table", "readme_table.py")


class FakeBenchmark:
    """The part of pytest-benchmark's fixture that _common uses (and its once-only rule)."""

    def __init__(self):
        self.extra_info, self.group, self._mode, self.pedantic_calls = {}, None, None, []

    def pedantic(self, target, args=(), kwargs=None, rounds=1, iterations=1,
                 warmup_rounds=0):
        if self._mode:
            raise RuntimeError("fixture used twice")
        self._mode = "pedantic"
        self.pedantic_calls.append((target, rounds, iterations))
        result = None
        for _ in range(rounds * iterations):
            result = target(*args)
        return result


def _bench(backend, median_s, *, op="rel_shift", case="B1 H1 Tq2 Tk4", mode="fwd",
           device_name="Test CPU (2 threads)", **info):
    """One entry of a pytest-benchmark JSON, as an old bench_*.py wrote it (stats only)
    or, with `info` (e.g. ms=, spread=, oom=, flops=), as _common.measure writes it."""
    return {
        "name": f"test_{op}[{case}-{mode}-{backend}]",
        "stats": {"min": median_s * 0.9, "max": median_s * 2, "mean": median_s * 1.1,
                  "median": median_s, "rounds": 10, "iterations": 1},
        "extra_info": {"op": op, "case": case, "mode": mode, "backend": backend,
                       "dtype": "float32", "device": "cpu", "device_name": device_name,
                       "torch": "9.9.9", "triton": "8.8.8", **info},
    }


# --------------------------------------------------------------------------- end to end

def test_quick_run_writes_report(report, tmp_path, monkeypatch):
    # Only rel_shift, so the test does not grow with every op's benchmarks; forced onto the
    # CPU so the "cpu" backend is there on a GPU machine too; a tenth of the timing budget
    # (the pipeline is under test, not the numbers); one thread (--threads 1: sane timings
    # on a shared machine, and the thread count must reach the device name).
    monkeypatch.setenv("CTXFAST_BENCH_BUDGET_SCALE", "0.1")
    result = report.run(tmp_path, quick=True, ops=["rel_shift"], device="cpu", echo=False,
                        threads=1)

    assert result["failed"] == []
    json_path, md_path = Path(result["json_path"]), Path(result["md_path"])
    assert json_path.parent == tmp_path and json_path.exists() and md_path.exists()
    data = json.loads(json_path.read_text())
    assert set(data) == {"device", "date", "written", "torch", "triton", "notes", "records"}
    cpu_name = report.device_name("cpu").replace(f"({torch.get_num_threads()} threads)",
                                                 "(1 threads)")
    assert data["device"] == cpu_name and cpu_name.endswith("(1 threads)")
    # the notes say what code the CPU kernels took (the same CPU name can run different code)
    assert f"CPU code: {torch.ops.ctxfast.cpu_code_paths()}" in data["notes"], data["notes"]
    records = data["records"]
    assert records == result["records"]

    backends = {r["backend"] for r in records}
    assert {"cpu", "eager"} <= backends
    assert "eager-pad-view" not in backends      # the baseline is no record of its own
    assert "triton" not in backends              # never timed under the interpreter
    for r in records:
        assert set(r) == KEYS, r
        assert r["op"] == "rel_shift" and r["baseline"] == "eager-pad-view"
        assert r["mode"] in ("fwd", "fwd+bwd") and r["dtype"] == "float32"
        assert r["device"] == cpu_name and r["date"] == data["date"]
        assert 0 < r["ms_min"] <= r["ms"] <= r["ms_max"] and r["baseline_ms"] > 0
        assert math.isclose(r["speedup"], r["baseline_ms"] / r["ms"], rel_tol=1e-12)
        assert r["spread"] >= 0 and r["baseline_spread"] >= 0
        assert r["peak_mem_bytes"] is None and r["baseline_peak_mem_bytes"] is None  # CPU
        assert r["tflops"] is None and r["gbps"] > 0        # memory-bound: GB/s
        # GB/s of the least traffic: x read, out written (fp32); fwd+bwd the same twice
        nbytes = math.prod(int(s.lstrip("BHTqk")) for s in r["case"].split()) * 4
        nbytes *= 2 if r["mode"] == "fwd" else 4
        assert math.isclose(r["gbps"] * 1e9 * r["ms"] * 1e-3, nbytes, rel_tol=1e-9), r
        assert r["T"] == int(r["case"].split()[2][2:]) and r["series"] == "sweep"
        assert r["note"] is None
    # every quick case and mode has both backends
    pairs = {(r["case"], r["mode"], r["backend"]) for r in records}
    for case in ("B2 H4 Tq64 Tk128", "B4 H8 Tq128 Tk256"):
        for mode in ("fwd", "fwd+bwd"):
            assert {(case, mode, "cpu"), (case, mode, "eager")} <= pairs

    md = md_path.read_text()
    assert cpu_name in md and TABLE_HEAD in md
    assert "timed twice" in md and "not measured on the CPU" in md
    assert md.count("| rel_shift |") == len(records)
    pngs = sorted(tmp_path.glob("*.png"))                 # matplotlib is in the venv
    assert [p.name for p in pngs] == [f"{json_path.stem}-rel_shift.png"]
    assert pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


FAKE_SUITE = '''
import sys
sys.path.insert(0, {bench_dir!r})
import pytest
import torch
import _common

OOM = "CUDA out of memory. Tried to allocate 64.00 GiB"


@pytest.mark.parametrize("case", ["small", "huge"])
@pytest.mark.parametrize("backend", ["mine", "base"])
def test_fakeop(benchmark, case, backend):
    _common.describe(benchmark, op="fakeop", case=case, mode="fwd", backend=backend,
                     dtype=torch.float32, device=torch.device("cpu"), baseline="base",
                     T=8 if case == "small" else 64, flops=1e6)
    x = torch.randn(64)
    with _common.oom_guard(benchmark):
        if case == "huge" and backend == "mine":
            raise torch.cuda.OutOfMemoryError(OOM)    # in the setup: recorded by oom_guard

        def fn(x):
            if case == "huge":                         # the baseline runs out in measure()
                raise torch.cuda.OutOfMemoryError(OOM)
            return x * 2

        _common.measure(benchmark, fn, [(x,)], torch.device("cpu"), budget_s=0.01)
'''


def _quick_report_of(report, tmp_path, name: str, suite: str):
    """(suites folder, result) of `report.run` (quick, CPU) over one suite file `name` with
    the source `suite` (its ``{bench_dir}`` filled in), in a folder of its own."""
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / name).write_text(suite.format(bench_dir=str(BENCH_DIR)))
    return suites, report.run(tmp_path / "out", quick=True, device="cpu", plots=False,
                              echo=False, bench_dir=suites)


def test_new_suite_and_oom_reach_the_report(report, tmp_path):
    # A suite the report has never heard of (not in BASELINES: its baseline comes from
    # extra_info) is discovered from its file name; OOMs in the setup and in measure()
    # become records, not crashes, through a real pytest-benchmark run.
    suites, result = _quick_report_of(report, tmp_path, "bench_fakeop.py", FAKE_SUITE)
    assert list(report.available_ops(suites)) == ["fakeop"]
    assert result["failed"] == []
    got = {r["case"]: r for r in result["records"]}
    assert set(got) == {"small", "huge"}
    small, huge = got["small"], got["huge"]
    assert small["baseline"] == "base" and small["ms"] > 0 and small["speedup"] > 0
    assert small["tflops"] > 0 and small["note"] is None
    assert huge["ms"] is None and huge["baseline_ms"] is None and huge["speedup"] is None
    assert huge["note"] == ("OOM: CUDA out of memory. Tried to allocate 64.00 GiB; "
                            "baseline OOM: CUDA out of memory. Tried to allocate 64.00 GiB")
    md = Path(result["md_path"]).read_text()
    assert "| fakeop | huge | fwd | mine | — | — | base | — | — |" in md
    assert "baseline OOM: CUDA out of memory" in md


# --------------------------------------------------------------------------- measure

def test_measure_times_two_passes_and_rotates_inputs(common):
    sets = [(torch.randn(8),), (torch.randn(8),), (torch.randn(8),)]
    seen = []

    def fn(x):
        seen.append(id(x))
        return x + 1

    bench = FakeBenchmark()
    out = common.measure(bench, fn, sets, torch.device("cpu"), budget_s=0.02, min_rounds=6)
    info = bench.extra_info
    assert torch.is_tensor(out)
    assert info["timer"] == "perf_counter" and info["peak_mem_bytes"] is None
    assert info["rounds"] >= 6 and info["iterations"] >= 1
    assert 0 < info["ms_min"] <= info["ms"] <= info["ms_max"]
    for m in (info["ms_pass1"], info["ms_pass2"]):
        assert info["ms_min"] <= m <= info["ms_max"]
    assert math.isclose(info["spread"], abs(info["ms_pass1"] - info["ms_pass2"])
                        / min(info["ms_pass1"], info["ms_pass2"]))
    assert len(bench.pedantic_calls) == 1 and "oom" not in info
    # every set used, in turn
    assert set(seen) == {id(s[0]) for s in sets}
    assert seen[:6] == [id(sets[i % 3][0]) for i in range(6)]


def test_time_paired_alternates_and_times_only_the_calls(common):
    # Round r: `iterations` calls of fn and `peer_iterations` of peer on args[r], fn first
    # in even rounds, peer first in odd ones; one time per round and side.
    log = []
    args = [(i,) for i in range(5)]
    ours, theirs = common._time_paired(lambda i: log.append(("fn", i)),
                                       lambda i: log.append(("peer", i)), args, 2, 3)
    assert len(ours) == len(theirs) == 5
    want = []
    for r in range(5):
        a, b = [("fn", r)] * 2, [("peer", r)] * 3
        want += a + b if r % 2 == 0 else b + a
    assert log == want
    assert all(t >= 0 for t in ours + theirs)


class _VirtualClock:
    """benchmarks/_common.py's ``time`` with a ``perf_counter`` that moves only when a timed
    function says so (the rest is the real module): the harness's pairing logic checked
    without the machine's load in the numbers. With busy-waiting functions instead, a
    fresh-clone CI beside other jobs read q3 = 5.96 for a peer exactly twice as slow."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def test_measure_paired_on_the_cpu(common, monkeypatch):
    # A peer twice as slow reads ~2x in the interleaved rounds; the separate timing of fn
    # is the same as without a peer; CTXFAST_BENCH_PAIRED=0 and a GPU device skip it.
    clock = _VirtualClock()
    monkeypatch.setattr(common, "time", clock)

    def taking(seconds):
        def fn(*_):
            clock.now += seconds
        return fn
    sets = [(torch.randn(4),)]
    fn, peer = taking(1e-3), taking(2e-3)
    bench = FakeBenchmark()
    common.measure(bench, fn, sets, torch.device("cpu"), budget_s=0.05, min_rounds=10,
                   paired=("slow", peer))
    info = bench.extra_info
    p = info["paired"]
    assert p["peer"] == "slow" and p["rounds"] >= 10
    assert 1.6 < p["q1"] <= p["speedup"] <= p["q3"] < 2.5, p
    assert math.isclose(p["speedup"], 2.0, rel_tol=1e-6), p
    assert 0.9 < p["ms"] < 1.5 and 1.9 < p["peer_ms"] < 2.6
    assert 0.9 < info["ms"] < 1.5
    # a peer that raises leaves our own timing and says why
    def broken(*_):
        raise RuntimeError("peer broke\nsecond line")
    bench = FakeBenchmark()
    common.measure(bench, fn, sets, torch.device("cpu"), budget_s=0.01, min_rounds=10,
                   paired=("broken", broken))
    assert bench.extra_info["paired"] == {"peer": "broken", "error": "RuntimeError: peer broke"}
    assert 0.9 < bench.extra_info["ms"] < 1.5
    monkeypatch.setenv(common.PAIRED_ENV, "0")
    bench = FakeBenchmark()
    common.measure(bench, fn, sets, torch.device("cpu"), budget_s=0.01, min_rounds=10,
                   paired=("slow", peer))
    assert "paired" not in bench.extra_info


def test_records_and_tables_carry_the_interleaved_speedup(report, readme_table):
    paired = {"peer": "eager-pad-view", "speedup": 2.2, "q1": 2.1, "q3": 2.3, "rounds": 40,
              "ms": 2.0, "peer_ms": 4.4}
    data = {"datetime": "2026-11-21T10:00:00+00:00",
            "benchmarks": [_bench("cpu", 0.002, ms=2.0, paired=paired),
                           _bench("eager-pad-view", 0.006, ms=6.0),
                           _bench("cpu", 0.004, mode="fwd+bwd", ms=4.0),
                           _bench("eager-pad-view", 0.010, mode="fwd+bwd", ms=10.0)]}
    records = report.records_from_pytest_benchmark(data)
    got = {r["mode"]: r for r in records}
    assert math.isclose(got["fwd"]["speedup"], 3.0)          # the separate timings
    assert got["fwd"]["paired_speedup"] == 2.2 and got["fwd"]["paired_peer"] == "eager-pad-view"
    assert (got["fwd"]["paired_q1"], got["fwd"]["paired_q3"], got["fwd"]["paired_rounds"]) \
        == (2.1, 2.3, 40)
    assert "interleaved with eager-pad-view: 2.20x (quartiles 2.10x-2.30x, 40 rounds)" \
        in got["fwd"]["note"]
    assert got["fwd+bwd"]["paired_speedup"] is None
    failed = report.records_from_pytest_benchmark({"datetime": data["datetime"], "benchmarks": [
        _bench("cpu", 0.002, ms=2.0, paired={"peer": "eager-pad-view", "error": "E: x"}),
        _bench("eager-pad-view", 0.006, ms=6.0)]})
    assert failed[0]["paired_speedup"] is None and math.isclose(failed[0]["speedup"], 3.0)
    assert "interleaved timing with eager-pad-view failed: E: x" in failed[0]["note"]
    text = report.compact_tables(records)
    rows = {line.split()[4]: line for line in text.splitlines() if " cpu " in line}
    assert "interleaved" in text.splitlines()[1]
    assert rows["fwd"].rstrip().endswith("2.20x vs eager-pad-view")
    assert rows["fwd+bwd"].rstrip().endswith("—")
    md = readme_table.render({"device": "Test CPU", "date": "2026-11-21", "records": records},
                             "x.json")
    assert "| speedup | interleaved | best rate |" in md
    line = next(l for l in md.splitlines() if l.startswith("| rel_shift | **cpu**") and "| fwd |" in l)
    assert "| 3.00x | 2.20x |" in line
    # a peer other than the baseline is named in the cell
    other = [dict(r, paired_peer="sdpa") if r["mode"] == "fwd" else r for r in records]
    md = readme_table.render({"device": "Test CPU", "date": "2026-11-21", "records": other},
                             "x.json")
    assert "| 3.00x | 2.20x vs sdpa |" in md
    # a run without interleaved timings keeps the old columns
    plain = [dict(r, paired_speedup=None) for r in records]
    assert "interleaved" not in readme_table.render(
        {"device": "Test CPU", "date": "2026-11-21", "records": plain}, "x.json")


@pytest.mark.parametrize("fail_at", [0, 3, 12], ids=["first-call", "warm-up", "timing"])
def test_measure_records_oom(common, fail_at):
    calls = []

    def fn(x):
        calls.append(1)
        if len(calls) > fail_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\n"
                                              "more detail")
        return x

    bench = FakeBenchmark()
    out = common.measure(bench, fn, [(torch.randn(4),)], torch.device("cpu"),
                         budget_s=0.01, min_rounds=20)
    assert out is None
    info = bench.extra_info
    assert info["oom"] == "CUDA out of memory. Tried to allocate 2 GiB"
    assert info["ms"] is None and info["spread"] is None and info["peak_mem_bytes"] is None
    # pytest-benchmark still gets one (meaningless) run, so the entry reaches the JSON
    assert len(bench.pedantic_calls) == 1 and bench.pedantic_calls[0][1:] == (1, 1)


def test_measure_lets_other_errors_through(common):
    def fn(x):
        raise ValueError("a real bug")

    with pytest.raises(ValueError, match="a real bug"):
        common.measure(FakeBenchmark(), fn, [(torch.randn(4),)], torch.device("cpu"),
                       budget_s=0.01)


def test_oom_guard(common):
    bench = FakeBenchmark()
    with common.oom_guard(bench):
        raise torch.OutOfMemoryError("out of memory in the setup")
    assert bench.extra_info["oom"] == "out of memory in the setup"
    assert bench.extra_info["ms"] is None and len(bench.pedantic_calls) == 1

    bench = FakeBenchmark()
    with common.oom_guard(bench):
        pass
    assert bench.extra_info == {} and bench.pedantic_calls == []
    with pytest.raises(RuntimeError, match="not an OOM"):
        with common.oom_guard(FakeBenchmark()):
            raise RuntimeError("not an OOM")


def test_describe(common):
    bench = FakeBenchmark()
    common.describe(bench, op="attention", case="c1", mode="fwd", backend="sdpa",
                    dtype=torch.bfloat16, device=torch.device("cpu"), T=128, flops=10)
    info = bench.extra_info
    assert bench.group == "attention c1 fwd"
    assert info["dtype"] == "bfloat16" and info["device"] == "cpu"
    assert info["device_name"] == common.device_name("cpu")
    assert info["torch"] == torch.__version__ and info["T"] == 128 and info["flops"] == 10


def test_cpu_name_says_its_vector_isa(common):
    """A CPU's device name (and so its results folder) carries its widest vector ISA from
    /proc/cpuinfo: the cpu kernels run different code on AVX2 and AVX-512 hosts that a VM
    may give the same model name."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(l.split(":", 1)[1].split()) for l in f
                          if l.lower().startswith("flags")), set())
    except OSError:
        flags = set()
    name = common.device_name("cpu")
    want = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    if want is None:
        assert "AVX" not in name, name
    else:
        assert f", {want} (" in name, name


# --------------------------------------------------------------------------- records

def test_records_pair_with_baseline(report):
    data = {
        "datetime": "2026-11-21T10:00:00.123456+00:00",
        "benchmarks": [
            _bench("cpu", 0.002),
            _bench("eager-pad-view", 0.006),
            _bench("eager", 0.012),
            _bench("cpu", 0.004, mode="fwd+bwd"),
            _bench("eager-pad-view", 0.010, mode="fwd+bwd"),
            {"name": "test_unrelated", "stats": {"median": 1.0}, "extra_info": {}},
        ],
    }
    records = report.records_from_pytest_benchmark(data)
    got = {(r["mode"], r["backend"]): r for r in records}
    assert set(got) == {("fwd", "cpu"), ("fwd", "eager"), ("fwd+bwd", "cpu")}
    for r in records:
        assert set(r) == KEYS
        assert r["baseline"] == "eager-pad-view"
        assert r["date"] == "2026-11-21"
        assert r["device"] == "Test CPU (2 threads)"
        assert (r["torch"], r["triton"], r["dtype"]) == ("9.9.9", "8.8.8", "float32")
        assert r["T"] == 2                          # from "Tq2" in the case name
    assert math.isclose(got["fwd", "cpu"]["ms"], 2.0)
    assert math.isclose(got["fwd", "cpu"]["baseline_ms"], 6.0)
    assert math.isclose(got["fwd", "cpu"]["speedup"], 3.0)
    assert math.isclose(got["fwd", "eager"]["speedup"], 0.5)       # slower than the baseline
    assert math.isclose(got["fwd+bwd", "cpu"]["baseline_ms"], 10.0)  # same mode's baseline
    assert math.isclose(got["fwd+bwd", "cpu"]["speedup"], 2.5)


def test_records_relative_to_a_yardstick(report):
    # rel_attention's cpu/triton rows carry relative_to="ctxfast.attention": their time as a
    # multiple of that row's (same case, mode, dtype, device), in the record and its note;
    # without the yardstick row, nothing
    yard = _bench("ctxfast.attention", 0.004, op="rel_attention", baseline="eager-original")
    rows = [_bench("cpu", 0.006, op="rel_attention", relative_to="ctxfast.attention",
                   baseline="eager-original"),
            _bench("eager-original", 0.012, op="rel_attention", baseline="eager-original")]
    got = {r["backend"]: r for r in report.records_from_pytest_benchmark(
        {"benchmarks": rows + [yard]})}
    assert got["cpu"]["relative_to"] == "ctxfast.attention"
    assert math.isclose(got["cpu"]["relative"], 1.5)
    assert "1.50x the time of ctxfast.attention" in got["cpu"]["note"]
    assert got["ctxfast.attention"]["relative"] is None
    assert math.isclose(got["ctxfast.attention"]["speedup"], 3.0)
    # the yardstick is neither ours nor a peer: no "slower than ctxfast.attention" row
    compare = _load("ctxfast_bench_compare", "_compare.py")
    recs = list(got.values())
    assert {(p.ours, p.other) for p in compare.pairs(recs)} == {("cpu", "eager-original")}
    assert compare.peers(recs, "rel_attention") == ["eager-original"]
    (alone,) = [r for r in report.records_from_pytest_benchmark({"benchmarks": rows})]
    assert alone["relative"] is None and alone["relative_to"] is None
    assert "the time of" not in (alone["note"] or "")


def test_records_from_measure_rates_and_memory(report):
    # extra_info["ms"] (measure) wins over pytest-benchmark's stats; rates from the counts
    data = {"benchmarks": [
        _bench("triton", 1.0, op="attention", case="c", ms=2.0, ms_min=1.9, ms_max=2.5,
               spread=0.03, flops=4e12, min_bytes=8e9, peak_mem_bytes=3 << 20, T=512,
               series="GPT-2 causal D64"),
        _bench("eager", 1.0, op="attention", case="c", ms=8.0, spread=0.05,
               peak_mem_bytes=40 << 20),
    ]}
    (r,) = report.records_from_pytest_benchmark(data)
    assert r["ms"] == 2.0 and r["baseline_ms"] == 8.0 and r["speedup"] == 4.0
    assert math.isclose(r["tflops"], 2000.0) and math.isclose(r["gbps"], 4000.0)
    assert (r["ms_min"], r["ms_max"], r["spread"], r["baseline_spread"]) == (1.9, 2.5, 0.03,
                                                                             0.05)
    assert (r["peak_mem_bytes"], r["baseline_peak_mem_bytes"]) == (3 << 20, 40 << 20)
    assert (r["T"], r["series"]) == (512, "GPT-2 causal D64")
    md = report.markdown([r])
    assert "| attention | c | fwd | triton | 2.000 | 1.900 | eager | 8.000 | 4.00x | " \
           "2e+03 TFLOP/s | 3 / 40 | ±5% |  |" in md
    assert "not measured on the CPU" not in md        # peak memory is there
    assert "noise, not results" not in md             # spread 5%: not flagged
    r["baseline_spread"] = 0.5
    assert "Note: 1 of 1 rows have a spread above 20%: their speedups are noise" in \
        report.markdown([r])


def test_records_carry_tokens_per_second(report):
    # a model suite's tokens= (positions per call) gives ours and the baseline's tokens/s
    data = {"benchmarks": [
        _bench("ctxfast", 1.0, op="models", case="gpt B2 T32", mode="eval", ms=4.0,
               tokens=64, flops=1e9, baseline="eager"),
        _bench("eager", 1.0, op="models", case="gpt B2 T32", mode="eval", ms=16.0,
               tokens=64, baseline="eager"),
    ]}
    (r,) = report.records_from_pytest_benchmark(data)
    assert math.isclose(r["tokens_per_s"], 16000.0)
    assert math.isclose(r["baseline_tokens_per_s"], 4000.0)
    md = report.markdown([r])
    assert "| rate | tokens/s | peak MiB |" in md
    assert "| 4.00x | 250 GFLOP/s | 1.6e+04 / 4e+03 | — |" in md
    # op suites give no tokens: no column, None in the record
    (o,) = report.records_from_pytest_benchmark({"benchmarks": [
        _bench("cpu", 0.001), _bench("eager-pad-view", 0.002)]})
    assert o["tokens_per_s"] is None and o["baseline_tokens_per_s"] is None
    assert TABLE_HEAD in report.markdown([o])


def test_records_without_baseline(report):
    data = {"benchmarks": [_bench("cpu", 0.001, case="B9 H9 Tq9 Tk9"),
                           _bench("eager-pad-view", 0.005, case="B1 H1 Tq1 Tk1")]}
    (r,) = report.records_from_pytest_benchmark(data)
    assert r["case"] == "B9 H9 Tq9 Tk9"
    assert math.isclose(r["ms"], 1.0)
    assert r["baseline_ms"] is None and r["speedup"] is None and r["note"] == "no baseline"


def test_records_oom(report):
    data = {"benchmarks": [
        _bench("triton", 1.0, op="attention", case="a", ms=3.0),
        _bench("eager", 1.0, op="attention", case="a", oom="CUDA out of memory. X"),
        _bench("triton", 1.0, op="attention", case="b", oom="CUDA out of memory. Y"),
        _bench("eager", 1.0, op="attention", case="b", ms=5.0),
    ]}
    got = {r["case"]: r for r in report.records_from_pytest_benchmark(data)}
    a, b = got["a"], got["b"]
    assert a["ms"] == 3.0 and a["baseline_ms"] is None and a["speedup"] is None
    assert a["note"] == "baseline OOM: CUDA out of memory. X"
    assert b["ms"] is None and b["baseline_ms"] == 5.0 and b["speedup"] is None
    assert b["note"] == "OOM: CUDA out of memory. Y" and b["tflops"] is None


def test_records_pair_attention_with_eager(report):
    # attention's baseline is "eager", which is also a ctxfast backend name: it is the
    # baseline of attention only; rel_shift's "eager" in the same run stays a record.
    case = "causal B2 H4 Tq128 Tk128 D64"
    data = {"benchmarks": [
        _bench("triton", 0.001, op="attention", case=case),
        _bench("sdpa", 0.002, op="attention", case=case),
        _bench("flex", 0.004, op="attention", case=case),
        _bench("eager", 0.008, op="attention", case=case),
        _bench("triton", 0.003, op="attention", case=case, mode="fwd+bwd"),  # no eager
        _bench("eager", 0.012),                                              # rel_shift
        _bench("eager-pad-view", 0.006),
    ]}
    records = report.records_from_pytest_benchmark(data)
    got = {(r["op"], r["mode"], r["backend"]): r for r in records}
    assert set(got) == {("attention", "fwd", "triton"), ("attention", "fwd", "sdpa"),
                        ("attention", "fwd", "flex"), ("attention", "fwd+bwd", "triton"),
                        ("rel_shift", "fwd", "eager")}
    for (op, _, _), r in got.items():
        assert set(r) == KEYS
        assert r["baseline"] == ("eager" if op == "attention" else "eager-pad-view")
    for backend, speedup in (("triton", 8.0), ("sdpa", 4.0), ("flex", 2.0)):
        r = got["attention", "fwd", backend]
        assert r["case"] == case
        assert math.isclose(r["baseline_ms"], 8.0)
        assert math.isclose(r["speedup"], speedup)
    r = got["attention", "fwd+bwd", "triton"]              # no baseline of that mode
    assert math.isclose(r["ms"], 3.0) and r["baseline_ms"] is None and r["speedup"] is None
    r = got["rel_shift", "fwd", "eager"]                   # paired with its own op's baseline
    assert math.isclose(r["baseline_ms"], 6.0) and math.isclose(r["speedup"], 0.5)

    md = report.markdown(records)
    assert md.count("| attention |") == 4
    assert f"| attention | {case} | fwd | triton | 1.000 | 0.900 | eager | 8.000 | 8.00x |" in md
    assert f"| attention | {case} | fwd+bwd | triton | 3.000 | 2.700 | eager | — | — |" in md
    assert "| attention | " + case + " | fwd | eager |" not in md


# --------------------------------------------------------------------------- writing

def test_write_never_overwrites(report, tmp_path):
    records = report.records_from_pytest_benchmark(
        {"datetime": "2026-11-21T23:59:00+00:00",
         "benchmarks": [_bench("cpu", 0.002), _bench("eager-pad-view", 0.003)]})
    paths = [report.write(records, tmp_path, plots=False) for _ in range(3)]
    assert [p.name for p, _ in paths] == ["2026-11-21.json", "2026-11-21-2.json",
                                          "2026-11-21-3.json"]
    assert [m.name for _, m in paths] == ["2026-11-21.md", "2026-11-21-2.md", "2026-11-21-3.md"]
    data = json.loads(paths[0][0].read_text())
    assert data["device"] == "Test CPU (2 threads)" and data["records"] == records
    md = paths[0][1].read_text()
    assert "Test CPU (2 threads)" in md and "torch 9.9.9" in md and "triton 8.8.8" in md
    assert ("| rel_shift | B1 H1 Tq2 Tk4 | fwd | cpu | 2.000 | 1.800 | eager-pad-view | "
            "3.000 | 1.50x | — | — | — |  |") in md


def _plottable(report):
    return report.records_from_pytest_benchmark({"benchmarks": [
        _bench("cpu", 0.001 * t, case=f"B1 H1 Tq{t} Tk{2 * t}", T=t, ms=t / 2)
        for t in (64, 128)] + [
        _bench("eager-pad-view", 0.001 * t, case=f"B1 H1 Tq{t} Tk{2 * t}", T=t, ms=t)
        for t in (64, 128)]})


def test_plots_skipped_without_matplotlib(report, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # `import matplotlib` fails
    json_path, md_path = report.write(_plottable(report), tmp_path)
    assert list(tmp_path.glob("*.png")) == []
    data = json.loads(json_path.read_text())
    assert any(n.startswith("plots skipped: matplotlib is not installed") for n in data["notes"])
    assert "Note: plots skipped: matplotlib is not installed" in md_path.read_text()


def test_plots_written(report, tmp_path):
    pytest.importorskip("matplotlib")                        # installed in .venv
    json_path, _ = report.write(_plottable(report), tmp_path)
    png = tmp_path / f"{json_path.stem}-rel_shift.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    assert f"plots: {png.name}" in json.loads(json_path.read_text())["notes"]


def test_plot_seq_len():
    plot = _load("ctxfast_bench_plot_t", "plot.py")
    assert plot.seq_len({"T": 300, "case": "B1 Tq5"}) == 300
    assert plot.seq_len({"case": "GPT-2 causal B16 H12 Tq1024 Tk1024 D64"}) == 1024
    assert plot.seq_len({"case": "ULMFiT T70 B16"}) == 70
    assert plot.seq_len({"case": "B2 H4 mem64 D32"}) is None


# --------------------------------------------------------------------------- discovery

def test_op_discovery(report, tmp_path):
    found = report.available_ops()
    assert set(found) == {p.stem[len("bench_"):] for p in BENCH_DIR.glob("bench_*.py")}
    assert {"rel_shift", "attention", "rel_attention"} <= set(found)
    assert report.bench_files() == list(found.values())
    # a suite that appears later (e.g. bench_lstm.py) is picked up with no other change
    for name in ("bench_lstm.py", "bench_zeta.py", "helper.py"):
        (tmp_path / name).write_text("")
    assert list(report.available_ops(tmp_path)) == ["lstm", "zeta"]
    assert report.bench_files(["zeta"], tmp_path) == [tmp_path / "bench_zeta.py"]
    with pytest.raises(ValueError, match="no_such_op.*available: lstm, zeta"):
        report.bench_files(["no_such_op"], tmp_path)


def test_slug_and_default_out_dir(report):
    assert report.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert report.slug("Intel(R) Xeon(R) CPU @ 2.20GHz (2 threads)") == \
        "intel-r-xeon-r-cpu-2-20ghz-2-threads"
    out = report.default_out_dir("cpu")
    assert out == REPORT_PY.parent / "results" / report.slug(report.device_name("cpu"))


def test_cli_bench_list_and_arguments(report, capsys):
    from ctxfast import cli
    assert cli.main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for op in ("rel_shift", "attention", "rel_attention"):
        assert any(line.split()[0] == op for line in out.splitlines())
    with pytest.raises(SystemExit):
        report.main(["--threads", "0"])
    assert "--threads must be >= 1" in capsys.readouterr().err
    assert report.main(["--ops", "no_such_op", "--out", "/nonexistent/never-written"]) == 1
    assert "no benchmark file for op(s) no_such_op" in capsys.readouterr().err


# --------------------------------------------------------------------------- README table

def _run_file(folder, stem, device, records, written=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(
        {"device": device, "date": stem[:10], "torch": "9.9", "triton": "8.8", "notes": [],
         "records": records, **({"written": written} if written else {})}))


def _rec(op, backend, mode, speedup, dtype="float32", **kw):
    return {"op": op, "backend": backend, "baseline": "base", "mode": mode,
            "speedup": speedup, "dtype": dtype, **kw}


def test_readme_table_newest_run(readme_table, tmp_path):
    _run_file(tmp_path / "cpu-a", "2026-11-21", "AMD EPYC (2 threads)", [])
    _run_file(tmp_path / "cpu-a", "2026-11-21-2", "AMD EPYC (2 threads)", [])
    _run_file(tmp_path / "cpu-a", "2026-11-21-10", "AMD EPYC (2 threads)", [])
    _run_file(tmp_path / "cpu-a", "2026-11-20-3", "AMD EPYC (2 threads)", [])
    (tmp_path / "cpu-a" / "notes.json").write_text("{}")           # not a report
    path, rep = readme_table.newest_run(tmp_path)
    assert path.name == "2026-11-21-10.json" and not readme_table.is_gpu_run(rep)
    # same date, another device folder: the time written decides, not the -<n> suffix
    _run_file(tmp_path / "cpu-b", "2026-11-21", "AMD EPYC (1 threads)", [],
              written="2026-11-21T15:00:00+00:00")
    assert readme_table.newest_run(tmp_path)[0].parent.name == "cpu-b"
    _run_file(tmp_path / "cpu-a", "2026-11-21-11", "AMD EPYC (2 threads)", [],
              written="2026-11-21T16:00:00+00:00")
    assert readme_table.newest_run(tmp_path)[0].name == "2026-11-21-11.json"
    # a GPU run wins over a newer CPU run
    _run_file(tmp_path / "nvidia-h100-80gb-hbm3", "2026-11-01", "NVIDIA H100 80GB HBM3", [])
    path, rep = readme_table.newest_run(tmp_path)
    assert path.parent.name == "nvidia-h100-80gb-hbm3" and readme_table.is_gpu_run(rep)
    assert readme_table.newest_run(tmp_path, "cpu-a")[0].name == "2026-11-21-11.json"
    with pytest.raises(FileNotFoundError):
        readme_table.newest_run(tmp_path, "no-such-device")


def test_readme_table_render_and_update(readme_table, tmp_path):
    recs = [_rec("attention", "triton", "fwd", 2.0, tflops=300.0),
            _rec("attention", "triton", "fwd", 4.0, tflops=350.0),
            _rec("attention", "triton", "fwd", 8.0, tflops=310.0),
            _rec("attention", "triton", "fwd", None, note="baseline OOM: x"),
            _rec("rel_shift", "cpu", "fwd+bwd", 1.5, gbps=12.0, case="B8 H8 Tq256 Tk512",
                 note="interleaved timing with eager failed: x"),   # its speedup stands
            _rec("linear", "triton", "fwd", None, note="2.00x the time of y; failed: boom"),
            _rec("linear", "triton", "fwd", None, note="baseline failed: boom"),
            _rec("models", "ctxfast", "eval", 2.0, tflops=0.5, tokens_per_s=1.2e5,
                 case="gpt B8 T1024")]
    _run_file(tmp_path / "results" / "gpu", "2026-12-01", "NVIDIA H200", recs)
    path, rep = readme_table.newest_run(tmp_path / "results")
    block = readme_table.render(rep, "benchmarks/results/gpu/2026-12-01.json")
    assert "**NVIDIA H200**, 2026-12-01" in block and "2026-12-01.json" in block
    assert ("| attention | **triton** (ctxfast) | base | fwd | 4 | 4.00x (2.00x–8.00x), 1 OOM "
            "| 350 TFLOP/s |") in block
    assert ("| rel_shift | **cpu** (ctxfast) | base | fwd+bwd | B8 H8 Tq256 Tk512 | 1.50x "
            "| 12 GB/s |") in block
    assert "| linear | **triton** (ctxfast) | base | fwd | 2 | —, 2 failed |" in block
    assert "| models | **ctxfast** (ctxfast) | base | eval | gpt B8 T1024 | 2.00x | 0.5 TFLOP/s, " \
        "1.2e+05 tokens/s |" in block
    assert "no GPU run" not in block
    assert "(no case where a ctxfast backend is slower" in block    # no peer has a time here

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{readme_table.BEGIN}\nold table\n{readme_table.END}\n"
                      "after\n")
    args = ["--results", str(tmp_path / "results"), "--readme", str(readme)]
    assert readme_table.main(args + ["--check"]) == 1
    assert readme_table.main(args) == 0
    text = readme.read_text()
    assert "old table" not in text and "| attention | **triton** (ctxfast) |" in text
    assert text.startswith("# x\n\nbefore\n") and text.endswith(f"{readme_table.END}\nafter\n")
    assert readme_table.main(args + ["--check"]) == 0               # idempotent
    readme.write_text("no markers\n")
    assert readme_table.main(args) == 1 and readme.read_text() == "no markers\n"


def test_readme_table_matches_committed_results(readme_table):
    # README.md's table is the one generated from the newest run under benchmarks/results
    assert readme_table.main(["--check"]) == 0


# --------------------------------------------------------------------------- roofline

def test_roofline_work_formulas():
    from collections import namedtuple
    roofline = _load("ctxfast_bench_roofline", "roofline.py")
    Att = namedtuple("Att", "mask shape")
    # causal Tq = Tk = 4: query i sees keys 0..i -> 1 + 2 + 3 + 4 = 10 pairs
    f, b = roofline.work("attention", Att("causal", (1, 1, 4, 4, 2)), "fwd", 4)
    assert f == 4 * 10 * 2 and b == (2 * 4 * 2 + 2 * 4 * 2) * 4 + 4 * 4
    f, b = roofline.work("attention", Att("causal", (1, 1, 4, 4, 2)), "bwd", 4)
    assert f == 10 * 10 * 2 and b == (4 * 4 * 2 + 4 * 4 * 2) * 4 + 4 * 4
    # with memory 2 (Tk 6): query i sees keys 0..i+2 -> 3 + 4 + 5 + 6 = 18 pairs
    assert roofline.work("attention", Att("causal-memory", (1, 1, 4, 6, 2)), "fwd", 4)[0] \
        == 4 * 18 * 2
    assert roofline.work("attention", Att("padding", (2, 3, 4, 6, 2)), "fwd", 2)[0] \
        == 4 * 2 * 3 * 4 * 6 * 2                              # dense
    Rel = namedtuple("Rel", "shape")
    f, b = roofline.work("rel_attention", Rel((1, 1, 4, 2, 2)), "fwd+bwd", 4)
    assert f == (6 + 16) * 18 * 2
    assert roofline.work("rel_shift", Rel((1, 2, 3, 5)), "fwd+bwd", 2) == (0.0, 4 * 30 * 2)
    Layer = namedtuple("Layer", "input_size hidden_size num_layers bidirectional proj_size")
    Lstm = namedtuple("Lstm", "layers T B")
    case = Lstm((Layer(3, 2, 1, False, 0),), T=5, B=1)
    rec, _ = roofline.lstm_recurrence_work(case, "fwd", 4)
    assert rec == 2 * 5 * 1 * 8 * 2                           # h @ W_hh^T: [1, 2] x [2, 8]
    assert roofline.work("lstm", case, "fwd", 4)[0] == rec + 2 * 5 * 1 * 8 * 3  # + x @ W_ih^T
    assert roofline.work("lstm", case, "fwd+bwd", 4)[0] == 3 * (rec + 2 * 5 * 8 * 3)
    # the floor: the larger of the two terms
    assert roofline.floor_s(100.0, 10.0, 10.0, 1.0) == (10.0, "compute")
    assert roofline.floor_s(100.0, 300.0, 10.0, 1.0) == (300.0, "memory")
    assert roofline.floor_s(100.0, 3.0, None, 1.0) == (3.0, "memory")


def test_rel_attention_suite_flops_agree_with_the_roofline():
    # the suite's TFLOP/s and the roofline's floor count the same products: fwd 3 (AC, BD,
    # PV), bwd 8 (it counted the backward as 2.5x the forward, FlashAttention's rule for
    # two products, 4.8% short); ctxfast.attention at the same shape: 2 and 5
    roofline = _load("ctxfast_bench_roofline2", "roofline.py")
    suite = _load("ctxfast_bench_rel_attention_flops", "bench_rel_attention.py")
    for case in suite.FULL_CASES:
        if case.window is not None:          # the roofline counts the causal pairs only
            continue
        for mode in ("fwd", "fwd+bwd"):
            assert suite.flops(case, mode) == roofline.work("rel_attention", case, mode, 2)[0]
        B, H, Tq, mem, D = case.shape
        att = namedtuple("Att", "mask shape")("causal-memory", (B, H, Tq, Tq + mem, D))
        assert suite.flops(case, "fwd+bwd", position_term=False) \
            == roofline.work("attention", att, "fwd+bwd", 2)[0]


# --------------------------------------------------------------------------- the timed loop

class _FakeEvent:
    """Stands in for torch.cuda.Event on the CPU: logs record() and times nothing."""
    log: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self, stream=None):
        _FakeEvent.log.append("record")

    def elapsed_time(self, other):
        return 1.0


def test_timed_loop_holds_the_op_and_nothing_else(common, monkeypatch):
    # The CUDA branch of measure(), run on the CPU with fake events: between the first and
    # the last event of the timed loop there must be the op's calls and event records
    # only — no synchronisation, no check, no hook, no dispatch mode, no other Python call
    # made by the harness (every call made from the timed loop's own frame is logged).
    log = _FakeEvent.log
    log.clear()
    monkeypatch.setattr(common, "_cuda_events", lambda rounds: (
        [_FakeEvent(True) for _ in range(rounds)], [_FakeEvent(True) for _ in range(rounds)]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    import torch.nn.modules.module as mod
    import ctxfast._dispatch as dispatch
    real_resolve = dispatch.resolve

    clean = []

    def fn(x):
        log.append("fn")
        # nothing of the harness is active while the op runs (the untimed call after the
        # timing may watch the dispatch: checked below that only that one does)
        clean.append(not _get_current_dispatch_mode_stack()
                     and not _get_current_function_mode_stack()
                     and not (mod._global_forward_hooks or mod._global_forward_pre_hooks
                              or mod._global_backward_hooks)
                     and dispatch.resolve is real_resolve)
        return x + 1

    loop = common._time_rounds.__code__
    allowed = (fn.__code__, _FakeEvent.record.__code__)

    def tracer(frame, event, arg):
        # every call the timed loop's own frame makes is logged unless it is the op or an
        # event record (builtins: only the loop's own bookkeeping)
        if event == "call" and frame.f_back is not None and frame.f_back.f_code is loop \
                and frame.f_code not in allowed:
            log.append(f"call {frame.f_code.co_name}")
        elif event == "c_call" and frame.f_code is loop \
                and getattr(arg, "__name__", "") not in ("len", "range", "append"):
            log.append(f"call {getattr(arg, '__name__', arg)}")

    bench = FakeBenchmark()
    sets = [(torch.randn(4),), (torch.randn(4),)]
    sys.setprofile(tracer)
    try:
        common.measure(bench, fn, sets, torch.device("cuda"), budget_s=0.0, min_rounds=1,
                       warmup=3, peak_memory=False)
    finally:
        sys.setprofile(None)
    info = bench.extra_info
    first, last = log.index("record"), len(log) - 1 - log[::-1].index("record")
    timed = log[first:last + 1]
    assert set(timed) == {"record", "fn"}                      # no sync inside
    assert timed.count("fn") == info["reps"] >= common.MIN_REPS >= 10
    assert info["rounds"] * info["iterations"] == info["reps"]
    assert log[:first].count("fn") == 3                          # warm-up before the loop
    assert log[first - 2:first] == ["call _sync", "sync"]        # one sync before it
    assert log[last + 1:last + 3] == ["call _sync", "sync"]      # and one after it
    assert all(clean[:-1]) and not clean[-1] and len(clean) == 3 + info["reps"] + 1
    assert info["timer"] == "cuda-events"
    assert math.isclose(info["ms"], 1.0 / info["iterations"])
    # pytest-benchmark gets no timing pass of its own (a no-op on the fake fixture)
    assert len(bench.pedantic_calls) == 1 and bench.pedantic_calls[0][1:] == (1, 1)


def test_measure_feeds_pytest_benchmark_its_own_rounds(common):
    # With pytest-benchmark's stats API, its table shows the rounds measure() timed, and
    # the op is not run again for it.
    stats = []

    class StatsBench(FakeBenchmark):
        def _make_stats(self, iterations):
            class S:
                def update(self, duration):
                    stats.append(duration / iterations)
            return S()

    calls = []
    bench = StatsBench()
    common.measure(bench, lambda x: calls.append(1), [(1,)], torch.device("cpu"),
                   budget_s=0.0, warmup=2, peak_memory=False)
    info = bench.extra_info
    assert bench.pedantic_calls == [] and bench._mode
    assert len(stats) == info["rounds"] >= 10
    assert math.isclose(sorted(stats)[len(stats) // 2] * 1e3, info["ms"], rel_tol=0.5)
    # warm-up + timed calls + one untimed call after the timing
    assert len(calls) == 2 + info["reps"] + 1


# --------------------------------------------------------------------------- the GPU round

GPU_ROUND = BENCH_DIR / "gpu_round.sh"


def _dry_run(stage, tmp_path):
    import subprocess
    out = tmp_path / "round"
    proc = subprocess.run(["bash", str(GPU_ROUND), "--stage", stage, "--dry-run"],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out)})
    return proc, out


def test_gpu_round_dry_run_prints_every_command(tmp_path):
    # The CPU check of the GPU round: each stage prints its commands and runs nothing.
    stages = {}
    for stage in ("build-test", "sanitize", "bench", "ncu", "verify", "followup"):
        proc, out = _dry_run(stage, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert not out.exists()                                 # nothing was run or written
        cmds = [l.split("] ", 1)[1] for l in proc.stdout.splitlines()
                if l.startswith(f"[{stage}] ")]
        stages[stage] = cmds
        # every stage builds offline (a fresh machine: the README's command with the index
        # switched off) and ends with its archive
        assert any("PIP_NO_INDEX=1" in c and "pip install --no-build-isolation --no-deps -e ." in c
                   for c in cmds)
        assert cmds[-1].startswith("tar czf ") and f"gpu_round-{stage}.tgz" in cmds[-1]
        for c in cmds[:-1]:                                     # each step under a timeout
            assert c.startswith("timeout "), c
            assert int(c.split()[1]) <= 570, c                  # < 10 min a command
    bt = stages["build-test"]
    suite = [c for c in bt if "-m pytest tests/gpu " in c and "-n 12" in c]
    assert len(suite) == 1                      # the whole suite, CUDA-only files first
    listed = suite[0].split(" -m pytest ")[1].split(" -v ")[0].split()
    assert sorted(listed[1:]) == sorted(str(p.relative_to(BENCH_DIR.parent))
                                        for p in (BENCH_DIR.parent / "tests").glob("test_*.py"))
    assert listed[-1] == "tests/test_bench.py"
    assert any("ctxfast.cli xl-eval" in c and "--quick" not in c for c in bt)
    assert any("ctxfast.cli smoke" in c for c in bt)
    # compute-sanitizer: both tools over every test file of the CUDA C++ kernels, one run
    # each (no -x: an unrelated failure does not stop the others)
    san = [c for c in stages["sanitize"] if "compute-sanitizer" in c]
    files = {c.split(" -m pytest ")[1].split()[0] for c in san}
    assert {"tests/gpu/test_lstm_gpu.py", "tests/gpu/test_rel_shift_gpu.py",
            "tests/test_cuda_bindings.py", "tests/test_lstm_native.py"} <= files
    for f in files:
        assert (BENCH_DIR.parent / f).is_file(), f
        for tool in ("memcheck", "racecheck"):
            assert sum(f"--tool {tool}" in c and f" {f} " in c for c in san) == 1
    assert not any(" -x" in c for c in san)
    assert any("--profile-check" in c for c in stages["sanitize"])
    bench = [c for c in stages["bench"] if "ctxfast.cli bench" in c]
    assert len(bench) == 1 and "--quick" not in bench[0]
    budget = float(bench[0].split("--time-budget ")[1].split()[0])
    assert budget <= 9 * 60 - 30                                 # the full set in < 9 min
    assert int(bench[0].split()[1]) <= 9 * 60
    ncu = [c for c in stages["ncu"] if " ncu " in f" {c} "]
    assert len(ncu) == 1 and "--clock-control none" in ncu[0] and "--ncu-target" in ncu[0]
    assert any("--host-split" in c for c in stages["ncu"])
    # verify: the changed kernels' test files (GPU-only ones first), the checked sweep
    verify = stages["verify"]
    vsuite = [c for c in verify if " -m pytest tests/gpu " in c]
    assert len(vsuite) == 1 and "tests/test_build_flags.py" in vsuite[0]
    for f in vsuite[0].split(" -m pytest ")[1].split(" -v ")[0].split():
        assert (BENCH_DIR.parent / f).exists(), f
    assert any("tune_report.py" in c and "--out" in c for c in verify)
    assert any("lstm_launch_compare.py" in c and "persistent-mma" in c for c in verify)
    # the grid-sync probe (built with nvcc there): in the ncu stage (verify: GRID_PROBE=1)
    probe = [c for c in stages["ncu"] if "grid_sync_probe.cu" in c]
    assert len(probe) == 1 and "-arch=sm_90" in probe[0], stages["ncu"]
    # the Triton LSTM backward's launch sweep in verify, xl-eval's quick run in followup
    assert any("lstm_triton_sweep.py --backward" in c for c in verify)
    assert any("xl-eval --quick" in c for c in stages["followup"])
    # the float32 decoder's GEMM against cuBLAS in followup, its tests in verify's suite;
    # the AWD-LSTM step with it in followup, and decoding against SDPA
    assert any("linear_compare.py --out" in c for c in stages["followup"])
    assert "tests/test_linear.py" in vsuite[0]
    assert any("CTXFAST_LINEAR_CUDA=triton" in c and "awd_lstm" in c
               for c in stages["followup"])
    assert any("bench_attention.py" in c and "decode" in c for c in stages["followup"])
    # the warp stalls (ncu) right after the AWD-LSTM step, before the xl-eval runs
    fu = stages["followup"]
    stalls = next(i for i, c in enumerate(fu) if "ncu_stalls.py --out-dir" in c)
    assert stalls < next(i for i, c in enumerate(fu) if "xl-eval --quick" in c)
    # verify: the suite first (the device code no GPU has run yet), then the timings, the
    # warp-specialised guard before the tuner, rel_attention's and attention's tuning
    # before dQ / dr's forms and the LSTM's, the launch sweeps last
    step = {k: next(i for i, c in enumerate(verify) if k in c)
            for k in (" -m pytest tests/gpu ", "warp_specialised", "tune_report.py",
                      "backward_adds_compare.py --out", "lstm_launch_compare.py")}
    assert list(step.values()) == sorted(step.values()), step
    sweeps = [i for i, c in enumerate(verify) if "lstm_triton_sweep.py" in c
              or "lstm_phase_clock.py" in c]
    assert sweeps and min(sweeps) > step["lstm_launch_compare.py"], verify
    assert "auto" in verify[step["lstm_launch_compare.py"]]
    assert "tests/test_dispatch.py" in vsuite[0]


def test_gpu_round_scripts_budgets_follow_the_stages_time(tmp_path):
    # A step's timeout is cut to what is left of the stage; the --time-budget of the
    # script it runs must be cut with it (less a margin), or the script plans for time it
    # does not have and is killed inside a case, its results unwritten. Dry runs with the
    # default budget and with 100 s: the scripts' budgets as asked, then cut.
    import subprocess

    def budgets(stage, budget):
        env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "round")}
        if budget is not None:
            env["STAGE_BUDGET"] = str(budget)
        proc = subprocess.run(["bash", str(GPU_ROUND), "--stage", stage, "--dry-run"],
                              capture_output=True, text=True, timeout=30, env=env)
        assert proc.returncode == 0, proc.stderr
        return {script: int(line.split("--time-budget ")[1].split()[0])
                for line in proc.stdout.splitlines() if "--time-budget " in line
                for script in ("tune_report.py", "lstm_triton_sweep.py --backward",
                               "lstm_triton_sweep.py --time", "ctxfast.cli bench")
                if script in line}
    full = budgets("verify", None)
    assert full == {"tune_report.py": 150, "lstm_triton_sweep.py --time": 65,
                    "lstm_triton_sweep.py --backward": 45}, full
    assert budgets("verify", 100) == {"tune_report.py": 70, "lstm_triton_sweep.py --time": 65,
                                      "lstm_triton_sweep.py --backward": 45}
    assert budgets("verify", 60) == {"tune_report.py": 30, "lstm_triton_sweep.py --time": 35,
                                     "lstm_triton_sweep.py --backward": 35}
    assert budgets("bench", None) == {"ctxfast.cli bench": 420}
    assert budgets("bench", 300) == {"ctxfast.cli bench": 300 - 10 - 120}


def test_gpu_round_refuses_a_bad_stage(tmp_path):
    for args in (["--stage", "everything"], [], ["--frobnicate"]):
        import subprocess
        proc = subprocess.run(["bash", str(GPU_ROUND), *args, "--dry-run"],
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and "gpu_round:" in proc.stderr


KILLED_SUITE = '''
import os
import sys
sys.path.insert(0, {bench_dir!r})
import pytest
import torch
import _common


@pytest.mark.parametrize("case, backend", [("a", "mine"), ("a", "base"), ("b", "mine"),
                                           ("b", "base"), ("c", "mine"), ("c", "base")])
def test_dies(benchmark, case, backend):
    if case == "c":
        os._exit(3)                     # the process dies (a timeout kill, a crash)
    _common.describe(benchmark, op="dies", case=case, mode="fwd", backend=backend,
                     dtype=torch.float32, device=torch.device("cpu"), baseline="base")
    _common.measure(benchmark, lambda x: x * 2, [(torch.randn(8),)], torch.device("cpu"),
                    budget_s=0.001, warmup=1)
'''


def test_records_survive_a_killed_suite_and_the_time_budget(report, tmp_path):
    suites, result = _quick_report_of(report, tmp_path, "bench_dies.py", KILLED_SUITE)
    # everything finished before the process died is in the report
    assert result["failed"] == ["bench_dies.py"]
    assert sorted(r["case"] for r in result["records"]) == ["a", "b"]
    assert all(r["speedup"] > 0 for r in result["records"])
    # a budget already spent: no case starts, each is named, nothing is made up
    result = report.run(tmp_path / "out2", quick=True, device="cpu", plots=False,
                        echo=False, bench_dir=suites, time_budget_s=1e-6)
    assert result["records"] == [] and len(result["skipped_budget"]) == 6
    assert any("not run: the time budget" in n for n in result["notes"])


def test_readme_table_says_where_we_are_slower_and_whose_rows_are_whose(readme_table):
    # GPU: ours against every peer of the same case, the slower cases counted; CPU rows
    # of torch's SDPA are labelled as PyTorch's, never as ctxfast's.
    def rec(case, backend, ms, base_ms, op="attention"):
        return {"op": op, "case": case, "mode": "fwd", "backend": backend, "baseline": "eager",
                "ms": ms, "baseline_ms": base_ms, "speedup": base_ms / ms,
                "dtype": "bfloat16"}
    gpu = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-22", "torch": "2.11",
           "triton": "3.6", "notes": ["measured with the old harness", "plots: x.png"],
           "records": [rec("a", "triton", 2.0, 10.0), rec("a", "sdpa", 1.0, 10.0),
                       rec("b", "triton", 1.0, 10.0), rec("b", "sdpa", 4.0, 10.0),
                       rec("a", "flex", 4.0, 10.0)]}
    cpu = {"device": "AMD EPYC (1 threads)", "date": "2026-11-21", "torch": "2.13",
           "notes": [], "records": [rec("a", "sdpa", 1.0, 2.0)]}
    block = readme_table.render(gpu, "g.json", (cpu, "c.json"))
    assert "> measured with the old harness" in block and "plots: x.png" not in block
    assert "| attention | fwd | **triton** | sdpa | 1 of 2 | 2.25x (0.50x–4.00x) |" in block
    assert "| attention | fwd | **triton** | flex |" not in block        # never slower there
    assert "| attention | sdpa (PyTorch SDPA, not ctxfast) | eager | fwd |" in block
    cpu_part = block.split("CPU run:")[1]
    assert "not GPU performance" in cpu_part and "not ctxfast" in cpu_part
    assert "**" not in cpu_part.split("|", 1)[1].replace("**AMD", "")  # no row marked ours


# --------------------------------------------------------------------------- importing old logs

OLD_LOG = """
---------- benchmark 'attention sweep causal B2 H16 Tq8192 Tk8192 D128 fwd': 4 tests ----------
Name (time in ms)                                                        Median               IQR            Rounds  Iterations
test_attention[sweep-causal-B2-H16-Tq8192-Tk8192-D128-fwd-sdpa]        1.1498 (1.0)      0.1848 (6.94)          3           1
test_attention[sweep-causal-B2-H16-Tq8192-Tk8192-D128-fwd-eager]      35.8517 (31.18)    0.0266 (1.0)           3           1
---------- benchmark 'attention sweep causal B2 H32 Tq8192 Tk8192 D64 fwd+bwd': 4 tests ----------
Name (time in us)                                                              Median                 IQR            Rounds  Iterations
test_attention[sweep-causal-B2-H32-Tq8192-Tk8192-D64-fwd+bwd-eager]          2.4860 (1.0)        0.0000 (1.0)           1           1
test_attention[sweep-causal-B2-H32-Tq8192-Tk8192-D64-fwd+bwd-sdpa]       4,921.7000 (>1000.0)  195.7357 (inf)           3           1
FAILED benchmarks/bench_lstm.py::test_lstm[ULMFiT-T70-B64-fp16-fwd-cuda] - AssertionError
"""


def test_import_logs_reads_only_what_the_log_says(report):
    imp = _load("ctxfast_bench_import_logs", "import_logs.py")
    rows = imp.parse_log(OLD_LOG)
    assert rows[0] == {"op": "attention", "case": "sweep causal B2 H16 Tq8192 Tk8192 D128",
                       "mode": "fwd", "backend": "sdpa", "ms": 1.1498,
                       "iqr_ms": 0.1848, "rounds": 3, "iterations": 1}
    assert math.isclose(rows[3]["ms"], 4.9217) and rows[3]["backend"] == "sdpa"   # us -> ms
    assert rows[2]["rounds"] == 1                              # the old OOM marker
    assert rows[4] == {"op": "lstm", "id": "ULMFiT-T70-B64-fp16-fwd-cuda", "failed": True}
    header = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6"}
    recs = {(r["case"], r["mode"], r["backend"]): r for r in
            report.records_from_pytest_benchmark({"benchmarks": imp.entries(rows, header)})}
    sdpa = recs[("sweep causal B2 H16 Tq8192 Tk8192 D128", "fwd", "sdpa")]
    assert sdpa["ms"] == 1.1498 and sdpa["baseline_ms"] == 35.8517
    assert round(sdpa["tflops"]) == 478     # the figure the first H100 round reported
    assert sdpa["timer"] == imp.LOG_TIMER
    oom = recs[("sweep causal B2 H32 Tq8192 Tk8192 D64", "fwd+bwd", "sdpa")]
    assert oom["speedup"] is None and oom["note"].startswith("baseline OOM")
    failed = recs[("ULMFiT T70 B64 fp16", "fwd", "cuda")]
    assert failed["ms"] is None and failed["note"].startswith("failed:")


def test_gpu_round_records_each_step_and_packs_one_archive(tmp_path):
    # The real (not dry) path with a stand-in python that does nothing: every step's exit
    # status reaches the summary, a failing step (no compute-sanitizer here) does not stop
    # the round, and the stage ends in one archive holding the summary and the logs.
    import subprocess
    import tarfile
    out = tmp_path / "round"
    proc = subprocess.run(["bash", str(GPU_ROUND), "--stage", "sanitize"], capture_output=True,
                          text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out), "PYTHON": "true"})
    assert proc.returncode == 0, proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "build: ctxfast._cuda already imports" in summary
    assert "profile check (lstm, models) rc=0" in summary
    ran = [l for l in summary.splitlines() if l.startswith("compute-sanitizer ")]
    assert len(ran) == 12 and all(" rc=" in l for l in ran)        # all ran, none stopped it
    with tarfile.open(out / "gpu_round-sanitize.tgz") as tar:
        names = tar.getnames()
    assert "summary.txt" in names and "r/profile_check.log" in names


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton LSTM needs a GPU or the interpreter")
def test_lstm_launch_compare_runs_every_form(tmp_path):
    """benchmarks/lstm_launch_compare.py (run by gpu_round's bench stage) times each launch
    form it can run here and writes one JSON row per (case, dtype, form)."""
    out = tmp_path / "llc.json"
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "lstm_launch_compare.py")
    # the forms whose code paths differ most (the others set flags these runs already check)
    forms = ["triton persistent", "triton stepwise", "triton persistent split-k",
             "triton persistent f16-operands"]
    proc = subprocess.run([sys.executable, script, "--quick", "--reps", "1", "--out", str(out),
                           "--forms", *forms], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    forms = {r["form"] for r in rows}
    assert {"triton persistent", "triton stepwise", "triton persistent split-k",
            "triton persistent f16-operands"} == forms
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton GEMM needs a GPU or the interpreter")
def test_linear_compare_times_every_form_and_restores_the_settings(tmp_path):
    """benchmarks/linear_compare.py (gpu_round's verify stage): one JSON row per form (the
    sweep's launch rows included) with its time and error against float64, a ratio line
    per form against cuBLAS float32; TF32 and the launch override restored after."""
    from utils import load_benchmark

    from ctxfast.kernels import linear as klinear
    lc = load_benchmark("linear_compare.py")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    out = tmp_path / "lc.json"
    assert lc.main(["--quick", "--sweep", "--reps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 5 + len(lc.SWEEP) and len({r["form"] for r in rows}) == len(rows)
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["rel_err"] < 1e-5 for r in rows)
    assert len(lc.ratios(rows)) == len(rows) - 1
    assert klinear.CONFIG_OVERRIDE is None and torch.backends.cuda.matmul.allow_tf32 == tf32
    assert klinear.PROMOTE is False


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton attention kernels need a GPU or the interpreter")
def test_backward_adds_compare_times_every_mode_and_clears_the_override(tmp_path):
    """benchmarks/backward_adds_compare.py (gpu_round's verify stage): per case a row for
    each of dQ's / dr's modes (kernel, atomic, bulk; dr also gemm, stored) with both times and its
    agreement with the kernel form, ratio lines against it; the launch overrides are empty
    after."""
    from utils import load_benchmark

    from ctxfast.kernels import attention as kattn
    from ctxfast.kernels import rel_attention as krel
    bac = load_benchmark("backward_adds_compare.py")
    out = tmp_path / "bac.json"
    assert bac.main(["--quick", "--reps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["form"].split()[-1] for r in rows] == [*bac.MODES["attention"],
                                                     *bac.MODES["rel_attention"]], rows
    assert all(r["bwd_us"] > 0 and r["fwd_bwd_us"] > 0 and r["agree"] <= 1 for r in rows)
    assert len(bac.ratios(rows)) == 6
    assert "dq_mode" not in kattn.LAUNCH_OVERRIDE and "dr_mode" not in krel.LAUNCH_OVERRIDE


def test_backward_adds_compare_goes_on_past_a_failing_form(tmp_path, monkeypatch, capsys):
    """A form that raises (the bulk form, in both ops) is a row with its error; the other
    forms and the next case still run, each case's rows are in the JSON and its ratio
    lines printed as it ends (a step cut by its timeout keeps them). It used to end the
    script: the other op's case never ran and no JSON was written."""
    from utils import load_benchmark

    from ctxfast.kernels import attention as kattn
    from ctxfast.kernels import rel_attention as krel
    bac = load_benchmark("backward_adds_compare.py")
    real_op = bac._op

    def failing_op(op):
        fn = real_op(op)
        module, key = (krel, "dr_mode") if op == "rel_attention" else (kattn, "dq_mode")

        def call(*ins):
            if module.LAUNCH_OVERRIDE.get(key) == "bulk":
                raise RuntimeError("bulk: no such luck")
            return fn(*ins)
        return call
    monkeypatch.setattr(bac, "_op", failing_op)
    monkeypatch.setattr(bac, "_compile_forms", lambda *a: None)
    out = tmp_path / "bac.json"
    assert bac.main(["--quick", "--reps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["form"].split()[-1] for r in rows] == [*bac.MODES["attention"],
                                                     *bac.MODES["rel_attention"]], rows
    failed = [r for r in rows if "error" in r]
    assert [r["form"] for r in failed] == ["dq_mode bulk", "dr_mode bulk"]
    assert all("no such luck" in r["error"] for r in failed)
    printed = capsys.readouterr().out
    assert printed.count("Error RuntimeError: bulk: no such luck") == 2
    assert printed.count("\nratio ") == len(rows) - 2 - 2       # less the kernel forms
    assert "dq_mode" not in kattn.LAUNCH_OVERRIDE and "dr_mode" not in krel.LAUNCH_OVERRIDE


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="launches recorded through the interpreter")
@pytest.mark.parametrize("op", ["attention", "rel_attention"])
def test_backward_adds_compare_compiles_what_each_form_launches(op, monkeypatch):
    """On a GPU the script compiles every form's backward kernels ahead, by replaying the
    kernel-level backward of one call on a thread with that form's mode in force
    (``_compile_forms``). The replay must launch what the form's own call launches
    (kernels, constexprs, warps, stages), or it compiles kernels nobody runs. Here the
    replay runs (one thread: the interpreter is not thread-safe) and its backward launches
    are compared with those of each form's own call."""
    import contextlib

    from utils import load_benchmark, spy_launch_settings

    from ctxfast.kernels import _tune
    from ctxfast.kernels import attention as kattn
    from ctxfast.kernels import rel_attention as krel
    bac = load_benchmark("backward_adds_compare.py")
    module, key = (krel, "dr_mode") if op == "rel_attention" else (kattn, "dq_mode")
    names = [n for n in vars(module) if n.startswith(("_rel_attn_bwd_", "_rel_bwd_", "_rel_d",
                                                      "_attn_bwd_")) and n.endswith("_kernel")]
    seen = spy_launch_settings(monkeypatch, module, names)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_tune, "COMPILE_THREADS", 1)
    case = next(c for c in bac.QUICK if c[0] == op)
    torch.manual_seed(0)
    ins, g = bac.make_inputs(op, *case[1:], torch.device("cpu"), torch.float32)
    fn = bac._op(op)
    backward, args, kwargs = bac._backward_call(op, fn, ins, g)
    for mode in bac.MODES[op]:
        seen.clear()
        _tune.compile_ahead([{key: mode}], lambda: backward(*args, **kwargs),
                            torch.device("cpu"))
        replayed = sorted(seen)
        seen.clear()
        monkeypatch.setitem(module.LAUNCH_OVERRIDE, key, mode)
        torch.autograd.grad(fn(*ins), ins, g)
        monkeypatch.delitem(module.LAUNCH_OVERRIDE, key)
        assert replayed and replayed == sorted(seen), (mode, replayed, sorted(seen))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="launches recorded through the interpreter")
def test_lstm_sweep_rows_compiled_ahead_launch_as_the_override(monkeypatch):
    """The LSTM launch sweep compiles its rows ahead on threads, each row as that thread's
    ``"lstm_config"`` (kernels.lstm reads it before CONFIG_OVERRIDE, which threads would
    share): a forward and backward with a row in force that way launch what the same calls
    launch with CONFIG_OVERRIDE set to it (kernels, constexprs, warps, stages), and not
    what the table row launches."""
    from utils import load_benchmark, spy_launch_settings

    from ctxfast.kernels import _tune
    from ctxfast.kernels import lstm as klstm
    sweep = load_benchmark("lstm_triton_sweep.py")
    seen = spy_launch_settings(monkeypatch, klstm)
    _, H, P, T, B = sweep.QUICK[1]                            # with a projection
    args = sweep._inputs(H, P, T, B, torch.float32, torch.device("cpu"))

    def call():
        out, cells, gates = klstm.lstm_forward(*args)
        klstm.lstm_backward(torch.ones_like(out), torch.ones_like(cells), *args[1:],
                            out, cells, gates)
        return sorted(seen)

    table = call()
    for row in ({"BLOCK_K": 32, "num_stages": 5}, sweep.CANDIDATES_SPLIT[3]):
        seen.clear()
        with _tune.active({"lstm_config": row}):
            ahead = call()
        seen.clear()
        monkeypatch.setattr(klstm, "CONFIG_OVERRIDE", row)
        own = call()
        monkeypatch.setattr(klstm, "CONFIG_OVERRIDE", None)
        assert ahead == own and own != table, (row, ahead, own)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="launches recorded through the interpreter")
def test_lstm_launch_compare_compiles_what_each_triton_form_launches(monkeypatch):
    """lstm_launch_compare.py compiles its Triton forms ahead on a GPU, by replaying one
    real call's kernel-level forward and backward on a thread per form, the form's
    kernels.lstm settings in force there as rows (``_triton_rows``; ``_form`` sets the same
    on the module). Each replay must launch what the form's own call launches (kernels,
    constexprs, warps, stages): checked here for every Triton form, with a projection."""
    import contextlib

    from utils import load_benchmark, spy_launch_settings

    import ctxfast
    from ctxfast.kernels import _tune
    from ctxfast.kernels import lstm as klstm
    lc = load_benchmark("lstm_launch_compare.py")
    seen = spy_launch_settings(monkeypatch, klstm)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_tune, "COMPILE_THREADS", 1)      # the interpreter: one at a time
    torch.manual_seed(0)
    _, I, H, P, T, B, clip = lc.QUICK[1]
    x = torch.randn(T, B, I, requires_grad=True)
    ws = [(torch.randn(*shape) * 0.3).requires_grad_()
          for shape in ((4 * H, I), (4 * H, P), (4 * H,), (4 * H,), (P, H))]
    mask = (torch.rand(4 * H, P) >= lc.P_DROP).float()
    g = torch.randn(T, B, P)

    def call():
        out = ctxfast.lstm(x, None, *ws, weight_mask=mask, weight_dropout=lc.P_DROP,
                           cell_clip=clip, proj_clip=clip, backend="triton")[0]
        torch.autograd.grad(out, [x, *ws], g)
    with lc._form("triton persistent"):
        calls = lc._kernel_calls(call)
    assert [fn.__name__ for fn, _, _ in calls] == ["lstm_forward", "lstm_backward"]
    forms = [f for f in lc._forms(torch.device("cpu")) if f.startswith("triton")]
    assert len(forms) >= 6, forms
    for form in forms:
        seen.clear()
        _tune.compile_ahead([lc._triton_rows(form)],
                            lambda: [fn(*a, **kw) for fn, a, kw in calls], torch.device("cpu"))
        ahead = sorted(seen)
        seen.clear()
        with lc._form(form):
            call()
        assert ahead and ahead == sorted(seen), (form, ahead, sorted(seen))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton LSTM needs a GPU or the interpreter")
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_lstm_triton_sweep_times_each_candidate(tmp_path, direction):
    """benchmarks/lstm_triton_sweep.py (gpu_round's verify stage; --backward for the
    backward kernels): the table row, then each candidate, each compared with the table
    row's output; a JSON row each, a winner per case; the override is cleared after every
    row."""
    out = tmp_path / "sweep.json"
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "lstm_triton_sweep.py")
    flags = ["--backward"] if direction == "bwd" else []
    proc = subprocess.run([sys.executable, script, "--quick", "--time-budget", "30", *flags,
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    ran = [r for r in rows if "ms" in r]
    assert ran[0]["override"] is None and ran[0]["vs_table"] == 1.0
    assert len(ran) >= 3 and all(r["agrees"] and r["ms"] > 0 for r in ran), rows
    assert {r["direction"] for r in ran} == {direction}
    for case in {r["case"] for r in ran}:             # each row of a case its own launch
        cfgs = [json.dumps(r["config"], sort_keys=True) for r in ran if r["case"] == case]
        assert len(set(cfgs)) == len(cfgs), cfgs
    assert f"fastest tiny float32 {direction}" in proc.stdout
    if direction == "bwd":                            # the split-K backward's rows ran
        assert any(r["config"]["KSPLIT"] for r in ran if r["case"] == "tiny"), ran


def test_rel_attention_check_allows_what_bf16_itself_costs():
    # The first H200 run (2026-11-26): the original code itself was 2.1% off in bf16 at
    # Tq 1 against 3,072 keys, over the fixed 2% of the correctness check, so the case had
    # no baseline. The check now allows the larger of that 2% and twice the reference's
    # own error at the inputs' dtype, and still fails a wrong result.
    sys.path.insert(0, str(BENCH_DIR))
    try:
        bench = _load("ctxfast_bench_rel_attention_t", "bench_rel_attention.py")
    finally:
        sys.path.remove(str(BENCH_DIR))
    import ctxfast.reference as ref
    case = bench.Case((1, 2, 1, 3072, 64))
    shapes = ((1, 2, 1, 64), (1, 2, 3073, 64), (1, 2, 3073, 64), (2, 3073, 64), (2, 64),
              (2, 64))

    def inputs(score_scale):  # q, k and r scaled: sharper softmax rows, more bf16 error
        torch.manual_seed(0)
        return [(torch.randn(s) * (score_scale if i in (0, 1, 3) else 1)).to(torch.bfloat16)
                for i, s in enumerate(shapes)]
    g = torch.randn(1, 2, 1, 64).to(torch.bfloat16)
    original = ref.rel_attention_original
    sharp = inputs(3.0)                      # the original itself is ~5% off here in bf16
    for mode in ("fwd", "fwd+bwd"):
        bench._check(original, "eager-original", mode, case, sharp,
                     None if mode == "fwd" else g)
    wrong = lambda *a: original(*a) * 1.05   # noqa: E731  (5% off: a broken kernel)
    with pytest.raises(AssertionError, match="relative error of out"):
        bench._check(wrong, "eager-original", "fwd", case, inputs(1.0), None)


def test_exception_probe_sees_the_cpu_op_raise():
    # benchmarks/exception_probe.py (gpu_round runs it after the build): each case in its
    # own process; here every C++ refusal must arrive as a Python exception.
    proc = subprocess.run([sys.executable, str(BENCH_DIR / "exception_probe.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "probe torch: ok: raised RuntimeError" in proc.stdout
    assert "probe _C: ok: raised ValueError: keep_mask_cpu: p must be in" in proc.stdout
    for way in ("TORCH_CHECK", "c10 error, no backtrace", "std::invalid_argument",
                "TORCH_CHECK double", "TORCH_CHECK int64", "TORCH_CHECK sizes",
                "ostringstream double"):
        assert f"probe _C {way}: ok: raised ValueError: probe_throw:" in proc.stdout
    assert "probe _C lstm (CPU): ok: raised ValueError: lstm_recurrence_native" in proc.stdout


def test_exception_probe_survives_a_case_that_crashes():
    # Forked cases (the _C ones): a child that dies of SIGSEGV or does not raise fails
    # only itself, with its exit status and native stack, and the cases after it still run.
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import exception_probe as ep\n"
            "ep.CASES = {'_C segv': ep._SETUP + 'import ctypes; ctypes.string_at(0)',\n"
            "            '_C silent': ep._SETUP + 'x = 1', '_C': ep.CASES['_C']}\n"
            "sys.argv = sys.argv[:1]; sys.exit(ep.main())")
    proc = subprocess.run([sys.executable, "-c", code, str(BENCH_DIR)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "probe _C segv: FAILED (exit -11)" in proc.stdout, proc.stdout
    assert "native stack at the fault:" in proc.stdout
    assert "probe _C silent: FAILED (exit 3): did not raise" in proc.stdout
    assert "probe _C: ok: raised ValueError: keep_mask_cpu" in proc.stdout


def _quick_json(script, tmp_path):
    """Run benchmarks/<script> --quick --out <json> (the CPU check of a GPU round's script)
    and return its JSON; the script must exit 0."""
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(BENCH_DIR / script), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_kernel_breakdown_runs_every_step(tmp_path):
    # benchmarks/kernel_breakdown.py (gpu_round's bench stage): on a CPU only that every
    # step runs and the JSON has a row per case with its timings and its largest ops.
    rows = _quick_json("kernel_breakdown.py", tmp_path)["rows"]
    assert [r["op"] for r in rows] == ["rel_attention", "attention"]
    for r in rows:
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["host_fwd_bwd_us"] > 0
        assert r["kernels"] and all(k["us"] > 0 for k in r["kernels"])


@needs_triton_kernels
def test_kernel_breakdown_host_split_and_ncu_target(tmp_path):
    # --host-split (gpu_round's ncu stage): every part timed, the launches restored after
    # the stubbed row; --ncu-target runs its calls.
    out = tmp_path / "split.json"
    proc = subprocess.run([sys.executable, str(BENCH_DIR / "kernel_breakdown.py"),
                           "--host-split", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["host_split"]
    assert len(rows) == 16 and all(r["us"] > 0 for r in rows)
    parts = [r["part"] for r in rows]
    assert rows[-1]["part"].endswith("launches stubbed")
    # the launchers and the op timed with Triton's launches and with the fast path
    for op in ("kernels.attention_forward (direct)", "ctxfast.attention forward+backward",
               "ctxfast.rel_attention forward+backward"):
        assert {op + ", JIT launches", op + ", fast-path launches"} <= set(parts)
    proc = subprocess.run([sys.executable, str(BENCH_DIR / "kernel_breakdown.py"),
                           "--ncu-target"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ncu target" in proc.stdout, proc.stdout + proc.stderr


FAKE_NCU = r'''#!{python}
"""A stand-in for ncu: records its arguments, writes the report, prints canned exports."""
import sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(" ".join(args) + "\n")
if "-o" in args:
    open(args[args.index("-o") + 1] + ".ncu-rep", "w").write("report")
elif "raw" in args:
    sys.stdout.write({raw!r})
elif "source" in args:
    sys.stdout.write({source!r})
'''

NCU_RAW = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
    '"gpu__time_duration.sum","launch__registers_per_thread",'
    '"sm__warps_active.avg.pct_of_peak_sustained_active",'
    '"smsp__average_warp_latency_per_inst_issued.ratio",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"\n'
    '"","","","","","","","msecond","register/thread","%","cycle","inst","inst","inst"\n'
    '"0","1","python","h","_rel_attn_fwd_kernel","1","7","0.10451","255","12.30","30.5",'
    '"9.10","2.50","4.00"\n'
    '"1","1","python","h","_rel_attn_bwd_dq_kernel","1","7","1,234.5","232","11","40.0",'
    '"1.00","20.00","3.00"\n')
NCU_SOURCE = (
    '"# Address","Source","Warp Stall Sampling (All Samples)",'
    '"Warp Stall Sampling (Not-issued Samples)"\n'
    '"0x3a70","SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR17+0x16000], R28","40","40"\n'
    '"0x3a80","@!P3 BRA `(.L_x_2)","2","1"\n'
    '"0x4080","BAR.SYNC.DEFER_BLOCKING 0x0","1,500","1,400"\n'
    '"0x4160","BAR.SYNC.DEFER_BLOCKING 0x0","500","480"\n'
    '"0x3e90","HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR16], R24","0","0"\n'
    '"# Address","Source","Warp Stall Sampling (All Samples)",'
    '"Warp Stall Sampling (Not-issued Samples)"\n'
    '"0x100","LDG.E R2, [R4.64]","7","7"\n')


def test_ncu_stalls_profiles_exports_and_summarises(tmp_path):
    # benchmarks/ncu_stalls.py against a stand-in ncu: one profile of kernel_breakdown.py's
    # "rel" target with the warp-state and source sections, both exports, and per kernel the
    # duration (units from the export's second row, thousands separators dropped), the
    # stall reasons largest first, and the SASS lines and opcodes with the most samples.
    log = tmp_path / "ncu_args.txt"
    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU.format(python=sys.executable, log=str(log), raw=NCU_RAW,
                                    source=NCU_SOURCE))
    fake.chmod(0o755)
    out = tmp_path / "stalls"
    proc = subprocess.run([sys.executable, str(BENCH_DIR / "ncu_stalls.py"), "--out-dir",
                           str(out), "--ncu", str(fake)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 3
    assert "--ncu-target rel" in calls[0] and "--nvtx-include profile/" in calls[0]
    assert all(f"--section {s}" in calls[0] for s in ("WarpStateStats", "SourceCounters"))
    assert "--page raw --csv" in calls[1] and "--print-source sass" in calls[2]
    data = json.loads((out / "stalls.json").read_text())
    fwd, dq = data["kernels"]
    assert fwd["kernel"] == "_rel_attn_fwd_kernel" and math.isclose(fwd["us"], 104.51)
    assert math.isclose(dq["us"], 1234.5e3) and dq["registers"] == 232
    assert fwd["stalls"] == {"barrier": 9.1, "long_scoreboard": 2.5, "wait": 4.0}
    assert "barrier 9.10, wait 4.00, long_scoreboard 2.50" in proc.stdout
    src = data["sources"]
    assert len(src) == 2 and src[0]["samples"] == 2042 and src[1]["samples"] == 7
    assert src[0]["by_opcode"][0] == ["BAR", 2000] and src[0]["top"][0][0] == "0x4080"
    assert (out / "stalls_raw.csv").read_text() == NCU_RAW
    # the exports summarised again without ncu (on a CPU)
    again = subprocess.run([sys.executable, str(BENCH_DIR / "ncu_stalls.py"), "--raw",
                            str(out / "stalls_raw.csv"), "--source",
                            str(out / "stalls_source.csv")], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and "_rel_attn_bwd_dq_kernel" in again.stdout, again.stderr
    assert "long_scoreboard 20.00" in again.stdout


def test_launch_override_reaches_the_launch_rows(monkeypatch):
    # The config sweep's hook: while LAUNCH_OVERRIDE is set, the launchers take its rows;
    # empty, the tables' rows come back.
    pytest.importorskip("triton")
    from ctxfast.kernels import attention as attn_k
    from ctxfast.kernels import rel_attention as rel_k
    monkeypatch.setattr(attn_k, "_interpreting", lambda: False)
    monkeypatch.setattr(rel_k, "_interpreting", lambda: False)
    table = attn_k._config("dkdv", 64, torch.bfloat16, True)
    monkeypatch.setitem(attn_k.LAUNCH_OVERRIDE, "dkdv", (32, 64, 4, 2))
    assert attn_k._config("dkdv", 64, torch.bfloat16, True) == (32, 64, 64, 4, 2)
    assert attn_k._config("dq", 64, torch.bfloat16, True) == attn_k._config_of(
        "dq", 64, torch.bfloat16, True, "none", False, False)
    attn_k.LAUNCH_OVERRIDE.clear()
    assert attn_k._config("dkdv", 64, torch.bfloat16, True) == table
    tile, launch = rel_k._config(64, None, torch.bfloat16), rel_k._bwd_launch(64, torch.bfloat16)
    decoding = rel_k._config(64, 4, torch.bfloat16)
    monkeypatch.setitem(rel_k.LAUNCH_OVERRIDE, "tile", 32)
    monkeypatch.setitem(rel_k.LAUNCH_OVERRIDE, "dr", (4, 3))
    assert rel_k._config(64, None, torch.bfloat16)[:4] == (32, 32, 64, 64)
    assert rel_k._config(64, 4, torch.bfloat16) == decoding       # decoding tile untouched
    assert rel_k._bwd_launch(64, torch.bfloat16) == {**launch, "dr": (4, 3)}
    rel_k.LAUNCH_OVERRIDE.clear()
    assert rel_k._config(64, None, torch.bfloat16) == tile
    assert rel_k._bwd_launch(64, torch.bfloat16) == launch


@needs_triton_kernels
def test_config_sweep_runs_every_step(tmp_path):
    # benchmarks/config_sweep.py on a CPU: the steps run (override, compile, time, restore)
    # and every candidate gets a row; the overrides are empty afterwards.
    data = _quick_json("config_sweep.py", tmp_path)
    kernels = {(r["op"], r["kernel"]) for r in data["rows"]}
    assert kernels == {("attention", k) for k in ("fwd", "dkdv", "dq")} | {
        ("rel_attention", k) for k in ("fwd", "dkdv", "dq", "dr")} | {
        ("rel_attention fp32 fwd", "fwd")}                  # XL evaluation's forward
    assert all(r["us"] and r["error"] is None for r in data["rows"])
    # every candidate checked against float64: the interpreter's answers are right
    assert all(r["err"] is not None and r["err"] <= 1 and "wrong" not in r
               for r in data["rows"]), [r for r in data["rows"] if not (r["err"] or 2) <= 1]
    assert len(data["summary"]) == 8


@needs_triton_kernels
def test_tune_report_runs_every_step(tmp_path):
    # benchmarks/tune_report.py on a CPU: each case timed with the table rows, tuned (every
    # candidate run, checked, timed) and (attention) against SDPA; the chosen rows and
    # every trial are in the JSON.
    data = _quick_json("tune_report.py", tmp_path)
    assert len(data["rows"]) == 3 and all("error" not in r for r in data["rows"]), data["rows"]
    for row in data["rows"]:
        rel = row["case"].startswith("rel_attention")
        for mode in ("fwd", "fwd+bwd"):
            us = row["us"][mode]
            assert us["table"] > 0 and us["tuned"] > 0 and ("sdpa" in us) != rel
        assert row["trials"] >= 6                      # forward and backward candidates ran
    assert len(data["chosen"]) == 6                    # fwd and bwd kinds of the three cases
    assert all(r["error"] is None and r["gap"] <= 1 for r in data["records"])
    assert sum(r["chosen"] for r in data["records"]) >= 4


@needs_triton_kernels
def test_tune_report_keeps_its_trials_when_stopped(tmp_path):
    # gpu_round's step timeout sends SIGTERM: the report writes the JSON it has (the cases
    # done, every trial timed so far, "killed") and exits 124, instead of losing a case's
    # minutes of compiles.
    import signal
    out = tmp_path / "tune.json"
    proc = subprocess.Popen([sys.executable, str(BENCH_DIR / "tune_report.py"), "--quick",
                             "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()              # the first case's line: trials recorded
        while first and not first.startswith("case causal"):
            first = proc.stdout.readline()
        assert first, "the report printed no case"
        done = json.loads(out.read_text())          # rewritten after each case
        assert len(done["rows"]) == 1 and done["records"] and not done["killed"]
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 124 and "stopped by signal" in rest, rest
    data = json.loads(out.read_text())
    assert data["killed"] and len(data["records"]) >= len(done["records"])
    assert data["rows"][0]["case"] == done["rows"][0]["case"]


def test_config_sweep_refuses_unknown_ops_and_kernels(capsys):
    # a misspelt subset would otherwise sweep nothing and say so nowhere (in process: the
    # parser refuses before anything runs)
    sys.path.insert(0, str(BENCH_DIR))
    import config_sweep
    for args, word in ((["--ops", "rel"], "--ops"), (["--kernels", "dQ"], "--kernels")):
        with pytest.raises(SystemExit) as exit_:
            config_sweep.main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and word in err and "invalid choice" in err


@needs_triton_kernels
def test_config_sweep_flags_a_wrong_candidate(monkeypatch):
    # A candidate whose answer is wrong is marked, and never the "best": a launch row that
    # breaks the dQ kernel (here: its gradient scaled by 2 while the override is set).
    sys.path.insert(0, str(BENCH_DIR))
    import config_sweep
    from ctxfast.kernels import rel_attention as rel_k
    original = rel_k.rel_attention_backward

    def broken(*a, **kw):
        grads = original(*a, **kw)
        if rel_k.LAUNCH_OVERRIDE.get("dq") == (4, 1):
            return (grads[0] * 2, *grads[1:])
        return grads
    monkeypatch.setattr(rel_k, "rel_attention_backward", broken)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = config_sweep.sweep(device, torch.float32, 600, True, ops=["rel_attention"],
                              kernels=["dq"])
    assert {(r["op"], r["kernel"]) for r in rows} == {("rel_attention", "dq")}
    bad = [r for r in rows if r["candidate"] == (4, 1)]
    good = [r for r in rows if r["candidate"] is None]
    assert bad and all(r.get("wrong") == "q" and r["err"] > 1 for r in bad), bad
    assert good and all("wrong" not in r and r["err"] <= 1 for r in good), good
    assert all("(4, 1)" not in line for line in config_sweep.summary(rows))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="launches recorded through the interpreter")
def test_config_sweep_rows_compiled_ahead_launch_as_their_overrides(monkeypatch):
    """On a GPU the sweep compiles every row of a case ahead on threads, each row's
    LAUNCH_OVERRIDE entries as that thread's rows, by replaying the kernel-level calls of
    one real call (``_kernel_calls``). For every row of the quick sweep, at fp16 (where the
    "tma" rows read descriptors), the replay must launch what the row's own timed call
    launches with the module's LAUNCH_OVERRIDE set (kernels, constexprs, warps, stages), or
    it compiles kernels nobody times. The "tma" rows read descriptors in both ops
    (rel_attention's used to set attention's module flag, and timed its default)."""
    import contextlib

    from utils import spy_launch_settings

    sys.path.insert(0, str(BENCH_DIR))
    import config_sweep
    from ctxfast.kernels import _tune
    from ctxfast.kernels import attention as attn_k
    from ctxfast.kernels import rel_attention as rel_k
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_tune, "COMPILE_THREADS", 1)
    cpu = torch.device("cpu")
    for module in (attn_k, rel_k):
        monkeypatch.setattr(module, "LAUNCH_OVERRIDE", {})
    jobs = config_sweep._jobs(torch.float16, True, ops=["attention", "rel_attention"])
    for op, module in (("attention", attn_k), ("rel_attention", rel_k)):
        # (rel_attention's _rel_bwd_prep_kernel calls _bwd_delta_kernel inside itself)
        seen = spy_launch_settings(monkeypatch, module, [
            n for n in vars(module) if n.endswith("_kernel") and n != "_bwd_delta_kernel"
            and hasattr(getattr(module, n), "__getitem__")])
        case = next(j[1] for j in jobs if j[0] == op)
        torch.manual_seed(0)
        ins, g = config_sweep.make_inputs(op, *case, cpu, torch.float16)
        timed, checked = config_sweep._call(op, ins, g)
        replay = config_sweep._kernel_calls(op, checked)
        rows = [j for j in jobs if j[0] == op]
        tma = []
        for job in rows:
            over = config_sweep._overrides(*job[:1], *job[2:])
            seen.clear()
            _tune.compile_ahead([over], replay, cpu)
            replayed = sorted(seen)
            seen.clear()
            module.LAUNCH_OVERRIDE.update(over)
            timed()
            module.LAUNCH_OVERRIDE.clear()
            assert replayed and replayed == sorted(seen), (job, replayed, sorted(seen))
            if job[5] == "tma":
                tma.append(any("('TMA', True)" in s for _, s in seen))
        assert tma and all(tma), (op, tma)


def test_model_steps_read_no_value_to_the_host_on_the_gpu_path(tmp_path):
    # A value read (.item(), int(t), bool(t), torch.equal) is a host-device sync on a GPU;
    # the models' input checks made 2-7 per training step. With the value checks of CPU
    # tensors off (what a GPU step runs), every model's forward + loss and backward read
    # none; with them on (a CPU step), the same count sees the checks' reads.
    counts = {}
    for flag in ("--as-on-gpu", None):
        out = tmp_path / f"counts{flag or ''}.json"
        proc = subprocess.run(
            [sys.executable, str(BENCH_DIR / "count_dispatches.py"), "--model", "gpt", "bert",
             "xlnet", "transformer_xl", "awd_lstm", "elmo", "--case", "tiny", "--backends",
             "ctxfast", "--json", str(out), *([flag] if flag else [])],
            capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        sys.path.insert(0, str(BENCH_DIR))
        try:
            reads = _load("ctxfast_count_dispatches_t", "count_dispatches.py").HOST_READS
        finally:
            sys.path.remove(str(BENCH_DIR))
        counts[flag] = {r["model"]: sum(n for phase in ("forward + loss", "backward")
                                        for op, n in r["counts"]["ctxfast"][phase].items()
                                        if op in reads)
                        for r in json.loads(out.read_text())}
    assert len(counts["--as-on-gpu"]) == 6
    assert all(n == 0 for n in counts["--as-on-gpu"].values()), counts["--as-on-gpu"]
    assert all(n > 0 for n in counts[None].values()), counts[None]


def test_lstm_launch_compare_ratios_against_cudnn():
    """lstm_launch_compare.py's closing lines (what gpu_round's summary keeps): each form's
    speed as a multiple of cuDNN+WeightDropout's in the same case and dtype; none where that
    case has no cuDNN row or the form refused."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        compare = _load("ctxfast_bench_llc_ratios", "lstm_launch_compare.py")
    finally:
        sys.path.remove(str(BENCH_DIR))
    rows = [dict(case="a", dtype="bfloat16", form="cuDNN+WeightDropout", fwd_ms=2.0,
                 fwd_bwd_ms=4.0),
            dict(case="a", dtype="bfloat16", form="triton persistent", fwd_ms=1.0,
                 fwd_bwd_ms=5.0),
            dict(case="a", dtype="float32", form="triton persistent", fwd_ms=1.0,
                 fwd_bwd_ms=3.0),
            dict(case="a", dtype="bfloat16", form="cuda per-step", fwd_ms=None,
                 fwd_bwd_ms=None, refused="too big")]
    lines = compare.ratios(rows)
    assert len(lines) == 1 and "triton persistent" in lines[0], lines
    assert "fwd  2.00x cuDNN" in lines[0] and "fwd+bwd  0.80x cuDNN" in lines[0], lines


def test_sass_loops_counts_loop_bodies_not_out_of_line_waits():
    # nvdisasm text shaped as the TMA kernels' (sm_90): a loop whose barrier wait may spin
    # branches out to a spin loop after the EXIT, which branches back into the loop's middle.
    # That return branch is backward too, but its span holds the epilogue and the EXIT: the
    # NOTES once recorded such a span (1,068 "instructions a tile" for a loop of 642).
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".L_x_2:",
        "        /*0010*/                   FADD R2, R2, R3 ;",
        "        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR17], R28 ;",
        "        /*0030*/              @!P3 BRA `(.L_x_1) ;",
        ".L_x_6:",
        "        /*0040*/                   HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR16], R24 ;",
        "        /*0050*/               @P0 FSEL R4, R5, R6, !P1 ;",
        "        /*0060*/              @!P4 BRA `(.L_x_2) ;",
        "        /*0070*/                   STG.E desc[UR38][R6.64], R33 ;",
        "        /*0080*/                   EXIT ;",
        ".L_x_1:",
        "        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR17], R28 ;",
        "        /*00a0*/              @!P3 BRA `(.L_x_1) ;",
        "        /*00b0*/                   BRA `(.L_x_6) ;",
    ])
    sys.path.insert(0, str(BENCH_DIR))
    try:
        tool = _load("ctxfast_bench_sass_loops_t", "sass_loops.py")
    finally:
        sys.path.remove(str(BENCH_DIR))
    found = tool.loops(sass)
    assert [(first, last, dict(ops)) for first, last, ops in found] == [
        (1, 8, {"FADD": 1, "SYNCS": 1, "BRA": 2, "HGMMA": 1, "FSEL": 1})]
    spins = [(first, last) for first, last, _ in tool.loops(sass, spin=True)]
    assert spins == [(1, 8), (11, 13)]
    assert tool.opcode("@!P1 FSEL R108, R25, R24, !P1") == "FSEL"
    # --loads: the TTGIR loads inside loops (an if and a reduce nested in one) and not
    # those before or after it
    ttgir = "\n".join([
        "    %q = tt.load %q_ptr : tensor<64x64x!tt.ptr<bf16>, #blocked> loc(#loc1)",
        "    %acc:2 = scf.for %i = %c0 to %n step %c64 iter_args(%a = %z) -> (f32) : i32 {",
        "      %rb_218 = tt.load %rb_217 : tensor<64x!tt.ptr<f32>, #ttg.slice<{dim = 0}>> loc(#l)",
        "      %m = \"tt.reduce\"(%x) <{axis = 1 : i32}> ({",
        "      ^bb0(%u: f32, %v: f32):",
        "        tt.reduce.return %u : f32 loc(#l)",
        "      }) : (tensor<64x64xf32, #mma>) -> tensor<64xf32> loc(#l)",
        "      %y = scf.if %p -> (f32) {",
        "        %s_3 = tt.load %sp : !tt.ptr<f32> loc(#l)",
        "        scf.yield %s_3 : f32 loc(#l)",
        "      } else {",
        "        scf.yield %a : f32 loc(#l)",
        "      } loc(#l)",
        "      scf.yield %y : f32 loc(#l)",
        "    } loc(#loc9)",
        "    %c = tt.load %c_ptr : tensor<64x!tt.ptr<f32>, #blocked> loc(#loc1)",
    ])
    assert tool.plain_loads(ttgir) == [
        ("%rb", "tensor<64x!tt.ptr<f32>, #ttg.slice<{dim = 0}>>"), ("%s", "!tt.ptr<f32>")]


# --------------------------------------------------------------------------- the harness's numbers

def _suite(filename):
    """A bench_*.py suite loaded by path (it imports _common: benchmarks/ on sys.path)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        return _load(f"ctxfast_bench_audit_{Path(filename).stem}", filename)
    finally:
        sys.path.remove(str(BENCH_DIR))


def test_measure_ms_is_the_median_of_every_timed_round(common, monkeypatch):
    # Calls of known length (a virtual clock): ms is the median over all the timed rounds,
    # ms_pass1 / ms_pass2 those of the first and second half, min / max over all; a call
    # of a millisecond (one per round) gets MIN_REPS rounds even where min_rounds asks for
    # fewer and the budget for none.
    clock = _VirtualClock()
    monkeypatch.setattr(common, "time", clock)
    timed = [5, 1, 9, 3, 7, 2, 10, 4, 8, 6]              # ms of the timed calls, in order
    durations = iter([1, 1] + timed + [1])              # warm-up x2, timed, untimed call

    def fn(x):
        clock.now += next(durations) * 1e-3

    bench = FakeBenchmark()
    common.measure(bench, fn, [(torch.randn(4),)], torch.device("cpu"), budget_s=0.0,
                   min_rounds=1, warmup=2, peak_memory=False)
    info = bench.extra_info
    assert (info["rounds"], info["iterations"], info["reps"]) == (common.MIN_REPS, 1, 10), info
    for key, want in (("ms", 5.5), ("ms_pass1", 5.0), ("ms_pass2", 6.0), ("ms_min", 1.0),
                      ("ms_max", 10.0)):
        assert math.isclose(info[key], want, rel_tol=1e-9), (key, info[key], want)
    assert math.isclose(info["spread"], 0.2, rel_tol=1e-9), info["spread"]


def test_measure_rounds_are_not_sized_by_the_first_call(common, monkeypatch):
    # The first warm-up call may compile (1 s here, then 1 ms a call): the number of rounds
    # comes from the calls after it, so the budget (50 ms) gets ~50 rounds, not MIN_REPS.
    clock = _VirtualClock()
    monkeypatch.setattr(common, "time", clock)
    calls = []

    def fn(x):
        clock.now += 1.0 if not calls else 1e-3
        calls.append(1)

    bench = FakeBenchmark()
    common.measure(bench, fn, [(torch.randn(4),)], torch.device("cpu"), budget_s=0.05,
                   min_rounds=10, warmup=2, peak_memory=False)
    assert bench.extra_info["iterations"] == 1
    assert 45 <= bench.extra_info["rounds"] <= 55, bench.extra_info["rounds"]


def test_input_sets_are_fresh_sets_to_rotate(common, monkeypatch):
    # On a GPU (an L2 of 4 KiB here) enough distinct input sets to cover twice the L2 (256
    # bytes a set: 32 sets), each made by its own make() call; on the CPU one set.
    made = []

    def make():
        made.append((torch.randn(64),))
        return made[-1]

    assert len(common.input_sets(make, torch.device("cpu"))) == 1
    monkeypatch.setattr(common, "_l2_bytes", lambda device: 4096)
    made.clear()
    sets = common.input_sets(make, torch.device("cpu"))
    assert len(sets) == 32 == len(made)
    assert len({s[0].data_ptr() for s in sets}) == 32, "the sets share their tensors"
    assert not torch.equal(sets[0][0], sets[1][0])


def test_record_peak_memory_counts_beyond_what_was_allocated(common, monkeypatch):
    # The CUDA branch with torch.cuda's memory counters faked: peak minus what was allocated
    # before the call (the inputs), and the call's result returned.
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100 << 20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 160 << 20)
    bench = FakeBenchmark()
    out = common.record_peak_memory(bench, lambda x: x + 1, (torch.ones(2),),
                                    torch.device("cuda"))
    assert torch.equal(out, torch.full((2,), 2.0))
    assert bench.extra_info["peak_mem_bytes"] == 60 << 20, bench.extra_info


def test_median_timer_takes_the_median_call(common, monkeypatch):
    # The standalone scripts' timer: the median of the calls (one 100 ms outlier among 1 ms
    # calls reads 1 ms), from CUDA events bracketing each call (faked here) or the clock.
    clock = _VirtualClock()
    monkeypatch.setattr(common, "time", clock)
    durations = []

    def fn():
        clock.now += durations.pop(0) * 1e-3

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = clock.now

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    for device, warmup in (("cuda", 3), ("cpu", 0)):
        durations[:] = [1] * warmup + [1, 1, 100, 1, 1]
        ms = common.median_timer(torch.device(device), 5)(fn)
        assert math.isclose(ms, 1.0, rel_tol=1e-6), (device, ms)
        assert durations == [], device


def test_assert_within_2x_eager_bounds_by_eager_not_by_ours(common):
    # The check before timing (bench_linear, bench_lstm): ours may be twice as far from the
    # float64 reference as eager at the same dtype (plus the floor), not further.
    torch.manual_seed(0)
    ref = torch.randn(256, dtype=torch.float64)
    eager = (ref + 1e-4 * torch.randn(256, dtype=torch.float64)).float()
    close = (ref + 1e-4 * torch.randn(256, dtype=torch.float64)).float()
    far = (ref + 1e-2 * torch.randn(256, dtype=torch.float64)).float()
    common.assert_within_2x_eager("close", close, eager, ref, 1e-6)
    with pytest.raises(AssertionError, match="far: relative error"):
        common.assert_within_2x_eager("far", far, eager, ref, 1e-6)
    common.assert_within_2x_eager("far, large floor", far, eager, ref, 0.1)


def test_compact_tables_read_peer_time_over_ours(report):
    # `ctxfast bench`'s tables: > 1x where ctxfast is faster (cpu 2 ms, its peer 6 ms: 3x)
    records = report.records_from_pytest_benchmark({"benchmarks": [
        _bench("cpu", 0.002, ms=2.0), _bench("eager-pad-view", 0.006, ms=6.0)]})
    row = next(l for l in report.compact_tables(records).splitlines() if " cpu " in l)
    assert row.rstrip().endswith("3.00x"), row


def test_readme_slower_rows_count_only_the_slower_cases(readme_table):
    # the "where ctxfast is slower" table: a case timed the same as the peer is not slower
    def rec(case, ms):
        return {"op": "attention", "case": case, "mode": "fwd", "backend": "triton",
                "baseline": "eager", "ms": ms, "baseline_ms": 2.0, "dtype": "bfloat16"}
    assert readme_table.slower_rows([rec("a", 2.0), rec("b", 1.0)]) == []
    (row,) = readme_table.slower_rows([rec("a", 2.0), rec("b", 4.0)])
    assert "| 1 of 2 |" in row, row


def test_records_name_a_timing_far_above_the_profiler(report):
    # the timed median 4x the kernel time the profiler saw: named in the note; 1.1x: not
    def recs(prof):
        return report.records_from_pytest_benchmark({"benchmarks": [
            _bench("triton", 1.0, op="attention", case="c", ms=2.0, profiler_ms=prof),
            _bench("eager", 1.0, op="attention", case="c", ms=8.0)]})
    (far,) = recs(0.5)
    assert "timed 2 ms but the profiler saw 0.5 ms of kernels" in (far["note"] or ""), far
    (near,) = recs(1.8)
    assert near["note"] is None and near["profiler_ms"] == 1.8, near


FAILING_CHECK_SUITE = '''
import sys
sys.path.insert(0, {bench_dir!r})
import pytest
import torch
import _common


@pytest.mark.parametrize("backend", ["mine", "base"])
def test_checked(benchmark, backend):
    _common.describe(benchmark, op="checked", case="a", mode="fwd", backend=backend,
                     dtype=torch.float32, device=torch.device("cpu"), baseline="base")
    assert backend == "base", "mine is wrong before timing"
    _common.measure(benchmark, lambda x: x * 2, [(torch.randn(8),)], torch.device("cpu"),
                    budget_s=0.001, warmup=1)
'''


def test_a_failed_check_is_recorded_as_failed(report, tmp_path):
    # A backend whose check fails before timing gets a record that says so (the
    # plugin's "error"), never a silent row without a time.
    _, result = _quick_report_of(report, tmp_path, "bench_checked.py", FAILING_CHECK_SUITE)
    (r,) = result["records"]
    assert r["backend"] == "mine" and r["ms"] is None and r["speedup"] is None, r
    assert (r["note"] or "").startswith("failed: ") and "mine is wrong" in r["note"], r


def test_op_suites_flops_agree_with_the_roofline():
    # attention: the FlashAttention count (causal without memory: half the dense work),
    # fwd+bwd 3.5x the forward; lstm: the GEMMs, fwd+bwd 3x; the roofline counts the same
    # (attention's causal cases without memory: its exact pairs, Tq(Tq + 1)/2 a head)
    roofline = _load("ctxfast_bench_roofline_audit", "roofline.py")
    att = _suite("bench_attention.py")
    for case in att.QUICK_CASES + att.FULL_CASES:
        B, H, Tq, Tk, D = case.shape
        for mode in ("fwd", "fwd+bwd"):
            got = att.flops(case, mode)
            if case.mask == "causal" and Tk == Tq:
                want = 2 * B * H * Tq * Tk * D * (1 if mode == "fwd" else 3.5)
            else:
                want = roofline.work("attention", case, mode, 2)[0]
            assert got == want, (case.name, mode, got, want)
    lstm = _suite("bench_lstm.py")
    for case in lstm.QUICK_CASES + lstm.FULL_CASES:
        for mode in ("fwd", "fwd+bwd"):
            assert lstm.flops(case, mode) == roofline.work("lstm", case, mode, 4)[0], \
                (case.name, mode)


def test_attention_suite_check_passes_the_peers_and_fails_a_wrong_result():
    # bench_attention's check before timing, on the quick cases of every mask kind (fp32,
    # the CPU's dtype): SDPA as the suite calls it (is_causal only without memory) and the
    # cpu kernel pass; a result 0.1% off fails fp32's 1e-4 (not bf16's 2e-2)
    att = _suite("bench_attention.py")
    cpu = torch.device("cpu")
    backends = [b for b in ("sdpa", "cpu") if att._skip_reason(b, cpu) is None]
    cases = {c.mask: c for c in att.QUICK_CASES}
    for mask, case in cases.items():
        B, H, Tq, Tk, D = case.shape
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D) for T in (Tq, Tk, Tk))
        g = torch.randn_like(q)
        mask_kw = att._mask_kwargs(case, cpu)
        for backend in backends:
            op, _ = att._op(backend, case, mask_kw, cpu)
            att._check(op, backend, "fwd", case, mask_kw, q, k, v, g)
        cpu_op, _ = att._op("eager", case, mask_kw, cpu)
        with pytest.raises(AssertionError, match="relative error of out"):
            att._check(lambda *a: cpu_op(*a) * 1.001, "cpu", "fwd", case, mask_kw, q, k, v, g)
    case = cases["causal-memory"]
    B, H, Tq, Tk, D = case.shape
    q, k, v = (torch.randn(B, H, T, D) for T in (Tq, Tk, Tk))
    mask_kw = att._mask_kwargs(case, cpu)
    for backend in backends:
        att._check(att._op(backend, case, mask_kw, cpu)[0], backend, "fwd+bwd", case, mask_kw,
                   q, k, v, torch.randn_like(q))


def test_attention_suite_check_allows_what_bf16_itself_costs():
    # As rel_attention's: a decoding row in bf16 against 3,072 keys with sharp scores, where
    # the reference itself at bf16 is over the fixed 2%: the same computation at bf16 (the
    # reference run at that dtype, as eager would) passes, forward and backward; a result
    # 5% off still fails.
    att = _suite("bench_attention.py")
    cpu = torch.device("cpu")
    case = att.Case("causal-memory", (1, 2, 1, 3072, 64))
    mask_kw = att._mask_kwargs(case, cpu)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, 64) for T in (1, 3072, 3072))
    q, k = q * 3.0, k * 3.0                  # sharper softmax rows: more bf16 error
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    g = torch.randn(1, 2, 1, 64).to(torch.bfloat16)
    import ctxfast.reference as ref
    same = functools.partial(ref.attention, **mask_kw)      # the reference at bf16
    want = ref.attention(q.float(), k.float(), v.float(), **mask_kw)
    own = (same(q, k, v).float() - want).norm() / want.norm()
    assert own > att.RTOL[torch.bfloat16], f"the case is not sharp enough: {own:.3g}"
    for mode in ("fwd", "fwd+bwd"):
        att._check(same, "cpu", mode, case, mask_kw, q, k, v, g)
    with pytest.raises(AssertionError, match="relative error of out"):
        att._check(lambda *a: same(*a) * 1.05, "cpu", "fwd", case, mask_kw, q, k, v, g)


def test_lstm_suite_check_fails_a_wrong_backend(monkeypatch):
    # bench_lstm's check: a backend 1% off fails, because the bound is 2x the error of the
    # module's eager backend at the same dtype (not of the backend under test)
    lstm = _suite("bench_lstm.py")
    cpu = torch.device("cpu")
    if lstm._skip_reason("cpu", cpu) is not None:
        pytest.skip(lstm._skip_reason("cpu", cpu))
    case = lstm.QUICK_CASES[0]
    lstm._check(case, "cpu", cpu, torch.float32)
    real = lstm._run

    def wrong(mods, x):                    # the cpu backend's output, 1% off
        out = real(mods, x)
        return out * 1.01 if getattr(mods[0], "backend", None) == "cpu" else out
    monkeypatch.setattr(lstm, "_run", wrong)
    with pytest.raises(AssertionError, match="relative error"):
        lstm._check(case, "cpu", cpu, torch.float32)


def test_linear_suite_counts_three_products_for_fwd_bwd(monkeypatch):
    # bench_linear's FLOPs: 2·M·I·N a product, the forward one, fwd+bwd three (dx, dW);
    # the eager baseline timed on a budget cut to a hundredth
    lin = _suite("bench_linear.py")
    monkeypatch.setenv("CTXFAST_BENCH_BUDGET_SCALE", "0.01")
    case = lin.QUICK_CASES[0]
    M, I, N = case.shape
    for mode, products in (("fwd", 1), ("fwd+bwd", 3)):
        bench = FakeBenchmark()
        lin.test_linear(bench, torch.device("cpu"), case, mode, "eager")
        assert bench.extra_info["flops"] == 2 * M * I * N * products, mode
        assert bench.extra_info["ms"] > 0


def test_kernel_breakdown_host_time_is_per_call(monkeypatch):
    # kernel_breakdown's host µs: per call of a round (calls of 2 ms: 2000 µs), the median
    kb = _suite("kernel_breakdown.py")
    clock = _VirtualClock()
    monkeypatch.setattr(kb, "time", clock)

    def fn():
        clock.now += 2e-3
    us = kb._host_us(fn, torch.device("cpu"), calls=7, rounds=3)
    assert math.isclose(us, 2000.0, rel_tol=1e-6), us


def test_tune_report_table_time_is_the_better_table_run(monkeypatch):
    # tune_report: "table" is the better (smaller) of the two table timings around the
    # tuned one, both kept in table_us_runs; the ratio printed is table / tuned
    tr = _suite("tune_report.py")
    times = iter([10.0, 5.0, 8.0])                      # table before, tuned, table after
    monkeypatch.setattr(tr, "_calls", lambda case, device, dtype: {"triton": [None, None]})
    monkeypatch.setattr(tr, "_time", lambda fn, device: next(times))
    case = tr.RelCase((1, 1, 1, 1, 1, torch.float32, ("fwd",)))
    (row,) = tr.report(torch.device("cpu"), torch.float32, [case], budget_s=60.0)
    assert row["us"] == {"fwd": {"table": 8.0, "tuned": 5.0}}, row
    assert row["table_us_runs"] == {"fwd": [10.0, 8.0]}
    assert "(1.60x)" in tr._line(row)


def test_models_suite_records_tokens_and_checks_at_fp32s_bound(monkeypatch):
    # bench_models on the CPU (GPT, quick size, eval): tokens = B·T positions a call (the
    # report's tokens/s), the FLOPs counted, the check's bound 1e-4 in fp32; a model with one
    # weight 0.1% off fails the check
    models = _suite("bench_models.py")
    monkeypatch.setenv("CTXFAST_BENCH_BUDGET_SCALE", "0.01")
    cpu = torch.device("cpu")
    case = next(c for c in models.QUICK_CASES if c.model == "gpt")
    reason = models._skip_reason(case, "ctxfast", cpu)
    if reason is not None:
        pytest.skip(reason)
    bench = FakeBenchmark()
    models.test_models(bench, cpu, case, "eval", "ctxfast")
    info = bench.extra_info
    assert info["tokens"] == case.B * case.T and info["flops"] > 0 and info["ms"] > 0, info
    assert info["check_bound"] == {"out": 1e-4, "loss": 1e-4}, info["check_bound"]
    model, ref = models._models(case, "ctxfast", cpu)
    with torch.no_grad():
        model.transformer.wte.weight.mul_(1.001)
    torch.manual_seed(1)
    batch = models.WORKLOADS[case.model].batch(case, cpu, torch.float32)
    with pytest.raises(AssertionError, match="relative error of the out"):
        models._check(case, "eval", "ctxfast", model, ref, batch, cpu)
