"""Checkpoints on S3-compatible object stores (AWS S3, MinIO, SeaweedFS, R2, ...).

Layout: `<prefix>/step_00000100/<file>` for every file of the local checkpoint directory, then
`<prefix>/step_00000100/CHECKPOINT.sha256.json` (names, sizes, sha256) uploaded LAST. The marker is
the commit: a checkpoint without it is an interrupted upload and is never listed as complete.

Credentials come only from the standard AWS chain (env, profile, instance role). They are never
passed around, printed or logged; errors name the endpoint, bucket and key, and the S3 error code,
never a server message (servers may echo request details) nor a credential.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_train.checkpoint.integrity import FileEntry
from dflash_train.checkpoint.local import step_of
from dflash_train.errors import UserError

MARKER = "CHECKPOINT.sha256.json"
MARKER_FORMAT = "dflash-checkpoint-sha256/1"
_MiB = 1024 * 1024

# S3 error codes that retrying cannot fix: the user has to change credentials or configuration.
_PERMANENT_CODES = {
    "AccessDenied": "access denied (check the credentials' permissions)",
    "InvalidAccessKeyId": "credentials rejected: unknown access key id",
    "SignatureDoesNotMatch": "credentials rejected: secret key does not match",
    "InvalidToken": "credentials rejected: invalid session token",
    "NoSuchBucket": "bucket does not exist",
    "AllAccessDisabled": "access to the bucket is disabled",
    "InvalidBucketName": "invalid bucket name",
}
# HEAD responses carry no body, hence no error code: only the status tells. A 404 is permanent only
# where the caller says what was not found (a NoSuchUpload after a server restart is worth a retry).
_PERMANENT_STATUS = {403: "access denied (403: wrong credentials or permissions)"}


class RemoteStorageError(UserError, RuntimeError):
    """A remote operation failed. `transient` = worth retrying (network, 5xx, throttling). Its
    message names the endpoint, bucket and key: the CLI prints it as one line."""

    def __init__(self, message: str, *, transient: bool):
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True)
class S3Url:
    bucket: str
    prefix: str
    """No leading or trailing '/'; may be empty (checkpoints at the bucket root)."""

    @classmethod
    def parse(cls, url: str) -> S3Url:
        if not url.startswith("s3://"):
            raise ValueError(f"remote checkpoint location must look like s3://bucket/prefix, got {url!r}")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {url!r} (expected s3://bucket/prefix)")
        return cls(bucket, prefix.strip("/"))

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def _import_boto3():
    """boto3 is the optional `s3` extra: it and botocore are imported inside S3Store's methods, here
    first with an install hint."""
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError:
        raise ImportError("S3 checkpoints need boto3: pip install 'dflash-train[s3]'") from None
    return boto3, botocore


class S3Store:
    """One `s3://bucket/prefix` on one endpoint. Thread-safe (boto3 clients are)."""

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        multipart_threshold: int = 64 * _MiB,
        multipart_chunksize: int = 64 * _MiB,
        max_concurrency: int = 4,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        max_attempts: int = 3,
    ):
        """`max_attempts`: botocore's own tries per request (standard retry mode), initial included."""
        boto3, botocore = _import_boto3()
        from boto3.s3.transfer import TransferConfig

        self.url = S3Url.parse(url)
        self._errors = botocore.exceptions
        # Path-style addressing for custom endpoints: MinIO/SeaweedFS/Ceph behind an IP or a single
        # host name cannot serve virtual-host buckets.
        self._client_config = botocore.config.Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        self._new_client = lambda config: boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )
        self.client = self._new_client(self._client_config)
        self.transfer_config = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=True,
        )

    @property
    def endpoint(self) -> str:
        return self.client.meta.endpoint_url

    def where(self, name: str = "") -> str:
        """For messages: the endpoint and the full s3:// location, nothing secret."""
        return f"s3://{self.url.bucket}/{self.url.key(name)} at {self.endpoint}"

    # ---- errors ---------------------------------------------------------------------------------

    @contextmanager
    def _translate(self, action: str, key: str = "", not_found: str | None = None) -> Iterator[None]:
        """Turn botocore's exceptions into one RemoteStorageError naming endpoint, bucket and key."""
        err = self._errors
        where = f"endpoint {self.endpoint}, bucket {self.url.bucket!r}" + (f", key {key!r}" if key else "")
        try:
            yield
        except err.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            reason = (
                _PERMANENT_CODES.get(code) or (status == 404 and not_found) or _PERMANENT_STATUS.get(status)
            )
            transient = reason is None
            reason = reason or f"S3 error {code or '?'} (HTTP {status})"
            raise RemoteStorageError(f"{action} failed: {reason} ({where})", transient=transient) from e
        except (err.NoCredentialsError, err.PartialCredentialsError) as e:
            raise RemoteStorageError(
                f"{action} failed: no usable AWS credentials found (set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) ({where})",
                transient=False,
            ) from e
        except (err.EndpointConnectionError, err.ConnectTimeoutError) as e:
            raise RemoteStorageError(
                f"{action} failed: endpoint unreachable ({where})", transient=True
            ) from e
        except err.BotoCoreError as e:
            raise RemoteStorageError(f"{action} failed: {type(e).__name__} ({where})", transient=True) from e

    # ---- operations -----------------------------------------------------------------------------

    def check_access(self, timeout: float = 5.0) -> None:
        """Cheap: credentials accepted and bucket exists, else RemoteStorageError. One HEAD, no
        retries, bounded by `timeout`: the trainer calls it at start only to warn early."""
        import botocore.config

        quick = botocore.config.Config(
            connect_timeout=timeout, read_timeout=timeout, retries={"total_max_attempts": 1}
        )
        client = self._new_client(self._client_config.merge(quick))
        with self._translate("checking access", not_found="bucket does not exist"):
            client.head_bucket(Bucket=self.url.bucket)

    def upload_checkpoint(self, local_dir: Path, entries: list[FileEntry]) -> None:
        """Upload every file (multipart, bounded concurrency), check sizes, then the marker last."""
        from boto3.s3.transfer import create_transfer_manager

        name = local_dir.name
        # Re-uploading a name (a resumed run saving the same step again): withdraw the old commit
        # first, or readers would trust an old marker over files being replaced.
        marker_key = self.url.key(name, MARKER)
        with self._translate("withdrawing an old commit marker", marker_key):
            self.client.delete_object(Bucket=self.url.bucket, Key=marker_key)
        with create_transfer_manager(self.client, self.transfer_config) as manager:
            futures = [
                (e, manager.upload(str(local_dir / e.name), self.url.bucket, self.url.key(name, e.name)))
                for e in entries
            ]
            for entry, future in futures:
                with self._translate(f"uploading {local_dir / entry.name}", self.url.key(name, entry.name)):
                    future.result()
        # Transfers are checksummed in flight (botocore's default CRC); the HEADs catch a store that
        # acknowledged less than it was sent before we commit.
        for entry in entries:
            size = self._size(self.url.key(name, entry.name))
            if size != entry.size:
                raise RemoteStorageError(
                    f"uploaded {entry.name} has {size} bytes, expected {entry.size} ({self.where(name)})",
                    transient=True,
                )
        marker = {"format": MARKER_FORMAT, "checkpoint": name, "files": [asdict(e) for e in entries]}
        with self._translate("writing the commit marker", marker_key):
            self.client.put_object(
                Bucket=self.url.bucket, Key=marker_key, Body=json.dumps(marker, indent=1).encode()
            )

    def _size(self, key: str) -> int:
        with self._translate("checking an uploaded object", key):
            return self.client.head_object(Bucket=self.url.bucket, Key=key)["ContentLength"]

    def list_checkpoints(self) -> tuple[list[str], list[str]]:
        """(complete, incomplete) checkpoint names under the prefix, each sorted by step."""
        base = self.url.key()
        start = f"{base}/" if base else ""
        seen: set[str] = set()
        marked: set[str] = set()
        with self._translate("listing checkpoints", start):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.url.bucket, Prefix=start
            ):
                for obj in page.get("Contents", []):
                    name, _, rest = obj["Key"][len(start) :].partition("/")
                    if step_of(name) is None or not rest:
                        continue
                    seen.add(name)
                    if rest == MARKER:
                        marked.add(name)
        return sorted(marked), sorted(seen - marked)

    def read_marker(self, name: str) -> list[FileEntry]:
        key = self.url.key(name, MARKER)
        with self._translate("reading the commit marker", key):
            try:
                body = self.client.get_object(Bucket=self.url.bucket, Key=key)["Body"].read()
            except self._errors.ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("NoSuchKey", "404"):
                    raise
                raise RemoteStorageError(
                    f"checkpoint {self.where(name)} has no commit marker {MARKER}: "
                    "its upload never finished, so it cannot be trusted",
                    transient=False,
                ) from e
        try:
            data = json.loads(body)
        except ValueError:
            raise RemoteStorageError(
                f"{self.where(name)}: {MARKER} is not valid JSON", transient=False
            ) from None
        if data.get("format") != MARKER_FORMAT:
            raise RemoteStorageError(f"{key}: unknown marker format {data.get('format')!r}", transient=False)
        return [FileEntry(**f) for f in data["files"]]

    def download_checkpoint(self, name: str, entries: list[FileEntry], dest_dir: Path) -> None:
        """Download the marker's files into an existing directory `dest_dir` (no verification)."""
        from boto3.s3.transfer import create_transfer_manager

        with create_transfer_manager(self.client, self.transfer_config) as manager:
            futures = []
            for e in entries:
                target = dest_dir / e.name
                target.parent.mkdir(parents=True, exist_ok=True)
                futures.append(
                    (e, manager.download(self.url.bucket, self.url.key(name, e.name), str(target)))
                )
            for entry, future in futures:
                with self._translate("downloading", self.url.key(name, entry.name)):
                    future.result()

    def delete_checkpoint(self, name: str) -> None:
        """Marker first: an interrupted delete leaves an incomplete checkpoint, never a 'complete' one
        with files missing."""
        marker_key = self.url.key(name, MARKER)
        with self._translate("deleting the commit marker", marker_key):
            self.client.delete_object(Bucket=self.url.bucket, Key=marker_key)
        start = self.url.key(name) + "/"
        with self._translate("deleting checkpoint files", start):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.url.bucket, Prefix=start
            ):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    self.client.delete_objects(
                        Bucket=self.url.bucket, Delete={"Objects": keys, "Quiet": True}
                    )
