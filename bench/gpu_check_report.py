"""The report of ``bench/gpu_check.py``: measurements (rows), checks, one table."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

GIB = 1024**3


@dataclasses.dataclass
class Row:
    name: str
    seconds: float | None = None
    nbytes: int | None = None
    note: str = ""

    @property
    def gbps(self) -> float | None:
        if not self.seconds or not self.nbytes:
            return None
        return self.nbytes / self.seconds / 1e9


@dataclasses.dataclass
class Report:
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)
    rows: list[Row] = dataclasses.field(default_factory=list)
    checks: list[tuple[str, bool, str]] = dataclasses.field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, bool(ok), detail))
        return bool(ok)

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.checks)


def render(report: Report, *, as_json: bool) -> str:
    if as_json:
        return json.dumps(
            {
                "ok": report.ok,
                "environment": report.environment,
                "rows": [
                    {
                        "name": r.name,
                        "seconds": r.seconds,
                        "bytes": r.nbytes,
                        "gbps": r.gbps,
                        "note": r.note,
                    }
                    for r in report.rows
                ],
                "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in report.checks],
            },
            indent=2,
        )
    lines = [f"{k}: {v}" for k, v in report.environment.items()]
    lines += ["", f"{'measurement':<38} {'seconds':>9} {'GiB':>8} {'GB/s':>8}  note"]
    for r in report.rows:
        secs = f"{r.seconds:9.3f}" if r.seconds is not None else f"{'-':>9}"
        gib = f"{r.nbytes / GIB:8.2f}" if r.nbytes is not None else f"{'-':>8}"
        rate = f"{r.gbps:8.2f}" if r.gbps is not None else f"{'-':>8}"
        lines.append(f"{r.name:<38} {secs} {gib} {rate}  {r.note}")
    lines += ["", "checks:"]
    lines += [
        f"  [{'ok' if ok else 'FAIL'}] {n}" + (f" ({d})" if d and not ok else "")
        for n, ok, d in report.checks
    ]
    lines.append("ALL CHECKS PASSED" if report.ok else "SOME CHECKS FAILED")
    return "\n".join(lines)
