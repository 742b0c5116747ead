#!/usr/bin/env bash
# Install the hangwatch@.service systemd unit (one instance per config in /etc/hangwatch/NAME.yaml).
#
#   scripts/install-service.sh [--dry-run] [--bin PATH] [--user NAME] [--config FILE] [--root DIR]
#
#   --bin PATH     the hangwatch executable ExecStart runs (default: `hangwatch` on PATH, else this
#                  checkout's .venv/bin/hangwatch)
#   --user NAME    run the service as NAME instead of root (a system user is created when missing;
#                  it needs access to the GPUs, e.g. the `video`/`render` groups on some distributions)
#   --config FILE  also copy FILE to /etc/hangwatch/ (the instance name is its base name without .yaml)
#   --root DIR     install under DIR instead of / (packaging, tests): no user creation, no daemon-reload
#   --dry-run      print every step and the files it would write; change nothing
#
# Then:  sudo systemctl enable --now hangwatch@NAME
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

dry=false
bin=""
user=""
config=""
root=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=true ;;
    --bin) bin=${2:?--bin needs a path}; shift ;;
    --user) user=${2:?--user needs a name}; shift ;;
    --config) config=${2:?--config needs a file}; shift ;;
    --root) root=${2:?--root needs a directory}; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-service: unknown argument: $1 (see --help)" >&2; exit 64 ;;
  esac
  shift
done
root=${root%/}

die() { echo "install-service: $*" >&2; exit 1; }

if [ -z "$bin" ]; then
  bin=$(command -v hangwatch || true)
  [ -n "$bin" ] || bin="$repo/.venv/bin/hangwatch"
fi
case "$bin" in /*) ;; *) bin="$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")" ;; esac
[ -x "$bin" ] || die "no hangwatch executable at $bin; run scripts/setup.sh first or pass --bin PATH"
if [ -n "$config" ]; then
  [ -f "$config" ] || die "no such config file: $config"
  case "$config" in *.yaml) ;; *) die "--config must be a .yaml file (the instance name is its base name)" ;; esac
fi
if [ -n "$user" ]; then
  case "$user" in *[!a-z0-9_-]*|"") die "--user: '$user' is not a valid user name" ;; esac
fi

# Every change goes through one of these two, so --dry-run shows exactly what a real run does.
step() {
  if $dry; then printf '+ %s\n' "$*"; else "$@"; fi
}
write() {  # write MODE PATH  (content on stdin)
  local mode=$1 path=$2 content
  content=$(cat)
  if $dry; then
    printf '+ write %s (mode %s):\n' "$path" "$mode"
    printf '%s\n' "$content" | sed 's/^/    /'
  else
    printf '%s\n' "$content" > "$path.tmp.$$"
    chmod "$mode" "$path.tmp.$$"
    mv -f "$path.tmp.$$" "$path"
  fi
}

unit_dir="$root/etc/systemd/system"
step install -d -m 0755 "$root/etc/hangwatch" "$unit_dir" "$root/etc/logrotate.d"

sed "s#^ExecStart=/usr/local/bin/hangwatch #ExecStart=$bin #" systemd/hangwatch@.service \
  | write 0644 "$unit_dir/hangwatch@.service"

if [ -n "$user" ]; then
  if [ -z "$root" ] && ! getent passwd "$user" >/dev/null; then
    step useradd --system --home-dir /var/lib/hangwatch --no-create-home --shell /usr/sbin/nologin "$user"
  fi
  step install -d -m 0755 "$unit_dir/hangwatch@.service.d"
  write 0644 "$unit_dir/hangwatch@.service.d/10-user.conf" <<EOF
[Service]
User=$user
Group=$user
EOF
fi

if [ -n "$config" ]; then
  step install -m 0640 "$config" "$root/etc/hangwatch/$(basename "$config")"
fi

# logrotate renames the file and creates a new one; the supervisor's WatchedFileHandler notices and
# reopens it before its next line, so no copytruncate (which can lose lines) and no signal are needed.
write 0644 "$root/etc/logrotate.d/hangwatch" <<'EOF'
/var/log/hangwatch/*/supervisor.log {
    weekly
    rotate 8
    maxsize 100M
    compress
    delaycompress
    missingok
    notifempty
}
EOF

if [ -z "$root" ] && command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
  step systemctl daemon-reload
elif [ -n "$root" ]; then
  echo "install-service: skipping systemctl daemon-reload (installing under $root)"
else
  echo "install-service: skipping systemctl daemon-reload (systemd is not running here)"
fi

name=demo
[ -n "$config" ] && name=$(basename "$config" .yaml)
if $dry; then
  echo "install-service: dry run, nothing changed"
else
  echo "install-service: installed $unit_dir/hangwatch@.service (ExecStart: $bin)"
fi
cat <<EOF
next:
  put a config at /etc/hangwatch/$name.yaml   (hangwatch validate-config /etc/hangwatch/$name.yaml)
  systemctl enable --now hangwatch@$name
  hangwatch status --run-dir /var/lib/hangwatch/$name
  journalctl -u hangwatch@$name -f
EOF
