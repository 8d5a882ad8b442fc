"""What a verified repo may hold (issue 24, High 3 and 4; issue 34, point 2): no ``CONFIG_FILE`` key
that sends timm to other weights; only the kinds the allow list names (safetensors, JSON, YAML,
Markdown, plain text, PNG, JPEG, WebP, ``SIGNATURE_FILE``), each wholly that kind (no polyglot, no
pickle written as text); weights files recognised in any case; no ``.git`` path (nor its short
name ``GIT~1``) and no path that is also a folder. Checked by ``vip-hub verify`` and by the live
hub at push, with the real huggingface_hub and timm clients; the hub's downloads say nosniff."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import os
import pickle
import pickletools
import random
import re
import shutil
import struct
import sys
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import httpx
import joblib
import numpy as np
import pytest
import safetensors.numpy
import timm
import torch
from huggingface_hub import HfApi
from huggingface_hub.errors import BadRequestError, RevisionNotFoundError
from matplotlib.figure import Figure
from PIL import Image, ImageCms, PngImagePlugin
from support.helpers import rewrite_ledger_copies, tiny_repo_with_head
from support.live import WRITE_TOKEN, raw_commit

from vip_hub import verify_repo
from vip_hub.models.tokenizer import public_vocab
from vip_hub.paths import tree_path_problems, validate_relpath
from vip_hub.repo.artifacts import (
    digest_file,
)
from vip_hub.repo.content import WEIGHT_SOURCE_KEYS, content_problem
from vip_hub.repo.pickles import pickle_problem
from vip_hub.repo.push import push_repo
from vip_hub.repo_format import (
    CARD_FILE,
    CONFIG_FILE,
    GITATTRIBUTES_FILE,
    VOCAB_FILE,
    WEIGHTS_FILE,
    WEIGHTS_SUFFIX,
    head_file,
)


def _rebind(folder: Path) -> None:
    """What an attacker who owns a repo can do: re-digest every listed file and write the three
    ledger copies again, so the tampering is not what gets the repo refused."""

    def redigested(ledger: dict) -> dict:
        ledger["artifacts"] = {rel: digest_file(folder / rel, rel) for rel in ledger["artifacts"]}
        return ledger

    rewrite_ledger_copies(folder, redigested)


def _redirect(folder: Path, key: str, value: object) -> Path:
    config = json.loads((folder / CONFIG_FILE).read_text())
    config["pretrained_cfg"][key] = value
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    _rebind(folder)
    return folder


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tiny_repo_with_head(tmp_path_factory.mktemp("good") / "repo")
    assert verify_repo(folder).ok
    return folder


def _copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "repo"))


def _torch_pickle(legacy: bool = False) -> bytes:
    buf = io.BytesIO()
    torch.save({"weight": torch.zeros(2)}, buf, _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


def test_rebind_alone_keeps_a_repo_verified(good, tmp_path):
    folder = _copy(good, tmp_path)
    _rebind(folder)
    assert verify_repo(folder).ok


@pytest.mark.parametrize("key", sorted(WEIGHT_SOURCE_KEYS))
def test_every_timm_weight_source_key_is_refused(good, tmp_path, key):
    folder = _redirect(
        _copy(good, tmp_path), key, "weights.pth.tar" if key != "custom_load" else "hf"
    )
    problems = [str(p) for p in verify_repo(folder).problems]
    assert problems == [
        (
            f"{CONFIG_FILE}:pretrained_cfg.{key}: would make timm load weights from elsewhere "
            f"than the verified {WEIGHTS_FILE}"
        )
    ]


def test_a_weight_source_at_the_top_level_is_refused(good, tmp_path):
    """timm's legacy config layout reads the source keys at the top level."""
    folder = _copy(good, tmp_path)
    config = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps({**config, "url": "https://example.com/w.pth"}))
    _rebind(folder)
    assert [p.where for p in verify_repo(folder).problems] == [f"{CONFIG_FILE}:url"]


class _RunsOnLoad:
    """What the review's model.joblib held: unpickling it calls os.system (never loaded here)."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, ("touch /tmp/owned-by-a-repo",)


def _joblib_lzma(tmp_path: Path) -> bytes:
    """A joblib file compressed with LZMA (its bytes start 5D 00 00: no magic a deny list knows)."""
    joblib.dump({"model": _RunsOnLoad()}, tmp_path / "m.joblib", compress="lzma")
    data = (tmp_path / "m.joblib").read_bytes()
    assert data[:3] == b"\x5d\x00\x00"
    return data


def _zip(content: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", content or pickle.dumps(_RunsOnLoad()))
    return buf.getvalue()


def _image(fmt: str, **options: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.arange(48 * 32 * 3, dtype=np.uint8).reshape(48, 32, 3)).save(
        buf, fmt, **options
    )
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_with(chunk: bytes) -> bytes:
    """A PNG with ``chunk`` after its IHDR (at byte 33)."""
    png = _image("PNG")
    return png[:33] + chunk + png[33:]


def _jpeg_with(marker: int, data: bytes) -> bytes:
    """A JPEG with a segment of ``marker`` after its SOI (at byte 2)."""
    jpeg = _image("JPEG")
    return jpeg[:2] + bytes([0xFF, marker]) + struct.pack(">H", len(data) + 2) + data + jpeg[2:]


def _webp_with(kind: bytes, data: bytes) -> bytes:
    """A WebP with a chunk of ``kind`` after its image, the RIFF size counting it."""
    webp = _image("WEBP") + kind + struct.pack("<I", len(data)) + data + b"\0" * (len(data) & 1)
    return webp[:4] + struct.pack("<I", len(webp) - 8) + webp[8:]


_TIFF = b"II*\0\x08\0\0\0\0\0\0\0\0\0"
"""A TIFF header and an empty IFD: what EXIF data starts with."""


def _polyglots() -> dict[str, tuple[bytes, str]]:
    """Images that are also zip archives, each with the review's payload in a chunk or segment
    its format allows or not, and the refusal's message: the chunk or segment named, else the
    archive."""
    payload = _zip(b"import os\nos.system('touch /tmp/owned-by-a-repo')\n")
    archive = "opens as a zip archive (1 members, 'archive/data.pkl')"
    return {
        "text.png": (
            _png_with(_png_chunk(b"tEXt", b"Comment\0" + payload)),
            "its chunk 'tEXt' at byte 33 holds the control character '\\x03': it is not text",
        ),
        "private.png": (
            _png_with(_png_chunk(b"prVt", payload)),
            "its chunk 'prVt' at byte 33 is no kind the allow list names (IHDR, PLTE, IDAT,",
        ),
        "compressed.png": (_png_with(_png_chunk(b"zTXt", b"Comment\0\0" + payload)), archive),
        "physical.png": (  # a chunk of a fixed size, not metadata, made to carry more
            _png_with(_png_chunk(b"pHYs", bytes(9) + payload)),
            f"its chunk 'pHYs' at byte 33 holds {9 + len(payload)} bytes, no size its kind has",
        ),
        "exif.png": (_png_with(_png_chunk(b"eXIf", _TIFF + payload)), archive),
        "big-text.png": (
            _png_with(_png_chunk(b"tEXt", b"Comment\0" + b"words " * 1500 + payload)),
            "its chunk 'tEXt' at byte 33 brings the image's metadata (text, EXIF, ICC profile, "
            f"XMP, comments) to {9008 + len(payload)} bytes, over the limit of 8192",
        ),
        "comment.jpg": (
            _jpeg_with(0xFE, payload),
            "its COM segment at byte 2 holds the control character '\\x03': it is not text",
        ),
        "app1.jpg": (_jpeg_with(0xE1, payload), "its APP1 segment at byte 2 holds neither EXIF"),
        "exif.jpg": (_jpeg_with(0xE1, b"Exif\0\0" + _TIFF + payload), archive),
        "app5.jpg": (_jpeg_with(0xE5, payload), "its APP5 segment at byte 2 is no kind the allow"),
        "unknown.webp": (
            _webp_with(b"ZIP ", payload),
            f"its chunk 'ZIP ' at byte {len(_image('WEBP'))} is no kind the allow list names",
        ),
        "exif.webp": (_webp_with(b"EXIF", _TIFF + payload), archive),
    }


_PICKLE_AS_TEXT = b"cos\nsystem\n(S'echo owned'\ntR."  # protocol 0: plain ASCII


def _call(marker: str) -> bytes:
    """Protocol-0 opcodes that call ``logging.getLogger(marker)``: harmless, and seen after."""
    return b"clogging\ngetLogger\n(S'" + marker.encode() + b"'\ntR"


_C_UNPICKLER_ONLY: dict[str, Callable[[str], bytes]] = {
    "hex INT (the review's I0x1)": lambda m: b"I0x1\n0" + _call(m) + b".",
    "octal INT": lambda m: b"I0o7\n0" + _call(m) + b".",
    "binary INT": lambda m: b"I0b1\n0" + _call(m) + b".",
    "hex LONG": lambda m: b"L0x1L\n0" + _call(m) + b".",
    "octal LONG without its L": lambda m: b"L0o7\n0" + _call(m) + b".",
    "non-ASCII STRING": lambda m: "S'\u00e9t\u00e9'\n0".encode() + _call(m) + b".",
    "no STOP": _call,
    "prose after the call": lambda m: _call(m) + b" and some prose after it\n",
}
"""Text the C unpickler runs up to the call and pickletools does not read (base-0 numbers, a
STRING for ``encoding='latin1'`` as numpy and torch load, the end after the call has run)."""


def _what_runs(tmp_path: Path) -> dict[str, bytes]:
    """The review's files: each runs code when a client loads it (or hides what does)."""
    return {
        "model.joblib": _joblib_lzma(tmp_path),
        "weights.zip": b"\x00" + _zip(_torch_pickle()),  # one junk byte before a zip
        "archive.txt": b"x" + _zip(),
        "plot.png": _image("PNG") + _zip(),  # a PNG and a zip in one file
        "photo.jpg": _image("JPEG") + _zip(),
        "chart.png": _polyglots()["text.png"][0],  # a zip in a PNG's text chunk
        "picture.jpg": _polyglots()["comment.jpg"][0],  # ...and in a JPEG's comment
        "modeling_vip.py": b"import os\nos.system('touch /tmp/owned-by-a-repo')\n",
        "notes.txt": _PICKLE_AS_TEXT,
        VOCAB_FILE: _C_UNPICKLER_ONLY["hex INT (the review's I0x1)"]("vip-hub-test-review"),
        "extra.yaml": _C_UNPICKLER_ONLY["no STOP"]("vip-hub-test-review"),
    }


def test_files_that_run_code_are_refused_naming_the_file(good, tmp_path):
    messages = {}
    for name, content in _what_runs(tmp_path).items():
        folder = _copy(good, tmp_path / name)
        (folder / name).write_bytes(content)
        problems = verify_repo(folder).problems
        assert [p.where for p in problems] == [name], (name, problems)
        messages[name] = problems[0].message
    assert "'.py' file is refused by name" in messages["modeling_vip.py"]
    assert "'.joblib' file is refused by name" in messages["model.joblib"]
    assert "bytes after its IEND chunk" in messages["plot.png"]
    assert "bytes after its EOI marker" in messages["photo.jpg"]
    assert messages["chart.png"].startswith("its chunk 'tEXt' at byte 33 holds the control")
    assert messages["picture.jpg"].startswith("its COM segment at byte 2 holds the control")
    assert "is not UTF-8 text" in messages["archive.txt"]
    assert "holds a pickle" in messages["notes.txt"]
    for name in (VOCAB_FILE, "extra.yaml"):
        assert "holds a pickle: unpickling it would import the module 'logging'" in messages[name]


@pytest.mark.parametrize(
    "name, content",
    [
        ("checkpoint.pth.tar", _torch_pickle()),
        ("weights.pth", _torch_pickle(legacy=True)),
        ("model.pkl", pickle.dumps({"w": [0.0] * 4}, protocol=5)),
        ("weights.pt.gz", gzip.compress(_torch_pickle(legacy=True))),
        ("pytorch_model.bin", _torch_pickle()),
        ("model.npy", pickle.dumps({"w": 1}, protocol=2)),
        ("LICENSE", b"MIT\n"),
        (f"{CONFIG_FILE}.py", b"{}"),
    ],
)
def test_every_kind_outside_the_allow_list_is_refused_by_name(good, tmp_path, name, content):
    folder = _copy(good, tmp_path)
    (folder / name).write_bytes(content)
    problems = verify_repo(folder).problems
    assert [p.where for p in problems] == [name]
    assert "is refused by name" in problems[0].message


def test_every_allowed_kind_is_accepted_when_it_is_wholly_that_kind(good, tmp_path):
    folder = _copy(good, tmp_path)
    files = {
        "plots/curve.png": _image("PNG"),
        "plots/photo.jpg": _image("JPEG"),
        "plots/photo.JPEG": _image("JPEG", progressive=True),
        "plots/photo.webp": _image("WEBP"),
        "plots/lossless.webp": _image("WEBP", lossless=True),
        "notes/settings.yaml": b"lr: 0.001\nsteps: [1, 2]\n",
        "notes/more.yml": b"a: b\n",
        "notes/extra.md": "---\nlicense: mit\n---\n# Notes\n\u00e9t\u00e9\n".encode(),
        f"notes/{VOCAB_FILE}": "[PAD]\n[UNK]\nthe\n\u00e9t\u00e9\t\r\n".encode(),
        "notes/data.json": b'{"a": [1, 2.5, null]}',
    }
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    assert verify_repo(folder).ok, verify_repo(folder).problems


def _jpeg_frame() -> bytes:
    """The data of the JPEG's SOF0 segment (a frame: 6 bytes and 3 per component)."""
    jpeg = _image("JPEG")
    at = jpeg.index(b"\xff\xc0")
    return jpeg[at + 4 : at + 2 + int.from_bytes(jpeg[at + 2 : at + 4], "big")]


_FORMAT_RULES = {
    "gamma.png": (
        lambda: _png_with(_png_chunk(b"gAMA", bytes(4)) * 2),
        "its chunk 'gAMA' at byte 49 repeats a kind an image holds once",
    ),
    "frames.jpg": (
        lambda: _jpeg_with(0xC0, _jpeg_frame()),
        "its SOF0 segment at byte 177 repeats a kind an image holds once",
    ),
    "frame.jpg": (
        lambda: _jpeg_with(0xC0, _jpeg_frame() + bytes(5)),
        "its SOF0 segment at byte 2 is not as long as its component count says",
    ),
    "tables.jpg": (
        lambda: _jpeg_with(0xDB, bytes([0]) + bytes(range(1, 65)) + bytes([1]) + bytes(10)),
        "its DQT segment at byte 2 holds a malformed table at offset 65",
    ),
    "extended.webp": (
        lambda: _webp_with(b"VP8X", bytes(12)),
        f"its chunk 'VP8X' at byte {len(_image('WEBP'))} holds 12 bytes, no size its kind has",
    ),
    "animation.webp": (
        lambda: _webp_with(b"ANIM", bytes(8)),
        f"its chunk 'ANIM' at byte {len(_image('WEBP'))} holds 8 bytes, no size its kind has",
    ),
}
"""Images breaking a rule of their format's allow list that no zip is needed to show: a kind
held once, a fixed size, a segment's length from its own counts."""


@pytest.mark.parametrize("name", sorted(_FORMAT_RULES))
def test_a_chunk_or_segment_against_its_kinds_rule_is_refused_naming_it(good, tmp_path, name):
    content, why = _FORMAT_RULES[name]
    folder = _copy(good, tmp_path)
    (folder / name).write_bytes(content())
    problems = verify_repo(folder).problems
    assert [(p.where, p.message) for p in problems] == [(name, why)]


@pytest.mark.parametrize("name", sorted(_polyglots()))
def test_an_image_that_hides_a_zip_is_refused_naming_where(good, tmp_path, name):
    """The review's zip in an ancillary chunk or segment, and every other place an image's
    format offers: refused naming the chunk or segment where a rule of the format says what it
    may hold (an allow list, text, sizes), else because the file opens as a zip archive."""
    content, why = _polyglots()[name]
    assert zipfile.ZipFile(io.BytesIO(content)).namelist() == ["archive/data.pkl"]
    assert Image.open(io.BytesIO(content)).size == (32, 48)  # and an image all the same
    folder = _copy(good, tmp_path)
    (folder / name).write_bytes(content)
    problems = verify_repo(folder).problems
    assert [p.where for p in problems] == [name]
    assert problems[0].message.startswith(why), problems[0].message


def test_weights_that_hide_a_zip_are_refused(tmp_path):
    """Tensors are any bytes: a zip in them is found as a zip reader finds it, by its end."""
    path = tmp_path / f"extra{WEIGHTS_SUFFIX}"
    payload = np.frombuffer(_zip(), dtype=np.uint8)
    safetensors.numpy.save_file({"w": np.zeros(4, np.float32), "z": payload}, path)
    assert content_problem(f"extra{WEIGHTS_SUFFIX}", path) == (
        "opens as a zip archive (1 members, 'archive/data.pkl'): one file may not hide another"
    )
    safetensors.numpy.save_file({"w": np.zeros(4, np.float32)}, path)
    assert content_problem(f"extra{WEIGHTS_SUFFIX}", path) is None


def _ordinary_images() -> dict[str, bytes]:
    """What Pillow and matplotlib write: metadata of each kind, palettes, 16 bits, animations."""
    exif = Image.Exif()
    exif.update({0x0131: "Pillow", 0x0112: 1, 0x010E: "a test image"})
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    text = PngImagePlugin.PngInfo()
    text.add_text("Title", "\u00e9t\u00e9")
    text.add_itxt("Comment", "\u00fcnicode", lang="en")
    text.add_text("Notes", "compressed", zip=True)
    image = Image.fromarray(np.arange(48 * 32 * 3, dtype=np.uint8).reshape(48, 32, 3))
    frames = {"save_all": True, "append_images": [image.rotate(90)], "duration": 100}
    images = {}
    for name, img, fmt, options in [
        ("text.png", image, "PNG", {"pnginfo": text, "dpi": (72, 72)}),
        ("exif.png", image, "PNG", {"exif": exif, "icc_profile": srgb}),
        ("palette.png", image.convert("P"), "PNG", {"transparency": 0}),
        ("sixteen.png", image.convert("I;16"), "PNG", {}),
        ("animated.png", image, "PNG", frames),
        ("exif.jpg", image, "JPEG", {"exif": exif, "icc_profile": srgb, "comment": "a note"}),
        ("progressive.jpg", image, "JPEG", {"progressive": True, "optimize": True}),
        ("cmyk.jpg", image.convert("CMYK"), "JPEG", {}),
        ("exif.webp", image, "WEBP", {"exif": exif, "icc_profile": srgb}),
        ("alpha.webp", image.convert("RGBA"), "WEBP", {}),
        ("animated.webp", image, "WEBP", frames),
    ]:
        buf = io.BytesIO()
        img.save(buf, fmt, **options)
        images[name] = buf.getvalue()
    figure = Figure(figsize=(2, 2))  # as the training curves are drawn (runlog.py)
    figure.gca().plot([1, 3, 2])
    for fmt in ("png", "jpg", "webp"):
        buf = io.BytesIO()
        figure.savefig(buf, format=fmt)
        images[f"matplotlib.{fmt}"] = buf.getvalue()
    return images


def test_ordinary_images_are_accepted(good, tmp_path):
    folder = _copy(good, tmp_path)
    for name, data in _ordinary_images().items():
        (folder / "images").mkdir(exist_ok=True)
        (folder / "images" / name).write_bytes(data)
    assert verify_repo(folder).ok, verify_repo(folder).problems


@pytest.mark.parametrize(
    "name, content, why",
    [
        ("data.json", b'{"a": 1}\n{"b": 2}', "is not valid JSON"),
        ("data.json", b'{"a": 1}\x00', "control character"),
        (VOCAB_FILE, b"the\n\xff\xfe", "is not UTF-8 text"),
        ("settings.yaml", b"a: [1\n", "is not valid YAML"),
        ("extra.md", b"---\n- a list\n---\ntext", "is not valid Markdown"),
        ("extra.md", b"---\ntags: 3\n---\ntext", "is not valid Markdown"),
        ("extra.md", b"---\n1: 2\n---\ntext", "is not valid Markdown"),
        ("curve.png", _image("PNG")[:-1], "ends before its IEND chunk"),
        ("photo.jpg", b"x" + _image("JPEG"), "does not start with the JPEG SOI marker"),
        ("photo.webp", _image("WEBP") + b"\x00\x00", "2 bytes after its RIFF data"),
        (f"extra{WEIGHTS_SUFFIX}", (b"x" * 8), "is not a valid safetensors file"),
    ],
)
def test_an_allowed_name_with_other_content_is_refused(good, tmp_path, name, content, why):
    folder = _copy(good, tmp_path)
    (folder / name).write_bytes(content)
    problems = verify_repo(folder).problems
    assert problems and problems[0].where == name and why in problems[0].message, problems


def test_safetensors_with_bytes_after_its_tensors_is_refused(good, tmp_path):
    folder = _copy(good, tmp_path)
    head = folder / head_file("toy")
    head.write_bytes(head.read_bytes() + _zip())  # the tensors digest does not see these bytes
    problems = verify_repo(folder).problems
    assert [p.where for p in problems] == [head_file("toy")]
    assert "not fully covered" in problems[0].message


@pytest.mark.parametrize("case", sorted(_C_UNPICKLER_ONLY))
def test_a_pickle_the_c_unpickler_runs_is_refused_in_any_text(good, tmp_path, case):
    """pickle.loads of each runs its call (pickletools stops before it, so these counted as
    text); as ``VOCAB_FILE`` or an extra YAML file, each is refused naming the import."""
    marker = f"vip-hub-test {case}"
    payload = _C_UNPICKLER_ONLY[case](marker)
    with pytest.raises(ValueError):
        list(pickletools.genops(payload))
    assert marker not in logging.Logger.manager.loggerDict
    with contextlib.suppress(pickle.UnpicklingError, EOFError):
        pickle.loads(payload, encoding="latin1")
    assert marker in logging.Logger.manager.loggerDict  # the call ran
    folder = _copy(good, tmp_path)
    for name in (VOCAB_FILE, "notes/extra.yaml"):
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(payload)
    problems = verify_repo(folder).problems
    assert sorted(p.where for p in problems) == ["notes/extra.yaml", VOCAB_FILE]
    for p in problems:
        assert p.message.startswith(
            "holds a pickle: unpickling it would import the module 'logging' (GLOBAL at byte "
        ), p.message


class _Imported(Exception):
    pass


class _Recorder(pickle.Unpickler):
    """The C unpickler, stopped at its first import; an application's persistent ids load."""

    def find_class(self, module: str, name: str) -> object:
        raise _Imported(module)

    def persistent_load(self, pid: object) -> object:
        return pid


def _imports(data: bytes) -> str | None:
    """The module the C unpickler imports first, reading pickles from ``data`` in a loop (as
    repeated ``pickle.load`` calls do), or None when it raises or ends before any import."""
    unpickler = _Recorder(io.BytesIO(data), encoding="latin1")
    try:
        for _ in range(len(data)):
            unpickler.load()
    except _Imported as e:
        return e.args[0]
    except Exception:  # whatever the C unpickler raises ends it
        return None
    return None


def _importable(module: str | None) -> bool:
    """Whether a file on ``sys.path`` could be the module (``cno such module`` could not)."""
    return module is not None and all(re.fullmatch(r"[\w-]+", p) for p in module.split("."))


_FRAGMENTS = [
    *(bytes([c]) for c in b"(.0123NRtd}]lasuebo)Q\x85\x86\x87\x88\x8f\x90\x91\x94\x97\x98\n#"),
    *(
        line + b"\n"
        for line in (b"I0x1", b"I0o7", b"I 010", b"I08", b"I", b"L0x1L", b"L0b1", b"L", b"F1.5")
    ),
    *(line + b"\n" for line in (b"F 1", b"Finf", b"S'a'", b"S'", b"S\"x'", b"Pid", b"Vx")),
    *(line + b"\n" for line in (b"p0", b"p 1", b"p-1", b"g0", b"g1")),
    *(b"q\x00", b"h\x00", b"r\x01\x00\x00\x00", b"j\x01\x00\x00\x00"),  # memo keys
    *(b"K ", b"J    ", b"U\x01x", b"T\x01\x00\x00\x00x"),  # binary arguments
    *(b"\x82\x01", b"\x80\x02", b"\x81", b"\x92"),  # EXT1, PROTO, NEWOBJ, NEWOBJ_EX
    b"\x95\x01\x00\x00\x00\x00\x00\x00\x00N",  # FRAME
    b"clogging\nLogger\n",
    b"cno such module\nx\n",
    b"ilogging\nLogger\n",
    b"\x8c\x07logging\x8c\x06Logger\x93",  # STACK_GLOBAL
]
"""Pieces of pickles and of text the differential test strings together."""


def test_the_scan_refuses_whatever_the_c_unpickler_would_import():
    """20,000 random strings of opcodes, numbers in every base, truncated arguments, marks and
    memo keys: whenever the C unpickler gets as far as importing a module a file could hold, the
    scan says so; whatever it says of the rest only errs towards refusing."""
    rng, imports = random.Random(53), 0
    for _ in range(20_000):
        data = b"".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(1, 12)))
        if not _importable(_imports(data)):
            continue
        imports += 1
        assert pickle_problem(data), data
    assert imports > 500  # the strings reach an import often enough to test the scan


def test_an_import_is_refused_when_standard_or_followed_by_a_call() -> None:
    """Any standard-library import is refused (the module is on every client, and some act on
    import), and any call after an import; an import alone of no standard module is not (a
    word list), since it calls nothing and no repo file can be that module."""
    refused = {
        b"cos\nsystem\n": "'os'",  # a standard module: refused at the import
        b"cantigravity\nx\n": "'antigravity'",
        b"cmymodule\nrun\n(S'x'\ntR.": "call what it imported",  # REDUCE
        b"cmymodule\nThing\n)\x81.": "call what it imported",  # NEWOBJ
        b"(cmymodule\nThing\no.": "call what it imported",  # OBJ: MARK, class, args
        b"cmymodule\nThing\n}b.": "call what it imported",  # BUILD
        b"(imymodule\nThing\n.": "INST",  # INST imports and calls
    }
    for data, said in refused.items():
        problem = pickle_problem(data)
        assert problem is not None and said in problem, (data, problem)
    for text in (b"coat\nshirt\nbag\n", b"cmymodule\nname\n.", b"cat\ndog\nemu\n"):
        assert pickle_problem(text) is None, text


def test_ordinary_text_is_not_taken_for_a_pickle(good, tmp_path):
    """Text that starts with opcodes but does not run as a pickle: vocabularies (a line ``I``,
    ``L`` or ``0x1`` stops the C unpickler), YAML, Markdown, release notes ('Git 1.7.12.2' is
    BINFLOAT, DUP, STOP: a pickle of data, importing nothing)."""
    folder = _copy(good, tmp_path)
    texts = {
        VOCAB_FILE: public_vocab(["I saw the cat", "0x1 L ##s"]).decode(),
        "vocab2.txt": "I\nL\n0x1\n##s\nthe\ncat\n",
        "vocab3.txt": "L\nI\n[PAD]\n",
        "vocab4.txt": "0x1\nI0x1\n",
        # a lower-case word list whose first word opens with c: GLOBAL oat.shirt, then BUILD
        # with one object on the stack, where the C unpickler stops: nothing is called
        "classes.txt": "coat\nshirt\nbag\nsneaker\n",
        "words.txt": "cat\ndog\nemu\n",
        "notes.yaml": "classes:\n  - cat\n  - dog\nconfig: {lr: 0.1}\n",
        "notes.md": "# Notes\n\nI0x1 is hex.\n",
        "release.txt": "Git 1.7.12.2 Release Notes\n==========\n",
        **{
            f"note{i}.txt": text
            for i, text in enumerate(
                ["The model card.\n" * 50, "N.B. short", "S'quoted'\n", "(\n)\n", "I1\nI2\n"]
            )
        },
    }
    for name, text in texts.items():
        (folder / name).write_text(text)
        module = _imports(text.encode())  # what the C unpickler would import: no standard module
        assert not _importable(module) or module.split(".")[0] not in sys.stdlib_module_names
    assert verify_repo(folder).ok, verify_repo(folder).problems


def test_weights_files_are_recognised_in_any_case(good, tmp_path):
    folder = _copy(good, tmp_path)
    shutil.copy(folder / WEIGHTS_FILE, folder / "extra.SAFETENSORS")
    assert [(p.where, "not listed" in p.message) for p in verify_repo(folder).problems] == [
        ("extra.SAFETENSORS", True)
    ]


def test_git_segments_and_file_folder_clashes_are_refused():
    for path in (
        ".git/config",
        "a/.git/hooks/post-checkout",
        ".GIT/config",
        ".git./config",
        ".git",
    ):
        with pytest.raises(ValueError, match="'.git' segment"):
            validate_relpath(path)
    for path in ("GIT~1/config", "a/git~2/hooks/post-checkout", "Git~1./config", ".git::$DATA"):
        with pytest.raises(ValueError, match="short name of one, such as GIT~1"):
            validate_relpath(path)
    assert validate_relpath(GITATTRIBUTES_FILE) == GITATTRIBUTES_FILE
    assert validate_relpath("git~notes/x.txt") == "git~notes/x.txt"
    for path, problem in [  # two files on Windows, or none: each was accepted
        ("docs./a.md", "ends in a dot or a space"),
        ("notes.txt ", "ends in a dot or a space"),
        ("a:b.txt", "holds :"),
        ('a<b>"c|d?.txt', 'holds " < > ? |'),
        ("con.txt", "is a Windows device name"),
        ("nul/x.md", "is a Windows device name"),
        ("x/LPT1.tar.gz", "is a Windows device name"),
    ]:
        with pytest.raises(ValueError, match=f"{re.escape(problem)}.*could not write it as named"):
            validate_relpath(path)
    for path in ("a .txt", "contents.txt", "console.md", "com10.txt", "a.b.c.txt"):
        assert validate_relpath(path) == path
    assert tree_path_problems([CARD_FILE, f"{CARD_FILE}/x", "a/b", "A/b", "c"]) == [
        f"'{CARD_FILE}' is a file and the folder of '{CARD_FILE}/x'",
        "'A/b' and 'a/b' differ only by case",
    ]


# ---------------------------------------------------------------------------- the live hub


def test_hub_refuses_a_repo_that_sends_timm_to_a_pickle(hub, good, tmp_path):
    """The review's repo: pretrained_cfg.hf_hub_filename names a pickle beside the verified
    weights."""
    folder = _redirect(_copy(good, tmp_path), "hf_hub_filename", "weights.pth.tar")
    (folder / "weights.pth.tar").write_bytes(_torch_pickle(legacy=True))
    api = HfApi(token=WRITE_TOKEN)
    api.create_repo("writer/redirect")
    with pytest.raises(BadRequestError, match="pretrained_cfg.hf_hub_filename") as err:
        api.upload_folder(repo_id="writer/redirect", folder_path=folder)
    assert "weights.pth.tar: a '.tar' file is refused by name" in str(err.value)
    with pytest.raises(RevisionNotFoundError):  # nothing was stored: timm has nothing to load
        timm.create_model("hf-hub:writer/redirect", pretrained=True)
    # the same repo without the redirect is served, and timm loads its verified safetensors
    push_repo(good, "writer/redirect", token=WRITE_TOKEN)
    model = timm.create_model("hf-hub:writer/redirect", pretrained=True)
    assert model.pretrained_cfg["hf_hub_id"] == "writer/redirect" and not model.pretrained_cfg.get(
        "hf_hub_filename"
    )


@pytest.mark.parametrize(
    "name", ["checkpoint.pth.tar", "model.joblib", "weights.pt.gz", "model.npy"]
)
def test_hub_refuses_pickles_under_any_name(hub, good, tmp_path, name):
    api = HfApi(token=WRITE_TOKEN)
    repo = f"writer/{name.replace('.', '-')}"
    api.create_repo(repo)
    push_repo(good, repo, token=WRITE_TOKEN)
    before = api.model_info(repo).sha
    data = gzip.compress(_torch_pickle(legacy=True)) if name.endswith(".gz") else _torch_pickle()
    if name.endswith(".npy"):
        buf = io.BytesIO()
        np.save(buf, np.array([{"w": 1}], dtype=object), allow_pickle=True)
        data = buf.getvalue()
    with pytest.raises(BadRequestError, match=f"{name}: a '"):
        api.upload_file(path_or_fileobj=data, path_in_repo=name, repo_id=repo)
    with pytest.raises(BadRequestError, match="MODEL.SAFETENSORS: not listed in the ledger"):
        api.upload_file(
            path_or_fileobj=(good / WEIGHTS_FILE).read_bytes(),
            path_in_repo="MODEL.SAFETENSORS",
            repo_id=repo,
        )
    assert api.model_info(repo).sha == before


def test_hub_refuses_git_paths_and_a_file_that_is_a_folder(hub, good):
    api = HfApi(token=WRITE_TOKEN)
    api.create_repo("writer/paths")
    push_repo(good, "writer/paths", token=WRITE_TOKEN)
    before = api.model_info("writer/paths").sha
    hook = b"[core]\n\tfsmonitor = touch /tmp/owned\n"
    for path in (".git/config", "sub/.git/config", ".Git/config", "GIT~1/config", "a/git~12/HEAD"):
        r = raw_commit(hub.url, "writer/paths", {path: hook})
        assert r.status_code == 400 and "'.git' segment" in r.json()["error"], (path, r.text)
    r = raw_commit(hub.url, "writer/paths", {f"{CARD_FILE}/x": b"shadow"})
    assert (
        r.status_code == 400
        and f"'{CARD_FILE}' is a file and the folder of '{CARD_FILE}/x'" in r.json()["error"]
    )
    assert api.model_info("writer/paths").sha == before


def test_hub_refuses_files_that_run_code_naming_them(hub, good, tmp_path):
    """The review's files, each pushed with huggingface_hub's upload_file: refused with a 400
    naming the file, and nothing stored."""
    api = HfApi(token=WRITE_TOKEN)
    api.create_repo("writer/runs-code")
    push_repo(good, "writer/runs-code", token=WRITE_TOKEN)
    before = api.model_info("writer/runs-code").sha
    for name, content in _what_runs(tmp_path).items():
        with pytest.raises(BadRequestError, match=f"{name}: ") as err:
            api.upload_file(path_or_fileobj=content, path_in_repo=name, repo_id="writer/runs-code")
        assert "does not verify, nothing was stored" in str(err.value)
    assert api.model_info("writer/runs-code").sha == before
    # what the allow list names is published and served
    api.upload_file(
        path_or_fileobj=_image("PNG"), path_in_repo="plot.png", repo_id="writer/runs-code"
    )
    assert api.model_info("writer/runs-code").sha != before


def test_resolve_says_nosniff_on_every_answer(hub, good):
    """A browser never takes a served repo file for HTML or script, whatever its bytes look like:
    whole files, ranges, HEAD, and errors."""
    push_repo(good, "writer/nosniff", token=WRITE_TOKEN)
    base = f"{hub.url}/writer/nosniff/resolve/main"
    answers = [
        httpx.get(f"{base}/{CARD_FILE}"),
        httpx.get(f"{base}/{CONFIG_FILE}", headers={"Range": "bytes=0-9"}),
        httpx.head(f"{base}/{WEIGHTS_FILE}"),
        httpx.get(f"{base}/missing.txt"),
        httpx.get(f"{hub.url}/writer/no-such-repo/resolve/main/{CARD_FILE}"),
        httpx.get(f"{base}/..%2Fsecret"),
    ]
    assert [r.status_code for r in answers] == [200, 206, 200, 404, 404, 400]
    assert [r.headers.get("x-content-type-options") for r in answers] == ["nosniff"] * 6
