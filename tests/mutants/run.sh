#!/usr/bin/env bash
# Planted bugs: each NAME.patch breaks one claim of the README; its first line names the test
# that must then fail. For every patch (or those named: run.sh NAME ...), this copies the
# working tree to a temporary folder, applies the patch there, runs that test, and prints
#   caught             the test failed on an assertion (or a pytest.raises that saw nothing raised)
#   caught (error)     it failed, but not on an assertion of the test (a fixture's run crashed)
#   caught (time-out)  it failed by running out of time: make it fail faster
#   SURVIVED           it passed: the claim is not guarded
#   NO TEST            pytest found no such test (a renamed test: update the patch's first line)
#   STALE              the patch no longer applies: update it to the moved code
# Only "caught" counts. Not part of CI (tests/test_units.py checks that every patch still
# applies and names a test); it takes about 40 minutes on 2 cores.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
names=("$@")
[ ${#names[@]} -gt 0 ] || names=($(cd "$here" && ls *.patch | sed 's/\.patch$//'))
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
caught=0 failed=0 start=$SECONDS
for name in "${names[@]}"; do
    patch="$here/$name.patch"
    test_id="$(sed -n 's/^# test: //p' "$patch" | head -n 1)"
    copy="$work/$name"
    mkdir -p "$copy"
    (cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$copy" 2>/dev/null)
    began=$SECONDS
    if ! (cd "$copy" && git apply "$patch" 2>/dev/null); then
        verdict="STALE"
    else
        (cd "$copy" && timeout 900 "$python" -m pytest -q -x -p no:cacheprovider "$test_id") >"$work/$name.log" 2>&1
        status=$?
        if [ $status -eq 0 ]; then
            verdict="SURVIVED"
        elif grep -q "TimeoutExpired" "$work/$name.log" || [ $status -eq 124 ]; then
            verdict="caught (time-out)"
        elif [ $status -ne 1 ]; then
            verdict="NO TEST"
        elif grep -q "^E  *AssertionError\|^E  *assert \|^E  *Failed: DID NOT RAISE" "$work/$name.log" \
                && ! grep -q "ERROR at setup" "$work/$name.log"; then
            verdict="caught"
        else
            verdict="caught (error)"
        fi
    fi
    case "$verdict" in caught) caught=$((caught + 1)) ;; *) failed=$((failed + 1)) ;; esac
    printf '%-32s %-18s %4ds  %s\n' "$name" "$verdict" $((SECONDS - began)) "$test_id"
    [ "$verdict" = "caught" ] || tail -n 5 "$work/$name.log" 2>/dev/null | sed 's/^/    /'
    rm -rf "$copy"
done
echo "$caught of ${#names[@]} mutants caught in $((SECONDS - start)) s"
[ $failed -eq 0 ]
