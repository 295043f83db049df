"""Bounded memory at LLM scale, measured in fresh subprocesses (`workbench.benchmarks.memory`): an in-place GPTQ
of a ~250 M-parameter random-init bf16 Llama (16 x 256 calibration tokens) grows the peak resident set by at most
half the model's bytes, and `wb.load` of its int4 file on an `empty_weights` base needs about the file's bytes."""
import pytest

from workbench.benchmarks.memory import bench_inplace_memory

pytest.importorskip("transformers")


@pytest.mark.slow   # ~1 min on 2 cores
def test_inplace_gptq_of_a_200m_llama_grows_by_at_most_half_the_model_and_loads_in_the_int4_bytes():
    r = bench_inplace_memory("llama-200m", samples=16, seq=256, threads=2, load=True)
    assert r["params"] > 200e6 and r["model_bytes"] == 2 * r["params"]   # bf16 throughout
    assert r["growth"] <= 0.5 * r["model_bytes"], r
    # the int4 file (bf16 embeddings and head, int4 g64 blocks) is well under half the model ...
    assert r["load_file_bytes"] < 0.5 * r["model_bytes"]
    # ... and loading it takes about its bytes: nothing of the fp model is built first (the weights are mapped
    # from the file and paged in by the first forward)
    assert r["load_growth"] <= 0.25 * r["load_file_bytes"], r
    assert r["load_growth_after_forward"] <= 1.15 * r["load_file_bytes"], r
