"""`AdamW8bit`: AdamW whose two moment estimates are stored in 8 bits, block-wise (as in bitsandbytes and
torchao's low-bit optimizers), a drop-in for ``torch.optim.AdamW``.

Each state tensor is split into blocks of ``block_size`` values; a block keeps one fp32 absmax and one byte per
value. The byte indexes a logarithmic code book: magnitudes from the absmax down to ``1e-6`` (first moment,
signed: 127 levels per sign + zero) or ``1e-12`` (second moment, unsigned: 255 levels + zero) of it, about 11 %
apart, so every value keeps ~5 % relative precision however small it is - which a linear 8-bit grid cannot do
for Adam's second moment (a tiny v rounded to zero would blow up the update). Each step dequantizes, does the
exact AdamW update in fp32 (bias correction, decoupled weight decay), and quantizes back. Parameters with fewer
than ``min_8bit_size`` elements keep fp32 states. `state_bytes` reports what the states really occupy.
"""
from __future__ import annotations

import math

import torch

__all__ = ["AdamW8bit", "state_bytes", "quantize_blockwise", "dequantize_blockwise"]

_SIGNED_FLOOR = 1e-6
_UNSIGNED_FLOOR = 1e-12


def _levels(signed: bool) -> tuple[int, float]:
    return (127, _SIGNED_FLOOR) if signed else (255, _UNSIGNED_FLOOR)


def quantize_blockwise(x: torch.Tensor, signed: bool, block_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes of x's flattened, zero-padded blocks (n_blocks, block_size), fp32 absmax (n_blocks, 1))."""
    flat = x.detach().float().reshape(-1)
    pad = (-flat.numel()) % block_size
    blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, block_size)
    absmax = blocks.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    n, floor = _levels(signed)
    mag = (blocks.abs() / absmax).clamp(min=floor * 1e-3)
    step = math.log(floor) / (n - 1)                          # log-ratio between levels (negative)
    level = torch.round(torch.log(mag) / step)               # 0 = absmax ... n-1 = floor
    code = torch.where(mag < floor / 2, torch.zeros_like(level), n - level.clamp(0, n - 1))  # 1..n, 0 = zero
    if signed:
        code = torch.where(blocks < 0, code + 128, code)     # bit 7: sign
    return code.to(torch.uint8), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool, shape: torch.Size) -> torch.Tensor:
    n, floor = _levels(signed)
    c = codes.to(torch.int32)
    negative = (c >= 128) if signed else torch.zeros_like(c, dtype=torch.bool)
    mag_code = torch.where(negative, c - 128, c).float()
    step = math.log(floor) / (n - 1)
    mag = torch.where(mag_code > 0, torch.exp((n - mag_code) * step), torch.zeros_like(mag_code))
    values = torch.where(negative, -mag, mag) * absmax
    return values.reshape(-1)[: math.prod(shape)].reshape(shape)


class AdamW8bit(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 block_size: int = 256, min_8bit_size: int = 4096):
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.block_size, self.min_8bit_size = block_size, min_8bit_size

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                state = self.state[p]
                eight_bit = p.numel() >= self.min_8bit_size
                if not state:
                    state["step"] = 0
                    if eight_bit:
                        zeros = torch.zeros_like(g)
                        state["m_codes"], state["m_absmax"] = quantize_blockwise(zeros, True, self.block_size)
                        state["v_codes"], state["v_absmax"] = quantize_blockwise(zeros, False, self.block_size)
                    else:
                        state["m"], state["v"] = torch.zeros_like(g), torch.zeros_like(g)
                state["step"] += 1
                if eight_bit:
                    m = dequantize_blockwise(state["m_codes"], state["m_absmax"], True, g.shape)
                    v = dequantize_blockwise(state["v_codes"], state["v_absmax"], False, g.shape)
                else:
                    m, v = state["m"], state["v"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                t = state["step"]
                denom = (v / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_((m / (1 - b1 ** t)).to(p.dtype), denom.to(p.dtype), value=-group["lr"])
                if eight_bit:
                    state["m_codes"], state["m_absmax"] = quantize_blockwise(m, True, self.block_size)
                    state["v_codes"], state["v_absmax"] = quantize_blockwise(v, False, self.block_size)
        return loss


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (step counters included)."""
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total
