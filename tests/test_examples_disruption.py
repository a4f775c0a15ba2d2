"""examples/disruption_lstm.py and examples/benchmark_lstm.py end to end under real mpirun (2 ranks).

Four launches (each costs ~30 s of mpirun start-up, TensorFlow import,
tracing and exit on a 2-core machine, plus a few seconds of work):

  A. disruption, float32, 1 epoch, --checkpoint-dir D            (fresh start, saves)
  B. disruption, float32, --epochs 2, same D, --plot P           (resumes at epoch 2)
  C. disruption, mixed_float16 with fp16 compression, 2 epochs from scratch
  D. benchmark_lstm, a few steps of a small model, --json J

B's final AUC is the float32 AUC, so it also checks that resuming continues
training (weights, optimizer state and step count) rather than restarting.
C must land within 0.05 of it.
"""
import json
import os
import pathlib
import tempfile

import pytest

from mpi_harness import assert_resumed_example, run_example, shared_run, start_shared

DISRUPTION, BENCHMARK = "disruption_lstm.py", "benchmark_lstm.py"

# 400 training shots per rank, 4 windows of 64 steps each per epoch: 50
# steps of 32 windows per epoch and rank. The learning-rate flags are the
# example's defaults, spelled out for the expected-rate check.
LR0, DECAY, STEPS_PER_EPOCH = 3e-3, 0.9, 50
SMALL = ["--train-shots", "800", "--test-shots", "400", "--windows-per-shot", "4", "--batch-size", "32",
         "--lr", str(LR0), "--lr-decay", str(DECAY), "--warmup-epochs", "0.5"]
LAUNCH_TIMEOUT = 300


WORKDIR = pathlib.Path(tempfile.mkdtemp(prefix="tfmpi_disruption_lstm_"))  # made at import: launches start early
# A saves a checkpoint; B resumes from it and plots the whole history (the plot is checked once: B's).
CHECKPOINT = ["--checkpoint-dir", str(WORKDIR / "ckpt")]
SAVING = CHECKPOINT + ["--plot", str(WORKDIR / "curves.png")]
MIXED = SMALL + ["--epochs", "2", "--precision", "mixed_float16", "--compression", "fp16"]
BENCH_JSON = WORKDIR / "bench.json"
BENCH = ["--steps", "3", "--warmup", "1", "--seq-len", "20", "--vocab", "2000", "--units", "32",
         "--precision", "mixed_float16", "--compression", "fp16", "--json", str(BENCH_JSON)]


def launch(script, args, np=2, timeout=LAUNCH_TIMEOUT, cwd=str(WORKDIR)):
    return run_example(script, args, np=np, timeout=timeout, cwd=cwd)


def first_then_resumed():
    """A (fresh start, 1 epoch), its checkpoint as A left it (B replaces it), and B (resumes A for a
    2nd epoch; only if A ended well)."""
    first = launch(DISRUPTION, SMALL + ["--epochs", "1"] + CHECKPOINT)
    if first.timed_out or first.returncode != 0 or first.result is None:
        return first, None, None
    state = _state(WORKDIR)
    saved = {"state": state, "file_exists": os.path.exists(WORKDIR / "ckpt" / state["file"])}
    return first, saved, launch(DISRUPTION, SMALL + ["--epochs", "2"] + SAVING)


def prefetch(items):
    names = {item.originalname for item in items}
    if names & {"test_first_run_trains_and_checkpoints", "test_resume_starts_at_saved_epoch_with_identical_replicas",
                "test_float32_shot_level_auc", "test_mixed_float16_matches_float32"}:
        start_shared(first_then_resumed)
    if "test_mixed_float16_matches_float32" in names:
        start_shared(launch, DISRUPTION, MIXED)
    if "test_benchmark_smoke" in names:
        start_shared(launch, BENCHMARK, BENCH, timeout=200)


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
    return shared_run(launch, DISRUPTION, MIXED)


def _state(workdir):
    with open(workdir / "ckpt" / "state.json") as f:
        return json.load(f)


def expected_lr(step):
    """The example's schedule after `step` optimizer steps (2 workers), computed independently."""
    base = LR0 * 2 / (1 + 2 / 100)
    return base * DECAY ** (step // STEPS_PER_EPOCH)  # past the 0.5-epoch warm-up


def test_first_run_trains_and_checkpoints(first_run):
    first_run.assert_ok()
    r = first_run.result
    assert (r["example"], r["ranks"], r["precision"], r["initial_epoch"], r["epochs_run"]) == \
        ("disruption_lstm", 2, "float32", 0, 1), r
    assert r["train_shots_per_rank"] == 400 and r["test_shots"] == 400, r
    assert r["weights_identical"] and r["optimizer_state_identical"], r
    assert 0.0 <= r["auc"] <= 1.0 and r["loss"] > 0, r
    saved = shared_run(first_then_resumed)[1]  # the checkpoint right after this run
    state = saved["state"]
    assert state["epoch"] == 1 and len(state["history"]) == 1, state
    assert saved["file_exists"], state


def test_resume_starts_at_saved_epoch_with_identical_replicas(resumed_run, workdir):
    assert_resumed_example(resumed_run, workdir, expected_lr(2 * STEPS_PER_EPOCH),
                           ["ckpt-epoch002.npz", "state.json"])
    assert resumed_run.result["epochs"] == 2, resumed_run.result


def test_float32_shot_level_auc(resumed_run):
    resumed_run.assert_ok()
    assert resumed_run.result["auc"] > 0.8, resumed_run.result


def test_mixed_float16_matches_float32(mixed_run, resumed_run):
    mixed_run.assert_ok()
    resumed_run.assert_ok()
    m, f = mixed_run.result, resumed_run.result
    assert (m["precision"], m["compression"], m["initial_epoch"], m["epochs_run"]) == \
        ("mixed_float16", "fp16", 0, 2), m
    assert m["weights_identical"] and m["optimizer_state_identical"], m
    assert m["loss_scale"] > 0, m
    assert m["auc"] > 0.8, m
    assert abs(m["auc"] - f["auc"]) <= 0.05, (m, f)


def test_benchmark_smoke():
    out = BENCH_JSON
    run = shared_run(launch, BENCHMARK, BENCH, timeout=200)
    run.assert_ok()
    r = run.result
    assert r["example"] == "benchmark_lstm" and r["ranks"] == 2 and r["steps"] == 3, r
    (entry,) = r["results"]
    assert (entry["precision"], entry["compression"]) == ("mixed_float16", "fp16"), entry
    assert entry["samples_per_sec_total"] > 0 and len(entry["per_rank"]) == 2, entry
    assert all(x > 0 for x in entry["per_rank"]), entry
    with open(out) as f:
        assert json.load(f) == r
    assert "samples/s total" in run.output  # the table
