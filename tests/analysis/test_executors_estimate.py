"""Executors give the in-process results; calibration / training estimates agree with measured runs."""
import pandas as pd
import pytest
import torch

import workbench as wb
from workbench.analysis import ProcessPool, Ray, estimate_calibration, estimate_training
from workbench.measurement.footprint import peak_allocated_during

CANDS = {"int8": wb.quant.WeightOnly(bits=8, group_size=None), "int2": wb.quant.WeightOnly(bits=2, group_size=16)}
QUALITY = ["layer", "candidate", "status", "base", "value", "loss", "size_before", "size_after"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model, task = wb.models.load("digits-mlp"), wb.tasks.load("digits")
    table = wb.sensitivity(model, task, CANDS, cache=False, progress=False)
    return model, task, table


def _same_sweep(a, b):
    cols = ["label", "accuracy", "size_bytes", "pareto_size"]
    pd.testing.assert_frame_equal(a[cols].reset_index(drop=True), b[cols].reset_index(drop=True))


@pytest.mark.slow
def test_process_pool_matches_in_process(reference):
    model, task, table = reference
    pooled = wb.sensitivity(model, task, CANDS, cache=False, progress=False, executor=ProcessPool(2, threads=1))
    pd.testing.assert_frame_equal(table[QUALITY], pooled[QUALITY])
    plans = wb.analysis.uniform_plans(table)
    _same_sweep(wb.sweep(model, task, plans, quick=True, progress=False),
                wb.sweep(model, task, plans, quick=True, progress=False, executor="process"))


@pytest.mark.slow
def test_ray_matches_in_process(reference):
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install .[ray])")
    model, task, table = reference
    ray_exec = Ray(num_cpus=2, threads=1)
    try:
        on_ray = wb.sensitivity(model, task, CANDS, cache=False, progress=False, executor=ray_exec)
        pd.testing.assert_frame_equal(table[QUALITY], on_ray[QUALITY])
        plans = wb.analysis.uniform_plans(table)
        _same_sweep(wb.sweep(model, task, plans, quick=True, progress=False),
                    wb.sweep(model, task, plans, quick=True, progress=False, executor=ray_exec))
    finally:
        ray_exec.shutdown()


def test_executor_names():
    assert isinstance(wb.analysis.executors.get_executor(None), wb.analysis.InProcess)
    assert isinstance(wb.analysis.executors.get_executor("process"), ProcessPool)
    with pytest.raises(ValueError, match="executor must be"):
        wb.analysis.executors.get_executor("dask")
    with pytest.raises(ValueError, match="workers"):
        ProcessPool(0)


@pytest.mark.slow   # three calibrated runs of tiny-lm, each estimated and then measured
@pytest.mark.parametrize("method,pipeline", [("gptq", "sequential"), ("awq", "sequential"), ("gptq", "original")])
def test_calibration_estimate_is_close_to_the_measured_run(method, pipeline):
    model, task = wb.models.load("tiny-lm"), wb.tasks.load("tiny-lm")
    plan = wb.Plan({"h.*": wb.quant.WeightOnly(bits=4, group_size=32, method=method)})
    calibration = task.calibration(16)
    est = estimate_calibration(model, plan, calibration, pipeline=pipeline)
    assert est.parts["pipeline"] == pipeline
    measured_peak = peak_allocated_during(lambda: wb.apply(model, plan, calibration=calibration, progress=False,
                                                           pipeline=pipeline))
    assert 0.75 <= est.peak_bytes / measured_peak <= 1.33, (est.parts, measured_peak)
    assert est.fits and est.seconds > 0 and est.parts["layers timed"] == 4
    assert "estimated peak" in str(est)


def test_apply_refuses_a_calibration_that_does_not_fit(monkeypatch):
    model, task = wb.models.load("digits-mlp"), wb.tasks.load("digits")
    monkeypatch.setattr("workbench.plans.estimate.available_memory", lambda device="cpu": 1024)
    plan = {"*": wb.quant.WeightOnly(bits=4, group_size=16, method="gptq")}
    with pytest.raises(MemoryError, match="EXCEEDS"):
        wb.apply(model, plan, calibration=task.calibration(64), estimate=True, progress=False)


def test_training_estimate_is_close_to_the_measured_run():
    model = wb.models.load("digits-cnn")
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    est = estimate_training(model, (x, y), steps=10)
    import copy

    work = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(work.parameters())

    def steps():
        for _ in range(3):
            torch.nn.functional.cross_entropy(work(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    measured = peak_allocated_during(steps) + wb.size_bytes(model)
    assert 0.75 <= est.peak_bytes / measured <= 1.33
    with pytest.raises(ValueError, match="steps"):
        estimate_training(model, (x, y), steps=0)
