"""Continuous batching with per-response policy versions: does a staleness bound that drops starve
the hard problems? (issue 57, item 4: drop vs correct).

tim_rl's async schedule (`--in-flight`, `--max-staleness`) gives every response of a batch the same
versions, so its bound drops whole batches. Frameworks with partial rollouts (verl's fully-async
recipe, AReaL, SkyRL, prime-rl) run a pool instead: a slot that finishes takes the next problem at
once, the trainer takes the oldest finished groups as soon as a batch is ready, and a response's
tokens carry the version of the weights that sampled each. A long response spans more updates, so
its oldest token is staler. Here that pool, in one process (a group's responses start together, so
a bound drops whole groups, the ones whose slowest response spans the most updates):

- `Pool.tick` decodes one position of every unfinished slot on the sampler's current weights (the
  prefix re-encoded: the KV cache recomputed under the new weights, `--kv-recompute`'s semantics);
  the trainer steps at most once a tick, when `prompts` finished groups wait (FIFO), and the
  sampler is synced after every step (versions = tim_rl's: the trainer's step count).
- The step is tim_rl's, piece by piece: `drop_stale` (or keep), the verifier, the behaviour pass,
  `update_on_batch` with the arm's loss, `Trainer.export` into the sampler, `step_record`.
- Difficulty is each problem's pass rate over `group` samples of the base sampler (the control at
  its start; a generator of its own), and the study reports which problems' responses were dropped.
- The behaviour pass scores every token on the current weights (no per-version copies): arms that
  read logp_old or top-K, and the ledger's lag / numerics split, are not per version here, so
  `check_pool` refuses those arms and the study reports no ledger.

Run `python -m lab async-drop [--smoke] [--publish]`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

import tim_rl as tr

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "lab" / "results" / "async-drop.json"
PREDICTION = ROOT / "lab" / "predictions" / "async-drop.json"
FIGURE = ROOT / "lab" / "figures" / "async-drop.png"


@dataclass
class Slot:
    """One response being generated: its problem, prompt, tokens so far and each one's log-prob
    and version."""

    problem: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False


class Pool:
    """`capacity` groups of `group` slots; a finished group waits in `ready` (FIFO) and its slots
    take the next problem."""

    def __init__(self, state: tr.RunState, cfg: tr.RLConfig, capacity: int):
        self.state, self.cfg, self.capacity = state, cfg, capacity
        self.next_problem = 0
        self.active: list[list[Slot]] = []
        self.ready: list[list[Slot]] = []
        self.fill()

    def fill(self) -> None:
        """Start problems until `capacity` groups are in flight."""
        while len(self.active) < self.capacity and self.next_problem < len(self.state.train_set):
            prompt = self.state.tokenizer.encode(self.state.train_set[self.next_problem][0])
            group = [Slot(self.next_problem, prompt) for _ in range(self.cfg.group)]
            self.active.append(group)
            self.next_problem += 1

    def tick(self, version: int) -> None:
        """One decode position of every unfinished slot on the sampler's weights (version);
        finished groups move to `ready`, new problems take their place."""
        live = [s for group in self.active for s in group if not s.done]
        ro = self.state.sampler.sample([s.prompt + s.tokens for s in live], 1, 1,
                                       self.cfg.temperature, None, self.state.gen)
        eos = self.state.tokenizer.eos_id
        tokens, logps = ro.response_ids[:, 0].tolist(), ro.logp_infer[:, 0].tolist()
        for slot, token, logp in zip(live, tokens, logps):
            slot.tokens.append(token)
            slot.logps.append(logp)
            slot.versions.append(version)
            slot.done = token == eos or len(slot.tokens) == self.cfg.max_new_tokens
        self.ready += [g for g in self.active if all(s.done for s in g)]
        self.active = [g for g in self.active if not all(s.done for s in g)]
        self.fill()


def _right_pad(rows: list[list], fill, dtype) -> torch.Tensor:
    """(B, T) of ragged rows, right-padded with `fill`."""
    T = max(map(len, rows))
    return torch.tensor([r + [fill] * (T - len(r)) for r in rows], dtype=dtype)


def rollout_of(groups: list[list[Slot]], tokenizer) -> tuple[tr.Rollout, list[int]]:
    """The finished groups as a tim_rl Rollout (versions per token; no top-K) and each row's
    problem index."""
    slots = [s for g in groups for s in g]
    prompt_ids, prompt_mask = tr.left_pad([s.prompt for s in slots], tokenizer.pad_id)
    response_ids = _right_pad([s.tokens for s in slots], tokenizer.pad_id, torch.long)
    mask = _right_pad([[True] * len(s.tokens) for s in slots], False, torch.bool)
    logp_infer = _right_pad([s.logps for s in slots], 0.0, torch.float32)
    versions = _right_pad([s.versions for s in slots], 0, torch.long)  # padding: masked
    B, T = response_ids.shape
    ro = tr.Rollout(prompt_ids, prompt_mask, response_ids, mask, logp_infer,
                    torch.zeros(B, T, 0, dtype=torch.long), torch.zeros(B, T, 0),
                    [tokenizer.decode(s.tokens) for s in slots], versions=versions)
    return ro, [s.problem for s in slots]


def pool_step(cfg: tr.RLConfig, step: int, state: tr.RunState, groups) -> tuple[dict, dict]:
    """tim_rl's RL step on finished groups: drop (or keep) the stale, verify, behaviour pass, one
    update, export into the sampler. -> (metrics record, {problem: [responses, dropped,
    correct]})."""
    meter = tr.StepMeter(tr.STEP_PHASES)
    ro, problems = rollout_of(groups, state.tokenizer)
    staleness = tr.drop_stale(cfg, step, ro)  # ro.mask loses the dropped rows (unless kept)
    dropped = (~ro.mask.any(1)).tolist()  # every response holds a token: empty rows were dropped
    answers = [state.train_set[p][1] for p in problems]
    rewards = torch.tensor([tr.verify(t, a) for t, a in zip(ro.texts, answers)])
    behaviour = state.trainer.behaviour_logprobs(ro, cfg.temperature)
    update = tr.update_on_batch(cfg, step, state, ro, rewards, behaviour, None, meter)
    served, visible = state.trainer.export(cfg.export, generator=state.gen)
    state.sampler.load_weights(served)
    record = tr.step_record(cfg, step, state, ro, rewards, behaviour, [update], visible, staleness)
    record["frac_dropped_rows"] = sum(dropped) / len(dropped)
    per_problem: dict[int, list[int]] = {}
    for problem, reward, drop in zip(problems, rewards.tolist(), dropped):
        counts = per_problem.setdefault(problem, [0, 0, 0])
        counts[0] += 1
        counts[1] += int(drop)
        counts[2] += int(reward > 0)
    return record, per_problem


@torch.no_grad()
def base_pass_rates(state: tr.RunState, cfg: tr.RLConfig, n: int, seed: int) -> list[float]:
    """Each of the first n problems' pass rate over cfg.group samples of the sampler before any
    update (the control's per-problem accuracy at its start), from a generator of its own."""
    gen = torch.Generator().manual_seed(seed)
    rates = []
    for start in range(0, n, 128):
        problems = state.train_set[start : min(start + 128, n)]
        prompts = [state.tokenizer.encode(q) for q, _ in problems]
        ro = state.sampler.sample(prompts, cfg.group, cfg.max_new_tokens, cfg.temperature, None,
                                  gen)
        right = [tr.verify(t, problems[i // cfg.group][1]) for i, t in enumerate(ro.texts)]
        rates += [sum(right[i : i + cfg.group]) / cfg.group
                  for i in range(0, len(right), cfg.group)]
    return rates


def check_pool(cfg: tr.RLConfig, capacity: int) -> None:
    """A UsageError naming the setting the pool does not implement (it would be ignored)."""
    arm = tr.arm_of(cfg)
    ignored = {"--top-p / --top-k / --min-p": tr._truncates(cfg),
               "--updates-per-batch != 1": cfg.updates_per_batch != 1,
               "--sync-every != 1 (the pool syncs after every step)": cfg.sync_every != 1,
               "--in-flight / --keep-stale": cfg.in_flight or cfg.keep_stale,
               "--prox-logp loglinear": cfg.prox_logp != "recompute",
               "--routing-replay": cfg.routing_replay != "none",
               "--sampler vllm": cfg.sampler != "torch",
               "--diagnose-drift": cfg.diagnose_drift,
               f"--correction {cfg.correction} (reads logp_old, top-K, a critic or resyncs)":
                   arm.renormalized or arm.reads_topk or arm.critic or arm.resync,
               f"capacity {capacity} < --prompts {cfg.prompts}": capacity < cfg.prompts}
    wrong = [name for name, bad in ignored.items() if bad]
    if wrong:
        raise tr.UsageError(f"the async pool does not implement: {', '.join(wrong)}")


def run_pool(cfg: tr.RLConfig, capacity: int) -> tuple[list[dict], dict, list[float]]:
    """cfg.steps steps of the pool; evaluations at 0 and after the last. -> (records,
    {problem: [responses, dropped, correct]}, the base pass rate of each problem)."""
    check_pool(cfg, capacity)
    state = tr.setup_run(cfg)
    # the pool reads past steps x prompts problems: a longer draw of the same stream (a prefix)
    more = replace(cfg, steps=cfg.steps + capacity)
    state.train_set = tr.run_problems(more, tr.resolve_model_dir(cfg.model), state.tokenizer)[0]
    rates = base_pass_rates(state, cfg, len(state.train_set), 10_000 + cfg.seed)
    pool = Pool(state, cfg, capacity)
    records = [tr.evaluate(0, state, cfg)]
    per_problem: dict[int, list[int]] = {}
    for step in range(cfg.steps):
        while len(pool.ready) < cfg.prompts:
            if not pool.active:
                raise ValueError(f"the pool ran out of problems at step {step}")
            pool.tick(step)
        groups, pool.ready = pool.ready[: cfg.prompts], pool.ready[cfg.prompts :]
        record, counts = pool_step(cfg, step, state, groups)
        records.append(record)
        per_problem |= counts  # a problem is started once: it lands in one batch
    records.append(tr.evaluate(cfg.steps, state, cfg))
    return records, per_problem, rates


# ---- the study: drop vs keep, claims stated before the runs ----

CAPACITY_GROUPS = 32  # groups in flight: 2 batches of 16 prompts (a sampler one batch ahead)
# --max-staleness of the drop arm: the pilot (seed 0, 10 steps) dropped 52 % at 1, 1 % at 2
BOUND = 1
ARMS = {"keep, none": {"correction": "none"},
        "keep, tis": {"correction": "tis"},
        f"drop > {BOUND}, none": {"correction": "none", "max_staleness": BOUND}}
HARD, EASY = 0.25, 0.75  # base pass rate < HARD: hard; >= EASY: easy
CLAIMS = [
    {"id": "async-drop-1", "claim": "the drop arm drops a larger share of the hard problems' "
     "responses than of the easy ones' (paired over seeds: hard - easy > 0)"},
    {"id": "async-drop-2", "claim": "keeping the stale responses with TIS ends with a higher "
     "held-out pc than dropping them (keep, tis - drop > 0)"},
    {"id": "async-drop-3", "claim": "with the stale responses kept, TIS vs none: reported, no "
     "direction claimed (two-sided)"},
]
DESIGN = {
    "pool": f"{CAPACITY_GROUPS} groups in flight, 16 prompts x 8 per step, bf16 sampler synced "
            "after every step, KV recomputed each position, 80 steps, lr 3e-5 (RLConfig's)",
    "arms": list(ARMS), "seeds": [0, 1, 2, 3, 4],
    "difficulty": f"each problem's pass rate over 8 samples of the base sampler (own generator); "
                  f"hard < {HARD}, easy >= {EASY}",
    "verdicts": "95 % paired t interval over the 5 seeds (lab.experiments.paired_ci): supported "
                "when it excludes 0 in the claimed direction, contradicted when it excludes 0 the "
                "other way, else not resolved",
    "power": "5 seeds: the interval's half-width is t(0.975, 4) = 2.78 standard errors; the "
             "staleness preset's pc differences had SE ~0.009, so |pc delta| >= ~0.026 resolves; "
             "the pilot's drop-share gap (0.56 vs 0.36) is ~10x that",
    "cpu": "pilot: 10 steps in 20 s on 2 busy cores; 15 runs x 80 steps ~ 15-25 CPU-minutes",
    "pilot": "seed 0, 10 steps: drop > 1 dropped 52 % of rows (hard 0.56, middle 0.55, easy "
             "0.36); drop > 2 dropped 1 %, so the bound is 1",
}


def write_prediction(path: Path = PREDICTION) -> Path:
    """The design and claims, to be committed before the study's first run."""
    path.write_text(json.dumps({"design": DESIGN, "claims": CLAIMS}, indent=1) + "\n")
    return path


def _shares(per_problem: dict, rates: list[float]) -> dict[str, float]:
    """Dropped share of the responses of the hard, middle and easy problems."""
    out = {}
    bins = {"hard": (0.0, HARD), "middle": (HARD, EASY), "easy": (EASY, 1.01)}
    for name, (lo, hi) in bins.items():
        rows = [per_problem[p] for p in per_problem if lo <= rates[p] < hi]
        total = sum(r[0] for r in rows)
        out[f"dropped_{name}"] = sum(r[1] for r in rows) / max(total, 1)
        out[f"responses_{name}"] = total
    return out


def study(smoke: bool = False, out: Path = Path("runs/async-drop")) -> dict:
    """Every arm at every seed (smoke: 2 steps, 1 seed, small batches) -> the per-run summaries."""
    from tqdm.auto import tqdm

    seeds = DESIGN["seeds"][:1] if smoke else DESIGN["seeds"]
    size, capacity = {"steps": 80, "prompts": 16, "group": 8, "eval_n": 512}, CAPACITY_GROUPS
    if smoke:
        size, capacity = {"steps": 2, "prompts": 2, "group": 2, "eval_n": 16}, 4
    runs = {}
    jobs = [(arm, seed) for arm in ARMS for seed in seeds]
    for arm, seed in tqdm(jobs, desc="async-drop"):
        cfg = tr.RLConfig(model=str(tr.resolve_model_dir("runs/base")), dtype="bf16", seed=seed,
                          eval_every=10**6, checkpoint_every=0, progress=False,
                          out_dir=str(out), name=f"{len(runs)}", **size | ARMS[arm])
        t0 = time.time()
        records, per_problem, rates = run_pool(cfg, capacity)
        steps = [r for r in records if "reward" in r]
        runs.setdefault(arm, []).append(
            {"seed": seed, "pc_final": records[-1]["pc_trainer"],
             "acc_final": records[-1]["acc_trainer"], "pc_start": records[0]["pc_trainer"],
             "staleness_mean": sum(r["staleness_mean"] for r in steps) / len(steps),
             "mixed_version_ratio": sum(r["mixed_version_ratio"] for r in steps) / len(steps),
             "frac_stale_rows": sum(r["frac_stale_rows"] for r in steps) / len(steps),
             "seconds": time.time() - t0} | _shares(per_problem, rates))
    return runs


def verdicts(runs: dict) -> list[dict]:
    """The claims' verdicts from the runs (paired over seeds)."""
    from lab.experiments import paired_ci

    drop, keep_tis, keep_none = (runs[a] for a in (list(ARMS)[2], "keep, tis", "keep, none"))
    diffs = [[r["dropped_hard"] - r["dropped_easy"] for r in drop],
             [a["pc_final"] - b["pc_final"] for a, b in zip(keep_tis, drop)],
             [a["pc_final"] - b["pc_final"] for a, b in zip(keep_tis, keep_none)]]
    out = []
    for claim, d, directed in zip(CLAIMS, diffs, (True, True, False)):
        lo, hi = paired_ci(d)  # one seed: (-inf, inf), nothing resolved
        verdict = "not resolved"
        if lo > 0:
            verdict = "supported" if directed else "resolved: > 0"
        elif hi < 0:
            verdict = "contradicted" if directed else "resolved: < 0"
        out.append(claim | {"mean": sum(d) / len(d), "ci95": [lo, hi], "verdict": verdict})
    return out


def report(runs: dict) -> str:
    """results as markdown: per arm the means over seeds; then the claims."""
    keys = ("pc_start", "pc_final", "acc_final", "staleness_mean", "mixed_version_ratio",
            "frac_stale_rows", "dropped_hard", "dropped_middle", "dropped_easy")
    lines = ["| arm | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for arm, rows in runs.items():
        means = [sum(r[k] for r in rows) / len(rows) for k in keys]
        lines.append(f"| {arm} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    lines.append("")
    for v in verdicts(runs):
        lo, hi = v["ci95"]
        lines.append(f"- [{v['id']}] {v['claim']}: {v['mean']:+.3f} [{lo:+.3f}, {hi:+.3f}] "
                     f"-> **{v['verdict']}**")
    return "\n".join(lines)


def figure(runs: dict, path: Path = FIGURE) -> Path:
    """Dropped share by difficulty (a line a seed) and final pc per arm (a dot a seed); titled."""
    from matplotlib.figure import Figure

    drop = runs[list(ARMS)[2]]
    bins = ("hard", "middle", "easy")
    hard, easy = (sum(r[f"dropped_{b}"] for r in drop) / len(drop) for b in ("hard", "easy"))
    kept, dropped = (sum(r["pc_final"] for r in runs[a]) / len(runs[a]) for a in ("keep, tis",
                                                                                  list(ARMS)[2]))
    fig = Figure(figsize=(10, 3.6))
    left, right = fig.subplots(1, 2)
    for r in drop:
        left.plot(bins, [r[f"dropped_{b}"] for b in bins], "o-", alpha=0.6)
    left.set(xlabel="problem (base pass rate: < 0.25 | middle | >= 0.75)",
             ylabel="share of responses dropped", ylim=(0, 1))
    for i, (arm, rows) in enumerate(runs.items()):
        right.plot([i] * len(rows), [r["pc_final"] for r in rows], "o", alpha=0.7)
    right.set_xticks(range(len(runs)), list(runs))
    right.set(ylabel="held-out pc after the last step")
    fig.suptitle(f"a staleness bound of {BOUND} drops {hard:.0%} of the hard problems' responses, "
                 f"{easy:.0%} of the easy ones'; keeping them with TIS ends at pc {kept:.3f}, "
                 f"dropping at {dropped:.3f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(smoke: bool = False, publish: bool = False, design: bool = False) -> str:
    """`python -m lab async-drop`: run, report; --publish writes lab/results/async-drop.json (and
    the figure); --design writes the design file alone (before the first run)."""
    if design:
        return str(write_prediction())
    if publish and not PREDICTION.exists():
        raise tr.UsageError(f"--publish needs the design committed first: {PREDICTION}")
    runs = study(smoke)
    text = report(runs)
    if publish and not smoke:
        RESULTS.write_text(json.dumps({"design": DESIGN, "runs": runs,
                                       "verdicts": verdicts(runs)}, indent=1) + "\n")
        figure(runs)
    return text
