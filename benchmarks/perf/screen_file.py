"""``hf-lsad screen`` on a table of bundled prompts: throughput against a plain forward pass cut at the deepest
hooked block over the same rows, and a run killed about half-way and started again.

1. The table: ``chat`` rows of the chat pool and ``unsafe`` rows drawn from the harmful, toxic and vauban harmful
   pools (seeded), written as JSON lines with an ``id`` column.
2. Throughput, one run each, same rows, same length-sorted batches: :func:`hf_lsad.generation.bulk.screen_to_jsonl`
   (reading the table's rows, tokenising, scoring every head, writing verdicts) against
   :func:`hf_lsad.capture.recorder.prefill_activations` at the deepest block the guard reads, on the pre-tokenised
   batches (no tokenising, no heads, no writing).
3. Kill and resume: ``hf-lsad screen`` in a subprocess, killed (SIGKILL) once about ``kill_at`` of the rows are
   written, then started again on the same output. Counted: ids written twice, ids missing, and verdicts that
   differ from the uninterrupted run of step 2 (flag, deciding heads, every head's score within 1e-4).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_lsad.capture.pretrained import load_model
from hf_lsad.capture.recorder import prefill_activations
from hf_lsad.data import load_pool
from hf_lsad.data.tables import read_prompt_table
from hf_lsad.generation.bulk import plan_batches, screen_to_jsonl
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from perf.harness import environment, load_average

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Settings:
    chat: int = 2000
    """Chat rows (seeded subset of the chat pool)."""
    unsafe: int = 500
    """Unsafe rows: half harmful, 30% toxic, 20% vauban harmful (seeded subsets; the jailbreak pool's prompts, up to
    6,000 tokens, would make the run an hour long on 2 cores)."""
    batch_size: int = 16
    """Prompts per forward pass at most, for both variants."""
    max_batch_tokens: int | None = 4096
    """Padded tokens per forward pass at most, for both variants (``None``: ``batch_size`` prompts a pass)."""
    kill_at: float = 0.5
    """Share of the rows written when the screening subprocess is killed."""
    seed: int = 0
    """Seed of the subsets."""


@torch.no_grad()
def run(settings: Settings) -> dict[str, Any]:
    load_before = load_average()
    n_harmful, n_toxic = settings.unsafe // 2, settings.unsafe * 3 // 10
    n_vauban = settings.unsafe - n_harmful - n_toxic
    prompts = [
        *load_pool("chat", limit=settings.chat, seed=settings.seed),
        *load_pool("harmful", limit=n_harmful, seed=settings.seed),
        *load_pool("toxic", limit=n_toxic, seed=settings.seed),
        *load_pool("harmful_vauban", limit=n_vauban, seed=settings.seed),
    ]
    work = Path(tempfile.mkdtemp(prefix="screen-file-"))
    table = work / "prompts.jsonl"
    table.write_text("".join(json.dumps({"id": p.id, "prompt": p.text}) + "\n" for p in prompts))

    model, tokenizer = load_model("default")
    guard = SafetyGuard.from_pretrained("default")
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    deepest = max(layer for layer, _ in guard.reads)
    rows = read_prompt_table(table, id_column="id")

    # the forward cut, on the same length-sorted batches screen_to_jsonl makes
    planned, _ = plan_batches(guarded, rows, batch_size=settings.batch_size, max_batch_tokens=settings.max_batch_tokens)
    batches = [batch.tensors(tokenizer) for batch in planned]
    start = time.perf_counter()
    for input_ids, attention_mask in batches:
        prefill_activations(model, deepest, input_ids, attention_mask)
    cut_seconds = time.perf_counter() - start

    whole = work / "whole.jsonl"
    start = time.perf_counter()
    summary = screen_to_jsonl(
        guarded,
        rows,
        whole,
        batch_size=settings.batch_size,
        max_batch_tokens=settings.max_batch_tokens,
        progress=False,
    )
    screen_seconds = time.perf_counter() - start
    print(summary.describe())
    print(f"screen {len(rows) / screen_seconds:.1f} rows/s, cut at layer {deepest} {len(rows) / cut_seconds:.1f}")

    resumed = work / "resumed.jsonl"
    argv = [sys.executable, "-m", "hf_lsad.cli", "screen", str(table), "--out", str(resumed)]
    argv += ["--id-column", "id", "--batch-size", str(settings.batch_size)]
    argv += ["--max-batch-tokens", str(settings.max_batch_tokens).lower()]  # None: 'none'

    env = dict(os.environ, TQDM_DISABLE="1")
    with (work / "log").open("w") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=log, cwd=REPO)
        target = int(settings.kill_at * len(rows))
        while process.poll() is None and (not resumed.exists() or _lines(resumed) < target):
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait()
    at_kill = _lines(resumed)
    again = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=REPO)
    if again.returncode != 0:
        raise RuntimeError(again.stderr)
    written = [json.loads(line) for line in resumed.read_text().splitlines()]
    reference = {r["id"]: r for r in (json.loads(line) for line in whole.read_text().splitlines())}
    ids = [r["id"] for r in written]
    differing = [r["id"] for r in written if not _same(r, reference.get(r["id"]))]
    kill = {
        "rows": len(rows),
        "written_when_killed": at_kill,
        "verdicts_after_restart": len(written),
        "written_twice": len(ids) - len(set(ids)),
        "missing": len(set(reference) - set(ids)),
        "differing_from_uninterrupted_run": len(differing),
        "restart_summary": again.stdout.strip().splitlines()[-1],
    }
    print(kill)
    return {
        "environment": environment(torch.device("cpu")),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "rows": {"chat": settings.chat, "harmful": n_harmful, "toxic": n_toxic, "harmful_vauban": n_vauban},
        "deepest_hooked_layer": deepest,
        "seconds": {"screen": screen_seconds, "forward_cut": cut_seconds},
        "rows_per_second": {"screen": len(rows) / screen_seconds, "forward_cut": len(rows) / cut_seconds},
        "screen_over_forward_cut": cut_seconds / screen_seconds,
        "summary": summary.to_json(),
        "kill_and_resume": kill,
    }


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")


def _same(record: dict[str, Any], reference: dict[str, Any] | None) -> bool:
    if reference is None or (record["flagged"], record.get("decided_by"), record["error"]) != (
        reference["flagged"],
        reference.get("decided_by"),
        reference["error"],
    ):
        return False
    return all(
        abs(record["heads"][name]["score"] - head["score"]) <= 1e-4
        for name, head in (reference.get("heads") or {}).items()
    )
