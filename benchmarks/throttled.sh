#!/usr/bin/env bash
# Run a command on a slow loopback, so that communication/compute overlap can be seen on a CPU machine.
#
#   benchmarks/throttled.sh [--rate 1gbit] [--burst 256kb] [--latency 200ms] -- COMMAND [ARG...]
#
# On the raw loopback, gloo's transfers are memory copies that compete with compute for the same cores, so
# nothing can hide behind anything. This runs COMMAND in a private network namespace (unshare --net) whose
# loopback is rate-limited by a token bucket filter (tc tbf): traffic on 127.0.0.1 then waits on a "wire"
# while the cores compute. All processes of COMMAND (torchrun and its ranks) share the one throttled link,
# so RATE is the total over all ranks. The namespace, and the limit, end with COMMAND; the host's network
# is never touched. COMMAND runs in the current directory with the current environment.
#
# Needs root (creating a network namespace and a qdisc), unshare (util-linux) and ip and tc (iproute2).
# Example, from the repository root:
#   benchmarks/throttled.sh --rate 1gbit -- python -m torch.distributed.run --standalone --nproc-per-node 2 \
#       benchmarks/domino_block.py
set -euo pipefail

usage() {
  echo "usage: $0 [--rate RATE] [--burst SIZE] [--latency TIME] -- COMMAND [ARG...]" >&2
  echo "  RATE as tc writes it (1gbit, 500mbit; default 1gbit), SIZE the bucket (default 256kb)," >&2
  echo "  TIME the longest a packet may queue (default 200ms)" >&2
  exit 2
}
fail() {
  echo "$(basename "$0"): $1" >&2
  echo "Fix: $2" >&2
  exit 2
}

rate=1gbit
burst=256kb
latency=200ms
while [ $# -gt 0 ]; do
  case "$1" in
    --rate | --burst | --latency)
      [ $# -ge 2 ] || usage
      declare "${1#--}=$2"
      shift 2 ;;
    --) shift; break ;;
    -h | --help) usage ;;
    -*) echo "unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || usage

[ "$(id -u)" -eq 0 ] || fail "needs root to create a network namespace and throttle its loopback" \
  "run it as root (sudo -E $0 ...), or run the benchmark unthrottled (benchmarks/domino.py --rates none)"
for tool in unshare:util-linux ip:iproute2 tc:iproute2; do
  command -v "${tool%%:*}" >/dev/null || fail "'${tool%%:*}' not found" \
    "install ${tool#*:} (Debian/Ubuntu: apt-get install -y ${tool#*:})"
done

# Inside the namespace: bring the loopback up, put the token bucket on it, then become COMMAND.
inside='
  rate=$1 burst=$2 latency=$3; shift 3
  ip link set dev lo up
  if ! error=$(tc qdisc add dev lo root tbf rate "$rate" burst "$burst" latency "$latency" 2>&1); then
    echo "throttled.sh: tc could not throttle the loopback to --rate $rate --burst $burst --latency $latency: $error" >&2
    echo "Fix: write sizes as tc does (1gbit, 500mbit, 256kb, 200ms); the kernel needs the sch_tbf qdisc" >&2
    exit 2
  fi
  exec "$@"'
exec unshare --net -- bash -c "$inside" throttled.sh "$rate" "$burst" "$latency" "$@"
