"""Calibration observers: watch tensors, then propose a quantization range.

Each observer has ``observe(x)`` (call it on every calibration tensor) and ``qparams(bits, symmetric,
signed) -> (scale, zero_point)``, both per group of a `Granularity` (per-tensor by default; per-token
makes no sense for a range shared across batches, so it is refused). They are small and usable on
weights as well as activations:

- `MinMax`: the running min and max.
- `MovingAverageMinMax`: exponential moving average of each batch's min / max (``momentum``).
- `Percentile`: the ``q``-th percentile of |x| (symmetric) or the (1-q, q) percentiles, averaged over batches.
- `MSE`: searches a clipping ratio of the min/max range that minimises the quantization MSE of the values seen.
- `Histogram`: TensorRT-style entropy calibration: the clipping threshold that minimises the KL
  divergence between the histogram of |x| and its quantized version (per-tensor).
"""
from __future__ import annotations

import math

import torch

from workbench.plans.registry import Accumulator
from workbench.quantization.primitives import (
    Granularity,
    PerTensor,
    PerToken,
    choose_qparams,
    dequantize,
    qrange,
    quantize,
    to_groups,
)

__all__ = ["Observer", "MinMax", "MovingAverageMinMax", "Percentile", "MSE", "Histogram", "OBSERVERS",
           "ObserverAccumulator"]


class Observer:
    """Base class: tracks per-group ``lo``/``hi`` and turns them into qparams."""

    def __init__(self, granularity: Granularity = PerTensor()):
        if isinstance(granularity, PerToken):
            raise ValueError("an observer keeps one range across batches; PerToken ranges are computed at run "
                             "time (dynamic quantization), not observed")
        self.granularity = granularity
        self.lo: torch.Tensor | None = None
        self.hi: torch.Tensor | None = None
        self.count = 0

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{type(self).__name__}.observe expects a floating-point tensor, got {x!r:.60}")
        if not torch.isfinite(x).all():
            raise ValueError(f"{type(self).__name__}.observe got NaN or Inf values")
        return to_groups(x.detach().float(), self.granularity)

    def observe(self, x: torch.Tensor) -> None:
        xg = self._groups(x)
        lo, hi = xg.amin(dim=1), xg.amax(dim=1)
        self._update(lo, hi, xg)
        self.count += 1

    def _update(self, lo: torch.Tensor, hi: torch.Tensor, xg: torch.Tensor) -> None:
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lo is None:
            raise RuntimeError(f"{type(self).__name__} has observed no data; call observe() on calibration tensors")
        return self.lo, self.hi

    def qparams(self, bits: int = 8, symmetric: bool = True, signed: bool = True):
        lo, hi = self.range()
        return choose_qparams(lo.reshape(-1, 1), bits, symmetric, signed, min_val=lo, max_val=hi)


class MinMax(Observer):
    """Running minimum and maximum."""


class MovingAverageMinMax(Observer):
    def __init__(self, granularity: Granularity = PerTensor(), momentum: float = 0.01):
        super().__init__(granularity)
        if not 0 < momentum <= 1:
            raise ValueError(f"momentum must be in (0, 1], got {momentum}")
        self.momentum = momentum

    def _update(self, lo, hi, xg):
        if self.lo is None:
            self.lo, self.hi = lo, hi
        else:
            self.lo = self.lo + self.momentum * (lo - self.lo)
            self.hi = self.hi + self.momentum * (hi - self.hi)


_QUANTILE_MAX = 1 << 24   # torch.quantile's input limit


def _quantile(xg: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(xg, q, dim=1)`` (linear interpolation), the same numbers, for any width.

    A tail quantile needs only the order statistics on either side of rank ``q (n - 1)``: ``torch.topk`` of
    the ``n - rank`` largest (or ``rank + 2`` smallest) values finds them without sorting each row, and has no
    input-size limit (``torch.quantile`` stops at 2^24 values). The rank, its floor /
    ceiling, the weight and the final ``lerp`` are computed as ``torch.quantile`` computes them (q and the
    rank in the tensor's dtype); tests compare the two bit for bit."""
    n = xg.shape[1]
    rank = torch.tensor(q, dtype=xg.dtype) * (n - 1)
    below, above = int(rank.item()), math.ceil(rank.item())
    weight = rank - below
    if min(n - below, above + 1) > max(n // 8, 1):   # a central quantile: a sort is as cheap
        if n > _QUANTILE_MAX:  # past torch.quantile's limit: estimate on a seeded random subset
            xg = xg[:, torch.randperm(n, generator=torch.Generator().manual_seed(n))[:_QUANTILE_MAX]]
        return torch.quantile(xg, q, dim=1)
    if n - below <= above + 1:      # upper tail: the n - below largest, descending
        top = torch.topk(xg, n - below, dim=1, largest=True, sorted=True).values
        lo_v, hi_v = top[:, n - 1 - below], top[:, n - 1 - above]
    else:                           # lower tail: the above + 1 smallest, ascending
        bottom = torch.topk(xg, above + 1, dim=1, largest=False, sorted=True).values
        lo_v, hi_v = bottom[:, below], bottom[:, above]
    return torch.lerp(lo_v, hi_v, weight)


class Percentile(Observer):
    def __init__(self, granularity: Granularity = PerTensor(), q: float = 99.99):
        super().__init__(granularity)
        if not 50 < q <= 100:
            raise ValueError(f"percentile q must be in (50, 100], got {q}")
        self.q = q
        self._sum_lo = self._sum_hi = None

    def _update(self, lo, hi, xg):
        hi_q = _quantile(xg, self.q / 100)
        lo_q = _quantile(xg, 1 - self.q / 100)
        self._sum_lo = lo_q if self._sum_lo is None else self._sum_lo + lo_q
        self._sum_hi = hi_q if self._sum_hi is None else self._sum_hi + hi_q
        n = self.count + 1
        self.lo, self.hi = self._sum_lo / n, self._sum_hi / n


class MSE(Observer):
    """Keeps the values (subsampled to ``max_samples`` per group) and searches a clipping ratio."""

    def __init__(self, granularity: Granularity = PerTensor(), grid: int = 80, min_ratio: float = 0.2,
                 max_samples: int = 65536):
        super().__init__(granularity)
        self.grid, self.min_ratio, self.max_samples = grid, min_ratio, max_samples
        self._samples: list[torch.Tensor] = []

    def _update(self, lo, hi, xg):
        super()._update(lo, hi, xg)
        if xg.shape[1] > self.max_samples:
            idx = torch.randperm(xg.shape[1], generator=torch.Generator().manual_seed(self.count))[:self.max_samples]
            xg = xg[:, idx]
        self._samples.append(xg)

    def qparams(self, bits: int = 8, symmetric: bool = True, signed: bool = True):
        lo, hi = self.range()
        xg = torch.cat(self._samples, dim=1)
        qmin, qmax = qrange(bits, signed)
        best_err = torch.full_like(lo, float("inf"))
        best = choose_qparams(xg, bits, symmetric, signed, min_val=lo, max_val=hi)
        for i in range(self.grid + 1):
            ratio = 1.0 - (1.0 - self.min_ratio) * i / self.grid
            scale, zp = choose_qparams(xg, bits, symmetric, signed, min_val=lo * ratio, max_val=hi * ratio)
            err = (dequantize(quantize(xg, scale, zp, qmin, qmax, torch.int32), scale, zp) - xg).pow(2).mean(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = (torch.where(better[:, None], scale, best[0]), torch.where(better[:, None], zp, best[1]))
        return best


class Histogram(Observer):
    """Entropy (KL) calibration on a histogram of |x| (per-tensor; symmetric ranges)."""

    def __init__(self, granularity: Granularity = PerTensor(), bins: int = 2048):
        if not isinstance(granularity, PerTensor):
            raise ValueError("the Histogram (KL) observer is per-tensor")
        super().__init__(granularity)
        self.bins = bins
        self.hist: torch.Tensor | None = None
        self.edge = 0.0

    def _update(self, lo, hi, xg):
        super()._update(lo, hi, xg)
        a = xg.abs().flatten()
        amax = float(a.max())
        if self.hist is None:
            self.edge = max(amax, 1e-12)
            self.hist = torch.histc(a, self.bins, 0, self.edge)
            return
        if amax > self.edge:  # grow the range: re-bin the old histogram onto the wider edges
            factor = math.ceil(amax / self.edge)
            old = torch.cat([self.hist, torch.zeros(self.bins * (factor - 1))]).reshape(self.bins, factor).sum(1)
            self.hist, self.edge = old, self.edge * factor
        self.hist += torch.histc(a, self.bins, 0, self.edge)

    def threshold(self, bits: int = 8) -> float:
        """The |x| clipping threshold with the smallest KL divergence (TensorRT's entropy calibration)."""
        if self.hist is None:
            raise RuntimeError("Histogram has observed no data")
        hist = self.hist.double()
        levels = 1 << (bits - 1)  # positive levels of a symmetric signed grid
        best_kl, best_i = float("inf"), self.bins
        for i in range(levels, self.bins + 1, max(1, (self.bins - levels) // 256)):
            p = hist[:i].clone()
            p[-1] += hist[i:].sum()                     # clipped mass lands in the last bin
            # quantize: merge the i bins into `levels` chunks, spread each chunk evenly over its non-empty bins
            chunks = torch.tensor_split(hist[:i], levels)
            q = torch.cat([torch.where(c > 0, c.sum() / (c > 0).sum().clamp(min=1), torch.zeros_like(c))
                           for c in chunks])
            mask = p > 0
            if q[mask].le(0).any():
                continue
            pn, qn = p / p.sum(), q / q.sum()
            kl = float((pn[mask] * torch.log(pn[mask] / qn[mask])).sum())
            if kl < best_kl:
                best_kl, best_i = kl, i
        return best_i * self.edge / self.bins

    def qparams(self, bits: int = 8, symmetric: bool = True, signed: bool = True):
        t = torch.tensor([self.threshold(bits)])
        lo, hi = self.range()
        lo_c = torch.maximum(lo, -t)
        hi_c = torch.minimum(hi, t)
        return choose_qparams(lo_c.reshape(-1, 1), bits, symmetric, signed, min_val=lo_c, max_val=hi_c)


OBSERVERS = {"minmax": MinMax, "moving_average": MovingAverageMinMax, "percentile": Percentile, "mse": MSE,
             "histogram": Histogram}


class ObserverAccumulator(Accumulator):
    """An observer fed one calibration batch at a time (``add`` is what a forward pre-hook calls), so a
    layer's inputs need not be kept; remembers the inputs' device for the scale it proposes."""

    def __init__(self, observer: Observer):
        self.observer = observer
        self.device: torch.device | None = None

    def add(self, batch: tuple[torch.Tensor, ...]) -> None:
        self.device = batch[0].device
        self.observer.observe(batch[0].float())
