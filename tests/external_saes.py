"""External SAE layouts written from known tensors (SAELens, sparsify, Gemma Scope) and NumPy references of their
codes, shared by the SAE-format and CLI tests. Each writer uses the file names, keys and orientations the anchor's own
loader expects."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from hf_lsad.sae.model import SparseAutoencoder

D_IN, D_SAE, K, LAYER = 16, 48, 6, 2


def weights(seed: int = 0, d_in: int = D_IN, d_sae: int = D_SAE) -> dict[str, np.ndarray]:
    """Known tensors in SAELens orientation: W_enc [d_in, d_sae], W_dec [d_sae, d_in]."""
    rng = np.random.default_rng(seed)
    return {
        "W_enc": (rng.standard_normal((d_in, d_sae)) / np.sqrt(d_in)).astype(np.float32),
        "b_enc": (0.1 * rng.standard_normal(d_sae)).astype(np.float32),
        "W_dec": (rng.standard_normal((d_sae, d_in)) / np.sqrt(d_sae)).astype(np.float32),
        "b_dec": (0.3 * rng.standard_normal(d_in)).astype(np.float32),
        # mostly positive, some negative: a negative threshold shows whether ReLU is applied too
        "threshold": (0.4 * rng.random(d_sae) - 0.1).astype(np.float32),
    }


def activations(n: int = 360, seed: int = 1) -> torch.Tensor:
    """Three Gaussian blobs in R^D_IN (so k-means has clusters to find)."""
    g = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(3, D_IN, generator=g)
    return centres[torch.arange(n) % 3] + 0.5 * torch.randn(n, D_IN, generator=g)


# --- references, written from the anchors' formulas (float64, NumPy) -------------------------------


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def ref_standard(x: np.ndarray, w: dict, apply_b_dec_to_input: bool = True) -> np.ndarray:
    """SAELens standard_sae.py: ReLU((x - b_dec * apply_b_dec_to_input) @ W_enc + b_enc)."""
    sae_in = x - w["b_dec"] * apply_b_dec_to_input
    return relu(sae_in @ w["W_enc"].astype(np.float64) + w["b_enc"])


def ref_jumprelu(x: np.ndarray, w: dict, apply_b_dec_to_input: bool) -> np.ndarray:
    """SAELens jumprelu_sae.py / Gemma Scope tutorial: ReLU(pre) * 1[pre > threshold]."""
    pre = (x - w["b_dec"] * apply_b_dec_to_input) @ w["W_enc"].astype(np.float64) + w["b_enc"]
    return relu(pre) * (pre > w["threshold"])


def ref_topk(pre: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest pre-activations of each row, ReLU'd; zero elsewhere."""
    out = np.zeros_like(pre)
    top = np.argsort(-pre, axis=1, kind="stable")[:, :k]
    rows = np.arange(len(pre))[:, None]
    out[rows, top] = relu(pre[rows, top])
    return out


def codes(sae: SparseAutoencoder, x: torch.Tensor) -> np.ndarray:
    """The loaded SAE's codes, computed in float64 from its (float32) weights, so that the comparison with
    the float64 reference tests the conversion (orientation, folded b_dec, activation), not float32
    rounding; the float32 codes the guard computes are checked to agree with them to 1e-5."""
    with torch.no_grad():
        exact = copy.deepcopy(sae).double().encode(x.double())
        np.testing.assert_allclose(sae.encode(x).double().numpy(), exact.numpy(), atol=1e-5, rtol=0)
        return exact.numpy()


# --- writers, each in its anchor's layout --------------------------------------------------------


def write_saelens(
    folder: Path,
    w: dict,
    architecture: str,
    hook_name: str = f"blocks.{LAYER}.hook_resid_post",
    cfg_overrides: dict | None = None,
) -> Path:
    """jbloomAus/SAELens sae_lens/constants.py (cfg.json, sae_weights.safetensors) and
    sae_lens/saes/sae.py (SAE.save_model: state_dict W_enc/b_enc/W_dec/b_dec [+ threshold]; cfg.to_dict() with
    architecture and metadata.hook_name, SAELens >= 6)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architecture": architecture,
        "d_in": D_IN,
        "d_sae": D_SAE,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {
            "sae_lens_version": "6.18.0",
            "model_name": "tiny",
            "hook_name": hook_name,
            "hook_head_index": None,
        },
    }
    if architecture == "topk":
        cfg |= {"k": K, "rescale_acts_by_decoder_norm": False}
    cfg |= cfg_overrides or {}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    keys = ["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if architecture == "jumprelu" else [])
    save_file({key: w[key] for key in keys}, folder / "sae_weights.safetensors")
    return folder


def write_sparsify(root: Path, w: dict, layer: int = LAYER, **cfg_overrides) -> Path:
    """EleutherAI/sparsify sparsify/sparse_coder.py (SparseCoder.save_to_disk: <hookpoint>/cfg.json with the
    SparseCoderConfig fields + d_in, <hookpoint>/sae.safetensors with encoder.weight [num_latents, d_in]
    (nn.Linear), encoder.bias, W_dec [num_latents, d_in], b_dec) and sparsify/config.py (SparseCoderConfig)."""
    folder = root / f"layers.{layer}"
    folder.mkdir(parents=True)
    cfg = {
        "activation": "topk",
        "expansion_factor": 32,
        "normalize_decoder": True,
        "num_latents": D_SAE,
        "k": K,
        "multi_topk": False,
        "skip_connection": False,
        "transcode": False,
        "d_in": D_IN,
    } | cfg_overrides
    (folder / "cfg.json").write_text(json.dumps(cfg))
    tensors = {
        "encoder.weight": np.ascontiguousarray(w["W_enc"].T),
        "encoder.bias": w["b_enc"],
        "W_dec": w["W_dec"],
        "b_dec": w["b_dec"],
    }
    save_file(tensors, folder / "sae.safetensors")
    return folder


def write_gemma_scope(root: Path, w: dict, layer: int = LAYER) -> tuple[Path, str]:
    """Gemma Scope params.npz (keys W_enc [d_model, d_sae], W_dec [d_sae, d_model], threshold, b_enc, b_dec:
    the Gemma Scope tutorial's JumpReLUSAE as in EleutherAI/sae-auto-interp
    sae_auto_interp/autoencoders/DeepMind/model.py; folder layer_L/width_*/average_l0_* as in
    jbloomAus/SAELens sae_lens/loading/pretrained_sae_loaders.py get_gemma_2_config_from_hf)."""
    subfolder = f"layer_{layer}/width_16k/average_l0_12"
    folder = root / subfolder
    folder.mkdir(parents=True)
    np.savez(folder / "params.npz", **{key: w[key] for key in ("W_enc", "W_dec", "threshold", "b_enc", "b_dec")})
    return folder, subfolder


# --- codes equal the reference ------------------------------------------------------------------
