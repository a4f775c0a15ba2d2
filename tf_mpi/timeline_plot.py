"""``tf_mpi.timeline_plot`` and ``python -m tf_mpi.timeline_plot``: the code lives in tf_mpi/tools/timeline_plot.py."""
import sys

from tf_mpi.tools import timeline_plot as _tool

if __name__ == "__main__":
    sys.exit(_tool.main())
# One module under both names: ``import tf_mpi.timeline_plot`` gives tf_mpi.tools.timeline_plot itself.
sys.modules[__name__] = _tool
