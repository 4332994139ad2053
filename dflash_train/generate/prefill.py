"""The graphed engine's prefills at a few fixed shapes, each captured once as a CUDA graph.

An eager prefill of a 30-layer model is about 1,300 kernel launches, and the engine makes one for
every group of waiting prompts it admits: on an H200 regenerating SmolLM2 answers, admissions took
111 s of the host's 169 while the GPU ran dry (docs/benchmarks/generate_local.md). Here a group is
padded to a shape (rows and width, powers of two) whose forward was captured once, so an admission
costs the host a replay and the copy of the new rows' K/V into the engine's cache.

Every shape's small cache is a view of one buffer per layer ([PREFILL_ROWS, heads, cache length,
dim], 1/16 of a 1,024-row cache), and all graphs share one memory pool: replays never overlap,
and each graph's logits are sampled right after its own replay. Padding rows keep whatever an
earlier prefill left (positions a permutation of 0..width-1); their K/V is never copied. A shape
is captured when first needed, a pause of the decoding pipeline while it is (a few dozen shapes
at most per cache length). On CPU (tests), and where a capture fails (logged once),
the same fixed-shape forward runs eagerly.
"""

from __future__ import annotations

import logging

import torch

from dflash_train.targets.static_cache import PositionedCache, capture_graph, forward_at

log = logging.getLogger("dflash_train")

PREFILL_ROWS = 64
"""The most prompts one prefill takes; more are split into several."""
MIN_WIDTH = 64


def bucket(n: int, least: int = 1) -> int:
    """The shape dimension for `n`: the next power of two, at least `least`."""
    return max(least, 1 << (n - 1).bit_length())


class _Shape:
    """The static inputs, cache view and captured forward of one (rows, width)."""

    def __init__(self, prefills: Prefills, rows: int, width: int):
        self.prefills, self.rows, self.width = prefills, rows, width
        device = prefills.device
        self.ids = torch.full((rows, width), prefills.pad_id, dtype=torch.long, device=device)
        self.positions = torch.arange(width, device=device).repeat(rows, 1)
        self.cache = prefills.view(rows, width)
        self.logits = None
        self.run = lambda: setattr(self, "logits", self.forward())
        if prefills.graphs:
            try:
                self.graph, self.logits = capture_graph(self.forward, device, pool=prefills.pool)
            except torch.OutOfMemoryError:
                raise  # the backend's to handle (fewer rows), not a reason to give up graphs
            except Exception as e:  # a forward that cannot be captured still prefills, eagerly
                prefills.graphs = False
                prefills.graph_error = f"{type(e).__name__}: {e}"
                log.error("capturing a prefill failed (%s); prefills run eagerly", prefills.graph_error)
                return
            prefills.pool = prefills.pool or self.graph.pool()
            self.run = self.graph.replay

    def forward(self) -> torch.Tensor:
        return forward_at(self.prefills.model, self.cache, self.ids, self.positions, logits_to_keep=1).logits[:, -1]


class Prefills:
    """`run(ids, positions)`: the last logits of left-padded prompts and the shape whose cache holds
    their K/V at positions 0..width-1, through captured fixed-shape forwards. `kv_shapes`: each
    layer's key and value of one token; `length`: the engine's cache length (the widest shape)."""

    def __init__(self, model, kv_shapes, length: int, pad_id: int, graphs: bool):
        self.model, self.pad_id, self.graphs = model, pad_id, graphs
        self.config = model.config.get_text_config(decoder=True)
        self.device = next(model.parameters()).device
        self.length = length
        self.buffers = [(key.new_zeros(PREFILL_ROWS, key.shape[1], length, key.shape[3]),
                         value.new_zeros(PREFILL_ROWS, value.shape[1], length, value.shape[3])) for key, value in kv_shapes]
        self.shapes: dict[tuple[int, int], _Shape] = {}
        self.pool = None
        self.graph_error: str | None = None

    def view(self, rows: int, width: int) -> PositionedCache:
        """A cache of `rows` x `width` over the shared buffers."""
        cache = PositionedCache(self.config, width)
        for layer, (keys, values) in zip(cache.layers, self.buffers):
            layer.hold(keys[:rows, :, :width], values[:rows, :, :width])
        return cache

    def shape(self, n: int, longest: int) -> _Shape:
        key = (bucket(n), min(bucket(longest, MIN_WIDTH), self.length))
        if key not in self.shapes:
            self.shapes[key] = _Shape(self, *key)
        return self.shapes[key]

    def run(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, _Shape]:
        """Left-padded `ids` and their `positions` [n, width] (on the device): the last logits [n, V]
        and the shape whose cache now holds their K/V in its first n rows."""
        n, width = ids.shape
        shape = self.shape(n, width)
        shape.ids[:n, : shape.width - width] = self.pad_id  # wider shape: more left padding, after the prompt
        shape.ids[:n, shape.width - width:] = ids
        shape.positions[:n, shape.width - width:] = positions
        shape.positions[:n, : shape.width - width] = torch.arange(width, shape.width, device=ids.device)
        shape.run()
        return shape.logits[:n], shape
