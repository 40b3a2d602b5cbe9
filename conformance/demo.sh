#!/usr/bin/env bash
# Tessera end to end on its embedded default: a local control plane (real
# etcd, kube-apiserver, scheduler, controller-manager and a kubelet with a
# fake CRI) and a node with simulated GPUs (the fake libnvidia-ml.so.1 driven
# by a topology file). Tessera publishes the node's GPUs, the real scheduler
# allocates the example claims in deploy/examples, the real kubelet asks
# Tessera's plugin to prepare them, and the result is printed: which physical
# GPU each claim got, with which limits, and the CDI spec the runtime reads.
#
# usage: conformance/demo.sh [--keep]
# env:   TESSERA_DEMO_TOPOLOGY   topology file (default: 8x H100 80GB, MIG off)
#        TESSERA_CLUSTER_DIR     state directory (default: .tessera/demo)
#   --keep leaves the cluster and Tessera running; stop them with
#   `conformance/demo.sh --stop`.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
export TESSERA_CLUSTER_DIR="${TESSERA_CLUSTER_DIR:-$REPO_ROOT/.tessera/demo}"
TOPOLOGY="${TESSERA_DEMO_TOPOLOGY:-$REPO_ROOT/driver/fake-nvml/topologies/h100x8.yaml}"
TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
RUN="$TESSERA_CLUSTER_DIR/tessera"
CLUSTER="$REPO_ROOT/conformance/cluster.sh"

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

stop_tessera() {
	for name in plugin publish; do
		local pidfile="$RUN/$name.pid"
		if [[ -f "$pidfile" ]]; then
			local pid
			pid=$(cat "$pidfile")
			kill "$pid" 2>/dev/null || true
			# wait for exactly the process we started
			while kill -0 "$pid" 2>/dev/null; do wait "$pid" 2>/dev/null || sleep 0.2; done
			rm -f "$pidfile"
		fi
	done
}

if [[ "${1:-}" == --stop ]]; then
	stop_tessera
	"$CLUSTER" stop
	exit 0
fi
KEEP=0
[[ "${1:-}" == --keep ]] && KEEP=1

say "building Tessera and the simulated GPU library"
cargo build -p tessera-driver -p tessera-fake-nvml
TESSERA="$TARGET_DIR/debug/tessera"

say "starting a fresh local control plane in $TESSERA_CLUSTER_DIR"
stop_tessera
"$CLUSTER" stop >/dev/null 2>&1 || true
rm -rf "$TESSERA_CLUSTER_DIR"
"$CLUSTER" start
eval "$("$CLUSTER" env)"

cleanup() {
	if ((KEEP)); then
		echo "left running; logs in $RUN/*.log; stop with: conformance/demo.sh --stop"
	else
		stop_tessera
		"$CLUSTER" stop
	fi
}
trap cleanup EXIT

# The simulated machine: the fake NVML under the name the loader looks for,
# and stand-ins for the device nodes a real driver would create.
mkdir -p "$RUN/nvml" "$RUN/gpu-root/dev" "$RUN/cdi" "$RUN/state"
ln -sfn "$TARGET_DIR/debug/libtessera_fake_nvml.so" "$RUN/nvml/libnvidia-ml.so.1"
for i in 0 1 2 3 4 5 6 7; do : >"$RUN/gpu-root/dev/nvidia$i"; done
# The simulated MPS control daemon stands in for the driver's
# nvidia-cuda-mps-control; its pipes need a short path (Unix socket limit).
mkdir -p "$RUN/gpu-root/usr/bin"
ln -sfn "$TARGET_DIR/debug/fake-mps-control" "$RUN/gpu-root/usr/bin/nvidia-cuda-mps-control"
MPS_DIR="${TMPDIR:-/tmp}/tessera-demo-mps"
: >"$RUN/gpu-root/dev/nvidiactl"
export LD_LIBRARY_PATH="$RUN/nvml${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TESSERA_FAKE_NVML_TOPOLOGY="$TOPOLOGY"
# One machine: every process here (inventory, publish, plugin) shares the
# simulated GPUs' state, and the MIG capability files live in the driver root.
export TESSERA_FAKE_NVML_STATE="$RUN/nvml.state"
export TESSERA_FAKE_NVML_DRIVER_ROOT="$RUN/gpu-root"
export NODE_NAME="$TESSERA_NODE_NAME"

say "what this node has (tessera inventory)"
"$TESSERA" inventory --output yaml | sed -n '1,40p'
echo "..."

stop_tessera
say "starting tessera publish and tessera plugin (logs in $RUN)"
"$TESSERA" publish >"$RUN/publish.log" 2>&1 &
echo $! >"$RUN/publish.pid"
"$TESSERA" plugin \
	--kubelet-registry-dir "$TESSERA_KUBELET_REGISTRY_DIR" \
	--kubelet-plugins-dir "$TESSERA_KUBELET_PLUGINS_DIR" \
	--cdi-dir "$RUN/cdi" --state-dir "$RUN/state" \
	--driver-root "$RUN/gpu-root" --mps-dir "$MPS_DIR" >"$RUN/plugin.log" 2>&1 &
echo $! >"$RUN/plugin.pid"

kubectl apply -f deploy/deviceclasses.yaml
say "published ResourceSlices"
deadline=$((SECONDS + 60))
until kubectl get resourceslices --field-selector "spec.nodeName=$NODE_NAME" -o name | grep -q .; do
	((SECONDS < deadline)) || { echo "no slices after 60s; see $RUN/publish.log"; exit 1; }
	sleep 1
done
kubectl get resourceslices -o wide

say "example claims (deploy/examples): whole GPU, two Isolated shares, one Shared share"
kubectl apply -f deploy/examples/whole-gpu.yaml -f deploy/examples/isolated-share.yaml \
	-f deploy/examples/shared-share.yaml
kubectl wait --for=condition=Ready pod/whole-gpu pod/isolated-a pod/isolated-b pod/shared --timeout=180s

say "which GPU each claim got (status.devices written by the plugin after prepare)"
kubectl get resourceclaims -o \
	'custom-columns=CLAIM:.metadata.name,DEVICE:.status.allocation.devices.results[*].device,DATA:.status.devices[*].data'

say "CDI specs the container runtime reads"
for f in "$RUN"/cdi/*.json; do
	echo "--- $(basename "$f")"
	cat "$f"
	echo
done

say "deleting the pods: the kubelet unprepares the claims"
kubectl delete pod whole-gpu isolated-a isolated-b shared --wait=true --timeout=120s
deadline=$((SECONDS + 60))
until ! compgen -G "$RUN/cdi/*.json" >/dev/null; do
	((SECONDS < deadline)) || { echo "CDI specs still present after 60s"; exit 1; }
	sleep 1
done
echo "all CDI specs removed"
