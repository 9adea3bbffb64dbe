"""Masks over SAE features: the top-k frequency mask and the straight-through learned mask."""

from __future__ import annotations

import torch

from hf_lsad.detectors.masks import straight_through_mask, top_k_mask


def test_top_k_mask_breaks_ties_to_the_lower_index_and_sorts():
    frequency = torch.tensor([0.5, 0.9, 0.5, 0.1, 0.9])
    assert top_k_mask(frequency, 3).tolist() == [0, 1, 4]


def test_straight_through_mask_is_hard_forward_and_sigmoid_backward():
    logits = torch.tensor([-1.0, 0.5], requires_grad=True)
    mask = straight_through_mask(logits)
    assert mask.tolist() == [0.0, 1.0]
    mask.sum().backward()
    sigmoid = torch.sigmoid(logits.detach())
    torch.testing.assert_close(logits.grad, sigmoid * (1 - sigmoid))
