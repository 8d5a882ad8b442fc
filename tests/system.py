"""Real servers from Debian packages, for tests: the package is installed with apt-get when its
program is missing (as ``make test`` on a fresh Debian machine needs), then started on loopback
with a folder and free ports of its own. PostgreSQL (a throwaway cluster made with initdb) and
nginx (a load balancer in front of hub replicas)."""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest
from live import free_port


def debian_program(name: str, package: str, pattern: str = "") -> str:
    """The program ``name`` (on PATH or at ``pattern``, a glob), installing Debian's
    ``package`` when it is missing."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(pattern or name))), None)
    if found:
        return found
    if not shutil.which("apt-get"):
        pytest.skip(f"no {name} and no apt-get to install Debian's {package} package")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", package]
    if subprocess.run(install, env=env, capture_output=True).returncode:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
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

    def new_database(self) -> str:
        """The URL of a new empty database."""
        name = f"hub{next(self._names)}"
        url = f"postgresql://vip@127.0.0.1:{self.port}"
        with psycopg.connect(f"{url}/postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"{url}/{name}"

    def stop(self) -> None:
        subprocess.run(
            [*self.as_user, _pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
            capture_output=True,
        )
        shutil.rmtree(self.folder, ignore_errors=True)
