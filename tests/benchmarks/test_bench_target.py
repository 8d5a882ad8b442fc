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


def test_every_runnable_script_loads_from_anywhere(tmp_path) -> None:
    """Each runnable script's module-level code runs (its imports, its definitions) from another
    folder, in one interpreter; and one that puts tests/ on its path still imports the project's
    ``service`` and ``training``, not the namespace packages tests/ holds under those names."""
    scripts = sorted(
        str(p)
        for p in (ROOT / "benchmarks").glob("*.py")
        if 'if __name__ == "__main__":' in p.read_text()
    )
    code = (
        f"import runpy, sys\nsys.path[0] = {str(ROOT / 'benchmarks')!r}  # as for a script\n"
        f"for s in {scripts!r}:\n    runpy.run_path(s, run_name='loaded')\nimport support.live"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
