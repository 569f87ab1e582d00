"""Per-notebook timing for the nbval run (design section 4: each chapter under 60 s on 2 cores).

At the repository root so that its hooks see the items collected from book/ as well as tests/.
"""
from __future__ import annotations

import collections

NOTEBOOK_BUDGET_S = 60.0

_notebook_seconds: dict[str, float] = collections.defaultdict(float)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb") and report.when == "call":
        _notebook_seconds[path] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _notebook_seconds:
        return
    terminalreporter.section("notebook execution times (nbval)")
    for path, seconds in sorted(_notebook_seconds.items()):
        flag = "  OVER BUDGET" if seconds > NOTEBOOK_BUDGET_S else ""
        terminalreporter.write_line(f"{seconds:6.1f} s  {path}{flag}")


def pytest_sessionfinish(session, exitstatus):
    over = {p: round(s, 1) for p, s in _notebook_seconds.items() if s > NOTEBOOK_BUDGET_S}
    if over and exitstatus == 0:
        session.exitstatus = 1
        print(f"\nnotebooks over the {NOTEBOOK_BUDGET_S:.0f} s budget: {over}")
