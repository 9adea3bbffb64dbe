"""What one ``model.generate`` call does with its prompts, read from its settings the way transformers reads them.

- :func:`generate_setting` is the one home of which value a setting has: the call's keyword, else the call's
  ``generation_config``, else the model's.
- How many rows the call holds and returns: beams (:func:`num_beams`), sequences per prompt
  (:func:`num_return_sequences`), the prefill's rows (:func:`prefill_call_rows`) and which of them reads each returned
  sequence (:func:`prefill_rows`); the ids that end a row (:func:`eos_token_ids`).
- The decoding loops a guard can follow (:func:`check_decoding_loop`): one forward call per new token, through the
  logits processors it is given.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel


def generate_setting(model: PreTrainedModel, generate_kwargs: dict[str, Any], name: str) -> Any:
    """The generation setting ``name`` a ``model.generate(**generate_kwargs)`` call uses, as transformers resolves
    it: the call's keyword, else the call's ``generation_config``, else the model's (``None``: none sets it)."""
    for source in (generate_kwargs, generate_kwargs.get("generation_config"), model.generation_config):
        value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
        if value is not None:
            return value
    return None


def call_generate(model: PreTrainedModel, generate_kwargs: dict[str, Any]) -> Any:
    """``model.generate(**generate_kwargs)``. ``PreTrainedModel``, the type callers hold, no longer inherits
    ``GenerationMixin`` (transformers 5), so a type checker sees no ``generate`` on it; every causal LM has one."""
    generate: Any = model.generate
    return generate(**generate_kwargs)


def eos_token_ids(model: PreTrainedModel, generate_kwargs: dict[str, Any]) -> list[int]:
    """EOS ids generate will stop on (:func:`generate_setting`)."""
    eos = generate_setting(model, generate_kwargs, "eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def num_return_sequences(model: PreTrainedModel, generate_kwargs: dict[str, Any]) -> int:
    """Sequences ``generate`` returns per prompt: it repeats each input row this many times, consecutively."""
    return int(generate_setting(model, generate_kwargs, "num_return_sequences") or 1)


def num_beams(model: PreTrainedModel, generate_kwargs: dict[str, Any]) -> int:
    """Beams of a ``generate`` call (1: no beam search)."""
    return int(generate_setting(model, generate_kwargs, "num_beams") or 1)


def prefill_rows(model: PreTrainedModel, generate_kwargs: dict[str, Any], batch: int) -> Tensor | None:
    """For each sequence a ``generate`` call over ``batch`` prompts returns, the row of its prefill call that read
    the sequence's prompt; ``None`` when they are the same rows. Sampling repeats each prompt
    ``num_return_sequences`` times and returns them all (``None``); beam search repeats it ``num_beams`` times and
    returns its best ``num_return_sequences``, so every returned sequence reads its prompt's first beam (the beams'
    prompts are the same)."""
    beams = num_beams(model, generate_kwargs)
    if beams == 1:
        return None
    return torch.arange(batch).repeat_interleave(num_return_sequences(model, generate_kwargs)) * beams


def prefill_call_rows(model: PreTrainedModel, generate_kwargs: dict[str, Any], batch: int) -> int:
    """How many rows the prefill call of a ``generate`` call over ``batch`` prompts holds: each prompt once per beam
    under beam search, else once per returned sequence."""
    beams = num_beams(model, generate_kwargs)
    return batch * (beams if beams > 1 else num_return_sequences(model, generate_kwargs))


def check_decoding_loop(model: PreTrainedModel, generate_kwargs: dict[str, Any]) -> None:
    """Refuse the decoding loops a guard cannot follow, whether the call, its ``generation_config`` or the model's
    asks for them (:func:`generate_setting`): it reads one forward call per new token and decides in the logits
    processor, before the token is picked.

    - assisted decoding (an assistant model, prompt lookup, early exit, multi-token prediction) scores several
      candidate tokens per forward call, and a flagged row could be given a drafted token of its own;
    - a custom decoding loop (``custom_generate``, or a ``generate`` a repository's code put on the model) need not
      call the guard's logits processor at all, so a flagged row would not be stopped;
    - the modes transformers runs from a Hub repository's code (DoLa, contrastive search, group and constrained
      beam search) are such loops;
    - token healing rewrites the end of the prompt before the prefill (it drops the prompt's last tokens and
      constrains the first new ones to extend them), so the guard would read another prompt than the one given;
    - chunked prefill reads the prompt in several forward calls, where the guard reads it from one (it was caught
      at the first new token, after the prompt had run);
    - a ``past_key_values`` that already holds tokens (a prefix cached by the caller) leaves them out of the
      prefill, so the guard would read part of the prompt (it failed with an ``IndexError`` inside the forward
      pass); an empty cache is fine.
    """

    def setting(name: str) -> Any:
        return generate_setting(model, generate_kwargs, name)

    assisted = [name for name in ("prompt_lookup_num_tokens", "assistant_early_exit") if setting(name) is not None]
    if generate_kwargs.get("assistant_model") is not None:
        assisted.insert(0, "assistant_model")
    if setting("use_mtp"):
        assisted.append("use_mtp")
    if assisted:
        raise ValueError(
            f"assisted decoding ({', '.join(assisted)}) is not supported by guarded generation: it scores several "
            "drafted tokens per forward pass, where the guard decides before each token is picked"
        )
    if generate_kwargs.get("custom_generate") is not None:
        raise ValueError(
            "a custom decoding loop (custom_generate) is not supported by guarded generation: it need not call the "
            "guard's logits processor"
        )
    if "generate" in vars(model):
        raise ValueError(
            "the model carries a generate of its own (as transformers puts a repository's custom_generate on a model "
            "loaded with trust_remote_code), a custom decoding loop that need not call the guard's logits processor; "
            "guarded generation needs the model class's own (`del model.generate` restores it)"
        )

    if setting("token_healing"):
        raise ValueError(
            "token healing (token_healing) is not supported by guarded generation: it rewrites the end of the prompt "
            "before the forward pass the guard reads the prompt from"
        )
    if setting("prefill_chunk_size"):
        raise ValueError(
            "chunked prefill (prefill_chunk_size) is not supported by guarded generation: it reads the prompt in "
            "several forward calls, where the guard reads it from one"
        )

    cached = cached_tokens(generate_kwargs.get("past_key_values"))
    if cached:
        raise ValueError(
            f"past_key_values holds {cached} tokens already: the prefill would read only the rest of the prompt, and "
            "the guard reads every prompt token's residual from it; pass the prompt without a filled cache (an "
            "empty one is fine)"
        )

    moved = {
        "DoLa decoding (dola_layers)": setting("dola_layers") is not None,
        "contrastive search (penalty_alpha)": bool(setting("penalty_alpha"))
        and (setting("top_k") or 0) > 1
        and not setting("do_sample"),
        "group beam search (num_beam_groups)": (setting("num_beam_groups") or 1) > 1,
        "constrained beam search (constraints, force_words_ids)": setting("constraints") is not None
        or setting("force_words_ids") is not None,
    }
    for mode, asked in moved.items():
        if asked:
            raise ValueError(
                f"{mode} is not supported by guarded generation: transformers runs it as a custom decoding loop "
                "from a Hub repository's code, which need not call the guard's logits processor"
            )


def cached_tokens(cache: Any) -> int:
    """Tokens a ``past_key_values`` given to ``generate`` holds (0 for ``None`` or an empty cache): a
    :class:`~transformers.Cache`'s ``get_seq_length()``, or the key length of a legacy tuple of ``(key, value)``
    pairs."""
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    if isinstance(cache, (tuple, list)) and cache and isinstance(cache[0], (tuple, list)) and cache[0]:
        return int(cache[0][0].shape[-2])
    return 0
