"""``python -m bench.studies.send_floor``: what one streamed chunk's ``send`` costs on loopback TCP.

Issue 47 asks for <= 20 us of server CPU per streamed token on the simulated device. A token
that goes out in a chunk of its own costs the front end one ``send`` on its stream's socket,
and on loopback the sender's system call also carries the packet through the receiving side's
TCP stack and wakes the reader. This probe measures that floor with no server at all:
``--connections`` loopback TCP connections (``TCP_NODELAY``, as aiohttp's responses), a reader
process draining them with a selector (the bench client's part), and this process writing a
payload of ``--bytes`` to each socket in turn, one round every ``--gap-ms`` (a decode step),
``--rounds`` rounds. Per payload size and gap it prints the sender's CPU microseconds per send
(user + system time of this process over the rounds) and the reader's per message received.

Set beside ``host_path``'s front-end figure it says how much of a streamed token is the socket
and how much the front end's own work. Knows nothing of inflight.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import selectors
import socket
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path


@dataclass(frozen=True)
class SendCost:
    """One cell: ``payload`` bytes a send, ``gap_ms`` between rounds, the CPU per send (us)."""

    payload: int
    gap_ms: float
    connections: int
    sends: int
    sender_us_per_send: float
    sender_wall_us_per_send: float  # the send loop's elapsed time: what the calls held the thread
    reader_us_per_send: float


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _read_all(port: int, connections: int, expect: int, report: Connection) -> None:
    """The reader: connect ``connections`` sockets, drain them until ``expect`` bytes came in,
    send back the CPU seconds it spent after connecting."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    report.send("connected")
    start = _cpu_s()
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    got = 0
    while got < expect:
        for key, _ in sel.select(timeout=30.0):
            data = key.fileobj.recv(65536)  # type: ignore[union-attr]
            if not data:
                raise RuntimeError("the sender closed a connection early")
            got += len(data)
    report.send(_cpu_s() - start)
    for s in socks:
        s.close()


def measure(payload: int, gap_ms: float, connections: int, rounds: int) -> SendCost:
    """One cell: the reader in a child process, this process sending."""
    with socket.create_server(("127.0.0.1", 0), backlog=max(1024, connections)) as server:
        port = server.getsockname()[1]
        ours, theirs = mp.Pipe()
        reader = mp.get_context("spawn").Process(
            target=_read_all, args=(port, connections, payload * connections * rounds, theirs))
        reader.start()
        try:
            socks = [server.accept()[0] for _ in range(connections)]
            for s in socks:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not ours.poll(60.0) or ours.recv() != "connected":
                raise RuntimeError("the reader did not connect")
            message = b"x" * payload
            spent = wall = 0.0
            for _ in range(rounds):
                start, t0 = _cpu_s(), time.perf_counter()
                for s in socks:
                    s.sendall(message)
                spent += _cpu_s() - start
                wall += time.perf_counter() - t0
                if gap_ms:
                    time.sleep(gap_ms / 1e3)
            if not ours.poll(60.0):
                raise RuntimeError("the reader did not finish")
            reader_s = float(ours.recv())
            for s in socks:
                s.close()
        finally:
            reader.join(30.0)
            if reader.is_alive():
                reader.kill()
    sends = connections * rounds
    return SendCost(payload, gap_ms, connections, sends, 1e6 * spent / sends, 1e6 * wall / sends, 1e6 * reader_s / sends)


def table(cells: list[SendCost]) -> str:
    lines = ["| payload bytes | gap ms | connections | sends | sender CPU us per send | sender wall us per send "
             "| reader CPU us per send |", "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {c.payload} | {c.gap_ms:g} | {c.connections} | {c.sends} | {c.sender_us_per_send:.1f} | "
              f"{c.sender_wall_us_per_send:.1f} | {c.reader_us_per_send:.1f} |" for c in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--bytes", type=int, nargs="+", default=[180, 360],
                    help="payload of a send (~180: one token's completion chunk with its framing)")
    ap.add_argument("--gap-ms", type=float, nargs="+", default=[10.0, 0.0],
                    help="pause between rounds (a decode step); 0: back to back")
    ap.add_argument("--out", type=Path, help="write the cells here as JSON")
    args = ap.parse_args(argv)
    cells = [measure(b, g, args.connections, args.rounds) for g in args.gap_ms for b in args.bytes]
    print(table(cells))
    if args.out:
        args.out.write_text(json.dumps([asdict(c) for c in cells], indent=1))


if __name__ == "__main__":
    main()
