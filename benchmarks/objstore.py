"""Transfers through a hub whose blobs live in an object store, against the same bytes moved
straight to and from that store, side by side in one run (ratios, never a pass/fail).

A real SeaweedFS (``tests/support/seaweed.py``) on loopback, ``vip-hub serve`` in its own
process with its blobs in that bucket, and a repo at real size each round
(``tests/support/helpers.base_size_repo``, a fresh seed each round so that nothing is
deduplicated: a ViP-Base encoder of 344 MB, a 52 MB MAE decoder, small files):

(a) upload straight: each file of the repo sent to the store with boto3 (multipart in parts of
    ``object_store.multipart_chunk_bytes``, one part at a time, as huggingface_hub sends them);
(b) upload through the hub: what huggingface_hub ``upload_folder`` does over Git LFS
    (``HF_HUB_DISABLE_XET=1``): ``preupload_lfs_files`` (the batch reply's presigned PUTs to
    staging keys, the hub's verify of each: it reads the staged object back, hashes it and
    copies it to its upload key), then ``create_commit`` (``verify_repo`` on the hub, each
    upload hashed again and sent to its blob key), whose share of the time is printed;
(c) download straight: each file's blob from a presigned GET into a file, through
    huggingface_hub's own GET loop (``http_get``), which (d) runs after each 302;
(d) download through the hub: ``snapshot_download`` (each LFS file a 302 to a presigned GET).

Ratios b/a (upload) and d/c (download), goal >= 0.9. ``benchmarks/replicas.py`` runs the same
rounds through nginx in front of two hub replicas.

    python benchmarks/objstore.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
# the project ahead of tests/, whose service/ and training/ folders would shadow its packages
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ["HF_HUB_DISABLE_XET"] = "1"  # the Git LFS batch API: presigned URLs

if TYPE_CHECKING:
    from support.seaweed import SeaweedFS


@dataclass
class Transfers:
    """MiB/s of each round under "a".."d", the commit's share of (b) under "commit"; the repo."""

    rates: dict[str, list[float]] = field(
        default_factory=lambda: {k: [] for k in ("a", "b", "c", "d", "commit")}
    )
    size: int = 0
    files: int = 0


def transfer_rounds(url: str, weed: SeaweedFS, work: Path, rounds: int) -> Transfers:
    """(a)-(d) above, ``rounds`` times, the clients reaching the hub at ``url`` (the hub or a
    balancer in front of it), its blobs in ``weed``'s bucket."""
    from boto3.s3.transfer import TransferConfig
    from huggingface_hub import CommitOperationAdd, HfApi, snapshot_download
    from huggingface_hub.file_download import http_get
    from support.helpers import base_size_repo
    from support.live import WRITE_TOKEN
    from support.seaweed import BUCKET

    from service.settings import ObjectStoreSettings
    from service.store import hash_file
    from service.store.s3 import S3Objects, blob_key
    from vip_hub.repo.verify import repo_files

    settings = ObjectStoreSettings(endpoint=weed.url, bucket=BUCKET)
    api, s3, signer = HfApi(endpoint=url, token=WRITE_TOKEN), weed.client(), S3Objects(settings)
    parts = TransferConfig(
        multipart_threshold=settings.multipart_chunk_bytes,
        multipart_chunksize=settings.multipart_chunk_bytes,
        max_concurrency=1,
    )
    result = Transfers()
    rates = result.rates
    for r in range(rounds):
        folder = base_size_repo(work / f"repo{r}", seed=r)
        files = repo_files(folder)
        size = sum(p.stat().st_size for p in files.values())
        result.size, result.files = size, len(files)
        keys = {rel: blob_key(hash_file(path).sha256) for rel, path in files.items()}

        start = time.perf_counter()
        for rel, path in files.items():
            s3.upload_file(str(path), BUCKET, f"straight/{r}/{rel}", Config=parts)
        rates["a"].append(size / (time.perf_counter() - start) / 2**20)

        api.create_repo(f"big/bench{r}")
        ops = [CommitOperationAdd(rel, str(path)) for rel, path in files.items()]
        start = time.perf_counter()  # what upload_folder does: preupload, then the commit
        api.preupload_lfs_files(f"big/bench{r}", ops)
        sent = time.perf_counter()
        api.create_commit(f"big/bench{r}", ops, commit_message="v1")
        rates["b"].append(size / (time.perf_counter() - start) / 2**20)
        rates["commit"].append((time.perf_counter() - sent) / (time.perf_counter() - start))

        start = time.perf_counter()
        for rel, key in keys.items():  # the client's own GET loop, as (d) runs it after the 302
            target = work / "straight" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                http_get(signer.presign_get(key), out)
        rates["c"].append(size / (time.perf_counter() - start) / 2**20)

        start = time.perf_counter()
        snapshot_download(f"big/bench{r}", endpoint=url, cache_dir=work / f"dl{r}")
        rates["d"].append(size / (time.perf_counter() - start) / 2**20)
        for done in (folder, work / "straight", work / f"dl{r}"):
            shutil.rmtree(done)
        for rel in files:
            s3.delete_object(Bucket=BUCKET, Key=f"straight/{r}/{rel}")
    return result


def print_transfers(out: Transfers, through: str) -> None:
    """The medians of :func:`transfer_rounds`' rates and their ratios; ``through`` names the
    way the clients reached the hub."""
    med, rates = statistics.median, out.rates
    print(
        f"repo {out.size / 1e6:.0f} MB ({out.files} files), "
        f"{len(rates['a'])} rounds, median MiB/s; clients reach the hub {through}"
    )
    print(f"(a) upload straight to the store     {med(rates['a']):7.0f}")
    print(
        f"(b) upload through the hub (LFS)     {med(rates['b']):7.0f}   b/a "
        f"{med(rates['b']) / med(rates['a']):.2f}  (goal >= 0.9; the commit "
        f"{med(rates['commit']):.0%} of it)"
    )
    print(f"(c) download straight from the store {med(rates['c']):7.0f}")
    print(
        f"(d) download through the hub (302)   {med(rates['d']):7.0f}   d/c "
        f"{med(rates['d']) / med(rates['c']):.2f}  (goal >= 0.9)"
    )


def start_store(work: Path) -> tuple[SeaweedFS, dict[str, str]]:
    """A SeaweedFS in ``work`` with its credentials in this process's environment (which hub
    processes inherit), client caches in ``work``; the settings that put a hub's blobs there."""
    from support.seaweed import BUCKET, SeaweedFS

    os.environ["HF_HOME"] = str(work / "hf")
    weed = SeaweedFS(work / "seaweed").start()
    os.environ["AWS_ACCESS_KEY_ID"] = weed.access_key
    os.environ["AWS_SECRET_ACCESS_KEY"] = weed.secret_key
    env = {"VIP_HUB_OBJECT_STORE__ENDPOINT": weed.url, "VIP_HUB_OBJECT_STORE__BUCKET": BUCKET}
    return weed, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from support.live import ProcessServer

    work = Path(tempfile.mkdtemp(prefix="vip-hub-objstore-bench-"))
    weed, env = start_store(work)
    server = ProcessServer(work / "store", extra_env=env)
    load = os.getloadavg()[0]
    try:
        server.start()
        rates = transfer_rounds(server.url, weed, work, args.rounds)
    finally:
        server.stop()
        weed.stop()
        shutil.rmtree(work, ignore_errors=True)
    print_transfers(
        rates, f"directly; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )


if __name__ == "__main__":
    main()
