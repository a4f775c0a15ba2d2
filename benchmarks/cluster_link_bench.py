"""The link between two pretend hosts (tests/cluster.py) against what MPI and tf_mpi get out of it.

Run (as root, from the repository root; it brings up and tears down its own cluster)::

    python benchmarks/cluster_link_bench.py --rates unlimited,1gbit --rounds 3

Per link rate, each round launches (through ``python -m tf_mpi.run --host ...``):

- 1 rank per host: a plain TCP socket's 4 KiB round trip and one-way bandwidth (64 MiB
  stream, TCP_NODELAY) between the hosts, then MPI's 4 KiB Send/Recv round trip;
- 2 ranks per host (``--map-by node``, the idle ranks in a barrier): TCP and MPI round trips
  again (tests/workers/launch_worker.py ``pingpong``, the program tests/test_launch.py uses);
- 1 rank per host, then 2 ranks per host: a 16 MiB float32 Sum allreduce through tf_mpi's engine
  (``tf_mpi._core.allreduce``, no TensorFlow), flat and with ``TF_MPI_HIERARCHICAL=1``, in
  one launch (engine re-initialised between the two, their order alternating per round),
  5 timed calls each after a checked warm-up; a call's time is the slowest rank's (at 1 rank per
  host flat only: the hierarchical path is the same there). The same
  launch again with the settings a multi-host job had before tf_mpi tuned them for networks
  (``--mca btl_tcp_links 1``, ``TF_MPI_CHUNK_BYTES=1048576``: :data:`BEFORE`), the two
  launches' order alternating per round: the ``*_before`` figures.

It prints medians and spreads (min-max over rounds) and the ratios against the targets, and
writes everything to benchmarks/results/cluster_link_<rate>.json (``--out`` another folder).
Launches, statistics and the record (with the machine): benchmarks/harness.py.

Link model for the allreduce bound: S = 16 MiB per rank, B = the measured one-way TCP
bandwidth. Flat over 4 ranks, 2 per host, a ring's two cross-host edges each carry
2(n-1)/n * S = 1.5 S per direction (reduce-scatter + allgather), so bound = 1.5 S / B.
Hierarchical: only the 2 host leaders cross the link, a 2-rank allreduce: 2(h-1)/h * S = S per
direction, bound = S / B; the same for 1 rank per host. Target: time <= 1.5 x bound.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)
import harness  # noqa: E402
PINGPONG = os.path.join(ROOT, "tests", "workers", "launch_worker.py")
MiB = 1 << 20
BEFORE = {"mpirun_args": ["--mca", "btl_tcp_links", "1"], "env": {"TF_MPI_CHUNK_BYTES": str(1 * MiB)}}
"""A multi-host job's settings before tf_mpi.run's MULTI_HOST_MCA and the engine's network chunk size."""
ALLREDUCE_BYTES = 16 * MiB
STREAM_BYTES = 64 * MiB


# -- worker modes (run on the ranks) -------------------------------------------
def worker_tcp_bandwidth():
    """Rank 0 streams STREAM_BYTES to rank 1 (on the other host) over a plain socket."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.rank == 1:
        server = socket.create_server((socket.gethostbyname(socket.gethostname()), 0))
        comm.send(server.getsockname(), dest=0)
        conn, _ = server.accept()
        view, got = memoryview(bytearray(1 * MiB)), 0
        while got < STREAM_BYTES:
            got += conn.recv_into(view)
        conn.sendall(b"k")
    else:
        conn = socket.create_connection(comm.recv(source=1))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chunk = bytes(1 * MiB)
        t = time.perf_counter()
        for _ in range(STREAM_BYTES // len(chunk)):
            conn.sendall(chunk)
        conn.recv(1)
        harness.emit({"tcp_bytes_per_s": STREAM_BYTES / (time.perf_counter() - t)})
    conn.close()
    comm.Barrier()


def worker_allreduce(round_index, calls=5, modes=("0", "1")):
    """16 MiB allreduces through tf_mpi's engine, flat ("0") and hierarchical ("1") (order alternates by round)."""
    from tf_mpi import basics
    from tf_mpi.basics import _core
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    n_elems = ALLREDUCE_BYTES // 4
    times = {}
    for mode in (modes if round_index % 2 == 0 else modes[::-1]):
        os.environ["TF_MPI_HIERARCHICAL"] = mode
        basics.init()
        rank, size = _core.rank(), _core.size()
        data = np.full(n_elems, rank + 1, np.float32)
        got = _core.allreduce(data, int(basics.Sum), f"warm.{mode}")
        assert np.all(got == size * (size + 1) / 2), "allreduce result wrong"
        samples = []
        for i in range(calls):
            _core.allreduce(np.ones(1, np.float32), int(basics.Sum), f"sync.{mode}.{i}")
            t = time.perf_counter()
            _core.allreduce(data, int(basics.Sum), f"big.{mode}.{i}")
            samples.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
        times["hierarchical" if mode == "1" else "flat"] = statistics.median(samples)
        comm.Barrier()
        _core.shutdown()
    if comm.rank == 0:
        harness.emit(times)


# -- driver ---------------------------------------------------------------------
def launch(cluster, slots, program, timeout=300, mpirun_args=(), env=None):
    """Runs program on 2 hosts x slots ranks through tf_mpi.run; the parsed RESULT/LAUNCH lines of rank 0."""
    try:
        records = harness.launch(2 * slots, program, timeout=timeout, cluster=cluster, expect=None, env=env,
                                 mpirun_args=["--host", cluster.host_list(slots), "--map-by", "node",
                                              *mpirun_args],
                                 tags=(harness.RESULT_PREFIX, "LAUNCH "))
    except harness.LaunchError as e:
        raise RuntimeError(f"launch failed: {e}") from None
    found = {}
    for record in records:
        if record.get("rank", 0) == 0:
            found.update(record)
    return found


def one_round(cluster, index):
    me = os.path.abspath(__file__)
    r = {}
    one = launch(cluster, 1, [PINGPONG, "pingpong"])
    r["tcp_rtt_us_1x1"], r["mpi_rtt_us_1x1"] = one["tcp_us"], one["mpi_us"]
    r["tcp_bytes_per_s"] = launch(cluster, 1, [me, "--worker", "tcp_bandwidth"])["tcp_bytes_per_s"]
    two = launch(cluster, 2, [PINGPONG, "pingpong"])
    r["tcp_rtt_us_2x2"], r["mpi_rtt_us_2x2"] = two["tcp_us"], two["mpi_us"]
    for before in ((False, True) if index % 2 == 0 else (True, False)):
        suffix = "_before" if before else ""
        settings = BEFORE if before else {}
        ar = launch(cluster, 2, [me, "--worker", "allreduce", "--round", str(index)], **settings)
        r["allreduce_s_flat" + suffix], r["allreduce_s_hierarchical" + suffix] = ar["flat"], ar["hierarchical"]
        ar = launch(cluster, 1, [me, "--worker", "allreduce_flat", "--round", str(index)], **settings)
        r["allreduce_s_2x1" + suffix] = ar["flat"]
    return r


def summarize(rounds):
    keys = rounds[0].keys()
    stats = {k: harness.summarize(r[k] for r in rounds) for k in keys}
    med = {k: s["median"] for k, s in stats.items()}
    spread = {k: [s["min"], s["max"]] for k, s in stats.items()}
    bw = med["tcp_bytes_per_s"]
    bounds = {"flat": 1.5 * ALLREDUCE_BYTES / bw, "hierarchical": 1.0 * ALLREDUCE_BYTES / bw,
              "2x1": 1.0 * ALLREDUCE_BYTES / bw}
    ratios = {
        "mpi_over_tcp_rtt_1x1": med["mpi_rtt_us_1x1"] / med["tcp_rtt_us_1x1"],
        "mpi_over_tcp_rtt_2x2": med["mpi_rtt_us_2x2"] / med["tcp_rtt_us_2x2"],
        "allreduce_over_bound_flat": med["allreduce_s_flat"] / bounds["flat"],
        "allreduce_over_bound_hierarchical": med["allreduce_s_hierarchical"] / bounds["hierarchical"],
        "allreduce_over_bound_2x1": med["allreduce_s_2x1"] / bounds["2x1"],
        "allreduce_over_bound_2x1_before": med["allreduce_s_2x1_before"] / bounds["2x1"],
        "allreduce_over_bound_flat_before": med["allreduce_s_flat_before"] / bounds["flat"],
        "allreduce_over_bound_hierarchical_before": med["allreduce_s_hierarchical_before"] / bounds["hierarchical"],
    }
    targets = {"mpi_over_tcp_rtt_1x1": 3, "mpi_over_tcp_rtt_2x2": 10,
               "allreduce_over_bound_flat": 1.5, "allreduce_over_bound_hierarchical": 1.5}
    return {"median": med, "spread_min_max": spread, "link_bound_s": bounds, "ratios": ratios,
            "targets": targets, "met": {k: ratios[k] <= targets[k] for k in targets}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="unlimited,1gbit", help="comma-separated tc rates ('unlimited': none)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefix", default="lan")
    p.add_argument("--net", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--worker", choices=["tcp_bandwidth", "allreduce", "allreduce_flat"])
    p.add_argument("--round", type=int, default=0)
    a = p.parse_args()
    if a.worker == "tcp_bandwidth":
        return worker_tcp_bandwidth()
    if a.worker == "allreduce":
        return worker_allreduce(a.round)
    if a.worker == "allreduce_flat":
        return worker_allreduce(a.round, modes=("0",))
    from cluster import Cluster
    for rate in a.rates.split(","):
        limit = None if rate == "unlimited" else rate
        record = harness.Record(f"cluster_link_{rate}", path=os.path.join(a.out, f"cluster_link_{rate}.json"))
        with Cluster(hosts=2, slots=2, rate=limit, prefix=a.prefix, net=a.net) as c:
            rounds = []
            for i in range(a.rounds):
                rounds.append(one_round(c, i))
                print(f"[{rate}] round {i + 1}: " + json.dumps({k: round(v, 6) for k, v in rounds[-1].items()}),
                      flush=True)
        s = summarize(rounds)
        m, q = s["median"], s["ratios"]
        print(f"== link {rate}: TCP {m['tcp_bytes_per_s'] / 1e6:.0f} MB/s, TCP RTT {m['tcp_rtt_us_1x1']:.1f} us")
        print(f"   MPI 4 KiB RTT 1/host {m['mpi_rtt_us_1x1']:.1f} us ({q['mpi_over_tcp_rtt_1x1']:.2f}x TCP, target 3x); "
              f"2/host {m['mpi_rtt_us_2x2']:.1f} us ({q['mpi_over_tcp_rtt_2x2']:.2f}x TCP {m['tcp_rtt_us_2x2']:.1f} us, "
              f"target 10x)")
        print(f"   16 MiB allreduce 2x1: {m['allreduce_s_2x1']:.3f} s, link bound {s['link_bound_s']['2x1']:.3f} s "
              f"({q['allreduce_over_bound_2x1']:.2f}x); with the settings before: {m['allreduce_s_2x1_before']:.3f} s "
              f"({q['allreduce_over_bound_2x1_before']:.2f}x)")
        for mode in ("flat", "hierarchical"):
            print(f"   16 MiB allreduce 2x2 {mode}: {m['allreduce_s_' + mode]:.3f} s, link bound "
                  f"{s['link_bound_s'][mode]:.3f} s ({q['allreduce_over_bound_' + mode]:.2f}x, target 1.5x); "
                  f"with the settings before: {m['allreduce_s_' + mode + '_before']:.3f} s "
                  f"({q['allreduce_over_bound_' + mode + '_before']:.2f}x)")
        record.write(rate=rate, rounds=rounds, **s)


if __name__ == "__main__":
    main()
