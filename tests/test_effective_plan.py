"""The effective grouping plan: with TF_MPI_AUTOTUNE=plan, rank 0's holdback may send
consecutive groups of the grouping plan as one message. describe() says so and names each
group's collective; rank 0 logs the plan in effect on the wire once, when the tuner finishes, as
the same collectives, grouped as they are sent (2 ranks, a small Keras model; a section of the np=2
launch that other modules' workers join, mpi_harness.joint_launch)."""
import json
import re

from mpi_harness import assert_check, joint_launch

WORKER = "plan_worker.py"
CHECK = "check_plan_is_described_with_its_collectives_and_the_holdback"


launch = joint_launch("np2", 2, "effective_plan", WORKER, env={"TF_MPI_AUTOTUNE": "plan", "TF_MPI_AUTOTUNE_STEPS": "2"})


def prefetch(items):
    launch(start=True)


def test_tuner_logs_the_effective_plan_in_describes_terms():
    run = launch()
    assert_check(run, 2, CHECK)
    (line,) = [line for line in run.output.splitlines() if line.startswith("PLAN_COLLECTIVES ")]
    collectives = json.loads(line[len("PLAN_COLLECTIVES "):])
    assert "[tf_mpi rank 0] INFO: autotune finished" in run.output, run.describe()
    lines = run.output.splitlines()
    heads = [k for k, line in enumerate(lines) if line.lstrip().startswith("effective plan: ")]
    assert len(heads) == 1, run.describe()  # logged once
    head = heads[0]
    m = re.search(r"effective plan: (\d+) groups on the wire, from the 3 allreduces of a step", lines[head])
    assert m, lines[head]
    groups = []
    for k in range(int(m.group(1))):
        g = re.match(rf"^\s+group {k}: (\d+) allreduces?: (.+)$", lines[head + 1 + k])
        assert g, lines[head + 1 + k]
        members = g.group(2).split(" + ")
        assert len(members) == int(g.group(1))
        groups.append(members)
    # Every group of describe() once, by its collective's name; the log lists them in the order
    # the engine decided them (which backprop's scheduling may change), consecutive ones merged
    # into one message where the tuner chose to.
    sent = [name for members in groups for name in members]
    assert sorted(sent) == sorted(collectives) and len(sent) == len(collectives), (groups, collectives)
