"""Prompt data for hf-lsad: bundled offline pools and Hugging Face Hub loaders.

See :mod:`hf_lsad.data.pools` for the pool contents and API.
"""

from hf_lsad.data.pools import (
    POOLS,
    UNSAFE_POOLS,
    Prompt,
    load_hub_prompts,
    load_manifest,
    load_pool,
    load_prompts,
)

__all__ = [
    "Prompt",
    "POOLS",
    "UNSAFE_POOLS",
    "load_pool",
    "load_hub_prompts",
    "load_prompts",
    "load_manifest",
]
