"""Where checkpoints live: resume from a local path or S3, upload receipts, retention.

Local layout (written by the trainer): `<run_dir>/checkpoints/step_00000100/`, complete once it
exists under that name. This module adds, next to a checkpoint directory, a receipt
`step_00000100.uploaded.json` once its upload is verified; retention only deletes a local
checkpoint that is safe to delete (no remote, or its receipt exists). A checkpoint that differs
from its integrity record is renamed `step_00000100.corrupt` by `--resume auto`, never deleted.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dflash_train.atomic import write_json_atomic
from dflash_train.checkpoint.integrity import CheckpointError, find_fault, has_record, require_intact, sha256_file
from dflash_train.checkpoint.local import checkpoint_path, checkpoints_dir, list_checkpoints, step_of
from dflash_train.checkpoint.s3 import FileEntry, RemoteStorageError, S3Store, S3Url

log = logging.getLogger(__name__)

# ---- resume ----------------------------------------------------------------------------------


def checkpoint_to_resume(resume: str, run_dir: str | Path, *, endpoint_url: str | None = None,
                         region: str | None = None) -> Path | None:
    """The checkpoint `--resume` names, checked against its integrity record.

    - `auto`: the newest intact checkpoint of `run_dir` (newer corrupt ones are moved aside, each
      with a warning), None when there is none;
    - a local path or an `s3://` location (see resolve_resume): that checkpoint, or a one-line
      CheckpointError naming the file that differs (the user chose it: nothing else is tried).
    """
    if resume == "auto":
        return newest_intact(run_dir)
    path = resolve_resume(resume, checkpoints_dir(run_dir), endpoint_url=endpoint_url, region=region)
    if not (path / "trainer_state.json").is_file():  # said before a warning about its integrity record
        what = "not a checkpoint (no trainer_state.json)" if path.is_dir() else "no such directory"
        hint = ("a run directory: --resume auto takes the newest checkpoint of the config's run_dir"
                if (path / "checkpoints").is_dir() else "give a checkpoints/step_NNNNNNNN folder, or --resume auto")
        raise CheckpointError(f"--resume {resume}: {what}; {hint}")
    if not _verified(path):
        log.warning("%s has no integrity record (written before checkpoints had one): resuming from it "
                    "unverified", path)
    return path


def newest_intact(run_dir: str | Path) -> Path | None:
    """The newest checkpoint that matches its integrity record (or has none: an older format, used
    with a warning). A newer one that differs is moved aside, never deleted: a job restarted on
    failure must go on from the newest good checkpoint, not fail on the same bad file forever."""
    for path in reversed(list_checkpoints(run_dir)):
        if _usable(path):
            return path
    return None


def newest_common_step(run_dirs: list[str | Path]) -> int | None:
    """The newest checkpoint step that every drafter group's run dir has (a crash can fall between
    two groups' saves of the same step); None when there is none. Listed, not verified."""
    steps = [{step_of(p.name) for p in list_checkpoints(d)} for d in run_dirs]
    common = set.intersection(*steps) if steps else set()
    return max(common) if common else None


def newest_common_intact(run_dirs: list[str | Path]) -> int | None:
    """newest_intact for several drafter groups' run dirs (distributed training): the newest step
    that every one of them holds intact, damaged ones moved aside; None when there is none."""
    while (step := newest_common_step(run_dirs)) is not None:
        if all(_usable(checkpoint_path(d, step)) for d in run_dirs):  # a damaged one leaves the common steps
            return step
    return None


def _usable(path: Path) -> bool:
    """Intact, or from before integrity records (said); a damaged one is moved aside: False."""
    try:
        if not _verified(path):
            log.warning("%s has no integrity record (written before checkpoints had one): resuming from it "
                        "unverified", path)
        return True
    except CheckpointError as err:
        aside = move_aside(path)
        log.warning("%s; moved aside to %s, resuming from the newest intact checkpoint before it", err, aside.name)
        return False


def _verified(path: Path) -> bool:
    """require_intact, timed: hashing a large checkpoint takes a while, and the log says why."""
    start = time.perf_counter()
    verified = require_intact(path)
    if verified:
        log.info("%s matches its integrity record (checked in %.1f s)", path, time.perf_counter() - start)
    return verified


def move_aside(ckpt_dir: Path) -> Path:
    """Rename a corrupt checkpoint out of the step_NNNNNNNN names that resume and retention see."""
    aside = ckpt_dir.with_name(f"{ckpt_dir.name}.corrupt")
    n = 1
    while aside.exists():
        aside, n = ckpt_dir.with_name(f"{ckpt_dir.name}.corrupt-{n}"), n + 1
    ckpt_dir.rename(aside)
    if has_receipt(ckpt_dir):  # it vouches for the upload of what was at that name
        receipt_path(ckpt_dir).rename(receipt_path(aside))
    return aside


def resolve_resume(
    url: str | Path, dest_dir: str | Path, *, endpoint_url: str | None = None, region: str | None = None
) -> Path:
    """A local checkpoint directory to resume from.

    - a local path: returned unchanged;
    - `s3://bucket/prefix/step_00000100`: that checkpoint;
    - `s3://bucket/prefix`: the newest COMPLETE checkpoint (one with its commit marker).
    Remote checkpoints are downloaded to `dest_dir/step_XXXXXXXX` (temp dir + rename, so the
    trainer's local resume reads it unchanged) and every file's sha256 is checked against the
    marker. An existing local copy of that name is verified and reused instead of downloaded.
    """
    url = str(url)
    if not url.startswith("s3://"):
        return Path(url)
    location = S3Url.parse(url)
    parent, _, last = location.prefix.rpartition("/")
    if step_of(last) is not None:
        store = S3Store(f"s3://{location.bucket}/{parent}", endpoint_url=endpoint_url, region=region)
        name = last
    else:
        store = S3Store(url, endpoint_url=endpoint_url, region=region)
        complete, _ = store.list_checkpoints()
        if not complete:
            raise RemoteStorageError(f"no complete checkpoint under {store.where()}", transient=False)
        name = complete[-1]
    return download_checkpoint(store, name, Path(dest_dir))


def download_checkpoint(store: S3Store, name: str, dest_dir: Path) -> Path:
    entries = store.read_marker(name)
    final = dest_dir / name
    if final.exists():
        _verify(final, entries, store, name)
        return final
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.download-", dir=dest_dir))
    try:
        store.download_checkpoint(name, entries, tmp)
        _verify(tmp, entries, store, name)
        # The marker vouches for the upload; the record for the checkpoint as it was written.
        if has_record(tmp) and (fault := find_fault(tmp)) is not None:
            raise CheckpointError(f"{store.where(name)}: corrupt checkpoint (damaged before its upload): {fault}")
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _verify(local_dir: Path, entries: list[FileEntry], store: S3Store, name: str) -> None:
    for entry in entries:
        path = local_dir / entry.name
        actual = sha256_file(path) if path.is_file() else "<missing>"
        if actual != entry.sha256:
            raise RemoteStorageError(
                f"checksum mismatch for {store.where(f'{name}/{entry.name}')}: the commit marker "
                f"expects sha256 {entry.sha256[:16]}..., the data has {actual[:16]}... "
                "(object corrupted or overwritten after upload)",
                transient=False,
            )


# ---- upload receipts ---------------------------------------------------------------------------


def receipt_path(ckpt_dir: Path) -> Path:
    return ckpt_dir.with_name(f"{ckpt_dir.name}.uploaded.json")


def write_receipt(ckpt_dir: Path, remote: str) -> None:
    """Persisted (not in memory) so a restarted run can still prune checkpoints uploaded before."""
    write_json_atomic(receipt_path(ckpt_dir), {"remote": remote})


def has_receipt(ckpt_dir: Path) -> bool:
    return receipt_path(ckpt_dir).is_file()


# ---- retention -------------------------------------------------------------------------------


def retired(names: list[str], keep_last: int) -> list[str]:
    """The retention rule, local and remote: of the checkpoint names given, all but the newest
    `keep_last` (by step), oldest first; the newest is never among them."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is never deleted), got {keep_last}")
    return sorted(names, key=step_of)[:-keep_last]


def prune_local(
    ckpt_root: Path, keep_last: int, is_safe_to_delete: Callable[[Path], bool] = lambda _: True
) -> list[Path]:
    """Delete all but the newest `keep_last` local checkpoints, skipping unsafe ones.

    With a remote, pass `uploader.is_safe_to_delete`: a checkpoint whose upload is not verified
    is kept (possibly the only copy). Returns the deleted directories.
    """
    names = [p.name for p in Path(ckpt_root).iterdir() if p.is_dir() and step_of(p.name) is not None]
    deleted = []
    for ckpt in (Path(ckpt_root) / name for name in retired(names, keep_last)):
        if not is_safe_to_delete(ckpt):
            continue
        # Rename first: a crash mid-rmtree must not leave a half-deleted dir under a complete name.
        doomed = ckpt.with_name(f".{ckpt.name}.deleting")
        shutil.rmtree(doomed, ignore_errors=True)  # left over from a crash during an earlier prune
        ckpt.rename(doomed)
        receipt_path(ckpt).unlink(missing_ok=True)
        shutil.rmtree(doomed)
        deleted.append(ckpt)
    return deleted


def prune_remote(store: S3Store, keep_last: int) -> list[str]:
    """Keep the newest `keep_last` complete remote checkpoints; delete older complete ones (marker
    first) and leftovers of abandoned uploads older than the newest complete one."""
    complete, incomplete = store.list_checkpoints()
    doomed = retired(complete, keep_last)
    if not complete:
        return []
    newest = max(map(step_of, complete))
    doomed += [n for n in incomplete if step_of(n) < newest]
    for name in doomed:
        store.delete_checkpoint(name)
    return doomed
