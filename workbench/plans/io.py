"""`save` / `load`: a compressed model as one safetensors file.

The file holds the model's tensors (safetensors: no pickle, nothing executed on load) and, as string
metadata, the applied plans as JSON plus the zoo name of the base model. `load` rebuilds the
compressed structure on a base model (given, or the zoo model named in the file) from the plans
alone (`build_skeleton`), checks that every tensor's name, shape and dtype match that structure
exactly, and only then fills in the values.

Memory: the structure is built with meta tensors (no copy of the base's weights), and each tensor is read
from the memory-mapped file straight into its place, so loading needs about the file's bytes on top of the
base. Alignment: safetensors packs tensors back to back after a header padded to 8 bytes, so a mapped tensor
may start anywhere on a 4- or 8-byte boundary; oneDNN picks another (bitwise different) convolution or GEMM path
for data that is not 64-byte aligned on some CPUs (measured on a Zen 5). `aligned` copies just those tensors
into fresh 64-byte-aligned memory (PyTorch's CPU allocator), the others stay mapped: outputs after `load` are
bit-identical to the saved model's on every CPU, at the cost of one copy of the misaligned tensors' bytes (the
file format is unchanged: safetensors allows no padding between tensors).

The base itself may hold no weights: build it under `empty_weights` (parameters on the meta device,
buffers real) and an int4 file of a model larger than memory's fp copy loads in about the int4 bytes.

File format versions: 2 (this one) stores GPTQ act-order layers with a ``perm`` buffer (groups in activation
order); version 1 files, whose act-order groups were those of the original columns, load with
``static_groups=True``, which is what they hold.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from workbench.plans.apply import applied_plans, build_skeleton
from workbench.plans.plan import Plan

__all__ = ["save", "load", "empty_weights", "aligned", "save_aligned", "ALIGNMENT", "PAD_SUFFIX", "FILE_FORMAT",
           "FILE_FORMAT_VERSION"]

FILE_FORMAT = "workbench.model"
FILE_FORMAT_VERSION = 3   # 3: tensors start on ALIGNMENT boundaries (PAD_SUFFIX tensors fill the gaps)
_READS = ("1", "2", "3")


# bytes: where PyTorch's CPU allocator starts every tensor, and what oneDNN's and our kernels' fastest paths expect
ALIGNMENT = 64


PAD_SUFFIX = "\x00pad"   # a tensor named NAME + PAD_SUFFIX holds zeros that keep the next tensor aligned
_PAD_KEY = "alignment_padding"   # a metadata value of spaces that puts the first tensor on a boundary


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape),
            t.stride())


def _header(path: Path) -> tuple[int, dict]:
    """The safetensors header of ``path``: its length in bytes and the JSON (read as JSON, nothing executed)."""
    import struct

    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return n, json.loads(fh.read(n))


def save_aligned(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> Path:
    """Write ``tensors`` with safetensors so that every tensor's data starts on an `ALIGNMENT` boundary of the
    file (hence of its memory map): a tensor mapped by `load` is used where it lies, never copied.

    safetensors writes the tensors by dtype, then name, with no gaps, after a JSON header padded to 8 bytes. So
    each tensor whose bytes are not a multiple of `ALIGNMENT` is followed by a zero tensor of its dtype named
    ``NAME + PAD_SUFFIX`` (the next name in that order), and the metadata gets a value of spaces that makes the
    header end on a boundary. The layout is checked on the written file (its header read back); should a future
    safetensors order the tensors differently, the file is written once more with what the header says."""
    from safetensors.torch import save_file

    path = Path(path)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(PAD_SUFFIX):
            raise ValueError(f"tensor name {name!r} ends with the padding suffix {PAD_SUFFIX!r}")
        out[name] = t
        extra = -t.numel() * t.element_size() % ALIGNMENT
        if extra:
            out[name + PAD_SUFFIX] = torch.zeros(extra // t.element_size(), dtype=t.dtype)
    meta = {**metadata, _PAD_KEY: ""}
    for _ in range(2):
        save_file(out, str(path), metadata=meta)
        n, header = _header(path)
        starts = [v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"]
        if (8 + n) % ALIGNMENT == 0 and all(o % ALIGNMENT == 0 for o in starts):
            return path
        # the JSON without safetensors' trailing spaces, and the padding that ends it at 8 bytes before a boundary
        raw = len(json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode())
        meta[_PAD_KEY] += " " * ((ALIGNMENT - 8 - raw) % ALIGNMENT)
    return path   # (a layout safetensors will not give: still a valid file, `load` copies what is off a boundary)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is not on the CPU or its data starts on an `ALIGNMENT` boundary, else a contiguous copy
    in fresh memory (which PyTorch's allocator aligns) - for tensors mapped from a file at arbitrary offsets."""
    if t.device.type != "cpu" or t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@contextlib.contextmanager
def empty_weights():
    """Modules built inside get their parameters on the meta device (no memory, no initialisation cost);
    buffers - e.g. rotary position tables computed at construction - are real. A base for `load`::

        with wb.empty_weights():
            base = transformers.LlamaForCausalLM(config)
        model = wb.load("llama-int4.safetensors", base=base)
    """
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register   # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original   # type: ignore[method-assign]


def save(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write ``model``'s tensors and its applied plans to ``path`` (a .safetensors file, every tensor on an
    `ALIGNMENT` boundary: `save_aligned`)."""

    from workbench.models import source_of

    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module to save, got {type(model).__name__}")
    path = Path(path)
    meta = {
        "format": FILE_FORMAT,
        "format_version": str(FILE_FORMAT_VERSION),
        "plans": json.dumps([p.to_dict() for p in applied_plans(model)]),
        "source": source_of(model) or "",
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "torch_version": torch.__version__,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    for name, t in model.state_dict().items():   # one copy of a shared tensor (tied weights), as safetensors wants
        key = _storage_key(t)
        if key not in seen:
            seen[key] = name
            tensors[name] = t.contiguous()   # K-major W8A8 codes are views
    return save_aligned(tensors, path, meta)


def _read_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a malformed header
        raise ValueError(f"{path} is not a safetensors file: {e}") from None
    if meta.get("format") != FILE_FORMAT:
        raise ValueError(f"{path} is a safetensors file but not one written by wb.save "
                         f"(its metadata has no \"format\": \"{FILE_FORMAT}\")")
    if meta.get("format_version") not in _READS:
        raise ValueError(f"{path} has workbench file format version {meta.get('format_version')!r}; "
                         f"this workbench reads versions {', '.join(_READS)}")
    return meta


def _plans_from(meta: dict[str, str], path: Path) -> list[Plan]:
    try:
        raw = json.loads(meta.get("plans", ""))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: the plans metadata is not valid JSON ({e})") from None
    if not isinstance(raw, list):
        raise ValueError(f"{path}: the plans metadata must be a JSON list")
    if meta.get("format_version") == "1":   # act-order groups were those of the original columns then
        for p in raw:
            for entry in p.get("entries", []) if isinstance(p, dict) else []:
                cfg = entry.get("config") if isinstance(entry, dict) else None
                if isinstance(cfg, dict) and cfg.get("act_order") is True and "static_groups" not in cfg:
                    cfg["static_groups"] = True
    try:
        return [Plan.from_dict(p) for p in raw]
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: invalid plan in metadata: {e}") from None


def load(path: str | os.PathLike, base: nn.Module | str | None = None) -> nn.Module:
    """Rebuild the model saved at ``path`` on ``base`` (an nn.Module - its weights may be on the meta device, see
    `empty_weights` -, a zoo model name, or None for the zoo model recorded in the file). ``base`` is not
    modified; none of its weights are copied (they come from the file)."""
    from safetensors import safe_open

    from workbench import models

    path = Path(path)
    meta = _read_metadata(path)
    plans = _plans_from(meta, path)
    if base is None:
        if not meta.get("source"):
            raise ValueError(f"{path} was saved from a user model; pass base=<the uncompressed model>")
        base = meta["source"]
    if isinstance(base, str):
        base = models.load(base)
    if not isinstance(base, nn.Module):
        raise TypeError(f"base must be an nn.Module or a zoo model name, got {type(base).__name__}")
    if applied_plans(base):
        raise ValueError("base must be the uncompressed model, but plans were already applied to it")
    device = next((t.device for t in [*base.parameters(), *base.buffers()] if t.device.type != "meta"),
                  torch.device("cpu"))
    try:
        model = build_skeleton(base, plans, values=False)
    except ValueError as e:
        raise ValueError(f"{path}: its plans do not fit the base model: {e}") from None

    expected = model.state_dict(keep_vars=True)
    with safe_open(str(path), "pt", device=str(device)) as f:
        stored = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()
                  if not k.endswith(PAD_SUFFIX)}
        by_object: dict[int, list[str]] = {}
        for key, t in expected.items():
            by_object.setdefault(id(t), []).append(key)
        problems = []
        for key, t in expected.items():
            if key not in stored:
                # safetensors stores one copy of shared tensors: another name of the same tensor is enough
                if not any(k in stored for k in by_object[id(t)]):
                    problems.append(f"missing tensor {key!r}")
                continue
            shape, dtype = stored[key]
            want = str(t.dtype).removeprefix("torch.")
            if shape != tuple(t.shape) or not _same_dtype(dtype, want):
                problems.append(f"{key!r}: file has {dtype} {list(shape)}, the model expects {want} {list(t.shape)}")
        extra = sorted(set(stored) - set(expected))
        if extra:
            problems.append(f"unexpected tensors {extra[:5]}")
        if problems:
            raise ValueError(f"{path} does not match the model its plans describe: " + "; ".join(problems[:5]))
        filled: dict[int, torch.Tensor] = {}
        for key, t in expected.items():   # each tensor read once from the mapped file, straight into its place
            if id(t) not in filled:
                value = aligned(f.get_tensor(next(k for k in by_object[id(t)] if k in stored)))
                if isinstance(t, nn.Parameter):   # a Parameter subclass (CastParameter) stays one, with its attributes
                    value = nn.Parameter(value, t.requires_grad) if type(t) is nn.Parameter else \
                        _same_kind(t, value)
                filled[id(t)] = value
            owner, _, attr = key.rpartition(".")
            module = model.get_submodule(owner)
            slots: dict = module._parameters if attr in module._parameters else module._buffers
            slots[attr] = filled[id(t)]
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ValueError(f"{path}: the base holds {left[:5]} on the meta device and the file does not have them "
                         f"(build the base with wb.empty_weights(), which keeps buffers real)")
    for m in model.modules():   # modules built on the meta device choose their "auto" kernel again, on this one
        set_kernel = getattr(m, "set_kernel", None)
        if getattr(m, "kernel_request", None) == "auto" and callable(set_kernel):
            set_kernel("auto")
    return model.eval() if not base.training else model


def _same_kind(like: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    """``value`` as a parameter of ``like``'s class (a subclass the base model holds, e.g. `CastParameter`) with
    its Python attributes (``source_dtype``)."""
    new = type(like)(value, like.requires_grad)
    new.__dict__.update(getattr(like, "__dict__", {}))
    return new


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
              "U64": "uint64"}


def _same_dtype(stored: str, torch_name: str) -> bool:
    return _ST_DTYPES.get(stored.upper(), stored.lower()) == torch_name
