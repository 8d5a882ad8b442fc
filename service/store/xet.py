"""The store's side of Xet uploads: the content-addressed storage (CAS) that ``hf_xet``, the
upload engine of huggingface_hub 1.x/2.x, sends files to when a hub answers ``lfs`` to
preupload.

The client cuts each file into content-defined chunks, packs chunks into *xorbs* (up to
64 MiB, each chunk stored as an 8-byte header then its bytes: raw, LZ4 frame, or LZ4 of the
bytes grouped by position mod 4), uploads the xorbs, then one *shard* per upload session:
for every file, its hash and SHA-256 and the ``(xorb, chunk range)`` terms that rebuild it.
Here a shard is applied at once: each file is rebuilt from the xorbs into the uploads area
(``BlobStore.stage_upload``), its SHA-256 checked against the shard's, so that the commit
that follows names it like any LFS object. Formats: xet-core's ``xet_core_structures``
(``xorb_object``, ``metadata_shard``).

A xorb is kept only under its own hash, recomputed from its chunks (xet-core's
``merklehash``: each chunk's keyed BLAKE3, aggregated by a tree of mean branching factor 4),
so no upload can hold a hash for other bytes. Each xorb is noted as sent by its uploader
(``owners/``), and a shard reads only xorbs its own uploader sent: another user's is answered
like one never uploaded. A shard rebuilds at most ``max_expansion`` times the bytes it reads as
stored (each distinct chunk counted once, compressed, header included), so what it writes is
bounded by what the same user actually uploaded (``hub.xet_max_expansion``): a 36 KB xorb of
LZ4-packed zero chunks rebuilds that many times 36 KB a shard, not 16 x 8 MiB. Xorbs are kept
while a client may still refer to them: its local shard cache lets a later upload of the same
bytes send a shard that names earlier xorbs instead of the bytes; those count at their stored
size, as if sent again.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import blake3
import lz4.frame
import numpy as np

from vip_hub.paths import fsync_dir, make_private_dir, replace_durably

from .blobs import BlobStore, Markers, listed_files, remove_older_than, sharded_name
from .errors import CorruptObject, InvalidRequest, StoreError, StoreUnavailable, TooLarge
from .s3 import XORB_OWNERS, XORBS

__all__ = [
    "Reserved",
    "XetStore",
    "check_xorb",
    "is_xorb_oid",
    "xet_hex",
    "xorb_hash",
    "xorb_key",
    "xorb_oid",
]

SHARD_TAG = bytes(
    [
        72,
        70,
        82,
        101,
        112,
        111,
        77,
        101,
        116,
        97,
        68,
        97,
        116,
        97,
        0,
        85,
        105,
        103,
        69,
        106,
        123,
        129,
        87,
        131,
        165,
        189,
        217,
        92,
        205,
        209,
        74,
        169,
    ]
)  # "HFRepoMetaData\0" + magic
_ENTRY = 48  # every shard record: a 32-byte hash then 16 bytes
_BOOKEND = b"\xff" * 32
_WITH_VERIFICATION = 1 << 31
_WITH_METADATA_EXT = 1 << 30
_FOOTER_IDENTS = (b"XETBLOB", b"XBLBHSH", b"XBLBBND")  # what follows a xorb's last chunk
_CHUNK_HEADER = 8
MAX_CHUNK = 128 * 1024  # 64 KiB target x 2
MAX_XORB_BYTES = 64 * 1024 * 1024 + 8 * 1024 * _CHUNK_HEADER + (1 << 20)
_MAX_TERMS = 1 << 20
_DATA_KEY = bytes(
    [
        102,
        151,
        245,
        119,
        91,
        149,
        80,
        222,
        49,
        53,
        203,
        172,
        165,
        151,
        24,
        28,
        157,
        228,
        33,
        16,
        155,
        235,
        43,
        88,
        180,
        208,
        176,
        75,
        147,
        173,
        242,
        41,
    ]
)  # xet-core merklehash DATA_KEY
_NODE_KEY = bytes(
    [
        1,
        126,
        197,
        199,
        165,
        71,
        41,
        150,
        253,
        148,
        102,
        102,
        180,
        138,
        2,
        230,
        93,
        221,
        83,
        111,
        55,
        199,
        109,
        210,
        248,
        99,
        82,
        230,
        74,
        83,
        113,
        63,
    ]
)  # ... and INTERNAL_NODE_HASH
_BRANCHING = 4


def xet_hex(raw: bytes) -> str:
    """A Xet hash in the text form URLs use: four little-endian u64s, each as 16 hex digits."""
    return "".join(raw[i : i + 8][::-1].hex() for i in range(0, 32, 8))


def xorb_hash(chunks: list[tuple[bytes, int]]) -> str:
    """The hash of a xorb of chunks given as (keyed BLAKE3 of the bytes, size), in text form
    (xet-core's ``aggregated_node_hash``: groups cut where a hash is 0 mod 4, 2 to 9 long)."""
    nodes = list(chunks)
    while len(nodes) > 1:
        merged, i = [], 0
        while i < len(nodes):
            rest = nodes[i:]
            cut = len(rest)
            if cut > 2:
                cut = min(2 * _BRANCHING + 1, cut)
                cut = next((j + 1 for j in range(2, cut) if rest[j][0][24] % _BRANCHING == 0), cut)
            group = rest[:cut]
            text = "".join(f"{xet_hex(h)} : {size}\n" for h, size in group).encode()
            merged.append(
                (blake3.blake3(text, key=_NODE_KEY).digest(), sum(size for _, size in group))
            )
            i += cut
        nodes = merged
    return xet_hex(nodes[0][0]) if nodes else "0" * 64


def check_xet_hash(text: str) -> str:
    """``text`` if it is a Xet hash (64 lowercase hex digits), else InvalidRequest."""
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise InvalidRequest(f"invalid Xet hash {text!r}: expected 64 lowercase hex digits")
    return text


class Reserved(Protocol):
    """What a reservation of uploaded bytes gives back (``HubStore.reserve_uploads``)."""

    def done(self) -> None:
        """What it counted was kept: the counts of what it replaces go."""

    def undo(self, keep: Collection[str] = ()) -> None:
        """Drop what it counted but ``keep``; what it replaces stays counted."""


@dataclass(frozen=True)
class Term:
    """Chunks ``[start, end)`` of xorb ``xorb`` (text form), ``size`` bytes once unpacked."""

    xorb: str
    start: int
    end: int
    size: int


@dataclass(frozen=True)
class ShardFile:
    """One file of a shard: its SHA-256 and how to rebuild it."""

    sha256: str
    terms: tuple[Term, ...]

    @property
    def size(self) -> int:
        return sum(t.size for t in self.terms)


class XetStore:
    """Xorbs under ``root/xet/xorbs/``, who sent each under ``root/xet/owners/``; shards
    applied into ``blobs``' uploads area. With an object store (``blobs.remote``), xorbs and
    who sent them are kept in its bucket (``xet/xorbs/``, ``xet/owners/``), so that a shard
    may reach any replica; the folder caches the xorbs this process read or wrote."""

    def __init__(self, root: Path, blobs: BlobStore):
        self.dir = root / "xet" / "xorbs"
        make_private_dir(self.dir)
        self.blobs = blobs
        self.remote = blobs.remote
        self.senders = Markers(
            root / "xet" / "owners", self.remote, XORB_OWNERS
        )  # who sent each xorb
        self._reads: list[set[str]] = []  # per shard being applied: the xorbs it reads
        self._reads_lock = threading.Lock()

    def xorb_path(self, xorb: str) -> Path:
        return self.dir / xorb[:2] / xorb[2:]

    def put_xorb(
        self,
        xorb: str,
        tmp: Path,
        uploader: str,
        reserve: Callable[[int], Reserved] | None = None,
    ) -> None:
        """Keep the xorb ``tmp`` that ``uploader`` sent under its hash, once that hash is
        recomputed from its chunks (InvalidRequest otherwise) and ``reserve`` took its size
        without raising (undone if nothing was stored after all), and note who sent it (with an
        object store: written to its bucket again). One already held stays, its age refreshed,
        unless its bytes rotted: a hash names the chunks, not how they are packed, and a shard
        may be reading the held one at the offsets it found there. ``tmp`` is gone afterwards,
        whatever the outcome."""
        target = self.xorb_path(check_xet_hash(xorb))
        try:
            check_xorb(tmp, xorb)
            counted = reserve(tmp.stat().st_size) if reserve is not None else None
            stored = False  # once it is, its count stays whatever follows
            try:
                if self.remote is not None:
                    self.remote.put_file(tmp, xorb_key(xorb))
                    stored = True
                if not _kept(target, xorb):
                    replace_durably(tmp, target)  # its age: now
                    stored = True
                self.senders.note(uploader, xorb)
            except BaseException:
                if counted is not None and not stored:
                    counted.undo()
                raise
        finally:
            tmp.unlink(missing_ok=True)

    def _local(self, xorb: str) -> Path:
        """The xorb as a local file (with an object store: fetched into the cache and checked
        on first use); FileNotFoundError when it is not held."""
        path = self.xorb_path(xorb)
        if self.remote is None or path.is_file():
            return path
        fetched = self._fetched(xorb)
        make_private_dir(path.parent)
        try:  # never over a copy another shard fetched meanwhile and may be reading
            os.link(fetched, path)
            fsync_dir(path.parent)
        except FileExistsError:
            pass
        finally:
            fetched.unlink(missing_ok=True)
        return path

    def _open(self, xorb: str) -> BinaryIO:
        """The held xorb opened for reading; InvalidRequest (upload it again) when it is not
        held, collected since the shard named it included."""
        try:
            return open(self._local(xorb), "rb")
        except FileNotFoundError:
            raise _not_held(xorb) from None

    def _fetched(self, xorb: str) -> Path:
        """The bucket's copy of ``xorb`` in a temp file, checked (CorruptObject);
        FileNotFoundError when the bucket does not hold it."""
        assert self.remote is not None
        if self.remote.size(xorb_key(xorb)) is None:
            raise FileNotFoundError(xorb_key(xorb))
        writer = self.blobs.writer()
        try:
            with _held_xorb(xorb):
                self.remote.read_into(xorb_key(xorb), writer.write, MAX_XORB_BYTES)
                writer.close()
                check_xorb(writer.path, xorb)
        except BaseException:
            writer.discard()
            raise
        return writer.path

    def check(self, xorb: str) -> None:
        """CorruptObject unless the xorb held (with an object store: in its bucket) hashes to
        its name."""
        if self.remote is None:
            with _held_xorb(xorb):
                check_xorb(self.xorb_path(xorb), xorb)
        else:
            self._fetched(xorb).unlink()

    def listed(self) -> list[str]:
        """The xorbs held (with an object store: in its bucket)."""
        if self.remote is None:
            return [x.key for x in listed_files(self.dir, sharded_name)]
        return [o.key.removeprefix(XORBS) for o in self.remote.listed(XORBS)]

    def remove(self, xorb: str) -> None:
        """Delete a xorb (with an object store: from its bucket, then this cache); only one
        that does not hash to its name: a shard may name any other."""
        if self.remote is not None:
            self.remote.delete(xorb_key(xorb))
        self.xorb_path(xorb).unlink(missing_ok=True)

    def apply_shard(
        self,
        shard: Path,
        uploader: str,
        held: Callable[[str], bool],
        max_file_bytes: int,
        max_expansion: int,
        reserve: Callable[[list[tuple[str, int]], list[str], list[tuple[str, int]]], Reserved],
    ) -> list[str]:
        """Rebuild every file a shard ``uploader`` sent describes into the uploads area, each
        checked against the shard's SHA-256, except those ``held`` says the uploader's repo
        already holds; returns the SHA-256s of those rebuilt. Before any is written, ``reserve``
        takes their (SHA-256, size), the xorbs whose every chunk they read (whose counts they
        take once every file is rebuilt), and (xorb, stored size) of those they read in part;
        undone, but for the files rebuilt, if the rest fails.
        The xorbs read have their age refreshed once every file is rebuilt (a refused shard
        keeps none alive). A shard naming a xorb this uploader did not send (InvalidRequest, as
        for one not held), a term stating another size than its chunks' headers, or one
        rebuilding more than ``max_expansion`` times the stored bytes of the distinct chunks it
        reads (TooLarge), is refused."""
        with open(shard, "rb") as f:
            files = list(_shard_files(f, shard.stat().st_size))
        with self._reading() as reading:
            offsets: dict[str, list[tuple[int, int]]] = {}
            rebuild = [entry for entry in files if not held(entry.sha256)]
            for entry in rebuild:
                if entry.size > max_file_bytes:
                    raise TooLarge(
                        f"file {entry.sha256} is {entry.size} bytes, over the upload limit of "
                        f"{max_file_bytes}"
                    )
            stored: dict[tuple[str, int], int] = {}  # each distinct chunk read: its stored bytes
            for entry in rebuild:
                for term in entry.terms:
                    chunks = self._chunks(term, offsets, uploader, reading)
                    stored.update(
                        ((term.xorb, i), chunks[i + 1][0] - chunks[i][0])
                        for i in range(term.start, term.end)
                    )
            total, sent = sum(entry.size for entry in rebuild), sum(stored.values())
            if total > max_expansion * sent:
                raise TooLarge(
                    f"the shard rebuilds {total} bytes from {sent} bytes of uploaded chunks, more "
                    f"than the limit of {max_expansion} times what was uploaded "
                    "(hub.xet_max_expansion)"
                )
            whole = [
                xorb
                for xorb, chunks in offsets.items()
                if all((xorb, i) in stored for i in range(len(chunks) - 1))
            ]
            part = [(xorb, chunks[-1][0]) for xorb, chunks in offsets.items() if xorb not in whole]
            counted = reserve([(entry.sha256, entry.size) for entry in rebuild], whole, part)
            rebuilt: list[str] = []
            try:
                for entry in rebuild:
                    self._rebuild(entry, offsets)
                    rebuilt.append(entry.sha256)
            except BaseException:
                counted.undo(keep=rebuilt)  # those are in the uploads area, and count
                raise
            counted.done()
            for xorb in offsets:
                self._refresh(xorb, uploader)
            return rebuilt

    def _chunks(
        self,
        term: Term,
        offsets: dict[str, list[tuple[int, int]]],
        uploader: str,
        reading: set[str],
    ) -> list[tuple[int, int]]:
        """(offset, unpacked size) of each chunk of the term's xorb, then (end, 0), the xorb
        noted in ``reading`` before it is opened; the term's range and stated size checked
        against them."""
        if term.xorb not in offsets:
            if not self.senders.holds(uploader, term.xorb):  # another user's: answered alike
                raise _not_held(term.xorb)
            reading.add(term.xorb)
            with self._open(term.xorb) as f, _held_xorb(term.xorb):
                offsets[term.xorb] = _chunk_offsets(f, os.fstat(f.fileno()).st_size, term.xorb)
        chunks = offsets[term.xorb]
        if not 0 <= term.start < term.end <= len(chunks) - 1:
            raise InvalidRequest(
                f"shard term: chunks [{term.start}, {term.end}) are not in xorb "
                f"{term.xorb} ({len(chunks) - 1} chunks)"
            )
        unpacked = sum(size for _, size in chunks[term.start : term.end])
        if unpacked != term.size:  # what its rebuild would refuse, refused before any count
            raise InvalidRequest(
                f"shard term of xorb {term.xorb} unpacks to {unpacked} bytes, not the "
                f"{term.size} bytes it states"
            )
        return chunks

    @contextlib.contextmanager
    def _reading(self) -> Iterator[set[str]]:
        """The set in which a shard notes the xorbs it reads: ``clean_stale`` keeps them,
        however old, until the shard is applied or refused."""
        reading: set[str] = set()
        with self._reads_lock:
            self._reads.append(reading)
        try:
            yield reading
        finally:
            with self._reads_lock:
                self._reads.remove(reading)

    def _being_read(self, xorb: str) -> bool:
        with self._reads_lock:
            return any(xorb in reading for reading in self._reads)

    def _refresh(self, xorb: str, uploader: str) -> None:
        """Refresh the age of a xorb a shard read, and of its uploader's note: it is still
        referred to (one collected meanwhile stays gone)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.xorb_path(xorb))
        self.senders.note(uploader, xorb)

    def _rebuild(self, entry: ShardFile, offsets: dict[str, list[tuple[int, int]]]) -> None:
        writer = self.blobs.writer()
        try:
            for term in entry.terms:
                chunks = offsets[term.xorb]  # the term checked against them by ``_chunks``
                with self._open(term.xorb) as f:
                    written = 0
                    with _held_xorb(term.xorb):  # its chunks were checked as it was kept
                        for data in _read_chunks(f, chunks[term.start][0], term.end - term.start):
                            written += len(data)
                            if written > term.size:  # its stated size bounds what is written
                                break
                            writer.write(data)
                    if written != term.size:
                        got = "more than" if written > term.size else f"{written} bytes, not"
                        raise InvalidRequest(
                            f"shard term of xorb {term.xorb} unpacks to {got} the {term.size} "
                            "bytes it states"
                        )
            sha256 = writer.close()
        except BaseException:
            writer.discard()
            raise
        if (
            sha256 != entry.sha256
        ):  # (its actual hash is not told: it could name bytes of another upload)
            writer.path.unlink(missing_ok=True)
            raise InvalidRequest(
                f"a file rebuilt from the shard does not have the SHA-256 {entry.sha256} the shard "
                "states"
            )
        try:
            self.blobs.stage_upload(writer.path, sha256)
        except BaseException:  # (the store down, say): nothing is left in tmp/
            writer.path.unlink(missing_ok=True)
            raise

    def clean_stale(self, max_age: float) -> int:
        """Remove xorbs, and notes of who sent them, no upload has referred to for ``max_age``
        seconds (with an object store: from its bucket too, a xorb once no note younger than
        that names it; the folder's copies are its cache), but those a shard applied by this
        process reads now."""
        removed = remove_older_than(
            self.dir, max_age, keep=lambda path: self._being_read(sharded_name(path))
        ) + remove_older_than(self.senders.folder, max_age)
        if self.remote is not None:
            with contextlib.suppress(StoreUnavailable):  # collected at a later call
                removed += self.remote.remove_older_than(XORB_OWNERS, max_age)
                used = {o.key.rsplit("/", 1)[1] for o in self.remote.listed(XORB_OWNERS)}
                removed += self.remote.remove_older_than(
                    XORBS,
                    max_age,
                    keep=lambda key: (
                        key.removeprefix(XORBS) in used or self._being_read(key.removeprefix(XORBS))
                    ),
                )
        return removed


def _not_held(xorb: str) -> InvalidRequest:
    """The answer to a shard naming a xorb this hub does not hold for its user."""
    return InvalidRequest(
        f"the shard names xorb {xorb}, which this hub does not hold for this user (never "
        "uploaded, or expired): upload again"
    )


@contextlib.contextmanager
def _held_xorb(xorb: str) -> Iterator[None]:
    """Turn a held xorb failing its checks (InvalidRequest, TooLarge) into CorruptObject: each
    was checked whole before it was kept, so it is the store's fault, not the request's."""
    try:
        yield
    except (InvalidRequest, TooLarge) as e:
        raise CorruptObject(
            f"the hub's copy of xorb {xorb} is corrupt ({e}): its operator's "
            "`vip-hub store check --repair` removes it, then the client uploads it again"
        ) from None


_XORB_OID = "xorb:"


def xorb_oid(xorb: str) -> str:
    """A xorb's name among the objects a user has sent and not yet committed
    (``pending_uploads``, beside LFS objects' SHA-256s)."""
    return _XORB_OID + xorb


def is_xorb_oid(oid: str) -> bool:
    """Whether ``oid`` (of ``pending_uploads``) names a xorb (``xorb_oid``)."""
    return oid.startswith(_XORB_OID)


def xorb_key(xorb: str) -> str:
    """A xorb's key in the object store."""
    return f"{XORBS}{xorb}"


def check_xorb(path: Path, xorb: str) -> None:
    """InvalidRequest unless the xorb file ``path`` holds chunks whose hash is ``xorb``."""
    with open(path, "rb") as f:
        chunks = _chunk_offsets(f, path.stat().st_size, xorb)
        if len(chunks) < 2:
            raise InvalidRequest(f"xorb {xorb} holds no chunk")
        hashes = [
            (blake3.blake3(data, key=_DATA_KEY).digest(), len(data))
            for data in _read_chunks(f, chunks[0][0], len(chunks) - 1)
        ]
    if xorb_hash(hashes) != xorb:
        raise InvalidRequest(f"xorb {xorb}: its chunks do not hash to the name it was sent under")


def _kept(path: Path, xorb: str) -> bool:
    """Whether ``path`` holds a xorb whose chunks hash to ``xorb``, its age then refreshed (not
    when it is absent, rotted, or collected meanwhile)."""
    try:
        check_xorb(path, xorb)
        os.utime(path)
    except (OSError, StoreError):
        return False
    return True


def _chunk_offsets(f: BinaryIO, size: int, xorb: str) -> list[tuple[int, int]]:
    """(offset, unpacked size) of each chunk header of a xorb, then (its end, 0): ``len - 1``
    chunks."""
    offsets, pos = [], 0
    while pos < size:
        f.seek(pos)
        header = f.read(_CHUNK_HEADER)
        if header[:7] in _FOOTER_IDENTS:
            break
        if len(header) < _CHUNK_HEADER:
            raise InvalidRequest(f"xorb {xorb}: truncated chunk header at byte {pos}")
        version, scheme = header[0], header[4]
        compressed = int.from_bytes(header[1:4], "little")
        unpacked = int.from_bytes(header[5:8], "little")
        if (
            version != 0
            or scheme not in (0, 1, 2)
            or unpacked > MAX_CHUNK
            or compressed > 2 * MAX_CHUNK
        ):
            raise InvalidRequest(
                f"xorb {xorb}: bad chunk header at byte {pos} (version {version}, scheme {scheme}, "
                f"{compressed} -> {unpacked} bytes)"
            )
        offsets.append((pos, unpacked))
        pos += _CHUNK_HEADER + compressed
        if pos > size:
            raise InvalidRequest(f"xorb {xorb}: chunk at byte {offsets[-1][0]} runs past the end")
    offsets.append((pos, 0))
    return offsets


def _read_chunks(f: BinaryIO, offset: int, count: int) -> Iterator[bytes]:
    """Unpack ``count`` chunks starting at ``offset``."""
    f.seek(offset)
    for _ in range(count):
        header = f.read(_CHUNK_HEADER)
        compressed = int.from_bytes(header[1:4], "little")
        unpacked = int.from_bytes(header[5:8], "little")
        data = f.read(compressed)
        scheme = header[4]
        try:
            if scheme == 1:
                data = _lz4_frame(data, unpacked)
            elif scheme == 2:
                data = _bg4_regroup(_lz4_frame(data, unpacked))
        except RuntimeError as e:
            raise InvalidRequest(f"a xorb chunk does not decompress ({e})") from None
        if len(data) != unpacked:
            raise InvalidRequest(
                f"a xorb chunk unpacks to {len(data)} bytes, not the {unpacked} its header states"
            )
        yield data


def _lz4_frame(data: bytes, unpacked: int) -> bytes:
    """An LZ4 frame's bytes, at most ``unpacked`` + 1 of them whatever size the frame declares
    (its header may state terabytes); RuntimeError for a frame that ends early."""
    frame = lz4.frame.LZ4FrameDecompressor()
    data = frame.decompress(data, max_length=unpacked + 1)
    if not frame.eof and len(data) <= unpacked:
        raise RuntimeError("the frame ends early")
    return data


def _bg4_regroup(grouped: bytes) -> bytes:
    """Undo the byte grouping: the bytes at positions 0, 4, 8... came first, then 1, 5, 9..."""
    n = len(grouped)
    src = np.frombuffer(grouped, dtype=np.uint8)
    out = np.empty(n, dtype=np.uint8)
    start = 0
    for g in range(4):
        count = len(range(g, n, 4))
        out[g::4] = src[start : start + count]
        start += count
    return out.tobytes()


def _shard_files(f: BinaryIO, size: int) -> Iterator[ShardFile]:
    """The file records of an uploaded shard (header, then file records up to a bookend)."""
    header = f.read(_ENTRY)
    if len(header) < _ENTRY or header[:32] != SHARD_TAG:
        raise InvalidRequest("not a Xet shard: bad header tag")
    (version,) = struct.unpack("<Q", header[32:40])
    if version != 2:
        raise InvalidRequest(f"Xet shard version {version} is not supported (expected 2)")
    terms_seen = 0
    while True:
        record = f.read(_ENTRY)
        if len(record) < _ENTRY:
            raise InvalidRequest("Xet shard: file section ends without its bookend")
        if record[:32] == _BOOKEND:
            return
        flags, n = struct.unpack("<II", record[32:40])
        terms_seen += n
        if n == 0 or terms_seen > _MAX_TERMS or f.tell() + n * _ENTRY > size:
            raise InvalidRequest(f"Xet shard: a file record states {n} terms")
        terms = []
        for _ in range(n):
            e = f.read(_ENTRY)
            _flags, unpacked, start, end = struct.unpack("<IIII", e[32:48])
            terms.append(Term(xet_hex(e[:32]), start, end, unpacked))
        if flags & _WITH_VERIFICATION:
            f.seek(n * _ENTRY, os.SEEK_CUR)
        if not flags & _WITH_METADATA_EXT:
            raise InvalidRequest(
                "Xet shard: a file record carries no SHA-256 (metadata extension); "
                "this hub keys uploads by SHA-256"
            )
        ext = f.read(_ENTRY)
        if len(ext) < _ENTRY:
            raise InvalidRequest("Xet shard: truncated metadata extension")
        yield ShardFile(
            xet_hex(ext[:32]), tuple(terms)
        )  # a SHA-256 in the same u64 layout as Xet hashes
