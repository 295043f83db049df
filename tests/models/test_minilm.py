"""MiniLM: the offline model reproduces the published-here fp32 references; the issue's example plan works."""
import pytest
import torch

import workbench as wb
from workbench.tasks import sentence

pytestmark = pytest.mark.slow

REFERENCES = {"wordsim353": 0.729, "simlex999": 0.446, "lee": 0.656, "pang_lee": 0.730}


@pytest.fixture(scope="module")
def fp32_metrics(minilm, minilm_task):
    return wb.measure(minilm, minilm_task, threads=2)


def test_layer_names_and_size(minilm):
    names = dict(minilm.named_modules())
    assert "encoder.layer.0.intermediate.dense" in names and "embeddings.word_embeddings" in names
    assert "pooler" not in names
    linears = [n for n, m in names.items() if type(m) is torch.nn.Linear]
    assert len(linears) == 36  # 6 layers x (q, k, v, attn out, ffn in, ffn out); the pooler is not built
    assert sum(p.numel() for p in minilm.parameters()) == 22_565_376


def test_fp32_reproduces_references(fp32_metrics):
    q = fp32_metrics.quality
    for name, ref in REFERENCES.items():
        assert q[name] == pytest.approx(ref, abs=0.01), name
    assert q["fidelity"] == pytest.approx(1.0, abs=1e-6)
    assert fp32_metrics.primary == "fidelity"
    assert fp32_metrics.size_bytes == 22_565_376 * 4 + 2 * 512 * 8  # + int64 position_ids, token_type_ids buffers
    assert fp32_metrics.batch_size == 8 and fp32_metrics.latency_ms > 0


def test_bf16_ffn_plan_from_the_issue(minilm, minilm_task, fp32_metrics):
    plan = wb.Plan({"encoder.layer.*.intermediate.dense": wb.precision.Cast(torch.bfloat16)})
    assert len(plan.resolve(minilm)) == 6
    small = wb.apply(minilm, plan)
    assert minilm.encoder.layer[0].intermediate.dense.weight.dtype == torch.float32
    m = wb.measure(small, minilm_task, quick=True, threads=2)
    # bf16 keeps 8 mantissa bits: embeddings move, but only slightly
    assert 0.995 < m.quality["fidelity"] < 1.0 - 1e-6
    saved = 6 * (1536 * 384 + 1536) * 2
    assert fp32_metrics.size_bytes - m.size_bytes == saved


def test_calibration_and_example_inputs(minilm_task):
    batches = minilm_task.calibration(20, batch_size=8)
    assert sum(b[0].shape[0] for b in batches) == 20
    assert all(b[0].shape == b[1].shape and b[0].shape[1] <= 128 for b in batches)
    ids, mask = minilm_task.example_inputs(3)
    assert ids.shape == mask.shape == (3, 128) and bool(mask.all())
    assert set(sentence.CALIBRATION_DOCS).isdisjoint(sentence.EVAL_DOCS)
    with pytest.raises(ValueError, match="asked for 151 samples, but the split has only 150"):
        minilm_task.calibration(151)


def test_calibration_runs_through_apply(minilm, minilm_task):
    from workbench.plans import capture_inputs, normalize_calibration

    batches = normalize_calibration(minilm_task.calibration(4, batch_size=2), minilm)
    rec = capture_inputs(minilm, ["encoder.layer.0.intermediate.dense"], batches)
    got = rec["encoder.layer.0.intermediate.dense"]
    assert len(got) == 2 and got[0][0].shape[-1] == 384
    with pytest.raises(ValueError, match=r"calibration batch 0 \(\(2, 5\) float32\) could not be run"):
        capture_inputs(minilm, ["encoder.layer.0.intermediate.dense"], [(torch.rand(2, 5),)])
