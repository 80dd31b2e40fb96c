"""tim_rl: LLM reinforcement learning under training-inference mismatch (TIM), in one readable file.

In RL for language models the tokens are sampled by an inference engine (vLLM, SGLang, a bf16 or quantised copy of
the weights, a copy that is some steps old) while the gradient is computed by a training engine (fp32 master
weights in torch). The two assign different probabilities to the same tokens. That gap biases the policy gradient,
and the bias compounds because every weight sync copies the biased trainer back into the sampler. This module
measures the gap, splits it into its sources, and implements every published correction as a short pure function
of tensors that you can copy into your own trainer.

Shape letters
    B  sequences in the batch (prompts x samples per prompt)
    G  samples per prompt (group size, GRPO)
    T  response positions (prompt tokens are never in these tensors)
    K  top-k token ids recorded by the sampler at each position (K = V allowed)
    V  vocabulary size

Log-prob sources (every per-token tensor is (B, T) float32 over response tokens; `mask` (B, T) bool)
    logp        trainer, current weights, carries gradient
    logp_old    trainer engine, behaviour weights (the ones the sampler held when it sampled), detached
    logp_infer  recorded by the sampler while sampling, detached
    logp_topk / logp_topk_infer   (B, T, K) trainer / sampler log-probs at the sampler's top-k ids

    log(p / q) = (logp - logp_old)  +  (logp_old - logp_infer)
                  policy lag             engine numerics (dtype, kernels, quantisation, export rounding)

Simplifications (deliberate; each is said again where it matters)
    1. Losses are token means over the whole batch, sum(x * mask) / max(sum(mask), 1) (the "token-mean" of DAPO).
    2. The score-centering baseline uses the sampler's top-k head and models the tail as the trainer distribution
       rescaled to the sampler's tail mass (Marek & Ryabinin, Appendix A); with K = V it is exact.
    3. DLC, Fair Cast, the details of COPC and FP8 calibrated clipping are reconstructed from the papers'
       abstracts plus related public work; their docstrings say so. No number of those papers is reproduced here.
    4. Non-finite log-probs are never allowed to produce a NaN loss: each function documents whether such a token
       gets weight 0 (dropped) or 1 (left uncorrected).

References
    [1] Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training" (token TIS).
    [2] Marek & Ryabinin, "Score Centering Stabilizes Off-policy RL", arXiv:2609.20807.
    [3] Li, Zhou & Lan, "On the Origin and Evolution of Training-Inference Mismatch in LLM RL" (DLC; abstract only).
    [4] Gao & Gao, "bf16 Rounding Silently Discards Most RL Policy Updates" (Fair Cast; abstract only).
    [5] Hu et al., "COPC: Coupled Off-Policy Correction for Asynchronous LLM RL", arXiv:2610.09597 (abstract only).
    [6] Yu et al., "Rethinking Training-Inference Mismatch in LLM RL", arXiv:2609.32444 (CIS).
    [7] Chen et al., "Towards Full Pipeline FP8 RL", arXiv:2609.22870 (calibrated clipping; details reconstructed).
    [8] Qi et al., "Rethinking the Trust Region in LLM RL", arXiv:2602.04879 (DPPO).
    [9] Qi et al., "Defeating the Training-Inference Mismatch via FP16", arXiv:2510.26788.
    [10] Hilton, Cobbe & Schulman 2021, "Batch size-invariance for policy optimization" (decoupled PPO); AReaL.
    [11] Team IcePop / MIS: masked importance sampling, weight rho * 1[lo <= rho <= hi].
"""

from __future__ import annotations

import math

import torch

# Log-ratios are clamped to +-LOG_RATIO_CLAMP before exp: exp(20) ~ 4.9e8 is far beyond any cap or band used
# here, so the clamp never changes a kept weight, but it keeps exp() finite and its gradient bounded.
LOG_RATIO_CLAMP = 20.0
# Tail masses of the score-centering top-k estimator are floored here (Marek & Ryabinin, Appendix A).
TAIL_FLOOR = 1e-6
# Bits of an fp32 number that bf16 drops: the low 16 of the 32.
BF16_DROPPED_BITS = 16


# ---------------------------------------------------------------------------------------------------------------
# ---- input checks ----
# Every public function validates cheaply and names the argument; nothing here is on the hot path's inner loop.


def _check_tensor(name: str, x, *, floating: bool = True) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def _check_mask(mask) -> None:
    _check_tensor("mask", mask, floating=False)
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True on generated tokens), got dtype {mask.dtype}")
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape (B, T), got {tuple(mask.shape)}")
    if mask.numel() == 0:
        raise ValueError(f"mask is empty (shape {tuple(mask.shape)}): need B >= 1 and T >= 1")


def _check_bt(mask, **tensors) -> None:
    """Check the mask and that every named tensor is float with the mask's (B, T) shape."""
    _check_mask(mask)
    for name, x in tensors.items():
        _check_tensor(name, x)
        if x.shape != mask.shape:
            raise ValueError(f"{name} must have shape (B, T) = {tuple(mask.shape)} like mask, got {tuple(x.shape)}")


def _check_adv(adv, mask) -> torch.Tensor:
    """Advantages may be (B, T), (B, 1) or (B,); returned as a detached (B, T) float tensor, non-finite -> 0."""
    _check_tensor("adv", adv)
    B, T = mask.shape
    if adv.shape == (B,):
        adv = adv[:, None]
    if adv.shape not in ((B, T), (B, 1)):
        raise ValueError(f"adv must have shape (B, T) = {(B, T)} or (B, 1) = {(B, 1)}, got {tuple(adv.shape)}")
    adv = adv.detach().float().expand(B, T)
    return torch.where(torch.isfinite(adv), adv, torch.zeros_like(adv))


# ---------------------------------------------------------------------------------------------------------------
# ---- log-space helpers ----


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * mask) / max(sum(mask), 1); values outside the mask (even nan) are ignored. (B, T) -> scalar."""
    total = torch.where(mask, x, torch.zeros_like(x)).sum()
    return total / mask.sum().clamp(min=1)


def _finite_log_ratio(logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor):
    """(log a/b clamped to +-LOG_RATIO_CLAMP with 0 where unusable, ok) where ok = mask & both finite. (B, T)."""
    ok = mask & torch.isfinite(logp_a) & torch.isfinite(logp_b)
    log_ratio = torch.where(ok, logp_a - logp_b, torch.zeros_like(logp_a))
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), ok


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """log softmax(logits)[ids] in float32, by gather - logsumexp over row chunks. (..., V), (...) -> (...).

    Never materialises a second full-size float32 copy of the logits: each chunk of rows is upcast and reduced on its
    own (default: 1/8 of the rows, so the transient is <= 1/8 of the logits in float32). Differentiable.
    """
    _check_tensor("logits", logits)
    _check_tensor("ids", ids, floating=False)
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"ids must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, got {tuple(ids.shape)}")
    V = logits.shape[-1]
    flat_logits, flat_ids = logits.reshape(-1, V), ids.reshape(-1)  # (N, V), (N,)
    N = flat_ids.numel()
    if chunk_rows is None:
        chunk_rows = max(1, math.ceil(N / 8))
    out = []
    for start in range(0, N, chunk_rows):
        chunk = flat_logits[start : start + chunk_rows].float()  # (n, V), a copy only when logits are not fp32
        picked = chunk.gather(-1, flat_ids[start : start + chunk_rows, None]).squeeze(-1)  # (n,)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out).reshape(ids.shape) if out else flat_logits.new_zeros(ids.shape, dtype=torch.float32)


def log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp <= 0, stable at both ends (Maechler 2012). Same shape."""
    logp = logp.clamp(max=0.0)
    return torch.where(logp > -math.log(2.0), torch.log(-torch.expm1(logp)), torch.log1p(-torch.exp(logp)))


# ---------------------------------------------------------------------------------------------------------------
# ---- mismatch metrics ----


def mismatch_metrics(logp_train: torch.Tensor, logp_infer: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """KL estimators and ratio statistics of r = p_train / q_infer over masked tokens sampled from q. (B, T) -> dict.

    k1 = mean(-log r), k2 = mean((log r)^2 / 2), k3 = mean(r - 1 - log r) (all estimate KL(q || p) under y ~ q;
    Schulman's estimators), chi2 = mean(r^2) - 1, ess = (sum r)^2 / (N sum r^2) in (0, 1], abs_diff = mean |log r|.
    Non-finite log-probs inside the mask are left out and counted in frac_nonfinite. Computed in float64.
    """
    _check_bt(mask, logp_train=logp_train, logp_infer=logp_infer)
    log_ratio, ok = _finite_log_ratio(logp_train.detach(), logp_infer.detach(), mask)
    n_mask = int(mask.sum())
    lr = log_ratio[ok].double()  # (N,)
    n = lr.numel()
    out = {"n_tokens": float(n_mask), "frac_nonfinite": (n_mask - n) / max(n_mask, 1)}
    if n == 0:
        zero = {k: 0.0 for k in ("k1", "k2", "k3", "abs_diff", "max_abs_diff", "chi2", "mean_log_ratio")}
        return out | zero | {"ess": 1.0, "ratio_min": 1.0, "ratio_max": 1.0}
    r = lr.exp()
    out |= {
        "k1": float((-lr).mean()),
        "k2": float((lr.square() / 2).mean()),
        "k3": float((r - 1 - lr).mean()),
        "abs_diff": float(lr.abs().mean()),
        "max_abs_diff": float(lr.abs().max()),
        "mean_log_ratio": float(lr.mean()),
        "chi2": float(r.square().mean() - 1),
        "ess": float(r.sum().square() / (n * r.square().sum())),
        "ratio_min": float(r.min()),
        "ratio_max": float(r.max()),
    }
    return out


def mismatch_ledger(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_infer: torch.Tensor,
    mask: torch.Tensor,
    logp_master_old: torch.Tensor | None = None,
) -> dict[str, float]:
    """Split total = log p - log q into lag + numerics (+ rounding); mean and mean |.| of each. (B, T) -> dict.

    numerics = logp_old - logp_infer (same weights, different engines), and without logp_master_old
    lag = logp - logp_old. With logp_master_old (trainer engine on the unrounded fp32 master the served copy was
    exported from) the master-vs-served part is split off: rounding = logp_master_old - logp_old and
    lag = logp - logp_master_old, so that lag + rounding + numerics == total token by token.
    Tokens where any input is non-finite are left out of every part.
    """
    _check_bt(mask, logp=logp, logp_old=logp_old, logp_infer=logp_infer)
    anchor = logp_old if logp_master_old is None else logp_master_old
    parts = {"total": (logp, logp_infer), "lag": (logp, anchor), "numerics": (logp_old, logp_infer)}
    ok = mask & torch.isfinite(logp) & torch.isfinite(logp_old) & torch.isfinite(logp_infer)
    if logp_master_old is not None:
        _check_bt(mask, logp_master_old=logp_master_old)
        parts["rounding"] = (logp_master_old, logp_old)
        ok = ok & torch.isfinite(logp_master_old)
    out = {}
    for name, (a, b) in parts.items():
        diff = torch.where(ok, a.detach().double() - b.detach().double(), torch.zeros((), dtype=torch.float64))
        out[f"{name}_mean"] = float(diff.sum() / ok.sum().clamp(min=1))
        out[f"{name}_abs"] = float(diff.abs().sum() / ok.sum().clamp(min=1))
    return out


def log_odds_displacement(logp_train: torch.Tensor, logp_infer: torch.Tensor) -> torch.Tensor:
    """eps = logit p - logit q, so that p / q = p + (1 - p) e^eps (Yu et al. [6], the CIS identity). Same shape."""
    _check_tensor("logp_train", logp_train)
    _check_tensor("logp_infer", logp_infer)
    return (logp_train - log1mexp(logp_train)) - (logp_infer - log1mexp(logp_infer))


# ---------------------------------------------------------------------------------------------------------------
# ---- weight export (fp32 master -> bf16 served copy) ----
# Fair Cast [4] (reconstructed from the abstract): round-to-nearest silently drops every per-step update smaller
# than half a bf16 cell (2^-8 of the weight's binade), so the sampler lags the master; unbiased rounding fixes it.


def _check_fp32(name: str, x) -> None:
    _check_tensor(name, x)
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (the fp32 master), got {x.dtype}")


def round_nearest_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even fp32 -> bf16 (what `x.to(torch.bfloat16)` does in every framework). Same shape."""
    _check_fp32("x", x)
    return x.to(torch.bfloat16)


def stochastic_round_bf16(
    x: torch.Tensor, *, generator: torch.Generator | None = None, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """Unbiased rounding fp32 -> bf16: add uniform u in [0, 2^16) to the fp32 bits, drop the low 16. E[SR(x)] = x.

    Fair Cast [4] (reconstructed): rounds away from zero with probability equal to x's position in its bf16 cell,
    so E[SR(x)] = x exactly for every finite x whose neighbours are finite. `noise` (int32, shaped like x, values in
    [0, 2^16)) replaces the random draw so that tests can enumerate all 65 536 draws. inf/nan pass through.
    """
    _check_fp32("x", x)
    if noise is None:
        noise = torch.randint(0, 1 << BF16_DROPPED_BITS, x.shape, dtype=torch.int32, generator=generator)
    else:
        _check_tensor("noise", noise, floating=False)
        if noise.dtype != torch.int32 or noise.shape != x.shape:
            raise ValueError(f"noise must be int32 with shape {tuple(x.shape)}, got {noise.dtype} {tuple(noise.shape)}")
        if noise.numel() and (int(noise.min()) < 0 or int(noise.max()) >= 1 << BF16_DROPPED_BITS):
            raise ValueError("noise values must lie in [0, 2**16)")
    # Sign-magnitude bits: adding to the magnitude's low bits and truncating rounds |x| up with the right odds.
    bits = (x.contiguous().view(torch.int32) + noise) & ~((1 << BF16_DROPPED_BITS) - 1)
    rounded = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero
    return torch.where(torch.isfinite(x), rounded, x.to(torch.bfloat16))


def error_feedback_round_bf16(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigma-delta export: served = RTN(x + e), e' = x + e - served. Returns (served bf16, e' fp32). Same shapes.

    Fair Cast [4] (reconstructed): the rounding error is carried to the next export, so the running sum of served
    values never leaves the running sum of masters by more than half a bf16 cell. Deterministic. A non-finite
    master is served as-is and its residual reset to 0.
    """
    _check_fp32("x", x)
    _check_fp32("residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have shape {tuple(x.shape)} like x, got {tuple(residual.shape)}")
    target = x + residual
    served = target.to(torch.bfloat16)
    new_residual = target - served.float()  # exact (Sterbenz): served is within half a cell of target
    finite = torch.isfinite(target)
    served = torch.where(finite, served, x.to(torch.bfloat16))
    return served, torch.where(finite, new_residual, torch.zeros_like(new_residual))


def visible_update_fraction(
    master_before: torch.Tensor, master_after: torch.Tensor, served_before: torch.Tensor, served_after: torch.Tensor
) -> float:
    """<d_served, d_master> / |d_master|^2: the share of the master's move the sampler sees (Fair Cast [4]). Any shape.

    1 for a lossless export, ~0 when round-to-nearest swallows the update; 0 when the master did not move.
    """
    for name, t in (("master_before", master_before), ("master_after", master_after),
                    ("served_before", served_before), ("served_after", served_after)):
        _check_tensor(name, t)
        if t.shape != master_before.shape:
            raise ValueError(f"{name} must have shape {tuple(master_before.shape)}, got {tuple(t.shape)}")
    d_master = master_after.double() - master_before.double()
    d_served = served_after.double() - served_before.double()
    denom = float(d_master.square().sum())
    return float((d_served * d_master).sum()) / denom if denom > 0 else 0.0


# ---------------------------------------------------------------------------------------------------------------
# ---- advantages ----


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = False) -> torch.Tensor:
    """A_i = r_i - mean_group(r) (/ std_group(r) if normalize_std) over consecutive groups of G. (B,) -> (B,).

    GRPO (Shao et al. 2024); Dr. GRPO and the score-centering paper [2] drop the std. Groups with zero reward
    variance get advantage 0 either way. Non-finite rewards count as 0.
    """
    _check_tensor("rewards", rewards)
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must have shape (B,) with B >= 1, got {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size must be a positive int dividing B = {rewards.numel()}, got {group_size!r}")
    r = torch.nan_to_num(rewards.detach().float(), nan=0.0, posinf=0.0, neginf=0.0).view(-1, group_size)  # (B/G, G)
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        std = r.std(dim=1, keepdim=True)  # unbiased, as GRPO / TRL
        adv = adv / torch.where(std > 0, std, torch.ones_like(std))
    return adv.reshape(-1)


def copc_residual_weights(logp: torch.Tensor, logp_infer: torch.Tensor, mask: torch.Tensor, eps: float = 0.2):
    """c_t = clip(p / q, 1 - eps, 1 + eps), detached; 1 where non-finite, 0 outside the mask. COPC [5]. (B, T)."""
    _check_bt(mask, logp=logp, logp_infer=logp_infer)
    log_ratio, ok = _finite_log_ratio(logp.detach(), logp_infer.detach(), mask)
    c = log_ratio.exp().clamp(1 - eps, 1 + eps)  # the log-ratio of non-finite tokens is 0, so c = 1 there
    return torch.where(mask, c, torch.zeros_like(c))


def copc_advantages(
    values: torch.Tensor,
    rewards: torch.Tensor,
    logp: torch.Tensor,
    logp_infer: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_t = sum_l (gamma lam)^l c_{t+l} delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t; V_target = V + A. (B, T).

    COPC [5], advantage side (reconstructed from the abstract): the TD residuals of GAE are weighted by the two-sided
    clipped ratio c_t = clip(p / q, 1 - eps, 1 + eps), so stale continuations count less. With p == q it is plain
    GAE(gamma, lambda). `rewards` is (B,) (paid at the last response token) or (B, T). The state after the last
    masked token is terminal (value 0). Returns detached (advantages, value_targets), 0 outside the mask.
    """
    _check_bt(mask, values=values, logp=logp, logp_infer=logp_infer)
    _check_tensor("rewards", rewards)
    B, T = mask.shape
    if rewards.shape == (B,):
        last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask  # (B, T) last generated token
        rewards = torch.where(last, rewards.float()[:, None], torch.zeros(B, T))
    elif rewards.shape != (B, T):
        raise ValueError(f"rewards must have shape (B,) = {(B,)} or (B, T) = {(B, T)}, got {tuple(rewards.shape)}")
    zero = torch.zeros(B, T)
    v = torch.where(mask, values.detach().float(), zero)
    r = torch.where(mask, torch.nan_to_num(rewards.detach().float()), zero)
    c = copc_residual_weights(logp, logp_infer, mask, eps)  # TIM: stale residuals are down-weighted
    next_v = torch.cat([v[:, 1:], torch.zeros(B, 1)], dim=1)  # 0 past the end and on masked-out positions
    delta = r + gamma * next_v - v
    adv = torch.zeros(B, T)
    running = torch.zeros(B)
    for t in reversed(range(T)):
        running = torch.where(mask[:, t], c[:, t] * delta[:, t] + gamma * lam * running, torch.zeros(B))
        adv[:, t] = running
    return adv, torch.where(mask, v + adv, zero)


# ---------------------------------------------------------------------------------------------------------------
# ---- correction weights ----
# Each returns a detached (B, T) float32 weight, 0 outside the mask. Detached because an importance weight changes
# the measure the gradient is averaged under, not the objective: no gradient may flow through it.
# rho = p_old / q = exp(logp_old - logp_infer) is the train/infer ratio of the behaviour weights.


def tis_weights(logp_old: torch.Tensor, logp_infer: torch.Tensor, mask: torch.Tensor, cap: float = 2.0):
    """w = min(rho, C). Token-level truncated IS, Yao et al. 2025 [1]. Non-finite log-ratio -> 0. (B, T)."""
    _check_bt(mask, logp_old=logp_old, logp_infer=logp_infer)
    log_rho, ok = _finite_log_ratio(logp_old.detach(), logp_infer.detach(), mask)
    w = log_rho.exp().clamp(max=cap)
    return torch.where(ok, w, torch.zeros_like(w))


def mis_weights(logp_old, logp_infer, mask, low: float = 0.5, high: float = 5.0):
    """w = rho * 1[low <= rho <= high]. Masked IS / IcePop [11]; band of [2] by default. Non-finite -> 0. (B, T)."""
    _check_bt(mask, logp_old=logp_old, logp_infer=logp_infer)
    log_rho, ok = _finite_log_ratio(logp_old.detach(), logp_infer.detach(), mask)
    rho = log_rho.exp()
    keep = ok & (rho >= low) & (rho <= high)
    return torch.where(keep, rho, torch.zeros_like(rho))


def seq_tis_weights(logp_old, logp_infer, mask, cap: float = 5.0):
    """w_i = min(prod_t rho_it, C) on every token of sequence i. Sequence-level TIS. Non-finite -> 0 for the sequence.

    Beware: the product shrinks long sequences towards 0 (TRL #5814); geo_mask_weights does not. (B, T).
    """
    _check_bt(mask, logp_old=logp_old, logp_infer=logp_infer)
    log_rho, ok = _finite_log_ratio(logp_old.detach(), logp_infer.detach(), mask)
    seq_ok = (ok == mask).all(dim=1, keepdim=True)  # (B, 1) every generated token finite
    seq_log_rho = log_rho.sum(dim=1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, 1)
    w = seq_log_rho.exp().clamp(max=cap).expand_as(log_rho)  # (B, T)
    return torch.where(mask & seq_ok, w, torch.zeros_like(w))


def geo_mask_weights(logp_old, logp_infer, mask, low: float = 0.99, high: float = 1.01):
    """w_i = 1[low <= exp(mean_t log rho_it) <= high] on every token of sequence i: geometric-mean sequence mask.

    Length-neutral replacement for the sequence product (TRL #5814, NeMo-RL #2269). Non-finite -> 0. (B, T).
    """
    _check_bt(mask, logp_old=logp_old, logp_infer=logp_infer)
    log_rho, ok = _finite_log_ratio(logp_old.detach(), logp_infer.detach(), mask)
    seq_ok = (ok == mask).all(dim=1, keepdim=True)  # (B, 1)
    geo = (log_rho.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)).exp()  # (B, 1)
    keep = mask & seq_ok & (geo >= low) & (geo <= high)  # (B, T)
    return keep.float()


def cis_weights(logp_old, logp_infer, mask, lam: float = 2.3, kappa: float = 5e-3):
    """w = min(rho, 1 + lam * max(1 - p_old, kappa)): a cap on the log-odds shift, tighter as p grows. CIS [6], Sec. 4.

    From rho = p + (1 - p) e^eps with eps = logit p - logit q, truncating eps gives a cap that tightens with
    confidence. Upper side only. Non-finite log-ratio -> 1 (left uncorrected, as the official code does). (B, T).
    """
    _check_bt(mask, logp_old=logp_old, logp_infer=logp_infer)
    log_rho, ok = _finite_log_ratio(logp_old.detach(), logp_infer.detach(), mask)
    p_old = torch.nan_to_num(logp_old.detach().float(), nan=0.0).clamp(max=0.0).exp()
    cap = 1 + lam * (1 - p_old).clamp(min=kappa)
    w = torch.minimum(log_rho.exp(), cap)  # log_rho = 0 on non-finite tokens, so w = 1 there
    return torch.where(mask, w, torch.zeros_like(w))


def dlc_weights(logp_old, logp_infer, mask, clamp: float = 1.0):
    """w = exp(clip(d - mean_mask(d), -c, c)), d = logp_old - logp_infer: centred numerical discrepancy. DLC [3].

    Reconstructed from the abstract of Li, Zhou & Lan ("centres numerical errors"): the persistent part of the engine
    discrepancy (its batch mean) is removed, the rest is a bounded weight in [e^-c, e^c]. Non-finite -> 0. (B, T).
    """
    _check_bt(mask, logp_old=logp_old, logp_infer=logp_infer)
    d, ok = _finite_log_ratio(logp_old.detach(), logp_infer.detach(), mask)
    centred = d - masked_mean(d, ok)
    w = centred.clamp(-clamp, clamp).exp()
    return torch.where(ok, w, torch.zeros_like(w))


def copc_mask(logp_old, logp_infer, mask, low: float = 0.5, high: float = 2.0):
    """m = 1[low <= rho <= high]: COPC's token-level ratio mask [5] (policy side; reconstructed). Non-finite -> 0."""
    _check_bt(mask, logp_old=logp_old, logp_infer=logp_infer)
    log_rho, ok = _finite_log_ratio(logp_old.detach(), logp_infer.detach(), mask)
    rho = log_rho.exp()
    return (ok & (rho >= low) & (rho <= high)).float()


def calibrated_clip_bounds(
    ratio_lowprec: torch.Tensor,
    ratio_ref: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[float, float]:
    """PPO clip bounds (L, H) for low-precision ratios that clip like the high-precision reference does. FP8 [7].

    Reconstructed from the abstract of Chen et al.: L is chosen so that the share of negative-advantage tokens with
    r_lowprec < L equals the share with r_ref < 1 - eps_low; H so that P(H) / N(L) on the low-precision ratios
    equals P(1 + eps_high) / N(1 - eps_low) on the reference, with P(H) = sum_{A>0, r<=H} A r and
    N(L) = sum_{A<0, r>=L} |A| r. Falls back to (1 - eps_low, 1 + eps_high) when a side has no tokens. (B, T).
    """
    _check_bt(mask, ratio_lowprec=ratio_lowprec, ratio_ref=ratio_ref)
    A = _check_adv(adv, mask)
    ok = mask & torch.isfinite(ratio_lowprec) & torch.isfinite(ratio_ref)
    neg, pos = ok & (A < 0), ok & (A > 0)
    if not neg.any() or not pos.any():
        return 1 - eps_low, 1 + eps_high
    low_neg = ratio_lowprec[neg].double().sort().values  # (N-,)
    n_clipped = int((ratio_ref[neg] < 1 - eps_low).sum())  # what the reference zeroes
    L = float(low_neg[n_clipped]) if n_clipped < low_neg.numel() else math.nextafter(float(low_neg[-1]), math.inf)

    def balance(r, H, L_):  # P(H) / N(L)
        p_mass = (A[pos] * r[pos]).double()[r[pos] <= H].sum()
        n_mass = (-A[neg] * r[neg]).double()[r[neg] >= L_].sum()
        return float(p_mass), float(n_mass)

    p_ref, n_ref = balance(ratio_ref, 1 + eps_high, 1 - eps_low)
    _, n_low = balance(ratio_lowprec, math.inf, L)
    if n_ref <= 0 or n_low <= 0:
        return L, 1 + eps_high
    target = p_ref / n_ref * n_low  # the P mass the low-precision ratios must reach
    r_pos, order = ratio_lowprec[pos].double().sort()
    cum = (A[pos].double()[order] * r_pos).cumsum(0)  # P(H) at H = each sorted ratio
    reach = torch.nonzero(cum >= target * (1 - 1e-12))
    H = float(r_pos[reach[0, 0]]) if reach.numel() else float(r_pos[-1])
    return L, H


# ---------------------------------------------------------------------------------------------------------------
# ---- losses ----
# Scalars, token means over the batch. Loss values of different corrections are not comparable with each other:
# watch reward, accuracy and the mismatch metrics instead.


def _finite_or_zero(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x with 0 where masked-out or non-finite, ok). torch.where keeps the gradient of the kept entries."""
    ok = mask & torch.isfinite(x)
    return torch.where(ok, x, torch.zeros_like(x)), ok


def _weights_or_ones(weights, mask) -> torch.Tensor:
    if weights is None:
        return mask.float()
    _check_bt(mask, weights=weights)
    w = weights.detach().float()  # weights are a change of measure: never differentiate through them
    return torch.where(mask & torch.isfinite(w), w, torch.zeros_like(w))


def pg_loss(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None):
    """-mean_mask(w * A * logp): REINFORCE with an optional detached per-token weight. (B, T) -> scalar.

    A non-finite logp inside the mask drops that token (no gradient, no NaN).
    """
    _check_bt(mask, logp=logp)
    A, w = _check_adv(adv, mask), _weights_or_ones(weights, mask)
    logp, ok = _finite_or_zero(logp, mask)
    return -masked_mean(w * A * logp, ok)


def ppo_loss(logp, logp_old, adv, mask, weights=None, eps_low: float = 0.2, eps_high: float = 0.28):
    """-mean_mask(w * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)), r = p / p_old. Decoupled PPO [10]. -> scalar.

    The clip is anchored at the behaviour weights of the trainer engine (logp_old), and the engine gap
    p_old / q_infer goes into `weights` (TIS, MIS, CIS, ...). Clip-higher 0.28 as in DAPO. A token whose log-ratio
    is non-finite is dropped.
    """
    _check_bt(mask, logp=logp, logp_old=logp_old)
    A, w = _check_adv(adv, mask), _weights_or_ones(weights, mask)
    ok = mask & torch.isfinite(logp) & torch.isfinite(logp_old)
    log_ratio = torch.where(ok, logp - logp_old.detach(), torch.zeros_like(logp))
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # r = p / p_old, carries gradient
    surrogate = ratio * A
    surrogate_clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * A
    return -masked_mean(w * torch.minimum(surrogate, surrogate_clipped), ok)


def score_centering_loss(
    logp: torch.Tensor,
    logp_topk: torch.Tensor,
    logp_infer: torch.Tensor,
    logp_topk_infer: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cap: float | None = None,
    band: tuple[float, float] | None = None,
):
    """-mean_mask(A * (f(r_y) log p_y - sum_{v in H} coef_v log p_v)): score centering [2], Eq. (drift) + App. A.

    Subtracts the sampler-expected (IS-weighted) score so that E_q[grad] has no drift term E_q[A] sum_v q_v s_v.
    f = 1 (SC), min(r, cap) (SC + TIS) or r 1[band] (SC + MIS), r = p / q with p the current trainer probability.
    Top-k head H (K ids), tail modelled as p rescaled to q's tail mass: rho_tail = (1 - sum_H q) / (1 - sum_H p),
    alpha = rho_tail f(1 / rho_tail), coef_v = q_v f(p_v / q_v) - alpha p_v (all detached). Exact when K = V.
    logp, logp_infer, adv (B, T); logp_topk (grad) and logp_topk_infer (B, T, K). -> scalar.
    """
    _check_bt(mask, logp=logp, logp_infer=logp_infer)
    for name, t in (("logp_topk", logp_topk), ("logp_topk_infer", logp_topk_infer)):
        _check_tensor(name, t)
        if t.dim() != 3 or t.shape[:2] != mask.shape or t.shape != logp_topk.shape:
            raise ValueError(f"{name} must have shape (B, T, K) with (B, T) = {tuple(mask.shape)}, got {tuple(t.shape)}")
    if cap is not None and band is not None:
        raise ValueError("pass at most one of cap (SC + TIS) and band (SC + MIS)")
    A = _check_adv(adv, mask)
    p_head = torch.nan_to_num(logp_topk.detach().float(), nan=-math.inf).clamp(max=0).exp()  # (B, T, K)
    q_head = torch.nan_to_num(logp_topk_infer.detach().float(), nan=-math.inf).clamp(max=0).exp()  # (B, T, K)
    rho_tail = (1 - q_head.sum(-1)).clamp(min=TAIL_FLOOR) / (1 - p_head.sum(-1)).clamp(min=TAIL_FLOOR)  # (B, T)
    log_r_y, ok_y = _finite_log_ratio(logp.detach(), logp_infer.detach(), mask)
    log_r_head = (p_head.log() - q_head.log()).nan_to_num(nan=0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B,T,K)
    if cap is not None:  # SC + TIS: q f(p/q) = min(p, C q), alpha = min(1, C rho_tail)
        f_y = log_r_y.exp().clamp(max=cap)
        head, alpha = torch.minimum(p_head, cap * q_head), (cap * rho_tail).clamp(max=1.0)
    elif band is not None:  # SC + MIS: q f(p/q) = p 1[band], alpha = 1[1/hi <= rho_tail <= 1/lo]
        lo, hi = band
        f_y = torch.where((log_r_y.exp() >= lo) & (log_r_y.exp() <= hi), log_r_y.exp(), torch.zeros_like(log_r_y))
        in_band = (log_r_head.exp() >= lo) & (log_r_head.exp() <= hi)
        head = torch.where(in_band, p_head, torch.zeros_like(p_head))
        alpha = ((rho_tail >= 1 / hi) & (rho_tail <= 1 / lo)).float()
    else:  # SC alone: f = 1, q f(p/q) = q, alpha = rho_tail
        f_y, head, alpha = torch.ones_like(log_r_y), q_head, rho_tail
    coef = (head - alpha[..., None] * p_head).nan_to_num(nan=0.0)  # (B, T, K), detached
    logp_topk_safe = torch.where(torch.isfinite(logp_topk), logp_topk, torch.zeros_like(logp_topk))
    baseline = (coef * logp_topk_safe).sum(-1)  # (B, T) sum_H coef_v log p_v
    logp_y, ok = _finite_or_zero(logp, ok_y)
    return -masked_mean(A * (f_y * logp_y - baseline), ok)


def dlc_loss(logp, logp_old, logp_infer, adv, mask, eps_low: float = 0.2, eps_high: float = 0.28, clamp: float = 1.0):
    """Decoupled PPO on the lag ratio p / p_old, weighted by the centred discrepancy of dlc_weights. DLC [3].

    Reconstructed from the abstract of Li, Zhou & Lan: numerics are centred (dlc_weights), lag ratios are clipped
    (the PPO clip), and the sampler is resynchronised when either grows (dlc_should_resync). (B, T) -> scalar.
    """
    weights = dlc_weights(logp_old, logp_infer, mask, clamp=clamp)  # TIM: numerics only
    return ppo_loss(logp, logp_old, adv, mask, weights=weights, eps_low=eps_low, eps_high=eps_high)  # TIM: lag only


def dppo_loss(logp, logp_infer, adv, mask, delta: float = 0.2):
    """-mean_mask(m * r * A), r = p / q, m = 0 iff the token already moved > delta in A's direction. DPPO [8] Binary-TV.

    The trust region is the sampled token's absolute probability shift p - q from the behaviour (sampler) policy;
    only updates that push further out are masked. Otherwise the gradient is the IS-weighted policy gradient
    r A grad log p. Non-finite log-ratio -> token dropped. (B, T) -> scalar.
    """
    _check_bt(mask, logp=logp, logp_infer=logp_infer)
    A = _check_adv(adv, mask)
    ok = mask & torch.isfinite(logp) & torch.isfinite(logp_infer)
    log_ratio = torch.where(ok, logp - logp_infer.detach(), torch.zeros_like(logp))
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # r = p / q, carries gradient
    shift = (torch.where(ok, logp.detach(), torch.zeros_like(logp)).exp()
             - torch.where(ok, logp_infer.detach(), torch.zeros_like(logp)).exp())  # p - q, detached
    outside = ((A > 0) & (shift > delta)) | ((A < 0) & (shift < -delta))
    return -masked_mean(torch.where(outside, torch.zeros_like(ratio), ratio * A), ok)


def dlc_should_resync(staleness: int, mean_discrepancy: float, max_staleness: int, max_discrepancy: float) -> bool:
    """Resync the sampler when staleness > K_max or |mean(logp_old - logp_infer)| > threshold. DLC [3] (reconstr.)."""
    if not math.isfinite(mean_discrepancy):
        return True  # an unmeasurable discrepancy is no reason to trust a stale sampler
    return staleness > max_staleness or abs(mean_discrepancy) > max_discrepancy
