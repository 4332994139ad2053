"""In-process generation with transformers: batched, left-padded, greedy or sampled.

For small targets (the SmolLM2 quickstart on CPU) and single-GPU runs without a server. Four
engines: one left-padded `generate` per batch with a dynamic cache (`padded`) or a preallocated
static cache whose decode step transformers compiles into CUDA graphs on a GPU (`static`),
transformers' continuous batching, or ours (`graphed`: generate/graphed_engine.py).
Concurrent `complete` calls queue up; one worker thread takes whatever is waiting (up to
`batch_size`, same sampling settings) and runs one `model.generate` for all of it, so batches
fill up naturally while the previous one runs. The graphed engine instead keeps `batch_size` rows
decoding and pulls waiting requests into the rows that finish.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
import hashlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from dflash_train.config import TargetConfig
from dflash_train.generate.backends import Completion, GenerationError, GenParams
from dflash_train.generate.config import LocalConfig
from dflash_train.generate.graphed_engine import GraphedEngine, Job, prefill_problem
from dflash_train.targets.static_cache import static_cache_problem
from dflash_train.targets.model import load_target, resolve_device

log = logging.getLogger("dflash_train")


def chat_template_hash(tokenizer) -> str | None:
    template = tokenizer.chat_template
    return hashlib.sha256(template.encode()).hexdigest()[:16] if isinstance(template, str) else None


def stop_ids(model, tokenizer) -> set[int]:
    """The chat end-of-turn token and the model's own eos ids (the generation config may list several)."""
    ids = {tokenizer.eos_token_id}
    configured = model.generation_config.eos_token_id
    ids.update(configured if isinstance(configured, list) else [configured])
    ids.discard(None)
    return ids


def encode_prompt(tokenizer, messages: list[dict], thinking: bool | None) -> list[int]:
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def fit_context(prompt: list[int], params: GenParams, config) -> GenParams:
    """A prompt the target's context cannot hold is this row's error (as a server answers it); an
    answer is cut where the context ends, counted as truncated like one cut at max_tokens."""
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    if context is None:
        return params
    if len(prompt) >= context:
        raise GenerationError(f"the prompt is {len(prompt):,} tokens, over the target's context of {context:,} "
                              "positions (max_position_embeddings)")
    return replace(params, max_tokens=min(params.max_tokens, context - len(prompt)))


def pad_token_id(tokenizer, stops) -> int:
    """The tokenizer's pad id, else the smallest stop id, else 0: left or right padding that no
    real token attends to, so any id serves."""
    return next((t for t in (tokenizer.pad_token_id, *sorted(stops)) if t is not None), 0)


def _cut_at_stop(ids: list[int], stops: set[int]) -> tuple[list[int], bool]:
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


def engine_problem(engine: str, model) -> str | None:
    """Why `engine` cannot run `model` (said before any request is queued), or None."""
    if engine == "graphed":
        problem = static_cache_problem(model)
        return problem and f"{problem} (use --engine padded or static)"
    config = model.config.get_text_config(decoder=True)
    if engine == "continuous" and getattr(config, "kv_lora_rank", None):
        # transformers' paged cache holds keys and values of one head size; MLA's differ
        return "multi-head latent attention (kv_lora_rank) has no paged cache in transformers' continuous " \
               "batching (use --engine padded, static or graphed)"
    return None


def graphed_generate(model, prompts: list[list[int]], params: GenParams, stops: set[int], pad_id: int,
                      rows: int | None = None) -> list[tuple[list[int], bool]]:
    jobs = [Job(p, params.max_tokens, params.temperature) for p in prompts]
    waiting = deque(jobs)
    engine = GraphedEngine(model, rows or len(prompts), stops, pad_id)
    engine.serve(lambda n: [waiting.popleft() for _ in range(min(n, len(waiting)))], lambda job: None)
    return [(job.tokens, job.stopped) for job in jobs]


@torch.no_grad()
def generate_ids(model, prompts: list[list[int]], params: GenParams, stops: set[int], pad_id: int,
                 engine: str = "padded", release: Callable[[int, list[int]], None] | None = None
                 ) -> list[tuple[list[int], bool]]:
    """Per token-id prompt: (new token ids cut after the first stop token, whether one ended them).
    `release(row, ids)`: each row that stops, as soon as it does (padded and static engines)."""
    if params.temperature > 0 and params.seed is not None:
        torch.manual_seed(params.seed)
    if engine == "graphed":
        return graphed_generate(model, prompts, params, stops, pad_id)
    run = {"padded": _padded_generate, "static": _static_generate, "continuous": _continuous_generate}[engine]
    with _plain_distribution(model):
        answers = run(model, prompts, _generation_config(params, stops, pad_id), release)
    return [_cut_at_stop(ids, stops) for ids in answers]


def completion(tokenizer, prompt: list[int], new: list[int], stopped: bool) -> Completion:
    return Completion(
        text=tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False),
        prompt_tokens=len(prompt),
        completion_tokens=len(new),
        finish_reason="stop" if stopped else "length",
    )


def generate_batch(model, tokenizer, prompts: list[list[int]], params: GenParams, engine: str = "padded",
                   release: Callable[[int, Completion], None] | None = None) -> list[Completion]:
    """Answer token-id prompts in one `generate` (padded) or `generate_batch` (continuous) call;
    `release(row, completion)` for each row as soon as it stops (see generate_ids)."""
    stops = stop_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, stops)
    early = release and (lambda row, ids: release(row, completion(tokenizer, prompts[row], *_cut_at_stop(ids, stops))))
    return [completion(tokenizer, prompt, new, stopped) for (new, stopped), prompt
            in zip(generate_ids(model, prompts, params, stops, pad_id, engine, early), prompts)]


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


@dataclass
class _Request:
    prompt: list[int]
    params: GenParams
    future: asyncio.Future = field(repr=False)


class LocalBackend:
    def __init__(self, model, tokenizer, *, name: str, batch_size: int, identity: dict | None = None,
                 engine: str = "padded", compile_step: bool = False, prefill: str = "auto"):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.batch_size = batch_size
        self.engine = engine
        self.compile_step = compile_step
        self.prefill = prefill
        self._target_identity = identity or {}
        self._queue: deque[_Request] = deque()
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        # One thread runs the model, always the same one: compiled CUDA graphs (static engine) are
        # recorded per thread, and a pool would hand batches to whichever thread is free.
        self._model_thread: ThreadPoolExecutor | None = None
        self._graphed: GraphedEngine | None = None

    @classmethod
    def load(cls, path: str, cfg: LocalConfig) -> LocalBackend:
        target = load_target(TargetConfig(path=path, dtype=cfg.dtype), resolve_device(cfg.device))
        if (problem := engine_problem(cfg.engine, target.model)) is not None:
            raise ValueError(f"generate engine '{cfg.engine}' cannot run {type(target.model).__name__}: {problem}")
        if cfg.engine == "graphed" and (problem := prefill_problem(target.model, cfg.prefill)):
            raise ValueError(f"local.prefill: {problem}")
        return cls(target.model, target.tokenizer, name=path, batch_size=cfg.batch_size, identity=target.identity,
                   engine=cfg.engine, compile_step=cfg.compile_step, prefill=cfg.prefill)

    async def identity(self) -> dict:
        return {
            "backend": "local",
            "model": self.name,
            "target": self._target_identity,
            "chat_template_hash": chat_template_hash(self.tokenizer),
        }

    async def complete(self, messages: list[dict], params: GenParams) -> Completion:
        if self._worker is None:
            self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-generate")
            self._wake = asyncio.Event()
            self._worker = asyncio.create_task(self._run())
        prompt = encode_prompt(self.tokenizer, messages, params.thinking)
        params = fit_context(prompt, params, self.model.config)
        request = _Request(prompt, params, asyncio.get_running_loop().create_future())
        self._queue.append(request)
        self._wake.set()
        return await request.future

    def _take_batch(self) -> list[_Request]:
        """Oldest request plus waiting ones with the same sampling settings, up to batch_size."""
        key = self._queue[0].params.batch_key()
        batch = [r for r in self._queue if r.params.batch_key() == key][: self.batch_size]
        for r in batch:
            self._queue.remove(r)
        return batch

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.engine == "graphed":
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._model_thread, self._serve_graphed, loop)
                continue
            while self._queue:
                batch = self._take_batch()
                prompts = [r.prompt for r in batch]
                loop = asyncio.get_running_loop()

                def release(row: int, result: Completion, batch=batch, loop=loop) -> None:
                    loop.call_soon_threadsafe(_resolve, batch[row].future, result)

                try:
                    # A thread keeps the event loop (HTTP server, writer) responsive during generate.
                    results = await loop.run_in_executor(
                        self._model_thread, self._generate_fitting, prompts, batch[0].params, release)
                except Exception as err:  # noqa: BLE001 -- a bug or OOM must reach the callers, not kill the worker
                    for r in batch:
                        _fail(r.future, err)
                    continue
                for r, result in zip(batch, results):
                    _resolve(r.future, result)

    def _serve_graphed(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs the graphed engine (in the model thread) until the queue is empty; answers reach
        their callers as each one finishes. On CUDA out-of-memory the rows halve and the answers
        in flight start again."""
        stops = stop_ids(self.model, self.tokenizer)
        inflight: dict[int, _Request] = {}

        def take(n: int) -> list[Job]:
            jobs = []
            while self._queue and len(jobs) < n:
                r = self._queue.popleft()  # deque pops are atomic: the event loop appends meanwhile
                if r.params.top_p < 1:
                    loop.call_soon_threadsafe(_fail, r.future, ValueError(
                        f"engine 'graphed' does not do top-p (top_p {r.params.top_p}): use padded, static or continuous"))
                    continue
                if r.params.temperature > 0 and r.params.seed is not None and not inflight and not jobs:
                    torch.manual_seed(r.params.seed)  # like the padded engine: reproducible per run, not per request
                inflight[id(r)] = r
                jobs.append(Job(r.prompt, r.params.max_tokens, r.params.temperature, tag=r))
            return jobs

        def answer(r: _Request, job: Job) -> None:
            try:
                _resolve(r.future, completion(self.tokenizer, r.prompt, job.tokens, job.stopped))
            except Exception as err:  # noqa: BLE001 -- a callback's error would only be logged: the caller must see it
                _fail(r.future, err)

        def give(job: Job) -> None:  # decoded to text in the event loop: the engine's thread goes on decoding
            loop.call_soon_threadsafe(answer, inflight.pop(id(job.tag)), job)

        try:
            if self._graphed is None:
                self._graphed = GraphedEngine(self.model, self.batch_size, stops, pad_token_id(self.tokenizer, stops),
                                             compile=self.compile_step, prefill=self.prefill)
            self._graphed.serve(take, give)
            return
        except torch.OutOfMemoryError as err:
            if self.batch_size == 1:
                self._fail_all(loop, inflight, err)
                return
        except Exception as err:  # noqa: BLE001 -- a bug must reach the callers, not kill the worker
            # the waiting requests too: an engine that cannot start (a model it refuses) serves none
            inflight.update((id(r), r) for r in self._queue)
            self._queue.clear()
            self._fail_all(loop, inflight, err)
            self._graphed = None
            return
        self._graphed = None  # out of the except block: its traceback no longer pins the engine's memory
        torch.cuda.empty_cache()
        self.batch_size = (self.batch_size + 1) // 2
        log.warning("out of GPU memory in the graphed engine: %d rows now; %d answers start again",
                    self.batch_size, len(inflight))
        self._queue.extendleft(reversed(list(inflight.values())))
        loop.call_soon_threadsafe(self._wake.set)

    @staticmethod
    def _fail_all(loop, inflight: dict, err: Exception) -> None:
        for r in inflight.values():
            loop.call_soon_threadsafe(_fail, r.future, err)
        inflight.clear()

    def _generate_fitting(self, prompts: list[list[int]], params: GenParams, release) -> list[Completion]:
        """generate_batch, halving the batch on CUDA out-of-memory (and keeping the smaller size for
        later batches): the size that fits depends on the longest prompts, which no one knows ahead."""
        try:
            return generate_batch(self.model, self.tokenizer, prompts, params, self.engine, release)
        except torch.OutOfMemoryError:
            if len(prompts) == 1:
                raise
        # Out of the except block: its traceback no longer pins the failed batch's activations.
        torch.cuda.empty_cache()
        half = (len(prompts) + 1) // 2
        if half < self.batch_size:
            self.batch_size = half
            log.warning("out of GPU memory generating %d prompts at once: generation batch size now %d",
                        len(prompts), half)
        return (self._generate_fitting(prompts[:half], params, release)
                + self._generate_fitting(prompts[half:], params, lambda row, c: release(half + row, c)))

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
            self._model_thread.shutdown(wait=True)
