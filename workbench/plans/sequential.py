"""Sequential calibration: compress a model block by block, each block calibrated on the activations that the
already-compressed blocks before it produce (the GPTQ paper's procedure and llm-compressor's default pipeline).

    blocks = find_blocks(model)                  # e.g. model.layers.0 ... model.layers.N-1 of a HF decoder
    first  = capture_block_inputs(model, blocks[0], batches)   # per batch: (args, kwargs) of block 0
    for block in blocks:
        record the inputs of the block's calibrated layers   (run the block on hidden states)
        compress those layers and put them in place          (`transform_layer`, `swap_layers`)
        hidden = block(hidden, **kwargs)                     (the compressed block's outputs feed the next)
    calibrate the remaining layers (e.g. ``lm_head``) in one pass of the now-compressed model

Memory is bounded by one block: the hidden states of every calibration batch, plus the recorded inputs of
one block's layers, instead of the inputs of every layer of the model at once.

The first block's arguments are taken as Hugging Face passes them (attention masks, rotary position
embeddings, ``position_ids``, ...) by a forward pre-hook that records ``(args, kwargs)`` and raises `_Stop`, so
the rest of the model never runs; the non-hidden arguments are reused for every block (they are the same for
all blocks of a stack). A key/value cache is not carried (each block call gets none): calibration is one
full-sequence forward per batch.

`find_blocks` finds the block list: the `nn.ModuleList` that holds the most calibrated layers (Hugging Face's
``model.layers``, ``encoder.layer``, ``transformer.h``, or any other `ModuleList` of blocks). A model without
one is calibrated from the original model's activations, and `apply` says so (a warning and the report).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.plans.layers import _call, batch_error

__all__ = ["Pipeline", "BlockList", "find_blocks", "runs_as_chain", "capture_block_inputs", "BlockInputs",
           "run_block", "block_output"]


class Pipeline(enum.Enum):
    """How calibrated layers get their inputs.

    SEQUENTIAL (default): block by block, from the outputs of the blocks already compressed before them.
    ORIGINAL: every layer's inputs recorded in one pass of the original (uncompressed) model."""

    SEQUENTIAL = "sequential"
    ORIGINAL = "original"

    @classmethod
    def of(cls, value: "Pipeline | str") -> "Pipeline":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"pipeline must be one of {[p.value for p in cls]}, got {value!r}") from None


@dataclass(frozen=True)
class BlockList:
    """The blocks of a model, in execution order: ``container`` is the `nn.ModuleList`'s name, ``names`` the
    full names of its children."""

    container: str
    names: tuple[str, ...]

    def block_of(self, layer: str) -> str | None:
        """The block that holds ``layer`` (None if the layer is outside every block)."""
        for b in self.names:
            if layer == b or layer.startswith(b + "."):
                return b
        return None


def find_blocks(model: nn.Module, layers: Sequence[str]) -> BlockList | None:
    """The `nn.ModuleList` whose children hold the most of ``layers``; None if there is none. Nested lists (a list
    inside a block) count for the outer list only. Whether the blocks really run as a chain is `runs_as_chain`'s
    question."""
    best: tuple[int, str, tuple[str, ...]] | None = None
    taken: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(t + ".") for t in taken):
            continue
        children = tuple(f"{name}.{c}" if name else c for c, _ in module.named_children())
        holding = [b for b in children if any(n == b or n.startswith(b + ".") for n in layers)]
        if not holding:
            continue
        taken.append(name)
        count = sum(1 for n in layers if any(n.startswith(b + ".") or n == b for b in children))
        if best is None or count > best[0]:
            best = (count, name, children)
    return None if best is None else BlockList(best[1], best[2])


class _Stop(Exception):
    """Raised by the first block's pre-hook: the rest of the model need not run."""


class _Handles:
    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class BlockInputs:
    """One calibration batch at a block boundary: the hidden states (the argument that flows from block to
    block) and the other arguments - the same for every block, or (``per_block``) each block's own, for models
    whose blocks take different ones (alternating sliding-window and full attention masks)."""

    hidden: torch.Tensor
    args: tuple                    # the positional arguments after the hidden states
    kwargs: dict[str, Any]
    hidden_key: str | None = None  # the keyword the hidden states came in (None: first positional argument)
    per_block: list | None = None  # blocks 1.. : (args, kwargs, hidden_key) each (the tensors shared, not copied)

    def for_block(self, i: int) -> "BlockInputs":
        """The arguments block ``i`` takes, with these hidden states."""
        if i == 0 or self.per_block is None:
            return self
        args, kwargs, key = self.per_block[i - 1]
        return BlockInputs(self.hidden, args, kwargs, key)


def _is_cache(value: Any) -> bool:
    # a key/value cache object (Hugging Face's Cache): calibration never carries one from block to block
    return not isinstance(value, (torch.Tensor, tuple, list, dict)) and hasattr(value, "get_seq_length")


def _detach(value: Any) -> Any:
    if _is_cache(value):
        return None
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    return value


def _block_inputs(block: str, args: tuple, kwargs: dict) -> BlockInputs:
    """A block call's arguments as the pipeline keeps them: the hidden states apart, the rest detached, no cache."""
    kwargs = {k: _detach(v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    if args and isinstance(args[0], torch.Tensor):
        return BlockInputs(args[0].detach(), tuple(_detach(a) for a in args[1:]), kwargs)
    key = "hidden_states" if isinstance(kwargs.get("hidden_states"), torch.Tensor) else next(
        (k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    if key is None:
        raise ValueError(f"block {block!r} was called without a tensor argument to calibrate on")
    return BlockInputs(kwargs.pop(key), tuple(_detach(a) for a in args), kwargs, key)


def capture_block_inputs(model: nn.Module, block: str, batches: Sequence, progress: bool = True,
                         on_batch: Callable[[int], None] | None = None,
                         every: BlockList | None = None) -> list[BlockInputs]:
    """Run each batch through ``model`` up to ``block`` and record that block's arguments (the rest of the
    model does not run). ``every``: the model's blocks, whose own other arguments are recorded too (`BlockInputs`'s
    ``per_block``; the original model then runs through its last block, each block's hidden states dropped).
    ``on_batch(i)`` is called after batch ``i`` was recorded."""
    records: list[BlockInputs] = []

    def hook(mod, args, kwargs):
        records.append(_block_inputs(block, args, kwargs))
        if every is None:
            raise _Stop
        records[-1].per_block = []

    handles = [model.get_submodule(block).register_forward_pre_hook(hook, with_kwargs=True)]
    for name in (every.names[1:] if every is not None else ()):
        def other(mod, args, kwargs, _name=name):
            found = _block_inputs(_name, args, kwargs)   # (its hidden states are not kept)
            per_block = records[-1].per_block
            if per_block is None:
                raise ValueError(f"block {_name!r} ran before {block!r}")
            per_block.append((found.args, found.kwargs, found.hidden_key))

        handles.append(model.get_submodule(name).register_forward_pre_hook(other, with_kwargs=True))
    if every is not None:
        def last(mod, args, kwargs, out):
            raise _Stop
        handles.append(model.get_submodule(every.names[-1]).register_forward_hook(last, with_kwargs=True))
    handle = _Handles(handles)
    try:
        with torch.inference_mode():
            for i, batch in enumerate(tqdm(batches, desc="calibration: first block inputs", leave=False,
                                           disable=not progress)):
                n = len(records)
                try:
                    _call(model, batch)
                except _Stop:
                    pass
                except Exception as e:
                    raise batch_error(i, batch, model, e) from e
                others = len(records[-1].per_block or ()) if records else 0
                if len(records) != n + 1 or (every is not None and others != len(every.names) - 1):
                    raise ValueError(f"calibration batch {i} did not reach block {block!r} (it ran "
                                     f"{len(records) - n} times) or its blocks once each; this model cannot be "
                                     f"calibrated block by block: use pipeline='original'")
                if on_batch is not None:
                    on_batch(i)
    finally:
        handle.remove()
    return records


def block_output(output: Any) -> torch.Tensor:
    """The hidden states a block returns: the tensor itself, or the first element of a tuple (BERT, GPT-2)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(output, Mapping) and isinstance(next(iter(output.values()), None), torch.Tensor):
        return next(iter(output.values()))
    raise TypeError(f"a block returned {type(output).__name__}; expected a tensor or a tuple starting with one")


def run_block(block: nn.Module, inputs: BlockInputs) -> torch.Tensor:
    """The block's output hidden states for one recorded batch (inference mode)."""
    with torch.inference_mode():
        if inputs.hidden_key is None:
            out = block(inputs.hidden, *inputs.args, **inputs.kwargs)
        else:
            out = block(*inputs.args, **{inputs.hidden_key: inputs.hidden}, **inputs.kwargs)
    return block_output(out)


def runs_as_chain(model: nn.Module, blocks: BlockList, batch, own_arguments: list | None = None) -> str | None:
    """Check on one batch that the blocks can be calibrated one after the other; returns why not, or None.

    Each block must run once, in order, and take the previous block's output as its hidden states (a list of
    parallel branches does not). Then each block is run alone the way the pipeline will run it - on the hidden
    states it received, with the *first* block's other arguments - and must give the output it gave inside the
    model: a block whose other arguments differ from the first block's (a Swin stage's spatial size, a
    downsampling stage) or that reads state from outside its arguments is caught here, before anything is
    compressed, instead of crashing or silently mis-calibrating later. With ``own_arguments`` (a list), a model
    whose blocks replay right with their *own* other arguments (alternating sliding-window and full attention
    masks) runs as a chain too, and True is appended to the list: the pipeline must then keep each block's
    arguments (`capture_block_inputs`'s ``every``). The model stops after the last block (an LM head's logits for
    a whole batch can outweigh a block)."""
    seen: list[tuple[int, torch.Tensor | None]] = []
    calls: list[BlockInputs | str] = []
    handles = []
    for i, name in enumerate(blocks.names):
        def pre(mod, args, kwargs, _i=i, _name=name):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            seen.append((_i, x))
            try:
                calls.append(_block_inputs(_name, args, kwargs))
            except ValueError as e:
                calls.append(str(e))

        def post(mod, args, kwargs, out, _i=i):
            seen.append((_i, block_output(out)))
            if _i == len(blocks.names) - 1:
                raise _Stop   # what follows the blocks (e.g. an LM head's logits) need not run
        m = model.get_submodule(name)
        handles += [m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post, with_kwargs=True)]
    was_training = model.training
    model.eval()   # as the pipeline runs it (dropout off): a replay must be able to give the same output
    try:
        with torch.inference_mode():
            _call(model, batch)
    except _Stop:
        pass
    except Exception as e:
        model.train(was_training)
        return f"a calibration batch could not be run through {type(model).__name__}: {type(e).__name__}: {e}"
    finally:
        for h in handles:
            h.remove()
    try:
        why = _checked_chain(model, blocks, seen, calls)
        if why is not None and own_arguments is not None and _checked_chain(model, blocks, seen, calls, True) is None:
            own_arguments.append(True)
            return None
        return why
    finally:
        model.train(was_training)


def _checked_chain(model: nn.Module, blocks: BlockList, seen: list, calls: list, own: bool = False) -> str | None:
    order = [i for i, _ in seen]
    if order != [i for i in range(len(blocks.names)) for _ in (0, 1)]:
        return f"the children of {blocks.container!r} do not each run once, in order"
    for i in range(1, len(blocks.names)):
        out, nxt = seen[2 * i - 1][1], seen[2 * i][1]
        if out is None or not isinstance(nxt, torch.Tensor) or out.shape != nxt.shape or not torch.equal(out, nxt):
            return f"{blocks.names[i]!r} does not take the output of {blocks.names[i - 1]!r} as its input"
    return _replays(model, blocks, calls, [seen[2 * i + 1][1] for i in range(len(blocks.names))], own)


def _replays(model: nn.Module, blocks: BlockList, calls: list, outputs: list[torch.Tensor],
             own: bool = False) -> str | None:
    """Why some block, run alone on its recorded hidden states with the first block's other arguments, does not
    give its output inside the model (None: every block does)."""
    first = calls[0]
    if isinstance(first, str):
        return first
    for name, call, expected in zip(blocks.names, calls, outputs):
        if isinstance(call, str):
            return call
        alone = call if own else BlockInputs(call.hidden, first.args, first.kwargs, first.hidden_key)
        try:
            got = run_block(model.get_submodule(name), alone)
        except Exception as e:
            return (f"{name!r} cannot run alone with the arguments {blocks.names[0]!r} received "
                    f"({type(e).__name__}: {str(e)[:160]})")
        if not isinstance(expected, torch.Tensor) or got.shape != expected.shape or not torch.allclose(
                got.float(), expected.float(), rtol=1e-4, atol=1e-5 * (1.0 + float(expected.abs().max()))):
            return (f"{name!r} run alone with the arguments {blocks.names[0]!r} received does not give the output "
                    f"it gives inside the model (its other arguments differ, or it reads state outside them)")
    return None
