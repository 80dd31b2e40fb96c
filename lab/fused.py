"""The compiled single-read GPU passes: token log-probs and the bf16 export roundings (lab only).

tim_rl.py's eager paths are the reference (tim_rl.token_logprobs by row chunks,
stochastic_round_bf16, error_feedback_round_bf16); every pass here is tested bitwise against them
(lab/tests, `pytest -m cuda` on a GPU) and timed beside them by `python -m lab bench`. On a CPU
nothing here runs in a tim_rl run: a run never calls this module; a user who wants the compiled pass
calls fused_token_logprobs on their logits."""

from __future__ import annotations

import math
import sys

import torch

import tim_rl as tr
from tim_rl import BF16_DROPPED_BITS, FAR_FROM_ZERO, _check_device, _check_fp32

# On a GPU token_logprobs runs one compiled pass per chunk of at most this many logits (2^28: 1 GiB
# of fp32, ~1 770 rows at V = 151 936): large enough to read at memory speed, small enough that a
# bf16 backward's fp32 chunk is not.
FUSED_CHUNK_ELEMENTS = 1 << 28


# function -> torch.compile(function, dynamic=True), built on first use (seconds; needs a compiler)
_COMPILED = {}


# (probe name, CUDA device index) -> whether torch.compile compiled and ran the probe's passes
_COMPILE_WORKS = {}


def _compiled(fn):
    """torch.compile(fn, dynamic=True), one per function: a kernel for every shape, compiled on the
    first call."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def _logprobs_pass(logits: torch.Tensor, ids: torch.Tensor):
    """(logits[ids] - logsumexp(logits), (logsumexp(logits), its tail)) in float32, one read of the
    logits."""
    z = logits.float()
    lse, m = torch.logsumexp(z, -1, keepdim=True), z.amax(-1, keepdim=True)  # (n, 1) each
    s = torch.exp(z - m).sum(-1, keepdim=True).log()
    tail = torch.where(m.abs() > FAR_FROM_ZERO, s - (lse - m), 0.0)  # what lse lost to rounding
    return logits.gather(-1, ids).float() - lse, torch.cat([lse, tail], -1)


def _logprobs_grad_pass(
    logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, tail: torch.Tensor, g: torch.Tensor
):
    """sum_k g_k (onehot(ids_k) - softmax(logits)) in the logits' dtype: the backward in one pass.
    -> (n, V)."""
    dense = torch.exp(logits.float() - lse - tail) * -g.sum(-1, keepdim=True)  # (n, V) float32
    return dense.scatter_add(-1, ids, g).to(logits.dtype)


def _two_or_more(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t with a size-1 `dim` repeated to size 2 (torch.compile specialises sizes 1: a graph of their
    own), else t."""
    return t if t.shape[dim] > 1 else torch.cat([t, t], dim)


def _fused_inputs(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, ids) alike for every chunk, so one compiled graph per logits dtype serves a tr.run:
    detached, ids contiguous, 1 row or K = 1 repeated to 2 (the copies' results are dropped). (n,
    V), (n, K) -> (max(n, 2), V), (max(n, 2), max(K, 2))."""
    rows = _two_or_more(logits.detach(), 0)  # a copy of one row only for a 1-row chunk
    both = _two_or_more(_two_or_more(ids, 1), 0).contiguous()
    return rows, both


def _fused_logprobs(logits: torch.Tensor, ids: torch.Tensor):
    """_logprobs_pass compiled on _fused_inputs. (n, V), (n, K) -> (n, K), (n, 2)."""
    n, K = ids.shape
    rows, both = _fused_inputs(logits, ids)
    with (
        torch.no_grad()
    ):  # grad and no-grad callers meet one compiled version (dynamo guards on both)
        out, lse = _compiled(_logprobs_pass)(rows, both)
    return out[:n, :K], lse[:n]


def _fused_logprobs_grad(
    logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, g: torch.Tensor
):
    """_logprobs_grad_pass compiled on _fused_inputs; g (n, K) contiguous, its K = 1 padded with a
    -0.0 column (x + -0.0 = x bitwise: the padded id adds nothing). -> (n, V)."""
    n, K = ids.shape
    rows, both = _fused_inputs(logits, ids)
    # a .sum()'s g has stride 0
    g_2 = g.contiguous() if K > 1 else torch.cat([g, torch.full_like(g, -0.0)], 1)
    # (n, 1) each, not views: a view of the (N, 2) lse makes dynamo guard on N too (and its 2 on K =
    # 2)
    lse_2, tail_2 = (_two_or_more(lse[:, k : k + 1], 0).clone() for k in (0, 1))
    with torch.no_grad():
        grad = _compiled(_logprobs_grad_pass)(rows, both, lse_2, tail_2, _two_or_more(g_2, 0))
    return grad[:n]


def _logprobs_probe(device: torch.device) -> None:
    """Compile and run the passes token_logprobs' fused path runs, forward and backward, on tiny
    fp32 and bf16 inputs (one graph per dtype; either failing means eager): sizes 3 x 7 with K = 2
    all differ, so the graph it compiles is the one every chunk of that dtype meets."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.zeros(3, 7, device=device, dtype=dtype)
        ids = torch.zeros(3, 2, dtype=torch.long, device=device)
        _, lse = _fused_logprobs(logits, ids)
        _fused_logprobs_grad(logits, ids, lse, torch.ones(3, 2, device=device))


def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA device: torch.device('cuda') is the current device, the same GPU as
    'cuda:<current>'."""
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


def _gpu_compiles(device: torch.device, probe) -> bool:
    """True on a CUDA device where torch.compile works: Triton present and probe(device), which
    compiles and runs the passes the caller would use, ran (once per probe and device index; the
    answer is kept in _COMPILE_WORKS)."""
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
            print(
                f"[tim_rl] torch.compile failed on {device} ({type(e).__name__}): eager fallbacks",
                file=sys.stderr,
            )
            _COMPILE_WORKS[key] = False
    return _COMPILE_WORKS[key]


def _fused_chunks(logits: torch.Tensor, ids: torch.Tensor, chunk_rows: int):
    """tim_rl._TokenLogprobs.forward with each chunk one compiled pass. (N, V), (N, K) -> (N, K),
    (N, 2)."""
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
            grad[rows] = _fused_logprobs_grad(
                logits[rows], ids[rows], lse[rows], grad_out[rows].float()
            )
        return grad, None, None


def fused_token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, chunk_rows: int | None = None, probe: bool = False
) -> torch.Tensor:
    """tim_rl.token_logprobs compiled, on (N, V) logits and (N, K) ids: chunks of
    FUSED_CHUNK_ELEMENTS logits by default.

    probe: only where torch.compile works on this GPU (_gpu_compiles), else tim_rl's eager chunks.
    """
    if probe and not _gpu_compiles(logits.device, _logprobs_probe):
        return tr.token_logprobs(logits, ids, chunk_rows)
    if chunk_rows is None:
        chunk_rows = max(1, FUSED_CHUNK_ELEMENTS // logits.shape[-1])
    return _FusedTokenLogprobs.apply(
        logits, ids, chunk_rows
    )  # without a graph to record: the forward alone


def hash_noise16(shape: tuple[int, ...], seed: torch.Tensor) -> torch.Tensor:
    """Counter-based uniform noise in [0, 2^16): 32-bit integer hash of (element index, seed).
    int32, `shape`.

    Deterministic given the seed (no generator state), so a compiler can fuse it with the rounding
    into one pass; on the seed's device. The hash is lowbias32 (C. Wellons' hash-prospector) of
    index * 0x9E3779B1 + seed; int32 products wrap, shifts are made logical by masking."""
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
    bits = (x.view(torch.int32) + hash_noise16(tuple(x.shape), seed)) & ~(
        (1 << BF16_DROPPED_BITS) - 1
    )
    return torch.where(
        torch.isfinite(x), bits.view(torch.float32).to(torch.bfloat16), x.to(torch.bfloat16)
    )


def stochastic_round_bf16_fused(x: torch.Tensor, seed: int, compile: bool = True) -> torch.Tensor:
    """stochastic_round_bf16 with hash_noise16(seed) as its noise, fused by torch.compile into one
    pass. Same shape.

    Bitwise equal to tr.stochastic_round_bf16(x, noise=hash_noise16(x.shape, seed)), so E[SR(x)] = x
    holds as far as the hash is uniform (tested). Use a fresh seed per export. For large models: the
    reference draws 2^16-valued noise with torch's generator in a separate pass; this runs at close
    to the speed of x.to(torch.bfloat16). compile=False runs the same code eagerly (slow; for
    machines without a compiler)."""
    _check_fp32("x", x)
    seed_t = torch.tensor(seed & 0x7FFFFFFF, dtype=torch.int32, device=x.device)
    flat = x.contiguous().reshape(-1)  # one compiled kernel for every parameter shape
    return (_compiled(_sr_hashed) if compile else _sr_hashed)(flat, seed_t).reshape(x.shape)


def _ef_one_pass(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """error_feedback_round_bf16 with round-to-nearest-even on the fp32 bits. Flat fp32 -> (bf16,
    fp32).

    Written on the bits because torch.compile drops the rounding from `target -
    target.to(bf16).float()`."""
    target = x + residual
    bits = target.view(torch.int32)
    half = (1 << (BF16_DROPPED_BITS - 1)) - 1 + ((bits >> BF16_DROPPED_BITS) & 1)  # ties to even
    served = ((bits + half) & ~((1 << BF16_DROPPED_BITS) - 1)).view(
        torch.float32
    )  # RNE, exact in fp32
    bad = ~torch.isfinite(target)  # where the reference's target - served is nan
    new_residual = torch.where(bad, torch.zeros_like(target), target - served)
    return torch.where(bad, x, served).to(torch.bfloat16), new_residual


def error_feedback_round_bf16_fused(x: torch.Tensor, residual: torch.Tensor, compile: bool = True):
    """error_feedback_round_bf16 as one pass fused by torch.compile, bitwise equal to it. (served
    bf16, e' fp32).

    The reference walks memory four times (add, cast, subtract, NaN check); this reads x and e once
    and writes served and e' once. compile=False runs the same code eagerly (slow; for machines
    without a compiler)."""
    _check_fp32("x", x)
    _check_fp32("residual", residual)
    _check_device("residual", residual, "x", x)
    if residual.shape != x.shape:
        raise ValueError(
            f"residual must have shape {tuple(x.shape)} like x, got {tuple(residual.shape)}"
        )
    # one kernel for every shape
    flat_x, flat_e = x.contiguous().reshape(-1), residual.contiguous().reshape(-1)
    served, new_residual = (_compiled(_ef_one_pass) if compile else _ef_one_pass)(flat_x, flat_e)
    return served.reshape(x.shape), new_residual.reshape(x.shape)


def _export_probe(device: torch.device) -> None:
    """Compile and run the passes of tr.Trainer.export's fused SR and EF exports on a tiny fp32
    input (_gpu_compiles)."""
    x = torch.zeros(7, device=device)
    stochastic_round_bf16_fused(x, seed=1)
    error_feedback_round_bf16_fused(x, torch.zeros_like(x))


def gpu_rounding(device: torch.device, generator: torch.Generator | None):
    """tr.Trainer.export's bf16 roundings on a GPU -> (sr(master), ef(master, residual)): fused
    where torch.compile works there (probed once), SR's noise hash_noise16 seeded by one draw from
    `generator` per tensor."""
    fast = _gpu_compiles(device, _export_probe)

    def sr(master: torch.Tensor) -> torch.Tensor:
        """Stochastic rounding of one tensor, its seed drawn from the run's generator."""
        return stochastic_round_bf16_fused(master, tr.draw_seed(generator), compile=fast)

    return sr, (error_feedback_round_bf16_fused if fast else tr.error_feedback_round_bf16)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk_rows=None, probe: bool = False):
    """tim_rl.token_logprobs (its checks, shapes and strided-slice handling) with one compiled pass
    per chunk: fused_token_logprobs as its chunk_pass. chunk_rows None: FUSED_CHUNK_ELEMENTS'
    sizing."""

    def chunk_pass(x, i, rows):
        """The compiled pass on one (N, V) block."""
        return fused_token_logprobs(x, i, chunk_rows, probe=probe)

    return tr.token_logprobs(logits, ids, chunk_pass=chunk_pass)
