"""tf_mpi.predict: the cost formulas against hand-computed cases, limits and orderings the model
must respect, the probe inversion, and the command line on the ResNet-50 gradient list and on a
saved Keras model (no MPI: the model is arithmetic; benchmarks/scaling_check.py checks it against
measurements)."""
import json
import os
import struct
import subprocess
import sys

import pytest

from mpi_harness import with_rank_site
from tf_mpi import grouping, predict
from tf_mpi.predict import Cluster, Link, Workload

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESNET_JSON = os.path.join(REPO, "benchmarks", "data", "resnet50_grad_shapes.json")
MiB = 1 << 20

LINK = Link(alpha=1e-6, beta=1e-9)
SLOW = Link(alpha=10e-6, beta=1e-8)


def test_ring_allreduce_by_hand():
    # 2 (p-1) alpha + 2 (p-1)/p n beta = 6 us + 1.5 ms
    assert predict.ring_allreduce_time(1e6, 4, LINK) == pytest.approx(6e-6 + 1.5e-3)
    assert predict.ring_allreduce_time(1e6, 1, LINK) == 0.0


def test_recursive_doubling_by_hand():
    assert predict.recursive_doubling_allreduce_time(1000, 8, LINK) == pytest.approx(3 * (1e-6 + 1e-6))
    # 6 ranks: 2 exchanges among 4, plus the hand-over and hand-back of the 2 extra ranks
    assert predict.recursive_doubling_allreduce_time(1000, 6, LINK) == pytest.approx(4 * (1e-6 + 1e-6))
    assert predict.recursive_doubling_allreduce_time(1000, 2, LINK) == pytest.approx(1e-6 + 1e-6)


def test_allreduce_takes_recursive_doubling_for_small_and_ring_for_large():
    assert predict.allreduce_time(100, 8, LINK)[1] == "recursive doubling"
    t, algorithm = predict.allreduce_time(64 * MiB, 8, LINK)
    assert algorithm == "ring"
    assert t == pytest.approx(14e-6 + 2 * 7 / 8 * 64 * MiB * 1e-9)


def test_reduce_scatter_by_hand():
    assert predict.ring_reduce_scatter_time(8e6, 8, LINK) == pytest.approx(7e-6 + 7e-3)


def test_hierarchical_by_hand():
    cluster = Cluster(2, 4, intra=LINK, inter=SLOW, chunk_bytes=0)
    n = 4e6
    inside = 2 * (3 * 1e-6 + 3 / 4 * n * 1e-9)
    # 4 shards of n/4 cross the one NIC at once: beta x 4; between 2 nodes recursive doubling is one exchange
    across = 10e-6 + (n / 4) * (4 * 1e-8)
    assert predict.hierarchical_allreduce_time(n, cluster)[0] == pytest.approx(inside + across)
    four_nics = Cluster(2, 4, intra=LINK, inter=SLOW, nics_per_node=4, chunk_bytes=0)
    assert predict.hierarchical_allreduce_time(n, four_nics)[0] == pytest.approx(inside + 10e-6 + n / 4 * 1e-8)
    # single-level flat: the slowest link paces all 8 ranks
    single_level = Cluster(2, 4, intra=LINK, inter=SLOW, chunk_bytes=0, flat="single-level")
    assert predict.flat_allreduce_time(n, single_level)[0] == pytest.approx(predict.allreduce_time(n, 8, SLOW)[0])
    # node-aware flat (the default): reduce to one rank per node (scatter + ring: 2 x 4 MB x 3/4 beta beats
    # a 2-level tree's 2 x 4 MB beta), the whole buffer across between 2 nodes (one exchange), broadcast back
    rooted = 2 * (3 * 1e-6 + 3 / 4 * n * 1e-9)
    assert predict.rooted_time(n, 4, LINK) == pytest.approx(rooted)
    assert predict.rooted_time(100, 4, LINK) == pytest.approx(2 * (1e-6 + 100 * 1e-9))  # small: the tree
    assert predict.flat_allreduce_time(n, cluster)[0] == pytest.approx(2 * rooted + 10e-6 + n * 1e-8)
    # With one NIC per node both cross the network with the same bytes and exchanges: only the in-node parts differ
    assert predict.flat_allreduce_time(n, cluster)[0] - 2 * rooted == pytest.approx(
        predict.hierarchical_allreduce_time(n, cluster)[0] - inside)


@pytest.mark.parametrize("nodes", [2, 4, 16, 64])
@pytest.mark.parametrize("nbytes", [4096, 1 * MiB, 100 * MiB])
def test_hierarchical_beats_flat_when_the_network_dominates_and_equals_it_with_one_rank_per_node(nodes, nbytes):
    fast_inside = Link(1e-7, 1e-12)
    for chunk in (0, predict.DEFAULT_CHUNK_BYTES):
        for flat, nics in (("single-level", 1), ("node-aware", 8)):
            if flat == "node-aware" and nbytes < MiB:
                continue  # one card per rank pays off in bandwidth; small buffers are latency-bound
            multi = Cluster(nodes, 8, intra=fast_inside, inter=SLOW, chunk_bytes=chunk, flat=flat, nics_per_node=nics)
            hier = predict.group_time([nbytes], multi, hierarchical=True)
            assert hier < predict.group_time([nbytes], multi, hierarchical=False), (flat, nics)
            single = Cluster(nodes, 1, intra=fast_inside, inter=SLOW, chunk_bytes=chunk, flat=flat)
            assert predict.group_time([nbytes], single, True) == predict.group_time([nbytes], single, False)


def test_flat_algorithm_is_checked():
    with pytest.raises(ValueError, match="node-aware, single-level"):
        Cluster(2, 4, intra=LINK, inter=SLOW, flat="ring")


def test_one_node_hierarchical_is_flat():
    cluster = Cluster(1, 8, intra=LINK, inter=SLOW)
    assert predict.group_time([5 * MiB], cluster, True) == predict.group_time([5 * MiB], cluster, False)


def test_engine_messages_direct_fused_and_chunked():
    cluster = Cluster(1, 2, LINK, LINK)
    assert predict.engine_messages([3 * MiB, 1000, 1000], cluster) == [MiB, MiB, MiB, 2000]
    assert predict.engine_messages([MiB + 5], cluster) == [MiB, 5]
    unchunked = Cluster(1, 2, LINK, LINK, chunk_bytes=0)
    assert predict.engine_messages([3 * MiB, 1000], unchunked) == [3 * MiB, 1000]


def test_exposed_communication_by_hand():
    # full overlap: group 0 (ready 50 ms) ends at 70 ms, group 1 (ready 100 ms) runs 100-130 ms
    assert predict.exposed_communication([0.05, 0.1], [0.02, 0.03], 0.1, 1.0) == pytest.approx(0.03)
    # no overlap: everything is exposed
    assert predict.exposed_communication([0.05, 0.1], [0.02, 0.03], 0.1, 0.0) == pytest.approx(0.05)
    # half: 20 ms during backprop count half, 30 ms after it in full
    assert predict.exposed_communication([0.05, 0.1], [0.02, 0.03], 0.1, 0.5) == pytest.approx(0.04)
    # a queue: group 1 waits for group 0, which runs past the end of backprop
    assert predict.exposed_communication([0.05, 0.06], [0.04, 0.01], 0.08, 1.0) == pytest.approx(0.02)


def resnet(step_s=0.25, backprop_s=None):
    return Workload.from_json(RESNET_JSON, step_s=step_s, backprop_s=backprop_s)


def test_resnet_json_is_read_in_backprop_order():
    work = resnet()
    with open(RESNET_JSON) as f:
        spec = json.load(f)
    assert len(work.sizes) == spec["num_tensors"] and work.total_bytes == spec["bytes_float32"]
    assert work.sizes[-1] == 7 * 7 * 3 * 64 * 4  # the first convolution's kernel comes last in backprop


def test_efficiency_is_one_with_free_links():
    free = Link(0.0, 0.0)
    for nodes in (1, 2, 64):
        for hierarchical in (False, True):
            p = predict.predict_step(resnet(), Cluster(nodes, 8, free, free), hierarchical)
            assert p.efficiency == 1.0 and p.exposed_s == 0.0


def test_efficiency_falls_with_more_nodes_and_overlap_only_helps():
    nodes = [1, 2, 4, 8, 16, 64]
    for hierarchical in (False, True):
        rows = [r for r in predict.predict_scaling(resnet(), nodes, 8, predict.PRESETS["pcie3"],
                                                   predict.PRESETS["25gbe"]) if r.hierarchical == hierarchical]
        eff = [r.efficiency for r in rows]
        assert all(a >= b for a, b in zip(eff, eff[1:])), eff
        assert eff[-1] < 0.9  # a 25 GbE network is felt by ResNet-50 with no overlap
    cluster = Cluster(8, 8, predict.PRESETS["nvlink"], predict.PRESETS["ib100"])
    none = predict.predict_step(resnet(), cluster, True)
    some = predict.predict_step(resnet(backprop_s=0.16), cluster, True, overlap=0.5)
    full = predict.predict_step(resnet(backprop_s=0.16), cluster, True, overlap=1.0)
    assert none.exposed_s == pytest.approx(none.comm_s)
    assert full.exposed_s <= some.exposed_s <= none.exposed_s
    assert full.efficiency >= some.efficiency >= none.efficiency


def test_shared_cores_slow_compute_and_communication():
    work = Workload([4 * MiB], step_s=0.1)
    alone = predict.predict_step(work, Cluster(1, 2, LINK, LINK, cores_per_node=2), False)
    crowded = predict.predict_step(work, Cluster(1, 4, LINK, LINK, cores_per_node=2), False)
    assert alone.compute_s == pytest.approx(0.1) and crowded.compute_s == pytest.approx(0.2)
    unshared = predict.group_time([4 * MiB], Cluster(1, 4, LINK, LINK), False)
    assert crowded.comm_s == pytest.approx(2 * unshared)


def test_plan_comes_from_tf_mpi_grouping():
    work = resnet()
    no_overlap = grouping.CostModel(alpha=50e-6, beta=1e-9, overlap=0.0)
    plan = predict.grouping_plan(work, no_overlap)
    # overlap 0: only the 4 MiB byte bound cuts, groups are contiguous in backprop order
    assert [i for g in plan.groups for i in g.indices] == list(range(len(work.sizes)))
    assert all(g.nbytes == sum(work.sizes[i] for i in g.indices) for g in plan.groups)
    # the byte bound: a group over 4 MiB holds a tensor over 4 MiB (rule d)
    assert all(g.nbytes <= 4 * MiB or max(work.sizes[i] for i in g.indices) > 4 * MiB for g in plan.groups)
    early = predict.grouping_plan(work, grouping.CostModel(alpha=1e-6, beta=1e-9, overlap=1.0))
    assert len(early.groups) > len(plan.groups)
    assert len(predict.grouping_plan(work, no_overlap, "one").groups) == 1


@pytest.mark.parametrize("ranks, tolerance", [(2, 1e-9), (3, 0.25), (4, 0.25)])
def test_link_from_probe_inverts_the_probe(ranks, tolerance):
    # Exact with 2 ranks; with more, the probe's 4 KiB and 4 MiB fall on different algorithms.
    cluster = Cluster(1, ranks, LINK, LINK)
    # what measure_cost_model would fit to the model's own probe allreduces
    model = predict.plan_cost_model(cluster, hierarchical=False, overlap=0.0)
    link = predict.link_from_probe(model, ranks)
    if ranks == 2:
        assert (link.alpha, link.beta) == (pytest.approx(LINK.alpha), pytest.approx(LINK.beta))
    for nbytes in (4096, MiB, 16 * MiB):
        again = predict.group_time([nbytes], Cluster(1, ranks, link, link), False)
        assert again == pytest.approx(predict.group_time([nbytes], cluster, False), rel=tolerance)


def test_collective_cost_is_paid_once_per_grouped_allreduce():
    bare = Cluster(2, 2, LINK, SLOW)
    priced = Cluster(2, 2, LINK, SLOW, collective_s=100e-6)
    for tensors in ([4096], [20 * MiB, 3 * MiB, 1000]):  # one message; several chunks and a fused buffer
        for hierarchical in (False, True):
            assert predict.group_time(tensors, priced, hierarchical) == pytest.approx(
                predict.group_time(tensors, bare, hierarchical) + 100e-6)
    assert predict.group_time([4096], Cluster(1, 1, LINK, LINK, collective_s=1.0), False) == 0.0  # no peers
    with pytest.raises(ValueError):
        Cluster(2, 2, LINK, SLOW, collective_s=-1e-6)


def test_link_rates_are_recovered_from_both_paths_timings():
    """Times of both paths generated by the model with known rates give those rates back (within the
    grid's resolution), the alphas untouched: the paths' shared part fixes the network's rate, their
    difference the node's."""
    intra, inter = Link(2e-6, 1 / 3e9), Link(10e-6, 1 / 120e6)
    truth = Cluster(2, 2, intra, inter)
    sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, MiB, 4 * MiB]
    timed = {"bytes": sizes, "flat_s": [predict.group_time([b], truth, False) for b in sizes],
             "hierarchical_s": [predict.group_time([b], truth, True) for b in sizes]}
    start_intra, start_inter = Link(2e-6, 1 / 10e9), Link(10e-6, 1 / 1e9)  # e.g. the defaults and a probe
    got_intra, got_inter = predict.fit_link_rates(timed, 2, 2, start_intra, start_inter)
    assert (got_intra.alpha, got_inter.alpha) == (start_intra.alpha, start_inter.alpha)
    assert got_inter.beta == pytest.approx(inter.beta, rel=0.03)
    assert got_intra.beta == pytest.approx(intra.beta, rel=0.15)
    with pytest.raises(ValueError):
        predict.fit_link_rates({"bytes": [], "flat_s": [], "hierarchical_s": []}, 2, 2, intra, inter)


def test_calibrated_cluster_prices_the_engine_beyond_its_mpi_calls():
    intra, inter = Link(2e-6, 1 / 3e9), Link(10e-6, 1 / 120e6)
    cluster = predict.calibrated_cluster(2, 2, intra, inter, engine_s=150e-6, engine_bytes=8)
    mpi_part = predict.group_time([8], Cluster(2, 2, intra, inter), False)
    assert cluster.collective_s == pytest.approx(150e-6 - mpi_part) and cluster.inter == inter
    # A measurement below the model's own time for the MPI calls prices nothing, not a negative cost.
    assert predict.calibrated_cluster(2, 2, intra, inter, engine_s=1e-6).collective_s == 0.0


def test_parse_link_presets_and_values():
    assert predict.parse_link("ib100").beta == pytest.approx(8 / 100e9)
    assert predict.parse_link("2,12.5") == Link(2e-6, 1 / 12.5e9, "2,12.5 (given)")
    with pytest.raises(ValueError, match="ALPHA_US,GBYTES_PER_S"):
        predict.parse_link("infiniband")


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tf_mpi.predict", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO,
                          env=with_rank_site(dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")))


def png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_cli_on_resnet_json_prints_the_table_and_writes_the_plot(tmp_path):
    plot, out = tmp_path / "scaling.png", tmp_path / "scaling.json"
    done = run_cli(RESNET_JSON, "--step-ms", "250", "--backprop-ms", "160", "--intra", "nvlink", "--inter", "ib200",
                   "--nodes", "1", "2", "64", "--plot", str(plot), "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "214 gradients, 97.6 MiB" in done.stdout
    table = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["1"], ["2"], ["64"])]
    assert [(row[0], row[1], row[2], row[3]) for row in table] == [
        ("1", "8", "8", "flat"), ("1", "8", "8", "hierarchical"), ("2", "8", "16", "flat"),
        ("2", "8", "16", "hierarchical"), ("64", "8", "512", "flat"), ("64", "8", "512", "hierarchical")]
    assert all(0 < float(row[-1]) <= 1 for row in table)
    assert png_size(plot) == (1200, 700)
    rows = json.load(open(out))["rows"]
    assert len(rows) == 6 and rows[-1]["ranks"] == 512


def test_cli_rejects_bad_input():
    done = run_cli(RESNET_JSON, "--step-ms", "250", "--inter", "carrier-pigeon")
    assert done.returncode == 2 and "ALPHA_US,GBYTES_PER_S" in done.stderr
    done = run_cli(RESNET_JSON, "--step-ms", "100", "--backprop-ms", "200")
    assert done.returncode == 2 and "--backprop-ms" in done.stderr


def test_cli_on_a_saved_keras_model(tmp_path):
    import keras  # saved here; the command line loads it in a process of its own
    path = tmp_path / "tiny.keras"
    keras.Sequential([keras.Input((32,)), keras.layers.Dense(16), keras.layers.Dense(10)]).save(str(path))
    done = run_cli(str(path), "--step-ms", "5", "--intra", "pcie4", "--inter", "25gbe", "--nodes", "1", "4")
    assert done.returncode == 0, done.stderr
    # 32x16 + 16 + 16x10 + 10 float32
    assert f"4 gradients, 0.0 MiB ({(32 * 16 + 16 + 160 + 10) * 4} B)" in done.stdout
    assert sum(1 for line in done.stdout.splitlines() if line.split()[:2] in (["1", "8"], ["4", "8"])) == 4


def test_cli_on_a_gradient_list_needs_no_tensorflow(tmp_path):
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps([4 << 20, 1 << 20, 4096]))  # bytes, backprop order
    code = ("import sys\nfrom tf_mpi import predict\n"
            f"assert predict.main([{str(sizes)!r}, '--step-ms', '50', '--nodes', '1', '2']) == 0\n"
            "assert 'tensorflow' not in sys.modules, 'tf_mpi.predict imported tensorflow'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == 0, done.stderr
    assert "3 gradients, 5.0 MiB (5246976 B)" in done.stdout
