"""``tf_mpi.timeline_analysis`` and ``python -m tf_mpi.timeline_analysis``: the code lives in tf_mpi/tools/timeline_analysis.py."""
import sys

from tf_mpi.tools import timeline_analysis as _tool

if __name__ == "__main__":
    sys.exit(_tool.main())
# One module under both names: ``import tf_mpi.timeline_analysis`` gives tf_mpi.tools.timeline_analysis itself.
sys.modules[__name__] = _tool
