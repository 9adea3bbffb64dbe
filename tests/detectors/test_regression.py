"""Seeded-score regression: every registered method, fitted on a small seeded fixture, scores as it did.

``tests/data/seeded_scores.safetensors`` holds the scores, clusters and thresholds that the code
of commit 6df37f0 (before the package redesign) produced for the cases below, and the
bundled guard's scores on a seeded random batch. A refactor must keep every one within 1e-5
(scaled by the score's magnitude when it exceeds 1: float32 spacing at 200 is 1.5e-5); in
practice they are bit-identical on one machine, and another CPU's kernels move them by round-off
(ocsvm by 1.7e-6 with torch's kernels limited to SSE, ``ATEN_CPU_CAPABILITY=default``). Regenerate
only when a change of numbers is intended::

    python tests/detectors/test_regression.py --write
    python tests/detectors/test_regression.py --write-bundled   # after a deliberate refit of the bundled guard only
    python tests/detectors/test_regression.py --write-new       # entries for cases added with a new method only
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_lsad.core.hook_point import HookPoint
from hf_lsad.detectors import DETECTORS, detector_class
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.guard import DEFAULT_GUARD, SafetyGuard
from hf_lsad.guard.calibration import fit_affine_calibration
from hf_lsad.guard.files import PAPER_GUARD
from hf_lsad.guard.fitting import fit_guard
from hf_lsad.sae.training import SAETrainConfig, train_sae

FIXTURE = Path(__file__).parents[1] / "data" / "seeded_scores.safetensors"
D_IN, D_SAE = 16, 32
HOOK = HookPoint(
    base_model="seeded-fixture",
    model_type="llama",
    layer=0,
    layer_module="model.layers.0",
    position="prompt_last",
    hidden_size=D_IN,
    num_hidden_layers=1,
)
SMALL_KMEANS = {"n_clusters": 4, "seed": 7}
LEARNED = {
    "kmeans": {"n_clusters": 3, "seed": 7},
    "lambdas": [1e-3, 1e-2],
    "stage1_steps": 15,
    "min_cluster_size": 20,
    "lora_min_cluster_size": 20,
    "lora_epochs": 2,
    "lora_batch_size": 64,
    "seed": 3,
}
ENCODER = {"hidden_dims": (12,), "rep_dim": 6, "epochs": 3, "pretrain_epochs": 2, "batch_size": 64, "seed": 5}
CASES: dict[str, tuple[str, dict]] = {
    "freqmask-global-l1": ("freqmask-km", {"kmeans": SMALL_KMEANS, "mask_size": 8}),
    "freqmask-local-l2": (
        "freqmask-km",
        {"kmeans": SMALL_KMEANS, "mask_size": 8, "mask_scope": "local", "score_metric": "l2"},
    ),
    "freqmask-mahalanobis": ("freqmask-km", {"kmeans": SMALL_KMEANS, "mask_size": 8, "score_metric": "mahalanobis"}),
    "freqmask-hamming-nomask": ("freqmask-km", {"kmeans": {**SMALL_KMEANS, "metric": "hamming"}, "use_mask": False}),
    "freqmask-l1-clusters": ("freqmask-km", {"kmeans": {**SMALL_KMEANS, "metric": "l1"}, "mask_size": 8}),
    "learned-mask-lora": ("learned-mask-lora", LEARNED),
    "learned-mask-mahalanobis": (
        "learned-mask-lora",
        {**LEARNED, "score_metric": "mahalanobis", "mask_type": "continuous"},
    ),
    "mahalanobis": ("mahalanobis", {"ridge": 1e-3}),
    "gmm": ("gmm", {"n_components": 3, "seed": 2}),
    "ocsvm": ("ocsvm", {"nu": 0.2, "gamma": 0.05, "max_samples": 300, "seed": 1}),
    "deep-svdd": ("deep-svdd", ENCODER),
    "deep-svdd-soft": ("deep-svdd", {**ENCODER, "objective": "soft-boundary", "warm_up_epochs": 1}),
    "cvdd": ("cvdd", {**ENCODER, "n_contexts": 3}),
    "linear-probe": ("linear-probe", {"epochs": 3, "batch_size": 64, "seed": 4}),
    "knn": ("knn", {"k": 5, "max_rows": 400, "seed": 2}),  # added with the method, not from 6df37f0
}
CALIBRATED_CASES = ("freqmask-global-l1", "gmm")
"""Cases whose scores also get a per-cluster affine calibration (probabilities compared)."""


@cache
def fixture_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(safe ``[600, 16]``, unsafe ``[150, 16]``, test batch ``[200, 16]``): seeded Gaussian blobs."""
    g = torch.Generator().manual_seed(12)
    centres = 3.0 * torch.randn(3, D_IN, generator=g)
    safe = centres[torch.arange(600) % 3] + torch.randn(600, D_IN, generator=g)
    unsafe = 2.0 * torch.randn(150, D_IN, generator=g) + 1.5
    test = torch.cat([centres[torch.arange(100) % 3] + torch.randn(100, D_IN, generator=g), unsafe[:100]])
    return safe, unsafe, test


@cache
def fixture_sae():
    safe, _, _ = fixture_data()
    return train_sae(safe, D_SAE, SAETrainConfig(epochs=4, batch_size=64, l1_coefficient=1e-3, seed=0), progress=False)


def build_config(method: str, settings: dict):
    """The method's config with ``settings`` (``kmeans`` given as a dict)."""
    settings = dict(settings)
    if "kmeans" in settings:
        settings["kmeans"] = KMeansConfig(**settings["kmeans"])
    return detector_class(method).config_class(**settings)


def run_case(name: str) -> dict[str, torch.Tensor]:
    """Fit the case on the fixture and score the test batch: ``scores``, ``clusters`` (and ``threshold``)."""
    method, settings = CASES[name]
    safe, unsafe, test = fixture_data()
    cls = detector_class(method)
    sae = fixture_sae() if cls.uses_sae else None
    config = build_config(method, settings)
    out: dict[str, torch.Tensor] = {}
    if cls.supervised:
        detector = cls(config, D_IN, D_SAE)
        detector.fit_supervised(safe, unsafe, sae, progress=False)
        detector.eval()
    else:
        guard = fit_guard(safe, HOOK, method, config, sae, seed=1, progress=False).guard
        detector = guard.detector
        out["threshold"] = torch.tensor([guard.threshold], dtype=torch.float64)
    with torch.no_grad():
        scores, clusters = detector(test, sae)
    out["scores"], out["clusters"] = scores.double(), clusters.long()
    if name in CALIBRATED_CASES:
        labels = torch.cat([torch.zeros(100), torch.ones(100)])
        n_clusters = int(clusters.max()) + 1
        calibration = fit_affine_calibration(scores, clusters, labels, torch.ones(200).numpy(), max(n_clusters, 1))
        out["probabilities"] = calibration.probabilities(scores, clusters)
    return out


def bundled_guard_case() -> dict[str, torch.Tensor]:
    """The bundled paper guard's scores on a seeded random activation batch."""
    guard = SafetyGuard.from_pretrained(PAPER_GUARD)
    batch = 4.0 * torch.randn(64, guard.config.hook.hidden_size, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        output = guard(batch)
    return {"scores": output.scores.double(), "clusters": output.clusters.long(), "flagged": output.flagged.long()}


def default_guard_case() -> dict[str, torch.Tensor]:
    """The bundled two-headed guard's head scores and verdicts on seeded random activations of each of its reads."""
    guard = SafetyGuard.from_pretrained(DEFAULT_GUARD)
    generator = torch.Generator().manual_seed(99)
    reads = {read: 4.0 * torch.randn(64, guard.config.hook.hidden_size, generator=generator) for read in guard.reads}
    with torch.no_grad():
        output = guard(reads)
    return {
        "scores": output.scores.double(),
        "clusters": output.clusters.long(),
        "flagged": output.flagged.long(),
        **{f"head-{name}": values.double() for name, values in output.head_scores.items()},
    }


def _compare(name: str, got: dict[str, torch.Tensor], stored: dict[str, torch.Tensor]) -> None:
    expected = {key.split("/", 1)[1] for key in stored if key.startswith(f"{name}/")}
    assert set(got) == expected, f"{name}: keys {sorted(set(got) ^ expected)} appeared or disappeared"
    for key, value in got.items():
        reference = stored[f"{name}/{key}"]
        assert value.shape == reference.shape, f"{name}/{key}: shape {tuple(value.shape)} vs {tuple(reference.shape)}"
        if reference.dtype == torch.int64:
            assert torch.equal(value, reference), f"{name}/{key} changed"
        else:
            delta = (value - reference).abs() / reference.abs().clamp_min(1.0)
            assert delta.max().item() <= 1e-5, f"{name}/{key}: max |delta| {delta.max().item():.3g}"


@pytest.fixture(scope="module")
def stored() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE))


def test_every_registered_method_has_a_case():
    covered = {method for method, _ in CASES.values()}
    package_methods = {m for m, cls in DETECTORS.items() if cls.__module__.startswith("hf_lsad.")}
    assert package_methods <= covered, f"no regression case for {sorted(package_methods - covered)}"


@pytest.mark.parametrize("name", list(CASES))
def test_seeded_fit_scores_as_before(name, stored):
    _compare(name, run_case(name), stored)


def test_bundled_guard_scores_as_before(stored):
    _compare("bundled-guard", bundled_guard_case(), stored)


def test_default_two_headed_guard_scores_as_before(stored):
    _compare("default-guard", default_guard_case(), stored)


if __name__ == "__main__" and sys.argv[1:] == ["--write-bundled"]:
    # After a deliberate refit of the bundled guard: its entries change, the seeded fits' stay as stored.
    tensors = load_file(str(FIXTURE)) | {f"bundled-guard/{k}": v for k, v in bundled_guard_case().items()}
    tensors |= {f"default-guard/{k}": v for k, v in default_guard_case().items()}
    save_file(tensors, str(FIXTURE))
    print(f"rewrote the bundled guard's entries in {FIXTURE}")
elif __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    tensors = {f"bundled-guard/{k}": v for k, v in bundled_guard_case().items()}
    tensors |= {f"default-guard/{k}": v for k, v in default_guard_case().items()}
    for case in CASES:
        tensors.update({f"{case}/{k}": v.contiguous() for k, v in run_case(case).items()})
    FIXTURE.parent.mkdir(exist_ok=True)
    save_file(tensors, str(FIXTURE))
    print(f"wrote {len(tensors)} tensors to {FIXTURE}")
elif __name__ == "__main__" and sys.argv[1:] == ["--write-new"]:
    # A new method's case: its entries are added, every stored entry stays as it is.
    tensors = load_file(str(FIXTURE))
    stored_cases = {key.split("/")[0] for key in tensors}
    for name in CASES.keys() - stored_cases:
        tensors |= {f"{name}/{k}": v for k, v in run_case(name).items()}
    save_file(tensors, str(FIXTURE))
