"""lab: the repository's own machinery around tim_rl.py, the reference. It imports tim_rl; tim_rl
never imports it.

Layout (the repository):
    tim_rl.py        the reference, complete in itself: copy it alone (bases/tiny runs its demo)
    test_tim_rl.py   the teaching properties (tim_rl, torch, pytest and hypothesis only)
    tutorial.ipynb   the course (imports tim_rl only)
    lab/             this package:
        experiments.py   presets (one paper claim each, paired seeds), statistics, publish into
                         RESULTS.md, the bench, the doctor's evaluations, the numerics fingerprint
        testbed.py       pre-training the tiny bases (bases/tiny, bases/tiny-moe), the mixed task
        fused.py         compiled GPU passes, tested bitwise against tim_rl's eager paths
        trl_adapter.py   TRL's GRPOTrainer with a tim_rl correction as its vLLM importance weight
        parity/          goldens of verl / TRL / slime / prime-rl functions and their generator
        predictions/     predictions committed before their runs
        figures/         the presets' published plots (RESULTS.md shows them)
        tests/           the pipeline, engine, CLI, lab and notebook tests

    python -m lab compare --preset NAME [--smoke] [--publish]   # a paper's claims on paired seeds
    python -m lab bench                                         # speed / memory ratios side by side
    python -m lab pretrain --out bases/tiny                     # how the committed base was made
"""

import os
import sys
import time
from pathlib import Path


def _openmp_for_a_shared_machine() -> None:
    """OMP_WAIT_POLICY=PASSIVE (waiting threads sleep) when other tasks kept running over 3 looks
    20 ms apart: OpenMP reads it once, when torch loads, so `python -m lab` sets it first."""
    looks = []
    for _ in range(3):  # other runnable tasks: /proc/loadavg's 4th field, "running/total"
        looks.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
        time.sleep(0.02)
    if min(looks) >= 1 and "OMP_WAIT_POLICY" not in os.environ:  # an explicit choice is kept
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


# python -m lab, before torch loads
if sys.orig_argv[1:3] == ["-m", "lab"] and Path("/proc/loadavg").is_file():
    _openmp_for_a_shared_machine()
