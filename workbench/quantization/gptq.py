"""GPTQ (Frantar et al., 2022): quantize a Linear weight column by column, feeding each column's rounding
error back into the columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

For a layer ``y = x W^T`` and calibration inputs X, the layer-output error of a quantized W' is
``tr((W - W') H (W - W')^T)`` with ``H = 2 X^T X / n``. Processing columns in blocks of ``block_size``:

    for each column j (in order, or by decreasing H_jj with act_order):
        q_j   = quant(w_j)                         # RTN with the column's group scale / zero
        e_j   = (w_j - q_j) / [H^-1]_jj            # scaled rounding error (Cholesky factor of H^-1)
        W[:, j+1:] -= e_j [H^-1]_{j, j+1:}         # error feedback to the remaining columns

Group scales are chosen from the *updated* weights when a group starts. With act_order, groups are formed in
activation order, as the reference (and GPTQModel's ``desc_act``) does: group k holds the k-th run of
``group_size`` columns in processing order; the result then encodes the weight with its columns permuted,
``W[:, perm]``, and carries ``perm`` - the layer gathers ``x[..., perm]`` once per call, so every kernel sees
an ordinary grouped weight of a permuted K. ``static_groups=True`` instead keeps groups of the original
columns with scales from the original weights up front (no permutation stored, usually a little less
accurate). Otherwise the result is the same storage as round-to-nearest (`formats.IntFormat`).

Where the inputs come from (the original model, or the already-quantized blocks before the layer) is the
calibration pipeline's business (`workbench.plans.sequential`).
An ``observer`` sees the algorithm's state after every column (`GPTQStep`), e.g. for a step-through.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from workbench.plans.registry import Accumulator
from workbench.quantization import formats as fm

__all__ = ["hessian", "HessianAccumulator", "inverse_hessian_factor", "gptq_quantize", "GPTQStep"]


@dataclass(frozen=True)
class GPTQStep:
    """The state after column ``column`` (in processing order) of block ``[i1, i2)`` was quantized; live
    tensors, to read and not to change. ``q``: the dequantized column; ``W``: the working weight (columns from
    ``i2`` on do not have this block's feedback yet: it is applied lazily, ``W[:, i2:] - Err1 @ Hinv[i1:i2, i2:]``
    at the end of the block); ``W1`` / ``Err1``: the block's weights and scaled errors so far; ``Hinv``: the
    upper Cholesky factor of H^-1."""

    column: int
    i1: int
    i2: int
    q: torch.Tensor
    W: torch.Tensor
    W1: torch.Tensor
    Err1: torch.Tensor
    Hinv: torch.Tensor


class HessianAccumulator(Accumulator):
    """``H = 2/n sum x x^T`` built one batch at a time (``add`` is what a forward pre-hook calls), so a layer's
    calibration inputs need not be kept: `gptq_quantize` takes it in place of the inputs.

    Float32, as the reference implementation keeps it (half the memory of float64: for a 5632-wide input
    127 MB instead of 254 MB). Layers that read the same input tensor (a decoder's q / k / v projections,
    gate / up) can share one accumulator (``users`` = how many): each `take` hands out H, the last one H
    itself (GPTQ factorizes it in place), the others a copy."""

    def __init__(self, in_features: int, name: str = "layer", dtype: torch.dtype = torch.float32):
        self.K, self.name, self.dtype = in_features, name, dtype
        self.H: torch.Tensor | None = None   # (in, in): sum of x x^T, allocated at the first batch
        self.n = 0
        self.scaled = False
        self.users = 1
        self.taken = 0

    @property
    def nbytes(self) -> int:
        """The bytes H takes once the first batch arrives."""
        return self.K * self.K * self.dtype.itemsize

    def shares_with(self, other: Accumulator) -> bool:
        """Another Hessian of the same width and dtype (the layers read one input)."""
        return type(other) is type(self) and other.K == self.K and other.dtype == self.dtype

    def add(self, batch: tuple[torch.Tensor, ...]) -> None:
        if self.scaled:
            raise RuntimeError(f"the Hessian of {self.name!r} was already handed to GPTQ; it takes no more inputs")
        x = batch[0]
        if x.shape[-1] != self.K:
            raise ValueError(f"calibration input of {self.name!r} has last dimension {x.shape[-1]}, expected {self.K}")
        x = x.reshape(-1, self.K).to(device="cpu", dtype=self.dtype)   # (tokens, in)
        if self.H is None:
            with torch.inference_mode(False):   # (hooks run in inference mode; H is changed in place later)
                self.H = torch.zeros(self.K, self.K, dtype=self.dtype)
        self.H.addmm_(x.T, x)
        self.n += x.shape[0]

    def value(self) -> torch.Tensor:
        """H itself, scaled in place (no second K x K copy): the caller may change it; no more `add` after."""
        if self.n == 0 or self.H is None:
            raise ValueError(f"GPTQ needs calibration inputs for {self.name!r}, and none were recorded")
        if not self.scaled:
            self.H.mul_(2.0 / self.n)
            self.scaled = True
        return self.H

    def take(self) -> torch.Tensor:
        """H for one of the ``users`` layers sharing it: a copy, except for the last taker, which gets H itself
        (and the accumulator lets go of it)."""
        H = self.value()
        self.taken += 1
        if self.taken < self.users:
            return H.clone()
        self.H = None
        return H


def hessian(inputs: Sequence[tuple[torch.Tensor, ...]] | HessianAccumulator | None, in_features: int,
            name: str = "layer", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """H = 2/n sum x x^T over every calibration token (``(in, in)``, float32 unless ``dtype``), from the recorded
    inputs or an accumulator that saw them (`HessianAccumulator.take`: the caller may change it)."""
    if isinstance(inputs, HessianAccumulator):
        return inputs.take()
    if not inputs:
        raise ValueError(f"GPTQ needs calibration inputs for {name!r}, and none were recorded")
    acc = HessianAccumulator(in_features, name, dtype)
    for batch in inputs:
        acc.add(batch)
    return acc.take()


def inverse_hessian_factor(H: torch.Tensor, damp: float, name: str = "layer") -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``, the matrix GPTQ and SparseGPT feed
    errors back with. ``H`` is consumed (damped and factorized in place), so at most two K x K matrices are
    alive at once. Columns that saw no input (a zero diagonal) must have been given a unit diagonal."""
    H.diagonal().add_(damp * H.diagonal().mean())
    try:
        L = torch.linalg.cholesky(H, out=H)
        Hinv = torch.cholesky_inverse(L)
        del L, H
        return torch.linalg.cholesky(Hinv, upper=True, out=Hinv)
    except torch.linalg.LinAlgError:
        raise ValueError(f"the Hessian of {name!r} is not positive definite even with damp={damp}; "
                         f"use more calibration data or a larger damp") from None


def gptq_quantize(weight: torch.Tensor, inputs, fmt: fm.IntFormat, damp: float = 0.01, act_order: bool = False,
                  block_size: int = 128, name: str = "layer",
                  observer: Callable[[GPTQStep], None] | None = None,
                  static_groups: bool = False) -> dict[str, torch.Tensor]:
    """GPTQ-quantize ``weight`` ``(out, in)`` from its recorded ``inputs`` (or a `HessianAccumulator`); returns the
    `formats.IntFormat` tensors, plus ``"perm"`` (int32
    ``(in,)``) when act_order formed groups in activation order (the tensors then encode ``weight[:, perm]``).
    ``observer`` is called with a `GPTQStep` after every column."""
    if not isinstance(fmt, fm.IntFormat):
        raise TypeError(f"GPTQ quantizes to integer formats, got {fmt!r}")
    device = weight.device
    W = weight.detach().to("cpu", torch.float32).clone()                      # (out, K)
    rows, K = W.shape
    g = K if fmt.group_size is None else fmt.group_size
    G = -(-K // g)   # a group size that does not divide K leaves a short last group, as the stored format allows
    H = hessian(inputs, K, name).to(torch.float32)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(K)
    static = (act_order and static_groups) or fmt.group_size is None
    permuted = act_order and not static   # stored in processing order: groups are runs of processing order
    if static:  # group parameters from the original weights, indexed by original column
        scale_all, zero_all = fm.int_qparams(W, fmt)                          # (out, G)
    else:
        scale_all = torch.empty(rows, G)
        zero_all = torch.empty(rows, G, dtype=torch.int32)
    if act_order:
        W, H = W[:, perm], H[perm.unsqueeze(1), perm]
    Hinv = inverse_hessian_factor(H, damp, name)   # (H is consumed: one K x K matrix from here on)
    del H

    maxq = (1 << fmt.bits) - 1
    if not static:  # blocks hold whole groups, so a group's columns are all in the block when it starts
        block_size = max(1, block_size // g) * g
    codes = torch.empty(rows, K, dtype=torch.uint8)
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            pos = int(perm[col]) if static else col   # the stored column
            grp = pos // g
            if not static and pos % g == 0:  # a new group starts: choose its scale from the updated weights
                s, z = fm.int_qparams(W1[:, i:i + g], fm.IntFormat(fmt.bits, None, fmt.symmetric))
                scale_all[:, grp], zero_all[:, grp] = s[:, 0], z[:, 0]
            s = scale_all[:, grp]
            z = zero_all[:, grp].float()
            w = W1[:, i]
            u = torch.clamp(torch.round(w * (1.0 / s)) + z, 0, maxq)
            q = (u - z) * s
            codes[:, pos] = u.to(torch.uint8)
            err = (w - q) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
            if observer is not None:
                observer(GPTQStep(col, i1, i2, q, W, W1, Err1, Hinv))
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    out = fm.pack_int(codes, scale_all, zero_all, fmt)
    if permuted:
        out["perm"] = perm.to(torch.int32)
    return {k: v.to(device) for k, v in out.items()}
