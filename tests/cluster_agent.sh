#!/bin/sh
# ssh stand-in for Open MPI on the pretend hosts of tests/cluster.py.
# Called as `cluster_agent.sh [ssh options] HOST COMMAND...`, like ssh; runs
# COMMAND with a shell inside HOST's network namespace, under HOST's hostname,
# on HOST's CPU share (TF_MPI_CLUSTER_CPUS_<host>, set by Cluster.env), as sshd
# would on a real host. Options with a value (-o X, -p N, ...) are skipped.
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F|-E|-b|-c|-m|-J) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
cpus=$(printenv "TF_MPI_CLUSTER_CPUS_$(echo "$host" | tr - _)")
exec ip netns exec "$host" unshare --uts taskset -c "${cpus:-0-1023}" \
  sh -c "hostname $host && exec sh -c \"\$0\"" "$*"
