"""The lab's tests: the helpers they share with test_tim_rl.py (which defines them and the
Hypothesis profiles, so that it runs alone), and the order pytest runs them in (the teaching
properties first, the notebook last)."""

from __future__ import annotations

import tim_rl as tr
from lab import experiments as ex

# the lab's tests import these from here
from test_tim_rl import FP32_ATOL, _arm_weights, _doctor_tensors  # noqa: F401
from test_tim_rl import HostFactoryWatch as _TimRLWatch


class HostFactoryWatch(_TimRLWatch):
    """test_tim_rl's watch over tim_rl.py and the lab's experiments.py."""

    def __init__(self, files=(tr.__file__, ex.__file__)):
        super().__init__(files)


# the banner of tim_rl.py's fast-path section: the copy-tests and the reading order both name it
FAST_PATHS = "fast paths (chunked log-probs)"


def pytest_collection_modifyitems(items):
    """test_tim_rl.py first, then test_pipeline.py, the notebook last (alphabetically
    test_pipeline.py would come first): a failing property shows before minutes of pipeline, as in
    the single file these tests came from."""
    items.sort(
        key=lambda item: (
            item.path.name != "test_tim_rl.py",
            item.get_closest_marker("notebook") is not None,
        )
    )
