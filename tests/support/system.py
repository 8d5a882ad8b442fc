"""Real servers from Debian packages, for tests: the package is installed with apt-get when its
program is missing (as ``make test`` on a fresh Debian machine needs), then started on loopback
with a folder and free ports of its own. PostgreSQL (a throwaway cluster made with initdb) and
nginx (``docker/nginx.conf``, the load balancer in front of hub replicas)."""

from __future__ import annotations

import glob
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from .helpers import ROOT
from .live import listens_on
from .ports import free_port

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
"""Debian's Chromium in the browser tests: headless, as root, no traffic of its own."""

APT_LOCK_WAIT_S = 900
"""How long an install waits for dpkg's lock (held by another worker's install on a fresh machine:
two workers' apt-get at once failed with exit 100)."""


def debian_program(name: str, package: str, pattern: str = "") -> str:
    """The program ``name`` (on PATH or at ``pattern``, a glob), installing Debian's
    ``package`` when it is missing."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(pattern or name))), None)
    if found:
        return found
    if not shutil.which("apt-get"):
        pytest.skip(f"no {name} and no apt-get to install Debian's {package} package")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # another test worker may be installing a package: wait for dpkg's lock rather than fail
    apt = ["apt-get", "-q", "-o", f"DPkg::Lock::Timeout={APT_LOCK_WAIT_S}"]
    install = [*apt, "install", "-y", package]
    if subprocess.run(install, env=env, capture_output=True).returncode:
        subprocess.run([*apt, "update"], env=env, capture_output=True, check=True)
        subprocess.run(install, env=env, capture_output=True, check=True)
    return debian_program(name, package, pattern)


def _pg_bin(name: str) -> str:
    return debian_program(name, "postgresql", f"/usr/lib/postgresql/*/bin/{name}")


class Postgres:
    """A throwaway PostgreSQL server on 127.0.0.1 (run as the ``postgres`` user when we are
    root: the server refuses to run as root); :meth:`new_database` gives each user an empty
    database of its own."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="vip-hub-pg-"))
        self.data = self.folder / "data"
        self.port = free_port()
        self.as_user: list[str] = []
        self._names = itertools.count()

    def start(self) -> Postgres:
        initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if os.geteuid() == 0:
            if subprocess.run(["id", "postgres"], capture_output=True).returncode:
                subprocess.run(["useradd", "--system", "--no-create-home", "postgres"], check=True)
            shutil.chown(self.folder, "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        subprocess.run(
            [*self.as_user, initdb, "-D", str(self.data), "-A", "trust", "-U", "vip", "--no-sync"],
            check=True,
            capture_output=True,
        )
        options = (
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=200"
        )
        subprocess.run(
            [
                *self.as_user,
                pg_ctl,
                "-D",
                str(self.data),
                "-o",
                options,
                "-l",
                str(self.folder / "log"),
                "-w",
                "start",
            ],
            check=True,
            capture_output=True,
        )
        return self

    def new_database(self, encoding: str | None = None) -> str:
        """The URL of a new empty database (in ``encoding``, else the cluster's)."""
        name = f"hub{next(self._names)}"
        url = f"postgresql://vip@127.0.0.1:{self.port}"
        how = f" ENCODING '{encoding}' LOCALE 'C' TEMPLATE template0" if encoding else ""
        with psycopg.connect(f"{url}/postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}{how}")
        return f"{url}/{name}"

    def stop(self) -> None:
        subprocess.run(
            [*self.as_user, _pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
            capture_output=True,
        )
        shutil.rmtree(self.folder, ignore_errors=True)


NGINX_CONF = ROOT / "docker" / "nginx.conf"
NGINX_PROXY = ROOT / "docker" / "nginx-proxy.conf"
NGINX_TLS = ROOT / "docker" / "nginx-tls.conf"
NGINX_MOUNTS = "/etc/nginx/vip-hub"
"""Where the shipped site includes its proxying and TLS files from (the compose files mount
them there)."""


class Nginx:
    """nginx on 127.0.0.1:``port`` running the shipped ``docker/nginx.conf`` (and its
    ``nginx-proxy.conf``), its ``hub`` and ``inference`` upstreams pointed at the given
    ``host:port`` replicas; one worker, so requests go round the replicas in turn. With ``tls``
    (a folder holding ``fullchain.pem`` and ``privkey.pem``) also ``docker/nginx-tls.conf`` on
    ``tls_port``, as ``compose.tls.yaml`` mounts it. Its access log goes to ``access_log``:
    where the site names none, in nginx's default format, as the image's own nginx.conf writes
    it."""

    SHIPPED_ACCESS_LOG = "/var/log/nginx/access.log"
    """Where ``docker/nginx-proxy.conf`` writes its access log (the image links it to stdout)."""

    def __init__(
        self,
        folder: Path,
        port: int,
        hub: list[str],
        inference: list[str],
        tls: Path | None = None,
    ):
        self.folder, self.port = folder, port
        self.hub, self.inference = hub, inference
        self.tls, self.tls_port = tls, free_port() if tls else None
        self.access_log = folder / "access.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def tls_url(self) -> str:
        assert self.tls_port is not None, "nginx was started without TLS"
        return f"https://127.0.0.1:{self.tls_port}"

    def _mounted(self, text: str) -> str:
        """``text`` with the compose files' mount points replaced by this nginx's folder."""
        return text.replace(f"{NGINX_MOUNTS}/", f"{self.folder}/")

    def _site(self) -> str:
        site = NGINX_CONF.read_text().replace("listen 8000;", f"listen 127.0.0.1:{self.port};")
        for name, replicas in (("hub", self.hub), ("inference", self.inference)):
            site = re.sub(
                rf"server {name}:8000([^;]*);",
                lambda m, rs=replicas: " ".join(f"server {r}{m.group(1)};" for r in rs),
                site,
            )
        proxy = NGINX_PROXY.read_text().replace(self.SHIPPED_ACCESS_LOG, str(self.access_log))
        (self.folder / "proxy.conf").write_text(proxy)
        (self.folder / "tls").mkdir(exist_ok=True)
        if self.tls is not None:
            shutil.copytree(self.tls, self.folder / "certs", dirs_exist_ok=True)
            tls = NGINX_TLS.read_text().replace(
                "listen 8443 ssl;", f"listen 127.0.0.1:{self.tls_port} ssl;"
            )
            (self.folder / "tls" / "tls.conf").write_text(self._mounted(tls))
        return self._mounted(site)

    def start(self) -> Nginx:
        nginx = debian_program("nginx", "nginx", "/usr/sbin/nginx")
        (self.folder / "logs").mkdir(parents=True, exist_ok=True)
        temp = " ".join(
            f"{kind}_temp_path {self.folder / kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        conf = self.folder / "nginx.conf"
        conf.write_text(
            ("user root;\n" if os.geteuid() == 0 else "")
            + f"worker_processes 1;\npid {self.folder / 'nginx.pid'};\n"
            + f"error_log {self.folder / 'error.log'} warn;\n"
            + "events { worker_connections 512; }\n"
            + f"http {{\naccess_log {self.access_log};\n{temp}\n{self._site()}\n}}\n"
        )
        self.proc = subprocess.Popen(
            [nginx, "-p", str(self.folder), "-e", str(self.folder / "error.log"), "-c", str(conf)]
            + ["-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.proc.stderr.read().decode()}")  # type: ignore[union-attr]
            if listens_on(self.proc.pid, self.port):
                return self
            if time.monotonic() > deadline:
                raise RuntimeError("nginx did not listen within 30 s")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGQUIT (finish what is in flight), then SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
