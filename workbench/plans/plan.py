"""`Plan`: an ordered mapping from layer-name patterns to technique configs.

Patterns, tried in order for each module name (the first pattern that matches a module decides it):

- an exact module name, e.g. ``"encoder.layer.0.output.dense"``;
- a glob (``fnmatch`` semantics, case-sensitive): ``*`` matches any run of characters, dots included,
  ``?`` one character, ``[...]`` a set - e.g. ``"encoder.layer.*.intermediate.dense"``;
- a regular expression prefixed with ``re:``, matched against the whole name (``re.fullmatch``).

A config of ``None`` keeps the matching layers untouched, so ``{"classifier": None, "*": cfg}``
compresses everything but the classifier. A pattern must select at least one layer its config can
handle, otherwise `resolve` raises an error naming it: a typo never silently compresses nothing.
"""
from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

from torch import nn

from workbench.plans.registry import Config, config_from_dict, config_to_dict, handler_for, stage_handler_for

__all__ = ["Plan", "Assignment", "PassedOver", "PLAN_FORMAT_VERSION", "layer_matcher"]

PLAN_FORMAT_VERSION = 1


def layer_matcher(pattern: str):
    """``name -> bool`` for a plan pattern: ``re:`` and a regular expression (whole name), a glob (``*?[``) or an
    exact layer name; a ValueError names a pattern that is empty or not a valid expression."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"plan pattern must be a non-empty string, got {pattern!r}")
    if pattern.startswith("re:"):
        try:
            rx = re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"plan pattern {pattern!r} is not a valid regular expression: {e}") from None
        return lambda name: rx.fullmatch(name) is not None
    if any(c in pattern for c in "*?["):
        rx = re.compile(fnmatch.translate(pattern))
        return lambda name: rx.match(name) is not None
    return lambda name: name == pattern


@dataclass(frozen=True)
class Assignment:
    """One resolved entry: which layer gets which config, and which pattern decided it."""

    name: str
    module_type: str
    pattern: str
    config: Config


@dataclass(frozen=True)
class PassedOver:
    """A layer a pattern matched but did not assign, and why."""

    name: str
    module_type: str
    pattern: str
    config: Config
    reason: str
    holds_matrix: bool = False   # it owns a parameter of 2+ dimensions (a weight matrix, not a norm's vector)
    share: float = 0.0           # its own parameters' bytes / all the model's parameter bytes


class Plan(Mapping[str, Config | None]):
    """An ordered, immutable mapping ``pattern -> config`` (see the module docstring)."""

    def __init__(self, entries: Mapping[str, Config | None] | Iterable[tuple[str, Config | None]] = (), *,
                 fold_batchnorm: bool = False, stages: Iterable[Config] = ()):
        from workbench.plans.stages import FoldBatchNorm

        if not isinstance(fold_batchnorm, bool):
            raise TypeError(f"fold_batchnorm must be True or False, got {fold_batchnorm!r}")
        if isinstance(stages, Config):
            raise TypeError(f"stages must be a list of stage configs, got a single {type(stages).__name__}; wrap it "
                            f"in a list")
        stages = tuple(stages)
        for i, stage in enumerate(stages):
            if not isinstance(stage, Config):
                raise TypeError(f"plan stage {i}: expected a stage config (e.g. wb.plans.FoldBatchNorm()), got "
                                f"{type(stage).__name__}")
            stage_handler_for(stage)   # raises, naming where a per-layer config goes
        # fold_batchnorm=True: the FoldBatchNorm stage first (the spelling plans had before stages)
        if fold_batchnorm and not any(isinstance(s, FoldBatchNorm) for s in stages):
            stages = (FoldBatchNorm(), *stages)
        self.stages: tuple[Config, ...] = stages
        items = list(entries.items()) if isinstance(entries, Mapping) else list(entries)
        self._entries: dict[str, Config | None] = {}
        self._matchers = {}
        for pattern, config in items:
            if pattern in self._entries:
                raise ValueError(f"plan pattern {pattern!r} appears twice")
            if config is not None:
                if not isinstance(config, Config):
                    raise TypeError(
                        f"plan pattern {pattern!r}: expected a technique config (e.g. "
                        f"wb.precision.Cast(torch.bfloat16)) or None, got {type(config).__name__}")
                handler_for(config)
            self._matchers[pattern] = layer_matcher(pattern)
            self._entries[pattern] = config

    # Mapping protocol
    def __getitem__(self, pattern: str) -> Config | None:
        return self._entries[pattern]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Plan) and list(self._entries.items()) == list(other._entries.items())
                and self.stages == other.stages)

    def __hash__(self) -> int:
        return hash(self.to_json())

    def __repr__(self) -> str:
        inner = ", ".join(f"{p!r}: {c!r}" for p, c in self._entries.items())
        return f"Plan({{{inner}}}{f', stages={list(self.stages)!r}' if self.stages else ''})"

    @property
    def fold_batchnorm(self) -> bool:
        """Whether the plan folds BatchNorms first (a `FoldBatchNorm` stage)."""
        from workbench.plans.stages import FoldBatchNorm

        return any(isinstance(s, FoldBatchNorm) for s in self.stages)

    def __reduce__(self):
        # pickles (for process pools and Ray) as its entries; the compiled matchers are rebuilt
        return (_rebuild, (list(self._entries.items()), self.stages))

    def __or__(self, other: "Plan") -> "Plan":
        """``a | b``: the stages and entries of ``a``, then those of ``b`` not already there (``a`` wins where both
        match)."""
        theirs = tuple(getattr(other, "stages", ()))
        return Plan([*self._entries.items(), *((p, c) for p, c in other.items() if p not in self._entries)],
                    stages=(*self.stages, *(s for s in theirs if s not in self.stages)))

    def match(self, name: str) -> tuple[str, Config | None] | None:
        """The first (pattern, config) whose pattern matches ``name``, or None."""
        for pattern, config in self._entries.items():
            if self._matchers[pattern](name):
                return pattern, config
        return None

    def resolve(self, model: nn.Module) -> list[Assignment]:
        """Which layer of ``model`` gets which config, in module order.

        Only modules the config's technique supports are assigned (a glob over ``encoder.*``
        assigns its nn.Linear layers, not the containers around them), and a module nested inside an
        already-assigned module is not assigned again. A layer whose weight is tied to another layer's
        (GPT-2's ``lm_head`` and ``transformer.wte``) is assigned only if every layer of its tie group gets the
        same config (they are then compressed into one stored copy); a glob passes it over otherwise (see
        `survey`), an exact name raises. Every pattern must assign or keep at least one layer.
        """
        return self.survey(model)[0]

    def survey(self, model: nn.Module) -> tuple[list[Assignment], list["PassedOver"]]:
        """`resolve`'s assignments and the layers the plan's patterns matched but passed over, with why
        (only modules that hold parameters themselves are listed: containers are not layers).

        Modules that compute a Linear in disguise and that the plan reaches (Hugging Face ``Conv1D``,
        ``nn.MultiheadAttention``, split into ``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj``) are seen in
        their canonical form (`workbench.plans.layers.canonical_view`), as `wb.apply` will build them."""
        from workbench.plans.layers import canonical_view, tie_groups

        if not isinstance(model, nn.Module):
            raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
        model = canonical_view(model, self)
        total = sum(p.numel() * p.element_size() for p in model.parameters()) or 1   # (shared ones once)
        seen_types: dict[str, set[str]] = {p: set() for p in self._entries}
        kept: dict[str, int] = {p: 0 for p in self._entries}
        out: list[Assignment] = []
        passed: list[PassedOver] = []
        taken: list[str] = []
        for name, module in model.named_modules():
            if not name:
                continue
            hit = self.match(name)
            if hit is None:
                continue
            pattern, config = hit
            seen_types[pattern].add(type(module).__name__)
            if config is None:
                kept[pattern] += 1
                continue
            if any(name.startswith(t + ".") for t in taken):
                continue
            handler = handler_for(config)
            if not handler.supports(module, config):
                if next(module.parameters(recurse=False), None) is not None:
                    reason = handler.why_not(module, config) or \
                        f"{type(config).__name__} does not handle {type(module).__name__}"
                    own = dict(module.named_parameters(recurse=False))   # a layer's weight matrix, not a
                    matrix = any(p.dim() >= 2 for n, p in own.items() if "weight" in n)   # token or table
                    share = sum(p.numel() * p.element_size() for p in own.values()) / total
                    passed.append(PassedOver(name, type(module).__name__, pattern, config, reason, matrix, share))
                continue
            taken.append(name)
            out.append(Assignment(name, type(module).__name__, pattern, config))
        by_name = {a.name: a for a in out}
        for group in tie_groups(model):
            hits = [by_name[n] for n in group if n in by_name]
            if not hits or (len(hits) == len(group) and len({a.config for a in hits}) == 1):
                continue
            for a in hits:
                others = [n for n in group if n != a.name]
                reason = (f"its weight is tied to {', '.join(map(repr, others))}, which the plan does not give the "
                          f"same config (compressing it alone would store the weight twice)")
                if a.pattern == a.name:
                    raise ValueError(f"layer {a.name!r}: {reason}; give {', '.join(map(repr, group))} the same "
                                     f"config, or leave them all unchanged")
                del by_name[a.name]
                module = model.get_submodule(a.name)
                share = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False)) / total
                passed.append(PassedOver(a.name, a.module_type, a.pattern, a.config, reason, True, share))
        out = [a for a in out if a.name in by_name]
        used = {p: kept[p] + sum(a.pattern == p for a in out) for p in self._entries}
        for pattern, count in used.items():
            if count == 0:
                config = self._entries[pattern]
                tied = [p for p in passed if p.pattern == pattern and "tied" in p.reason]
                if tied:
                    raise ValueError(f"plan pattern {pattern!r} matches only layers with tied weights: "
                                     f"{tied[0].name!r}: {tied[0].reason}")
                if seen_types[pattern]:
                    why = next((p for p in passed if p.pattern == pattern), None)   # e.g. a look-alike's forward
                    raise ValueError(
                        f"plan pattern {pattern!r} matches only layers that {type(config).__name__} "
                        f"cannot handle ({', '.join(sorted(seen_types[pattern]))})"
                        + (f": layer {why.name!r}: {why.reason}" if why is not None else ""))
                raise ValueError(
                    f"plan pattern {pattern!r} matches no layer of {type(model).__name__}; "
                    f"some layer names: {_some_names(model)}")
        return out, passed

    def describe(self, model: nn.Module):
        """Every layer the plan's patterns match, as a DataFrame: layer, type, pattern, config (in words,
        `workbench.plans.words.describe`), status
        ("compressed", "kept" for a ``None`` entry, "passed over") and the reason a layer is passed over."""
        import pandas as pd

        from workbench.plans.layers import canonical_view
        from workbench.plans.words import describe

        model = canonical_view(model, self)   # once: surveying the view finds nothing left to rewrite
        assigned, passed = self.survey(model)
        rows = {a.name: {"layer": a.name, "type": a.module_type, "pattern": a.pattern, "config": describe(a.config),
                         "status": "compressed", "reason": ""} for a in assigned}
        rows.update({p.name: {"layer": p.name, "type": p.module_type, "pattern": p.pattern,
                              "config": describe(p.config), "status": "passed over", "reason": p.reason}
                     for p in passed})
        for name, module in model.named_modules():
            hit = self.match(name) if name else None
            if hit is not None and hit[1] is None and next(module.parameters(recurse=False), None) is not None:
                rows[name] = {"layer": name, "type": type(module).__name__, "pattern": hit[0], "config": describe(None),
                              "status": "kept", "reason": "the plan leaves it unchanged"}
        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        return pd.DataFrame(sorted(rows.values(), key=lambda r: order.get(r["layer"], 0)),
                            columns=["layer", "type", "pattern", "config", "status", "reason"])

    # JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "workbench.plan",
            "version": PLAN_FORMAT_VERSION,
            **({"stages": [config_to_dict(s) for s in self.stages]} if self.stages else {}),
            "entries": [{"pattern": p, "config": None if c is None else config_to_dict(c)}
                        for p, c in self._entries.items()],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        if not isinstance(data, Mapping) or data.get("format") != "workbench.plan":
            raise ValueError("not a workbench plan: expected an object with \"format\": \"workbench.plan\"")
        version = data.get("version")
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"unsupported plan format version {version!r}; this workbench reads "
                             f"version {PLAN_FORMAT_VERSION}")
        entries = data.get("entries")
        if not isinstance(entries, list):
            raise ValueError("plan 'entries' must be a list")
        out = []
        for i, e in enumerate(entries):
            if not isinstance(e, Mapping) or set(e) != {"pattern", "config"}:
                raise ValueError(f"plan entry {i} must have exactly 'pattern' and 'config', got {e!r}")
            cfg = None if e["config"] is None else config_from_dict(e["config"], f"plan entry {i} ({e['pattern']!r})")
            out.append((e["pattern"], cfg))
        fold = data.get("fold_batchnorm", False)   # (plans written before stages)
        if not isinstance(fold, bool):
            raise ValueError(f"plan 'fold_batchnorm' must be true or false, got {fold!r}")
        stages = data.get("stages", [])
        if not isinstance(stages, list):
            raise ValueError(f"plan 'stages' must be a list, got {stages!r}")
        built = [config_from_dict(s, f"plan stage {i}") for i, s in enumerate(stages)]
        try:
            return cls(out, fold_batchnorm=fold, stages=built)
        except TypeError as e:
            raise ValueError(f"plan stages: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"plan is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def save(self, path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json(indent=2) + "\n")

    @classmethod
    def read(cls, path) -> "Plan":
        with open(path, encoding="utf-8") as f:
            try:
                return cls.from_json(f.read())
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None


def _rebuild(entries, stages):
    return Plan(entries, stages=stages)


def _some_names(model: nn.Module, limit: int = 8) -> str:
    names = [n for n, m in model.named_modules() if n and not list(m.children())]
    more = f", ... ({len(names)} leaf layers)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
