"""Guarded vs plain ``generate`` on a Llama-3-8B-shaped model with random bf16 weights, on a GPU.

    python benchmarks/generate_overhead_gpu.py [--batch-sizes 1 32] [--new-tokens 128] [--repeats 5]

The model has Llama-3-8B's shape (32 layers, hidden 4096, MLP 14336, 32 query
and 8 key/value heads, vocabulary 128256) and random weights in bfloat16. The
guard reads block ``--layer``: its SAE (4096 x 16384, random, bias set for about
60 active features per row) and its FreqMask-KM detector (K=100) are fitted on
that block's outputs for random prompts. Prompts are random token ids; both
calls generate exactly ``--new-tokens`` tokens greedily (``min_new_tokens`` =
``max_new_tokens``), so they do the same model work, and plain and guarded
calls alternate so drift hits both; the ratio is of the medians. The shape
flags make a small smoke run possible on the CPU. Writes
``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from hf_lsad.core.hook_point import HookPoint
from hf_lsad.detectors import FreqMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard.fitting import fit_guard
from perf.harness import environment, load_average, mean_l0, set_threads, sparse_random_sae


@torch.no_grad()
def block_outputs(model: PreTrainedModel, layer: int, prompts: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Float32 outputs of decoder block ``layer`` at every position of ``prompts``, ``[rows, hidden]``."""
    parts = []
    for start in range(0, len(prompts), batch_size):
        hidden = model(prompts[start : start + batch_size], output_hidden_states=True).hidden_states[layer + 1]
        parts.append(hidden.reshape(-1, hidden.shape[-1]).float())
    return torch.cat(parts)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of ``fn()``, waiting for queued CUDA work before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@dataclass
class Settings:
    device: str = "cuda"
    """Device."""
    dtype: str = "bfloat16"
    """Dtype."""
    layers: int = 32
    """Layers."""
    hidden_size: int = 4096
    """Hidden size."""
    intermediate_size: int = 14336
    """Intermediate size."""
    heads: int = 32
    """Heads."""
    kv_heads: int = 8
    """Kv heads."""
    vocab_size: int = 128256
    """Vocab size."""
    layer: int = 16
    """Decoder block the guard reads."""
    d_sae: int = 16384
    """D sae."""
    clusters: int = 100
    """Clusters."""
    fit_prompts: int = 128
    """Random prompts whose block outputs fit the guard."""
    prompt_tokens: int = 64
    """Prompt tokens."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 32])
    """Batch sizes."""
    new_tokens: int = 128
    """New tokens."""
    repeats: int = 5
    """Repeats."""
    seed: int = 0
    """Seed."""
    threads: int | None = None
    """CPU threads for torch and faiss (default: one per core)."""


def run(args: Settings) -> dict[str, Any]:
    set_threads(args.threads)
    device = torch.device(args.device)

    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    model.generation_config.pad_token_id = config.eos_token_id
    generator = torch.Generator().manual_seed(args.seed)

    fit_prompts = torch.randint(args.vocab_size, (args.fit_prompts, args.prompt_tokens), generator=generator)
    activations = block_outputs(model, args.layer, fit_prompts.to(device), max(args.batch_sizes))
    sae = sparse_random_sae(activations[:2048].cpu(), args.d_sae, 60.0, args.seed).to(device)
    kmeans = KMeansConfig(n_clusters=args.clusters, seed=args.seed, max_points_per_centroid=256)
    detector = FreqMaskConfig(kmeans=kmeans)
    hook = HookPoint.from_model(model, args.layer, "response_last")
    guard = fit_guard(activations, hook, "freqmask-km", detector, sae, seed=args.seed, progress=False).guard
    guarded = GuardedModelForCausalLM(model, guard)

    settings = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    prompts = torch.randint(args.vocab_size, (max(args.batch_sizes), args.prompt_tokens), generator=generator)
    prompts = prompts.to(device)
    results = {}
    for batch_size in args.batch_sizes:
        inputs = dict(input_ids=prompts[:batch_size], attention_mask=torch.ones_like(prompts[:batch_size]))
        with torch.no_grad():
            plain_fn = partial(model.generate, **inputs, **settings)
            guarded_fn = partial(guarded.generate, **inputs, **settings)
            assert torch.equal(plain_fn(), guarded_fn())  # warm-up, and the same sequences
            load_before, plain, guard_s = load_average(), [], []
            for _ in range(args.repeats):
                plain.append(timed(plain_fn, device))
                guard_s.append(timed(guarded_fn, device))
        results[f"batch_{batch_size}"] = {
            "plain_median_s": statistics.median(plain),
            "guarded_median_s": statistics.median(guard_s),
            "ratio": statistics.median(guard_s) / statistics.median(plain),
            "plain_s": plain,
            "guarded_s": guard_s,
            "load_average_before": load_before,
            "load_average_after": load_average(),
        }
        print(batch_size, results[f"batch_{batch_size}"], flush=True)
    record = {
        **environment(device),
        "settings": {k: v for k, v in vars(args).items() if k != "name"},
        "sae_l0_on_fit_activations": mean_l0(sae, activations[-2048:]),
        "results": results,
    }
    return record
