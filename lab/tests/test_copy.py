"""The copy test, as a user does it: tim_rl.py and test_tim_rl.py copied alone (with bases/tiny and
examples/ as data) into an empty directory whose Python has the project's dependencies but not the
project, then the demo at a tiny size, `train --steps 2`, the doctor, the teaching tests and the
public names a CPU runs. And the import rules by the AST: tim_rl.py imports nothing of this
repository (nor importlib, __import__ or exec); the lab never assigns into tim_rl."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tim_rl as tr

ROOT = Path(tr.__file__).resolve().parent
LAB = ROOT / "lab"

# Run a file or `-m pytest` with this Python's dependencies but without the project: the editable
# install's import hook and any path into the repository (but a virtual environment's packages
# inside it, as CI's) are removed before the target runs.
ISOLATE = """import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
inside = [p for p in sys.path if p == REPO or p.startswith(REPO + "/") and "-packages" not in p]
sys.path[:] = [p for p in sys.path if p not in inside]
sys.path.insert(0, ".")
target, *sys.argv = sys.argv[1:]
if target == "pytest":
    import pytest
    sys.exit(pytest.main(sys.argv))
sys.argv.insert(0, target)
runpy.run_path(target, run_name="__main__")
"""

API_SCRIPT = """import torch
import tim_rl as tr
assert tr.__file__.startswith(HERE), tr.__file__
try:
    import lab  # noqa: F401
    raise SystemExit("the project is importable here")
except ImportError:
    pass
base = tr.resolve_model_dir("runs/base")
model, tok = tr.load_model(base), tr.load_tokenizer(base)
prompts = [tok.encode("12+34="), tok.encode("5+7=")]
gen = torch.Generator().manual_seed(0)
ro = tr.decode(model, prompts, 4, 1.0, 4, gen, tok.decode, tok.eos_id, tok.pad_id)
assert ro.mask.any() and ro.logp_infer.shape == ro.mask.shape
trainer = tr.Trainer(model, lr=1e-4, export_dtype="bf16")
state, visible = trainer.export("sr", generator=torch.Generator().manual_seed(0))
assert all(v.dtype == torch.bfloat16 for v in state.values()) and 0 <= visible <= 1
logits = torch.randn(2, 3, 11)
ids = torch.randint(0, 11, (2, 3))
ref = logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0]
assert torch.allclose(tr.token_logprobs(logits, ids), ref)
cfg = tr.RLConfig(steps=1, prompts=2, group=2, eval_n=4, out_dir="runs", name="api", progress=False)
state = tr.setup_run(cfg)
record = tr.rl_step(cfg, 0, state)
assert "mm_k3" in record and "reward" in record, sorted(record)
g = torch.Generator().manual_seed(0)
logp = -torch.rand(16, 6, generator=g)
noisy = logp + 0.01 * torch.randn(16, 6, generator=g)
print(tr.diagnose_mismatch(logp, noisy, torch.ones(16, 6, dtype=torch.bool)))
print("API OK")
"""


@pytest.fixture(scope="module")
def copy_dir(tmp_path_factory) -> Path:
    """An empty directory holding tim_rl.py, test_tim_rl.py, bases/tiny and examples/ and nothing
    else."""
    here = tmp_path_factory.mktemp("copy")
    for name in ("tim_rl.py", "test_tim_rl.py"):
        shutil.copy(ROOT / name, here / name)
    shutil.copytree(ROOT / "bases" / "tiny", here / "bases" / "tiny")
    shutil.copytree(ROOT / "examples", here / "examples")
    (here / "_isolate.py").write_text(f"REPO = {str(ROOT)!r}\n" + ISOLATE)
    (here / "api.py").write_text(f"HERE = {str(here)!r}\n" + API_SCRIPT)
    return here


def _run(copy_dir: Path, *args: str, timeout: int = 300) -> str:
    """`python _isolate.py ARGS` in the copy; its output, or a failure with it."""
    done = subprocess.run(
        [sys.executable, "_isolate.py", *args],
        cwd=copy_dir,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    assert done.returncode == 0, (
        f"{args}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout + done.stderr


@pytest.mark.slow
def test_the_copied_file_runs_its_commands_alone(copy_dir):
    out = _run(
        copy_dir,
        "tim_rl.py",
        "train",
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--eval-n",
        "16",
        "--no-progress",
    )
    assert (
        "evaluations (first -> last)" in out
        and (copy_dir / "runs" / "run" / "metrics.jsonl").is_file()
    )
    out = _run(copy_dir, "tim_rl.py", "doctor", "examples/doctor_batch.safetensors")
    assert "cause: numerics" in out
    out = _run(copy_dir, "tim_rl.py", "demo", "--steps", "2", "--seeds", "0")
    assert "policy lag" in out and (copy_dir / "runs" / "demo" / "demo.png").is_file()
    assert not list((copy_dir / "runs" / "demo").glob("*/checkpoint.safetensors")), (
        "the demo keeps no checkpoint"
    )
    assert "usage: tim_rl" in _run(copy_dir, "tim_rl.py", "--help")


@pytest.mark.slow
def test_the_copied_public_names_run_alone(copy_dir):
    out = _run(copy_dir, "api.py")
    assert "API OK" in out and "cause:" in out


@pytest.mark.slow
def test_the_copied_teaching_tests_pass_alone(copy_dir):
    out = _run(copy_dir, "pytest", "-q", "-p", "no:cacheprovider", "test_tim_rl.py", timeout=600)
    assert " passed" in out and "failed" not in out


def test_the_copied_file_alone_asks_for_a_model_in_one_line(tmp_path):
    """tim_rl.py copied without bases/: train and the demo refuse in one line naming what to copy
    (they went on to a traceback from transformers); the doctor needs no model and runs."""
    shutil.copy(ROOT / "tim_rl.py", tmp_path / "tim_rl.py")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / "_isolate.py").write_text(f"REPO = {str(ROOT)!r}\n" + ISOLATE)
    for argv in (["train", "--steps", "1"], ["demo", "--steps", "1", "--seeds", "0"]):
        done = subprocess.run(
            [sys.executable, "_isolate.py", "tim_rl.py", *argv],
            cwd=tmp_path,
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (argv, done.stderr[-2000:])
        assert "copy bases/tiny/ beside tim_rl.py" in done.stderr
    assert "cause: numerics" in _run(
        tmp_path, "tim_rl.py", "doctor", "examples/doctor_batch.safetensors"
    )


def test_the_isolation_hides_the_project(copy_dir):
    """Anti-vacuity for the copy tests: in the copy, `import lab` fails and tim_rl is the copied
    file."""
    probe = copy_dir / "probe.py"
    probe.write_text(
        "import tim_rl\nprint(tim_rl.__file__)\ntry:\n    import lab\n    print('LAB FOUND')\n"
        "except ImportError:\n    print('no lab')\n"
    )
    out = _run(copy_dir, "probe.py")
    assert "no lab" in out and str(copy_dir) in out


def _imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


def test_tim_rl_imports_nothing_of_this_repository():
    tree = ast.parse((ROOT / "tim_rl.py").read_text())
    repository = {p.stem for p in ROOT.glob("*.py")} - {"tim_rl"} | {
        "lab",
        ".",
        "machinery",
        "experiments",
    }
    assert not _imports(tree) & repository, _imports(tree) & repository
    assert "importlib" not in _imports(tree)
    calls = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert not calls & {"__import__", "exec", "eval"}, calls & {"__import__", "exec", "eval"}
    # anti-vacuity: the same check finds a planted lazy import and an exec
    planted = ast.parse("def f():\n    import machinery\n    exec('1')\n")
    assert "machinery" in _imports(planted) & repository


def test_the_lab_never_assigns_into_tim_rl():
    found = []
    for path in [*LAB.glob("*.py"), *LAB.glob("parity/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id in ("tr", "tim_rl")
                ):
                    found.append(f"{path.name}:{node.lineno}")
            call = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(call, ast.Name)
                and call.id == "setattr"
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in ("tr", "tim_rl")
            ):
                found.append(f"{path.name}:{node.lineno}")
    assert found == [], f"the lab assigns into tim_rl at {found}"
