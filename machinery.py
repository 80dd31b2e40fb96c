"""machinery: what only this repository's machinery needs, kept out of the reference a learner reads (tim_rl.py).

The compiled single-read GPU passes behind tim_rl.token_logprobs and Trainer.export, and the probes that decide
once per GPU whether torch.compile works there. On a CPU none of this runs: tim_rl.py's eager paths are the
reference, and every pass here is tested bitwise against them. tim_rl.py imports this module only where it is used.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import sys
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

import torch

import tim_rl as tr
from tim_rl import BF16_DROPPED_BITS, _check_device, _check_fp32, _lse_tail

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
    return logits.gather(-1, ids).float() - lse, _lse_tail(lse, m, torch.exp(z - m).sum(-1, keepdim=True).log())



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
    flag = tr._flag
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
    tr.resolve_device(cfg.device)
    try:
        tr._check_truncation(cfg.top_p, cfg.top_k, cfg.min_p)
    except ValueError as e:
        raise ValueError("--" + str(e).replace("_", "-", 1)) from None
    arm = tr.arm_of(cfg)
    group_relative = cfg.baseline == "group" and not arm.critic  # COPC's advantages come from its critic
    vllm = cfg.sampler == "vllm"
    # its longest answer and <eos>: a product or a swap has 2 x digits, else digits + 1
    task = tr.run_task_kwargs(cfg, cfg.model)
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
        (vllm and not tr.vllm_available(),
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
    flags = [f"{tr._flag(n)} {getattr(cfg, n)}" for n in names if getattr(cfg, n) not in ("none", 0.0)]
    if not flags or tr.moe_routers(model):
        return
    its = f"; its router is {tr.router_class(model)}" if tr.is_moe(model) else ""
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
            raise tr.UsageError(f"{tr._flag(name)} {path}: {existing} is {what}, not a directory")
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
        tr._check_choice("vllm_dtype", vllm_dtype, sorted(tr._VLLM_DTYPES))
    threads = tr._vllm_environment()
    # vLLM's class as TRL imported it; with vllm_dtype, pinned for this call
    llm = getattr(trl_vllm, "LLM", None)
    llm = llm if vllm_dtype is None else functools.partial(llm, dtype=tr._VLLM_DTYPES[vllm_dtype])
    with unittest.mock.patch.object(trl_vllm, "LLM", llm, create=True):
        trainer = TimRLGRPOTrainer(**trainer_kwargs)
    torch.set_num_threads(threads)
    generation = getattr(trainer, "vllm_generation", None)
    colocated = trainer.use_vllm and generation is not None and generation.mode == "colocate"
    if colocated and tr._vllm_on_cpu():
        # vLLM's CPU build repacks Linear weights, which breaks TRL's per-parameter sync; on a GPU TRL's own sync
        # (PEFT merge, ZeRO-3 gather, sleep-mode wake-up) stays in charge
        def sync_weights():
            """TRL's weight sync, done by reloading vLLM's model from the trainer's parameters."""
            tr.reload_vllm_weights(generation.llm, trainer.model.named_parameters())

        generation.sync_weights = sync_weights
    return trainer


# TEMP until h2 merges: the names h2 moves here from tim_rl.py (the lead deletes this block)
from tim_rl import (  # noqa: F401
    TASKS,
    chat_prompt,
    ensure_base_model,
    load_checkpoint,
    load_trainer_state,
    make_arithmetic_task,
    make_word_problems,
    pretrain,
    save_checkpoint,
    trainer_state,
    write_atomic,
)
