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

import contextlib
import copy
import dataclasses
import json
import math
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

if __name__ == "__main__":  # a command-line run: machinery.py sets OpenMP's policy before torch
    import machinery  # noqa: F401

import torch

# Log-ratios are bounded to +-LOG_RATIO_CLAMP where exp is taken: per token for token weights, after
# summing (or averaging) for sequence weights. exp(20) ~ 4.9e8 is beyond every cap and band here, so
# the bound keeps exp() and its gradient finite; it moves a kept weight only below e^-20 ~ 2e-9
# (TRL and slime, unbounded, give e^-30 at log rho = -30).
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
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp(min=1)


def _log_ratio(mask: torch.Tensor, **pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log a/b, ok) for pair = {name_a: a, name_b: b}, checked like _check_bt, detached. (B, T).

    ok = mask & both finite. The log-ratio is 0 where not ok, else raw: a caller clamps it to
    +-LOG_RATIO_CLAMP where it takes exp.

    needs: _check_bt
    """
    _check_bt(mask, **pair)
    a, b = (x.detach() for x in pair.values())
    ok = mask & torch.isfinite(a) & torch.isfinite(b)
    return torch.where(ok, a - b, torch.zeros_like(a)), ok


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk_rows=None, fused=None):
    """log_softmax(logits.float(), -1).gather(-1, ids) in float32. (..., V), (...) -> (...).

    log p_v = z_v - logsumexp(z). ids may carry a trailing K axis, (..., K) -> (..., K), for the
    sampler's top-k ids. Computed by chunks of chunk_rows rows (_TokenLogprobs), so no second
    full-size float32 copy of the logits is made, not even of a strided slice such as
    logits[:, :-1]. fused (default: on CUDA where torch.compile works): one compiled pass per chunk
    (machinery.py). Differentiable, with finite gradients wherever a row has a finite logit; on
    CUDA repeated ids make the gradient's scatter_add order-dependent.

    needs: _TokenLogprobs, _check_tensor, CHUNK_BYTES, GPU_CHUNK_BYTES
    """
    _check_tensor("logits", logits)
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        got = getattr(ids, "dtype", type(ids).__name__)
        raise TypeError(f"ids must be an int64 or int32 tensor of token ids, got {got}")
    if ids.device != logits.device:
        raise ValueError(f"ids on {ids.device}, logits on {logits.device}: put both on one device")
    lead, V = tuple(logits.shape[:-1]), logits.shape[-1]
    ids_k = ids.long()[..., None] if ids.shape == lead else ids.long()  # (..., K); one id: K = 1
    if ids_k.shape[:-1] != lead:
        raise ValueError(f"ids must have shape {lead} or {lead} + (K,), got {tuple(ids.shape)}")
    if bool(((ids_k < 0) | (ids_k >= V)).any()):  # one host sync per call
        raise ValueError(f"ids must be token ids in [0, {V}) (the logits' last axis), got min "
                         f"{int(ids_k.min())}, max {int(ids_k.max())}")
    K = ids_k.shape[-1]
    try:
        blocks = [(logits.view(-1, V), ids_k.reshape(-1, K))]  # (N, V): a view, or a RuntimeError
    except RuntimeError:  # a strided slice such as logits[:, :-1]: a (T, V) view per leading index
        blocks = [(x.reshape(-1, V), i.reshape(-1, K)) for x, i in zip(logits, ids_k)]
    if fused or (fused is None and logits.device.type == "cuda"):
        from machinery import fused_token_logprobs  # compiled passes, imported where they run

        out = [fused_token_logprobs(x, i, chunk_rows, probe=fused is None) for x, i in blocks]
    else:
        budget = GPU_CHUNK_BYTES if logits.device.type == "cuda" else CHUNK_BYTES
        rows = chunk_rows or max(1, budget // (4 * V))
        out = [_TokenLogprobs.apply(x, i, rows) for x, i in blocks]  # (n, K) each
    return torch.stack(out).view(ids.shape)


def log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp <= 0, stable at both ends (Maechler 2012). Same shape.

    needs: nothing
    """
    logp = logp.clamp(max=0.0)
    near_zero = logp > -math.log(2.0)
    return torch.where(near_zero, torch.log(-torch.expm1(logp)), torch.log1p(-torch.exp(logp)))


# Tensor checks: every public function validates cheaply and names the argument.
def _check_tensor(name: str, x, *, floating: bool = True) -> None:
    """A TypeError naming the argument unless x is a torch.Tensor (floating-point if `floating`)."""
    if not isinstance(x, torch.Tensor) or (floating and not x.is_floating_point()):
        kind = "a floating-point torch.Tensor" if floating else "a torch.Tensor"
        raise TypeError(f"{name} must be {kind}, got {getattr(x, 'dtype', type(x).__name__)}")


def _check_device(name: str, x, ref_name: str, ref) -> None:
    """A ValueError naming both unless x (a tensor or generator; None passes) is on ref's device."""
    here = None if x is None else (x.device.type, x.device.index or 0)  # "cuda" is "cuda:0"
    if here not in (None, (ref.device.type, ref.device.index or 0)):
        raise ValueError(f"{name} on {x.device}, {ref_name} on {ref.device}: "
                         "put both on one device")


def _check_choice(name: str, value, choices) -> None:
    """A ValueError naming the argument unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_bt(mask, **tensors) -> None:
    """A TypeError or ValueError naming the argument unless mask is a non-empty (B, T) bool tensor
    and each named tensor a floating-point one of its shape on its device.

    needs: _check_tensor
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = getattr(mask, "dtype", type(mask).__name__)
        raise TypeError(f"mask must be a bool tensor (True on generated tokens), got {got}")
    if mask.dim() != 2 or mask.numel() == 0:
        raise ValueError(f"mask must be a non-empty (B, T) tensor, got shape {tuple(mask.shape)}")
    shape = tuple(mask.shape)
    for name, x in tensors.items():
        _check_tensor(name, x)
        if x.shape != mask.shape:
            raise ValueError(f"{name} must have shape (B, T) = {shape}, got {tuple(x.shape)}")
        if x.device != mask.device:
            raise ValueError(f"{name} on {x.device}, mask on {mask.device}: put both on one device")


def _check_adv(adv, mask, name: str = "adv") -> torch.Tensor:
    """Advantages (B, T), (B, 1) or (B,) as a detached (B, T) float tensor; non-finite -> 0.

    Also per-token weights (name="weights"). The caller checks mask first.

    needs: _check_bt
    """
    if isinstance(adv, torch.Tensor) and adv.shape in (mask.shape[:1], (len(mask), 1)):
        adv = adv.reshape(-1, 1).expand(mask.shape)  # one advantage per sequence, a view
    _check_bt(mask, **{name: adv})
    return adv.detach().float().nan_to_num(0.0, 0.0, 0.0)


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
    x, V = logits.float(), logits.shape[-1]
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
    lr = log_ratio[ok].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).double()  # (N,)
    n_mask = int(mask.sum())
    out = {"n_tokens": float(n_mask), "frac_nonfinite": (n_mask - lr.numel()) / max(n_mask, 1)}
    lr = lr if lr.numel() else lr.new_zeros(1)  # no token measured: the statistics of r = 1
    r = lr.exp()
    ess = r.sum().square() / (r.numel() * r.square().sum())
    return out | {"k1": float((-lr).mean()), "k2": float((lr.square() / 2).mean()),
                  "k3": float((r - 1 - lr).mean()), "abs_diff": float(lr.abs().mean()),
                  "max_abs_diff": float(lr.abs().max()), "mean_log_ratio": float(lr.mean()),
                  "chi2": float(r.square().mean() - 1), "ess": float(ess),
                  "ratio_min": float(r.min()), "ratio_max": float(r.max())}


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

    needs: _check_bt
    """
    routes = logp_old_sampler_routes
    gates = None if routes is None else logp_old_sampler_gates  # gates split the routes' part
    inputs = {"logp": logp, "logp_old": logp_old, "logp_infer": logp_infer,
              "logp_master_old": logp_master_old, "log_kept_mass": log_kept_mass,
              "logp_old_sampler_routes": routes, "logp_old_sampler_gates": gates}
    _check_bt(mask, **{name: x for name, x in inputs.items() if x is not None})
    # from the trainer's log-prob down to the sampler's, each naming the part below it
    chain = [("truncation", None if log_kept_mass is None else logp + log_kept_mass),
             ("lag", logp), ("rounding", logp_master_old),
             ("numerics" if routes is None else "routing", logp_old),
             ("gates_and_numerics" if gates is None else "gates", routes),  # router noise: gates
             ("numerics", gates), ("", logp_infer)]
    names, logps = zip(*[(name, x.detach().double()) for name, x in chain if x is not None])
    ok = mask & torch.stack([torch.isfinite(x) for x in logps]).all(0)  # (B, T)
    n = ok.sum().clamp(min=1)
    parts = [("total", logps[0], logps[-1]), *zip(names, logps, logps[1:])]  # they telescope
    out = {}
    for name, a, b in parts:
        diff = torch.where(ok, a - b, 0.0)
        out |= {f"{name}_mean": float(diff.sum() / n), f"{name}_abs": float(diff.abs().sum() / n)}
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
    layers = ((routes_a >= 0) | (routes_b >= 0)).any((0, 1, 3)).nonzero()[:, 0].tolist()  # MoE ones
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

# Each cause the doctor can name, and what to do about it
DOCTOR_ADVICE = {
    "clean": "nothing to correct: the gap is at fp32 kernel level",
    "numerics": "engine numerics (dtype, kernels, quantised weights): per-token tis / mis / icepop;"
                " an fp16 sampler shrinks a bf16 engine's share [9], not a quantised one's",
    "truncation": "top-p / top-k renormalised by the sampler only: renormalize_on_support, or raw "
                  "sampler log-probs",
    "temperature": "temperature applied on one side only: divide the trainer's logits by it too",
    "misaligned": "log-probs shifted by one position: check logits[:, :-1] / labels[:, 1:]",
    "padding": "the gap sits at the mask's edge: the mask is off by one (a prompt token or pad)",
    "lag": "the policy moved since sampling: sync more often, or a lag-aware arm (ppo, dppo, mis)",
    "outliers": "a few sequences carry the gap (a stale request, another checkpoint?): seq_mask / "
                "seq_tis",
    "routing": "MoE experts flip where the gap is largest: routing replay (r3) or fp32 routers",
}
DOCTOR_CAUSES = tuple(DOCTOR_ADVICE)


class Diagnosis:
    """diagnose_mismatch's answer (a plain class: it copies with torch and math alone).

    cause: the most likely one, of DOCTOR_CAUSES; also_possible: not ruled out (present, or
    untestable here); evidence: one dict per signature (name, measures, statistic, threshold,
    verdict: present | absent | cannot tell without <input>); numbers: |d| per token, quantiles
    of sum_t log p/q per sequence, shares beyond the usual caps.
    """

    def __init__(self, cause: str, also_possible: list, evidence: list, advice: str, numbers: dict):
        self.cause, self.also_possible, self.advice = cause, also_possible, advice
        self.evidence, self.numbers = evidence, numbers

    def __str__(self) -> str:
        import machinery  # printing is presentation: the table is formatted there

        return machinery.format_diagnosis(self)

    __repr__ = __str__


def _signature(name: str, measures: str, statistic: float, threshold: float, verdict="") -> dict:
    """One signature: present iff statistic > threshold (nan: absent), unless a verdict is given."""
    return {"name": name, "measures": measures, "statistic": statistic, "threshold": threshold,
            "verdict": verdict or ("present" if statistic > threshold else "absent")}


def _lag_signature(logp_infer, d, ok, advantages) -> dict:
    """A trainer some steps ahead of its sampler moved toward positive-advantage tokens.

    So at equal log q, d is larger in rows with A > 0 than in rows with A < 0. GRPO's advantage is
    one number per sequence, so the row is the unit: a Welch t over the rows' mean d less its fit
    on (1, the row's mean log q), rows weighted by their tokens (the row residuals of a token fit on
    (1, log q, row mean log q): within-row deviations of log q are orthogonal to row constants).
    Counting tokens would read any per-row gap as lag; without the fit, a row's confidence (correct
    rows are surer) would. d is 0 where not ok.
    """
    measures = "t over rows of mean(d - fit on log q), A > 0 vs < 0"
    if advantages is None:
        return _signature("lag", measures, math.nan, 3.0, "cannot tell without advantages")
    n = ok.sum(1).double()  # (B,) tokens per row
    rows = n > 0
    row_adv = torch.where(ok, _check_adv(advantages, ok), 0.0).sum(1).double()[rows] / n[rows]
    row_q = torch.where(ok, logp_infer, 0.0).sum(1).double()[rows] / n[rows]  # (B',)
    row_d = d.sum(1).double()[rows] / n[rows]
    X = torch.stack([torch.ones_like(row_q), row_q], 1)  # (B', 2)
    w = n[rows, None].sqrt()  # (B', 1): least squares weighted by each row's tokens
    residual = row_d - (X @ torch.linalg.lstsq(w * X, w * row_d[:, None]).solution)[:, 0]  # (B',)
    up = residual[row_adv > 0]
    down = residual[row_adv < 0]
    if min(up.numel(), down.numel()) < 2:
        return _signature("lag", measures, math.nan, 3.0, "cannot tell with < 2 rows each side")
    spread = (up.var() / up.numel() + down.var() / down.numel()).sqrt().clamp(min=1e-12)
    return _signature("lag", measures, float((up.mean() - down.mean()) / spread), 3.0)


def diagnose_mismatch(logp_train, logp_infer, mask, *, advantages=None, routes=None,
                      logp_train_topk=None, topk_ids=None) -> Diagnosis:
    """Why trainer (p) and sampler (q) disagree, from their per-token log-probs.

    Every signature's statistic and verdict; the first present one in DOCTOR_CAUSES' order of
    specificity is the cause, the rest also_possible. (B, T) float logp_train / logp_infer, (B, T)
    bool mask; advantages (B, T), (B, 1) or (B,) enables the lag test; routes = (routes_train,
    routes_infer), (B, T, L, k) int, the routing test; logp_train_topk (B, T, K) (the trainer at
    the sampler's top-K ids topk_ids, only shape-checked) the exact truncation test.
    Reconstruction: the rules are this project's, tuned on its own engines (experiments.py
    doctor-eval). Each signature is a small function of d = log p - log q on the usable tokens ok.
    Memory: two or three (B, T) tensors beside the inputs (no (tokens, 3) fit, no float64 copies).

    needs: _check_bt, _check_adv, _log_ratio, LOG_RATIO_CLAMP, Diagnosis, DOCTOR_ADVICE, _signature,
    _lag_signature
    """
    _check_bt(mask, logp_train=logp_train, logp_infer=logp_infer)
    p, q = logp_train.detach().float(), logp_infer.detach().float()
    d, ok = _log_ratio(mask, logp_train=p, logp_infer=q)  # (B, T); d = 0 where not ok
    d.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if not ok.any():
        raise ValueError("mask: no finite token to diagnose")
    n = ok.sum(1)  # (B,) usable tokens per row
    rows = d.abs().sum(1)  # (B,) sum |d| per row
    mean_abs = float(rows.sum() / n.sum())
    worst = rows.topk(max(1, math.ceil(0.05 * rows.numel()))).indices  # the worst 5 % of rows
    # padding: a mask off by one counts a prompt token or a pad, where the two sides hold unrelated
    # numbers; the gap then sits at each row's first or last masked token, not inside
    first = d.gather(1, ok.byte().argmax(1, keepdim=True))[n > 0].abs()  # (B',) |d|, first token
    last = d.gather(1, ok.shape[1] - 1 - ok.flip(1).byte().argmax(1, keepdim=True))[n > 1].abs()
    inner_n = (n - 2).clamp(min=0).sum()  # every row's tokens less its first and last
    inner = float((rows.sum() - first.sum() - last.sum()) / inner_n.clamp(min=1)) + 1e-3
    edge = max(float(first.mean()), float(last.mean().nan_to_num(0.0)))
    # misaligned: log-probs shifted by one position fit log q[t] to log p[t +- 1] far better than to
    # log p[t]; the share of rows (with a gap > 0.05 per token) whose shifted fit is 4x better
    both = ok[:, 1:] & ok[:, :-1]  # (B, T - 1): pairs (t, t + 1) inside the mask
    pairs = both.sum(1)  # (B,)
    shifted = torch.zeros_like(pairs, dtype=torch.bool)
    for t, t_next in ((slice(None, -1), slice(1, None)), (slice(1, None), slice(None, -1))):
        gap = torch.where(both, d[:, t], 0.0).abs_().sum(1)  # (B,)
        fit = torch.where(both, q[:, t] - p[:, t_next], 0.0).abs_().sum(1)
        shifted |= (fit < gap / 4) & (gap > 0.05 * pairs)
    misaligned = float(shifted.sum() / (pairs > 0).sum().clamp(min=1))
    # routing: MoE experts that flip between the two sides make the largest gaps, at the flip and
    # after (attention reads the flipped hidden states). routes = (routes_train, routes_infer), each
    # (B, T, L, k) int: the experts of the forward position that predicts token t
    routing, routing_verdict = math.nan, "cannot tell without routes"
    if routes is not None:
        shapes = [tuple(r.shape) for r in routes]  # two (B, T, L, k)
        if len(shapes) != 2 or shapes[0] != shapes[1] or shapes[0][:2] != ok.shape:
            raise ValueError(f"routes must be (routes_train, routes_infer), each (B, T, L, k), "
                             f"(B, T) = {tuple(ok.shape)}")
        differs = (routes[0].sort(-1).values != routes[1].sort(-1).values).any(-1).any(-1)  # (B, T)
        flipped = differs.cumsum(1) > 0  # from the row's first flip on
        after, before = d[ok & flipped].abs().mean(), d[ok & ~flipped].abs().mean()
        routing, routing_verdict = float(after / before.clamp(min=1e-9)), ""
    # outliers: sequences from another policy (a stale request, another checkpoint) concentrate |d|
    outliers = float(rows[worst].sum() / rows.sum())
    # truncation: a sampler renormalised on its top-p / top-k support records q = p / S on the kept
    # tokens, so p / q = S <= 1 on every token and mean(p / q) = the kept mass; every other cause
    # keeps E_q[p / q] = 1. With the trainer's top-K log-probs (B, T, K), exactly: the share of
    # tokens with p / q < 1 whose p / q is the trainer's mass on a prefix of its sorted top-K
    if logp_train_topk is not None:
        top = logp_train_topk.detach().float().sort(-1, descending=True).values  # (B, T, K)
        if top.shape[:2] != mask.shape or topk_ids is not None and topk_ids.shape != top.shape:
            raise ValueError(f"logp_train_topk / topk_ids must be {tuple(mask.shape)} + (K,)")
        below = ok & (d < -1e-3)
        # log S, the mass of each prefix, rounds to ~1e-6
        hit = below & ((top.logcumsumexp(-1) - d[..., None]).abs().amin(-1) < 2e-4)
        share = float(hit.sum() / below.sum().clamp(min=1))
        truncation = ("share of p/q < 1 equal to a top-K prefix mass", share, 0.5)
    else:
        std, mean = torch.std_mean(d[ok].exp())  # of p / q over the usable tokens
        se = float(std / math.sqrt(n.sum()))
        below_one = 1 - float(mean) - 4 * se
        truncation = (f"1 - mean(p/q) - 4 standard errors ({se:.2g})", below_one, 0.005)
    # temperature: an unapplied temperature tau makes log q = log p / tau + c (c per position), so
    # the least-squares slope of log q on log p is 1 / tau instead of 1
    x, y = (v[ok] - v[ok].mean() for v in (p, q))  # (N,) each, centred
    slope = float(torch.dot(x, y) / torch.dot(x, x).clamp(min=1e-12))
    del x, y  # the doctor keeps few token-sized tensors alive at once
    # numerics: rounding moves log q both ways, so 2 mean(max(d, 0)) estimates mean |d| from the
    # upward side alone, which a renormalised truncation (d <= 0) leaves at 0; over the rows outside
    # the worst 5 % (outliers carry their own gap). Not beside lag: an optimizer step moves log p
    # both ways too (Adam moves every weight by ~lr; on the tiny model one step's gap is symmetric
    # noise 7x bf16's), so nothing in d but its tilt toward the advantages tells the two apart
    kept = ok.index_fill(0, worst, False)  # (B, T)
    upward = float(2 * torch.where(kept, d, 0.0).clamp_(min=0).sum() / kept.sum().clamp(min=1))
    lag = _lag_signature(q, d, ok, advantages)
    # the evidence, in DOCTOR_CAUSES' order of specificity (the first present one is the cause)
    evidence = [
        _signature("padding", "edge mean |d| / (interior mean |d| + 1e-3)", edge / inner, 20.0),
        _signature("misaligned", "share of rows fitting log p[t +- 1] 4x better", misaligned, 0.1),
        _signature("routing", "mean |d| after a flip / before", routing, 3.0, routing_verdict),
        lag,
        _signature("outliers", "share of sum |d| in the worst 5 % of sequences", outliers, 0.6),
        _signature("truncation", *truncation),
        _signature("temperature", "|slope of log q on log p - 1|", abs(slope - 1), 0.02),
        _signature("numerics", "2 mean(max(d, 0)), rows outside the worst 5 %", upward, 5e-4,
                   "cannot tell beside lag" if lag["verdict"] == "present" else ""),
    ]
    clean = mean_abs < 1e-4  # below every real engine seen (fp16: ~1e-3)
    present = [] if clean else [s["name"] for s in evidence if s["verdict"] == "present"]
    cause = "clean" if clean else (present[0] if present else "numerics")  # numerics: unexplained
    untested = [s["name"] for s in evidence if s["verdict"].startswith("cannot")]
    advice = "; ".join(DOCTOR_ADVICE[c] for c in [cause, *present[1:]])  # every cause present
    also = present[1:] + ([] if clean else [f"{name} (not tested)" for name in untested])
    # the numbers: mean / max |d| per token, the mean answer length T, percentiles of per-sequence
    # sum_t d, the shares of tokens and sequences beyond the TIS cap 2 and outside IcePop's [0.5, 2]
    seq = d.sum(1, dtype=torch.float64)[n > 0]  # (B',)
    numbers = {"mean |log p/q| per token": mean_abs, "max |log p/q|": max(d.max(), -d.min()).item(),
               "T, mean answer length (tokens)": float(n[n > 0].double().mean())}
    for k in (0.0, 0.05, 0.5, 0.95, 1.0):
        numbers[f"per-sequence sum log p/q, {k:.0%} percentile"] = float(seq.quantile(k))
    for what, x, count in (("tokens", d, n.sum()), ("sequences", seq, seq.numel())):
        numbers[f"{what} with p/q > 2 (TIS cap)"] = float((x > math.log(2)).sum() / count)
        numbers[f"{what} outside [0.5, 2] (IcePop)"] = float((x.abs() > math.log(2)).sum() / count)
    return Diagnosis(cause, also, evidence, advice, numbers)


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
        malformed = noise.dtype != torch.int32 or noise.shape != x.shape
        if malformed or bool(((noise < 0) | (noise >= cell)).any()):
            raise ValueError(f"noise must be int32 in [0, 2**16) with shape {tuple(x.shape)}")
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
        raise ValueError(f"residual must have shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    _check_device("residual", residual, "x", x)
    target = x + residual
    served = target.to(torch.bfloat16)
    new_residual = target.sub_(served)  # in place, exact (Sterbenz): within half a cell of target
    bad = torch.isnan(new_residual)  # only inf - inf or nan give nan
    served = torch.where(bad, x.to(torch.bfloat16), served)
    return served, new_residual.masked_fill_(bad, 0.0)


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

    needs: nothing
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or len(rewards) == 0:
        got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a tensor of shape (B,) with B >= 1, got {got}")
    B = len(rewards)
    if not isinstance(group_size, int) or group_size < 1 or B % group_size:
        raise ValueError(f"group_size must be a positive int dividing B = {B}, got {group_size!r}")
    r = rewards.detach().float().nan_to_num(0.0, 0.0, 0.0).view(-1, group_size)  # (B / G, G)
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
    # the log-ratio of non-finite tokens is 0, so c = 1 there
    c = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(1 - eps, 1 + eps)
    return torch.where(mask, c, torch.zeros_like(c))


def copc_advantages(values, rewards, logp, logp_infer, mask, gamma=1.0, lam=1.0, eps=0.2):
    """A_t = sum_l (gamma lam)^l c_{t+l} delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t. (B, T).

    COPC [5], advantage side (reconstructed from the abstract): the TD residuals of GAE are weighted
    by the two-sided clipped ratio c_t = clip(p / q, 1 - eps, 1 + eps), so stale continuations
    count less. With p == q it is plain GAE(gamma, lambda). `rewards` is (B,) (paid at the last
    response token) or (B, T). The state after the last masked token is terminal (value 0).
    Returns detached (advantages, value targets V + A), 0 outside the mask.

    needs: _check_bt, _check_device, _check_tensor, copc_residual_weights
    """
    _check_bt(mask, values=values, logp=logp, logp_infer=logp_infer)
    _check_tensor("rewards", rewards)
    _check_device("rewards", rewards, "values", values)
    B, T = mask.shape
    zero = mask.new_zeros(B, T, dtype=torch.float32)
    if rewards.shape == (B,):  # paid at the last response token
        last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask  # (B, T)
        rewards = torch.where(last, rewards.float()[:, None], zero)
    _check_bt(mask, rewards=rewards)  # (B, T) as given, or from (B,)
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
# is passed as `logp_old` is the loss's choice (its row of ARMS): the current p under REINFORCE, the
# proximal p_prox under decoupled PPO.


def tis_weights(logp_old, logp_infer, mask, cap: float = 2.0, low: float = 0.0) -> torch.Tensor:
    """w = clip(rho, low, C): token truncated IS, Yao et al. 2025 [1]. Non-finite -> 0. (B, T).

    low = 0 truncates above only (verl rollout_is="token"); low > 0 is slime's two-sided clip
    (--tis-mode clip, --tis-clip-low low, --tis-clip C).

    needs: _log_ratio, LOG_RATIO_CLAMP
    """
    log_rho, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    w = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(low, cap)
    return torch.where(ok, w, 0.0)


def mis_weights(logp_old, logp_infer, mask, low: float = 0.5, high: float = 5.0):
    """w = rho * 1[low <= rho <= high]: masked IS / IcePop [11], band of [2]. (B, T).

    Non-finite -> 0.

    needs: _log_ratio, LOG_RATIO_CLAMP
    """
    log_rho, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return torch.where(ok & (rho >= low) & (rho <= high), rho, 0.0)


def _sequence_log_ratio(mask, **pair):
    """(sum_t log rho_t, True where every generated token is finite, ok) for pair as _log_ratio's.

    (B, 1), (B, 1), (B, T). The raw log-ratios are summed, as verl, slime and TRL do; a caller
    bounds the sum where it takes exp.
    """
    log_rho, ok = _log_ratio(mask, **pair)
    return log_rho.sum(dim=1, keepdim=True), (ok == mask).all(dim=1, keepdim=True), ok


def seq_tis_weights(logp_old, logp_infer, mask, cap: float = 5.0):
    """w_i = min(prod_t rho_it, C) on every token of sequence i: sequence-level TIS. (B, T).

    Beware: the product shrinks long sequences towards 0 (TRL #5814); geo_mask_weights does not.
    A non-finite token gives its whole sequence weight 0.

    needs: _log_ratio, _sequence_log_ratio, LOG_RATIO_CLAMP
    """
    total, seq_ok, _ = _sequence_log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    w = total.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=cap)  # (B, 1)
    return torch.where(mask & seq_ok, w, 0.0)


def seq_mask_weights(logp_old, logp_infer, mask, low: float = 0.0, high: float = 3.0):
    """w_i = R_i * 1[low <= R_i <= high], R_i = prod_t rho_it: sequence masked IS. (B, T).

    TRL's GRPOTrainer default (1.16: vllm_importance_sampling_mode="sequence_mask", band
    [clip_min, clip_max] = [None (no lower bound), 3.0], edges kept). A non-finite token gives its
    sequence 0 (TRL counts it as ratio 1). The product shrinks long sequences like seq_tis_weights.

    needs: _log_ratio, _sequence_log_ratio, LOG_RATIO_CLAMP
    """
    total, seq_ok, _ = _sequence_log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    seq_rho = total.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # (B, 1)
    return torch.where(mask & seq_ok & (seq_rho >= low) & (seq_rho <= high), seq_rho, 0.0)


def geo_mask_weights(logp_old, logp_infer, mask, low: float = 0.99, high: float = 1.01):
    """w_i = 1[low <= exp(mean_t log rho_it) <= high] on every token of sequence i. (B, T).

    The geometric-mean sequence mask: a length-neutral replacement for the sequence product
    (TRL #5814, NeMo-RL #2269). Non-finite -> 0. Equals verl rollout_rs="seq_mean_k1" with
    rollout_rs_threshold "1/high_1/low" (verl's k1 is log q/p: its literal "low_high" bounds q/p),
    and divergence_seq_mean_mask(..., (1 / high, 1 / low), kl_k1), where |log rho| <= 20.

    needs: _log_ratio, _sequence_log_ratio, LOG_RATIO_CLAMP
    """
    total, seq_ok, _ = _sequence_log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    mean_log_rho = total / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    geo = mean_log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
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
    w = torch.minimum(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp(), cap)  # 1: non-finite
    return torch.where(mask, w, 0.0)


def dlc_weights(logp_old, logp_infer, mask, clamp: float = 1.0):
    """w = exp(clip(d - mean_mask(d), -c, c)), d = logp_old - logp_infer. DLC [3]. (B, T).

    Reconstructed from the abstract of Li, Zhou & Lan ("centres numerical errors"): the persistent
    part of the engine discrepancy (its batch mean) is removed, the rest is a bounded weight in
    [e^-c, e^c]. Non-finite -> 0.

    needs: _log_ratio, masked_mean
    """
    d, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    w = (d - masked_mean(d, ok)).clamp(-clamp, clamp).exp()  # centred, then bounded
    return torch.where(ok, w, 0.0)


def copc_mask(logp_old, logp_infer, mask, low: float = 0.5, high: float = 2.0):
    """m = 1[low <= rho <= high]: COPC's token ratio mask [5] (policy side; reconstructed). (B, T).

    The band of mis_weights as a 0/1 mask (rho >= e^-LOG_RATIO_CLAMP > 0). Non-finite -> 0.

    needs: mis_weights
    """
    return (mis_weights(logp_old, logp_infer, mask, low, high) > 0).float()


def calibrated_clip_bounds(ratio_lowprec, ratio_ref, adv, mask, eps_low=0.2, eps_high=0.28):
    """PPO clip bounds (L, H) for low-precision ratios that clip as the reference does. FP8 [7].

    Reconstructed from the abstract of Chen et al.: L is chosen so that the share of
    negative-advantage tokens with r_lowprec < L equals the share with r_ref < 1 - eps_low; H so
    that P(H) / N(L) on the low-precision ratios equals P(1 + eps_high) / N(1 - eps_low) on the
    reference, with P(H) = sum_{A>0, r<=H} A r and N(L) = sum_{A<0, r>=L} |A| r. Falls back to
    (1 - eps_low, 1 + eps_high) when a side has no tokens. (B, T) -> (float, float).

    needs: _check_adv, _check_bt, _log_ratio
    """
    _, ok = _log_ratio(mask, ratio_lowprec=ratio_lowprec, ratio_ref=ratio_ref)  # checked, finite
    A = _check_adv(adv, mask)
    neg, pos = ok & (A < 0), ok & (A > 0)
    if not neg.any() or not pos.any():
        return 1 - eps_low, 1 + eps_high
    low_neg = ratio_lowprec[neg].double().sort().values  # (N-,)
    n_clipped = int((ratio_ref[neg] < 1 - eps_low).sum())  # what the reference zeroes
    last = math.nextafter(float(low_neg[-1]), math.inf)  # L when every one is clipped
    L = float(low_neg[n_clipped]) if n_clipped < low_neg.numel() else last
    # P(H) = sum_{A>0, r<=H} A r and N(L) = sum_{A<0, r>=L} |A| r
    p_ref = float((A[pos] * ratio_ref[pos]).double()[ratio_ref[pos] <= 1 + eps_high].sum())
    n_ref = float((-A[neg] * ratio_ref[neg]).double()[ratio_ref[neg] >= 1 - eps_low].sum())
    n_low = float((-A[neg] * ratio_lowprec[neg]).double()[ratio_lowprec[neg] >= L].sum())
    if n_ref <= 0 or n_low <= 0:
        return L, 1 + eps_high
    r_pos, order = ratio_lowprec[pos].double().sort()
    cum = (A[pos].double()[order] * r_pos).cumsum(0)  # P(H) at H = each sorted ratio
    # the P mass the low-precision ratios must reach: P(1 + eps_high) / N(1 - eps_low) * N(L)
    reach = torch.nonzero(cum >= p_ref / n_ref * n_low * (1 - 1e-12))
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

    verl's kl_penalty and slime's low_var_kl clamp k3 at 10; kl_k3 does not.

    needs: LOG_RATIO_CLAMP
    """
    return log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp() - 1 - log_rho


def divergence_mask_weights(logp_old, logp_infer, mask, threshold=0.01, estimator=None):
    """m = 1[k(log rho) within threshold] per token: verl rollout_rs="token_k1|k2|k3". (B, T).

    k = estimator(log rho): kl_k1, kl_k2 or kl_k3 (None: kl_k3; K3-RS preset 0.01), each token's
    log rho bounded at +-LOG_RATIO_CLAMP first (verl's SAFETY_BOUND). "Within" is k <= threshold
    for k2, k3; for k1 verl's band on q / p: log lo <= k1 <= log hi with threshold (lo, hi), a lone
    hi meaning (1 / hi, hi). Rejection, not reweighting: kept tokens get weight 1. Non-finite -> 0.

    needs: _divergence, _log_ratio, _within, kl_k1, kl_k3, LOG_RATIO_CLAMP
    """
    estimate, ok, _ = _divergence(logp_old, logp_infer, mask, estimator)
    return (ok & _within(estimate, threshold, estimator)).float()


def _divergence(logp_old, logp_infer, mask, estimator=None):
    """(k(log rho) per token, 0 where not ok; ok; seq_ok: a row's every token ok), log rho bounded.

    (B, T), (B, T), (B, 1). The bound is verl's.
    """
    log_rho, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    estimate = (estimator or kl_k3)(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return torch.where(ok, estimate, 0.0), ok, (ok == mask).all(dim=1, keepdim=True)


def _within(statistic, threshold, estimator):
    """statistic <= threshold, or for kl_k1 verl's band log lo <= statistic <= log hi."""
    if estimator is not kl_k1:
        return statistic <= threshold
    lo, hi = threshold if isinstance(threshold, tuple) else (1 / threshold, threshold)
    return (statistic >= math.log(lo)) & (statistic <= math.log(hi))


def divergence_seq_max_mask(logp_old, logp_infer, mask, threshold=0.01, estimator=None):
    """m_i = 1[max_t k(log rho_it) <= threshold] on every token of sequence i: a veto. (B, T).

    Trust Region Masking (Li et al., arXiv 2512.23075: the error bounds grow with the largest
    per-token divergence, so a sequence with one token outside the region is dropped whole); verl
    rollout_rs="seq_max_k2|k3". Keeps a sequence whose every token divergence_mask_weights keeps
    (so kl_k1, which verl lacks here, is its band). Non-finite -> 0 for the sequence.

    needs: divergence_mask_weights
    """
    kept = divergence_mask_weights(logp_old, logp_infer, mask, threshold, estimator) > 0
    return (mask & (kept | ~mask).all(dim=1, keepdim=True)).float()


def divergence_seq_mean_mask(logp_old, logp_infer, mask, threshold=0.01, estimator=None):
    """m_i = 1[mean_t k(log rho_it) within threshold]: verl rollout_rs="seq_mean_k1|k2|k3". (B, T).

    "Within" and the per-token bound as in divergence_mask_weights. Length-neutral like
    geo_mask_weights (with kl_k1 a band on the geometric mean of q / p). Non-finite -> 0 for the
    sequence.

    needs: _divergence, _log_ratio, _within, kl_k1, kl_k3, LOG_RATIO_CLAMP
    """
    estimate, _, seq_ok = _divergence(logp_old, logp_infer, mask, estimator)
    mean = estimate.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return (mask & seq_ok & _within(mean, threshold, estimator)).float()


def divergence_seq_sum_mask(logp_old, logp_infer, mask, threshold=0.01, estimator=None):
    """m_i = 1[sum_t k(log rho_it) within threshold]: verl rollout_rs="seq_sum_k1|k2|k3". (B, T).

    "Within" and the per-token bound as in divergence_mask_weights. The sum grows with the length,
    so long sequences are dropped first (like the sequence product). Non-finite -> 0 for the
    sequence.

    needs: _divergence, _log_ratio, _within, kl_k1, kl_k3, LOG_RATIO_CLAMP
    """
    estimate, _, seq_ok = _divergence(logp_old, logp_infer, mask, estimator)
    total = estimate.sum(dim=1, keepdim=True)  # (B, 1)
    return (mask & seq_ok & _within(total, threshold, estimator)).float()


def self_normalize_weights(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """w / mean_mask(w): mean 1 over the batch's valid tokens. verl rollout_is_batch_normalize.

    Self-normalised IS trades a bias of order 1/N (the normaliser is itself an estimate) for less
    variance. Under Adam it is nearly a no-op (one scale for the whole batch's gradient). Pass
    sequence weights through self_normalize_seq_weights instead. Non-finite -> 0; all zero stays
    zero. (B, T).

    needs: _check_bt
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
    generated token; non-finite -> 0. An all-masked row is left out of the mean, as verl does
    (slime's mean counts it as a weight 0).

    needs: _check_bt, self_normalize_weights
    """
    _check_bt(mask, weights=weights)
    first = mask.float().argmax(dim=1, keepdim=True)  # (B, 1)
    w_seq = weights.gather(1, first)  # (B, 1): each sequence's weight, one vote each
    w_seq = self_normalize_weights(w_seq, mask.any(dim=1, keepdim=True))
    return torch.where(mask, w_seq, 0.0)


def opsm_mask(logp, logp_infer, adv, mask, delta: float = 1e-4):
    """m_i = 0 iff A_i < 0 and mean_t(logp_infer - logp) > delta, on sequence i: OPSM. (B, T).

    DeepSeek-V3.2's off-policy sequence masking, as TRL (off_policy_mask_threshold: keep A >= 0 or
    seq_kl <= delta) and slime (--use-opsm, --opsm-delta 1e-4) implement it: seq_kl is the k1
    estimate of KL(q || p) on y ~ q, the sampler's log-prob minus the current trainer's, so a bad
    sample the trainer already finds less likely than the sampler did is not pushed further down.
    Positive-advantage sequences are always kept. A non-finite token gets 0 and makes its
    sequence's KL unmeasurable: dropped when A < 0. adv (B, T), (B, 1) or (B,).

    needs: _check_adv, _log_ratio, _sequence_log_ratio
    """
    total, seq_ok, ok = _sequence_log_ratio(mask, logp_infer=logp_infer, logp=logp)  # log q / p
    A = _check_adv(adv, mask)
    seq_kl = total / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    off_policy = (A < 0) & ~(seq_ok & (seq_kl <= delta))  # (B, T)
    return (ok & ~off_policy).float()


# --------------------------------------------------------------------------------------------------
# ---- losses ----
# Scalars, token means over the batch. Loss values of different corrections are not comparable
# with each other: watch reward, accuracy and the mismatch metrics instead.


def pg_loss(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, weights=None):
    """-mean_mask(w * A * logp): REINFORCE with an optional detached per-token weight. (B, T) -> ().

    A non-finite logp inside the mask drops that token (no gradient, no NaN); a non-finite weight
    counts as 0.

    needs: _check_adv, _check_bt, masked_mean
    """
    _check_bt(mask, logp=logp)
    A = _check_adv(adv, mask)
    # a change of measure: no gradient through the weight
    w = mask.float() if weights is None else _check_adv(weights, mask, "weights")
    return -masked_mean(w * A * logp, mask & torch.isfinite(logp))  # a non-finite logp: left out


def ppo_loss(logp, logp_prox, adv, mask, weights=None, eps_low=0.2, eps_high=0.28):
    """-mean_mask(w min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)), r = p / p_prox. [10] -> ().

    Decoupled PPO: the clip is anchored at the proximal policy p_prox, the trainer's own weights
    before the first update on this rollout batch (AReaL; verl's recomputed old_log_prob). The
    behaviour gap p_prox / q (lag + engine numerics) is not in the clip but in `weights` (TIS, MIS,
    CIS, ...). With one update per batch r = 1 and the clip is inert; it bites from the second
    update on (RLConfig.updates_per_batch). Anchoring at the sampler instead (p_prox := q) gives
    the plain "sampler log-probs as pi_old" PPO. Clip-higher 0.28 as in DAPO. A non-finite
    log-ratio drops the token, a non-finite weight counts as 0. (B, T). verl's default dual clip
    (clip_ratio_c = 3) bounds an A < 0 token's loss at 3 |A|; ppo_loss has none.

    needs: _check_adv, _check_bt, _log_ratio, masked_mean, LOG_RATIO_CLAMP
    """
    _, ok = _log_ratio(mask, logp=logp, logp_prox=logp_prox)
    A = _check_adv(adv, mask)
    # a change of measure: no gradient through the weight
    w = mask.float() if weights is None else _check_adv(weights, mask, "weights")
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

    needs: _check_adv, _log_ratio, masked_mean, LOG_RATIO_CLAMP, _score_centering_terms, _check_bt,
    _check_device, _check_tensor
    """
    log_r_y, ok = _log_ratio(mask, logp=logp, logp_infer=logp_infer)
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
    r_y = log_r_y.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # (B, T)
    f_y, coef = _score_centering_terms(r_y, p_head, q_head, cap, band)  # detached
    baseline = (coef * torch.where(torch.isfinite(logp_topk), logp_topk, 0.0)).sum(-1)  # (B, T)
    return -masked_mean(A * (f_y * logp - baseline), ok)  # a non-finite logp: left out


def _score_centering_terms(r_y, p_head, q_head, cap=None, band=None):
    """(f(r_y), coef_v = q_v f(p_v / q_v) - alpha p_v): score centering's weights, [2] App. A.

    The tail beyond the top-k head H is p rescaled to q's tail mass, rho_tail = (1 - sum_H q) /
    (1 - sum_H p), so alpha = rho_tail f(1 / rho_tail). f = 1 (SC), min(r, cap) (SC + TIS) or
    r 1[band] (SC + MIS). r_y (B, T); p_head, q_head (B, T, K) probabilities; all detached.

    needs: LOG_RATIO_CLAMP, TAIL_FLOOR
    """
    q_tail = (1 - q_head.sum(-1)).clamp(min=TAIL_FLOOR)  # (B, T)
    rho_tail = q_tail / (1 - p_head.sum(-1)).clamp(min=TAIL_FLOOR)
    f_y, head, alpha = torch.ones_like(r_y), q_head, rho_tail  # SC alone: f = 1, q f(p/q) = q
    if cap is not None:  # SC + TIS: q f(p/q) = min(p, C q), alpha = min(1, C rho_tail)
        f_y = r_y.clamp(max=cap)
        head, alpha = torch.minimum(p_head, cap * q_head), (cap * rho_tail).clamp(max=1.0)
    elif band is not None:  # SC + MIS: q f(p/q) = p 1[band], alpha = 1[1/hi <= rho_tail <= 1/lo]
        lo, hi = band
        f_y = torch.where((r_y >= lo) & (r_y <= hi), r_y, torch.zeros_like(r_y))
        log_r_head = (p_head.log() - q_head.log()).nan_to_num(nan=0.0)  # (B, T, K)
        r_head = log_r_head.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        head = torch.where((r_head >= lo) & (r_head <= hi), p_head, torch.zeros_like(p_head))
        alpha = ((rho_tail >= 1 / hi) & (rho_tail <= 1 / lo)).float()
    return f_y, (head - alpha[..., None] * p_head).nan_to_num(nan=0.0)  # (B, T), (B, T, K)


def dlc_loss(logp, logp_old, logp_infer, adv, mask, eps_low=0.2, eps_high=0.28, clamp=1.0,
             logp_prox=None, lag_cap=2.0):
    """Decoupled PPO, w = dlc_weights(d) min(p_prox / p_old, lag_cap). DLC [3]. (B, T) -> ().

    Reconstructed from the abstract of Li, Zhou & Lan ("centres numerical errors, clips lag
    ratios"): the engine part d = logp_old - logp_infer gets the centred weight of dlc_weights; the
    staleness part p_prox / p_old (same engine, behaviour -> proximal weights) is truncated at
    lag_cap; the update p / p_prox is PPO-clipped. Each part is bounded on its own, so lag cannot
    use up the budget meant for numerics. logp_prox defaults to logp (one update per batch).

    needs: _check_adv, _check_bt, dlc_weights, _log_ratio, masked_mean, ppo_loss, tis_weights,
    LOG_RATIO_CLAMP
    """
    _check_bt(mask, logp=logp)
    logp_prox = logp.detach() if logp_prox is None else logp_prox
    weights = dlc_weights(logp_old, logp_infer, mask, clamp=clamp)  # TIM: numerics only
    weights = weights * tis_weights(logp_prox, logp_old, mask, cap=lag_cap)  # TIM: staleness only
    return ppo_loss(logp, logp_prox, adv, mask, weights=weights, eps_low=eps_low, eps_high=eps_high)


# exp(80) ~ 5.5e34: finite in float32 (max 3.4e38), even summed over a batch's tokens
DPPO_LOG_RATIO_MAX = 80.0


def dppo_loss(logp, logp_infer, adv, mask, delta=0.2, delta_low=None, delta_high=None):
    """-mean_mask(m r A), r = p / q, m = 0 iff the token already moved > delta toward A. DPPO [8].

    Binary-TV: the trust region is the sampled token's absolute probability shift p - q from the
    behaviour (sampler) policy; only updates that push further out are masked: p - q > delta_high
    when A > 0, p - q < -delta_low when A < 0 (each None: delta; prime-rl dppo_mask_high /
    dppo_mask_low). Otherwise value and gradient are r A and r A grad log p, as prime-rl's, up to
    r = e^DPPO_LOG_RATIO_MAX (where prime-rl's float32 overflows soon after); beyond, both are
    e^DPPO_LOG_RATIO_MAX A (grad log p). Non-finite log-ratio -> token dropped. (B, T) -> ().

    needs: _check_adv, _check_bt, _log_ratio, masked_mean, DPPO_LOG_RATIO_MAX
    """
    log_r, ok = _log_ratio(mask, logp=logp, logp_infer=logp_infer)  # detached
    A = _check_adv(adv, mask)
    logp = torch.where(ok, logp, 0.0)  # a finite exp below, so a finite gradient
    # value r, gradient r grad log p
    ratio = log_r.clamp(max=DPPO_LOG_RATIO_MAX).exp() * (logp - logp.detach()).exp()
    shift = logp.detach().exp() - torch.where(ok, logp_infer.detach(), 0.0).exp()  # p - q
    high = delta if delta_high is None else delta_high
    low = delta if delta_low is None else delta_low
    outside = ((A > 0) & (shift > high)) | ((A < 0) & (shift < -low))
    return -masked_mean(torch.where(outside, 0.0, ratio * A), ok)


def effective_token_weights(loss, logp: torch.Tensor, adv, mask: torch.Tensor) -> torch.Tensor:
    """w_t = -(d loss / d logp_t) N / A_t: what a loss multiplies a token's A grad log p by. (B, T).

    1 for plain REINFORCE, rho for IS, 0 where a clip or mask drops the token; nan where A_t = 0
    (undefined). N is the number of masked tokens (losses are token means). Differentiates only
    back to logp, not into the model. Detached.

    needs: _check_adv, _check_bt
    """
    _check_bt(mask, logp=logp)
    A = _check_adv(adv, mask)
    # materialize_grads: a loss that does not use logp gives 0, not None
    (grad,) = torch.autograd.grad(loss, logp, retain_graph=True, materialize_grads=True)
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

    needs: _check_bt, _log_ratio, masked_mean
    """
    lag, ok = _log_ratio(mask, logp=logp, logp_old=logp_old)
    if max_staleness <= 0 and max_lag <= 0:
        return False  # both triggers off
    # an unmeasurable lag is no reason to trust a stale sampler; then: too stale, or lagging
    if bool((mask & ~ok).any()) or 0 < max_staleness <= staleness:
        return True
    return max_lag > 0 and float(masked_mean(lag.abs(), ok)) > max_lag



def cispo_loss(logp, logp_infer, adv, mask, eps_high: float = 0.28, eps_low=None):
    """-mean_mask(sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp), r = p / q: CISPO. (B, T) -> ().

    arXiv 2506.13585. The ratio is clipped as a detached coefficient, not inside PPO's min: no
    token's gradient is dropped, the confident ones are only scaled down. MiniMax-M1 (and TRL
    loss_type="cispo", whose epsilon_high is the cap itself, 1 + eps_high here) take
    r = p / p_old against the trainer's proximal policy and leave the lower side unclipped; pass
    logp_prox as logp_infer for that. tim_rl's arm passes the sampler's q: one update per batch
    makes p / p_prox identically 1 (plain REINFORCE), while p / q covers the whole gap (lag and
    numerics), so the arm is token TIS with cap 1 + eps_high. eps_low None: no lower clip, as
    MiniMax-M1 and TRL; verl's compute_policy_loss_cispo clips below at 1 - clip_ratio_low (default
    0.2): pass eps_low. Non-finite log-ratio -> token dropped.

    needs: _check_adv, _log_ratio, masked_mean, LOG_RATIO_CLAMP, _check_bt
    """
    log_r, ok = _log_ratio(mask, logp=logp, logp_infer=logp_infer)
    A = _check_adv(adv, mask)
    low = None if eps_low is None else 1 - eps_low
    coef = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(low, 1 + eps_high)  # a weight
    return -masked_mean(coef * A * logp, ok)


def aggregate_loss(per_token, mask, mode: str = "token-mean", norm=None) -> torch.Tensor:
    """One scalar from (B, T) per-token losses: verl loss_agg_mode, TRL loss_type. -> ().

    "token-mean": sum / tokens (every other loss here; verl's default; TRL "bnpo", and "dapo" on
    one process). "seq-mean-token-mean": the mean over sequences of each one's token mean (TRL
    "grpo", GSPO). "seq-mean-token-sum": the mean over sequences of each one's token sum.
    "seq-mean-token-sum-norm": sum / norm, norm default T (verl); TRL "dr_grpo" is norm =
    B * max_completion_length. A sequence with no token is left out of the sequence means, as
    verl (TRL "grpo" counts it as 0). Non-finite or off the mask -> dropped. verl's
    seq-mean-token-mean divides by tokens + 1e-8 (here: tokens), a 1e-8 relative gap.

    needs: _check_choice
    """
    _check_choice("mode", mode, ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm"))
    ok = mask & torch.isfinite(per_token)
    x = torch.where(ok, per_token, 0.0)
    tokens = ok.sum(dim=1)  # (B,)
    if mode == "token-mean":
        return x.sum() / tokens.sum().clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / (mask.shape[1] if norm is None else norm)
    seq = x.sum(dim=1)  # (B,)
    if mode == "seq-mean-token-mean":
        seq = seq / tokens.clamp(min=1)
    return seq.sum() / (tokens > 0).sum().clamp(min=1)


def gspo_loss(logp, logp_old, adv, mask, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """-mean_i mean_t min(s_it A, clip(s_it, 1 - eps_low, 1 + eps_high) A): GSPO. (B, T) -> ().

    Zheng et al., arXiv 2507.18071, in its GSPO-token form: s_i = exp(mean_t log p_it / p_old_it),
    the sequence's length-normalised ratio, as s_it = sg(s_i) p_it / sg(p_it) (value s_i, gradient
    s_i grad log p_it), clipped like PPO but per sequence (the paper's eps: 3e-4, 4e-4), averaged
    over sequences of token means. verl policy_loss "gspo" (log s_i capped at 10); TRL
    importance_sampling_level="sequence" with loss_type "grpo" (uncapped); here |log s_i| <= 20.
    TIM: the arm takes the sampler's q as p_old, and the mean divides engine noise: i.i.d.
    per-token noise of variance sigma^2 in log p/q gives log s_i the variance sigma^2 / T, where
    token TIS gives each token's log-weight sigma^2. A non-finite token drops its sequence.
    logp, logp_old, mask (B, T); adv (B, 1) or (B, T).

    needs: _check_adv, _log_ratio, _sequence_log_ratio, aggregate_loss, LOG_RATIO_CLAMP, _check_bt
    """
    total, seq_ok, ok = _sequence_log_ratio(mask, logp=logp, logp_old=logp_old)  # detached
    A = _check_adv(adv, mask)
    log_s = total / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    logp = torch.where(ok, logp, 0.0)  # a finite exp below, so a finite gradient
    s = log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp() * (logp - logp.detach()).exp()
    surrogate = torch.minimum(s * A, s.clamp(1 - eps_low, 1 + eps_high) * A)
    return -aggregate_loss(surrogate, ok & seq_ok, "seq-mean-token-mean")


def k2_penalty(logp, logp_infer, mask, coef: float = 1e-3):
    """coef mean_mask((logp - logp_infer)^2 / 2): a k2 pull toward the sampler (prime-rl). -> ().

    prime-rl's default loss adds kl_tau (log r)^2 without the 1/2: coef = c is kl_tau = c / 2 (its
    default kl_tau 1e-3 is coef 2e-3). The gradient coef (logp - logp_infer) grad logp moves each
    sampled token's trainer log-prob toward the sampler's, shrinking the mismatch the other terms
    must correct; added to any arm's loss (--k2-coef). Non-finite log-ratio -> token dropped.
    (B, T).

    needs: _check_bt, _log_ratio, masked_mean
    """
    _, ok = _log_ratio(mask, logp=logp, logp_infer=logp_infer)
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
# enable_return_routed_experts). The forced forward is below; the hooks that put it in place of
# each router's forward for one block (machinery.replay_routes) run only for an MoE model.


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
    # (N, E) router logits of the (N, H) positions
    logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
    if getattr(router, "logit_jitter", 0.0):  # TIM: a sampler's fresh router noise: near-tie flips
        noise = torch.randn(logits.shape, generator=router.jitter_generator, device=logits.device)
        logits = logits + router.logit_jitter * noise.to(logits.dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    ids = torch.topk(probs, router.top_k, dim=-1).indices  # (N, k): the live routing
    forced = ids if forced is None else forced.to(ids)  # None: the live routing "forced"
    has_route = (forced >= 0).all(-1, keepdim=True)  # (N, 1); no route (the last token): live
    ids = torch.where(has_route, forced, ids)

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


# --------------------------------------------------------------------------------------------------
# ---- fast paths (chunked log-probs) ----
# What keeps token_logprobs' memory small at a real vocabulary (V = 151,936): row chunks with a
# hand-written backward, never a second (B, T, V) float32 tensor. The compiled single-read GPU
# passes live in machinery.py, imported only where they run; on a CPU these eager chunks are the
# reference.

# Row chunks of at most this many fp32 bytes (4 MiB: ~32 rows at V = 32 000, ~6 at V = 151 936).
CHUNK_BYTES = 4 << 20
# The same on a GPU without the compiled pass (64 MiB: ~110 rows at V = 151 936): fewer launches.
GPU_CHUNK_BYTES = 64 << 20


def _chunk_rows(V: int, device: torch.device) -> int:
    """Rows per eager chunk, at least 1: token_logprobs' rule (written out there to copy alone)."""
    budget = GPU_CHUNK_BYTES if torch.device(device).type == "cuda" else CHUNK_BYTES
    return max(1, budget // (4 * V))
# Rows whose largest logit m has |m| above this keep what lse = m + s lost to rounding (ulp(m) / 2).
FAR_FROM_ZERO = 1024.0


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits)[ids] by row chunks; the backward fills the (N, V) gradient by chunks.

    d/dz_v = 1[v in ids] g - softmax(z)_v sum_k g_k. Saves (logits, ids, lse), no (N, V) tensor:
    autograd's own backward would allocate several. A -inf logit's id gets the same finite gradient
    as autograd's; a non-finite g spoils its own row only.

    needs: FAR_FROM_ZERO
    """

    @staticmethod
    def forward(ctx, logits, ids, chunk_rows):  # (N, V), (N, K) -> (N, K) float32
        """log softmax(logits)[ids] by row chunks; saves (logits, ids, (lse, tail) (N, 2)).

        One code path with and without a gradient, so the trainer's log-probs are bitwise the same
        either way. lse = z_m - log_softmax(z)_m at each row's largest logit m: exact to one
        rounding whatever the other logits are (-inf and finfo.min included). tail = what lse lost
        to rounding where |m| > FAR_FROM_ZERO, else 0, so exp(z - lse - tail) is exact at any row
        offset. Rows of only -inf give nan, as log_softmax.
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
            lse_m = m - log_p_m  # (n, 1)
            tail = torch.where(m.abs() > FAR_FROM_ZERO, -log_p_m - (lse_m - m), 0.0)
            lse[rows] = torch.cat([lse_m, tail], -1)
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


# --------------------------------------------------------------------------------------------------
# ---- task and reward verifier ----
# Model text is data, never code: the verifier uses regular expressions and fractions.Fraction only.
# The task generators (the testbed) live in machinery.py.

MAX_VERIFY_CHARS = 10_000  # extract_answer reads the last 10 000 characters: answers come last
MAX_NUMBER_CHARS = 64  # a longer digit run is no answer here (and int() of huge strings is slow)
# ASCII digits only; no nested quantifiers, so every scan is linear time. A candidate may carry an
# exponent so that "4.7e1" is one candidate (then rejected), not the number 1.
_CANDIDATE = re.compile(r"[-+]?[0-9][0-9,]*(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?(?:/[0-9]+)?")
_NUMBER = re.compile(r"[-+]?[0-9][0-9,]*(?:\.[0-9]+)?(?:/[0-9]+)?")
_THOUSANDS = re.compile(r"[-+]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?(?:/[0-9]+)?")


def extract_answer(text: str) -> str | None:
    """The last \\boxed{...} (balanced), else the number after the last ####, else the last number.

    Reads the last MAX_VERIFY_CHARS characters; linear time. A "number" is a _CANDIDATE match
    (digits, sign, commas, decimals, a/b, an exponent); verify decides if it is acceptable.
    """
    text = text[-MAX_VERIFY_CHARS:] if isinstance(text, str) else ""  # not a str: no answer
    start = text.rfind("\\boxed{")
    if start >= 0:  # one scan from the opener to its balancing brace (unbalanced: the other rules)
        depth, first = 1, start + len("\\boxed{")
        for j in range(first, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[first:j].strip()
    _, hashes, after = text.rpartition("####")  # no ####: after is the whole text
    numbers = _CANDIDATE.findall(after)  # whole candidates: the pattern has no capturing group
    pick = 0 if hashes else -1  # the first number after the last ####, else the last number
    return numbers[pick] if numbers else None


def verify(text: str, answer: str) -> float:
    """1.0 iff extract_answer(text) equals `answer` as a number, else 0.0. Never raises, runs code.

    Where: the last \\boxed{...}, else the first number after the last "####", else the last number.
    Accepted: integers, a leading + or -, decimals (47.0 == 47), thousands groups (1,234), fractions
    a/b as values (6/8 == 0.75), leading zeros (047 == 47); "47.", "47%", "47 apples", "$47" read
    47. Rejected (reward 0): 4.7e1, 12,34, unicode digits (٤٧, full-width), numbers over
    MAX_NUMBER_CHARS, a/0, a non-str text or answer. "4 7" reads as its last number, 7.
    """
    extracted = extract_answer(text)  # None for a non-str text
    if extracted is None or not isinstance(answer, str):
        return 0.0
    values = []  # '1,234' '-47' '+3' '2.50' '3/4' -> Fraction; anything else -> None
    for s in (answer, extracted):
        s = s.strip().rstrip(".")
        thousands = "," not in s or _THOUSANDS.fullmatch(s)  # commas only as thousands separators
        number = len(s) <= MAX_NUMBER_CHARS and _NUMBER.fullmatch(s) and thousands
        try:
            values.append(Fraction(s.replace(",", "")) if number else None)
        except (ValueError, ZeroDivisionError):  # a/0
            values.append(None)
    want, got = values
    return float(want is not None and got == want)


# --------------------------------------------------------------------------------------------------
# ---- model and tokenizer ----
# transformers is imported inside these functions: the math above imports with torch alone. The tiny
# models, the character tokenizer (the testbed) and the HF tokenizer wrapper live in machinery.py.


def load_model(path: str | Path, trust_remote_code: bool = False):
    """An HF causal LM from a local directory in fp32 (safetensors; no remote code unless asked)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                use_safetensors=True, local_files_only=True,
                                                trust_remote_code=trust_remote_code)


def load_tokenizer(directory: str | Path):
    """machinery.CharTokenizer if the directory holds pretrain.json, else machinery.HFTokenizer."""
    import machinery

    own = (Path(directory) / "pretrain.json").exists()  # a tiny model of machinery.pretrain's
    return machinery.CharTokenizer() if own else machinery.HFTokenizer(directory)


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every dropout at 0, in training mode too: nn.Dropout's p and every float
    attribute named *dropout* or *jitter* of its modules and config. Train mode then computes what
    eval mode does, bitwise, and transformers' gradient checkpointing stays on."""
    for part in [getattr(model, "config", None), *model.modules()]:
        for name, value in list(vars(part).items()) if part is not None else ():
            named = "dropout" in name or "jitter" in name or isinstance(part, torch.nn.Dropout)  # p
            if isinstance(value, float) and named:
                setattr(part, name, 0.0)
    return model


# --------------------------------------------------------------------------------------------------
# ---- samplers (torch, vLLM) ----


@dataclass
class Rollout:
    """One batch of sampled responses. Prompts are left-padded to P; responses right-padded to T."""

    prompt_ids: torch.Tensor  # (B, P) long, left-padded with the pad id
    prompt_mask: torch.Tensor  # (B, P) bool, True on real prompt tokens
    response_ids: torch.Tensor  # (B, T) long, the pad id after <eos>
    mask: torch.Tensor  # (B, T) bool, True on generated tokens (<eos> included)
    logp_infer: torch.Tensor  # (B, T) float32, the sampler's log-prob of each sampled token
    topk_ids: torch.Tensor  # (B, T, K) long, the sampler's top-K ids at each position
    logp_topk_infer: torch.Tensor  # (B, T, K) float32, the sampler's log-probs of those ids
    texts: list[str]  # decoded responses
    # (B, T, S) long, -1 padded: the sampler's kept support. None: untruncated, or the engine
    # cannot return it (the loop rebuilds it from the trainer's logits; an empty row too)
    kept_ids: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # (B, T) float32, the sampled one's (None: unknown)
    # (B, P + T, L, k) int16: the experts each MoE layer's router chose at each position, -1 where
    # none (the last sampled token is never fed); None: a dense model, or unknown
    routed_experts: torch.Tensor | None = None
    routed_weights: torch.Tensor | None = None  # (B, P + T, L, k) float32 gate weights (nan: none)

    def to(self, device) -> Rollout:
        """The rollout with every tensor on `device`; routes stay on the CPU (moved per layer)."""
        tensors = {name: x for name, x in vars(self).items() if isinstance(x, torch.Tensor)}
        moved = {name: x.to(device) for name, x in tensors.items() if not name.startswith("routed")}
        return dataclasses.replace(self, **moved)


def left_pad(prompts: list[list[int]], pad_id: int = 0, device="cpu") -> tuple:
    """(ids (B, P) left-padded with pad_id, mask (B, P) True on real tokens) of token-id lists."""
    P = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts], device=device)  # (B, P)
    mask = ids.new_tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts]).bool()  # (B, P)
    return ids, mask


def draw_seed(generator: torch.Generator | None) -> int:
    """One draw in [0, 2^31 - 1) from `generator` (None: torch's default), e.g. a GPU seed."""
    device = generator.device if generator else "cpu"
    return int(torch.randint(0, 2**31 - 1, (), generator=generator, device=device))


@torch.no_grad()
def decode(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
           topk: int | None = 0, generator=None, decode_text=None, eos_id: int | None = None,
           pad_id: int | None = None, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0):
    """KV-cache sampling from softmax(logits / temperature) truncated by min_p, top_k, top_p (greedy
    at 0).

    Records, in float32, the log-probs of the distribution sampled from (temperature applied,
    renormalised over the kept tokens, -inf elsewhere: vLLM's processed log-probs), its entropy, the
    kept support when truncated, and the K most probable ids (topk 0: all V; None: K = 0). A row
    stops at eos_id (the mask includes it); pad_id fills (None: the config's, else eos_id). One host
    sync per token. An MoE model's routers record their experts (R3's routes). -> Rollout
    """
    import machinery  # the MoE hooks

    eos_id = model.config.eos_token_id if eos_id is None else eos_id
    eos_id = eos_id[0] if isinstance(eos_id, (list, tuple)) else eos_id
    if pad_id is None:
        pad_id = eos_id if model.config.pad_token_id is None else model.config.pad_token_id
    device = next(model.parameters()).device
    # TIM: a GPU's sampling noise differs from the CPU's: a generator on `device`, seeded by one
    # host draw per call (not a host copy per token), keeps sampling reproducible for a seed
    if generator is not None and generator.device.type != device.type:
        generator = torch.Generator(device).manual_seed(draw_seed(generator))
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, device)  # (B, P)
    inputs, attention = prompt_ids, prompt_mask.long()  # the prompt, then one token at a time
    cache = None  # the first forward makes a DynamicCache
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)  # (B,)
    truncate = temperature > 0 and (top_p < 1 or top_k > 0 or min_p > 0)
    ids, masks, logps, entropies, tops, kept = [], [], [], [], [], []
    training = model.training  # a checkpointed model in training mode drops its KV cache: eval here
    moe = machinery.routes_experts(model)
    model.eval()
    with machinery.replay_routes(model) if moe else contextlib.nullcontext() as route_log:
        for _ in range(max_new_tokens):
            positions = (attention.cumsum(1) - 1).clamp(min=0)  # 0 at each row's first real token
            out = model(input_ids=inputs, past_key_values=cache, use_cache=True,
                        attention_mask=attention, position_ids=positions[:, -inputs.shape[1] :],
                        logits_to_keep=1)  # the head on the last position only
            cache, logits = out.past_key_values, out.logits[:, -1]  # (B, V)
            scaled = logits.float() / (temperature if temperature > 0 else 1.0)  # (B, V)
            if truncate:  # TIM: the sampled distribution is renormalised over the kept tokens
                keep = truncation_mask(scaled, top_p, top_k, min_p)  # (B, V)
                scaled = scaled.masked_fill(~keep, -math.inf)
            logprobs = torch.log_softmax(scaled, -1)  # (B, V)
            if temperature > 0:  # (B,), on the logits' device: no host copy per token
                token = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)
            else:
                token = logprobs.argmax(-1)
            token = token.masked_fill(finished, pad_id)
            masks.append(~finished)
            ids.append(token)
            logps.append(logprobs.gather(-1, token[:, None]).squeeze(1))
            # (B,) -sum p log p, 0 * -inf read as 0: the whole distribution is at hand only now
            entropies.append(-(logprobs.exp() * logprobs.nan_to_num(neginf=0.0)).sum(-1))
            V = logits.shape[-1]
            K = 0 if topk is None else (min(topk, V) if topk > 0 else V)
            tops.append(logprobs.topk(K, dim=-1))
            finished = finished | (token == eos_id)
            # the one host sync: stop when every row finished; the kept count S sizes the support
            counts = [finished.all().long()] + ([keep.sum(-1).max()] if truncate else [])
            done, *kept_count = torch.stack(counts).tolist()
            if truncate:
                kept.append(support_ids(keep, size=max(kept_count[0], 1)))  # (B, S_t)
            if done:
                break
            inputs = token[:, None]
            attention = torch.cat([attention, attention.new_ones(len(prompts), 1)], 1)
    model.train(training)
    response_ids = torch.stack(ids, 1)  # (B, T)
    routes, gates = machinery.rollout_routes(route_log, len(prompts)) if moe else (None, None)
    decode_text = decode_text or (lambda row: " ".join(map(str, row)))
    texts = [decode_text(row) for row in response_ids.tolist()]
    return Rollout(prompt_ids, prompt_mask, response_ids, torch.stack(masks, 1),
                   torch.stack(logps, 1), torch.stack([t.indices for t in tops], 1),  # (B, T, K)
                   torch.stack([t.values for t in tops], 1), texts,
                   entropy=torch.stack(entropies, 1),
                   kept_ids=torch.stack(_pad_last(kept, -1), 1) if kept else None,  # (B, T, S)
                   routed_experts=routes, routed_weights=gates)


class Forward(NamedTuple):
    """response_forward's result at the T response positions (log-probs renormalised on the kept
    support where there is one; None when logprobs=False asked for the forward alone)."""

    logits: torch.Tensor  # (B, T, V) logits / temperature
    hidden: torch.Tensor  # (B, T, H) the last hidden state
    routes: torch.Tensor | None  # (B, P + T, L, k) the experts each MoE layer used (None: dense)
    logp: torch.Tensor | None = None  # (B, T) log p~ of the sampled tokens
    logp_topk: torch.Tensor | None = None  # (B, T, K) log p~ of topk_ids, -inf off the support
    log_s: torch.Tensor | None = None  # (B, T) log of the kept mass S (None: no kept support)
    rebuilt: torch.Tensor | None = None  # (B, T, S) the support rebuilt from these logits


def response_forward(model, rollout: Rollout, temperature: float = 1.0, params: dict | None = None,
                     routes=None, gates=None, record: bool = True, topk_ids=None,
                     truncation: tuple | None = None, logprobs: bool = True) -> Forward:
    """One forward over prompt + response, the head on the T response positions only; then (unless
    logprobs=False) one token_logprobs pass for the sampled token, the top-K ids and the kept ids.

    `params` (name -> tensor) runs other weights (torch.func.functional_call). An MoE model's
    routers are forced to `routes` and gate weights `gates` (None: live); the experts used come
    back when `record`. The kept support is rollout.kept_ids; truncation = (top_p, top_k, min_p)
    also rebuilds it from the logits (kept_support_from_logits) where the sampler returned none
    (merge_support). Log-probs on it: renormalize_on_support; top-K ids off it get -inf.
    """
    import machinery  # the MoE hooks

    input_ids = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)  # (B, P + T)
    attention = torch.cat([rollout.prompt_mask, torch.ones_like(rollout.mask)], 1).long()
    P, T = rollout.prompt_ids.shape[1], rollout.response_ids.shape[1]
    keep = torch.arange(P - 1, P + T - 1, device=input_ids.device)  # position t predicts token t
    positions = (attention.cumsum(1) - 1).clamp(min=0)  # 0 at each row's first real token
    kwargs = {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions,
              "output_hidden_states": True, "logits_to_keep": keep, "use_cache": False}
    moe = routes is not None or machinery.routes_experts(model)
    # TIM: R2 / R3: an MoE model's routers run routed_router_forward on the given experts
    with (machinery.replay_routes(model, routes, gates, record) if moe
          else contextlib.nullcontext()) as route_log:
        out = torch.func.functional_call(model, params or {}, args=(), kwargs=kwargs)
    logits = out.logits  # (B, T, V)
    if temperature > 0 and temperature != 1.0:  # in place: the head's output is not saved
        logits.div_(temperature)
    used = machinery.stack_routes(route_log, input_ids.shape[0]) if moe and record else None
    hidden = out.hidden_states[-1][:, P - 1 : P + T - 1]  # (B, T, H)
    if not logprobs:  # the forward alone: logits, hidden state and routes
        return Forward(logits, hidden, used)
    kept, rebuilt = rollout.kept_ids, None  # (B, T, S), -1 pads
    if truncation is not None:
        rebuilt = kept_support_from_logits(logits, rollout.response_ids, *truncation)
        kept = merge_support(kept, rebuilt, rollout.mask)[0]
    K = 0 if topk_ids is None else topk_ids.shape[-1]
    ids = [rollout.response_ids[..., None]] + ([] if topk_ids is None else [topk_ids])
    ids += [] if kept is None else [kept.clamp(min=0)]
    both = token_logprobs(logits, torch.cat(ids, -1))  # (B, T, 1 + K + S)
    logp, log_s = both[..., 0], None
    logp_topk = None if topk_ids is None else both[..., 1 : 1 + K]
    if kept is not None:  # p~ = p / S on the kept support
        logp_kept = both[..., 1 + K :].masked_fill(kept < 0, -math.inf)  # (B, T, S)
        logp, log_s = renormalize_on_support(logp, logp_kept)
        if topk_ids is not None:
            on_support = torch.isfinite(rollout.logp_topk_infer)
            logp_topk = torch.where(on_support, logp_topk - log_s[..., None], -math.inf)
    return Forward(logits, hidden, used, logp, logp_topk, log_s, rebuilt)


def support_logprobs(model, rollout: Rollout, temperature: float = 1.0, topk_ids=None,
                     params: dict | None = None, routes=None, gates=None):
    """response_forward's (log p~ (B, T), log p~ of the top-K ids (B, T, K) or None, hidden, log S
    (B, T) or None): renormalised on rollout.kept_ids (none: plain log-probs, log S None)."""
    f = response_forward(model, rollout, temperature, params, routes, gates, record=False,
                         topk_ids=topk_ids)
    return f.logp, f.logp_topk, f.hidden, f.log_s


def sequence_logprobs(model, rollout: Rollout, temperature: float = 1.0, topk_ids=None,
                      params: dict | None = None, routes=None):
    """support_logprobs over the whole vocabulary (no kept support): (logp, logp_topk, hidden)."""
    untruncated = dataclasses.replace(rollout, kept_ids=None)
    return support_logprobs(model, untruncated, temperature, topk_ids, params, routes)[:3]


@torch.no_grad()
def kept_support_from_logits(logits: torch.Tensor, response_ids: torch.Tensor, top_p: float,
                             top_k: int, min_p: float) -> torch.Tensor:
    """The kept support of (B, T, V) logits by the sampler's rule, plus the sampled token: (B, T,
    S), -1 pads.

    By row chunks of token_logprobs' size: truncation_mask's transients are a few chunks, never (B,
    T, V) masks. One host sync per chunk (its kept count).

    needs: _chunk_rows
    """
    B, T, V = logits.shape
    flat, ids = logits.reshape(-1, V), response_ids.reshape(-1, 1)  # (N, V), (N, 1)
    rows = _chunk_rows(V, logits.device)  # token_logprobs' chunks
    parts = []
    for start in range(0, flat.shape[0], rows):
        keep = truncation_mask(flat[start : start + rows].float(), top_p, top_k, min_p)  # (n, V)
        keep.scatter_(-1, ids[start : start + rows], True)  # TIM: the token was sampled, so kept
        parts.append(support_ids(keep))  # (n, S_chunk)
    return torch.cat(_pad_last(parts, -1)).reshape(B, T, -1)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
INT8_MAX = 127.0


def fake_quantize(w: torch.Tensor, quant: str) -> torch.Tensor:
    """Weight fake-quantisation in fp32: int8 per output channel (symmetric) or fp8-e4m3 per matrix.
    (..., O, I); a leading experts dim gives each expert its own scales."""
    if quant == "int8":
        scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / INT8_MAX  # (..., O, 1)
        return (w / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale
    if quant == "fp8":
        # (..., 1, 1): one scale per matrix
        scale = w.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=1e-12) / FP8_E4M3_MAX
        return (w / scale).to(torch.float8_e4m3fn).float() * scale
    raise ValueError(f"quant must be 'int8' or 'fp8', got {quant!r}")


class TorchSampler:
    """A sampler engine in plain torch: its own copy of the weights in the engine's numerics."""

    def __init__(self, model_dir_or_model, engine: EngineSpec | None = None, tokenizer=None):
        import machinery  # the default tokenizer, an MoE's routers

        self.engine = engine or EngineSpec()
        _check_engine(self.engine)
        is_path = isinstance(model_dir_or_model, (str, Path))
        source = load_model(model_dir_or_model) if is_path else model_dir_or_model
        self.model = copy.deepcopy(source).eval().to(_DTYPES[self.engine.dtype])  # the engine dtype
        head = self.model.get_output_embeddings()
        if self.engine.head_fp32 and head.weight is self.model.get_input_embeddings().weight:
            raise ValueError("engine.head_fp32 needs an untied output head (this one is tied)")
        routers = machinery.moe_routers(self.model)
        kept_fp32 = list(routers) if self.engine.router_fp32 else []
        kept_fp32 += [head] if self.engine.head_fp32 else []
        for module in kept_fp32:  # TIM: fp32 weights and inputs (a pre-hook) in a bf16 engine
            module.float().register_forward_pre_hook(lambda _, xs: tuple(x.float() for x in xs))
        # read by routed_router_forward: this copy's routers, the jitter's own stream
        jitter = torch.Generator(head.weight.device).manual_seed(self.engine.noise_seed)
        for router in routers:
            router.logit_jitter, router.jitter_generator = self.engine.router_jitter, jitter
        # the weights the engine's numerics perturb: every nn.Linear's but the lm_head, and an MoE
        # model's routers (Qwen3-MoE: mlp.gate) and experts (gate_up_proj, down_proj: 3-D weights)
        modules = dict(self.model.named_modules())
        self.router_weights = {f"{n}.weight" for n, m in modules.items() if m in routers}
        self.perturbed = set(self.router_weights)
        for name, module in modules.items():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                self.perturbed.add(f"{name}.weight")
            if type(module).__name__.endswith("Experts"):
                self.perturbed |= {f"{name}.{p}" for p, _ in module.named_parameters()}
        self.tokenizer = tokenizer or machinery.CharTokenizer(self.model.config.vocab_size)
        self.load_weights({k: v.detach() for k, v in source.state_dict().items()})

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy exported weights in: the engine's numerics on each tensor in fp32 (quantisation,
        then noise, the same draw every load), then one rounding to the engine dtype.

        Which weights: self.perturbed (int8 scales per expert and output row, fp8 per expert).
        """
        # TIM: everything below is where this engine's numbers start to differ from the trainer's
        noise_gen = torch.Generator().manual_seed(self.engine.noise_seed)
        # every name, a tied head's included, so a model's own state_dict loads
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params |= dict(self.model.named_buffers())
        # one name per tensor suffices
        missing = sorted({n for n, _ in self.model.named_parameters()} - set(state_dict))
        unexpected = sorted(set(state_dict) - set(params))
        if missing or unexpected:
            raise ValueError(f"state_dict: missing {missing}, unexpected {unexpected}")
        # named_modules order: the noise draws in a fixed order
        loaded = {name: target for name, target in params.items() if name in state_dict}
        for name, target in loaded.items():
            w = state_dict[name].detach().to(device=target.device, dtype=torch.float32)  # a copy
            if name in self.perturbed and self.engine.quant != "none":
                w = fake_quantize(w, self.engine.quant)
            scale = self.engine.noise if name in self.perturbed else 0.0
            scale += self.engine.router_noise if name in self.router_weights else 0.0
            if scale:  # the same noise on every device: drawn on the CPU once per load
                noise = torch.randn(w.shape, generator=noise_gen, device="cpu").to(w.device)
                w = w + scale * noise * w
            target.copy_(w)  # TIM: the one rounding to the engine dtype (round to nearest)

    def sample(self, prompts: list[list[int]], n: int = 1, max_new_tokens: int = 5,
               temperature: float = 1.0, topk: int = 0, generator: torch.Generator | None = None,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Rollout:
        """n samples per prompt (consecutive rows); log-probs, top-K and kept support as sampled."""
        tok, expanded = self.tokenizer, [p for p in prompts for _ in range(n)]
        rollout = decode(self.model, expanded, max_new_tokens, temperature, topk, generator,
                         tok.decode, tok.eos_id, tok.pad_id, top_p, top_k, min_p)
        if self.engine.exact:
            # TIM: zero-mismatch limit: score the sampled tokens with the trainer's own fp32 forward
            # (Trainer.logprobs' kernels, shapes and weights), so logp_infer == logp_old bitwise; an
            # MoE model replays the experts the tokens were sampled with (what R3 replays)
            with torch.no_grad():
                scored = response_forward(self.model, rollout, temperature, None,
                                          rollout.routed_experts, topk_ids=rollout.topk_ids)
            rollout.logp_infer = torch.where(rollout.mask, scored.logp, 0.0)
            rollout.logp_topk_infer = scored.logp_topk
        return rollout


# vLLM 0.32 raises a temperature in (0, 0.01) to 0.01 (SamplingParams) and treats < 1e-5 as greedy
VLLM_MIN_TEMPERATURE = 0.01


class VLLMSampler:
    """The same interface over vllm.LLM (the CPU build here, `vllm` on a GPU); in-place weight sync.

    Log-probs come from SamplingParams(logprobs=K) with logprobs_mode="processed_logprobs": those of
    the distribution sampled from (temperature, then top-p / top-k / min-p: -inf off the kept set).
    Prompts go in as token ids, so no tokenizer can disagree. The engine: machinery.vllm_engine;
    in-place sync: machinery.reload_vllm_weights. Rollouts come back on the reference's device (the
    trainer's; none: the CPU).
    """

    def __init__(self, model_dir: str | Path, dtype: str = "fp32", seed: int = 0, tokenizer=None,
                 max_model_len: int | None = None, max_num_seqs: int = 256, gpu_memory: float = 0.3,
                 reference: torch.nn.Module | None = None):
        import machinery  # vLLM's engine and its CPU build's settings

        _check_choice("dtype", dtype, sorted(_DTYPES))
        self.dtype = dtype
        self.tokenizer = tokenizer or load_tokenizer(model_dir)
        self.reference = reference  # a torch model holding what each sync loads: the canary
        self.device = next(reference.parameters()).device if reference is not None else "cpu"
        # gpu_memory: colocated with the trainer on one GPU, vLLM takes this share of its memory
        self.llm = machinery.vllm_engine(model_dir, dtype, seed, max_model_len, max_num_seqs,
                                         gpu_memory)
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """In-place sync of exported weights (vLLM casts them); with a reference, the sync canary
        (machinery.check_vllm_sync: both engines score one held-out answer)."""
        import machinery  # vLLM's reload_weights RPC, its CPU build's expert repacking

        # TIM: the served copy enters vLLM's own kernels here
        machinery.reload_vllm_weights(self.llm, state_dict.items())
        if self.reference is not None:
            machinery.check_vllm_sync(self)

    def sample(self, prompts: list[list[int]], n: int = 1, max_new_tokens: int = 5,
               temperature: float = 1.0, topk: int = 0, generator: torch.Generator | None = None,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Rollout:
        """n samples per prompt (consecutive rows), vLLM's log-probs of each token and top-K ids.

        With truncation the kept support is read off the K processed log-probs (the finite ones).
        topk None: only the sampled token's log-prob (K = 0, kept_ids None: rebuilt by the trainer).
        """
        from vllm import SamplingParams

        import machinery  # vLLM's outputs as tensors

        V, pad_id = self.vocab_size, self.tokenizer.pad_id
        K = 0 if topk is None else (V if topk <= 0 else min(topk, V))
        # one seed per prompt: vLLM seeds completion i of a request with seed + i, so one seed for
        # all would give every prompt's i-th sample the same random stream
        seeds = [draw_seed(generator) if generator is not None else None for _ in prompts]
        _check_truncation(top_p, top_k, min_p)
        if 0 < temperature < VLLM_MIN_TEMPERATURE:
            raise ValueError(f"temperature {temperature} < {VLLM_MIN_TEMPERATURE}: vLLM would "
                             f"sample at {VLLM_MIN_TEMPERATURE}, the trainer at {temperature}")
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, min_p=min_p,
                                 top_k=top_k if temperature > 0 else 1, max_tokens=max_new_tokens,
                                 logprobs=K, seed=seed, skip_special_tokens=False,
                                 stop_token_ids=[self.tokenizer.eos_id]) for seed in seeds]
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        # (B, T) ids, mask, log-probs; (B, T, K) the ranked top-K (-inf where fewer came back)
        response_ids, mask, logp, top_ids, top_logp = machinery.vllm_tensors(outputs, K, pad_id)
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], pad_id)
        kept = None  # TIM: processed log-probs are -inf exactly off the kept support
        if K > 0 and temperature > 0 and (top_p < 1 or top_k > 0 or min_p > 0):  # truncated
            finite = torch.isfinite(top_logp) & mask[..., None]  # (B, T, K), ranked: finite first
            # a row whose K are all finite (K < V: the support may go on) is left empty: rebuilt
            beyond = finite.all(-1, keepdim=True) & (K < V)
            S = max(int(finite.sum(-1).max()), 1)
            kept = top_ids.masked_fill(~finite | beyond, -1)[..., :S]  # (B, T, S)
        # (B, T) -sum p log p (0 * -inf read as 0) when the K are the whole distribution
        entropy = -(top_logp.exp() * top_logp.nan_to_num(neginf=0.0)).sum(-1) if K == V else None
        texts = [self.tokenizer.decode(row.tolist()) for row in response_ids]
        # built on the CPU, returned on the reference's device
        return Rollout(prompt_ids, prompt_mask, response_ids, mask, logp, top_ids, top_logp,
                       texts, kept_ids=kept, entropy=entropy).to(self.device)


# --------------------------------------------------------------------------------------------------
# ---- trainer ----


class Behaviour(NamedTuple):
    """Trainer.behaviour_logprobs' result: (B, T) trainer-engine log-probs (None: not made)."""

    logp_old: torch.Tensor  # on the served weights (R3: on the sampler's experts)
    logp_master_old: torch.Tensor | None  # on the unrounded master at export (None: fp32 export)
    rebuilt: torch.Tensor | None  # (B, T, S) the kept support rebuilt (None: untruncated)
    # MoE only: logp_old on the sampler's experts; the experts (B, P + T, L, k) the served weights
    # chose themselves; those the update replays (None: live; R2 the policy's; R3 the sampler's);
    # logp_old on the sampler's experts and gate weights
    logp_old_sampler_routes: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    update_routes: torch.Tensor | None = None
    logp_old_sampler_gates: torch.Tensor | None = None


class Trainer:
    """fp32 master weights + optimizer; recomputes log-probs; exports the copy the sampler holds."""

    def __init__(self, model, lr: float = 1e-4, optimizer: str = "adamw",
                 export_dtype: str = "fp32", loss_on_served: bool = False, extra_params=()):
        import machinery  # whether the model routes tokens to experts

        _check_choice("export_dtype", export_dtype, sorted(_DTYPES))
        _check_choice("optimizer", optimizer, ("adamw", "sgd"))
        # TIM: dropout off, or every forward would differ from the last and show up as lag; training
        # mode kept, so gradient checkpointing (in training mode only) stays effective
        self.model = without_dropout(model.float()).train()
        self.moe = machinery.routes_experts(self.model)
        # the trainer engine on the weights the sampler holds: logp_old comes from here; its
        # parameters are the served copy (fp32 values of what the sampler holds), no second copy
        self.behaviour = copy.deepcopy(self.model).eval().requires_grad_(False)
        # the unrounded master at the last export: splits export rounding off the ledger
        self.master_at_export = copy.deepcopy(self.model).eval() if export_dtype != "fp32" else None
        params = list(self.model.parameters()) + list(extra_params)
        self.opt = (torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if optimizer == "adamw"
                    else torch.optim.SGD(params, lr=lr))
        self.export_dtype, self.loss_on_served = export_dtype, loss_on_served
        self.residual: dict[str, torch.Tensor] = {}  # error-feedback residuals, fp32
        self._served_leaves: dict[str, torch.Tensor] | None = None

    @property
    def served(self) -> dict[str, torch.Tensor]:
        """The fp32 values the sampler holds (the behaviour copy's parameters; not a copy)."""
        return dict(self.behaviour.named_parameters())

    def support_logprobs(self, rollout: Rollout, topk_ids=None, temperature: float = 1.0,
                         routes=None):
        """support_logprobs under the current weights, with gradient: (logp~, logp_topk~, hidden,
        log S). Fair Cast's loss_on_served runs the forward on fresh leaves holding the served
        (rounded) copy; step routes their gradient to the fp32 master (straight-through).
        `routes` replays an MoE model's experts."""
        leaves = None
        if self.loss_on_served:  # TIM: the forward on the served copy, not on the master
            leaves = {n: v.clone().requires_grad_(True) for n, v in self.served.items()}
        self._served_leaves = leaves
        f = response_forward(self.model, rollout, temperature, leaves, routes, record=False,
                             topk_ids=topk_ids)
        return f.logp, f.logp_topk, f.hidden, f.log_s

    def logprobs(self, rollout: Rollout, topk_ids=None, temperature: float = 1.0, routes=None):
        """(logp, logp_topk, hidden): support_logprobs on the whole vocabulary (no support)."""
        untruncated = dataclasses.replace(rollout, kept_ids=None)
        return self.support_logprobs(untruncated, topk_ids, temperature, routes)[:3]

    @torch.no_grad()
    def behaviour_logprobs(self, rollout: Rollout, temperature: float = 1.0,
                           truncation: tuple | None = None, routing_replay: str = "none"):
        """The trainer engine on the served weights and on the master at export, renormalised on the
        kept support: Behaviour. One forward per model, and an MoE model's replays.

        truncation = (top_p, top_k, min_p): the kept support is also rebuilt from the served
        forward's logits (kept_support_from_logits), used where the sampler returned none
        (merge_support). routing_replay: none | r2 | r3 (Config.routing_replay).
        """
        # MoE: its own experts; truncated: the support rebuilt where the sampler returned none
        forward = response_forward(self.behaviour, rollout, temperature, truncation=truncation)
        logp_old, own_routes, rebuilt = forward.logp, forward.routes, forward.rebuilt
        del forward  # before the next forward's logits
        if rebuilt is not None:  # the same support for the passes below
            merged = merge_support(rollout.kept_ids, rebuilt, rollout.mask)[0]  # (B, T, S)
            rollout = dataclasses.replace(rollout, kept_ids=merged)
        logp_experts = logp_gates = update_routes = None
        experts, gates = rollout.routed_experts, rollout.routed_weights  # the sampler's
        if self.moe and experts is not None:  # TIM: the same weights, the sampler's experts
            logp_experts = support_logprobs(self.behaviour, rollout, temperature, routes=experts)[0]
            if gates is not None:  # TIM: and on the sampler's gate weights: gates
                logp_gates = support_logprobs(self.behaviour, rollout, temperature, routes=experts,
                                              gates=gates)[0]
        if self.moe and routing_replay == "r2":  # TIM: R2: the experts the updated policy chooses
            updated = self.behaviour if self.loss_on_served else self.model  # the update's weights
            update_routes = response_forward(updated, rollout, temperature, logprobs=False).routes
        elif self.moe and routing_replay == "r3":  # TIM: R3: the sampler's experts
            update_routes = experts
            if logp_experts is not None:  # the policy runs on the sampler's experts
                logp_old = logp_experts
        logp_master_old = None
        if self.master_at_export is not None:  # on the experts the update will use
            logp_master_old = support_logprobs(self.master_at_export, rollout, temperature,
                                               routes=update_routes)[0]
        return Behaviour(logp_old, logp_master_old, rebuilt, logp_experts, own_routes,
                         update_routes, logp_gates)

    def grad_leaves(self) -> list[torch.Tensor]:
        """The tensors the last forward ran on: the served leaves (loss_on_served) or the master."""
        leaves = self._served_leaves
        return list(leaves.values()) if leaves is not None else list(self.model.parameters())

    def step(self, loss: torch.Tensor) -> float:
        """Backward and one optimizer step on the fp32 master; returns the gradient norm."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.moe:  # the routes a replayed forward kept for activation checkpointing's recompute
            import machinery

            machinery.release_routes(self.model)
        if self._served_leaves is not None:
            for name, p in self.model.named_parameters():
                p.grad = self._served_leaves[name].grad
            self._served_leaves = None
        params = [p for group in self.opt.param_groups for p in group["params"]]
        norms = [p.grad.norm() for p in params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
        self.opt.step()
        return norm

    @torch.no_grad()
    def export(self, mode: str = "rtn", generator: torch.Generator | None = None):
        """Round the fp32 master to the sampler's dtype (rtn | sr | ef) -> (state dict, visible
        update fraction); the behaviour copy moves to the served weights in place.

        On the CPU the reference roundings, SR with `generator` itself; on a GPU fused passes, SR's
        noise hash_noise16 seeded by one draw from `generator` per tensor (machinery.gpu_rounding).
        """
        if mode not in ("rtn", "sr", "ef"):  # inline: a traced step enters no check function here
            raise ValueError(f"mode must be one of ('rtn', 'sr', 'ef'), got {mode!r}")
        import machinery  # the GPU roundings; fp64 sums of the visible update fraction
        if mode != "rtn" and self.export_dtype != "bf16":
            raise ValueError(f"export mode {mode!r} rounds to bf16, not {self.export_dtype}")
        state, dot, norm2, fp32 = {}, 0.0, 0.0, self.export_dtype == "fp32"
        # the CPU: stochastic_round_bf16 (with `generator`) and error_feedback_round_bf16
        sr, ef = machinery.export_roundings(next(self.model.parameters()).device, generator)
        for name, p in self.model.named_parameters():
            master = p.detach()
            if fp32:
                served = master.clone()
            elif mode == "sr":  # TIM: Fair Cast, unbiased rounding
                served = sr(master)
            elif mode == "ef":  # TIM: Fair Cast, error feedback
                residual = self.residual.get(name, torch.zeros_like(master))
                served, self.residual[name] = ef(master, residual)
            else:  # TIM: round-to-nearest swallows updates below half a cell
                served = master.to(_DTYPES[self.export_dtype])
            served_before = self.behaviour.get_parameter(name)
            if self.master_at_export is not None:  # <d served, d master> / |d master|^2
                master_before = self.master_at_export.get_parameter(name)
                moved = machinery.dot_and_norm2(master, master_before, served, served_before)
                dot, norm2 = dot + moved[0], norm2 + moved[1]
            served_before.copy_(served)  # TIM: the behaviour copy = what the sampler will hold
            state[name] = served
        if self.master_at_export is not None:
            self.master_at_export.load_state_dict(dict(self.model.named_parameters()), strict=False)
        return state, float(dot / norm2) if norm2 > 0 else (1.0 if fp32 else 0.0)


# --------------------------------------------------------------------------------------------------
# ---- experiment loop and ledger ----


RS_ARMS = {"rs": divergence_mask_weights, "rs_seq_max": divergence_seq_max_mask,  # verl rollout_rs
           "rs_seq_mean": divergence_seq_mean_mask, "rs_seq_sum": divergence_seq_sum_mask}
RS_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}  # --rs-estimator -> the per-token estimate


class LossInputs(NamedTuple):
    """What an arm's loss reads: (B, T) log-probs of the sampled tokens, (B, T, K) at top-K ids."""

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
    """One --correction: its loss, what the loop gives it besides the sampled log-probs, metrics."""

    loss: Callable  # (cfg, LossInputs) -> scalar loss
    reads_topk: bool = False  # the sampler's top-K log-probs (recorded only for these arms)
    renormalized: bool = False  # reads logp_old or top-K: needs the trainer renormalised on support
    critic: bool = False  # COPC: a value head gives (B, T) advantages
    resync: bool = False  # DLC: its lag or staleness trigger may sync before --sync-every
    # (cfg, LossInputs) -> {metric: share} of what it drops or clips; reads logp_now, logp_infer,
    # adv and mask only (step_record gives it those of the first update)
    shares: Callable | None = None


def _pg(x: LossInputs, weights=None):
    """REINFORCE on the batch, each token's term times its weight."""
    return pg_loss(x.logp, x.adv, x.mask, weights)


def _ppo(cfg, x: LossInputs, weights=None):
    """Decoupled PPO: the update p / p_prox clipped, the behaviour gap p_prox / q in `weights`."""
    return ppo_loss(x.logp, x.logp_prox, x.adv, x.mask, weights, cfg.eps_low, cfg.eps_high)  # TIM


def _sc(x: LossInputs, cap=None, band=None):
    """Score centering on the sampler's top-K head (with a TIS cap or an MIS band)."""
    topk, topk_infer = x.logp_topk, x.logp_topk_infer
    return score_centering_loss(x.logp, topk, x.logp_infer, topk_infer, x.adv, x.mask, cap, band)


def _calibrated(cfg, x: LossInputs):
    """TIM: ppo_infer with FP8-calibrated bounds [7]; the ratio p/q is the IS weight, no TIS."""
    ratio_low, ratio_ref = (x.logp_now - x.logp_infer).exp(), (x.logp_now - x.logp_old).exp()
    lo, hi = calibrated_clip_bounds(ratio_low, ratio_ref, x.adv, x.mask, cfg.eps_low, cfg.eps_high)
    return ppo_loss(x.logp, x.logp_infer, x.adv, x.mask, eps_low=1 - lo, eps_high=hi - 1)


def _dropped(touched, mask, kind="masked") -> dict[str, float]:
    """Shares of the generated tokens and of the sequences that `touched` (B, T) bool marks."""
    touched = mask & touched
    tokens = touched.sum() / mask.sum().clamp(min=1)
    seqs = touched.any(dim=1).sum() / mask.any(dim=1).sum().clamp(min=1)
    return {f"frac_{kind}_tokens": float(tokens), f"frac_{kind}_seqs": float(seqs)}


def _rs_arm(divergence_weights) -> Arm:
    """A verl rollout_rs arm: rejection only, kept tokens weigh 1 (no rollout_is)."""
    def keep(c, x):
        """The arm's keep mask on the batch: 1 kept, 0 dropped."""
        est = RS_ESTIMATORS[c.rs_estimator]
        return divergence_weights(x.logp_now, x.logp_infer, x.mask, c.rs_threshold, est)
    return Arm(lambda c, x: _pg(x, keep(c, x)),
               shares=lambda c, x: _dropped(keep(c, x) == 0, x.mask))


def _tis(cfg, x: LossInputs, logp=None):
    """TIS weights of `logp` (default: the current trainer) against the sampler, cap --tis-cap."""
    return tis_weights(x.logp_now if logp is None else logp, x.logp_infer, x.mask, cfg.tis_cap)


def _opsm(cfg, x: LossInputs):
    """OPSM's keep mask on the batch."""
    return opsm_mask(x.logp_now, x.logp_infer, x.adv, x.mask, cfg.opsm_delta)


# Every correction (--correction NAME). TIM: REINFORCE has no trust region, so its weight covers the
# whole gap p / q = lag x numerics: the weight gets the current log-prob (detached). The
# decoupled-PPO arms weight the behaviour gap p_prox / q and leave the update p / p_prox to the
# clip.
ARMS = {
    "none": Arm(lambda c, x: _pg(x)),
    # TIM: REINFORCE times min(p / q, C), written out; the rows below use the helpers above
    "tis": Arm(lambda c, x: pg_loss(x.logp, x.adv, x.mask,
                                    tis_weights(x.logp_now, x.logp_infer, x.mask, c.tis_cap))),
    "mis": Arm(lambda c, x: _pg(x, mis_weights(x.logp_now, x.logp_infer, x.mask, c.mis_low,
                                               c.mis_high))),
    "seq_tis": Arm(lambda c, x: _pg(x, seq_tis_weights(x.logp_now, x.logp_infer, x.mask,
                                                       c.seq_tis_cap))),
    "geo": Arm(lambda c, x: _pg(x, geo_mask_weights(x.logp_now, x.logp_infer, x.mask))),
    "cis": Arm(lambda c, x: _ppo(c, x, cis_weights(x.logp_prox, x.logp_infer, x.mask))),
    "ppo": Arm(lambda c, x: _ppo(c, x, _tis(c, x, x.logp_prox))),
    # TIM: the sampler's log-probs as pi_old: the whole gap clipped
    "ppo_infer": Arm(lambda c, x: ppo_loss(x.logp, x.logp_infer, x.adv, x.mask, None, c.eps_low,
                                           c.eps_high)),
    "dppo": Arm(lambda c, x: dppo_loss(x.logp, x.logp_infer, x.adv, x.mask, delta=c.dppo_delta)),
    "sc": Arm(lambda c, x: _sc(x), reads_topk=True, renormalized=True),
    "sc_tis": Arm(lambda c, x: _sc(x, cap=c.tis_cap), reads_topk=True, renormalized=True),
    "sc_mis": Arm(lambda c, x: _sc(x, band=(c.mis_low, c.mis_high)), reads_topk=True,
                  renormalized=True),
    # DLC: the lag p_prox / p_old and the numerics p_old / q corrected apart
    "dlc": Arm(lambda c, x: dlc_loss(x.logp, x.logp_old, x.logp_infer, x.adv, x.mask, c.eps_low,
                                     c.eps_high, logp_prox=x.logp_prox, lag_cap=c.dlc_lag_cap),
               renormalized=True, resync=True),
    "copc": Arm(lambda c, x: _ppo(c, x, copc_mask(x.logp_prox, x.logp_infer, x.mask)), critic=True),
    "calibrated": Arm(_calibrated, renormalized=True),
    # a positive control [2], not a correction: REINFORCE minus its signal part = the drift alone
    "drift_only": Arm(lambda c, x: _pg(x) - _sc(x), reads_topk=True, renormalized=True),
    **{name: _rs_arm(weights) for name, weights in RS_ARMS.items()},
    # TIM: truncate, then self-normalise (verl rollout_is_batch_normalize)
    "tis_sn": Arm(lambda c, x: _pg(x, self_normalize_weights(_tis(c, x), x.mask)),
                  shares=lambda c, x: {"sn_mean_weight": float(masked_mean(_tis(c, x), x.mask))}),
    "opsm": Arm(lambda c, x: _pg(x, _opsm(c, x)),
                shares=lambda c, x: _dropped(_opsm(c, x) == 0, x.mask)),
    # TIM: r = p / q, see cispo_loss; clipped tokens keep their gradient, scaled down
    "cispo": Arm(lambda c, x: cispo_loss(x.logp, x.logp_infer, x.adv, x.mask, c.eps_high),
                 shares=lambda c, x: _dropped(x.logp_now - x.logp_infer > math.log1p(c.eps_high),
                                              x.mask, "clipped")),
    # TIM: the whole sequence's ratio p / q, its log averaged over the tokens, clipped per sequence
    "gspo": Arm(lambda c, x: gspo_loss(x.logp, x.logp_infer, x.adv, x.mask, c.gspo_eps_low,
                                       c.gspo_eps_high)),
}
CORRECTIONS = tuple(ARMS)


def arm_of(cfg) -> Arm:
    """The run's arm, checked: ARMS[cfg.correction]."""
    name = cfg.correction
    if name not in ARMS:
        raise ValueError(f"correction must be one of {' | '.join(ARMS)}, got {name!r}")
    return ARMS[name]


STEP_PHASES = ("sample", "recompute", "loss", "optimizer", "export", "sync")  # sec_<phase> logged


@dataclass
class RunState:
    """What one RL run holds between steps (all a checkpoint must restore, plus the fixed data)."""

    trainer: Trainer
    sampler: object
    tokenizer: object
    gen: torch.Generator  # the run's random stream: sampling, SR export (not the router jitter)
    value_head: torch.nn.Module | None  # COPC's critic
    train_set: list
    eval_set: list
    arm: Arm  # ARMS[cfg.correction]
    truncation: tuple | None  # (top_p, top_k, min_p) when the sampler truncates, else None
    topk: int | None  # the top-K the sampler records (machinery.recorded_topk)
    since_sync: int = 0


class Update(NamedTuple):
    """One optimizer step on a rollout batch: what it records, the log-probs it saw before it."""

    loss: float
    grad_norm: float
    frac_zeroed: float  # share of the tokens with A != 0 whose gradient the arm zeroed
    frac_zeroed_neg_adv: float  # the same among the tokens with A < 0
    logp_kept: torch.Tensor  # (B, T) detached, before the step: the trainer on the kept support
    logp_prox: torch.Tensor  # (B, T) the proximal policy the loss used (first update: its own logp)
    adv: torch.Tensor  # (B, T) or (B, 1), the advantages the loss used
    log_s: torch.Tensor | None  # (B, T) log kept mass under truncation, else None
    extra: dict  # first update only: kept_mass, the drift / signal split


def update_on_batch(cfg: RLConfig, state: RunState, ro: Rollout, rewards, behaviour: Behaviour,
                    logp_prox, meter) -> Update:
    """One optimizer step on the whole batch: the arm's loss (plus --k2-coef's term); the weight
    it gives each token: effective_token_weights.

    logp (grad) the current trainer; logp_prox the trainer before this batch's first update (None:
    this is it, its own log-probs are the proximal policy); behaviour.logp_old the trainer engine
    on the weights the sampler holds; ro.logp_infer the sampler. behaviour.update_routes: the MoE
    experts the forward replays (R2 / R3; None: live). meter: machinery.StepMeter, laps charged to
    recompute, loss and optimizer."""
    trainer, extra = state.trainer, {}
    reads_topk = state.arm.reads_topk or cfg.diagnose_drift
    topk_ids = ro.topk_ids if reads_topk and ro.topk_ids.shape[-1] > 0 else None
    # TIM: with truncation the trainer's log-probs are renormalised on the kept support: p~, not p
    logp, logp_topk, hidden, log_s = trainer.support_logprobs(ro, topk_ids, cfg.temperature,
                                                              behaviour.update_routes)
    meter.lap("recompute")
    first, logp_kept = logp_prox is None, logp.detach()
    if first and log_s is not None:
        extra["kept_mass"] = float(masked_mean(log_s.detach().exp(), ro.mask))
    if log_s is not None and not cfg.renormalize:  # TIM: full-vocabulary log-probs: biased by S
        logp = logp + log_s
        logp_topk = None if logp_topk is None else logp_topk + log_s[..., None]
    if first:  # TIM: the proximal policy: the trainer before the batch's first update
        logp_prox = logp.detach()
    if state.arm.critic:  # COPC: a critic's (B, T) advantages, bounded like the rewards
        values = torch.sigmoid(state.value_head(hidden.detach()).squeeze(-1))  # (B, T)
        adv, targets = copc_advantages(values, rewards, logp, ro.logp_infer, ro.mask)
        critic_loss = 0.5 * masked_mean((values - targets).square(), ro.mask)
    else:  # (B, 1) GRPO or raw-reward advantages
        adv = grpo_advantages(rewards, cfg.group) if cfg.baseline == "group" else rewards
        adv, critic_loss = adv[:, None], 0.0
    x = LossInputs(logp, logp.detach(), logp_prox, behaviour.logp_old, ro.logp_infer, logp_topk,
                   ro.logp_topk_infer, adv, ro.mask)
    loss = state.arm.loss(cfg, x)
    if cfg.k2_coef > 0:  # TIM: any arm plus prime-rl's k2 pull toward the sampler
        loss = loss + k2_penalty(logp, ro.logp_infer, ro.mask, cfg.k2_coef)
    w_eff = effective_token_weights(loss, logp, adv, ro.mask)  # what the arm did to each token
    if first and cfg.diagnose_drift:
        extra |= drift_signal_norms(trainer.grad_leaves(), logp, logp_topk, ro.logp_infer,
                                    ro.logp_topk_infer, adv, ro.mask)
    meter.lap("loss")
    grad_norm = trainer.step(loss + critic_loss)
    meter.lap("optimizer")
    live = torch.isfinite(w_eff)  # masked tokens with A != 0
    negative, zeroed = live & (adv.expand_as(w_eff) < 0), live & (w_eff == 0)
    frac_zeroed = float(zeroed.sum() / live.sum()) if live.any() else math.nan
    frac_neg = float((zeroed & negative).sum() / negative.sum()) if negative.any() else math.nan
    return Update(loss.item(), grad_norm, frac_zeroed, frac_neg, logp_kept, logp_prox, adv, log_s,
                  extra)


def sample_batch(cfg: RLConfig, step: int, state: RunState) -> tuple[Rollout, list[str]]:
    """This step's prompts, G samples each, on the trainer's device; and their answers."""
    problems = state.train_set[step * cfg.prompts : (step + 1) * cfg.prompts]
    prompts = [state.tokenizer.encode(prompt) for prompt, _ in problems]
    ro = state.sampler.sample(prompts, cfg.group, cfg.max_new_tokens, cfg.temperature, state.topk,
                              state.gen, cfg.top_p, cfg.top_k, cfg.min_p)
    return ro, [answer for _, answer in problems]  # the samplers return it on the trainer's device


def merge_kept_support(ro: Rollout, rebuilt) -> dict:
    """Truncated sampling: the sampler's kept support, else the trainer's rebuilt one; metrics."""
    extra = {"support_rebuilt": ro.kept_ids is None}
    if ro.kept_ids is None:
        ro.kept_ids = rebuilt
        return extra
    ro.kept_ids, beyond = merge_support(ro.kept_ids, rebuilt, ro.mask)  # TIM: past K: rebuilt
    extra["support_differs"] = support_differs(ro.kept_ids, rebuilt, ro.mask & ~beyond)
    if beyond.any():  # logged where it happened (a torch sampler records its whole support: never)
        extra["support_beyond_k"] = int(beyond.sum())
        warnings.warn("vLLM returned --support-topk finite log-probs at some positions: the "
                      "trainer renormalises there on its rebuilt support", stacklevel=1)
    return extra


def sync_sampler(cfg: RLConfig, state: RunState, ro: Rollout, behaviour: Behaviour, meter):
    """Counts the step since the last sync; every sync_every steps (policy lag k - 1), or when DLC's
    lag or staleness trigger fires, exports the master (rounding it) into the sampler.

    -> the visible update fraction (None without a sync). meter: the export's seconds."""
    state.since_sync += 1
    due = state.since_sync >= cfg.sync_every
    if not due and state.arm.resync and (cfg.dlc_max_lag > 0 or cfg.dlc_max_staleness > 0):
        # TIM: DLC's trigger: the lag the next batch would be sampled with, the updated trainer vs
        # the sampler's weights on this batch's tokens, measured from the master at export
        # (rounding is no lag)
        with torch.no_grad():
            logp_next = support_logprobs(state.trainer.model, ro, cfg.temperature,
                                         routes=behaviour.update_routes)[0]
        anchor = behaviour.logp_master_old
        anchor = behaviour.logp_old if anchor is None else anchor
        due = dlc_should_resync(logp_next, anchor, ro.mask, state.since_sync,
                                cfg.dlc_max_staleness, cfg.dlc_max_lag)
    if not due:
        return None
    meter.lap("sync")
    served, visible = state.trainer.export(cfg.export, generator=state.gen)
    meter.lap("export")
    state.sampler.load_weights(served)  # TIM: the trainer's weights (and drift) enter the sampler
    state.since_sync = 0
    return visible


def step_record(cfg: RLConfig, step: int, state: RunState, ro: Rollout, rewards,
                behaviour: Behaviour, updates: list[Update], visible, extra: dict) -> dict:
    """One metrics.jsonl line: mismatch metrics and ledger of the first update's log-probs (before
    any step on this batch), loss and grad_norm as means over the updates, what the arm dropped or
    clipped (frac_masked_* / frac_clipped_*, tis_sn's normaliser), the k2 term."""
    first = updates[0]
    logp = first.logp_prox  # (B, T) the trainer before any step on this batch
    ledger = mismatch_ledger(first.logp_kept, behaviour.logp_old, ro.logp_infer, ro.mask,
                             behaviour.logp_master_old, first.log_s,
                             behaviour.logp_old_sampler_routes, behaviour.logp_old_sampler_gates)
    record = {"step": step, "reward": float(rewards.mean()), "synced": visible is not None,
              "visible_update_fraction": visible, "staleness": state.since_sync}
    for key in ("loss", "grad_norm", "frac_zeroed", "frac_zeroed_neg_adv"):  # means of the finite
        values = [getattr(u, key) for u in updates if math.isfinite(getattr(u, key))]
        record[key] = sum(values) / len(values) if values else None
    record |= {f"mm_{k}": v for k, v in mismatch_metrics(logp, ro.logp_infer, ro.mask).items()}
    if cfg.k2_coef > 0:
        record["k2_penalty"] = float(k2_penalty(logp, ro.logp_infer, ro.mask, cfg.k2_coef))
    if state.arm.shares is not None:
        x = LossInputs(logp, logp, logp, None, ro.logp_infer, None, None, first.adv, ro.mask)
        record |= state.arm.shares(cfg, x)
    record |= {f"ledger_{k}": v for k, v in ledger.items()} | extra | first.extra
    if ro.entropy is not None:  # recorded by the sampler, which had the whole distribution
        record["entropy"] = float(masked_mean(ro.entropy, ro.mask))
    return record


def rl_step(cfg: RLConfig, step: int, state: RunState) -> dict:
    """One step: sample -> score -> behaviour pass -> update(s) -> export / sync -> ledger."""
    import machinery  # the meter of sec_<phase> and peak_rss_mb

    meter = machinery.StepMeter(STEP_PHASES)
    # 1) sample
    ro, answers = sample_batch(cfg, step, state)
    meter.lap("sample")
    # 2) score: the verifier's reward per sequence
    rewards = [verify(text, answers[i // cfg.group]) for i, text in enumerate(ro.texts)]
    rewards = torch.tensor(rewards, device=ro.mask.device)
    # 3) behaviour pass: the trainer engine on the weights the sampler holds, and on the master
    # (with truncation the same forward rebuilds the kept support; an MoE model: also on the
    # sampler's experts)
    behaviour = state.trainer.behaviour_logprobs(ro, cfg.temperature, state.truncation,
                                                 cfg.routing_replay)
    extra = merge_kept_support(ro, behaviour.rebuilt) if state.truncation else {}
    extra |= machinery.route_flips(ro, behaviour.routes)  # MoE: routing_flip_rate of two engines
    meter.lap("recompute")
    # 4) update(s): the arm's loss, updates_per_batch optimizer steps on the batch
    updates = []
    for _ in range(cfg.updates_per_batch):
        # TIM: the proximal policy is the trainer before this batch's first update (None: this is
        # it); R2 / R3: behaviour.update_routes are the experts every forward of the update replays
        logp_prox = updates[0].logp_prox if updates else None
        updates.append(update_on_batch(cfg, state, ro, rewards, behaviour, logp_prox, meter))
    # 5) export / sync
    visible = sync_sampler(cfg, state, ro, behaviour, meter)
    meter.lap("sync")
    # 6) ledger and metrics
    record = step_record(cfg, step, state, ro, rewards, behaviour, updates, visible, extra)
    return record | meter.record()


def setup_run(cfg: RLConfig) -> RunState:
    """Model, trainer, sampler (holding the first served copy), data; all seeded from cfg.seed."""
    import machinery  # the config rules, the testbed's tasks

    machinery.check_run_config(cfg)
    torch.manual_seed(cfg.seed)
    model_dir = machinery.resolve_model_dir(cfg.model)
    tokenizer, device = load_tokenizer(model_dir), machinery.resolve_device(cfg.device)
    model = load_model(model_dir, trust_remote_code=cfg.trust_remote_code).to(device)
    if cfg.gradient_checkpointing:  # each layer recomputed in backward: same numbers, less memory
        model.gradient_checkpointing_enable()
    machinery.check_model_routers(cfg, model)
    arm = arm_of(cfg)
    value_head = torch.nn.Linear(model.config.hidden_size, 1).to(device) if arm.critic else None
    trainer = Trainer(model, cfg.lr, cfg.optimizer, export_dtype=cfg.dtype,
                      loss_on_served=cfg.loss_on_served,
                      extra_params=value_head.parameters() if arm.critic else ())
    sampler = machinery.build_sampler(cfg, trainer, tokenizer)  # TorchSampler or VLLMSampler
    gen = torch.Generator().manual_seed(cfg.seed)
    sampler.load_weights(trainer.export(cfg.export, generator=gen)[0])  # the first served copy
    train_set, eval_set = machinery.run_problems(cfg, model_dir, tokenizer)  # RL, held-out
    truncation = (cfg.top_p, cfg.top_k, cfg.min_p) if _truncates(cfg) else None
    return RunState(trainer, sampler, tokenizer, gen, value_head, train_set, eval_set, arm,
                    truncation, machinery.recorded_topk(cfg))


def run(cfg: RLConfig, resume: bool = False) -> list[dict]:
    """RL under mismatch: evaluate, then rl_step after rl_step; returns the records.

    Writes one JSON line per record to runs/<name>/metrics.jsonl, a checkpoint every
    cfg.checkpoint_every steps and at the end. resume=True continues from
    runs/<name>/checkpoint.safetensors (bit for bit the run that was interrupted, on the same
    machine and thread count)."""
    import machinery  # runs/<name>/ (metrics, config, checkpoints, resume); evaluation

    state = setup_run(cfg)
    log = machinery.RunLog(cfg, state, resume)
    for step in log.steps():  # the steps left, behind a progress bar
        if step % cfg.eval_every == 0:  # before the step's update: step 0 is the start model
            log.write(machinery.evaluate(step, state, cfg))
        log.write(rl_step(cfg, step, state))
        log.checkpoint_after(step)
    log.write(machinery.evaluate(cfg.steps, state, cfg))  # after the last update
    return log.records


# --------------------------------------------------------------------------------------------------
# ---- config dataclasses and input checks ----
# One flat dataclass per concern; every field has a help text, the CLI builds its flags from them.


def cli_field(default, help: str):
    """A dataclass field with this default and its --help text in the metadata (for the CLI)."""
    return field(default=default, metadata={"help": help})


@dataclass
class EngineSpec:
    """The sampler engine's numerics: its own copy of the weights, stored and computed this way."""

    dtype: str = cli_field("fp32", "sampler weight/compute dtype: fp32 | bf16 | fp16")
    quant: str = cli_field("none", "fake-quantised Linear weights (not lm_head): none | int8 | fp8")
    noise: float = cli_field(0.0, "relative weight noise s: w + s * N(0,1) * w, one draw")
    noise_seed: int = cli_field(1234, "seed of that noise draw (re-applied after every sync)")
    exact: bool = cli_field(False, "zero mismatch: log-probs from the trainer's own fp32 forward")
    router_fp32: bool = cli_field(False, "MoE: routers' weights and logits in fp32 (bf16/fp16)")
    router_noise: float = cli_field(0.0, "MoE: relative noise s on the routers' weights only")
    router_jitter: float = cli_field(0.0, "MoE: noise sigma * N(0, 1) on the routers' logits")
    head_fp32: bool = cli_field(False, "lm_head and logits in fp32 in bf16/fp16 (TRL's option)")


@dataclass
class RLConfig:
    """One RL run: sample -> verify -> advantages -> recompute -> correct -> step -> export/sync."""

    name: str = cli_field("run", "run name: writes runs/<name>/metrics.jsonl")
    model: str = cli_field("runs/base", "HF causal-LM dir (the tiny model is built if missing)")
    sampler: str = cli_field("torch", "sampler engine: torch | vllm")
    dtype: str = cli_field("fp32", "sampler dtype: fp32 | bf16 | fp16")
    quant: str = cli_field("none", "sampler weight quantisation: none | int8 | fp8")
    noise: float = cli_field(0.0, "sampler relative weight noise s")
    router_noise: float = cli_field(0.0, "MoE sampler: relative noise on the routers' weights only")
    router_jitter: float = cli_field(0.0, "MoE sampler: per-forward noise sigma, routers' logits")
    exact: bool = cli_field(False, "sampler log-probs from the trainer's forward (ratio 1)")
    correction: str = cli_field("none", " | ".join(CORRECTIONS) + " (drift_only: a control)")
    steps: int = cli_field(80, "optimizer steps")
    prompts: int = cli_field(16, "prompts per step")
    group: int = cli_field(8, "samples per prompt (G)")
    max_new_tokens: int = cli_field(5, "response length cap")
    temperature: float = cli_field(1.0, "temperature of sampler and trainer (vLLM: 0 or >= 0.01)")
    top_p: float = cli_field(1.0, "sampler nucleus truncation (vLLM's rule; 1 = off)")
    top_k: int = cli_field(0, "sampler top-k truncation (0 = off; not the recorded --topk)")
    min_p: float = cli_field(0.0, "sampler min-p truncation: keep p >= min_p * max p (0 = off)")
    renormalize: bool = cli_field(True, "truncated: trainer log-probs renormalised on kept support")
    topk: int = cli_field(32, "top-K recorded for sc*, drift_only, --diagnose-drift (0: all V)")
    support_topk: int = cli_field(64, "vLLM truncated: log-probs per token, finite ones = support")
    baseline: str = cli_field("group", "advantage baseline: group (GRPO mean, no std) | none")
    optimizer: str = cli_field("adamw", "adamw | sgd")
    lr: float = cli_field(3e-5, "learning rate (1e-4 knocks the tiny model back early)")
    sync_every: int = cli_field(1, "copy the trainer into the sampler every k steps (lag k - 1)")
    updates_per_batch: int = cli_field(1, "optimizer steps per rollout batch (verl ppo_epochs)")
    export: str = cli_field("rtn", "fp32 -> bf16/fp16 export rounding: rtn | sr | ef")
    loss_on_served: bool = cli_field(False, "Fair Cast: forward on the served weights")
    tis_cap: float = cli_field(2.0, "TIS cap C of the token-level weights (tis, ppo, sc_tis)")
    seq_tis_cap: float = cli_field(5.0, "seq_tis: cap on the sequence's importance ratio")
    dlc_lag_cap: float = cli_field(2.0, "DLC: cap on its lag ratio p_prox / p_old")
    mis_low: float = cli_field(0.5, "MIS band low")
    mis_high: float = cli_field(5.0, "MIS band high")
    eps_low: float = cli_field(0.2, "PPO clip low")
    eps_high: float = cli_field(0.28, "PPO clip high")
    dppo_delta: float = cli_field(0.2, "DPPO trust region on |p - q|")
    rs_threshold: float = cli_field(0.01, "rs arms: drop divergence > it (k1: q/p in [1/it, it])")
    rs_estimator: str = cli_field("k3", "rs arms' estimate of KL(q || p) per token: k1 | k2 | k3")
    opsm_delta: float = cli_field(1e-4, "opsm: drop A < 0 sequences, mean(logp_infer - logp) > it")
    k2_coef: float = cli_field(0.0, "loss + c * mean((logp - logp_infer)^2 / 2); kl_tau = c / 2")
    gspo_eps_low: float = cli_field(3e-4, "gspo: clip low of the sequence ratio (GSPO's 3e-4)")
    gspo_eps_high: float = cli_field(4e-4, "gspo: clip high of the sequence ratio (GSPO's 4e-4)")
    dlc_max_staleness: int = cli_field(0, "DLC: resync after this many steps without one (0 = off)")
    dlc_max_lag: float = cli_field(0.0, "DLC: resync at mean |logp - logp at sync| > this (0: off)")
    eval_every: int = cli_field(20, "evaluate at step 0, every N <= steps/4 steps, after the last")
    eval_n: int = cli_field(512, "distinct held-out problems per evaluation")
    diagnose_drift: bool = cli_field(False, "log the gradient's drift and signal norms")
    seed: int = cli_field(0, "seed of sampling, data and noise")
    out_dir: str = cli_field("runs", "parent directory of runs")
    checkpoint_every: int = cli_field(10, "checkpoint every N steps (0: at the end only)")
    trust_remote_code: bool = cli_field(False, "let transformers run code shipped in --model")
    progress: bool = cli_field(True, "show a tqdm bar")
    device: str = cli_field("auto", "trainer, TorchSampler and evaluation: auto | cpu | cuda")
    vllm_gpu_memory: float = cli_field(0.3, "GPU memory share vLLM takes beside the trainer")
    task: str = cli_field("arithmetic", "arithmetic (the tiny model's) | words (chat)")
    task_digits: int = cli_field(0, "arithmetic task's operand digits (0: the model's own)")
    routing_replay: str = cli_field("none", "MoE: none | r2 (policy's experts) | r3 (sampler's)")
    gradient_checkpointing: bool = cli_field(False, "transformers' gradient checkpointing")


def _truncates(cfg: RLConfig) -> bool:
    """Whether the run samples from a truncated distribution (top-p, top-k or min-p at T > 0)."""
    return cfg.temperature > 0 and (cfg.top_p < 1 or cfg.top_k > 0 or cfg.min_p > 0)


QUANTS = ("none", "int8", "fp8")  # EngineSpec.quant / RLConfig.quant: weight fake-quantisation


class UsageError(ValueError):
    """A mistake on the command line: main() prints it as one `tim_rl: error: ...` line, exit 2."""


def _check_engine(engine: EngineSpec) -> None:
    """Raise ValueError, naming the field, for an EngineSpec no TorchSampler can build."""
    _check_choice("engine.dtype", engine.dtype, sorted(_DTYPES))
    _check_choice("engine.quant", engine.quant, QUANTS)
    noisy = engine.noise or engine.router_noise or engine.router_jitter
    if engine.exact and (engine.dtype != "fp32" or engine.quant != "none" or noisy):
        raise ValueError("engine.exact needs dtype fp32 without quantisation or noise")


# --------------------------------------------------------------------------------------------------
# ---- CLI ----


def main(argv: list[str] | None = None) -> None:
    """`python tim_rl.py [pretrain|train|demo|doctor] --help`; no subcommand runs the demo."""
    import machinery  # the CLI's rules (config combinations, paths, seeds), the demo, the doctor

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:  # the mismatch doctor: its own parser
        return machinery.doctor_main(argv[1:])
    parser = machinery.cli_parser()
    args = parser.parse_args(argv)
    with machinery.cli_errors(parser, args):  # UsageError: one line, status 2; Ctrl-C: resume hint
        cfg = machinery.checked_cli_config(args)  # every refusal before any work
        if args.cmd == "pretrain":
            pretrain_cfg = machinery.config_from_args(machinery.PretrainConfig, args)
            print(json.dumps(machinery.pretrain(pretrain_cfg)))
        elif args.cmd == "train":
            records = run(cfg, resume=bool(args.resume))
            print(machinery.train_summary(records, Path(cfg.out_dir) / cfg.name))
        else:
            seeds = tuple(int(s) for s in args.seeds.split(","))
            machinery.demo(steps=args.steps, seeds=seeds)


if __name__ == "__main__":
    import tim_rl  # the copy machinery.py imported: one module for the CLI and its helpers

    tim_rl.main()
