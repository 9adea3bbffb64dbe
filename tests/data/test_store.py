"""The activation store: what is written is read back, in one piece or in batches, and a store folder that is not
one hf-lsad wrote fails on open with an error naming the file and the key."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hf_lsad.core.hook_point import HookPoint
from hf_lsad.data.store import INDEX, ActivationStore, load_activations, save_activations
from hf_lsad.errors import GuardFormatError

HOOK = HookPoint("tiny/model", "llama", 4, 4, 1, "model.layers.1", "prompt_last")


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def records(n: int) -> list[dict]:
    return [{"id": f"p{i}", "source": "test"} for i in range(n)]


def test_a_store_round_trips_whole_and_in_batches_across_shards(tmp_path):
    activations = rows(25)
    save_activations(tmp_path / "store", activations, records(25), HOOK, shard_size=10)
    assert sorted(f.name for f in (tmp_path / "store").iterdir()) == [
        INDEX,
        "shard-00000.safetensors",
        "shard-00001.safetensors",
        "shard-00002.safetensors",
    ]
    loaded = load_activations(tmp_path / "store")
    assert torch.equal(loaded.activations, activations) and loaded.records == records(25) and loaded.hook == HOOK
    store = ActivationStore(tmp_path / "store")
    picked = torch.tensor([0, 9, 10, 11, 24])  # across the three shards
    assert len(store) == 25 and torch.equal(store.take(picked), activations[picked])


def test_a_store_saved_over_a_larger_one_leaves_none_of_its_shards(tmp_path):
    save_activations(tmp_path / "store", rows(25), records(25), HOOK, shard_size=10)
    (tmp_path / "store" / "notes.txt").write_text("mine")
    save_activations(tmp_path / "store", rows(8, seed=1), records(8), HOOK, shard_size=10)
    assert sorted(f.name for f in (tmp_path / "store").iterdir()) == [INDEX, "notes.txt", "shard-00000.safetensors"]
    assert torch.equal(load_activations(tmp_path / "store").activations, rows(8, seed=1))


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_store_whose_save_over_it_fails_is_the_store_that_was_there(tmp_path, monkeypatch, failure):
    """collect run again over its own --out, at another layer, failing at the index: the new layer's activations were
    read under the old index, which names the old layer (the shapes agree)."""
    store = tmp_path / "store"
    save_activations(store, rows(25), records(25), HOOK, shard_size=10)
    before = {file.name: file.read_bytes() for file in store.iterdir()}

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr("hf_lsad.data.store.write_json", fail)  # the disk fills at the index, the last file
    deeper = dataclasses.replace(HOOK, layer=2, layer_module="model.layers.2")
    with pytest.raises(type(failure)):
        save_activations(store, rows(25, seed=1), records(25), deeper, shard_size=10)
    assert {file.name: file.read_bytes() for file in store.iterdir()} == before
    assert torch.equal(load_activations(store).activations, rows(25))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda index: index.pop("records"), r"missing key\(s\) \['records'\]"),
        (lambda index: index.update(extra=1), r"unknown key\(s\) \['extra'\]"),
        (lambda index: index.update(format_version=True), "format_version True"),
        (lambda index: index.update(format_version=2), "format_version 2, expected 1: written by a newer hf-lsad"),
        (lambda index: index.update(shards=[]), "'shards' must be a non-empty list"),
        (lambda index: index["shards"][0].update(file="../other/shard-00000.safetensors"), "not a shard-NNNNN"),
        (lambda index: index["shards"][0].update(rows="25"), r"shards\[0\]: key 'rows' is '25' \(str\)"),
        (lambda index: index["shards"][0].pop("rows"), r"shards\[0\]: missing config key\(s\) \['rows'\]"),
        (lambda index: index.update(records=["p0"] * 25), "'records' must be a list of JSON objects"),
        (lambda index: index["hook"].update(hidden_size=5), "shape"),
        (lambda index: index.update(records=records(24)), "25 rows but 24 records"),
    ],
    ids=[
        "missing-key",
        "unknown-key",
        "version-bool",
        "version-newer",
        "no-shards",
        "shard-elsewhere",
        "rows-text",
        "rows-missing",
        "records-text",
        "hook-width",
        "records-short",
    ],
)
@pytest.mark.parametrize("reader", [load_activations, ActivationStore], ids=["load_activations", "ActivationStore"])
def test_a_store_index_is_read_strictly(tmp_path, change, message, reader):
    save_activations(tmp_path / "store", rows(25), records(25), HOOK)
    index = json.loads((tmp_path / "store" / INDEX).read_text())
    change(index)
    (tmp_path / "store" / INDEX).write_text(json.dumps(index))
    with pytest.raises(GuardFormatError, match=message):
        reader(tmp_path / "store")


@pytest.mark.parametrize(
    "activations, entries, error, message",
    [
        (torch.full((3, 4), float("nan")), records(3), ValueError, "NaN or inf"),
        (rows(3), records(2), ValueError, "2 records for 3 activation rows"),
        (rows(3), ["p0", "p1", "p2"], TypeError, "each record must be a dict"),
        (rows(3)[:, :3], records(3), ValueError, "expected hidden size 4"),
    ],
)
def test_a_store_refuses_what_it_could_not_read_back(tmp_path, activations, entries, error, message):
    with pytest.raises(error, match=message):
        save_activations(tmp_path / "store", activations, entries, HOOK)
    assert not (tmp_path / "store").exists()  # nothing half written
