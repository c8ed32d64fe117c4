#!/usr/bin/env bash
# A/B of a patch in one GPU call: copies this tree (the working tree, not git; without
# build/ and exp/) to AB_DIR (default /tmp/ab_patched), applies the patch there, and runs
# tools/ab_trees.sh with that copy as the other tree: both built side by side, each
# command line run ROUNDS times in both, taking turns (docs/decisions/0013-power-limit-
# timing). A variant that lost is kept as a commit that a decision file cites; this
# A/B-tests it again: git show COMMIT > variant.patch.
#
#   tools/ab_patch.sh PATCH ROUNDS 'command line' ['command line' ...]
#
# Logs and the printed summary: as tools/ab_trees.sh ("this" is the tree, "other" the
# patched copy).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
    sed -n '2,12p' "$0" >&2
    exit 2
fi
patch_file=$(realpath "$1")
AB_DIR=${AB_DIR:-/tmp/ab_patched}
rm -rf "$AB_DIR" && mkdir -p "$AB_DIR" || exit 1
tar cf - --exclude=./build --exclude=./exp . | tar xf - -C "$AB_DIR" || exit 1
# git apply works outside a repository; patch(1) where git is missing
(cd "$AB_DIR" && if command -v git >/dev/null; then git apply "$patch_file"
                 else patch -s -p1 < "$patch_file"; fi) ||
    { echo "ab_patch: $1 does not apply" >&2; exit 1; }
shift
exec tools/ab_trees.sh "$AB_DIR" "$@"
