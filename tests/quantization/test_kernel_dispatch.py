"""Explicit kernel dispatch of the quantized modules: "reference", "cpu" and "triton" give the same numbers
(exactly where the integer math is the same, within bf16 / kernel tolerance otherwise), the path that ran is
recorded, and a path that cannot run raises instead of falling back.

The Triton paths run under TRITON_INTERPRET=1 here (tests/conftest.py sets it on machines without a GPU)."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.quantization.modules import W8A8Linear, WeightOnlyLinear
from workbench_kernels._common import triton_available

Q = wb.quant
needs_triton = pytest.mark.skipif(not triton_available(), reason="no CUDA GPU and TRITON_INTERPRET is not set")


def linear(K, N, seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(K, N, bias=bias))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("M", [1, 17, 3000])
def test_w8a8_cpu_fused_path_equals_the_reference(static, M):
    """The CPU path (workbench_kernels/w8a8_cpu: quantization, torch._int_mm and the rescale fused block by block)
    computes exactly the reference's numbers, for per-token and static activation scales, with and without a
    bias."""
    K, N = 200, 136
    for bias in (True, False):
        lin = linear(K, N, bias=bias)
        x = torch.randn(M, K) * 3
        act = torch.tensor(x.abs().max().item() / 127.5)
        ref = W8A8Linear.from_float(lin[0], act_scale=act if static else None)
        cpu = W8A8Linear.from_float(lin[0], kernel="cpu", act_scale=act if static else None)
        with torch.no_grad():
            assert torch.equal(cpu(x), ref(x))


def test_w8a8_cpu_without_a_compiler_says_so(monkeypatch):
    import workbench_kernels.w8a8_cpu as w8a8_cpu

    monkeypatch.setattr(w8a8_cpu, "_build", lambda: (None, RuntimeError("Error building extension\nc++: not found")))
    layer = W8A8Linear.from_float(nn.Linear(16, 8), kernel="cpu")
    with pytest.raises(RuntimeError, match="needs ninja and a working C\\+\\+ compiler.*kernel='reference'"):
        layer(torch.randn(2, 16))


def test_w8a8_cpu_is_inference_only_but_works_with_grad_enabled():
    lin = linear(64, 32)
    cpu = W8A8Linear.from_float(lin[0], kernel="cpu")
    y = cpu(torch.randn(2000, 64))                         # grad mode on: no error, no graph
    assert not y.requires_grad


def test_w8a8_cpu_keeps_the_input_gradient_and_the_input_dtype():
    """An input that needs its gradient runs the reference's math (a graph, the reference's numbers); a half input
    of a smoothed layer (fp32 factors promote it) comes back in its own dtype, as from the reference."""
    lin = linear(64, 32)
    smooth = torch.rand(64) + 0.5
    ref = W8A8Linear.from_float(lin[0], smooth=smooth)
    cpu = W8A8Linear.from_float(lin[0], kernel="cpu", smooth=smooth)
    x = torch.randn(5, 64, requires_grad=True)
    y = cpu(x)
    assert y.requires_grad and torch.equal(y, ref(x))
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    xh = torch.randn(5, 64).half()
    with torch.no_grad():
        got, want = cpu(xh), ref(xh)
    assert got.dtype == want.dtype == torch.float16 and torch.equal(got, want)


@pytest.mark.parametrize("config", [Q.WeightOnly(8, None), Q.WeightOnly(4, 32), Q.WeightOnly(4, 32, symmetric=False),
                                    Q.WeightOnly(4, 32, symmetric=False, method="hqq"), Q.WeightOnly(3, 24),
                                    Q.WeightOnly(2, 16, symmetric=False), Q.NF4(32)])
@pytest.mark.parametrize("shape", [(4, 7, 128), (1, 128), (33, 128)])
def test_weight_only_cpu_path_matches_the_reference(config, shape):
    """workbench_kernels.weight_only_cpu computes in fp32 from the stored codes: the reference's numbers up to the
    order of
    the sums (decode-sized inputs), exactly (prefill-sized inputs: the same decoded weight, the same GEMM)."""
    lin = linear(128, 96)
    x = torch.randn(*shape)
    ref = wb.apply(lin, {"0": config}).apply(
        lambda m: m.set_kernel("reference") if isinstance(m, WeightOnlyLinear) else None)
    cpu = wb.apply(lin, {"0": config})
    assert (ref[0].kernel, cpu[0].kernel) == ("reference", "cpu")   # "auto" (the default) picks the CPU kernel
    with torch.no_grad():
        a, b = ref(x), cpu(x)
        assert b.dtype == x.dtype
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        xb = x.bfloat16()                                # bf16 inputs: fp32 math here, bf16 GEMM in the reference
        assert cpu(xb).dtype == torch.bfloat16
        assert (cpu(xb).float() - a).norm() / a.norm() < 1e-2


def test_weight_only_cpu_keeps_the_input_gradient():
    """Training through a quantized layer (grad of the input needed) runs the reference's differentiable math."""
    q = wb.apply(linear(64, 32), {"0": Q.WeightOnly(4, 32)})
    assert q[0].kernel == "cpu"
    x = torch.randn(3, 64, requires_grad=True)
    q(x).sum().backward()
    expected = q[0].effective_weight().sum(0).expand(3, -1)
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-5)


def test_weight_only_cpu_follows_new_tensors():
    """The kernel's fp32 copy of scales / zeros is rebuilt when the stored tensors change (e.g. load_state_dict)."""
    a = wb.apply(linear(64, 32, seed=0), {"0": Q.WeightOnly(4, 32, symmetric=False)})
    b = wb.apply(linear(64, 32, seed=1), {"0": Q.WeightOnly(4, 32, symmetric=False)})
    x = torch.randn(2, 64)
    with torch.no_grad():
        before = a(x)
        a.load_state_dict(b.state_dict())
        assert not torch.equal(a(x), before)
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_weight_only_cpu_runs_on_a_layer_built_under_inference_mode():
    """Buffers made under torch.inference_mode have no version counter: the kernel's cache must not need one."""
    lin = linear(64, 32)
    with torch.inference_mode():
        q = wb.apply(lin, {"0": Q.WeightOnly(4, 32)}, progress=False)
        x = torch.randn(3, 64)
        torch.testing.assert_close(q(x), q[0].set_kernel("reference")(x), rtol=1e-5, atol=1e-5)


def test_fp8_weights_have_no_cpu_kernel():
    q = wb.apply(linear(64, 32), {"0": Q.FP8()})
    assert q[0].kernel == "reference"                    # "auto": nothing faster here
    with pytest.raises(ValueError, match="FP8Format.*has no 'cpu' kernel"):
        q[0].set_kernel("cpu")


def test_kernel_choice_is_part_of_the_config_and_survives_save_load(tmp_path):
    model = wb.models.load("digits-mlp")
    q = wb.apply(model, {"fc*": Q.WeightOnly(4, 32, kernel="cpu")})
    assert wb.measure(q, "digits", quick=True, progress=False).kernels == {"WeightOnlyLinear:cpu": 3}
    wb.save(q, tmp_path / "q.safetensors")
    again = wb.load(tmp_path / "q.safetensors", base=model)
    assert again.fc1.kernel == "cpu"
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(q(x), again(x))


def test_paths_that_cannot_run_raise():
    with pytest.raises(ValueError, match="kernel='triton'.*int8 per-channel.*int4"):
        Q.WeightOnly(3, 32, kernel="triton")
    with pytest.raises(ValueError, match="Dynamic\\(kernel='triton'\\)"):
        Q.Static(kernel="triton")
    with pytest.raises(ValueError, match="WeightOnly.kernel must be one of"):
        Q.WeightOnly(4, 32, kernel="fast")
    m = W8A8Linear.from_float(nn.Linear(32, 16), act_scale=torch.tensor(0.1))
    with pytest.raises(ValueError, match="static.*has no 'triton' kernel"):
        m.set_kernel("triton")
    nf4 = WeightOnlyLinear.from_float(nn.Linear(64, 16), wb.quant.NF4(32).format())
    with pytest.raises(ValueError, match="has no 'triton' kernel"):
        nf4.set_kernel("triton")
    # the fast paths are matmuls: a conv matched by a fast-path config is refused by name, not left on the reference
    with pytest.raises(ValueError, match="conv1"):
        wb.apply(wb.models.load("digits-cnn"), {"conv1": Q.WeightOnly(8, None, kernel="cpu")})


def test_triton_needs_a_gpu_without_the_interpreter(monkeypatch):
    import workbench_kernels._common as common

    monkeypatch.setattr(common, "INTERPRET", False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        WeightOnlyLinear.from_float(nn.Linear(64, 16), wb.quant.WeightOnly(4, 32).format(), kernel="triton")


@needs_triton
@pytest.mark.parametrize("config", [Q.WeightOnly(8, None, kernel="triton"), Q.WeightOnly(4, 32, kernel="triton"),
                                    Q.WeightOnly(4, 32, symmetric=False, kernel="triton"),
                                    Q.WeightOnly(4, 32, symmetric=False, method="hqq", kernel="triton"),
                                    Q.Dynamic(kernel="triton")])
def test_triton_paths_match_the_reference(config):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lin = linear(96, 48).to(device)
    x = torch.randn(2, 5, 96, device=device)
    reference = type(config)(**{**config.__dict__, "kernel": "reference"})
    ref = wb.apply(lin, {"0": reference})
    tri = wb.apply(lin, {"0": config})
    assert tri[0].kernel == "triton"
    with torch.no_grad():
        a, b = ref(x), tri(x)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("config", [Q.WeightOnly(3, 8), Q.WeightOnly(4, None, symmetric=False), Q.Dynamic()])
def test_qat_fused_fake_quant_matches_the_pytorch_path(config):
    """kernel='triton' fake quantization: the same forward and the same weight / input gradients."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8)).to(device)
    x = torch.randn(6, 32, device=device)
    outs, grads = [], []
    for kernel in ("reference", "triton"):
        qm = wb.qat.prepare(model, {"0": config, "2": config}, kernel=kernel)
        assert qm[0].kernel == kernel
        y = qm(x)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append([p.grad.clone() for p in qm.parameters()])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_qat_kernel_choice_is_checked():
    model = nn.Sequential(nn.Linear(32, 8))
    with pytest.raises(ValueError, match="kernel must be"):
        wb.qat.prepare(model, {"0": Q.WeightOnly(4, 16)}, kernel="cpu")
    if triton_available():
        with pytest.raises(ValueError, match="learnable_scales"):
            wb.qat.prepare(model, {"0": Q.WeightOnly(4, 16)}, learnable_scales=True, kernel="triton")


def test_auto_picks_the_device_fast_path_and_records_it():
    """kernel='auto': the CPU fast path on the CPU where the module has one, the reference elsewhere (convs)."""
    model = wb.models.load("digits-cnn")
    q = wb.apply(model, {"fc1": Q.WeightOnly(4, 32, kernel="auto"), "fc2": Q.Dynamic(kernel="auto"),
                         "conv1": Q.WeightOnly(8, None, kernel="auto"), "conv2": Q.Static(kernel="auto")},
                 calibration=wb.tasks.load("digits").calibration(16))
    from workbench_kernels.w8a8_cpu import int8_dot_product

    # the W8A8 CPU path is an int8 GEMM: "auto" takes it only where the CPU has an int8 dot-product instruction
    w8a8 = "cpu" if int8_dot_product() else "reference"
    assert (q.fc1.kernel, q.fc2.kernel, q.conv1.kernel, q.conv2.kernel) == ("cpu", w8a8, "reference", "reference")
    kernels = wb.measure(q, "digits", quick=True, progress=False).kernels
    assert kernels["WeightOnlyLinear:cpu"] == 1 and kernels[f"W8A8Linear:{w8a8}"] == 1
    if torch.cuda.is_available():
        gpu = wb.apply(model.cuda(), {"fc1": Q.WeightOnly(4, 32, kernel="auto")})
        assert gpu.fc1.kernel == "triton"
