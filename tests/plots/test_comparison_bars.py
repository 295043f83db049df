"""`wb.plots.comparison_bars`: four readable panels (2 x 2, no overlapping titles), plain-number labels and the
quality's sampling error as error bars."""
import pytest

import workbench as wb
from workbench.plots import _plain


@pytest.mark.parametrize("value, text", [(1380.4, "1,380"), (0.97265625, "0.9727"), (12.3456, "12.35"),
                                         (0.0, "0"), (2.5e7, "2.5e+07"), (0.00012, "0.00012")])
def test_bar_labels_are_plain_numbers(value, text):
    assert _plain(value) == text


def test_comparison_bars_grid_and_error_bars(digits_mlp, digits_task):
    reference = wb.measure(digits_mlp, digits_task, quick=True, threads=1)
    small = wb.apply(digits_mlp, {"fc*": wb.precision.Cast("bfloat16")})
    result = wb.measure(small, digits_task, quick=True, threads=1, baseline=digits_mlp)
    fig = wb.plots.comparison_bars([reference, result], labels=["fp32", "bf16"])
    assert len(fig.data) == 4
    domains = {(tuple(fig.layout[f"xaxis{i or ''}"].domain), tuple(fig.layout[f"yaxis{i or ''}"].domain))
               for i in ("", 2, 3, 4)}
    assert len(domains) == 4                                          # four separate panels
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0].startswith("accuracy") and titles[2] == "size, MiB (lower is better)"
    quality = fig.data[0]
    assert list(quality.error_y.array) == pytest.approx([reference.primary_error, result.primary_error])
    assert quality.text[0] == _plain(reference.primary_value)
    assert all("e+" not in t for bar in fig.data for t in bar.text)
    # speed from one regime: the paired speedup (the verdict's numbers), not two latencies measured apart
    speed = fig.data[1]
    assert titles[1].startswith("speedup over fp32") and "paired rounds" in titles[1]
    assert list(speed.y) == pytest.approx([1.0, result.speedup.ratio])
    assert speed.error_y.array[1] == pytest.approx(result.speedup.high - result.speedup.ratio)
    assert speed.customdata[1] == result.speedup.verdict


def test_comparison_bars_label_latencies_measured_apart_and_clip_a_wide_interval(digits_mlp, digits_task):
    import dataclasses

    reference = wb.measure(digits_mlp, digits_task, quick=True, threads=1)
    other = wb.measure(digits_mlp, digits_task, quick=True, threads=1)
    fig = wb.plots.comparison_bars([reference, other], labels=["a", "b"])
    assert fig.layout.annotations[1].text == "latency, ms (lower is better), each measured apart"
    assert list(fig.data[1].y) == pytest.approx([reference.latency_ms, other.latency_ms])
    # one interval reaching to 15x while the bar sits near 1: the axis stops at twice the tallest bar
    wide = dataclasses.replace(other, speedup=wb.measurement.Speedup(1.1, 0.3, 15.0, 1.0, 1.1, 8, 1))
    fig = wb.plots.comparison_bars([reference, wide], labels=["a", "b"])
    assert tuple(fig.layout.yaxis2.range) == pytest.approx((0, 2.2))
    assert fig.data[1].text[1].startswith("~1.10x")
