#!/usr/bin/env python3
"""Clients for measuring `voiceclone serve` (docs/serving.md §6), Python standard library only.

  serve_client.py bench URL --streams "1 2 4 8" --frames 50 [--rounds 2]
      For each concurrency N: N simultaneous greedy requests of exactly FRAMES frames (response
      format pcm, so the first body bytes are audio). Prints, per N: time to first audio
      (mean / max), per-stream real-time factor (stream wall time / audio seconds, mean), how
      long a player that starts with the first audio and plays in real time waits for data
      in all (mean; what the server's chunking and speed cost a listener), and
      aggregate audio seconds per second (all audio / wall time from the first request to the
      last byte). Best (highest aggregate) of the rounds.

  serve_client.py load URL --requests 200 --clients 8 --frames 20 --pid PID [--passes 2]
      A bounded load test: CLIENTS threads send REQUESTS requests in all; by index, some are
      malformed (bad JSON, unknown voice, empty input, speed 2: each must be 400), some hang up
      after their first audio chunk, the rest are read to the end (each must be 200 with a
      complete body). Prints the counts, latencies, and the server's resident memory (VmRSS of
      PID) idle before, at its peak during, and idle again after each pass (the first pass also
      pays first-use growth: caches, allocator arenas; a leak shows as growth in later passes). Exits 1 when a
      well-formed request was not answered or a malformed one got anything but 400.

  serve_client.py voices --frames 50 [--rounds 3] LABEL,URL,PID,VOICE ...
      One greedy request of exactly FRAMES frames at a time to each (server, voice) target in
      turn, ROUNDS rounds after one warm-up each (rounds alternate the targets). Prints per
      target the best real-time factor (request time / audio seconds) and its ratio to the
      first target's, and the resident memory (VmRSS of PID) of every server after the runs.
"""

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse

RATE = 24_000


def connect(url):
    u = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=900)


def speech(url, body, hang_up=False, raw=None):
    """One request. Returns a dict: status, bytes, first (s to the first body byte), total (s),
    complete (the body ended as HTTP says), error (text of a non-200 answer), stall (s a player
    of 16-bit mono audio at RATE, starting with the first byte, would have waited for data)."""
    conn = connect(url)
    data = raw if raw is not None else json.dumps(body).encode()
    t0 = time.perf_counter()
    out = {"status": None, "bytes": 0, "first": None, "total": None, "complete": False,
           "stall": 0.0}
    played_until = None  # when the player will have played every byte received so far
    try:
        conn.request("POST", "/v1/audio/speech", data, {"Content-Type": "application/json"})
        r = conn.getresponse()
        out["status"] = r.status
        if r.status != 200:
            out["error"] = r.read().decode(errors="replace")
            out["complete"] = True
            return out
        while True:
            chunk = r.read1(1 << 16)
            if not chunk:
                out["complete"] = True
                break
            now = time.perf_counter() - t0
            if out["first"] is None:
                out["first"] = now
                played_until = now
            if now > played_until:
                out["stall"] += now - played_until
                played_until = now
            played_until += len(chunk) / 2 / RATE
            out["bytes"] += len(chunk)
            if hang_up:
                break
    except (OSError, http.client.HTTPException) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        out["total"] = time.perf_counter() - t0
        conn.close()
    return out


def get_json(url, path):
    conn = connect(url)
    conn.request("GET", path)
    r = conn.getresponse()
    v = json.loads(r.read())
    conn.close()
    return v


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wait_idle(url, limit=120):
    t = time.time()
    while time.time() - t < limit:
        h = get_json(url, "/health")
        if h["running"] == 0 and h["queued"] == 0 and h["streams"] == 0:
            return True
        time.sleep(0.05)
    return False


def bench_body(frames, seed, text):
    return {
        "model": "voiceclone",
        "input": text,
        "voice": "default",
        "response_format": "pcm",
        "greedy": True,
        "max_frames": frames,
        "seed": seed,
    }


def run_parallel(fn, n):
    results = [None] * n
    def work(i):
        results[i] = fn(i)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def bench(a):
    text = a.text
    # Warm-up (first-use costs: page faults of the weights, allocator growth).
    w = speech(a.url, bench_body(a.frames, 0, text))
    if w["status"] != 200:
        sys.exit(f"warm-up request failed: {w}")
    rows = []
    for n in [int(s) for s in a.streams.split()]:
        best = None
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            res = run_parallel(lambda i: speech(a.url, bench_body(a.frames, i, text)), n)
            wall = time.perf_counter() - t0
            bad = [r for r in res if r["status"] != 200 or not r["complete"]]
            if bad:
                sys.exit(f"{n} streams: failed requests: {bad}")
            audio = [r["bytes"] / 2 / RATE for r in res]
            agg = sum(audio) / wall
            row = {
                "streams": n,
                "ttfa_mean_ms": 1e3 * sum(r["first"] for r in res) / n,
                "ttfa_max_ms": 1e3 * max(r["first"] for r in res),
                "rtf_mean": sum(r["total"] / s for r, s in zip(res, audio)) / n,
                "stall_mean_ms": 1e3 * sum(r["stall"] for r in res) / n,
                "aggregate": agg,
                "audio_s": sum(audio),
                "wall_s": wall,
            }
            if best is None or row["aggregate"] > best["aggregate"]:
                best = row
        rows.append(best)
        print(
            f"{n} stream(s): time to first audio {best['ttfa_mean_ms']:.0f} ms mean, "
            f"{best['ttfa_max_ms']:.0f} ms max; per-stream RTF {best['rtf_mean']:.3f}; "
            f"a real-time player waits {best['stall_mean_ms']:.0f} ms after the first audio; "
            f"aggregate {best['aggregate']:.3f} audio s/s ({best['audio_s']:.2f} s of audio "
            f"in {best['wall_s']:.2f} s)",
            flush=True,
        )
    one = next((r for r in rows if r["streams"] == 1), None)
    if one:
        for r in rows:
            print(f"aggregate at {r['streams']} stream(s) = {r['aggregate'] / one['aggregate']:.2f}x one stream")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def load(a):
    good = bench_body(a.frames, 0, a.text)
    kinds = []
    for i in range(a.requests):
        if i % 10 == 3:
            kinds.append(("bad-json", None, b'{"model": "voiceclone", "input": '))
        elif i % 20 == 7:
            kinds.append(("unknown-voice", dict(good, voice="nobody-here"), None))
        elif i % 20 == 17:
            kinds.append(("empty-input", dict(good, input="  "), None))
        elif i % 25 == 11:
            kinds.append(("speed", dict(good, speed=2.0), None))
        elif i % 7 == 5:
            kinds.append(("hang-up", dict(good, seed=i), None))
        else:
            kinds.append(("full", dict(good, seed=i), None))
    wait_idle(a.url)
    idle_before = rss_mb(a.pid)
    ok = True
    for p in range(1, a.passes + 1):
        ok &= load_pass(a, kinds, p, idle_before)
    if not ok:
        sys.exit(1)


def load_pass(a, kinds, number, idle_before):
    idle_start = rss_mb(a.pid)
    peak = [idle_start]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb(a.pid))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    lock = threading.Lock()
    nxt = [0]
    results = []

    def client(_):
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(kinds):
                return
            kind, body, raw = kinds[i]
            r = speech(a.url, body, hang_up=(kind == "hang-up"), raw=raw)
            with lock:
                results.append((kind, r))

    t0 = time.perf_counter()
    run_parallel(client, a.clients)
    wall = time.perf_counter() - t0
    idle = wait_idle(a.url)
    stop.set()
    watcher.join()
    time.sleep(1.0)
    idle_after = rss_mb(a.pid)
    failures = []
    counts = {}
    for kind, r in results:
        counts[kind] = counts.get(kind, 0) + 1
        if kind in ("full",):
            if r["status"] != 200 or not r["complete"] or r["bytes"] == 0 or r["bytes"] % 2:
                failures.append((kind, r))
        elif kind == "hang-up":
            if r["status"] != 200:
                failures.append((kind, r))
        elif r["status"] != 400:
            failures.append((kind, r))
    full = sorted(r["total"] for k, r in results if k == "full")
    print(f"pass {number}: {len(results)} requests from {a.clients} clients in {wall:.1f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if full:
        print(f"full requests: median {full[len(full) // 2]:.2f} s, max {full[-1]:.2f} s")
    print(f"server VmRSS: idle {idle_start:.0f} MB before the pass, peak {peak[0]:.0f} MB, "
          f"idle {idle_after:.0f} MB after ({idle_after - idle_start:+.0f} MB in the pass, "
          f"{idle_after - idle_before:+.0f} MB since the first)")
    print(f"server idle afterwards: {idle}; health {get_json(a.url, '/health')}")
    for kind, r in failures[:10]:
        print(f"FAILED {kind}: {r}")
    return not failures and idle


def voices(a):
    targets = []
    for t in a.targets:
        label, url, pid, voice = t.split(",")
        targets.append({"label": label, "url": url, "pid": int(pid), "voice": voice, "best": None})
    for t in targets:
        w = speech(t["url"], dict(bench_body(a.frames, 0, a.text), voice=t["voice"]))
        if w["status"] != 200:
            sys.exit(f"warm-up of {t['label']} failed: {w}")
    for _ in range(a.rounds):
        for t in targets:
            r = speech(t["url"], dict(bench_body(a.frames, 0, a.text), voice=t["voice"]))
            if r["status"] != 200 or not r["complete"]:
                sys.exit(f"{t['label']}: request failed: {r}")
            rtf = r["total"] / (r["bytes"] / 2 / RATE)
            t["best"] = rtf if t["best"] is None else min(t["best"], rtf)
    first = targets[0]["best"]
    for t in targets:
        print(f"{t['label']} (voice {t['voice']}): best RTF {t['best']:.3f}, "
              f"{t['best'] / first:.3f}x {targets[0]['label']}", flush=True)
    for pid in dict.fromkeys(t["pid"] for t in targets):
        labels = ", ".join(t["label"] for t in targets if t["pid"] == pid)
        print(f"server {pid} ({labels}): {rss_mb(pid):.0f} MB resident")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    text = "The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet forest."
    b = sub.add_parser("bench")
    b.add_argument("url")
    b.add_argument("--streams", default="1 2 4 8")
    b.add_argument("--frames", type=int, default=50)
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("--text", default=text)
    b.add_argument("--json")
    l = sub.add_parser("load")
    l.add_argument("url")
    l.add_argument("--requests", type=int, default=200)
    l.add_argument("--clients", type=int, default=8)
    l.add_argument("--frames", type=int, default=20)
    l.add_argument("--pid", type=int, required=True)
    l.add_argument("--passes", type=int, default=2,
                   help="repeat the load; growth after the first pass is what a leak would show")
    l.add_argument("--text", default=text)
    v = sub.add_parser("voices")
    v.add_argument("targets", nargs="+", help="LABEL,URL,PID,VOICE")
    v.add_argument("--frames", type=int, default=50)
    v.add_argument("--rounds", type=int, default=3)
    v.add_argument("--text", default=text)
    a = p.parse_args()
    {"bench": bench, "load": load, "voices": voices}[a.cmd](a)


if __name__ == "__main__":
    main()
