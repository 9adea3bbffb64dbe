"""Prompt data for hf-lsad: bundled offline pools and Hugging Face Hub loaders.

See :mod:`hf_lsad.data.pools` for the pool contents and API.
"""

from .pools import (
    DOMAINS,
    POOL_CATEGORY,
    POOLS,
    UNSAFE_POOLS,
    Prompt,
    load_hub_prompts,
    load_manifest,
    load_pool,
    load_prompts,
    pool_domains,
)

__all__ = [
    "DOMAINS",
    "POOLS",
    "POOL_CATEGORY",
    "UNSAFE_POOLS",
    "Prompt",
    "load_hub_prompts",
    "load_manifest",
    "load_pool",
    "load_prompts",
    "pool_domains",
]
