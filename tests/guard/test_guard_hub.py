"""SafetyGuard on the Hub: push, pull, model cards and the base-model check, against tests/hub_server.py."""

from __future__ import annotations

import contextlib
import io
import json
import re
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, ModelCard, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
from tiny import LAYER, MIXED_BATCH, fresh_guard, tiny_guard, two_headed_guard

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.cli.main import main as cli_main
from hf_lsad.core.hook_point import HookPoint, base_model_key, same_base_model
from hf_lsad.core.serialization import GuardFormatError
from hf_lsad.data.store import save_activations
from hf_lsad.detectors.mahalanobis import MahalanobisConfig
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.card import GUARD_TAGS, guard_model_card
from hf_lsad.guard.fitting import fit_guard
from hf_lsad.testing import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

METRICS = {
    "harmful": {"auroc": 0.9731, "tpr_at_5fpr": 0.8125, "flagged": 0.79},
    "toxic": {"auroc": 0.88, "tpr_at_5fpr": 0.5},
}
GUARD_FILES = [
    "README.md",
    "config.json",
    "detector.safetensors",
    "sae/config.json",
    "sae/sae.safetensors",
    "threshold.safetensors",
]


@pytest.fixture
def repo_id(hub_server) -> str:
    return f"hf-lsad-org/guard-{uuid.uuid4().hex[:8]}"


def assert_same_guard(a: SafetyGuard, b: SafetyGuard) -> None:
    """Same config, bit-identical tensors, bit-identical scores."""
    assert a.config == b.config
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys() and len(state_a) > 0
    for name, tensor in state_a.items():
        assert tensor.dtype == state_b[name].dtype and torch.equal(tensor, state_b[name]), name
    activations = torch.randn(16, a.config.hook.hidden_size, generator=torch.Generator().manual_seed(0))
    out_a, out_b = a(activations), b(activations)
    assert torch.equal(out_a.scores, out_b.scores) and torch.equal(out_a.clusters, out_b.clusters)
    # The held-out safe scores travel with the guard, so its reports keep their conformal p-values.
    assert (a.holdout_scores is None) == (b.holdout_scores is None)
    if a.holdout_scores is not None:
        assert torch.equal(a.holdout_scores, b.holdout_scores)
        assert [r.p_value for r in a.reports(activations)] == [r.p_value for r in b.reports(activations)]


def save_tiny_model(folder: Path) -> Path:
    model, tokenizer, _ = tiny_guard()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def python_block(markdown: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", markdown, flags=re.S)
    assert len(blocks) == 1
    return blocks[0]


# --- push / pull -----------------------------------------------------------------------------------------------


def test_push_then_pull_is_bit_exact(hub_server, hub_cache, repo_id):
    guard = fresh_guard()
    commit = guard.push_to_hub(repo_id, metrics=METRICS)
    api = HfApi()
    assert api.repo_info(repo_id).sha == commit.oid
    files = sorted(f for f in api.list_repo_files(repo_id) if f != ".gitattributes")
    assert files == GUARD_FILES
    tree = {f.path: f for f in api.list_repo_tree(repo_id, recursive=True) if hasattr(f, "lfs")}
    assert tree["detector.safetensors"].lfs is not None and tree["config.json"].lfs is None

    pulled = SafetyGuard.from_pretrained(repo_id, cache_dir=hub_cache)
    assert_same_guard(guard, pulled)
    assert list(hub_cache.glob(f"*/snapshots/{commit.oid}/config.json"))  # loaded from the fresh cache

    # A second load is served from the cache, also with local_files_only.
    hub_server.log.clear()
    offline = SafetyGuard.from_pretrained(repo_id, revision=commit.oid, cache_dir=hub_cache, local_files_only=True)
    assert hub_server.log == [] and offline.config == guard.config


def test_revision_pinning(hub_server, hub_cache, repo_id):
    guard = fresh_guard()
    first = guard.push_to_hub(repo_id)
    old_threshold = guard.threshold
    guard.config.threshold = old_threshold + 1.0
    second = guard.push_to_hub(repo_id, commit_message="Raise the threshold")
    assert first.oid != second.oid

    old = SafetyGuard.from_pretrained(repo_id, revision=first.oid, cache_dir=hub_cache)
    new = SafetyGuard.from_pretrained(repo_id, cache_dir=hub_cache)
    assert old.threshold == old_threshold and new.threshold == old_threshold + 1.0
    assert_same_guard(new, guard)
    guard.config.threshold = old_threshold
    assert_same_guard(old, guard)
    assert HfApi().repo_info(repo_id).sha == second.oid


def test_push_to_a_branch_and_as_a_pull_request(hub_server, hub_cache, repo_id):
    guard = fresh_guard()
    guard.push_to_hub(repo_id)
    guard.config.threshold += 0.5
    branch = guard.push_to_hub(repo_id, revision="refit")
    pr = guard.push_to_hub(repo_id, create_pr=True)
    assert pr.pr_revision == "refs/pr/1"
    assert SafetyGuard.from_pretrained(repo_id, revision="refit", cache_dir=hub_cache).threshold == guard.threshold
    assert (
        SafetyGuard.from_pretrained(repo_id, revision=pr.pr_revision, cache_dir=hub_cache).threshold == guard.threshold
    )
    assert SafetyGuard.from_pretrained(repo_id, cache_dir=hub_cache).threshold == guard.threshold - 0.5
    card = ModelCard.load(hf_hub_download(repo_id, "README.md", revision=branch.oid, cache_dir=hub_cache))
    assert '"revision": "refit"' in card.text


def test_two_guards_in_subfolders_of_one_repo(hub_server, hub_cache, repo_id):
    response, prompt = fresh_guard("response_last"), fresh_guard("prompt_last")
    response.push_to_hub(repo_id, subfolder=f"layer_{LAYER}/response_last", metrics=METRICS)
    prompt.push_to_hub(repo_id, subfolder=f"layer_{LAYER}/prompt_last")
    files = HfApi().list_repo_files(repo_id)
    assert sorted(f for f in files if f != ".gitattributes") == sorted(
        f"layer_{LAYER}/{position}/{name}" for position in ("prompt_last", "response_last") for name in GUARD_FILES
    )

    for guard in (response, prompt):
        sub = f"layer_{LAYER}/{guard.config.hook.position}"
        pulled = SafetyGuard.from_pretrained(repo_id, subfolder=sub, cache_dir=hub_cache)
        assert_same_guard(guard, pulled)
        card = ModelCard.load(hf_hub_download(repo_id, f"{sub}/README.md", cache_dir=hub_cache))
        assert f'"subfolder": "{sub}"' in card.text and f'guard="{repo_id}"' in card.text
    with pytest.raises(EntryNotFoundError, match=f"layer_{LAYER}/nowhere"):
        SafetyGuard.from_pretrained(repo_id, subfolder=f"layer_{LAYER}/nowhere", cache_dir=hub_cache)


# --- errors ----------------------------------------------------------------------------------------------------


def test_missing_repo_revision_subfolder_and_file(hub_server, hub_cache, repo_id):
    guard = fresh_guard()
    guard.push_to_hub(repo_id, subfolder="layer_2")
    with pytest.raises(RepositoryNotFoundError):
        SafetyGuard.from_pretrained("hf-lsad-org/no-such-guard", cache_dir=hub_cache)
    with pytest.raises(RevisionNotFoundError):
        SafetyGuard.from_pretrained(repo_id, revision="no-such-branch", subfolder="layer_2", cache_dir=hub_cache)
    with pytest.raises(EntryNotFoundError, match="layer_3"):
        SafetyGuard.from_pretrained(repo_id, subfolder="layer_3", cache_dir=hub_cache)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(repo_id, "layer_2/calibration.json", cache_dir=hub_cache)
    assert not list(hub_cache.glob("*/snapshots/*/*"))  # nothing was downloaded so far

    # A guard folder on the Hub that lacks one of its files: a clear error naming the file.
    HfApi().create_commit(
        repo_id, [CommitOperationDelete("layer_2/detector.safetensors")], commit_message="Break the guard"
    )
    with pytest.raises(GuardFormatError, match=r"missing file .*layer_2/detector\.safetensors"):
        SafetyGuard.from_pretrained(repo_id, subfolder="layer_2", cache_dir=hub_cache)


@pytest.mark.parametrize("pickle_path", ["sae/weights.bin", "detector.pt", "extra/state.pkl"])
def test_pickle_files_are_refused(hub_server, hub_cache, repo_id, pickle_path):
    fresh_guard().push_to_hub(repo_id)
    HfApi().create_commit(repo_id, [CommitOperationAdd(pickle_path, b"\x80\x04pickle")], commit_message="Add a pickle")
    with pytest.raises(ValueError, match=re.escape(pickle_path)):
        SafetyGuard.from_pretrained(repo_id, cache_dir=hub_cache)
    assert not list(hub_cache.glob("*/snapshots/*/*"))  # refused before downloading anything


@pytest.mark.parametrize(
    "version, message", [(2, "format_version 2, expected 1: written by a newer hf-lsad"), (None, "format_version None")]
)
def test_format_version_is_checked(hub_server, hub_cache, repo_id, tmp_path, version, message):
    guard = fresh_guard()
    guard.save_pretrained(tmp_path / "guard")
    config = json.loads((tmp_path / "guard" / "config.json").read_text())
    if version is None:
        del config["format_version"]
    else:
        config["format_version"] = version
    guard.push_to_hub(repo_id)
    HfApi().upload_file(path_or_fileobj=json.dumps(config).encode(), path_in_repo="config.json", repo_id=repo_id)
    with pytest.raises(GuardFormatError, match=message):
        SafetyGuard.from_pretrained(repo_id, cache_dir=hub_cache)


# --- base model check ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "huggingfacetb/smollm2-135m-instruct", True),  # Hub ids ignore case
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "/data/models/HuggingFaceTB/SmolLM2-135M-Instruct/", True),
        (
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "/cache/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/" + "a" * 40,
            True,
        ),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct", False),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "/data/models/SmolLM2-135M-Instruct", False),  # other parent
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "other-org/SmolLM2-135M-Instruct", False),
        ("gpt2", "openai-community/gpt2", True),  # a namespace-less id: last components only
        ("tiny-llama", "/tmp/pytest-7/tiny-llama", True),
        ("tiny-llama", "C:\\models\\tiny-llama", True),
        ("tiny-llama", "/tmp/pytest-7/model", False),
        ("tiny-llama", "", None),  # an unnamed model (from_config): nothing to compare
        ("", "HuggingFaceTB/SmolLM2-135M-Instruct", None),
    ],
)
def test_same_base_model(a, b, same):
    assert same_base_model(a, b) is same
    assert same_base_model(b, a) is same


def test_base_model_key():
    assert base_model_key("./models/Org/Name/") == "org/name"
    assert base_model_key("/x/models--Org--Name/snapshots/abc/") == "org/name"
    assert base_model_key("") == ""


def test_base_model_mismatch_is_refused_unless_overridden(hub_server, hub_cache, repo_id, tmp_path):
    guard = fresh_guard()  # fitted on "tiny-llama"
    commit = guard.push_to_hub(repo_id)
    other = save_tiny_model(tmp_path / "other-llama")
    kwargs = dict(guard=repo_id, guard_kwargs={"revision": commit.oid, "cache_dir": hub_cache})

    with pytest.raises(
        ValueError, match=r"fitted on base model 'tiny-llama'.*model to guard is '.*other-llama'"
    ) as err:
        GuardedModelForCausalLM.from_pretrained(other, **kwargs)
    assert "allow_base_model_mismatch=True" in str(err.value)
    with pytest.warns(UserWarning, match=r"'tiny-llama'.*other-llama.*using it anyway"):
        guarded = GuardedModelForCausalLM.from_pretrained(other, allow_base_model_mismatch=True, **kwargs)
    assert guarded.guard.config == guard.config

    # The constructor has the same switch; an unnamed model (from_config) is not checked.
    model, _ = tiny_model("llama")
    model.config.name_or_path = "someone/else"
    with pytest.raises(ValueError, match=r"'tiny-llama'.*'someone/else'"):
        GuardedModelForCausalLM(model, guard)
    with pytest.warns(UserWarning, match="'someone/else'"):
        GuardedModelForCausalLM(model, guard, allow_base_model_mismatch=True)
    model.config.name_or_path = ""
    GuardedModelForCausalLM(model, guard)


def test_shape_mismatches_stay_errors_with_the_override():
    guard = fresh_guard()
    model, _ = tiny_model("llama")
    model.config.name_or_path = "someone/else"
    guard.config.hook.num_hidden_layers = 12
    with pytest.raises(ValueError, match=r"12 decoder layers.*has 4"):
        GuardedModelForCausalLM(model, guard, allow_base_model_mismatch=True)
    guard = fresh_guard()
    guard.config.hook.hidden_size = 48
    with pytest.raises(ValueError, match="hidden size 48"):
        guard.config.hook.check_model(model, allow_base_model_mismatch=True)


def test_the_recorded_base_model_is_matched(tmp_path):
    """A guard fitted on a model loaded from a folder records that path, and the same folder matches it."""
    folder = save_tiny_model(tmp_path / "tiny-llama")
    model, _ = tiny_model("llama")
    model = type(model).from_pretrained(folder)
    hook = HookPoint.from_model(model, LAYER, "response_last")
    assert hook.base_model == str(folder)
    hook.check_model(model)


# --- guarded generation from the Hub ---------------------------------------------------------------------------


def test_guarded_model_from_local_model_and_hub_guard(hub_server, hub_cache, repo_id, tmp_path):
    model, tokenizer, guard = tiny_guard()
    commit = guard.push_to_hub(repo_id, subfolder="layer_2")
    folder = save_tiny_model(tmp_path / "tiny-llama")

    guarded = GuardedModelForCausalLM.from_pretrained(
        folder, guard=repo_id, guard_kwargs={"revision": commit.oid, "subfolder": "layer_2", "cache_dir": hub_cache}
    )
    assert guarded.model.config.name_or_path == str(folder)
    inputs = encode_prompts(tokenizer, MIXED_BATCH)
    output = guarded.generate(**inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)

    reference = GuardedModelForCausalLM(model, guard)
    expected = reference.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(output.sequences, expected)
    assert len(output.safety) == len(reference.last_safety) == len(MIXED_BATCH)
    for got, want in zip(output.safety, reference.last_safety):  # the reloaded model uses sdpa, the tiny one eager
        assert got.score == pytest.approx(want.score, abs=1e-5) and got.threshold == want.threshold
        assert (got.cluster, got.flagged) == (want.cluster, want.flagged)


# --- model card ------------------------------------------------------------------------------------------------


def test_model_card_validates_and_renders_metrics(hub_server, hub_cache, repo_id):
    guard = fresh_guard()
    guard.push_to_hub(repo_id, metrics=METRICS, datasets=["org/safe-prompts"], license="mit")
    readme = Path(hf_hub_download(repo_id, "README.md", cache_dir=hub_cache)).read_text()
    card = ModelCard(readme)
    hub_server.log.clear()
    card.validate()  # the Hub's metadata check, POST /api/validate-yaml
    assert hub_server.log == ["POST /api/validate-yaml"]

    metadata = yaml.safe_load(readme.split("---")[1])
    assert metadata == {
        "library_name": "hf-lsad",
        "base_model": "tiny-llama",
        "tags": GUARD_TAGS,
        "license": "mit",
        "datasets": ["org/safe-prompts"],
    }
    assert card.data.library_name == "hf-lsad" and card.data.base_model == "tiny-llama"

    lines = readme.splitlines()
    header = lines.index("| Category | AUROC | TPR@5%FPR | Flagged at threshold |")
    assert lines[header + 1 : header + 4] == [
        "|---|---:|---:|---:|",
        "| harmful | 0.9731 | 0.8125 | 0.7900 |",
        "| toxic | 0.8800 | 0.5000 | – |",
    ]
    config = guard.config
    assert f"| Threshold | {config.threshold:.6g} (target safe FPR 5%) |" in lines
    assert f"| `kmeans.n_clusters` | `{guard.detector.config.kmeans.n_clusters}` |" in lines
    assert f"| Sparse autoencoder | 32 → {guard.sae.config.d_sae} features |" in lines
    assert f"{config.n_fit} to fit, {config.n_holdout} held out" in readme
    assert "No metrics were measured" not in readme


def test_card_template_ships_inside_the_package():
    """Wheels carry package files only: the template must be reachable from the package."""
    from importlib.resources import files

    from hf_lsad.guard.card import GUARD_CARD_TEMPLATE

    packaged = files("hf_lsad") / "model_cards" / "guard_card.md"
    assert packaged.is_file() and Path(str(packaged)).samefile(GUARD_CARD_TEMPLATE)
    top_level = Path(__file__).resolve().parents[2] / "model_cards" / "guard_card.md"
    assert top_level.read_text() == GUARD_CARD_TEMPLATE.read_text()


def test_model_card_puts_pooled_auroc_next_to_safe_only_auroc():
    from hf_lsad.guard.card import _metrics_table

    header, rows = _metrics_table(
        {"harmful": {"tpr_at_5fpr": 0.5, "pooled_auroc": 0.8, "auroc": 0.9}, "benign_ood": {"flagged": 0.2}}
    )
    assert header == ["AUROC", "AUROC, safe + benign-OOD negatives", "TPR@5%FPR", "Flagged at threshold"]
    assert rows == [("harmful", ["0.9000", "0.8000", "0.5000", "–"]), ("benign_ood", ["–", "–", "–", "0.2000"])]


def test_model_card_without_metrics_says_so(tmp_path):
    guard = fresh_guard()
    card = guard_model_card(guard.parts())
    assert "No metrics were measured for this guard" in card.text and "| Category |" not in card.text
    assert "The uploader did not describe the prompts" in card.text
    guard.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "README.md").exists()  # no card without metrics or data
    guard.save_pretrained(tmp_path / "described", data="96 prompts about arithmetic and the weather.")
    saved = ModelCard.load(tmp_path / "described" / "README.md")
    assert "96 prompts about arithmetic and the weather." in saved.text and "No metrics were measured" in saved.text
    assert (
        SafetyGuard.from_pretrained(tmp_path / "described").config == guard.config
    )  # the card does not get in the way


def raw_activation_guard() -> SafetyGuard:
    """A guard without an SAE (Mahalanobis on the raw residual)."""
    hook = fresh_guard("prompt_last").config.hook
    safe = torch.randn(200, hook.hidden_size, generator=torch.Generator().manual_seed(0))
    return fit_guard(safe, hook, "mahalanobis", MahalanobisConfig(), None, progress=False).guard


def without_holdout_scores(guard: SafetyGuard) -> SafetyGuard:
    """``guard`` as saved before guards kept their held-out scores (no ``threshold.safetensors``)."""
    return SafetyGuard.from_parts(guard.parts()._replace(holdout_scores=None))


def folder_files(path: Path) -> dict[str, bytes]:
    return {f.relative_to(path).as_posix(): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.mark.parametrize(
    "first, second",
    [
        (two_headed_guard, lambda: fresh_guard("prompt_last")),  # a head it lacks
        (lambda: fresh_guard("prompt_last"), raw_activation_guard),  # an SAE it lacks
        (lambda: fresh_guard("prompt_last"), lambda: without_holdout_scores(fresh_guard("prompt_last"))),
        (two_headed_guard, raw_activation_guard),
    ],
    ids=["head", "sae", "holdout-scores", "all"],
)
def test_a_guard_saved_over_another_leaves_none_of_its_files(tmp_path, first, second):
    """Saved over another guard's folder, a guard's folder holds exactly what it holds saved alone: no tensor file
    and no model card of the guard it replaced (a card would describe heads and thresholds the folder lacks, and
    ``hf-lsad push`` uploads the folder's card). A README the user wrote stays."""
    replaced, guard = first(), second()
    replaced.save_pretrained(tmp_path / "folder", data="the guard that is replaced")
    (tmp_path / "folder" / "NOTES.txt").write_text("mine")
    guard.save_pretrained(tmp_path / "folder")
    guard.save_pretrained(tmp_path / "alone")
    assert folder_files(tmp_path / "folder") == {**folder_files(tmp_path / "alone"), "NOTES.txt": b"mine"}
    assert SafetyGuard.from_pretrained(tmp_path / "folder").config == guard.config

    (tmp_path / "folder" / "README.md").write_text("# My notes on this guard\n")  # not a card hf-lsad wrote
    replaced.save_pretrained(tmp_path / "folder")
    assert (tmp_path / "folder" / "README.md").read_text() == "# My notes on this guard\n"


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    "kept, saved, where, failure",
    [  # config.json is the last file written; the SAE is written after the detector
        (two_headed_guard, raw_activation_guard, "hf_lsad.guard.files.write_json", _disk_full),
        (raw_activation_guard, two_headed_guard, "hf_lsad.sae.model.SparseAutoencoder.save_pretrained", _interrupted),
    ],
    ids=["config-disk-full", "sae-interrupted"],
)
def test_a_save_that_fails_leaves_the_guard_that_was_there(tmp_path, monkeypatch, kept, saved, where, failure):
    """``hf-lsad add-head`` and ``set-budget`` save a guard over its own folder. A save that fails while writing
    leaves the folder's guard as it was, loadable, and nothing of the save behind (written in place, the new
    detector beside the old config.json made the folder a guard that no longer loaded)."""
    kept, saved = kept(), saved()
    kept.save_pretrained(tmp_path / "folder", data="the guard that stays")
    before = folder_files(tmp_path / "folder")
    monkeypatch.setattr(where, failure)
    with pytest.raises((OSError, KeyboardInterrupt)):
        saved.save_pretrained(tmp_path / "folder")
    monkeypatch.undo()
    assert folder_files(tmp_path / "folder") == before
    assert sorted(p.name for p in (tmp_path / "folder").iterdir()) == sorted({k.split("/")[0] for k in before})
    loaded = SafetyGuard.from_pretrained(tmp_path / "folder")
    assert loaded.config == kept.config and loaded.head_names == kept.head_names


def test_a_guard_or_an_sae_is_not_saved_over_another_kinds_folder(model_dir, tmp_path):
    """A model folder's ``config.json``, a guard's or an SAE's is not overwritten by another kind's: the save is
    refused before anything is written (a guard saved over a model folder overwrote its config.json)."""
    import shutil

    guard = fresh_guard()
    shutil.copytree(model_dir, tmp_path / "model")
    guard.save_pretrained(tmp_path / "guard")
    guard.sae.save_pretrained(tmp_path / "sae")
    for folder, save, what in [
        ("model", guard.save_pretrained, "a guard"),
        ("sae", guard.save_pretrained, "a guard"),
        ("model", guard.sae.save_pretrained, "an SAE"),
        ("guard", guard.sae.save_pretrained, "an SAE"),
    ]:
        before = folder_files(tmp_path / folder)
        with pytest.raises(FileExistsError, match=f"is not the config of {what}"):
            save(tmp_path / folder)
        assert folder_files(tmp_path / folder) == before, (folder, what)
    guard.sae.save_pretrained(tmp_path / "sae")  # its own kind: saved again


def test_a_guard_saved_again_keeps_its_card(tmp_path):
    guard = two_headed_guard()
    guard.save_pretrained(tmp_path / "folder", data="96 prompts about arithmetic and the weather.")
    card = (tmp_path / "folder" / "README.md").read_bytes()
    SafetyGuard.from_pretrained(tmp_path / "folder").save_pretrained(tmp_path / "folder")  # the guard it describes
    assert (tmp_path / "folder" / "README.md").read_bytes() == card


def test_a_projects_own_readme_is_not_overwritten_by_a_card(tmp_path):
    """A guard saved with its card into a folder holding a README.md of the user's own (``add-head --out .`` in a
    project) overwrote it."""
    guard = two_headed_guard()
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "README.md").write_text("# My project\n\nNotes I keep.\n")
    with pytest.raises(FileExistsError, match=r"README\.md is not a model card hf-lsad wrote"):
        guard.save_pretrained(folder, data="96 prompts about arithmetic and the weather.")
    assert folder_files(folder) == {"README.md": b"# My project\n\nNotes I keep.\n"}  # nothing written
    guard.save_pretrained(folder)  # no card: the README is left alone
    assert (folder / "README.md").read_text() == "# My project\n\nNotes I keep.\n"
    guard.save_pretrained(tmp_path / "guard", data="first")
    guard.save_pretrained(tmp_path / "guard", data="second")  # a card hf-lsad wrote is replaced
    assert "second" in (tmp_path / "guard" / "README.md").read_text()


@pytest.mark.parametrize("flag_rate, warns", [(0.97, True), (0.11, True), (0.10, False), (0.02, False)])
def test_model_card_warns_when_benign_ood_flag_rate_exceeds_ten_percent(flag_rate, warns):
    metrics = {"harmful": {"auroc": 0.99}, "benign_ood": {"flagged": flag_rate}}
    text = guard_model_card(fresh_guard().parts(), metrics=metrics).text
    assert ("**Warning:**" in text) is warns
    assert (f"flags {flag_rate:.0%} of benign out-of-distribution prompts" in text) is warns
    assert "**Warning:**" not in guard_model_card(fresh_guard().parts(), metrics={"harmful": {"auroc": 0.99}}).text


@pytest.mark.parametrize(
    "metrics, error",
    [({"harmful": {"auroc": float("nan")}}, ValueError), ({"harmful": 0.9}, TypeError), ([0.9], TypeError)],
)
def test_model_card_rejects_malformed_metrics(metrics, error):
    with pytest.raises(error):
        guard_model_card(fresh_guard().parts(), metrics=metrics)


def test_model_card_local_base_model_is_not_hub_metadata(tmp_path):
    guard = fresh_guard()
    guard.config.hook.base_model = str(tmp_path / "models" / "my-llama")
    card = guard_model_card(guard.parts(), repo_id="org/name")
    assert card.data.base_model is None and f"`{tmp_path / 'models' / 'my-llama'}` (a local model)" in card.text


def test_model_card_usage_snippet_runs(hub_server, repo_id, tmp_path, monkeypatch):
    """The card's Python snippet, run as it is, loads the base model and the guard and generates."""
    fresh_guard().push_to_hub(repo_id, subfolder="layer_2")
    readme = Path(hf_hub_download(repo_id, "layer_2/README.md")).read_text()
    snippet = python_block(readme)
    save_tiny_model(tmp_path / "tiny-llama")  # the base model "tiny-llama", as a folder in the working directory
    monkeypatch.chdir(tmp_path)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(snippet, "README.md", "exec"), {})
    verdict = stdout.getvalue().splitlines()[-1]  # the report's describe(): the verdict, the score and threshold
    assert re.fullmatch(r"(ok|FLAGGED): score \S+ (<=|>) \S+ \(cluster \d+, p-value \S+\)", verdict), verdict


# --- CLI -------------------------------------------------------------------------------------------------------


def test_cli_fit_pushes_to_the_hub(hub_server, hub_cache, repo_id, tmp_path, capsys):
    _, _, guard = tiny_guard()
    activations = torch.randn(60, 32, generator=torch.Generator().manual_seed(1))
    records = [
        {"id": f"safe-{i}", "source": "bigbench/strategyqa" if i % 3 else "humaneval", "category": "safe"}
        for i in range(60)
    ]
    save_activations(tmp_path / "acts", activations, records, guard.config.hook)
    guard.sae.save_pretrained(tmp_path / "sae")
    cli_main(
        [
            "fit",
            "--activations",
            str(tmp_path / "acts"),
            "--sae",
            str(tmp_path / "sae"),
            "--kmeans.n-clusters",
            "3",
            "--mask-size",
            "16",
            "--out",
            str(tmp_path / "guard"),
            "--push-to-hub",
            repo_id,
            "--subfolder",
            "layer_2",
        ]
    )
    assert f"pushed to {repo_id}/layer_2 at " in capsys.readouterr().out
    pulled = SafetyGuard.from_pretrained(repo_id, subfolder="layer_2", cache_dir=hub_cache)
    assert_same_guard(pulled, SafetyGuard.from_pretrained(tmp_path / "guard"))
    card = ModelCard.load(hf_hub_download(repo_id, "layer_2/README.md", cache_dir=hub_cache))
    assert "60 safe prompts (activation store `acts`), categories `safe` (60)" in card.text
    assert "`bigbench/strategyqa` (40), `humaneval` (20)" in card.text
