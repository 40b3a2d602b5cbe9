#!/usr/bin/env bash
# Tessera end to end on its embedded default: a local control plane (real
# etcd, kube-apiserver, scheduler, controller-manager, and a kubelet running
# real containers through containerd + runc) and a node with simulated GPUs
# (the fake libnvidia-ml.so.1 driven by a topology file), on which
# `conformance/cluster.sh node-start` runs Tessera's one node process
# (`tessera plugin`). It publishes the node's GPUs, the real scheduler
# allocates the example claims in deploy/examples, the real kubelet asks it
# to prepare them, containerd starts the pods with the CDI edits, and the
# result is printed: which physical GPU each claim got, with which limits,
# what each pod's own nvidia-smi sees, the CDI spec the runtime read, and the
# simulated machine as another process (`tessera inventory`) sees it.
#
# usage: conformance/demo.sh [--keep]
# env:   TESSERA_DEMO_TOPOLOGY   topology file (default: 8x H100 80GB, MIG off)
#        TESSERA_CLUSTER_DIR     state directory (default: .tessera/demo)
#   --keep leaves the cluster and Tessera running after a successful run;
#   stop them with `conformance/demo.sh --stop` (or conformance/cluster.sh
#   stop). A failure stops everything the demo started.
# First it installs what the machine lacks from Debian (runc, the CNI
# plugins, busybox-static, ...: conformance/cluster/prereqs.sh, as root) and
# stops at once, naming the fix, for what it cannot install (Go, Rust).
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
export TESSERA_CLUSTER_DIR="${TESSERA_CLUSTER_DIR:-$REPO_ROOT/.tessera/demo}"
TOPOLOGY="${TESSERA_DEMO_TOPOLOGY:-$REPO_ROOT/driver/fake-nvml/topologies/h100x8.yaml}"
TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
CLUSTER="$REPO_ROOT/conformance/cluster.sh"
PREREQS="$REPO_ROOT/conformance/cluster/prereqs.sh"

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
fail() {
	echo "demo: $*" >&2
	exit 1
}

if [[ "${1:-}" == --stop ]]; then
	exec "$CLUSTER" stop # stops Tessera's node process too
fi
KEEP=0
[[ "${1:-}" == --keep ]] && KEEP=1

say "checking what the demo needs (conformance/cluster/prereqs.sh)"
# Before any build, so that a missing piece is named in seconds, not minutes.
"$PREREQS" ensure --for "$0" go rust cluster node
echo "all there"

say "building Tessera and the simulated GPU library"
cargo build -p tessera-driver -p tessera-fake-nvml -p tessera-fake-cuda -p tessera-test-kit
TESSERA="$TARGET_DIR/debug/tessera"

# From the start of the cluster on, every way out passes here: a failure
# (in cluster.sh start too, which may leave etcd running) or an interrupt
# stops what was started; a success stops it unless --keep.
STARTED=0
cleanup() {
	local rc=$?
	trap - EXIT INT TERM
	((STARTED)) || exit "$rc"
	if ((rc != 0)); then
		if [[ -n "${TESSERA_NODE_LOG:-}" ]]; then
			echo "demo failed; last lines of Tessera's log ($TESSERA_NODE_LOG):" >&2
			tail -n 30 "$TESSERA_NODE_LOG" >&2 || true
		fi
		echo "demo $( ((rc == 130 || rc == 143)) && echo interrupted || echo failed) (exit $rc);" \
			"stopping what it started (logs stay in $TESSERA_CLUSTER_DIR/logs)" >&2
		"$CLUSTER" stop || true
	elif ((KEEP)); then
		echo "left running; Tessera's log: ${TESSERA_NODE_LOG:-$TESSERA_CLUSTER_DIR/node/tessera.log};" \
			"stop with: conformance/demo.sh --stop"
	else
		"$CLUSTER" stop || rc=1
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

say "starting a fresh local control plane in $TESSERA_CLUSTER_DIR"
"$CLUSTER" stop >/dev/null 2>&1 || true
rm -rf "$TESSERA_CLUSTER_DIR"
STARTED=1
"$CLUSTER" start

say "starting Tessera's node process on the kubelet's node (simulated GPUs: $(basename "$TOPOLOGY"))"
# tessera plugin registers with the kubelet and publishes the node's slices;
# node-start waits for both. See docs/development.md for the node's layout.
"$CLUSTER" node-start --topology "$TOPOLOGY"
# This shell now sees the same simulated machine as the node process.
eval "$("$CLUSTER" env)"

say "what this node has (tessera inventory)"
"$TESSERA" inventory --output yaml | sed -n '1,40p'
echo "..."

# One line per GPU and per MIG device, from `tessera inventory` in this shell.
gpus() {
	"$TESSERA" inventory --output yaml | awk '
		/^- uuid: /        { gpu = $3 }
		/^  minor: /       { printf "GPU %s  /dev/nvidia%s\n", gpu, $2 }
		/^    mode: /      { printf "    MIG %s\n", $2 }
		/^    - uuid: MIG-/ { mig = $3 }
		/^      profile: / { if (mig != "") printf "    MIG device %s  %s\n", mig, $2; mig = "" }'
}

kubectl apply -f deploy/deviceclasses.yaml
say "published ResourceSlices (by tessera plugin)"
kubectl get resourceslices -o wide

pods=(whole-gpu isolated-a isolated-b shared limits-gpu)
examples=(-f deploy/examples/whole-gpu.yaml -f deploy/examples/isolated-share.yaml -f deploy/examples/shared-share.yaml
	-f deploy/examples/extended-resource.yaml)
what="whole GPU, two Isolated shares, one Shared share, a whole GPU asked as resources.limits tessera.dev/gpu"
# A MIG device where the node offers one (dynamic MIG: prepare creates it).
profiles=$(kubectl get resourceslices --field-selector "spec.nodeName=$TESSERA_NODE_NAME" \
	-o 'jsonpath={.items[*].spec.devices[*].attributes.profile.string}')
if grep -qw '1g\.10gb' <<<"$profiles"; then
	pods+=(mig)
	examples+=(-f deploy/examples/mig.yaml)
	what+=", one 1g.10gb MIG device"
fi
say "example claims (deploy/examples): $what"
kubectl apply "${examples[@]}"
kubectl wait --for=condition=Ready "${pods[@]/#/pod/}" --timeout=180s

say "which GPU each claim got (status.devices written by the plugin after prepare)"
kubectl get resourceclaims -o \
	'custom-columns=CLAIM:.metadata.name,DEVICE:.status.allocation.devices.results[*].device,DATA:.status.devices[*].data'

say "what each pod sees: its own nvidia-smi (kubectl logs)"
for pod in "${pods[@]}"; do
	# A Pod asking resources.limits has the claim the scheduler made for it.
	claim=$(kubectl get pod "$pod" -o 'jsonpath={.status.resourceClaimStatuses[0].resourceClaimName}{.status.extendedResourceClaimStatus.resourceClaimName}')
	want=$(kubectl get resourceclaim "$claim" -o 'jsonpath={.status.devices[0].data.migUUID}')
	[[ -n "$want" ]] || want=$(kubectl get resourceclaim "$claim" -o 'jsonpath={.status.devices[0].data.gpuUUID}')
	out=$(kubectl logs "$pod")
	echo "--- pod $pod (claim $claim: $want)"
	echo "$out"
	grep -q "UUID: $want)" <<<"$out" || fail "pod $pod does not see $want, the device its claim got"
	# nvidia-smi -L lists a MIG device under its parent GPU.
	expected=1
	[[ "$want" == MIG-* ]] && expected=2
	(($(grep -c 'UUID: ' <<<"$out") == expected)) || fail "pod $pod sees more than the device its claim got"
done

say "CDI specs the container runtime read"
for f in "$TESSERA_NODE_CDI_DIR"/*.json; do
	echo "--- $(basename "$f")"
	cat "$f"
	echo
done

say "the machine as another process sees it (tessera inventory in this shell)"
machine=$(gpus)
echo "$machine"
mig_uuids=$(kubectl get resourceclaims -o 'jsonpath={.items[*].status.devices[*].data.migUUID}')
for u in $mig_uuids; do
	grep -q "MIG device $u " <<<"$machine" || fail "MIG device $u (prepared for a claim) is not in tessera inventory"
	echo "MIG device $u: created by prepare, seen by this shell's tessera inventory"
done

say "deleting the pods: the kubelet unprepares the claims"
kubectl delete pod "${pods[@]}" --wait=true --timeout=120s
deadline=$((SECONDS + 60))
until ! compgen -G "$TESSERA_NODE_CDI_DIR/*.json" >/dev/null; do
	((SECONDS < deadline)) || fail "CDI specs still present after 60s"
	sleep 1
done
echo "all CDI specs removed"
machine=$(gpus)
for u in $mig_uuids; do
	if grep -q "MIG device $u " <<<"$machine"; then fail "MIG device $u still exists after unprepare"; fi
	echo "MIG device $u destroyed by unprepare (tessera inventory in this shell)"
done
echo "$machine"
