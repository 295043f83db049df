"""Head pruning of the 2026 attention layouts (issue 15's gallery: OPT, DeBERTa-v2, Swin, Phi-3, GPT-NeoX, Falcon in
its three layouts) on tiny random configs: the pruned model equals the original with the removed heads masked (their
output-projection columns zeroed), the shapes and head counts shrink, importance ranks a dead head last, save -> load
rebuilds it bit for bit, and what cannot be pruned is refused naming the block."""
import copy

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.pruning.heads import _blocks
from workbench.pruning.structured import run

T = pytest.importorskip("transformers")
import gallery as G  # noqa: E402  (tests/ is on sys.path through its conftest, as for tests/test_gallery.py)


def _falcon(**kw):
    cfg = T.FalconConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=64, **kw)
    torch.manual_seed(0)
    return T.FalconForCausalLM(cfg).eval(), (torch.randint(0, 96, (2, 9), generator=G._seeded()),), G._logits


BUILDERS = {
    "opt": G.opt, "deberta-v2": G.deberta_v2, "swin": G.swin, "phi3": G.phi3, "gpt-neox": G.gpt_neox,
    "falcon-mqa": G.falcon,
    "falcon-gqa": lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2),
    "falcon-mha": lambda: _falcon(multi_query=False),
}
PER_UNIT = {"phi3": 2, "falcon-gqa": 2}   # query heads per key/value head: whole groups go


def _out_layer(block: nn.Module) -> nn.Module:
    """The block's output projection (input features = query heads x head dim)."""
    for path in ("o_proj", "out_proj", "output.dense", "dense"):
        try:
            return block.get_submodule(path)
        except AttributeError:
            continue
    raise AssertionError(f"no output projection in {type(block).__name__}")


def _mask(model: nn.Module, unit: int, per: int) -> nn.Module:
    """A copy of ``model`` where the query heads of ``unit`` in every block contribute nothing (the output
    projection's input columns of those heads zeroed) - what removing them computes."""
    masked = copy.deepcopy(model)
    with torch.no_grad():
        for name in _blocks(masked):
            out = _out_layer(masked.get_submodule(name))
            heads = out.in_features // _head_dim(masked.get_submodule(name))
            d = out.in_features // heads
            out.weight[:, unit * per * d:(unit + 1) * per * d] = 0
    return masked


def _head_dim(block: nn.Module) -> int:
    for attr in ("head_dim", "head_size"):
        if isinstance(getattr(block, attr, None), int):
            return getattr(block, attr)
    return block.self.attention_head_size


def _out(model, inputs, read):
    with torch.inference_mode():
        return read(model(*inputs)).detach().clone()


@pytest.mark.parametrize("arch", BUILDERS)
def test_pruned_equals_masked_reference_and_round_trips(arch, tmp_path):
    model, inputs, read = BUILDERS[arch]()
    per = PER_UNIT.get(arch, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = list(_blocks(model))
    importance = {}
    for n in names:   # unit 1 is the least important everywhere
        units = _out_layer(model.get_submodule(n)).in_features // _head_dim(model.get_submodule(n)) // per
        importance[n] = torch.ones(units)
        importance[n][1] = 0
    fewer = wb.prune.attention_heads(model, per, [inputs], importance=importance)
    out = _out(fewer, inputs, read)
    torch.testing.assert_close(out, _out(_mask(model, 1, per), inputs, read), rtol=1e-4, atol=1e-5)
    assert not torch.equal(out, _out(model, inputs, read))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())   # the original is untouched
    assert wb.size_bytes(fewer) < wb.size_bytes(model)
    plan = wb.applied_plans(fewer)[-1]
    assert set(plan) == set(names)
    again = wb.load(wb.save(fewer, tmp_path / "heads.safetensors"), base=model)
    assert torch.equal(_out(again, inputs, read), out)


def test_pruned_shapes_and_bookkeeping():
    model, inputs, _ = G.opt()
    a = wb.prune.attention_heads(model, 1, [inputs]).model.decoder.layers[0].self_attn
    assert (a.num_heads, a.q_proj.out_features, a.v_proj.out_features, a.out_proj.in_features) == (3, 24, 24, 24)

    model, inputs, _ = G.deberta_v2()
    sa = wb.prune.attention_heads(model, 1, [inputs]).encoder.layer[1].attention.self
    assert (sa.num_attention_heads, sa.all_head_size) == (3, 24)
    assert sa.query_proj.out_features == sa.pos_key_proj.out_features == sa.pos_query_proj.out_features == 24

    model, inputs, _ = G.swin()
    small = wb.prune.attention_heads(model, 1, [inputs])
    for stage, heads in ((0, 1), (1, 3)):   # num_heads=[2, 4]
        a = small.swin.encoder.layers[stage].blocks[0].attention
        assert a.num_attention_heads == heads and a.o_proj.in_features == heads * a.head_dim
        assert a.relative_position_bias.relative_position_bias_table.shape == (49, heads)   # (2*4-1)^2 positions

    model, inputs, _ = G.phi3()
    small = wb.prune.attention_heads(model, 2, [inputs])
    a = small.model.layers[0].self_attn
    assert (a.qkv_proj.out_features, a.o_proj.in_features, a.num_key_value_heads) == (16 + 8 + 8, 16, 1)
    # Phi-3's forward reads config.num_attention_heads: the block got its own config, the model's is unchanged
    assert a.config.num_attention_heads == 2 and a.config is not small.config
    assert small.config.num_attention_heads == model.config.num_attention_heads == 4

    model, inputs, _ = G.gpt_neox()
    a = wb.prune.attention_heads(model, 1, [inputs]).gpt_neox.layers[0].attention
    assert (a.query_key_value.out_features, a.dense.in_features) == (3 * 24, 24)

    model, inputs, _ = G.falcon()
    a = wb.prune.attention_heads(model, 1, [inputs]).transformer.h[0].self_attention
    assert (a.num_heads, a.num_kv_heads, a.query_key_value.out_features, a.dense.in_features) == (3, 1, 24 + 16, 24)
    assert type(a.query_key_value).__name__ == type(a.dense).__name__ == "FalconLinear"   # kept its class


@pytest.mark.parametrize("arch", ["opt", "deberta-v2", "phi3", "gpt-neox", "falcon-mqa"])
def test_importance_ranks_a_dead_head_last(arch):
    model, inputs, read = BUILDERS[arch]()
    per = PER_UNIT.get(arch, 1)
    dead = _mask(model, 1, per)
    scores = wb.prune.head_importance(dead, [inputs])
    for name, s in scores.items():
        assert int(s.argmin()) == 1, (name, s)
        assert float(s[1]) < 0.1 * float(s.max()), (name, s)
    # chosen by importance, the dead head is the one removed: nothing changes
    fewer = wb.prune.attention_heads(dead, per, [inputs], importance=scores)
    torch.testing.assert_close(_out(fewer, inputs, read), _out(dead, inputs, read), rtol=1e-4, atol=1e-5)


def test_refusals_name_the_block():
    model, inputs, _ = G.phi3()
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn' has grouped-query attention.*multiple of 2"):
        wb.prune.attention_heads(model, 1, [inputs])
    model, inputs, _ = _falcon(alibi=True)
    with pytest.raises(ValueError, match=r"'transformer.h.0.self_attention' \(FalconAttention\): uses ALiBi"):
        wb.prune.attention_heads(model, 1, [inputs])


class _TimmLikeAttention(nn.Module):
    """timm's layout: one fused ``qkv`` and ``proj`` - no known layout."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):  # (B, T, 16)
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 8).unbind(2)                  # (B, T, 2, 8) each
        y = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(y.transpose(1, 2).reshape(x.shape))


class _TimmLikeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(16), _TimmLikeAttention()

    def forward(self, x):  # (B, T, 16)
        return x + self.attn(self.norm(x))


class _HardCodedHeads(nn.Module):
    """q/k/v/o_proj with ``head_dim`` (so it looks like Llama) but a forward that reads its own ``n_head``."""

    def __init__(self):
        super().__init__()
        self.head_dim, self.n_head = 8, 2
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):  # (B, T, 16)
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))


def test_unknown_layout_and_a_forward_it_breaks_are_refused_naming_the_block():
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    model = _TimmLikeBlock().eval()
    with pytest.raises(ValueError, match=r"no attention block of a known layout.*'attn' \(_TimmLikeAttention, "
                                         r"projections qkv, proj\)"):
        wb.prune.attention_heads(model, 1, [x])
    hard = nn.Sequential(nn.Linear(16, 16), _HardCodedHeads()).eval()
    with pytest.raises(ValueError, match=r"cannot remove heads of '1' \(_HardCodedHeads\).*forward fails"):
        wb.prune.attention_heads(hard, 1, [x])
    assert run(hard, x).shape == (2, 5, 16)   # the original still runs
