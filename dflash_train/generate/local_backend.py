"""In-process generation with transformers: batched, left-padded, greedy or sampled.

For small targets (the SmolLM2 quickstart on CPU) and single-GPU runs without a server, by the
engines of decode/greedy.py.
Concurrent `complete` calls queue up; one worker thread takes whatever is waiting (up to
`batch_size`, same sampling settings) and runs one `model.generate` for all of it, so batches
fill up naturally while the previous one runs. The graphed engine instead keeps `batch_size` rows
decoding and pulls waiting requests into the rows that finish.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
import hashlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from dflash_train.config_model import TargetConfig
from dflash_train.decode.graphed_engine import GraphedEngine, Job, prefill_problem
from dflash_train.decode.greedy import ENGINES, cut_at_stop, engine_problem, generate_ids, pad_token_id
from dflash_train.decode.sampling import GenParams
from dflash_train.generate.backends import Completion, GenerationError
from dflash_train.generate.config import LocalConfig
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
    early = release and (lambda row, ids: release(row, completion(tokenizer, prompts[row], *cut_at_stop(ids, stops))))
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
        if problem := prefill_problem(target.model, cfg.prefill):  # the config allows a prefill for graphed only
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
            if ENGINES[self.engine].serves_queue:
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
