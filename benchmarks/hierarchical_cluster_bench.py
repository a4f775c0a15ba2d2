"""benchmarks/hierarchical_bench.py across pretend hosts (tests/cluster.py), at several link rates.

Run (as root, from the repository root; it brings up and tears down its own cluster)::

    python benchmarks/hierarchical_cluster_bench.py --rates unlimited,1gbit --layouts 2x2 --rounds 5

Per link rate and layout (HOSTSxRANKS), one launch through ``python -m tf_mpi.run --host ...``
(ranks in blocks per host, Open MPI's default) of hierarchical_bench.py: flat, hierarchical and auto allreduces of 4 KiB to
16 MiB, the model's predicted times next to the measured medians, and auto against the better of
the two (target: at most 1.1). No TF_MPI_TOPOLOGY: the nodes are the pretend hosts, and the
model's inter-node link is the engine's start-up probe unless TF_MPI_INTER_NODE_LINK is set.
Writes benchmarks/results/hierarchical_cluster_<rate>_<layout>.json; ``--table`` prints those
files as the Markdown table of docs/scaling.md (tf_mpi.predict against the measured medians).
Launches and the record (with the machine): benchmarks/harness.py.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)
import harness  # noqa: E402
from tf_mpi import predict  # noqa: E402
BENCH = os.path.join(HERE, "hierarchical_bench.py")


def run_layout(cluster, hosts, slots, rounds, timeout):
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    hostlist = ",".join(f"{h}:{slots}" for h in cluster.hosts[:hosts])
    began = time.time()
    harness.launch(hosts * slots, [BENCH, "--rounds", str(rounds), "--json", out], mpirun_args=["--host", hostlist],
                   env={"TF_CPP_MIN_LOG_LEVEL": "3", "TF_MPI_TOPOLOGY": None}, timeout=timeout, cluster=cluster,
                   expect=None, echo=True)
    with open(out) as f:
        record = json.load(f)
    os.unlink(out)
    record.pop("elapsed_s", None)  # the ranks' own; the launch's, start to end:
    record["launch_s"] = time.time() - began
    return record


def calibration(rec):
    """tf_mpi.predict's Cluster for a stored run, as `predict --measure` calibrates it: the engine's
    links with their rates fitted to the auto rounds' start-up timings (per size, the median over
    rounds, sizes every round timed) and the engine's cost per collective from their 8-byte
    allreduces (median). Older records without those: the start-up probe's links."""
    a = rec["auto"]
    intra = predict.Link(a["intra_alpha_s"], a["intra_beta_s"])
    probe = predict.Link(a["inter_alpha_s"], a["inter_beta_s"])
    rounds = [r for r in rec.get("auto_rounds", []) if r.get("timed", {}).get("bytes") and "engine_s" in r]
    if not rounds:
        return predict.Cluster(rec["nodes"], rec["ranks_per_node"], intra, probe), "probe"
    n = min(len(r["timed"]["bytes"]) for r in rounds)
    timed = {"bytes": rounds[0]["timed"]["bytes"][:n]}
    for key in ("flat_s", "hierarchical_s"):
        timed[key] = [statistics.median(r["timed"][key][i] for r in rounds) for i in range(n)]
    engine_s = statistics.median(r["engine_s"] for r in rounds)
    small = predict.ENGINE_PROBE_BYTES
    cluster = predict.calibrated_cluster(rec["nodes"], rec["ranks_per_node"], intra, probe, timed, engine_s, small,
                                         predict.goes_hierarchical(a, small))
    return cluster, "calibrated"


def table(paths):
    """Markdown rows: per rate and size, measured medians against tf_mpi.predict, and auto."""
    def ms(v):
        return f"{v * 1e3:.3g}"

    def err(pred, meas):
        return f"{(pred - meas) / meas * 100:+.0f}%"

    print("| link | bytes | flat measured ms | predicted | error | hierarchical measured ms | predicted | error "
          "| auto took | auto / better |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as f:
            rec = json.load(f)
        a = rec["auto"]
        # The predictions of the current tf_mpi.predict (across real hosts: Open MPI's node-aware flat),
        # calibrated as `predict --measure` does on the measurements each auto round made at start-up.
        cluster, how = calibration(rec)
        link = (f"{rec['rate']} ({rec['nodes']}x{rec['ranks_per_node']}; probe {a['inter_alpha_s'] * 1e6:.0f} us, "
                f"{1e-6 / a['inter_beta_s']:.0f} MB/s"
                + (f"; calibrated: {1e-6 / cluster.inter.beta:.0f} MB/s across, {1e-9 / cluster.intra.beta:.2g} GB/s "
                   f"in the node, {cluster.collective_s * 1e6:.0f} us per collective)" if how == "calibrated" else ")"))
        for r in rec["rows"]:
            flat, hier = (predict.group_time([r["bytes"]], cluster, hierarchical=h) for h in (False, True))
            print(f"| {link} | {r['bytes']} | {ms(r['flat_median_s'])} | {ms(flat)} | "
                  f"{err(flat, r['flat_median_s'])} | {ms(r['hierarchical_median_s'])} | "
                  f"{ms(hier)} | {err(hier, r['hierarchical_median_s'])} | "
                  f"{'hierarchical' if r['auto_hierarchical'] else 'flat'} | {r['auto_over_best']:.2f} |")
            link = ""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="unlimited,1gbit", help="comma-separated tc rates ('unlimited': none)")
    p.add_argument("--layouts", default="2x2", help="comma-separated HOSTSxRANKS_PER_HOST")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefix", default="cal")
    p.add_argument("--net", type=int, default=9)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--table", nargs="+", metavar="JSON", help="print these results as Markdown and exit")
    a = p.parse_args()
    if a.table:
        return table(a.table)
    from cluster import Cluster
    layouts = [tuple(int(v) for v in l.split("x")) for l in a.layouts.split(",")]
    for rate in a.rates.split(","):
        limit = None if rate == "unlimited" else rate
        with Cluster(hosts=max(h for h, _ in layouts), slots=max(s for _, s in layouts), rate=limit,
                     prefix=a.prefix, net=a.net) as c:
            for hosts, slots in layouts:
                print(f"== link {rate}, {hosts} hosts x {slots} ranks", flush=True)
                record = harness.Record(f"hierarchical_cluster_{rate}_{hosts}x{slots}",
                                        path=os.path.join(a.out, f"hierarchical_cluster_{rate}_{hosts}x{slots}.json"))
                measured = run_layout(c, hosts, slots, a.rounds, a.timeout)
                measured.pop("benchmark", None)
                measured.pop("info", None)  # the ranks' view; the record's is the driver's
                record.write(rate=rate, **measured)

if __name__ == "__main__":
    main()
