"""What every SAE layout reader shares: the errors, :class:`LoadedSAE`, hook names, and the checked readers.

:func:`sae_hook_layer` maps a hook name to the decoder block ``L`` whose output it is; the small
readers (:func:`read_config`, :func:`read_safetensors`) and validators (:func:`positive_int`,
:func:`take_tensors`) turn every bad file, key or value into an :class:`SAEFormatError` naming it;
:func:`build_sae` converts SAELens-oriented weights to hf-lsad's ``nn.Linear`` ``encoder`` /
``decoder``, folding a ``b_dec`` subtraction into the encoder bias.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from ...core.serialization import GuardFormatError, check_readable, read_json
from ..model import SAEConfig, SparseAutoencoder

_RESID_POST = re.compile(r"blocks\.(\d+)\.hook_resid_post")
_RESID_PRE = re.compile(r"blocks\.(\d+)\.hook_resid_pre")
_SPARSIFY_LAYER = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]*\.)*(?:layers|h)\.(\d+)")


class SAEFormatError(GuardFormatError):
    """An external SAE folder is missing a file, holds a bad tensor, or uses an unsupported option."""


class SAELayerMismatchError(ValueError):
    """The SAE was trained on another layer (hook point) than the one the guard reads."""


@dataclass(frozen=True)
class LoadedSAE:
    """An SAE read from one of :data:`~hf_lsad.sae.formats.LAYOUTS`, with where it was trained."""

    sae: SparseAutoencoder
    """The SAE, float32, in hf-lsad's form (``encoder`` / ``decoder`` linears)."""

    layout: str
    """One of :data:`~hf_lsad.sae.formats.LAYOUTS`."""

    hook_name: str | None
    """The hook point as the source names it (``blocks.20.hook_resid_post``, ``layers.20``,
    ``layer_20``); ``None`` if the folder does not say (an hf-lsad SAE)."""

    layer: int | None
    """Decoder block whose output the SAE reads (``HookPoint.layer``; ``hidden_states[layer + 1]``);
    ``None`` if unknown."""

    folder: Path
    """The local folder the SAE was read from (a Hub repo's cached snapshot subfolder)."""


def sae_hook_layer(hook_name: str) -> int:
    """The decoder block ``L`` whose output ``hook_name`` is.

    ``blocks.L.hook_resid_post`` (SAELens) and ``layers.L`` (sparsify; also ``model.layers.L``,
    ``h.L``) give ``L``; ``blocks.L.hook_resid_pre`` gives ``L - 1``. Any other hook (MLP or
    attention outputs, ``hook_z``, embeddings, ``hook_resid_mid``) is not a residual-stream block
    output and raises :class:`SAEFormatError`.
    """
    if match := _RESID_POST.fullmatch(hook_name):
        return int(match.group(1))
    if match := _RESID_PRE.fullmatch(hook_name):
        block = int(match.group(1))
        if block == 0:
            raise SAEFormatError(
                f"hook {hook_name!r} reads the embeddings (the input of block 0), not the output of a decoder block"
            )
        return block - 1
    if match := _SPARSIFY_LAYER.fullmatch(hook_name):
        return int(match.group(1))
    raise SAEFormatError(
        f"hook {hook_name!r} is not the residual-stream output of a decoder block; hf-lsad guards read "
        "'blocks.L.hook_resid_post' (SAELens) = 'layers.L' (sparsify) = hidden_states[L+1]"
    )


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a layout's ``cfg.json``)."""
    try:
        raw = read_json(path)
    except GuardFormatError as err:
        raise SAEFormatError(str(err)) from err
    if not isinstance(raw, dict):
        raise SAEFormatError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def positive_int(cfg: dict[str, Any], key: str, source: Path) -> int:
    """``cfg[key]``, which must be a positive integer (``source`` names the file in the error)."""
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SAEFormatError(f"{source}: {key}={value!r}, expected a positive integer")
    return value


def layer_of(hook_name: str, source: Path) -> int:
    """:func:`sae_hook_layer`, with ``source`` (the file or folder naming the hook) in the error."""
    try:
        return sae_hook_layer(hook_name)
    except SAEFormatError as err:
        raise SAEFormatError(f"{source}: {err}") from err


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """The tensors of the safetensors file ``path``."""
    if not path.is_file():
        raise SAEFormatError(f"missing file {path}")
    check_readable(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise SAEFormatError(f"{path} is not a readable safetensors file ({err})") from err


def take_tensors(tensors: dict[str, Tensor], shapes: dict[str, tuple[int, ...]], path: Path) -> dict[str, Tensor]:
    """Exactly the tensors in ``shapes``, with those shapes, finite, as float32."""
    missing = sorted(set(shapes) - set(tensors))
    unknown = sorted(set(tensors) - set(shapes))
    if missing or unknown:
        raise SAEFormatError(
            f"{path}: missing tensors {missing}, unexpected tensors {unknown}; expected {sorted(shapes)}"
        )
    out = {}
    for name, shape in shapes.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise SAEFormatError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        if not tensor.is_floating_point():
            raise SAEFormatError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, expected floating point")
        tensor = tensor.float()
        if not torch.isfinite(tensor).all():
            raise SAEFormatError(f"{path}: tensor {name!r} holds NaN or inf")
        out[name] = tensor
    return out


@torch.no_grad()
def build_sae(
    config: SAEConfig,
    *,
    w_enc: Tensor,
    b_enc: Tensor,
    w_dec: Tensor,
    b_dec: Tensor,
    threshold: Tensor | None,
    subtract_b_dec: bool,
) -> SparseAutoencoder:
    """An hf-lsad SAE from ``W_enc`` ``[d_in, d_sae]`` and ``W_dec`` ``[d_sae, d_in]`` (SAELens orientation).

    ``subtract_b_dec``: the source encodes ``x - b_dec``; folded into the encoder bias in float64.
    """
    sae = SparseAutoencoder(config)
    bias = b_enc.double() - b_dec.double() @ w_enc.double() if subtract_b_dec else b_enc
    sae.encoder.weight.copy_(w_enc.T)
    sae.encoder.bias.copy_(bias.float())
    sae.decoder.weight.copy_(w_dec.T)
    sae.decoder.bias.copy_(b_dec)
    if threshold is not None:
        if sae.threshold is None:
            raise ValueError(f"a threshold was given for a {config.activation} SAE; only jumprelu has one")
        sae.threshold.copy_(threshold)
    return sae.eval()
