"""TF_MPI_HIERARCHICAL=auto across pretend hosts (tests/cluster.py): the engine's start-up probe of
the inter-node link, the start-up timing of both allreduce paths, and the decision they feed.

One launch of 2 hosts x 2 ranks (prefix "cal", addresses 10.231.9.0/24) of
tests/workers/hierarchical_auto_worker.py: init() without TF_MPI_INTER_NODE_LINK measures the
link and the alpha inside a node (rank 0 logs the figures once) and times the flat and the
hierarchical allreduce from 4 KiB up; every rank ends with the same figures, the same timings and
the window those timings give, allreduces of 1 KiB-4 MiB go hierarchical exactly where the window
says, on every rank, with right sums; with TF_MPI_INTER_NODE_LINK set there is neither probe nor
timing, and the window is the model's with the user's figures.
A second launch on the same layout has rank 3 stop responding inside that timing
(TF_MPI_FAULT_STALL_STARTUP_TIMING): the MPI watchdog, armed around the start-up measurements, must
end the job with its error within a bounded time.
Plus, without MPI, the probe's arithmetic (tf_mpi._core.link_from_ping_pong), how timings
become a window (tf_mpi._core.hierarchical_window_from_timings) and the model's flat allreduce
across real hosts (tf_mpi._core.hierarchical_model).

Needs root (network namespaces); skipped with the reason otherwise.
"""
import json
import os
import re
import sys
import tempfile

import pytest

import cluster
from mpi_harness import WORKERS, launch_env, run_bounded
from tf_mpi import predict
from tf_mpi.basics import _core

PREFIX, NET = "cal", 9
PROBE_LINE = re.compile(r"inter-node link measured at start-up: ([0-9.]+) us per message, ([0-9.e+-]+) GB/s "
                        r"per node .* in ([0-9]+) ms")


def test_link_from_ping_pong_arithmetic():
    # 2 ranks per node, each exchanging 128 KiB: beta is the extra time over all 256 KiB a node moves.
    alpha, beta = _core.link_from_ping_pong(20e-6, 8, 1e-3, 128 << 10, 2)
    assert alpha == pytest.approx(20e-6)
    assert beta == pytest.approx((1e-3 - 20e-6) / (2 * (128 << 10) - 16))
    # Noise made the large message no slower than the small one: beta from the large one alone.
    alpha, beta = _core.link_from_ping_pong(50e-6, 8, 40e-6, 1 << 17, 1)
    assert beta == pytest.approx(40e-6 / (1 << 17)) and beta > 0


def test_window_from_timings():
    K = 1 << 10
    sizes = [4 * K, 16 * K, 64 * K, 256 * K, 1024 * K, 4096 * K]
    window = _core.hierarchical_window_from_timings
    # Hierarchical faster from 64 KiB on: open-ended (larger sizes go as the largest timed).
    assert window(sizes, [1] * 6, [1.2, 1.1, 0.5, 0.6, 0.6, 0.5]) == (64 * K, None)
    # Faster from the smallest size up to 1 MiB only.
    assert window(sizes, [1] * 6, [0.5, 0.5, 0.5, 0.6, 1.3, 1.5]) == (0, 1024 * K)
    # One slower size amid faster ones is outvoted; at the edge of the run it ends the window.
    assert window(sizes, [1] * 6, [1.2, 1.1, 0.5, 0.6, 1.5, 0.5]) == (64 * K, None)
    assert window(sizes, [1] * 6, [1.2, 1.1, 0.5, 0.6, 1.5, 1.5]) == (64 * K, 1024 * K)
    # Within the 5 % margin it is a tie, and ties go to the flat allreduce: nowhere.
    assert window(sizes, [1] * 6, [0.97] * 6) == (0, 0)
    assert window(sizes, [1] * 6, [1.5] * 6) == (0, 0)
    with pytest.raises(ValueError):
        window(sizes, [1] * 6, [1] * 5)


def test_model_prices_flat_as_the_mpi_runs_it_across_real_hosts():
    """The model behind auto where nothing is timed (TF_MPI_INTER_NODE_LINK set, process sets,
    elastic mode): across real hosts MPI's own allreduce is node-aware (one stream of the whole
    buffer per node, as the hierarchical path's shards add up to), so on a slow link the two are a
    tie and the 5 % margin keeps the flat allreduce; a single-level flat (TF_MPI_TOPOLOGY's pretend
    nodes, which MPI sees as one host) pays the ring across the link and goes hierarchical."""
    gbit = dict(intra_alpha_s=1.7e-6, inter_alpha_s=11e-6, inter_beta_s=1 / 122e6)  # the 1 Gbit/s test bed's probe
    aware = _core.hierarchical_model(16 << 20, 2, 2, **gbit)
    single = _core.hierarchical_model(16 << 20, 2, 2, flat="single-level", **gbit)
    assert (aware["auto_min_bytes"], aware["auto_max_bytes"]) == (0, 0), aware
    assert single["auto_min_bytes"] <= 4096 and single["auto_max_bytes"] is None, single
    # Node-aware flat: the link's time for the buffer once, plus the in-node reduce and broadcast.
    assert aware["flat_s"] == pytest.approx(2 * 1.7e-6 + 2 * (16 << 20) / 10e9 + 11e-6 + (16 << 20) / 122e6, rel=1e-6)
    assert single["flat_s"] > 1.4 * aware["flat_s"] and single["hierarchical_s"] == aware["hierarchical_s"]
    # A fast link makes the in-node stages count: hierarchical from some size, with no upper end.
    fast = _core.hierarchical_model(1 << 20, 2, 2, intra_alpha_s=1.7e-6, inter_alpha_s=10e-6, inter_beta_s=1 / 1466e6)
    assert 0 < fast["auto_min_bytes"] <= 64 << 10 and fast["auto_max_bytes"] is None, fast
    with pytest.raises(ValueError, match="node-aware"):
        _core.hierarchical_model(1 << 20, 2, 2, flat="ring")


@pytest.mark.hosts
def test_probe_across_hosts_gives_every_rank_the_same_link_and_choice():
    reason = cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = tempfile.mkdtemp(prefix="tfmpi_hauto_")
    env = {"TF_MPI_TEST_OUT": out, "TF_CPP_MIN_LOG_LEVEL": "3"}
    with cluster.Cluster(hosts=2, slots=2, prefix=PREFIX, net=NET) as c:
        argv = [sys.executable, "-m", "tf_mpi.run", "-np", "4", "--host", c.host_list(), "-x", "TF_CPP_MIN_LOG_LEVEL",
                "--", sys.executable, os.path.join(WORKERS, "hierarchical_auto_worker.py")]
        launch = {k: v for k, v in launch_env(env).items() if k not in ("TF_MPI_TOPOLOGY", "TF_MPI_INTER_NODE_LINK")}
        rc, output, elapsed, timed_out = run_bounded(c.command(argv), 120, c.env(launch))
    assert rc == 0 and not timed_out, output[-3000:]
    ranks = {}
    for name in os.listdir(out):
        with open(os.path.join(out, name)) as f:
            r = json.load(f)
        ranks[r["rank"]] = r
    assert sorted(ranks) == [0, 1, 2, 3], output[-3000:]
    assert all(r["cross_size"] == 2 and r["local_size"] == 2 for r in ranks.values())

    # The probe ran once (in phase "probe", not "given"), logged by rank 0 only.
    logged = PROBE_LINE.findall(output)
    assert len(logged) == 1, output[-3000:]
    alpha_us, gb_per_s, probe_ms = (float(v) for v in logged[0])
    assert probe_ms < 500, f"the probe took {probe_ms} ms"

    probe = [ranks[i]["probe"]["hierarchical"] for i in range(4)]
    link = {(h["inter_alpha_s"], h["inter_beta_s"]) for h in probe}
    assert len(link) == 1, f"ranks got different inter-node links: {link}"
    alpha, beta = link.pop()
    # Sane for TCP between network namespaces: microseconds to a millisecond, 1 MB/s to 100 GB/s.
    assert 0.5e-6 < alpha < 5e-3 and 1e6 < 1 / beta < 100e9, (alpha, 1 / beta)
    assert alpha * 1e6 == pytest.approx(alpha_us, abs=0.06) and 1e-9 / beta == pytest.approx(gb_per_s, rel=0.01)
    assert all("measured at start-up" in h["summary"] and h["usable"] for h in probe), probe[0]["summary"]
    # Inside a node the probe measured the alpha (local ranks 0 and 1), the same on every rank and logged.
    intra = {(h["intra_alpha_s"], h["intra_beta_s"]) for h in probe}
    assert len(intra) == 1, f"ranks got different intra-node links: {intra}"
    intra_alpha, intra_beta = intra.pop()
    assert 0.05e-6 < intra_alpha < 50e-3 and intra_beta == pytest.approx(1 / 10e9), (intra_alpha, intra_beta)
    print(f"probe: inter {alpha * 1e6:.1f} us, {1e-9 / beta:.3g} GB/s; intra {intra_alpha * 1e6:.1f} us")
    inside = re.findall(r"inside a node ([0-9.]+) us per message", output)
    assert len(inside) == 1 and float(inside[0]) == pytest.approx(intra_alpha * 1e6, abs=0.06), output[-3000:]

    # Both paths were timed once, in phase "probe": every rank holds rank-identical figures (the
    # slowest rank's per call; only the timing's own wall time is each rank's) and the window they
    # give; rank 0 logged it.
    timed = [ranks[i]["probe"]["hierarchical"]["timed"] for i in range(4)]
    figures = [{k: v for k, v in t.items() if k != "seconds"} for t in timed]
    assert all(f == figures[0] for f in figures), timed
    t0 = timed[0]
    assert t0["bytes"][:3] == [4 << 10, 16 << 10, 64 << 10] and len(t0["bytes"]) >= 3, t0
    assert all(b * 4 == c for b, c in zip(t0["bytes"], t0["bytes"][1:])), t0
    assert all(v > 0 for v in t0["flat_s"] + t0["hierarchical_s"]) and 0 < t0["seconds"] < 5, t0
    print("timed (ms):", [(b >> 10, round(f * 1e3, 3), round(h * 1e3, 3))
                          for b, f, h in zip(t0["bytes"], t0["flat_s"], t0["hierarchical_s"])])
    assert "both paths timed at start-up" in probe[0]["summary"], probe[0]["summary"]
    assert output.count("both paths timed at start-up") == 1, output[-3000:]
    assert ranks[0]["given"]["hierarchical"]["timed"]["bytes"] == []

    for phase in ("probe", "given"):
        windows = {(ranks[i][phase]["hierarchical"]["min_bytes"], ranks[i][phase]["hierarchical"]["max_bytes"])
                   for i in range(4)}
        assert len(windows) == 1, f"{phase}: ranks chose different windows {windows}"
        lo, hi = windows.pop()
        h0 = ranks[0][phase]["hierarchical"]
        if phase == "probe":
            want = _core.hierarchical_window_from_timings(t0["bytes"], t0["flat_s"], t0["hierarchical_s"])
        else:
            model = _core.hierarchical_model(1.0, 2, 2, h0["intra_alpha_s"], h0["intra_beta_s"], h0["inter_alpha_s"],
                                             h0["inter_beta_s"])
            want = (model["auto_min_bytes"], model["auto_max_bytes"])
        assert (lo, hi) == want, (phase, lo, hi, want)
        for i in range(4):
            for row in ranks[i][phase]["rows"]:
                inside = lo <= row["bytes"] and (hi is None or row["bytes"] < hi)
                assert row["right"], (phase, i, row)
                assert row["hierarchical"] == (1 if inside else 0), (phase, i, row, lo, hi)

    # predict.measure_cluster(): the same calibration on every rank, the probe's latencies kept, the
    # rates those the start-up timings give (predict.fit_link_rates, checked here from the figures),
    # a cost per collective below the 8-byte allreduce's few milliseconds at most.
    calibrated = [ranks[i]["probe"]["calibrated"] for i in range(4)]
    assert all(c == calibrated[0] for c in calibrated), calibrated
    c0, h0 = calibrated[0], ranks[0]["probe"]["hierarchical"]
    assert (c0["nodes"], c0["ranks_per_node"]) == (2, 2)
    assert c0["inter_alpha_s"] == h0["inter_alpha_s"] and c0["intra_alpha_s"] == h0["intra_alpha_s"], (c0, h0)
    intra, inter = predict.fit_link_rates(t0, 2, 2, predict.Link(h0["intra_alpha_s"], h0["intra_beta_s"]),
                                          predict.Link(h0["inter_alpha_s"], h0["inter_beta_s"]))
    assert (c0["intra_beta_s"], c0["inter_beta_s"]) == pytest.approx((intra.beta, inter.beta)), (c0, intra, inter)
    assert 0 <= c0["collective_s"] < 0.05, c0
    print("calibrated:", c0)

    given = ranks[0]["given"]["hierarchical"]
    assert given["inter_alpha_s"] == pytest.approx(7e-6) and given["inter_beta_s"] == pytest.approx(1 / 3.5e9)
    assert "from TF_MPI_INTER_NODE_LINK" in given["summary"]


@pytest.mark.hosts
def test_a_rank_stuck_in_the_start_up_timing_ends_the_job_with_the_watchdogs_error():
    """A peer that stops responding while init() times both paths (a frozen host, a cut link): the
    others are inside MPI, where only the watchdog sees them; it covers the start-up measurements
    as it covers collectives, so the job ends with its error instead of waiting."""
    reason = cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    watchdog_s = 2
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_MPI_FAULT_STALL_STARTUP_TIMING": "3",
           "TF_MPI_MPI_TIMEOUT_SECONDS": str(watchdog_s), "TF_MPI_MPI_TIMEOUT_MB_PER_S": "1000"}
    program = "from tf_mpi.basics import _core; _core.init(); print('init returned on rank', _core.rank())"
    with cluster.Cluster(hosts=2, slots=2, prefix=PREFIX, net=NET) as c:
        argv = [sys.executable, "-m", "tf_mpi.run", "-np", "4", "--host", c.host_list(), "--",
                sys.executable, "-c", program]
        launch = {k: v for k, v in launch_env(env).items() if k not in ("TF_MPI_TOPOLOGY", "TF_MPI_INTER_NODE_LINK")}
        rc, output, elapsed, timed_out = run_bounded(c.command(argv), 90, c.env(launch))
    assert not timed_out, f"the job did not end within 90 s:\n{output[-3000:]}"
    assert rc != 0 and "init returned" not in output, output[-3000:]
    assert "start-up timing of the flat and hierarchical allreduce" in output and "inside MPI" in output, output[-3000:]
    # The watchdog's limit (2 s + 64 MiB at 1000 MB/s), one check period, the abort and the
    # launcher's exit after it, on top of start-up (processes, the probe).
    assert elapsed < 45, (elapsed, output[-3000:])
