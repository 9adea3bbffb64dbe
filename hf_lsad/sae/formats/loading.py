"""Read an SAE of any layout: :func:`detect_sae_layout`, :func:`read_sae`, :func:`check_sae_layer`, :func:`load_sae`.

:func:`read_sae` resolves a local folder or a Hub repo through
:func:`hf_lsad.core.hub.resolve_pretrained_dir`, detects its layout from the file names, and hands it to
that layout's reader (:mod:`~hf_lsad.sae.formats.saelens`, :mod:`~hf_lsad.sae.formats.sparsify`,
:mod:`~hf_lsad.sae.formats.gemma_scope`; an hf-lsad SAE is read by
:meth:`~hf_lsad.sae.SparseAutoencoder.from_pretrained`). :func:`load_sae` also checks the layer.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...core.hub import resolve_pretrained_dir
from ...errors import warn
from ..model import SAE_CONFIG, SAE_WEIGHTS, SparseAutoencoder, check_sae_block
from .common import LoadedSAE, SAEFormatError, SAELayerMismatchError
from .gemma_scope import GEMMA_SCOPE_PARAMS, read_gemma_scope
from .saelens import SAELENS_CONFIG, SAELENS_WEIGHTS, read_saelens
from .sparsify import SPARSIFY_CONFIG, SPARSIFY_WEIGHTS, read_sparsify

LAYOUTS: tuple[str, ...] = ("hf-lsad", "saelens", "sparsify", "gemma-scope")

#: Files each layout needs (in the SAE's own folder).
LAYOUT_FILES: dict[str, tuple[str, ...]] = {
    "hf-lsad": (SAE_CONFIG, SAE_WEIGHTS),
    "saelens": (SAELENS_CONFIG, SAELENS_WEIGHTS),
    "sparsify": (SPARSIFY_CONFIG, SPARSIFY_WEIGHTS),
    "gemma-scope": (GEMMA_SCOPE_PARAMS,),
}


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
    raise SAEFormatError(f"Unknown SAE layout in '{path}': files {sorted(names)}; expected one of [{expected}]{hint}")


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
        token, cache_dir, local_files_only: As for :func:`hf_lsad.core.hub.resolve_pretrained_dir`.

    Returns:
        The SAE and the decoder block it was trained on (:class:`LoadedSAE`).

    Raises:
        SAEFormatError: Unknown layout, missing file or tensor, wrong shape, NaN / inf weights,
            pickled arrays in ``params.npz``, or an option hf-lsad does not implement; the
            message names the file, key and value.
        ValueError: The folder holds pickle files (from :func:`~hf_lsad.core.hub.resolve_pretrained_dir`).
        FileNotFoundError, huggingface_hub errors: As :func:`~hf_lsad.core.hub.resolve_pretrained_dir`.
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
        what="SAE",
    )
    layout = layout or detect_sae_layout(folder)
    missing = [name for name in LAYOUT_FILES[layout] if not (folder / name).is_file()]
    if missing:
        raise SAEFormatError(f"{layout} SAE folder '{folder}' has no {', '.join(missing)}")
    if layout == "saelens":
        loaded = read_saelens(folder)
    elif layout == "sparsify":
        loaded = read_sparsify(folder)
    elif layout == "gemma-scope":
        loaded = read_gemma_scope(folder, os.fspath(name_or_path))
    else:
        sae = SparseAutoencoder.from_pretrained(folder)
        hook_name = None if sae.layer is None else f"layers.{sae.layer}"
        return LoadedSAE(sae, "hf-lsad", hook_name, sae.layer, folder)
    loaded.sae.layer = loaded.layer  # kept when the SAE is saved, with a guard or on its own
    return loaded


def check_sae_layer(loaded: LoadedSAE, layer: int) -> None:
    """Raise :class:`SAELayerMismatchError` if ``loaded`` was trained on another block than ``layer``.

    ``layer`` is the guard's ``HookPoint.layer`` (0-based, non-negative). An SAE whose folder does
    not say its layer (an hf-lsad SAE saved before SAEs recorded it, a Gemma Scope folder without
    ``layer_L`` in its path) is accepted with a warning.
    """
    if check_sae_block(layer) is None:
        raise ValueError("layer must be a non-negative decoder block index (HookPoint.layer), got None")
    if loaded.layer is None:
        warn(
            f"{loaded.layout} SAE '{loaded.folder}' does not record the layer it was trained on; "
            f"assuming it reads the output of decoder block {layer}",
            UserWarning,
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
