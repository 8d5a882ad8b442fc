"""Transfers through a hub whose blobs live in an object store, against the same bytes moved
straight to and from that store, side by side in one run (ratios, never a pass/fail).

A real SeaweedFS (``tests/seaweed.py``) on loopback, ``vip-hub serve`` in its own process with
its blobs in that bucket, and a repo at real size each round (``tests/helpers.base_size_repo``,
a fresh seed each round so that nothing is deduplicated: a ViP-Base encoder of 344 MB, a 52 MB
MAE decoder, small files):

(a) upload straight: each file of the repo sent to the store with boto3 (multipart in parts of
    ``object_store.multipart_chunk_bytes``, one part at a time, as huggingface_hub sends them);
(b) upload through the hub: what huggingface_hub ``upload_folder`` does over Git LFS
    (``HF_HUB_DISABLE_XET=1``): ``preupload_lfs_files`` (the batch reply's presigned PUTs to
    staging keys, the hub's verify of each: it reads the staged object back, hashes it and
    copies it to its upload key), then ``create_commit`` (``verify_repo`` on the hub, uploads
    copied to their blob keys), whose share of the time is printed;
(c) download straight: each file's blob streamed from a presigned GET into a file;
(d) download through the hub: ``snapshot_download`` (each LFS file a 302 to a presigned GET).

Ratios a/b (upload) and c/d (download), goal >= 0.9. With ``--balancer URL`` the clients reach
the hub through that URL (a load balancer in front of the hub this script starts on ``--port``)
instead of the hub itself.

    python benchmarks/objstore.py [--rounds 3] [--port P --balancer URL]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ["HF_HUB_DISABLE_XET"] = "1"  # the Git LFS batch API: presigned URLs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, help="the hub's port (default: a free one)")
    parser.add_argument(
        "--balancer", help="the URL clients reach the hub through (default: the hub itself)"
    )
    args = parser.parse_args()

    import httpx
    from boto3.s3.transfer import TransferConfig
    from helpers import base_size_repo
    from huggingface_hub import CommitOperationAdd, HfApi, snapshot_download
    from live import WRITE_TOKEN, ProcessServer
    from seaweed import BUCKET, SeaweedFS

    from service.settings import ObjectStoreSettings
    from service.store import hash_file
    from service.store.s3 import S3Objects, blob_key
    from vip_hub.repo.verify import repo_files

    work = Path(tempfile.mkdtemp(prefix="vip-hub-objstore-bench-"))
    os.environ["HF_HOME"] = str(work / "hf")
    weed = SeaweedFS(work / "seaweed").start()
    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = (
        weed.access_key,
        weed.secret_key,
    )
    settings = ObjectStoreSettings(endpoint=weed.url, bucket=BUCKET)
    server = ProcessServer(
        work / "store",
        port=args.port,
        extra_env={
            "VIP_HUB_OBJECT_STORE__ENDPOINT": weed.url,
            "VIP_HUB_OBJECT_STORE__BUCKET": BUCKET,
        },
    )
    server.start()
    url = args.balancer or server.url
    api, s3, signer = HfApi(endpoint=url, token=WRITE_TOKEN), weed.client(), S3Objects(settings)
    parts = TransferConfig(
        multipart_threshold=settings.multipart_chunk_bytes,
        multipart_chunksize=settings.multipart_chunk_bytes,
        max_concurrency=1,
    )
    http = httpx.Client(timeout=300)
    rates: dict[str, list[float]] = {k: [] for k in "abcd"}
    commit_share: list[float] = []
    load = os.getloadavg()[0]
    try:
        for r in range(args.rounds):
            folder = base_size_repo(work / f"repo{r}", seed=r)
            files = repo_files(folder)
            size = sum(p.stat().st_size for p in files.values())
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
            commit_share.append((time.perf_counter() - sent) / (time.perf_counter() - start))

            start = time.perf_counter()
            for rel, key in keys.items():
                source = signer.presign_get(key)
                target = work / "straight" / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with http.stream("GET", source) as got, open(target, "wb") as out:
                    for chunk in got.iter_bytes(1 << 20):
                        out.write(chunk)
            rates["c"].append(size / (time.perf_counter() - start) / 2**20)

            start = time.perf_counter()
            snapshot_download(f"big/bench{r}", endpoint=url, cache_dir=work / f"dl{r}")
            rates["d"].append(size / (time.perf_counter() - start) / 2**20)
            for done in (folder, work / "straight", work / f"dl{r}"):
                shutil.rmtree(done)
            for rel in files:
                s3.delete_object(Bucket=BUCKET, Key=f"straight/{r}/{rel}")
    finally:
        server.stop()
        weed.stop()
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    print(
        f"repo {size / 1e6:.0f} MB ({len(files)} files), {args.rounds} rounds, median MiB/s; "
        f"hub at {url}; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(f"(a) upload straight to the store     {med(rates['a']):7.0f}")
    print(
        f"(b) upload through the hub (LFS)     {med(rates['b']):7.0f}   b/a "
        f"{med(rates['b']) / med(rates['a']):.2f}  (goal >= 0.9; the commit "
        f"{med(commit_share):.0%} of it)"
    )
    print(f"(c) download straight from the store {med(rates['c']):7.0f}")
    print(
        f"(d) download through the hub (302)   {med(rates['d']):7.0f}   d/c "
        f"{med(rates['d']) / med(rates['c']):.2f}  (goal >= 0.9)"
    )


if __name__ == "__main__":
    main()
