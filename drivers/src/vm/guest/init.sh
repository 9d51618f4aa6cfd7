#!/bin/busybox sh
# sbx guest init: pid 1 of every vm sandbox. Built into the shared initramfs; the per-run
# files come in a second archive appended to it at each launch:
#   /etc/sbx/run.env   SBX_RUN_ID, SBX_GENERATION, SBX_HOSTNAME, SBX_GRACE (shell assignments)
#   /etc/sbx/command   the sandbox's command (env exports + exec of the quoted argv)
# It loads the modules listed in /etc/sbx/modules (in order), mounts the persistent disk
# (/dev/vda, ext4) at /sandbox, starts the exec agent on the virtio port named sbx.agent,
# runs the command with its output on the console, and reports on the console, each on its own
# line:  "sbx-guest: <run id> ready"  and  "sbx-guest: <run id> exit <code>".
# A stop (the ACPI power button, or "stop" on the agent port) sends the command SIGTERM, then
# SIGKILL after SBX_GRACE seconds. When the command has ended, /sandbox is synced and unmounted
# and the VM resets (QEMU runs with -no-reboot, so it exits).
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /tmp /run /sandbox
mount -t tmpfs tmp /tmp
. /etc/sbx/run.env

say() { printf '\nsbx-guest: %s %s\n' "$SBX_RUN_ID" "$*" > /dev/ttyS0; }
die() { say "fatal $*"; sync; reboot -f; }

mmio=""
for arg in $(cat /proc/cmdline); do
  case "$arg" in virtio_mmio.device=*) mmio="$mmio device=${arg#virtio_mmio.device=}" ;; esac
done
while read -r module; do
  [ -n "$module" ] || continue
  if [ "$module" = virtio_mmio ]; then insmod "/lib/modules/$module.ko" $mmio; else insmod "/lib/modules/$module.ko"; fi
done < /etc/sbx/modules
hostname "$SBX_HOSTNAME"
# Loopback: a server inside the sandbox is reachable from its other processes (and execs).
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up

waited=0
until [ -b /dev/vda ]; do
  waited=$((waited + 1)); [ "$waited" -le 100 ] || die "no disk /dev/vda"; sleep 0.1
done
mount -t ext4 /dev/vda /sandbox || die "cannot mount /dev/vda at /sandbox"

stopping=0
child=""
on_stop() {
  [ "$stopping" = 1 ] && return
  stopping=1
  say "stopping"
  [ -n "$child" ] || return
  kill -TERM -"$child" 2>/dev/null || kill -TERM "$child" 2>/dev/null
  ( sleep "$SBX_GRACE"; kill -KILL -"$child" 2>/dev/null ) &
}
trap on_stop TERM

# The power button: the only input device of the machine; any event from it means stop.
( waited=0
  until [ -c /dev/input/event0 ]; do waited=$((waited + 1)); [ "$waited" -le 100 ] || exit 0; sleep 0.1; done
  head -c 24 /dev/input/event0 > /dev/null && kill -TERM 1 ) &

# The exec agent. Requests, one per line: "exec <id> <timeout s> <base64 script>",
# "ping <id>", "stop". Answers: "result <id> <code> <base64 stdout> <base64 stderr>",
# "pong <id> <run id>". One request at a time; output is capped at 1 MiB per stream.
agent_port() {
  for p in /sys/class/virtio-ports/*; do
    [ "$(cat "$p/name" 2>/dev/null)" = sbx.agent ] && { echo "/dev/${p##*/}"; return; }
  done
}
( port=""
  waited=0
  while [ -z "$port" ]; do
    port=$(agent_port); waited=$((waited + 1)); [ "$waited" -le 100 ] || exit 0; [ -n "$port" ] || sleep 0.1
  done
  exec 3<> "$port"
  while :; do
    if ! read -r verb id arg1 arg2 <&3; then sleep 0.1; continue; fi
    case "$verb" in
      ping) echo "pong $id $SBX_RUN_ID" >&3 ;;
      stop) kill -TERM 1 ;;
      exec)
        echo "$arg2" | base64 -d > /tmp/exec.sh 2>/dev/null
        (cd /sandbox && timeout -s KILL "$arg1" sh /tmp/exec.sh < /dev/null > /tmp/exec.out 2> /tmp/exec.err)
        code=$?
        echo "result $id $code $(head -c 1048576 /tmp/exec.out | base64 -w 0) $(head -c 1048576 /tmp/exec.err | base64 -w 0)" >&3
        rm -f /tmp/exec.sh /tmp/exec.out /tmp/exec.err ;;
    esac
  done ) &

cd /sandbox
setsid sh /etc/sbx/command < /dev/null > /dev/ttyS0 2>&1 &
child=$!
say "ready"
while :; do
  wait "$child"
  code=$?
  kill -0 "$child" 2>/dev/null || break
done
say "exit $code"
cd /
sync
umount /sandbox 2>/dev/null || { sync; mount -o remount,ro /sandbox; }
reboot -f
