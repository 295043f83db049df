"""Lab 41 (fp8 recipes): every checker passes its worked solution and rejects a plausible wrong implementation
with the hint written for that mistake."""
import pytest
import torch
from torch import nn

from workbench.teach import fp8 as L
from workbench.teach.fp8 import checks

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2



@pytest.fixture(scope="module")
def grad():
    torch.manual_seed(0)
    return torch.randn(64, 10) * 1e-5 * torch.rand(64, 1) ** 4        # small, spread over decades, as gradients


def test_round_trip(grad):
    x = torch.tensor([0.013, -0.2, 0.75, 1.9, -3.3, 12.0])
    assert L.check_round_trip(checks._solution_round_trip(x, E4M3, 100.0), x, E4M3, 100.0).passed
    wrong = L.check_round_trip((x * 100.0).clamp(-448, 448).to(E4M3).float(), x, E4M3, 100.0)
    assert wrong.status == "failed" and "divide by the scale" in wrong.hint


def test_zero_fraction(grad):
    assert L.check_zero_fraction(checks._solution_zero_fraction(grad, E5M2), grad, E5M2).passed
    with_zeros = torch.cat([grad.flatten(), torch.zeros(100)])
    wrong = L.check_zero_fraction(float((with_zeros.to(E5M2) == 0).float().mean()), with_zeros, E5M2)
    assert wrong.status == "failed" and "not zero to begin with" in wrong.hint


def test_current_scale(grad):
    assert L.check_current_scale(checks._solution_current_scale(grad, E5M2), grad, E5M2).passed
    wrong = L.check_current_scale(float(grad.abs().max()) / 57344.0, grad, E5M2)
    assert wrong.status == "failed" and "inverse" in wrong.hint


def test_relative_error(grad):
    assert L.check_relative_error(checks._solution_relative_error(grad, E5M2), grad, E5M2).passed
    unscaled = float((grad.to(E5M2).float() - grad).norm() / grad.norm())
    wrong = L.check_relative_error(unscaled, grad, E5M2)
    assert wrong.status == "failed" and "scale first" in wrong.hint


def test_better_gradient_format_is_measured_not_recalled(grad):
    right = checks._solution_better_gradient_format(grad)
    assert L.check_better_gradient_format(right, grad).passed
    other = {"e4m3": "e5m2", "e5m2": "e4m3"}[right]
    wrong = L.check_better_gradient_format(other, grad)
    assert wrong.status == "failed" and "measured relative errors" in wrong.hint


def test_delayed_scale():
    history = [2.5, 3.1, 2.8, 3.0]
    assert L.check_delayed_scale(checks._solution_delayed_scale(history, 448.0, 1), history, 448.0, margin=1).passed
    last = L.check_delayed_scale(448.0 / 3.0 / 2, history, 448.0, margin=1)
    assert last.status == "failed" and "largest amax of the whole history" in last.hint
    no_margin = L.check_delayed_scale(448.0 / 3.1, history, 448.0, margin=1)
    assert no_margin.status == "failed" and "divide by 2**margin" in no_margin.hint


def test_saturating_steps():
    trace = [1.0, 2.0, 1.5, 1.2, 1.1, 1.9, 1.0, 1.0, 1.8]
    assert L.check_saturating_steps(checks._solution_saturating_steps(trace, 2), trace, 2).passed
    assert L.saturating_steps(trace, 2) == 3 and L.saturating_steps(trace, 8) == 1
    whole = L.check_saturating_steps(1, trace, 2)       # counted against the whole past, not the last 2 steps
    assert whole.status == "failed" and "previous 2 steps" in whole.hint


def test_headroom():
    assert L.check_headroom(checks._solution_headroom(2), 2).passed
    wrong = L.check_headroom(2, 2)
    assert wrong.status == "failed" and "exponent" in wrong.hint


def test_saved_bytes():
    assert L.check_saved_bytes(checks._solution_saved_bytes(256, [64, 256, 128]), 256, [64, 256, 128]).passed
    wrong = L.check_saved_bytes(256 * 448 * 3, 256, [64, 256, 128])
    assert wrong.status == "failed" and "not fp32" in wrong.hint


def test_step_tensors_and_amax_trace_leave_the_model_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    before = [p.detach().clone() for p in model.parameters()]
    seen = L.step_tensors(model, torch.randn(32, 8), torch.randint(0, 3, (32,)))
    assert set(seen) == {"0", "2"} and seen["2"]["grad"].shape == (32, 3) and seen["0"]["input"].shape == (32, 8)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
