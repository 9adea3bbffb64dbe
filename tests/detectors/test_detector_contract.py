"""The detector contract: a method defined in this file alone, registered with one call, works everywhere.

It is fitted, saved and loaded, pushed to and pulled from the Hub, calibrated per cluster,
fitted by ``hf-lsad fit --method`` with flags generated from its config, and run by the
evaluation grid, with no edit to any other file.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import torch
from torch import Tensor

from hf_lsad.cli.main import main
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.data.store import save_activations
from hf_lsad.detectors import Detector, DetectorConfig, DetectorOutput, register_detector
from hf_lsad.evaluation import EvalData, GridConfig, MethodSpec, run_grid
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.fitting import fit_guard
from hf_lsad.sae.model import SparseAutoencoder

D = 8


@dataclass
class NearestSampleConfig(DetectorConfig):
    """Settings of the test-only nearest-sample detector."""

    n_centres: int = 4
    """Safe rows drawn (seeded) as centres; each is a cluster."""

    seed: int = 0
    """Seed of the draw."""


@dataclass
class NearestSampleState:
    """What fitting learned that is not a tensor."""

    n_fit: int = 0
    """Safe rows the centres were drawn from (0: not fitted)."""


class NearestSample(Detector):
    """Distance to the nearest of a few seeded safe rows; the cluster is that row."""

    method = "test-nearest-sample"
    config_class = NearestSampleConfig
    state_class = NearestSampleState
    uses_sae = False

    def __init__(self, config: NearestSampleConfig, d_in: int, d_sae: int | None = None, state=None) -> None:
        super().__init__(config, d_in, d_sae, state)
        self.register_buffer("centres", torch.zeros(config.n_centres, d_in))

    @property
    def n_clusters(self) -> int:
        return self.config.n_centres

    def fit(self, activations: Tensor, sae: SparseAutoencoder | None = None, *, progress: bool = True) -> None:
        order = torch.randperm(len(activations), generator=torch.Generator().manual_seed(self.config.seed))
        self.centres.copy_(activations[order[: self.config.n_centres]])
        self.state = NearestSampleState(n_fit=len(activations))

    def forward(self, activations: Tensor, sae: SparseAutoencoder | None = None) -> DetectorOutput:
        scores, clusters = torch.cdist(activations.float(), self.centres).min(-1)
        return DetectorOutput(scores, clusters)


register_detector(NearestSample)

HOOK = HookPoint(
    base_model="synthetic",
    model_type="llama",
    hidden_size=D,
    num_hidden_layers=4,
    layer=2,
    layer_module="model.layers.2",
    position="prompt_last",
)


def stores(tmp_path) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    sets = {
        "safe": torch.randn(200, D, generator=g),
        "unsafe": 3 + torch.randn(200, D, generator=g),
        "ood": 1.5 * torch.randn(100, D, generator=g),
    }
    for name, rows in sets.items():
        save_activations(tmp_path / name, rows, [{"id": i} for i in range(len(rows))], HOOK)
    return sets


def test_fit_save_load_push_pull_calibrate(tmp_path, hub_server, hub_cache):
    sets = stores(tmp_path)
    config = NearestSampleConfig(n_centres=3, seed=1)
    guard = fit_guard(sets["safe"], HOOK, NearestSample.method, config, None, progress=False).guard
    assert guard.detector.config is config and guard.detector.state == NearestSampleState(n_fit=160)
    guard.save_pretrained(tmp_path / "guard")
    loaded = SafetyGuard.from_pretrained(tmp_path / "guard")
    assert loaded.detector.config == config and loaded.detector.state == guard.detector.state
    assert torch.equal(loaded(sets["unsafe"]).scores, guard(sets["unsafe"]).scores)

    repo_id = f"hf-lsad-org/contract-{uuid.uuid4().hex[:8]}"
    guard.push_to_hub(repo_id)
    pulled = SafetyGuard.from_pretrained(repo_id, cache_dir=hub_cache)
    assert torch.equal(pulled(sets["ood"]).scores, guard(sets["ood"]).scores)

    main(
        [
            "calibrate",
            "--guard",
            str(tmp_path / "guard"),
            "--safe",
            str(tmp_path / "safe"),
            "--unsafe",
            str(tmp_path / "unsafe"),
            "--benign-ood",
            str(tmp_path / "ood"),
            "--budget",
            "0.1",
            "--out",
            str(tmp_path / "calibrated"),
        ]
    )
    calibrated = SafetyGuard.from_pretrained(tmp_path / "calibrated")
    calibration = calibrated.calibration
    assert calibration is not None and calibration.n_clusters == 3 and sum(calibration.labelled) == 20 + 20 + 10
    assert "calibrated probability of being unsafe" in calibrated.model_card().text  # the card states the rule applied
    assert "calibrated probability" not in guard.model_card().text


def test_cli_fit_uses_generated_flags_and_the_api_defaults(tmp_path):
    stores(tmp_path)
    main(
        [
            "fit",
            "--method",
            NearestSample.method,
            "--activations",
            str(tmp_path / "safe"),
            "--n-centres",
            "2",
            "--out",
            str(tmp_path / "flags"),
        ]
    )
    assert SafetyGuard.from_pretrained(tmp_path / "flags").detector.config == NearestSampleConfig(n_centres=2)
    main(
        [
            "fit",
            "--method",
            NearestSample.method,
            "--activations",
            str(tmp_path / "safe"),
            "--set",
            "seed=5",
            "--out",
            str(tmp_path / "set"),
        ]
    )
    saved = json.loads((tmp_path / "set" / "config.json").read_text())["detector"]
    assert saved == {"n_centres": 4, "seed": 5, "n_fit": 160}


def test_evaluation_grid_runs_the_method():
    g = torch.Generator().manual_seed(1)
    data = EvalData(
        safe=torch.randn(200, D, generator=g),
        unsafe={"far": 4 + torch.randn(100, D, generator=g)},
        benign_ood=None,
        hook={},
        sources={},
    )
    grid = GridConfig(methods=[MethodSpec("Nearest sample", NearestSample.method, grid={"n_centres": [2, 5]})])
    results = run_grid(data, grid, None, progress=False)
    method = results["methods"]["Nearest sample"]
    assert method["selected"]["n_centres"] in (2, 5) and method["test"]["mean"]["auroc"][0] > 0.9
