"""The graphed engine's padded prefills at a few fixed shapes, each captured once as a CUDA graph:
the prefills of models with sliding windows, sinks or soft-capping, which packed prefills
(packed_prefill.py) do not run, and the engine's choice where asked (`prefill="padded"`).

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
from itertools import chain

import torch

from dflash_train.compiled_steps import capture_graph
from dflash_train.decode.static_cache import PositionedCache, forward_at

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
        if prefills.graphs and (captured := capture_prefill(prefills, self.forward, "a prefill")):
            self.graph, self.logits = captured
            self.run = self.graph.replay

    def forward(self) -> torch.Tensor:
        return forward_at(self.prefills.model, self.cache, self.ids, self.positions, logits_to_keep=1).logits[:, -1]


class Prefills:
    """`run(prompts, rows)`: prefills `prompts` into the engine `cache`'s `rows` through captured
    fixed-shape forwards of left-padded prompts, then copies their K/V over; returns their last
    logits [n, V]. `pieces(lengths)` splits an admission into the prompts each forward takes."""

    def __init__(self, model, cache: PositionedCache, pad_id: int, graphs: bool):
        self.model, self.target, self.pad_id, self.graphs = model, cache, pad_id, graphs
        self.config = model.config.get_text_config(decoder=True)
        self.device = next(model.parameters()).device
        self.length = cache.layers[0].max_cache_len
        self.buffers = [(layer.keys.new_zeros(PREFILL_ROWS, *layer.keys.shape[1:]),
                         layer.values.new_zeros(PREFILL_ROWS, *layer.values.shape[1:])) for layer in cache.layers]
        self.shapes: dict[tuple[int, int], _Shape] = {}
        self.pool = None
        self.graph_error: str | None = None

    @staticmethod
    def pieces(lengths: list[int]) -> list[list[int]]:
        """One forward per width (a power of two: a prompt is padded to at most twice its length,
        where one batch would pad every prompt to the longest), at most PREFILL_ROWS prompts each."""
        groups: dict[int, list[list[int]]] = {}
        for i, n in enumerate(lengths):
            pieces = groups.setdefault(bucket(n, MIN_WIDTH), [[]])
            if len(pieces[-1]) == PREFILL_ROWS:
                pieces.append([])
            pieces[-1].append(i)
        return [piece for _, width_pieces in sorted(groups.items()) for piece in width_pieces]

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

    def run(self, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:
        lengths = torch.tensor([len(p) for p in prompts])
        n, width = len(prompts), int(lengths.max())
        shape = self.shape(n, width)
        # A pad token sits at a position after its prompt (invisible to the prompt's queries,
        # overwritten by the answer), so positions stay per row: prompt 0..len-1 at the right,
        # padding len..width-1 before it. A few whole-batch ops: the host builds these while the GPU waits.
        pad = (shape.width - lengths)[:, None]
        column = torch.arange(shape.width)[None]
        ids = torch.full((n, shape.width), self.pad_id, dtype=torch.long)
        ids[column >= pad] = torch.tensor(list(chain.from_iterable(prompts)), dtype=torch.long)
        positions = (column - pad) % shape.width
        ids, positions = to_device(torch.stack([ids, positions]), self.device)
        index = to_device(torch.tensor(rows), self.device)
        shape.ids[:n], shape.positions[:n] = ids, positions
        shape.run()
        for layer, fresh in zip(self.target.layers, shape.cache.layers):
            layer.keys[index, :, : shape.width] = fresh.keys[:n]
            layer.values[index, :, : shape.width] = fresh.values[:n]
        return shape.logits[:n]


def capture_prefill(prefills, forward, what: str):
    """`forward` captured as a CUDA graph in the memory pool all of `prefills`' shapes share:
    (graph, its static output). None where it cannot be captured: logged once, and `prefills`
    captures nothing more (its forwards run eagerly)."""
    try:
        graph, output = capture_graph(forward, prefills.device, pool=prefills.pool)
    except torch.OutOfMemoryError:
        raise  # the backend's to handle (fewer rows), not a reason to give up graphs
    except Exception as e:  # a forward that cannot be captured still prefills, eagerly
        prefills.graphs = False
        prefills.graph_error = f"{type(e).__name__}: {e}"
        log.error("capturing %s failed (%s); prefills run eagerly", what, prefills.graph_error)
        return None
    prefills.pool = prefills.pool or graph.pool()
    return graph, output


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the GPU without the host waiting for it: through pinned memory,
    stream-ordered (a plain copy would wait for the chunk of steps in flight)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
