#!/usr/bin/env bash
# Compares the SASS of every kernel in two builds of the library, kernel by kernel:
#   tools/sass_compare.sh OLD/build/libmoefuse.a NEW/build/libmoefuse.a [-v]
# Kernel names are demangled with anonymous namespaces dropped (they carry a hash of the
# file's path), instruction addresses and object-file headers are stripped, so a file move
# or a rename of a .cu file leaves every kernel "identical". A kernel whose SASS is
# identical computes the same bits; `-v` prints the differing instructions. Needs
# cuobjdump (the CUDA toolkit's, or the one in triton's wheel) and c++filt.
# SASS_COMPARE_DROP=REGEX: removed from every demangled name first, for a change that
# renames kernels only (e.g. SASS_COMPARE_DROP='mf::sm90::Bf16, ' when TileConfig took
# the precision as a template argument).
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,8p' "$0" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dump() {
    cuobjdump -sass "$1" 2>/dev/null | grep -v '^\s*$' | sed -E 's#/\*[0-9a-f]{4}\*/##; s#^\s+##' |
        grep -v '^====\|^code for\|^\.target\|^member\|Fatbin\|arch = \|code version\|host = \|compile_size\|identifier'
}
dump "$1" > "$tmp/a.txt"
dump "$2" > "$tmp/b.txt"
python3 - "$tmp/a.txt" "$tmp/b.txt" "${3:-}" <<'PY'
import collections, os, re, subprocess, sys

drop = os.environ.get('SASS_COMPARE_DROP', '')

def kernels(path):
    out, cur = collections.OrderedDict(), None
    for line in open(path):
        m = re.match(r'Function : (\S+)', line)
        if m:
            name = subprocess.run(['c++filt', m.group(1)], capture_output=True, text=True).stdout.strip()
            cur = name.replace('(anonymous namespace)::', '')
            if drop: cur = re.sub(drop, '', cur)
            out[cur] = []
        elif cur:
            out[cur].append(line)
    return out

a, b = kernels(sys.argv[1]), kernels(sys.argv[2])
same = differ = 0
for k in sorted(set(a) | set(b)):
    if k not in a:
        print('NEW  ', k); differ += 1
    elif k not in b:
        print('GONE ', k); differ += 1
    elif a[k] != b[k]:
        print('DIFF ', k, len(a[k]), 'vs', len(b[k]), 'lines'); differ += 1
        if sys.argv[3] == '-v':
            for x, y in zip(a[k], b[k]):
                if x != y: print('   -', x.strip()); print('   +', y.strip())
    else:
        same += 1
print(f'{same} kernels identical, {differ} differ')
sys.exit(1 if differ else 0)
PY
