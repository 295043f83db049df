"""Smoke tests: every benchmark runs (tiny settings) so none can rot."""
from workbench.benchmarks.measure import bench_measure


def test_bench_measure_smoke():
    df = bench_measure("digits-mlp", threads=1, repeats=1, quick_modes=(True,))
    assert list(df["quick"]) == [True] and (df["median_s"] > 0).all() and df.loc[0, "primary"] > 0.9


def test_bench_quantization_smoke():
    from workbench.benchmarks.quantization import bench_quantization

    df = bench_quantization(models=("tiny-lm",), calib=8, quick=True, threads=1, bits_list=(4,), methods=("rtn",),
                            pipelines=("sequential", "original"))
    assert list(df["plan"]) == ["fp32", "W4 g64 rtn", "W8A8 dynamic"] + ["W8A8 dynamic + SmoothQuant 0.5"] * 2
    assert list(df["pipeline"]) == ["", "", "", "sequential", "original"]
    assert (df["size_ratio"].iloc[1:] < 0.6).all() and (df["perplexity"] > 1).all()


def test_bench_analysis_smoke():
    from workbench.benchmarks.analysis import bench_analysis

    timings, predicted, df = bench_analysis("digits-mlp", "digits", layers=None, threads=1, budget_fraction=0.5,
                                            quick_verify=True, compare_replay=True)
    assert timings.loc[0, "layers"] == 3 and timings.loc[0, "cached_s"] < timings.loc[0, "cold_s"]
    assert timings.loc[0, "cold_without_replay_s"] > 0
    assert (predicted["bytes"] <= predicted["budget_bytes"]).all()
    assert list(df["label"][:4]) == ["reference", "int8", "int4 g64", "50% sparse"]
    assert df["pareto_size"].any() and (df["layers_fraction"].iloc[1:] <= 1.3).all()


def test_bench_ui_smoke():
    from workbench.benchmarks.ui import bench_ui

    df = bench_ui(cases=(("digits-mlp", "digits"),), threads=1, edits=2)
    assert df.loc[0, "points"] == 3 and df.loc[0, "one_layer_median_s"] > 0


def test_bench_honest_smoke():
    from workbench.benchmarks.honest import bench_honest

    df = bench_honest(models=("digits-mlp",), threads=1, repeats=1)
    assert len(df) == 4 and (df["median_s"] > 0).all() and (df["budget_s"] == 2.0).all()
    unchanged = df[df["point"] == "unchanged copy"]
    # a smoke test of the benchmark's plumbing, not of the statistics (tests/measurement/test_speedup.py holds
    # those): a quick 95 % interval of an unchanged copy misses 1.0 by chance (and by drift on a loaded machine),
    # but it never reads as a gain or loss of more than a few percent
    assert ((unchanged["low"] <= 1.03) & (unchanged["high"] >= 0.97)).all(), unchanged[["low", "high"]]


def test_bench_inplace_memory_smoke():
    from workbench.benchmarks.memory import bench_inplace_memory

    arch = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256)
    r = bench_inplace_memory(arch, samples=4, seq=32, threads=1, load=True, timeout=300)
    assert r["model_bytes"] > 0 and r["peak_after"] >= r["peak_before"] and r["seconds"] > 0
    assert 0 < r["load_file_bytes"] < r["model_bytes"] and r["load_seconds"] > 0
