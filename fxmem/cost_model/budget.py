"""memory_budget: the region's saved bytes spent down to a target, one move at a time (fit_budget): exact options first,
then quantization down BUDGET_STAGES, then low-rank factors, and whole blocks checkpointed where that is cheaper."""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field

from torch.fx import Node

from fxmem.analysis import Analysis, Role, SavedTensor
from fxmem.analysis.blocks import Block
from fxmem.analysis.graph import storage_base, storage_bytes, tensor_val
from fxmem.analysis.recompute import rebuild_inputs, replays_product
from fxmem.config import Config
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

# memory_budget's ladder: (bits, sensitivity) stages, taken in order until the region fits. Sensitivity 0 is
# activation and product inputs and X W; 1 norm inputs; 2 linear inputs; 3 attention's q, k, v. The least
# sensitive go first, and q, k, v drop below 8 bits last, after everything else is at 2 (docs/quantization.md
# measures why: the softmax amplifies their error; a linear input's error reaches its LoRA A's gradient whole, and
# at 2 bits it was worse than a norm input's).
BUDGET_STAGES = ((8, 0), (8, 1), (8, 2), (8, 3), (4, 0), (4, 1), (4, 2), (2, 0), (2, 1), (2, 2), (4, 3), (2, 3))


# The error class of a memory_budget option: exact ones first (recompute, an X W replayed from its x, a block's input
# waiting in host memory), then quantization down BUDGET_STAGES, then low-rank factors, whose error no bit width
# bounds (a rank keeps a subspace, not a range): a storage is factored only once its quantization reached its floor.
EXACT_ERROR = 0
LOWRANK_ERROR = len(BUDGET_STAGES) + 1


@dataclass(frozen=True)
class Option:
    """One typed way to hold a saved storage between forward and backward (recompute, replay, quantize b, low-rank
    k, offload; keep is where every storage starts): its plan, which prices it in device bytes and seconds, and its
    error class."""

    storage: str
    plan: Plan
    error: int
    tables: frozenset[str] = frozenset()  # RoPE tables the plan pays for, added to the region's once it is chosen


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


@dataclass(frozen=True)
class BlockOption:
    """memory_budget's block checkpoint (``block_checkpoint``): the new plans of the storages it moves, and the
    sources it saves that nothing saved before (``added``, storage -> bytes)."""

    block: str
    plans: dict[str, Plan]
    added: dict[str, int]


def fit_budget(analysis: Analysis, by_storage: dict[str, list[SavedTensor]], owner_plans: dict[str, Plan],
               config: Config, tables_saved: set[str], frozen: set[str] | frozenset[str] = frozenset()) -> None:
    """memory_budget: one rule over every typed option (``budget_options``, and a block checkpoint per block the
    analysis offers, ``_block_move``). From the exact plan, each step takes the option of the least error class, the
    fewest seconds per byte it saves within it (the most bytes saved on a tie), among every option that saves
    device bytes; until the region fits its target or no option is left (budget_note then says the target is not
    met). A move that changes another storage's options (a RoPE table paid, a storage a recomputation reads moved)
    prices that storage, and the blocks holding it, again. The ``frozen`` storages (the guard's) are not moved."""
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
    heap: list[tuple[tuple[int, float, int], int, Option | BlockOption]] = []
    counter = 0
    # pushed in graph order, blocks last: equal keys then pop by that order, not by a set's (hash-seeded) order
    position = {unit: index for index, unit in enumerate([*free, *blocks])}

    def move(unit: str) -> tuple[tuple[int, float, int], Option | BlockOption] | None:
        if unit in blocks:
            return _block_move(blocks[unit], by_storage, owner_plans, config, spending)
        return _next_move(unit, analysis, by_storage, owner_plans, config, tables_saved, spending)

    def push(units: set[str] | list[str]) -> None:
        nonlocal counter
        for unit in sorted(units, key=position.__getitem__):
            found = move(unit)
            if found is not None:
                heapq.heappush(heap, (found[0], counter, found[1]))
                counter += 1

    push([*free, *blocks])
    while total > target and heap:
        key, _, option = heapq.heappop(heap)
        unit = option.block if isinstance(option, BlockOption) else option.storage
        fresh = move(unit)
        if fresh is None:
            continue
        if fresh[0] != key or fresh[1] != option:  # another move changed what this one reads: priced again
            push([unit])
            continue
        if isinstance(option, BlockOption):
            total += _checkpoint(option, blocks[option.block], by_storage, owner_plans, config, spending)
            repriced = option.plans.keys() | option.added.keys()
        else:
            owner = by_storage[option.storage][0]
            total += planned_bytes(owner, option.plan) - planned_bytes(owner, owner_plans[option.storage])
            owner_plans[option.storage] = dataclasses.replace(option.plan,
                                                              reason=f"{option.plan.reason} (memory_budget)")
            tables_saved.update(option.tables)
            repriced = {option.storage, *readers.get(option.storage, ())} | (free_set if option.tables else set())
            if option.plan.action is Action.RECOMPUTE:
                spending.recomputed.add(option.storage)
                read = {n.name for n in rebuild_inputs(option.plan.chain)}
                spending.read_by_recompute |= read
                repriced |= read
                if option.plan.chain is owner.rebuild_product:  # replayed: x stays at REBUILD_SOURCE_BITS or more
                    source = replay_source_storage(owner, by_storage)
                    spending.floors[source] = max(spending.floors.get(source, 0), REBUILD_SOURCE_BITS)
        push(repriced & free_set)
        push(set().union(*(holding.get(storage, ()) for storage in repriced)) - spending.checkpointed)


def _block_move(parts: _BlockParts, by_storage: dict[str, list[SavedTensor]], owner_plans: dict[str, Plan],
                config: Config, spending: _Spending) -> tuple[tuple[int, float, int], BlockOption] | None:
    """Checkpointing a block from the plans now, with its key, or None where it saves no device bytes or cannot be
    taken: a storage it would free is read by a recomputation outside it. Its error class is its sources' (exact
    where they are kept exact); its seconds are the block's forward run again less the seconds of the plans it
    replaces."""
    name = parts.block.name
    if name in spending.checkpointed:
        return None
    outside = spending.recomputed.difference(parts.inside, parts.sources)
    if {n.name for storage in outside for n in _recomputed_from(owner_plans[storage])} & set(parts.inside):
        return None
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
        return None
    device = next(str(v.device) for v in map(tensor_val, parts.block.nodes) if v is not None)
    forward = forward_seconds(parts.block.nodes, device)
    seconds = forward + sum(p.seconds - owner_plans[s].seconds for s, p in changed.items())
    error = max((_error(by_storage[s][0], changed.get(s, owner_plans[s])) for s in parts.sources if s in by_storage),
                default=EXACT_ERROR)
    price = f"a {forward * 1e3:.3g} ms forward for {saved / 2**20:.2f} MiB"
    checkpointed = Checkpoint(f"recomputed in backward with its block, {name}: {price}", block=name, price=price,
                              nbytes=0)
    plans |= dict.fromkeys(parts.inside, checkpointed)
    return (error, seconds / saved, -saved), BlockOption(name, plans, added)


def _recomputed_from(plan: Plan) -> list[Node]:
    """The saved nodes a recomputation reads (none for a storage recomputed with its checkpointed block: its block's
    sources are read, held by the block's own move)."""
    return rebuild_inputs(plan.chain) if isinstance(plan, Recompute) else []


def _checkpoint(option: BlockOption, parts: _BlockParts, by_storage: dict[str, list[SavedTensor]],
                owner_plans: dict[str, Plan], config: Config, spending: _Spending) -> int:
    """Applies a block checkpoint; returns the device bytes it adds (negative: saves)."""
    change = sum(option.added.values())
    for storage, plan in option.plans.items():
        owner = by_storage[storage][0]
        change += planned_bytes(owner, plan) - planned_bytes(owner, owner_plans[storage])
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
    spending.checkpointed.add(option.block)
    return change


def _next_move(storage: str, analysis: Analysis, by_storage: dict[str, list[SavedTensor]],
               owner_plans: dict[str, Plan], config: Config, tables_saved: set[str],
               spending: _Spending) -> tuple[tuple[int, float, int], Option] | None:
    """The best option ``storage`` can move to now that saves device bytes, with its key, or None."""
    owner, plan = by_storage[storage][0], owner_plans[storage]
    before = planned_bytes(owner, plan)
    best = None
    for option in budget_options(owner, by_storage, analysis, owner_plans, config, tables_saved, spending):
        saved = before - planned_bytes(owner, option.plan)
        if saved <= 0:
            continue
        key = (option.error, (option.plan.seconds - plan.seconds) / saved, -saved)
        if best is None or key < best[0]:
            best = key, option
    return best


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
    options = []
    if storage not in spending.read_by_recompute:
        recompute = recompute_plan(owner, by_storage, owner_plans)
        # not the experts' products: this solver holds no floor under what they replay from
        if (recompute is not None and not replays_product(recompute.chain)
                and not spending.recomputed & {n.name for n in rebuild_inputs(recompute.chain)}):
            options.append(Option(storage, recompute, EXACT_ERROR))
        replay = _replay_plan(owner, by_storage, owner_plans, config)
        if replay is not None and replay_source_storage(owner, by_storage) not in spending.recomputed:
            options.append(Option(storage, replay, EXACT_ERROR))
    if config.block_offload and offloadable(owner, group, plan, analysis) and _host_apart(owner):
        options.append(Option(storage, offloaded(owner, plan), _error(owner, plan)))
    if plan.action is Action.LOWRANK:
        return options
    # the RoPE tables a quantized plan pays for stay saved with what replaces it: they stay in its bytes
    held_tables = 0 if plan.action is Action.KEEP else plan.nbytes - quantized_plan(
        owner, group, analysis, config, set(tables_saved), plan.bits).nbytes
    lower = []
    if quantizable(group, config):
        floor = max(lowest_bits(owner), spending.floors.get(storage, 0))
        lower = [bits for bits, sensitivity in BUDGET_STAGES if sensitivity == _sensitivity(owner)
                 and bits >= floor and (plan.action is Action.KEEP or bits < plan.bits)]
    for bits in lower:
        tables = set(tables_saved)
        lowered = quantized_plan(owner, group, analysis, config, tables, bits)
        if lowered.action is Action.QUANTIZE:
            options.append(Option(storage, dataclasses.replace(lowered, nbytes=lowered.nbytes + held_tables),
                                  _error(owner, lowered), frozenset(tables - tables_saved)))
    if config.lowrank is not None and storage not in spending.floors:
        tables = set(tables_saved)
        factored = propose_lowrank(owner, group, analysis, config, tables)
        if factored is not None and factored.action is Action.LOWRANK:
            options.append(Option(storage, dataclasses.replace(factored, nbytes=factored.nbytes + held_tables),
                                  LOWRANK_ERROR, frozenset(tables - tables_saved)))
    return options


def _host_apart(owner: SavedTensor) -> bool:
    """Whether host memory is apart from the memory ``owner`` lives in: on a CPU it is the same, and offloading
    saves nothing."""
    return tensor_val(owner.base).device.type != "cpu"


def _error(owner: SavedTensor, plan: Plan) -> int:
    """``plan``'s error class under memory_budget."""
    if plan.action is Action.QUANTIZE:
        return 1 + BUDGET_STAGES.index((plan.bits, _sensitivity(owner)))
    return LOWRANK_ERROR if plan.action is Action.LOWRANK else EXACT_ERROR


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


def _sensitivity(owner: SavedTensor) -> int:
    if (owner.feeds_attention or owner.reaches_attention) is not None:
        return 3
    if Role.LINEAR_INPUT in (owner.role, *owner.also):
        return 2
    return 1 if owner.role is Role.NORM_INPUT else 0


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
