"""GuardedModelForCausalLM: ``generate`` as in transformers, plus a safety report per sequence.

The guard's hook is registered on the target decoder block for the duration of
each ``generate`` call only (and removed on the way out, exceptions included),
so the wrapped model is untouched between calls and there is nothing to close.
Everything a call records lives in objects made for that call (the recorder, the
:class:`~hf_lsad.generation.control.GuardedGenerationState`), never on the instance.

Saving and loading delegate to :mod:`hf_lsad.generation.files`, each ``generate`` call to
:mod:`hf_lsad.generation.generate`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast, overload

import torch
from torch import Tensor, nn
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

from ..capture.adapters import check_adapter
from ..capture.collect import (
    check_pad_token,
    check_prompts,
    conversation_token_ids,
    encode_prompts,
    pad_left,
    prompt_token_ids,
)
from ..capture.inputs import check_context, check_generate_inputs, check_lengths_fit
from ..capture.recorder import PROMPT_POSITIONS, read_prompts
from ..core.batching import check_batching, length_batches
from ..core.prompt_inputs import InputWarner
from ..core.prompt_tokens import check_explain
from ..core.serialization import folder_path
from ..data.tables import conversation_problem
from ..guard.fingerprint import check_fingerprint
from ..guard.guard import SafetyGuard, SafetyReport
from .control import OnFlag, StepVerdict
from .files import GUARD_SUBFOLDER, GUARDED_CONFIG, load_guarded_model, upload_guarded_folder, write_guarded_folder
from .generate import (
    GuardedGenerateBeamDecoderOnlyOutput,
    GuardedGenerateDecoderOnlyOutput,
    GuardedGenerateOutput,
    check_generate_options,
    generate_guarded,
    guarded_output,
)

__all__ = [
    "GUARDED_CONFIG",
    "GUARD_SUBFOLDER",
    "GuardedGenerateBeamDecoderOnlyOutput",
    "GuardedGenerateDecoderOnlyOutput",
    "GuardedGenerateOutput",
    "GuardedModelForCausalLM",
]


Conversation = Sequence[Mapping[str, str]]
"""A conversation: ``{"role", "content"}`` turns (:func:`~hf_lsad.data.tables.conversation_problem`)."""


def _are_conversations(prompts: object) -> bool:
    """Whether ``prompts`` is a list of conversations (its first item a list of ``{"role", "content"}`` turns)
    rather than of strings; anything else is read, and refused, as strings."""
    return (
        isinstance(prompts, Sequence)
        and not isinstance(prompts, str)
        and len(prompts) > 0
        and isinstance(prompts[0], (list, tuple))
        and len(prompts[0]) > 0
        and isinstance(prompts[0][0], Mapping)
    )


class GuardedModelForCausalLM(nn.Module):
    """A causal LM whose ``generate`` also scores every sequence with a :class:`SafetyGuard`.

    ``generate`` takes and returns exactly what ``model.generate`` does (same
    sequences for the same arguments, with the default ``on_flag="report"``). With ``return_dict_in_generate=True``
    the output is a :class:`GuardedGenerateDecoderOnlyOutput` (under beam search a
    :class:`GuardedGenerateBeamDecoderOnlyOutput`) whose ``safety``
    holds the reports; with a plain tensor return they are in
    :attr:`last_safety`, which is per thread (also set in the dict case).

    Thread safety: one instance serves concurrent ``generate`` calls from several threads.
    Each call records only its own forward passes (the hook keys its records to the
    calling thread), so calls run in parallel, with no lock, and each gets the reports it
    would get alone; reports travel in the return value (and the calling thread's
    :attr:`last_safety`), never between threads.

    Inputs: left- or right-padded batches (a tokenizer's default ``padding_side``) are
    scored alike, each row at its last real token (:func:`hf_lsad.capture.recorder.last_token_positions`).
    A prompt longer than the model's context is an :class:`~hf_lsad.errors.InputError`
    (:func:`hf_lsad.capture.inputs.check_generate_inputs`). A row whose activation is not
    finite fails closed (:meth:`SafetyGuard.reports`); the sequences are returned anyway.

    Casting: ``.to(dtype)``, ``.half()``, ``.bfloat16()`` cast the model only; the guard
    follows the model's device and stays in float32 (its threshold was set in float32).

    Attributes the wrapper does not have are looked up on the wrapped model (as peft's
    ``PeftModel`` does), so code written for a transformers model (``pipeline``,
    ``guarded.config``, ``guarded.can_generate()``, ...) can take the wrapper.

    The guard must fit the model: same hidden size, layer count and hooked block (always an
    error otherwise), and the same base model (``guard.config.hook.base_model`` against
    ``model.config.name_or_path``, compared as in :func:`hf_lsad.capture.recorder.same_base_model`:
    Hub ids, or the last two components of a local path). A base-model mismatch is refused
    unless ``allow_base_model_mismatch=True``, which warns instead.

    A model running peft adapters (a ``PeftModel``, or adapters loaded by transformers' ``load_adapter``) is read
    with its adapters, if the guard's thresholds were set through the same adapters; another adapter, or none where
    the thresholds were set through one, is refused unless ``allow_adapter_mismatch=True``, which warns instead
    (:func:`hf_lsad.capture.adapters.check_adapter`).

    A model whose weights differ from those of the model the guard's thresholds were set through (a full fine-tune, an
    adapter merged into the weights), which no name or module tells apart, is found by reading the guard's probe
    prompts through it (one short forward pass): when its heads score them otherwise than the recorded fingerprint,
    the model is refused unless ``allow_score_shift=True``, which warns instead
    (:func:`hf_lsad.guard.fingerprint.check_fingerprint`; guards without a fingerprint are not checked).

    ``tokenizer`` (optional) lets :meth:`screen` take prompt strings and ``refusal`` be text.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        guard: SafetyGuard,
        *,
        tokenizer: Any = None,
        allow_base_model_mismatch: bool = False,
        allow_adapter_mismatch: bool = False,
        allow_score_shift: bool = False,
    ) -> None:
        super().__init__()
        guard.config.hook.check_model(model, allow_base_model_mismatch=allow_base_model_mismatch)
        same_adapters = check_adapter(model, guard.inputs, allow_mismatch=allow_adapter_mismatch)
        guard = guard.to(model.device)
        if same_adapters:  # other adapters, allowed, move the scores anyway: the user was warned of that
            check_fingerprint(model, guard, allow_shift=allow_score_shift)
        self.model = model
        self.guard = guard
        self.tokenizer = tokenizer
        self._per_thread = threading.local()
        self._input_warner = InputWarner()

    @property
    def last_safety(self) -> list[SafetyReport] | None:
        """Reports of this thread's latest ``generate`` call, one per returned sequence (``None`` before one)."""
        return getattr(self._per_thread, "last_safety", None)

    def _apply(self, fn: Any, recurse: bool = True) -> GuardedModelForCausalLM:
        # .to(dtype) / .half() / .to(device) reach the model; the guard only follows its device, in float32.
        self.model._apply(fn, recurse)
        self.guard.to(self.model.device)
        return self

    def __getattr__(self, name: str) -> Any:
        """Forward missing attributes to the wrapped model (as ``peft.PeftModel.__getattr__``)."""
        try:
            return super().__getattr__(name)  # parameters, buffers and submodules (nn.Module)
        except AttributeError:
            if name == "model":  # not set yet (e.g. during __init__ or unpickling): avoid recursion
                raise
            return getattr(self.model, name)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        guard: str | os.PathLike | SafetyGuard | None = None,
        guard_kwargs: dict[str, Any] | None = None,
        allow_base_model_mismatch: bool = False,
        allow_adapter_mismatch: bool = False,
        allow_score_shift: bool = False,
        **model_kwargs: Any,
    ) -> GuardedModelForCausalLM:
        """Load a guarded model.

        ``"default"`` alone is the bundled SmolLM2 with the bundled two-headed guard (``guard="paper"`` for the
        paper's guard alone). Without ``guard``, ``pretrained_model_name_or_path`` is a folder or Hub repo written by
        :meth:`save_pretrained` / :meth:`push_to_hub`: its guard is loaded from it and the base
        model from the reference it holds (``AutoModelForCausalLM.from_pretrained(base_model,
        **model_kwargs)``; the bundled SmolLM2 through :func:`hf_lsad.capture.pretrained.load_model`).
        ``guard_kwargs`` (``revision``, ``subfolder``, ``token``, ``cache_dir``,
        ``local_files_only``, ``force_download``) then say where to read that folder.

        With ``guard``, load the model with ``AutoModelForCausalLM.from_pretrained(..., **model_kwargs)``
        (the bundled SmolLM2, ``"default"``, a ``.gguf`` file and a peft adapter as
        :func:`~hf_lsad.capture.pretrained.load_model` loads them, with their tokenizer) and the guard: a
        :class:`SafetyGuard`, a guard folder or a Hub repo id; ``guard_kwargs`` go to
        :meth:`SafetyGuard.from_pretrained`, e.g.::

            GuardedModelForCausalLM.from_pretrained("default")  # = guard="default"
            GuardedModelForCausalLM.from_pretrained(
                "Qwen/Qwen2.5-0.5B-Instruct", guard="org/qwen-lsad", guard_kwargs={"revision": "v1"}
            )

        ``allow_base_model_mismatch``, ``allow_adapter_mismatch`` and ``allow_score_shift`` as in the class
        docstring.
        """
        model, guard, tokenizer = load_guarded_model(pretrained_model_name_or_path, guard, guard_kwargs, model_kwargs)
        return cls(
            model,
            guard,
            tokenizer=tokenizer,
            allow_base_model_mismatch=allow_base_model_mismatch,
            allow_adapter_mismatch=allow_adapter_mismatch,
            allow_score_shift=allow_score_shift,
        )

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        base_model: str | None = None,
        base_model_revision: str | None = None,
    ) -> None:
        """Write the guard and a reference to the base model (not its weights)::

            guarded_model.json   {"format_version", "base_model", "base_model_revision", "guard": "guard"}
            guard/               the guard folder (:meth:`SafetyGuard.save_pretrained`)

        ``base_model`` defaults to ``model.config.name_or_path`` (a Hub id, or the local folder
        the model was loaded from); :meth:`from_pretrained` loads it from there.
        """
        write_guarded_folder(
            folder_path(save_directory, "save_directory"), self.model, self.guard, base_model, base_model_revision
        )

    def push_to_hub(
        self,
        repo_id: str,
        *,
        base_model: str | None = None,
        base_model_revision: str | None = None,
        commit_message: str = "Upload hf-lsad guarded model",
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
    ) -> Any:
        """Upload what :meth:`save_pretrained` writes to a Hub repo in one commit; returns the ``CommitInfo``."""
        return upload_guarded_folder(
            self.model,
            self.guard,
            repo_id,
            base_model,
            base_model_revision,
            commit_message=commit_message,
            revision=revision,
            private=private,
            token=token,
            create_pr=create_pr,
        )

    @property
    def config(self) -> PretrainedConfig:
        """The wrapped model's config (what ``pipeline`` and generation utilities read)."""
        return self.model.config

    @property
    def generation_config(self) -> GenerationConfig:
        """The wrapped model's generation config."""
        return self.model.generation_config

    @property
    def device(self) -> torch.device:
        """The wrapped model's device, where inputs go."""
        return self.model.device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward, unguarded: the guard reads the residual stream in :meth:`generate` and
        :meth:`screen`."""
        return self.model(*args, **kwargs)

    @overload
    def generate(
        self,
        input_ids: Tensor | None = None,
        *,
        return_dict_in_generate: Literal[True],
        on_flag: OnFlag = ...,
        refusal: str | list[int] | Tensor | None = ...,
        explain: bool = ...,
        explain_top_k: int = ...,
        safety_out: list[SafetyReport] | None = ...,
        on_step: Callable[[StepVerdict], None] | None = ...,
        **kwargs: Any,
    ) -> GuardedGenerateOutput: ...

    @overload
    def generate(
        self,
        input_ids: Tensor | None = None,
        *,
        return_dict_in_generate: bool | None = ...,
        on_flag: OnFlag = ...,
        refusal: str | list[int] | Tensor | None = ...,
        explain: bool = ...,
        explain_top_k: int = ...,
        safety_out: list[SafetyReport] | None = ...,
        on_step: Callable[[StepVerdict], None] | None = ...,
        **kwargs: Any,
    ) -> Tensor | GuardedGenerateOutput: ...

    def generate(
        self,
        input_ids: Tensor | None = None,
        *,
        return_dict_in_generate: bool | None = None,
        on_flag: OnFlag = "report",
        refusal: str | list[int] | Tensor | None = None,
        explain: bool = False,
        explain_top_k: int = 10,
        safety_out: list[SafetyReport] | None = None,
        on_step: Callable[[StepVerdict], None] | None = None,
        **kwargs: Any,
    ) -> Tensor | GuardedGenerateOutput:
        """``model.generate(input_ids, **kwargs)``, scoring each sequence at the guard's position.

        Args:
            return_dict_in_generate: As ``model.generate`` (``None``: the generation config's). When true the
                output is a :class:`GuardedGenerateDecoderOnlyOutput` (under beam search a
                :class:`GuardedGenerateBeamDecoderOnlyOutput`) whose ``safety`` holds the reports, else the
                sequences tensor plain ``generate`` returns (type checkers know the dict output for a literal
                ``True``).
            on_flag: ``"report"`` (default): generate as the plain model does and report.
                ``"stop"``: end a flagged row as soon as the verdict exists, while the other rows
                of the batch go on: right after the prefill for a ``prompt_last`` guard (the row
                gets no token of its own), at the flagged token for a ``response_running`` guard.
                A stopped row emits ``refusal`` (if given) and then EOS. A ``response_last``
                verdict exists only after the response, so it cannot stop anything. Under beam search
                (``do_sample=False``, a model with an EOS id) every beam of a flagged prompt is forced alike.
            refusal: What a stopped row says: token ids, or text (encoded with the wrapper's
                ``tokenizer``, without special tokens). ``None``: EOS only. Given with ``on_flag="report"``: an error.
            explain: Explain the head that decided (:attr:`~hf_lsad.guard.SafetyReport.explained_head`): each
                report's ``features`` lists its top features (the anomaly head's SAE features,
                :mod:`hf_lsad.guard.explain`), and, for a supervised head, ``tokens`` the prompt tokens that raise
                its score most (:meth:`~hf_lsad.guard.heads.SupervisedHead.explain_tokens`).
            explain_top_k: How many features and tokens to list (an int, 0 or more; checked before generating).
            on_step: Called with a :class:`~hf_lsad.generation.control.StepVerdict` after each step the
                guard scores (the prefill of a ``prompt_last`` guard, every token of a running guard),
                from the thread running ``generate``: e.g. to show the verdict while streaming.
            safety_out: A list the reports are appended to, for callers that do not see the return
                value (``pipeline``); the reports are also in the dict output's ``safety``.
            kwargs: As ``model.generate`` (its ``inputs`` is taken as ``input_ids``); ``logits_processor`` and
                ``stopping_criteria`` of the caller are kept (the guard's are added after them), so greedy search,
                sampling, streamers and the caller's criteria compose with stopping.
        """
        if "inputs" in kwargs:  # transformers' name for the prompt tensor of a causal LM
            if input_ids is not None or "input_ids" in kwargs:
                raise ValueError("give the prompt ids once: as input_ids or as inputs, not both")
            input_ids = kwargs.pop("inputs")
        if input_ids is not None:
            kwargs["input_ids"] = input_ids
        if return_dict_in_generate is not None:
            kwargs["return_dict_in_generate"] = return_dict_in_generate
        position = self.guard.config.hook.position
        check_generate_options(position, on_flag, on_step, explain, explain_top_k, refusal)
        check_generate_inputs(self.model, self.guard, kwargs)
        self._input_warner.warn(
            self.guard.inputs, self.tokenizer, kwargs.get("input_ids"), kwargs.get("attention_mask")
        )
        # the rows are expected under the system turn the thresholds were set under (the warner says when not)
        opening = self._input_warner.opening(self.tokenizer, self._guard_system()) if explain else ()
        output, reports = generate_guarded(
            self.model, self.guard, self.tokenizer, kwargs, on_flag, refusal, explain, explain_top_k, on_step, opening
        )
        self._per_thread.last_safety = reports
        if safety_out is not None:
            safety_out.extend(reports)
        if isinstance(output, Tensor):
            return output
        return guarded_output(output, reports)

    def _guard_system(self) -> str | None:
        """The system turn the guard's thresholds were set under (``None``: the template's default)."""
        return self.guard.inputs.system if self.guard.inputs is not None else None

    @torch.no_grad()
    def screen(
        self,
        prompts: Sequence[str] | Sequence[Conversation] | Tensor | None = None,
        attention_mask: Tensor | None = None,
        *,
        input_ids: Tensor | None = None,
        chat_template: bool = True,
        system: str | None = None,
        explain: bool = False,
        top_k: int = 10,
        batch_size: int | None = None,
        max_batch_tokens: int | None = None,
    ) -> list[SafetyReport]:
        """Reports for a batch of prompts without generating: a forward pass cut after the hooked block.

        ``prompts`` are strings (encoded with the wrapper's ``tokenizer`` as user turns of its chat
        template, after the system turn ``system`` when given, left-padded, as
        :func:`hf_lsad.capture.collect.encode_prompts`) or ``input_ids`` (left- or right-padded) with their
        ``attention_mask``, given first or as ``input_ids=`` (so that ``screen(**inputs)`` takes what
        ``encode_prompts`` or a tokenizer returns), or conversations: lists of ``{"role", "content"}`` turns ending
        with a user turn, each read whole under the chat template as a chat server reads it for its next answer
        (:func:`~hf_lsad.capture.collect.conversation_token_ids`; ``system`` before one without a system turn of its
        own). Rows under another system turn than the one the guard's thresholds were set under
        (:attr:`~hf_lsad.core.prompt_inputs.InputProfile.system`) warn. Needs a guard that reads the prompt
        (``prompt_last`` or ``prompt_mean``): a ``prompt_last`` verdict equals the one ``generate`` reports for the
        same prompts, and the same inputs are refused (:func:`hf_lsad.capture.inputs.check_context`: malformed
        tensors, prompts beyond the model's context). ``explain`` and ``top_k`` are ``generate``'s ``explain`` and
        ``explain_top_k``.

        ``batch_size`` and ``max_batch_tokens`` screen strings or conversations in several forward passes, in order
        of token length (:func:`~hf_lsad.core.batching.length_batches`: at most ``batch_size`` prompts and
        ``max_batch_tokens`` padded tokens a pass; ``None``: no limit), so that one long prompt does not pad the
        others to its length; the reports come back in the order of ``prompts``, and bad input is refused, and
        warned of, before the first pass. Both ``None`` (the default): one pass over the whole list, as
        ``model(**inputs)``.
        """
        if input_ids is not None:
            if prompts is not None:
                raise ValueError("give the prompts once: as the first argument or as input_ids, not both")
            prompts = input_ids
        if prompts is None:
            raise TypeError("screen() needs prompts: strings, conversations, or input_ids with their attention_mask")
        hook = self.guard.config.hook
        check_explain(explain, top_k)
        if hook.position not in PROMPT_POSITIONS:
            raise ValueError(
                f"screen() needs a guard that reads the prompt {PROMPT_POSITIONS}; this one reads {hook.position}"
            )
        if _are_conversations(prompts):
            conversations = cast(Sequence[Conversation], prompts)
            return self._screen_conversations(
                conversations, chat_template, system, explain, top_k, batch_size, max_batch_tokens
            )
        if batch_size is not None or max_batch_tokens is not None:
            if isinstance(prompts, Tensor):
                raise ValueError("batch_size and max_batch_tokens batch prompts given as strings, not input_ids")
            strings = cast(Sequence[str], prompts)
            return self._screen_in_batches(strings, chat_template, system, explain, top_k, batch_size, max_batch_tokens)
        if isinstance(prompts, Tensor):
            if system is not None:
                raise ValueError("system= formats prompts given as strings; input_ids are formatted already")
            input_ids = prompts
            attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        else:
            strings = cast(Sequence[str], prompts)
            inputs = encode_prompts(self._string_tokenizer(), strings, chat_template=chat_template, system=system)
            input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        check_context(self.model, input_ids, attention_mask)  # the rule generate applies
        self._input_warner.warn(self.guard.inputs, self.tokenizer, input_ids, attention_mask)
        # explanations leave out the template's opening: strings were formatted under ``system``; input_ids are
        # expected under the guard's system turn
        turn = self._guard_system() if isinstance(prompts, Tensor) else system
        return self._screen_pass(input_ids, attention_mask, explain, top_k, turn)

    def _screen_in_batches(
        self,
        prompts: Sequence[str],
        chat_template: bool,
        system: str | None,
        explain: bool,
        top_k: int,
        batch_size: int | None,
        max_batch_tokens: int | None,
    ) -> list[SafetyReport]:
        """:meth:`screen` of strings in forward passes grouped by token length; every check on the whole list first."""
        check_prompts(prompts)
        rows = prompt_token_ids(self._string_tokenizer(), prompts, chat_template=chat_template, system=system)
        return self._screen_rows(rows, explain, top_k, batch_size, max_batch_tokens, system)

    def _screen_conversations(
        self,
        conversations: Sequence[Conversation],
        chat_template: bool,
        system: str | None,
        explain: bool,
        top_k: int,
        batch_size: int | None,
        max_batch_tokens: int | None,
    ) -> list[SafetyReport]:
        """:meth:`screen` of conversations, each read whole under the chat template; every check first."""
        if not chat_template:
            raise ValueError("conversations are read under the chat template; chat_template=False reads strings raw")
        for number, turns in enumerate(conversations):
            problem = conversation_problem(turns)
            if problem is not None:
                raise ValueError(f"conversation {number}: {problem}")
        rows = conversation_token_ids(self._string_tokenizer(), conversations, system=system)
        return self._screen_rows(rows, explain, top_k, batch_size, max_batch_tokens, system)

    def _screen_rows(
        self,
        rows: list[list[int]],
        explain: bool,
        top_k: int,
        batch_size: int | None,
        max_batch_tokens: int | None,
        system: str | None,
    ) -> list[SafetyReport]:
        """Reports of token ``rows`` in the caller's order, screened in forward passes grouped by token length (one
        pass without limits); the batching, the pad token and the rows' lengths are checked and their warnings given
        first, by the caller's rows."""
        tokenizer = self._string_tokenizer()
        check_batching(1 if batch_size is None else batch_size, max_batch_tokens)
        check_pad_token(tokenizer)
        lengths = [len(tokens) for tokens in rows]
        check_lengths_fit(self.model, torch.tensor(lengths))  # the rule generate applies, naming the caller's row
        self._input_warner.warn_rows(self.guard.inputs, tokenizer, rows)
        by_row: dict[int, SafetyReport] = {}
        for batch in length_batches(lengths, batch_size or len(rows), max_batch_tokens):
            input_ids, attention_mask = pad_left(tokenizer, [rows[i] for i in batch])
            by_row.update(zip(batch, self._screen_pass(input_ids, attention_mask, explain, top_k, system)))
        return [by_row[i] for i in range(len(rows))]

    def _string_tokenizer(self) -> Any:
        """The wrapper's tokenizer, which :meth:`screen` needs for prompts given as strings."""
        if self.tokenizer is None:
            raise ValueError(
                "screen() of strings needs a tokenizer: GuardedModelForCausalLM(model, guard, tokenizer=tok)"
            )
        return self.tokenizer

    def _screen_pass(
        self, input_ids: Tensor, attention_mask: Tensor, explain: bool, top_k: int, turn: str | None
    ) -> list[SafetyReport]:
        """The reports of one forward pass over ``input_ids`` ``[batch, seq]``, cut after the deepest hooked block;
        ``turn``: the system turn whose template opening explanations leave out."""
        device = self.model.device
        keep_tokens = explain and bool(self.guard.heads)  # a supervised head names the tokens behind its score
        reader = read_prompts(
            self.model, self.guard.reads, input_ids.to(device), attention_mask.to(device), keep_tokens=keep_tokens
        )
        reads = reader.features(self.guard.reads)
        activations = reads if self.guard.heads else reads[self.guard.reads[0]]
        tokens = reader.tokens(self._input_warner.opening(self.tokenizer, turn)) if keep_tokens else None
        return self.guard.reports(activations, explain=explain, top_k=top_k, tokens=tokens)


def _register_pipeline() -> None:
    from .pipeline import register

    register()


_register_pipeline()
