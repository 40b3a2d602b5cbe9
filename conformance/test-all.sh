#!/usr/bin/env bash
# The project's one test command: builds the Kubernetes components, starts a
# local control plane in a fresh temporary state directory, runs the whole
# Rust workspace's tests against it, and stops it again whatever happens.
#
# usage: conformance/test-all.sh [extra cargo test args...]
# env:   TESSERA_KEEP_STATE=1 keeps the state dir (logs, etcd) after a green run;
#        it is always kept after a failure, and its path printed.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLUSTER="$REPO_ROOT/conformance/cluster.sh"
cd "$REPO_ROOT"

say() { printf '[test-all] %s\n' "$*" >&2; }

# --- 0. static checks (fast; a formatting or lint error fails the run) ----
say "cargo fmt --check, cargo clippy -D warnings"
cargo fmt --all --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

# --- 1. Go components (cached by source hash; seconds when unchanged) -------
t0=$SECONDS
"$CLUSTER" build >/dev/null
say "Kubernetes components ready ($((SECONDS - t0))s)"

# --- hook: podman ----------------------------------------------------------
# The CDI consumer test (driver/tests/cdi_podman.rs) runs a real container
# with podman + runc from a busybox-static rootfs. Install what is missing
# (Debian packages; nothing when all are there) and make the test fail,
# rather than skip, if podman still cannot run. See docs/development.md.
ensure_packages() {
	local missing=() pkg
	for pkg in "$@"; do
		dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' ||
			missing+=("$pkg")
	done
	((${#missing[@]} == 0)) && return 0
	say "installing ${missing[*]}"
	if ((EUID != 0)) || ! command -v apt-get >/dev/null; then
		say "cannot install ${missing[*]} (needs root and apt-get); the podman test will fail"
		return 0
	fi
	{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends "${missing[@]}"; } >&2 ||
		say "installing ${missing[*]} failed; the podman test will fail"
}
# The local cluster's kubelet runs real containers: runc, the CNI plugins,
# ip (pod network cleanup) and unshare come from Debian too. The webhook test
# makes its CA and serving certificate with the openssl CLI.
ensure_packages podman runc busybox-static containernetworking-plugins iproute2 util-linux openssl
export TESSERA_REQUIRE_PODMAN=1

# --- 2. Rust: compile everything before the clusters take CPU -----------------
# Binaries and cdylibs the tests launch (tessera, the fake libnvidia-ml.so)
# come from `cargo build`; test executables from `--no-run`. Arguments after
# `--` belong to the test executables, not to cargo.
cargo_args=()
for a in "$@"; do
	[[ "$a" == -- ]] && break
	cargo_args+=("$a")
done
t0=$SECONDS
cargo build --workspace
cargo test --workspace --no-run "${cargo_args[@]}"
say "Rust build done ($((SECONDS - t0))s)"

# --- hook: Helm chart -------------------------------------------------------
# conformance/tests/helm_install.rs installs deploy/helm/tessera with helm
# (built from its Go module, cached) and the node image of the release
# binary (conformance/cluster/image.sh imports it into the cluster).
t0=$SECONDS
cargo build --release -p tessera-driver --bin tessera
conformance/cluster/image.sh helm >/dev/null
say "release binary and helm ready ($((SECONDS - t0))s)"

# --- 3. clusters in a fresh state directory --------------------------------
STATE=$(mktemp -d "${TMPDIR:-/tmp}/tessera-test.XXXXXX")
MAIN_DIR="$STATE/main"
DEGRADED_DIR="$STATE/degraded"

finish() {
	local rc=$?
	trap - EXIT INT TERM
	TESSERA_CLUSTER_DIR="$MAIN_DIR" "$CLUSTER" stop || rc=1
	TESSERA_CLUSTER_DIR="$DEGRADED_DIR" "$CLUSTER" stop || rc=1
	if ((rc != 0)); then
		say "FAILED (exit $rc); cluster state and logs kept in $STATE"
		TESSERA_CLUSTER_DIR="$MAIN_DIR" TESSERA_LOG_LINES=30 "$CLUSTER" logs >&2 2>&1 || true
		if [[ -d "$DEGRADED_DIR/logs" ]]; then
			say "degraded cluster:"
			TESSERA_CLUSTER_DIR="$DEGRADED_DIR" TESSERA_LOG_LINES=30 "$CLUSTER" logs >&2 2>&1 || true
		fi
	elif [[ "${TESSERA_KEEP_STATE:-0}" == 1 ]]; then
		say "state kept in $STATE"
	else
		rm -rf "$STATE"
	fi
	exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

export TESSERA_CLUSTER_DIR="$MAIN_DIR"
"$CLUSTER" start
eval "$("$CLUSTER" env)"

# --- degraded cluster ---------------------------------------------------------
# A second cluster serving the API of an older server: no partitionable
# devices, no consumable capacity. The publisher must detect that and fall
# back to the static per-GPU mode (conformance/tests/slices_degraded.rs).
# No kubelet: those tests only need the API server and the scheduler.
TESSERA_CLUSTER_DIR="$DEGRADED_DIR" TESSERA_KUBELET=0 \
	TESSERA_FEATURE_GATES=DRAPartitionableDevices=false,DRAConsumableCapacity=false \
	"$CLUSTER" start
export TESSERA_DEGRADED_KUBECONFIG="$DEGRADED_DIR/kubeconfig"

# --- 4. tests ----------------------------------------------------------------
say "running cargo test --workspace against $TESSERA_APISERVER_URL"
cargo test --workspace --no-fail-fast "$@"

# --- 5. bounded fuzzing of the untrusted-input decoders --------------------
conformance/fuzz-smoke.sh
