"""Each numbered finding of issue 56 (trust where users copy), re-run on today's tim_rl: the case
the review reported and what tim_rl gives now. `python lab/parity/reproduce_issue56.py` (a few
seconds; the CLI items run `python tim_rl.py` as subprocesses in a temporary directory)."""

import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import tim_rl as tr

ROOT = Path(__file__).resolve().parents[2]


def show(item: str, what: str, value) -> None:
    print(f"{item:>4}  {what}: {value}")


def main() -> None:
    # 1. slime's geometric mask mode weights kept sequences by exp(mean log rho)
    q = torch.full((1, 2), -1.0)
    p = q + torch.tensor([[0.10, -0.05]])
    m = torch.ones(1, 2, dtype=torch.bool)
    show(
        "1",
        "geo_mask_weights(weighted=True) [slime 1.0253 x2]",
        tr.geo_mask_weights(p, q, m, 0.9, 1.1, weighted=True).tolist(),
    )
    # 2. / 3. slime's CISPO reductions
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    lp = torch.full((2, 3), -1.0)
    adv = torch.tensor([[1.0], [-1.0]])
    show(
        "2",
        "cispo_loss agg=sample-mean [slime 0.0; token mean -0.5]",
        round(float(tr.cispo_loss(lp, lp, adv, mask, agg="sample-mean")), 6),
    )
    mask = torch.tensor([[0, 0], [1, 1]], dtype=torch.bool)
    show(
        "3",
        "cispo_loss agg=token-mean-min1 [slime 0.667; token mean 1.0]",
        round(
            float(
                tr.cispo_loss(lp[:, :2], lp[:, :2], torch.ones(2, 1), mask, agg="token-mean-min1")
            ),
            4,
        ),
    )
    # 4. verl decoupled vs bypass
    lp = torch.full((1, 4), -1.0)
    q = lp - torch.tensor([[0.0, 0.0, 1.0, -1.0]])
    m = torch.ones(1, 4, dtype=torch.bool)
    w = tr.divergence_mask_weights(lp, q, m, 0.01)
    show(
        "4",
        "bypass (weights) / decoupled (mask) [verl 0.5 / 1.0]",
        (
            float(tr.pg_loss(lp, torch.ones(1, 1), m, weights=w)),
            float(tr.pg_loss(lp, torch.ones(1, 1), m & (w > 0))),
        ),
    )
    # 5. / 6. / 7. the doctor on tiny, short and skewed batches
    g = torch.Generator().manual_seed(
        0
    )  # the sampler's noise on the trainer's log-probs: q = p + noise
    p = -torch.rand(1, 30, generator=g)
    show(
        "5",
        "1-row bf16-like batch: cause, outliers verdict",
        _cause(
            tr.diagnose_mismatch(
                p, p + 0.003 * torch.randn(1, 30, generator=g), torch.ones(1, 30, dtype=torch.bool)
            )
        ),
    )
    p = -torch.rand(256, 2, generator=g)
    show(
        "6",
        "256 rows of 2 tokens, symmetric noise: cause, padding verdict",
        _cause(
            tr.diagnose_mismatch(
                p, p + 0.05 * torch.randn(256, 2, generator=g), torch.ones(256, 2, dtype=torch.bool)
            ),
            "padding",
        ),
    )
    mask = torch.zeros(64, 2000, dtype=torch.bool)
    mask[:4] = True
    mask[4:, :30] = True
    p = -torch.rand(64, 2000, generator=g) * 2
    show(
        "7",
        "4 rows of 2,000 beside 60 of 30, same noise: cause, outliers verdict",
        _cause(tr.diagnose_mismatch(p, p + 0.01 * torch.randn(64, 2000, generator=g), mask)),
    )
    # 9. one IcePop band
    show(
        "9",
        "ICEPOP_BAND and mis_weights' default band",
        (tr.ICEPOP_BAND, tr.mis_weights.__defaults__),
    )
    # 11. / 12. fp16 inputs and dppo's sum
    p = torch.tensor([[12.0, 0.0]], dtype=torch.float16).requires_grad_(True)
    q = torch.zeros(1, 2, dtype=torch.float16)
    m = torch.ones(1, 2, dtype=torch.bool)
    (grad,) = torch.autograd.grad(tr.ppo_loss(p - 13, q - 13, torch.ones(1), m), p)
    show("11", "ppo_loss fp16, log p/q = 12: gradient finite", bool(torch.isfinite(grad).all()))
    lp = torch.full((8, 1024), -1.0, requires_grad=True)
    loss = tr.dppo_loss(
        lp, lp.detach() - 100.0, torch.ones(8), torch.ones(8, 1024, dtype=torch.bool), delta=2.0
    )
    show(
        "12",
        "dppo_loss log r = 100 on 8 x 1,024 tokens: finite",
        math.isfinite(float(loss.detach())),
    )
    # 13. tis_weights' needs line
    show("13", "tis_weights needs:", tr.tis_weights.__doc__.split("needs:")[1].split())
    # 8. / 10. the CLI
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp, "x.pt")
        bad.write_text("not a torch file")
        show("8", "doctor on a text file saved as x.pt", _run(["doctor", str(bad)], tmp))
        show(
            "10",
            "train --name ../../etc",
            _run(["train", "--name", "../../etc", "--out-dir", tmp], tmp),
        )
        Path(tmp, "run").mkdir()
        Path(tmp, "run", "metrics.jsonl").write_text("")
        show(
            "10",
            "train into a directory that holds a run",
            _run(["train", "--out-dir", tmp, "--steps", "1"], tmp),
        )


def _cause(found, name="outliers") -> tuple:
    return found.cause, next(s["verdict"] for s in found.evidence if s["name"] == name)


def _run(args: list[str], cwd: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tim_rl.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    return f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1]}"


if __name__ == "__main__":
    main()
