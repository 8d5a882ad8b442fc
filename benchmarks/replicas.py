"""Hub replicas behind nginx, side by side in one run (ratios, never a pass/fail; issue 37).

A throwaway PostgreSQL (``tests/support/system.Postgres``), a SeaweedFS
(``tests/support/seaweed.py``), two ``vip-hub serve`` replicas (hub and inference, default settings:
torch threads = all cores) sharing them, nginx running the shipped ``docker/nginx.conf``
(``tests/support/system.Nginx``) in front of both, and a second nginx in front of the first replica
alone:

transfers: ``objstore.py``'s rounds (a repo at real size, 395 MB, a fresh seed each round) with
    the clients going through nginx to both replicas: upload with ``upload_folder``'s steps over
    presigned LFS against boto3 straight to the store (b/a), ``snapshot_download`` (302s to
    presigned GETs) against presigned GETs straight from the store (d/c); goal >= 0.9;
embeddings: ``/v1/embeddings`` (one JPEG a request, ``serve.py``'s load generator and model)
    at concurrency 32 through nginx to two replicas against nginx to one, alternated point by
    point; the ratio of requests/s, and the CPU each side used in cores (CPU seconds per
    second): the replicas, nginx, the load generator, and the whole machine (other jobs
    included), and requests per CPU second of the replicas. Two replicas can only beat one
    where one leaves cores idle: on the 2-core development machine one replica's forward
    already uses both, and what a second one adds there is a larger share of cores taken from
    other jobs, which the CPU columns show.

    python benchmarks/replicas.py [--rounds 2] [--points 3] [--seconds 8] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

# objstore first: it puts tests/ on sys.path and sets huggingface_hub's environment (Xet off)
from objstore import print_transfers, start_store, transfer_rounds
from serve import export_model, load, make_images

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` and of all their descendants (nginx's worker)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        times[pid] = (int(fields[11]) + int(fields[12])) / _TICK
    total, todo = 0.0, list(pids)
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo += [child for child, parent in parents.items() if parent == pid]
    return total


def _machine_busy() -> tuple[float, float]:
    """The machine's busy and total CPU seconds so far (every process, other jobs included)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values) - idle) / _TICK, sum(values) / _TICK


def embeddings_point(
    port: int, bodies: list[bytes], concurrency: int, seconds: float, servers: dict[str, list[int]]
) -> dict[str, float]:
    """One load point through nginx on ``port``: requests/s, p50/p99, errors and the client's
    cores from ``serve.load``, and the cores (CPU seconds per second) each of ``servers`` used."""
    before = {name: _cpu_seconds(pids) for name, pids in servers.items()}
    busy, total = _machine_busy()
    start = time.perf_counter()
    point = asyncio.run(load(port, "/v1/embeddings", bodies, concurrency, seconds))
    elapsed = time.perf_counter() - start
    for name, pids in servers.items():
        point[name] = (_cpu_seconds(pids) - before[name]) / elapsed
    busy2, total2 = _machine_busy()
    point["machine"] = (busy2 - busy) / (total2 - total) * (os.cpu_count() or 1)
    return point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="transfer rounds")
    parser.add_argument("--points", type=int, default=3, help="embedding points per side")
    parser.add_argument("--seconds", type=float, default=8.0, help="time per embedding point")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--arch", default="vip-nano")
    parser.add_argument("--img-size", type=int, default=224)
    args = parser.parse_args()

    from support.live import WRITE_TOKEN, ProcessServer
    from support.ports import free_port
    from support.system import Nginx, Postgres

    from vip_hub.repo.push import push_repo

    work = Path(tempfile.mkdtemp(prefix="vip-hub-replicas-bench-"))
    weed, env = start_store(work)
    postgres = Postgres().start()
    env = {
        **env,
        "VIP_HUB_INDEX": postgres.new_database(),
        "VIP_HUB_INFERENCE__MAX_QUEUE_IMAGES": "100000",
        "VIP_HUB_INFERENCE__PRELOAD": '["big/embed"]',
    }
    replicas = [ProcessServer(work / f"replica-{i}", extra_env=env, inference=True) for i in (0, 1)]
    balancers: list[Nginx] = []
    load_before = os.getloadavg()
    try:
        for r in replicas:
            r.start()
        both = [f"127.0.0.1:{r.port}" for r in replicas]
        two = Nginx(work / "nginx-2", free_port(), both, both).start()
        balancers.append(two)
        one = Nginx(work / "nginx-1", free_port(), both[:1], both[:1]).start()
        balancers.append(one)

        model = export_model(work, args.arch, args.img_size)
        push_repo(model, "big/embed", endpoint=two.url, token=WRITE_TOKEN)
        bodies = [
            json.dumps({"model": "big/embed", "input": [base64.b64encode(i).decode()]}).encode()
            for i in make_images(64, args.img_size)
        ]
        for lb in (one, two, two):  # the model loaded on both replicas before any point
            asyncio.run(load(lb.port, "/v1/embeddings", bodies, 2, 1.0))
        print(
            f"{os.cpu_count()} cores, load average {load_before[0]:.1f} "
            f"(5 min {load_before[1]:.1f}) at the start; embeddings: {args.arch} at "
            f"{args.img_size} px, one image a request, concurrency {args.concurrency}, "
            f"{args.seconds:g} s a point; CPU in cores (CPU s per s)",
            flush=True,
        )
        points: dict[int, list[dict]] = {1: [], 2: []}
        for _ in range(args.points):
            for n, lb in ((1, one), (2, two)):
                servers = {
                    "replicas": [r.proc.pid for r in replicas[:n]],
                    "nginx": [lb.proc.pid],
                }
                p = embeddings_point(lb.port, bodies, args.concurrency, args.seconds, servers)
                points[n].append(p)
                print(
                    f"  {n} replica{'s' if n > 1 else ' '} {p['rate']:6.1f} req/s  p50 "
                    f"{p['p50']:6.0f} ms  p99 {p['p99']:6.0f} ms  err {p['errors']}  CPU: "
                    f"replicas {p['replicas']:.2f} ({p['rate'] / p['replicas']:.1f} req per "
                    f"CPU s), nginx {p['nginx']:.3f}, client {p['client_cpu']:.3f}, whole "
                    f"machine {p['machine']:.2f} of "
                    f"{os.cpu_count()}; load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        med = {n: statistics.median(p["rate"] for p in pts) for n, pts in points.items()}
        per_cpu = {
            n: statistics.median(p["rate"] / p["replicas"] for p in pts)
            for n, pts in points.items()
        }
        print(
            f"embeddings 2 replicas / 1 replica: {med[2] / med[1]:.2f} "
            f"({med[2]:.1f} vs {med[1]:.1f} req/s, medians of {args.points} points); per "
            f"replica CPU second: {per_cpu[2] / per_cpu[1]:.2f} ({per_cpu[2]:.1f} vs "
            f"{per_cpu[1]:.1f} req)\n",
            flush=True,
        )

        transfers = transfer_rounds(two.url, weed, work, args.rounds)
        print_transfers(
            transfers,
            f"through nginx to 2 replicas (PostgreSQL index); load average "
            f"{os.getloadavg()[0]:.1f} at the end",
        )
    finally:
        for stop in [*balancers, *replicas, postgres, weed]:
            stop.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
