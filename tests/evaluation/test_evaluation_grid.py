"""The method-grid runner: splits, selection on validation only, and an end-to-end report via the CLI."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from hf_lsad.cli.main import main
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.data.store import save_activations
from hf_lsad.evaluation import (
    EvalData,
    GridConfig,
    MethodSpec,
    Splits,
    build_config,
    evaluate_detector,
    fit_detector,
    grid_points,
    make_splits,
    run_grid,
)

D = 16


def hook() -> HookPoint:
    return HookPoint("tiny/model", "llama", D, 4, 2, "model.layers.2", "prompt_last")


def clustered(n: int, seed: int, shift: float = 0.0) -> torch.Tensor:
    """Three safe-like blobs; ``shift`` pushes rows off them along a fixed random direction."""
    g = torch.Generator().manual_seed(seed)
    centres = 4.0 * torch.randn(3, D, generator=torch.Generator().manual_seed(123))
    direction = torch.randn(D, generator=torch.Generator().manual_seed(7))
    x = centres[torch.arange(n) % 3] + torch.randn(n, D, generator=g)
    return x + shift * direction / direction.norm()


def test_make_splits_are_disjoint_seeded_and_sized():
    config = GridConfig(methods=[MethodSpec("M", "mahalanobis")], split_seed=3)
    splits = make_splits(100, {"harmful": 50, "toxic": 10}, config)
    assert (len(splits.safe_test), len(splits.safe_validation), len(splits.safe_fit)) == (20, 20, 60)
    safe = torch.cat([splits.safe_fit, splits.safe_validation, splits.safe_test])
    assert sorted(safe.tolist()) == list(range(100))
    for category, n in (("harmful", 50), ("toxic", 10)):
        parts = [splits.unsafe_probe[category], splits.unsafe_validation[category], splits.unsafe_test[category]]
        assert sorted(torch.cat(parts).tolist()) == list(range(n))
    assert [len(p) for p in (splits.unsafe_probe["harmful"], splits.unsafe_validation["harmful"])] == [10, 10]
    again = make_splits(100, {"harmful": 50, "toxic": 10}, config)
    assert torch.equal(again.safe_test, splits.safe_test)
    with pytest.raises(ValueError, match="empty"):
        make_splits(2, {"harmful": 50}, config)


def test_build_config_dotted_keys_seeds_and_grid_points():
    config, seeded = build_config("freqmask-km", {"kmeans.n_clusters": 7, "mask_scope": "local"}, 5)
    assert (config.kmeans.n_clusters, config.kmeans.seed, config.mask_scope, seeded) == (7, 5, "local", True)
    config, seeded = build_config("mahalanobis", {"ridge": 0.1}, 5)
    assert (config.ridge, seeded) == (0.1, False)
    config, _ = build_config("deep-svdd", {"hidden_dims": [8, 4]}, 0)
    assert config.hidden_dims == (8, 4)  # JSON lists become the config's tuples
    with pytest.raises(ValueError, match="no field"):
        build_config("mahalanobis", {"ridge_typo": 1.0}, 0)
    spec = MethodSpec(
        "F", "freqmask-km", base={"mask_scope": "local"}, grid={"mask_size": [4, 8], "kmeans.n_clusters": [2, 3]}
    )
    points = grid_points(spec)
    assert len(points) == 4 and all(p["mask_scope"] == "local" for p in points)


def test_selection_uses_the_validation_split_only():
    """Validation unsafe rows are off-axis in a low-variance direction, test unsafe rows far along the
    high-variance one. Mahalanobis with a tiny ridge wins on validation, a huge ridge (about Euclidean) on
    test: the runner must select the tiny ridge, and its selection must not move when the test rows change."""
    g = torch.Generator().manual_seed(0)
    scale = torch.ones(6)
    scale[0] = 10.0
    safe = torch.randn(400, 6, generator=g) * scale
    val_unsafe = torch.randn(40, 6, generator=g) * scale
    val_unsafe[:, 1] += 6.0
    test_unsafe = torch.randn(60, 6, generator=g) * scale
    test_unsafe[:, 0] += 35.0
    data = EvalData(safe, {"harmful": torch.cat([val_unsafe, test_unsafe])}, None, {}, {})
    config = GridConfig(
        methods=[MethodSpec("Mahalanobis", "mahalanobis", grid={"ridge": [1e-5, 1e4]})], diagnostics=False
    )
    base = make_splits(400, {"harmful": 100}, config)
    splits = Splits(
        base.safe_fit,
        base.safe_validation,
        base.safe_test,
        {"harmful": torch.arange(0)},
        {"harmful": torch.arange(40)},
        {"harmful": torch.arange(40, 100)},
    )
    result = run_grid(data, config, None, splits=splits, progress=False)["methods"]["Mahalanobis"]
    assert result["selected"] == {"ridge": 1e-5}
    validation = {p["settings"]["ridge"]: p["validation_auroc"] for p in result["grid"]}
    assert validation[1e-5] > validation[1e4]
    # the test split would have preferred the other point
    other = fit_detector("mahalanobis", build_config("mahalanobis", {"ridge": 1e4}, 0)[0], data, splits, None)
    assert (
        evaluate_detector(other, data, splits, None, 0.05)["test"]["mean"]["auroc"] > result["test"]["mean"]["auroc"][0]
    )

    # replacing every test row changes the test numbers, never the selection
    shuffled = EvalData(safe, {"harmful": torch.cat([val_unsafe, -test_unsafe])}, None, {}, {})
    again = run_grid(shuffled, config, None, splits=splits, progress=False)["methods"]["Mahalanobis"]
    assert again["selected"] == result["selected"] and again["grid"] == result["grid"]


def test_cli_grid_end_to_end_writes_the_report(tmp_path, monkeypatch):
    stores = tmp_path / "stores"
    for name, (n, seed, shift) in {
        "safe": (360, 0, 0.0),
        "harmful": (90, 1, 6.0),
        "toxic": (90, 2, 3.0),
        "benign_ood": (60, 3, 4.0),
    }.items():
        activations = clustered(n, seed, shift)
        records = [{"id": f"{name}-{i}", "category": name} for i in range(n)]
        save_activations(stores / name, activations, records, hook())
    grid = {
        "methods": [
            {
                "name": "FreqMask-KM",
                "method": "freqmask-km",
                "base": {"mask_size": 8},
                "grid": {"kmeans.n_clusters": [2, 3]},
                "local": True,
            },
            {
                "name": "Local FreqMask-KM",
                "method": "freqmask-km",
                "base": {"mask_size": 8, "mask_scope": "local", "kmeans.n_clusters": 3},
                "local": True,
            },
            {"name": "Mahalanobis", "method": "mahalanobis", "grid": {"ridge": [1e-3, 1.0]}},
            {"name": "Linear probe", "method": "linear-probe", "base": {"epochs": 5}},
        ],
        "ablations": [
            {"name": "clusters K", "method": "FreqMask-KM", "key": "kmeans.n_clusters", "values": [1, 2, 3]},
            {"name": "mask on/off", "method": "FreqMask-KM", "key": "use_mask", "values": [True, False]},
        ],
        "seeds": [0, 1],
    }
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    out, sae = tmp_path / "report", tmp_path / "sae"
    args = [
        "evaluate",
        "--safe",
        str(stores / "safe"),
        "--unsafe",
        str(stores / "harmful"),
        str(stores / "toxic"),
        "--benign-ood",
        str(stores / "benign_ood"),
        "--grid",
        str(tmp_path / "grid.json"),
        "--sae",
        str(sae),
        "--d-sae",
        "32",
        "--sae-l1",
        "0.01",
        "--sae-epochs",
        "3",
        "--out",
        str(out),
        "--title",
        "tiny",
    ]
    monkeypatch.setattr(sys, "argv", ["hf-lsad", *args])  # the report records the command line it ran
    main(args)
    assert (sae / "training.json").is_file()  # trained on the fit split, cached for the next run
    results = json.loads((out / "results.json").read_text())
    methods = results["results"]["methods"]
    assert list(methods) == ["FreqMask-KM", "Local FreqMask-KM", "Mahalanobis", "Linear probe"]
    assert methods["Linear probe"]["supervised"] and not methods["FreqMask-KM"]["supervised"]
    assert methods["Mahalanobis"]["deterministic"] and len(methods["Mahalanobis"]["runs"]) == 1
    assert len(methods["FreqMask-KM"]["runs"]) == 2
    for m in methods.values():
        assert set(m["test"]) == {"harmful", "toxic", "mean", "benign_ood_fpr"}
        assert set(m["test"]["mean"]) == {"auroc", "tpr_at_fpr", "fpr_at_tpr", "flagged", "auroc_pooled"}
        mean = (m["runs"][0]["test"]["harmful"]["auroc"] + m["runs"][0]["test"]["toxic"]["auroc"]) / 2
        assert m["runs"][0]["test"]["mean"]["auroc"] == pytest.approx(mean)
    best = max(methods["FreqMask-KM"]["grid"], key=lambda p: p["validation_auroc"])
    assert methods["FreqMask-KM"]["selected"] == best["settings"]
    assert [a["name"] for a in results["results"]["ablations"]] == ["clusters K", "mask on/off"]
    assert [r["value"] for r in results["results"]["ablations"][1]["rows"]] == [True, False]
    diag = results["results"]["diagnostics"]
    assert set(diag) == {"FreqMask-KM", "Local FreqMask-KM"}
    assert {"effective_dimension", "occupancy", "scores", "support_overlap"} <= set(diag["FreqMask-KM"])
    assert results["versions"]["torch"] == torch.__version__
    assert results["command"].startswith("hf-lsad evaluate --safe")

    report = (out / "report.md").read_text()
    assert "Linear probe (SUPERVISED reference)" in report
    assert "**" in report and "selected on the validation split only" in report
    assert "### clusters K" in report and "### mask on/off" in report
    assert "Effective dimension d90" in report and "TV distance" in report
    assert "hf-lsad evaluate --safe" in report
    # the header row of the Table-2 layout: categories and their mean
    assert "| Method | Local | harmful | toxic | mean |" in report

    # a second run reuses the cached SAE; asking for other SAE settings is refused
    main([*args[:-4], "--out", str(tmp_path / "again")])
    assert json.loads((tmp_path / "again" / "results.json").read_text())["sae"]["trained_here"] is False
    with pytest.raises(ValueError, match="trained with"):
        main([a if a != "3" else "4" for a in args])
