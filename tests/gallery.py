"""The architecture gallery: models users bring, built small and deterministic, for `test_gallery.py`.

Each builder returns ``(model, inputs, read)``: a fresh fp32 model in eval mode (weights from a fixed seed),
one input batch as a tuple of tensors (``model(*inputs)``; tuples, because that is the calibration format of
``wb.apply``), and ``read(output) -> tensor`` that picks the tensor to compare (logits, last_hidden_state, or the
output itself). Everything is tiny (a few thousand to a few hundred thousand parameters) except the real
EfficientNet-Lite0, so a whole row of techniques runs in seconds.

`ARCHITECTURES` also says, per architecture, which layers channel pruning should shrink (``channel_pattern``) and
whether it has attention heads to prune. `families` sorts a model's weight-bearing layers by what they compute,
so a test can tell which layers a technique must have compressed (a Conv2d subclass is a Conv2d, transformers'
Conv1D and nn.MultiheadAttention's projections are Linear computations).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

Built = tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[object], torch.Tensor]]


def _seeded(seed: int = 0) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1)


def _itself(out) -> torch.Tensor:
    return out


def _first(out) -> torch.Tensor:
    return out[0]


def _logits(out) -> torch.Tensor:
    return out.logits


def _last_hidden(out) -> torch.Tensor:
    return out.last_hidden_state


# ---------------------------------------------------------------- PyTorch building blocks

class EncoderClassifier(nn.Module):
    """nn.TransformerEncoder (2 layers, d_model 32, 4 heads) over (B, T, 16) features, mean-pooled, then a head."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(16, 32)
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                           batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 16) or (T, B, 16)
        h = self.encoder(self.embed(x))
        return self.head(h.mean(1 if self.batch_first else 0))          # (B, 10)


def encoder_batch_first() -> Built:
    g = _seeded()
    return EncoderClassifier(batch_first=True).eval(), (torch.randn(3, 7, 16, generator=g),), _itself


def encoder_seq_first() -> Built:
    g = _seeded()
    return EncoderClassifier(batch_first=False).eval(), (torch.randn(7, 3, 16, generator=g),), _itself


class AttentionPool(nn.Module):
    """nn.MultiheadAttention used directly (self-attention, 3 heads of 8) with a residual, then a head."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, 24)
        self.attn = nn.MultiheadAttention(24, num_heads=3, batch_first=True)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 12)
        h = self.proj(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(self.norm(h + a).mean(1))                      # (B, 6)


def mha() -> Built:
    g = _seeded()
    return AttentionPool().eval(), (torch.randn(3, 9, 12, generator=g),), _itself


class RecurrentClassifier(nn.Module):
    """A 2-layer nn.LSTM or nn.GRU over (B, T, 12); the head reads the last step."""

    def __init__(self, cell: type[nn.Module]):
        super().__init__()
        self.rnn = cell(12, 20, num_layers=2, batch_first=True)
        self.head = nn.Linear(20, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 12)
        out, _ = self.rnn(x)
        return self.head(out[:, -1])                                    # (B, 5)


def lstm() -> Built:
    g = _seeded()
    return RecurrentClassifier(nn.LSTM).eval(), (torch.randn(3, 11, 12, generator=g),), _itself


def gru() -> Built:
    g = _seeded()
    return RecurrentClassifier(nn.GRU).eval(), (torch.randn(3, 11, 12, generator=g),), _itself


class Conv1dNet(nn.Module):
    """A 1-D CNN: two nn.Conv1d with ReLU, global average pooling, a Linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 16, 5, padding=2)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv1d(16, 24, 3, padding=1)
        self.act2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4, L)
        h = self.act2(self.conv2(self.act1(self.conv1(x))))
        return self.head(self.pool(h).flatten(1))                       # (B, 5)


def cnn1d() -> Built:
    g = _seeded()
    return Conv1dNet().eval(), (torch.randn(3, 4, 40, generator=g),), _itself


def _randomise_bn(model: nn.Module, g: torch.Generator) -> None:
    """Give every BatchNorm non-trivial statistics and affine parameters (as a trained network has)."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            with torch.no_grad():
                m.running_mean.copy_(0.1 * torch.randn(n, generator=g))
                m.running_var.copy_(0.5 + torch.rand(n, generator=g))
                m.weight.copy_(1 + 0.1 * torch.randn(n, generator=g))
                m.bias.copy_(0.1 * torch.randn(n, generator=g))


class MobileBlockNet(nn.Module):
    """MobileNet-style: stem Conv2d+BN+ReLU6, depthwise 3x3 (groups = channels)+BN+ReLU6, pointwise 1x1+BN,
    global pooling, Linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(16)
        self.act0 = nn.ReLU6()
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.act1 = nn.ReLU6()
        self.pointwise = nn.Conv2d(16, 24, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(24)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W)
        h = self.act0(self.bn0(self.stem(x)))
        h = self.act1(self.bn1(self.depthwise(h)))
        h = self.bn2(self.pointwise(h))
        return self.head(self.pool(h).flatten(1))                       # (B, 10)


def mobilenet_block() -> Built:
    g = _seeded()
    model = MobileBlockNet()
    _randomise_bn(model, g)
    return model.eval(), (torch.randn(3, 3, 20, 20, generator=g),), _itself


class Decoder(nn.Module):
    """A latent vector -> Linear -> (16, 4, 4) -> two nn.ConvTranspose2d (stride 2) -> a (3, 16, 16) image."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16 * 4 * 4)
        self.up1 = nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1)
        self.act = nn.ReLU()
        self.up2 = nn.ConvTranspose2d(8, 3, 4, stride=2, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (B, 8)
        h = self.fc(z).view(-1, 16, 4, 4)
        return self.up2(self.act(self.up1(h)))                          # (B, 3, 16, 16)


def conv_transpose() -> Built:
    g = _seeded()
    return Decoder().eval(), (torch.randn(3, 8, generator=g),), _itself


class OddSizes(nn.Module):
    """Sizes that are not multiples of anything: Embedding(50, 100) mean-pooled, Linear(100, 27),
    Linear(27, 344), Linear(344, 7)."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(50, 100)
        self.fc1 = nn.Linear(100, 27)
        self.act1 = nn.GELU()
        self.fc2 = nn.Linear(27, 344)
        self.act2 = nn.GELU()
        self.out = nn.Linear(344, 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) int64
        h = self.tokens(ids).mean(1)                                    # (B, 100)
        return self.out(self.act2(self.fc2(self.act1(self.fc1(h)))))   # (B, 7)


def odd_sizes() -> Built:
    g = _seeded()
    return OddSizes().eval(), (torch.randint(0, 50, (3, 6), generator=g),), _itself


# ---------------------------------------------------------------- Hugging Face, tiny random configs

def _ids(g: torch.Generator, vocab: int = 96, shape=(2, 9)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=g)


def gpt2() -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    g = _seeded()
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    assert model.lm_head.weight is model.transformer.wte.weight   # tied, as in the real GPT-2
    return model, (_ids(g),), _logits


def llama() -> Built:
    from transformers import LlamaConfig, LlamaForCausalLM

    g = _seeded()
    cfg = LlamaConfig(hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval(), (_ids(g),), _logits


def bert() -> Built:
    from transformers import BertConfig, BertModel

    g = _seeded()
    cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                     vocab_size=96, max_position_embeddings=32, pad_token_id=0)
    ids = _ids(g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0                                                    # one padded sequence
    return BertModel(cfg).eval(), (ids, mask), _last_hidden


def t5() -> Built:
    from transformers import T5Config, T5Model

    g = _seeded()
    cfg = T5Config(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, vocab_size=96, decoder_start_token_id=0,
                   pad_token_id=0, eos_token_id=1)
    ids = _ids(g)
    return T5Model(cfg).eval(), (ids, torch.ones_like(ids), _ids(g, shape=(2, 5))), _last_hidden


def vit() -> Built:
    from transformers import ViTConfig, ViTForImageClassification

    g = _seeded()
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=48, num_labels=5)
    return ViTForImageClassification(cfg).eval(), (torch.randn(2, 3, 16, 16, generator=g),), _logits


# ---------------------------------------------------------------- Hugging Face, 2026 layouts (issue 35)

def mixtral() -> Built:
    """Mixture of experts, transformers 5 layout: one MixtralExperts module holding fused 3-D expert weights."""
    from transformers import MixtralConfig, MixtralForCausalLM

    g = _seeded()
    cfg = MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64)
    return MixtralForCausalLM(cfg).eval(), (_ids(g, shape=(2, 16)),), _logits


def qwen2_moe() -> Built:
    """Another mixture-of-experts layout: fused routed experts beside a shared expert of nn.Linears and its gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    g = _seeded()
    cfg = Qwen2MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                         shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    return Qwen2MoeForCausalLM(cfg).eval(), (_ids(g, shape=(2, 16)),), _logits


def phi3() -> Built:
    """Fused projections: qkv_proj, and gate_up_proj whose two halves feed one SiLU-gated product."""
    from transformers import Phi3Config, Phi3ForCausalLM

    g = _seeded()
    cfg = Phi3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                     bos_token_id=0, eos_token_id=0)
    return Phi3ForCausalLM(cfg).eval(), (_ids(g),), _logits


def gpt_neox() -> Built:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    g = _seeded()
    cfg = GPTNeoXConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64)
    return GPTNeoXForCausalLM(cfg).eval(), (_ids(g),), _logits


def falcon() -> Built:
    """FalconLinear: an nn.Linear subclass with its own forward (which computes x @ W.T + b)."""
    from transformers import FalconConfig, FalconForCausalLM

    g = _seeded()
    cfg = FalconConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       max_position_embeddings=64)
    return FalconForCausalLM(cfg).eval(), (_ids(g),), _logits


def gemma2() -> Built:
    """A scaled word embedding (an Embedding subclass multiplying by sqrt(hidden)), soft-capped logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    g = _seeded()
    cfg = Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                       sliding_window=8)
    return Gemma2ForCausalLM(cfg).eval(), (_ids(g),), _logits


def opt() -> Built:
    """Learned positions with an offset (an Embedding subclass indexed at position + 2)."""
    from transformers import OPTConfig, OPTForCausalLM

    g = _seeded()
    cfg = OPTConfig(vocab_size=96, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=32)
    return OPTForCausalLM(cfg).eval(), (_ids(g),), _logits


def swin() -> Built:
    """Shifted windows: blocks whose arguments (the spatial size) are not the hidden states alone."""
    from transformers import SwinConfig, SwinForImageClassification

    g = _seeded()
    cfg = SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                     window_size=4, num_labels=5)
    return SwinForImageClassification(cfg).eval(), (torch.randn(2, 3, 32, 32, generator=g),), _logits


def mamba() -> Built:
    """A state-space model: dt_proj's weight is read directly by its parent, a depthwise causal Conv1d."""
    from transformers import MambaConfig, MambaForCausalLM

    g = _seeded()
    cfg = MambaConfig(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    return MambaForCausalLM(cfg).eval(), (_ids(g),), _logits


def deberta_v2() -> Built:
    """Disentangled attention: relative-position projections shared across layers."""
    from transformers import DebertaV2Config, DebertaV2Model

    g = _seeded()
    cfg = DebertaV2Config(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=48, max_position_embeddings=64, relative_attention=True,
                          position_buckets=16, pos_att_type=["p2c", "c2p"])
    ids = _ids(g)
    return DebertaV2Model(cfg).eval(), (ids, torch.ones_like(ids)), _last_hidden


def hf_resnet() -> Built:
    """Hugging Face's ResNet: bottleneck blocks (1x1, 3x3, 1x1) with residual shortcuts, BatchNorm after each."""
    from transformers import ResNetConfig, ResNetForImageClassification

    g = _seeded()
    cfg = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[32, 64], depths=[1, 2],
                       layer_type="bottleneck", num_labels=5)
    model = ResNetForImageClassification(cfg)
    _randomise_bn(model, g)
    return model.eval(), (torch.randn(2, 3, 32, 32, generator=g),), _logits


# ---------------------------------------------------------------- a real pretrained CNN

def efficientnet_lite0() -> Built:
    """The zoo's EfficientNet-Lite0 (ImageNet weights) on a real photo (the centre crop of chelsea, a cat)."""
    import workbench as wb
    from workbench.tasks.images import views

    x = views("chelsea")[:1]                                          # (1, 3, 224, 224)
    return wb.models.load("efficientnet-lite0"), (x,), _itself


def chelsea_other_crops() -> list[tuple[torch.Tensor, ...]]:
    """Calibration for EfficientNet-Lite0: four other crops of the photo it is checked on. (On its own crop, 64 %
    of the pooled features the classifier reads are exactly 0, so Wanda and SparseGPT rightly prune only weights
    that meet zeros there: the same output, which the gallery would call a no-op.)"""
    from workbench.tasks.images import views

    return [(views("chelsea")[2:6],)]


@dataclass(frozen=True)
class Architecture:
    name: str
    build: Callable[[], Built]
    channel_pattern: str | None   # the producers channel pruning shrinks (None: nothing it can take)
    heads: bool                   # has attention heads to prune
    slow: bool = False
    calibration: Callable[[], list] | None = None   # calibration batches other than the checked input


ARCHITECTURES = {a.name: a for a in [
    Architecture("encoder-batch-first", encoder_batch_first, "encoder.layers.*.linear1", heads=True),
    Architecture("encoder-seq-first", encoder_seq_first, "encoder.layers.*.linear1", heads=True),
    Architecture("mha", mha, "proj", heads=True),
    Architecture("lstm", lstm, None, heads=False),
    Architecture("gru", gru, None, heads=False),
    Architecture("conv1d", cnn1d, "conv1", heads=False),
    Architecture("mobilenet-block", mobilenet_block, "stem", heads=False),
    Architecture("conv-transpose", conv_transpose, "up1", heads=False),
    Architecture("odd-sizes", odd_sizes, "fc2", heads=False),
    Architecture("gpt2", gpt2, "transformer.h.*.mlp.c_fc", heads=True),
    Architecture("llama-gqa", llama, "model.layers.*.mlp.gate_proj", heads=True),
    Architecture("bert", bert, "encoder.layer.*.intermediate.dense", heads=True),
    Architecture("t5", t5, "*.DenseReluDense.wi", heads=True),
    Architecture("vit", vit, r"re:vit\..*\.(intermediate\.dense|mlp\.fc1)", heads=True),   # by transformers version
    Architecture("efficientnet-lite0", efficientnet_lite0, "_blocks.*._expand_conv", heads=False, slow=True,
                 calibration=chelsea_other_crops),
    Architecture("mixtral", mixtral, "model.layers.*.mlp.experts", heads=True),
    Architecture("qwen2-moe", qwen2_moe, "model.layers.*.mlp.experts", heads=True),
    Architecture("phi3", phi3, "model.layers.*.mlp.gate_up_proj", heads=True),
    Architecture("gpt-neox", gpt_neox, "gpt_neox.layers.*.mlp.dense_h_to_4h", heads=True),
    Architecture("falcon", falcon, "transformer.h.*.mlp.dense_h_to_4h", heads=True),
    Architecture("gemma2", gemma2, "model.layers.*.mlp.gate_proj", heads=True),
    Architecture("opt", opt, "model.decoder.layers.*.fc1", heads=True),
    Architecture("swin", swin, r"re:swin\..*\.(intermediate\.dense|mlp\.fc1)", heads=True),
    Architecture("mamba", mamba, "backbone.layers.*.mixer.in_proj", heads=False),
    Architecture("deberta-v2", deberta_v2, "encoder.layer.*.intermediate.dense", heads=True),
    Architecture("hf-resnet", hf_resnet, "resnet.encoder.stages.*.layers.*.layer.0.convolution", heads=False),
]}


# ---------------------------------------------------------------- layers by what they compute

def _hf_conv1d() -> tuple[type, ...]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:   # transformers is a dependency; without it no model here has a Conv1D
        return ()
    return (Conv1D,)


def family(module: nn.Module) -> str | None:
    """What a weight-bearing layer computes: 'linear' (nn.Linear and subclasses, transformers' Conv1D,
    nn.MultiheadAttention's packed in-projection), 'conv1d', 'conv2d' (any nn.Conv2d subclass, grouped and
    depthwise included), 'conv_transpose', 'embedding', 'rnn' (nn.LSTM / nn.GRU), 'experts' (a module holding
    the 3-D stacked weights of a mixture of experts' experts, as transformers 5 stores them); None otherwise."""
    if isinstance(module, (nn.Linear, *_hf_conv1d(), nn.MultiheadAttention)):
        return "linear"
    if isinstance(module, nn.Conv1d):
        return "conv1d"
    if isinstance(module, nn.Conv2d):
        return "conv2d"
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d)):
        return "conv_transpose"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, (nn.LSTM, nn.GRU)):
        return "rnn"
    if any(p.dim() == 3 and n.endswith("_proj") for n, p in module.named_parameters(recurse=False)):
        return "experts"   # a mixture of experts' fused experts (gate_up_proj (E, 2I, H), down_proj (E, H, I), ...)
    return None


def families(model: nn.Module) -> dict[str, str]:
    """``{layer name: family}`` of every weight-bearing layer of ``model`` (an MHA's out_proj is listed too)."""
    return {name: f for name, m in model.named_modules() if name and (f := family(m)) is not None}
