"""The benchmark report pipeline (benchmarks/report.py): correctness, never speed.

One test runs the quick rel_shift benchmarks on the CPU for real (~20-30 s on the 2-core
machines) and checks the files written; the others check the JSON-to-records conversion
and the writer on hand-made input.
"""
import importlib.util
import json
import math
from pathlib import Path

import pytest

REPORT_PY = Path(__file__).parents[1] / "benchmarks" / "report.py"
KEYS = {"op", "case", "mode", "backend", "baseline", "ms", "baseline_ms", "speedup", "dtype",
        "device", "torch", "triton", "date"}


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("ctxfast_bench_report", REPORT_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench(backend, median_s, *, op="rel_shift", case="B1 H1 Tq2 Tk4", mode="fwd",
           device_name="Test CPU (2 threads)"):
    """One entry of a pytest-benchmark JSON, as bench_*.py writes it."""
    return {
        "name": f"test_{op}[{case}-{mode}-{backend}]",
        "stats": {"min": median_s * 0.9, "max": median_s * 2, "mean": median_s * 1.1,
                  "median": median_s, "rounds": 10, "iterations": 1},
        "extra_info": {"op": op, "case": case, "mode": mode, "backend": backend,
                       "dtype": "float32", "device": "cpu", "device_name": device_name,
                       "torch": "9.9.9", "triton": "8.8.8"},
    }


def test_quick_run_writes_report(report, tmp_path):
    # Only rel_shift, so the test does not grow with every op's benchmarks; forced onto the
    # CPU so the "cpu" backend is there on a GPU machine too.
    result = report.run(tmp_path, quick=True, ops=["rel_shift"], device="cpu")

    json_path, md_path = Path(result["json_path"]), Path(result["md_path"])
    assert json_path.parent == tmp_path and json_path.exists() and md_path.exists()
    data = json.loads(json_path.read_text())
    assert set(data) == {"device", "date", "torch", "triton", "records"}
    cpu_name = report.device_name("cpu")
    assert data["device"] == cpu_name
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
        assert r["ms"] > 0 and r["baseline_ms"] > 0
        assert math.isclose(r["speedup"], r["baseline_ms"] / r["ms"], rel_tol=1e-12)
    # every quick case and mode has both backends
    pairs = {(r["case"], r["mode"], r["backend"]) for r in records}
    for case in ("B2 H4 Tq64 Tk128", "B4 H8 Tq128 Tk256"):
        for mode in ("fwd", "fwd+bwd"):
            assert {(case, mode, "cpu"), (case, mode, "eager")} <= pairs

    md = md_path.read_text()
    assert cpu_name in md
    assert "| op | case | mode | backend | ms | baseline | baseline ms | speedup |" in md
    assert md.count("| rel_shift |") == len(records)


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
    assert math.isclose(got["fwd", "cpu"]["ms"], 2.0)
    assert math.isclose(got["fwd", "cpu"]["baseline_ms"], 6.0)
    assert math.isclose(got["fwd", "cpu"]["speedup"], 3.0)
    assert math.isclose(got["fwd", "eager"]["speedup"], 0.5)       # slower than the baseline
    assert math.isclose(got["fwd+bwd", "cpu"]["baseline_ms"], 10.0)  # same mode's baseline
    assert math.isclose(got["fwd+bwd", "cpu"]["speedup"], 2.5)


def test_records_without_baseline(report):
    data = {"benchmarks": [_bench("cpu", 0.001, case="B9 H9 Tq9 Tk9"),
                           _bench("eager-pad-view", 0.005, case="B1 H1 Tq1 Tk1")]}
    (r,) = report.records_from_pytest_benchmark(data)
    assert r["case"] == "B9 H9 Tq9 Tk9"
    assert math.isclose(r["ms"], 1.0)
    assert r["baseline_ms"] is None and r["speedup"] is None


def test_records_pair_attention_with_eager(report):
    # attention's baseline is "eager", which is also a ctxfast backend name: it is the
    # baseline of attention only; rel_shift's "eager" in the same run stays a record.
    case = "causal B2 H4 Tq128 Tk128 D64"
    data = {"benchmarks": [
        _bench("triton", 0.001, op="attention", case=case),
        _bench("sdpa", 0.002, op="attention", case=case),
        _bench("flex", 0.004, op="attention", case=case),
        _bench("eager", 0.008, op="attention", case=case),
        _bench("triton", 0.003, op="attention", case=case, mode="fwd+bwd"),  # eager: OOM
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
    assert f"| attention | {case} | fwd | triton | 1.000 | eager | 8.000 | 8.00x |" in md
    assert f"| attention | {case} | fwd+bwd | triton | 3.000 | eager | — | — |" in md
    assert "| attention | " + case + " | fwd | eager |" not in md


def test_write_never_overwrites(report, tmp_path):
    records = report.records_from_pytest_benchmark(
        {"datetime": "2026-11-21T23:59:00+00:00",
         "benchmarks": [_bench("cpu", 0.002), _bench("eager-pad-view", 0.003)]})
    paths = [report.write(records, tmp_path) for _ in range(3)]
    assert [p.name for p, _ in paths] == ["2026-11-21.json", "2026-11-21-2.json",
                                          "2026-11-21-3.json"]
    assert [m.name for _, m in paths] == ["2026-11-21.md", "2026-11-21-2.md", "2026-11-21-3.md"]
    data = json.loads(paths[0][0].read_text())
    assert data["device"] == "Test CPU (2 threads)" and data["records"] == records
    md = paths[0][1].read_text()
    assert "Test CPU (2 threads)" in md and "torch 9.9.9" in md and "triton 8.8.8" in md
    assert "| rel_shift | B1 H1 Tq2 Tk4 | fwd | cpu | 2.000 | eager-pad-view | 3.000 | 1.50x |" in md


def test_slug_and_default_out_dir(report):
    assert report.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert report.slug("Intel(R) Xeon(R) CPU @ 2.20GHz (2 threads)") == \
        "intel-r-xeon-r-cpu-2-20ghz-2-threads"
    out = report.default_out_dir("cpu")
    assert out == REPORT_PY.parent / "results" / report.slug(report.device_name("cpu"))


def test_bench_files_filter(report):
    assert REPORT_PY.parent / "bench_rel_shift.py" in report.bench_files()
    assert report.bench_files(["rel_shift"]) == [REPORT_PY.parent / "bench_rel_shift.py"]
    with pytest.raises(ValueError, match="no_such_op"):
        report.bench_files(["no_such_op"])
