"""Dotted settings and the CLI flags generated from config dataclasses."""

from __future__ import annotations

import argparse

import pytest

from hf_lsad.core.settings import add_config_arguments, build_config, field_docs, settings_from_args
from hf_lsad.detectors import FreqMaskConfig, LearnedMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig


def test_build_config_applies_dotted_settings_and_seeds():
    config = build_config(FreqMaskConfig, {"kmeans.n_clusters": 7, "mask_size": 12}, seed=3)
    assert config == FreqMaskConfig(kmeans=KMeansConfig(n_clusters=7, seed=3), mask_size=12)
    with pytest.raises(ValueError, match="no field"):
        build_config(FreqMaskConfig, {"kmeans.clusters": 7})


def test_field_docs_read_the_docstring_under_each_field():
    assert field_docs(KMeansConfig)["n_clusters"] == "Number of clusters K."


def test_generated_flags_default_to_the_config_and_set_overrides():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, LearnedMaskConfig, title="settings")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(
        [
            "--kmeans.n-clusters",
            "5",
            "--mask-type",
            "continuous",
            "--no-stage1-only",
            "--lora-ranks",
            "1",
            "2",
            "3",
            "--set",
            "lambdas=[0.1]",
            "--set",
            "score_metric=mahalanobis",
        ]
    )
    settings = settings_from_args(args, args.set)
    assert settings == {
        "kmeans.n_clusters": 5,
        "mask_type": "continuous",
        "stage1_only": False,
        "lora_ranks": [1, 2, 3],
        "lambdas": [0.1],
        "score_metric": "mahalanobis",
    }
    config = build_config(LearnedMaskConfig, settings)
    assert config.kmeans == KMeansConfig(n_clusters=5) and config.lora_ranks == [1, 2, 3]
    assert build_config(LearnedMaskConfig, settings_from_args(parser.parse_args([]))) == LearnedMaskConfig()
    with pytest.raises(SystemExit):
        parser.parse_args(["--mask-type", "ternary"])
