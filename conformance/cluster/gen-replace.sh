#!/usr/bin/env bash
# Pins conformance/cluster to a Kubernetes release.
#
# k8s.io/kubernetes requires its staging modules (k8s.io/api, client-go,
# kubelet, ...) at v0.0.0 and replaces them with directories inside its own
# repository, which a consumer cannot see. This script reads the release's
# go.mod, and writes a replace block that pins every staging module to the
# matching published tag (v1.X.Y -> v0.X.Y), then tidies the module.
#
# usage: conformance/cluster/gen-replace.sh [v1.36.3]   (default: current pin)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

version=${1:-$(awk '$1 == "k8s.io/kubernetes" { print $2; exit }' go.mod)}
[[ "$version" =~ ^v1\.[0-9]+\.[0-9]+$ ]] || {
	echo "want a release like v1.36.3, got '$version'" >&2
	exit 2
}
staging_version="v0.${version#v1.}"

gomod=$(go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
[[ -f "$gomod" ]] || {
	echo "could not download go.mod of k8s.io/kubernetes@$version" >&2
	exit 1
}
mapfile -t staging < <(awk '$2 == "=>" && $3 ~ /^\.\/staging\// { print $1 }' "$gomod" | LC_ALL=C sort -u)
((${#staging[@]} > 0)) || {
	echo "no staging replace lines found in $gomod" >&2
	exit 1
}

go mod edit -require="k8s.io/kubernetes@$version"
for m in "${staging[@]}"; do
	go mod edit -replace="$m=$m@$staging_version"
done
# Drop replaces for staging modules that the release no longer has.
while read -r m; do
	printf '%s\n' "${staging[@]}" | grep -qxF "$m" || go mod edit -dropreplace="$m"
done < <(awk '$2 == "=>" && $1 ~ /^k8s\.io\// { print $1 }' go.mod)
go mod tidy
echo "pinned k8s.io/kubernetes $version, ${#staging[@]} staging modules at $staging_version"
