"""``hf-lsad collect`` under ``accelerate launch``: two CPU processes write the store one process writes, row for
row."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_lsad.capture.resumable import PARTIAL
from hf_lsad.capture.sharded import PARTS, Shard, merge_parts, write_part
from hf_lsad.cli.main import main
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.core.prompt_inputs import InputProfile
from hf_lsad.data.store import load_activations, save_activations

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("position", ["response_last", "prompt_mean"])  # generated; read in parts, resumably
def test_two_accelerate_processes_write_the_one_process_store(model_dir, tmp_path, position):
    # 13 prompts: shards of 7 and 6, each batched (by length) differently from the one-process run.
    collect = [
        "collect",
        "--model",
        str(model_dir),
        "--pool",
        "harmful",
        "--limit",
        "13",
        "--layer",
        "2",
        "--position",
        position,
        "--max-new-tokens",
        "3",
        "--batch-size",
        "4",
        "--device",
        "cpu",
    ]
    main([*collect, "--out", str(tmp_path / "one")])
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
        "-m",
        "hf_lsad.cli",
    ]
    # The processes import this checkout's hf_lsad, one thread each (the machine may have one core for both).
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    run = subprocess.run(
        [*launch, *collect, "--out", str(tmp_path / "two")], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("wrote 13 activations") == 1 and "by 2 processes" in run.stdout  # process 0 reports
    one, two = load_activations(tmp_path / "one"), load_activations(tmp_path / "two")
    assert two.records == one.records and two.hook == one.hook and two.inputs == one.inputs is not None
    assert [r["id"] for r in two.records] == [r["id"] for r in one.records]  # the pool's order
    torch.testing.assert_close(two.activations, one.activations, atol=1e-5, rtol=1e-5)
    assert not (tmp_path / "two" / PARTS).exists() and not (tmp_path / "two" / PARTIAL).exists()


def hook() -> HookPoint:
    return HookPoint(
        base_model="tiny",
        model_type="llama",
        hidden_size=4,
        num_hidden_layers=2,
        layer=1,
        layer_module="model.layers.1",
        position="prompt_last",
    )


def test_merge_keeps_rank_order_and_skips_a_process_without_prompts(tmp_path):
    rows = torch.arange(12.0).reshape(3, 4)
    records = [{"id": f"p{i}"} for i in range(3)]
    # Three processes, three prompts written out of rank order; rank 2's part is empty.
    write_part(tmp_path, Shard(1, 3, [2]), rows[2:], records[2:], hook(), inputs=InputProfile("chat_template", 9))
    write_part(tmp_path, Shard(2, 3, []), rows[:0], [], hook(), inputs=InputProfile("chat_template", 1))
    write_part(tmp_path, Shard(0, 3, [0, 1]), rows[:2], records[:2], hook(), inputs=InputProfile("chat_template", 5))
    merge_parts(tmp_path, 3, 3)
    merged = load_activations(tmp_path)
    assert merged.records == records and torch.equal(merged.activations, rows)
    assert merged.inputs == InputProfile("chat_template", 9)  # the longest prompt of any part
    assert not (tmp_path / PARTS).exists()


def test_merge_refuses_missing_rows(tmp_path):
    save_activations(tmp_path / PARTS / "rank-00000", torch.ones(2, 4), [{"id": "a"}, {"id": "b"}], hook())
    with pytest.raises(RuntimeError, match="wrote 2 rows for 3 prompts"):
        merge_parts(tmp_path, 2, 3)


def test_one_process_writes_the_store_itself(tmp_path):
    write_part(tmp_path, Shard(0, 1, [0]), torch.ones(1, 4), [{"id": "a"}], hook())
    assert load_activations(tmp_path).records == [{"id": "a"}] and not (tmp_path / PARTS).exists()
