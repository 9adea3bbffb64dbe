"""Load public SAEs (SAELens, sparsify, Gemma Scope) as a :class:`~hf_lsad.sae.SparseAutoencoder`.

:func:`load_sae` reads a local folder or a Hub repo (``revision`` / ``subfolder``) through
:func:`hf_lsad.hub.resolve_pretrained_dir`, the strict, pickle-refusing path guards use, detects
its layout (:func:`detect_sae_layout`), converts the weights to hf-lsad's ``nn.Linear``
``encoder`` / ``decoder`` and checks the layer the SAE was trained on against the guard's.
:func:`read_sae` returns the SAE together with that layer (:class:`LoadedSAE`).

Layouts, as the anchors' own code reads them:

``saelens``: ``cfg.json`` + ``sae_weights.safetensors`` (``sae_lens/constants.py``;
    ``sae_lens/loading/pretrained_sae_loaders.py: sae_lens_disk_loader``). Tensors ``W_enc``
    ``[d_in, d_sae]``, ``b_enc`` ``[d_sae]``, ``W_dec`` ``[d_sae, d_in]``, ``b_dec`` ``[d_in]``, and
    ``threshold`` ``[d_sae]`` for JumpReLU (``sae_lens/saes/{standard,jumprelu,topk}_sae.py``).
    ``encode(x) = act((x - b_dec * apply_b_dec_to_input) @ W_enc + b_enc)`` with ``act`` = ReLU
    (``standard``), ``ReLU(pre) * 1[pre > threshold]`` (``jumprelu``), ReLU of the ``k`` largest
    (``topk``). Configs older than SAELens 6 are read as ``handle_pre_6_0_config`` reads them
    (``hook_point`` -> ``hook_name``, ``activation_fn_str`` -> ``activation_fn``, TopK from
    ``activation_fn_kwargs.k``, ``apply_b_dec_to_input`` defaulting to true).
``sparsify``: one folder per hookpoint, ``layers.L/cfg.json`` + ``sae.safetensors``
    (``sparsify/sparse_coder.py: SparseCoder.load_from_disk``). Tensors ``encoder.weight``
    ``[num_latents, d_in]`` (an ``nn.Linear``), ``encoder.bias``, ``W_dec`` ``[num_latents, d_in]``,
    ``b_dec`` ``[d_in]``. ``encode(x) = topk(ReLU((x - b_dec) @ encoder.weight.T + encoder.bias))``
    (``sparsify/fused_encoder.py``); ``num_latents = 0`` means ``d_in * expansion_factor``. The
    folder name is the hookpoint; a folder not named like one (no ``.``) leaves the layer unknown.
``gemma-scope``: ``params.npz`` with ``W_enc`` ``[d_in, d_sae]``, ``W_dec`` ``[d_sae, d_in]``,
    ``b_enc``, ``b_dec``, ``threshold`` (JumpReLU), no ``b_dec`` subtraction before encoding
    (Gemma Scope tutorial, as copied in EleutherAI/sae-auto-interp
    ``sae_auto_interp/autoencoders/DeepMind/model.py``; SAELens ``get_gemma_2_config_from_hf``:
    ``apply_b_dec_to_input: False``). Read with ``numpy.load(..., allow_pickle=False)``.
``hf-lsad``: ``config.json`` + ``sae.safetensors`` as written by
    :meth:`~hf_lsad.sae.SparseAutoencoder.save_pretrained` (no layer recorded).

Subtracting ``b_dec`` before the encoder is folded into the encoder bias,
``b_E = b_enc - W_enc^T b_dec`` (computed in float64): the same map, so the codes agree with the
original to float rounding. Weights are converted to float32. Options hf-lsad does not implement
(input normalisation, ``hook_z`` reshaping, decoder-norm rescaled TopK, sparsify's ``groupmax``,
skip connections, transcoders, other SAELens architectures) are refused by name, never ignored.

Hook points. A guard reads the output of decoder block ``L`` (``HookPoint.layer``), which is
``hidden_states[L + 1]`` of transformers' ``output_hidden_states`` (except that transformers
applies the final norm to the last entry; the guard's hook does not). The same point is

- SAELens / TransformerLens ``blocks.L.hook_resid_post`` (= ``blocks.{L+1}.hook_resid_pre``),
- sparsify hookpoint ``layers.L`` (a module of the base model; its output),
- Gemma Scope residual SAEs ``layer_L/...`` (``google/gemma-scope-*-res``).

:func:`sae_hook_layer` maps a hook name to ``L``; :func:`load_sae` raises
:class:`SAELayerMismatchError` when it differs from the guard's layer.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from .hub import resolve_pretrained_dir
from .sae import SAE_CONFIG, SAE_WEIGHTS, SAEConfig, SparseAutoencoder
from .serialization import GuardFormatError, read_json

__all__ = [
    "LAYOUTS",
    "LoadedSAE",
    "SAEFormatError",
    "SAELayerMismatchError",
    "check_sae_layer",
    "detect_sae_layout",
    "load_sae",
    "read_sae",
    "sae_hook_layer",
]

Layout = Literal["hf-lsad", "saelens", "sparsify", "gemma-scope"]
LAYOUTS: tuple[str, ...] = ("hf-lsad", "saelens", "sparsify", "gemma-scope")

SAELENS_CONFIG = "cfg.json"
SAELENS_WEIGHTS = "sae_weights.safetensors"
SPARSIFY_CONFIG = "cfg.json"
SPARSIFY_WEIGHTS = "sae.safetensors"
GEMMA_SCOPE_PARAMS = "params.npz"

#: Files each layout needs (in the SAE's own folder).
LAYOUT_FILES: dict[str, tuple[str, ...]] = {
    "hf-lsad": (SAE_CONFIG, SAE_WEIGHTS),
    "saelens": (SAELENS_CONFIG, SAELENS_WEIGHTS),
    "sparsify": (SPARSIFY_CONFIG, SPARSIFY_WEIGHTS),
    "gemma-scope": (GEMMA_SCOPE_PARAMS,),
}

#: SAELens architectures hf-lsad reads, and the activation each maps to.
SAELENS_ARCHITECTURES: dict[str, str] = {"standard": "relu", "jumprelu": "jumprelu", "topk": "topk"}

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

_RESID_POST = re.compile(r"blocks\.(\d+)\.hook_resid_post")
_RESID_PRE = re.compile(r"blocks\.(\d+)\.hook_resid_pre")
_SPARSIFY_LAYER = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]*\.)*(?:layers|h)\.(\d+)")
_GEMMA_SCOPE_LAYER = re.compile(r"(?:^|[/\\])layer_(\d+)(?=$|[/\\])")
_GEMMA_SCOPE_OTHER_SITES = re.compile(
    r"gemma-scope[^/\\]*-(?:mlp|att|transcoders?)(?=$|[-/\\])|(?:^|[/\\])embedding(?=$|[/\\_])"
)


class SAEFormatError(GuardFormatError):
    """An external SAE folder is missing a file, holds a bad tensor, or uses an unsupported option."""


class SAELayerMismatchError(ValueError):
    """The SAE was trained on another layer (hook point) than the one the guard reads."""


@dataclass(frozen=True)
class LoadedSAE:
    """An SAE read from one of :data:`LAYOUTS`, with where it was trained."""

    sae: SparseAutoencoder
    """The SAE, float32, in hf-lsad's form (``encoder`` / ``decoder`` linears)."""

    layout: str
    """One of :data:`LAYOUTS`."""

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


def detect_sae_layout(folder: str | os.PathLike) -> str:
    """Which of :data:`LAYOUTS` the local ``folder`` holds, from its file names.

    Raises:
        SAEFormatError: No layout's files (:data:`LAYOUT_FILES`) are there, or several layouts'
            are; the message lists the folder's files (and its ``layers.*`` subfolders, a sparsify
            repo root, hinting at ``subfolder``).
    """
    path = Path(folder)
    if not path.is_dir():
        raise SAEFormatError(f"SAE folder '{path}' does not exist (or is not a directory)")
    names = {p.name for p in path.iterdir() if p.is_file()}
    found = [layout for layout, files in LAYOUT_FILES.items() if set(files) <= names]
    if len(found) == 1:
        return found[0]
    if found:
        raise SAEFormatError(f"SAE folder '{path}' holds the files of several layouts {found}; pass layout=")
    expected = "; ".join(f"{layout}: {' + '.join(files)}" for layout, files in LAYOUT_FILES.items())
    subfolders = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    more = " ..." if len(subfolders) > 8 else ""
    hint = f"; it has subfolders {subfolders[:8]}{more}: pass subfolder=" if subfolders else ""
    raise SAEFormatError(
        f"Unknown SAE layout in '{path}': files {sorted(names)}; expected one of [{expected}]{hint}"
    )


def read_sae(
    name_or_path: str | os.PathLike,
    *,
    layout: str | None = None,
    revision: str | None = None,
    subfolder: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> LoadedSAE:
    """Read an SAE in any of :data:`LAYOUTS` from a local folder or a Hub repo.

    Args:
        name_or_path: A local folder, or a Hub repo id.
        layout: One of :data:`LAYOUTS`; ``None`` detects it from the file names.
        revision: Hub branch, tag or commit (default ``main``); ignored for a local folder.
        subfolder: Folder inside the repo / directory holding the SAE (e.g. ``layers.20`` of a
            sparsify repo, ``layer_20/width_16k/average_l0_71`` of a Gemma Scope repo).
        token, cache_dir, local_files_only: As for :func:`hf_lsad.hub.resolve_pretrained_dir`.

    Returns:
        The SAE and the decoder block it was trained on (:class:`LoadedSAE`).

    Raises:
        SAEFormatError: Unknown layout, missing file or tensor, wrong shape, NaN / inf weights,
            pickled arrays in ``params.npz``, or an option hf-lsad does not implement; the
            message names the file, key and value.
        ValueError: The folder holds pickle files (from :func:`~hf_lsad.hub.resolve_pretrained_dir`).
        FileNotFoundError, huggingface_hub errors: As :func:`~hf_lsad.hub.resolve_pretrained_dir`.
    """
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown SAE layout {layout!r}; choose one of {LAYOUTS}")
    folder = resolve_pretrained_dir(
        name_or_path,
        revision=revision,
        subfolder=subfolder or "",
        token=token,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
        extra_allow_patterns=(GEMMA_SCOPE_PARAMS,),
        root_file=None,  # cfg.json, params.npz or config.json: the layout is detected below
    )
    layout = layout or detect_sae_layout(folder)
    missing = [name for name in LAYOUT_FILES[layout] if not (folder / name).is_file()]
    if missing:
        raise SAEFormatError(f"{layout} SAE folder '{folder}' has no {', '.join(missing)}")
    if layout == "saelens":
        return _read_saelens(folder)
    if layout == "sparsify":
        return _read_sparsify(folder)
    if layout == "gemma-scope":
        return _read_gemma_scope(folder, os.fspath(name_or_path))
    return LoadedSAE(SparseAutoencoder.from_pretrained(folder), "hf-lsad", None, None, folder)


def check_sae_layer(loaded: LoadedSAE, layer: int) -> None:
    """Raise :class:`SAELayerMismatchError` if ``loaded`` was trained on another block than ``layer``.

    ``layer`` is the guard's ``HookPoint.layer`` (0-based, non-negative). An SAE whose folder does
    not say its layer (an hf-lsad SAE, a Gemma Scope folder without ``layer_L`` in its path) is
    accepted with a warning.
    """
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a non-negative decoder block index (HookPoint.layer), got {layer!r}")
    if loaded.layer is None:
        warnings.warn(
            f"{loaded.layout} SAE '{loaded.folder}' does not record the layer it was trained on; "
            f"assuming it reads the output of decoder block {layer}",
            stacklevel=3,
        )
        return
    if loaded.layer != layer:
        raise SAELayerMismatchError(
            f"{loaded.layout} SAE '{loaded.folder}' was trained on {loaded.hook_name!r}, the output of decoder "
            f"block {loaded.layer} (hidden_states[{loaded.layer + 1}]), but the guard reads decoder block {layer} "
            f"(hidden_states[{layer + 1}]): use the SAE for layer {layer}, or hook the guard at layer {loaded.layer}"
        )


def load_sae(
    name_or_path: str | os.PathLike,
    *,
    layout: str | None = None,
    hook_layer: int | None = None,
    revision: str | None = None,
    subfolder: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> SparseAutoencoder:
    """Load an SAE in any of :data:`LAYOUTS` (see :func:`read_sae`), checking its layer.

    Args:
        hook_layer: The guard's decoder block (``HookPoint.layer``). If given, an SAE trained on
            another block raises :class:`SAELayerMismatchError` (:func:`check_sae_layer`).
        Others: As :func:`read_sae`.

    Example:
        >>> sae = load_sae("EleutherAI/sae-llama-3-8b-32x", subfolder="layers.20", hook_layer=20)  # doctest: +SKIP
    """
    loaded = read_sae(
        name_or_path,
        layout=layout,
        revision=revision,
        subfolder=subfolder,
        token=token,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
    )
    if hook_layer is not None:
        check_sae_layer(loaded, hook_layer)
    return loaded.sae


# --- layouts -------------------------------------------------------------------------------


def _read_saelens(folder: Path) -> LoadedSAE:
    cfg_path = folder / SAELENS_CONFIG
    cfg = _read_config(cfg_path)
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
    d_in, d_sae = _positive_int(cfg, "d_in", cfg_path), _positive_int(cfg, "d_sae", cfg_path)
    activation = SAELENS_ARCHITECTURES[architecture]
    k = None
    if activation == "topk":
        k = cfg.get("k", fn_kwargs.get("k"))
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d_sae:
            raise SAEFormatError(f"{cfg_path}: TopK k={k!r}, expected an integer in [1, d_sae={d_sae}]")
    hook_name = option("hook_name", "hook_point")
    if not isinstance(hook_name, str):
        raise SAEFormatError(f"{cfg_path}: no hook_name (metadata.hook_name, hook_name or hook_point)")
    layer = _layer_of(hook_name, cfg_path)

    weights_path = folder / SAELENS_WEIGHTS
    tensors = _read_safetensors(weights_path)
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
    weights = _take(tensors, shapes, weights_path)
    sae = _build(
        SAEConfig(d_in=d_in, d_sae=d_sae, activation=activation, k=k),
        w_enc=weights["W_enc"],
        b_enc=weights["b_enc"],
        w_dec=weights["W_dec"],
        b_dec=weights["b_dec"],
        threshold=weights.get("threshold"),
        subtract_b_dec=apply_b_dec,
    )
    return LoadedSAE(sae, "saelens", hook_name, layer, folder)


def _read_sparsify(folder: Path) -> LoadedSAE:
    cfg_path = folder / SPARSIFY_CONFIG
    raw = _read_config(cfg_path)
    d_in = _positive_int(raw, "d_in", cfg_path)
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
        layer: int | None = _layer_of(folder.name, folder)
    else:
        hook_name = layer = None

    weights_path = folder / SPARSIFY_WEIGHTS
    shapes = {"encoder.weight": (d_sae, d_in), "encoder.bias": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    weights = _take(_read_safetensors(weights_path), shapes, weights_path)
    sae = _build(
        SAEConfig(d_in=d_in, d_sae=d_sae, activation="topk", k=k),
        w_enc=weights["encoder.weight"].T,
        b_enc=weights["encoder.bias"],
        w_dec=weights["W_dec"],
        b_dec=weights["b_dec"],
        threshold=None,
        subtract_b_dec=True,  # SparseCoder.encode: x - b_dec unless transcode (refused above)
    )
    return LoadedSAE(sae, "sparsify", hook_name, layer, folder)


def _read_gemma_scope(folder: Path, name: str) -> LoadedSAE:
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
        "W_enc": (d_in, d_sae), "W_dec": (d_sae, d_in), "b_enc": (d_sae,), "b_dec": (d_in,), "threshold": (d_sae,)
    }
    weights = _take(tensors, shapes, path)
    layers = _GEMMA_SCOPE_LAYER.findall(where)
    hook_name = f"layer_{layers[-1]}" if layers else None
    sae = _build(
        SAEConfig(d_in=d_in, d_sae=d_sae, activation="jumprelu"),
        w_enc=weights["W_enc"],
        b_enc=weights["b_enc"],
        w_dec=weights["W_dec"],
        b_dec=weights["b_dec"],
        threshold=weights["threshold"],
        subtract_b_dec=False,
    )
    return LoadedSAE(sae, "gemma-scope", hook_name, int(layers[-1]) if layers else None, folder)


# --- helpers -------------------------------------------------------------------------------


def _read_config(path: Path) -> dict[str, Any]:
    try:
        raw = read_json(path)
    except GuardFormatError as err:
        raise SAEFormatError(str(err)) from err
    if not isinstance(raw, dict):
        raise SAEFormatError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _positive_int(cfg: dict[str, Any], key: str, source: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SAEFormatError(f"{source}: {key}={value!r}, expected a positive integer")
    return value


def _layer_of(hook_name: str, source: Path) -> int:
    try:
        return sae_hook_layer(hook_name)
    except SAEFormatError as err:
        raise SAEFormatError(f"{source}: {err}") from err


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise SAEFormatError(f"missing file {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise SAEFormatError(f"{path} is not a readable safetensors file ({err})") from err


def _take(tensors: dict[str, Tensor], shapes: dict[str, tuple[int, ...]], path: Path) -> dict[str, Tensor]:
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
def _build(
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
        sae.threshold.copy_(threshold)
    return sae.eval()
