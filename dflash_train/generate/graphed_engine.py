"""Regeneration as a serving engine runs it: continuous batching over a static KV cache, CUDA graphs.

`rows` answers are decoded together, one token per row and step. The step (the target's forward
over [rows, 1] at per-row positions, then the next token of every row) has fixed shapes, so on a GPU
it is captured once as a CUDA graph and replayed (compiled first when asked: `compile`); on CPU
(tests) the same function runs eagerly, or compiled when asked (static_cache.prepare_steps).
A finished row is refilled with a waiting prompt: the new prompts are prefilled together in one
eager forward and their K/V copied into the free rows (static_cache.py says why stale K/V there is
harmless). The host reads the new tokens once every `chunk` steps, so it seldom waits on the GPU.

Greedy and temperature sampling (Gumbel-max: exact sampling from softmax(logits / T)) per row;
top-p is refused. The cache holds prompt + max_tokens positions of the longest request seen; a longer
one grows it (by half at least): the rows' K/V are copied over and the step captured again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash_train.generate.backends import emit_tokens
from dflash_train.targets.static_cache import ALIGN, PositionedCache, Steps, forward_at, prepare_steps, static_cache_problem

log = logging.getLogger("dflash_train")

LENGTH_STEP = 256
"""Cache lengths are rounded up to this, so a slightly longer prompt seldom forces a rebuild."""


@dataclass
class Job:
    """One answer to produce: the prompt's token ids and how; `tokens` fills in as it decodes."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    tag: object = None
    """The caller's handle (a request), given back with the answer."""
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    stopped: bool = False
    """Finished by a stop token (else by max_tokens)."""

    def positions_needed(self) -> int:
        return len(self.prompt) + self.max_tokens + 1  # a finished row idles at prompt + max_tokens


def sample(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Per row [R, V] -> [R]: argmax where temperature is 0, else a draw from softmax(logits / T)
    (the argmax of logits / T plus Gumbel noise)."""
    logits = logits.float()
    uniform = torch.rand_like(logits).clamp_(min=torch.finfo(torch.float32).tiny)
    noisy = logits / temperature.clamp(min=1e-6)[:, None] - torch.log(-torch.log(uniform))
    return torch.where(temperature > 0, noisy.argmax(-1), logits.argmax(-1))


class GraphedEngine:
    """`graphs` (default: on a GPU) captures the step as a CUDA graph, `compile` compiles it first
    (opt-in, `local.compile_step`: its gain at a thousand rows, where the cache reads dominate, is
    not measured yet; each cache growth compiles again); `steps` says what happened (errors included)."""

    def __init__(self, model, rows: int, stops: set[int], pad_id: int, chunk: int = 8, graphs: bool | None = None,
                 compile: bool = False):
        problem = static_cache_problem(model)
        if problem:
            raise ValueError(f"generate engine 'graphed' cannot run {type(model).__name__}: {problem} "
                             "(use --engine padded or static)")
        self.model, self.rows, self.stops, self.pad_id, self.chunk = model, rows, stops, pad_id, chunk
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.compile = compile
        self.config = model.config.get_text_config(decoder=True)
        self.kv_shapes = self._kv_shapes()
        self.length = 0
        self.cache = None
        self.steps: Steps | None = None
        r = rows
        self.ids = torch.zeros(r, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(r, 1, dtype=torch.long, device=self.device)
        self.cap = torch.zeros(r, dtype=torch.long, device=self.device)
        self.temperature = torch.zeros(r, device=self.device)
        self.history = torch.zeros(r, chunk, dtype=torch.long, device=self.device)
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)

    @torch.no_grad()
    def _kv_shapes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's key and value of one token (shape and dtype): read from a one-token forward,
        since layers may store other shapes than the config's K/V heads (MLA: every head, keys and
        values of different sizes)."""
        probe = PositionedCache(self.config, ALIGN)
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        forward_at(self.model, probe, one, one, logits_to_keep=1)
        return [(layer.keys[:, :, :1], layer.values[:, :, :1]) for layer in probe.layers]

    # --------------------------------------------------------------- the fixed-shape step

    def _step(self):
        logits = forward_at(self.model, self.cache, self.ids, self.pos, logits_to_keep=1).logits[:, -1]
        token = sample(logits, self.temperature)
        self.ids.copy_(token[:, None])
        self.history.index_copy_(1, self.column, token[:, None])
        self.column.add_(1).remainder_(self.chunk)
        self.pos.copy_(torch.minimum(self.pos + 1, self.cap[:, None]))

    def _build(self, positions: int):
        """Cache and step for `positions` per row; the step captured as a graph on a GPU. Growing,
        the rows' K/V move to the new cache and decoding goes on where it was."""
        old, self.step, self.steps = self.cache, None, None  # the old graph goes before the new one is captured
        length = max(-(-positions // LENGTH_STEP) * LENGTH_STEP, self.length * 3 // 2)  # few regrowths
        length = -(-length // ALIGN) * ALIGN
        self.cache = PositionedCache(self.config, length)
        for i, (layer, (key, value)) in enumerate(zip(self.cache.layers, self.kv_shapes)):
            layer.lazy_initialization(key.expand(self.rows, -1, -1, -1), value.expand(self.rows, -1, -1, -1))
            if old is not None:
                layer.keys[:, :, : self.length] = old.layers[i].keys
                layer.values[:, :, : self.length] = old.layers[i].values
                old.layers[i].keys = old.layers[i].values = None  # one layer of both caches at a time
        self.length = length
        del old
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        saved = self.ids.clone(), self.pos.clone()  # warm-up steps write only above each row's position
        self.steps = prepare_steps({"step": self._step}, self.device, self.graphs, self.compile)
        self.step = self.steps.run["step"]
        self.ids.copy_(saved[0])
        self.pos.copy_(saved[1])
        self.column.zero_()  # a chunk of steps fills history columns 0..chunk-1 in order
        log.info("graphed engine: %d rows x %d positions%s%s", self.rows, self.length,
                 " (compiled)" if self.steps.compiled else "", " (CUDA graph)" if self.steps.graphed else "")

    # --------------------------------------------------------------- admission

    def _admit(self, rows: list[int], jobs: list[Job]) -> None:
        """Prefills `jobs` into the free `rows`: one eager forward over the prompts, left-padded so
        the last logit of every row is the prompt's. A pad token sits at a position after its prompt
        (invisible to the prompt's queries, overwritten by the answer), so positions stay per row."""
        width = max(len(j.prompt) for j in jobs)
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        positions = torch.empty((len(jobs), width), dtype=torch.long)
        for i, job in enumerate(jobs):
            n = len(job.prompt)
            ids[i, width - n:] = torch.tensor(job.prompt)
            positions[i] = torch.cat([torch.arange(n, width), torch.arange(n)])
        prefill = PositionedCache(self.config, width)
        logits = forward_at(self.model, prefill, ids.to(self.device), positions.to(self.device), logits_to_keep=1).logits
        index = torch.tensor(rows, device=self.device)
        temperature = torch.tensor([j.temperature for j in jobs], device=self.device)
        first = sample(logits[:, -1], temperature)
        for layer, fresh in zip(self.cache.layers, prefill.layers):
            layer.keys[index, :, :width] = fresh.keys
            layer.values[index, :, :width] = fresh.values
        lengths = torch.tensor([len(j.prompt) for j in jobs], device=self.device)
        self.ids[index] = first[:, None]
        self.pos[index] = lengths[:, None]
        self.cap[index] = lengths + torch.tensor([j.max_tokens for j in jobs], device=self.device)
        self.temperature[index] = temperature
        for job, token in zip(jobs, first.tolist()):
            self._emit(job, [token])

    def _emit(self, job: Job, tokens: list[int]) -> None:
        """Appends an unfinished job's new tokens up to its stop token or budget."""
        job.finished = emit_tokens(job.tokens, tokens, job.max_tokens, self.stops)
        job.stopped = job.finished and job.tokens[-1] in self.stops

    # --------------------------------------------------------------- serving

    @torch.no_grad()
    def serve(self, take: Callable[[int], list[Job]], give: Callable[[Job], None]) -> None:
        """Decodes until `take` has nothing more: `take(n)` returns up to n waiting jobs (ones this
        engine cannot run, e.g. top-p, are the caller's to refuse), `give(job)` receives each
        finished one (tokens cut after the first stop token, `stopped` set)."""
        occupant: list[Job | None] = [None] * self.rows
        refill_at = max(1, self.rows // 8)  # a prefill costs about as much as a few steps: batch them
        while True:
            free = [r for r, job in enumerate(occupant) if job is None]
            idle = len(free) == self.rows
            jobs = take(len(free)) if len(free) >= refill_at or idle else []
            if jobs:
                need = max(j.positions_needed() for j in jobs)
                if need > self.length:
                    self._build(need)
                self._admit(free[: len(jobs)], jobs)
                for r, job in zip(free, jobs):
                    occupant[r] = job
                self._release(occupant, give)  # a one-token answer ends at its prefill
            if all(job is None for job in occupant):
                if idle and not jobs:
                    return
                continue
            for _ in range(self.chunk):
                self.step()
            for job, tokens in zip(occupant, self.history.tolist()):
                if job is not None and not job.finished:
                    self._emit(job, tokens)
            self._release(occupant, give)

    def _release(self, occupant: list[Job | None], give) -> None:
        for r, job in enumerate(occupant):
            if job is not None and job.finished:
                occupant[r] = None
                give(job)
