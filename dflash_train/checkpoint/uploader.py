"""Uploads checkpoints to S3 on a background thread so the training loop never waits on the network.

One worker, first in first out. A failed upload is retried with exponential backoff when the error
is transient (network, 5xx); wrong credentials or a missing bucket are not retried. When it gives
up it logs ONE warning and keeps the local copy, which retention then never deletes.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from pathlib import Path

from dflash_train.checkpoint.integrity import hash_checkpoint
from dflash_train.checkpoint.s3 import RemoteStorageError, S3Store
from dflash_train.checkpoint.storage import has_receipt, prune_remote, write_receipt

log = logging.getLogger(__name__)


class BackgroundUploader:
    def __init__(
        self,
        store: S3Store,
        *,
        keep_last: int | None = None,
        max_attempts: int = 6,
        backoff_s: float = 2.0,
        max_backoff_s: float = 60.0,
    ):
        """`keep_last`: prune the remote to that many complete checkpoints after each upload
        (None = keep all). Backoff between attempts: backoff_s * 2**k, at most max_backoff_s."""
        self.store = store
        self.keep_last = keep_last
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.failed: list[str] = []
        """Names of checkpoints given up on (their local copies are kept)."""
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._closed = threading.Event()
        # Daemon: an upload stuck on a dead network must not keep the finished process alive.
        self._thread = threading.Thread(target=self._run, name="checkpoint-uploader", daemon=True)
        self._thread.start()

    def enqueue(self, local_ckpt_dir: str | Path) -> None:
        """Queue a complete local checkpoint directory; returns at once."""
        assert not self._closed.is_set(), "enqueue after close()"
        with self._idle:
            self._pending += 1
        self._queue.put(Path(local_ckpt_dir))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued upload finished or gave up; False if `timeout` ran out first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop: queued uploads not yet started are dropped (call wait() first to drain), a backoff
        sleep is cut short, and an upload in flight gets at most `timeout` seconds to finish."""
        self._closed.set()
        self._queue.put(None)
        self._thread.join(timeout)

    def is_safe_to_delete(self, local_ckpt_dir: str | Path) -> bool:
        """True once this checkpoint's upload is verified (also by an earlier process)."""
        return has_receipt(Path(local_ckpt_dir))

    # ---- worker ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while (local_dir := self._queue.get()) is not None:
            try:
                if not self._closed.is_set() and self._upload(local_dir) and self.keep_last:
                    self._prune()
            except Exception:  # a bug here must not kill the thread and silently stop all uploads
                log.warning("checkpoint upload of %s crashed; local copy kept", local_dir, exc_info=True)
                self.failed.append(local_dir.name)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _upload(self, local_dir: Path) -> bool:
        name = local_dir.name
        entries = hash_checkpoint(local_dir)
        for attempt in itertools.count(1):
            try:
                self.store.upload_checkpoint(local_dir, entries)
                write_receipt(local_dir, f"{self.store.url}/{name}")
                log.info("checkpoint %s uploaded to %s", name, self.store.where(name))
                return True
            except RemoteStorageError as err:
                if not err.transient or attempt == self.max_attempts or self._closed.is_set():
                    log.warning(
                        "checkpoint %s NOT uploaded to %s after %d attempt(s); local copy %s kept: %s",
                        name,
                        self.store.where(name),
                        attempt,
                        local_dir,
                        err,
                    )
                    self.failed.append(name)
                    return False
                delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
                log.info("upload of %s failed (%s); retry %d in %.1fs", name, err, attempt, delay)
                self._closed.wait(delay)

    def _prune(self) -> None:
        try:
            deleted = prune_remote(self.store, self.keep_last)
        except RemoteStorageError as err:
            log.warning("pruning old remote checkpoints failed: %s", err)
            return
        if deleted:
            log.info("deleted remote checkpoints %s (keep_last=%d)", ", ".join(deleted), self.keep_last)


def remote_uploader(ck) -> BackgroundUploader:
    """The uploader for `checkpoint.remote`: a bad remote warns at once but never stops training."""
    store = S3Store(ck.remote, endpoint_url=ck.endpoint_url, region=ck.region)
    try:
        store.check_access()
    except RemoteStorageError as err:
        log.warning("checkpoint.remote is not usable yet (training goes on, local copies kept): %s", err)
    return BackgroundUploader(store, keep_last=ck.keep_last)
