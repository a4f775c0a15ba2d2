"""Horovod's ways that tf_mpi supports only because Horovod scripts use them: the
DistributedOptimizer for TF1 optimizers (legacy_optimizer). See tf_mpi/README.md."""
