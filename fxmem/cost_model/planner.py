"""The planner: what happens to each saved tensor of a region, decided from the config, priced by the cost model."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from fxmem.analysis import Analysis, Role, SavedTensor
from fxmem.analysis.norm import NormUnit
from fxmem.analysis.recompute import copies_values, rebuild_inputs, replays_product
from fxmem.config import BITS_CHOICES, Config
from fxmem.cost_model.budget import fit_budget
from fxmem.cost_model.error import error_class
from fxmem.cost_model.memory import stored_bytes
from fxmem.cost_model.options import (
    REBUILD_SOURCE_BITS,
    Propose,
    held_as_is,
    lowest_bits,
    offloadable,
    offloaded,
    prenorm_plan,
    quantized_plan,
    rebuild_source,
    rebuilds_from_x,
    recompute_plan,
    replay_source_storage,
    replayed_plan,
    stored_as,
)
from fxmem.cost_model.plan import Action, Keep, LowRank, Plan, Quantize, RaisedFor, RebuildNormInput
from fxmem.cost_model.solve import Ceilings, Option, solve


class TechniqueHooks(Protocol):
    name: str
    propose: Propose | None


def plan_region(analysis: Analysis, config: Config, techniques: Sequence[TechniqueHooks],
                demoted: Mapping[str, int] | None = None) -> list[Plan]:
    """One plan per saved tensor, in the analysis' order: with memory_budget its one rule down to the region's target
    (fit_budget), else the same kind of choice against each storage's ceiling, the compression the config asks of it
    (fit_ceilings).

    Tensors sharing a storage are planned together: the storage is compressed
    only if every tensor viewing it may be.

    ``demoted``: the guard's demotions (fxmem/guard.py), a saved tensor's key (SavedRecord.key) -> how many steps:
    its storage's configured compression is made that many steps less lossy (_demoted_plan); under memory_budget
    a demoted storage is kept exact.
    """
    by_storage: dict[str, list[SavedTensor]] = {}
    for saved in analysis.saved:
        by_storage.setdefault(saved.storage, []).append(saved)
    levels = {storage: max(demoted.get(s.key, 0) for s in group)
              for storage, group in by_storage.items()} if demoted else {}
    tables_saved: set[str] = set()  # RoPE tables already paid for by an earlier plan
    # the analysis counts a storage's bytes on its first saved tensor, its owner
    held = {storage: held_as_is(group[0], group, analysis) for storage, group in by_storage.items()}
    if config.memory_budget is not None:  # the budget's planner starts from the fastest plan and spends from there
        owner_plans = {storage: plan or (Keep("exact: demoted by the guard") if levels.get(storage)
                                         else Keep("exact: memory_budget needs no bytes of it"))
                       for storage, plan in held.items()}
        fit_budget(analysis, by_storage, owner_plans, config, tables_saved,
                   frozen={storage for storage, level in levels.items() if level})
    else:
        owner_plans = fit_ceilings(analysis, by_storage, held, config, tables_saved, techniques, levels)
    plans = []
    for saved in analysis.saved:
        owner, owner_plan = by_storage[saved.storage][0], owner_plans[saved.storage]
        if saved is owner:
            plan = owner_plan
        elif owner_plan.action is not Action.KEEP:
            plan = dataclasses.replace(owner_plan, reason=f"view of {owner.name}, compressed with it", nbytes=None)
        else:
            plan = Keep(f"shares storage with {owner.name}" if saved.frees_memory
                        else "frees nothing: not an activation")
        plans.append(plan)
    return plans


def _configured_plan(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                     tables_saved: set[str], techniques: Sequence[TechniqueHooks]) -> Plan:
    """The compression the config asks of a storage: of the enabled techniques' proposals, the fewest bytes (a tie
    goes to the technique registered first: quantization, the cheaper one to compute); keep where none compresses."""
    # each with the RoPE tables it would save, on top of tables_saved (only the chosen plan's count)
    proposals: list[tuple[Plan, set[str]]] = []
    for technique in techniques:
        tables = set(tables_saved)
        plan = technique.propose(owner, group, analysis, config, tables) if technique.propose else None
        if plan is not None:
            proposals.append((plan, tables))
    if not proposals:
        return Keep(f"no enabled technique applies to {owner.role.value}")
    compressing = [c for c in proposals if c[0].action is not Action.KEEP]
    if not compressing:
        return Keep("; ".join(plan.reason for plan, _ in proposals))
    plan, tables = min(compressing, key=lambda c: c[0].nbytes)
    tables_saved.update(tables)
    return plan


def _demoted_plan(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                  tables_saved: set[str], techniques: Sequence[TechniqueHooks], steps: int) -> Plan:
    """The configured compression made ``steps`` steps less lossy (the guard's demotion): each step the config's lossy
    widths are raised a notch (less_lossy) until this storage's plan stores more bytes: more bits, then exact. The
    options fit_ceilings weighs against it (a replay, a recomputation) follow from its bytes."""
    plan = _configured_plan(owner, group, analysis, config, set(tables_saved) if steps else tables_saved, techniques)
    if not steps:
        return plan
    demoted: Config | None = config
    for _ in range(steps):
        while plan.action is not Action.KEEP:
            demoted = less_lossy(demoted) if demoted is not None else None
            if demoted is None:
                return Keep(f"exact: demoted by the guard ({steps} step{'s' if steps > 1 else ''})")
            candidate = _configured_plan(owner, group, analysis, demoted, set(tables_saved), techniques)
            if candidate.action is not Action.LOWRANK and demoted.lowrank is not None:  # factors no longer its plan: an
                demoted = demoted.replace(lowrank=None, prenorm_sharing=True)  # integer rank would double forever
            if stored_bytes(owner, candidate) > stored_bytes(owner, plan):
                plan = candidate
                break
    if plan.action is Action.KEEP:
        return Keep(f"exact: demoted by the guard ({steps} step{'s' if steps > 1 else ''})")
    plan = _configured_plan(owner, group, analysis, demoted, tables_saved, techniques)  # its RoPE tables paid
    return dataclasses.replace(plan, reason=f"{plan.reason}; demoted by the guard ({steps} step"
                                            f"{'s' if steps > 1 else ''})")


def less_lossy(config: Config) -> Config | None:
    """One notch less lossy: with ``bits``, each set width of it, ``qkv_bits`` and ``linear_input_bits`` one choice
    up, 8 bits left as it is; ``lowrank``'s rank doubled, off from half the channels; ``attn_sparsity`` doubled, off from a half.
    None where nothing is left to raise: exact."""
    changes: dict[str, object] = {}
    for name in ("bits", "qkv_bits", "linear_input_bits") if config.bits is not None else ():
        bits = getattr(config, name)
        if bits is not None and bits < BITS_CHOICES[-1]:
            changes[name] = BITS_CHOICES[BITS_CHOICES.index(bits) + 1]
    if config.lowrank is not None:
        doubled = config.lowrank * 2
        changes["lowrank"] = None if isinstance(config.lowrank, float) and doubled >= 0.5 else doubled
    if config.attn_sparsity is not None:
        changes["attn_sparsity"] = None if config.attn_sparsity * 2 >= 0.5 else config.attn_sparsity * 2
    if not changes:
        return None
    if "lowrank" in changes and changes["lowrank"] is None:
        changes["prenorm_sharing"] = True  # a part of lowrank, refused without it
    return config.replace(**changes)


def fit_ceilings(analysis: Analysis, by_storage: dict[str, list[SavedTensor]], held: dict[str, Plan | None],
                 config: Config, tables_saved: set[str], techniques: Sequence[TechniqueHooks],
                 demoted: Mapping[str, int] | None = None) -> dict[str, Plan]:
    """Without memory_budget, each storage's target is its ceiling: the bytes of the compression the config asks of it
    (_configured_plan), or of a norm input rebuilt from its output's factors with ``prenorm_sharing``. Its options
    (_options): that compression, at REBUILD_SOURCE_BITS or more where backward rebuilds something from it;
    with ``rebuild_from_x`` the experts' products replayed from what is held at REBUILD_SOURCE_BITS or more;
    recomputed element-wise from storages the config keeps exact (from a quantized one it would carry that error
    rather than its own, which is not less: a norm's output rebuilt from its input quantized per row bent q_proj's
    A gradient more than the output's own codes did); with ``rebuild_from_x`` an X W replayed from its
    x where its codes are coarser than 8 bits; a norm's input rebuilt from its output's factors (``prenorm_sharing``)
    or, with ``rebuild_from_x``, from its output's codes at 8 bits.

    The one solver chooses (cost_model/solve.py), by the rule memory_budget spends by (fit_budget), against a target
    per storage instead of per region: among the options within the ceiling, the least error class, then the fewest
    seconds per byte saved, then the most bytes saved; where none is within it, the fewest bytes. A storage the config
    keeps is not moved. The X W replayed from one x are weighed with x (_replayable). The bytes a rebuilt norm input
    adds to its output, raised to 8 bits, count against no ceiling: ``rebuild_from_x`` asks for them (at 2 bits a
    norm's input bends the gradient far more than one rebuilt from its output at 8; measured: docs/quantization.md).
    A storage is chosen again when a plan it reads changes (its x, its norm's output) or an option raises it.
    ``block_offload`` then puts a checkpointed block's input in host memory, as its plan stores it. A storage the
    guard ``demoted`` (storage -> steps) has that many steps less lossy a compression configured (_demoted_plan)."""
    demoted = demoted or {}
    configured = {storage: plan or _demoted_plan(by_storage[storage][0], by_storage[storage], analysis, config,
                                                 tables_saved, techniques, demoted.get(storage, 0))
                  for storage, plan in held.items()}
    plans = dict(configured)
    raised: dict[str, list[RaisedFor]] = {}  # storage -> what backward rebuilds from it, where an option raised it
    replayable = _replayable(analysis, by_storage, configured, config, tables_saved)
    readers: dict[str, set[str]] = {}  # storage -> the storages whose options read its plan
    for storage, source in replayable.items():
        readers.setdefault(source, set()).add(storage)
    for storage, group in by_storage.items():
        if group[0].role is Role.NORM_INPUT and group[0].norm is not None:
            readers.setdefault(group[0].norm.output.name, set()).add(storage)
        for leaf in rebuild_inputs(group[0].recompute) if group[0].recompute is not None else ():
            readers.setdefault(leaf.name, set()).add(storage)  # its recomputation may read it as planned
    # what the config asks of each, as the bytes it must free: fixed by it, whatever the others choose
    least_saves = {storage: by_storage[storage][0].nbytes - _ceiling(by_storage[storage][0], by_storage[storage], plan,
                                                                     analysis, config, tables_saved)
                   for storage, plan in configured.items() if plan.action is not Action.KEEP}

    def price(storage: str) -> list[Option]:
        if configured[storage].action is Action.KEEP:  # kept by the config, a source raised or not
            return []
        return _options(by_storage[storage][0], by_storage, configured, plans, raised, replayable, analysis, config,
                        tables_saved)

    def apply(option: Option) -> set[str]:
        storage = option.unit
        again = set()
        for source, purpose in option.raises:
            if purpose not in raised.setdefault(source, []):
                raised[source].append(purpose)
                again.add(source)
        if option.plans[storage] != plans[storage]:
            again |= readers.get(storage, set())
        plans[storage] = option.plans[storage]
        return again

    solve(Ceilings(least_saves), list(by_storage), price, apply)
    for storage, group in by_storage.items():
        if config.block_offload and offloadable(group[0], group, plans[storage], analysis):
            plans[storage] = offloaded(group[0], plans[storage])
    return plans


def _option(owner: SavedTensor, plan: Plan, raises: tuple[tuple[str, RaisedFor], ...] = ()) -> Option:
    """A preset's option for a storage, priced against keeping it exact."""
    return Option(owner.storage, owner.nbytes - stored_bytes(owner, plan), plan.seconds, error_class(owner, plan),
                  {owner.storage: plan}, raises)


def _replayable(analysis: Analysis, by_storage: dict[str, list[SavedTensor]], configured: dict[str, Plan],
                config: Config, tables_saved: set[str]) -> dict[str, str]:
    """The X W ``rebuild_from_x`` may replay, each with its x: configured below REBUILD_SOURCE_BITS (or at it only for
    rebuild_refusal), x kept or quantized, and the X W of one x together where their codes outweigh what x's codes at
    REBUILD_SOURCE_BITS add to its configured ones: the ceilings of the move (the X W and x) hold it. Against 8-bit
    codes a matmul would buy bytes the config did not ask for, at the machine's measured flops per byte. Counted so
    because a replayed product is back in backward beside the rest: without the count, hyclora-2bit with
    qkv_bits=None on whatif's Llama-3-8B replayed GQA's narrow q, k and v, for fewer saved bytes and a higher
    predicted peak (measured: docs/cost_model.md)."""
    if not rebuilds_from_x(config):
        return {}
    by_source: dict[str, list[str]] = {}
    for storage, group in by_storage.items():
        owner, plan = group[0], configured[storage]
        coarse = plan.action is Action.QUANTIZE and (plan.bits < REBUILD_SOURCE_BITS
                                                     or _held_for_refusal(owner, config))
        source = replay_source_storage(owner, by_storage) if coarse else None
        if source is not None and configured[source].action in (Action.KEEP, Action.QUANTIZE):
            by_source.setdefault(source, []).append(storage)
    replayable = {}
    for source, products in by_source.items():
        group, before = by_storage[source], configured[source]
        after = before if before.action is Action.KEEP else rebuild_source(
            group[0], group, analysis, config, set(tables_saved), RaisedFor.REPLAYED_X_W.value)
        if sum(configured[p].nbytes for p in products) > stored_bytes(group[0], after) - stored_bytes(group[0], before):
            replayable.update(dict.fromkeys(products, source))
    return replayable


def _held_for_refusal(owner: SavedTensor, config: Config) -> bool:
    """An X W held at 8 bits, above the preset's width, only because it feeds GELU, tanh or ReLU (rebuild_refusal)."""
    return config.bits is not None and owner.role is Role.LORA_BASE_OUTPUT and lowest_bits(owner) > config.bits


def _ceiling(owner: SavedTensor, group: list[SavedTensor], plan: Plan, analysis: Analysis, config: Config,
             tables_saved: set[str]) -> int:
    """The bytes of the compression the config asks of a storage: an X W that feeds GELU, tanh or ReLU at the
    preset's width, not the 8 bits it is held at unless replayed (rebuild_refusal)."""
    if rebuilds_from_x(config) and plan.action is Action.QUANTIZE and _held_for_refusal(owner, config):
        at_width = quantized_plan(owner, group, analysis, config, set(tables_saved), config.bits)
        if at_width.action is Action.QUANTIZE:
            return at_width.nbytes
    return stored_bytes(owner, plan)


def _options(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]], configured: dict[str, Plan],
             plans: dict[str, Plan], raised: dict[str, list[RaisedFor]], replayable: dict[str, str], analysis: Analysis,
             config: Config, tables_saved: set[str]) -> list[Option]:
    """fit_ceilings' options for a storage the config compresses, from the plans now: its configured compression
    first, each other option's reason naming that one's price."""
    storage, group = owner.storage, by_storage[owner.storage]
    base = configured[storage]
    if storage in raised and base.action is Action.QUANTIZE:
        purpose = RaisedFor.REPLAYED_X_W if RaisedFor.REPLAYED_X_W in raised[storage] else raised[storage][0]
        base = rebuild_source(owner, group, analysis, config, set(tables_saved), purpose.value)
    others: list[tuple[Plan, tuple[tuple[str, RaisedFor], ...]]] = []
    leaves = [n.name for n in rebuild_inputs(owner.recompute)] if owner.recompute is not None else []
    if all(_rebuildable_from(leaf, owner, base, configured, plans, config) for leaf in leaves):
        recompute = recompute_plan(owner, by_storage, plans)
        if recompute is not None:
            priced = f"{recompute.reason}, {recompute.seconds * 1e3:.3g} ms"
            others.append((dataclasses.replace(recompute, reason=priced), ()))
    source = replayable.get(storage)
    if source is not None and plans[source].action in (Action.KEEP, Action.QUANTIZE):
        others.append((replayed_plan(owner, source), ((source, RaisedFor.REPLAYED_X_W),)))
    others.extend(_prenorm_options(owner, by_storage, plans, analysis, config, tables_saved))
    # a norm input rebuilt from its output's factors caps its ceiling: what stores more is not weighed
    factored = [plan.nbytes for plan, _ in others if isinstance(plan, RebuildNormInput) and plan.bits is None]
    cap = min(factored, default=None)
    against = f", against {base.seconds * 1e3:.3g} ms for its {stored_as(base)}"
    options = [_option(owner, base), *(_option(owner, dataclasses.replace(plan, reason=plan.reason + against), raises)
                                       for plan, raises in others)]
    return [o for o in options if cap is None or stored_bytes(owner, o.plans[storage]) <= cap]


def replay_sources(recomputed: list[tuple[SavedTensor, Plan]]) -> frozenset[str]:
    """What the region's replays read, for the partition that runs them to hold at REBUILD_SOURCE_BITS or more: an X
    W's x; for the experts' replayed products, what they read through the recomputations between (the routed rows
    gathered again from the router's input)."""
    chains = {saved.storage: plan.chain for saved, plan in recomputed}
    sources = {n.name for saved, plan in recomputed if plan.chain == saved.rebuild_product
               for n in rebuild_inputs(plan.chain)}
    stack = [n.name for _, plan in recomputed if replays_product(plan.chain) for n in rebuild_inputs(plan.chain)]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in chains:
            stack.extend(n.name for n in rebuild_inputs(chains[name]))
        else:
            sources.add(name)
    return frozenset(sources)


def _rebuildable_from(leaf: str, owner: SavedTensor, owner_plan: Plan, configured: dict[str, Plan],
                      plans: dict[str, Plan], config: Config) -> bool:
    """A recomputation may read ``leaf``: kept as configured; where the chain replays the experts' products, under
    ``rebuild_from_x`` held at REBUILD_SOURCE_BITS as planned now (as a dense X W is replayed from its x); where it
    only copies values (the experts' routed rows gathered from the tokens), configured at no fewer bits than
    ``owner`` would be."""
    if replays_product(owner.recompute):
        return rebuilds_from_x(config) and _held_at_source_bits(leaf, plans)
    plan = configured.get(leaf, Keep(""))
    if plan.action is Action.KEEP:
        return True
    return (plan.action is Action.QUANTIZE and owner_plan.action is Action.QUANTIZE and plan.bits >= owner_plan.bits
            and copies_values(owner.recompute))


def _held_at_source_bits(storage: str, plans: dict[str, Plan]) -> bool:
    """``storage`` as planned now is kept, stored at REBUILD_SOURCE_BITS or more, or recomputed from such alone."""
    plan = plans.get(storage, Keep(""))
    if plan.action is Action.RECOMPUTE and plan.chain:
        return all(_held_at_source_bits(n.name, plans) for n in rebuild_inputs(plan.chain))
    return plan.action is Action.KEEP or (plan.action is Action.QUANTIZE and plan.bits >= REBUILD_SOURCE_BITS)


def _prenorm_options(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]], plans: dict[str, Plan],
                     analysis: Analysis, config: Config, tables_saved: set[str]
                     ) -> list[tuple[Plan, tuple[tuple[str, RaisedFor], ...]]]:
    """A norm's saved input (RMSNorm's input, LayerNorm's x_hat or x) rebuilt from its output: from the output's factors
    with ``prenorm_sharing`` (LoRAct's pre-norm sharing); with ``rebuild_from_x`` from the output's codes at
    REBUILD_SOURCE_BITS, the output raised to them where it is a linear's input (as rebuild_from_x holds every x)."""
    unit = owner.norm
    output_plan = _output_plan(unit, plans) if owner.role is Role.NORM_INPUT and unit is not None else None
    if output_plan is None:
        return []
    output = unit.output.name
    choices = []
    if config.prenorm_sharing and output_plan.action is Action.LOWRANK:
        choices.append((prenorm_plan(owner, analysis, output, output_plan), ()))
    if rebuilds_from_x(config) and output_plan.action is Action.QUANTIZE:
        if output_plan.bits >= REBUILD_SOURCE_BITS:
            choices.append((prenorm_plan(owner, analysis, output, output_plan), ()))
        elif any(Role.LINEAR_INPUT in (s.role, *s.also) for s in by_storage[output]):
            group = by_storage[output]
            purpose = RaisedFor.NORM_INPUT
            raised = rebuild_source(group[0], group, analysis, config, set(tables_saved), purpose.value)
            if raised.action is Action.QUANTIZE:
                choices.append((prenorm_plan(owner, analysis, output, raised), ((output, purpose),)))
    return choices


def _output_plan(unit: NormUnit, plans: dict[str, Plan]) -> Plan | None:
    """How a norm's output is stored as planned now: its own plan, or the plan of a tensor compressed through it (a
    per-head q or k norm's output, stored before RoPE for the q or k rotated from it); None if neither."""
    name = unit.output.name
    if name in plans:
        return plans[name]
    return next((plan for plan in plans.values()
                 if isinstance(plan, (Quantize, LowRank)) and plan.replay is not None and plan.source == name), None)
