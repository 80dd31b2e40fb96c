"""The lab's parts of the reference's properties: the compiled GPU passes (lab/fused.py) bitwise
against tim_rl's eager paths, the TRL adapter's weights, and the lab's copy-ready statistics run
from their own source (test_tim_rl's copy-test, with experiments.py among its modules)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import FP32_ATOL

import test_tim_rl as teach
import tim_rl as tr
from lab import experiments as ex
from lab import fused, trl_adapter


def _chi2_per_dof(values: torch.Tensor, bins: int = 256) -> float:
    counts = torch.bincount(values, minlength=bins).double()
    expected = values.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum()) / (bins - 1)


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 1])
def test_hash_noise_is_uniform_on_16_bits(seed):
    noise = fused.hash_noise16((1 << 20,), torch.tensor(seed, dtype=torch.int32))
    assert noise.dtype == torch.int32 and int(noise.min()) >= 0 and int(noise.max()) < 1 << 16
    # high byte and low byte each uniform over 256 bins: chi2/dof ~ 1 +- 0.09 for 2^20 draws
    assert _chi2_per_dof(noise >> 8) < 1.5 and _chi2_per_dof(noise & 255) < 1.5
    # anti-vacuity: the same check rejects noise that misses its top bit (i.e. a biased rounding)
    assert _chi2_per_dof((noise & 0x7FFF) >> 8) > 10
    other = fused.hash_noise16((1 << 20,), torch.tensor(seed ^ 1, dtype=torch.int32))
    assert float((noise == other).double().mean()) < 1e-3, "another seed, other noise"


@pytest.mark.parametrize("compile_", [False, True])
def test_fused_stochastic_round_equals_the_reference_with_its_noise(compile_):
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.randn(5000, generator=g) * 10.0 ** torch.randint(-40, 38, (5000,), generator=g),
            torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-45, 3.4e38]),
            torch.tensor([-1], dtype=torch.int32).view(torch.float32),
        ]
    )  # a NaN that overflows int32
    x = x.reshape(8, -1)  # (8, 626): a 2-D parameter
    out = fused.stochastic_round_bf16_fused(x, seed=123, compile=compile_)
    ref = tr.stochastic_round_bf16(
        x,
        noise=fused.hash_noise16(
            tuple(x.reshape(-1).shape), torch.tensor(123, dtype=torch.int32)
        ).reshape(x.shape),
    )
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), "bit for bit, NaNs included"


def test_fused_stochastic_round_is_unbiased_rtn_is_not():
    x = torch.full((1 << 20,), 1.0 + 2.0**-9)  # a quarter of a bf16 cell (2^-7) above 1
    means = [
        float(fused.stochastic_round_bf16_fused(x, seed=s, compile=False).double().mean())
        for s in range(4)
    ]
    sd = 2.0**-7 * math.sqrt(0.25 * 0.75 / x.numel())
    assert all(abs(m - (1.0 + 2.0**-9)) < 5 * sd for m in means)
    assert float(tr.round_nearest_bf16(x).double().mean()) == 1.0, "RTN: the quarter cell is gone"


@pytest.mark.parametrize("compile_", [False, True])
def test_fused_error_feedback_equals_the_reference_bit_for_bit(compile_):
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.randn(5000, generator=g) * 10.0 ** torch.randint(-40, 38, (5000,), generator=g),
            torch.tensor(
                [math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-45, 3.4e38, 3.39e38, -3.39e38]
            ),
            torch.tensor([-1], dtype=torch.int32).view(torch.float32),
        ]
    )  # a NaN that overflows int32
    residual = torch.randn(x.shape, generator=g) * 10.0 ** torch.randint(
        -45, -3, x.shape, generator=g
    )
    residual = torch.nan_to_num(
        residual * x.abs().clamp(max=1e30), nan=0.0
    )  # residuals near the cell sizes
    residual[:3] = torch.tensor(
        [math.inf, -math.inf, 3.4e38]
    )  # inf - inf, and a finite sum that overflows
    x, residual = x.reshape(10, -1), residual.reshape(10, -1)  # (10, 501): a 2-D parameter
    for _ in range(2):  # the second export feeds the first one's residual back
        served, new = fused.error_feedback_round_bf16_fused(x, residual, compile=compile_)
        ref_served, ref_new = tr.error_feedback_round_bf16(x, residual)
        assert (
            served.shape == x.shape
            and served.dtype == torch.bfloat16
            and new.dtype == torch.float32
        )
        assert torch.equal(served.view(torch.int16), ref_served.view(torch.int16)), (
            "served, NaNs included"
        )
        assert torch.equal(new.view(torch.int32), ref_new.view(torch.int32)), "residual"
        assert (new != 0).float().mean() > 0.5, "anti-vacuity: the residual is not dropped"
        residual = new


def test_token_logprobs_compiled_pass_matches_log_softmax_and_its_gradient():
    """The GPU path (one torch.compile'd pass per chunk, forward and backward) forced on the CPU on
    small inputs: the values and gradient of log_softmax + gather, grad and no-grad bitwise equal,
    over several chunks."""
    g = torch.Generator().manual_seed(0)
    logits, ids = (
        torch.randn(6, 5, 96, generator=g) * 8,
        torch.randint(0, 96, (6, 5, 3), generator=g),
    )
    upstream = torch.randn(6, 5, 3, generator=g)
    for dtype, atol in (
        (torch.float32, FP32_ATOL),
        (torch.bfloat16, 1e-2),
    ):  # bf16: one bf16 rounding of the grad
        leaf = logits.to(dtype).requires_grad_(True)
        with torch.no_grad():
            plain = fused.token_logprobs(leaf, ids, chunk_rows=7)
        ours = fused.token_logprobs(leaf, ids, chunk_rows=7)
        ref = torch.log_softmax(leaf.float(), -1).gather(-1, ids)
        assert torch.equal(plain, ours.detach()) and torch.allclose(ours, ref, atol=FP32_ATOL)
        (grad,) = torch.autograd.grad((ours * upstream).sum(), leaf)
        (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), leaf)
        assert grad.dtype == dtype and torch.allclose(grad.float(), ref_grad.float(), atol=atol)
    assert fused._logprobs_pass in fused._COMPILED, "anti-vacuity: the compiled passes ran"
    x = (
        logits[0].clone().requires_grad_(True)
    )  # anti-vacuity: the same check sees a backward with a wrong lse
    (ref0,) = torch.autograd.grad(
        (torch.log_softmax(x, -1).gather(-1, ids[0]) * upstream[0]).sum(), x
    )
    wrong = fused._logprobs_grad_pass(
        logits[0], ids[0], torch.zeros(5, 1), torch.zeros(5, 1), upstream[0]
    )
    assert not torch.allclose(wrong, ref0, atol=1e-3)


@pytest.mark.parametrize("compiled", [False, True])
def test_token_logprobs_gradient_is_exact_at_any_row_offset(monkeypatch, compiled):
    """Rows shifted by -1e4 .. -1e7, +1e6, a row of finfo.min, and finfo.min-masked rows: the
    gradient within 1e-3 relative L1 of autograd's log_softmax (fp32) on every row, eager and fused
    (its passes run eagerly here); the forward bitwise that of today's formula (log_softmax +
    gather; the fused pass's gather - logsumexp)."""
    monkeypatch.setattr(fused, "_compiled", lambda fn: fn)
    g = torch.Generator().manual_seed(0)
    V = 300
    tiny = torch.finfo(torch.float32).min
    rows = [
        torch.randn(V, generator=g) * 3 + offset for offset in (0.0, -1e4, -1e5, -1e6, -1e7, 1e6)
    ]
    rows += [
        torch.full((V,), tiny),
        torch.randn(V, generator=g).masked_fill(torch.arange(V) % 3 > 0, tiny),
    ]
    logits = torch.stack(rows)  # (8, V)
    ids = torch.randint(0, V, (len(rows), 2), generator=g)
    upstream = torch.randn(ids.shape, generator=g)
    leaf = logits.clone().requires_grad_(True)
    ours = (fused.token_logprobs if compiled else tr.token_logprobs)(leaf, ids)
    (grad,) = torch.autograd.grad((ours * upstream).sum(), leaf)
    ref_leaf = logits.clone().requires_grad_(True)
    ref = torch.log_softmax(ref_leaf, -1).gather(-1, ids)
    (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), ref_leaf)
    rel_l1 = (grad - ref_grad).abs().sum(-1) / ref_grad.abs().sum(-1)
    assert torch.isfinite(grad).all() and rel_l1.max() <= 1e-3, rel_l1
    today = (
        logits.gather(-1, ids) - torch.logsumexp(logits, -1, keepdim=True)
        if compiled
        else ref.detach()
    )
    assert torch.equal(ours.detach(), today)
    # anti-vacuity: the gradient from the rounded logsumexp alone (exp(z - lse)) is far off on these
    # rows
    lse = torch.logsumexp(logits, -1, keepdim=True)
    rounded = torch.zeros_like(logits).scatter_add(-1, ids, upstream) - torch.exp(
        logits - lse
    ) * upstream.sum(-1, True)
    assert ((rounded - ref_grad).abs().sum(-1) / ref_grad.abs().sum(-1)).max() > 0.1


@pytest.mark.parametrize("name", ["rs", "rs_seq_max", "rs_seq_mean", "rs_seq_sum", "tis_sn"])
def test_trl_adapter_carries_the_fixed_2026_weights(name):
    g = torch.Generator().manual_seed(0)
    p_old = -torch.rand(3, 4, generator=g)
    q = p_old + 0.1 * torch.randn(3, 4, generator=g)
    q[1, 2] = math.nan  # a position vLLM gave no log-prob
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    own = tr.RS_ARMS.get(name) or (
        lambda a, b, m: tr.self_normalize_weights(tr.tis_weights(a, b, m), m)
    )
    assert torch.equal(trl_adapter.trl_weights(name, p_old, q, mask), own(p_old, q, mask.bool()))


# ---- the lab's copy-ready statistics, run from their source alone ----

LAB_COPY_CALLS = {
    "student_t_quantile": lambda f: f(0.975, 4),
    "paired_ci": lambda f: f([0.1, 0.2, -0.05]),
    "student_t_cdf": lambda f: f(2.0, 4),
    "paired_p": lambda f: f([0.1, 0.2, -0.05]),
    "holm": lambda f: f({"a": 0.01, "b": 0.04, "c": math.nan}),
    "paired_p_batch": lambda f: f(
        torch.tensor([[0.1, 0.2, -0.05], [0.3, 0.1, 0.2]])
    ),  # (nan != nan in ==)
    "fixed_sequence": lambda f: f(torch.tensor([0.001, 0.04, 0.03, 0.002])),
    "bh_adjusted": lambda f: f(torch.tensor([[0.01, 0.04, 0.03, 0.5]])),
}


@pytest.mark.parametrize("name", sorted(LAB_COPY_CALLS))
def test_lab_statistic_runs_from_its_source_and_needs_alone(monkeypatch, name):
    monkeypatch.setattr(teach, "HOMES", (ex,))
    monkeypatch.setattr(teach, "_copy_calls", lambda: LAB_COPY_CALLS)
    teach.test_function_runs_from_its_source_and_needs_alone(name)


def test_every_lab_statistic_is_copy_tested():
    import inspect

    lab = {
        n
        for n, f in vars(ex).items()
        if inspect.isfunction(f) and f.__module__ == ex.__name__ and "needs:" in (f.__doc__ or "")
    }  # the lab's statistics (paired_ci, holm, ...)
    assert lab and lab <= set(LAB_COPY_CALLS), (
        "the lab's copy-ready statistics are run from their source too"
    )


def test_fused_arguments_on_two_devices_are_a_value_error_naming_both():
    a, meta = torch.zeros(2, 3), torch.zeros(2, 3, device="meta")
    with pytest.raises(ValueError, match=r"(on meta.*on cpu|on cpu.*on meta)"):
        fused.error_feedback_round_bf16_fused(a, meta, compile=False)


def test_the_factory_watch_sees_no_host_tensor_in_the_hash():
    from conftest import HostFactoryWatch

    with HostFactoryWatch(files=(fused.__file__,)) as watch:
        fused.hash_noise16((4, 5), torch.tensor(7, dtype=torch.int32))
    assert watch.found == []
    with HostFactoryWatch(
        files=(teach.__file__,)
    ) as watch:  # anti-vacuity: the planted CPU-built index
        teach._old_hash_noise16((4, 5), torch.tensor(7, dtype=torch.int32))
    assert watch.found
