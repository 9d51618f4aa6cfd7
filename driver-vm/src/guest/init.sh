#!/bin/busybox sh
# sbx guest init: pid 1 of every vm sandbox. Built into the shared initramfs; the per-run
# files come in a second archive appended to it at each launch:
#   /etc/sbx/run.env   SBX_RUN_ID, SBX_GENERATION, SBX_HOSTNAME, SBX_GRACE, SBX_EXEC_CHANNELS
#                      (shell assignments)
#   /etc/sbx/command   the sandbox's command (env exports + exec of the quoted argv)
# It loads the modules listed in /etc/sbx/modules (in order), mounts the persistent disk
# (/dev/vda, ext4) at /sandbox — and, for a sandbox of an image (SBX_ROOT_SERIAL and
# SBX_WORKDIR in run.env), the image's root disk, where the command and execs then run —
# starts sbx-agent (exec: streamed output, stdin, a pty; copy
# and port-forward as commands run through exec) on each virtio port named sbx.exec.<k> and
# answers ping/stop on the one named sbx.agent, runs the command
# with its output on the console, and reports on the console, each on its own line:
# "sbx-guest: <run id> ready"  and  "sbx-guest: <run id> exit <code>".
# A stop (the ACPI power button, or "stop" on the agent port) sends the command SIGTERM, then
# SIGKILL after SBX_GRACE seconds. When the command has ended, /sandbox is synced and unmounted
# and the VM resets (QEMU runs with -no-reboot, so it exits).
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
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
# On the gateway's network: the leased address (a /32) and the routes through the gateway,
# as an oci sandbox's namespace has them. The host passes on only what comes from this
# address and this NIC's MAC.
if [ -n "${SBX_NET_ADDR:-}" ]; then
  waited=0
  until [ -e /sys/class/net/eth0 ]; do
    waited=$((waited + 1)); [ "$waited" -le 100 ] || die "no network device eth0"; sleep 0.1
  done
  ip link set eth0 up || die "cannot bring eth0 up"
  ip addr add "$SBX_NET_ADDR/32" dev eth0 || die "cannot set the address $SBX_NET_ADDR"
  ip route add "$SBX_NET_GW" dev eth0 scope link || die "cannot route to $SBX_NET_GW"
  ip route add default via "$SBX_NET_GW" dev eth0 || die "cannot set the default route"
  mkdir -p /etc && echo "nameserver $SBX_NET_GW" > /etc/resolv.conf
fi

# The persistent disk (/dev/vda); with an image, also its root disk, found by its serial
# ($SBX_ROOT_SERIAL), the persistent disk being the other one.
disks_wanted=1
[ -n "${SBX_ROOT_SERIAL:-}" ] && disks_wanted=2
waited=0
while :; do
  data=""; rootdev=""; found=0
  for b in /sys/block/vd*; do
    [ -e "$b" ] || continue
    found=$((found + 1))
    if [ -n "${SBX_ROOT_SERIAL:-}" ] && [ "$(cat "$b/serial" 2>/dev/null)" = "$SBX_ROOT_SERIAL" ]; then
      rootdev="/dev/${b##*/}"
    elif [ -z "$data" ]; then
      data="/dev/${b##*/}"
    fi
  done
  [ "$found" -ge "$disks_wanted" ] && [ -b "$data" ] && { [ "$disks_wanted" = 1 ] || [ -b "$rootdev" ]; } && break
  waited=$((waited + 1)); [ "$waited" -le 100 ] || die "no disks (found $found of $disks_wanted)"; sleep 0.1
done
mount -t ext4 "$data" /sandbox || die "cannot mount $data at /sandbox"

# A sandbox of an image: its root disk at $root, with /proc, /sys, /dev (this guest's own,
# in memory), /sandbox and the resolver's /etc/resolv.conf in it, and the agent copied to /dev/.sbx; the command and every
# exec run there (chroot). The mount points are made in the image's root when it lacks
# them, as a container runtime does.
root=""
if [ -n "${SBX_ROOT_SERIAL:-}" ]; then
  root=/sbx/root
  mkdir -p "$root"
  mount -t ext4 -o noinit_itable "$rootdev" "$root" || die "cannot mount the root disk $rootdev"
  for d in proc sys dev sandbox etc; do
    [ -L "$root/$d" ] && die "the image's /$d is a symbolic link, where the guest mounts its own"
    [ -d "$root/$d" ] || mkdir -p "$root/$d" || die "cannot make /$d in the image's root"
  done
  mount -t proc proc "$root/proc"
  mount -t sysfs sys "$root/sys"
  mount -t devtmpfs dev "$root/dev"
  mkdir -p "$root/dev/pts" "$root/dev/shm" /dev/.sbx
  mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts "$root/dev/pts"
  mount -t tmpfs -o mode=1777 shm "$root/dev/shm"
  mount --bind /sandbox "$root/sandbox"
  # The gateway's resolver as the image's /etc/resolv.conf (bound over it, as a container
  # runtime does; written when the image has none).
  if [ -n "${SBX_NET_ADDR:-}" ]; then
    if [ -f "$root/etc/resolv.conf" ] && [ ! -L "$root/etc/resolv.conf" ]; then
      mount --bind /etc/resolv.conf "$root/etc/resolv.conf"
    else
      rm -f "$root/etc/resolv.conf"; cp /etc/resolv.conf "$root/etc/resolv.conf"
    fi
  fi
  cp /bin/sbx-agent /dev/.sbx/sbx-agent || die "cannot place the agent"
  chmod 0755 /dev/.sbx/sbx-agent
fi

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

# The device of the virtio port named $1, once it shows (at most 10 s).
port_named() {
  waited=0
  while [ "$waited" -le 100 ]; do
    for p in /sys/class/virtio-ports/*; do
      [ "$(cat "$p/name" 2>/dev/null)" = "$1" ] && { echo "/dev/${p##*/}"; return 0; }
    done
    waited=$((waited + 1)); sleep 0.1
  done
  return 1
}

# Exec: one sbx-agent per port sbx.exec.<k>, each serving one exec at a time, in /sandbox
# unless told otherwise. The ports show one after the other: wait for the last.
if port_named "sbx.exec.$((SBX_EXEC_CHANNELS - 1))" > /dev/null; then
  for p in /sys/class/virtio-ports/*; do
    case "$(cat "$p/name" 2>/dev/null)" in
      sbx.exec.*)
        if [ -n "$root" ]; then
          # The init's values are taken before the image's Env is sourced (it may name any of
          # them): as positional arguments, which sourcing cannot change.
          ( set -- "$root" "/dev/${p##*/}" "$SBX_WORKDIR" "${SBX_USER:-}"
            . /etc/sbx/process.env
            exec /bin/chroot "$1" /dev/.sbx/sbx-agent serve-port "$2" --workdir "$3" --user "$4" < /dev/null > /dev/ttyS0 2>&1 ) &
        else
          ( cd /sandbox && exec /bin/sbx-agent serve-port "/dev/${p##*/}" < /dev/null > /dev/ttyS0 2>&1 ) &
        fi ;;
    esac
  done
else
  say "no exec port"
fi

# Control, one line each: "ping <id>" (answered "pong <id> <run id>"), "stop".
( port=$(port_named sbx.agent) || exit 0
  exec 3<> "$port"
  while :; do
    if ! read -r verb id _ <&3; then sleep 0.1; continue; fi
    case "$verb" in
      ping) echo "pong $id $SBX_RUN_ID" >&3 ;;
      stop) kill -TERM 1 ;;
    esac
  done ) &

cd /sandbox
# The command is looked up first, as its shell will (after its exports; in the image's
# root, or in /sandbox without an image): a
# missing one is said ("notfound") and the run ends with 127 without "ready", so the start
# answers "command not found" instead of a Ready that turns into an Error.
if [ "${SBX_HELPER:-}" = 1 ]; then
  # A helper guest (a copy into or out of a stopped sandbox): the disks and the exec agents,
  # no command; it runs until it is stopped.
  say "ready"
  while [ "$stopping" = 0 ]; do sleep 0.2; done
  code=0
elif sh /etc/sbx/command --sbx-check < /dev/null > /dev/ttyS0 2>&1; then
  # Its stdout and stderr each through a logger of the agent's (`sbx-agent log`), which
  # writes them to the console as records that keep the two streams apart (the CRI log
  # format the other drivers' logs have), each record whole in one write.
  mkdir -p /tmp/sbx-log
  mkfifo /tmp/sbx-log/out /tmp/sbx-log/err
  /bin/sbx-agent log stdout /tmp/sbx-log/out > /dev/ttyS0 2>&1 &
  outlog=$!
  /bin/sbx-agent log stderr /tmp/sbx-log/err > /dev/ttyS0 2>&1 &
  errlog=$!
  # Through `sbx-agent run`: a background job of this shell starts with SIGINT and SIGQUIT
  # ignored, which the command would keep.
  oom_before=$(sed -n 's/^oom_kill //p' /proc/vmstat)
  setsid /bin/sbx-agent run sh /etc/sbx/command < /dev/null > /tmp/sbx-log/out 2> /tmp/sbx-log/err &
  child=$!
  say "ready"
  while :; do
    wait "$child"
    code=$?
    kill -0 "$child" 2>/dev/null || break
  done
  # Ended by SIGKILL while the kernel killed for want of memory: said, so the run reads as
  # OOMKilled (the guest's memory is the spec's limit).
  if [ "$code" = 137 ] && [ "$(sed -n 's/^oom_kill //p' /proc/vmstat)" != "$oom_before" ]; then
    say "oom"
  fi
  # The loggers write what is left in their FIFOs (a background process of the command's
  # may hold them open) and end.
  kill -USR1 "$outlog" "$errlog" 2>/dev/null
  wait "$outlog" "$errlog" 2>/dev/null
else
  code=127
  say "notfound"
fi
say "exit $code"
cd /
sync
if [ -n "$root" ]; then
  umount "$root/sandbox" 2>/dev/null
  umount "$root/etc/resolv.conf" 2>/dev/null
  for m in dev/shm dev/pts dev proc sys; do umount -l "$root/$m" 2>/dev/null; done
  umount "$root" 2>/dev/null || mount -o remount,ro "$root"
fi
umount /sandbox 2>/dev/null || { sync; mount -o remount,ro /sandbox; }
reboot -f
