"""Reading the residual stream of a causal LM while it generates.

One function, :func:`generate_with_activations`, serves both activation
collection (fitting) and guarded generation (deployment), so a detector scores
exactly the activation it was fitted on.

A forward hook on decoder layer ``L`` records the hidden state of the *last
position* of every forward call: the last prompt token on the prefill call,
then the newest token on each decoding call. With left padding the last
position of every row is a real token, so a row's record does not depend on
the rest of the batch. A right-padded batch (a tokenizer's default
``padding_side="right"``) is read at each row's last real token on the prefill
call, found from the attention mask (:func:`last_token_positions`), so it is
scored as the same prompt left-padded. The hook only records forward passes
of the thread that registered it, so concurrent calls on one model do not mix.

Positions (one activation per sequence):

- ``prompt_last``: the last prompt token (from the prefill call), for
  screening before any response exists.
- ``response_last``: the *final response token*, defined as the last token
  of the sequence that the model consumed: the token whose forward pass
  produced the final generated token (the end-of-sequence token when the
  model stopped by itself). With ``n`` generated tokens (counting the first
  EOS, ignoring padding after it) that is the record of call ``n - 1``, and it
  equals a fresh forward pass over ``prompt + response[:-1]`` at its last
  position. The hidden state of the very last generated token is never
  computed by ``generate`` (it would be fed back on the next step), so this
  definition costs nothing: no extra forward pass.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

from ..core.hook_point import POSITIONS, decoder_layer
from ..core.prompt_tokens import PromptTokens, fixed_openings
from .generate_call import (
    call_generate,
    eos_token_ids,
    num_beams,
    num_return_sequences,
    prefill_call_rows,
    prefill_rows,
)
from .inputs import check_generate_kwargs, check_prompt_tensors, check_real_tokens


class LastPositionRecorder:
    """Forward hook that keeps ``output[:, -1, :]`` of a module for every call made by the thread that entered it.

    Use as a context manager; the hook is removed on exit, exceptions included.

    - Calls from other threads are ignored, so several threads can each run a recorder on
      the same module at once (concurrent guarded ``generate`` calls on one model): each
      sees only the forward passes of its own call.
    - ``first_positions`` (``[batch]`` long), when given, is the position read on the first
      call instead of the last one: each row's last real token of a right-padded prompt
      (:func:`last_token_positions`). Later calls (one new token each) read position ``-1``.
    - ``first_rows`` (``[batch]`` long), when given, are the rows of the first call that are read, in order
      (:func:`prefill_rows`: beam search's prefill holds each prompt once per beam); ``first_positions`` then
      belong to those rows.
    - ``first_call_rows``, when given, is how many rows the first call must hold (:func:`prefill_call_rows`), so
      that ``first_rows`` and ``first_positions`` read the rows they were meant to (:func:`check_call_rows`).
    """

    def __init__(
        self,
        module: nn.Module,
        first_positions: Tensor | None = None,
        first_rows: Tensor | None = None,
        first_call_rows: int | None = None,
    ) -> None:
        self.module = module
        self.first_positions = first_positions
        self.first_rows = first_rows
        self.first_call_rows = first_call_rows
        self.records: list[Tensor] = []
        self._handle: Any = None
        self._thread: int | None = None

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return  # another thread's forward pass through the same module
        hidden = output[0] if isinstance(output, tuple) else output  # older transformers return tuples
        if not self.records and self.first_call_rows is not None:
            check_call_rows(hidden.shape[0], self.first_call_rows)
        if not self.records and self.first_rows is not None:
            hidden = hidden[self.first_rows.to(hidden.device)]  # [prefill rows, seq, hidden] -> [batch, seq, hidden]
        if not self.records and self.first_positions is not None:
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            self.records.append(hidden[rows, self.first_positions.to(hidden.device)].detach().clone())
            return
        # clone: keep [batch, hidden], not a view pinning the whole prefill tensor.
        self.records.append(hidden[:, -1, :].detach().clone())

    def __enter__(self) -> LastPositionRecorder:
        self.records = []
        self._thread = threading.get_ident()
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()
        self._handle = None


def last_token_positions(attention_mask: Tensor | None) -> Tensor | None:
    """Per row, the position of its last real token, or ``None`` when that is the last position of every row.

    ``None`` (nothing to correct) for no mask or a left-padded / unpadded batch. For a
    right-padded batch (what a tokenizer with ``padding_side="right"`` gives, e.g.
    SmolLM2's by default) the last position of a short row is padding, and reading it
    would score a pad token. Raises :class:`~hf_lsad.errors.InputError` for a row
    without any real token.
    """
    if attention_mask is None or attention_mask.ndim != 2 or attention_mask.shape[1] == 0:
        return None
    mask = attention_mask.bool()
    check_real_tokens(mask)
    if mask[:, -1].all():
        return None
    return mask.shape[1] - 1 - mask.flip(1).long().argmax(1)


def final_call_index(new_tokens: Tensor, eos_token_ids: Sequence[int], position: str) -> Tensor:
    """For each row, the forward call whose record is that row's activation (see module docstring)."""
    if position == "prompt_last":
        return torch.zeros(len(new_tokens), dtype=torch.long, device=new_tokens.device)
    if position != "response_last":
        raise ValueError(f"unknown position {position!r}; choose one of {POSITIONS}")
    n_new = new_tokens.shape[1]
    if not eos_token_ids:
        return torch.full((len(new_tokens),), n_new - 1, dtype=torch.long, device=new_tokens.device)
    is_eos = torch.isin(new_tokens, torch.tensor(list(eos_token_ids), device=new_tokens.device))
    steps = torch.arange(n_new, device=new_tokens.device).expand_as(new_tokens)
    first_eos = torch.where(is_eos, steps, n_new).min(dim=1).values  # n_new when the row never stopped
    return first_eos.clamp(max=n_new - 1)


def check_call_rows(rows: int, expected: int) -> None:
    """Refuse a forward call of ``rows`` rows where the guard's map of the prefill expects ``expected``: the rows it
    reads would not be the prompts' own."""
    if rows != expected:
        raise RuntimeError(
            f"the forward pass read has {rows} rows where {expected} were expected: the prompts "
            "were expanded otherwise than the guard maps them (the rows read would not be the prompts' own)"
        )


def generation_recorder(model: PreTrainedModel, layer: int, generate_kwargs: dict[str, Any]) -> LastPositionRecorder:
    """The recorder of block ``layer`` for one ``model.generate(**generate_kwargs)`` call.

    Every path that reads the layer while generating (reports, screening with ``on_flag="stop"``,
    ``on_step``, running guards) builds its recorder here, so each reads the same positions: a
    right-padded row at its last real token on the prefill call (:func:`last_token_positions`),
    repeated as ``generate`` repeats the row for ``num_return_sequences``.
    """
    _, module = decoder_layer(model, layer)
    first_positions = last_token_positions(generate_kwargs.get("attention_mask"))
    if first_positions is not None:
        first_positions = first_positions.repeat_interleave(num_return_sequences(model, generate_kwargs))
    batch = generate_kwargs["input_ids"].shape[0]
    first_rows = prefill_rows(model, generate_kwargs, batch)
    return LastPositionRecorder(module, first_positions, first_rows, prefill_call_rows(model, generate_kwargs, batch))


def generate_with_activations(
    model: PreTrainedModel, layer: int, position: str, **generate_kwargs: Any
) -> tuple[Any, Tensor]:
    """Run ``model.generate(**generate_kwargs)`` and return ``(its output, activations [batch, hidden])``.

    The activation of each returned sequence is the residual stream after
    decoder block ``layer`` at ``position`` (module docstring). Assisted decoding batches
    positions and is refused; beam search reorders rows after the prefill and is refused
    unless ``position`` is ``prompt_last``, which the prefill reads.
    """
    if position not in POSITIONS:
        raise ValueError(f"unknown position {position!r}; choose one of {POSITIONS}")
    if position == "prompt_mean":
        raise ValueError("prompt_mean is read from the prompt alone: use prompt_features (or screen)")
    input_ids = check_generate_kwargs(model, generate_kwargs, prompt_only=position == "prompt_last")
    with generation_recorder(model, layer, generate_kwargs) as recorder:
        output = call_generate(model, generate_kwargs)
    if num_beams(model, generate_kwargs) > 1:
        if not recorder.records:
            raise RuntimeError(f"decoder block {layer} was not called while generating")
        return output, recorder.records[0]  # the prefill's read, one row per returned sequence (prefill_rows)
    sequences = output if isinstance(output, Tensor) else output.sequences
    new_tokens = sequences[:, input_ids.shape[1] :]
    if len(recorder.records) != new_tokens.shape[1] or new_tokens.shape[1] == 0:
        raise RuntimeError(
            f"expected one forward call per generated token ({new_tokens.shape[1]}), "
            f"saw {len(recorder.records)}; was prefill chunked or the cache disabled mid-way?"
        )
    index = final_call_index(new_tokens, eos_token_ids(model, generate_kwargs), position)
    records = torch.stack(recorder.records)  # [calls, batch, hidden]
    return output, records[index.to(records.device), torch.arange(len(index), device=records.device)]


class _StopForward(Exception):
    """Raised by :class:`_RecordThenStop`: nothing after the target block is needed."""


class _RecordThenStop(LastPositionRecorder):
    """A :class:`LastPositionRecorder` that ends the forward pass once it has recorded."""

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        super()._hook(module, args, output)
        raise _StopForward


@torch.no_grad()
def prefill_activations(model: PreTrainedModel, layer: int, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``prompt_last`` activations ``[batch, hidden]`` from a forward pass cut after block ``layer``.

    The same activation as :func:`generate_with_activations` records on its
    prefill call (position ids are derived from the left-padded attention mask
    as ``generate`` derives them), without the blocks above ``layer`` and the
    LM head: collection for ``prompt_last`` costs about ``(layer + 1) /
    num_layers`` of a forward pass.
    """
    _, module = decoder_layer(model, layer)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with _RecordThenStop(module, last_token_positions(attention_mask)) as recorder:
        try:
            model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        except _StopForward:
            pass
    if len(recorder.records) != 1:
        raise RuntimeError(
            f"decoder block {layer} ran {len(recorder.records)} times in one forward pass; expected once"
        )
    return recorder.records[0]


PROMPT_POSITIONS = ("prompt_last", "prompt_mean")
"""What a forward pass over the prompt alone can read: its last real token, and the mean over its real tokens."""


def prompt_read_modules(model: PreTrainedModel, reads: Sequence[tuple[int, str]]) -> dict[int, nn.Module]:
    """The decoder blocks ``reads`` read, by layer, once their positions are ones a pass over the prompt gives."""
    unknown = sorted({position for _, position in reads} - set(PROMPT_POSITIONS))
    if unknown:
        raise ValueError(f"positions {unknown} are not read from the prompt; choose from {PROMPT_POSITIONS}")
    return {layer: decoder_layer(model, layer)[1] for layer in sorted({layer for layer, _ in reads})}


class PromptReader:
    """Forward hooks on several decoder blocks that read, on one forward call of the calling thread, each block's
    output at the prompt's last real token and its mean over the prompt's real tokens.

    Both are read through the attention mask, so a row reads the same under left padding, right padding or
    none (the mean sums only real positions). The hook of the deepest block ends the forward pass when
    ``stop_after`` is set: nothing above it is needed. Given the prompts' ``input_ids``, it keeps each block's output
    at every position too (for explanations, :meth:`tokens`).
    """

    def __init__(
        self,
        modules: dict[int, nn.Module],
        attention_mask: Tensor,
        *,
        stop_after: bool = True,
        input_ids: Tensor | None = None,
        rows: Tensor | None = None,
        call_rows: int | None = None,
    ) -> None:
        self.modules = modules
        self.mask = attention_mask.bool()
        self.stop_after = stop_after
        self.rows = rows
        """The rows of the forward call read, in order (:func:`prefill_rows`); ``None``: all of them."""
        self.call_rows = call_rows
        """How many rows the forward call read must have (:func:`prefill_call_rows`), so that ``rows`` index the rows
        they were meant to; ``None``: as many as the mask."""
        if input_ids is not None and tuple(input_ids.shape) != tuple(self.mask.shape):
            raise ValueError(f"input_ids {tuple(input_ids.shape)} do not match the mask {tuple(self.mask.shape)}")
        self.input_ids = input_ids
        self.last: dict[int, Tensor] = {}
        """Per layer, ``[batch, hidden]`` at the last real token."""
        self.mean: dict[int, Tensor] = {}
        """Per layer, ``[batch, hidden]``: the mean over the real tokens."""
        self.hidden: dict[int, Tensor] = {}
        """Given ``input_ids``: per layer, float32 ``[batch, seq, hidden]`` at every position."""
        self._handles: list[Any] = []
        self._thread: int | None = None

    def _hook(self, layer: int) -> Any:
        deepest = max(self.modules)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if threading.get_ident() != self._thread or layer in self.last:
                return  # another thread's pass, or a decoding call after the prefill
            hidden = output[0] if isinstance(output, tuple) else output  # [calls' rows, seq, hidden]
            check_call_rows(hidden.shape[0], self.call_rows if self.call_rows is not None else len(self.mask))
            if self.rows is not None:
                hidden = hidden[self.rows.to(hidden.device)]  # [batch, seq, hidden]
            mask = self.mask.to(hidden.device)
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            last = mask.shape[1] - 1 - mask.flip(1).long().argmax(1)  # each row's last real token
            self.last[layer] = hidden[rows, last].detach().float().clone()
            weights = mask.unsqueeze(-1).to(torch.float32)  # [batch, seq, 1]
            self.mean[layer] = ((hidden.float() * weights).sum(1) / weights.sum(1)).detach()
            if self.input_ids is not None:
                self.hidden[layer] = hidden.detach().to(torch.float32, copy=True)
            if self.stop_after and layer == deepest:
                raise _StopForward

        return hook

    def __enter__(self) -> PromptReader:
        self._thread = threading.get_ident()
        self._handles = [module.register_forward_hook(self._hook(layer)) for layer, module in self.modules.items()]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def features(self, reads: Sequence[tuple[int, str]]) -> dict[tuple[int, str], Tensor]:
        """The ``[batch, hidden]`` activation of each ``(layer, position)`` read."""
        return {
            (layer, position): (self.last if position == "prompt_last" else self.mean)[layer]
            for layer, position in reads
        }

    def tokens(self, opening: Sequence[int] = ()) -> PromptTokens:
        """Every block's output at every position of the prompts (a reader given their ``input_ids``); ``opening``:
        the chat template's ids before the user's text (:func:`hf_lsad.core.prompt_tokens.fixed_openings`)."""
        if self.input_ids is None:
            raise RuntimeError("this PromptReader was made without the prompts' input_ids: it kept no token's output")
        fixed = fixed_openings(self.input_ids, self.mask, opening)
        return PromptTokens(dict(self.hidden), self.mask, self.input_ids, fixed)


class PromptPrefix:
    """The tokens every prompt of a collection opens with (the chat template's opening and its system turn), run once
    through the blocks up to the deepest read: their keys and values, and each read block's output summed over them.

    :func:`read_after_prefix` then runs only the rest of each prompt against them and gives the features a pass over
    the whole prompt gives, to float round-off: causal attention leaves the prefix's outputs the same in every prompt.
    Under a system turn of a few sentences that is about half of a collection's tokens. Made by :meth:`run`.
    """

    def __init__(
        self,
        config: Any,
        layers: list[int],
        length: int,
        sums: dict[int, Tensor],
        keys_values: list[tuple[Tensor, Tensor]],
    ) -> None:
        self.config = config
        """The model's config, which lays out its cache."""
        self.layers = layers
        """The blocks read, up to the deepest, whose keys and values the prefix holds."""
        self.length = length
        """The prefix's length in tokens."""
        self.sums = sums
        """Per read block, ``[hidden]``: its output summed over the prefix's tokens (float32)."""
        self.keys_values = keys_values
        """Per block up to the deepest read, ``[1, kv_heads, prefix, head_dim]`` keys and values."""

    @classmethod
    @torch.no_grad()
    def run(cls, model: PreTrainedModel, layers: Sequence[int], prefix_ids: Sequence[int]) -> PromptPrefix | None:
        """The prefix ``prefix_ids`` run through ``model`` up to the deepest of ``layers``; ``None`` for a model whose
        cache keeps no keys and values per block (linear attention, say), whose prompts are then run whole."""
        if not prefix_ids:
            raise ValueError("a prompt prefix needs at least one token")
        read = sorted(set(layers))
        ids = torch.tensor([list(prefix_ids)], device=model.device)  # [1, prefix]
        modules = {layer: decoder_layer(model, layer)[1] for layer in read}
        cache = DynamicCache(config=model.config)
        with PromptReader(modules, torch.ones_like(ids)) as reader:
            try:
                model(input_ids=ids, past_key_values=cache, use_cache=True)
            except _StopForward:
                pass
        keys_values = []
        for layer in cache.layers[: max(read) + 1]:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, Tensor) or not isinstance(values, Tensor):
                return None
            keys_values.append((keys, values))
        sums = {layer: reader.mean[layer][0] * ids.shape[1] for layer in read}
        return cls(model.config, read, ids.shape[1], sums, keys_values)

    def cache(self, batch: int) -> DynamicCache:
        """A fresh cache of the prefix for ``batch`` rows (a pass appends the rest of its prompts to it)."""
        cache = DynamicCache(config=self.config)
        # Views, not copies: a dynamic cache concatenates what it is given (a copy of its own), and the pass that
        # follows appends the rests to it.
        for index, (keys, values) in enumerate(self.keys_values):  # each [1, kv_heads, prefix, head_dim]
            cache.update(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), index)
        return cache


@torch.no_grad()
def prefix_reader(
    model: PreTrainedModel,
    reads: Sequence[tuple[int, str]],
    prefix: PromptPrefix,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    keep_tokens: bool = False,
) -> PromptReader:
    """The :class:`PromptReader` of ``reads`` after one forward pass over the rest of each prompt (``input_ids``
    ``[batch, seq]`` after ``prefix``, left- or right-padded, at least one real token a row) against the prefix's
    cache, cut after the deepest read. It reads the rests alone: ``read_after_prefix`` adds the prefix to the mean;
    ``keep_tokens`` keeps every token's output of the rests."""
    check_prompt_tensors(input_ids, attention_mask)
    layers = sorted({layer for layer, _ in reads})
    if not set(layers) <= set(prefix.layers) or max(layers) != max(prefix.layers):
        raise ValueError(f"the prefix was run to blocks {prefix.layers}; these reads need {layers}")
    modules = prompt_read_modules(model, reads)
    batch, length = input_ids.shape
    mask = torch.cat([attention_mask.new_ones(batch, prefix.length), attention_mask], 1)  # [batch, prefix + seq]
    position_ids = prefix.length + (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # pads take no position
    cache_position = torch.arange(prefix.length, prefix.length + length, device=input_ids.device)
    with PromptReader(modules, attention_mask, input_ids=input_ids if keep_tokens else None) as reader:
        try:
            model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=prefix.cache(batch),
                use_cache=True,
                cache_position=cache_position,
            )
        except _StopForward:
            pass
    return reader


def read_after_prefix(
    model: PreTrainedModel,
    reads: Sequence[tuple[int, str]],
    prefix: PromptPrefix,
    input_ids: Tensor,
    attention_mask: Tensor,
) -> dict[tuple[int, str], Tensor]:
    """:func:`prompt_features` of prompts that open with ``prefix``, given the rest of each: ``input_ids``
    ``[batch, seq]`` after the prefix, left- or right-padded, with at least one real token a row. One forward pass over
    the rests, cut after the deepest read (:func:`prefix_reader`); ``prompt_mean`` sums the prefix's outputs in."""
    reader = prefix_reader(model, reads, prefix, input_ids, attention_mask)
    counts = attention_mask.sum(1, keepdim=True).float()  # [batch, 1]
    features = {}
    for layer, position in reads:
        if position == "prompt_last":
            features[(layer, position)] = reader.last[layer]
        else:  # on the block's device (a model split over devices has its blocks on several)
            count = counts.to(reader.mean[layer].device)
            features[(layer, position)] = (prefix.sums[layer] + reader.mean[layer] * count) / (prefix.length + count)
    return features


def generation_prompt_reader(
    model: PreTrainedModel,
    reads: Sequence[tuple[int, str]],
    generate_kwargs: dict[str, Any],
    *,
    keep_tokens: bool = False,
) -> PromptReader:
    """A :class:`PromptReader` of ``reads`` for one ``model.generate(**generate_kwargs)`` call: it reads the prefill
    call only (left or right padding alike), one row per returned sequence (:func:`prefill_rows`), and lets the
    forward pass run on. A guard with supervised heads reads all its prompt reads here; ``keep_tokens`` keeps every
    token's output for explanations (:meth:`PromptReader.tokens`)."""
    input_ids = generate_kwargs["input_ids"]
    mask = generate_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    batch = input_ids.shape[0]
    rows = prefill_rows(model, generate_kwargs, batch)
    repeats = num_return_sequences(model, generate_kwargs)  # each prompt's returned sequences
    mask, input_ids = mask.repeat_interleave(repeats, dim=0), input_ids.repeat_interleave(repeats, dim=0)
    return PromptReader(
        prompt_read_modules(model, reads),
        mask,
        stop_after=False,
        input_ids=input_ids if keep_tokens else None,
        rows=rows,
        call_rows=prefill_call_rows(model, generate_kwargs, batch),
    )


def prompt_features(
    model: PreTrainedModel, reads: Sequence[tuple[int, str]], input_ids: Tensor, attention_mask: Tensor
) -> dict[tuple[int, str], Tensor]:
    """Float32 ``[batch, hidden]`` activations of each ``(layer, position)`` in ``reads`` (positions of
    :data:`PROMPT_POSITIONS`) from one forward pass cut after the deepest of those layers.

    Several layers cost one pass to the deepest: reading layers 8, 16 and 24 of a 30-block model costs
    about 25/30 of a forward pass. ``prompt_last`` equals :func:`prefill_activations`. Layers are
    0-based indices (not negative ones), as a guard records them.
    """
    return read_prompts(model, reads, input_ids, attention_mask).features(reads)


@torch.no_grad()
def read_prompts(
    model: PreTrainedModel,
    reads: Sequence[tuple[int, str]],
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    keep_tokens: bool = False,
) -> PromptReader:
    """The :class:`PromptReader` of ``reads`` after one forward pass over the prompts, cut after the deepest read
    (:func:`prompt_features` reads its features; ``keep_tokens`` keeps every token's output for explanations)."""
    check_prompt_tensors(input_ids, attention_mask)
    if any(layer < 0 for layer, _ in reads):
        raise ValueError(f"layers are 0-based block indices, got {sorted({layer for layer, _ in reads})}")
    modules = prompt_read_modules(model, reads)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with PromptReader(modules, attention_mask, input_ids=input_ids if keep_tokens else None) as reader:
        try:
            model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        except _StopForward:
            pass
    missing = sorted(set(modules) - set(reader.last))
    if missing:
        raise RuntimeError(f"decoder blocks {missing} did not run in the forward pass")
    return reader
