#!/usr/bin/env bash
# sha256 of the project's source files (Python, shell, TOML; paths sorted, each path and its
# bytes hashed), without git: it names the tree a copied checkout ran, whatever its .git says.
#
#   bash bench/tree_digest.sh        (from anywhere; prints one hex digest)
set -euo pipefail
cd "$(dirname "$0")/.."
find aux_output kernels store sim bench tests pyproject.toml -type f \
    \( -name '*.py' -o -name '*.sh' -o -name '*.toml' \) -not -path '*/__pycache__/*' -print0 |
    LC_ALL=C sort -z |
    xargs -0 sha256sum |
    sha256sum |
    cut -c1-16
