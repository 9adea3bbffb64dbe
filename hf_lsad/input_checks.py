"""Checks on what a user passes to guarded ``generate``, before any compute is spent.

Decisions (README, "Thread safety and inputs"):

- **Padding**: left and right padding are both supported; each row is read at its last
  real token (:func:`hf_lsad.capture.last_token_positions`), so no check is needed here.
- **Context**: a row whose prompt is longer than the model's context
  (``max_position_embeddings``) is an :class:`~hf_lsad.errors.InputError`: positions past
  the context are outside what the model (and so the guard's activations) were trained on,
  transformers only warns, and a verdict on such a row would look as trustworthy as any
  other. For ``response_last`` a prompt that fits but leaves less room than
  ``max_new_tokens`` warns: the response may run past the context.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor
from transformers import PreTrainedModel

from .errors import InputError


def _max_new_tokens(model: PreTrainedModel, kwargs: dict[str, Any]) -> int | None:
    if kwargs.get("max_new_tokens") is not None:
        return int(kwargs["max_new_tokens"])
    config = kwargs.get("generation_config") or model.generation_config
    return getattr(config, "max_new_tokens", None)


def prompt_lengths(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Real (unpadded) tokens per row."""
    if attention_mask is not None and attention_mask.ndim == 2:
        return attention_mask.long().sum(1)
    return input_ids.new_full((input_ids.shape[0],), input_ids.shape[1]).long()


def check_generate_inputs(model: PreTrainedModel, guard: Any, kwargs: dict[str, Any]) -> None:
    """Raise :class:`InputError` for prompts beyond the model's context; warn when the response may run past it."""
    input_ids = kwargs.get("input_ids")
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        return  # generate_with_activations / transformers give the error
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if not context:
        return
    lengths = prompt_lengths(input_ids, kwargs.get("attention_mask"))
    longest, row = int(lengths.max()), int(lengths.argmax())
    name = model.config.name_or_path or type(model).__name__
    if longest > context:
        raise InputError(
            f"row {row} holds a prompt of {longest} tokens, longer than the context of {name} "
            f"(max_position_embeddings={context}); the model, and so the guard, cannot read it meaningfully. "
            "Truncate the prompt (e.g. tokenizer(..., truncation=True, max_length=...))"
        )
    new = _max_new_tokens(model, kwargs)
    if guard.config.hook.position == "response_last" and new is not None and longest + new > context:
        warnings.warn(
            f"row {row}: a prompt of {longest} tokens plus max_new_tokens={new} exceeds the context of {name} "
            f"({context}); the response, and the token the guard scores, may run past it",
            UserWarning,
            stacklevel=3,
        )
