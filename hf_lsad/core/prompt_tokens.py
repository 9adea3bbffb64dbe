"""A prompt's residual stream at every token: what a ``prompt_mean`` read averages, kept for explanations.

The forward pass over a prompt reads each block's output at the last real token and its mean over the real tokens
(:class:`hf_lsad.capture.recorder.PromptReader`). Asked to explain a verdict (``explain=True``), it also keeps every
token's output, so that a supervised head can say which tokens raised its score
(:meth:`hf_lsad.guard.heads.SupervisedHead.explain_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class PromptTokens(NamedTuple):
    """The prompt tokens of a batch and the residual stream at each of them."""

    hidden: dict[int, Tensor]
    """Per decoder block read, its float32 output ``[batch, seq, hidden]`` at every position, padding included."""
    mask: Tensor
    """``[batch, seq]`` bool: the real tokens (the attention mask)."""
    input_ids: Tensor
    """``[batch, seq]``: the token ids, as the model read them (left- or right-padded)."""
    fixed: Tensor
    """``[batch]``: how many of each row's first real tokens an explanation does not name, because the residual
    stream at them is the same whatever the prompt says (:func:`fixed_openings`)."""

    def rows(self, index: Tensor) -> PromptTokens:
        """The rows ``index`` (a bool mask or indices over the batch)."""
        return PromptTokens(
            {layer: hidden[index.to(hidden.device)] for layer, hidden in self.hidden.items()},
            self.mask[index.to(self.mask.device)],
            self.input_ids[index.to(self.input_ids.device)],
            self.fixed[index.to(self.fixed.device)],
        )


def is_count(value: object) -> bool:
    """Whether ``value`` is an int of 0 or more (a bool is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_explain_count(explain: object) -> None:
    """Refuse a number of tokens to name that is not an int of 0 or more (``screen --explain``, ``serve --explain``)."""
    if not is_count(explain):
        raise ValueError(f"explain must be a number of tokens, 0 or more, got {explain!r}")


def check_top_k(top_k: object, *, allow_all: bool = False) -> None:
    """Refuse a number of features or tokens to list that is not an int of 0 or more (``None``, all of them, where
    ``allow_all``), before any work: ``explain_top_k`` of ``generate``, ``top_k`` of ``screen`` and of a guard."""
    if not is_count(top_k) and not (top_k is None and allow_all):
        wanted = "an int of 0 or more" + (" (or None for all)" if allow_all else "")
        raise ValueError(f"top_k must be {wanted}, got {top_k!r}")


def check_explain(explain: object, top_k: object) -> None:
    """Refuse an ``explain`` that is not a bool (``explain=3``, meant as three tokens, would list ten), and, when
    explaining, a ``top_k`` that is not a count (:func:`check_top_k`): before any work."""
    if not isinstance(explain, bool):
        raise TypeError(
            f"explain must be True or False, got {explain!r} (how many features or tokens to list is explain_top_k "
            "of generate, top_k of screen and of a guard's reports)"
        )
    if explain:
        check_top_k(top_k)


def fixed_openings(input_ids: Tensor, mask: Tensor, opening: Sequence[int] = ()) -> Tensor:
    """``[batch]``: per row, the leading real tokens whose residual does not depend on what the prompt says.

    In a causal model the stream at a token sees only the tokens up to it. So a row that starts with the chat
    template's ``opening`` (:attr:`hf_lsad.core.prompt_inputs.TemplateMarkers.opening`: the system turn and the
    user turn's header) holds the same residuals there as every other templated prompt; any row's first token sees
    itself alone, and holds the model's attention sink (activations far larger than any other token's), which a
    prompt's mean always carries. Those ``len(opening)`` tokens, or the first alone, say nothing about the prompt.
    """
    fixed = []
    for ids, real in zip(input_ids.tolist(), mask.bool().tolist()):
        tokens = [token for token, keep in zip(ids, real) if keep]
        fixed.append(len(opening) if opening and tokens[: len(opening)] == list(opening) else 1)
    return torch.tensor(fixed, dtype=torch.long)
