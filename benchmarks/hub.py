"""Hub transfer speed, side by side in one run (ratios, never a pass/fail).

For one large file (random bytes, ``--mib`` MiB) on this machine's loopback:

(a) a plain loopback copy: the bytes sent over a 127.0.0.1 TCP socket (``sendfile``) to a
    thread that writes them to a file in the same folder and fsyncs it: the floor of any
    transfer that lands on disk;
(b) upload through the hub: the file's transfer with unmodified huggingface_hub, through Xet
    (hf_xet: chunking, xorbs, a shard; the hub rebuilds and hashes the file) and through the
    Git LFS batch API (one streamed PUT, hashed as it lands); and for reference the whole
    publish, ``vip-hub push`` of a repo holding the file (local verification, the upload,
    the commit's verification);
(c) download through the hub: ``hf_hub_download`` of the file (HEAD, then a GET served from
    the blob store).

Targets: download/copy >= 0.9, upload/copy >= 0.5. The server runs as ``vip-hub serve`` in
its own process.

    python benchmarks/hub.py [--mib 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the project ahead of tests/, whose service/ and training/ folders would shadow its packages
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def loopback_copy(src: Path, dst: Path) -> float:
    """Seconds to send ``src`` over a loopback socket into ``dst`` (written and fsynced)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def receive() -> None:
            conn, _ = server.accept()
            with conn, open(dst, "wb") as out:
                while chunk := conn.recv(1 << 20):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())

        start = time.perf_counter()
        receiver = threading.Thread(target=receive)
        receiver.start()
        with socket.create_connection(server.getsockname()) as client, open(src, "rb") as f:
            client.sendfile(f)
        receiver.join()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="size of the file moved (MiB)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from huggingface_hub import CommitOperationAdd, HfApi, hf_hub_download
    from support.helpers import TINY, random_text, synthetic_stage, tiny_encoder
    from support.live import WRITE_TOKEN, ProcessServer

    from vip_hub import export_encoder
    from vip_hub.repo.push import push_repo

    size = args.mib << 20
    work = Path(tempfile.mkdtemp(prefix="vip-hub-bench-"))
    os.environ["HF_HOME"] = str(work / "hf")
    server = ProcessServer(work / "store").start()
    api = HfApi(endpoint=server.url, token=WRITE_TOKEN)
    copies, pushes, xets, puts, gets = [], [], [], [], []
    try:
        for r in range(args.rounds):
            data = random_text(size)  # fresh bytes each round: nothing is deduplicated
            repo = export_encoder(
                work / f"repo{r}",
                tiny_encoder(r),
                TINY,
                [synthetic_stage()],
                model_name="bench",
                extra_files={"blob.txt": data},
            )
            del data
            blob = repo / "blob.txt"
            copies.append(size / loopback_copy(blob, work / "copy.bin") / 2**20)
            (work / "copy.bin").unlink()

            start = time.perf_counter()
            push_repo(repo, f"bench/r{r}", endpoint=server.url, token=WRITE_TOKEN)
            pushes.append(size / (time.perf_counter() - start) / 2**20)

            fresh = work / "xet.dat"
            with open(blob, "rb") as src, open(fresh, "wb") as dst:  # other bytes than pushed above
                dst.write(b"y")
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
            start = time.perf_counter()  # a path: huggingface_hub takes Xet
            api.preupload_lfs_files(f"bench/r{r}", [CommitOperationAdd("xet.dat", str(fresh))])
            xets.append(fresh.stat().st_size / (time.perf_counter() - start) / 2**20)
            fresh.unlink()

            fresh = work / "lfs.bin"
            with open(blob, "rb") as src, open(fresh, "wb") as dst:  # other bytes than pushed above
                dst.write(b"x")
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
            with open(
                fresh, "rb"
            ) as f:  # a file object: huggingface_hub takes the Git LFS batch API
                op = CommitOperationAdd("other.dat", f)
                _ = (
                    op.upload_info.sha256
                )  # hashed before the clock starts, as push hashes its files too
                start = time.perf_counter()
                api.preupload_lfs_files(f"bench/r{r}", [op])
                puts.append(fresh.stat().st_size / (time.perf_counter() - start) / 2**20)
            fresh.unlink()

            start = time.perf_counter()
            hf_hub_download(
                f"bench/r{r}", "blob.txt", endpoint=server.url, cache_dir=work / f"dl{r}"
            )
            gets.append(size / (time.perf_counter() - start) / 2**20)
    finally:
        server.stop()

    med = statistics.median
    print(f"file {args.mib} MiB, {args.rounds} rounds (median MiB/s)")
    print(f"(a) loopback copy            {med(copies):8.0f}")
    print(
        f"(b) upload: Xet transfer     {med(xets):8.0f}   xet/copy  {med(xets) / med(copies):.2f}  "
        "(target >= 0.5)"
    )
    print(
        f"    upload: Git LFS PUT      {med(puts):8.0f}   lfs/copy  {med(puts) / med(copies):.2f}  "
        "(target >= 0.5)"
    )
    print(
        f"    publish: vip-hub push    {med(pushes):8.0f}   push/copy "
        f"{med(pushes) / med(copies):.2f}  (verifies locally, uploads, verifies again on commit)"
    )
    print(
        f"(c) download: hf_hub_download{med(gets):8.0f}   get/copy  {med(gets) / med(copies):.2f}  "
        "(target >= 0.9)"
    )


if __name__ == "__main__":
    main()
