"""Reproduce the zoo's shipped weights: ``python -m workbench.models.train NAME [--out DIR]``.

Training is deterministic for a given torch version and thread count (seeded, fixed splits). Each run
writes ``DIR/NAME.safetensors`` whose metadata records the architecture, the seed, the measured test
metric and the versions used, so a shipped file says how it was made.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_model
from tqdm.auto import tqdm

from workbench.models.architectures import DigitsCNN, DigitsMLP, Mnist1dCNN, TinyLM, TinyLMConfig
from workbench.tasks import data

__all__ = ["train", "TRAINABLE"]


def _train_classifier(model: torch.nn.Module, split: data.Split, *, epochs: int, lr: float,
                      batch_size: int = 64, seed: int = 0) -> float:
    from workbench.training import fit_classifier

    fit_classifier(model, split, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed)
    with torch.inference_mode():
        pred = model(torch.from_numpy(split.x_test)).argmax(-1).numpy()
    return float((pred == split.y_test).mean())


def _train_tiny_lm(steps: int = 2000, batch_size: int = 32, lr: float = 2e-3, seed: int = 0):
    corpus = data.char_corpus()
    cfg = TinyLMConfig(vocab_size=len(corpus.vocab))
    model = TinyLM(cfg)
    g = torch.Generator().manual_seed(seed)
    train = torch.from_numpy(corpus.train)
    T = cfg.block_size
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = 100

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    bar = tqdm(range(steps), desc="tiny-lm")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = torch.randint(0, len(train) - T - 1, (batch_size,), generator=g)
        xb = torch.stack([train[s:s + T] for s in starts])          # (B, T)
        yb = torch.stack([train[s + 1:s + 1 + T] for s in starts])  # (B, T)
        logits = model(xb)                                           # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    from workbench.tasks.lm import perplexity
    return model, perplexity(model, corpus.test, T), cfg


def train(name: str, out: Path, seed: int = 0) -> dict:
    """Train one zoo model and write ``out/NAME.safetensors``; returns its metadata."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    t0 = time.perf_counter()
    arch: dict = {}
    if name == "digits-mlp":
        model = DigitsMLP()
        metric = {"accuracy": _train_classifier(model, data.digits(), epochs=60, lr=3e-3, seed=seed)}
    elif name == "digits-cnn":
        model = DigitsCNN()
        metric = {"accuracy": _train_classifier(model, data.digits(), epochs=40, lr=3e-3, seed=seed)}
    elif name == "mnist1d-cnn":
        model = Mnist1dCNN()
        metric = {"accuracy": _train_classifier(model, data.mnist1d(), epochs=30, lr=3e-3, batch_size=128,
                                                seed=seed)}
    elif name == "tiny-lm":
        model, ppl, cfg = _train_tiny_lm(seed=seed)
        metric = {"perplexity": ppl}
        arch = cfg.to_dict()
    else:
        raise ValueError(f"unknown trainable model {name!r}; trainable: {TRAINABLE}")
    meta = {
        "workbench_zoo": name,
        "arch": json.dumps(arch),
        "seed": str(seed),
        "test_metric": json.dumps(metric),
        "train_seconds": f"{time.perf_counter() - t0:.1f}",
        "threads": str(torch.get_num_threads()),
        "torch_version": torch.__version__,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / f"{name}.safetensors"), metadata=meta)
    return meta


TRAINABLE = ("digits-mlp", "digits-cnn", "mnist1d-cnn", "tiny-lm")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", choices=[*TRAINABLE, "all"])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the data folder)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from workbench.paths import data_dir

    out = args.out or data_dir()
    names = TRAINABLE if "all" in args.names else args.names
    for name in names:
        meta = train(name, out, seed=args.seed)
        print(f"{name}: {meta['test_metric']} in {meta['train_seconds']} s -> {out / (name + '.safetensors')}")


if __name__ == "__main__":
    main()
