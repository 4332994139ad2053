"""How many chat-completion requests/s the generate client sustains against a trivial server.

The echo server runs in its own process (as SGLang/vLLM would), so client and server each get
one of the machine's cores. Two figures:
  client      HttpBackend.complete alone, N requests with C in flight;
  end to end  generate() over an N-row JSONL file: input streaming, regeneration, shard commits.

    PYTHONPATH=. python bench/generate_client.py --requests 20000 --concurrency 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash_train.decode.sampling import GenParams
from dflash_train.generate.job import generate
from dflash_train.generate.config import HttpConfig, build_generate_config
from dflash_train.generate.http_backend import HttpBackend


def start_echo_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("chat_server.py")), "--echo", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"echo server did not start: {line!r}")
    return proc, line.split()[1]


async def client_rate(url: str, num_requests: int, concurrency: int) -> float:
    backend = HttpBackend(HttpConfig(server_urls=[url]), model="echo", max_connections=concurrency)
    params = GenParams(temperature=0.0, top_p=1.0, max_tokens=64)
    messages = [{"role": "user", "content": "Say something short about speculative decoding."}]
    left = num_requests

    async def worker():
        nonlocal left
        while left > 0:
            left -= 1
            await backend.complete(messages, params)

    await backend.complete(messages, params)  # connect once before timing
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    await backend.aclose()
    return num_requests / elapsed


def end_to_end_rate(url: str, num_requests: int, concurrency: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Path(tmp) / "prompts.jsonl"
        with inputs.open("w") as f:
            for i in range(num_requests):
                f.write(json.dumps({"messages": [{"role": "user", "content": f"Question number {i}?"}]}) + "\n")
        cfg = build_generate_config(
            {"inputs": [str(inputs)], "output_dir": f"{tmp}/out", "concurrency": concurrency, "progress": False},
            {"http.server_urls": [url]},
        )
        summary = generate(cfg)
        assert summary["ok"] == num_requests, summary
        return summary["this_run"]["rows_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=128)
    args = p.parse_args()
    server, url = start_echo_server()
    try:
        rate = asyncio.run(client_rate(url, args.requests, args.concurrency))
        print(f"client      {args.requests} requests, {args.concurrency} in flight: {rate:,.0f} requests/s")
        rate = end_to_end_rate(url, args.requests, args.concurrency)
        print(f"end to end  {args.requests} rows through generate(): {rate:,.0f} requests/s")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
