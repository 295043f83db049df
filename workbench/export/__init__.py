"""Deployable exports: write a compressed model in a format that serving tools read (`wb.export`).

    small = wb.apply(model, wb.Plan({"model.layers.*": wb.quant.WeightOnly(bits=4, group_size=32)}))
    wb.export(small, "llama-w4a16", format="compressed-tensors", base_folder="llama")   # vLLM, transformers

A format is a class derived from `ExportFormat`, registered in `FORMATS` under the name users pass
(``format="compressed-tensors"``); an instance may be passed instead of the name. Each has two steps:

1. ``prepare(model, base_folder)`` checks the whole model and builds everything to be written in memory. Whatever the
   format cannot hold raises ``ValueError`` here, naming the layer and what the format allows - before anything
   touches the disk. The model is only read.
2. ``write(prepared, folder)`` puts it into an empty folder.

Where a format cannot hold a layer as it is (NF4 or int3 in GGUF, per-channel int4 in a block-32 format), it also says
which grid it holds is nearest (``nearest(name, module)``: the config to re-quantize into, None where it holds the
layer as it is, a ValueError naming the layer where nothing is near). ``export(..., requantize=True)`` - or
``requantize=task``, which also measures the task's metric before and after - re-quantizes those layers (round to
nearest from the weight they compute with, in a copy: `workbench.export.fit`) and exports the result, with one
`RequantizedWarning` saying what changed; without it, the refusal says that ``requantize=True`` is the way out.

`export` writes into a temporary folder next to ``path`` and renames it into place only when it is complete, so a
failed export leaves no folder behind (and never overwrites a non-empty one).

| name | class | read by | timed with (`runtimes`) |
|---|---|---|---|
| ``"compressed-tensors"`` | `compressed_tensors.CompressedTensors` | vLLM, transformers' ``from_pretrained`` | - |
| ``"gguf"`` | `gguf.GGUF` | llama.cpp (llama-cpp-python, Ollama, LM Studio) | `LlamaCppModel` |
| ``"onnx"`` | `onnx.ONNX` (``ONNX(example_inputs=...)``) | ONNX Runtime (``MatMulNBits``, QDQ) | `OnnxRuntimeModel` |

`OnnxRuntimeModel(folder)` and `LlamaCppModel(folder)` (`workbench.export.runtimes`) run an exported folder in that
runtime as an ``nn.Module``, so ``wb.measure`` / ``wb.speedup`` score and time it beside the workbench's own model.
"""
from __future__ import annotations

import abc
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

if TYPE_CHECKING:
    from workbench.plans.registry import Config
    from workbench.tasks.base import Task

__all__ = ["ExportFormat", "FORMATS", "register_export_format", "export", "integer_weight_problem",
           "CompressedTensors", "GGUF", "ONNX", "OnnxRuntimeModel", "LlamaCppModel"]

FORMATS: dict[str, type["ExportFormat"]] = {}   # user-facing name -> format class, filled by `register_export_format`


def register_export_format(cls: type["ExportFormat"]) -> type["ExportFormat"]:
    """Class decorator: add an `ExportFormat` subclass to `FORMATS` under its ``name``."""
    if cls.name in FORMATS:
        raise ValueError(f"export format name {cls.name!r} is taken by {FORMATS[cls.name].__name__}")
    FORMATS[cls.name] = cls
    return cls


class ExportFormat(abc.ABC):
    """One deployable format. Subclasses are frozen dataclasses (their fields are the format's options)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def prepare(self, model: nn.Module, base_folder: Path | None) -> Any:
        """Everything to be written, built in memory; raises (ValueError naming the layer, or TypeError for a model
        the format cannot describe) on anything the format cannot hold. Never modifies ``model``."""

    @abc.abstractmethod
    def write(self, prepared: Any, folder: Path) -> None:
        """Write what `prepare` returned into the empty folder ``folder``."""

    def nearest(self, name: str, module: nn.Module) -> Config | None:
        """The config of the nearest grid this format holds, for a layer it cannot hold as it is (`workbench.export.fit`
        re-quantizes the layer into it); None where it holds the layer as it is or the layer is not one it writes
        (`prepare` decides the rest); raises ValueError naming the layer where nothing it holds is near (pruned,
        low-rank, cast layers). This default re-quantizes nothing."""
        return None


def integer_weight_problem(m: nn.Module) -> str | None:
    """Why a weight-only layer is not what every export format starts from - integer codes with integer zero points,
    the input as it comes - or None. Each format adds its own limits (bits, group sizes) and names the layer."""
    from workbench.quantization.formats import IntFormat

    fmt = m.fmt
    if getattr(m, "act_bits", None) is not None:
        return (f"rounds its input to {m.act_bits} bits per token (W{fmt.bits}A{m.act_bits}), which the format's "
                f"weight-only layers do not do")
    if not isinstance(fmt, IntFormat):
        return f"stores {type(fmt).__name__} weights ({fmt}), not integer codes"
    if fmt.float_zero:
        return "has real-valued (HQQ) zero points, not integer ones"
    if "smooth" in m._buffers:
        return ("divides its inputs by an AWQ smoothing vector, which would have to be folded into the layer "
                "before")
    if "perm" in m._buffers:
        return ("stores GPTQ act-order groups with a column permutation: quantize with WeightOnly(method='gptq', "
                "act_order=True, static_groups=True), whose groups are the original columns'")
    return None


def _format(format: str | ExportFormat) -> ExportFormat:
    if isinstance(format, ExportFormat):
        return format
    if isinstance(format, str) and format in FORMATS:
        return FORMATS[format]()
    raise ValueError(f"unknown export format {format!r}; known: {sorted(FORMATS)} (or an ExportFormat instance)")


def _target(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an empty folder; export writes a new folder")
    return path


def _requantize_hint(model: nn.Module, fmt: ExportFormat) -> str | None:
    """The way out of a refusal, where re-quantizing is one: which layers ``requantize=True`` would re-quantize, into
    what (None when there is nothing to re-quantize, or some layer nothing in the format is near)."""
    from workbench.export.fit import nearest_configs
    from workbench.plans.words import describe

    try:
        configs = nearest_configs(model, fmt)
    except ValueError:   # (a layer re-quantizing cannot help: the format's own refusal stands alone)
        return None
    if not configs:
        return None
    shown = ", ".join(f"{n!r} -> {describe(c)}" for n, c in list(configs.items())[:3])
    more = f", and {len(configs) - 3} more" if len(configs) > 3 else ""
    return (f"To export anyway, pass requantize=True (or requantize=task, to measure the change in the task's "
            f"metric): it re-quantizes, round to nearest, the {len(configs)} layer(s) {fmt.name} cannot hold as they "
            f"are into the nearest grid it holds ({shown}{more}) and reports the change.")


def export(model: nn.Module, path: str | os.PathLike, format: str | ExportFormat = "compressed-tensors", *,
           base_folder: str | os.PathLike | None = None, overwrite: bool = False,
           requantize: bool | Task | str = False) -> Path:
    """Write ``model`` (e.g. the result of `wb.apply`) as a checkpoint folder ``path`` in ``format``; returns the path.

    ``base_folder``: the folder the model was loaded from; its tokenizer (and generation) files are copied, so the
    exported folder is complete. ``path`` must not exist or be an empty folder, unless ``overwrite=True``: then an
    existing folder there is replaced, once the new one is completely written (a report re-run exports again).
    Raises before writing anything when the format cannot hold some layer (the error names it); a failure while
    writing removes what was written and leaves an existing folder as it was.

    ``requantize``: True re-quantizes the layers the format cannot hold as they are into the nearest grid it holds
    (`workbench.export.fit.fit`, on a copy: ``model`` is only read) and exports that, with one `RequantizedWarning`
    listing the layers and their weight change; a task (a `wb.tasks.Task` or its name) does the same and also
    measures the task's primary metric before and after (``wb.measure(quick=True)``) into the warning. Call `fit`
    itself for its report.
    """
    fmt = _format(format)
    from workbench.plans.layers import input_transforms

    online = input_transforms(model)
    if online:
        names = ", ".join(f"{n} ({', '.join(map(repr, h))})" for n, h in online.items())
        raise ValueError(f"wb.export: {names} transform their input at run time (an online rotation, "
                         f"wb.quant.Rotate(online=True)), which no exported format runs; rotate with online=False "
                         f"to export")
    if not isinstance(requantize, bool):
        from workbench.tasks.base import Task

        if not isinstance(requantize, (Task, str)):
            raise TypeError(f"requantize must be True, False or a task (a wb.tasks.Task or its name), got "
                            f"{type(requantize).__name__}")
    path = Path(path)
    if overwrite:
        if path.exists() and not path.is_dir():
            raise FileExistsError(f"{path} exists and is not a folder; export writes (or replaces) a folder")
    else:
        _target(path)
    base = None
    if base_folder is not None:
        base = Path(base_folder)
        if not base.is_dir():
            raise ValueError(f"base_folder {base} is not a folder")
    if requantize is not False:
        from workbench.export.fit import RequantizedWarning, fit, summary

        model, report = fit(model, fmt, None if requantize is True else requantize)
        if len(report):
            warnings.warn(f"wb.export: {summary(report)}", RequantizedWarning, stacklevel=2)
    try:
        prepared = fmt.prepare(model, base)
    except ValueError as e:
        if requantize is not False:
            raise
        hint = _requantize_hint(model, fmt)
        if hint is None:
            raise
        raise ValueError(f"{e} {hint}") from e
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.partial"
    partial.mkdir()   # (not tempfile.mkdtemp: its 0700 mode would stay on the renamed folder)
    try:
        fmt.write(prepared, partial)
        if overwrite and path.is_dir() and any(path.iterdir()):
            old = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.replaced"
            os.replace(path, old)
            try:
                os.replace(partial, path)
            except BaseException:
                os.replace(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            _target(path)   # (still free: nothing appeared there meanwhile)
            os.replace(partial, path)   # atomic on one file system; replaces an empty folder
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return path


from workbench.export.compressed_tensors import CompressedTensors  # noqa: E402  (registers itself)
from workbench.export.gguf import GGUF  # noqa: E402  (registers itself)
from workbench.export.onnx import ONNX  # noqa: E402  (registers itself)
from workbench.export.runtimes import LlamaCppModel, OnnxRuntimeModel  # noqa: E402
