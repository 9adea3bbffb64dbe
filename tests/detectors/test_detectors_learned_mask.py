"""LearnedMask-LoRA: STE gradient, mask recovery, cluster batching, peft export, fallback, save/load."""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch
from peft import PeftModel
from tiny import LAYER, MIXED_BATCH, PROMPTS, reports_of, tiny_guard

from hf_lsad.capture.collect import collect_activations, encode_prompts
from hf_lsad.cli.main import main
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.core.metrics import auroc
from hf_lsad.data.store import save_activations
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.detectors.learned_mask import (
    BASE_SAE,
    MASK_AND_LORA,
    MASK_ONLY,
    LearnedMaskConfig,
    LearnedMaskLoRA,
    LearnedMaskState,
)
from hf_lsad.detectors.learned_mask.training import _MaskedSAE
from hf_lsad.detectors.masks import straight_through_mask
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.fitting import fit_guard
from hf_lsad.sae.model import SAEConfig, SparseAutoencoder


@pytest.fixture(autouse=True)
def one_thread():
    # Small matrices: a second thread only adds contention on a shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_straight_through_mask_is_hard_forward_and_sigmoid_backward():
    logits = torch.tensor([-2.0, -0.1, 0.0, 0.3, 1.5], requires_grad=True)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    mask = straight_through_mask(logits)
    assert torch.equal(mask.detach(), torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0]))
    (mask * weights).sum().backward()
    sigmoid = torch.sigmoid(logits.detach())
    assert torch.allclose(logits.grad, weights * sigmoid * (1 - sigmoid))


def signed_identity_sae(d_in: int) -> SparseAutoencoder:
    """E(a) = relu([a, -a]) and D(z) = z[:d] - z[d:]: reconstructs every a exactly with all features on."""
    sae = SparseAutoencoder(SAEConfig(d_in=d_in, d_sae=2 * d_in))
    eye = torch.eye(d_in)
    with torch.no_grad():
        sae.encoder.weight.copy_(torch.cat([eye, -eye]))
        sae.encoder.bias.zero_()
        sae.decoder.weight.copy_(torch.cat([eye, -eye], dim=1))
        sae.decoder.bias.zero_()
    return sae


@pytest.mark.parametrize("mask_type", ["binary", "continuous"])
def test_mask_recovers_the_features_a_cluster_lives_on(mask_type):
    d_in, signal = 12, [1, 4, 5, 9]
    g = torch.Generator().manual_seed(0)
    data = 1e-3 * torch.randn(300, d_in, generator=g)  # tiny noise fires features that carry no signal
    data[:, signal] = 1.0 + torch.rand(300, len(signal), generator=g)
    config = LearnedMaskConfig(
        kmeans=KMeansConfig(n_clusters=1), mask_type=mask_type, min_cluster_size=10, stage1_only=True
    )
    detector = LearnedMaskLoRA(config, d_in, 2 * d_in)
    detector.fit(data, signed_identity_sae(d_in), progress=False)
    assert detector.state.cluster_stages == [MASK_ONLY]
    mask = detector.masks[0]
    if mask_type == "binary":
        assert mask.nonzero().squeeze(1).tolist() == signal  # the positive halves of the signal dimensions
    else:
        assert set(mask.topk(len(signal)).indices.tolist()) == set(signal)
        assert mask[signal].min() > 0.9 and mask[[j for j in range(2 * d_in) if j not in signal]].max() < 0.1


def three_clusters(n: tuple[int, ...], generator: torch.Generator, offset: int = 0) -> torch.Tensor:
    """Rows of a d=16 space; cluster i lives on dimensions 4i..4i+3 (+ offset), sizes n."""
    rows = []
    for i, size in enumerate(n):
        x = 0.05 * torch.randn(size, 16, generator=generator)
        dims = [(4 * i + j + offset) % 16 for j in range(4)]
        x[:, dims] += 1.0 + torch.rand(size, 4, generator=generator)
        rows.append(x)
    return torch.cat(rows)


def random_sae(d_in: int = 16, d_sae: int = 48) -> SparseAutoencoder:
    torch.manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(d_in, d_sae))
    sae.normalize_decoder()
    return sae.eval()


FAST = dict(stage1_steps=80, lora_epochs=5, lora_batch_size=64)


@cache
def fitted(**overrides) -> tuple[LearnedMaskLoRA, SparseAutoencoder, torch.Tensor]:
    """A detector fitted on three clusters of 240, 90 and 12 rows: LoRA, mask only, base SAE."""
    settings = dict(kmeans=KMeansConfig(n_clusters=3, seed=0), min_cluster_size=30, lora_min_cluster_size=150) | FAST
    config = LearnedMaskConfig(**(settings | overrides))
    data = three_clusters((240, 90, 12), torch.Generator().manual_seed(1))
    sae = random_sae()
    detector = LearnedMaskLoRA(config, 16, 48)
    detector.fit(data, sae, progress=False)
    return detector, sae, data


def test_stages_follow_cluster_sizes_and_small_clusters_fall_back_to_the_base_sae():
    detector, _, _ = fitted()
    by_size = dict(zip(detector.cluster_sizes.tolist(), detector.state.cluster_stages))
    assert by_size == {240: MASK_AND_LORA, 90: MASK_ONLY, 12: BASE_SAE}
    base = detector.state.cluster_stages.index(BASE_SAE)
    assert detector.masks[base].eq(1).all() and detector.state.cluster_ranks[base] == 0
    assert detector.state.cluster_lambdas[base] == 0.0 and detector.encoder_lora_B[base].eq(0).all()
    lora = detector.state.cluster_stages.index(MASK_AND_LORA)
    assert detector.state.cluster_ranks[lora] in (2, 4, 8) and detector.encoder_lora_B[lora].abs().sum() > 0


def test_mixed_cluster_batch_scores_equal_one_row_at_a_time():
    detector, sae, _ = fitted()
    with torch.no_grad():
        batch = three_clusters((5, 5, 5), torch.Generator().manual_seed(2))
        together = detector(batch, sae)
        assert set(together.clusters.tolist()) == {0, 1, 2}
        alone = [detector(row[None], sae) for row in batch]
    assert torch.allclose(together.scores, torch.cat([a.scores for a in alone]), rtol=1e-5, atol=1e-5)
    assert torch.equal(together.clusters, torch.cat([a.clusters for a in alone]))


def test_stacked_adapters_equal_peft_mixed_batches_and_exported_peft_folders(tmp_path):
    detector, sae, data = fitted()
    rows = torch.arange(0, len(data), 17)
    with torch.no_grad():
        clusters = detector(data[rows], sae).clusters
        stacked = detector.reconstruct(data[rows], sae, clusters)
        names = [f"cluster_{c}" if detector.state.cluster_ranks[c] else "__base__" for c in clusters.tolist()]
        mixed = detector.peft_model(sae)(data[rows], detector.masks[clusters], adapter_names=names)
    assert torch.allclose(stacked, mixed, atol=1e-5)

    folders = detector.save_peft_adapters(tmp_path, sae)
    lora = detector.state.cluster_stages.index(MASK_AND_LORA)
    assert [f.name for f in folders] == [f"cluster_{lora}"]
    assert {p.name for p in folders[0].iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    loaded = PeftModel.from_pretrained(_MaskedSAE(sae), str(folders[0])).eval()
    members = rows[clusters == lora]
    with torch.no_grad():
        expected = detector.reconstruct(data[members], sae, torch.full((len(members),), lora))
        assert torch.allclose(loaded(data[members], detector.masks[lora].expand(len(members), -1)), expected, atol=1e-5)


VARIANTS = [
    dict(),
    dict(mask_type="continuous"),
    dict(score_metric="mahalanobis", ridge=0.1),
    dict(stage1_only=True),
]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_variants_separate_rows_off_the_clusters_supports(overrides):
    detector, sae, _ = fitted(**overrides)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        safe = detector(three_clusters((60, 60, 60), g), sae).scores
        shifted = detector(three_clusters((60, 60, 60), g, offset=2), sae).scores  # half on foreign dimensions
    assert torch.isfinite(safe).all() and auroc(safe.numpy(), shifted.numpy()) > 0.9
    if overrides.get("stage1_only"):
        assert MASK_AND_LORA not in detector.state.cluster_stages


def test_fit_is_deterministic():
    first, sae, data = fitted()
    second = LearnedMaskLoRA(first.config, 16, 48)
    second.fit(data, sae, progress=False)
    assert second.config == first.config
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name


BAD_SETTINGS = [
    (dict(mask_type="ternary"), "mask_type"),
    (dict(score_metric="cosine"), "score_metric"),
    (dict(lambdas=[]), "lambdas"),
    (dict(validation_fraction=1.0), "validation_fraction"),
    (dict(min_cluster_size=1), "min_cluster_size"),
    (dict(lora_ranks=[2, 4]), "lora_ranks"),
    (dict(lora_epochs=0), "lora_epochs"),
    (dict(shrinkage=1.5), "shrinkage"),
    (dict(score_metric="mahalanobis", ridge=0.0), "ridge"),
]


@pytest.mark.parametrize("settings, message", BAD_SETTINGS)
def test_bad_settings_are_clear_errors(settings, message):
    with pytest.raises(ValueError, match=message):
        LearnedMaskConfig(kmeans=KMeansConfig(n_clusters=3), **settings)


def test_a_fitted_state_that_does_not_fit_the_config_is_a_clear_error():
    with pytest.raises(ValueError, match="one entry per cluster"):
        LearnedMaskLoRA(
            LearnedMaskConfig(kmeans=KMeansConfig(n_clusters=3)), 16, 48, LearnedMaskState(cluster_stages=[1, 2])
        )


def test_fit_keeps_the_config_it_was_given():
    config = LearnedMaskConfig(kmeans=KMeansConfig(n_clusters=2), min_cluster_size=10, lora_min_cluster_size=10, **FAST)
    detector = LearnedMaskLoRA(config, 16, 48)
    detector.fit(three_clusters((60, 40), torch.Generator().manual_seed(3)), random_sae(), progress=False)
    assert detector.config is config and detector.config == LearnedMaskConfig(
        kmeans=KMeansConfig(n_clusters=2), min_cluster_size=10, lora_min_cluster_size=10, **FAST
    )
    assert len(detector.state.cluster_stages) == 2


def test_unfitted_detector_refuses_to_score():
    detector = LearnedMaskLoRA(LearnedMaskConfig(kmeans=KMeansConfig(n_clusters=2)), 16, 48)
    with pytest.raises(RuntimeError, match="not fitted"):
        detector(torch.zeros(1, 16), random_sae())


def test_guard_round_trip_gives_identical_scores_in_guarded_generate(tmp_path):
    model, tokenizer, reference = tiny_guard("response_last")  # positional: the cache entry fresh_guard uses
    collected = collect_activations(
        model,
        tokenizer,
        PROMPTS,
        layer=LAYER,
        position="response_last",
        batch_size=16,
        max_new_tokens=6,
        progress=False,
    )
    hook = reference.config.hook
    config = LearnedMaskConfig(kmeans=KMeansConfig(n_clusters=3), min_cluster_size=10, lora_min_cluster_size=10, **FAST)
    guard = fit_guard(collected.activations, hook, "learned-mask-lora", config, reference.sae, progress=False).guard
    guard.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["detector"]
    assert saved["cluster_stages"] == guard.detector.state.cluster_stages and MASK_AND_LORA in saved["cluster_stages"]
    loaded = SafetyGuard.from_pretrained(tmp_path)

    inputs = encode_prompts(tokenizer, MIXED_BATCH)
    reports = reports_of(model, (guard, loaded), inputs)
    assert reports[0] == reports[1]
    assert all(r.probability is None and r.flagged == (r.score > guard.threshold) for r in reports[0])


def test_cli_fits_a_learned_mask_lora_guard(tmp_path):
    data = three_clusters((240, 90, 12), torch.Generator().manual_seed(1))
    hook = HookPoint(
        base_model="synthetic",
        model_type="llama",
        hidden_size=16,
        num_hidden_layers=4,
        layer=2,
        layer_module="model.layers.2",
        position="prompt_last",
    )
    save_activations(tmp_path / "acts", data, [{"id": i} for i in range(len(data))], hook)
    random_sae().save_pretrained(tmp_path / "sae")
    main(
        [
            "fit",
            "--activations",
            str(tmp_path / "acts"),
            "--sae",
            str(tmp_path / "sae"),
            "--out",
            str(tmp_path / "guard"),
            "--method",
            "learned-mask-lora",
            "--kmeans.n-clusters",
            "3",
            "--min-cluster-size",
            "30",
            "--lora-min-cluster-size",
            "150",
        ]
    )
    guard = SafetyGuard.from_pretrained(tmp_path / "guard")
    assert guard.config.method == "learned-mask-lora"
    assert sorted(guard.detector.state.cluster_stages) == [BASE_SAE, MASK_ONLY, MASK_AND_LORA]
