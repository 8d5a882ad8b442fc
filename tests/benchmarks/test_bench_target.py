"""`make bench`'s list: every runnable benchmarks/*.py is a speed benchmark on the Makefile's
``SPEED`` (run with its defaults) or a study named in the benchmarks' README (its own arguments)."""

from __future__ import annotations

import re

from support.helpers import BENCHMARKS_README, ROOT


def test_every_runnable_script_is_a_speed_benchmark_or_a_named_study() -> None:
    (line,) = re.findall(r"^SPEED := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    speed = set(line.split())
    runnable = {
        p.stem
        for p in (ROOT / "benchmarks").glob("*.py")
        if 'if __name__ == "__main__":' in p.read_text()
    }
    assert speed <= runnable, sorted(speed - runnable)
    (studies,) = re.findall(r"The studies \(([^)]+)\)", BENCHMARKS_README.read_text())
    named = set(re.findall(r"`(\w+)\.py`", studies))
    assert runnable - speed == named, sorted(runnable - speed ^ named)
