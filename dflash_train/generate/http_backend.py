"""OpenAI-compatible chat-completions client for SGLang / vLLM fleets.

One aiohttp session with keep-alive connections, bounded by the run's concurrency. Each request
goes to the server with the fewest requests in flight (slow or overloaded servers get less work)
and a retry moves on to the next one, so a dead server costs time, not rows. Retries use
exponential backoff with full jitter on connection errors, timeouts, 429 and 5xx; other 4xx
(e.g. prompt longer than the context) fail at once: asking again cannot help.
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp

from dflash_train.decode.sampling import GenParams
from dflash_train.generate.backends import Completion, GenerationError
from dflash_train.generate.config import HttpConfig

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


def base_url(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def request_body(model: str, messages: list[dict], params: GenParams) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
        "stream": False,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": params.thinking}
    return body


def parse_completion(data: dict) -> Completion:
    try:
        choice = data["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise GenerationError(f"malformed response: {json.dumps(data)[:200]}") from None
    usage = data.get("usage") or {}
    return Completion(
        text=message.get("content") or "",
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        finish_reason=choice.get("finish_reason") or "stop",
        # SGLang and older vLLM say reasoning_content, newer vLLM says reasoning.
        reasoning=message.get("reasoning_content") or message.get("reasoning"),
    )


class HttpBackend:
    def __init__(self, cfg: HttpConfig, *, model: str | None, max_connections: int):
        self.cfg = cfg
        self.model = model
        self.urls = [base_url(u) for u in cfg.server_urls]
        self.in_flight = dict.fromkeys(self.urls, 0)
        self._turn = 0
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._headers = {"Content-Type": "application/json"}
        if cfg.api_key:
            self._headers["Authorization"] = f"Bearer {cfg.api_key}"

    @property
    def session(self) -> aiohttp.ClientSession:
        # Created on first use: an aiohttp session belongs to the running event loop.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout),
                headers=self._headers,
            )
        return self._session

    def _pick(self, avoid: str | None) -> str:
        """Least busy server, rotating among ties; not the one that just failed if there is another."""
        self._turn += 1
        n = len(self.urls)
        order = [self.urls[(self._turn + i) % n] for i in range(n)]
        if avoid is not None and n > 1:
            order.remove(avoid)
        return min(order, key=self.in_flight.__getitem__)

    def _backoff(self, attempt: int) -> float:
        return random.uniform(0, min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2**attempt))

    async def _send(self, method: str, path: str, payload: bytes | None, only: str | None = None) -> dict:
        """One logical request with retries (to server `only`, else any); returns the JSON body."""
        last_error, failed = "", None
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt - 1))
            url = only or self._pick(avoid=failed)
            self.in_flight[url] += 1
            try:
                async with self.session.request(method, url + path, data=payload) as resp:
                    if resp.status == 200:
                        return await resp.json(content_type=None)
                    text = (await resp.text())[:300]
                    if resp.status not in RETRY_STATUS:
                        raise GenerationError(f"HTTP {resp.status} from {url}: {text}")
                    last_error = f"HTTP {resp.status} from {url}: {text}"
                    retry_after = resp.headers.get("Retry-After", "")
                    if retry_after.isdigit():
                        await asyncio.sleep(min(float(retry_after), self.cfg.backoff_max_s))
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as err:
                kind = "timeout" if isinstance(err, TimeoutError) else type(err).__name__
                last_error = f"{kind} from {url}: {err}".rstrip(": ")
            finally:
                self.in_flight[url] -= 1
            failed = url
        raise GenerationError(f"gave up after {self.cfg.max_retries + 1} attempts: {last_error}")

    async def identity(self) -> dict:
        """Ask every server what it serves: mixing two different targets would poison the data."""
        served = {}
        for url in self.urls:
            data = await self._send("GET", "/v1/models", None, only=url)
            served[url] = sorted(m["id"] for m in data.get("data", []))
        names = {tuple(v) for v in served.values()}
        if self.model is None:
            if len(names) != 1 or len(next(iter(names))) != 1:
                raise ValueError(f"servers do not serve one common model; set `model`. Served: {served}")
            self.model = next(iter(names))[0]
        missing = [u for u, ids in served.items() if ids and self.model not in ids]
        if missing:
            raise ValueError(f"model '{self.model}' is not served by {missing} (they serve {served})")
        return {"backend": "http", "model": self.model, "served_models": served, "chat_template_hash": None}

    async def complete(self, messages: list[dict], params: GenParams) -> Completion:
        payload = json.dumps(request_body(self.model, messages, params)).encode()
        return parse_completion(await self._send("POST", "/v1/chat/completions", payload))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
