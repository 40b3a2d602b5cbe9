#!/usr/bin/env bash
# The cluster-scale benchmark of docs/benchmarks.md, in one command: a local
# control plane without a kubelet, N fake nodes (100), one `tessera publish`
# per node over a simulated 8x H100 machine, then pods with one claim each on
# an Isolated share, bound by the real kube-scheduler; then the same capacity
# published as plain replica devices (no counters, no consumable capacity)
# and the same pods again. Release builds.
#
# usage: conformance/bench-scale.sh
# env:   TESSERA_SCALE_DIR     cluster state dir (default <repo>/.tessera/scale);
#                              the cluster is started there and stopped at the end
#        TESSERA_SCALE_NODES   fake nodes (default 100)
#        TESSERA_SCALE_PODS    pods per scheduling run (default 1000)
#        TESSERA_SCALE_CLAIMS  direct,template (default both): a ResourceClaim per
#                              pod created beforehand, or a ResourceClaimTemplate
#        TESSERA_SCALE_REPLICAS  0: skip the replica model's run (default 1)
#        TESSERA_SCALE_POLICY  node policy file for every publisher (default: every
#                              mode on every GPU, the full model)
# Prints one JSON object per result; they are also kept in
# <state dir>/results.jsonl. Nothing here is a test: numbers are reported,
# never asserted.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLUSTER="$REPO_ROOT/conformance/cluster.sh"
cd "$REPO_ROOT"
say() { printf '[bench-scale] %s\n' "$*" >&2; }

export TESSERA_CLUSTER_DIR="${TESSERA_SCALE_DIR:-$REPO_ROOT/.tessera/scale}"
export TESSERA_KUBELET=0
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${TESSERA_CACHE:-$HOME/.cache/tessera}/target}"
NODES=${TESSERA_SCALE_NODES:-100}
PODS=${TESSERA_SCALE_PODS:-1000}
CLAIMS=${TESSERA_SCALE_CLAIMS:-direct,template}
extra=()
[[ -n "${TESSERA_SCALE_POLICY:-}" ]] && extra=(--policy "$(realpath "$TESSERA_SCALE_POLICY")")
[[ "${TESSERA_SCALE_REPLICAS:-1}" == 0 ]] && extra+=(--no-replicas)

say "release builds"
cargo build --release --quiet -p tessera-driver -p tessera-fake-nvml
cargo build --release --quiet -p tessera-conformance --bin tessera-bench
T="$CARGO_TARGET_DIR/release"

# A fresh cluster: the publish phase starts from no slices at all.
"$CLUSTER" stop >/dev/null 2>&1 || true
rm -rf "$TESSERA_CLUSTER_DIR"
"$CLUSTER" start >&2
trap '"$CLUSTER" stop >&2 || true' EXIT
eval "$("$CLUSTER" env)"
"$CLUSTER" add-nodes "$NODES" >&2
kubectl apply -f deploy/deviceclasses.yaml >&2

RESULTS="$TESSERA_CLUSTER_DIR/results.jsonl"
say "$NODES nodes, $PODS pods per run ($CLAIMS); results in $RESULTS"
"$T/tessera-bench" scale --nodes "$NODES" --pods "$PODS" --claims "$CLAIMS" \
	--tessera "$T/tessera" --nvml-library "$T/libtessera_fake_nvml.so" \
	--topology driver/fake-nvml/topologies/h100x8.yaml \
	--work-dir "$TESSERA_CLUSTER_DIR/publishers" "${extra[@]}" | tee "$RESULTS"
