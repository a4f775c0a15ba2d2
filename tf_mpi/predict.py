"""``tf_mpi.predict`` and ``python -m tf_mpi.predict``: the code lives in tf_mpi/tools/predict.py."""
import sys

from tf_mpi.tools import predict as _tool

if __name__ == "__main__":
    sys.exit(_tool.main())
# One module under both names: ``import tf_mpi.predict`` gives tf_mpi.tools.predict itself.
sys.modules[__name__] = _tool
