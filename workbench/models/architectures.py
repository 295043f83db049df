"""The small architectures of the model zoo (their trained weights ship in ``data/``).

Each takes the task's raw input layout, so every model of a task is measured on the same tensors:
digits models take ``(B, 64)`` pixel rows in [0, 1], mnist1d models take ``(B, 40)`` signals, and the
language model takes ``(B, T)`` character ids.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DigitsMLP", "DigitsCNN", "Mnist1dCNN", "TinyLMConfig", "TinyLM"]


class DigitsMLP(nn.Module):
    """64 -> 256 -> 128 -> 10 multilayer perceptron for the 8x8 digits."""

    def __init__(self, hidden: tuple[int, int] = (256, 128), classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.fc3 = nn.Linear(hidden[1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 64)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)  # (B, classes)


class DigitsCNN(nn.Module):
    """Three 3x3 conv blocks (conv -> BatchNorm -> ReLU) and two Linear layers for the 8x8 digits."""

    def __init__(self, channels: tuple[int, int, int] = (32, 64, 64), hidden: int = 128, classes: int = 10):
        super().__init__()
        c1, c2, c3 = channels
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c2)
        self.conv3 = nn.Conv2d(c2, c3, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(c3)
        self.fc1 = nn.Linear(c3 * 2 * 2, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 64)
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.bn1(self.conv1(x)))                    # (B, c1, 8, 8)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)   # (B, c2, 4, 4)
        x = F.max_pool2d(F.relu(self.bn3(self.conv3(x))), 2)   # (B, c3, 2, 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)  # (B, classes)


class Mnist1dCNN(nn.Module):
    """A 1-D CNN (conv -> BatchNorm -> ReLU blocks, two max-pools) for mnist1d's 40-sample signals."""

    def __init__(self, channels: tuple[int, int, int] = (32, 64, 128), hidden: int = 128, classes: int = 10):
        super().__init__()
        c1, c2, c3 = channels
        self.conv1 = nn.Conv1d(1, c1, 5, padding=2)
        self.bn1 = nn.BatchNorm1d(c1)
        self.conv2 = nn.Conv1d(c1, c2, 3, padding=1)
        self.bn2 = nn.BatchNorm1d(c2)
        self.conv3 = nn.Conv1d(c2, c3, 3, padding=1)
        self.bn3 = nn.BatchNorm1d(c3)
        self.fc1 = nn.Linear(c3 * 10, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 40)
        x = x.unsqueeze(1)                                      # (B, 1, 40)
        x = F.relu(self.bn1(self.conv1(x)))                     # (B, c1, 40)
        x = F.max_pool1d(F.relu(self.bn2(self.conv2(x))), 2)    # (B, c2, 20)
        x = F.max_pool1d(F.relu(self.bn3(self.conv3(x))), 2)    # (B, c3, 10)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)  # (B, classes)


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = 96
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 6
    n_embd: int = 192
    dropout: float = 0.1

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)                      # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, C)                         # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    """A nanoGPT-shaped character-level decoder (pre-LayerNorm blocks, untied head)."""

    def __init__(self, cfg: TinyLMConfig = TinyLMConfig()):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (B, T) int64
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds the block size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))      # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))                  # (B, T, vocab)
