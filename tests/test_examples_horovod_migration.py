"""examples/horovod_migration.py: a Horovod-style TF2 training script whose only
tf_mpi-specific line is its import, run unchanged under real mpirun (2 ranks)."""
import ast
import os
import pathlib
import tempfile

import pytest

from mpi_harness import run_example, shared_run, start_shared

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "examples", "horovod_migration.py")
# What the script may use from `hvd`: names horovod.tensorflow (0.28.1) has too.
HOROVOD_NAMES = {"init", "size", "rank", "local_rank", "DistributedGradientTape", "broadcast_variables",
                 "allreduce", "allgather", "Average"}


def test_the_import_is_the_only_change_from_horovod():
    with open(SCRIPT) as f:
        tree = ast.parse(f.read())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    mentions = [n for n in imports if any("tf_mpi" in (a.name or "") for a in n.names)
                or "tf_mpi" in (getattr(n, "module", None) or "")]
    assert len(mentions) == 1 and [(a.name, a.asname) for a in mentions[0].names] == [("tf_mpi", "hvd")]
    docstring = ast.get_docstring(tree, clean=False)
    others = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
              and "tf_mpi" in n.value and n.value != docstring]
    others += [n for n in ast.walk(tree) if isinstance(n, ast.Name) and "tf_mpi" in n.id]
    assert not others, [ast.dump(n) for n in others]
    used = {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "hvd"}
    assert used <= HOROVOD_NAMES, used - HOROVOD_NAMES
    assert {"init", "DistributedGradientTape", "broadcast_variables", "allreduce"} <= used


WORKDIR = pathlib.Path(tempfile.mkdtemp(prefix="tfmpi_horovod_migration_"))  # made at import: the launch starts early
ARGS = ["--steps", "240", "--checkpoint-dir", str(WORKDIR / "ckpt")]


def prefetch(items):
    if "test_trains_with_identical_replicas_and_rank_0_checkpoint" in {item.originalname for item in items}:
        start_shared(run_example, "horovod_migration.py", ARGS, np=2, timeout=300, cwd=str(WORKDIR))


@pytest.fixture(scope="module")
def run():
    return shared_run(run_example, "horovod_migration.py", ARGS, np=2, timeout=300, cwd=str(WORKDIR)), WORKDIR


def test_trains_with_identical_replicas_and_rank_0_checkpoint(run):
    result, workdir = run
    result.assert_ok()
    r = result.result
    assert r["ranks"] == 2 and r["steps"] == 120, r
    assert r["final_loss"] < 0.35 * r["first_loss"] and r["accuracy"] > 0.8, r
    # Different initial weights per rank; broadcast after the first step, then averaged gradients.
    a, b = r["weight_checksums"]
    assert a == b, r
    assert r["checkpoint"] == str(workdir / "ckpt" / "ckpt-1"), r
    assert sorted(os.listdir(workdir / "ckpt")) == ["checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]
