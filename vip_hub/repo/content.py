"""What a released repo may carry: an allow list by name and by content together.

A file's kind comes from its name, and the file is accepted only when that kind's own parser
accepts all of its bytes, nothing before or after them (so no polyglot: a PNG with a zip
appended, a zip behind one junk byte):

- safetensors (names ending in ``WEIGHTS_SUFFIX``): the safetensors library's header checks
  (its tensors cover the data section exactly);
- JSON (``*.json``, and the signature: a Sigstore bundle), YAML (``*.yaml``, ``*.yml``),
  Markdown (``*.md``: its front matter is YAML) and plain text (``*.txt`` such as the
  vocabulary, and ``GITATTRIBUTES_FILE``): UTF-8 with no control character but tab, line feed and
  carriage return, then the kind's parser; every YAML (a file, a front matter) first within the
  card's limits, with no alias (``vip_hub.repo.card.yaml_problem``; the hub's
  ``hub.max_front_matter_*``); every text file is also walked as the C unpickler would run it,
  and refused if that would import a module (``vip_hub.repo.pickles``: a
  protocol-0 pickle is plain ASCII);
- PNG, JPEG (``*.jpg``, ``*.jpeg``) and WebP: their chunk or segment structure, from the
  signature to the end marker on the file's last byte, each chunk or segment of a kind the
  format's allow list names (an unknown or private kind is refused), within the sizes its
  specification gives, at most once where it says so; metadata (text, EXIF, ICC profiles, XMP,
  comments) at most ``MAX_METADATA_BYTES`` an image, and text metadata text (no NUL: no archive
  or executable fits in it).

No file of any kind opens as a zip archive. A zip reader finds an archive by its end record in a
file's last 64 KiB and its members wherever that record says, so a zip hides in whatever bytes a
format leaves free: opaque metadata (an ICC profile, EXIF, compressed text), but also pixel data,
palettes, quantisation tables and tensors, which no structural rule can close. Re-encoding
images at the hub would close those in images (not in tensors) but change the bytes the ledger
digests and the trainer signed. So the allow list bounds what an image carries besides its
pixels (the review hid a zip in a text chunk, a private chunk and a JPEG comment: each is refused
naming the chunk), and the zip check refuses the polyglot wherever it lies, as the review's own
``zipfile`` found it.

Every other kind is refused naming the file: code (``.py``), pickles and what hides them
(``.pkl``, ``.joblib``, ``.pt``, ``.bin``, ``.npy``), archives and compressed streams
(``.zip``, ``.tar``, ``.gz``), files without a suffix. Also here: the timm configuration's keys that
would send timm elsewhere for the weights (a repo's verified weights file is what
``timm.create_model("hf-hub:…", pretrained=True)`` loads).

``vip_hub.repo.verify`` applies both rules, so the hub (which verifies every commit) does too.
"""

from __future__ import annotations

import codecs
import functools
import json
import mmap
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import yaml
from safetensors import SafetensorError, safe_open

from ..errors import RepoFormatError
from ..repo_format import (
    CONFIG_FILE,
    GITATTRIBUTES_FILE,
    SIGNATURE_FILE,
    WEIGHTS_SUFFIX,
    FrontMatterLimits,
)
from .artifacts import CHUNK
from .card import front_matter_problem, load_card, yaml_problem
from .pickles import pickle_problem

__all__ = [
    "ALLOWED_KINDS",
    "MAX_METADATA_BYTES",
    "WEIGHT_SOURCE_KEYS",
    "content_problem",
    "weight_sources",
]

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
            chunk = f.read(CHUNK)
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


def _opens_as_zip(path: Path) -> str | None:
    """Why a file is refused as an archive too: a zip reader finds an archive by the end record
    in a file's last 64 KiB and its members anywhere (pixels, tensors, palettes), so no rule of
    the file's own kind rules one out. Text cannot hold one (its end record holds NULs)."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, EOFError):
        return None
    except UnicodeDecodeError:  # member names that are not UTF-8: other readers open it
        names = []
    shown = "".join(f", {name!r}" for name in names[:3]) + (", ..." if len(names) > 3 else "")
    return f"opens as a zip archive ({len(names)} members{shown}): one file may not hide another"


# ----------------------------------------------------------------------------------- images

MAX_METADATA_BYTES = 8 * 1024
"""Metadata one image may carry in all (text, EXIF, ICC profile, XMP, comments): Pillow and
matplotlib write a few hundred bytes at most, an sRGB profile is about 3 KB; a camera's maker
notes (tens of KB) are refused."""
_EXIF = b"Exif\0\0"
_TIFF = (b"II*\0", b"MM\0*")
_XMP = (b"http://ns.adobe.com/xap/1.0/\0", b"XMP\0://ns.adobe.com/xap/1.0/\0")
"""An XMP packet's identifier in JPEG (the second as some Adobe software writes it)."""
_TABLE_IDS = frozenset({*range(4), *range(0x10, 0x14)})
"""A DQT or DHT table's first byte: precision or class 0 or 1, destination 0 to 3."""


@dataclass(frozen=True)
class _Kind:
    """A chunk or segment kind an image may hold: its data lengths (None: any), whether it
    appears at most once, what its data must be (``check``: why not, else None), and whether it
    is metadata (its bytes count against ``MAX_METADATA_BYTES``)."""

    sizes: Container[int] | None = None
    once: bool = False
    check: Callable[[bytes], str | None] | None = None
    metadata: bool = False


class _Walk:
    """The chunks or segments of one image so far, against the allow list of its format."""

    def __init__(self, kinds: Mapping[str, _Kind]) -> None:
        self.kinds, self.seen, self.metadata = kinds, set[str](), 0

    def admit(self, name: str, length: int) -> str | None:
        """Why chunk or segment ``name`` of ``length`` data bytes may not come next, else None."""
        kind = self.kinds.get(name)
        if kind is None:
            return f"is no kind the allow list names ({', '.join(self.kinds)})"
        if kind.once and name in self.seen:
            return "repeats a kind an image holds once"
        self.seen.add(name)
        if kind.sizes is not None and length not in kind.sizes:
            return f"holds {length} bytes, no size its kind has"
        if kind.metadata:
            self.metadata += length
            if self.metadata > MAX_METADATA_BYTES:
                return (
                    "brings the image's metadata (text, EXIF, ICC profile, XMP, comments) to "
                    f"{self.metadata} bytes, over the limit of {MAX_METADATA_BYTES}"
                )
        return None

    def reads(self, name: str) -> bool:
        """Whether the data of an admitted ``name`` is checked (``check``: its bytes)."""
        return self.kinds[name].check is not None

    def check(self, name: str, data: bytes) -> str | None:
        check = self.kinds[name].check
        assert check is not None  # called only for the names ``reads`` says are checked
        return check(data)


def _text(data: bytes, encoding: str = "utf-8") -> str | None:
    """Why metadata ``data`` is not text (no NUL nor other control character but tab, line feed
    and carriage return: no archive or executable fits in it), else None."""
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as e:
        return f"is not {encoding} text (invalid byte at offset {e.start})"
    if found := _CONTROL.search(text):
        return f"holds the control character {found.group()!r}: it is not text"
    return None


def _exif(data: bytes) -> str | None:
    """EXIF: a TIFF header (after ``Exif\\0\\0``, which some writers add)."""
    return None if data.removeprefix(_EXIF)[:4] in _TIFF else "holds no TIFF header (EXIF)"


def _png_text(data: bytes) -> str | None:
    """tEXt: a keyword of 1-79 Latin-1 characters, a NUL, Latin-1 text."""
    keyword, _, text = data.partition(b"\0")
    if not 1 <= len(keyword) <= 79:
        return "has no keyword of 1 to 79 characters"
    return _text(keyword + text, "latin-1")


def _png_itxt(data: bytes) -> str | None:
    """iTXt: keyword, NUL, compression flag and method, language, NUL, translated keyword, NUL,
    UTF-8 text (compressed text is counted, not read)."""
    keyword, _, rest = data.partition(b"\0")
    flags, (language, _, rest) = rest[:2], rest[2:].partition(b"\0")
    translated, _, text = rest.partition(b"\0")
    if not 1 <= len(keyword) <= 79 or flags not in (b"\0\0", b"\1\0"):
        return "has no keyword of 1 to 79 characters and compression flags"
    return _text(keyword + language, "latin-1") or _text(
        translated + (text if flags == b"\0\0" else b"")
    )


def _png_chunks() -> dict[str, _Kind]:
    once, metadata = functools.partial(_Kind, once=True), functools.partial(_Kind, metadata=True)
    return {
        "IHDR": once({13}),
        "PLTE": once(range(3, 769, 3)),
        "IDAT": _Kind(),
        "IEND": once({0}),
        "tRNS": once(range(1, 257)),
        "cHRM": once({32}),
        "gAMA": once({4}),
        "sBIT": once(range(1, 5)),
        "sRGB": once({1}),
        "cICP": once({4}),
        "mDCV": once({24}),
        "cLLI": once({8}),
        "bKGD": once({1, 2, 6}),
        "hIST": once(range(2, 513, 2)),
        "pHYs": once({9}),
        "tIME": once({7}),
        "acTL": once({8}),
        "fcTL": _Kind({26}),
        "fdAT": _Kind(range(4, 1 << 31)),
        "tEXt": metadata(check=_png_text),
        "iTXt": metadata(check=_png_itxt),
        "zTXt": metadata(),
        "iCCP": metadata(once=True),
        "eXIf": metadata(once=True, check=_exif),
    }


_PNG_CHUNKS = _png_chunks()
"""Every chunk kind a PNG may hold (the PNG specification, third edition, with APNG's)."""


def _tables(entry: Callable[[bytes, int], int]) -> Callable[[bytes], str | None]:
    """DQT, DHT: tables back to back filling the segment, each an id byte and ``entry(data,
    at)`` bytes after it."""

    def check(data: bytes) -> str | None:
        at = 0
        while at < len(data):
            if data[at] not in _TABLE_IDS or at + 1 + (n := entry(data, at)) > len(data):
                return f"holds a malformed table at offset {at}"
            at += 1 + n
        return None if data else "holds no table"

    return check


def _components(fixed: int, each: int, count_at: int) -> Callable[[bytes], str | None]:
    """SOF, SOS: ``fixed`` bytes and ``each`` per component, their count at ``count_at``."""

    def check(data: bytes) -> str | None:
        if len(data) <= count_at or len(data) != fixed + each * data[count_at]:
            return "is not as long as its component count says"
        return None

    return check


def _jfif(data: bytes) -> str | None:
    """APP0: a JFIF header and its thumbnail (width and height at offsets 12 and 13)."""
    if data[:5] != b"JFIF\0" or len(data) < 14 or len(data) != 14 + 3 * data[12] * data[13]:
        return "is not a JFIF header"
    return None


def _app1(data: bytes) -> str | None:
    """APP1: EXIF, or an XMP packet (text)."""
    if data.startswith(_EXIF):
        return _exif(data)
    if prefix := next((p for p in _XMP if data.startswith(p)), None):
        return _text(data[len(prefix) :].removesuffix(b"\0"))  # C writers end it with a NUL
    return "holds neither EXIF nor XMP"


def _starts(prefix: bytes, what: str) -> Callable[[bytes], str | None]:
    return lambda data: None if data.startswith(prefix) else f"is not {what}"


def _jpeg_segments() -> dict[str, _Kind]:
    frame = _Kind(once=True, check=_components(6, 3, 5))
    metadata = functools.partial(_Kind, metadata=True)
    return {
        **{_marker_name(m): frame for m in range(0xC0, 0xD0) if m not in (0xC4, 0xC8, 0xCC)},
        "DHT": _Kind(check=_tables(lambda data, at: 16 + sum(data[at + 1 : at + 17]))),
        "DQT": _Kind(check=_tables(lambda data, at: 64 << (data[at] >> 4))),
        "DAC": _Kind(range(2, 1 << 16, 2)),
        "DRI": _Kind({2}),
        "DNL": _Kind({2}),
        "SOS": _Kind(check=_components(4, 2, 0)),
        "APP0": metadata(check=_jfif),
        "APP1": metadata(check=_app1),
        "APP2": metadata(check=_starts(b"ICC_PROFILE\0", "an ICC profile")),
        "APP13": metadata(check=_starts(b"Photoshop 3.0\0", "Photoshop's IPTC data")),
        "APP14": metadata({12}, check=_starts(b"Adobe", "Adobe's colour transform")),
        "COM": metadata(check=lambda data: _text(data, "latin-1")),
    }


def _marker_name(marker: int) -> str:
    """A JPEG marker's name: ``SOF2``, ``APP1``, ``COM``..."""
    if 0xE0 <= marker <= 0xEF:
        return f"APP{marker - 0xE0}"
    if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
        return f"SOF{marker - 0xC0}"
    names = {0xC4: "DHT", 0xCC: "DAC", 0xDA: "SOS", 0xDB: "DQT", 0xDC: "DNL", 0xDD: "DRI"}
    return names.get(marker, "COM" if marker == 0xFE else f"0x{marker:02X}")


_JPEG_SEGMENTS = _jpeg_segments()
"""Every segment kind a JPEG may hold (ITU T.81 without hierarchical coding; the APP segments of
JFIF, EXIF, XMP, ICC profiles, Photoshop's IPTC data and Adobe's colour transform)."""
_WEBP_CHUNKS = {
    "VP8 ": _Kind(),
    "VP8L": _Kind(),
    "VP8X": _Kind({10}, once=True),
    "ALPH": _Kind(),
    "ANIM": _Kind({6}, once=True),
    "ANMF": _Kind(range(16, 1 << 32)),
    "ICCP": _Kind(once=True, metadata=True),
    "EXIF": _Kind(once=True, metadata=True, check=_exif),
    "XMP ": _Kind(once=True, metadata=True, check=_text),
}
"""Every chunk kind a WebP may hold (RFC 9649)."""
_WEBP_FRAME_CHUNKS = {name: _WEBP_CHUNKS[name] for name in ("ALPH", "VP8 ", "VP8L")}
"""What an animation frame (ANMF) holds after its 16-byte header."""


def _png(path: Path) -> str | None:
    """The chunks, each of a kind the allow list names and with its CRC, from the signature to
    IEND on the last byte."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if f.read(8) != _PNG_SIGNATURE:
            return "does not start with the PNG signature"
        walk, kind = _Walk(_PNG_CHUNKS), b""
        while kind != b"IEND":
            start = f.tell()
            head = f.read(8)
            if len(head) < 8:
                return "ends before its IEND chunk"
            length, kind = struct.unpack(">I4s", head)
            if length >= 1 << 31 or not kind.isalpha() or (start == 8) != (kind == b"IHDR"):
                return f"has a malformed chunk at byte {start}"
            name = kind.decode("ascii")
            if problem := walk.admit(name, length):
                return f"its chunk {name!r} at byte {start} {problem}"
            crc, remaining = zlib.crc32(kind), length
            if walk.reads(name):  # metadata, within MAX_METADATA_BYTES
                data = f.read(length)
                if problem := walk.check(name, data):
                    return f"its chunk {name!r} at byte {start} {problem}"
                crc, remaining = zlib.crc32(data, crc), length - len(data)
            while remaining and (data := f.read(min(CHUNK, remaining))):
                crc, remaining = zlib.crc32(data, crc), remaining - len(data)
            stored = f.read(4)
            if remaining or len(stored) < 4:
                return "ends before its IEND chunk"
            if struct.unpack(">I", stored)[0] != crc:
                return f"its chunk {name!r} at byte {start} fails its CRC"
        return _ends_at(f.tell(), size, "IEND chunk")


def _jpeg(path: Path) -> str | None:
    """The marker segments, each of a kind the allow list names, and the scans, from SOI to EOI
    on the last byte."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 4:
            return "is too short to be a JPEG image"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[:2] != b"\xff\xd8":
                return "does not start with the JPEG SOI marker"
            pos, walk = 2, _Walk(_JPEG_SEGMENTS)
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
                if length < 2 or pos + length > size:
                    return f"has a malformed segment at byte {pos - 2}"
                name = _marker_name(marker)
                problem = walk.admit(name, length - 2)
                if problem is None and walk.reads(name):
                    problem = walk.check(name, m[pos + 2 : pos + length])
                if problem:
                    return f"its {name} segment at byte {pos - 2} {problem}"
                pos += length
                if marker == 0xDA:  # SOS: entropy-coded data up to the next real marker
                    while (pos := m.find(b"\xff", pos)) >= 0 and pos + 1 < size:
                        following = m[pos + 1]
                        if following != 0x00 and not 0xD0 <= following <= 0xD7:
                            break
                        pos += 2  # a stuffed 0xFF or a restart marker
                    else:
                        return "ends inside its scan data"


def _riff_chunks(f: BinaryIO, pos: int, end: int, walk: _Walk) -> str | None:
    """Why the chunks from ``pos`` to ``end`` do not fill it exactly, each of a kind ``walk``
    admits (an animation frame's chunks too), else None."""
    while pos < end:
        f.seek(pos)
        head = f.read(8)
        if len(head) < 8:
            return "ends inside a chunk header"
        name, n = head[:4].decode("latin-1"), struct.unpack("<I", head[4:])[0]
        after = pos + 8 + n + (n & 1)  # a chunk of odd size is padded
        if after > end:
            return f"its chunk {name!r} at byte {pos} ends past the data that holds it"
        problem = walk.admit(name, n)
        if problem is None and walk.reads(name):
            problem = walk.check(name, f.read(n))
        if problem:
            return f"its chunk {name!r} at byte {pos} {problem}"
        if name == "ANMF" and (
            problem := _riff_chunks(f, pos + 24, pos + 8 + n, _Walk(_WEBP_FRAME_CHUNKS))
        ):
            return problem
        pos = after
    return None


def _webp(path: Path) -> str | None:
    """The RIFF container: its size is the file's, its chunks (each of a kind the allow list
    names) fill it exactly."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:] != b"WEBP":
            return "does not start with a RIFF WEBP header"
        if problem := _ends_at(struct.unpack("<I", head[4:8])[0] + 8, size, "RIFF data"):
            return problem
        walk = _Walk(_WEBP_CHUNKS)
        if problem := _riff_chunks(f, 12, size, walk):
            return problem
        return None if walk.seen & {"VP8 ", "VP8L", "ANMF"} else "holds no image chunk"


# ------------------------------------------------------------------------------ the rules

_YAML = _parsed(lambda text, limits: yaml.safe_load(text), "YAML", yaml_problem)
ALLOWED_KINDS: dict[str, Check] = {
    WEIGHTS_SUFFIX: _bytes(_safetensors),
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
_BY_NAME = {SIGNATURE_FILE: ALLOWED_KINDS[".json"], GITATTRIBUTES_FILE: _bytes(_plain_text)}
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
    return check(Path(path), yaml_limits or FrontMatterLimits()) or _opens_as_zip(Path(path))


def weight_sources(config: Mapping[str, Any]) -> list[str]:
    """The timm configuration's keys that would make timm load weights from elsewhere (top
    level, where timm's legacy layout reads them, and ``pretrained_cfg``), as ``block.key``."""
    found = [f"{CONFIG_FILE}:{k}" for k in sorted(WEIGHT_SOURCE_KEYS & set(config))]
    cfg = config.get("pretrained_cfg", {})
    if not isinstance(cfg, Mapping):
        return [*found, f"{CONFIG_FILE}:pretrained_cfg (not an object)"]
    return found + [
        f"{CONFIG_FILE}:pretrained_cfg.{k}" for k in sorted(WEIGHT_SOURCE_KEYS & set(cfg))
    ]
