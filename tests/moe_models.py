"""Small random mixtures of experts in transformers 5's layouts, shared by the experts tests: Mixtral (fused
(E, 2I, H) / (E, H, I) experts used as ``F.linear``), GPT-OSS (transposed, with biases and an interleaved gate) and
Qwen2-MoE (Mixtral's layout beside a shared expert of nn.Linears). Hidden 64, 4 experts, top-2, 2 layers."""
import torch
import transformers as tf
from torch import nn


def mixtral() -> nn.Module:
    torch.manual_seed(0)
    return tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)).eval()


def gpt_oss() -> nn.Module:
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])).eval()
    with torch.no_grad():   # (initialised to zero: random, so that a lost bias shows)
        for name, p in model.named_parameters():
            if name.endswith("_proj_bias"):
                p.normal_(0, 0.02)
    return model


def qwen2_moe() -> nn.Module:
    torch.manual_seed(0)
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2)).eval()


MODELS = {"mixtral": mixtral, "gpt_oss": gpt_oss, "qwen2_moe": qwen2_moe}

TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def experts_of(model: nn.Module) -> dict[str, nn.Module]:
    """The model's experts modules by name."""
    return {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}


def logits(model: nn.Module) -> torch.Tensor:
    """The model's logits on `TOKENS` (inference mode)."""
    with torch.inference_mode():
        return model(TOKENS).logits


CALIBRATION = [(torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2)),)]


def routed_inputs(model: nn.Module, layer: str = "model.layers.0.mlp.experts") -> tuple[torch.Tensor, torch.Tensor]:
    """The experts module's (hidden states (T, H), routed expert ids (T, k)) on the `CALIBRATION` batch, read with
    a hook on the float model (independently of the workbench's recording)."""
    seen = []
    handle = model.get_submodule(layer).register_forward_pre_hook(lambda m, args: seen.append(args))
    with torch.inference_mode():
        model(*CALIBRATION[0])
    handle.remove()
    return seen[0][0], seen[0][1]
