"""Collecting activation sets: prompts encoded as the guard reads them, batched by length, one layer read.

:func:`prompt_texts` is the one way prompts are formatted (the user turn of the chat template, after a system turn when
given), so a guard scores the token it was fitted on. :func:`encode_prompts` tokenises them for screening, the CLI and
generation (padded on the left by default); :func:`collect_prompt_features` tokenises them once and runs the opening
they share once (:func:`read_token_batches`, which the fingerprint's probes and rows are read by too).
:func:`collect_activations` runs the recorder of :mod:`hf_lsad.capture.recorder` over a prompt list: a forward pass cut
after the hooked block for ``prompt_last``, greedy generation for the response positions, in batches of
:func:`~hf_lsad.core.batching.length_batches`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Literal, NamedTuple, TypedDict

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..core.batching import length_batches
from ..core.prompt_inputs import InputProfile, chat_turns, check_system_turn
from ..core.text import unencodable
from ..data.tables import chat_role
from .adapters import adapter_digest
from .recorder import PROMPT_POSITIONS, PromptPrefix, generate_with_activations, prompt_features, read_after_prefix


def check_prompts(prompts: Sequence[str]) -> None:
    """Raise ``TypeError`` for a non-list or a non-string prompt, ``ValueError`` for an empty list or a prompt that
    cannot be read (:func:`prompt_problem`)."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings, not a single string")
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of strings, got a {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("the prompt list is empty")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise TypeError(f"prompt {i} is not a string but {type(prompt).__name__}: {prompt!r}")
        why = prompt_problem(prompt)
        if why:
            raise ValueError(f"prompt {i} is {why}")


def prompt_problem(prompt: str) -> str | None:
    """Why ``prompt`` cannot be read (``"empty: ''"``, whitespace only, or not Unicode text:
    :func:`~hf_lsad.core.text.unencodable`), ``None`` when it can."""
    if prompt.strip():
        return unencodable(prompt)
    # the length, not the repr: a one-line error message folds whitespace
    return f"empty: {prompt!r}" if not prompt else f"empty: whitespace only ({len(prompt)} characters)"


def check_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise ``ValueError`` for a tokenizer without a pad token: a batch of prompts of several lengths needs one."""
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos token)")


def pad_left(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
    """``input_ids`` and ``attention_mask`` ``[batch, longest]`` of prompts given as their token ids, padded on the
    left by the tokenizer (as :func:`encode_prompts` pads)."""
    padded = tokenizer.pad({"input_ids": [list(ids) for ids in token_ids]}, padding_side="left", return_tensors="pt")
    return padded["input_ids"], padded["attention_mask"]


def prompt_texts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    chat_template: bool = True,
    system: str | None = None,
) -> tuple[list[str], bool]:
    """The texts the model reads for ``prompts`` (user turns of the chat template with the generation prompt, when
    the tokenizer has one and ``chat_template``), and whether the tokenizer must add its special tokens.

    ``system``: a system turn before each user turn, as a deployment sets one (``None``: none, so the template's
    default, if it has one). A guard's thresholds hold for the system turn they were set under."""
    check_system_turn(system)
    if system is not None and not (chat_template and tokenizer.chat_template):
        raise ValueError("a system turn needs the tokenizer's chat template (chat_template=True and a template)")
    if chat_template and tokenizer.chat_template:
        texts = [
            str(tokenizer.apply_chat_template(chat_turns(p, system), add_generation_prompt=True, tokenize=False))
            for p in prompts
        ]
        return texts, False  # the template already holds them
    return list(prompts), True


class EncodedPrompts(TypedDict):
    """What :func:`encode_prompts` returns, ready for ``generate(**encoded)`` (a ``TypedDict``, so a type checker
    matches its two keys to ``generate``'s arguments)."""

    input_ids: Tensor
    """``[batch, tokens]`` long, padded."""
    attention_mask: Tensor
    """``[batch, tokens]``, 1 on the prompts' tokens and 0 on padding."""


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    chat_template: bool = True,
    padding_side: Literal["left", "right"] = "left",
    device: torch.device | str | None = None,
    system: str | None = None,
) -> EncodedPrompts:
    """Tokenise prompts as user turns of the chat template when it has one, padded on ``padding_side``.

    Left padding (the default) is what decoder-only generation expects; guarded ``generate`` and
    ``screen`` read right-padded rows at their last real token too, with the same scores. Only ``input_ids`` and
    ``attention_mask`` are returned: other tokenizer outputs (``token_type_ids``) are not generation inputs.
    ``device``: where the tensors go (default: the CPU), e.g. ``guarded.device``. ``system``: a system turn before
    each user turn (:func:`prompt_texts`).
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    check_prompts(prompts)
    texts, add_special_tokens = prompt_texts(tokenizer, prompts, chat_template=chat_template, system=system)
    check_pad_token(tokenizer)
    # padding_side as an argument, not by setting tokenizer.padding_side and back: that raced between threads.
    encoded = tokenizer(
        texts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens, padding_side=padding_side
    )
    return EncodedPrompts(
        input_ids=encoded["input_ids"].to(device), attention_mask=encoded["attention_mask"].to(device)
    )


def prompt_token_lengths(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    chat_template: bool = True,
    system: str | None = None,
) -> list[int]:
    """Each prompt's length in tokens as the model reads it (:func:`prompt_texts`), unpadded."""
    return [len(ids) for ids in prompt_token_ids(tokenizer, prompts, chat_template=chat_template, system=system)]


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    chat_template: bool = True,
    system: str | None = None,
) -> list[list[int]]:
    """Each prompt's token ids as the model reads it (:func:`prompt_texts`), unpadded (none for no prompts, which a
    tokenizer refuses)."""
    texts, add_special_tokens = prompt_texts(tokenizer, prompts, chat_template=chat_template, system=system)
    return _token_ids(tokenizer, texts, add_special_tokens)


def _token_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """The token ids of formatted ``texts``, unpadded (none for no texts, which a tokenizer refuses)."""
    return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"] if texts else []


def conversation_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Sequence[Mapping[str, str]]],
    *,
    system: str | None = None,
) -> list[list[int]]:
    """Each conversation's token ids as a chat server reads it for its next answer: all its ``{"role", "content"}``
    turns under the chat template, with the generation prompt (a one-turn conversation reads as
    :func:`prompt_token_ids` reads its prompt). ``system`` goes before a conversation that has no system turn of its
    own; a conversation's own system turn is kept. A ``developer`` turn is read as the system turn
    (:func:`~hf_lsad.data.tables.chat_role`)."""
    check_system_turn(system)
    if not tokenizer.chat_template:
        raise ValueError("reading conversations needs the tokenizer's chat template")
    texts = []
    for conversation in conversations:
        turns = [{**turn, "role": chat_role(turn["role"])} for turn in conversation]
        if system is not None and not any(turn.get("role") == "system" for turn in turns):
            turns.insert(0, {"role": "system", "content": system})
        texts.append(str(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)))
    return _token_ids(tokenizer, texts, False)  # the template holds the special tokens


def prompt_batches(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    batch_size: int,
    max_batch_tokens: int | None = None,
    *,
    chat_template: bool = True,
    system: str | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """:func:`~hf_lsad.core.batching.length_batches` of ``prompts``: ``batch_size`` at a time in order of their
    length in characters (``max_batch_tokens=None``, how every bundled collection was made), or in order of their
    length in tokens, as the model reads them, with at most ``max_batch_tokens`` padded tokens a batch.
    ``token_ids``: the prompts' :func:`prompt_token_ids`, when the caller has them already."""
    if max_batch_tokens is None:
        return length_batches([len(prompt) for prompt in prompts], batch_size)
    if token_ids is None:
        token_ids = prompt_token_ids(tokenizer, prompts, chat_template=chat_template, system=system)
    return length_batches([len(ids) for ids in token_ids], batch_size, max_batch_tokens)


def shared_prefix_length(token_ids: Sequence[Sequence[int]]) -> int:
    """How many tokens every sequence of ``token_ids`` opens with, leaving each at least one of its own (0 for
    none)."""
    if not token_ids:
        return 0
    limit = min(len(ids) for ids in token_ids) - 1
    first = token_ids[0]
    length = 0
    while length < limit and all(ids[length] == first[length] for ids in token_ids):
        length += 1
    return length


def prompt_format(tokenizer: PreTrainedTokenizerBase, chat_template: bool = True) -> str:
    """How prompts reach the model (:class:`~hf_lsad.core.prompt_inputs.InputProfile`): ``"chat_template"`` when they
    are user turns of the tokenizer's template, else ``"raw"``."""
    return "chat_template" if chat_template and tokenizer.chat_template else "raw"


class Collected(NamedTuple):
    """What :func:`collect_activations` read from the prompts, in their order."""

    activations: Tensor
    """``[n_prompts, hidden]`` float32 on the CPU, in prompt order."""
    responses: list[str]
    """The model's greedy responses (empty strings for ``prompt_last``)."""
    inputs: InputProfile
    """How the prompts were formatted and the longest one, in tokens (for the store and the guard)."""


@torch.no_grad()
def collect_activations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    layer: int,
    position: str = "response_last",
    batch_size: int = 16,
    max_batch_tokens: int | None = None,
    max_new_tokens: int = 64,
    chat_template: bool = True,
    progress: bool = True,
) -> Collected:
    """Activations of ``prompts`` at decoder block ``layer``: greedy generation, batched, left-padded.

    Prompts are batched by length to waste little compute on padding (:func:`prompt_batches`, ``max_batch_tokens``
    counting the prompts' padded tokens); results come back in the input order. ``prompt_last`` and ``prompt_mean``
    generate nothing: they are :func:`collect_prompt_features` of the one read, a forward pass that stops after block
    ``layer``.
    """
    check_prompts(prompts)
    if position in PROMPT_POSITIONS:
        read = (layer, position)
        features, profile = collect_prompt_features(
            model,
            tokenizer,
            prompts,
            [read],
            batch_size=batch_size,
            max_batch_tokens=max_batch_tokens,
            chat_template=chat_template,
            progress=progress,
        )
        return Collected(features[read], [""] * len(prompts), profile)
    batches = prompt_batches(tokenizer, prompts, batch_size, max_batch_tokens, chat_template=chat_template)
    activations: list[Tensor] = [None] * len(prompts)  # type: ignore[list-item]
    responses = [""] * len(prompts)
    device = model.device
    longest = 0
    for batch in tqdm(batches, desc=f"collect layer {layer} {position}", disable=not progress):
        inputs = encode_prompts(tokenizer, [prompts[i] for i in batch], chat_template=chat_template, device=device)
        longest = max(longest, int(inputs["attention_mask"].sum(1).max()))
        output, acts = generate_with_activations(
            model,
            layer,
            position,
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for row, i in enumerate(batch):
            activations[i] = acts[row].float().cpu()
            responses[i] = texts[row]
    return Collected(
        torch.stack(activations),
        responses,
        InputProfile(prompt_format(tokenizer, chat_template), longest, adapter=adapter_digest(model)),
    )


@torch.no_grad()
def read_token_batches(
    model: PreTrainedModel,
    reads: Sequence[tuple[int, str]],
    token_ids: Sequence[Sequence[int]],
    batches: Sequence[list[int]],
    *,
    pad_token_id: int,
    progress: bool = False,
    desc: str = "read",
) -> Iterator[tuple[list[int], dict[tuple[int, str], Tensor]]]:
    """``(batch, features)`` for each batch of rows of ``token_ids`` (whole prompts as the model reads them), in the
    order of ``batches``: :func:`~hf_lsad.capture.recorder.prompt_features` of each read, ``[batch, hidden]`` on the
    model's device in its dtype.

    The tokens every row of ``token_ids`` opens with (the chat template's opening, the system turn) run once
    (:class:`~hf_lsad.capture.recorder.PromptPrefix`); each batch runs the rest of its rows against them, right-padded
    with ``pad_token_id``. This is the one loop that reads prompts for their features: the collections the heads are
    fitted and thresholded on, and the rows a guard's fingerprint keeps, are read by it alike.
    """
    # nothing to run: no prefix either; a model whose cache keeps no keys and values: rows run whole
    shared = shared_prefix_length(token_ids) if batches else 0
    prefix = PromptPrefix.run(model, [layer for layer, _ in reads], token_ids[0][:shared]) if shared else None
    shared = shared if prefix is not None else 0
    device = model.device
    for batch in tqdm(batches, desc=f"{desc} {len(reads)} reads", disable=not progress):
        rests = [list(token_ids[i][shared:]) for i in batch]
        width = max(len(rest) for rest in rests)
        input_ids = torch.tensor([rest + [pad_token_id] * (width - len(rest)) for rest in rests], device=device)
        attention_mask = torch.tensor([[1] * len(rest) + [0] * (width - len(rest)) for rest in rests], device=device)
        if prefix is None:  # input_ids, attention_mask: [batch, width]
            yield batch, prompt_features(model, reads, input_ids, attention_mask)
        else:
            yield batch, read_after_prefix(model, reads, prefix, input_ids, attention_mask)


@torch.no_grad()
def collect_prompt_features(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    reads: Sequence[tuple[int, str]],
    *,
    batch_size: int = 16,
    max_batch_tokens: int | None = None,
    chat_template: bool = True,
    system: str | None = None,
    progress: bool = True,
    skip: Collection[int] = (),
    on_batch: Callable[[list[int], dict[tuple[int, str], Tensor], int], None] | None = None,
    desc: str = "collect",
) -> tuple[dict[tuple[int, str], Tensor], InputProfile]:
    """``[n_prompts, hidden]`` float32 CPU activations of every ``(layer, position)`` read (prompt positions),
    one forward pass per batch cut after the deepest layer; results in input order.

    The tokens every prompt opens with (the chat template's opening, the system turn) run once
    (:class:`~hf_lsad.capture.recorder.PromptPrefix`), and each batch runs the rest of its prompts against them: the
    features of whole prompts, to float round-off, for fewer tokens.

    Prompts are batched by :func:`prompt_batches`: ``batch_size`` at a time, or under a budget of
    ``max_batch_tokens`` padded tokens. The batches change the activations by float round-off only.

    ``skip`` and ``on_batch`` resume an interrupted collection: a batch whose prompts are all in ``skip`` (positions
    already collected, say by an earlier run with the same batching) is not run, and its rows of the result are left
    for the caller to fill; ``on_batch(positions, features, longest)`` is called after each batch that runs, with its
    ``[batch, hidden]`` features per read and its longest prompt in tokens. The profile's longest prompt is of the
    batches that ran (1 when none did). ``system``: a system turn before each user turn (:func:`prompt_texts`).
    ``desc``: the progress bar's label.
    """
    check_prompts(prompts)
    check_pad_token(tokenizer)
    token_ids = prompt_token_ids(tokenizer, prompts, chat_template=chat_template, system=system)  # tokenised once
    batches = prompt_batches(
        tokenizer,
        prompts,
        batch_size,
        max_batch_tokens,
        chat_template=chat_template,
        system=system,
        token_ids=token_ids,
    )
    done = set(skip)
    batches = [batch for batch in batches if not done.issuperset(batch)]
    out = {read: torch.empty(len(prompts), model.config.get_text_config().hidden_size) for read in reads}
    longest = 0
    ran = read_token_batches(
        model, reads, token_ids, batches, pad_token_id=tokenizer.pad_token_id, progress=progress, desc=desc
    )
    for batch, features in ran:
        batch_longest = max(len(token_ids[i]) for i in batch)
        longest = max(longest, batch_longest)
        features = {read: values.float().cpu() for read, values in features.items()}
        index = torch.tensor(batch)
        for read, values in features.items():
            out[read][index] = values
        if on_batch is not None:
            on_batch(batch, features, batch_longest)
    return out, InputProfile(prompt_format(tokenizer, chat_template), max(longest, 1), system, adapter_digest(model))
