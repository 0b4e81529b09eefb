"""Group-relative advantages (N-GRPO paper Eq. 12; Dr.GRPO) and the zero-variance group filter.

Responses are grouped by prompt; every response of a group is held by the same rank, so these
are local operations on [N] float tensors.
"""

from __future__ import annotations

import torch


def group_ids(prompt_index: list[int] | torch.Tensor) -> torch.Tensor:
    """[N] group number 0..G-1 per response, groups numbered in order of first appearance."""
    idx = torch.as_tensor(prompt_index, dtype=torch.long)
    _, inverse = torch.unique(idx, return_inverse=True)
    return inverse


def group_stats(
    rewards: torch.Tensor, groups: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per response: its group's mean, unbiased std and size (float64 [N] each).

    A group of one has mean 0 and std 1 (reference code: its advantage is its reward)."""
    r = rewards.double()
    n_groups = int(groups.max()) + 1 if groups.numel() else 0
    count = torch.bincount(groups, minlength=n_groups).double()
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, r)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, (r - mean[groups]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[groups], std[groups], count[groups]


def compute_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, kind: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """[N] float32 sequence-level advantages.

    ``grpo``: (r − mean) / (std + eps) with the unbiased group std (reference code);
    ``dr_grpo``: r − mean (no std normalisation).
    """
    mean, std, _ = group_stats(rewards, groups)
    adv = rewards.double() - mean
    if kind == "grpo":
        adv = adv / (std + eps)
    elif kind != "dr_grpo":
        raise ValueError(f"advantage {kind!r}")
    return adv.float()


def zero_variance_groups(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """[N] bool: True for responses whose group has more than one response, all rewards equal."""
    r = rewards.double()
    n_groups = int(groups.max()) + 1 if groups.numel() else 0
    lo = torch.full((n_groups,), float("inf"), dtype=torch.float64).scatter_reduce(
        0, groups, r, "amin"
    )
    hi = torch.full((n_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(
        0, groups, r, "amax"
    )
    count = torch.bincount(groups, minlength=n_groups)
    return ((lo == hi) & (count > 1))[groups]
