"""Which gradients are reduced together: the grouping plan.

Backprop produces gradients last layer first. Reducing them in groups that
follow that order lets the first groups' communication run while backprop
still computes the rest (wait-free backpropagation). The plan:

1. **Order** gradients by when backprop produces them. Inside ``tf.function``
   this is read from the graph: the creation index of each gradient's
   producing op (``tape.gradient`` emits ops in backprop order). In eager code
   the variable list reversed is used.
2. **Cut** that order into contiguous groups with an alpha-beta cost model
   (as in MG-WFBP): a message costs ``alpha + beta * bytes``; ``overlap`` is
   the share of a transfer that hides behind computation (step 3). A group
   is *bandwidth-bound* when the hidden part of its transfer,
   ``overlap * beta * bytes``, is at least ``MIN_GROUP_COST_FACTOR`` (4)
   times the latency ``alpha`` (start-up is then at most a fifth of what an
   early message costs), and *latency-bound* otherwise; with ``overlap`` 0
   every group is latency-bound. The rules, each pinned by a test on
   synthetic layer lists in tests/test_grouping_plan.py:

   a. *Bandwidth-bound cut.* A group is closed once it is bandwidth-bound:
      merging more into it would save little, while sending it now lets it
      overlap the rest of backprop. A latency-bound group keeps taking the
      next tensors.
   b. *Layer boundary.* That cut waits for the end of the current layer: a
      layer's backward op produces all its gradients at about the same time
      (all the weights of one op, or of one loop over time), so a cut inside
      it would add a message without adding overlap. Layers are read from
      variable paths (``"block_1/conv/kernel"`` belongs to
      ``"block_1/conv"``); consecutive tensors of one layer stay together.
   c. *Byte bound.* No group grows beyond ``threshold_bytes`` (default
      ``TF_MPI_GROUP_BYTES`` = 4 MiB): a group is closed before the tensor
      that would take it past the bound, inside a layer too.
   d. *A tensor over the bound* is a group of its own, except that the
      latency-bound group before it (one rule a has not closed) joins it:
      sent alone, that group would cost a start-up and hide next to nothing.
      With ``overlap`` 0 that is everything since the last cut.
   e. *Latency-bound remainder at the end.* What is left after the last cut
      is latency-bound (a bandwidth-bound group is closed by rule a at its
      layer's end). It is ready only when backprop is over, so as a message
      of its own it would overlap nothing and add a start-up to the critical
      path: it joins the group before it if both fit within the byte bound.

   ``alpha`` and ``beta`` are measured once with probe allreduces and rank
   0's values are used everywhere, so every rank derives the same plan.
3. **Count only the overlap the machine allows.** An early group pays off
   only if its transfer really runs while backprop computes. The probe in
   tf_mpi.policy.overlap_probe measures the share that does (``overlap``), and only
   that share counts in rule a: with ``overlap`` 0.5 a group needs twice the
   bytes to be worth an early message. Where communication and computation
   share the cores (CPU training with as many ranks as cores, shared-memory
   transport) the probe measures 0, no group is ever worth an early message,
   and only the byte bound (rules c and d) cuts: a model whose gradients fit
   within the bound is one group.

``num_groups`` (equal-byte contiguous groups) or explicit ``groups`` (lists of
variables) override steps 2 and 3. Every rank checks at trace time that all ranks
derived the same plan and raises a clear error otherwise.

The plan decides which gradients each grouped allreduce takes. With
``TF_MPI_AUTOTUNE=plan`` (or ``1``) rank 0's engine may in addition hold a
group back and send consecutive groups as one message, if the tuner measured
that faster; ``Plan.describe()`` says so, and rank 0 logs the plan in effect
on the wire once, when the tuner finishes (``effective plan: ...``).

Example::

    opt = tf_mpi.keras.DistributedOptimizer(keras.optimizers.Adam())
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, epochs=1)
    print(opt.grouping_plan.describe())
"""
import hashlib
import os
import time
from dataclasses import dataclass, field

import numpy as np

DEFAULT_GROUP_BYTES = 4 << 20


@dataclass
class CostModel:
    """Per-message latency ``alpha`` (s) and per-byte cost ``beta`` (s/byte) of
    an allreduce, and ``overlap``: the share of its time that hides behind
    computation (1: free in the background; 0: none, see tf_mpi.policy.overlap_probe).

    Example::

        model = CostModel(alpha=50e-6, beta=1e-9, overlap=1.0)
        model.break_even_bytes                      # 50000.0
        plan = make_plan(grads, variables, cost_model=model)   # no probe, no MPI needed
    """
    alpha: float
    beta: float
    overlap: float = 1.0

    @property
    def break_even_bytes(self):
        """Message size at which transfer time equals latency (alpha / beta)."""
        return self.alpha / self.beta if self.beta > 0 else float("inf")


_cost_model = None

agreed_fingerprints = {}
"""Plan name -> the fingerprint every rank verified (verify_same_plan_everywhere)."""

inherited_fingerprints = {}
"""On a rank that joined a running job (tf_mpi.elastic): rank 0's agreed_fingerprints, each
checked locally the first time this rank builds that plan."""


def measure_cost_model(small_bytes=4 << 10, large_bytes=4 << 20, repeats=11):
    """Measures alpha and beta with probe allreduces, and the overlap with
    tf_mpi.policy.overlap_probe (collective: call on every rank).

    The fastest of `repeats` probes per size is used: on a shared machine the
    slow samples measure the neighbours, and the minimum is what makes the
    plan the same from one launch to the next. The result is rank 0's
    (broadcast), so plans derived from it agree everywhere. It is measured
    once per process and cached.

    Example::

        hvd.init()
        model = tf_mpi.grouping.measure_cost_model()   # on every rank
        print(f"alpha {model.alpha * 1e6:.0f} us, overlap {model.overlap:.2f}")
    """
    global _cost_model
    if _cost_model is not None:
        return _cost_model
    from tf_mpi.basics import _core, Sum
    times = {}
    for nbytes in (small_bytes, large_bytes):
        x = np.ones(nbytes // 4, np.float32)
        _core.allreduce(x, Sum, f"tfmpi.costmodel.{nbytes}")  # warm-up
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            _core.allreduce(x, Sum, f"tfmpi.costmodel.{nbytes}")
            samples.append(time.perf_counter() - start)
        times[nbytes] = min(samples)
    beta = max((times[large_bytes] - times[small_bytes]) / (large_bytes - small_bytes), 1e-12)
    alpha = max(times[small_bytes] - beta * small_bytes, 1e-7)
    shared = _core.broadcast(np.array([alpha, beta], np.float64), 0, "tfmpi.costmodel.share")
    from tf_mpi.policy.overlap_probe import measure_overlap
    _cost_model = CostModel(float(shared[0]), float(shared[1]), measure_overlap())
    return _cost_model


@dataclass
class Group:
    """Gradients reduced by one grouped allreduce, in the order they are produced.

    Example: ``[(g.nbytes, len(g.indices)) for g in opt.grouping_plan.groups]``
    """
    indices: list
    names: list
    nbytes: int


def _autotune_merges_groups():
    """Whether TF_MPI_AUTOTUNE lets rank 0's holdback merge groups (its values plan and 1)."""
    return os.environ.get("TF_MPI_AUTOTUNE", "0") in ("1", "plan")


@dataclass
class Plan:
    """The grouping of one gradient list, in backprop order: ``groups[0]`` holds the gradients produced first.

    ``name`` is the prefix of the groups' collectives: group k is the grouped
    allreduce ``collective_name(k)`` (``"<name>.group<k>"``), the name the
    engine's log and timeline show.

    Example::

        plan = opt.grouping_plan            # after the first training step
        print(plan.describe())
        sizes = [g.nbytes for g in plan.groups]
    """
    groups: list
    order: list
    source: str
    threshold_bytes: int = 0
    cost_model: CostModel = None
    fingerprint: str = field(default="", repr=False)
    name: str = ""

    def collective_name(self, k):
        """Name of group k's grouped allreduce (equal on all ranks)."""
        return f"{self.name}.group{k}"

    def describe(self):
        """A human-readable table of the plan: one line per group, in the order they are sent.

        With ``TF_MPI_AUTOTUNE=plan`` or ``1`` in the environment a last line
        says that rank 0 may merge consecutive groups on the wire, and where
        the plan in effect is logged.

        Example::

            print(opt.grouping_plan.describe())
            # grouping plan (...): 2 groups, threshold 4194304 B, ...
            #   group 0 (DistributedAdam.group0): 1058816 B, 4 tensors: dense_2/bias, ...
            #   group 1 (DistributedAdam.group1): 1607680 B, 2 tensors: dense/bias, dense/kernel
        """
        lines = [f"grouping plan ({self.source}): {len(self.groups)} groups"
                 + (f", threshold {self.threshold_bytes} B" if self.threshold_bytes else "")
                 + (f", alpha {self.cost_model.alpha * 1e6:.1f} us, beta {self.cost_model.beta * 1e9:.3f} ns/B"
                    f", overlap {self.cost_model.overlap:.2f}" if self.cost_model else "")]
        for k, g in enumerate(self.groups):
            label = f"group {k} ({self.collective_name(k)})" if self.name else f"group {k}"
            lines.append(f"  {label}: {g.nbytes} B, {len(g.indices)} tensors: {', '.join(g.names)}")
        if _autotune_merges_groups():
            lines.append("  TF_MPI_AUTOTUNE is on: rank 0's holdback may send consecutive groups as one message "
                         "if the tuner measures that faster; rank 0 logs the plan in effect on the wire once, "
                         "when the tuner finishes (\"effective plan: ...\")")
        return "\n".join(lines)


def _nbytes(grad, variable):
    """Bytes of a gradient; from its variable's shape when tracing left the
    gradient's shape partly unknown (e.g. Dense on a [None, T, C] input)."""
    shape = grad.shape if grad.shape.is_fully_defined() else variable.shape
    return int(np.prod(list(shape), dtype=np.int64)) * grad.dtype.size


def production_order(grads):
    """Indices of `grads` in the order backprop produces them.

    Symbolic gradients (inside tf.function) are ordered by the creation index
    of their producing op; eager gradients by reversed position.

    Example: ``production_order([g0, g1, g2])`` of eager tensors is ``[2, 1, 0]``
    """
    def op_of(g):
        values = getattr(g, "values", g)  # IndexedSlices -> its values
        try:
            return values.op
        except AttributeError:  # eager tensors have no op
            return None

    ops = [op_of(g) for g in grads]
    if all(op is not None for op in ops):
        return sorted(range(len(grads)), key=lambda i: (ops[i]._id, -i))
    return list(reversed(range(len(grads))))


def layer_of(variable_name):
    """The layer a variable belongs to: its path without the last part.

    Example: ``layer_of("sequential/lstm_1/lstm_cell/kernel")`` is
    ``"sequential/lstm_1/lstm_cell"``; a name without "/" is its own layer.
    """
    name = variable_name.split(":")[0]
    return name.rsplit("/", 1)[0] if "/" in name else name


# Rule a: a group is closed once the hidden part of its transfer is this many times the
# message latency alpha (start-up at most 1/5 of its cost). Lower: more, earlier messages
# (more overlap, more start-ups); higher: fewer, later ones.
MIN_GROUP_COST_FACTOR = 4


def _cut_when_bandwidth_bound(order, sizes, cost_model, threshold, layers=None):
    """Cuts `order` (tensor indices in backprop order) into contiguous groups by
    rules a-e of the module docstring. `sizes[i]`: tensor i's bytes;
    `layers[i]`: its layer (None: every tensor is a layer of its own);
    `threshold`: the byte bound."""
    # Rule a's bound in bytes: sending a group early hides overlap * beta * bytes and costs
    # one start-up. With no overlap nothing is worth an early message (only rules c-d cut).
    hidden_share = cost_model.overlap
    enough = MIN_GROUP_COST_FACTOR * cost_model.break_even_bytes / hidden_share if hidden_share > 0 else float("inf")
    order = list(order)
    groups, current, current_bytes = [], [], 0
    for k, i in enumerate(order):
        # Rule d: a tensor over the byte bound takes the latency-bound group before it along.
        takes_current_along = sizes[i] > threshold and current_bytes < enough
        if current and current_bytes + sizes[i] > threshold and not takes_current_along:
            groups.append(current)  # rule c
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += sizes[i]
        layer_ends = layers is None or k + 1 == len(order) or layers[order[k + 1]] != layers[i]
        if current_bytes >= enough and layer_ends:
            groups.append(current)  # rules a and b
            current, current_bytes = [], 0
    if current:
        # Rule e: the remainder is latency-bound (a bandwidth-bound one was closed above) and
        # ready only when backprop is over: one more start-up on the critical path.
        if groups and sum(sizes[i] for i in groups[-1]) + current_bytes <= threshold:
            groups[-1].extend(current)
        else:
            groups.append(current)
    return groups


def _equal_bytes(order, sizes, num_groups):
    total = sum(sizes[i] for i in order)
    groups, current, acc = [], [], 0
    for i in order:
        current.append(i)
        acc += sizes[i]
        if acc >= total * (len(groups) + 1) / num_groups and len(groups) < num_groups - 1:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


def make_plan(grads, variables, threshold_bytes=None, num_groups=0, groups=None, cost_model=None, name=""):
    """Builds the grouping plan for `grads` (dense tensors) of `variables`.

    Args:
      grads: gradient tensors (symbolic inside tf.function, or eager).
      variables: the matching variables (for names and explicit groups).
      threshold_bytes: largest group; default TF_MPI_GROUP_BYTES or 4 MiB.
      num_groups: if > 0, that many contiguous groups of about equal bytes.
      groups: explicit lists of variables; variables in no list form one last group.
      cost_model: a CostModel; default: measured once (collective).
      name: prefix of the groups' collective names (``Plan.collective_name``).

    Example::

        grads = tape.gradient(loss, model.trainable_variables)
        plan = tf_mpi.grouping.make_plan(grads, model.trainable_variables, threshold_bytes=1 << 20)
        print(plan.describe())
    """
    sizes = [_nbytes(g, v) for g, v in zip(grads, variables)]
    names = [getattr(v, "path", None) or getattr(v, "name", str(i)) for i, v in enumerate(variables)]
    layers = [layer_of(name) for name in names]
    order = production_order(grads)
    model = None
    if groups:
        position = {id(v): k for k, group in enumerate(groups) for v in group}
        buckets = [[] for _ in range(len(groups) + 1)]
        for i in order:
            buckets[position.get(id(variables[i]), len(groups))].append(i)
        index_groups = [b for b in buckets if b]
        source, threshold = "explicit groups", 0
    elif num_groups and num_groups > 0:
        index_groups = _equal_bytes(order, sizes, num_groups)
        source, threshold = f"num_groups={num_groups}", 0
    else:
        threshold = int(threshold_bytes or os.environ.get("TF_MPI_GROUP_BYTES", DEFAULT_GROUP_BYTES))
        model = cost_model or measure_cost_model()
        index_groups = _cut_when_bandwidth_bound(order, sizes, model, threshold, layers)
        source = "backprop order, cut at layer ends when bandwidth-bound (alpha-beta), byte bound"
    plan = Plan([Group(g, [names[i] for i in g], sum(sizes[i] for i in g)) for g in index_groups],
                order, source, threshold, model, name=name)
    signature = repr([(g.names, g.nbytes) for g in plan.groups]).encode()
    plan.fingerprint = hashlib.sha256(signature).hexdigest()
    return plan


def measurements():
    """This process's cached measurements: (cost model or None, {plan name: agreed fingerprint}).

    Example: ``model, fingerprints = tf_mpi.grouping.measurements()``
    """
    return _cost_model, dict(agreed_fingerprints)


def adopt_measurements(cost_model, fingerprints, joining):
    """Takes rank 0's ``measurements()`` (tf_mpi.elastic, after the ranks changed): its cost model,
    and, on a rank that just joined a running job (``joining``), its plan fingerprints, each checked
    locally the first time this rank builds that plan instead of collectively.

    Example: ``adopt_measurements(*broadcast_object(measurements()), joining=membership.spawned())``
    """
    global _cost_model
    _cost_model = cost_model
    if joining and not agreed_fingerprints:
        inherited_fingerprints.update(fingerprints)


def verify_same_plan_everywhere(plan, name, process_set_id=0):
    """Raises ValueError on every rank (of the process set) if the ranks derived different plans (collective).

    Example: ``verify_same_plan_everywhere(plan, "my_loop")`` (on every rank, with the same name)
    """
    from tf_mpi.basics import _core, Min, Max
    h = np.array([int(plan.fingerprint[:15], 16)], np.int64)
    if name in inherited_fingerprints:
        # A rank that joined a running job (elastic): the others verified this plan before it
        # came and will not trace it again, so it checks against rank 0's fingerprint alone, once.
        if inherited_fingerprints.pop(name) != int(h[0]):
            raise ValueError(
                f"tf_mpi: this rank derived a gradient grouping plan for '{name}' that differs from rank 0's. "
                "Every rank must build the same model and optimizer. This rank's plan:\n" + plan.describe())
        return
    lo = _core.allreduce(h, Min, f"tfmpi.plancheck.{name}.min", 1.0, 1.0, process_set_id)
    hi = _core.allreduce(h, Max, f"tfmpi.plancheck.{name}.max", 1.0, 1.0, process_set_id)
    if lo[0] != hi[0]:
        raise ValueError(
            f"tf_mpi: ranks derived different gradient grouping plans for '{name}' (plan hashes differ). "
            "Every rank must build the same model and optimizer. This rank's plan:\n" + plan.describe())
    agreed_fingerprints[name] = int(h[0])
