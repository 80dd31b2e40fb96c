"""tim_rl: LLM reinforcement learning under training-inference mismatch (TIM), in one readable file.

In RL for language models the tokens are sampled by an inference engine (vLLM, SGLang, a bf16 or
quantised copy of the weights, a copy that is some steps old) while the gradient is computed by a
training engine (fp32 master weights in torch). The two assign different probabilities to the same
tokens. That gap biases the policy gradient, and the bias compounds because every weight sync
copies the biased trainer back into the sampler. This module measures the gap, splits it into its
sources, and implements every published correction as a short pure function of tensors that you
can copy into your own trainer. Around the math: a torch and a vLLM sampler, an fp32 trainer with
atomic checkpoints, the RL loop and an adapter that runs the weight corrections inside TRL's
GRPOTrainer. The lab (experiments.py: `compare --preset`, one paper claim per preset on paired
seeds, and `bench`) imports this module; this module never imports it.

Shape letters
    B  sequences in the batch (prompts x samples per prompt)
    G  samples per prompt (group size, GRPO)
    T  response positions (prompt tokens are never in these tensors)
    K  top-k token ids recorded by the sampler at each position (K = V allowed)
    V  vocabulary size

Log-prob sources (each per-token tensor is (B, T) float32 over response tokens; `mask` (B, T) bool)
    logp        trainer, current weights, carries gradient
    logp_prox   trainer, proximal weights (before the first update on this rollout batch), detached
    logp_old    trainer engine, behaviour weights (those the sampler held when it sampled), detached
    logp_infer  recorded by the sampler while sampling, detached
    logp_topk / logp_topk_infer   (B, T, K) trainer / sampler log-probs at the sampler's top-k ids

    log(p / q) = (logp - logp_old)  +  (logp_old - logp_infer)
                  policy lag           engine numerics (dtype, kernels, quantisation, rounding)

Simplifications (deliberate; each is said again where it matters)
    1. Losses are token means over the whole batch, sum(x * mask) / max(sum(mask), 1) (the
       "token-mean" of DAPO).
    2. The score-centering baseline uses the sampler's top-k head and models the tail as the
       trainer distribution rescaled to the sampler's tail mass (Marek & Ryabinin, Appendix A);
       with K = V it is exact.
    3. DLC, Fair Cast, the details of COPC and FP8 calibrated clipping are reconstructed from the
       papers' abstracts plus related public work; their docstrings say so. No number of those
       papers is reproduced here.
    4. Non-finite log-probs are never allowed to produce a NaN loss: each function documents
       whether such a token gets weight 0 (dropped) or 1 (left uncorrected).

References
    [1] Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"
        (token TIS).
    [2] Marek & Ryabinin, "Score Centering Stabilizes Off-policy RL", arXiv:2609.20807.
    [3] Li, Zhou & Lan, "On the Origin and Evolution of Training-Inference Mismatch in LLM RL"
        (DLC; abstract only).
    [4] Gao & Gao, "bf16 Rounding Silently Discards Most RL Policy Updates" (Fair Cast; abstract
        only).
    [5] Hu et al., "COPC: Coupled Off-Policy Correction for Asynchronous LLM RL",
        arXiv:2610.09597 (abstract only).
    [6] Yu et al., "Rethinking Training-Inference Mismatch in LLM RL", arXiv:2609.32444 (CIS).
    [7] Chen et al., "Towards Full Pipeline FP8 RL", arXiv:2609.22870 (calibrated clipping;
        details reconstructed).
    [8] Qi et al., "Rethinking the Trust Region in LLM RL", arXiv:2602.04879 (DPPO).
    [9] Qi et al., "Defeating the Training-Inference Mismatch via FP16", arXiv:2510.26788.
    [10] Hilton, Cobbe & Schulman 2021, "Batch size-invariance for policy optimization"
         (decoupled PPO); AReaL.
    [11] Team IcePop / MIS: masked importance sampling, weight rho * 1[lo <= rho <= hi].
    [12] Framework corrections: verl rollout_rs / rollout_is_batch_normalize; Li et al., "Trust
         Region Masking for Long-Horizon LLM RL", arXiv:2512.23075; DeepSeek-V3.2's off-policy
         sequence masking (TRL, slime); MiniMax-M1's CISPO, arXiv:2506.13585; prime-rl's k2 term
         toward the sampler.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import math
import os
import pickle
import random
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

if __name__ == "__main__":  # a command-line run: machinery.py sets OpenMP's policy before torch
    import machinery  # noqa: F401

import torch

# Log-ratios are clamped to +-LOG_RATIO_CLAMP before exp: exp(20) ~ 4.9e8 is far beyond any cap or
# band used here, so the clamp never changes a kept weight, but keeps exp() and its gradient finite.
LOG_RATIO_CLAMP = 20.0
# Tail masses of the score-centering top-k estimator are floored here (Marek & Ryabinin, App. A).
TAIL_FLOOR = 1e-6
# Bits of an fp32 number that bf16 drops: the low 16 of the 32.
BF16_DROPPED_BITS = 16


# --------------------------------------------------------------------------------------------------
# ---- log-space helpers ----


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * mask) / max(sum(mask), 1); values off the mask (even nan) are ignored. (B, T) -> ().

    needs: nothing
    """
    total = torch.where(mask, x, torch.zeros_like(x)).sum()
    return total / mask.sum().clamp(min=1)


def _log_ratio(mask: torch.Tensor, **pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log a/b, ok) for pair = {name_a: a, name_b: b}, checked like _check_bt, detached. (B, T).

    ok = mask & both finite. The log-ratio is 0 where not ok, else raw: a caller clamps it to
    +-LOG_RATIO_CLAMP where it takes exp.

    needs: _check_bt, _check_device, _check_mask, _check_tensor
    """
    _check_bt(mask, **pair)
    a, b = (x.detach() for x in pair.values())
    ok = mask & torch.isfinite(a) & torch.isfinite(b)
    return torch.where(ok, a - b, torch.zeros_like(a)), ok


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk_rows=None, fused=None):
    """log_softmax(logits.float(), -1).gather(-1, ids) in float32. (..., V), (...) -> (...).

    log p_v = z_v - logsumexp(z). ids may carry a trailing K axis, (..., K) -> (..., K), for the
    sampler's top-k ids. Differentiable w.r.t. logits, with finite gradients wherever a row has a
    finite logit. Computed by row chunks (fast paths: chunked_token_logprobs, whose knobs are
    chunk_rows and fused), so no second full-size float32 copy of the logits is ever made, not even
    for a strided slice such as logits[:, :-1]. On CUDA, repeated ids make the gradient's
    scatter_add order-dependent: bitwise reproducible on CPU only.

    needs: _check_tensor, _check_device, logprobs_by_blocks
    """
    _check_tensor("logits", logits)
    _check_tensor("ids", ids, floating=False)
    _check_device("ids", ids, "logits", logits)
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must be an int64 or int32 tensor of token ids, got dtype {ids.dtype}")
    lead, V = logits.shape[:-1], logits.shape[-1]
    if ids.shape != lead and (ids.dim() != logits.dim() or ids.shape[:-1] != lead):
        raise ValueError(f"ids must have shape {tuple(lead)} or {tuple(lead)} + (K,), "
                         f"got {tuple(ids.shape)}")
    ids_k = ids.long()[..., None] if ids.shape == lead else ids.long()  # (..., K); one id: K = 1
    if bool(((ids_k < 0) | (ids_k >= V)).any()):  # one host sync per call
        raise ValueError(f"ids must be token ids in [0, {V}) (the logits' last axis), got min "
                         f"{int(ids_k.min())}, max {int(ids_k.max())}")
    # the formula above by row chunks, log p(ids) = z[ids] - logsumexp(z): no second (N, V) copy
    return logprobs_by_blocks(logits, ids_k, chunk_rows, fused).reshape(ids.shape)


def log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp <= 0, stable at both ends (Maechler 2012). Same shape.

    needs: nothing
    """
    logp = logp.clamp(max=0.0)
    near_zero = logp > -math.log(2.0)
    return torch.where(near_zero, torch.log(-torch.expm1(logp)), torch.log1p(-torch.exp(logp)))


# --------------------------------------------------------------------------------------------------
# ---- sampling transforms (top-p / top-k / min-p) ----
# vLLM's processed log-probs are log(p_v / S) over the tokens that survive truncation, S their mass
# under the untruncated p; a full-vocabulary trainer log-softmax gives log p_v. Their ratio is S at
# every position: a bias, not a policy change (TRL issue #6789). The fix is to renormalise the
# trainer on the sampler's kept support.


def truncation_mask(logits: torch.Tensor, top_p=1.0, top_k=0, min_p=0.0) -> torch.Tensor:
    """Tokens kept after min_p, top_k, then top_p, on logits already divided by the temperature.

    vLLM 0.32's PyTorch path, step for step (MinPLogitsProcessor, apply_top_k_top_p_pytorch): min_p
    keeps p_v >= min_p * max p; the min_p-masked logits are sorted ascending once; top_k keeps those
    >= the k-th largest (ties kept); top_p drops a token when the mass of it and every smaller one
    is <= 1 - top_p (in float32, as vLLM), the largest always kept; ties fall on the side the same
    sort puts them. -inf logits are never kept. vLLM's GPU Triton kernel keeps exactly k tokens at a
    top-k tie and searches the top-p cut approximately. (..., V) -> (..., V) bool.

    needs: _check_tensor, _check_truncation
    """
    _check_tensor("logits", logits)
    _check_truncation(top_p, top_k, min_p)
    x = logits.float()
    V = x.shape[-1]
    if min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -math.inf)
    if 0 < top_k < V or top_p < 1:
        x_sorted, order = x.sort(dim=-1)  # ascending, as vLLM sorts
        if 0 < top_k < V:
            kth = x_sorted[..., V - top_k : V - top_k + 1]  # the k-th largest
            x_sorted = x_sorted.masked_fill(x_sorted < kth, -math.inf)
        if top_p < 1:
            drop = x_sorted.softmax(-1).cumsum(-1) <= 1 - torch.tensor(top_p, dtype=torch.float32)
            drop[..., -1] = False  # the most likely token always stays
            x_sorted = x_sorted.masked_fill(drop, -math.inf)
        x = torch.empty_like(x).scatter_(-1, order, x_sorted)
    return torch.isfinite(x)


def _check_truncation(top_p: float, top_k: int, min_p: float) -> None:
    """A ValueError naming the argument unless top_p in (0, 1], top_k >= 0 and min_p in [0, 1)."""
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 <= min_p < 1:
        raise ValueError(f"min_p must be in [0, 1), got {min_p}")


def support_ids(keep: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """The kept ids of a bool mask, -1 padded to the largest kept count S. (..., V) -> (..., S).

    Costs 8 S bytes per position instead of V for the mask: far less whenever truncation bites
    (S << V / 8). size: S when the caller knows it (decode reads it in its one host sync per
    token); else counted here.

    needs: nothing
    """
    S = size if size is not None else (max(int(keep.sum(-1).max()), 1) if keep.numel() else 1)
    order = torch.sort(keep.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :S]
    return torch.where(keep.gather(-1, order), order, torch.full_like(order, -1))


def renormalize_on_support(logp: torch.Tensor, logp_kept: torch.Tensor):
    """(log p~, log S): log p~ = log p - log S, S = sum_{v kept} p_v: the truncated policy.

    The sampler's processed log-prob is log q~ = log q - log S_q on the same support, so p~ / q~ has
    no truncation bias (TRL PR #7269, NeMo-RL PR #2053). Gradient flows through both terms: it is
    the truncated policy's score. The support must contain the sampled token. logp (B, T);
    logp_kept (B, T, S) with -inf on padding.

    needs: _check_tensor, _check_device
    """
    _check_tensor("logp", logp)
    _check_tensor("logp_kept", logp_kept)
    _check_device("logp_kept", logp_kept, "logp", logp)
    if logp_kept.dim() != logp.dim() + 1 or logp_kept.shape[:-1] != logp.shape:
        raise ValueError(f"logp_kept must have shape {tuple(logp.shape)} + (S,), "
                         f"got {tuple(logp_kept.shape)}")
    log_s = torch.logsumexp(logp_kept, dim=-1).clamp(max=0.0)  # (B, T); no support gives -inf
    return logp - log_s, log_s


def _pad_last(tensors: list[torch.Tensor], value: int) -> list[torch.Tensor]:
    """The tensors with their last dim padded with `value` to the largest one's."""
    S = max(t.shape[-1] for t in tensors)
    return [torch.nn.functional.pad(t, (0, S - t.shape[-1]), value=value) for t in tensors]


def support_differs(kept_a: torch.Tensor, kept_b: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of masked positions whose kept supports ((B, T, S) ids, -1 pads) differ as sets.

    Compares the sorted id lists (padded to one S): (B, T, S) work, no (B, T, V) mask.

    needs: _pad_last
    """
    a, b = (kept.sort(-1).values for kept in _pad_last([kept_a, kept_b], -1))  # (B, T, S) each
    differs = (a != b).any(-1)  # (B, T)
    return float(differs[mask].float().mean()) if mask.any() else 0.0


def merge_support(kept: torch.Tensor | None, rebuilt: torch.Tensor, mask: torch.Tensor):
    """(kept ids, beyond): the sampler's kept support with `rebuilt` where it is empty. (B, T, S).

    kept: (B, T, S) ids, -1 pads (None: the sampler returned none). beyond (B, T) bool: the masked
    positions where it was empty, i.e. a bounded request's K entries were all finite there.

    needs: _pad_last
    """
    if kept is None:
        return rebuilt, torch.zeros_like(mask)
    beyond = mask & (kept < 0).all(-1)  # (B, T): a sampled token is always kept
    if not beyond.any():
        return kept, beyond
    return torch.where(beyond[..., None], *_pad_last([rebuilt, kept], -1)), beyond


# --------------------------------------------------------------------------------------------------
# ---- mismatch metrics ----


def mismatch_metrics(logp_train, logp_infer, mask: torch.Tensor) -> dict[str, float]:
    """KL estimators and ratio statistics of r = p_train / q_infer on masked tokens y ~ q. (B, T).

    k1 = mean(-log r), k2 = mean((log r)^2 / 2), k3 = mean(r - 1 - log r) (Schulman's estimators of
    KL(q || p) under y ~ q), chi2 = mean(r^2) - 1, ess = (sum r)^2 / (N sum r^2) in (0, 1],
    abs_diff = mean |log r|. Non-finite log-probs inside the mask are left out and counted in
    frac_nonfinite. Computed in float64.

    needs: _log_ratio, LOG_RATIO_CLAMP
    """
    log_ratio, ok = _log_ratio(mask, logp_train=logp_train, logp_infer=logp_infer)
    n_mask = int(mask.sum())
    lr = log_ratio[ok].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).double()  # (N,)
    n = lr.numel()
    out = {"n_tokens": float(n_mask), "frac_nonfinite": (n_mask - n) / max(n_mask, 1)}
    if n == 0:
        names = ("k1", "k2", "k3", "abs_diff", "max_abs_diff", "chi2", "mean_log_ratio")
        return out | dict.fromkeys(names, 0.0) | {"ess": 1.0, "ratio_min": 1.0, "ratio_max": 1.0}
    r = lr.exp()
    ess = r.sum().square() / (n * r.square().sum())
    out |= {"k1": float((-lr).mean()), "k2": float((lr.square() / 2).mean()),
            "k3": float((r - 1 - lr).mean()), "abs_diff": float(lr.abs().mean()),
            "max_abs_diff": float(lr.abs().max()), "mean_log_ratio": float(lr.mean()),
            "chi2": float(r.square().mean() - 1), "ess": float(ess),
            "ratio_min": float(r.min()), "ratio_max": float(r.max())}
    return out


def mismatch_ledger(logp, logp_old, logp_infer, mask, logp_master_old=None, log_kept_mass=None,
                    logp_old_sampler_routes=None, logp_old_sampler_gates=None) -> dict[str, float]:
    """total = log p - log q split into lag + numerics (+ rounding, truncation, routing, gates).

    numerics = logp_old - logp_infer (same weights, two engines); lag = logp - logp_old.
    logp_master_old (the trainer engine on the unrounded fp32 master the served copy was exported
    from) splits off rounding = logp_master_old - logp_old, and lag = logp - logp_master_old.
    log_kept_mass (log S of the current trainer on the sampler's kept support, from
    renormalize_on_support) makes the trainer side the renormalised log-prob: total = logp + log S
    - logp_infer and truncation = log S (under lag, S also moves with the lag).
    logp_old_sampler_routes (an MoE model: the trainer engine on the served weights with the
    sampler's experts replayed; logp_old has logp's experts) splits off routing = logp_old -
    logp_old_sampler_routes (0 under R3, where logp_old is that replay); the rest is
    gates_and_numerics, or with logp_old_sampler_gates (the sampler's gate weights replayed too)
    gates = logp_old_sampler_routes - logp_old_sampler_gates and numerics = logp_old_sampler_gates
    - logp_infer. The parts sum to total token by token. Tokens where an input is non-finite are
    left out of every part. (B, T) -> {part_mean, part_abs (mean |.|)}.

    needs: _check_bt, _check_device, _check_mask, _check_tensor
    """
    routes = logp_old_sampler_routes
    gates = None if routes is None else logp_old_sampler_gates  # gates split the routes' part
    given = {"logp_master_old": logp_master_old, "log_kept_mass": log_kept_mass,
             "logp_old_sampler_routes": routes, "logp_old_sampler_gates": gates}
    given = {name: x for name, x in given.items() if x is not None}
    _check_bt(mask, logp=logp, logp_old=logp_old, logp_infer=logp_infer, **given)
    anchor = logp_old if logp_master_old is None else logp_master_old
    logp_full = logp if log_kept_mass is None else logp + log_kept_mass
    parts = {"total": (logp_full, logp_infer), "lag": (logp, anchor)}
    if routes is None:
        parts["numerics"] = (logp_old, logp_infer)
    if logp_master_old is not None:
        parts["rounding"] = (logp_master_old, logp_old)
    if log_kept_mass is not None:
        parts["truncation"] = (logp_full, logp)
    if routes is not None and gates is None:  # the trainer's own gates: router noise lands there
        parts |= {"routing": (logp_old, routes), "gates_and_numerics": (routes, logp_infer)}
    if gates is not None:
        parts |= {"routing": (logp_old, routes), "gates": (routes, gates)}
        parts["numerics"] = (gates, logp_infer)
    ok = mask
    for a, b in parts.values():
        ok = ok & torch.isfinite(a) & torch.isfinite(b)
    n = ok.sum().clamp(min=1)
    out = {}
    for name, (a, b) in parts.items():
        diff = torch.where(ok, a.detach().double() - b.detach().double(), 0.0)
        out[f"{name}_mean"] = float(diff.sum() / n)
        out[f"{name}_abs"] = float(diff.abs().sum() / n)
    return out


def routing_flip_rate(routes_a, routes_b, mask: torch.Tensor) -> dict[str, float]:
    """Share of positions whose k experts (as a set) differ between two routings, per MoE layer.

    routes (B, S, L, k) int, -1: no route (left out; -1 everywhere: a dense layer, skipped); mask
    (B, S) bool, True where counted. -> {"layer0": ..., one per MoE layer, "any": in any layer}.

    needs: _check_tensor
    """
    _check_tensor("routes_a", routes_a, floating=False)
    _check_tensor("routes_b", routes_b, floating=False)
    if routes_a.shape != routes_b.shape or routes_a.shape[:2] != mask.shape:
        raise ValueError(f"routes_a {tuple(routes_a.shape)} and routes_b {tuple(routes_b.shape)} "
                         f"must have one shape (B, S, L, k), (B, S) = mask's {tuple(mask.shape)}")
    routed_a, routed_b = (routes_a >= 0).any((0, 1, 3)), (routes_b >= 0).any((0, 1, 3))  # (L,)
    layers = [n for n in range(routes_a.shape[2]) if routed_a[n] or routed_b[n]]  # the MoE layers
    routes_a, routes_b = routes_a[:, :, layers], routes_b[:, :, layers]
    routed = mask & (routes_a >= 0).all(-1).all(-1) & (routes_b >= 0).all(-1).all(-1)  # (B, S)
    differs = routes_a.sort(-1).values != routes_b.sort(-1).values  # (B, S, L, k)
    flipped = differs.any(-1)[routed].double()  # (N, L) 0 / 1
    n = max(flipped.shape[0], 1)
    per_layer = {f"layer{layer}": float(flipped[:, i].sum() / n) for i, layer in enumerate(layers)}
    return per_layer | {"any": float(flipped.amax(-1).sum() / n)}


def log_odds_displacement(logp_train: torch.Tensor, logp_infer: torch.Tensor) -> torch.Tensor:
    """eps = logit p - logit q, so that p / q = p + (1 - p) e^eps (CIS identity, Yu et al. [6]).

    needs: _check_tensor, _check_device, log1mexp
    """
    _check_tensor("logp_train", logp_train)
    _check_tensor("logp_infer", logp_infer)
    _check_device("logp_infer", logp_infer, "logp_train", logp_train)
    return (logp_train - log1mexp(logp_train)) - (logp_infer - log1mexp(logp_infer))


# --------------------------------------------------------------------------------------------------
# ---- the mismatch doctor ----
# From the (B, T) tensors a trainer already logs, name why trainer and sampler disagree.
# d = logp_train - logp_infer on the usable tokens; each signature is a small function of d. The
# thresholds were tuned on the lab's seeds 0-1 and checked on seeds 2-4 (experiments.py
# doctor-eval; RESULTS.md has its confusion table and detection floors).

DOCTOR_CAUSES = ("clean", "numerics", "truncation", "temperature", "misaligned", "padding", "lag",
                 "outliers", "routing")
DOCTOR_ADVICE = {
    "clean": "nothing to correct: the gap is at fp32 kernel level",
    "numerics": "engine numerics (dtype, kernels, quantised weights): a token-level correction "
                "(tis / mis / icepop); a bf16 engine's share shrinks with an fp16 sampler (FP16 "
                "paper), a quantised one's does not",
    "truncation": "top-p / top-k renormalised by the sampler only: renormalize_on_support, or raw "
                  "sampler log-probs",
    "temperature": "the sampling temperature is applied on one side only: divide the trainer's "
                   "logits by it too",
    "misaligned": "log-probs are shifted by one position: check the logits[:, :-1] / labels[:, 1:] "
                  "slicing",
    "padding": "the gap sits at the mask's edge: the mask is off by one (prompt token or pad "
               "counted)",
    "lag": "the policy moved since sampling: sync more often, or a lag-aware correction (ppo "
           "ratio, dppo, mis)",
    "outliers": "a few sequences carry the gap (another checkpoint, a stale request?): seq_mask / "
                "seq_tis",
    "routing": "MoE experts flip where the gap is largest: routing replay (r3) or fp32 routers",
}
# What the doctor's numbers are called on a dashboard where one equals them (TRL GRPOTrainer)
DOCTOR_METRIC_NAMES = {"mean |log p/q| per token": "TRL sampling/sampling_logp_difference/mean",
                       "max |log p/q|": "TRL sampling/sampling_logp_difference/max"}


class Diagnosis:
    """diagnose_mismatch's answer (a plain class: it copies with torch and math alone).

    evidence: one dict per signature (name, measures, statistic, threshold, verdict: present |
    absent | cannot tell without <input>).
    """

    def __init__(self, cause: str, also_possible: list, evidence: list, advice: str, numbers: dict):
        self.cause = cause  # the most likely cause, one of DOCTOR_CAUSES
        self.also_possible = also_possible  # not ruled out: present, or untestable here
        self.evidence, self.advice = evidence, advice
        self.numbers = numbers  # |d| per token, quantiles of sum_t log p/q per sequence, shares

    def __str__(self) -> str:
        maybe = ", ".join(self.also_possible)
        out = [f"cause: {self.cause}" + (f"   (also possible: {maybe})" if maybe else "")]
        out += [f"advice: {self.advice}", ""]
        out.append(f"  {'signature':<12} {'statistic':<54} {'value':>10}  {'threshold':>9}"
                   "  verdict")
        for s in self.evidence:
            value = "-" if math.isnan(s["statistic"]) else f"{s['statistic']:.4g}"
            row = f"  {s['name']:<12} {s['measures']:<54} {value:>10}  {s['threshold']:>9.3g}"
            out.append(f"{row}  {s['verdict']}")
        out += ["", f"  {'number':<44} {'value':>10}  what your dashboard calls it"]
        for key, value in self.numbers.items():
            out.append(f"  {key:<44} {value:>10.4g}  {DOCTOR_METRIC_NAMES.get(key, '')}")
        return "\n".join(out)

    __repr__ = __str__


def _signature(name: str, measures: str, statistic: float, threshold: float, verdict="") -> dict:
    """One signature: present iff statistic > threshold (nan: absent), unless a verdict is given."""
    verdict = verdict or ("present" if statistic > threshold else "absent")
    return {"name": name, "measures": measures, "statistic": statistic, "threshold": threshold,
            "verdict": verdict}


def _numerics_signature(d, ok) -> dict:
    """Engine numerics are symmetric (rounding moves log q both ways) and grow with entropy.

    2 mean(max(d, 0)) estimates mean |d| from the upward side alone, which one-sided causes
    (renormalised truncation) leave at 0.
    """
    upward = float(2 * d[ok].clamp(min=0).mean())
    return _signature("numerics", "2 mean(max(d, 0)), d = log p - log q", upward, 5e-4)


def _truncation_signature(d, ok, logp_train_topk=None) -> dict:
    """A sampler renormalised on its top-p / top-k support records q = p / S on the kept tokens.

    Then p / q = S <= 1 on every token and mean(p / q) = the kept mass; every other cause keeps
    E_q[p / q] = 1 (an importance weight). With the trainer's top-K log-probs (B, T, K), exactly:
    the share of tokens with p / q < 1 whose p / q is the trainer's mass on a prefix of its sorted
    top-K (top-k and top-p keep such a prefix; engines of one numerics).
    """
    if logp_train_topk is not None:
        top = logp_train_topk.detach().float().sort(-1, descending=True).values  # (B, T, K)
        log_s = top.logcumsumexp(-1)  # the mass of each prefix
        below = ok & (d < -1e-3)
        hit = below & ((log_s - d[..., None]).abs().amin(-1) < 2e-4)  # log S rounds to ~1e-6
        share = float(hit.sum() / below.sum().clamp(min=1))
        return _signature("truncation", "share of p/q < 1 equal to a top-K prefix mass", share, 0.5)
    r = d[ok].exp()
    gap = 1 - float(r.mean())
    se = float(r.std() / math.sqrt(max(r.numel(), 1)))
    measures = f"1 - mean(p/q) - 4 standard errors ({se:.2g})"
    return _signature("truncation", measures, gap - 4 * se, 0.005)


def _temperature_signature(logp_train, logp_infer, ok) -> dict:
    """An unapplied temperature tau makes log q = log p / tau + c (c per position).

    The least-squares slope of log q on log p is then 1 / tau instead of 1.
    """
    p, q = logp_train[ok].double(), logp_infer[ok].double()
    covariance = ((p - p.mean()) * (q - q.mean())).sum()
    slope = float(covariance / (p - p.mean()).square().sum().clamp(min=1e-12))
    return _signature("temperature", "|slope of log q on log p - 1|", abs(slope - 1), 0.02)


def _misaligned_signature(logp_train, logp_infer, ok) -> dict:
    """Log-probs shifted by one position fit log q[t] to log p[t +- 1] far better than to log p[t].

    The statistic: the share of rows (with a gap > 0.05 per token) whose shifted fit is 4x better
    than the aligned one.
    """
    both = (ok[:, 1:] & ok[:, :-1]).float()  # (B, T - 1): pairs (t, t + 1) inside the mask
    p, q = logp_train.nan_to_num(0.0, 0.0, 0.0), logp_infer.nan_to_num(0.0, 0.0, 0.0)
    pairs = (((q - p)[:, :-1], q[:, :-1] - p[:, 1:]), ((q - p)[:, 1:], q[:, 1:] - p[:, :-1]))
    fits = []
    for aligned, shifted in pairs:
        gap, fit = (aligned.abs() * both).sum(1), (shifted.abs() * both).sum(1)  # (B,)
        fits.append((fit < gap / 4) & (gap > 0.05 * both.sum(1)))
    rows = (both.sum(1) > 0).float().sum().clamp(min=1)
    share = float((fits[0] | fits[1]).float().sum() / rows)
    return _signature("misaligned", "share of rows fitting log p[t +- 1] 4x better", share, 0.1)


def _padding_signature(d, ok) -> dict:
    """A mask off by one counts a prompt token or a pad, where the two sides hold unrelated numbers.

    The gap then sits at each row's first or last masked token, not inside.
    """
    idx = torch.arange(ok.shape[1], device=ok.device).expand_as(ok)
    first = idx == torch.where(ok, idx, ok.shape[1]).amin(1, keepdim=True)  # (B, T)
    last = idx == torch.where(ok, idx, -1).amax(1, keepdim=True)
    inner = d.abs()[ok & ~first & ~last].mean().nan_to_num(0.0) + 1e-3
    edge = max(float(d.abs()[ok & e].mean().nan_to_num(0.0)) for e in (first, last))
    measures = "edge mean |d| / (interior mean |d| + 1e-3)"
    return _signature("padding", measures, edge / float(inner), 20.0)


def _lag_signature(logp_infer, d, ok, advantages) -> dict:
    """A trainer some steps ahead of its sampler moved toward positive-advantage tokens.

    So at equal log q, d is larger in rows with A > 0 than in rows with A < 0. GRPO's advantage is
    one number per sequence, so the row is the unit: a Welch t over the rows' mean residual of d on
    (1, log q, the row's mean log q). Counting tokens would read any per-row gap as lag; without the
    row's mean log q, a row's confidence (correct rows are surer) would.
    """
    measures = "t over rows of mean(d - fit on log q), A > 0 vs < 0"
    if advantages is None:
        return _signature("lag", measures, math.nan, 3.0, "cannot tell without advantages")
    tokens = ok.sum(1)  # (B,)
    q = logp_infer.double()
    row_q = torch.where(ok, q, 0.0).sum(1) / tokens.clamp(min=1)  # (B,)
    X = torch.stack([torch.ones_like(q[ok]), q[ok], row_q[:, None].expand_as(q)[ok]], 1)  # (N, 3)
    fit = X @ torch.linalg.lstsq(X, d[ok].double()[:, None]).solution  # (N, 1)
    residual = torch.zeros(ok.shape, dtype=torch.float64, device=ok.device)
    residual[ok] = d[ok].double() - fit[:, 0]
    row_residual = residual.sum(1) / tokens.clamp(min=1)  # (B,)
    row_adv = torch.where(ok, advantages.double(), 0.0).sum(1) / tokens.clamp(min=1)  # (B,)
    up = row_residual[(tokens > 0) & (row_adv > 0)]
    down = row_residual[(tokens > 0) & (row_adv < 0)]
    if min(up.numel(), down.numel()) < 2:
        verdict = "cannot tell with fewer than 2 rows each side"
        return _signature("lag", measures, math.nan, 3.0, verdict)
    spread = (up.var() / up.numel() + down.var() / down.numel()).sqrt().clamp(min=1e-12)
    return _signature("lag", measures, float((up.mean() - down.mean()) / spread), 3.0)


def _outliers_signature(d, ok) -> dict:
    """Sequences from another policy (a stale request, another checkpoint) concentrate |d|.

    The statistic: the share of sum |d| carried by the worst 5 % of sequences.
    """
    rows = torch.where(ok, d.abs(), torch.zeros_like(d)).sum(1)  # (B,)
    worst = rows.topk(max(1, math.ceil(0.05 * rows.numel()))).values.sum()
    measures = "share of sum |d| in the worst 5 % of sequences"
    return _signature("outliers", measures, float(worst / rows.sum()), 0.6)


def _routing_signature(d, ok, routes) -> dict:
    """MoE experts that flip between the two sides make the largest gaps, at the flip and after.

    (Attention reads the flipped hidden states.) The statistic: mean |d| from a row's first flip on
    / mean |d| before it. routes = (routes_train, routes_infer), each (B, T, L, k) int: the experts
    of the forward position that predicts token t.
    """
    measures = "mean |d| after a flip / before"
    if routes is None:
        return _signature("routing", measures, math.nan, 3.0, "cannot tell without routes")
    if len(routes) != 2 or routes[0].shape != routes[1].shape or routes[0].shape[:2] != ok.shape:
        raise ValueError("routes must be (routes_train, routes_infer), each (B, T, L, k), "
                         f"(B, T) = {tuple(ok.shape)}")
    differs = (routes[0].sort(-1).values != routes[1].sort(-1).values).any(-1).any(-1)  # (B, T)
    flipped = differs.cumsum(1) > 0  # from the row's first flip on
    after, before = d.abs()[ok & flipped].mean(), d.abs()[ok & ~flipped].mean()
    return _signature("routing", measures, float(after / before.clamp(min=1e-9)), 3.0)


def _mismatch_numbers(d, ok) -> dict[str, float]:
    """Mean / max |d| per token, the mean answer length T, percentiles of per-sequence sum_t d, and
    the shares of tokens and sequences beyond the TIS cap 2 and outside the IcePop band [0.5, 2]."""
    seq = torch.where(ok, d, torch.zeros_like(d)).sum(1)[ok.any(1)].double()  # (B',)
    out = {"mean |log p/q| per token": float(d[ok].abs().mean()),
           "max |log p/q|": float(d[ok].abs().max()),
           "T, mean answer length (tokens)": float(ok.sum(1)[ok.any(1)].double().mean())}
    for q in (0.0, 0.05, 0.5, 0.95, 1.0):
        out[f"per-sequence sum log p/q, {q:.0%} percentile"] = float(seq.quantile(q))
    for what, x in (("tokens", d[ok].double()), ("sequences", seq)):
        out[f"{what} with p/q > 2 (TIS cap)"] = float((x > math.log(2)).double().mean())
        out[f"{what} outside [0.5, 2] (IcePop)"] = float((x.abs() > math.log(2)).double().mean())
    return out


def diagnose_mismatch(logp_train, logp_infer, mask, *, advantages=None, routes=None,
                      logp_train_topk=None, topk_ids=None) -> Diagnosis:
    """Why trainer (p) and sampler (q) disagree, from their per-token log-probs.

    Every signature's statistic and verdict; the first present one in DOCTOR_CAUSES' order of
    specificity is the cause, the rest also_possible. (B, T) float logp_train / logp_infer, (B, T)
    bool mask; advantages (B, T), (B, 1) or (B,) enables the lag test; routes = (routes_train,
    routes_infer), (B, T, L, k) int, the routing test; logp_train_topk (B, T, K) (the trainer at
    the sampler's top-K ids topk_ids, only shape-checked) the exact truncation test.
    Reconstruction: the rules are this project's, tuned on its own engines (experiments.py
    doctor-eval).

    needs: _check_adv, _log_ratio, LOG_RATIO_CLAMP, Diagnosis, DOCTOR_ADVICE, _signature,
    _padding_signature, _misaligned_signature, _routing_signature, _lag_signature,
    _outliers_signature, _truncation_signature, _temperature_signature, _numerics_signature,
    _mismatch_numbers, DOCTOR_METRIC_NAMES, _check_bt, _check_device, _check_mask, _check_tensor
    """
    _check_bt(mask, logp_train=logp_train, logp_infer=logp_infer)
    logp_train, logp_infer = logp_train.detach().float(), logp_infer.detach().float()
    d, ok = _log_ratio(mask, logp_train=logp_train, logp_infer=logp_infer)
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if not ok.any():
        raise ValueError("mask: no finite token to diagnose")
    adv = None if advantages is None else _check_adv(advantages, mask)
    topk = logp_train_topk
    if topk is not None and (topk.shape[:2] != mask.shape or topk_ids is not None
                             and topk_ids.shape != topk.shape):
        raise ValueError("logp_train_topk / topk_ids must be (B, T, K) with (B, T) = "
                         f"{tuple(mask.shape)}")
    evidence = [_padding_signature(d, ok), _misaligned_signature(logp_train, logp_infer, ok),
                _routing_signature(d, ok, routes), _lag_signature(logp_infer, d, ok, adv),
                _outliers_signature(d, ok), _truncation_signature(d, ok, logp_train_topk),
                _temperature_signature(logp_train, logp_infer, ok), _numerics_signature(d, ok)]
    clean = float(d[ok].abs().mean()) < 1e-4  # below every real engine seen (fp16: ~1e-3)
    present = [] if clean else [s["name"] for s in evidence if s["verdict"] == "present"]
    explained = present[0] if present else "numerics"  # numerics: a gap no signature explains
    cause = "clean" if clean else explained
    untested = [s["name"] for s in evidence if s["verdict"].startswith("cannot")]
    advice = "; ".join(DOCTOR_ADVICE[c] for c in [cause, *present[1:]])  # every cause present
    also = present[1:] + ([] if clean else [f"{name} (not tested)" for name in untested])
    return Diagnosis(cause, also, evidence, advice, _mismatch_numbers(d, ok))


# --------------------------------------------------------------------------------------------------
# ---- weight export (fp32 master -> bf16 served copy) ----
# Fair Cast [4] (reconstructed from the abstract): round-to-nearest silently drops every per-step
# update smaller than half a bf16 cell (2^-8 of the weight's binade), so the sampler lags the
# master; unbiased rounding fixes it.


def _check_fp32(name: str, x) -> None:
    """A TypeError naming the argument unless x is a float32 tensor (the fp32 master)."""
    _check_tensor(name, x)
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (the fp32 master), got {x.dtype}")


def round_nearest_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even fp32 -> bf16, what `x.to(torch.bfloat16)` does everywhere. Same shape.

    needs: _check_fp32, _check_tensor
    """
    _check_fp32("x", x)
    return x.to(torch.bfloat16)


def stochastic_round_bf16(x: torch.Tensor, *, generator=None, noise=None) -> torch.Tensor:
    """Unbiased fp32 -> bf16: add uniform u in [0, 2^16) to the fp32 bits, drop the low 16 bits.

    Fair Cast [4] (reconstructed): rounds away from zero with probability equal to x's position in
    its bf16 cell, so E[SR(x)] = x exactly for every finite x whose neighbours are finite. `noise`
    (int32, shaped like x, values in [0, 2^16)) replaces the random draw so that tests can
    enumerate all 65 536 draws. inf/nan pass through. The noise is drawn on x's device, with
    `generator` (if given) on that device too. Same shape.

    needs: _check_fp32, _check_device, _check_tensor, BF16_DROPPED_BITS
    """
    _check_fp32("x", x)
    cell = 1 << BF16_DROPPED_BITS
    if noise is None:
        _check_device("generator", generator, "x", x)
        noise = torch.randint(0, cell, x.shape, dtype=torch.int32, generator=generator,
                              device=x.device)
    else:  # a given draw (tests): checked
        _check_tensor("noise", noise, floating=False)
        _check_device("noise", noise, "x", x)
        if noise.dtype != torch.int32 or noise.shape != x.shape:
            raise ValueError(f"noise must be int32 with shape {tuple(x.shape)}, got {noise.dtype}")
        if noise.numel() and (int(noise.min()) < 0 or int(noise.max()) >= cell):
            raise ValueError("noise values must lie in [0, 2**16)")
    # sign-magnitude bits: adding to the magnitude's low bits and truncating rounds |x| up with the
    # right odds
    bits = (x.contiguous().view(torch.int32) + noise) & ~(cell - 1)
    rounded = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero
    return torch.where(torch.isfinite(x), rounded, x.to(torch.bfloat16))


def error_feedback_round_bf16(x: torch.Tensor, residual: torch.Tensor):
    """Sigma-delta export: served = RTN(x + e), e' = x + e - served. -> (served bf16, e' fp32).

    Fair Cast [4] (reconstructed): the rounding error is carried to the next export, so the running
    sum of served values never leaves the running sum of masters by more than half a bf16 cell.
    Deterministic. A non-finite master is served as-is and its residual reset to 0. Same shapes.

    needs: _check_fp32, _check_device, _check_tensor
    """
    _check_fp32("x", x)
    _check_fp32("residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have shape {tuple(x.shape)} like x, "
                         f"got {tuple(residual.shape)}")
    _check_device("residual", residual, "x", x)
    target = x + residual
    served = target.to(torch.bfloat16)
    new_residual = target.sub_(served)  # in place, exact (Sterbenz): within half a cell of target
    if torch.isnan(new_residual.sum()):  # only inf - inf or nan give nan: one sum finds them
        bad = torch.isnan(new_residual)
        served = torch.where(bad, x.to(torch.bfloat16), served)
        new_residual = torch.where(bad, torch.zeros_like(new_residual), new_residual)
    return served, new_residual


def visible_update_fraction(master_before, master_after, served_before, served_after) -> float:
    """<d_served, d_master> / |d_master|^2: the share of the master's move the sampler sees [4].

    1 for a lossless export, ~0 when round-to-nearest swallows the update; 0 when the master did
    not move. Tensors of any one shape.

    needs: _check_tensor, _check_device
    """
    named = {"master_before": master_before, "master_after": master_after,
             "served_before": served_before, "served_after": served_after}
    for name, t in named.items():
        _check_tensor(name, t)
        _check_device(name, t, "master_before", master_before)
        if t.shape != master_before.shape:
            raise ValueError(f"{name} must have shape {tuple(master_before.shape)}, "
                             f"got {tuple(t.shape)}")
    d_master = master_after.double() - master_before.double()
    d_served = served_after.double() - served_before.double()
    denom = float(d_master.square().sum())
    return float((d_served * d_master).sum()) / denom if denom > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# ---- advantages ----


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_std=False) -> torch.Tensor:
    """A_i = r_i - mean_group(r) (/ std_group(r) if normalize_std), groups of G in a row. (B,).

    GRPO (Shao et al. 2024); Dr. GRPO and the score-centering paper [2] drop the std. Groups with
    zero reward variance get advantage 0 either way. Non-finite rewards count as 0.

    needs: _check_tensor
    """
    _check_tensor("rewards", rewards)
    B = rewards.numel()
    if rewards.dim() != 1 or B == 0:
        raise ValueError(f"rewards must have shape (B,) with B >= 1, got {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1 or B % group_size:
        raise ValueError(f"group_size must be a positive int dividing B = {B}, got {group_size!r}")
    r = torch.nan_to_num(rewards.detach().float(), nan=0.0, posinf=0.0, neginf=0.0)
    r = r.view(-1, group_size)  # (B / G, G)
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        std = r.std(dim=1, keepdim=True)  # unbiased, as GRPO / TRL
        adv = adv / torch.where(std > 0, std, torch.ones_like(std))
    return adv.reshape(-1)


def copc_residual_weights(logp, logp_infer, mask: torch.Tensor, eps: float = 0.2) -> torch.Tensor:
    """c_t = clip(p / q, 1 - eps, 1 + eps), detached: COPC [5]. 1 where non-finite. (B, T).

    needs: _log_ratio, LOG_RATIO_CLAMP
    """
    log_ratio, _ = _log_ratio(mask, logp=logp, logp_infer=logp_infer)
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    c = ratio.clamp(1 - eps, 1 + eps)  # the log-ratio of non-finite tokens is 0, so c = 1 there
    return torch.where(mask, c, torch.zeros_like(c))


def copc_advantages(values, rewards, logp, logp_infer, mask, gamma=1.0, lam=1.0, eps=0.2):
    """A_t = sum_l (gamma lam)^l c_{t+l} delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t. (B, T).

    COPC [5], advantage side (reconstructed from the abstract): the TD residuals of GAE are weighted
    by the two-sided clipped ratio c_t = clip(p / q, 1 - eps, 1 + eps), so stale continuations
    count less. With p == q it is plain GAE(gamma, lambda). `rewards` is (B,) (paid at the last
    response token) or (B, T). The state after the last masked token is terminal (value 0).
    Returns detached (advantages, value targets V + A), 0 outside the mask.

    needs: _check_bt, _check_device, _check_mask, _check_tensor, copc_residual_weights
    """
    _check_bt(mask, values=values, logp=logp, logp_infer=logp_infer)
    _check_tensor("rewards", rewards)
    _check_device("rewards", rewards, "values", values)
    B, T = mask.shape
    zero = mask.new_zeros(B, T, dtype=torch.float32)
    if rewards.shape == (B,):
        last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask  # (B, T) last token
        rewards = torch.where(last, rewards.float()[:, None], zero)
    elif rewards.shape != (B, T):
        raise ValueError(f"rewards must have shape (B,) = {(B,)} or (B, T) = {(B, T)}, got "
                         f"{tuple(rewards.shape)}")
    v = torch.where(mask, values.detach().float(), zero)
    r = torch.where(mask, torch.nan_to_num(rewards.detach().float()), zero)
    c = copc_residual_weights(logp, logp_infer, mask, eps)  # TIM: stale residuals are down-weighted
    next_v = torch.cat([v[:, 1:], zero[:, :1]], dim=1)  # 0 past the end and on masked-out positions
    delta = r + gamma * next_v - v
    adv, running = zero.clone(), zero[:, 0]
    for t in reversed(range(T)):
        running = torch.where(mask[:, t], c[:, t] * delta[:, t] + gamma * lam * running, zero[:, 0])
        adv[:, t] = running
    return adv, torch.where(mask, v + adv, zero)


# --------------------------------------------------------------------------------------------------
# ---- correction weights ----
# Each returns a detached (B, T) float32 weight, 0 outside the mask. Detached because an importance
# weight changes the measure the gradient is averaged under, not the objective: no gradient may
# flow through it. rho = exp(logp_old - logp_infer) is a train/infer ratio; which trainer log-prob
# is passed as `logp_old` is the loss's choice (policy_loss): the current p under REINFORCE, the
# proximal p_prox under decoupled PPO.


def tis_weights(logp_old, logp_infer, mask: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """w = min(rho, C): token-level truncated IS, Yao et al. 2025 [1]. Non-finite -> 0. (B, T).

    needs: _log_ratio, LOG_RATIO_CLAMP
    """
    log_rho, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    w = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=cap)
    return torch.where(ok, w, torch.zeros_like(w))


def mis_weights(logp_old, logp_infer, mask, low: float = 0.5, high: float = 5.0):
    """w = rho * 1[low <= rho <= high]: masked IS / IcePop [11], band of [2]. (B, T).

    Non-finite -> 0.

    needs: _log_ratio, LOG_RATIO_CLAMP
    """
    log_rho, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    keep = ok & (rho >= low) & (rho <= high)
    return torch.where(keep, rho, torch.zeros_like(rho))


def _sequence_log_ratio(logp_old, logp_infer, mask):
    """(sum_t log rho_t within +-LOG_RATIO_CLAMP, True where every generated token is finite).

    Each (B, 1); each token's log rho is clamped too, before the sum.
    """
    log_rho, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    seq_ok = (ok == mask).all(dim=1, keepdim=True)  # (B, 1)
    total = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).sum(dim=1, keepdim=True)  # (B, 1)
    return total.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), seq_ok


def seq_tis_weights(logp_old, logp_infer, mask, cap: float = 5.0):
    """w_i = min(prod_t rho_it, C) on every token of sequence i: sequence-level TIS. (B, T).

    Beware: the product shrinks long sequences towards 0 (TRL #5814); geo_mask_weights does not.
    A non-finite token gives its whole sequence weight 0.

    needs: _log_ratio, _sequence_log_ratio, LOG_RATIO_CLAMP
    """
    seq_log_rho, seq_ok = _sequence_log_ratio(logp_old, logp_infer, mask)  # (B, 1) each
    w = seq_log_rho.exp().clamp(max=cap).expand(mask.shape)  # (B, T)
    return torch.where(mask & seq_ok, w, torch.zeros_like(w))


def seq_mask_weights(logp_old, logp_infer, mask, low: float = 0.0, high: float = 3.0):
    """w_i = R_i * 1[low <= R_i <= high], R_i = prod_t rho_it: sequence masked IS. (B, T).

    TRL's GRPOTrainer default (1.16: vllm_importance_sampling_mode="sequence_mask", band
    [clip_min, clip_max] = [None (no lower bound), 3.0], edges kept). A non-finite token gives its
    sequence 0 (TRL counts it as ratio 1). The product shrinks long sequences like seq_tis_weights.

    needs: _log_ratio, _sequence_log_ratio, LOG_RATIO_CLAMP
    """
    seq_log_rho, seq_ok = _sequence_log_ratio(logp_old, logp_infer, mask)
    seq_rho = seq_log_rho.exp()  # (B, 1)
    keep = mask & seq_ok & (seq_rho >= low) & (seq_rho <= high)  # (B, T)
    zero = torch.zeros_like(keep, dtype=torch.float32)
    return torch.where(keep, seq_rho.expand(mask.shape), zero)


def geo_mask_weights(logp_old, logp_infer, mask, low: float = 0.99, high: float = 1.01):
    """w_i = 1[low <= exp(mean_t log rho_it) <= high] on every token of sequence i. (B, T).

    The geometric-mean sequence mask: a length-neutral replacement for the sequence product
    (TRL #5814, NeMo-RL #2269). Non-finite -> 0.

    needs: _log_ratio, LOG_RATIO_CLAMP
    """
    log_rho, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    seq_ok = (ok == mask).all(dim=1, keepdim=True)  # (B, 1)
    total = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).sum(dim=1, keepdim=True)  # (B, 1)
    geo = (total / mask.sum(dim=1, keepdim=True).clamp(min=1)).exp()
    return (mask & seq_ok & (geo >= low) & (geo <= high)).float()


def cis_weights(logp_old, logp_infer, mask, lam: float = 2.3, kappa: float = 5e-3):
    """w = min(rho, 1 + lam * max(1 - p_old, kappa)): CIS [6], Sec. 4. (B, T).

    From rho = p + (1 - p) e^eps with eps = logit p - logit q, truncating the log-odds shift eps
    gives a cap that tightens with confidence. Upper side only. Non-finite log-ratio -> 1 (left
    uncorrected, as the official code does).

    needs: _log_ratio, LOG_RATIO_CLAMP
    """
    log_rho, _ = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    p_old = torch.nan_to_num(logp_old.detach().float(), nan=0.0).clamp(max=0.0).exp()
    cap = 1 + lam * (1 - p_old).clamp(min=kappa)
    rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    w = torch.minimum(rho, cap)  # log_rho = 0 on non-finite tokens, so w = 1 there
    return torch.where(mask, w, torch.zeros_like(w))


def dlc_weights(logp_old, logp_infer, mask, clamp: float = 1.0):
    """w = exp(clip(d - mean_mask(d), -c, c)), d = logp_old - logp_infer. DLC [3]. (B, T).

    Reconstructed from the abstract of Li, Zhou & Lan ("centres numerical errors"): the persistent
    part of the engine discrepancy (its batch mean) is removed, the rest is a bounded weight in
    [e^-c, e^c]. Non-finite -> 0.

    needs: _log_ratio, masked_mean, LOG_RATIO_CLAMP
    """
    d, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    centred = d - masked_mean(d, ok)
    w = centred.clamp(-clamp, clamp).exp()
    return torch.where(ok, w, torch.zeros_like(w))


def copc_mask(logp_old, logp_infer, mask, low: float = 0.5, high: float = 2.0):
    """m = 1[low <= rho <= high]: COPC's token ratio mask [5] (policy side; reconstructed). (B, T).

    Non-finite -> 0.

    needs: _log_ratio, LOG_RATIO_CLAMP
    """
    log_rho, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return (ok & (rho >= low) & (rho <= high)).float()


def calibrated_clip_bounds(ratio_lowprec, ratio_ref, adv, mask, eps_low=0.2, eps_high=0.28):
    """PPO clip bounds (L, H) for low-precision ratios that clip as the reference does. FP8 [7].

    Reconstructed from the abstract of Chen et al.: L is chosen so that the share of
    negative-advantage tokens with r_lowprec < L equals the share with r_ref < 1 - eps_low; H so
    that P(H) / N(L) on the low-precision ratios equals P(1 + eps_high) / N(1 - eps_low) on the
    reference, with P(H) = sum_{A>0, r<=H} A r and N(L) = sum_{A<0, r>=L} |A| r. Falls back to
    (1 - eps_low, 1 + eps_high) when a side has no tokens. (B, T) -> (float, float).

    needs: _check_adv, _check_bt, _check_device, _check_mask, _check_tensor
    """
    _check_bt(mask, ratio_lowprec=ratio_lowprec, ratio_ref=ratio_ref)
    A = _check_adv(adv, mask)
    ok = mask & torch.isfinite(ratio_lowprec) & torch.isfinite(ratio_ref)
    neg, pos = ok & (A < 0), ok & (A > 0)
    if not neg.any() or not pos.any():
        return 1 - eps_low, 1 + eps_high
    low_neg = ratio_lowprec[neg].double().sort().values  # (N-,)
    n_clipped = int((ratio_ref[neg] < 1 - eps_low).sum())  # what the reference zeroes
    if n_clipped < low_neg.numel():
        L = float(low_neg[n_clipped])
    else:
        L = math.nextafter(float(low_neg[-1]), math.inf)

    def balance(r, H, L_):
        """(P(H), N(L)) of the ratios r."""
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


# Framework corrections (verl rollout_rs / rollout_is_batch_normalize, DeepSeek-V3.2's OPSM). The
# three per-token estimators of KL(q || p_old) from log rho = logp_old - logp_infer on tokens
# y ~ q, Schulman's k1, k2, k3; a divergence mask takes one as `estimator` (a function).


def kl_k1(log_rho: torch.Tensor) -> torch.Tensor:
    """k1 = -log rho: unbiased, signed (negative where the trainer is more confident). Same shape.

    needs: nothing
    """
    return -log_rho


def kl_k2(log_rho: torch.Tensor) -> torch.Tensor:
    """k2 = (log rho)^2 / 2: >= 0, biased, low variance. Same shape.

    needs: nothing
    """
    return log_rho.square() / 2


def kl_k3(log_rho: torch.Tensor) -> torch.Tensor:
    """k3 = rho - 1 - log rho: >= 0 and unbiased. Same shape.

    needs: LOG_RATIO_CLAMP
    """
    return log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp() - 1 - log_rho


def divergence_mask_weights(logp_old, logp_infer, mask, threshold=0.01, estimator=None):
    """m = 1[k(log rho) <= threshold] per token: verl rollout_rs="token_k1|k2|k3". (B, T).

    k = estimator(log rho): kl_k1, kl_k2 or kl_k3 (None: kl_k3; K3-RS preset 0.01). Rejection, not
    reweighting: kept tokens get weight 1. Non-finite log-ratio -> 0.

    needs: _log_ratio, kl_k3, LOG_RATIO_CLAMP
    """
    log_rho, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    estimate = (estimator or kl_k3)(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return (ok & (estimate <= threshold)).float()


def _sequence_divergence(logp_old, logp_infer, mask, estimator=None):
    """(per-token estimate, kl_k3 by default, -inf off the mask; (B, 1) True where every generated
    token is finite)."""
    log_rho, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    estimate = (estimator or kl_k3)(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    estimate = torch.where(mask, estimate, torch.full_like(log_rho, -math.inf))  # (B, T)
    return estimate, (ok == mask).all(dim=1, keepdim=True)


def divergence_seq_max_mask(logp_old, logp_infer, mask, threshold=0.01, estimator=None):
    """m_i = 1[max_t k(log rho_it) <= threshold] on every token of sequence i: a veto. (B, T).

    Trust Region Masking (Li et al., arXiv 2512.23075: the error bounds grow with the largest
    per-token divergence, so a sequence with one token outside the region is dropped whole); verl
    rollout_rs="seq_max_k2|k3". Non-finite -> 0 for the sequence.

    needs: _log_ratio, kl_k3, _sequence_divergence, LOG_RATIO_CLAMP
    """
    estimate, seq_ok = _sequence_divergence(logp_old, logp_infer, mask, estimator)
    worst = estimate.amax(dim=1, keepdim=True)  # (B, 1)
    return (mask & seq_ok & (worst <= threshold)).float()


def divergence_seq_mean_mask(logp_old, logp_infer, mask, threshold=0.01, estimator=None):
    """m_i = 1[mean_t k(log rho_it) <= threshold]: verl rollout_rs="seq_mean_k1|k2|k3". (B, T).

    Length-neutral like geo_mask_weights (with kl_k1 it is a one-sided geometric-mean mask).
    Non-finite -> 0 for the sequence.

    needs: _log_ratio, kl_k3, _sequence_divergence, LOG_RATIO_CLAMP
    """
    estimate, seq_ok = _sequence_divergence(logp_old, logp_infer, mask, estimator)
    total = torch.where(mask, estimate, torch.zeros_like(estimate)).sum(dim=1, keepdim=True)
    mean = total / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    return (mask & seq_ok & (mean <= threshold)).float()


def divergence_seq_sum_mask(logp_old, logp_infer, mask, threshold=0.01, estimator=None):
    """m_i = 1[sum_t k(log rho_it) <= threshold]: verl rollout_rs="seq_sum_k1|k2|k3". (B, T).

    The sum grows with the length, so long sequences are dropped first (like the sequence
    product). Non-finite -> 0 for the sequence.

    needs: _log_ratio, kl_k3, _sequence_divergence, LOG_RATIO_CLAMP
    """
    estimate, seq_ok = _sequence_divergence(logp_old, logp_infer, mask, estimator)
    total = torch.where(mask, estimate, torch.zeros_like(estimate)).sum(dim=1, keepdim=True)
    return (mask & seq_ok & (total <= threshold)).float()


def self_normalize_weights(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """w / mean_mask(w): mean 1 over the batch's valid tokens. verl rollout_is_batch_normalize.

    Self-normalised IS trades a bias of order 1/N (the normaliser is itself an estimate) for less
    variance. Under Adam it is nearly a no-op (one scale for the whole batch's gradient). Pass
    sequence weights through self_normalize_seq_weights instead. Non-finite -> 0; all zero stays
    zero. (B, T).

    needs: _check_bt, _check_device, _check_mask, _check_tensor
    """
    _check_bt(mask, weights=weights)
    ok = mask & torch.isfinite(weights)
    w = torch.where(ok, weights.detach().float(), torch.zeros_like(weights, dtype=torch.float32))
    mean = w.sum() / ok.sum().clamp(min=1)
    return torch.where(mean > 0, w / mean, w)


def self_normalize_seq_weights(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """w_i / mean_i(w_i) for a weight constant along each sequence (seq_tis, seq_mask, geo). (B, T).

    The mean is over sequences, not tokens, so a long sequence is one vote: verl
    rollout_is="sequence" + rollout_is_batch_normalize. A sequence's weight is read at its first
    generated token; non-finite -> 0.

    needs: _check_bt, _check_device, _check_mask, _check_tensor
    """
    _check_bt(mask, weights=weights)
    first = mask.float().argmax(dim=1, keepdim=True)  # (B, 1)
    w_seq = weights.detach().float().gather(1, first)  # (B, 1)
    live = mask.any(dim=1, keepdim=True) & torch.isfinite(w_seq)
    w_seq = torch.where(live, w_seq, torch.zeros_like(w_seq))
    mean = w_seq.sum() / live.sum().clamp(min=1)
    w_seq = torch.where(mean > 0, w_seq / mean, w_seq)
    zero = torch.zeros_like(weights, dtype=torch.float32)
    return torch.where(mask, w_seq.expand(mask.shape), zero)


def opsm_mask(logp, logp_infer, adv, mask, delta: float = 1e-4):
    """m_i = 0 iff A_i < 0 and mean_t(logp_infer - logp) > delta, on sequence i: OPSM. (B, T).

    DeepSeek-V3.2's off-policy sequence masking, as TRL (off_policy_mask_threshold: keep A >= 0 or
    seq_kl <= delta) and slime (--use-opsm, --opsm-delta 1e-4) implement it: seq_kl is the k1
    estimate of KL(q || p) on y ~ q, the sampler's log-prob minus the current trainer's, so a bad
    sample the trainer already finds less likely than the sampler did is not pushed further down.
    Positive-advantage sequences are always kept. A non-finite token gets 0 and makes its
    sequence's KL unmeasurable: dropped when A < 0. adv (B, T), (B, 1) or (B,).

    needs: _check_adv, _log_ratio, LOG_RATIO_CLAMP
    """
    log_ratio, ok = _log_ratio(mask, logp_infer=logp_infer, logp=logp)  # log q / p
    A = _check_adv(adv, mask)
    total = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).sum(dim=1, keepdim=True)  # (B, 1)
    seq_kl = total / mask.sum(dim=1, keepdim=True).clamp(min=1)
    seq_ok = (ok == mask).all(dim=1, keepdim=True)
    off_policy = (A < 0) & ~(seq_ok & (seq_kl <= delta))  # (B, T)
    return (ok & ~off_policy).float()


# --------------------------------------------------------------------------------------------------
# ---- losses ----
# Scalars, token means over the batch. Loss values of different corrections are not comparable
# with each other: watch reward, accuracy and the mismatch metrics instead.


def _finite_or_zero(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x with 0 off the mask or where non-finite, ok); torch.where keeps the kept entries' grad."""
    ok = mask & torch.isfinite(x)
    return torch.where(ok, x, torch.zeros_like(x)), ok


def _weights_or_ones(weights, mask) -> torch.Tensor:
    """Detached float weights, 0 off the mask and where non-finite; None: 1 on the mask."""
    if weights is None:
        return mask.float()
    _check_bt(mask, weights=weights)
    w = weights.detach().float()  # a change of measure: never differentiated through
    return torch.where(mask & torch.isfinite(w), w, torch.zeros_like(w))


def pg_loss(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, weights=None):
    """-mean_mask(w * A * logp): REINFORCE with an optional detached per-token weight. (B, T) -> ().

    A non-finite logp inside the mask drops that token (no gradient, no NaN).

    needs: _check_adv, _check_bt, _check_device, _check_mask, _check_tensor, _finite_or_zero,
    masked_mean, _weights_or_ones
    """
    _check_bt(mask, logp=logp)
    A, w = _check_adv(adv, mask), _weights_or_ones(weights, mask)
    logp, ok = _finite_or_zero(logp, mask)
    return -masked_mean(w * A * logp, ok)


def ppo_loss(logp, logp_prox, adv, mask, weights=None, eps_low=0.2, eps_high=0.28):
    """-mean_mask(w min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)), r = p / p_prox. [10] -> ().

    Decoupled PPO: the clip is anchored at the proximal policy p_prox, the trainer's own weights
    before the first update on this rollout batch (AReaL; verl's recomputed old_log_prob). The
    behaviour gap p_prox / q (lag + engine numerics) is not in the clip but in `weights` (TIS, MIS,
    CIS, ...). With one update per batch r = 1 and the clip is inert; it bites from the second
    update on (RLConfig.updates_per_batch). Anchoring at the sampler instead (p_prox := q) gives
    the plain "sampler log-probs as pi_old" PPO. Clip-higher 0.28 as in DAPO. A non-finite
    log-ratio drops the token. (B, T).

    needs: _check_adv, _check_bt, _check_device, _check_mask, _check_tensor, masked_mean,
    _weights_or_ones, LOG_RATIO_CLAMP
    """
    _check_bt(mask, logp=logp, logp_prox=logp_prox)
    A, w = _check_adv(adv, mask), _weights_or_ones(weights, mask)
    ok = mask & torch.isfinite(logp) & torch.isfinite(logp_prox)
    log_ratio = torch.where(ok, logp - logp_prox.detach(), torch.zeros_like(logp))
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # p / p_prox, with gradient
    surrogate = ratio * A
    surrogate_clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * A
    return -masked_mean(w * torch.minimum(surrogate, surrogate_clipped), ok)


def score_centering_loss(logp, logp_topk, logp_infer, logp_topk_infer, adv, mask, cap=None,
                         band=None):
    """-mean_mask(A (f(r_y) log p_y - sum_{v in H} coef_v log p_v)): score centering [2]. -> ().

    Eq. (drift) + App. A: subtracts the sampler-expected (IS-weighted) score so that E_q[grad] has
    no drift term E_q[A] sum_v q_v s_v. f = 1 (SC), min(r, cap) (SC + TIS) or r 1[band]
    (SC + MIS), r = p / q with p the current trainer probability. Top-k head H (K ids), tail
    modelled as p rescaled to q's tail mass: rho_tail = (1 - sum_H q) / (1 - sum_H p),
    alpha = rho_tail f(1 / rho_tail), coef_v = q_v f(p_v / q_v) - alpha p_v (all detached). Exact
    when K = V. logp, logp_infer, adv (B, T); logp_topk (grad) and logp_topk_infer (B, T, K).

    needs: _check_adv, _log_ratio, _finite_or_zero, masked_mean, LOG_RATIO_CLAMP, TAIL_FLOOR,
    _check_bt, _check_device, _check_mask, _check_tensor
    """
    log_r_y, ok_y = _log_ratio(mask, logp=logp, logp_infer=logp_infer)
    for name, t in (("logp_topk", logp_topk), ("logp_topk_infer", logp_topk_infer)):
        _check_tensor(name, t)
        _check_device(name, t, "logp", logp)
        if t.dim() != 3 or t.shape[:2] != mask.shape or t.shape != logp_topk.shape:
            raise ValueError(f"{name} must have shape (B, T, K) with (B, T) = {tuple(mask.shape)}, "
                             f"got {tuple(t.shape)}")
    if cap is not None and band is not None:
        raise ValueError("pass at most one of cap (SC + TIS) and band (SC + MIS)")
    A = _check_adv(adv, mask)
    p_head = torch.nan_to_num(logp_topk.detach().float(), nan=-math.inf).clamp(max=0).exp()
    q_head = torch.nan_to_num(logp_topk_infer.detach().float(), nan=-math.inf).clamp(max=0).exp()
    q_tail = (1 - q_head.sum(-1)).clamp(min=TAIL_FLOOR)  # (B, T)
    rho_tail = q_tail / (1 - p_head.sum(-1)).clamp(min=TAIL_FLOOR)
    r_y = log_r_y.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # (B, T)
    if cap is not None:  # SC + TIS: q f(p/q) = min(p, C q), alpha = min(1, C rho_tail)
        f_y = r_y.clamp(max=cap)
        head, alpha = torch.minimum(p_head, cap * q_head), (cap * rho_tail).clamp(max=1.0)
    elif band is not None:  # SC + MIS: q f(p/q) = p 1[band], alpha = 1[1/hi <= rho_tail <= 1/lo]
        lo, hi = band
        f_y = torch.where((r_y >= lo) & (r_y <= hi), r_y, torch.zeros_like(log_r_y))
        log_r_head = (p_head.log() - q_head.log()).nan_to_num(nan=0.0)  # (B, T, K)
        r_head = log_r_head.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        head = torch.where((r_head >= lo) & (r_head <= hi), p_head, torch.zeros_like(p_head))
        alpha = ((rho_tail >= 1 / hi) & (rho_tail <= 1 / lo)).float()
    else:  # SC alone: f = 1, q f(p/q) = q, alpha = rho_tail
        f_y, head, alpha = torch.ones_like(log_r_y), q_head, rho_tail
    coef = (head - alpha[..., None] * p_head).nan_to_num(nan=0.0)  # (B, T, K), detached
    logp_topk_safe = torch.where(torch.isfinite(logp_topk), logp_topk, torch.zeros_like(logp_topk))
    baseline = (coef * logp_topk_safe).sum(-1)  # (B, T): sum_H coef_v log p_v
    logp_y, ok = _finite_or_zero(logp, ok_y)
    return -masked_mean(A * (f_y * logp_y - baseline), ok)


def dlc_loss(logp, logp_old, logp_infer, adv, mask, eps_low=0.2, eps_high=0.28, clamp=1.0,
             logp_prox=None, lag_cap=2.0):
    """Decoupled PPO, w = dlc_weights(d) min(p_prox / p_old, lag_cap). DLC [3]. (B, T) -> ().

    Reconstructed from the abstract of Li, Zhou & Lan ("centres numerical errors, clips lag
    ratios"): the engine part d = logp_old - logp_infer gets the centred weight of dlc_weights; the
    staleness part p_prox / p_old (same engine, behaviour -> proximal weights) is truncated at
    lag_cap; the update p / p_prox is PPO-clipped. Each part is bounded on its own, so lag cannot
    use up the budget meant for numerics. logp_prox defaults to logp (one update per batch).

    needs: _check_adv, _check_bt, _check_device, _check_mask, _check_tensor, dlc_weights,
    _log_ratio, masked_mean, ppo_loss, tis_weights, _weights_or_ones, LOG_RATIO_CLAMP
    """
    _check_bt(mask, logp=logp)
    logp_prox = logp.detach() if logp_prox is None else logp_prox
    weights = dlc_weights(logp_old, logp_infer, mask, clamp=clamp)  # TIM: numerics only
    weights = weights * tis_weights(logp_prox, logp_old, mask, cap=lag_cap)  # TIM: staleness only
    return ppo_loss(logp, logp_prox, adv, mask, weights=weights, eps_low=eps_low, eps_high=eps_high)


def dppo_loss(logp, logp_infer, adv, mask, delta: float = 0.2):
    """-mean_mask(m r A), r = p / q, m = 0 iff the token already moved > delta toward A. DPPO [8].

    Binary-TV: the trust region is the sampled token's absolute probability shift p - q from the
    behaviour (sampler) policy; only updates that push further out are masked. Otherwise the
    gradient is the IS-weighted policy gradient r A grad log p. Non-finite log-ratio -> token
    dropped. (B, T) -> ().

    needs: _check_adv, _check_bt, _check_device, _check_mask, _check_tensor, masked_mean,
    LOG_RATIO_CLAMP
    """
    _check_bt(mask, logp=logp, logp_infer=logp_infer)
    A = _check_adv(adv, mask)
    ok = mask & torch.isfinite(logp) & torch.isfinite(logp_infer)
    log_ratio = torch.where(ok, logp - logp_infer.detach(), torch.zeros_like(logp))
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # r = p / q, with gradient
    p = torch.where(ok, logp.detach(), torch.zeros_like(logp)).exp()
    q = torch.where(ok, logp_infer.detach(), torch.zeros_like(logp)).exp()
    shift = p - q  # detached
    outside = ((A > 0) & (shift > delta)) | ((A < 0) & (shift < -delta))
    return -masked_mean(torch.where(outside, torch.zeros_like(ratio), ratio * A), ok)


def effective_token_weights(loss, logp: torch.Tensor, adv, mask: torch.Tensor) -> torch.Tensor:
    """w_t = -(d loss / d logp_t) N / A_t: what a loss multiplies a token's A grad log p by. (B, T).

    1 for plain REINFORCE, rho for IS, 0 where a clip or mask drops the token; nan where A_t = 0
    (undefined). N is the number of masked tokens (losses are token means). Differentiates only
    back to logp, not into the model. Detached.

    needs: _check_adv, _check_bt, _check_device, _check_mask, _check_tensor
    """
    _check_bt(mask, logp=logp)
    A = _check_adv(adv, mask)
    (grad,) = torch.autograd.grad(loss, logp, retain_graph=True, allow_unused=True)
    grad = torch.zeros_like(logp) if grad is None else grad.detach()
    w = -grad * mask.sum().clamp(min=1) / A
    return torch.where(mask & (A != 0), w, torch.full_like(w, math.nan))


def dlc_should_resync(logp, logp_old, mask, staleness: int, max_staleness=0, max_lag=0.05) -> bool:
    """Resync when mean_mask |logp - logp_old| > max_lag or staleness >= max_staleness. DLC [3].

    Each trigger is off at 0. Reconstructed from the abstract of Li, Zhou & Lan ("resynchronises
    the sampler"): the trigger watches the part of the mismatch a resync removes, the policy lag
    (same engine, trainer weights now vs the weights the sampler holds). The engine discrepancy
    logp_old - logp_infer is computed on the same weights on both sides, so no resync can change
    it, and it is deliberately not an input. logp (detached): the trainer now; logp_old: the
    trainer engine on the weights of the last sync (the loop passes the fp32 master at that export,
    logp_master_old, so export rounding is not counted as lag); both (B, T). An unmeasurable
    (non-finite) lag resyncs.

    needs: _check_bt, _check_device, _check_mask, _check_tensor, _log_ratio, masked_mean,
    LOG_RATIO_CLAMP
    """
    _check_bt(mask, logp=logp, logp_old=logp_old)
    if max_staleness <= 0 and max_lag <= 0:
        return False  # both triggers off
    lag, ok = _log_ratio(mask, logp=logp, logp_old=logp_old)
    if bool((mask & ~ok).any()):
        return True  # an unmeasurable lag is no reason to trust a stale sampler
    if max_staleness > 0 and staleness >= max_staleness:
        return True  # too stale
    lag = lag.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return max_lag > 0 and float(masked_mean(lag.abs(), ok)) > max_lag


def cispo_loss(logp, logp_infer, adv, mask, eps_high: float = 0.28):
    """-mean_mask(sg(min(r, 1 + eps_high)) A logp), r = p / q: CISPO (MiniMax-M1). (B, T) -> ().

    arXiv 2506.13585. The ratio is clipped as a detached coefficient, not inside PPO's min: no
    token's gradient is dropped, the confident ones are only scaled down. MiniMax-M1 (and TRL
    loss_type="cispo", whose epsilon_high is the cap itself, 1 + eps_high here) take
    r = p / p_old against the trainer's proximal policy and leave the lower side unclipped; pass
    logp_prox as logp_infer for that. tim_rl's arm passes the sampler's q: one update per batch
    makes p / p_prox identically 1 (plain REINFORCE), while p / q covers the whole gap (lag and
    numerics), so the arm is token TIS with cap 1 + eps_high. Non-finite log-ratio -> token
    dropped.

    needs: _check_adv, _log_ratio, _finite_or_zero, masked_mean, LOG_RATIO_CLAMP, _check_bt,
    _check_device, _check_mask, _check_tensor
    """
    log_r, ok = _log_ratio(mask, logp=logp, logp_infer=logp_infer)
    A = _check_adv(adv, mask)
    coef = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=1 + eps_high)  # a weight
    logp, ok = _finite_or_zero(logp, ok)
    return -masked_mean(coef * A * logp, ok)


def k2_penalty(logp, logp_infer, mask, coef: float = 1e-3):
    """coef mean_mask((logp - logp_infer)^2 / 2): a k2 pull toward the sampler (prime-rl). -> ().

    prime-rl's loss, kl_tau = 1e-3. Its gradient coef (logp - logp_infer) grad logp moves each
    sampled token's trainer log-prob toward the sampler's, shrinking the mismatch the other terms
    must correct; added to any arm's loss (--k2-coef). Non-finite log-ratio -> token dropped.
    (B, T).

    needs: _check_bt, _check_device, _check_mask, _check_tensor, masked_mean
    """
    _check_bt(mask, logp=logp, logp_infer=logp_infer)
    ok = mask & torch.isfinite(logp) & torch.isfinite(logp_infer)
    diff = torch.where(ok, logp - logp_infer.detach(), torch.zeros_like(logp))  # logp's gradient
    return coef * masked_mean(diff.square() / 2, ok)


def drift_signal_norms(params, logp, logp_topk, logp_infer, logp_topk_infer, adv, mask) -> dict:
    """Norms of REINFORCE's drift part E_q[A] sum_v q_v s_v and signal part (SC's gradient) [2].

    The split is of REINFORCE on this batch, whatever the arm trains with (hence the pg_ prefix):
    drift = g_pg - g_sc. `params` are the leaves the forward ran on (the served copy under
    loss_on_served). (B, T) / (B, T, K) -> floats.

    needs: pg_loss, score_centering_loss
    """
    params = [p for p in params if p.requires_grad]
    loss_total = pg_loss(logp, adv, mask)
    loss_signal = score_centering_loss(logp, logp_topk, logp_infer, logp_topk_infer, adv, mask)
    g_total = torch.autograd.grad(loss_total, params, retain_graph=True, materialize_grads=True)
    g_signal = torch.autograd.grad(loss_signal, params, retain_graph=True, materialize_grads=True)
    drift = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(g_total, g_signal)))
    signal = math.sqrt(sum(float(b.square().sum()) for b in g_signal))
    return {"pg_drift_grad_norm": drift, "pg_signal_grad_norm": signal,
            "pg_drift_over_signal": drift / max(signal, 1e-12)}


# --------------------------------------------------------------------------------------------------
# ---- MoE routing: record and replay (R2 / R3) ----
# A mixture-of-experts layer sends each token to the top-k experts of its router's softmax. A tiny
# numerical difference between two engines flips a near-tie, and the token's output jumps. Routing
# replay (Ma et al., arXiv 2510.11370; Megatron-Core RouterReplay, verl router_replay R2 | R3,
# slime) records the discrete expert ids and forces them in the trainer, with the weights
# recomputed from the trainer's live router scores. R2 records them from the policy being updated
# before its update (verl: compute_log_prob), R3 in the inference engine (vLLM and SGLang on a GPU:
# enable_return_routed_experts).

# transformers 5.19 routers whose forward is Qwen3MoeTopKRouter.forward line for line (softmax,
# top-k, renormalise; the Qwen3.5-MoE, Qwen3-VL-MoE and Qwen3-Omni-MoE text routers have no
# norm_topk_prob and always renormalise); others (Mixtral, GPT-OSS, DeepSeek, GLM, Granite, ...)
# route differently: replay on them is an error
REPLAYABLE_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "Qwen3NextTopKRouter",
                      "OlmoeTopKRouter", "FlexOlmoTopKRouter", "MellumTopKRouter",
                      "Qwen3OmniMoeThinkerTextTopKRouter", "Qwen3OmniMoeTalkerTextTopKRouter",
                      "Qwen3OmniMoeTextTopKRouter", "Qwen3_5MoeTopKRouter",
                      "Qwen3VLMoeTextTopKRouter")
# config keys of the experts per token
MOE_CONFIG_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")


def is_moe(model) -> bool:
    """Whether `model`'s config or a sub-config sends tokens to experts (MOE_CONFIG_KEYS > 0)."""
    def routes(config: dict) -> bool:
        """Any experts-per-token key > 0 here or in a nested config."""
        here = any(isinstance(config.get(k), int) and config[k] > 0 for k in MOE_CONFIG_KEYS)
        return here or any(routes(v) for v in config.values() if isinstance(v, dict))
    return routes(model.config.to_dict())


def router_class(model) -> str:
    """The class names of `model`'s router modules (Router or Gate in the name), for an error."""
    names = {type(m).__name__ for m in model.modules()}
    return ", ".join(sorted(n for n in names if re.search("(?i)router|gate$", n))) or "none found"


def moe_routers(model) -> list[torch.nn.Module]:
    """The REPLAYABLE_ROUTERS of a transformers MoE model, in layer order ([]: dense or another).

    Qwen3-MoE's is mlp.gate (Qwen3MoeTopKRouter).
    """
    return [m for m in model.modules() if type(m).__name__ in REPLAYABLE_ROUTERS]


def decoder_routers(model) -> list[torch.nn.Module | None]:
    """The replayable router of each decoder layer, None at a dense layer: the routes' L axis.

    As vLLM's routed_experts (dense layers: mlp_only_layers, dense-first layers). [] for a model
    without one (moe_routers' order without DecoderLayers).
    """
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    per_layer = [next((r for r in layer.modules() if type(r).__name__ in REPLAYABLE_ROUTERS), None)
                 for layer in layers]
    return per_layer if any(per_layer) else moe_routers(model)


def routed_router_forward(router, hidden: torch.Tensor, forced=None, gates=None):
    """Qwen3MoeTopKRouter.forward with the expert ids forced where `forced` (N, k) has a route.

    A row with a -1 has none: the live top-k is used there. -> (router logits (N, E), routing
    weights (N, k), expert ids (N, k)). The weights are the live softmax scores gathered at the
    ids (verl: scores.gather(1, indices)), renormalised over the k when the router does: the router
    keeps its gradient. forced None: the router's own forward, bit for bit. Where the forced
    experts' probabilities all underflow (logit gap >~ 104: 0 / 0), Megatron's softmax over the
    gathered logits. gates (N, k): weights forced too where there is a route (no gradient: the
    ledger's gates part).
    """
    hidden = hidden.reshape(-1, router.hidden_dim)  # (N, H)
    logits = torch.nn.functional.linear(hidden, router.weight)  # (N, E)
    if getattr(router, "logit_jitter", 0.0):  # TIM: a sampler's fresh router noise: near-tie flips
        noise = torch.randn(logits.shape, generator=router.jitter_generator, device=logits.device)
        logits = logits + router.logit_jitter * noise.to(logits.dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    ids = torch.topk(probs, router.top_k, dim=-1).indices  # (N, k): the live routing
    if forced is None:
        has_route = torch.ones_like(ids[:, :1], dtype=torch.bool)
    else:  # no route (the last token): live
        has_route = (forced >= 0).all(-1, keepdim=True)
        ids = torch.where(has_route, forced.to(ids), ids)
    # TIM: gathered from the live probabilities, not from post-top-k zeros (no gradient there)
    weights = probs.gather(-1, ids)
    if getattr(router, "norm_topk_prob", True):  # (Qwen3.5-MoE's router always renormalises)
        total = weights.sum(dim=-1, keepdim=True)  # (N, 1)
        underflow = total < torch.finfo(total.dtype).tiny  # TIM: every forced expert underflowed
        weights = torch.where(underflow, torch.softmax(logits.float().gather(-1, ids), -1),
                              weights / torch.where(underflow, 1.0, total))
    if gates is not None:
        weights = torch.where(has_route, gates.to(weights), weights)
    return logits, weights.to(logits.dtype), ids


def _recompute_forward(router, ids: torch.Tensor, previous):
    """The router's forward after a replayed forward with gradient: it forces that forward's ids
    inside a backward (activation checkpointing's recompute, Megatron RouterReplay's backward
    list); elsewhere `previous`."""
    def forward(hidden):
        """routed_router_forward on the kept ids during a backward, else the previous forward."""
        if torch._C._current_graph_task_id() != -1:  # in a backward
            return routed_router_forward(router, hidden, ids)
        return previous(hidden) if previous is not None else type(router).forward(router, hidden)
    forward.recomputes = True
    return forward


def release_routes(model) -> None:
    """Drop the routes a replayed forward left on the routers for its backward (after the step)."""
    for router in moe_routers(model):
        if getattr(vars(router).get("forward"), "recomputes", False):
            del router.forward


@contextlib.contextmanager
def replay_routes(model, routes=None, gates=None, record: bool = True):
    """Within the block every router of `model` (decoder_routers) runs routed_router_forward.

    It is forced to `routes` (B, S, L, k) for a forward over B sequences of S positions (-1: no
    route; on any device, moved per layer), or live when None, and to the gate weights `gates`
    (B, S, L, k) when given. Yields a list per layer of (ids (B * n, k) int16, weights (B * n, k)
    fp32) of each call (record=False: none kept): stack_routes(log, B) -> (B, S, L, k).

    A forward with gradient leaves its ids on the routers for activation checkpointing's recompute
    in the backward (VeOmni: routes keyed by module), until the next replayed forward or
    release_routes (Trainer.step).
    """
    routers = decoder_routers(model)
    if routes is not None and not any(routers):  # no silent no-op
        raise ValueError(f"replay_routes: {type(model).__name__} has no router tim_rl replays "
                         f"(its router: {router_class(model)}; REPLAYABLE_ROUTERS are those whose "
                         "forward is Qwen3-MoE's)")
    log, kept = [[] for _ in routers], {}
    keep = routes is not None and torch.is_grad_enabled()  # TIM: a checkpointed layer recomputes

    def forward_of(layer: int, router):
        """The forward that replaces `router`'s within the block (layer: its decoder layer)."""

        def forward(hidden):
            """routed_router_forward on this layer's routes, logged."""
            rows = hidden.numel() // router.hidden_dim  # B * S positions
            forced = forced_gates = None
            if routes is not None:  # (B * S, k)
                forced = routes[:, :, layer].reshape(-1, routes.shape[-1]).to(hidden.device)
            if forced is not None and forced.shape[0] != rows:
                raise ValueError(f"routes has shape {tuple(routes.shape)}: it needs one route per "
                                 f"position of the forward ({rows} rows)")
            if gates is not None:
                forced_gates = gates[:, :, layer].reshape(-1, routes.shape[-1]).to(hidden.device)
            logits, weights, ids = routed_router_forward(router, hidden, forced, forced_gates)
            if record:
                log[layer].append((ids.to(torch.int16), weights.detach().float()))
            if keep:
                kept[layer] = ids
            return logits, weights, ids

        return forward

    previous = [vars(router).get("forward") if router is not None else None for router in routers]
    for layer, router in enumerate(routers):
        if router is not None:  # an instance attribute: nn.Module.__call__ (and its hooks) use it
            router.forward = forward_of(layer, router)
    try:
        yield log
    finally:
        for layer, (router, forward) in enumerate(zip(routers, previous)):
            if router is None:
                continue
            del router.forward
            forward = _recompute_forward(router, kept[layer], forward) if layer in kept else forward
            if forward is not None:
                router.forward = forward


def stack_routes(log: list[list[tuple]], batch: int, part: int = 0) -> torch.Tensor | None:
    """replay_routes' log as (B, S, L, k) on the CPU, calls concatenated along positions.

    part 0: the ids (int16, -1 at a dense layer); part 1: the gate weights (fp32, nan there).
    KV-cache decoding logs the prompt, then one position per step. None for a dense model (or
    nothing recorded).
    """
    if not any(log):
        return None
    layers = [torch.cat([c[part].reshape(batch, -1, c[part].shape[-1]) for c in calls], 1)
              if calls else None for calls in log]  # (B, S, k) each
    some = next(x for x in layers if x is not None)
    fill = torch.full_like(some, -1 if part == 0 else math.nan)
    return torch.stack([x if x is not None else fill for x in layers], 2).cpu()


# --------------------------------------------------------------------------------------------------
# ---- fast paths (chunked log-probs) ----
# What keeps token_logprobs' memory small at a real vocabulary (V = 151,936): row chunks with a
# hand-written backward, never a second (B, T, V) float32 tensor. The compiled single-read GPU
# passes live in machinery.py, imported only where they run; on a CPU these eager chunks are the
# reference.

# Row chunks of at most this many fp32 bytes (4 MiB: ~32 rows at V = 32 000, ~6 at V = 151 936).
CHUNK_BYTES = 4 << 20
# The same on a GPU without the compiled pass (64 MiB: ~110 rows at V = 151 936): fewer kernel
# launches.
GPU_CHUNK_BYTES = 64 << 20
# Rows whose largest logit m has |m| above this keep what lse = m + s lost to rounding (ulp(m) / 2).
FAR_FROM_ZERO = 1024.0


def _lse_tail(lse: torch.Tensor, m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(lse, tail), tail = s - (lse - m) where |m| > FAR_FROM_ZERO, else 0. (n, 1) each -> (n, 2).

    exp(z - lse - tail) is then exact at any row offset; ordinary rows keep their bits (x - 0 is x).
    """
    return torch.cat([lse, torch.where(m.abs() > FAR_FROM_ZERO, s - (lse - m), 0.0)], -1)


def _chunked_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk_rows: int):
    """(log softmax(logits)[ids], (lse, tail)) by row chunks. (N, V), (N, K) -> (N, K), (N, 2).

    One code path with and without a gradient, so the trainer's log-probs are bitwise the same
    either way. lse = z_m - log_softmax(z)_m at each row's largest logit m: exact to one rounding
    whatever the other logits are (-inf and finfo.min included). Rows of only -inf give nan, as
    log_softmax.
    """
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    lse = torch.empty(logits.shape[0], 2, dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        chunk = logits[rows].float()  # (n, V), a copy only when logits are not fp32
        log_probs = torch.log_softmax(chunk, dim=-1)  # (n, V) transient
        out[rows] = log_probs.gather(-1, ids[rows])
        top = chunk.argmax(-1, keepdim=True)  # (n, 1): each row's largest logit
        m, log_p_m = chunk.gather(-1, top), log_probs.gather(-1, top)
        lse[rows] = _lse_tail(m - log_p_m, m, -log_p_m)
    return out, lse


def _default_chunk_rows(V: int, device: torch.device, fused: bool = False) -> int:
    """Rows per chunk: GPU_CHUNK_BYTES of fp32 on CUDA, CHUNK_BYTES elsewhere; fused:
    FUSED_CHUNK_ELEMENTS logits (machinery.py). At least 1."""
    if fused:
        from machinery import FUSED_CHUNK_ELEMENTS

        return max(1, FUSED_CHUNK_ELEMENTS // V)
    budget = GPU_CHUNK_BYTES if torch.device(device).type == "cuda" else CHUNK_BYTES
    return max(1, budget // (4 * V))


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits)[ids] by row chunks; the backward fills the (N, V) gradient by chunks.

    d/dz_v = 1[v in ids] g - softmax(z)_v sum_k g_k. Saves (logits, ids, lse), no (N, V) tensor:
    autograd's own backward would allocate several. A -inf logit's id gets the same finite gradient
    as autograd's; a non-finite g spoils its own row only.
    """

    @staticmethod
    def forward(ctx, logits, ids, chunk_rows):  # (N, V), (N, K) -> (N, K) float32
        """The chunked log-probs; saves (logits, ids, lse) for backward."""
        out, lse = _chunked_logprobs(logits, ids, chunk_rows)
        ctx.save_for_backward(logits, ids, lse)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):  # (N, K)
        """The (N, V) logits gradient by chunks: 1[v in ids] g - softmax(z)_v sum_k g_k."""
        logits, ids, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # (N, V), the only full-size tensor
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            g = grad_out[rows].float()  # (n, K)
            fp32 = logits.dtype == torch.float32  # then work in the gradient's own rows
            probs = torch.sub(logits[rows].float(), lse[rows, :1], out=grad[rows] if fp32 else None)
            probs.sub_(lse[rows, 1:]).exp_().mul_(-g.sum(-1, keepdim=True))  # -softmax(z) sum_k g_k
            grad[rows] = probs.scatter_add_(-1, ids[rows], g)  # (n, V); fp32: onto itself, skipped
        return grad, None, None


def chunked_token_logprobs(logits, ids, chunk_rows: int | None = None, fused: bool | None = None):
    """token_logprobs on flat rows by chunks, each upcast on its own. (N, V), (N, K) -> (N, K).

    Default chunk: CHUNK_BYTES of float32 (GPU_CHUNK_BYTES on CUDA). fused (default: on CUDA where
    torch.compile works) runs each chunk as one compiled pass that reads the logits once
    (machinery.py).

    needs: _TokenLogprobs, _chunked_logprobs, _default_chunk_rows, _lse_tail, CHUNK_BYTES,
    GPU_CHUNK_BYTES, FAR_FROM_ZERO
    """
    if fused or (fused is None and logits.device.type == "cuda"):  # compiled passes (machinery.py)
        from machinery import fused_token_logprobs

        return fused_token_logprobs(logits, ids, chunk_rows, probe=fused is None)
    if chunk_rows is None:
        chunk_rows = _default_chunk_rows(logits.shape[-1], logits.device)
    return _TokenLogprobs.apply(logits, ids, chunk_rows)  # without a graph: the forward alone


def logprobs_by_blocks(logits, ids, chunk_rows: int | None = None, fused: bool | None = None):
    """chunked_token_logprobs on (..., V) logits and (..., K) ids -> (..., K), copying nothing.

    Logits with no flat (N, V) view (a strided slice such as logits[:, :-1], which a reshape would
    copy) go by the blocks of their leading index: for (B, T, V) logits each (T, V) block is a view.

    needs: chunked_token_logprobs
    """
    V, K = logits.shape[-1], ids.shape[-1]
    try:
        blocks = [(logits.view(-1, V), ids.reshape(-1, K))]  # (N, V): a view, or a RuntimeError
    except RuntimeError:  # no flat view: the leading index's blocks, (n, V) views each
        blocks = [(x.reshape(-1, V), i.reshape(-1, K)) for x, i in zip(logits, ids)]
    out = [chunked_token_logprobs(x, i, chunk_rows, fused) for x, i in blocks]
    return torch.stack(out).view(ids.shape)


# ---------------------------------------------------------------------------------------------------------------
# ---- task and reward verifier ----
# Model text is data, never code: the verifier uses regular expressions and fractions.Fraction, nothing else.

MAX_VERIFY_CHARS = 10_000  # extract_answer reads only the last 10 000 characters: final answers come last
MAX_NUMBER_CHARS = 64  # a longer digit run is not an answer here (and int() of huge strings is slow)
# ASCII digits only; no nested quantifiers, so every scan is linear time. A candidate may carry an exponent so that
# "4.7e1" is one candidate (then rejected), not the number 1.
_CANDIDATE = re.compile(r"[-+]?[0-9][0-9,]*(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?(?:/[0-9]+)?")
_NUMBER = re.compile(r"[-+]?[0-9][0-9,]*(?:\.[0-9]+)?(?:/[0-9]+)?")
_THOUSANDS = re.compile(r"[-+]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?(?:/[0-9]+)?")


SPLITS = ("pretrain", "rl", "eval")


def _split_of(a: int, b: int, op: str) -> str:
    """Each problem belongs to exactly one pool, by a hash of its text, whatever the seed: 20% eval, 20% rl.

    A cryptographic hash, not a linear one: (7919 a + 104729 b) % 5 depends on (a + b) % 5 only, which put every
    answer ending in 3 or 8 into the held-out pool (and none into training).
    """
    bucket = int.from_bytes(hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=4).digest(), "little") % 5
    return "eval" if bucket == 0 else "rl" if bucket == 1 else "pretrain"


@functools.cache
def _eval_pool_size(digits: int, ops: str) -> int:
    """How many distinct problems the eval pool holds (counted; about 1/5 of all, and plenty beyond 3 digits)."""
    if digits > 3:
        return 10**9
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    operands = range(lo, 10**digits)
    return sum(_split_of(a, b, op) == "eval" for op in set(ops) for a in operands for b in operands)


OPS = "+-*s"  # s: swap, "ab s cd=" -> "cdab": a long answer (2 x digits tokens) whose every token is a copy
MAX_DIGITS = MAX_NUMBER_CHARS // 2  # a product's or a swap's answer (2 x digits) must stay a number verify reads


def make_arithmetic_task(n: int, digits: int = 2, seed: int = 0, ops: str = "+", split: str = "pretrain"):
    """n (prompt, answer) pairs "ab+cd=" -> "e" with operands of exactly `digits` digits, from one pool of three.

    The pools pretrain | rl | eval are disjoint by construction for every seed (a hash of the operands picks the
    pool), so RL never trains on a problem the base model was pre-trained on and evaluation sees neither. eval draws
    distinct problems (at most the pool's size); pretrain and rl draw with replacement.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(digits, int) or not 1 <= digits <= MAX_DIGITS:
        raise ValueError(f"digits must be an int in [1, {MAX_DIGITS}], got {digits!r}")
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"ops must be a non-empty string over {OPS!r}, got {ops!r}")
    _check_choice("split", split, SPLITS)
    if "s" in ops and digits < 2:
        raise ValueError("ops 's' needs digits >= 2 (a 1-digit b can be 0, and verify reads '09' as 9)")
    rng = random.Random(f"{seed}-{split}-{digits}-{ops}")
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    if split == "eval" and n > _eval_pool_size(digits, ops):
        raise ValueError(f"n = {n} distinct eval problems is more than the eval pool of {digits}-digit "
                         f"{ops!r} holds ({_eval_pool_size(digits, ops)})")
    out, seen = [], set()
    while len(out) < n:
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops)
        if _split_of(a, b, op) != split or (split == "eval" and (a, b, op) in seen):
            continue
        seen.add((a, b, op))
        answer = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else f"{b}{a}"
        out.append((f"{a}{op}{b}=", str(answer)))
    return out


def mixed_arithmetic_task(n: int, digits: tuple[int, ...], seed: int = 0, ops: str = "+", split: str = "pretrain",
                          block: int = 1):
    """n problems over several operand digit counts, `block` at a time in turn (the i-th has digits[(i // block) %
    len(digits)]; block = the batch: one length per batch, padded to its own length): one base model for several
    answer lengths. Each count draws from make_arithmetic_task's own pools, so they stay disjoint."""
    if not digits or block < 1:
        raise ValueError(f"digits must name at least one digit count and block be >= 1, got {digits!r}, {block!r}")
    turn = [(i // block) % len(digits) for i in range(n)]  # which count the i-th problem has
    per = [iter(make_arithmetic_task(turn.count(k), d, seed, ops, split)) for k, d in enumerate(digits)]
    return [next(per[k]) for k in turn]


# Word problems for chat models: (text, op); {a} and {b} are drawn, a - b only with b <= a (answers >= 0).
WORD_TEMPLATES = {
    "apples+": ("Sam has {a} apples and buys {b} more. How many apples does Sam have now?", "+"),
    "apples-": ("Sam has {a} apples and gives {b} of them away. How many apples does Sam have left?", "-"),
    "distance+": (("A cyclist rides {a} km in the morning and {b} km in the afternoon. How many km does she "
                  "ride?"), "+"),
    "distance-": ("A trail is {a} km long and Mia has walked {b} km of it. How many km are left?", "-"),
    "money+": ("Leo has {a} dollars and earns {b} dollars more. How many dollars does Leo have now?", "+"),
    "money-": ("Leo has {a} dollars and spends {b} dollars. How many dollars does Leo have left?", "-"),
    "books+": (("A shelf holds {a} books and {b} more books are put on it. How many books are on the "
               "shelf?"), "+"),
    "birds-": (("{a} birds sit on a wire and {b} of them fly away. How many birds are still on the "
               "wire?"), "-"),
}
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."
TASKS = ("arithmetic", "words")


def make_word_problems(n: int, seed: int = 0, split: str = "rl",
                       max_operand: int = 20) -> list[tuple[str, str]]:
    """n (question, answer) word problems a + b or a - b, 0 <= a, b <= max_operand, answer >= 0 (WORD_TEMPLATES).

    Two pools, rl | eval, disjoint by construction for every seed: _split_of's hash of the arithmetic (op, a, b)
    picks the pool, whatever the wording (its eval bucket is eval, the rest rl; a chat model comes pre-trained), so
    no eval sum is an RL sum under another template. eval draws distinct problems.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(max_operand, int) or max_operand < 1:
        raise ValueError(f"max_operand must be an int >= 1, got {max_operand!r}")
    _check_choice("split", split, ("rl", "eval"))
    pool = [(name, a, b) for name, (_, op) in WORD_TEMPLATES.items() for a in range(max_operand + 1)
            for b in range(max_operand + 1 if op == "+" else a + 1)
            if (_split_of(a, b, op) == "eval") == (split == "eval")]
    rng = random.Random(f"{seed}-{split}-words-{max_operand}")
    if split == "eval" and n > len(pool):
        raise ValueError(f"n = {n} distinct eval word problems is more than the pool holds ({len(pool)})")
    picks = rng.sample(pool, n) if split == "eval" else [rng.choice(pool) for _ in range(n)]
    return [(WORD_TEMPLATES[name][0].format(a=a, b=b), str(a + b if name.endswith("+") else a - b))
            for name, a, b in picks]


def chat_prompt(tokenizer, question: str) -> str:
    """The question plus BOXED_INSTRUCTION as one user turn of the tokenizer's chat template, up to the answer."""
    tok = getattr(tokenizer, "tok", tokenizer)  # HFTokenizer wraps the transformers tokenizer
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer: {type(tok).__name__} has no chat template (task words needs a chat model)")
    return tok.apply_chat_template([{"role": "user", "content": f"{question} {BOXED_INSTRUCTION}"}],
                                   add_generation_prompt=True, tokenize=False)


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} with balanced braces, or None (linear: one scan from the last opener)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: fall back to the other rules


def extract_answer(text: str) -> str | None:
    """The final answer: last \\boxed{...} (balanced), else the number after the last ####, else the last number.

    Only the last MAX_VERIFY_CHARS characters are read (longer text is truncated, not rejected). Linear time. A
    "number" here is a candidate of _CANDIDATE (ASCII digits, sign, commas, decimals, a/b, an exponent); whether it
    is an acceptable answer is _parse_number's decision.
    """
    if not isinstance(text, str):
        return None
    text = text[-MAX_VERIFY_CHARS:]
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = text.rfind("####")
    if hashes >= 0:
        match = _CANDIDATE.search(text, hashes + 4)
        return match.group(0) if match else None
    numbers = _CANDIDATE.findall(text)  # every match is a whole candidate: the pattern has no capturing group
    return numbers[-1] if numbers else None


def _parse_number(s: str) -> Fraction | None:
    """'1,234' '-47' '+3' '2.50' '3/4' -> Fraction; anything else -> None. Never evaluates code."""
    s = s.strip().rstrip(".")
    if len(s) > MAX_NUMBER_CHARS or not _NUMBER.fullmatch(s) or ("," in s and not _THOUSANDS.fullmatch(s)):
        return None  # commas only as thousands separators
    try:
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def verify(text: str, answer: str) -> float:
    """1.0 iff extract_answer(text) equals `answer` as a number, else 0.0. Never raises for a str; never runs code.

    Where the answer is read: the last \\boxed{...} with balanced braces, else the first number after the last
    "####", else the last number in the text (of its last MAX_VERIFY_CHARS characters).
    Accepted number forms: integers, a leading + or -, decimals (47.0 == 47), thousands separators in groups of
    three (1,234), simple fractions a/b compared as values (6/8 == 0.75), leading zeros (047 == 47).
    Text around the number is ignored: "47.", "47%", "47 apples", "$47" all read 47.
    Rejected (reward 0): scientific notation (4.7e1), misplaced commas (12,34), unicode digits (٤٧, full-width),
    numbers longer than MAX_NUMBER_CHARS, a/0, and a non-str text or answer. "4 7" reads as its last number, 7.
    """
    extracted = extract_answer(text)  # None for a non-str text
    if extracted is None or not isinstance(answer, str):
        return 0.0
    want = _parse_number(answer)
    return float(want is not None and _parse_number(extracted) == want)


# ---------------------------------------------------------------------------------------------------------------
# ---- model and tokenizer ----
# transformers is imported inside these functions: the math above must import with torch alone.

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


class CharTokenizer:
    """One id per printable ASCII character, plus <pad> <bos> <eos> <unk>; vocab padded to `vocab_size`."""

    def __init__(self, vocab_size: int = 128):
        self.tokens = [*SPECIAL_TOKENS, *(chr(c) for c in range(32, 127))]
        self.tokens += [f"<unused{i}>" for i in range(vocab_size - len(self.tokens))]
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.vocab_size, self.eos_id, self.pad_id, self.bos_id = len(self.tokens), EOS_ID, PAD_ID, BOS_ID

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of `text`, <bos> first."""
        return ([BOS_ID] if bos else []) + [self.index.get(c, UNK_ID) for c in text]

    def decode(self, ids) -> str:
        """Text up to the first <eos>; special tokens dropped."""
        ids = [int(i) for i in ids]
        ids = ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
        return "".join(self.tokens[i] if 0 <= i < len(self.tokens) and len(self.tokens[i]) == 1 else "" for i in ids)

    def save(self, directory: str | Path) -> None:
        """Write an HF fast tokenizer equivalent to this one, so transformers and vLLM load the directory offline."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(vocab=self.index, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
        tok.decoder = decoders.Fuse()
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS_ID)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                       pad_token="<pad>", unk_token="<unk>")
        fast.save_pretrained(str(directory))


def build_tiny_model(vocab_size: int = 128, hidden: int = 128, layers: int = 4, heads: int = 4,
                     intermediate: int = 384, max_positions: int = 64, seed: int = 0):
    """An untied Llama, head size 32 (vLLM CPU attention needs 32/64/...), ~0.9 M parameters at the defaults.

    Untied embeddings because vLLM's CPU build keeps a pre-packed copy of a tied output head across in-place weight
    syncs: after a sync the head would still compute with the old weights.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=hidden // heads, max_position_embeddings=max_positions, tie_word_embeddings=False,
                         rms_norm_eps=1e-5, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                         torch_dtype="float32")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


MOE_BASE = "runs/base-moe"  # where `pretrain --moe` and the moe preset keep the tiny MoE model
MOE_AUX_LOSS = 0.01  # pre-training's load-balancing loss coefficient (router_aux_loss_coef): every expert is used


def build_tiny_moe_model(vocab_size: int = 128, hidden: int = 128, layers: int = 4, heads: int = 4,
                         experts: int = 8, top_k: int = 2, expert_intermediate: int = 96, max_positions: int = 64,
                         seed: int = 0):
    """A Qwen3-MoE (transformers Qwen3MoeForCausalLM, the family of Qwen3-30B-A3B): every layer's MLP is `experts`
    experts of which its router (mlp.gate) picks top_k per token, weights renormalised over them; ~1.5 M parameters.

    Untied embeddings for the reason build_tiny_model gives; the load-balancing loss is on in pre-training only.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=expert_intermediate,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                            head_dim=hidden // heads, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
                            num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_intermediate,
                            norm_topk_prob=True, decoder_sparse_step=1, router_aux_loss_coef=MOE_AUX_LOSS,
                            tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                            pad_token_id=PAD_ID)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).float()


def load_model(path: str | Path, trust_remote_code: bool = False):
    """Load an HF causal LM from a local directory in fp32 (safetensors; no remote code unless asked)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, use_safetensors=True,
                                                trust_remote_code=trust_remote_code, local_files_only=True)


def encode_problems(tokenizer: CharTokenizer, problems):
    """Prompts as token-id lists (with <bos>) and answers as strings."""
    return [tokenizer.encode(p) for p, _ in problems], [a for _, a in problems]


def pretrain(cfg: PretrainConfig) -> dict:
    """Supervised training of the tiny model on "prompt answer<eos>" (loss on the answer), saved to cfg.out."""
    from tqdm.auto import tqdm

    tokenizer = CharTokenizer()
    model = (build_tiny_moe_model if cfg.moe else build_tiny_model)(vocab_size=tokenizer.vocab_size, seed=cfg.seed,
                                                                   max_positions=cfg.max_positions)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / cfg.steps))))
    mixed = tuple(int(d) for d in cfg.mixed_digits.split(",") if d)  # several answer lengths in one model
    # mixed batches: one length per batch (block = batch) pre-trained 2-digit swap only (800 steps; measured)
    problems = mixed_arithmetic_task(cfg.steps * cfg.batch, mixed or (cfg.digits,), cfg.seed, cfg.ops, "pretrain")
    t0 = time.time()
    for step in tqdm(range(cfg.steps), desc="pretrain", mininterval=2):
        batch = problems[step * cfg.batch : (step + 1) * cfg.batch]
        seqs = [(tokenizer.encode(p), tokenizer.encode(a, bos=False) + [EOS_ID]) for p, a in batch]
        L = max(len(p) + len(a) for p, a in seqs)
        ids = torch.tensor([p + a + [PAD_ID] * (L - len(p) - len(a)) for p, a in seqs])  # (B, L) right-padded
        # the answer only
        labels = torch.tensor([[-100] * len(p) + a + [-100] * (L - len(p) - len(a)) for p, a in seqs])
        # an MoE model adds router_aux_loss_coef x its load-balancing loss
        loss = model(input_ids=ids, labels=labels, **({"output_router_logits": True} if cfg.moe else {})).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    acc = greedy_accuracy(model, tokenizer, make_arithmetic_task(512, cfg.digits, 0, cfg.ops, split="eval"),
                          max(6, 2 * cfg.digits + 1))  # the longest answer (a product, a swap) and <eos>
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save(out)
    info = {"greedy_accuracy_eval": acc, "seconds": time.time() - t0, "steps": cfg.steps, "digits": cfg.digits,
            "ops": cfg.ops, "params": sum(p.numel() for p in model.parameters())}
    if mixed:  # held-out greedy exact match of each length (256 problems each)
        info["mixed_digits"] = {d: greedy_accuracy(model, tokenizer, make_arithmetic_task(256, d, 0, cfg.ops,
                                                                                          split="eval"), 2 * d + 1)
                                for d in mixed}
    if cfg.moe:
        info["expert_usage"] = expert_usage(model, tokenizer, make_arithmetic_task(256, cfg.digits, 0, cfg.ops,
                                                                                     split="eval"))
    (out / "pretrain.json").write_text(json.dumps(info, indent=1))
    return info


@torch.no_grad()
def expert_usage(model, tokenizer, problems) -> list[list[float]]:
    """Share of the routed (token, slot) pairs each expert gets, per MoE layer, over the problems' prompt + answer
    tokens (a balanced router: 1 / experts each). -> [layers][experts]."""
    seqs = [tokenizer.encode(p + a) for p, a in problems]
    ids, mask = left_pad(seqs, tokenizer.pad_id, next(model.parameters()).device)
    with replay_routes(model) as log:
        model(input_ids=ids, attention_mask=mask.long(), position_ids=_positions(mask))
    routes = stack_routes(log, ids.shape[0])[mask.cpu()].long()  # (N, L, k) real tokens only
    counts = [torch.bincount(routes[:, layer].flatten(), minlength=moe_routers(model)[0].num_experts)
              for layer in range(routes.shape[1]) if routes[0, layer, 0] >= 0]  # MoE layers only
    return [[round(float(c / row.sum()), 4) for c in row] for row in counts]


def ensure_base_model(path: str | Path = "runs/base", **change) -> Path:
    """Pre-train the embedded tiny model (PretrainConfig with `change`) into `path` unless a model is there."""
    path = Path(path)
    if not (path / "config.json").exists():
        print(f"[tim_rl] no model at {path}: pre-training the embedded tiny model (~20 s)", file=sys.stderr)
        pretrain(PretrainConfig(out=str(path), **change))
    return path


def resolve_model_dir(model: str) -> Path:
    """The model directory a run or preset uses: runs/base (and runs/base-moe) are pre-trained when missing; others
    must exist."""
    if model in ("runs/base", MOE_BASE):
        return ensure_base_model(model, moe=model == MOE_BASE)
    return Path(model)


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every dropout at 0 in training mode too: nn.Dropout's p and every float attribute named
    *dropout* or *jitter* of its modules and config (transformers copies attention_dropout into each layer).

    Train mode then computes what eval mode does, bitwise, and transformers' gradient checkpointing stays on.
    """
    for part in [getattr(model, "config", None), *model.modules()]:
        for name, value in list(vars(part).items()) if part is not None else ():
            named = "dropout" in name or "jitter" in name or isinstance(part, torch.nn.Dropout)  # nn.Dropout: p
            if isinstance(value, float) and named:
                setattr(part, name, 0.0)
    return model


# ---------------------------------------------------------------------------------------------------------------
# ---- samplers (torch, vLLM) ----


@dataclass
class Rollout:
    """One batch of sampled responses. Prompts are left-padded to P; responses right-padded to T."""

    prompt_ids: torch.Tensor  # (B, P) long, left-padded with PAD_ID
    prompt_mask: torch.Tensor  # (B, P) bool, True on real prompt tokens
    response_ids: torch.Tensor  # (B, T) long, PAD_ID after <eos>
    mask: torch.Tensor  # (B, T) bool, True on generated tokens (<eos> included)
    logp_infer: torch.Tensor  # (B, T) float32, the sampler's log-prob of each sampled token
    topk_ids: torch.Tensor  # (B, T, K) long, the sampler's top-K ids at each position
    logp_topk_infer: torch.Tensor  # (B, T, K) float32, the sampler's log-probs of those ids
    texts: list[str]  # decoded responses
    kept_ids: torch.Tensor | None = None  # (B, T, S) long, -1 padded: the sampler's kept support (None: untruncated,
    # or the engine cannot return it: the loop then rebuilds it from the trainer's logits, kept_support_from_logits;
    # an empty row at a generated token: unknown there, a bounded vLLM request's K all finite, rebuilt: merge_support)
    entropy: torch.Tensor | None = None  # (B, T) float32, entropy of the sampled distribution (None: not recorded)
    routed_experts: torch.Tensor | None = None  # (B, P + T, L, k) int16: the experts each MoE layer's router chose at
    # each position of prompt + response, -1 where none (the last sampled token is never fed); None: dense or unknown
    routed_weights: torch.Tensor | None = None  # (B, P + T, L, k) float32: their gate weights (nan: none; torch only)

    def to(self, device) -> Rollout:
        """The same rollout with every tensor on `device` (vLLM returns CPU tensors; the trainer may be on a GPU), the
        routes kept on the CPU (each replayed forward moves its layer's)."""
        return Rollout(**{k: v.to(device) if isinstance(v, torch.Tensor) and not k.startswith("routed_") else v
                          for k, v in vars(self).items()})


def _entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """-sum_v p_v log p_v over the last axis, 0 * -inf read as 0 (truncated tokens). (..., V) -> (...)."""
    return -(logprobs.exp() * logprobs.nan_to_num(neginf=0.0)).sum(-1)


def left_pad(prompts: list[list[int]], pad_id: int = PAD_ID, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, P) left-padded with pad_id, mask (B, P) True on real tokens) of token-id lists."""
    P = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts], device=device)  # (B, P)
    return ids, ids.new_tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts]).bool()


def _positions(attention: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: 0 at each row's first real token (pads get 0). (B, L) -> (B, L)."""
    return (attention.long().cumsum(1) - 1).clamp(min=0)


def draw_seed(generator: torch.Generator | None) -> int:
    """One draw in [0, 2^31 - 1) from `generator` (None: torch's default CPU generator), e.g. to seed a GPU one."""
    return int(torch.randint(0, 2**31 - 1, (), generator=generator, device=generator.device if generator else "cpu"))


@torch.no_grad()
def decode(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, topk: int | None = 0,
           generator: torch.Generator | None = None, decode_text=None, eos_id: int | None = None,
           pad_id: int | None = None, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Rollout:
    """KV-cache sampling from softmax(logits / temperature) truncated by min_p, top_k, top_p (greedy at 0).

    The recorded log-probs are those of the distribution actually sampled from (temperature applied, renormalised
    over the kept tokens, -inf elsewhere), computed in float32 from the engine's logits, as vLLM's processed
    log-probs are; with truncation the kept support is recorded too (Rollout.kept_ids), and the entropy of every
    sampled distribution. topk: the K most probable ids recorded per token (0 = all V; None = none, K = 0).
    A sequence stops at eos_id (default: the model config's; the mask includes it); pad_id fills prompts and ends.
    One host sync per token: the stop test (and, with truncation, the kept count) in one transfer.
    """
    from transformers import DynamicCache

    eos_id = model.config.eos_token_id if eos_id is None else eos_id
    eos_id = eos_id[0] if isinstance(eos_id, (list, tuple)) else eos_id
    if pad_id is None:
        pad_id = eos_id if model.config.pad_token_id is None else model.config.pad_token_id
    device = next(model.parameters()).device
    # TIM: on a GPU the sampling noise differs from the CPU's: a generator on `device`, seeded by one host draw per
    # call (not a host copy per token), keeps sampling reproducible for a seed
    if generator is not None and generator.device.type != device.type:
        generator = torch.Generator(device).manual_seed(draw_seed(generator))
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, device)
    inputs, attention, cache = prompt_ids, prompt_mask.long(), DynamicCache()  # the prompt, then one token at a time
    finished = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=device)  # (B,)
    truncate = temperature > 0 and (top_p < 1 or top_k > 0 or min_p > 0)
    ids, masks, logps, entropies, tops, kept = [], [], [], [], [], []
    training = model.training  # a checkpointed model in training mode drops its KV cache (transformers): eval here
    with replay_routes(model.eval()) as route_log:  # an MoE model's routers record their experts (R3)
        for _ in range(max_new_tokens):
            positions = _positions(attention)[:, -inputs.shape[1] :]
            out = model(input_ids=inputs, past_key_values=cache, use_cache=True, attention_mask=attention,
                        position_ids=positions, logits_to_keep=1)  # the head on the last position only
            cache, logits = out.past_key_values, out.logits[:, -1]  # (B, V)
            scaled = logits.float() / (temperature if temperature > 0 else 1.0)  # (B, V)
            if truncate:  # TIM: the sampled distribution is renormalised over the kept tokens
                keep = truncation_mask(scaled, top_p, top_k, min_p)  # (B, V)
                scaled = scaled.masked_fill(~keep, -math.inf)
            logprobs = torch.log_softmax(scaled, -1)  # (B, V)
            token = (torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1) if temperature > 0
                     else logprobs.argmax(-1))  # (B,), on the logits' device: no host copy per token
            token = torch.where(finished, torch.full_like(token, pad_id), token)
            masks.append(~finished)
            ids.append(token)
            logps.append(logprobs.gather(-1, token[:, None]).squeeze(1))
            entropies.append(_entropy(logprobs))  # (B,): the sampler has the whole distribution now, nobody stores it
            if topk is not None:
                tops.append(logprobs.topk(min(topk, logits.shape[-1]) if topk > 0 else logits.shape[-1], dim=-1))
            finished = finished | (token == eos_id)
            # the token's one host sync: stop when every row finished; the kept count S sizes this token's support
            counts = [finished.all().long()] + ([keep.sum(-1).max()] if truncate else [])
            done, *kept_count = torch.stack(counts).tolist()
            if truncate:
                kept.append(support_ids(keep, size=max(kept_count[0], 1)))  # (B, S_t)
            if done:
                break
            inputs, attention = token[:, None], torch.cat([attention, attention.new_ones(attention.shape[0], 1)], 1)
    model.train(training)
    response_ids = torch.stack(ids, 1)  # (B, T)
    B, T = response_ids.shape
    routes, gates = stack_routes(route_log, B), stack_routes(route_log, B, 1)  # (B, P + T - 1, L, k): all but the last
    if routes is not None:
        routes = torch.nn.functional.pad(routes, (0, 0, 0, 0, 0, 1), value=-1)  # (B, P + T, L, k)
        gates = torch.nn.functional.pad(gates, (0, 0, 0, 0, 0, 1), value=math.nan)
    kept_ids = torch.stack(_pad_last(kept, -1), 1) if kept else None  # (B, T, S), -1 pads
    decode_text = decode_text or (lambda row: " ".join(map(str, row)))
    no_topk = torch.zeros(B, T, 0, device=device)
    return Rollout(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, mask=torch.stack(masks, 1),
        logp_infer=torch.stack(logps, 1),
        topk_ids=torch.stack([t.indices for t in tops], 1) if tops else no_topk.long(),  # (B, T, K)
        logp_topk_infer=torch.stack([t.values for t in tops], 1) if tops else no_topk,
        kept_ids=kept_ids, entropy=torch.stack(entropies, 1), routed_experts=routes, routed_weights=gates,
        texts=[decode_text(row) for row in response_ids.tolist()])


def sequence_logprobs(model, rollout: Rollout, temperature: float = 1.0, topk_ids: torch.Tensor | None = None,
                      params: dict | None = None, routes: torch.Tensor | None = None):
    """Trainer-engine log-probs of the rollout's tokens (and of its top-K ids) over the whole vocabulary: one full
    forward, no KV cache (support_logprobs without a kept support).

    Returns (logp (B, T), logp_topk (B, T, K) or None, last hidden state at the response positions (B, T, H)).
    `params` (name -> tensor) runs the same model with other weights (torch.func.functional_call); `routes`
    (B, P + T, L, k) replays an MoE model's experts (replay_routes).
    """
    untruncated = dataclasses.replace(rollout, kept_ids=None)
    return support_logprobs(model, untruncated, temperature, topk_ids, params, routes)[:3]  # (logp, topk, hidden)


class Forward(NamedTuple):
    """response_forward's result: logits / temperature (B, T, V) and last hidden state (B, T, H) at the response
    positions, and the experts each MoE layer used at every position (B, P + T, L, k) (None: a dense model)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    routes: torch.Tensor | None


def response_forward(model, rollout: Rollout, temperature: float = 1.0, params: dict | None = None,
                      routes: torch.Tensor | None = None, gates: torch.Tensor | None = None,
                      record: bool = True) -> Forward:
    """One full forward over prompt + response, an MoE model's routers forced to `routes` (None: live) and to the
    gate weights `gates`; the experts used are returned when `record` (else routes None: no copy).

    The head runs on the T response positions only (logits_to_keep): no (B, P + T, V) logits for the prompt.
    """
    input_ids = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)  # (B, P + T)
    attention = torch.cat([rollout.prompt_mask, torch.ones_like(rollout.mask)], 1).long()
    P, T = rollout.prompt_ids.shape[1], rollout.response_ids.shape[1]
    keep = torch.arange(P - 1, P + T - 1, device=input_ids.device)  # position t predicts response token t
    kwargs = {"input_ids": input_ids, "attention_mask": attention, "position_ids": _positions(attention),
                  "output_hidden_states": True, "logits_to_keep": keep, "use_cache": False}  # no KV cache to keep
    with replay_routes(model, routes, gates, record) as route_log:
        out = model(**kwargs) if params is None else torch.func.functional_call(model, params, args=(), kwargs=kwargs)
    logits = out.logits  # (B, T, V)
    if temperature > 0 and temperature != 1.0:  # in place: the head's output is not saved for backward (no copy)
        logits = logits.div_(temperature)
    hidden = out.hidden_states[-1][:, P - 1 : P + T - 1]
    return Forward(logits, hidden, stack_routes(route_log, input_ids.shape[0]) if record else None)


def logprobs_on_support(logits: torch.Tensor, rollout: Rollout, topk_ids: torch.Tensor | None = None):
    """(log p~ (B, T), log p~ of the top-K ids (B, T, K) or None, log S (B, T) or None) from response logits
    (B, T, V), renormalised on rollout.kept_ids (renormalize_on_support); without a kept support, plain log-probs.

    Top-K ids off the support (-inf in the sampler's processed logp_topk_infer) get -inf: the truncated policy puts
    no mass there. One token_logprobs pass serves the sampled token, the K ids and the S kept ids.
    """
    kept = rollout.kept_ids  # (B, T, S), -1 pads
    K = 0 if topk_ids is None else topk_ids.shape[-1]
    ids = [rollout.response_ids[..., None]] + ([] if topk_ids is None else [topk_ids])
    ids += [] if kept is None else [kept.clamp(min=0)]
    both = token_logprobs(logits, torch.cat(ids, -1))  # (B, T, 1 + K + S)
    logp, logp_topk = both[..., 0], (None if topk_ids is None else both[..., 1 : 1 + K])
    if kept is None:
        return logp, logp_topk, None
    logp, log_s = renormalize_on_support(logp, both[..., 1 + K :].masked_fill(kept < 0, -math.inf))
    if topk_ids is None:
        return logp, None, log_s
    on_support = torch.isfinite(rollout.logp_topk_infer)
    return logp, torch.where(on_support, logp_topk - log_s[..., None], -math.inf), log_s


def support_logprobs(model, rollout: Rollout, temperature: float = 1.0, topk_ids: torch.Tensor | None = None,
                     params: dict | None = None, routes: torch.Tensor | None = None):
    """sequence_logprobs renormalised on the sampler's kept support rollout.kept_ids (logprobs_on_support).

    Returns (log p~ (B, T), log p~ of the top-K ids (B, T, K) or None, hidden, log S (B, T) or None). Without a
    kept support (kept_ids None: the sampler kept every token) it is sequence_logprobs, log S None.
    """
    logits, hidden, _ = response_forward(model, rollout, temperature, params, routes, record=False)  # (B, T, V)
    logp, logp_topk, log_s = logprobs_on_support(logits, rollout, topk_ids)
    return logp, logp_topk, hidden, log_s


@torch.no_grad()
def kept_support_from_logits(logits: torch.Tensor, response_ids: torch.Tensor, top_p: float, top_k: int,
                             min_p: float) -> torch.Tensor:
    """The kept support of (B, T, V) logits by the sampler's rule, plus the sampled token: (B, T, S) ids, -1 pads.

    By row chunks of token_logprobs' size (CHUNK_BYTES; GPU_CHUNK_BYTES on CUDA): truncation_mask's sort transients
    are a few chunks, never (B, T, V) masks. One host sync per chunk (its kept count), none per row.
    """
    B, T, V = logits.shape
    flat, ids = logits.reshape(-1, V), response_ids.reshape(-1, 1)  # (N, V), (N, 1)
    rows = _default_chunk_rows(V, logits.device, fused=False)
    parts = []
    for start in range(0, flat.shape[0], rows):
        keep = truncation_mask(flat[start : start + rows].float(), top_p, top_k, min_p)  # (n, V) bool
        keep.scatter_(-1, ids[start : start + rows], True)  # TIM: the token was sampled, so it was kept
        parts.append(support_ids(keep))  # (n, S_chunk)
    return torch.cat(_pad_last(parts, -1)).reshape(B, T, -1)


def greedy_accuracy(model, tokenizer: CharTokenizer, problems, max_new_tokens: int = 6, batch: int = 256) -> float:
    """Held-out exact-match accuracy of greedy decoding with `model` (any engine's copy)."""
    prompts, answers = encode_problems(tokenizer, problems)
    texts = []
    for i in range(0, len(prompts), batch):
        texts += decode(model, prompts[i : i + batch], max_new_tokens, temperature=0.0, topk=1,
                        decode_text=tokenizer.decode, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id).texts
    return sum(map(verify, texts, answers)) / max(len(prompts), 1)


@torch.no_grad()
def answer_logprobs(model, tokenizer, problems, batch: int = 256, truncation: tuple | None = None,
                    temperature: float = 1.0) -> torch.Tensor:
    """log P(answer + <eos> | prompt) under `model`, teacher-forced (one full forward per batch). -> (N,) float32.

    exp() of it is `pc`, the probability of the exact correct answer: a far less noisy accuracy than greedy match.
    truncation = (top_p, top_k, min_p): the probability under the policy such a sampler draws from at `temperature`
    (renormalised over the kept tokens at each position; 0 when an answer token is not kept).
    """
    device, out = next(model.parameters()).device, []
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        prompt_ids, prompt_mask = left_pad([tokenizer.encode(p) for p, _ in chunk], tokenizer.pad_id, device)
        answers = [tokenizer.encode(a, bos=False) + [tokenizer.eos_id] for _, a in chunk]
        T = max(map(len, answers))
        response_ids = torch.tensor([a + [tokenizer.pad_id] * (T - len(a)) for a in answers], device=device)  # (B, T)
        mask = torch.tensor([[1] * len(a) + [0] * (T - len(a)) for a in answers], device=device).bool()
        unused = torch.zeros(0, device=device)  # the sampler's fields: no sampler here
        ro = Rollout(prompt_ids, prompt_mask, response_ids, mask, unused, unused, unused, [])
        logits = response_forward(model, ro, 1.0 if truncation is None else temperature)[0]  # (B, T, V)
        logp = truncated_logprobs(logits, response_ids, truncation)  # (B, T), -inf where an answer token is dropped
        del logits  # before the next batch's forward
        out.append(torch.where(mask, logp, torch.zeros_like(logp)).sum(1).cpu())
    return torch.cat(out)


def truncated_logprobs(logits: torch.Tensor, ids: torch.Tensor, truncation: tuple | None = None) -> torch.Tensor:
    """token_logprobs of the logits masked to -inf off truncation_mask(*truncation) (None: untruncated), by row chunks
    of token_logprobs' size: a few chunks of transients, never (B, T, V) masks or a masked copy. (B, T, V) -> (B, T)."""
    if truncation is None:
        return token_logprobs(logits, ids)
    flat, flat_ids = logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)  # (N, V), (N,)
    rows = _default_chunk_rows(logits.shape[-1], logits.device, fused=False)
    parts = [token_logprobs(chunk.masked_fill(~truncation_mask(chunk, *truncation), -math.inf), i)  # TIM: p~
             for chunk, i in zip(flat.split(rows), flat_ids.split(rows))]
    return torch.cat(parts).view(ids.shape)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
INT8_MAX = 127.0


def fake_quantize(w: torch.Tensor, quant: str) -> torch.Tensor:
    """Weight fake-quantisation in fp32: int8 per output channel (symmetric) or fp8-e4m3 per matrix. (..., O, I)
    (a leading experts dim: each expert its own scales)."""
    if quant == "int8":
        scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / INT8_MAX  # (..., O, 1)
        return (w / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale
    if quant == "fp8":
        scale = w.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=1e-12) / FP8_E4M3_MAX  # (..., 1, 1)
        return (w / scale).to(torch.float8_e4m3fn).float() * scale
    raise ValueError(f"quant must be 'int8' or 'fp8', got {quant!r}")


class TorchSampler:
    """A sampler engine in plain torch: its own copy of the weights in the engine's numerics, KV-cache decoding."""

    def __init__(self, model_dir_or_model, engine: EngineSpec | None = None, tokenizer: CharTokenizer | None = None):
        self.engine = engine or EngineSpec()
        _check_engine(self.engine)
        source = load_model(model_dir_or_model) if isinstance(model_dir_or_model, (str, Path)) else model_dir_or_model
        self.model = copy.deepcopy(source).eval().to(_DTYPES[self.engine.dtype])  # in the engine dtype from the start
        kept_fp32 = moe_routers(self.model) if self.engine.router_fp32 else []
        head = self.model.get_output_embeddings()
        if self.engine.head_fp32 and head.weight is self.model.get_input_embeddings().weight:
            raise ValueError("engine.head_fp32 needs an untied output head (this model ties it to the embeddings)")
        kept_fp32 += [head] if self.engine.head_fp32 else []
        for module in kept_fp32:  # TIM: fp32 weights, and fp32 inputs (a pre-hook), inside a bf16 / fp16 engine
            module.float().register_forward_pre_hook(lambda _, inputs: tuple(x.float() for x in inputs))
        jitter = torch.Generator(head.weight.device).manual_seed(self.engine.noise_seed)  # the jitter's own stream
        for router in moe_routers(self.model):  # read by routed_router_forward: this copy's routers only
            router.logit_jitter, router.jitter_generator = self.engine.router_jitter, jitter
        self.tokenizer = tokenizer or CharTokenizer(self.model.config.vocab_size)
        self.load_weights({k: v.detach() for k, v in source.state_dict().items()})

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy exported weights in, applying the engine's numerics to each tensor in fp32 and rounding it once to the
        engine dtype: quantisation, then noise (the same draw every load). Loading one master twice gives one engine.

        Which weights: every nn.Linear weight but the lm_head (attention and MLP projections) and, in an MoE model,
        the routers' weights (Qwen3-MoE: mlp.gate.weight) and the experts' 3-D weights (mlp.experts.gate_up_proj,
        mlp.experts.down_proj; int8 scales per expert and output row, fp8 per expert).
        """
        # TIM: everything below is where this engine's numbers start to differ from the trainer's
        noise_gen = torch.Generator().manual_seed(self.engine.noise_seed)
        perturbed = {f"{n}.weight" for n, m in self.model.named_modules()
                     if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
        routers = moe_routers(self.model)
        router_weights = {f"{n}.weight" for n, m in self.model.named_modules() if any(m is r for r in routers)}
        perturbed |= router_weights | {f"{n}.{p}" for n, m in self.model.named_modules()
                                       if type(m).__name__.endswith("Experts") for p, _ in m.named_parameters()}
        # every name, a tied head's included, so a model's own state_dict loads (tied weights: one tensor, 2 names)
        params = dict(self.model.named_parameters(remove_duplicate=False)) | dict(self.model.named_buffers())
        required = {n for n, _ in self.model.named_parameters()}  # each tensor under one name suffices
        missing = sorted(required - set(state_dict))
        if missing or set(state_dict) - set(params):
            raise ValueError(f"state_dict: missing {missing}, unexpected {sorted(set(state_dict) - set(params))}")
        for name, target in params.items():  # named_modules order: the noise draws come in one fixed order
            if name not in state_dict:
                continue
            w = state_dict[name].detach().to(device=target.device, dtype=torch.float32)  # (a copy: never the master)
            if name in perturbed and self.engine.quant != "none":
                w = fake_quantize(w, self.engine.quant)
            scale = (self.engine.noise if name in perturbed else 0.0) + (
                self.engine.router_noise if name in router_weights else 0.0)
            if scale:
                # the same noise on every device: drawn on the CPU once per load (not per step or token)
                noise = torch.randn(w.shape, generator=noise_gen, device="cpu").to(w.device)
                w = w + scale * noise * w
            target.copy_(w)  # TIM: the one rounding to the engine dtype (fp32 -> bf16 / fp16, round to nearest)

    def sample(self, prompts: list[list[int]], n: int = 1, max_new_tokens: int = 5, temperature: float = 1.0,
               topk: int = 0, generator: torch.Generator | None = None, top_p: float = 1.0, top_k: int = 0,
               min_p: float = 0.0) -> Rollout:
        """n samples per prompt (consecutive rows), log-probs, top-K and kept support recorded at sampling time."""
        expanded = [p for p in prompts for _ in range(n)]
        rollout = decode(self.model, expanded, max_new_tokens, temperature, topk, generator, self.tokenizer.decode,
                         self.tokenizer.eos_id, self.tokenizer.pad_id, top_p, top_k, min_p)
        if self.engine.exact:
            # TIM: zero-mismatch limit: score the sampled tokens with the trainer's own fp32 forward (same kernels,
            # shapes and weights as Trainer.logprobs), so logp_infer == logp_old bitwise.
            # An MoE model's scoring pass replays the experts the tokens were sampled with (what R3 replays).
            with torch.no_grad():
                logp, rollout.logp_topk_infer = support_logprobs(self.model, rollout, temperature, rollout.topk_ids,
                                                                 routes=rollout.routed_experts)[:2]
            rollout.logp_infer = torch.where(rollout.mask, logp, torch.zeros_like(logp))
        return rollout

    def greedy_accuracy(self, problems, max_new_tokens: int = 6) -> float:
        """Held-out greedy exact match of this engine's copy of the weights."""
        return greedy_accuracy(self.model, self.tokenizer, problems, max_new_tokens)

    def answer_logprobs(self, problems) -> torch.Tensor:
        """log P(answer + <eos> | prompt) under this engine's copy of the weights. (N,)."""
        return answer_logprobs(self.model, self.tokenizer, problems)


_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# vLLM 0.32 raises a temperature in (0, 0.01) to 0.01 (SamplingParams, _MAX_TEMP) and treats < 1e-5 as greedy.
VLLM_MIN_TEMPERATURE = 0.01
# the sync canary's bound on one answer's |Δlogp| (VLLMSampler.load_weights); on the tiny MoE a correct sync gives
# 5e-7 (fp32) and 7e-3 (bf16: numerics), one that skipped the experts' repack > 2. Calibrated on the CPU build only
VLLM_SYNC_TOLERANCE = {"fp32": 1e-4, "bf16": 0.5, "fp16": 0.5}


def _vllm_environment() -> int:
    """Settings vLLM must see before it is imported; returns torch's thread count (to restore after start-up)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: tensors can be passed
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, CPU build only
    threads = torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # else vLLM drops torch to one thread
    return threads


def _vllm_on_cpu() -> bool:
    """True on vLLM's CPU build (vllm-cpu), False on the GPU build."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def reload_vllm_weights(llm, named_tensors) -> None:
    """In-place weight sync of a vllm.LLM: collective_rpc("reload_weights") + reset_prefix_cache.

    Works on vLLM's CPU build, whose repacked Linear weights break the per-parameter `load_weights` path that TRL's
    colocate sync uses. `named_tensors`: (HF parameter name, tensor) pairs; vLLM casts them to its dtype.
    """
    # TIM: the served copy enters vLLM's own kernels here
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [(n, t.detach()) for n, t in named_tensors]})
    if _vllm_on_cpu():
        llm.collective_rpc(_repack_cpu_experts)
    llm.reset_prefix_cache()


def _repack_cpu_experts(worker) -> int:
    """Runs on vLLM 0.32's CPU worker after a reload: a weight update copies the new experts into storage already
    packed for the CPU kernel and skips the repack (unquantized_fused_moe_method runs cpu_moe's
    process_weights_after_loading on the first load only: |Δlogp| 4.4 after one sync), so run it again. Returns the
    MoE layers repacked (0 for a dense model). Reaches into vLLM's internals: vllm-cpu is pinned to 0.32."""
    layers = [m for m in worker.model_runner.model.modules()
              if getattr(getattr(m, "quant_method", None), "moe_kernel", None) is not None]
    for layer in layers:
        layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
    return len(layers)


class VLLMSampler:
    """The same interface over vllm.LLM (vLLM's CPU build here, `vllm` on a GPU); weights synced in place.

    Log-probs come from SamplingParams(logprobs=K) with logprobs_mode="processed_logprobs", i.e. of the
    distribution actually sampled from (temperature, then top-p / top-k / min-p when set: -inf off the kept set).
    Prompts go in as token ids, so no tokenizer can disagree. In-place sync:
    collective_rpc("reload_weights", weights_iterator=...) then reset_prefix_cache(); the in-process engine
    (VLLM_ENABLE_V1_MULTIPROCESSING=0) is required for passing tensors.
    """

    def __init__(self, model_dir: str | Path, dtype: str = "fp32", seed: int = 0, tokenizer=None,
                 max_model_len: int | None = None, max_num_seqs: int = 256, gpu_memory: float = 0.3,
                 reference: torch.nn.Module | None = None):
        threads = _vllm_environment()
        from vllm import LLM  # heavy (~4 s): imported only when a vLLM sampler is built

        _check_choice("dtype", dtype, sorted(_DTYPES))
        self.dtype, self.seed, self.tokenizer = dtype, seed, tokenizer or load_tokenizer(model_dir)
        self.reference = reference  # a torch model holding what each sync loads (Trainer.behaviour): the canary
        # colocated with the trainer on one GPU: vLLM takes this share of its memory (the CPU build has its own knob)
        on_gpu = {} if _vllm_on_cpu() else {"gpu_memory_utilization": gpu_memory}
        from vllm.distributed import parallel_state as ps  # vLLM 0.32 makes the expert-parallel group only for
        if ps.model_parallel_is_initialized() and ps._EP is None:  # a process's first engine: add it after a dense one
            world = ps.get_world_group()
            ps._EP = ps.init_model_parallel_group([list(range(world.world_size))], world.local_rank,
                                                  torch.distributed.get_backend(world.device_group), group_name="ep")
        self.llm = LLM(model=str(model_dir), dtype=_VLLM_DTYPES[dtype], enforce_eager=True, block_size=32, seed=seed,
                       max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                       logprobs_mode="processed_logprobs", max_logprobs=-1, **on_gpu)
        torch.set_num_threads(threads)
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """In-place sync of exported weights (vLLM casts them to its dtype). With a reference, the sync canary: one
        held-out problem's answer log-prob from both engines, RuntimeError beyond VLLM_SYNC_TOLERANCE[dtype]: a sync
        the engine did not take up (mis-packed experts: > 2; in fp32 also a stale one: one step moves it ~1e-3)."""
        reload_vllm_weights(self.llm, state_dict.items())
        if self.reference is not None:
            problem = make_arithmetic_task(1, seed=0, split="eval")
            logp = answer_logprobs(self.reference, self.tokenizer, problem)  # (1,) torch on the same weights
            gap = float((self.answer_logprobs(problem) - logp).abs())
            if not gap <= VLLM_SYNC_TOLERANCE[self.dtype]:
                raise RuntimeError(f"vLLM sync canary: after a weight sync vLLM ({self.dtype}) and torch disagree by "
                                   f"|Δlogp| {gap:.3g} > {VLLM_SYNC_TOLERANCE[self.dtype]:g} on one held-out "
                                   "answer: the engine does not serve the weights it was sent")

    def sample(self, prompts: list[list[int]], n: int = 1, max_new_tokens: int = 5, temperature: float = 1.0,
               topk: int = 0, generator: torch.Generator | None = None, top_p: float = 1.0, top_k: int = 0,
               min_p: float = 0.0) -> Rollout:
        """n samples per prompt (consecutive rows) with vLLM's log-probs of each token and of its top-K ids.

        With truncation the kept support is the finite entries of the K processed log-probs; a position whose K are
        all finite (K < V: its support may be larger) gets an empty row, which the trainer fills with the support it
        rebuilds (merge_support). topk None: only the sampled token's log-prob (K = 0, kept_ids None: rebuilt).
        """
        from vllm import SamplingParams

        K = 0 if topk is None else (self.vocab_size if topk <= 0 else min(topk, self.vocab_size))
        # One seed per prompt: vLLM seeds completion i of a request with seed + i, so one seed for the whole batch
        # would give every prompt's i-th sample the same random stream (and duplicate prompts identical groups).
        seeds = (torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist() if generator is not None
                 else [None] * len(prompts))
        _check_truncation(top_p, top_k, min_p)
        if 0 < temperature < VLLM_MIN_TEMPERATURE:
            raise ValueError(f"temperature {temperature} < {VLLM_MIN_TEMPERATURE}: vLLM would sample at "
                             f"{VLLM_MIN_TEMPERATURE} while the trainer divides by {temperature}, so every ratio "
                             "would compare two different distributions")
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k if temperature > 0 else 1,
                                 min_p=min_p, max_tokens=max_new_tokens, logprobs=K, seed=seed,
                                 skip_special_tokens=False, stop_token_ids=[self.tokenizer.eos_id])
                  for seed in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rows = [comp for out in outputs for comp in out.outputs]  # n completions of each prompt, in order
        B, T = len(rows), max(len(c.token_ids) for c in rows)
        response_ids, logp = torch.full((B, T), self.tokenizer.pad_id, dtype=torch.long), torch.zeros(B, T)
        mask, top_ids = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, K, dtype=torch.long)
        top_logp = torch.full((B, T, K), -math.inf)
        for i, comp in enumerate(rows):
            for t, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
                ranked = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:K]
                response_ids[i, t], mask[i, t], logp[i, t] = tok, True, lp[tok].logprob
                top_ids[i, t, : len(ranked)] = torch.tensor([k for k, _ in ranked])
                top_logp[i, t, : len(ranked)] = torch.tensor([v.logprob for _, v in ranked])
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], self.tokenizer.pad_id)
        kept = None  # TIM: processed log-probs are -inf exactly off the kept support
        if temperature > 0 and (top_p < 1 or top_k > 0 or min_p > 0) and K > 0:
            finite = torch.isfinite(top_logp) & mask[..., None]  # (B, T, K), ranked: the finite ones first
            beyond = finite.all(-1, keepdim=True) & (K < self.vocab_size)  # the support may not end within K
            kept = top_ids.masked_fill(~finite | beyond, -1)[..., : max(int(finite.sum(-1).max()), 1)]  # (B, T, S)
        entropy = _entropy(top_logp) if K == self.vocab_size else None  # the whole distribution came back
        texts = [self.tokenizer.decode(row.tolist()) for row in response_ids]
        return Rollout(prompt_ids, prompt_mask, response_ids, mask, logp, top_ids, top_logp, texts, kept_ids=kept,
                       entropy=entropy)

    def greedy_accuracy(self, problems, max_new_tokens: int = 6) -> float:
        """Held-out greedy exact match of vLLM's copy of the weights."""
        prompts, answers = encode_problems(self.tokenizer, problems)
        texts = self.sample(prompts, 1, max_new_tokens, temperature=0.0, topk=1).texts
        return sum(map(verify, texts, answers)) / max(len(prompts), 1)

    def answer_logprobs(self, problems) -> torch.Tensor:
        """log P(answer + <eos> | prompt) from vLLM's prompt log-probs (teacher-forced). (N,)."""
        from vllm import SamplingParams

        seqs = [(self.tokenizer.encode(p), self.tokenizer.encode(a, bos=False) + [self.tokenizer.eos_id])
                for p, a in problems]
        outputs = self.llm.generate([{"prompt_token_ids": p + a} for p, a in seqs],
                                    SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
        return torch.tensor([sum(o.prompt_logprobs[len(p) + j][tok].logprob for j, tok in enumerate(a))
                             for o, (p, a) in zip(outputs, seqs)])


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")  # ChatML (SmolLM2, Qwen), Llama 3, Gemma


class HFTokenizer:
    """CharTokenizer's interface over any saved HF tokenizer (for --model directories that are not tim_rl's)."""

    def __init__(self, directory: str | Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        template, vocab = self.tok.chat_template or "", self.tok.get_vocab()
        turn_end = next((t for t in END_OF_TURN if t in template and t in vocab), None)
        # A chat model ends its answer with the template's end-of-turn token, which need not be the EOS (Llama 3)
        self.eos_id = vocab[turn_end] if turn_end else self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of `text` with the tokenizer's special tokens, but no second BOS before a chat template's."""
        bos = bos and not (self.tok.bos_token and text.startswith(self.tok.bos_token))
        return self.tok(text, add_special_tokens=bos)["input_ids"]

    def decode(self, ids) -> str:
        """Text up to the first <eos>, special tokens skipped."""
        ids = [int(i) for i in ids]
        return self.tok.decode(ids[: ids.index(self.eos_id)] if self.eos_id in ids else ids, skip_special_tokens=True)


def task_kwargs(model_dir: Path) -> dict:
    """make_arithmetic_task's digits and ops the embedded model was pre-trained on (its pretrain.json), 2-digit
    addition for other models."""
    path = Path(model_dir) / "pretrain.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    return {"digits": info.get("digits", 2), "ops": info.get("ops", "+")}


def load_tokenizer(directory: str | Path):
    """tim_rl's CharTokenizer when the directory holds it (pretrain.json), else the directory's HF tokenizer."""
    return CharTokenizer() if (Path(directory) / "pretrain.json").exists() else HFTokenizer(directory)


# ---------------------------------------------------------------------------------------------------------------
# ---- trainer ----


class Behaviour(NamedTuple):
    """Trainer.behaviour_logprobs' result, (B, T) log-probs of the trainer engine: on the served weights (logp_old)
    and on the unrounded master at export (None for an fp32 export); the kept support rebuilt from them (None); an MoE
    model's log-probs on the served weights with the sampler's experts replayed and the experts it chose itself
    (B, P + T, L, k) (None: a dense model or a sampler that returned no routes)."""

    logp_old: torch.Tensor
    logp_master_old: torch.Tensor | None
    rebuilt: torch.Tensor | None
    logp_old_sampler_routes: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    update_routes: torch.Tensor | None = None  # what the update replays: None (live), R2 the current policy's, R3 the
    # sampler's (on the CPU)
    logp_old_sampler_gates: torch.Tensor | None = None  # the sampler's experts and gate weights replayed (torch only)


EXPORT_STAT_ELEMENTS = 1 << 22  # the visible update fraction's fp64 sums run on slices of 4M elements (32 MiB)


def _dot_and_norm2(master, master_before, served, served_before) -> tuple[torch.Tensor, torch.Tensor]:
    """(<d served, d master>, |d master|^2) in fp64, over flat slices: no fp64 copy of a whole tensor. -> 0-d, 0-d."""
    dot = torch.zeros((), dtype=torch.float64, device=master.device)
    norm2 = torch.zeros((), dtype=torch.float64, device=master.device)
    flat = [t.detach().reshape(-1) for t in (master, master_before, served, served_before)]
    for start in range(0, flat[0].numel(), EXPORT_STAT_ELEMENTS):
        m, m0, s, s0 = (t[start : start + EXPORT_STAT_ELEMENTS].double() for t in flat)
        d_master = m - m0
        dot += (d_master * (s - s0)).sum()
        norm2 += d_master.square().sum()
    return dot, norm2


class Trainer:
    """fp32 master weights + optimizer; recomputes log-probs; exports the served copy the sampler will hold."""

    def __init__(self, model, lr: float = 1e-4, optimizer: str = "adamw", export_dtype: str = "fp32",
                 loss_on_served: bool = False, extra_params=()):
        _check_choice("export_dtype", export_dtype, sorted(_DTYPES))
        _check_choice("optimizer", optimizer, ("adamw", "sgd"))
        # TIM: dropout off, or every forward would differ from the last and show up as lag; training mode kept, so
        # gradient checkpointing (transformers checkpoints in training mode only) stays effective
        self.model = without_dropout(model.float()).train()
        # The trainer engine on the weights the sampler holds: logp_old comes from here (kept when the sampler lags).
        # Its parameters are also the served copy (fp32 values of what the sampler holds): no second copy.
        self.behaviour = copy.deepcopy(self.model).eval().requires_grad_(False)
        # The unrounded master at the last export: splits export rounding off the ledger (bf16 / fp16 exports only).
        self.master_at_export = copy.deepcopy(self.model).eval() if export_dtype != "fp32" else None
        params = list(self.model.parameters()) + list(extra_params)
        self.opt = (torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if optimizer == "adamw"
                    else torch.optim.SGD(params, lr=lr))
        self.export_dtype, self.loss_on_served = export_dtype, loss_on_served
        self.residual: dict[str, torch.Tensor] = {}  # error-feedback residuals, fp32
        self._served_leaves: dict[str, torch.Tensor] | None = None

    @property
    def served(self) -> dict[str, torch.Tensor]:
        """The fp32 values the sampler holds (the behaviour copy's parameters; name -> tensor, not a copy)."""
        return dict(self.behaviour.named_parameters())

    def _params(self) -> dict | None:
        """None (the master), or under loss_on_served fresh leaves holding the served copy."""
        self._served_leaves = ({n: v.clone().requires_grad_(True) for n, v in self.served.items()}
                               if self.loss_on_served else None)
        return self._served_leaves

    def logprobs(self, rollout: Rollout, topk_ids: torch.Tensor | None = None, temperature: float = 1.0, routes=None):
        """(logp, logp_topk, hidden) under the current weights, with gradient. Fair Cast's loss_on_served runs the
        forward on the served (rounded) copy and routes its gradient to the fp32 master (straight-through); `routes`
        replays an MoE model's experts."""
        return sequence_logprobs(self.model, rollout, temperature, topk_ids, self._params(), routes)  # TIM

    def support_logprobs(self, rollout: Rollout, topk_ids: torch.Tensor | None = None, temperature: float = 1.0,
                         routes: torch.Tensor | None = None):
        """logprobs renormalised on rollout.kept_ids, plus log S: (logp~, logp_topk~, hidden, log S or None)."""
        return support_logprobs(self.model, rollout, temperature, topk_ids, self._params(), routes)

    @torch.no_grad()
    def behaviour_logprobs(self, rollout: Rollout, temperature: float = 1.0, truncation: tuple | None = None,
                           routing_replay: str = "none") -> Behaviour:
        """The trainer engine on the served weights / on the master at export, renormalised on the kept support
        (Behaviour). One forward per model; an MoE model with the sampler's routes gets a second one on the served
        weights (and a third with its gate weights), so that the ledger can split routing / gates / numerics; R2 one
        on the current weights (the experts the update replays).

        truncation = (top_p, top_k, min_p): the kept support is also rebuilt from the behaviour logits of that same
        forward (kept_support_from_logits) and used where the sampler returned none (rollout.kept_ids None).
        routing_replay: none (logp_old on the trainer's own experts) | r2 (the same; the update replays the experts the
        policy being updated, the trainer's current weights, chooses before it: verl's compute_log_prob) | r3
        (logp_old on the sampler's experts, replayed; the update replays those too).
        """
        sampler_routes = rollout.routed_experts if moe_routers(self.behaviour) else None
        forward = response_forward(self.behaviour, rollout, temperature)  # (B, T, V); an MoE model: own experts
        rebuilt = None
        if truncation is not None:
            rebuilt = kept_support_from_logits(forward.logits, rollout.response_ids, *truncation)  # (B, T, S)
        if rebuilt is not None:  # where the sampler returned none, or its K entries did not reach the support's end
            rollout = dataclasses.replace(rollout, kept_ids=merge_support(rollout.kept_ids, rebuilt, rollout.mask)[0])
        logp_old, own_routes = logprobs_on_support(forward.logits, rollout)[0], forward.routes
        del forward  # before the next forward's logits
        logp_old_sampler_routes = logp_old_sampler_gates = None
        if sampler_routes is not None:  # TIM: the same weights on the sampler's experts: routing vs numerics
            replayed = response_forward(self.behaviour, rollout, temperature, routes=sampler_routes, record=False)
            logp_old_sampler_routes = logprobs_on_support(replayed.logits, rollout)[0]
            del replayed
            if rollout.routed_weights is not None:  # TIM: and on the sampler's gate weights: gates vs numerics
                replayed = response_forward(self.behaviour, rollout, temperature, routes=sampler_routes,
                                            gates=rollout.routed_weights, record=False)
                logp_old_sampler_gates = logprobs_on_support(replayed.logits, rollout)[0]
            if routing_replay == "r3":  # TIM: R3: the trainer's policy runs on the sampler's experts from here on
                logp_old = logp_old_sampler_routes
        # TIM: the experts the update's forwards are forced to: R2 the policy being updated's own, R3 the sampler's
        updated = self.behaviour if self.loss_on_served else self.model  # the weights the update's forward runs on
        current_routes = response_forward(updated, rollout, temperature).routes if routing_replay == "r2" else None
        update_routes = {"none": None, "r2": current_routes, "r3": sampler_routes}[routing_replay]
        logp_master_old = None
        if self.master_at_export is not None:  # on the experts the update will use
            logits_master = response_forward(self.master_at_export, rollout, temperature, routes=update_routes,
                                             record=False)[0]
            logp_master_old = logprobs_on_support(logits_master, rollout)[0]
        return Behaviour(logp_old, logp_master_old, rebuilt, logp_old_sampler_routes, own_routes, update_routes,
                         logp_old_sampler_gates)

    def grad_leaves(self) -> list[torch.Tensor]:
        """The tensors the last forward ran on: the served leaves under loss_on_served, else the master."""
        return list(self._served_leaves.values()) if self._served_leaves is not None else list(self.model.parameters())

    def step(self, loss: torch.Tensor) -> float:
        """Backward and one optimizer step on the fp32 master; returns the gradient norm."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        release_routes(self.model)  # the routes kept for activation checkpointing's recompute
        if self._served_leaves is not None:
            for name, p in self.model.named_parameters():
                p.grad = self._served_leaves[name].grad
            self._served_leaves = None
        grads = [p.grad for group in self.opt.param_groups for p in group["params"] if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        self.opt.step()
        return norm

    @torch.no_grad()
    def export(self, mode: str = "rtn", generator: torch.Generator | None = None) -> tuple[dict, float]:
        """Round the fp32 master to the sampler's dtype (rtn | sr | ef). Returns (state dict, visible update fraction).

        Also moves the behaviour copy to the served weights (in place), so that logp_old is the trainer engine on what
        the sampler now holds. On the CPU: the reference roundings with `generator` itself. On a GPU: SR's noise is
        hash_noise16 seeded by one draw from `generator` per tensor, SR and EF fused where torch.compile has Triton.
        """
        _check_choice("mode", mode, ("rtn", "sr", "ef"))
        if mode != "rtn" and self.export_dtype != "bf16":
            raise ValueError(f"export mode {mode!r} rounds to bf16, but the sampler dtype is {self.export_dtype}")
        state, dot, norm2 = {}, 0.0, 0.0
        device = next(self.model.parameters()).device
        sr = functools.partial(stochastic_round_bf16, generator=generator)
        ef = error_feedback_round_bf16
        if device.type == "cuda":  # fused passes, SR's noise hashed from one host draw per tensor (machinery.py)
            from machinery import gpu_rounding

            sr, ef = gpu_rounding(device, generator)
        for name, p in self.model.named_parameters():
            master = p.detach()
            if self.export_dtype == "fp32":
                served = master.clone()
            elif mode == "sr":  # TIM: Fair Cast, unbiased rounding
                served = sr(master)
            elif mode == "ef":  # TIM: Fair Cast, error feedback
                served, self.residual[name] = ef(master, self.residual.get(name, torch.zeros_like(master)))
            else:  # TIM: round-to-nearest swallows updates below half a cell
                served = master.to(_DTYPES[self.export_dtype])
            served_before = self.behaviour.get_parameter(name)
            if self.master_at_export is not None:  # the visible update fraction's <d served, d master> / |d master|^2
                moved = _dot_and_norm2(master, self.master_at_export.get_parameter(name), served, served_before)
                dot, norm2 = dot + moved[0], norm2 + moved[1]  # on the device: no host round trip per tensor
            served_before.copy_(served)  # TIM: the behaviour copy now holds exactly what the sampler will hold
            state[name] = served
        if self.master_at_export is not None:
            self.master_at_export.load_state_dict(dict(self.model.named_parameters()), strict=False)
        return state, (float(dot / norm2) if norm2 > 0 else (1.0 if self.export_dtype == "fp32" else 0.0))


def trainer_state(trainer: Trainer, extra: dict[str, torch.nn.Module] | None = None) -> tuple[dict, dict]:
    """(tensors, metadata) that restore a Trainer bit for bit: master, served copy, EF residuals, master at export,
    optimizer moments; plus any extra modules (the COPC value head). Names are prefixed by what they belong to."""
    modules = {"model": trainer.model, "master_at_export": trainer.master_at_export} | (extra or {})
    tensors = {f"{m}.{n}": p.detach() for m, module in modules.items() if module is not None
               for n, p in module.named_parameters()}
    tensors |= {f"{part}.{n}": v for part in ("served", "residual") for n, v in getattr(trainer, part).items()}
    opt = trainer.opt.state_dict()
    tensors |= {f"opt.{i}.{key}": torch.as_tensor(v) for i, slots in opt["state"].items() for key, v in slots.items()}
    return tensors, {"param_groups": opt["param_groups"], "opt_slots": {i: list(v) for i, v in opt["state"].items()}}


@torch.no_grad()
def load_trainer_state(trainer: Trainer, tensors: dict, meta: dict, extra: dict | None = None) -> None:
    """Inverse of trainer_state (the behaviour copy is rebuilt from the served weights)."""
    part = lambda name: {n[len(name) + 1:]: v for n, v in tensors.items() if n.startswith(name + ".")}
    device = next(trainer.model.parameters()).device
    trainer.residual = {n: v.to(device, copy=True) for n, v in part("residual").items()}
    trainer.behaviour.load_state_dict(part("served"), strict=False)  # the served copy is the behaviour's weights
    modules = {"model": trainer.model, "master_at_export": trainer.master_at_export} | (extra or {})
    for name, module in modules.items():
        if module is not None:
            module.load_state_dict(part(name), strict=False)  # buffers (rotary tables) are not saved
    state = {int(i): {key: tensors[f"opt.{i}.{key}"].clone() for key in keys} for i, keys in meta["opt_slots"].items()}
    trainer.opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def write_atomic(path: Path, text: str, write=None) -> None:
    """Write text (or call write(temporary path)) to a temporary file next to `path`, fsync it, then rename it over
    `path` (all or nothing)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text) if write is None else write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Atomic safetensors write: a temporary file in the same directory, fsync, then rename over `path`.

    A crash leaves either the previous checkpoint or the new one, never a torn file. `meta` is stored as JSON in
    the safetensors header (no pickle anywhere).
    """
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    write_atomic(Path(path), "", lambda tmp: save_file(tensors, str(tmp), metadata={"json": json.dumps(meta)}))


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) from save_checkpoint's file. safetensors only: loading never executes code."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        return {k: f.get_tensor(k) for k in names}, json.loads(f.metadata()["json"])


# ---------------------------------------------------------------------------------------------------------------
# ---- experiment loop and ledger ----


RS_ARMS = {"rs": divergence_mask_weights, "rs_seq_max": divergence_seq_max_mask,
           "rs_seq_mean": divergence_seq_mean_mask, "rs_seq_sum": divergence_seq_sum_mask}  # verl rollout_rs
RS_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}  # --rs-estimator -> the per-token estimate


class LossInputs(NamedTuple):
    """What an arm's loss reads. (B, T) log-probs of the sampled tokens; (B, T, K) at the sampler's top-K ids."""

    logp: torch.Tensor  # current trainer, carries gradient
    logp_now: torch.Tensor  # logp detached: the trainer side of REINFORCE's weights
    logp_prox: torch.Tensor  # the trainer before this batch's first update, detached
    logp_old: torch.Tensor  # the trainer engine on the weights the sampler holds, detached
    logp_infer: torch.Tensor  # the sampler's, recorded while sampling
    logp_topk: torch.Tensor | None  # (B, T, K) trainer, carries gradient
    logp_topk_infer: torch.Tensor | None  # (B, T, K) the sampler's
    adv: torch.Tensor  # (B, T) or (B, 1)
    mask: torch.Tensor


class Arm(NamedTuple):
    """One --correction: its loss, what the loop must give it besides the sampled tokens' log-probs, its metrics."""

    loss: Callable  # (cfg, LossInputs) -> scalar loss
    reads_topk: bool = False  # the sampler's top-K log-probs (recorded only for these arms)
    renormalized: bool = False  # reads logp_old or the top-K: needs the trainer renormalised on the kept support
    critic: bool = False  # COPC: a value head gives (B, T) advantages
    resync: bool = False  # DLC: its lag or staleness trigger may sync before --sync-every
    shares: Callable | None = None  # (cfg, LossInputs) -> {metric: share} of what it drops or clips; reads
    # logp_now, logp_infer, adv and mask only (correction_shares gives it those of the first update)


def _pg(x: LossInputs, weights=None):
    """REINFORCE on the batch, each token's term times its weight."""
    return pg_loss(x.logp, x.adv, x.mask, weights)


def _ppo(cfg, x: LossInputs, weights=None):
    """Decoupled PPO: the update p / p_prox clipped, the behaviour gap p_prox / q in `weights`."""
    return ppo_loss(x.logp, x.logp_prox, x.adv, x.mask, weights, cfg.eps_low, cfg.eps_high)  # TIM


def _sc(x: LossInputs, cap=None, band=None):
    """Score centering on the sampler's top-K head (with a TIS cap or an MIS band)."""
    return score_centering_loss(x.logp, x.logp_topk, x.logp_infer, x.logp_topk_infer, x.adv, x.mask, cap, band)


def _calibrated(cfg, x: LossInputs):
    """TIM: ppo_infer with FP8-calibrated bounds [7]; the ratio p/q is the IS weight, no TIS on top."""
    ratio_low, ratio_ref = (x.logp_now - x.logp_infer).exp(), (x.logp_now - x.logp_old).exp()
    lo, hi = calibrated_clip_bounds(ratio_low, ratio_ref, x.adv, x.mask, cfg.eps_low, cfg.eps_high)
    return ppo_loss(x.logp, x.logp_infer, x.adv, x.mask, eps_low=1 - lo, eps_high=hi - 1)


def _dropped(touched, mask, kind="masked") -> dict[str, float]:
    """Shares of the generated tokens and of the sequences that `touched` (B, T) bool marks."""
    touched = mask & touched
    return {f"frac_{kind}_tokens": float(touched.sum() / mask.sum().clamp(min=1)),
            f"frac_{kind}_seqs": float(touched.any(dim=1).sum() / mask.any(dim=1).sum().clamp(min=1))}


def _rs_arm(divergence_weights) -> Arm:
    """A verl rollout_rs arm: rejection only, kept tokens weigh 1 (rollout_rs without rollout_is)."""
    def weights(cfg, x):
        """The arm's keep mask (1 kept, 0 dropped) on the batch."""
        estimator = RS_ESTIMATORS[cfg.rs_estimator]
        return divergence_weights(x.logp_now, x.logp_infer, x.mask, cfg.rs_threshold, estimator)

    return Arm(lambda c, x: _pg(x, weights(c, x)), shares=lambda c, x: _dropped(weights(c, x) == 0, x.mask))


def _tis_sn(cfg, x: LossInputs):
    """TIM: truncate, then self-normalise (verl rollout_is_batch_normalize)."""
    return self_normalize_weights(tis_weights(x.logp_now, x.logp_infer, x.mask, cfg.tis_cap), x.mask)


def _opsm(cfg, x: LossInputs):
    """OPSM's keep mask on the batch."""
    return opsm_mask(x.logp_now, x.logp_infer, x.adv, x.mask, cfg.opsm_delta)


# Every correction (--correction NAME). TIM: REINFORCE has no trust region, so its weight covers the whole gap
# p / q = lag x numerics: the weight gets the current log-prob (detached). The decoupled-PPO arms weight the
# behaviour gap p_prox / q and leave the update p / p_prox to the clip.
ARMS = {
    "none": Arm(lambda c, x: _pg(x)),
    "tis": Arm(lambda c, x: _pg(x, tis_weights(x.logp_now, x.logp_infer, x.mask, c.tis_cap))),
    "mis": Arm(lambda c, x: _pg(x, mis_weights(x.logp_now, x.logp_infer, x.mask, c.mis_low, c.mis_high))),
    "seq_tis": Arm(lambda c, x: _pg(x, seq_tis_weights(x.logp_now, x.logp_infer, x.mask, c.seq_tis_cap))),
    "geo": Arm(lambda c, x: _pg(x, geo_mask_weights(x.logp_now, x.logp_infer, x.mask))),
    "cis": Arm(lambda c, x: _ppo(c, x, cis_weights(x.logp_prox, x.logp_infer, x.mask))),
    "ppo": Arm(lambda c, x: _ppo(c, x, tis_weights(x.logp_prox, x.logp_infer, x.mask, c.tis_cap))),
    # TIM: the sampler's log-probs as pi_old: the whole gap clipped
    "ppo_infer": Arm(lambda c, x: ppo_loss(x.logp, x.logp_infer, x.adv, x.mask, None, c.eps_low, c.eps_high)),
    "dppo": Arm(lambda c, x: dppo_loss(x.logp, x.logp_infer, x.adv, x.mask, delta=c.dppo_delta)),
    "sc": Arm(lambda c, x: _sc(x), reads_topk=True, renormalized=True),
    "sc_tis": Arm(lambda c, x: _sc(x, cap=c.tis_cap), reads_topk=True, renormalized=True),
    "sc_mis": Arm(lambda c, x: _sc(x, band=(c.mis_low, c.mis_high)), reads_topk=True, renormalized=True),
    "dlc": Arm(lambda c, x: dlc_loss(x.logp, x.logp_old, x.logp_infer, x.adv, x.mask, c.eps_low, c.eps_high,
                                     logp_prox=x.logp_prox, lag_cap=c.dlc_lag_cap),
               renormalized=True, resync=True),
    "copc": Arm(lambda c, x: _ppo(c, x, copc_mask(x.logp_prox, x.logp_infer, x.mask)), critic=True),
    "calibrated": Arm(_calibrated, renormalized=True),
    # a positive control [2], not a correction: REINFORCE minus its signal part = the drift alone
    "drift_only": Arm(lambda c, x: _pg(x) - _sc(x), reads_topk=True, renormalized=True),
    **{name: _rs_arm(weights) for name, weights in RS_ARMS.items()},
    "tis_sn": Arm(lambda c, x: _pg(x, _tis_sn(c, x)),
                  shares=lambda c, x: {"sn_mean_weight": float(masked_mean(tis_weights(
                      x.logp_now, x.logp_infer, x.mask, c.tis_cap), x.mask))}),
    "opsm": Arm(lambda c, x: _pg(x, _opsm(c, x)), shares=lambda c, x: _dropped(_opsm(c, x) == 0, x.mask)),
    # TIM: r = p / q, see cispo_loss; clipped tokens keep their gradient, scaled down
    "cispo": Arm(lambda c, x: cispo_loss(x.logp, x.logp_infer, x.adv, x.mask, c.eps_high),
                 shares=lambda c, x: _dropped(x.logp_now - x.logp_infer > math.log1p(c.eps_high), x.mask,
                                              "clipped")),
}
CORRECTIONS = tuple(ARMS)


def arm_of(cfg) -> Arm:
    """The run's arm: the one place that reads cfg.correction."""
    name = cfg.correction
    if name not in ARMS:
        raise ValueError(f"correction must be one of {' | '.join(ARMS)}, got {name!r}")
    return ARMS[name]


def policy_loss(cfg: RLConfig, logp, logp_topk, logp_prox, logp_old, ro: Rollout, adv):
    """The chosen correction as one loss (its per-token weight: effective_token_weights), plus --k2-coef's term.

    logp (grad) current trainer; logp_prox the trainer before this batch's first update; logp_old the trainer engine
    on the weights the sampler holds; ro.logp_infer the sampler. At the first update logp == logp_prox.
    """
    x = LossInputs(logp, logp.detach(), logp_prox, logp_old, ro.logp_infer, logp_topk, ro.logp_topk_infer, adv,
                   ro.mask)
    loss = arm_of(cfg).loss(cfg, x)
    if cfg.k2_coef > 0:  # TIM: any arm plus prime-rl's k2 pull toward the sampler
        loss = loss + k2_penalty(logp, ro.logp_infer, ro.mask, cfg.k2_coef)
    return loss


def correction_shares(cfg: RLConfig, logp_now, logp_infer, adv, mask) -> dict[str, float]:
    """What an arm drops (frac_masked_*) or clips (frac_clipped_*): shares of generated tokens and of sequences;
    tis_sn's normaliser; the k2 term. {} for the other arms (their frac_zeroed is in the record)."""
    out = {"k2_penalty": float(k2_penalty(logp_now, logp_infer, mask, cfg.k2_coef))} if cfg.k2_coef > 0 else {}
    shares = arm_of(cfg).shares
    if shares is None:
        return out
    x = LossInputs(logp_now, logp_now, logp_now, None, logp_infer, None, None, adv, mask)
    return out | shares(cfg, x)


def resolve_device(device: str) -> torch.device:
    """auto -> cuda when torch sees a GPU, else cpu; cuda without a GPU is a clear error (naming --device)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto | cpu | cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' (--device cuda) but torch.cuda.is_available() is False: no GPU or a CPU "
                         "build of torch; use --device cpu or auto")
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


def _has_chat_template(model_dir: str | Path) -> bool:
    """Whether the tokenizer saved in model_dir has a chat template (read off its files; nothing is loaded)."""
    d = Path(model_dir)
    config = d / "tokenizer_config.json"
    return (d / "chat_template.jinja").is_file() or (config.is_file() and "chat_template" in json.loads(
        config.read_text()))


STEP_PHASES = ("sample", "recompute", "loss", "optimizer", "export", "sync")  # sec_<phase> in metrics.jsonl


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (getrusage: Linux reports KiB)."""
    import resource  # Unix only

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class RunState:
    """What one RL run holds between steps (everything a checkpoint must restore, plus the fixed data)."""

    trainer: Trainer
    sampler: object
    tokenizer: object
    gen: torch.Generator  # the run's random stream: sampling and SR export (router jitter: the sampler's own)
    value_head: torch.nn.Module | None  # COPC's critic
    train_set: list
    eval_set: list
    since_sync: int = 0


def evaluate(step: int, rs: RunState, cfg: RLConfig) -> dict:
    """Held-out greedy exact match (acc_) and probability of the exact answer (pc_), of trainer and sampler engine;
    with truncated sampling also pct_trainer, that probability under the policy the sampler draws from."""
    model, problems = rs.trainer.model, rs.eval_set
    tokens = max(6, cfg.max_new_tokens) if cfg.task == "arithmetic" else cfg.max_new_tokens  # greedy answer length
    record = {"step": step, "acc_trainer": greedy_accuracy(model, rs.tokenizer, problems, tokens),
              "acc_sampler": rs.sampler.greedy_accuracy(problems, tokens),
              "pc_trainer": float(answer_logprobs(model, rs.tokenizer, problems).exp().mean()),
              "pc_sampler": float(rs.sampler.answer_logprobs(problems).exp().mean())}
    if _truncates(cfg):  # what a truncated sampler would draw: the objective truncated RL optimises
        record["pct_trainer"] = float(answer_logprobs(model, rs.tokenizer, problems, temperature=cfg.temperature,
                                                      truncation=(cfg.top_p, cfg.top_k, cfg.min_p)).exp().mean())
    return record


class Update(NamedTuple):
    """One optimizer step on a rollout batch: what the step records, and the log-probs it saw before stepping."""

    loss: float
    grad_norm: float
    frac_zeroed: float  # share of the tokens with A != 0 whose gradient the clip, mask or weight zeroed
    frac_zeroed_neg_adv: float  # the same among the tokens with A < 0
    logp_kept: torch.Tensor  # (B, T) detached, before the step: the trainer renormalised on the kept support
    logp_prox: torch.Tensor  # (B, T) the proximal policy the loss used: at the first update, its own logp detached
    adv: torch.Tensor  # (B, T) or (B, 1), the advantages the loss used
    log_s: torch.Tensor | None  # (B, T) log kept mass under truncation, else None
    extra: dict  # first update only: kept_mass, the drift / signal split
    seconds: dict  # recompute / loss / optimizer


def update_on_batch(cfg: RLConfig, rs: RunState, ro: Rollout, rewards, logp_old, logp_prox, routes=None) -> Update:
    """One optimizer step of the chosen correction on the whole batch.

    logp_prox None: this is the batch's first update, and its own log-probs are the proximal policy. routes: the
    MoE experts the forward replays (R2 / R3; None: live routing).
    """
    clock = [time.perf_counter()]
    # TIM: with truncation the current trainer's log-probs are renormalised on the sampler's kept support: p~, not p
    topk_ids = ro.topk_ids if _reads_topk(cfg) and ro.topk_ids.shape[-1] > 0 else None  # gathered only where read
    logp, logp_topk, hidden, log_s = rs.trainer.support_logprobs(ro, topk_ids, cfg.temperature, routes)
    clock.append(time.perf_counter())
    first = logp_prox is None
    logp_kept = logp.detach()
    extra = {}
    if first and log_s is not None:
        extra["kept_mass"] = float(masked_mean(log_s.detach().exp(), ro.mask))
    if log_s is not None and not cfg.renormalize:  # TIM: full-vocabulary log-probs: the ratio is biased by S
        logp = logp + log_s
        logp_topk = None if logp_topk is None else logp_topk + log_s[..., None]
    logp_prox = logp.detach() if first else logp_prox  # TIM: the proximal policy: the trainer before the first update
    if arm_of(cfg).critic:  # COPC's critic: (B, T) advantages and its own loss
        values = torch.sigmoid(rs.value_head(hidden.detach()).squeeze(-1))  # (B, T), bounded to [0, 1] rewards
        adv, targets = copc_advantages(values, rewards, logp, ro.logp_infer, ro.mask)
        critic_loss = 0.5 * masked_mean((values - targets).square(), ro.mask)
    else:  # (B, 1) GRPO or raw-reward advantages
        adv = (grpo_advantages(rewards, cfg.group) if cfg.baseline == "group" else rewards)[:, None]
        critic_loss = 0.0
    loss = policy_loss(cfg, logp, logp_topk, logp_prox, logp_old, ro, adv)
    w_eff = effective_token_weights(loss, logp, adv, ro.mask)  # what the arm did to each token
    if first and cfg.diagnose_drift:
        extra |= drift_signal_norms(rs.trainer.grad_leaves(), logp, logp_topk, ro.logp_infer, ro.logp_topk_infer,
                                    adv, ro.mask)
    clock.append(time.perf_counter())
    grad_norm = rs.trainer.step(loss + critic_loss)
    clock.append(time.perf_counter())
    live = torch.isfinite(w_eff)  # masked tokens with A != 0
    negative = live & (adv.expand_as(w_eff) < 0)
    zeroed = live & (w_eff == 0)
    frac_zeroed = float(zeroed.sum() / live.sum()) if live.any() else math.nan
    frac_zeroed_neg_adv = float((zeroed & negative).sum() / negative.sum()) if negative.any() else math.nan
    seconds = {phase: clock[k + 1] - clock[k] for k, phase in enumerate(("recompute", "loss", "optimizer"))}
    return Update(loss.item(), grad_norm, frac_zeroed, frac_zeroed_neg_adv, logp_kept, logp_prox, adv, log_s, extra,
                  seconds)


class Timer:
    """Seconds per phase of one step: sec_<phase> in metrics.jsonl."""

    def __init__(self):
        self.sec, self.last = dict.fromkeys(STEP_PHASES, 0.0), time.perf_counter()

    def lap(self, phase: str | None) -> None:
        """Add the time since the previous lap to `phase` (None: to no phase)."""
        now = time.perf_counter()
        if phase is not None:
            self.sec[phase] += now - self.last
        self.last = now


def sample_batch(cfg: RLConfig, step: int, rs: RunState) -> tuple[Rollout, list[str]]:
    """This step's prompts, G samples each, on the trainer's device; and their answers."""
    problems = rs.train_set[step * cfg.prompts : (step + 1) * cfg.prompts]
    prompts, answers = encode_problems(rs.tokenizer, problems)
    device = next(rs.trainer.model.parameters()).device
    ro = rs.sampler.sample(prompts, cfg.group, cfg.max_new_tokens, cfg.temperature, recorded_topk(cfg), rs.gen,
                           cfg.top_p, cfg.top_k, cfg.min_p)
    return ro.to(device), answers


def merge_kept_support(ro: Rollout, rebuilt) -> dict:
    """Truncated sampling: the sampler's kept support, the trainer's rebuilt one where it has none; metrics."""
    extra = {"support_rebuilt": ro.kept_ids is None}
    if ro.kept_ids is None:
        ro.kept_ids = rebuilt
        return extra
    ro.kept_ids, beyond = merge_support(ro.kept_ids, rebuilt, ro.mask)  # TIM: past K: the rebuilt support
    extra["support_differs"] = support_differs(ro.kept_ids, rebuilt, ro.mask & ~beyond)
    if beyond.any():  # logged where it happened (a torch sampler records its whole support: never)
        extra["support_beyond_k"] = int(beyond.sum())
        warnings.warn(SUPPORT_BEYOND_K, stacklevel=1)
    return extra


def route_flips(ro: Rollout, behaviour) -> dict:
    """MoE: share of fed positions (prompt and response) whose experts differ between sampler and trainer."""
    fed = torch.cat([ro.prompt_mask, ro.mask], 1).cpu()  # (B, P + T)
    flips = routing_flip_rate(ro.routed_experts, behaviour.routes, fed)
    return {f"route_flip_{name}": share for name, share in flips.items()}


def sync_due(cfg: RLConfig, rs: RunState, ro: Rollout, behaviour) -> bool:
    """Counts the step since the last sync; True every sync_every steps (policy lag k - 1), or when DLC's lag or
    staleness trigger fires."""
    rs.since_sync += 1
    if rs.since_sync >= cfg.sync_every:
        return True
    if not arm_of(cfg).resync or (cfg.dlc_max_lag <= 0 and cfg.dlc_max_staleness <= 0):
        return False
    # TIM: DLC's trigger: the lag the next batch would be sampled with, the updated trainer vs the sampler's
    # weights on this batch's tokens, measured from the master at export when it was rounded (rounding is no lag)
    with torch.no_grad():
        routes = behaviour.update_routes
        logp_next = support_logprobs(rs.trainer.model, ro, cfg.temperature, routes=routes)[0]
    anchor = behaviour.logp_old if behaviour.logp_master_old is None else behaviour.logp_master_old
    return dlc_should_resync(logp_next, anchor, ro.mask, rs.since_sync, cfg.dlc_max_staleness, cfg.dlc_max_lag)


def sync_sampler(cfg: RLConfig, rs: RunState, timer: Timer) -> float | None:
    """Export the master (rounding it) into the sampler; returns the visible update fraction."""
    state, vuf = rs.trainer.export(cfg.export, generator=rs.gen)
    timer.lap("export")
    rs.sampler.load_weights(state)  # TIM: the trainer's weights (and its drift) enter the sampler
    rs.since_sync = 0
    return vuf


def step_record(cfg: RLConfig, step: int, rs: RunState, ro: Rollout, rewards, behaviour, updates: list[Update],
                synced: bool, vuf, extra: dict) -> dict:
    """One metrics.jsonl line: mismatch metrics and ledger of the first update's log-probs (before any step on this
    batch), loss and grad_norm as means over the updates, what the arm dropped."""
    first = updates[0]
    ledger = mismatch_ledger(first.logp_kept, behaviour.logp_old, ro.logp_infer, ro.mask, behaviour.logp_master_old,
                             first.log_s, behaviour.logp_old_sampler_routes, behaviour.logp_old_sampler_gates)
    record = {"step": step, "reward": float(rewards.mean()), "synced": synced, "visible_update_fraction": vuf,
              "staleness": rs.since_sync}
    for key in ("loss", "grad_norm", "frac_zeroed", "frac_zeroed_neg_adv"):  # nan: no token
        values = [getattr(u, key) for u in updates if math.isfinite(getattr(u, key))]
        record[key] = sum(values) / len(values) if values else None
    record |= {f"mm_{k}": v for k, v in mismatch_metrics(first.logp_prox, ro.logp_infer, ro.mask).items()}
    record |= correction_shares(cfg, first.logp_prox, ro.logp_infer, first.adv, ro.mask)
    record |= {f"ledger_{k}": v for k, v in ledger.items()} | extra | first.extra | {"peak_rss_mb": peak_rss_mb()}
    if ro.entropy is not None:  # recorded by the sampler, which had the whole distribution
        record["entropy"] = float(masked_mean(ro.entropy, ro.mask))
    return record


def rl_step(cfg: RLConfig, step: int, rs: RunState) -> dict:
    """One step: sample -> score -> behaviour pass -> (correct -> optimizer) x updates -> export/sync -> record."""
    timer = Timer()
    # 1) sample
    ro, answers = sample_batch(cfg, step, rs)
    timer.lap("sample")
    # 2) score: the verifier's reward per sequence
    rewards = [verify(text, answers[i // cfg.group]) for i, text in enumerate(ro.texts)]
    rewards = torch.tensor(rewards, device=ro.mask.device)
    # 3) behaviour pass: the trainer engine on the weights the sampler holds, and on the master (with truncation
    # the same forward rebuilds the kept support; an MoE model: also on the sampler's experts)
    truncation = (cfg.top_p, cfg.top_k, cfg.min_p) if _truncates(cfg) else None
    behaviour = rs.trainer.behaviour_logprobs(ro, cfg.temperature, truncation, cfg.routing_replay)
    extra = merge_kept_support(ro, behaviour.rebuilt) if truncation else {}
    if behaviour.routes is not None and ro.routed_experts is not None:  # MoE: same weights, two engines' experts
        extra |= route_flips(ro, behaviour)
    timer.lap("recompute")
    # 4) update(s): the arm's loss, updates_per_batch optimizer steps on the batch
    updates = []
    logp_prox = None  # TIM: the proximal policy, the trainer before this batch's first update
    for _ in range(cfg.updates_per_batch):
        # TIM: R2 / R3: update_routes are the experts every forward of the update is forced to
        update = update_on_batch(cfg, rs, ro, rewards, behaviour.logp_old, logp_prox, behaviour.update_routes)
        logp_prox = update.logp_prox
        updates.append(update)
        for phase, seconds in update.seconds.items():
            timer.sec[phase] += seconds
    timer.lap(None)
    # 5) export / sync
    synced = sync_due(cfg, rs, ro, behaviour)
    vuf = sync_sampler(cfg, rs, timer) if synced else None
    timer.lap("sync")
    # 6) ledger and metrics
    record = step_record(cfg, step, rs, ro, rewards, behaviour, updates, synced, vuf, extra)
    return record | {f"sec_{phase}": seconds for phase, seconds in timer.sec.items()}


def setup_run(cfg: RLConfig) -> RunState:
    """Model, trainer, sampler (holding the first served copy), data; all seeded from cfg.seed."""
    _check_run_config(cfg)
    torch.manual_seed(cfg.seed)
    model_dir = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(model_dir)
    device = resolve_device(cfg.device)
    model = load_model(model_dir, trust_remote_code=cfg.trust_remote_code).to(device)
    if cfg.gradient_checkpointing:  # each layer recomputed in backward: the same numbers, less memory
        model.gradient_checkpointing_enable()
    routers_flag = next((f"{_flag(n)} {getattr(cfg, n)}" for n in ("routing_replay", "router_noise", "router_jitter")
                         if getattr(cfg, n) not in ("none", 0.0)), None)  # no silent no-op on a model without them
    if routers_flag and not moe_routers(model):
        raise UsageError(f"{routers_flag} acts on MoE routers, but {cfg.model} has no "
                         "router tim_rl replays (REPLAYABLE_ROUTERS; --model runs/base-moe is the tiny MoE)" +
                         (f"; its router is {router_class(model)}" if is_moe(model) else ""))
    value_head = torch.nn.Linear(model.config.hidden_size, 1).to(device) if arm_of(cfg).critic else None
    trainer = Trainer(model, cfg.lr, cfg.optimizer, export_dtype=cfg.dtype, loss_on_served=cfg.loss_on_served,
                      extra_params=value_head.parameters() if value_head is not None else ())
    if cfg.sampler == "vllm":  # --dtype only (_check_run_config refused --quant, --noise and --exact)
        sampler = VLLMSampler(cfg.model, dtype=cfg.dtype, seed=cfg.seed, tokenizer=tokenizer,
                              gpu_memory=cfg.vllm_gpu_memory, reference=trainer.behaviour)
    else:
        sampler = TorchSampler(trainer.model, engine_spec(cfg), tokenizer)
    gen = torch.Generator().manual_seed(cfg.seed)
    sampler.load_weights(trainer.export(cfg.export, generator=gen)[0])  # it starts from the master's served copy
    return RunState(trainer, sampler, tokenizer, gen, value_head, *task_problems(cfg, model_dir, tokenizer))


def task_problems(cfg: RLConfig, model_dir: Path, tokenizer) -> tuple[list, list]:
    """(RL problems, held-out problems) of cfg.task; word problems go through the tokenizer's chat template."""
    if cfg.task == "arithmetic":
        task = run_task_kwargs(cfg, model_dir)
        return (make_arithmetic_task(cfg.steps * cfg.prompts, seed=cfg.seed, split="rl", **task),
                make_arithmetic_task(cfg.eval_n, seed=0, split="eval", **task))
    rl, held_out = make_word_problems(cfg.steps * cfg.prompts, cfg.seed), make_word_problems(cfg.eval_n, 0, "eval")
    return [[(chat_prompt(tokenizer, q), a) for q, a in problems] for problems in (rl, held_out)]


def _save_run_checkpoint(out: Path, rs: RunState, next_step: int) -> None:
    """out/checkpoint.safetensors: the trainer, the random streams and where to resume (atomic)."""
    tensors, meta = trainer_state(rs.trainer, {"value_head": rs.value_head})
    tensors |= {"rng.generator": rs.gen.get_state(), "rng.torch": torch.get_rng_state()}
    meta |= {"next_step": next_step, "since_sync": rs.since_sync}
    save_checkpoint(out / "checkpoint.safetensors", tensors, meta)


def _resume_run(out: Path, rs: RunState) -> tuple[int, list[dict]]:
    """Restore the checkpoint into rs; keep metrics.jsonl lines of the steps it covers (drop later or torn ones)."""
    if not (out / "checkpoint.safetensors").exists():
        raise FileNotFoundError(f"resume: no checkpoint.safetensors in {out}")
    tensors, meta = load_checkpoint(out / "checkpoint.safetensors")
    load_trainer_state(rs.trainer, tensors, meta, {"value_head": rs.value_head})
    rs.sampler.load_weights(rs.trainer.served)  # the sampler holds the served copy of the last sync
    rs.gen.set_state(tensors["rng.generator"])
    torch.set_rng_state(tensors["rng.torch"])
    rs.since_sync, start = meta["since_sync"], meta["next_step"]
    records = []
    for line in (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the kill
            continue
        if record.get("step", start) < start:  # an evaluation at `start` runs again
            records.append(record)
    return start, records


def run(cfg: RLConfig, resume: bool = False) -> list[dict]:
    """RL under mismatch: sample -> verify -> advantages -> recompute + ledger -> correct -> step -> export/sync.

    Writes one JSON line per step to runs/<name>/metrics.jsonl, a checkpoint every cfg.checkpoint_every steps and at
    the end, and returns the records. resume=True continues from runs/<name>/checkpoint.safetensors (bit for bit
    the run that was interrupted, on the same machine and thread count).
    """
    from tqdm.auto import tqdm

    rs = setup_run(cfg)
    out = Path(cfg.out_dir) / cfg.name
    out.mkdir(parents=True, exist_ok=True)
    start, records = _resume_run(out, rs) if resume else (0, [])
    if resume:
        print(f"[tim_rl] resuming {out} at step {start} of {cfg.steps} (its checkpoint)", file=sys.stderr)
    write_atomic(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))  # steps covered, once
    write_atomic(out / "config.json", json.dumps(asdict(cfg), indent=1))  # after: never beside older metrics
    with open(out / "metrics.jsonl", "a") as log:
        def write(record: dict) -> None:
            """Keep the record and append it to metrics.jsonl (flushed: a kill loses at most this line)."""
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()

        for step in tqdm(range(start, cfg.steps), desc=cfg.name, disable=not cfg.progress, mininterval=2,
                         initial=start, total=cfg.steps):
            if step % cfg.eval_every == 0:  # before the step's update: step 0 is the model RL starts from
                write(evaluate(step, rs, cfg))
            write(rl_step(cfg, step, rs))
            if step == cfg.steps - 1 or (cfg.checkpoint_every > 0 and (step + 1) % cfg.checkpoint_every == 0):
                _save_run_checkpoint(out, rs, step + 1)
        write(evaluate(cfg.steps, rs, cfg))  # after the last update
    return records


def vllm_available() -> bool:
    """True when the module `vllm` can be imported (vLLM's CPU build or the GPU build)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def demo(steps: int = 80, seeds: tuple[int, ...] = (0, 1, 2, 3, 4), sync_every: int = 16,
         out: str = "runs/demo") -> None:
    """The default command: mismatch of every engine, then policy lag hurting and being repaired (mean ± sd over
    paired seeds; `python experiments.py compare` adds the paired intervals and verdicts). Writes <out>/demo.md
    (both tables) and <out>/demo.png (trainer pc per arm, mean and ± 1 sd band over the seeds)."""
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend is left alone

    model_dir = ensure_base_model("runs/base")
    model, tokenizer = load_model(model_dir).eval(), load_tokenizer(model_dir)
    prompts = encode_problems(tokenizer, make_arithmetic_task(64, seed=0, split="eval", **task_kwargs(model_dir)))[0]
    engines = [("torch fp32 (KV cache)", EngineSpec()), ("torch fp32 exact", EngineSpec(exact=True)),
               ("torch fp16", EngineSpec(dtype="fp16")), ("torch bf16", EngineSpec(dtype="bf16")),
               ("torch int8 weights", EngineSpec(quant="int8")), ("torch fp8-e4m3 weights", EngineSpec(quant="fp8"))]
    engines += [("vLLM fp32", "fp32"), ("vLLM bf16", "bf16")] if vllm_available() else []
    lines = ["== 1. measured mismatch of each sampler engine vs the fp32 trainer (64 prompts x 4 samples) =="]
    print("\n" + lines[0])
    for label, spec in engines:
        sampler = (TorchSampler(model, spec, tokenizer) if isinstance(spec, EngineSpec)
                   else VLLMSampler(model_dir, dtype=spec, seed=0, tokenizer=tokenizer))
        ro = sampler.sample(prompts, 4, 5, 1.0, None, torch.Generator().manual_seed(0))
        del sampler  # vLLM: one engine per process at a time
        with torch.no_grad():
            m = mismatch_metrics(sequence_logprobs(model, ro)[0], ro.logp_infer, ro.mask)  # TIM: the same tokens
        lines.append(f"{label:<24} k3 {m['k3']:<9.3g} mean |Δlogp| {m['abs_diff']:<9.3g} "
                     f"max |Δlogp| {m['max_abs_diff']:.3g}")
        print(lines[-1])
    lines.append(f"== 2. policy lag: sampler synced every {sync_every} steps vs every step, {steps} steps, "
                 f"{len(seeds)} paired seeds: held-out trainer pc at step 0 -> after the last step, mean ± sd over "
                 f"the seeds (sd with Bessel's correction) ==")
    print("\n" + lines[-1])
    base = RLConfig(steps=steps, sync_every=sync_every, eval_every=max(steps // 4, 1), out_dir=out,
                    topk=0)  # sc_tis over all V, as README's demo output was run
    arms = [("synced control (k=1, none)", {"correction": "none", "sync_every": 1})]
    arms += [(f"{c} (k={sync_every})", {"correction": c}) for c in ("none", "tis", "sc_tis")]
    fig = Figure(figsize=(7.5, 4))
    ax = fig.subplots()
    for i, (label, change) in enumerate(arms):
        runs = [run(dataclasses.replace(base, name=f"arm{i}_s{s}", seed=s, **change)) for s in seeds]
        evals = [[r for r in rs if "pc_trainer" in r] for rs in runs]
        pc = torch.tensor([[r["pc_trainer"] for r in e] for e in evals], dtype=torch.float64)  # (seeds, evals)
        sd = pc.std(0) if len(seeds) > 1 else torch.zeros(pc.shape[1], dtype=torch.float64)
        lines.append(f"{label:<28} pc {float(pc[:, 0].mean()):.3f} -> {float(pc[:, -1].mean()):.3f} "
                     f"± {float(sd[-1]):.3f}")
        print(lines[-1])
        x = [r["step"] for r in evals[0]]
        ax.plot(x, pc.mean(0), marker="o", ms=3, label=label)
        ax.fill_between(x, pc.mean(0) - sd, pc.mean(0) + sd, alpha=0.15)
    ax.set(title=f"policy lag k={sync_every}: mean and ± 1 sd over {len(seeds)} seeds", xlabel="optimizer step",
           ylabel="held-out probability of the exact answer (pc)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(out).mkdir(parents=True, exist_ok=True)
    fig.savefig(Path(out) / "demo.png", dpi=110)
    write_atomic(Path(out) / "demo.md", "\n".join(lines) + "\n")
    print(f"\nwrote {out}/demo.md, {out}/demo.png and {out}/arm<i>_s<seed>/; paired intervals and verdicts: "
          "python experiments.py compare --help")


# ---------------------------------------------------------------------------------------------------------------
# ---- interop: TRL ----
# The weight-style corrections ride through TRL's GRPOTrainer, which multiplies its per-token PPO loss by
# inputs["importance_sampling_ratio"] (TRL 1.16, vLLM on, a token_* mode). Score centering cannot: it needs the
# sampler's top-k log-probs, which TRL does not request from vLLM. COPC cannot: it needs a critic. DPPO cannot: its
# mask depends on the current log-prob's gradient direction, not on a weight fixed at generation time. OPSM and
# CISPO are TRL's own (off_policy_mask_threshold, loss_type="cispo"); the k2 term is a loss, not a weight.

TRL_CORRECTIONS = {"tis": tis_weights, "mis": mis_weights, "seq_tis": seq_tis_weights,
                   "seq_mask": seq_mask_weights, "geo": geo_mask_weights, "cis": cis_weights, "dlc": dlc_weights,
                   "tis_sn": lambda p_old, q, m: self_normalize_weights(tis_weights(p_old, q, m), m)} | RS_ARMS


def trl_weights(correction: str, old_per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor,
                completion_mask: torch.Tensor) -> torch.Tensor:
    """A tim_rl weight from TRL's tensors (trainer-engine p_old, vLLM's q, int mask). (B, T) -> (B, T) detached.

    TRL pads sampling log-probs with 0 and marks positions vLLM gave none with NaN: those get the correction's
    documented value for a non-finite token.
    """
    _check_choice("correction", correction, sorted(TRL_CORRECTIONS))  # the weights that ride through TRL
    return TRL_CORRECTIONS[correction](old_per_token_logps.detach().float(), sampling_per_token_logps.float(),
                                       completion_mask.bool())


def check_trl_args(args) -> None:
    """Refuse GRPOConfig settings under which a tim_rl weight would be silently wrong or ignored (TRL 1.16)."""
    if not getattr(args, "use_vllm", False):
        raise ValueError("use_vllm=False: TRL then has no sampler log-probs, so no tim_rl weight would be applied")
    if getattr(args, "loss_type", None) == "vespo":
        raise ValueError("loss_type='vespo' takes log(importance_sampling_ratio) and sums it over unmasked "
                         "padding: tim_rl's weights are 0 there (and where a mask drops a token); use "
                         "another loss_type")
    # TRL merges these into vLLM's sampling settings last
    extra = getattr(args, "generation_kwargs", None) or {}
    extra = json.loads(extra) if isinstance(extra, str) else extra
    top_p, top_k, min_p = (extra.get(k, getattr(args, k, None)) for k in ("top_p", "top_k", "min_p"))
    if (top_p if top_p is not None else 1.0) < 1 or (top_k or 0) > 0 or (min_p or 0) > 0:
        raise ValueError("top_p / top_k / min_p truncate sampling: vLLM returns log-probs renormalised over "
                         "the kept tokens, TRL 1.16 computes the trainer's over the full vocabulary, so "
                         "every weight would carry the kept mass S (TRL #6789), and vLLM 0.32 gives TRL no "
                         "kept support to renormalise on; set top_p=1.0, top_k=0, min_p=None (or use "
                         "tim_rl's loop: --top-p, renormalised)")
    if not getattr(args, "vllm_importance_sampling_correction", True):
        raise ValueError("vllm_importance_sampling_correction=False: TRL would compute the tim_rl weight "
                         "and never apply it; set it to True")


def trl_grpo_trainer(correction: str = "tis", vllm_dtype: str | None = None, **trainer_kwargs):
    """trl.GRPOTrainer(**trainer_kwargs) whose vLLM importance weight is a tim_rl correction; logs tim_rl/* metrics.

    - The weight multiplies TRL's per-token loss (clipped PPO on p / p_old, p_old TRL's proximal log-probs), i.e.
      it covers p_old / q as in tim_rl's decoupled-PPO arms. Needs GRPOConfig(use_vllm=True,
      vllm_importance_sampling_mode="token_truncate" or
      "token_mask"); TRL's own sampling/importance_sampling_ratio/* metrics describe TRL's ratio, not this weight.
    - mismatch_metrics(old_per_token_logps, sampling_per_token_logps) are logged as tim_rl/k1, tim_rl/k3, ...
    - vllm_dtype ("fp32" | "bf16" | "fp16") sets vLLM's dtype, which GRPOConfig cannot.
    - On vLLM's CPU build a colocated vLLM is synced with reload_vllm_weights (TRL's per-parameter sync breaks
      there); on a GPU TRL's own sync is kept. loss_type="vespo" and a disabled correction are refused.
    """
    import unittest.mock

    import trl.generation.vllm_generation as trl_vllm
    from trl import GRPOTrainer

    _check_choice("correction", correction, sorted(TRL_CORRECTIONS))  # the weights that ride through TRL
    if "args" in trainer_kwargs:
        check_trl_args(trainer_kwargs["args"])

    class TimRLGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            """TRL's rollout with its importance_sampling_ratio from trl_weights."""
            out = super()._generate_and_score_completions(inputs)
            p_old, q = out.get("old_per_token_logps"), out.get("sampling_per_token_logps")
            if p_old is None or q is None:  # no vLLM, or TRL's correction off: nothing to weight
                return out
            mask = out["completion_mask"]
            out["importance_sampling_ratio"] = trl_weights(correction, p_old, q, mask)  # TIM
            mode = "train" if self.model.training else "eval"
            for key, value in mismatch_metrics(p_old, q, out["completion_mask"].bool()).items():
                self._metrics[mode][f"tim_rl/{key}"].append(value)
            return out

    if vllm_dtype is not None:
        _check_choice("vllm_dtype", vllm_dtype, sorted(_VLLM_DTYPES))
    threads = _vllm_environment()
    # vLLM's class as TRL imported it; with vllm_dtype, pinned for this call
    llm = getattr(trl_vllm, "LLM", None)
    llm = llm if vllm_dtype is None else functools.partial(llm, dtype=_VLLM_DTYPES[vllm_dtype])
    with unittest.mock.patch.object(trl_vllm, "LLM", llm, create=True):
        trainer = TimRLGRPOTrainer(**trainer_kwargs)
    torch.set_num_threads(threads)
    generation = getattr(trainer, "vllm_generation", None)
    if trainer.use_vllm and generation is not None and generation.mode == "colocate" and _vllm_on_cpu():
        # vLLM's CPU build repacks Linear weights, which breaks TRL's per-parameter sync; on a GPU TRL's own sync
        # (PEFT merge, ZeRO-3 gather, sleep-mode wake-up) stays in charge
        generation.sync_weights = lambda: reload_vllm_weights(generation.llm, trainer.model.named_parameters())
    return trainer


# ---------------------------------------------------------------------------------------------------------------
# ---- config dataclasses and input checks ----
# One flat dataclass per concern; every field has a help text, and the CLI builds its flags from them.


def cli_field(default, help: str):
    """A dataclass field with this default and its --help text in the metadata (the CLI reads it)."""
    return field(default=default, metadata={"help": help})


@dataclass
class EngineSpec:
    """The sampler engine's numerics: its own copy of the weights, stored and computed this way."""

    dtype: str = cli_field("fp32", "sampler weight/compute dtype: fp32 | bf16 | fp16")
    quant: str = cli_field("none", "fake-quantised Linear weights (not lm_head): none | int8 | fp8")
    noise: float = cli_field(0.0, "relative weight noise s: w + s * N(0,1) * w, one draw per run (SC paper)")
    noise_seed: int = cli_field(1234, "seed of that noise draw (the same draw is re-applied after every sync)")
    exact: bool = cli_field(False, "zero-mismatch limit: record log-probs with the trainer's own fp32 forward")
    router_fp32: bool = cli_field(False, "MoE: routers' weights and logits in fp32 in a bf16/fp16 engine (slime)")
    router_noise: float = cli_field(0.0, "MoE: relative noise s on the routers' weights only (on top of "
                                         "--noise), drawn like it: a mismatch that flips experts")
    router_jitter: float = cli_field(0.0, "MoE: noise sigma * N(0, 1) on the routers' logits, fresh at every forward")
    head_fp32: bool = cli_field(False, "lm_head and logits in fp32 in a bf16/fp16 engine (TRL cast_lm_head_to_fp32)")


@dataclass
class PretrainConfig:
    """Supervised pre-training of the embedded tiny model on the arithmetic task."""

    out: str = cli_field("runs/base", "model directory written (safetensors + tokenizer)")
    steps: int = cli_field(400, "AdamW steps (400: held-out greedy ~0.7, sampled reward ~0.4: room for RL)")
    batch: int = cli_field(64, "problems per step")
    lr: float = cli_field(1e-3, "AdamW learning rate (cosine to 10%)")
    digits: int = cli_field(2, "operand digits")
    ops: str = cli_field("+", "operators drawn from: + - * and s (swap: 'a s b=' -> 'ba', 2 x digits tokens)")
    seed: int = cli_field(0, "seed of init and data")
    moe: bool = cli_field(False, "a tiny Qwen3-MoE (8 experts, top-2, load-balancing loss), not the Llama")
    mixed_digits: str = cli_field("", "comma-separated digit counts pre-trained in turn ('' = --digits alone)")
    max_positions: int = cli_field(64, "max_position_embeddings (prompt + answer; the swap task: 4 x digits + 4)")


@dataclass
class RLConfig:
    """One RL run: sample -> verify -> advantages -> recompute -> correct -> step -> export/sync."""

    name: str = cli_field("run", "run name: writes runs/<name>/metrics.jsonl")
    model: str = cli_field("runs/base", "HF causal-LM directory (the tiny model is built there if missing)")
    sampler: str = cli_field("torch", "sampler engine: torch | vllm")
    dtype: str = cli_field("fp32", "sampler dtype: fp32 | bf16 | fp16")
    quant: str = cli_field("none", "sampler weight quantisation: none | int8 | fp8")
    noise: float = cli_field(0.0, "sampler relative weight noise s")
    router_noise: float = cli_field(0.0, "MoE sampler: relative noise on the routers' weights only (flips experts)")
    router_jitter: float = cli_field(0.0, "MoE sampler: per-forward noise sigma on the routers' logits (near-ties)")
    exact: bool = cli_field(False, "exact mode: sampler log-probs from the trainer's forward (ratio 1)")
    correction: str = cli_field("none", " | ".join(CORRECTIONS) + " (drift_only: the drift alone, a positive control)")
    steps: int = cli_field(80, "optimizer steps")
    prompts: int = cli_field(16, "prompts per step")
    group: int = cli_field(8, "samples per prompt (G)")
    max_new_tokens: int = cli_field(5, "response length cap")
    temperature: float = cli_field(1.0, "temperature of sampler and trainer (with vLLM (0, 0.01) is refused)")
    top_p: float = cli_field(1.0, "sampler nucleus truncation (vLLM's rule; 1 = off)")
    top_k: int = cli_field(0, "sampler top-k truncation (0 = off; not the recorded --topk)")
    min_p: float = cli_field(0.0, "sampler min-p truncation: keep p >= min_p * max p (0 = off)")
    renormalize: bool = cli_field(True, "with truncation, renormalise the trainer's log-probs on the sampler's "
                                        "kept support (off: full-vocabulary log-probs, every ratio biased by the "
                                        "kept mass S)")
    topk: int = cli_field(32, "sampler top-K ids recorded for score centering (0 = whole vocabulary, 12 V bytes "
                              "per token; the published runs used 0); recorded only for the arms that read them "
                              "(sc, sc_tis, sc_mis, drift_only, --diagnose-drift)")
    support_topk: int = cli_field(64, "vLLM under truncation: log-probs requested per token, whose finite ones are "
                                      "the kept support (0 = all V); where all K are finite the trainer's rebuilt "
                                      "support is used (counted: support_beyond_k)")
    baseline: str = cli_field("group", "advantage baseline: group (GRPO mean, no std) | none (raw reward)")
    optimizer: str = cli_field("adamw", "adamw | sgd")
    lr: float = cli_field(3e-5, "learning rate (1e-4 knocks the tiny model back in Adam's first steps)")
    sync_every: int = cli_field(1, "copy trainer weights into the sampler every k steps (policy lag k - 1)")
    updates_per_batch: int = cli_field(1, "optimizer steps per rollout batch (verl ppo_epochs, TRL num_iterations)")
    export: str = cli_field("rtn", "fp32 -> bf16/fp16 export rounding: rtn | sr | ef")
    loss_on_served: bool = cli_field(False, "Fair Cast: forward on the served weights, step the fp32 master")
    tis_cap: float = cli_field(2.0, "TIS cap C of the token-level weights (tis, ppo, sc_tis)")
    seq_tis_cap: float = cli_field(5.0, "seq_tis: cap on the sequence's importance ratio")
    dlc_lag_cap: float = cli_field(2.0, "DLC: cap on its lag ratio p_prox / p_old")
    mis_low: float = cli_field(0.5, "MIS band low")
    mis_high: float = cli_field(5.0, "MIS band high")
    eps_low: float = cli_field(0.2, "PPO clip low")
    eps_high: float = cli_field(0.28, "PPO clip high")
    dppo_delta: float = cli_field(0.2, "DPPO trust region on |p - q|")
    rs_threshold: float = cli_field(0.01, "rs, rs_seq_max, rs_seq_mean, rs_seq_sum: drop where the divergence estimate "
                                          "exceeds this (verl's K3-RS preset: 0.01)")
    rs_estimator: str = cli_field("k3", "rs arms' per-token estimate of KL(q || p) from log rho: k1 (-log rho) | k2 "
                                        "((log rho)^2 / 2) | k3 (rho - 1 - log rho)")
    opsm_delta: float = cli_field(1e-4, "opsm: drop A < 0 sequences whose mean(logp_infer - logp) exceeds this "
                                        "(slime's --opsm-delta default)")
    k2_coef: float = cli_field(0.0, "add k2_coef * mean((logp - logp_infer)^2 / 2) to the loss (prime-rl: 1e-3)")
    dlc_max_staleness: int = cli_field(0, "DLC: resync once this many steps passed without one (0 = off)")
    dlc_max_lag: float = cli_field(0.0, "DLC: resync when mean |logp - logp at the last sync| exceeds this (0 = off)")
    eval_every: int = cli_field(20, "evaluate at step 0, every N steps and after the last (N <= steps/4)")
    eval_n: int = cli_field(512, "distinct held-out problems per evaluation")
    diagnose_drift: bool = cli_field(False, "log the gradient's drift and signal norms (extra backwards)")
    seed: int = cli_field(0, "seed of sampling, data and noise")
    out_dir: str = cli_field("runs", "parent directory of runs")
    checkpoint_every: int = cli_field(10, "write runs/<name>/checkpoint.safetensors every N steps (0: at the end "
                                          "only); --resume continues from the last one")
    trust_remote_code: bool = cli_field(False, "let transformers run Python code shipped in --model (off: never)")
    progress: bool = cli_field(True, "show a tqdm bar")
    device: str = cli_field("auto", "trainer, TorchSampler and evaluation: auto (cuda if available) | cpu | cuda")
    vllm_gpu_memory: float = cli_field(0.3, "share of GPU memory vLLM takes beside the trainer (GPU only)")
    task: str = cli_field("arithmetic", "arithmetic (the tiny model's) | words (chat word problems, a chat model)")
    task_digits: int = cli_field(0, "arithmetic task's operand digits (0: the model's own, its pretrain.json; a "
                                    "base pre-trained with --mixed-digits serves each of its counts)")
    routing_replay: str = cli_field("none", "MoE: none | r2 (the update replays the experts the policy being "
                                            "updated chose before it) | r3 (the sampler's; torch sampler)")
    gradient_checkpointing: bool = cli_field(False, "transformers' gradient checkpointing (its cost: RESULTS.md)")


def engine_spec(cfg: RLConfig) -> EngineSpec:
    """The torch sampler's engine a run's flags describe (its noise seeded apart from the run's seed)."""
    return EngineSpec(dtype=cfg.dtype, quant=cfg.quant, noise=cfg.noise, noise_seed=cfg.seed + 1234, exact=cfg.exact,
                      router_noise=cfg.router_noise, router_jitter=cfg.router_jitter)


def run_task_kwargs(cfg: RLConfig, model_dir: str | Path) -> dict:
    """The arithmetic task a run trains and evaluates on: the model's own (task_kwargs), --task-digits if set."""
    return task_kwargs(model_dir) | ({"digits": cfg.task_digits} if cfg.task_digits else {})


def _truncates(cfg: RLConfig) -> bool:
    """Whether the run samples from a truncated distribution (top-p, top-k or min-p at a temperature > 0)."""
    return cfg.temperature > 0 and (cfg.top_p < 1 or cfg.top_k > 0 or cfg.min_p > 0)


def _reads_topk(cfg: RLConfig) -> bool:
    """Whether the run's loss or diagnostics read the sampler's top-K log-probs."""
    return arm_of(cfg).reads_topk or cfg.diagnose_drift


SUPPORT_BEYOND_K = ("vLLM returned --support-topk finite log-probs at some positions (the kept support may be "
                    "larger): the trainer renormalises there on the support it rebuilds (metrics: support_beyond_k)")


def recorded_topk(cfg: RLConfig) -> int | None:
    """The top-K the sampler records: cfg.topk for the arms (and diagnostics) that read it, else None (K = 0); vLLM
    under truncation cfg.support_topk, the finite ones of which are its kept support.

    At V = 151,936 all-V records would be 12 bytes x V per token: only a flag set to 0 asks for them.
    """
    if _reads_topk(cfg):
        return cfg.topk
    if cfg.sampler == "vllm" and _truncates(cfg):
        return cfg.support_topk
    return None


# Tensor checks: every public function validates cheaply and names the argument; nothing here is on the hot
# path's inner loop.
def _check_tensor(name: str, x, *, floating: bool = True) -> None:
    """A TypeError naming the argument unless x is a torch.Tensor (of a floating dtype when `floating`)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def _check_choice(name: str, value, choices) -> None:
    """A ValueError naming the argument unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_mask(mask) -> None:
    """A TypeError or ValueError unless mask is a non-empty (B, T) bool tensor."""
    _check_tensor("mask", mask, floating=False)
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True on generated tokens), got dtype {mask.dtype}")
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape (B, T), got {tuple(mask.shape)}")
    if mask.numel() == 0:
        raise ValueError(f"mask is empty (shape {tuple(mask.shape)}): need B >= 1 and T >= 1")


def _check_device(name: str, x, ref_name: str, ref) -> None:
    """x (a tensor or a generator; None passes) must be on ref's device: mixing devices is a ValueError naming both."""
    if x is not None and (x.device.type, x.device.index or 0) != (ref.device.type, ref.device.index or 0):
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}: put both on one device")


def _check_bt(mask, **tensors) -> None:
    """Check the mask and that every named tensor is float with the mask's (B, T) shape, on the mask's device."""
    _check_mask(mask)
    for name, x in tensors.items():
        _check_tensor(name, x)
        if x.shape != mask.shape:
            raise ValueError(f"{name} must have shape (B, T) = {tuple(mask.shape)} like mask, got "
                             f"{tuple(x.shape)}")
        _check_device(name, x, "mask", mask)


def _check_adv(adv, mask) -> torch.Tensor:
    """Advantages may be (B, T), (B, 1) or (B,); returned as a detached (B, T) float tensor, non-finite -> 0."""
    _check_tensor("adv", adv)
    _check_device("adv", adv, "mask", mask)
    B, T = mask.shape
    if adv.shape == (B,):
        adv = adv[:, None]
    if adv.shape not in ((B, T), (B, 1)):
        raise ValueError(f"adv must have shape (B, T) = {(B, T)} or (B, 1) = {(B, 1)}, got "
                         f"{tuple(adv.shape)}")
    adv = adv.detach().float().expand(B, T)
    return torch.where(torch.isfinite(adv), adv, torch.zeros_like(adv))


# Run settings: every rule of RLConfig, PretrainConfig and EngineSpec, checked before anything is built, so a user's
# mistake is one line, not a traceback. _check_values: one value at a time (UsageError); _check_run_config: the
# combinations and what the run would reject later (ValueError); check_cli: the flags that are not config fields
# (--seeds, --model's files, --resume); _check_engine: EngineSpec.
# EngineSpec.quant / RLConfig.quant: weight fake-quantisation (fake_quantize)
QUANTS = ("none", "int8", "fp8")


class UsageError(ValueError):
    """A mistake on the command line: main() prints it as one `tim_rl: error: ...` line and exits with status 2."""


def _flag(name: str) -> str:
    """The command-line flag of a config field: max_new_tokens -> --max-new-tokens."""
    return "--" + name.replace("_", "-")


# Smallest value allowed, and the fields that must be finite and > 0. Keys are config field names; a subcommand or
# config checks the ones it has (batch, digits: PretrainConfig; repeats: experiments.py's BenchConfig).
_CONFIG_MIN = {"steps": 1, "prompts": 1, "group": 1, "max_new_tokens": 1, "eval_every": 1, "eval_n": 1,
               "sync_every": 1, "updates_per_batch": 1, "checkpoint_every": 0, "topk": 0, "temperature": 0,
               "batch": 1, "digits": 1, "repeats": 1, "task_digits": 0, "noise": 0, "router_noise": 0,
               "router_jitter": 0}
_CONFIG_POSITIVE = ("lr", "tis_cap", "seq_tis_cap", "dlc_lag_cap", "mis_high", "dppo_delta", "vllm_gpu_memory")


def _config_choices() -> dict[str, tuple]:
    """The allowed values of each choice field (a function: _DTYPES, TASKS, CORRECTIONS come later)."""
    return {"sampler": ("torch", "vllm"), "dtype": tuple(_DTYPES), "quant": QUANTS, "correction": CORRECTIONS,
            "baseline": ("group", "none"), "optimizer": ("adamw", "sgd"), "export": ("rtn", "sr", "ef"),
            "device": ("auto", "cpu", "cuda"), "task": TASKS, "routing_replay": ("none", "r2", "r3"),
            "rs_estimator": tuple(RS_ESTIMATORS)}


def _check_values(obj) -> None:
    """Raise UsageError, naming the flag, for a value below its minimum or not among its choices (args or config),
    a float flag that is not finite, or a learning rate / cap / band that is not positive."""
    for f in fields(RLConfig):
        value = getattr(obj, f.name, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{_flag(f.name)} must be a finite number, got {value}")
        if f.name in _CONFIG_POSITIVE and value is not None and value <= 0:
            raise UsageError(f"{_flag(f.name)} must be > 0, got {value}")
    for name, low in _CONFIG_MIN.items():
        if getattr(obj, name, low) < low:
            raise UsageError(f"{_flag(name)} must be >= {low}, got {getattr(obj, name)}")
    for name, choices in _config_choices().items():
        if getattr(obj, name, choices[0]) not in choices:
            shown = " | ".join(c for c in choices if c)
            raise UsageError(f"{_flag(name)} must be one of {shown}, got {getattr(obj, name)!r}")


def _check_engine(engine: EngineSpec) -> None:
    """Raise ValueError, naming the field, for an EngineSpec no TorchSampler can build."""
    _check_choice("engine.dtype", engine.dtype, sorted(_DTYPES))
    _check_choice("engine.quant", engine.quant, QUANTS)
    if engine.exact and (engine.dtype != "fp32" or engine.quant != "none" or engine.noise or engine.router_noise
                         or engine.router_jitter):
        raise ValueError("engine.exact needs dtype fp32 without quantisation or noise")


def _check_run_config(cfg: RLConfig) -> None:
    """Raise ValueError naming the flag(s) for a setting the run would reject later, or that would train nothing."""
    _check_values(cfg)
    resolve_device(cfg.device)
    try:
        _check_truncation(cfg.top_p, cfg.top_k, cfg.min_p)
    except ValueError as e:
        raise ValueError("--" + str(e).replace("_", "-", 1)) from None
    # COPC's advantages come from its critic
    group_relative = cfg.baseline == "group" and not arm_of(cfg).critic
    vllm = cfg.sampler == "vllm"
    # its longest answer and <eos>: a product or a swap has 2 x digits, else digits + 1
    task = run_task_kwargs(cfg, cfg.model)
    longest = 1 + max(2 * task["digits"] if op in "*s" else task["digits"] + 1 for op in task["ops"])
    mistakes = [
        (cfg.task == "arithmetic" and cfg.max_new_tokens < longest, (f"--max-new-tokens {cfg.max_new_tokens} "
         f"cannot hold this model's answers ({task['digits']}-digit {task['ops']!r}: up to {longest} with <eos>)")),
        (_truncates(cfg) and not cfg.renormalize and arm_of(cfg).renormalized,
         (f"--no-renormalize applies to the current trainer's sampled-token log-probs only; --correction "
         f"{cfg.correction} also reads logp_old or the top-K log-probs: run it with --renormalize")),
        (cfg.loss_on_served and (cfg.sync_every, cfg.updates_per_batch) != (1, 1), ("--loss-on-served needs "
         "--sync-every 1 and --updates-per-batch 1 (the loss runs on the copy the sampler holds until a sync)")),
        (cfg.export != "rtn" and cfg.dtype != "bf16", (f"--export {cfg.export} rounds the fp32 master to "
         f"bf16: it needs --dtype bf16 (the sampler is {cfg.dtype}; rtn is the only export to fp32 / fp16)")),
        (group_relative and cfg.group == 1, ("--group 1 with --baseline group: each sample is its own group "
         "mean, so every advantage is 0 and nothing trains (use --group >= 2, or --baseline none)")),
        (group_relative and cfg.temperature == 0, ("--temperature 0 samples greedily: a group's samples are "
         "identical, so every advantage is 0 (use --temperature > 0, or --baseline none)")),
        (vllm and not vllm_available(), ("--sampler vllm: vLLM is not installed in this environment (README: "
         "Set-up installs it in its own environment)")),
        (vllm and (cfg.quant != "none" or cfg.noise or cfg.router_noise or cfg.router_jitter or cfg.exact), (
         "--sampler vllm takes --dtype only (no --quant, --noise, --router-noise, --router-jitter or --exact)")),
        (vllm and cfg.routing_replay == "r3", ("--routing-replay r3 replays the sampler's experts, but "
         "VLLMSampler records none (the CPU build returns no routes): use --routing-replay r2 or --sampler torch")),
        (vllm and 0 < cfg.temperature < 0.01, (f"--sampler vllm with --temperature {cfg.temperature}: vLLM "
         "samples at 0.01 while the trainer would score the requested value (use 0.01 or more)")),
        (Path(cfg.out_dir, cfg.name).resolve() == Path(cfg.model).resolve(), (f"--out-dir {cfg.out_dir} "
         f"--name {cfg.name}: that run directory is the --model directory (a run writes config.json there)")),
        (cfg.task == "words" and not _has_chat_template(cfg.model), ("--task words needs a chat model "
         f"(--model DIR with a chat template): {cfg.model} has no chat template")),
    ]
    for bad, message in mistakes:
        if bad:
            raise ValueError(message)


def check_cli(args) -> RLConfig | None:
    """Raise ValueError, naming the flag(s), for a value or combination the run would reject later (or with a
    traceback, or that would train nothing); returns the RL config train (or experiments.py compare) will run."""
    _check_values(args)
    seeds = getattr(args, "seeds", None) or "0"
    if not re.fullmatch(r"-?\d+(,-?\d+)*", seeds) or len({int(s) for s in seeds.split(",")}) <= seeds.count(","):
        raise UsageError(f"--seeds must be comma-separated integers, each listed once, got {seeds!r}")
    model = getattr(args, "model", "runs/base")
    # runs/base is built when missing
    if model != "runs/base" and not (Path(model) / "config.json").is_file():
        found = "a directory without config.json" if Path(model).is_dir() else "no model directory there"
        raise UsageError(f"--model {model}: {found} (expected a Hugging Face causal-LM directory with "
                         "config.json; omit --model to use the embedded tiny model)")
    out_dirs = [("out", getattr(args, "out", None)), ("out_dir", getattr(args, "out_dir", None))]
    if getattr(args, "out_dir", None) and args.cmd == "train":  # the run's own directory
        out_dirs.append(("name", Path(args.out_dir, args.name)))
    for flag, path in out_dirs:  # a file where a directory goes: refused before any training
        path = Path(path or ".")
        existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
        if not existing.is_dir():
            what = "a link to nowhere" if existing.is_symlink() and not existing.exists() else "a file"
            raise UsageError(f"{_flag(flag)} {path}: {existing} is {what}, not a directory")
    resume = getattr(args, "resume", "")
    for need in ("config.json", "checkpoint.safetensors") if resume else ():
        if not (Path(resume) / need).is_file():
            raise UsageError(f"--resume {resume}: no {need} there (expected a run directory written by train)")
    if args.cmd not in ("train", "compare") or getattr(args, "preset", ""):
        return None
    # resume: its config
    saved = json.loads((Path(resume) / "config.json").read_text()) if resume else vars(args)
    cfg = RLConfig(**{f.name: saved[f.name] for f in fields(RLConfig) if f.name in saved})
    _check_run_config(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# ---- CLI ----


def add_config_flags(parser, cls):
    """One --flag per dataclass field, its help text from the field's metadata. Returns the parser."""
    for f in fields(cls):
        help_text = f.metadata.get("help")
        if f.type in ("bool", bool):
            kind = {"action": argparse.BooleanOptionalAction}
        else:
            kind = {"type": {"int": int, "float": float, "str": str}.get(f.type, type(f.default))}
            help_text = help_text.replace("%", "%%") + " (default: %(default)s)"  # argparse formats %
        parser.add_argument(_flag(f.name), default=f.default, help=help_text, **kind)
    return parser


def config_from_args(cls, args):
    """The config dataclass `cls` from the parsed flags of the same names."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line and exit status 2 (no usage block before them)."""

    def error(self, message):
        """Print `prog: error: message` alone and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser():
    """The argparse parser of every subcommand, flags built from the config dataclasses."""
    parser = OneLineParser(prog="tim_rl", description="RL under training-inference mismatch. No "
                                     "subcommand: the default demo (~5 min; first pre-trains the tiny model "
                                     "if needed, ~20 s).")
    sub = parser.add_subparsers(dest="cmd")
    add_config_flags(sub.add_parser("pretrain", help="pre-train the embedded tiny model"), PretrainConfig)
    p_train = add_config_flags(sub.add_parser("train", help="one RL run"), RLConfig)
    p_train.add_argument("--resume", metavar="RUN_DIR", default="",
                         help="continue runs/<name> from its checkpoint, with its config.json (other flags ignored)")
    p_demo = sub.add_parser("demo", help="the default demo")
    p_demo.add_argument("--steps", type=int, default=80)
    p_demo.add_argument("--seeds", default="0,1,2,3,4")
    # listed for --help; main() hands `doctor ...` to _doctor_main, whose own parser reads its arguments
    sub.add_parser("doctor", help="why your trainer and sampler disagree, from your logged tensors: doctor FILE")
    return parser


def eval_warning(cfg: RLConfig) -> str | None:
    """One line when --eval-every gives fewer than 5 evaluations although --steps allows 5 (a coarse pc curve)."""
    count = len(range(0, cfg.steps, cfg.eval_every)) + 1
    if count < 5 <= cfg.steps + 1:
        return (f"tim_rl: warning: --steps {cfg.steps} --eval-every {cfg.eval_every} gives {count} "
                f"evaluations (--eval-every {max(cfg.steps // 4, 1)} gives 5 or more)")


def _train_summary(records: list[dict], out: Path) -> str:
    """A few numbers of a finished run (first and last evaluation, last step) and the files it wrote."""
    step, first, last = [r for r in records if "reward" in r][-1], records[0], records[-1]
    evals = "  ".join(f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in ("acc_trainer", "pc_trainer", "pc_sampler"))
    now = "  ".join(f"{k} {step[k]:.3g}" for k in ("reward", "mm_abs_diff", "grad_norm") if step[k] is not None)
    files = ", ".join(str(out / f) for f in ("metrics.jsonl", "config.json", "checkpoint.safetensors"))
    return f"evaluations (first -> last): {evals}\nstep {step['step']}: {now}\nwrote {files}"


MOVED = ("compare", "bench")  # the lab's subcommands: experiments.py


def main(argv: list[str] | None = None) -> None:
    """`python tim_rl.py [pretrain|train|demo] --help`; no subcommand runs the demo."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:  # the mismatch doctor: its own parser (_doctor_main)
        return _doctor_main(argv[1:])
    parser = _parser()
    if argv[:1] and argv[0] in MOVED:  # one line, not argparse's list of choices
        parser.exit(2, f"tim_rl: error: {argv[0]} moved to experiments.py: python experiments.py {argv[0]} --help\n")
    args = parser.parse_args(argv)
    try:
        cfg = check_cli(args)
    except ValueError as e:  # UsageError, or _check_run_config's
        parser.exit(2, f"tim_rl: error: {e}\n")
    if cfg is not None and eval_warning(cfg):
        print(eval_warning(cfg), file=sys.stderr)
    seeds = getattr(args, "seeds", None) or "0,1,2,3,4"  # demo's
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar per engine between ours
    try:
        if args.cmd == "pretrain":
            print(json.dumps(pretrain(config_from_args(PretrainConfig, args))))
        elif args.cmd == "train":
            print(_train_summary(run(cfg, resume=bool(args.resume)), Path(cfg.out_dir) / cfg.name))
        else:
            demo(steps=getattr(args, "steps", 80), seeds=tuple(int(s) for s in seeds.split(",")))
    except UsageError as e:  # found once the model is loaded (setup_run): still before anything is built
        parser.exit(2, f"tim_rl: error: {e}\n")
    except KeyboardInterrupt:
        where = f"; python tim_rl.py train --resume {Path(cfg.out_dir) / cfg.name}" if args.cmd == "train" else ""
        parser.exit(130, f"tim_rl: interrupted (the last checkpoint is kept{where})\n")


DOCTOR_KEYS = (("old_per_token_logps", "sampling_per_token_logps", "completion_mask"),  # TRL's GRPOTrainer
               ("old_log_probs", "rollout_log_probs", "response_mask"))  # verl's DataProto batch
JSONL_KEYS = tuple((train, infer, "mask") for train, infer, _ in DOCTOR_KEYS)  # a .jsonl without a mask key


def _read_doctor_file(path: Path) -> dict:
    """name -> tensor from .pt (a dict of tensors, torch.load weights_only=True), .safetensors or .jsonl (one JSON
    object per sequence, each key a list over its tokens; rows padded with mask False, and without a mask key each
    row's length is its mask)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if path.suffix == ".pt":
        if path.is_file() and path.stat().st_size == 0:
            raise ValueError("the file is empty")
        try:
            with warnings.catch_warnings():  # torch's own notes on the pickle protocol: the error below says it
                warnings.simplefilter("ignore")
                tensors = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise ValueError("not a dict of tensors torch.load(weights_only=True) reads (a pickled object? save "
                             "{name: tensor})") from None
        if not isinstance(tensors, dict):
            raise ValueError(f"holds a {type(tensors).__name__}, not a dict of named tensors")
        return tensors
    if path.suffix != ".jsonl":
        raise ValueError("expected a .pt, .safetensors or .jsonl file")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    T = max((len(v) for row in rows for v in row.values() if isinstance(v, list)), default=0)
    padded = {k: [row.get(k, []) + [0] * (T - len(row.get(k, []))) for row in rows] for k in (rows or [{}])[0]}
    tensors = {k: torch.tensor(v) for k, v in padded.items()}
    if rows and not any(name[2] in tensors for name in DOCTOR_KEYS):  # no mask: each row's own length
        lengths = torch.tensor([max(len(v) for v in row.values() if isinstance(v, list)) for row in rows])
        tensors["mask"] = torch.arange(T) < lengths[:, None]  # (B, T)
    return tensors


def _doctor_main(argv: list[str]) -> None:
    """`python tim_rl.py doctor FILE [--keys TRAIN,INFER,MASK]`: diagnose_mismatch on a file's tensors, printed;
    an unreadable file, a missing key, a bad shape or dtype is one error line and exit status 2."""
    from safetensors import SafetensorError

    parser = OneLineParser(prog="tim_rl doctor", description="Why trainer and sampler log-probs disagree "
                                     "(TRL / verl tensor names, or --keys; an 'advantages' tensor enables lag).")
    parser.add_argument("file", type=Path, help=".pt, .safetensors or .jsonl")
    parser.add_argument("--keys", default="", help="TRAIN,INFER,MASK: the names of the trainer's log-probs, the "
                        "sampler's and the mask (default: TRL's or verl's names)")
    args = parser.parse_args(argv)
    keys = None
    try:
        tensors = _read_doctor_file(args.file)
        names = [tuple(args.keys.split(","))] if args.keys else [*DOCTOR_KEYS, *JSONL_KEYS]
        if len(names[0]) != 3:
            raise ValueError(f"--keys takes three names, TRAIN,INFER,MASK, got {args.keys!r}")
        keys = next((k for k in names if set(k) <= set(tensors)), None)
        if keys is None:
            named = names if args.keys else DOCTOR_KEYS
            raise ValueError(f"no tensors named {' or '.join(','.join(k) for k in named)} (found: "
                             f"{', '.join(sorted(tensors)) or 'none'}; --keys TRAIN,INFER,MASK names them)")
        train, infer, mask = (tensors[k] for k in keys)
        _check_tensor(f"mask ({keys[2]})", mask, floating=False)
        if mask.dtype != torch.bool and torch.isin(mask, torch.tensor([0, 1])).all():  # TRL / verl keep 0 / 1 ints
            mask = mask.bool()
        print(diagnose_mismatch(train, infer, mask, advantages=tensors.get("advantages")))
    except (OSError, ValueError, TypeError, RuntimeError, EOFError, SafetensorError) as e:
        read_as = f" (read {', '.join(keys)} as logp_train, logp_infer, mask)" if keys else ""
        parser.exit(2, f"tim_rl doctor: error: {args.file}: {str(e).splitlines()[0]}{read_as}\n")


if __name__ == "__main__":
    main()
