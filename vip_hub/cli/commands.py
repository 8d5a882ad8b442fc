"""The library's own sub-commands: epsilon, calibrate, verify, import-mae, import-dpcap, push,
caption, zero-shot."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..device import DEVICE_HELP, check_device_name
from ..errors import ConfigError
from ..models.names import family_archs
from ..privacy.accounting import Accountant
from ..privacy.sensitivity import DP_ADAMW, PER_EXAMPLE_MECHANISMS
from ..repo_format import DEFAULT_BRANCH, SIGNATURE_FILE, VOCAB_FILE
from .main import add_command

if TYPE_CHECKING:
    from ..privacy.ledger import DPStage, NonPrivateStage

# Heavy modules (torch, opacus) are imported inside the handlers, so `vip-hub --help` is quick.
ACCOUNTANTS = tuple(a.value for a in Accountant)
VIP_ARCHS = family_archs("vip")
DPCAP_ARCHS = family_archs("dpcap")
VIP_PRESETS = ("vip-base", "vip-syn-base")
DPCAP_PRESETS = ("dpcap-base-eps7",)

__all__ = [
    "register_calibrate",
    "register_caption",
    "register_epsilon",
    "register_import_dpcap",
    "register_import_mae",
    "register_push",
    "register_verify",
    "register_zero_shot",
]


def _run_args(p: argparse.ArgumentParser) -> None:
    """The options of a run of Poisson-sampled Gaussian steps: q, T, delta, the accountant."""
    p.add_argument("--sample-rate", type=float, required=True, help="Poisson sampling rate q = B/n")
    p.add_argument("--steps", type=int, required=True, help="number of steps T")
    p.add_argument("--delta", type=float, required=True)
    p.add_argument(
        "--accountant",
        choices=ACCOUNTANTS,
        default="rdp",
        help="rdp (Opacus, the ViP paper's; default), prv (Opacus) or pld (Google's dp_accounting)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    """Print the result: ``payload`` and the run's options as JSON (--json), else ``text``
    followed by the run's options."""
    run = {k: getattr(args, k) for k in ("sample_rate", "steps", "delta", "accountant")}
    options = f"q={args.sample_rate:g}, steps={args.steps}, delta={args.delta!r}"
    print(json.dumps(payload | run) if args.json else f"{text} for {options}")


# ------------------------------------------------------------------------- epsilon
def register_epsilon(sub: Any) -> None:
    """The ``epsilon`` command: what T Poisson-sampled Gaussian steps spend."""
    p = add_command(sub, "epsilon", _epsilon, "epsilon spent by T Poisson-sampled Gaussian steps")
    p.add_argument("--sigma", type=float, required=True, help="noise multiplier")
    _run_args(p)


def _epsilon(args: argparse.Namespace) -> None:
    from ..privacy.accounting import epsilon

    eps = epsilon(args.sigma, args.sample_rate, args.steps, args.delta, args.accountant)
    text = f"epsilon = {eps:.4f} ({args.accountant}) with sigma={args.sigma:g}"
    _emit(args, {"epsilon": eps, "sigma": args.sigma}, text)


# ----------------------------------------------------------------------- calibrate
def register_calibrate(sub: Any) -> None:
    """The ``calibrate`` command: the least sigma that meets a target epsilon."""
    p = add_command(
        sub, "calibrate", _calibrate, "smallest noise multiplier that stays within an epsilon"
    )
    p.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    _run_args(p)


def _calibrate(args: argparse.Namespace) -> None:
    from ..privacy.accounting import calibrate, epsilon

    sigma = calibrate(args.epsilon, args.delta, args.sample_rate, args.steps, args.accountant)
    spent = epsilon(sigma, args.sample_rate, args.steps, args.delta, args.accountant)
    payload = {"sigma": sigma, "epsilon": spent, "target_epsilon": args.epsilon}
    text = f"sigma = {sigma:.6g} (gives epsilon {spent:.4f} <= {args.epsilon:g}, {args.accountant})"
    _emit(args, payload, text)


# -------------------------------------------------------------------------- verify
def register_verify(sub: Any) -> None:
    """The ``verify`` command: a repo's ledger, copies, files and signer checked."""
    p = add_command(
        sub,
        "verify",
        _verify,
        "check a repo's privacy ledger, its copies and its files, and who signed it",
    )
    p.add_argument("repo", help="repo folder")
    p.add_argument(
        "--key",
        action="append",
        metavar="PUB",
        help=(
            f"public key (file, or folder of *.pub) of a signer you trust: {SIGNATURE_FILE} must "
            "be theirs (repeatable)"
        ),
    )
    p.add_argument(
        "--require-signature",
        action="store_true",
        help="fail an unsigned repo too (else a warning: a signature stripped from a repo, then "
        "its files edited, would verify); needs --key",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _verify(args: argparse.Namespace) -> int:
    from ..privacy.ledger import privacy_headline
    from ..repo.signing import check_signature
    from ..repo.verify import verify_repo

    report = verify_repo(args.repo)
    check_signature(args.repo, args.key, report, required=args.require_signature)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        for p in report.problems:
            print(f"FAIL  {p}")
        for w in report.warnings:
            print(f"WARN  {w}")
        if report.ok and report.ledger is not None:
            print(
                f"OK    {args.repo}: {privacy_headline(report.ledger.summary())} "
                f"({', '.join(report.checks)})"
            )
    return 0 if report.ok else 1


# ---------------------------------------------------------------------- import-mae
def _import_args(
    p: argparse.ArgumentParser,
    presets: tuple[str, ...],
    archs: tuple[str, ...],
    sampling: str,
    delta_help: str,
) -> None:
    """The options every import command shares: the repo, and the ledger of any other run."""
    p.add_argument("checkpoint", help="reference checkpoint (.pth), loaded with weights_only=True")
    p.add_argument("--out", required=True, help="repo folder to write")
    p.add_argument("--preset", choices=presets, help="a published checkpoint's arch and ledger")
    p.add_argument("--arch", choices=archs, help="architecture (required without --preset)")
    p.add_argument(
        "--img-size",
        type=int,
        help="input resolution in pixels (default: the released checkpoints')",
    )
    p.add_argument("--name", help="model name (default: the preset's or the folder's)")
    p.add_argument("--repo-id", help="hub id shown on the card, e.g. vip/vip-base")
    p.add_argument("--overwrite", action="store_true")
    g = p.add_argument_group("ledger (without --preset)")
    g.add_argument(
        "--synthetic-dataset",
        default=None,
        help="non-private pretraining data, e.g. Shaders21k (a stage with no cost)",
    )
    g.add_argument("--private-dataset", help="name of the DP-trained dataset")
    g.add_argument("--dataset-size", type=int, help="n, examples in the private dataset")
    g.add_argument("--sigma", type=float, help="noise multiplier")
    g.add_argument("--batch-size", type=float, help="expected batch size B (q = B/n)")
    g.add_argument("--steps", type=int, help="DP steps T")
    g.add_argument("--clip", type=float, help="clipping norm C")
    g.add_argument("--delta", type=float, help=delta_help)
    g.add_argument("--mechanism", default=DP_ADAMW, choices=PER_EXAMPLE_MECHANISMS)
    g.add_argument(
        "--sampling",
        choices=("poisson", "shuffle"),
        default=sampling,
        help=f"how the run drew its batches (default {sampling}); the accountants assume Poisson "
        "sampling, and the card says so when it was not",
    )
    g.add_argument(
        "--ledger-accountant",
        choices=ACCOUNTANTS,
        default="rdp",
        help="the accountant whose epsilon is the claim (the others are reported beside it)",
    )


def register_import_mae(sub: Any) -> None:
    """The ``import-mae`` command: an official ViP/MAE checkpoint as a released repo."""
    p = add_command(
        sub,
        "import-mae",
        _import_mae,
        "convert a ViP-MAE reference checkpoint into a released-encoder repo",
    )
    _import_args(p, VIP_PRESETS, VIP_ARCHS, "poisson", "default 1/(2n), the ViP paper's")


def _import_kwargs(args: argparse.Namespace, delta: Callable[[int], float]) -> dict[str, Any]:
    """The keywords both importers take, from --preset or from --arch and the ledger options;
    an option not given (and not set by the preset) is left to the importer's default."""
    from pathlib import Path

    from ..repo.importer import PRESETS

    stages: Sequence[NonPrivateStage | DPStage]
    if args.preset:
        preset = PRESETS[args.preset]()
        arch, stages, name = preset.arch, preset.stages, preset.model_name
        summary, license = preset.summary, preset.license
    elif args.arch:
        arch, stages, name = args.arch, _stages_from_args(args, delta), Path(args.out).name
        summary, license = "", None
    else:
        raise ConfigError("--arch is required without --preset")
    given = {"img_size": args.img_size}
    if "license" in vars(args):  # import-dpcap's option; ViP repos keep the writer's licence
        given["license"] = args.license or license
    return {
        "arch": arch,
        "stages": stages,
        "model_name": args.name or name,
        "summary": summary,
        "repo_id": args.repo_id,
        "overwrite": args.overwrite,
        **{key: value for key, value in given.items() if value is not None},
    }


def _import_mae(args: argparse.Namespace) -> None:
    from ..privacy.accounting import paper_delta
    from ..repo.importer import import_mae_checkpoint

    out = import_mae_checkpoint(args.checkpoint, args.out, **_import_kwargs(args, paper_delta))
    print(f"wrote {out}")


# -------------------------------------------------------------------- import-dpcap
def register_import_dpcap(sub: Any) -> None:
    """The ``import-dpcap`` command: an official DP-Cap checkpoint as a released repo."""
    p = add_command(
        sub,
        "import-dpcap",
        _import_dpcap,
        "convert a DP-Cap reference checkpoint (encoder and text decoder) into a released-encoder "
        "repo",
    )
    _import_args(p, DPCAP_PRESETS, DPCAP_ARCHS, "shuffle", "default 1/n, the DP-Cap authors'")
    p.add_argument(
        "--vocab",
        metavar="FILE",
        help=f"the tokenizer's {VOCAB_FILE} (BERT uncased WordPiece, e.g. bert-base-uncased's): "
        "copied into the repo so it can caption",
    )
    p.add_argument(
        "--decoder-heads", type=int, help="text decoder heads (default: the architecture's)"
    )
    p.add_argument(
        "--license", help="licence on the card (default: the preset's, else the DP-Cap authors')"
    )


def _import_dpcap(args: argparse.Namespace) -> None:
    from ..repo.importer import import_dpcap_checkpoint

    out = import_dpcap_checkpoint(
        args.checkpoint,
        args.out,
        vocab=args.vocab,
        decoder_heads=args.decoder_heads,
        **_import_kwargs(args, lambda n: 1.0 / n),
    )
    print(f"wrote {out}" + ("" if args.vocab else " (no --vocab: it cannot caption)"))


def _stages_from_args(
    args: argparse.Namespace, delta: Callable[[int], float]
) -> list[NonPrivateStage | DPStage]:
    from ..privacy.ledger import MAX_COUNT, Dataset, DPStage, NonPrivateStage
    from ..repo.importer import REFERENCE_NOISE_SUPPORT, REFERENCE_NOISED_TENSORS

    stages: list[NonPrivateStage | DPStage] = []
    if args.synthetic_dataset:
        stages.append(
            NonPrivateStage(
                name="synthetic-pretraining",
                dataset=Dataset(name=args.synthetic_dataset),
                private_data=False,
            )
        )
    dp = [
        args.private_dataset,
        args.dataset_size,
        args.sigma,
        args.batch_size,
        args.steps,
        args.clip,
    ]
    if any(v is not None for v in dp):
        if any(v is None for v in dp):
            raise ConfigError(
                "a DP stage needs --private-dataset, --dataset-size, --sigma, "
                "--batch-size, --steps and --clip"
            )
        if not 1 <= args.dataset_size <= MAX_COUNT:  # q = B / n
            raise ConfigError(
                f"--dataset-size {args.dataset_size}: n is a positive integer up to 2^53"
            )
        stages.append(
            DPStage.from_parameters(
                name="dp-pretraining",
                dataset=Dataset(name=args.private_dataset, size=args.dataset_size),
                sample_rate=args.batch_size / args.dataset_size,
                noise_multiplier=args.sigma,
                steps=args.steps,
                clipping_norm=args.clip,
                noise_support=REFERENCE_NOISE_SUPPORT,
                noised_tensors=REFERENCE_NOISED_TENSORS,
                mechanism=args.mechanism,
                sampling=args.sampling,
                delta=delta(args.dataset_size) if args.delta is None else args.delta,
                accountant=args.ledger_accountant,
            )
        )
    if not stages:
        raise ConfigError(
            "describe the training: --preset, or --synthetic-dataset and/or the DP stage options"
        )
    return stages


# ---------------------------------------------------------------------------- push
def register_push(sub: Any) -> None:
    """The ``push`` command: a repo folder published to a hub."""
    p = add_command(
        sub, "push", _push, "verify a repo folder and publish it to a hub as one commit"
    )
    p.add_argument("folder", help="repo folder (as written by export, train-* or import-mae)")
    p.add_argument("repo_id", metavar="ORG/NAME")
    p.add_argument("--endpoint", help="hub URL (default: HF_ENDPOINT, else https://huggingface.co)")
    p.add_argument("--token", help="write token (default: HF_TOKEN or the saved login)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=DEFAULT_BRANCH, help="branch to commit to")
    p.add_argument("--message", help="commit message")


def _push(args: argparse.Namespace) -> None:
    from huggingface_hub import constants, get_token

    from ..errors import VerificationError
    from ..hub_client import check_endpoint, hub_errors
    from ..repo.push import push_repo

    endpoint = args.endpoint or constants.ENDPOINT
    check_endpoint(endpoint)
    token = args.token if args.token is not None else get_token()
    if token is not None and not token.isascii():  # it goes in an HTTP header
        raise ConfigError(
            "the token (--token, else HF_TOKEN or the saved login) holds a character that is "
            "not ASCII (a pasted quote?)"
        )
    try:
        with hub_errors(f"pushing {args.repo_id!r} did not complete", endpoint):
            commit = push_repo(
                args.folder,
                args.repo_id,
                endpoint=args.endpoint,
                token=args.token,
                private=args.private,
                revision=args.revision,
                message=args.message,
            )
    except VerificationError as e:
        raise ConfigError(f"{args.folder} does not verify, nothing was pushed: {e}") from None
    print(f"pushed {args.folder} to {args.repo_id} at {commit}")


# ------------------------------------------------------------------ caption, zero-shot
def _device_name(name: str) -> str:
    """``--device``'s argparse type: a device name ``vip_hub.device`` knows."""
    try:
        return check_device_name(name)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _caption_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        metavar="DIR_OR_REPO",
        help="repo folder or hub repo id (HF_ENDPOINT) of a DP-Cap repo",
    )
    p.add_argument("images", metavar="IMAGE", nargs="+", help="image files")
    p.add_argument("--revision", help="hub revision")
    p.add_argument("--device", default="cpu", type=_device_name, help=DEVICE_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _load_for_captions(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    from PIL import Image, UnidentifiedImageError

    from ..device import pick_device
    from ..errors import MissingInputError
    from ..images import to_rgb
    from ..loading import load_captioner

    model = load_captioner(args.source, revision=args.revision, device=pick_device(args.device))
    images = []
    for path in args.images:
        try:
            with Image.open(path) as img:
                images.append(to_rgb(img).copy())  # to_rgb may return img, which closing empties
        except FileNotFoundError:
            raise MissingInputError(f"{path}: no such image file") from None
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
            raise ConfigError(f"{path}: not a readable image ({e})") from None
    return model, images


def _print_per_image(
    args: argparse.Namespace, model: Any, key: str, rows: list[dict[str, Any]], lines: list[str]
) -> None:
    """Print per-image results: with --json one object ``{key: rows, "privacy": ...}``, else a
    line each and the model's privacy headline."""
    from ..privacy.ledger import privacy_headline

    privacy = model.encoder.privacy
    if args.json:
        print(json.dumps({key: rows, "privacy": privacy.to_dict()}))
        return
    print("\n".join(lines))
    print(f"model privacy: {privacy_headline(privacy)}")


def register_caption(sub: Any) -> None:
    """The ``caption`` command: captions of images by a DP-Cap repo."""
    p = add_command(sub, "caption", _caption, "caption images with a DP-Cap repo (greedy decoding)")
    _caption_source_args(p)
    p.add_argument(
        "--max-tokens", type=int, help="most tokens per caption (default: the decoder's maximum)"
    )


def _caption(args: argparse.Namespace) -> None:
    model, images = _load_for_captions(args)
    captions = model.caption(images, args.max_tokens)
    pairs = list(zip(args.images, captions, strict=True))
    _print_per_image(
        args,
        model,
        "captions",
        [{"image": i, "caption": c} for i, c in pairs],
        [f"{path}: {caption}" for path, caption in pairs],
    )


def register_zero_shot(sub: Any) -> None:
    """The ``zero-shot`` command: labels of images scored by a DP-Cap repo."""
    p = add_command(
        sub,
        "zero-shot",
        _zero_shot,
        "classify images among label texts by caption likelihood (DP-Cap repos)",
    )
    _caption_source_args(p)
    p.add_argument("--labels", required=True, help="comma-separated label texts, e.g. dog,cat,car")
    p.add_argument("--prompt", help="text before each label (default: 'this is a photo of a')")
    p.add_argument("--top-k", type=int, default=3, help="labels listed per image")


def _zero_shot(args: argparse.Namespace) -> None:
    from ..models.text_decoder import DEFAULT_PROMPT

    labels = [label.strip() for label in args.labels.split(",")]
    empty = [i for i, label in enumerate(labels) if not label]
    if empty:
        raise ConfigError(f"--labels: labels[{empty[0]}] is empty")
    model, images = _load_for_captions(args)
    losses = model.zero_shot(images, labels, DEFAULT_PROMPT if args.prompt is None else args.prompt)
    k = max(1, min(args.top_k, len(labels)))
    ranked = [[(labels[j], float(row[j])) for j in row.argsort()[:k].tolist()] for row in losses]
    results = list(zip(args.images, ranked, strict=True))
    _print_per_image(
        args,
        model,
        "results",
        [
            {
                "image": path,
                "label": r[0][0],
                "labels": [{"label": lab, "loss": loss} for lab, loss in r],
            }
            for path, r in results
        ],
        [
            f"{path}: {r[0][0]}  (" + ", ".join(f"{lab} {loss:.3f}" for lab, loss in r) + ")"
            for path, r in results
        ],
    )
