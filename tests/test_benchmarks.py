"""Smoke tests: every benchmark runs (tiny settings) so none can rot."""
from benchmarks.measure import bench_measure


def test_bench_measure_smoke():
    df = bench_measure("digits-mlp", threads=1, repeats=1, quick_modes=(True,))
    assert list(df["quick"]) == [True] and (df["median_s"] > 0).all() and df.loc[0, "primary"] > 0.9


def test_bench_quantization_smoke():
    from benchmarks.quantization import bench_quantization

    df = bench_quantization(models=("tiny-lm",), calib=8, quick=True, threads=1, bits_list=(4,), methods=("rtn",))
    assert list(df["plan"]) == ["fp32", "W4 g64 rtn", "W8A8 dynamic", "W8A8 dynamic + SmoothQuant 0.5"]
    assert (df["size_ratio"].iloc[1:] < 0.6).all() and (df["perplexity"] > 1).all()
