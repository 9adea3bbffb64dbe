"""Hub round trips of guard folders: the real huggingface_hub client against tests/hub_server.py."""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import CommitOperationAdd, HfApi, constants, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)
from huggingface_hub.utils import get_session
from safetensors.numpy import save_file

from hf_lsad.core.hub import resolve_pretrained_dir, upload_pretrained_dir

# huggingface_hub's legacy LFS upload (the path taken with HF_HUB_DISABLE_XET=1) PUTs with `data=`, which httpx2
# deprecates; that is the client's business, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

README = "---\nlibrary_name: hf-lsad\ntags:\n- safety\n---\n# A test guard\n"


def make_guard(folder: Path, seed: int = 0) -> Path:
    """A guard-shaped folder: config.json, README.md, detector.safetensors, sae/{config.json,sae.safetensors}."""
    rng = np.random.default_rng(seed)
    (folder / "sae").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"format_version": 1, "seed": seed}))
    (folder / "README.md").write_text(README)
    save_file({"centroids": rng.standard_normal((64, 128), dtype=np.float32)}, folder / "detector.safetensors")
    (folder / "sae" / "config.json").write_text(json.dumps({"d_model": 32, "d_sae": 64}))
    save_file({"W_enc": rng.standard_normal((32, 64), dtype=np.float32)}, folder / "sae" / "sae.safetensors")
    return folder


def contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def repo_id(hub_server) -> str:
    return f"hf-lsad-org/guard-{uuid.uuid4().hex[:8]}"


def test_upload_then_download_round_trip(hub_server, hub_cache, repo_id, tmp_path):
    guard = make_guard(tmp_path / "guard")
    hub_server.log.clear()
    commit = upload_pretrained_dir(guard, repo_id)

    assert HfApi().repo_info(repo_id).sha == commit.oid
    assert commit == f"{hub_server.url}/{repo_id}/commit/{commit.oid}"
    # The safetensors files took the LFS path (batch, PUT, verify), the JSON / README did not.
    assert f"POST /{repo_id}.git/info/lfs/objects/batch" in hub_server.log
    assert sum(line.startswith("PUT /lfs/upload/") for line in hub_server.log) == 2
    tree = {f.path: f for f in HfApi().list_repo_tree(repo_id, recursive=True) if hasattr(f, "lfs")}
    assert tree["detector.safetensors"].lfs is not None and tree["sae/sae.safetensors"].lfs is not None
    assert tree["config.json"].lfs is None and tree["README.md"].lfs is None

    local = resolve_pretrained_dir(repo_id, cache_dir=hub_cache)
    assert local.is_relative_to(hub_cache) and local.name == commit.oid
    assert contents(local) == contents(guard)


def test_a_saves_folder_is_not_pushed(hub_server, repo_id, tmp_path):
    """A save in progress, or one a kill left, has its own folder of partial files in the guard folder."""
    guard = make_guard(tmp_path / "guard")
    staging = guard / ".hf-lsad-saving-abc123"
    staging.mkdir()
    (staging / "detector.safetensors").write_bytes(b"partial")
    upload_pretrained_dir(guard, repo_id)
    pushed = {f.path for f in HfApi().list_repo_tree(repo_id, recursive=True)}
    assert "detector.safetensors" in pushed and not any(".hf-lsad-saving" in path for path in pushed), pushed


def test_older_revision_by_commit_sha(hub_server, hub_cache, repo_id, tmp_path):
    first = upload_pretrained_dir(make_guard(tmp_path / "v1", seed=1), repo_id)
    v2 = make_guard(tmp_path / "v2", seed=2)
    second = upload_pretrained_dir(v2, repo_id, commit_message="Refit")
    assert first.oid != second.oid

    old = resolve_pretrained_dir(repo_id, revision=first.oid, cache_dir=hub_cache)
    assert contents(old) == contents(tmp_path / "v1")
    latest = resolve_pretrained_dir(repo_id, cache_dir=hub_cache)
    assert latest.name == second.oid and contents(latest) == contents(v2)


def test_two_guards_in_subfolders(hub_server, hub_cache, repo_id, tmp_path):
    guard_10 = make_guard(tmp_path / "g10", seed=10)
    guard_20 = make_guard(tmp_path / "g20", seed=20)
    upload_pretrained_dir(guard_10, repo_id, subfolder="layer_10")
    upload_pretrained_dir(guard_20, repo_id, subfolder="layer_20/")

    local_10 = resolve_pretrained_dir(repo_id, subfolder="layer_10", cache_dir=hub_cache)
    assert local_10.name == "layer_10" and contents(local_10) == contents(guard_10)
    assert not (local_10.parent / "layer_20").exists()  # only the asked subfolder was fetched
    local_20 = resolve_pretrained_dir(repo_id, subfolder="layer_20", cache_dir=hub_cache)
    assert contents(local_20) == contents(guard_20)
    with pytest.raises(EntryNotFoundError, match="layer_1"):  # a prefix of layer_10 is not a folder
        resolve_pretrained_dir(repo_id, subfolder="layer_1", cache_dir=hub_cache)


def test_typed_errors(hub_server, hub_cache, repo_id, tmp_path):
    upload_pretrained_dir(make_guard(tmp_path / "guard"), repo_id)
    with pytest.raises(RepositoryNotFoundError):
        resolve_pretrained_dir("hf-lsad-org/no-such-guard", cache_dir=hub_cache)
    with pytest.raises(RevisionNotFoundError):
        resolve_pretrained_dir(repo_id, revision="no-such-branch", cache_dir=hub_cache)
    with pytest.raises(RevisionNotFoundError):
        resolve_pretrained_dir(repo_id, revision="0" * 40, cache_dir=hub_cache)
    with pytest.raises(EntryNotFoundError, match="no-such-layer"):
        resolve_pretrained_dir(repo_id, subfolder="no-such-layer", cache_dir=hub_cache)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(repo_id, "no-such-file.json", cache_dir=hub_cache)
    assert not list(hub_cache.glob("*/snapshots/*/*"))  # nothing was downloaded


def test_pickles_are_refused(hub_server, hub_cache, repo_id, tmp_path):
    guard = make_guard(tmp_path / "guard")
    upload_pretrained_dir(guard, repo_id, subfolder="clean")
    upload_pretrained_dir(guard, repo_id, subfolder="dirty")
    HfApi().create_commit(
        repo_id, [CommitOperationAdd("dirty/sae/weights.bin", b"\x80\x04pickle")], commit_message="Add a pickle"
    )

    with pytest.raises(ValueError, match=r"dirty/sae/weights\.bin"):
        resolve_pretrained_dir(repo_id, subfolder="dirty", cache_dir=hub_cache)
    assert not list(hub_cache.glob("*/snapshots/*/*"))  # refused before downloading anything
    assert contents(resolve_pretrained_dir(repo_id, subfolder="clean", cache_dir=hub_cache)) == contents(guard)

    (guard / "extra.pt").write_bytes(b"\x80\x04")  # local folders are checked too, both ways
    with pytest.raises(ValueError, match=r"extra\.pt"):
        resolve_pretrained_dir(guard)
    with pytest.raises(ValueError, match=r"extra\.pt"):
        upload_pretrained_dir(guard, repo_id)


def test_local_files_only(hub_server, hub_cache, repo_id, tmp_path):
    guard = make_guard(tmp_path / "guard")
    upload_pretrained_dir(guard, repo_id, subfolder="layer_10")
    with pytest.raises(LocalEntryNotFoundError):
        resolve_pretrained_dir(repo_id, subfolder="layer_10", cache_dir=hub_cache, local_files_only=True)

    online = resolve_pretrained_dir(repo_id, subfolder="layer_10", cache_dir=hub_cache)
    hub_server.log.clear()
    offline = resolve_pretrained_dir(repo_id, subfolder="layer_10", cache_dir=hub_cache, local_files_only=True)
    assert offline == online and contents(offline) == contents(guard)
    assert hub_server.log == []  # no request at all
    with pytest.raises(LocalEntryNotFoundError):  # another subfolder was never cached
        resolve_pretrained_dir(repo_id, subfolder="layer_20", cache_dir=hub_cache, local_files_only=True)


def test_a_name_that_is_no_folder_with_the_hub_unreachable_says_both(tmp_path, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RevisionResolutionError, match="no local folder 'my-guard', and the Hub could not be reached"):
        resolve_pretrained_dir("my-guard", cache_dir=tmp_path / "cache")
    with pytest.raises(RevisionResolutionError, match="Could not load hf-lsad SAE 'my-sae': there is no local folder"):
        resolve_pretrained_dir("my-sae", cache_dir=tmp_path / "cache", what="SAE")


def test_local_directories(tmp_path):
    guard = make_guard(tmp_path / "guard")
    assert resolve_pretrained_dir(guard) == guard
    assert resolve_pretrained_dir(str(guard), subfolder="sae") == guard / "sae"
    with pytest.raises(FileNotFoundError, match="layer_10"):
        resolve_pretrained_dir(guard, subfolder="layer_10")
    with pytest.raises(FileNotFoundError, match="missing-guard"):
        resolve_pretrained_dir(tmp_path / "missing-guard")


def test_upload_options(hub_server, repo_id, tmp_path):
    guard = make_guard(tmp_path / "guard")
    (guard / "calibration.json").write_text("{}")
    upload_pretrained_dir(guard, repo_id, subfolder="layer_10")
    (guard / "calibration.json").unlink()
    api = HfApi()

    # A file the folder no longer has stays in the repo, unless delete_stale is set.
    upload_pretrained_dir(guard, repo_id, subfolder="layer_10", commit_message="no-op")
    assert "layer_10/calibration.json" in api.list_repo_files(repo_id)
    upload_pretrained_dir(guard, repo_id, subfolder="layer_10", delete_stale=True)
    assert "layer_10/calibration.json" not in api.list_repo_files(repo_id)

    branch = upload_pretrained_dir(guard, repo_id, revision="experiment")
    assert api.repo_info(repo_id, revision="experiment").sha == branch.oid != api.repo_info(repo_id).sha
    pr = upload_pretrained_dir(make_guard(tmp_path / "v2", seed=3), repo_id, create_pr=True)
    assert pr.pr_url.endswith("/discussions/1") and pr.pr_revision == "refs/pr/1"

    name_only = upload_pretrained_dir(guard, f"plain-{uuid.uuid4().hex[:6]}")  # the token owner's namespace
    assert name_only.repo_url.repo_id.startswith("test-user/")


def test_server_protocol_details(hub_server, repo_id, tmp_path):
    """What the client relies on beyond the happy path: stale parents, Range requests."""
    api = HfApi()
    first = upload_pretrained_dir(make_guard(tmp_path / "guard"), repo_id)
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="extra.json", repo_id=repo_id)
    with pytest.raises(HfHubHTTPError) as err:
        api.create_commit(
            repo_id, [CommitOperationAdd("x.json", b"{}")], commit_message="stale", parent_commit=first.oid
        )
    assert err.value.response.status_code == 412

    url = f"{hub_server.url}/{repo_id}/resolve/{first.oid}/detector.safetensors"
    full = get_session().get(url).content
    part = get_session().get(url, headers={"Range": "bytes=8-15"})
    assert part.status_code == 206 and part.content == full[8:16]
    head = get_session().head(url)
    assert head.headers["X-Repo-Commit"] == first.oid and int(head.headers["X-Linked-Size"]) == len(full)
