"""How a guard's fitting prompts were given to the model, and the checks of ``generate``'s inputs against it.

A guard reads one position of the residual stream; its threshold holds only for inputs
shaped like the prompts it was fitted on. Two ways a user's input silently differs:

- **Format.** :func:`hf_lsad.capture.collect.encode_prompts` wraps each prompt as a user turn of the
  tokenizer's chat template, generation prompt included (``"chat_template"``), or passes it
  as it is (``"raw"``). A ``prompt_last`` guard reads the last prompt token, which for a
  templated prompt is the end of the generation prompt (``<|im_start|>assistant\\n`` for
  SmolLM2); a raw prompt ends elsewhere, and its scores are off by up to 2x.
- **Length.** A prompt far longer than any the guard was fitted on lies outside what its
  clusters and threshold have seen.

Both are **warnings**, not errors: a system prompt, several turns or a long document are
legitimate inputs that the checks cannot tell from a mistake, and the model reads them
fine. (Prompts beyond the model's context are errors: :mod:`hf_lsad.capture.inputs`.) A row
warns for the format when it does not start with the template's first special token or
does not end with its generation prompt (``chat_template`` guards), or when it starts
with that token (``raw`` guards); for the length when it is more than
:data:`LONG_PROMPT_FACTOR` times the longest fitting prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..errors import warn

PROMPT_FORMATS = ("chat_template", "raw")
LONG_PROMPT_FACTOR = 2.0
"""A prompt longer than this many times the longest fitting prompt warns."""


@dataclass
class InputProfile:
    """The prompts a guard was fitted on (saved in its ``config.json`` under ``inputs``)."""

    prompt_format: str
    """``"chat_template"``: user turns of the tokenizer's chat template with the generation prompt; ``"raw"``: as
    given."""
    max_prompt_tokens: int
    """Tokens of the longest fitting prompt, template included."""

    def __post_init__(self) -> None:
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"unknown prompt_format {self.prompt_format!r}; choose one of {PROMPT_FORMATS}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


class TemplateMarkers(NamedTuple):
    """Token ids that mark a chat-template prompt of one tokenizer."""

    start: int | None
    """The template's first token when it is a special token (``<|im_start|>``), else ``None``."""
    generation_prompt: tuple[int, ...]
    """The ids ``add_generation_prompt=True`` appends (``<|im_start|>assistant\\n``)."""
    text: str
    """Both, as text, for messages."""
    opening: tuple[int, ...]
    """The ids before the user's text (``<|im_start|>system\\n...<|im_start|>user\\n``): the same in every prompt,
    and so, in a causal model, the residual stream at them too."""


def template_markers(tokenizer: Any) -> TemplateMarkers | None:
    """The markers of ``tokenizer``'s chat template, ``None`` when it has none."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def ids(content: str, generation_prompt: bool) -> list[int]:
        turn = [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(turn, add_generation_prompt=generation_prompt, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    with_prompt, without, other = ids("x", True), ids("x", False), ids("y", True)
    suffix = with_prompt[len(without) :] if with_prompt[: len(without)] == without else []
    start = with_prompt[0] if with_prompt and with_prompt[0] in set(tokenizer.all_special_ids) else None
    text = f"start with {tokenizer.decode([start])!r} and " if start is not None else ""
    opening = next((i for i, (a, b) in enumerate(zip(with_prompt, other)) if a != b), 0)  # where the texts part
    return TemplateMarkers(
        start, tuple(suffix), text + f"end with {tokenizer.decode(suffix)!r}", tuple(with_prompt[:opening])
    )


def template_opening(tokenizer: Any) -> tuple[int, ...]:
    """:attr:`TemplateMarkers.opening` of ``tokenizer`` (empty without a tokenizer or a chat template); a guarded
    model reads it from its :class:`InputWarner`, which computes the markers once per tokenizer."""
    return InputWarner().opening(tokenizer)


def input_warnings(
    profile: InputProfile, markers: TemplateMarkers | None, input_ids: Tensor, attention_mask: Tensor | None
) -> list[str]:
    """One message per kind of mismatch between ``input_ids`` ``[batch, seq]`` and ``profile`` (empty: none).

    Each row is read between its first and last real token (left or right padding). Without
    ``markers`` (no tokenizer, or one without a chat template) the format is not checked.
    """
    mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    lengths = mask.sum(1)
    messages = []
    long_rows = (lengths > LONG_PROMPT_FACTOR * profile.max_prompt_tokens).nonzero().flatten().tolist()
    if long_rows:
        messages.append(
            f"rows {long_rows} hold prompts of up to {int(lengths.max())} tokens, more than {LONG_PROMPT_FACTOR:g}x "
            f"the "
            f"longest prompt the guard was fitted on ({profile.max_prompt_tokens} tokens): its clusters and threshold "
            "have seen nothing like them, so treat their verdicts with care"
        )
    if markers is None:
        return messages
    odd_rows = []
    for row in range(len(input_ids)):
        tokens = input_ids[row][mask[row]].tolist()
        starts = markers.start is not None and tokens[:1] == [markers.start]
        if profile.prompt_format == "raw":
            odd = starts
        else:
            ends = tuple(tokens[-len(markers.generation_prompt) :]) == markers.generation_prompt
            odd = not ends or (markers.start is not None and not starts)
        if odd:
            odd_rows.append(row)
    if odd_rows:
        if profile.prompt_format == "raw":
            expected = "the guard was fitted on raw prompts, but these start with the chat template's first token"
        else:
            expected = (
                "the guard was fitted on prompts formatted with the chat template and its generation prompt, "
                f"which {markers.text}; these do not (format them with tokenizer.apply_chat_template(..., "
                "add_generation_prompt=True) or hf_lsad.encode_prompts)"
            )
        messages.append(f"rows {odd_rows} do not look like the guard's fitting prompts: {expected}; scores may be off")
    return messages


class InputWarner:
    """Warns for ``generate``'s or ``screen``'s rows formatted unlike, or far longer than, a guard's fitting prompts.

    Holds the markers of the last tokenizer it saw, so they are computed once per tokenizer (it can be swapped); the
    explanations read the template's opening from them too (:meth:`opening`).
    """

    def __init__(self) -> None:
        self._markers_of: tuple[Any, TemplateMarkers | None] = (None, None)  # (tokenizer, its chat-template markers)

    def markers(self, tokenizer: Any) -> TemplateMarkers | None:
        """:func:`template_markers` of ``tokenizer`` (``None`` without one), computed once per tokenizer."""
        if self._markers_of[0] is not tokenizer:
            self._markers_of = (tokenizer, template_markers(tokenizer) if tokenizer is not None else None)
        return self._markers_of[1]

    def opening(self, tokenizer: Any) -> tuple[int, ...]:
        """:attr:`TemplateMarkers.opening` of ``tokenizer``: empty without a tokenizer or a chat template."""
        markers = self.markers(tokenizer)
        return () if markers is None else markers.opening

    def warn(self, profile: InputProfile | None, tokenizer: Any, input_ids: Any, attention_mask: Tensor | None) -> None:
        """Warn (attributed to the caller's caller) once per kind of mismatch (:func:`input_warnings`)."""
        if profile is None or not isinstance(input_ids, Tensor) or input_ids.ndim != 2:
            return
        for message in input_warnings(profile, self.markers(tokenizer), input_ids, attention_mask):
            warn(message, UserWarning)
