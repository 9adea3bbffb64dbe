"""``pipeline("text-generation", model=guarded, tokenizer=tok)``: outputs carry the safety reports.

transformers' :class:`~transformers.TextGenerationPipeline` keeps only the tensors of what
``generate`` returns, so it would drop the reports. :class:`GuardedTextGenerationPipeline`
is that pipeline plus one key: each output record gets ``"safety"``, the
:class:`~hf_lsad.guard.SafetyReport` of its sequence. The reports travel through the
call's own objects (a list handed to ``generate`` as ``safety_out``, then the pipeline's
per-call model outputs), never through an attribute of the model.

Importing :mod:`hf_lsad` makes it the implementation of the ``text-generation`` task
(:func:`register`), so the plain ``pipeline(...)`` call returns it; for a model that is not
a :class:`~hf_lsad.generation.model.GuardedModelForCausalLM` it behaves exactly like transformers'
pipeline (it delegates every step). Generation arguments of the guarded ``generate``
(``on_flag``, ``refusal``, ``explain``) can be given to the pipeline call.
"""

from __future__ import annotations

from typing import Any

from transformers import TextGenerationPipeline


class _Reports:
    """The reports of one input row, boxed: the pipeline rebuilds tuples and lists it passes on
    (a :class:`~hf_lsad.guard.SafetyReport` is a tuple), but leaves other objects alone."""

    def __init__(self, reports: list[Any]) -> None:
        self.reports = reports


class GuardedTextGenerationPipeline(TextGenerationPipeline):
    """``TextGenerationPipeline`` whose records also hold ``"safety"`` for a guarded model."""

    def check_model_type(self, supported_models: Any) -> None:
        if not self._is_guarded():
            super().check_model_type(supported_models)
        # a guarded model wraps a causal LM whose decoder blocks it found: nothing to warn about

    def _sanitize_parameters(
        self,
        *args: Any,
        on_flag: str | None = None,
        refusal: str | list[int] | None = None,
        explain: bool | None = None,
        explain_top_k: int | None = None,
        **kwargs: Any,
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        preprocess, forward, postprocess = super()._sanitize_parameters(*args, **kwargs)
        extra = {"on_flag": on_flag, "refusal": refusal, "explain": explain, "explain_top_k": explain_top_k}
        forward = {**forward, **{k: v for k, v in extra.items() if v is not None}}
        return preprocess, forward, postprocess

    def _is_guarded(self) -> bool:
        from ..guard.guard import SafetyGuard

        # a GuardedModelForCausalLM (not imported here: modeling imports this module)
        return isinstance(self.model.__dict__.get("_modules", {}).get("guard"), SafetyGuard)

    # TextGenerationPipeline renames Pipeline._forward's first parameter (input_tensors) and returns a dict, not the
    # ModelOutput Pipeline annotates: no signature agrees with both, so this follows the parent it extends
    def _forward(self, model_inputs: dict[str, Any], **generate_kwargs: Any) -> Any:  # type: ignore[override]
        if not self._is_guarded():
            return super()._forward(model_inputs, **generate_kwargs)
        reports: list[Any] = []
        outputs = super()._forward(model_inputs, **generate_kwargs, safety_out=reports)
        in_b = outputs["generated_sequence"].shape[0]
        per_input = len(reports) // in_b if in_b else 0
        # one list per input row (num_return_sequences reports each), as generated_sequence is shaped
        outputs["safety"] = [_Reports(reports[i * per_input : (i + 1) * per_input]) for i in range(in_b)]
        return outputs

    def postprocess(self, model_outputs: dict[str, Any], *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        safety = model_outputs.pop("safety", None)
        records = super().postprocess(model_outputs, *args, **kwargs)
        if safety is None:
            return records
        # batch_size 1: the per-row list as _forward made it; batched: the loader already took row i
        if isinstance(safety, list):
            safety = safety[0]
        for record, report in zip(records, safety.reports):
            record["safety"] = report
        return records


def register() -> None:
    """Make :class:`GuardedTextGenerationPipeline` the ``text-generation`` implementation (idempotent, quiet)."""
    from transformers.pipelines import PIPELINE_REGISTRY

    task = PIPELINE_REGISTRY.supported_tasks.get("text-generation")
    if task is None or task.get("impl") is GuardedTextGenerationPipeline:
        return
    task["impl"] = GuardedTextGenerationPipeline
