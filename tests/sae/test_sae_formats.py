"""External SAE layouts (SAELens, sparsify, Gemma Scope) -> hf-lsad SparseAutoencoder.

Each layout is written here from known tensors with the file names, keys and orientations the
anchor's own loader expects (cited per writer), loaded with :func:`hf_lsad.sae.formats.load_sae`,
and its codes compared with a NumPy reference of that architecture written from the anchor's
formulas. A guard is then fitted on it and round-tripped through save_pretrained / from_pretrained.
"""

from __future__ import annotations

import json
import shutil
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from external_saes import (
    D_IN,
    D_SAE,
    LAYER,
    K,
    activations,
    codes,
    ref_jumprelu,
    ref_standard,
    ref_topk,
    relu,
    weights,
    write_gemma_scope,
    write_saelens,
    write_sparsify,
)
from huggingface_hub import HfApi
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch

from hf_lsad.core.hook_point import HookPoint
from hf_lsad.core.serialization import GuardFormatError
from hf_lsad.detectors import FreqMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.detectors.learned_mask import LearnedMaskConfig
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.fitting import fit_guard
from hf_lsad.sae.formats import (
    SAEFormatError,
    SAELayerMismatchError,
    detect_sae_layout,
    load_sae,
    read_sae,
    sae_hook_layer,
)
from hf_lsad.sae.model import SAEConfig, SparseAutoencoder

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

BUNDLED_GUARD = Path(__file__).parents[2] / "hf_lsad" / "guards" / "smollm2-135m-instruct"


X = activations()


def test_saelens_standard_codes_match_reference(tmp_path):
    w = weights(0)
    sae = load_sae(write_saelens(tmp_path / "sae", w, "standard"), hook_layer=LAYER)
    assert sae.config == SAEConfig(D_IN, D_SAE, "relu", None)
    np.testing.assert_allclose(codes(sae, X), ref_standard(X.double().numpy(), w), atol=1e-6, rtol=0)


def test_saelens_standard_without_b_dec_on_input(tmp_path):
    w = weights(1)
    sae = load_sae(write_saelens(tmp_path / "sae", w, "standard", cfg_overrides={"apply_b_dec_to_input": False}))
    np.testing.assert_allclose(codes(sae, X), ref_standard(X.double().numpy(), w, False), atol=1e-6, rtol=0)


def test_saelens_jumprelu_codes_match_reference(tmp_path):
    w = weights(2)
    loaded = read_sae(write_saelens(tmp_path / "sae", w, "jumprelu"))
    assert (loaded.layout, loaded.hook_name, loaded.layer) == ("saelens", "blocks.2.hook_resid_post", 2)
    assert loaded.sae.config.activation == "jumprelu"
    ref = ref_jumprelu(X.double().numpy(), w, True)
    assert 0 < (ref > 0).mean() < 0.6  # the threshold matters
    np.testing.assert_allclose(codes(loaded.sae, X), ref, atol=1e-6, rtol=0)


def test_saelens_topk_codes_match_reference(tmp_path):
    w = weights(3)
    sae = load_sae(write_saelens(tmp_path / "sae", w, "topk"), hook_layer=LAYER)
    assert (sae.config.activation, sae.config.k) == ("topk", K)
    pre = (X.double().numpy() - w["b_dec"]) @ w["W_enc"].astype(np.float64) + w["b_enc"]
    got = codes(sae, X)
    np.testing.assert_allclose(got, ref_topk(pre, K), atol=1e-6, rtol=0)
    assert ((got > 0).sum(1) <= K).all()


def test_saelens_pre_6_config(tmp_path):
    """Configs before SAELens 6 (handle_pre_6_0_config): hook_point, activation_fn_str, activation_fn_kwargs.k."""
    w = weights(4)
    folder = tmp_path / "old"
    folder.mkdir()
    cfg = {
        "d_in": D_IN,
        "d_sae": D_SAE,
        "dtype": "float32",
        "hook_point": "blocks.3.hook_resid_pre",
        "hook_point_layer": 3,
        "activation_fn_str": "topk",
        "activation_fn_kwargs": {"k": K},
        "normalize_activations": False,
        "sae_lens_training_version": "3.13.0",
    }
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file({key: w[key] for key in ("W_enc", "b_enc", "W_dec", "b_dec")}, folder / "sae_weights.safetensors")
    loaded = read_sae(folder)
    assert (loaded.layer, loaded.sae.config.activation, loaded.sae.config.k) == (2, "topk", K)  # resid_pre of 3
    pre = (X.double().numpy() - w["b_dec"]) @ w["W_enc"].astype(np.float64) + w["b_enc"]
    np.testing.assert_allclose(codes(loaded.sae, X), ref_topk(pre, K), atol=1e-6, rtol=0)


def test_sparsify_codes_match_reference(tmp_path):
    w = weights(5)
    write_sparsify(tmp_path / "repo", w)
    write_sparsify(tmp_path / "repo", weights(6), layer=3)
    loaded = read_sae(tmp_path / "repo", subfolder="layers.2")
    assert (loaded.layout, loaded.hook_name, loaded.layer) == ("sparsify", "layers.2", 2)
    # sparsify/fused_encoder.py: topk(ReLU(F.linear(x - b_dec, encoder.weight, encoder.bias)))
    pre = (X.double().numpy() - w["b_dec"]) @ w["W_enc"].astype(np.float64) + w["b_enc"]
    np.testing.assert_allclose(codes(loaded.sae, X), ref_topk(relu(pre), K), atol=1e-6, rtol=0)
    # decode: top_acts @ W_dec + b_dec (embedding_bag over W_dec rows)
    z = torch.from_numpy(ref_topk(relu(pre), K)).float()
    with torch.no_grad():
        np.testing.assert_allclose(
            loaded.sae.decode(z).double().numpy(), z.double().numpy() @ w["W_dec"] + w["b_dec"], atol=1e-5
        )


def test_saelens_bf16_weights_and_training_log_threshold(tmp_path):
    """bf16 weights are widened exactly; a JumpReLU training checkpoint's log_threshold is exp'd
    (jumprelu_sae.py: JumpReLUTrainingSAE.process_state_dict_for_saving)."""
    w = weights(14)
    folder = write_saelens(tmp_path / "sae", w, "jumprelu", cfg_overrides={"dtype": "bfloat16"})
    bf16 = {key: torch.from_numpy(w[key]).bfloat16() for key in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")}
    bf16["log_threshold"] = bf16.pop("threshold").float().clamp_min(1e-3).log()
    save_torch({key: value.contiguous() for key, value in bf16.items()}, str(folder / "sae_weights.safetensors"))
    rounded = {key: value.double().numpy() for key, value in bf16.items()}
    rounded["threshold"] = np.exp(rounded.pop("log_threshold"))
    sae = load_sae(folder, hook_layer=LAYER)
    np.testing.assert_allclose(codes(sae, X), ref_jumprelu(X.double().numpy(), rounded, True), atol=1e-6, rtol=0)


def test_sparsify_folder_not_named_after_a_hookpoint_has_no_layer(tmp_path):
    folder = write_sparsify(tmp_path, weights())
    folder.rename(tmp_path / "my_sae")
    loaded = read_sae(tmp_path / "my_sae")
    assert (loaded.layout, loaded.hook_name, loaded.layer) == ("sparsify", None, None)
    (tmp_path / "my_sae").rename(tmp_path / "layers.3.mlp")
    with pytest.raises(SAEFormatError, match=r"'layers\.3\.mlp' is not the residual-stream output"):
        read_sae(tmp_path / "layers.3.mlp")


def test_sparsify_num_latents_zero_uses_expansion_factor(tmp_path):
    w = weights(7, d_sae=2 * D_IN)
    folder = write_sparsify(tmp_path, w, num_latents=0, expansion_factor=2)
    assert load_sae(folder).config.d_sae == 2 * D_IN


def test_gemma_scope_codes_match_reference(tmp_path):
    w = weights(8)
    folder, _ = write_gemma_scope(tmp_path / "gemma-scope-2b-pt-res", w)
    loaded = read_sae(folder)
    assert (loaded.layout, loaded.hook_name, loaded.layer) == ("gemma-scope", "layer_2", 2)
    # No b_dec subtraction: pre = x @ W_enc + b_enc.
    np.testing.assert_allclose(codes(loaded.sae, X), ref_jumprelu(X.double().numpy(), w, False), atol=1e-6, rtol=0)
    with torch.no_grad():
        z = loaded.sae.encode(X)
        np.testing.assert_allclose(
            loaded.sae.decode(z).double().numpy(), z.double().numpy() @ w["W_dec"] + w["b_dec"], atol=1e-5
        )


def test_layout_detection(tmp_path):
    write_saelens(tmp_path / "a", weights(), "standard")
    folder = write_sparsify(tmp_path / "b", weights())
    gemma, _ = write_gemma_scope(tmp_path / "c", weights())
    SparseAutoencoder(SAEConfig(D_IN, D_SAE)).save_pretrained(tmp_path / "d")
    assert [detect_sae_layout(p) for p in (tmp_path / "a", folder, gemma, tmp_path / "d")] == [
        "saelens",
        "sparsify",
        "gemma-scope",
        "hf-lsad",
    ]
    native = read_sae(tmp_path / "d")
    assert (native.layout, native.layer) == ("hf-lsad", None)


def test_an_sae_of_a_newer_format_says_so(tmp_path):
    SparseAutoencoder(SAEConfig(D_IN, D_SAE)).save_pretrained(tmp_path / "sae")
    config = json.loads((tmp_path / "sae" / "config.json").read_text())
    (tmp_path / "sae" / "config.json").write_text(json.dumps({**config, "format_version": 2}))
    with pytest.raises(GuardFormatError, match=r"format_version 2, expected 1: written by a newer hf-lsad"):
        SparseAutoencoder.from_pretrained(tmp_path / "sae")


def test_an_sae_save_that_fails_leaves_the_sae_that_was_there(tmp_path, monkeypatch):
    """``train-sae`` run again with the same ``--out`` saves over an SAE. A save that fails while writing leaves that
    SAE as it was (written in place, the new config.json beside the old weights loaded as neither SAE)."""
    torch.manual_seed(0)
    kept, saved = SparseAutoencoder(SAEConfig(D_IN, D_SAE), layer=2), SparseAutoencoder(SAEConfig(D_IN, D_SAE), layer=3)
    kept.save_pretrained(tmp_path / "sae")
    before = {f.name: f.read_bytes() for f in (tmp_path / "sae").iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hf_lsad.sae.model.save_module", disk_full)
    with pytest.raises(OSError, match="No space left"):
        saved.save_pretrained(tmp_path / "sae")
    monkeypatch.undo()
    assert {f.name: f.read_bytes() for f in (tmp_path / "sae").iterdir()} == before  # nothing of the save left
    loaded = SparseAutoencoder.from_pretrained(tmp_path / "sae")
    assert loaded.layer == 2 and torch.equal(loaded.encoder.weight, kept.encoder.weight)
    saved.save_pretrained(tmp_path / "sae")  # a save that succeeds replaces it
    assert SparseAutoencoder.from_pretrained(tmp_path / "sae").layer == 3


# --- guards fitted on each kind of SAE -----------------------------------------------------------


def hook() -> HookPoint:
    return HookPoint(
        base_model="tiny",
        model_type="llama",
        hidden_size=D_IN,
        num_hidden_layers=4,
        layer=LAYER,
        layer_module=f"model.layers.{LAYER}",
        position="response_last",
    )


def sae_of_each_layout(root: Path) -> dict[str, SparseAutoencoder]:
    gemma, _ = write_gemma_scope(root / "gemma", weights(12))
    return {
        "saelens-standard": load_sae(write_saelens(root / "std", weights(9), "standard"), hook_layer=LAYER),
        "saelens-jumprelu": load_sae(write_saelens(root / "jump", weights(10), "jumprelu"), hook_layer=LAYER),
        "saelens-topk": load_sae(write_saelens(root / "topk", weights(11), "topk"), hook_layer=LAYER),
        "sparsify": load_sae(write_sparsify(root / "sparsify", weights(13)), hook_layer=LAYER),
        "gemma-scope": load_sae(gemma, hook_layer=LAYER),
    }


@pytest.mark.parametrize("kind", ["saelens-standard", "saelens-jumprelu", "saelens-topk", "sparsify", "gemma-scope"])
def test_freqmask_guard_on_each_layout_saves_loads_and_scores_identically(kind, tmp_path):
    sae = sae_of_each_layout(tmp_path)[kind]
    config = FreqMaskConfig(kmeans=KMeansConfig(n_clusters=3), mask_size=12)
    guard = fit_guard(X, hook(), "freqmask-km", config, sae, progress=False).guard
    # "Active" is z > 0 for every activation (all codes are >= 0): the masks pick features that fire.
    z = sae.encode(X)
    assert (z >= 0).all()
    frequency = guard.detector.cluster_frequency
    never_fires = ~(z > 0).any(0)
    assert (frequency[:, never_fires] == 0).all() and frequency.max() <= 1
    guard.save_pretrained(tmp_path / "guard")
    saved = json.loads((tmp_path / "guard" / "sae" / "config.json").read_text())["sae"]
    assert saved["activation"] == sae.config.activation and saved["k"] == sae.config.k
    loaded = SafetyGuard.from_pretrained(tmp_path / "guard")
    assert loaded.sae.config == sae.config
    if sae.threshold is not None:
        assert torch.equal(loaded.sae.threshold, sae.threshold)
    probe = torch.cat([X[:50], X[:50] + 3.0 * torch.randn(50, D_IN, generator=torch.Generator().manual_seed(3))])
    before, after = guard(probe), loaded(probe)
    assert torch.equal(before.scores, after.scores)
    assert torch.equal(before.clusters, after.clusters) and torch.equal(before.flagged, after.flagged)


@pytest.mark.parametrize("kind", ["saelens-topk", "gemma-scope"])
def test_learned_mask_guard_uses_the_sae_activation(kind, tmp_path):
    """LearnedMask-LoRA re-applies the nonlinearity to (LoRA-adapted) pre-activations: it must be the SAE's."""
    sae = sae_of_each_layout(tmp_path)[kind]
    config = LearnedMaskConfig(
        kmeans=KMeansConfig(n_clusters=2),
        lambdas=[1e-3],
        min_cluster_size=20,
        lora_min_cluster_size=40,
        stage1_steps=20,
        lora_epochs=1,
        lora_batch_size=64,
    )
    guard = fit_guard(X, hook(), "learned-mask-lora", config, sae, progress=False).guard
    detector = guard.detector
    with torch.no_grad():
        clusters = detector(X, sae).clusters
        base = [c for c, r in enumerate(detector.state.cluster_ranks) if r == 0]
        rows = torch.isin(clusters, torch.tensor(base)) if base else torch.zeros(len(X), dtype=torch.bool)
        if rows.any():  # rows of un-adapted clusters reconstruct as D(m_c * activate(E(a)))
            expected = sae.decode(sae.encode(X[rows]) * detector.masks[clusters[rows]])
            torch.testing.assert_close(detector.reconstruct(X[rows], sae, clusters[rows]), expected)
    guard.save_pretrained(tmp_path / "guard")
    loaded = SafetyGuard.from_pretrained(tmp_path / "guard")
    assert torch.equal(guard(X).scores, loaded(X).scores)


# --- backward compatibility ----------------------------------------------------------------------


def test_an_sae_config_from_before_activations_loads_as_relu(tmp_path):
    shutil.copytree(BUNDLED_GUARD / "sae", tmp_path / "sae")
    config = json.loads((tmp_path / "sae" / "config.json").read_text())
    config["sae"] = {"d_in": config["sae"]["d_in"], "d_sae": config["sae"]["d_sae"]}  # as written before activations
    (tmp_path / "sae" / "config.json").write_text(json.dumps(config))
    sae = SparseAutoencoder.from_pretrained(tmp_path / "sae")
    assert (sae.config.activation, sae.config.k, sae.threshold) == ("relu", None, None)
    assert set(sae.state_dict()) == {"encoder.weight", "encoder.bias", "decoder.weight", "decoder.bias"}
    x = torch.randn(8, sae.config.d_in, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(sae.encode(x), torch.relu(sae.encoder(x)))  # bit-identical to the ReLU-only encode


def test_sae_config_keys_are_strict_apart_from_the_documented_legacy_defaults(tmp_path):
    sae = SparseAutoencoder(SAEConfig(D_IN, D_SAE, "topk", K))
    sae.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["sae"].pop("k")  # one of the new keys without the other: not the old format, an error
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(GuardFormatError, match=r"missing config key\(s\) \['k'\]"):
        SparseAutoencoder.from_pretrained(tmp_path)
    raw["sae"] |= {"k": K, "extra": 1}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(GuardFormatError, match=r"unknown config key\(s\) \['extra'\]"):
        SparseAutoencoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="topk SAE needs an integer k"):
        SAEConfig(D_IN, D_SAE, "topk")
    with pytest.raises(ValueError, match="k is only used by the topk"):
        SAEConfig(D_IN, D_SAE, "relu", 3)
    with pytest.raises(ValueError, match="unknown SAE activation 'gelu'"):
        SAEConfig(D_IN, D_SAE, "gelu")


def test_jumprelu_threshold_is_a_saved_buffer(tmp_path):
    sae = SparseAutoencoder(SAEConfig(D_IN, D_SAE, "jumprelu"))
    assert "threshold" in dict(sae.named_buffers()) and "threshold" not in dict(sae.named_parameters())
    sae.threshold.fill_(0.25)
    sae.save_pretrained(tmp_path)
    assert torch.equal(SparseAutoencoder.from_pretrained(tmp_path).threshold, sae.threshold)


# --- hook names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hook_name", "layer"),
    [
        ("blocks.20.hook_resid_post", 20),
        ("blocks.21.hook_resid_pre", 20),
        ("layers.20", 20),
        ("model.layers.20", 20),
        ("h.0", 0),
        ("blocks.0.hook_resid_post", 0),
    ],
)
def test_hook_names_map_to_decoder_block_outputs(hook_name, layer):
    assert sae_hook_layer(hook_name) == layer


@pytest.mark.parametrize(
    "hook_name",
    [
        "blocks.5.hook_mlp_out",
        "blocks.5.attn.hook_z",
        "blocks.5.hook_resid_mid",
        "hook_embed",
        "blocks.0.hook_resid_pre",
        "layers.5.mlp",
        "embed_tokens",
    ],
)
def test_other_hooks_are_refused(hook_name):
    with pytest.raises(SAEFormatError, match="hook"):
        sae_hook_layer(hook_name)


def test_layer_mismatch_is_a_clear_error(tmp_path):
    folder = write_saelens(tmp_path / "sae", weights(), "standard", hook_name="blocks.5.hook_resid_post")
    message = r"'blocks.5.hook_resid_post'.*block 5.*guard reads decoder block 2"
    with pytest.raises(SAELayerMismatchError, match=message):
        load_sae(folder, hook_layer=2)
    sparsify_root = tmp_path / "sparsify"
    write_sparsify(sparsify_root, weights(), layer=7)
    with pytest.raises(SAELayerMismatchError, match=r"'layers.7'.*block 7"):
        load_sae(sparsify_root, subfolder="layers.7", hook_layer=LAYER)
    gemma, _ = write_gemma_scope(tmp_path / "g", weights(), layer=9)
    with pytest.raises(SAELayerMismatchError, match=r"'layer_9'"):
        load_sae(gemma, hook_layer=LAYER)


def test_unknown_layer_warns(tmp_path):
    SparseAutoencoder(SAEConfig(D_IN, D_SAE)).save_pretrained(tmp_path)
    assert "layer" not in json.loads((tmp_path / "config.json").read_text())  # as SAEs saved before it was recorded
    with pytest.warns(UserWarning, match="does not record the layer"):
        load_sae(tmp_path, hook_layer=LAYER)


def test_an_hf_lsad_sae_records_its_layer_and_guards_check_it(tmp_path):
    SparseAutoencoder(SAEConfig(D_IN, D_SAE), layer=LAYER).save_pretrained(tmp_path / "sae")
    assert json.loads((tmp_path / "sae" / "config.json").read_text())["layer"] == LAYER
    loaded = read_sae(tmp_path / "sae")
    assert loaded.layer == loaded.sae.layer == LAYER and loaded.hook_name == f"layers.{LAYER}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the layer is known: no warning
        load_sae(tmp_path / "sae", hook_layer=LAYER)
    with pytest.raises(SAELayerMismatchError, match=rf"block {LAYER} .*guard reads decoder block {LAYER + 1}"):
        load_sae(tmp_path / "sae", hook_layer=LAYER + 1)

    config = FreqMaskConfig(kmeans=KMeansConfig(n_clusters=3), mask_size=12)
    guard = fit_guard(X, hook(), "freqmask-km", config, loaded.sae, progress=False).guard
    guard.save_pretrained(tmp_path / "guard")
    assert json.loads((tmp_path / "guard" / "sae" / "config.json").read_text())["layer"] == LAYER
    assert SafetyGuard.from_pretrained(tmp_path / "guard").sae.layer == LAYER
    other = SparseAutoencoder(SAEConfig(D_IN, D_SAE), layer=LAYER + 1)
    with pytest.raises(ValueError, match=rf"trained on decoder block {LAYER + 1}, but the guard reads block {LAYER}"):
        fit_guard(X, hook(), "freqmask-km", config, other, progress=False)
    with pytest.raises(ValueError, match=rf"trained on decoder block {LAYER + 1}, but the guard reads block {LAYER}"):
        SafetyGuard(guard.config, guard.detector, other)
    # a guard folder whose SAE records another block is refused on loading
    record = json.loads((tmp_path / "guard" / "sae" / "config.json").read_text())
    (tmp_path / "guard" / "sae" / "config.json").write_text(json.dumps({**record, "layer": LAYER + 1}))
    with pytest.raises(ValueError, match=rf"trained on decoder block {LAYER + 1}"):
        SafetyGuard.from_pretrained(tmp_path / "guard")


@pytest.mark.parametrize("layer", [-1, 1.5, True, "3"])
def test_an_sae_layer_that_is_not_a_block_is_refused(tmp_path, layer):
    SparseAutoencoder(SAEConfig(D_IN, D_SAE)).save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**record, "layer": layer}))
    with pytest.raises(GuardFormatError, match="non-negative decoder block index"):
        SparseAutoencoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="non-negative decoder block index"):
        SparseAutoencoder(SAEConfig(D_IN, D_SAE), layer=layer)


# --- errors --------------------------------------------------------------------------------------


def test_unknown_layout(tmp_path):
    (tmp_path / "weights.txt").write_text("?")
    (tmp_path / "layers.3").mkdir()
    with pytest.raises(
        SAEFormatError,
        match=r"Unknown SAE layout .*weights.txt.*saelens: cfg.json \+ sae_weights"
        r".*subfolders \['layers.3'\]: pass subfolder=",
    ):
        load_sae(tmp_path)
    with pytest.raises(ValueError, match="unknown SAE layout 'dictionary'"):
        load_sae(tmp_path, layout="dictionary")


def test_missing_files(tmp_path):
    folder = write_saelens(tmp_path / "sae", weights(), "standard")
    (folder / "sae_weights.safetensors").unlink()
    with pytest.raises(SAEFormatError, match=r"saelens SAE folder .* has no sae_weights\.safetensors"):
        load_sae(folder, layout="saelens")
    with pytest.raises(FileNotFoundError):
        load_sae(tmp_path / "nowhere")


def test_wrong_shapes_and_missing_tensors(tmp_path):
    w = weights()
    bad = dict(w, W_enc=np.ascontiguousarray(w["W_enc"].T))  # nn.Linear orientation where SAELens wants [d_in, d_sae]
    message = r"sae_weights.safetensors: tensor 'W_enc' has shape \(48, 16\), expected \(16, 48\)"
    with pytest.raises(SAEFormatError, match=message):
        load_sae(write_saelens(tmp_path / "a", bad, "standard"))
    with pytest.raises(SAEFormatError, match=r"missing tensors \['threshold'\]"):
        folder = write_saelens(tmp_path / "b", w, "jumprelu")
        save_file({key: w[key] for key in ("W_enc", "b_enc", "W_dec", "b_dec")}, folder / "sae_weights.safetensors")
        load_sae(folder)
    folder = write_sparsify(tmp_path / "c", w)
    save_file(
        {"encoder.weight": w["W_enc"], "encoder.bias": w["b_enc"], "W_dec": w["W_dec"], "b_dec": w["b_dec"]},
        folder / "sae.safetensors",
    )
    with pytest.raises(SAEFormatError, match=r"tensor 'encoder.weight' has shape \(16, 48\), expected \(48, 16\)"):
        load_sae(folder)


def test_nan_weights(tmp_path):
    w = weights()
    w["b_dec"][3] = np.nan
    with pytest.raises(SAEFormatError, match=r"sae_weights.safetensors: tensor 'b_dec' holds NaN or inf"):
        load_sae(write_saelens(tmp_path / "a", w, "standard"))
    gemma, _ = write_gemma_scope(tmp_path / "g", w)
    with pytest.raises(SAEFormatError, match=r"params.npz: tensor 'b_dec' holds NaN or inf"):
        load_sae(gemma)


def test_pickles_are_refused(tmp_path):
    folder = write_saelens(tmp_path / "a", weights(), "standard")
    (folder / "sparsity.pt").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match=r"pickle files.*sparsity.pt"):
        load_sae(folder)
    gemma, _ = write_gemma_scope(tmp_path / "g", weights())
    np.savez(gemma / "params.npz", **weights(), extra=np.array([{"a": 1}], dtype=object))
    message = r"params.npz: not a plain-array .npz \(pickled object arrays are refused\)"
    with pytest.raises(SAEFormatError, match=message):
        load_sae(gemma)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"normalize_activations": "layer_norm"}, "normalize_activations='layer_norm' is not supported"),
        ({"normalize_activations": "expected_average_only_in"}, "normalize_activations='expected_average_only_in'"),
        ({"architecture": "gated"}, "SAELens architecture 'gated' is not supported"),
        ({"reshape_activations": "hook_z"}, "reshape_activations='hook_z' is not supported"),
        ({"finetuning_scaling_factor": True}, "finetuning_scaling_factor=true is not supported"),
        ({"activation_fn": "tanh-relu"}, "activation_fn 'tanh-relu' is not supported"),
        ({"metadata": {"hook_name": "blocks.2.hook_mlp_out"}}, "'blocks.2.hook_mlp_out' is not the residual-stream"),
    ],
)
def test_unsupported_saelens_options_are_refused(tmp_path, overrides, message):
    with pytest.raises(SAEFormatError, match=message):
        load_sae(write_saelens(tmp_path / "sae", weights(), "standard", cfg_overrides=overrides))


def test_unsupported_saelens_topk_rescaling(tmp_path):
    folder = write_saelens(tmp_path / "sae", weights(), "topk", cfg_overrides={"rescale_acts_by_decoder_norm": True})
    with pytest.raises(SAEFormatError, match="rescale_acts_by_decoder_norm=true"):
        load_sae(folder)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"transcode": True}, "transcode=True is not supported"),
        ({"skip_connection": True}, "skip_connection=True is not supported"),
        ({"activation": "groupmax"}, "activation='groupmax' is not supported"),
        ({"signed": True}, "signed=True is not supported"),
        ({"batch_topk": True}, r"unknown sparsify config key\(s\) \['batch_topk'\]"),
        ({"k": D_SAE + 1}, "k=49 must be in"),
    ],
)
def test_unsupported_sparsify_options_are_refused(tmp_path, overrides, message):
    with pytest.raises(SAEFormatError, match=message):
        load_sae(write_sparsify(tmp_path, weights(), **overrides))


def test_gemma_scope_other_sites_are_refused(tmp_path):
    folder, _ = write_gemma_scope(tmp_path / "gemma-scope-2b-pt-mlp", weights())
    with pytest.raises(SAEFormatError, match="'gemma-scope-2b-pt-mlp' SAE"):
        load_sae(folder)


# --- Hub ---------------------------------------------------------------------------------------


def test_hub_round_trip_with_revision_and_subfolder(hub_server, hub_cache, tmp_path):
    """sparsify and Gemma Scope repos on the (local) Hub, read by repo id + revision + subfolder."""
    api = HfApi()
    repo_id = f"hf-lsad-org/saes-{uuid.uuid4().hex[:8]}"
    api.create_repo(repo_id)
    w_old, w_new = weights(20), weights(21)
    write_sparsify(tmp_path / "v1", w_old)
    write_sparsify(tmp_path / "v1", weights(22), layer=3)
    first = api.upload_folder(repo_id=repo_id, folder_path=tmp_path / "v1", path_in_repo="sparsify")
    write_sparsify(tmp_path / "v2", w_new)
    write_gemma_scope(tmp_path / "v2", w_new)
    second = api.upload_folder(repo_id=repo_id, folder_path=tmp_path / "v2")

    old = read_sae(repo_id, revision=first.oid, subfolder="sparsify/layers.2", cache_dir=hub_cache)
    assert old.folder.is_relative_to(hub_cache) and old.layer == LAYER
    assert {p.name for p in old.folder.iterdir()} == {"cfg.json", "sae.safetensors"}
    pre = (X.double().numpy() - w_old["b_dec"]) @ w_old["W_enc"].astype(np.float64) + w_old["b_enc"]
    np.testing.assert_allclose(codes(old.sae, X), ref_topk(relu(pre), K), atol=1e-6, rtol=0)

    new = read_sae(repo_id, revision=second.oid, subfolder="layers.2", cache_dir=hub_cache)
    pre = (X.double().numpy() - w_new["b_dec"]) @ w_new["W_enc"].astype(np.float64) + w_new["b_enc"]
    np.testing.assert_allclose(codes(new.sae, X), ref_topk(relu(pre), K), atol=1e-6, rtol=0)

    gemma = load_sae(repo_id, subfolder="layer_2/width_16k/average_l0_12", hook_layer=LAYER, cache_dir=hub_cache)
    np.testing.assert_allclose(codes(gemma, X), ref_jumprelu(X.double().numpy(), w_new, False), atol=1e-6, rtol=0)
    with pytest.raises(SAELayerMismatchError):
        load_sae(repo_id, subfolder="layer_2/width_16k/average_l0_12", hook_layer=3, cache_dir=hub_cache)


def test_hub_repo_with_pickles_is_refused_before_download(hub_server, hub_cache, tmp_path):
    api = HfApi()
    repo_id = f"hf-lsad-org/saes-{uuid.uuid4().hex[:8]}"
    api.create_repo(repo_id)
    folder = write_saelens(tmp_path / "sae", weights(), "standard")
    (folder / "trainer_state.pt").write_bytes(b"\x80\x04")
    api.upload_folder(repo_id=repo_id, folder_path=folder, path_in_repo="blocks.2")
    with pytest.raises(ValueError, match=r"pickle files.*trainer_state.pt"):
        load_sae(repo_id, subfolder="blocks.2", cache_dir=hub_cache)
    assert not any(p.name == "sae_weights.safetensors" for p in hub_cache.rglob("*"))
