"""Expert-load statistics of the MoE layers: device-side sums per layer, summarised at log steps.

T tokens, E experts, L MoE layers.
`ExpertLoadStats.record` only adds into device buffers (no host sync, no allocation that grows with
the window), `pop` hands the raw sums over, and `summarize` moves every layer's sums to the host in
one copy and turns them into the logged metrics. Every raw value is a sum or a count, so ranks can
all-reduce (SUM) the popped dicts before `summarize` to get data-parallel totals.
"""

import contextlib
import math

import torch
from torch import Tensor

from moefold.dtypes import KeepsBufferDtypes
from moefold.moe.balance import whole_sequences

# Keys of the dict returned by `ExpertLoadStats.pop`.
TOKENS = "tokens_per_expert_E"  # int64 [E]: routed copies per expert, before capacity drops
DROPPED = "dropped"  # int64: copies dropped by the capacity limit
ENTROPY_SUM = "entropy_sum"  # fp32: Σ over real tokens of the routing entropy (nats)
ENTROPY_TOKENS = "entropy_tokens"  # int64: real tokens in that sum
AUX_SUM = "aux_sum/"  # + name, fp32: Σ over forwards of the unweighted aux value
AUX_CALLS = "aux_calls/"  # + name, int64: forwards that reported that value

# Keys an aux value's name must not shadow: summarize's own (an aux value's `<name>_per_layer`
# list too: tokens_per_expert would become the counts' key), and the trainer's losses that share
# the log record's namespace.
_RESERVED = {"load_imbalance", "load_imbalance_max", "load_cv", "dead_expert_fraction",
             "routing_entropy", "dropped_fraction", "tokens_per_expert", "loss", "val_loss"}


def _is_shard_sum(key: str) -> bool:
    """Sums over this rank's own tokens; the routed counts are already the data rank's."""
    return key in (ENTROPY_SUM, ENTROPY_TOKENS) or key.startswith(AUX_SUM)


class ExpertLoadStats(KeepsBufferDtypes):
    """Device-side accumulators of one MoE layer, all non-persistent buffers.

    Non-persistent: checkpoints neither hold nor expect them, and a resumed run starts a fresh
    window. `aux_names` registers those buffers up front; a name first seen in `record` is
    registered then, which changes the module once (a recompile under torch.compile).
    """

    def __init__(self, num_experts: int, aux_names: tuple[str, ...] = ()):
        super().__init__()
        self.num_experts = num_experts
        self.aux_names: list[str] = []
        # Sequence parallelism (parallel/sequence.py) sets a sum over the TP group: each rank's
        # entropy and aux-loss sums are then its sequences' shard of them.
        self.sum_over_shards = whole_sequences
        self.register_buffer("tokens_E", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("entropy_sum", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("entropy_tokens", torch.zeros((), dtype=torch.int64), persistent=False)
        for name in aux_names:
            self._add_aux(name)

    def _add_aux(self, name: str) -> None:
        if not name.isidentifier() or name in _RESERVED or name.endswith("_per_layer"):
            raise ValueError(f"aux value name {name!r} must be a Python identifier that is not a "
                             f"summary key ({sorted(_RESERVED)}) and does not end in _per_layer")
        device = self.tokens_E.device
        self.register_buffer(f"aux_sum_{name}", torch.zeros((), dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer(f"aux_calls_{name}", torch.zeros((), dtype=torch.int64, device=device),
                             persistent=False)
        self.aux_names.append(name)

    @torch.no_grad()
    def record(self, tokens_per_expert_E: Tensor, scores_TE: Tensor, num_dropped: Tensor | int,
               aux_values: dict[str, Tensor], valid_T: Tensor | None = None) -> None:
        """Add one forward. `scores_TE` rows must be distributions (softmax; a sigmoid router passes
        its scores divided by their row sum); `valid_T` marks real tokens for the entropy, the
        counts arrive already masked. A dropless layer passes `num_dropped=0`."""
        self.tokens_E += tokens_per_expert_E
        self.dropped += num_dropped
        # entr(p) = -p·ln p with entr(0) = 0: one-hot rows give exactly 0, no 0·(-inf) NaN.
        entropy_T = torch.special.entr(scores_TE.float()).sum(dim=-1)
        if valid_T is None:
            self.entropy_sum += entropy_T.sum()
            self.entropy_tokens += entropy_T.shape[0]
        else:
            self.entropy_sum += torch.where(valid_T, entropy_T, 0.0).sum()
            self.entropy_tokens += valid_T.sum()
        for name, value in aux_values.items():
            if name not in self.aux_names:
                self._add_aux(name)
            getattr(self, f"aux_sum_{name}").add_(value.detach().float())
            getattr(self, f"aux_calls_{name}").add_(1)

    def _raw(self) -> dict[str, Tensor]:
        raw = {TOKENS: self.tokens_E, DROPPED: self.dropped, ENTROPY_SUM: self.entropy_sum,
               ENTROPY_TOKENS: self.entropy_tokens}
        for name in self.aux_names:
            raw[AUX_SUM + name] = getattr(self, f"aux_sum_{name}")
            raw[AUX_CALLS + name] = getattr(self, f"aux_calls_{name}")
        return raw

    @torch.no_grad()
    def pop(self) -> dict[str, Tensor]:
        """The raw sums since the last pop (device tensors, no sync; under sequence parallelism the
        shards' sums added up, a collective), then reset to zero."""
        raw = {key: buf.clone() for key, buf in self._raw().items()}
        for key in filter(_is_shard_sum, raw):
            raw[key] = self.sum_over_shards(raw[key])
        for buf in self.buffers():
            buf.zero_()  # in place: CUDA graphs and compiled code keep the buffers' addresses
        return raw

    @contextlib.contextmanager
    def frozen(self):
        """Forwards inside (validation, generation) leave the accumulators unchanged."""
        saved = {key: buf.clone() for key, buf in self._raw().items()}
        try:
            yield
        finally:
            with torch.no_grad():
                for key, buf in self._raw().items():
                    # A name first recorded inside the block had nothing before it: back to zero.
                    if key in saved:
                        buf.copy_(saved[key])
                    else:
                        buf.zero_()


def summarize(raw_per_layer: list[dict[str, Tensor]]) -> dict[str, float | list[float]]:
    """The logged metrics of L layers' popped sums (in layer order). HOST SYNC: one copy.

    Ratios of a layer that saw no tokens are nan, and a mean over layers is nan if any layer's is.
    An aux value is averaged over the layers that reported it; its per-layer list has nan elsewhere.
    """
    if not raw_per_layer:
        return {}
    layers = [_layer_metrics(raw) for raw in _to_host(raw_per_layer)]
    imbalance_L = [m["load_imbalance"] for m in layers]
    routed = sum(sum(m["tokens"]) for m in layers)
    out: dict[str, float | list[float]] = {
        "load_imbalance": _mean(imbalance_L),
        "load_imbalance_max": _max(imbalance_L),
        "load_cv": _mean([m["load_cv"] for m in layers]),
        "dead_expert_fraction": _mean([m["dead_expert_fraction"] for m in layers]),
        "routing_entropy": _mean([m["routing_entropy"] for m in layers]),
        "dropped_fraction": sum(m["dropped"] for m in layers) / routed if routed else math.nan,
    }
    out.update(_aux_metrics([m["aux"] for m in layers]))
    out["load_imbalance_per_layer"] = imbalance_L
    out["tokens_per_expert_per_layer"] = [m["tokens"] for m in layers]
    return out


def _to_host(raw_per_layer: list[dict[str, Tensor]]) -> list[dict[str, list[float]]]:
    """Every layer's sums in one device→host copy. float64 holds int64 counts exactly below 2**53."""
    device = raw_per_layer[0][TOKENS].device
    keys_L = [sorted(raw) for raw in raw_per_layer]
    pieces = [raw[k].to(device, torch.float64).reshape(-1) for raw, keys in zip(raw_per_layer, keys_L)
              for k in keys]
    flat = torch.cat(pieces).tolist()  # HOST SYNC: the only one, once per log step
    host, i = [], 0
    for raw, keys in zip(raw_per_layer, keys_L):
        layer = {}
        for k in keys:
            n = raw[k].numel()
            layer[k], i = flat[i:i + n], i + n
        host.append(layer)
    return host


def _layer_metrics(raw: dict[str, list[float]]) -> dict:
    counts = [int(c) for c in raw[TOKENS]]
    total, num_experts = sum(counts), len(counts)
    mean = total / num_experts
    entropy_tokens = raw[ENTROPY_TOKENS][0]
    metrics = {"tokens": counts, "dropped": raw[DROPPED][0], "aux": _layer_aux(raw),
               "routing_entropy": raw[ENTROPY_SUM][0] / entropy_tokens if entropy_tokens else math.nan,
               "load_imbalance": math.nan, "load_cv": math.nan, "dead_expert_fraction": math.nan}
    if total:
        std = math.sqrt(sum((c - mean) ** 2 for c in counts) / num_experts)  # population std
        metrics.update(load_imbalance=max(counts) / mean, load_cv=std / mean,
                       dead_expert_fraction=counts.count(0) / num_experts)
    return metrics


def _layer_aux(raw: dict[str, list[float]]) -> dict[str, float]:
    """Per-forward mean of each aux value; a name with no forward in this window is left out."""
    aux = {}
    for key in raw:
        name = key.removeprefix(AUX_SUM)
        if key.startswith(AUX_SUM) and raw[AUX_CALLS + name][0]:
            aux[name] = raw[key][0] / raw[AUX_CALLS + name][0]
    return aux


def _aux_metrics(aux_L: list[dict[str, float]]) -> dict[str, float | list[float]]:
    names = sorted({name for aux in aux_L for name in aux})
    out: dict[str, float | list[float]] = {}
    for name in names:
        reported = [aux[name] for aux in aux_L if name in aux]
        out[name] = sum(reported) / len(reported)
    for name in names:
        out[f"{name}_per_layer"] = [aux.get(name, math.nan) for aux in aux_L]
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)  # nan propagates: a layer without tokens shows up


def _max(values: list[float]) -> float:
    # Python's max() with a nan is order-dependent; make it nan like _mean.
    return math.nan if any(math.isnan(v) for v in values) else max(values)
