"""Reproduce the zoo's shipped weights: ``python -m workbench.models.train NAME [--out DIR]``.

Training is deterministic for a given torch version and thread count (seeded, fixed splits). Each run
writes ``DIR/NAME.safetensors`` whose metadata records the architecture, the seed, the measured test
metric and the versions used, so a shipped file says how it was made.

tiny-llama (`workbench.models.llama`): first a 4,096-token byte-level BPE on the training documents of
`workbench.tasks.data.english_documents` (gensim's lee_background + Python 3.11's pydoc_data topics, every tenth
document held out), then 2,000 AdamW steps of 8 random 128-token windows (1.6 M tokens, ~8 epochs of the 202 k
training tokens; warm-up, cosine decay). The shipped file was made with ``--device cuda`` on an H100 (120 s,
held-out perplexity 113.8); the same recipe on 2 CPU cores takes about 1-2 s a step when the machine is quiet
(``--threads 1`` beat 2 under load), so ``--steps 160`` (perplexity ~700, under-trained) is the quick CPU check
(GPU and CPU runs are not bit-identical).
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
from workbench.training import optimizer_step

__all__ = ["train", "TRAINABLE"]


def _train_classifier(model: torch.nn.Module, split: data.Split, *, epochs: int, lr: float,
                      batch_size: int = 64, seed: int = 0) -> float:
    from workbench.training import fit_classifier

    fit_classifier(model, split, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed)
    with torch.inference_mode():
        pred = model(torch.from_numpy(split.x_test)).argmax(-1).numpy()
    return float((pred == split.y_test).mean())


def _pretrain_lm(model: torch.nn.Module, stream: torch.Tensor, *, steps: int, batch_size: int, block: int, lr: float,
                 warmup: int, generator: torch.Generator, desc: str, logits_of, device: str = "cpu",
                 log_every: int = 10) -> None:
    """Next-token pre-training on random ``block``-token windows of ``stream`` (N,): AdamW (weight decay on
    matrices only), linear warm-up then cosine decay to a tenth of ``lr``, gradients clipped at 1.
    ``logits_of(ids (B, T)) -> (B, T, V)``."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    bar = tqdm(range(steps), desc=desc)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = torch.randint(0, len(stream) - block - 1, (batch_size,), generator=generator)
        xb = torch.stack([stream[s:s + block] for s in starts]).to(device)          # (B, T)
        yb = torch.stack([stream[s + 1:s + 1 + block] for s in starts]).to(device)  # (B, T)
        logits = logits_of(xb)                                                      # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1))
        value = optimizer_step(loss, opt, clip=1.0, params=model.parameters())
        if step % log_every == 0:
            bar.set_postfix(loss=f"{value:.3f}")


def _train_tiny_lm(steps: int = 2000, batch_size: int = 32, lr: float = 2e-3, seed: int = 0):
    corpus = data.char_corpus()
    cfg = TinyLMConfig(vocab_size=len(corpus.vocab))
    model = TinyLM(cfg)
    g = torch.Generator().manual_seed(seed)
    train = torch.from_numpy(corpus.train)
    T = cfg.block_size
    _pretrain_lm(model, train, steps=steps, batch_size=batch_size, block=T, lr=lr, warmup=100, generator=g,
                 desc="tiny-lm", logits_of=model, log_every=50)
    model.eval()
    from workbench.tasks.lm import perplexity
    return model, perplexity(model, corpus.test, T), cfg


def _train_tiny_llama(out: Path, steps: int = 2000, batch_size: int = 8, block: int = 128, lr: float = 3e-3,
                      seed: int = 0, device: str = "cpu"):
    """Tokenizer first (training documents only, written to ``out``), then the model on random windows of the
    training token stream; perplexity is measured on the held-out documents after the fp16 round trip the
    shipped file goes through."""
    from transformers import PreTrainedTokenizerFast

    from workbench.models import llama
    from workbench.tasks.llama import TinyLlamaTask

    text = data.english_documents()
    tok = llama.train_tokenizer(text.train)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / llama.TOKENIZER_FILE))
    eos = tok.token_to_id(llama.EOS)
    stream = torch.tensor([i for doc in text.train for i in [*tok.encode(doc).ids, eos]])  # (N,)
    torch.manual_seed(seed)
    model = llama.build().to(device).train()
    g = torch.Generator().manual_seed(seed)
    _pretrain_lm(model, stream, steps=steps, batch_size=batch_size, block=block, lr=lr, warmup=steps // 10,
                 generator=g, desc="tiny-llama", logits_of=lambda ids: model(input_ids=ids).logits, device=device)
    model = model.cpu().eval().half().float()  # what loading the shipped fp16 file gives
    task = TinyLlamaTask(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=llama.EOS))
    return model, task.evaluate(model)["perplexity"], {"tokens_train": len(stream), "tokens_test": len(task.test_ids)}


def train(name: str, out: Path, seed: int = 0, device: str = "cpu", steps: int | None = None) -> dict:
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
    elif name == "tiny-llama":
        from workbench.models.llama import ARCH

        model, ppl, sizes = _train_tiny_llama(out, seed=seed, device=device, **({"steps": steps} if steps else {}))
        metric = {"perplexity": ppl, **sizes}
        arch = dict(ARCH)
        model = model.half()                   # fp16 on disk (~21 MB); the zoo loads it as fp32
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
        "device": device,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / f"{name}.safetensors"), metadata=meta)
    return meta


TRAINABLE = ("digits-mlp", "digits-cnn", "mnist1d-cnn", "tiny-lm", "tiny-llama")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", choices=[*TRAINABLE, "all"])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the data folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); on a busy shared machine 1 can be faster than 2")
    parser.add_argument("--device", default="cpu", help="where tiny-llama trains (cpu, cuda); the others train on cpu")
    parser.add_argument("--steps", type=int, default=None, help="tiny-llama optimizer steps (default: the recipe's)")
    args = parser.parse_args(argv)
    from workbench.paths import data_dir

    out = args.out or data_dir()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = TRAINABLE if "all" in args.names else args.names
    for name in names:
        meta = train(name, out, seed=args.seed, device=args.device if name == "tiny-llama" else "cpu",
                     steps=args.steps if name == "tiny-llama" else None)
        print(f"{name}: {meta['test_metric']} in {meta['train_seconds']} s -> {out / (name + '.safetensors')}")


if __name__ == "__main__":
    main()
