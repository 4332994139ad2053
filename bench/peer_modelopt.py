"""NVIDIA Model-Optimizer's DFlash trainer (nvidia-modelopt 0.47.0) beside ours, on one run config.

    python bench/peer_modelopt.py train --trainer modelopt -c CONFIG [overrides] --out DIR
    python bench/peer_modelopt.py train --trainer ours -c CONFIG [overrides] --out DIR
    python bench/peer_modelopt.py report DIR_OURS DIR_PEER --out CHART_DIR

`--trainer modelopt` trains Model-Optimizer's drafter through its own API: `mtsp.convert(model,
[("dflash", config)])` turns the HF target into its DFlash model, and each micro-batch is one call
of that model's training forward (anchors, masks, drafter and loss are all its own: the call its
HF-Trainer example makes per step). What it shares with ours, so that trainers are compared and not
setups: the target and its dtype, the data and micro-batches (our collation, padded to a multiple
of the block size as it requires), block size, drafter depth and width, captured target layers,
anchors per sequence, mask token, AdamW, the learning-rate schedule and the wall-clock budget (our
TimeBudget: steps shrink to fit and the schedule still ends), fp32 drafter weights under bf16
autocast on GPU. Its loss stays its default (self-logit distillation, D-PACE slot weights) unless
--peer-loss / --peer-weights say otherwise. `--trainer ours` runs our training loop on the same config in
this process, so both sides are measured alike.

Both sides write DIR/peer.json (summary and log records) and DIR/heldout.jsonl: OUR teacher-forced
held-out probe (eval.heldout_files: tau_hat and loss against device-seconds, the probe's own time
left out), so `dflash-train curve DIR_OURS DIR_PEER` charts both. The peer's drafter is converted to
our checkpoint layout (`to_ours`) for that probe and for `dflash-train eval` / `export`.

What reading Model-Optimizer 0.47.0 on transformers 5 found (docs/benchmarks/peers.md):
- its drafter does not take the target's sizes: Qwen3Config's defaults (32 heads x 128, MLP 22016)
  beat its setdefault, so every size is passed explicitly here;
- nor the target's RoPE base, which transformers 5 keeps in `rope_parameters`: it trains at
  Qwen3Config's 1e4 while its exporter writes the target's base; `to_ours` records the base the
  drafter really used (and this script passes the target's);
- from transformers 5.18 on, Qwen3RotaryEmbedding takes no `device` and its first forward fails;
  `rotary_compat` builds the embedding without it (5.17, the GPU image's, needs nothing).
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_train.config import RunConfig, load_config
from dflash_train.data.dataset import load_training_data
from dflash_train.draft.model import DraftModelConfig
from dflash_train.eval.export import CHECKPOINT_CONFIG, WEIGHTS, check_state_dict
from dflash_train.targets.model import load_target, resolve_device
from dflash_train.train.batches import collate_as_trained, epoch_plan, take
from dflash_train.train.budget import TimeBudget
from dflash_train.train.shapes import autocast_for
from dflash_train.train.heldout import HeldoutProbe
from dflash_train.train.build import build
from dflash_train.train.loop import train
from dflash_train.train.tracking import Tracker
from dflash_train.train.optim import build_optimizer, build_scheduler, refit_scheduler


# ---- Model-Optimizer's drafter, configured like ours ----------------------------------------------
def peer_config(cfg: RunConfig, d: DraftModelConfig, loss: str, weights: str) -> dict:
    """Model-Optimizer's DFlashConfig for our drafter shape. Every size is explicit (see the module
    docstring); rms_norm_eps is the target's, as ours."""
    arch = {
        "num_hidden_layers": d.num_hidden_layers,
        "target_layer_ids": list(d.target_layer_ids),
        "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads,
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate_size,
        "rms_norm_eps": d.rms_norm_eps,
        "max_position_embeddings": d.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": d.rope_theta},
    }
    if cfg.objective.num_anchors_length is not None:
        raise ValueError("objective.num_anchors_length: Model-Optimizer draws a fixed number of anchors a row; "
                         "remove it so both sides train alike")
    return {
        "dflash_block_size": d.block_size,
        "dflash_num_anchors": cfg.objective.num_anchors,
        "dflash_mask_token_id": d.mask_token_id,
        "dflash_self_logit_distillation": loss == "kd",
        "dflash_loss_objective": weights,
        # read only by the `decay` objective (it warns when set beside dpace)
        "dflash_loss_decay_factor": cfg.objective.gamma if weights == "decay" else 0.0,
        "dflash_architecture_config": arch,
    }


def rotary_compat(model) -> None:
    """transformers >= 5.18 dropped Qwen3RotaryEmbedding's `device` argument, which Model-Optimizer
    0.47.0 passes when it builds the drafter's rotary embedding at the first forward: build it here."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    if "device" in inspect.signature(Qwen3RotaryEmbedding.__init__).parameters:
        return
    module = model.dflash_module
    module.rotary_emb = Qwen3RotaryEmbedding(config=module._rotary_config).to(module.fc.weight.device)


def to_ours(model) -> tuple[DraftModelConfig, dict[str, torch.Tensor]]:
    """(our DraftModelConfig, state dict) of a Model-Optimizer DFlash model's drafter. The tensor names
    are already ours (both follow z-lab's layout); the config is read from what the drafter RUNS with,
    its RoPE base included, not from what its exporter writes."""
    dc = model.dflash_config
    rope = dict(dc.rope_parameters)
    layer_types = list(getattr(dc, "layer_types", None) or [])
    unsupported = {
        "attention sink": model.dflash_attention_sink,
        "causal block attention": model.dflash_draft_attention != "bidirectional",
        "sliding window": model.dflash_swa_window_size is not None
        or any(t != "full_attention" for t in layer_types),
        "attention bias": dc.attention_bias,
        f"activation {dc.hidden_act}": dc.hidden_act != "silu",
        f"rope type {rope.get('rope_type')}": rope.get("rope_type", "default") != "default",
    }
    if any(unsupported.values()):
        raise ValueError(f"drafter uses what ours does not have: {[k for k, v in unsupported.items() if v]}")
    cfg = DraftModelConfig(
        hidden_size=dc.hidden_size,
        num_attention_heads=dc.num_attention_heads,
        num_key_value_heads=dc.num_key_value_heads,
        head_dim=dc.head_dim,
        intermediate_size=dc.intermediate_size,
        num_hidden_layers=dc.num_hidden_layers,
        vocab_size=dc.vocab_size,
        block_size=model.dflash_block_size,
        target_layer_ids=list(model.target_layer_ids),
        num_target_layers=model._base_llm_config.num_hidden_layers,
        mask_token_id=model.mask_token_id,
        rms_norm_eps=dc.rms_norm_eps,
        rope_theta=float(rope["rope_theta"]),
        max_position_embeddings=dc.max_position_embeddings,
    )
    state = {name: t.detach().float().cpu().clone() for name, t in model.dflash_module.state_dict().items()
             if "rotary_emb" not in name}
    check_state_dict(cfg, state, "Model-Optimizer drafter")
    return cfg, state


def save_ours(cfg: DraftModelConfig, state: dict[str, torch.Tensor], out: Path) -> Path:
    """Our checkpoint layout (weights + draft_config.json): `dflash-train eval --drafter` and
    `dflash-train export` read it."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, out / WEIGHTS, metadata={"format": "pt"})
    (out / CHECKPOINT_CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return out


# ---- measuring both sides alike ---------------------------------------------------------------------
def peak_memory_gib(device: torch.device) -> float:
    """GPU: the most allocated by torch; CPU: the process's peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def consumed_tokens(epoch_batches, input_ids, micro_batches: int) -> int:
    """Real (unpadded) tokens of the first `micro_batches` micro-batches of the plan."""
    total, cursor = 0, (0, 0)
    for _ in range(micro_batches):
        _, indices, cursor = take(epoch_batches, cursor)
        total += sum(len(input_ids[i]) for i in indices)
    return total


def summary(trainer: str, cfg: RunConfig, steps: int, records: list[dict], heldout: list[dict], tokens: int,
            device: torch.device, extra: dict) -> dict:
    """One shape for both sides. Rates are over the training time the probe reports (device-seconds:
    wall clock since the start, the probes left out)."""
    seconds = heldout[-1]["device_seconds"]
    windows = [r["tokens_per_s"] for r in records[1:]] or [r["tokens_per_s"] for r in records]
    return {
        "trainer": trainer, "steps": steps, "train_seconds": seconds, "tokens": tokens,
        "tokens_per_s": tokens / seconds, "steps_per_s": steps / seconds,
        "median_window_tokens_per_s": statistics.median(windows),
        "peak_memory_gib": round(peak_memory_gib(device), 3), "device": str(device),
        "final_heldout": heldout[-1], "config": cfg.model_dump(mode="json"), **extra,
        "records": records, "heldout": heldout,
    }


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- the two trainers -------------------------------------------------------------------------------
def train_ours(cfg: RunConfig, out: Path) -> dict:
    parts = build(cfg)
    done = train(cfg, parts=parts, progress=False)
    tokens = consumed_tokens(parts.epoch_batches, parts.dataset.input_ids, done["steps"] * cfg.train.grad_accum)
    return summary("dflash-train", cfg, done["steps"], read_jsonl(out / "metrics.jsonl"),
                   read_jsonl(out / "heldout.jsonl"), tokens, parts.device, {"drafter": done["checkpoint"]})


def padded_batch(batch: dict, block_size: int) -> dict:
    """Model-Optimizer's forward wants a length divisible by the block size, and labels of -100 where
    no loss goes (its anchors and loss follow `labels != -100` and the attention mask)."""
    pad = -batch["input_ids"].shape[1] % block_size
    grow = lambda t: torch.nn.functional.pad(t, (0, pad))  # noqa: E731
    ids, loss_mask = grow(batch["input_ids"]), grow(batch["loss_mask"])
    return {"input_ids": ids, "attention_mask": grow(batch["attention_mask"]),
            "labels": ids.masked_fill(loss_mask == 0, -100)}


def train_modelopt(cfg: RunConfig, out: Path, loss: str, weights: str) -> dict:
    import modelopt.torch.speculative as mtsp

    tc = cfg.train
    device = resolve_device(cfg.device)
    target = load_target(cfg.target, device)
    dataset = load_training_data(cfg.data, target.tokenizer, target.identity["tokenizer"])
    # Our probe, on a run of the same config whose drafter receives the peer's weights; built
    # before the conversion, on the same target (its decoder stays the target's own).
    scorer = build(cfg, target, dataset)
    probe = HeldoutProbe.for_run(cfg, scorer, Tracker(cfg.tracking))
    if probe is None:
        raise ValueError("set eval.heldout_files: both sides are scored by our held-out probe")
    d = scorer.drafter.config

    torch.manual_seed(cfg.seed)
    model = mtsp.convert(target.model, [("dflash", peer_config(cfg, d, loss, weights))])
    model.dflash_module.float()  # fp32 weights under autocast, as ours
    rotary_compat(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, tc, device)
    plan = epoch_plan(cfg, dataset.lengths)
    planned = tc.max_steps or max(sum(len(b) for b in plan) // tc.grad_accum, 1)
    total = planned
    scheduler = build_scheduler(optimizer, tc, total)
    budget = tc.time_budget_minutes and TimeBudget(tc.time_budget_minutes, 0, tc.compile_warmup_steps, tc.log_every)
    autocast = autocast_for(device, target.embed_weight.dtype)

    records, window, cursor, step = [], [], (0, 0), 0
    probe.restart(0)
    t0 = time.perf_counter()
    while step < total:
        losses, accs, tokens = [], [], 0
        for _ in range(tc.grad_accum):
            _, indices, cursor = take(plan, cursor)
            batch = collate_as_trained(dataset, indices, device, cfg.data)
            with autocast:
                outputs = model(**padded_batch(batch, d.block_size))
            (outputs.loss / tc.grad_accum).backward()
            losses.append(outputs.loss.detach())
            accs.append(outputs.train_acc[0][0])
            tokens += batch["num_tokens"]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        window.append({"loss": torch.stack(losses).mean(), "acc": sum(accs) / len(accs), "tokens": tokens,
                       "grad_norm": grad_norm, "lr": lr})
        fitted = budget and budget.steps_that_fit(step, planned)
        if fitted and fitted != total:
            total = fitted
            refit_scheduler(scheduler, total)
        if step % tc.log_every == 0 or step == total:
            seconds = time.perf_counter() - t0
            records.append({"step": step, "epoch": cursor[0], "lr": window[-1]["lr"],
                            "loss": float(torch.stack([w["loss"] for w in window]).mean()),
                            "train_acc": sum(w["acc"] for w in window) / len(window),
                            "grad_norm": float(torch.stack([w["grad_norm"] for w in window]).mean()),
                            "tokens_per_s": sum(w["tokens"] for w in window) / seconds})
            print(json.dumps(records[-1]), flush=True)
            window = []
        if probe.due(step, step == total):
            scorer.drafter.load_state_dict(to_ours(model)[1])
            probe.run(step)
        t0 = time.perf_counter() if step % tc.log_every == 0 else t0

    model.get_exporter().export(out / "modelopt_export")  # its own deployment format
    ours = save_ours(*to_ours(model), out / "drafter")
    tokens = consumed_tokens(plan, dataset.input_ids, step * tc.grad_accum)
    return summary(f"modelopt ({loss}, {weights})", cfg, step, records, read_jsonl(out / "heldout.jsonl"), tokens,
                   device, {"drafter": str(ours), "modelopt_export": str(out / "modelopt_export"),
                            "peer_loss": loss, "peer_weights": weights, "planned_steps": planned})


# ---- the table and the loss chart ---------------------------------------------------------------------
def table(results: list[dict]) -> str:
    rows = ["| trainer | steps | train s | tokens/s | steps/s | peak mem GiB | held-out loss | held-out tau_hat "
            "| held-out tau_decode |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        h = r["final_heldout"]
        decode = f"{h['tau_decode']:.3f}" if "tau_decode" in h else "-"
        rows.append(f"| {r['trainer']} | {r['steps']} | {r['train_seconds']:.1f} | {r['tokens_per_s']:.0f} | "
                    f"{r['steps_per_s']:.3f} | {r['peak_memory_gib']:.2f} | {h['loss']:.3f} | {h['tau_hat']:.3f} | {decode} |")
    return "\n".join(rows)


EVAL_SETS = ("sharegpt", "humaneval", "mt-bench")


def eval_table(runs: list[Path], names: list[str]) -> str:
    """Real tau per set from each run's eval/SET.json (`dflash-train eval --out RUN/eval/SET`):
    greedy speculative decoding, rounds and the lossless count beside it. Empty when no run has one."""
    rows = []
    for run, name in zip(runs, names, strict=True):
        cells = []
        for s in EVAL_SETS:
            path = run / "eval" / f"{s}.json"
            if not path.exists():
                cells.append("-")
                continue
            r = json.loads(path.read_text())
            lossless = r["lossless"]
            cells.append(f"{r['tau']:.3f} ({r['num_rounds']:,} rounds, lossless {lossless['matches']}/{lossless['total']})")
        if any(c != "-" for c in cells):
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
    if not rows:
        return ""
    return "\n".join(["| trainer | " + " | ".join(f"{s} tau" for s in EVAL_SETS) + " |",
                      "| --- |" + " --- |" * len(EVAL_SETS), *rows])


def loss_chart(results: list[dict], out: Path) -> Path:
    """Held-out loss (our probe: the same CE on both sides) and each trainer's own training loss
    (not comparable across trainers: Model-Optimizer's default is a soft CE to the target)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        left.plot([h["device_seconds"] / 60 for h in r["heldout"]], [h["loss"] for h in r["heldout"]],
                  marker="o", ms=3, label=r["trainer"])
        right.plot([x["step"] for x in r["records"]], [x["loss"] for x in r["records"]], label=r["trainer"])
    left.set(xlabel="device-minutes", ylabel="held-out loss (our probe)", title="held-out loss, same measure")
    right.set(xlabel="step", ylabel="training loss (own objective)", title="training loss, own objectives")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "loss_curves.png", dpi=110)
    plt.close(fig)
    return out / "loss_curves.png"


def main(argv: list[str] | None = None) -> dict | str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("--trainer", choices=["ours", "modelopt"], required=True)
    t.add_argument("-c", "--config", required=True)
    t.add_argument("overrides", nargs="*")
    t.add_argument("--out", required=True, help="run directory (the config's run_dir is replaced)")
    t.add_argument("--minutes", type=float, help="wall-clock budget (train.time_budget_minutes)")
    t.add_argument("--peer-loss", choices=["kd", "ce"], default="kd",
                   help="Model-Optimizer's loss: self-logit distillation (its default) or CE on the data")
    t.add_argument("--peer-weights", choices=["dpace", "decay"], default="dpace",
                   help="its slot weights: D-PACE (its default and ours) or exp(-(k-1)/gamma) (our slot_weights: decay)")
    r = sub.add_parser("report")
    r.add_argument("runs", nargs="+", help="run directories (peer.json; eval/SET.json where evaluated)")
    r.add_argument("--out", required=True, help="directory for loss_curves.png")
    args = p.parse_args(argv)

    if args.command == "report":
        runs = [Path(run) for run in args.runs]
        results = [json.loads((run / "peer.json").read_text()) for run in runs]
        print(f"chart: {loss_chart(results, Path(args.out))}")
        tables = "\n\n".join(t for t in (table(results), eval_table(runs, [r["trainer"] for r in results])) if t)
        print(tables)
        return tables
    out = Path(args.out)
    overrides = [*args.overrides, f"run_dir={out}"]
    if args.minutes:
        overrides.append(f"train.time_budget_minutes={args.minutes}")
    cfg = load_config(args.config, overrides)
    out.mkdir(parents=True, exist_ok=True)
    result = (train_ours(cfg, out) if args.trainer == "ours"
              else train_modelopt(cfg, out, args.peer_loss, args.peer_weights))
    (out / "peer.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("records", "heldout", "config")}, indent=2))
    return result


if __name__ == "__main__":
    main()
