#!/bin/sh
# Checks the library's objects (usage: check_layering.sh OBJ...):
#  - no dependency loop between source files (a file calls into another only if that one never calls back,
#    directly or through others), so each concept can be read and changed on its own;
#  - every exported symbol is public API (pdpair_*, declared in include/pdpair/transport.h) or internal (pdpi_*).
set -eu
header="$(dirname "$0")/../include/pdpair/transport.h"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for o in "$@"; do
    f=$(basename "$o" .o)
    nm -g --defined-only "$o" | awk -v f="$f" 'NF == 3 {print $3, f}' >>"$tmp/defs"
    nm -u "$o" | awk -v f="$f" '{print $NF, f}' >>"$tmp/uses"
done
# "user definer" pairs, one per call across files; tsort fails on a loop and names it.
sort -k1,1 "$tmp/uses" >"$tmp/uses.s"
sort -k1,1 "$tmp/defs" >"$tmp/defs.s"
join "$tmp/uses.s" "$tmp/defs.s" | awk '$2 != $3 {print $2, $3}' | sort -u >"$tmp/edges"
calls=$(wc -l <"$tmp/edges")
for o in "$@"; do f=$(basename "$o" .o); echo "$f $f" >>"$tmp/edges"; done # files that call no other
if ! tsort "$tmp/edges" >/dev/null 2>"$tmp/loop"; then
    echo "check_layering: dependency loop between source files:" >&2
    cat "$tmp/loop" >&2
    exit 1
fi
bad=0
for s in $(cut -d' ' -f1 "$tmp/defs"); do
    case "$s" in
    pdpi_*) ;;
    pdpair_*) grep -q "\\b$s(" "$header" || { echo "check_layering: $s is exported but not in transport.h" >&2; bad=1; } ;;
    *) echo "check_layering: $s is exported without the pdpair_/pdpi_ prefix" >&2; bad=1 ;;
    esac
done
[ "$bad" = 0 ] || exit 1
echo "layering: $# files, $calls file-to-file dependencies, no loop; $(wc -l <"$tmp/defs") exported symbols, all prefixed"
