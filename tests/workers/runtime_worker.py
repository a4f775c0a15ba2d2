"""Runtime behaviour under mpirun: init/shutdown, mpi4py coexistence, stalls
and aborts. The scenario is argv[1]; tests/test_runtime.py launches each one.
"""
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402

SCENARIO = sys.argv[1]

if SCENARIO == "mpi4py_first":
    from mpi4py import MPI  # initialises MPI before tf_mpi does
    import tensorflow as tf
    import tf_mpi as hvd
    WORLD_RANK = MPI.COMM_WORLD.Get_rank()
else:
    import tensorflow as tf
    import tf_mpi as hvd
    hvd.init()
    WORLD_RANK = hvd.rank()


def sum_of_ranks(name, n=None):
    n = hvd.size() if n is None else n
    y = hvd.allreduce(tf.constant([float(hvd.rank())]), op=hvd.Sum, name=name)
    assert float(y[0]) == sum(range(n)), (name, float(y[0]))


if SCENARIO == "mpi4py_first":
    def check_init_with_a_list_of_ranks():
        # World has 3 ranks; run on ranks 0 and 2 only. Rank 1 must get a clear error.
        try:
            hvd.init(comm=[0, 2])
        except ValueError as e:
            assert WORLD_RANK == 1 and "not in the ranks" in str(e), str(e)
            return
        assert WORLD_RANK in (0, 2) and hvd.size() == 2 and hvd.rank() == WORLD_RANK // 2
        sum_of_ranks("sub.list")
        hvd.shutdown()

    def check_init_with_an_mpi4py_communicator():
        # A split in reverse rank order: tf_mpi's rank follows the communicator.
        comm = MPI.COMM_WORLD.Split(color=0, key=-WORLD_RANK)
        hvd.init(comm=comm)
        assert hvd.size() == comm.Get_size() and hvd.rank() == comm.Get_size() - 1 - WORLD_RANK
        sum_of_ranks("sub.mpi4py")
        # mpi4py keeps working beside the engine.
        assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.Get_size()
        assert comm.allreduce(hvd.rank()) == sum(range(hvd.size()))

elif SCENARIO == "tf_mpi_first":
    def check_mpi4py_after_tf_mpi():
        from mpi4py import MPI
        assert MPI.Is_initialized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        assert MPI.COMM_WORLD.allreduce(hvd.rank()) == sum(range(hvd.size()))
        sum_of_ranks("after.mpi4py")

    def check_shutdown_and_init_again():
        hvd.shutdown()
        try:
            assert not hvd.is_initialized()
            try:
                hvd.allreduce(tf.constant([1.0]), name="while.down")
                raise AssertionError("no error after shutdown")
            except tf.errors.FailedPreconditionError as e:
                assert "not been initialized" in e.message
        finally:  # every rank starts again, also where an assertion failed: no rank waits alone in init
            hvd.init()
        sum_of_ranks("after.reinit")

    def check_one_rank_shutting_down_fails_the_others_promptly():
        try:
            if hvd.rank() == 1:
                hvd.shutdown()
            else:
                start = time.time()
                try:
                    hvd.allreduce(tf.constant([1.0]), name="needs.rank1")
                    raise AssertionError("no error although rank 1 shut down")
                except tf.errors.AbortedError as e:
                    assert "rank 1 called shutdown()" in e.message, e.message
                assert time.time() - start < 20
        finally:  # every rank starts again, also where an assertion failed: no rank waits alone in init
            if hvd.is_initialized():
                hvd.shutdown()
            hvd.init()
        sum_of_ranks("after.partial.shutdown")

elif SCENARIO == "stall":
    # Run with TF_MPI_STALL_CHECK_TIME_SECONDS=1 TF_MPI_STALL_SHUTDOWN_TIME_SECONDS=4.
    def check_stalled_collective_fails_instead_of_hanging():
        if hvd.rank() == 0:
            start = time.time()
            try:
                hvd.allreduce(tf.constant([1.0]), name="only.rank0.submits.this")
                raise AssertionError("a stalled collective returned")
            except tf.errors.AbortedError as e:
                assert "stalled" in e.message and "never submitted by rank 1" in e.message, e.message
            assert time.time() - start < 30
        else:
            time.sleep(6)
        sum_of_ranks("after.stall")

elif SCENARIO == "autotune":
    # Run with TF_MPI_AUTOTUNE=1 TF_MPI_AUTOTUNE_STEPS=1: the tuner switches
    # settings every couple of steps while collectives keep flowing.
    import numpy as np
    from tf_mpi import _core
    from tf_mpi.functions import allgather_object

    def check_autotune_changes_settings_identically_and_results_stay_exact():
        # A "step": a gradient-like group (a big tensor that may skip the fusion
        # buffer, small ones that are fused) and one lone tensor, every value checked.
        shapes = [(300, 300), (7,), (5, 3), (1000,)]
        n = hvd.size()
        start = _core.config()
        seen = {start}
        for step in range(80):
            xs = [tf.fill(s, float(hvd.rank() + 1 + step)) for s in shapes[:3]]
            ys = hvd.grouped_allreduce(xs, op=hvd.Sum, name="tune.group")
            z = hvd.allreduce(tf.fill(shapes[3], float(hvd.rank())), op=hvd.Average, name="tune.lone")
            want = sum(r + 1 + step for r in range(n))
            for y, s in zip(ys, shapes):
                assert y.shape == s and np.all(y.numpy() == want), (step, s)
            assert np.all(z.numpy() == sum(range(n)) / n), step
            seen.add(_core.config())
        # Rank 0 chose the settings and every rank applied the same ones.
        final = allgather_object(_core.config())
        assert len(set(final)) == 1, final
        assert len(seen) > 1, "the tuner never changed a setting"
        if hvd.rank() == 0:
            print("autotune settings:", final[0], flush=True)


elif SCENARIO == "merge":
    # Run with TF_MPI_AUTOTUNE=plan TF_MPI_AUTOTUNE_STEPS=2: rank 0 tries
    # holding some of a step's allreduces back to send them with later ones.
    import numpy as np
    from tf_mpi import _core
    from tf_mpi.functions import allgather_object

    @tf.function
    def merge_step(step):
        # Three independent gradient-like groups, all in flight together: a
        # held one never keeps another from being submitted.
        base = tf.cast(step, tf.float32) + float(hvd.rank() + 1)
        groups = [[tf.fill((64, 33), base), tf.fill((5,), 2 * base)], [tf.fill((300, 41), 3 * base)],
                  [tf.fill((7, 7), 4 * base), tf.fill((2,), 5 * base)]]
        return [hvd.grouped_allreduce(g, op=hvd.Sum, name=f"merge.group{k}") for k, g in enumerate(groups)]

    def check_held_back_allreduces_stay_exact_and_the_tuner_chooses_a_plan():
        n = hvd.size()
        for step in range(60):
            out = merge_step(tf.constant(step))
            want = sum(step + r + 1 for r in range(n))
            factors = [[1, 2], [3], [4, 5]]
            for group, fs in zip(out, factors):
                for y, f in zip(group, fs):
                    assert np.all(y.numpy() == f * want), (step, f, y.numpy().ravel()[:3])
        if hvd.rank() == 0:
            # The merge candidates really held allreduces back (each one of
            # them holds at least one allreduce per timed step).
            assert _core.stats()["held_back"] > 0, _core.stats()
        assert len(set(allgather_object(_core.config()))) == 1

if __name__ == "__main__":
    if SCENARIO == "abort":
        if hvd.rank() == 1:
            time.sleep(1)
            raise RuntimeError("boom on rank 1")
        hvd.allreduce(tf.constant([1.0]), name="rank1.never.comes")
        time.sleep(120)  # must never get here; the job is aborted first
    else:
        run_checks(globals(), WORLD_RANK)
