"""The testbed's making (lab only): pre-training the tiny Llama and Qwen3-MoE committed under
bases/, the mixed-length task, the tiny models' builders, expert usage, and OpenMP's wait policy for
a shared machine.

tim_rl.py runs the committed bases (tim_rl.resolve_model_dir); this module makes them:
`python -m lab pretrain --out bases/tiny` and `... --moe --out bases/tiny-moe`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import tim_rl as tr
from tim_rl import BOS_ID, EOS_ID, PAD_ID


@dataclass
class PretrainConfig:
    """Supervised pre-training of the embedded tiny model on the arithmetic task."""

    out: str = tr.cli_field("runs/base", "model directory written (safetensors + tokenizer)")
    steps: int = tr.cli_field(
        400, "AdamW steps (400: held-out greedy ~0.7, sampled reward ~0.4: room for RL)"
    )
    batch: int = tr.cli_field(64, "problems per step")
    lr: float = tr.cli_field(1e-3, "AdamW learning rate (cosine to 10%)")
    digits: int = tr.cli_field(2, "operand digits")
    ops: str = tr.cli_field(
        "+", "operators drawn from: + - * and s (swap: 'a s b=' -> 'ba', 2 x digits tokens)"
    )
    seed: int = tr.cli_field(0, "seed of init and data")
    moe: bool = tr.cli_field(
        False, "a tiny Qwen3-MoE (8 experts, top-2, load-balancing loss), not the Llama"
    )
    mixed_digits: str = tr.cli_field(
        "", "comma-separated digit counts pre-trained in turn ('' = --digits alone)"
    )
    max_positions: int = tr.cli_field(
        64, "max_position_embeddings (prompt + answer; the swap task: 4 x digits + 4)"
    )


def mixed_arithmetic_task(
    n: int,
    digits: tuple[int, ...],
    seed: int = 0,
    ops: str = "+",
    split: str = "pretrain",
    block: int = 1,
):
    """n problems over several operand digit counts, `block` at a time in turn: the i-th has
    digits[(i // block) % len(digits)]. Each count draws from make_arithmetic_task's own pools (a
    count named twice comes up twice as often, with distinct problems)."""
    if not digits or block < 1:
        raise ValueError(
            f"digits must name at least one digit count and block be >= 1, "
            f"got {digits!r}, {block!r}"
        )
    turn = [digits[(i // block) % len(digits)] for i in range(n)]  # the i-th problem's digit count
    per = {
        d: iter(tr.make_arithmetic_task(turn.count(d), d, seed, ops, split)) for d in set(digits)
    }
    return [next(per[d]) for d in turn]


def build_tiny_model(
    vocab_size: int = 128,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    intermediate: int = 384,
    max_positions: int = 64,
    seed: int = 0,
):
    """An untied Llama, head size 32 (vLLM CPU attention needs 32/64/...), ~0.9 M parameters.

    Untied embeddings because vLLM's CPU build keeps a pre-packed copy of a tied output head across
    in-place weight syncs: after a sync the head would still compute with the old weights.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


MOE_BASE = "runs/base-moe"  # where `pretrain --moe` and the moe preset keep the tiny MoE model


MOE_AUX_LOSS = 0.01  # pre-training's load-balancing loss coefficient (router_aux_loss_coef)


def build_tiny_moe_model(
    vocab_size: int = 128,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    experts: int = 8,
    top_k: int = 2,
    expert_intermediate: int = 96,
    max_positions: int = 64,
    seed: int = 0,
):
    """A Qwen3-MoE (the family of Qwen3-30B-A3B): each layer's router picks top_k of `experts`
    experts per token, weights renormalised over them; ~1.5 M parameters, untied embeddings."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=expert_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_intermediate,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        router_aux_loss_coef=MOE_AUX_LOSS,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).float()


def _warmup_cosine(steps: int):
    """The learning-rate factor at step s: 50 steps of linear warm-up, then cosine down to 0.1."""

    def factor(s: int) -> float:
        """min(1, (s + 1) / 50) x (0.1 + 0.9 x half a cosine)."""
        return min(1.0, (s + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))

    return factor


def _eval_accuracy(model, tokenizer, digits: int, ops: str, n: int = 512) -> float:
    """Greedy exact match on n held-out problems; room for the longest answer (a product, a swap),
    <eos>."""
    problems = tr.make_arithmetic_task(n, digits, 0, ops, split="eval")
    return tr.greedy_accuracy(model, tokenizer, problems, max(6, 2 * digits + 1))


def pretrain(cfg: PretrainConfig) -> dict:
    """Supervised training of the tiny model on "prompt answer<eos>" (loss on the answer), saved to
    cfg.out."""
    from tqdm.auto import tqdm

    tokenizer = tr.CharTokenizer()
    build = build_tiny_moe_model if cfg.moe else build_tiny_model
    model = build(vocab_size=tokenizer.vocab_size, seed=cfg.seed, max_positions=cfg.max_positions)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(cfg.steps))
    mixed = tuple(
        int(d) for d in cfg.mixed_digits.split(",") if d
    )  # several answer lengths, one model
    n = cfg.steps * cfg.batch
    problems = mixed_arithmetic_task(n, mixed or (cfg.digits,), cfg.seed, cfg.ops, "pretrain")
    router_logits = {"output_router_logits": True} if cfg.moe else {}  # MoE: + the balancing loss
    t0 = time.time()
    for step in tqdm(range(cfg.steps), desc="pretrain", mininterval=2):
        batch = problems[step * cfg.batch : (step + 1) * cfg.batch]
        seqs = [(tokenizer.encode(p), tokenizer.encode(a, bos=False) + [EOS_ID]) for p, a in batch]
        L = max(len(p) + len(a) for p, a in seqs)
        ids = torch.tensor([p + a + [PAD_ID] * (L - len(p) - len(a)) for p, a in seqs])  # (B, L)
        labels = torch.tensor(
            [[-100] * len(p) + a + [-100] * (L - len(p) - len(a)) for p, a in seqs]
        )
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
    save_char_tokenizer(tokenizer, out)
    params = sum(p.numel() for p in model.parameters())
    info = {
        "greedy_accuracy_eval": acc,
        "seconds": time.time() - t0,
        "steps": cfg.steps,
        "digits": cfg.digits,
        "ops": cfg.ops,
        "params": params,
    }
    if mixed:  # held-out greedy exact match of each length (256 problems each)
        info["mixed_digits"] = {
            d: tr.greedy_accuracy(
                model,
                tokenizer,
                tr.make_arithmetic_task(256, d, 0, cfg.ops, split="eval"),
                2 * d + 1,
            )
            for d in mixed
        }
    if cfg.moe:
        held_out = tr.make_arithmetic_task(256, cfg.digits, 0, cfg.ops, split="eval")
        info["expert_usage"] = expert_usage(model, tokenizer, held_out)
    (out / "pretrain.json").write_text(json.dumps(info, indent=1))
    return info


@torch.no_grad()
def expert_usage(model, tokenizer, problems) -> list[list[float]]:
    """Share of the routed (token, slot) pairs each expert gets, per MoE layer, over the problems'
    prompt + answer tokens (a balanced router: 1 / experts each). -> [layers][experts]."""
    seqs = [tokenizer.encode(p + a) for p, a in problems]
    ids, mask = tr.left_pad(seqs, tokenizer.pad_id, next(model.parameters()).device)
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # 0 at each row's first real token
    with tr.replay_routes(model) as log:
        model(input_ids=ids, attention_mask=mask.long(), position_ids=positions)
    routes = tr.stack_routes(log, ids.shape[0])[mask.cpu()].long()  # (N, L, k) real tokens only
    experts = tr.moe_routers(model)[0].num_experts
    moe_layers = [layer for layer in range(routes.shape[1]) if routes[0, layer, 0] >= 0]
    counts = [torch.bincount(routes[:, layer].flatten(), minlength=experts) for layer in moe_layers]
    return [[round(float(c / row.sum()), 4) for c in row] for row in counts]


# The tiny bases committed with the repository (tim_rl.BASES), so every machine starts from the same
# weights, and the PretrainConfig changes each was made with (`python -m lab pretrain --out
# bases/tiny`, `... --moe --out bases/tiny-moe`).
MADE_WITH = {"runs/base": {}, MOE_BASE: {"moe": True}}


def committed_base(moe: bool = False) -> Path:
    """The committed tiny base: bases/tiny (the Llama) or bases/tiny-moe (the Qwen3-MoE)."""
    return tr.resolve_model_dir(MOE_BASE if moe else "runs/base")


def ensure_base_model(path: str | Path = "runs/base", **change) -> Path:
    """The model at `path`; else, for runs/base and runs/base-moe with their settings, the committed
    copy (tim_rl.resolve_model_dir); else pre-train the tiny model (PretrainConfig with
    `change`)."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    made_with = MADE_WITH.get(path.as_posix())
    if made_with is not None and PretrainConfig(**change) == PretrainConfig(**made_with):
        committed = tr.resolve_model_dir(path.as_posix())
        if (committed / "config.json").exists():
            return committed
    print(
        f"[tim_rl] no model at {path}: pre-training the embedded tiny model (~20 s)",
        file=sys.stderr,
    )
    pretrain(PretrainConfig(out=str(path), **change))
    return path


def save_char_tokenizer(tokenizer: tr.CharTokenizer, directory: str | Path) -> None:
    """Write an HF fast tokenizer equal to tim_rl.CharTokenizer, so transformers and vLLM load the
    directory offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=tokenizer.index, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one per character
    tok.decoder = decoders.Fuse()
    bos = [("<bos>", BOS_ID)]
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=bos)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(directory))


def planted_faults(model, at: tuple = (2, 3, 1)) -> dict:
    """{name: (reference, its copy, the layer a fault was planted in or None)} for layer_divergence:
    the fp32 model against bf16, fp16 and int8 copies (no fault), and three faults a practitioner
    meets, at the layers `at`: a partial sync (the trainer took one Adam step, lr 1e-3, on random
    ids; the sampler got it in every layer but at[0]), one layer's input norm scaled by 1 %
    (at[1]), one layer computed in bf16 inside the fp32 model, its weights and output rounded
    (at[2])."""
    import copy

    def changed(edit):
        other = copy.deepcopy(model)
        edit(other)
        return other.eval()

    trainer = copy.deepcopy(model)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-3)
    ids = torch.randint(
        0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1)
    )
    trainer(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    trainer.eval()

    def one_step_behind(other):
        other.load_state_dict(trainer.state_dict())
        other.model.layers[at[0]].load_state_dict(model.model.layers[at[0]].state_dict())

    def layer_in_bf16(other):
        layer = other.model.layers[at[2]]
        for p in layer.parameters():
            p.data.copy_(p.data.bfloat16().float())

        def rounded(module, inputs, output):
            if isinstance(output, tuple):
                return (output[0].bfloat16().float(), *output[1:])
            return output.bfloat16().float()

        layer.register_forward_hook(rounded)

    def int8(other):
        for name, p in other.named_parameters():
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.data.copy_(tr.fake_quantize(p.data, "int8"))

    return {
        "identical": (model, changed(lambda m: None), None),
        "bf16": (model, changed(lambda m: m.to(torch.bfloat16)), None),
        "fp16": (model, changed(lambda m: m.to(torch.float16)), None),
        "int8": (model, changed(int8), None),
        f"one step behind at {at[0]}": (trainer, changed(one_step_behind), at[0]),
        f"norm x1.01 at {at[1]}": (
            model,
            changed(lambda m: m.model.layers[at[1]].input_layernorm.weight.data.mul_(1.01)),
            at[1],
        ),
        f"bf16 layer {at[2]}": (model, changed(layer_in_bf16), at[2]),
    }
