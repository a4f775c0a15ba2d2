"""``tf_mpi.grouping``, a module of the public API: the code lives in tf_mpi/policy/grouping.py."""
import sys

from tf_mpi.policy import grouping as _grouping

# One module under both names: ``import tf_mpi.grouping`` gives tf_mpi.policy.grouping itself.
sys.modules[__name__] = _grouping
