"""Prompt data for hf-lsad: bundled offline pools and Hugging Face Hub loaders.

See :mod:`hf_lsad.data.pools` for the pool contents and API.
"""

from .pools import (
    DOMAINS,
    GUARD_POOLS,
    POOL_CATEGORY,
    POOLS,
    RESERVED_PROMPTS,
    UNSAFE_POOLS,
    Prompt,
    is_reserved,
    is_unsafe_pool,
    load_hub_prompts,
    load_manifest,
    load_pool,
    load_prompts,
    pool_domains,
)

__all__ = [
    "DOMAINS",
    "GUARD_POOLS",
    "POOLS",
    "POOL_CATEGORY",
    "RESERVED_PROMPTS",
    "UNSAFE_POOLS",
    "Prompt",
    "is_reserved",
    "is_unsafe_pool",
    "load_hub_prompts",
    "load_manifest",
    "load_pool",
    "load_prompts",
    "pool_domains",
]
