#!/usr/bin/env bash
# Install (or upgrade, or remove) an unpacked ascendserve release on this host.
# Run it as root from the unpacked tarball: ./install.sh
#
#   ./install.sh [--root DIR] [--version V] [--no-verify]   install or upgrade
#   ./install.sh [--root DIR] --switch VERSION              point `current` at an installed version
#   ./install.sh [--root DIR] --uninstall                   remove programs and units, keep /etc/ascendserve
#
# Lays out:
#   /opt/ascendserve/<version>/          this release (bin/, conf/, systemd/, ...); older ones are kept
#   /opt/ascendserve/current -> <version> switched atomically (rename of a symlink)
#   /etc/ascendserve/<role>.toml         default configs; an edited one is never overwritten:
#                                        the new default goes beside it as <role>.toml.new
#   /etc/systemd/system/ascendserve@.service, ascendserve.target
#   user and group `ascendserve` (system account)
# Running instances keep running the version they started with; restart them
# (systemctl restart ascendserve.target) to run the new one.
#
#   --root DIR    install under DIR instead of / (also: DESTDIR=DIR; --prefix DIR is the same).
#                 Paths inside the units stay /opt/... and /etc/...; no user, chown or
#                 systemctl: for packaging and tests, runs unprivileged.
#   --version V   the version directory name (default: version= from BUILD_INFO, else
#                 `bin/ascendserve version`)
#   --no-verify   skip checking the files against SHA256SUMS
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=${DESTDIR:-}
VERSION="" ACTION=install VERIFY=1 SWITCH_TO=""
USER_NAME=ascendserve
DEVICE_GROUPS=(HwHiAiUser)  # Ascend's driver group owns /dev/davinci*

say() { printf '[ascendserve-install] %s\n' "$*"; }
die() { printf '[ascendserve-install] error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --root|--prefix) [ $# -ge 2 ] || die "$1 needs a directory"; ROOT=$2; shift 2 ;;
        --root=*|--prefix=*) ROOT=${1#*=}; shift ;;
        --version) [ $# -ge 2 ] || die "--version needs a value"; VERSION=$2; shift 2 ;;
        --no-verify) VERIFY=0; shift ;;
        --switch) [ $# -ge 2 ] || die "--switch needs a version"; ACTION=switch SWITCH_TO=$2; shift 2 ;;
        --uninstall) ACTION=uninstall; shift ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done

ROOT=${ROOT%/}
if [ -n "$ROOT" ]; then
    mkdir -p "$ROOT"
    ROOT=$(cd "$ROOT" && pwd)
    if [ "$ROOT" = / ]; then ROOT=""; fi
fi
LIVE=1  # installing into the running system: create the user, chown, talk to systemd
if [ -n "$ROOT" ]; then
    LIVE=0
    say "installing under $ROOT: skipping user creation, chown and systemctl"
elif [ "$(id -u)" -ne 0 ]; then
    die "run as root (or pass --root DIR to install into a directory)"
fi

OPT=$ROOT/opt/ascendserve
ETC=$ROOT/etc/ascendserve
UNITS=$ROOT/etc/systemd/system

systemd_running() { [ "$LIVE" = 1 ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null; }

daemon_reload() {
    if systemd_running; then
        systemctl daemon-reload
        say "systemctl daemon-reload done"
    elif [ "$LIVE" = 1 ]; then
        say "systemd is not running here: no daemon-reload"
    fi
}

switch_current() {  # $1: a version directory under $OPT
    ln -sfn "$1" "$OPT/.current.$$"
    mv -Tf "$OPT/.current.$$" "$OPT/current"  # rename(2): no moment without `current`
    say "$OPT/current -> $1"
}

# --- install steps ---------------------------------------------------------

release_version() {
    if [ -n "$VERSION" ]; then
        echo "$VERSION"
    elif [ -f "$SRC/BUILD_INFO" ] && grep -q '^version=.' "$SRC/BUILD_INFO"; then
        sed -n 's/^version=//p' "$SRC/BUILD_INFO" | head -n 1
    else
        local out
        out=$("$SRC/bin/ascendserve" version 2>/dev/null) ||
            die "cannot tell the version: no BUILD_INFO and '$SRC/bin/ascendserve version' failed; pass --version V"
        echo "${out##* }"
    fi
}

check_release() {
    [ -x "$SRC/bin/ascendserve" ] || die "$SRC/bin/ascendserve is missing: run this from an unpacked release"
    [ -f "$SRC/systemd/ascendserve@.service" ] || die "$SRC/systemd/ascendserve@.service is missing"
    if [ "$VERIFY" = 1 ] && [ -f "$SRC/SHA256SUMS" ]; then
        (cd "$SRC" && sha256sum --quiet --strict -c SHA256SUMS) >&2 ||
            die "files differ from SHA256SUMS (a damaged or modified release); --no-verify installs anyway"
        say "checksums OK"
    fi
}

install_tree() {  # $1: version
    local dest=$OPT/$1 stage=$OPT/.$1.new.$$ old=$OPT/.$1.old.$$
    mkdir -p "$OPT"
    if [ -d "$dest" ] && diff -qr "$SRC" "$dest" >/dev/null 2>&1; then
        say "$dest is already installed and unchanged"
        return
    fi
    rm -rf "$stage"
    cp -a "$SRC" "$stage"
    chmod -R u+rwX,go+rX,go-w "$stage"
    if [ "$LIVE" = 1 ]; then chown -R root:root "$stage"; fi
    if [ -d "$dest" ]; then  # same version, other contents (a rebuild): replace it whole
        mv -T "$dest" "$old"
        mv -T "$stage" "$dest"
        rm -rf "$old"
        say "replaced $dest"
    else
        mv -T "$stage" "$dest"
        say "installed $dest"
    fi
}

install_configs() {  # $1: the previous defaults (conf/ of the version `current` pointed at), may be empty
    local previous=$1 new name dest
    mkdir -p "$ETC"
    chmod 0750 "$ETC"
    if [ "$LIVE" = 1 ]; then chown root:"$USER_NAME" "$ETC"; fi
    for new in "$SRC"/conf/*.toml; do
        [ -e "$new" ] || continue
        name=$(basename "$new")
        dest=$ETC/$name
        if [ ! -e "$dest" ]; then
            install_config "$new" "$dest"
            say "config $dest installed"
        elif cmp -s "$new" "$dest"; then
            rm -f "$dest.new"  # a .new from an earlier upgrade that has since been taken over
        elif [ -n "$previous" ] && [ -f "$previous/$name" ] && cmp -s "$previous/$name" "$dest"; then
            install_config "$new" "$dest"  # never edited: follow the new default
            say "config $dest updated to the new default (it was unedited)"
        else
            install_config "$new" "$dest.new"
            say "config $dest was edited: kept; the new default is $dest.new (compare: diff $dest $dest.new)"
        fi
    done
}

install_config() {  # $1 source, $2 destination; written beside and renamed into place
    cp "$1" "$2.tmp.$$"
    chmod 0640 "$2.tmp.$$"
    if [ "$LIVE" = 1 ]; then chown root:"$USER_NAME" "$2.tmp.$$"; fi
    mv -f "$2.tmp.$$" "$2"
}

install_units() {
    local unit
    mkdir -p "$UNITS"
    for unit in "$SRC"/systemd/*; do
        [ -f "$unit" ] || continue
        install -m 0644 "$unit" "$UNITS/$(basename "$unit").tmp.$$"
        mv -f "$UNITS/$(basename "$unit").tmp.$$" "$UNITS/$(basename "$unit")"
        say "unit $UNITS/$(basename "$unit")"
    done
}

ensure_user() {
    [ "$LIVE" = 1 ] || return 0
    local nologin group
    nologin=$(command -v nologin || echo /bin/false)
    if ! getent group "$USER_NAME" >/dev/null; then
        groupadd --system "$USER_NAME"
        say "created group $USER_NAME"
    fi
    if ! getent passwd "$USER_NAME" >/dev/null; then
        useradd --system --gid "$USER_NAME" --home-dir /var/lib/ascendserve --no-create-home \
            --shell "$nologin" --comment "ascendserve serving roles" "$USER_NAME"
        say "created user $USER_NAME"
    fi
    for group in "${DEVICE_GROUPS[@]}"; do
        if getent group "$group" >/dev/null && ! id -nG "$USER_NAME" | tr ' ' '\n' | grep -qx "$group"; then
            usermod -aG "$group" "$USER_NAME"
            say "added $USER_NAME to group $group (accelerator devices)"
        fi
    done
}

do_install() {
    check_release
    local version previous=""
    version=$(release_version)
    case "$version" in
        ""|.|..|current|*/*|.*) die "unusable version name '$version'; pass --version V" ;;
    esac
    say "ascendserve $version from $SRC"
    if [ -L "$OPT/current" ] && [ -d "$OPT/current/conf" ]; then
        previous=$(cd "$OPT/current/conf" && pwd -P)
    fi
    ensure_user
    install_tree "$version"
    install_configs "$previous"
    install_units
    switch_current "$version"
    daemon_reload
    if systemd_running && systemctl list-units --no-legend --state=active 'ascendserve@*' | grep -q .; then
        say "running instances still run the version they started with:"
        say "  systemctl restart ascendserve.target   (or one: systemctl restart ascendserve@NAME)"
    fi
    say "done. Next: edit $ETC/<name>.toml, then systemctl enable --now ascendserve@<name>"
}

# --- switch and uninstall --------------------------------------------------

do_switch() {
    case "$SWITCH_TO" in ""|.|..|current|*/*|.*) die "unusable version name '$SWITCH_TO'" ;; esac
    [ -x "$OPT/$SWITCH_TO/bin/ascendserve" ] ||
        die "$OPT/$SWITCH_TO is not an installed version; installed: $(ls "$OPT" 2>/dev/null | grep -vx current | tr '\n' ' ')"
    switch_current "$SWITCH_TO"
    say "restart instances to run it: systemctl restart ascendserve.target"
}

do_uninstall() {
    local link unit
    if systemd_running; then
        systemctl stop ascendserve.target 'ascendserve@*.service' || true
        for link in /etc/systemd/system/*.wants/ascendserve@*.service; do
            if [ -L "$link" ]; then systemctl disable "$(basename "$link")" || true; fi
        done
        systemctl disable ascendserve.target 2>/dev/null || true
    elif [ "$LIVE" = 1 ]; then
        say "systemd is not running here: nothing to stop"
    fi
    for link in "$UNITS"/*.wants/ascendserve@*.service "$UNITS"/*.wants/ascendserve.target; do
        if [ -L "$link" ]; then rm -f "$link"; fi
    done
    for unit in "$UNITS/ascendserve@.service" "$UNITS/ascendserve.target"; do
        if [ -e "$unit" ]; then rm -f "$unit"; say "removed $unit"; fi
    done
    if [ -d "$UNITS/ascendserve@.service.d" ] || [ -d "$UNITS/ascendserve.target.d" ]; then
        say "kept drop-ins $UNITS/ascendserve*.d (yours); remove them by hand if unwanted"
    fi
    if [ -e "$OPT" ]; then
        rm -rf "$OPT"
        say "removed $OPT (every installed version)"
    fi
    daemon_reload
    say "kept $ETC (configs), /var/lib/ascendserve, /var/log/ascendserve, /var/cache/ascendserve and user $USER_NAME"
}

case "$ACTION" in
    install) do_install ;;
    switch) do_switch ;;
    uninstall) do_uninstall ;;
esac
