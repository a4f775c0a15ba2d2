"""Predicts what data-parallel training with tf_mpi costs on a cluster: communication per
step, the part of it that backprop does not hide, and scaling efficiency, for N nodes x G
ranks per node, with the flat and the hierarchical allreduce.

Run::

    python -m tf_mpi.predict benchmarks/data/resnet50_grad_shapes.json --step-ms 250 \\
        --backprop-ms 160 --intra nvlink --inter ib100 --ranks-per-node 8 --plot scaling.png
    python -m tf_mpi.predict model.keras --step-ms 120            # a saved Keras model
    mpirun -np 2 python -m tf_mpi.predict model.keras --step-ms 120 --measure   # links from the probe
    mpirun -np 4 -H host1:2,host2:2 python -m tf_mpi.predict model.keras --step-ms 120 --measure
        # across nodes: calibrated on the job (measure_cluster; prints its TF_MPI_INTER_NODE_LINK)

or from Python::

    from tf_mpi import predict
    work = predict.Workload.from_json("benchmarks/data/resnet50_grad_shapes.json", step_s=0.25)
    cluster = predict.Cluster(nodes=2, ranks_per_node=8, intra=predict.PRESETS["nvlink"],
                              inter=predict.PRESETS["ib100"])
    print(predict.predict_step(work, cluster, hierarchical=True).efficiency)

The model (docs/scaling.md says the same, with the numbers of the presets):

* **A link** costs ``alpha + beta * bytes`` per message (Hockney's alpha-beta model);
  the cost of reducing the bytes is folded into ``beta``.
* **One allreduce of n bytes over p ranks on one kind of link** takes the cheaper of
  the ring, ``2 (p-1) alpha + 2 (p-1)/p n beta``, and recursive doubling,
  ``s (alpha + n beta)`` with ``s = log2 q + 2 [p != q]``, q the largest power of two
  <= p (Thakur, Rabenseifner and Gropp, "Optimization of collective communication
  operations in MPICH", 2005). Reduce-scatter and allgather (ring) each take
  ``(p-1) alpha + (p-1)/p n beta``.
* **Flat** allreduce over all N x G ranks, one MPI_Allreduce: what the MPI library does
  with it across nodes (``Cluster.flat``).
  ``"node-aware"`` (the default; what Open MPI 5, whose ``coll/han`` takes over allreduces
  across nodes, and MPICH, with its SMP-aware collectives, do): a reduce to one rank per
  node, an allreduce of the whole n among those N ranks over the inter-node link (one
  stream per node), a broadcast inside the node. A reduce or broadcast of n bytes over g
  ranks takes the cheaper of a binomial tree, ``ceil(log2 g) (alpha + n beta)``, and
  scatter + ring (``2 x`` the ring reduce-scatter below). Measured across pretend hosts
  (docs/scaling.md): Open MPI 5 sends one buffer's worth across per direction at 2 x 2,
  as this says.
  ``"single-level"`` (an MPI whose algorithm ignores nodes): the formula above over all
  N x G ranks with the slower link (inter-node when N > 1): every ring step waits for the
  transfers that cross nodes.
* **Hierarchical** (2D): reduce-scatter inside the node (intra link, G ranks), an
  allreduce of each n/G shard across the N nodes (the G shards concurrently, sharing
  ``nics_per_node`` network cards, so the inter-node beta is multiplied by
  ``max(1, G / nics_per_node)``), allgather inside the node. With G = 1 it is the flat
  allreduce across nodes; with N = 1 the flat one inside the node.
* **tf_mpi's engine**: every MPI call moves at most ``chunk_bytes`` (TF_MPI_CHUNK_BYTES,
  default 1 MiB on one node, 16 MiB across nodes); a larger message is that many allreduces in a row, each paying its
  latency. Within one grouped allreduce, tensors of at least ``direct_bytes``
  (TF_MPI_FUSION_DIRECT_BYTES) are reduced from their own buffers, the rest fused into
  one buffer.
* **Which gradients go together**: the grouping plan tf_mpi would choose
  (``tf_mpi.grouping.make_plan``, fed with the allreduce alpha and beta this model
  predicts for the cluster), or one group.
* **Overlap**: backprop takes ``backprop_s`` and produces the gradients in backprop order,
  at a rate proportional to their bytes; a group can start when its last gradient exists,
  groups are sent one after another. Of the communication that runs while backprop still
  computes, the share ``overlap`` (1 on GPUs; the probe tf_mpi.policy.overlap_probe measures it
  on CPUs) is hidden; what runs after backprop is exposed. Without ``backprop_s``
  nothing overlaps (all communication is exposed): a lower bound on efficiency.
* **Step** = single-rank step x ``core_share`` + exposed communication; efficiency =
  single-rank step / step (throughput per rank against one rank alone, the same batch per
  rank). ``core_share`` is ``G / cores_per_node`` where more ranks than cores share a
  node's cores (CPU training; then communication, CPU work too, is slowed by the same
  factor), else 1.

* **The engine's own cost per collective** (``Cluster.collective_s``: the negotiation with
  rank 0, hand-offs between threads) is added once per grouped allreduce; 0 unless measured.
* **Calibration** (``--measure`` across hosts, ``measure_cluster``): the links tf_mpi probed
  at start-up, their rates fitted to the start-up timings of both allreduce paths
  (``fit_link_rates``), and the cost per collective from an 8-byte allreduce.

Left out: network contention and congestion (many flows on one switch or rate limiter),
stragglers and step-time variance (a synchronous step waits for the slowest rank),
interference of communication with computation beyond the one ``overlap`` share, NCCL's
algorithms (tree, pipelining of chunks), and the time to load a batch.
"""
import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field, replace

import numpy as np

from tf_mpi.policy import grouping

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# The engine's defaults (cpp/core/common/env.cc; docs/configuration.md).
DEFAULT_CHUNK_BYTES = 1 << 20            # all ranks on one host
NETWORK_CHUNK_BYTES = 16 << 20           # ranks on several hosts (cpp/core/common/tunables.h)
DEFAULT_DIRECT_BYTES = 256 << 10
# The probe message sizes of tf_mpi.grouping.measure_cost_model.
PROBE_SMALL_BYTES, PROBE_LARGE_BYTES = 4 << 10, 4 << 20


@dataclass(frozen=True)
class Link:
    """One kind of link: a message of n bytes takes ``alpha + beta * n`` seconds.

    Example::

        ib = Link.from_bandwidth(alpha_us=2.0, gbit_per_s=100)   # 100 Gb/s InfiniBand
        ib.time(1 << 20)                                           # ~86 us
    """
    alpha: float
    beta: float
    description: str = ""

    @classmethod
    def from_bandwidth(cls, alpha_us, gbit_per_s=None, gbyte_per_s=None, description=""):
        """A link from its latency (microseconds) and bandwidth (gigabits or gigabytes per second)."""
        if (gbit_per_s is None) == (gbyte_per_s is None):
            raise ValueError("give exactly one of gbit_per_s and gbyte_per_s")
        bytes_per_s = gbit_per_s * 1e9 / 8 if gbit_per_s is not None else gbyte_per_s * 1e9
        if alpha_us < 0 or bytes_per_s <= 0:
            raise ValueError(f"a link needs alpha >= 0 and a positive bandwidth, got {alpha_us} us, {bytes_per_s} B/s")
        return cls(alpha_us * 1e-6, 1.0 / bytes_per_s, description)

    def time(self, nbytes):
        """Seconds one message of `nbytes` takes."""
        return self.alpha + self.beta * nbytes

    def scaled(self, factor):
        """This link with alpha and beta multiplied by `factor` (e.g. ranks sharing cores)."""
        return replace(self, alpha=self.alpha * factor, beta=self.beta * factor)

    def __str__(self):
        bandwidth = 1.0 / self.beta / 1e9 if self.beta > 0 else float("inf")
        return (f"alpha {self.alpha * 1e6:.2f} us, {bandwidth:.2f} GB/s"
                + (f" ({self.description})" if self.description else ""))


# Nominal per-direction bandwidths from the vendors' and standards' specifications; the
# latencies are typical small-message MPI/NCCL figures, to be replaced by measured ones.
# Real transfers reach ~80-95 % of the nominal bandwidth, so predictions with these
# presets are that much optimistic. docs/scaling.md lists them with their sources.
PRESETS = {
    "nvlink": Link.from_bandwidth(2.0, gbyte_per_s=300,
                                  description="NVLink 3 / NVSwitch (A100): 600 GB/s total = 300 GB/s per direction"),
    "nvlink4": Link.from_bandwidth(2.0, gbyte_per_s=450,
                                   description="NVLink 4 / NVSwitch (H100): 900 GB/s total = 450 GB/s per direction"),
    "pcie3": Link.from_bandwidth(5.0, gbyte_per_s=15.75, description="PCIe 3.0 x16: 15.75 GB/s per direction"),
    "pcie4": Link.from_bandwidth(5.0, gbyte_per_s=31.5, description="PCIe 4.0 x16: 31.5 GB/s per direction"),
    "ib100": Link.from_bandwidth(2.0, gbit_per_s=100, description="InfiniBand EDR, 100 Gb/s"),
    "ib200": Link.from_bandwidth(1.5, gbit_per_s=200, description="InfiniBand HDR, 200 Gb/s"),
    "ib400": Link.from_bandwidth(1.5, gbit_per_s=400, description="InfiniBand NDR, 400 Gb/s"),
    "25gbe": Link.from_bandwidth(25.0, gbit_per_s=25, description="25 Gb Ethernet, TCP"),
    "100gbe": Link.from_bandwidth(10.0, gbit_per_s=100, description="100 Gb Ethernet, TCP"),
}


def parse_link(text):
    """A Link from a preset name (``PRESETS``) or ``ALPHA_US,GBYTES_PER_S`` (e.g. ``2,12.5``).

    Example: ``parse_link("ib100")``, ``parse_link("1.5,25")``
    """
    if text in PRESETS:
        return PRESETS[text]
    try:
        alpha_us, gbyte_per_s = (float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"link {text!r}: expected one of {', '.join(PRESETS)} or ALPHA_US,GBYTES_PER_S "
                         "(e.g. 2,12.5)") from None
    return Link.from_bandwidth(alpha_us, gbyte_per_s=gbyte_per_s, description=f"{text} (given)")


# ----------------------------------------------------------------------------- collectives on one link


def ring_allreduce_time(nbytes, p, link):
    """Ring allreduce: ``2 (p-1) alpha + 2 (p-1)/p * n * beta`` (0 for one rank).

    Example: ``ring_allreduce_time(1 << 20, 4, PRESETS["ib100"])``
    """
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes * link.beta


def recursive_doubling_allreduce_time(nbytes, p, link):
    """Recursive doubling: ``log2 q`` exchanges of the whole message, q the largest power of
    two <= p, and two more when p is not a power of two (the extra ranks hand their data to
    a partner first and get the result back last).

    Example: ``recursive_doubling_allreduce_time(4096, 8, PRESETS["ib100"])`` is 3 (alpha + 4096 beta)
    """
    if p <= 1:
        return 0.0
    q = 1 << (p.bit_length() - 1)
    steps = int(math.log2(q)) + (2 if q != p else 0)
    return steps * link.time(nbytes)


def allreduce_time(nbytes, p, link):
    """(seconds, algorithm) of one allreduce: the cheaper of ring and recursive doubling.

    Example: ``allreduce_time(64 << 20, 16, PRESETS["ib100"])`` is ``(~0.0101, "ring")``
    """
    ring = ring_allreduce_time(nbytes, p, link)
    doubling = recursive_doubling_allreduce_time(nbytes, p, link)
    return (doubling, "recursive doubling") if doubling < ring else (ring, "ring")


def ring_reduce_scatter_time(nbytes, p, link):
    """Ring reduce-scatter of n bytes into p shards: ``(p-1) alpha + (p-1)/p * n * beta``; the
    ring allgather of the shards costs the same.

    Example: ``ring_reduce_scatter_time(8 << 20, 8, PRESETS["nvlink"])``
    """
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha + (p - 1) / p * nbytes * link.beta


# ----------------------------------------------------------------------------- the cluster

# How the MPI library's allreduce over all ranks crosses nodes (Cluster.flat; the module docstring).
FLAT_ALGORITHMS = ("node-aware", "single-level")


@dataclass(frozen=True)
class Cluster:
    """N nodes x G ranks per node, the links inside and between nodes, and tf_mpi's engine settings.

    ``nics_per_node``: network cards the ranks of a node share for the cross-node part of
    the hierarchical allreduce. ``cores_per_node``: 0 when ranks do not share compute (a
    GPU each); otherwise more ranks than cores on a node slow computation and
    communication by ``ranks_per_node / cores_per_node``. ``collective_s``: what one
    collective costs the engine besides the MPI calls (the negotiation with rank 0, the
    hand-offs between threads), added once per grouped allreduce; ``measure_cluster`` measures
    it on a running job, 0 leaves it out.

    Example::

        Cluster(nodes=64, ranks_per_node=8, intra=PRESETS["nvlink"], inter=PRESETS["ib200"]).size   # 512
    """
    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link
    nics_per_node: int = 1
    cores_per_node: int = 0
    chunk_bytes: int = None   # None: the engine's default for this many nodes
    direct_bytes: int = DEFAULT_DIRECT_BYTES
    flat: str = "node-aware"  # how the MPI library's own allreduce crosses nodes: FLAT_ALGORITHMS
    collective_s: float = 0.0  # the engine's software cost per collective (measure_cluster); 0: not priced

    def __post_init__(self):
        if self.chunk_bytes is None:
            object.__setattr__(self, "chunk_bytes", DEFAULT_CHUNK_BYTES if self.nodes == 1 else NETWORK_CHUNK_BYTES)
        if (self.nodes < 1 or self.ranks_per_node < 1 or self.nics_per_node < 1 or self.cores_per_node < 0
                or not self.collective_s >= 0):
            raise ValueError(f"a cluster needs nodes, ranks_per_node, nics_per_node >= 1 and cores_per_node, "
                             f"collective_s >= 0: {self}")
        if self.flat not in FLAT_ALGORITHMS:
            raise ValueError(f"flat={self.flat!r}: expected one of {', '.join(FLAT_ALGORITHMS)}")

    @property
    def size(self):
        """Ranks in all."""
        return self.nodes * self.ranks_per_node

    @property
    def core_share(self):
        """How many times slower a rank computes (and its CPU moves bytes) than alone on a core."""
        if self.cores_per_node <= 0:
            return 1.0
        return max(1.0, self.ranks_per_node / self.cores_per_node)


def rooted_time(nbytes, p, link):
    """A reduce to one rank, or a broadcast from one, of n bytes over p ranks: the cheaper of a
    binomial tree, ``ceil(log2 p) (alpha + n beta)``, and scatter + ring, ``2 (p-1) alpha +
    2 (p-1)/p n beta``.

    Example: ``rooted_time(64 << 20, 8, PRESETS["nvlink"])``
    """
    if p <= 1:
        return 0.0
    return min(math.ceil(math.log2(p)) * link.time(nbytes), 2 * ring_reduce_scatter_time(nbytes, p, link))


def flat_allreduce_time(nbytes, cluster):
    """(seconds, algorithm) of one MPI allreduce over all ranks, as the MPI library runs it
    (``cluster.flat``): node-aware (reduce in the node, allreduce among one rank per node,
    broadcast in the node) or single-level (paced by the slowest link).

    Example: ``flat_allreduce_time(4 << 20, Cluster(2, 8, PRESETS["nvlink"], PRESETS["ib100"]))``
    """
    g, n = cluster.ranks_per_node, cluster.nodes
    if cluster.flat == "node-aware" and g > 1 and n > 1:
        intra = cluster.intra.scaled(cluster.core_share)
        across, algorithm = allreduce_time(nbytes, n, cluster.inter.scaled(cluster.core_share))
        return 2 * rooted_time(nbytes, g, intra) + across, f"node-aware (reduce in node, {algorithm} across)"
    link = cluster.inter if n > 1 else cluster.intra
    return allreduce_time(nbytes, cluster.size, link.scaled(cluster.core_share))


def hierarchical_allreduce_time(nbytes, cluster):
    """(seconds, algorithm) of the 2D allreduce: reduce-scatter in the node, allreduce of the
    shards across nodes (G at a time over the node's network cards), allgather in the node.

    Example: ``hierarchical_allreduce_time(4 << 20, Cluster(2, 8, PRESETS["nvlink"], PRESETS["ib100"]))``
    """
    g, n = cluster.ranks_per_node, cluster.nodes
    if g == 1 or n == 1:
        return flat_allreduce_time(nbytes, cluster)
    share = cluster.core_share
    intra = cluster.intra.scaled(share)
    inter = cluster.inter.scaled(share)
    inter = replace(inter, beta=inter.beta * max(1.0, g / cluster.nics_per_node))
    across, algorithm = allreduce_time(nbytes / g, n, inter)
    inside = 2 * ring_reduce_scatter_time(nbytes, g, intra)
    return inside + across, f"hierarchical (ring in node, {algorithm} across)"


def engine_messages(tensor_bytes, cluster):
    """Sizes of the MPI allreduce calls the engine makes for one grouped allreduce of these
    tensors: tensors of at least ``direct_bytes`` on their own, the rest fused into one
    buffer, each cut into pieces of at most ``chunk_bytes``.

    Example: ``engine_messages([3 << 20, 1000, 1000], cluster)`` is ``[1 MiB, 1 MiB, 1 MiB, 2000]``
    """
    direct = [b for b in tensor_bytes if b >= cluster.direct_bytes > 0]
    fused = sum(b for b in tensor_bytes if not b >= cluster.direct_bytes > 0)
    buffers = direct + ([fused] if fused else [])
    chunk = cluster.chunk_bytes
    pieces = []
    for b in buffers:
        if chunk <= 0:
            pieces.append(b)
            continue
        pieces += [chunk] * (b // chunk) + ([b % chunk] if b % chunk else [])
    return pieces


def group_time(tensor_bytes, cluster, hierarchical):
    """Seconds of one grouped allreduce of tensors of these sizes (engine messages, one after another).

    Example: ``group_time([25 << 20], cluster, hierarchical=True)``
    """
    allreduce = hierarchical_allreduce_time if hierarchical else flat_allreduce_time
    if cluster.size == 1:
        return 0.0
    return cluster.collective_s + sum(allreduce(b, cluster)[0] for b in engine_messages(tensor_bytes, cluster))


def plan_cost_model(cluster, hierarchical, overlap):
    """The tf_mpi.grouping.CostModel the grouping plan's probe would measure on `cluster`:
    alpha and beta fitted to the predicted times of its two probe sizes.

    Example: ``plan_cost_model(cluster, hierarchical=True, overlap=1.0).break_even_bytes``
    """
    small = group_time([PROBE_SMALL_BYTES], cluster, hierarchical)
    large = group_time([PROBE_LARGE_BYTES], cluster, hierarchical)
    beta = max((large - small) / (PROBE_LARGE_BYTES - PROBE_SMALL_BYTES), 1e-15)
    alpha = max(small - beta * PROBE_SMALL_BYTES, 1e-9)
    return grouping.CostModel(alpha, beta, overlap)


def engine_links():
    """(intra, inter): the Links of the running engine's hierarchical-allreduce model, the
    inter-node one measured at start-up across nodes (cpp/core/transports/link_probe.h) unless
    TF_MPI_INTER_NODE_LINK gave it. Needs tf_mpi.init().

    Example: ``intra, inter = engine_links(); print(inter_node_link_setting(inter))``
    """
    from tf_mpi.basics import _core
    h = _core.hierarchical()
    source = ("measured at start-up" if "measured at start-up" in h["summary"] else
              "TF_MPI_INTER_NODE_LINK" if "from TF_MPI_INTER_NODE_LINK" in h["summary"] else "engine default")
    return (Link(h["intra_alpha_s"], h["intra_beta_s"], "engine"),
            Link(h["inter_alpha_s"], h["inter_beta_s"], source))


def inter_node_link_setting(link):
    """The TF_MPI_INTER_NODE_LINK value (ALPHA_US,GB_PER_S) for a Link, e.g. ``"12.0,0.118"``."""
    return f"{link.alpha * 1e6:.1f},{1e-9 / link.beta:.3g}"


def link_from_probe(cost_model, ranks, chunk_bytes=DEFAULT_CHUNK_BYTES):
    """The Link that makes this model reproduce the probe allreduces of
    ``tf_mpi.grouping.measure_cost_model`` (measured on `ranks` ranks of one node).

    The probe fits ``alpha + beta * n`` to a 4 KiB and a 4 MiB allreduce; the 4 MiB one
    was several engine messages of ``chunk_bytes``. This recovers the two times, solves
    for the per-message alpha and beta of one allreduce on `ranks` ranks, and inverts
    the cheaper of ring and recursive doubling for the link's alpha and beta. Exact with
    2 ranks (both algorithms send the whole message once); with more, the two probe sizes
    may fall on different algorithms and the link is an approximation.

    Example::

        cm = tf_mpi.grouping.measure_cost_model()          # on every rank, under mpirun
        link = link_from_probe(cm, hvd.size())
    """
    if ranks < 2:
        raise ValueError("the probe measures a link only with 2 or more ranks")
    small_t = cost_model.alpha + cost_model.beta * PROBE_SMALL_BYTES
    large_t = cost_model.alpha + cost_model.beta * PROBE_LARGE_BYTES
    pieces = PROBE_LARGE_BYTES // chunk_bytes if 0 < chunk_bytes < PROBE_LARGE_BYTES else 1
    piece = PROBE_LARGE_BYTES / pieces
    # small_t = a + b * small; large_t = pieces * a + b * large  (a, b: one allreduce message)
    b = (large_t - pieces * small_t) / (PROBE_LARGE_BYTES - pieces * PROBE_SMALL_BYTES)
    b = max(b, 1e-15)
    a = max(small_t - b * PROBE_SMALL_BYTES, 1e-9)
    # One allreduce message on `ranks` ranks costs c_a * alpha + c_b * beta * n for the
    # algorithm the model picks; try both and keep the one the model then picks itself.
    q = 1 << (ranks.bit_length() - 1)
    steps = int(math.log2(q)) + (2 if q != ranks else 0)
    candidates = [Link(a / steps, b / steps, "from the probe"),
                  Link(a / (2 * (ranks - 1)), b * ranks / (2 * (ranks - 1)), "from the probe")]
    best = min(candidates, key=lambda link: abs(allreduce_time(piece, ranks, link)[0] - (a + b * piece)))
    return best


# ----------------------------------------------------------------------------- calibration on a running job


def fit_link_rates(timed, nodes, ranks_per_node, intra, inter, flat="node-aware", chunk_bytes=None):
    """(intra, inter): the two Links with their betas (seconds per byte) fitted so that this model
    best reproduces measured times of both allreduce paths; their alphas stay as given (the
    start-up probe's latencies). ``timed`` is ``{"bytes": [...], "flat_s": [...],
    "hierarchical_s": [...]}``, what ``tf_mpi._core.hierarchical()["timed"]`` holds after
    ``init()`` across real hosts (the engine timed both paths at start-up, 4 KiB and up).

    Both paths send the same bytes across nodes and differ in the node stages (the flat one
    reduces to one rank and broadcasts, the hierarchical one reduce-scatters and allgathers), so
    the times of both fix the two rates: what they share is the network's, their difference the
    node's. The fit is least squares in seconds (a log grid for the start, then Gauss-Newton
    steps): the sizes where the time goes weigh most, so the rates are the sustained ones, not
    those of messages that fit the socket buffers or a rate limiter's burst. What the rates then
    stand for is the job's own links as its allreduces see them, with what the model leaves out
    (the MPI's algorithms, CPU per byte, ranks sharing cores) folded in.

    Example::

        timed = {"bytes": [1 << 20, 4 << 20], "flat_s": [8.8e-3, 35e-3], "hierarchical_s": [8.9e-3, 36e-3]}
        intra, inter = fit_link_rates(timed, 2, 2, Link(1.7e-6, 1e-10), Link(1e-5, 8e-9))
    """
    points = [(b, f, h) for b, f, h in zip(timed["bytes"], timed["flat_s"], timed["hierarchical_s"]) if f > 0 and h > 0]
    if not points:
        raise ValueError("fit_link_rates needs at least one timed size with positive times")

    measured = np.array([t for _, f, h in points for t in (f, h)])

    def times(intra_beta, inter_beta):
        cluster = Cluster(nodes, ranks_per_node, replace(intra, beta=intra_beta), replace(inter, beta=inter_beta),
                          flat=flat, chunk_bytes=chunk_bytes)
        return np.array([group_time([b], cluster, h) for b, _, _ in points for h in (False, True)])

    # A coarse log grid for the start, then Gauss-Newton steps: with the algorithms the model picks
    # held, every time is linear in the two rates, so each step is an exact linear least squares.
    _, intra_beta, inter_beta = min((float(np.sum((times(i, x) - measured) ** 2)), i, x)
                                    for i in np.logspace(-12, -8, 17) for x in np.logspace(-12, -6, 25))
    # The node's rate is at most the given one (the default is shared memory's, 10 GB/s): where
    # the hierarchical path is no faster than the flat one, a faster node would be the fit's only
    # way to price that, and it would take the difference from the network's rate.
    intra_beta = max(intra_beta, intra.beta)
    for fit_intra in (True, False):
        for _ in range(4):
            base = times(intra_beta, inter_beta)
            columns = [(times(intra_beta, inter_beta * 1.01) - base) / (0.01 * inter_beta)]
            if fit_intra:
                columns.append((times(intra_beta * 1.01, inter_beta) - base) / (0.01 * intra_beta))
            step = np.linalg.lstsq(np.stack(columns, axis=1), measured - base, rcond=None)[0]
            inter_beta = float(min(max(inter_beta + step[0], 1e-13), 1e-5))
            if fit_intra:
                intra_beta = float(min(max(intra_beta + step[1], intra.beta), 1e-7))
        if intra_beta > intra.beta:
            break  # both rates fitted inside their bounds; else fit the network's alone
    return (replace(intra, beta=float(intra_beta), description="rate fitted to both paths' start-up timings"),
            replace(inter, beta=float(inter_beta), description="rate fitted to both paths' start-up timings"))


ENGINE_PROBE_BYTES = 8  # the allreduce measure_cluster prices the engine's cost per collective with


def calibrated_cluster(nodes, ranks_per_node, intra, inter, timed=None, engine_s=None,
                       engine_bytes=ENGINE_PROBE_BYTES, engine_hierarchical=False, flat="node-aware"):
    """The Cluster of a running job, calibrated on what it measured: the links' rates fitted to the
    start-up timings of both paths (``fit_link_rates``; the links as given where there are none),
    and ``collective_s`` = ``engine_s``, the time of one allreduce of ``engine_bytes`` through the
    engine (negotiation included), less the model's time for its MPI part (on the hierarchical
    path if ``engine_hierarchical``).

    Example::

        cluster = calibrated_cluster(2, 2, Link(1.7e-6, 1e-10), Link(1e-5, 8e-9), timed, engine_s=1.3e-4)
    """
    if timed and timed.get("bytes"):
        intra, inter = fit_link_rates(timed, nodes, ranks_per_node, intra, inter, flat)
    cluster = Cluster(nodes, ranks_per_node, intra, inter, flat=flat)
    if engine_s is not None:
        mpi_part = group_time([engine_bytes], cluster, engine_hierarchical)
        cluster = replace(cluster, collective_s=max(0.0, engine_s - mpi_part))
    return cluster


def measure_engine_seconds(nbytes=ENGINE_PROBE_BYTES, repeats=31):
    """Seconds of one float32 Sum allreduce of ``nbytes`` through the engine (negotiation
    included): the median over ``repeats`` calls, each started together on every rank and
    counted as the slowest rank's time; rank 0's figure on every rank (collective: call on
    every rank after ``tf_mpi.init()``).

    Example: ``predict.measure_engine_seconds() * 1e6``   # microseconds
    """
    import time
    from tf_mpi.basics import _core, Max, Sum
    x = np.ones(max(1, nbytes // 4), np.float32)
    _core.allreduce(x, Sum, "tfmpi.predict.engine")  # warm-up
    samples = []
    for _ in range(repeats):
        _core.allreduce(np.zeros(1, np.int32), Sum, "tfmpi.predict.barrier")  # start together
        start = time.perf_counter()
        _core.allreduce(x, Sum, "tfmpi.predict.engine")
        samples.append(time.perf_counter() - start)
    slowest = _core.allreduce(np.array(samples, np.float64), Max, "tfmpi.predict.engine.slowest")
    return float(_core.broadcast(np.array([float(np.median(slowest))]), 0, "tfmpi.predict.engine.share")[0])


def measure_cluster(repeats=31):
    """Calibrates the model on the running job (collective: call on every rank after
    ``tf_mpi.init()``): its nodes and ranks per node, the engine's links (the start-up probe's
    or TF_MPI_INTRA/INTER_NODE_LINK) with their rates fitted to the start-up timings of both
    allreduce paths where the engine made them (across real hosts, ``fit_link_rates``), and
    ``collective_s`` from ``measure_engine_seconds(8, repeats)``. Every rank returns rank 0's figures.

    Example::

        hvd.init()
        cluster = predict.measure_cluster()
        print(cluster.inter, cluster.collective_s)
    """
    from tf_mpi.basics import _core
    h = _core.hierarchical()
    intra, inter = engine_links()
    engine_s = measure_engine_seconds(ENGINE_PROBE_BYTES, repeats)
    return calibrated_cluster(_core.cross_size(), _core.local_size(), intra, inter, h["timed"], engine_s,
                              ENGINE_PROBE_BYTES, goes_hierarchical(h, ENGINE_PROBE_BYTES))


def goes_hierarchical(choice, nbytes):
    """Whether an allreduce buffer of ``nbytes`` takes the hierarchical path under ``choice``,
    a ``tf_mpi._core.hierarchical()`` dict (its window [min_bytes, max_bytes), None: no upper end).

    Example: ``goes_hierarchical(_core.hierarchical(), 4 << 20)``
    """
    return bool(choice["usable"] and choice["min_bytes"] <= nbytes and
                (choice["max_bytes"] is None or nbytes < choice["max_bytes"]))


# ----------------------------------------------------------------------------- the workload


@dataclass
class Workload:
    """The gradients of one training step, in backprop order (``sizes[0]`` is produced first),
    and the single-rank step time.

    ``backprop_s``: the part of the step during which the gradients are produced and
    communication can overlap; None: no overlap (all communication is exposed).

    Example::

        work = Workload([4 << 20, 1 << 20], step_s=0.1, backprop_s=0.06)
    """
    sizes: list
    step_s: float
    backprop_s: float = None
    names: list = field(default=None)
    source: str = ""

    def __post_init__(self):
        self.sizes = [int(s) for s in self.sizes]
        if not self.sizes or any(s < 0 for s in self.sizes):
            raise ValueError("a workload needs a non-empty list of gradient sizes >= 0 bytes")
        if self.step_s <= 0:
            raise ValueError(f"the single-rank step time must be > 0, got {self.step_s}")
        if self.backprop_s is not None and not 0 <= self.backprop_s <= self.step_s:
            raise ValueError(f"backprop time {self.backprop_s} must lie in [0, step time {self.step_s}]")
        if self.names is None:
            self.names = [f"tensor{i}" for i in range(len(self.sizes))]

    @property
    def total_bytes(self):
        return sum(self.sizes)

    @classmethod
    def from_json(cls, path, step_s, backprop_s=None, bytes_per_element=4):
        """From a JSON file: a list of byte counts in backprop order; or an object with
        ``"shapes"`` (and optionally ``"names"``) in the order the model lists its variables
        (forward order, as benchmarks/data/resnet50_grad_shapes.json), reversed here for
        backprop order as tf_mpi does for eager gradients; or with ``"backprop_bytes"``.

        Example: ``Workload.from_json("benchmarks/data/resnet50_grad_shapes.json", step_s=0.25)``
        """
        with open(path) as f:
            spec = json.load(f)
        names = None
        if isinstance(spec, list):
            sizes = spec
        elif "backprop_bytes" in spec:
            sizes, names = spec["backprop_bytes"], spec.get("names")
        elif "shapes" in spec:
            sizes = [int(np.prod(s, dtype=np.int64)) * bytes_per_element for s in spec["shapes"]][::-1]
            names = spec["names"][::-1] if "names" in spec else None
        else:
            raise ValueError(f"{path}: expected a list of byte counts or an object with 'shapes' or 'backprop_bytes'")
        return cls(sizes, step_s, backprop_s, names, source=os.path.basename(path))

    @classmethod
    def from_keras_model(cls, model, step_s, backprop_s=None):
        """From a Keras model (or the path of a saved one): its trainable variables, reversed
        (backprop order at layer granularity, as tf_mpi orders eager gradients).

        Example: ``Workload.from_keras_model("model.keras", step_s=0.12)``
        """
        source = None
        if isinstance(model, str):
            import keras
            source = os.path.basename(model)
            model = keras.models.load_model(model, compile=False)
        variables = list(model.trainable_variables)[::-1]
        sizes = [int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize for v in variables]
        names = [getattr(v, "path", None) or v.name for v in variables]
        return cls(sizes, step_s, backprop_s, names, source=source or model.name)


class _Shape(tuple):
    """A fully known shape, for tf_mpi.grouping.make_plan without TensorFlow."""

    def is_fully_defined(self):
        return True


@dataclass
class _Dtype:
    size: int


@dataclass
class _Tensor:
    """What make_plan reads of an eager gradient and of its variable (no ``op``: eager order)."""
    shape: _Shape
    dtype: _Dtype
    path: str


def grouping_plan(work, cost_model, grouping_mode="plan", threshold_bytes=None):
    """tf_mpi.grouping.make_plan's plan for `work`'s gradients under `cost_model`; groups'
    ``indices`` index ``work.sizes``. ``grouping_mode`` "one": a single group.

    Example: ``[g.nbytes for g in grouping_plan(work, grouping.CostModel(5e-5, 1e-9, 1.0)).groups]``
    """
    # make_plan orders eager gradients by reversed position: hand it the forward order.
    n = len(work.sizes)
    tensors = [_Tensor(_Shape((work.sizes[n - 1 - i],)), _Dtype(1), work.names[n - 1 - i]) for i in range(n)]
    if grouping_mode == "one":
        plan = grouping.make_plan(tensors, tensors, num_groups=1)
    elif grouping_mode == "plan":
        plan = grouping.make_plan(tensors, tensors, threshold_bytes=threshold_bytes, cost_model=cost_model)
    else:
        raise ValueError(f"grouping {grouping_mode!r}: expected 'plan' or 'one'")
    for group in plan.groups:  # back to indices of work.sizes (backprop order)
        group.indices = [n - 1 - i for i in group.indices]
    return plan


# ----------------------------------------------------------------------------- the step


@dataclass
class StepPrediction:
    """One prediction: per-step communication, the exposed part of it, the step and the efficiency.

    Example: ``p = predict_step(work, cluster, hierarchical=True); print(p.efficiency)``
    """
    nodes: int
    ranks_per_node: int
    hierarchical: bool
    groups: int
    comm_s: float
    exposed_s: float
    compute_s: float
    step_s: float
    efficiency: float
    algorithm: str

    @property
    def ranks(self):
        return self.nodes * self.ranks_per_node


def exposed_communication(group_ready_s, group_cost_s, backprop_s, overlap):
    """Communication (seconds) not hidden behind backprop: groups are sent one after another,
    each once it is ready; of the time spent before backprop ends, the share `overlap` is
    hidden; everything after it is exposed.

    Example: ``exposed_communication([0.05, 0.1], [0.02, 0.03], 0.1, 1.0)`` is 0.03
    """
    clock, busy_during_backprop = 0.0, 0.0
    for ready, cost in zip(group_ready_s, group_cost_s):
        start = max(clock, ready)
        clock = start + cost
        busy_during_backprop += max(0.0, min(clock, backprop_s) - min(start, backprop_s))
    return max(0.0, clock - backprop_s) + (1.0 - overlap) * busy_during_backprop


def predict_step(work, cluster, hierarchical, overlap=1.0, grouping_mode="plan", threshold_bytes=None):
    """Predicts one training step of `work` on `cluster` (a StepPrediction).

    Example::

        work = Workload.from_json("benchmarks/data/resnet50_grad_shapes.json", step_s=0.25, backprop_s=0.16)
        cluster = Cluster(2, 8, PRESETS["nvlink"], PRESETS["ib100"])
        print(predict_step(work, cluster, hierarchical=True).efficiency)
    """
    compute = work.step_s * cluster.core_share
    if cluster.size == 1:
        return StepPrediction(cluster.nodes, cluster.ranks_per_node, hierarchical, 0, 0.0, 0.0, compute, compute,
                              work.step_s / compute, "none")
    plan = grouping_plan(work, plan_cost_model(cluster, hierarchical, overlap), grouping_mode, threshold_bytes)
    costs = [group_time([work.sizes[i] for i in g.indices], cluster, hierarchical) for g in plan.groups]
    backprop = (work.backprop_s or 0.0) * cluster.core_share
    produced = np.cumsum(work.sizes) / max(work.total_bytes, 1)
    ready = [backprop * produced[max(g.indices)] for g in plan.groups]
    exposed = exposed_communication(ready, costs, backprop, overlap)
    allreduce = hierarchical_allreduce_time if hierarchical else flat_allreduce_time
    algorithm = allreduce(min(cluster.chunk_bytes or work.total_bytes, work.total_bytes), cluster)[1]
    step = compute + exposed
    return StepPrediction(cluster.nodes, cluster.ranks_per_node, hierarchical, len(plan.groups), sum(costs),
                          exposed, compute, step, work.step_s / step, algorithm)


def predict_scaling(work, nodes_list, ranks_per_node, intra, inter, overlap=1.0, grouping_mode="plan", **cluster_args):
    """StepPredictions for every node count in `nodes_list`, flat and hierarchical.

    Example::

        rows = predict_scaling(work, [1, 2, 64], 8, PRESETS["nvlink"], PRESETS["ib200"])
    """
    rows = []
    for nodes in nodes_list:
        cluster = Cluster(nodes, ranks_per_node, intra, inter, **cluster_args)
        for hierarchical in (False, True):
            rows.append(predict_step(work, cluster, hierarchical, overlap, grouping_mode))
    return rows


def format_table(rows):
    """The predictions as a fixed-width text table.

    Example: ``print(format_table(predict_scaling(work, [1, 2], 8, intra, inter)))``
    """
    lines = [f"{'nodes':>5} {'x G':>4} {'ranks':>6}  {'allreduce':<12} {'groups':>6} {'comm ms':>9} "
             f"{'exposed ms':>10} {'step ms':>9} {'efficiency':>10}"]
    for r in rows:
        lines.append(f"{r.nodes:>5} {r.ranks_per_node:>4} {r.ranks:>6}  {'hierarchical' if r.hierarchical else 'flat':<12} "
                     f"{r.groups:>6} {r.comm_s * 1e3:>9.2f} {r.exposed_s * 1e3:>10.2f} {r.step_s * 1e3:>9.1f} "
                     f"{r.efficiency:>10.3f}")
    return "\n".join(lines)


def plot_scaling(rows, path, title):
    """Writes a PNG (1200 x 700 px) of efficiency against ranks, flat and hierarchical.

    Example: ``plot_scaling(predict_scaling(work, [1, 2, 4, 8], 8, intra, inter), "scaling.png", "ResNet-50")``
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 7), dpi=100)
    for hierarchical, style in ((False, "o-"), (True, "s--")):
        picked = [r for r in rows if r.hierarchical == hierarchical]
        ax.plot([r.ranks for r in picked], [r.efficiency for r in picked], style,
                label="hierarchical (2D)" if hierarchical else "flat", linewidth=2, markersize=7)
    ax.set_xscale("log", base=2)
    ranks = sorted({r.ranks for r in rows})
    ax.set_xticks(ranks)
    ax.set_xticklabels([str(r) for r in ranks])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("ranks (nodes x ranks per node)", fontsize=13)
    ax.set_ylabel("scaling efficiency (step of 1 rank / step)", fontsize=13)
    ax.set_title(title, fontsize=14)
    ax.tick_params(labelsize=12)
    ax.grid(True, alpha=0.4)
    ax.legend(fontsize=12)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m tf_mpi.predict",
        description="Predicts per-step communication, exposed communication and scaling efficiency of "
                    "data-parallel training with tf_mpi on N nodes x G ranks per node (docs/scaling.md).")
    p.add_argument("model", help="a saved Keras model (.keras, .h5) or a JSON file of gradient sizes "
                                 "(a list of bytes in backprop order, or an object with 'shapes')")
    p.add_argument("--step-ms", type=float, required=True, help="single-rank training step time (ms)")
    p.add_argument("--backprop-ms", type=float, default=None,
                   help="the part of the step that produces gradients, over which communication can overlap; "
                        "default: no overlap")
    p.add_argument("--intra", default="nvlink", help="link inside a node: a preset (%s) or ALPHA_US,GBYTES_PER_S"
                   % ", ".join(PRESETS))
    p.add_argument("--inter", default="ib100", help="link between nodes (same forms as --intra)")
    p.add_argument("--measure", action="store_true",
                   help="under mpirun on one node: take the intra-node link (and the overlap, unless --overlap) "
                        "from tf_mpi's probe, --inter stays as given; across nodes: the links tf_mpi measured at "
                        "start-up with their rates fitted to its start-up timings of both allreduce paths (the "
                        "inter-node one printed as a TF_MPI_INTER_NODE_LINK value), the engine's cost per "
                        "collective (an 8-byte allreduce less its MPI part) and the overlap; --intra and --inter "
                        "are then not used")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--nics-per-node", type=int, default=1,
                   help="network cards per node the hierarchical allreduce's cross-node shards share")
    p.add_argument("--flat", choices=FLAT_ALGORITHMS, default="node-aware",
                   help="how the MPI library's own allreduce crosses nodes: node-aware (Open MPI 5, MPICH: reduce "
                        "in the node, one stream per node across, broadcast) or single-level (a ring or recursive "
                        "doubling over all ranks, paced by the inter-node link)")
    p.add_argument("--cores-per-node", type=int, default=0,
                   help="CPU training: ranks beyond this many per node share cores (0: a GPU per rank)")
    p.add_argument("--overlap", type=float, default=None,
                   help="share of communication during backprop that hides (default 1, or the probe's with --measure)")
    p.add_argument("--grouping", choices=["plan", "one"], default="plan",
                   help="the grouping plan tf_mpi would choose, or all gradients in one group")
    chunk = os.environ.get("TF_MPI_CHUNK_BYTES")
    p.add_argument("--chunk-bytes", type=int, default=int(chunk) if chunk else None,
                   help="largest MPI call of the engine (TF_MPI_CHUNK_BYTES; 0: no limit; default: the engine's, "
                        f"{DEFAULT_CHUNK_BYTES} B on one node, {NETWORK_CHUNK_BYTES} B on several)")
    p.add_argument("--plot", default=None, help="write efficiency against ranks to this PNG")
    p.add_argument("--json", default=None, help="write the predictions to this JSON file")
    args = p.parse_args(argv)
    if args.step_ms <= 0 or (args.backprop_ms is not None and not 0 <= args.backprop_ms <= args.step_ms):
        p.error("--step-ms must be > 0 and --backprop-ms in [0, --step-ms]")
    if args.overlap is not None and not 0 <= args.overlap <= 1:
        p.error("--overlap must lie in [0, 1]")
    if min(args.nodes) < 1 or args.ranks_per_node < 1:
        p.error("--nodes and --ranks-per-node must be >= 1")
    try:
        args.intra_link, args.inter_link = parse_link(args.intra), parse_link(args.inter)
    except ValueError as e:
        p.error(str(e))
    return args


def load_workload(path, step_s, backprop_s=None):
    """A Workload from a JSON file of gradient sizes or a saved Keras model (by extension).

    Example: ``load_workload("model.keras", step_s=0.12)``
    """
    if path.endswith(".json"):
        return Workload.from_json(path, step_s, backprop_s)
    return Workload.from_keras_model(path, step_s, backprop_s)


def main(argv=None):
    """The command line: prints the table (rank 0 under mpirun) and writes the plot and JSON if asked.

    Example: ``main(["benchmarks/data/resnet50_grad_shapes.json", "--step-ms", "250", "--nodes", "1", "2"])``
    """
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    work = load_workload(args.model, args.step_ms / 1e3, None if args.backprop_ms is None else args.backprop_ms / 1e3)
    intra, inter, overlap, printing = args.intra_link, args.inter_link, args.overlap, True
    collective_s = 0.0
    if args.measure:
        from tf_mpi import basics
        basics.init()
        cost_model = grouping.measure_cost_model()
        if basics.cross_size() > 1:  # the probe's allreduces crossed nodes: they say nothing of the intra link
            measured = measure_cluster()
            intra, inter, collective_s = measured.intra, measured.inter, measured.collective_s
        else:
            intra = link_from_probe(cost_model, basics.size(),
                                    DEFAULT_CHUNK_BYTES if args.chunk_bytes is None else args.chunk_bytes)
        overlap = cost_model.overlap if overlap is None else overlap
        printing = basics.rank() == 0
    overlap = 1.0 if overlap is None else overlap
    rows = predict_scaling(work, sorted(set(args.nodes)), args.ranks_per_node, intra, inter, overlap,
                           args.grouping, nics_per_node=args.nics_per_node, cores_per_node=args.cores_per_node,
                           chunk_bytes=args.chunk_bytes, flat=args.flat, collective_s=collective_s)
    if not printing:
        return 0
    print(f"model     : {work.source}: {len(work.sizes)} gradients, {work.total_bytes / MiB:.1f} MiB ({work.total_bytes} B)")
    print(f"step      : {args.step_ms:g} ms on one rank, backprop "
          + (f"{args.backprop_ms:g} ms" if args.backprop_ms is not None else "unknown (no overlap counted)")
          + f", overlap {overlap:.2f}")
    print(f"intra-node: {intra}")
    print(f"inter-node: {inter}, {args.nics_per_node} NIC(s) per node"
          + (f"; TF_MPI_INTER_NODE_LINK={inter_node_link_setting(inter)}" if inter is not args.inter_link else ""))
    if collective_s:
        print(f"engine    : {collective_s * 1e6:.0f} us per collective besides its MPI calls (measured)")
    chunks = "the engine's default" if args.chunk_bytes is None else f"{args.chunk_bytes} B"
    print(f"MPI       : flat allreduce {args.flat} across nodes")
    print(f"engine    : chunks of {chunks}, grouping {args.grouping}"
          + (f", {args.cores_per_node} cores per node" if args.cores_per_node else ""))
    print(format_table(rows))
    if args.plot:
        plot_scaling(rows, args.plot, f"{work.source}: {args.step_ms:g} ms step, {args.ranks_per_node} ranks per "
                                      f"node, {args.intra} in node, {args.inter} across")
        print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=work.source, step_ms=args.step_ms, backprop_ms=args.backprop_ms, overlap=overlap,
                           intra=str(intra), inter=str(inter), flat=args.flat,
                           rows=[dict(r.__dict__, ranks=r.ranks) for r in rows]), f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
