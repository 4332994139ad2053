"""One llama-server process on a loopback port: start, greedy completions of token prompts, stop.

Acceptance is read the way llama.cpp counts it: its Prometheus counters (`--metrics`) of drafted
tokens, accepted tokens and verification steps, taken before and after each request (one slot, one
request at a time), so a request's mean accepted length is llama.cpp's own `1 + accepted / steps`.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dflash_train.errors import UserError
from dflash_train.serve.llama_cpp import LlamaCpp

START_TIMEOUT_S = 300
"""Loading an f32 GGUF of a few GB from a cold disk; a server that never answers is killed then."""
REQUEST_TIMEOUT_S = 1800
GPU_LAYERS = "99"
"""-ngl / -ngld: more layers than any served model has, so all of them go to the GPU."""
DRAFT_STATS = re.compile(r"statistics +\S+: #calls\(b,g,a\) = +\d+ +(\d+) +\d+,.*dur\(b,g,a\) = [\d.]+, ([\d.]+), [\d.]+ ms")
"""llama.cpp's trace line (`-lv 4`) at each finished request: its drafter's calls and milliseconds spent
drafting (common/speculative.cpp, `common_speculative_print_stats`), both counted since the server started."""
SPEC_COUNTERS = {
    "drafted": "llamacpp:spec_decode_num_draft_tokens_total",
    "accepted": "llamacpp:spec_decode_num_accepted_tokens_total",
    "steps": "llamacpp:spec_decode_num_drafts_total",
}


class ServerError(UserError):
    pass


@dataclass
class Completion:
    tokens: list[int]
    seconds: float
    """llama.cpp's own generation time (prompt processing excluded)."""
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    """Verification steps: target passes that checked a draft."""
    draft_calls: int = 0
    draft_seconds: float | None = None
    """llama.cpp's own time in its drafter's passes (None: not in its log); `seconds` holds it too."""

    @property
    def mean_accepted_length(self) -> float | None:
        """llama.cpp's `mean len`: 1 + accepted drafts per verification step (None: no step)."""
        return 1 + self.accepted / self.steps if self.steps else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_lines(lines: list[str], n: int = 3) -> str:
    return " | ".join(lines[-n:])


class LlamaServer:
    """`with LlamaServer(llama, target_gguf, drafter_gguf, block_size, log_file) as server:`; no drafter
    = the target alone. `backend_sampling`: llama.cpp's `-bs`, the target samples inside its graph
    (its drafter does by default). `exact`: f32 KV caches (llama.cpp's default f16 rounds every key and value) and
    no flash attention (its CPU kernel rounds a several-token verification apart from a one-token
    step, so a near-tie can flip): an f32 model then computes as a float32 reference does."""

    def __init__(self, llama: LlamaCpp, target: Path, drafter: Path | None, block_size: int, log_file: Path,
                 context: int = 4096, threads: int | None = None, exact: bool = False, draft_length: int | None = None,
                 spec_type: str = "draft-dflash", draft_p_min: float = 0.0, backend_sampling: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = log_file
        kv_type = "f32" if exact else "f16"
        cmd = [str(llama.server), "-m", str(target), "--host", "127.0.0.1", "--port", str(self.port),
               "-np", "1", "-c", str(context), "--metrics", "--no-webui", "-ctk", kv_type, "-ctv", kv_type]
        if exact:
            cmd += ["-fa", "off"]
        if threads:
            cmd += ["-t", str(threads)]
        if backend_sampling:  # the target's greedy pick made on the device: no logits row copied to the host
            cmd += ["-bs"]
        if llama.cuda:  # every layer of both models on the GPU (llama.cpp's "auto" may keep some on the CPU)
            cmd += ["-ngl", GPU_LAYERS]
        if drafter is not None:
            # llama.cpp drafts block_size - 1 tokens a round at most (slot 0 is the verified token); a shorter
            # draft_length runs the drafter over draft_length + 1 tokens
            cmd += ["-md", str(drafter), "--spec-type", spec_type,
                    "--spec-draft-n-max", str(draft_length or block_size - 1), "-ctkd", kv_type, "-ctvd", kv_type]
            if draft_p_min > 0:  # a DSpark or DFlash2 draft stops at its first slot of lower confidence
                cmd += ["--spec-draft-p-min", str(draft_p_min)]
            if llama.cuda:
                cmd += ["-ngld", GPU_LAYERS]
            cmd += ["-lv", "4"]  # trace level: the drafter's own time at each request (DRAFT_STATS)
        self.cmd = cmd
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self._log = open(self.log_file, "w")
        self.process = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"llama-server exited with {self.process.returncode} while loading: "
                                  f"{self.first_error()} (log {self.log_file})")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise ServerError(f"llama-server did not answer within {START_TIMEOUT_S} s (log {self.log_file})")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def _log_lines(self) -> list[str]:
        self._log.flush()
        return [ln for ln in self.log_file.read_text(errors="replace").splitlines() if ln.strip()]

    def first_error(self) -> str:
        """The first error line of the log (llama.cpp's level letter E), where it says what it refused."""
        lines = self._log_lines()
        errors = [ln.split(" E ", 1)[1].strip() for ln in lines if " E " in ln and "is normal" not in ln]
        return errors[0] if errors else last_lines(lines)

    def why_it_stopped(self) -> str:
        """What a crashed server's log says, in the user's terms where the cause is known."""
        lines = self._log_lines()
        if any("layer input tensor is null" in ln for ln in lines):
            return ("llama.cpp's graph for this target's family does not expose the layer inputs a DFlash drafter "
                    "reads (docs/serving.md lists the families it serves)")
        failed = [ln.strip() for ln in lines if "GGML_ASSERT" in ln or "failed" in ln]
        return failed[0] if failed else last_lines(lines)

    def _request(self, path: str, body: dict | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                return r.read()
        except urllib.error.HTTPError as err:
            raise ServerError(f"llama-server {path}: HTTP {err.code} {err.read()[:300]!r} "
                              f"(log {self.log_file})") from None
        except (urllib.error.URLError, ConnectionError) as err:
            raise ServerError(f"llama-server {path}: {err}; {self.why_it_stopped()} (log {self.log_file})") from None

    def time_drafting(self, completions: list[Completion]) -> None:
        """Once the server has stopped (its log complete): each completion's drafter calls and seconds from
        llama.cpp's trace lines, one line per request in the order sent; left unset where the log has not
        exactly one line per completion (another llama.cpp's wording, or a request that failed)."""
        totals = [(int(m[1]), float(m[2])) for m in DRAFT_STATS.finditer(self.log_file.read_text(errors="replace"))]
        if len(totals) != len(completions):
            return
        for c, (calls, ms), (calls0, ms0) in zip(completions, totals, [(0, 0.0)] + totals[:-1]):
            c.draft_calls, c.draft_seconds = calls - calls0, (ms - ms0) / 1000

    def spec_counters(self) -> dict[str, int]:
        values = {}
        for line in self._request("/metrics").decode().splitlines():
            name, _, value = line.partition(" ")
            for key, metric in SPEC_COUNTERS.items():
                if name == metric:
                    values[key] = int(float(value))
        return {key: values.get(key, 0) for key in SPEC_COUNTERS}

    def complete(self, prompt_ids: list[int], max_new_tokens: int) -> Completion:
        """A greedy completion of the token prompt (no prompt cache reused between requests)."""
        before = self.spec_counters()
        body = {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        reply = json.loads(self._request("/completion", body))
        after = self.spec_counters()
        delta = {key: after[key] - before[key] for key in SPEC_COUNTERS}
        return Completion(tokens=list(reply["tokens"]), seconds=reply["timings"]["predicted_ms"] / 1000, **delta)
