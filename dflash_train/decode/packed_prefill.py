"""The graphed engine's prefills packed: an admission's prompts as one row of tokens, no padding.

The padded prefills (prefill.py) round a group's prompts and width up to powers of two. In the
SmolLM2 chain's regeneration on an H200 they took 54 s of the GPU's 197, a quarter of its time,
for prompts that average 130 tokens (docs/benchmarks/generate_local.md). Here the prompts of an
admission are concatenated, each token at its own position in its own prompt, and the row's length
is rounded up to one of a few sizes (four per octave), each forward captured once as a CUDA graph.
Attention is causal inside each prompt and never crosses one: flash attention over
variable-length sequences (torch.nn.attention.varlen) for half-precision models on CUDA, else SDPA
under the equivalent block-diagonal mask (CPU tests, fp32). Each layer writes its K/V straight
into the engine's cache at (row, position) of its token, so nothing is copied afterwards, and
the last token of each prompt gives that prompt's logits.

Tokens past the prompts (the row's rounding) are attended by nobody; they write their K/V at the
cache's last position of the first prompt's row, above anything that row has seen yet (a stale
K/V there is harmless: static_cache.py says why). Plain causal models whose heads flash attention
takes (`packed_prefill_problem`); the others keep the padded prefills.

With `compile` the forward goes through torch.compile before it is captured: eager, ~60% of the
GPU time of a SmolLM2-shaped prefill on an H200 went to small elementwise kernels (RMSNorm,
rotary, SiLU * mul, casts, the K/V copies), which inductor fuses. The row's length and the longest
prompt are symbolic, so the graphs made in the engine's build (`compile_now`) serve every shape and
no admission waits for a compile; a forward that cannot compile runs uncompiled, the error logged
and kept (`compile_error`). Opt-in (`GraphedEngine(compile_prefill=True)`,
`bench/regen_speed.py --compile-prefill`) until its speed on a GPU is measured.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from dflash_train.checks import compile_cache
from dflash_train.decode.prefill import capture_prefill, to_device
from dflash_train.compiled_steps import compiled
from dflash_train.decode.static_cache import PositionedCache, PositionedLayer, attention_as
from dflash_train.decode.windows import plain_causal_problem

log = logging.getLogger("dflash_train")

PACKED_PREFILL = "dflash_packed_prefill"
PACK_PROMPTS = 128
"""The most prompts one packed prefill takes (its logits are [PACK_PROMPTS, vocab])."""
PACK_TOKENS = 16384
"""The most tokens one packed prefill takes, unless a single prompt is longer."""
MIN_TOKENS = 512
LONGEST_FLOOR = 128
"""The longest prompt is rounded up to a power of two of at least this (flash's block of queries):
the kernel's grid, which has to be fixed in a graph, grows with it."""

_VARLEN = inspect.signature(varlen_attn).parameters
"""Its keywords: GQA and causal windows are spelled differently across torch releases."""


def packed_size(tokens: int) -> int:
    """The row length for `tokens`: rounded up to four steps per octave (at most 25% of it is
    rounding), at least MIN_TOKENS."""
    tokens = max(tokens, MIN_TOKENS)
    step = 1 << max(tokens.bit_length() - 3, 0)
    return -(-tokens // step) * step


def packed_prefill_problem(model, kv_shapes) -> str | None:
    """Why `model`'s prompts cannot be prefilled packed, or None. `kv_shapes`: each layer's key and
    value of one token. Flash attention wants one head size for queries, keys and values, a
    multiple of 8 up to 256 (MLA's values are narrower than its keys)."""
    problem = plain_causal_problem(model)
    if problem:
        return problem
    for key, value in kv_shapes:
        dim = key.shape[-1]
        if value.shape[-1] != dim:
            return f"keys of {dim} and values of {value.shape[-1]} per head (flash attention wants one size)"
        if dim % 8 or dim > 256:
            return f"head size {dim} (flash attention: a multiple of 8 up to 256)"
    return None


@dataclass
class Packing:
    """A packed row's layout, as attention reads it: where each prompt begins (`starts` [P + 1],
    int32: prompt i is tokens starts[i]..starts[i+1]-1, unused ones empty at the end), how long a
    prompt may be (`longest`), each token's prompt (`sequence` [T]: PACK_PROMPTS + 1 for the
    rounding tokens) and position (`positions` [T])."""

    starts: torch.Tensor
    longest: int
    sequence: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor
    """Which tokens are prompts' [T]: written by each forward (inside its graph)."""


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, packing=None, **kwargs):
    """`query` [1, H, T, D] and the row's own `key`/`value` [1, Hkv, T, D]: each token attends to
    the tokens of its own prompt at or before it. Returns [1, T, H, D]."""
    heads, kv_heads = query.shape[1], key.shape[1]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        if "enable_gqa" in _VARLEN:
            gqa = {"enable_gqa": heads != kv_heads}
        else:
            k, v, gqa = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1), {}
        causal = {"window_size": (-1, 0)} if "window_size" in _VARLEN else {"is_causal": True}
        out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), packing.starts, packing.starts,
                          packing.longest, packing.longest, scale=scaling, **causal, **gqa)
        return torch.where(packing.real[:, None, None], out, 0)[None], None  # unwritten rows: not NaN
    same = packing.sequence[:, None] == packing.sequence[None, :]
    visible = same & (packing.positions[None, :] <= packing.positions[:, None])
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling,
                                         enable_gqa=heads != kv_heads)
    return out.transpose(1, 2), None


AttentionInterface.register(PACKED_PREFILL, packed_attention)  # no mask function: transformers builds none


class _ScatterLayer(PositionedLayer):
    """Writes a packed row's K/V into the engine's cache at (rows, positions) of each token and
    hands attention the row's own K/V (a prompt starts at position 0: nothing before it to read)."""

    def update(self, key_states, value_states, *args, **kwargs):
        super().update(key_states, value_states)
        return key_states, value_states


class _Shape:
    """The static inputs and captured forward of one (tokens, longest prompt). Captured on its first
    run, once that run's inputs are in place: the capture's eager warm-ups then write the very K/V
    the replay writes. Until then the inputs are inert (every token a rounding token at the dead
    position of row 0), so no forward of this shape can write where a live row reads."""

    def __init__(self, prefills: PackedPrefills, tokens: int, longest: int):
        self.prefills, self.tokens, self.longest = prefills, tokens, longest
        device = prefills.device
        self.ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
        self.positions = torch.full((1, tokens), prefills.length - 1, dtype=torch.long, device=device)
        self.rows = torch.zeros(1, tokens, dtype=torch.long, device=device)
        self.sequence = torch.full((tokens,), PACK_PROMPTS + 1, dtype=torch.long, device=device)
        self.starts = torch.zeros(PACK_PROMPTS + 1, dtype=torch.int32, device=device)
        self.last = torch.zeros(PACK_PROMPTS, dtype=torch.long, device=device)
        self.real = torch.zeros(tokens, dtype=torch.bool, device=device)
        for tensor, dim in ((self.ids, 1), (self.positions, 1), (self.rows, 1), (self.sequence, 0), (self.real, 0)):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)  # compiled: one graph for every row length
        self.logits = None
        self.graph = None

    def run(self) -> None:
        """The forward over the inputs in place: replayed, captured first when not yet."""
        if self.graph is None and self.prefills.graphs:
            captured = capture_prefill(self.prefills, self.forward, "a packed prefill")
            if captured:
                self.graph, self.logits = captured
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self.forward()

    def forward(self) -> torch.Tensor:
        # the state the forward reads, set here: the function compiled (packed_forward) mutates nothing
        # of Python's, so dynamo guards on no attribute that changes between calls
        torch.le(self.sequence, PACK_PROMPTS, out=self.real)
        for layer in self.prefills.cache.layers:
            layer.rows, layer.positions = self.rows, self.positions
        with attention_as(self.prefills.model, PACKED_PREFILL):  # outside the compiled call (attention_as says why)
            return self.prefills.forward(self.ids, self.positions, self.starts, self.longest, self.sequence,
                                         self.real, self.last)


def packed_forward(model, cache: Cache, ids, positions, starts, longest: int, sequence, real, last) -> torch.Tensor:
    """The model over one packed row (`ids`, `positions` [1, T]; `Packing` says what the rest are),
    its K/V written into `cache` where its layers' rows and positions say; the logits of the tokens
    `last` [PACK_PROMPTS]. `longest` is an argument, not an attribute, so that compiled it turns
    symbolic once it changes: one graph for every longest prompt too."""
    packing = Packing(starts, longest, sequence, positions[0], real)
    out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=last,
                packing=packing)
    return out.logits[0]


class PackedPrefills:
    """`run(prompts, rows)`: prefills `prompts` into the engine cache's `rows` through captured
    packed forwards; returns their last logits [n, V]. `pieces(lengths)` splits an admission into
    the prompts each forward takes."""

    def __init__(self, model, cache: PositionedCache, graphs: bool, compile: bool = False):
        self.model, self.graphs = model, graphs
        self.device = next(model.parameters()).device
        self.cache = Cache(layers=[_ScatterLayer(layer.max_cache_len) for layer in cache.layers])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.hold(theirs.keys, theirs.values)
        self.length = cache.layers[0].max_cache_len
        self.shapes: dict[tuple[int, int], _Shape] = {}
        self.pool = None
        self.graph_error: str | None = None
        self.compiled = None
        self.compile_error: str | None = None
        if compile:
            compile_cache.activate(compile_cache.cache_key())  # the trainer's keyed, durable cache, never /tmp
            self.compiled = compiled(packed_forward, dynamic=None)

    @torch.no_grad()  # as `run` runs it
    def compile_now(self) -> None:
        """The compiled forward made before any admission (the engine's build, as its step is): two
        shapes of inert inputs (every token a rounding token at the dead position), at two longest
        prompts, so that the graph decoding then replays is symbolic in both the row's length and the
        longest prompt, and no admission waits for a compile."""
        if self.compiled is None:
            return
        for longest in (LONGEST_FLOOR, 2 * LONGEST_FLOOR):
            self.shape(MIN_TOKENS, longest).forward()

    def forward(self, *inputs) -> torch.Tensor:
        """`packed_forward` of `inputs` over the engine's cache: compiled where asked and possible."""
        if self.compiled is not None:
            try:
                return self.compiled(self.model, self.cache, *inputs)
            except torch.OutOfMemoryError:
                raise  # the backend's to handle (fewer rows)
            except Exception as e:  # a model dynamo or inductor cannot handle still prefills, uncompiled
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise  # not a compile failure (compile_now compiled it): the capture's, handled there
                self.compiled, self.compile_error = None, f"{type(e).__name__}: {e}"
                log.error("compiling the packed prefill failed (%s); it runs uncompiled", self.compile_error)
        return packed_forward(self.model, self.cache, *inputs)

    @staticmethod
    def pieces(lengths: list[int]) -> list[list[int]]:
        """Consecutive prompts, at most PACK_PROMPTS and PACK_TOKENS tokens a piece (a longer
        prompt goes alone)."""
        out, tokens = [[]], 0
        for i, n in enumerate(lengths):
            if out[-1] and (len(out[-1]) == PACK_PROMPTS or tokens + n > PACK_TOKENS):
                out.append([])
                tokens = 0
            out[-1].append(i)
            tokens += n
        return out

    def shape(self, tokens: int, longest: int) -> _Shape:
        key = (packed_size(tokens), min(max(LONGEST_FLOOR, 1 << (longest - 1).bit_length()), self.length))
        if key not in self.shapes:
            self.shapes[key] = _Shape(self, *key)
        return self.shapes[key]

    @torch.no_grad()  # always: a compiled forward is guarded on the grad mode it was compiled in
    def run(self, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:
        """Prefills `prompts` into `rows` of the engine's cache; their last logits [n, V]."""
        lengths = [len(p) for p in prompts]
        total = sum(lengths)
        shape = self.shape(total, max(lengths))
        n, pad = len(prompts), shape.tokens - total
        counts = torch.tensor(lengths + [pad])
        # one pinned transfer for the row's integers: ids, positions, rows, prompt of each token
        ids = torch.tensor(list(chain.from_iterable(prompts)) + [0] * pad)
        positions = torch.cat([torch.arange(c) for c in lengths] + [torch.full((pad,), self.length - 1)])
        owner = torch.repeat_interleave(torch.arange(n + 1), counts)
        row_of = torch.tensor(rows + [rows[0]])[owner]
        sequence = torch.where(owner < n, owner, PACK_PROMPTS + 1)
        ends = torch.tensor(lengths).cumsum(0)
        starts = torch.full((PACK_PROMPTS + 1,), total)
        starts[0], starts[1:n + 1] = 0, ends
        last = torch.zeros(PACK_PROMPTS, dtype=torch.long)
        last[:n] = ends - 1
        row = to_device(torch.stack([ids, positions, row_of, sequence]), self.device)
        small = to_device(torch.cat([starts, last]), self.device)
        shape.ids[0], shape.positions[0], shape.rows[0], shape.sequence[:] = row
        shape.starts.copy_(small[: PACK_PROMPTS + 1])
        shape.last.copy_(small[PACK_PROMPTS + 1:])
        shape.run()
        return shape.logits[:n]
