"""Dynamic W8A8 LSTM and GRU: int8 per-channel weights, int8 per-token activations, drop-ins for ``nn.LSTM`` /
``nn.GRU`` at inference.

Each layer and direction holds two `W8A8Linear` children (so the int8 data, the scales and the matmul paths are
those of the rest of the package):

- ``ih_l{k}[_reverse]``: the input-to-hidden projection, run once for the whole sequence (``T * B`` rows in one
  int8 GEMM - where the time goes, and what batches well);
- ``hh_l{k}[_reverse]``: the hidden-to-hidden projection, run at every step on the ``B`` rows of the state.

Both quantize their input per token (per row) at run time. The LSTM's gate rows are stored in the order
``i, f, o, g`` (``nn.LSTM`` uses ``i, f, g, o``) so the three sigmoid gates are one contiguous slice, and its two
biases are summed into the input projection. A GRU keeps both biases where ``nn.GRU`` has them (``b_hn`` sits
inside the reset gate's product).

``kernel="cpu"`` runs `workbench_kernels.w8a8_cpu` (oneDNN's int8 GEMM with fused quantization and rescale),
``"reference"`` the same math in fp32 anywhere; ``"auto"`` picks "cpu" for CPU modules. The step loop is
Python: per step one int8 GEMM of ``B`` rows and ~7 element-wise ops, so at small batches the fixed cost of each
GEMM call, not its arithmetic, sets the speed (torch.ao's fbgemm LSTM runs its whole loop in C++ and is faster;
``python -m workbench.benchmarks.recurrent`` measures both). ``torch._int_mm`` is fast only on CPUs with VNNI
(AVX-512 VNNI
or AVX-VNNI); on AVX2-only CPUs oneDNN runs a generic loop and "cpu" is far slower than fp32.

Supported: ``num_layers``, ``bidirectional``, ``batch_first``, ``bias``, unbatched inputs, initial states
``h0`` (and ``c0``), ``dropout`` (between layers, in training mode only, as in PyTorch). Refused with an error:
``proj_size > 0`` and ``PackedSequence`` inputs. Inference only: no gradient flows through the int8 matmuls.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from workbench.quantization.modules import KernelPath, W8A8Linear, choose_kernel

__all__ = ["DynamicQuantLSTM", "DynamicQuantGRU"]


def _w8a8(weight: torch.Tensor, bias: torch.Tensor | None, name: str, kernel: str) -> W8A8Linear:
    """A W8A8Linear computing ``x @ weight.T + bias`` (weight quantized per output row)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.detach().float(), requires_grad=False)
    lin.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
    return W8A8Linear.from_float(lin, name=name, kernel=kernel)


class _DynamicQuantRNN(nn.Module):
    """The shared structure: options, children, input handling and the layer/direction loop; the subclasses
    give the gate count, the conversion of PyTorch's weights and one direction's time loop."""

    rounds_activations = True   # (per step to int8; see WeightOnlyLinear.rounds_activations)

    GATES: int = 0
    FLOAT: type = nn.Module

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 kernel: str = "auto"):
        super().__init__()
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout, self.bidirectional = bias, batch_first, dropout, bidirectional
        self.proj_size = 0
        G, H = self.GATES * hidden_size, hidden_size
        for name, k in self._names():
            rows_in = input_size if k == 0 else H * self.num_directions
            setattr(self, "ih" + name, W8A8Linear(rows_in, G, bias=bias))
            setattr(self, "hh" + name, W8A8Linear(H, G, bias=bias and self.GATES == 3))   # GRU keeps b_hh
        self.set_kernel(kernel)

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    def _names(self) -> list[tuple[str, int]]:
        """Child-name suffixes ``_l{k}[_reverse]`` with their layer, in PyTorch's order (layer, direction)."""
        return [(f"_l{k}{'_reverse' if d else ''}", k) for k in range(self.num_layers)
                for d in range(self.num_directions)]

    @classmethod
    def skeleton(cls, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 kernel: str = "auto"):
        """The module's structure with uninitialised int8 data, for ``load_state_dict`` of saved weights."""
        return cls(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, kernel)

    @classmethod
    def from_float(cls, rnn: nn.Module, name: str | None = None, kernel: str = "auto"):
        """The quantized equivalent of ``rnn`` (an ``nn.LSTM`` / ``nn.GRU``); ``name`` is used in errors."""
        name = name or type(rnn).__name__
        if not isinstance(rnn, cls.FLOAT):
            raise TypeError(f"{cls.__name__}.from_float: {name!r} is a {type(rnn).__name__}, not an "
                            f"{cls.FLOAT.__name__}")
        if getattr(rnn, "proj_size", 0):
            raise ValueError(f"{cls.__name__}: {name!r} has proj_size={rnn.proj_size}; LSTMs with projections are "
                             "not supported")
        new = cls(rnn.input_size, rnn.hidden_size, rnn.num_layers, rnn.bias, rnn.batch_first, rnn.dropout,
                  rnn.bidirectional, kernel)
        for sfx, _ in new._names():
            w_ih, w_hh = getattr(rnn, "weight_ih" + sfx), getattr(rnn, "weight_hh" + sfx)
            b_ih = getattr(rnn, "bias_ih" + sfx) if rnn.bias else None
            b_hh = getattr(rnn, "bias_hh" + sfx) if rnn.bias else None
            (w_ih, b_ih), (w_hh, b_hh) = cls._convert(w_ih.detach(), b_ih, w_hh.detach(), b_hh)
            setattr(new, "ih" + sfx, _w8a8(w_ih, b_ih, f"{name}.weight_ih{sfx}", new.kernel))
            setattr(new, "hh" + sfx, _w8a8(w_hh, b_hh, f"{name}.weight_hh{sfx}", new.kernel))
        return new.train(rnn.training)

    def set_kernel(self, kernel: str):
        """Choose the int8 matmul path for every child ("cpu", "reference" or "auto"); raises if it cannot run."""
        self.kernel = choose_kernel(type(self).__name__, kernel, ("reference", "cpu"), self.ih_l0.qweight_t.device,
                                    int8_gemm=True)
        for m in self.children():
            m.set_kernel(self.kernel)
        return self

    def _matmul(self, lin: W8A8Linear):
        """``x -> lin(x)`` without the module call's overhead on the CPU path (it runs once per step)."""
        if self.kernel is not KernelPath.CPU:
            return lin
        from workbench_kernels.w8a8_cpu import linear_unchecked

        qw, scale = lin.qweight_t, lin.scale.float()
        bias = None if lin.bias is None else lin.bias.detach().float()
        return lambda x: linear_unchecked(x, qw, scale, bias, None)

    def _check_input(self, x, hx):
        if isinstance(x, PackedSequence):
            raise TypeError(f"{type(self).__name__}: PackedSequence inputs are not supported; pass a padded tensor "
                            "(nn.utils.rnn.pad_packed_sequence) and read each sequence's last step yourself")
        if x.dim() not in (2, 3) or x.shape[-1] != self.input_size:
            raise ValueError(f"{type(self).__name__}: expected input (T, {self.input_size}) or a batched 3-D input "
                             f"with {self.input_size} features, got {tuple(x.shape)}")

    def _run(self, x: torch.Tensor, states: list[tuple[torch.Tensor, ...]]):
        """x: (T, B, in); states[layer * D + d]: that direction's initial state tensors, each (B, H).
        Returns (output (T, B, D * H), final states in the same order)."""
        finals = []
        D = self.num_directions
        for k in range(self.num_layers):
            if k > 0 and self.dropout > 0 and self.training:
                x = F.dropout(x, self.dropout, training=True)
            outs = []
            for d in range(D):
                sfx = f"_l{k}{'_reverse' if d else ''}"
                gx = self._matmul(getattr(self, "ih" + sfx))(x)                     # (T, B, G*H), all steps
                out, final = self._direction(gx, states[k * D + d], self._matmul(getattr(self, "hh" + sfx)),
                                             reverse=d == 1)
                outs.append(out)
                finals.append(final)
            x = outs[0] if D == 1 else torch.cat(outs, dim=2)                      # (T, B, D*H)
        return x, finals

    def _forward(self, x: torch.Tensor, hx: tuple[torch.Tensor, ...] | None, n_states: int):
        """Layout handling shared by LSTM (two state tensors) and GRU (one)."""
        self._check_input(x, hx)
        batched = x.dim() == 3
        if not batched:
            x = x.unsqueeze(1)                                                     # (T, 1, in)
            hx = None if hx is None else tuple(h.unsqueeze(1) for h in hx)
        elif self.batch_first:
            x = x.transpose(0, 1)                                                  # (T, B, in)
        T, B, _ = x.shape
        LD, H = self.num_layers * self.num_directions, self.hidden_size
        if hx is None:
            hx = tuple(x.new_zeros(LD, B, H) for _ in range(n_states))
        for h in hx:
            if tuple(h.shape) != (LD, B, H):
                raise ValueError(f"{type(self).__name__}: initial states must be {(LD, B, H) if batched else (LD, H)}"
                                 f", got {tuple(h.shape if batched else h.shape[::2])}")
        dtype, x = x.dtype, x.float()
        out, finals = self._run(x, [tuple(h[i].float() for h in hx) for i in range(LD)])
        out = out.to(dtype)
        hn = tuple(torch.stack([f[j] for f in finals]).to(dtype) for j in range(n_states))   # each (LD, B, H)
        if not batched:
            return out.squeeze(1), tuple(h.squeeze(1) for h in hn)
        return (out.transpose(0, 1) if self.batch_first else out), hn

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, bias={self.bias}, "
                f"batch_first={self.batch_first}, bidirectional={self.bidirectional}, weights=int8 per channel, "
                f"activations=int8 per token (dynamic), kernel={self.kernel}")


class DynamicQuantLSTM(_DynamicQuantRNN):
    """``nn.LSTM`` with int8 weights and int8 dynamic activations (see the module docstring).
    ``forward(input, (h0, c0)=None) -> (output, (h_n, c_n))`` with ``nn.LSTM``'s shapes."""

    GATES = 4
    FLOAT = nn.LSTM

    @staticmethod
    def _convert(w_ih, b_ih, w_hh, b_hh):
        """PyTorch's (i, f, g, o) rows -> (i, f, o, g); the two biases summed into the input projection."""
        def reorder(t):
            i, f, g, o = t.chunk(4, dim=0)
            return torch.cat([i, f, o, g])
        bias = None if b_ih is None else reorder(b_ih.detach() + b_hh.detach())
        return (reorder(w_ih), bias), (reorder(w_hh), None)

    def _direction(self, gx, state, hh, reverse: bool):
        H = self.hidden_size
        h, c = state                                                       # (B, H) each
        out = [None] * gx.shape[0]
        for t in (range(gx.shape[0] - 1, -1, -1) if reverse else range(gx.shape[0])):
            gates = hh(h).add_(gx[t])                                      # (B, 4H): i, f, o | g, fresh
            s = gates[:, :3 * H].sigmoid_()                                # in place: fewer allocations
            c = torch.addcmul(s[:, H:2 * H] * c, s[:, :H], gates[:, 3 * H:].tanh_())
            h = c.tanh().mul_(s[:, 2 * H:])
            out[t] = h
        return torch.stack(out), (h, c)                                    # (T, B, H)

    def forward(self, input: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None):
        out, (h, c) = self._forward(input, hx, 2)
        return out, (h, c)


class DynamicQuantGRU(_DynamicQuantRNN):
    """``nn.GRU`` with int8 weights and int8 dynamic activations (see the module docstring).
    ``forward(input, h0=None) -> (output, h_n)`` with ``nn.GRU``'s shapes."""

    GATES = 3
    FLOAT = nn.GRU

    @staticmethod
    def _convert(w_ih, b_ih, w_hh, b_hh):
        return (w_ih, b_ih), (w_hh, b_hh)                                  # rows r, z, n as in PyTorch

    def _direction(self, gx, state, hh, reverse: bool):
        H = self.hidden_size
        (h,) = state                                                       # (B, H)
        out = [None] * gx.shape[0]
        for t in (range(gx.shape[0] - 1, -1, -1) if reverse else range(gx.shape[0])):
            gi, gh = gx[t], hh(h)                                          # (B, 3H) each: r, z, n
            rz = (gi[:, :2 * H] + gh[:, :2 * H]).sigmoid_()
            n = torch.addcmul(gi[:, 2 * H:], rz[:, :H], gh[:, 2 * H:]).tanh_()
            h = torch.addcmul(n, rz[:, H:], h - n)                         # (1 - z) n + z h
            out[t] = h
        return torch.stack(out), (h,)

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None):
        out, (h,) = self._forward(input, None if hx is None else (hx,), 1)
        return out, h
