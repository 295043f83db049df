"""Sequential calibration (`workbench.plans.sequential`): block by block on the compressed blocks' outputs.

The reference below is written independently of the pipeline: for each block, the *whole* reference model
(blocks before it already quantized) is run with hooks recording that block's layer inputs, and GPTQ is
called directly on each layer's weight."""
import warnings

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.plans.sequential import find_blocks
from workbench.quantization import formats as fm
from workbench.quantization.gptq import gptq_quantize

transformers = pytest.importorskip("transformers")


def tiny_llama(layers: int = 3, seed: int = 0):   # 3 blocks: the last is two compressed blocks away
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def batches(n=4, vocab=128, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (2, seq), generator=g),) for _ in range(n)]


GPTQ = wb.quant.WeightOnly(bits=4, group_size=32, method="gptq")
PLAN = {"lm_head": None, "model.embed_tokens": None, "*": GPTQ}


def reference_sequential_gptq(model, data):
    """Block-by-block GPTQ written by hand: fake-quantized weights, whole-model forwards to record inputs."""
    ref = __import__("copy").deepcopy(model)
    fmt = GPTQ.format()
    for block in ref.model.layers:
        linears = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
        seen = {n: [] for n in linears}
        hooks = [m.register_forward_pre_hook(lambda mod, args, _n=n: seen[_n].append((args[0].detach(),)))
                 for n, m in linears.items()]
        with torch.inference_mode():
            for (ids,) in data:
                ref(ids)
        for h in hooks:
            h.remove()
        for n, m in linears.items():   # every layer of the block from the same recorded inputs, then swapped
            t = gptq_quantize(m.weight.detach(), seen[n], fmt, damp=GPTQ.damp, name=n)
            m.weight.data = fm.decode(t, fmt, m.in_features).to(m.weight.dtype)
    return ref


def test_sequential_gptq_equals_block_by_block_reference():
    model, data = tiny_llama(), batches(3)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    seq = wb.apply(model, PLAN, calibration=data, progress=False)
    orig = wb.apply(model, PLAN, calibration=data, progress=False, pipeline="original")
    ref = reference_sequential_gptq(model, data)
    for name, m in ref.named_modules():
        if isinstance(m, nn.Linear) and name.startswith("model.layers."):
            got = seq.get_submodule(name).effective_weight()
            torch.testing.assert_close(got, m.weight, rtol=0, atol=1e-6, msg=f"{name} differs from the reference")
    # the first block sees the same inputs both ways; later blocks differ (they see quantized blocks' outputs)
    last = "model.layers.2.mlp.down_proj"
    assert not torch.allclose(orig.get_submodule(last).effective_weight(), ref.get_submodule(last).weight)
    torch.testing.assert_close(orig.get_submodule("model.layers.0.mlp.up_proj").effective_weight(),
                               ref.get_submodule("model.layers.0.mlp.up_proj").weight, rtol=0, atol=1e-6)
    with torch.inference_mode():
        torch.testing.assert_close(seq(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)
    report = wb.applied_report(seq)
    assert set(report[report.status == "compressed"].calibration) == {"sequential"}
    assert set(wb.applied_report(orig)[lambda r: r.status == "compressed"].calibration) == {"original"}
    assert all(isinstance(p, nn.Parameter) for p in model.parameters()) and type(model.model.layers[0].mlp.up_proj) \
        is nn.Linear   # the input model was not touched


def test_blocks_found_in_hf_encoders_and_decoders():
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                          num_attention_heads=2, intermediate_size=64))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2))
    llama = tiny_llama(2)
    for model, container in [(bert, "encoder.layer"), (gpt2, "transformer.h"), (llama, "model.layers")]:
        layers = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, transformers.Conv1D))]
        found = find_blocks(model, layers)
        assert found is not None and found.container == container, type(model).__name__
        assert len(found.names) == 2


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_sequential_on_hf_models_with_masks_runs_every_block(arch):
    """Attention masks and other keyword arguments reach every block (dict batches, HF style)."""
    torch.manual_seed(0)
    if arch == "bert":
        model = transformers.BertModel(transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                               num_attention_heads=2, intermediate_size=64)).eval()
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2,
                                                                     n_head=2)).eval()
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0   # padding: a mask the blocks must receive
    data = [{"input_ids": torch.randint(0, 100, (2, 12)), "attention_mask": mask} for _ in range(3)]
    plan = {"*": wb.quant.Static()} if arch == "bert" else {"lm_head": None, "*": wb.quant.Static()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seq = wb.apply(model, plan, calibration=data, progress=False)
        orig = wb.apply(model, plan, calibration=data, progress=False, pipeline="original")
    first = next(n for n, m in model.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
    # block 0 is calibrated on the same inputs both ways: the same activation scale
    assert torch.equal(seq.get_submodule(first).act_scale, orig.get_submodule(first).act_scale)
    with torch.inference_mode():
        a, b = seq(**data[0])[0], orig(**data[0])[0]
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_model_without_blocks_falls_back_with_a_warning():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    data = [torch.randn(8, 16) for _ in range(2)]
    with pytest.warns(UserWarning, match="no block list"):
        small = wb.apply(model, {"*": wb.quant.WeightOnly(bits=4, group_size=16, method="gptq")}, calibration=data,
                         progress=False)
    report = wb.applied_report(small)
    assert set(report.calibration) == {"original"} and report.note.str.contains("no block list").all()


class Branches(nn.Module):
    """A ModuleList of parallel branches: not a chain of blocks."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3))

    def forward(self, x):
        return sum(b(x) for b in self.branches)


def test_a_list_of_parallel_branches_is_not_taken_for_blocks():
    with pytest.warns(UserWarning, match="does not take the output"):
        small = wb.apply(Branches().eval(), {"*": wb.quant.WeightOnly(bits=4, group_size=16, method="gptq")},
                         calibration=[torch.randn(8, 16) for _ in range(2)], progress=False)
    assert set(wb.applied_report(small).calibration) == {"original"}


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, scale=1.0):
        return torch.relu(self.fc(x)) * scale


class ScaledStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(Stage() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for i, stage in enumerate(self.stages):
            x = stage(x, scale=float(i + 1))
        return self.head(x)


def test_blocks_taking_their_own_arguments_are_calibrated_with_them():
    """Blocks whose other arguments differ from block to block (a scale here; alternating sliding-window and full
    attention masks in Gemma-2 / GPT-OSS) replay right with their own: the pipeline keeps each block's arguments
    and stays sequential (before issue 35 every block got the first block's, silently)."""
    model = ScaledStages().eval()
    data = [torch.randn(8, 16) for _ in range(2)]
    plan = {"*": wb.quant.WeightOnly(bits=4, group_size=16, method="gptq")}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        small = wb.apply(model, plan, calibration=data, progress=False)
    report = wb.applied_report(small)
    assert set(report.calibration) == {"sequential"}


def test_sliding_window_blocks_equal_the_block_by_block_reference():
    """Gemma-2 (its layers alternate a sliding-window and a full attention mask): the sequential pipeline with each
    block's own mask gives what block-by-block GPTQ written by hand gives (whole-model forwards)."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=64, sliding_window=4)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    data = batches(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        seq = wb.apply(model, PLAN, calibration=data, progress=False)
    ref = reference_sequential_gptq(model, data)
    for name, m in ref.named_modules():
        if isinstance(m, nn.Linear) and name.startswith("model.layers."):
            torch.testing.assert_close(seq.get_submodule(name).effective_weight(), m.weight, rtol=0, atol=1e-6,
                                       msg=f"{name} differs from the reference")


class StatefulStage(Stage):
    outside = 1.0   # set by the parent before each call

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.outside


class Stateful(nn.Module):
    """Blocks reading state their parent sets before calling them (not an argument): no replay can be right."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(StatefulStage() for _ in range(3))

    def forward(self, x):
        for i, stage in enumerate(self.stages):
            StatefulStage.outside = float(i + 1)
            x = stage(x)
        return x


def test_blocks_that_cannot_run_alone_fall_back_to_the_original_pipeline():
    """Issue 35: the pipeline replays each block alone on the first batch; a block that gives another output alone
    (it reads state outside its arguments) is caught before anything is compressed (no crash inside the model, no
    silently mis-calibrated block): the model is calibrated from the original activations, said in the warning and
    the report - the same result as asking for pipeline='original'."""
    model = Stateful().eval()
    data = [torch.randn(8, 16) for _ in range(2)]
    plan = {"*": wb.quant.WeightOnly(bits=4, group_size=16, method="gptq")}
    with pytest.warns(UserWarning, match=r"'stages.0' run alone with the arguments 'stages.0' received"):
        small = wb.apply(model, plan, calibration=data, progress=False)
    report = wb.applied_report(small)
    assert set(report.calibration) == {"original"} and report.note.str.contains("run alone").all()
    reference = wb.apply(model, plan, calibration=data, progress=False, pipeline="original")
    x = torch.randn(5, 16)
    assert torch.equal(small(x), reference(x))


def fail_at(monkeypatch, layer: str) -> None:
    """GPTQ fails on ``layer`` (as a non-positive-definite Hessian would)."""
    import workbench.quantization.gptq as gptq

    real = gptq.gptq_quantize

    def failing(w, inputs, *a, **k):
        if k.get("name") == layer:
            raise ValueError(f"the Hessian of {layer!r} is not positive definite (injected)")
        return real(w, inputs, *a, **k)
    monkeypatch.setattr(gptq, "gptq_quantize", failing)


def test_failure_mid_pipeline_leaves_an_inplace_model_untouched(monkeypatch):
    model, data = tiny_llama(2), batches(2)
    before = {n: type(m) for n, m in model.named_modules()}
    weights = {n: p.clone() for n, p in model.named_parameters()}
    fail_at(monkeypatch, "model.layers.0.mlp.down_proj")   # block 0's attention is done, its down_proj fails
    with pytest.raises(Exception, match="down_proj"):
        wb.apply(model, PLAN, calibration=data, inplace=True, progress=False)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_unknown_pipeline_is_refused():
    with pytest.raises(ValueError, match="pipeline must be one of"):
        wb.apply(nn.Linear(4, 4), {"*": wb.quant.WeightOnly(bits=8)}, pipeline="parallel")


def test_gptq_is_fed_a_hessian_built_batch_by_batch_not_the_inputs(monkeypatch):
    import workbench.quantization.gptq as gptq

    seen, real = [], gptq.gptq_quantize
    monkeypatch.setattr(gptq, "gptq_quantize",
                        lambda w, inputs, *a, **k: seen.append(inputs) or real(w, inputs, *a, **k))
    model = tiny_llama(2)
    wb.apply(model, PLAN, calibration=batches(2), progress=False)
    assert len(seen) == 14 and all(isinstance(s, gptq.HessianAccumulator) and s.n == 2 * 2 * 16 for s in seen)


def test_layers_reading_one_input_share_one_hessian(monkeypatch):
    import workbench.quantization.gptq as gptq

    seen, real = {}, gptq.gptq_quantize
    monkeypatch.setattr(gptq, "gptq_quantize",
                        lambda w, inputs, *a, **k: seen.setdefault(k["name"], inputs) and real(w, inputs, *a, **k))
    model = tiny_llama(2)
    wb.apply(model, PLAN, calibration=batches(2), progress=False)
    for b in range(2):
        p = f"model.layers.{b}."
        acc = {n.removeprefix(p): s for n, s in seen.items() if n.startswith(p)}
        assert acc["self_attn.q_proj"] is acc["self_attn.k_proj"] is acc["self_attn.v_proj"]
        assert acc["mlp.gate_proj"] is acc["mlp.up_proj"]
        assert len({id(s) for s in acc.values()}) == 4   # qkv, o_proj, gate/up, down_proj
        assert acc["self_attn.q_proj"].users == 3 and acc["mlp.up_proj"].users == 2 and acc["mlp.down_proj"].users == 1
        assert all(s.H is None for s in acc.values())   # every Hessian handed over, none kept


def test_inplace_failure_in_a_later_block_restores_the_spilled_layers(monkeypatch, tmp_path):
    import tempfile

    from workbench.plans.spill import Spill

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    freed, stash = [], Spill.stash
    monkeypatch.setattr(Spill, "stash", lambda self, modules: freed.append(stash(self, modules)) or freed[-1])
    model, data = tiny_llama(2), batches(2)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        want = model(x).logits
    before = {n: type(m) for n, m in model.named_modules()}
    weights = {n: p.clone() for n, p in model.named_parameters()}
    fail_at(monkeypatch, "model.layers.1.mlp.down_proj")
    with pytest.raises(Exception, match="layers.1.mlp.down_proj"):
        wb.apply(model, PLAN, calibration=data, inplace=True, progress=False)
    # block 0 was compressed and its fp32 layers moved to disk (7 weight matrices) before block 1 failed
    assert len(freed) == 1 and freed[0] == sum(p.numel() * 4 for n, p in weights.items()
                                               if n.startswith("model.layers.0.") and "norm" not in n)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert all(p.device.type == "cpu" and torch.equal(p, weights[n]) for n, p in model.named_parameters())
    with torch.inference_mode():
        assert torch.equal(model(x).logits, want)
    assert list(tmp_path.iterdir()) == []   # the spill files are gone


def test_inplace_success_leaves_no_spill_files_and_no_meta_tensors(monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = tiny_llama(2)
    out = wb.apply(model, PLAN, calibration=batches(2), inplace=True, progress=False)
    assert out is model and list(tmp_path.iterdir()) == []
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_a_model_in_train_mode_is_still_calibrated_block_by_block():
    """The chain check runs the model as the pipeline does (eval: dropout off), so a model left in train mode with
    dropout is not sent to the original-model pipeline by a replay that dropout made differ."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=32,
                                       resid_pdrop=0.5, attn_pdrop=0.5, embd_pdrop=0.5)).train()
    data = [(torch.randint(0, 96, (2, 12)),)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # (no "cannot be calibrated block by block" warning)
        small = wb.apply(model, {"transformer.h.*": wb.quant.WeightOnly(bits=4, group_size=16, method="gptq")},
                         calibration=data, progress=False)
    report = wb.applied_report(small)
    assert set(report[report.status == "compressed"].calibration) == {"sequential"} and model.training


def test_a_hessian_is_shared_past_an_earlier_reader_that_keeps_other_statistics():
    """q reads x into Wanda's norms, k and v into GPTQ Hessians: k's Hessian also serves v (x added once), and later
    batches must show the same sharing."""
    from workbench.plans.apply import _Feed
    from workbench.pruning.oneshot import NormAccumulator
    from workbench.quantization.gptq import HessianAccumulator

    stats = {"q": NormAccumulator(8, "q"), "k": HessianAccumulator(8, "k"), "v": HessianAccumulator(8, "v")}
    feed = _Feed(stats)
    for batch in range(2):
        x = torch.randn(3, 8)
        for name in ("q", "k", "v"):
            feed(name, (x,))
        feed.next_batch()
    assert stats["v"] is stats["k"] and stats["k"].users == 2 and stats["k"].n == 6 and stats["q"].n == 2
