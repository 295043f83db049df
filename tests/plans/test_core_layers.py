"""The core's per-layer steps on models the workbench did not build: tied weights (GPT-2's lm_head / wte),
modules registered under two names (T5's shared embedding), passed-over layers reported, the Session's
concrete configs, and prefix replay on nn.TransformerEncoder."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.plans import Plan, compressible_layers, tie_groups
from workbench.precision import Cast


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(cfg).eval()


class TiedLM(nn.Module):
    """An embedding and an output layer that share one weight (as in GPT-2, Llama with tied embeddings)."""

    def __init__(self, vocab=50, dim=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.body(self.emb(idx))))


def test_tie_groups_finds_gpt2_lm_head():
    assert ("transformer.wte", "lm_head") in tie_groups(tiny_gpt2())


@pytest.mark.parametrize("config", [wb.quant.WeightOnly(bits=8, group_size=None), Cast(torch.bfloat16)])
def test_tied_layers_compressed_into_one_copy(tmp_path, config):
    model = TiedLM().eval()
    idx = torch.randint(0, 50, (3, 7))
    small = wb.apply(model, {"*": config})
    assert isinstance(small.head, type(small.emb)) or small.head is not model.head
    # one stored copy: the compressed model is smaller than the original, never larger
    assert wb.size_bytes(small) < wb.size_bytes(model)
    shared = {id(t) for t in small.emb.state_dict(keep_vars=True).values()}
    assert any(id(t) in shared for t in small.head.state_dict(keep_vars=True).values())
    with torch.inference_mode():
        ref, out = model(idx), small(idx)
    assert torch.nn.functional.cosine_similarity(ref.flatten(), out.float().flatten(), dim=0) > 0.99
    wb.save(small, tmp_path / "m.safetensors")
    again = wb.load(tmp_path / "m.safetensors", base=model)
    with torch.inference_mode():
        assert torch.equal(again(idx), out)
    assert wb.size_bytes(again) == wb.size_bytes(small)


def test_tied_layer_passed_over_by_a_glob_and_refused_by_name():
    model = TiedLM().eval()
    # Dynamic W8A8 takes Linear only: the head alone would store the shared weight a second time
    with pytest.warns(UserWarning, match="tied to 'emb'"):
        small = wb.apply(model, {"*": wb.quant.Dynamic()})
    assert isinstance(small.body, wb.quant.W8A8Linear) and type(small.head) is nn.Linear
    report = wb.applied_report(small)
    row = report.set_index("layer").loc["head"]
    assert row.status == "passed over" and "tied to 'emb'" in row.note
    assert wb.size_bytes(small) <= wb.size_bytes(model)
    with pytest.raises(ValueError, match=r"layer 'head'.*tied to 'emb'.*'emb', 'head'"):
        wb.apply(model, {"head": wb.quant.Dynamic()})


def test_gpt2_lm_head_stays_tied():
    model = tiny_gpt2()
    small = wb.apply(model, {"lm_head": wb.quant.WeightOnly(bits=8, group_size=None),
                             "transformer.wte": wb.quant.WeightOnly(bits=8, group_size=None)})
    assert wb.size_bytes(small) < wb.size_bytes(model)
    assert small.lm_head.qweight is small.transformer.wte.qweight
    idx = torch.randint(0, 96, (2, 9))
    with torch.inference_mode():
        a, b = model(idx).logits, small(idx).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_module_under_two_names_is_swapped_under_both():
    emb = nn.Embedding(20, 8)
    model = nn.ModuleDict({"shared": emb, "enc": nn.ModuleDict({"tok": emb}), "out": nn.Linear(8, 4)})
    small = wb.apply(model, {"shared": wb.quant.WeightOnly(bits=8, group_size=None)})
    assert small["enc"]["tok"] is small["shared"]
    assert isinstance(small["shared"], wb.quant.WeightOnlyEmbedding)


def test_describe_and_report_list_passed_over_layers():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.RNN(8, 8), nn.Linear(8, 2))
    plan = Plan({"3": None, "*": wb.quant.Dynamic()})
    df = plan.describe(model).set_index("layer")
    assert df.loc["0", "status"] == "compressed"
    assert df.loc["0", "config"] == "Dynamic · 8 bits"          # in words, as the workbench shows it, not a repr
    assert df.loc["3", "status"] == "kept" and df.loc["3", "config"] == "none"
    assert df.loc["1", "status"] == "passed over" and "Dynamic does not handle LayerNorm" in df.loc["1", "reason"]
    assert df.loc["2", "status"] == "passed over"


def test_compressible_layers_follow_what_techniques_take():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Conv2d(3, 4, 3), nn.Embedding(5, 4))
    assert compressible_layers(model) == ["0", "2", "3"]


def test_session_records_the_concrete_svd_rank(tmp_path, digits_mlp, digits_task):
    from workbench.ui.session import Session

    s = Session(digits_mlp, digits_task, calibration=8)
    s.set("*", wb.lowrank.SVD(energy=0.9))
    s.apply_and_measure()
    recorded = wb.applied_plans(s.work)[0]
    assert all(c.rank is not None for c in recorded.values())
    wb.save(s.work, tmp_path / "svd.safetensors")
    again = wb.load(tmp_path / "svd.safetensors", base=digits_mlp)
    x = digits_task.example_inputs(4)[0]
    with torch.inference_mode():
        assert torch.equal(again(x), s.work(x))


def test_sensitivity_with_replay_on_transformer_encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    enc = nn.Sequential()
    enc.add_module("encoder", nn.TransformerEncoder(layer, 3, enable_nested_tensor=False))
    enc.add_module("head", nn.Linear(16, 1))
    enc.eval()
    x = torch.randn(8, 5, 16)
    with torch.no_grad():
        y = enc(x).detach()
    task = _MSETask(x, y)
    df = wb.sensitivity(enc, task, {"bf16": Cast(torch.bfloat16)}, layers="encoder.layers.*.linear2", cache=False,
                        progress=False)
    assert (df["status"] == "ok").all() and len(df) == 3


class _MSETask(wb.tasks.Task):
    """Mean squared error against fixed reference outputs (lower is better)."""

    name = "mse-to-reference"
    metrics = (wb.tasks.MetricSpec("mse", False, "mean squared error to the fp32 outputs"),)

    def __init__(self, x, y):
        self.x, self.y = x, y

    def evaluate(self, model, quick=False):
        with torch.inference_mode():
            return {"mse": float(((model(self.x) - self.y) ** 2).mean())}

    def calibration(self, n, batch_size=None):
        return [(self.x[:n],)]

    def example_inputs(self, batch_size=None):
        return (self.x,)


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def test_attention_projections_are_layers_a_plan_reaches(tmp_path):
    enc = _encoder()
    x = torch.randn(3, 5, 16)
    plan = Plan({"*": wb.quant.Dynamic()})
    df = plan.describe(enc).set_index("layer")
    assert df.loc["layers.0.self_attn.q_proj", "status"] == "compressed"
    assert type(enc.layers[0].self_attn) is nn.MultiheadAttention   # describing never changes the model
    small = wb.apply(enc, plan, progress=False)
    assert isinstance(small.layers[1].self_attn.v_proj, wb.quant.W8A8Linear)
    with torch.inference_mode():
        a, b = enc(x), small(x)
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999
    wb.save(small, tmp_path / "enc.safetensors")
    again = wb.load(tmp_path / "enc.safetensors", base=enc)
    with torch.inference_mode():
        assert torch.equal(again(x), b)
    # a plan that does not reach the attention leaves it packed (and PyTorch's fused path available)
    only_ffn = wb.apply(enc, {"layers.*.linear1": wb.quant.Dynamic()}, progress=False)
    assert type(only_ffn.layers[0].self_attn) is nn.MultiheadAttention


def test_gpt2_conv1d_layers_are_compressed_and_reload(tmp_path):
    model = tiny_gpt2()
    small = wb.apply(model, {"*": wb.quant.WeightOnly(bits=8, group_size=None)}, progress=False)
    report = wb.applied_report(small)
    assert (report[report["layer"].str.contains(r"\.attn\.c_attn|\.mlp\.c_fc")]["status"] == "compressed").all()
    assert wb.size_bytes(small) < 0.4 * wb.size_bytes(model)
    idx = torch.randint(0, 96, (2, 9))
    with torch.inference_mode():
        a, b = model(idx).logits, small(idx).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
    wb.save(small, tmp_path / "g.safetensors")
    again = wb.load(tmp_path / "g.safetensors", base=model)
    with torch.inference_mode():
        assert torch.equal(again(idx).logits, b)


def test_session_edits_attention_projections_and_reloads(tmp_path):
    from workbench.ui.session import Session

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = _encoder()
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return self.head(self.enc(x).mean(1))

    model = Net().eval()
    x = torch.randn(32, 5, 16)
    with torch.no_grad():
        task = _MSETask(x, model(x))
    s = Session(model, task)
    assert "enc.layers.0.self_attn.q_proj" in s.layer_names
    s.set("enc.layers.0.self_attn.q_proj", wb.quant.Dynamic())
    s.apply_and_measure()
    wb.save(s.work, tmp_path / "s.safetensors")
    again = wb.load(tmp_path / "s.safetensors", base=model)
    with torch.inference_mode():
        assert torch.equal(again(x), s.work(x))
    s.set("enc.layers.0.self_attn.q_proj", None)
    entry = s.apply_and_measure()
    assert type(s.work.enc.layers[0].self_attn) is nn.MultiheadAttention and entry.quality < 1e-10


def test_plan_folds_batchnorm_before_quantizing(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                          nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(288, 4))
    for bn in (model[1], model[4]):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    model.eval()
    x = torch.randn(2, 3, 10, 10)
    plan = Plan({"*": wb.quant.WeightOnly(bits=8, group_size=None)}, fold_batchnorm=True)
    assert Plan.from_json(plan.to_json()) == plan and "stages=[FoldBatchNorm()]" in repr(plan)
    assert plan == Plan({"*": wb.quant.WeightOnly(bits=8, group_size=None)}, stages=[wb.plans.FoldBatchNorm()])
    small = wb.apply(model, plan, progress=False)
    assert isinstance(small[1], nn.Identity) and isinstance(small[0], wb.quant.WeightOnlyConv2d)
    assert isinstance(model[1], nn.BatchNorm2d)                     # the user's model is untouched
    with torch.inference_mode():
        a, b = model(x), small(x)
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999
    wb.save(small, tmp_path / "f.safetensors")
    again = wb.load(tmp_path / "f.safetensors", base=model)
    with torch.inference_mode():
        assert torch.equal(again(x), b)
    with pytest.raises(ValueError, match="inplace=False"):
        wb.apply(model, plan, inplace=True)
