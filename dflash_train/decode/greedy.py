"""The target alone, one batch of token-id prompts at a time: greedy or sampled answers from its plain
next-token distribution, by one of four engines. `padded`: one left-padded transformers `generate`
with a dynamic cache; `static`: a preallocated static cache, whose decode step transformers compiles
into CUDA graphs on a GPU; `continuous`: transformers' continuous batching; `graphed`: ours
(decode/graphed_engine.py). Every engine answers alike in fp32 (tests/test_families.py). `generate`
serves prompts with them (generate/local_backend.py); `eval` checks speculative decoding against them.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from dflash_train.decode.graphed_engine import GraphedEngine, Job
from dflash_train.decode.sampling import GenParams
from dflash_train.decode.static_cache import static_cache_problem


def pad_token_id(tokenizer, stops) -> int:
    """The tokenizer's pad id, else the smallest stop id, else 0: left or right padding that no
    real token attends to, so any id serves."""
    return next((t for t in (tokenizer.pad_token_id, *sorted(stops)) if t is not None), 0)


def cut_at_stop(ids: list[int], stops: set[int]) -> tuple[list[int], bool]:
    """New tokens up to and including the first stop token; whether one ended them."""
    end = next((i for i, t in enumerate(ids) if t in stops), None)
    return (ids, False) if end is None else (ids[: end + 1], True)


def _generation_config(params: GenParams, stops: set[int], pad_id: int) -> GenerationConfig:
    # Sampling flags only when sampling: transformers warns on every greedy call that sets any of them
    # ("generation flags are not valid ... ['top_k']").
    sampling = {}
    if params.temperature > 0:
        # top_k off: an unset top_k would be filled with transformers' default of 50
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
    return GenerationConfig(
        max_new_tokens=params.max_tokens,
        do_sample=bool(sampling),
        eos_token_id=sorted(stops) or None,
        pad_token_id=pad_id,
        **sampling,
    )


@contextlib.contextmanager
def _plain_distribution(model):
    """transformers fills every field a generation config leaves unset from the model's own
    (repetition penalties, n-gram bans, top_k...). Answers here come from the model's plain next-token
    distribution, argmax at temperature 0: what speculative decoding verifies against."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


STATIC_WIDTH_STEP = 128
"""On a GPU the static engine pads prompts to a multiple of this: the cache length (prompt width + new
tokens) then takes a few values, and each compiled decode graph is reused across batches. On CPU
transformers compiles nothing, and the padding was only prefill work: a batch of prompts of 92
tokens or fewer ran 128 wide, 40% more."""


class ReleaseFinished(StoppingCriteria):
    """Hands each row's answer on (`release(row, new token ids)`) as soon as it ends with a stop token,
    while the batch decodes on: a slow batch's finished rows reach generate's commit clock without
    waiting for its longest row. Stops nothing itself."""

    def __init__(self, width: int, stops: set[int], release: Callable[[int, list[int]], None]):
        self.width, self.stops, self.release, self.done = width, stops, release, set()

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        for row, token in enumerate(input_ids[:, -1].tolist()):  # transformers reads a flag per step too
            if token in self.stops and row not in self.done:
                self.done.add(row)
                self.release(row, input_ids[row, self.width:].tolist())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _static_generate(model, prompts: list[list[int]], gen: GenerationConfig, release=None) -> list[list[int]]:
    """`_padded_generate` with a preallocated KV cache: a dynamic cache grows by concatenation, copying
    every layer's whole cache at each new token (quadratic in the answer length at large batches);
    a static one is written in place, and on a GPU transformers captures its decode step as a graph."""
    width = max(map(len, prompts))
    if model.device.type != "cpu":
        width = -(-width // STATIC_WIDTH_STEP) * STATIC_WIDTH_STEP
    static = gen.to_dict() | {"cache_implementation": "static"}
    return _padded_generate(model, prompts, GenerationConfig(**static), release, width)


def _padded_generate(model, prompts: list[list[int]], gen: GenerationConfig, release=None,
                     width: int | None = None) -> list[list[int]]:
    device = next(model.parameters()).device
    width = width or max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), gen.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    stopping = None
    if release is not None and gen.eos_token_id:
        stopping = StoppingCriteriaList([ReleaseFinished(width, set(gen.eos_token_id), release)])
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=gen,
                         stopping_criteria=stopping)
    return out[:, width:].tolist()


CPU_PAGE = 256
"""Tokens a KV-cache page holds in continuous batching on CPU (transformers' default page)."""


def _cpu_cache_config(model, prompts: list[list[int]], gen: GenerationConfig):
    """On CPU, pages for exactly these prompts and answers: left to itself, continuous batching
    reserves a fraction of all free RAM for its cache (13 GB for a tiny test model on a 23 GB
    machine, enough for the OOM killer), as on a GPU it takes a fraction of device memory."""
    if model.device.type != "cpu":
        return None
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:  # older transformers: no such config, its own sizing
        return None
    pages = sum(-(-(len(p) + gen.max_new_tokens) // CPU_PAGE) for p in prompts)
    return ContinuousBatchingConfig(page_size=CPU_PAGE, num_blocks=pages + 1)


def _continuous_generate(model, prompts: list[list[int]], gen: GenerationConfig, release=None) -> list[list[int]]:
    results = list(model.generate_batch(prompts, generation_config=gen, progress_bar=False,
                                        continuous_batching_config=_cpu_cache_config(model, prompts, gen)).values())
    # generate_batch logs failed or lost requests instead of raising: a missing answer must not
    # pass for an empty one.
    failed = [(i, r.error) for i, r in enumerate(results) if r.error is not None]
    if len(results) != len(prompts) or failed:
        raise RuntimeError(
            f"continuous batching answered {len(results)} of {len(prompts)} prompts; failed: {failed[:3]}"
        )
    return [r.generated_tokens for r in results]


def _graphed_problem(model) -> str | None:
    problem = static_cache_problem(model)
    return problem and f"{problem} (use --engine padded or static)"


def _continuous_problem(model) -> str | None:
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "kv_lora_rank", None):
        # transformers' paged cache holds keys and values of one head size; MLA's differ
        return "multi-head latent attention (kv_lora_rank) has no paged cache in transformers' continuous " \
               "batching (use --engine padded, static or graphed)"
    return None


def graphed_generate(model, prompts: list[list[int]], params: GenParams, stops: set[int], pad_id: int,
                     release: Callable[[int, list[int]], None] | None = None, rows: int | None = None
                     ) -> list[tuple[list[int], bool]]:
    jobs = [Job(p, params.max_tokens, params.temperature, tag=i) for i, p in enumerate(prompts)]
    waiting = deque(jobs)
    engine = GraphedEngine(model, rows or len(prompts), stops, pad_id)

    def give(job: Job) -> None:
        if release is not None and job.stopped:
            release(job.tag, list(job.tokens))

    engine.serve(lambda n: [waiting.popleft() for _ in range(min(n, len(waiting)))], give)
    return [(job.tokens, job.stopped) for job in jobs]


def _through_transformers(run):
    """A transformers-driven engine (`run(model, prompts, generation_config, release)` -> new ids per
    prompt) with the plain distribution and the answers cut after their first stop token."""
    def decode(model, prompts, params, stops, pad_id, release=None):
        with _plain_distribution(model):
            answers = run(model, prompts, _generation_config(params, stops, pad_id), release)
        return [cut_at_stop(ids, stops) for ids in answers]
    return decode


@dataclass(frozen=True)
class GreedyEngine:
    """One way to answer a batch of token-id prompts with the target alone."""

    decode: Callable[..., list[tuple[list[int], bool]]]
    """(model, prompts, params, stops, pad_id, release) -> per prompt (new ids cut after the first stop
    token, whether one ended them); `release(row, ids)` as each row stops, where the engine can."""
    problem: Callable[[object], str | None] = lambda model: None
    """Why it cannot run `model` (said before any request is queued), or None."""
    serves_queue: bool = False
    """It keeps its rows decoding and admits waiting prompts into the rows others leave: a server runs
    it on its request queue (GraphedEngine.serve), not batch by batch through `decode`."""


ENGINES: dict[str, GreedyEngine] = {
    "padded": GreedyEngine(_through_transformers(_padded_generate)),
    "static": GreedyEngine(_through_transformers(_static_generate)),
    "continuous": GreedyEngine(_through_transformers(_continuous_generate), _continuous_problem),
    "graphed": GreedyEngine(graphed_generate, _graphed_problem, serves_queue=True),
}
"""The engines by the name `generate --engine` takes (GenerateConfig's `local.engine`)."""


def engine_problem(engine: str, model) -> str | None:
    """Why `engine` cannot run `model` (said before any request is queued), or None."""
    return ENGINES[engine].problem(model)


@torch.no_grad()
def generate_ids(model, prompts: list[list[int]], params: GenParams, stops: set[int], pad_id: int,
                 engine: str = "padded", release: Callable[[int, list[int]], None] | None = None
                 ) -> list[tuple[list[int], bool]]:
    """Per token-id prompt: (new token ids cut after the first stop token, whether one ended them).
    `release(row, ids)`: each row that stops, as soon as it does (every engine but continuous)."""
    if params.temperature > 0 and params.seed is not None:
        torch.manual_seed(params.seed)
    return ENGINES[engine].decode(model, prompts, params, stops, pad_id, release)
