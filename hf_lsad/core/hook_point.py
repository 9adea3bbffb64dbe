"""Where a guard reads a model: the hook point's identity, and locating decoder blocks.

A :class:`HookPoint` names a model, a decoder block and a token position. It is
plain data, saved in every guard and activation store, so this module imports
no transformers: the detector layer depends on it without depending on the LM
stack (nor torch, until a model is inspected). Models are only touched through
``model.config`` and their module tree.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ModelMismatchError, warn
from .validation import NON_NEGATIVE, POSITIVE, check_ranges, ranged

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

POSITIONS = ("response_last", "prompt_last", "prompt_mean")
"""Token positions a hook point reads (see :mod:`hf_lsad.capture`)."""
GUARD_POSITIONS = (*POSITIONS, "response_running")
"""Positions a guard can read; ``response_running`` scores every generated token (:mod:`hf_lsad.guard.running`)."""

Read = tuple[int, str]
"""A read of the residual stream: a decoder block (0-based) and a position (one of :data:`POSITIONS`)."""

# Where transformers keeps the decoder blocks, by architecture family.
_LAYER_PATHS = (
    "model.layers",  # Llama, Mistral, Qwen2/3, Gemma, Phi-3, OLMo
    "model.language_model.layers",  # multimodal wrappers (Gemma 3, Llava)
    "transformer.h",  # GPT-2, GPT-J, Bloom, Falcon
    "gpt_neox.layers",  # GPT-NeoX, Pythia
    "model.decoder.layers",  # OPT
    "transformer.blocks",  # MPT
)


def unwrap_peft(model: PreTrainedModel) -> PreTrainedModel:
    """The transformers model inside a peft ``PeftModel`` (its adapters stay in it and run in its forward pass), or
    ``model`` itself: block names are the transformers model's whichever of the two a guard meets."""
    peft = sys.modules.get("peft")  # a PeftModel exists only once peft is imported; this module imports nothing heavy
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def decoder_layers(model: PreTrainedModel) -> tuple[str, nn.ModuleList]:
    """The dotted path and ``ModuleList`` of the model's decoder blocks (of the transformers model a peft
    ``PeftModel`` wraps: :func:`unwrap_peft`)."""
    from torch import nn  # a model exists, so torch is loaded; this module itself imports nothing heavy

    expected = model.config.get_text_config().num_hidden_layers
    for path in _LAYER_PATHS:
        module: Any = unwrap_peft(model)
        for part in path.split("."):
            module = getattr(module, part, None)
        if isinstance(module, nn.ModuleList) and len(module) == expected:
            return path, module
    raise ValueError(
        f"cannot locate the decoder layers of {type(model).__name__} "
        f"(model_type={model.config.model_type!r}); looked for a ModuleList of "
        f"{expected} blocks at {', '.join(_LAYER_PATHS)}"
    )


def decoder_layer(model: PreTrainedModel, layer: int) -> tuple[str, nn.Module]:
    """Module name and module of decoder block ``layer`` (0-based; negative counts from the end)."""
    path, layers = decoder_layers(model)
    if not -len(layers) <= layer < len(layers):
        raise IndexError(f"layer {layer} is out of range: {type(model).__name__} has {len(layers)} decoder layers")
    index = layer % len(layers)
    return f"{path}.{index}", layers[index]


@dataclass
class HookPoint:
    """Where a guard reads the model: which model, which block, which token."""

    base_model: str
    """Hub id or path of the model the activations came from."""

    model_type: str
    """``config.model_type`` of that model (``llama``, ``qwen2``, ...)."""

    hidden_size: int = ranged(POSITIVE)
    """Residual-stream width, the SAE's input width."""

    num_hidden_layers: int = ranged(POSITIVE)
    """Number of decoder blocks of that model."""

    layer: int = ranged(NON_NEGATIVE)
    """0-based index of the decoder block whose output is read."""

    layer_module: str  # type: ignore[misc]  # mypy reads ranged(...) above as a default; it has none
    """Dotted module name of that block, e.g. ``model.layers.20``."""

    position: str  # type: ignore[misc]  # as layer_module
    """``response_last``, ``prompt_last`` or ``prompt_mean`` (the mean over the prompt's tokens; module docstring)."""

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.layer >= self.num_hidden_layers:
            below = f"a layer index below num_hidden_layers={self.num_hidden_layers}"
            raise ValueError(f"key 'layer' is {self.layer!r}, expected {below}")
        if self.position not in GUARD_POSITIONS:
            raise ValueError(f"unknown position {self.position!r}; choose one of {GUARD_POSITIONS}")

    @classmethod
    def from_model(cls, model: PreTrainedModel, layer: int, position: str, base_model: str | None = None) -> HookPoint:
        """The hook point of block ``layer`` of ``model`` at ``position``; ``base_model`` defaults to the model's
        ``name_or_path``."""
        name, _ = decoder_layer(model, layer)
        text_config = model.config.get_text_config()
        return cls(
            base_model=base_model or model.config.name_or_path or "",
            model_type=model.config.model_type,
            hidden_size=text_config.hidden_size,
            num_hidden_layers=text_config.num_hidden_layers,
            layer=layer % text_config.num_hidden_layers,
            layer_module=name,
            position=position,
        )

    def check_model(self, model: PreTrainedModel, *, allow_base_model_mismatch: bool = False) -> None:
        """Raise :class:`~hf_lsad.errors.ModelMismatchError` (a ``ValueError``) if ``model`` cannot be read at this
        hook point, or is not the guard's base model.

        Model type (``config.model_type``), hidden size, layer count and the hooked block's module
        name must match: always an error, whatever the names say.
        The model's name (``model.config.name_or_path``) must match :attr:`base_model` under
        :func:`same_base_model`; a mismatch is an error unless ``allow_base_model_mismatch``,
        which turns it into a ``UserWarning``. When either name is empty (a model built with
        ``from_config``, or a guard fitted on one) there is nothing to compare and no check.
        """
        text_config = model.config.get_text_config()
        if model.config.model_type != self.model_type:
            raise ModelMismatchError(
                f"guard was fitted on a {self.model_type!r} model ({self.base_model or 'unnamed'}), but "
                f"{model.config.name_or_path or type(model).__name__} is a {model.config.model_type!r} model"
            )
        if text_config.hidden_size != self.hidden_size:
            raise ModelMismatchError(
                f"guard expects hidden size {self.hidden_size} (fitted on {self.base_model}), "
                f"but {model.config.name_or_path or type(model).__name__} has hidden size {text_config.hidden_size}"
            )
        if text_config.num_hidden_layers != self.num_hidden_layers:
            raise ModelMismatchError(
                f"guard was fitted on a model with {self.num_hidden_layers} decoder layers (layer {self.layer}), "
                f"but {model.config.name_or_path or type(model).__name__} has {text_config.num_hidden_layers}"
            )
        name, _ = decoder_layer(model, self.layer)
        if name != self.layer_module:
            raise ModelMismatchError(
                f"guard reads {self.layer_module!r}, but this model's block {self.layer} is {name!r}"
            )
        model_name = str(model.config.name_or_path or "")
        if same_base_model(self.base_model, model_name) is False:
            message = (
                f"guard was fitted on base model {self.base_model!r}, but the model to guard is {model_name!r} "
                f"(config.name_or_path); its scores and threshold are only meaningful on the model it was fitted on"
            )
            if not allow_base_model_mismatch:
                raise ModelMismatchError(
                    f"{message}. If this is the same model under another name (e.g. a local copy), "
                    "pass allow_base_model_mismatch=True."
                )
            warn(f"{message}; using it anyway (allow_base_model_mismatch=True).", UserWarning)


def base_model_key(name_or_path: str) -> str:
    """The comparable form of a model name: ``org/name`` (lower case) of a Hub id or local path.

    - A Hub id is kept as it is: ``HuggingFaceTB/SmolLM2-135M-Instruct``, ``gpt2``.
    - A huggingface_hub cache snapshot folder (``.../models--org--name/snapshots/<sha>``) is
      its repo id ``org/name``.
    - Any other path keeps its last two components: ``/data/HuggingFaceTB/SmolLM2-135M-Instruct``
      -> ``huggingfacetb/smollm2-135m-instruct``; ``./tiny-llama`` -> ``tiny-llama``.

    Returns ``""`` for an empty name.
    """
    parts = [part for part in str(name_or_path).strip().replace("\\", "/").split("/") if part not in ("", ".")]
    for i, part in enumerate(parts[:-1]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return part[len("models--") :].replace("--", "/").lower()
    return "/".join(parts[-2:]).lower()


def same_base_model(a: str, b: str) -> bool | None:
    """Whether two model names (Hub ids or local paths) name the same model; ``None`` if either is empty.

    Names are compared as :func:`base_model_key` gives them (case-insensitive, as Hub ids are).
    When one side has a single component (a Hub id without namespace such as ``gpt2``, or a
    one-component relative path) only the last components are compared, so ``gpt2`` matches
    ``openai-community/gpt2`` and ``tiny-llama`` matches ``/tmp/models/tiny-llama``.
    """
    key_a, key_b = base_model_key(a), base_model_key(b)
    if not key_a or not key_b:
        return None
    if "/" not in key_a or "/" not in key_b:
        return key_a.rsplit("/", 1)[-1] == key_b.rsplit("/", 1)[-1]
    return key_a == key_b
