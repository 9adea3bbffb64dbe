"""Folder-level Hugging Face Hub I/O for hf-lsad guards.

A guard is a folder: ``config.json``, ``*.safetensors``, maybe subfolders such as ``sae/``
with their own ``config.json`` + ``*.safetensors``, and a ``README.md`` model card. On the
Hub it is the root of a repo or one of its subfolders (several guards can share a repo,
e.g. ``layer_10/`` and ``layer_20/``).

- :func:`resolve_pretrained_dir` turns a local path or a Hub repo id into a local folder,
  downloading only JSON, safetensors and model cards, and refusing folders that hold
  pickle files.
- :func:`upload_pretrained_dir` creates the repo if needed and uploads a folder in one
  commit.

huggingface_hub's typed errors (``RepositoryNotFoundError``, ``RevisionNotFoundError``,
``EntryNotFoundError``, ``LocalEntryNotFoundError``) reach the caller with their type kept.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from huggingface_hub import CommitInfo, HfApi, constants as hf_constants, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RevisionResolutionError,
)
from huggingface_hub.utils import filter_repo_objects

from ..errors import GuardFormatError, UnsafeGuardFileError
from .integrity import PICKLE_SUFFIXES, bounding_folder, check_guard_tree
from .serialization import STAGING_PREFIX, folder_path

__all__ = ["PICKLE_SUFFIXES", "find_pickle_files", "resolve_pretrained_dir", "upload_pretrained_dir"]


def find_pickle_files(paths: Iterable[str | os.PathLike]) -> list[str]:
    """Return, sorted, the entries of ``paths`` whose suffix is one of :data:`PICKLE_SUFFIXES`."""
    return sorted(os.fspath(p) for p in paths if os.fspath(p).lower().endswith(PICKLE_SUFFIXES))


def _normalize_subfolder(subfolder: str) -> str:
    """``"a/b/"``, ``"/a/b"``, ``"a\\b"`` -> ``"a/b"``; ``""`` or ``"."`` -> ``""``."""
    parts = [part for part in subfolder.replace("\\", "/").split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"subfolder must stay inside the guard folder, got {subfolder!r}")
    return "/".join(parts)


def _allow_patterns(subfolder: str, extra: Iterable[str] = ()) -> list[str]:
    """Patterns (huggingface_hub's fnmatch, where ``*`` also matches ``/``) for the files a guard needs."""
    prefix = re.sub(r"([*?\[])", r"[\1]", subfolder) + "/" if subfolder else ""
    names = ["*.json", "*.safetensors", "README.md", "*/README.md", *extra]
    return [prefix + name for name in names]


def _refuse_pickles(files: Iterable[str], where: str) -> None:
    pickles = find_pickle_files(files)
    if pickles:
        raise UnsafeGuardFileError(
            f"Refusing {where}: it holds pickle files, which can run arbitrary code when loaded: "
            f"{', '.join(pickles)}. hf-lsad guards are stored as safetensors and JSON only."
        )


def _refuse_local_pickles(folder: Path) -> None:
    """Pickles, links leaving the folder (or its Hub cache repo) and huge trees are refused
    (:func:`check_guard_tree`)."""
    check_guard_tree(folder, bounding_folder(folder))


def looks_like_path(name: str) -> bool:
    """True for strings that can only be a filesystem path, never a Hub repo id."""
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or name in (".", "..")
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
        or bool(re.match(r"^[A-Za-z]:", name))
    )


def resolve_pretrained_dir(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    subfolder: str = "",
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
    extra_allow_patterns: Iterable[str] = (),
    root_file: str | None = "config.json",
    what: str = "guard",
) -> Path:
    """Return a local folder holding the guard (or ``what``) named by ``name_or_path``.

    A local folder without ``root_file`` at its root (``config.json`` for a guard,
    ``guarded_model.json`` for a saved guarded model) fails at once, without walking it;
    ``None`` for folders whose layout is detected later (public SAEs).

    Args:
        name_or_path: A local directory, or a Hub repo id (``"name"`` or ``"org/name"``).
            An existing local directory wins over a repo id of the same spelling.
        revision: Branch name or commit sha on the Hub (default: the repo's ``main``).
            Ignored for a local directory.
        subfolder: Folder inside the directory / repo that holds the guard (``""``: the root).
        token: Hub token; ``None`` uses the saved or ``HF_TOKEN`` token, ``False`` sends none.
        cache_dir: huggingface_hub cache folder (default: ``HF_HUB_CACHE``).
        local_files_only: Use the cache only, no network (also implied by ``HF_HUB_OFFLINE=1``).
        force_download: Download the files again even if they are cached.
        what: What the folder holds, as the errors name it (``"guard"``, ``"SAE"``, ``"guarded model"``).
        extra_allow_patterns: More file patterns (relative to ``subfolder``, e.g. ``"params.npz"``
            for a Gemma Scope SAE) to download besides JSON, safetensors and model cards. A
            pickle suffix is refused here too: such a file is never downloaded.

    Returns:
        For a local directory, ``Path(name_or_path) / subfolder`` as given. For a repo id,
        the subfolder of the cached snapshot (``<cache>/models--org--name/snapshots/<sha>/...``)
        holding the subfolder's ``*.json``, ``*.safetensors`` and ``README.md`` files,
        recursively. Nothing else of the repo is downloaded.

    Raises:
        FileNotFoundError: A local path (or its subfolder) that does not exist.
        hf_lsad.GuardFormatError: A local folder without ``config.json`` at its root (checked
            before walking it), or with more than ``MAX_GUARD_ENTRIES`` entries.
        hf_lsad.UnsafeGuardFileError: The folder, or the repo subfolder at that revision, holds
            pickle files (:data:`PICKLE_SUFFIXES`; checked on the Hub listing before anything is
            downloaded), or links that resolve outside it (or loop); the message names them.
        huggingface_hub.errors.RepositoryNotFoundError: No such repo (or no access to it).
        huggingface_hub.errors.RevisionNotFoundError: No such branch or commit in the repo.
        huggingface_hub.errors.RevisionResolutionError: No local folder of that name, and the Hub could not be
            reached (nor the revision found in the cache).
        huggingface_hub.errors.EntryNotFoundError: The repo has no such subfolder, or it holds
            no JSON / safetensors file, at that revision.
        huggingface_hub.errors.LocalEntryNotFoundError: ``local_files_only`` (or offline) and
            the guard is not in the cache.
    """
    sub = _normalize_subfolder(subfolder)
    extra_allow_patterns = tuple(extra_allow_patterns)
    _refuse_pickles(extra_allow_patterns, "extra_allow_patterns")
    path = folder_path(name_or_path, "name_or_path").expanduser()
    name = os.fspath(name_or_path)
    if path.is_dir():
        folder = path / sub if sub else path
        if not folder.is_dir():
            raise FileNotFoundError(f"No subfolder '{sub}' in local {what} directory '{path}' (no '{folder}')")
        if root_file is not None and not (folder / root_file).exists() and not (folder / root_file).is_symlink():
            # Fail fast: do not walk a folder that is not a guard (e.g. "/usr").
            raise GuardFormatError(f"'{folder}' is not a {what} folder: it has no {root_file} at its root")
        _refuse_local_pickles(folder)
        return folder
    if path.exists() or looks_like_path(name):
        what_dir = what[:1].upper() + what[1:] + " directory"
        raise FileNotFoundError(f"{what_dir} '{name}' does not exist (or is not a directory)")

    repo_id, where = name, f"'{name}'" + (f", subfolder '{sub}'" if sub else "")
    cache = None if cache_dir is None else folder_path(cache_dir, "cache_dir")
    allow_patterns = _allow_patterns(sub, extra_allow_patterns)
    if local_files_only or hf_constants.is_offline_mode():
        try:
            snapshot = Path(
                snapshot_download(
                    repo_id,
                    revision=revision,
                    cache_dir=cache,
                    token=token,
                    allow_patterns=allow_patterns,
                    local_files_only=True,
                )
            )
        except LocalEntryNotFoundError as err:
            raise LocalEntryNotFoundError(
                f"hf-lsad {what} {where} at revision '{revision or 'main'}' is not in the cache, and "
                f"local_files_only / HF_HUB_OFFLINE forbids downloading it: {err}"
            ) from err
        folder = snapshot / sub if sub else snapshot
        if not folder.is_dir():
            raise LocalEntryNotFoundError(f"hf-lsad {what} {where} is not in the cached snapshot '{snapshot}'")
        _refuse_local_pickles(folder)
        return folder

    api = HfApi(token=token)
    try:
        # Pin the revision once, so the listing checked here and the files downloaded are one commit.
        resolved = api.resolve_revision(repo_id, revision=revision, cache_dir=cache)
        repo_files = api.list_repo_files(repo_id, revision=resolved.resolved)
    except HfHubHTTPError as err:
        err.append_to_message(f"\nCould not load hf-lsad {what} {where} at revision '{revision or 'main'}'.")
        raise
    except RevisionResolutionError as err:  # the Hub unreachable: most often a local folder's name mistyped
        raise RevisionResolutionError(
            f"Could not load hf-lsad {what} {where}: there is no local folder '{name}', and the Hub could not be "
            f"reached to find a repo of that name at revision '{revision or 'main'}' ({err})"
        ) from err
    at = f"{where} at revision '{revision or 'main'}' ({resolved.resolved})"
    in_sub = [f for f in repo_files if not sub or f.startswith(sub + "/")]
    if not in_sub:
        raise EntryNotFoundError(
            f"Hub repo '{repo_id}' has no subfolder '{sub}' at revision '{revision or 'main'}' ({resolved.resolved})"
        )
    _refuse_pickles(in_sub, f"Hub {what} {at}")
    if not any(filter_repo_objects(in_sub, allow_patterns=allow_patterns)):
        wanted = " or ".join(["*.json", "*.safetensors", *extra_allow_patterns])
        raise EntryNotFoundError(f"Hub {what} {at} holds no {wanted} file: {', '.join(in_sub)}")
    snapshot = Path(
        snapshot_download(
            repo_id,
            revision=resolved,
            cache_dir=cache,
            token=token,
            allow_patterns=allow_patterns,
            force_download=force_download,
        )
    )
    folder = snapshot / sub if sub else snapshot
    _refuse_local_pickles(folder)  # the downloaded files must be links into this repo's blobs
    return folder


def upload_pretrained_dir(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    subfolder: str = "",
    commit_message: str = "Upload hf-lsad guard",
    revision: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    create_pr: bool = False,
    delete_stale: bool = False,
) -> CommitInfo:
    """Upload a guard folder to a Hub repo in one commit, creating the repo if needed.

    Args:
        folder: Local guard folder (as written by ``save_pretrained``).
        repo_id: Target repo, ``"name"`` (in the token owner's namespace) or ``"org/name"``.
        subfolder: Path in the repo to upload under (``""``: the repo root).
        commit_message: Commit summary.
        revision: Branch to commit to (default ``main``); created from ``main`` if missing.
        private: Visibility if the repo is created (``None``: the Hub default). An existing
            repo's visibility is left as it is.
        token: Hub token; ``None`` uses the saved or ``HF_TOKEN`` token.
        create_pr: Open a pull request against ``main`` instead of committing to it.
        delete_stale: Also delete files under ``subfolder`` in the repo that ``folder`` does not
            have (e.g. a ``calibration.json`` from an older version of the guard). With
            ``subfolder=""`` that means every other file of the repo (``.gitattributes`` is kept).

    The folders of saves into ``folder`` (in progress, or left by a killed save: their files are partial) are left
    out.

    Returns:
        The commit's :class:`huggingface_hub.CommitInfo`, a ``str`` equal to the commit URL;
        ``.oid`` is the commit sha and ``.pr_url`` the pull request URL when ``create_pr``.

    Raises:
        FileNotFoundError: ``folder`` is not a directory.
        hf_lsad.UnsafeGuardFileError: ``folder`` holds pickle files (:data:`PICKLE_SUFFIXES`) or links leaving it.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"Guard directory '{folder}' does not exist (or is not a directory)")
    _refuse_local_pickles(folder)
    sub = _normalize_subfolder(subfolder)
    api = HfApi(token=token)
    repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
    repo_id = repo_url.repo_id  # "name" -> "user/name"
    if revision not in (None, hf_constants.DEFAULT_REVISION) and not create_pr:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        path_in_repo=sub or None,
        commit_message=commit_message,
        revision=revision,
        create_pr=create_pr,
        delete_patterns="*" if delete_stale else None,
        ignore_patterns=f"{STAGING_PREFIX}*",  # a save in progress, or one a kill left (its files are partial)
    )
