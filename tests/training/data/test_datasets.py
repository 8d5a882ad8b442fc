"""Fashion-MNIST's data module (``training/data/labelled.py``): the IDX reader on files the test
writes (good and corrupt), the --data folder forms, public-rule and keyed subsets, the fetch's
fallbacks and error path with apt-get absent or failing (no network), and the image and
caption folders written from arrays (what the probe and the recipes read), with captions,
vocabulary and public captions made from the class names alone."""

from __future__ import annotations

import gzip
import io
import os
import secrets
import stat
import struct
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.helpers import WIDE_GREY, idx_bytes, turned_jpeg, wide_grey, write_fashion

from training.data.images import CAPTIONS_FILE, CaptionFolder, open_captions, open_images
from training.data.labelled import (
    CAPTION_TEMPLATE,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_FILES,
    FASHION_MNIST_PACKAGE,
    FASHION_MNIST_TRAIN,
    class_folder,
    class_public_captions,
    class_vocabulary,
    fashion_mnist,
    fetch_fashion_mnist,
    keyed_uniforms,
    read_idx,
    write_caption_folder,
    write_image_folder,
)
from training.recipes.probe import load_labelled
from vip_hub.errors import ConfigError, DataError
from vip_hub.models.text_decoder import DEFAULT_PROMPT
from vip_hub.models.tokenizer import BERT_SPECIAL_IDS, CaptionTokenizer
from vip_hub.repo_format import VOCAB_FILE


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
        # dimensions whose int64 product wraps to 0 (2^31 x 2^31 x 4): no reshape error
        (b"\x00\x00\x08\x03" + struct.pack(">III", 2**31, 2**31, 4), "truncated"),
        (idx_bytes(np.zeros((2, 3, 4), np.uint8))[:-5], "truncated"),  # data cut short
        (idx_bytes(np.zeros((2, 3, 4), np.uint8)) + b"\x00", "longer than its dimensions say"),
        (
            gzip.compress(idx_bytes(np.zeros((2, 2), np.uint8)), mtime=0)[:-9],
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
    kept = train.subset(np.flatnonzero(u < 0.5), "each kept by a keyed hash")
    assert (
        np.array_equal(kept.labels, train.labels[u < 0.5])
        and kept.dataset.name == train.dataset.name
    )
    with pytest.raises(DataError, match=r"the subset \(none kept\) is empty"):
        train.subset(np.flatnonzero(u < 1e-9), "none kept")


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
        f"{FASHION_MNIST_PACKAGE}_1_all.deb && exit 0 ;;\nesac\n"
        'echo "E: no network" >&2\nexit 100\n',
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


def test_an_image_folder_written_from_arrays_reads_back_as_the_same_records(
    tmp_path: Path,
) -> None:
    """Every record lands in its class's folder, pixel for pixel; the probe's reader and the
    IDX-or-image-folder reader recover the labels; a second write replaces the first whole."""
    data = fashion_mnist("train", write_fashion(tmp_path / "idx"))
    root = write_image_folder(data, tmp_path / "images" / "train", FASHION_MNIST_CLASSES)
    assert root == tmp_path / "images" / "train"
    assert sorted(p.name for p in root.parent.iterdir()) == ["train"]  # no temporary left
    files = sorted(root.glob("*/*.png"))
    assert len(files) == len(data) and len(open_images(root)) == len(data)
    for path in files:
        i = int(path.stem)
        assert path.parent.name == class_folder(FASHION_MNIST_CLASSES[data.labels[i]])
        assert np.array_equal(np.asarray(Image.open(path)), data.images[i])
    folder_of = [class_folder(FASHION_MNIST_CLASSES[y]) for y in data.labels]
    probe = load_labelled(root, "test/fashion")
    assert [probe.classes[y] for y in probe.labels] == [folder_of[int(p.stem)] for p in probe.files]
    again = fashion_mnist("train", root.parent)  # an image folder's train/ split
    order = sorted(range(len(data)), key=lambda i: (folder_of[i], i))
    assert np.array_equal(again.images, data.images[order])
    assert np.array_equal(again.labels, data.labels[order])
    write_image_folder(data.first(5), root, FASHION_MNIST_CLASSES)
    assert len(list(root.glob("*/*.png"))) == 5


def test_wide_greyscale_and_exif_orientation_load_as_seen(tmp_path: Path) -> None:
    """A 16-bit or float greyscale file loads as its 8-bit version (not clipped at 255), a JPEG as
    its EXIF orientation shows it."""
    pairs = [wide_grey(mode) for mode in WIDE_GREY] + [turned_jpeg()]
    for i, (data, _) in enumerate(pairs):
        suffix = ".png" if i == 0 else ".jpg" if i == len(pairs) - 1 else ".tif"
        (tmp_path / f"{i}{suffix}").write_bytes(data)
    images = open_images(tmp_path)
    for i, (_, expected) in enumerate(pairs):
        assert np.array_equal(np.asarray(images.load(i)), np.asarray(expected)), i


def test_writing_a_folder_names_what_is_wrong_and_leaves_nothing_behind(tmp_path: Path) -> None:
    data = fashion_mnist("train", write_fashion(tmp_path / "idx"))
    with pytest.raises(DataError, match="labels span 0..9, but 3 class names"):
        write_image_folder(data, tmp_path / "out", FASHION_MNIST_CLASSES[:3])
    with pytest.raises(DataError, match="the same folder twice"):
        write_image_folder(data, tmp_path / "out", ["a/b", "a-b", *FASHION_MNIST_CLASSES[2:]])
    with pytest.raises(DataError, match="cannot name a folder"):
        write_image_folder(data, tmp_path / "out", ["..", *FASHION_MNIST_CLASSES[1:]])
    with pytest.raises(ConfigError, match="only field is {name}"):
        write_caption_folder(data, tmp_path / "out", FASHION_MNIST_CLASSES, "a {label}")
    assert sorted(tmp_path.iterdir()) == [tmp_path / "idx"]


def test_captions_are_the_public_template_over_each_class_name(tmp_path: Path) -> None:
    """Each image's caption is the template over its class name (nothing else about the image
    enters it), listed in record order; the vocabulary covers every caption and the zero-shot
    prompt, so DP-Cap trains on the texts zero-shot scores."""
    data = fashion_mnist("train", write_fashion(tmp_path / "idx"))
    root = write_caption_folder(data, tmp_path / "captions", FASHION_MNIST_CLASSES)
    pairs = open_captions(root)
    assert isinstance(pairs, CaptionFolder) and len(pairs) == len(data)
    for i in range(len(data)):
        name = FASHION_MNIST_CLASSES[data.labels[i]]
        assert pairs.caption(i) == f"{DEFAULT_PROMPT} {name}" == CAPTION_TEMPLATE.format(name=name)
        assert np.array_equal(np.asarray(pairs.load(i).convert("L")), data.images[i])
    public = class_public_captions(FASHION_MNIST_CLASSES)
    assert public == [f"{DEFAULT_PROMPT} {c}" for c in FASHION_MNIST_CLASSES]
    assert class_public_captions(["cat"], "{name} on a mat") == ["cat on a mat"]

    vocab = tmp_path / VOCAB_FILE
    vocab.write_bytes(class_vocabulary(FASHION_MNIST_CLASSES))
    tokens = vocab.read_text().splitlines()
    assert {t: tokens.index(t) for t in BERT_SPECIAL_IDS} == BERT_SPECIAL_IDS
    assert {"shirt", "ankle", "boot", "photo", "/", "-"} <= set(tokens)
    texts = [*public, DEFAULT_PROMPT, *(pairs.caption(i) for i in range(len(pairs)))]
    unk = BERT_SPECIAL_IDS["[UNK]"]
    assert not (CaptionTokenizer(vocab).encode(texts) == unk).any()
    assert (CaptionTokenizer(vocab).encode(["a photo of a dog"]) == unk).any()  # no other words


# ---------------------------------------------------------------- private image folders and shards
def test_an_image_linked_twice_is_refused_up_front_naming_both_files(tmp_path: Path) -> None:
    """The guarantee is per example: one file under two names (a symlink, a hard link) would be
    sampled as two records, so it is refused at open, as captions.jsonl refuses an image listed
    twice. Copies are two files (no content is hashed), as in a captions.jsonl."""
    (tmp_path / "cats").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "cats" / "a.png")
    Image.new("RGB", (8, 8), "red").save(tmp_path / "b.png")
    assert len(open_images(tmp_path)) == 2
    (tmp_path / "c.png").symlink_to(tmp_path / "cats" / "a.png")
    with pytest.raises(DataError, match=r"c.png and .*cats/a.png are one file"):
        open_images(tmp_path)
    (tmp_path / "c.png").unlink()
    os.link(tmp_path / "b.png", tmp_path / "cats" / "d.png")
    with pytest.raises(DataError, match=r"b.png and .*cats/d.png are one file"):
        open_images(tmp_path)


def test_a_captioned_image_listed_under_two_names_is_refused_up_front(tmp_path: Path) -> None:
    """captions.jsonl refused one path listed twice, not a link to it under another name: one
    image, two examples. The folder of captions takes the image folder's rule."""
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "b.png").symlink_to(tmp_path / "a.png")
    lines = [f'{{"image": "{name}", "caption": "a cat"}}' for name in ("a.png", "b.png")]
    (tmp_path / CAPTIONS_FILE).write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"a.png and .*b.png are one file"):
        open_captions(tmp_path)


def test_a_tar_member_stored_twice_is_refused_up_front(tmp_path: Path) -> None:
    """``tar cf shard.tar images images/a.png`` stores a.png twice: one example, counted once."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "a.png")
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "00000.tar", "w") as tar:
        tar.add(tmp_path / "images", arcname="images")
        tar.add(tmp_path / "images" / "a.png", arcname="images/a.png")
    with pytest.raises(DataError, match=r"00000.tar: member 'images/a.png' is stored twice"):
        open_images(tmp_path / "shards")


def test_hidden_files_are_not_examples_in_folders_as_in_shards(tmp_path: Path) -> None:
    """macOS's AppleDouble files (``._a.png``, also in ``__MACOSX/``) and other hidden files are
    not examples: skipped when counting n, in a folder as in a tar shard (webdataset's key split
    already leaves them out), so none fails to decode after noise has been spent."""
    folder = tmp_path / "folder"
    (folder / "__MACOSX").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    for hidden in ("._a.png", "__MACOSX/._a.png", ".b.png"):
        (folder / hidden).write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    images = open_images(folder)
    assert len(images) == 1 and images.load(0).size == (8, 8)
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "00000.tar", "w") as tar:
        for name in ("a.png", "._a.png", "__MACOSX/._a.png"):
            tar.add(folder / name, arcname=name)
    shards = open_images(tmp_path / "shards")
    assert len(shards) == 1 and shards.load(0).size == (8, 8)


def test_broken_links_are_not_examples_and_the_user_is_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link whose target is gone decodes to nothing, so n leaves it out, but not silently: one
    line says how many entries were left out and names the first few (records were lost)."""
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    for name in ("b.png", "c.jpg", "d.jpg", "e.png"):
        (tmp_path / name).symlink_to(tmp_path / "gone" / name)
    images = open_images(tmp_path)
    assert [p.name for p in images.files] == ["a.png"]  # type: ignore[attr-defined]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "4 of the entries" in lines[0], lines
    assert all(str(tmp_path / name) in lines[0] for name in ("b.png", "c.jpg", "d.jpg"))
    assert "e.png" not in lines[0]
    for name in ("b.png", "c.jpg", "d.jpg", "e.png"):
        (tmp_path / name).unlink()
    open_images(tmp_path)
    assert capsys.readouterr().err == ""  # nothing left out, nothing said


def test_a_linked_folder_is_not_searched_and_the_user_is_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link to a folder of images was skipped silently (rglob does not enter it), so n shrank
    with no word, while a broken link was reported."""
    (tmp_path / "outside").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "outside" / "b.png")
    (tmp_path / "data" / "real").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "data" / "real" / "a.png")
    (tmp_path / "data" / "linked").symlink_to(tmp_path / "outside")
    assert len(open_images(tmp_path / "data")) == 1
    err = capsys.readouterr().err
    assert "1 links to folders (not searched) left out" in err and "linked" in err, err


def test_a_sample_with_two_captions_is_refused_up_front(tmp_path: Path) -> None:
    """A tar sample with two captions (``a.txt`` and ``a.TXT``) kept the last one silently; two
    images of one sample were refused."""
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "00000.tar", "w") as tar:
        tar.add(tmp_path / "a.png", arcname="a.png")
        for name, text in (("a.txt", b"a cat"), ("a.TXT", b"a dog")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    with pytest.raises(DataError, match=r"sample 'a' has two captions"):
        open_captions(tmp_path / "shards")


def test_an_idx_split_without_records_is_refused_naming_its_file(tmp_path: Path) -> None:
    """Valid headers over zero records gave pydantic's multi-line error for Dataset.size."""
    for split in ("train", "test"):
        images, labels = FASHION_MNIST_FILES[split]
        (tmp_path / images).write_bytes(idx_bytes(np.zeros((0, 28, 28), np.uint8)))
        (tmp_path / labels).write_bytes(idx_bytes(np.zeros((0,), np.uint8)))
    with pytest.raises(DataError, match=r"holds no images"):
        fashion_mnist("train", tmp_path)


def test_a_compressed_shard_named_tar_is_refused_up_front(tmp_path: Path) -> None:
    """Members are read in place at their offsets, so a shard must be a plain tar: a gzipped one
    named ``*.tar`` (which tarfile would open) is refused at open, not at the first step."""
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "00000.tar", "w:gz") as tar:
        tar.add(tmp_path / "a.png", arcname="a.png")
    with pytest.raises(DataError, match=r"00000.tar: not a readable uncompressed tar file"):
        open_images(tmp_path / "shards")


def test_files_under_hidden_folders_are_not_examples_in_folders_as_in_shards(
    tmp_path: Path,
) -> None:
    """A hidden folder's files are hidden too: a thumbnail cache (``.thumbnails/``) would count an
    image twice, a trash folder (``.Trash-1000/``) a record its owner removed, netatalk's
    ``.AppleDouble/a.png`` metadata would fail to decode after noise has been spent."""
    folder = tmp_path / "folder"
    for sub in (".thumbnails/normal", ".Trash-1000/files", ".AppleDouble"):
        (folder / sub).mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    Image.new("RGB", (4, 4)).save(folder / ".thumbnails" / "normal" / "a.png")
    Image.new("RGB", (8, 8), "red").save(folder / ".Trash-1000" / "files" / "removed.png")
    (folder / ".AppleDouble" / "a.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    images = open_images(folder)
    assert [p.name for p in images.files] == ["a.png"]  # type: ignore[attr-defined]
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "00000.tar", "w") as tar:
        tar.add(folder, arcname=".")  # members ./a.png, ./.thumbnails/normal/a.png, ...
    shards = open_images(tmp_path / "shards")
    assert len(shards) == 1 and shards.load(0).size == (8, 8)


def _not_an_image(folder: Path) -> tuple[str, str]:
    """A file of ``folder`` named as an image that is none (an empty download), and its match."""
    (folder / "b.jpg").write_bytes(b"")
    return "b.jpg", r"cannot decode image .*b\.jpg"


def _too_many_pixels(folder: Path) -> tuple[str, str]:
    """A decompression bomb: a 10 kB PNG of 9000 x 9000 pixels, and its match."""
    Image.new("1", (9000, 9000)).save(folder / "b.png")
    return "b.png", r"b\.png: 9000x9000 pixels is over the 64000000 limit"


def _truncated(kind: str) -> Callable[[Path], tuple[str, str]]:
    """An image of format ``kind`` cut short (a download broken off): its header reads, its body
    does not decode; it was counted in n and refused at the step that first sampled it."""

    def bad(folder: Path) -> tuple[str, str]:
        noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        data = io.BytesIO()
        Image.fromarray(noise).save(data, kind)
        name = f"b.{kind.lower()}"
        (folder / name).write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
        return name, rf"cannot decode image .*b\.{kind.lower()}"

    return bad


@pytest.mark.parametrize(
    "bad",
    [_not_an_image, _too_many_pixels, _truncated("PNG"), _truncated("JPEG")],
    ids=["not an image", "too many pixels", "truncated PNG", "truncated JPEG"],
)
def test_a_file_that_is_no_usable_image_is_refused_at_open_naming_it(
    bad: Callable[[Path], tuple[str, str]], tmp_path: Path
) -> None:
    """n counts examples the engine will decode: a file named as an image whose header is none
    (an empty download, an HTML page), over the pixel limit, or whose body does not decode is
    refused when the data is opened,
    in a folder, a tar shard or a captions.jsonl, not when first sampled, after noise was spent."""
    folder = tmp_path / "folder"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    name, match = bad(folder)
    with pytest.raises(DataError, match=match):
        open_images(folder)
    lines = [f'{{"image": "{f}", "caption": "a cat"}}' for f in ("a.png", name)]
    (folder / CAPTIONS_FILE).write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=match):
        open_captions(folder)
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "00000.tar", "w") as tar:
        for f in ("a.png", name):
            tar.add(folder / f, arcname=f)
    with pytest.raises(DataError, match=match):
        open_images(tmp_path / "shards")


def test_an_image_gone_since_the_count_is_a_data_error_naming_it(tmp_path: Path) -> None:
    """The data changed between the count of n and a read (a file deleted, a shard moved): a
    DataError naming the file, in every layout, not a bare OSError's traceback."""
    (tmp_path / "folder").mkdir()
    for name in ("a.png", "b.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / "folder" / name)
    (tmp_path / "folder" / CAPTIONS_FILE).write_text('{"image": "b.png", "caption": "a cat"}\n')
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "00000.tar", "w") as tar:
        tar.add(tmp_path / "folder" / "b.png", arcname="b.png")
    opened = [open_images(tmp_path / "folder"), open_captions(tmp_path / "folder")]
    shards = open_images(tmp_path / "shards")
    (tmp_path / "folder" / "b.png").unlink()
    (tmp_path / "shards" / "00000.tar").unlink()
    for data, index in ((opened[0], 1), (opened[1], 0), (shards, 0)):
        with pytest.raises(DataError, match=r"cannot read .*(folder/b\.png|00000\.tar:b\.png)"):
            data.load(index)
