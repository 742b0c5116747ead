#!/usr/bin/env bash
# Install the hangwatch@.service systemd unit (one instance per config in /etc/hangwatch/NAME.yaml).
#
#   scripts/install-service.sh [--dry-run] [--bin PATH] [--user NAME] [--config FILE] [--root DIR]
#
#   --bin PATH     the hangwatch executable ExecStart runs (default: `hangwatch` on PATH, else this
#                  checkout's .venv/bin/hangwatch)
#   --user NAME    run the service as NAME instead of root (a system user is created when missing;
#                  it needs access to the GPUs, e.g. the `video`/`render` groups on some distributions)
#   --config FILE  also install FILE as /etc/hangwatch/NAME.yaml (NAME: its base name without .yaml):
#                  checked first (exit 78 when it is not valid), relative paths in it resolved against
#                  FILE's directory, readable by the service user; paths the hardened unit hides
#                  (/home, /root) or keeps read-only get a drop-in that opens exactly those
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

# The config is checked and resolved before anything is written: a bad one changes nothing.
if [ -n "$config" ]; then
  # The python that runs hangwatch: it resolves the config exactly as `hangwatch run` will.
  # (Its shebang's interpreter, when that can import hangwatch; else this checkout's .venv.)
  py=$(sed -n '1s/^#!//p' "$bin")
  for candidate in "$py" "$repo/.venv/bin/python" "$(command -v python3)"; do
    if [ -n "$candidate" ] && "$candidate" -c 'import hangwatch.common.config' 2>/dev/null; then py=$candidate; break; fi
    py=""
  done
  [ -n "$py" ] || die "no python that can import hangwatch (tried $bin's interpreter, $repo/.venv/bin/python, python3)"
  resolved=$("$py" - "$config" <<'PY'
import sys
from hangwatch.common.config import ConfigError, dump_config, load_checked
try:
    cfg, warnings = load_checked(sys.argv[1])  # what `hangwatch run` checks: files, model, command, dirs
except ConfigError as err:
    for problem in err.problems:
        print(problem, file=sys.stderr)
    sys.exit(78)
print(f"# installed by scripts/install-service.sh from {sys.argv[1]}; relative paths resolved against its directory")
print(dump_config(cfg), end="")
PY
) || { code=$?; echo "install-service: $config is not a valid config (see above); nothing installed" >&2; exit "$code"; }
  # Paths the run reads or writes, for the hardened unit (ProtectSystem=strict, ProtectHome=yes).
  paths=$("$py" - "$config" <<'PY'
import sys
from hangwatch.common.config import load_config
cfg = load_config(sys.argv[1])
for kind, path in (("r", cfg.data.train), ("r", cfg.data.eval), ("r", cfg.model.name_or_path),
                   ("r", cfg.worker.cwd), ("w", getattr(cfg.checkpoint, "dir", None))):
    if path and path.startswith("/"):
        print(kind, path)
PY
)
  rw=""; home=false
  while read -r kind path; do
    [ -n "$path" ] || continue
    case "$path" in /home/*|/root/*|/run/user/*) home=true ;; esac
    case "$path" in /var/lib/hangwatch/*|/var/log/hangwatch/*|/run/hangwatch/*) ;; *) [ "$kind" = w ] && rw="$rw $path" ;; esac
  done <<< "$paths"
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
  dest="$root/etc/hangwatch/$(basename "$config")"
  printf '%s\n' "$resolved" | write 0640 "$dest"
  if [ -n "$user" ]; then
    if [ -z "$root" ] || $dry; then
      step chown "root:$user" "$dest"  # 0640 root:USER: readable by the service, not by everyone
    else
      echo "install-service: not changing the owner of $dest (installing under $root): make it root:$user"
    fi
  fi
  name=$(basename "$config" .yaml)
  if $home || [ -n "$rw" ]; then
    step install -d -m 0755 "$unit_dir/hangwatch@$name.service.d"
    {
      echo "[Service]"
      echo "# written by install-service.sh for $config: the paths this run uses outside the unit's directories"
      $home && echo "ProtectHome=read-only"
      [ -n "$rw" ] && echo "ReadWritePaths=${rw# }"
    } | write 0644 "$unit_dir/hangwatch@$name.service.d/20-paths.conf"
  fi
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
