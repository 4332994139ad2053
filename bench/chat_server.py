"""A small OpenAI-compatible chat-completions server (non-streaming) for local work and tests.

    python bench/chat_server.py --model smollm2            # the in-process backend over HTTP
    python bench/chat_server.py --echo --fail-every 7      # deterministic echo + fault injection

It prints `READY <url>` once listening (port 0 picks a free one). The echo responder answers with
a hash of the whole conversation it was sent, so a client can check exactly what each request
contained. Faults (500s, dropped connections, stalls) are for exercising clients; they are off
unless asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from dataclasses import dataclass

from aiohttp import web

from dflash_train.decode.sampling import GenParams
from dflash_train.generate.backends import Completion


def echo_answer(messages: list[dict]) -> str:
    """`echo <hash of the conversation> <start of the last user turn>`."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:12]
    last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    return f"echo {digest} {' '.join(last_user.split()[:8])}"


class EchoResponder:
    """Answers instantly with `echo_answer`; word counts stand in for tokens. Asked to think
    (`enable_thinking: true`), it also returns a thinking text apart, as a server with a reasoning
    parser does (`reasoning_content`)."""

    name = "echo"

    async def complete(self, messages: list[dict], params: GenParams) -> Completion:
        words = echo_answer(messages).split()
        cut = len(words) > params.max_tokens
        return Completion(
            text=" ".join(words[: params.max_tokens]),
            prompt_tokens=sum(len(m["content"].split()) for m in messages),
            completion_tokens=min(len(words), params.max_tokens),
            finish_reason="length" if cut else "stop",
            reasoning=f"The user wrote {len(messages[-1]['content'].split())} words." if params.thinking else None,
        )


@dataclass
class FaultPlan:
    """Every Nth chat request fails / loses its connection / stalls (0 = never)."""

    fail_every: int = 0
    drop_every: int = 0
    stall_every: int = 0
    stall_s: float = 0.0
    fail_marker: str | None = None
    """A request whose last message contains this always gets a 500."""


def parse_request(body: dict) -> tuple[list[dict], GenParams]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(
            m.get("content"), str
        ):
            raise ValueError(f"bad message {str(m)[:80]}")
    kwargs = body.get("chat_template_kwargs") or {}
    params = GenParams(
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)),
        max_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 256),
        thinking=kwargs.get("enable_thinking"),
        seed=body.get("seed"),
    )
    return [{"role": m["role"], "content": m["content"]} for m in messages], params


def make_app(responder, *, model_name: str, faults: FaultPlan | None = None) -> web.Application:
    faults = faults or FaultPlan()
    counters = {"requests": 0, "failed": 0, "dropped": 0, "stalled": 0}

    async def chat(request: web.Request) -> web.StreamResponse:
        counters["requests"] += 1
        n = counters["requests"]
        try:
            messages, params = parse_request(await request.json())
        except (ValueError, TypeError, json.JSONDecodeError) as err:
            return web.json_response({"error": {"message": str(err), "type": "invalid_request"}}, status=400)
        marked = faults.fail_marker is not None and faults.fail_marker in messages[-1]["content"]
        if marked or (faults.fail_every and n % faults.fail_every == 0):
            counters["failed"] += 1
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        if faults.drop_every and n % faults.drop_every == 0:
            counters["dropped"] += 1
            request.transport.abort()  # the client sees the connection die mid-request
            return web.Response()
        if faults.stall_every and n % faults.stall_every == 0:
            counters["stalled"] += 1
            await asyncio.sleep(faults.stall_s)
        answer = await responder.complete(messages, params)
        message = {"role": "assistant", "content": answer.text}
        if answer.reasoning is not None:
            message["reasoning_content"] = answer.reasoning
        return web.json_response(
            {
                "id": f"chatcmpl-{n}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": answer.finish_reason}],
                "usage": {
                    "prompt_tokens": answer.prompt_tokens,
                    "completion_tokens": answer.completion_tokens,
                    "total_tokens": answer.prompt_tokens + answer.completion_tokens,
                },
            }
        )

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model_name, "object": "model"}]})

    async def stats(_request: web.Request) -> web.Response:
        return web.json_response(counters)

    app = web.Application(client_max_size=64 << 20)
    app.add_routes(
        [
            web.post("/v1/chat/completions", chat),
            web.get("/v1/models", models),
            web.get("/health", lambda _r: web.Response(text="ok")),
            web.get("/stats", stats),
        ]
    )
    return app


async def serve(app: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)  # per-request logging would halve throughput
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"READY http://{host}:{bound}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="target path for the in-process backend (e.g. smollm2)")
    what.add_argument("--echo", action="store_true", help="deterministic echo responder, no model")
    p.add_argument("--served-name", help="model id reported by /v1/models (default: --model or 'echo')")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--drop-every", type=int, default=0)
    p.add_argument("--stall-every", type=int, default=0)
    p.add_argument("--stall-s", type=float, default=0.0)
    p.add_argument("--fail-marker")
    args = p.parse_args(argv)
    if args.echo:
        responder = EchoResponder()
    else:  # torch and transformers only when a model is served: the echo server starts in ~0.3 s
        from dflash_train.generate.config import LocalConfig
        from dflash_train.generate.local_backend import LocalBackend

        responder = LocalBackend.load(args.model, LocalConfig(device=args.device, batch_size=args.batch_size))
    faults = FaultPlan(args.fail_every, args.drop_every, args.stall_every, args.stall_s, args.fail_marker)
    app = make_app(responder, model_name=args.served_name or args.model or "echo", faults=faults)
    asyncio.run(serve(app, args.host, args.port))


if __name__ == "__main__":
    main()
