"""Model cards (``README.md``) for guards, rendered from ``model_cards/guard_card.md``.

The card carries the Hub metadata (``library_name: hf-lsad``, ``base_model``, tags,
license, datasets), the guard's settings as saved in its ``config.json``, a description
of the data it was fitted on, the metrics the caller measured (AUROC / TPR@5%FPR per
unsafe category; never filled in by this module), and a usage snippet. It is rendered from the
guard's plain parts (:class:`hf_lsad.guard.files.GuardParts`), never from the guard object.

    card = guard_model_card(guard.parts(), metrics={"harmful": {"auroc": 0.97, "tpr_at_5fpr": 0.88}},
                            repo_id="org/smollm2-lsad")
    card.validate()          # the Hub's metadata check (needs HF_ENDPOINT reachable)
    card.save("guard/README.md")

:meth:`SafetyGuard.save_pretrained` and :meth:`SafetyGuard.push_to_hub` call this for you.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..core.metrics import METRICS
from ..core.serialization import config_to_dict
from ..version import library_versions
from .files import MODEL_CARD
from .types import RATE_TOLERANCE

if TYPE_CHECKING:
    from .files import GuardParts

__all__ = [
    "BENIGN_OOD_WARNING_FPR",
    "DEFAULT_LICENSE",
    "GUARD_CARD_TEMPLATE",
    "GUARD_TAGS",
    "METRIC_COLUMNS",
    "benign_ood_warning",
    "card_section",
    "derived_data",
    "describe_records",
    "guard_model_card",
]

GUARD_CARD_TEMPLATE = Path(__file__).parent.parent / "model_cards" / "guard_card.md"
"""The Jinja template of guard cards: top-level ``model_cards/guard_card.md``, reached through the
package's ``model_cards`` link in a source tree and copied into wheels."""

GUARD_TAGS = ["hf-lsad", "safety", "sparse-autoencoder", "anomaly-detection"]
DEFAULT_LICENSE = "apache-2.0"

METRIC_COLUMNS = {
    **{key: METRICS[key] for key in ("auroc", "auroc_pooled")},
    "tpr_at_fpr": "TPR@5%FPR",
    "flagged": METRICS["flagged"],
}
"""Column titles of the :data:`hf_lsad.core.metrics.METRICS` keys a card shows first (``hf-lsad evaluate`` measures at
5% FPR); other keys are shown under their own name."""

METRIC_ALIASES = {"pooled_auroc": "auroc_pooled", "tpr_at_5fpr": "tpr_at_fpr"}
"""Keys of metrics dicts written before the one vocabulary (:data:`hf_lsad.core.metrics.METRICS`), still read."""

DEFAULT_METRICS_NOTE = (
    "Measured by whoever pushed this guard (`hf-lsad evaluate` uses the guard's held-out safe activations as "
    "negatives and each unsafe category as positives; with `--benign-ood` also pooled: held-out safe + benign "
    "out-of-distribution negatives, the number to judge a deployment by). *Flagged at threshold* is the fraction "
    "of the category above the guard's threshold."
)


BENIGN_OOD_WARNING_FPR = 0.10
"""Above this benign-OOD flag rate at the guard's threshold, the card warns (and ``hf-lsad evaluate`` too)."""


def benign_ood_warning(flag_rate: float) -> str:
    """The warning for a guard that flags ``flag_rate`` of benign out-of-distribution prompts; ``""`` if at most 10%."""
    if flag_rate <= BENIGN_OOD_WARNING_FPR:
        return ""
    return (
        f"This guard flags {flag_rate:.0%} of benign out-of-distribution prompts at its threshold (more than "
        f"{BENIGN_OOD_WARNING_FPR:.0%}): its score measures how unlike its safe training data a prompt is, not how "
        "unsafe. Before deploying it, calibrate it per cluster on a small labelled sample (`hf-lsad calibrate`) "
        "or fit it on a safe pool that covers the benign traffic it will see."
    )


def _is_hub_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not Path(name).expanduser().is_absolute()


def _format_number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4f}" if abs(value) < 1000 else f"{value:.6g}"


def _metrics_table(metrics: Mapping[str, Mapping[str, float]]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Header titles and ``(category, cells)`` rows; keys in :data:`METRIC_COLUMNS` order, then the others."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must map category -> {{metric: value}}, got {type(metrics).__name__}")
    metrics = {
        category: {METRIC_ALIASES.get(key, key): value for key, value in row.items()}
        if isinstance(row, Mapping)
        else row
        for category, row in metrics.items()
    }
    keys: list[str] = [key for key in METRIC_COLUMNS if any(key in row for row in metrics.values())]
    for category, row in metrics.items():
        if not isinstance(row, Mapping):
            raise TypeError(f"metrics[{category!r}] must map metric name -> value, got {type(row).__name__}")
        for key, value in row.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"metrics[{category!r}][{key!r}] must be a finite number, got {value!r}")
            if key not in keys:
                keys.append(key)
    rows = [
        (str(category).replace("|", "\\|"), [_format_number(row[key]) if key in row else "–" for key in keys])
        for category, row in metrics.items()
    ]
    return [METRIC_COLUMNS.get(key, key) for key in keys], rows


def _flatten(settings: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in settings.items():
        if isinstance(value, Mapping):
            items.extend(_flatten(value, f"{prefix}{key}."))
        else:
            items.append((f"{prefix}{key}", value))
    return items


def describe_records(records: Iterable[Mapping[str, Any]], what: str = "prompts") -> str:
    """One Markdown paragraph counting activation-store records by ``category`` and ``source``."""
    records = list(records)
    categories = Counter(str(r.get("category", "unknown")) for r in records)
    sources = Counter(str(r.get("source", "unknown")) for r in records)
    listing = ", ".join(
        f"`{name}` ({count})" for name, count in sorted(sources.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    return (
        f"{len(records)} {what}, categories {', '.join(f'`{c}` ({n})' for c, n in sorted(categories.items()))}; "
        f"sources: {listing}."
    )


def card_section(folder: str | os.PathLike, title: str) -> str | None:
    """The text of the section ``## {title}`` of the model card in ``folder`` (``None``: no card, or no such
    section), without its heading and the blank lines around it."""
    card = Path(folder) / MODEL_CARD
    if not card.is_file():
        return None
    lines = card.read_text(encoding="utf-8").splitlines()
    heading = f"## {title}"
    if heading not in lines:
        return None
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end]).strip() or None


def derived_data(parent: str, parent_folder: str | os.PathLike, change: str) -> str:
    """The card's training-data text for a guard derived from the one in ``parent_folder`` (named ``parent``): what
    its own card said the parent was fitted on, then ``change``, so that a chain of derivations reads in order."""
    before = card_section(parent_folder, "Training data")
    if before is None:
        return f"Derived from `{parent}`, whose card did not describe its data. Then: {change}."
    return f"Derived from `{parent}`:\n\n{before}\n\nThen: {change}."


def _title(guard: GuardParts, where: str) -> str:
    """``hf-lsad guard [where]: <heads> on <base>``: the anomaly method, and each supervised head by name and kind."""
    config = guard.config
    methods = config.method
    if guard.heads:
        supervised = (f"{head.name} ({head.config.probe.label})" for head in guard.heads)
        methods = " + ".join([f"anomaly ({config.method})", *supervised])
    return f"hf-lsad guard{f' {where}' if where else ''}: {methods} on {config.hook.base_model or 'an unnamed model'}"


def _usage(base: str, repo_id: str | None, subfolder: str, revision: str | None, position: str) -> str:
    guard_ref = repo_id or "path/to/this/guard"
    kwargs = {}
    if repo_id:
        kwargs["revision"] = revision or "main"
    if subfolder:
        kwargs["subfolder"] = subfolder
    guard_kwargs = "{" + ", ".join(f'"{k}": "{v}"' for k, v in kwargs.items()) + "}"
    max_new_tokens = 1 if position == "prompt_last" else 64
    lines = [
        "from transformers import AutoTokenizer",
        "from hf_lsad import GuardedModelForCausalLM",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{base}")',
        "model = GuardedModelForCausalLM.from_pretrained(",
        f'    "{base}",',
        f'    guard="{guard_ref}",',
        *([f"    guard_kwargs={guard_kwargs},"] if kwargs else []),
        ")",
        "inputs = tokenizer.apply_chat_template(",
        '    [{"role": "user", "content": "How do I bake bread?"}],',
        "    add_generation_prompt=True,",
        '    return_tensors="pt",',
        "    return_dict=True,",
        ")",
        f"output = model.generate(**inputs, max_new_tokens={max_new_tokens}, do_sample=False, "
        f"return_dict_in_generate=True)",
        'print(tokenizer.decode(output.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))',
        "print(output.safety[0].describe())  # the verdict, each head's score beside its threshold, who decided",
    ]
    return "\n".join(lines)


def guard_model_card(
    guard: GuardParts,
    *,
    metrics: Mapping[str, Mapping[str, float]] | None = None,
    metrics_note: str | None = None,
    data: str | None = None,
    datasets: str | list[str] | None = None,
    license: str = DEFAULT_LICENSE,
    repo_id: str | None = None,
    subfolder: str = "",
    revision: str | None = None,
    template_path: str | os.PathLike | None = None,
    limitations: str | None = None,
) -> ModelCard:
    """Render the model card of ``guard``.

    Args:
        guard: The parts of the guard described (:meth:`hf_lsad.guard.SafetyGuard.parts`).
        metrics: Measured metrics, ``{category: {"auroc": ..., "tpr_at_5fpr": ..., "flagged": ...}}``
            (the JSON ``hf-lsad evaluate`` prints); any other numeric key gets its own column.
            ``None``: the card says that no metrics were measured.
        metrics_note: One paragraph above the metrics table saying how they were measured.
        data: Markdown describing the data the guard was fitted on (see :func:`describe_records`).
            Default: what the guard's config records (row counts, hook point, base model).
        datasets: Hub dataset id(s) for the card metadata (``None``: left out).
        license: License identifier for the card metadata.
        repo_id: Hub repo the card goes to, for the usage snippet (``None``: a local folder).
        subfolder: Folder of the guard in that repo.
        revision: Branch (or tag / sha) for the usage snippet (default ``main``).
        template_path: Jinja template (default :data:`GUARD_CARD_TEMPLATE`).
        limitations: Markdown on what the guard cannot be expected to catch, above the general limitations.
    """
    config = guard.config
    hook = config.hook
    base = hook.base_model
    base_is_hub_id = bool(base) and _is_hub_id(base)
    metrics_header, metrics_rows = _metrics_table(metrics) if metrics is not None else ([], [])
    sae = guard.sae
    card_data = ModelCardData(
        library_name="hf-lsad",
        base_model=base if base_is_hub_id else None,
        tags=list(GUARD_TAGS),
        license=license,
        datasets=datasets,
    )
    if base_is_hub_id:
        base_model_md = f"[`{base}`](https://huggingface.co/{base})"
    else:
        base_model_md = f"`{base}` (a local model)" if base else "an unnamed model"
    default_data = (
        f"{config.n_fit + config.n_holdout} activations of safe prompts, read at `{hook.layer_module}` "
        f"(`{hook.position}`) of `{base or 'an unnamed model'}`: {config.n_fit} to fit the detector, "
        f"{config.n_holdout} held out to set the threshold (split seed {config.seed}). "
        "The uploader did not describe the prompts."
    )
    versions = library_versions("hf_lsad", "torch", "faiss", "transformers", "huggingface_hub")
    calibration = guard.calibration
    if calibration is not None:
        flag_rule = (
            f"its calibrated probability of being unsafe, sigmoid(a_c * score + b_c) with an affine map per cluster "
            f"({calibration.coverage()}), "
            f"is above {guard.budget.thresholds[0] if guard.budget is not None else calibration.threshold:g}"
        )
        fit_note = "The detector was fitted on safe data only; the calibration used a small labelled sample."
    elif guard.budget is not None:  # the anomaly head's threshold is its share of the budget, not the holdout's
        flag_rule = f"its score is above {guard.budget.thresholds[0]:g}"
        fit_note = "The detector is unsupervised: only safe data was used to fit it."
    else:
        flag_rule = fit_note = ""
    where = (repo_id or "") + (f"/{subfolder}" if subfolder else "")
    return ModelCard.from_template(
        card_data,
        template_path=os.fspath(template_path or GUARD_CARD_TEMPLATE),
        title=_title(guard, where),
        base_model_md=base_model_md,
        hook=hook,
        position_md=(
            "last prompt token (`prompt_last`, screened before the response)"
            if hook.position == "prompt_last"
            else "final response token (`response_last`)"
        ),
        method=config.method,
        sae=f"{sae.config.d_in} → {sae.config.d_sae} features" if sae is not None else "",
        threshold=f"{config.threshold:.6g}",
        flag_rule=flag_rule,
        fit_note=fit_note,
        target_fpr_pct=f"{config.target_fpr:.1%}".replace(".0%", "%"),
        n_fit=config.n_fit,
        n_holdout=config.n_holdout,
        seed=config.seed,
        detector_settings=_flatten(config_to_dict(guard.detector.config)),
        versions=list(versions.items()),
        data=data or default_data,
        metrics_header=metrics_header,
        metrics_rows=metrics_rows,
        metrics_note=metrics_note or DEFAULT_METRICS_NOTE,
        metrics_note_only=metrics is None and metrics_note is not None,
        benign_ood_warning=benign_ood_warning((metrics or {}).get("benign_ood", {}).get("flagged", 0.0)),
        usage=_usage(base or "path/to/base-model", repo_id, subfolder, revision, hook.position),
        heads_rows=_heads_rows(guard),
        budget=guard.budget,
        limitations=limitations,
        adapter=guard.inputs.adapter if guard.inputs is not None else None,
        fingerprint=guard.fingerprint.input_ids.shape[0] if guard.fingerprint is not None else None,
        boundary=guard.fingerprint.boundary if guard.fingerprint is not None else None,
        rate_tolerance=RATE_TOLERANCE,
    )


def _heads_rows(guard: GuardParts) -> list[list[str]]:
    """One row per head (the anomaly head first) for the card's heads table; empty for a single-head guard."""
    if not guard.heads or guard.budget is None:
        return []
    hook = guard.config.hook
    rows = [
        [
            "`anomaly`",
            guard.config.method,
            f"layer {hook.layer} `{hook.position}`",
            "benign prompts only (unsupervised)",
            f"{guard.budget.shares[0]:.2f}",
            f"{guard.budget.thresholds[0]:.4g}",
        ]
    ]
    for head, share, threshold in zip(guard.heads, guard.budget.shares[1:], guard.budget.thresholds[1:]):
        reads = ", ".join(f"layer {layer} `{position}`" for layer, position in head.reads)
        sources = ", ".join(head.config.sources)
        learnt = f"{head.config.n_unsafe} unsafe rows ({sources}) against {head.config.n_safe} benign"
        rows.append([f"`{head.name}`", head.config.probe.label, reads, learnt, f"{share:.2f}", f"{threshold:.4g}"])
    return rows
