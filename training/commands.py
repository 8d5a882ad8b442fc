"""The training sub-commands of ``vip-hub`` (registered as entry-point plugins).

Each recipe is a dataclass; its fields become ``--options`` here, so the CLI, the Python API
and ``torchrun -m training.dp`` share one definition of every setting and its default.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from vip_hub.cli import CommandError, add_command

__all__ = ["config_from_args", "add_config_args", "register_probe", "register_run",
           "register_synth_preview", "register_train_dp", "register_train_syn"]

HELP = {
    "init": "(Syn)-ViP repo folder to start from (with mae_decoder.safetensors)",
    "data": "image folder (class subfolders allowed) or directory of webdataset tar shards",
    "out": "folder the released repo is written to (the run folder is OUT.run/)",
    "epsilon": "target epsilon; training stops before exceeding it",
    "sigma": "noise multiplier (default: calibrated from --epsilon)",
    "delta": "delta (default 1/(2n))",
    "batch_size": "expected logical batch size B (DP: q = B/n)",
    "micro_batch_size": "physical batch that fits memory (does not change the result)",
    "dataset_size": "n, checked against the images found",
    "seed": "seed of every random stream (DP default: a secret random one)",
    "restart": "discard the run folder's checkpoint and start over",
    "device": "auto, cpu, cuda or cuda:N",
    "encoder": "encoder repo folder or hub repo id",
    "test_data": "labelled test folder (default: a stratified split of --data)",
    "head": "head name: the repo gets heads/NAME/",
    "pooling": "feature mode: vip (the paper's), avg or cls",
    "few_shot": "keep k training examples per class",
    "export": "add the head to the repo (--out, or the encoder folder)",
    "serve": "keep serving after publishing",
    "work_dir": "where the job keeps data, runs and repos",
    "store": "the hub store the server uses",
}


def _base(tp: Any) -> Any:
    """``X | None`` -> X."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_config_args(parser: argparse.ArgumentParser, cls: type, positional: tuple[str, ...] = ()) -> None:
    """Add one option per dataclass field (``positional`` ones as arguments)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _base(hints[f.name])
        required = f.default is dataclasses.MISSING
        help_ = HELP.get(f.name, "")
        if f.name in positional:
            parser.add_argument(f.name, type=tp, help=help_)
        elif tp is bool:
            parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=f.default,
                                action=argparse.BooleanOptionalAction, help=help_)
        else:
            default = None if required else f.default
            parser.add_argument(
                f"--{f.name.replace('_', '-')}", dest=f.name, type=tp, required=required, default=default,
                help=f"{help_} (default: {default})" if not required else help_,
            )


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass built from parsed arguments."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def register_train_syn(sub: Any) -> None:
    from .syn import SynConfig

    p = add_command(sub, "train-syn", _train_syn, "(Syn)-ViP: MAE pretraining on procedural images")
    add_config_args(p, SynConfig)


def _train_syn(args: argparse.Namespace) -> int:
    from .syn import SynConfig, train_syn

    out = train_syn(config_from_args(SynConfig, args))
    print(f"exported {out}")
    return 0


def register_train_dp(sub: Any) -> None:
    from .dp import DPConfig

    p = add_command(sub, "train-dp", _train_dp, "ViP: DP-AdamW MAE training on private images")
    add_config_args(p, DPConfig)


def _train_dp(args: argparse.Namespace) -> int:
    from .dp import DPConfig, train_dp
    from .distributed import Dist

    cfg = config_from_args(DPConfig, args)
    dist = Dist.from_env(cfg.device)
    try:
        out = train_dp(cfg, dist)
    finally:
        dist.close()
    if dist.main:
        print(f"exported {out}")
    return 0


def register_synth_preview(sub: Any) -> None:
    p = add_command(sub, "synth-preview", _synth_preview, "write a contact sheet of procedural images")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--size", type=int, default=96, help="pixels per image")
    p.add_argument("--columns", type=int, default=8)


def _synth_preview(args: argparse.Namespace) -> int:
    from .synthetic import contact_sheet

    if not 1 <= args.count <= 4096 or not 8 <= args.size <= 1024 or args.columns < 1:
        raise ValueError("--count must be 1..4096, --size 8..1024, --columns >= 1")
    contact_sheet(args.seed, args.count, args.size, args.columns).save(args.out)
    print(f"wrote {args.out}: {args.count} images of {args.size} px")
    return 0


def register_probe(sub: Any) -> None:
    from .probe import ProbeConfig

    p = add_command(sub, "probe", _probe, "train and evaluate a linear-probe head on a frozen encoder")
    add_config_args(p, ProbeConfig)


def _probe(args: argparse.Namespace) -> int:
    from .probe import ProbeConfig, run_probe

    cfg = config_from_args(ProbeConfig, args)
    r = run_probe(cfg)
    kind = f"DP, epsilon {r.stage.epsilon:.3g}" if r.stage.type == "dp" else "no DP"
    print(f"head {cfg.head!r} ({cfg.pooling} features, {kind}): top-1 {r.top1:.4f} on {r.test_size} "
          f"held-out images ({r.train_size} training)")
    if r.repo:
        print(f"saved to {r.repo}/heads/{cfg.head}/")
    return 0


def register_run(sub: Any) -> None:
    from .main_job import MainJobConfig

    p = add_command(sub, "run", _run, "the main job: train, compare, publish and serve private encoders")
    add_config_args(p, MainJobConfig)


def _run(args: argparse.Namespace) -> int:
    from .main_job import MainJobConfig, StepFailed, run_main_job

    try:
        return run_main_job(config_from_args(MainJobConfig, args))
    except StepFailed as e:
        raise CommandError(str(e)) from None
