"""End-to-end training benchmark: tf_mpi against one process and MultiWorkerMirroredStrategy.

The command line of the package benchmarks/training_bench/ (its docstring says what it
measures and how to run it; ``python benchmarks/training_bench.py --help`` lists the options).
Every launch the driver starts runs this same script in its worker role.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: training_bench, bench_models

from training_bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main()
