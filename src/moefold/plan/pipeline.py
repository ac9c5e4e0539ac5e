"""Pipeline stages and how many micro-batches' activations each pipeline rank holds at once.

Layers split into pp·vpp model chunks (virtual stages), chunk c on pipeline rank c mod pp, the
embedding on chunk 0 and the final norm, output head and MTP modules on the last chunk. When the
layers do not divide evenly, the first n_layers mod (pp·vpp) chunks take one layer more (the last
chunks, which also hold the head, take fewer), and every rank is evaluated: the plan reports the
busiest.

In-flight micro-batches follow Megatron-Core's schedules
(megatron/core/pipeline_parallel/schedules.py): 1F1B runs pp − r − 1 warm-up forwards on rank r,
the interleaved schedule (pp − r − 1)·2 + (vpp − 1)·pp, and then alternates one forward and one
backward. We replay that order and take the largest sum of live activations, so uneven chunks are
weighed exactly. On rank 0 it gives Korthikanti et al.'s rule (arXiv 2205.05198, §4.2.3): the first
stage holds pp micro-batches of its layers, times (1 + (pp − 1)/(pp·vpp)) with interleaving.
"""

from __future__ import annotations

from dataclasses import dataclass

from moefold.errors import ConfigError


@dataclass(frozen=True)
class LayerIds:
    """Layer ids as ranges (a rank's chunks'), iterated and counted as ids: a model of 10^8
    layers lists them in a few ranges."""
    ranges: tuple[range, ...]

    def __len__(self) -> int:
        return sum(len(r) for r in self.ranges)

    def __iter__(self):
        return (i for r in self.ranges for i in r)

    def __contains__(self, layer_id: object) -> bool:
        return any(layer_id in r for r in self.ranges)


@dataclass(frozen=True)
class Chunk:
    index: int  # virtual stage, 0 .. pp·vpp − 1
    layers: range  # layer ids (MTP blocks numbered on from n_layers, after the last chunk's)
    first: bool  # holds the embedding
    last: bool  # holds the final norm, the output head and the MTP modules


def model_chunks(n_layers: int, mtp_layers: int, pp: int, vpp: int) -> list[Chunk]:
    virtual = pp * vpp
    if vpp > 1 and pp == 1:
        raise ConfigError(f"parallel.vpp={vpp} needs parallel.pp > 1 (virtual stages interleave "
                          "pipeline ranks)")
    if n_layers < virtual:
        raise ConfigError(f"parallel.pp·vpp = {virtual} exceeds model.n_layers={n_layers} (every "
                          "virtual pipeline stage needs at least one layer)")
    base, extra = divmod(n_layers, virtual)
    chunks, start = [], 0
    for c in range(virtual):
        last = c == virtual - 1
        stop = start + base + (c < extra) + (mtp_layers if last else 0)  # MTP blocks sit beside the head
        chunks.append(Chunk(c, range(start, stop), first=c == 0, last=last))
        start = stop
    return chunks


def rank_chunks(chunks: list[Chunk], pp: int, rank: int) -> list[Chunk]:
    """The chunks of pipeline rank `rank`, in model order (its virtual stages 0 .. vpp−1)."""
    return [c for c in chunks if c.index % pp == rank]


def schedule_micro_batches(micro_batches: int, pp: int) -> int:
    """Micro-batches the schedule is planned with: a multiple of pp, as Megatron's interleaved
    schedule requires. Fewer than pp cannot fill a pipeline (a config that does not set
    train.global_batch_size or train.grad_accum has one): those plan the steady state (2·pp, enough
    for every rank's warm-up to end), where the most micro-batches are in flight."""
    if pp == 1:
        return micro_batches
    if micro_batches < pp:
        return 2 * pp
    return -(-micro_batches // pp) * pp


def _order(micro_batches: int, pp: int, vpp: int, rank: int) -> list[tuple[str, int]]:
    """The rank's sequence of ("F" | "B", local chunk) steps."""
    total = micro_batches * vpp
    if vpp == 1:
        warmup = min(pp - rank - 1, micro_batches)
    else:
        warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)

    def fwd(k):
        return ("F", (k // pp) % vpp)

    def bwd(k):
        return ("B", vpp - 1 - (k // pp) % vpp)

    steps = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [fwd(warmup + k), bwd(k)]
    return steps + [bwd(k) for k in range(total - warmup, total)]


@dataclass(frozen=True)
class InFlight:
    bytes: int  # live saved activations at the peak
    per_chunk: tuple[int, ...]  # micro-batches live per local chunk at that moment


def peak_in_flight(chunk_bytes: list[int], micro_batches: int, pp: int, rank: int) -> InFlight:
    """Largest sum of live activations over the rank's schedule; chunk_bytes[i] is one
    micro-batch's saved activations of the rank's i-th chunk."""
    vpp = len(chunk_bytes)
    # The warm-up ends within 4·pp micro-batches, the steady state then repeats every pp·vpp
    # steps and the cool-down only frees: a longer schedule peaks where its first 4·pp do (a
    # multiple of pp), so train.grad_accum = 10^9 costs what 4·pp do.
    micro_batches = min(micro_batches, 4 * pp)
    live = [0] * vpp
    best = InFlight(0, tuple(live))
    for kind, chunk in _order(micro_batches, pp, vpp, rank):
        live[chunk] += 1 if kind == "F" else -1
        held = sum(n * b for n, b in zip(live, chunk_bytes))
        if held > best.bytes:
            best = InFlight(held, tuple(live))
    return best
