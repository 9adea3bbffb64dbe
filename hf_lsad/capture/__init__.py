"""Stage 1: reading the residual stream of a causal LM (one recorder for every path) and collecting activation sets."""

from .collect import Collected, EncodedPrompts, check_prompts, collect_activations, encode_prompts
from .recorder import LastPositionRecorder, generate_with_activations, last_token_positions, prefill_activations

__all__ = [
    "Collected",
    "EncodedPrompts",
    "LastPositionRecorder",
    "check_prompts",
    "collect_activations",
    "encode_prompts",
    "generate_with_activations",
    "last_token_positions",
    "prefill_activations",
]
