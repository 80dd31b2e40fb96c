"""The real-lengths preset (lab/reallengths.py): its scorer against tim_rl's own forward, its shares
against hand-made ratios, and the whole preset at smoke size (a 2-layer random Llama, seconds)."""

from __future__ import annotations

import math

import pytest
import torch

import tim_rl as tr
from lab import reallengths as rl
from lab import testbed


@pytest.fixture(scope="module")
def smoke_tokens():
    """A random 2-layer Llama and 4 prompts x 2 samples of 12 tokens from it at top-p 0.8, EOS
    suppressed."""
    model, tokenizer = rl.smoke_model()
    prompts = [tokenizer.encode(p[:9]) for p in rl.PROMPTS[:4]]
    return model, rl.sample_set(model, tokenizer, prompts, 2, 12, 0, [tr.EOS_ID], top_p=0.8)


def test_chunked_score_equals_the_full_forward_and_its_renormalisation(smoke_tokens, monkeypatch):
    """score() in chunks of 3 rows x 5 positions = tim_rl.response_forward's log-probs
    (full (B, T, V) logits), and its logp_renorm = the forward renormalised on the top-p support
    rebuilt from its logits; the sampler's own log-probs (top-p 0.8) are the renormalised ones, not
    the plain ones."""
    model, tokens = smoke_tokens
    monkeypatch.setattr(rl, "SCORE_ROWS", 3)
    monkeypatch.setattr(rl, "SCORE_COLS", 5)
    got = rl.score(model, tokens, [], truncation=(0.8, 0))
    as_sampled = rl.score(model, tokens, [tr.EOS_ID], truncation=(0.8, 0))
    ro = tr.Rollout(tokens["prompt_ids"], tokens["prompt_mask"], tokens["response_ids"],
                    torch.ones_like(tokens["response_ids"], dtype=torch.bool), tokens["logp_infer"],
                    None, None, [])
    with torch.no_grad():
        plain = tr.response_forward(model, ro).logp
        renorm = tr.response_forward(model, ro, truncation=(0.8, 0, 0.0)).logp
    torch.testing.assert_close(got["logp"], plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(got["logp_renorm"], renorm, atol=1e-5, rtol=0)
    torch.testing.assert_close(as_sampled["logp_renorm"], tokens["logp_infer"], atol=1e-4, rtol=0)
    # the twin: truncation
    assert float((as_sampled["logp"] - tokens["logp_infer"]).abs().max()) > 1e-2


def test_suppressed_ids_get_no_mass_on_either_side(smoke_tokens):
    """A suppressed id is never sampled, and the trainer's scores renormalise without it: the
    log-prob of every other token rises (the suppressed mass is gone), a suppressed token's is -inf,
    and the sampler's log-probs are the trainer's on its own suppressed tokens."""
    model, tokens = smoke_tokens
    tokenizer = tr.CharTokenizer(128)
    sampled = rl.sample_set(model, tokenizer, [tokenizer.encode("ab")] * 4, 1, 30, 0,
                            [tr.EOS_ID, 5, 6, 7])
    assert not bool(torch.isin(sampled["response_ids"], torch.tensor([tr.EOS_ID, 5, 6, 7])).any())
    free, suppressed = (rl.score(model, tokens, [tr.EOS_ID]),
                        rl.score(model, tokens, [tr.EOS_ID, 5, 6, 7]))
    hit = torch.isin(tokens["response_ids"], torch.tensor([5, 6, 7]))
    assert bool((suppressed["logp"] > free["logp"])[~hit].all())
    # the fixture's 96 tokens hold a few of ids 5-7 (seeded; ~3 / 128 per token by chance)
    assert bool(torch.isneginf(suppressed["logp"][hit]).all()) and bool(hit.any())
    scored = rl.score(model, sampled, [tr.EOS_ID, 5, 6, 7])
    torch.testing.assert_close(scored["logp"], sampled["logp_infer"], atol=1e-5, rtol=0)


def test_masked_shares_count_what_each_default_touches():
    """One token at ratio 4 in one of four rows: verl's TIS 2 clips 1 token, TRL's sequence_mask
    (cap 3) drops that sequence, IcePop drops the token; a ratio of 1.5 (the twin) touches none of
    them."""
    logp_infer = torch.full((4, 5), -1.0)
    mask = torch.ones(4, 5, dtype=torch.bool)
    adv = torch.ones(4)
    for ratio, touched in ((4.0, True), (1.5, False)):
        logp = logp_infer.clone()
        logp[2, 3] += math.log(ratio)
        shares = rl.masked_shares(logp, logp_infer, mask, adv)
        expected_tokens = 1 / 20 if touched else 0.0
        for name in ("verl token TIS 2 (clipped)", "IcePop [0.5, 2]"):
            assert shares[name]["tokens"] == pytest.approx(expected_tokens)
        trl = shares["TRL sequence_mask cap 3"]
        assert trl["sequences"] == pytest.approx(0.25 if touched else 0.0)
        assert trl["tokens"] == pytest.approx(0.25 if touched else 0.0)
        assert shares["slime OPSM delta 1e-4"]["sequences"] == 0.0  # positive advantages are kept


def test_masked_shares_of_the_sequence_level_defaults():
    """Five rows of 5 tokens, log p/q per token: 0; -0.002; -0.05 (its advantage < 0); -0.5; one
    token at 1e-5. Each default drops exactly the rows its rule names: verl's Geo-RS (geometric mean
    outside [1/1.001, 1/0.999]) rows 2-5, slime's geometric mask (0.99-1.01) rows 3-5, verl's K3-RS
    (mean k3 > 0.01) rows 4-5, OPSM (A < 0, k1 > 1e-4) row 3, slime's mis.yaml (its 1e-4 veto) row
    5 whole, IcePop that row's one token."""
    d = torch.tensor([0.0, -0.002, -0.05, -0.5, 0.0])[:, None].expand(5, 5).clone()
    d[4, 0] = math.log(1e-5)
    logp_infer = torch.full((5, 5), -1.0)
    mask = torch.ones(5, 5, dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0, 1.0])
    shares = rl.masked_shares(logp_infer + d, logp_infer, mask, adv)
    sequences = {name: round(5 * v["sequences"]) for name, v in shares.items()}
    assert sequences == {"verl token TIS 2 (clipped)": 0, "TRL sequence_mask cap 3": 0,
                         "IcePop [0.5, 2]": 1, "geometric mask 0.99-1.01 (slime, SkyRL)": 3,
                         "verl Geo-RS 0.999-1.001": 4, "verl K3-RS (seq_mean_k3 0.01)": 2,
                         "slime OPSM delta 1e-4": 1, "slime mis.yaml default": 1}
    assert shares["slime mis.yaml default"]["tokens"] == pytest.approx(5 / 25)
    assert shares["IcePop [0.5, 2]"]["tokens"] == pytest.approx(1 / 25)


def test_gap_bins_and_the_degenerate_rows():
    """gap_by's shares add to 1 and put each token in its bin; a row that loops is degenerate, a row
    of distinct tokens is not."""
    d = torch.tensor([0.1, -0.2, 0.3, 0.4])
    key = torch.tensor([0.005, 0.05, 0.95, 1.0])
    bins = rl.gap_by(d, key, (0.0, 0.01, 0.1, 0.5, 0.9, 1.0))
    assert sum(b["share"] for b in bins) == pytest.approx(1.0)
    assert bins[0]["mean abs log p/q"] == pytest.approx(0.1)
    assert bins[-1]["mean abs log p/q"] == pytest.approx(0.35)
    looping = torch.tensor([[1, 2, 3] * 10, list(range(30))])
    assert rl.degenerate_share(looping) == 0.5


def test_the_preset_at_smoke_size_reads_every_source(tmp_path):
    """The whole preset on the 2-layer Llama (T = 8 and 16), from an empty cache and again from the
    cache: every source at 8, the longest length's four; the floors and the renormalised rows clean
    and near 0, the not-renormalised and temperature rows far from it (the twins) and named as such
    by the doctor."""
    found, info = rl.collect(smoke=True, out=tmp_path)
    again, _ = rl.collect(smoke=True, out=tmp_path)
    assert rl.table(again) == rl.table(found) and info["tie share after"] == 0.0
    rows = {(r["source"], r["T"]): r for r in found}
    # built apart
    assert {s for s, T in rows if T == 8} == set(rl.SOURCES) - {"vLLM CPU bf16 sampler"}
    assert {s for s, T in rows if T == 16} == {"fp32 KV-cache sampler (floor)", "bf16",
                                                "lag: 1 AdamW step, lr 1e-6",
                                                "top_p 0.9, trainer not renormalised",
                                                "top_p 0.9, trainer renormalised"}
    x = "x (mean |log p/q| per token)"
    for T in (8, 16):
        for clean in ("fp32 KV-cache sampler (floor)", "top_p 0.9, trainer renormalised"):
            assert rows[clean, T][x] < 1e-5 and rows[clean, T]["doctor"]["cause"] == "clean"
        assert rows["top_p 0.9, trainer not renormalised", T][x] > 1e-2
        assert rows["top_p 0.9, trainer not renormalised", T]["doctor"]["cause"] == "truncation"
    assert rows["sampler at temperature 0.7, scored at 1.0", 8]["doctor"]["cause"] == "temperature"
    assert rows["bf16", 8][x] > 10 * rows["fp32 KV-cache sampler (floor)", 8][x]
    # the lag step moved the model: its gap is far above the floor at both lengths
    for T in (8, 16):
        floor = rows["fp32 KV-cache sampler (floor)", T][x]
        assert rows["lag: 1 AdamW step, lr 1e-6", T][x] > 10 * floor
    assert info["pieces without a timing"] == [] and info["CPU minutes"] > 0


def test_a_cache_of_another_build_is_refused(tmp_path):
    """A directory whose key.json names other prompts or lengths: one line naming it, nothing
    read."""
    (tmp_path / "key.json").write_text('{"prompts": [[1, 2]]}')
    with pytest.raises(tr.UsageError, match="another build"):
        rl.collect(smoke=True, out=tmp_path)


@pytest.mark.vllm
def test_vllm_suppresses_the_ids_in_its_processed_logprobs():
    """vLLM's CPU build (fp32) with min_tokens = T and EOS as a stop token: every row runs to T, no
    EOS, and its processed log-probs are the trainer's with EOS at -inf (to 1e-3), not the trainer's
    plain ones (the twin: the tiny model puts real mass on EOS after an answer)."""
    if not tr.vllm_available():
        pytest.skip("vLLM is not installed (the second CI environment)")
    base_model_dir = testbed.committed_base()
    tokenizer = tr.load_tokenizer(base_model_dir)
    prompts = [tokenizer.encode(f"{a}+{a}=") for a in range(10, 14)]
    tokens = rl.sample_vllm(base_model_dir, tokenizer, prompts, 2, 8, 0, [tr.EOS_ID], dtype="fp32")
    assert tokens["response_ids"].shape == (8, 8) and not bool(
        (tokens["response_ids"] == tr.EOS_ID).any())
    model = tr.load_model(base_model_dir).eval()
    suppressed, plain = rl.score(model, tokens, [tr.EOS_ID]), rl.score(model, tokens, [])
    assert float((suppressed["logp"] - tokens["logp_infer"]).abs().max()) < 1e-3
    assert float((plain["logp"] - tokens["logp_infer"]).abs().max()) > 1e-2


def test_the_command_as_a_user_types_it(tmp_path):
    """`python -m lab real-lengths --smoke` in a fresh directory prints the table; run again over a
    cache of another build it exits 2 with one line naming the directory."""
    import os
    import subprocess
    import sys

    env = os.environ | {"PYTHONPATH": str(rl.RESULTS.parents[2])}
    command = [sys.executable, "-m", "lab", "real-lengths", "--smoke"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| fp32 KV-cache sampler (floor) | 8 |" in done.stdout
    (tmp_path / "runs" / "real-lengths-smoke" / "key.json").write_text('{"prompts": []}')
    refused = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                             check=False)
    assert refused.returncode == 2
    line = ("lab: error: runs/real-lengths-smoke holds tensors of another build (its key.json "
            "differs): remove it first")
    assert refused.stderr.strip().splitlines() == [line]


def test_cached_only_publishes_what_is_there_and_names_the_rest(tmp_path, monkeypatch):
    """--cached-only over a build missing one piece: nothing is built, that source's row is absent,
    and info names the piece (the published block says so). Without the flag it is built again."""
    rl.collect(smoke=True, out=tmp_path)
    (tmp_path / "T16" / "bf16.safetensors").unlink()
    monkeypatch.setattr(rl, "CACHED_ONLY", True)
    rows, info = rl.collect(smoke=True, out=tmp_path)
    assert ("bf16", 16) not in {(r["source"], r["T"]) for r in rows}
    assert (
        info["not built"] == ["T = 16: bf16"]
        and not (tmp_path / "T16" / "bf16.safetensors").exists()
    )
    assert "Not built" in rl.section(rows, info)
    monkeypatch.setattr(rl, "CACHED_ONLY", False)
    rows, info = rl.collect(smoke=True, out=tmp_path)
    assert ("bf16", 16) in {(r["source"], r["T"]) for r in rows} and info["not built"] == []
