"""Reduces a list of gradients across ranks following a grouping plan.

Shared by the Keras DistributedOptimizer and DistributedGradientTape, so both
group, compress and average the same way.
"""
import numbers
import os
import warnings

import tensorflow as tf

from tf_mpi import basics, ops, process_sets
from tf_mpi.policy import backprop_order, grouping, sparse as sparse_gradients
from tf_mpi.basics import Adasum, Average, Max, Min, Product, Sum
from tf_mpi.policy.compression import Compression
from tf_mpi.policy.variable_identity import variable_key

# Reductions a gradient reducer passes to the allreduce (Horovod's tape takes any op).
GRADIENT_OPS = (Average, Sum, Min, Max, Product, Adasum)
# The grouping plan's cost model for gradients reduced in a process set: fixed, identical on
# every rank, since the probe (tf_mpi.grouping.measure_cost_model) is a collective of all ranks.
PROCESS_SET_COST_MODEL = grouping.CostModel(alpha=50e-6, beta=1e-9, overlap=0.0)
# The attribute DistributedGradientTape sets on the gradients it returns (see mark_reduced).
_REDUCED_MARK = "_tfmpi_reduced"


def map_gradient(grad, fn):
    """fn applied to a gradient's values: a tensor, a tf.IndexedSlices (its rows) or None."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def check_groups(num_groups, groups, stacklevel=3):
    """Horovod's rules for ``num_groups`` / ``groups``; returns the effective ``groups``.

    ``num_groups != 0`` warns (DeprecationWarning: Horovod replaced it by
    ``groups``) and stands for ``groups`` when that is None; ``groups`` must be
    None, a list of lists of variables, or an integer > 0 (that many groups),
    else ValueError. `stacklevel` points the warning at the user's call.

    Example: ``check_groups(0, 4)`` is 4; ``check_groups(0, 0)`` raises ValueError
    """
    if num_groups != 0:
        warnings.warn("tf_mpi: `num_groups` is deprecated (as in Horovod, which replaced it by `groups`); "
                      "pass groups=<number of groups> instead", DeprecationWarning, stacklevel=stacklevel)
        if groups is None:
            groups = num_groups
    if groups is None or isinstance(groups, (list, tuple)):
        return groups
    if not isinstance(groups, numbers.Integral) or groups <= 0:
        raise ValueError(f"tf_mpi: groups must be a positive integer or a list of lists of variables; got {groups!r}")
    return int(groups)


def mark_reduced(grad):
    """Marks a gradient returned by DistributedGradientTape, so that a DistributedOptimizer given it
    does not reduce it again (Horovod's optimizer reduces only in compute_gradients, never in
    apply_gradients). The mark is an attribute of that tensor object: any new tensor computed from
    it (clipping, scaling, a copy) is unmarked."""
    if grad is not None:
        try:
            setattr(grad, _REDUCED_MARK, True)
        except AttributeError:  # a tensor type without instance attributes: stays unmarked
            pass
    return grad


def is_reduced(grad):
    """Whether `grad` is a gradient object returned by DistributedGradientTape (see mark_reduced)."""
    return grad is not None and getattr(grad, _REDUCED_MARK, False) is True


class GradientReducer:
    """Averages (or sums) gradients over ranks in groups that follow backprop order.

    Args:
      name: prefix of the collectives' names (must be equal on all ranks).
      op: Average, Sum, Min, Max or Product (passed to the allreduce; Min, Max and
        Product only with Horovod's sparse modes "allgather" / "dense" and without
        top-k compression, whose error feedback sums).
      compression: Compression.none, Compression.fp16, or Compression.topk(ratio) /
        Compression.gtopk(ratio) (sparsified with error feedback; IndexedSlices
        gradients are densified first).
      sparse_as_dense: densify IndexedSlices instead of allgathering them
        (Horovod's flag; the same as sparse="dense").
      sparse: how IndexedSlices gradients are reduced: "allgather", "dense",
        "dedup" or "auto" (tf_mpi.policy.sparse); None: "dense" with
        sparse_as_dense, else tf_mpi.policy.sparse.DEFAULT_MODE.
      gradient_predivide_factor: with op=Average, divide by this before the sum
        and by size/factor after it (splits the averaging to avoid overflow).
      num_groups, groups, threshold_bytes: see tf_mpi.grouping.make_plan; an integer
        ``groups`` is Horovod's number of groups (``num_groups``).
      order_backprop: make backprop finish each group's gradients before it
        starts on the layers below (tf_mpi.policy.backprop_order); None: the
        TF_MPI_ORDER_BACKPROP environment variable (default off).
      scale_local_gradients: gradients of variables registered with
        ``register_local`` are never reduced; if True (Horovod's default) they
        are divided by size(), like the averaged ones.
      device_dense / device_sparse: Horovod's placement of the collectives of
        dense / IndexedSlices gradients (``tf.device``; '' leaves them where
        TensorFlow puts them), passed to ``tf_mpi.allreduce``.
      process_set: reduce among the ranks of this registered tf_mpi.ProcessSet
        only (None: all ranks); Average and the local-gradient scaling then use
        its size. Its grouping plan uses a fixed cost model
        (PROCESS_SET_COST_MODEL: the start-up probe runs on all ranks), and it
        takes the sparse modes "allgather" / "dense" and no top-k.

    Example::

        reducer = GradientReducer("my_loop")
        grads = reducer.reduce(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    """

    def __init__(self, name, op=Average, compression=Compression.none, sparse_as_dense=False,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None, threshold_bytes=None,
                 order_backprop=None, scale_local_gradients=True, device_dense="", device_sparse="",
                 sparse=None, process_set=None):
        self.process_set = process_set
        self.set_id = basics._check_process_set(process_set, name)
        if op not in GRADIENT_OPS:
            raise ValueError(f"tf_mpi: gradients are reduced with op=Average, Sum, Min, Max, Product or Adasum; "
                             f"got {op!r}")
        if compression in (Compression.topk, Compression.gtopk):
            raise ValueError("tf_mpi: Compression.topk / Compression.gtopk take the ratio of entries to send, "
                             "e.g. compression=Compression.topk(0.01)")
        self.name, self.op, self.compression = name, op, compression
        self.sparse = sparse_gradients.resolve_mode(sparse, sparse_as_dense)
        self.sparse_as_dense = self.sparse == "dense"
        if self.set_id != 0:
            if self.sparse not in ("allgather", "dense"):
                raise NotImplementedError(f"tf_mpi: sparse={self.sparse!r} runs on the global process set only; "
                                          "use sparse='allgather' or 'dense' with process_set=")
            if getattr(compression, "sparsifies", False):
                raise NotImplementedError("tf_mpi: top-k compression runs on the global process set only")
        if op not in (Average, Sum):
            # tf_mpi's own sparse modes and top-k's error feedback are built on sums.
            if self.sparse not in ("allgather", "dense"):
                raise ValueError(f"tf_mpi: sparse={self.sparse!r} reduces with op=Average or op=Sum only")
            if getattr(compression, "sparsifies", False):
                raise ValueError("tf_mpi: top-k compression reduces with op=Average or op=Sum only")
        # As in Horovod's gradient reduction, the factor only splits an Average (other ops ignore it;
        # the public entry points that refuse it for op != Average say so themselves).
        self.gradient_predivide_factor = gradient_predivide_factor
        if isinstance(groups, numbers.Integral):  # Horovod's integer groups: that many groups
            num_groups, groups = int(groups), None
        self.num_groups, self.groups, self.threshold_bytes = num_groups, groups, threshold_bytes
        if order_backprop is None:
            order_backprop = os.environ.get("TF_MPI_ORDER_BACKPROP", "0") == "1"
        self.order_backprop = order_backprop
        self.plan = None
        self._verified = set()
        self.scale_local_gradients = scale_local_gradients
        self.device_dense, self.device_sparse = device_dense, device_sparse
        self._local = set()  # variable_key of worker-local variables
        self._residuals = {}  # variable_key -> error-feedback variable given by the optimizer

    def register_local(self, variable):
        """Marks `variable` as worker local: its gradient is not reduced (Horovod's model-parallel hook)."""
        self._local.add(variable_key(variable))

    def _size(self):
        return process_sets.set_size(self.set_id)

    def _scale_local(self, grad):
        if not self.scale_local_gradients:
            return grad
        n = ops.size_op(self.set_id)  # read at run time: elastic jobs change it
        return map_gradient(grad, lambda v: v / tf.cast(n, v.dtype))

    def _scaling(self):
        """(op, prescale, postscale) for the grouped allreduces."""
        f = self.gradient_predivide_factor
        if self.op == Average and f != 1.0:
            return Sum, 1.0 / f, f / self._size()
        return self.op, 1.0, 1.0

    def _reduce_sparse(self, grad, name):
        """One IndexedSlices gradient, by self.sparse: allgathered (Horovod) or by tf_mpi.policy.sparse."""
        if self.sparse == "allgather":
            return ops.allreduce(grad, op=self.op, name=name, compression=self.compression,
                                 device_sparse=self.device_sparse, process_set=self.process_set)
        op, prescale, postscale = self._scaling()
        scale = prescale * postscale / (basics.size() if op == Average else 1)

        def dense_allreduce(tensor, dense_name):
            return ops.allreduce(tensor, op=op, name=dense_name, prescale_factor=prescale,
                                 postscale_factor=postscale, compression=self.compression,
                                 device_dense=self.device_dense)

        with ops._on_device(self.device_sparse):
            return sparse_gradients.reduce_indexed_slices(grad, self.sparse, name, basics.size(), scale=scale,
                                                          dense_allreduce=dense_allreduce)

    def reduce(self, grads, variables, residuals=None):
        """Returns the reduced gradients, in the input order (None stays None).

        Gradients of registered local variables are not reduced (and divided
        by size() if scale_local_gradients). `residuals`: with top-k
        compression, the error-feedback variables of `variables` (in order);
        None: the compressor's own."""
        grads = list(grads)
        variables = list(variables)
        if residuals is not None:
            self._residuals = {variable_key(v): r for v, r in zip(variables, residuals)}
        if self._size() == 1:
            return grads
        if self._local:
            local = [i for i, v in enumerate(variables) if variable_key(v) in self._local]
            if local:
                mine = set(local)
                shared = [i for i in range(len(grads)) if i not in mine]
                out = list(grads)
                for i, r in zip(shared, self._reduce([grads[i] for i in shared], [variables[i] for i in shared])):
                    out[i] = r
                for i in local:
                    out[i] = self._scale_local(grads[i])
                return out
        return self._reduce(grads, variables)

    def _reduce(self, grads, variables):
        if getattr(self.compression, "sparsifies", False):
            return self._reduce_sparsified(grads, variables)
        out = list(grads)
        dense = []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                if self.sparse == "dense":
                    out[i] = g = tf.convert_to_tensor(g)
                else:
                    out[i] = self._reduce_sparse(g, f"{self.name}.sparse.{i}")
                    continue
            dense.append(i)
        if not dense:
            return out
        op, prescale, postscale = self._scaling()
        for collective_name, members in self._planned_groups(out, dense, variables):
            reduced = ops.grouped_allreduce([out[i] for i in members], op=op, name=collective_name,
                                            prescale_factor=prescale, postscale_factor=postscale,
                                            compression=self.compression, device_dense=self.device_dense,
                                            process_set=self.process_set)
            for i, r in zip(members, reduced):
                out[i] = r
        return out

    def _planned_groups(self, out, indices, variables):
        """The grouping plan of out[indices] (verified on every rank, and imposed on backprop with
        order_backprop): (collective name, indices into `out`) per group, in plan order."""
        plan = self._make_plan([out[i] for i in indices], [variables[i] for i in indices])
        if self.order_backprop:
            backprop_order.order_backprop([[out[indices[j]] for j in group.indices] for group in plan.groups])
        return [(plan.collective_name(k), [indices[j] for j in group.indices]) for k, group in enumerate(plan.groups)]

    def _make_plan(self, tensors, variables):
        plan = grouping.make_plan(tensors, variables, threshold_bytes=self.threshold_bytes,
                                  num_groups=self.num_groups, groups=self.groups, name=self.name,
                                  cost_model=PROCESS_SET_COST_MODEL if self.set_id != 0 else None)
        if plan.fingerprint not in self._verified:
            grouping.verify_same_plan_everywhere(plan, self.name, process_set_id=self.set_id)
            self._verified.add(plan.fingerprint)
        self.plan = plan
        return plan

    def _reduce_sparsified(self, grads, variables):
        """Top-k / gTop-k: each group of (densified) gradients goes to the compressor with its residuals."""
        out = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        present = [i for i, g in enumerate(out) if g is not None]
        if not present:
            return out
        op, prescale, postscale = self._scaling()
        for collective_name, members in self._planned_groups(out, present, variables):
            residuals = [self._residuals.get(variable_key(variables[i])) for i in members]
            residuals = [self.compression.residual_for(variables[i]) if r is None else r
                         for i, r in zip(members, residuals)]
            with ops._on_device(self.device_dense):
                reduced = self.compression.reduce([out[i] for i in members], residuals, op=op,
                                                  prescale_factor=prescale, postscale_factor=postscale,
                                                  name=collective_name)
            for i, r in zip(members, reduced):
                out[i] = r
        return out
