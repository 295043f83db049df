"""Pruned layers.

- `PrunedLinear` / `PrunedConv2d`: the dense weight plus a boolean ``mask`` buffer, computing with
  ``weight * mask``; gradients of pruned weights are zero, so they stay pruned while the model is fine-tuned.
- `SparseLinear`: the kept weights in CSR form (fp32 values, int32 column indices and row pointers), so
  `measure().size_bytes` really drops - once sparsity is high enough (CSR costs 8 bytes per kept weight,
  dense 4 per weight: it only pays above 50 %). It multiplies with ``torch.sparse.mm``.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PrunedLinear", "PrunedConv2d", "SparseLinear", "csr_bytes"]


class PrunedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sparsity={1 - self.mask.float().mean().item():.3f}"


class PrunedConv2d(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight * self.mask, self.bias)


def csr_bytes(rows: int, nnz: int) -> int:
    return nnz * (4 + 4) + (rows + 1) * 4


class SparseLinear(nn.Module):
    """y = x W^T + b with W in CSR storage."""

    def __init__(self, in_features: int, out_features: int, nnz: int, bias: bool = True, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("values", torch.empty(nnz, device=device))
        self.register_buffer("col_indices", torch.empty(nnz, dtype=torch.int32, device=device))
        self.register_buffer("crow_indices", torch.empty(out_features + 1, dtype=torch.int32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.kernel = "sparse_csr"

    @classmethod
    def from_dense(cls, weight: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None) -> "SparseLinear":
        w = (weight.detach() * mask).float()
        # the mask decides what is stored (a kept weight that happens to be 0.0 is still stored)
        sentinel = torch.where(w == 0, torch.full_like(w, float("nan")), w)             # NaN marks kept zeros
        with warnings.catch_warnings():  # "sparse CSR support is in beta": known, and tested here
            warnings.simplefilter("ignore", UserWarning)
            csr = torch.where(mask, sentinel, torch.zeros_like(w)).to_sparse_csr()
        values = torch.nan_to_num(csr.values(), nan=0.0)
        if values.numel() != int(mask.sum()):
            raise RuntimeError("CSR conversion lost entries")
        new = cls(w.shape[1], w.shape[0], values.numel(), bias is not None)
        new.values.copy_(values)
        new.col_indices.copy_(csr.col_indices().to(torch.int32))
        new.crow_indices.copy_(csr.crow_indices().to(torch.int32))
        if bias is not None:
            new.bias.data.copy_(bias.detach())
        return new

    def weight_csr(self) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(self.crow_indices, self.col_indices, self.values,
                                           (self.out_features, self.in_features), check_invariants=False)

    def dense_weight(self) -> torch.Tensor:
        return self.weight_csr().to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        x2 = x.reshape(-1, self.in_features).float()                             # (M, in)
        y = torch.sparse.mm(self.weight_csr(), x2.T).T                             # (M, out)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
