#!/usr/bin/env bash
# What a machine needs for the local cluster, the demo and the tests: one
# table (command or file -> Debian package -> why), read by everything that
# checks or installs prerequisites (cluster.sh, demo.sh, test-all.sh).
#
# usage: conformance/cluster/prereqs.sh check  [--for WHO] GROUP...
#        conformance/cluster/prereqs.sh ensure [--for WHO] GROUP...
#        conformance/cluster/prereqs.sh confine GROUP... -- COMMAND [ARGS...]
#        conformance/cluster/prereqs.sh selftest
#        conformance/cluster/prereqs.sh list
#   check    exits 1 when something is missing, naming each item, why it is
#            needed and the command that fixes it; installs nothing
#   ensure   installs what is missing from Debian (apt-get, as root) and says
#            what and why; fails at once, naming the fix, for what it cannot
#            install (Go, Rust, root, a machine without apt-get)
#   confine  runs COMMAND with a PATH of only the table's commands (of the
#            groups and base): a command its scripts call that the table
#            lacks is "not found" there
#   selftest proves check and ensure notice each missing item: hides every
#            non-base item in a mount namespace of its own (root, seconds)
# groups: base (always included), go, rust, cluster, node, tests
#
# Also sourced (by containerd.sh, so by cluster.sh and image.sh): prereq_check,
# prereq_ensure and the paths RUNC, CNI_BIN_DIR and CNI_PLUGINS.

PREREQ_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PREREQ_SELF="$PREREQ_ROOT/conformance/cluster/prereqs.sh"

RUNC=${TESSERA_RUNC:-/usr/sbin/runc}
CNI_BIN_DIR=/usr/lib/cni
CNI_PLUGINS=(bridge host-local loopback)

# group | Debian package (- when apt cannot provide it) | what must be there | why
#   what: cmd:NAME (on PATH), file:PATH (executable), go, rust, root.
# base: Debian's essential tools the scripts use; never hidden by selftest.
prereq_table() {
	local cni="" p
	for p in "${CNI_PLUGINS[@]}"; do cni+=" file:$CNI_BIN_DIR/$p"; done
	cat <<EOF
base    | bash           | cmd:bash | runs these scripts
base    | dash           | cmd:sh | runs the API server's mount of its /etc/hosts
base    | coreutils      | cmd:basename cmd:cat cmd:chmod cmd:cp cmd:cut cmd:date cmd:dirname cmd:env cmd:head cmd:ln cmd:ls cmd:mkdir cmd:mknod cmd:mktemp cmd:mv cmd:rm cmd:rmdir cmd:sha256sum cmd:sleep cmd:sort cmd:stat cmd:tail cmd:touch cmd:tr cmd:wc | file and text tools of the scripts
base    | grep           | cmd:grep | searches logs and output
base    | sed            | cmd:sed | edits and extracts text
base    | mawk           | cmd:awk | extracts fields of listings
base    | findutils      | cmd:find cmd:xargs | hashes the Go sources, prunes old builds
base    | diffutils      | cmd:cmp | compares a node's topology and policy with the last ones
go      | -              | go | builds Kubernetes, containerd and helm from their Go modules
rust    | -              | rust | builds Tessera and the simulated GPU libraries (cargo)
rust    | gcc            | cmd:cc | the linker cargo uses
cluster | util-linux     | cmd:flock cmd:setsid cmd:unshare | one build at a time (flock), components detached from the terminal (setsid), the API server's own /etc/hosts (unshare)
cluster | mount          | cmd:mount cmd:umount | the API server's /etc/hosts; unmounts the kubelet's volumes at stop
cluster | curl           | cmd:curl | health checks of etcd and the control plane
node    | -              | root | containerd and the kubelet run containers, mount volumes and create device nodes
node    | runc           | file:$RUNC | containerd runs the pods' containers with it
node    | containernetworking-plugins |$cni | the pods' network (bridge, host-local, loopback)
node    | busybox-static | file:/bin/busybox | the shell and tools of the local images (probe, pause)
node    | python3        | cmd:python3 | writes containerd's base OCI spec
node    | iproute2       | cmd:ip | makes the pod bridge with the host's address at start, deletes it at stop
node    | libc-bin       | cmd:ldconfig | finds the host's glibc for the probe image
node    | tar            | cmd:tar | packs the local images
tests   | podman         | cmd:podman | the CDI consumer test (driver/tests/cdi_podman.rs) runs a container with it
tests   | openssl        | cmd:openssl | the webhook tests (webhook.rs, helm_install.rs) make their CA and serving certificates
EOF
}

prereq_say() { printf '[prereqs] %s\n' "$*" >&2; }

# Rows of the table for the groups named (base always), fields trimmed and
# separated by tabs: group, package, what, why.
prereq_rows() {
	local want=" base $* "
	prereq_table | awk -F'|' -v want="$want" '
		function trim(s) { gsub(/^[ \t]+|[ \t]+$/, "", s); return s }
		index(want, " " trim($1) " ") { print trim($1) "\t" trim($2) "\t" trim($3) "\t" trim($4) }'
}

# bash's lookup falls back to a file that is not executable: ask for one that is.
prereq_have() {
	local p
	p=$(type -P "$1") && [[ -f "$p" && -x "$p" ]]
}

prereq_version_ge() { # have want
	[[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" == "$2" ]]
}

prereq_go_min() { awk '$1 == "go" { print $2; exit }' "$PREREQ_ROOT/conformance/cluster/go.mod"; }
prereq_rust_min() { sed -n 's/^rust-version *= *"\(.*\)"/\1/p' "$PREREQ_ROOT/Cargo.toml" | head -n 1; }

# Prints why one item is missing (nothing when it is there); the fix for
# items apt cannot provide comes with it.
prereq_item_missing() {
	local item=$1 have want
	case "$item" in
	cmd:*) prereq_have "${item#cmd:}" || echo "${item#cmd:} is not on PATH" ;;
	file:*) [[ -x "${item#file:}" && -f "${item#file:}" ]] || echo "${item#file:} is missing" ;;
	root) ((EUID == 0)) || echo "not running as root; fix: run it as root" ;;
	go)
		want=$(prereq_go_min)
		if ! prereq_have go; then
			echo "go is not on PATH; fix: install Go >= $want (https://go.dev/dl) and put its bin directory on PATH"
			return
		fi
		have=$(go env GOVERSION 2>/dev/null) || have=go0
		have=${have#go}
		# From Go 1.21 on, go fetches the toolchain a go.mod asks for by itself.
		prereq_version_ge "$have" "$want" ||
			{ prereq_version_ge "$have" 1.21 && [[ "$(go env GOTOOLCHAIN)" != local ]]; } ||
			echo "go $have is older than the $want conformance/cluster/go.mod needs; fix: install Go >= $want (https://go.dev/dl)"
		;;
	rust)
		want=$(prereq_rust_min)
		if ! prereq_have cargo; then
			echo "cargo is not on PATH; fix: install Rust >= $want with rustup (https://rustup.rs) and put ~/.cargo/bin on PATH"
			return
		fi
		have=$(cargo --version 2>/dev/null | awk '{ print $2 }')
		prereq_version_ge "${have%%-*}" "$want" ||
			echo "cargo $have is older than the rust-version $want of Cargo.toml; fix: rustup update stable"
		;;
	*) echo "unknown prerequisite '$item' in $PREREQ_SELF" ;;
	esac
}

# Fills PREREQ_MISSING (one line per missing item: what, package, why),
# PREREQ_PACKAGES (Debian packages that provide missing items) and
# PREREQ_NOT_APT (missing items apt cannot provide). Returns 1 when anything
# is missing.
prereq_scan() {
	PREREQ_MISSING=()
	PREREQ_PACKAGES=()
	PREREQ_NOT_APT=0
	local group pkg what why item reason
	while IFS=$'\t' read -r group pkg what why; do
		for item in $what; do
			reason=$(prereq_item_missing "$item")
			[[ -n "$reason" ]] || continue
			if [[ "$reason" == *"; fix: "* ]]; then
				PREREQ_MISSING+=("${reason%%; fix: *} ($why); fix: ${reason#*; fix: }")
				PREREQ_NOT_APT=$((PREREQ_NOT_APT + 1))
			elif [[ "$pkg" == - ]]; then
				PREREQ_MISSING+=("$reason ($why)")
				PREREQ_NOT_APT=$((PREREQ_NOT_APT + 1))
			else
				PREREQ_MISSING+=("$reason (Debian package $pkg: $why)")
				[[ " ${PREREQ_PACKAGES[*]} " == *" $pkg "* ]] || PREREQ_PACKAGES+=("$pkg")
			fi
		done
	done < <(prereq_rows "$@")
	((${#PREREQ_MISSING[@]} == 0))
}

prereq_apt_fix() { echo "apt-get update && apt-get install -y --no-install-recommends ${PREREQ_PACKAGES[*]}"; }

prereq_report() { # who
	local m
	prereq_say "error: $1 needs what this machine lacks:"
	for m in "${PREREQ_MISSING[@]}"; do prereq_say "  $m"; done
	((${#PREREQ_PACKAGES[@]} == 0)) || prereq_say "fix (as root): $(prereq_apt_fix)"
}

# prereq_check [--for WHO] GROUP...
prereq_check() {
	local who="this"
	[[ "${1:-}" == --for ]] && { who=$2 && shift 2; }
	prereq_scan "$@" && return 0
	prereq_report "$who"
	return 1
}

# prereq_ensure [--for WHO] GROUP...
prereq_ensure() {
	local who="this" pkg why
	[[ "${1:-}" == --for ]] && { who=$2 && shift 2; }
	prereq_scan "$@" && return 0
	# What apt cannot provide stops everything before anything is installed.
	if ((PREREQ_NOT_APT > 0)); then
		prereq_report "$who"
		return 1
	fi
	if ((EUID != 0)) || ! prereq_have apt-get; then
		prereq_report "$who"
		prereq_say "cannot install them here ($( ((EUID != 0)) && echo "not root" || echo "no apt-get"))"
		return 1
	fi
	prereq_say "$who needs these Debian packages; installing them with apt-get:"
	for pkg in "${PREREQ_PACKAGES[@]}"; do
		why=$(prereq_rows "$@" | awk -F'\t' -v p="$pkg" '$2 == p { print $4; exit }')
		prereq_say "  $pkg: $why"
	done
	local apt_log t0=$SECONDS
	apt_log=$(mktemp "${TMPDIR:-/tmp}/tessera-apt.XXXXXX")
	if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends "${PREREQ_PACKAGES[@]}"; } >"$apt_log" 2>&1; then
		tail -n 20 "$apt_log" >&2
		prereq_say "error: installing ${PREREQ_PACKAGES[*]} failed (apt-get's output: $apt_log); fix: $(prereq_apt_fix)"
		return 1
	fi
	rm -f "$apt_log"
	prereq_say "installed ${PREREQ_PACKAGES[*]} ($((SECONDS - t0))s)"
	# A package may not provide what was asked (TESSERA_RUNC elsewhere, or
	# an installed package whose file was removed).
	prereq_scan "$@" && return 0
	prereq_report "$who"
	prereq_say "still missing after apt-get; if the package is installed: apt-get install --reinstall ${PREREQ_PACKAGES[*]}"
	return 1
}

# prereq_confine GROUP... -- COMMAND...: COMMAND runs with a PATH of one
# directory holding the table's commands of the groups (and base), so what
# it and everything it starts look up on PATH must be in the table.
# Toolchain launchers (rustup's cargo, a pyenv python3) look for their own
# parts on PATH: those get a wrapper that runs them with the caller's PATH.
# The directory stays: components COMMAND started keep it as their PATH.
PREREQ_OWN_PATH=" go cargo cc python3 "
prereq_confine() {
	local groups=() dir group pkg what why item real
	while (($#)) && [[ "$1" != -- ]]; do
		groups+=("$1")
		shift
	done
	[[ "${1:-}" == -- ]] && shift
	(($#)) || {
		prereq_say "usage: $PREREQ_SELF confine GROUP... -- COMMAND [ARGS...]"
		return 2
	}
	# One directory per set of groups and caller's PATH, refreshed each time.
	dir="${TMPDIR:-/tmp}/tessera-confined-$(printf '%s\n' "${groups[*]}" "$PATH" | sha256sum | cut -c1-12)"
	mkdir -p "$dir"
	while IFS=$'\t' read -r group pkg what why; do
		for item in $what; do
			case "$item" in
			cmd:*) item=${item#cmd:} ;;
			go) item=go ;;
			rust) item=cargo ;;
			*) continue ;;
			esac
			prereq_have "$item" || continue
			real=$(type -P "$item")
			if [[ "$PREREQ_OWN_PATH" == *" $item "* ]]; then
				printf '#!/bin/sh\nPATH=%q exec %q "$@"\n' "$PATH" "$real" >"$dir/$item.tmp"
				chmod +x "$dir/$item.tmp"
				mv -f "$dir/$item.tmp" "$dir/$item"
			else
				ln -sfn "$real" "$dir/$item"
			fi
		done
	done < <(prereq_rows "${groups[@]}")
	PATH="$dir" "$@"
}

# ------------------------------------------------------------- selftest ----

# Inside a mount namespace of its own: hides every item outside base (an
# empty, non-executable file mounted over each path it resolves to), then
# asserts that check names each one with its package and fix, and that
# ensure without apt-get fails at once the same way.
prereq_selftest_hidden() { # work dir
	local empty=$1/empty mount_bin=$1/mount group pkg what why item path groups=(go rust cluster node tests) out rc t0
	local -a expect=() hidden=()
	: >"$empty"
	chmod 644 "$empty"
	while IFS=$'\t' read -r group pkg what why; do
		[[ "$group" != base ]] || continue
		for item in $what; do
			case "$item" in
			cmd:*)
				mapfile -t -O "${#hidden[@]}" hidden < <(type -aP "${item#cmd:}")
				expect+=("${item#cmd:} is not on PATH (Debian package $pkg: $why)")
				;;
			file:*)
				[[ ! -e "${item#file:}" ]] || hidden+=("${item#file:}")
				expect+=("${item#file:} is missing (Debian package $pkg: $why)")
				;;
			go)
				mapfile -t -O "${#hidden[@]}" hidden < <(type -aP go)
				expect+=("go is not on PATH ($why); fix: install Go >= $(prereq_go_min)")
				;;
			rust)
				mapfile -t -O "${#hidden[@]}" hidden < <(type -aP cargo)
				expect+=("cargo is not on PATH ($why); fix: install Rust >= $(prereq_rust_min) with rustup")
				;;
			esac # root: not something a mount hides
		done
	done < <(prereq_rows "${groups[@]}")
	mapfile -t -O "${#hidden[@]}" hidden < <(type -aP apt-get)
	# mount itself is among the hidden: a copy of it does the mounting.
	cp "$(type -P mount)" "$mount_bin"
	for path in "${hidden[@]}"; do
		"$mount_bin" --bind "$empty" "$path" || {
			prereq_say "selftest: cannot hide $path"
			return 1
		}
	done

	rc=0
	out=$("$PREREQ_SELF" check --for selftest "${groups[@]}" 2>&1) || rc=$?
	((rc == 1)) || {
		prereq_say "selftest: check exited $rc with every item hidden, not 1; it said: $out"
		return 1
	}
	prereq_selftest_expect "check" "$out" "${expect[@]}" || return 1
	prereq_scan "${groups[@]}" || true
	[[ "$out" == *"fix (as root): $(prereq_apt_fix)"* ]] || {
		prereq_say "selftest: check did not print the apt-get fix for ${PREREQ_PACKAGES[*]}; it said: $out"
		return 1
	}

	# Without Go and Rust ensure must stop before installing anything; with
	# them, the Debian packages alone need apt-get, hidden here: at once too.
	local ensure_groups
	for ensure_groups in "${groups[*]}" "cluster node tests"; do
		t0=$SECONDS
		rc=0
		# shellcheck disable=SC2086 # a list of groups
		out=$("$PREREQ_SELF" ensure --for selftest $ensure_groups 2>&1) || rc=$?
		((rc == 1 && SECONDS - t0 <= 10)) || {
			prereq_say "selftest: ensure $ensure_groups exited $rc after $((SECONDS - t0))s, not 1 within 10s; it said: $out"
			return 1
		}
		[[ "$out" != *"installing"* ]] || {
			prereq_say "selftest: ensure $ensure_groups tried to install without apt-get: $out"
			return 1
		}
	done
	[[ "$out" == *"cannot install them here"* && "$out" == *"fix (as root): apt-get"* ]] || {
		prereq_say "selftest: ensure without apt-get did not say it cannot install, with the fix: $out"
		return 1
	}
	prereq_say "selftest: check and ensure name all ${#expect[@]} hidden items with their fix"
}

prereq_selftest_expect() { # what output expected-line...
	local what=$1 out=$2 line
	shift 2
	for line in "$@"; do
		[[ "$out" == *"$line"* ]] || {
			prereq_say "selftest: $what did not report: $line"
			prereq_say "it said: $out"
			return 1
		}
	done
}

prereq_selftest() {
	((EUID == 0)) || {
		prereq_say "selftest: needs root (it mounts over files in a mount namespace of its own)"
		return 1
	}
	# This machine itself must have everything outside the tests group.
	prereq_check --for "selftest (this machine)" go rust cluster node || return 1
	local work rc=0
	work=$(mktemp -d "${TMPDIR:-/tmp}/tessera-prereqs.XXXXXX")
	unshare --mount --propagation private -- "$PREREQ_SELF" _selftest-hidden "$work" || rc=$?
	rm -rf "$work"
	return "$rc"
}

prereq_main() {
	local cmd=${1:-}
	(($#)) && shift
	case "$cmd" in
	check) prereq_check "$@" ;;
	ensure) prereq_ensure "$@" ;;
	confine) prereq_confine "$@" ;;
	selftest) prereq_selftest ;;
	_selftest-hidden) prereq_selftest_hidden "$@" ;;
	list) prereq_rows go rust cluster node tests | awk -F'\t' '{ printf "%-8s %-28s %s\n%37s%s\n", $1, $2, $3, "", $4 }' ;;
	*)
		sed -n '2,21p' "$PREREQ_SELF" | sed 's/^# \{0,1\}//' >&2
		return 2
		;;
	esac
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
	set -euo pipefail
	prereq_main "$@"
fi
