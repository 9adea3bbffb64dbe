"""The sparsify layout: one folder per hookpoint, ``layers.L/cfg.json`` + ``sae.safetensors``.

As sparsify reads it (``sparsify/sparse_coder.py: SparseCoder.load_from_disk``). Tensors
``encoder.weight`` ``[num_latents, d_in]`` (an ``nn.Linear``), ``encoder.bias``, ``W_dec``
``[num_latents, d_in]``, ``b_dec`` ``[d_in]``.
``encode(x) = topk(ReLU((x - b_dec) @ encoder.weight.T + encoder.bias))``
(``sparsify/fused_encoder.py``); ``num_latents = 0`` means ``d_in * expansion_factor``. The
folder name is the hookpoint (``layers.L``, a module of the base model; its output); a folder not
named like one (no ``.``) leaves the layer unknown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..model import SAEConfig
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

SPARSIFY_CONFIG = "cfg.json"
SPARSIFY_WEIGHTS = "sae.safetensors"

#: sparsify ``SparseCoderConfig`` keys (``sparsify/config.py``, plus ``signed`` of older
#: releases), with the defaults sparsify uses when a key is absent.
SPARSIFY_DEFAULTS: dict[str, Any] = {
    "activation": "topk",
    "expansion_factor": 32,
    "normalize_decoder": True,  # a training constraint on W_dec; encode/decode do not read it
    "num_latents": 0,
    "k": 32,
    "multi_topk": False,  # an extra training loss; encode/decode do not read it
    "skip_connection": False,
    "transcode": False,
    "signed": False,
}


def read_sparsify(folder: Path) -> LoadedSAE:
    """The sparsify SAE in ``folder``; unknown keys and unsupported options raise :class:`SAEFormatError`."""
    cfg_path = folder / SPARSIFY_CONFIG
    raw = read_config(cfg_path)
    d_in = positive_int(raw, "d_in", cfg_path)
    unknown = sorted(set(raw) - set(SPARSIFY_DEFAULTS) - {"d_in"})
    if unknown:
        raise SAEFormatError(
            f"{cfg_path}: unknown sparsify config key(s) {unknown}; known: {sorted(SPARSIFY_DEFAULTS)} and 'd_in'"
        )
    cfg = {**SPARSIFY_DEFAULTS, **raw}
    supported_values = {"activation": "topk", "skip_connection": False, "transcode": False, "signed": False}
    for name, supported in supported_values.items():
        if cfg[name] != supported:
            raise SAEFormatError(f"{cfg_path}: {name}={cfg[name]!r} is not supported (only {supported!r})")
    num_latents, expansion = cfg["num_latents"], cfg["expansion_factor"]
    for name, value in (("num_latents", num_latents), ("expansion_factor", expansion), ("k", cfg["k"])):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SAEFormatError(f"{cfg_path}: {name}={value!r} must be a non-negative integer")
    d_sae = num_latents or d_in * expansion
    k = cfg["k"]
    if not 1 <= k <= d_sae:
        raise SAEFormatError(f"{cfg_path}: k={k} must be in [1, num_latents={d_sae}]")
    # The folder is named after the hookpoint (a dotted module name, or embed_tokens). A folder with
    # another name (a repo root holding one SAE, a renamed copy) does not say where the SAE was trained.
    hook_name: str | None = folder.name
    if "." in folder.name or folder.name == "embed_tokens":
        layer: int | None = layer_of(folder.name, folder)
    else:
        hook_name = layer = None

    weights_path = folder / SPARSIFY_WEIGHTS
    shapes = {"encoder.weight": (d_sae, d_in), "encoder.bias": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    weights = take_tensors(read_safetensors(weights_path), shapes, weights_path)
    sae = build_sae(
        SAEConfig(d_in=d_in, d_sae=d_sae, activation="topk", k=k),
        w_enc=weights["encoder.weight"].T,
        b_enc=weights["encoder.bias"],
        w_dec=weights["W_dec"],
        b_dec=weights["b_dec"],
        threshold=None,
        subtract_b_dec=True,  # SparseCoder.encode: x - b_dec unless transcode (refused above)
    )
    return LoadedSAE(sae, "sparsify", hook_name, layer, folder)
