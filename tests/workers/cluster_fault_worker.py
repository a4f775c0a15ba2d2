"""Allreduces in a loop until the job is ended from outside (tests/test_cluster_faults.py).

One rank per pretend host; numpy only (no TensorFlow import, so a launch
starts in about a second). Every rank writes "<pid> <hostname>" to
$TF_MPI_TEST_OUT/pid.<rank> after init and the time to going.<rank> after 200
correct collectives; then it keeps going until a host is killed or cut off.
Each result is checked, so the loop cannot run on wrong numbers unnoticed.
TF_MPI_TEST_ELEMENTS sets the float32 elements per allreduce (default 1024);
tests/test_faults.py also runs it on one host with a large one and a tiny
watchdog limit. With TF_MPI_TEST_QUIET_RANK=r, rank r stops submitting after
going.<r> (it writes quiet.<r> and sleeps; its engine runs on), so the other
ranks wait in negotiation for its next announcement, inside no MPI call.
"""
import os
import socket
import sys
import time

import numpy as np

from tf_mpi import basics
from tf_mpi.basics import _core

OUT = os.environ["TF_MPI_TEST_OUT"]

basics.init()  # as a user's script: an uncaught error (a stalled collective) aborts the job
rank, size = _core.rank(), _core.size()
with open(os.path.join(OUT, f"pid.{rank}"), "w") as f:
    f.write(f"{os.getpid()} {socket.gethostname()}")
if rank == 0:
    print(f"cluster_fault_worker: tf_mpi from {os.path.dirname(basics.__file__)}", flush=True)
quiet = int(os.environ.get("TF_MPI_TEST_QUIET_RANK", "-1"))
x = np.full(int(os.environ.get("TF_MPI_TEST_ELEMENTS", "1024")), rank + 1, np.float32)
expected = size * (size + 1) / 2
i = 0
while True:
    y = _core.allreduce(x, 1, "loop")  # op 1: Sum
    if not np.all(y == expected):
        sys.exit(f"rank {rank}: allreduce {i} gave {y[:4]}, expected {expected}")
    i += 1
    if i == 200:
        with open(os.path.join(OUT, f"going.{rank}"), "w") as f:
            f.write(repr(time.time()))
        if rank == quiet:
            with open(os.path.join(OUT, f"quiet.{rank}"), "w") as f:
                f.write(repr(time.time()))
            time.sleep(3600)  # ended from outside
