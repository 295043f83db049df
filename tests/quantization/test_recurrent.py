"""Dynamic W8A8 LSTM / GRU: close to fp32 and to torch.ao's quantize_dynamic, every nn.LSTM option that matters,
the CPU kernel bit-identical to the reference path, really smaller, skeleton + load_state_dict round trip."""
import io
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.quantization.recurrent import DynamicQuantGRU, DynamicQuantLSTM

PAIRS = [(nn.LSTM, DynamicQuantLSTM), (nn.GRU, DynamicQuantGRU)]


def _cos(a, b):
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _float(F_cls, **kw):
    torch.manual_seed(0)
    return F_cls(**kw).eval()


def _state(F_cls, m, B, batched=True):
    shape = (m.num_layers * (2 if m.bidirectional else 1), B, m.hidden_size) if batched else \
        (m.num_layers * (2 if m.bidirectional else 1), m.hidden_size)
    h = torch.randn(shape) * 0.5
    return (h, torch.randn(shape) * 0.5) if F_cls is nn.LSTM else h


@pytest.mark.parametrize("F_cls,Q_cls", PAIRS)
@pytest.mark.parametrize("layers,bidir,batch_first,bias", list(itertools.product((1, 2), (False, True), (False, True),
                                                                                  (True, False))))
def test_close_to_fp32_every_option(F_cls, Q_cls, layers, bidir, batch_first, bias):
    m = _float(F_cls, input_size=12, hidden_size=16, num_layers=layers, bidirectional=bidir,
               batch_first=batch_first, bias=bias, dropout=0.3 if layers > 1 else 0.0)
    q = Q_cls.from_float(m, kernel="reference")
    x = torch.randn(3, 9, 12) * 2 if batch_first else torch.randn(9, 3, 12) * 2
    hx = _state(F_cls, m, 3)
    with torch.inference_mode():
        for args in ((x,), (x, hx)):
            (y, s), (yq, sq) = m(*args), q(*args)
            assert yq.shape == y.shape and _cos(yq, y) > 0.995
            for a, b in zip(s if isinstance(s, tuple) else (s,), sq if isinstance(sq, tuple) else (sq,)):
                assert b.shape == a.shape and _cos(b, a) > 0.995


@pytest.mark.parametrize("F_cls,Q_cls", PAIRS)
def test_unbatched_input(F_cls, Q_cls):
    m = _float(F_cls, input_size=6, hidden_size=8, num_layers=2, bidirectional=True)
    q = Q_cls.from_float(m, kernel="reference")
    x, hx = torch.randn(5, 6), _state(F_cls, m, 1, batched=False)
    with torch.inference_mode():
        (y, s), (yq, sq) = m(x, hx), q(x, hx)
    assert yq.shape == y.shape == (5, 16) and _cos(yq, y) > 0.995
    h, hq = (s[0], sq[0]) if isinstance(sq, tuple) else (s, sq)
    assert hq.shape == h.shape == (4, 8) and _cos(hq, h) > 0.99


@pytest.mark.parametrize("F_cls,Q_cls", PAIRS)
def test_cpu_kernel_bit_identical_to_reference(F_cls, Q_cls):
    m = _float(F_cls, input_size=20, hidden_size=24, num_layers=2, bidirectional=True)
    x = torch.randn(7, 5, 20)
    with torch.inference_mode():
        ref = Q_cls.from_float(m, kernel="reference")(x)
        cpu = Q_cls.from_float(m, kernel="cpu")
        assert cpu.kernel == "cpu" and cpu.ih_l0.kernel == "cpu"
        out = cpu(x)
    assert torch.equal(out[0], ref[0])


@pytest.mark.parametrize("F_cls,Q_cls", PAIRS)
def test_matches_fp32_and_torch_quantize_dynamic_at_realistic_scale(F_cls, Q_cls):
    """Hidden 128, 2 layers, inputs of unit scale: cosine > 0.99 against fp32, and at least as close to fp32
    as torch.ao's quantize_dynamic (per-tensor activations; ours are per token)."""
    m = _float(F_cls, input_size=64, hidden_size=128, num_layers=2)
    x = torch.randn(32, 4, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                           # torch.ao.quantization is deprecated
        ao = torch.ao.quantization.quantize_dynamic(nn.Sequential(m), {F_cls}, dtype=torch.qint8)
    q = Q_cls.from_float(m, kernel="reference")
    with torch.inference_mode():
        y, ya, yq = m(x)[0], ao(x)[0], q(x)[0]
    assert _cos(yq, y) > 0.999 and _cos(yq, ya) > 0.995
    assert (yq - y).abs().max() <= (ya - y).abs().max() * 1.5


@pytest.mark.parametrize("F_cls,Q_cls", PAIRS)
def test_smaller_and_skeleton_round_trip(F_cls, Q_cls):
    m = _float(F_cls, input_size=32, hidden_size=48, num_layers=2, bidirectional=True, batch_first=True)
    q = Q_cls.from_float(m, kernel="reference")

    def nbytes(mod):
        return sum(t.numel() * t.element_size() for t in mod.state_dict().values())
    assert nbytes(q) < 0.3 * nbytes(m)
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    sk = Q_cls.skeleton(32, 48, num_layers=2, batch_first=True, bidirectional=True, kernel="reference")
    sk.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert list(sk.state_dict()) == list(q.state_dict())
    x = torch.randn(2, 6, 32)
    with torch.inference_mode():
        assert torch.equal(sk(x)[0], q(x)[0])
    assert sorted(n for n, _ in q.named_children()) == sorted(
        f"{p}_l{k}{s}" for p in ("ih", "hh") for k in (0, 1) for s in ("", "_reverse"))


def test_refusals_name_the_layer_and_reason():
    with pytest.raises(ValueError, match="'enc.rnn' has proj_size=4"):
        DynamicQuantLSTM.from_float(nn.LSTM(8, 8, proj_size=4), name="enc.rnn")
    with pytest.raises(TypeError, match="'g' is a GRU, not an LSTM"):
        DynamicQuantLSTM.from_float(nn.GRU(8, 8), name="g")
    q = DynamicQuantLSTM.from_float(nn.LSTM(4, 6), kernel="reference")
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 4), [5, 3])
    with pytest.raises(TypeError, match="PackedSequence"):
        q(packed)
    with pytest.raises(ValueError, match="4 features"):
        q(torch.randn(5, 2, 3))
    with pytest.raises(ValueError, match="initial states"):
        q(torch.randn(5, 2, 4), (torch.zeros(1, 3, 6), torch.zeros(1, 3, 6)))


def test_dropout_only_in_training():
    m = _float(nn.LSTM, input_size=8, hidden_size=8, num_layers=2, dropout=0.5)
    q = DynamicQuantLSTM.from_float(m, kernel="reference")
    x = torch.randn(6, 2, 8)
    with torch.no_grad():
        ev = q(x)[0]
        q.train()
        tr = q(x)[0]
    assert not torch.equal(ev, tr) and _cos(ev, m(x)[0]) > 0.99


def test_dynamic_plan_takes_lstm_and_gru_and_reloads(tmp_path):
    import workbench as wb

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(16, 32, 2, batch_first=True)
            self.gru = nn.GRU(32, 8)
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            h, _ = self.rnn(x)
            h, _ = self.gru(h)
            return self.fc(h)

    model = Net().eval()
    x = torch.randn(4, 7, 16)
    q = wb.apply(model, {"*": wb.quant.Dynamic()}, progress=False)
    assert isinstance(q.rnn, DynamicQuantLSTM) and isinstance(q.gru, DynamicQuantGRU)
    assert wb.size_bytes(q) < 0.35 * wb.size_bytes(model)
    with torch.inference_mode():
        a, b = model(x), q(x)
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999
    wb.save(q, tmp_path / "q.safetensors")
    again = wb.load(tmp_path / "q.safetensors", base=model)
    with torch.inference_mode():
        assert torch.equal(again(x), b)
    with pytest.raises(wb.ApplyError, match="'rnn'.*no Triton kernel"):
        wb.apply(model, {"rnn": wb.quant.Dynamic(kernel="triton")}, progress=False)
