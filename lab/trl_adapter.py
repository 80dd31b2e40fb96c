"""TRL's GRPOTrainer with a tim_rl correction as its vLLM importance weight (lab: tested in the vLLM
environment).

The weight-style corrections ride through TRL's GRPOTrainer, which multiplies its per-token PPO loss
by inputs["importance_sampling_ratio"] (TRL 1.16, vLLM on, a token_* mode). Score centering cannot:
it needs the sampler's top-k log-probs, which TRL does not request from vLLM. COPC cannot: it needs
a critic. DPPO cannot: its mask depends on the current log-prob's gradient direction, not on a
weight fixed at generation time. OPSM and CISPO are TRL's own (off_policy_mask_threshold,
loss_type="cispo"); the k2 term is a loss, not a weight."""

from __future__ import annotations

import json

import torch

import tim_rl as tr


def _tis_sn(p_old, q, mask):
    """TIS, then self-normalised (verl rollout_is_batch_normalize)."""
    return tr.self_normalize_weights(tr.tis_weights(p_old, q, mask), mask)


TRL_CORRECTIONS = {
    "tis": tr.tis_weights,
    "mis": tr.mis_weights,
    "seq_tis": tr.seq_tis_weights,
    "seq_mask": tr.seq_mask_weights,
    "geo": tr.geo_mask_weights,
    "cis": tr.cis_weights,
    "dlc": tr.dlc_weights,
    "tis_sn": _tis_sn,
} | tr.RS_ARMS


def trl_weights(
    correction: str,
    old_per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """A tim_rl weight from TRL's tensors (trainer-engine p_old, vLLM's q, int mask). (B, T) -> (B,
    T) detached.

    TRL pads sampling log-probs with 0 and marks positions vLLM gave none with NaN: those get the
    correction's documented value for a non-finite token."""
    tr._check_choice(
        "correction", correction, sorted(TRL_CORRECTIONS)
    )  # the weights that ride through TRL
    p_old = old_per_token_logps.detach().float()
    return TRL_CORRECTIONS[correction](
        p_old, sampling_per_token_logps.float(), completion_mask.bool()
    )


def check_trl_args(args) -> None:
    """Refuse GRPOConfig settings under which a tim_rl weight would be silently wrong or ignored
    (TRL 1.16)."""
    if not getattr(args, "use_vllm", False):
        raise ValueError(
            "use_vllm=False: TRL then has no sampler log-probs, so no tim_rl weight would be "
            "applied"
        )
    if getattr(args, "loss_type", None) == "vespo":
        raise ValueError(
            "loss_type='vespo' takes log(importance_sampling_ratio) and sums it over unmasked "
            "padding: tim_rl's weights are 0 there (and where a mask drops a token); use "
            "another loss_type"
        )
    extra = (
        getattr(args, "generation_kwargs", None) or {}
    )  # TRL merges these into vLLM's sampling settings last
    extra = json.loads(extra) if isinstance(extra, str) else extra
    top_p, top_k, min_p = (
        extra.get(k, getattr(args, k, None)) for k in ("top_p", "top_k", "min_p")
    )
    if (top_p if top_p is not None else 1.0) < 1 or (top_k or 0) > 0 or (min_p or 0) > 0:
        raise ValueError(
            "top_p / top_k / min_p truncate sampling: vLLM returns log-probs renormalised over "
            "the kept tokens, TRL 1.16 computes the trainer's over the full vocabulary, so "
            "every weight would carry the kept mass S (TRL #6789), and vLLM 0.32 gives TRL no "
            "kept support to renormalise on; set top_p=1.0, top_k=0, min_p=None (or use "
            "tim_rl's loop: --top-p, renormalised)"
        )
    if not getattr(args, "vllm_importance_sampling_correction", True):
        raise ValueError(
            "vllm_importance_sampling_correction=False: TRL would compute the tim_rl weight "
            "and never apply it; set it to True"
        )


def trl_grpo_trainer(correction: str = "tis", vllm_dtype: str | None = None, **trainer_kwargs):
    """trl.GRPOTrainer(**trainer_kwargs) whose vLLM importance weight is a tim_rl correction; logs
    tim_rl/*.

    - The weight multiplies TRL's per-token loss (clipped PPO on p / p_old, p_old TRL's proximal
    log-probs), i.e. it covers p_old / q as in tim_rl's decoupled-PPO arms. Needs
    GRPOConfig(use_vllm=True, vllm_importance_sampling_mode="token_truncate" or "token_mask"); TRL's
    own sampling/importance_sampling_ratio/* metrics describe TRL's ratio, not this weight.
    - tr.mismatch_metrics(old_per_token_logps, sampling_per_token_logps) are logged as tim_rl/k1,
    tim_rl/k3, ...
    - vllm_dtype ("fp32" | "bf16" | "fp16") sets vLLM's dtype, which GRPOConfig cannot.
    - On vLLM's CPU build a colocated vLLM is synced with tr.reload_vllm_weights (TRL's
    per-parameter sync breaks there); on a GPU TRL's own sync is kept. loss_type="vespo" and a
    disabled correction are refused."""
    import functools
    import unittest.mock

    import trl.generation.vllm_generation as trl_vllm
    from trl import GRPOTrainer

    tr._check_choice(
        "correction", correction, sorted(TRL_CORRECTIONS)
    )  # the weights that ride through TRL
    if "args" in trainer_kwargs:
        check_trl_args(trainer_kwargs["args"])

    class TimRLGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            """TRL's rollout with its importance_sampling_ratio from trl_weights."""
            out = super()._generate_and_score_completions(inputs)
            p_old, q = out.get("old_per_token_logps"), out.get("sampling_per_token_logps")
            if p_old is None or q is None:  # no vLLM, or TRL's correction off: nothing to weight
                return out
            mask = out["completion_mask"]
            out["importance_sampling_ratio"] = trl_weights(correction, p_old, q, mask)  # TIM
            mode = "train" if self.model.training else "eval"
            for key, value in tr.mismatch_metrics(p_old, q, out["completion_mask"].bool()).items():
                self._metrics[mode][f"tim_rl/{key}"].append(value)
            return out

    if vllm_dtype is not None:
        tr._check_choice("vllm_dtype", vllm_dtype, sorted(tr.VLLM_DTYPES))
    threads = tr._vllm_environment()
    # vLLM's class as TRL imported it; with vllm_dtype, pinned for this call
    llm = getattr(trl_vllm, "LLM", None)
    llm = llm if vllm_dtype is None else functools.partial(llm, dtype=tr.VLLM_DTYPES[vllm_dtype])
    with unittest.mock.patch.object(trl_vllm, "LLM", llm, create=True):
        trainer = TimRLGRPOTrainer(**trainer_kwargs)
    torch.set_num_threads(threads)
    generation = getattr(trainer, "vllm_generation", None)
    colocated = trainer.use_vllm and generation is not None and generation.mode == "colocate"
    if colocated and tr._vllm_on_cpu():
        # vLLM's CPU build repacks Linear weights, which breaks TRL's per-parameter sync; on a GPU
        # TRL's own sync (PEFT merge, ZeRO-3 gather, sleep-mode wake-up) stays in charge
        def sync_weights():
            """TRL's weight sync, done by reloading vLLM's model from the trainer's parameters."""
            tr.reload_vllm_weights(generation.llm, trainer.model.named_parameters())

        generation.sync_weights = sync_weights
    return trainer
