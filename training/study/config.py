"""The study's settings, once: ``StudyConfig``'s fields say what each setting is and how it was
chosen; its defaults are the main job's (``JOB``), and ``BENCHMARK`` names every field on which
``benchmarks/utility.py`` differs, with why. Nothing here was tuned on the records it reports.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..recipes.probe import PAPER_HEAD_BATCHES, PAPER_HEAD_CLIP, PAPER_HEAD_LR
from ..skeleton.config import EncoderParameters

__all__ = ["BENCHMARK", "JOB", "StudyConfig", "stamp"]


class StudyConfig(BaseModel):
    """The Fashion-MNIST study's data split, budget, DP encoders' schedule and DP heads: the
    main job's values by default (``JOB``); ``BENCHMARK`` for ``benchmarks/utility.py``."""

    model_config = ConfigDict(extra="forbid")

    train_size: int = Field(
        10_000,
        gt=0,
        description="private records: the first N of the train split in file order (a public "
        "rule); the job's 10,000 is what it can embed once per encoder within 15 minutes on 2 "
        "cores, the benchmark's 60,000 the whole split, as in Tramer & Boneh's table",
    )
    select_size: int = Field(
        8_000,
        ge=4,
        description="public test records 0..K-1 that choose each (Syn) encoder's feature mode, "
        "two-fold (a head fit on each half, scored on the other); the job's 8,000 give each "
        "selection head 4,000 records to fit, the benchmark's 5,000 leave 5,000 to score "
        "(docs/changes.md)",
    )
    test_size: int = Field(
        2_000,
        gt=0,
        description="public test records that measure top-1: the M after the selection records "
        "(no choice saw them); the job's 2,000 are what its 10,000 test records leave, the "
        "benchmark's 5,000 likewise",
    )
    centre_size: int = Field(
        1_000,
        gt=0,
        description="the first selection records (all, when fewer), whose features' mean "
        "centres every DP head (BatchNorm fixed to that mean; a DP-SGD head's variance 1, a "
        "class-means head's their variance, their covariance its LDA's); centring and its size "
        "chosen on public data (the benchmarks' README, 'the head's centring' and 'Settings "
        "chosen on public data')",
    )
    epsilon: float = Field(
        3.0,
        gt=0,
        description="epsilon of every released classifier, encoder and head composed (RDP): "
        "the literature's budget for Fashion-MNIST (Tramer & Boneh, ICLR 2021)",
    )
    delta: float = Field(
        1e-5,
        gt=0,
        lt=1,
        description="delta of every DP stage, passed explicitly (below 1/n): the literature's",
    )
    encoder_epsilon: float = Field(
        0.5,
        gt=0,
        description="the split rule: epsilon of every DP encoder, its head calibrated to the "
        "rest (a head on an encoder that saw no private record gets all of it); chosen on "
        "public data, ViP's stage and heads on a public stand-in (benchmarks/standin.py; "
        "the benchmarks' README, 'Settings chosen on public data')",
    )
    probe_epochs: int = Field(
        48,
        gt=0,
        description="epochs of every DP head, the selection heads' too (fewer steps at one "
        "epsilon carry less noise each); each preset's, with head_batches, chosen for both "
        "priors' DP heads on the public stand-in at that preset's head noise (the benchmarks' "
        "README, 'The DP heads' epochs' and 'The DP heads' batch')",
    )
    head_batches: int = Field(
        2,
        gt=0,
        description="Poisson batches per epoch of a DP head (q = 1 / head_batches); each "
        "preset's chosen with probe_epochs (likewise)",
    )
    head_draws: int = Field(
        3,
        ge=1,
        le=16,
        description="draws of each row's DP head, each from a fresh secret and all composed "
        "with the encoder within epsilon (the split rule shares the head's rest among them): "
        "the mean of their heads is released and every draw's top-1 reported, so a row's "
        "spread from its head's noise is seen; the job's 3, whose mean head matched one head at "
        "the whole budget on the public stand-in (the benchmarks' README, 'Head draws'); the "
        "benchmark's 1 (its --draws are each a classifier at the whole budget, their "
        "composition printed)",
    )
    head_clip: float = Field(
        PAPER_HEAD_CLIP, gt=0, description="clipping norm C of a DP head (the paper's)"
    )
    head_lr: float = Field(
        PAPER_HEAD_LR,
        gt=0,
        description="peak SGD learning rate of a DP head, momentum 0.9 (the paper's)",
    )
    head_kind: Literal["sgd", "class-means", "chosen"] = Field(
        "chosen",
        description="a row's released DP head: 'sgd', the paper's DP-SGD linear head; "
        "'class-means', LDA on private class means released once by the Gaussian mechanism "
        "with a public covariance (training/recipes/class_means.py); 'chosen', either, the one "
        "that scores higher on the public selection records at the real head's noise, with "
        "the feature mode (training/study/selection.py); chosen on the public stand-in (the "
        "benchmarks' README, 'A class-means head')",
    )
    class_means_components: int = Field(
        128,
        gt=0,
        description="the public principal components a class-means head reads (its noise and "
        "its public covariance's error grow with the dimension): the best of 64, 128, 256 and "
        "512 on the public stand-in (the benchmarks' README, 'A class-means head')",
    )
    head_components: int = Field(
        128,
        ge=0,
        description="K > 0: a DP-SGD head (the selection heads too) reads the top K principal "
        "components of its features of the centring records (public; at most one fewer than "
        "those records and the features' dimension), and the released head is its map back to "
        "the features (post-processing); 0: the features themselves. Each preset's chosen on "
        "the public stand-in alone, taken where its gain clears the trials' spread (the "
        "benchmarks' README, 'Heads on public principal components')",
    )
    syn_prior: str = Field(
        "vip-nano-scatter",
        description="the (Syn)-ViP encoder: a committed prior's name (training.priors) or a "
        "(Syn) repo folder; the start of ViP, Logit-DP and Naive-DP",
    )
    dpcap_prior: str = Field(
        "dpcap-nano-scatter", description="the (Syn) encoder DP-Cap starts from (likewise)"
    )
    decoder_dim: int = Field(256, gt=0, description="ViP's fresh MAE decoder width")
    decoder_depth: int = Field(2, gt=0, description="ViP's fresh MAE decoder blocks")
    decoder_heads: int = Field(8, gt=0, description="ViP's fresh MAE decoder heads")
    dp_batch_size: int = Field(256, gt=0, description="expected batch of ViP and DP-Cap")
    dp_steps: int = Field(
        70,
        gt=0,
        description="steps of ViP: cut to fit the job's 15 minutes, no data seen",
    )
    dpcap_steps: int = Field(30, gt=0, description="steps of DP-Cap: cut likewise")
    dp_micro_batch_size: int = Field(
        128, gt=0, description="physical batch of ViP and DP-Cap (memory only, not the result)"
    )
    dp_lr_scale: float = Field(
        0.25,
        gt=0,
        le=16,
        description="multiple of its recipe's peak learning rate ViP and DP-Cap train at (the "
        "recipes' rates are their papers', for batches of 98,304 and 1.3 M); chosen on public "
        "data, ViP's stage on a public stand-in (the benchmarks' README, 'Settings chosen on "
        "public data')",
    )
    dp_ema_decay: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="ViP's and DP-Cap's released weights: the iterates' moving average at this "
        "decay (the DP engine's ``ema_decay``, post-processing; 0 the last iterate); chosen on "
        "the public stand-in against the last iterate (the benchmarks' README, 'Weight "
        "averaging')",
    )
    dp_encoder_parameters: EncoderParameters = Field(
        "all",
        description="what of the encoder ViP's and DP-Cap's stages train (the recipes' "
        "``encoder_parameters``): all, kept as biases alone did not pass the rule on the public "
        "stand-in (the benchmarks' README, 'The encoder's biases alone')",
    )
    vip_decoder_warmup: int = Field(
        0,
        ge=0,
        description="steps of ViP's fresh MAE decoder on public procedural images, the encoder "
        "frozen, before its DP stage (the recipe's ``decoder_warmup``; no private data); 0, kept "
        "as a warm-up did not pass the rule on the public stand-in (the benchmarks' README, "
        "'The MAE decoder's public warm-up')",
    )
    dpcap_decoder_warmup: int = Field(
        0,
        ge=0,
        description="steps of DP-Cap's fresh text decoder on public procedural images with the "
        "public captions, the encoder frozen, before its DP stage (the recipe's "
        "``decoder_warmup``; no private data); 0, kept likewise (the benchmarks' README, "
        "'DP-Cap: a larger batch, and its text decoder's public warm-up')",
    )
    contrastive_batch_size: int = Field(
        32,
        gt=0,
        description="expected batch of Logit-DP and Naive-DP: cut to fit the job's 15 "
        "minutes, no data seen; a larger one did no better on the public stand-in (the "
        "benchmarks' README, 'The contrastive stages on the stand-in')",
    )
    contrastive_steps: int = Field(
        30, gt=0, description="steps of Logit-DP and Naive-DP: cut likewise"
    )
    temperature: float = Field(
        1.0, gt=0, description="InfoNCE temperature of Logit-DP and Naive-DP"
    )

    @model_validator(mode="after")
    def _budget_split(self) -> StudyConfig:
        if self.encoder_epsilon >= self.epsilon:
            raise ValueError(
                f"encoder_epsilon {self.encoder_epsilon:g} leaves nothing of epsilon "
                f"{self.epsilon:g} for the heads"
            )
        return self

    def recipe_settings(self) -> dict[str, dict[str, Any]]:
        """Each DP encoder recipe's settings from this schedule: ``vip``, ``dpcap`` and
        ``contrastive`` (Logit-DP and Naive-DP) config fields."""
        from ..recipes.dpcap import DPCapConfig
        from ..recipes.vip import VipConfig

        def peak(recipe: type[BaseModel]) -> float:
            return float(recipe.model_fields["lr"].default) * self.dp_lr_scale

        adamw = {
            "batch_size": self.dp_batch_size,
            "micro_batch_size": self.dp_micro_batch_size,
            "ema_decay": self.dp_ema_decay,
            "encoder_parameters": self.dp_encoder_parameters,
        }
        return {
            "vip": {
                **adamw,
                "steps": self.dp_steps,
                "lr": peak(VipConfig),
                "decoder_dim": self.decoder_dim,
                "decoder_depth": self.decoder_depth,
                "decoder_heads": self.decoder_heads,
                "decoder_warmup": self.vip_decoder_warmup,
            },
            "dpcap": {
                **adamw,
                "steps": self.dpcap_steps,
                "lr": peak(DPCapConfig),
                "decoder_warmup": self.dpcap_decoder_warmup,
            },
            "contrastive": {
                "batch_size": self.contrastive_batch_size,
                "steps": self.contrastive_steps,
                "temperature": self.temperature,
            },
        }

    def updated(self, fields: dict[str, Any]) -> StudyConfig:
        """This study with ``fields`` replaced, each checked against its bounds and the study's
        rules (``model_copy`` checks none)."""
        return StudyConfig.model_validate({**self.model_dump(), **fields})

    def prior(self, family: str) -> str:
        """The (Syn) encoder ``family`` (``vip`` or ``dpcap``) starts from: a committed prior's
        name or a repo folder."""
        return self.dpcap_prior if family == "dpcap" else self.syn_prior


JOB = StudyConfig()
"""``vip-hub run``'s study (``make run``): 10,000 private records, 15 minutes on 2 cores."""
BENCHMARK = StudyConfig(
    train_size=60_000,
    select_size=5_000,
    test_size=5_000,
    probe_epochs=50,
    head_batches=PAPER_HEAD_BATCHES,
    head_components=0,
    head_draws=1,
)
"""``benchmarks/utility.py``'s study: the whole train split, as the paper's table; the same
protocol otherwise, its heads' batch and epochs chosen at its own noise (Tramer & Boneh's
published head: batch 8,192, and epsilon 3 in 50 epochs at their sigma 4.05)."""


def stamp(settings: dict[str, Any]) -> str:
    """A SHA-256 hex digest of ``settings`` (JSON, keys sorted): a step's or a cache's key."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
