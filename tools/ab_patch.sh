#!/usr/bin/env bash
# A/B of patches in one GPU call: for each patch, copies this tree (the working tree, not
# git; without build/ and exp/) to its own directory (AB_DIR, default /tmp/ab_patched,
# then AB_DIR2, AB_DIR3, ... for a second and third patch), applies the patch there, and
# runs tools/ab_trees.sh with those copies as the other trees: all built side by side,
# each command line run ROUNDS times in every tree, taking turns (docs/decisions/0013-
# power-limit-timing). A variant that lost is kept as a commit that a decision file
# cites; this A/B-tests it again: git show COMMIT > variant.patch.
#
#   tools/ab_patch.sh PATCH[,PATCH2,...] ROUNDS 'command line' ['command line' ...]
#
# Logs and the printed summary: as tools/ab_trees.sh ("this" is the tree, "other" the
# first patched copy, "other2" the second, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
    sed -n '2,13p' "$0" >&2
    exit 2
fi
IFS=, read -ra patches <<< "$1"
AB_DIR=${AB_DIR:-/tmp/ab_patched}
copies=()
for ((k = 0; k < ${#patches[@]}; ++k)); do
    patch_file=$(realpath "${patches[$k]}") || exit 1
    dir=$AB_DIR$([ "$k" -gt 0 ] && echo $((k + 1)))
    rm -rf "$dir" && mkdir -p "$dir" || exit 1
    tar cf - --exclude=./build --exclude=./exp . | tar xf - -C "$dir" || exit 1
    # git apply works outside a repository; patch(1) where git is missing
    (cd "$dir" && if command -v git >/dev/null; then git apply "$patch_file"
                  else patch -s -p1 < "$patch_file"; fi) ||
        { echo "ab_patch: ${patches[$k]} does not apply" >&2; exit 1; }
    copies+=("$dir")
done
shift
exec tools/ab_trees.sh "$(IFS=,; echo "${copies[*]}")" "$@"
