"""The technique registry: config type -> handler.

Every technique (cast, quantization, pruning, low-rank, ...) describes one layer's change as a frozen
dataclass *config* and registers a *handler* for that config type. `wb.apply` and `wb.load` only ever
talk to handlers through this table, so adding a technique is a registration, never a new branch in
the spine (and never a dispatch on strings).

A config class is registered with `@register_config(handler)`; its JSON name is the class's
``kind`` (defaults to ``"<module>.<ClassName>"``), which is what a saved plan records.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import typing
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import nn

__all__ = [
    "Config",
    "Handler",
    "StageHandler",
    "stage_handler_for",
    "registered_stages",
    "Accumulator",
    "register_config",
    "handler_for",
    "config_from_dict",
    "config_to_dict",
    "registered_kinds",
    "registered_configs",
]


class Config:
    """Base class of every technique config (a frozen dataclass).

    Subclasses validate their fields in ``__post_init__`` and raise ``ValueError``/``TypeError``
    naming the field at fault.
    """

    kind: ClassVar[str] = ""


class Accumulator(abc.ABC):
    """What a technique keeps of one layer's calibration inputs when the pipeline feeds them one batch at a time (a
    forward pre-hook calls ``add``), so that the inputs themselves need not be kept: GPTQ's Hessian, Wanda's input
    norms, SmoothQuant's per-channel max, an activation observer. `Handler.accumulator` returns one; the pipeline
    then hands it to `Handler.apply` as ``inputs``.

    Layers that read the very same input tensor (a decoder's q / k / v projections, gate / up) may share one
    accumulator, the input then added once: an accumulator that allows it says so in `shares_with` and counts its
    layers in ``users``."""

    users: int = 1

    @abc.abstractmethod
    def add(self, batch: tuple[torch.Tensor, ...]) -> None:
        """Take one calibration batch: the layer's tensor inputs of one forward call."""

    @property
    def nbytes(self) -> int | None:
        """The bytes it will hold once fed, where known before the first batch (None: count its tensors)."""
        return None

    def shares_with(self, other: "Accumulator") -> bool:
        """Whether ``other``, fed the same input tensor, can stand for this one (default: never)."""
        return False


class Handler(abc.ABC):
    """What a technique provides for its config type: one subclass per config type, registered with it.

    ``supports``, ``apply`` and ``skeleton`` must be written; the other hooks have no-op defaults that a
    technique overrides where it has something to say (the core calls every hook directly, never looking
    for it)."""

    @abc.abstractmethod
    def supports(self, module: nn.Module, config: Config) -> bool:
        """Whether this technique, with this config, can replace ``module`` (e.g. only nn.Linear)."""

    @abc.abstractmethod
    def apply(self, name: str, module: nn.Module, config: Config,
              inputs: Sequence[tuple[torch.Tensor, ...]] | None) -> nn.Module:
        """Return a *new* module implementing ``config`` for ``module`` (never mutate ``module``).

        ``inputs`` are the layer's recorded calibration inputs when ``needs_calibration`` is true (or what its
        ``accumulator`` kept of them)."""

    @abc.abstractmethod
    def skeleton(self, name: str, module: nn.Module, config: Config) -> nn.Module:
        """Return a module with the compressed structure (shapes, dtypes, buffers) but no computation
        of its values: `wb.load` fills it from a file. Must not need calibration data."""

    def needs_calibration(self, config: Config) -> bool:
        """Whether ``apply`` needs the layer's calibration inputs (default: no)."""
        return False

    def accumulator(self, name: str, module: nn.Module, config: Config) -> Accumulator | None:
        """What the technique keeps of the layer's inputs when fed one batch at a time (an `Accumulator`: GPTQ's
        Hessian, an activation observer); the sequential pipeline then passes it to ``apply`` as ``inputs``. None
        (default): the input batches themselves are recorded and passed."""
        return None

    def calibration_cost(self, module: nn.Module, config: Config, tokens: int) -> tuple[int, float] | None:
        """(working bytes, floating-point operations) of calibrating one layer on ``tokens`` input rows, for
        `wb.analysis.estimate_calibration`; None (default): no cost model, only the measured baseline."""
        return None

    def resolved(self, config: Config, new_module: nn.Module) -> Config:
        """The concrete config that rebuilds exactly the structure of ``new_module`` (e.g. SVD(energy=0.9) ->
        SVD(rank=37)); `apply` records it per layer. Default: ``config`` itself."""
        return config

    def why_not(self, module: nn.Module, config: Config) -> str | None:
        """Why ``supports`` refused ``module`` (shown to the user), or None (default) for a generic sentence."""
        return None

    def from_trained(self, name: str, layer: nn.Module, config: Config, weight_scale: torch.Tensor | None = None,
                     input_padding: Any = None) -> nn.Module:
        """The real compressed module for ``layer``, a float layer trained under this config's fake quantization
        (`wb.qat.convert`): ``weight_scale`` the learned step sizes, if any; ``input_padding`` a "same"-padding
        convolution's. Default: the technique has no quantization-aware training."""
        raise ValueError(f"{name!r}: {type(config).__name__} has no quantization-aware training to convert from")


class StageHandler(abc.ABC):
    """What a model-level technique provides for its config type (a *stage*): it changes the whole model - several
    layers together, e.g. folding every BatchNorm into the convolution before it, or a rotation of the residual
    stream - where a `Handler` replaces one layer. A plan's stages (``Plan(entries, stages=[...])``) run in order
    before its per-layer entries, on `wb.apply`'s copy of the model (``inplace=True`` is refused: a failure later in
    the plan could not put the stage's changes back), inside the same transaction."""

    @abc.abstractmethod
    def apply(self, model: nn.Module, config: Config, calibration: Sequence) -> str | None:
        """Transform ``model`` in place (it is `wb.apply`'s copy); ``calibration``: the normalized calibration
        batches (empty when none were given; a stage that needs them says so in ``needs_calibration``). May return
        a note - what it did, in words - that `wb.applied_report` shows in the stage's row."""

    @abc.abstractmethod
    def skeleton(self, model: nn.Module, config: Config) -> None:
        """Make the same structural change to ``model`` without computing values from data (`wb.load` fills them
        from the file); ``model`` may hold meta tensors."""

    def needs_calibration(self, config: Config) -> bool:
        """Whether ``apply`` needs calibration batches (default: no)."""
        return False


_HANDLERS: dict[type, Handler | StageHandler] = {}
_KINDS: dict[str, type] = {}


def register_config(handler: Handler | StageHandler, kind: str | None = None) -> Callable[[type], type]:
    """Class decorator: register a frozen-dataclass config type with its handler (a `Handler`: a per-layer
    technique; a `StageHandler`: a model-level stage)."""

    if not isinstance(handler, (Handler, StageHandler)):
        raise TypeError(f"register_config needs a Handler instance (a subclass of workbench.plans.registry.Handler, "
                        f"or StageHandler for a model-level stage), got {type(handler).__name__}")

    def deco(cls: type) -> type:
        if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
            raise TypeError(f"{cls.__name__} must be a frozen dataclass to be registered as a config")
        name = kind or f"{cls.__module__.removeprefix('workbench.')}.{cls.__name__}"
        if name in _KINDS and _KINDS[name] is not cls:
            raise ValueError(f"config kind {name!r} is already registered by {_KINDS[name].__qualname__}")
        cls.kind = name  # type: ignore[attr-defined]  # the class attribute every registered config carries
        _KINDS[name] = cls
        _HANDLERS[cls] = handler
        return cls

    return deco


def _registered(config: Config) -> Handler | StageHandler:
    try:
        return _HANDLERS[type(config)]
    except KeyError:
        raise TypeError(
            f"{type(config).__qualname__} is not a registered technique config; registered: "
            f"{sorted(_KINDS)}") from None


def handler_for(config: Config) -> Handler:
    """The per-layer handler of ``config``; a stage's config is refused, naming where it goes."""
    handler = _registered(config)
    if isinstance(handler, StageHandler):
        raise TypeError(f"{type(config).__name__} is a model-level stage, not a per-layer technique: pass it as "
                        f"wb.Plan(entries, stages=[{type(config).__name__}(...)])")
    return handler


def stage_handler_for(config: Config) -> StageHandler:
    """The stage handler of ``config``; a per-layer technique's config is refused, naming where it goes."""
    handler = _registered(config)
    if not isinstance(handler, StageHandler):
        raise TypeError(f"{type(config).__name__} is a per-layer technique, not a model-level stage: give it to a "
                        f"plan's entries (a pattern -> config), not to stages")
    return handler


def registered_kinds() -> list[str]:
    return sorted(_KINDS)


def registered_configs() -> list[type]:
    """The registered per-layer technique config classes, in order of registration (stages: `registered_stages`)."""
    return [cls for cls in _KINDS.values() if not isinstance(_HANDLERS[cls], StageHandler)]


def registered_stages() -> list[type]:
    """The registered model-level stage config classes, in order of registration."""
    return [cls for cls in _KINDS.values() if isinstance(_HANDLERS[cls], StageHandler)]


# --- JSON (de)serialisation of configs -------------------------------------------------------------

def _encode(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot serialise config value {value!r} of type {type(value).__name__}")


def _decode(value: Any, annotation: Any, where: str) -> Any:
    if isinstance(value, dict) and set(value) == {"dtype"}:
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}: unknown dtype {value['dtype']!r}")
        return dtype
    origin = typing.get_origin(annotation)
    if isinstance(value, list):
        return tuple(value) if origin in (tuple, None) or annotation is tuple else value
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation(value)
    return value


def config_to_dict(config: Config) -> dict[str, Any]:
    if not isinstance(config, Config) or not dataclasses.is_dataclass(config):
        raise TypeError(f"expected a technique config, got {type(config).__name__}")
    _registered(config)  # raises if unregistered
    return {"kind": config.kind,
            **{f.name: _encode(getattr(config, f.name)) for f in dataclasses.fields(config)}}


def config_from_dict(data: dict[str, Any], where: str = "config") -> Config:
    """Rebuild a config from its JSON form. Only registered kinds can be built (no imports, no eval)."""
    if not isinstance(data, dict) or "kind" not in data:
        raise ValueError(f"{where}: expected an object with a 'kind' field, got {data!r}")
    kind = data["kind"]
    cls = _KINDS.get(kind)
    if cls is None:
        raise ValueError(f"{where}: unknown config kind {kind!r}; registered kinds: {registered_kinds()}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields) - {"kind"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)} for {kind}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _decode(v, hints.get(k), f"{where}.{k}") for k, v in data.items() if k != "kind"}
    return cls(**kwargs)
