"""The technique registry's handler protocol: one `Handler` subclass per config type with explicit hooks
(no-op defaults the core calls directly), and the core (`workbench.plans`) independent of `workbench.analysis`."""
import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.plans import registry
from workbench.plans.registry import Config, Handler, handler_for, register_config


class _Identity(Handler):
    """A minimal technique: replaces a Linear by a copy of itself."""

    def supports(self, module, config):
        return isinstance(module, nn.Linear)

    def apply(self, name, module, config, inputs):
        new = nn.Linear(module.in_features, module.out_features)
        new.load_state_dict(module.state_dict())
        return new

    def skeleton(self, name, module, config):
        return nn.Linear(module.in_features, module.out_features)


def test_handler_hooks_have_explicit_defaults():
    h = _Identity()
    lin = nn.Linear(4, 3)
    assert h.needs_calibration(object()) is False
    assert h.accumulator("x", lin, object()) is None
    assert h.calibration_cost(lin, object(), 128) is None
    assert h.why_not(lin, object()) is None
    cfg = object()
    assert h.resolved(cfg, lin) is cfg
    with pytest.raises(TypeError, match="abstract"):
        type("Incomplete", (Handler,), {"supports": lambda self, m, c: True})()


def test_register_config_needs_a_handler_instance():
    with pytest.raises(TypeError, match="needs a Handler instance"):
        register_config(object(), kind="test.NotAHandler")


def test_a_minimal_technique_runs_through_apply_with_default_hooks():
    @register_config(_Identity(), kind="test.Identity")
    @dataclass(frozen=True)
    class Identity(Config):
        pass

    try:
        model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
        out = wb.apply(model, {"0": Identity()}, progress=False)
        assert out[0] is not model[0] and isinstance(out[0], nn.Linear)
        x = torch.randn(3, 8)
        torch.testing.assert_close(out(x), model(x))
    finally:   # leave the registry as it was
        registry._KINDS.pop("test.Identity", None)
        registry._HANDLERS.pop(Identity, None)


def test_each_quantization_config_has_its_own_handler():
    Q = wb.quant
    handlers = [handler_for(c) for c in (Q.WeightOnly(), Q.NF4(), Q.FP8(), Q.Dynamic(), Q.Static())]
    assert len({type(h) for h in handlers}) == 5
    assert all(isinstance(h, Handler) for h in handlers)


def test_the_core_does_not_import_analysis():
    plans = Path(registry.__file__).parent
    found = {}
    for path in plans.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad = [m for m in mods if m.startswith("workbench.analysis")]
            if bad:
                found[path.name] = bad
    assert not found, found
