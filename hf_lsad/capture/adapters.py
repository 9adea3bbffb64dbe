"""peft adapters: which ones a model runs, so that a guard knows whether its thresholds were set through them.

A LoRA adapter (or any peft tuner) changes the residual stream every head reads. A guard fitted and thresholded on
the base model still runs on the adapted model (the blocks are the same modules: :func:`hf_lsad.core.hook_point.
unwrap_peft`), but its flag rates are the base model's only as far as the adapter leaves the stream alone.
:func:`adapter_digest` names what a model runs; collection records it in the
:class:`~hf_lsad.core.prompt_inputs.InputProfile` of the rows it reads, so a guard's profile says which adapter its
thresholds were set through, and :func:`check_adapter` refuses a guarded model that runs another (or warns, when
allowed). Refused, because the shift is large and fails open: a LoRA fine-tune of SmolLM2 at the released thresholds
caught 0.43 of do-not-answer where the base model catches 0.97, and thresholds re-set through it gave the base
model's operating point back (``python benchmarks/run.py heads/adapter_shift``).

The digest covers the weights and the numbers (rank, scaling) of every *active* adapter of every tuner layer, keyed
by the layer's name in the transformers model: the same adapter gives the same digest whether it was loaded by
``peft.PeftModel.from_pretrained`` or by transformers' ``model.load_adapter``, and whatever name it was loaded under.
An adapter merged into the base weights and unloaded (``merge_and_unload``) leaves no tuner layer: nothing tells
that model from the base model by its modules. What tells it is how the guard's heads score fixed prompts through it
(:mod:`hf_lsad.guard.fingerprint`).
"""

from __future__ import annotations

import hashlib
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..core.hook_point import unwrap_peft
from ..errors import AdapterWarning, ModelMismatchError, warn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..core.prompt_inputs import InputProfile


def adapter_digest(model: PreTrainedModel) -> str | None:
    """``sha256:<hex>`` of the peft adapters ``model`` runs (a ``PeftModel`` or a transformers model with adapters
    loaded), ``None`` when it runs none: no tuner layer, or every one disabled (``with peft_model.disable_adapter()``)
    or without an active adapter."""
    peft = sys.modules.get("peft")  # adapters exist only once peft is imported
    if peft is None:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    digest = hashlib.sha256()
    found = False
    for name, module in unwrap_peft(model).named_modules():
        if not isinstance(module, BaseTunerLayer) or module.disable_adapters:
            continue
        for adapter in sorted(module.active_adapters):
            for part in module.adapter_layer_names:
                weights = getattr(module, part, {})
                if adapter not in weights:
                    continue
                found = True
                held = weights[adapter]
                tensors = held.state_dict() if isinstance(held, nn.Module) else {"": held}
                for key, tensor in sorted(tensors.items()):
                    digest.update(f"{name}.{part}.{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                    digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for part in module.other_param_names:  # rank, alpha, scaling: numbers the weights are used with
                values = getattr(module, part, None)
                value = values.get(adapter) if isinstance(values, dict) else None
                if isinstance(value, (int, float, bool)):
                    digest.update(f"{name}.{part}={value!r}".encode())
    return f"sha256:{digest.hexdigest()}" if found else None


def adapter_label(digest: str | None) -> str:
    """A digest as messages name it: by its first hex digits, or "no adapter"."""
    return "no adapter" if digest is None else f"the peft adapter {digest[:19]}"


def check_adapter(model: PreTrainedModel, inputs: InputProfile | None, *, allow_mismatch: bool = False) -> bool:
    """Refuse (:class:`~hf_lsad.errors.ModelMismatchError`) a ``model`` that runs other peft adapters than those the
    guard's thresholds were set through (``inputs``: the guard's profile; ``None``, a guard without one, counts as set
    on the model without adapters); with ``allow_mismatch``, warn (:class:`~hf_lsad.errors.AdapterWarning`). Returns
    whether the model runs the guard's adapters (``False`` after the warning)."""
    running = adapter_digest(model)
    fitted = inputs.adapter if inputs is not None else None
    if running == fitted:
        return True
    if fitted is None:
        what = f"the model runs {adapter_label(running)}; the guard's thresholds were set on the model without it"
    elif running is None:
        what = f"the guard's thresholds were set through {adapter_label(fitted)}, which this model does not run"
    else:
        what = f"the model runs {adapter_label(running)}; the guard's thresholds were set through another"
    message = (
        f"{what}. An adapter changes the residual stream the heads read, so the guard may flag more or less of your "
        "traffic than its card says (two LoRA fine-tunes measured here let half of one source's harm through). "
        "Re-set the thresholds through the model you serve: `hf-lsad set-budget --model ADAPTER --guard GUARD --out "
        "NEW` (on the bundled validation chat, or --benign your own traffic), or "
        "hf_lsad.fit_budget_on_prompts(model, tokenizer, guard); the guard then records the adapter"
    )
    if not allow_mismatch:
        raise ModelMismatchError(
            f"{message}. To guard it as it is, pass allow_adapter_mismatch=True (--allow-adapter-mismatch in the CLI)."
        )
    warn(f"{message}; guarding it anyway (allow_adapter_mismatch=True).", AdapterWarning)
    return False
