"""pytest configuration of the benchmarks (``benchmarks/bench_*.py``).

Run them through ``benchmarks/report.py`` (or ``ctxfast bench``), which writes the
results; or directly, e.g.::

    CTXFAST_BENCH_QUICK=1 python -m pytest benchmarks/bench_rel_shift.py -q

Name the files: pytest's default patterns (``test_*.py``) do not match ``bench_*.py``, so
``pytest benchmarks/`` alone collects nothing (on purpose: a bare ``pytest`` at the repo
root never runs benchmarks).

Environment: ``CTXFAST_BENCH_QUICK=1`` selects the small case set;
``CTXFAST_BENCH_DEVICE`` forces the device (default: CUDA when available, else CPU);
``CTXFAST_BENCH_THREADS`` sets torch's CPU threads (``ctxfast bench --threads``);
``CTXFAST_BENCH_BUDGET_SCALE`` scales every timing budget (e.g. 0.1 in the pipeline's own
tests). What a suite must provide: the top of ``_common.py``.

What ``report.py`` (``ctxfast bench``) adds to a suite's run (records written as each
benchmark ends, a time budget, progress): ``_bench_plugin.py``, loaded with ``-p``.
"""
import os

import pytest
import torch

import _common

if os.environ.get(_common.THREADS_ENV, "").strip():
    torch.set_num_threads(int(os.environ[_common.THREADS_ENV]))


@pytest.fixture(scope="session")
def bench_device() -> torch.device:
    """The device every benchmark of this session runs on."""
    return _common.bench_device()


def pytest_report_header(config):
    dev = _common.bench_device()
    v = _common.versions()
    return (f"ctxfast bench: device {dev} ({_common.device_name(dev)}), "
            f"{'quick' if _common.quick() else 'full'} cases, "
            f"torch {v['torch']}, triton {v['triton']}")

