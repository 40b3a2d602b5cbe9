#!/usr/bin/env bash
# The GPU self-test: do Isolated shares hold on this node's GPUs against a
# hostile tenant? Run as root on one GPU node; needs no kubelet, no container
# runtime and no registry. It starts a local control plane (etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler on 127.0.0.1, with
# a Node object for this machine), `tessera plugin` over the node's
# libnvidia-ml with its sockets in a directory of its own, lets the real
# scheduler allocate two Isolated claims on one GPU, prepares them over the
# plugin's socket, probes what a CUDA process gets under each claim's CDI
# edits (also raising its environment, quitting its daemon), has the node's
# claim guard stop a process that leaves MPS and processes that together
# overfill their claim, asks (real GPUs) whether MPS clients need
# /dev/nvidia<N>, unprepares, prints a table and removes everything it made.
# It never changes MIG mode, compute mode or clocks. See docs/isolation.md.
# conformance/gpu-kit.sh packs all it needs for a machine without Go, Rust
# or network.
#
# usage: conformance/gpu-selftest.sh [--simulated TOPOLOGY] [-- TESSERA-SELFTEST FLAGS]
#   --simulated FILE  the simulated machine of a topology
#                     (driver/fake-nvml/topologies/) instead of real GPUs: how
#                     CI runs it
#   flags after --    passed to tessera-selftest (--nvml-library, --driver-root,
#                     --timeout, --isolated-class; see tessera-selftest --help)
# environment:
#   TESSERA_BIN_DIR   prebuilt tessera and tessera-selftest (and, simulated,
#                     the fakes) instead of building them with cargo
#   TESSERA_FAKES_DIR where the prebuilt fakes are (default: TESSERA_BIN_DIR)
#   TESSERA_PROFILE   cargo profile to build and use (default release)
#   TESSERA_KUBE_BIN  a prebuilt control plane binary (conformance/cluster.sh
#                     builds one from Kubernetes' Go modules otherwise)
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NODE=tessera-selftest-0

log() { printf '[gpu-selftest] %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 2
}

simulated=""
while (($#)); do
	case "$1" in
	--simulated)
		(($# > 1)) || die "--simulated needs a topology file"
		simulated=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
		[[ -f "$simulated" ]] || die "no topology file $2"
		shift 2
		;;
	--)
		shift
		break
		;;
	-h | --help)
		sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'
		exit 0
		;;
	*) die "unknown argument '$1' (usage: $0 [--simulated TOPOLOGY] [-- TESSERA-SELFTEST FLAGS])" ;;
	esac
done
((EUID == 0)) || die "run as root: the node process makes device nodes and MPS daemons, the probe a mount namespace"

profile=${TESSERA_PROFILE:-release}
if [[ -n "${TESSERA_BIN_DIR:-}" ]]; then
	bin=$TESSERA_BIN_DIR
else
	target=${CARGO_TARGET_DIR:-$REPO_ROOT/target}
	case "$target" in /*) ;; *) target="$REPO_ROOT/$target" ;; esac
	bin="$target/$profile"
	packages=(-p tessera-driver -p tessera-conformance)
	[[ -z "$simulated" ]] || packages+=(-p tessera-fake-nvml -p tessera-fake-cuda)
	log "building ${packages[*]} ($profile)"
	(cd "$REPO_ROOT" && cargo build --profile "$profile" "${packages[@]}" --bins --lib -q)
	if [[ "$profile" == dev ]]; then bin=${bin%/dev}/debug; fi
fi
fakes=${TESSERA_FAKES_DIR:-$bin}
for f in tessera tessera-selftest; do
	[[ -x "$bin/$f" ]] || die "missing $bin/$f (build it, or set TESSERA_BIN_DIR)"
done

# Short: MPS pipes are Unix sockets below it.
work=$(mktemp -d /tmp/tst.XXXXXX)
export TESSERA_CLUSTER_DIR="$work/cp"
cleanup() {
	local rc=$?
	"$REPO_ROOT/conformance/cluster.sh" stop >/dev/null 2>&1 || log "stopping the control plane failed (state in $TESSERA_CLUSTER_DIR)"
	if ((rc != 0)) && [[ -f "$work/node/plugin.log" ]]; then
		log "the end of tessera plugin's log:"
		tail -n 40 "$work/node/plugin.log" >&2 || true
	fi
	rm -rf "$work"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "starting a control plane without a kubelet in $TESSERA_CLUSTER_DIR"
TESSERA_KUBELET=0 "$REPO_ROOT/conformance/cluster.sh" start
TESSERA_FAKE_NODE_PREFIX=${NODE%0} "$REPO_ROOT/conformance/cluster.sh" add-nodes 1
"$TESSERA_CLUSTER_DIR/bin/kubectl" --kubeconfig "$TESSERA_CLUSTER_DIR/kubeconfig" \
	apply -f "$REPO_ROOT/deploy/deviceclasses.yaml" >/dev/null

args=(--kubeconfig "$TESSERA_CLUSTER_DIR/kubeconfig" --node "$NODE" --tessera "$bin/tessera" --work-dir "$work/node")
[[ -z "$simulated" ]] || args+=(--simulated "$simulated" --fakes "$fakes")
log "running tessera-selftest on node $NODE ($([[ -n "$simulated" ]] && echo "simulated: $(basename "$simulated")" || echo "real GPUs"))"
"$bin/tessera-selftest" "${args[@]}" "$@"
