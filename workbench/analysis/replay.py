"""Prefix replay: evaluate a one-layer change without recomputing the blocks that run before it.

Changing one layer inside block ``k`` of a stack (e.g. ``encoder.layer.k`` of a transformer) cannot
change what blocks ``0 .. k-1`` compute for the same inputs. `PrefixReplay` records, during one
reference evaluation, every output of each block of the model's longest stack of same-type blocks
(an ``nn.ModuleList``), and the order in which blocks and the studied layers ran. `skip_before(layer)`
then temporarily swaps the blocks that finished before ``layer`` first ran with modules that return
the recorded outputs, so an evaluation only computes from the changed block onwards. The results are
identical to a full evaluation (tests check it); if the evaluation does not call the blocks in the same
order as when recording, the replay raises instead of returning wrong numbers.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch import nn

__all__ = ["PrefixReplay", "find_blocks"]


def find_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks of the model's longest ``nn.ModuleList`` of same-type modules (or [])."""
    best: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            types = {type(m) for m in module}
            if len(types) == 1 and len(module) > len(best):
                best = [f"{name}.{i}" if name else str(i) for i in range(len(module))]
    return best


def _clone(value):
    """A copy of a block output (tensors cloned), so in-place changes downstream cannot alter a recording."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_clone(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _clone(v)) for k, v in value.items())
    return value


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


class _Replay(nn.Module):
    """Stands in for a block: returns its recorded outputs, one per call, in order."""

    def __init__(self, name: str, outputs: list, block: nn.Module | None = None):
        super().__init__()
        self.block_name = name
        self.outputs = outputs
        self.calls = 0
        # The replaced block, not registered as a child: containers that inspect their first block before
        # calling it (nn.TransformerEncoder reads ``layers[0].self_attn.batch_first``) still find what they read.
        object.__setattr__(self, "_block", block)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__.get("_block")
            if block is None:
                raise
            return getattr(block, name)

    def forward(self, *args, **kwargs):
        if self.calls >= len(self.outputs):
            raise RuntimeError(f"prefix replay: block {self.block_name!r} was called more often than when it was "
                               f"recorded ({len(self.outputs)} calls); the evaluation is not repeatable")
        out = self.outputs[self.calls]
        self.calls += 1
        return _clone(out)


class PrefixReplay:
    """See the module docstring. ``max_bytes`` caps the memory of the recorded outputs."""

    def __init__(self, model: nn.Module, layers: Sequence[str], max_bytes: int = 1 << 30):
        self.model = model
        self.blocks = find_blocks(model)
        self.layers = list(layers)
        self.max_bytes = max_bytes
        self.outputs: dict[str, list] = {}
        self.skippable: dict[str, int] = {}  # layer -> number of leading blocks that can be replayed
        self.status = "off: not recorded"

    def record(self, evaluate: Callable[[], object]):
        """Run ``evaluate()`` (the reference evaluation) once, recording block outputs and call order."""
        if not self.blocks:
            self.status = "off: the model has no stack of blocks"
            return evaluate()
        outputs: dict[str, list] = {b: [] for b in self.blocks}
        order: list[tuple[str, str]] = []  # (event, name) of the first model call
        model_calls = [0]
        handles = []

        def root_pre(_m, _a):
            model_calls[0] += 1

        handles.append(self.model.register_forward_pre_hook(root_pre))
        for b in self.blocks:
            block = self.model.get_submodule(b)

            def pre(_m, _a, _b=b):
                if model_calls[0] == 1:
                    order.append(("start", _b))

            def post(_m, _a, out, _b=b):
                outputs[_b].append(_clone(out))
                if model_calls[0] == 1:
                    order.append(("end", _b))
            handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
        for layer in self.layers:
            def lpre(_m, _a, _l=layer):
                if model_calls[0] == 1:
                    order.append(("layer", _l))
            handles.append(self.model.get_submodule(layer).register_forward_pre_hook(lpre))
        try:
            result = evaluate()
        finally:
            for h in handles:
                h.remove()
        counts = {len(v) for v in outputs.values()}
        expected = [e for b in self.blocks for e in (("start", b), ("end", b))]
        block_events = [e for e in order if e[0] != "layer"]
        total = sum(_tensor_bytes(v) for v in outputs.values())
        if len(counts) != 1 or counts == {0} or block_events != expected:
            self.status = "off: the blocks do not run once each, in order, per model call"
        elif total > self.max_bytes:
            self.status = (f"off: recorded outputs would take {total / 2**20:.0f} MiB "
                           f"(limit {self.max_bytes / 2**20:.0f})")
        else:
            self.outputs = outputs
            ended: list[str] = []
            for event, name in order:
                if event == "end":
                    ended.append(name)
                elif event == "layer" and name not in self.skippable:
                    self.skippable[name] = len(ended)
            self.status = f"on: {len(self.blocks)} blocks, {total / 2**20:.1f} MiB recorded"
        return result

    @contextlib.contextmanager
    def skip_before(self, layer: str):
        """Replay the blocks that finished before ``layer`` first ran (none if the replay is off)."""
        k = self.skippable.get(layer, 0) if self.outputs else 0
        originals = {b: self.model.get_submodule(b) for b in self.blocks[:k]}
        stand_ins = {b: _Replay(b, self.outputs[b], m) for b, m in originals.items()}
        for b, m in stand_ins.items():
            self.model.set_submodule(b, m)
        try:
            yield k
            for b, m in stand_ins.items():
                if m.calls != len(m.outputs):
                    raise RuntimeError(f"prefix replay: block {b!r} was called {m.calls} times, but "
                                       f"{len(m.outputs)} when recorded; the evaluation is not repeatable")
        finally:
            for b, m in originals.items():
                self.model.set_submodule(b, m)
