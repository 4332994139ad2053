"""`data.cache_features`: the target's features of every answer, kept in device memory, then in
page-locked host memory.

Each answer's features are made once (its first batch: the target runs, or with
`data.captured_features` they are read from the capture's shards) and later epochs read them from
here. The device part stops growing before the training step would run out of memory; rows past it
go to host memory, from where a batch copies them back asynchronously (no host sync), until the host
too keeps only its reserve (`data.cache_host_gib` caps it). Rows cached in neither get their
features made again every epoch: slower, never out of memory, but the target then runs in nearly
every step (docs/benchmarks/chain.md: a quarter fewer steps before the host part existed).
"""

from __future__ import annotations

import logging
from pathlib import Path
from time import perf_counter
from typing import Callable

import torch

from dflash_train.draft.loss import DEFAULT_CHUNK_ROWS
from dflash_train.train.batches import collate

log = logging.getLogger("dflash_train")

RESERVE_GIB = 16
"""GPU memory the cache leaves free for the training step itself, at the default loss chunk
(draft/loss.py DEFAULT_CHUNK_ROWS)."""


def step_reserve(ce_chunk_size: int, vocab_size: int) -> int:
    """Bytes the cache leaves free: RESERVE_GIB, plus the logits of loss chunks larger than the
    default (fp32, ~3 chunk-sized copies alive in a chunk's forward and backward)."""
    return RESERVE_GIB * 2**30 + 3 * 4 * vocab_size * max(0, ce_chunk_size - DEFAULT_CHUNK_ROWS)


HOST_RESERVE_GIB = 8
"""Host memory the cache leaves available, besides a tenth of the host's total (the data, the
process itself, other jobs on the host)."""
SLAB_BYTES = 2**30
"""Host rows live in page-locked slabs of this size: one pinning per slab, not per row (PyTorch's
caching host allocator rounds every allocation up to a power of two). The step waits for each
pinning; dflash_train/pinned_memory.py makes it ~5x faster."""
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def _meminfo(path: Path) -> dict[str, int] | None:
    """MemTotal and MemAvailable in bytes, or None where the file cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
        return {k: int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable")}
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _cgroup_dir(root: Path, own: Path) -> Path:
    """The process's cgroup v2 directory (`0::/path` in /proc/self/cgroup) where it exists, else
    `root` (a container sees its own cgroup there)."""
    try:
        line = next(ln for ln in own.read_text().splitlines() if ln.startswith("0::"))
    except (OSError, StopIteration):
        return root
    path = root / line[3:].lstrip("/")
    return path if path.is_dir() else root


def _cgroup_room(root: Path, own: Path = Path("/proc/self/cgroup")) -> int | None:
    """What the process's memory cgroup (v2, else v1) still allows, or None without a limit: in a
    container /proc/meminfo shows the whole host, and pinned pages count against the cgroup."""
    v2 = _cgroup_dir(root, own)
    for limit, usage in ((v2 / "memory.max", v2 / "memory.current"),
                         (root / "memory/memory.limit_in_bytes", root / "memory/memory.usage_in_bytes")):
        try:
            cap = limit.read_text().strip()
            if cap != "max" and int(cap) < 2**60:  # v1 writes "no limit" as a huge number
                return int(cap) - int(usage.read_text().strip())
            return None
        except (OSError, ValueError):
            continue
    return None


def host_room(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int:
    """Bytes the cache may still take from host memory: MemAvailable (or the cgroup's room, if
    smaller) less the reserve; 0 where /proc/meminfo cannot be read, so the host part stays empty."""
    info = _meminfo(meminfo)
    if info is None:
        return 0
    available = info["MemAvailable"]
    if (room := _cgroup_room(cgroup)) is not None:
        available = min(available, room)
    return available - HOST_RESERVE_GIB * 2**30 - info["MemTotal"] // 10


def padded(per_row: list[torch.Tensor], shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Rows' features [T_i, K*H] -> [rows, T, K*H] of a collated batch's `shape` on `device`, zeros in
    its padding, rows included: with length_bucket a batch is padded beyond its real sequences. Rows
    in page-locked host memory are copied in without waiting for the copy."""
    rows, t = shape
    out = torch.zeros(rows, t, per_row[0].shape[-1], dtype=per_row[0].dtype, device=device)
    for row, f in enumerate(per_row):
        out[row, : f.shape[0]].copy_(f, non_blocking=True)
    return out


class HostSlabs:
    """Rows past the device's room, as views into page-locked slabs. A row is copied in without
    waiting (the slab is page-locked and written once); the later copy back to the device is queued
    on the same stream, so it reads the row only after it landed. `limit`: bytes at most (None: as
    `host_room` allows)."""

    def __init__(self, pin: bool, limit: int | None = None, room: Callable[[], int] | None = None):
        self.pin, self.limit, self.room = pin, limit, room or host_room
        self.slabs: list[torch.Tensor] = []
        self.used = 0  # bytes taken from the last slab
        self.full = False
        self.pin_seconds = 0.0
        """Host time spent allocating slabs: on a GPU host the driver page-locks each one, and the step
        waits for it."""

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.slabs)

    def keep(self, f: torch.Tensor) -> torch.Tensor | None:
        """`f`'s copy in host memory, or None once the host keeps only its reserve."""
        if self.full:
            return None
        n = f.numel() * f.element_size()
        start = -(-self.used // 64) * 64  # a row of any dtype starts on its element size (<= 64 bytes)
        if not self.slabs or start + n > self.slabs[-1].numel():
            start = 0
            if (slab := self._new_slab(max(SLAB_BYTES, 1 << (n - 1).bit_length()))) is None:
                return None
            self.slabs.append(slab)
        self.used = start + n
        row = self.slabs[-1][start : start + n].view(f.dtype).view(f.shape)
        return row.copy_(f, non_blocking=self.pin)

    def _new_slab(self, size: int) -> torch.Tensor | None:
        """A page-locked slab (a power of two: what the host allocator pins anyway), or None, and
        the host part full, once the limit or the host's room is reached or pinning fails."""
        if (self.limit is not None and self.nbytes + size > self.limit) or self.room() < size:
            self.full = True
            return None
        start = perf_counter()
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as err:  # the driver could not pin it: no host part beyond this
            log.warning("feature cache: pinning %.1f GiB of host memory failed (%s)", size / 2**30, err)
            self.full = True
            return None
        finally:
            self.pin_seconds += perf_counter() - start


class FeatureCache:
    """`expected_rows`: the dataset's rows; once every one is kept, where they went is logged."""

    def __init__(self, device: torch.device, reserve_bytes: int = RESERVE_GIB * 2**30, host: HostSlabs | None = None,
                 expected_rows: int | None = None):
        self.device, self.reserve_bytes, self.expected_rows = device, reserve_bytes, expected_rows
        self.rows: dict[int, torch.Tensor] = {}  # on the device, or views into `host`'s slabs
        self.host = host if host is not None else HostSlabs(pin=device.type == "cuda")
        self.full = False
        self.on_host = 0
        self.logged_host_full = False

    def __len__(self) -> int:
        return len(self.rows)

    def placement(self) -> str:
        """Where the kept rows are, and what the host part cost to pin."""
        return (f"{len(self.rows) - self.on_host} rows on the device, {self.on_host} in host memory "
                f"({self.host.nbytes / 2**30:.1f} GiB in {len(self.host.slabs)} slabs, pinned in "
                f"{self.host.pin_seconds:.1f} s)")

    def features(self, batch: dict, make: Callable[[list[int]], list[torch.Tensor]]) -> torch.Tensor:
        """The batch's features [rows, T, K*H]; `make(indices)` gives the features [T_i, K*H] of the
        rows not cached, on the device (`from_target` or `from_capture`)."""
        missing = [i for i in batch["indices"] if i not in self.rows]
        fresh = self.fill(missing, make) if missing else {}
        if missing and len(self.rows) == self.expected_rows:
            log.info("feature cache: every row kept: %s", self.placement())
        return padded([fresh[i] if i in fresh else self.rows[i] for i in batch["indices"]], batch["input_ids"].shape,
                      self.device)

    def fill(self, indices: list[int], make: Callable[[list[int]], list[torch.Tensor]]) -> dict[int, torch.Tensor]:
        """Makes the rows' features and keeps them where the memory allows (the device, else the
        host); returns them either way."""
        fresh = dict(zip(indices, make(indices)))
        if self.has_room(sum(f.nbytes for f in fresh.values())):
            # A view (the target's rows) would keep the whole padded batch alive: copied. Rows that
            # own their memory (read from a capture) are kept as they are.
            self.rows.update({i: f.clone() if f._base is not None else f for i, f in fresh.items()})
            return fresh
        for i, f in fresh.items():
            if (kept := self.host.keep(f)) is None:
                break
            self.rows[i] = kept
            self.on_host += 1
        if self.host.full and not self.logged_host_full:
            self.logged_host_full = True
            log.warning("feature cache full: %s; the other rows' features are recomputed", self.placement())
        return fresh

    def has_room(self, nbytes: int) -> bool:
        """Whether the cache may grow by `nbytes` and leave `reserve_bytes` free."""
        if self.device.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        room = free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if room - nbytes > self.reserve_bytes:
            return True
        if not self.full:
            self.full = True
            log.warning("feature cache: the device holds %d rows (%.1f GiB free); the next rows go to page-locked "
                        "host memory (%.1f GiB available to the cache)", len(self.rows), room / 2**30,
                        max(self.host.room(), 0) / 2**30)
        return False


def from_target(dataset, device: torch.device, compute: Callable[[torch.Tensor], torch.Tensor]):
    """`make` for the cache: the target (`compute(input_ids)`) runs over the rows, batched."""

    def make(indices: list[int]) -> list[torch.Tensor]:
        feats = compute(collate(dataset, indices, device)["input_ids"])
        return [feats[row, : len(dataset.input_ids[i])] for row, i in enumerate(indices)]

    return make


def from_capture(captured, device: torch.device):
    """`make` for the cache: the rows read from a `dflash-train capture` directory."""
    return lambda indices: [captured.row(i).to(device, non_blocking=True) for i in indices]
