"""Private datasets: images, or image-caption pairs, by index.

``open_images(path)`` picks the layout: a directory holding ``*.tar`` files is read as
shards (each image member one example; captions and labels ignored), anything else as an
image folder searched recursively (class subfolders allowed, labels ignored; hidden files and
everything under a hidden folder, such as ``.thumbnails/``, are not examples, in a folder as in a
shard).
``open_captions(path)`` reads image-caption pairs: webdataset tar shards (an image member
``KEY.jpg``/``KEY.png``/... and its caption ``KEY.txt`` per sample) or a folder with a
``captions.jsonl`` (one ``{"image": relative path, "caption": text}`` per line). Examples are
addressed by a stable index (sorted paths, tar order, or the order of the lines), which
Poisson sampling needs. No hash of the contents is kept: a released ledger names a dataset by its
declared name only (a plain hash would let anyone confirm a candidate dataset). Anything
malformed is a DataError naming the file: every image is decoded when the data is opened (not
an image, over ``MAX_PIXELS``, truncated or corrupt, is refused before n is counted), and a file
that cannot be read later (gone since) is one too.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import IO, Any, Protocol, cast

import torch
from PIL import Image
from torchvision.transforms import v2
from tqdm.auto import tqdm

from vip_hub.errors import DataError, MissingInputError, UnsafePathError
from vip_hub.images import to_rgb
from vip_hub.paths import validate_relpath

from ..dp.sampling import AUGMENT, torch_generator

__all__ = [
    "CAPTIONS_FILE",
    "CaptionFolder",
    "ImageFolder",
    "PrivateCaptions",
    "PrivateImages",
    "Pictures",
    "TarShards",
    "CROP_SCALE",
    "MAE_AUGMENTATION",
    "contrastive_transform",
    "greyscale_transform",
    "mae_transform",
    "open_captions",
    "open_images",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".gif", ".tif", ".tiff")
MAX_PIXELS = 64_000_000
CAPTIONS_FILE = "captions.jsonl"
MAX_CAPTION_BYTES = 64 * 1024
_UNDECODABLE = (OSError, ValueError, Image.DecompressionBombError)


class Pictures(Protocol):
    """Anything that numbers RGB PIL images (private folders, procedural streams)."""

    def __len__(self) -> int: ...

    def load(self, index: int) -> Image.Image: ...


class PrivateImages(torch.utils.data.Dataset):
    """Index -> RGB PIL image, made RGB as the service makes it (``vip_hub.images.to_rgb``:
    upright by its EXIF orientation, 16-bit greyscale scaled to 8 bits)."""

    name: str

    def __len__(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def load(self, index: int) -> Image.Image:  # pragma: no cover - interface
        raise NotImplementedError

    @staticmethod
    def _decode(data: bytes, where: str) -> Image.Image:
        img = _header(io.BytesIO(data), where)
        try:
            return to_rgb(img)
        except _UNDECODABLE as e:
            raise _undecodable(where, e) from e


def _undecodable(where: str, why: object) -> DataError:
    """The error for an image ``where`` that does not decode, because of ``why``."""
    return DataError(f"cannot decode image {where}: {why}")


def _header(source: Path | IO[bytes], where: str) -> Image.Image:
    """``source`` opened as an image (its header read, nothing decoded) of at most ``MAX_PIXELS``
    pixels; else a DataError naming ``where``."""
    try:
        img = Image.open(source)
    except _UNDECODABLE as e:
        raise _undecodable(where, e) from e
    if img.width * img.height > MAX_PIXELS:
        img.close()
        raise _undecodable(where, f"{img.width}x{img.height} pixels is over the {MAX_PIXELS} limit")
    return img


def _read(path: Path, where: str, offset: int = 0, size: int = -1) -> bytes:
    """``size`` bytes of ``path`` from ``offset`` (all by default); a DataError naming ``where`` if
    it cannot be read (say, gone since the examples were counted)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(size)
    except OSError as e:
        raise DataError(f"cannot read {where}: {e}") from None


def _hidden(parts: Sequence[str]) -> bool:
    """Whether a path (its parts under the data's root) is hidden: a hidden file (macOS's
    ``._name.jpg``) or anything under a hidden folder (``.thumbnails/``, ``.Trash-1000/``)."""
    return any(part.startswith(".") for part in parts)


def _where(shard: Path, member: str) -> str:
    """How messages name a member of a tar shard."""
    return f"{shard.name}:{member}"


def _each_an_image(files: Sequence[Path]) -> None:
    """DataError unless every path of ``files`` is a file of its own (``_one_name_each``) that
    decodes whole as ``load`` decodes it (within ``MAX_PIXELS``, no truncated or corrupt body):
    n counts only examples that load, and a bad file is found when the data is opened, not at
    the step that first samples it (one decoding pass, about an epoch's)."""
    _one_name_each(files)
    for path in tqdm(files, desc="checking images", unit="img", leave=False, disable=None):
        PrivateImages._decode(_read(path, str(path)), str(path)).close()


def _one_name_each(files: Sequence[Path]) -> None:
    """DataError unless every path of ``files`` is a file of its own: one file under two names (a
    link) would be two examples, and the guarantee is per example."""
    seen: dict[tuple[int, int], Path] = {}
    for path in files:
        st = path.stat()
        first = seen.setdefault((st.st_dev, st.st_ino), path)
        if first != path:
            raise DataError(
                f"{first} and {path} are one file (a link): an image may be counted once, "
                "the guarantee is per example"
            )


def _tell_left_out(paths: Sequence[Path], root: Path, what: str, first: int = 3) -> None:
    """One warning line on stderr for entries left out of the examples (``what`` they are): not
    examples, but their records are lost, so the user is told."""
    if paths:
        names = ", ".join(str(p) for p in paths[:first]) + (", ..." if len(paths) > first else "")
        print(
            f"warning: {root}: {len(paths)} {what} left out of the examples: {names}",
            file=sys.stderr,
        )


class _ImageFiles(PrivateImages):
    """Examples that are image files, ``files`` (decoded from disk when loaded)."""

    files: list[Path]

    def __len__(self) -> int:
        return len(self.files)

    def load(self, index: int) -> Image.Image:
        path = self.files[index]
        return self._decode(_read(path, str(path)), str(path))


class ImageFolder(_ImageFiles):
    """Every image file under ``root`` (recursively), in sorted path order; hidden files and
    folders (``_hidden``) are not searched; every file is checked (``_each_an_image``)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.name = self.root.name
        named = sorted(
            p
            for p in self.root.rglob("*")
            if p.suffix.lower() in IMAGE_EXTENSIONS and not _hidden(p.relative_to(self.root).parts)
        )
        self.files = [p for p in named if p.is_file()]
        _tell_left_out(
            [p for p in named if not p.is_file() and not p.is_dir()],
            self.root,
            "of the entries named as images (neither a file nor a folder: a broken link?)",
        )
        linked = (  # rglob does not enter them
            p
            for p in self.root.rglob("*")
            if p.is_symlink() and p.is_dir() and not _hidden(p.relative_to(self.root).parts)
        )
        _tell_left_out(sorted(linked), self.root, "links to folders (not searched)")
        if not self.files:
            raise DataError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {self.root}")
        _each_an_image(self.files)


class PrivateCaptions(PrivateImages):
    """Index -> RGB PIL image and its caption."""

    def caption(self, index: int) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    @staticmethod
    def _text(data: bytes, where: str) -> str:
        """A caption's text: UTF-8, stripped, not empty, at most ``MAX_CAPTION_BYTES``."""
        if len(data) > MAX_CAPTION_BYTES:
            raise DataError(f"caption {where} is over {MAX_CAPTION_BYTES} bytes")
        try:
            text = data.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise DataError(f"caption {where} is not UTF-8 text ({e})") from None
        if not text:
            raise DataError(f"caption {where} is empty")
        return text


def _sample_key(name: str) -> tuple[str, str]:
    """webdataset's split of a member name: (folder/basename up to its first dot, the rest)."""
    path = PurePosixPath(name)
    base, _, ext = path.name.partition(".")
    return str(path.parent / base), ext.lower()


class TarShards(PrivateCaptions):
    """The samples of the ``*.tar`` shards in ``root`` (webdataset layout), indexed once, in
    shard and tar order. Without ``captions`` every image member is an example; with them every
    sample must hold exactly one image and one ``.txt`` caption."""

    def __init__(self, root: str | os.PathLike[str], captions: bool = False):
        self.root = Path(root)
        self.name = self.root.name
        self.shards = sorted(self.root.glob("*.tar"))
        self.members: list[tuple[int, int, int]] = []  # images: (shard, data offset, size)
        self.texts: list[
            tuple[int, int, int]
        ] = []  # captions, when read: (shard, data offset, size)
        self.names: list[str] = []  # each example's image member
        for s, shard in enumerate(self.shards):
            images: dict[str, tarfile.TarInfo] = {}
            texts: dict[str, tarfile.TarInfo] = {}
            try:
                with tarfile.open(shard, "r:") as tar:  # members are read in place: no compression
                    stored: set[str] = set()
                    for m in tar:
                        if not m.isfile() or _hidden(PurePosixPath(m.name).parts):
                            continue
                        key, ext = _sample_key(m.name)
                        if "." + ext in IMAGE_EXTENSIONS and m.name in stored:
                            raise DataError(
                                f"{shard}: member {m.name!r} is stored twice: an image may be "
                                "counted once, the guarantee is per example"
                            )
                        if "." + ext in IMAGE_EXTENSIONS:
                            data = cast(IO[bytes], tar.extractfile(m))  # a regular file's
                            PrivateImages._decode(data.read(), _where(shard, m.name)).close()
                        stored.add(m.name)
                        if "." + ext in IMAGE_EXTENSIONS and not captions:
                            self._add(s, m)
                        elif "." + ext in IMAGE_EXTENSIONS:
                            if key in images:
                                raise DataError(
                                    f"{shard}: sample {key!r} has two images ({images[key].name}, "
                                    f"{m.name}); a sample is one image and one caption"
                                )
                            images[key] = m
                        elif ext == "txt" and captions:
                            if key in texts:
                                raise DataError(
                                    f"{shard}: sample {key!r} has two captions ({texts[key].name}, "
                                    f"{m.name}); a sample is one image and one caption"
                                )
                            texts[key] = m
            except (tarfile.TarError, OSError) as e:
                raise DataError(
                    f"{shard}: not a readable uncompressed tar file ({e}); shards are plain tar"
                ) from None
            if captions:
                self._pair(s, shard, images, texts)
        if not self.members:
            raise DataError(f"no image members in the tar shards under {self.root}")

    def _add(self, shard: int, image: tarfile.TarInfo, text: tarfile.TarInfo | None = None) -> None:
        self.members.append((shard, image.offset_data, image.size))
        self.names.append(image.name)
        if text is not None:
            self.texts.append((shard, text.offset_data, text.size))

    def _pair(
        self,
        s: int,
        shard: Path,
        images: dict[str, tarfile.TarInfo],
        texts: dict[str, tarfile.TarInfo],
    ) -> None:
        lonely = sorted(set(texts) - set(images))
        if lonely:
            raise DataError(
                f"{shard}: sample {lonely[0]!r} has a caption ({texts[lonely[0]].name}) but no "
                "image"
            )
        for key, image in images.items():
            if key not in texts:
                raise DataError(
                    f"{shard}: sample {key!r} ({image.name}) has no caption ({key}.txt)"
                )
            self._add(s, image, texts[key])

    def __len__(self) -> int:
        return len(self.members)

    def _read(self, member: tuple[int, int, int], name: str) -> tuple[bytes, str]:
        """The bytes of ``member`` (named ``name`` in its shard) and how messages name it."""
        s, offset, size = member
        where = _where(self.shards[s], name)
        return _read(self.shards[s], where, offset, size), where

    def load(self, index: int) -> Image.Image:
        return self._decode(*self._read(self.members[index], self.names[index]))

    def caption(self, index: int) -> str:
        if not self.texts:
            raise DataError(f"{self.root} was opened without captions")
        key = _sample_key(self.names[index])[0]
        return self._text(*self._read(self.texts[index], f"{key}.txt"))


class CaptionFolder(_ImageFiles, PrivateCaptions):
    """The pairs listed in ``root/captions.jsonl``, one ``{"image": path relative to root,
    "caption": text}`` per line (blank lines skipped), in the order of the lines. An image may
    be listed once: the guarantee is per example, and an example is one image."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.name = self.root.name
        self.file = self.root / CAPTIONS_FILE
        self.files: list[Path] = []
        self.captions: list[str] = []
        try:
            lines = self.file.read_bytes().decode("utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise DataError(f"{self.file} is not UTF-8 text ({e})") from None
        seen: dict[str, int] = {}
        for number, line in enumerate(lines, 1):
            if line.strip():
                where = f"{self.file}:{number}"
                rel, caption = self._entry(line, where)
                if rel in seen:
                    raise DataError(
                        f"{where}: image {rel!r} is already listed on line {seen[rel]} (one "
                        "caption per image: the guarantee is per example)"
                    )
                seen[rel] = number
                self.files.append(self.root / rel)
                self.captions.append(caption)
        if not self.files:
            raise DataError(f"{self.file} lists no image-caption pairs")
        _each_an_image(self.files)

    def _entry(self, line: str, where: str) -> tuple[str, str]:
        """One line's (image path, caption), checked."""
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
            raise DataError(f"{where}: not JSON ({e})") from None
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("image"), str)
            and isinstance(entry.get("caption"), str)
        ):
            raise DataError(f'{where}: expected {{"image": relative path, "caption": text}}')
        rel = entry["image"]
        try:
            validate_relpath(rel)
        except UnsafePathError as e:
            raise DataError(f"{where}: image path {e}") from None
        if PurePosixPath(rel).suffix.lower() not in IMAGE_EXTENSIONS:
            raise DataError(
                f"{where}: {rel!r} is not an image file ({', '.join(IMAGE_EXTENSIONS)})"
            )
        if not (self.root / rel).is_file():
            raise DataError(f"{where}: image {rel!r} not found under {self.root}")
        try:
            data = entry["caption"].encode()
        except UnicodeEncodeError as e:  # a lone surrogate escaped in the JSON (\ud83d)
            raise DataError(f"caption {where} is not UTF-8 text ({e})") from None
        return rel, self._text(data, where)

    def caption(self, index: int) -> str:
        return self.captions[index]


def open_images(path: str | os.PathLike[str]) -> PrivateImages:
    """An image folder or a directory of tar shards; a clear error for anything else."""
    root = Path(path)
    if not root.is_dir():
        raise MissingInputError(f"dataset {root} is not a directory")
    return TarShards(root) if any(root.glob("*.tar")) else ImageFolder(root)


def open_captions(path: str | os.PathLike[str]) -> PrivateCaptions:
    """Image-caption pairs: a directory of tar shards, or a folder with a ``captions.jsonl``."""
    root = Path(path)
    if not root.is_dir():
        raise MissingInputError(f"dataset {root} is not a directory")
    if any(root.glob("*.tar")):
        return TarShards(root, captions=True)
    if (root / CAPTIONS_FILE).is_file():
        return CaptionFolder(root)
    raise DataError(
        f"{root} holds neither webdataset tar shards (*.tar with KEY.jpg/KEY.png and KEY.txt per "
        f'sample) nor a {CAPTIONS_FILE} (one {{"image": relative path, "caption": text}} per line)'
    )


CROP_SCALE = (0.2, 1.0)
"""The random resized crop's range of areas (the reference MAE's)."""
MAE_AUGMENTATION = f"random resized crop ({CROP_SCALE[0]:g}-{CROP_SCALE[1]:g}), flip"
"""What ``mae_transform`` does, in the words a ledger stage records."""


def mae_transform(encoder: torch.nn.Module, img_size: int) -> v2.Compose:
    """The reference MAE pretraining augmentation: random resized crop (0.2-1) and flip, to
    ``img_size``, then the timm ``encoder``'s normalisation (its ``pretrained_cfg`` mean, std)."""
    # set by timm's create_model (a Module's unknown attribute types as Tensor | Module)
    cfg = cast(dict[str, Any], encoder.pretrained_cfg)
    return _augmented(img_size, tuple(cfg["mean"]), tuple(cfg["std"]))


def _augmented(
    img_size: int, mean: tuple[float, ...], std: tuple[float, ...], *colour: v2.Transform
) -> v2.Compose:
    """Random resized crop (0.2-1, bicubic) and flip, then ``colour``, then normalisation."""
    return v2.Compose(
        [
            v2.ToImage(),
            v2.RandomResizedCrop(
                img_size,
                scale=CROP_SCALE,
                interpolation=v2.InterpolationMode.BICUBIC,
                antialias=True,
            ),
            v2.RandomHorizontalFlip(),
            *colour,
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(mean), std=list(std)),
        ]
    )


def contrastive_transform(
    img_size: int, mean: tuple[float, ...], std: tuple[float, ...]
) -> v2.Compose:
    """SimCLR's augmentation (Chen et al. 2020) for contrastive views: random resized crop
    (0.2-1), flip, colour jitter (0.4, 0.4, 0.4, 0.1) with probability 0.8, greyscale with
    probability 0.2 (no blur: the images are tiny)."""
    return _augmented(
        img_size,
        mean,
        std,
        v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        v2.RandomGrayscale(p=0.2),
    )


def greyscale_transform() -> v2.Compose:
    """Greyscale in [0, 1], (1, H, W), inverted with probability 1/2 (dark objects on light ground
    and the other way round), for the (Syn) ScatterNet distillation."""
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Grayscale(1),
            v2.RandomInvert(p=0.5),
            v2.ToDtype(torch.float32, scale=True),
        ]
    )


class Augmented(torch.utils.data.Dataset):
    """Items are ``(index, step)``: image ``index`` augmented by the stream of (seed, step, index),
    so an example's augmentation does not depend on its micro-batch, worker or batch-mates."""

    def __init__(self, images: Pictures, transform: v2.Compose, seed: int):
        self.images, self.transform, self.seed = images, transform, seed

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, item: tuple[int, int]) -> torch.Tensor:
        return self.views(*item, count=1)[0]

    def views(self, index: int, step: int, count: int) -> list[torch.Tensor]:
        """``count`` independent augmentations of image ``index`` at ``step``, drawn one after the
        other from that example's stream (the first is ``self[index, step]``)."""
        image = self.images.load(index)
        with torch.random.fork_rng(devices=[]):
            # the CPU generator only: torch.manual_seed would also queue lazy seeds for every
            # accelerator backend, each recording a stack trace (milliseconds per example)
            torch.default_generator.manual_seed(
                int(torch_generator(self.seed, AUGMENT, step, index).initial_seed())
            )
            return [self.transform(image) for _ in range(count)]
