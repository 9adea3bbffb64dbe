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

- **System turn.** The template puts a system turn before the user's (SmolLM2's own default, or the one a
  deployment sets: :func:`hf_lsad.capture.collect.prompt_texts`). It is a large part of every prompt mean, and a
  guard's thresholds hold only for the system turn they were set under (``heads/system_prompt`` in the benchmarks:
  chat flagged from 3% to 13% under three turns); :attr:`InputProfile.system` records it.

All are **warnings**, not errors: another system prompt, several turns or a long document are
legitimate inputs that the checks cannot tell from a mistake, and the model reads them
fine. (Prompts beyond the model's context are errors: :mod:`hf_lsad.capture.inputs`.) A row
warns for the format when it does not start with the template's first special token or
does not end with its generation prompt (``chat_template`` guards), or when it starts
with that token (``raw`` guards); for the system turn when it is formatted with the template but does not open
as the guard's system turn opens a prompt; for the length when it is more than
:data:`LONG_PROMPT_FACTOR` times the longest fitting prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from jinja2.exceptions import TemplateError
from torch import Tensor

from ..errors import warn
from .serialization import config_from_dict
from .text import unencodable

PROMPT_FORMATS = ("chat_template", "raw")
LONG_PROMPT_FACTOR = 2.0
"""A prompt longer than this many times the longest fitting prompt warns."""


def check_system_turn(system: str | None) -> None:
    """Refuse a system turn that is not ``None`` or a non-empty string of Unicode text."""
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise ValueError(f"system must be None or a non-empty string, got {system!r}")
    why = None if system is None else unencodable(system)
    if why:
        raise ValueError(f"the system turn is {why}")


def turn_label(system: str | None) -> str:
    """A system turn as messages name it: quoted, or "the chat template's default" for ``None``."""
    return "the chat template's default" if system is None else repr(system)


def chat_turns(user: str, system: str | None = None) -> list[dict[str, str]]:
    """The messages of one prompt: the system turn when given (``None``: the template adds its default, if it has
    one), then the user's turn."""
    opening = [{"role": "system", "content": system}] if system is not None else []
    return [*opening, {"role": "user", "content": user}]


def _is_digest(value: object) -> bool:
    digits = value.removeprefix("sha256:") if isinstance(value, str) and value.startswith("sha256:") else ""
    return len(digits) == 64 and all(c in "0123456789abcdef" for c in digits)


@dataclass
class InputProfile:
    """The prompts a guard was fitted on (saved in its ``config.json`` under ``inputs``)."""

    prompt_format: str
    """``"chat_template"``: user turns of the tokenizer's chat template with the generation prompt; ``"raw"``: as
    given."""
    max_prompt_tokens: int
    """Tokens of the longest fitting prompt, template included."""
    system: str | None = None
    """The system turn before each prompt's user turn, the one the guard's thresholds were set under (``None``: none
    given, so the chat template's own default if it has one). ``hf-lsad set-budget --system`` records it; folders and
    stores written before this field existed load as ``None``."""
    adapter: str | None = None
    """The peft adapters the model ran the prompts through (``sha256:...``:
    :func:`hf_lsad.capture.adapters.adapter_digest`), ``None`` for none: the guard's thresholds hold for the model
    with those adapters. Folders and stores written before this field existed load as ``None``."""

    def __post_init__(self) -> None:
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"unknown prompt_format {self.prompt_format!r}; choose one of {PROMPT_FORMATS}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        check_system_turn(self.system)
        if self.system is not None and self.prompt_format != "chat_template":
            raise ValueError("a system turn needs prompt_format 'chat_template'")
        if self.adapter is not None and not _is_digest(self.adapter):
            raise ValueError(f"adapter must be None or 'sha256:' and 64 hex digits, got {self.adapter!r}")

    @classmethod
    def from_dict(cls, data: Any, *, source: str) -> InputProfile:
        """The profile saved as ``data`` (a guard's ``config.json`` or a store's index: ``source`` names it in
        errors); one written before :attr:`system` (:attr:`adapter`) existed was collected without a system turn
        (an adapter)."""
        written = {"system": None, "adapter": None, **data} if isinstance(data, dict) else data
        return config_from_dict(cls, written, source=source)


class TemplateMarkers(NamedTuple):
    """Token ids that mark a chat-template prompt of one tokenizer."""

    start: int | None
    """The template's first token when it is a special token (``<|im_start|>``), else ``None``."""
    generation_prompt: tuple[int, ...]
    """The ids ``add_generation_prompt=True`` appends (``<|im_start|>assistant\\n``)."""
    text: str
    """Both, as text, for messages."""
    opening: tuple[int, ...]
    """The ids before the user's text (``<|im_start|>system\\n...<|im_start|>user\\n``): the same in every prompt
    under one system turn, and so, in a causal model, the residual stream at them too."""
    first_tokens: frozenset[int]
    """The special tokens a templated prompt opens with, under the template's default turn or a system turn of its
    own (``<|im_start|>`` alone for SmolLM2; ``<|user|>`` and ``<|system|>`` for a template without a default)."""
    turn_opening: tuple[int, ...]
    """:attr:`opening` without a last id of whitespace (the newline after ``user``), which a user's text that starts
    with whitespace merges into: what every prompt under this system turn opens with."""


def template_markers(tokenizer: Any, system: str | None = None) -> TemplateMarkers | None:
    """The markers of ``tokenizer``'s chat template for prompts under the system turn ``system`` (``None``: none
    given, the template's default), ``None`` when it has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def ids(content: str, generation_prompt: bool) -> list[int]:
        turns = chat_turns(content, system)
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=generation_prompt, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    with_prompt, without, other = ids("x", True), ids("x", False), ids("y", True)
    suffix = with_prompt[len(without) :] if with_prompt[: len(without)] == without else []
    special = set(tokenizer.all_special_ids)
    start = with_prompt[0] if with_prompt and with_prompt[0] in special else None
    text = f"start with {tokenizer.decode([start])!r} and " if start is not None else ""
    opening = next((i for i, (a, b) in enumerate(zip(with_prompt, other)) if a != b), 0)  # where the texts part
    fixed = with_prompt[:opening]
    mergeable = bool(fixed) and fixed[-1] not in special and not tokenizer.decode(fixed[-1:]).strip()
    return TemplateMarkers(
        start,
        tuple(suffix),
        text + f"end with {tokenizer.decode(suffix)!r}",
        tuple(fixed),
        frozenset(_first_tokens(tokenizer)) & special,
        tuple(fixed[:-1] if mergeable else fixed),
    )


def _first_tokens(tokenizer: Any) -> set[int]:
    """The first token of a prompt under the template's default turn and under a system turn of its own (the first
    alone when the template refuses a system role)."""
    firsts = set()
    for system in (None, "s"):
        try:
            text = tokenizer.apply_chat_template(chat_turns("x", system), add_generation_prompt=True, tokenize=False)
        except TemplateError:  # a template that raises on a system role: its prompts open one way only
            continue
        firsts.update(tokenizer(text, add_special_tokens=False)["input_ids"][:1])
    return firsts


def template_opening(tokenizer: Any) -> tuple[int, ...]:
    """:attr:`TemplateMarkers.opening` of ``tokenizer`` (empty without a tokenizer or a chat template); a guarded
    model reads it from its :class:`InputWarner`, which computes the markers once per tokenizer."""
    return InputWarner().opening(tokenizer)


def input_warnings(
    profile: InputProfile, markers: TemplateMarkers | None, input_ids: Tensor, attention_mask: Tensor | None
) -> list[str]:
    """One message per kind of mismatch between ``input_ids`` ``[batch, seq]`` and ``profile`` (empty: none).

    Each row is read between its first and last real token (left or right padding): :func:`token_row_warnings` of
    those tokens.
    """
    mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    return token_row_warnings(profile, markers, [input_ids[row][mask[row]].tolist() for row in range(len(input_ids))])


def token_row_warnings(profile: InputProfile, markers: TemplateMarkers | None, rows: Sequence[list[int]]) -> list[str]:
    """One message per kind of mismatch between prompts given as their token ids (no padding) and ``profile``, naming
    the rows by their index in ``rows`` (empty: none).

    Without ``markers`` (no tokenizer, or one without a chat template) the format is not checked; ``markers`` are those
    of the profile's system turn (:func:`template_markers`).
    """
    lengths = [len(tokens) for tokens in rows]
    messages = []
    long_rows = [row for row, length in enumerate(lengths) if length > LONG_PROMPT_FACTOR * profile.max_prompt_tokens]
    if long_rows:
        messages.append(
            f"rows {long_rows} hold prompts of up to {max(lengths)} tokens, more than {LONG_PROMPT_FACTOR:g}x "
            f"the "
            f"longest prompt the guard was fitted on ({profile.max_prompt_tokens} tokens): its clusters and threshold "
            "have seen nothing like them, so treat their verdicts with care"
        )
    if markers is None:
        return messages
    odd_rows, other_turn_rows = [], []
    opening = list(markers.turn_opening)
    for row, tokens in enumerate(rows):
        starts = bool(tokens) and tokens[0] in markers.first_tokens
        if profile.prompt_format == "raw":
            odd = starts
        else:
            ends = tuple(tokens[-len(markers.generation_prompt) :]) == markers.generation_prompt
            odd = not ends or (markers.start is not None and not starts)
            if not odd and tokens[: len(opening)] != opening:
                other_turn_rows.append(row)
        if odd:
            odd_rows.append(row)
    if other_turn_rows:
        messages.append(
            f"rows {other_turn_rows} open with another system turn than the one the guard's thresholds were set "
            f"under ({turn_label(profile.system)}): verdicts move with the system turn, so the flag rate may be far "
            "from the guard's target and harm may pass; teach the guard under yours with `hf-lsad teach --system` "
            "(teach_traffic(..., system=...)), or set its thresholds under it with `hf-lsad set-budget --system`"
        )
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


def unmasked_padding_warnings(input_ids: Tensor, attention_mask: Tensor | None, pad_token_id: int | None) -> list[str]:
    """A message when a batch ``[batch, seq]`` comes without ``attention_mask`` and some of its rows open or close with
    the pad token: read as prompt, the padding moves those rows' scores (transformers cannot infer the mask either when
    the pad token is also EOS, as in SmolLM2)."""
    if attention_mask is not None or pad_token_id is None or len(input_ids) < 2:
        return []
    padded = (input_ids[:, 0] == pad_token_id) | (input_ids[:, -1] == pad_token_id)
    rows = padded.nonzero().flatten().tolist()
    if not rows:
        return []
    return [
        f"rows {rows} open or close with the pad token (id {pad_token_id}) and no attention_mask was given: their "
        "padding is read as part of the prompt, which moves their scores; pass the attention_mask the tokenizer "
        "returned (generate(**inputs), or hf_lsad.encode_prompts)"
    ]


class InputWarner:
    """Warns for ``generate``'s or ``screen``'s rows formatted unlike, or far longer than, a guard's fitting prompts.

    Holds the markers of the last tokenizer it saw, so they are computed once per tokenizer (it can be swapped); the
    explanations read the template's opening from them too (:meth:`opening`).
    """

    def __init__(self) -> None:
        # (tokenizer, its markers per system turn), swapped as one so that threads sharing a model read a pair
        self._markers_of: tuple[Any, dict[str | None, TemplateMarkers | None]] = (None, {})

    def markers(self, tokenizer: Any, system: str | None = None) -> TemplateMarkers | None:
        """:func:`template_markers` of ``tokenizer`` under ``system`` (``None`` without a tokenizer), computed once
        per tokenizer and system turn."""
        owner, cache = self._markers_of
        if owner is not tokenizer:
            cache = {}
            self._markers_of = (tokenizer, cache)
        if system not in cache:
            cache[system] = template_markers(tokenizer, system) if tokenizer is not None else None
        return cache[system]

    def opening(self, tokenizer: Any, system: str | None = None) -> tuple[int, ...]:
        """:attr:`TemplateMarkers.opening` of ``tokenizer`` under ``system``: empty without a tokenizer or a chat
        template."""
        markers = self.markers(tokenizer, system)
        return () if markers is None else markers.opening

    def warn(self, profile: InputProfile | None, tokenizer: Any, input_ids: Any, attention_mask: Tensor | None) -> None:
        """Warn (attributed to the user's line) once per kind of mismatch: padding read as prompt
        (:func:`unmasked_padding_warnings`), rows unlike the guard's fitting prompts (:func:`input_warnings`)."""
        if not isinstance(input_ids, Tensor) or input_ids.ndim != 2:
            return
        messages = unmasked_padding_warnings(input_ids, attention_mask, getattr(tokenizer, "pad_token_id", None))
        if profile is not None:
            messages += input_warnings(profile, self.markers(tokenizer, profile.system), input_ids, attention_mask)
        for message in messages:
            warn(message, UserWarning)

    def warn_rows(self, profile: InputProfile | None, tokenizer: Any, rows: Sequence[list[int]]) -> None:
        """:meth:`warn` for prompts given as their token ids, unpadded (:func:`token_row_warnings`): rows screened
        in several batches are checked once, by their index in the caller's list."""
        if profile is None:
            return
        for message in token_row_warnings(profile, self.markers(tokenizer, profile.system), rows):
            warn(message, UserWarning)
