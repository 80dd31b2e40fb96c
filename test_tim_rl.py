"""Tests for tim_rl's teaching properties, as lessons a learner reads in this order: exact
properties by enumeration and Hypothesis (each paired with an anti-vacuity twin that shows the
property is not trivially true), then misuse and non-finite inputs, each correction's weight on a
hand-made batch, the copy-ready functions run from their own source, the verifier, the 2026
corrections and the mismatch doctor's statistics. The pipeline, engine, CLI, lab and notebook tests
are test_pipeline.py's; what both files use is conftest.py's. Run: `pytest -q` (profile `ci`,
derandomised, is the default; `HYPOTHESIS_PROFILE=dev` explores more)."""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tim_rl as tr

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tolerances, each with its reason.
FP32_ATOL = 1e-5  # token_logprobs against log_softmax in float32 (V up to 1000, logits up to 30)
EXPECT_ATOL = 1e-6  # expectations of float32 gradients summed over <= 8 outcomes of magnitude <= 4
N_NOISE = 1 << 16  # every stochastic-rounding draw

# ---- corrections in the RL step: each arm's per-token weight on a hand-made batch ----


def _arm_weights(correction, logp_now, logp_prox, logp_old, logp_infer, adv, **cfg):
    """effective_token_weights of the arm's loss (plus --k2-coef's term), composed as
    update_on_batch does, on a hand-made (B, 1) batch (K = V = 2 top-k for SC)."""
    cfg = tr.RLConfig(correction=correction, **cfg)
    mask = torch.ones_like(logp_now, dtype=torch.bool)
    logp = logp_now.clone().requires_grad_(True)
    x = tr.LossInputs(
        logp,
        logp.detach(),
        logp_prox,
        logp_old,
        logp_infer,
        logp[..., None],
        logp_infer[..., None],
        adv,
        mask,
    )
    loss = tr.ARMS[correction].loss(cfg, x)
    if cfg.k2_coef > 0:
        loss = loss + tr.k2_penalty(logp, logp_infer, mask, cfg.k2_coef)
    return tr.effective_token_weights(loss, logp, adv, mask)


# ---- device-following: what a function builds on the host ----

_FACTORIES = {
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.tensor,
    torch.as_tensor,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.empty_strided,
    torch.normal,
}


class HostFactoryWatch(torch.overrides.TorchFunctionMode):
    """Records each non-scalar tensor a torch factory builds without an explicit device=, and each
    .cpu() copy, called from `files`: on a GPU such a tensor lands on the CPU (a crash when mixed
    with the inputs, or a host copy)."""

    def __init__(self, files=(tr.__file__,)):
        super().__init__()
        self.files, self.found = set(files), []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import sys

        out = func(*args, **(kwargs or {}))
        built = (
            func in _FACTORIES
            and "device" not in (kwargs or {})
            and isinstance(out, torch.Tensor)
            and out.dim()
        )
        if built or func is torch.Tensor.cpu:  # a tensor built on the host, or one copied there
            frame = sys._getframe(1)
            while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back  # the first caller outside torch itself
            if frame is not None and frame.f_code.co_filename in self.files:
                self.found.append(
                    f"{func.__name__} in {frame.f_code.co_name} (line {frame.f_lineno})"
                )
        return out


# ---- the mismatch doctor: hand-made tensors ----


def _doctor_tensors(B=128, T=6, V=12, seed=0, tau=1.0, top_k=0, noise=0.0, full=False):
    """Tokens sampled from a sampler q over V ids (its logits z / tau + noise, renormalised on its
    top_k when given) and the trainer's p = softmax(z) at them: (logp_train, logp_infer, mask), rows
    of 3..T tokens, and with `full` the trainer's log-probs of every id (B, T, V)."""
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(B, T, V, generator=g)  # (B, T, V)
    q_logits = z / tau + noise * torch.randn(B, T, V, generator=g)
    if top_k:
        q_logits = q_logits.masked_fill(
            q_logits < q_logits.topk(top_k, -1).values[..., -1:], -math.inf
        )
    logq = q_logits.log_softmax(-1)
    ids = torch.multinomial(logq.exp().reshape(-1, V), 1, generator=g).reshape(B, T, 1)
    mask = torch.arange(T) < torch.randint(3, T + 1, (B, 1), generator=g)  # (B, T)
    out = z.log_softmax(-1).gather(-1, ids)[..., 0], logq.gather(-1, ids)[..., 0], mask
    return (*out, z.log_softmax(-1)) if full else out


# ---- strategies (bounded floats; names carry shapes) ----

finite_fp32 = st.floats(
    min_value=-(2.0**127),
    max_value=2.0**127,
    allow_nan=False,
    allow_infinity=False,
    allow_subnormal=True,
    width=32,
)
subnormal_fp32 = st.floats(
    min_value=-(2.0**-126), max_value=2.0**-126, allow_subnormal=True, width=32
)
logit = st.floats(min_value=-4.0, max_value=4.0, allow_nan=False, width=32)


@st.composite
def logits_pq_V(draw, min_v=2, max_v=8):
    """Logits of two different categorical distributions p (trainer) and q (sampler) over V <= 8
    tokens."""
    V = draw(st.integers(min_v, max_v))
    zp = torch.tensor(draw(st.lists(logit, min_size=V, max_size=V)), dtype=torch.float64)
    zq = torch.tensor(draw(st.lists(logit, min_size=V, max_size=V)), dtype=torch.float64)
    return zp, zq


@st.composite
def logps_BT(draw, max_b=4, max_t=6, low=-8.0):
    """(logp_old, logp_infer, mask) with B <= 4, T <= 6, log-probs in [low, 0], at least one masked
    token."""
    B, T = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    lp = st.floats(min_value=low, max_value=0.0, allow_nan=False, width=32)
    a = torch.tensor(draw(st.lists(lp, min_size=B * T, max_size=B * T))).view(B, T)
    b = torch.tensor(draw(st.lists(lp, min_size=B * T, max_size=B * T))).view(B, T)
    lengths = draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return a, b, mask


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above |x| (truncation and one cell away from zero), as
    float64."""
    low_bits = x.view(torch.int32) & ~0xFFFF
    return low_bits.view(torch.float32).double(), (low_bits + 0x10000).view(torch.float32).double()


def bf16_cell(x: torch.Tensor) -> torch.Tensor:
    lo, hi = bf16_neighbours(x)
    return (hi - lo).abs()


def all_noise(shape) -> torch.Tensor:
    """(65536, *shape) int32: every possible stochastic-rounding draw, the same for every element.
    """
    return (
        torch.arange(N_NOISE, dtype=torch.int32)
        .view(-1, *([1] * len(shape)))
        .expand(N_NOISE, *shape)
        .contiguous()
    )


# ==================================================================================================
# 1. stochastic rounding is exactly unbiased; round-to-nearest is not


@given(st.lists(st.one_of(finite_fp32, subnormal_fp32), min_size=1, max_size=4))
def test_stochastic_round_is_exactly_unbiased(values):
    x = torch.tensor(values, dtype=torch.float32)
    xs = x.expand(N_NOISE, -1).contiguous()
    out = tr.stochastic_round_bf16(xs, noise=all_noise(x.shape)).double()  # (65536, n)
    # Exact in float64: 2^16 bf16 values need 8 + 16 < 53 mantissa bits, and the division is by a
    # power of two.
    assert torch.equal(out.mean(dim=0), x.double())
    lo, hi = bf16_neighbours(x)
    assert ((out == lo) | (out == hi)).all(), "every draw must be one of the two bf16 neighbours"


def test_stochastic_round_non_finite_pass_through():
    x = torch.tensor([math.inf, -math.inf, math.nan, 1.0])
    noise = torch.full((4,), 0xFFFF, dtype=torch.int32)
    out = tr.stochastic_round_bf16(x, noise=noise).float()
    assert out[0] == math.inf and out[1] == -math.inf and math.isnan(out[2]) and out[3] == 1.0
    # a NaN whose payload would overflow the int32 addition still comes back NaN
    weird_nan = torch.tensor([-1], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(tr.stochastic_round_bf16(weird_nan, noise=noise[:1]).float()).all()


def _chi2_per_dof(values: torch.Tensor, bins: int = 256) -> float:
    counts = torch.bincount(values, minlength=bins).double()
    expected = values.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum()) / (bins - 1)








@given(
    st.floats(min_value=2.0**-100, max_value=2.0**100, width=32),
    st.integers(1, (1 << 15) - 1),
    st.sampled_from([1.0, -1.0]),
)
def test_rtn_loses_subhalf_cell_update_sr_keeps_it(w, k, sign):
    """Anti-vacuity twin: a master on the bf16 grid moved by less than half a cell."""
    master = torch.tensor([w], dtype=torch.float32).to(torch.bfloat16).float() * sign  # on the grid
    fp32_ulp = bf16_cell(master) / (1 << 16)
    # k fp32 ulps away from zero, exact in fp32
    updated = (master.double() + sign * k * fp32_ulp).float()
    assert float((updated.double() - master.double()).abs()) < 0.5 * float(bf16_cell(master))
    assert torch.equal(tr.round_nearest_bf16(updated).float(), master), "RTN swallows the update"
    sr = tr.stochastic_round_bf16(
        updated.expand(N_NOISE).contiguous(), noise=all_noise(())
    ).double()
    assert float(sr.mean() - master.double()) == float(updated.double() - master.double())


def test_stochastic_round_generator_is_reproducible_and_random():
    x = torch.full((4096,), 1.0 + 2.0**-10)  # 1/8 of a bf16 cell above 1
    a = tr.stochastic_round_bf16(x, generator=torch.Generator().manual_seed(0))
    b = tr.stochastic_round_bf16(x, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    up = (a.float() > 1).double().mean()
    assert 0.09 < float(up) < 0.16, "rounds up about 1/8 of the time"


# ==================================================================================================
# 2. error feedback keeps the running sum


@given(
    st.floats(min_value=-10.0, max_value=10.0, width=32),
    st.lists(
        st.floats(min_value=-(2.0**-10), max_value=2.0**-10, width=32), min_size=1, max_size=60
    ),
)
def test_error_feedback_running_sum(start, steps):
    master = torch.tensor([start], dtype=torch.float32)
    residual = torch.zeros(1)
    sum_master = sum_served = 0.0
    # the only inexact operation is the fp32 addition master + residual: half an fp32 ulp each step
    slop = 0.0
    for dx in steps:
        master = master + dx
        target = master + residual
        served, residual = tr.error_feedback_round_bf16(master, residual)
        assert float(residual.abs()) <= 0.5 * float(bf16_cell(target)), "residual below half a cell"
        sum_master += float(master.double())
        sum_served += float(served.double())
        slop += 0.5 * float(bf16_cell(target)) / (1 << 16)
        assert abs(sum_served - sum_master) <= 0.5 * float(bf16_cell(target)) + slop


def test_error_feedback_vs_rtn_on_constant_offgrid_master():
    """Anti-vacuity twin: RTN's running sum drifts linearly, error feedback's stays bounded."""
    master = torch.tensor([1.0 + 2.0**-10])  # 1/8 cell above the grid point 1.0
    residual = torch.zeros(1)
    served_ef, served_rtn = [], []
    for _ in range(64):
        s, residual = tr.error_feedback_round_bf16(master, residual)
        served_ef.append(float(s))
        served_rtn.append(float(tr.round_nearest_bf16(master)))
    err_ef = abs(sum(served_ef) - 64 * float(master))
    err_rtn = abs(sum(served_rtn) - 64 * float(master))
    assert err_rtn == 64 * 2.0**-10 and err_ef <= 0.5 * 2.0**-7




# ==================================================================================================
# 3. visible update fraction


def test_visible_update_fraction_identity_rtn_and_sr_expectation():
    before = torch.tensor([0.5, -0.25, 1.0, 3.0]).to(torch.bfloat16).float()  # on the grid
    update = bf16_cell(before).float() * torch.tensor([0.1, -0.3, 0.45, 0.2])  # below half a cell
    after = before + update
    assert tr.visible_update_fraction(before, after, before, after) == 1.0
    assert (
        tr.visible_update_fraction(before, after, before, tr.round_nearest_bf16(after).float())
        == 0.0
    )
    sr = tr.stochastic_round_bf16(
        after.expand(N_NOISE, 4).contiguous(), noise=all_noise((4,))
    ).double()
    # every 64th draw
    fractions = [tr.visible_update_fraction(before, after, before, row) for row in sr[::64]]
    full = sum((sr - before.double()) @ (after.double() - before.double())) / float(
        (after.double() - before.double()).square().sum()
    )
    assert abs(float(full) / N_NOISE - 1.0) < 1e-9, "E[fraction] = 1 over all 65536 draws"
    assert min(fractions) < 0.5 < max(fractions), "single draws vary"
    assert tr.visible_update_fraction(before, before, before, after) == 0.0


# ==================================================================================================
# 4. score centering cancels drift, exactly


def _sc_case(zp, zq, y, adv, **kw):
    """Gradient w.r.t. trainer logits of the SC (or PG when kw['pg']) loss for one sampled token y.
    """
    z = zp.clone().requires_grad_(True)
    logp_all = torch.log_softmax(z, -1)
    logq_all = torch.log_softmax(zq, -1)
    k = kw.get("k", len(zp))
    head = torch.argsort(logq_all, descending=True)[:k]
    mask = torch.ones(1, 1, dtype=torch.bool)
    a = torch.tensor([[adv]], dtype=torch.float64)
    if kw.get("pg"):
        loss = tr.pg_loss(logp_all[y].view(1, 1), a, mask)
    else:
        loss = tr.score_centering_loss(
            logp_all[y].view(1, 1), logp_all[head].view(1, 1, k), logq_all[y].view(1, 1),
            logq_all[head].view(1, 1, k), a, mask, cap=kw.get("cap"), band=kw.get("band"),
        )
    (grad,) = torch.autograd.grad(loss, z)
    return grad


def _expect_q(zp, zq, advs, **kw):
    q = torch.softmax(zq, -1)
    return sum(q[y] * _sc_case(zp, zq, y, advs[y], **kw) for y in range(len(zp)))


@given(logits_pq_V(), st.floats(min_value=-2.0, max_value=2.0, width=32))
def test_score_centering_cancels_drift_pg_does_not(pq, adv):
    zp, zq = pq
    V = len(zp)
    p, q = torch.softmax(zp, -1), torch.softmax(zq, -1)
    for kw in ({}, {"cap": 2.0}, {"band": (0.5, 5.0)}):
        drift = _expect_q(zp, zq, [adv] * V, **kw)
        assert torch.allclose(drift, torch.zeros(V, dtype=torch.float64), atol=EXPECT_ATOL), kw
    pg = _expect_q(zp, zq, [adv] * V, pg=True)
    assert torch.allclose(pg, -adv * (q - p), atol=EXPECT_ATOL), (
        "plain PG carries the drift A (q - p)"
    )


@given(
    logits_pq_V(),
    st.lists(st.floats(min_value=-2.0, max_value=2.0, width=32), min_size=8, max_size=8),
)
def test_score_centering_keeps_the_signal(pq, advs):
    zp, zq = pq
    V = len(zp)
    advs = advs[:V]
    p, q = torch.softmax(zp, -1), torch.softmax(zq, -1)
    scores = torch.eye(V, dtype=torch.float64) - p  # s_y = d log p_y / d logits
    a = torch.tensor(advs, dtype=torch.float64)
    cov = (q[:, None] * a[:, None] * scores).sum(0) - (q * a).sum() * (q[:, None] * scores).sum(0)
    assert torch.allclose(_expect_q(zp, zq, advs), -cov, atol=EXPECT_ATOL)


def _sc_reference(zp, zq, y, adv, k, f):
    """Independent float64 reference of the top-k estimator (Marek & Ryabinin, App. A),
    differentiable in the logits."""
    z = zp.clone().requires_grad_(True)
    logp = torch.log_softmax(z, -1)
    p, q = logp.detach().exp(), torch.softmax(zq, -1)
    head = torch.argsort(q, descending=True)[:k]
    tail_q = max(float(1 - q[head].sum()), tr.TAIL_FLOOR)
    tail_p = max(float(1 - p[head].sum()), tr.TAIL_FLOOR)
    rho_tail = tail_q / tail_p
    alpha = rho_tail * f(1 / rho_tail)
    coef = torch.stack([q[v] * f(float(p[v] / q[v])) - alpha * p[v] for v in head.tolist()])
    loss = -adv * (f(float(p[y] / q[y])) * logp[y] - (coef * logp[head]).sum())
    (grad,) = torch.autograd.grad(loss, z)
    return float(loss.detach()), grad


@given(logits_pq_V(min_v=3), st.integers(1, 7), st.floats(min_value=-2.0, max_value=2.0, width=32))
def test_score_centering_topk_matches_modelled_tail_formula(pq, k, adv):
    zp, zq = pq
    V = len(zp)
    k = min(k, V)
    fs = {
        None: (lambda r: 1.0),
        2.0: (lambda r: min(r, 2.0)),
    }
    for cap, f in fs.items():
        for y in range(V):
            _, ref_grad = _sc_reference(zp, zq, y, adv, k, f)
            grad = _sc_case(zp, zq, y, adv, k=k, cap=cap)
            assert torch.allclose(grad, ref_grad, atol=EXPECT_ATOL), (cap, y, k)
    band = (0.5, 5.0)
    f_mis = lambda r: r if band[0] <= r <= band[1] else 0.0
    for y in range(V):
        _, ref_grad = _sc_reference(zp, zq, y, adv, k, f_mis)
        assert torch.allclose(_sc_case(zp, zq, y, adv, k=k, band=band), ref_grad, atol=EXPECT_ATOL)


@given(logits_pq_V(), st.floats(min_value=-2.0, max_value=2.0, width=32))
def test_score_centering_full_vocab_equals_full_centering(pq, adv):
    zp, zq = pq
    V = len(zp)
    p, q = torch.softmax(zp, -1), torch.softmax(zq, -1)
    for y in range(V):
        s_y = torch.eye(V, dtype=torch.float64)[y] - p
        expected = -adv * (s_y - (q[:, None] * (torch.eye(V, dtype=torch.float64) - p)).sum(0))
        assert torch.allclose(_sc_case(zp, zq, y, adv), expected, atol=EXPECT_ATOL)


# ==================================================================================================
# 5. importance weights: TIS unbiased by enumeration, every weight bounded and detached


@given(
    logits_pq_V(),
    st.lists(st.floats(min_value=-2.0, max_value=2.0, width=32), min_size=8, max_size=8),
)
def test_tis_weight_is_unbiased_by_enumeration(pq, advs):
    zp, zq = pq
    V = len(zp)
    p, q = torch.softmax(zp, -1), torch.softmax(zq, -1)
    logq_all = torch.log_softmax(zq, -1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    total = torch.zeros(V, dtype=torch.float64)
    for y in range(V):
        z = zp.clone().requires_grad_(True)
        logp = torch.log_softmax(z, -1)[y].view(1, 1)
        # exact rho = p / q
        w = tr.tis_weights(logp.detach(), logq_all[y].view(1, 1), mask, cap=math.inf)
        (g,) = torch.autograd.grad(tr.pg_loss(logp, torch.tensor([[advs[y]]]), mask, weights=w), z)
        total += q[y] * g
    scores = torch.eye(V, dtype=torch.float64) - p
    on_policy = -(p[:, None] * torch.tensor(advs[:V], dtype=torch.float64)[:, None] * scores).sum(0)
    # weights are float32: rho carries ~1e-7 relative error
    assert torch.allclose(total, on_policy, atol=1e-5)
    unweighted = -(q[:, None] * torch.tensor(advs[:V], dtype=torch.float64)[:, None] * scores).sum(
        0
    )
    if (p - q).abs().max() > 0.05 and (on_policy - unweighted).abs().max() > 1e-3:
        assert not torch.allclose(unweighted, on_policy, atol=1e-5), (
            "anti-vacuity: without rho it is biased"
        )


# ==================================================================================================
# 5b. sampling transforms: the truncation bias is exactly the kept mass S, and renormalising removes
# it


def test_truncation_mask_follows_vllms_rules_on_a_hand_made_distribution():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # probabilities, largest first
    def keep(**kw):
        return tr.truncation_mask(logits, **kw).tolist()

    assert keep() == [True] * 4, "all off keeps everything"
    assert keep(top_p=0.79) == [True, True, False, False], "0.05 + 0.15 <= 1 - 0.79: both dropped"
    assert keep(top_p=0.81) == [True, True, True, False]
    assert keep(top_p=0.8) == [True, True, True, False], (
        "at the boundary, float32 as vLLM: 1 - 0.8f < 0.2f"
    )
    assert keep(top_p=1e-6) == [True, False, False, False], "the most likely token always stays"
    assert keep(top_k=2) == [True, True, False, False]
    assert keep(min_p=0.2) == [True, True, True, False], "p >= 0.2 * 0.5"
    assert keep(min_p=0.2, top_k=1) == [True, False, False, False]
    ties = tr.truncation_mask(torch.tensor([1.0, 2.0, 2.0, 0.0]), top_k=1)
    assert ties.tolist() == [False, True, True, False], (
        "top-k keeps ties at the k-th value, as vLLM does"
    )
    masked = torch.tensor([-math.inf, 0.5, -math.inf, 1.0])
    assert tr.truncation_mask(masked, top_k=3).tolist() == [False, True, False, True], (
        "-inf is never kept"
    )
    for bad, kw in (("top_p", {"top_p": 0.0}), ("top_k", {"top_k": -1}), ("min_p", {"min_p": 1.0})):
        with pytest.raises(ValueError, match=bad):
            tr.truncation_mask(logits, **kw)


def _truncated(z, top_p, top_k, min_p):
    """(log q~ over V with -inf off the support, kept ids (S,)) of the distribution softmax(z)
    truncated."""
    keep = tr.truncation_mask(z, top_p, top_k, min_p)
    return torch.log_softmax(z.masked_fill(~keep, -math.inf), -1), tr.support_ids(keep)


truncations = st.tuples(st.floats(0.05, 1.0), st.integers(0, 8), st.sampled_from([0.0, 0.1, 0.3]))


@given(logits_pq_V(), truncations)
def test_truncation_bias_is_exactly_the_kept_mass_and_renormalising_removes_it(pq, trunc):
    zp, _ = pq
    # identical numerics: the sampler is the trainer, truncated
    logq_trunc, kept = _truncated(zp, *trunc)
    logp = torch.log_softmax(zp, -1)
    S = logp.exp()[kept].sum()
    for y in kept.tolist():
        assert math.isclose(float(logp[y] - logq_trunc[y]), float(S.log()), abs_tol=1e-9), (
            "ratio = S everywhere"
        )
        logp_renorm, log_s = tr.renormalize_on_support(
            logp[y].view(1, 1), logp[kept].view(1, 1, -1)
        )
        assert math.isclose(float(logp_renorm - logq_trunc[y]), 0.0, abs_tol=1e-9), (
            "renormalised: exactly 1"
        )
        assert math.isclose(float(log_s), float(S.log()), abs_tol=1e-9)
    # twin: nothing truncated, the ratio is exactly 1
    if trunc == (1.0, 0, 0.0) or len(kept) == len(zp):
        assert math.isclose(float(S), 1.0, abs_tol=1e-9)


def test_truncation_bias_twin_top_p_one_is_ratio_one_and_top_p_below_one_is_not():
    z = torch.tensor([2.0, 1.0, 0.5, -1.0, -2.0], dtype=torch.float64)
    logp = torch.log_softmax(z, -1)
    assert torch.equal(_truncated(z, 1.0, 0, 0.0)[0], logp), (
        "top_p = 1, top_k = 0: the sampled distribution is p"
    )
    logq_trunc, kept = _truncated(z, 0.8, 0, 0.0)
    assert (logp[kept] - logq_trunc[kept]).max() < math.log(0.95), (
        "top_p = 0.8: every ratio carries S < 0.95"
    )
    zq, f = torch.tensor([0.8, 0.6, -0.2, -1.5], dtype=torch.float64), [1.0, -0.5, 0.3, 2.0]
    renorm, _ = _expected_grad(z[:4], zq, f, (0.7, 0, 0.0), renormalise=True)
    biased, _ = _expected_grad(z[:4], zq, f, (0.7, 0, 0.0), renormalise=False)
    assert (renorm - biased).abs().max() > 0.02, (
        "the full-vocabulary ratio and score give another gradient"
    )


def _expected_grad(zp, zq, f, trunc, renormalise):
    """E_{y ~ q~}[w_y f_y d log p_y / d z] by enumeration over the sampler's support; w = p~ / q~
    (renormalised trainer) or p / q~ (the full-vocabulary ratio and score)."""
    logq_trunc, kept = _truncated(zq, *trunc)
    total = torch.zeros_like(zp)
    mask = torch.ones(1, 1, dtype=torch.bool)
    for y in kept.tolist():
        z = zp.clone().requires_grad_(True)
        logp_all = torch.log_softmax(z, -1)
        logp = logp_all[y].view(1, 1)
        if renormalise:
            logp = tr.renormalize_on_support(logp, logp_all[kept].view(1, 1, -1))[0]
        w = tr.tis_weights(logp.detach(), logq_trunc[y].view(1, 1), mask, cap=math.inf)
        (g,) = torch.autograd.grad(tr.pg_loss(logp, torch.tensor([[f[y]]]), mask, weights=w), z)
        total += logq_trunc[y].exp() * g
    return total, kept


@given(
    logits_pq_V(min_v=3),
    st.lists(st.floats(-2.0, 2.0, width=32), min_size=8, max_size=8),
    st.sampled_from([(0.7, 0, 0.0), (1.0, 2, 0.0), (0.9, 0, 0.2)]),
)
def test_renormalised_is_gradient_is_unbiased_for_the_truncated_policy_full_vocab_is_not(
    pq, f, trunc
):
    zp, zq = pq
    got, kept = _expected_grad(zp, zq, f, trunc, renormalise=True)
    z = zp.clone().requires_grad_(True)
    p_kept = torch.softmax(z, -1)[kept]
    # E_{p~}[f]
    objective = (p_kept / p_kept.sum() * torch.tensor(f, dtype=torch.float64)[kept]).sum()
    (truth,) = torch.autograd.grad(-objective, z)
    assert torch.allclose(got, truth, atol=1e-5), "renormalised IS: the truncated policy's gradient"
    biased, _ = _expected_grad(zp, zq, f, trunc, renormalise=False)
    S = float(torch.softmax(zp, -1)[kept].sum())
    if S < 0.95 and (truth - biased).abs().max() > 1e-3:  # anti-vacuity where truncation bites
        assert not torch.allclose(biased, truth, atol=1e-5)


@given(logits_pq_V(min_v=3), st.floats(min_value=-2.0, max_value=2.0, width=32),
       st.sampled_from([(0.7, 0, 0.0), (1.0, 2, 0.0), (0.9, 0, 0.2)]))
def test_score_centering_over_the_truncated_distribution_cancels_drift(pq, adv, trunc):
    zp, zq = pq
    logq_trunc, kept = _truncated(zq, *trunc)
    V, mask, a = (
        len(zp),
        torch.ones(1, 1, dtype=torch.bool),
        torch.tensor([[adv]], dtype=torch.float64),
    )
    on_support = torch.isfinite(logq_trunc)
    drift, pg = torch.zeros_like(zp), torch.zeros_like(zp)
    for y in kept.tolist():
        z = zp.clone().requires_grad_(True)
        logp_all = torch.log_softmax(z, -1)
        logp, log_s = tr.renormalize_on_support(
            logp_all[y].view(1, 1), logp_all[kept].view(1, 1, -1)
        )
        # K = V
        logp_topk = torch.where(on_support, logp_all - log_s.view(1), -math.inf).view(1, 1, V)
        loss = tr.score_centering_loss(
            logp, logp_topk, logq_trunc[y].view(1, 1), logq_trunc.view(1, 1, V), a, mask
        )
        drift += logq_trunc[y].exp() * torch.autograd.grad(loss, z, retain_graph=True)[0]
        pg += logq_trunc[y].exp() * torch.autograd.grad(tr.pg_loss(logp, a, mask), z)[0]
    assert torch.allclose(drift, torch.zeros(V, dtype=torch.float64), atol=EXPECT_ATOL)
    p_trunc = torch.softmax(zp.masked_fill(~on_support, -math.inf), -1)
    # anti-vacuity: plain PG drifts by A (q~ - p~)
    expected_pg = -adv * (logq_trunc.exp() - p_trunc)
    assert torch.allclose(pg, expected_pg, atol=EXPECT_ATOL)


def test_support_ids_round_trip_and_support_differs():
    keep = torch.tensor([[[True, False, True, False], [False, False, False, True]]])  # (1, 2, 4)
    ids = tr.support_ids(keep)
    assert ids.tolist() == [[[0, 2], [3, -1]]], "kept ids first, -1 pads to the largest count"
    same = torch.tensor([[[2, 0], [3, -1]]])
    other = torch.tensor([[[2, 1], [3, -1]]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert tr.support_differs(ids, same, mask) == 0.0, "the same sets in another order"
    assert tr.support_differs(ids, other, mask) == 0.5
    wider = torch.tensor([[[0, 2, -1], [-1, 3, -1]]])
    assert tr.support_differs(ids, wider, mask) == 0.0, "the same sets, padded to another S"


@pytest.mark.parametrize("trunc", [(0.8, 0, 0.0), (1.0, 3, 0.0), (1.0, 0, 0.2)])
def test_kept_support_by_row_chunks_equals_the_whole_mask(monkeypatch, trunc):
    """kept_support_from_logits chunk by chunk (a few rows of (B, T, V) at a time) gives the same
    supports as truncation_mask on the whole tensor, the sampled token added."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=gen) * 3  # (B, T, V)
    ids = torch.randint(0, 40, (3, 5), generator=gen)
    keep = tr.truncation_mask(logits, *trunc).scatter_(-1, ids[..., None], True)
    whole = tr.support_ids(keep)
    # 2 rows per chunk: 8 chunks, the last one of 1 row
    monkeypatch.setattr(tr, "CHUNK_BYTES", 4 * 40 * 2)
    chunked = tr.kept_support_from_logits(logits, ids, *trunc)
    assert tr.support_differs(whole, chunked, torch.ones(3, 5, dtype=torch.bool)) == 0.0
    assert (chunked >= 0).sum() == keep.sum(), "every kept id once, pads elsewhere"


WEIGHT_FUNCS = {
    "tis": lambda a, b, m: tr.tis_weights(a, b, m),
    "mis": lambda a, b, m: tr.mis_weights(a, b, m),
    "seq_tis": lambda a, b, m: tr.seq_tis_weights(a, b, m),
    "seq_mask": lambda a, b, m: tr.seq_mask_weights(a, b, m),
    "geo": lambda a, b, m: tr.geo_mask_weights(a, b, m),
    "cis": lambda a, b, m: tr.cis_weights(a, b, m),
    "dlc": lambda a, b, m: tr.dlc_weights(a, b, m),
    "copc": lambda a, b, m: tr.copc_mask(a, b, m),
}


@given(logps_BT())
def test_weights_bounds_detached_and_zero_outside_mask(data):
    logp_old, logp_infer, mask = data
    logp_old = logp_old.clone().requires_grad_(True)
    rho = (logp_old.detach() - logp_infer).exp()
    p_old = logp_old.detach().exp()
    for name, fn in WEIGHT_FUNCS.items():
        w = fn(logp_old, logp_infer, mask)
        assert not w.requires_grad, f"{name} must be detached"
        assert w.shape == mask.shape and w.dtype == torch.float32
        assert (w[~mask] == 0).all(), f"{name} must be 0 outside the mask"
        assert torch.isfinite(w).all() and (w >= 0).all()
    assert (tr.tis_weights(logp_old, logp_infer, mask, cap=2.0) <= 2.0).all()
    w = tr.mis_weights(logp_old, logp_infer, mask, low=0.5, high=5.0)
    assert ((w == 0) | ((w >= 0.5) & (w <= 5.0))).all()
    assert torch.allclose(w[w > 0], rho[w > 0])
    assert (tr.seq_tis_weights(logp_old, logp_infer, mask, cap=5.0) <= 5.0).all()
    w = tr.seq_mask_weights(logp_old, logp_infer, mask, low=0.5, high=3.0)
    assert ((w == 0) | ((w >= 0.5) & (w <= 3.0))).all()
    assert set(tr.geo_mask_weights(logp_old, logp_infer, mask).unique().tolist()) <= {0.0, 1.0}
    w = tr.cis_weights(logp_old, logp_infer, mask, lam=2.3, kappa=5e-3)
    cap = 1 + 2.3 * (1 - p_old).clamp(min=5e-3)
    assert (w[mask] <= cap[mask] * (1 + 1e-6)).all() and (w <= 1 + 2.3).all()
    assert torch.allclose(w[mask], torch.minimum(rho, cap)[mask])
    w = tr.dlc_weights(logp_old, logp_infer, mask, clamp=1.0)
    assert ((w[mask] >= math.exp(-1) * (1 - 1e-6)) & (w[mask] <= math.e * (1 + 1e-6))).all()


@given(logps_BT())
def test_sequence_weights_are_constant_per_sequence(data):
    logp_old, logp_infer, mask = data
    for fn in (tr.seq_tis_weights, tr.seq_mask_weights, tr.geo_mask_weights):
        w = fn(logp_old, logp_infer, mask)
        for i in range(mask.shape[0]):
            assert w[i][mask[i]].unique().numel() == 1


def test_geometric_mask_is_length_neutral_product_is_not():
    """The known trap (TRL #5814): each token 0.999 -> the product vanishes with length, the
    geometric mean does not."""
    T = 200
    logp_infer = torch.zeros(1, T)
    logp_old = torch.full((1, T), math.log(0.999))
    mask = torch.ones(1, T, dtype=torch.bool)
    assert tr.geo_mask_weights(logp_old, logp_infer, mask, low=0.99, high=1.01).min() == 1.0
    assert tr.seq_tis_weights(logp_old, logp_infer, mask).max() < 0.82


def test_seq_mask_keeps_a_sequence_iff_its_product_ratio_is_in_the_band():
    """TRL's default correction: the whole sequence weighted by prod_t rho_t, or 0 when that product
    leaves the band."""
    # product e^1 = 2.72 <= 3: kept, weight e on every token
    log_rho = torch.tensor([[0.5, 0.5, 0.0],
                            [1.0, 0.2, 0.0],  # e^1.2 = 3.32 > 3: dropped
                            [-2.0, -2.0, -2.0],  # e^-6: kept (no lower bound by default)
                            # the 9 is outside the mask: product 2, kept
                            [math.log(2.0), 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    logp_infer = torch.full((4, 3), -3.0)
    w = tr.seq_mask_weights(logp_infer + log_rho, logp_infer, mask)
    expected = torch.tensor([math.e, 0.0, math.exp(-6.0), 2.0])[:, None] * mask
    assert torch.allclose(w, expected, rtol=1e-5, atol=0.0)
    # band edges are inclusive, as in TRL (a ratio is masked only when < low or > high)
    kept = float(w[0, 0])
    above = float(torch.nextafter(torch.tensor(kept), torch.tensor(math.inf)))
    assert (
        tr.seq_mask_weights(logp_infer + log_rho, logp_infer, mask, low=kept, high=kept)[0] == kept
    ).all()
    assert (
        tr.seq_mask_weights(logp_infer + log_rho, logp_infer, mask, low=above, high=4.0)[0] == 0
    ).all()
    assert (tr.seq_mask_weights(logp_infer + log_rho, logp_infer, mask, low=0.01)[2] == 0).all(), (
        "low bound"
    )


@given(
    st.floats(min_value=-6.0, max_value=-(2.0**-10)),
    st.floats(min_value=-6.0, max_value=-(2.0**-10)),
)
def test_cis_log_odds_identity(logp, logq):
    """k = p / q = p + (1 - p) e^eps with eps = logit p - logit q (Yu et al.)."""
    lp, lq = torch.tensor([logp], dtype=torch.float64), torch.tensor([logq], dtype=torch.float64)
    eps = tr.log_odds_displacement(lp, lq)
    p = lp.exp()
    assert torch.allclose(p + (1 - p) * eps.exp(), (lp - lq).exp(), rtol=1e-9)


@given(logps_BT())
def test_corrections_reduce_to_plain_pg_and_ppo_without_mismatch(data):
    logp_fixed, _, mask = data
    logp = logp_fixed.clone().requires_grad_(True)
    adv = torch.linspace(-1, 1, mask.shape[0])[:, None]
    same = logp.detach()
    plain_pg = tr.pg_loss(logp, adv, mask)
    (g_pg,) = torch.autograd.grad(plain_pg, logp)
    for name, fn in WEIGHT_FUNCS.items():
        w = fn(same, same, mask)
        assert torch.equal(w, mask.float()), (
            f"{name} weight must be exactly 1 on every token when p_old == q"
        )
    lossa = {
        "sc": tr.score_centering_loss(logp, logp[..., None], same, same[..., None], adv, mask),
        "sc_tis": tr.score_centering_loss(
            logp, logp[..., None], same, same[..., None], adv, mask, cap=2.0
        ),
        "sc_mis": tr.score_centering_loss(
            logp, logp[..., None], same, same[..., None], adv, mask, band=(0.5, 5.0)
        ),
        "dppo": tr.dppo_loss(logp, same, adv, mask),
    }
    for name, loss in lossa.items():
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.allclose(g, g_pg, atol=1e-7), name
    ppo = tr.ppo_loss(logp, same, adv, mask)
    assert torch.allclose(tr.dlc_loss(logp, same, same, adv, mask), ppo)


# ==================================================================================================
# 6. losses


@given(logps_BT())
def test_ppo_gradient_equals_pg_at_first_step(data):
    logp_fixed, _, mask = data
    adv = torch.linspace(-1, 2, mask.shape[0])[:, None]
    logp = logp_fixed.clone().requires_grad_(True)
    (g_ppo,) = torch.autograd.grad(tr.ppo_loss(logp, logp.detach(), adv, mask), logp)
    (g_pg,) = torch.autograd.grad(tr.pg_loss(logp, adv, mask), logp)
    assert torch.allclose(g_ppo, g_pg, atol=1e-7)


def test_ppo_clip_kills_gradient_on_the_correct_side_only():
    mask = torch.ones(1, 4, dtype=torch.bool)
    logp_old = torch.log(torch.full((1, 4), 0.5))
    # ratios 1.5 (above 1 + 0.28), 0.5 (below 1 - 0.2), for A > 0 and A < 0
    logp = torch.log(torch.tensor([[0.75, 0.25, 0.75, 0.25]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    (g,) = torch.autograd.grad(tr.ppo_loss(logp, logp_old, adv, mask), logp)
    assert g[0, 0] == 0, "A > 0, r above 1 + eps: clipped"
    assert g[0, 1] != 0, "A > 0, r below 1 - eps: still pushed up"
    assert g[0, 2] != 0, "A < 0, r above 1 + eps: still pushed down"
    assert g[0, 3] == 0, "A < 0, r below 1 - eps: clipped"
    # between the bounds and their swap: r in (1.2, 1.28) with A > 0 and r in (0.72, 0.8) with A < 0
    # are kept by the right clip [0.8, 1.28] and cut by a swapped one [0.72, 1.2]
    # r = 1.24, 1.24, 0.76, 0.76
    logp = torch.log(torch.tensor([[0.62, 0.62, 0.38, 0.38]])).requires_grad_(True)
    (g,) = torch.autograd.grad(
        tr.ppo_loss(logp, logp_old, torch.tensor([[1.0, 1.0, -1.0, -1.0]]), mask), logp
    )
    assert (g[0, :2] == 0).all() == False and (g[0, :2] != 0).all(), (
        "A > 0, r = 1.24 < 1 + eps_high: kept"
    )
    assert (g[0, 2:] == 0).all(), "A < 0, r = 0.76 < 1 - eps_low: clipped"
    (g,) = torch.autograd.grad(
        tr.ppo_loss(
            logp, logp_old, torch.tensor([[1.0, 1.0, -1.0, -1.0]]), mask, eps_low=0.28, eps_high=0.2
        ),
        logp,
    )
    assert (g[0, :2] == 0).all() and (g[0, 2:] != 0).all(), "the swapped bounds cut the other pair"


def test_mis_band_is_inclusive_at_both_ends():
    mask = torch.ones(1, 4, dtype=torch.bool)
    logp_old = torch.tensor([[math.log(0.5), math.log(5.0), math.log(0.49), math.log(5.1)]])
    logp_infer = torch.zeros(1, 4)
    rho = (logp_old - logp_infer).exp()
    assert rho[0, 0].item() == 0.5 and rho[0, 1].item() == 5.0, "the edges are exact in float32"
    w = tr.mis_weights(logp_old, logp_infer, mask, low=0.5, high=5.0)
    assert w.tolist() == [[0.5, 5.0, 0.0, 0.0]]


def test_dlc_weights_centre_a_constant_shift():
    mask = torch.tensor([[True, True, True, False]])
    logp_infer = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3]]))
    logp_old = logp_infer + 0.3  # a persistent engine offset
    w = tr.dlc_weights(logp_old, logp_infer, mask)
    assert torch.allclose(w[mask], torch.ones(3)) and w[0, 3] == 0
    tis = tr.tis_weights(logp_old, logp_infer, mask)
    assert torch.allclose(tis[mask], torch.full((3,), math.exp(0.3))), (
        "anti-vacuity: TIS keeps the offset"
    )


@given(logps_BT(low=-3.0), logps_BT(low=-3.0))
def test_dppo_masks_only_harmful_moves_and_is_is_pg_elsewhere(d1, d2):
    logp_fixed, logp_infer, mask = d1
    B, T = mask.shape
    adv = torch.where(torch.arange(B * T).view(B, T) % 2 == 0, 1.0, -1.0)
    logp = logp_fixed.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(tr.dppo_loss(logp, logp_infer, adv, mask, delta=0.2), logp)
    shift = logp_fixed.exp() - logp_infer.exp()
    harmful = ((adv > 0) & (shift > 0.2)) | ((adv < 0) & (shift < -0.2))
    r = (logp_fixed - logp_infer).exp()
    n = mask.sum()
    expected = torch.where(mask & ~harmful, -r * adv / n, torch.zeros_like(r))
    assert torch.allclose(g, expected, atol=1e-6)


def test_dppo_mask_anti_vacuity():
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp_infer = torch.log(torch.tensor([[0.2, 0.8]]))
    logp = torch.log(torch.tensor([[0.6, 0.4]])).requires_grad_(True)  # +0.4 and -0.4 shifts
    adv = torch.tensor([[1.0, 1.0]])
    (g,) = torch.autograd.grad(tr.dppo_loss(logp, logp_infer, adv, mask), logp)
    assert g[0, 0] == 0, "already pushed up by 0.4 > delta with A > 0: masked"
    assert g[0, 1] != 0, "moved down, A > 0 pulls back: kept"


# ==================================================================================================
# 7. COPC advantages


def _gae_loop(values, rewards, mask, gamma, lam):
    B, T = mask.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        n = int(mask[i].sum())
        last = 0.0
        for t in reversed(range(n)):
            next_v = float(values[i, t + 1]) if t + 1 < n else 0.0
            r = float(rewards[i]) if t == n - 1 else 0.0
            delta = r + gamma * next_v - float(values[i, t])
            last = delta + gamma * lam * last
            adv[i, t] = last
    return adv


@given(logps_BT(), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_copc_equals_gae_without_mismatch(data, gamma, lam):
    logp, values_raw, mask = data
    values = values_raw.exp()  # in [0, 1], like a reward-bounded critic
    rewards = torch.linspace(0, 1, mask.shape[0])
    adv, targets = tr.copc_advantages(values, rewards, logp, logp, mask, gamma=gamma, lam=lam)
    ref = _gae_loop(values, rewards, mask, gamma, lam)
    assert torch.allclose(adv.double(), ref, atol=1e-5)
    assert torch.allclose(targets[mask], (values + adv)[mask])
    assert (adv[~mask] == 0).all()


@given(logps_BT())
def test_copc_residual_weights_bounded_and_matter(data):
    logp, logp_infer, mask = data
    c = tr.copc_residual_weights(logp, logp_infer, mask, eps=0.2)
    assert ((c[mask] >= 0.8 - 1e-7) & (c[mask] <= 1.2 + 1e-7)).all() and (c[~mask] == 0).all()
    values = torch.zeros_like(logp)
    adv, _ = tr.copc_advantages(values, torch.ones(mask.shape[0]), logp, logp_infer, mask, lam=0.0)
    last = mask & (mask.cumsum(1) == mask.sum(1, keepdim=True))
    assert torch.allclose(adv[last], c[last]), (
        "with lambda = 0 and V = 0, A at the reward token is c_t * r"
    )


# ==================================================================================================
# 8. GRPO advantages


@given(st.integers(1, 5), st.integers(1, 6), st.data())
def test_grpo_advantages_centre_and_scale(n_groups, G, data):
    rewards = torch.tensor(
        data.draw(
            st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n_groups * G, max_size=n_groups * G)
        )
    )
    adv = tr.grpo_advantages(rewards, G).view(n_groups, G)
    assert torch.allclose(adv.sum(1), torch.zeros(n_groups), atol=1e-6)
    adv_n = tr.grpo_advantages(rewards, G, normalize_std=True).view(n_groups, G)
    for g in range(n_groups):
        if rewards.view(n_groups, G)[g].unique().numel() > 1:
            assert abs(float(adv_n[g].std()) - 1.0) < 1e-5
        else:
            assert (adv_n[g] == 0).all()


# ==================================================================================================
# 9. metrics and ledger


@given(logps_BT())
def test_metrics_zero_on_identical_and_k3_nonnegative(data):
    a, b, mask = data
    m = tr.mismatch_metrics(a, a, mask)
    for k in ("k1", "k2", "k3", "chi2", "abs_diff", "max_abs_diff"):
        assert m[k] == 0.0, k
    assert m["ess"] == 1.0 and m["ratio_min"] == m["ratio_max"] == 1.0
    m = tr.mismatch_metrics(a, b, mask)
    assert m["k3"] >= 0 and m["k2"] >= 0 and 0 < m["ess"] <= 1 + 1e-12
    lr = (a - b)[mask].double()
    assert math.isclose(m["k1"], float(-lr.mean()), abs_tol=1e-9)
    assert math.isclose(m["abs_diff"], float(lr.abs().mean()), abs_tol=1e-9)


@given(logps_BT(), logps_BT())
def test_ledger_parts_add_up(d1, d2):
    logp, logp_old, mask = d1
    logp_infer = torch.roll(logp, 1, dims=1)
    led = tr.mismatch_ledger(logp, logp_old, logp_infer, mask)
    assert math.isclose(led["lag_mean"] + led["numerics_mean"], led["total_mean"], abs_tol=1e-9)
    master = logp_old + 0.01 * torch.cos(torch.arange(logp.numel()).view(logp.shape).float())
    led = tr.mismatch_ledger(logp, logp_old, logp_infer, mask, logp_master_old=master)
    parts = led["lag_mean"] + led["rounding_mean"] + led["numerics_mean"]
    assert math.isclose(parts, led["total_mean"], abs_tol=1e-9)
    assert led["rounding_abs"] > 0


# ==================================================================================================
# 10. token_logprobs


@given(st.integers(1, 40), st.integers(2, 1000), st.integers(1, 50), st.integers(0, 2**31 - 1))
def test_token_logprobs_matches_log_softmax(n, V, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 10
    ids = torch.randint(0, V, (n,), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
    assert torch.allclose(tr.token_logprobs(logits, ids, chunk_rows=chunk), ref, atol=FP32_ATOL)
    assert torch.allclose(
        tr.token_logprobs(logits.view(1, n, V), ids.view(1, n)).view(n), ref, atol=FP32_ATOL
    )
    topk = torch.randint(0, V, (n, 3), generator=g)
    ref_k = torch.log_softmax(logits, -1).gather(-1, topk)
    assert torch.allclose(tr.token_logprobs(logits, topk, chunk_rows=chunk), ref_k, atol=FP32_ATOL)
    # the hand-written backward equals autograd through log_softmax + gather (repeated ids included)
    upstream = torch.randn(n, 3, generator=g)
    leaf = logits.clone().requires_grad_(True)
    (ours,) = torch.autograd.grad(
        (tr.token_logprobs(leaf, topk, chunk_rows=chunk) * upstream).sum(), leaf
    )
    (ref_g,) = torch.autograd.grad(
        (torch.log_softmax(leaf, -1).gather(-1, topk) * upstream).sum(), leaf
    )
    assert torch.allclose(ours, ref_g, atol=1e-5)


def test_token_logprobs_with_and_without_gradient_are_bitwise_equal():
    """Exact mode (ratio exactly 1) and a lag of exactly 0 at k = 1 rely on one code path for both.
    """
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 5, 96, generator=g) * 8
    ids = torch.randint(0, 96, (7, 5, 4), generator=g)
    with torch.no_grad():
        plain = tr.token_logprobs(logits, ids)
    assert torch.equal(plain, tr.token_logprobs(logits.clone().requires_grad_(True), ids).detach())




def test_token_logprobs_bf16_logits_and_gradient():
    logits = torch.randn(3, 5, 64).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, 64, (3, 5))
    out = tr.token_logprobs(logits, ids)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(out, ref, atol=FP32_ATOL)
    out.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()


def _masked_logits(V: int, seed: int) -> torch.Tensor:
    """Rows with -inf, finfo.min or -1e4 in every column in turn (column 0 included), a few masked
    columns at once, and rows of one finite logit in each column: the vocabularies truncation and
    masking produce. (4 V + 3, V)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for fill in (-math.inf, torch.finfo(torch.float32).min, -1e4):
        for col in range(V):
            row = torch.randn(V, generator=g) * 4
            row[col] = fill
            rows.append(row)
        several = torch.randn(V, generator=g) * 4
        several[::2] = fill  # half the vocabulary, column 0 among them
        rows.append(several)
    for col in range(V):
        row = torch.full((V,), -math.inf)
        row[col] = 3.0
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("K", [None, 3])
def test_token_logprobs_gradient_is_exact_with_masked_logits_in_any_column(K):
    """Eager path: finite gradients equal to autograd through log_softmax + gather (in float64) for
    -inf, finfo.min and -1e4 logits in any column and rows of one finite logit. An id with a -inf
    logit has log-prob -inf and the same finite gradient as autograd's; a nan upstream gradient
    spoils its own row only."""
    V = 8
    logits = _masked_logits(V, seed=0)
    n = logits.shape[0]
    g = torch.Generator().manual_seed(1)
    ids_k = torch.randint(0, V, (n, K or 1), generator=g)  # (n, K)
    # the one-finite rows: the id just left of the finite logit, -inf
    ids_k[n - V:, 0] = torch.arange(V).roll(1)
    ids = ids_k[:, 0] if K is None else ids_k
    upstream = torch.randn(ids.shape, generator=g)
    leaf = logits.clone().requires_grad_(True)
    ours = tr.token_logprobs(leaf, ids, chunk_rows=5)
    (grad,) = torch.autograd.grad((ours * upstream).sum(), leaf)
    leaf64 = logits.double().requires_grad_(True)
    ref = torch.log_softmax(leaf64, -1).gather(-1, ids_k).view(ids.shape)
    (ref_grad,) = torch.autograd.grad((ref * upstream.double()).sum(), leaf64)
    assert torch.isneginf(ours).any(), "anti-vacuity: some ids have logit -inf"
    assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
    # allclose counts -inf == -inf as close
    assert torch.allclose(ours.double(), ref, atol=FP32_ATOL)
    assert torch.isfinite(grad).all() and torch.allclose(
        grad.double(), ref_grad, atol=FP32_ATOL, rtol=0
    )
    with torch.no_grad():
        assert torch.equal(tr.token_logprobs(logits, ids, chunk_rows=5), ours.detach())
    spoiled = upstream.clone()
    spoiled[0] = math.nan
    (grad_nan,) = torch.autograd.grad(
        (tr.token_logprobs(leaf, ids, chunk_rows=5) * spoiled).sum(), leaf
    )
    assert torch.isnan(grad_nan[0]).all() and torch.equal(grad_nan[1:], grad[1:])
    # anti-vacuity: the logsumexp read off column 0 (the old formula) is nan or far off on these
    # rows
    column0 = logits[:, :1] - torch.log_softmax(logits, -1)[:, :1]
    assert not torch.allclose(
        column0.double(), torch.logsumexp(logits.double(), -1, keepdim=True), atol=1e-3
    )


# ==================================================================================================
# 11. non-finite inputs


def _all_losses(logp, logp_old, logp_infer, adv, mask):
    topk = torch.stack([logp, logp - 1.0], -1)
    topk_infer = torch.stack([logp_infer, logp_infer - 1.0], -1)
    return {
        "pg": tr.pg_loss(logp, adv, mask),
        "pg_tis": tr.pg_loss(logp, adv, mask, weights=tr.tis_weights(logp_old, logp_infer, mask)),
        "pg_cis": tr.pg_loss(logp, adv, mask, weights=tr.cis_weights(logp_old, logp_infer, mask)),
        "ppo_mis": tr.ppo_loss(
            logp, logp_old, adv, mask, weights=tr.mis_weights(logp_old, logp_infer, mask)
        ),
        "ppo_seq": tr.ppo_loss(
            logp, logp_old, adv, mask, weights=tr.seq_tis_weights(logp_old, logp_infer, mask)
        ),
        "ppo_geo": tr.ppo_loss(
            logp, logp_old, adv, mask, weights=tr.geo_mask_weights(logp_old, logp_infer, mask)
        ),
        "sc": tr.score_centering_loss(logp, topk, logp_infer, topk_infer, adv, mask),
        "sc_tis": tr.score_centering_loss(logp, topk, logp_infer, topk_infer, adv, mask, cap=2.0),
        "sc_mis": tr.score_centering_loss(
            logp, topk, logp_infer, topk_infer, adv, mask, band=(0.5, 5.0)
        ),
        "dlc": tr.dlc_loss(logp, logp_old, logp_infer, adv, mask),
        "dppo": tr.dppo_loss(logp, logp_infer, adv, mask),
        "ppo": tr.ppo_loss(logp, logp_old, adv, mask),
        "pg_dlc": tr.pg_loss(logp, adv, mask, weights=tr.dlc_weights(logp_old, logp_infer, mask)),
        "ppo_copc": tr.ppo_loss(
            logp, logp_old, adv, mask, weights=tr.copc_mask(logp_old, logp_infer, mask)
        ),
        "pg_rs": tr.pg_loss(
            logp, adv, mask, weights=tr.divergence_mask_weights(logp_old, logp_infer, mask)
        ),
        "pg_rs_max": tr.pg_loss(
            logp, adv, mask, weights=tr.divergence_seq_max_mask(logp_old, logp_infer, mask)
        ),
        "pg_rs_mean": tr.pg_loss(
            logp, adv, mask, weights=tr.divergence_seq_mean_mask(logp_old, logp_infer, mask)
        ),
        "pg_rs_sum": tr.pg_loss(
            logp, adv, mask, weights=tr.divergence_seq_sum_mask(logp_old, logp_infer, mask)
        ),
        "pg_tis_sn": tr.pg_loss(
            logp,
            adv,
            mask,
            weights=tr.self_normalize_weights(tr.tis_weights(logp_old, logp_infer, mask), mask),
        ),
        "pg_seq_sn": tr.pg_loss(
            logp,
            adv,
            mask,
            weights=tr.self_normalize_seq_weights(
                tr.seq_tis_weights(logp_old, logp_infer, mask), mask
            ),
        ),
        "pg_opsm": tr.pg_loss(logp, adv, mask, weights=tr.opsm_mask(logp, logp_infer, adv, mask)),
        "cispo": tr.cispo_loss(logp, logp_infer, adv, mask),
        "pg_k2": tr.pg_loss(logp, adv, mask) + tr.k2_penalty(logp, logp_infer, mask),
    }


extreme = st.sampled_from([-1e4, -50.0, -1e-6, 0.0, -math.inf, math.nan, 1e4, math.inf])


@given(logps_BT(), st.data())
def test_non_finite_outside_mask_changes_nothing_inside_never_nan(data, draw):
    logp, logp_infer, mask = data
    logp_old = (logp + logp_infer) / 2
    adv = torch.linspace(-1, 1, mask.shape[0])[:, None]
    clean = _all_losses(logp, logp_old, logp_infer, adv, mask)
    poisoned = [t.clone() for t in (logp, logp_old, logp_infer)]
    for t in poisoned:
        t[~mask] = draw.draw(extreme)
    dirty = _all_losses(*poisoned, adv, mask)
    for name in clean:
        assert torch.equal(clean[name], dirty[name]), name
    # inside the mask: extreme values and non-finite numbers, never a NaN loss or gradient
    inside = [t.clone() for t in (logp, logp_old, logp_infer)]
    idx = draw.draw(st.lists(st.integers(0, mask.numel() - 1), min_size=1, max_size=3))
    for t in inside:
        for i in idx:
            t.view(-1)[i] = draw.draw(extreme)
    lp = inside[0].clone().requires_grad_(True)
    for name, loss in _all_losses(lp, inside[1], inside[2], adv, mask).items():
        assert torch.isfinite(loss), name
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(g).all(), name
    m = tr.mismatch_metrics(inside[0], inside[2], mask)
    assert all(math.isfinite(v) for v in m.values())


# ==================================================================================================
# misuse: a bad argument is a clear error naming it


def test_misuse_raises_clear_errors():
    mask = torch.ones(2, 3, dtype=torch.bool)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"ids must be token ids in \[0, 3\).*max 3"):
        tr.token_logprobs(x, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="ids must be token ids.*min -1"):
        tr.token_logprobs(x, torch.tensor([-1, 0]))
    with pytest.raises(TypeError, match="ids must be an int64 or int32"):
        tr.token_logprobs(x, torch.tensor([0.0, 1.0]))
    assert torch.equal(
        tr.token_logprobs(x, torch.tensor([0, 2], dtype=torch.int32)),
        tr.token_logprobs(x, torch.tensor([0, 2])),
    )
    with pytest.raises(TypeError, match="mask must be a bool"):
        tr.tis_weights(x, x, mask.float())
    with pytest.raises(ValueError, match="logp_infer must have shape"):
        tr.tis_weights(x, torch.zeros(2, 4), mask)
    with pytest.raises(TypeError, match="logp_old must be a floating-point torch.Tensor"):
        tr.mis_weights([[0.0]], x, mask)
    with pytest.raises(ValueError, match="mask must be a non-empty"):
        tr.pg_loss(torch.zeros(0, 3), torch.zeros(0, 1), torch.ones(0, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="adv must have shape"):
        tr.pg_loss(x, torch.zeros(3, 3), mask)
    with pytest.raises(ValueError, match="logp_topk must have shape"):
        tr.score_centering_loss(x, torch.zeros(2, 3), x, torch.zeros(2, 3), x, mask)
    with pytest.raises(ValueError, match="at most one"):
        tr.score_centering_loss(x, x[..., None], x, x[..., None], x, mask, cap=2.0, band=(0.5, 2.0))
    with pytest.raises(TypeError, match="float32"):
        tr.stochastic_round_bf16(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="noise"):
        tr.stochastic_round_bf16(torch.zeros(3), noise=torch.full((3,), 1 << 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="group_size"):
        tr.grpo_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="ids must have shape"):
        tr.token_logprobs(torch.zeros(2, 5), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="ids must have shape"):
        tr.token_logprobs(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="residual must have shape"):
        tr.error_feedback_round_bf16(torch.zeros(3), torch.zeros(4))


def _bt_functions():
    """Every public (B, T) function, called with named (B, T) tensors: name -> (callable(**kw),
    tensor names)."""
    return {
        "tis_weights": (
            lambda logp_old, logp_infer, mask: tr.tis_weights(logp_old, logp_infer, mask),
            ("logp_old", "logp_infer"),
        ),
        "mis_weights": (
            lambda logp_old, logp_infer, mask: tr.mis_weights(logp_old, logp_infer, mask),
            ("logp_old", "logp_infer"),
        ),
        "seq_tis_weights": (
            lambda logp_old, logp_infer, mask: tr.seq_tis_weights(logp_old, logp_infer, mask),
            ("logp_old", "logp_infer"),
        ),
        "geo_mask_weights": (
            lambda logp_old, logp_infer, mask: tr.geo_mask_weights(logp_old, logp_infer, mask),
            ("logp_old", "logp_infer"),
        ),
        "seq_mask_weights": (
            lambda logp_old, logp_infer, mask: tr.seq_mask_weights(logp_old, logp_infer, mask),
            ("logp_old", "logp_infer"),
        ),
        "cis_weights": (
            lambda logp_old, logp_infer, mask: tr.cis_weights(logp_old, logp_infer, mask),
            ("logp_old", "logp_infer"),
        ),
        "dlc_weights": (
            lambda logp_old, logp_infer, mask: tr.dlc_weights(logp_old, logp_infer, mask),
            ("logp_old", "logp_infer"),
        ),
        "copc_mask": (
            lambda logp_old, logp_infer, mask: tr.copc_mask(logp_old, logp_infer, mask),
            ("logp_old", "logp_infer"),
        ),
        **{
            n: (
                lambda logp_old, logp_infer, mask, _n=n: getattr(tr, _n)(
                    logp_old, logp_infer, mask
                ),
                ("logp_old", "logp_infer"),
            )
            for n in (
                "divergence_mask_weights",
                "divergence_seq_max_mask",
                "divergence_seq_mean_mask",
                "divergence_seq_sum_mask",
            )
        },
        "self_normalize_weights": (
            lambda weights, mask: tr.self_normalize_weights(weights, mask),
            ("weights",),
        ),
        "self_normalize_seq_weights": (
            lambda weights, mask: tr.self_normalize_seq_weights(weights, mask),
            ("weights",),
        ),
        "opsm_mask": (
            lambda logp, logp_infer, mask: tr.opsm_mask(
                logp, logp_infer, torch.zeros(mask.shape[0]), mask
            ),
            ("logp", "logp_infer"),
        ),
        "cispo_loss": (
            lambda logp, logp_infer, mask: tr.cispo_loss(
                logp, logp_infer, torch.zeros(mask.shape[0], 1), mask
            ),
            ("logp", "logp_infer"),
        ),
        "k2_penalty": (
            lambda logp, logp_infer, mask: tr.k2_penalty(logp, logp_infer, mask),
            ("logp", "logp_infer"),
        ),
        "mismatch_metrics": (
            lambda logp_train, logp_infer, mask: tr.mismatch_metrics(logp_train, logp_infer, mask),
            ("logp_train", "logp_infer"),
        ),
        "mismatch_ledger": (
            lambda logp, logp_old, logp_infer, mask: tr.mismatch_ledger(
                logp, logp_old, logp_infer, mask
            ),
            ("logp", "logp_old", "logp_infer"),
        ),
        "pg_loss": (
            lambda logp, mask: tr.pg_loss(logp, torch.zeros(mask.shape[0], 1), mask),
            ("logp",),
        ),
        "ppo_loss": (
            lambda logp, logp_prox, mask: tr.ppo_loss(
                logp, logp_prox, torch.zeros(mask.shape[0], 1), mask
            ),
            ("logp", "logp_prox"),
        ),
        "dlc_should_resync": (
            lambda logp, logp_old, mask: tr.dlc_should_resync(logp, logp_old, mask, 1),
            ("logp", "logp_old"),
        ),
        "dppo_loss": (
            lambda logp, logp_infer, mask: tr.dppo_loss(
                logp, logp_infer, torch.zeros(mask.shape[0], 1), mask
            ),
            ("logp", "logp_infer"),
        ),
        "dlc_loss": (
            lambda logp, logp_old, logp_infer, mask: tr.dlc_loss(
                logp, logp_old, logp_infer, torch.zeros(mask.shape[0], 1), mask
            ),
            ("logp", "logp_old", "logp_infer"),
        ),
        "score_centering_loss": (
            lambda logp, logp_infer, mask: tr.score_centering_loss(
                logp,
                torch.full((*mask.shape, 2), -1.0),
                logp_infer,
                torch.full((*mask.shape, 2), -1.0),
                torch.zeros(mask.shape[0], 1),
                mask,
            ),
            ("logp", "logp_infer"),
        ),
        "copc_advantages": (
            lambda logp, logp_infer, mask: tr.copc_advantages(
                torch.zeros(mask.shape), torch.zeros(mask.shape[0]), logp, logp_infer, mask
            ),
            ("logp", "logp_infer"),
        ),
        "calibrated_clip_bounds": (
            lambda ratio_lowprec, ratio_ref, mask: tr.calibrated_clip_bounds(
                ratio_lowprec, ratio_ref, torch.ones(mask.shape[0], 1), mask
            ),
            ("ratio_lowprec", "ratio_ref"),
        ),
    }


@pytest.mark.parametrize("name", sorted(_bt_functions()))
def test_every_bt_function_names_the_bad_argument(name):
    fn, args = _bt_functions()[name]
    mask = torch.ones(2, 3, dtype=torch.bool)
    good = {a: torch.full((2, 3), -0.5) for a in args}
    fn(mask=mask, **good)  # the well-formed call works
    for a in args:
        with pytest.raises(TypeError, match=a):
            fn(mask=mask, **(good | {a: [[0.0] * 3] * 2}))  # not a tensor
        with pytest.raises(ValueError, match=rf"{a} must have shape.*\(2, 3\)"):
            # wrong shape, the expected one is named
            fn(mask=mask, **(good | {a: torch.zeros(2, 4)}))
        with pytest.raises(TypeError, match=a):
            fn(mask=mask, **(good | {a: torch.zeros(2, 3, dtype=torch.long)}))  # not floating point
    with pytest.raises(TypeError, match="mask must be a bool"):
        fn(mask=mask.float(), **good)
    with pytest.raises(ValueError, match="mask must be a non-empty"):
        fn(mask=torch.ones(0, 3, dtype=torch.bool), **{a: torch.zeros(0, 3) for a in args})


NEUTRAL = {"tis_weights": 0.0, "mis_weights": 0.0, "seq_tis_weights": 0.0, "seq_mask_weights": 0.0,
           "geo_mask_weights": 0.0, "cis_weights": 1.0, "dlc_weights": 0.0,
           "copc_mask": 0.0, "divergence_mask_weights": 0.0, "divergence_seq_max_mask": 0.0,
           "divergence_seq_mean_mask": 0.0,
           # the documented weight of a non-finite token
           "divergence_seq_sum_mask": 0.0, "m2po_mask": 0.0}


@pytest.mark.parametrize("name", sorted(NEUTRAL))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_token_gets_its_documented_weight(name, bad):
    fn = getattr(tr, name)
    mask = torch.ones(2, 3, dtype=torch.bool)
    logp_old, logp_infer = torch.full((2, 3), -0.5), torch.full((2, 3), -0.5)
    logp_infer[0, 1] = bad
    w = fn(logp_old, logp_infer, mask)
    assert float(w[0, 1]) == NEUTRAL[name] and torch.isfinite(w).all()
    assert float(w[1, 1]) == 1.0, "other sequences are untouched"


def test_calibrated_clip_bounds_match_reference_clip_share():
    g = torch.Generator().manual_seed(0)
    B, T = 8, 64
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.where(torch.arange(B) % 2 == 0, 1.0, -1.0)[:, None].expand(B, T)
    ratio_ref = (0.15 * torch.randn(B, T, generator=g)).exp()
    # low precision: wider spread
    ratio_low = ratio_ref * (0.3 * torch.randn(B, T, generator=g)).exp()
    L, H = tr.calibrated_clip_bounds(ratio_ref, ratio_ref, adv, mask)
    neg = adv < 0
    share_ref = float((ratio_ref[neg] < 0.8).float().mean())
    assert abs(float((ratio_ref[neg] < L).float().mean()) - share_ref) < 1e-9
    assert 0.75 < L <= 0.85 and 1.2 < H < 1.36, "identical ratios give bounds near the nominal ones"
    L, H = tr.calibrated_clip_bounds(ratio_low, ratio_ref, adv, mask)
    assert abs(float((ratio_low[neg] < L).float().mean()) - share_ref) < 1e-9
    assert L < 0.8, "wider low-precision spread: a lower L clips the same share"
    share_fixed = float((ratio_low[neg] < 0.8).float().mean())
    assert share_fixed > share_ref + 0.05, (
        "anti-vacuity: the fixed bound clips more negative tokens"
    )


def test_dlc_resync_fires_on_growing_lag():
    """The trigger's own rule; that the loop never hands it the engine gap is
    test_dlc_lag_resync_in_a_run's."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 6, dtype=torch.bool)
    logp_old = -torch.rand(4, 6, generator=g)
    direction = torch.randn(4, 6, generator=g).sign()
    fired = [
        tr.dlc_should_resync(
            logp_old + 0.01 * k * direction, logp_old, mask, staleness=k, max_lag=0.045
        )
        # the trainer drifts away from the behaviour weights by 0.01 per step
        for k in range(10)
    ]
    assert fired == [False] * 5 + [True] * 5, fired
    assert not tr.dlc_should_resync(logp_old, logp_old, mask, staleness=100, max_lag=0.05), (
        "no lag, no resync"
    )
    assert tr.dlc_should_resync(logp_old, logp_old, mask, staleness=4, max_staleness=4, max_lag=0.0)
    assert not tr.dlc_should_resync(
        logp_old + 1.0, logp_old, mask, staleness=3, max_staleness=4, max_lag=0.0
    )
    bad = logp_old.clone()
    bad[0, 0] = math.nan
    assert tr.dlc_should_resync(bad, logp_old, mask, staleness=0), "an unmeasurable lag resyncs"
    assert not tr.dlc_should_resync(
        bad, logp_old, mask, staleness=9, max_staleness=0, max_lag=0.0
    ), "both off"
    assert not tr.dlc_should_resync(
        bad, logp_old, mask, staleness=1, max_staleness=10, max_lag=0.0
    ), "the lag trigger off: an unmeasurable lag is no reason, the staleness one not reached"


# ==================================================================================================
# corrections in the RL step: each arm's per-token weight on a hand-made batch is its formula


RHO = torch.tensor([[1.111], [0.909], [1.05], [0.95]])  # p_old / q of four tokens


ADV = torch.tensor([[1.0], [1.0], [-1.0], [-1.0]])


def test_calibrated_arm_weights_by_rho_not_rho_squared():
    logp_old = torch.log(torch.tensor([[0.5], [0.4], [0.6], [0.3]]))
    q = logp_old - RHO.log()
    # no lag: p = p_prox = p_old
    w = _arm_weights("calibrated", logp_old, logp_old, logp_old, q, ADV)
    assert torch.allclose(w, RHO, atol=1e-5), w
    assert not torch.allclose(w, RHO.square(), atol=1e-2), (
        "the old arm counted the engine gap twice"
    )
    assert torch.allclose(
        _arm_weights("ppo_infer", logp_old, logp_old, logp_old, q, ADV), RHO, atol=1e-5
    )


def test_decoupled_ppo_arm_weights_by_proximal_over_behaviour_and_clips_the_update():
    logp_infer = torch.log(torch.tensor([[0.5], [0.4], [0.6], [0.3]]))
    logp_old = logp_infer + RHO.log()  # engine gap rho
    lag = torch.tensor([[0.3], [-0.1], [0.2], [-0.4]])
    logp_prox = logp_old + lag  # the trainer moved on since the sampler's weights (staleness)
    behaviour = (logp_prox - logp_infer).exp().clamp(max=2.0)  # AReaL: min(p_prox / q, C)
    # first update: p = p_prox
    w_first = _arm_weights("ppo", logp_prox, logp_prox, logp_old, logp_infer, ADV)
    assert torch.allclose(w_first, behaviour, atol=1e-5), (w_first, behaviour)
    # r = p / p_prox = 1.35, 1.25, 0.90, 0.74
    update = torch.tensor([[0.3], [0.22], [-0.1], [-0.3]])
    w_second = _arm_weights("ppo", logp_prox + update, logp_prox, logp_old, logp_infer, ADV)
    r = update.exp()
    expected = torch.where(
        torch.tensor([[True], [False], [False], [True]]), torch.zeros(4, 1), r * behaviour
    )
    assert torch.allclose(w_second, expected, atol=1e-5), (w_second, expected)
    # the behaviour-anchored variant it replaced clipped p / p_old: the first token (r_old = 1.35 *
    # e^0.3) got 0
    assert w_first[0, 0] > 0


def test_dlc_arm_centres_numerics_and_caps_lag_separately():
    logp_infer = torch.log(torch.tensor([[0.5], [0.4], [0.6], [0.3]]))
    logp_old = logp_infer + RHO.log() + 0.7  # a persistent engine offset of 0.7 on top of rho
    # lag: e^1 = 2.7 is above the cap 2
    logp_prox = logp_old + torch.tensor([[1.0], [0.1], [-0.2], [0.0]])
    w = _arm_weights("dlc", logp_prox, logp_prox, logp_old, logp_infer, ADV)
    d = RHO.log() + 0.7
    centred = (d - d.mean()).clamp(-1, 1).exp()
    lag = (logp_prox - logp_old).exp().clamp(max=2.0)
    assert torch.allclose(w, centred * lag, atol=1e-5), (w, centred * lag)


@pytest.mark.parametrize(
    "correction,expected",
    [
        ("none", lambda rho: torch.ones_like(rho)),
        ("tis", lambda rho: rho.clamp(max=2.0)),
        ("cis", lambda rho: rho.clamp(max=1 + 2.3 * 0.5)),
        # DPPO: token 0 (A > 0) already gained p - q = 0.33
        # > 0.2
        ("dppo", lambda rho: rho * torch.tensor([[0.0], [1], [1], [1]])),
    ],
)
def test_weight_arms_on_a_hand_made_batch(correction, expected):
    logp_old = torch.log(torch.full((4, 1), 0.5))
    rho = torch.tensor([[3.0], [0.5], [1.2], [0.8]])
    w = _arm_weights(correction, logp_old, logp_old, logp_old, logp_old - rho.log(), ADV)
    assert torch.allclose(w, expected(rho), atol=1e-5), (correction, w)


# ==================================================================================================
# copy-ready functions: each public math function runs from its own source plus the names on its
# `needs:` line


def _copy_calls():
    """name -> call(fn) on one fixed random batch: (B, T) = (3, 5) log-probs, a ragged mask, K = 4,
    V = 11."""
    g = torch.Generator().manual_seed(0)
    B, T, K, V = 3, 5, 4, 11
    a, b, c, d = (-3 * torch.rand(B, T, generator=g) for _ in range(4))
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 1])[:, None]
    adv = torch.tensor([[1.0], [-1.0], [0.5]])
    # sum_K p < 1
    head, head_infer = (-3 * torch.rand(B, T, K, generator=g) - math.log(K + 1) for _ in range(2))
    x, dx = torch.randn(64, generator=g), 1e-3 * torch.randn(64, generator=g)
    logits, ids = (
        torch.randn(B, T, V, generator=g).requires_grad_(),
        torch.randint(V, (B, T), generator=g),
    )
    logp_grad = a.clone().requires_grad_(True)
    # (B, S, L, k), -1 gaps
    routes_a, routes_b = (torch.randint(-1, 4, (B, T, 2, 2), generator=g) for _ in range(2))
    # kept ids, rows whose first id is 0 emptied (merge_support)
    kept = torch.randint(0, 3, (B, T, 3), generator=g)
    weight_calls = {
        n: lambda f: f(a, b, mask)
        for n in (
            "tis_weights",
            "mis_weights",
            "seq_tis_weights",
            "seq_mask_weights",
            "geo_mask_weights",
            "cis_weights",
            "dlc_weights",
            "copc_mask",
            "copc_residual_weights",
            "mismatch_metrics",
            "divergence_mask_weights",
            "divergence_seq_max_mask",
            "divergence_seq_mean_mask",
            "divergence_seq_sum_mask",
        )
    }
    return (
        weight_calls
        | {
            **{n: lambda f: f(a - b) for n in ("kl_k1", "kl_k2", "kl_k3")},
            "self_normalize_weights": lambda f: f(b.exp(), mask),
            "self_normalize_seq_weights": lambda f: f(d[:, :1].exp().expand(B, T), mask),
            "opsm_mask": lambda f: f(a, b, adv, mask, 0.1),
            "cispo_loss": lambda f: f(a, b, adv, mask),
            "k2_penalty": lambda f: f(a, b, mask),
            "masked_mean": lambda f: f(a, mask),
            "token_logprobs": lambda f: f(logits[:, 1:], ids[:, 1:]),  # a strided slice: by blocks
            "support_differs": lambda f: f(
                torch.randint(-1, V, (B, T, 3), generator=g),
                torch.randint(-1, V, (B, T, 2), generator=g),
                mask,
            ),
            "drift_signal_norms": lambda f: _drift_call(f, head, head_infer, b, adv, mask),
            "merge_support": lambda f: f(
                kept.masked_fill(kept[..., :1] == 0, -1), kept[..., :2], mask
            ),
            "log1mexp": lambda f: f(a),
            "mismatch_ledger": lambda f: f(a, b, c, mask, d),
            "routing_flip_rate": lambda f: f(routes_a, routes_b, mask),
            "log_odds_displacement": lambda f: f(a, b),
            "round_nearest_bf16": lambda f: f(x),
            "stochastic_round_bf16": lambda f: f(x, generator=torch.Generator().manual_seed(1)),
            "error_feedback_round_bf16": lambda f: f(x, dx),
            "visible_update_fraction": lambda f: f(
                x, x + dx, x.bfloat16().float(), (x + dx).bfloat16().float()
            ),
            "grpo_advantages": lambda f: f(
                torch.rand(6, generator=torch.Generator().manual_seed(2)), 3, True
            ),
            "copc_advantages": lambda f: f(c, d[:, 0].exp(), a, b, mask),
            "calibrated_clip_bounds": lambda f: f(a.exp(), b.exp(), adv, mask),
            "pg_loss": lambda f: f(a, adv, mask, b.exp()),
            "ppo_loss": lambda f: f(a, b, adv, mask),
            "score_centering_loss": lambda f: f(a, head, b, head_infer, adv, mask),
            "dlc_loss": lambda f: f(a, b, c, adv, mask),
            "dppo_loss": lambda f: f(a, b, adv, mask),
            "dppo_kl_loss": lambda f: f(a, b, adv, mask, 0.02, 0.02),
            "binary_kl_mask": lambda f: f(a, b, adv, mask, 0.02, 0.02),
            "sapo_loss": lambda f: f(a, b, adv, mask),
            "m2po_mask": lambda f: f(a, b, mask, 0.5),
            "prox_logp_loglinear": lambda f: f(
                a, b, torch.tensor([[3, 4, 5, 6, 7]] * 3) - torch.arange(3)[:, None], mask, 7
            ),
            "gspo_loss": lambda f: f(a, b, adv, mask, 0.01, 0.02),
            "aggregate_loss": lambda f: f(a, mask, "seq-mean-token-mean"),
            "effective_token_weights": lambda f: f(
                -(logp_grad * adv).sum(), logp_grad, adv, mask
            ).nan_to_num(-9.0),
            "dlc_should_resync": lambda f: f(a, b, mask, 3, 0, 0.05),
            "truncation_mask": lambda f: f(logits.detach(), 0.8, 6, 0.05),
            "support_ids": lambda f: f(
                torch.rand(B, T, V, generator=torch.Generator().manual_seed(3)) < 0.3
            ),
            "renormalize_on_support": lambda f: f(
                logp_grad, torch.cat([logp_grad[..., None], head], -1)
            ),
            "format_diagnosis": lambda f: f(tr.diagnose_mismatch(a, b, mask, advantages=adv)),
            "diagnose_mismatch": lambda f: str(
                f(a, b, mask, advantages=adv, routes=(routes_a, routes_b))
            ),
        }
    )


def _drift_call(f, head, head_infer, logp_infer, adv, mask):
    """drift_signal_norms on a (B, T) linear model's log-probs: its parameters are the leaves."""
    w = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape).requires_grad_(True)
    logp = torch.nn.functional.logsigmoid(w) - 1.0  # (B, T) log-probs of the sampled tokens
    logp_topk = head + 0.1 * w[..., None]  # (B, T, K), sum_K p < 1
    return f([w], logp, logp_topk, logp_infer, head_infer, adv, mask)


# The modules whose copy-ready functions these tests read (the lab's tests add its statistics
# module)
HOMES = (tr,)


def _home(name: str):
    """The first module in HOMES that defines `name`."""
    return next(m for m in HOMES if hasattr(m, name))


def _own_needs(name: str) -> list[str]:
    """The names after `needs:`, the last thing in <module>.<name>'s docstring ([] for `needs:
    nothing`)."""
    _, found, tail = (getattr(_home(name), name).__doc__ or "").rpartition("needs:")
    assert found, f"{name}: the docstring does not end with a needs: line"
    return [] if tail.strip() == "nothing" else [n.strip() for n in tail.split(",")]


def _needs(name: str) -> list[str]:
    """Everything a copy of `name` needs: its needs: line, taken as the whole list (a copy made from
    it alone runs; the test below checks that every name those functions use is on it)."""
    return _own_needs(name)


def test_a_needs_line_lists_what_its_needs_need():
    """The twin of the copy test: a needs: line that leaves out what a listed helper uses
    (tis_weights without _check_bt, which _log_ratio calls) is caught by the same check the copy
    test makes."""
    listed = [n for n in _needs("tis_weights") if n != "_check_bt"]
    used = set().union(*(_module_names_used(getattr(tr, n)) for n in ["tis_weights", *listed]))
    assert "_check_bt" in used - set(listed)


def _module_names_used(obj) -> set[str]:
    """Module-level names read or written by obj's code in a module of HOMES (nested code and class
    methods included), less torch, math and builtins. A constant (or what torch.compile built from a
    function) uses none."""
    import builtins
    import dis
    import inspect

    members = vars(obj).values() if inspect.isclass(obj) else [obj]
    todo = [
        getattr(m, "__func__", m).__code__
        for m in members
        if inspect.isfunction(getattr(m, "__func__", m))
    ]
    todo = [code for code in todo if code.co_filename in {m.__file__ for m in HOMES}]
    names = set()
    while todo:
        code = todo.pop()
        names |= {
            i.argval
            for i in dis.get_instructions(code)
            if i.opname in ("LOAD_GLOBAL", "STORE_GLOBAL")
        }
        todo += [k for k in code.co_consts if inspect.iscode(k)]
    return {n for n in names if n not in ("torch", "math") and not hasattr(builtins, n)}


@functools.cache
def _module_source(module) -> tuple:
    """(source, its module-level statements) of a module, read and parsed once per test session."""
    import ast
    import inspect

    source = inspect.getsource(module)
    return source, ast.parse(source).body


def _copy_source(name: str) -> str:
    """What a user copies for `name`: a function's or class's source, or a constant's assignment."""
    import ast
    import inspect

    module, body = _module_source(_home(name))
    assigned = [
        n
        for n in body
        if isinstance(n, ast.Assign)
        and
        # a, b = ...
        any(name in {e.id for e in ast.walk(t) if isinstance(e, ast.Name)} for t in n.targets)
    ]
    return (
        ast.get_source_segment(module, assigned[0])
        if assigned
        else inspect.getsource(getattr(_home(name), name))
    )


def _plain(x):
    """An output as plain Python values (tensors as dtype + nested lists), so that == is bitwise
    equality."""
    if isinstance(x, torch.Tensor):
        return str(x.dtype), x.detach().tolist()
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


@pytest.mark.parametrize("name", sorted(_copy_calls()))
def test_function_runs_from_its_source_and_needs_alone(name):
    needs = _needs(name)
    for n in [name, *needs]:
        missing = _module_names_used(getattr(_home(n), n)) - set(needs)
        assert not missing, f"{name}: {n} uses {sorted(missing)}, not on the needs: line"
    used, todo = set(), [name]
    while todo:
        n = todo.pop()
        todo += sorted(_module_names_used(getattr(_home(n), n)) - used)
        used |= set(todo)
    assert not set(needs) - used, (
        f"{name}: needs: lists {sorted(set(needs) - used)}, which it does not use"
    )
    namespace = {"torch": torch, "math": math, "__builtins__": __builtins__}
    source = "\n\n".join(_copy_source(n) for n in [*needs, name])
    exec(source, namespace)  # noqa: S102 (the reference's own source)
    call = _copy_calls()[name]
    assert _plain(call(namespace[name])) == _plain(call(getattr(_home(name), name)))


def test_every_public_math_function_is_copy_tested():
    import inspect

    lines = inspect.getsource(tr).splitlines()
    at = {
        b: lines.index(f"# ---- {b} ----") + 1
        for b in (
            "log-space helpers",
            "MoE routing: record and replay (R2 / R3)",
            "fast paths (chunked log-probs)",
            "task and reward verifier",
        )
    }
    math_lines = range(at["log-space helpers"], at["MoE routing: record and replay (R2 / R3)"])
    # the routing section holds model code
    fast_lines = range(at["fast paths (chunked log-probs)"], at["task and reward verifier"])
    public = {
        n
        for n, f in vars(tr).items()
        if inspect.isfunction(f)
        and f.__module__ == tr.__name__
        and not n.startswith("_")
        and (
            inspect.getsourcelines(f)[1] in math_lines or inspect.getsourcelines(f)[1] in fast_lines
        )
    }
    assert public <= set(_copy_calls()), "each is run from its source alone"


# ==================================================================================================
# device-following: every tensor a function builds lives on its inputs' device (caught on a CPU-only
# machine)


# planted: the index built on the CPU whatever the seed's device
def _old_hash_noise16(shape, seed):
    h = torch.arange(math.prod(shape), dtype=torch.int32).reshape(shape) * -1640531535 + seed
    return (h ^ ((h >> 16) & 0xFFFF)) & 0xFFFF


def _old_stochastic_round_bf16(x, generator=None):  # planted: noise drawn on the CPU, then copied
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=generator).to(x.device)
    return ((x.view(torch.int32) + noise) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def test_the_factory_watch_catches_host_built_tensors():
    """Anti-vacuity for the device-following tests below: yesterday's hash index and CPU-drawn SR
    noise are caught, today's functions on the same inputs are not."""
    seed, x = torch.tensor(7, dtype=torch.int32), torch.randn(64)
    for old in (
        lambda: _old_hash_noise16((4, 5), seed),
        lambda: _old_stochastic_round_bf16(x, torch.Generator()),
    ):
        with HostFactoryWatch(files=(__file__,)) as watch:
            old()
        assert watch.found and watch.found[0].startswith(("arange", "randint")), watch.found
    with HostFactoryWatch() as watch:
        tr.stochastic_round_bf16(x, generator=torch.Generator())
    assert watch.found == []


@pytest.mark.parametrize("name", sorted(_copy_calls()))
def test_public_math_builds_its_tensors_on_the_inputs_device(name):
    call = _copy_calls()[name]  # inputs are built before the watch starts
    with HostFactoryWatch() as watch:
        call(getattr(_home(name), name))
    assert watch.found == [], f"{name} builds tensors on the default device: {watch.found}"


def test_arguments_on_two_devices_are_a_value_error_naming_both():
    """Checked on a CPU-only machine with "meta" tensors (shape and device, no data) against CPU
    ones."""
    mask = torch.ones(2, 3, dtype=torch.bool)
    a, meta = torch.zeros(2, 3), torch.zeros(2, 3, device="meta")
    logits, ids = torch.zeros(2, 3, 5, device="meta"), torch.zeros(2, 3, dtype=torch.long)
    calls = [
        lambda: tr.tis_weights(meta, a, mask),
        lambda: tr.pg_loss(a, meta[:, :1], mask),
        lambda: tr.token_logprobs(logits, ids),
        lambda: tr.error_feedback_round_bf16(a, meta),
        lambda: tr.stochastic_round_bf16(meta, generator=torch.Generator()),
        lambda: tr.stochastic_round_bf16(
            a, noise=torch.zeros(2, 3, dtype=torch.int32, device="meta")
        ),
        lambda: tr.score_centering_loss(a, meta[..., None], a, a[..., None], a[:, :1], mask),
        lambda: tr.score_centering_loss(a, a[..., None], a, meta[..., None], a[:, :1], mask),
        lambda: tr.copc_advantages(a, meta[:, 0], a, a, mask),
        lambda: tr.visible_update_fraction(a, a, meta, a),
        lambda: tr.renormalize_on_support(a, meta[..., None]),
        lambda: tr.log_odds_displacement(a, meta),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"(on meta.*on cpu|on cpu.*on meta)"):
            call()
    # anti-vacuity: the same calls with every argument on one device pass the check
    tr.tis_weights(a, a, mask), tr.pg_loss(a, a[:, :1], mask), tr.error_feedback_round_bf16(a, a)
    (
        tr.token_logprobs(torch.zeros(2, 3, 5), ids),
        tr.stochastic_round_bf16(a, generator=torch.Generator()),
    )


# ==================================================================================================
# the verifier: a table of its semantics, hostile text, huge text, model text never run


VERIFY_CASES = [  # (text, answer, reward): the documented semantics of verify, near-misses included
    # where the answer is read
    ("47", "47", 1.0),
    ("the sum is 47", "47", 1.0),
    ("\\boxed{47}", "47", 1.0),
    ("x #### 47", "47", 1.0),
    ("\\boxed{12} then 47", "12", 1.0),
    ("#### 5 and 6", "5", 1.0),
    ("#### 1 #### 2", "2", 1.0),
    ("12 then 47", "12", 0.0),
    ("\\boxed{4{7}}", "47", 0.0),
    ("\\boxed{47", "47", 1.0),
    ("\\boxed{ 47 }", "47", 1.0),
    ("\\boxed{\\boxed{47}}", "47", 1.0),
    ("#### no number", "47", 0.0),
    # number forms
    ("1,234", "1234", 1.0),
    ("1,234,567", "1234567", 1.0),
    ("12,34", "1234", 0.0),
    ("1,23,4", "1234", 0.0),
    ("-47", "-47", 1.0),
    ("+47", "47", 1.0),
    ("47.0", "47", 1.0),
    ("47.50", "47.5", 1.0),
    ("3/4", "0.75", 1.0),
    ("6/8", "3/4", 1.0),
    ("047", "47", 1.0),
    ("0", "0", 1.0),
    ("-0", "0", 1.0),
    ("1/0", "0", 0.0),
    # text around the number
    ("47.", "47", 1.0),
    ("47%", "47", 1.0),
    ("47 apples", "47", 1.0),
    ("$47", "47", 1.0),
    ("(47)", "47", 1.0),
    # near-misses that must score 0
    ("-47", "47", 0.0),
    ("47.5", "47", 0.0),
    ("4 7", "47", 0.0),
    ("470", "47", 0.0),
    ("4.7e1", "47", 0.0),
    ("4.7e1", "1", 0.0),
    ("1e3", "1000", 0.0),
    ("\u0664\u0667", "47", 0.0),
    ("\uff14\uff17", "47", 0.0),
    ("", "47", 0.0),
    ("no number", "47", 0.0),
    ("4" * 65, "4" * 65, 0.0),
    ("47", "forty-seven", 0.0),
    # model text is data, never code
    ("__import__('os').system('x')", "0", 0.0),
    ("eval('40+7')", "47", 0.0),
    ("$(echo 47)x", "47", 1.0),
]


@pytest.mark.parametrize("text,answer,expected", VERIFY_CASES)
def test_verify_table(text, answer, expected):
    assert tr.verify(text, answer) == expected


FUZZ_FRAGMENTS = [
    "\\boxed{",
    "{",
    "}",
    "####",
    "#",
    "-",
    "+",
    ",",
    ".",
    "/",
    "e",
    "E",
    "7",
    "0",
    " ",
    "\n",
    "\x00",
    "\\",
    "٤",
    "７",
    "%",
    "$",
    "\ud7ff",
    "\U0001f600",
    "1,234",
    "3/4",
    "4.7e1",
    "\\boxed{47}",
]


@st.composite
def hostile_text(draw):
    """Arbitrary unicode, binary-looking bytes, and runs of verifier-relevant fragments repeated up
    to 1e5 times."""
    kind = draw(st.sampled_from(["unicode", "binary", "runs"]))
    if kind == "unicode":
        return draw(st.text(max_size=2000))
    if kind == "binary":
        return draw(st.binary(max_size=4000)).decode("latin-1")
    pieces = draw(
        st.lists(
            st.tuples(st.sampled_from(FUZZ_FRAGMENTS), st.integers(1, 100_000)),
            min_size=1,
            max_size=6,
        )
    )
    return "".join(fragment * times for fragment, times in pieces)


@settings(max_examples=300)
@given(hostile_text(), st.sampled_from(["47", "-3/4", "1,234", "0"]))
def test_verify_never_raises(text, answer):
    assert tr.verify(text, answer) in (0.0, 1.0)
    found = tr.extract_answer(text)
    assert found is None or isinstance(found, str)


@pytest.mark.parametrize("size", [10**6, 4 * 10**6])
def test_verify_reads_only_the_tail_of_huge_text(size):
    """1 MB and 4 MB inputs are truncated to the last MAX_VERIFY_CHARS characters, not scanned
    whole."""
    assert tr.verify("\\boxed{" * (size // 7) + "47", "47") == 1.0
    assert tr.verify("47 " + "{" * size, "47") == 0.0, "the 47 lies outside the tail that is read"
    assert tr.verify("9" * size, "9" * 10) == 0.0


def test_verify_never_executes_model_text(tmp_path, monkeypatch):
    import builtins

    def forbidden(*args, **kwargs):
        raise AssertionError("model text reached eval/exec/compile")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, forbidden)
    sentinel = tmp_path / "pwned"
    payloads = [
        f"__import__('os').system('touch {sentinel}')",
        f"$(touch {sentinel})",
        f"`touch {sentinel}`",
        f"; touch {sentinel} #### 47",
        "{{7*7}}",
        "exec('x=47')",
        "import os; os.remove('/')",
        f"\\boxed{{__import__('pathlib').Path('{sentinel}').touch()}}",
    ]
    rewards = [tr.verify(p, "49") for p in payloads]
    assert rewards == [0.0] * len(payloads)
    assert not sentinel.exists(), "nothing ran"
    assert tr.verify("#### 47", "47") == 1.0, "the verifier still works without eval"


# ==================================================================================================
# the 2026 corrections: divergence masks and the sequence veto, self-normalised weights, OPSM,
# CISPO, the k2 term


def _pq_categorical():
    """A trainer p and a sampler q over 3 tokens, and an advantage per token (float64)."""
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    return p, q, torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)


def test_k1_and_k3_estimate_the_kl_without_bias_and_k2_does_not():
    """E_{y~q}[k(log rho_y)] against KL(q || p) = sum_y q_y log(q_y / p_y), by enumeration (rho = p
    / q)."""
    p, q, _ = _pq_categorical()
    log_rho = p.log() - q.log()
    kl = float((q * (q / p).log()).sum())
    assert torch.equal(tr.kl_k1(log_rho), -log_rho)
    assert torch.allclose(tr.kl_k2(log_rho), log_rho.square() / 2)
    assert torch.allclose(tr.kl_k3(log_rho), log_rho.exp() - 1 - log_rho)
    assert abs(float((q * tr.kl_k1(log_rho)).sum()) - kl) < 1e-12
    assert abs(float((q * tr.kl_k3(log_rho)).sum()) - kl) < 1e-12
    assert (tr.kl_k3(log_rho) >= 0).all() and (tr.kl_k1(log_rho) < 0).any(), (
        "k3 >= 0 per token, k1 is signed"
    )
    assert abs(float((q * tr.kl_k2(log_rho)).sum()) - kl) > 1e-2, "anti-vacuity: k2 is biased"


def test_self_normalised_weights_trade_bias_for_variance_by_enumeration():
    """N tokens drawn from q: the IS estimate mean(rho f) of E_p[f] is unbiased, the self-normalised
    one sum(rho f) / sum(rho) is not (bias shrinking with N) but has less variance; every N-tuple
    enumerated."""
    import itertools

    p, q, f = _pq_categorical()
    target = float((p * f).sum())
    bias, variance = {}, {}
    for n in (2, 3):
        mask = torch.ones(n, 1, dtype=torch.bool)
        moments = torch.zeros(2, 2, dtype=torch.float64)  # (IS, SN) x (E, E[x^2])
        for ys in itertools.product(range(3), repeat=n):
            ys = list(ys)
            rho = tr.tis_weights(
                p[ys].log().float()[:, None], q[ys].log().float()[:, None], mask, cap=math.inf
            )
            estimates = torch.stack([tr.masked_mean(w * f[ys].float()[:, None], mask).double()
                                     for w in (rho, tr.self_normalize_weights(rho, mask))])
            moments += q[ys].prod() * torch.stack([estimates, estimates.square()], 1)
        assert abs(float(moments[0, 0]) - target) < 1e-6, "plain IS: unbiased"
        bias[n] = float(moments[1, 0]) - target
        variance[n] = (moments[:, 1] - moments[:, 0].square()).tolist()
        assert variance[n][1] < variance[n][0], ("self-normalised: less variance", variance)
    assert bias[2] < -0.4 and bias[2] < bias[3] < -0.1, ("biased, less so with more tokens", bias)


def test_self_normalised_weights_have_mean_one_per_token_or_per_sequence():
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    w = torch.tensor([[1.0, 2.0, 3.0, 2.0], [4.0, 9.0, 9.0, 9.0]])
    # token mean (1 + 2 + 3 + 2 + 4) / 5
    assert torch.allclose(tr.self_normalize_weights(w, mask), w * mask / 2.4)
    seq = torch.tensor([[2.0] * 4, [6.0] * 4])
    assert torch.allclose(
        tr.self_normalize_seq_weights(seq, mask), torch.tensor([[0.5] * 4, [1.5, 0, 0, 0]])
    )
    assert not torch.allclose(
        tr.self_normalize_weights(seq, mask), tr.self_normalize_seq_weights(seq, mask)
    ), "anti-vacuity: the token mean lets the long sequence count four times"
    assert torch.equal(tr.self_normalize_weights(torch.zeros(2, 4), mask), torch.zeros(2, 4)), (
        "all zero stays zero"
    )


# sequence 0 has one outlying token
LOG_RHO_SEQ = torch.tensor([[0.05, -0.05, 0.3], [0.05, 0.05, -0.05]])


def _k3(log_rho):
    return log_rho.exp() - 1 - log_rho


def test_the_trust_region_veto_drops_a_sequence_for_one_token_that_the_mean_forgives():
    """On one hand-made batch: k3 per token 0.0013, 0.0012, 0.050 | 0.0013, 0.0013, 0.0012;
    threshold 0.02."""
    logp_infer = torch.log(torch.full((2, 3), 0.4))
    logp_old = logp_infer + LOG_RHO_SEQ
    mask = torch.ones(2, 3, dtype=torch.bool)
    k3 = _k3(LOG_RHO_SEQ)
    by_token = (k3 <= 0.02).float()
    by_max = (k3.amax(1, keepdim=True) <= 0.02).float().expand(2, 3)
    by_mean = (k3.mean(1, keepdim=True) <= 0.02).float().expand(2, 3)
    by_sum = (k3.sum(1, keepdim=True) <= 0.02).float().expand(2, 3)
    assert torch.equal(tr.divergence_mask_weights(logp_old, logp_infer, mask, 0.02), by_token)
    assert torch.equal(tr.divergence_seq_max_mask(logp_old, logp_infer, mask, 0.02), by_max)
    assert torch.equal(tr.divergence_seq_mean_mask(logp_old, logp_infer, mask, 0.02), by_mean)
    assert torch.equal(tr.divergence_seq_sum_mask(logp_old, logp_infer, mask, 0.02), by_sum)
    assert by_sum.tolist() == [[0] * 3, [1] * 3], (
        "the sum (0.052 | 0.0038) drops what the mean (0.017) keeps"
    )
    assert by_token.tolist() == [[1, 1, 0], [1, 1, 1]] and by_max.tolist() == [[0] * 3, [1] * 3]
    assert by_mean.tolist() == [[1] * 3, [1] * 3], (
        "anti-vacuity: the mean keeps what the veto drops"
    )
    # the outlier is padding now: veto lifted
    ragged = torch.tensor([[True, True, False], [True, True, True]])
    assert tr.divergence_seq_max_mask(logp_old, logp_infer, ragged, 0.02).tolist() == [
        [1, 1, 0],
        [1, 1, 1],
    ]
    # k1 = log q / p is verl's band on q / p: mean k1 -0.1 | -0.017 against [log 0.8, log 0.95] =
    # [-0.22, -0.051]
    k1 = tr.divergence_seq_mean_mask(logp_old, logp_infer, mask, (0.8, 0.95), estimator=tr.kl_k1)
    assert k1.tolist() == [[1] * 3, [0] * 3]
    # |k1| <= 0.058
    lone = tr.divergence_seq_mean_mask(logp_old, logp_infer, mask, 1.06, estimator=tr.kl_k1)
    assert lone.tolist() == [[0] * 3, [1] * 3], "a lone u is the band [1/u, u]: the other sequence"
    assert tr.divergence_mask_weights(
        logp_old, logp_infer, mask, 1.06, estimator=tr.kl_k1
    ).tolist() == [[1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize(
    "correction,reduce",
    [("rs", None), ("rs_seq_max", "amax"), ("rs_seq_mean", "mean"), ("rs_seq_sum", "sum")],
)
def test_divergence_arms_weigh_each_token_by_their_formula(correction, reduce):
    """The arms on the (2, 3) batch above: REINFORCE's current p against q, k3 at threshold 0.02."""
    logp_infer = torch.log(torch.full((2, 3), 0.4))
    k3 = _k3(LOG_RHO_SEQ)
    statistic = k3 if reduce is None else getattr(k3, reduce)(1, keepdim=True).expand(2, 3)
    adv = torch.tensor([[1.0], [-1.0]])
    w = _arm_weights(
        correction,
        logp_infer + LOG_RHO_SEQ,
        logp_infer + LOG_RHO_SEQ,
        logp_infer + LOG_RHO_SEQ,
        logp_infer,
        adv,
        rs_threshold=0.02,
    )
    assert torch.allclose(w, (statistic <= 0.02).float(), atol=1e-6), (correction, w)


# (B, 1) hand-made batch of the other arm tests: p_old = 0.5, rho = p / q, A = +1, +1, -1, -1 (ADV)
RHO_2026 = torch.tensor([[3.0], [0.5], [1.2], [0.8]])
TAU = torch.where(ADV > 0, 1.0, 1.05)  # SAPO's gate temperatures by the advantage's sign


@pytest.mark.parametrize(
    "correction,cfg,expected",
    [
        # k3 0.90, 0.19, 0.018, 0.023: all dropped
        ("rs", {}, lambda rho: (_k3(rho.log()) <= 0.01).float()),
        (
            "rs",
            {"rs_threshold": 0.02},
            lambda rho: (_k3(rho.log()) <= 0.02).float(),
        ),  # token 2 kept
        (
            "rs",
            {"rs_threshold": 0.3, "rs_estimator": "k2"},
            lambda rho: (rho.log().square() / 2 <= 0.3).float(),
        ),
        (
            "rs",
            {"rs_threshold": 1.5, "rs_estimator": "k1"},
            lambda rho: (rho.log().abs() <= math.log(1.5)).float(),
        ),
        # T = 1: max = token
        ("rs_seq_max", {"rs_threshold": 0.02}, lambda rho: (_k3(rho.log()) <= 0.02).float()),
        # (2, .5, 1.2, .8) / 1.125
        ("tis_sn", {}, lambda rho: rho.clamp(max=2.0) / rho.clamp(max=2.0).mean()),
        # r = p / q capped at 1 + eps_high, nothing dropped
        ("cispo", {}, lambda rho: rho.clamp(max=1.28)),
        # OPSM: A < 0 and mean log q / p = -log rho > 0.1 drops the fourth sequence only (the third
        # has log q/p < 0)
        ("opsm", {"opsm_delta": 0.1}, lambda rho: torch.tensor([[1.0], [1], [1], [0]])),
        # k2: w = 1 - c (logp - logp_infer) / A
        ("none", {"k2_coef": 0.1}, lambda rho: 1 - 0.1 * rho.log() / ADV),
        # SAPO: w = f'(r) r = 4 s (1 - s) r, s = sigmoid(tau (r - 1)), tau 1 where A > 0, 1.05 where
        # A < 0
        (
            "sapo",
            {},
            lambda rho: (
                4 * torch.sigmoid(TAU * (rho - 1)) * (1 - torch.sigmoid(TAU * (rho - 1))) * rho
            ),
        ),
        # binary KL(q || p) 0.243 (moved toward A > 0: masked), q = 1 (against A), against A < 0,
        # 0.032 < 0.05
        ("dppo_kl", {}, lambda rho: torch.tensor([[0.0], [1], [1], [1]]) * rho),
        # M2PO: m2 = (log rho)^2 = 1.21, 0.48, 0.033, 0.050: the tail means fall below 0.04 once
        # three are dropped
        ("m2po", {}, lambda rho: torch.tensor([[0.0], [0], [1], [0]])),
        # TRL's sequence mask at cap 2: the sequence ratio, 0 for the sequence with p/q = 3 > 2
        ("seq_mask", {"seq_mask_cap": 2.0}, lambda rho: torch.tensor([[0.0], [1], [1], [1]]) * rho),
        # slime's mis.yaml: TIS 2 normalised by its batch mean (2 + .5 + 1.2 + .8) / 4, times the
        # band [0.5, 2] (3 is outside; 0.5 is in)
        (
            "slime_mis",
            {},
            lambda rho: rho.clamp(max=2.0) / 1.125 * torch.tensor([[0.0], [1], [1], [1]]),
        ),
    ],
)
def test_2026_arms_on_a_hand_made_batch(correction, cfg, expected):
    logp_old = torch.log(torch.full((4, 1), 0.5))
    w = _arm_weights(
        correction, logp_old, logp_old, logp_old, logp_old - RHO_2026.log(), ADV, **cfg
    )
    assert torch.allclose(w, expected(RHO_2026), atol=1e-5), (correction, cfg, w)
    assert not torch.allclose(w, torch.ones(4, 1), atol=1e-3), (
        "anti-vacuity: the arm did something here"
    )


@pytest.mark.parametrize(
    "correction",
    [
        "rs",
        "rs_seq_max",
        "rs_seq_mean",
        "rs_seq_sum",
        "tis_sn",
        "opsm",
        "cispo",
        "sapo",
        "dppo_kl",
        "m2po",
        "seq_mask",
        "slime_mis",
    ],
)
def test_2026_arms_reduce_to_plain_reinforce_without_mismatch(correction):
    logp = torch.log(torch.tensor([[0.5, 0.2], [0.4, 0.9], [0.6, 0.3], [0.3, 0.7]]))
    for cfg in ({}, {"k2_coef": 1e-3}):
        w = _arm_weights(correction, logp, logp, logp, logp, ADV, **cfg)  # p = p_prox = p_old = q
        assert torch.allclose(w, torch.ones(4, 2), atol=1e-6), (correction, cfg, w)
    # q moved
    w = _arm_weights(correction, logp, logp, logp, logp + torch.tensor([[0.4, 0.2]]), ADV)
    assert not torch.allclose(w, torch.ones(4, 2), atol=1e-3), "anti-vacuity"


def test_slime_mis_vetoes_a_sequence_with_one_token_below_its_floor():
    """slime's mis.yaml on two 2-token sequences, the first token at p / q = 1: a second token at
    p / q = 5e-5 (below the veto's 1e-4) zeroes its whole sequence; the twin, at 2e-4 (outside
    the band [0.5, 2] but above the veto), zeroes that token alone."""
    logp = torch.log(torch.full((2, 2), 0.5))
    for ratio, kept_first in ((5e-5, 0.0), (2e-4, 1.0)):
        log_rho = torch.tensor([[0.0, math.log(ratio)], [0.0, 0.0]])  # row 2: no mismatch
        w = _arm_weights("slime_mis", logp, logp, logp, logp - log_rho, torch.ones(2, 1))
        normaliser = (1 + ratio + 2) / 4  # TIS weights' mean over the batch's four tokens
        assert w[0].tolist() == pytest.approx([kept_first / normaliser, 0.0]), (ratio, w)
        assert w[1].tolist() == pytest.approx([1 / normaliser] * 2), (ratio, w)


def test_slime_mis_band_is_half_to_two():
    """Just inside and just outside each edge of slime's token band [0.5, 2]: p / q = 0.45 and 2.2
    are dropped, 0.55 and 1.9 kept with their TIS weight over the batch mean of min(p / q, 2)."""
    rho = torch.tensor([[0.45], [0.55], [1.9], [2.2]])
    logp = torch.log(torch.full((4, 1), 0.5))
    w = _arm_weights("slime_mis", logp, logp, logp, logp - rho.log(), torch.ones(4, 1))
    mean = (0.45 + 0.55 + 1.9 + 2.0) / 4
    assert w[:, 0].tolist() == pytest.approx([0.0, 0.55 / mean, 1.9 / mean, 0.0]), w


@given(logps_BT(), st.floats(min_value=-2.0, max_value=2.0, width=32))
def test_2026_functions_are_neutral_when_sampler_and_trainer_agree(data, a):
    logp, _, mask = data
    adv = torch.full((mask.shape[0], 1), a)
    for w in (
        tr.divergence_mask_weights(logp, logp, mask),
        tr.divergence_seq_max_mask(logp, logp, mask),
        tr.divergence_seq_mean_mask(logp, logp, mask),
        tr.divergence_seq_sum_mask(logp, logp, mask),
        tr.opsm_mask(logp, logp, adv, mask),
        tr.self_normalize_weights(tr.tis_weights(logp, logp, mask), mask),
        tr.self_normalize_seq_weights(tr.seq_tis_weights(logp, logp, mask), mask),
    ):
        assert torch.equal(w, mask.float())
    lp = logp.clone().requires_grad_(True)
    g_cispo, g_pg = (
        torch.autograd.grad(loss, lp)[0]
        for loss in (tr.cispo_loss(lp, logp, adv, mask, 0.0), tr.pg_loss(lp, adv, mask))
    )
    assert torch.equal(g_cispo, g_pg), "r = 1: CISPO is REINFORCE even with no room above 1"
    k2 = tr.k2_penalty(lp, logp, mask)
    assert float(k2.detach()) == 0.0 and torch.equal(
        torch.autograd.grad(k2, lp)[0], torch.zeros_like(lp)
    )


def test_opsm_keeps_good_samples_and_drops_bad_ones_the_trainer_already_disfavours():
    """TRL's rule, keep iff A >= 0 or mean_t(logp_infer - logp) <= delta; a non-finite token drops
    an A < 0 one."""
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]))
    gap = torch.tensor([[0.3], [0.3], [-0.3], [0.05]])  # mean log q / p per sequence
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0])
    w = tr.opsm_mask(logp, logp + gap, adv, torch.ones(4, 2, dtype=torch.bool), delta=0.1)
    assert w[:, 0].tolist() == [1, 0, 1, 1]
    assert tr.opsm_mask(logp + gap, logp, adv, torch.ones(4, 2, dtype=torch.bool), 0.1)[
        :, 0
    ].tolist() == [1, 1, 0, 1], "anti-vacuity: the sign matters (q over p, not p over q)"
    bad = logp + gap
    bad[0, 1] = bad[3, 1] = math.nan
    w = tr.opsm_mask(logp, bad, adv, torch.ones(4, 2, dtype=torch.bool), delta=0.1)
    assert w.tolist() == [[1, 0], [0, 0], [1, 1], [0, 0]]


def test_sequence_weights_bound_the_sum_not_each_token():
    """log rho = (+15, -30): the sequence's log-ratio is -15, its weight e^-15 = 3.1e-7 (verl, slime
    and TRL); a clamp of each token at +-20 first would give e^-5 = 6.7e-3. OPSM (delta 5): mean log
    q / p = 7.5 drops it."""
    log_rho = torch.tensor([[15.0, -30.0]])
    zero, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    assert tr.seq_tis_weights(log_rho, zero, mask)[0].tolist() == pytest.approx(
        [math.exp(-15)] * 2, rel=1e-5
    )
    assert tr.seq_mask_weights(log_rho, zero, mask, high=1.0)[0].tolist() == pytest.approx(
        [math.exp(-15)] * 2, rel=1e-5
    )
    assert tr.opsm_mask(log_rho, zero, torch.tensor([-1.0]), mask, delta=5.0).tolist() == [[0, 0]]
    assert tr.opsm_mask(log_rho, zero, torch.tensor([-1.0]), mask, delta=8.0).tolist() == [
        [1, 1]
    ], "anti-vacuity"
    # geo mean e^-7.5
    assert tr.geo_mask_weights(log_rho, zero, mask, 0.0, math.exp(-7.4)).tolist() == [[1, 1]]
    assert tr.tis_weights(log_rho, zero, mask, cap=math.inf)[0, 1] == pytest.approx(
        math.exp(-20), rel=1e-5
    ), "a token weight is still bounded where exp is taken"


def test_gspo_divides_per_token_engine_noise_by_the_length():
    """Per-token noise eps_t = +-sigma in log p / q, i.i.d. over T tokens: over all 2^T sign
    patterns (exact), token TIS's log-weights have variance sigma^2, GSPO's sequence ratio log s =
    mean_t eps_t has sigma^2 / T; its gradient is s_i A grad log p_t on every token (effective
    weight s_i).
    """
    import itertools

    sigma, T = 0.1, 4
    # (2^T, T)
    eps = torch.tensor(list(itertools.product((sigma, -sigma), repeat=T)), dtype=torch.float64)
    logp = torch.full_like(eps, math.log(0.5)).requires_grad_()
    logq = logp.detach() - eps
    mask = torch.ones_like(eps, dtype=torch.bool)
    adv = torch.ones(eps.shape[0], 1, dtype=torch.float64)
    log_w_tis = tr.tis_weights(logp.detach(), logq, mask, cap=math.inf).double().log()
    # no clip: the ratio alone
    loss = tr.gspo_loss(logp, logq, adv, mask, eps_low=math.inf, eps_high=math.inf)
    log_s = tr.effective_token_weights(loss, logp, adv, mask).log()
    assert torch.allclose(log_s, eps.mean(dim=1, keepdim=True).expand_as(eps), atol=1e-6)
    assert float(log_w_tis.var(unbiased=False)) == pytest.approx(sigma**2, rel=1e-5)
    assert float(log_s.var(unbiased=False)) == pytest.approx(sigma**2 / T, rel=1e-5)
    # the paper's 3e-4 / 4e-4: every s != 1 outside for A > 0
    clipped = tr.gspo_loss(logp, logq, adv, mask)
    kept = tr.effective_token_weights(clipped, logp, adv, mask)[:, 0]
    assert torch.equal(kept != 0, eps.sum(dim=1) <= 0), (
        "anti-vacuity: A > 0 keeps only s <= 1 + eps_high"
    )


def test_aggregation_modes_weigh_long_and_short_sequences_differently():
    """(B, T) = (3, 4), lengths 1, 4 and 0, per-token loss 1 | 2 | 5: token-mean 9/5,
    seq-mean-token-mean (1 + 2)/2, seq-mean-token-sum (1 + 8)/2, seq-mean-token-sum-norm 9/4 (verl's
    T); an all-masked row is left out."""
    x = torch.tensor([[1.0, 1, 1, 1], [2, 2, 2, 2], [5, 5, 5, 5]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    got = {
        m: float(tr.aggregate_loss(x, mask, m))
        for m in (
            "token-mean",
            "seq-mean-token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-sum-norm",
        )
    }
    assert got == {"token-mean": 9 / 5, "seq-mean-token-mean": 1.5, "seq-mean-token-sum": 4.5,
                   "seq-mean-token-sum-norm": 9 / 4}
    assert float(tr.aggregate_loss(x, mask, "token-mean")) == pytest.approx(
        float(tr.masked_mean(x, mask))
    )
    with pytest.raises(ValueError, match="mode must be"):
        tr.aggregate_loss(x, mask, "seq-mean")


def test_dppo_beyond_a_log_ratio_of_20_keeps_r_a_grad_log_p():
    """log p/q = 25, A = -1 (never masked: p - q > 0): value -r A / N and gradient -r A / N with r =
    e^25, as the docstring says; the asymmetric masks: delta_high bounds A > 0, delta_low A < 0."""
    logp = torch.tensor([[-1.0, -3.0]], dtype=torch.float64).requires_grad_()
    logq = torch.tensor([[-26.0, -3.0]], dtype=torch.float64)
    adv, mask = torch.tensor([[-1.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    loss = tr.dppo_loss(logp, logq, adv, mask)
    (g,) = torch.autograd.grad(loss, logp)
    assert float(loss) == pytest.approx((math.exp(25) + 1) / 2, rel=1e-12)
    assert g[0].tolist() == pytest.approx([math.exp(25) / 2, 0.5], rel=1e-12)
    logp = torch.log(torch.tensor([[0.6], [0.2]], dtype=torch.float64)).requires_grad_()
    # p - q = +0.3 (A > 0), -0.3 (A < 0)
    logq = torch.log(torch.tensor([[0.3], [0.5]], dtype=torch.float64))
    adv, mask = (
        torch.tensor([[1.0], [-1.0]], dtype=torch.float64),
        torch.ones(2, 1, dtype=torch.bool),
    )
    kept = {}
    for bounds in ({}, {"delta_high": 0.4}, {"delta_low": 0.4}, {"delta": 0.4}):
        w = tr.effective_token_weights(
            tr.dppo_loss(logp, logq, adv, mask, **bounds), logp, adv, mask
        )
        kept[tuple(bounds.items())] = (w[:, 0] != 0).tolist()
    assert list(kept.values()) == [[False, False], [True, False], [False, True], [True, True]]




# ==================================================================================================
# the mismatch doctor: each signature on hand-made tensors (with its absent twin), the numbers it
# reports


def _verdicts(diagnosis) -> dict:
    return {s["name"]: s["verdict"] for s in diagnosis.evidence}


def test_doctor_clean_and_numerics():
    p, q, mask = _doctor_tensors()
    clean = tr.diagnose_mismatch(p, p.clone(), mask)
    assert (
        clean.cause == "clean"
        and clean.also_possible == []
        and "present" not in _verdicts(clean).values()
    )
    p, q, mask = _doctor_tensors(noise=0.05)  # the twin: symmetric noise on the sampler's logits
    found = tr.diagnose_mismatch(p, q, mask)
    assert found.cause == "numerics" and _verdicts(found)["numerics"] == "present", found
    assert _verdicts(found)["truncation"] == _verdicts(found)["temperature"] == "absent"


def test_doctor_clean_cut_off_pinned_by_hard_negatives():
    """Hard negatives on both sides of the clean cut-off (mean |d| < 1e-4): the same fp32 logits
    reduced in another order (split-K, as a GPU engine at another batch shape or padding does; |d| ~
    6e-7) are clean; the same logits in fp16 (|d| ~ 1e-3, the weakest real engine) are not. A
    cut-off 100x looser fails the fp16 half; one 1,000x tighter fails the fp32 half."""
    g = torch.Generator().manual_seed(5)
    B, T, H, V = 64, 12, 64, 512
    # hidden states, head
    h, W = torch.randn(B, T, H, generator=g), 3 * torch.randn(H, V, generator=g) / H**0.5
    ids = torch.randint(0, V, (B, T, 1), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)

    def logp(logits):  # (B, T, V) -> (B, T)
        return logits.float().log_softmax(-1).gather(-1, ids)[..., 0]

    trainer = logp(h @ W)
    split_k = logp(h[..., : H // 2] @ W[: H // 2] + h[..., H // 2 :] @ W[H // 2 :])  # (B, T)
    fp16 = logp(h.half() @ W.half())
    assert 0 < (trainer - split_k).abs().mean() < 1e-6  # a real fp32-level gap, not bit-identical
    assert tr.diagnose_mismatch(trainer, split_k, mask).cause == "clean"
    found = tr.diagnose_mismatch(trainer, fp16, mask)
    assert found.cause == "numerics" and 5e-4 < found.numbers["mean |log p/q| per token"] < 5e-3, (
        found
    )


def test_doctor_numerics_is_not_named_beside_lag():
    """An fp32 sampler one optimizer step behind: every token moved both ways (Adam moves every
    weight), tilted toward the advantages. Lag is named; numerics, whose symmetric gap lag also
    makes, is not present ("cannot tell beside lag"). Twin: the same gap with unrelated advantages:
    no lag, so numerics is present."""
    p, _, mask = _doctor_tensors()
    g = torch.Generator().manual_seed(6)
    adv = torch.randn(p.shape[0], generator=g)
    # the sampler: p before the step
    q = p - 0.05 * torch.randn(p.shape, generator=g) - 0.05 * adv[:, None].sign()
    found = tr.diagnose_mismatch(p, q, mask, advantages=adv)
    assert found.cause == "lag" and _verdicts(found)["numerics"] == "cannot tell beside lag", found
    assert "numerics (not tested)" in found.also_possible
    unrelated = adv[torch.randperm(adv.numel(), generator=g)]
    twin = tr.diagnose_mismatch(p, q, mask, advantages=unrelated)
    assert _verdicts(twin)["lag"] == "absent" and _verdicts(twin)["numerics"] == "present", twin


def test_doctor_truncation_is_named_only_when_the_sampler_renormalised():
    p, q, mask = _doctor_tensors(top_k=4)
    found = tr.diagnose_mismatch(p, q, mask)
    # one-sided
    assert found.cause == "truncation" and _verdicts(found)["numerics"] == "absent", found
    assert ((p - q)[mask] <= 1e-6).all()  # p / q = S <= 1 on every token
    twin = tr.diagnose_mismatch(*_doctor_tensors(noise=0.05))
    assert _verdicts(twin)["truncation"] == "absent" and "truncation" not in [
        twin.cause,
        *twin.also_possible,
    ]
    # the exact test: p / q is a top-K prefix's mass
    *tensors, logp_all = _doctor_tensors(top_k=4, full=True)
    exact = tr.diagnose_mismatch(*tensors, logp_train_topk=logp_all)
    assert exact.cause == "truncation" and exact.evidence[5]["statistic"] > 0.99, exact
    *tensors, logp_all = _doctor_tensors(noise=0.05, full=True)
    exact_twin = tr.diagnose_mismatch(*tensors, logp_train_topk=logp_all)
    assert (
        exact_twin.evidence[5]["verdict"] == "absent" and exact_twin.evidence[5]["statistic"] < 0.1
    ), exact_twin


@pytest.mark.parametrize("tau", [0.7, 1.4])
def test_doctor_temperature_on_one_side(tau):
    found = tr.diagnose_mismatch(*_doctor_tensors(tau=tau))
    assert found.cause == "temperature", found
    twin = tr.diagnose_mismatch(*_doctor_tensors(tau=1.0, noise=0.05))
    assert _verdicts(twin)["temperature"] == "absent" and twin.cause != "temperature"


def test_doctor_misaligned_by_one_position():
    p, q, mask = _doctor_tensors(noise=0.02)
    shifted = torch.nn.functional.pad(q[:, 1:], (0, 1))  # q[t] := q[t + 1]
    found = tr.diagnose_mismatch(p, torch.where(mask, shifted, 0.0), mask)
    assert found.cause == "misaligned", found
    twin = tr.diagnose_mismatch(p, q, mask)
    assert _verdicts(twin)["misaligned"] == "absent" and twin.cause != "misaligned"


def test_doctor_padding_a_mask_one_token_long():
    p, q, mask = _doctor_tensors(noise=0.02)
    p = torch.where(mask, p, torch.full_like(p, -9.0))  # the trainer's log-prob of a pad token
    longer = mask | torch.nn.functional.pad(mask[:, :-1], (1, 0))
    found = tr.diagnose_mismatch(p, torch.where(mask, q, 0.0), longer)  # the sampler's pads are 0
    assert found.cause == "padding", found
    twin = tr.diagnose_mismatch(p, torch.where(mask, q, 0.0), mask)
    assert _verdicts(twin)["padding"] == "absent" and twin.cause != "padding"


def test_doctor_lag_needs_the_advantages():
    p, q, mask = _doctor_tensors(noise=0.02)
    adv = torch.randn(p.shape[0], generator=torch.Generator().manual_seed(1))
    moved = p + 0.05 * adv[:, None].sign()  # the trainer moved toward positive-advantage rows
    assert (
        _verdicts(tr.diagnose_mismatch(moved, q, mask))["lag"] == "cannot tell without advantages"
    )
    found = tr.diagnose_mismatch(moved, q, mask, advantages=adv)
    assert found.cause == "lag", found
    # the twin
    unrelated = adv[torch.randperm(adv.numel(), generator=torch.Generator().manual_seed(2))]
    twin = tr.diagnose_mismatch(moved, q, mask, advantages=unrelated)
    assert _verdicts(twin)["lag"] == "absent" and twin.cause != "lag", twin


@pytest.mark.parametrize("T", [8, 32, 170, 1024])
def test_doctor_lag_counts_rows_not_tokens(T):
    """GRPO advantages are one number per sequence, so the lag test's unit is the row. Null: no lag,
    a per-row gap (sd 0.03) plus token noise 0.01, B = 16, random +-1 row advantages: "lag" in <= 5
    % of 200 draws at every T. Twins: the same test counting tokens false-alarms at least twice as
    often, and a real lag (rows with A > 0 moved 0.05 above the rest) is found in nearly every draw.
    """
    g = torch.Generator().manual_seed(T)
    B, draws = 16, 200
    ok = torch.ones(B, T, dtype=torch.bool)
    rows = tokens = lagged = 0
    for _ in range(draws):
        logp_infer = -3 * torch.rand(B, T, generator=g)
        # (B, T), no lag
        d = 0.03 * torch.randn(B, 1, generator=g) + 0.01 * torch.randn(B, T, generator=g)
        adv = (2.0 * torch.randint(0, 2, (B, 1), generator=g) - 1).expand(B, T)
        rows += tr._lag_signature(logp_infer, d, ok, adv)["verdict"] == "present"
        up, down = d[adv > 0], d[adv < 0]  # the token-counted t (every token an independent sample)
        tokens += (
            float(
                (up.mean() - down.mean())
                / (up.var() / up.numel() + down.var() / down.numel()).sqrt()
            )
            > 3
        )
        lagged += tr._lag_signature(logp_infer, d + 0.05 * adv, ok, adv)["verdict"] == "present"
    assert rows <= 0.05 * draws, rows
    assert tokens >= 0.1 * draws, tokens  # why rows: token counting reads the per-row gap as lag
    assert lagged >= 0.95 * draws, lagged


def test_doctor_outliers_concentrate_in_a_few_rows():
    p, q, mask = _doctor_tensors(noise=0.02)
    far = q.clone()
    far[:4] = q[:4] - 1.5  # 4 of 128 rows from another policy
    found = tr.diagnose_mismatch(p, far, mask)
    assert found.cause == "outliers", found
    spread = (
        q - 1.5 * 4 / 128 * torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).sign()
    )
    twin = tr.diagnose_mismatch(p, spread, mask)  # as large a gap, over every row
    assert _verdicts(twin)["outliers"] == "absent" and twin.cause != "outliers", twin


@pytest.mark.parametrize("B", [1, 2, 19])
def test_doctor_cannot_tell_outliers_below_its_minimum_rows(B):
    """Below DOCTOR_MIN_ROWS rows the worst 5 % is a row picked for its size: outliers is 'cannot
    tell', so pure bf16-like noise on one row is not named outliers (it was: the worst 5 % of one
    row is the row). The twin: the same noise on DOCTOR_MIN_ROWS rows tests it (absent)."""
    p, q, mask = _doctor_tensors(B=B, noise=0.02)
    found = tr.diagnose_mismatch(p, q, mask)
    assert _verdicts(found)["outliers"] == f"cannot tell ({B} rows < {tr.DOCTOR_MIN_ROWS})"
    assert found.cause != "outliers", found
    twin = tr.diagnose_mismatch(*_doctor_tensors(B=tr.DOCTOR_MIN_ROWS, noise=0.02))
    assert _verdicts(twin)["outliers"] == "absent"


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 1)])
def test_doctor_never_names_temperature_from_one_or_two_tokens(shape):
    """A slope through one or two points is any slope: over 50 seeds of 5e-3 noise, temperature is
    never named and reads 'cannot tell' (1 x 1 read temperature 197 times in 200, 1 x 2 38). The
    twin: a real temperature, tau 1.5 on one side, is named on 8 x 6 tokens."""
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        p = -3 * torch.rand(*shape, generator=g)
        q = p + 5e-3 * torch.randn(*shape, generator=g)
        found = tr.diagnose_mismatch(p, q, torch.ones(*shape, dtype=torch.bool))
        assert found.cause != "temperature", (seed, found)
        assert _verdicts(found)["temperature"].startswith("cannot tell"), (seed, found)
    twin = tr.diagnose_mismatch(*_doctor_tensors(B=8, tau=1.5))
    assert _verdicts(twin)["temperature"] == "present"


def test_doctor_temperature_ignores_a_sentinel_log_prob():
    """vLLM's server writes -9999 for -inf: one such token in a 64 x 200 batch of bf16-like noise
    leaves the cause numerics (its log-ratio is past LOG_RATIO_CLAMP, so it is no slope). The twin:
    the slope with that token in is far from 1, as the doctor read it before."""
    g = torch.Generator().manual_seed(0)
    p = -3 * torch.rand(64, 200, generator=g)
    q = p + 0.01 * torch.randn(64, 200, generator=g)
    q[5, 7] = -9999.0
    found = tr.diagnose_mismatch(p, q, torch.ones(64, 200, dtype=torch.bool))
    assert found.cause == "numerics" and _verdicts(found)["temperature"] == "absent", found
    x, y = p.flatten() - p.mean(), q.flatten() - q.mean()
    assert abs(float(torch.dot(x, y) / torch.dot(x, x)) - 1) > 0.02


def test_doctor_on_one_token_warns_nothing_and_prints_no_nan():
    """A 1 x 1 batch: no degrees-of-freedom warning from a standard deviation of one value, the
    truncation test 'cannot tell', and nothing prints 'nan' (an empty p bucket prints '-', as the
    evidence table does). The twin: that bucket's number is nan, so printing it raw said 'nan'."""
    import warnings

    p, q = torch.tensor([[-0.5]]), torch.tensor([[-0.52]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = tr.diagnose_mismatch(p, q, torch.ones(1, 1, dtype=torch.bool))
    assert _verdicts(found)["truncation"].startswith("cannot tell")
    assert "nan" not in str(found).lower()
    assert math.isnan(found.numbers["mean |log p/q|, trainer p > 90 %"])


def test_doctor_reads_versions_on_the_mask_and_refuses_booleans():
    """Version ages are counted on the usable tokens: a pad holding 999 is no version (the newest
    was read as 999 and every token as 999 old). A bool tensor is refused, naming versions. The
    twin: the same pad value on the mask counts."""
    p, q, mask = _doctor_tensors(B=32, noise=0.01)
    versions = torch.zeros(mask.shape, dtype=torch.long).masked_fill(~mask, 999)
    ages = [k for k in tr.diagnose_mismatch(p, q, mask, versions=versions).numbers if "age" in k]
    assert ages == ["mean |log p/q|, version age 0"]
    versions[0, 0] = 999
    ages = [k for k in tr.diagnose_mismatch(p, q, mask, versions=versions).numbers if "age" in k]
    assert "mean |log p/q|, version age 999" in ages
    with pytest.raises(TypeError, match="versions"):
        tr.diagnose_mismatch(p, q, mask, versions=mask)


def test_doctor_warns_first_when_log_probs_are_above_zero():
    """Probabilities passed as log-probs (values in (0, 1]) read as some cause, so the printout's
    first line says so. The twin: the same batch as log-probs has no warning."""
    p, q, mask = _doctor_tensors(B=32, noise=0.01)
    found = tr.diagnose_mismatch(p.exp(), q.exp(), mask)
    assert str(found).startswith("warning: logp_train is > 0 on"), found
    assert "logp_infer is > 0" in str(found).splitlines()[1]
    assert not tr.diagnose_mismatch(p, q, mask).warnings


def test_doctor_cannot_tell_padding_without_an_interior():
    """256 rows of 1-2 tokens with the same symmetric noise on every token: no interior to compare
    the edges with, so padding is 'cannot tell' (it read ~40 against the 1e-3 floor and was named).
    The twin: rows of 3+ with the same noise test it (absent)."""
    g = torch.Generator().manual_seed(0)
    q = -torch.rand(256, 2, generator=g) - 0.1
    p = q + 0.05 * torch.randn(256, 2, generator=g)
    mask = torch.ones(256, 2, dtype=torch.bool)
    mask[::2, 1] = False  # rows of 1 and 2 tokens
    found = tr.diagnose_mismatch(p, q, mask)
    padding = next(s for s in found.evidence if s["name"] == "padding")
    assert padding["statistic"] > padding["threshold"], (
        "without the rule this batch would read padding"
    )
    assert padding["verdict"].startswith("cannot tell") and found.cause != "padding", found
    twin = tr.diagnose_mismatch(*_doctor_tensors(B=256, noise=0.05))
    assert _verdicts(twin)["padding"] == "absent"


def test_doctor_routing_needs_routes_and_flips_where_the_gap_is():
    p, q, mask = _doctor_tensors(B=128, noise=0.005)
    g = torch.Generator().manual_seed(4)
    routes = torch.randint(0, 8, (128, 6, 2, 2), generator=g)  # (B, T, L, k)
    flipped = routes.clone()
    flipped[:16, 2, 0, 0] = (routes[:16, 2, 0, 0] + 1) % 8  # 16 rows flip an expert at t = 2
    q_flip = q.clone()
    q_flip[:16, 2:] -= 0.3  # the gap from the flip on
    assert (
        _verdicts(tr.diagnose_mismatch(p, q_flip, mask))["routing"] == "cannot tell without routes"
    )
    found = tr.diagnose_mismatch(p, q_flip, mask, routes=(routes, flipped))
    assert found.cause == "routing", found
    elsewhere = flipped.roll(64, 0)  # the twin: the same flips on rows without the gap
    twin = tr.diagnose_mismatch(p, q_flip, mask, routes=(routes, elsewhere))
    assert _verdicts(twin)["routing"] == "absent" and twin.cause != "routing", twin


def test_doctor_numbers_are_the_shares_users_act_on():
    logp_infer = torch.zeros(2, 3)
    # ratios 3 and 0.4
    logp_train = torch.tensor([[math.log(3), 0.0, 0.0], [math.log(0.4), 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    numbers = tr.diagnose_mismatch(logp_train, logp_infer, mask).numbers
    assert numbers["tokens with p/q > 2 (TIS cap)"] == pytest.approx(1 / 5)
    assert numbers["tokens outside [0.5, 2] (IcePop)"] == pytest.approx(2 / 5)
    assert numbers["sequences outside [0.5, 2] (IcePop)"] == pytest.approx(1.0)
    assert numbers["max |log p/q|"] == pytest.approx(math.log(3))
    assert numbers["per-sequence sum log p/q, 0% percentile"] == pytest.approx(math.log(0.4))
    # over 5 tokens
    assert numbers["mean |log p/q| per token"] == pytest.approx((math.log(3) - math.log(0.4)) / 5)
    assert numbers["T, mean answer length (tokens)"] == 2.5  # answers of 2 and 3 tokens
    shown = str(tr.diagnose_mismatch(logp_train, logp_infer, mask))
    assert "cause:" in shown and "TRL sampling/sampling_logp_difference/mean" in shown
    with pytest.raises(ValueError, match="logp_infer must have shape"):
        tr.diagnose_mismatch(logp_train, logp_infer[:, :2], mask)


def test_doctor_numbers_place_the_gap_by_the_trainers_probability():
    """The gap by bucket of the trainer's p: a gap planted on tokens with p = 0.5 % shows in "<= 1
    %" alone, the same gap on p = 95 % tokens in "> 90 %" alone (the twin); a sequence at p/q = 4 is
    beyond TRL's sequence_mask cap 3, one at 2.5 is not."""
    for p_token, bucket in ((0.005, "<= 1 %"), (0.95, "> 90 %")):
        logp_train = torch.full((4, 6), math.log(0.3))
        logp_train[:, :2] = math.log(p_token)
        logp_infer = logp_train.clone()
        logp_infer[:, :2] -= 0.1  # the gap on the planted tokens only
        numbers = tr.diagnose_mismatch(
            logp_train, logp_infer, torch.ones(4, 6, dtype=torch.bool)
        ).numbers
        gaps = {label: numbers[f"mean |log p/q|, trainer p {label}"] for label in tr.GAP_P_LABELS}
        assert gaps.pop(bucket) == pytest.approx(0.1, abs=1e-5)
        assert gaps["10-50 %"] == 0.0 and all(
            math.isnan(v) for k, v in gaps.items() if k != "10-50 %"
        )
    logp_infer = torch.zeros(4, 3)
    logp_train = torch.zeros(4, 3)
    logp_train[0, 0], logp_train[1, 0] = math.log(4), math.log(2.5)
    numbers = tr.diagnose_mismatch(
        logp_train, logp_infer, torch.ones(4, 3, dtype=torch.bool)
    ).numbers
    assert numbers["sequences with p/q > 3 (TRL sequence_mask)"] == 0.25


def test_doctor_refuses_routes_and_topk_of_the_wrong_shape():
    p, q, mask = _doctor_tensors(noise=0.05)
    routes = torch.zeros(128, 6, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="routes must be"):
        tr.diagnose_mismatch(p, q, mask, routes=(routes, routes[:, :5]))
    with pytest.raises(ValueError, match="logp_train_topk"):
        tr.diagnose_mismatch(p, q, mask, logp_train_topk=torch.zeros(128, 5, 3))
    # the twin: shapes fit
    assert tr.diagnose_mismatch(p, q, mask, routes=(routes, routes)).cause == "numerics"


# ==================================================================================================
# half precision at the door: fp16 / bf16 log-probs give float32 results and finite gradients


def _half_batch(dtype):
    """(B, T) = (2, 4) log-probs in `dtype`: the trainer's p (a leaf with gradient), the sampler's
    q, one token at log p/q = 12 (beyond fp16's exp range, ~11.1), a ragged mask, A = +1 / -1, a (B,
    T, K = 3) top-K head."""
    q = torch.tensor([[-0.7, -13.0, -1.2, -0.4], [-0.9, -0.3, -2.0, -1.1]])
    p = q + torch.tensor([[0.05, 12.0, -0.1, 0.02], [-0.03, 0.01, 0.2, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    head = torch.log(torch.tensor([0.5, 0.2, 0.1])).expand(2, 4, 3)
    leaf = p.to(dtype).requires_grad_(True)
    return leaf, q.to(dtype), mask, torch.tensor([1.0, -1.0]), head.to(dtype)


HALF_WEIGHTS = [
    "tis_weights",
    "mis_weights",
    "seq_tis_weights",
    "seq_mask_weights",
    "geo_mask_weights",
    "cis_weights",
    "dlc_weights",
    "copc_mask",
    "divergence_mask_weights",
    "divergence_seq_max_mask",
    "divergence_seq_mean_mask",
    "divergence_seq_sum_mask",
    "copc_residual_weights",
    "m2po_mask",
]
HALF_LOSSES = {
    "pg_loss": lambda p, q, m, a, h: tr.pg_loss(p, a, m, tr.tis_weights(p, q, m)),
    "ppo_loss": lambda p, q, m, a, h: tr.ppo_loss(p, q, a, m),
    "dppo_loss": lambda p, q, m, a, h: tr.dppo_loss(p, q, a, m),
    "dppo_kl_loss": lambda p, q, m, a, h: tr.dppo_kl_loss(p, q, a, m),
    "sapo_loss": lambda p, q, m, a, h: tr.sapo_loss(p, q, a, m),
    "gspo_loss": lambda p, q, m, a, h: tr.gspo_loss(p, q, a, m),
    "cispo_loss": lambda p, q, m, a, h: tr.cispo_loss(p, q, a, m),
    "dlc_loss": lambda p, q, m, a, h: tr.dlc_loss(p, q, q, a, m),
    "k2_penalty": lambda p, q, m, a, h: tr.k2_penalty(p, q, m),
    "score_centering_loss": lambda p, q, m, a, h: tr.score_centering_loss(
        p, h + 0 * p[..., None], q, h, a, m
    ),
    "aggregate_loss": lambda p, q, m, a, h: tr.aggregate_loss(-(p - q), m, "seq-mean-token-sum"),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", HALF_WEIGHTS)
def test_every_weight_takes_half_precision_and_returns_float32(name, dtype):
    p, q, mask, _, _ = _half_batch(dtype)
    w = getattr(tr, name)(p.detach(), q, mask)
    assert w.dtype == torch.float32 and torch.isfinite(w).all(), (name, w)
    # the same numbers, upcast by the caller
    ref = getattr(tr, name)(p.detach().float(), q.float(), mask)
    assert torch.equal(w, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(HALF_LOSSES))
def test_every_loss_takes_half_precision_with_a_finite_float32_loss_and_gradient(name, dtype):
    p, q, mask, adv, head = _half_batch(dtype)
    loss = HALF_LOSSES[name](p, q, mask, adv, head)
    (grad,) = torch.autograd.grad(loss, p)
    assert loss.dtype == torch.float32 and torch.isfinite(loss), (name, loss)
    assert grad.dtype == dtype and torch.isfinite(grad).all(), (name, grad)


def test_without_the_door_fp16_overflows_at_a_log_ratio_of_12():
    """The twin: the ratio the losses take, computed in fp16 as the inputs come, is infinite and its
    gradient not finite, so the tests above would catch a loss that skipped the upcast."""
    p, q, mask, adv, _ = _half_batch(torch.float16)
    ratio = (p - q).exp()
    (grad,) = torch.autograd.grad((ratio * adv[:, None] * mask).sum(), p)
    assert torch.isinf(ratio[0, 1]) and not torch.isfinite(grad).all()


@pytest.mark.parametrize("name", ["ppo_loss", "dppo_loss"])
def test_a_kept_token_beyond_fp16_range_gets_a_saturated_gradient(name):
    """log p/q = 13.5 on a token the loss keeps (ppo: A < 0, the unclipped side; dppo: p - q ~ 0.08
    < delta): r |A| / N = 1.8e5 overflows fp16, so its gradient returns saturated at 65504 with the
    sign of the fp32 one. The twin: the fp32 gradient is that large, and a plain cast of it is inf."""
    q = torch.tensor([[-16.0, -1.0, -1.0, -1.0]])
    adv = torch.tensor([{"ppo_loss": -1.0, "dppo_loss": 1.0}[name]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    grads = {}
    for dtype in (torch.float16, torch.float32):
        p = torch.tensor([[-2.5, -1.0, -1.0, -1.0]], dtype=dtype, requires_grad=True)
        loss = getattr(tr, name)(p, q.to(dtype), adv, mask)
        (grads[dtype],) = torch.autograd.grad(loss, p)
    big = torch.finfo(torch.float16).max
    assert abs(float(grads[torch.float32][0, 0])) > 1e5
    assert torch.isinf(grads[torch.float32][0, 0].half())
    assert float(grads[torch.float16][0, 0]) == math.copysign(big, grads[torch.float32][0, 0])
    assert torch.equal(grads[torch.float16][0, 1:].float(), grads[torch.float32][0, 1:])


def test_score_centering_with_bf16_top_k_matches_fp32_at_k_equal_v():
    """K = V, one position: the bf16 head sums miss 1 by ~1e-3, which as tails against the floor
    1e-6 gave rho_tail ~ 1e3 and a 5x wrong gradient; floored at their rounding, the gradient on the
    logits is fp32's to 1 % (SC, SC + TIS, SC + MIS). The twin: the bf16 head's sum is off by more
    than TAIL_FLOOR, so a floor at TAIL_FLOOR reads rounding as a tail."""
    z_q = torch.log_softmax(torch.tensor([[[1.9455, 1.0567, 0.3189, -0.5916]]]), -1)
    mask, adv = torch.ones(1, 1, dtype=torch.bool), torch.ones(1)
    for kwargs in ({}, {"cap": 2.0}, {"band": (0.5, 5.0)}):
        grads = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            z = torch.tensor([[[2.0, 1.0, 0.3, -0.5]]], requires_grad=True)
            lp, lq = torch.log_softmax(z, -1).to(dtype), z_q.to(dtype)
            loss = tr.score_centering_loss(lp[..., 0], lp, lq[..., 0], lq, adv, mask, **kwargs)
            (grads[dtype],) = torch.autograd.grad(loss, z)
        for dtype in (torch.bfloat16, torch.float16):
            assert torch.allclose(grads[dtype], grads[torch.float32], rtol=0.01, atol=2e-3), kwargs
    head = torch.log_softmax(torch.tensor([2.0, 1.0, 0.3, -0.5]), -1).bfloat16()
    head_sum = float(head.float().exp().sum())  # as the loss reads it: upcast, then exp
    assert abs(1 - head_sum) > 10 * tr.TAIL_FLOOR


def test_calibrated_clip_bounds_compares_half_precision_ratios_in_float32():
    """Ratios exact in bf16 (1.28125, 1.5): upcast at the door, H is the fp32 answer, 1.0; compared
    in bf16, 1 + 0.28 rounds to 1.28125 and H came out 1.5. The twin: that rounding is real."""
    mask, adv = torch.ones(1, 4, dtype=torch.bool), torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    ratio_ref, ratio_low = torch.tensor([[1.0, 1.28125, 0.9, 1.0]]), torch.tensor([[1.0, 1.5, 0.9, 1.0]])
    fp32 = tr.calibrated_clip_bounds(ratio_low, ratio_ref, adv, mask)
    bf16 = tr.calibrated_clip_bounds(ratio_low.bfloat16(), ratio_ref.bfloat16(), adv, mask)
    assert bf16[1] == fp32[1] == 1.0
    assert float(torch.tensor(1 + 0.28).bfloat16()) == 1.28125


def test_mismatch_metrics_bound_the_ratio_not_the_log_ratio():
    """log q = -1000 against log p = 0 on one of two tokens: abs_diff is 500 and k1 -500, as their
    formulas say (clamping log r at 20 read 10 and -10); r, where exp is taken, is held at e^20.
    The twin: the ledger's total agrees with abs_diff."""
    logp, logp_infer = torch.zeros(1, 2), torch.tensor([[-1000.0, 0.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    m = tr.mismatch_metrics(logp, logp_infer, mask)
    assert (m["abs_diff"], m["max_abs_diff"], m["k1"]) == (500.0, 1000.0, -500.0)
    assert m["ratio_max"] == pytest.approx(math.exp(20.0)) and math.isfinite(m["chi2"])
    ledger = tr.mismatch_ledger(logp, logp, logp_infer, mask)
    assert ledger["total_abs"] == pytest.approx(m["abs_diff"])


def test_api_edges_raise_naming_the_argument():
    """What a copied function used to take silently: chunk_rows < 0 returned uninitialised memory,
    ids of another shape than the logits' (B, T) scattered into the wrong rows. The twins: the valid
    calls agree with the defaults."""
    logits = torch.randn(2, 3, 7)
    ids = torch.randint(7, (2, 3))
    with pytest.raises(ValueError, match="chunk_rows"):
        tr.token_logprobs(logits, ids, chunk_rows=-1)
    assert torch.equal(tr.token_logprobs(logits, ids, chunk_rows=1), tr.token_logprobs(logits, ids))
    with pytest.raises(ValueError, match="response_ids"):
        tr.kept_support_from_logits(logits, ids[:, :2], 0.9, 0, 0.0)
    assert tr.kept_support_from_logits(logits, ids, 0.9, 0, 0.0).shape[:2] == (2, 3)


def test_renormalize_on_support_upcasts_half_precision():
    """bf16 and fp16 log-probs come back float32 (they came back in half precision). The twin:
    the same numbers upcast by the caller give the same result."""
    logp = torch.log(torch.tensor([[0.3, 0.2]]))
    kept = torch.log(torch.tensor([[[0.3, 0.5], [0.2, 0.1]]]))
    for dtype in (torch.bfloat16, torch.float16):
        out = tr.renormalize_on_support(logp.to(dtype), kept.to(dtype))
        ref = tr.renormalize_on_support(logp.to(dtype).float(), kept.to(dtype).float())
        assert all(x.dtype == torch.float32 for x in out)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.parametrize("text, answer", [(".5", "5"), ("-.5", "5"), ("1_000", "0"), ("0x1F", "1"),
                                          ("v2", "2")])
def test_verify_reads_no_number_glued_to_what_precedes_it(text, answer):
    """A digit run right after a point, a letter or "_" is a fragment of something else: it earns
    no reward (each read as the fragment and scored 1). The twins: the number standing alone, or
    after a space, a sign or "=", is read."""
    assert tr.verify(text, answer) == 0.0
    assert tr.verify(f"x = {answer}", answer) == 1.0 and tr.verify(answer, answer) == 1.0


def test_dppo_loss_stays_finite_summed_over_a_batch_beyond_its_cap():
    """log r = 100 on 8 x 1,024 tokens: a finite loss and gradient (the cap's promise, 'even summed
    over a batch's tokens'). The twin: the old cap, e^80 per token, sums to inf over the same batch.
    """
    logp = torch.full((8, 1024), -1.0, requires_grad=True)
    mask = torch.ones(8, 1024, dtype=torch.bool)
    loss = tr.dppo_loss(logp, logp.detach() - 100.0, torch.ones(8), mask, delta=2.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.isinf(torch.full((8, 1024), math.exp(80.0)).sum())


# ==================================================================================================
# behaviour pins: planted one-line bugs each caught by what the function decides (issue 56, item 14)


def test_a_divergence_exactly_at_its_threshold_is_kept():
    """verl keeps a token whose divergence equals the threshold (<=): a planted `<` drops it. The
    twin: just above is dropped."""
    logp_old = torch.tensor([[-1.0, -1.2, -0.7]])
    logp_infer = logp_old - torch.tensor([[0.3, 0.05, -0.2]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    k = tr.kl_k3(logp_old - logp_infer)  # (1, 3) float32
    at = float(k[0, 0])
    assert tr.divergence_mask_weights(logp_old, logp_infer, mask, at, tr.kl_k3)[0, 0] == 1.0
    below = float(torch.nextafter(k[0, 0], torch.tensor(0.0)))
    assert tr.divergence_mask_weights(logp_old, logp_infer, mask, below, tr.kl_k3)[0, 0] == 0.0
    band = (1 / 1.35, float(torch.exp((logp_old - logp_infer)[0, 0])))  # k1: the band's edge itself
    assert tr.divergence_mask_weights(logp_old, logp_infer, mask, band, tr.kl_k1)[0, 0] == 1.0


def _lag_batch(eps, seed=0, B=64, T=8):
    """Rows whose log-probs moved eps toward the sign of their advantage (a trainer ahead of its
    sampler) over symmetric per-token noise 0.02."""
    g = torch.Generator().manual_seed(seed)
    q = -torch.rand(B, T, generator=g) * 2 - 0.05
    adv = torch.randn(B, 1, generator=g)
    p = q + 0.02 * torch.randn(B, T, generator=g) + eps * adv.sign()
    return p, q, torch.ones(B, T, dtype=torch.bool), adv


def test_the_lag_threshold_is_pinned_by_cases_just_inside_and_outside():
    """t = 2.87 reads no lag and t = 3.11 reads lag: a threshold moved to 2.0 or 3.5 fails one of
    them."""
    inside = tr.diagnose_mismatch(*_lag_batch(0.003)[:3], advantages=_lag_batch(0.003)[3])
    outside = tr.diagnose_mismatch(*_lag_batch(0.0032)[:3], advantages=_lag_batch(0.0032)[3])
    t_in, t_out = (
        next(s["statistic"] for s in d.evidence if s["name"] == "lag") for d in (inside, outside)
    )
    assert 2.0 < t_in < 3.0 < t_out < 3.5, (t_in, t_out)
    assert _verdicts(inside)["lag"] == "absent" and _verdicts(outside)["lag"] == "present"


def test_the_lag_fit_takes_each_rows_confidence():
    """No lag, a per-token gap proportional to log q (a temperature-like gap), and correct rows
    surer than wrong ones: the lag test's fit on each row's mean log q reads no lag; without that
    covariate the rows' mean gaps differ by the confidence alone (t ~ 25), the twin computed here.
    """
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(64, 1, generator=g)
    q = -torch.rand(64, 8, generator=g) * torch.where(adv > 0, 0.2, 1.5)  # A > 0 rows: surer
    p = q * 1.1 + 0.005 * torch.randn(64, 8, generator=g)
    found = tr.diagnose_mismatch(p, q, torch.ones(64, 8, dtype=torch.bool), advantages=adv)
    assert _verdicts(found)["lag"] == "absent", found
    row_d = (p - q).mean(1)
    up, down = row_d[adv[:, 0] > 0], row_d[adv[:, 0] < 0]
    t_without = (up.mean() - down.mean()) / (
        up.var() / up.numel() + down.var() / down.numel()
    ).sqrt()
    assert t_without > 10


def test_the_geometric_mask_averages_over_each_rows_own_length():
    """A row of 2 generated tokens (padded to T = 6) at log rho 0.015 each: geometric mean e^0.015 >
    1.01, masked; a planted division by T (0.005) would keep it. The twin: the same row at 0.005 per
    token is kept."""
    logp_old = torch.full((2, 6), -1.0)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[:, :2] = True
    gaps = torch.tensor([[0.015], [0.005]]).expand(2, 6)
    w = tr.geo_mask_weights(logp_old, logp_old - gaps, mask)
    assert w[0].sum() == 0 and torch.equal(w[1], mask[1].float())


# ==================================================================================================
# framework modes: an argument makes each function equal one mode of the framework (issue 56, items
# 1-4); each case is the issue's, and both modes are pinned, so a function that ignored its argument
# would fail one of them


def test_geo_mask_weighted_is_slimes_geometric_mask_mode():
    """q = [-1, -1], p = q + [0.10, -0.05], band [0.9, 1.1]: both kept. slime --tis-mode mask
    --tis-level geometric weights each kept token by exp(mean log rho) = e^0.025 = 1.0253; the
    rejection mask alone gives 1."""
    q = torch.full((1, 2), -1.0)
    p = q + torch.tensor([[0.10, -0.05]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    weighted = tr.geo_mask_weights(p, q, mask, 0.9, 1.1, weighted=True)
    assert torch.allclose(weighted, torch.full((1, 2), math.exp(0.025)))
    assert torch.equal(tr.geo_mask_weights(p, q, mask, 0.9, 1.1), torch.ones(1, 2))


def test_cispo_reductions_are_slimes_per_sample_and_per_token_modes():
    """mask [[1,0,0],[1,1,1]], logp = logp_infer = -1, A = [+1, -1]: token mean -0.5, slime's
    default per-sample mean 0.0. mask [[0,0],[1,1]], A = 1: token mean 1.0, slime
    --calculate-per-token-loss 2/3 (an all-masked sample counts one token)."""
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    logp = torch.full((2, 3), -1.0)
    adv = torch.tensor([[1.0], [-1.0]])
    assert float(tr.cispo_loss(logp, logp, adv, mask)) == pytest.approx(-0.5)
    assert float(tr.cispo_loss(logp, logp, adv, mask, agg="sample-mean")) == pytest.approx(
        0.0, abs=1e-7
    )
    mask = torch.tensor([[0, 0], [1, 1]], dtype=torch.bool)
    logp, adv = torch.full((2, 2), -1.0), torch.ones(2, 1)
    assert float(tr.cispo_loss(logp, logp, adv, mask)) == pytest.approx(1.0)
    assert float(tr.cispo_loss(logp, logp, adv, mask, agg="token-mean-min1")) == pytest.approx(
        2 / 3
    )


def test_a_rejection_as_weights_is_verl_bypass_as_mask_is_verl_decoupled():
    """p/q = [1, 1, e, 1/e], logp -1, A 1, k3 threshold 0.01 rejects the last two: as weights (verl
    bypass_mode: still counted) the loss is 0.5; in the mask (verl's default decoupled mode rewrites
    response_mask) 1.0."""
    logp = torch.full((1, 4), -1.0)
    logp_infer = logp - torch.tensor([[0.0, 0.0, 1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    m = tr.divergence_mask_weights(logp, logp_infer, mask, 0.01)
    assert m.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert float(tr.pg_loss(logp, torch.ones(1, 1), mask, weights=m)) == pytest.approx(0.5)
    assert float(tr.pg_loss(logp, torch.ones(1, 1), mask & (m > 0))) == pytest.approx(1.0)


def test_a_reduction_mode_that_is_not_one_is_refused_by_its_name():
    with pytest.raises(ValueError, match="agg"):
        tr.cispo_loss(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1, 1),
            torch.ones(1, 2, dtype=torch.bool),
            agg="mean",
        )


def test_one_icepop_band_in_mis_weights_and_in_the_doctors_share():
    """issue 56, item 9: mis_weights' default band and the doctor's "outside (IcePop)" share are one
    band, ICEPOP_BAND = [0.5, 2]: rho 1.9 and 0.55 kept, 2.5 and 0.45 not (under the old [0.5, 5]
    2.5 was kept), and the doctor counts exactly the tokens mis_weights drops."""
    assert tr.ICEPOP_BAND == (0.5, 2.0)
    rho = torch.tensor([[1.9, 0.55, 2.5, 0.45, 1.0, 1.0]])
    logp_infer = torch.full_like(rho, -2.0)
    mask = torch.ones_like(rho, dtype=torch.bool)
    w = tr.mis_weights(logp_infer + rho.log(), logp_infer, mask)
    assert torch.allclose(w, torch.tensor([[1.9, 0.55, 0.0, 0.0, 1.0, 1.0]]))
    found = tr.diagnose_mismatch(
        logp_infer.expand(32, 6) + rho.log(), logp_infer.expand(32, 6), mask.expand(32, 6)
    )
    assert found.numbers["tokens outside [0.5, 2] (IcePop)"] == pytest.approx(
        float((w == 0).float().mean())
    )


def test_length_skew_alone_is_not_outliers_and_a_few_rows_from_another_policy_are():
    """issue 56, item 7: 4 rows of 2,000 tokens beside 60 of 30, the same symmetric per-token noise
    on every token: the long rows carry 82 % of sum |d| (the old statistic read "outliers"); per
    token they are like the rest, so the doctor does not name outliers. The twin: 3 of the 64 rows
    of 30 tokens at 30x the noise are named."""
    g = torch.Generator().manual_seed(7)
    mask = torch.zeros(64, 2000, dtype=torch.bool)
    mask[:4] = True
    mask[4:, :30] = True
    q = -torch.rand(64, 2000, generator=g) * 2
    noise = 0.01 * torch.randn(64, 2000, generator=g)
    skewed = tr.diagnose_mismatch(q + noise, q, mask)
    assert _verdicts(skewed)["outliers"] == "absent" and skewed.cause != "outliers", skewed
    mask = torch.zeros(64, 30, dtype=torch.bool) | True
    scale = torch.ones(64, 1)
    scale[[5, 17, 40]] = 30.0
    planted = tr.diagnose_mismatch(q[:, :30] + noise[:, :30] * scale, q[:, :30], mask)
    assert _verdicts(planted)["outliers"] == "present" and planted.cause == "outliers", planted


# ==================================================================================================
# the async frameworks' corrections (issue 57, item 3): each by its formula on hand-made or
# enumerated cases


def test_prox_logp_loglinear_interpolates_by_version_and_leaves_the_last_broadcast_alone():
    """Current version 9: a token of version 8 (the last broadcast, the proximal policy itself)
    keeps log q; one of 7 sits half way to log p in log space (a = 1/2), one of 5 at a = 3/4; a
    prompt token (-1), a token from the future (9) and a token off the mask keep log q. The twin: at
    version 10 the version-8 token moves (a = 1/2)."""
    logp_infer = torch.full((1, 6), -2.0)
    logp = torch.full((1, 6), -1.0)
    versions = torch.tensor([[8, 7, 5, -1, 9, 5]])
    mask = torch.tensor([[True, True, True, True, True, False]])
    got = tr.prox_logp_loglinear(logp_infer, logp, versions, mask, 9)
    assert got.tolist() == [[-2.0, -1.5, -1.25, -2.0, -2.0, -2.0]]
    assert float(tr.prox_logp_loglinear(logp_infer, logp, versions, mask, 10)[0, 0]) == -1.5
    with pytest.raises(TypeError, match="versions"):
        tr.prox_logp_loglinear(logp_infer, logp, versions.float(), mask, 9)
    with pytest.raises(ValueError, match="versions"):
        tr.prox_logp_loglinear(logp_infer, logp, versions[:, :3], mask, 9)


@settings(deadline=None, max_examples=60)
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=12), st.floats(1e-3, 2.0))
def test_m2po_mask_drops_the_fewest_largest_until_the_kept_mean_is_below_threshold(gaps, threshold):
    """Exactly the M2PO rule, checked by enumerating every count of largest tokens dropped: the kept
    tokens' mean (log p_prox - log q)^2 is below the threshold (or one token is left), and dropping
    one fewer would not be."""
    d = torch.tensor([gaps], dtype=torch.float64)
    mask = torch.ones_like(d, dtype=torch.bool)
    kept = tr.m2po_mask(d, torch.zeros_like(d), mask, threshold)[0].bool()
    m2 = d[0].square()
    order = m2.argsort(descending=True)
    drop = int((~kept).sum())
    assert (
        set(order[:drop].tolist()) == set((~kept).nonzero().flatten().tolist())
        or m2[order[drop - 1]] == m2[order[drop]]
    ), "the largest go first"  # ties may swap which of equal tokens goes
    assert kept.sum() >= 1
    assert m2[kept].mean() < threshold or drop == len(gaps) - 1
    if drop > 0:
        assert m2[order[drop - 1:]].mean() >= threshold, "one fewer dropped would do"


def test_binary_kl_mask_is_the_binary_kl_in_the_advantages_direction():
    """q = 0.5: p = 0.9 is KL(q || p) = 0.5 log(0.5/0.9) + 0.5 log(0.5/0.1) = 0.511 > 0.05, masked
    when A > 0 (moved toward A) and kept when A < 0 (moved against it); p = 0.52 (KL 0.0008) is kept
    either way."""
    q = torch.log(torch.full((2, 2), 0.5))
    p = torch.log(torch.tensor([[0.9, 0.52], [0.9, 0.52]]))
    mask = torch.ones(2, 2, dtype=torch.bool)
    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl == pytest.approx(0.5108, abs=1e-4)
    m = tr.binary_kl_mask(p, q, torch.tensor([1.0, -1.0]), mask)
    assert m.tolist() == [[0.0, 1.0], [1.0, 1.0]]
    assert (
        tr.binary_kl_mask(p, q, torch.tensor([1.0, -1.0]), mask, delta_high=0.6).tolist()
        == [[1.0] * 2] * 2
    )


def test_dppo_kl_loss_is_dppo_with_the_binary_kl_mask():
    """The loss is -mean(m r A) with m = binary_kl_mask: equal to dppo_loss where neither masks
    (deltas too wide to bind), and its gradient is 0 on a masked token."""
    g = torch.Generator().manual_seed(3)
    q = -torch.rand(4, 5, generator=g) * 2
    logp = (q + 0.2 * torch.randn(4, 5, generator=g)).clamp(max=-1e-3).requires_grad_(True)
    mask, adv = torch.ones(4, 5, dtype=torch.bool), torch.tensor([1.0, -1.0, 0.5, -2.0])
    wide = tr.dppo_kl_loss(logp, q, adv, mask, 50.0, 50.0)
    assert torch.allclose(wide, tr.dppo_loss(logp, q, adv, mask, delta=5.0))
    (grad,) = torch.autograd.grad(tr.dppo_kl_loss(logp, q, adv, mask, 0.005, 0.005), logp)
    masked = tr.binary_kl_mask(logp, q, adv, mask, 0.005, 0.005) == 0
    assert masked.any() and (grad[masked] == 0).all() and (grad[~masked] != 0).all()


def test_sapo_gradient_is_pgs_at_r_1_and_its_soft_gate_elsewhere():
    """At p = p_old SAPO's gradient equals pg_loss's exactly (f'(1) = 1); elsewhere each token's
    weight is f'(r) r = 4 sigmoid(tau (r - 1)) (1 - sigmoid(tau (r - 1))) r, tau by A's sign
    (effective_token_weights)."""
    logp_old = torch.log(torch.tensor([[0.5, 0.2, 0.7], [0.3, 0.6, 0.1]]))
    mask, adv = torch.ones(2, 3, dtype=torch.bool), torch.tensor([1.0, -1.0])
    at_one = logp_old.clone().requires_grad_(True)
    (g_sapo,) = torch.autograd.grad(tr.sapo_loss(at_one, logp_old, adv, mask), at_one)
    (g_pg,) = torch.autograd.grad(tr.pg_loss(at_one, adv, mask), at_one)
    assert torch.allclose(g_sapo, g_pg, atol=1e-7)
    logp = (logp_old + torch.tensor([[0.4, -0.3, 0.1], [0.2, -0.5, 0.6]])).requires_grad_(True)
    w = tr.effective_token_weights(tr.sapo_loss(logp, logp_old, adv, mask), logp, adv, mask)
    r = (logp - logp_old).detach().exp()
    tau = torch.tensor([[1.0], [1.05]])
    s = torch.sigmoid(tau * (r - 1))
    assert torch.allclose(w, 4 * s * (1 - s) * r, atol=1e-6)
    assert not torch.allclose(w, torch.ones_like(w), atol=1e-2), (
        "the twin: away from r = 1 it is not PG"
    )


def test_the_doctor_names_mixed_versions_where_the_gap_jumps_at_a_version_boundary():
    """issue 57, item 6: 64 responses of 8 tokens, half of them spanning an in-flight update (tokens
    0-3 of version 5, 4-7 of version 8): the older tokens carry a lag of 0.05 per token, the newer
    ones bf16-like noise 0.003. The doctor names "mixed versions" and reports the gap by version
    age. The twin: the same versions with one gap on every token read absent; without versions the
    test does not appear at all."""
    g = torch.Generator().manual_seed(5)
    q = -torch.rand(64, 8, generator=g) * 2
    mask = torch.ones(64, 8, dtype=torch.bool)
    versions = torch.full((64, 8), 8)
    versions[:32, :4] = 5
    older = versions == 5
    p = q + torch.where(older, 0.05, 0.003) * torch.randn(64, 8, generator=g)
    found = tr.diagnose_mismatch(p, q, mask, versions=versions)
    assert found.cause == "mixed versions" and _verdicts(found)["mixed versions"] == "present", (
        found
    )
    assert (
        found.numbers["mean |log p/q|, version age 3"]
        > 5 * found.numbers["mean |log p/q|, version age 0"]
    )
    even = tr.diagnose_mismatch(
        q + 0.01 * torch.randn(64, 8, generator=g), q, mask, versions=versions
    )
    assert _verdicts(even)["mixed versions"] == "absent", even
    assert "mixed versions" not in _verdicts(tr.diagnose_mismatch(p, q, mask))
    with pytest.raises(TypeError, match="versions"):
        tr.diagnose_mismatch(p, q, mask, versions=versions.float())
    with pytest.raises(ValueError, match="versions must be >= 0"):
        tr.diagnose_mismatch(p, q, mask, versions=versions - 6)
