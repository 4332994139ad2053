"""Who does what in distributed training, and how many GPUs each role should get. Pure functions,
light to import: `launch` checks a split with them before torchrun starts.

Global ranks: target ranks 0..T-1, then the ranks of drafter group 0, group 1, ... in order.
Target ranks form T/N tensor-parallel groups of N = `target.tensor_parallel` consecutive ranks
(N = 1: every target rank is its own group); a group runs one sharded target and its first rank,
the lead, sends. Colocated: every rank is target rank r AND rank r of the single drafter group, so
every micro-batch is produced and consumed by the same process.
Micro-batch m of a step is produced by target group m % (T/N) and consumed by rank m % D_g of each
drafter group: balanced, and a pure function of m, so any split resumes from the same global cursor.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path

from dflash_train.config import RunConfig, build_config
from dflash_train.config_model import sizes_into_family_sections


LAYER_CHOICE = {"target_layer_ids", "num_target_features"}
"""draft keys that each choose the captured target layers (setting both is a config error)."""


def drafter_runs(cfg: RunConfig) -> list[tuple[str, RunConfig]]:
    """(name, config) of every drafter group; each of several drafters gets <run_dir>/<name>."""
    if not cfg.drafters:
        return [("drafter", cfg)]
    base = cfg.model_dump(mode="json", exclude={"drafters"})
    runs = []
    for spec in cfg.drafters:
        tree = copy.deepcopy(base)
        if LAYER_CHOICE & set(spec.draft):  # a drafter's own choice of target layers replaces the base's
            tree["draft"].update(dict.fromkeys(LAYER_CHOICE))
        for key, value in sizes_into_family_sections(spec.draft).items():
            # a family's section merges key by key: the base's other sizes of that family stay
            own = tree["draft"].get(key)
            tree["draft"][key] = {**own, **value} if isinstance(own, dict) and isinstance(value, dict) else value
        if tree["objective"].get("slot_weights") == "dpace" and "slot_weights" not in spec.objective:
            # D-PACE left to the entry's own keys: its gamma, family or CE kernel may need the decay (config.py)
            del tree["objective"]["slot_weights"]
        tree["objective"].update(spec.objective)
        tree["train"].update(spec.train)
        tree["run_dir"] = str(Path(cfg.run_dir) / spec.name)
        runs.append((spec.name, build_config(tree, source=f"drafters[{spec.name}]")))
    return runs


@dataclass(frozen=True)
class Layout:
    num_targets: int
    group_sizes: tuple[int, ...]
    group_names: tuple[str, ...]
    colocated: bool = False
    tensor_parallel: int = 1

    def __post_init__(self):
        if self.num_targets < 1 or not self.group_sizes or min(self.group_sizes) < 1:
            raise ValueError(f"need >= 1 target rank and >= 1 rank per drafter group, got {self}")
        if self.colocated and self.group_sizes != (self.num_targets,):
            raise ValueError("colocated mode runs exactly one drafter group on every rank")
        if self.colocated and self.tensor_parallel > 1:
            raise ValueError(f"target.tensor_parallel {self.tensor_parallel} needs a split layout "
                             "(--target-gpus), not --colocated")
        if self.num_targets % self.tensor_parallel:
            raise ValueError(f"{self.num_targets} target GPUs do not form groups of target.tensor_parallel = "
                             f"{self.tensor_parallel}: give a multiple of {self.tensor_parallel}")

    @property
    def num_target_groups(self) -> int:
        return self.num_targets // self.tensor_parallel

    def target_group_ranks(self, k: int) -> list[int]:
        return list(range(k * self.tensor_parallel, (k + 1) * self.tensor_parallel))

    def target_lead(self, rank: int) -> int:
        """The rank that sends for `rank`'s target group."""
        return rank - rank % self.tensor_parallel

    @property
    def world_size(self) -> int:
        return self.num_targets if self.colocated else self.num_targets + sum(self.group_sizes)

    def group_ranks(self, group: int) -> list[int]:
        if self.colocated:
            return list(range(self.num_targets))
        start = self.num_targets + sum(self.group_sizes[:group])
        return list(range(start, start + self.group_sizes[group]))

    def is_target(self, rank: int) -> bool:
        return rank < self.num_targets

    def drafter_role(self, rank: int) -> int | None:
        """The drafter group this rank belongs to, if any."""
        for g in range(len(self.group_sizes)):
            if rank in self.group_ranks(g):
                return g
        return None

    def target_of(self, m: int) -> int:
        """The lead rank of the target group that produces micro-batch m."""
        return (m % self.num_target_groups) * self.tensor_parallel

    def consumers(self, m: int) -> list[int]:
        """The rank of each drafter group that trains on micro-batch m."""
        return [self.group_ranks(g)[m % size] for g, size in enumerate(self.group_sizes)]

    def consumed_by(self, rank: int, group: int, grad_accum: int) -> list[int]:
        index = self.group_ranks(group).index(rank)
        return [m for m in range(grad_accum) if m % self.group_sizes[group] == index]

    def describe(self, rank: int) -> str:
        roles = []
        if self.is_target(rank) and self.tensor_parallel > 1:
            roles.append(f"target group {rank // self.tensor_parallel} shard {rank % self.tensor_parallel}")
        elif self.is_target(rank):
            roles.append(f"target {rank}")
        group = self.drafter_role(rank)
        if group is not None:
            index = self.group_ranks(group).index(rank)
            roles.append(f"drafter {index} of group '{self.group_names[group]}'")
        return " + ".join(roles)

    def check_grad_accum(self, grad_accum: int) -> None:
        widest = max(self.num_target_groups, *self.group_sizes)
        if grad_accum < widest:
            raise ValueError(
                f"train.grad_accum ({grad_accum}) < {widest} target groups or ranks of one drafter group: every one needs at least one "
                "micro-batch per step; raise grad_accum or use fewer ranks"
            )


def build_layout(world: int, names: list[str], *, target_ranks: int | None, drafter_ranks: str | None,
                 colocated: bool, tensor_parallel: int) -> Layout:
    """The layout of `world` processes (`launch` checks it before starting them, with the same call)."""
    names_t = tuple(names)
    if colocated:
        return Layout(world, (world,), names_t, colocated=True, tensor_parallel=tensor_parallel)
    rest = world - target_ranks
    if drafter_ranks:
        sizes = tuple(int(x) for x in drafter_ranks.split(","))
    elif rest % len(names) == 0:
        sizes = (rest // len(names),) * len(names)
    else:
        raise ValueError(f"{rest} drafter ranks do not split evenly over {len(names)} groups: give --drafter-ranks")
    layout = Layout(target_ranks, sizes, names_t, tensor_parallel=tensor_parallel)
    if layout.world_size != world or len(sizes) != len(names):
        raise ValueError(f"layout {target_ranks} targets + {sizes} drafters does not match "
                         f"{world} processes and {len(names)} drafter groups")
    return layout


@dataclass(frozen=True)
class Plan:
    num_targets: int
    group_sizes: tuple[int, ...]
    colocated: bool
    tokens_per_s: float
    reason: str


def plan_split(num_gpus: int, target_tps: float, drafter_tps: list[float], colocated_tps: float | None,
               tensor_parallel: int = 1) -> Plan:
    """The split of `num_gpus` that maximises end-to-end tokens/s, from measured throughputs: one
    target group (`tensor_parallel` GPUs running one sharded target), one GPU running only one
    drafter, or one GPU running both (None: does not fit, several drafters, or a sharded target).
    Target GPUs come in whole groups. A disaggregated pipeline runs at its slowest stage. In an ideal
    world colocated equals the best fractional split (N*a*b/(a+b)), so disaggregation wins through
    integer splits that fit well, memory (both models on one GPU force smaller batches or do not
    fit), or several drafters."""
    if num_gpus < 1 or target_tps <= 0 or min(drafter_tps) <= 0:
        raise ValueError("plan_split needs >= 1 GPU and positive throughputs")
    per = f"per target group of {tensor_parallel} GPUs" if tensor_parallel > 1 else "per GPU"
    measured = (f"measured {per}: target {target_tps:.0f}, drafter per GPU {', '.join(f'{b:.0f}' for b in drafter_tps)}"
                + (f", colocated {colocated_tps:.0f}" if colocated_tps else "") + " tokens/s")
    best = None
    for sizes in itertools.product(range(1, num_gpus), repeat=len(drafter_tps)):
        t = num_gpus - sum(sizes)
        if t < 1 or t % tensor_parallel:
            continue
        stages = [t // tensor_parallel * target_tps] + [d * b for d, b in zip(sizes, drafter_tps)]
        if best is None or min(stages) > best.tokens_per_s:
            bound = "target" if stages[0] == min(stages) else "drafter"
            best = Plan(t, tuple(sizes), False, min(stages),
                        f"{t} target + {'/'.join(map(str, sizes))} drafter GPUs run at their slowest stage "
                        f"({', '.join(f'{s:.0f}' for s in stages)}): {min(stages):.0f} tokens/s, {bound}-bound")
    if colocated_tps and tensor_parallel == 1 and (best is None or num_gpus * colocated_tps >= best.tokens_per_s):
        vs = f" (vs {best.reason})" if best else ""
        return Plan(num_gpus, (num_gpus,), True, num_gpus * colocated_tps,
                    f"colocated on {num_gpus} GPUs: {num_gpus * colocated_tps:.0f} tokens/s{vs}; {measured}")
    if best is None:
        raise ValueError(f"{num_gpus} GPUs cannot hold a target group of {tensor_parallel} GPUs and "
                         f"{len(drafter_tps)} drafter groups")
    vs = f" (vs colocated {num_gpus * colocated_tps:.0f})" if colocated_tps else ""
    return Plan(best.num_targets, best.group_sizes, False, best.tokens_per_s, f"{best.reason}{vs}; {measured}")
