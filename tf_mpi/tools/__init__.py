"""Command-line tools that read what training left behind or predict what it will cost: predict,
timeline_analysis, timeline_plot (run them as ``python -m tf_mpi.<tool>``). See tf_mpi/README.md."""
