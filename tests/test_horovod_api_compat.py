"""Horovod 0.28.1's API, area by area, each checked by one worker against
Horovod's source (signatures transcribed from it, expected numbers from its
formulas, numpy or mpi4py):

- api_compat_worker.py: join as an int32 op that waits each time it runs
  (eager, tf.function, TF1 Session); the signatures of horovod.tensorflow and
  calls in Horovod's positional order; int32 alltoall received splits; the
  root's own object from broadcast_object; the `session` argument; gradients of
  Min / Max / Product allreduces; process-set parameters and ops; is_homogeneous, gloo_enabled, nccl_built, check_num_rank_power_of_2,
  handle_average_backwards_compatibility; the timeline's ValueError before init().
- optimizer_compat_worker.py: iterations with backward_passes_per_step, the
  Keras module's collectives, the positional order of both DistributedOptimizers,
  the tapes, gradient() and load_model, the groups / num_groups rules, any op
  through the tape, and a tape's gradients reduced once by a DistributedOptimizer.
- keras_callbacks_compat_worker.py: LearningRateScheduleCallback's number
  multiplier (exponential decay), steps_per_epoch taken from fit, the rate logged
  as 'lr' and 'learning_rate', BroadcastGlobalVariablesCallback's local
  variables, device and variables created by the first step, BestModelCheckpoint.
- elastic_keras_compat_worker.py: commits, state.epoch, state.batch and
  params['steps'] during fit and across an elastic restart.
- adasum_worker.py: op=hvd.Adasum (allreduce, grouped, scale factors, fp16,
  gradient, the tape) against a numpy reference of Horovod's recursion at
  np=2 and 4; the refusals (np=3: not a power of two; IndexedSlices; integers).
- process_sets_worker.py: static and dynamic process sets at np=2 and 4 (even/odd
  sets, a set of one rank, overlapping and disjoint sets), every collective and
  gradient within a set against mpi4py-gathered inputs, Horovod's errors.

Each worker is a section of the launch of its world size that other modules' workers join too
(mpi_harness.joint_launch, tests/workers/_sections.py: each worker as if launched alone, with the
engine shut down between them); each worker's checks keep their own results.
"""
import pytest

from mpi_harness import BOUNDED_STALL_ENV, assert_check, check_names, checks_at, joint_launch, left_out_env

# worker -> world sizes
WORKERS = {
    "optimizer_compat_worker.py": [2],
    "keras_callbacks_compat_worker.py": [2],
    "elastic_keras_compat_worker.py": [2],
    "adasum_worker.py": [2, 3, 4],
    "process_sets_worker.py": [2, 4],
    "api_compat_worker.py": [2, 3],
}
SIZES = sorted({np for sizes in WORKERS.values() for np in sizes})


CASES = [(worker, np) for worker, sizes in WORKERS.items() for np in sizes]
# worker -> {check: the world sizes it runs at} where not all: Adasum needs a power-of-two world,
# so np=3 checks Horovod's refusal only.
ONLY_AT = {"adasum_worker.py": {check: (2, 4) for check in check_names("adasum_worker.py")
                                if check != "check_refusals_as_horovod"}}
LAUNCHES = {(worker, np): joint_launch(f"np{np}", np, worker, worker,
                                       env={**BOUNDED_STALL_ENV, **left_out_env(worker, np, ONLY_AT.get(worker))})
            for worker, np in CASES}


def prefetch(items):
    for case in dict.fromkeys((item.callspec.params["worker"], item.callspec.params["np"]) for item in items):
        LAUNCHES[case](start=True)


@pytest.mark.parametrize("worker,np", CASES)
def test_launch_exits_cleanly(worker, np):
    LAUNCHES[worker, np]().assert_clean_exit()


@pytest.mark.parametrize("worker,np,check", [(worker, np, check) for worker, np in CASES
                                             for check in checks_at(worker, np, ONLY_AT.get(worker))])
def test_horovod_api_compat(worker, np, check):
    assert_check(LAUNCHES[worker, np](), np, check)
