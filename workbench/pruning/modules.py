"""Pruned layers.

- `PrunedLinear` / `PrunedConv1d` / `PrunedConv2d` / `PrunedEmbedding` (and `pruned_class(cls)` for any
  subclass of those, e.g. EfficientNet's same-padding convolution): the layer itself, with its pruned weights
  stored as zeros *in* ``weight``. Whatever reads ``.weight`` - the layer's own ``forward`` (a subclass keeps
  its padding), PyTorch's fused ``TransformerEncoderLayer`` fast path, ``nn.MultiheadAttention`` reading
  ``out_proj.weight``, Hugging Face dtype checks, user code - sees the pruned weight, at no cost per forward.
  The mask is the weight's zero pattern (``.mask`` is ``weight != 0``), so it costs no bytes either: a pruned
  model is never larger than the original. While gradients are recorded, a hook on the weight zeroes the
  gradient of every zero weight, so fine-tuning never regrows a pruned weight (with SGD, momentum, Adam or
  decoupled weight decay alike: each moves a weight only by a multiple of its gradient or of itself).
  A kept weight that becomes exactly 0.0 while fine-tuning is pruned from then on.
- `SparseLinear`: the kept weights in CSR form (fp32 values, int32 column indices and row pointers), so
  `measure().size_bytes` really drops - once sparsity is high enough (CSR costs 8 bytes per kept weight,
  dense 4 per weight: it only pays above 50 %). It multiplies with ``torch.sparse.mm``.
- `SemiStructuredLinear`: a 2:4 weight stored compressed - the two kept values of every group of four along
  the input dimension (``values`` (out, in/2), the weight's dtype) and their positions (two 2-bit indices per
  group, two groups per byte: ``meta`` (out, in/8) uint8), i.e. 0.52x the dense bytes for fp32.
  ``kernel="reference"`` decompresses and runs a dense matmul (any device); ``kernel="semi_structured"``
  multiplies with ``torch.sparse.to_sparse_semi_structured`` (CUDA, fp16/bf16, shapes its kernels accept) and
  raises where that cannot run - the path is chosen, never switched silently.
"""
from __future__ import annotations

import enum
import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PrunedLinear", "PrunedConv1d", "PrunedConv2d", "PrunedEmbedding", "Pruned", "pruned_class",
           "PRUNABLE", "SparseLinear", "SemiStructuredLinear", "csr_bytes"]

PRUNABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)   # layers whose ``weight`` unstructured pruning masks


class _HookMark:
    """Marks a weight whose gradient hook is installed. Pickling drops tensor hooks, so the mark unpickles as
    False and the hook is installed again."""

    def __bool__(self) -> bool:
        return True

    def __reduce__(self):
        return (bool, ())


def _zero_grad_of_zeros(weight_ref, grad: torch.Tensor) -> torch.Tensor:
    weight = weight_ref()
    return grad if weight is None else grad * (weight.detach() != 0)


def freeze_zeros(weight: torch.Tensor) -> None:
    """Make the gradient of every zero entry of ``weight`` zero, whenever a gradient reaches it (idempotent)."""
    if weight.requires_grad and not getattr(weight, "_workbench_zero_grad", False):
        import weakref

        weight.register_hook(functools.partial(_zero_grad_of_zeros, weakref.ref(weight)))
        weight._workbench_zero_grad = _HookMark()


class Pruned:
    """Mixin of the pruned layers (see the module docstring): the parent's forward, pruned weights as zeros,
    their gradients held at zero. ``pruned_base`` is the class it prunes."""

    pruned_base: type = nn.Module

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():   # a copy made since (deepcopy, pickle, a new Parameter) gets its hook here
            freeze_zeros(self.weight)
        return super().forward(*args, **kwargs)

    @property
    def mask(self) -> torch.Tensor:
        """The keep-mask: True where the weight is not (yet) pruned."""
        return self.weight != 0

    def __setstate__(self, state):
        super().__setstate__(state)
        if "weight" in self._parameters and self._parameters["weight"] is not None:
            freeze_zeros(self._parameters["weight"])

    def __reduce_ex__(self, protocol):
        # a class made by `pruned_class` for a user's subclass is not importable by name: rebuild it from its base
        return (_new_pruned, (self.pruned_base,), self.__getstate__())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sparsity={1 - self.mask.float().mean().item():.3f}"


def _new_pruned(base: type) -> nn.Module:
    cls = pruned_class(base)
    return cls.__new__(cls)


class PrunedLinear(Pruned, nn.Linear):
    pruned_base = nn.Linear


class PrunedConv1d(Pruned, nn.Conv1d):
    pruned_base = nn.Conv1d


class PrunedConv2d(Pruned, nn.Conv2d):
    pruned_base = nn.Conv2d


class PrunedEmbedding(Pruned, nn.Embedding):
    pruned_base = nn.Embedding


_STATIC = {c.pruned_base: c for c in (PrunedLinear, PrunedConv1d, PrunedConv2d, PrunedEmbedding)}


@functools.cache
def pruned_class(base: type) -> type:
    """The pruned version of layer class ``base`` (a subclass of one of `PRUNABLE`): ``Pruned`` mixed into
    ``base`` itself, so ``isinstance`` checks, attributes and ``base.forward`` all stay."""
    if issubclass(base, Pruned):
        raise TypeError(f"{base.__name__} is already a pruned class")
    if base in _STATIC:
        return _STATIC[base]
    if not issubclass(base, PRUNABLE):
        raise TypeError(f"unstructured pruning handles subclasses of {[c.__name__ for c in PRUNABLE]}, "
                        f"not {base.__name__}")
    return type(f"Pruned{base.__name__}", (Pruned, base),
                {"pruned_base": base, "__module__": __name__, "__qualname__": f"Pruned{base.__name__}"})


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


def _pack_positions(mask: torch.Tensor) -> torch.Tensor:
    """(out, in) 2:4 mask -> (out, ceil(in / 8)) uint8: per group of 4 the positions p0 < p1 of its two kept
    values as p0 | p1 << 2 (4 bits), two groups per byte (the low nibble first)."""
    from workbench.quantization import packing

    rows, K = mask.shape
    pos = mask.reshape(rows, K // 4, 4).nonzero()[:, 2].reshape(rows, K // 4, 2)        # sorted per group
    codes = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.uint8)                           # (out, in/4)
    return packing.pack(codes, 4)


def _unpack_positions(meta: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of `_pack_positions`: (out, groups, 2) int64 positions within each group."""
    from workbench.quantization import packing

    codes = packing.unpack(meta, 4, groups).long()                                       # (out, in/4)
    return torch.stack([codes & 3, codes >> 2], dim=-1)


class SemiStructuredKernel(enum.StrEnum):
    """The path a `SemiStructuredLinear` runs, chosen once by `set_kernel` (a `StrEnum`: equals its name)."""

    REFERENCE = "reference"               # decompress to dense, then F.linear; runs anywhere
    SEMI_STRUCTURED = "semi_structured"   # torch.sparse.to_sparse_semi_structured (CUDA, fp16 / bf16)


SEMI_STRUCTURED_KERNELS = tuple(k.value for k in SemiStructuredKernel)


class SemiStructuredLinear(nn.Module):
    """y = x W^T + b with a 2:4 sparse W stored compressed (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=torch.float32, device=None,
                 kernel: str = "reference"):
        super().__init__()
        if in_features % 4:
            raise ValueError(f"2:4 storage needs the input dimension to be a multiple of 4, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("values", torch.zeros(out_features, in_features // 2, dtype=dtype, device=device))
        self.register_buffer("meta", torch.zeros(out_features, -(-in_features // 8), dtype=torch.uint8,
                                                 device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self._sparse = None  # (version key, torch semi-structured weight) for kernel="semi_structured"
        self.kernel = SemiStructuredKernel.REFERENCE
        if kernel != "reference":
            self.set_kernel(kernel)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None,
                   name: str = "linear") -> "SemiStructuredLinear":
        rows, K = weight.shape
        if K % 4:
            raise ValueError(f"{name!r}: 2:4 storage needs the input dimension to be a multiple of 4, got {K}")
        per_group = mask.reshape(rows, K // 4, 4).sum(-1)
        if not bool((per_group == 2).all()):
            bad = int((per_group != 2).sum())
            raise ValueError(f"{name!r}: 2:4 storage needs exactly 2 kept weights in every group of 4 along the "
                             f"input dimension; {bad} group(s) are not (prune with wb.prune.NM(2, 4))")
        new = cls(K, rows, bias is not None, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            new.values.copy_(weight.detach()[mask.bool()].reshape(rows, K // 2))       # row-major: group order
            new.meta.copy_(_pack_positions(mask.bool()))
            if bias is not None:
                new.bias.copy_(bias.detach())
        return new

    def dense_weight(self) -> torch.Tensor:
        rows, K = self.out_features, self.in_features
        pos = _unpack_positions(self.meta, K // 4)                                        # (out, in/4, 2)
        w = torch.zeros(rows, K // 4, 4, dtype=self.values.dtype, device=self.values.device)
        w.scatter_(2, pos, self.values.reshape(rows, K // 4, 2))
        return w.reshape(rows, K)

    def set_kernel(self, kernel: str) -> "SemiStructuredLinear":
        if kernel not in SEMI_STRUCTURED_KERNELS:
            raise ValueError(f"SemiStructuredLinear: kernel must be one of {SEMI_STRUCTURED_KERNELS}, got {kernel!r}")
        kernel = SemiStructuredKernel(kernel)
        if kernel is SemiStructuredKernel.SEMI_STRUCTURED:
            self._semi_structured_weight()   # raises here, not at the first forward, if it cannot run
        self.kernel = kernel
        return self

    def _semi_structured_weight(self):
        key = (self.values.data_ptr(), self.values._version, self.meta._version)
        if self._sparse is not None and self._sparse[0] == key:
            return self._sparse[1]
        device, dtype = self.values.device, self.values.dtype
        if device.type != "cuda":
            raise RuntimeError(f"SemiStructuredLinear: kernel='semi_structured' needs CUDA "
                               f"(torch.sparse.to_sparse_semi_structured); the layer is on {device}. "
                               f"kernel='reference' decompresses and runs anywhere.")
        if dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(f"SemiStructuredLinear: kernel='semi_structured' runs fp16/bf16 weights, this one is "
                               f"{dtype}; cast the layer first (wb.precision.Cast) or use kernel='reference'")
        try:
            weight = torch.sparse.to_sparse_semi_structured(self.dense_weight())
        except (RuntimeError, ValueError) as e:   # e.g. a shape its kernels do not accept: say so, do not fall back
            raise RuntimeError(f"SemiStructuredLinear ({self.out_features}x{self.in_features}, {dtype}): "
                               f"to_sparse_semi_structured refused it: {e}") from e
        self._sparse = (key, weight)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.kernel is SemiStructuredKernel.SEMI_STRUCTURED:
            return F.linear(x, self._semi_structured_weight(), bias)
        return F.linear(x, self.dense_weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 2:4, kernel={self.kernel}"
