"""`linear`: one matmul entry point for every weight of the model, dense or quantized."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a dense [out, in] weight."""
    return F.linear(x, weight, bias)
