"""A guarded model on disk: its folder written, read back and uploaded, and a model and a guard
loaded together (:class:`hf_lsad.generation.model.GuardedModelForCausalLM` delegates ``save_pretrained``,
``push_to_hub`` and ``from_pretrained`` here).

The folder (locally or in a Hub repo, optionally under a subfolder) holds the guard and a
reference to the base model, not its weights::

    guarded_model.json   {"format_version", "base_model", "base_model_revision", "guard": "guard"}
    guard/               the guard folder (:mod:`hf_lsad.guard.files`)
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..core.hub import resolve_pretrained_dir, upload_pretrained_dir
from ..core.serialization import FORMAT_VERSION, config_from_dict, config_to_dict, folder_path, read_json, write_json
from ..core.validation import check_format_version
from ..guard.files import MODEL_CARD
from ..guard.guard import SafetyGuard

GUARDED_CONFIG = "guarded_model.json"
"""File of a saved guarded model: format version and the reference to the base model."""
GUARD_SUBFOLDER = "guard"
"""Folder of a saved guarded model that holds the guard."""


@dataclass(frozen=True)
class GuardedModelConfig:
    """``guarded_model.json``: what a saved guarded model refers to. Read as strictly as a guard's ``config.json``:
    exactly these keys, each of its type."""

    format_version: int
    """The folder format's version (:data:`hf_lsad.core.serialization.FORMAT_VERSION`)."""
    base_model: str
    """The base model: a Hub id, a local path, ``"default"`` or a GGUF file."""
    base_model_revision: str | None
    """The base model's Hub revision, or ``None`` for its default branch."""
    guard: str
    """The subfolder that holds the guard; always :data:`GUARD_SUBFOLDER`, so the guard is read from inside the
    saved folder and nowhere else."""

    def __post_init__(self) -> None:
        check_format_version(self.format_version, FORMAT_VERSION)  # config_from_dict names the file
        if not self.base_model:
            raise ValueError("base_model is empty")
        if self.base_model_revision == "":
            raise ValueError("base_model_revision is empty (null means the default branch)")
        if self.guard != GUARD_SUBFOLDER:
            raise ValueError(f"guard is {self.guard!r}, expected {GUARD_SUBFOLDER!r}")


def load_guarded_model(
    name_or_path: str | os.PathLike,
    guard: str | os.PathLike | SafetyGuard | None,
    guard_kwargs: dict[str, Any] | None,
    model_kwargs: dict[str, Any],
) -> tuple[PreTrainedModel, SafetyGuard, Any]:
    """The ``(model, guard, tokenizer)`` of ``GuardedModelForCausalLM.from_pretrained`` (arguments as there).

    Without ``guard``, those of the saved guarded model ``name_or_path`` (:func:`load_guarded_folder`), or of the
    bundled model with the bundled guard for ``"default"``; with one, the model ``name_or_path``
    (:func:`load_base_model`) and the guard (loaded unless it is a :class:`SafetyGuard`).
    """
    if guard is None and os.fspath(name_or_path) == "default":  # the bundled model with the bundled guard
        guard = "default"
    if guard is None:
        return load_guarded_folder(name_or_path, guard_kwargs or {}, model_kwargs)
    if not isinstance(guard, SafetyGuard):
        guard = SafetyGuard.from_pretrained(guard, **(guard_kwargs or {}))
    model, tokenizer = load_base_model(os.fspath(name_or_path), model_kwargs)
    return model, guard, tokenizer


def load_base_model(
    name_or_path: str, model_kwargs: dict[str, Any], revision: str | None = None
) -> tuple[PreTrainedModel, Any]:
    """The model a guarded model's name loads, with ``model_kwargs`` (and at ``revision`` unless they name one): the
    bundled SmolLM2 (``default``, ``smollm2`` or its Hub id), a ``.gguf`` file or a peft adapter as
    :func:`hf_lsad.capture.pretrained.load_model` loads them, with their tokenizer; anything else with
    ``AutoModelForCausalLM.from_pretrained`` and no tokenizer."""
    from ..capture.pretrained import DEFAULT_MODEL_ALIASES, adapter_base, is_gguf_path, load_model

    if name_or_path in DEFAULT_MODEL_ALIASES or is_gguf_path(name_or_path):
        return load_model(name_or_path, **model_kwargs)
    if revision is not None and "revision" not in model_kwargs:
        model_kwargs = {**model_kwargs, "revision": revision}
    if adapter_base(name_or_path, **model_kwargs) is not None:
        return load_model(name_or_path, **model_kwargs)
    return AutoModelForCausalLM.from_pretrained(name_or_path, **model_kwargs), None


def load_guarded_folder(
    name_or_path: str | os.PathLike, hub_kwargs: dict[str, Any], model_kwargs: dict[str, Any]
) -> tuple[PreTrainedModel, SafetyGuard, Any]:
    """The ``(model, guard, tokenizer)`` of a saved guarded model, a local folder or a Hub repo.

    ``hub_kwargs`` say where to read the folder (:func:`hf_lsad.core.hub.resolve_pretrained_dir`);
    the base model is loaded with ``model_kwargs`` (:func:`load_base_model`, which says when there is a tokenizer).
    """
    local = folder_path(name_or_path, "pretrained_model_name_or_path").expanduser() / hub_kwargs.get("subfolder", "")
    path = local if local.is_dir() and not (local / GUARDED_CONFIG).is_file() else None
    if path is None:  # a saved guarded model (local or on the Hub): the strict resolver
        path = resolve_pretrained_dir(name_or_path, root_file=GUARDED_CONFIG, what="guarded model", **hub_kwargs)
    if not (path / GUARDED_CONFIG).is_file():
        raise FileNotFoundError(
            f"{name_or_path} holds no {GUARDED_CONFIG} (not saved by GuardedModelForCausalLM.save_pretrained); "
            "to load a model and a guard separately pass guard=..."
        )
    saved = config_from_dict(GuardedModelConfig, read_json(path / GUARDED_CONFIG), source=str(path / GUARDED_CONFIG))
    guard = SafetyGuard.from_pretrained(path / saved.guard)
    model, tokenizer = load_base_model(saved.base_model, model_kwargs, saved.base_model_revision)
    return model, guard, tokenizer


def write_guarded_folder(
    folder: Path, model: PreTrainedModel, guard: SafetyGuard, base_model: str | None, base_model_revision: str | None
) -> None:
    """Write ``guard`` and the reference to the base model (default: ``model.config.name_or_path``) to ``folder``."""
    base_model = base_model or str(model.config.name_or_path or "")
    if not base_model:
        raise ValueError("the model has no config.name_or_path to refer to; pass base_model='org/name'")
    saved = GuardedModelConfig(FORMAT_VERSION, base_model, base_model_revision, GUARD_SUBFOLDER)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / GUARDED_CONFIG, config_to_dict(saved))
    guard.save_pretrained(folder / GUARD_SUBFOLDER)


def upload_guarded_folder(
    model: PreTrainedModel,
    guard: SafetyGuard,
    repo_id: str,
    base_model: str | None,
    base_model_revision: str | None,
    **upload_kwargs: Any,
) -> CommitInfo:
    """Write the folder, with the guard's model card, to a temporary folder and upload it in one commit
    (``upload_kwargs`` as in :func:`hf_lsad.core.hub.upload_pretrained_dir`)."""
    with tempfile.TemporaryDirectory(prefix="hf-lsad-push-") as tmp:
        folder = Path(tmp)
        write_guarded_folder(folder, model, guard, base_model, base_model_revision)
        guard.model_card().save(folder / GUARD_SUBFOLDER / MODEL_CARD)
        return upload_pretrained_dir(folder, repo_id, **upload_kwargs)
