#!/usr/bin/python3
"""A c-ares client (pycares) asking one server a stream of unique names from one channel.

One query every --interval-ms until standard input closes, each for a name of its own (q<N>.who.test: c-ares
1.23+ caches answers itself), then one JSON line per query on stdout: seq, begun_ms (milliseconds
since the Unix epoch, taken before the query is handed to c-ares), done_ms, and the first A record
or the c-ares error (after a first line saying it has begun). With --stayopen the channel keeps its UDP socket for its whole life
(ARES_FLAG_STAYOPEN, as gRPC C-core sets it); without, c-ares closes idle sockets (its default).
"""

import argparse
import json
import sys
import threading
import time

import pycares
import pycares.errno


def now_ms():
    return int(time.time() * 1000)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--stayopen", action="store_true")
    parser.add_argument("--interval-ms", type=int, default=20)
    parser.add_argument("--timeout-ms", type=int, default=1000)
    args = parser.parse_args()

    flags = pycares.ARES_FLAG_NOSEARCH
    if args.stayopen:
        flags |= pycares.ARES_FLAG_STAYOPEN
    channel = pycares.Channel(
        flags=flags, servers=[args.server], timeout=args.timeout_ms / 1000, tries=2
    )
    lock = threading.Lock()
    done = []

    def callback_for(seq, begun_ms):
        def callback(result, error):
            record = {"seq": seq, "begun_ms": begun_ms, "done_ms": now_ms()}
            if error:
                record["error"] = pycares.errno.errorcode.get(error, str(error))
            else:
                record["answer"] = result.answer[0].data.addr
            with lock:
                done.append(record)

        return callback

    # The test waits for this line before it strikes the cache.
    print(json.dumps({"streaming": True}), flush=True)
    stop = threading.Event()

    def wait_for_eof():
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    seq = 0
    while not stop.is_set():
        begun_ms = now_ms()
        channel.query(
            f"q{seq}.who.test", pycares.QUERY_TYPE_A, callback=callback_for(seq, begun_ms)
        )
        seq += 1
        time.sleep(args.interval_ms / 1000)
    # Every query ends within its tries' timeouts.
    deadline = now_ms() + 3 * args.timeout_ms
    while now_ms() < deadline:
        with lock:
            if len(done) == seq:
                break
        time.sleep(0.05)
    with lock:
        for record in sorted(done, key=lambda record: record["seq"]):
            print(json.dumps(record))
        print(json.dumps({"asked": seq, "ended": len(done)}))


if __name__ == "__main__":
    main()
