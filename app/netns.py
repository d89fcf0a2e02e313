"""Two hosts on one machine: two network namespaces joined by a veth pair, one MPI rank in each
(Linux, as root), so a split model's collectives cross a real network stack.

    python -m app.netns up DIR       make them (`make netns`); write DIR/hosts and DIR/launch
    python -m app.netns down DIR     remove them (`make netns-down`)

A network namespace has interfaces, addresses and routes of its own; a veth pair is a cable
whose two ends sit in two of them. Each namespace here holds one end, named IFACE, with one
address, and its loopback: no route leads anywhere else, so the ranks' messages cross the pair as
TCP segments through the kernel's network stack, as between two machines (at the speed of a
copy in memory, not of a wire: the latency of the stack is real, a wire's is not there).

MPICH's mpiexec (hydra) reaches another host with ssh; `DIR/launch` stands in for ssh and runs
its command in the namespace that holds the host's address. mpiexec runs in the first namespace
(from outside them it could reach neither) and is told:

    -iface IFACE                the address its proxies on the hosts call back on
    -genv UCX_TLS tcp           MPICH's transport (UCX) would otherwise see two processes of one
    -genv UCX_NET_DEVICES IFACE machine and use shared memory: nothing would cross the link

That command is the host file's first line (a comment to MPICH), which `make run hosts=DIR/hosts`
reads, so the make target that runs over real machines runs over these two unchanged.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

IFACE = "tp0"
SUBNET = "10.231.0"             # a private /24 that exists only inside the two namespaces
PREFIX = "llm-tp"               # namespaces PREFIX-a and PREFIX-b
MPIEXEC_LINE = "# mpiexec: "    # the host file's first line: how to reach its hosts
IP_TIMEOUT_S = 20


def missing() -> str | None:
    """None if network namespaces can be made here, else why not (a property of the machine)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's; this is {sys.platform}"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2; `make iproute2` installs it)"
    if os.geteuid() != 0:
        return f"making network namespaces needs root (this is uid {os.geteuid()})"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if made.returncode != 0:
        return f"`ip netns add` was refused: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=IP_TIMEOUT_S)
    return None


def _ip(*args: str):
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {p.stderr.strip()}")
    return p.stdout


class TwoHosts:
    """Namespaces PREFIX-a and PREFIX-b, one end of a veth pair in each (IFACE, addresses
    SUBNET.1 and SUBNET.2), and in `folder` the host file and the launcher that reach them."""

    def __init__(self, folder, prefix: str = PREFIX):
        self.folder = Path(folder).resolve()
        self.names = (f"{prefix}-a", f"{prefix}-b")
        self.addresses = (f"{SUBNET}.1", f"{SUBNET}.2")
        self.hosts = self.folder / "hosts"
        self.launcher = self.folder / "launch"

    def up(self) -> "TwoHosts":
        self.down()                                        # what a run that was killed left behind
        a, b = self.names
        for ns in self.names:
            _ip("netns", "add", ns)
        _ip("link", "add", IFACE, "netns", a, "type", "veth", "peer", "name", IFACE, "netns", b)
        for ns, address in zip(self.names, self.addresses):
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", IFACE, "up")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write_launcher()
        self.hosts.write_text(MPIEXEC_LINE + shlex.join(self.mpiexec()) + "\n"
                              + "".join(f"{address}:1\n" for address in self.addresses))
        return self

    def down(self):
        for ns in self.names:                               # the pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=IP_TIMEOUT_S)

    def __enter__(self) -> "TwoHosts":
        return self.up()

    def __exit__(self, *exc):
        self.down()

    def _write_launcher(self):
        """An ssh for hydra: `launch [options] HOST COMMAND...` runs COMMAND in HOST's namespace."""
        cases = "\n".join(f"  {address}) ns={ns} ;;" for address, ns in zip(self.addresses, self.names))
        self.launcher.write_text(f"""#!/bin/sh
# hydra calls this as it would call ssh: [options] HOST COMMAND... (written by app/netns.py)
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
  *) echo "launch: no namespace holds $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" sh -c "$*"
""")
        self.launcher.chmod(0o755)

    def mpiexec(self, transport: bool = True) -> list[str]:
        """The command that starts ranks on the two hosts (add -n N, -f hosts and the program).
        transport=False leaves MPICH's own choice of transport (shared memory): the planted twin
        of a run that would not cross the link."""
        cmd = ["ip", "netns", "exec", self.names[0], str(Path(sys.executable).parent / "mpiexec"),
               "-launcher", "ssh", "-launcher-exec", str(self.launcher), "-iface", IFACE]
        if transport:
            cmd += ["-genv", "UCX_TLS", "tcp", "-genv", "UCX_NET_DEVICES", IFACE]
        return cmd

    def link_bytes(self) -> dict:
        """{namespace: bytes its end of the pair has sent}, from the kernel's counters."""
        out = {}
        for ns in self.names:
            link = json.loads(_ip("-n", ns, "-s", "-j", "link", "show", "dev", IFACE))[0]
            out[ns] = int(link["stats64"]["tx"]["bytes"])
        return out


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in ("up", "down"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    hosts = TwoHosts(args[1])
    if args[0] == "down":
        hosts.down()
        return 0
    why = missing()
    if why:
        print(f"cannot make the two hosts: {why}", file=sys.stderr)
        return 1
    hosts.up()
    print(f"namespaces {' and '.join(hosts.names)} joined by a veth pair ({IFACE}: "
          f"{' and '.join(hosts.addresses)}); host file {hosts.hosts}\n"
          f"  make stage=tp run np=2 hosts={hosts.hosts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
