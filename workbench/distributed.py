"""Data-parallel fine-tuning across processes: the ``workers=N`` option of the training loops.

    wb.training.fit_classifier(model, "digits", epochs=3, lr=3e-3, workers=2)    # also wb.distill.fit / fit_embeddings

`launch` starts ``N`` processes with ``torch.multiprocessing`` (the ``spawn`` start method, as ``torchrun`` would),
joins them in one ``torch.distributed`` process group (gloo for CPU models, NCCL for CUDA models, one GPU per
worker) and runs the same training function in each, the model wrapped in ``DistributedDataParallel``. Every
worker draws the same shuffled order (same seed) and takes its own share of each global batch (`shard`), so the
global batch - and with it the learning-rate schedule - is what a single process would use; DDP averages the
gradients, each local loss being weighted by its share of the global batch so that a short last batch counts as
it does in one process. Rank 0 writes the trained weights to a temporary safetensors file that is loaded back into
the caller's model and its return value (the history: a list or a DataFrame) comes back as JSON - nothing is
unpickled.

What differs from one process: BatchNorm statistics are computed per worker on the local share of the batch
(DDP broadcasts rank 0's running statistics; SyncBatchNorm would need CUDA), and float sums are taken in another
order. Tested here: CPU / gloo with 2 workers on 2 cores. NCCL (CUDA models) follows the same path with
``cuda:rank`` per worker but needs as many GPUs as workers and has not been run with more than one.

``strategy="fsdp"`` shards instead of replicating (PyTorch's FSDP2, ``fully_shard``): every block of the model -
each child of an ``nn.ModuleList`` holding parameters, e.g. a decoder's layers - and then the model itself, so each
worker keeps 1/N of the parameters, gradients and AdamW state (the state is 2x the parameters: most of training's
memory) and all-gathers one block's parameters at a time for its forward and backward. Only rank 0 receives the
weights; the other workers receive the model's structure on the meta device, allocate just their shards and get
rank 0's values broadcast into them, so N workers hold one copy of the weights between them at start-up (rank 0's,
until it is sharded), not N. Losses, batches and schedules are the DDP ones (the runs agree with one process up to
float-sum order); the trained weights are gathered to a full state dict for the hand-back. A forward without
gradients (a probe, a validation pass) reshards the root at once: FSDP2 otherwise keeps its gathered parameters
for a backward that never comes, and the next training step would not reach the shards. Tested here: CPU / gloo,
2 workers, on the digits MLP / CNN, distillation with per-epoch validation, and tiny-lm; NCCL sharding is the
same code, not run on more than one GPU.
"""
from __future__ import annotations

import json
import os
import pickle
import socket
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["launch", "check_workers", "check_batch_size", "check_strategy", "prepare", "shard", "shard_batch",
           "global_mean", "is_worker", "strategy_here", "shard_model", "STRATEGIES"]

STRATEGIES = ("ddp", "fsdp")
_STRATEGY_ENV = "WORKBENCH_PARALLEL_STRATEGY"   # set in each worker by `launch`, read by `prepare`


def check_workers(workers: int) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    return workers


def check_batch_size(batch_size: int, workers: int) -> None:
    """A trainer whose every worker needs a share of each batch refuses, before spawning, a batch smaller than the
    number of workers."""
    if batch_size < workers:
        raise ValueError(f"batch_size={batch_size} cannot be shared by {workers} workers: use batch_size >= workers "
                         f"(each global batch is split between them)")


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


def is_worker() -> bool:
    """True inside a process started by `launch` (a process group is up)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if is_worker() else (0, 1)


def prepare(model: nn.Module) -> tuple[nn.Module, tuple[int, int]]:
    """``(net, (rank, world))``: inside a worker, ``net`` is ``model`` wrapped in DDP (call it for the forward
    passes that train; read and restore weights on ``model``), or with ``strategy="fsdp"`` ``model`` itself,
    sharded in place (`shard_model`); outside, ``net`` is ``model`` and ``(0, 1)``. Build the optimizer after
    this call (FSDP replaces the parameters)."""
    if not is_worker():
        return model, (0, 1)
    if os.environ.get(_STRATEGY_ENV) == "fsdp":
        return shard_model(model), _rank_world()
    from torch.nn.parallel import DistributedDataParallel as DDP

    from workbench.tasks.base import model_device

    device = model_device(model)
    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, find_unused_parameters=False), _rank_world()


def strategy_here() -> str | None:
    """Inside a worker, the strategy it runs ("ddp" or "fsdp"); None outside."""
    return (os.environ.get(_STRATEGY_ENV) or "ddp") if is_worker() else None


def shard_model(model: nn.Module, sync: bool = True) -> nn.Module:
    """FSDP2 in place: each block (a child with parameters of an ``nn.ModuleList``) is its own shard group, then
    the model (the rest: embeddings, heads, small layers). Parts already sharded stay as they are. ``sync``: first
    give every worker rank 0's values of what is not sharded yet (a module each worker created with its own
    random initialisation, as DDP does when it wraps a model). Returns ``model``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if sync and is_worker():
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.device.type != "meta" and not hasattr(t, "device_mesh"):   # (a DTensor is sharded already)
                    dist.broadcast(t.data, 0)

    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for block in module:
                if not isinstance(block, FSDPModule) and any(True for _ in block.parameters()):
                    fully_shard(block)
    if not isinstance(model, FSDPModule):
        fully_shard(model)
        # FSDP2 keeps the root's parameters gathered after a forward (for the backward that follows); after a
        # forward without gradients (a shape probe, a validation pass) the next training forward would then use
        # those gathered copies, and the sharded parameters would never get a gradient: reshard right away
        model.register_forward_hook(_reshard_without_grad)
    return model


def _reshard_without_grad(module: nn.Module, args, output) -> None:
    if not torch.is_grad_enabled():
        module.reshard()   # type: ignore[operator]   # (an FSDPModule)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict on the CPU: gathered from the shards under FSDP (a collective: every worker calls it),
    the model's own otherwise. Tensors are cloned, so no two names share storage (safetensors refuses that)."""
    if os.environ.get(_STRATEGY_ENV) == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}


def shard(idx: torch.Tensor, where: tuple[int, int]) -> tuple[torch.Tensor, float]:
    """This worker's share of the global batch ``idx`` and the weight (local size × world / global size) that
    makes DDP's gradient average equal the gradient of the global-batch mean."""
    rank, world = where
    if world == 1:
        return idx, 1.0
    part = idx[rank::world]
    return part, len(part) * world / len(idx)


def global_mean(weighted: torch.Tensor, where: tuple[int, int]) -> torch.Tensor:
    """The global batch's mean loss from each worker's weighted local mean (one all-reduce per step), so every
    worker sees the same value - and stops together on a NaN."""
    if where[1] == 1:
        return weighted
    import torch.distributed as dist

    out = weighted.clone()
    dist.all_reduce(out)
    return out / where[1]


def shard_batch(batch: Any, where: tuple[int, int]) -> tuple[Any, float]:
    """`shard` for one batch of model inputs: a tensor, a tuple of tensors or a dict of keyword tensors (every
    tensor split along dim 0; other values kept)."""
    rank, world = where
    if world == 1:
        return batch, 1.0
    first = batch if isinstance(batch, torch.Tensor) else next(
        t for t in (batch.values() if isinstance(batch, dict) else batch) if isinstance(t, torch.Tensor))
    n = len(first)
    if n < world:
        raise ValueError(f"a batch of {n} samples cannot be shared by {world} workers; use a larger batch_size")

    def cut(t):
        return t[rank::world] if isinstance(t, torch.Tensor) and t.ndim and len(t) == n else t

    if isinstance(batch, torch.Tensor):
        part = cut(batch)
    elif isinstance(batch, dict):
        part = {k: cut(v) for k, v in batch.items()}
    else:
        part = type(batch)(cut(t) for t in batch)
    m = len(cut(first))
    return part, m * world / n


def _pickled(name: str, value: Any) -> bytes:
    try:
        return pickle.dumps(value)
    except Exception as e:  # any pickling failure: say which argument and why
        raise TypeError(f"workers > 1 sends the {name} ({type(value).__name__}) to each worker process by pickling "
                        f"it, which failed: {type(e).__name__}: {e}. Use workers=1, or make it picklable (no "
                        f"lambdas, open files or locally defined classes in it)") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _encode(result: Any) -> str:
    """Rank 0's return value as JSON (the training loops return a list of losses or a DataFrame)."""
    import pandas as pd

    if isinstance(result, pd.DataFrame):
        return json.dumps({"dataframe": result.to_dict(orient="split"), "attrs": result.attrs})
    return json.dumps({"value": result})


def _decode(text: str) -> Any:
    import pandas as pd

    data = json.loads(text)
    if "dataframe" in data:
        split = data["dataframe"]
        df = pd.DataFrame(split["data"], columns=split["columns"], index=split["index"])
        df.attrs.update(data["attrs"])
        return df
    return data["value"]


def _shard_and_load(model: nn.Module, rank: int, device: torch.device) -> nn.Module:
    """FSDP start-up: only rank 0 holds the weights (the others hold meta tensors); every worker shards the
    model, the others allocate just their shards, and rank 0's full state is broadcast into them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = {k: v.detach() for k, v in model.state_dict().items()} if rank == 0 else {}
    kept = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    shard_model(model, sync=False)
    if rank != 0:
        model.to_empty(device=device)
        with torch.no_grad():   # non-persistent buffers (not in a state dict) were real all along
            for n, b in model.named_buffers():
                if n in kept:
                    b.copy_(kept[n])
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def _worker(rank: int, world: int, port: int, fn: Callable, payloads: tuple[bytes, bytes], out_dir: str,
            threads: int, strategy: str, device_type: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    # our own bytes from `launch`: each worker gets its own copy (FSDP: only rank 0 a copy with weights)
    model, args, kwargs = pickle.loads(payloads[0] if rank == 0 else payloads[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{_STRATEGY_ENV: strategy})
    device = torch.device(f"cuda:{rank}" if device_type == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        if strategy != "fsdp" or rank == 0:
            model.to(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        if strategy == "fsdp":
            _shard_and_load(model, rank, device)
        with _threads(threads):
            result = fn(model, *args, **kwargs)
        state = _full_state(model)   # (every worker takes part in gathering FSDP's shards)
        if rank == 0:
            save_file(state, str(Path(out_dir) / "model.safetensors"))
            (Path(out_dir) / "result.json").write_text(_encode(result))
        dist.barrier()   # past it, every worker has taken part in every step and rank 0's files are written
        (Path(out_dir) / f"done-{rank}").touch()
    finally:
        dist.destroy_process_group()
    # The run is finished and on disk. A spawned process would go on to the interpreter's teardown, which also
    # destroys the process group's C++ threads; a C++ thread destroyed while still joinable aborts the process
    # ("terminate called without an active exception"), and a CI run once lost two data-parallel runs to that
    # abort in a worker (where in the worker was not recorded). Nothing is left to do: leave without teardown (nor
    # atexit handlers: what the training function returns and the weights are on disk by now).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_GRACE_S = 5.0   # seconds the other workers get to exit on their own after one fails or on an interrupt


def _finished(out_dir: str, workers: int) -> bool:
    """Every worker got past the final barrier (so rank 0's weights and result are complete)."""
    return all((Path(out_dir) / f"done-{r}").exists() for r in range(workers))


def _join(context, out_dir: str, workers: int) -> None:
    """Wait for the workers of ``context`` (torch.multiprocessing's ProcessContext). A worker's failure is raised
    unless every worker had passed the final barrier (`_finished`): then it failed while shutting down, the result
    is complete and stands, with a warning. On an interrupt no worker outlives the call."""
    import torch.multiprocessing as mp

    try:
        # after a failure the others get _GRACE_S to finish on their own before they are terminated: a worker past
        # the final barrier but not yet at its marker must not be killed into a false failure
        while not context.join(grace_period=_GRACE_S):
            pass
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        if not _finished(out_dir, workers):
            raise
        warnings.warn(f"data-parallel worker {e.error_index} failed after the run had finished ({e}); every "
                      f"worker had passed the final barrier, so the trained weights are complete",
                      RuntimeWarning, stacklevel=3)
    except BaseException:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
        for p in context.processes:   # gone before the caller's temporary folder is removed
            p.join(_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()
        raise


def launch(fn: Callable, model: nn.Module, args: tuple, kwargs: dict, workers: int,
           threads: int | None = None, strategy: str = "ddp") -> Any:
    """Run ``fn(model, *args, **kwargs)`` in ``workers`` DDP (or, ``strategy="fsdp"``, FSDP) processes (see the
    module docstring); the trained weights of rank 0 are loaded into ``model`` and rank 0's return value is
    returned. ``fn`` must be a module-level function that calls `prepare` and `shard` (the training loops here
    do)."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from workbench.plans.layers import empty_copy
    from workbench.tasks.base import model_device

    check_workers(workers)
    check_strategy(strategy)
    device = model_device(model)
    if device.type == "cuda" and workers > torch.cuda.device_count():
        raise ValueError(f"workers={workers} needs one GPU each; {torch.cuda.device_count()} visible")
    _pickled("model", model)
    for i, a in enumerate(args):
        _pickled(f"argument {i + 1} after the model", a)
    for k, v in kwargs.items():
        _pickled(f"argument {k!r}", v)
    # Plain pickle bytes, not the objects: torch.multiprocessing would move the tensors into shared memory, and
    # the workers' optimizers would then all step the same parameters.
    payload = pickle.dumps((model, args, kwargs))
    # FSDP: the workers other than rank 0 get the model's structure only (meta tensors), and their shards from
    # rank 0 (`_shard_and_load`): N workers hold one copy of the weights between them, not N
    others = pickle.dumps((empty_copy(model), args, kwargs)) if strategy == "fsdp" else payload
    per_worker = threads or max(1, torch.get_num_threads() // workers)
    with tempfile.TemporaryDirectory(prefix="workbench-ddp-") as out_dir:
        context = mp.start_processes(_worker, args=(workers, _free_port(), fn, (payload, others), out_dir,
                                                    per_worker, strategy, device.type),
                                     nprocs=workers, join=False, start_method="spawn")
        _join(context, out_dir, workers)
        result = _decode((Path(out_dir) / "result.json").read_text())
        model.load_state_dict(load_file(str(Path(out_dir) / "model.safetensors")), strict=True)
    model.eval()
    return result
