"""Golden tensors from the frameworks' own code: verl, slime, prime-rl (fetched sources) and TRL
(installed).

Each framework function is taken FROM ITS SOURCE, not transcribed: the definitions named below are
cut out of the file with `ast` (decorators such as torch.compile / jaxtyped / register_policy_loss
removed, nothing else changed) and executed in a namespace that holds torch and stubs for the
framework's plumbing (config objects, a DataProto placeholder, jaxtyping annotations). The
framework's own small helpers (verl's masked_sum / masked_mean, slime's masked_sum / masked_mean /
truncate / clip / mask, prime-rl's _safe_mean) are cut from the same sources too. TRL is called as
installed: its static get_off_policy_mask directly, GRPOTrainer._compute_loss on a stand-in `self`
that carries only the attributes the method reads (no trainer, no model), and the vLLM
importance-sampling block of _generate_and_score_completions (an `if` inside a 500-line method) cut
out with `ast` and executed as it stands.

Every call runs in float64 on the edge-case batches of issue 44 and writes
  lab/parity/goldens.safetensors  inputs ("input/<set>/<name>") and outputs ("<case>/<name>"),
                                  float64
  lab/parity/goldens.json         per case: framework, repo, path, function, commit (TRL: version
                                  + file sha256), keyword arguments, input tensors, output
                                  tensors, and what the gradient is of.
Regenerate (TRL lives in the vLLM environment; the fetched checkouts are bare git directories):
  python lab/parity/make_goldens.py --verl verl --slime slime --prime-rl prime-rl
  (clones at the commits of lab/parity/README.md; TRL 1.16.0 installed)
"""

import argparse
import ast
import hashlib
import json
import math
import subprocess
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
F64 = torch.float64
KEEP_DECORATORS = {"dataclass"}

# --------------------------------------------------------------------------------------------------
# loading functions from source


def git_show(repo: Path, path: str) -> tuple[str, str]:
    """(text of HEAD:path, HEAD commit) of a bare or normal git directory."""
    commit = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    text = subprocess.run(
        ["git", "-C", str(repo), "show", f"{commit}:{path}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return text, commit


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target)


def exec_definitions(text: str, names: list[str], namespace: dict, origin: str) -> list[str]:
    """Execute the top-level definitions `names` of source `text` in `namespace`; returns decorators
    removed."""
    tree = ast.parse(text)
    kept, stripped = [], []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in names:
            for deco in node.decorator_list:
                if _decorator_name(deco) not in KEEP_DECORATORS:
                    stripped.append(f"{node.name}: @{_decorator_name(deco)}")
            node.decorator_list = [
                d for d in node.decorator_list if _decorator_name(d) in KEEP_DECORATORS
            ]
            kept.append(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in names for t in targets):
                kept.append(node)
    found = set()
    for n in kept:
        if hasattr(n, "name"):
            found.add(n.name)
        else:
            found.update(t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                         if isinstance(t, ast.Name))
    missing = set(names) - found
    if missing:
        raise LookupError(f"{origin}: not found: {sorted(missing)}")
    code = compile(ast.Module(body=kept, type_ignores=[]), origin, "exec")
    exec(code, namespace)  # noqa: S102  the point
    return stripped


class _Subscriptable:
    """jaxtyping's Float[Tensor, "seq"] as an annotation placeholder."""

    def __class_getitem__(cls, item):
        return Any


class ActorConfigStub(dict):
    """verl ActorConfig: the attributes compute_policy_loss_* read (clip ratios, global_batch_info).
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.__dict__.update(kw)
        self.global_batch_info = {}


class AlgoConfigStub:
    """verl AlgoConfig: only for the `not isinstance(config, AlgoConfig)` assertions."""


def load_verl(repo: Path) -> tuple[dict, dict]:
    tf_text, commit = git_show(repo, "verl/utils/torch_functional.py")
    verl_f = {"torch": torch}
    exec_definitions(
        tf_text, ["masked_sum", "masked_mean"], verl_f, "verl/utils/torch_functional.py"
    )
    ns = {"torch": torch, "math": math, "Optional": Optional, "Any": Any,
          "verl_F": types.SimpleNamespace(**{k: verl_f[k] for k in ("masked_sum", "masked_mean")}),
          "DataProto": None, "RolloutCorrectionConfig": None, "PolicyLossConfig": None,
          "ActorConfig": ActorConfigStub, "AlgoConfig": AlgoConfigStub, "DictConfig": dict}
    helper = "verl/trainer/ppo/rollout_corr_helper.py"
    text, _ = git_show(repo, helper)
    stripped = exec_definitions(
        text,
        [
            "SAFETY_BOUND",
            "SUPPORTED_ROLLOUT_RS_OPTIONS",
            "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
            "_parse_rollout_rs_thresholds",
            "compute_rollout_rejection_mask",
            "compute_rs_metrics",
            "compute_rollout_correction_weights",
            "compute_is_metrics",
            "compute_rollout_correction_and_rejection_mask",
            "compute_offpolicy_metrics",
        ],
        ns,
        helper,
    )
    core = "verl/trainer/ppo/core_algos.py"
    text, _ = git_show(repo, core)
    stripped += exec_definitions(
        text,
        [
            "agg_loss",
            "compute_policy_loss_vanilla",
            "compute_policy_loss_gspo",
            "compute_policy_loss_geo_mean",
            "compute_policy_loss_cispo",
            "compute_policy_loss_reinforce",
            "compute_policy_loss_bypass_mode",
            "compute_policy_loss_sapo",
            "kl_penalty",
            "kl_penalty_forward",
        ],
        ns,
        core,
    )
    info = {"repo": "volcengine/verl", "commit": commit, "stripped_decorators": stripped,
            "helpers_from_source": "verl/utils/torch_functional.py: masked_sum, masked_mean"}
    return ns, info


def load_slime(repo: Path) -> tuple[dict, dict]:
    ns = {"torch": torch, "Any": Any, "Namespace": argparse.Namespace, "dist": None, "F": None}
    ppo = "slime/utils/ppo_utils.py"
    text, commit = git_show(repo, ppo)
    stripped = exec_definitions(text, ["compute_approx_kl", "compute_opsm_mask", "compute_gspo_kl",
                                       "compute_policy_loss", "compute_cispo_loss"], ns, ppo)
    mis = "examples/train_infer_mismatch_helper/mis.py"
    text, _ = git_show(repo, mis)
    stripped += exec_definitions(
        text,
        [
            "masked_sum",
            "masked_mean",
            "masked_min",
            "masked_max",
            "metrics_append",
            "calculate_veto_mask",
            "truncate",
            "clip",
            "mask",
            "compute_mis_weights",
            "add_ppl_metrics",
        ],
        ns,
        mis,
    )
    loss = "slime/backends/megatron_utils/loss.py"
    text, _ = git_show(repo, loss)
    stripped += exec_definitions(text, ["vanilla_tis_function", "icepop_function"], ns, loss)
    cp = "slime/backends/megatron_utils/cp_utils.py"
    text, _ = git_show(repo, cp)
    ns["Callable"] = __import__("typing").Callable
    # no context parallelism
    ns["mpu"] = types.SimpleNamespace(get_context_parallel_world_size=lambda: 1)
    stripped += exec_definitions(text, ["get_sum_of_sample_mean"], ns, cp)
    return ns, {"repo": "THUDM/slime", "commit": commit, "stripped_decorators": stripped}


def load_prime_rl(repo: Path) -> tuple[dict, dict]:
    ns = {
        "torch": torch,
        "Tensor": torch.Tensor,
        "Any": Any,
        "Float": _Subscriptable,
        "Bool": _Subscriptable,
        "Int": _Subscriptable,
        "Callable": __import__("typing").Callable,
        "dataclass": __import__("dataclasses").dataclass,
        "field": __import__("dataclasses").field,
        "DefaultLossConfig": object,
        "IPOLossConfig": object,
        "CustomLossConfig": object,
        "LossConfig": object,
    }
    path = "src/prime_rl/trainer/rl/loss.py"
    text, commit = git_show(repo, path)
    stripped = exec_definitions(
        text,
        [
            "LossInputs",
            "LossOutputs",
            "LossFn",
            "_safe_mean",
            "compute_importance_ratio_and_mismatch_kl",
            "default_loss_fn",
            "ce_loss_fn",
            "ref_kl_loss_fn",
            "compute_loss",
        ],
        ns,
        path,
    )
    cfg_path = "packages/prime-rl-configs/src/prime_rl/configs/trainer.py"
    return ns, {
        "repo": "PrimeIntellect-ai/prime-rl",
        "commit": commit,
        "stripped_decorators": stripped,
        "config_defaults_from": (
            f"{cfg_path}: DefaultLossConfig (dppo_mask_low 0.2, dppo_mask_high 0.2, "
            "adv_tau 1.0, kl_tau 1e-3)"
        ),
    }


def load_areal(repo: Path) -> tuple[dict, dict]:
    """AReaL's M2PO mask, log-linear proximal log-probs and SAPO loss, with the constants they read.
    """
    from enum import Enum

    ns = {"torch": torch, "Enum": Enum}
    path = "areal/utils/constants.py"
    text, commit = git_show(repo, path)
    exec_definitions(
        text,
        [
            "ProxApproxMethod",
            "PROX_APPROX_METHOD_LOGLINEAR",
            "PROX_APPROX_METHOD_LINEAR",
            "PROX_APPROX_METHOD_ROLLOUT",
            "PROX_APPROX_METHODS_ALL",
        ],
        ns,
        path,
    )
    actor = "areal/trainer/ppo/actor.py"
    text, _ = git_show(repo, actor)
    stripped = exec_definitions(text, ["compute_prox_logp_approximations", "_apply_m2po_masking",
                                       "_get_m2po_loss_mask"], ns, actor)
    functional = "areal/utils/functional/functional.py"
    text, _ = git_show(repo, functional)
    stripped += exec_definitions(text, ["sapo_loss_fn"], ns, functional)
    return ns, {"repo": "inclusionAI/AReaL", "commit": commit, "stripped_decorators": stripped}


def load_skyrl(repo: Path) -> tuple[dict, dict]:
    """SkyRL's DPPO loss (binary KL); its off-policy correction (off by default) stubbed to
    identity."""
    ns = {"torch": torch, "Optional": Optional, "Tuple": tuple, "Float": _Subscriptable,
          "AlgorithmConfig": object, "PolicyLossType": types.SimpleNamespace(DPPO="dppo"),
          "apply_off_policy_correction": lambda loss, old, rollout, mask, cfg: (loss, mask, {})}
    utils = "skyrl/backends/skyrl_train/utils/torch_utils.py"
    text, commit = git_show(repo, utils)
    exec_definitions(text, ["masked_mean", "safe_exp_delta"], ns, utils)
    path = "skyrl/backends/skyrl_train/utils/ppo_utils.py"
    text, _ = git_show(repo, path)
    stripped = exec_definitions(text, ["dppo_policy_loss", "reduce_loss"], ns, path)
    return ns, {"repo": "NovaSky-AI/SkyRL", "commit": commit, "stripped_decorators": stripped}


ASYNC_SETS = ["ragged", "extreme", "beyond20", "threshold", "nonfinite_out", "nonfinite_in"]


def _versions(x) -> torch.Tensor:
    """Per-token sampler versions for the async goldens: row b's tokens from version 7 - (b % 4) on,
    one version newer from the row's middle on (an in-flight update); -1 (a prompt token) at
    position 0 of the last row."""
    B, T = x["mask"].shape
    rows = 7 - (torch.arange(B) % 4)[:, None] + (torch.arange(T) >= T // 2).long()
    rows[-1, 0] = -1
    return rows


def run_areal(rec: "Recorder", ns: dict, info: dict):
    actor, functional = "areal/trainer/ppo/actor.py", "areal/utils/functional/functional.py"
    for s in ASYNC_SETS:
        x = rec.sets[s]
        mask = x["mask"].bool()
        versions = _versions(x)
        rec.tensors[f"input/{s}/versions"] = versions.double()
        approx = ns["compute_prox_logp_approximations"](
            x["logp_infer"], x["logp"], versions, 9, "loglinear"
        )
        rec.add(
            f"areal.prox_loglinear.{s}",
            "areal",
            info,
            actor,
            "compute_prox_logp_approximations",
            s,
            {"current_version": 9, "method": "loglinear"},
            {
                "old_logp": f"input/{s}/logp_infer",
                "logprobs": f"input/{s}/logp",
                "versions": f"input/{s}/versions",
            },
            {"prox_logp": approx["loglinear"]},
        )
        for threshold in (0.04, 1.0):
            keep = ns["_apply_m2po_masking"](x["logp_infer"], x["logp_old"], mask, threshold)
            rec.add(
                f"areal.m2po.{threshold}.{s}",
                "areal",
                info,
                actor,
                "_apply_m2po_masking",
                s,
                {"m2_threshold": threshold},
                {
                    "old_logp": f"input/{s}/logp_infer",
                    "prox_logp": f"input/{s}/logp_old",
                    "loss_mask": f"input/{s}/mask",
                },
                {"mask": keep},
            )
        logp = rec.leaf(s)
        adv = x["adv"][:, None].expand_as(x["mask"]).contiguous()
        loss, _ = ns["sapo_loss_fn"](logp, x["logp_old"], adv, 1.0, 1.05, mask)
        rec.add(
            f"areal.sapo.{s}",
            "areal",
            info,
            functional,
            "sapo_loss_fn",
            s,
            {"tau_pos": 1.0, "tau_neg": 1.05},
            {
                "logprobs": f"input/{s}/logp",
                "old_logprobs": f"input/{s}/logp_old",
                "advantages": f"input/{s}/adv per token",
                "loss_mask": f"input/{s}/mask",
            },
            {"loss": loss},
            grad=(loss, logp),
        )


def run_skyrl(rec: "Recorder", ns: dict, info: dict):
    path = "skyrl/backends/skyrl_train/utils/ppo_utils.py"
    for s in ASYNC_SETS:
        x = rec.sets[s]
        cfg = types.SimpleNamespace(
            dppo=types.SimpleNamespace(dppo_type="binary_kl", delta_low=0.05, delta_high=0.05),
            off_policy_correction=None,
        )
        logp = rec.leaf(s)
        adv = x["adv"][:, None].expand_as(x["mask"]).contiguous()
        loss, _ = ns["dppo_policy_loss"](logp, x["logp_old"], adv, cfg, x["mask"], x["logp_infer"])
        rec.add(
            f"skyrl.dppo.binary_kl.{s}",
            "skyrl",
            info,
            path,
            "dppo_policy_loss",
            s,
            {"dppo_type": "binary_kl", "delta_low": 0.05, "delta_high": 0.05},
            {
                "log_probs": f"input/{s}/logp",
                "rollout_logprobs": f"input/{s}/logp_infer",
                "advantages": f"input/{s}/adv per token",
                "loss_mask": f"input/{s}/mask",
            },
            {"loss": loss},
            grad=(loss, logp),
            note="SkyRL sums the masked loss (reduce_loss; its advantages carry the token mean's "
                 "scale)",
        )


def run_verl_sapo(rec: "Recorder", ns: dict, info: dict):
    core = "verl/trainer/ppo/core_algos.py"
    cfg = ActorConfigStub(clip_ratio=0.2, tau_pos=1.0, tau_neg=1.05)
    ns["ActorConfig"] = ActorConfigStub
    for s in ASYNC_SETS:
        x = rec.sets[s]
        logp = rec.leaf(s)
        adv = x["adv"][:, None].expand_as(x["mask"])
        loss, _ = ns["compute_policy_loss_sapo"](x["logp_old"], logp, adv, x["mask"], config=cfg)
        rec.add(
            f"verl.loss.sapo.{s}",
            "verl",
            info,
            core,
            "compute_policy_loss_sapo",
            s,
            {"tau_pos": 1.0, "tau_neg": 1.05, "loss_agg_mode": "seq-mean-token-mean"},
            {
                "old_log_prob": f"input/{s}/logp_old",
                "log_prob": f"input/{s}/logp",
                "advantages": f"input/{s}/adv[:, None] broadcast",
                "response_mask": f"input/{s}/mask",
            },
            {"loss": loss},
            grad=(loss, logp),
        )


def load_trl() -> tuple[dict, dict]:
    import trl
    from trl.trainer import grpo_trainer

    path = Path(grpo_trainer.__file__)
    text = path.read_text()
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer")
    method = next(
        n
        for n in cls.body
        if isinstance(n, ast.FunctionDef) and n.name == "_generate_and_score_completions"
    )
    block = next(
        n
        for n in ast.walk(method)
        if isinstance(n, ast.If)
        and ast.unparse(n.test) == "self.use_vllm and self.vllm_importance_sampling_correction"
        and "vllm_importance_sampling_ratio = torch.exp" in ast.unparse(n)
    )
    is_block = compile(
        ast.Module(body=block.body, type_ignores=[]), f"{path}:{block.lineno}", "exec"
    )
    ns = {"GRPOTrainer": grpo_trainer.GRPOTrainer, "is_block": is_block}
    return ns, {
        "repo": "huggingface/trl (pip)",
        "commit": f"trl=={trl.__version__}, grpo_trainer.py sha256 "
        f"{hashlib.sha256(text.encode()).hexdigest()[:16]}",
        "path_installed": str(path),
        "is_block_lines": f"{block.lineno}-{block.end_lineno}",
    }


# --------------------------------------------------------------------------------------------------
# edge-case inputs (issue 44)


def _batch(lr, mask, adv, seed, d_std=0.1):
    """logp_old - logp_infer = lr exactly where finite, both <= 0; logp = logp_old + small noise
    (the update)."""
    g = torch.Generator().manual_seed(seed)
    lr = torch.as_tensor(lr, dtype=F64)
    base = torch.empty(lr.shape, dtype=F64).uniform_(0.05, 0.95, generator=g).log()
    pos = lr >= 0
    logp_old = torch.where(pos, base, base + lr)
    logp_infer = torch.where(pos, base - lr, base)
    logp = (logp_old + d_std * torch.randn(lr.shape, generator=g, dtype=F64)).clamp(max=-1e-4)
    return {"logp": logp, "logp_old": logp_old, "logp_infer": logp_infer,
            "mask": torch.as_tensor(mask, dtype=F64), "adv": torch.as_tensor(adv, dtype=F64)}


def input_sets() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(44)
    sets = {}
    mask = [
        [1, 1, 0, 1, 1, 1, 0, 0],
        [1] * 8,
        [1, 0, 0, 0, 0, 0, 0, 0],
        [0] * 8,
        [0, 1, 1, 0, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 0],
    ]
    sets["ragged"] = _batch(
        0.4 * torch.randn(6, 8, generator=g, dtype=F64),
        mask,
        [1.0, -1.0, 0.5, -0.5, -2.0, 1.5],
        seed=1,
    )
    lr = [[30.0, -30.0, 0.1, -0.2, 1e4, 0.0], [15.0, -30.0, 0.3, -0.3, 9.0, -9.0],
          [-1e4, 0.3, 0.1, 0.0, -0.4, 0.0], [30.0, -30.0, 1e4, -1e4, 5.0, 2.0],
          [25.0, 0.0, -25.0, 0.5, 0.0, 0.0], [0.05, -0.1, 0.2, -0.05, 0.1, 0.0]]
    mask = [[1] * 6, [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 1, 0], [0] * 6, [1] * 6, [1, 1, 1, 1, 0, 1]]
    sets["extreme"] = _batch(lr, mask, [1.0, -1.0, -1.0, 1.0, -0.5, 2.0], seed=2)
    lr = [[30.0, -30.0, 0.1, -0.2], [15.0, -30.0, 0.3, 0.0], [25.0, -25.0, 0.5, -21.0]]
    sets["beyond20"] = _batch(lr, [[1] * 4, [1, 1, 0, 0], [1] * 4], [1.0, -1.0, -0.5], seed=6)
    s = math.sqrt(0.02)
    lr = [[0.0, 0.005, -0.005, 0.02], [math.log(2.0), math.log(0.5), math.log(5.0), math.log(3.0)],
          [0.01, -0.01, 0.01, -0.01], [s, -s, 0.0, 0.0], [math.log(1.01)] * 4, [math.log(0.99)] * 4]
    sets["threshold"] = _batch(lr, [[1] * 4] * 6, [1.0, -1.0, 1.0, -1.0, 1.0, -1.0], seed=3)
    clean = _batch(0.3 * torch.randn(4, 6, generator=g, dtype=F64), [[1, 1, 0, 1, 0, 0], [1] * 6,
                   [0, 1, 1, 1, 1, 0], [0] * 6], [1.0, -1.0, 0.5, -0.5], seed=4)
    out = {k: v.clone() for k, v in clean.items()}
    off = out["mask"] == 0
    for name, value in (("logp", math.nan), ("logp_old", math.inf), ("logp_infer", -math.inf)):
        out[name] = torch.where(off, value, out[name])
    out["logp"][0, 2], out["logp_old"][0, 4], out["logp_infer"][2, 0] = (
        -math.inf,
        math.nan,
        math.inf,
    )
    sets["nonfinite_out"] = out
    inside = {k: v.clone() for k, v in clean.items()}
    inside["logp_infer"][0, 1] = math.nan  # sampler could not score a token
    inside["logp_infer"][1, 3] = -math.inf  # log rho = +inf
    inside["logp"][2, 2] = math.nan  # current policy NaN
    inside["logp_old"][1, 0] = -1e4  # finite but extreme, next to the non-finite one
    sets["nonfinite_in"] = inside
    T = 2048
    lr = 0.05 * torch.randn(2, T, generator=g, dtype=F64)
    lr[0, 100], lr[1, 7] = 3.0, -4.0
    mask = torch.ones(2, T, dtype=F64)
    mask[1, 1300:] = 0
    mask[1, 500:520] = 0
    sets["long"] = _batch(lr, mask, [1.0, -1.0], seed=5, d_std=0.02)
    return sets


# --------------------------------------------------------------------------------------------------
# the calls


class Recorder:
    def __init__(self, sets):
        self.sets, self.tensors, self.cases = sets, {}, []
        for set_name, tensors in sets.items():
            for name, t in tensors.items():
                self.tensors[f"input/{set_name}/{name}"] = t.contiguous()

    def leaf(self, set_name, name="logp"):
        return self.sets[set_name][name].clone().requires_grad_(True)

    def add(
        self, case, fw, info, path, function, set_name, kwargs, inputs, outputs, grad=None, note=""
    ):
        if set_name == "long" and not case.startswith(LONG_CASES):
            return
        names = []
        for key, value in outputs.items():
            t = torch.as_tensor(value).detach()
            self.tensors[f"{case}/{key}"] = t.to(F64).contiguous().clone()
            names.append(f"{case}/{key}")
        entry = {
            "case": case,
            "framework": fw,
            "repo": info["repo"],
            "path": path,
            "function": function,
            "commit": info["commit"],
            "input_set": set_name,
            "kwargs": kwargs,
            "inputs": inputs,
            "outputs": names,
        }
        if grad is not None:
            loss, leaf = grad
            (g,) = torch.autograd.grad(
                loss, leaf, retain_graph=True, allow_unused=True, materialize_grads=True
            )
            self.tensors[f"{case}/grad_logp"] = g.detach().to(F64).contiguous().clone()
            entry["outputs"].append(f"{case}/grad_logp")
            entry["grad"] = "d(loss)/d(logp), logp = input/<set>/logp"
        if note:
            entry["note"] = note
        self.cases.append(entry)


# T = 2,048 goldens are 32 kB each: only these cases keep theirs (the file stays under 1 MB)
LONG_CASES = (
    "verl.is.token.long",
    "verl.is.sequence.long",
    "verl.rs.token_k3.",
    "verl.rs.seq_mean_k3.",
    "verl.loss.vanilla.long",
    "verl.loss.gspo.long",
    "slime.mis.truncate.sequence.long",
    "slime.opsm.0.0001.long",
    "prime_rl.dppo.long",
    "prime_rl.kl_only.long",
    "trl.is.sequence_mask.None_3.0",
    "trl.loss.grpo.token.long",
    "trl.loss.grpo.sequence.long",
)
ALL = ["ragged", "extreme", "beyond20", "threshold", "nonfinite_out", "nonfinite_in", "long"]


def run_verl(rec: Recorder, ns: dict, info: dict):
    helper, core = "verl/trainer/ppo/rollout_corr_helper.py", "verl/trainer/ppo/core_algos.py"
    for s in ALL:
        x = rec.sets[s]
        log_ratio = x["logp_old"] - x["logp_infer"]
        lr_in = {
            "log_ratio": f"input/{s}/logp_old - input/{s}/logp_infer",
            "response_mask": f"input/{s}/mask",
        }
        for level, thr in (("token", 2.0), ("sequence", 5.0)):
            for norm in (False, True):
                if s == "long" and norm:
                    continue
                kw = {
                    "rollout_is": level,
                    "rollout_is_threshold": thr,
                    "rollout_is_batch_normalize": norm,
                }
                w, _ = ns["compute_rollout_correction_weights"](
                    log_ratio=log_ratio, response_mask=x["mask"], **kw
                )
                case = f"verl.is.{level}{'.norm' if norm else ''}.{s}"
                rec.add(
                    case,
                    "verl",
                    info,
                    helper,
                    "compute_rollout_correction_weights",
                    s,
                    kw,
                    lr_in,
                    {"weights": w},
                )
        options = [
            "token_k1",
            "token_k2",
            "token_k3",
            "seq_sum_k1",
            "seq_sum_k2",
            "seq_sum_k3",
            "seq_mean_k1",
            "seq_mean_k2",
            "seq_mean_k3",
            "seq_max_k2",
            "seq_max_k3",
        ]
        if s == "long":
            options = ["token_k3", "seq_mean_k3", "seq_sum_k2"]
        for opt in options:
            thresholds = ["0.01"] + (["0.99_1.01"] if opt.endswith("k1") else [])
            for thr in thresholds:
                kw = {"rollout_rs": opt, "rollout_rs_threshold": thr}
                m, _ = ns["compute_rollout_rejection_mask"](
                    log_ratio=log_ratio, response_mask=x["mask"], **kw
                )
                case = f"verl.rs.{opt}.{thr}.{s}"
                rec.add(case, "verl", info, helper, "compute_rollout_rejection_mask", s, kw, lr_in,
                        {"mask": m})
        for kind in ("k1", "k2", "k3"):
            kl = ns["kl_penalty"](x["logp_infer"], x["logp_old"], kind)
            rec.add(
                f"verl.kl_penalty.{kind}.{s}",
                "verl",
                info,
                core,
                "kl_penalty",
                s,
                {"kl_penalty": kind},
                {"logprob": f"input/{s}/logp_infer", "ref_logprob": f"input/{s}/logp_old"},
                {"kl": kl},
            )
    # losses: gradient w.r.t. logp
    cfg = ActorConfigStub(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0
    )
    for s in ALL:
        x = rec.sets[s]
        adv = x["adv"][:, None].expand_as(x["mask"])
        for mode in (
            "token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-mean",
            "seq-mean-token-sum-norm",
        ):
            logp = rec.leaf(s)
            loss = ns["agg_loss"](loss_mat=-adv * logp, loss_mask=x["mask"], loss_agg_mode=mode)
            rec.add(
                f"verl.agg_loss.{mode}.{s}",
                "verl",
                info,
                core,
                "agg_loss",
                s,
                {"loss_agg_mode": mode},
                {
                    "loss_mat": f"-input/{s}/adv[:, None] * input/{s}/logp",
                    "loss_mask": f"input/{s}/mask",
                },
                {"loss": loss},
                grad=(loss, logp),
            )
        tis = ns["compute_rollout_correction_weights"](log_ratio=x["logp_old"] - x["logp_infer"],
                                                       response_mask=x["mask"], rollout_is="token",
                                                       rollout_is_threshold=2.0)[0]
        base_in = {"log_prob": f"input/{s}/logp", "advantages": f"input/{s}/adv[:, None] broadcast",
                   "response_mask": f"input/{s}/mask"}
        for name, fn, old, weights, cf in (
                ("vanilla", "compute_policy_loss_vanilla", "logp_old", None, cfg),
                ("vanilla.tis2", "compute_policy_loss_vanilla", "logp_old", tis, cfg),
                ("vanilla.bypass", "compute_policy_loss_vanilla", "logp_infer", None, cfg),
                ("cispo.low0.2", "compute_policy_loss_cispo", "logp_infer", None, cfg),
                ("cispo.low1.0", "compute_policy_loss_cispo", "logp_infer", None,
                 ActorConfigStub(clip_ratio=0.2, clip_ratio_low=1.0, clip_ratio_high=0.28)),
                ("gspo", "compute_policy_loss_gspo", "logp_old", None,
                 ActorConfigStub(clip_ratio=0.2, clip_ratio_low=3e-4, clip_ratio_high=4e-4)),
                ("geo_mean", "compute_policy_loss_geo_mean", "logp_old", None,
                 ActorConfigStub(clip_ratio=0.4, clip_ratio_low=0.4, clip_ratio_high=0.4)),
                ("reinforce.tis2", "compute_policy_loss_reinforce", "logp_infer", tis, cfg)):
            if s == "long" and name not in ("vanilla", "gspo", "reinforce.tis2"):
                continue
            logp = rec.leaf(s)
            first = "rollout_log_prob" if "reinforce" in fn else "old_log_prob"
            mode = "seq-mean-token-mean" if name == "gspo" else "token-mean"
            loss, _ = ns[fn](
                x[old],
                logp,
                adv,
                x["mask"],
                loss_agg_mode=mode,
                config=cf,
                rollout_is_weights=weights,
            )
            kw = {"loss_agg_mode": mode, "config": {k: v for k, v in cf.items()}}
            inputs = {first: f"input/{s}/{old}", **base_in}
            if weights is not None:
                inputs["rollout_is_weights"] = (
                    "compute_rollout_correction_weights(token, 2.0) of logp_old - logp_infer"
                )
            rec.add(f"verl.loss.{name}.{s}", "verl", info, core, fn, s, kw, inputs, {"loss": loss},
                    grad=(loss, logp))
        if s != "long":
            run_verl_rejection_modes(rec, ns, info, s, adv, cfg)
    run_verl_sapo(rec, ns, info)


def _as_module(name: str, **attrs):
    """sys.modules[name] (and its parents) as a plain module holding attrs: what an in-function
    import reads."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    vars(sys.modules[name]).update(attrs)


def run_verl_rejection_modes(rec: Recorder, ns: dict, info: dict, s: str, adv, cfg):
    """rollout_rs="token_k3" at "0.01" in verl's two modes (issue 56, item 4). Decoupled
    (bypass_mode False, the default): the trainer rewrites response_mask with
    compute_rollout_correction_and_rejection_mask before the actor, so the token-mean's count
    (batch_num_tokens, from the batch's mask) leaves rejected tokens out; the loss is PPO against
    the recomputed old_log_prob. Bypass (loss_type "reinforce"): compute_policy_loss_bypass_mode
    rejects inside the loss, against the current policy, while batch_num_tokens is still the
    unmodified mask's count."""
    helper, core = "verl/trainer/ppo/rollout_corr_helper.py", "verl/trainer/ppo/core_algos.py"
    x = rec.sets[s]
    rs = {"rollout_rs": "token_k3", "rollout_rs_threshold": "0.01"}
    _, kept, _ = ns["compute_rollout_correction_and_rejection_mask"](
        old_log_prob=x["logp_old"], rollout_log_prob=x["logp_infer"], response_mask=x["mask"], **rs)
    logp = rec.leaf(s)
    decoupled = ActorConfigStub(**cfg)
    decoupled.global_batch_info = {"batch_num_tokens": kept.sum()}
    loss, _ = ns["compute_policy_loss_vanilla"](
        x["logp_old"], logp, adv, kept, loss_agg_mode="token-mean", config=decoupled
    )
    rec.add(
        f"verl.mode.decoupled.token_k3.{s}",
        "verl",
        info,
        f"{helper} + {core}",
        "compute_rollout_correction_and_rejection_mask, then compute_policy_loss_vanilla",
        s,
        {**rs, "bypass_mode": False, "batch_num_tokens": "the rewritten mask's count"},
        {
            "old_log_prob": f"input/{s}/logp_old",
            "rollout_log_prob": f"input/{s}/logp_infer",
            "log_prob": f"input/{s}/logp",
            "response_mask": f"input/{s}/mask",
        },
        {"loss": loss},
        grad=(loss, logp),
    )
    logp = rec.leaf(s)
    bypass = ActorConfigStub(**cfg)
    bypass.policy_loss = {"rollout_correction": {"loss_type": "reinforce", **rs}}
    bypass.global_batch_info = {"batch_num_tokens": x["mask"].sum()}
    _as_module(
        "verl.trainer.ppo.rollout_corr_helper",
        compute_rollout_correction_and_rejection_mask=ns[
            "compute_rollout_correction_and_rejection_mask"
        ],
    )
    loss, _ = ns["compute_policy_loss_bypass_mode"](
        x["logp_infer"], logp, adv, x["mask"], loss_agg_mode="token-mean", config=bypass
    )
    rec.add(
        f"verl.mode.bypass.token_k3.{s}",
        "verl",
        info,
        core,
        "compute_policy_loss_bypass_mode",
        s,
        {
            **rs,
            "bypass_mode": True,
            "loss_type": "reinforce",
            "batch_num_tokens": "the batch mask's count",
        },
        {
            "old_log_prob": f"input/{s}/logp_infer (bypass: the rollout's)",
            "log_prob": f"input/{s}/logp",
            "response_mask": f"input/{s}/mask",
        },
        {"loss": loss},
        grad=(loss, logp),
    )


def _slime_args(**kw):
    base = {
        "use_tis": True,
        "use_rs": False,
        "tis_lower_bound": None,
        "tis_upper_bound": 2.0,
        "tis_mode": "truncate",
        "tis_level": "token",
        "rs_lower_bound": None,
        "rs_upper_bound": None,
        "rs_level": "token",
        "rs_veto_threshold": None,
        "tis_batch_normalize": False,
    }
    base.update(kw)
    return argparse.Namespace(**base)


def run_slime(rec: Recorder, ns: dict, info: dict):
    mis, ppo, loss_py = ("examples/train_infer_mismatch_helper/mis.py", "slime/utils/ppo_utils.py",
                         "slime/backends/megatron_utils/loss.py")
    for s in ALL:
        x = rec.sets[s]
        rows = lambda t: list(t.unbind(0))
        variants = [
            ("truncate", "token", 2.0, None, False),
            ("clip", "token", 2.0, 0.5, False),
            ("mask", "token", 5.0, 0.5, False),
            ("truncate", "sequence", 5.0, None, False),
            ("mask", "sequence", 3.0, 0.0, False),
            ("mask", "geometric", 1.01, 0.99, False),
            ("truncate", "token", 2.0, None, True),
            ("truncate", "sequence", 5.0, None, True),
        ]
        if s == "long":
            variants = variants[:1] + variants[3:4]
        for mode, level, upper, lower, norm in variants:
            kw = {
                "tis_mode": mode,
                "tis_level": level,
                "tis_upper_bound": upper,
                "tis_lower_bound": lower,
                "tis_batch_normalize": norm,
            }
            w, m, _ = ns["compute_mis_weights"](
                _slime_args(**kw),
                train_log_probs=rows(x["logp_old"]),
                rollout_log_probs=rows(x["logp_infer"]),
                loss_masks=rows(x["mask"]),
            )
            case = f"slime.mis.{mode}.{level}{'.norm' if norm else ''}.{s}"
            rec.add(
                case,
                "slime",
                info,
                mis,
                "compute_mis_weights",
                s,
                kw,
                {
                    "train_log_probs": f"rows of input/{s}/logp_old",
                    "rollout_log_probs": f"rows of input/{s}/logp_infer",
                    "loss_masks": f"rows of input/{s}/mask",
                },
                {"weights": torch.stack(w), "modified_mask": torch.stack(m)},
            )
        # examples/train_infer_mismatch_helper/mis.yaml as committed: TIS 2, RS [0.5, 2], veto 1e-4
        if s != "long":
            kw = {
                "use_rs": True,
                "tis_mode": "truncate",
                "tis_level": "token",
                "tis_upper_bound": 2.0,
                "tis_lower_bound": 0.5,
                "rs_level": "token",
                "rs_veto_threshold": 1e-4,
                "tis_batch_normalize": True,
            }
            w, m, _ = ns["compute_mis_weights"](
                _slime_args(**kw),
                train_log_probs=rows(x["logp_old"]),
                rollout_log_probs=rows(x["logp_infer"]),
                loss_masks=rows(x["mask"]),
            )
            rec.add(
                f"slime.mis.yaml_default.{s}",
                "slime",
                info,
                mis,
                "compute_mis_weights",
                s,
                kw,
                {
                    "train_log_probs": f"rows of input/{s}/logp_old",
                    "rollout_log_probs": f"rows of input/{s}/logp_infer",
                    "loss_masks": f"rows of input/{s}/mask",
                },
                {"weights": torch.stack(w), "modified_mask": torch.stack(m)},
            )
        for fn, lo, hi in (("vanilla_tis_function", 0.0, 2.0), ("vanilla_tis_function", 0.5, 2.0),
                           ("icepop_function", 0.5, 5.0)):
            args = argparse.Namespace(tis_clip_low=lo, tis_clip=hi)
            out, _, _ = ns[fn](
                args,
                pg_loss=torch.ones(x["mask"].numel(), dtype=F64),
                train_log_probs=rows(x["logp_old"]),
                rollout_log_probs=rows(x["logp_infer"]),
                loss_masks=rows(x["mask"]),
            )
            rec.add(
                f"slime.{fn}.{lo}_{hi}.{s}",
                "slime",
                info,
                loss_py,
                fn,
                s,
                {"tis_clip_low": lo, "tis_clip": hi},
                {
                    "pg_loss": "ones (so the output is the weight)",
                    "train_log_probs": f"input/{s}/logp_old",
                    "rollout_log_probs": f"input/{s}/logp_infer",
                },
                {"weights": out.view_as(x["mask"])},
            )
        for delta in (1e-4, 5.0):
            adv_rows = rows(x["adv"][:, None].expand_as(x["mask"]))
            m, _ = ns["compute_opsm_mask"](
                argparse.Namespace(opsm_delta=delta),
                full_log_probs=rows(x["logp"]),
                full_old_log_probs=rows(x["logp_infer"]),
                advantages=adv_rows,
                loss_masks=rows(x["mask"]),
            )
            rec.add(
                f"slime.opsm.{delta}.{s}",
                "slime",
                info,
                ppo,
                "compute_opsm_mask",
                s,
                {"opsm_delta": delta},
                {
                    "full_log_probs": f"input/{s}/logp",
                    "full_old_log_probs": f"input/{s}/logp_infer",
                    "advantages": f"input/{s}/adv per token",
                    "loss_masks": f"input/{s}/mask",
                },
                {"mask": m.view_as(x["mask"])},
            )
        for kind in ("k1", "k2", "k3", "low_var_kl"):
            kl = ns["compute_approx_kl"](x["logp_infer"], x["logp_old"], kind)
            rec.add(
                f"slime.approx_kl.{kind}.{s}",
                "slime",
                info,
                ppo,
                "compute_approx_kl",
                s,
                {"kl_loss_type": kind},
                {"log_probs": f"input/{s}/logp_infer", "log_probs_base": f"input/{s}/logp_old"},
                {"kl": kl},
            )
        if s == "long":
            continue
        adv = x["adv"][:, None].expand_as(x["mask"])
        logp = rec.leaf(s)
        pg, _ = ns["compute_policy_loss"](x["logp_old"] - logp, adv, 0.2, 0.28, eps_clip_c=None)
        rec.add(
            f"slime.ppo.{s}",
            "slime",
            info,
            ppo,
            "compute_policy_loss",
            s,
            {"eps_clip": 0.2, "eps_clip_high": 0.28, "eps_clip_c": None},
            {
                "ppo_kl": f"input/{s}/logp_old - input/{s}/logp",
                "advantages": f"input/{s}/adv per token",
            },
            {"per_token_loss": pg},
            grad=(pg.sum(), logp),
            note="per-token loss (slime reduces it later with sum_of_sample_mean); grad is of its "
                 "plain sum, "
            "i.e. each token's own derivative",
        )
        for lo in (0.2, 1.0):
            logp = rec.leaf(s)
            pg, _ = ns["compute_cispo_loss"](x["logp_infer"] - logp, logp, adv, lo, 0.28)
            rec.add(
                f"slime.cispo.{lo}.{s}",
                "slime",
                info,
                ppo,
                "compute_cispo_loss",
                s,
                {"eps_clip": lo, "eps_clip_high": 0.28},
                {
                    "ppo_kl": f"input/{s}/logp_infer - input/{s}/logp",
                    "log_probs": f"input/{s}/logp",
                    "advantages": f"input/{s}/adv per token",
                },
                {"per_token_loss": pg},
                grad=(pg.sum(), logp),
                note="per-token loss; grad of its plain sum",
            )
        run_slime_reducers(rec, ns, info, s, adv)


def run_slime_reducers(rec: Recorder, ns: dict, info: dict, s: str, adv):
    """slime's CISPO (eps_clip 1.0: no lower clip) reduced as slime's loss_function does (issue 56,
    items 2-3), each sample its own rollout (slime's default when a sample sets no rollout_id).
    Default: get_sum_of_sample_mean's per-sample means summed, times num_microbatches /
    step_global_batch_size (one micro-batch of B samples: / B).
    --calculate-per-token-loss: its token sum, which Megatron divides by loss_function's normalizer
      num_tokens = sum over samples of clamp_min(loss_mask.sum(), 1) (that expression re-typed: it
      sits in loss_function)."""
    x = rec.sets[s]
    B, T = x["mask"].shape
    masks = list(x["mask"].unbind(0))
    for per_token in (False, True):
        logp = rec.leaf(s)
        pg, _ = ns["compute_cispo_loss"](x["logp_infer"] - logp, logp, adv, 1.0, 0.28)
        reduce = ns["get_sum_of_sample_mean"]([T] * B, [T] * B, masks, None, per_token)
        total = reduce(pg.reshape(-1))
        if per_token:
            loss = total / sum(torch.clamp_min(m.sum(), 1) for m in masks)
        else:
            loss = total / B
        name = "per_token" if per_token else "sample_mean"
        rec.add(
            f"slime.cispo.1.0.{name}.{s}",
            "slime",
            info,
            "slime/backends/megatron_utils/cp_utils.py",
            "compute_cispo_loss, then get_sum_of_sample_mean",
            s,
            {
                "eps_clip": 1.0,
                "eps_clip_high": 0.28,
                "calculate_per_token_loss": per_token,
                "normalizer": "sum clamp_min(mask.sum(), 1)"
                if per_token
                else "B (one micro-batch)",
            },
            {
                "ppo_kl": f"input/{s}/logp_infer - input/{s}/logp",
                "log_probs": f"input/{s}/logp",
                "advantages": f"input/{s}/adv per token",
                "loss_masks": f"rows of input/{s}/mask",
            },
            {"loss": loss},
            grad=(loss, logp),
        )


def run_prime_rl(rec: Recorder, ns: dict, info: dict):
    path = "src/prime_rl/trainer/rl/loss.py"
    for s in ALL:
        x = rec.sets[s]
        mask = x["mask"].bool()
        n_tok = int(mask.sum())
        for name, low, high, kl_tau, adv_scale in (
            ("dppo", 0.2, 0.2, 0.0, 1.0),
            ("dppo.asym", 0.1, 0.3, 0.0, 1.0),
            ("default", 0.2, 0.2, 1e-3, 1.0),
            ("kl_only", 0.2, 0.2, 1e-3, 0.0),
        ):
            if s == "long" and name == "dppo.asym":
                continue
            cfg = types.SimpleNamespace(
                dppo_mask_low=low, dppo_mask_high=high, adv_tau=1.0, kl_tau=kl_tau
            )
            logp = rec.leaf(s)
            adv = (adv_scale * x["adv"])[:, None].expand_as(x["mask"])
            loss, _ = ns["compute_loss"](
                list(logp.unbind(0)),
                list(x["logp_infer"].unbind(0)),
                None,
                list(adv.unbind(0)),
                list(mask.unbind(0)),
                None,
                None,
                None,
                rl_loss_fn=lambda inputs, cfg=cfg: ns["default_loss_fn"](inputs, cfg),
                rl_scale=n_tok,
                ce_scale=1,
                ref_kl_scale=1,
            )
            kw = {"loss_config": vars(cfg), "rl_scale": n_tok, "rl_loss_fn": "default_loss_fn"}
            rec.add(
                f"prime_rl.{name}.{s}",
                "prime-rl",
                info,
                path,
                "compute_loss(default_loss_fn)",
                s,
                kw,
                {
                    "trainer_logprobs": f"rows of input/{s}/logp",
                    "inference_logprobs": f"rows of input/{s}/logp_infer",
                    "advantages": f"{adv_scale} * input/{s}/adv per token",
                    "loss_mask": f"input/{s}/mask (bool)",
                },
                {"loss": loss},
                grad=(loss, logp),
                note="rl_scale = number of masked tokens of the batch (prime-rl's global token "
                     "count)",
            )


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def _trl_self(GRPOTrainer, logp, T, **kw):
    base = {
        "top_entropy_quantile": 1.0,
        "off_policy_mask_threshold": None,
        "importance_sampling_level": "token",
        "beta": 0.0,
        "loss_type": "grpo",
        "epsilon_low": 0.2,
        "epsilon_high": 0.28,
        "use_vllm": True,
        "vllm_importance_sampling_correction": False,
        "current_gradient_accumulation_steps": 1,
        "max_completion_length": T,
        "accelerator": _Accelerator(),
        "_entropy_bonus_enabled": False,
        "aux_loss_enabled": False,
        "model": types.SimpleNamespace(training=True),
        "args": types.SimpleNamespace(
            delta=None, steps_per_generation=1, use_bias_correction_kl=False
        ),
        "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)},
        "get_off_policy_mask": GRPOTrainer.get_off_policy_mask,
        "_get_per_token_logps_and_entropies": lambda *a, **k: (logp, torch.zeros_like(logp), None),
    }
    base.update(kw)
    return types.SimpleNamespace(**base)


def trl_is_ratio(ns, x, mode, clip_min, clip_max):
    fake = types.SimpleNamespace(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )
    scope = {
        "self": fake,
        "torch": torch,
        "math": math,
        "completion_mask": x["mask"].long(),
        "tool_mask": None,
        "old_per_token_logps": x["logp_old"],
        "sampling_per_token_logps": x["logp_infer"],
    }
    exec(ns["is_block"], scope)  # noqa: S102  TRL's own block, as installed
    return scope["vllm_importance_sampling_ratio"]


def run_trl(rec: Recorder, ns: dict, info: dict):
    path = "trl/trainer/grpo_trainer.py"
    GRPOTrainer = ns["GRPOTrainer"]
    for s in ALL:
        x = rec.sets[s]
        modes = [
            ("token_truncate", None, 2.0),
            ("token_truncate", 0.5, 2.0),
            ("token_mask", 0.5, 5.0),
            ("sequence_truncate", None, 5.0),
            ("sequence_mask", None, 3.0),
            ("sequence_mask", 0.5, 3.0),
        ]
        for mode, lo, hi in modes:
            r = trl_is_ratio(ns, x, mode, lo, hi)
            rec.add(
                f"trl.is.{mode}.{lo}_{hi}.{s}",
                "trl",
                info,
                path,
                f"GRPOTrainer._generate_and_score_completions, lines {info['is_block_lines']} "
                "(vLLM IS block)",
                s,
                {
                    "vllm_importance_sampling_mode": mode,
                    "vllm_importance_sampling_clip_min": lo,
                    "vllm_importance_sampling_clip_max": hi,
                },
                {
                    "old_per_token_logps": f"input/{s}/logp_old",
                    "sampling_per_token_logps": f"input/{s}/logp_infer",
                    "completion_mask": f"input/{s}/mask (int64)",
                    "tool_mask": None,
                },
                {"ratio": r},
            )
        for delta in (1e-4, 5.0):
            m = GRPOTrainer.get_off_policy_mask(
                advantages=x["adv"][:, None],
                per_token_logps=x["logp"],
                sampling_per_token_logps=x["logp_infer"],
                mask=x["mask"],
                off_policy_threshold=delta,
            )
            rec.add(
                f"trl.opsm.{delta}.{s}",
                "trl",
                info,
                path,
                "GRPOTrainer.get_off_policy_mask",
                s,
                {"off_policy_threshold": delta},
                {
                    "advantages": f"input/{s}/adv[:, None]",
                    "per_token_logps": f"input/{s}/logp",
                    "sampling_per_token_logps": f"input/{s}/logp_infer",
                    "mask": f"input/{s}/mask",
                },
                {"mask": m},
            )
        losses = [
            ("grpo", "token", None),
            ("bnpo", "token", None),
            ("dr_grpo", "token", None),
            ("dapo", "token", None),
            ("grpo", "sequence", None),
            ("cispo", "token", None),
            ("bnpo", "token", ("token_truncate", None, 2.0)),
            ("bnpo", "token", ("sequence_mask", None, 3.0)),
            ("bnpo", "token", "opsm"),
        ]
        if s == "long":
            losses = [losses[0], losses[3], losses[4]]
        for loss_type, level, extra in losses:
            B, T = x["mask"].shape
            logp = rec.leaf(s)
            inputs = {
                "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
                "prompt_mask": torch.ones(B, 1, dtype=torch.long),
                "completion_ids": torch.zeros(B, T, dtype=torch.long),
                "completion_mask": x["mask"].long(),
                "advantages": x["adv"],
                "old_per_token_logps": x["logp_old"],
                "sampling_per_token_logps": x["logp_infer"],
                "num_items_in_batch": x["mask"].sum(),
            }
            kw = {"loss_type": loss_type, "importance_sampling_level": level, "epsilon_low": 0.2,
                  "epsilon_high": 1.28 if loss_type == "cispo" else 0.28}
            name = f"{loss_type}.{level}"
            if isinstance(extra, tuple):
                inputs["importance_sampling_ratio"] = trl_is_ratio(ns, x, *extra)
                kw.update(
                    vllm_importance_sampling_correction=True,
                    vllm_importance_sampling_mode=extra[0],
                    vllm_importance_sampling_clip_min=extra[1],
                    vllm_importance_sampling_clip_max=extra[2],
                )
                name += f".{extra[0]}"
            elif extra == "opsm":
                kw["off_policy_mask_threshold"] = 1e-4
                name += ".opsm"
            attrs = ("loss_type", "importance_sampling_level", "epsilon_low", "epsilon_high",
                     "off_policy_mask_threshold", "vllm_importance_sampling_correction")
            fake = _trl_self(GRPOTrainer, logp, T, **{k: v for k, v in kw.items() if k in attrs})
            loss = GRPOTrainer._compute_loss(fake, None, inputs)
            used = {
                "per_token_logps": f"input/{s}/logp (the method's forward stubbed to return it)",
                "advantages": f"input/{s}/adv",
                "old_per_token_logps": f"input/{s}/logp_old",
                "completion_mask": f"input/{s}/mask (int64)",
                "num_items_in_batch": f"sum of input/{s}/mask",
            }
            if "importance_sampling_ratio" in inputs:
                used["importance_sampling_ratio"] = (
                    "the IS block's ratio (trl.is.*) of logp_old vs logp_infer"
                )
            if extra == "opsm":
                used["sampling_per_token_logps"] = f"input/{s}/logp_infer"
            rec.add(
                f"trl.loss.{name}.{s}",
                "trl",
                info,
                path,
                "GRPOTrainer._compute_loss",
                s,
                {
                    **kw,
                    "beta": 0.0,
                    "max_completion_length": T,
                    "gradient_accumulation_steps": 1,
                    "num_processes": 1,
                },
                used,
                {"loss": loss},
                grad=(loss, logp),
            )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verl", type=Path, default=Path("verl"))
    p.add_argument("--slime", type=Path, default=Path("slime"))
    p.add_argument("--prime-rl", type=Path, default=Path("prime-rl"))
    p.add_argument("--areal", type=Path, default=Path("AReaL"))
    p.add_argument("--skyrl", type=Path, default=Path("SkyRL"))
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument(
        "--skip-trl", action="store_true", help="when TRL is not installed in this environment"
    )
    args = p.parse_args()
    torch.set_default_dtype(F64)
    rec = Recorder(input_sets())
    frameworks = {}
    for name, loader, runner, src in (("verl", load_verl, run_verl, args.verl),
                                      ("slime", load_slime, run_slime, args.slime),
                                      ("prime-rl", load_prime_rl, run_prime_rl, args.prime_rl),
                                      ("areal", load_areal, run_areal, args.areal),
                                      ("skyrl", load_skyrl, run_skyrl, args.skyrl)):
        ns, info = loader(src)
        runner(rec, ns, info)
        frameworks[name] = info
    if not args.skip_trl:
        ns, info = load_trl()
        run_trl(rec, ns, info)
        frameworks["trl"] = info
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(rec.tensors, str(args.out / "goldens.safetensors"))
    meta = {
        "generator": "lab/parity/make_goldens.py",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "dtype": "float64",
        "frameworks": frameworks,
        "input_sets": sorted(rec.sets),
        "cases": rec.cases,
    }
    cases = meta.pop("cases")
    head = json.dumps(meta, indent=1, default=str)[:-2]  # one case a line: diffs stay readable
    lines = ",\n  ".join(json.dumps(c, default=str) for c in cases)
    (args.out / "goldens.json").write_text(f'{head},\n "cases": [\n  {lines}\n ]\n}}\n')
    size = (args.out / "goldens.safetensors").stat().st_size
    print(f"{len(rec.cases)} cases, {len(rec.tensors)} tensors, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
