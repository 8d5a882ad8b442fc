"""The wheel that ``pip install .`` builds (as in the docker images) carries every module,
template and entry point, and its core install (no extras) loads and verifies a released
encoder without the web server or the training stack."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support.helpers import PROJECT_README, ROOT

from vip_hub.privacy.ledger import PrivacyLedger

PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
PIP = [sys.executable, "-m", "pip", "--python"]
"""This venv's pip, run on another environment's Python (pip >= 22.3): that one needs no pip."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", PROJECT_README.name):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return next((tmp / "dist").glob("vip_hub-*.whl"))


def test_wheel_carries_every_package_file_and_entry_point(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    expected = {
        p.relative_to(ROOT).as_posix()
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert {"service", "training", "vip_hub", "model_cards"} <= set(PACKAGES)
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    entry_points = archive.read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    ).decode()
    for line in (
        "vip-hub = vip_hub.cli.main:main",
        "serve = service.cli:register_serve",
        "training = training.commands:register",
    ):
        assert line in entry_points


def _closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions ``requirements`` need, recursively, each with the extras its
    requirers name (the no-extra requirements of the wheel at the top)."""
    seen: dict[str, metadata.Distribution] = {}
    extras_seen: set[tuple[str, str]] = set()
    stack = [Requirement(text) for text in requirements]
    while stack:
        req = stack.pop()
        name = canonicalize_name(req.name)
        wanted = {(name, extra) for extra in ["", *req.extras]} - extras_seen
        if not wanted:
            continue
        extras_seen |= wanted
        try:
            seen[name] = dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a marker for another platform or Python; `pip check` names a real gap
        for text in dist.requires or []:
            sub = Requirement(text)
            if any(sub.marker is None or sub.marker.evaluate({"extra": e}) for _, e in wanted):
                stack.append(sub)
    return seen


def _core_requirements(wheel: Path) -> list[str]:
    """The wheel's own ``Requires-Dist`` lines that no extra adds: what ``pip install vip-hub``
    installs."""
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(name).decode().splitlines()
    texts = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    return [
        t for t in texts if (r := Requirement(t)).marker is None or r.marker.evaluate({"extra": ""})
    ]


CORE_SCRIPT = """
import importlib.util, json, sys
import vip_hub
encoder = vip_hub.load_encoder(sys.argv[1])             # verifies first
report = vip_hub.verify_repo(sys.argv[1])
import torch
out = encoder.embed(torch.zeros(2, 3, 32, 32), pooling="vip")
present = [m for m in ("fastapi", "uvicorn", "sklearn", "matplotlib")
           if importlib.util.find_spec(m) is not None]
loaded = [m for m in ("service", "training") if m in sys.modules]  # in the wheel, never needed here
print(json.dumps({"ok": report.ok, "shape": list(out.shape), "epsilon": encoder.privacy.epsilon,
                  "present": present, "loaded": loaded}))
"""


@pytest.mark.slow
def test_core_install_alone_loads_and_verifies_a_repo(
    wheel: Path, tiny_repo: Path, tmp_path: Path
) -> None:
    # A fresh environment with nothing but Python (not even pip: this one, run with --python,
    # installs into it). The distributions the wheel's core requirements need, recursively, are
    # linked in from this environment (torch and torchvision alone are several GB) and nothing
    # else is: `pip check` below fails if the wheel declares a requirement they do not satisfy,
    # and the script fails if the code imports anything outside them. Every command runs in
    # tmp_path: from the checkout, `python -c`/`-m` would put its source tree and
    # vip_hub.egg-info on sys.path.
    env_dir = tmp_path / "core-venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    linked = tmp_path / "core-site"
    linked.mkdir()
    site = Path(metadata.distribution("torch").locate_file(""))
    core = _closure(_core_requirements(wheel))
    assert {"torch", "timm", "safetensors", "opacus"} <= set(core), sorted(core)
    assert not {"fastapi", "uvicorn", "scikit-learn", "matplotlib"} & set(core), sorted(core)
    for dist in core.values():
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (linked / top).exists() and (site / top).exists():
                (linked / top).symlink_to(site / top)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        cwd=tmp_path,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "core-from-disk.pth").write_text(str(linked) + "\n")
    done = subprocess.run(
        [*PIP, str(python), "install", "-q", "--disable-pip-version-check", "--no-deps"]
        + ["--no-compile", str(wheel)],
        capture_output=True,
        cwd=tmp_path,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    check = subprocess.run(
        [*PIP, str(python), "check"], capture_output=True, cwd=tmp_path, text=True
    )
    assert check.returncode == 0, check.stdout
    run = subprocess.run(
        [str(python), "-c", CORE_SCRIPT, str(tiny_repo)],
        capture_output=True,
        cwd=tmp_path,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    result = json.loads(run.stdout.strip().splitlines()[-1])
    claim = PrivacyLedger.read(tiny_repo).summary().epsilon
    assert claim is not None and claim > 0  # the repo's DP stage
    assert result == {
        "ok": True,
        "shape": [2, 192 * 6],
        "epsilon": pytest.approx(claim),  # the DP stage's, read in the core install
        "present": [],
        "loaded": [],
    }
    server = subprocess.run(
        [str(python), "-c", "import service.app"], capture_output=True, cwd=tmp_path, text=True
    )
    assert (
        server.returncode != 0 and "No module named 'fastapi'" in server.stderr
    )  # needs the serve extra
    cli = env_dir / "bin" / "vip-hub"
    assert (
        subprocess.run(
            [str(cli), "verify", str(tiny_repo)], capture_output=True, cwd=tmp_path, text=True
        ).returncode
        == 0
    )
    help_text = subprocess.run(
        [str(cli), "--help"], capture_output=True, cwd=tmp_path, text=True
    ).stdout
    unavailable = " ".join(help_text.split("unavailable commands")[1].split())  # as unwrapped
    assert "training (needs the train extra" in unavailable
    for command in ("serve", "token", "org", "trust", "store"):  # the four last loaded, then
        assert f"{command} (needs the serve extra" in unavailable  # died on fastapi's import
    assert "verify" in help_text.split("unavailable commands")[0]


def test_a_command_named_by_its_plugin_loads_that_plugin_alone(tmp_path: Path) -> None:
    """``vip-hub token`` (or ``serve``) loads the service's plugin only, not the training one
    with torch and timm (seconds before every command); ``--help`` still lists every command."""
    code = (
        "import sys\n"
        "from vip_hub.cli.main import main\n"
        "rc = main(['token', 'create', '--name', 'ann', '--store', sys.argv[1]])\n"
        "print(rc, sorted(m for m in ('torch', 'timm', 'training') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "store")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout
    cli = Path(sys.executable).with_name("vip-hub")
    listed = subprocess.run([str(cli), "--help"], capture_output=True, text=True).stdout
    assert "train-vip" in listed and "token" in listed and "verify" in listed
    # a plugin's name that is not one of its commands: the error lists every command
    wrong = subprocess.run([str(cli), "training"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "invalid choice: 'training'" in wrong.stderr
    assert "train-vip" in wrong.stderr and "token" in wrong.stderr and "verify" in wrong.stderr


def _cli_in_a_fresh_process(argv: list[str], modules: tuple[str, ...]) -> tuple[list[str], str]:
    """Run ``vip-hub argv`` in a fresh interpreter: which of ``modules`` it imported, and what it
    printed."""
    code = (
        "import contextlib, io, sys\n"
        "from vip_hub.cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        f"    main({argv!r})\n"
        f"print(sorted(m for m in {modules!r} if m in sys.modules))\n"
        "print(out.getvalue())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loaded, printed = done.stdout.split("\n", 1)
    return ast.literal_eval(loaded), printed


def test_listing_the_commands_imports_no_recipe_and_each_command_keeps_its_options() -> None:
    """``vip-hub --help`` took 7 s: registering the training commands imported every recipe's
    configuration (torch, timm), and ``key`` and ``sign`` the verifier. Their options are added
    when the command is used: the listing imports none of it and names every command, and a
    command's help and its parsing still have every option."""
    slow = ("torch", "timm", "training.skeleton.config", "vip_hub.repo.signing")
    loaded, listing = _cli_in_a_fresh_process(["--help"], slow)
    assert loaded == [], loaded
    from training.commands import RECIPES, recipe_command
    from vip_hub.cli.main import build_parser

    commands = [*map(recipe_command, RECIPES), "probe", "run", "key", "sign", "verify", "token"]
    assert set(commands) <= set(re.findall(r"^ {4}(\S+)", listing, re.M)), listing
    parser = build_parser()
    helps = {c: parser._subparsers._group_actions[0].choices[c].format_help() for c in commands}
    assert "--temperature" in helps["train-logit-dp"] and "--head-clip" in helps["run"]
    assert "--overwrite" in helps["key"] and "--key" in helps["sign"]
    args = build_parser().parse_args(["train-logit-dp", "--temperature", "0.25", "--init=i"])
    assert (args.recipe, args.temperature, args.init) == ("logit_dp", 0.25, "i")
    key = build_parser().parse_args(["key", "create", "--name", "k"])
    assert (key.action, key.name, key.overwrite) == ("create", "k", False)
    fresh = build_parser()._subparsers._group_actions[0].choices
    assert fresh["key"].get_default("name") == "signing"  # a default, before any other use
    assert fresh["sign"].parse_intermixed_args(["f", "--key", "k"]).folder == "f"


def test_the_training_commands_start_without_scipy() -> None:
    """The training plugin's commands leave scipy unloaded until a test statistic is computed
    (``scipy.stats`` was 1.7 s of every command's start, ``--help`` included)."""
    loaded, _ = _cli_in_a_fresh_process(["train-vip", "--help"], ("training", "scipy"))
    assert loaded == ["training"], loaded
