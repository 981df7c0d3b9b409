"""Ours against every other backend timed in the same run: the rows of ``ctxfast bench``'s
compact tables and of the README's "where we are slower" list.

A report's records pair each backend with the op's one baseline (``report.py``). Users
also ask how ctxfast compares with the *other* peers timed next to it (SDPA,
FlexAttention, cuDNN's ``nn.LSTM``, Hugging Face's SDPA models): every backend timed in the
same (op, case, mode, dtype, device) is a record (or the baseline of one), so the times of
all of them are known and any two can be compared.

Ours = the ctxfast backends :data:`OURS` (``triton``, ``cuda``, ``cpu`` kernels and the
``ctxfast`` models); ``eager`` is ctxfast's reference and counts as a peer (the op
baseline), not as ours. Loaded by path (no package, no torch import).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

#: Backends that are ctxfast's own kernels (or models running on them).
OURS: Tuple[str, ...] = ("triton", "cuda", "cpu", "ctxfast")
#: Rows that are neither ours nor a peer: another ctxfast op timed on the same inputs as a
#: yardstick (rel_attention's ``ctxfast.attention``: what the position term costs). Never
#: paired: being slower than a simpler op is expected, not a loss to a peer.
YARDSTICKS: Tuple[str, ...] = ("ctxfast.attention",)


class Pair(NamedTuple):
    op: str
    case: str
    mode: str
    ours: str            # our backend
    other: str           # the peer
    ours_ms: float
    other_ms: float

    @property
    def speedup(self) -> float:
        """other time / our time: > 1 where we are faster."""
        return self.other_ms / self.ours_ms


def times(records: Sequence[dict]) -> Dict[Tuple[str, str, str, str], Dict[str, float]]:
    """{(op, case, mode, dtype): {backend: ms}} of every backend with a time, the baselines
    included (from ``baseline_ms``)."""
    out: Dict[Tuple[str, str, str, str], Dict[str, float]] = {}
    for r in records:
        key = (r["op"], str(r.get("case", "")), r["mode"], str(r.get("dtype")))
        got = out.setdefault(key, {})
        if r.get("ms") is not None:
            got[r["backend"]] = float(r["ms"])
        if r.get("baseline") and r.get("baseline_ms") is not None:
            got.setdefault(r["baseline"], float(r["baseline_ms"]))
    return out


def pairs(records: Sequence[dict], ours: Sequence[str] = OURS) -> List[Pair]:
    """Every (our backend, other backend) pair timed on the same case, in record order."""
    out: List[Pair] = []
    for (op, case, mode, _), ms in times(records).items():
        for mine in (b for b in ms if b in ours):
            for other in (b for b in ms if b not in ours and b not in YARDSTICKS):
                if ms[mine] > 0:
                    out.append(Pair(op, case, mode, mine, other, ms[mine], ms[other]))
    return out


def peers(records: Sequence[dict], op: str, ours: Sequence[str] = OURS) -> List[str]:
    """The non-ctxfast backends timed for `op`, the op's baseline first."""
    base = [r.get("baseline") for r in records if r["op"] == op and r.get("baseline")]
    found: List[str] = []
    for b in base[:1] + [r["backend"] for r in records if r["op"] == op] + base:
        if b and b not in ours and b not in YARDSTICKS and b not in found:
            found.append(b)
    return found


def fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return "—"
    return f"{x:.4f}" if x < 0.1 else f"{x:.3f}" if x < 10 else f"{x:.1f}"
