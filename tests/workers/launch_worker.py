"""What a job launched by ``python -m tf_mpi.run`` sees of the network; run by tests/test_launch.py.

Every rank prints one ``LAUNCH {json}`` line. Two modes:

``listeners``: the TCP sockets this rank listens on (its own file descriptors matched
against /proc/net/tcp and tcp6) and which of them are bound to a non-loopback address;
plus a sum computed by tf_mpi's own engine (``tf_mpi.basics._core``), so the check covers
the MPI that tf_mpi initialises, not only mpi4py's.

``pingpong``: rank 0 and the first rank on another host time 4 KiB round trips, first over a
plain TCP socket between their hosts (TCP_NODELAY; the same processes, the same link), then
with MPI Send/Recv; the other ranks wait in a barrier meanwhile, as idle ranks of a job do.
Medians in microseconds.
"""
import json
import os
import socket
import struct
import sys
import time

import numpy as np

MODE = sys.argv[1]
SIZE, ROUNDS, WARMUP = 4096, 2000, 100


def listening_sockets():
    """[(address, port)] of the TCP sockets this process listens on."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    out = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state != "0A" or inode not in mine:   # 0A: TCP_LISTEN
                    continue
                hex_addr, hex_port = local.split(":")
                raw = bytes.fromhex(hex_addr)
                # /proc/net/tcp* prints the address as native-endian 32-bit words.
                raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0])
                               for i in range(0, len(raw), 4))
                out.append((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return out


def is_loopback(address):
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1") or \
        address.startswith("::ffff:127.")


def check_listeners():
    from tf_mpi import basics
    from tf_mpi.basics import _core
    basics.init()
    got = _core.allreduce(np.full(1000, _core.rank() + 1, np.float32), int(basics.Sum), "launch.sum")
    n = _core.size()
    listening = listening_sockets()
    report = {"rank": _core.rank(), "size": n, "listening": listening,
              "non_loopback": [a for a in listening if not is_loopback(a[0])],
              "engine_sum_ok": bool(np.all(got == n * (n + 1) / 2))}
    print("LAUNCH " + json.dumps(report), flush=True)
    _core.shutdown()


def median_round_trip_us(one_round):
    times = []
    for i in range(WARMUP + ROUNDS):
        t = time.perf_counter()
        one_round()
        if i >= WARMUP:
            times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e6)


def check_pingpong():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    peer = next((r for r, h in enumerate(hosts) if h != hosts[0]), None)
    report = {"rank": comm.rank, "hosts": hosts, "peer": peer}
    if peer is not None and comm.rank in (0, peer):
        other = peer if comm.rank == 0 else 0
        buf = bytearray(SIZE)
        # Plain TCP between the two hosts: the peer listens on its own (non-loopback) address.
        if comm.rank == peer:
            server = socket.create_server((socket.gethostbyname(hosts[peer]), 0))
            comm.send(server.getsockname(), dest=0)
            conn, _ = server.accept()
        else:
            conn = socket.create_connection(comm.recv(source=peer))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(buf)

        def recv_all():
            got = 0
            while got < SIZE:
                got += conn.recv_into(view[got:], SIZE - got)

        def tcp_round():
            if comm.rank == 0:
                conn.sendall(buf)
                recv_all()
            else:
                recv_all()
                conn.sendall(buf)

        report["tcp_us"] = median_round_trip_us(tcp_round)
        conn.close()
        array = np.zeros(SIZE, np.uint8)

        def mpi_round():
            if comm.rank == 0:
                comm.Send(array, other)
                comm.Recv(array, other)
            else:
                comm.Recv(array, other)
                comm.Send(array, other)

        report["mpi_us"] = median_round_trip_us(mpi_round)
    comm.Barrier()
    print("LAUNCH " + json.dumps(report), flush=True)


if __name__ == "__main__":
    {"listeners": check_listeners, "pingpong": check_pingpong}[MODE]()
