"""GPTQ act-order as the reference does it: groups formed in activation order, stored as a weight with permuted
input columns and a ``perm`` buffer (the layer gathers x once); every kernel path computes the same; save/load.

The Triton path runs under TRITON_INTERPRET=1 here (tests/conftest.py sets it on machines without a GPU)."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.quantization import formats as fm
from workbench.quantization.gptq import gptq_quantize
from workbench_kernels._common import triton_available

Q = wb.quant
needs_triton = pytest.mark.skipif(not triton_available(), reason="no CUDA GPU and TRITON_INTERPRET is not set")


def outlier_inputs(tokens=512, K=96, seed=0):
    """Inputs whose channels differ in scale by ~30x and are correlated (as a transformer's are)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp(torch.randn(K, generator=g) * 1.2)                         # (K,)
    mix = torch.eye(K) + 0.3 * torch.randn(K, K, generator=g) / K ** 0.5
    return (torch.randn(tokens, K, generator=g) @ mix) * scales                   # (tokens, K)


def layer(K=96, N=48, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(K, N))


def rel_error(X, W, Wq):
    return float((X @ (W - Wq).T).pow(2).sum() / (X @ W.T).pow(2).sum())


def decoded(t, fmt, K):
    perm = t.pop("perm", None)
    W = fm.decode(t, fmt, K)
    return W if perm is None else torch.empty_like(W).index_copy_(1, perm.long(), W)


def test_dynamic_groups_are_runs_of_the_activation_order():
    X = outlier_inputs()
    W = layer()[0].weight.detach()
    fmt = fm.IntFormat(4, 32, True)
    dyn = gptq_quantize(W, [(X,)], fmt, act_order=True)
    perm = dyn["perm"].long()
    # processing order = decreasing Hessian diagonal, i.e. decreasing E[x_j^2]
    assert torch.equal(perm, torch.argsort(X.pow(2).sum(0).double(), descending=True))
    assert sorted(perm.tolist()) == list(range(96))
    # group 0 holds the 32 loudest channels: its stored columns are the first 32 of the permuted weight
    Wp = fm.decode({k: v for k, v in dyn.items() if k != "perm"}, fmt, 96)
    assert torch.allclose(Wp[:, :32], decoded(dict(dyn), fmt, 96)[:, perm[:32]])
    static = gptq_quantize(W, [(X,)], fmt, act_order=True, static_groups=True)
    plain = gptq_quantize(W, [(X,)], fmt)
    assert "perm" not in static and "perm" not in plain
    e_dyn, e_static, e_plain = (rel_error(X, W, decoded(t, fmt, 96)) for t in (dyn, static, plain))
    e_rtn = rel_error(X, W, fm.decode(fm.encode(W, fmt), fmt, 96))
    assert max(e_dyn, e_static, e_plain) < e_rtn, (e_dyn, e_static, e_plain, e_rtn)


def test_on_minilm_dynamic_groups_beat_static_ones(minilm, minilm_task):
    """The issue's layer (int4 g64 symmetric): activation-order groups give a lower output error."""
    from workbench.plans.layers import capture_inputs

    name = "encoder.layer.2.intermediate.dense"
    inputs = capture_inputs(minilm, [name], minilm_task.calibration(16), progress=False)[name]
    X = torch.cat([b[0].reshape(-1, 384) for b in inputs]).float()                  # (tokens, 384)
    W = minilm.get_submodule(name).weight.detach()
    fmt = fm.IntFormat(4, 64, True)
    e_dyn = rel_error(X, W, decoded(gptq_quantize(W, inputs, fmt, act_order=True), fmt, 384))
    e_static = rel_error(X, W, decoded(gptq_quantize(W, inputs, fmt, act_order=True, static_groups=True), fmt, 384))
    assert e_dyn < 0.95 * e_static, (e_dyn, e_static)


def test_per_channel_act_order_needs_no_permutation():
    X = outlier_inputs(K=64)
    t = gptq_quantize(layer(64)[0].weight.detach(), [(X,)], fm.IntFormat(8, None, True), act_order=True)
    assert "perm" not in t


@pytest.mark.parametrize("kernel", ["reference", "cpu", pytest.param("triton", marks=needs_triton)])
def test_every_kernel_path_computes_the_effective_weight(kernel):
    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"
    lin = layer()
    X = outlier_inputs()
    config = Q.WeightOnly(4, 32, method="gptq", act_order=True, kernel=kernel)
    q = wb.apply(lin, {"0": config}, calibration=[X[:256], X[256:]], progress=False).to(device)
    assert hasattr(q[0], "perm") and not torch.equal(q[0].perm.cpu(), torch.arange(96, dtype=torch.int32))
    x = torch.randn(2, 5, 96, device=device)
    with torch.no_grad():
        got = q(x)
        want = nn.functional.linear(x, q[0].effective_weight(), q[0].bias)
    tol = 1e-2 if kernel == "cpu" else 1e-4   # bf16 operands on the CPU path
    assert (got - want).norm() / want.norm() < tol
    # and the effective weight is GPTQ's own result, in the float layer's column order
    t = gptq_quantize(lin[0].weight.detach(), [(X[:256],), (X[256:],)], config.format(), act_order=True)
    torch.testing.assert_close(q[0].effective_weight().cpu(), decoded(t, config.format(), 96), rtol=0, atol=1e-6)


def test_act_order_round_trips_through_save_and_load(tmp_path):
    lin = layer()
    X = outlier_inputs()
    plan = {"0": Q.WeightOnly(4, 32, method="gptq", act_order=True)}
    q = wb.apply(lin, plan, calibration=[X], progress=False)
    wb.save(q, tmp_path / "q.safetensors")
    again = wb.load(tmp_path / "q.safetensors", base=lin)
    assert torch.equal(again[0].perm, q[0].perm)
    x = torch.randn(3, 96)
    with torch.no_grad():
        assert torch.equal(q(x), again(x))
    # static groups store no permutation, and their config says so through JSON
    static = Q.WeightOnly(4, 32, method="gptq", act_order=True, static_groups=True)
    qs = wb.apply(lin, {"0": static}, calibration=[X], progress=False)
    assert not hasattr(qs[0], "perm")
    assert wb.Plan.from_json(wb.Plan({"0": static}).to_json())["0"] == static


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_takes_a_short_last_group(act_order):
    """A group size that does not divide K (tiny-llama's down_proj: 864 inputs, groups of 64) leaves a short last
    group, as round-to-nearest does: GPTQ quantizes it too and still beats RTN on the layer's own inputs."""
    torch.manual_seed(0)
    linear = nn.Linear(100, 24)
    x = torch.randn(256, 100) * torch.linspace(0.2, 3.0, 100)
    plan = {"*": wb.quant.WeightOnly(bits=4, group_size=32, method="gptq", act_order=act_order)}
    q = wb.apply(nn.Sequential(linear), plan, calibration=[x[:128], x[128:]], progress=False)
    rtn = wb.apply(nn.Sequential(linear), {"*": wb.quant.WeightOnly(bits=4, group_size=32)}, progress=False)
    assert q[0].scale.shape == (24, 4) and "the last group of each row holds 4 values" in q[0].note
    with torch.no_grad():
        ref = linear(x)
        err_gptq, err_rtn = ((m(x) - ref).pow(2).mean().item() for m in (q, rtn))
    assert err_gptq < 0.9 * err_rtn


def test_a_version_1_file_with_act_order_loads_as_the_static_groups_it_holds(tmp_path):
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    lin, X = layer(), outlier_inputs()
    static = Q.WeightOnly(4, 32, method="gptq", act_order=True, static_groups=True)
    qs = wb.apply(lin, {"0": static}, calibration=[X], progress=False)
    path = wb.save(qs, tmp_path / "v2.safetensors")
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert meta["format_version"] == "3"
    # a version 1 file of the same layer: act_order=True meant static groups, and the field did not exist
    plans = json.loads(meta["plans"])
    del plans[0]["entries"][0]["config"]["static_groups"]
    save_file(tensors, str(tmp_path / "v1.safetensors"), metadata={**meta, "format_version": "1",
                                                                    "plans": json.dumps(plans)})
    again = wb.load(tmp_path / "v1.safetensors", base=lin)
    assert wb.applied_plans(again)[0]["0"] == static and not hasattr(again[0], "perm")
    x = torch.randn(3, 96)
    with torch.no_grad():
        assert torch.equal(qs(x), again(x))
