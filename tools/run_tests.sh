#!/usr/bin/env bash
# Runs every test program given, then the Python tests, and sums their closing lines
# ("N passed, N failed, N skipped") into one. A program that crashes or exits non-zero
# without a closing line counts as one failure.
#   tools/run_tests.sh [--no-python | --python-only] PROGRAM...
# The Python tests load $MOEFUSE_LIB (default: build/libmoefuse.so; make passes the
# library of its build).
set -u
python=1
case "${1:-}" in
    --no-python) python=0; shift ;;
    --python-only) python=only; shift; set -- ;;
esac
passed=0 failed=0 skipped=0
tally() { # $1 = a closing line
    local p f s
    p=$(sed -nE 's/.*\b([0-9]+) passed.*/\1/p' <<<"$1"); f=$(sed -nE 's/.*\b([0-9]+) failed.*/\1/p' <<<"$1")
    s=$(sed -nE 's/.*\b([0-9]+) skipped.*/\1/p' <<<"$1")
    passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0})); skipped=$((skipped + ${s:-0}))
}
for bin in "$@"; do
    echo "== $bin"
    out=$("$bin" 2>&1); rc=$?
    printf '%s\n' "$out" | grep -vE '^ok ' 
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -1)
    if [ -z "$line" ]; then
        echo "FAIL $bin: exited $rc without a closing line"; failed=$((failed + 1))
    else
        tally "$line"
        if [ $rc -ne 0 ] && ! grep -qE ' [1-9][0-9]* failed' <<<"$line"; then
            echo "FAIL $bin: exited $rc"; failed=$((failed + 1))
        fi
    fi
done

if [ "$python" != 0 ] && [ -d python/tests ]; then
    echo "== python/tests"
    if python3 -c 'import torch, pytest' 2>/dev/null; then
        out=$(MOEFUSE_LIB="${MOEFUSE_LIB:-$PWD/build/libmoefuse.so}" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" \
              python3 -m pytest -q -rs python/tests 2>&1); rc=$?
        printf '%s\n' "$out" | tail -25
        line=$(printf '%s\n' "$out" | grep -E '[0-9]+ (passed|failed)' | tail -1)
        if [ -z "$line" ]; then echo "FAIL python/tests: pytest exited $rc"; failed=$((failed + 1));
        else tally "$line"; [ $rc -ne 0 ] && ! grep -q failed <<<"$line" && failed=$((failed + 1)); fi
    else
        echo "SKIP python/tests: torch or pytest is not installed (.ci/run installs them)"
        skipped=$((skipped + 1))
    fi
fi

echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
