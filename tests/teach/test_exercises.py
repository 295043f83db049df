"""Every exercise of lessons 10-50, as the learner meets it: the worked solution in the lesson module passes its
own check (what ``solutions=True`` runs), and a plausible wrong implementation is rejected with its specific hint.
Inputs are small stand-ins for the lessons' tensors, so the whole file runs in seconds."""
import math

import pandas as pd
import pytest
import torch

import workbench as wb
from workbench import teach
from workbench.teach import basics as B
from workbench.teach import distillation as D
from workbench.teach import formats as F
from workbench.teach import kernels as K
from workbench.teach import precision as PR
from workbench.teach import pruning as PN
from workbench.teach import ptq as PT
from workbench.teach import qat as Q
from workbench.teach.formats.checks import _decode_fields
from workbench.teach.precision.checks import _scaler_variant
from workbench.teach.ptq.checks import _alpha_search


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _weight(shape=(16, 128)):
    return torch.randn(*shape, generator=_g()) * 0.05


def _layer():
    """A Linear weight (48, 64) and inputs (256 tokens) with a few large channels, as AWQ / SmoothQuant see."""
    W = torch.randn(48, 64, generator=_g(1)) * 0.05
    X = torch.randn(256, 64, generator=_g(2)) * torch.where(torch.arange(64) % 16 == 3, 20.0, 1.0)
    return W, X


def _digits_cnn():
    return wb.models.load("digits-cnn")


X13, S13 = torch.tensor([-1.5, -1.3, -0.6, -0.2, 0.1, 0.3, 0.7, 1.0, 1.2]), 0.3
X13_LEAF = X13.clone().requires_grad_(True)                # the STE exercise's x: autograd must reach it
UPSTREAM13 = torch.tensor([0.8, -1.1, 0.3, 1.7, -0.4, 0.9, -1.6, 0.6, 1.3])
BF16_X = torch.cat([torch.randn(512, generator=_g(9)), torch.tensor(PR.HALFWAY)])
GRADS40 = torch.cat([torch.zeros(8), torch.rand(256, generator=_g(10)) * 1e-6])      # tiny activation gradients
PEAKS40 = [0.01, 0.2, 0.03, 0.01, 0.02, 0.2, 0.05, 0.01, 0.02, 0.01, 0.01, 0.3, 0.02]
X50 = torch.randn(3, 128, generator=_g(11))
LOGITS = torch.tensor([6.0, 1.5, -2.0, 0.3, 4.2, -1.0, 0.0, 2.2, -3.1, 1.1])
CODES = torch.randint(0, 16, (4, 16), generator=_g(), dtype=torch.uint8)


def _gradients():
    student, teacher = torch.randn(32, 10, generator=_g(3)), torch.randn(32, 10, generator=_g(4)) * 4
    return D.soft_gradient_norms(student, teacher, [1, 2, 4, 8])


def _kd_batch():
    """Student and teacher logits of 16 examples and their labels."""
    return torch.randn(16, 10, generator=_g(7)), 4 * torch.randn(16, 10, generator=_g(8)), torch.arange(16) % 10


def _int4_stored():
    """A (48, 128) int4 layer with one scale per 32 inputs, as `formats.encode` stores it."""
    return K.int4_layer(48, 128, group_size=32, seed=3)


def _methods():
    return pd.DataFrame({4: {"rtn": 0.97, "gptq": 0.985, "awq": 0.98}, 3: {"rtn": 0.80, "gptq": 0.86, "awq": 0.90}})


def _wrong_group(w):      # one scale per row instead of per group of 64
    s = w.abs().amax(dim=1, keepdim=True) / 7.5
    return (w / s).round().clamp(-8, 7) * s


def _flattened_nm(w):     # groups of 4 over the flattened (in, kh, kw): the mistake issue 23 found in the package
    g = w.detach().abs().reshape(-1, 4)
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(2, dim=1).indices, True)
    return keep.reshape(w.shape)


def _global_weights():
    return {"a": torch.randn(8, 16, generator=_g(5)), "b": torch.randn(32, 16, generator=_g(6)) * 0.1}


# (exercise id, check(answer) -> Feedback, a plausible wrong implementation (a function of nothing), hint words)
CASES = [
    ("10 e4m3 decoder", lambda a: F.check_e4m3_decode(a, torch.arange(256)),
     lambda: _decode_fields(torch.arange(256), subnormals=False), "subnormal"),
    ("10 int8 round trip", lambda a: F.check_int8_round_trip(a, _weight()),
     lambda: (lambda w: (w / (w.abs().max() / 127)).round().clamp(-128, 127) * (w.abs().max() / 127))(_weight()),
     "restricted range"),
    ("10 loses small values", lambda a: F.check_loses_small_values(a, torch.softmax(LOGITS * 4, -1)),
     lambda: "bf16", "exponent bits"),
    ("10 fp16 exp limit", F.check_fp16_exp_limit, lambda: math.log10(65504), "log10"),
    ("11 asymmetric quantizer", lambda a: B.check_asymmetric_quantizer(a, X13, lo=-0.9, hi=0.6, bits=4),
     lambda: (lambda c: (c, (c - 9) * 0.1))(torch.round(X13 / 0.1) + 9), "must be clipped"),
    ("11 codes used", lambda a: B.check_codes_used(a, _weight().flatten(), bits=8), lambda: 256, "every code"),
    ("11 group quantizer", lambda a: B.check_group_quantizer(a, _weight(), bits=4, group_size=64),
     lambda: _wrong_group(_weight()), "one scale per row"),
    ("11 best clipping", lambda a: B.check_best_clipping(a, B.clipping_curve(_layer()[1], bits=8, points=40)),
     lambda: float(_layer()[1].abs().max()), "no clipping"),
    ("12 GPTQ block", lambda a: PT.check_gptq_block(a, PT.gptq_block(*_layer(), bits=3)),
     lambda: (lambda b: (b.W / b.scale[:, None]).round().clamp(b.qmin, b.qmax) * b.scale[:, None])(
         PT.gptq_block(*_layer(), bits=3)), "round-to-nearest"),
    ("12 AWQ alpha", lambda a: PT.check_awq_alpha(a, *_layer(), bits=3, group_size=16),
     lambda: _alpha_search(*_layer(), wb.quant.formats.IntFormat(3, 16), _layer()[1].abs().mean(0),
                           on_weights=True), "*weights*"),
    ("12 SmoothQuant migration", lambda a: PT.check_smoothing(a, _layer()[1], _layer()[0], 0.5),
     lambda: (lambda X, W, s: (X * s, W / s))(_layer()[1], _layer()[0],
                                              _layer()[1].abs().amax(0) ** 0.5 / _layer()[0].abs().amax(0) ** 0.5),
     "other way"),
    ("12 best method", lambda a: PT.check_best_method(a, _methods(), bits=3), lambda: "gptq", "another method"),
    ("13 STE fake-quant", lambda a: Q.check_ste_fake_quantize(a, X13_LEAF, S13, 1, bits=3),
     lambda: ((torch.round(X13_LEAF / S13) + 1).clamp(-4, 3) - 1) * S13, "derivative is 0"),
    ("13 LSQ step gradient", lambda a: Q.check_lsq_step_gradient(a, X13, S13, 1, 3, UPSTREAM13),
     lambda: Q.lsq_step_gradient(X13, S13, 1, 3, UPSTREAM13) * math.sqrt(X13.numel() * 3), "before LSQ's scaling"),
    ("13 code usage", lambda a: Q.check_code_usage(a, _weight((16, 8, 3, 3)), bits=2),
     lambda: (lambda r: [int(((r / (r.abs().max() / 1.5)).round().clamp(-2, 1) == c).sum()) for c in range(-2, 2)])(
         _weight((16, 8, 3, 3)).reshape(16, -1)), "whole tensor"),
    ("20 global mask", lambda a: PN.check_global_mask(a, _global_weights(), 0.7, "a"),
     lambda: wb.pruning.masks.magnitude_mask(_global_weights()["a"], 0.7), "all the layers"),
    ("20 2:4 mask", lambda a: PN.check_nm_mask(a, torch.randn(8, 16, 3, 3, generator=_g()), n=2, m=4),
     lambda: _flattened_nm(torch.randn(8, 16, 3, 3, generator=_g())), "mixes kernel positions"),
    ("20 structured pair", lambda a: PN.check_structured_pair(a, _digits_cnn(), "conv1", "conv2", amount=0.25),
     lambda: (lambda w1, w2: (lambda kept: (w1[kept], w2))(
         w1.abs().sum((1, 2, 3)).topk(24).indices.sort().values))(
         _digits_cnn().conv1.weight.detach(), _digits_cnn().conv2.weight.detach()), "*input* dimension"),
    ("30 KD loss", lambda a: D.check_kd_loss(a, *_kd_batch(), alpha=0.9, temperature=4.0),
     lambda: (lambda s, t, y: float(0.1 * torch.nn.functional.cross_entropy(s, y) + 0.9 * torch.nn.functional.kl_div(
         torch.log_softmax(s / 4, -1), torch.log_softmax(t / 4, -1), reduction="batchmean", log_target=True)))(
         *_kd_batch()), "multiplied by T²"),
    ("30 entropies", lambda a: D.check_entropies(a, LOGITS, [1, 2, 4, 8]),
     lambda: [float(-(p * p.log()).sum()) for p in (torch.softmax(LOGITS / t, -1) for t in (1, 2, 4, 8))], "nats"),
    ("30 restoring factor", lambda a: D.check_restoring_factor(a, _gradients(), 4), lambda: 16.0, "limit"),
    ("40 bf16 rounding", lambda a: PR.check_bf16_round(a, BF16_X),
     lambda: (BF16_X.view(torch.int32) & -65536).view(torch.float32), "truncates"),
    ("40 underflow fractions", lambda a: PR.check_underflow_fractions(a, GRADS40, [1.0, 2.0 ** 8]),
     lambda: [float((GRADS40[GRADS40 != 0] * s < 2.0 ** -14).float().mean()) for s in (1.0, 2.0 ** 8)],
     "subnormals as lost"),
    ("40 GradScaler", lambda a: PR.check_grad_scaler(a, PEAKS40, 2.0 ** 20, 3),
     lambda: _scaler_variant(PEAKS40, 2.0 ** 20, 3, reset_on_skip=False), "*in a row*"),
    ("50 int4 pack", lambda a: K.check_int4_pack(a, CODES), lambda: (CODES[:, 0::2] << 4) | CODES[:, 1::2],
     "swapped"),
    ("50 int4 linear", lambda a: K.check_int4_linear(a, X50, _int4_stored(), 32),
     lambda: (lambda q: X50 @ (torch.stack([q & 15, q >> 4], -1).flatten(1).float() - 8).T)(  # the scales left out
         _int4_stored()["qweight"]), "group's scale"),
    ("50 bound", lambda a: K.check_bound(a, M=512, K=384, N=1536, weight_bytes_per_value=4, bandwidth_GBs=20,
                                         peak_GFLOPs=100), lambda: "memory", "ridge point"),
]


@pytest.mark.parametrize("name, check, wrong, words", CASES, ids=[c[0] for c in CASES])
def test_worked_solution_passes_and_a_wrong_implementation_gets_its_hint(name, check, wrong, words):
    assert check(...).status == "not attempted"                      # the learner's cell as committed
    teach.use_solutions(True)
    worked = check(...)
    assert worked.passed and worked.from_solution, str(worked)       # the lesson module's worked solution
    assert worked.solution and "answer" in worked.solution           # offered behind "Show solution"
    teach.use_solutions(False)
    fb = check(wrong())
    assert fb.status == "failed" and words in fb.hint, str(fb)
    assert "expected" in fb.message                                  # says what it expected and what it found
    assert "Show solution" in fb._repr_html_()


def test_feedback_banner_sets_code_spans_as_code():
    fb = teach.check("scale", 1.0, 2.0, hint="use `x.abs().max()` <not HTML>")
    html = fb._repr_html_()
    assert "<code>x.abs().max()</code>" in html and "`" not in html and "&lt;not HTML&gt;" in html
    unattempted = teach.check("scale", ..., 2.0)._repr_html_()         # "replace the `...`" in the message
    assert "<code>...</code>" in unattempted and "`" not in unattempted
    assert "`" in teach.check("odd", 1.0, 2.0, hint="an unpaired ` stays")._repr_html_()
