"""A probe on every token of the prompt, pooled: does a score that looks for harm token by token flag fewer rows of an
unseen benign domain than a head on the prompt's mean?

Every head tried against the held-out benign domain target reads one vector a prompt (its mean over the tokens, or
its last token), and an unseen benign domain is flagged for how much its style, spread over every token, moves that
vector towards harm (``heads/domain_curve``). A probe that scores each token and pools the scores asks instead
whether some token of the prompt looks like harm; probes of that kind, with max or attention pooling, are reported to
carry over to held-out distributions better than a probe on the mean (McKenzie et al., "Detecting High-Stakes
Interactions with Activation Probes", 2025; Kramar et al., "Building Production-Ready Probes for Gemini", 2026, whose
max of rolling means carried over to long contexts).

Each token's residual at the shipped layers (16, 20, 24, 28: ``[layers * hidden]``, standardised) is scored by one
linear map, and the scores of a prompt's tokens after the chat template's opening (the user's text and the
assistant's header, whose stream depends on the prompt) are pooled into the prompt's logit:

- ``mean``: their mean, the control (a linear head on the mean of those tokens);
- ``max``: their largest;
- ``rolling_max``: the largest mean of ``window`` consecutive scores (the whole prompt when it is shorter);
- ``attention``: their mean weighed by a softmax over a second linear map of the same tokens (one attention head).

For time, each pool is the seeded sample of ``heads/asked`` (at most ``rows_per_pool`` rows,
``load_pool(limit=..., seed=0)``); the tokens are collected into ``tokens_folder``. The fits are our own torch loop
(Adam; every training source drawn alike at every step, each label's sources weighing half, as the shipped head
weighs them), through :func:`studies.heads.run`'s leave-one-source-out and leave-one-benign-domain-out protocol. The
shipped head's figures on the same rows are ``heads/asked``'s baseline (prompt mean 16-28, MLP 256).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from hf_lsad.capture.collect import prompt_batches, prompt_token_ids
from hf_lsad.capture.pretrained import load_model
from hf_lsad.capture.recorder import PromptPrefix, prefix_reader
from hf_lsad.core.prompt_inputs import template_opening
from hf_lsad.data import GUARD_POOLS, load_pool
from hf_lsad.evaluation.sources import SourceRows, leave_one_source_out, load_source_rows

from . import heads

Tensor = torch.Tensor
Pooling = Literal["mean", "max", "rolling_max", "attention"]
POOLINGS: tuple[Pooling, ...] = get_args(Pooling)


@dataclass
class Settings:
    layers: list[int] = field(default_factory=lambda: [16, 20, 24, 28])
    """The blocks whose output at every token is read (the shipped head's layers), concatenated per token."""
    poolings: list[Pooling] = field(default_factory=lambda: list(POOLINGS))
    """How a prompt's token scores become its logit, each a candidate (see the module's docstring)."""
    window: int = 8
    """Tokens of each mean that ``rolling_max`` takes the largest of."""
    rows_per_pool: int = 1500
    """A seeded sample of at most this many rows of each pool (``heads/asked``'s sample)."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """The pools whose rows take part."""
    baseline_folder: str = "artifacts/smollm2-sample"
    """``heads/asked``'s stores cut to the sample: the rows, their sources and splits (their reads are not used)."""
    tokens_folder: str = "artifacts/smollm2-tokens"
    """Where each pool's token residuals are written (once): ``<pool>.safetensors`` and ``<pool>.json``."""
    steps: int = 400
    """Optimiser steps of each fit (Adam)."""
    learning_rate: float = 1e-3
    """Adam's learning rate."""
    rows_per_source: int = 8
    """Rows drawn from every training source at each step (with replacement), so every source is in every batch."""
    l2: float = 1e-3
    """Penalty on the squared norm of the linear maps' weights (over standardised features)."""
    standardise_tokens: int = 50_000
    """Training tokens (a seeded draw) whose mean and scale standardise each fit's features."""
    max_batch_tokens: int = 4096
    """Padded tokens a collection pass holds at most."""
    seed: int = 0
    """Seed of the fits (initial weights, the rows of each step)."""


def collect_tokens(settings: Settings) -> None:
    """Each sample prompt's residuals at ``layers``, at every token after the chat template's opening, float16
    ``[tokens, layers * hidden]`` per pool with the offsets of its rows (``[rows + 1]``) and their ids."""
    folder = Path(settings.tokens_folder)
    folder.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model("default")
    opening = list(template_opening(tokenizer))
    if not opening:
        raise RuntimeError("the default model's tokenizer gives no chat-template opening")
    reads = [(layer, "prompt_mean") for layer in settings.layers]
    prefix = PromptPrefix.run(model, settings.layers, opening)
    if prefix is None:
        raise RuntimeError("the default model keeps no keys and values per block")
    for pool in settings.pools:
        if (folder / f"{pool}.json").is_file():
            continue
        prompts = load_pool(pool, limit=settings.rows_per_pool, seed=0)
        token_ids = prompt_token_ids(tokenizer, [prompt.text for prompt in prompts])
        for prompt, ids in zip(prompts, token_ids):
            if ids[: len(opening)] != opening or len(ids) == len(opening):
                raise ValueError(f"{pool}/{prompt.id} does not open with the chat template's opening")
        rests = [ids[len(opening) :] for ids in token_ids]
        batches = prompt_batches(tokenizer, [p.text for p in prompts], 64, settings.max_batch_tokens, token_ids=rests)
        parts: dict[int, Tensor] = {}  # prompt index -> [real tokens, layers * hidden]
        for batch in tqdm(batches, desc=pool):
            padded = tokenizer.pad({"input_ids": [rests[i] for i in batch]}, padding_side="right", return_tensors="pt")
            reader = prefix_reader(
                model, reads, prefix, padded["input_ids"], padded["attention_mask"], keep_tokens=True
            )
            hidden = torch.cat([reader.hidden[layer] for layer in settings.layers], -1)  # [batch, seq, width]
            for row, i in enumerate(batch):
                parts[i] = hidden[row, : len(rests[i])].to(torch.float16).clone()
        lengths = torch.tensor([len(rest) for rest in rests])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        tokens = torch.cat([parts[i] for i in range(len(prompts))])  # every prompt was in a batch
        save_file({"tokens": tokens, "offsets": offsets}, folder / f"{pool}.safetensors")
        (folder / f"{pool}.json").write_text(json.dumps({"ids": [p.id for p in prompts], "layers": settings.layers}))


class TokenRows:
    """The collected token residuals of every sample row: one ``[tokens, width]`` tensor and each row's span in it, by
    row id."""

    def __init__(self, folder: str | Path, pools: list[str], layers: list[int]) -> None:
        self.spans: dict[str, tuple[int, int]] = {}
        metas, sizes = [], []
        for pool in pools:
            meta = json.loads((Path(folder) / f"{pool}.json").read_text())
            if meta["layers"] != layers:
                raise ValueError(f"{folder}/{pool} holds layers {meta['layers']}, not {layers}")
            with safe_open(Path(folder) / f"{pool}.safetensors", framework="pt") as stored:
                sizes.append(stored.get_slice("tokens").get_shape())
            metas.append(meta)
        # float32 in memory (about 10 GB for the sample): a fit's steps then only gather
        self.tokens = torch.empty(sum(size[0] for size in sizes), sizes[0][1])  # [tokens, layers * hidden]
        start = 0
        for pool, meta in zip(pools, metas):
            stored = load_file(Path(folder) / f"{pool}.safetensors")
            offsets = stored["offsets"].tolist()
            for i, row_id in enumerate(meta["ids"]):
                self.spans[row_id] = (start + offsets[i], start + offsets[i + 1])
            self.tokens[start : start + offsets[-1]] = stored["tokens"]
            start += offsets[-1]

    def gather(self, ids: list[str]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(tokens [n, width], row [n], position [n], lengths [rows])`` of the rows ``ids``, in order."""
        spans = [self.spans[row_id] for row_id in ids]
        lengths = torch.tensor([end - start for start, end in spans])
        index = torch.cat([torch.arange(start, end) for start, end in spans])
        row = torch.repeat_interleave(torch.arange(len(ids)), lengths)
        position = index - torch.repeat_interleave(torch.tensor([start for start, _ in spans]), lengths)
        return self.tokens[index], row, position, lengths


class PooledProbe(torch.nn.Module):
    """A linear score of every token's standardised features, pooled into one logit a prompt by ``pooling``."""

    mean: Tensor
    scale: Tensor

    def __init__(self, mean: Tensor, scale: Tensor, pooling: str, window: int) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.pooling, self.window = pooling, window
        self.register_buffer("mean", mean)  # [width]
        self.register_buffer("scale", scale)  # [width]
        self.score = torch.nn.Linear(len(mean), 1)
        self.attend = torch.nn.Linear(len(mean), 1) if pooling == "attention" else None

    def linear(self, layer: torch.nn.Linear, x: Tensor) -> Tensor:
        """``layer`` on ``(x - mean) / scale``, the standardisation folded into its weights: ``[n]``."""
        weight = layer.weight[0] / self.scale  # [width]
        return x @ weight + (layer.bias[0] - self.mean @ weight)

    def forward(self, x: Tensor, row: Tensor, position: Tensor, lengths: Tensor) -> Tensor:
        """``x`` ``[n, width]`` tokens of ``len(lengths)`` prompts; ``[prompts]`` logits."""
        scores = self.linear(self.score, x)  # [n]
        rows, longest = len(lengths), int(lengths.max())
        if self.pooling == "mean":
            return scores.new_zeros(rows).index_add(0, row, scores) / lengths
        values = scores.new_zeros(rows, longest).index_put((row, position), scores)  # [rows, longest], 0 at pads
        real = torch.arange(longest)[None, :] < lengths[:, None]  # [rows, longest]
        if self.pooling == "max":
            return values.masked_fill(~real, float("-inf")).max(1).values
        if self.pooling == "attention":
            assert self.attend is not None
            attention = scores.new_zeros(rows, longest).index_put((row, position), self.linear(self.attend, x))
            weights = attention.masked_fill(~real, float("-inf")).softmax(1)  # [rows, longest]
            return (weights * values).sum(1)
        # rolling_max: the largest mean of `window` consecutive scores, or of the whole prompt when it is shorter
        sums = torch.cat([values.new_zeros(rows, 1), values.cumsum(1)], 1)  # [rows, longest + 1]
        starts = torch.arange(longest)[None, :].expand(rows, -1)  # [rows, longest]
        ends = torch.minimum(starts + self.window, lengths[:, None])
        means = (sums.gather(1, ends) - sums[:, :longest]) / (ends - starts).clamp_min(1)
        whole = starts <= (lengths[:, None] - self.window).clamp_min(0)  # windows that fit in the prompt
        return means.masked_fill(~whole, float("-inf")).max(1).values


def pooled_method(tokens: TokenRows, pooling: str, settings: Settings):
    """A :class:`PooledProbe` fitted by Adam on batches that draw ``rows_per_source`` rows of every training source,
    the mean loss of each source weighing alike within its label and the labels weighing half each."""

    def fit(train: SourceRows):
        generator = torch.Generator().manual_seed(settings.seed)
        sources = heads.SourceDraws(train)
        # standardise with a seeded draw of the training rows' tokens
        spans = [tokens.spans[row_id] for row_id in train.ids]
        all_tokens = torch.cat([torch.arange(start, end) for start, end in spans])
        draw = all_tokens[torch.randperm(len(all_tokens), generator=generator)[: settings.standardise_tokens]]
        sample = tokens.tokens[draw].double()
        mean, scale = sample.mean(0).float(), sample.std(0).clamp_min(1e-6).float()
        torch.manual_seed(settings.seed)
        model = PooledProbe(mean, scale, pooling, settings.window)
        optimiser = torch.optim.Adam(model.parameters(), lr=settings.learning_rate)
        for _ in range(settings.steps):
            batch = sources.draw(settings.rows_per_source, generator)  # [sources * rows_per_source]
            raw, row, position, lengths = tokens.gather([train.ids[i] for i in batch.tolist()])
            logits = model(raw, row, position, lengths)
            targets = sources.labels.repeat_interleave(settings.rows_per_source)
            per_row = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none")
            losses = per_row.view(len(sources.names), settings.rows_per_source).mean(1)  # [sources]
            loss = (sources.weights * losses).sum() / sources.weights.sum()
            maps = [model.score] + ([model.attend] if model.attend is not None else [])
            loss = loss + settings.l2 * sum((linear.weight**2).sum() for linear in maps)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
        model.eval()

        @torch.no_grad()
        def score(rows: SourceRows) -> Tensor:
            out = []
            for start in range(0, len(rows), 256):
                raw, row, position, lengths = tokens.gather(rows.ids[start : start + 256])
                out.append(torch.sigmoid(model(raw, row, position, lengths)))
            return torch.cat(out) if out else torch.empty(0)

        return score

    return fit


def run(settings: Settings) -> dict[str, Any]:
    collect_tokens(settings)
    rows = load_source_rows(settings.baseline_folder, settings.pools, [(16, "prompt_mean")], seed=0)
    tokens = TokenRows(settings.tokens_folder, settings.pools, settings.layers)
    results: dict[str, Any] = {"rows": len(rows), "tokens": len(tokens.tokens), "candidates": {}}
    for pooling in settings.poolings:
        print(f"candidate {pooling}", flush=True)
        table = leave_one_source_out(
            rows,
            pooled_method(tokens, pooling, settings),
            evaluate_on="validation",
            progress=lambda message: print(f"  {message}", flush=True),
        )
        results["candidates"][f"layers {'+'.join(map(str, settings.layers))}, every token, {pooling} pooling"] = table
        print(f"  {table['summary@0.05']}", flush=True)
    return results
