"""wb.measure and its parts: real bytes, peak memory, latency bookkeeping, Metrics rows."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.measurement import bytes_by_dtype, layer_table, peak_memory, size_bytes, time_forward


def test_size_bytes_counts_storage_once_and_as_stored():
    lin = nn.Linear(100, 10)                      # 1010 fp32 values
    assert size_bytes(lin) == 1010 * 4
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert size_bytes(tied) == 40 * 4             # shared weight counted once
    packed = nn.Module()
    packed.register_buffer("q", torch.zeros(64, 32, dtype=torch.uint8))    # 64x64 int4 values, two per byte
    packed.register_buffer("scales", torch.zeros(64, 1, dtype=torch.float16))
    assert size_bytes(packed) == 64 * 64 // 2 + 64 * 2
    assert bytes_by_dtype(packed) == {"uint8": 2048, "float16": 128}


def test_layer_table(digits_mlp):
    df = layer_table(digits_mlp)
    assert list(df["layer"]) == ["fc1", "fc2", "fc3"]
    assert df["bytes"].sum() == size_bytes(digits_mlp)
    assert df.loc[0, "shape"] == (256, 64)


def test_peak_memory_sees_activations():
    model = nn.Sequential(nn.Linear(256, 2048), nn.GELU(), nn.Linear(2048, 256)).eval()
    small = peak_memory(model, (torch.randn(8, 256),))
    large = peak_memory(model, (torch.randn(256, 256),))
    weights = size_bytes(model)
    assert small.bytes > weights and "profiler" in small.method
    # two (256, 2048) fp32 activations are alive at once around the GELU: at least 2 MiB more
    assert large.bytes - weights >= 2 * 256 * 2048 * 4
    assert large.bytes > small.bytes


def test_time_forward_restores_threads():
    before = torch.get_num_threads()
    lat = time_forward(nn.Linear(8, 8), (torch.randn(2, 8),), threads=1, min_runs=3, max_runs=3)
    assert lat.runs == 3 and lat.threads == 1 and 0 < lat.median_ms <= lat.p90_ms
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be a positive int"):
        time_forward(nn.Linear(8, 8), (torch.randn(2, 8),), threads=0)


def test_measure_digits(digits_mlp, digits_task):
    m = wb.measure(digits_mlp, digits_task, threads=1, quick=True)
    assert m.model == "digits-mlp" and m.task == "digits" and m.primary == "accuracy"
    assert m.quality["accuracy"] >= 0.95 and m.higher_is_better == {"accuracy": True}
    assert m.size_bytes == size_bytes(digits_mlp) and m.dtypes == {"float32": m.size_bytes}
    assert m.threads == 1 and m.batch_size == 64 and m.device == "cpu" and m.torch_version == torch.__version__
    assert m.peak_memory_bytes > m.size_bytes
    row = m.to_dict()
    assert row["accuracy"] == m.quality["accuracy"] and row["primary_value"] == row["accuracy"]
    assert set(m.to_series().index) == set(row)

    small = wb.apply(digits_mlp, {"fc*": wb.precision.Cast(torch.bfloat16)})
    s = wb.measure(small, "digits", threads=1, quick=True, batch_size=16)
    assert s.size_bytes == m.size_bytes // 2 and s.dtypes == {"bfloat16": s.size_bytes}
    assert s.batch_size == 16 and s.plans == [wb.applied_plans(small)[0].to_dict()]
    df = wb.compare(m, s, labels=["fp32", "bf16"])
    assert list(df.index) == ["fp32", "bf16"] and df.loc["bf16", "size_ratio"] == 0.5


def test_measure_restores_training_mode(digits_mlp):
    digits_mlp.train()
    wb.measure(digits_mlp, "digits", quick=True)
    assert digits_mlp.training


def test_measure_bad_input(digits_mlp):
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        wb.measure("digits-mlp", "digits")
    with pytest.raises(ValueError, match="unknown task"):
        wb.measure(digits_mlp, "cifar")
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        wb.measure(digits_mlp, "digits", batch_size=0)
    with pytest.raises(ValueError, match=r"expects \(batch, classes\) logits"):
        wb.measure(nn.Sequential(nn.Linear(64, 10), nn.Flatten(0)), "digits")


def test_lower_is_better_direction():
    model = wb.models.load("tiny-lm")
    m = wb.measure(model, "tiny-lm", quick=True)
    assert m.higher_is_better == {"perplexity": False}
    worse = wb.measure(wb.models.architectures.TinyLM(model.config).eval(), "tiny-lm", quick=True)
    assert m.better_than(worse)
    assert "lower is better" in str(m)


def test_training_helpers_take_threads_and_restore_the_setting():
    """fit_classifier and distill.fit (like every helper with threads_option) run under `threads=` and put torch's
    thread count back, also when the argument is refused."""
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            seen.append(torch.get_num_threads())
            return self.fc(x)

    task = wb.tasks.load("digits")
    before = torch.get_num_threads()
    want = 1 if before > 1 else 2
    wb.training.fit_classifier(Probe(), task, epochs=1, lr=1e-3, progress=False, threads=want)
    assert set(seen) == {want} and torch.get_num_threads() == before
    seen.clear()
    wb.distill.fit(Probe(), wb.models.load("digits-mlp"), task.split, epochs=1, progress=False, threads=want)
    assert set(seen) == {want} and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be a positive int"):
        wb.training.fit_classifier(Probe(), task, epochs=1, lr=1e-3, progress=False, threads=0)
    assert torch.get_num_threads() == before
