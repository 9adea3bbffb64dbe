"""The commands' ``--device`` / ``--dtype`` / ``--kmeans-device``, ``--guard`` at ``--revision`` / ``--subfolder``,
``--version``, and dataset pools in ``collect``: bad values are one-line usage errors before any model loads."""

from __future__ import annotations

import json

import faiss
import pytest
import torch
from huggingface_hub.errors import EntryNotFoundError
from tiny import fresh_guard

from hf_lsad.capture import pretrained
from hf_lsad.capture.pretrained import placement
from hf_lsad.cli.main import entry, main
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.data.store import load_activations, save_activations
from hf_lsad.version import __version__


def usage_error(capsys, monkeypatch, *argv: str) -> str:
    """Run the command, which must stop with a usage error (exit 2: argparse's usage, then one error line)
    without loading a model; return the error line."""

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(pretrained, "load_model", no_model)
    with pytest.raises(SystemExit) as exit_:
        entry(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    command = next(a for a in argv if not a.startswith("-"))
    assert exit_.value.code == 2 and err[0].startswith(f"usage: hf-lsad {command} "), err  # the command's usage
    assert err[-1].startswith(f"hf-lsad {command}: error: "), err
    assert not any("Traceback" in line for line in err)
    return err[-1]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        entry(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"hf-lsad {__version__}"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--device", "gpu0"], "argument --device: 'gpu0' is not a device: use auto, cpu, cuda"),
        (["--device", "cuda:99"], "argument --device: 'cuda:99': "),
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8' (choose from 'fp32', 'bf16', 'fp16')"),
    ],
)
def test_bad_device_and_dtype_fail_before_the_model_loads(capsys, monkeypatch, tmp_path, flags, expected):
    for argv in (["collect", "--pool", "harmful", "--layer", "1", "--out", str(tmp_path / "x")], ["generate", "hi"]):
        assert expected in usage_error(capsys, monkeypatch, *argv, *flags)


@pytest.mark.skipif(hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0, reason="faiss has GPUs here")
def test_gpu_kmeans_without_faiss_gpus_is_a_usage_error(capsys, monkeypatch, tmp_path):
    (tmp_path / "store").mkdir()
    err = usage_error(
        capsys,
        monkeypatch,
        "fit",
        "--activations",
        str(tmp_path / "store"),
        "--kmeans-device",
        "gpu",
        "--method",
        "mahalanobis",
        "--out",
        str(tmp_path / "g"),
    )
    assert "argument --kmeans-device: GPU k-means was requested but faiss" in err


def test_dataset_flags_belong_to_dataset_pools(capsys, monkeypatch, tmp_path):
    out = ["--layer", "1", "--out", str(tmp_path / "x")]
    err = usage_error(capsys, monkeypatch, "collect", "--pool", "harmful", "--column", "instruction", *out)
    assert "argument --column: only for a dataset --pool; the bundled pool 'harmful' is category 'harmful'" in err
    err = usage_error(capsys, monkeypatch, "collect", "--pool", str(tmp_path), *out)
    assert f"argument --category: required for the dataset pool '{tmp_path}'" in err


def test_collect_reads_a_local_dataset_folder(model_dir, tmp_path):
    # datasets.load_dataset on a folder of JSON lines: what a user does with a Hub dataset, offline.
    (tmp_path / "prompts").mkdir()
    rows = [{"instruction": f"tell me fact number {i}", "other": i} for i in range(6)] + [
        {"instruction": " ", "other": 6}
    ]
    (tmp_path / "prompts" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(
        [
            "collect",
            "--model",
            str(model_dir),
            "--pool",
            str(tmp_path / "prompts"),
            "--category",
            "safe",
            "--split",
            "test",
            "--text-field",
            "instruction",
            "--limit",
            "4",
            "--layer",
            "1",
            "--position",
            "prompt_last",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--out",
            str(tmp_path / "store"),
        ]
    )
    store = load_activations(tmp_path / "store")
    source = str(tmp_path / "prompts")
    assert store.activations.shape == (4, 32)
    assert {r["category"] for r in store.records} == {"safe"} and {r["source"] for r in store.records} == {source}
    assert all(r["id"].startswith(f"safe-{source}-") and int(r["id"].rsplit("-", 1)[1]) < 6 for r in store.records)


def test_collect_refuses_a_dataset_without_prompts(tmp_path, capsys):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "train.jsonl").write_text(json.dumps({"prompt": "  "}) + "\n")
    with pytest.raises(SystemExit) as exit_:
        entry(
            [
                "collect",
                "--pool",
                str(tmp_path / "prompts"),
                "--category",
                "safe",
                "--layer",
                "1",
                "--out",
                str(tmp_path / "store"),
            ]
        )
    assert exit_.value.code == 2 and "holds no non-empty prompt" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


def test_generate_in_bf16_with_a_guard_in_a_subfolder(model_dir, tmp_path, capsys):
    guard = fresh_guard("prompt_last")
    guard.save_pretrained(tmp_path / "guards" / "screen")
    main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--guard",
            str(tmp_path / "guards"),
            "--subfolder",
            "screen",
            "--dtype",
            "bf16",
            "--device",
            "cpu",
            "--max-new-tokens",
            "2",
            "hi there",
        ]
    )
    printed = capsys.readouterr()
    out = printed.out  # what it loads goes to stderr, the answers to stdout
    assert "(bf16)" in printed.err and out.count("safety:") == 1 and f" {guard.threshold:.4g} (cluster " in out


def test_generate_reads_a_guard_at_a_hub_revision(model_dir, hub_server, capsys):
    repo = f"hf-lsad-org/runtime-{id(capsys):x}"
    guard = fresh_guard("prompt_last")
    guard.push_to_hub(repo, subfolder="screen", revision="v1")
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--guard",
        repo,
        "--subfolder",
        "screen",
        "--max-new-tokens",
        "1",
        "hi",
    ]
    main([*argv, "--revision", "v1"])
    assert f" {guard.threshold:.4g} (cluster " in capsys.readouterr().out
    with pytest.raises(EntryNotFoundError, match="has no subfolder 'screen' at revision 'main'"):
        main(argv)  # the guard was pushed to the branch v1 only


@pytest.mark.parametrize(
    "argv",
    [
        ["collect", "--pool", "safe", "--layer", "1", "--position", "prompt_last"],
        ["train-sae", "--activations", "{tmp}", "--d-sae", "8"],
        ["fit", "--activations", "{tmp}"],
        ["calibrate", "--guard", "default", "--safe", "{tmp}", "--unsafe", "{tmp}", "--benign-ood", "{tmp}"],
        ["evaluate", "--guard", "default", "--benign-prompts", "chat={tmp}/chat.txt"],
        ["add-head", "--guard", "default", "--name", "dosage", "--unsafe", "{tmp}/chat.txt"],
        ["set-budget", "--guard", "default", "--benign", "{tmp}/chat.txt"],
        ["teach", "--guard", "default", "--benign", "{tmp}/chat.txt"],
    ],
    ids=lambda argv: argv[0],
)
def test_an_out_folder_that_is_a_file_fails_before_the_model_loads(capsys, monkeypatch, tmp_path, argv):
    (tmp_path / "chat.txt").write_text("How do I bake bread?\n")
    (tmp_path / "a-file").write_text("not a folder")
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    # collect failed after its model loaded, with a bare NotADirectoryError; the others at their save, after the work
    error = usage_error(capsys, monkeypatch, *argv, "--out", str(tmp_path / "a-file"))
    assert error.endswith(f"argument --out: '{tmp_path / 'a-file'}' is a file, not a folder")


def test_collect_does_not_replace_an_index_of_something_else(capsys, monkeypatch, tmp_path):
    """A collection into a folder with another tool's ``index.json`` replaced it with the store's, at the end."""
    (tmp_path / "index.json").write_text('{"pages": ["home", "about"]}')
    error = usage_error(capsys, monkeypatch, "collect", "--pool", "safe", "--layer", "1", "--out", str(tmp_path))
    assert error.endswith(
        f"argument --out: {tmp_path / 'index.json'} is not the config of an activation store: saving "
        f"an activation store in {tmp_path} would overwrite it; save it to a folder of its own"
    )
    hook = HookPoint("tiny/model", "llama", 4, 4, 1, "model.layers.1", "prompt_last")
    with pytest.raises(FileExistsError, match="is not the config of an activation store"):
        save_activations(tmp_path, torch.randn(3, 4), [{"id": str(i)} for i in range(3)], hook)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json"]
    assert (tmp_path / "index.json").read_text() == '{"pages": ["home", "about"]}'
    save_activations(tmp_path / "store", torch.randn(3, 4), [{"id": str(i)} for i in range(3)], hook)
    save_activations(tmp_path / "store", torch.randn(2, 4), [{"id": str(i)} for i in range(2)], hook)  # its own


def test_placement_of_a_model():
    assert placement("cpu") == {} and placement("cuda:1") == {"device_map": {"": "cuda:1"}}
    assert placement("auto", torch.device("cuda", 1)) == {"device_map": {"": "cuda:1"}}
    assert placement("auto", torch.device("cpu")) == {}
    assert placement("auto") == ({"device_map": "auto"} if torch.cuda.is_available() else {})


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--top-p", "0.5"], "argument --top-p: shapes sampling, which needs --temperature above 0"),
        (["--seed", "3"], "argument --seed: shapes sampling, which needs --temperature above 0"),
        (["--temperature", "-1"], "argument --temperature: -1.0 is not a number >= 0"),
        (["--temperature", "nan"], "argument --temperature: nan is not a number >= 0"),
        (["--temperature", "1", "--top-p", "0"], "argument --top-p: 0.0 is not a number in (0, 1]"),
        (["--on-flag", "report", "--refusal", "No."], "argument --refusal: what a stopped row says, and --on-flag"),
    ],
)
def test_sampling_flags_that_cannot_work_fail_before_the_model_loads(capsys, monkeypatch, flags, expected):
    assert expected in usage_error(capsys, monkeypatch, "generate", "hi", *flags)


def test_generate_samples_at_a_temperature_and_a_seed_repeats_the_draw(model_dir, tmp_path, capsys):
    fresh_guard("prompt_last").save_pretrained(tmp_path / "guard")

    def answer(*flags: str) -> tuple[str, str]:
        """(how the command says it decodes, the response line) of one run."""
        argv = ["generate", "--model", str(model_dir), "--guard", str(tmp_path / "guard"), "--max-new-tokens", "8"]
        main([*argv, *flags, "--on-flag", "report", "hi there"])
        lines = capsys.readouterr().out.splitlines()
        return lines[0], next(line for line in lines if line.startswith("response:"))

    greedy_header, greedy = answer()
    assert greedy_header.endswith("(greedy) ...")
    header, first = answer("--temperature", "1.5", "--seed", "3")
    assert header.endswith("(sampling at temperature 1.5, top-p 1.0, seed 3) ...")
    assert answer("--temperature", "1.5", "--seed", "3")[1] == first
    drawn = {answer("--temperature", "1.5", "--seed", str(seed))[1] for seed in range(4)}
    assert len(drawn | {greedy}) > 2  # the seed decides the draw


@pytest.mark.parametrize(("command", "shown"), [("generate", str), ("explain", repr)])
def test_a_long_prompt_is_echoed_cut_to_its_start(model_dir, tmp_path, capsys, command, shown):
    fresh_guard("prompt_last").save_pretrained(tmp_path / "guard")
    long_prompt = "Tell me about bread. " * 20  # 420 characters, within the tiny model's context
    argv = [command, "--model", str(model_dir), "--guard", str(tmp_path / "guard")]
    argv += ["--max-new-tokens", "2", "--on-flag", "report"] if command == "generate" else []
    main([*argv, "hi there", long_prompt])
    prompts = [line.split(maxsplit=1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("prompt:")]
    assert prompts == [shown("hi there"), f"{shown(long_prompt[:300])} ... [420 characters]"]
