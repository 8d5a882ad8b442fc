"""Labelled benchmark data held as arrays: Fashion-MNIST (IDX files), its fetch and its subsets.

Fashion-MNIST is Debian's package ``dataset-fashion-mnist``: four gzipped IDX files under
``/usr/share/datasets/fashion-mnist/``. ``fashion_mnist(split)`` reads them from ``--data`` (the
folder of the four IDX files, gzipped or not, or an image folder with ``train/`` and ``test/``
class subfolders), else from the package, installing it when missing (``apt-get install`` as
root, otherwise ``apt-get download`` and ``dpkg -x`` into the work folder); where none of these
works a DataError names the package and ``--data``. The train split is private (declared as
``FASHION_MNIST_TRAIN``), the standard test split public; the budget on it and its split rule
are the study's (``training/study``).

Subsets of private data are chosen by a public rule (``LabelledArrays.first``: the first n
records, n declared) or per record by a keyed hash (``keyed_uniforms``): either way a record's
membership never depends on another record.

Arrays become the folders the recipes and the probe read: ``write_image_folder`` (PNG class
folders, ``training/data/images.py``'s ``open_images``, ``training/recipes/probe.py``'s
``load_labelled``) and ``write_caption_folder`` (the same with a ``captions.jsonl``,
``open_captions``), each caption the public ``CAPTION_TEMPLATE`` over its class name. So captions,
DP-Cap's vocabulary (``class_vocabulary``) and its public curve's captions
(``class_public_captions``) are made from the class names alone and are public by construction.
"""

from __future__ import annotations

import gzip
import hashlib
import hmac
import json
import math
import os
import shutil
import subprocess
import tempfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from vip_hub.errors import ConfigError, DataError
from vip_hub.models.text_decoder import DEFAULT_PROMPT
from vip_hub.models.tokenizer import public_vocab
from vip_hub.paths import replace_dir
from vip_hub.privacy.ledger import Dataset
from vip_hub.repo_format import VOCAB_FILE

__all__ = [
    "CAPTION_TEMPLATE",
    "DATA_DIR",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_PACKAGE",
    "FASHION_MNIST_TEST",
    "FASHION_MNIST_TRAIN",
    "PUBLIC_CAPTIONS_FILE",
    "LabelledArrays",
    "caption_text_paths",
    "class_folder",
    "head_class_order",
    "class_public_captions",
    "class_vocabulary",
    "fashion_mnist",
    "fetch_fashion_mnist",
    "keyed_uniforms",
    "read_idx",
    "write_caption_folder",
    "write_caption_texts",
    "write_image_folder",
]

FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
DATA_DIR = Path("var/data")
"""Where a dataset a package ships is fetched when it is missing and no folder is given."""
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
FASHION_MNIST_TRAIN = "public-benchmarks/fashion-mnist-train"
"""The private split's declared name: every DP stage on it names it, so they compose."""
FASHION_MNIST_TEST = "public-benchmarks/fashion-mnist-test"
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FASHION_MNIST_SIDE = 28
CAPTION_TEMPLATE = DEFAULT_PROMPT + " {name}"
"""Every image's caption: the zero-shot prompt (``DEFAULT_PROMPT``) then its class name, so
DP-Cap is trained on the very texts zero-shot scores, and no caption depends on pixels."""
PUBLIC_CAPTIONS_FILE = "public-captions.txt"
"""``write_caption_texts``' file of the public captions (DP-Cap's ``--public-captions``)."""

# IDX type codes (the third byte of the magic number) and their big-endian dtypes
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """An IDX file (gzipped or not) as an array; a wrong magic, a truncated file or a size
    that does not match its dimensions is a DataError naming the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == _GZIP_MAGIC:
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _IDX_TYPES or raw[3] == 0:
        raise DataError(
            f"{path}: not an IDX file (magic {raw[:4].hex() or 'missing'}; expected 0000, a type "
            f"code in {sorted(_IDX_TYPES)}, and a dimension count)"
        )
    dtype, ndim = np.dtype(_IDX_TYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(
            f"{path}: truncated IDX header ({len(raw)} bytes, {ndim} dimensions need {header})"
        )
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, 4))
    expected = header + math.prod(dims) * dtype.itemsize  # (exact: an int64 product wraps)
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "longer than its dimensions say"
        raise DataError(
            f"{path}: {what}: dimensions {dims} of {dtype.name} need {expected} bytes, "
            f"the file has {len(raw)}"
        )
    return np.frombuffer(raw, dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def keyed_uniforms(
    key: bytes, purpose: str, records: Iterable[bytes | Path], labels: np.ndarray
) -> np.ndarray:
    """One number in [0, 1) per record (its bytes, or a file's): HMAC-SHA256 under ``key`` of
    the record and its label. A record's number depends on that record alone, so subsets
    chosen by threshold are stable when any other record comes or goes; without the key the
    numbers are unpredictable."""
    out = np.empty(len(labels))
    for i, (record, y) in enumerate(zip(records, labels, strict=True)):
        data = record.read_bytes() if isinstance(record, Path) else record
        digest = hmac.new(
            key, purpose.encode() + b"\0" + str(int(y)).encode() + b"\0" + data, hashlib.sha256
        ).digest()
        out[i] = int.from_bytes(digest[:8], "big") / 2.0**64
    return out


@dataclass
class LabelledArrays:
    """Grey images (n, h, w) uint8 with integer labels, class names and the ledger's identity."""

    images: np.ndarray
    labels: np.ndarray
    classes: tuple[str, ...]
    dataset: Dataset

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: np.ndarray, rule: str) -> LabelledArrays:
        """The records at ``indices`` under the same declared name (stages on it compose), with
        n and the rule declared."""
        n = len(indices)
        if n == 0:
            raise DataError(f"{self.dataset.name}: the subset ({rule}) is empty")
        dataset = Dataset(
            name=self.dataset.name,
            size=n,
            description=f"{n} of the {len(self)} records of {self.dataset.name}, {rule}",
        )
        return LabelledArrays(self.images[indices], self.labels[indices], self.classes, dataset)

    def first(self, n: int) -> LabelledArrays:
        """The first ``n`` records in file order: a public rule, so no record's membership
        depends on another."""
        if n >= len(self):
            return self
        return self.subset(np.arange(n), f"the first {n} in file order (a public rule)")

    def pil(self, index: int) -> Image.Image:
        """Record ``index`` as a greyscale PIL image."""
        return Image.fromarray(self.images[index], mode="L")


def _idx_pair(folder: Path, split: str) -> tuple[Path, Path] | None:
    """The split's image and label IDX files in ``folder`` (``.gz`` or not), if both are there."""
    found = []
    for stem in FASHION_MNIST_FILES[split]:
        candidates = [folder / f"{stem}.gz", folder / stem]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            return None
        found.append(path)
    return found[0], found[1]


def fetch_fashion_mnist(
    work_dir: str | os.PathLike[str], system_dir: Path = FASHION_MNIST_DIR
) -> Path:
    """The folder of the four IDX files: the installed package's, else installed now
    (``apt-get install`` as root), else unpacked into ``work_dir`` (``apt-get download``,
    ``dpkg -x``). A DataError names the package and ``--data`` when none of these works."""
    downloads = Path(work_dir) / "debian"
    local = downloads / FASHION_MNIST_DIR.relative_to(
        FASHION_MNIST_DIR.anchor
    )  # where dpkg -x puts the files
    for folder in (system_dir, local):
        if all(_idx_pair(folder, s) for s in FASHION_MNIST_FILES):
            return folder
    apt, dpkg = shutil.which("apt-get"), shutil.which("dpkg")
    tried: list[str] = []
    if (
        apt
        and os.geteuid() == 0
        and _run([apt, "update", "-q"], tried)
        and _run([apt, "install", "-y", "-q", FASHION_MNIST_PACKAGE], tried)
        and all(_idx_pair(system_dir, s) for s in FASHION_MNIST_FILES)
    ):
        return system_dir
    if apt and dpkg:
        downloads.mkdir(parents=True, exist_ok=True)
        if _run([apt, "download", FASHION_MNIST_PACKAGE], tried, cwd=downloads):
            for deb in sorted(downloads.glob(f"{FASHION_MNIST_PACKAGE}_*.deb")):
                _run([dpkg, "-x", str(deb), str(downloads)], tried)
            if all(_idx_pair(local, s) for s in FASHION_MNIST_FILES):
                return local
            tried.append(f"the unpacked package has no IDX files under {local}")
    why = "; ".join(tried) if tried else "apt-get and dpkg are not on PATH"
    raise DataError(
        f"Fashion-MNIST is not installed and could not be fetched ({why}). Install the Debian "
        f"package {FASHION_MNIST_PACKAGE} (apt-get install {FASHION_MNIST_PACKAGE}), or pass "
        "--data FOLDER: the folder of its four IDX files (train-/t10k-images-idx3-ubyte, "
        "train-/t10k-labels-idx1-ubyte, gzipped or not) or an image folder with train/ and test/ "
        "class subfolders"
    )


def _run(cmd: list[str], tried: list[str], cwd: Path | None = None) -> bool:
    """Run ``cmd``; on failure note it (with the end of its output) in ``tried``."""
    try:
        done = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=600, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        tried.append(f"{' '.join(cmd[:2])}: {e}")
        return False
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        tried.append(f"{Path(cmd[0]).name} {cmd[1]}: {tail[0]}")
    return done.returncode == 0


def _read_idx_split(
    images_file: Path, labels_file: Path, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """A split's images (n, 28, 28) uint8 and labels (n,), checked against each other."""
    images, labels = read_idx(images_file), read_idx(labels_file)
    if (
        images.dtype != np.uint8
        or images.ndim != 3
        or images.shape[1:] != (FASHION_MNIST_SIDE,) * 2
    ):
        raise DataError(
            f"{images_file}: expected uint8 images n x {FASHION_MNIST_SIDE} x "
            f"{FASHION_MNIST_SIDE}, found {images.dtype.name} {images.shape}"
        )
    if not len(images):
        raise DataError(f"{images_file}: holds no images (its dimensions are {images.shape})")
    if labels.dtype != np.uint8 or labels.ndim != 1 or len(labels) != len(images):
        raise DataError(
            f"{labels_file}: expected {len(images)} uint8 labels (one per image of "
            f"{images_file.name}), found {labels.dtype.name} {labels.shape}"
        )
    if len(labels) and labels.max() >= len(FASHION_MNIST_CLASSES):
        raise DataError(
            f"{labels_file}: label {labels.max()} is not one of the "
            f"{len(FASHION_MNIST_CLASSES)} classes of {name}"
        )
    return images, labels.astype(np.int64)


def _read_image_split(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """An image folder with one subfolder per class (named by ``class_folder`` of a
    ``FASHION_MNIST_CLASSES`` name, or by class index), as 28 x 28 grey arrays in sorted path
    order."""
    from .images import ImageFolder

    images = ImageFolder(folder)
    index = {class_folder(c): i for i, c in enumerate(FASHION_MNIST_CLASSES)}
    index |= {str(i): i for i in range(len(FASHION_MNIST_CLASSES))}
    pixels, labels = [], []
    for i, path in enumerate(images.files):
        parts = path.relative_to(folder).parts
        if len(parts) < 2 or parts[0] not in index:
            raise DataError(
                f"{path}: not in a class subfolder of {folder} (one of {sorted(index)})"
            )
        grey = (
            images.load(i).convert("L").resize((FASHION_MNIST_SIDE,) * 2, Image.Resampling.BILINEAR)
        )
        pixels.append(np.asarray(grey, dtype=np.uint8))
        labels.append(index[parts[0]])
    return np.stack(pixels), np.asarray(labels, dtype=np.int64)


def fashion_mnist(
    split: Literal["train", "test"],
    data: str | os.PathLike[str] | None = None,
    work_dir: str | os.PathLike[str] = DATA_DIR,
) -> LabelledArrays:
    """Fashion-MNIST's ``split`` from ``data`` (IDX folder or image folder) or the Debian package
    (fetched into ``work_dir`` when missing). Train is declared as the private
    ``FASHION_MNIST_TRAIN``."""
    if split not in FASHION_MNIST_FILES:
        raise DataError(f"unknown split {split!r}: train or test")
    name = FASHION_MNIST_TRAIN if split == "train" else FASHION_MNIST_TEST
    if data is None:
        folder = fetch_fashion_mnist(work_dir)
    else:
        folder = Path(data)
        if not folder.is_dir():
            raise DataError(
                f"--data {folder} is not a folder (give the four IDX files' folder or an image "
                "folder with train/ and test/ class subfolders)"
            )
    pair = _idx_pair(folder, split)
    if pair is not None:
        images, labels = _read_idx_split(*pair, name)
    elif (folder / split).is_dir():
        images, labels = _read_image_split(folder / split)
    else:
        raise DataError(
            f"{folder} holds neither the {split} IDX files "
            f"({', '.join(FASHION_MNIST_FILES[split])}, gzipped or not) nor an image folder "
            f"{split}/ with one subfolder per class"
        )
    dataset = Dataset(
        name=name,
        size=len(labels),
        description=f"Fashion-MNIST {split} split: {len(labels)} grey 28x28 images, 10 classes"
        + (" (private)" if split == "train" else " (public)"),
    )
    return LabelledArrays(images, labels, FASHION_MNIST_CLASSES, dataset)


def class_folder(name: str) -> str:
    """The folder of class ``name`` in an image folder: the name with '/' as '-'
    ("T-shirt/top" -> "T-shirt-top"); an empty name, "." or ".." is a DataError."""
    folder = name.replace("/", "-")
    if not folder.strip() or folder in (".", "..") or "\0" in folder:
        raise DataError(f"class name {name!r} cannot name a folder")
    return folder


def head_class_order(classes: Sequence[str], head_labels: Sequence[str]) -> list[int]:
    """For each output of a head whose labels are class folder names (``class_folder``), the index
    of its class in ``classes``: ``order[logits.argmax(1)]`` answers in ``classes``' indices."""
    index = {class_folder(name): i for i, name in enumerate(classes)}
    return [index[label] for label in head_labels]


def class_public_captions(
    class_names: Sequence[str], template: str = CAPTION_TEMPLATE
) -> list[str]:
    """``template`` over each class name, in class order: every caption an image can get, so
    public text (DP-Cap's ``--public-captions`` for its curve on procedural images)."""
    if not class_names:
        raise DataError("no class names")
    try:
        return [template.format(name=name) for name in class_names]
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"caption template {template!r}: its only field is {{name}} (the class name): {e!r}"
        ) from None


def class_vocabulary(class_names: Sequence[str], template: str = CAPTION_TEMPLATE) -> bytes:
    """DP-Cap's public vocabulary file (``public_vocab``): BERT's special tokens, then the words
    of every class caption and of the zero-shot prompt; fixed before training, fitted on no
    private text."""
    return public_vocab([*class_public_captions(class_names, template), DEFAULT_PROMPT])


def caption_text_paths(folder: Path) -> tuple[Path, Path]:
    """Where ``write_caption_texts`` puts DP-Cap's public vocabulary and captions in ``folder``
    (``VOCAB_FILE``, ``PUBLIC_CAPTIONS_FILE``), in that order."""
    return folder / VOCAB_FILE, folder / PUBLIC_CAPTIONS_FILE


def write_caption_texts(folder: Path, class_names: Sequence[str]) -> tuple[Path, Path]:
    """DP-Cap's public vocabulary and captions over ``class_names`` written into ``folder``;
    their paths (``caption_text_paths``)."""
    vocab, captions = caption_text_paths(folder)
    vocab.write_bytes(class_vocabulary(class_names))
    captions.write_text("\n".join(class_public_captions(class_names)) + "\n", "utf-8")
    return vocab, captions


def write_image_folder(data: LabelledArrays, root: Path, class_names: Sequence[str]) -> Path:
    """``data`` as PNG class folders ``root/<class folder>/<index>.png`` (indices zero-padded, so
    sorted paths keep the records' order); written into a temporary sibling and put in place
    (``vip_hub.paths.replace_dir``), so ``root`` is whole (the old or the new) or absent. Returns
    ``root``."""
    return _write_folder(data, Path(root), class_names, lambda tmp, files: None)


def write_caption_folder(
    data: LabelledArrays,
    root: Path,
    class_names: Sequence[str],
    template: str = CAPTION_TEMPLATE,
) -> Path:
    """``write_image_folder`` plus a ``captions.jsonl`` (``training/data/images.py``'s
    ``open_captions``) listing the images in record order, each captioned by ``template`` over its
    class name."""
    from .images import CAPTIONS_FILE

    captions = class_public_captions(class_names, template)

    def write_captions(tmp: Path, files: list[str]) -> None:
        lines = (
            json.dumps({"image": f, "caption": captions[y]})
            for f, y in zip(files, data.labels, strict=True)
        )
        (tmp / CAPTIONS_FILE).write_text("".join(f"{line}\n" for line in lines), "utf-8")

    return _write_folder(data, Path(root), class_names, write_captions)


def _write_folder(
    data: LabelledArrays,
    root: Path,
    class_names: Sequence[str],
    finish: Callable[[Path, list[str]], None],
) -> Path:
    """The images of ``data`` in class folders under a temporary sibling of ``root``, then
    ``finish(tmp, relative paths in record order)``, then the sibling put in place of ``root``."""
    folders = [class_folder(name) for name in class_names]
    if len(set(folders)) != len(folders):
        raise DataError(f"class names {list(class_names)} name the same folder twice")
    if len(data) == 0:
        raise DataError(f"{data.dataset.name}: no records to write")
    if data.labels.min() < 0 or data.labels.max() >= len(folders):
        raise DataError(
            f"{data.dataset.name}: labels span {data.labels.min()}..{data.labels.max()}, "
            f"but {len(folders)} class names were given"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", suffix=".tmp", dir=root.parent))
    try:
        width = len(str(len(data) - 1))
        files = [f"{folders[y]}/{i:0{width}d}.png" for i, y in enumerate(data.labels)]
        for name in {folders[y] for y in data.labels}:
            (tmp / name).mkdir()
        for i, f in enumerate(files):
            data.pil(i).save(tmp / f)
        finish(tmp, files)
        replace_dir(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root
