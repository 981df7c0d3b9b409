"""pytest plugin that ``report.py`` loads into every benchmark suite it runs
(``-p _bench_plugin``, with ``benchmarks/`` on ``PYTHONPATH``), whatever folder the suite
is in. Without the environment variables below it does nothing.

Set by ``report.py`` (``ctxfast bench``):

* ``CTXFAST_BENCH_RECORDS=<file>``: every benchmark is appended to that file as one JSON
  line (``{"name", "extra_info", "stats"}``) the moment its test ends, and flushed: a
  suite killed half-way keeps everything it finished.
* ``CTXFAST_BENCH_DEADLINE=<unix time>``: a benchmark that would start after it is
  skipped ("time budget spent") and written as ``{"name", "budget_skipped": true}``, so
  a suite that runs out of time stops cleanly and records what it finished.
* ``CTXFAST_BENCH_PROGRESS=<file>``: ``total <n>`` once collected, then one line
  ``<outcome> <test id>`` per finished test, for the runner's progress bar.
"""
import json
import os
import time

import pytest


RECORDS_ENV = "CTXFAST_BENCH_RECORDS"
DEADLINE_ENV = "CTXFAST_BENCH_DEADLINE"
PROGRESS_ENV = "CTXFAST_BENCH_PROGRESS"


def _append(env: str, line: str) -> None:
    path = os.environ.get(env, "").strip()
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
            f.flush()


def _stats(benchmark) -> dict:
    st = getattr(benchmark, "stats", None)
    st = getattr(st, "stats", st)
    out = {}
    for key in ("min", "max", "median", "mean", "rounds"):
        try:
            out[key] = getattr(st, key)
        except Exception:       # noqa: BLE001 — pytest-benchmark raises on empty stats
            pass
    return out


@pytest.fixture(autouse=True)
def _bench_record(request):
    """Skip a benchmark that would start after ``$CTXFAST_BENCH_DEADLINE``; write every
    benchmark to ``$CTXFAST_BENCH_RECORDS`` as soon as its test ends (module docstring)."""
    deadline = os.environ.get(DEADLINE_ENV, "").strip()
    if deadline and time.time() > float(deadline):
        _append(RECORDS_ENV, json.dumps({"name": request.node.nodeid,
                                         "budget_skipped": True}))
        pytest.skip("time budget spent (CTXFAST_BENCH_DEADLINE)")
    yield
    bench = request.node.funcargs.get("benchmark")
    info = getattr(bench, "extra_info", None)
    if info and "op" in info:
        entry = {"name": request.node.nodeid, "extra_info": info, "stats": _stats(bench)}
        rep = getattr(request.node, "_ctxfast_call_report", None)
        if rep is not None and rep.failed:
            crash = getattr(getattr(rep, "longrepr", None), "reprcrash", None)
            entry["error"] = (getattr(crash, "message", None) or "the test failed"
                              ).strip().splitlines()[0][:200]
        _append(RECORDS_ENV, json.dumps(entry, default=str))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item._ctxfast_call_report = rep          # read by _bench_record's teardown


def pytest_collection_finish(session):
    _append(PROGRESS_ENV, f"total {len(session.items)}")


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _append(PROGRESS_ENV, f"{report.outcome} {report.nodeid}")
