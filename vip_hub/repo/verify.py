"""``vip-hub verify``: check a released repo's privacy claims and its files.

A repo verifies when
- its three ledger copies (the ledger file, the weights' metadata, the card's front
  matter) are valid and equal;
- its paths are safe, alone and together (``vip_hub.paths``), and every file is of a kind the
  allow list names and wholly that kind, parsed (``vip_hub.repo.content``);
- every file the ledger lists has the digest it lists, and no weights file is unlisted;
- every weights file's tensors hold finite values alone (no NaN, no infinity: the importer
  refuses them by the same rule, ``artifacts.nonfinite_count``);
- the timm configuration and the weights agree on the architecture and on every tensor's name
  and shape (``models.encoders.encoder_shapes``), and it names no other source for the weights;
- the card's tags claim of the training data (``differential-privacy``, ``no-private-data``)
  what the ledger gives;
- every head's weights metadata, which its loader reads and the digest leaves out, agrees with
  its labels file, its tensor's shape and the width the configuration gives its feature mode;
- every DP stage's sensitivity is its mechanism's and its noise is sigma times it (neither
  below: an understated sensitivity or noise overstates the noise multiplier);
- every DP stage's noise support c is a sampler vip-hub knows, and its truncation delta what
  (sigma, q, T, c, d) give;
- every DP stage names the tensors its noise went to (d is their elements and the canaries'),
  and each named in a weights file this repo carries is in that file with that many elements
  (tensors declared unreleased, or released in a file this repo does not carry, are taken as
  declared);
- no DP stage claims less epsilon than its accountant gives for its parameters, its two
  reference figures are what the other accountants give, and no guarantee claims less than
  the composition of its stages;
- every audit records one result per guess count of its canaries' grid (``guess_grid``), its
  lower bound is what those counts give, its ceiling what its canaries,
  beta and delta give, and the bound its counts give does not exceed the accountants' epsilon
  at the audit's delta (a lower bound above an upper bound is a bug).

Each comparison has a direction. An upper bound (an epsilon, a delta, a sensitivity, the
noise) may be recorded above its recomputation (conservative; a reference figure or an audit's
accountant epsilon by at most ``RELATIVE_TOLERANCE`` and the stored rounding up, a sensitivity
or the noise, records of what ran, by at most that rounding), never below
it by more than the recomputation's floating-point noise (``NUMERICAL_TOLERANCE``). An audit's
lower bound and its ceiling the reverse. A rule between two figures (an audit's bound against
the accountants') is checked on their recomputations, not on what the ledger records.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml

from ..errors import (
    AccountingError,
    AuditError,
    ClaimTooLowError,
    ConfigError,
    LedgerError,
    MissingInputError,
    RepoFormatError,
    TamperedFileError,
    UnsafePathError,
    VerificationError,
)
from ..models.encoders import EncoderSpec, encoder_shapes
from ..models.features import PIXELS, SpatialMode, pixel_width
from ..paths import tree_path_problems, validate_relpath
from ..privacy.accounting import (
    NOISE_SAMPLERS,
    Accountant,
    composed_epsilon,
    noise_sampler,
    truncation_delta,
)
from ..privacy.audit import bound_over_grid, ceiling, guess_grid
from ..privacy.ledger import EPSILON_DECIMALS, DPStage, PrivacyLedger, truncated
from ..privacy.sensitivity import ROUNDING_TERMS, sample_bound, sensitivity
from ..repo_format import (
    CARD_FILE,
    CONFIG_BLOCK,
    CONFIG_DECODERS,
    CONFIG_FILE,
    HEAD_LABELS,
    HEAD_METRICS,
    LEDGER_FILE,
    MAE_DECODER_FILE,
    META_ARCH,
    META_DECODER,
    META_IN_FEATURES,
    META_LABELS,
    META_LEDGER,
    META_POOLING,
    METRICS_POOLING,
    REQUIRED_FILES,
    TEXT_DECODER_FILE,
    WEIGHTS_FILE,
    FrontMatterLimits,
    head_file,
    head_folders,
    heads_in,
    is_weights_file,
)
from .artifacts import (
    bytes_sha256,
    digest_file,
    header_metadata,
    header_tensors,
    loaded_tensors_digest,
    nonfinite_in_file,
    read_safetensors_header,
    read_safetensors_metadata,
)
from .card import card_ledger, card_prose_problem, card_tags_problem, load_card
from .content import content_problem, weight_sources

if TYPE_CHECKING:
    import torch
    from huggingface_hub import ModelCardData

__all__ = [
    "NUMERICAL_TOLERANCE",
    "Problem",
    "RELATIVE_TOLERANCE",
    "VerificationReport",
    "check_loaded_decoder_config",
    "check_loaded_tensors",
    "is_hidden",
    "mode_widths",
    "repo_files",
    "verified_bytes",
    "verify_repo",
]

RELATIVE_TOLERANCE = 1e-4
"""How far (a fraction, plus the stored rounding) a recorded figure may stray from its
recomputation in its conservative direction alone: an upper bound above it, a lower bound below
it. A claim itself (a stage's epsilon, a guarantee's, a truncation delta) may be stated any
amount above."""
NUMERICAL_TOLERANCE = 1e-9
"""How far (a fraction) a figure may stray from its recomputation in the other direction, the
one that would understate privacy loss (an upper bound below it, a lower bound above it): the
recomputation's floating-point noise alone. The accountants are deterministic on one machine:
measured here, a recomputation repeats bit for bit in one setting; PRV differs by up to about
3e-15 (relative) between one thread and many (its FFTs); a delta one ulp off (a guarantee's
delta less its truncation deltas) moves RDP, PRV and PLD by under 2e-16. 1e-9 leaves six
orders of magnitude for other machines and library builds, and stays a thousand times below
the stored rounding (1e-6) for an epsilon of order 1, which an export's rounding up
(``round_up``) covers anyway."""
_ROUNDING = 10.0**-EPSILON_DECIMALS


@dataclass(frozen=True)
class Problem:
    """One failed check: ``where`` names the file, stage or field; ``kind`` the error class."""

    where: str
    message: str
    kind: type[VerificationError] = VerificationError

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class VerificationReport:
    """What was checked, what failed, and the ledger (when one could be read)."""

    ledger: PrivacyLedger | None = None
    problems: list[Problem] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    recomputed: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    """What verifies but a reader must know (an epsilon that assumes sampling the run did not
    use)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(
        self, where: str, message: str, kind: type[VerificationError] = VerificationError
    ) -> None:
        self.problems.append(Problem(where, message, kind))

    def overclaims(self, where: str, message: str) -> None:
        """Record a privacy claim the ledger's own parameters do not support."""
        self.fail(where, message, ClaimTooLowError)

    def raise_for_problems(self) -> VerificationReport:
        """Raise the first problem's error class (listing every problem) unless the repo
        verifies."""
        if self.problems:
            raise self.problems[0].kind(self.problems)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The JSON form ``vip-hub verify --json`` prints."""
        return {
            "ok": self.ok,
            "problems": [
                {"where": p.where, "message": p.message, "kind": p.kind.__name__}
                for p in self.problems
            ],
            "checks": self.checks,
            "recomputed": self.recomputed,
            "warnings": self.warnings,
        }


def is_hidden(rel: str) -> bool:
    """Whether the repo path ``rel`` has a hidden segment (``GITATTRIBUTES_FILE``, ``.cache/x``): a
    file ``repo_files`` skips, so that neither a folder's verify nor any signature covers it."""
    return any(segment.startswith(".") for segment in rel.split("/"))


def repo_files(folder: str | os.PathLike[str]) -> dict[str, Path]:
    """Map the repo path of every file under ``folder`` (hidden entries skipped: ``is_hidden``)
    to the file; UnsafePathError for a link to a folder, which would be read but neither verified
    nor signed."""
    root = Path(folder)
    if not root.is_dir():
        raise MissingInputError(f"{root} is not a directory")
    out = {}
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))
        for name in dirnames:  # os.walk lists a folder link but does not enter it
            if os.path.islink(p := Path(dirpath, name)):
                raise UnsafePathError(
                    f"{p.relative_to(root).as_posix()}: a link to a folder: loaders would read "
                    "its files, which verify and signatures do not see; copy the files instead"
                )
        for name in names:
            if not is_hidden(name):
                p = Path(dirpath, name)
                out[rel := p.relative_to(root).as_posix()] = p
                _check_regular(p, rel)
    return out


def _check_regular(path: Path, rel: str) -> None:
    """UnsafePathError for an entry that is not a regular file once links are followed: a link
    that leads nowhere or loops, a FIFO (reading one waits for a writer forever), a socket or a
    device."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise UnsafePathError(f"{rel}: a link that leads to no file ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise UnsafePathError(
            f"{rel}: not a regular file (a FIFO, socket or device): a repo holds files only"
        )


def verify_repo(
    repo: str | os.PathLike[str] | Mapping[str, Path],
    *,
    check_accounting: bool = True,
    front_matter: FrontMatterLimits | None = None,
) -> VerificationReport:
    """Verify a repo folder, or a mapping of repo paths to local files (e.g. a hub commit); the
    card's front matter and every YAML file are read within ``front_matter`` (default:
    ``FrontMatterLimits()``)."""
    files = dict(repo) if isinstance(repo, Mapping) else repo_files(repo)
    report = VerificationReport()
    _check_paths(files, report, front_matter)
    for name in REQUIRED_FILES:
        if name not in files:
            report.fail(name, "missing: every released repo carries it")
    card = _read_card(files[CARD_FILE], front_matter) if CARD_FILE in files else None
    ledger = _compare_copies(_ledger_copies(files, card, report), report)
    if ledger is None:
        return report
    report.ledger = ledger
    _check_artifacts(files, ledger, report)
    _check_finite(files, report)
    _check_components(files, ledger, report)
    config = _check_config(files, report)
    _check_heads(files, config, report)
    _check_decoders(files, config, report)
    _check_mechanisms(ledger, report)
    _check_noised(files, ledger, report)
    if card is not None:
        _check_card(card, ledger, report)
    if check_accounting:
        _check_accounting(ledger, report)
        _check_audits(ledger, report)
    return report


def check_loaded_tensors(
    ledger: PrivacyLedger, rel: str, path: Path, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Raise TamperedFileError unless ``tensors``, loaded from the repo file ``rel`` at ``path``
    after the repo verified, are the ones the verified ``ledger``'s digest of ``rel`` binds."""
    claimed = ledger.artifacts.get(rel)
    try:
        actual = loaded_tensors_digest(tensors, read_safetensors_header(path)[0])
    except (RepoFormatError, OSError):
        actual = None
    if claimed is None or actual != claimed:
        _changed(
            rel, "the loaded tensors", actual or "none: a tensor missing or not as stored", claimed
        )


def check_loaded_decoder_config(
    config: Mapping[str, Any], rel: str, loaded: Mapping[str, Any]
) -> None:
    """Raise TamperedFileError unless ``loaded``, the configuration read from the decoder file
    ``rel``'s metadata after the repo verified, is the one its verified ``config`` binds."""
    if not _same_json(loaded, _bound_decoders(config).get(rel)):
        raise TamperedFileError(
            [
                Problem(
                    rel,
                    f"changed after verification: its configuration is not the one "
                    f"{CONFIG_FILE} binds",
                    TamperedFileError,
                )
            ]
        )


def verified_bytes(ledger: PrivacyLedger, rel: str, path: Path) -> bytes:
    """The bytes of the repo file ``rel`` at ``path``, read once after the repo verified; a
    TamperedFileError unless they are the ones the verified ``ledger``'s digest of ``rel`` binds."""
    try:
        data: bytes | None = path.read_bytes()
    except OSError:
        data = None
    actual = None if data is None else bytes_sha256(data)
    if data is None or actual != ledger.artifacts.get(rel):
        _changed(rel, "its bytes", actual or "none: unreadable", ledger.artifacts.get(rel))
    return data


def _changed(rel: str, what: str, actual: str, claimed: str | None) -> NoReturn:
    raise TamperedFileError(
        [
            Problem(
                rel,
                f"changed after verification: {what} are not those the ledger binds "
                f"(digest {actual}, ledger says {claimed})",
                TamperedFileError,
            )
        ]
    )


def _check_paths(
    files: Mapping[str, Path], report: VerificationReport, yaml_limits: FrontMatterLimits | None
) -> None:
    for rel, path in files.items():
        try:
            validate_relpath(rel)
        except RepoFormatError as e:
            report.fail(rel, str(e))
            continue
        if problem := content_problem(rel, path, yaml_limits):
            report.fail(rel, problem, TamperedFileError)
    for problem in tree_path_problems(files):
        report.fail("paths", problem)
    report.checks.append("paths and content")


@dataclass(frozen=True)
class _Card:
    """The card as read once for every check of it: its text (None where it is not UTF-8) and
    its front matter parsed (``load_card``), or why that cannot be done."""

    text: str | None
    parsed: ModelCardData | None
    unreadable: str = ""

    def ledger_copy(self) -> PrivacyLedger:
        """Its front matter's ledger copy (``card_ledger``); a RepoFormatError where it has no
        front matter that can be read."""
        if self.parsed is None:
            raise RepoFormatError(self.unreadable)
        return card_ledger(self.parsed)


def _read_card(path: Path, front_matter: FrontMatterLimits | None) -> _Card:
    """The card at ``path``, its front matter read within ``front_matter``."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        return _Card(None, None, str(e))
    try:
        return _Card(text, load_card(text, limits=front_matter))
    except yaml.YAMLError as e:
        return _Card(
            text, None, f"{CARD_FILE}: front matter is not valid YAML ({' '.join(str(e).split())})"
        )
    except RepoFormatError as e:
        return _Card(text, None, str(e))


def _ledger_copies(
    files: Mapping[str, Path], card: _Card | None, report: VerificationReport
) -> dict[str, PrivacyLedger]:
    readers: dict[str, Callable[[Path], PrivacyLedger]] = {
        LEDGER_FILE: lambda p: PrivacyLedger.parse(p.read_bytes()),
        WEIGHTS_FILE: _weights_copy,
    }
    if card is not None:
        readers[CARD_FILE] = lambda _: card.ledger_copy()
    copies = {}
    for name, read in readers.items():
        if name not in files:
            continue
        try:
            copies[name] = read(files[name])
        except (LedgerError, RepoFormatError, UnicodeDecodeError) as e:
            report.fail(name, f"ledger copy unreadable: {e}")
    report.checks.append("ledger copies parsed")
    return copies


def _weights_copy(path: Path) -> PrivacyLedger:
    text = read_safetensors_metadata(path).get(META_LEDGER)
    if text is None:
        raise LedgerError([f"{WEIGHTS_FILE}: metadata has no {META_LEDGER} entry"])
    return PrivacyLedger.parse(text)


def _compare_copies(
    copies: dict[str, PrivacyLedger], report: VerificationReport
) -> PrivacyLedger | None:
    """Compare every copy with the first readable one (the ledger file first); return it."""
    if not copies:
        return None
    ref_name, reference = next(iter(copies.items()))
    for name, other in copies.items():
        if other != reference:
            where, a, b = _first_difference(reference.to_dict(), other.to_dict())
            report.fail(
                name,
                f"its ledger copy disagrees with {ref_name} at {where or 'top level'}: "
                f"{json.dumps(b)} vs {json.dumps(a)}",
                TamperedFileError,
            )
    report.checks.append("ledger copies equal")
    return reference


def _first_difference(a: Any, b: Any, where: str = "") -> tuple[str, Any, Any]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{where}.{k}".lstrip("."))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{where}.{i}".lstrip("."))
    return where, a, b


def _check_card(card: _Card, ledger: PrivacyLedger, report: VerificationReport) -> None:
    """The card's tags claim of its training data what the ledger gives (the hub answers a
    model's tags from them), and its text states the ledger's guarantee and no other
    (``card_prose_problem``); a card that cannot be read, its ledger copy's check names."""
    if card.text is None:
        return
    if card.parsed is not None and (problem := card_tags_problem(card.parsed, ledger)):
        report.fail(CARD_FILE, problem, TamperedFileError)
    if problem := card_prose_problem(card.text, ledger, card.parsed):
        report.fail(CARD_FILE, problem, TamperedFileError)
    report.checks.append("card tags and text follow the ledger")


def _check_artifacts(
    files: Mapping[str, Path], ledger: PrivacyLedger, report: VerificationReport
) -> None:
    for rel, claimed in ledger.artifacts.items():
        if rel not in files:
            report.fail(
                rel, "listed in the ledger's artifacts but missing from the repo", TamperedFileError
            )
            continue
        try:
            actual = digest_file(files[rel], rel)
        except (RepoFormatError, OSError) as e:
            report.fail(rel, f"cannot be digested: {e}", TamperedFileError)
            continue
        if actual != claimed:
            report.fail(
                rel,
                f"content changed since export (digest {actual}, ledger says {claimed})",
                TamperedFileError,
            )
    for rel in files:
        if (is_weights_file(rel) or rel == CONFIG_FILE) and rel not in ledger.artifacts:
            report.fail(
                rel,
                "not listed in the ledger's artifacts: its provenance is unknown",
                TamperedFileError,
            )
    report.checks.append("file digests")


def _check_finite(files: Mapping[str, Path], report: VerificationReport) -> None:
    """Every weights file holds finite values alone: NaN or an infinity in released weights
    would be served as embeddings, labels and captions."""
    for rel, path in files.items():
        if not is_weights_file(rel):
            continue
        try:
            problem = nonfinite_in_file(path)
        except (RepoFormatError, OSError):
            continue  # unreadable: the digest and content checks name it
        if problem is not None:
            report.fail(rel, f"{problem}: it would serve non-finite outputs")
    report.checks.append("weights finite")


def _check_components(
    files: Mapping[str, Path], ledger: PrivacyLedger, report: VerificationReport
) -> None:
    """Every head folder has a stage of its own (else it would inherit the encoder's summary);
    every stage accounted under an assumption it did not meet is reported as a warning."""
    components = set(ledger.components())
    for folder in head_folders(files):
        if folder not in components:
            report.fail(
                f"{folder}/",
                "has files but no ledger stage (DP or non-private) of its own: "
                "what trained it, on which data, is unknown",
            )
    for stage in ledger.dp_stages():
        if stage.sampling != "poisson":
            report.warnings.append(
                f"stages.{stage.name}: accounted as Poisson-sampled but trained with "
                f"{stage.sampling} sampling: its ε is as reported, assuming Poisson sampling"
            )
    report.checks.append("every component has its stages")


def _check_config(files: Mapping[str, Path], report: VerificationReport) -> dict[str, Any]:
    """The timm configuration checked against the weights; returned ({} if unreadable)."""
    if CONFIG_FILE not in files or WEIGHTS_FILE not in files:
        return {}
    try:
        config = json.loads(files[CONFIG_FILE].read_bytes())
    except (ValueError, OSError, RecursionError) as e:
        report.fail(CONFIG_FILE, f"unreadable: {e}")
        return {}
    try:  # a broken header is the weights check's to name, not the configuration's
        header = read_safetensors_header(files[WEIGHTS_FILE])[0]
        arch = header_metadata(header).get(META_ARCH)
    except (ValueError, OSError, RecursionError):
        return {}
    for key in weight_sources(config) if isinstance(config, dict) else []:
        report.fail(
            key,
            f"would make timm load weights from elsewhere than the verified {WEIGHTS_FILE}",
            TamperedFileError,
        )
    if not isinstance(config, dict) or "architecture" not in config:
        report.fail(CONFIG_FILE, "has no 'architecture' entry (timm needs one)")
    elif not isinstance(block := config.get(CONFIG_BLOCK), dict) or block.get("arch") != arch:
        report.fail(
            CONFIG_FILE, f"{CONFIG_BLOCK}.arch disagrees with {WEIGHTS_FILE} metadata ({arch!r})"
        )
    else:
        try:  # what timm builds from it (plain timm reads model_args): the arch's model
            spec = EncoderSpec.from_config(config)
        except (ConfigError, RepoFormatError) as e:
            report.fail(CONFIG_FILE, str(e).removeprefix(f"{CONFIG_FILE}: "))
        else:
            if problem := _tensors_problem(spec, header):
                report.fail(WEIGHTS_FILE, problem)
        if problem := _block_problem(block, header):
            report.fail(CONFIG_FILE, problem)
    report.checks.append("config matches weights")
    return config if isinstance(config, dict) else {}


def _tensors_problem(spec: EncoderSpec, header: Mapping[str, Any]) -> str | None:
    """How the weights' tensors (their safetensors ``header``) differ by name or shape from those
    of the model the configuration builds (timm's load would fail), naming the first of each."""
    want = encoder_shapes(spec)
    have = {k: tuple(t["shape"]) for k, t in header_tensors(header).items()}
    shapes = [
        f"{k} {list(v)} (expected {list(want[k])})" for k, v in have.items() if v != want.get(k, v)
    ]
    parts = [
        f"{what}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
        for what, names in (
            ("missing", sorted(want.keys() - have.keys())),
            ("unexpected", sorted(have.keys() - want.keys())),
            ("wrong shape", shapes),
        )
        if names
    ]
    if not parts:
        return None
    return f"its tensors are not those of the {spec.arch} {CONFIG_FILE} builds ({'; '.join(parts)})"


def _block_problem(block: Mapping[str, Any], header: Mapping[str, Any]) -> str | None:
    """Why the configuration's own block states what the weights (their safetensors ``header``)
    do not, or in a form its readers (the hub's pages, the service's model list) cannot take."""
    count = sum(math.prod(t["shape"]) for t in header_tensors(header).values())
    params = block.get("num_params")
    if type(params) is not int or params != count:
        shown = reprlib.repr(params)
        return f"{CONFIG_BLOCK}.num_params is {shown}, not the {count} of {WEIGHTS_FILE}"
    dims = block.get("feature_dims")
    if not isinstance(dims, dict) or not dims:
        shown = reprlib.repr(dims)
        return f"{CONFIG_BLOCK}.feature_dims is {shown}, not an object of feature modes"
    for mode, width in dims.items():
        try:
            SpatialMode.parse(mode)  # None for a mode not spatial
        except ConfigError as e:
            return f"{CONFIG_BLOCK}.feature_dims: {e}"
        if type(width) is not int or width < 1:
            return (
                f"{CONFIG_BLOCK}.feature_dims gives {mode!r} the width "
                f"{reprlib.repr(width)}, not a positive integer"
            )
    return None


def _check_heads(
    files: Mapping[str, Path], config: Mapping[str, Any], report: VerificationReport
) -> None:
    """Each head as its loader reads it, from its weights' metadata (which the digest leaves out):
    its labels its labels file's, its feature mode its metrics file's, one label per row of its
    one matrix (the classifier), its inputs its feature mode's width in ``config`` (the timm
    configuration)."""
    widths = mode_widths(config)  # _check_config names a malformed feature_dims
    for name in heads_in(files):
        where, labels_file = head_file(name), head_file(name, HEAD_LABELS)
        metrics_file = head_file(name, HEAD_METRICS)
        try:
            header = read_safetensors_header(files[where])[0]
            meta = header_metadata(header)
            labels, pooling = json.loads(meta[META_LABELS]), meta[META_POOLING]
            inputs = int(meta[META_IN_FEATURES])
            ((matrix, shape),) = [
                (key, entry["shape"])
                for key, entry in header_tensors(header).items()
                if len(entry["shape"]) == 2
            ]
            listed = json.loads(files[labels_file].read_bytes()) if labels_file in files else None
            metrics = json.loads(files[metrics_file].read_bytes()) if metrics_file in files else {}
            bound = metrics.get(METRICS_POOLING) if isinstance(metrics, dict) else None
        except (KeyError, ValueError, OSError, RecursionError) as e:
            report.fail(where, f"not a readable head ({type(e).__name__}: {e})", TamperedFileError)
            continue
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            report.fail(where, f"its labels are {reprlib.repr(labels)}, not a list of class names")
        elif labels != listed:
            report.fail(where, f"its metadata's labels are not {labels_file}'s", TamperedFileError)
        elif pooling != bound:
            report.fail(
                where,
                f"its metadata's feature mode {pooling!r} is not {metrics_file}'s ({bound!r})",
                TamperedFileError,
            )
        elif shape != [len(labels), inputs]:
            report.fail(
                where,
                f"{matrix} has shape {shape}, not {len(labels)} labels by {inputs} inputs",
                TamperedFileError,
            )
        elif (width := widths.get(pooling)) != inputs:
            source = "pretrained_cfg.input_size" if pooling == PIXELS else "feature_dims"
            report.fail(
                where,
                f"reads {inputs} features of mode {pooling!r}, which {CONFIG_FILE}'s {source} "
                f"makes {width}",
                TamperedFileError,
            )
    report.checks.append("heads match their labels and features")


def mode_widths(config: Mapping[str, Any]) -> dict[str, int]:
    """The width of every feature mode a repo's timm configuration ``config`` offers: its
    ``feature_dims`` (the positive integers of it), then ``pixels`` by its input size where that
    is three integers (no configuration lists it)."""
    block = config.get(CONFIG_BLOCK)
    dims = block.get("feature_dims") if isinstance(block, dict) else None
    widths = {
        m: w
        for m, w in (dims if isinstance(dims, dict) else {}).items()
        if type(w) is int and w > 0
    }
    cfg = config.get("pretrained_cfg")
    size = cfg.get("input_size") if isinstance(cfg, dict) else None
    if isinstance(size, list) and len(size) == 3 and all(type(x) is int for x in size):
        widths[PIXELS] = pixel_width(size)
    return widths


def _same_json(a: Any, b: Any) -> bool:
    """Whether two JSON values are written alike (Python's ``==`` takes 96.0 for 96, 1 for true)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _bound_decoders(config: Mapping[str, Any]) -> Mapping[str, Any]:
    block = config.get(CONFIG_BLOCK)
    bound = block.get(CONFIG_DECODERS) if isinstance(block, dict) else None
    return bound if isinstance(bound, dict) else {}


def _check_decoders(
    files: Mapping[str, Path], config: Mapping[str, Any], report: VerificationReport
) -> None:
    """Each decoder file's configuration (its metadata, which the digest leaves out: a text
    decoder's heads and token ids shape every caption) is the one ``config`` binds by its name."""
    bound = _bound_decoders(config)
    for rel in (MAE_DECODER_FILE, TEXT_DECODER_FILE):
        if rel not in files:
            continue
        try:
            meta = json.loads(read_safetensors_metadata(files[rel])[META_DECODER])
        except (KeyError, ValueError, OSError, RecursionError) as e:
            report.fail(
                rel, f"no readable configuration ({type(e).__name__}: {e})", TamperedFileError
            )
            continue
        if not _same_json(meta, bound.get(rel)):
            report.fail(
                rel,
                f"its metadata's configuration is not the one {CONFIG_FILE}'s "
                f"{CONFIG_BLOCK}.{CONFIG_DECODERS} binds",
                TamperedFileError,
            )
    report.checks.append("decoders match their configuration")


def _check_mechanisms(ledger: PrivacyLedger, report: VerificationReport) -> None:
    for stage in ledger.dp_stages():
        where = f"stage {stage.name!r}"
        assert stage.dataset.size is not None  # DPStage's validator requires it
        try:
            expected = sensitivity(stage.mechanism, stage.clipping_norm, stage.mechanism_params)
            terms = stage.mechanism_params.get(ROUNDING_TERMS)
            if terms is not None and terms < sample_bound(stage.dataset.size, stage.sample_rate):
                raise AccountingError(
                    f"{ROUNDING_TERMS} {terms} is below the {stage.dataset.size} examples' sample "
                    f"bound {sample_bound(stage.dataset.size, stage.sample_rate)} at q "
                    f"{stage.sample_rate:g}: the allowance covers smaller sums than the steps held"
                )
        except AccountingError as e:
            report.overclaims(where, str(e))
            continue
        if _off_upper(stage.sensitivity, expected, 1e-9):
            report.overclaims(
                where,
                f"claims sensitivity {stage.sensitivity:.6g} but {stage.mechanism} with "
                f"{stage.mechanism_params or 'C'} = {stage.clipping_norm:g} has {expected:.6g}",
            )
        noise = stage.noise_multiplier * stage.sensitivity
        # sigma times the stated sensitivity, never below it (the check above holds that one to
        # the mechanism's, so an understated sensitivity is named once, there)
        if _off_upper(stage.noise_std, noise, 1e-9):
            report.overclaims(
                where, f"noise std {stage.noise_std:.6g} is not sigma * sensitivity = {noise:.6g}"
            )
    report.checks.append("sensitivity and noise")


def _check_noised(
    files: Mapping[str, Path], ledger: PrivacyLedger, report: VerificationReport
) -> None:
    """Each DP stage's noised dimension d against the tensors it names: recorded (the ledger's
    model checks that they and the canaries sum to d), and each in a weights file of this repo
    with the elements the stage counts."""
    headers: dict[str, dict[str, Any]] = {}
    for stage in ledger.dp_stages():
        where = f"stage {stage.name!r}"
        if stage.noised_tensors is None:
            report.overclaims(
                where,
                f"records a noised dimension of {stage.noised_dimension} without the tensors it "
                "counts (noised_tensors), so d and its truncation delta cannot be checked: export "
                "the repo again with this vip-hub",
            )
            continue
        for key, count in stage.noised_tensors.items():
            file, _, tensor = key.partition(":")
            if not is_weights_file(file) or file not in files:
                continue  # declared: not released, or released in a file this repo lacks
            if file not in headers:
                try:
                    headers[file] = read_safetensors_header(files[file])[0]
                except (RepoFormatError, OSError) as e:
                    report.fail(file, f"unreadable: {e}", TamperedFileError)
                    headers[file] = {}
            shape = (header_tensors(headers[file]).get(tensor) or {}).get("shape")
            if shape is None:
                report.overclaims(where, f"counts the noised tensor {key}, which {file} lacks")
            elif math.prod(shape) != count:
                report.overclaims(
                    where,
                    f"counts {count} noised elements in {key}, which has {math.prod(shape)} "
                    f"(shape {shape})",
                )
    report.checks.append("noised tensors")


def _check_truncation(stage: DPStage, report: VerificationReport) -> None:
    """The stage's sampler is one vip-hub knows, and the delta its truncation adds, recomputed
    from (sigma, q, T, c, d)."""
    if noise_sampler(stage.noise_support) is None:
        known = ", ".join(f"{name} {c:.6g}" for name, c in NOISE_SAMPLERS.items())
        report.overclaims(
            f"stage {stage.name!r}",
            f"records noise support c = {stage.noise_support:.6g} sigma, which is no noise "
            f"sampler vip-hub knows ({known})",
        )
    try:
        actual = truncation_delta(
            stage.noise_multiplier,
            stage.sample_rate,
            stage.steps,
            stage.noise_support,
            stage.noised_dimension,
        )
    except (ValueError, ArithmeticError):  # a support far below any sampler's: named above
        return
    report.recomputed[f"{stage.name}/truncation_delta"] = actual
    if _understated(stage.truncation_delta, actual):
        report.overclaims(
            f"stage {stage.name!r}",
            f"records a truncation delta of {stage.truncation_delta:.6g} but noise truncated at "
            f"{stage.noise_support:g} sigma on {stage.noised_dimension} coordinates adds "
            f"{actual:.6g}",
        )


def _check_accounting(ledger: PrivacyLedger, report: VerificationReport) -> None:
    for stage in ledger.dp_stages():
        if stage.weak_delta:
            report.warnings.append(
                f"stage {stage.name!r}: weak delta {stage.delta:.3g} for n = "
                f"{stage.dataset.size:,}, above 1/(10n): its epsilon says little"
            )
        _check_truncation(stage, report)
        for accountant, claimed in stage.epsilons.items():
            actual = _recompute(
                report, f"stage {stage.name!r}", [stage.mechanism_tuple], stage.delta, accountant
            )
            if actual is None:
                continue
            report.recomputed[f"{stage.name}/{accountant.value}"] = actual
            params = (
                f"sigma={stage.noise_multiplier:g}, q={stage.sample_rate:.6g}, "
                f"steps={stage.steps}, delta={stage.delta:.6g}"
            )
            if accountant is stage.accountant:  # the claim: never below what it recomputes to
                wrong = _understated(claimed, actual)
                what = f"claims epsilon {claimed:.6g} but the {accountant.value} accountant gives"
            else:  # a reference figure: what that accountant gives, never below it
                wrong = _off_upper(claimed, actual, RELATIVE_TOLERANCE)
                what = (
                    f"reference epsilon {claimed:.6g} ({accountant.value}) is not what that "
                    "accountant gives:"
                )
            if wrong:
                report.overclaims(f"stage {stage.name!r}", f"{what} {actual:.6g} for {params}")
    for g in ledger.guarantees:
        stages: list[Any] = [ledger.stage(name) for name in g.stages]
        history = [s.mechanism_tuple for s in stages]
        accounted = g.delta - truncated(stages)  # the guarantee's delta includes the truncation
        if accounted <= 0:
            report.overclaims(
                f"guarantee {g.dataset!r}",
                f"delta {g.delta:.6g} does not cover its stages' truncation deltas",
            )
            continue
        actual = _recompute(report, f"guarantee {g.dataset!r}", history, accounted, g.accountant)
        if actual is None:
            continue
        report.recomputed[f"guarantee:{g.dataset}"] = actual
        if _understated(g.epsilon, actual):
            report.overclaims(
                f"guarantee {g.dataset!r}",
                f"claims epsilon {g.epsilon:.6g} but composing stages {g.stages} gives "
                f"{actual:.6g}",
            )
    report.checks.append("epsilon recomputed (rdp, prv, pld)")


def _check_audits(ledger: PrivacyLedger, report: VerificationReport) -> None:
    for stage in ledger.dp_stages():
        audit = stage.audit
        if audit is None:
            continue
        where = f"stage {stage.name!r} audit"
        # beta is split over the grid fixed in advance: fewer or other counts inflate the bound
        counts = sorted(r.guesses for r in audit.results)
        if counts != guess_grid(audit.canaries):
            report.fail(
                where,
                f"records guess counts {counts}, not the grid {guess_grid(audit.canaries)} its "
                f"{audit.canaries} canaries fix in advance",
                AuditError,
            )
        bound = bound_over_grid(
            audit.canaries, [(r.guesses, r.correct) for r in audit.results], audit.beta, audit.delta
        )
        top = ceiling(audit.canaries, audit.beta, audit.delta)
        report.recomputed[f"{stage.name}/audit"] = bound
        report.recomputed[f"{stage.name}/audit-ceiling"] = top
        # a lower bound: never above what its counts give (an export rounds it down)
        if _off_lower(audit.epsilon_lower_bound, bound, RELATIVE_TOLERANCE):
            report.fail(
                where,
                f"records eps_lb {audit.epsilon_lower_bound:.6g} but its counts give {bound:.6g}",
                AuditError,
            )
        # never above (an overstated ceiling would say the audit could show a violation)
        if _off_lower(audit.ceiling, top, RELATIVE_TOLERANCE):
            report.fail(
                where,
                f"records a ceiling of {audit.ceiling:.6g} but {audit.canaries} canaries at beta "
                f"{audit.beta:g}, delta {audit.delta:g} give {top:.6g}",
                AuditError,
            )
        accounted = []
        for accountant, claimed in audit.accountant_epsilon.items():
            actual = _recompute(report, where, [stage.mechanism_tuple], audit.delta, accountant)
            if actual is None:
                continue
            accounted.append(actual)
            if _off_upper(claimed, actual, RELATIVE_TOLERANCE):  # an upper bound: never below
                report.fail(
                    where,
                    f"records {accountant.value} epsilon {claimed:.6g} at delta {audit.delta:g} "
                    f"but that accountant gives {actual:.6g}",
                    AuditError,
                )
        # the recomputed figures, not the records (each allowed its tolerance, which summed
        # let a bound pass up to about 3e-4 above the accountants')
        if accounted and bound > min(accounted):
            report.fail(
                where,
                f"the empirical lower bound eps >= {bound:.6g} its counts give exceeds the "
                f"accounted epsilon {min(accounted):.6g} at delta {audit.delta:g}: the training "
                "does not give the privacy it claims",
                AuditError,
            )
    report.checks.append("audits recomputed")


def _recompute(
    report: VerificationReport,
    where: str,
    history: list[tuple[float, float, int]],
    delta: float,
    accountant: Accountant,
) -> float | None:
    try:
        return composed_epsilon(history, delta, accountant)
    except AccountingError as e:
        report.overclaims(where, str(e))
        return None


def _understated(claimed: float, actual: float) -> bool:
    """An upper bound below its recomputation by more than the recomputation's noise; any bound
    is below a recomputation that overflowed (or is NaN)."""
    return not math.isfinite(actual) or claimed < actual - NUMERICAL_TOLERANCE * abs(actual)


def _overstated(claimed: float, actual: float) -> bool:
    """A lower bound above its recomputation by more than the recomputation's noise; a NaN
    recomputation confirms no bound."""
    return math.isnan(actual) or claimed > actual + NUMERICAL_TOLERANCE * abs(actual)


def _off_upper(claimed: float, actual: float, tolerance: float) -> bool:
    """A recorded upper bound that is not its recomputation: below it beyond the noise, or above
    it by more than ``tolerance`` (relative) and the stored rounding up."""
    return _understated(claimed, actual) or claimed - actual > tolerance * abs(actual) + _ROUNDING


def _off_lower(claimed: float, actual: float, tolerance: float) -> bool:
    """A recorded lower bound that is not its recomputation: above it beyond the noise, or below
    it by more than ``tolerance`` (relative) and the stored rounding down."""
    return _overstated(claimed, actual) or actual - claimed > tolerance * abs(actual) + _ROUNDING
