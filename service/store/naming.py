"""Validation of repo ids, revisions and file paths arriving from the network.

Anything that could reach outside the store (``..``, absolute paths, backslashes, control
characters, double percent-encoding, over-long names) is refused (InvalidRequest, a 400) naming it.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from vip_hub.paths import PERCENT_ESCAPE, UnsafePathError, validate_relpath

from .errors import InvalidRequest

__all__ = [
    "COMMIT_RE",
    "MAX_REVISION_LENGTH",
    "REPO_PART_PATTERN",
    "RESERVED_NAMESPACES",
    "REVISION_PATTERN",
    "decode_segment",
    "validate_namespace",
    "validate_path",
    "validate_repo_id",
    "validate_revision",
]

REPO_PART_PATTERN = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_-])?"
"""A namespace (user or organisation) or a repo name, unanchored (also in request schemas)."""
RESERVED_NAMESPACES = frozenset({"api", "datasets", "v1"})
"""Namespaces no repo is created in, nor a model page routed for: the service's own paths
(``/api/`` the hub protocol, ``/datasets/NAME`` a dataset's page, ``/v1/`` the inference API)."""
MAX_REVISION_LENGTH = 128
REVISION_PATTERN = rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{MAX_REVISION_LENGTH - 1}}}"
"""A branch, a tag or a commit id, unanchored."""
# \Z, not $: $ also matches before a final newline ("main\n")
_PART = re.compile(rf"^{REPO_PART_PATTERN}\Z")
_REVISION = re.compile(rf"^{REVISION_PATTERN}\Z")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}\Z")


def validate_namespace(part: str, what: str = "organisation") -> str:
    """``part`` if it is 1-96 letters, digits, '_', '.', '-' (no '..'), else 400: a namespace
    (user or organisation) or a repo name."""
    if not _PART.match(part) or ".." in part:
        raise InvalidRequest(
            f"invalid {what} {part!r}: use 1-96 letters, digits, '_', '.' or '-', "
            "starting and ending with a letter or digit"
        )
    return part


def validate_repo_id(org: str, name: str) -> str:
    """``org/name`` if both parts are valid names (``validate_namespace``), else 400."""
    return f"{validate_namespace(org)}/{validate_namespace(name, 'repo name')}"


def validate_revision(revision: str) -> str:
    """A branch, tag (letters, digits, '_', '.', '-') or 40-hex commit id, else 400."""
    if not _REVISION.match(revision) or ".." in revision:
        raise InvalidRequest(
            f"invalid revision {revision!r}: use a branch, a tag or a full commit id"
        )
    return revision


def validate_path(path: str) -> str:
    """A safe relative file path inside a repo, else 400 naming the problem."""
    try:
        return validate_relpath(path)
    except UnsafePathError as e:
        raise InvalidRequest(f"invalid path: {e}") from None


def decode_segment(raw: str) -> str:
    """Percent-decode one raw URL segment once; a still-encoded result is a trick: 400."""
    try:
        text = unquote(raw, errors="strict") if "%" in raw else raw
    except UnicodeDecodeError:
        raise InvalidRequest(f"URL segment {raw!r} is not valid UTF-8 once decoded") from None
    if PERCENT_ESCAPE.search(text):
        raise InvalidRequest(f"doubly percent-encoded URL segment {raw!r}")
    return text
