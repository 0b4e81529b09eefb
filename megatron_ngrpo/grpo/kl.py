"""Per-token estimators of KL(π_θ ‖ π_ref) from sampled-token log-probs (Schulman's k1/k2/k3).

With δ = log π_ref − log π_θ at a token sampled from (approximately) π_θ:
k1 = −δ (unbiased, high variance), k2 = δ²/2, k3 = e^δ − δ − 1 (unbiased, ≥ 0, low variance;
verl's ``low_var_kl``, clamped to ±``clamp``).
"""

from __future__ import annotations

import torch


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3", clamp: float = 10.0
) -> torch.Tensor:
    """Elementwise KL estimate, same shape as the inputs; differentiable in ``logprobs``."""
    delta = ref_logprobs - logprobs
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        delta = delta.clamp(-20.0, 20.0)  # exp overflow guard, as verl
        return torch.clamp(torch.exp(delta) - delta - 1.0, min=-clamp, max=clamp)
    raise ValueError(f"kl estimator {estimator!r}")
