"""Stage 2: sparse autoencoders: the model, its training, and loading public SAEs (SAELens, sparsify, Gemma Scope)."""

from .formats import load_sae
from .model import SAEConfig, SAEOutput, SparseAutoencoder
from .training import SAEStats, SAETrainConfig, sae_stats, train_sae

__all__ = [
    "SAEConfig",
    "SAEOutput",
    "SAEStats",
    "SAETrainConfig",
    "SparseAutoencoder",
    "load_sae",
    "sae_stats",
    "train_sae",
]
