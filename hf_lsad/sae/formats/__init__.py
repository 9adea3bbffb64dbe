"""Load public SAEs (SAELens, sparsify, Gemma Scope) as a :class:`~hf_lsad.sae.SparseAutoencoder`.

:func:`load_sae` reads a local folder or a Hub repo (``revision`` / ``subfolder``) through
:func:`hf_lsad.core.hub.resolve_pretrained_dir`, the strict, pickle-refusing path guards use, detects
its layout (:func:`detect_sae_layout`), converts the weights to hf-lsad's ``nn.Linear``
``encoder`` / ``decoder`` and checks the layer the SAE was trained on against the guard's.
:func:`read_sae` returns the SAE together with that layer (:class:`LoadedSAE`).

Layouts (:data:`LAYOUTS`), one module each, whose docstring cites how the anchor's own code reads it:

``saelens``: ``cfg.json`` + ``sae_weights.safetensors`` (:mod:`~hf_lsad.sae.formats.saelens`).
``sparsify``: one folder per hookpoint, ``layers.L/cfg.json`` + ``sae.safetensors``
    (:mod:`~hf_lsad.sae.formats.sparsify`).
``gemma-scope``: ``params.npz`` (:mod:`~hf_lsad.sae.formats.gemma_scope`).
``hf-lsad``: ``config.json`` + ``sae.safetensors`` as written by
    :meth:`~hf_lsad.sae.SparseAutoencoder.save_pretrained` (no layer recorded).

:mod:`~hf_lsad.sae.formats.loading` detects the layout and reads, :mod:`~hf_lsad.sae.formats.common`
holds what the readers share.

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

from .common import LoadedSAE, SAEFormatError, SAELayerMismatchError, sae_hook_layer
from .loading import LAYOUTS, check_sae_layer, detect_sae_layout, load_sae, read_sae

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
