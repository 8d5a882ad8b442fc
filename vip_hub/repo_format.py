"""The released-encoder repo format: every file name, metadata key and name pattern, in one place.

A repo folder (or a hub commit's tree) holds::

    model.safetensors         encoder weights (timm keys); metadata: ledger, arch, format version
    config.json               what timm's hf-hub / local-dir loaders read, plus a vip_hub block
    privacy_ledger.json       the privacy ledger
    README.md                 the model card (its front matter carries the ledger too)
    mae_decoder.safetensors   optional (ViP): the MAE decoder, to initialise further training
    text_decoder.safetensors  optional (DP-Cap): the caption decoder; its config in the metadata
    vocab.txt                 optional (DP-Cap): the tokenizer's vocabulary
    *.png                     optional: training curves shown in the card
    heads/<name>/             optional linear-probe heads: head.safetensors, labels.json,
                              metrics.json
    model.sig                 optional: the trainer's signature over every other file
                              (vip_hub.repo.signing)

Every other module (writing, verifying, loading, the hub store, the inference API, the
pages) reads these names from here; see ``docs/architecture.md``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import ConfigError
from .paths import windows_problem

__all__ = [
    "CARD_FILE",
    "CARD_LEDGER_KEY",
    "COMPONENT_PATTERN",
    "CONFIG_DECODERS",
    "CONFIG_FILE",
    "CURVES_FILE",
    "DEFAULT_BRANCH",
    "ENCODER",
    "FORMAT_VERSION",
    "FrontMatterLimits",
    "GITATTRIBUTES_FILE",
    "HEADS_DIR",
    "HEAD_FOLDER_SHOWN",
    "HEAD_COMPONENT_PATTERN",
    "HEAD_LABELS",
    "HEAD_METRICS",
    "HEAD_WEIGHTS",
    "HEAD_WEIGHTS_GLOB",
    "LEDGER_FILE",
    "MAE_DECODER_FILE",
    "MANAGED_FILES",
    "METRICS_POOLING",
    "NAME_PATTERN",
    "REQUIRED_FILES",
    "SIGNATURE_FILE",
    "TEXT_DECODER_FILE",
    "VOCAB_FILE",
    "WEIGHTS_FILE",
    "WEIGHTS_SUFFIX",
    "check_name",
    "head_component",
    "head_file",
    "head_folders",
    "head_name_of",
    "heads_in",
    "is_weights_file",
]

FORMAT_VERSION = 1
DEFAULT_BRANCH = "main"
"""The branch a repo id without ``@revision`` means, everywhere (hub, clients, inference)."""

WEIGHTS_SUFFIX = ".safetensors"
"""Every file of tensors ends so (the weights, decoders and heads)."""
WEIGHTS_FILE = f"model{WEIGHTS_SUFFIX}"
CONFIG_FILE = "config.json"
LEDGER_FILE = "privacy_ledger.json"
CARD_FILE = "README.md"
CARD_LEDGER_KEY = "differential_privacy"
"""The key of the card's front matter that holds its ledger copy."""
CURVES_FILE = "training_curves.png"
"""A recipe's training curves (measured on public data), shown in the card."""
MAE_DECODER_FILE = f"mae_decoder{WEIGHTS_SUFFIX}"
TEXT_DECODER_FILE = f"text_decoder{WEIGHTS_SUFFIX}"
VOCAB_FILE = "vocab.txt"
SIGNATURE_FILE = "model.sig"
"""A Sigstore bundle over every other file; never listed in the ledger's artifacts (it is made after
them)."""
GITATTRIBUTES_FILE = ".gitattributes"
"""What a git clone or a hub adds for its LFS files: hidden, so never signed nor listed in the
ledger, and kept by a push that replaces the other files."""


@dataclass(frozen=True)
class FrontMatterLimits:
    """How much YAML a card's front matter, and each YAML file of a repo, may hold: ``max_bytes``
    of text, lists and mappings nested at most ``max_depth`` deep (a YAML loader recurses once per
    level), and no alias (``vip_hub.repo.card.yaml_problem``)."""

    max_bytes: int = 64 * 1024
    max_depth: int = 20


REQUIRED_FILES = (WEIGHTS_FILE, CONFIG_FILE, LEDGER_FILE, CARD_FILE)
MANAGED_FILES = (*REQUIRED_FILES, SIGNATURE_FILE)
"""Files only vip_hub writes (``update_repo`` refuses to replace them with given bytes)."""

# safetensors ``__metadata__`` keys
META_FORMAT = "vip_hub.format_version"
META_ARCH = "vip_hub.arch"
META_LEDGER = "vip_hub.privacy_ledger"
META_DECODER = "vip_hub.decoder"  # a decoder file's configuration (JSON)
META_POOLING = "vip_hub.pooling"  # a head's feature mode
META_IN_FEATURES = "vip_hub.in_features"
META_LABELS = "vip_hub.labels"

CONFIG_BLOCK = "vip_hub"
"""The key of config.json's own block (arch, num_params, feature_dims, family, decoders)."""
CONFIG_DECODERS = "decoders"
"""The key of that block binding each decoder file's configuration (its ``META_DECODER``, which
the tensors digest leaves out) by the file's name."""

ENCODER = "encoder"
"""The ledger component of the encoder weights; heads are ``heads/<name>``."""
HEADS_DIR = "heads"
HEAD_WEIGHTS = f"head{WEIGHTS_SUFFIX}"
HEAD_LABELS = "labels.json"
HEAD_METRICS = "metrics.json"
METRICS_POOLING = "pooling"
"""The key of a head's metrics file that binds its feature mode (its weights' ``META_POOLING``,
which the tensors digest leaves out, must equal it)."""

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
"""A head name (and a stage's component suffix)."""
_NAME = re.compile(rf"^{NAME_PATTERN}\Z")  # \Z: $ matches before a final newline too
_HEAD_COMPONENT = rf"{HEADS_DIR}/{NAME_PATTERN}"
HEAD_COMPONENT_PATTERN = rf"^{_HEAD_COMPONENT}$"
"""A head's ledger component (``head_component``)."""
COMPONENT_PATTERN = rf"^({ENCODER}|{_HEAD_COMPONENT})$"
HEAD_WEIGHTS_GLOB = f"{HEADS_DIR}/*/{HEAD_WEIGHTS}"
"""Every head's weights file in a repo folder (``Path.glob``)."""
HEAD_FOLDER_SHOWN = f"{HEADS_DIR}/<name>/"
"""A head's folder as help texts and field descriptions show it."""


def check_name(kind: str, name: str) -> str:
    """``name`` if it matches ``NAME_PATTERN`` (a head's, a signing key's), else a ConfigError
    naming the ``kind`` of name."""
    if not _NAME.match(name or ""):
        raise ConfigError(f"{kind} name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
    if problem := windows_problem(name):  # it names a folder or file in the repo
        raise ConfigError(f"{kind} name {name!r} {problem}")
    return name


def head_component(name: str) -> str:
    """The ledger component and folder of head ``name`` (``heads/<name>``)."""
    return f"{HEADS_DIR}/{check_name('head', name)}"


def head_file(name: str, file: str = HEAD_WEIGHTS) -> str:
    """The repo path of one of head ``name``'s files."""
    return f"{head_component(name)}/{file}"


def head_name_of(path: str) -> str | None:
    """The head whose weights live at repo path ``path``, else None."""
    parts = path.split("/")
    if (
        len(parts) == 3
        and parts[0] == HEADS_DIR
        and parts[2] == HEAD_WEIGHTS
        and _NAME.match(parts[1])
    ):
        return parts[1]
    return None


def head_folders(paths: Iterable[object]) -> list[str]:
    """The ``heads/<name>/`` folders (as components) holding any of the repo paths, sorted."""
    return sorted(
        {
            "/".join(parts[:2])
            for p in paths
            if len(parts := str(p).split("/")) > 2 and parts[0] == HEADS_DIR
        }
    )


def heads_in(paths: Iterable[object]) -> list[str]:
    """Names of the heads among repo paths (a tree's keys, a folder's files), sorted."""
    return sorted(name for p in paths if (name := head_name_of(str(p))) is not None)


def is_weights_file(path: str) -> bool:
    """Whether a repo path holds tensors (digested over its tensors, not its bytes); any case."""
    return path.lower().endswith(WEIGHTS_SUFFIX)
