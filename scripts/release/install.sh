#!/usr/bin/env bash
# Puts `voiceclone` on the PATH (docs/architecture.md §9.4).
#
#   bash scripts/release/install.sh                    # build the static release binary, then install it
#   bash scripts/release/install.sh --binary FILE      # install a release binary you were given
#   bash scripts/release/install.sh --prefix DIR       # into DIR/bin (default /usr/local as root,
#                                              # ~/.local otherwise)
#
# From source it runs scripts/release/release.sh (Debian build dependencies, the musl target, zig from
# PyPI: about six minutes on two cores the first time). The binary is copied beside its
# destination and renamed into place, so a running voiceclone is never cut short, and only a
# voiceclone is ever replaced: another program of that name is left alone.
set -euo pipefail
script=$(realpath "$0")

binary=""
prefix=""
while (($#)); do
    case "$1" in
        --binary) binary=${2:?--binary needs a file}; shift 2 ;;
        --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
        -h|--help) sed -n '2,13p' "$script" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [[ -z $prefix ]]; then
    if [[ $EUID -eq 0 ]]; then prefix=/usr/local; else prefix=$HOME/.local; fi
fi
# Paths the user gave are taken from where the script was started.
prefix=$(realpath -m "$prefix")
[[ -z $binary ]] || binary=$(realpath -m "$binary")

if [[ -z $binary ]]; then
    binary=$(cd "$(dirname "$script")/../.." && bash scripts/release/release.sh | tail -n 1)
fi
[[ -f $binary && -x $binary ]] || { echo "error: $binary is not an executable file" >&2; exit 1; }
version=$("$binary" --version 2>/dev/null | head -n 1) || true
[[ $version == voiceclone\ * ]] ||
    { echo "error: $binary does not run as voiceclone on this machine (--version said: ${version:-nothing})" >&2; exit 1; }

dest_dir=$prefix/bin
dest=$dest_dir/voiceclone
mkdir -p "$dest_dir"
if [[ -e $dest ]]; then
    old=$("$dest" --version 2>/dev/null | head -n 1) || true
    if [[ $old != voiceclone\ * ]]; then
        echo "error: $dest exists and is not voiceclone; remove or rename it, or choose --prefix" >&2
        exit 1
    fi
fi
tmp=$(mktemp "$dest_dir/.voiceclone.XXXXXX")
trap 'rm -f "$tmp"' EXIT
cp "$binary" "$tmp"
chmod 755 "$tmp"
mv -f "$tmp" "$dest"
trap - EXIT
echo "installed $version as $dest"
case ":$PATH:" in
    *":$dest_dir:"*) ;;
    *) echo "note: $dest_dir is not on your PATH; add it, e.g. export PATH=\"$dest_dir:\$PATH\"" ;;
esac
