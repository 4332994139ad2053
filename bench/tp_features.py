"""A target sharded over two GPUs (target.tensor_parallel 2) against the same target whole on one:
the captured features, and the target's tokens/s either way.

    torchrun --standalone --nproc-per-node 2 bench/tp_features.py --out out/tp --layers 36
    torchrun --standalone --nproc-per-node 2 bench/tp_features.py --out out/tp32 --layers 4 --dtype float32

Rank 0 saves a random-init Qwen3-8B-shaped target (`--layers` decoder layers) once; both ranks load
it sharded with `load_target(..., mesh=...)`, the path `launch` takes, and rank 0 also loads it
whole. Writes <out>/tp_features.json: the largest |features(N=2) - features(N=1)| and the features'
scale over one micro-batch, and target.features tokens/s at N=1 (rank 0 alone) and N=2 (the pair)
over --steps micro-batches of --tokens tokens after one warm-up. tests/gpu runs the float32 variant.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from throughput import SHAPES  # noqa: E402
from tiny import tiny_tokenizer  # noqa: E402

from dflash_train.config_model import TargetConfig  # noqa: E402
from dflash_train.draft.model import default_target_layer_ids  # noqa: E402
from dflash_train.targets.model import load_target  # noqa: E402


def save_target(path: Path, shape: dict, dtype: torch.dtype, device: torch.device) -> None:
    torch.manual_seed(0)
    with device:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, tie_word_embeddings=False, max_position_embeddings=32768))
    model.to(dtype).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tokens_per_s(target, ids: torch.Tensor, layer_ids: list[int], steps: int) -> float:
    target.features(ids, layer_ids)  # warm-up
    _sync(ids.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        target.features(ids, layer_ids)
    _sync(ids.device)
    return steps * ids.numel() / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="tiny: a CPU/gloo smoke run")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=3072, help="tokens per micro-batch (one sequence)")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    shape = {**SHAPES[args.shape], "num_hidden_layers": args.layers}
    path = args.out / f"target-{args.shape}-{args.layers}l-{args.dtype}"
    if rank == 0 and not (path / "config.json").is_file():
        save_target(path, shape, getattr(torch, args.dtype), device)
    dist.barrier()
    cfg = TargetConfig(path=str(path), dtype=args.dtype, tensor_parallel=dist.get_world_size())
    sharded = load_target(cfg, device, mesh=mesh)
    # a 5-layer drafter's ids; a cut-down target has too few layers for 5 distinct ones: capture all
    layer_ids = default_target_layer_ids(args.layers, 5) if args.layers > 8 else list(range(args.layers))
    ids = torch.randint(0, shape["vocab_size"] - 300, (1, args.tokens),
                        generator=torch.Generator().manual_seed(1)).to(device)
    feats = sharded.features(ids, layer_ids)
    sharded_tps = tokens_per_s(sharded, ids, layer_ids, args.steps)
    sharded_peak = torch.cuda.max_memory_allocated() / 1024**3 if cuda else None
    if rank == 0:
        whole = load_target(cfg.model_copy(update={"tensor_parallel": 1}), device)
        reference = whole.features(ids, layer_ids)
        result = {
            "shape": args.shape, "layers": args.layers, "dtype": args.dtype, "tokens": args.tokens, "layer_ids": layer_ids,
            "max_abs_diff": (feats.float() - reference.float()).abs().max().item(),
            "max_abs": reference.float().abs().max().item(),
            "tokens_per_s_whole": tokens_per_s(whole, ids, layer_ids, args.steps),
            "tokens_per_s_sharded": sharded_tps,
            "peak_memory_gib_sharded_rank0": sharded_peak,
        }
        (args.out / "tp_features.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
