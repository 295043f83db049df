"""Rotations of a decoder LLM's residual stream and attention heads, fused into the weights (QuaRot, Ashkboos et al.
2024; SpinQuant, Liu et al. 2024): the model computes the same function, and its weights and activations lose their
outlier channels, so they quantize with less error.

`Rotate` is a model-level stage (``wb.Plan(entries, stages=[wb.quant.Rotate()])``) for Llama-family decoders (Llama,
Mistral, Qwen2 / Qwen3, Gemma and their look-alikes: pre-norm RMSNorm blocks with ``self_attn.{q,k,v,o}_proj`` and an
MLP of ``gate / up / down_proj`` nn.Linears or a mixture of experts - transformers 5's fused experts in either
orientation with their router, and a shared expert with its gate, as Mixtral, GPT-OSS, Qwen2/3-MoE have). It

1. folds every RMSNorm's scale into the Linears that read it (``input_layernorm`` into q / k / v,
   ``post_attention_layernorm`` into gate / up, the final norm into the head) and leaves the norms with unit scale
   (the head is untied from the embedding first: the embedding takes the rotation, the head the final norm too);
2. rotates the residual stream by one orthogonal matrix Q (d x d): the embedding's rows ``E Q``, the Linears (and
   routers, and experts) that read the stream ``W Q``, the ones that write to it ``Q^T W`` (and their biases).
   RMSNorm without a scale commutes with Q (it divides by the vector's norm, which Q keeps);
3. with ``heads=True``, rotates each head's values by one orthogonal H (head_dim x head_dim): ``v_proj``'s rows of
   every kv head ``H^T W``, ``o_proj``'s columns of every head ``W H``;
4. with ``online=True``, rotates a dense MLP's ``down_proj`` input at run time by a Hadamard R of its width (an
   `OnlineHadamard` hook, ``x R`` computed as two small products of its Kronecker factors) and its weight by
   ``W R``: the product the MLP feeds ``down_proj``, where LLMs' largest activation outliers sit, is spread before
   it is quantized. The hook moves with the layer when it is compressed; `wb.export` refuses such a model (no
   exported format runs it).

Q and H are random Hadamard matrices (``H diag(s) / sqrt(n)`` with random signs ``s``: every output mixes every input
with equal weight, which spreads an outlier channel over all of them) where a Hadamard matrix of that order is
constructed here (Sylvester's powers of two, Paley's constructions for q + 1 and 2(q + 1), and their Kronecker
products: 320 = 20 x 16, 864 = 108 x 8, 5632 = 44 x 128), else random orthogonal matrices (QR of a Gaussian), and
the stage says which. The arithmetic is float64; the model is checked to compute what it did before (a short probe
sequence) and refused otherwise, naming the error.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from workbench.plans.layers import InputTransform
from workbench.plans.registry import Config, StageHandler, register_config

__all__ = ["Rotate", "OnlineHadamard", "hadamard", "random_hadamard", "random_orthogonal", "rotation", "kurtosis"]

ROTATIONS = ("hadamard", "orthogonal")


# ---------------------------------------------------------------------------------------------------- the matrices

def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = chi(j - i) over GF(q), q prime: chi the quadratic character (0 at 0)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order m by Paley's constructions with a prime q: I (m = q + 1, q = 3 mod 4) or
    II (m = 2 (q + 1), q = 1 mod 4); None when neither applies."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:
        S = torch.zeros(m, m, dtype=torch.float64)
        S[0, 1:] = 1
        S[1:, 0] = -1
        S[1:, 1:] = _jacobsthal(q)
        return S + torch.eye(m, dtype=torch.float64)
    if m % 2 == 0:
        q = m // 2 - 1
        if _is_prime(q) and q % 4 == 1:
            C = torch.zeros(q + 1, q + 1, dtype=torch.float64)
            C[0, 1:] = 1
            C[1:, 0] = 1
            C[1:, 1:] = _jacobsthal(q)
            a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
            b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
            return torch.kron(C, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)
    return None


def _sylvester(n: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


@functools.lru_cache(maxsize=32)
def _hadamard_factor(n: int) -> int | None:
    """The smallest m with n = m 2^k and a Hadamard matrix of order m constructed here (1 for a power of two)."""
    if n < 1:
        return None
    k = (n & -n).bit_length() - 1   # the power of two in n
    for j in range(k, -1, -1):
        m = n >> j
        if m == 1 or (m == 2) or (m % 4 == 0 and _paley(m) is not None):
            return m
    return None


def hadamard(n: int) -> torch.Tensor:
    """A Hadamard matrix of order ``n`` (entries +-1, ``H H^T = n I``; float64), as a Kronecker product of a Paley
    matrix and a Sylvester one; ``ValueError`` when no construction here reaches ``n``."""
    m = _hadamard_factor(n)
    if m is None:
        raise ValueError(f"no Hadamard matrix of order {n} is constructed here (orders m * 2^k with m = 1, 2, or a "
                         f"Paley order q + 1 / 2 (q + 1), q prime)")
    base = _sylvester(m) if m <= 2 else _paley(m)
    assert base is not None
    H = torch.kron(base, _sylvester(n // m))
    return H


def random_hadamard(n: int, generator: torch.Generator) -> torch.Tensor:
    """An orthogonal ``H diag(s) / sqrt(n)`` with random signs ``s`` (float64)."""
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64).to(torch.float64) * 2 - 1
    return hadamard(n) * signs[None, :] / math.sqrt(n)


def random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """A random orthogonal matrix (Haar: QR of a Gaussian with the signs of R's diagonal; float64)."""
    A = torch.randn(n, n, generator=generator, dtype=torch.float64)
    Q, R = torch.linalg.qr(A)
    return Q * torch.sign(torch.diagonal(R))[None, :]


def rotation(n: int, kind: str, generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """(an n x n orthogonal matrix, what it is): ``kind="hadamard"`` a random Hadamard where one of order n is
    constructed here, else a random orthogonal matrix; ``kind="orthogonal"`` always the latter."""
    if kind == "hadamard" and _hadamard_factor(n) is not None:
        m = _hadamard_factor(n)
        return random_hadamard(n, generator), (f"Hadamard {n}" if m == 1 else f"Hadamard {m} x {n // m}")
    return random_orthogonal(n, generator), f"random orthogonal {n}"


class OnlineHadamard(InputTransform):
    """A layer's input times an orthogonal R (``n x n``) at run time, before the layer computes: the normalized
    Hadamard matrix of order ``n`` (no random signs), applied as two Kronecker factors ``A (a x a)`` and ``B (b x b)``
    with ``n = a b`` and both near sqrt(n) (``x R = A^T X B / sqrt(n)`` with ``X`` the input viewed as ``(..., a, b)``:
    a^2 b + a b^2 multiply-adds a row, not n^2), or, where no Hadamard matrix of order n is constructed here, a random
    orthogonal matrix from ``seed`` (one dense product). The layer's weight holds ``W R`` (`rotate`)."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = int(n), int(seed)
        self.m = _hadamard_factor(self.n)
        self._factors: dict = {}

    def _split(self) -> tuple[int, int]:
        """(a, b): A = Paley(m) x Sylvester(2^i), B = Sylvester(2^j), 2^(i + j) = n / m, b the power of two nearest
        sqrt(n) that fits."""
        assert self.m is not None
        k = (self.n // self.m).bit_length() - 1
        j = min(k, max(0, round(math.log2(math.sqrt(self.n)))))
        return self.n >> j, 1 << j

    def factors(self, device=None, dtype=torch.float64) -> tuple[torch.Tensor, ...]:
        key = (torch.device(device or "cpu"), dtype)
        if key not in self._factors:
            if self.m is None:
                dense = random_orthogonal(self.n, torch.Generator().manual_seed(self.seed))
                made: tuple[torch.Tensor, ...] = (dense,)
            else:
                a, b = self._split()
                base = _sylvester(self.m) if self.m <= 2 else _paley(self.m)
                A = torch.kron(base, _sylvester(a // self.m))
                made = (A.T.contiguous() / math.sqrt(a), _sylvester(b) / math.sqrt(b))
            self._factors[key] = tuple(f.to(key[0], dtype) for f in made)
        return self._factors[key]

    def rotate(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """``x R`` over the last dimension (length n), in ``x``'s dtype; ``transpose=True``: ``x R^T`` (the inverse)."""
        if x.shape[-1] != self.n:
            raise ValueError(f"OnlineHadamard of order {self.n} got an input with {x.shape[-1]} features")
        f = self.factors(x.device, x.dtype)
        if len(f) == 1:
            return x @ (f[0].T if transpose else f[0])
        at, b = f   # x R = A^T X B / sqrt(n), x R^T = A X B^T / sqrt(n) (B is symmetric)
        X = x.reshape(*x.shape[:-1], at.shape[0], b.shape[0])
        return ((at.T if transpose else at) @ X @ b).reshape(x.shape)

    def __call__(self, module: nn.Module, args: tuple):
        return (self.rotate(args[0]), *args[1:])

    def __getstate__(self):   # (deepcopy / pickle: the factors are made again on demand)
        return {"n": self.n, "seed": self.seed, "m": self.m, "_factors": {}}

    def __repr__(self) -> str:
        what = f"Hadamard {self.m} x {self.n // self.m}" if self.m else "random orthogonal"
        return f"OnlineHadamard({self.n}, {what})"


def kurtosis(x: torch.Tensor) -> torch.Tensor:
    """The kurtosis E[(x - mu)^4] / sigma^4 over the last dimension, averaged over the rest (3 for a Gaussian; large
    when a few channels hold outliers)."""
    x = x.double().reshape(-1, x.shape[-1])
    c = x - x.mean(-1, keepdim=True)
    var = c.pow(2).mean(-1)
    return (c.pow(4).mean(-1) / var.clamp_min(1e-30).pow(2)).mean()


# ---------------------------------------------------------------------------------------------------- the layout

@dataclass
class _Block:
    name: str
    norm1: nn.Module
    norm2: nn.Module
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    readers: list[tuple[torch.Tensor, int]]   # the MLP's tensors reading the normed stream (and their hidden dim)
    writers: list[tuple[torch.Tensor, int]]   # the MLP's tensors writing to the stream (and their hidden dim)
    down: nn.Linear | None                    # a dense MLP's down_proj (the online rotation's layer)


@dataclass
class _Layout:
    embed: nn.Embedding
    blocks: list[_Block]
    norm: nn.Module
    head: nn.Linear
    head_name: str
    norm_name: str
    hidden: int
    head_dim: int
    heads: int
    kv_heads: int
    tied: bool = False


def _refuse(model: nn.Module, why: str) -> ValueError:
    return ValueError(f"Rotate: {type(model).__name__} {why}")


def _linear(model: nn.Module, parent: nn.Module, pname: str, attr: str) -> nn.Linear:
    mod = getattr(parent, attr, None)
    if not isinstance(mod, nn.Linear):
        what = "missing" if mod is None else f"a {type(mod).__name__}, not an nn.Linear"
        raise _refuse(model, f"has no plain Linear at {pname}.{attr} ({what}): the rotation is fused into the Llama "
                             f"family's q / k / v / o and gate / up / down projections; rotate before compressing")
    return mod


def _router(own: dict[str, nn.Parameter], hidden: int) -> bool:
    """Whether a module's own parameters are a router's: a (experts, hidden) weight and perhaps a bias per expert."""
    w, b = own.get("weight"), own.get("bias")
    return w is not None and set(own) <= {"weight", "bias"} and w.dim() == 2 and w.shape[1] == hidden and \
        (b is None or b.shape == w.shape[:1])


def _mlp_tensors(model: nn.Module, name: str, mlp: nn.Module, hidden: int):
    """(readers, writers, the dense down_proj or None) of a decoder layer's MLP: a dense one (gate / up / down
    nn.Linears) or a mixture of experts (transformers 5's fused experts - `experts.experts_layout`, either
    orientation - with its router, and a shared expert of nn.Linears with its gate, as Qwen2-MoE has). Each entry is
    a tensor and the dimension of it that runs along the hidden size. Anything else holding parameters is refused."""
    from workbench.quantization.experts import experts_layout

    readers: list[tuple[torch.Tensor, int]] = []
    writers: list[tuple[torch.Tensor, int]] = []
    dense_down = None
    moe = False
    for sub, mod in mlp.named_modules():
        own = dict(mod.named_parameters(recurse=False))
        where = f"{name}.{sub}" if sub else name
        if type(mod).__module__.startswith("workbench."):
            raise _refuse(model, f"layer {where} is already compressed ({type(mod).__name__}): rotate before "
                                 f"compressing (the stage runs first in a plan)")
        if not own:
            continue
        try:
            layout = experts_layout(mod)
        except ValueError as e:
            raise _refuse(model, f"layer {where}: {e}") from None
        if layout is not None:   # fused experts: (E, rows, K) used as F.linear, or transposed (E, K, rows)
            moe = True
            for m in layout:
                p = own.pop(m.name)
                if m.name == "down_proj":   # rows = hidden: the writer
                    writers.append((p, 2 if m.transposed else 1))
                    bias = own.pop("down_proj_bias", None)
                    if bias is not None:
                        writers.append((bias, 1))
                else:                       # K = hidden: a reader
                    readers.append((p, 1 if m.transposed else 2))
                    own.pop(f"{m.name}_bias", None)   # (its outputs are not the stream)
            if own:
                raise _refuse(model, f"layer {where} holds {sorted(own)} beside its expert projections")
        elif isinstance(mod, nn.Linear):
            if sub.rpartition(".")[2] == "down_proj":
                if mod.out_features != hidden:
                    raise _refuse(model, f"layer {where} writes {mod.out_features} features, not the hidden size "
                                         f"{hidden}")
                writers += [(mod.weight, 0)] + ([(mod.bias, 0)] if mod.bias is not None else [])
                dense_down = mod if not sub.count(".") else dense_down
            else:
                if mod.in_features != hidden:
                    raise _refuse(model, f"layer {where} reads {mod.in_features} features, not the hidden size "
                                         f"{hidden}")
                readers.append((mod.weight, 1))
        elif _router(own, hidden):
            readers.append((own["weight"], 1))   # a router: (experts, hidden) scores of the normed stream
        else:
            raise _refuse(model, f"layer {where} ({type(mod).__name__}) holds parameters the rotation does not know "
                                 f"how to turn")
    if not readers or not writers:
        raise _refuse(model, f"layer {name} has no MLP reading and writing the residual stream (gate / up / down "
                             f"projections)")
    return readers, writers, None if moe else dense_down


def _layout(model: nn.Module) -> _Layout:
    """The Llama-family layout of ``model`` (a Hugging Face causal LM), or ValueError naming what does not fit."""
    names = {id(m): n for n, m in model.named_modules()}
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embed = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    # (subclasses too - Gemma's embedding scales its rows by a constant: the probe below checks the whole function)
    if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear):
        raise _refuse(model, "is not a causal LM with an nn.Embedding input and an nn.Linear head "
                             "(get_input_embeddings / get_output_embeddings): the rotation applies to Llama-family "
                             "decoders")
    config = getattr(model, "config", None)
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) and
             all(hasattr(b, "self_attn") and hasattr(b, "mlp") for b in m)]
    if len(lists) != 1 or config is None:
        raise _refuse(model, "has no single list of decoder layers with self_attn and mlp")
    lname, layers = lists[0]
    hidden = embed.embedding_dim
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else None)
    if not heads or not head_dim:
        raise _refuse(model, "has no num_attention_heads / head_dim in its config")
    blocks = []
    for i, layer in enumerate(layers):
        name = f"{lname}.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        for attr in ("input_layernorm", "post_attention_layernorm"):
            if not hasattr(layer, attr):
                raise _refuse(model, f"layer {name} has no {attr}: the rotation needs pre-norm blocks")
        extra = [f"{name}.{n}" for n, c in layer.named_children()
                 if n not in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
                 and any(p.numel() for p in c.parameters())]
        if extra:
            raise _refuse(model, f"layer {name} holds {', '.join(extra)} beside its attention, MLP and two norms (e.g. "
                                 f"norms after the attention or the MLP): the residual stream cannot be rotated "
                                 f"through it")
        readers, writers, down = _mlp_tensors(model, f"{name}.mlp", mlp, hidden)
        b = _Block(name, layer.input_layernorm, layer.post_attention_layernorm,
                   *(_linear(model, attn, f"{name}.self_attn", a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")),
                   readers, writers, down)
        for lin, side in ((b.q, "in"), (b.k, "in"), (b.v, "in"), (b.o, "out")):
            size = lin.in_features if side == "in" else lin.out_features
            if size != hidden:
                raise _refuse(model, f"layer {names[id(lin)]} has {size} {side}put features, not the hidden size "
                                     f"{hidden}")
        if b.v.out_features != kv_heads * head_dim or b.o.in_features != heads * head_dim:
            raise _refuse(model, f"layer {name}: v_proj / o_proj are not {kv_heads} / {heads} heads of {head_dim}")
        blocks.append(b)
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    norm = getattr(base, "norm", None)
    if norm is None:
        raise _refuse(model, "has no final norm (model.norm) before its head")
    if head.in_features != hidden:
        raise _refuse(model, f"head {names[id(head)]} reads {head.in_features} features, not {hidden}")
    return _Layout(embed, blocks, norm, head, names[id(head)], names.get(id(norm), "the final norm"), hidden, head_dim,
                   heads, kv_heads, tied=head.weight is embed.weight)


# ---------------------------------------------------------------------------------------------------- folding norms

def _norm_scale(model: nn.Module, norm: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the RMSNorm's per-channel scale g, the weight value that makes g = 1): the norm must compute
    g * x / sqrt(mean(x^2) + eps) with g from its ``weight`` (``weight`` itself, or 1 + weight as Gemma's)."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1 or getattr(norm, "bias", None) is not None:
        raise _refuse(model, f"norm {name} ({type(norm).__name__}) is not an RMSNorm with one scale vector: a "
                             f"LayerNorm's mean subtraction and bias do not commute with a rotation")
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(4, w.numel(), generator=gen, dtype=torch.float32) * 3
    x[:, 0] += 20   # an outlier channel: a LayerNorm would move with it
    fed = x.to(w.dtype)
    with torch.no_grad():
        y = norm(fed.to(w.device)).double().cpu()
    xf = fed.double()
    r = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    wd = w.detach().to("cpu", torch.float64)
    rtol = 1e-4 if w.dtype in (torch.float32, torch.float64) else 3 * torch.finfo(w.dtype).eps   # (a few roundings)
    for scale, unit in ((wd, torch.ones_like(wd)), (1 + wd, torch.zeros_like(wd))):
        if torch.allclose(y, r * scale, rtol=rtol, atol=rtol * float(y.abs().max())):
            return scale, unit
    raise _refuse(model, f"norm {name} ({type(norm).__name__}) does not compute weight * x / rms(x) (or (1 + weight) "
                         f"* x / rms(x)): a rotation does not commute with it")


def _set(p: torch.Tensor, value: torch.Tensor) -> None:
    p.data.copy_(value.to(p.device, p.dtype))


def _w(lin: nn.Module) -> torch.Tensor:
    return lin.weight.detach().to("cpu", torch.float64)


# ---------------------------------------------------------------------------------------------------- the stage

def _probe(model: nn.Module, vocab: int, device: torch.device) -> torch.Tensor:
    ids = (torch.arange(1, 17, device=device) * 7919 % max(vocab - 1, 1) + 1)[None, :]
    out = model(input_ids=ids)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.detach().double().cpu()


def rotate(model: nn.Module, config: "Rotate") -> list[str]:
    """Fold the norms and rotate ``model`` in place (see the module docstring); returns what was done, in words."""
    lay = _layout(model)
    norms = [(b.norm1, f"{b.name}.input_layernorm") for b in lay.blocks] + \
            [(b.norm2, f"{b.name}.post_attention_layernorm") for b in lay.blocks]
    scales = {id(n): _norm_scale(model, n, name) for n, name in [*norms, (lay.norm, lay.norm_name)]}
    device = lay.embed.weight.device
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            before = _probe(model, lay.embed.num_embeddings, device)
            gen = torch.Generator().manual_seed(config.seed)
            Q, what = rotation(lay.hidden, config.rotation, gen)
            notes = [f"residual stream: {what}"]
            if lay.tied:   # the embedding takes E Q, the head W diag(g) Q: two matrices from here on
                lay.head.weight = nn.Parameter(lay.head.weight.detach().clone())
                notes.append(f"{lay.head_name} untied from the input embedding (it takes the final norm's scale)")
            if lay.tied or getattr(model.config, "tie_word_embeddings", False):
                _untie_config(model)
            H = None
            if config.heads:   # (drawn right after Q, from the same generator)
                H, what_h = rotation(lay.head_dim, config.rotation, gen)
            dense = [b for b in lay.blocks if b.down is not None]
            hooks = _online_hooks(lay, config.seed) if config.online else {}
            # every tensor is computed whole in float64 from its original values and written once
            _set(lay.embed.weight, _w(lay.embed) @ Q)
            hd = lay.head_dim
            for b in lay.blocks:
                g1, one1 = scales[id(b.norm1)]
                g2, one2 = scales[id(b.norm2)]
                for lin in (b.q, b.k):
                    _set(lin.weight, (_w(lin) * g1[None, :]) @ Q)
                wv = (_w(b.v) * g1[None, :]) @ Q                                  # (kv_heads * hd, hidden)
                wo = Q.T @ _w(b.o)                                                # (hidden, heads * hd)
                if H is not None:   # v per kv head: H^T W; o's columns per head: W H
                    wv = torch.einsum("ji,hjk->hik", H, wv.reshape(lay.kv_heads, hd, -1)).reshape(wv.shape)
                    wo = torch.einsum("ohj,jk->ohk", wo.reshape(lay.hidden, lay.heads, hd), H).reshape(wo.shape)
                    if b.v.bias is not None:
                        bv = b.v.bias.detach().to("cpu", torch.float64).reshape(lay.kv_heads, hd)
                        _set(b.v.bias, (bv @ H).reshape(-1))
                _set(b.v.weight, wv)
                _set(b.o.weight, wo)
                if b.o.bias is not None:
                    _set(b.o.bias, Q.T @ b.o.bias.detach().to("cpu", torch.float64))
                for t, dim in b.readers:   # W diag(g) Q along the hidden dimension
                    _turn(t, dim, Q, g2)
                online = hooks.get(b.down.in_features) if b.down is not None else None
                for t, dim in b.writers:   # Q^T W: each vector along the hidden dimension times Q
                    if online is not None and t is b.down.weight:   # and W R: the input rotated at run time
                        _set(t, online.rotate(Q.T @ _w(b.down)))
                    else:
                        _turn(t, dim, Q)
                _set(b.norm1.weight, one1)
                _set(b.norm2.weight, one2)
                if online is not None:
                    b.down.register_forward_pre_hook(online)
            g, one = scales[id(lay.norm)]
            _set(lay.head.weight, (_w(lay.head) * g[None, :]) @ Q)
            _set(lay.norm.weight, one)
            if H is not None:
                notes.append(f"values and outputs of each head: {what_h}")
            if config.online and dense:
                notes.append(f"down_proj's input at run time: {', '.join(map(repr, set(hooks.values())))}" +
                             (f" (the {len(lay.blocks) - len(dense)} mixture-of-experts MLPs' down projections "
                              f"only in their weights)" if len(dense) < len(lay.blocks) else ""))
            elif config.online:
                notes.append("no online rotation: every MLP is a mixture of experts (their down projections are "
                             "rotated in their weights only)")
            after = _probe(model, lay.embed.num_embeddings, device)
    finally:
        model.train(was)
    err = ((after - before).norm() / before.norm().clamp_min(1e-30)).item()
    dtype = lay.embed.weight.dtype
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    if not math.isfinite(err) or err > tol:
        raise _refuse(model, f"does not compute the same function once rotated (relative change of the logits "
                             f"{err:.2e} > {tol:.0e} on a probe sequence): something in it reads the residual stream "
                             f"other than the layers rotated here")
    notes.append(f"logits before / after on a 16-token probe: relative change {err:.1e}")
    return notes


def _online_hooks(lay: _Layout, seed: int) -> dict[int, OnlineHadamard]:
    """One hook per dense MLP width (shared by the layers of that width)."""
    return {n: OnlineHadamard(n, seed) for n in sorted({b.down.in_features for b in lay.blocks if b.down is not None})}


def _turn(t: torch.Tensor, dim: int, Q: torch.Tensor, g: torch.Tensor | None = None) -> None:
    """``t`` in place: every vector along ``dim`` (the hidden size) times diag(g) (when given), then Q. Fused experts
    (3-D, the hidden size not first) one expert at a time, so the float64 copy is one expert's."""
    if t.dim() == 3 and dim > 0:
        for e in range(t.shape[0]):
            _turn(t[e], dim - 1, Q, g)
        return
    x = t.detach().to("cpu", torch.float64).movedim(dim, -1)
    if g is not None:
        x = x * g
    _set(t, (x @ Q).movedim(-1, dim))


def _untie_config(model: nn.Module) -> None:
    for cfg in (getattr(model, "config", None), getattr(getattr(model, "config", None), "get_text_config",
                                                        lambda: None)()):
        if cfg is not None and getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False


class _RotateHandler(StageHandler):
    def apply(self, model: nn.Module, config: Config, calibration: Sequence) -> str:
        notes = rotate(model, config)   # type: ignore[arg-type]
        untied = [n for n in notes if "untied" in n]
        if untied:
            warnings.warn(f"wb.quant.Rotate: {untied[0]}; the head is stored apart from the embedding from here on",
                          stacklevel=3)
        return "; ".join(notes)

    def skeleton(self, model: nn.Module, config: Config) -> None:
        lay = _layout(model)
        if lay.tied:
            lay.head.weight = nn.Parameter(lay.head.weight.detach().clone())
        _untie_config(model)
        if config.online:   # type: ignore[attr-defined]
            hooks = _online_hooks(lay, config.seed)   # type: ignore[attr-defined]
            for b in lay.blocks:
                if b.down is not None:
                    b.down.register_forward_pre_hook(hooks[b.down.in_features])


@register_config(_RotateHandler(), kind="quant.Rotate")
@dataclass(frozen=True)
class Rotate(Config):
    """Rotate a Llama-family decoder's residual stream (and with ``heads=True`` each head's values) by orthogonal
    matrices fused into the weights, after folding the RMSNorm scales: the same function, fewer outlier channels.
    ``rotation``: "hadamard" (random Hadamard where constructed, else random orthogonal) or "orthogonal";
    ``online``: also rotate ``down_proj``'s input at run time (`OnlineHadamard`; not exportable); ``seed``: the
    random signs / matrices."""

    rotation: str = field(default="hadamard", metadata={"choices": ROTATIONS})
    heads: bool = True
    online: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.rotation not in ROTATIONS:
            raise ValueError(f"Rotate.rotation must be one of {ROTATIONS}, got {self.rotation!r}")
