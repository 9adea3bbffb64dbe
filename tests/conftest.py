"""Shared pytest fixtures.

Hub round trips run against `tests/hub_server.py`, a local Hub-compatible server, with the
real huggingface_hub client. huggingface_hub reads HF_ENDPOINT, HF_HUB_DISABLE_XET and the
cache location when it is imported, so they are set here, at conftest import time, before
any test module imports it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # works with any pytest import mode
from hub_server import HubServer  # the standard library only: safe before the environment below


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


HUB_PORT = _free_port()
_HF_HOME = tempfile.mkdtemp(prefix="hf-lsad-tests-hf-home-")  # never touch the user's cache or token
atexit.register(shutil.rmtree, _HF_HOME, ignore_errors=True)
os.environ.update(
    HF_ENDPOINT=f"http://127.0.0.1:{HUB_PORT}",
    HF_HUB_DISABLE_XET="1",  # uploads take the plain LFS path, which the test server speaks
    HF_HUB_DISABLE_TELEMETRY="1",
    HF_HUB_DISABLE_PROGRESS_BARS="1",
    HF_TOKEN="hf_test_token",  # any token: the server only checks that one is sent
    HF_HOME=_HF_HOME,
    HF_HUB_CACHE=os.path.join(_HF_HOME, "hub"),
    NO_PROXY=",".join(filter(None, ["127.0.0.1,localhost", os.environ.get("NO_PROXY")])),
)
for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_LSAD_CACHE"):  # converted GGUF models go under HF_HOME
    os.environ.pop(_name, None)

# pytest-xdist runs the suite in several processes (pyproject's addopts); each takes its share of the cores for torch's
# threads, set before torch is imported, or their thread pools contend for every core (the suite ran slower on two
# processes than on one)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _CORES // _WORKERS)))


@pytest.fixture(scope="session")
def hub_server(tmp_path_factory: pytest.TempPathFactory):
    """A running Hub-compatible server at HF_ENDPOINT, shared by the whole session."""
    server = HubServer(tmp_path_factory.mktemp("hub-server"), HUB_PORT).start()
    yield server
    server.stop()


@pytest.fixture
def hub_cache(tmp_path: Path) -> Path:
    """A fresh, empty huggingface_hub cache dir (pass it as `cache_dir=`)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    return cache


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny seeded Llama saved as a model folder, what a user passes as ``--model``; its name,
    ``tiny-llama``, is the tiny guards' base model."""
    from hf_lsad.testing import tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    model, tokenizer = tiny_model("llama", seed=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
