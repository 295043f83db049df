"""wb.sensitivity: per-layer rows, exact prefix replay, caching, interruption, bad input."""
import importlib
import json

import pandas as pd
import pytest
import torch

import workbench as wb
from workbench.analysis import replay as replay_mod

sens_mod = importlib.import_module("workbench.analysis.sensitivity")  # the module, not the function

INT8 = wb.quant.WeightOnly(bits=8, group_size=None)
INT2 = wb.quant.WeightOnly(bits=2, group_size=16)


@pytest.fixture(scope="module")
def tiny_lm():
    return wb.models.load("tiny-lm"), wb.tasks.load("tiny-lm")


def test_rows_are_single_layer_measurements(digits_mlp, digits_task, tmp_path):
    before = {k: v.clone() for k, v in digits_mlp.state_dict().items()}
    df = wb.sensitivity(digits_mlp, digits_task, {"int8": INT8, "int2": INT2}, cache=tmp_path, progress=False)
    assert list(df["layer"]) == ["fc1", "fc1", "fc2", "fc2", "fc3", "fc3"]
    assert set(df["status"]) == {"ok"}
    # the user's model is untouched
    assert all(torch.equal(before[k], v) for k, v in digits_mlp.state_dict().items())
    assert type(digits_mlp.fc1) is torch.nn.Linear
    # each row equals applying that single change and evaluating it
    row = df[(df.layer == "fc2") & (df.candidate == "int2")].iloc[0]
    single = wb.apply(digits_mlp, {"fc2": INT2}, progress=False)
    value = digits_task.evaluate(single, quick=True)["accuracy"]
    assert row["value"] == pytest.approx(value, abs=1e-12)
    assert row["loss"] == pytest.approx(df.attrs["base"] - value, abs=1e-12)
    assert row["size_after"] == wb.size_bytes(single.fc2)
    assert row["size_before"] == wb.size_bytes(digits_mlp.fc2)
    assert json.loads(row["config"])["bits"] == 2
    assert df.attrs["complete"] and df.attrs["higher_is_better"]


def test_prefix_replay_is_exact(tiny_lm, tmp_path):
    model, task = tiny_lm
    layers = ["h.0.mlp.c_fc", "h.2.attn.c_proj", "h.3.mlp.c_proj", "lm_head"]
    layers = [n for n in layers if n in dict(model.named_modules())]
    fast = wb.sensitivity(model, task, [INT2], layers, cache=False, progress=False)
    slow = wb.sensitivity(model, task, [INT2], layers, cache=False, progress=False, replay=False)
    assert fast.attrs["replay"].startswith("on: 4 blocks")
    pd.testing.assert_series_equal(fast["value"], slow["value"], rtol=0, atol=1e-9)
    assert (fast["loss"] < 0).sum() + (fast["loss"] > 0).sum() > 0  # int2 changes the perplexity


def test_replay_skips_finished_blocks(tiny_lm):
    model, task = tiny_lm
    import copy

    work = copy.deepcopy(model)
    rp = replay_mod.PrefixReplay(work, ["h.0.attn.c_attn", "h.3.mlp.c_fc"])
    rp.record(lambda: task.evaluate(work, quick=True))
    assert rp.skippable == {"h.0.attn.c_attn": 0, "h.3.mlp.c_fc": 3}
    reference = task.evaluate(work, quick=True)["perplexity"]
    with rp.skip_before("h.3.mlp.c_fc") as k:
        assert k == 3 and isinstance(work.get_submodule("h.0"), replay_mod._Replay)
        assert task.evaluate(work, quick=True)["perplexity"] == pytest.approx(reference, abs=1e-9)
    assert not isinstance(work.get_submodule("h.0"), replay_mod._Replay)
    with pytest.raises(RuntimeError, match="not repeatable"):  # a different evaluation is refused, not replayed
        with rp.skip_before("h.3.mlp.c_fc"):
            pass


def test_cache_hits_and_resume(digits_mlp, digits_task, tmp_path, monkeypatch):
    cands = {"int8": INT8, "int2": INT2}
    first = wb.sensitivity(digits_mlp, digits_task, cands, ["fc1"], cache=tmp_path, progress=False)
    calls = []
    real = sens_mod._Session

    class Counting(real):
        def __init__(self, *a, **k):
            calls.append(a[3])
            super().__init__(*a, **k)

    monkeypatch.setattr(sens_mod, "_Session", Counting)
    again = wb.sensitivity(digits_mlp, digits_task, cands, ["fc1"], cache=tmp_path, progress=False)
    assert calls == []  # everything from the cache
    pd.testing.assert_frame_equal(first.drop(columns="seconds"), again.drop(columns="seconds"))
    both = wb.sensitivity(digits_mlp, digits_task, cands, ["fc1", "fc3"], cache=tmp_path, progress=False)
    assert calls == [["fc3"]]  # only the missing layer is measured
    assert len(both) == 4
    # a changed model has another fingerprint: nothing reused
    other = wb.apply(digits_mlp, {"fc3": INT8}, progress=False)
    wb.sensitivity(other, digits_task, cands, ["fc1"], cache=tmp_path, progress=False)
    assert calls[-1] == ["fc1"]


def test_interrupt_keeps_partial_rows(digits_mlp, digits_task, tmp_path, monkeypatch):
    real = sens_mod._Session
    seen = []

    class Interrupting(real):
        def rows(self, layer, todo=None):
            if layer == "fc2":
                raise KeyboardInterrupt
            seen.append(layer)
            yield from super().rows(layer, todo)

    monkeypatch.setattr(sens_mod, "_Session", Interrupting)
    with pytest.warns(UserWarning, match="interrupted"):
        df = wb.sensitivity(digits_mlp, digits_task, [INT8], cache=tmp_path, progress=False)
    assert list(df["layer"]) == ["fc1"] and df.attrs["complete"] is False
    monkeypatch.undo()
    resumed = wb.sensitivity(digits_mlp, digits_task, [INT8], cache=tmp_path, progress=False)
    assert list(resumed["layer"]) == ["fc1", "fc2", "fc3"] and resumed.attrs["complete"]


def test_latency_and_unsupported_rows(digits_task, tmp_path):
    cnn = wb.models.load("digits-cnn")
    df = wb.sensitivity(cnn, digits_task, {"dyn": wb.quant.Dynamic(), "int8": INT8}, ["conv1", "fc1"],
                        latency=True, cache=False, progress=False)
    conv_dyn = df[(df.layer == "conv1") & (df.candidate == "dyn")].iloc[0]
    assert conv_dyn["status"] == "unsupported" and pd.isna(conv_dyn["value"])
    ok = df[df.status == "ok"]
    assert (ok["latency_before_ms"] > 0).all() and (ok["latency_after_ms"] > 0).all()


def test_calibrated_candidates_use_task_calibration(digits_mlp, digits_task):
    gptq = wb.quant.WeightOnly(bits=2, group_size=16, method="gptq")
    df = wb.sensitivity(digits_mlp, digits_task, [gptq], ["fc2"], calibration=64, cache=False, progress=False)
    single = wb.apply(digits_mlp, {"fc2": gptq}, calibration=digits_task.calibration(64), progress=False)
    assert df["value"].iloc[0] == pytest.approx(digits_task.evaluate(single, quick=True)["accuracy"], abs=1e-12)
    with pytest.raises(ValueError, match="need calibration"):
        wb.sensitivity(digits_mlp, digits_task, [gptq], ["fc2"], calibration=None, cache=False, progress=False)


def test_bad_input(digits_mlp, digits_task):
    with pytest.raises(ValueError, match="empty"):
        wb.sensitivity(digits_mlp, digits_task, [], cache=False)
    with pytest.raises(ValueError, match="'fc9' is not in DigitsMLP"):
        wb.sensitivity(digits_mlp, digits_task, [INT8], ["fc9"], cache=False)
    with pytest.raises(KeyError, match="no metric 'bleu'"):
        wb.sensitivity(digits_mlp, digits_task, [INT8], metric="bleu", cache=False)
    with pytest.raises(TypeError, match="single WeightOnly"):
        wb.sensitivity(digits_mlp, digits_task, INT8, cache=False)
    with pytest.raises(TypeError, match="not a technique config"):
        wb.sensitivity(digits_mlp, digits_task, ["int8"], cache=False)
    with pytest.raises(ValueError, match="listed twice"):
        wb.sensitivity(digits_mlp, digits_task, [INT8, INT8], cache=False)


def test_task_that_does_not_report_its_metric(digits_mlp, digits_task):
    class Silent(type(digits_task)):
        def evaluate(self, model, quick=False):
            return {}

    silent = Silent.__new__(Silent)
    silent.__dict__.update(digits_task.__dict__)
    with pytest.raises(RuntimeError, match="did not report metric 'accuracy'"):
        wb.sensitivity(digits_mlp, silent, [INT8], ["fc3"], cache=False, progress=False)
