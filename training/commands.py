"""The training sub-commands of ``vip-hub`` (one entry-point plugin, ``register``).

Every recipe in ``RECIPES`` becomes ``vip-hub train-<name>`` with the options of its one
configuration declaration (``training/skeleton/config.py``); ``probe`` and ``run`` read theirs the
same way. ``torchrun -m training.recipes.<module>`` takes the same arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vip_hub.cli.main import Options, add_command, require_extra
from vip_hub.errors import ConfigError
from vip_hub.repo_format import head_component

from .skeleton.memory import reuse_freed_memory

if TYPE_CHECKING:
    from pydantic import BaseModel

    from .skeleton.config import Recipe

# The configurations (training.skeleton.config and the recipes) import torch: each is imported
# when its command runs or prints its help, not to list the commands.

__all__ = ["RECIPES", "note_head_statistics", "recipe", "recipe_command", "register"]

RECIPES = {
    "syn": "(Syn)-ViP: pretraining on procedural images",
    "vip": "ViP: DP-AdamW MAE training on private images",
    "dpcap": "DP-Cap: DP-AdamW image captioning on private image-caption pairs",
    "logit_dp": "Logit-DP: a contrastive encoder with per-pair clipping (or the Naive-DP baseline)",
    "finetune": "DP fine-tuning: a (Syn)-ViP encoder's top blocks and a linear head on labelled "
    "images",
}
"""Each module of ``training.recipes`` that declares a ``RECIPE``, and what its command does
(here, not in the module, so that listing the commands imports no recipe, torch or timm)."""


def recipe_command(module: str) -> str:
    """The command that runs ``training.recipes.<module>``'s recipe: ``train-logit-dp``."""
    return "train-" + module.replace("_", "-")


def recipe(module: str) -> Recipe:
    """The recipe declared by ``training.recipes.<module>``."""
    return importlib.import_module(f"training.recipes.{module}").RECIPE


def register(sub: Any) -> None:
    """Add every training sub-command to the ``vip-hub`` parser; each one's options (from its
    configuration, whose module imports torch) are added when it is used."""
    require_extra("train", "matplotlib")
    for module, summary in RECIPES.items():
        options = _config_options(partial(_recipe_config, module))
        p = add_command(sub, recipe_command(module), _train, summary, options)
        p.set_defaults(recipe=module)
    add_command(
        sub,
        "probe",
        _probe,
        "train and evaluate a linear-probe head on a frozen encoder",
        _config_options(_probe_config),
    )
    add_command(
        sub,
        "run",
        _run,
        "the main job: train, compare, publish and serve private encoders",
        _config_options(_main_job_config),
    )
    p = add_command(
        sub, "synth-preview", _synth_preview, "write a contact sheet of procedural images"
    )
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--size", type=int, default=96, help="pixels per image")
    p.add_argument("--columns", type=int, default=8)


def _config_options(config: Callable[[], type[BaseModel]]) -> Options:
    """Adds the options of the configuration class ``config()`` imports."""

    def options(parser: argparse.ArgumentParser) -> None:
        from .skeleton.config import add_config_args

        add_config_args(parser, config())

    return options


def _recipe_config(module: str) -> type[BaseModel]:
    return recipe(module).config


def _probe_config() -> type[BaseModel]:
    from .recipes.probe import ProbeConfig

    return ProbeConfig


def _main_job_config() -> type[BaseModel]:
    from .main_job import MainJobConfig

    return MainJobConfig


def note_head_statistics(cfg: Any) -> None:
    """Say on stderr when ``cfg``'s DP head will be normalised by procedural images' features
    because no ``--public-data`` was given."""
    from .recipes.probe import HeadData

    dp = getattr(cfg, "epsilon", None) is not None
    if isinstance(cfg, HeadData) and dp and not cfg.public_data:
        print(
            "note: no --public-data, so the DP head's normalisation comes from procedural "
            "images' features; public images of the task's domain (--public-data FOLDER) "
            "centre it and make a stronger head",
            file=sys.stderr,
        )


def _train(args: argparse.Namespace) -> int:
    from .dp.run import retrained_if_flagged
    from .skeleton.config import DPRunConfig, config_from_args
    from .skeleton.distributed import Dist

    r = recipe(args.recipe)
    cfg = config_from_args(r.config, args)
    note_head_statistics(cfg)
    reuse_freed_memory()
    dist = Dist.from_env(cfg.device)
    try:
        if isinstance(cfg, DPRunConfig) and dist.world == 1:
            out = retrained_if_flagged(lambda c: r.train(c, dist), cfg)
        else:  # ranks of torchrun would have to start again together: a flag is raised
            out = r.train(cfg, dist)
    finally:
        dist.close()
    if dist.main:
        print(f"exported {out}")
    return 0


def _synth_preview(args: argparse.Namespace) -> int:
    from .data.procedural import contact_sheet

    if not 1 <= args.count <= 4096 or not 8 <= args.size <= 1024 or args.columns < 1:
        raise ConfigError("--count must be 1..4096, --size 8..1024, --columns >= 1")
    if args.seed < 0:
        raise ConfigError(f"--seed {args.seed}: a seed is a non-negative integer")
    from PIL import Image

    out = Path(args.out)
    Image.init()
    image_format = Image.EXTENSION.get(out.suffix.lower())
    if image_format not in Image.SAVE:  # .psd, .xpm...: formats Pillow reads and cannot write
        raise ConfigError(
            f"--out {out}: {out.suffix or 'no extension'} is no image format Pillow writes "
            "(.png, .jpg, ...)"
        )
    # (more columns than images would only widen the sheet: 600 million overflowed Pillow)
    sheet = contact_sheet(args.seed, args.count, args.size, min(args.columns, args.count))
    tmp = out.with_name(f".{out.name}.part")  # written whole, then renamed into place
    try:
        sheet.save(tmp, format=image_format)
        os.replace(tmp, out)
    except (OSError, ValueError) as e:  # ValueError: a format that does not take RGB (BLP)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ConfigError(
            f"cannot write --out {out}: {getattr(e, 'strerror', None) or e}"
        ) from None
    print(f"wrote {out}: {args.count} images of {args.size} px")
    return 0


def _probe(args: argparse.Namespace) -> int:
    from .recipes.probe import ProbeConfig, run_probe
    from .skeleton.config import config_from_args

    cfg = config_from_args(ProbeConfig, args)
    note_head_statistics(cfg)
    reuse_freed_memory()
    r = run_probe(cfg)
    kind = f"DP, epsilon {r.stage.epsilon:.3g}" if r.stage.type == "dp" else "no DP"
    where = (
        "public test images (published with the head)"
        if cfg.test_data
        else "held-out private images (not published: a figure on private data carries no "
        "guarantee)"
    )
    print(
        f"head {cfg.head!r} ({cfg.pooling} features, {kind}): top-1 {r.top1:.4f} on "
        f"{r.test_size} {where}; {r.train_size} training images"
    )
    if r.repo:
        print(f"saved to {r.repo}/{head_component(cfg.head)}/")
    return 0


def _run(args: argparse.Namespace) -> int:
    from .main_job import MainJobConfig, run_main_job, sigterm_as_interrupt
    from .skeleton.config import config_from_args

    cfg = config_from_args(MainJobConfig, args)
    reuse_freed_memory()  # the server it starts is a process of its own, with glibc's defaults
    with sigterm_as_interrupt():
        return run_main_job(cfg)
