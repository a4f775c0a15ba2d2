#!/bin/sh
# ssh stand-in for Open MPI on the pretend hosts of tests/cluster.py.
# Called as `cluster_agent.sh [ssh options] HOST COMMAND...`, like ssh; runs
# COMMAND with a shell inside HOST's network namespace, under HOST's hostname,
# on HOST's CPU share (TF_MPI_CLUSTER_CPUS_<host>, set by Cluster.env), as sshd
# would on a real host. Options with a value (-o X, -p N, ...) are skipped.
# With TF_MPI_CLUSTER_CLEAN_ENV=1 (Cluster.env(clean_remote_env=True)) COMMAND
# starts from a login's environment, not the launcher's: sshd passes nothing
# on, so a variable the ranks need must travel with `mpirun -x NAME`, as on a
# real cluster. TMPDIR is the exception: the pretend hosts share this machine's
# file system, and what their processes write to a temporary file goes under
# the launcher's TMPDIR (the test session's folder, removed at its end), as it
# would go to that host's own /tmp on a real cluster.
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F|-E|-b|-c|-m|-J) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
cpus=$(printenv "TF_MPI_CLUSTER_CPUS_$(echo "$host" | tr - _)")
clean=""
if [ "${TF_MPI_CLUSTER_CLEAN_ENV:-0}" = 1 ]; then
  clean="env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=${HOME:-/root}
    USER=$(id -un) LOGNAME=$(id -un) SHELL=/bin/sh ${TMPDIR:+TMPDIR=$TMPDIR}"
fi
exec $clean ip netns exec "$host" unshare --uts taskset -c "${cpus:-0-1023}" \
  sh -c "hostname $host && exec sh -c \"\$0\"" "$*"
