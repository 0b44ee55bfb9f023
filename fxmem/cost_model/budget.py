"""memory_budget: the region's saved bytes spent down to a target, one move at a time (fit_budget): exact options first,
then quantization down BUDGET_STAGES, then low-rank factors, and whole blocks checkpointed where that is cheaper."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch.fx import Node

from fxmem.analysis import Analysis, SavedTensor
from fxmem.analysis.blocks import Block
from fxmem.analysis.graph import storage_base, storage_bytes, tensor_val
from fxmem.analysis.recompute import rebuild_inputs, replays_product
from fxmem.config import Config
from fxmem.cost_model.error import BUDGET_STAGES, EXACT_ERROR, error_class, sensitivity
from fxmem.cost_model.memory import planned_bytes
from fxmem.cost_model.options import (
    REBUILD_SOURCE_BITS,
    block_source_bits,
    held_as_is,
    lowest_bits,
    offloadable,
    offloaded,
    propose_lowrank,
    quantizable,
    quantized_plan,
    recompute_plan,
    replay_source_storage,
    replayed_plan,
    source_bits,
)
from fxmem.cost_model.plan import Action, Checkpoint, Keep, Plan, Recompute
from fxmem.cost_model.prices import forward_seconds
from fxmem.cost_model.solve import Budget, Option, solve


@dataclass
class _Spending:
    """What memory_budget's moves so far constrain."""

    floors: dict[str, int]  # the fewest bits a storage may go to: backward rebuilds something from it
    # storages recomputed in backward (element-wise, replayed, or with their checkpointed block)
    recomputed: set[str] = field(default_factory=set)
    read_by_recompute: set[str] = field(default_factory=set)  # storages those recomputations read: they stay saved
    checkpointed: set[str] = field(default_factory=set)  # blocks checkpointed
    added: set[str] = field(default_factory=set)  # storages a checkpointed block saves that nothing saved before


@dataclass(frozen=True)
class _BlockParts:
    """A block as memory_budget's checkpoint of it moves storages: those its forward makes but its outputs (freed,
    recomputed with it) and its sources (analysis.blocks.Block.sources: saved, at their floor or finer)."""

    block: Block
    inside: tuple[str, ...]
    sources: dict[str, Node]  # storage -> its base node

    @staticmethod
    def of(block: Block, analysis: Analysis, by_storage: dict[str, list[SavedTensor]]) -> _BlockParts:
        sources = {storage_base(node).name: storage_base(node) for node in block.sources}
        inside = tuple(storage for storage, group in by_storage.items()
                       if group[0].layer == block.name and group[0].frees_memory and storage not in sources
                       and storage not in analysis.output_storages)
        return _BlockParts(block, inside, sources)


def fit_budget(analysis: Analysis, by_storage: dict[str, list[SavedTensor]], owner_plans: dict[str, Plan],
               config: Config, tables_saved: set[str], frozen: set[str] | frozenset[str] = frozenset()) -> None:
    """memory_budget: one rule over every typed option (``budget_options``, and a block checkpoint per block the
    analysis offers, ``_block_options``), applied by the one solver (cost_model/solve.py). From the exact plan, each
    step takes the option of the least error class, the fewest seconds per byte it saves within it (the most bytes
    saved on a tie), among every option that saves device bytes; until the region fits its target or no option is
    left (budget_note then says the target is not met). A move that changes another storage's options (a RoPE table
    paid, a storage a recomputation reads moved) prices that storage, and the blocks holding it, again. The ``frozen``
    storages (the guard's) are not moved."""
    target = budget_bytes(analysis, config)
    total = sum(planned_bytes(group[0], owner_plans[storage]) for storage, group in by_storage.items())
    free = [storage for storage, group in by_storage.items()
            if storage not in frozen and held_as_is(group[0], group, analysis) is None]
    free_set = set(free)
    # the analysis' rebuild sources: the first partition's replayed X W's x, a chunked op's or a checkpointed
    # block's input
    spending = _Spending({storage: source_bits(by_storage[storage][0], config)
                          for storage in analysis.rebuild_sources if storage in by_storage})
    readers: dict[str, set[str]] = {}  # the storages whose element-wise recomputation reads each storage
    for storage in free:
        chain = by_storage[storage][0].recompute
        for node in rebuild_inputs(chain) if chain is not None else ():
            readers.setdefault(node.name, set()).add(storage)
    # blocks drawing random numbers are not offered (backend.py reports them)
    blocks = {b.name: _BlockParts.of(b, analysis, by_storage) for b in analysis.blocks if b.random is None}
    holding: dict[str, set[str]] = {}  # the blocks whose checkpoint moves or saves each storage
    for parts in blocks.values():
        for storage in (*parts.inside, *parts.sources):
            holding.setdefault(storage, set()).add(parts.block.name)

    def price(unit: str) -> list[Option]:
        if unit in blocks:
            return _block_options(blocks[unit], by_storage, owner_plans, config, spending)
        return budget_options(by_storage[unit][0], by_storage, analysis, owner_plans, config, tables_saved, spending)

    def apply(option: Option) -> set[str]:
        if option.unit in blocks:
            _checkpoint(option, blocks[option.unit], by_storage, owner_plans, config, spending)
            repriced = option.plans.keys() | option.added.keys()
        else:
            owner, plan = by_storage[option.unit][0], option.plans[option.unit]
            owner_plans[option.unit] = dataclasses.replace(plan, reason=f"{plan.reason} (memory_budget)")
            tables_saved.update(option.tables)
            repriced = {option.unit, *readers.get(option.unit, ())} | (free_set if option.tables else set())
            if isinstance(plan, Recompute):
                spending.recomputed.add(option.unit)
                read = {n.name for n in rebuild_inputs(plan.chain)}
                spending.read_by_recompute |= read
                repriced |= read
                if plan.chain is owner.rebuild_product:  # replayed: x stays at REBUILD_SOURCE_BITS or more
                    source = replay_source_storage(owner, by_storage)
                    spending.floors[source] = max(spending.floors.get(source, 0), REBUILD_SOURCE_BITS)
        blocks_again = set().union(*(holding.get(storage, ()) for storage in repriced)) - spending.checkpointed
        return (repriced & free_set) | blocks_again

    # graph order, blocks last: equal keys are taken in that order
    solve(Budget(total, target), [*free, *blocks], price, apply)


def _block_options(parts: _BlockParts, by_storage: dict[str, list[SavedTensor]], owner_plans: dict[str, Plan],
                   config: Config, spending: _Spending) -> list[Option]:
    """Checkpointing a block from the plans now, or nothing where it saves no device bytes or cannot be
    taken: a storage it would free is read by a recomputation outside it. Its error class is its sources' (exact
    where they are kept exact); its seconds are the block's forward run again less the seconds of the plans it
    replaces."""
    name = parts.block.name
    if name in spending.checkpointed:
        return []
    outside = spending.recomputed.difference(parts.inside, parts.sources)
    if {n.name for storage in outside for n in _recomputed_from(owner_plans[storage])} & set(parts.inside):
        return []
    floor = block_source_bits(config)
    plans: dict[str, Plan] = {}
    added = {}
    for storage, node in parts.sources.items():
        if storage not in by_storage:
            if storage not in spending.added:
                added[storage] = storage_bytes(tensor_val(node))
            continue
        plan = owner_plans[storage]
        if not (plan.action is Action.KEEP or (plan.action is Action.QUANTIZE and plan.bits >= floor)):
            plans[storage] = Keep(f"what {name} is recomputed from in backward: kept exact")
    freed = {storage: Checkpoint("", block=name, nbytes=0) for storage in parts.inside}
    changed = plans | freed
    saved = sum(planned_bytes(by_storage[s][0], owner_plans[s]) - planned_bytes(by_storage[s][0], p)
                for s, p in changed.items()) - sum(added.values())
    if saved <= 0:
        return []
    device = next(str(v.device) for v in map(tensor_val, parts.block.nodes) if v is not None)
    forward = forward_seconds(parts.block.nodes, device)
    seconds = forward + sum(p.seconds - owner_plans[s].seconds for s, p in changed.items())
    error = max((error_class(by_storage[s][0], changed.get(s, owner_plans[s]))
                 for s in parts.sources if s in by_storage), default=EXACT_ERROR)
    price = f"a {forward * 1e3:.3g} ms forward for {saved / 2**20:.2f} MiB"
    checkpointed = Checkpoint(f"recomputed in backward with its block, {name}: {price}", block=name, price=price,
                              nbytes=0)
    plans |= dict.fromkeys(parts.inside, checkpointed)
    return [Option(name, saved, seconds, error, plans, added=added)]


def _recomputed_from(plan: Plan) -> list[Node]:
    """The saved nodes a recomputation reads (none for a storage recomputed with its checkpointed block: its block's
    sources are read, held by the block's own move)."""
    return rebuild_inputs(plan.chain) if isinstance(plan, Recompute) else []


def _checkpoint(option: Option, parts: _BlockParts, by_storage: dict[str, list[SavedTensor]],
                owner_plans: dict[str, Plan], config: Config, spending: _Spending) -> None:
    """Applies a block checkpoint."""
    for storage, plan in option.plans.items():
        owner_plans[storage] = dataclasses.replace(plan, reason=f"{plan.reason} (memory_budget)")
        if plan.action is Action.CHECKPOINT:
            spending.recomputed.add(storage)
        else:  # a source saved again
            spending.recomputed.discard(storage)
    spending.read_by_recompute |= parts.sources.keys()
    floor = block_source_bits(config)
    for storage in parts.sources.keys() & by_storage.keys():
        spending.floors[storage] = max(spending.floors.get(storage, 0), floor)
    spending.added |= option.added.keys()
    spending.checkpointed.add(option.unit)


def budget_options(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]], analysis: Analysis,
                   owner_plans: dict[str, Plan], config: Config, tables_saved: set[str],
                   spending: _Spending) -> list[Option]:
    """The options memory_budget weighs for ``owner``'s storage from its plan now: recomputed element-wise from what
    stays saved; an X W replayed from its x (``rebuild_from_x``), x then held at REBUILD_SOURCE_BITS or more; a
    checkpointed block's input in host memory (``block_offload``, on a device whose host memory is apart from it);
    quantized at each BUDGET_STAGES width below its plan's and at or above its floor; factored at ``lowrank``'s
    rank. A storage a recomputation reads stays saved; one recomputed is not moved again. Pre-norm sharing, the
    preset's sparsified probabilities and the experts' replayed products are not among them."""
    storage, group = owner.storage, by_storage[owner.storage]
    plan = owner_plans[storage]
    if plan.action not in (Action.KEEP, Action.QUANTIZE, Action.LOWRANK) or plan.host:
        return []
    before = planned_bytes(owner, plan)

    def moved(to: Plan, tables: frozenset[str] = frozenset()) -> Option:
        return Option(storage, before - planned_bytes(owner, to), to.seconds - plan.seconds, error_class(owner, to),
                      {storage: to}, tables=tables)

    options = []
    if storage not in spending.read_by_recompute:
        recompute = recompute_plan(owner, by_storage, owner_plans)
        # not the experts' products: this solver holds no floor under what they replay from
        if (recompute is not None and not replays_product(recompute.chain)
                and not spending.recomputed & {n.name for n in rebuild_inputs(recompute.chain)}):
            options.append(moved(recompute))
        replay = _replay_plan(owner, by_storage, owner_plans, config)
        if replay is not None and replay_source_storage(owner, by_storage) not in spending.recomputed:
            options.append(moved(replay))
    if config.block_offload and offloadable(owner, group, plan, analysis) and _host_apart(owner):
        options.append(moved(offloaded(owner, plan)))
    if plan.action is Action.LOWRANK:
        return options
    # the RoPE tables a quantized plan pays for stay saved with what replaces it: they stay in its bytes
    held_tables = 0 if plan.action is Action.KEEP else plan.nbytes - quantized_plan(
        owner, group, analysis, config, set(tables_saved), plan.bits).nbytes
    lower = []
    if quantizable(group, config):
        floor = max(lowest_bits(owner), spending.floors.get(storage, 0))
        owner_sensitivity = sensitivity(owner)
        lower = [bits for bits, stage_sensitivity in BUDGET_STAGES if stage_sensitivity == owner_sensitivity
                 and bits >= floor and (plan.action is Action.KEEP or bits < plan.bits)]
    for bits in lower:
        tables = set(tables_saved)
        lowered = quantized_plan(owner, group, analysis, config, tables, bits)
        if lowered.action is Action.QUANTIZE:
            options.append(moved(dataclasses.replace(lowered, nbytes=lowered.nbytes + held_tables),
                                 frozenset(tables - tables_saved)))
    if config.lowrank is not None and storage not in spending.floors:
        tables = set(tables_saved)
        factored = propose_lowrank(owner, group, analysis, config, tables)
        if factored is not None and factored.action is Action.LOWRANK:
            options.append(moved(dataclasses.replace(factored, nbytes=factored.nbytes + held_tables),
                                 frozenset(tables - tables_saved)))
    return options


def _host_apart(owner: SavedTensor) -> bool:
    """Whether host memory is apart from the memory ``owner`` lives in: on a CPU it is the same, and offloading
    saves nothing."""
    return tensor_val(owner.base).device.type != "cpu"


def _replay_plan(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]], owner_plans: dict[str, Plan],
                 config: Config) -> Plan | None:
    """``rebuild_from_x``: an X W rebuilt in backward by replaying its matmul from its x, where x is kept or stored at
    REBUILD_SOURCE_BITS or more, priced by the matmul's flops; None where it cannot be."""
    source = replay_source_storage(owner, by_storage) if config.rebuild_from_x else None
    if source is None:
        return None
    x = owner_plans[source]
    if not (x.action is Action.KEEP or (x.action is Action.QUANTIZE and x.bits >= REBUILD_SOURCE_BITS)):
        return None
    return replayed_plan(owner, source)


def budget_bytes(analysis: Analysis, config: Config) -> float:
    """memory_budget in bytes: as given, or its fraction of what torch.compile's own partition saves (of what the
    region saves as partitioned where that was not measured)."""
    if config.budget_in_bytes():
        return config.memory_budget
    reference = analysis.exact_bytes if analysis.exact_bytes is not None else sum(s.nbytes for s in analysis.saved)
    return config.memory_budget * reference


def budget_note(analysis: Analysis, plans: list[Plan], config: Config) -> tuple[str, bool] | None:
    """The report's note on the region's plan against memory_budget and whether the plan fits it; None without
    a budget."""
    if config.memory_budget is None:
        return None
    target = budget_bytes(analysis, config)
    planned = sum(planned_bytes(s, p) for s, p in zip(analysis.saved, plans, strict=True))
    reference = analysis.exact_bytes if analysis.exact_bytes is not None else sum(s.nbytes for s in analysis.saved)
    amounts = (f"{planned / 2**20:.2f} MiB saved against a target of {target / 2**20:.2f} MiB "
               f"({planned / reference if reference else 0:.1%} of the {reference / 2**20:.2f} MiB "
               f"{'torch.compile saves' if analysis.exact_bytes is not None else 'saved as partitioned'})")
    if planned <= target:
        return f"memory_budget {config.memory_budget:g}: planned {amounts}", True
    return (f"memory_budget {config.memory_budget:g} not met: planned {amounts} with every quantizable tensor at "
            "2 bits; the rest are kept exact or hold their roles' plans (loss input, x @ A, outputs)"), False
