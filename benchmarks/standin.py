"""The study's DP settings tried on a public stand-in (issue 54): the main job's DP stages, or the
benchmark's DP fine-tuning, run on public test records with the real run's noise, so that a
setting a release depends on is chosen without any private record.

Only the public test split is read (``fashion_mnist("test")``; the tool never asks for the train
split, and ``tests/benchmarks/test_standin.py`` runs it with no train split on disk). Its first
``--private`` records (0-3,999) stand in for the private records, the next ones up to ``--end``
(4,000-4,999) score, and the first ``centre_size`` (0-999) centre every DP head, as the study's
first selection records do: all inside test records 0-4,999, which serve for selection in both
presets; the scoring records of either preset (5,000-9,999 and 8,000-9,999) are never read.

The real run's noise, reproduced:

- a DP encoder stage (ViP, DP-Cap, Logit-DP, Naive-DP) keeps the real run's expected batch B,
  steps T (the study's, or ``--dp-batch-size`` and ``--encoder-steps``) and noise multiplier
  sigma, calibrated at the real n (q = B / n) to ``--encoder-epsilon``: the same noise on the
  same averaged gradient, as many steps; on the stand-in q = B / P;
- a DP head (and the fine-tuning row's probe and fine-tuning) keeps the real q and T and scales
  sigma by the ratio of the expected batches (``choose_pooling``'s rule), so the noise on its
  averaged gradient is the real head's, whose epsilon is what the split rule leaves after the
  encoder's stage at the real n.

The epsilons of the stand-in's stages mean nothing (its records are public); the figures printed
are top-1 on the stand-in's scoring records, for choosing. The feature mode is fixed
(``--mode``, default ``spatial-b4-g4``: what the study's public selection chose for both
priors); the non-private reference is printed beside (public records).

    python benchmarks/standin.py {syn,syn-dpcap,vip,dpcap,logit-dp,naive-dp} [--encoder-epsilon 0.5]
        [--lr-scale 0.25] [--ema-decay D] [--decoder-warmup N] [--encoder-parameters all|biases]
        [--heads 3] [--head-epochs E] [--head-batches K] [--head-draws D] [--uncentred]
        [--head-components K]
        [--head-kind sgd|class-means] [--study job|benchmark] [--dp-batch-size B]
        [--encoder-steps T] [--private P] [--end END] [--no-noise]
    python benchmarks/standin.py finetune [--probe-epsilon 2] [--lr L] [--finetune-steps 10]
        [--augmult 0] [--encoder-parameters all|biases] [--probe-only] [--head-epochs E]
        [--head-batches K]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError
from utility import FINETUNE, FINETUNE_LR

from training.data.labelled import (
    FASHION_MNIST_TEST,
    LabelledArrays,
    fashion_mnist,
    write_caption_folder,
    write_caption_texts,
    write_image_folder,
)
from training.dp.run import trial_weights
from training.priors import prior_path
from training.recipes.class_means import fit_class_means
from training.recipes.probe import (
    accuracy,
    centred_statistics,
    component_count,
    fit_probe,
    public_components,
)
from training.study.budget import head_epsilon
from training.study.config import BENCHMARK, JOB, StudyConfig
from training.study.features import embed
from training.study.heads import (
    head_config,
    head_kind,
    head_sampling,
    mean_head,
    released_sampling,
)
from vip_hub.loading import load_encoder
from vip_hub.privacy.accounting import (
    calibrate,
    composed_epsilon,
    epsilon,
    remaining_epsilon,
)

PRIVATE, END = 4_000, 5_000
"""Test records 0..PRIVATE-1 stand in for the private records, PRIVATE..END-1 score."""
PRIORS = {"syn": "vip", "syn-dpcap": "dpcap"}
"""The prior rows: each family's committed prior, no DP stage."""
STAGES = {"vip": "vip", "dpcap": "dpcap", "logit-dp": "contrastive", "naive-dp": "contrastive"}
"""The DP stage rows: each one's schedule in ``StudyConfig.recipe_settings`` (Logit-DP and
Naive-DP start from the (Syn)-ViP prior, as in the job)."""
MODE = "spatial-b4-g4"
NO_NOISE = 1e-5
"""``--no-noise``: a stage row's noise multiplier (the engine takes sigma > 0): the objective's
ceiling at its schedule, the weights kept and nothing exported, as no ledger may state it. Small
enough for Naive-DP, whose noise is sigma x 2C in each of its ~10^6 coordinates against a
clipped whole-batch gradient of at most C (at 1e-3 the noise's norm was still twice C)."""
GaussianRun = tuple[float, float, int]


@dataclass(frozen=True)
class StandIn:
    """The stand-in's records, all from the public test split."""

    private: LabelledArrays
    score: LabelledArrays
    centre: LabelledArrays


def standin_records(
    study: StudyConfig,
    data: str | None,
    work: str | os.PathLike[str],
    private: int = PRIVATE,
    end: int = END,
    disjoint_centre: bool = False,
) -> StandIn:
    """Test records 0..``private``-1 (the stand-in's private records), ``private``..``end``-1
    (scoring) and the first ``study.centre_size`` (centring): the public test split only. With
    ``disjoint_centre`` the centring records are the last ``centre_size`` of the first
    ``private`` instead, and the private records the ones before them, as in the real run, whose
    centring records are not private (a head that reads more of them than their mean, the
    class-means head's covariance, fits them better when they are its private records too)."""
    if not 0 < private < end or study.centre_size > end:
        raise ValueError(f"records 0-{private - 1} and {private}-{end - 1}: give 0 < P < END")
    if disjoint_centre and study.centre_size >= private:
        raise ValueError(f"a disjoint centre of {study.centre_size} leaves no private record")
    test = fashion_mnist("test", data, work)
    if end > len(test):
        raise ValueError(f"--end {end} > the {len(test)} test records")
    cut = private - study.centre_size if disjoint_centre else private
    return StandIn(
        private=test.first(cut),
        score=test.subset(np.arange(private, end), f"test records {private}-{end - 1}"),
        centre=test.subset(np.arange(cut, private), f"test records {cut}-{private - 1}")
        if disjoint_centre
        else test.first(study.centre_size),
    )


@dataclass
class Trial:
    """One trial's settings, the real run's and the stand-in's (sigma, q, T), and its figures."""

    row: str
    settings: dict[str, Any]
    real: dict[str, GaussianRun] = field(default_factory=dict)
    standin: dict[str, GaussianRun] = field(default_factory=dict)
    dp_top1: list[float] = field(default_factory=list)
    reference_top1: float | None = None
    cpu_s: float = 0.0

    @property
    def mean(self) -> float:
        return sum(self.dp_top1) / len(self.dp_top1)


def encoder_stage(study: StudyConfig, row: str) -> GaussianRun:
    """The job's DP encoder stage of ``row`` (one of ``STAGES``) at the real n: (sigma, q, T)
    at ``study.encoder_epsilon``."""
    s = study.recipe_settings()[STAGES[row]]
    q = s["batch_size"] / study.train_size
    return calibrate(study.encoder_epsilon, study.delta, q, s["steps"]), q, s["steps"]


def train_encoder(
    study: StudyConfig,
    row: str,
    sigma: float,
    records: LabelledArrays,
    out: Path,
) -> Path:
    """``row``'s recipe (one of ``STAGES``), on the study's schedule, trained from its committed
    prior on ``records`` at noise multiplier ``sigma`` (a secret seed, as every DP run)."""
    from training.recipes.dpcap import DPCapConfig, train_dpcap
    from training.recipes.logit_dp import ContrastiveMechanism, LogitDPConfig, train_logit_dp
    from training.recipes.vip import VipConfig, train_vip

    s = study.recipe_settings()[STAGES[row]]
    common = {
        "out": str(out),
        "model_name": out.name,
        "init": str(prior_path(study.prior(row))),
        "epsilon": None,
        "sigma": sigma,
        "delta": study.delta,
        "dataset_name": records.dataset.name,
        "dataset_size": len(records),
        "device": "cpu",
        "workers": 0,
        "seed": None,
        "restart": True,
        **s,
    }
    root = out.parent / "data"
    if row != "dpcap":
        images = root / f"images-{len(records)}"
        if not images.exists():
            write_image_folder(records, images, records.classes)
        if row == "vip":
            return train_vip(VipConfig(data=str(images), **common))
        naive = row == "naive-dp"
        mechanism = ContrastiveMechanism.NAIVE if naive else ContrastiveMechanism.LOGIT_DP
        return train_logit_dp(LogitDPConfig(data=str(images), mechanism=mechanism, **common))
    captions = root / f"captions-{len(records)}"
    if not captions.exists():
        write_caption_folder(records, captions, records.classes)
    vocab, public = write_caption_texts(root, records.classes)
    return train_dpcap(
        DPCapConfig(data=str(captions), vocab=str(vocab), public_captions=str(public), **common)
    )


def batch_ratio(study: StudyConfig, n: int, real_n: int) -> float:
    """A study head's expected batch on ``n`` records over its expected batch on ``real_n``."""

    def batch(m: int) -> int:
        return head_config(study, m, None, dataset=FASHION_MNIST_TEST).batch_size

    return batch(n) / batch(real_n)


def matched_head(
    study: StudyConfig, real_n: int, prior: Sequence[GaussianRun], n: int
) -> tuple[GaussianRun, GaussianRun]:
    """A study head's (sigma, q, T) at the real ``real_n`` after the stages ``prior``, and on a
    stand-in of ``n`` records: the same q and T, sigma scaled by the ratio of expected batches
    (a DP-SGD head's; a class-means head's batch is every record, so the ratio of the records):
    the same noise on its averaged gradient, or on each class mean."""
    kind = head_kind(study, None)
    q, steps = released_sampling(kind, study, real_n, FASHION_MNIST_TEST)
    sigma = calibrate(head_epsilon(study, prior, q, steps), study.delta, q, steps)
    ratio = n / real_n if kind == "class-means" else batch_ratio(study, n, real_n)
    return (sigma, q, steps), (sigma * ratio, q, steps)


def head_schedule(study: StudyConfig) -> dict[str, int]:
    """The DP heads' epochs, batches an epoch and draws, recorded in every trial: the presets'
    defaults of the first two changed on 2026-11-30, the job's draws on 2026-12-06."""
    return {
        "head_epochs": study.probe_epochs,
        "head_batches": study.head_batches,
        "head_draws": study.head_draws,
    }


def tag(settings: dict[str, Any]) -> str:
    """A trial's settings as a folder name's part (numbers in ``g`` form; ``defaults`` for
    none: the folder names the repo, which may not end in '-')."""
    return (
        "-".join(
            f"{k}{v:g}" if isinstance(v, int | float) else f"{k}{v}" for k, v in settings.items()
        )
        or "defaults"
    )


def heads_trial(
    study: StudyConfig,
    row: str,
    settings: dict[str, Any],
    recs: StandIn,
    work: Path,
    heads: int = 3,
    mode: str = MODE,
    centred: bool = True,
    noise: bool = True,
    matched_rate: bool = False,
    interpolate: float = 1.0,
) -> Trial:
    """``row`` (``syn``, ``syn-dpcap``: the committed ViP or DP-Cap prior; one of ``STAGES``:
    its family's DP stage on the stand-in at the job's noise) read in ``mode`` by ``heads`` DP
    heads of the study's fixed ``head_kind`` with the job's head noise (centred on the centring
    records' mean, or with ``centred`` off a DP-SGD head's BatchNorm the identity), and a
    non-private reference; top-1 on the stand-in's scoring records. The DP heads read the
    study's principal components of the centring records' features (``head_components`` for
    DP-SGD, ``class_means_components`` for class means), as the study's heads do; the
    reference reads the features. Without ``noise`` a stage row trains at ``NO_NOISE`` inside
    ``trial_weights`` and its heads are charged as the job's stage; with ``matched_rate`` its
    stage samples the real q (a batch of P q) at sigma scaled as a head's (``matched_head``),
    inside ``trial_weights`` too (on P records that sigma spends an epsilon no ledger states);
    ``interpolate`` a: the heads read prior + a (stage - prior), the stage's weights moved
    toward its prior's (post-processing of the stage's release)."""
    began = time.process_time()
    t = Trial(row, settings)
    prior: list[GaussianRun] = []
    kept: dict[str, torch.Tensor] | None = None
    if row in PRIORS:
        repo = prior_path(study.prior(PRIORS[row]))
    else:
        sigma, q, steps_real = encoder_stage(study, row)
        prior = [(sigma, q, steps_real)]
        t.real["encoder"] = prior[0]
        q_standin, stage_sigma, stage_study = q * study.train_size / len(recs.private), sigma, study
        if matched_rate:  # as many epochs as the real stage, the same noise on the averaged step
            batch = max(1, round(q * len(recs.private)))
            q_standin = batch / len(recs.private)
            stage_sigma = sigma * batch / (q * study.train_size)
            stage_study = study.updated({"dp_batch_size": batch, "contrastive_batch_size": batch})
        stage_sigma = stage_sigma if noise else NO_NOISE
        t.standin["encoder"] = (stage_sigma, q_standin, steps_real)
        # every setting in the folder: trials run side by side never share (and restart) one encoder
        out = work / f"{row}-{tag(settings)}"
        if noise and not matched_rate:
            repo = train_encoder(stage_study, row, stage_sigma, recs.private, out)
        else:  # a noise no ledger may state (its epsilon on the stand-in is beyond the grids)
            with trial_weights() as weights:
                train_encoder(stage_study, row, stage_sigma, recs.private, out)
            repo, kept = prior_path(study.prior(row)), weights
    encoder = load_encoder(repo)
    if kept is not None:  # the stage's weights (noise-free, or at a matched rate) in its prior's
        encoder.model.load_state_dict(kept)
    if interpolate != 1.0 and row not in PRIORS:
        start = load_encoder(prior_path(study.prior(row))).model.state_dict()
        moved = {
            k: start[k] + interpolate * (v - start[k]) if v.is_floating_point() else v
            for k, v in encoder.model.state_dict().items()
        }
        encoder.model.load_state_dict(moved)
    x, xs, xc = (embed(encoder, d, mode) for d in (recs.private, recs.score, recs.centre))
    y, ys = torch.as_tensor(recs.private.labels), torch.as_tensor(recs.score.labels)
    t.real["head"], t.standin["head"] = matched_head(study, study.train_size, prior, len(y))
    sigma_h, q_h, steps_h = t.standin["head"]
    eps = epsilon(sigma_h, q_h, steps_h, study.delta)
    cfg = head_config(study, len(y), eps, dataset=recs.private.dataset.name)
    means = head_kind(study, None) == "class-means"
    k = component_count(xc, study.class_means_components if means else study.head_components)
    project = public_components(xc, k) if k else (lambda features: features)
    px, pxs, pxc = project(x), project(xs), project(xc)
    statistics = centred_statistics(pxc if centred else torch.zeros_like(pxc[:1]))
    classes = len(recs.private.classes)
    for _ in range(heads):  # each the mean of the study's head draws, as the job releases
        draws = [
            fit_class_means(px, y, classes, cfg, pxc)[0]
            if means
            else fit_probe(px, y, classes, cfg, statistics)[0]
            for _ in range(study.head_draws)
        ]
        t.dp_top1.append(100 * accuracy(mean_head(draws), pxs, ys))
    ref_cfg = head_config(study, len(y), None, dataset=recs.private.dataset.name)
    ref, _ = fit_probe(x, y, len(recs.private.classes), ref_cfg, desc="reference")
    t.reference_top1 = 100 * accuracy(ref, xs, ys)
    t.cpu_s = time.process_time() - began
    return t


def finetune_trial(
    study: StudyConfig,
    settings: dict[str, Any],
    recs: StandIn,
    work: Path,
    probe_only: bool = False,
) -> Trial:
    """The benchmark's DP fine-tuning row (``FINETUNE`` with ``settings`` replacing its fields)
    on the stand-in: the DP probe at ``probe_epsilon`` alone and the fine-tuning the split leaves
    at the benchmark's n, every sigma scaled by the ratio of expected batches; or
    (``probe_only``) a DP probe alone at the whole epsilon."""
    from training.recipes.finetune import arrays_config, trial_finetune

    began = time.process_time()
    s = {**FINETUNE, **settings}
    n, real_n = len(recs.private), study.train_size
    init = prior_path(study.syn_prior)
    if probe_only:  # the row's probe alone: a DP-SGD head
        sgd = study.model_copy(update={"head_kind": "sgd"})
        t = heads_trial(sgd, "syn", {"probe_only": 1}, recs, work, heads=3)
        t.row = "finetune"
        return t
    t = Trial("finetune", settings)
    probe_epsilon, steps = s.pop("probe_epsilon"), s["steps"]
    q, t_p = head_sampling(study, real_n, FASHION_MNIST_TEST)
    s_p = calibrate(probe_epsilon, study.delta, q, t_p)
    own = remaining_epsilon(study.epsilon, study.delta, [(s_p, q, t_p)], q, steps)
    s_f = calibrate(own, study.delta, q, steps)
    r = batch_ratio(study, n, real_n)
    t.real = {"probe": (s_p, q, t_p), "finetune": (s_f, q, steps)}
    t.standin = {"probe": (s_p * r, q, t_p), "finetune": (s_f * r, q, steps)}
    batch = head_config(study, n, None, dataset=recs.private.dataset.name).batch_size
    run_settings = {
        "batch_size": batch,
        "pooling": MODE,
        "probe_epsilon": epsilon(*t.standin["probe"], study.delta),
        "probe_epochs": study.probe_epochs,
        "probe_batch_size": batch,
        "probe_lr": study.head_lr,
        "probe_max_grad_norm": study.head_clip,
        "device": "cpu",
        "workers": 0,
        **s,
    }
    cfg = arrays_config(
        init,
        recs.private,
        recs.score,
        work / f"finetune-{tag(settings)}",
        recs.centre,
        composed_epsilon(list(t.standin.values()), study.delta),
        study.delta,
        run_settings,
    )
    t.dp_top1 = [100 * trial_finetune(cfg)]
    t.cpu_s = time.process_time() - began
    return t


def main(argv: Sequence[str] | None = None) -> Trial:
    """Command line: run one trial, print it (and append it to ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("row", choices=(*PRIORS, *STAGES, "finetune"))
    p.add_argument("--encoder-epsilon", type=float, default=JOB.encoder_epsilon)
    p.add_argument("--lr-scale", type=float, default=JOB.dp_lr_scale)
    p.add_argument(
        "--interpolate",
        type=float,
        default=1.0,
        help="a stage row: the heads read prior + A (stage - prior), the stage's weights moved "
        "toward its prior's (1: the stage's)",
    )
    p.add_argument(
        "--ema-decay",
        type=float,
        default=JOB.dp_ema_decay,
        help="vip, dpcap: the released average's decay (0: the last iterate)",
    )
    p.add_argument(
        "--decoder-warmup",
        type=int,
        default=JOB.vip_decoder_warmup,
        help="vip, dpcap: steps of the stage's fresh decoder (ViP's MAE decoder, DP-Cap's text "
        "decoder) on public procedural images before its DP stage (the study's "
        "vip_decoder_warmup or dpcap_decoder_warmup)",
    )
    p.add_argument(
        "--encoder-parameters",
        choices=("all", "biases"),
        default=None,
        help="what of the encoder the stage trains (default: vip, dpcap: the study's "
        "dp_encoder_parameters; finetune: the benchmark row's, FINETUNE)",
    )
    p.add_argument("--probe-epsilon", type=float, default=FINETUNE["probe_epsilon"])
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="fine-tuning's lr (default: the benchmark's for --encoder-parameters, FINETUNE_LR)",
    )
    p.add_argument(
        "--finetune-steps", type=int, default=FINETUNE["steps"], help="fine-tuning's steps"
    )
    p.add_argument(
        "--augmult", type=int, default=FINETUNE["augmult"], help="fine-tuning's views per example"
    )
    p.add_argument(
        "--fixed-head",
        action="store_true",
        help="finetune: the fine-tuning keeps the DP probe's head, training the encoder alone",
    )
    p.add_argument("--probe-only", action="store_true", help="finetune: the DP probe alone")
    p.add_argument("--heads", type=int, default=3, help="DP heads per trial (their mean)")
    p.add_argument(
        "--head-epochs",
        type=int,
        default=None,
        help="the DP heads' epochs, the fine-tuning's probe's too (default: the study's "
        "probe_epochs), their noise calibrated at the real run's steps",
    )
    p.add_argument(
        "--head-batches",
        type=int,
        default=None,
        help="the DP heads' Poisson batches an epoch, the fine-tuning row's probe's and stage's "
        "too (default: the study's head_batches), their noise calibrated at the real run's q "
        "and steps",
    )
    p.add_argument(
        "--head-draws",
        type=int,
        default=None,
        help="draws each DP head is the mean of, sharing the head's budget (default: the "
        "study's head_draws: the job's 3, the benchmark's 1)",
    )
    p.add_argument("--uncentred", action="store_true", help="heads' BatchNorm the identity")
    p.add_argument(
        "--no-noise",
        action="store_true",
        help=f"a stage row: the stage at sigma {NO_NOISE:g} (its objective's ceiling), its "
        "weights kept and nothing exported; the heads charged as the job's stage",
    )
    p.add_argument(
        "--disjoint-centre",
        action="store_true",
        help="centre on the last centring-size records of --private, the private ones before them",
    )
    p.add_argument(
        "--head-components",
        type=int,
        help="the DP heads' public principal components (0: the features; default: the study's)",
    )
    p.add_argument(
        "--head-kind",
        choices=("sgd", "class-means"),
        default="sgd",
        help="the DP heads: DP-SGD (on --head-components) or class-means (on the study's "
        "class_means_components)",
    )
    p.add_argument(
        "--study",
        choices=("job", "benchmark"),
        default="job",
        help="syn, vip, dpcap: whose real run's noise (the job's n = 10,000 or the benchmark's)",
    )
    p.add_argument("--private", type=int, default=PRIVATE, help="stand-in private records")
    p.add_argument("--end", type=int, default=END, help="scoring records end here")
    p.add_argument("--mode", default=MODE, help="the feature mode the heads read")
    p.add_argument(
        "--encoder-steps",
        type=int,
        default=None,
        help="a stage row: the real stage's steps T (default: the study's), its noise "
        "calibrated at T",
    )
    p.add_argument(
        "--dp-batch-size",
        type=int,
        default=None,
        help="a stage row: the real stage's expected batch B (default: the study's), its noise "
        "calibrated at B",
    )
    p.add_argument(
        "--matched-rate",
        action="store_true",
        help="a stage row: the stand-in's stage samples the real q (a batch of P q, as many "
        "epochs) at sigma scaled by the ratio of the expected batches (the heads' rule), not the "
        "real B at the real sigma",
    )
    p.add_argument("--data", default=None, help="Fashion-MNIST folder (default: the package)")
    p.add_argument("--work", default="var/standin")
    p.add_argument("--json", default=None, help="append the trial here (JSON lines)")
    a = p.parse_args(argv)
    adamw_only = (
        a.lr_scale != JOB.dp_lr_scale
        or a.ema_decay != JOB.dp_ema_decay
        or a.decoder_warmup
        or a.encoder_parameters
    )
    contrastive = STAGES.get(a.row) == "contrastive"
    if (a.no_noise or a.interpolate != 1.0) and a.row not in STAGES:
        p.error(f"--no-noise and --interpolate are a stage row's ({', '.join(STAGES)})")
    if contrastive and adamw_only:
        p.error(
            "--lr-scale, --ema-decay, --decoder-warmup and --encoder-parameters are ViP's and "
            "DP-Cap's: the contrastive stages train at their recipe's rate, the last iterate"
        )
    if a.uncentred and a.head_kind != "sgd":
        p.error("--uncentred is a DP-SGD head's option: a class-means head centres its features")
    base = JOB if a.study == "job" else BENCHMARK
    components = base.head_components if a.head_components is None else a.head_components
    if a.uncentred and components:
        p.error("--uncentred reads the features as they are: give --head-components 0 with it")
    work = Path(a.work)
    head = {
        key: value
        for key, value in (
            ("probe_epochs", a.head_epochs),
            ("head_batches", a.head_batches),
            ("head_draws", a.head_draws),
        )
        if value is not None
    }
    # a split other than the default is recorded (and so names the trial's folder)
    given = (("private", a.private, PRIVATE), ("end", a.end, END))
    split = {key: value for key, value, default in given if value != default}
    if a.row == "finetune":
        try:
            study = BENCHMARK.updated(head)
        except ValidationError as e:
            p.error(str(e))
        recs = standin_records(study, a.data, work, a.private, a.end)
        trains = a.encoder_parameters or FINETUNE["encoder_parameters"]
        lr = FINETUNE_LR[trains] if a.lr is None else a.lr
        # encoder_parameters recorded always: its default changed on 2026-11-30
        settings = {"probe_epsilon": a.probe_epsilon, "lr": lr, "encoder_parameters": trains}
        settings |= head_schedule(study) | split
        for key, value in (
            ("steps", a.finetune_steps),
            ("augmult", a.augmult),
            ("fixed_head", a.fixed_head),
        ):
            if value != FINETUNE[key]:
                settings[key] = value
        t = finetune_trial(study, settings, recs, work, a.probe_only)
    else:
        trains = a.encoder_parameters or base.dp_encoder_parameters
        try:
            study = base.updated(
                {
                    "encoder_epsilon": a.encoder_epsilon,
                    "dp_lr_scale": a.lr_scale,
                    "dp_ema_decay": a.ema_decay,
                    "dp_encoder_parameters": trains,
                    "vip_decoder_warmup": a.decoder_warmup,
                    "dpcap_decoder_warmup": a.decoder_warmup,
                    "head_components": components,
                    "head_kind": a.head_kind,
                    **(
                        {
                            "dp_steps": a.encoder_steps,
                            "dpcap_steps": a.encoder_steps,
                            "contrastive_steps": a.encoder_steps,
                        }
                        if a.encoder_steps
                        else {}
                    ),
                    **(
                        {
                            "dp_batch_size": a.dp_batch_size,
                            "contrastive_batch_size": a.dp_batch_size,
                        }
                        if a.dp_batch_size
                        else {}
                    ),
                    **head,
                }
            )
        except ValidationError as e:
            p.error(str(e))
        recs = standin_records(study, a.data, work, a.private, a.end, a.disjoint_centre)
        adamw = a.row in STAGES and not contrastive
        settings = {} if a.row in PRIORS else {"E": a.encoder_epsilon}
        if adamw:  # the contrastive stages take none of these (their recipe's lr, no average)
            settings["lr"] = a.lr_scale
        if adamw and a.ema_decay:
            settings["ema"] = a.ema_decay
        if a.row not in PRIORS and a.encoder_steps:
            settings["steps"] = a.encoder_steps
        if a.row not in PRIORS and a.dp_batch_size:
            settings["batch"] = a.dp_batch_size
        if a.row not in PRIORS and trains != "all":
            settings["trains"] = trains
        if a.row not in PRIORS and a.decoder_warmup:
            settings["decoder_warmup"] = a.decoder_warmup
        if a.no_noise:
            settings["noise"] = "none"
        if a.uncentred:
            settings["centred"] = 0
        settings |= head_schedule(study) | split
        if a.disjoint_centre:
            settings["centre"] = "disjoint"
        if a.head_kind == "sgd":
            settings["components"] = components
        else:
            settings["head"] = a.head_kind
        if a.study != "job":
            settings["study"] = a.study
        if a.mode != MODE:  # in the folder's name too: trials of two modes never share an encoder
            settings["mode"] = a.mode
        if a.matched_rate:
            settings["rate"] = "matched"
        if a.interpolate != 1.0:
            settings["interpolate"] = a.interpolate
        t = heads_trial(
            study, a.row, settings, recs, work, a.heads, a.mode, not a.uncentred, not a.no_noise,
            a.matched_rate, a.interpolate,
        )  # fmt: skip
    print(json.dumps({**asdict(t), "mean": t.mean}))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps({**asdict(t), "mean": t.mean}) + "\n")
    return t


if __name__ == "__main__":
    main()
