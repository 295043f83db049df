"""What every kernel file shares: interpreter detection, autotune configs, input checks, availability.

- ``INTERPRET``: true when ``TRITON_INTERPRET=1`` was set before this module was imported (Triton reads the
  variable when ``@triton.jit`` decorates a function, so it must be set before the kernel modules import).
  Under the interpreter kernels run on CPU tensors with numpy: small shapes only, one autotune config
  (``@triton.autotune`` benchmarks, which the interpreter cannot), and no bf16 operands to ``tl.dot``.
- ``configs(full, interpret)``: the autotune list for the current mode.
- ``check(...)``: launcher-side validation with errors that name the argument, so bad input never reaches a
  Triton compile error or a silent wrong result.
- ``triton_available(device)``: whether a Triton kernel can run on ``device`` here (a CUDA GPU, or any
  device under the interpreter).
"""
from __future__ import annotations

import os
from typing import Iterable

import torch

__all__ = ["INTERPRET", "configs", "check", "check_same_device", "triton_available", "require_triton", "cdiv"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def configs(full: Iterable[dict], interpret: dict, num_warps: int = 4, num_stages: int = 3) -> list:
    """``triton.Config`` objects: every entry of ``full`` on a GPU, only ``interpret`` under the interpreter.

    Each dict maps block-size names to values; ``num_warps`` / ``num_stages`` keys override the defaults."""
    import triton

    def make(d: dict) -> "triton.Config":
        d = dict(d)
        return triton.Config(d, num_warps=d.pop("num_warps", num_warps), num_stages=d.pop("num_stages", num_stages))

    if INTERPRET:
        return [triton.Config(dict(interpret), num_warps=1, num_stages=1)]
    return [make(d) for d in full]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check(name: str, t: torch.Tensor, *, dtypes: tuple[torch.dtype, ...] | None = None, ndim: int | None = None,
          shape: tuple[int | None, ...] | None = None, contiguous: bool = True, op: str = "kernel") -> None:
    """Raise a clear error when tensor argument ``name`` of ``op`` is not what the kernel needs."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape, strict=True)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{op}: {name} must have shape {want}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (call .contiguous() first); got strides {t.stride()}")


def check_same_device(op: str, **tensors: torch.Tensor | None) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"{op}: all tensors must be on one device, got " +
                         ", ".join(f"{n} on {d}" for n, d in devices.items()))
    return first


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether a Triton kernel can run on ``device``: a CUDA device, or anything under the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if INTERPRET:
        return True
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def require_triton(op: str, device: torch.device) -> None:
    if not triton_available(device):
        raise RuntimeError(f"{op}: the Triton kernel needs a CUDA GPU (or TRITON_INTERPRET=1 for testing on the "
                           f"CPU); the tensors are on {device}. Use kernel='cpu' or kernel='reference' there.")
