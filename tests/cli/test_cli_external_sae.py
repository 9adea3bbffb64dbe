"""``hf-lsad fit --sae`` with an SAELens-layout SAE (written from known tensors) on the tiny model's activations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from external_saes import codes, ref_standard, weights, write_saelens

from hf_lsad.cli.main import entry, main
from hf_lsad.data.store import load_activations
from hf_lsad.detectors import FreqMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.fitting import fit_guard
from hf_lsad.sae.formats import load_sae

LAYER, HIDDEN, D_SAE = 2, 32, 64


@pytest.fixture(scope="module")
def store(tmp_path_factory, model_dir):
    """prompt_last activations of the tiny llama at block LAYER, collected by the CLI."""
    root = tmp_path_factory.mktemp("external-sae")
    main(
        [
            "collect",
            "--model",
            str(model_dir),
            "--pool",
            "benign_ood",
            "--limit",
            "80",
            "--layer",
            str(LAYER),
            "--position",
            "prompt_last",
            "--device",
            "cpu",
            "--out",
            str(root / "safe"),
        ]
    )
    return root / "safe"


def test_fit_with_a_saelens_sae_saves_loads_and_scores_identically(store, tmp_path):
    w = weights(seed=4, d_in=HIDDEN, d_sae=D_SAE)
    sae_dir = write_saelens(
        tmp_path / "saelens",
        w,
        "standard",
        hook_name=f"blocks.{LAYER}.hook_resid_post",
        cfg_overrides={"d_in": HIDDEN, "d_sae": D_SAE},
    )
    main(
        [
            "fit",
            "--activations",
            str(store),
            "--sae",
            str(sae_dir),
            "--kmeans.n-clusters",
            "3",
            "--mask-size",
            "8",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "guard"),
        ]
    )
    guard = SafetyGuard.from_pretrained(tmp_path / "guard")
    data = load_activations(store)
    # The SAE inside the saved guard is the SAELens one: its codes are SAELens' standard (ReLU) encoder's.
    np.testing.assert_allclose(
        codes(guard.sae, data.activations), ref_standard(data.activations.double().numpy(), w), atol=1e-6, rtol=0
    )
    # The same fit through the API gives the same guard: scores and threshold.
    config = FreqMaskConfig(kmeans=KMeansConfig(n_clusters=3), mask_size=8)
    api = fit_guard(
        data.activations,
        data.hook,
        "freqmask-km",
        config,
        load_sae(sae_dir, hook_layer=LAYER),
        progress=False,
        device="cpu",
    ).guard
    assert guard.threshold == pytest.approx(api.threshold, abs=1e-6)
    torch.testing.assert_close(guard(data.activations).scores, api(data.activations).scores, atol=1e-5, rtol=1e-6)
    # Saved and loaded again: the same scores exactly.
    guard.save_pretrained(tmp_path / "again")
    torch.testing.assert_close(
        SafetyGuard.from_pretrained(tmp_path / "again")(data.activations).scores,
        guard(data.activations).scores,
        atol=0,
        rtol=0,
    )


def test_fit_refuses_an_sae_of_another_layer(store, tmp_path, capsys):
    sae_dir = write_saelens(
        tmp_path / "saelens",
        weights(d_in=HIDDEN, d_sae=D_SAE),
        "standard",
        hook_name="blocks.5.hook_resid_post",
        cfg_overrides={"d_in": HIDDEN, "d_sae": D_SAE},
    )
    with pytest.raises(SystemExit) as exit_:
        entry(
            ["fit", "--activations", str(store), "--sae", str(sae_dir), "--device", "cpu", "--out", str(tmp_path / "g")]
        )
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 1 and len(err.splitlines()) == 1
    assert "SAELayerMismatchError" in err and "'blocks.5.hook_resid_post'" in err and "decoder block 2" in err
    assert not (tmp_path / "g").exists()


def test_fit_refuses_a_folder_of_no_sae_layout_before_reading_the_store(store, tmp_path, capsys):
    (tmp_path / "not-an-sae").mkdir()
    (tmp_path / "not-an-sae" / "weights.txt").write_text("0")
    with pytest.raises(SystemExit) as exit_:
        entry(["fit", "--activations", str(store), "--sae", str(tmp_path / "not-an-sae"), "--out", str(tmp_path / "g")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --sae: Unknown SAE layout" in err and "weights.txt" in err
