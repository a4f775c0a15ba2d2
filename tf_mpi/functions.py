"""Helpers built on the collectives: variables and Python objects."""
from tf_mpi.ops import grouped_broadcast


def broadcast_variables(variables, root_rank, name="tfmpi.broadcast_variables"):
    """Assigns root_rank's values to `variables` on every rank (one collective).

    Example::

        hvd.broadcast_variables(model.variables, root_rank=0)
    """
    variables = list(variables)
    if not variables:
        return
    values = grouped_broadcast(variables, root_rank, name=name)
    for v, value in zip(variables, values):
        v.assign(value)
