"""workbench_kernels/fake_quant.py: fused fake quantization (forward and straight-through backward) against QAT's
`fake_quantize_ste`, exactly in fp32; per channel and per group, signed and unsigned grids."""
import pytest
import torch

from workbench.quantization.primitives import choose_qparams, qrange
from workbench.quantization.qat import fake_quantize_ste
from workbench_kernels import fake_quant as fq
from workbench_kernels._common import INTERPRET, triton_available

DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="needs a CUDA GPU or TRITON_INTERPRET=1")


def _case(shape, bits, symmetric, group_size, shrink=0.7, seed=0):
    """x (..., K) and the grouped qparams QAT would use, with scales shrunk so that some values clamp."""
    torch.manual_seed(seed)
    x = (torch.randn(shape) * 2).to(DEVICE)
    K = shape[-1]
    xg = x.reshape(-1, K if group_size is None else group_size)        # (G, g)
    scale, zero = choose_qparams(xg, bits, symmetric, signed=symmetric)
    qmin, qmax = qrange(bits, symmetric)
    rows = x.numel() // K
    return x, (scale * shrink).reshape(rows, -1), zero.float().reshape(rows, -1), qmin, qmax


def _ste(x, scale, zero, qmin, qmax, group_size):
    """QAT's own function on the grouped view."""
    K = x.shape[-1]
    g = K if group_size is None else group_size
    return fake_quantize_ste(x.reshape(-1, g), scale.reshape(-1, 1), zero.reshape(-1, 1), qmin, qmax).reshape(x.shape)


@pytest.mark.parametrize("shape,group_size", [((5, 80), None), ((33, 80), 16), ((2, 3, 64), 32), ((1, 48), 8)])
@pytest.mark.parametrize("bits,symmetric", [(8, True), (4, False), (2, True), (3, False)])
def test_forward_and_grad_equal_fake_quantize_ste(shape, group_size, bits, symmetric):
    x, scale, zero, qmin, qmax = _case(shape, bits, symmetric, group_size)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = fq.fake_quantize(xa, scale, zero, qmin, qmax, group_size)
    expected = _ste(xb, scale, zero, qmin, qmax, group_size)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y, expected)
    grad = torch.randn_like(x)
    y.backward(grad)
    expected.backward(grad)
    assert torch.equal(xa.grad, xb.grad)
    clamped = (xa.grad == 0).float().mean().item()
    assert 0 < clamped < 0.6                       # the shrunk scales really clamp some values
    assert torch.equal(fq.reference(x, scale, zero, qmin, qmax, group_size), expected)


def test_zero_none_and_int32_zero():
    x, scale, zero, qmin, qmax = _case((7, 64), 4, False, 16)
    y = fq.fake_quantize(x, scale, zero, qmin, qmax, 16)
    assert torch.equal(fq.fake_quantize(x, scale, zero.to(torch.int32), qmin, qmax, 16), y)
    x, scale, _, qmin, qmax = _case((7, 64), 8, True, None)
    assert torch.equal(fq.fake_quantize(x, scale, None, qmin, qmax), _ste(x, scale, torch.zeros_like(scale),
                                                                          qmin, qmax, None))


def test_values_on_the_grid_ends_keep_their_gradient():
    """clamp passes gradients at qmin / qmax themselves (as torch.clamp's backward does)."""
    scale = torch.ones(1, 1, device=DEVICE)
    x = torch.tensor([[-129.0, -128.0, -3.5, 127.0, 127.4, 128.0]], device=DEVICE, requires_grad=True)
    fq.fake_quantize(x, scale, None, -128, 127).sum().backward()
    assert x.grad.tolist() == [[0.0, 1.0, 1.0, 1.0, 1.0, 0.0]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(dtype):
    x, scale, zero, qmin, qmax = _case((9, 64), 4, False, 32)
    x = x.to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = fq.fake_quantize(xa, scale, zero, qmin, qmax, 32)
    expected = fq.reference(xb, scale, zero, qmin, qmax, 32)
    assert y.dtype == dtype
    grad = torch.randn_like(x)
    y.backward(grad)
    expected.backward(grad)
    if dtype == torch.float16:
        assert torch.equal(y, expected) and torch.equal(xa.grad, xb.grad)
    else:  # the interpreter's fp32 -> bf16 cast truncates (the GPU rounds): within one bf16 ulp
        torch.testing.assert_close(y, expected, rtol=2 ** -7, atol=0)
        torch.testing.assert_close(xa.grad, xb.grad, rtol=2 ** -7, atol=0)


def test_learnable_scale_is_refused():
    x, scale, zero, qmin, qmax = _case((4, 32), 4, True, None)
    with pytest.raises(ValueError, match="scale requires grad"):
        fq.fake_quantize(x.requires_grad_(), scale.requires_grad_(), zero, qmin, qmax)


def test_bad_inputs_name_the_argument():
    x, scale, zero, qmin, qmax = _case((4, 32), 4, False, 8)
    with pytest.raises(ValueError, match="group_size"):
        fq.fake_quantize(x, scale, zero, qmin, qmax, 12)
    with pytest.raises(ValueError, match="scale must have shape"):
        fq.fake_quantize(x, scale, zero, qmin, qmax, 16)
    with pytest.raises(TypeError, match="scale must have dtype"):
        fq.fake_quantize(x, scale.half(), zero, qmin, qmax, 8)
    with pytest.raises(TypeError, match="zero must have dtype"):
        fq.fake_quantize(x, scale, zero.to(torch.uint8), qmin, qmax, 8)
    with pytest.raises(ValueError, match="zero must have shape"):
        fq.fake_quantize(x, scale, zero[:2], qmin, qmax, 8)
    with pytest.raises(TypeError, match="x must have dtype"):
        fq.fake_quantize(x.to(torch.int32), scale, zero, qmin, qmax, 8)
    with pytest.raises(ValueError, match="x must be contiguous"):
        fq.fake_quantize(torch.randn(32, 4, device=DEVICE).t(), scale, zero, qmin, qmax, 8)
    with pytest.raises(ValueError, match="qmin < qmax"):
        fq.fake_quantize(x, scale, zero, 7, 7, 8)
    with pytest.raises(ValueError, match="grad must have shape"):
        fq.fake_quantize_backward(x[:2], x, scale, zero, qmin, qmax, 8)


def test_opcheck_and_compile():
    x, scale, zero, qmin, qmax = _case((3, 32), 4, False, 16)
    xr = x.clone().requires_grad_()
    torch.library.opcheck(torch.ops.workbench.fake_quantize.default, (xr, scale, zero, qmin, qmax, 16))
    torch.library.opcheck(torch.ops.workbench.fake_quantize.default, (x, scale[:, :1].contiguous(), None, -8, 7))
    torch.library.opcheck(torch.ops.workbench.fake_quantize_backward.default,
                          (torch.randn_like(x), x, scale, zero, qmin, qmax, 16))

    def loss(x):
        return (fq.fake_quantize(x * 2, scale, zero, qmin, qmax, 16) ** 2).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled(xa).backward()
    loss(xb).backward()
    assert torch.equal(xa.grad, xb.grad)


def test_nan_propagates_like_torch_clamp():
    x = torch.tensor([[1.0, float("nan"), -3.0, 100.0]], device=DEVICE)
    scale = torch.full((1, 1), 0.5, device=DEVICE)
    y = fq.fake_quantize(x, scale, None, -8, 7)
    expected = _ste(x, scale, torch.zeros_like(scale), -8, 7, None)
    torch.testing.assert_close(y, expected, equal_nan=True, rtol=0, atol=0)
