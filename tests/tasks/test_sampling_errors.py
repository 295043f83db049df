"""Every kind of task states the sampling error of its quality where it can: Fidelity (Wilson / Student's t over
the compared vectors), the ImageNet photos task, and Custom when the user's function returns ``<metric>_error``."""
import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

import workbench as wb
from workbench.measurement.sampling import wilson_halfwidth


def _pair():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    other = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    other.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return ref, other


def test_fidelity_states_wilson_and_t_errors_that_match_a_direct_computation():
    ref, other = _pair()
    x = torch.randn(400, 16)
    task = wb.tasks.Fidelity(ref, x, logits=True, calibration=torch.randn(8, 16))
    values, errors = task.evaluate_with_error(other)
    assert set(errors) == set(values) == {"kl_divergence", "top1_agreement", "cosine"}
    with torch.no_grad():
        a, b = ref(x).double(), other(x).double()
    agree = int((a.argmax(-1) == b.argmax(-1)).sum())
    assert values["top1_agreement"] == agree / 400
    assert errors["top1_agreement"] == pytest.approx(wilson_halfwidth(agree, 400))
    kl = (a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum(-1).numpy()
    half = stats.t.ppf(0.975, len(kl) - 1) * kl.std(ddof=1) / np.sqrt(len(kl))
    assert values["kl_divergence"] == pytest.approx(kl.mean(), rel=1e-9)
    assert errors["kl_divergence"] == pytest.approx(half, rel=1e-6)
    assert 0 < errors["cosine"] < 0.1
    assert task.evaluate(other) == values
    # the reference against itself: no disagreement, KL 0 with zero spread
    same, same_err = task.evaluate_with_error(ref)
    assert same["top1_agreement"] == 1.0 and same["kl_divergence"] == pytest.approx(0, abs=1e-12)
    assert same_err["kl_divergence"] == pytest.approx(0, abs=1e-12) and same_err["top1_agreement"] > 0


def test_fidelity_errors_reach_measure_and_compare():
    ref, other = _pair()
    task = wb.tasks.Fidelity(ref, torch.randn(200, 16), logits=True, calibration=torch.randn(8, 16))
    m = wb.measure(other, task, quick=True, progress=False)
    assert m.primary == "kl_divergence" and m.primary_error is not None and m.primary_error > 0
    assert set(m.quality_error) == {"kl_divergence", "top1_agreement", "cosine"}
    assert f"+- {m.primary_error:.2g}" in str(m)


def test_custom_task_error_keys():
    model = nn.Linear(4, 2)
    task = wb.tasks.Custom(lambda m: {"f1": 0.9, "f1_error": 0.02, "extra": 3.0}, metric="f1", higher_is_better=True,
                           example_inputs=torch.randn(2, 4))
    values, errors = task.evaluate_with_error(model)
    assert values == {"f1": 0.9, "extra": 3.0} and errors == {"f1": 0.02}
    assert task.evaluate(model) == values
    plain = wb.tasks.Custom(lambda m: 0.5, metric="f1", higher_is_better=True, example_inputs=torch.randn(2, 4))
    assert plain.evaluate_with_error(model) == ({"f1": 0.5}, {})
    bad = wb.tasks.Custom(lambda m: {"f1": 0.9, "f1_error": -1}, metric="f1", higher_is_better=True,
                          example_inputs=torch.randn(2, 4))
    with pytest.raises(ValueError, match="f1_error"):
        bad.evaluate_with_error(model)
