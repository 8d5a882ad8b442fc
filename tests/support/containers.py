"""Docker for tests: the engine (started when none answers, stopped afterwards), images built
with BuildKit, stand-ins for the public images the tests cannot pull (Docker Hub is out of
reach: a Debian base made with debootstrap, Debian's packages on top), a page of the host's
local torch wheels for the image build, and compose projects brought up and torn down with
their volumes.

Programs missing on a fresh Debian machine (``docker.io``, ``docker-compose``, ``debootstrap``)
are installed with apt-get as ``system.debian_program`` does. The debootstrap root file system
is kept as a tarball under ``VIP_HUB_TEST_CACHE`` (default ``/var/cache/vip-hub-tests``); without
it the base is made from scratch (about a minute)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .ports import free_port
from .system import debian_program

STAND_INS = Path(__file__).resolve().parent / "images"
CACHE = Path(os.environ.get("VIP_HUB_TEST_CACHE", "/var/cache/vip-hub-tests"))
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
"""What the debootstrap base holds beyond minbase: Python 3.11 for the python:3.11-slim stand-in
(the other stand-ins add their Debian packages in their own Dockerfiles)."""
CA_BUNDLE = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
"""The host's CA bundle: pip inside a build trusts it through the ``pip-ca`` build secret (a
certificate in the chain to PyPI is not in a container's own store)."""


class CommandFailed(RuntimeError):
    pass


def run(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None, input: bytes | None = None
) -> str:
    """Run ``cmd``; its stdout. Fails with the command and the end of its output when it exits
    non-zero or outlives ``timeout`` seconds."""
    try:
        done = subprocess.run(
            cmd,
            input=input,
            capture_output=True,
            timeout=timeout,
            env=None if env is None else {**os.environ, **env},
        )
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"") + (e.stderr or b"")).decode(errors="replace")[-3000:]
        raise CommandFailed(f"{' '.join(cmd)!r} still ran after {timeout:.0f} s:\n{tail}") from None
    if done.returncode:
        tail = (done.stdout + done.stderr).decode(errors="replace")[-4000:]
        raise CommandFailed(f"{' '.join(cmd)!r} exited {done.returncode}:\n{tail}")
    return done.stdout.decode()


def wait_until(what: str, check: Callable[[], object], timeout: float, every: float = 0.5):
    """Poll ``check`` until it returns something true (returned) or ``timeout`` passes (fails,
    naming ``what`` and the last exception ``check`` raised)."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        try:
            got = check()
            if got:
                return got
        except Exception as e:  # reported when time is up
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s (last error: {last!r})")
        time.sleep(every)


def _major(version_line: str) -> int:
    found = re.search(r"version (\d+)\.", version_line)
    return int(found.group(1)) if found else 0


@functools.cache
def buildkit_client() -> str:
    """A docker client that builds with BuildKit (build secrets, ``RUN --mount``): one with the
    buildx plugin, or one older than 23, whose BuildKit is built in (Debian's ``docker.io``)."""
    debian_program("dockerd", "docker.io", "/usr/sbin/dockerd")  # the engine and its client
    tried = []
    for client in dict.fromkeys(filter(None, [shutil.which("docker"), "/usr/bin/docker"])):
        if not Path(client).is_file():
            continue
        buildx = subprocess.run([client, "buildx", "version"], capture_output=True)
        version = subprocess.run([client, "--version"], capture_output=True, text=True).stdout
        if buildx.returncode == 0 or 0 < _major(version) < 23:
            return client
        tried.append(f"{client} ({version.strip()}, no buildx)")
    raise RuntimeError(f"no docker client builds with BuildKit: {', '.join(tried)}")


class Engine:
    """The Docker engine: the one that answers, else a ``dockerd`` started here (as root) with
    Debian's defaults (so images stay cached between runs) and stopped by :meth:`stop`."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.proc: subprocess.Popen[bytes] | None = None
        self.docker = ""

    def _answers(self) -> bool:
        return subprocess.run([self.docker, "info"], capture_output=True).returncode == 0

    def start(self) -> Engine:
        self.docker = buildkit_client()
        if self._answers():
            return self
        if os.geteuid() != 0:
            pytest.skip("no Docker engine answers, and only root may start dockerd")
        dockerd = debian_program("dockerd", "docker.io", "/usr/sbin/dockerd")
        with open(self.folder / "dockerd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [dockerd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log_tail = (self.folder / "dockerd.log").read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"dockerd did not answer within 60 s:\n{log_tail}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        """Stop the dockerd started here (SIGTERM: it stops its containers, then containerd)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)

    def __call__(self, *args: str, timeout: float = 120, input: bytes | None = None) -> str:
        """``docker ARGS``: its stdout."""
        return run([self.docker, *args], timeout, env={"DOCKER_BUILDKIT": "1"}, input=input)

    def has_image(self, tag: str) -> bool:
        return (
            subprocess.run([self.docker, "image", "inspect", tag], capture_output=True).returncode
            == 0
        )

    def inspect(self, name: str) -> dict:
        return json.loads(self("inspect", name))[0]

    def size_mb(self, tag: str) -> float:
        return int(self("image", "inspect", "-f", "{{.Size}}", tag)) / 1e6

    def build(
        self,
        context: Path,
        tag: str,
        dockerfile: Path | None = None,
        args: dict[str, str] | None = None,
        secrets_: dict[str, Path] | None = None,
        network: str | None = None,
        timeout: float = 1200,
    ) -> str:
        """``docker build`` with BuildKit; its log (plain progress)."""
        cmd = ["build", "--progress=plain", "-t", tag]
        cmd += ["-f", str(dockerfile)] if dockerfile else []
        for key, value in (args or {}).items():
            cmd += ["--build-arg", f"{key}={value}"]
        for key, path in (secrets_ or {}).items():
            cmd += ["--secret", f"id={key},src={path}"]
        cmd += ["--network", network] if network else []
        done = subprocess.run(
            [self.docker, *cmd, str(context)],
            capture_output=True,
            timeout=timeout,
            env={**os.environ, "DOCKER_BUILDKIT": "1"},
        )
        log = (done.stdout + done.stderr).decode(errors="replace")
        if done.returncode:
            raise CommandFailed(f"docker build of {tag} exited {done.returncode}:\n{log[-6000:]}")
        return log


def debian_base(engine: Engine) -> tuple[str, float]:
    """The image ``vip-hub-test/bookworm:KEY``: debootstrap's minbase with ``BASE_PACKAGES``,
    imported; its root file system cached as a tarball in ``CACHE``. Returns the tag and the
    seconds spent making it (0 when the engine had it)."""
    key = hashlib.sha256(f"{SUITE} {MIRROR} minbase {BASE_PACKAGES}".encode()).hexdigest()[:12]
    tag = f"vip-hub-test/{SUITE}:{key}"
    if engine.has_image(tag):
        return tag, 0.0
    start = time.monotonic()
    tarball = CACHE / f"{SUITE}-minbase-{key}.tar"
    if not tarball.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        debootstrap = debian_program("debootstrap", "debootstrap", "/usr/sbin/debootstrap")
        rootfs = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE))
        try:
            run(
                [
                    debootstrap,
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    SUITE,
                    str(rootfs),
                    MIRROR,
                ],
                timeout=900,
            )
            partial = tarball.with_suffix(".partial")
            run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], timeout=300)
            partial.replace(tarball)  # whole or absent, should a run be killed meanwhile
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)
    engine("import", str(tarball), tag, timeout=300)
    return tag, time.monotonic() - start


def stand_in(engine: Engine, name: str, base: str, extra: dict[str, Path] | None = None) -> str:
    """Build the stand-in ``tests/support/images/NAME`` on ``base`` (files in ``extra`` join its
    build context); its tag."""
    tag = f"vip-hub-test/{name}:latest"
    with tempfile.TemporaryDirectory(prefix=f"{name}-context-") as tmp:
        context = Path(tmp) / name
        shutil.copytree(STAND_INS / name, context)
        for filename, source in (extra or {}).items():
            shutil.copy2(source, context / filename)
        engine.build(context, tag, args={"BASE": base}, timeout=900)
    return tag


WHEEL_PAGE_PORT = 38517


class WheelPage:
    """A page of links to the local wheels the host's pip takes for ``requirements`` (pip's
    configured find-links and file:// indexes: for this project the pinned torch and torchvision
    and their CUDA libraries, none of them on PyPI at these versions), served on 127.0.0.1: a
    build with ``--network host`` reads it as TORCH_FIND_LINKS. The rest comes from the index."""

    def __init__(self, folder: Path, requirements: list[str]):
        self.folder = folder
        report = folder / "report.json"
        run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
            + ["--report", str(report), *requirements],
            timeout=600,
        )
        local = [
            Path(item["download_info"]["url"].removeprefix("file://"))
            for item in json.loads(report.read_text())["install"]
            if item["download_info"]["url"].startswith("file://")
        ]
        self.wheels = sorted(p.name for p in local)
        links = []
        for path in local:
            (folder / path.name).symlink_to(path)
            links.append(f'<a href="{path.name}">{path.name}</a>')
        (folder / "index.html").write_text(
            "<html><body>\n" + "\n".join(links) + "\n</body></html>\n"
        )
        handler = functools.partial(_QuietHandler, directory=str(folder))
        try:  # the same URL every run: it is a build argument, part of the layers' cache key
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEEL_PAGE_PORT), handler)
        except OSError:  # taken: the build still works, without the cached torch layer
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def __enter__(self) -> WheelPage:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def compose_program() -> str:
    return debian_program("docker-compose", "docker-compose", "/usr/bin/docker-compose")


class Compose:
    """One compose project (a fresh name) over ``files``, with ``env`` for their variables.
    Leaving the ``with`` block takes it down with its volumes, named and anonymous, and checks
    that none of its containers, networks or volumes is left; on a failure the services' logs
    are printed (pytest shows them with the failure) and kept in ``folder``."""

    def __init__(self, engine: Engine, folder: Path, files: list[Path], env: dict[str, str]):
        self.engine, self.folder, self.files = engine, folder, files
        self.project = "viphubtest" + secrets.token_hex(4)
        self.env = env
        self.volumes: set[str] = set()

    def __call__(self, *args: str, timeout: float = 300) -> str:
        """``docker-compose ARGS`` on this project: its stdout."""
        files = [arg for f in self.files for arg in ("-f", str(f))]
        return run([compose_program(), "-p", self.project, *files, *args], timeout, env=self.env)

    def up(self, *args: str, timeout: float = 300) -> None:
        self("up", "-d", "--no-build", *args, timeout=timeout)
        self._note_volumes()

    def containers(self, service: str, all_: bool = False) -> list[str]:
        """The ids of ``service``'s containers (running ones, or all)."""
        out = self.engine(
            "ps",
            *(["-a"] if all_ else []),
            "-q",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
        )
        return out.split()

    def ip(self, container: str) -> str:
        networks = self.engine.inspect(container)["NetworkSettings"]["Networks"]
        return next(iter(networks.values()))["IPAddress"]

    def health(self, container: str) -> str:
        return self.engine.inspect(container)["State"].get("Health", {}).get("Status", "none")

    def _note_volumes(self) -> None:
        """Remember every volume the project's containers mount (anonymous ones carry no
        project label), to check after ``down -v`` that none is left."""
        ids = self.engine(
            "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}"
        ).split()
        for cid in ids:
            for mount in self.engine.inspect(cid)["Mounts"]:
                if mount.get("Type") == "volume":
                    self.volumes.add(mount["Name"])

    def leftovers(self) -> list[str]:
        """What of the project still exists: containers, networks, volumes."""
        label = f"label=com.docker.compose.project={self.project}"
        found = [f"container {c}" for c in self.engine("ps", "-aq", "--filter", label).split()]
        found += [
            f"network {n}" for n in self.engine("network", "ls", "-q", "--filter", label).split()
        ]
        volumes = set(self.engine("volume", "ls", "-q").split())
        found += [f"volume {v}" for v in sorted(self.volumes & volumes)]
        found += [
            f"volume {v}" for v in self.engine("volume", "ls", "-q", "--filter", label).split()
        ]
        return found

    def down(self) -> None:
        self._note_volumes()
        self("down", "--volumes", "--remove-orphans", "--timeout", "30", timeout=300)

    def logs(self) -> str:
        with contextlib.suppress(CommandFailed):
            return self("logs", "--no-color", "--timestamps", timeout=120)
        return ""

    def __enter__(self) -> Compose:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            logs = self.logs()
            (self.folder / f"{self.project}.log").write_text(logs)
            print(f"== compose logs of {self.project} (last 200 lines) ==")
            print("\n".join(logs.splitlines()[-200:]))
        self.down()
        left = self.leftovers()
        if exc_type is None:
            assert not left, f"`docker-compose down --volumes` left {left}"
        elif left:
            print(f"`docker-compose down --volumes` left {left}")
