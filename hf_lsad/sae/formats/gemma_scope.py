"""The Gemma Scope layout: ``params.npz``, read with ``numpy.load(..., allow_pickle=False)``.

Arrays ``W_enc`` ``[d_in, d_sae]``, ``W_dec`` ``[d_sae, d_in]``, ``b_enc``, ``b_dec``,
``threshold`` (JumpReLU), no ``b_dec`` subtraction before encoding (Gemma Scope tutorial, as
copied in EleutherAI/sae-auto-interp ``sae_auto_interp/autoencoders/DeepMind/model.py``; SAELens
``get_gemma_2_config_from_hf``: ``apply_b_dec_to_input: False``). Residual SAEs
(``google/gemma-scope-*-res``) sit under ``layer_L/...``, the output of decoder block ``L``; the
layer is read from that path, and MLP, attention, transcoder and embedding SAEs are refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from ..model import SAEConfig
from .common import LoadedSAE, SAEFormatError, build_sae, take_tensors

GEMMA_SCOPE_PARAMS = "params.npz"

_GEMMA_SCOPE_LAYER = re.compile(r"(?:^|[/\\])layer_(\d+)(?=$|[/\\])")
_GEMMA_SCOPE_OTHER_SITES = re.compile(
    r"gemma-scope[^/\\]*-(?:mlp|att|transcoders?)(?=$|[-/\\])|(?:^|[/\\])embedding(?=$|[/\\_])"
)


def read_gemma_scope(folder: Path, name: str) -> LoadedSAE:
    """The Gemma Scope SAE in ``folder``; ``name`` (the repo id or path asked for) and ``folder`` give its layer."""
    path = folder / GEMMA_SCOPE_PARAMS
    where = f"{name} {folder}"
    if match := _GEMMA_SCOPE_OTHER_SITES.search(where):
        raise SAEFormatError(
            f"Gemma Scope SAE '{folder}' is a {match.group(0)!r} SAE; hf-lsad guards read the residual stream "
            "(google/gemma-scope-*-res)"
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except ValueError as err:  # numpy refuses object (pickled) arrays when allow_pickle=False
        raise SAEFormatError(f"{path}: not a plain-array .npz (pickled object arrays are refused): {err}") from err
    except (OSError, EOFError) as err:
        raise SAEFormatError(f"{path} is not a readable .npz file ({err})") from err
    # SAELens gemma_2_sae_huggingface_loader also accepts lower-case "w_enc" / "w_dec".
    arrays = {"W_" + key[2:] if key.startswith("w_") else key: value for key, value in arrays.items()}
    tensors = {}
    for key, value in arrays.items():
        if value.dtype.kind != "f":
            raise SAEFormatError(f"{path}: array {key!r} has dtype {value.dtype}, expected floating point")
        tensors[key] = torch.from_numpy(np.ascontiguousarray(value))
    if "W_enc" not in tensors or tensors["W_enc"].ndim != 2:
        shape = tuple(tensors["W_enc"].shape) if "W_enc" in tensors else None
        raise SAEFormatError(f"{path}: needs a 2-d array 'W_enc' [d_in, d_sae], got {shape}; keys {sorted(tensors)}")
    d_in, d_sae = tensors["W_enc"].shape
    shapes = {
        "W_enc": (d_in, d_sae),
        "W_dec": (d_sae, d_in),
        "b_enc": (d_sae,),
        "b_dec": (d_in,),
        "threshold": (d_sae,),
    }
    weights = take_tensors(tensors, shapes, path)
    layers = _GEMMA_SCOPE_LAYER.findall(where)
    hook_name = f"layer_{layers[-1]}" if layers else None
    sae = build_sae(
        SAEConfig(d_in=d_in, d_sae=d_sae, activation="jumprelu"),
        w_enc=weights["W_enc"],
        b_enc=weights["b_enc"],
        w_dec=weights["W_dec"],
        b_dec=weights["b_dec"],
        threshold=weights["threshold"],
        subtract_b_dec=False,
    )
    return LoadedSAE(sae, "gemma-scope", hook_name, int(layers[-1]) if layers else None, folder)
