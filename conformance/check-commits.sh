#!/usr/bin/env bash
# Every commit since the habit was written down says what it does in a
# subject of at most 72 characters, then a blank line, then why.
#
# usage: conformance/check-commits.sh [SINCE]   (default: when this check began)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SINCE=${1:-4dc49a131ff71e173349674fdc155158d702b701}
if ! git rev-parse --git-dir >/dev/null 2>&1; then
	echo "check-commits: not a git checkout; nothing to check" >&2
	exit 0
fi
if ! git cat-file -e "$SINCE^{commit}" 2>/dev/null; then
	echo "check-commits: $SINCE is not in this history (shallow clone?); nothing to check" >&2
	exit 0
fi

bad=0
while read -r commit; do
	subject=$(git log -1 --format=%s "$commit")
	second=$(git log -1 --format=%B "$commit" | sed -n 2p)
	body=$(git log -1 --format=%b "$commit" | grep -c . || true)
	problems=()
	((${#subject} <= 72)) || problems+=("subject is ${#subject} characters (at most 72)")
	[[ -z "$second" ]] || problems+=("no blank line after the subject")
	((body > 0)) || problems+=("no body saying why")
	if ((${#problems[@]})); then
		printf 'check-commits: %s "%s": %s\n' "${commit:0:12}" "$subject" "$(IFS=';'; echo "${problems[*]}")" >&2
		bad=1
	fi
done < <(git rev-list --no-merges "$SINCE..HEAD")
exit "$bad"
