"""The largest |log p/q| a published preset's run meets: where LOG_RATIO_CLAMP (20) could move a
number.

Issue 44: the clamp fix (raw log-ratios summed, the sum bounded) moves seq_tis / seq_mask / geo /
self_normalize_seq / opsm / DLC weights only where some token's |log p/q| > 20, and dppo only past
|log r| > 20. Per preset, the arms those functions serve at its most extreme setting run for one
seed with the preset's steps; every _log_ratio call (every token log-ratio any correction or metric
reads) and every _sequence_log_ratio sum is watched, and the maxima printed.

    OMP_NUM_THREADS=1 python lab/parity/max_log_ratio.py runs/max-log-ratio [ARM-SUBSTRING]
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tim_rl as tr
from lab import experiments, testbed

# (preset, arm label): the affected arms at each preset's largest noise / lag / lowest precision
CASES = (
    ("staleness", f"dppo {experiments.LAG_LABEL}"),
    ("dlc", f"dlc {experiments.LAG_LABEL}"),
    ("dose", "seq_tis @ s=0.8"),
    ("dose", "geo @ s=0.8"),
    ("dose", "dlc @ s=0.8"),
    ("dose", "dppo @ s=0.8"),
    ("dose-long", "seq_tis @ s=0.6"),
    ("dose-long", "geo @ s=0.6"),
    ("corrections-2026", f"opsm {experiments.LAG_LABEL}"),
    ("corrections-2026", f"opsm (s={experiments.DOSE_HARMED:g})"),
)
seen = {"token": 0.0, "sequence": 0.0}


def watch(frame, event, result) -> None:
    """A profiler hook (sys.setprofile) that reads what tr._log_ratio and tr._sequence_log_ratio
    return: the largest |log a/b| on finite generated tokens and the largest |sum_t log rho_t|. It
    observes; tim_rl is not changed."""
    if event != "return" or result is None:
        return
    if frame.f_code is tr._log_ratio.__code__:
        lr, ok = result
        if ok.any():
            seen["token"] = max(seen["token"], float(lr[ok].abs().max()))
    elif frame.f_code is tr._sequence_log_ratio.__code__:
        seen["sequence"] = max(seen["sequence"], float(result[0].abs().max()))


def main(out: Path, only: str = "") -> None:
    """Run every case (whose arm label contains `only`) for seed 0 and print one JSON line per run.
    """
    pc = experiments.PresetConfig(model=str(tr.RLConfig().model))
    for name, label in [(name, label) for name, label in CASES if only in label]:
        preset = experiments.RL_PRESETS[name]
        base = experiments._preset_base(pc, **preset.base)
        if preset.pretrain:
            suffix, change = preset.pretrain
            base.model = str(testbed.ensure_base_model(str(out / f"base-{suffix}"), **change))
        change = dict(preset.arms)[label]
        cfg = tr.RLConfig(**(experiments.asdict(base) | change | {"seed": 0, "out_dir": str(out),
                                                                   "name": f"{name}-{label}"}))
        seen.update(token=0.0, sequence=0.0)
        start = time.process_time()
        sys.setprofile(watch)
        tr.run(cfg)
        sys.setprofile(None)
        cpu = time.process_time() - start
        row = {
            "preset": name,
            "arm": label,
            "steps": cfg.steps,
            "max_token_abs_log_ratio": seen["token"],
            "max_sequence_abs_sum": seen["sequence"],
            "cpu_s": round(cpu),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:3])
