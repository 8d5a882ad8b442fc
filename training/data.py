"""Private image datasets: an image folder or webdataset-style tar shards, by index.

``open_images(path)`` picks the layout: a directory holding ``*.tar`` files is read as
shards (each image member one example; keys grouping ``.jpg``/``.txt``/... as webdataset
does, labels and captions ignored), anything else as an image folder searched recursively
(class subfolders allowed, labels ignored). Examples are addressed by a stable index (sorted
paths), which Poisson sampling needs; ``fingerprint()`` hashes the exact contents so the
ledger pins the dataset.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import torch
from PIL import Image
from torchvision.transforms import v2

from vip_hub.errors import DataError, MissingInputError

from .sampling import AUGMENT, torch_generator

__all__ = ["ImageFolder", "PrivateImages", "TarShards", "mae_transform", "open_images"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".gif", ".tif", ".tiff")
MAX_PIXELS = 64_000_000


class PrivateImages(torch.utils.data.Dataset):
    """Index -> RGB PIL image, plus a content fingerprint."""

    name: str

    def load(self, index: int) -> Image.Image:  # pragma: no cover - interface
        raise NotImplementedError

    def fingerprint(self) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    @staticmethod
    def _decode(data: bytes, where: str) -> Image.Image:
        try:
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > MAX_PIXELS:
                raise DataError(f"{img.width}x{img.height} pixels is over the {MAX_PIXELS} limit")
            return img.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise DataError(f"cannot decode image {where}: {e}") from e


class ImageFolder(PrivateImages):
    """Every image file under ``root`` (recursively), in sorted path order."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.name = self.root.name
        self.files = sorted(
            p for p in self.root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
        )
        if not self.files:
            raise DataError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {self.root}")

    def __len__(self) -> int:
        return len(self.files)

    def load(self, index: int) -> Image.Image:
        path = self.files[index]
        return self._decode(path.read_bytes(), str(path))

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for p in self.files:
            h.update(p.relative_to(self.root).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(p.read_bytes()).digest())
        return "sha256:" + h.hexdigest()


class TarShards(PrivateImages):
    """Image members of the ``*.tar`` shards in ``root`` (webdataset layout), indexed once."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.name = self.root.name
        self.shards = sorted(self.root.glob("*.tar"))
        self.members: list[tuple[int, int, int]] = []  # (shard, data offset, size)
        for s, shard in enumerate(self.shards):
            with tarfile.open(shard) as tar:
                for m in tar:
                    if m.isfile() and Path(m.name).suffix.lower() in IMAGE_EXTENSIONS:
                        self.members.append((s, m.offset_data, m.size))
        if not self.members:
            raise DataError(f"no image members in the tar shards under {self.root}")

    def __len__(self) -> int:
        return len(self.members)

    def load(self, index: int) -> Image.Image:
        s, offset, size = self.members[index]
        with open(self.shards[s], "rb") as f:
            f.seek(offset)
            data = f.read(size)
        return self._decode(data, f"{self.shards[s].name}@{offset}")

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for p in self.shards:
            h.update(p.name.encode() + b"\0")
            with open(p, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        return "sha256:" + h.hexdigest()


def open_images(path: str | os.PathLike[str]) -> PrivateImages:
    """An image folder or a directory of tar shards; a clear error for anything else."""
    root = Path(path)
    if not root.is_dir():
        raise MissingInputError(f"dataset {root} is not a directory")
    return TarShards(root) if any(root.glob("*.tar")) else ImageFolder(root)


def mae_transform(img_size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> v2.Compose:
    """The reference MAE pretraining augmentation: random resized crop (0.2-1) and flip."""
    return v2.Compose([
        v2.ToImage(),
        v2.RandomResizedCrop(img_size, scale=(0.2, 1.0), interpolation=v2.InterpolationMode.BICUBIC,
                             antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=list(mean), std=list(std)),
    ])


class Augmented(torch.utils.data.Dataset):
    """Items are ``(index, step)``: image ``index`` augmented by the stream of (seed, step),
    so an example's augmentation does not depend on its micro-batch or worker."""

    def __init__(self, images: PrivateImages, transform: v2.Compose, seed: int):
        self.images, self.transform, self.seed = images, transform, seed

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, item: tuple[int, int]) -> torch.Tensor:
        index, step = item
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch_generator(self.seed, AUGMENT, step, index).initial_seed()))
            return self.transform(self.images.load(index))
