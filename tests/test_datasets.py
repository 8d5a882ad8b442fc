"""Fashion-MNIST's data module (``training/datasets.py``): the IDX reader on files the test
writes (good and corrupt), the --data folder forms, public-rule and keyed subsets, and the
fetch's fallbacks and error path with apt-get absent or failing (no network)."""

from __future__ import annotations

import gzip
import os
import secrets
import stat
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from training.datasets import (
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_PACKAGE,
    FASHION_MNIST_TRAIN,
    fashion_mnist,
    fetch_fashion_mnist,
    keyed_uniforms,
    read_idx,
)
from vip_hub.errors import DataError

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    """An IDX file's bytes: magic (0, 0, type code, dimension count), big-endian dims, data."""
    dtype = {0x08: ">u1", 0x0D: ">f4"}[code]
    return (
        bytes([0, 0, code, array.ndim])
        + struct.pack(f">{array.ndim}I", *array.shape)
        + array.astype(dtype).tobytes()
    )


def write_fashion(folder: Path, n: dict[str, int] | None = None, gz: bool = True) -> Path:
    """The four Fashion-MNIST IDX files with random content (``n`` records per split)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, (images, labels) in FILES.items():
        count = (n or {"train": 30, "test": 10})[split]
        for stem, array in (
            (images, rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)),
            (labels, rng.integers(0, 10, count, dtype=np.uint8)),
        ):
            data = idx_bytes(array)
            (folder / (stem + ".gz" if gz else stem)).write_bytes(
                gzip.compress(data) if gz else data
            )
    return folder


def test_idx_reader_reads_what_was_written(tmp_path: Path) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "a").write_bytes(idx_bytes(images))
    (tmp_path / "b.gz").write_bytes(gzip.compress(idx_bytes(images)))
    floats = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
    (tmp_path / "c").write_bytes(idx_bytes(floats, 0x0D))
    assert np.array_equal(read_idx(tmp_path / "a"), images)
    assert np.array_equal(read_idx(tmp_path / "b.gz"), images)
    assert (
        np.array_equal(read_idx(tmp_path / "c"), floats) and read_idx(tmp_path / "c").dtype.isnative
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\x01\x08\x03" + bytes(12), "not an IDX file"),  # wrong magic
        (b"\x00\x00\x07\x01" + bytes(8), "not an IDX file"),  # unknown type code
        (b"PK\x03\x04", "not an IDX file"),  # another format
        (b"", "not an IDX file"),  # empty
        (b"\x00\x00\x08\x03\x00\x00\x00\x02", "truncated IDX header"),
        (idx_bytes(np.zeros((2, 3, 4), np.uint8))[:-5], "truncated"),  # data cut short
        (idx_bytes(np.zeros((2, 3, 4), np.uint8)) + b"\x00", "longer than its dimensions say"),
        (
            gzip.compress(idx_bytes(np.zeros((2, 2), np.uint8)))[:-9],
            "cannot read",
        ),  # a cut gzip stream
    ],
)
def test_idx_reader_names_what_is_wrong(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad-idx3-ubyte"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as e:
        read_idx(path)
    assert str(path) in str(e.value)


def test_fashion_mnist_from_an_idx_folder_gzipped_or_not(tmp_path: Path) -> None:
    for gz in (True, False):
        folder = write_fashion(tmp_path / str(gz), gz=gz)
        train, test = fashion_mnist("train", folder), fashion_mnist("test", folder)
        assert (
            train.images.shape == (30, 28, 28)
            and train.images.dtype == np.uint8
            and len(test) == 10
        )
        assert train.dataset.name == FASHION_MNIST_TRAIN and train.dataset.size == 30
        assert train.classes == FASHION_MNIST_CLASSES and len(train.classes) == 10
        assert test.dataset.name != train.dataset.name  # the public split is another dataset


def test_split_files_that_disagree_are_refused(tmp_path: Path) -> None:
    folder = write_fashion(tmp_path / "d")
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(idx_bytes(np.zeros(29, np.uint8)))
    )
    with pytest.raises(DataError, match="expected 30 uint8 labels"):
        fashion_mnist("train", folder)
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(idx_bytes(np.full(30, 10, np.uint8)))
    )
    with pytest.raises(DataError, match="label 10 is not one of the 10 classes"):
        fashion_mnist("train", folder)
    (folder / "train-images-idx3-ubyte.gz").write_bytes(
        gzip.compress(idx_bytes(np.zeros((30, 27, 28), np.uint8)))
    )
    with pytest.raises(DataError, match="n x 28 x 28"):
        fashion_mnist("train", folder)
    with pytest.raises(DataError, match="neither the test IDX files"):
        fashion_mnist("test", tmp_path)


def test_fashion_mnist_from_an_image_folder(tmp_path: Path) -> None:
    for i, name in enumerate(("Trouser", "Bag", "8")):
        folder = tmp_path / "test" / name
        folder.mkdir(parents=True)
        Image.fromarray(np.full((32, 32), 40 * i, np.uint8)).save(folder / f"{i}.png")
    test = fashion_mnist("test", tmp_path)
    assert test.images.shape == (3, 28, 28)
    assert sorted(test.labels.tolist()) == [1, 8, 8]
    (tmp_path / "test" / "Boots").mkdir()
    Image.new("L", (28, 28)).save(tmp_path / "test" / "Boots" / "x.png")
    with pytest.raises(DataError, match="not in a class subfolder"):
        fashion_mnist("test", tmp_path)


def test_subsets_by_a_public_rule_and_by_a_keyed_hash(tmp_path: Path) -> None:
    train = fashion_mnist("train", write_fashion(tmp_path / "d"))
    first = train.first(12)
    assert first.dataset.name == train.dataset.name and first.dataset.size == 12
    assert "first 12" in first.dataset.description and np.array_equal(
        first.images, train.images[:12]
    )
    assert train.first(10_000) is train
    key = secrets.token_bytes(32)
    records = [im.tobytes() for im in train.images]
    u = keyed_uniforms(key, "validation", records, train.labels)
    assert np.array_equal(u[1:], keyed_uniforms(key, "validation", records[1:], train.labels[1:]))
    kept = train.keyed(key, "validation", 0.5)
    assert (
        np.array_equal(kept.labels, train.labels[u < 0.5])
        and kept.dataset.name == train.dataset.name
    )
    with pytest.raises(DataError, match="empty"):
        train.keyed(key, "validation", 1e-9)


def _executable(path: Path, script: str) -> None:
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_fetch_without_apt_names_the_package_and_the_data_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(DataError) as e:
        fetch_fashion_mnist(
            tmp_path / "work", system_dir=tmp_path / "usr/share/datasets/fashion-mnist"
        )
    assert (
        FASHION_MNIST_PACKAGE in str(e.value)
        and "--data" in str(e.value)
        and "not on PATH" in str(e.value)
    )


def test_fetch_falls_back_to_download_and_unpack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """apt-get install fails (no root, no network): ``apt-get download`` + ``dpkg -x`` into the
    work folder is next; when that fails too, the error says what each command answered."""
    bin_dir, payload = tmp_path / "bin", write_fashion(tmp_path / "payload")
    bin_dir.mkdir()
    _executable(
        bin_dir / "apt-get",
        'case "$1" in\n  download) [ -n "$FAKE_DEB" ] && touch '
        f'{FASHION_MNIST_PACKAGE}_1_all.deb && exit 0 ;;\nesac\necho "E: no network" >&2\nexit 100\n',
    )
    _executable(
        bin_dir / "dpkg",
        f'mkdir -p "$3/usr/share/datasets/fashion-mnist"\ncp {payload}/* '
        '"$3/usr/share/datasets/fashion-mnist/"\n',
    )
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/bin{os.pathsep}/usr/bin")
    system = tmp_path / "usr/share/datasets/fashion-mnist"
    with pytest.raises(
        DataError, match=f"apt-get download: E: no network.*{FASHION_MNIST_PACKAGE}.*--data"
    ):
        fetch_fashion_mnist(tmp_path / "work", system_dir=system)
    monkeypatch.setenv("FAKE_DEB", "1")
    folder = fetch_fashion_mnist(tmp_path / "work", system_dir=system)
    assert folder.is_relative_to(tmp_path / "work") and len(fashion_mnist("train", folder)) == 30
    monkeypatch.setenv("PATH", "")
    assert fetch_fashion_mnist(tmp_path / "work", system_dir=system) == folder  # found, nothing run
