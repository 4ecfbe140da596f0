#!/bin/sh
# Install kvtierd as a systemd service from this checkout: a virtual environment holding the
# package, the unit with the drop-in that runs it from there, the system user and group, the
# directories, the example configuration (only where there is none) and the docs the unit's
# Documentation= names. docs/operations.md ("Install") explains each step; rerun it to upgrade.
#
# Run as root (nothing here calls sudo). The test suite (tests/test_install.py) runs it against
# a scratch root and checks what it made, so the documented install is the one that works.
set -eu

usage() {
    cat <<'EOF'
usage: systemd/install.sh [--root DIR] [--venv DIR] [--python PYTHON] [--package SPEC]
                          [--no-pip] [-- PIP_OPTION...]

Install kvtierd as a systemd service. Run as root, from anywhere.

  --root DIR        install into DIR as if it were / (an image, a test); default /
  --venv DIR        the virtual environment, as the installed system names it;
                    default /opt/kvtierd/venv (not under /home or /root: ProtectHome=)
  --python PYTHON   the interpreter that makes the environment (3.11 or later);
                    default python3
  --package SPEC    what pip installs into it; default this checkout with the fast extra
  --no-pip          install no package: the environment must hold kvtierd already
  -- PIP_OPTION...  passed on to pip install (--no-index --find-links DIR, offline)
EOF
}

die() {
    echo "install.sh: $*" >&2
    exit 1
}

value() {
    [ "$#" -ge 2 ] || { echo "install.sh: $1 needs a value" >&2; usage >&2; exit 2; }
}

src=$(cd "$(dirname "$0")/.." && pwd)
root=/
venv=/opt/kvtierd/venv
python=python3
package="${src}[fast]"
pip=yes
while [ "$#" -gt 0 ]; do
    case $1 in
        --root) value "$@"; root=$2; shift 2 ;;
        --venv) value "$@"; venv=$2; shift 2 ;;
        --python) value "$@"; python=$2; shift 2 ;;
        --package) value "$@"; package=$2; shift 2 ;;
        --no-pip) pip=no; shift ;;
        --) shift; break ;;
        -h | --help) usage; exit 0 ;;
        *) echo "install.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

[ "$(id -u)" -eq 0 ] || die "run it as root (it creates a system user and root-owned files)"
case $venv in
    /home/* | /root/*) die "--venv $venv: the unit's ProtectHome= hides /home and /root" ;;
    /*) ;;
    *) die "--venv $venv: give an absolute path" ;;
esac
case $venv in
    *[!A-Za-z0-9._/+-]*) die "--venv $venv: use letters, digits and . _ / + - only" ;;
esac
[ -d "$root" ] || die "--root $root is not a directory"
root=$(cd "$root" && pwd)
# Paths below are "$R/etc/...": the same path under the scratch root, or the real one.
R=${root%/}
for tool in systemd-sysusers systemd-tmpfiles install; do
    command -v "$tool" >/dev/null || die "$tool is missing (Debian: apt-get install systemd)"
done

# 1. The package, in its own environment: Debian refuses `pip install` as root outside one
#    (PEP 668), and an environment upgrades without touching the system's Python.
if [ ! -x "$R$venv/bin/python" ]; then
    command -v "$python" >/dev/null || die "$python is missing (Debian: apt-get install python3)"
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$python is older than 3.11: give a newer one with --python"
    echo "install.sh: making the environment $venv"
    "$python" -m venv "$R$venv"
fi
if [ "$pip" = yes ]; then
    echo "install.sh: installing $package into $venv"
    "$R$venv/bin/python" -m pip install --upgrade "$@" "$package"
fi
[ -x "$R$venv/bin/kvtierd" ] || die "$venv/bin/kvtierd is missing: kvtierd is not installed there"

# 2. The unit, and the drop-in that runs kvtierd from the environment.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
install -D -m644 "$src/systemd/kvtierd.service" "$R/etc/systemd/system/kvtierd.service"
install -D -m644 "$src/systemd/kvtierd.socket" "$R/etc/systemd/system/kvtierd.socket"
sed "s|/opt/kvtierd/venv|$venv|g" "$src/systemd/kvtierd.service.d/venv.conf" >"$work/venv.conf"
install -D -m644 "$work/venv.conf" "$R/etc/systemd/system/kvtierd.service.d/venv.conf"

# 3. The user and group, then the directories owned by them: in this order, or tmpfiles cannot
#    resolve the group. The snippets are fed on standard input because systemd releases differ
#    on whether a file named beside --root is read inside the root or outside it.
install -D -m644 "$src/systemd/sysusers.d/kvtierd.conf" "$R/etc/sysusers.d/kvtierd.conf"
systemd-sysusers --root="$root" - <"$R/etc/sysusers.d/kvtierd.conf"
install -D -m644 "$src/systemd/tmpfiles.d/kvtierd.conf" "$R/etc/tmpfiles.d/kvtierd.conf"
systemd-tmpfiles --create --root="$root" - <"$R/etc/tmpfiles.d/kvtierd.conf"

# 4. The configuration, only where there is none: an upgrade keeps the site's. The group is
#    looked up in the root's own /etc/group, which the host's `install -g` would not read.
config=/etc/kvtierd/kvtierd.toml
if [ -e "$R$config" ]; then
    echo "install.sh: kept $config (the example is $src/systemd/kvtierd.toml)"
else
    gid=$(awk -F: '$1 == "kvtierd" { print $3 }' "$R/etc/group")
    [ -n "$gid" ] || die "group kvtierd is not in $R/etc/group after systemd-sysusers"
    install -m640 -o 0 -g "$gid" "$src/systemd/kvtierd.toml" "$R$config"
fi

# 5. The docs, where the unit's Documentation= points.
install -D -m644 -t "$R/usr/share/doc/kvtierd" "$src"/docs/*.md

[ -z "$R" ] || echo "install.sh: installed into $root; on the system it becomes:"
cat <<EOF
install.sh: kvtierd is installed in $venv. Next, as root:
  systemctl daemon-reload
  $venv/bin/kvtierd --check --as-unit --config $config
  systemctl enable --now kvtierd.socket kvtierd
EOF
