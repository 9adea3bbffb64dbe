"""The CLI pipeline end to end on the tiny model: collect -> train-sae -> fit -> evaluate -> generate."""

from __future__ import annotations

import json

import pytest
import torch

from hf_lsad.cli.main import entry, main
from hf_lsad.core.splits import split_safe
from hf_lsad.data.store import load_activations
from hf_lsad.guard import SafetyGuard
from hf_lsad.sae import SparseAutoencoder, sae_stats


@pytest.mark.filterwarnings("error:.*does not record the layer")  # train-sae records it for fit
def test_cli_pipeline(model_dir, tmp_path, capsys):
    # The tiny model's 512 positions fit the short benign_ood / harmful prompts (character tokens).
    common = ["--model", str(model_dir), "--layer", "2", "--position", "response_last", "--max-new-tokens", "4"]
    main(["collect", "--pool", "benign_ood", "--limit", "60", *common, "--out", str(tmp_path / "safe")])
    main(["collect", "--pool", "harmful", "--limit", "20", *common, "--out", str(tmp_path / "harmful")])
    safe = load_activations(tmp_path / "safe")
    assert safe.activations.shape == (60, 32) and len(safe.records) == 60
    assert safe.hook.layer == 2 and safe.hook.position == "response_last"
    assert all(record["category"] == "benign_ood" and "response" in record for record in safe.records)

    main(
        [
            "train-sae",
            "--activations",
            str(tmp_path / "safe"),
            "--d-sae",
            "64",
            "--l1",
            "1e-3",
            "--epochs",
            "5",
            "--out",
            str(tmp_path / "sae"),
        ]
    )
    out = capsys.readouterr().out
    stats = json.loads(out[out.index("{") :])
    # the printed statistics are those of the saved SAE on the held-out split the command drew
    data = load_activations(tmp_path / "safe")
    split = split_safe(len(data.activations), 0.2, 0)
    held_out = sae_stats(SparseAutoencoder.from_pretrained(tmp_path / "sae"), data.activations[split.holdout])
    assert stats["held_out"] == pytest.approx(held_out._asdict(), abs=1e-6)
    assert stats["held_out"]["l0"] > 0
    assert SparseAutoencoder.from_pretrained(tmp_path / "sae").layer == 2  # the store's, which fit checks
    main(
        [
            "fit",
            "--activations",
            str(tmp_path / "safe"),
            "--sae",
            str(tmp_path / "sae"),
            "--kmeans.n-clusters",
            "3",
            "--mask-size",
            "16",
            "--out",
            str(tmp_path / "guard"),
        ]
    )
    guard = SafetyGuard.from_pretrained(tmp_path / "guard")
    assert guard.config.n_fit == 48 and guard.config.n_holdout == 12
    assert guard.config.hook.base_model.endswith("tiny-llama")

    capsys.readouterr()
    main(
        [
            "evaluate",
            "--guard",
            str(tmp_path / "guard"),
            "--safe",
            str(tmp_path / "safe"),
            "--unsafe",
            str(tmp_path / "harmful"),
        ]
    )
    metrics = json.loads(capsys.readouterr().out)
    # the AUROC of the guard's scores, harmful rows against its held-out safe rows, computed here by sklearn
    from sklearn.metrics import roc_auc_score

    safe_rows = load_activations(tmp_path / "safe").activations[split_safe(60, 0.2, 0).holdout]
    negatives, positives = guard(safe_rows).scores, guard(load_activations(tmp_path / "harmful").activations).scores
    labels = [0] * len(negatives) + [1] * len(positives)
    expected = roc_auc_score(labels, torch.cat([negatives, positives]).numpy())
    assert set(metrics) == {"harmful"} and metrics["harmful"]["auroc"] == pytest.approx(expected, abs=1e-9)
    # Any store can play benign OOD: its flag rate is reported, with a warning above 10%.
    main(
        [
            "evaluate",
            "--guard",
            str(tmp_path / "guard"),
            "--safe",
            str(tmp_path / "safe"),
            "--unsafe",
            str(tmp_path / "harmful"),
            "--benign-ood",
            str(tmp_path / "harmful"),
        ]
    )
    captured = capsys.readouterr()
    with_ood = json.loads(captured.out)
    flagged = with_ood["benign_ood"]["flagged"]
    assert flagged == metrics["harmful"]["flagged"]
    # Pooled negatives = 12 held-out safe + the 20 "benign" rows, which tie the positives (AUROC 1/2).
    assert with_ood["harmful"]["auroc"] == metrics["harmful"]["auroc"]
    assert with_ood["harmful"]["auroc_pooled"] == pytest.approx((12 * metrics["harmful"]["auroc"] + 20 * 0.5) / 32)
    assert ("warning: This guard flags" in captured.err) == (flagged > 0.10)

    main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--guard",
            str(tmp_path / "guard"),
            "--max-new-tokens",
            "3",
            "hi there",
            "a somewhat longer prompt about bread",
        ]
    )
    out = capsys.readouterr().out
    assert out.count("safety:") == 2 and out.count(f" {guard.threshold:.4g} (cluster ") == 2  # score <=/> threshold
    assert out.count("p-value ") == 2  # conformal p-value against the held-out safe scores


def test_cli_collect_refuses_a_layer_the_model_lacks(model_dir, tmp_path):
    common = ["--model", str(model_dir), "--position", "prompt_last", "--max-new-tokens", "1"]
    with pytest.raises(IndexError, match="layer 9 is out of range"):
        main(["collect", "--pool", "harmful", "--limit", "4", "--layer", "9", *common, "--out", str(tmp_path / "x")])


def test_cli_collect_reads_several_layers_and_positions_in_one_pass(model_dir, tmp_path):
    from hf_lsad.capture import encode_prompts
    from hf_lsad.capture.recorder import prompt_features
    from hf_lsad.data import load_pool
    from hf_lsad.testing import tiny_model

    argv = ["collect", "--model", str(model_dir), "--pool", "harmful", "--limit", "6", "--layer", "1", "3"]
    main([*argv, "--position", "prompt_last", "prompt_mean", "--out", str(tmp_path / "acts")])
    model, tokenizer = tiny_model("llama")
    prompts = [p.text for p in load_pool("harmful", limit=6, seed=0)]
    inputs = encode_prompts(tokenizer, prompts)
    for layer in (1, 3):
        for position in ("prompt_last", "prompt_mean"):
            store = load_activations(tmp_path / "acts" / f"layer{layer}-{position}")
            assert store.hook.layer == layer and store.hook.position == position
            want = prompt_features(model, [(layer, position)], inputs["input_ids"], inputs["attention_mask"])
            torch.testing.assert_close(store.activations, want[layer, position], atol=1e-5, rtol=1e-5)


def test_cli_collect_refuses_several_reads_with_a_response_position(capsys, model_dir, tmp_path):
    from hf_lsad.cli.main import entry

    argv = ["collect", "--model", str(model_dir), "--pool", "harmful", "--layer", "1", "2"]
    with pytest.raises(SystemExit) as info:
        entry([*argv, "--position", "response_last", "--out", str(tmp_path / "x")])
    assert info.value.code == 2 and "read from the prompt in one pass" in capsys.readouterr().err


def test_the_guard_line_says_how_the_budget_was_set():
    from tiny import PROMPTS, tiny_guard, two_headed_guard

    from hf_lsad.capture.collect import collect_prompt_features

    guard = two_headed_guard()
    assert guard.describe().endswith("(together 25% of tiny benign prompts)")
    model, tokenizer, _ = tiny_guard("prompt_last")
    reads, _ = collect_prompt_features(model, tokenizer, PROMPTS, guard.reads, progress=False)
    budget = guard.fit_budget(reads, target_fpr=0.25, shares=[0.5, 0.5], rows="tiny benign prompts", confidence=0.9)
    assert guard.describe().endswith(
        f"(together at most 25% of benign traffic like tiny benign prompts with 90% confidence; "
        f"{budget.measured_fpr:.1%} of the rows it was set on)"
    )


def test_generate_fails_on_a_missing_guard_before_loading_the_model(hub_server, capsys):
    # Both repos are missing on the Hub: the guard is loaded (and fails) first, so the error names it, not the model.
    with pytest.raises(SystemExit) as info:
        entry(["generate", "--model", "hf-lsad-org/no-such-model", "--guard", "hf-lsad-org/no-such-guard", "hi"])
    error = capsys.readouterr().err
    assert info.value.code == 1 and "no-such-guard" in error and "no-such-model" not in error.split("error:", 1)[1]


def test_an_interrupted_collect_resumes_where_it_stopped_for_the_same_store(model_dir, tmp_path, capsys):
    """An interrupted collect lost everything it had collected (the in-the-wild jailbreak pool alone took 25
    minutes on a 2-core CPU)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tiny import held_by_another_run

    out = tmp_path / "acts"
    argv = ["collect", "--model", str(model_dir), "--pool", "harmful", "--limit", "400", "--layer", "1", "3"]
    argv += ["--position", "prompt_last", "prompt_mean", "--batch-size", "1"]
    # Ctrl-C as at a terminal, even where this suite runs with SIGINT ignored (which a child would inherit)
    start = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    start += "from hf_lsad.cli.main import entry; entry(sys.argv[1:])"
    log = tmp_path / "log"
    with log.open("w") as sink:  # not a pipe: a full pipe would stall the run
        env = dict(os.environ, TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
        process = subprocess.Popen(
            [sys.executable, "-c", start, *argv, "--out", str(out)], stdout=sink, stderr=sink, env=env
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None and not (out / ".partial" / "part-00002").is_dir():
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)  # two parts of 32 prompts written
    assert process.wait(timeout=120) == 130, log.read_text()
    assert f"note: the prompts collected so far are kept in {out / '.partial'}; run the same command" in log.read_text()
    kept = len(list((out / ".partial").glob("part-*")))
    assert 2 <= kept < 400 // 32, "the run was not interrupted mid-way"

    with held_by_another_run(out / ".partial"):
        with pytest.raises(ValueError, match="collected into by another run"):
            main([*argv, "--out", str(out)])
        with pytest.raises(SystemExit) as refused:  # the command line says so before it loads a model
            entry([*argv, "--out", str(out)])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and "argument --out: " in err and "collected into by another run" in err
    main([*argv, "--out", str(out)])
    main([*argv, "--out", str(tmp_path / "alone")])
    assert not (out / ".partial").exists()
    for folder in ("layer1-prompt_last", "layer1-prompt_mean", "layer3-prompt_last", "layer3-prompt_mean"):
        resumed, alone = load_activations(out / folder), load_activations(tmp_path / "alone" / folder)
        assert torch.equal(resumed.activations, alone.activations)  # the same batches: bit for bit
        assert resumed.records == alone.records and resumed.inputs == alone.inputs
