"""What a released repo may carry: an allow list by name and by content together.

A file's kind comes from its name, and the file is accepted only when that kind's own parser
accepts all of its bytes, nothing before or after them (so no polyglot: a PNG with a zip
appended, a zip behind one junk byte):

- safetensors (``*.safetensors``): the safetensors library's header checks (its tensors cover
  the data section exactly);
- JSON (``*.json``, and ``model.sig``: a Sigstore bundle), YAML (``*.yaml``, ``*.yml``),
  Markdown (``*.md``: its front matter is YAML) and plain text (``*.txt`` such as the
  vocabulary, and ``.gitattributes``): UTF-8 with no control character but tab, line feed and
  carriage return, then the kind's parser; every YAML (a file, a front matter) first within the
  card's limits, with no alias (``vip_hub.repo.card.yaml_problem``; the hub's
  ``hub.max_front_matter_*``); every text file is also walked as the C unpickler would run it,
  and refused if that would import a module (``vip_hub.repo.pickles``: a
  protocol-0 pickle is plain ASCII);
- PNG, JPEG (``*.jpg``, ``*.jpeg``) and WebP: their chunk or segment structure, from the
  signature to the end marker on the file's last byte.

Every other kind is refused naming the file: code (``.py``), pickles and what hides them
(``.pkl``, ``.joblib``, ``.pt``, ``.bin``, ``.npy``), archives and compressed streams
(``.zip``, ``.tar``, ``.gz``), files without a suffix. Also here: the config.json keys that
would send timm elsewhere for the weights (a repo's verified ``model.safetensors`` is what
``timm.create_model("hf-hub:…", pretrained=True)`` loads).

``vip_hub.repo.verify`` applies both rules, so the hub (which verifies every commit) does too.
"""

from __future__ import annotations

import codecs
import json
import mmap
import os
import re
import struct
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from safetensors import SafetensorError, safe_open

from ..errors import RepoFormatError
from ..repo_format import CONFIG_FILE, SIGNATURE_FILE, FrontMatterLimits
from .card import front_matter_problem, load_card, yaml_problem
from .pickles import pickle_problem

__all__ = ["ALLOWED_KINDS", "WEIGHT_SOURCE_KEYS", "content_problem", "weight_sources"]

WEIGHT_SOURCE_KEYS = frozenset(
    {
        "source",
        "url",
        "file",
        "state_dict",
        "hf_hub_id",
        "hf_hub_filename",  # timm _resolve_pretrained_source
        "custom_load",  # timm load_pretrained: hands the file to the model's own loader
    }
)
"""pretrained_cfg keys timm (1.0: ``models/_builder.py``) reads to find where weights come from."""

_CHUNK = 1 << 20
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
"""Control characters plain text does not hold (tab, line feed and carriage return it may)."""
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
Check = Callable[[Path, FrontMatterLimits], str | None]
"""A kind's check of a file's content: why it is not that kind, or None."""


# ------------------------------------------------------------------------------ text kinds


def _plain_text(path: Path) -> str | None:
    """Why the file is not plain UTF-8 text (or is a pickle written as text), else None."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        offset = 0
        while True:
            chunk = f.read(_CHUNK)
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                return f"is not UTF-8 text (invalid byte near offset {offset + e.start})"
            if found := _CONTROL.search(text):
                return f"holds the control character {found.group()!r}: it is not plain text"
            if not chunk:
                break
            offset += len(chunk)
        if offset:  # a text is walked as the C unpickler would run it
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return pickle_problem(m)
    return None


def _parsed(
    parse: Callable[[str, FrontMatterLimits], object],
    what: str,
    within: Callable[[str, FrontMatterLimits], str | None] = lambda text, limits: None,
) -> Check:
    """A text kind: plain text, ``within`` the YAML limits where it holds YAML, that ``parse``
    accepts whole."""

    def check(path: Path, limits: FrontMatterLimits) -> str | None:
        if problem := _plain_text(path):
            return problem
        text = path.read_text(encoding="utf-8")
        if problem := within(text, limits):
            return problem
        try:
            parse(text, limits)
        except (ValueError, yaml.YAMLError, RepoFormatError, RecursionError) as e:
            return f"is not valid {what}: {' '.join(str(e).split())[:300]}"
        return None

    return check


def _bytes(check: Callable[[Path], str | None]) -> Check:
    """A kind that holds no YAML: its check, whatever the YAML limits."""
    return lambda path, limits: check(path)


# ---------------------------------------------------------------------------- binary kinds


def _safetensors(path: Path) -> str | None:
    try:
        with safe_open(path, framework="numpy"):  # the same header checks, without torch
            return None
    except SafetensorError as e:
        return f"is not a valid safetensors file: {e}"


def _ends_at(end: int, size: int, marker: str) -> str | None:
    if end > size:
        return f"ends before its {marker}"
    if end < size:
        return f"has {size - end} bytes after its {marker}: one file may not hide another"
    return None


def _png(path: Path) -> str | None:
    """The chunks, each with its CRC, from the signature to IEND on the last byte."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if f.read(8) != _PNG_SIGNATURE:
            return "does not start with the PNG signature"
        kind = b""
        while kind != b"IEND":
            start = f.tell()
            head = f.read(8)
            if len(head) < 8:
                return "ends before its IEND chunk"
            length, kind = struct.unpack(">I4s", head)
            if length >= 1 << 31 or not kind.isalpha() or (start == 8) != (kind == b"IHDR"):
                return f"has a malformed chunk at byte {start}"
            crc, remaining = zlib.crc32(kind), length
            while remaining and (data := f.read(min(_CHUNK, remaining))):
                crc, remaining = zlib.crc32(data, crc), remaining - len(data)
            stored = f.read(4)
            if remaining or len(stored) < 4:
                return "ends before its IEND chunk"
            if struct.unpack(">I", stored)[0] != crc:
                return f"its {kind.decode()} chunk at byte {start} fails its CRC"
        return _ends_at(f.tell(), size, "IEND chunk")


def _jpeg(path: Path) -> str | None:
    """The marker segments and scans, from SOI to EOI on the last byte."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 4:
            return "is too short to be a JPEG image"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[:2] != b"\xff\xd8":
                return "does not start with the JPEG SOI marker"
            pos = 2
            while True:
                if pos + 2 > size:
                    return "ends before its EOI marker"
                if m[pos] != 0xFF:
                    return f"has no marker where one is due, at byte {pos}"
                marker = m[pos + 1]
                pos += 1 if marker == 0xFF else 2  # 0xFF: a fill byte before a marker
                if marker == 0xD9:  # EOI
                    return _ends_at(pos, size, "EOI marker")
                if marker == 0xFF or 0xD0 <= marker <= 0xD7 or marker == 0x01:
                    continue  # fill byte, restart, TEM: no length
                if marker in (0x00, 0xD8) or pos + 2 > size:
                    return f"has a malformed segment at byte {pos - 2}"
                length = m[pos] << 8 | m[pos + 1]
                if length < 2:
                    return f"has a malformed segment at byte {pos - 2}"
                pos += length
                if marker == 0xDA:  # SOS: entropy-coded data up to the next real marker
                    while (pos := m.find(b"\xff", pos)) >= 0 and pos + 1 < size:
                        following = m[pos + 1]
                        if following != 0x00 and not 0xD0 <= following <= 0xD7:
                            break
                        pos += 2  # a stuffed 0xFF or a restart marker
                    else:
                        return "ends inside its scan data"


def _webp(path: Path) -> str | None:
    """The RIFF container: its size is the file's, its chunks fill it exactly."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:] != b"WEBP":
            return "does not start with a RIFF WEBP header"
        if (
            problem := _ends_at(struct.unpack("<I", head[4:8])[0] + 8, size, "RIFF data")
        ) is not None:
            return problem
        pos = 12
        while pos < size:
            chunk = f.read(8)
            if len(chunk) < 8:
                return "ends inside a chunk header"
            pos += 8 + (n := struct.unpack("<I", chunk[4:])[0]) + (n & 1)
            f.seek(pos)
        return _ends_at(pos, size, "last chunk") if pos != 12 else "holds no image chunk"


# ------------------------------------------------------------------------------ the rules

_YAML = _parsed(lambda text, limits: yaml.safe_load(text), "YAML", yaml_problem)
ALLOWED_KINDS: dict[str, Check] = {
    ".safetensors": _bytes(_safetensors),
    ".json": _parsed(lambda text, limits: json.loads(text), "JSON"),
    ".yaml": _YAML,
    ".yml": _YAML,
    ".md": _parsed(
        lambda text, limits: load_card(text, limits=limits),
        "Markdown with YAML front matter",
        front_matter_problem,
    ),
    ".txt": _bytes(_plain_text),
    ".png": _bytes(_png),
    ".jpg": _bytes(_jpeg),
    ".jpeg": _bytes(_jpeg),
    ".webp": _bytes(_webp),
}
"""Each allowed suffix (any case) and the check of its content within the YAML limits: why the
file is not one, or None."""
_BY_NAME = {SIGNATURE_FILE: ALLOWED_KINDS[".json"], ".gitattributes": _bytes(_plain_text)}
"""Repo paths allowed by their whole name: the signature (a Sigstore bundle), git's attributes."""


def content_problem(
    rel: str, path: str | os.PathLike[str], yaml_limits: FrontMatterLimits | None = None
) -> str | None:
    """Why repo path ``rel`` (its content in the local file ``path``) may not be published, or
    None: its name is not an allowed kind, or its bytes are not wholly that kind (its YAML, if
    any, within ``yaml_limits``, default ``FrontMatterLimits()``)."""
    suffix = PurePosixPath(rel).suffix.lower()
    check = _BY_NAME.get(rel) or ALLOWED_KINDS.get(suffix)
    if check is None:
        allowed = ", ".join([*ALLOWED_KINDS, *_BY_NAME])
        return (
            f"a {f'{suffix!r} file' if suffix else 'file without a suffix'} is refused by name "
            f"(code, pickles and archives run when loaded); a repo carries only {allowed}"
        )
    return check(Path(path), yaml_limits or FrontMatterLimits())


def weight_sources(config: Mapping[str, Any]) -> list[str]:
    """config.json keys that would make timm load weights from elsewhere (top level, where
    timm's legacy layout reads them, and ``pretrained_cfg``), as ``block.key``."""
    found = [f"{CONFIG_FILE}:{k}" for k in sorted(WEIGHT_SOURCE_KEYS & set(config))]
    cfg = config.get("pretrained_cfg", {})
    if not isinstance(cfg, Mapping):
        return [*found, f"{CONFIG_FILE}:pretrained_cfg (not an object)"]
    return found + [
        f"{CONFIG_FILE}:pretrained_cfg.{k}" for k in sorted(WEIGHT_SOURCE_KEYS & set(cfg))
    ]
