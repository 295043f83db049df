"""workers=N: data-parallel (DDP, gloo on CPU) fine-tuning gives the single-process result with the same global
batch, hands the weights back to the caller's model, and refuses what cannot be sent to a worker."""
import numpy as np
import pytest
import torch
from torch import nn

import workbench as wb
from workbench import distributed
from workbench.models.architectures import DigitsCNN, DigitsMLP
from workbench.tasks import data


def _accuracy(model, split) -> float:
    with torch.inference_mode():
        return float((model(torch.from_numpy(split.x_test)).argmax(-1).numpy() == split.y_test).mean())


@pytest.mark.parametrize("n, world", [(64, 2), (7, 2), (1, 2), (10, 3)])
def test_shards_partition_the_batch_and_weights_restore_the_global_mean(n, world):
    idx = torch.arange(100, 100 + n)
    losses = torch.rand(n, generator=torch.Generator().manual_seed(n))
    parts = [distributed.shard(idx, (r, world)) for r in range(world)]
    assert sorted(torch.cat([p for p, _ in parts]).tolist()) == idx.tolist()
    # DDP averages the weighted local means over the workers: that must be the global mean
    avg = sum(w * losses[p - 100].mean() for p, w in parts if len(p)) / world
    assert float(avg) == pytest.approx(float(losses.mean()), rel=1e-6)


def test_shard_batch_splits_tensors_and_keyword_inputs():
    b = {"input_ids": torch.arange(12).reshape(6, 2), "attention_mask": torch.ones(6, 2), "flag": True}
    part, w = distributed.shard_batch(b, (1, 2))
    assert part["input_ids"].tolist() == [[2, 3], [6, 7], [10, 11]] and part["flag"] is True and w == 1.0
    (x,), w = distributed.shard_batch((torch.arange(5),), (0, 2))
    assert x.tolist() == [0, 2, 4] and w == pytest.approx(3 * 2 / 5)
    with pytest.raises(ValueError, match="cannot be shared by 3 workers"):
        distributed.shard_batch(torch.zeros(2, 4), (0, 3))


def test_unpicklable_model_gets_a_clear_error_and_stays_untouched():
    model = DigitsMLP()
    model.hook = lambda x: x   # a lambda cannot be pickled to a worker
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"sends the model \(DigitsMLP\).*pickl"):
        wb.training.fit_classifier(model, data.digits(), epochs=1, lr=1e-3, workers=2)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="workers must be a positive int"):
        wb.training.fit_classifier(model, data.digits(), epochs=1, lr=1e-3, workers=0)
    with pytest.raises(ValueError, match="return_optimizer=True needs workers=1"):
        wb.training.fit_classifier(DigitsMLP(), data.digits(), epochs=1, lr=1e-3, workers=2, return_optimizer=True)


class _Worker:
    def __init__(self, alive):
        self.alive, self.terminated, self.joined = alive, False, False

    def is_alive(self):
        return self.alive

    def terminate(self):
        self.terminated, self.alive = True, False

    def join(self, timeout=None):
        self.joined = True


class _Context:
    """Stands in for torch.multiprocessing's ProcessContext: ``join`` raises what a real one would."""
    def __init__(self, error):
        self.error, self.processes = error, [_Worker(True), _Worker(False)]

    def join(self, grace_period=None):
        assert grace_period == distributed._GRACE_S   # the others get time to reach their markers
        raise self.error


def _abort(index=1):
    import torch.multiprocessing as mp
    return mp.ProcessExitedException(f"process {index} terminated with signal SIGABRT", error_index=index,
                                     error_pid=1234, exit_code=-6, signal_name="SIGABRT")


def test_a_worker_failure_is_raised_unless_every_worker_had_finished(tmp_path):
    """`launch` waits through `_join`: a worker dying before the final barrier fails the run; dying after every
    worker passed it (its shutdown) leaves complete weights, kept with a warning naming the worker; an interrupt
    terminates the workers still running."""
    import torch.multiprocessing as mp

    (tmp_path / "done-0").touch()
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        distributed._join(_Context(_abort()), str(tmp_path), workers=2)   # rank 1 never got past the barrier
    (tmp_path / "done-1").touch()
    with pytest.warns(RuntimeWarning, match="worker 1 failed after the run had finished.*SIGABRT"):
        distributed._join(_Context(_abort()), str(tmp_path), workers=2)
    with pytest.raises(mp.ProcessExitedException):
        distributed._join(_Context(_abort()), str(tmp_path), workers=3)   # (a third worker's marker is missing)
    context = _Context(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        distributed._join(context, str(tmp_path), workers=2)
    assert [p.terminated for p in context.processes] == [True, False] and all(p.joined for p in context.processes)


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_workers_equal_one_process_without_batchnorm(strategy):
    """No BatchNorm: the averaged gradient (DDP's all-reduce, FSDP's reduce-scatter) is the global batch's, so the
    runs agree step for step (up to the order of float sums), including the short last batch (1257 % 64 = 41)."""
    split = data.digits()
    runs = []
    for workers in (1, 2):
        torch.manual_seed(0)
        model = DigitsMLP()
        history = wb.training.fit_classifier(model, split, epochs=1, lr=3e-3, batch_size=64, workers=workers,
                                             strategy=strategy, progress=False)
        runs.append((history, model))
    (h1, m1), (h2, m2) = runs
    np.testing.assert_allclose(h2, h1, rtol=1e-4)
    for (k, a), b in zip(m1.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-3, msg=k)
    assert not m2.training
    assert all(type(p) is nn.Parameter for p in m2.parameters())   # plain weights came back, not shards


@pytest.mark.slow   # two DDP worker processes train; the quick tier keeps the BatchNorm-free equivalence
def test_two_worker_digits_cnn_reaches_single_process_accuracy():
    """digits-cnn (BatchNorm: statistics per worker's half batch), 3 epochs from the same init, same global
    batch of 64: the test accuracies agree within 0.5 points (1 test sample is 0.28 points)."""
    split = data.digits()
    acc = {}
    for workers in (1, 2):
        torch.manual_seed(0)
        model = DigitsCNN()
        wb.training.fit_classifier(model, split, epochs=3, lr=3e-3, batch_size=64, workers=workers, progress=False)
        acc[workers] = _accuracy(model, split)
    assert acc[1] > 0.95
    assert abs(acc[2] - acc[1]) <= 0.005 + 1e-9, acc


@pytest.mark.slow   # two DDP worker processes train; the quick tier keeps the BatchNorm-free equivalence
def test_distillation_with_two_workers_matches_one_process():
    split = data.digits()
    teacher = wb.models.load("digits-mlp")
    results = {}
    for workers in (1, 2):
        torch.manual_seed(0)
        student = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        history = wb.distill.fit(student, teacher, split, epochs=2, lr=3e-3, workers=workers, progress=False)
        results[workers] = (history, student)
    (h1, s1), (h2, s2) = results[1], results[2]
    assert list(h2.columns) == ["epoch", "train_loss", "val_accuracy"] and len(h2) == 2
    np.testing.assert_allclose(h2["train_loss"], h1["train_loss"], rtol=1e-4)
    for a, b in zip(s1.parameters(), s2.parameters()):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-3)


@pytest.mark.slow   # two DDP worker processes train; the quick tier keeps the BatchNorm-free equivalence
def test_qat_fine_tuning_with_two_workers_matches_one_process_and_converts():
    """The QAT loop is fit_classifier on a wb.qat.prepare'd copy: fake quantization with learnable scales trains
    under DDP (scales are parameters, averaged like weights) and converts to real int4 layers."""
    split = data.digits()
    plan = wb.Plan({"fc*": wb.quant.WeightOnly(bits=4, group_size=32)})
    runs = {}
    for workers in (1, 2):
        qmodel = wb.qat.prepare(wb.models.load("digits-mlp"), plan, learnable_scales=True)
        history = wb.training.fit_classifier(qmodel, split, epochs=1, lr=1e-3, workers=workers, progress=False)
        runs[workers] = (history, qmodel)
    # a float-order difference can flip a fake-quantized value to the next level: slightly looser than above
    np.testing.assert_allclose(runs[2][0], runs[1][0], rtol=2e-3)
    for (k, a), b in zip(runs[1][1].state_dict().items(), runs[2][1].state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-2, msg=k)
    assert _accuracy(wb.qat.convert(runs[2][1]), split) > 0.95


@pytest.mark.slow   # two DDP worker processes train; the quick tier keeps the BatchNorm-free equivalence
def test_embedding_distillation_with_two_workers_matches_one_process():
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    g = torch.Generator().manual_seed(1)
    task = wb.tasks.Fidelity(teacher, torch.randn(40, 16, generator=g), calibration=torch.randn(48, 16, generator=g))
    runs = {}
    for workers in (1, 2):
        torch.manual_seed(2)
        student = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        history = wb.distill.fit_embeddings(student, teacher, task, epochs=2, lr=1e-2, n=48, batch_size=8,
                                            workers=workers, progress=False)
        runs[workers] = (history, student)
    np.testing.assert_allclose(runs[2][0]["train_loss"], runs[1][0]["train_loss"], rtol=1e-4)
    assert runs[2][0]["train_loss"].iloc[-1] < runs[2][0]["train_loss"].iloc[0]
    for a, b in zip(runs[1][1].parameters(), runs[2][1].parameters()):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-3)


def test_fsdp_shards_each_block_then_the_model(monkeypatch):
    """`shard_model` in a one-process gloo group: every block of tiny-lm's ModuleList and the model become FSDP
    modules whose parameters are sharded DTensors, and the forward still computes the same logits."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from workbench.models.architectures import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=32, n_layer=2, dropout=0.0)).eval()
    x = torch.randint(0, 32, (2, 16))
    with torch.no_grad():
        want = model(x)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(distributed._free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        distributed.shard_model(model)
        assert all(isinstance(b, FSDPModule) for b in model.h) and isinstance(model, FSDPModule)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        with torch.no_grad():
            torch.testing.assert_close(model(x), want)
        assert set(distributed._full_state(model)) == set(TinyLM(TinyLMConfig(vocab_size=32, n_layer=2)).state_dict())
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="strategy must be one of"):
        wb.training.fit_classifier(DigitsMLP(), data.digits(), epochs=1, lr=1e-3, strategy="zero")


@pytest.mark.slow   # two FSDP worker processes train
def test_fsdp_digits_cnn_reaches_single_process_accuracy_and_lm_embedding_distillation_matches():
    split = data.digits()
    acc = {}
    for workers in (1, 2):
        torch.manual_seed(0)
        model = DigitsCNN()
        wb.training.fit_classifier(model, split, epochs=3, lr=3e-3, batch_size=64, workers=workers,
                                   strategy="fsdp", progress=False)
        acc[workers] = _accuracy(model, split)
    assert acc[1] > 0.95 and abs(acc[2] - acc[1]) <= 0.005 + 1e-9, acc
    # distillation validates after every epoch (a forward without gradients): training goes on after it
    teacher = wb.models.load("digits-mlp")
    histories = {}
    for workers in (1, 2):
        torch.manual_seed(0)
        student = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        histories[workers] = wb.distill.fit(student, teacher, split, epochs=3, lr=3e-3, workers=workers,
                                            strategy="fsdp", patience=None, progress=False)
    np.testing.assert_allclose(histories[2]["train_loss"], histories[1]["train_loss"], rtol=1e-4)
    assert histories[2]["train_loss"].is_monotonic_decreasing
    # a model with blocks (tiny-lm's ModuleList: one shard group per block), distilled on its logits
    from workbench.models.architectures import TinyLM, TinyLMConfig

    cfg = TinyLMConfig(vocab_size=32, n_layer=2, dropout=0.0)
    torch.manual_seed(0)
    teacher = TinyLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    task = wb.tasks.Fidelity(teacher, torch.randint(0, 32, (8, 16), generator=g),
                             calibration=torch.randint(0, 32, (16, 16), generator=g))
    runs = {}
    for workers in (1, 2):
        torch.manual_seed(2)
        student = TinyLM(cfg)
        history = wb.distill.fit_embeddings(student, teacher, task, epochs=2, lr=1e-3, n=16, batch_size=4,
                                            workers=workers, strategy="fsdp", progress=False)
        runs[workers] = (history, student)
    np.testing.assert_allclose(runs[2][0]["train_loss"], runs[1][0]["train_loss"], rtol=1e-4)
    for a, b in zip(runs[1][1].parameters(), runs[2][1].parameters()):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("loss, strategy", [("forward_kl", "ddp"), ("sequence", "ddp"),
                                            pytest.param("reverse_kl", "fsdp", marks=pytest.mark.slow)])
def test_lm_distillation_with_two_workers_matches_one_process(loss, strategy):
    """`wb.distill.fit_lm(workers=2)`: each global batch of windows (or teacher sequences) is split between the
    workers; the losses step for step and the trained student equal one process's."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=56, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                           max_position_embeddings=32, pad_token_id=0)).eval()
    rng = np.random.default_rng(0)
    texts = [" ".join(str(int(v)) for v in rng.integers(1, 64, size=60)) for _ in range(10)]
    task = wb.tasks.CausalLM(texts, lambda s: [int(v) for v in s.split()], block_size=12)
    runs = {}
    for workers in (1, 2):
        torch.manual_seed(2)
        student = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))   # no dropout
        history = wb.distill.fit_lm(student, teacher, task, loss=loss, steps=6, lr=1e-2, batch_size=4,
                                    sequences=8, prompt_tokens=4, workers=workers, strategy=strategy,
                                    progress=False)
        runs[workers] = (history, student)
    np.testing.assert_allclose(runs[2][0]["loss"], runs[1][0]["loss"], rtol=1e-4)
    for a, b in zip(runs[1][1].parameters(), runs[2][1].parameters()):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-3)
    with pytest.raises(ValueError, match="batch_size=1 cannot be shared by 2 workers"):
        wb.distill.fit_lm(student, teacher, task, batch_size=1, workers=2, progress=False)
