"""wb.ui.Session: incremental, all-or-nothing apply; history, restore, undo/redo; the user's model untouched."""
import threading

import pytest
import torch

import workbench as wb
from workbench.ui.session import Cancelled, Session

INT8 = wb.quant.WeightOnly(bits=8, group_size=None)
INT4 = wb.quant.WeightOnly(bits=4, group_size=16)


@pytest.fixture
def session(digits_mlp, digits_task):
    return Session(digits_mlp, digits_task)


def test_incremental_apply_matches_wb_apply(session, digits_mlp, digits_task):
    before = {k: v.clone() for k, v in digits_mlp.state_dict().items()}
    first = session.apply_and_measure()
    assert first.label == "reference" and first.metrics.plans == []
    session.set(["fc1", "fc2"], INT8)
    assert session.changed == ["fc1", "fc2"]
    built = []
    real = wb.plans.registry.handler_for(INT8).apply

    def counting(name, *a, **k):
        built.append(name)
        return real(name, *a, **k)

    handler = wb.plans.registry.handler_for(INT8)
    handler.apply = counting
    try:
        session.apply_and_measure()
        session.set("fc2", INT4)  # only fc2 is rebuilt next time
        third = session.apply_and_measure()
    finally:
        del handler.apply
    assert built == ["fc1", "fc2", "fc2"]
    reference = wb.apply(digits_mlp, {"fc1": INT8, "fc2": INT4}, progress=False)
    x = digits_task.example_inputs(16)[0]
    with torch.inference_mode():
        assert torch.equal(session.work(x), reference(x))
    assert third.metrics.size_bytes == wb.size_bytes(reference)
    assert third.metrics.plans == [session.plan.to_dict()]
    assert all(torch.equal(before[k], v) for k, v in digits_mlp.state_dict().items())
    assert type(digits_mlp.fc2) is torch.nn.Linear


def test_undo_redo_restore(session):
    session.set("fc1", INT8)
    session.set("fc3", INT4)
    assert session.undo() and session.assigned == {"fc1": INT8}
    assert session.redo() and session.assigned == {"fc1": INT8, "fc3": INT4}
    assert not session.redo()
    session.apply_and_measure()
    session.set("fc1", None)
    session.apply_and_measure()
    session.restore(0)
    assert session.assigned == {"fc1": INT8, "fc3": INT4} and session.changed == ["fc1"]
    assert session.undo() and session.assigned == {"fc3": INT4}


def test_failures_leave_nothing_half_applied(session, digits_task):
    cnn = Session(wb.models.load("digits-cnn"), digits_task)
    with pytest.raises(ValueError, match="Dynamic cannot be applied to layer 'conv1'"):
        cnn.set(["fc1", "conv1"], wb.quant.Dynamic())
    assert cnn.assigned == {}  # fc1 was not assigned either
    session.apply_and_measure()
    good = session.work.fc1
    # the Triton kernels need whole groups (the other paths take a short last group): refused when set
    bad = wb.quant.WeightOnly(bits=4, group_size=7, kernel="triton")
    with pytest.raises(ValueError, match="layer .fc2.: .*no 'triton' kernel"):
        session.set("fc2", bad)
    session.set("fc1", INT8)
    # bypassing the check: fails on apply
    session.assigned["fc2"] = bad
    with pytest.raises(wb.ApplyError, match="'fc2'"):
        session.apply_and_measure()
    assert session.work.fc1 is good and len(session.history) == 1  # fc1 not swapped in either
    cancel = threading.Event()
    cancel.set()
    session.set("fc2", INT8)
    with pytest.raises(Cancelled):
        session.apply_and_measure(cancel=cancel)
    assert session.work.fc1 is good
    with pytest.raises(ValueError, match="no editable layer matches 'fc9'"):
        session.set("fc9", INT8)
    with pytest.raises(ValueError, match="not an editable layer"):
        session.set(["nope"], INT8)


def test_calibrated_layers_and_estimate(session, digits_mlp, digits_task):
    gptq = wb.quant.WeightOnly(bits=2, group_size=16, method="gptq")
    session.set("fc2", gptq)
    est = session.estimate()
    assert est is not None and est.fits and est.parts["calibrated layers"] == 1
    session.apply_and_measure()
    reference = wb.apply(digits_mlp, {"fc2": gptq}, calibration=digits_task.calibration(32), progress=False)
    x = digits_task.example_inputs(8)[0]
    with torch.inference_mode():
        assert torch.equal(session.work(x), reference(x))
    assert session.estimate() is None  # nothing left to calibrate


def test_plan_json_round_trip(session):
    session.set("fc*", INT4)
    text = session.plan.to_json()
    other = Session(session.original, session.task)
    other.load_plan(text)
    assert other.assigned == session.assigned
    rows = other.layer_rows()
    assert list(rows["technique"]) == ["WeightOnly · 4 bits · group 16 · rtn"] * 3


def test_status_says_why_pruning_left_the_size_as_it_was(digits_mlp, digits_task):
    s = Session(digits_mlp, digits_task, threads=1)
    s.set(s.select("fc1"), wb.prune.Magnitude(0.5))                       # the default storage: "mask"
    masked = s.apply_and_measure()
    assert masked.metrics.size_bytes >= s.history[0].metrics.size_bytes   # nothing saved ...
    assert "storage 'mask' keeps every weight" in masked.status and "'csr'" in masked.status   # ... and said why
    s.set(s.select("fc1"), wb.prune.Magnitude(0.8, storage="csr"))   # value + int32 index: 0.4x the bytes
    stored = s.apply_and_measure()
    assert stored.metrics.size_bytes < s.history[0].metrics.size_bytes and "keeps every weight" not in stored.status


def _llama_and_task(layers: int = 3):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (24, 16), generator=torch.Generator().manual_seed(1))
    return model, wb.tasks.Fidelity(model, {"input_ids": ids[:16]}, calibration={"input_ids": ids[16:]})


def _counting(monkeypatch, config) -> list[str]:
    built: list[str] = []
    handler = wb.plans.registry.handler_for(config)
    real = handler.apply

    def counting(name, *a, **k):
        built.append(name)
        return real(name, *a, **k)

    monkeypatch.setattr(handler, "apply", counting)
    return built


def _same_logits(a, b, ids) -> bool:
    with torch.inference_mode():
        return torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("pipeline", ["sequential", "original"])
def test_the_session_builds_what_wb_apply_builds_and_rebuilds_only_what_a_change_reaches(monkeypatch, pipeline):
    """One applier: the session's working copy equals wb.apply of the session's plan with the same calibration
    batches and pipeline, after every edit. Sequentially a change in block 1 reaches the calibrated layers of the
    blocks after it (their inputs were block 1's outputs), so those blocks are rebuilt, and nothing before it."""
    import warnings

    model, task = _llama_and_task()
    gptq = wb.quant.WeightOnly(bits=4, group_size=32, method="gptq")
    built = _counting(monkeypatch, gptq)   # (one handler for every WeightOnly config)
    s = Session(model, task, calibration=8, threads=1, pipeline=pipeline)
    s.set(s.select("model.layers.*.mlp.[gu]*_proj"), gptq)
    s.set(s.select("model.layers.*.mlp.down_proj"), INT8)
    ids = task.example_inputs(4)["input_ids"]
    data = task.calibration(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # calibrated block by block, no fallback to the original pipeline
        s.apply_and_measure()
    assert len(built) == 9
    first = wb.apply(model, s.plan, calibration=data, progress=False, pipeline=pipeline)
    assert _same_logits(s.work, first, ids)
    built.clear()
    s.set("model.layers.1.mlp.down_proj", INT4)
    s.apply_and_measure()
    after_block_1 = {f"model.layers.2.mlp.{p}_proj" for p in ("gate", "up", "down")}
    expected = {"model.layers.1.mlp.down_proj"} | (after_block_1 if pipeline == "sequential" else set())
    assert sorted(built) == sorted(expected)
    second = wb.apply(model, s.plan, calibration=data, progress=False, pipeline=pipeline)
    assert _same_logits(s.work, second, ids)
    other = wb.apply(model, s.plan, calibration=data, progress=False,
                     pipeline="original" if pipeline == "sequential" else "sequential")
    assert not _same_logits(s.work, other, ids)   # the pipelines differ: the equality above says which one ran
    s.undo()
    s.apply_and_measure()
    assert _same_logits(s.work, first, ids)
    assert type(model.model.layers[1].mlp.down_proj) is torch.nn.Linear


def test_a_failure_in_a_later_block_leaves_the_working_copy_as_it_was():
    model, task = _llama_and_task()
    gptq = wb.quant.WeightOnly(bits=4, group_size=32, method="gptq")
    s = Session(model, task, calibration=8, threads=1)
    s.set(s.select("model.layers.*.mlp.*"), gptq)
    s.apply_and_measure()
    held = {n: m for n, m in s.work.named_modules()}
    s.set("model.layers.0.mlp.down_proj", INT8)
    s.assigned["model.layers.2.mlp.up_proj"] = wb.quant.WeightOnly(bits=4, group_size=7, kernel="triton")  # (unchecked)
    with pytest.raises(wb.ApplyError, match="'model.layers.2.mlp.up_proj'"):
        s.apply_and_measure()
    assert {n: m for n, m in s.work.named_modules()} == held and len(s.history) == 1
    s.assigned["model.layers.2.mlp.up_proj"] = gptq
    s.apply_and_measure()
    assert _same_logits(s.work, wb.apply(model, s.plan, calibration=task.calibration(8), progress=False),
                        task.example_inputs(4)["input_ids"])


def test_a_calibrated_head_is_calibrated_on_the_compressed_blocks_as_wb_apply_does():
    """The head is outside the blocks: wb.apply calibrates it last, with every block compressed. Rebuilt alone (its
    config changed) or because a block changed, the session does the same."""
    import warnings

    model, task = _llama_and_task()
    gptq = wb.quant.WeightOnly(bits=4, group_size=32, method="gptq")
    s = Session(model, task, calibration=8, threads=1)
    s.set(s.select("model.layers.*.mlp.[gu]*_proj"), gptq)
    s.set("lm_head", gptq)
    s.apply_and_measure()
    data, ids = task.calibration(8), task.example_inputs(4)["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "cannot be calibrated block by block"
        for layer, config in [("lm_head", wb.quant.WeightOnly(bits=8, group_size=32, method="gptq")),
                              ("model.layers.2.mlp.down_proj", INT4)]:
            s.set(layer, config)
            s.apply_and_measure()
            assert _same_logits(s.work, wb.apply(model, s.plan, calibration=data, progress=False), ids), layer


def test_a_conv1d_left_again_is_the_models_own_module():
    """GPT-2's Conv1D is rewritten to a Linear while the plan reaches it; when the assignment is taken back, the
    working copy holds the model's own Conv1D again, as wb.apply of the empty plan would."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    task = wb.tasks.Fidelity(model, {"input_ids": ids})
    s = Session(model, task, threads=1)
    s.set("transformer.h.0.mlp.c_fc", INT8)
    s.apply_and_measure()
    assert isinstance(s.work.transformer.h[0].mlp.c_fc, wb.quant.WeightOnlyLinear)
    s.set("transformer.h.0.mlp.c_fc", None)
    entry = s.apply_and_measure()
    assert type(s.work.transformer.h[0].mlp.c_fc) is transformers.pytorch_utils.Conv1D
    assert entry.quality == pytest.approx(0.0, abs=1e-9)


def test_new_calibration_samples_mark_the_calibrated_layers_changed(session, digits_mlp, digits_task):
    gptq = wb.quant.WeightOnly(bits=2, group_size=16, method="gptq")
    session.set("fc2", gptq)
    session.set("fc1", INT8)
    session.apply_and_measure()
    assert session.changed == []
    session.calibration = 16
    assert session.changed == ["fc2"]   # calibrated on 32 samples so far; fc1 needs no calibration
    session.apply_and_measure()
    reference = wb.apply(digits_mlp, session.plan, calibration=digits_task.calibration(16), progress=False)
    x = digits_task.example_inputs(8)[0]
    with torch.inference_mode():
        assert torch.equal(session.work(x), reference(x))
