"""Compare tim_rl's corrections and losses with the framework goldens of make_goldens.py. Prints a table.

Run from the repository root in tim_rl's environment: `python parity/compare.py [--cases PATTERN] [--detail]`.
A golden (B, T) weight or mask is compared on the mask's tokens (tim_rl defines 0 off the mask); a loss by its
value and its gradient d loss / d logp on every token. Tolerance: relative 1e-6 (float64), NaN equals NaN.
"""

import argparse
import fnmatch
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import tim_rl as T

RTOL, ATOL = 1e-6, 1e-12


def seq_token_mean(per_token, x):
    """slime's per-token loss as a token mean over the batch (what tim_rl's losses return)."""
    m = x["mask"].double()
    return torch.where(x["mask"], per_token, 0.0).sum() / m.sum()


# (case pattern, tim_rl call as written in README's table, f(x) -> value or (loss, logp leaf), golden transform)
# golden transform: None, or f(golden outputs dict, x) -> {"value": ..., "grad": ...}
def _loss(fn):
    def run(x):
        logp = x["logp"].clone().requires_grad_(True)
        return fn(dict(x, logp=logp)), logp
    return run


def _slime_token(g, x):
    n = x["mask"].double().sum()
    per_token = g["per_token_loss"]
    return {"loss": seq_token_mean(per_token, x), "grad_logp": torch.where(x["mask"], g["grad_logp"] / n, 0.0)}


def _product(g, x):
    return {"weights": g["weights"] * g["modified_mask"]}


def _modified(g, x):
    return {"weights": g["modified_mask"]}


A = 1 / 1.01
B_ = 1 / 0.99
MAPPING = [
    # verl rollout_corr_helper
    ("verl.is.token.*", "tis_weights(logp_old, logp_infer, mask, cap=2)",
     lambda x: T.tis_weights(x["logp_old"], x["logp_infer"], x["mask"], cap=2.0), None),
    ("verl.is.sequence.*", "seq_tis_weights(logp_old, logp_infer, mask, cap=5)",
     lambda x: T.seq_tis_weights(x["logp_old"], x["logp_infer"], x["mask"], cap=5.0), None),
    ("verl.is.token.norm.*", "self_normalize_weights(tis_weights(.., cap=2), mask)",
     lambda x: T.self_normalize_weights(T.tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 2.0), x["mask"]),
     None),
    ("verl.is.sequence.norm.*", "self_normalize_seq_weights(seq_tis_weights(.., cap=5), mask)",
     lambda x: T.self_normalize_seq_weights(T.seq_tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 5.0),
                                            x["mask"]), None),
]
for k in ("k1", "k2", "k3"):
    est = getattr(T, f"kl_{k}")
    MAPPING += [
        (f"verl.rs.token_{k}.0.01.*", f"divergence_mask_weights(.., threshold=0.01, estimator=kl_{k})",
         lambda x, e=est: T.divergence_mask_weights(x["logp_old"], x["logp_infer"], x["mask"], 0.01, e), None),
        (f"verl.rs.seq_sum_{k}.0.01.*", f"divergence_seq_sum_mask(.., threshold=0.01, estimator=kl_{k})",
         lambda x, e=est: T.divergence_seq_sum_mask(x["logp_old"], x["logp_infer"], x["mask"], 0.01, e), None),
        (f"verl.rs.seq_mean_{k}.0.01.*", f"divergence_seq_mean_mask(.., threshold=0.01, estimator=kl_{k})",
         lambda x, e=est: T.divergence_seq_mean_mask(x["logp_old"], x["logp_infer"], x["mask"], 0.01, e), None),
        (f"verl.rs.seq_max_{k}.0.01.*", f"divergence_seq_max_mask(.., threshold=0.01, estimator=kl_{k})",
         lambda x, e=est: T.divergence_seq_max_mask(x["logp_old"], x["logp_infer"], x["mask"], 0.01, e), None),
        (f"verl.kl_penalty.{k}.*", f"kl_{k}(logp_old - logp_infer)",
         lambda x, e=est: e(x["logp_old"] - x["logp_infer"]), None),
        (f"slime.approx_kl.{k}.*", f"kl_{k}(logp_old - logp_infer)",
         lambda x, e=est: e(x["logp_old"] - x["logp_infer"]), None),
    ]
MAPPING += [
    ("verl.rs.token_k1.0.99_1.01.*", "copc_mask(.., low=1/1.01, high=1/0.99)  (the same band on rho)",
     lambda x: T.copc_mask(x["logp_old"], x["logp_infer"], x["mask"], A, B_), None),
    ("verl.rs.seq_mean_k1.0.99_1.01.*", "geo_mask_weights(.., low=1/1.01, high=1/0.99)",
     lambda x: T.geo_mask_weights(x["logp_old"], x["logp_infer"], x["mask"], A, B_), None),
    ("verl.rs.seq_mean_k1.0.99_1.01.*", "geo_mask_weights(.., low=0.99, high=1.01)  (the literal lo_hi)",
     lambda x: T.geo_mask_weights(x["logp_old"], x["logp_infer"], x["mask"], 0.99, 1.01), None),
    ("verl.rs.seq_sum_k1.0.99_1.01.*", "seq_mask_weights(.., low=1/1.01, high=1/0.99) > 0",
     lambda x: (T.seq_mask_weights(x["logp_old"], x["logp_infer"], x["mask"], A, B_) > 0).double(), None),
    ("verl.agg_loss.token-mean.*", "pg_loss(logp, adv, mask)",
     _loss(lambda x: T.pg_loss(x["logp"], x["adv"], x["mask"])), None),
    ("verl.loss.vanilla.*", "ppo_loss(logp, logp_old, adv, mask)  (eps 0.2 / 0.28)",
     _loss(lambda x: T.ppo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"])), None),
    ("verl.loss.vanilla.tis2.*", "ppo_loss(logp, logp_old, adv, mask, weights=tis_weights(.., cap=2))",
     _loss(lambda x: T.ppo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"],
                                weights=T.tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 2.0))), None),
    ("verl.loss.vanilla.bypass.*", "ppo_loss(logp, logp_infer, adv, mask)  (p_prox := q)",
     _loss(lambda x: T.ppo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"])), None),
    ("verl.loss.cispo.low1.0.*", "cispo_loss(logp, logp_infer, adv, mask, eps_high=0.28)",
     _loss(lambda x: T.cispo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.28)), None),
    ("verl.loss.cispo.low0.2.*", "cispo_loss(logp, logp_infer, adv, mask, eps_high=0.28)  (no lower clip)",
     _loss(lambda x: T.cispo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.28)), None),
    ("verl.loss.reinforce.tis2.*", "pg_loss(logp, adv, mask, weights=tis_weights(.., cap=2))",
     _loss(lambda x: T.pg_loss(x["logp"], x["adv"], x["mask"],
                               weights=T.tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 2.0))), None),
    # slime
    ("slime.mis.truncate.token.*", "tis_weights(.., cap=2)",
     lambda x: T.tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 2.0), None),
    ("slime.mis.mask.token.*", "mis_weights(.., low=0.5, high=5)",
     lambda x: T.mis_weights(x["logp_old"], x["logp_infer"], x["mask"], 0.5, 5.0), _product),
    ("slime.mis.truncate.sequence.*", "seq_tis_weights(.., cap=5)",
     lambda x: T.seq_tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 5.0), None),
    ("slime.mis.mask.sequence.*", "seq_mask_weights(.., low=0, high=3)",
     lambda x: T.seq_mask_weights(x["logp_old"], x["logp_infer"], x["mask"], 0.0, 3.0), _product),
    ("slime.mis.mask.geometric.*", "geo_mask_weights(.., low=0.99, high=1.01)",
     lambda x: T.geo_mask_weights(x["logp_old"], x["logp_infer"], x["mask"], 0.99, 1.01), _modified),
    ("slime.mis.truncate.token.norm.*", "self_normalize_weights(tis_weights(.., cap=2), mask)",
     lambda x: T.self_normalize_weights(T.tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 2.0), x["mask"]),
     None),
    ("slime.mis.truncate.sequence.norm.*", "self_normalize_seq_weights(seq_tis_weights(.., cap=5), mask)",
     lambda x: T.self_normalize_seq_weights(T.seq_tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 5.0),
                                            x["mask"]), None),
    ("slime.vanilla_tis_function.0.0_2.0.*", "tis_weights(.., cap=2)",
     lambda x: T.tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 2.0), None),
    ("slime.icepop_function.0.5_5.0.*", "mis_weights(.., low=0.5, high=5)",
     lambda x: T.mis_weights(x["logp_old"], x["logp_infer"], x["mask"], 0.5, 5.0), None),
    ("slime.opsm.0.0001.*", "opsm_mask(logp, logp_infer, adv, mask, delta=1e-4)",
     lambda x: T.opsm_mask(x["logp"], x["logp_infer"], x["adv"], x["mask"], 1e-4), None),
    ("slime.opsm.5.0.*", "opsm_mask(logp, logp_infer, adv, mask, delta=5)",
     lambda x: T.opsm_mask(x["logp"], x["logp_infer"], x["adv"], x["mask"], 5.0), None),
    ("slime.approx_kl.low_var_kl.*", "kl_k3(logp_old - logp_infer)",
     lambda x: T.kl_k3(x["logp_old"] - x["logp_infer"]), None),
    ("slime.ppo.*", "ppo_loss(logp, logp_old, adv, mask)  (vs slime's per-token loss, token-mean)",
     _loss(lambda x: T.ppo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"])), _slime_token),
    ("slime.cispo.1.0.*", "cispo_loss(logp, logp_infer, adv, mask, eps_high=0.28)  (token-mean)",
     _loss(lambda x: T.cispo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.28)), _slime_token),
    ("slime.cispo.0.2.*", "cispo_loss(logp, logp_infer, adv, mask, eps_high=0.28)  (no lower clip)",
     _loss(lambda x: T.cispo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.28)), _slime_token),
    # prime-rl
    ("prime_rl.dppo.*", "dppo_loss(logp, logp_infer, adv, mask, delta=0.2)",
     _loss(lambda x: T.dppo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.2)), None),
    ("prime_rl.default.*", "dppo_loss(.., delta=0.2) + k2_penalty(.., coef=2e-3)  (kl_tau = coef / 2)",
     _loss(lambda x: T.dppo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.2)
           + T.k2_penalty(x["logp"], x["logp_infer"], x["mask"], 2e-3)), None),
    ("prime_rl.kl_only.*", "k2_penalty(logp, logp_infer, mask, coef=2e-3)  (kl_tau = coef / 2)",
     _loss(lambda x: T.k2_penalty(x["logp"], x["logp_infer"], x["mask"], 2e-3)), None),
    ("prime_rl.kl_only.*", "k2_penalty(logp, logp_infer, mask, coef=1e-3)  (README: coef = kl_tau)",
     _loss(lambda x: T.k2_penalty(x["logp"], x["logp_infer"], x["mask"], 1e-3)), None),
    # TRL
    ("trl.is.token_truncate.None_2.0.*", "tis_weights(.., cap=2)",
     lambda x: T.tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 2.0), None),
    ("trl.is.token_mask.0.5_5.0.*", "mis_weights(.., low=0.5, high=5)",
     lambda x: T.mis_weights(x["logp_old"], x["logp_infer"], x["mask"], 0.5, 5.0), None),
    ("trl.is.sequence_truncate.None_5.0.*", "seq_tis_weights(.., cap=5)",
     lambda x: T.seq_tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 5.0), None),
    ("trl.is.sequence_mask.None_3.0.*", "seq_mask_weights(.., low=0, high=3)",
     lambda x: T.seq_mask_weights(x["logp_old"], x["logp_infer"], x["mask"], 0.0, 3.0), None),
    ("trl.is.sequence_mask.0.5_3.0.*", "seq_mask_weights(.., low=0.5, high=3)",
     lambda x: T.seq_mask_weights(x["logp_old"], x["logp_infer"], x["mask"], 0.5, 3.0), None),
    ("trl.opsm.0.0001.*", "opsm_mask(logp, logp_infer, adv, mask, delta=1e-4)",
     lambda x: T.opsm_mask(x["logp"], x["logp_infer"], x["adv"], x["mask"], 1e-4), None),
    ("trl.opsm.5.0.*", "opsm_mask(logp, logp_infer, adv, mask, delta=5)",
     lambda x: T.opsm_mask(x["logp"], x["logp_infer"], x["adv"], x["mask"], 5.0), None),
    ("trl.loss.bnpo.token.*", "ppo_loss(logp, logp_old, adv, mask)",
     _loss(lambda x: T.ppo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"])), None),
    ("trl.loss.dapo.token.*", "ppo_loss(logp, logp_old, adv, mask)",
     _loss(lambda x: T.ppo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"])), None),
    ("trl.loss.cispo.token.*", "cispo_loss(logp, logp_old, adv, mask, eps_high=0.28)  (TRL epsilon_high=1.28)",
     _loss(lambda x: T.cispo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"], 0.28)), None),
    ("trl.loss.bnpo.token.token_truncate.*", "ppo_loss(.., weights=tis_weights(logp_old, logp_infer, mask, 2))",
     _loss(lambda x: T.ppo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"],
                                weights=T.tis_weights(x["logp_old"], x["logp_infer"], x["mask"], 2.0))), None),
    ("trl.loss.bnpo.token.sequence_mask.*", "ppo_loss(.., weights=seq_mask_weights(.., 0, 3))",
     _loss(lambda x: T.ppo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"],
                                weights=T.seq_mask_weights(x["logp_old"], x["logp_infer"], x["mask"], 0.0, 3.0))),
     None),
    ("trl.loss.bnpo.token.opsm.*", "ppo_loss(.., weights=opsm_mask(logp, logp_infer, adv, mask, 1e-4))",
     _loss(lambda x: T.ppo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"],
                                weights=T.opsm_mask(x["logp"].detach(), x["logp_infer"], x["adv"], x["mask"], 1e-4))),
     None),
]


def matches(case, pattern):
    """pattern 'NAME.*' matches NAME.<input set> only: 'verl.is.token.*' skips 'verl.is.token.norm.ragged'."""
    return case.rpartition(".")[0] == pattern.removesuffix(".*")


def where_differs(a, b):
    a, b = torch.broadcast_tensors(a, b)
    close = torch.isclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
    return ~close


def compare_case(entry, golden, x):
    case = entry["case"]
    outs = {k.split("/", 1)[1]: golden[k] for k in entry["outputs"]}
    rows = []
    for pattern, call, fn, transform in MAPPING:
        if not matches(case, pattern):
            continue
        want = transform(outs, x) if transform else outs
        got = fn(x)
        problems = []
        if isinstance(got, tuple):  # a loss: value and gradient
            loss, logp = got
            (grad,) = torch.autograd.grad(loss, logp, allow_unused=True, materialize_grads=True)
            for name, a, b in (("value", want["loss"], loss.detach()), ("grad", want["grad_logp"], grad)):
                bad = where_differs(a.double(), b.double())
                if bad.any():
                    idx = bad.nonzero()[0].tolist()
                    ga, gb = a.broadcast_to(bad.shape)[tuple(idx)], b.broadcast_to(bad.shape)[tuple(idx)]
                    problems.append(f"{name}: {int(bad.sum())} differ, e.g. {idx} framework {float(ga):.6g} "
                                    f"tim_rl {float(gb):.6g}")
        else:
            key = next(iter(want))
            a = want[key].double()
            b = got.detach().double()
            a, b = torch.broadcast_tensors(a, b) if a.shape != b.shape else (a, b)
            bad = where_differs(a, b) & x["mask"]
            if bad.any():
                idx = bad.nonzero()[0].tolist()
                lr = float((x["logp_old"] - x["logp_infer"])[tuple(idx)])
                problems.append(f"{int(bad.sum())}/{int(x['mask'].sum())} masked tokens differ, e.g. {idx} "
                                f"(log rho {lr:.4g}): framework {float(a[tuple(idx)]):.6g} tim_rl "
                                f"{float(b[tuple(idx)]):.6g}")
        rows.append((case, call, "equal" if not problems else "differs", "; ".join(problems)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="*", help="fnmatch pattern over case names")
    p.add_argument("--detail", action="store_true", help="one line per case and input set")
    args = p.parse_args()
    meta = json.loads((HERE / "goldens.json").read_text())
    golden = load_file(str(HERE / "goldens.safetensors"))
    sets = {}
    for s in meta["input_sets"]:
        x = {k: golden[f"input/{s}/{k}"] for k in ("logp", "logp_old", "logp_infer", "mask", "adv")}
        x["mask"] = x["mask"].bool()
        sets[s] = x
    results, unmapped = [], []
    for entry in meta["cases"]:
        if not fnmatch.fnmatchcase(entry["case"], args.cases):
            continue
        rows = compare_case(entry, golden, sets[entry["input_set"]])
        results += rows
        if not rows:
            unmapped.append(entry["case"])
    if args.detail:
        for case, call, status, info in results:
            print(f"{status:7s} {case:48s} {call}\n        {info}" if info else f"{status:7s} {case:48s} {call}")
    # summary per (case without input set, tim_rl call)
    summary = {}
    for case, call, status, info in results:
        head, _, s = case.rpartition(".")
        row = summary.setdefault((head, call), {"equal": [], "differs": [], "first": ""})
        row[status].append(s)
        if status == "differs" and not row["first"]:
            row["first"] = f"[{s}] {info}"
    print(f"\n{'golden case':42s} | {'tim_rl call':70s} | result")
    for (head, call), row in summary.items():
        verdict = "equal" if not row["differs"] else f"differs on {','.join(row['differs'])}"
        print(f"{head:42s} | {call:70s} | {verdict}")
        if row["first"]:
            print(f"{'':42s} |   {row['first']}")
    n_eq = sum(1 for r in summary.values() if not r["differs"])
    print(f"\n{len(summary)} pairs: {n_eq} equal on every input set, {len(summary) - n_eq} differ somewhere")
    heads = sorted({c.rpartition('.')[0] for c in unmapped})
    print(f"no tim_rl counterpart ({len(heads)}): {', '.join(heads)}")


if __name__ == "__main__":
    main()
