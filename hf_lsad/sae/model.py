"""The sparse autoencoder: ``z = E(a) = ReLU(W_E a + b_E)`` and ``a_hat = D(z) = W_D z + b_D``.

Training (ReLU + L1, paper appendix "SAE Training") is :mod:`hf_lsad.sae.training`.

The encoder and decoder are plain ``nn.Linear`` modules named ``encoder`` and
``decoder`` so that peft's ``LoraConfig(target_modules=["encoder", "decoder"])``
can adapt them per cluster (LearnedMask-LoRA).

Loaded SAEs (:mod:`hf_lsad.sae.formats`: SAELens, sparsify, Gemma Scope) may use another
nonlinearity on the same pre-activations ``pre = W_E a + b_E`` (``SAEConfig.activation``):

- ``relu``: ``z = ReLU(pre)`` (the SAEs hf-lsad trains);
- ``jumprelu``: ``z = ReLU(pre) * 1[pre > threshold]`` with a per-feature ``threshold``
  (a buffer, saved in ``sae.safetensors``);
- ``topk``: ``ReLU`` of the ``k`` largest entries of ``pre``, zero elsewhere.

All three give codes ``z >= 0``, so "feature j is active" is ``z_j > 0`` for every one of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from ..core.hook_point import HookPoint
from ..core.serialization import (
    FORMAT_VERSION,
    GuardFormatError,
    config_from_dict,
    config_to_dict,
    config_to_replace,
    folder_path,
    load_module,
    read_json,
    save_module,
    staged_folder,
    write_json,
)
from ..core.validation import POSITIVE, check_format_version, check_ranges, ranged, require_keys

SAE_WEIGHTS = "sae.safetensors"
SAE_CONFIG = "config.json"

Activation = Literal["relu", "jumprelu", "topk"]
ACTIVATIONS: tuple[str, ...] = ("relu", "jumprelu", "topk")

#: SAE config keys added with JumpReLU / TopK support, and the values that SAEs saved before
#: them (``sae/config.json`` holding only ``d_in`` and ``d_sae``, e.g. the bundled guards) had:
#: every such SAE is a ReLU SAE. :meth:`SparseAutoencoder.from_pretrained` fills them in only
#: when *all* of them are absent; any other missing or unknown key is still an error.
LEGACY_SAE_CONFIG_DEFAULTS: dict[str, object] = {"activation": "relu", "k": None}


@dataclass
class SAEConfig:
    """Shape of a sparse autoencoder."""

    d_in: int = ranged(POSITIVE)
    """Width of the activations it reads: the hidden size of the hooked model."""

    d_sae: int = ranged(POSITIVE)
    """Number of dictionary features (the paper uses 16384)."""

    activation: Activation = "relu"
    """Nonlinearity on ``pre = W_E a + b_E``: ``relu``, ``jumprelu`` or ``topk`` (module docstring)."""

    k: int | None = None
    """Number of features kept by ``topk`` (``None`` for the other activations)."""

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown SAE activation {self.activation!r}; choose one of {ACTIVATIONS}")
        if self.activation == "topk":
            if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= self.d_sae:
                raise ValueError(f"a topk SAE needs an integer k in [1, d_sae={self.d_sae}], got k={self.k!r}")
        elif self.k is not None:
            raise ValueError(f"k is only used by the topk activation, got k={self.k!r} with {self.activation!r}")


class SAEOutput(NamedTuple):
    """What :meth:`SparseAutoencoder.forward` returns."""

    codes: Tensor
    """Sparse features ``z``, shape ``[batch, d_sae]``."""
    reconstruction: Tensor
    """``D(z)``, shape ``[batch, d_in]``."""


def apply_activation(pre: Tensor, config: SAEConfig, threshold: Tensor | None = None) -> Tensor:
    """Codes ``z`` from pre-activations ``pre`` (``[..., d_sae]``) under ``config.activation``.

    ``threshold`` (``[d_sae]``) is required by, and only used by, ``jumprelu``.
    """
    if config.activation == "relu":
        return torch.relu(pre)
    if config.activation == "jumprelu":
        if threshold is None:
            raise ValueError("a jumprelu SAE needs its per-feature threshold")
        return torch.relu(pre) * (pre > threshold).to(pre.dtype)
    if config.k is None:
        raise ValueError("a topk SAE needs its k")
    values, indices = pre.topk(config.k, dim=-1, sorted=False)
    return torch.zeros_like(pre).scatter(-1, indices, torch.relu(values))


class SparseAutoencoder(nn.Module):
    """An SAE: ``encode`` gives sparse codes, ``decode`` maps them back.

    ``encode(a) = activate(encoder(a))``; ``activate`` is ReLU, JumpReLU or TopK as
    ``config.activation`` says. A JumpReLU SAE also holds a ``threshold`` buffer (``[d_sae]``).

    ``layer`` is the decoder block whose output it was trained on (``HookPoint.layer``), ``None`` when not known (an
    SAE trained on bare tensors, or saved before hf-lsad recorded it). It is where the SAE was trained, not its shape,
    so it stays out of :class:`SAEConfig` (and out of the settings a guard's integrity record hashes).
    """

    threshold: Tensor | None

    def __init__(self, config: SAEConfig, layer: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.layer = check_sae_block(layer)
        self.encoder = nn.Linear(config.d_in, config.d_sae)
        self.decoder = nn.Linear(config.d_sae, config.d_in)
        if config.activation == "jumprelu":
            self.register_buffer("threshold", torch.zeros(config.d_sae))
        else:
            self.threshold = None

    def extra_repr(self) -> str:
        return f"activation={self.config.activation!r}" + (f", k={self.config.k}" if self.config.k is not None else "")

    def activate(self, pre: Tensor) -> Tensor:
        """The nonlinearity alone: codes from pre-activations ``encoder(a)`` (possibly adapted, e.g. by LoRA)."""
        return apply_activation(pre, self.config, self.threshold)

    def encode(self, activations: Tensor) -> Tensor:
        """Codes ``[batch, d_sae]`` of activations ``[batch, d_in]``."""
        return self.activate(self.encoder(activations))

    def decode(self, codes: Tensor) -> Tensor:
        """Reconstructions ``[batch, d_in]`` of codes ``[batch, d_sae]``."""
        return self.decoder(codes)

    def forward(self, activations: Tensor) -> SAEOutput:
        """Codes and reconstructions of activations ``[batch, d_in]``."""
        codes = self.encode(activations)
        return SAEOutput(codes, self.decode(codes))

    def check_reads(self, hook: HookPoint) -> None:
        """Raise ``ValueError`` unless this SAE reads what a guard at ``hook`` reads: activations of its width and,
        when the SAE records one, of its layer. The one check of an SAE against a guard's hook point, made when a
        guard is fitted (before any work) and whenever one is built or loaded."""
        if self.config.d_in != hook.hidden_size:
            raise ValueError(
                f"the SAE reads width {self.config.d_in}, but the hook point {hook.layer_module} of "
                f"{hook.base_model or 'the model'} has hidden size {hook.hidden_size}: train or load an SAE on this "
                "model's layer"
            )
        if self.layer is not None and self.layer != hook.layer:
            raise ValueError(
                f"the SAE was trained on decoder block {self.layer}, but the guard reads block {hook.layer}: use the "
                f"SAE for layer {hook.layer}, or read the activations at layer {self.layer}"
            )

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Scale each feature's decoder column to unit norm, in place (training keeps them there)."""
        self.decoder.weight /= self.decoder.weight.norm(dim=0, keepdim=True).clamp_min(1e-8)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write ``config.json`` and ``sae.safetensors`` into ``save_directory``; a folder holding another kind's
        ``config.json`` (a model's, a guard's) is refused before anything is written (``FileExistsError``). Saved
        over an SAE, a save that fails while writing leaves that SAE as it was
        (:func:`~hf_lsad.core.serialization.staged_folder`)."""
        path = folder_path(save_directory, "save_directory")
        check_sae_destination(path)
        record: dict[str, object] = {"format_version": FORMAT_VERSION, "sae": config_to_dict(self.config)}
        if self.layer is not None:
            record["layer"] = self.layer
        with staged_folder(path, SAE_CONFIG) as staging:
            write_json(staging / SAE_CONFIG, record)
            save_module(self, staging / SAE_WEIGHTS)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> SparseAutoencoder:
        """Load an SAE written by :meth:`save_pretrained`; strict about keys and shapes. ``layer``, when the folder
        records it, must be a decoder block index (a folder without it loads with ``layer=None``)."""
        path = folder_path(directory, "directory")
        raw = read_json(path / SAE_CONFIG)
        check_format_version(raw.get("format_version"), FORMAT_VERSION, source=str(path / SAE_CONFIG))
        require_keys(raw, {"format_version", "sae"}, {"layer"}, source=str(path / SAE_CONFIG))
        fields = raw["sae"]
        if isinstance(fields, dict) and not set(LEGACY_SAE_CONFIG_DEFAULTS) & set(fields):
            # Written before JumpReLU / TopK support: a ReLU SAE (see LEGACY_SAE_CONFIG_DEFAULTS).
            fields = {**fields, **LEGACY_SAE_CONFIG_DEFAULTS}
        try:
            layer = check_sae_block(raw.get("layer"))
        except ValueError as error:
            raise GuardFormatError(f"{path / SAE_CONFIG}: {error}") from None
        sae = cls(config_from_dict(SAEConfig, fields, source=str(path / SAE_CONFIG)), layer)
        load_module(sae, path / SAE_WEIGHTS)
        return sae


def check_sae_block(layer: object) -> int | None:
    """``layer`` as :attr:`SparseAutoencoder.layer` takes it, and :func:`~hf_lsad.sae.formats.check_sae_layer`
    checks an SAE against: a non-negative decoder block index, or ``None``."""
    if layer is None:
        return None
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"a layer is a non-negative decoder block index (HookPoint.layer) or None, got {layer!r}")
    return layer


def check_sae_destination(path: Path) -> None:
    """Raise :class:`FileExistsError` if ``path`` holds the ``config.json`` of something else than an SAE (a model, a
    guard), which an SAE saved there would overwrite."""
    config_to_replace(path / SAE_CONFIG, {"sae"}, "an SAE")
