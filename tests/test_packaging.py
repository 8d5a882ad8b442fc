"""The wheel that ``pip install .`` builds (as in the docker images) carries every module,
template and entry point: the editable install the other tests run on would not notice a
missing sub-package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")


def test_wheel_carries_every_package_file_and_entry_point(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--wheel-dir", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("vip_hub-*.whl")))
    names = set(wheel.namelist())
    expected = {p.relative_to(src).as_posix() for pkg in PACKAGES for p in (src / pkg).rglob("*") if p.is_file()}
    assert {"service", "training", "vip_hub", "model_cards"} <= set(PACKAGES)
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    entry_points = wheel.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    for line in ("vip-hub = vip_hub.cli:main", "serve = service.cli:register_serve", "run = training.commands:register_run"):
        assert line in entry_points
