"""One guarded ``generate`` call and its dict output (:meth:`hf_lsad.generation.model.GuardedModelForCausalLM.generate`
delegates here).

Reporting alone runs plain ``generate`` with the guard's activation captured on the way
(:func:`hf_lsad.capture.recorder.generate_with_activations`), so the sequences are exactly the plain
model's. Stopping, ``on_step`` and running guards need the verdict while the call runs: they
generate under the logits processor and stopping criteria of :mod:`hf_lsad.generation.control`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from transformers import LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

from ..capture.generate_call import (
    call_generate,
    eos_token_ids,
    generate_setting,
    num_beams,
    num_return_sequences,
    prefill_call_rows,
)
from ..capture.inputs import check_generate_kwargs
from ..capture.recorder import generate_with_activations, generation_prompt_reader, generation_recorder
from ..core.prompt_tokens import check_explain
from ..guard.guard import SafetyGuard, SafetyReport
from .control import (
    ON_FLAG,
    RUNNING_POSITIONS,
    SCREEN_POSITIONS,
    GuardedGenerationState,
    GuardLogitsProcessor,
    GuardStoppingCriteria,
    OnFlag,
    StepVerdict,
    decided_at_prefill,
    refusal_token_ids,
)


@dataclass
class GuardedGenerateDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only generate output with one :class:`SafetyReport` per sequence."""

    # Always set: GuardedModelForCausalLM.generate builds it with the reports. The None default is what ModelOutput
    # demands of every field after the first; typing it Optional would make every reader check a None that never is.
    safety: list[SafetyReport] = None  # type: ignore[assignment]


@dataclass
class GuardedGenerateBeamDecoderOnlyOutput(GenerateBeamDecoderOnlyOutput):
    """transformers' beam-search decoder-only generate output with one :class:`SafetyReport` per returned sequence
    (beam search reports on the prompt: each returned sequence gets its prompt's verdict)."""

    # Always set, as for GuardedGenerateDecoderOnlyOutput.
    safety: list[SafetyReport] = None  # type: ignore[assignment]


GuardedGenerateOutput = GuardedGenerateDecoderOnlyOutput | GuardedGenerateBeamDecoderOnlyOutput
"""What guarded ``generate`` returns with ``return_dict_in_generate=True``: the beam-search output under beam search,
else the decoder-only one; both carry ``safety``."""


def guarded_output(output: Any, reports: list[SafetyReport]) -> GuardedGenerateOutput:
    """``generate``'s dict ``output`` with the reports, as the guarded class of its own kind."""
    if isinstance(output, GenerateBeamDecoderOnlyOutput):
        return GuardedGenerateBeamDecoderOnlyOutput(**output, safety=reports)
    return GuardedGenerateDecoderOnlyOutput(**output, safety=reports)


def check_generate_options(
    position: str,
    on_flag: str,
    on_step: Callable[[StepVerdict], None] | None,
    explain: bool = False,
    explain_top_k: object = 10,
    refusal: object = None,
) -> None:
    """Refuse an ``on_flag`` / ``on_step`` that a guard reading ``position`` cannot honour, a ``refusal`` that no row
    would say, and, with ``explain``, an ``explain_top_k`` that is not a count: before any token is generated."""
    check_explain(explain, explain_top_k)
    if on_flag not in ON_FLAG:
        raise ValueError(f"on_flag must be one of {ON_FLAG}, got {on_flag!r}")
    if refusal is not None and on_flag != "stop":
        raise ValueError(
            f"refusal is what a stopped row says, and on_flag={on_flag!r} stops no row: pass on_flag='stop' with it, "
            "or leave it out"
        )
    if position == "prompt_mean":
        raise ValueError(
            "a prompt_mean guard reads the mean over the prompt's tokens, which guarded generate does not record; "
            "score prompts with screen() (a forward pass over the prompt)"
        )
    if on_flag == "stop" and position == "response_last":
        raise ValueError(
            "a response_last guard decides only after the response is complete, so it cannot stop one; "
            "use a prompt_last guard (screening) or a response_running guard (stopping while writing)"
        )
    if on_step is not None and position == "response_last":
        raise ValueError("a response_last guard scores once, after generation: there is no step to report")


def generate_guarded(
    model: PreTrainedModel,
    guard: SafetyGuard,
    tokenizer: Any,
    kwargs: dict[str, Any],
    on_flag: OnFlag,
    refusal: str | Sequence[int] | Tensor | None,
    explain: bool,
    top_k: int,
    on_step: Callable[[StepVerdict], None] | None,
    opening: Sequence[int] = (),
) -> tuple[Any, list[SafetyReport]]:
    """``model.generate(**kwargs)`` and one report per sequence (arguments as in ``GuardedModelForCausalLM.generate``;
    ``tokenizer`` encodes a text ``refusal``; ``opening``: the chat template's ids before the user's text, which an
    explanation does not name)."""
    hook = guard.config.hook
    if on_flag == "report" and hook.position not in RUNNING_POSITIONS and on_step is None:
        if guard.heads:  # every head reads the prompt: all reads come from the prefill call
            check_generate_kwargs(model, kwargs, prompt_only=True)
            with generation_prompt_reader(model, guard.reads, kwargs, keep_tokens=explain) as prompt_reader:
                output = call_generate(model, kwargs)
            tokens = prompt_reader.tokens(opening) if explain else None
            reports = guard.reports(prompt_reader.features(guard.reads), explain=explain, top_k=top_k, tokens=tokens)
            return output, decided_at_prefill(reports)
        output, activations = generate_with_activations(model, hook.layer, hook.position, **kwargs)
        reports = guard.reports(activations, explain=explain, top_k=top_k)  # fails closed per row
        return output, decided_at_prefill(reports) if hook.position in SCREEN_POSITIONS else reports
    # The verdict is needed while generating: the guard's logits processor and stopping criteria go after the
    # caller's, and the recorder (the report path's) reads the block for this call only.
    # A screening guard decides on the prefill, where every beam of a prompt holds the prompt.
    input_ids = check_generate_kwargs(model, kwargs, prompt_only=hook.position in SCREEN_POSITIONS)
    eos = eos_token_ids(model, kwargs)
    beams = num_beams(model, kwargs)
    if beams > 1 and on_flag == "stop":
        check_beam_stop(model, kwargs, eos)
    recorder = generation_recorder(model, hook.layer, kwargs)
    reader = generation_prompt_reader(model, guard.reads, kwargs, keep_tokens=explain) if guard.heads else None
    state = GuardedGenerationState(
        guard=guard,
        batch_size=prefill_call_rows(model, kwargs, input_ids.shape[0]),  # generate repeats each row
        eos_token_ids=eos,
        stop=on_flag == "stop",
        forced_tokens=refusal_token_ids(refusal, tokenizer, vocabulary_size(model)) + eos[:1],
        patience=guard.running.patience if guard.running is not None else 1,
        recorder=recorder,
        prompt_reader=reader,
        on_step=on_step,
        beams=beams,
        returned=num_return_sequences(model, kwargs),
    )
    kwargs["logits_processor"] = LogitsProcessorList(
        [*(kwargs.get("logits_processor") or []), GuardLogitsProcessor(state)]
    )
    if beams == 1:  # beam search checks stopping criteria on its candidates, not its rows: EOS ends a beam there
        kwargs["stopping_criteria"] = StoppingCriteriaList(
            [*(kwargs.get("stopping_criteria") or []), GuardStoppingCriteria(state)]
        )
    with recorder, reader if reader is not None else contextlib.nullcontext():
        output = call_generate(model, kwargs)
    return output, state.reports(explain=explain, top_k=top_k, opening=opening)


def decoding_settings(temperature: float, top_p: float = 1.0) -> dict[str, Any]:
    """``generate`` settings for a temperature and a top-p as the OpenAI API reads them: 0 decodes greedily (the
    model's own sampling settings cleared), above 0 samples from the whole distribution under them (no top-k, which
    transformers would otherwise take as 50)."""
    if temperature == 0:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    return dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)


def check_beam_stop(model: PreTrainedModel, kwargs: dict[str, Any], eos: Sequence[int]) -> None:
    """Refuse a stop under beam search that beam search cannot carry out: beam sampling draws twice the beams'
    continuations of each prompt, and a stopped prompt has one; without an EOS id nothing ends a stopped beam."""
    if generate_setting(model, kwargs, "do_sample"):
        raise ValueError(
            "on_flag='stop' under beam search needs do_sample=False: beam sampling draws 2 x num_beams "
            "continuations of each prompt, and a stopped prompt has only its forced one"
        )
    if not eos:
        raise ValueError(
            "on_flag='stop' under beam search needs the model's EOS token id: beam search ends a hypothesis at EOS"
        )


def vocabulary_size(model: PreTrainedModel) -> int:
    """Rows of the logits ``generate`` picks tokens from (the output embedding; the config's vocab_size without one)."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)
