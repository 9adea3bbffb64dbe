"""Load on ``hf-lsad serve``: concurrent streaming clients (the official ``openai`` client) against a live server
with SmolLM2 and the bundled guard, for a fixed number of requests, at each ``max_concurrency``.

Per setting: requests/s over the wall time, latency (request to last chunk) p50 / p95, time to the first chunk
p50, requests ended by the guard (``content_filter``), server errors, and **mixed reports**: answers whose report
differs from the one the same prompt gets alone (``screen``, after the load: flag, deciding heads, every head's
score within 1e-4). Requests are not micro-batched (:mod:`hf_lsad.serving.app` says why); ``max_concurrency`` is
how many generate at once.

With ``top_logprobs`` the clients may also ask for each token's log-probabilities: each setting is a load run of its
own, the runs interleaved and repeated, and the summary gives each setting's median requests/s over the repeats and
its ratio to the run without log-probabilities.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import openai
import torch
import uvicorn

from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import load_pool
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from hf_lsad.serving import ServeConfig, create_app
from perf.harness import environment, load_average


@dataclass
class Settings:
    clients: int = 32
    """Concurrent streaming clients."""
    requests: int = 96
    """Requests per setting, shared out among the clients."""
    max_tokens: int = 16
    """New tokens per request (greedy)."""
    max_concurrency: list[int] = field(default_factory=lambda: [1, 4, 8])
    """The server's generations at once, one load run each."""
    seed: int = 0
    """Seed of the prompts: half chat, half harmful and toxic requests."""
    top_logprobs: list[int | None] = field(default_factory=lambda: [None])
    """Per load run, what the clients ask for: ``None``, no log-probabilities; ``k``, ``logprobs`` with the ``k`` most
    likely tokens at each position."""
    repeats: int = 1
    """Load runs of each setting, interleaved (the summary takes medians over them)."""


def run(settings: Settings) -> dict[str, Any]:
    model, tokenizer = load_model("default")
    guarded = GuardedModelForCausalLM(model, SafetyGuard.from_pretrained("default"), tokenizer=tokenizer)
    half = settings.requests // 2
    prompts = [p.text for p in load_pool("chat", limit=half, seed=settings.seed)]
    prompts += [p.text for p in load_pool("harmful", limit=half // 2, seed=settings.seed)]
    prompts += [p.text for p in load_pool("toxic", limit=settings.requests - len(prompts), seed=settings.seed)]
    with torch.no_grad():
        alone = {p: guarded.screen([p])[0].to_json() for p in prompts}
    results: dict[str, Any] = {}
    rates: dict[str, list[float]] = {}
    for repeat in range(settings.repeats):
        for concurrency in settings.max_concurrency:
            for top in settings.top_logprobs:
                setting = _setting(concurrency, top)
                name = f"{setting}_repeat_{repeat}" if settings.repeats > 1 else setting
                results[name] = _load(guarded, prompts, alone, concurrency, top, settings)
                rates.setdefault(setting, []).append(results[name]["requests_per_second"])
                print(name, results[name], flush=True)
    summary = {}
    for concurrency in settings.max_concurrency:
        plain = rates.get(_setting(concurrency, None))
        for top in settings.top_logprobs:
            median = statistics.median(rates[_setting(concurrency, top)])
            summary[_setting(concurrency, top)] = {
                "requests_per_second_median": median,
                "ratio_to_no_logprobs": median / statistics.median(plain) if plain else None,
            }
    return {
        "environment": environment(torch.device("cpu")),
        "prompts": len(prompts),
        "runs": results,
        "summary": summary,
    }


def _setting(concurrency: int, top: int | None) -> str:
    """A setting's name: its ``max_concurrency`` and, when the clients ask for log-probabilities, how many tokens."""
    return f"max_concurrency_{concurrency}" + ("" if top is None else f"_top_logprobs_{top}")


def _load(guarded, prompts, alone, concurrency: int, top: int | None, settings: Settings) -> dict[str, Any]:
    config = ServeConfig(model_name="SmolLM2-135M-Instruct", max_concurrency=concurrency)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(guarded, config), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)

    def ask(prompt: str) -> dict[str, Any]:
        start = time.perf_counter()
        first = None
        try:
            stream = client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=settings.max_tokens,
                temperature=0,
                stream=True,
                **({} if top is None else {"logprobs": True, "top_logprobs": top}),
            )
            last = None
            for chunk in stream:
                first = first if first is not None else time.perf_counter() - start
                last = chunk
            logprobs = last.choices[0].logprobs
            return {
                "prompt": prompt,
                "seconds": time.perf_counter() - start,
                "first_chunk": first,
                "finish": last.choices[0].finish_reason,
                "report": last.model_extra["safety"]["prompt"],
                "tokens_listed": None if logprobs is None else len(logprobs.content),
            }
        except Exception as err:  # counted, not raised: the load goes on
            return {"prompt": prompt, "error": f"{type(err).__name__}: {err}"}

    load_before = load_average()
    start = time.perf_counter()
    with ThreadPoolExecutor(settings.clients) as pool:
        answers = list(pool.map(ask, prompts))
    wall = time.perf_counter() - start
    server.should_exit = True
    thread.join(timeout=30)
    ok = [a for a in answers if "error" not in a]
    latencies = sorted(a["seconds"] for a in ok)
    mixed = [a["prompt"][:60] for a in ok if not _same(a["report"], alone[a["prompt"]])]
    return {
        "requests": len(answers),
        "wall_seconds": wall,
        "requests_per_second": len(answers) / wall,
        "latency_p50": statistics.median(latencies) if latencies else None,
        "latency_p95": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "first_chunk_p50": statistics.median(a["first_chunk"] for a in ok) if ok else None,
        "content_filter": sum(a["finish"] == "content_filter" for a in ok),
        "tokens_listed": None if top is None else sum(a["tokens_listed"] or 0 for a in ok),
        "errors": [a["error"] for a in answers if "error" in a],
        "mixed_reports": len(mixed),
        "mixed_examples": mixed[:3],
        "load_average": {"before": load_before, "after": load_average()},
    }


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    if (got["flagged"], got["decided_by"], got["error"]) != (want["flagged"], want["decided_by"], want["error"]):
        return False
    return all(abs(got["heads"][name]["score"] - head["score"]) <= 1e-4 for name, head in want["heads"].items())
