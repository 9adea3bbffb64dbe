"""The bundled rows' activations kept in a cache (:func:`hf_lsad.guard.heads.bundled.bundled_features`): read
without the model, checked against the prompts' text and the reads, resumed after an interruption."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from tiny import ROWS_PER_POOL, SHOP_TURN, SHORT_POOLS, tiny_guard, two_headed_guard

from hf_lsad.capture.collect import collect_prompt_features
from hf_lsad.capture.resumable import PARTIAL, read_folder
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.data.store import load_activations, save_activations
from hf_lsad.guard.heads import bundled
from hf_lsad.guard.heads.bundled import bundled_features, cache_record, release_rows


@contextlib.contextmanager
def forward_passes(model, interrupt_at: int | None = None):
    """Count the forward passes of ``model`` (one for the opening every prompt shares, then one per batch),
    interrupting the ``interrupt_at``-th as Ctrl-C does."""
    passes: list[int] = []

    def count(*_):
        passes.append(1)
        if len(passes) == interrupt_at:
            raise KeyboardInterrupt

    handle = model.model.layers[0].register_forward_pre_hook(count)
    try:
        yield passes
    finally:
        handle.remove()


def fit_prompts():
    return [p for pool in SHORT_POOLS for p in release_rows(pool, "fit")[:ROWS_PER_POOL]]


def test_a_cache_written_from_other_stores_with_cache_records_is_read_without_the_model(tmp_path):
    """A study writes teach's cache from the stores hf-lsad collect wrote; the records are the cache's own."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    collected, inputs = collect_prompt_features(model, tokenizer, [p.text for p in prompts], reads, progress=False)
    cache = tmp_path / "cache"
    records = [cache_record(p) for p in prompts]
    for read in reads:
        marked = collected[read] + 1.0  # activations no forward pass gives: read back, they show the cache was read
        save_activations(cache / read_folder(read), marked, records, HookPoint.from_model(model, *read), inputs=inputs)
    with forward_passes(model) as passes:
        features = bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, progress=False)
    assert not passes
    assert all(torch.equal(features[read], collected[read] + 1.0) for read in reads)
    record = cache_record(prompts[0])
    assert set(record) == {"id", "digest", "source", "category"} and record["id"] == prompts[0].id
    changed = prompts[0]._replace(text=prompts[0].text + " (edited)")
    with pytest.raises(ValueError, match="different"):  # a store written when a prompt's text was other
        bundled_features(model, tokenizer, [changed, *prompts[1:]], reads, cache_dir=cache, progress=False)


def test_a_collection_into_a_cache_another_run_is_collecting_into_is_refused(tmp_path):
    """Two runs on one cache each collected what the other had not written yet, and the first to finish removed the
    other's parts."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    cache = tmp_path / "cache"
    refused: list[str] = []

    def second_run(*_):  # started, in a thread of its own, while the first is in its forward passes
        def collect():
            try:
                bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, progress=False)
            except ValueError as error:
                refused.append(str(error))

        if not refused:
            thread = threading.Thread(target=collect)
            thread.start()
            thread.join()

    handle = model.model.layers[0].register_forward_pre_hook(second_run)
    try:
        first = bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, progress=False)
    finally:
        handle.remove()
    assert refused and "cache is in use by another run that collects into it" in refused[0]
    with forward_passes(model) as passes:  # held no longer: the next run reads what the first wrote
        again = bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, progress=False)
    assert not passes and all(torch.equal(again[read], first[read]) for read in reads)


def test_an_interrupted_collection_into_a_cache_resumes_where_it_stopped(tmp_path):
    """An hour of collection was lost to an interruption, cache or not: the cache was written at the end."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    kwargs = dict(batch_size=4, progress=False)
    reference = bundled_features(model, tokenizer, prompts, reads, **kwargs)  # 12 batches, nothing kept
    cache = tmp_path / "cache"
    with forward_passes(model, interrupt_at=6), pytest.raises(KeyboardInterrupt):  # two parts of two batches kept
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=2, **kwargs)
    assert len(list((cache / PARTIAL).glob("part-*"))) == 2 and not any(cache.glob("layer*"))
    with forward_passes(model) as passes:
        resumed = bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=2, **kwargs)
    assert len(passes) == 1 + 12 - 4  # the shared opening, then the batches no part held, and those alone
    assert all(torch.equal(resumed[read], reference[read]) for read in reads)  # the same batches: bit for bit
    assert not (cache / PARTIAL).exists()
    uninterrupted = tmp_path / "uninterrupted"
    bundled_features(model, tokenizer, prompts, reads, cache_dir=uninterrupted, **kwargs)
    for read in reads:
        store, alone = load_activations(cache / read_folder(read)), load_activations(uninterrupted / read_folder(read))
        assert torch.equal(store.activations, alone.activations)
        assert store.records == alone.records and store.inputs == alone.inputs


def test_parts_left_by_a_run_stopped_after_its_stores_are_removed(tmp_path, monkeypatch):
    """A run stopped between writing its stores and removing its parts left them: a later collection of other reads
    was refused ("holds an interrupted collection of other reads"), and told to delete the whole cache."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    cache = tmp_path / "cache"

    def stopped(parts):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(bundled, "remove_parts", stopped)
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=2, batch_size=4)
    assert any((cache / PARTIAL).glob("part-*")) and all((cache / read_folder(read)).is_dir() for read in reads)
    other = (reads[0][0], "prompt_last" if reads[0][1] == "prompt_mean" else "prompt_mean")
    with forward_passes(model) as passes:
        features = bundled_features(model, tokenizer, prompts, [*reads, other], cache_dir=cache, progress=False)
    with forward_passes(model) as passes_alone:
        alone = bundled_features(model, tokenizer, prompts, [other], progress=False)
    assert len(passes) == len(passes_alone) and not (cache / PARTIAL).exists()  # the new read alone was collected
    assert torch.equal(features[other], alone[other])


def test_parts_of_a_run_that_did_not_finish_are_kept(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    cache = tmp_path / "cache"
    bundled_features(model, tokenizer, prompts, reads[:1], cache_dir=cache, progress=False)
    with forward_passes(model, interrupt_at=4), pytest.raises(KeyboardInterrupt):
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=1, batch_size=4)
    bundled_features(model, tokenizer, prompts, reads[:1], cache_dir=cache, progress=False)  # its store is there
    assert len(list((cache / PARTIAL).glob("part-*"))) == 2  # of reads[1:], whose stores are not


def test_parts_written_for_other_prompt_text_or_reads_are_refused(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    cache = tmp_path / "cache"
    with forward_passes(model, interrupt_at=3), pytest.raises(KeyboardInterrupt):
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=1, progress=False)
    edited = [p._replace(text=p.text + " (edited)") for p in prompts]
    with pytest.raises(ValueError, match=r"was written when the text of prompt .* was different"):
        bundled_features(model, tokenizer, edited, reads, cache_dir=cache, progress=False)
    other = [(reads[0][0], "prompt_last" if reads[0][1] == "prompt_mean" else "prompt_mean")]
    with pytest.raises(ValueError, match="holds an interrupted collection of other reads"):
        bundled_features(model, tokenizer, prompts, other, cache_dir=cache, progress=False)
    with pytest.raises(ValueError, match="checkpoint_batches must be a positive integer"):
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=0, progress=False)


def test_the_parts_of_an_interrupted_collection_keep_their_system_turn(tmp_path):
    """A cache holds the bundled rows under one system turn (``hf-lsad teach --system``): its parts too."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    prompts, reads = fit_prompts(), sorted(two_headed_guard().heads["harm"].reads)
    cache = tmp_path / "interrupted"
    with forward_passes(model, interrupt_at=3), pytest.raises(KeyboardInterrupt):
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, checkpoint_batches=1, progress=False)
    with pytest.raises(ValueError, match="under the system turn the chat template's default, not"):
        bundled_features(model, tokenizer, prompts, reads, cache_dir=cache, system=SHOP_TURN, progress=False)
    with forward_passes(model, interrupt_at=3), pytest.raises(KeyboardInterrupt):
        bundled_features(
            model, tokenizer, prompts, reads, cache_dir=tmp_path / "turned", checkpoint_batches=1, system=SHOP_TURN
        )
    resumed = bundled_features(model, tokenizer, prompts, reads, cache_dir=tmp_path / "turned", system=SHOP_TURN)
    alone = bundled_features(model, tokenizer, prompts, reads, system=SHOP_TURN, progress=False)
    assert all(torch.allclose(resumed[read], alone[read], atol=1e-5) for read in reads)
    assert load_activations(tmp_path / "turned" / read_folder(reads[0])).inputs.system == SHOP_TURN


@pytest.mark.parametrize("kind", ["add_head", "teach_traffic", "fit_budget_on_prompts"])
def test_an_empty_cache_name_is_refused_before_any_forward_pass(tmp_path, monkeypatch, kind):
    # Path("") is the current folder: the bundled rows' stores were written there, after the user's own prompts ran
    from hf_lsad.guard.heads.budget import fit_budget_on_prompts
    from hf_lsad.guard.heads.training import add_head, teach_traffic

    monkeypatch.chdir(tmp_path)
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard()  # fitted before the passes are counted
    prompts = [f"what is on the menu today, number {i}?" for i in range(200)]
    calls = {
        "add_head": lambda: add_head(model, tokenizer, guard, "secrets", prompts[:12], cache_dir=""),
        "teach_traffic": lambda: teach_traffic(model, tokenizer, guard, prompts, cache_dir=""),
        "fit_budget_on_prompts": lambda: fit_budget_on_prompts(
            model, tokenizer, guard, prompts, keep_bundled=["chat"], cache_dir=""
        ),
    }
    with forward_passes(model) as passes, pytest.raises(ValueError, match="cache_dir is empty"):
        calls[kind]()
    assert passes == [] and list(tmp_path.iterdir()) == []
