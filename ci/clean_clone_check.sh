#!/usr/bin/env bash
# Runs .ci/run from a fresh clone of the committed tree, the way CI does, so
# that anything missing from git (or left over locally) shows up.
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-/tmp/tf_mpi-ci-check}"
rm -rf "$dest"
git clone -q "$src" "$dest"
cd "$dest"
time bash .ci/run
