#!/usr/bin/env bash
# Tessera's local Kubernetes control plane: real etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and kubelet, all built from their Go
# modules into one binary (conformance/cluster), run on 127.0.0.1; the kubelet
# runs real containers through containerd + runc (conformance/cluster/containerd.sh).
# See docs/development.md.
#
# usage: conformance/cluster.sh build|kube-bin|start|stop|status|env|add-nodes N|logs [component] [-f]
#        conformance/cluster.sh node-start --topology FILE [--policy FILE] [--driver-name NAME] [--cdi-dir DIR] [-- PLUGIN FLAGS]
#        conformance/cluster.sh node-stop
#        conformance/cluster.sh kill|revive COMPONENT
#   kill ends one component (etcd, containerd, kube-apiserver,
#   kube-controller-manager, kube-scheduler, kubelet) with SIGKILL; revive
#   starts it again as it was started and waits until it serves.
#   node-start runs Tessera's node process (tessera plugin: kubelet plugin and
#   slice publisher) on the kubelet's node over simulated GPUs (a topology of
#   driver/fake-nvml/topologies/), from binaries cargo built; the node's state
#   (<state dir>/node) outlives node-stop, and a restart without arguments
#   reuses its topology, policy and driver name. `stop` stops it too.
#   --cdi-dir puts the node process's CDI specs in DIR instead of the node's
#   spec dir, which containerd watches; nothing reads DIR, so no container can
#   use what the node prepares until a node-start without it (benchmarks of
#   the plugin calls alone: containerd reads every spec again on each change).
#   TESSERA_KUBE_VERSION=v1.36.3 builds and starts that release instead of
#   the default (conformance/cluster/go.mod; others: go-1.<minor>.mod).
#   kube-bin prints the control plane binary's path (built when needed),
#   without containerd: what a start without a kubelet needs.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SRC="$REPO_ROOT/conformance/cluster"
CACHE="${TESSERA_CACHE:-$HOME/.cache/tessera}"
DIR="${TESSERA_CLUSTER_DIR:-$REPO_ROOT/.tessera/cluster}"
case "$DIR" in /*) ;; *) DIR="$PWD/$DIR" ;; esac
START_TIMEOUT="${TESSERA_START_TIMEOUT:-240}"
LOG_LEVEL="${TESSERA_LOG_LEVEL:-1}"

# Gates Tessera relies on, per Kubernetes minor (checked against
# pkg/features/kube_features.go of each release; see docs/development.md).
# Gates that can still be switched are set explicitly, so the cluster's shape
# does not depend on upstream defaults; GA gates locked on are left out (they
# cannot be turned off, and a component refuses a gate its release removed).
#   1.36: DRAPartitionableDevices, DRAConsumableCapacity, DRADeviceTaints,
#         DRAResourceClaimDeviceStatus, ResourceHealthStatus beta (on);
#         DRADeviceTaintRules beta but off, like its API (v1beta2);
#         DRAPrioritizedList GA; DRAAdminAccess GA, locked.
#   1.37: DRADeviceTaints and DRADeviceTaintRules GA (not yet locked; the
#         API is resource.k8s.io/v1); DRAPartitionableDevices,
#         DRAConsumableCapacity, ResourceHealthStatus still beta (on);
#         DRAPrioritizedList, DRAResourceClaimDeviceStatus, DRAAdminAccess
#         GA, locked.
default_feature_gates() { # minor
	case "$1" in
	36) echo "DRAPartitionableDevices=true,DRAConsumableCapacity=true,DRADeviceTaints=true,DRADeviceTaintRules=true,DRAResourceClaimDeviceStatus=true,ResourceHealthStatus=true,DRAPrioritizedList=true" ;;
	37) echo "DRAPartitionableDevices=true,DRAConsumableCapacity=true,DRADeviceTaints=true,DRADeviceTaintRules=true,ResourceHealthStatus=true" ;;
	*) return 1 ;;
	esac
}
DEFAULT_RUNTIME_CONFIG="resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true,resource.k8s.io/v1alpha3=true"

# Components in start order (stop: clients, then the API server, then etcd and the runtime).
COMPONENTS=(etcd containerd kube-apiserver kube-controller-manager kube-scheduler kubelet)

# fd 4 stays the original stderr even where a condition's output is silenced.
exec 4>&2

log() { printf '[cluster] %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

# ---------------------------------------------------------------- build ----

GO_BUILD_FLAGS=(-trimpath -buildvcs=false)

modfile_version() { awk '$1 == "k8s.io/kubernetes" { print $2; exit }' "$SRC/$1"; }

# The module file of the Kubernetes release to build: go.mod holds the
# default release, go-1.<minor>.mod (+ .sum) each other one tested
# (conformance/cluster/gen-replace.sh --modfile writes them).
# TESSERA_KUBE_VERSION picks one: v1.36.3, 1.36.3, v1.36 or 1.36.
MODFILE=""
select_modfile() {
	[[ -z "$MODFILE" ]] || return 0
	local want=${TESSERA_KUBE_VERSION:-} f v have=()
	want=${want#v}
	for f in go.mod $(cd "$SRC" && ls go-1.*.mod 2>/dev/null); do
		v=$(modfile_version "$f")
		have+=("$v")
		if [[ -z "$want" || "$want" == "${v#v}" || "$want" == "$(minor_of "$v")" ]]; then
			MODFILE=$f
			return 0
		fi
	done
	die "TESSERA_KUBE_VERSION=$TESSERA_KUBE_VERSION: no module file for it in $SRC (have: ${have[*]})"
}
k8s_version() {
	select_modfile
	modfile_version "$MODFILE"
}
minor_of() { # v1.37.2 -> 1.37
	local v=${1#v}
	echo "${v%.*}"
}
# Go code that differs between releases (an interface method one release's
# library has and another's lacks) is selected by a build tag naming the
# release's minor: tessera_k8s_1_36, tessera_k8s_1_37, ...
build_tags() { echo "tessera_k8s_$(minor_of "$(k8s_version)" | tr . _)"; }

# Everything that determines the binary: sources (test files never enter
# it), the module file used and its sums, toolchain, flags.
source_hash() {
	select_modfile
	(
		cd "$SRC"
		go env GOVERSION GOOS GOARCH
		echo "${GO_BUILD_FLAGS[*]} -modfile=$MODFILE -tags=$(build_tags) $(build_ldflags "-")"
		{
			find . -type f -name '*.go' ! -name '*_test.go' -print
			echo "./$MODFILE"
			echo "./${MODFILE%.mod}.sum"
		} | LC_ALL=C sort | xargs sha256sum
	) | sha256sum | cut -c1-16
}

build_ldflags() {
	local commit="$1" v major minor ldf=(-s -w)
	v=$(k8s_version)
	major=${v#v}
	major=${major%%.*}
	minor=${v#v*.}
	minor=${minor%%.*}
	# Stamp the version the way upstream's release build does, so /version and
	# the node's kubeletVersion report the real release, not v0.0.0-master.
	for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		ldf+=(-X "$pkg.gitVersion=$v" -X "$pkg.gitMajor=$major" -X "$pkg.gitMinor=$minor"
			-X "$pkg.gitTreeState=clean" -X "$pkg.gitCommit=$commit")
	done
	echo "${ldf[*]}"
}

# Prints the path of an up-to-date tessera-kube, building it when needed.
ensure_binary() {
	if [[ -n "${TESSERA_KUBE_BIN:-}" ]]; then
		[[ -x "$TESSERA_KUBE_BIN" ]] || die "TESSERA_KUBE_BIN=$TESSERA_KUBE_BIN is not executable"
		if [[ -n "${TESSERA_KUBE_VERSION:-}" ]]; then
			local have
			have=$(binary_version "$TESSERA_KUBE_BIN")
			[[ "${TESSERA_KUBE_VERSION#v}" == "${have#v}" || "${TESSERA_KUBE_VERSION#v}" == "$(minor_of "$have")" ]] ||
				die "TESSERA_KUBE_BIN=$TESSERA_KUBE_BIN is $have, not TESSERA_KUBE_VERSION=$TESSERA_KUBE_VERSION (unset one of them)"
		fi
		echo "$TESSERA_KUBE_BIN"
		return
	fi
	prereq_check --for "building Kubernetes" go || exit 1
	select_modfile
	local hash out bin
	hash=$(source_hash)
	out="$CACHE/kube/$hash"
	bin="$out/tessera-kube"
	if [[ ! -x "$bin" ]]; then
		mkdir -p "$out"
		# One build at a time per cache; a second caller waits, then finds the binary.
		exec 9>"$CACHE/kube/.build.lock"
		flock 9
		if [[ ! -x "$bin" ]]; then
			log "building tessera-kube ($(k8s_version), $MODFILE) into $out (first build of Kubernetes takes long on a small machine)"
			local t0=$SECONDS
			(cd "$SRC" && go build "${GO_BUILD_FLAGS[@]}" -modfile="$MODFILE" -tags="$(build_tags)" -ldflags "$(build_ldflags "$hash")" -o "$bin.tmp" ./cmd/tessera-kube) >&2
			mv -f "$bin.tmp" "$bin"
			log "built in $((SECONDS - t0))s"
		fi
		flock -u 9
		exec 9>&-
		prune_cache
	fi
	touch "$out" # marks it as recently used for prune_cache
	echo "$bin"
}

# Each source change leaves a ~180 MB binary behind: keep the four most
# recently used (two per tested release), and anything used within the last
# day (a running cluster may still need it).
prune_cache() {
	local d
	while read -r d; do
		[[ -n "$d" && -n "$(find "$d" -maxdepth 0 -mmin +1440)" ]] || continue
		rm -rf "$d"
		log "pruned old build $d"
	done < <(ls -1dt "$CACHE"/kube/*/ 2>/dev/null | tail -n +5)
}

# The release a tessera-kube binary was stamped with (v1.37.2).
binary_version() {
	"$1" kubectl version --client -o json 2>/dev/null | sed -n 's/^[[:space:]]*"gitVersion": "\(.*\)",$/\1/p' | head -n 1
}

cmd_build() {
	local t0=$SECONDS bin
	bin=$(ensure_binary)
	log "tessera-kube $(binary_version "$bin") ready: $bin ($((SECONDS - t0))s)"
	log "containerd ready: $(ensure_containerd)"
	echo "$bin"
}

# ---------------------------------------------------------------- state ----

pidfile() { echo "$DIR/pids/$1.pid"; }
cmdfile() { echo "$DIR/pids/$1.cmd"; }
logfile() { echo "$DIR/logs/$1.log"; }

proc_starttime() { # pid -> start time in clock ticks since boot (field 22 of /proc/PID/stat)
	local stat
	stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
	stat=${stat##*) } # the command name may contain spaces; fields restart after ") "
	read -ra f <<<"$stat"
	echo "${f[19]}"
}

# Pid files hold "PID STARTTIME". A recorded pid counts only while a process
# with that pid and that start time exists, so a reused pid is never signalled.
recorded_pid() {
	local f pid start now
	f=$(pidfile "$1")
	[[ -f "$f" ]] || return 1
	read -r pid start <"$f" || true
	[[ "$pid" =~ ^[0-9]+$ && -n "$start" ]] || return 1
	now=$(proc_starttime "$pid") || return 1
	[[ "$now" == "$start" ]] || return 1
	echo "$pid"
}
pid_alive() { recorded_pid "$1" >/dev/null; }

load_state() {
	[[ -f "$DIR/cluster.env" ]] || return 1
	# shellcheck disable=SC1091
	source "$DIR/cluster.env"
}

kubectl_() { "$KUBE_BIN" kubectl --kubeconfig "$DIR/kubeconfig" "$@"; }

# wait_for <seconds> <what> <command...>: poll a condition until a deadline.
# The condition returns 0 when met, 3 when it can never be met (a component
# died), anything else to be polled again.
wait_for() {
	local timeout=$1 what=$2 rc
	shift 2
	local deadline=$((SECONDS + timeout))
	while :; do
		rc=0
		"$@" 4>&2 >/dev/null 2>&1 || rc=$?
		case $rc in
		0) break ;;
		3)
			log "gave up waiting for $what"
			return 1
			;;
		esac
		if ((SECONDS >= deadline)); then
			log "timed out after ${timeout}s waiting for $what"
			return 1
		fi
		sleep 0.5
	done
	log "ok: $what"
}

# ---------------------------------------------------------------- start ----

merge_gates() { # kubernetes version
	# Later entries win: the release's defaults first, then TESSERA_FEATURE_GATES.
	local -A val=()
	local -a order=()
	local kv k defaults
	defaults=$(default_feature_gates "$(minor_of "$1" | cut -d. -f2)") ||
		die "no feature gate list for Kubernetes $1 in $0 (default_feature_gates): check pkg/features/kube_features.go of that release"
	IFS=',' read -ra kvs <<<"$defaults,${TESSERA_FEATURE_GATES:-}"
	for kv in "${kvs[@]}"; do
		kv=${kv// /}
		[[ -z "$kv" ]] && continue
		[[ "$kv" == *=* ]] || die "bad feature gate '$kv' (want Name=true|false)"
		k=${kv%%=*}
		[[ -v "val[$k]" ]] || order+=("$k")
		val[$k]=${kv#*=}
	done
	local out=()
	for k in "${order[@]}"; do out+=("$k=${val[$k]}"); done
	(
		IFS=,
		echo "${out[*]}"
	)
}

pick_ports() {
	local names=(ETCD_PORT ETCD_PEER_PORT APISERVER_PORT CONTROLLER_MANAGER_PORT SCHEDULER_PORT KUBELET_PORT KUBELET_HEALTHZ_PORT)
	local free i=0 n
	mapfile -t free < <("$KUBE_BIN" free-ports "${#names[@]}")
	: >"$DIR/ports.env.tmp"
	for n in "${names[@]}"; do
		local override="TESSERA_$n"
		echo "$n=${!override:-${free[$i]}}" >>"$DIR/ports.env.tmp"
		i=$((i + 1))
	done
	mv "$DIR/ports.env.tmp" "$DIR/ports.env"
}

start_component() {
	local name=$1
	shift
	start_external "$name" "$KUBE_BIN" "$@"
}

# start_external NAME BINARY ARGS...
start_external() {
	local name=$1
	shift
	if pid_alive "$name"; then
		log "$name already running (pid $(recorded_pid "$name"))"
		return
	fi
	local lf
	lf=$(logfile "$name")
	printf '\n==== %s start %s\n' "$name" "$(date -u +%FT%TZ)" >>"$lf"
	# setsid: components outlive this script and an interactive Ctrl-C; they are
	# stopped by `stop`, which signals exactly the recorded pids.
	setsid "$@" >>"$lf" 2>&1 </dev/null 4>&- 9>&- &
	local pid=$!
	echo "$pid $(proc_starttime "$pid")" >"$(pidfile "$name")"
	# What `revive` starts again: the search path, then the command line.
	printf '%s\0' "$PATH" "$@" >"$(cmdfile "$name")"
	log "started $name (pid $pid, log $lf)"
}

# Reports (once, on stderr) that a component died, so waits end early.
alive_or_fatal() {
	pid_alive "$1" && return 0
	{
		log "$1 is not running; last lines of $(logfile "$1"):"
		tail -n 40 "$(logfile "$1")" || true
	} >&4 2>&4
	return 3
}

http_ok() { # url [curl args...]: 2xx and body "ok"
	local url=$1
	shift
	[[ "$(curl -sS --max-time 5 --fail "$@" "$url")" == ok ]]
}

readyz_ok() {
	http_ok "https://127.0.0.1:$APISERVER_PORT/readyz" --cacert "$DIR/pki/ca.crt" \
		--cert "$DIR/pki/admin.crt" --key "$DIR/pki/admin.key"
}
apiserver_ready() { alive_or_fatal kube-apiserver && readyz_ok; }
component_healthy() { # name port
	alive_or_fatal "$1" && http_ok "https://127.0.0.1:$2/healthz" --cacert "$DIR/pki/ca.crt"
}
etcd_ready() {
	alive_or_fatal etcd && curl -sS --max-time 5 --fail "http://127.0.0.1:$ETCD_PORT/health" | grep -q '"health":"true"'
}
default_sa_exists() { kubectl_ get -n default serviceaccount default; }
node_ready() {
	alive_or_fatal kubelet || return 3
	[[ "$(kubectl_ get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" == True ]]
}

write_kubelet_config() {
	local gates=$1 f="$DIR/kubelet/config.yaml"
	{
		cat <<EOF
# Generated by conformance/cluster.sh; see docs/development.md for why each
# setting is needed in a container without systemd on cgroup v1.
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
tlsCertFile: $DIR/pki/kubelet.crt
tlsPrivateKeyFile: $DIR/pki/kubelet.key
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: $DIR/pki/ca.crt
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix://$CRI_SOCKET
imageServiceEndpoint: unix://$CRI_SOCKET
podLogsDir: $DIR/kubelet/pod-logs
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failCgroupV1: false
failSwapOn: false
localStorageCapacityIsolation: false
evictionHard: {}
evictionSoft: {}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
protectKernelDefaults: false
registerNode: true
maxPods: 110
clusterDomain: cluster.local
featureGates:
EOF
		local kv
		IFS=',' read -ra kvs <<<"$gates"
		for kv in "${kvs[@]}"; do echo "  ${kv%%=*}: ${kv#*=}"; done
	} >"$f.tmp"
	mv "$f.tmp" "$f"
}

cmd_start() {
	if [[ -f "$DIR/cluster.env" ]] && cmd_status >/dev/null 2>&1; then
		log "cluster in $DIR is already running"
		return 0
	fi
	# What the machine lacks is named now, not after minutes of building.
	local groups=(cluster)
	if [[ "${TESSERA_KUBELET:-1}" == 1 ]]; then
		groups+=(go node) # containerd is built too
	elif [[ -z "${TESSERA_KUBE_BIN:-}" ]]; then
		groups+=(go)
	fi
	prereq_check --for "$0 start" "${groups[@]}" ||
		die "missing prerequisites (above); conformance/cluster/prereqs.sh ensure ${groups[*]} installs the Debian packages among them"
	KUBE_BIN=$(ensure_binary)
	if [[ "${TESSERA_KUBELET:-1}" == 1 ]]; then CTRD_BIN=$(ensure_containerd); fi
	local kube_version
	kube_version=$(binary_version "$KUBE_BIN")
	[[ -n "$kube_version" ]] || die "$KUBE_BIN does not say its version (kubectl version --client)"
	if [[ -f "$DIR/cluster.env" ]]; then
		local last
		last=$(sed -n "s/^KUBE_VERSION='\(.*\)'$/\1/p" "$DIR/cluster.env")
		[[ -z "$last" || "$last" == "$kube_version" ]] ||
			log "the state in $DIR was last run by Kubernetes $last, now $kube_version"
	fi
	mkdir -p "$DIR"/{pids,logs,pki,etcd,kubelet/pod-logs,bin}
	chmod 700 "$DIR"

	# Ports are fixed at the first start of a state dir and reused after; gates,
	# kubelet and node name come from the environment of each start.
	if [[ ! -f "$DIR/ports.env" ]]; then pick_ports; fi
	# shellcheck disable=SC1091
	source "$DIR/ports.env"
	local gates runtime_config kubelet_enabled node cri_socket
	gates=$(merge_gates "$kube_version")
	runtime_config="${TESSERA_RUNTIME_CONFIG:-$DEFAULT_RUNTIME_CONFIG}"
	kubelet_enabled="${TESSERA_KUBELET:-1}"
	node="${TESSERA_NODE_NAME:-tessera-node}"
	cri_socket="$DIR/containerd/containerd.sock"
	# Unix socket paths are limited to 107 bytes; kubelet plugin sockets live
	# below the state dir too, so keep TESSERA_CLUSTER_DIR short.
	((${#cri_socket} < 100)) || die "state dir path too long for unix sockets: $DIR"
	cat >"$DIR/cluster.env" <<EOF
KUBE_BIN='$KUBE_BIN'
KUBE_VERSION='$kube_version'
FEATURE_GATES='$gates'
RUNTIME_CONFIG='$runtime_config'
KUBELET_ENABLED='$kubelet_enabled'
NODE_NAME='$node'
CRI_SOCKET='$cri_socket'
$(cat "$DIR/ports.env")
EOF
	load_state
	ln -sfn "$KUBE_BIN" "$DIR/bin/kubectl"
	ln -sfn "$KUBE_BIN" "$DIR/bin/tessera-kube"

	local server="https://127.0.0.1:$APISERVER_PORT" pki="$DIR/pki"
	"$KUBE_BIN" certs --dir "$pki" --server "$server" --node-name "$NODE_NAME"
	cp "$pki/admin.kubeconfig" "$DIR/kubeconfig.tmp" && mv "$DIR/kubeconfig.tmp" "$DIR/kubeconfig"

	local deadline_total=$((SECONDS + START_TIMEOUT)) t0=$SECONDS
	remaining() { local r=$((deadline_total - SECONDS)); echo $((r > 0 ? r : 1)); }

	start_component etcd etcd --data-dir "$DIR/etcd" \
		--listen-client-url "http://127.0.0.1:$ETCD_PORT" --listen-peer-url "http://127.0.0.1:$ETCD_PEER_PORT"
	if [[ "$KUBELET_ENABLED" == 1 ]]; then
		start_containerd
	fi
	wait_for "$(remaining)" "etcd healthy" etcd_ready

	# The API server reaches the kubelet (logs, exec) by the node's name, which
	# only its own hosts file maps to the kubelet's loopback address: a node
	# address may not be loopback, and nothing here listens elsewhere.
	# No kube-proxy serves ClusterIPs here: --enable-aggregator-routing makes
	# the API server call webhooks (and aggregated APIs) of a Service at a
	# Ready endpoint's pod address, which the host reaches on the pod bridge.
	grep -v "[[:space:]]$NODE_NAME\$" /etc/hosts >"$DIR/apiserver-hosts" || true
	echo "127.0.0.1 $NODE_NAME" >>"$DIR/apiserver-hosts"
	start_external kube-apiserver unshare --mount --propagation private -- \
		sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$DIR/apiserver-hosts" "$KUBE_BIN" kube-apiserver \
		--etcd-servers "http://127.0.0.1:$ETCD_PORT" \
		--bind-address 127.0.0.1 --secure-port "$APISERVER_PORT" --advertise-address 127.0.0.1 \
		--endpoint-reconciler-type none \
		--tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
		--client-ca-file "$pki/ca.crt" \
		--requestheader-client-ca-file "$pki/ca.crt" --requestheader-allowed-names tessera-front-proxy \
		--requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
		--requestheader-extra-headers-prefix X-Remote-Extra- \
		--kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" \
		--kubelet-client-key "$pki/apiserver-kubelet-client.key" \
		--kubelet-preferred-address-types Hostname \
		--service-account-issuer https://kubernetes.default.svc.cluster.local \
		--service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
		--service-cluster-ip-range 10.0.0.0/24 --enable-aggregator-routing=true \
		--authorization-mode Node,RBAC --allow-privileged=true \
		--cert-dir "$DIR/apiserver" \
		--feature-gates "$FEATURE_GATES" --runtime-config "$RUNTIME_CONFIG" \
		--v "$LOG_LEVEL"
	wait_for "$(remaining)" "kube-apiserver /readyz" apiserver_ready

	start_component kube-controller-manager kube-controller-manager \
		--kubeconfig "$pki/controller-manager.kubeconfig" \
		--authentication-kubeconfig "$pki/controller-manager.kubeconfig" \
		--authorization-kubeconfig "$pki/controller-manager.kubeconfig" \
		--bind-address 127.0.0.1 --secure-port "$CONTROLLER_MANAGER_PORT" \
		--tls-cert-file "$pki/controller-manager-serving.crt" \
		--tls-private-key-file "$pki/controller-manager-serving.key" \
		--leader-elect=false \
		--use-service-account-credentials=true \
		--service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
		--cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
		--feature-gates "$FEATURE_GATES" --v "$LOG_LEVEL"
	start_component kube-scheduler kube-scheduler \
		--kubeconfig "$pki/scheduler.kubeconfig" \
		--authentication-kubeconfig "$pki/scheduler.kubeconfig" \
		--authorization-kubeconfig "$pki/scheduler.kubeconfig" \
		--bind-address 127.0.0.1 --secure-port "$SCHEDULER_PORT" \
		--tls-cert-file "$pki/scheduler-serving.crt" --tls-private-key-file "$pki/scheduler-serving.key" \
		--leader-elect=false \
		--feature-gates "$FEATURE_GATES" --v "$LOG_LEVEL"
	if [[ "$KUBELET_ENABLED" == 1 ]]; then
		wait_for "$(remaining)" "containerd" containerd_ready
		import_images
		write_kubelet_config "$FEATURE_GATES"
		start_component kubelet kubelet \
			--config "$DIR/kubelet/config.yaml" \
			--kubeconfig "$pki/kubelet.kubeconfig" \
			--root-dir "$DIR/kubelet" --cert-dir "$DIR/kubelet/pki" \
			--hostname-override "$NODE_NAME" --v "$LOG_LEVEL"
	fi
	wait_for "$(remaining)" "kube-controller-manager /healthz" component_healthy kube-controller-manager "$CONTROLLER_MANAGER_PORT"
	wait_for "$(remaining)" "kube-scheduler /healthz" component_healthy kube-scheduler "$SCHEDULER_PORT"
	wait_for "$(remaining)" "default ServiceAccount" default_sa_exists
	if [[ "$KUBELET_ENABLED" == 1 ]]; then
		wait_for "$(remaining)" "node $NODE_NAME Ready" node_ready
	fi
	log "cluster (Kubernetes $KUBE_VERSION) up in $((SECONDS - t0))s; state in $DIR"
	log "use it with: eval \"\$($0 env)\""
}

# ----------------------------------------------------------------- stop ----

# stop_group NAME...: SIGTERM to every recorded, live pid of the group at
# once, then wait for all of them (SIGKILL to what is left after 30s).
stop_group() {
	local name f pid t0=$SECONDS
	local -a names=() pids=()
	for name in "$@"; do
		f=$(pidfile "$name")
		[[ -f "$f" ]] || continue
		if pid=$(recorded_pid "$name"); then
			kill -TERM "$pid" 2>/dev/null || true
			names+=("$name")
			pids+=("$pid")
		else
			rm -f "$f"
		fi
	done
	local i deadline=$((SECONDS + 30))
	for i in "${!pids[@]}"; do
		pid=${pids[$i]}
		while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
		if kill -0 "$pid" 2>/dev/null; then
			log "${names[$i]} (pid $pid) ignored SIGTERM for 30s; sending SIGKILL"
			kill -KILL "$pid" 2>/dev/null || true
			while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
		fi
		rm -f "$(pidfile "${names[$i]}")"
		log "stopped ${names[$i]} (pid $pid, $((SECONDS - t0))s)"
	done
}

# The kubelet mounts tmpfs volumes (service-account tokens, secrets) below its
# root dir; after it is gone they would keep the state dir from being removed.
unmount_state_dir() {
	local m
	[[ -r /proc/self/mountinfo ]] || return 0
	# Deepest first.
	while read -r m; do
		umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
	done < <(awk -v d="$DIR/" 'index($5, d) == 1 { print $5 }' /proc/self/mountinfo | sort -r)
}

cmd_stop() {
	[[ -d "$DIR/pids" ]] || {
		log "nothing recorded in $DIR"
		return 0
	}
	local f
	local -a clients=()
	for f in "$DIR"/pids/fake-nodes-*.pid; do
		[[ -e "$f" ]] && clients+=("$(basename "$f" .pid)")
	done
	# API clients first (together, Tessera's node process among them), then
	# the API server, then its backends.
	stop_group "$NODE_PID" "${clients[@]}" kubelet kube-scheduler kube-controller-manager
	# A stopped kubelet leaves its pods running: remove them while the
	# runtime is still there, so no shim, mount or network namespace stays.
	if pid_alive containerd && load_state; then
		if ! "$KUBE_BIN" cri-reset --endpoint "unix://$CRI_SOCKET" >>"$(logfile containerd)" 2>&1; then
			log "could not remove every pod from containerd (see $(logfile containerd))"
		fi
	fi
	stop_group kube-apiserver
	stop_group containerd etcd
	remove_pod_network
	unmount_state_dir
	unmount_mps_dir
	log "cluster in $DIR stopped"
}

# ---------------------------------------------------------- kill/revive ----

# Crash tests: `kill NAME` ends one component with SIGKILL, as an OOM kill or
# a lost machine would, and waits until it is gone; `revive NAME` starts it
# again with the command line it was started with and waits until it serves.
component_ready() { # name
	case $1 in
	etcd) etcd_ready ;;
	containerd) containerd_ready ;;
	kube-apiserver) apiserver_ready ;;
	kube-controller-manager) component_healthy "$1" "$CONTROLLER_MANAGER_PORT" ;;
	kube-scheduler) component_healthy "$1" "$SCHEDULER_PORT" ;;
	kubelet) node_ready ;;
	esac
}

known_component() { # name
	local c
	for c in "${COMPONENTS[@]}"; do [[ "$c" == "$1" ]] && return 0; done
	die "unknown component '$1' (one of: ${COMPONENTS[*]})"
}

cmd_kill() { # name
	known_component "${1:-}"
	load_state || die "no cluster state in $DIR"
	local pid
	pid=$(recorded_pid "$1") || die "$1 is not running"
	kill -KILL "$pid"
	while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
	log "killed $1 (pid $pid, SIGKILL)"
}

cmd_revive() { # name
	known_component "${1:-}"
	load_state || die "no cluster state in $DIR"
	local f
	f=$(cmdfile "$1")
	[[ -f "$f" ]] || die "$1 was never started in $DIR"
	local -a argv
	mapfile -d '' -t argv <"$f"
	PATH=${argv[0]} start_external "$1" "${argv[@]:1}"
	wait_for "$START_TIMEOUT" "$1 serving again" component_ready "$1"
}

# --------------------------------------------------------------- status ----

cmd_status() {
	load_state || {
		echo "no cluster state in $DIR"
		return 1
	}
	local rc=0 c want
	for c in "${COMPONENTS[@]}"; do
		want=1
		if [[ "$KUBELET_ENABLED" != 1 ]] && [[ "$c" == kubelet || "$c" == containerd ]]; then want=0; fi
		if pid_alive "$c"; then
			printf '%-26s running (pid %s)\n' "$c" "$(recorded_pid "$c")"
		elif ((want)); then
			printf '%-26s NOT RUNNING\n' "$c"
			rc=1
		else
			printf '%-26s disabled\n' "$c"
		fi
	done
	for f in "$DIR"/pids/fake-nodes-*.pid; do
		[[ -e "$f" ]] || continue
		c=$(basename "$f" .pid)
		if pid_alive "$c"; then printf '%-26s running (pid %s)\n' "$c" "$(recorded_pid "$c")"; else
			printf '%-26s NOT RUNNING\n' "$c"
			rc=1
		fi
	done
	if load_node; then
		c=$NODE_PID
		if pid_alive "$c"; then
			printf '%-26s running (pid %s, driver %s)\n' "$c" "$(recorded_pid "$c")" "$NODE_DRIVER"
		elif [[ -f "$(pidfile "$c")" ]]; then
			printf '%-26s NOT RUNNING (exited; see %s)\n' "$c" "$(node_log)"
			rc=1
		else
			printf '%-26s stopped (node-start restarts it)\n' "$c"
		fi
	fi
	if ((rc == 0)) && ! readyz_ok >/dev/null 2>&1; then
		echo "kube-apiserver /readyz is not ok"
		rc=1
	fi
	((rc == 0)) && echo "cluster in $DIR is running; API server https://127.0.0.1:$APISERVER_PORT"
	return $rc
}

# ------------------------------------------------------------------ env ----

cmd_env() {
	load_state || die "no cluster state in $DIR (run: $0 start)"
	cat <<EOF
export TESSERA_CLUSTER_DIR='$DIR'
export KUBECONFIG='$DIR/kubeconfig'
export TESSERA_KUBE_BIN='$KUBE_BIN'
export TESSERA_KUBE_VERSION='${KUBE_VERSION:-}'
export TESSERA_APISERVER_URL='https://127.0.0.1:$APISERVER_PORT'
export TESSERA_NODE_NAME='$NODE_NAME'
export TESSERA_KUBELET='$KUBELET_ENABLED'
export TESSERA_KUBELET_ROOT_DIR='$DIR/kubelet'
export TESSERA_KUBELET_REGISTRY_DIR='$DIR/kubelet/plugins_registry'
export TESSERA_KUBELET_PLUGINS_DIR='$DIR/kubelet/plugins'
export TESSERA_FEATURE_GATES='$FEATURE_GATES'
export TESSERA_CONTAINER_RUNTIME='containerd'
export TESSERA_CRI_ENDPOINT='unix://$CRI_SOCKET'
export TESSERA_CDI_DIR='$DIR/cdi'
export TESSERA_PROBE_IMAGE='$PROBE_IMAGE'
export PATH='$DIR/bin':"\$PATH"
EOF
	# After node-start: this shell sees the simulated node's machine
	# (`tessera inventory`, `tessera slices`) as the node process does.
	load_node || return 0
	cat <<EOF
export TESSERA_NODE_DRIVER_NAME='$NODE_DRIVER'
export TESSERA_NODE_CDI_DIR='$NODE_DIR/cdi'
export TESSERA_NODE_STATE_DIR='$NODE_DIR/state'
export TESSERA_NODE_DRIVER_ROOT='$(node_driver_root)'
export TESSERA_NODE_MPS_DIR='$(node_mps_dir)'
export TESSERA_NODE_HAMI_CORE_DIR='$(node_hami_core_dir)'
export TESSERA_NODE_LOG='$(node_log)'
export TESSERA_FAKE_NVML_TOPOLOGY='$(sim_kernel_dir)/topology.yaml'
export TESSERA_FAKE_NVML_STATE='$(sim_kernel_dir)/nvml.state'
export TESSERA_FAKE_NVML_LOAD=1
export TESSERA_FAKE_NVML_DRIVER_ROOT='$(node_driver_root)'
export LD_LIBRARY_PATH='$(node_nvml_dir)'"\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF
}

# ------------------------------------------------------------ add-nodes ----

fake_nodes_ready() { # batch-name expected-count
	alive_or_fatal "$1" || return 3
	local n
	n=$(kubectl_ get nodes -l tessera.dev/fake-node=true \
		-o 'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' | grep -c '^True$')
	((n >= $2))
}

cmd_add_nodes() {
	local count=${1:-}
	[[ "$count" =~ ^[1-9][0-9]*$ ]] || die "usage: $0 add-nodes N"
	load_state || die "no cluster state in $DIR (run: $0 start)"
	readyz_ok >/dev/null 2>&1 || die "cluster in $DIR is not running"
	local start=0
	[[ -f "$DIR/fake-nodes.next" ]] && start=$(<"$DIR/fake-nodes.next")
	echo $((start + count)) >"$DIR/fake-nodes.next"
	start_component "fake-nodes-$start" fake-nodes --kubeconfig "$DIR/kubeconfig" \
		--prefix "${TESSERA_FAKE_NODE_PREFIX:-tessera-fake-}" --start-index "$start" --count "$count" \
		--cpu "${TESSERA_FAKE_NODE_CPU:-32}" --memory "${TESSERA_FAKE_NODE_MEMORY:-256Gi}" \
		--pods "${TESSERA_FAKE_NODE_PODS:-110}"
	wait_for "$START_TIMEOUT" "$((start + count)) fake nodes Ready" fake_nodes_ready "fake-nodes-$start" $((start + count))
}

# ----------------------------------------------------------------- node ----
#
# A simulated GPU node on the cluster's kubelet node: Tessera's one node
# process (`tessera plugin`: kubelet plugin and ResourceSlice publisher) over
# the fake libnvidia-ml.so.1. Everything lives in $NODE_DIR and survives
# node-stop, so a restart sees the same simulated GPUs (MIG instances and
# modes) and the same checkpoint, as a restarted DaemonSet pod would.

NODE_DIR="$DIR/node"
NODE_PID=tessera-node # pids/tessera-node.pid, recorded like a component

node_driver_root() { echo "$NODE_DIR/driver"; }
# The fake NVML under the name the loader looks for, in the driver root's
# library directory (Debian's layout, which the probe image's loader
# searches): processes find it there (LD_LIBRARY_PATH) and prepare mounts it
# into containers as it would mount the real library.
node_nvml_dir() { echo "$NODE_DIR/driver/usr/lib/x86_64-linux-gnu"; }
node_log() { echo "$NODE_DIR/tessera.log"; }
# MPS pipes are Unix sockets (paths up to ~100 bytes): a short directory of
# its own per cluster dir.
node_mps_dir() { echo "${TMPDIR:-/tmp}/tessera-mps-$(printf '%s' "$DIR" | sha256sum | cut -c1-8)"; }
MPS_TMPFS_SOURCE=tessera-mps
# A node's /run is a tmpfs, and the chart keeps the MPS daemons' directories
# there (mpsDir: /run/tessera/mps): the simulated node's are on a tmpfs too,
# not on whatever file system holds TMPDIR (on ext4, every directory a
# daemon start creates costs an inode search).
mount_mps_dir() {
	local d
	d=$(node_mps_dir)
	mkdir -p "$d"
	if [[ "$(stat -f -c %T "$d")" != tmpfs ]] &&
		! mount -t tmpfs -o size=256m,mode=700,nosuid,nodev "$MPS_TMPFS_SOURCE" "$d"; then
		log "could not mount a tmpfs on $d; MPS daemons keep their directories on $(stat -f -c %T "$d")"
	fi
	chmod 700 "$d"
}
# Our tmpfs on the MPS directory goes with the cluster (daemons still running
# keep their own views).
unmount_mps_dir() {
	local d
	d=$(node_mps_dir)
	if [[ "$(findmnt -n -o SOURCE --mountpoint "$d" 2>/dev/null)" == "$MPS_TMPFS_SOURCE" ]]; then
		umount -l "$d" || log "could not unmount $d"
	fi
}

# What node.env records (the node's settings, reused by a restart).
NODE_DRIVER=""
NODE_TOPOLOGY_SOURCE=""
load_node() {
	[[ -f "$NODE_DIR/node.env" ]] || return 1
	# shellcheck disable=SC1091
	source "$NODE_DIR/node.env"
}

# The environment every host process of the simulated machine shares
# (NAME=value lines): its topology and machine-wide NVML state (in the
# directory every container sees read-only, see containerd.sh), the load
# directory every process records its GPU use in, the driver root the
# library keeps the MIG capability files in, and the library itself.
node_nvml_env() {
	echo "TESSERA_FAKE_NVML_TOPOLOGY=$(sim_kernel_dir)/topology.yaml"
	echo "TESSERA_FAKE_NVML_STATE=$(sim_kernel_dir)/nvml.state"
	echo "TESSERA_FAKE_NVML_LOAD=1"
	echo "TESSERA_FAKE_NVML_DRIVER_ROOT=$(node_driver_root)"
	echo "LD_LIBRARY_PATH=$(node_nvml_dir)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# Sets TESSERA_BIN_, TESSERA_KIT_ and PROFILE_DIR_ (where the fakes are) from
# cargo's target dir (profile TESSERA_PROFILE, default debug; the benchmark
# uses release); this script builds none of them.
node_binaries() {
	local target="${CARGO_TARGET_DIR:-$REPO_ROOT/target}" profile="${TESSERA_PROFILE:-debug}" f
	case "$target" in /*) ;; *) target="$PWD/$target" ;; esac
	PROFILE_DIR_="$target/$profile"
	TESSERA_BIN_="$PROFILE_DIR_/tessera"
	TESSERA_KIT_="$PROFILE_DIR_/tessera-kit"
	for f in "$TESSERA_BIN_" "$TESSERA_KIT_" "$PROFILE_DIR_/libtessera_fake_nvml.so" "$PROFILE_DIR_/libtessera_fake_cuda.so" \
		"$PROFILE_DIR_/fake-mps-control" "$PROFILE_DIR_/nvidia-smi"; do
		[[ -e "$f" ]] || die "missing $f: run cargo build -p tessera-driver -p tessera-fake-nvml -p tessera-fake-cuda -p tessera-test-kit$([[ $profile == release ]] && echo ' --release') (with the same CARGO_TARGET_DIR)"
	done
}

# The driver root a real node has, built by the test kit as every test
# builds it (driver/test-kit/src/driver_root.rs): device nodes for every GPU
# the simulated machine reports (asked with its environment, which also
# seeds its state and capability files), the control and uvm nodes, the
# fake NVML and CUDA libraries, nvidia-smi and the MPS control binary.
# Sets NODE_GPUS_.
make_driver_root() {
	local -a nvml_env
	mapfile -t nvml_env < <(node_nvml_env)
	NODE_GPUS_=$(env "${nvml_env[@]}" "$TESSERA_KIT_" driver-root "$(node_driver_root)" \
		--fakes "$PROFILE_DIR_" --tessera "$TESSERA_BIN_") || die "building the simulated node's driver root failed"
	((NODE_GPUS_ > 0)) || die "tessera inventory reports no GPUs for $(sim_kernel_dir)/topology.yaml"
}

# A stand-in for HAMi-core (the directory --hami-core-dir names): an empty
# shared object as libvgpu.so (a real ELF the dynamic loader accepts and
# that intercepts nothing; an empty file without a C compiler) and the
# preload file listing it where containers see it. Prepare mounts both into
# Isolated shares of GPUs whose policy says `isolationProvider: hami-core`.
node_hami_core_dir() { echo "$NODE_DIR/hami-core"; }
make_hami_core_standin() {
	local dir
	dir=$(node_hami_core_dir)
	mkdir -p "$dir"
	if [[ ! -s "$dir/libvgpu.so" ]]; then
		if ! cc -shared -nostdlib -o "$dir/libvgpu.so.tmp" -x c /dev/null 2>/dev/null; then
			: >"$dir/libvgpu.so.tmp"
		fi
		mv "$dir/libvgpu.so.tmp" "$dir/libvgpu.so"
	fi
	echo /usr/local/vgpu/libvgpu.so >"$dir/ld.so.preload.tmp"
	mv "$dir/ld.so.preload.tmp" "$dir/ld.so.preload"
}

# Log lines written since byte offset $1 (the log is appended across restarts).
node_log_since() { tail -c +"$(($1 + 1))" "$(node_log)"; }

node_alive_or_fatal() { # log-offset
	pid_alive "$NODE_PID" && return 0
	{
		log "tessera plugin exited; its log since this start ($(node_log)):"
		node_log_since "$1" | tail -n 40 || true
	} >&4 2>&4
	return 3
}

node_health_socket() { echo "$NODE_DIR/health.sock"; }

# The node process says it serves (`tessera health --probe status`): the
# kubelet accepted its registration, and it has published the pool (or
# found it up to date).
node_serving() { # log-offset
	node_alive_or_fatal "$1" || return 3
	"$TESSERA_BIN_" health --socket "$(node_health_socket)" --probe status >/dev/null 2>&1
}

# The API server holds all of the pool's slices: as many of the newest
# generation as they say the pool has.
node_published() { # log-offset
	node_alive_or_fatal "$1" || return 3
	local listing
	listing=$(kubectl_ get resourceslices --field-selector "spec.nodeName=$NODE_NAME,spec.driver=$NODE_DRIVER" \
		-o 'jsonpath={range .items[*]}{.spec.pool.generation} {.spec.pool.resourceSliceCount}{"\n"}{end}') || return 1
	awk 'NF == 2 { n[$1]++; want[$1] = $2; if (!seen || $1 + 0 > max + 0) { max = $1; seen = 1 } }
		END { exit !(seen && n[max] == want[max]) }' <<<"$listing"
}

cmd_node_start() {
	local topology="" policy="" driver="" cdi_dir="" a
	local -a extra=()
	while (($#)); do
		a=$1
		shift
		case "$a" in
		--topology | --policy | --driver-name | --cdi-dir)
			(($#)) || die "$a needs a value"
			case "$a" in
			--topology) topology=$1 ;;
			--policy) policy=$1 ;;
			--cdi-dir) cdi_dir=$1 ;;
			*) driver=$1 ;;
			esac
			shift
			;;
		--)
			extra=("$@")
			break
			;;
		*) die "node-start: unknown argument '$a' (usage: $0 node-start --topology FILE [--policy FILE] [--driver-name NAME] [--cdi-dir DIR] [-- PLUGIN FLAGS...])" ;;
		esac
	done
	load_state || die "no cluster state in $DIR (run: $0 start)"
	[[ "$KUBELET_ENABLED" == 1 ]] || die "the cluster in $DIR runs without a kubelet (TESSERA_KUBELET=0): no node to run Tessera on"
	readyz_ok >/dev/null 2>&1 || die "the cluster in $DIR is not running (run: $0 start)"
	pid_alive kubelet || die "the kubelet of the cluster in $DIR is not running"
	[[ -z "$topology" || -f "$topology" ]] || die "no topology file $topology"
	[[ -z "$policy" || -f "$policy" ]] || die "no policy file $policy"

	# One node dir is one machine: its NVML state belongs to its topology,
	# its checkpoint and its slices to its driver name.
	if load_node; then
		if [[ -n "$topology" ]] && ! cmp -s "$topology" "$(sim_kernel_dir)/topology.yaml"; then
			die "the node in $NODE_DIR simulates another machine ($NODE_TOPOLOGY_SOURCE); for a new one: $0 node-stop && rm -rf $NODE_DIR"
		fi
		if [[ -n "$driver" && "$driver" != "$NODE_DRIVER" ]]; then
			die "the node in $NODE_DIR runs driver $NODE_DRIVER; for $driver: $0 node-stop && rm -rf $NODE_DIR"
		fi
	else
		[[ -n "$topology" ]] || die "the first node-start needs --topology FILE (see driver/fake-nvml/topologies/)"
		# A new machine: nothing of the last one's GPU state stays.
		find "$(sim_kernel_dir)" -mindepth 1 -delete 2>/dev/null || true
		NODE_DRIVER=${driver:-gpu.tessera.dev}
		NODE_TOPOLOGY_SOURCE="$(cd "$(dirname "$topology")" && pwd)/$(basename "$topology")"
	fi
	if pid_alive "$NODE_PID"; then
		if [[ -n "$policy" ]] && ! cmp -s "$policy" "$NODE_DIR/policy.yaml"; then
			die "the node runs with another policy; $0 node-stop first"
		fi
		log "tessera plugin already running on $NODE_NAME (pid $(recorded_pid "$NODE_PID"), driver $NODE_DRIVER)"
		return 0
	fi
	node_binaries

	cdi_dir=${cdi_dir:-$NODE_DIR/cdi}
	mkdir -p "$cdi_dir" "$NODE_DIR/state" "$(sim_kernel_dir)"
	mount_mps_dir
	if [[ ! -f "$(sim_kernel_dir)/topology.yaml" ]]; then
		cp "$topology" "$(sim_kernel_dir)/topology.yaml.tmp"
		mv "$(sim_kernel_dir)/topology.yaml.tmp" "$(sim_kernel_dir)/topology.yaml"
	fi
	if [[ -n "$policy" ]]; then
		cp "$policy" "$NODE_DIR/policy.yaml.tmp"
		mv "$NODE_DIR/policy.yaml.tmp" "$NODE_DIR/policy.yaml"
	fi
	printf "NODE_DRIVER='%s'\nNODE_TOPOLOGY_SOURCE='%s'\n" "$NODE_DRIVER" "$NODE_TOPOLOGY_SOURCE" >"$NODE_DIR/node.env.tmp"
	mv "$NODE_DIR/node.env.tmp" "$NODE_DIR/node.env"

	local NODE_GPUS_
	make_driver_root
	make_hami_core_standin
	local -a nvml_env plugin_args
	mapfile -t nvml_env < <(node_nvml_env)
	plugin_args=(--nvml-library "$(node_nvml_dir)/libnvidia-ml.so.1" plugin
		--node-name "$NODE_NAME" --driver-name "$NODE_DRIVER" --kubeconfig "$DIR/kubeconfig"
		--kubelet-registry-dir "$DIR/kubelet/plugins_registry" --kubelet-plugins-dir "$DIR/kubelet/plugins"
		--cdi-dir "$cdi_dir" --state-dir "$NODE_DIR/state" --driver-root "$(node_driver_root)"
		--mps-dir "$(node_mps_dir)" --hami-core-dir "$(node_hami_core_dir)"
		--health-socket "$(node_health_socket)")
	if [[ -f "$NODE_DIR/policy.yaml" ]]; then plugin_args+=(--policy "$NODE_DIR/policy.yaml"); fi
	plugin_args+=("${extra[@]}")

	local lf offset pid
	lf=$(node_log)
	printf '\n==== tessera plugin start %s\n' "$(date -u +%FT%TZ)" >>"$lf"
	offset=$(stat -c %s "$lf")
	ln -sfn "$lf" "$(logfile "$NODE_PID")" # so that `logs tessera-node` finds it
	# Flags only: drop variables the plugin would read for flags not given here.
	setsid env -u TESSERA_POLICY -u TESSERA_DEV_ROOT -u TESSERA_BOOT_ID_FILE -u TESSERA_NVML_LIBRARY \
		"${nvml_env[@]}" RUST_LOG="${RUST_LOG:-info}" NO_COLOR=1 \
		"$TESSERA_BIN_" "${plugin_args[@]}" >>"$lf" 2>&1 </dev/null 4>&- 9>&- &
	pid=$!
	echo "$pid $(proc_starttime "$pid")" >"$(pidfile "$NODE_PID")"
	log "started tessera plugin on node $NODE_NAME: $NODE_GPUS_ simulated GPUs ($(basename "$NODE_TOPOLOGY_SOURCE")), driver $NODE_DRIVER (pid $pid, log $lf)"
	local hint="tessera plugin did not come up (log: $lf; if it still runs, $0 node-stop stops it)"
	wait_for "$START_TIMEOUT" "tessera plugin registered with the kubelet and its slices published" node_serving "$offset" || die "$hint"
	wait_for "$START_TIMEOUT" "ResourceSlices of $NODE_NAME ($NODE_DRIVER) published" node_published "$offset" || die "$hint"
	log "node state in $NODE_DIR; use it with: eval \"\$($0 env)\""
}

cmd_node_stop() {
	if ! pid_alive "$NODE_PID"; then
		rm -f "$(pidfile "$NODE_PID")"
		log "no tessera plugin running for $DIR"
		return 0
	fi
	stop_group "$NODE_PID"
	log "node state kept in $NODE_DIR (node-start restarts the same machine)"
}

# ----------------------------------------------------------------- logs ----

cmd_logs() {
	[[ -d "$DIR/logs" ]] || die "no logs in $DIR/logs"
	local follow=0 comp=""
	for a in "$@"; do
		case "$a" in
		-f | --follow) follow=1 ;;
		*) comp=$a ;;
		esac
	done
	if [[ -n "$comp" ]]; then
		local f
		f=$(logfile "$comp")
		[[ -f "$f" ]] || die "no log for '$comp'; have: $(cd "$DIR/logs" && ls)"
		if ((follow)); then exec tail -n 100 -F "$f"; else tail -n "${TESSERA_LOG_LINES:-200}" "$f"; fi
		return
	fi
	echo "logs in $DIR/logs:"
	local f
	for f in "$DIR"/logs/*.log; do
		[[ -e "$f" ]] || continue
		printf '\n--- %s (%s bytes) ---\n' "$f" "$(stat -L -c %s "$f")"
		tail -n "${TESSERA_LOG_LINES:-15}" "$f"
	done
}

# shellcheck source=conformance/cluster/containerd.sh
source "$SRC/containerd.sh"

usage() {
	sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'
	cat <<EOF

state dir: $DIR (TESSERA_CLUSTER_DIR)
build cache: $CACHE/kube (TESSERA_CACHE)
EOF
}

main() {
	local cmd=${1:-}
	[[ $# -gt 0 ]] && shift
	case "$cmd" in
	build) cmd_build ;;
	kube-bin) ensure_binary ;;
	start) cmd_start ;;
	stop) cmd_stop ;;
	status) cmd_status ;;
	env) cmd_env ;;
	add-nodes) cmd_add_nodes "$@" ;;
	node-start) cmd_node_start "$@" ;;
	node-stop) cmd_node_stop ;;
	logs) cmd_logs "$@" ;;
	kill) cmd_kill "$@" ;;
	revive) cmd_revive "$@" ;;
	-h | --help | help) usage ;;
	*)
		usage >&2
		exit 2
		;;
	esac
}

main "$@"
