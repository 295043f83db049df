"""Smoke tests for the architecture benchmarks (recurrent int8, BatchNorm folding, rotations): tiny settings, so none
rots."""


def test_bench_recurrent_smoke():
    from workbench.benchmarks.recurrent import bench_recurrent

    df = bench_recurrent(batches=(2,), seq=4, hidden=16, layers=2, threads=1, warmup=1, rounds=2,
                         kernel="reference")
    assert list(df["kind"]) == ["LSTM", "GRU"] and (df["ours_ms"] > 0).all() and (df["torch_ao_ms"] > 0).all()
    assert (df["cos_ours"] > 0.99).all() and (df["state_bytes_ratio"] < 0.5).all()


def test_bench_fold_smoke():
    from workbench.benchmarks.fold import bench_fold

    df = bench_fold("tiny", batches=(2,), threads=1, warmup=1, rounds=2)
    assert df.loc[0, "bn_folded"] == df.loc[0, "bn_total"] == 3 and df.loc[0, "method"] == "fx"
    assert df.loc[0, "max_abs_err"] < 1e-4 and df.loc[0, "top1_agree"] == 1.0 and df.loc[0, "folded_ms"] > 0


def test_bench_experts_smoke():
    """The mixture-of-experts decode benchmark runs and its CPU kernel path computes the reference path's output."""
    from workbench.benchmarks.experts import bench_experts

    df = bench_experts(hidden=64, intermediate=96, experts=4, tokens=(2,), threads=1, warmup=1, rounds=2)
    assert list(df.path) == ["fp32", "int4 reference", "int4 cpu kernel", "w8a8 dynamic cpu kernel"]
    kernel = df[df.path == "int4 cpu kernel"].iloc[0]
    assert kernel.max_abs_diff_to_reference < 1e-4 and (df.median_ms > 0).all()


def test_bench_rotation_smoke():
    from workbench.benchmarks.rotation import bench_rotation, markdown

    ppl, kurt = bench_rotation("tiny-llama", calibration=8, quick=True, schemes=["fp32", "KV4 per token"])
    assert list(ppl.rotation) == ["none", "Rotate()", "Rotate(online=True)"] * 2
    fp32 = ppl[ppl.scheme == "fp32"]
    assert abs(fp32.ratio.iloc[1:] - 1).max() < 1e-4   # the rotation alone keeps the function
    assert kurt.loc[2, "mlp.down_proj"] < kurt.loc[0, "mlp.down_proj"] / 4
    text = markdown(ppl, kurt)
    assert "| KV4 per token | " in text and "input kurtosis" in text
