"""Fashion-MNIST at (epsilon 3, delta 1e-5), every row side by side in one run against
Tramer & Boneh's table (ICLR 2021): end-to-end CNN 86.0, ScatterNet + linear 89.7,
ScatterNet + CNN 89.0 (test top-1, %).

The study of ``training/study`` at its benchmark preset (``BENCHMARK``: the whole train split;
every difference from ``vip-hub run``'s is a field of ``StudyConfig``, named there), with more
rows than the job releases. A row is a classifier at the study's budget: features, then the
study's DP linear head (``training.study.heads``: the paper's q = 1/8, clipping 0.1, learning
rate 16; the preset's 50 epochs; centred on the first selection records' features; calibrated
by the split rule so that it composes with the encoder's DP stages to epsilon). Its guarantee is
with respect to the private train split (``public-benchmarks/fashion-mnist-train``) and composes
every DP stage the classifier depends on (``training.study.budget.composed``; RDP is the claim,
PRV and PLD printed beside it). The standard test split is public: its first ``select_size``
records choose feature modes, the ``test_size`` after them score every row.

- raw pixels (``training.study.features.pixels``);
- ScatterNet: kymatio's ``Scattering2D(J=2)`` (81 x 7 x 7), GroupNorm over 27 groups of
  channels per example (no statistics across examples), as in the paper;
- (Syn)-ViP and (Syn)-DP-Cap: the committed priors ``vip-nano-scatter`` and
  ``dpcap-nano-scatter`` (procedural images only: no private data, so the whole budget goes to
  the head);
- ViP, DP-Cap, Logit-DP and Naive-DP: an encoder trained on the private split by its recipe on
  the study's schedule (``StudyConfig.recipe_settings``), from its (Syn) prior, at
  ``encoder_epsilon``; the head gets the rest;
- DP fine-tuning (after DP-RandP): a DP linear probe on the (Syn)-ViP encoder, then the whole
  encoder its mode reads and the probe's head trained together on the private split
  (``training.recipes.finetune``), the two DP stages composed to the whole epsilon.

Each row's DP head is drawn ``--draws`` times (the fine-tuning row ``--finetune-draws``), each
from a fresh secret, on each of ``--encoder-draws`` encoders of a DP encoder row (each trained
from a fresh secret): the table gives their mean and range, and every DP-trained row is compared
with its own prior's row and with ScatterNet's, paired on the scoring records
(``training.study.table.paired``: the difference, its standard error from the records and from
the draws, counted as encoders where a row drew several: each encoder's mean over its heads).
An encoder row reads the feature mode chosen for its (Syn) prior (``training.study.selection``, as
the job: on the selection records, for the noisiest head among the rows run that read it). Every DP
head, the selection heads' too, reads the top ``--head-components`` principal components of its
row's features of the centring records (public; ``StudyConfig.head_components``, 0: the features
themselves); the non-private reference reads the features.

Settings are the study's (``BENCHMARK``, command-line options override some). ``--tune ROWS``
picks those rows' head learning rate from ``HEAD_LR_GRID`` as the feature mode is chosen: by DP
heads at the row's noise on the public selection records (``tune_lr``; no private record, and
never the scoring records); the table says which rows were tuned and how many configurations
were tried. Each row's non-private reference (the same features, a head without DP) is printed
here only. Features, choices and trained encoders are cached under ``--work``.

    python benchmarks/utility.py [--train-size 60000] [--select-size 5000] [--test-size 5000] \
        [--epochs 50] [--rows pixels,scatter,syn,syn-dpcap,vip,dpcap,logit-dp,naive-dp,finetune] \
        [--tune ROWS] [--encoder-epsilon 1] [--draws 3] [--encoder-draws 1] [--finetune-draws 1] \
        [--device cpu|cuda] [--head-components K] [--head-kind chosen|sgd|class-means] \
        [--ema-decay D] [--decoder-warmup N] [--dpcap-decoder-warmup N] [--data FOLDER] \
        [--work var/utility]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import numpy as np
import torch
from pydantic import ValidationError
from tqdm.auto import tqdm

from training.data.labelled import LabelledArrays
from training.dp.run import retrained_if_flagged
from training.recipes.probe import accuracy, choose_pooling, fit_probe, right_answers
from training.recipes.trainable import encoder_parameters_note
from training.skeleton.config import EncoderParameters, field_help
from training.skeleton.memory import reuse_freed_memory
from training.study.budget import composed
from training.study.config import BENCHMARK, StudyConfig, stamp
from training.study.features import CHUNK, Inputs, embed, pixels
from training.study.heads import HeadKind, dp_head, head_config, released_epsilon
from training.study.selection import Choice, choose_features, choose_modes, sgd_scores
from training.study.splits import Splits, study_splits
from training.study.table import Paired, paired
from vip_hub.loading import load_encoder
from vip_hub.privacy.accounting import Accountant
from vip_hub.privacy.ledger import DPStage, PrivacyLedger, compose_releases
from vip_hub.repo_format import LEDGER_FILE

PAPER = {"end-to-end CNN": 86.0, "ScatterNet + linear": 89.7, "ScatterNet + CNN": 89.0}
"""Tramer & Boneh 2021, Fashion-MNIST at (3, 1e-5), test top-1 in %."""
HEAD_LR_GRID = (4.0, 16.0, 64.0)
"""Head learning rates ``--tune`` tries (clipping and batch stay the study's)."""
HEAD = "utility"
"""The benchmark's heads' name in their ledger stages (never released)."""


@dataclass
class Bench:
    """One benchmark run: the study's settings and records, where it caches, and how it
    trains; the feature mode of each (Syn) prior, once chosen (``run_benchmark``)."""

    study: StudyConfig
    splits: Splits
    work: Path
    device: str = "cpu"
    tune: frozenset[str] = frozenset()
    workers: int = 0
    draws: int = 3
    finetune_draws: int = 1
    finetune_parameters: EncoderParameters = field(
        default_factory=lambda: FINETUNE["encoder_parameters"]
    )
    finetune_steps: int = field(default_factory=lambda: FINETUNE["steps"])
    finetune_fixed_head: bool = field(default_factory=lambda: FINETUNE["fixed_head"])
    encoder_draws: int = 1
    modes: dict[str, Choice] = field(default_factory=dict)
    inputs: Inputs = field(default_factory=Inputs)
    """The splits preprocessed once per data configuration, for every encoder row."""

    @property
    def private(self) -> LabelledArrays:
        return self.splits.private


@dataclass
class Features:
    """One row's features of the private, scoring, centring and selection records (N, D), the
    DP stages (on the private split) that made the encoder, and how the feature mode was
    chosen."""

    train: torch.Tensor
    test: torch.Tensor
    centre: torch.Tensor
    selection: torch.Tensor
    what: str
    mode: str
    stages: list[DPStage] = field(default_factory=list)
    chosen: str = "fixed"
    head: HeadKind = "sgd"


@dataclass(frozen=True)
class Timing:
    """Where a row's wall time went: making its features (0 s when ``cached``), then fitting
    its DP head (or fine-tuning); and the 1-minute load average as the fit began."""

    make_s: float
    cached: bool
    fit_s: float
    load: float


@dataclass
class Result:
    """One row of the table: the DP classifier's top-1 on the scoring records and every DP stage
    it rests on."""

    row: str
    what: str
    correct: np.ndarray  # (draws, scoring records): each draw's right answers, fresh secrets
    ref: float | None
    stages: list[DPStage]  # one classifier's (the first draw's)
    drawn: list[DPStage]  # every draw's, the encoder's once: what the row's figures rest on
    tried: int  # head configurations tried on the public selection records (0: fixed in code)
    lr: float
    timing: Timing
    chosen: str = "fixed"
    encoders: int = 1  # encoder draws, each read by len(correct) // encoders heads in turn

    @property
    def draws(self) -> list[float]:
        """Each draw's top-1 (%)."""
        return [100 * float(c.mean()) for c in self.correct]

    @property
    def dp(self) -> float:
        """The mean top-1 (%) over the draws."""
        return float(np.mean(self.draws))

    def spread(self) -> str:
        """The draws' range and count (encoders x heads where it drew encoders), or one draw."""
        d = self.draws
        if self.encoders > 1:
            heads = len(d) // self.encoders
            return f"{min(d):.1f}-{max(d):.1f}, {self.encoders} encoders x {heads} heads"
        return f"{min(d):.1f}-{max(d):.1f}, {len(d)} draws" if len(d) > 1 else "1 draw"

    def encoder_means(self) -> np.ndarray:
        """The units a paired comparison's draw term counts: each head draw's right answers,
        (draws, records); with encoder draws, each encoder's mean over its heads, (encoders,
        records)."""
        if self.encoders == 1:
            return self.correct
        return self.correct.reshape(self.encoders, -1, self.correct.shape[1]).mean(1)


def fixed_head(b: Bench, mode: str, selection: torch.Tensor) -> tuple[HeadKind, str]:
    """A fixed-features row's head kind and how it was chosen: the study's, or under
    ``chosen`` the one that scores higher on the selection records' features ``selection``, as
    for a (Syn) prior's rows (``choose_features``)."""
    if b.study.head_kind != "chosen":
        return b.study.head_kind, "fixed"
    choice = choose_features(b.study, {mode: selection}, b.splits.selection, b.private)
    print(f"  {mode}: {choice.shown()}", flush=True)
    return choice.head, "; ".join(filter(None, ("fixed", choice.head_note())))


def pixel_features(b: Bench) -> Features:
    """Raw pixels."""
    s = b.splits
    selection = pixels(s.selection)
    head, chosen = fixed_head(b, "pixels", selection)
    return Features(
        pixels(s.private), pixels(s.test), pixels(s.centre), selection, "784 pixels in [-1, 1]",
        "pixels", chosen=chosen, head=head,
    )  # fmt: skip


def scatter_features(b: Bench) -> Features:
    """ScatterNet (J = 2, L = 8) on 28 x 28, then GroupNorm over groups of channels, per example
    (the (Syn) distillation's teacher, ``training.recipes.scatter.Scattering``)."""
    from training.recipes.scatter import SCATTER_GROUPS, SCATTER_J, Scattering

    scattering = Scattering(28).to(b.device)

    def run(data: LabelledArrays, desc: str) -> torch.Tensor:
        out = []
        for start in tqdm(range(0, len(data), CHUNK), desc=desc, unit="chunk", leave=False):
            x = torch.from_numpy(data.images[start : start + CHUNK].astype(np.float32) / 255)
            out.append(scattering(x.to(b.device)).flatten(1).cpu())  # (n, 81 x 7 x 7)
        return torch.cat(out)

    s = b.splits
    selection = run(s.selection, "scattering selection")
    head, chosen = fixed_head(b, "scatter", selection)
    return Features(
        run(s.private, "scattering train"),
        run(s.test, "scattering test"),
        run(s.centre, "scattering centre"),
        selection,
        f"ScatterNet J={SCATTER_J} (81x7x7), GroupNorm({SCATTER_GROUPS}) per example",
        "scatter",
        chosen=chosen,
        head=head,
    )


def syn_repo(b: Bench, family: str) -> Path:
    """The study's (Syn) encoder of ``family`` (``vip`` or ``dpcap``): a committed prior
    (procedural images only, ``training.priors``) or a repo folder."""
    from training.priors import PRIORS, prior_path

    prior = b.study.prior(family)
    return prior_path(prior) if prior in PRIORS else Path(prior)


def draw_path(path: Path, draw: int) -> Path:
    """Encoder draw ``draw``'s copy of ``path``, ``-drawK`` before its suffix (draw 0's is
    ``path``)."""
    return path.with_name(f"{path.stem}-draw{draw}{path.suffix}") if draw else path


def private_repo(
    b: Bench, name: str, train: Callable[..., Path], config: Any, draw: int, **fields: Any
) -> Path:
    """Encoder draw ``draw`` trained on the private split by a DP recipe (``train(config(...))``)
    at the study's encoder epsilon, trained once into the work folder (a secret seed of its own,
    kept in its run folder, draws its noise and sampling)."""
    settings = {
        "epsilon": b.study.encoder_epsilon,
        "delta": b.study.delta,
        "dataset_name": b.private.dataset.name,
        "dataset_size": len(b.private),
        **fields,
    }
    repo = b.work / "encoders" / f"{name}-{len(b.private)}-{stamp(settings)[:10]}"
    repo = draw_path(repo, draw)
    if not (repo / LEDGER_FILE).exists():
        cfg = config(
            out=str(repo),
            model_name=name,
            device=b.device,
            workers=b.workers,
            seed=None,
            **settings,
        )
        retrained_if_flagged(train, cfg)
    return repo


def private_images(b: Bench, captions: bool = False) -> Path:
    """The private split as the image folder the recipes read (with captions by the public
    template over the class names for DP-Cap), written once."""
    from training.data.labelled import write_caption_folder, write_image_folder

    kind = "captions" if captions else "images"
    root = b.work / "data" / f"train-{len(b.private)}-{kind}"
    if not root.exists():
        write = write_caption_folder if captions else write_image_folder
        write(b.private, root, b.private.classes)
    return root


def vip_repo(b: Bench, draw: int) -> Path:
    """ViP: the (Syn)-ViP MAE trained on the private images with DP-AdamW."""
    from training.recipes.vip import VipConfig, train_vip

    return private_repo(
        b,
        "vip-nano-vip",
        train_vip,
        VipConfig,
        draw,
        init=str(syn_repo(b, "vip")),
        data=str(private_images(b)),
        **b.study.recipe_settings()["vip"],
    )


def dpcap_repo(b: Bench, draw: int) -> Path:
    """DP-Cap: the (Syn) DP-Cap encoder trained to caption the private images (the public
    template over their class names) with DP-AdamW."""
    from training.data.labelled import write_caption_texts
    from training.recipes.dpcap import DPCapConfig, train_dpcap

    text = b.work / "data" / "text"
    text.mkdir(parents=True, exist_ok=True)
    vocab, public = write_caption_texts(text, b.private.classes)
    return private_repo(
        b,
        "dpcap-nano-dpcap",
        train_dpcap,
        DPCapConfig,
        draw,
        init=str(syn_repo(b, "dpcap")),
        data=str(private_images(b, captions=True)),
        vocab=str(vocab),
        public_captions=str(public),
        **b.study.recipe_settings()["dpcap"],
    )


def contrastive_repo(mechanism: str) -> Callable[[Bench, int], Path]:
    """Logit-DP (per-pair clipping) or Naive-DP (the whole batch clipped): the top blocks of the
    (Syn)-ViP encoder trained contrastively on the private images."""

    def make(b: Bench, draw: int) -> Path:
        from training.recipes.logit_dp import LogitDPConfig, train_logit_dp

        return private_repo(
            b,
            f"vip-nano-{mechanism}",
            train_logit_dp,
            LogitDPConfig,
            draw,
            init=str(syn_repo(b, "vip")),
            data=str(private_images(b)),
            mechanism=mechanism,
            **b.study.recipe_settings()["contrastive"],
        )

    return make


@dataclass(frozen=True)
class EncoderRow:
    """A row whose features are an encoder's: the (Syn) family whose prior's mode it reads, and
    how its encoder is made (None: the prior itself)."""

    family: str
    make: Callable[[Bench, int], Path] | None
    what: str

    def repo(self, b: Bench, draw: int = 0) -> Path:
        """The row's encoder repo, draw ``draw`` (trained once into the work folder; the prior
        has one)."""
        return self.make(b, draw) if self.make is not None else syn_repo(b, self.family)

    def draws(self, b: Bench) -> int:
        """How many encoders the row draws: ``--encoder-draws`` for a DP encoder, else one."""
        return b.encoder_draws if self.make is not None else 1


ENCODERS = {
    "syn": EncoderRow("vip", None, "(Syn)-ViP (the committed prior)"),
    "syn-dpcap": EncoderRow("dpcap", None, "(Syn)-DP-Cap (the committed prior)"),
    "vip": EncoderRow("vip", vip_repo, "ViP vip-nano (DP-AdamW MAE)"),
    "dpcap": EncoderRow("dpcap", dpcap_repo, "DP-Cap dpcap-nano (DP-AdamW captions)"),
    "logit-dp": EncoderRow("vip", contrastive_repo("logit-dp"), "Logit-DP vip-nano"),
    "naive-dp": EncoderRow("vip", contrastive_repo("naive"), "Naive-DP vip-nano"),
}
"""The rows whose features are an encoder's, by key."""


def stages_of(repo: Path) -> list[DPStage]:
    """The DP stages of ``repo``'s ledger."""
    return PrivacyLedger.parse((repo / LEDGER_FILE).read_text()).dp_stages()


def choose(b: Bench, rows: Sequence[str]) -> None:
    """Each (Syn) prior's feature mode, read by ``rows``' encoder rows: chosen on the selection
    records for the noisiest head among those rows that read it (their encoders trained
    first), cached under the work folder by what it depends on."""
    readers: dict[Path, list[list[DPStage]]] = {}
    for key in rows:
        if key in ENCODERS:
            row = ENCODERS[key]
            readers.setdefault(syn_repo(b, row.family), []).append(stages_of(row.repo(b)))
    n, dataset = len(b.private), b.private.dataset.name
    for prior, stages in readers.items():
        noisiest = min(released_epsilon(b.study, "sgd", n, dataset, s) for s in stages)
        made = {"prior": str(prior.resolve()), "head": noisiest, "study": b.study.model_dump()}
        path = b.work / "choices" / f"{prior.name}-{stamp(made)[:10]}.json"
        if path.exists():
            choice = Choice(**json.loads(path.read_text()))
        else:
            (choice,) = choose_modes(
                b.study, {prior: stages}, b.splits.selection, b.private, b.device, b.inputs
            ).values()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(choice.__dict__))
        b.modes[prior.name] = choice


def encoder_features(key: str) -> Callable[[Bench, int], Features]:
    """Encoder row ``key``'s features, of its encoder draw ``draw``, in the mode chosen for its
    prior (``choose``)."""

    def make(b: Bench, draw: int) -> Features:
        row = ENCODERS[key]
        repo = row.repo(b, draw)
        choice = b.modes[syn_repo(b, row.family).name]
        encoder = load_encoder(repo, device=b.device)
        s = b.splits
        records = {"train": s.private, "test": s.test, "centre": s.centre, "selection": s.selection}
        x = {
            what: embed(encoder, d, choice.mode, f"{repo.name} {what}", b.inputs)
            for what, d in records.items()
        }
        return Features(
            **x, what=f"{row.what}, {choice.mode} features", mode=choice.mode,
            stages=stages_of(repo), chosen=choice.describe(), head=choice.head,
        )  # fmt: skip

    return make


CACHED = ("train", "test", "centre", "selection", "what", "mode", "chosen", "head")
"""The ``Features`` fields a features file holds beside its stages and seconds."""


def cached(path: Path, make: Callable[[], Features]) -> tuple[Features, float, bool]:
    """Features from ``path`` (a file this script wrote with every field of ``CACHED``), else
    made and saved; with the seconds making them took (then or now) and whether they came from
    the cache."""
    blob = torch.load(path, weights_only=True) if path.exists() else {}
    if set(CACHED) <= blob.keys():
        stages = [DPStage.model_validate_json(s) for s in blob["stages"]]
        f = Features(**{k: blob[k] for k in CACHED}, stages=stages)
        return f, float(blob["make_s"]), True
    start = time.perf_counter()
    f = make()
    seconds = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        **{k: getattr(f, k) for k in CACHED},
        "stages": [s.model_dump_json() for s in f.stages],
        "make_s": seconds,
    }
    torch.save(blob, path)
    return f, seconds, False


def tune_lr(b: Bench, f: Features) -> tuple[float, dict[float, float]]:
    """The head learning rate of ``HEAD_LR_GRID`` whose DP-SGD heads at the row's noise score
    best on the PUBLIC selection records (``sgd_scores``, as the feature mode is chosen), with
    each candidate's score (top-1 %); no private record is read."""
    feats, selection = {f.mode: f.selection}, b.splits.selection
    scores = {
        lr: sgd_scores(b.study, feats, selection, b.private, f.stages, lr)[f.mode]
        for lr in HEAD_LR_GRID
    }
    return max(scores, key=lambda lr: scores[lr]), scores


def feature_row(
    label: str, make: Callable[[Bench, int], Features]
) -> Callable[[Bench, str], Result]:
    """A row that is the study's DP head on fixed features (``make(b, draw)``, cached), drawn
    ``--draws`` times on each of the row's encoder draws (``EncoderRow.draws``), with the head's
    learning rate chosen on the public selection records (``tune_lr``, the first encoder's
    features) when the row is in ``--tune``, and its non-private reference (the mean over its
    encoders)."""

    def run(b: Bench, key: str) -> Result:
        n, classes = len(b.private), len(b.private.classes)
        mode = b.modes[syn_repo(b, ENCODERS[key].family).name].mode if key in ENCODERS else key
        settings = {"study": b.study.model_dump(), "mode": mode}
        encoders = ENCODERS[key].draws(b) if key in ENCODERS else 1
        y, yt = torch.as_tensor(b.private.labels), torch.as_tensor(b.splits.test.labels)
        reference = head_config(b.study, n, None, dataset=b.private.dataset.name)
        lr, tried, load = b.study.head_lr, 0, os.getloadavg()[0]
        correct, drawn, refs, first = [], [], [], None
        make_s, hits, head_s = 0.0, 0, 0.0
        for draw in range(encoders):
            path = b.work / "features" / f"{key}-{n}-{stamp(settings)[:10]}.pt"
            path = draw_path(path, draw)
            f, seconds, hit = cached(path, functools.partial(make, b, draw))
            make_s, hits = make_s + seconds, hits + hit
            start = time.perf_counter()
            if key in b.tune and first is None and f.head == "class-means":
                print(f"  {label}: a class-means head has no learning rate to tune", flush=True)
            elif key in b.tune and first is None:
                lr, scores = tune_lr(b, f)
                tried = len(scores)
                shown = ", ".join(f"lr {k:g}: {v:.1f} %" for k, v in scores.items())
                print(
                    f"  {label}: top-1 on the public selection records {shown}; chosen lr {lr:g}",
                    flush=True,
                )
            fits = [
                dp_head(
                    b.study,
                    f.train,
                    y,
                    f.centre,
                    b.private.dataset,
                    classes,
                    f.stages,
                    name=HEAD,
                    pooling=f.mode,
                    lr=lr,
                    kind=f.head,
                )  # fmt: skip
                for _ in range(b.draws)
            ]
            head_s += (time.perf_counter() - start) / (b.draws * encoders)
            ref, _ = fit_probe(f.train, y, classes, reference, desc="reference")
            refs.append(100 * accuracy(ref, f.test, yt))
            correct += [right_answers(fit.head, f.test, yt) for fit in fits]
            drawn += [*f.stages, *(fit.stage for fit in fits)]
            if first is None:
                first = (f, fits[0].stage)
        assert first is not None  # at least one encoder
        f, stage = first
        return Result(
            row=label,
            what=f.what,
            correct=np.stack(correct),
            ref=float(np.mean(refs)),
            stages=[*f.stages, stage],
            drawn=drawn,
            tried=tried,
            lr=lr,
            timing=Timing(make_s, hits == encoders, head_s, load),
            chosen=f.chosen,
            encoders=encoders,
        )

    return run


ROWS: dict[str, tuple[str, Callable[[Bench, str], Result]]] = {
    key: (label, feature_row(label, make))
    for key, label, make in (
        ("pixels", "raw pixels + DP linear", lambda b, _: pixel_features(b)),
        ("scatter", "ScatterNet + DP linear (GroupNorm)", lambda b, _: scatter_features(b)),
        ("syn", "(Syn)-ViP + DP linear", encoder_features("syn")),
        ("syn-dpcap", "(Syn)-DP-Cap + DP linear", encoder_features("syn-dpcap")),
        ("vip", "ViP (DP encoder) + DP linear", encoder_features("vip")),
        ("dpcap", "DP-Cap (DP encoder) + DP linear", encoder_features("dpcap")),
        ("logit-dp", "Logit-DP (DP encoder) + DP linear", encoder_features("logit-dp")),
        ("naive-dp", "Naive-DP (DP encoder) + DP linear", encoder_features("naive-dp")),
    )
}
"""Every row, in table order: a label and a function of the run and the row's key returning its
``Result``. A row that trains its own classifier end to end adds itself here with one function."""


FINETUNE: dict[str, Any] = {
    "trainable_blocks": "all",
    "augmult": 0,
    "probe_epsilon": 2.0,
    "encoder_parameters": "biases",
    "fixed_head": False,
    "steps": 10,
    "warmup_steps": 2,
    "micro_batch_size": 64,
}
"""The DP fine-tuning row (``training.recipes.finetune``), fixed in code, after DP-RandP and De et
al. 2022: a DP linear probe at ``probe_epsilon`` (the study's head) on the (Syn)-ViP encoder's
feature mode that such a probe scores best on the selection records (``finetune_mode``), then of
the whole encoder that mode reads its biases and normalisation scales (``encoder_parameters``,
after Bu et al. 2022's DP-BiTFiT) and the probe's head
fine-tuned together by DP-AdamW (expected batch n / ``head_batches``, ``steps`` steps, each image
itself: ``augmult`` 0) at ``FINETUNE_LR``'s rate for what it trains, its noise calibrated so that
probe and fine-tuning compose to the study's epsilon, the head trained with the encoder
(``fixed_head`` False; ``--finetune-fixed-head`` keeps the probe's). The probe's epsilon, what
the fine-tuning trains, its rate and whether the head trains are chosen on public data: on the
public stand-in (``benchmarks/standin.py finetune``, test records 0-3,999 at the real run's
noise, scored on 4,000-4,999), the highest mean of a setting's trials (the benchmarks' README,
"Settings chosen on public data", "The DP fine-tuning row's biases alone", "Where the DP
fine-tuning's step goes"); ``steps`` and ``augmult`` were cut to fit the benchmark's time bound,
not by any score (``--finetune-steps`` runs a longer schedule); ``--finetune-parameters all`` runs
the whole encoder."""

FINETUNE_LR: dict[EncoderParameters, float] = {"all": 1e-5, "biases": 1e-3}
"""The DP fine-tuning row's learning rate by what of the encoder it trains, each chosen on the
public stand-in (``standin.py finetune [--encoder-parameters all|biases] --lr L``), the highest
mean of a setting's trials (the benchmarks' README, "The DP fine-tuning row's probe epsilon and
learning rate" and "The DP fine-tuning row's biases alone")."""


def released_correct(repo: Path, head: str, data: LabelledArrays, device: str) -> np.ndarray:
    """Whether a released repo's head answers each record of ``data`` right, (n,) booleans: the
    encoder's features in the head's mode, then the head (what ``/v1/classify`` computes); the
    head's labels are class folder names (``write_image_folder``), mapped back to ``data``'s."""
    from training.data.labelled import head_class_order
    from vip_hub.repo.heads import load_head

    encoder = load_encoder(repo, device=device)
    probe, info = load_head(repo, head)
    order = torch.tensor(head_class_order(data.classes, info.labels))
    with torch.no_grad():
        guess = order[probe(embed(encoder, data, info.pooling)).argmax(1)]
    return (guess == torch.as_tensor(data.labels)).numpy()


def finetune_mode(b: Bench, init: Path) -> tuple[str, str]:
    """The feature mode the DP fine-tuning row reads: the one whose DP probe (the study's head at
    ``probe_epsilon``) scores best on the selection records (``choose_pooling``), and how it was
    chosen."""
    encoder = load_encoder(init, device=b.device)
    n, sel = len(b.private), b.splits.selection
    cfg = head_config(b.study, n, FINETUNE["probe_epsilon"], dataset=b.private.dataset.name)
    images = [sel.pil(i) for i in range(len(sel))]
    mode, scores = choose_pooling(encoder, images, sel.labels, len(sel.classes), cfg, n)
    shown = ", ".join(f"{m} {v:.1f}" for m, v in sorted(scores.items(), key=lambda kv: -kv[1]))
    print(f"  DP fine-tuning: DP probe top-1 of each mode on public records: {shown}", flush=True)
    return mode, f"{mode}: best DP probe of {len(scores)} modes on test records 0-{len(sel) - 1}"


def finetune_row(b: Bench, key: str) -> Result:
    """DP fine-tuning: a DP probe, then the (Syn)-ViP encoder its mode reads (its biases alone, by
    default: ``--finetune-parameters``) and the head trained together on the private split, or
    the encoder under the probe's head kept fixed (``--finetune-fixed-head``;
    ``training.recipes.finetune.finetune_arrays``), the two DP stages composed to the study's
    epsilon; top-1 of the released classifier."""
    from training.recipes.finetune import finetune_arrays

    if key in b.tune:
        raise ValueError(
            f"--tune {key}: the DP fine-tuning row's settings are fixed in FINETUNE and FINETUNE_LR"
        )
    trains = b.finetune_parameters
    settings = {
        **FINETUNE,
        "encoder_parameters": trains,
        "lr": FINETUNE_LR[trains],
        "fixed_head": b.finetune_fixed_head,
    }
    settings.pop("steps")
    steps = b.finetune_steps
    batch = head_config(b.study, len(b.private), None, dataset=b.private.dataset.name).batch_size
    load = os.getloadavg()[0]
    init = syn_repo(b, "vip")
    start = time.perf_counter()
    mode, chosen = finetune_mode(b, init)
    choose_s = time.perf_counter() - start
    digest = stamp({**settings, "steps": steps, "m": mode, "study": b.study.model_dump()})[:10]
    work = b.work / "finetune" / f"{len(b.private)}-{len(b.splits.test)}-{digest}"
    correct, drawn, seconds = [], [], 0.0
    for _ in range(b.finetune_draws):  # each draw starts over from a fresh secret
        run = finetune_arrays(
            init,
            b.private,
            b.splits.test,
            work,
            epsilon=b.study.epsilon,
            delta=b.study.delta,
            batch_size=batch,
            steps=steps,
            public=b.splits.centre,
            device=b.device,
            workers=b.workers,
            pooling=mode,
            probe_epochs=b.study.probe_epochs,
            probe_batch_size=batch,
            probe_lr=b.study.head_lr,
            probe_max_grad_norm=b.study.head_clip,
            **settings,
        )
        correct.append(released_correct(run.repo, "classifier", b.splits.test, b.device))
        drawn += run.stages
        seconds += run.seconds / b.finetune_draws
    return Result(
        row=ROWS[key][0],
        what=f"(Syn)-ViP vip-nano: DP probe (epsilon {settings['probe_epsilon']:g} alone), then "
        f"the whole encoder its {mode} features read"
        + (" under the probe's head, fixed" if b.finetune_fixed_head else " and the head")
        + encoder_parameters_note(trains)
        + f", DP-AdamW {steps} x {batch}, "
        + (f"{views} views per example" if (views := settings["augmult"]) else "unaugmented"),
        correct=np.stack(correct),
        ref=100 * finetune_reference(b.study, init, work, run.stage, batch, b.device),
        stages=run.stages,
        drawn=drawn,
        tried=0,
        lr=settings["lr"],
        timing=Timing(choose_s, False, seconds, load),
        chosen=chosen,
    )


def finetune_reference(
    study: StudyConfig, init: Path, work: Path, stage: DPStage, batch: int, device: str = "cpu"
) -> float:
    """The DP fine-tuning row's non-private reference (printed, never released): the same
    model from the same init (after a non-private probe where the row has a DP one: SGD at 0.1,
    the probe's epochs), trained on the train folder ``finetune_arrays`` wrote under ``work``
    with plain AdamW (the mean loss, no clipping, no noise; the same views) at the DP stage's
    recorded settings, steps and expected batch (summed over micro-batches, as the DP row is);
    its top-1 on the public test folder."""
    from training.recipes.finetune import augment_views, classifier, evaluate, frozen_outputs
    from training.recipes.probe import load_labelled
    from training.skeleton.optim import make_adamw, warmup_cosine
    from vip_hub.device import pick_device

    hp, dev = stage.hyperparameters, pick_device(device)
    train = load_labelled(work / "train", "reference/train")
    test = load_labelled(work / "test", "public/test")
    encoder = load_encoder(init)
    labels = torch.as_tensor(train.labels)
    torch.manual_seed(0)
    head = None
    if hp.get("probe_epsilon"):
        x = encoder.embed(train.images, hp["pooling"])
        cfg = head_config(study, len(labels), None, dataset=train.dataset.name)
        head, _ = fit_probe(x, labels, len(train.classes), cfg, desc="reference probe")
    model = classifier(
        encoder,
        len(train.classes),
        hp["pooling"],
        hp["trainable_blocks"],
        head,
        parameters=hp["encoder_parameters"],
        train_head=not hp["fixed_head"],
    )
    model.to(dev)
    order = torch.Generator().manual_seed(0)
    if hp["trainable_blocks"] == "all":
        pixels = torch.stack([encoder.transform(i.convert("RGB")) for i in train.images])

        def inputs(i: torch.Tensor) -> tuple[torch.Tensor, ...]:
            views = [augment_views(pixels[j], hp["augmult"], order) for j in i.tolist()]
            return torch.stack(views), labels[i]

    else:
        tokens, means = frozen_outputs(model, encoder.transform, train.images, dev)  # type: ignore[arg-type]

        def inputs(i: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tokens[i], means[i], labels[i]

    optimizer = make_adamw(model, hp["lr"], hp["weight_decay"], tuple(hp["betas"]))
    schedule = warmup_cosine(optimizer, hp["warmup_steps"], stage.steps)
    for _ in tqdm(range(stage.steps), desc="reference", leave=False):
        i = torch.randint(len(labels), (batch,), generator=order)
        optimizer.zero_grad()
        for part in i.split(FINETUNE["micro_batch_size"]):  # the batch's mean loss, in parts
            (model(*(t.to(dev) for t in inputs(part))).sum() / batch).backward()
        optimizer.step()
        schedule.step()
    return evaluate(model, encoder.transform, test.images, test.labels.tolist(), dev)[1]


ROWS["finetune"] = ("DP fine-tuning: DP probe, then the (Syn)-ViP encoder", finetune_row)


PRIOR_ROWS = {
    "vip": "syn",
    "logit-dp": "syn",
    "naive-dp": "syn",
    "finetune": "syn",
    "dpcap": "syn-dpcap",
}
"""Each DP-trained row's own prior's row: the encoder its DP stages started from, read by the
same DP head (issue 56: a private stage is worth its budget when its row beats this one)."""


def comparisons(rows: Sequence[str], results: Sequence[Result]) -> list[tuple[str, str, Paired]]:
    """Each DP-trained row of ``rows`` against its own prior's row and against ScatterNet's,
    where those ran: (row, the row compared with, the paired comparison on the scoring
    records)."""
    by_key = dict(zip(rows, results, strict=True))
    out = []
    for key, r in by_key.items():
        for other in (PRIOR_ROWS.get(key), "scatter"):
            if other in by_key and other != key:
                theirs = by_key[other].encoder_means()
                out.append((r.row, by_key[other].row, paired(r.encoder_means(), theirs)))
    return out


def run_benchmark(b: Bench, rows: Sequence[str]) -> list[tuple[Result, dict[Accountant, float]]]:
    """Every row of ``rows`` in turn (the (Syn) priors' modes chosen first), each with its
    composed epsilon under the three accountants."""
    choose(b, rows)
    out = []
    for key in rows:
        label, run = ROWS[key]
        r = run(b, key)
        try:
            eps = composed(b.study, r.stages, b.private.dataset.name)
        except RuntimeError as e:
            raise RuntimeError(f"{r.row}: {e}") from None
        out.append((r, eps))
        ref, t = (f"{r.ref:.2f} %" if r.ref is not None else "-"), r.timing
        draws = ", ".join(f"{d:.2f}" for d in r.draws)
        print(
            f"  {label}: DP {r.dp:.2f} % (draws {draws}), non-private {ref} (make "
            f"{t.make_s:.0f} s{' cached' if t.cached else ''}, DP head {t.fit_s:.0f} s a draw, "
            f"load {t.load:.1f})",
            flush=True,
        )
    return out


def table(
    study: StudyConfig, results: Sequence[tuple[Result, dict[Accountant, float]]]
) -> list[str]:
    """The Markdown table: every row beside the paper's three figures; top-1 on the scoring
    records (after the selection records that choose feature modes): the mean of the row's
    draws, their range and count."""
    scored = f"{study.select_size}-{study.select_size + study.test_size - 1}"
    lines = [
        f"| features + head | top-1 at (3, 1e-5), test records {scored} | non-private reference "
        "| feature mode | eps RDP / PRV / PLD | DP stages | tuned | make s | DP head s | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r, eps in results:
        stages = " + ".join(
            f"{s.mechanism} ({s.noise_multiplier:.2f}, {s.sample_rate:.3g}, {s.steps})"
            for s in r.stages
        )
        tuned = (
            f"yes, {r.tried} configs on public selection records (lr {r.lr:g})" if r.tried else "no"
        )
        ref, t = (f"{r.ref:.1f}" if r.ref is not None else "-"), r.timing
        lines.append(
            f"| {r.row} | **{r.dp:.1f}** ({r.spread()}) | {ref} | {r.chosen} | "
            f"{eps[Accountant.RDP]:.3f} / {eps[Accountant.PRV]:.3f} / {eps[Accountant.PLD]:.3f} | "
            f"{stages} | {tuned} | "
            f"{t.make_s:.0f}{' (cached)' if t.cached else ''} | {t.fit_s:.0f} | {t.load:.1f} |"
        )
    for name, top1 in PAPER.items():
        lines.append(
            f"| Tramer & Boneh: {name} | {top1} (all) | - | - | 3 (RDP, Poisson assumed) | - | - |"
            " - | - | - |"
        )
    return lines


STUDY_OPTIONS = (
    ("--train-size", "train_size"),
    ("--select-size", "select_size"),
    ("--test-size", "test_size"),
    ("--epochs", "probe_epochs"),
    ("--dp-batch-size", "dp_batch_size"),
    ("--encoder-epsilon", "encoder_epsilon"),
    ("--head-components", "head_components"),
    ("--head-kind", "head_kind"),
    ("--ema-decay", "dp_ema_decay"),
    ("--lr-scale", "dp_lr_scale"),
    ("--encoder-parameters", "dp_encoder_parameters"),
    ("--decoder-warmup", "vip_decoder_warmup"),
    ("--dpcap-decoder-warmup", "dpcap_decoder_warmup"),
)
"""The options that set a ``StudyConfig`` field (its default the benchmark's, its help the
field's description)."""


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the options, run the rows, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data", help="the four IDX files' folder or an image folder (default: the Debian package)"
    )
    p.add_argument("--work", default="var/utility", help="cache of features and encoders")
    for flag, field_name in STUDY_OPTIONS:
        default = getattr(BENCHMARK, field_name)
        annotation = StudyConfig.model_fields[field_name].annotation
        p.add_argument(
            flag,
            type=type(default),
            choices=get_args(annotation) if get_origin(annotation) is Literal else None,
            default=default,
            help=field_help(StudyConfig, field_name),
        )
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    p.add_argument(
        "--tune", default="", help="rows whose head lr is chosen on the public selection records"
    )
    p.add_argument("--device", default="cpu", help="encoders' device: cpu or cuda (heads on CPU)")
    p.add_argument(
        "--encoder-steps",
        type=int,
        default=None,
        help="steps of every DP encoder recipe (default: the study's, ViP "
        f"{BENCHMARK.dp_steps}, DP-Cap {BENCHMARK.dpcap_steps}, Logit-DP and Naive-DP "
        f"{BENCHMARK.contrastive_steps})",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--draws", type=int, default=3, help="DP heads per row, each from a fresh secret"
    )
    p.add_argument(
        "--encoder-draws",
        type=int,
        default=1,
        help="encoders of each DP encoder row, each trained from a fresh secret and read by "
        "--draws heads (the paired comparison's draw term then counts encoders)",
    )
    p.add_argument(
        "--finetune-draws",
        type=int,
        default=1,
        help="DP fine-tunings of the finetune row, each from a fresh secret (about 10 min each)",
    )
    p.add_argument(
        "--finetune-parameters",
        choices=get_args(EncoderParameters),
        default=FINETUNE["encoder_parameters"],
        help="what of the encoder the finetune row trains, at FINETUNE_LR's rate for it",
    )
    p.add_argument(
        "--finetune-steps",
        type=int,
        default=FINETUNE["steps"],
        help="the finetune row's DP fine-tuning steps (a longer schedule than the default's, "
        "its noise recalibrated to the same epsilon; about 24 s a step at 60,000 records on two "
        "threads)",
    )
    p.add_argument(
        "--finetune-fixed-head",
        action="store_true",
        default=FINETUNE["fixed_head"],
        help="the finetune row keeps its DP probe's head, fine-tuning the encoder alone",
    )
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    tune = {r.strip() for r in args.tune.split(",") if r.strip()}
    unknown = sorted((set(rows) | tune) - set(ROWS))
    if unknown:
        p.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    if min(args.draws, args.finetune_draws, args.encoder_draws, args.finetune_steps) < 1:
        p.error("--draws, --encoder-draws, --finetune-draws and --finetune-steps are at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    reuse_freed_memory()
    steps = args.encoder_steps
    try:
        study = BENCHMARK.updated(
            {
                **{name: getattr(args, flag[2:].replace("-", "_")) for flag, name in STUDY_OPTIONS},
                **(
                    {"dp_steps": steps, "dpcap_steps": steps, "contrastive_steps": steps}
                    if steps
                    else {}
                ),
            }
        )
    except ValidationError as e:
        p.error(str(e))

    work = Path(args.work)
    b = Bench(
        splits=study_splits(study, args.data, work),
        work=work,
        study=study,
        device=args.device,
        tune=frozenset(tune),
        draws=args.draws,
        finetune_draws=args.finetune_draws,
        finetune_parameters=args.finetune_parameters,
        finetune_steps=args.finetune_steps,
        finetune_fixed_head=args.finetune_fixed_head,
        encoder_draws=args.encoder_draws,
    )
    start = time.perf_counter()
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {os.cpu_count()} CPUs  torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, device {args.device}  "
        f"load average {os.getloadavg()}"
    )
    print(
        f"train: {b.private.dataset.description}; test records 0-{study.select_size - 1} choose "
        f"feature modes, {study.select_size}-{study.select_size + study.test_size - 1} score; "
        f"(epsilon {study.epsilon:g}, delta {study.delta:g}) per classifier, encoders at epsilon "
        f"{study.encoder_epsilon:g}; heads: expected batch n/{study.head_batches}, clip "
        f"{study.head_clip}, lr {study.head_lr:g} unless tuned, SGD momentum 0.9, "
        f"{study.probe_epochs} epochs, warm-up + cosine"
    )
    results = run_benchmark(b, rows)
    print("\n" + "\n".join(table(study, results)))
    together = ", ".join(
        f"{r.row} {compose_releases(r.drawn, study.delta)[Accountant.RDP]:.2f}"
        for r, _ in results
        if len(r.correct) > 1
    )
    if together:
        print(
            f"\neach draw is a classifier at the budget; a row's draws together (its mean and "
            f"range rest on them all) compose to epsilon (RDP, delta {study.delta:g}): {together}"
        )
    pairs = comparisons(rows, [r for r, _ in results])
    if pairs:
        print("\npaired on the scoring records (A - B, mean over draws):")
        for a, other, p_ in pairs:
            print(f"  {a} - {other}: {p_.describe()}")
    print(
        f"\nwall time {time.perf_counter() - start:.0f} s, load average at the end "
        f"{os.getloadavg()}"
    )


if __name__ == "__main__":
    main()
