"""HQQ (Badri & Shaji, 2023): data-free half-quadratic optimisation of the zero points.

With scales fixed from the min/max range, HQQ minimises the sparsity-promoting error ``||W - Q^-1(Q(W))||_p^p``
(p < 1, robust to outliers) over the per-group zero points z by alternating two closed-form steps:

    W_e = shrink_p(W - Q^-1(Q(W)); beta)               (proximal step on the error, lp shrinkage)
    z   = mean_group( Q(W) - (W - W_e) / scale )       (the zero point that best explains W - W_e)

with beta growing by ``kappa`` each iteration and early exit once the mean absolute error stops falling.
No calibration data is used. Zero points are real-valued (stored as fp16: `IntFormat(float_zero=True)`).
"""
from __future__ import annotations

import torch

from workbench.quantization import formats as fm
from workbench.quantization.primitives import choose_qparams, fp16_scale

__all__ = ["hqq_quantize"]


def _shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    return torch.sign(x) * torch.relu(x.abs() - (1.0 / beta) * x.abs().clamp(min=1e-8).pow(p - 1))


def hqq_quantize(weight: torch.Tensor, fmt: fm.IntFormat, iters: int = 20, p: float = 0.7, beta: float = 10.0,
                 kappa: float = 1.01) -> dict[str, torch.Tensor]:
    if fmt.symmetric or not fmt.float_zero:
        raise ValueError("HQQ optimises real-valued zero points: use IntFormat(symmetric=False, float_zero=True)")
    W = weight.detach().float()
    rows, K = W.shape
    g, G = fmt.groups(K)   # a group size that does not divide K leaves a short last group (zero-padded, as RTN)
    Wg = fm.padded_groups(W, g)                                                # (rows * G, g)
    real = fm.padded_groups(torch.ones(1, K), g).expand(rows, G, g).reshape(-1, g)   # 1: real, 0: padding
    count = real.sum(dim=1, keepdim=True)
    maxq = (1 << fmt.bits) - 1
    scale, zp = choose_qparams(Wg, fmt.bits, symmetric=False, signed=False)  # unsigned codes 0..maxq
    scale = fp16_scale(scale)
    zero = zp.float()
    best_err, best_zero = float("inf"), zero
    for _ in range(iters):
        Wq = torch.clamp(torch.round(Wg / scale + zero), 0, maxq)
        Wr = (Wq - zero) * scale
        err = float(((Wg - Wr).abs() * real).sum() / real.sum())
        if err >= best_err:
            break
        best_err, best_zero = err, zero
        We = _shrink_lp(Wg - Wr, beta, p)
        zero = ((Wq - (Wg - We) / scale) * real).sum(dim=1, keepdim=True) / count
        beta *= kappa
    zero = best_zero.to(torch.float16).float()                                 # what is stored
    codes = torch.clamp(torch.round(Wg / scale + zero), 0, maxq).to(torch.uint8).reshape(rows, G * g)[:, :K]
    return fm.pack_int(codes, scale.reshape(rows, G), zero.reshape(rows, G), fmt)
