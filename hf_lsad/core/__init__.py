"""Foundations every stage stands on: the hook point's identity, strict JSON/safetensors I/O, validation,
settings, seeded splits, metrics, Hub folder I/O, integrity records and files one run writes at a time. Imports no
transformers."""
