"""``vip-hub run`` (what ``make run`` does): train, compare, publish and serve private encoders
on Fashion-MNIST: the study of ``training/study`` at its job preset (``MainJobConfig`` is a
``StudyConfig`` with where to work and serve).

1. the data: Fashion-MNIST from ``--data`` (its four IDX files, or an image folder), else the
   Debian package, fetched when missing, split by ``training.study.splits``; the private records
   are written as a PNG class folder captioned by the public template over the class names (what
   every recipe reads), the scoring records as a PNG class folder, with a public vocabulary and
   public captions over the class names;
2. the (Syn) encoders: the committed priors (``training.priors``; procedural images only, no
   private data), a 4-block vip-nano and a 4-block dpcap-nano at 28 px and patch 4 whose last
   block learned a ScatterNet's coefficients, copied into the work folder;
3. four private encoders on the private records, each at ``encoder_epsilon`` and ``delta``: ViP
   (DP-AdamW MAE), DP-Cap (DP-AdamW captioning), Logit-DP (contrastive, per-pair clipping) and
   its Naive-DP baseline (the whole batch clipped), on the study's schedule;
4. the comparison: every encoder gets the study's DP head (``training.study.heads``), drawn
   ``head_draws`` times within the budget (each a ledger stage) and the mean of the draws'
   heads released in its repo as head ``fashion-mnist``, on the feature mode chosen for its (Syn)
   encoder (``training.study.selection``); DP-Cap also classifies zero-shot over the class
   names, shown beside the heads only when it is above chance (``training.study.table``); the
   raw-pixel baseline is the same DP head on the preprocessed image's pixels, released in the
   (Syn)-ViP repo as head ``fashion-mnist-pixels`` (the ``pixels`` mode reads no weight). Every
   row is a released repo's head, so the dataset page composes them all; the rows go into every
   card and the printed summary, with each DP-trained encoder's row paired against its prior's
   row (both priors are published with their heads; ``training.study.table.paired``, over every
   draw) and every encoder's against raw pixels;
5. sign every repo with the job's key (``WORK/signing/main-job.key``, made once), start
   ``vip-hub serve`` on the embedded store trusting that key, and publish the repos through
   ``vip_hub.repo.push`` (the verified path ``vip-hub push`` takes);
6. print the comparison, the job's wall time and how to use the models, and keep serving until
   interrupted.

Every step records a stamp of its inputs; a re-run skips steps whose outputs exist and whose
stamp matches. A failing step says which one failed and how to resume. The server is a child
process (``training`` never imports ``service``), reached over HTTP by the hub clients.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import ConfigDict, Field

from vip_hub.cli.main import unavailable
from vip_hub.errors import (
    AuditError,
    ConfigError,
    MissingInputError,
    SignatureError,
    StepFailed,
)
from vip_hub.local_hub import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_STORE, Port
from vip_hub.paths import write_private
from vip_hub.privacy.audit import DEFAULT_BETA, DEFAULT_CANARIES, MAX_CANARIES
from vip_hub.privacy.ledger import DPStage, PrivacyLedger, privacy_headline
from vip_hub.repo.files import DEFAULT_ORG, update_repo
from vip_hub.repo.push import is_published, push_repo
from vip_hub.repo.signing import (
    PRIVATE_SUFFIX,
    PUBLIC_SUFFIX,
    create_key,
    load_keys,
    sign_repo,
    verify_signature,
)
from vip_hub.repo.verify import verify_repo
from vip_hub.repo_format import (
    LEDGER_FILE,
    SIGNATURE_FILE,
    head_component,
    head_name_of,
    is_weights_file,
)

from .data.labelled import (
    CAPTION_TEMPLATE,
    FASHION_MNIST_TRAIN,
    caption_text_paths,
    write_caption_folder,
    write_caption_texts,
    write_image_folder,
)
from .skeleton.config import run_folder
from .study.config import StudyConfig, stamp
from .study.splits import study_splits
from .study.table import Row

if TYPE_CHECKING:
    from .skeleton.config import DPRunConfig

__all__ = ["PUBLISHED", "MainJobConfig", "run_main_job"]

JOB_USER = "main-job"
"""The job's user on its hub, a member of ``DEFAULT_ORG``, and its signing key's name."""
HEAD = "fashion-mnist"
"""The name of the DP probe head every published encoder gets (its folder: ``head_component``)."""
PIXELS_HEAD = "fashion-mnist-pixels"
"""The raw-pixel baseline's DP head, on the ``pixels`` mode of the (Syn)-ViP repo (which reads no
weight: its guarantee is the head's own stages alone)."""


class MainJobConfig(StudyConfig):
    """The study at its job preset (``training.study.config.JOB``: sized so the whole job stays
    under 15 minutes on 2 CPU cores, the install included), and where the job works and serves."""

    model_config = ConfigDict(extra="forbid")

    work_dir: str = Field("var/run", description="where the job keeps data, runs and repos")
    data: str | None = Field(
        None,
        description="Fashion-MNIST: the folder of its four IDX files (gzipped or not) or an image "
        "folder with train/ and test/ class subfolders (default: the Debian package "
        "dataset-fashion-mnist, fetched into WORK_DIR/data when missing)",
    )
    store: str = Field(str(DEFAULT_STORE), description="the hub store the server uses")
    host: str = Field(DEFAULT_HOST, description="interface the server binds")
    port: Port = Field(DEFAULT_PORT, description="port the server binds")
    audit_canaries: int = Field(
        DEFAULT_CANARIES,
        ge=0,
        le=MAX_CANARIES,
        description="canaries of each DP run's one-run audit",
    )
    workers: int = Field(1, ge=0, description="data-loading processes")
    serve: bool = Field(
        True,
        description=(
            "keep serving after publishing (--no-serve: publish to a hub started without "
            "inference, then stop, e.g. in tests)"
        ),
    )
    restart: bool = Field(False, description="delete the work folder first (the hub store is kept)")

    def study(self) -> StudyConfig:
        """The study settings alone (what the comparison step's stamp covers)."""
        return StudyConfig(**self.model_dump(include=set(StudyConfig.model_fields)))


def _ledger_digest(repo: Path) -> str:
    return hashlib.sha256((repo / LEDGER_FILE).read_bytes()).hexdigest()


def _weights_digest(repo: Path) -> str:
    """The encoder's and decoder's tensor digests (unchanged when heads or cards change)."""
    artifacts = PrivacyLedger.read(repo).artifacts
    return stamp(
        {k: v for k, v in artifacts.items() if is_weights_file(k) and head_name_of(k) is None}
    )


def _copy_repo(source: Path, out: Path) -> None:
    """Copy the repo folder ``source`` to ``out``, replacing what is there (the job signs its
    copy, never the committed prior)."""
    if not (source / LEDGER_FILE).is_file():
        raise MissingInputError(f"{source} is not an exported repo (no {LEDGER_FILE})")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out)


_RESUME_HINT = (
    "Fix the cause and run `make run` again: finished steps are skipped and training resumes "
    "from its last checkpoint (`vip-hub run --restart` starts over)."
)


def _audit_hint(outputs: list[Path]) -> str:
    """What to do when a step's one-run audit refused its release twice, the second time on a run
    from a fresh secret (``retrained_if_flagged``)."""
    folders = " ".join(str(run_folder(p)) for p in outputs)
    return (
        "Nothing was released. An honest run is flagged with probability at most beta = "
        f"{DEFAULT_BETA:g} (far less at the job's settings: docs/concepts/verify.md), two in a "
        "row far less often still: the DP engine does not give the privacy it claims. Report it "
        f"with the run folder ({folders})."
    )


class _Steps:
    """Runs named steps, skipping those whose outputs exist with a matching input stamp."""

    def __init__(self, work: Path):
        self.file = work / "steps.json"
        self.done: dict[str, str] = self._read() if self.file.exists() else {}
        self.count = 0

    def _read(self) -> dict[str, str]:
        """The finished steps' stamps; ConfigError naming the file when it holds none."""
        try:
            done = json.loads(self.file.read_bytes())
        except ValueError as e:  # not UTF-8, not JSON
            done = e
        if not isinstance(done, dict) or not all(isinstance(v, str) for v in done.values()):
            raise ConfigError(
                f"{self.file} is not the job's record of its finished steps ({done!r:.80}): "
                "remove it to run every step again (training resumes from its checkpoints)"
            )
        return done

    def run(
        self,
        name: str,
        inputs: dict[str, Any],
        outputs: list[Path],
        fn: Callable[[], Any],
        fresh: Callable[[], bool] = lambda: True,
    ) -> None:
        self.count += 1
        digest = stamp(inputs)
        if self.done.get(name) == digest and all(p.exists() for p in outputs) and fresh():
            print(f"[{self.count}] {name}: up to date, skipped", flush=True)
            return
        print(f"[{self.count}] {name} ...", flush=True)
        start = time.monotonic()
        try:
            fn()
        except KeyboardInterrupt:
            raise
        except Exception as e:
            raise StepFailed(
                f"step {self.count} ({name}) failed: {type(e).__name__}: {e}\n"
                + (_audit_hint(outputs) if isinstance(e, AuditError) else _RESUME_HINT)
            ) from e
        self.done[name] = digest
        write_private(self.file, json.dumps(self.done, indent=1).encode())  # whole, or not at all
        print(f"[{self.count}] done in {_duration(time.monotonic() - start)}", flush=True)


@dataclass(frozen=True)
class _Encoder:
    """One encoder the job trains and publishes: its folder and repo name and the comparison's
    label."""

    name: str
    label: str

    @property
    def repo_id(self) -> str:
        return f"{DEFAULT_ORG}/{self.name}"


SYN_VIP = _Encoder("vip-nano-syn", "(Syn)-ViP")
SYN_DPCAP = _Encoder("dpcap-nano-syn", "(Syn)-DP-Cap")
VIP = _Encoder("vip-nano-fashion-dp", "ViP (DP-AdamW MAE)")
DPCAP = _Encoder("dpcap-nano-fashion-dp", "DP-Cap (DP-AdamW captioning)")
LOGIT_DP = _Encoder("vip-nano-fashion-logit-dp", "Logit-DP (per-pair clipping)")
NAIVE_DP = _Encoder("vip-nano-fashion-naive-dp", "Naive-DP (whole batch clipped)")
PUBLISHED = (SYN_VIP, VIP, SYN_DPCAP, DPCAP, LOGIT_DP, NAIVE_DP)
"""Published and compared, in this order: each DP-trained encoder's prior is published with a
row of its own, so the DP stage's worth is measured against it."""


def run_main_job(cfg: MainJobConfig) -> int:
    """Run the job; returns the exit status (serving blocks until interrupted)."""
    from .dp.run import retrained_if_flagged
    from .priors import PRIORS, prior_path
    from .recipes.dpcap import DPCapConfig, train_dpcap
    from .recipes.logit_dp import ContrastiveMechanism, LogitDPConfig, train_logit_dp
    from .recipes.vip import VipConfig, train_vip

    began = time.monotonic()
    why = unavailable("serve")
    if why is not None:  # said now, not after the training steps
        raise ConfigError(
            f"the main job publishes through a hub it starts, and `vip-hub serve` cannot run "
            f"here: {why}; the job needs every extra: pip install 'vip-hub[all]'"
        )
    work = Path(cfg.work_dir)
    if cfg.restart and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    steps = _Steps(work)
    data = work / "fashion-mnist"
    train, test = data / "train", data / "test"
    folder = {e: work / e.name for e in PUBLISHED}
    vocab, public_captions = caption_text_paths(data)
    comparison = work / "comparison.json"
    sizes = {"data": cfg.data, **cfg.model_dump(include={"train_size", "select_size", "test_size"})}

    steps.run(
        "Fashion-MNIST: the private and the public scoring records as image folders; captions, "
        "vocabulary and public captions over the class names",
        sizes,
        [train, test, vocab, public_captions],
        lambda: _write_data(cfg, work, train, test),
    )

    for prior, out, what in (
        (cfg.syn_prior, folder[SYN_VIP], "(Syn)-ViP"),
        (cfg.dpcap_prior, folder[SYN_DPCAP], "(Syn)-DP-Cap"),
    ):
        source = prior_path(prior) if prior in PRIORS else Path(prior)
        steps.run(
            f"{what}: the prior {prior} (procedural images only, no private data)",
            {"prior": _weights_digest(source)},
            [out],
            partial(_copy_repo, source, out),
        )

    # The DP runs draw a secret seed (kept in their run folders for resume): with a published
    # seed anyone could regenerate the noise and subtract it.
    private = {
        "data": str(train),
        "epsilon": cfg.encoder_epsilon,
        "delta": cfg.delta,
        "dataset_name": FASHION_MNIST_TRAIN,
        "audit_canaries": cfg.audit_canaries,
        "workers": cfg.workers,
        "seed": None,
    }
    schedule = cfg.recipe_settings()
    runs: list[tuple[_Encoder, Path, Callable[[Any], Path], DPRunConfig]] = [
        (
            VIP,
            folder[SYN_VIP],
            train_vip,
            VipConfig(
                init=str(folder[SYN_VIP]), **schedule["vip"], **private, **_names(VIP, folder)
            ),
        ),
        (
            DPCAP,
            folder[SYN_DPCAP],
            train_dpcap,
            DPCapConfig(
                init=str(folder[SYN_DPCAP]),
                vocab=str(vocab),
                public_captions=str(public_captions),
                **schedule["dpcap"],
                **private,
                **_names(DPCAP, folder),
            ),
        ),
        *[
            (
                e,
                folder[SYN_VIP],
                train_logit_dp,
                LogitDPConfig(
                    init=str(folder[SYN_VIP]),
                    mechanism=m,
                    **schedule["contrastive"],
                    **private,
                    **_names(e, folder),
                ),
            )
            for e, m in (
                (LOGIT_DP, ContrastiveMechanism.LOGIT_DP),
                (NAIVE_DP, ContrastiveMechanism.NAIVE),
            )
        ],
    ]
    for encoder, init, fn, config in runs:
        steps.run(
            f"{encoder.label} on {FASHION_MNIST_TRAIN} at epsilon {cfg.encoder_epsilon:g}",
            {**config.model_dump(mode="json"), "init": _weights_digest(init)},
            [folder[encoder]],
            partial(retrained_if_flagged, fn, config),
        )

    # Each published encoder's (Syn) encoder: the one it was trained from (itself for a (Syn)
    # encoder), on whose features its feature mode is chosen.
    origin = {e: folder[e] for e in (SYN_VIP, SYN_DPCAP)} | {e: init for e, init, _, _ in runs}
    steps.run(
        f"DP heads composing to epsilon {cfg.epsilon:g}, raw pixels, DP-Cap zero-shot",
        {
            "data": cfg.data,
            "study": cfg.study().model_dump(),
            "encoders": {e.name: _weights_digest(folder[e]) for e in PUBLISHED},
            "chosen on": {e.name: _weights_digest(origin[e]) for e in PUBLISHED},
            # its file's layout (a list until 2026-11-29, no against_pixels until 2026-12-06)
            "comparison": "rows, against_prior and against_pixels",
        },
        [
            comparison,
            *(folder[e] / head_component(HEAD) for e in PUBLISHED),
            folder[SYN_VIP] / head_component(PIXELS_HEAD),
        ],
        lambda: _compare(cfg, work, test, folder, origin, comparison),
    )

    key = _signing_key(work)
    for e in PUBLISHED:
        _sign(folder[e], key)
    token = secrets.token_urlsafe(24)
    server = _start_server(cfg, token, key.with_suffix(PUBLIC_SUFFIX))
    try:
        endpoint = f"http://{cfg.host}:{cfg.port}"
        for e in PUBLISHED:
            repo = folder[e]

            def publish(r: Path = repo, i: str = e.repo_id) -> None:
                print("    commit", push_repo(r, i, endpoint=endpoint, token=token))

            def fresh(r: Path = repo, i: str = e.repo_id) -> bool:
                return is_published(r, i, endpoint=endpoint, token=token)

            steps.run(
                f"publish {e.repo_id}",
                {
                    "ledger": _ledger_digest(repo),
                    "store": str(Path(cfg.store).resolve()),
                    "signature": _file_digest(repo / SIGNATURE_FILE),
                },
                [],
                publish,
                fresh=fresh,
            )
        _print_summary(cfg, json.loads(comparison.read_text()), time.monotonic() - began)
        _print_usage(endpoint, test)
        if not cfg.serve:
            return 0
        print("Serving; press Ctrl-C to stop.", flush=True)
        return server.wait()
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM (``docker stop``, a process manager) interrupts as Ctrl-C does:
    the server child is stopped and the current step can be resumed."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _names(encoder: _Encoder, folder: dict[_Encoder, Path]) -> dict[str, str]:
    return {"out": str(folder[encoder]), "model_name": encoder.name, "repo_id": encoder.repo_id}


def _write_data(cfg: MainJobConfig, work: Path, train: Path, test: Path) -> None:
    """The private records captioned over their class names (what every recipe reads), the
    public scoring records, and beside them DP-Cap's public vocabulary and captions (from the
    class names alone)."""
    splits = study_splits(cfg, cfg.data, work / "data")
    write_caption_folder(splits.private, train, splits.classes)
    write_image_folder(splits.test, test, splits.classes)
    write_caption_texts(train.parent, splits.classes)
    print(
        f"    {splits.private.dataset.description}; {len(splits.test)} public test records",
        flush=True,
    )


def _compare(
    cfg: MainJobConfig,
    work: Path,
    test: Path,
    folder: dict[_Encoder, Path],
    origin: dict[_Encoder, Path],
    out: Path,
) -> None:
    """The study's comparison: on every published encoder the study's DP head drawn
    ``cfg.head_draws`` times (their mean head released as head ``HEAD``; all of them composing
    with the encoder's DP stages to ``cfg.epsilon``, every draw's top-1 reported), reading the
    feature mode chosen once per (Syn) encoder (``origin``: what each encoder was trained from);
    the raw-pixel baseline, the same head on the (Syn)-ViP repo's ``pixels`` mode (head
    ``PIXELS_HEAD``, its kind chosen on the selection records' pixels); DP-Cap's zero-shot over
    the class names beside them when above chance. Top-1 on the public scoring records; the rows
    go into every card and ``out``, with each DP-trained encoder paired against its prior and
    every encoder against raw pixels. No model trained without DP on the private records is
    released or measured: its accuracy would be a figure with no guarantee."""
    from vip_hub.loading import Encoder, load_captioner, load_encoder
    from vip_hub.models.features import PIXELS, describe
    from vip_hub.repo.heads import HeadInfo, save_head

    from .recipes.probe import right_answers, top1_result
    from .study.features import Inputs, embed
    from .study.heads import HeadKind, dp_head, dp_head_draws
    from .study.selection import choose_features, choose_modes
    from .study.table import chance_test, paired

    splits = study_splits(cfg, cfg.data, work / "data")
    private = splits.private
    heads = {head_component(HEAD), head_component(PIXELS_HEAD)}
    stages = {  # what each head composes with: not an earlier run's heads, which it replaces
        e: [
            s
            for s in PrivacyLedger.read(folder[e]).dp_stages()
            if s.dataset.name == private.dataset.name and s.component not in heads
        ]
        for e in PUBLISHED
    }
    readers: dict[Path, list[list[DPStage]]] = {}
    for e in PUBLISHED:
        readers.setdefault(origin[e], []).append(stages[e])
    inputs = Inputs()  # each split preprocessed once per data configuration, not per encoder
    chosen = choose_modes(cfg, readers, splits.selection, private, inputs=inputs)
    y, y_test = torch.as_tensor(private.labels), torch.as_tensor(splits.test.labels)

    def release(
        e: _Encoder, name: str, mode: str, kind: HeadKind, reader: Encoder, model: str, how: str
    ) -> np.ndarray:
        """Head ``name`` on ``e``'s ``mode`` features (read by ``reader``) drawn
        ``cfg.head_draws`` times, their mean released in ``e``'s repo; its row (``model``, its
        features ``how``) joins ``rows``; returns every draw's right answers (draws, records)."""
        x, x_test, x_centre = (
            embed(reader, d, mode, f"{e.name} {what}", inputs)
            for d, what in ((private, "private"), (splits.test, "test"), (splits.centre, "centre"))
        )
        head = partial(
            dp_head, cfg, x, y, x_centre, private.dataset, len(splits.classes), stages[e],
            name=name, pooling=mode, kind=kind,
        )  # fmt: skip
        drawn = dp_head_draws(head, cfg.head_draws)
        right = np.stack([right_answers(d.head, x_test, y_test) for d in drawn.draws])
        draws = [float(a.mean()) for a in right]
        top1 = float(right_answers(drawn.head, x_test, y_test).mean())
        metrics = {
            "train_size": len(private),
            "head": kind,
            "epochs": cfg.probe_epochs if kind == "sgd" else 1,
            "top1": top1,
            "draws_top1": draws,
            "test_data": "public",
            "test_size": len(splits.test),
        }
        first = drawn.draws[0]
        ledger = save_head(
            folder[e],
            drawn.head,
            HeadInfo(name, mode, list(splits.classes), metrics),
            first.stage,
            top1_result(
                str(test),
                top1,
                f"top-1, DP linear head '{name}' ({kind}, {mode} features; the mean of "
                f"{len(draws)} draws' heads, each at DP epsilon {first.stage.epsilon:.3g})",
            ),
            draws=drawn.stages[1:],
        )
        privacy = privacy_headline(ledger.summary(head_component(name)))
        rows.append(Row(model, e.repo_id, privacy, how, top1, tuple(draws)))
        print(
            f"    {model}: top-1 {top1:.4f} released (the draws' mean head), {Row.spread(draws)} "
            f"({mode}; {kind} head, each draw at epsilon {first.config.epsilon:.3f}; {privacy})",
            flush=True,
        )
        return right

    rows: list[Row] = []
    answers, loaded = {}, {e: load_encoder(folder[e]) for e in PUBLISHED}
    for e in PUBLISHED:
        choice = chosen[origin[e]]
        model = f"{e.label}: {e.name}"
        answers[e] = release(e, HEAD, choice.mode, choice.head, loaded[e], model, choice.describe())
    syn = loaded[SYN_VIP]  # raw pixels: its preprocessing, none of its weights
    raw = choose_features(
        cfg,
        {PIXELS: embed(syn, splits.selection, PIXELS, inputs=inputs)},
        splits.selection,
        private,
    )
    print(f"    raw pixels: {raw.shown()}", flush=True)
    note = raw.head_note()
    how = f"{describe(PIXELS)}{'; ' + note if note else ''}"
    pixels = release(
        SYN_VIP, PIXELS_HEAD, PIXELS, raw.head, syn, f"raw pixels: {SYN_VIP.name}", how
    )

    captioner = load_captioner(folder[DPCAP])
    losses = captioner.zero_shot(
        [splits.test.pil(i) for i in range(len(splits.test))], list(splits.classes)
    )
    zero_shot = chance_test(losses.argmin(1).numpy(), splits.test.labels)
    print(f"    {DPCAP.name} zero-shot: {zero_shot.describe()}", flush=True)
    if zero_shot.above_chance:
        rows.append(
            Row(
                f"DP-Cap zero-shot: {DPCAP.name}",
                DPCAP.repo_id,
                privacy_headline(captioner.encoder.privacy),
                f"caption loss of '{CAPTION_TEMPLATE}' per class name, no head; "
                + zero_shot.describe(),
                zero_shot.top1,
            )
        )
    against = [  # each DP-trained encoder against the published encoder it was trained from
        f"{e.name} - {prior.name}: {paired(answers[e], answers[prior]).describe()}"
        for e in PUBLISHED
        for prior in PUBLISHED
        if prior != e and folder[prior] == origin[e]
    ]
    baseline = [  # every encoder against raw pixels
        f"{e.name} - raw pixels: {paired(answers[e], pixels).describe()}" for e in PUBLISHED
    ]
    cards = [r.card() for r in rows]
    for e in PUBLISHED:
        update_repo(folder[e], comparison=cards)
        verify_repo(folder[e]).raise_for_problems()
    out.write_text(
        json.dumps(
            {"rows": cards, "against_prior": against, "against_pixels": baseline},
            indent=1,
            ensure_ascii=False,
        )
    )


def _duration(seconds: float) -> str:
    """``seconds`` as minutes:seconds to a tenth (59.96 s is 1:00.0, not 0:60.0)."""
    minutes, tenths = divmod(round(seconds * 10), 600)
    return f"{minutes}:{tenths / 10:04.1f}"


def _print_summary(cfg: MainJobConfig, comparison: dict[str, Any], seconds: float) -> None:
    """The comparison (every row a released repo's DP head, or zero-shot above chance), each
    DP-trained encoder's row against its prior's and every encoder's against raw pixels, and the
    job's wall time with the load average."""
    print(
        f"\nTop-1 on public Fashion-MNIST test records {cfg.select_size} to "
        f"{cfg.select_size + cfg.test_size - 1} (the first {cfg.select_size} chose feature modes); "
        f"every row a classifier released at epsilon <= {cfg.epsilon:g}, delta = {cfg.delta:g} "
        "(and its noise samplers' truncation delta, each row's privacy line says) on "
        f"the first {cfg.train_size} train records ({FASHION_MNIST_TRAIN}), composed on the "
        f"hub's page /datasets/{FASHION_MNIST_TRAIN}; each DP head drawn {cfg.head_draws} "
        "times from fresh secrets, all of them within that epsilon, their mean released:"
    )
    for r in comparison["rows"]:
        draws = f"  ({Row.spread(r['draws'])})" if "draws" in r else ""
        print(f"  {r['top1']:.4f}  {r['model']}{draws}\n          {r['privacy']}")
    print(
        "Each DP-trained encoder against its published prior, paired on the same records over "
        "every head draw (the SE from the records and from the draws' spread):"
    )
    for line in comparison["against_prior"]:
        print(f"  {line}")
    print("Each encoder against raw pixels (the same DP head on the preprocessed image), paired:")
    for line in comparison["against_pixels"]:
        print(f"  {line}")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"Job wall time {_duration(seconds)} (load average {load}).", flush=True)


def _signing_key(work: Path) -> Path:
    """The job's private signing key, kept in its work folder (made on the first run)."""
    private = work / "signing" / f"{JOB_USER}{PRIVATE_SUFFIX}"
    if not private.exists():
        create_key(private.parent, JOB_USER, overwrite=True)
    return private


def _sign(repo: Path, key: Path) -> None:
    """Sign ``repo`` with ``key`` unless that key's signature over it still holds (a new one
    would differ, and be published again)."""
    try:
        if verify_signature(repo, load_keys([key.with_suffix(PUBLIC_SUFFIX)])) is not None:
            return
    except SignatureError:  # stale (a probe or card update changed the files), or another key's
        pass
    sign_repo(repo, key)


def _file_digest(path: Path) -> str:
    """SHA-256 hex of a file's bytes (a step's input stamp)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _start_server(cfg: MainJobConfig, token: str, trusted_key: Path) -> subprocess.Popen[bytes]:
    with socket.socket() as s:
        if s.connect_ex((cfg.host, cfg.port)) == 0:
            raise StepFailed(
                f"port {cfg.port} on {cfg.host} is in use: stop what holds it, or run "
                "`vip-hub run --port N`"
            )
    # the job's own user, a member of the organisation it publishes to
    env = {
        **os.environ,
        "VIP_HUB_AUTH__TOKENS": f"{JOB_USER}:write:{token}",
        "VIP_HUB_AUTH__ORGS": json.dumps({DEFAULT_ORG: [JOB_USER]}),
        "VIP_HUB_HUB__TRUSTED_KEYS": str(trusted_key),
    }  # the hub accepts what the job signed
    cmd = [
        sys.executable,
        "-m",
        "vip_hub.cli.main",
        "serve",
        "--store",
        cfg.store,
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        # publishing alone (--no-serve) needs the hub, not the models: no torch in the server
        *([] if cfg.serve else ["--no-inference"]),
    ]
    print(f"[*] starting the server: {' '.join(cmd[2:])}", flush=True)
    server = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise StepFailed(
                f"the server exited with status {server.returncode} before it was ready"
            )
        try:
            with urllib.request.urlopen(f"http://{cfg.host}:{cfg.port}/healthz", timeout=2):
                return server
        except OSError:
            time.sleep(0.3)
    server.kill()
    raise StepFailed("the server did not answer /healthz within 120 s")


def _print_usage(endpoint: str, test: Path) -> None:
    sample = min(test.glob("*/*.png"), default=None)
    image = f"$(base64 -w0 '{sample}')" if sample else "<base64 PNG>"
    models = "\n".join(f"                {endpoint}/{e.repo_id}   {e.label}" for e in PUBLISHED)
    json_header = "-H 'Content-Type: application/json'"
    timm = f'm = timm.create_model("hf-hub:{VIP.repo_id}", pretrained=True)'
    print(
        f"""
vip-hub is up.

  Web page      {endpoint}/
                (each model page shows its guarantee, its audit and the comparison)
{models}

  Embeddings    curl -s {endpoint}/v1/embeddings {json_header} \\
                  -d '{{"model": "{VIP.repo_id}", "input": ["'{image}'"], \\
                       "pooling": "avg"}}'

  Classify      curl -s {endpoint}/v1/classify {json_header} \\
                  -d '{{"model": "{LOGIT_DP.repo_id}", "head": "{HEAD}", \\
                       "input": ["'{image}'"], "top_k": 3}}'

  Caption       curl -s {endpoint}/v1/captions {json_header} \\
                  -d '{{"model": "{DPCAP.repo_id}", "input": ["'{image}'"], "max_tokens": 12}}'

  timm          HF_ENDPOINT={endpoint} python -c 'import timm; {timm}; print(m)'
""",
        flush=True,
    )
