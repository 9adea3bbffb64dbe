"""Tiny seeded causal LMs for tests and examples: no download, a few layers, any architecture family.

Like ``transformers.testing_utils``, this lives in the package (not in ``tests/``) because the
examples use it too; the library itself never imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

_TINY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),
    "mistral": dict(num_key_value_heads=2, sliding_window=None),
    "gemma": dict(num_key_value_heads=2, head_dim=8),
    "gpt2": dict(n_embd=32, n_layer=4, n_head=4, n_positions=512),
}
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII with a chat template (no download)."""
    specials = ["<pad>", "<unk>", "<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {token: i for i, token in enumerate(specials + [chr(c) for c in range(32, 127)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="<|end|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials[4:]})
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def tiny_model(architecture: str = "llama", *, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A randomly initialised 4-layer model of ``architecture`` (seeded) and :func:`tiny_tokenizer`."""
    if architecture not in _TINY_ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {architecture!r}; choose one of {sorted(_TINY_ARCHITECTURES)}")
    tokenizer = tiny_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    if architecture == "gpt2":
        common = {
            k: v for k, v in common.items() if k in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")
        }
    config = AutoConfig.for_model(architecture, **common, **_TINY_ARCHITECTURES[architecture])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer
