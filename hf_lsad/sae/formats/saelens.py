"""The SAELens layout: ``cfg.json`` + ``sae_weights.safetensors``.

As SAELens reads it (``sae_lens/constants.py``;
``sae_lens/loading/pretrained_sae_loaders.py: sae_lens_disk_loader``). Tensors ``W_enc``
``[d_in, d_sae]``, ``b_enc`` ``[d_sae]``, ``W_dec`` ``[d_sae, d_in]``, ``b_dec`` ``[d_in]``, and
``threshold`` ``[d_sae]`` for JumpReLU (``sae_lens/saes/{standard,jumprelu,topk}_sae.py``).
``encode(x) = act((x - b_dec * apply_b_dec_to_input) @ W_enc + b_enc)`` with ``act`` = ReLU
(``standard``), ``ReLU(pre) * 1[pre > threshold]`` (``jumprelu``), ReLU of the ``k`` largest
(``topk``). Configs older than SAELens 6 are read as ``handle_pre_6_0_config`` reads them
(``hook_point`` -> ``hook_name``, ``activation_fn_str`` -> ``activation_fn``, TopK from
``activation_fn_kwargs.k``, ``apply_b_dec_to_input`` defaulting to true). The hook is
``blocks.L.hook_resid_post`` (or ``blocks.{L+1}.hook_resid_pre``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..model import Activation, SAEConfig
from .common import (
    LoadedSAE,
    SAEFormatError,
    build_sae,
    layer_of,
    positive_int,
    read_config,
    read_safetensors,
    take_tensors,
)

SAELENS_CONFIG = "cfg.json"
SAELENS_WEIGHTS = "sae_weights.safetensors"

#: SAELens architectures hf-lsad reads, and the activation each maps to.
SAELENS_ARCHITECTURES: dict[str, Activation] = {"standard": "relu", "jumprelu": "jumprelu", "topk": "topk"}


def read_saelens(folder: Path) -> LoadedSAE:
    """The SAELens SAE in ``folder``; options hf-lsad does not implement raise :class:`SAEFormatError`."""
    cfg_path = folder / SAELENS_CONFIG
    cfg = read_config(cfg_path)
    metadata = cfg.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise SAEFormatError(f"{cfg_path}: 'metadata' must be a JSON object, got {metadata!r}")

    def option(*names: str, default: Any = None) -> Any:
        """A SAELens option: 6.x keeps model / hook facts in ``metadata``, older configs at the top level."""
        for name in names:
            for source in (cfg, metadata):
                if name in source:
                    return source[name]
        return default

    architecture = cfg.get("architecture", "standard")  # pre-6.0 configs: "standard" unless TopK below
    activation_fn = option("activation_fn", "activation_fn_str", default="relu")
    fn_kwargs = option("activation_fn_kwargs", default={}) or {}
    if architecture == "standard" and activation_fn == "topk" and fn_kwargs.get("k") is not None:
        architecture = "topk"  # pre-6.0 TopK (handle_pre_6_0_config)
    if architecture not in SAELENS_ARCHITECTURES:
        raise SAEFormatError(
            f"{cfg_path}: SAELens architecture {architecture!r} is not supported; "
            f"hf-lsad reads {sorted(SAELENS_ARCHITECTURES)}"
        )
    if architecture != "topk" and activation_fn not in ("relu", None):
        raise SAEFormatError(f"{cfg_path}: activation_fn {activation_fn!r} is not supported (only 'relu')")
    if (norm := option("normalize_activations")) not in (None, False, "none"):
        raise SAEFormatError(
            f"{cfg_path}: normalize_activations={norm!r} is not supported (only 'none'); fold the "
            "normalisation into the weights first"
        )
    if (reshape := option("reshape_activations", default="none")) != "none":
        raise SAEFormatError(f"{cfg_path}: reshape_activations={reshape!r} is not supported (only 'none')")
    if option("hook_head_index") is not None:
        raise SAEFormatError(f"{cfg_path}: hook_head_index={option('hook_head_index')!r} is not supported")
    if option("finetuning_scaling_factor", default=False):
        raise SAEFormatError(f"{cfg_path}: finetuning_scaling_factor=true is not supported")
    if option("rescale_acts_by_decoder_norm", default=False):
        raise SAEFormatError(f"{cfg_path}: rescale_acts_by_decoder_norm=true (TopK) is not supported")
    apply_b_dec = option("apply_b_dec_to_input", default=True)
    if not isinstance(apply_b_dec, bool):
        raise SAEFormatError(f"{cfg_path}: apply_b_dec_to_input must be true or false, got {apply_b_dec!r}")
    d_in, d_sae = positive_int(cfg, "d_in", cfg_path), positive_int(cfg, "d_sae", cfg_path)
    activation = SAELENS_ARCHITECTURES[architecture]
    k = None
    if activation == "topk":
        k = cfg.get("k", fn_kwargs.get("k"))
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d_sae:
            raise SAEFormatError(f"{cfg_path}: TopK k={k!r}, expected an integer in [1, d_sae={d_sae}]")
    hook_name = option("hook_name", "hook_point")
    if not isinstance(hook_name, str):
        raise SAEFormatError(f"{cfg_path}: no hook_name (metadata.hook_name, hook_name or hook_point)")
    layer = layer_of(hook_name, cfg_path)

    weights_path = folder / SAELENS_WEIGHTS
    tensors = read_safetensors(weights_path)
    for name in ("scaling_factor", "finetuning_scaling_factor"):
        if name in tensors:  # read_sae_components_from_disk drops an all-ones scaling factor
            if not torch.equal(tensors[name], torch.ones_like(tensors[name])):
                raise SAEFormatError(
                    f"{weights_path}: tensor {name!r} is not all ones; scaling factors are not supported"
                )
            del tensors[name]
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    if activation == "jumprelu":
        shapes["threshold"] = (d_sae,)
        if "log_threshold" in tensors and "threshold" not in tensors:  # JumpReLUTrainingSAE checkpoints
            tensors["threshold"] = tensors.pop("log_threshold").double().exp()
    weights = take_tensors(tensors, shapes, weights_path)
    sae = build_sae(
        SAEConfig(d_in=d_in, d_sae=d_sae, activation=activation, k=k),
        w_enc=weights["W_enc"],
        b_enc=weights["b_enc"],
        w_dec=weights["W_dec"],
        b_dec=weights["b_dec"],
        threshold=weights.get("threshold"),
        subtract_b_dec=apply_b_dec,
    )
    return LoadedSAE(sae, "saelens", hook_name, layer, folder)
