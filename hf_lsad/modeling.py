"""GuardedModelForCausalLM: ``generate`` as in transformers, plus a safety report per sequence.

The guard's hook is registered on the target decoder block for the duration of
each ``generate`` call only (and removed on the way out, exceptions included),
so the wrapped model is untouched between calls and there is nothing to close.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.generation import GenerateDecoderOnlyOutput

from .capture import generate_with_activations
from .guard import SafetyGuard, SafetyReport
from .input_checks import check_generate_inputs


@dataclass
class GuardedGenerateDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only generate output with one :class:`SafetyReport` per sequence."""

    safety: list[SafetyReport] | None = None


class GuardedModelForCausalLM(nn.Module):
    """A causal LM whose ``generate`` also scores every sequence with a :class:`SafetyGuard`.

    ``generate`` takes and returns exactly what ``model.generate`` does (same
    sequences for the same arguments). With ``return_dict_in_generate=True``
    the output is a :class:`GuardedGenerateDecoderOnlyOutput` whose ``safety``
    holds the reports; with a plain tensor return they are in
    :attr:`last_safety`, which is per thread (also set in the dict case).

    Thread safety: one instance serves concurrent ``generate`` calls from several threads.
    Each call records only its own forward passes (the hook keys its records to the
    calling thread), so calls run in parallel, with no lock, and each gets the reports it
    would get alone; reports travel in the return value (and the calling thread's
    :attr:`last_safety`), never between threads.

    Inputs: left- or right-padded batches (a tokenizer's default ``padding_side``) are
    scored alike, each row at its last real token (:func:`hf_lsad.capture.last_token_positions`).
    A prompt longer than the model's context is an :class:`~hf_lsad.errors.InputError`
    (:func:`hf_lsad.input_checks.check_generate_inputs`). A row whose activation is not
    finite fails closed (:meth:`SafetyGuard.reports`); the sequences are returned anyway.

    Casting: ``.to(dtype)``, ``.half()``, ``.bfloat16()`` cast the model only; the guard
    follows the model's device and stays in float32 (its threshold was set in float32).

    The guard must fit the model: same hidden size, layer count and hooked block (always an
    error otherwise), and the same base model (``guard.config.hook.base_model`` against
    ``model.config.name_or_path``, compared as in :func:`hf_lsad.capture.same_base_model`:
    Hub ids, or the last two components of a local path). A base-model mismatch is refused
    unless ``allow_base_model_mismatch=True``, which warns instead.
    """

    def __init__(self, model: PreTrainedModel, guard: SafetyGuard, *, allow_base_model_mismatch: bool = False) -> None:
        super().__init__()
        guard.config.hook.check_model(model, allow_base_model_mismatch=allow_base_model_mismatch)
        self.model = model
        self.guard = guard.to(model.device)
        self._per_thread = threading.local()

    @property
    def last_safety(self) -> list[SafetyReport] | None:
        """Reports of this thread's latest ``generate`` call, one per returned sequence (``None`` before one)."""
        return getattr(self._per_thread, "last_safety", None)

    def _apply(self, fn: Any, recurse: bool = True) -> GuardedModelForCausalLM:
        # .to(dtype) / .half() / .to(device) reach the model; the guard only follows its device, in float32.
        self.model._apply(fn, recurse)
        self.guard.to(self.model.device)
        return self

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        guard: str | os.PathLike | SafetyGuard,
        guard_kwargs: dict[str, Any] | None = None,
        allow_base_model_mismatch: bool = False,
        **model_kwargs: Any,
    ) -> GuardedModelForCausalLM:
        """Load the model with ``AutoModelForCausalLM.from_pretrained(..., **model_kwargs)`` and the guard.

        ``guard`` is a :class:`SafetyGuard`, a guard folder or a Hub repo id;
        ``guard_kwargs`` go to :meth:`SafetyGuard.from_pretrained` (``revision``, ``subfolder``,
        ``token``, ``cache_dir``, ``local_files_only``, ``force_download``), e.g.::

            GuardedModelForCausalLM.from_pretrained(
                "HuggingFaceTB/SmolLM2-135M-Instruct", guard="org/smollm2-lsad", guard_kwargs={"revision": "v1"}
            )

        ``allow_base_model_mismatch`` as in the class docstring.
        """
        if not isinstance(guard, SafetyGuard):
            guard = SafetyGuard.from_pretrained(guard, **(guard_kwargs or {}))
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, **model_kwargs)
        return cls(model, guard, allow_base_model_mismatch=allow_base_model_mismatch)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def generation_config(self) -> Any:
        return self.model.generation_config

    @property
    def device(self) -> Any:
        return self.model.device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def generate(self, input_ids: Tensor | None = None, **kwargs: Any) -> Tensor | GuardedGenerateDecoderOnlyOutput:
        """``model.generate(input_ids, **kwargs)``, scoring each sequence at the guard's position."""
        if input_ids is not None:
            kwargs["input_ids"] = input_ids
        hook = self.guard.config.hook
        check_generate_inputs(self.model, self.guard, kwargs)
        output, activations = generate_with_activations(self.model, hook.layer, hook.position, **kwargs)
        reports = self.guard.reports(activations)  # fails closed per row: the sequences are never lost
        self._per_thread.last_safety = reports
        if isinstance(output, Tensor):
            return output
        return GuardedGenerateDecoderOnlyOutput(**output, safety=reports)
