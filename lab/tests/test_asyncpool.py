"""The continuous-batching pool (issue 57, item 4): each token's log-prob and version are the
weights' that sampled it; the bound drops exactly the responses older than it; the study's command
runs at smoke size."""

import copy
import subprocess
import sys

import pytest
import torch

import tim_rl as tr
from lab import asyncpool as ap


def _small(tmp_path, **change):
    return tr.RLConfig(model="bases/tiny", steps=3, prompts=2, group=2, eval_n=16,
                       checkpoint_every=0, progress=False, out_dir=str(tmp_path), **change)


def _drive(cfg, monkeypatch, capacity=4):
    """run_pool itself, keeping a copy of the sampler's model at each version it samples with and
    each batch it trains on; -> (batches, copies)."""
    copies, batches = {}, []
    tick, step_of = ap.Pool.tick, ap.pool_step

    def spying_tick(pool, version):
        assert version == len(batches), "a token's version is the number of updates so far"
        copies.setdefault(version, copy.deepcopy(pool.state.sampler.model))
        tick(pool, version)

    def spying_step(cfg, step, state, groups):
        batches.append((step, copy.deepcopy(groups)))
        return step_of(cfg, step, state, groups)

    monkeypatch.setattr(ap.Pool, "tick", spying_tick)
    monkeypatch.setattr(ap, "pool_step", spying_step)
    ap.run_pool(cfg, capacity)
    return batches, copies


@torch.no_grad()
def _rescored(model, slot, t):
    ids = torch.tensor([slot.prompt + slot.tokens[:t]])
    return float(torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)[slot.tokens[t]])


def test_each_token_is_its_versions_weights_and_a_wrong_version_is_not(tmp_path, monkeypatch):
    batches, copies = _drive(_small(tmp_path), monkeypatch)
    worst, wrong, spans = 0.0, 0.0, 0
    for step, groups in batches:
        for slot in (s for g in groups for s in g):
            assert slot.versions == sorted(slot.versions) and slot.versions[-1] <= step
            spans += slot.versions[0] < slot.versions[-1]
            for t, (v, logp) in enumerate(zip(slot.versions, slot.logps)):
                worst = max(worst, abs(_rescored(copies[v], slot, t) - logp))
                if v > 0:  # the twin: the version before gives another number
                    wrong = max(wrong, abs(_rescored(copies[v - 1], slot, t) - logp))
    assert spans > 0, "some response spans an update (the pool is one batch ahead)"
    assert worst < 1e-5 and wrong > 1e-4, (worst, wrong)


def test_the_bound_drops_exactly_the_responses_older_than_it(tmp_path):
    cfg = _small(tmp_path, max_staleness=0)
    state = tr.setup_run(cfg)
    pool, stale = ap.Pool(state, cfg, 4), 0
    for step in range(cfg.steps):
        while len(pool.ready) < cfg.prompts:
            pool.tick(step)
        groups, pool.ready = pool.ready[: cfg.prompts], pool.ready[cfg.prompts :]
        old = [s.versions[0] < step for g in groups for s in g]
        stale += sum(old)
        record, per_problem = ap.pool_step(cfg, step, state, groups)
        assert record["frac_dropped_rows"] == pytest.approx(sum(old) / len(old))
        assert sum(c[1] for c in per_problem.values()) == sum(old)
    assert stale > 0, "some batch held a stale response"
    # a group sampled at version 0, trained at step 2: two versions old
    groups = [[ap.Slot(0, [1, 5], [6, 2], [-0.1, -0.2], [0, 0], True)] * 2] * 2
    for bound, dropped in ((-1, 0.0), (2, 0.0), (1, 1.0)):
        record = ap.pool_step(_small(tmp_path, max_staleness=bound), 2, state, groups)[0]
        assert record["frac_dropped_rows"] == dropped, bound


def test_the_pool_refuses_what_it_would_ignore(tmp_path):
    for change in ({"top_p": 0.9}, {"updates_per_batch": 2}, {"correction": "dlc"},
                   {"correction": "sc"}, {"sync_every": 2}):
        with pytest.raises(tr.UsageError, match="does not implement"):
            ap.check_pool(_small(tmp_path, **change), 4)
    ap.check_pool(_small(tmp_path, correction="tis", max_staleness=1), 4)


def test_the_study_command_runs_at_smoke_size_and_publish_needs_the_design(tmp_path, monkeypatch):
    out = subprocess.run([sys.executable, "-m", "lab", "async-drop", "--smoke"], cwd=ap.ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(c["id"] in out.stdout for c in ap.CLAIMS)
    monkeypatch.setattr(ap, "PREDICTION", tmp_path / "none.json")
    with pytest.raises(tr.UsageError, match="design committed first"):
        ap.main(smoke=True, publish=True)


def test_the_figure_and_the_published_section_are_the_committed_numbers(tmp_path):
    """The figure draws from runs (its title from their numbers); RESULTS.md's async-drop section is
    report() of lab/results/async-drop.json, line for line (`python -m lab async-drop --publish`
    regenerates both)."""
    import json

    row = {"pc_final": 0.5, "dropped_hard": 0.6, "dropped_middle": 0.5, "dropped_easy": 0.25}
    path = ap.figure({arm: [row, row] for arm in ap.ARMS}, tmp_path / "f.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    published = json.loads(ap.RESULTS.read_text())
    assert published["design"] == ap.DESIGN
    assert ap.report(published["runs"]) in (ap.ROOT / "RESULTS.md").read_text()
