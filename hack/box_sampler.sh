#!/usr/bin/env bash
# Once a second, how this box is doing: MemAvailable and Shmem (MiB), then per-second deltas of major faults,
# refaulted file pages, direct-reclaim steals and allocation stalls, then the 10 s averages of memory "some" and
# io "full" pressure. Run it beside a test run (`bash hack/box_sampler.sh > /tmp/box.log &`) to see whether the
# box stalled; the numbers in tests/README and the session notes came from it.
set -u
prev=""
while true; do
  now=$(date +%H:%M:%S)
  avail=$(awk '/^MemAvailable:/{print int($2/1024)}' /proc/meminfo)
  shmem=$(awk '/^Shmem:/{print int($2/1024)}' /proc/meminfo)
  counters=$(awk '/^pgmajfault /{a=$2}/^workingset_refault_file /{b=$2}/^pgsteal_direct /{c=$2}/^allocstall_movable /{d=$2}END{print a,b,c,d}' /proc/vmstat)
  psi_mem=$(awk '/^some/{split($2,a,"="); print a[2]}' /proc/pressure/memory)
  psi_io=$(awk '/^full/{split($2,a,"="); print a[2]}' /proc/pressure/io)
  if [ -n "$prev" ]; then
    read -r mf rf sd as <<<"$counters"
    read -r pmf prf psd pas <<<"$prev"
    echo "$now avail=$avail shmem=$shmem majf=$((mf-pmf)) refault=$((rf-prf)) steal_direct=$((sd-psd))" \
         "allocstall=$((as-pas)) psi_mem=$psi_mem psi_io_full=$psi_io"
  fi
  prev=$counters
  sleep 1
done
