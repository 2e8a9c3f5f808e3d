#!/usr/bin/python3
"""glibc's and musl's resolvers asking the nameserver of /etc/resolv.conf a stream of unique names.

One query every --interval-ms until standard input closes, each for a name of its own
(q<N>.who.test), through one of:

  getent     `getent ahosts NAME`, a process per query: glibc's getaddrinfo, which opens a connected
             UDP socket per lookup and sends A and AAAA on it at once (sendmmsg).
  musl       the static musl client (--musl PATH), a process per query: musl's getaddrinfo, which
             sends from an unconnected UDP socket of its own per lookup.
  res-query  glibc's res_query(3) in a loop on one resolver state with RES_STAYOPEN: one connected
             UDP socket kept across queries, as a long-lived glibc resolver keeps it. One query at
             a time: a query begins at its slot, or when the one before it ended.

Prints what cares-stream.py prints: a first line saying it has begun, then one JSON line per query
(seq, begun_ms, done_ms, and the first address or the error), then the totals.
"""

import argparse
import ctypes
import json
import subprocess
import sys
import threading
import time

# <resolv.h>: keep the UDP socket open between queries.
RES_STAYOPEN = 0x00000100
# struct __res_state on x86_64 glibc: int retrans; int retry; unsigned long options; ...
RES_OPTIONS_OFFSET = 8
C_IN = 1
T_A = 1


def now_ms():
    return int(time.time() * 1000)


def first_a_record(message):
    """The first A record of a DNS response, as dotted text, or None."""
    qdcount = int.from_bytes(message[4:6], "big")
    ancount = int.from_bytes(message[6:8], "big")
    offset = 12

    def skip_name(offset):
        while True:
            length = message[offset]
            if length & 0xC0 == 0xC0:
                return offset + 2
            if length == 0:
                return offset + 1
            offset += 1 + length

    for _ in range(qdcount):
        offset = skip_name(offset) + 4
    for _ in range(ancount):
        offset = skip_name(offset)
        rtype = int.from_bytes(message[offset : offset + 2], "big")
        rdlength = int.from_bytes(message[offset + 8 : offset + 10], "big")
        offset += 10
        if rtype == T_A and rdlength == 4:
            return ".".join(str(byte) for byte in message[offset : offset + 4])
        offset += rdlength
    return None


class Records:
    def __init__(self):
        self.lock = threading.Lock()
        self.done = []

    def add(self, seq, begun_ms, answer=None, error=None):
        record = {"seq": seq, "begun_ms": begun_ms, "done_ms": now_ms()}
        if error is None and answer is None:
            error = "no address in the answer"
        if error is not None:
            record["error"] = error
        else:
            record["answer"] = answer
        with self.lock:
            self.done.append(record)

    def count(self):
        with self.lock:
            return len(self.done)


def process_per_query(command, records, stop, interval_ms, timeout_s):
    """Starts `command NAME` every interval in a thread of its own; returns the number asked."""

    def one(seq, begun_ms):
        try:
            out = subprocess.run(
                command + [f"q{seq}.who.test"],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            records.add(seq, begun_ms, error=f"no answer within {timeout_s} s")
            return
        words = out.stdout.split()
        if out.returncode == 0 and words:
            records.add(seq, begun_ms, answer=words[0])
        else:
            text = (out.stdout + out.stderr).strip()
            records.add(seq, begun_ms, error=f"exit {out.returncode}: {text}")

    seq = 0
    while not stop.is_set():
        threading.Thread(target=one, args=(seq, now_ms()), daemon=True).start()
        seq += 1
        time.sleep(interval_ms / 1000)
    return seq


def res_query_loop(records, stop, interval_ms):
    """res_query on this thread's resolver state, kept open; returns the number asked."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.__res_state.restype = ctypes.c_void_p
    libc.__h_errno_location.restype = ctypes.POINTER(ctypes.c_int)
    if libc.__res_init() != 0:
        raise OSError(ctypes.get_errno(), "res_init failed")
    options = ctypes.c_ulong.from_address(libc.__res_state() + RES_OPTIONS_OFFSET)
    options.value |= RES_STAYOPEN
    answer = ctypes.create_string_buffer(4096)
    seq = 0
    while not stop.is_set():
        begun_ms = now_ms()
        name = f"q{seq}.who.test".encode()
        length = libc.res_query(name, C_IN, T_A, answer, len(answer))
        if length < 0:
            records.add(
                seq,
                begun_ms,
                error=f"h_errno {libc.__h_errno_location()[0]}, errno {ctypes.get_errno()}",
            )
        else:
            records.add(seq, begun_ms, answer=first_a_record(answer.raw[:length]))
        seq += 1
        time.sleep(max(0, begun_ms + interval_ms - now_ms()) / 1000)
    return seq


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--client", required=True, choices=["getent", "musl", "res-query"])
    parser.add_argument("--musl", help="the static musl client (for --client musl)")
    parser.add_argument("--interval-ms", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=10)
    args = parser.parse_args()
    if args.client == "musl" and not args.musl:
        parser.error("--client musl needs --musl PATH")

    records = Records()
    stop = threading.Event()

    def wait_for_eof():
        sys.stdin.read()
        stop.set()

    # The test waits for this line before it strikes the cache.
    print(json.dumps({"streaming": True}), flush=True)
    threading.Thread(target=wait_for_eof, daemon=True).start()
    if args.client == "res-query":
        asked = res_query_loop(records, stop, args.interval_ms)
    else:
        command = ["getent", "ahosts"] if args.client == "getent" else [args.musl]
        asked = process_per_query(command, records, stop, args.interval_ms, args.timeout_s)
    deadline = time.monotonic() + args.timeout_s + 1
    while records.count() < asked and time.monotonic() < deadline:
        time.sleep(0.05)
    with records.lock:
        for record in sorted(records.done, key=lambda record: record["seq"]):
            print(json.dumps(record))
        print(json.dumps({"asked": asked, "ended": len(records.done)}))


if __name__ == "__main__":
    main()
