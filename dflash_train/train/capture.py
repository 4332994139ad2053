"""Target features captured once to disk (`dflash-train capture`), read back by training.

`data.captured_features: DIR` makes training read every answer's features from DIR instead of
running the target's layers, so later epochs and every ablation over the same data, target and
layers skip the target. With `data.cache_features` too, each row is read from its shard once and
then kept in device memory, or past its room in page-locked host memory (train/feature_cache.py).

DIR holds `capture.json` (the fingerprint: target identity, captured layers, a hash of the tokenized
rows; the shard list) and `shard-NNNNN.safetensors` files, each with
`features` [tokens of its rows, K*H] in the target's dtype and `offsets` [rows + 1]. A shard is
written atomically and listed only then: a crash loses at most the shard in progress, and the same
command resumes. Training refuses a capture whose fingerprint differs from its own run, naming
the field.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from dflash_train.atomic import write_atomic
from dflash_train.run_lock import RunLock
from dflash_train.disk import require_writable
from dflash_train.config import RunConfig
from dflash_train.data.dataset import TokenizedDataset
from dflash_train.targets.model import Target
from dflash_train.train.batches import collate
from dflash_train.train.shapes import stream_layer_ids
from dflash_train.train.feature_cache import padded
from dflash_train.train.inputs import load_inputs

log = logging.getLogger("dflash_train")

FORMAT = "dflash-capture/1"
MANIFEST = "capture.json"


def fingerprint(target: Target, layer_ids: list[int], dataset: TokenizedDataset) -> dict:
    """What the features depend on: the target, the captured layers and every token of every row."""
    rows = hashlib.sha256()
    for ids in dataset.input_ids:
        rows.update(ids.astype("int64").tobytes())
        rows.update(b"|")
    return {"target": target.identity, "layer_ids": list(layer_ids), "rows": len(dataset),
            "tokens_sha256": rows.hexdigest()[:16]}


def _groups(dataset: TokenizedDataset, first: int, last: int, token_budget: int):
    """Consecutive rows [first, last) in forwards of at most `token_budget` padded tokens."""
    group, longest = [], 0
    for i in range(first, last):
        n = len(dataset.input_ids[i])
        if group and max(longest, n) * (len(group) + 1) > token_budget:
            yield group
            group, longest = [], 0
        group.append(i)
        longest = max(longest, n)
    if group:
        yield group


def capture(cfg: RunConfig, out: str | Path, rows_per_shard: int = 1024) -> dict:
    """Runs `cfg`'s target once over `cfg`'s training data and writes its features to `out`."""
    out = Path(out)
    require_writable(out, "the captured features")
    with RunLock(out, "capture"):
        return _capture_into(cfg, out, rows_per_shard)


def _capture_into(cfg: RunConfig, out: Path, rows_per_shard: int) -> dict:
    device, target, dataset = load_inputs(cfg)
    layer_ids = stream_layer_ids(cfg, target)
    width, dtype = len(layer_ids) * target.hidden_size, target.embed_weight.dtype
    tokens = int(dataset.lengths.sum())
    log.info("capture: %d rows, %d tokens x %d layers x %d = %.2f GiB of %s features in %s", len(dataset), tokens,
             len(layer_ids), target.hidden_size, tokens * width * dtype.itemsize / 2**30, dtype, out)
    manifest = {"format": FORMAT, "fingerprint": fingerprint(target, layer_ids, dataset), "width": width,
                "dtype": str(dtype).removeprefix("torch."), "shards": []}
    if (out / MANIFEST).exists():
        saved = json.loads((out / MANIFEST).read_text())
        check_fingerprint(saved["fingerprint"], manifest["fingerprint"], out / MANIFEST)
        manifest["shards"] = saved["shards"]
    done = {s["first"] for s in manifest["shards"]}
    for first in range(0, len(dataset), rows_per_shard):
        if first in done:
            continue
        last = min(first + rows_per_shard, len(dataset))
        rows = []
        with torch.no_grad():
            for group in _groups(dataset, first, last, cfg.data.token_budget):
                feats = target.features(collate(dataset, group, device)["input_ids"], layer_ids)
                rows += [feats[r, : len(dataset.input_ids[i])].cpu() for r, i in enumerate(group)]
        offsets = torch.tensor([0] + [len(dataset.input_ids[i]) for i in range(first, last)]).cumsum(0)
        name = f"shard-{first // rows_per_shard:05d}.safetensors"
        blob = save({"features": torch.cat(rows).contiguous(), "offsets": offsets})
        write_atomic(out / name, lambda f, b=blob: f.write(b))
        manifest["shards"] = sorted(manifest["shards"] + [{"file": name, "first": first, "rows": last - first}],
                                    key=lambda s: s["first"])
        text = json.dumps(manifest, indent=2) + "\n"
        write_atomic(out / MANIFEST, lambda f, t=text: f.write(t.encode()))
        log.info("capture: rows %d-%d written (%s)", first, last - 1, name)
    return manifest


def check_fingerprint(saved: dict, current: dict, where: Path) -> None:
    for key in current:
        if saved.get(key) != current[key]:
            raise ValueError(f"{where}: captured with another {key} ({saved.get(key)!r}, this run: {current[key]!r}); "
                             "capture again for this run")


class CapturedFeatures:
    """A finished capture, read row by row (memory-mapped shards)."""

    def __init__(self, path: str | Path, expected: dict):
        path = Path(path)
        if not (path / MANIFEST).is_file():
            raise ValueError(f"data.captured_features: {path} holds no {MANIFEST} (run `dflash-train capture`)")
        manifest = json.loads((path / MANIFEST).read_text())
        check_fingerprint(manifest["fingerprint"], expected, path / MANIFEST)
        covered = sum(s["rows"] for s in manifest["shards"])
        if covered != expected["rows"]:
            raise ValueError(f"{path / MANIFEST}: {covered} of {expected['rows']} rows captured (an interrupted "
                             "capture: run the same `dflash-train capture` again to finish it)")
        self.shards = [(s["first"], s["rows"], safe_open(str(path / s["file"]), framework="pt"))
                       for s in manifest["shards"]]
        self.offsets = [f.get_tensor("offsets").tolist() for _, _, f in self.shards]

    def row(self, index: int) -> torch.Tensor:
        for k, (first, rows, f) in enumerate(self.shards):
            if first <= index < first + rows:
                a, b = self.offsets[k][index - first], self.offsets[k][index - first + 1]
                return f.get_slice("features")[a:b]
        raise IndexError(index)

    def batch(self, batch: dict, device: torch.device) -> torch.Tensor:
        """Features [rows, T, K*H] of a collated batch, zeros in its padding."""
        rows = [self.row(i) for i in batch["indices"]]
        return padded(rows, batch["input_ids"].shape, torch.device("cpu")).to(device, non_blocking=True)
