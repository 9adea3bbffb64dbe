"""Foundations every stage stands on: the hook point's identity, strict JSON/safetensors I/O, validation,
settings, seeded splits, metrics, Hub folder I/O and integrity records. Imports no transformers."""
