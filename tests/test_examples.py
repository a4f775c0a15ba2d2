"""examples/imdb_lstm.py end to end under real mpirun (2 ranks, synthetic corpus, small sizes).

Three launches (each costs ~30 s of mpirun start-up, TensorFlow import and
exit on a 2-core machine, plus a few seconds of training):

  A. float32, 1 epoch, --checkpoint-dir D               (fresh start, saves)
  B. float32, --epochs 2, same D, --plot P              (resumes at epoch 2)
  C. mixed_float16, 2 epochs from scratch

B's final accuracy is the float32 accuracy, so it also checks that resuming
continues training (weights, optimizer state and step count) rather than
restarting. C must land within 0.05 of it. A quick single-process run checks
the missing-data message, and the schedule module is checked in this process
(no MPI needed).
"""
import json
import math
import os
import pathlib
import tempfile

import pytest

from mpi_harness import assert_resumed_example, run_example, shared_run, start_shared


# 1500 reviews x 50 words per rank, 30 steps per epoch; the learning-rate
# flags are the example's defaults, spelled out for the expected-rate check.
LR0, DECAY, STEPS_PER_EPOCH = 2e-3, 0.9, 30
SMALL = ["--synthetic", "--train-samples", "3000", "--test-samples", "600", "--maxlen", "50",
         "--batch-size", "50", "--vocab", "5000", "--lr", str(LR0), "--lr-decay", str(DECAY),
         "--warmup-epochs", "0.5"]
LAUNCH_TIMEOUT = 300


WORKDIR = pathlib.Path(tempfile.mkdtemp(prefix="tfmpi_imdb_lstm_"))  # made at import: launches start early
# A saves a checkpoint; B resumes from it and plots the whole history (the plot is checked once: B's).
CHECKPOINT = ["--checkpoint-dir", str(WORKDIR / "ckpt")]
SAVING = CHECKPOINT + ["--plot", str(WORKDIR / "curves.png")]


def run_imdb(args, np=2, timeout=LAUNCH_TIMEOUT, cwd=str(WORKDIR)):
    return run_example("imdb_lstm.py", args, np=np, timeout=timeout, cwd=cwd)


def first_then_resumed():
    """A (fresh start, 1 epoch), its checkpoint as A left it (B replaces it), and B (resumes A for a
    2nd epoch; only if A ended well)."""
    first = run_imdb(SMALL + ["--epochs", "1"] + CHECKPOINT)
    if first.timed_out or first.returncode != 0 or first.result is None:
        return first, None, None
    state = _state(WORKDIR)
    saved = {"state": state, "model_exists": os.path.exists(WORKDIR / "ckpt" / state["model"])}
    return first, saved, run_imdb(SMALL + ["--epochs", "2"] + SAVING)


MIXED = SMALL + ["--epochs", "2", "--precision", "mixed_float16"]
MISSING_DATA = ["--data", str(WORKDIR / "absent" / "imdb.npz")]


def prefetch(items):
    names = {item.originalname for item in items}
    if names & {"test_first_run_trains_and_checkpoints", "test_resume_starts_at_saved_epoch_with_identical_replicas",
                "test_float32_accuracy", "test_mixed_float16_matches_float32"}:
        start_shared(first_then_resumed)
    if "test_mixed_float16_matches_float32" in names:
        start_shared(run_imdb, MIXED)
    if "test_missing_data_says_how_to_get_it" in names:
        start_shared(run_imdb, MISSING_DATA, np=None, timeout=120)


@pytest.fixture(scope="module")
def workdir():
    return WORKDIR


@pytest.fixture(scope="module")
def first_run():
    return shared_run(first_then_resumed)[0]


@pytest.fixture(scope="module")
def resumed_run(first_run):
    first_run.assert_ok()
    return shared_run(first_then_resumed)[2]


@pytest.fixture(scope="module")
def mixed_run():
    return shared_run(run_imdb, MIXED)


def _state(workdir):
    with open(workdir / "ckpt" / "state.json") as f:
        return json.load(f)


def expected_lr(step):
    """The example's schedule after `step` optimizer steps (2 workers), computed independently."""
    base = LR0 * 2 / (1 + 2 / 100)
    return base * DECAY ** math.floor(step / STEPS_PER_EPOCH)  # past the 0.5-epoch warm-up


def test_first_run_trains_and_checkpoints(first_run):
    first_run.assert_ok()
    r = first_run.result
    assert (r["ranks"], r["precision"], r["initial_epoch"], r["epochs_run"]) == (2, "float32", 0, 1), r
    assert r["train_samples_per_rank"] == 1500, r
    assert r["weights_identical"] and r["optimizer_state_identical"], r
    saved = shared_run(first_then_resumed)[1]  # the checkpoint right after this run
    state = saved["state"]
    assert state["epoch"] == 1 and len(state["history"]) == 1, state
    assert saved["model_exists"], state


def test_resume_starts_at_saved_epoch_with_identical_replicas(resumed_run, workdir):
    assert_resumed_example(resumed_run, workdir, expected_lr(2 * STEPS_PER_EPOCH),
                           ["model-epoch002.keras", "state.json"])


def test_float32_accuracy(resumed_run):
    resumed_run.assert_ok()
    assert resumed_run.result["val_accuracy"] > 0.75, resumed_run.result


def test_mixed_float16_matches_float32(mixed_run, resumed_run):
    mixed_run.assert_ok()
    resumed_run.assert_ok()
    m, f = mixed_run.result, resumed_run.result
    assert m["precision"] == "mixed_float16" and m["initial_epoch"] == 0 and m["epochs_run"] == 2, m
    assert m["weights_identical"] and m["optimizer_state_identical"], m
    assert abs(m["val_accuracy"] - f["val_accuracy"]) <= 0.05, (m, f)


def test_missing_data_says_how_to_get_it():
    run = shared_run(run_imdb, MISSING_DATA, np=None, timeout=120)
    assert not run.timed_out, run.describe()
    assert run.returncode not in (0, None), run.describe()
    assert "tf-keras-datasets/imdb.npz" in run.output and "--synthetic" in run.output, run.describe()
    assert not run.results, run.describe()


SCHEDULE_CHECKS = r"""
import math, keras
import tf_mpi
from tf_mpi.keras.schedules import WorkerScaledSchedule, worker_scaled_lr
assert not tf_mpi.is_initialized()
assert math.isclose(worker_scaled_lr(1e-3, 1), 1e-3 / 1.01)
assert math.isclose(worker_scaled_lr(1e-3, 8), 8e-3 / 1.08)
assert worker_scaled_lr(1e-3, 10**6) < 0.1 and worker_scaled_lr(1e-3, 64, max_lr=0.02) == 0.02
s = WorkerScaledSchedule(1e-3, 8, steps_per_epoch=10, decay=0.5, warmup_epochs=1.5)
lrs = [float(s(k)) for k in range(60)]
assert all(math.isclose(a, s.value(0, k), rel_tol=1e-5) for k, a in enumerate(lrs))
assert math.isclose(lrs[0], 1e-3 + (s.base_lr - 1e-3) / 15, rel_tol=1e-5)   # warm-up starts near lr0
assert all(b >= a - 1e-9 for a, b in zip(lrs[:10], lrs[1:10]))             # rises during warm-up
assert math.isclose(lrs[25], s.base_lr / 4, rel_tol=1e-5)                   # epoch 2: decay ** 2
assert max(lrs) <= s.base_lr * (1 + 1e-6)
again = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(s))
assert type(again) is WorkerScaledSchedule and again.get_config() == s.get_config()
opt = keras.optimizers.Adam.from_config(keras.optimizers.Adam(s).get_config())
assert opt._learning_rate.get_config() == s.get_config()
print("SCHEDULE_OK")
"""


def test_schedule_module_without_mpi(capsys):
    exec(SCHEDULE_CHECKS, {})  # in this process: tf_mpi imported, never initialised
    assert "SCHEDULE_OK" in capsys.readouterr().out
