"""Checks on what a user passes to guarded ``generate`` and ``screen``, before any compute is spent.

Decisions (docs/usage.md, "Thread safety and inputs"):

- **Padding**: left and right padding are both supported; each row is read at its last
  real token (:func:`hf_lsad.capture.recorder.last_token_positions`), so no check is needed here.
- **Types and shapes**: ``input_ids`` is a 2-D integer tensor with a token in every row, and
  ``attention_mask`` matches it (:func:`check_prompt_tensors`); anything else fails here with a
  typed error instead of inside transformers.
- **Context**: a row whose prompt is longer than the model's context
  (``max_position_embeddings``) is an :class:`~hf_lsad.errors.InputError`: positions past
  the context are outside what the model (and so the guard's activations) were trained on,
  transformers only warns, and a verdict on such a row would look as trustworthy as any
  other. For ``response_last`` a prompt that fits but leaves less room than
  ``max_new_tokens`` warns: the response may run past the context. ``screen`` applies the same
  rule (:func:`check_context`), so the two paths accept the same prompts.
- **Decoding**: beam search only where the guard reads the prompt alone, and only the decoding loops a guard can
  follow (:func:`check_generate_kwargs`; :func:`hf_lsad.capture.generate_call.check_decoding_loop`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..errors import InputError, warn
from .generate_call import check_decoding_loop, generate_setting, num_beams


def _max_new_tokens(model: PreTrainedModel, kwargs: dict[str, Any]) -> int | None:
    value = generate_setting(model, kwargs, "max_new_tokens")
    return None if value is None else int(value)


def check_prompt_tensors(input_ids: Any, attention_mask: Any = None) -> None:
    """Raise for ``input_ids`` / ``attention_mask`` that are not what a causal LM reads, before any forward pass.

    ``input_ids`` must be a 2-D integer tensor ``[batch, seq]`` with at least one row and one
    token (:class:`TypeError` for a list, a float tensor; :class:`InputError` for a wrong shape);
    ``attention_mask``, when given, a tensor of the same shape.
    """
    if not isinstance(input_ids, Tensor):
        raise TypeError(
            f"input_ids must be a torch.Tensor [batch, seq] of token ids, got a {type(input_ids).__name__} "
            "(tokenize with return_tensors='pt', or hf_lsad.encode_prompts)"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.ndim != 2:
        raise InputError(
            f"input_ids must be 2-D [batch, seq], got shape {tuple(input_ids.shape)} (a single prompt: input_ids[None])"
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise InputError(f"input_ids of shape {tuple(input_ids.shape)} holds no prompt token")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got a {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise InputError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}: "
            "they must match"
        )
    check_real_tokens(attention_mask)


def check_real_tokens(attention_mask: Tensor) -> None:
    """Raise :class:`InputError` naming the rows of ``attention_mask`` ``[batch, seq]`` that hold no real token."""
    empty = (~attention_mask.bool().any(1)).nonzero().flatten().tolist()
    if empty:
        raise InputError(f"rows {empty} of attention_mask hold no real token (all padding)")


def prompt_lengths(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Real (unpadded) tokens per row."""
    if attention_mask is not None and attention_mask.ndim == 2:
        return attention_mask.long().sum(1)
    return input_ids.new_full((input_ids.shape[0],), input_ids.shape[1]).long()


def check_context(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Raise :class:`InputError` for a row longer than the model's context, or a token id the model has no
    embedding for (:func:`check_vocabulary`); return the rows' lengths."""
    check_prompt_tensors(input_ids, attention_mask)
    check_vocabulary(model, input_ids)
    lengths = prompt_lengths(input_ids, attention_mask)
    check_lengths_fit(model, lengths)
    return lengths


def check_vocabulary(model: PreTrainedModel, input_ids: Tensor) -> None:
    """Raise :class:`InputError` for an id in ``input_ids`` (padding included, which the model embeds too) outside
    the rows of the model's input embedding: ids of another tokenizer, which transformers meets as an ``IndexError``
    inside the forward pass."""
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if rows is None:
        return
    outside = (input_ids < 0) | (input_ids >= rows)
    if outside.any():
        ids = input_ids[outside].unique()
        listed = ", ".join(str(i) for i in ids[:5].tolist()) + (", ..." if len(ids) > 5 else "")
        raise InputError(
            f"input_ids hold token ids ({listed}) outside the model's vocabulary [0, {rows}): were they made by "
            "another model's tokenizer?"
        )


def check_lengths_fit(model: PreTrainedModel, lengths: Tensor) -> None:
    """Raise :class:`InputError` when a row of these prompt ``lengths`` (in tokens) is longer than the model's
    context, naming the row by its index in ``lengths``."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest, row = int(lengths.max()), int(lengths.argmax())
    if context and longest > context:
        name = model.config.name_or_path or type(model).__name__
        raise InputError(
            f"row {row} holds a prompt of {longest} tokens, longer than the context of {name} "
            f"(max_position_embeddings={context}); the model, and so the guard, cannot read it meaningfully. "
            "Truncate the prompt (e.g. tokenizer(..., truncation=True, max_length=...))"
        )


def check_generate_inputs(model: PreTrainedModel, guard: Any, kwargs: dict[str, Any]) -> None:
    """Raise for malformed inputs (:func:`check_prompt_tensors`) and prompts beyond the model's context
    (:func:`check_context`); warn when the response may run past it."""
    input_ids = kwargs.get("input_ids")
    if input_ids is None:
        raise ValueError("guarded generation needs input_ids (inputs_embeds alone are not supported)")
    lengths = check_context(model, input_ids, kwargs.get("attention_mask"))
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest, row = int(lengths.max()), int(lengths.argmax())
    new = _max_new_tokens(model, kwargs)
    if context and guard.config.hook.position == "response_last" and new is not None and longest + new > context:
        name = model.config.name_or_path or type(model).__name__
        warn(
            f"row {row}: a prompt of {longest} tokens plus max_new_tokens={new} exceeds the context of {name} "
            f"({context}); the response, and the token the guard scores, may run past it",
            UserWarning,
        )


def check_generate_kwargs(
    model: PreTrainedModel, generate_kwargs: dict[str, Any], *, prompt_only: bool = False
) -> Tensor:
    """Refuse inputs and generation modes a guard cannot follow; return ``input_ids``. ``prompt_only``: the call
    reads the prompt alone (a report on, or a screen of, prompt positions), which beam search leaves in place."""
    input_ids = generate_kwargs.get("input_ids")
    if input_ids is None:
        raise ValueError("guarded generation needs input_ids (inputs_embeds alone are not supported)")
    check_prompt_tensors(input_ids, generate_kwargs.get("attention_mask"))
    if num_beams(model, generate_kwargs) != 1 and not prompt_only:
        raise ValueError(
            "beam search reorders hypotheses between steps: running guards and reads of the response need "
            "num_beams=1 (a guard that reads the prompt reports, screens and stops under beam search)"
        )
    check_decoding_loop(model, generate_kwargs)
    return input_ids
