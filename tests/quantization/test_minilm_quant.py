"""Quantization of the real MiniLM: storage and GPTQ vs RTN end to end (fidelity on held-out documents)."""
import pytest
import torch

import workbench as wb

pytestmark = pytest.mark.slow
Q = wb.quant


def int4_plan(method):
    return wb.Plan({"encoder.*": Q.WeightOnly(4, 64, method=method),
                    "embeddings.word_embeddings": Q.WeightOnly(4, 64)})


@pytest.fixture(scope="module")
def results(minilm, minilm_task):
    calib = minilm_task.calibration(32)
    # batch_size: the latency / memory batch only (the tests read size, dtypes and quality): 1 keeps it cheap
    out = {"fp32": wb.measure(minilm, minilm_task, quick=True, threads=2, batch_size=1, progress=False)}
    for method in ("rtn", "gptq", "awq"):
        q = wb.apply(minilm, int4_plan(method), calibration=calib, progress=False)
        out[method] = wb.measure(q, minilm_task, quick=True, threads=2, batch_size=1, progress=False)
    return out


def test_int4_g64_stores_under_30_percent(results):
    ratio = results["rtn"].size_bytes / results["fp32"].size_bytes
    assert ratio <= 0.30, ratio
    assert results["rtn"].dtypes["uint8"] > results["rtn"].dtypes.get("float32", 0)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_ptq_has_higher_fidelity_than_rtn(results, method):
    rtn, better = results["rtn"].primary_value, results[method].primary_value
    assert 0.85 < rtn < better < 1.0, (rtn, better)
    assert better - rtn > 0.01


def test_smoothquant_w8a8_beats_plain_w8a8(minilm, minilm_task, results):
    calib = minilm_task.calibration(32)
    plain = wb.apply(minilm, {"encoder.*": Q.Dynamic()}, progress=False)
    smooth = wb.apply(minilm, {"encoder.*": Q.Dynamic(smooth_alpha=0.5)}, calibration=calib, progress=False)
    loss_plain = 1 - minilm_task.fidelity(plain, quick=True)
    loss_smooth = 1 - minilm_task.fidelity(smooth, quick=True)
    assert 0 < loss_smooth < 0.6 * loss_plain, (loss_plain, loss_smooth)


@pytest.mark.parametrize("bits", [4, 3])
def test_gptq_and_awq_lower_layer_output_error_on_held_out_text(minilm, minilm_task, bits):
    """FFN output projection of layer 3: calibration documents 0-31, error on held-out documents."""
    from workbench.plans import capture_inputs, normalize_calibration
    from workbench.quantization.primitives import sqnr

    layer = "encoder.layer.3.output.dense"
    calib = minilm_task.calibration(32)
    held = capture_inputs(minilm, [layer], [minilm_task.example_inputs(8)])[layer][0][0]
    lin = minilm.get_submodule(layer)
    inputs = capture_inputs(minilm, [layer], normalize_calibration(calib, minilm))[layer]
    with torch.no_grad():
        ref = lin(held)
        err = {}
        for method in ("rtn", "gptq", "awq"):
            q = wb.apply(torch.nn.Sequential(lin), {"0": Q.WeightOnly(bits, 64, method=method)},
                         calibration=[b[0] for b in inputs], progress=False)
            err[method] = sqnr(ref, q(held))
    assert err["gptq"] > err["rtn"] + 1.0 and err["awq"] > err["rtn"] + 1.0, err
