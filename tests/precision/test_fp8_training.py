"""fp8 training recipes (`wb.precision.fp8_training`): the emulated numerics against a hand computation, delayed vs
current scaling on an outlier step, gradient underflow without scaling, and a short training run."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.precision.fp8 import Fp8Linear, Fp8Recipe, fp8_layers

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _by_hand(t, dtype, amax):
    fmax = torch.finfo(dtype).max
    s = fmax / amax
    return (t * s).clamp(-fmax, fmax).to(dtype).float() / s


def test_current_scaling_forward_and_backward_match_a_hand_computation():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    layer = Fp8Linear(lin, Fp8Recipe(scaling="current"))
    x = torch.randn(4, 3, 16, requires_grad=True)
    y = layer(x)
    xq, wq = _by_hand(x.detach(), E4M3, x.detach().abs().max()), _by_hand(lin.weight.detach(), E4M3,
                                                                          lin.weight.detach().abs().max())
    torch.testing.assert_close(y, xq @ wq.t() + lin.bias, rtol=0, atol=1e-6)
    g = torch.randn_like(y) * 1e-3
    y.backward(g)
    gq = _by_hand(g, E5M2, g.abs().max())
    torch.testing.assert_close(x.grad, gq @ wq, rtol=0, atol=1e-9)
    torch.testing.assert_close(lin.weight.grad, gq.reshape(-1, 8).t() @ xq.reshape(-1, 16), rtol=0, atol=1e-9)
    torch.testing.assert_close(lin.bias.grad, g.reshape(-1, 8).sum(0))
    # fp8 is coarse but not wrong: the forward stays within a few per cent of fp32
    rel = ((y - lin(x)).norm() / lin(x).norm()).detach()
    assert 1e-4 < float(rel) < 0.08


def test_delayed_scaling_saturates_on_an_outlier_step_and_current_does_not():
    lin = nn.Linear(8, 4)
    delayed = Fp8Linear(lin, Fp8Recipe(scaling="delayed", history=4))
    current = Fp8Linear(lin, Fp8Recipe(scaling="current"))
    calm = torch.full((2, 8), 0.5)
    for layer in (delayed, current):
        layer(calm)                                         # history: amax 0.5
    spike = calm.clone()
    spike[0, 0] = 50.0                                      # 100x the history's amax
    out_d, out_c = delayed(spike), current(spike)
    assert delayed.input_state.saturated == 1 and current.input_state.saturated == 0
    ref = lin(spike)
    assert float((out_d - ref).abs().max()) > 10 * float((out_c - ref).abs().max())
    assert delayed.input_state.history == [0.5, 50.0]       # recorded after the cast: the next step is scaled for it
    delayed(spike)
    assert delayed.input_state.saturated == 1               # no new saturation once the history has caught up


def test_eval_mode_records_nothing():
    layer = Fp8Linear(nn.Linear(8, 4), Fp8Recipe())
    layer.eval()
    layer(torch.randn(2, 8))
    assert layer.input_state.history == [] and layer.input_state.seen == 0


def test_small_gradients_underflow_in_e5m2_without_a_scale():
    g = torch.full((64,), 1e-8)
    assert bool((g.to(E5M2) == 0).all())                    # 1e-8 is below e5m2's smallest subnormal (2^-16)
    state = wb.precision.fp8.Fp8State(E5M2, Fp8Recipe(scaling="current"))
    torch.testing.assert_close(state.cast(g), g, rtol=0.13, atol=0)   # scaled: kept to e5m2's 2-bit mantissa


def test_fp8_training_copies_swaps_and_restores(digits_mlp):
    fp8 = wb.precision.fp8_training(digits_mlp, Fp8Recipe(scaling="current"))
    assert set(fp8_layers(fp8)) == {n for n, m in digits_mlp.named_modules() if isinstance(m, nn.Linear)}
    assert not fp8_layers(digits_mlp)                       # the user's model is untouched
    with pytest.raises(ValueError, match="no nn.Linear matches 'conv\\*'"):
        wb.precision.fp8_training(digits_mlp, layers="conv*")
    with pytest.raises(ValueError, match="scaling must be one of"):
        Fp8Recipe(scaling="just-in-time")
    back = wb.precision.fp8_restore(fp8)
    assert not fp8_layers(back) and all(type(m) is not Fp8Linear for m in back.modules())


@pytest.mark.slow      # two short trainings per recipe
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_training_in_fp8_reaches_fp32_accuracy(scaling, digits_mlp, digits_task):
    """The digits MLP trained from a fresh initialisation for two epochs, fp32 and fp8 from the same seed."""
    import copy

    torch.manual_seed(0)
    fp32 = copy.deepcopy(digits_mlp)
    for m in fp32.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    fp8 = wb.precision.fp8_training(fp32, Fp8Recipe(scaling=scaling))
    wb.training.fit_classifier(fp32, digits_task, epochs=2, lr=3e-3, progress=False)
    wb.training.fit_classifier(fp8, digits_task, epochs=2, lr=3e-3, progress=False)
    layers = fp8_layers(fp8).values()
    assert all(layer.grad_state.seen > 0 and len(layer.input_state.history) > 0 for layer in layers)
    a32 = wb.measure(fp32, digits_task, quick=True, threads=1).primary_value
    a8 = wb.measure(wb.precision.fp8_restore(fp8), digits_task, quick=True, threads=1).primary_value
    assert a32 > 0.9 and a8 > a32 - 0.03, (a8, a32)


def test_matched_layers_it_cannot_replace_are_reported_not_skipped_silently():
    """MHA's out_proj (read by nn.MultiheadAttention directly) and GPT-2's Conv1D stay in full precision, and the
    warning names each with its reason; a model with nothing it can replace is an error that names them."""
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    with pytest.warns(UserWarning, match=r"passed over 1 matched layer.*self_attn\.out_proj \(MultiheadAttention "
                                         r"uses its weight directly"):
        out = wb.precision.fp8_training(layer)
    assert sorted(fp8_layers(out)) == ["linear1", "linear2"]
    out(torch.randn(2, 5, 16)).sum().backward()          # the MHA still runs, and trains

    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                n_positions=16))
    with pytest.warns(UserWarning, match=r"passed over 4 matched layer.*transformers Conv1D"):
        out = wb.precision.fp8_training(gpt2, layers="*")
    assert list(fp8_layers(out)) == ["lm_head"]
    with pytest.raises(ValueError, match=r"no nn\.Linear matches 'transformer\.h\.\*'.*c_attn: a transformers "
                                         r"Conv1D"):
        wb.precision.fp8_training(gpt2, layers="transformer.h.*")
