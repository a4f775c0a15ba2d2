"""The shared-memory allreduce (TF_MPI_SHM) under real mpirun: every dtype and
op, direct and fused (a bucket's tensors reduced where they lie: mixed sizes,
empty tensors, pieces across steps and blocks, per-request scales, a bucket
over 4 MiB), sizes around a pipeline step and the switch-over size,
np=2 and np=3, slots written through the cache or streamed to memory,
prescale/postscale, integer wrap-around, the response cache,
join, TensorFlow ops and the timeline, all compared with the MPI path in the
same process and with numpy; TF_MPI_SHM=0 keeps it off; and a rank that exits
in the middle of a stream of shared-memory allreduces ends the job."""
import pytest

from mpi_harness import assert_check, check_names, joint_launch, param, shared_launch

WORKER = "shm_worker.py"
# A 4 KiB pipeline chunk makes small arrays take many steps; arrays of 1 KiB
# and more skip the fusion buffer; allreduces below 1000 bytes keep the MPI path.
SMALL_STEPS = {"TF_MPI_SHM_CHUNK_BYTES": "4096", "TF_MPI_SHM_MIN_BYTES": "1000", "TF_MPI_FUSION_DIRECT_BYTES": "1024",
               "TF_MPI_STALL_CHECK_TIME_SECONDS": "20", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "60"}
# The MPI-progress check needs the default pipeline and fusion settings (its own section), and the
# peer liveness check off: its heartbeats call into MPI every second and would free a stall.
PROGRESS = "check_stream_of_gradient_storms_keeps_mpi_progressing"
LAUNCHES = {
    "np2": (2, {"TF_MPI_SHM": "1", "TF_MPI_TEST_EXCEPT": PROGRESS, **SMALL_STEPS}),
    "np3": (3, {"TF_MPI_SHM": "1", "TF_MPI_TEST_EXCEPT": PROGRESS, **SMALL_STEPS}),
    "progress": (2, {"TF_MPI_SHM": "1", "TF_MPI_TEST_ONLY": PROGRESS, "TF_MPI_STALL_CHECK_TIME_SECONDS": "5",
                     "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "20", "TF_MPI_PEER_TIMEOUT_SECONDS": "0"}),
    "off": (2, {"TF_MPI_SHM": "0", "TF_MPI_TEST_ONLY": "check_path_taken_matches_setting,"
                "check_stream_with_response_cache,check_tensorflow_ops_fused_and_timeline"}),
}
# Each way of writing the slots, fixed (auto measures and uses both), is checked in the np2 and np3
# launches: check_large_bucket_with_slots_{streamed,cached} restart the engine with the setting.
OFF_CHECKS = LAUNCHES["off"][1]["TF_MPI_TEST_ONLY"].split(",")
DIE = (2, {"SHM_SCENARIO": "die", "TF_MPI_SHM": "1"})


# The launches that end cleanly are sections, each with its own settings, of launches that other
# modules' workers join (mpi_harness.joint_launch): np=3 of the np=3 launch, the np=2 ones of the
# second np=2 launch.
EXPECTED_S = {"np2": 15, "progress": 10, "off": 1, "np3": 15}  # on a busy 2-core machine
JOINT = {key: joint_launch("np2b" if LAUNCHES[key][0] == 2 else "np3", LAUNCHES[key][0], f"shm.{key}", WORKER,
                           env=LAUNCHES[key][1], timeout=240, expected_s=EXPECTED_S[key]) for key in EXPECTED_S}


def launch(key, start=False):
    if key in JOINT:
        return JOINT[key](start=start)
    np, env = DIE if key == "die" else LAUNCHES[key]
    # "die": a rank exits 1.5 s in and the survivor waits to be ended: in the lane of waiting launches.
    return shared_launch(np, WORKER, timeout=120 if key == "die" else 240, env=env, start=start,
                         waiting=key == "die")


# The launch of each test that is not parametrized by it.
KEY_OF_TEST = {"test_waiting_on_shared_memory_keeps_mpi_progressing": "progress",
               "test_shm_off_keeps_the_mpi_path": "off", "test_rank_exiting_mid_stream_ends_the_job": "die"}


def prefetch(items):
    for key in dict.fromkeys(param(item, "key", KEY_OF_TEST.get(item.originalname)) for item in items):
        if key is not None:
            launch(key, start=True)


@pytest.mark.parametrize("key", ["np2", "np3"])
@pytest.mark.parametrize("check", [c for c in check_names(WORKER) if c != PROGRESS])
def test_shm(key, check):
    assert_check(launch(key), LAUNCHES[key][0], check)


def test_waiting_on_shared_memory_keeps_mpi_progressing():
    assert_check(launch("progress"), 2, PROGRESS)


@pytest.mark.parametrize("check", OFF_CHECKS)
def test_shm_off_keeps_the_mpi_path(check):
    assert_check(launch("off"), 2, check)


def test_rank_exiting_mid_stream_ends_the_job():
    # Rank 1 exits (os._exit) 1.5 s into a stream of 4 MiB shared-memory
    # allreduces: no rank may be left waiting on its flags.
    run = launch("die")
    assert not run.timed_out, run.describe()
    assert run.returncode != 0 and run.elapsed < 90, run.describe()
    # The survivor normally sees the peer's death first (an error naming it);
    # the launcher may also end it before that: both end the job.
    for line in run.output.splitlines():
        if "SURVIVOR ERROR" in line:
            assert "exited while this rank waited for it" in line or "gave up" in line, run.describe()
