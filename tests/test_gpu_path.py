"""What of the GPU path runs without a GPU (CI): the CUDA part's library, the
transport choice and its override, the error for a GPU array when no GPU is
usable, and the array collectives the GPU check uses. The GPU path itself is
checked by ci/gpu_check.sh on a machine with an NVIDIA GPU (docs/gpus.md):
no test here can run a CUDA kernel."""
import pytest

from mpi_harness import assert_check, check_names, params_of, selected_tests, shared_launch

WORKER = "gpu_path_worker.py"
# scenario -> (world sizes, environment)
SCENARIOS = {"default": ([2, 3], {}), "forced_direct": ([2], {"TF_MPI_CUDA_AWARE": "1"}),
             "bad_setting": ([2], {"TF_MPI_CUDA_AWARE": "maybe"})}


def launch(scenario, np, start=False):
    return shared_launch(np, WORKER, timeout=90, env=SCENARIOS[scenario][1], args=[scenario], start=start)


def prefetch(items):
    for np in params_of(items, "np"):
        launch("default", np, start=True)
    names = selected_tests(items)
    if "test_direct_transport_can_be_forced" in names:
        launch("forced_direct", 2, start=True)
    if "test_a_bad_cuda_aware_setting_is_refused" in names:
        launch("bad_setting", 2, start=True)


COMMON = [c for c in check_names(WORKER) if c != "check_a_bad_cuda_aware_setting_fails_init_with_its_name"]


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("check", COMMON)
def test_gpu_path_without_a_gpu(check, np):
    run = launch("default", np)
    assert run.returncode == 0, run.describe()
    assert_check(run, np, check)


@pytest.mark.parametrize("check", ["check_the_transport_follows_the_mpi_or_the_override",
                                   "check_a_gpu_array_without_a_usable_gpu_is_a_clear_error_and_the_engine_goes_on"])
def test_direct_transport_can_be_forced(check):
    run = launch("forced_direct", 2)
    assert run.returncode == 0, run.describe()
    assert_check(run, 2, check)


def test_a_bad_cuda_aware_setting_is_refused():
    run = launch("bad_setting", 2)
    assert_check(run, 2, "check_a_bad_cuda_aware_setting_fails_init_with_its_name")
