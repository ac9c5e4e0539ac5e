"""What `memory.recompute` and `memory.offload` keep of one block's saved activations, and what
offload's host copies hold.

plan.storages lists each storage a block saves with the site calls whose ops save it, the
recomputed calls that keep it as their input and the producer whose recompute frees it. Each
reference an op takes goes the way of the innermost wrapped call around the op, since only the
innermost saved-tensor hooks run:

- recomputed: a placeholder, rebuilt in backward;
- offloaded: a host copy, one per storage and call (memory/offload.py), where the storage holds at
  least `memory.offload_min_bytes` and is not a parameter's cast; otherwise the tensor stays;
- neither: the tensor stays.

A recomputed call keeps its inputs instead, in the dtype they arrive in (with fp32 parameters
under autocast the residual stream and the normed x are fp32): a checkpoint saves its positional
inputs through the hooks around its call, so they take the same way (to the host inside an
offloaded call), while an output-discarding producer holds its inputs, and a checkpoint its
keyword arguments, on the device. A recomputed producer frees its output where the consumer kept
that very tensor, with every reference to that storage (a host copy made before stays). A storage
stays on the device while any reference to it does (in `kept_inputs` when only a recomputed call's
does).

So names compose as the wrappers do: a site recomputed inside an offloaded one saves nothing to
copy, but its inputs go to the host where it is a checkpoint and stay where it is a producer; a
site offloaded inside a recomputed one copies what it saves all the same (and nothing when
backward recomputes the region: memory/offload.py's `_recomputed`); nested offloaded calls each
copy what they save, a storage saved in both once by each; an offloaded consumer copies what a
recomputed producer then frees.

`layer_delta(cfg, layer_id, sh)` returns the change by category (negative: freed) and the bytes
the block's host copies hold when forward ends, the most they hold (backward only releases them);
`rope_tables_kept` the RoPE tables blocks keep. Checked to the byte, in total and host copies
(as forward ends and at their most in backward), against the real model with the wrappers
applied, every pair of names included (plan.measure on CPU, tests/unit/test_plan_memory.py;
under TP with and without sequence parallelism, tests/unit/test_plan_tp.py, where offload moves
the local shards of the DTensors that the sharded linears and sequence-parallel norms save).
"""

from __future__ import annotations

from dataclasses import dataclass

from moefold.config import Config
from moefold.plan import activations as act
from moefold.plan.activations import Bytes, Shapes
from moefold.plan.storages import Call, Stored, block_storages, rope_tables, site


@dataclass(frozen=True)
class _Wrapped:
    recompute: frozenset[str] = frozenset()
    offload: frozenset[str] = frozenset()
    min_bytes: int = 0

    @classmethod
    def of(cls, cfg: Config) -> _Wrapped:
        m = cfg.memory
        return cls(frozenset(m.recompute), frozenset(m.offload), m.offload_min_bytes)

    def innermost(self, call: Call) -> Call | None:
        """The innermost call around an op (`call` and the calls it is in) that a name wraps."""
        for depth in range(len(call), 0, -1):
            if site(call[:depth]) in self.recompute | self.offload:
                return call[:depth]
        return None


_STAYS, _KEPT, _DROPPED = "stays", "kept as an input", "dropped"


def _taken(s: Stored, call: Call, wrapped: _Wrapped) -> str | Call:
    """What becomes of a reference to `s` taken in `call` (an op's save, or a checkpoint's input
    saved around it): it stays, it is dropped (a recomputed call's placeholder), or the offloaded
    call that copies it to the host."""
    wrapper = wrapped.innermost(call)
    if wrapper is None:
        return _STAYS
    if site(wrapper) in wrapped.recompute:
        return _DROPPED
    if s.weight or s.nbytes < wrapped.min_bytes:  # the storage is what moves, and measured
        return _STAYS
    return wrapper


def _fates(s: Stored, wrapped: _Wrapped) -> set[str | Call]:
    """What becomes of each reference to `s`: its ops' saves, and the recomputed calls' inputs
    (`_KEPT` where one stays on the device)."""
    saves = {_taken(s, call, wrapped) for call in s.saved_in}
    recomputed = [call for call in s.input_of if site(call) in wrapped.recompute]
    inputs = {_taken(s, call[:-1], wrapped) for call in recomputed}  # saved around the checkpoint
    if any(site(call) in wrapped.recompute for call in s.held_by):
        inputs.add(_STAYS)
    return saves | {_KEPT if fate == _STAYS else fate for fate in inputs}


def _kept(storages: list[Stored], wrapped: _Wrapped) -> Bytes:
    """The bytes the storages keep on the device, by category."""
    kept: Bytes = {}
    for s in storages:
        fates = _fates(s, wrapped)
        if s.output_of is not None and site(s.output_of) in wrapped.recompute:
            continue  # freed once the consumer ran
        if _STAYS in fates:
            act._add(kept, **{_category(s, wrapped): s.nbytes})
        elif _KEPT in fates:
            act._add(kept, kept_inputs=s.nbytes)
    return kept


def _category(s: Stored, wrapped: _Wrapped) -> str:
    """The category of the first reference to `s` an op takes that stays on the device."""
    return next(s.category_of(i) for i, call in enumerate(s.saved_in) if _taken(s, call, wrapped) == _STAYS)


def _host(storages: list[Stored], wrapped: _Wrapped) -> int:
    """The bytes of the offloaded calls' host copies: one of each storage each call saved."""
    return sum(int(s.nbytes) for s in storages for fate in _fates(s, wrapped) if isinstance(fate, tuple))


def layer_delta(cfg: Config, layer_id: int, sh: Shapes) -> tuple[Bytes, int]:
    """(change of the block's saved bytes by category, bytes its offload holds on the host when
    forward ends: the RoPE tables' copies too, which every block's call of the site that saves
    them makes)."""
    wrapped = _Wrapped.of(cfg)
    if not (wrapped.recompute or wrapped.offload):
        return {}, 0
    storages = block_storages(cfg, layer_id, sh)
    plain, kept = _kept(storages, _Wrapped()), _kept(storages, wrapped)
    delta = {k: kept.get(k, 0) - plain.get(k, 0) for k in kept.keys() | plain.keys()}
    return {k: v for k, v in delta.items() if v}, _host(storages + rope_tables(cfg, sh), wrapped)


def rope_tables_kept(cfg: Config, sh: Shapes) -> Bytes:
    """The bytes of the RoPE tables that blocks keep on the device (every block alike), by
    category; the trunk lets the rest go when forward ends."""
    return _kept(rope_tables(cfg, sh), _Wrapped.of(cfg))
