"""Smoke tests: every benchmark runs (tiny settings) so none can rot."""
from benchmarks.measure import bench_measure


def test_bench_measure_smoke():
    df = bench_measure("digits-mlp", threads=1, repeats=1, quick_modes=(True,))
    assert list(df["quick"]) == [True] and (df["median_s"] > 0).all() and df.loc[0, "primary"] > 0.9
