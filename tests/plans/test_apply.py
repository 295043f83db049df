"""wb.apply: never mutates its input, is transactional, validates calibration; plus the Cast technique."""
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.plans import Config, Handler, register_config
from workbench.precision import Cast, CastConv2d, CastEmbedding, CastLinear


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]


def assert_unchanged(model, snap):
    state, types = snap
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k in state:
        assert now[k].dtype == state[k].dtype and torch.equal(now[k], state[k]), k
    assert [type(m) for m in model.modules()] == types


# A test-only technique: records the calibration inputs it was given, fails on a chosen layer.
class _Probe(Handler):
    seen: dict = {}

    def supports(self, module, config):
        return type(module) is nn.Linear

    def needs_calibration(self, config):
        return config.calibrated

    def apply(self, name, module, config, inputs):
        if name == config.fail_on:
            raise RuntimeError("probe failure")
        _Probe.seen[name] = inputs
        new = nn.Linear(module.in_features, module.out_features)
        new.load_state_dict(module.state_dict())
        with torch.no_grad():
            new.weight.mul_(0)  # visible change
        return new

    def skeleton(self, name, module, config):
        return nn.Linear(module.in_features, module.out_features)


@register_config(_Probe(), kind="tests.Probe")
@dataclass(frozen=True)
class Probe(Config):
    fail_on: str = ""
    calibrated: bool = False


def test_apply_returns_new_model_and_leaves_input_untouched(digits_mlp, digits_task):
    snap = snapshot(digits_mlp)
    small = wb.apply(digits_mlp, {"fc*": Cast(torch.bfloat16)})
    assert_unchanged(digits_mlp, snap)
    assert small is not digits_mlp
    assert all(isinstance(getattr(small, n), CastLinear) for n in ("fc1", "fc2", "fc3"))
    assert small.fc1.weight.dtype == torch.bfloat16
    assert wb.applied_plans(small) == (wb.Plan({"fc*": Cast(torch.bfloat16)}),)
    assert wb.applied_plans(digits_mlp) == ()


def test_apply_inplace(digits_mlp):
    same = wb.apply(digits_mlp, {"fc2": Cast(torch.float16)}, inplace=True)
    assert same is digits_mlp and isinstance(digits_mlp.fc2, CastLinear)


@pytest.mark.parametrize("inplace", [False, True])
def test_failure_is_transactional_and_names_the_layer(digits_mlp, inplace):
    snap = snapshot(digits_mlp)
    with pytest.raises(wb.ApplyError, match=r"layer 'fc2' with Probe\(fail_on='fc2'.*probe failure") as err:
        wb.apply(digits_mlp, {"fc*": Probe(fail_on="fc2")}, inplace=inplace)
    assert err.value.layer == "fc2"
    assert_unchanged(digits_mlp, snap)  # fc1 was already transformed when fc2 failed, yet nothing changed


def test_calibration_inputs_reach_the_handler(digits_mlp, digits_task):
    _Probe.seen.clear()
    calib = digits_task.calibration(200, batch_size=64)
    wb.apply(digits_mlp, {"fc2": Probe(calibrated=True), "fc3": Probe()}, calibration=calib)
    batches = _Probe.seen["fc2"]
    assert [b[0].shape for b in batches] == [(64, 256), (64, 256), (64, 256), (8, 256)]
    assert _Probe.seen["fc3"] is None  # only layers that need calibration get (and cost) inputs
    expected = torch.relu(digits_mlp.fc1(calib[0][0]))
    torch.testing.assert_close(batches[0][0], expected)


def test_calibration_errors(digits_mlp):
    with pytest.raises(ValueError, match=r"calibration data is required for 1 layer\(s\): fc2 \(Probe\)"):
        wb.apply(digits_mlp, {"fc2": Probe(calibrated=True)})
    with pytest.raises(ValueError, match=r"calibration data is required"):
        wb.apply(digits_mlp, {"fc2": Probe(calibrated=True)}, calibration=[])
    with pytest.raises(ValueError,
                       match=r"calibration batch 0 \(\(8, 10\) float32\) could not be run through DigitsMLP"):
        wb.apply(digits_mlp, {"fc2": Probe(calibrated=True)}, calibration=[torch.randn(8, 10)])
    with pytest.raises(TypeError,
                       match="calibration batch 1 must be a tensor, a tuple of tensors or a dict of tensors"):
        wb.apply(digits_mlp, {"fc2": Probe(calibrated=True)}, calibration=[torch.randn(8, 64), "text"])


def test_calibration_dtype_is_handled(digits_mlp):
    _Probe.seen.clear()
    wb.apply(digits_mlp, {"fc1": Probe(calibrated=True)}, calibration=[torch.rand(4, 64, dtype=torch.float64)])
    assert _Probe.seen["fc1"][0][0].dtype == torch.float32


def test_bad_arguments(digits_mlp):
    with pytest.raises(TypeError, match="expected a torch.nn.Module to compress, got str"):
        wb.apply("model", {"fc1": Cast()})
    with pytest.raises(TypeError, match="expected a wb.Plan"):
        wb.apply(digits_mlp, [("fc1", Cast())])


def test_cast_layers_match_fp32_within_dtype_precision():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    x = torch.randn(4, 3, 6, 6)
    ref = model(x)
    for dtype, rtol in ((torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        small = wb.apply(model, {"*": Cast(dtype)})
        assert isinstance(small[0], CastConv2d) and isinstance(small[2], CastLinear)
        out = small(x)
        assert out.dtype == torch.float32
        err = (out - ref).abs().max() / ref.abs().max()
        assert 0 < err < rtol, (dtype, err)
        assert wb.size_bytes(small) * 2 == wb.size_bytes(model)


def test_cast_embedding_returns_original_dtype():
    emb = nn.Sequential(nn.Embedding(50, 16))
    small = wb.apply(emb, {"0": Cast(torch.float16)})
    assert isinstance(small[0], CastEmbedding) and small[0].weight.dtype == torch.float16
    idx = torch.tensor([[1, 2, 49]])
    out = small(idx)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, emb(idx), rtol=1e-3, atol=1e-3)


def test_cast_refuses_nan_and_out_of_range_weights(digits_mlp):
    broken = wb.models.load("digits-mlp")
    with torch.no_grad():
        broken.fc2.weight[0, 0] = float("nan")
    with pytest.raises(wb.ApplyError, match="weight of 'fc2' contains NaN or Inf"):
        wb.apply(broken, {"fc*": Cast(torch.bfloat16)})
    with torch.no_grad():
        broken.fc2.weight[0, 0] = 1e6
    with pytest.raises(wb.ApplyError, match=r"weight of 'fc2' has magnitude 1e\+06, beyond the torch.float16 range"):
        wb.apply(broken, {"fc2": Cast(torch.float16)})
    assert isinstance(wb.apply(broken, {"fc2": Cast(torch.bfloat16)}).fc2, CastLinear)  # bf16 has the range


def test_composing_plans_records_both(digits_mlp):
    a = wb.apply(digits_mlp, {"fc1": Cast(torch.float16)})
    b = wb.apply(a, {"fc2": Cast(torch.bfloat16)})
    assert len(wb.applied_plans(b)) == 2 and len(wb.applied_plans(a)) == 1
    # an already-cast layer is not a plain Linear any more: a pattern selecting only it is an error
    with pytest.raises(ValueError, match="cannot handle"):
        wb.apply(b, {"fc1": Cast(torch.bfloat16)})


def test_large_modules_passed_over_are_named_with_their_share_whatever_their_parameters_are_called():
    """A small Mixtral (transformers 5: each layer's experts one module of fused 3-D tensors, no `.weight`): "*"
    with SVD (which does not take fused experts; quantization, Cast and pruning do, tests/quantization/test_experts.py)
    takes attention and the head and passes over the experts - the warning names both expert blocks first, with their
    share of the model's bytes (measured here, not assumed), and the total."""
    import re
    import warnings

    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for p in model.model.layers[0].mlp.experts.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wb.apply(model, {"model.embed_tokens": None, "*": wb.lowrank.SVD(rank=8)}, progress=False)
    [message] = [str(w.message) for w in caught if "passed over" in str(w.message)]
    share = f"{experts / total:.1%}"
    assert re.search(rf"passed over 4 matched layer\(s\) holding [\d.]+% of the model's parameter bytes: "
                     rf"model\.layers\.0\.mlp\.experts \(MixtralExperts, {re.escape(share)} of the model's parameter "
                     rf"bytes\): SVD factorises an nn\.Linear's weight; model\.layers\.1\.mlp\.experts", message)
    assert experts / total > 0.3


class ReadsWeight(nn.Module):
    """Like Mamba's mixer: ``dt`` is an nn.Linear whose weight the parent uses directly (never calling it)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.dt = nn.Linear(16, 16, bias=False)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)) @ self.dt.weight.T)


@pytest.mark.parametrize("config", [wb.quant.WeightOnly(bits=4, group_size=16, method="gptq"), wb.prune.Wanda(0.5),
                                    wb.quant.Static()], ids=["gptq", "wanda", "static"])
def test_a_layer_the_model_never_calls_is_passed_over_by_a_glob_out_loud(config, tmp_path):
    """Issue 35: a calibrated technique has no inputs for a layer its parent reads directly. A glob passes it over
    with the reason (the warning, the report), the rest is calibrated, and the saved plan keeps it untouched on
    reload; an exact name is refused naming the layer."""
    torch.manual_seed(0)
    model = ReadsWeight().eval()
    data = [torch.randn(8, 16) for _ in range(2)]
    with pytest.warns(UserWarning, match=r"dt \(Linear.*never called when the calibration batch ran through"):
        small = wb.apply(model, {"*": config}, calibration=data, progress=False)
    report = wb.applied_report(small).set_index("layer")
    assert report.loc["dt", "status"] == "passed over"
    assert "uses its weight without calling it" in report.loc["dt", "note"]
    assert (report.drop("dt")["status"] == "compressed").all()
    assert torch.equal(small.dt.weight, model.dt.weight)
    path = tmp_path / "m.safetensors"
    wb.save(small, path)
    x = torch.randn(3, 16)
    assert torch.equal(wb.load(path, base=model)(x), small(x))
    with pytest.raises(wb.ApplyError, match=r"layer 'dt' .*never called"):
        wb.apply(model, {"dt": config, "*": config}, calibration=data, progress=False)
