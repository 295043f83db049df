"""Calibration observers: ranges, clipping and their effect on quantization error."""
import pytest
import torch

from workbench.quantization.observers import MSE, Histogram, MinMax, MovingAverageMinMax, Percentile
from workbench.quantization.primitives import PerChannel, PerToken, dequantize, qrange, quantize


def heavy_tailed(n=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[:5] = torch.tensor([40.0, -35.0, 30.0, 25.0, -50.0])  # a few outliers
    return x


def mse_of(x, scale, zp, bits=8):
    qmin, qmax = qrange(bits, True)
    xg = x.reshape(1, -1)
    return float((dequantize(quantize(xg, scale, zp, qmin, qmax, torch.int32), scale, zp) - xg).pow(2).mean())


def test_minmax_and_moving_average():
    obs = MinMax()
    obs.observe(torch.tensor([-1.0, 2.0]))
    obs.observe(torch.tensor([-3.0, 1.0]))
    lo, hi = obs.range()
    assert lo.item() == -3.0 and hi.item() == 2.0
    ma = MovingAverageMinMax(momentum=0.5)
    ma.observe(torch.tensor([-1.0, 1.0]))
    ma.observe(torch.tensor([-3.0, 3.0]))
    assert ma.range()[1].item() == 2.0
    scale, zp = obs.qparams(8, symmetric=True)
    assert scale.item() == pytest.approx(3.0 / 127.5) and zp.item() == 0


def test_per_channel_observer():
    obs = MinMax(PerChannel(0))
    obs.observe(torch.tensor([[1.0, -2.0], [0.5, 0.25]]))
    scale, _ = obs.qparams(8)
    assert scale.shape == (2, 1) and scale[0].item() > scale[1].item()


@pytest.mark.parametrize("cls", [Percentile, MSE, Histogram])
def test_clipping_observers_beat_minmax_on_outliers(cls):
    x = heavy_tailed()
    mm, clip = MinMax(), cls()
    for chunk in x.split(5000):
        mm.observe(chunk)
        clip.observe(chunk)
    s_mm, z_mm = mm.qparams(4)
    s_c, z_c = clip.qparams(4)
    assert s_c.item() < s_mm.item()                                  # it clipped the outliers
    assert mse_of(x, s_c, z_c, 4) < 0.7 * mse_of(x, s_mm, z_mm, 4)   # and that lowers the total error


def test_observer_errors():
    with pytest.raises(RuntimeError, match="MinMax has observed no data"):
        MinMax().qparams()
    with pytest.raises(ValueError, match="NaN or Inf"):
        MinMax().observe(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="PerToken ranges are computed at run time"):
        MinMax(PerToken())
    with pytest.raises(ValueError, match="percentile q must be in"):
        Percentile(q=10)
    with pytest.raises(TypeError, match="floating-point tensor"):
        MinMax().observe(torch.tensor([1, 2]))


def test_histogram_grows_its_range():
    h = Histogram(bins=256)
    h.observe(torch.randn(1000))
    h.observe(torch.randn(1000) * 10)
    assert h.edge >= float(h.hi.abs().max()) and h.hist.sum().item() == 2000
    assert 0 < h.threshold(8) <= h.edge


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 100_003])
@pytest.mark.parametrize("q", [1.0, 0.9999, 0.999, 0.99, 0.9, 0.75, 0.6, 0.4, 0.1, 0.01, 0.0001, 0.0])
def test_percentile_quantiles_equal_torch_quantile(n, q):
    """The top-k shortcut gives torch.quantile's numbers bit for bit, on both tails and (by falling back to it)
    in the middle; rows of different distributions, ties included."""
    from workbench.quantization.observers import _quantile

    g = torch.Generator().manual_seed(n)
    xg = torch.stack([torch.randn(n, generator=g), torch.rand(n, generator=g).round(decimals=1),
                      torch.randn(n, generator=g).exp()])
    assert torch.equal(_quantile(xg, q), torch.quantile(xg, q, dim=1))
