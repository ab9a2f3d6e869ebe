#!/usr/bin/env python3
"""The scaling prediction of docs/distributed.md §8.2: step time and efficiency of a sharded run
on H200s, from the model's parameter counts and these assumptions (a prediction, not a
measurement):

- 400 TFLOP/s of useful bf16 throughput per GPU, 8 FLOP per parameter and position (forward,
  backward, recompute); an utterance of 175 talker positions and 125 frames, each frame 16
  positions of the code predictor; the text table is a lookup (no FLOPs, row-sparse traffic);
- 350 GB/s of NCCL bus bandwidth within an NVLink node, 45 GB/s per GPU across nodes (one
  400 Gb/s NIC per GPU); the ring algorithms' bytes (docs/distributed.md §8.1): per rank and step two gathers of the
  non-text weights in bf16 and one reduce-scatter of their gradients in f32 within the shard
  group, `(2 + 2 + 4) · Ψ' · (S−1)/S`, and with G groups an all-reduce of the f32 gradient shard
  across them, `2 · 4 · (Ψ'/S) · (G−1)/G`;
- flat sharding over nodes is bound by the slowest link of its ring: all of it at the
  inter-node speed; in shard groups of a node the group's traffic is on NVLink, the all-reduce on
  the NICs, two links that run at once;
- not overlapped: step = compute + communication; overlapped: step = max(compute,
  communication) + what cannot overlap — the first unit's gather and the last unit's reduction
  (the embedding unit's, in both passes' order);
- ranks beyond grad_accum have no micro-batch: a step's compute is ceil(grad_accum / N)
  micro-batches of 4 utterances, and efficiency can be at most grad_accum / N when N exceeds it.

  python3 scripts/bench/scaling_model.py
"""

FLOPS = 400e12
NVLINK, IB = 350e9, 45e9
POSITIONS, FRAMES, GROUPS = 175, 125, 16
UTTERANCES = 4  # per micro-batch

# Parameters in millions (docs/model.md §11, docs/distributed.md §7): trained talker, text table,
# the code predictor, the embedding unit (text table excluded).
MODELS = {
    "0.6B": dict(trained=905.9, text=311.2, predictor=110.1, embeddings=40.9),
    "1.7B": dict(trained=1916.7, text=311.2, predictor=112.2, embeddings=77.6),
}


def one_utterance_seconds(m):
    talker = (m["trained"] - m["text"] - m["predictor"]) * 1e6
    flop = 8 * (talker * POSITIONS + m["predictor"] * 1e6 * FRAMES * GROUPS)
    return flop / FLOPS


def step(m, nodes, per_node, grad_accum, hybrid, overlap):
    n = nodes * per_node
    size = per_node if hybrid else n
    groups = n // size
    psi = (m["trained"] - m["text"]) * 1e6
    emb = m["embeddings"] * 1e6
    micro = -(-grad_accum // n)
    compute = micro * UTTERANCES * one_utterance_seconds(m)
    one_gpu = grad_accum * UTTERANCES * one_utterance_seconds(m)

    def traffic(values):
        """(group link seconds, replica link seconds) for `values` parameters."""
        group_bytes = 8 * values * (size - 1) / size
        replica_bytes = 2 * 4 * (values / size) * (groups - 1) / groups
        group_bw = NVLINK if size <= per_node else IB
        return group_bytes / group_bw, replica_bytes / IB

    g, r = traffic(psi)
    if not overlap:
        comm = g + r
        total = compute + comm
    else:
        comm = max(g, r)
        eg, er = traffic(emb)
        # The embedding unit's first gather (2 of its 8 bytes) and its last reduction.
        exposed = eg * 2 / 8 + eg * 4 / 8 + er
        total = max(compute, comm) + exposed
    return one_gpu, compute, g + r, total, one_gpu / total, one_gpu / total / n


def main():
    print("| model | setup | sharding | overlap | grad_accum | 1 GPU | compute | collectives | step | "
          "speed-up | efficiency |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, m in MODELS.items():
        for nodes, per_node, setup in [(1, 8, "8 GPUs, NVLink"), (2, 8, "2 × 8 GPUs, IB")]:
            for grad_accum in [8, 16, 64]:
                for hybrid in ([False] if nodes == 1 else [False, True]):
                    for overlap in [False, True]:
                        one, compute, comm, total, speed, eff = step(
                            m, nodes, per_node, grad_accum, hybrid, overlap)
                        print(f"| {name} | {setup} | {'groups of 8' if hybrid else 'flat'} | "
                              f"{'yes' if overlap else 'no'} | {grad_accum} | {one * 1e3:.0f} ms | "
                              f"{compute * 1e3:.0f} ms | {comm * 1e3:.0f} ms | {total * 1e3:.0f} ms | "
                              f"{speed:.1f}× | {eff * 100:.0f} % |")


if __name__ == "__main__":
    main()
