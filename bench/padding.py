"""How much of a step's padded batch is padding, and what packing would save: a CPU prediction.

Reads the sequence lengths of prepared datasets (`dflash-train prepare` shards) and builds one epoch
of batches exactly as training does (`data/batching.py`, bucket mode when `--length-bucket` > 0), then
counts per epoch:
  batches           optimizer steps at grad_accum 1
  real / slots      real tokens over the padded [rows, length] slots the target and the drafter's
                    context side run over (the drafter's queries, anchors x block a sequence, do not
                    depend on padding)
  packed slots      the slots if the same batches' sequences were packed end to end into rows of
                    the bucket's length (best fit decreasing per batch): the target-side work
                    packing would leave, at the same sequences a step
and, with --pack-length, the whole epoch packed into rows of that length (other batches: more
sequences a step at the same token budget).
                    python bench/padding.py PREPARED_DIR... --token-budget 32768 --max-batch-size 64 \\
                        --length-bucket 256 128 64 0 --pack-length 1024 --out padding.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_train.data.batching import bucket_shape, make_batches


def prepared_lengths(dirs: list[str]) -> np.ndarray:
    """Token counts of every row of the prepared datasets, in their shards' order."""
    lengths = []
    for d in dirs:
        shards = sorted(Path(d).glob("*.parquet"))
        if not (Path(d) / "dataset.json").is_file() or not shards:
            raise SystemExit(f"{d}: not a prepared dataset (dataset.json and *.parquet shards expected)")
        for shard in shards:
            column = pq.read_table(shard, columns=["input_ids"]).column("input_ids")
            lengths.append(pc.list_value_length(column).to_numpy(zero_copy_only=False))
    return np.concatenate(lengths).astype(np.int64)


def packed_rows(lengths: np.ndarray, row_length: int) -> int:
    """Rows of `row_length` that hold these sequences end to end: best fit decreasing (each sequence
    into the open row with the least room that takes it). `open_rows[r]`: rows with r tokens free."""
    open_rows = np.zeros(row_length + 1, dtype=np.int64)
    rows = 0
    for n in np.sort(lengths)[::-1]:
        fits = np.flatnonzero(open_rows[n:])
        if len(fits):
            room = n + int(fits[0])
            open_rows[room] -= 1
        else:
            room, rows = row_length, rows + 1
        open_rows[room - n] += 1
    return rows


def packed_epoch(lengths: np.ndarray, token_budget: int, row_length: int) -> dict:
    """The whole epoch packed into rows of `row_length`, token_budget // row_length rows a step."""
    rows = packed_rows(lengths, row_length)
    batches = -(-rows // max(1, token_budget // row_length))
    real = int(lengths.sum())
    return {"pack_length": row_length, "rows": rows, "batches": batches, "real_over_slots": real / (rows * row_length),
            "real_tokens_per_step": real / batches, "sequences_per_step": len(lengths) / batches}


def epoch_padding(lengths: np.ndarray, token_budget: int, max_batch_size: int, length_bucket: int,
                  seed: int = 0) -> dict:
    batches = make_batches(lengths, token_budget, max_batch_size, seed, 0, length_bucket)
    real = slots = packed = 0
    for rows in batches:
        seq = lengths[rows]
        longest = int(seq.max())
        n_rows, length = (bucket_shape(longest, length_bucket, token_budget, max_batch_size) if length_bucket
                          else (len(rows), longest))
        real += int(seq.sum())
        slots += n_rows * length
        packed += packed_rows(seq, length) * length
    return {"length_bucket": length_bucket, "batches": len(batches), "real_tokens": real, "slots": slots,
            "real_over_slots": real / slots, "packed_slots": packed, "real_over_packed_slots": real / packed,
            "real_tokens_per_step": real / len(batches), "sequences_per_step": len(lengths) / len(batches)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prepared", nargs="+", help="prepared dataset directories")
    p.add_argument("--token-budget", type=int, required=True)
    p.add_argument("--max-batch-size", type=int, required=True)
    p.add_argument("--length-bucket", type=int, nargs="+", default=[256], help="0: pad to each batch's longest")
    p.add_argument("--pack-length", type=int, default=0,
                   help="also: the whole epoch packed into rows of this many tokens (e.g. data.max_length)")
    p.add_argument("--out", help="JSON file for the figures")
    args = p.parse_args(argv)
    lengths = prepared_lengths(args.prepared)
    result = {"datasets": args.prepared, "rows": len(lengths), "tokens": int(lengths.sum()),
              "token_budget": args.token_budget, "max_batch_size": args.max_batch_size,
              "epochs": [epoch_padding(lengths, args.token_budget, args.max_batch_size, b) for b in args.length_bucket]}
    for e in result["epochs"]:
        print(f"bucket {e['length_bucket']:4d}: {e['batches']} batches, {e['sequences_per_step']:.1f} sequences and "
              f"{e['real_tokens_per_step']:,.0f} real tokens a step, real/slots {e['real_over_slots']:.3f}, "
              f"packed {e['real_over_packed_slots']:.3f}")
    if args.pack_length:
        e = result["packed"] = packed_epoch(lengths, args.token_budget, args.pack_length)
        print(f"packed into rows of {args.pack_length}: {e['batches']} batches, {e['sequences_per_step']:.1f} sequences and "
              f"{e['real_tokens_per_step']:,.0f} real tokens a step, real/slots {e['real_over_slots']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
