#!/usr/bin/env python3
"""Run `voiceclone train` as the ranks of a sharded run on a Ray cluster (docs/distributed.md §5).

One Ray task per rank, all in one placement group (one bundle per rank: a GPU each, or CPUs).
Each task starts `voiceclone ARGS...` with the environment torchrun would give it -- RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT -- so voiceclone runs as one rank and starts
nothing itself; its rendezvous uses MASTER_PORT + 1 on the node of rank 0.

A rank that fails raises a Ray error (its exit status and the end of its error output); the
other ranks are cancelled, and with --max-restarts K every rank is started again, at most K
times, continuing from the last complete checkpoint (VOICECLONE_RESTART_COUNT tells voiceclone
it is a restart, so `--fresh` applies to the first attempt only). The workspace must be on a
filesystem every node of the cluster sees, at the same path.

  ray start --head
  python3 scripts/launchers/ray_train.py --workers 4 --gpus-per-worker 1 -- --workdir /shared/ws train
  python3 scripts/launchers/ray_train.py --workers 2 --cpu -- --workdir /shared/ws train --max-steps 100

Environment variables of this driver named VOICECLONE_*, RUST_*, HF_*, RAYON_NUM_THREADS and
LD_LIBRARY_PATH are passed to the ranks (Ray's workers do not inherit the driver's environment).
"""

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

FORWARDED_PREFIXES = ("VOICECLONE_", "RUST_", "HF_")
FORWARDED_NAMES = ("RAYON_NUM_THREADS", "LD_LIBRARY_PATH")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--workers", type=int, required=True, help="ranks of the run")
    p.add_argument("--gpus-per-worker", type=int, default=0, help="1: one GPU per rank")
    p.add_argument("--cpus-per-worker", type=int, default=1, help="CPUs reserved per rank")
    p.add_argument("--cpu", action="store_true",
                   help="CPU ranks (adds --cpu-ranks N to the train arguments)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="start every rank again after a failure, at most this many times")
    p.add_argument("--voiceclone", default=shutil.which("voiceclone") or "voiceclone",
                   help="the voiceclone binary on every node (default: from PATH)")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="-- then voiceclone's arguments, e.g. -- --workdir WS train")
    a = p.parse_args()
    if a.args and a.args[0] == "--":
        a.args = a.args[1:]
    if a.workers < 1 or "train" not in a.args:
        p.error("give --workers N and voiceclone's train arguments after --")
    if a.cpu == (a.gpus_per_worker > 0):
        p.error("choose --cpu or --gpus-per-worker 1")
    return a


def _die_with_parent():
    """In the rank's process: be killed when the Ray worker that started it dies (cancelled)."""
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


@ray.remote(num_cpus=0)
def rendezvous_point():
    """On rank 0's node: its address and a port P with P + 1 free as well."""
    ip = ray.util.get_node_ip_address()
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("", 0))
            port = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("", port + 1))
                    return ip, port
            except OSError:
                continue
    raise RuntimeError(f"no two consecutive free ports on {ip}")


@ray.remote(max_retries=0)
def rank_task(cmd, env, rank):
    """One rank: runs voiceclone and fails with its status and error output if it fails."""
    node = ray.get_runtime_context().get_node_id()
    full_env = dict(os.environ)
    full_env.update(env)
    proc = subprocess.Popen(cmd, env=full_env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_die_with_parent)
    tail = []
    for line in proc.stderr:
        sys.stderr.write(f"[rank {rank}] {line}")
        sys.stderr.flush()
        tail = (tail + [line.rstrip()])[-20:]
    code = proc.wait()
    if code != 0:
        raise RuntimeError(f"rank {rank} (node {node[:12]}) exited with status {code}:\n"
                           + "\n".join(tail))
    return rank


def forwarded_env():
    return {k: v for k, v in os.environ.items()
            if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}


def attempt(a, pg, attempt_no):
    """Runs every rank once; returns None on success, else the first failure (a Ray error)."""
    ip, port = ray.get(rendezvous_point.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0)).remote())
    bundles_nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    args = list(a.args)
    if a.cpu and "--cpu-ranks" not in args:
        args += ["--cpu-ranks", str(a.workers)]
    refs = []
    # Ranks per node, when the placement put the ranks on nodes in blocks of one size, as
    # torchrun numbers them (LOCAL_WORLD_SIZE, which `train.shard_group = "node"` reads).
    per_node = {n: sum(1 for r in range(a.workers) if bundles_nodes[r] == n) for n in set(bundles_nodes.values())}
    sizes = set(per_node.values())
    blocks = len(sizes) == 1 and all(
        bundles_nodes[r] == bundles_nodes[r - r % next(iter(sizes))] for r in range(a.workers))
    for rank in range(a.workers):
        node = bundles_nodes[rank]
        # The rank's index among the ranks on its node; with one GPU per rank, Ray makes only
        # that GPU visible to the rank, whose ordinal is then 0.
        local = sum(1 for r in range(rank) if bundles_nodes[r] == node)
        env = forwarded_env()
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(a.workers),
            "LOCAL_RANK": "0" if a.gpus_per_worker else str(local),
            "MASTER_ADDR": ip, "MASTER_PORT": str(port),
            "VOICECLONE_RESTART_COUNT": str(attempt_no),
        })
        if blocks:
            env["LOCAL_WORLD_SIZE"] = str(next(iter(sizes)))
        if a.cpu and "RAYON_NUM_THREADS" not in env:
            env["RAYON_NUM_THREADS"] = str(a.cpus_per_worker)
        refs.append(rank_task.options(
            num_cpus=a.cpus_per_worker, num_gpus=a.gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank),
        ).remote([a.voiceclone] + args, env, rank))
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except ray.exceptions.RayError as e:
            for r in pending:
                ray.cancel(r, force=True)
            for r in pending:
                try:
                    ray.get(r)
                except ray.exceptions.RayError:
                    pass
            return e
    return None


def main():
    a = parse_args()
    ray.init(address=a.address, log_to_driver=True)
    bundle = {"CPU": a.cpus_per_worker}
    if a.gpus_per_worker:
        bundle["GPU"] = a.gpus_per_worker
    pg = placement_group([dict(bundle) for _ in range(a.workers)], strategy="PACK")
    ray.get(pg.ready())
    try:
        for n in range(a.max_restarts + 1):
            failure = attempt(a, pg, n)
            if failure is None:
                return 0
            if n < a.max_restarts:
                print(f"ray_train: a rank failed ({failure}); restarting every rank from the last "
                      f"complete checkpoint (restart {n + 1} of {a.max_restarts})",
                      file=sys.stderr, flush=True)
            else:
                print(f"ray_train: the run failed after {n} restart(s):", file=sys.stderr)
                raise failure
    finally:
        remove_placement_group(pg)


if __name__ == "__main__":
    sys.exit(main())
