"""(Syn) priors committed to the project (issue 36): encoder repos trained on procedural images
only (no private data, ε = 0), which the main job publishes as its (Syn) repos and every DP run of
the main job and of ``benchmarks/utility.py`` starts from, instead of training its own.

Each is reproduced by one command, ``prior_command(name)`` (``vip-hub train-syn`` with
``PRIORS[name]``'s settings, seed 0), whose per-step training losses are committed beside the repo
(``<name>.losses.json``): a rerun reproduces that curve, which tests/training/recipes/test_priors.py
checks on its first steps. They train in fp32 on any device (``bf16`` off), so a GPU run reproduces
the CPU's curve to rounding. The weights are stored in float16 (a committed prior is at most 5 MB).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vip_hub.errors import MissingInputError

__all__ = ["PRIORS", "losses_path", "prior_command", "prior_path", "read_losses"]

HERE = Path(__file__).resolve().parent
_DISTILLED = {
    "objective": "scatter",
    "depth": 4,
    "img_size": 28,
    "patch_size": 4,
    "crop_pct": 1.0,
    "batch_size": 64,
    "lr": 1e-3,
    "seed": 0,
    "weights_dtype": "float16",
    "workers": 0,
    "bf16": False,
}
PRIORS: dict[str, dict[str, Any]] = {
    "vip-nano-scatter": {"arch": "vip-nano", "steps": 10000, **_DISTILLED},
    "dpcap-nano-scatter": {"arch": "dpcap-nano", "steps": 5000, **_DISTILLED},
}
"""Each prior's ``SynConfig`` settings (but ``out``): a 4-block encoder at 28 px and patch 4 (a
7 x 7 patch grid that reads Fashion-MNIST without resizing) whose last block's tokens learned a
ScatterNet's coefficients (``training.recipes.scatter``); ViP's and DP-Cap's family each."""


def prior_path(name: str) -> Path:
    """The committed repo folder of prior ``name``; MissingInputError names the known ones."""
    if name not in PRIORS:
        raise MissingInputError(f"no committed prior {name!r}; known: {', '.join(PRIORS)}")
    return HERE / name


def losses_path(name: str) -> Path:
    """The committed per-step training losses of prior ``name`` (a JSON list)."""
    return prior_path(name).with_name(f"{name}.losses.json")


def prior_command(name: str, out: str | None = None) -> list[str]:
    """The command that trains prior ``name`` into ``out`` (default: its committed folder)."""
    folder = prior_path(name)  # raises for an unknown name
    args = ["vip-hub", "train-syn", "--out", out or str(folder), "--model-name", name]
    for key, value in PRIORS[name].items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):  # argparse's --flag / --no-flag
            args.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            args += [f"--{flag}", str(value)]
    return args


def read_losses(name: str) -> list[float]:
    """The committed per-step training losses of prior ``name``."""
    return [float(x) for x in json.loads(losses_path(name).read_text())]
