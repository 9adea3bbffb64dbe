"""The request bodies of the OpenAI-compatible routes, as pydantic models: what FastAPI checks before a route runs.

Fields that do not change the answer (``user``, ``metadata``, ``store``, ...) are accepted and ignored, so existing
clients work unchanged; fields that would change it and that this server does not implement (:data:`UNSUPPORTED`:
tools, ``response_format``, ``echo``) are refused when set to anything but their defaults: an answer that silently
ignored them would not be the one asked for. Sizes are checked against the server's limits in
:mod:`hf_lsad.serving.app`. Counts, switches and sampling numbers are strict JSON types: ``true`` is not a count
of 1, ``"0.7"`` not a temperature, and NaN or infinity no number at all; ``null`` is the default, as the OpenAI API
reads it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..capture.collect import prompt_problem
from ..core.text import unencodable

UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "response_format": ({"type": "text"}, {}),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "audio": (),
    "web_search_options": (),
}
"""Request fields that would change the answer and that the server does not implement, each with the values that
leave the answer as it is (an empty list of tools, plain text, one candidate, ``echo: false``, text out and no audio,
no web search): refused when set to anything else. ``null`` is the default, as for every field."""

MAX_STOP_SEQUENCES = 4
"""Stop sequences a request may give, as the OpenAI API allows."""

MAX_LOGIT_BIAS = 100.0
"""The largest bias a token may be given either way, as the OpenAI API allows: -100 bans a token, 100 all but forces
it."""


class ContentPart(BaseModel):
    """One part of a message's content; only text parts can be read by a language model."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn of a conversation."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_or_text_parts(cls, value: Any) -> Any:
        # Checked before pydantic tries each member of the union, whose errors would name the string member of
        # a list that holds an image part.
        if isinstance(value, list):
            check_text_parts(value)
        elif not isinstance(value, str):
            raise ValueError(f"a string or a list of text parts, got {json_type(value)}")
        else:
            check_text(value)
        return value

    @field_validator("content")
    @classmethod
    def _user_turn_has_text(cls, value: str | list[ContentPart], info: ValidationInfo) -> str | list[ContentPart]:
        # An empty user turn is an empty prompt, refused as the Python API, the CLI and /v1/completions refuse one.
        # Other turns may be empty, as the OpenAI API allows.
        why = prompt_problem(joined(value))
        if info.data.get("role") == "user" and why:
            raise ValueError(f"a user turn is {why}")
        return value

    def text(self) -> str:
        return joined(self.content)


class StreamOptions(BaseModel):
    """``stream_options`` of a streamed request."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = Field(default=False, strict=True)
    """Send the usage in a chunk of its own before ``data: [DONE]``, its ``choices`` empty, and ``usage: null`` in
    every other chunk, as the OpenAI API; without it a stream carries no usage."""

    @field_validator("include_usage", mode="before")
    @classmethod
    def _null_is_false(cls, value: Any) -> Any:
        return False if value is None else value


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    """The model's name; the server serves one model and answers with its name whatever is asked."""
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    """New tokens at most (default: the server's ``--default-max-tokens``)."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, strict=True, allow_inf_nan=False)
    """0: greedy decoding; above 0: sampling (default 1, as the OpenAI API)."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
    stream: bool = Field(default=False, strict=True)
    """Server-sent events, one chunk per piece of text, then ``data: [DONE]``."""
    stream_options: StreamOptions | None = None
    """With ``stream``: whether the stream ends with the usage (:class:`StreamOptions`)."""
    n: int = Field(default=1, ge=1, strict=True)
    """Choices per request, at most the server's ``max_choices``: rows of one ``generate`` call, each with its own
    report (greedy decoding answers alike in each; sampling draws each apart)."""
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, strict=True, allow_inf_nan=False)
    """Lowers the logit of every token the answer has written by this, once (below 0: raises it), as the OpenAI API;
    the prompt's tokens do not count."""
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, strict=True, allow_inf_nan=False)
    """Lowers the logit of every token the answer has written by this times the times it has written it."""
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64, strict=True)
    """Sampling (``temperature`` above 0) draws with a generator of this seed, the request's own: the same request
    gets the same answer, whatever other requests draw meanwhile."""
    logit_bias: dict[int, float] | None = None
    """Token id (written as a string, as JSON keys are) to a number from -100 to 100 added to the token's logit before
    sampling and the penalties, as the OpenAI API; ids beyond the model's vocabulary are refused
    (:mod:`hf_lsad.serving.app`)."""
    stop: list[str] | None = None
    """Up to :data:`MAX_STOP_SEQUENCES` texts (one may be given alone): the answer ends before the first of them
    it writes, with ``finish_reason: "stop"``."""

    @field_validator("stream", "n", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        # clients send null for a setting they leave alone; the OpenAI API reads it as the default
        return cls.model_fields[str(info.field_name)].default if value is None else value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_sequences(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        texts = text_or_texts(value)
        stops = [texts] if isinstance(texts, str) else texts
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if not all(stops):
            raise ValueError("a stop sequence is empty")
        return stops or None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_biases(cls, value: Any) -> dict[int, float] | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"an object of token ids to biases, got {json_type(value)}")
        biases: dict[int, float] = {}
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"{key!r} is not a token id (a whole number, written as a string)")
            number = isinstance(bias, int | float) and not isinstance(bias, bool)
            if not (number and abs(bias) <= MAX_LOGIT_BIAS):  # NaN fails the comparison too
                shown = repr(bias) if number else json_type(bias)
                raise ValueError(f"token {key}: the bias is {shown}, not a number from -100 to 100")
            biases[int(key)] = float(bias)
        return biases or None

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self

    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a chunk of the usage alone."""
        return self.stream_options is not None and self.stream_options.include_usage

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = [
                f"{name} (it takes only {' or '.join([*(json.dumps(option) for option in neutral), 'null'])})"
                for name, neutral in UNSUPPORTED.items()
                if not _neutral(data.get(name), neutral)
            ]
            if given:
                raise ValueError(f"not supported by hf-lsad serve: {'; '.join(given)}")
        return data


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is ``null`` or one of the ``neutral`` values, of its JSON type (``true`` is not 1)."""
    return value is None or any(type(value) is type(option) and value == option for option in neutral)


MAX_TOP_LOGPROBS = 20
"""The most likely tokens a chat answer may list at each position, as the OpenAI API allows (5 for a completion)."""


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    """The newer name of ``max_tokens``; wins when both are given."""
    logprobs: bool | None = Field(default=None, strict=True)
    """Give each token of the answer with its log-probability (:class:`hf_lsad.serving.decoding.TokenLogprobs`);
    ``null`` is ``false``."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    """With ``logprobs``: the most likely tokens at each position too, this many."""

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    def token_logprobs(self) -> int | None:
        """How many most likely tokens to list at each position; ``None``: no log-probabilities asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: the prompt is read as it is, without the chat template."""

    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5, strict=True)
    """Give each token of the answer with its log-probability and this many most likely tokens at each position (the
    legacy API's shape)."""

    def token_logprobs(self) -> int | None:
        """How many most likely tokens to list at each position; ``None``: no log-probabilities asked for."""
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> str:
        texts = text_or_texts(value)
        if isinstance(texts, list):
            if len(texts) != 1:
                raise ValueError(f"one prompt per request, got {len(texts)}")
            texts = texts[0]
        why = prompt_problem(texts)
        if why:
            raise ValueError(why)
        return texts


class ModerationRequest(BaseModel):
    """``POST /v1/moderations``: each input is screened as a user turn of the chat template. ``input`` is a text, a
    list of texts (a result each), or a list of parts (``{"type": "text", "text": "..."}``), one input whose text is
    theirs one after another, as the OpenAI API reads a list of multi-modal inputs; an image part is refused."""

    model_config = ConfigDict(extra="ignore")
    input: str | list[str] | list[ContentPart]
    model: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_or_texts(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            check_text_parts(value)  # before pydantic tries each member of the union, as for a chat turn
            return value
        return text_or_texts(value)

    def texts(self) -> list[str]:
        if isinstance(self.input, str):
            return [self.input]
        parts = [item for item in self.input if isinstance(item, ContentPart)]
        if parts:  # one input; the validator lets no list mix parts and texts
            return [joined(parts)]
        return [item for item in self.input if isinstance(item, str)]


def check_text_parts(parts: list[Any]) -> None:
    """A ``ValueError`` naming the first of ``parts`` that is not a text part (an image, a file, not an object)."""
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            shown = f"a part of type {kind!r}" if isinstance(kind, str) else json_type(part)
            text_part = '{"type": "text", "text": "..."}'
            raise ValueError(f"part {index} is {shown}: only text parts ({text_part}) can be read")
        check_text(part["text"], f"part {index}")


def check_text(text: str, what: str | None = None) -> None:
    """A ``ValueError`` when ``text`` is not Unicode text a tokenizer can encode
    (:func:`~hf_lsad.core.text.unencodable`): a JSON ``\\ud800`` escape makes a lone surrogate."""
    why = unencodable(text)
    if why:
        raise ValueError(why if what is None else f"{what} is {why}")


def joined(content: str | list[ContentPart]) -> str:
    """A message's text: its string, or its text parts one after another."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


def text_or_texts(value: Any) -> str | list[str]:
    """``value`` if it is a string or a list of strings; a ``ValueError`` naming what it is otherwise."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise ValueError(f"item {index} is {json_type(item)}, not a string")
            check_text(item, f"item {index}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"a string or a list of strings, got {json_type(value)}")
    check_text(value)
    return value


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, as a client wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
