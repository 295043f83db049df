"""Smoke tests of `python -m workbench.benchmarks.kernels`: the functions run and produce well-formed tables (tiny
sizes; under the Triton interpreter on CPU the kernel times mean nothing, only the plumbing is checked)."""
import math

import pytest
import torch

from workbench.benchmarks import kernels as bench
from workbench_kernels._common import triton_available


@pytest.mark.skipif(not triton_available(), reason="no CUDA GPU and TRITON_INTERPRET is not set")
def test_gpu_table_plumbing():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32   # bf16 tl.dot is wrong in the interpreter
    df = bench.gpu_table({"tiny": (128, 32)}, ms=(3,), kernels=("int8_weight_only", "int4_g128", "w8a8", "fp8"),
                         device=device, dtype=dtype)
    assert list(df["kernel"]) == ["int8_weight_only", "int4_g128", "w8a8", "fp8"]
    assert (df["ms"] > 0).all() and (df["GB/s"] > 0).all()
    assert df.set_index("kernel")["ceiling"].to_dict() == pytest.approx(
        {"int8_weight_only": 16 / (8 + 16 / 128), "int4_g128": 16 / (4 + 16 / 128), "w8a8": 2.0, "fp8": 2.0})
    assert df.attrs["copy_bandwidth_GBs"] > 0
    with pytest.raises(ValueError, match="unknown kernel"):
        bench.gpu_table({"tiny": (128, 32)}, ms=(1,), kernels=("int3",), device=device, dtype=dtype, torchao=False)


@pytest.mark.slow
def test_cpu_minilm_table():
    # the plumbing on the first encoder layer's six Linears (the benchmark itself quantizes all 36)
    df = bench.cpu_minilm(batch_sizes=(1,), rounds=1, layers="encoder.layer.0.*")
    assert set(df["path"]) == {"fp32", "w8a8 cpu (ours)", "w8a8 reference", "int8 weight-only cpu",
                               "torch quantize_dynamic"}
    assert (df["ms"] > 0).all() and df["threads"].eq(1).all()
    fp32 = df.set_index("path").loc["fp32"]
    assert math.isclose(fp32["speedup_vs_fp32"], 1.0)


def test_environment_names_versions():
    text = bench.environment()
    assert f"torch {torch.__version__}" in text and "triton" in text


def test_gpu_results_filters_by_timing(tmp_path):
    import pandas as pd

    path = tmp_path / "results.csv"
    pd.DataFrame([{"part": "cpu", "ms": 1.0, "timing": None},
                  {"part": "gpu", "ms": 2.0, "timing": "CUDA-graph replay, L2 flushed (GPU time)"},
                  {"part": "gpu", "ms": 3.0, "timing": "eager Python call"}]).to_csv(path, index=False)
    assert list(bench.gpu_results(path)["ms"]) == [2.0, 3.0]
    assert list(bench.gpu_results(path, timing="CUDA-graph")["ms"]) == [2.0]
    runs = pd.DataFrame([{"part": "gpu", "ms": ms, "run": run} for run, ms in (("a", 1.0), ("a", 2.0), ("b", 3.0))])
    runs.to_csv(path, index=False)
    assert list(bench.gpu_results(path)["ms"]) == [3.0, 1.0, 2.0]   # the newest run first, each in its order
    assert bench.gpu_results(tmp_path / "absent.csv").empty
    recorded = bench.gpu_results(timing="CUDA-graph")   # the repository's rows: each says where and how it ran
    assert recorded.empty or (recorded["environment"].str.contains("torch") & (recorded["ms"] > 0)).all()


@pytest.mark.slow
def test_decode_rows_plumbing():
    """`bench_e2e.decode_rows` on the CPU (bf16; the quantized plans run the Triton kernels, under the interpreter
    here): the compiled and the eager loop each give a row with the path that ran, and a plan name it does not know is
    a row with its error."""
    from workbench.benchmarks import kernels_e2e as bench_e2e

    df = bench_e2e.decode_rows(("tiny-llama",), ("bf16", "int2"), device="cpu", new_tokens=3, prompt_tokens=2, runs=1)
    bf16 = df[df["plan"] == "bf16"].set_index("compile")
    assert bf16.loc[True, "path"] == "compiled" and bf16.loc[False, "path"] == "static-cache"
    assert (bf16["tokens_per_s"] > 0).all() and (bf16["model_MB"] > 0).all() and (bf16["vs_bf16"] == 1).all()
    assert df[df["plan"] == "int2"]["note"].str.startswith("apply: ValueError: unknown plan 'int2'").all()


def test_e2e_rows_plumbing():
    """`workbench.benchmarks.kernels_e2e` on a tiny Llama on the CPU: bf16 rows are timed; a path that cannot run
    there (2:4 needs CUDA) is a row with its error, not a crash."""
    from workbench.benchmarks import kernels_e2e as bench_e2e

    df = bench_e2e.model_rows(kinds=("llama",), paths=("bf16", "2:4 sparse"), device="cpu", tiny=True)
    bf16 = df[df["path"] == "bf16"]
    assert len(bf16) == 2 and (bf16["ms"] > 0).all() and (bf16["speedup"] == 1.0).all()
    assert "needs CUDA" in df.loc[df["path"] == "2:4 sparse", "note"].iloc[0]


def test_recording_a_run_keeps_every_earlier_row(tmp_path):
    """A benchmark run appends its rows under a run label; earlier rows (the lent-GPU runs) are never overwritten,
    and a run label is not reused."""
    import pandas as pd

    path = tmp_path / "results.csv"
    pd.DataFrame({"part": ["gpu", "gpu"], "run": ["h100_a", "h100_a"], "ms": [1.0, 2.0]}).to_csv(path, index=False)
    kept, added = bench.record(pd.DataFrame({"part": ["cpu"], "ms": [3.0]}), path, run="cpu_1")
    assert (kept, added) == (2, 1)
    df = pd.read_csv(path)
    assert list(df["run"]) == ["h100_a", "h100_a", "cpu_1"] and list(df["ms"]) == [1.0, 2.0, 3.0]
    assert bench.record(pd.DataFrame({"part": ["cpu"], "ms": [4.0]}), path)[0] == 3   # default label: part + time
    with pytest.raises(ValueError, match="already has a run named 'cpu_1'"):
        bench.record(pd.DataFrame({"part": ["cpu"], "ms": [5.0]}), path, run="cpu_1")
    assert len(pd.read_csv(path)) == 4
