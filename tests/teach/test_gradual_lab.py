"""Lab 21's exercise checks (workbench.teach.gradual): each rejects a plausible wrong implementation with its
specific hint and accepts the worked solution; the expected values come from the package where it has them."""
import pandas as pd
import pytest
import torch

from workbench import teach
from workbench.pruning import masks
from workbench.pruning.oneshot import sparsegpt_prune
from workbench.teach import gradual as G


def _worked(checker, *args, **kwargs):
    teach.use_solutions(True)
    try:
        return checker(..., *args, **kwargs)
    finally:
        teach.use_solutions(False)


def _layer(seed=0, N=12, K=32, tokens=96):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g)
    X = torch.randn(tokens, K, generator=g) * torch.linspace(0.2, 5.0, K)   # channels of different sizes
    return W, X


def test_schedule_rejects_a_linear_and_a_slow_start_schedule():
    fb = G.check_schedule([0.9 * t / 5 for t in range(1, 6)], 0.9, 5)
    assert fb.status == "failed" and "linear" in fb.hint
    fb = G.check_schedule([0.9 * (t / 5) ** 3 for t in range(1, 6)], 0.9, 5)
    assert fb.status == "failed" and "opposite" in fb.hint
    fb = _worked(G.check_schedule, 0.9, 5)
    assert fb.passed and fb.answer[-1] == pytest.approx(0.9)


def test_magnitude_mask_rejects_ranking_signed_weights():
    W, _ = _layer()
    signed = torch.ones(W.numel(), dtype=torch.bool)
    signed[W.flatten().argsort(stable=True)[:round(0.75 * W.numel())]] = False
    fb = G.check_magnitude_mask(signed.reshape(W.shape), W, 0.75)
    assert fb.status == "failed" and "|w|" in fb.hint
    assert _worked(G.check_magnitude_mask, W, 0.75).passed


def test_wanda_scores_reject_mean_abs_activations():
    W, X = _layer()
    fb = G.check_wanda_scores(W.abs() * X.abs().mean(0), W, X)
    assert fb.status == "failed" and "AWQ" in fb.hint
    assert _worked(G.check_wanda_scores, W, X).passed


def test_wanda_mask_rejects_one_ranking_over_the_whole_matrix():
    W, X = _layer()
    scores = W.abs() * X.norm(dim=0)
    flat = torch.ones(W.numel(), dtype=torch.bool)
    flat[scores.flatten().argsort(stable=True)[:W.numel() // 2]] = False
    fb = G.check_wanda_mask(flat.reshape(W.shape), W, X, 0.5)
    assert fb.status == "failed" and "every output row" in fb.hint
    fb = _worked(G.check_wanda_mask, W, X, 0.5)
    assert fb.passed and bool((fb.answer.sum(1) == W.shape[1] // 2).all())


def test_nm_mask_rejects_groups_down_the_output_rows():
    W, X = _layer()
    S = W.abs() * X.norm(dim=0)
    fb = G.check_nm_mask(masks.nm_mask(S.T.contiguous(), 2, 4).T, S)
    assert fb.status == "failed" and "output rows" in fb.hint
    fb = _worked(G.check_nm_mask, S)
    assert fb.passed and bool((fb.answer.reshape(-1, 4).sum(1) == 2).all())


def test_obs_update_rejects_the_wrong_sign_and_moves_only_the_rows_that_lost_a_weight():
    W, X = _layer()
    ex = G.obs_example(W, X, rows=8, cols=6)
    removed = ex.W[:, 0] * ~ex.keep0
    fb = G.check_obs_update(ex.W[:, 1:] + torch.outer(removed / ex.U[0, 0], ex.U[0, 1:]), ex)
    assert fb.status == "failed" and "sign" in fb.hint
    fb = _worked(G.check_obs_update, ex)
    assert fb.passed and fb.answer.shape == (8, 5)
    kept_rows = ex.keep0.nonzero().flatten()                      # a kept weight passes no error on
    assert torch.equal(fb.answer[kept_rows], ex.W[kept_rows, 1:])


def test_obs_saliency_rejects_an_unsquared_diagonal():
    W, X = _layer()
    ex = G.obs_example(W, X)
    fb = G.check_obs_saliency(ex.W.pow(2) / torch.diag(ex.U), ex)
    assert fb.status == "failed" and "square the diagonal" in fb.hint
    assert _worked(G.check_obs_saliency, ex).passed


def test_24_bytes_reject_forgetting_the_metadata_and_match_semistructured_storage():
    fb = G.check_24_bytes(64 * 128 // 2 * 2, 64, 128)
    assert fb.status == "failed" and "metadata" in fb.hint
    fb = _worked(G.check_24_bytes, 64, 128)
    assert fb.passed and fb.answer == G.bytes_24(64, 128) == 64 * 128 * 2 * 9 // 16


def test_24_ceiling_rejects_the_math_ceiling():
    sparse = G.bytes_24(64, 128)
    fb = G.check_24_ceiling(2.0, 64, 128, sparse)
    assert fb.status == "failed" and "math ceiling" in fb.hint
    fb = _worked(G.check_24_ceiling, 64, 128, sparse)
    assert fb.passed and fb.answer == pytest.approx(16 / 9)


def test_best_pruner_rejects_a_method_that_measured_worse():
    table = pd.DataFrame({"50%": [150.0, 148.0, 144.0], "2:4": [181.0, 170.0, 146.0]},
                         index=["magnitude", "wanda", "sparsegpt"])
    fb = G.check_best_pruner("wanda", table, "2:4")
    assert fb.status == "failed" and "wanda measured 170.00" in fb.hint
    assert _worked(G.check_best_pruner, table, "2:4").passed


def test_layer_errors_use_the_package_and_sparsegpt_fits_its_calibration_tokens_best():
    W, X = _layer(K=64, tokens=256)
    X_held = _layer(seed=1, K=64, tokens=128)[1]
    table = G.layer_errors(W, X, X_held, 0.5).set_index(["method", "pattern"])["calibration tokens"]
    for kind in ("50%", "2:4"):
        assert table[("sparsegpt", kind)] < table[("magnitude", kind)]
    W_hat = sparsegpt_prune(W, [(X,)], nm=(2, 4))[0]
    assert bool(((W_hat != 0).reshape(-1, 4).sum(1) <= 2).all())


def test_2_4_timing_is_a_side_by_side_table_of_three_layers():
    timing = G.time_24(32, 64, batches=(1,), rounds=2, threads=1)
    assert list(timing["layer"]) == ["dense", "2:4 mask, dense storage", "2:4 storage (SemiStructuredLinear)"]
    assert timing["speedup vs dense"].iloc[0] == 1.0 and bool((timing["median ms"] > 0).all())
