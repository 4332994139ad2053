"""Fixed-shape steps made fast: compiled with torch.compile, captured as CUDA graphs and replayed.

Used by every part that repeats one step of fixed shapes: the decoders' steps (decode/), the training
step (train/step_graph.py) and the target's compiled decoder layers (targets/model.py). A step that
cannot be compiled or captured still runs, plainly, with the reason logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.utils import output_capturing

from dflash_train.checks import compile_cache

log = logging.getLogger("dflash_train")


def graphed(step, device: torch.device):
    """`step` captured as a CUDA graph; returns its replay."""
    return capture_graph(step, device)[0].replay


def capture_graph(step, device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """`step` captured as a CUDA graph, after two eager runs on a side stream (cuBLAS workspaces,
    compiled code's first calls: nothing may compile or allocate host memory inside a capture).
    Returns the graph and what the captured call returned: its static outputs, rewritten by each
    replay. `pool`: another graph's memory pool to share (`graph.pool()`)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = step()
    return graph, outputs


RECOMPILE_LIMIT = 64
"""Compiled versions of one step's code: its code object is shared by every decoder of a process
(each a few shapes; an engine adds one each time its cache grows), past dynamo's default of 8."""


def raising_past_recompile_limit():
    """Within the block, a compiled function past RECOMPILE_LIMIT versions raises: dynamo's default
    is to run it eagerly from then on, without a word."""
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True)


def compiled(step: Callable[..., object], dynamic: bool | None = False) -> Callable[..., object]:
    """`step` through torch.compile: inductor fuses the eager forward's ~35 small kernels a layer
    (RMSNorm, rotary, SiLU * mul, residual adds, casts, the mask) into a few, which is what a CUDA
    graph of the step then replays. Default mode, not reduce-overhead: `graphed` captures the graph.
    One graph or an error (fullgraph); fixed shapes, or (`dynamic=None`) dims that change between
    calls, or that the caller marks, made symbolic. Past the recompile limit dynamo would quietly
    run the step eagerly: here it raises instead. Random ops keep eager's generator (fallback_random),
    so a compiled step samples as the plain one does."""
    fn = torch.compile(step, fullgraph=True, dynamic=dynamic, options={"fallback_random": True})

    def run(*args):
        try:
            with raising_past_recompile_limit():
                return fn(*args)
        finally:  # a step that fails to compile falls back to eager: that must find the collector idle too
            _end_output_capture()

    return run


def _end_output_capture() -> None:
    """Switch transformers' output collector back to its per-context state after a compiled step.
    While dynamo traces a forward the collector keeps its outputs in a process-wide global
    (`output_capturing.CompileableContextVar`). A compiled step with flex_attention inside (flex
    decoding) leaves that mode on: dynamo keeps an attribute as it was set before the flex call, not as
    the function left it (torch 2.13; the SDPA step does not;
    tests/decode/test_flex_decode.py::test_a_compiled_flex_call_leaves_no_mid_function_state).
    Every later eager forward then recorded its hidden states into a stale dict:
    `output_hidden_states` came back empty. Newer transformers may drop the name: then nothing to do."""
    collector = getattr(output_capturing, "_active_collector", None)
    if getattr(collector, "compiling", False):
        collector.reset(None)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


@dataclass
class Steps:
    """Fixed-shape steps as they run: `run[name]()`, compiled and/or replayed as CUDA graphs."""

    run: dict[str, Callable[[], object]]
    compiled: list[str] = field(default_factory=list)
    """The steps that run compiled."""
    graphed: bool = False
    compile_error: str | None = None
    graph_error: str | None = None


def prepare_steps(steps: dict[str, Callable[[], object]], device: torch.device, graphs: bool,
                  compile: bool) -> Steps:
    """Each step compiled (run once here, so a failure falls back now, not mid-decode: that step
    stays plain, the error logged) and then all captured as CUDA graphs; a capture that fails is
    tried again with the plain steps, then they run eagerly. The steps run a few times here: they
    must only touch state that decoding resets."""
    out = Steps(dict(steps))
    if compile:
        compile_cache.activate(compile_cache.cache_key())  # the trainer's keyed, durable cache, never /tmp
        errors = []
        for name, step in steps.items():
            try:
                fn = compiled(step)
                fn()
                out.run[name] = fn
                out.compiled.append(name)
            except Exception as e:  # a model dynamo or inductor cannot handle still decodes, uncompiled
                errors.append(f"{name}: {_error(e)}")
                log.error("compiling the %s step failed (%s); it runs uncompiled", name, errors[-1])
        out.compile_error = "; ".join(errors) or None
    if graphs:
        _capture(out, steps, device)
    return out


def _capture(out: Steps, plain: dict, device: torch.device) -> None:
    """`out.run` captured as CUDA graphs; else `plain` captured; else `plain` eagerly."""
    for run in [out.run, plain] if out.compiled else [plain]:
        try:
            out.run = {name: graphed(step, device) for name, step in run.items()}
            out.graphed = True
            return
        except Exception as e:  # a model whose forward cannot be captured still decodes, eagerly
            if run is plain:
                out.graph_error = _error(e)
                log.error("CUDA graph capture failed (%s); decoding eagerly", out.graph_error)
            else:
                out.compile_error = f"CUDA graph capture of the compiled steps: {_error(e)}"
                log.error("%s; capturing the uncompiled steps", out.compile_error)
                out.compiled = []
    out.run = dict(plain)
