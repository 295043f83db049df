"""Weights and activations at low bits (``wb.quant.WeightOnly(act_bits=...)``: W4A8, W4A4): the per-token rounding
worked by hand, every matmul path computing on the rounded input, what is refused (the cpu-int8 kernel's own
rounding, layers without an input to round, exports), and reload."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.quantization.modules import round_per_token
from workbench.quantization.primitives import quantize_per_token


def test_rounding_per_token_by_hand_and_as_the_int8_path_at_8_bits():
    x = torch.tensor([[0.5, 1.5, 2.5, -7.5, 7.0, 0.0, 3.49, -0.5],     # max|x| 7.5: step 1 at 4 bits
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert round_per_token(x, 4).tolist() == [[0.0, 2.0, 2.0, -8.0 * 7.5 / 7.5, 7.0, 0.0, 3.0, -0.0], [0.0] * 8]
    y = torch.randn(5, 33)
    q, s = quantize_per_token(y)
    assert torch.equal(round_per_token(y, 8), q.float() * s)
    assert torch.isnan(round_per_token(torch.tensor([[1.0, float("inf")]]), 4)).all()
    assert round_per_token(y.half(), 4).dtype == torch.float16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc1, self.fc2 = nn.Embedding(20, 64), nn.Linear(64, 96), nn.Linear(96, 8)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.emb(ids))))


IDS = torch.randint(0, 20, (3, 7), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("kernel", ["reference", "cpu"])
@pytest.mark.parametrize("act_bits", [8, 4])
def test_the_layer_multiplies_the_rounded_input(kernel, act_bits):
    model = Net().eval()
    cfg = wb.quant.WeightOnly(bits=4, group_size=32, act_bits=act_bits, kernel=kernel)
    small = wb.apply(model, {"fc*": cfg}, progress=False)
    layer = small.fc1
    assert layer.act_bits == act_bits and layer.rounds_activations and f"act_bits={act_bits}" in repr(layer)
    x = torch.randn(4, 64)
    with torch.inference_mode():
        want = F.linear(round_per_token(x, act_bits), layer.effective_weight(), layer.bias)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        weight_only = wb.apply(model, {"fc*": wb.quant.WeightOnly(bits=4, group_size=32, kernel=kernel)},
                               progress=False)
        assert not torch.allclose(weight_only.fc1(x), layer(x), atol=1e-4)   # the rounding really happens


def test_what_act_bits_cannot_do_is_refused_naming_the_field_or_the_layer(tmp_path):
    with pytest.raises(ValueError, match="act_bits"):
        wb.quant.WeightOnly(act_bits=1)
    with pytest.raises(ValueError, match="cpu-int8"):
        wb.quant.WeightOnly(bits=4, group_size=32, act_bits=8, kernel="cpu-int8")
    with pytest.raises(ValueError, match=r"'fc1': QAT of WeightOnly .* act_bits=4"):
        wb.qat.prepare(Net(), {"fc1": wb.quant.WeightOnly(bits=4, group_size=32, act_bits=4)})
    model = Net().eval()
    with pytest.warns(UserWarning, match=r"emb \(Embedding.*act_bits=4 rounds the input of nn\.Linear layers"):
        small = wb.apply(model, {"*": wb.quant.WeightOnly(bits=4, group_size=32, act_bits=4)}, progress=False)
    assert type(small.emb) is nn.Embedding
    import transformers as tf

    torch.manual_seed(0)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4)).eval()
    small = wb.apply(llama, {"model.layers.*": wb.quant.WeightOnly(bits=4, group_size=32, act_bits=4)},
                     progress=False)
    for fmt in ("compressed-tensors", "gguf"):
        with pytest.raises(ValueError, match=r"model\.layers\.0\..*rounds its input to 4 bits per token \(W4A4\)"):
            wb.export(small, tmp_path / fmt, format=fmt)
        assert not (tmp_path / fmt).exists()


def test_saved_and_reloaded_with_the_same_rounding(tmp_path):
    model = Net().eval()
    plan = wb.Plan({"fc*": wb.quant.WeightOnly(bits=4, group_size=None, act_bits=4, method="gptq")})
    assert wb.Plan.from_json(plan.to_json()) == plan
    cal = [(torch.randint(0, 20, (4, 7), generator=torch.Generator().manual_seed(i)),) for i in range(4)]
    small = wb.apply(model, plan, calibration=cal, progress=False)
    with torch.inference_mode():
        y = small(IDS)
    wb.save(small, tmp_path / "s.safetensors")
    again = wb.load(tmp_path / "s.safetensors", base=model)
    assert again.fc2.act_bits == 4
    with torch.inference_mode():
        assert torch.equal(again(IDS), y)
