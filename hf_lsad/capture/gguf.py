"""A GGUF model converted once into a transformers folder, so that later loads skip the GGUF reader.

transformers loads a GGUF file by parsing its whole header three times (tokenizer, config, weights) and
de-quantising every tensor to float32: about 16 s for the bundled SmolLM2-135M on two CPU cores, where the same
float32 weights load from safetensors in 0.4 s. So the first :func:`~hf_lsad.capture.pretrained.load_model`
of a GGUF file writes what transformers made of it (float32 weights, config, generation config, tokenizer) to a
folder of the cache, and every later load reads that folder. The weights are bit-identical to a load from the GGUF
file, and so are the tokenizer's ids and chat template.

The cache is ``$HF_LSAD_CACHE`` if set, else ``hf-lsad/gguf`` under the Hugging Face home (``$HF_HOME``, by
default ``~/.cache/huggingface``). Each GGUF file has one folder, named by its SHA-256 and by the transformers and
gguf versions that converted it, so that an upgrade converts again; deleting a folder only costs the next load
its conversion. ``load_model(..., gguf_cache=False)`` reads the GGUF file every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
import warnings
from pathlib import Path

from ..core.integrity import sha256_file
from ..core.locking import marked_in_use
from ..core.serialization import new_file_modes, remove_abandoned_staging
from ..version import library_versions

CACHE_ENV = "HF_LSAD_CACHE"
"""The environment variable naming the folder that holds converted GGUF models."""
RECORD_FILE = "hf_lsad_gguf.json"
"""Written last into a converted folder: its source and the size of every file, checked on each use."""


def cache_root() -> Path:
    """The folder holding converted GGUF models (module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "hf-lsad" / "gguf"


def converted_folder(gguf: Path) -> Path:
    """Where the conversion of ``gguf`` lives, whether or not it exists yet (reads the whole file for its hash)."""
    versions = ", ".join(f"{name} {version}" for name, version in library_versions("transformers", "gguf").items())
    key = hashlib.sha256(f"{sha256_file(gguf)} {versions}".encode()).hexdigest()
    return cache_root() / f"{gguf.stem}-{key[:16]}"


def cached_conversion(gguf: Path) -> Path | None:
    """The converted folder of ``gguf`` if the cache holds a complete one this user may read, else ``None``."""
    folder = converted_folder(gguf)
    return folder if _complete(folder) and _readable(folder, gguf) else None


def convert_gguf(gguf: Path) -> Path | None:
    """The converted folder of ``gguf``, converting it first when the cache has none (about 17 s for the bundled
    model). ``None``, with a warning, when the cache cannot be written: the caller loads the GGUF file itself."""
    folder = converted_folder(gguf)
    if _complete(folder):
        return folder if _readable(folder, gguf) else None
    if folder.exists():
        warnings.warn(f"{folder} is not a complete conversion of {gguf}; converting it again", stacklevel=3)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_staging(folder.parent, prefix=f".{folder.name}-")  # a killed conversion's 540 MB
        staging = folder.parent / f".{folder.name}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()  # not mkdtemp: its folder is private (0700), the cache's are as the umask says
    except OSError as err:
        warnings.warn(f"cannot write the GGUF cache {folder.parent} ({err}); set {CACHE_ENV}", stacklevel=3)
        return None
    try:
        with marked_in_use(staging):  # another process's conversion does not take it for a killed one's
            _write_conversion(gguf, staging)
            new_file_modes(staging)
            if not _complete(folder):  # else another process converted the same file meanwhile: keep theirs
                shutil.rmtree(folder, ignore_errors=True)  # an incomplete conversion
                os.replace(staging, folder)  # atomic: a folder in the cache is complete
    except OSError as err:
        if _complete(folder):  # another process won the race to the same folder
            return folder
        warnings.warn(f"cannot write the GGUF cache {folder} ({err}); set {CACHE_ENV}", stacklevel=3)
        return None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone after os.replace; else what this call wrote
    return folder


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds every file its record names, at its recorded size."""
    try:
        record = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
        return all((folder / name).stat().st_size == size for name, size in record["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _readable(folder: Path, gguf: Path) -> bool:
    """Whether this user may read every file of ``folder``; if not, a warning that ``gguf`` is read itself. A shared
    cache can hold a conversion another user made private (hf-lsad wrote its weights 0600 until it followed the
    umask)."""
    private = [file.name for file in sorted(folder.iterdir()) if file.is_file() and not os.access(file, os.R_OK)]
    if private:
        warnings.warn(
            f"{folder} holds files this user may not read ({', '.join(private)}): reading {gguf} itself, which is "
            f"slower; ask the cache's owner to make them readable (chmod -R a+rX), or set {CACHE_ENV} to a cache of "
            "your own",
            stacklevel=4,
        )
    return not private


def _write_conversion(gguf: Path, folder: Path) -> None:
    """What transformers makes of ``gguf`` at float32, as a model folder; the record last."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} once for faster loads (cache: {folder.parent}) ...", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # without the GGUF quantisation record, which would make transformers read the folder as GGUF again
    settings = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    AutoConfig.for_model(**settings).save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))  # keeps a tied embedding tied
    tokenizer.save_pretrained(folder)
    record = {"source": str(gguf), "files": {p.name: p.stat().st_size for p in sorted(folder.iterdir())}}
    (folder / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
