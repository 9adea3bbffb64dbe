"""Where a command runs and in what precision: the ``--device`` and ``--dtype`` of the ``hf-lsad`` commands.

:class:`ModelRuntime` (commands that run a model: ``collect``, ``generate``, ``explain``),
:class:`FitRuntime` (``train-sae``) and :class:`GuardFitRuntime` (``fit``: also where faiss k-means
runs) are settings dataclasses; the CLI generates their flags from the fields
(:func:`hf_lsad.core.settings.add_config_arguments`).
:func:`check_device` rejects a device this machine does not have before any model loads.

``--dtype`` is the precision of the *model's* weights. Guards and SAEs are fitted and score in
float32 whatever the model's dtype (their thresholds were set in float32): the activation a
bf16 model records is cast to float32 before the guard reads it. So fits have no ``--dtype``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

DType = Literal["fp32", "bf16", "fp16"]
DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``--dtype`` value -> ``torch`` dtype name."""

_DEVICE = re.compile(r"(auto|cpu|mps|(?:cuda|xpu|npu)(?::\d+)?)")


@dataclass
class ModelRuntime:
    """Device and precision of a command that runs a causal LM."""

    device: str = "auto"
    """Where the model runs: auto (under accelerate launch each process's own device; otherwise all visible GPUs
    through device_map="auto", or the CPU without one), cpu, cuda, cuda:N, mps, xpu[:N], npu[:N]."""

    dtype: DType = "fp32"
    """Precision of the model's weights; the guard always scores in float32."""


@dataclass
class FitRuntime:
    """Devices of a command that fits an SAE or a guard (fits are float32: see the module docstring)."""

    device: str = "auto"
    """Where the SAE and the detector are fitted: auto (the first GPU if there is one, else the CPU), cpu, cuda,
    cuda:N, mps, xpu[:N], npu[:N]."""


@dataclass
class GuardFitRuntime(FitRuntime):
    """Devices of ``hf-lsad fit``: the fit's, and faiss k-means' (FreqMask-KM and the clustered methods)."""

    kmeans_device: Literal["auto", "cpu", "gpu"] = "auto"
    """Where faiss k-means runs: auto (a GPU when faiss has its GPU API, else the CPU), cpu, or gpu (an error
    without faiss GPUs)."""


def check_device(device: str) -> None:
    """Raise ``ValueError`` (one line) unless ``device`` names a device this machine has (or ``auto``).

    Imports torch only for an accelerator name, to count its devices.
    """
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise ValueError(f"{device!r} is not a device: use auto, cpu, cuda, cuda:N, mps, xpu[:N] or npu[:N]")
    if device in ("auto", "cpu"):
        return
    import torch

    kind, _, index = device.partition(":")
    backend = getattr(torch.backends, kind) if kind == "mps" else getattr(torch, kind, None)  # mps: torch.backends
    if backend is None or not (hasattr(backend, "is_available") and backend.is_available()):
        raise ValueError(f"{device!r}: torch {torch.__version__} sees no {kind} device on this machine")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if index and int(index) >= count:
        raise ValueError(f"{device!r}: this machine has {count} {kind} device(s), numbered from 0")


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` of a ``--dtype`` value (``fp32``, ``bf16``, ``fp16``)."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPE_NAMES)}")
    return getattr(torch, DTYPE_NAMES[name])


def fit_device(device: str) -> torch.device:
    """The device a fit runs on: ``auto`` is the first GPU when torch sees one, else the CPU."""
    import torch

    check_device(device)
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
