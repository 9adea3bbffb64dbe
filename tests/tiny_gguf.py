"""A tiny Llama GGUF file written with gguf-py (no download), for the GGUF loading and conversion tests.

Byte-level BPE vocabulary (256 bytes, three specials, three merges) and four blocks of width 32, as the tiny
models of :mod:`hf_lsad.testing`; the attention and MLP matrices are Q8_0-quantised, so that loading it
de-quantises as the bundled model's load does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from tokenizers.pre_tokenizers import ByteLevel

HIDDEN, FFN, BLOCKS, HEADS, CONTEXT = 32, 64, 4, 4, 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(path: Path, *, seed: int = 0) -> Path:
    """Write a tiny Llama to ``path`` (a ``.gguf`` file) whose weights are drawn from ``seed``; return ``path``."""
    rng = np.random.default_rng(seed)
    tokens = SPECIALS + sorted(ByteLevel.alphabet()) + [merge.replace(" ", "") for merge in MERGES]
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(BLOCKS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, *shape: int, quantized: bool = False) -> None:
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if quantized:
            writer.add_tensor(name, quantize(data, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, data)

    tensor("token_embd.weight", len(tokens), HIDDEN)
    for block in range(BLOCKS):
        tensor(f"blk.{block}.attn_norm.weight", HIDDEN)
        for part in ("q", "k", "v", "output"):
            tensor(f"blk.{block}.attn_{part}.weight", HIDDEN, HIDDEN, quantized=True)
        tensor(f"blk.{block}.ffn_norm.weight", HIDDEN)
        tensor(f"blk.{block}.ffn_gate.weight", FFN, HIDDEN, quantized=True)
        tensor(f"blk.{block}.ffn_up.weight", FFN, HIDDEN, quantized=True)
        tensor(f"blk.{block}.ffn_down.weight", HIDDEN, FFN, quantized=True)
    tensor("output_norm.weight", HIDDEN)
    tensor("output.weight", len(tokens), HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
