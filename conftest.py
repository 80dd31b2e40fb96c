"""What test_tim_rl.py (the teaching properties) and test_pipeline.py (the pipeline, engine, CLI, lab and notebook)
share: the Hypothesis profiles, one tolerance, the helpers both call, and the order pytest runs them in (the teaching
properties first, the notebook last, as in the single file they came from)."""

from __future__ import annotations

import math
import os

import torch
from hypothesis import HealthCheck, settings

import experiments as ex
import tim_rl as tr

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

FP32_ATOL = 1e-5  # token_logprobs against log_softmax in float32 (V up to 1000, logits up to 30)
# the banner of tim_rl.py's fast-path section: the copy-tests and the reading order both name it
FAST_PATHS = "fast paths (chunked log-probs)"


def pytest_collection_modifyitems(items):
    """test_tim_rl.py first, then test_pipeline.py, the notebook last (alphabetically test_pipeline.py would come
    first): a failing property shows before minutes of pipeline, as in the single file these tests came from."""
    items.sort(key=lambda item: (item.path.name != "test_tim_rl.py", item.get_closest_marker("notebook") is not None))


# ---- corrections in the RL step: each arm's per-token weight on a hand-made batch ----


def _arm_weights(correction, logp_now, logp_prox, logp_old, logp_infer, adv, **cfg):
    """effective_token_weights of the arm's loss (plus --k2-coef's term), composed as update_on_batch
    does, on a hand-made (B, 1) batch (K = V = 2 top-k for SC)."""
    cfg = tr.RLConfig(correction=correction, **cfg)
    mask = torch.ones_like(logp_now, dtype=torch.bool)
    logp = logp_now.clone().requires_grad_(True)
    x = tr.LossInputs(logp, logp.detach(), logp_prox, logp_old, logp_infer, logp[..., None], logp_infer[..., None],
                      adv, mask)
    loss = tr.ARMS[correction].loss(cfg, x)
    if cfg.k2_coef > 0:
        loss = loss + tr.k2_penalty(logp, logp_infer, mask, cfg.k2_coef)
    return tr.effective_token_weights(loss, logp, adv, mask)


# ---- device-following: what a function builds on the host ----

_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.rand, torch.randn, torch.randint,
              torch.randperm, torch.tensor, torch.as_tensor, torch.linspace, torch.logspace, torch.eye,
              torch.empty_strided, torch.normal}


class HostFactoryWatch(torch.overrides.TorchFunctionMode):
    """Records each non-scalar tensor a torch factory builds without an explicit device=, and each .cpu() copy, called
    from `files`: on a GPU such a tensor lands on the CPU (a crash when mixed with the inputs, or a host copy)."""

    def __init__(self, files=(tr.__file__, ex.__file__)):
        super().__init__()
        self.files, self.found = set(files), []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import sys

        out = func(*args, **(kwargs or {}))
        built = func in _FACTORIES and "device" not in (kwargs or {}) and isinstance(out, torch.Tensor) and out.dim()
        if built or func is torch.Tensor.cpu:  # a tensor built on the host, or one copied there
            frame = sys._getframe(1)
            while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back  # the first caller outside torch itself
            if frame is not None and frame.f_code.co_filename in self.files:
                self.found.append(f"{func.__name__} in {frame.f_code.co_name} (line {frame.f_lineno})")
        return out


# ---- the mismatch doctor: hand-made tensors ----


def _doctor_tensors(B=128, T=6, V=12, seed=0, tau=1.0, top_k=0, noise=0.0, full=False):
    """Tokens sampled from a sampler q over V ids (its logits z / tau + noise, renormalised on its top_k when given)
    and the trainer's p = softmax(z) at them: (logp_train, logp_infer, mask), rows of 3..T tokens, and with `full`
    the trainer's log-probs of every id (B, T, V)."""
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(B, T, V, generator=g)  # (B, T, V)
    q_logits = z / tau + noise * torch.randn(B, T, V, generator=g)
    if top_k:
        q_logits = q_logits.masked_fill(q_logits < q_logits.topk(top_k, -1).values[..., -1:], -math.inf)
    logq = q_logits.log_softmax(-1)
    ids = torch.multinomial(logq.exp().reshape(-1, V), 1, generator=g).reshape(B, T, 1)
    mask = torch.arange(T) < torch.randint(3, T + 1, (B, 1), generator=g)  # (B, T)
    out = z.log_softmax(-1).gather(-1, ids)[..., 0], logq.gather(-1, ids)[..., 0], mask
    return (*out, z.log_softmax(-1)) if full else out
