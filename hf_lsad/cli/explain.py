"""``hf-lsad explain``: what is behind each verdict. For the anomaly head, its top SAE features, each with the store
prompts that activate it most, so that a person can name them (:mod:`hf_lsad.guard.explain` says what a feature's
contribution is); for a supervised head that decided, the prompt tokens that raise its score most
(:meth:`hf_lsad.guard.heads.SupervisedHead.explain_tokens`).
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from ..guard.explain import store_texts, top_activating
from ..guard.types import ANOMALY_HEAD, FeatureContribution, SafetyReport
from .echo import shown_prompt

FEATURE_HEADER = f"{'feature':>8} {'activation':>10} {'typical':>8} {'contribution':>12}"
"""The columns of a feature's line (:func:`_feature_row`)."""


def _feature_row(f: FeatureContribution) -> str:
    return f"{f.feature:>8} {f.activation:>10.3f} {f.typical:>8.3f} {f.contribution:>12.3f}"


def explain_command(args: argparse.Namespace, out: TextIO | None = None) -> None:
    """``hf-lsad explain [--guard G] [--activations STORE] [--model M] [--top-k K] [--examples N] PROMPT...``.

    Runs the guard on each prompt (a forward pass cut at the hooked block for a
    ``prompt_last`` guard, greedy generation otherwise) and prints its report with the explanation of the head that
    decided (:attr:`~hf_lsad.guard.SafetyReport.explained_head`): the anomaly head's top features, each followed by
    the store's prompts that activate it most; a supervised head's top prompt tokens.
    ``args``: ``guard`` (with ``revision`` / ``subfolder``), ``activations`` (``None``: no store prompts),
    ``model`` (default ``default``), ``top_k`` (default 10), ``examples`` (default 3), ``prompts``,
    ``max_new_tokens`` (default 64), ``system`` (default ``None``: the template's own system turn), and the
    ``--device`` / ``--dtype`` flags (:class:`~hf_lsad.core.runtime.ModelRuntime`).
    """
    import sys

    from ..capture.pretrained import load_model, placement
    from ..core.runtime import ModelRuntime, torch_dtype
    from ..data.store import ActivationStore
    from ..generation.model import GuardedModelForCausalLM
    from ..guard.guard import SafetyGuard
    from .arguments import guard_location, mismatch_allowances, runtime_config

    out = out or sys.stdout
    runtime = runtime_config(args, ModelRuntime)
    guard = SafetyGuard.from_pretrained(args.guard, **guard_location(args))
    model, tokenizer = load_model(
        getattr(args, "model", None) or "default", dtype=torch_dtype(runtime.dtype), **placement(runtime.device)
    )
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer, **mismatch_allowances(args))
    top_k = getattr(args, "top_k", None) or 10
    system = getattr(args, "system", None)
    if guard.config.hook.position == "prompt_last":
        reports = guarded.screen(list(args.prompts), system=system, explain=True, top_k=top_k)
    else:
        from ..capture.collect import encode_prompts

        inputs = encode_prompts(tokenizer, list(args.prompts), device=guarded.device, system=system)
        reports = guarded.generate(
            **inputs,
            max_new_tokens=getattr(args, "max_new_tokens", None) or 64,
            do_sample=False,
            return_dict_in_generate=True,
            explain=True,
            explain_top_k=top_k,
        ).safety
    examples: dict[int, list[tuple[float, int]]] = {}
    text_of: dict[int, str] = {}
    if getattr(args, "activations", None):
        store = ActivationStore(args.activations)
        # a row that could not be scored (NaN activations, fail closed) has no features to explain; a supervised
        # head's features are dimensions of its reads, not SAE features: the store has nothing to say about them
        anomaly_reports = [report for report in reports if report.explained_head == ANOMALY_HEAD]
        features = sorted({f.feature for report in anomaly_reports for f in report.features or ()})
        examples = top_activating(guard.sae, store, features, n=getattr(args, "examples", None) or 3)
        texts = store_texts([store.records[r] for values in examples.values() for _, r in values])
        rows = [r for values in examples.values() for _, r in values]
        text_of = dict(zip(rows, texts))
    for prompt, report in zip(args.prompts, reports):
        print(f"prompt: {shown_prompt(prompt, quoted=True)}", file=out)
        print(f"  {report.describe()}", file=out)
        if report.features is None:  # not scored (fail closed): describe() said why
            continue
        if report.explained_head != ANOMALY_HEAD:
            _print_tokens(report, tokenizer, out)
            continue
        print(f"  the SAE features that add most to the {ANOMALY_HEAD} head's score:", file=out)
        column = "  top prompts in the store" if examples else ""
        print(f"  {FEATURE_HEADER}{column}", file=out)
        for f in report.features:
            print(f"  {_feature_row(f)}", file=out)
            for value, r in examples.get(f.feature, []):
                text = " ".join(text_of[r].split())
                print(f"  {'':>8} {value:>10.3f}  {text[:100]!r}", file=out)
        total = sum(f.contribution for f in report.features)
        print(
            f"  (the {len(report.features)} features listed make {total:.3f} of the score {report.score:.3f})", file=out
        )


def _print_tokens(report: SafetyReport, tokenizer: Any, out: TextIO) -> None:
    """The prompt tokens behind a supervised head's verdict, or its top features when it reads no prompt mean."""
    head = report.explained_head
    if report.tokens is None:
        print(f"  the {head} head reads no prompt mean, so no token is named; its top features:", file=out)
        print(f"  {FEATURE_HEADER}", file=out)
        for f in report.features or ():
            print(f"  {_feature_row(f)}", file=out)
        return
    print(f"  the prompt tokens that raise the {head} head's logit most (how much it falls without each):", file=out)
    for t in report.tokens:
        print(f"  {t.contribution:>8.3f}  {t.text(tokenizer)!r} (token {t.position})", file=out)
