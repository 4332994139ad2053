"""Regeneration as a serving engine runs it: continuous batching over a static KV cache, CUDA graphs.

`rows` answers are decoded together, one token per row and step. The step (the target's forward
over [rows, 1] at per-row positions, then the next token of every row) has fixed shapes, so on a GPU
it is captured once as a CUDA graph and replayed (compiled first when asked: `compile`); on CPU
(tests) the same function runs eagerly, or compiled when asked (compiled_steps.prepare_steps).
Compiled, the step's attention reads each row's cache only up to the row's position
(decode/flex_decode.py); otherwise packed SDPA reads the whole cache under a mask.
A finished row is refilled with a waiting prompt: the new prompts are prefilled through forwards
of fixed shapes captured as CUDA graphs, packed into one row of tokens that writes their K/V
straight into the free rows (decode/packed_prefill.py), or, for models with sliding windows,
sinks or soft-capping, grouped by width and left-padded (decode/prefill.py), their K/V copied
over (static_cache.py says why stale K/V in a reused row is harmless).

The host never waits for the step it just launched: steps run in chunks of `chunk`, each chunk's
new tokens copied to pinned host memory behind it, and the host reads a chunk while the `ahead`
chunks launched after it run (admissions, too, go to the GPU without a synchronisation). A row that
finishes therefore decodes `ahead` more chunks of tokens nobody reads before it is refilled; each
chunk remembers which job held each row, so those tokens never reach the next occupant.
Where a job's time went is logged at its end on two clocks: the host's (`Timings`: waiting for the
GPU, admitting, reading) and the GPU's (launch_timeline.py: steps, prefills, idle between launches).

Greedy and temperature sampling (Gumbel-max: exact sampling from softmax(logits / T)) per row;
top-p is refused. The cache holds prompt + max_tokens positions of the longest request seen; a longer
one grows it (by half at least): the rows' K/V are copied over and the step captured again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from dflash_train.decode.sampling import emit_tokens
from dflash_train.decode.launch_timeline import LaunchTimeline
from dflash_train.decode.packed_prefill import PackedPrefills, packed_prefill_problem
from dflash_train.decode.prefill import Prefills, to_device
from dflash_train.decode.flex_decode import FLEX_DECODE, flex_decode_problem
from dflash_train.compiled_steps import Steps, prepare_steps
from dflash_train.decode.static_cache import (ALIGN, PACKED_GQA, PositionedCache, attention_as, forward_at,
                                              static_cache_problem)

log = logging.getLogger("dflash_train")

LENGTH_STEP = 256
"""Cache lengths are rounded up to this, so a slightly longer prompt seldom forces a rebuild."""


@torch.no_grad()
def kv_shapes(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's key and value of one token (shape and dtype): read from a one-token forward,
    since layers may store other shapes than the config's K/V heads (MLA: every head, keys and
    values of different sizes)."""
    probe = PositionedCache(model.config.get_text_config(decoder=True), ALIGN)
    one = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    forward_at(model, probe, one, one, logits_to_keep=1)
    return [(layer.keys[:, :, :1], layer.values[:, :, :1]) for layer in probe.layers]


def prefill_problem(model, prefill: str, shapes=None) -> str | None:
    """Why the graphed engine cannot prefill `model` as `prefill` (auto, packed or padded) asks, or
    None. `shapes`: the model's `kv_shapes`, read here when needed and not given."""
    if prefill not in ("auto", "packed", "padded"):
        return f"prefill must be auto, packed or padded, not {prefill!r}"
    if prefill == "packed" and (problem := packed_prefill_problem(model, shapes or kv_shapes(model))):
        return f"packed prefills cannot run {type(model).__name__}: {problem} (prefill auto or padded can)"
    return None


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


@dataclass
class _Chunk:
    """A chunk of steps launched and not yet read: its tokens [rows, chunk] land in `tokens` once
    `done` has passed; `jobs` held the rows while it ran, `first` are the admissions made before it
    (their jobs and first tokens, read before the chunk's own)."""

    tokens: torch.Tensor
    done: torch.cuda.Event | None
    jobs: list[Job | None]
    first: list[tuple[list[Job], torch.Tensor]]


@dataclass
class Timings:
    """Where the serving thread's wall time went (host clocks): what `serve` logs at its end."""

    chunks: int = 0
    prefills: int = 0
    waiting_s: float = 0.0
    """Blocked on the GPU (the chunk being read had not finished)."""
    admitting_s: float = 0.0
    """Prefills launched, their K/V copied into rows."""
    reading_s: float = 0.0
    """Tokens handed to their jobs, finished jobs handed back."""
    building_s: float = 0.0
    """Caches allocated, steps compiled and captured."""

    def __str__(self) -> str:
        return (f"{self.chunks} chunks, {self.prefills} prefills; waiting for the GPU {self.waiting_s:.1f} s, "
                f"admitting {self.admitting_s:.1f} s, reading {self.reading_s:.1f} s, building {self.building_s:.1f} s")


AHEAD = 2
"""Chunks queued on the GPU behind the one the host reads. An admission's prefills cost the host
tens of milliseconds at once (several captured forwards, their K/V copied layer by layer), as long
as a chunk of steps takes the GPU at a thousand rows: with one chunk queued, the GPU can run dry
while the host admits. Each more costs a finished row one more chunk of idle steps (8 of ~330
per answer)."""


LENGTH_BLOCK = 256
"""A multiple of flex_decode.KV_BLOCK and static_cache.ALIGN: every cache length is one of both."""


class GraphedEngine:
    """`graphs` (default: on a GPU) captures the step as a CUDA graph, `compile` compiles it first
    (`local.compile_step`; each cache growth compiles again), and a compiled step's attention reads
    each row only up to its position where the model allows it (`attention`: auto, flex or sdpa);
    `steps` says what happened (errors included). Prompts are prefilled packed where the model
    allows it (`prefill`: auto, packed or padded), their forward compiled when asked
    (`compile_prefill`: packed prefills only; `prefills.compile_error` says if it failed)."""

    def __init__(self, model, rows: int, stops: set[int], pad_id: int, chunk: int = 8, graphs: bool | None = None,
                 compile: bool = False, attention: str = "auto", ahead: int = AHEAD, prefill: str = "auto",
                 compile_prefill: bool = False):
        problem = static_cache_problem(model)
        if problem:
            raise ValueError(f"generate engine 'graphed' cannot run {type(model).__name__}: {problem} "
                             "(use --engine padded or static)")
        if ahead < 1:
            raise ValueError(f"ahead must be at least 1 (chunks queued behind the one read), not {ahead}")
        self.model, self.rows, self.stops, self.pad_id, self.chunk = model, rows, stops, pad_id, chunk
        self.ahead = ahead
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.compile = compile
        self.flex = self._flex(attention)
        self.attention = FLEX_DECODE if self.flex else PACKED_GQA
        self.config = model.config.get_text_config(decoder=True)
        self.kv_shapes = kv_shapes(model)
        self.packed = self._packed(prefill)
        if compile_prefill and not self.packed:
            raise ValueError(f"compile_prefill compiles packed prefills; {type(model).__name__} prefills padded here")
        self.compile_prefill = compile_prefill
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
        pinned = self.device.type == "cuda"
        # one per chunk in flight: a chunk's copy lands while the host reads the oldest
        self.host_tokens = [torch.zeros(r, chunk, dtype=torch.long, pin_memory=pinned) for _ in range(ahead + 1)]
        self.launches = 0
        self.timings = Timings()
        self.timeline = LaunchTimeline(self.device)
        self.sampling = False
        """Whether a job has sampled yet: then a sampling step is prepared beside the greedy one."""

    def _flex(self, attention: str) -> bool:
        """Whether the step's attention is flex decoding: asked for, or (auto) when the step is
        compiled (eager flex_attention computes densely) and the model's attention allows it."""
        if attention not in ("auto", "flex", "sdpa"):
            raise ValueError(f"attention must be auto, flex or sdpa, not {attention!r}")
        problem = flex_decode_problem(self.model)
        if attention == "flex" and problem:
            raise ValueError(f"flex decoding cannot run {type(self.model).__name__}: {problem}")
        if attention == "auto" and self.compile and problem:
            log.info("graphed engine: SDPA over the whole cache (flex decoding: %s)", problem)
        return attention == "flex" or (attention == "auto" and self.compile and problem is None)

    def _packed(self, prefill: str) -> bool:
        """Whether prompts are prefilled packed (auto: where the model's attention allows it)."""
        if problem := prefill_problem(self.model, prefill, self.kv_shapes):
            raise ValueError(problem)
        if prefill != "auto":
            return prefill == "packed"
        if problem := packed_prefill_problem(self.model, self.kv_shapes):
            log.info("graphed engine: padded prefills (packed: %s)", problem)
        return problem is None

    # --------------------------------------------------------------- the fixed-shape step

    def _step(self, sampled: bool):
        logits = forward_at(self.model, self.cache, self.ids, self.pos, flex=self.flex, logits_to_keep=1).logits[:, -1]
        token = sample(logits, self.temperature) if sampled else logits.argmax(-1)
        self.ids.copy_(token[:, None])
        self.history.index_copy_(1, self.column, token[:, None])
        self.column.add_(1).remainder_(self.chunk)
        self.pos.copy_(torch.minimum(self.pos + 1, self.cap[:, None]))

    def _build(self, positions: int):
        """Cache and step for `positions` per row; the step captured as a graph on a GPU. Growing,
        the rows' K/V move to the new cache and decoding goes on where it was."""
        old, self.steps = self.cache, None  # the old graphs go before the new ones are captured
        self.prefills = None  # its graphs go too, and (packed) its hold on every layer of the old cache
        # Few regrowths: each compiles again. With flex decoding a longer cache costs memory, not
        # reads, so the first one leaves room for prompts twice as long as the first batch's.
        first = 2 * positions if self.flex and self.length == 0 else positions
        length = max(-(-first // LENGTH_STEP) * LENGTH_STEP, self.length * 3 // 2)
        length = -(-length // LENGTH_BLOCK) * LENGTH_BLOCK
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
        if self.packed:
            self.prefills = PackedPrefills(self.model, self.cache, self.graphs, compile=self.compile_prefill)
        else:
            self.prefills = Prefills(self.model, self.cache, self.pad_id, self.graphs)
        self._prepare()
        if self.packed:
            self.prefills.compile_now()  # where asked (compile_prefill): in the build, not in an admission

    @torch.no_grad()
    def _prepare(self):
        """The steps compiled (when asked) and captured: greedy, and sampled once a job samples
        (the greedy step draws no noise over the [rows, vocab] logits)."""
        self.steps = None
        steps = {"greedy": partial(self._step, False)}
        if self.sampling:
            steps["sample"] = partial(self._step, True)
        saved = self.ids.clone(), self.pos.clone()  # warm-up steps write only above each row's position
        with attention_as(self.model, self.attention):
            self.steps = prepare_steps(steps, self.device, self.graphs, self.compile)
        self.ids.copy_(saved[0])
        self.pos.copy_(saved[1])
        self.column.zero_()  # a chunk of steps fills history columns 0..chunk-1 in order
        log.info("graphed engine: %d rows x %d positions%s%s%s", self.rows, self.length,
                 " (compiled)" if self.steps.compiled else "", " (CUDA graph)" if self.steps.graphed else "",
                 " (flex decoding)" if self.flex else "")

    # --------------------------------------------------------------- admission

    def _admit(self, rows: list[int], jobs: list[Job]) -> list[tuple[list[Job], torch.Tensor]]:
        """Prefills `jobs` into the free `rows`, as many forwards as the prefills split them into.
        Returns each prefill's jobs and their first tokens."""
        pieces = self.prefills.pieces([len(job.prompt) for job in jobs])
        self.timings.prefills += len(pieces)
        return [([jobs[i] for i in piece], self.timeline.around("prefills", self._prefill, [rows[i] for i in piece],
                                                                [jobs[i] for i in piece])) for piece in pieces]

    def _prefill(self, rows: list[int], jobs: list[Job]) -> torch.Tensor:
        """Prefills `jobs` into `rows` (packed_prefill.py, else prefill.py) and starts their rows.
        Returns each job's first token, on the host once the GPU gets there (pinned, non-blocking)."""
        logits = self.prefills.run([job.prompt for job in jobs], rows)
        # one transfer for the rows' integers: a pinned copy on the host
        index, lengths, budgets = to_device(torch.tensor([rows, [len(j.prompt) for j in jobs],
                                                          [j.max_tokens for j in jobs]]), self.device)
        temperature = to_device(torch.tensor([j.temperature for j in jobs], dtype=torch.float32), self.device)
        first = sample(logits, temperature)
        self.ids[index] = first[:, None]
        self.pos[index] = lengths[:, None]
        self.cap[index] = lengths + budgets
        self.temperature[index] = temperature
        return first.to("cpu", non_blocking=True) if self.device.type == "cuda" else first

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
        refill_at = max(1, self.rows // 16)  # a prefill costs about as much as a few steps: batch them
        self.timings, self.timeline = Timings(), LaunchTimeline(self.device)
        with attention_as(self.model, self.attention):  # set outside the compiled step (attention_as says why)
            self._serve(take, give, refill_at)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the job is over: its last marks may be read
        self.timeline.settle()
        log.info("graphed engine served: %s; the GPU's clock %s", self.timings, self.timeline)

    def _serve(self, take, give, refill_at: int) -> None:
        occupant: list[Job | None] = [None] * self.rows
        launched: deque[_Chunk] = deque()
        admitted: list[tuple[list[Job], torch.Tensor]] = []
        while True:
            free = [r for r, job in enumerate(occupant) if job is None]
            idle = len(free) == self.rows
            jobs = take(len(free)) if len(free) >= refill_at or idle else []
            if jobs:
                need = max(j.positions_needed() for j in jobs)
                sampling = not self.sampling and any(j.temperature > 0 for j in jobs)
                if need > self.length or sampling:
                    while launched:  # the steps are rebuilt: read what the old ones made first
                        self._read(launched.popleft(), occupant, give)
                    self.sampling = self.sampling or sampling
                    start = time.perf_counter()
                    if need > self.length:
                        self._build(need)
                    else:
                        self._prepare()
                    self.timings.building_s += time.perf_counter() - start
                start = time.perf_counter()
                admitted += self._admit(free[: len(jobs)], jobs)
                self.timings.admitting_s += time.perf_counter() - start
                for r, job in zip(free, jobs):
                    occupant[r] = job
            busy = [job for job in occupant if job is not None]
            if busy:
                sampled = any(job.temperature > 0 for job in busy)
                # no local name for the step: a cache growth must free the old graph (and its pool)
                launched.append(self.timeline.around("steps", self._launch, self.steps.run["sample" if sampled else "greedy"],
                                                     occupant, admitted))
                admitted = []
            elif not launched:
                return
            if len(launched) > self.ahead or not busy:
                self._read(launched.popleft(), occupant, give)

    def _launch(self, step, occupant: list[Job | None], admitted: list) -> _Chunk:
        """Runs a chunk of steps; its tokens follow it to the host without a wait."""
        for _ in range(self.chunk):
            step()
        tokens = self.host_tokens[self.launches % len(self.host_tokens)]  # the others may be in flight or read
        self.launches += 1
        tokens.copy_(self.history, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return _Chunk(tokens, done, list(occupant), admitted)

    def _read(self, chunk: _Chunk, occupant: list[Job | None], give) -> None:
        """Hands a chunk's tokens to their jobs (first tokens of its admissions first) and frees the
        rows whose job has finished."""
        start = time.perf_counter()
        if chunk.done is not None:
            chunk.done.synchronize()
        self.timings.waiting_s += time.perf_counter() - start
        start = time.perf_counter()
        self.timeline.settle()  # every mark up to this chunk's has passed
        self.timings.chunks += 1
        for jobs, first in chunk.first:
            for job, token in zip(jobs, first.tolist()):
                self._emit(job, [token])
        for job, tokens in zip(chunk.jobs, chunk.tokens.tolist()):
            if job is not None and not job.finished:
                self._emit(job, tokens)
        for r, job in enumerate(occupant):
            if job is not None and job.finished:
                occupant[r] = None
                give(job)
        self.timings.reading_s += time.perf_counter() - start
