"""The package version, and the versions of the libraries that change hf-lsad's numbers.

One home for both, at the bottom of the package, so nothing imports the package root
for its version (the root imports everything else).
"""

from __future__ import annotations

import platform

__version__ = "0.1.0"

LIBRARIES = {
    "hf_lsad": "hf-lsad",
    "torch": "torch",
    "faiss": "faiss-cpu",
    "transformers": "transformers",
    "gguf": "gguf",
    "huggingface_hub": "huggingface-hub",
    "scikit-learn": "scikit-learn",
    "numpy": "numpy",
}
"""Name in the version records -> distribution that provides it."""


def library_versions(*names: str) -> dict[str, str]:
    """``{name: version}`` for ``names`` (keys of :data:`LIBRARIES`), read from the installed distributions.

    Reading distribution metadata imports nothing, so recording versions never pays
    for importing transformers or faiss.
    """
    import importlib.metadata  # not at import time: the package root imports this module

    versions = {}
    for name in names:
        if name == "hf_lsad":
            versions[name] = __version__
        elif name == "torch":
            import torch  # the build tag (+cpu, +cu121) is only in torch.__version__

            versions[name] = torch.__version__
        else:
            try:
                versions[name] = importlib.metadata.version(LIBRARIES[name])
            except importlib.metadata.PackageNotFoundError:  # e.g. faiss-gpu instead of faiss-cpu
                versions[name] = "unknown"
    return versions


def environment() -> dict[str, str]:
    """Python, platform and torch threads, for reports and benchmarks."""
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": str(torch.get_num_threads()),
    }
