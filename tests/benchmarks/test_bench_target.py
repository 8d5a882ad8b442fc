"""`make bench`'s list: every runnable benchmarks/*.py is a speed benchmark on the Makefile's
``SPEED`` (run with its defaults) or a study named in the benchmarks' README (its own arguments)."""

from __future__ import annotations

import re
import subprocess
import sys

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


def test_scripts_that_read_the_tests_support_find_the_projects_packages(tmp_path) -> None:
    """A script that puts tests/ on its path, run from anywhere, still imports the project's
    ``service`` and ``training``, not the namespace packages tests/ holds under those names."""
    scripts = [p for p in (ROOT / "benchmarks").glob("*.py") if 'ROOT / "tests"' in p.read_text()]
    assert scripts
    for script in scripts:
        code = f"import runpy; runpy.run_path({str(script)!r}); import support.live"
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (script.name, done.stderr[-2000:])
