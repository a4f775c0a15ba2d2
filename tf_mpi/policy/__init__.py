"""How gradients are reduced across ranks: the grouping plan and its cost model, the order of
backprop, sparse gradients, compression, and the reducer that the optimizers and the gradient tape
share. Built on the runtime and the collectives (tf_mpi.basics, tf_mpi.ops); see tf_mpi/README.md."""
