"""Speculative decoding as a server runs it: static KV caches, fixed shapes, CUDA graphs.

`spec_decode.speculative_generate` makes the decisions; this module makes the same ones (greedy) with
a serving engine's machinery, so its tokens/s predict what SGLang or vLLM would give:
- Both models write their K/V into caches preallocated to `max_len` (+ one block) positions, at
  positions given by a tensor. Nothing is ever cropped: a rejected proposal's K/V stays where it
  was written, is masked out (a key is visible only at a position the query may see), and the next
  block overwrites it. Hence `cap`: a finished row of a batch keeps running (the shape is fixed) at
  a clamped position, inside the cache.
- One round is three fixed-shape steps over `R` rows of `B` slots:
    draft    the drafter's forward; its new context is the last verification's features of all B
             slots at their positions (masking, not slicing, keeps the accepted ones: key j is
             visible iff j < the block's start), its block [token, MASK x (B-1)]
    verify   the target's forward over [token, proposals], capturing the drafter's layers
    advance  acceptance (longest agreeing prefix + the target's token) and the next round's inputs
  and the target-only baseline is one step: one token per row. On a GPU each step is compiled
  (torch.compile: fused kernels), captured once as a CUDA graph over static buffers and replayed; on
  CPU (tests) the same functions run eagerly, or compiled when asked (compiled_steps.prepare_steps).
- Prefills (variable length: the prompts, and the drafter's pass over the prompt's features) run
  eagerly. The drafter's prompt pass also drafts round 1 and is timed as its drafter step.
Greedy only: sampling keeps to `spec_decode`. Shape names: R rows, B block slots, L cache positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from dflash_train.device_clock import DeviceClock
from dflash_train.draft import masks
from dflash_train.draft.model import DFlashDraftModel
from dflash_train.decode.rounds import decode_rows
from dflash_train.decode.spec_decode import DecodeResult, SpecResult, check_budget
from dflash_train.decode.sampling import emit_tokens
from dflash_train.compiled_steps import prepare_steps
from dflash_train.decode.static_cache import ALIGN, PositionedCache, forward_at, static_cache_problem, write_at
from dflash_train.targets.model import Target

class DraftStaticCache:
    """DraftKVCache's interface over preallocated [R, kv_heads, L, D] buffers written at `positions`."""

    def __init__(self, cfg, rows: int, length: int, dtype: torch.dtype, device: torch.device):
        shape = (rows, cfg.num_key_value_heads, length, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.rows = torch.arange(rows, device=device)[:, None]
        self.positions: torch.Tensor | None = None

    def extend(self, layer: int, k_ctx: torch.Tensor, v_ctx: torch.Tensor):
        write_at(self.k[layer], self.rows, self.positions, k_ctx)
        write_at(self.v[layer], self.rows, self.positions, v_ctx)
        return self.k[layer], self.v[layer]


@dataclass
class Decoded:
    results: list
    """Per prompt: SpecResult (speculative) or DecodeResult (target only); decode_seconds is its group's."""
    decode_seconds: float = 0.0
    """Summed over groups of R rows, after each group's prefill."""
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    bookkeeping_seconds: list[float] = field(default_factory=list)
    """Per round (speculative only): the rest of the round's wall time (acceptance, the host copy of
    the accepted tokens, emission)."""


class StaticDecoder:
    """Greedy decoding of `rows` prompts at a time, speculative (`speculative`) or by the target
    alone (`greedy`), on caches for `max_len` positions (prompt + new tokens). `graphs` (default: on
    a GPU) captures the steps as CUDA graphs, `compile` (default: as graphs) compiles them first."""

    def __init__(self, target: Target, drafter: DFlashDraftModel | None, rows: int, max_len: int,
                 block_size: int | None = None, graphs: bool | None = None, compile: bool | None = None):
        problem = static_cache_problem(target.model)
        if problem:
            raise ValueError(f"no static decoding for {target.name}: {problem}")
        self.target, self.drafter, self.rows, self.max_len = target, drafter, rows, max_len
        self.block_size = b = block_size or (drafter.config.block_size if drafter else 1)
        device, self.dtype = target.device, target.embed_weight.dtype
        self.length = -(-(max_len + b) // ALIGN) * ALIGN  # a clamped row's block ends below max_len + B
        self.cache = PositionedCache(target.model.config.get_text_config(decoder=True), self.length)
        self.cap = torch.zeros(rows, dtype=torch.long, device=device)
        self.offsets = torch.arange(b, device=device)
        self.step_ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.step_pos = torch.zeros(rows, 1, dtype=torch.long, device=device)
        if drafter is not None:
            cfg = drafter.config
            self.layer_ids = cfg.target_layer_ids
            self.draft_len = -(-(self.length + b) // ALIGN) * ALIGN - b  # aligned with the block's keys
            self.draft_cache = DraftStaticCache(cfg, rows, self.draft_len, self.dtype, device)
            self.block_pos = self.offsets.repeat(rows, 1)
            self.ctx_pos = self.block_pos.clone()
            self.draft_ids = torch.full((rows, b), cfg.mask_token_id, dtype=torch.long, device=device)
            self.verify_ids, self.choice = torch.zeros_like(self.draft_ids), torch.zeros_like(self.draft_ids)
            self.feats = torch.zeros(rows, b, len(self.layer_ids) * target.hidden_size, dtype=self.dtype, device=device)
            self.accepted = torch.zeros(rows, b + 1, dtype=torch.long, device=device)
        graphs = device.type == "cuda" if graphs is None else graphs
        self._capture(graphs, graphs if compile is None else compile)

    # --------------------------------------------------------------- the fixed-shape steps

    def _target(self, ids, positions, layer_ids=()):
        """Logits [R, Q, V] of `ids` at `positions`, written into the cache there, and the features
        of `layer_ids` [R, Q, K*H] (None without)."""
        if not layer_ids:
            return forward_at(self.target.model, self.cache, ids, positions).logits, None
        # transformers' own selection, not capture's hooks: a compiled step traces it in one graph
        indices = self.target.hidden_state_indices(layer_ids)
        out = forward_at(self.target.model, self.cache, ids, positions, output_hidden_states=indices)
        return out.logits, torch.cat([out.hidden_states[i] for i in indices], dim=-1)

    def _draft(self, feats, ctx_pos):
        """Proposals for slots 1..B-1 into verify_ids; `feats` at `ctx_pos` join the drafter's cache."""
        self.draft_cache.positions = ctx_pos
        mask = masks.decode_mask(self.block_pos[:, 0], self.draft_len, self.block_size, self.drafter.config.sliding_window)
        embeds = self.target.embed_weight[self.draft_ids]
        hidden = self.drafter(feats, embeds, ctx_pos, self.block_pos, mask=mask, cache=self.draft_cache)
        self.verify_ids[:, 0] = self.draft_ids[:, 0]
        self.verify_ids[:, 1:] = self.drafter.propose_greedy(hidden, self.target.lm_head_weight, self.draft_ids)

    def _draft_step(self):
        self._draft(self.feats, self.ctx_pos)

    def _verify_step(self):
        logits, feats = self._target(self.verify_ids, self.block_pos, self.layer_ids)
        self.choice.copy_(logits.argmax(-1))
        self.feats.copy_(feats)

    def _advance_step(self):
        """Acceptance as spec_decode.accept_greedy, per row; the verified block becomes the next context."""
        n = (self.verify_ids[:, 1:] == self.choice[:, :-1]).long().cumprod(1).sum(1)
        token = self.choice.gather(1, n[:, None])
        self.accepted.copy_(torch.cat([self.verify_ids[:, 1:], token, n[:, None]], dim=1))
        self.ctx_pos.copy_(self.block_pos)
        start = torch.minimum(self.block_pos[:, 0] + n + 1, self.cap)
        self.block_pos.copy_(start[:, None] + self.offsets)
        self.draft_ids[:, :1] = token

    def _target_step(self):
        logits, _ = self._target(self.step_ids, self.step_pos)
        self.step_ids.copy_(logits[:, -1:].argmax(-1))
        self.step_pos.copy_(torch.minimum(self.step_pos + 1, self.cap[:, None]))

    def _capture(self, graphs: bool, compile: bool):
        steps = {"target": self._target_step}
        if self.drafter is not None:
            steps |= {"draft": self._draft_step, "verify": self._verify_step, "advance": self._advance_step}
        with torch.no_grad():
            # allocates the target cache (and, with features, installs transformers' recording hooks
            # eagerly: a compiled step cannot)
            self._prefill([[0]], layer_ids=getattr(self, "layer_ids", ()))
            self.steps = prepare_steps(steps, self.target.device, graphs, compile)

    # --------------------------------------------------------------- decoding

    def _prefill(self, prompts: list[list[int]], layer_ids=()):
        """Rows right-padded (and the batch padded with copies of the last prompt): first tokens [R]
        and the prompts' features [R, P, K*H]. Pad positions get K/V that no later query sees."""
        device = self.target.device
        rows = prompts + [prompts[-1]] * (self.rows - len(prompts))
        width = max(map(len, rows))
        ids = torch.zeros(self.rows, width, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = torch.tensor(row)
        positions = torch.arange(width, device=device).expand(self.rows, -1)
        last = torch.tensor([len(row) - 1 for row in rows], device=device)
        logits, feats = self._target(ids.to(device), positions, layer_ids)
        first = logits[torch.arange(self.rows, device=device), last].argmax(-1)
        return first, feats, positions, last + 1

    def _start(self, prompts, max_new_tokens, layer_ids=()):
        if not 1 <= len(prompts) <= self.rows or min(map(len, prompts)) < 1:
            raise ValueError(f"1..{self.rows} prompts of at least one token each, got {len(prompts)}")
        check_budget(max_new_tokens)
        longest = max(map(len, prompts)) + max_new_tokens
        if longest > self.max_len:
            raise ValueError(f"prompt + max_new_tokens = {longest} exceeds the decoder's max_len {self.max_len}")
        first, feats, positions, lengths = self._prefill(prompts, layer_ids)
        self.cap.copy_(lengths + max_new_tokens)
        return first, feats, positions, lengths

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_new_tokens: int, stop_ids=()) -> Decoded:
        """The target alone, one token per row and step: the baseline of `speculative`."""
        return self._decode(StaticGreedy(self, max_new_tokens, set(stop_ids)), prompts)

    @torch.no_grad()
    def speculative(self, prompts: list[list[int]], max_new_tokens: int, stop_ids=()) -> Decoded:
        """Decisions of `speculative_generate` at temperature 0, for up to R prompts at once."""
        return self._decode(StaticSpeculative(self, max_new_tokens, set(stop_ids)), prompts)

    def _decode(self, rounds, prompts: list[list[int]]) -> Decoded:
        results, seconds = decode_rows(rounds, prompts)
        out = rounds.timing
        out.results, out.decode_seconds = results, seconds
        for res in results:
            res.decode_seconds = seconds
        return out

    def _emit(self, results, new, max_new_tokens, stop_ids) -> set[int]:
        """Appends each row's new tokens (emit_tokens: stops and budget); the rows still decoding."""
        return {r for r, (res, toks) in enumerate(zip(results, new))
                if toks and not emit_tokens(res.tokens, toks, max_new_tokens, stop_ids)}


class _StaticRounds:
    """What the two round decoders on a StaticDecoder share: its caches and steps, the budget and
    stops, `timing`, and the rows still decoding (`active`, the rows `_emit` leaves)."""

    def __init__(self, decoder: StaticDecoder, max_new_tokens: int, stop_ids: set[int]):
        self.decoder, self.device = decoder, decoder.target.device
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids
        self.timing = Decoded([])

    def decoding(self) -> bool:
        return bool(self.active)

    def _first(self, results: list, first: torch.Tensor) -> list[int]:
        """Each row's first token (the prefill's) emitted; the rows it ended."""
        self.results = results
        self.active = self.decoder._emit(results, first[: len(results), None].tolist(), self.max_new_tokens,
                                         self.stop_ids)
        return [r for r in range(len(results)) if r not in self.active]

    def _next(self, new: list[list[int]]) -> list[int]:
        """Each active row's new tokens of a round emitted; the rows they ended."""
        before = self.active
        rows = [new[r] if r in before else [] for r in range(len(self.results))]
        self.active = self.decoder._emit(self.results, rows, self.max_new_tokens, self.stop_ids)
        return sorted(before - self.active)


class StaticGreedy(_StaticRounds):
    """The target alone on a StaticDecoder's caches, one token per row and step (a RoundDecoder:
    decode/rounds.py)."""

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        d = self.decoder
        first, _, _, lengths = d._start(prompts, self.max_new_tokens)
        d.step_ids.copy_(first[:, None])
        d.step_pos.copy_(lengths[:, None])
        return self._first([DecodeResult(tokens=[], decode_seconds=0.0) for _ in prompts], first)

    def step(self) -> list[int]:
        self.decoder.steps.run["target"]()
        return self._next(self.decoder.step_ids.tolist())


class StaticSpeculative(_StaticRounds):
    """Speculative rounds (draft, verify, advance) on a StaticDecoder's caches and steps, with each
    round's time split into `timing` (a RoundDecoder: decode/rounds.py)."""

    def __init__(self, decoder: StaticDecoder, max_new_tokens: int, stop_ids: set[int]):
        super().__init__(decoder, max_new_tokens, stop_ids)
        self.clock = DeviceClock(self.device)

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        d, b = self.decoder, self.decoder.block_size
        first, feats, positions, lengths = d._start(prompts, self.max_new_tokens, d.layer_ids)
        d.block_pos.copy_(lengths[:, None] + d.offsets)
        d.draft_ids.fill_(d.drafter.config.mask_token_id)
        d.draft_ids[:, 0] = first
        self.draft = lambda: d._draft(feats, positions)  # round 1: the drafter's prompt pass
        return self._first([SpecResult(tokens=[], decode_seconds=0.0, block_size=b, position_accepts=[0] * (b - 1))
                            for _ in prompts], first)

    def step(self) -> list[int]:
        d, b, out = self.decoder, self.decoder.block_size, self.timing
        wall, marks = time.perf_counter(), [self.clock.mark()]
        self.draft()
        marks.append(self.clock.mark())
        d.steps.run["verify"]()
        marks.append(self.clock.mark())
        d.steps.run["advance"]()
        accepted = d.accepted.tolist()  # the round's one host sync
        new = []
        for r, row in enumerate(accepted[: len(self.results)]):
            n = row[b]
            if r in self.active:
                self.results[r].acceptance_lengths.append(n + 1)
                for k in range(n):
                    self.results[r].position_accepts[k] += 1
            new.append(row[:n] + [row[b - 1]])
        finished = self._next(new)
        out.draft_seconds.append(self.clock.seconds(marks[0], marks[1]))
        out.verify_seconds.append(self.clock.seconds(marks[1], marks[2]))
        out.bookkeeping_seconds.append(time.perf_counter() - wall - out.draft_seconds[-1] - out.verify_seconds[-1])
        self.draft = d.steps.run["draft"]
        return finished
