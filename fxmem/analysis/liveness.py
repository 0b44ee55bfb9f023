"""What a graph holds at once: the transients of a step, beside what it saves between forward and backward.

At long context the step's peak is set as much by the tensors that live inside one graph (an MLP's intermediate and
its gradients, the loss's working set) as by the saved ones. This walks a partitioned graph in its order as its ops
would run it: each op's output storage is allocated when it runs and freed after its last reader (a view keeps its
base alive; the graph's outputs live to its end). It counts storages, not tensors, each at its full size.

That is the eager lowering's step. Inductor's differs in four ways modelled here (``compiled_liveness``): its
backward frees each saved activation (its inputs) after its last reader instead of holding them all to its end, it
computes an element-wise op inside the kernel of each reader instead of storing it, it keeps a freed buffer for a
later one of its size (``_reused_buffers``), and on a CPU it runs the kernels between two library calls as one call,
an output written over an input that dies there where it can (``_kernel_groups``). Where it places each kernel is
not modelled (docs/long-context.md has the error this leaves).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fxmem.analysis.graph import CONSTANT_FILLS, DTYPE_CASTS, aten, is_view, storage_base, storage_bytes
from fxmem.analysis.meta import HOST
from fxmem.analysis.saved import saved_placeholders, stashed_unchecked


@dataclass(frozen=True)
class Liveness:
    """A graph's transients, its inputs left out (a region's inputs are weights, the batch, or what forward saved,
    counted elsewhere)."""

    # the most bytes its own ops' outputs hold at once; with released inputs, the most they and the released inputs
    # not yet freed hold, net of all the released inputs (what it adds to what forward saved: may be below what its
    # outputs hold, or negative)
    peak_bytes: int
    end_bytes: int  # what they hold when it returns: its outputs

    @property
    def transient_bytes(self) -> int:
        """What the graph holds at its peak beyond what it returns."""
        return self.peak_bytes - self.end_bytes


# Ops that return a new tensor but that every lowering runs as a view of their (contiguous) input.
ALIASING_OPS = frozenset({torch.ops.aten._unsafe_view.default})
Storage = Node | tuple[Node, int]  # an op's output, or one output of an op that returns several


def _base(node: Node) -> Node:
    while is_view(node) or node.target in ALIASING_OPS:
        node = node.args[0] if node.target in ALIASING_OPS else storage_base(node)
    return node


def _storage(node: Node) -> Storage:
    """What ``node`` reads when it reads a tensor: an op's storage, or one item of an op with several outputs."""
    base = _base(node)
    if base.target is operator.getitem and isinstance(base.args[0], Node) \
            and isinstance(base.args[0].meta.get("val"), (tuple, list)):
        return base.args[0], base.args[1]
    return base


def _allocations(node: Node) -> dict[Storage, int]:
    """The storages ``node``'s op allocates on the device, with their bytes (none for views, items of a tuple,
    non-tensors and copies to host memory)."""
    if node.op != "call_function" or _base(node) is not node or node.target is operator.getitem \
            or node.meta.get(HOST):
        return {}
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return {(node, i): storage_bytes(v) for i, v in enumerate(val) if isinstance(v, torch.Tensor)}
    return {node: storage_bytes(val)} if isinstance(val, torch.Tensor) else {}


def released_activations(fw: Graph, bw: Graph, num_fwd_outputs: int) -> dict[Node, tuple[Node, int]]:
    """Backward's inputs that hold a forward activation, each with the forward storage it holds and that storage's
    bytes. AOTAutograd hands the saved tensors to the compiled backward, which frees each after its last reader.
    Left out: forward inputs (parameters, the batch), a storage forward also returns (its caller holds it), and what
    AOTAutograd stashes on its context unchecked for versions (held there to the end of backward), and what waits
    in host memory (block_offload: its copy back to the device is one of backward's own allocations)."""
    returned = {_base(n) for n in fw.find_nodes(op="output")[0].args[0][:num_fwd_outputs] if isinstance(n, Node)}
    released = {}
    for node, placeholder in saved_placeholders(fw, bw, num_fwd_outputs).items():
        base = _base(node)
        if base.op == "call_function" and base not in returned and not stashed_unchecked(node) \
                and not base.meta.get(HOST):
            released[placeholder] = base, storage_bytes(base.meta["val"])
    return released


def inlined_elementwise(graph: Graph) -> frozenset[Node]:
    """The element-wise ops inductor computes inside the kernels of their readers instead of storing: every reader
    (through views) takes the value inside its own loop, none is the graph's output, and there are at most
    ``_MAX_INLINED_READERS``, or any number for a constant fill, which reads nothing; and the value does not read
    too many stored buffers, counted through the inlined values it reads (``_stores_for_its_reads``). (Inductor
    also stores a value that is costly to recompute for several readers; that is not modelled.)"""
    inlined: set[Node] = set()
    reads: dict[Node, frozenset[Node]] = {}  # the stored buffers each inlined value's loop loads
    cpu = _runs_on_cpu(graph)
    for node in graph.nodes:
        if node.op != "call_function" or not _elementwise(node) or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        readers, stack = set(), [node]
        while stack:
            for user in stack.pop().users:
                if is_view(user) or user.target in ALIASING_OPS:
                    stack.append(user)
                else:
                    readers.add(user)
        few = len(readers) <= _MAX_INLINED_READERS or node.target in CONSTANT_FILLS
        if not (readers and few and all(_takes_inline(r) for r in readers)):
            continue
        loads = frozenset().union(*(reads.get(_base(arg), {_base(arg)}) for arg in node.all_input_nodes))
        if not _stores_for_its_reads(len(loads), len(readers), cpu):
            inlined.add(node)
            reads[node] = loads
    return frozenset(inlined)


def _stores_for_its_reads(loads: int, readers: int, cpu: bool) -> bool:
    """Whether inductor stores an element-wise value for the buffers its loop loads (``loads``, through the values
    inlined into it), which would otherwise grow without bound along a chain (a residual stream's gradient summed
    layer after layer): past ``realize_acc_reads_threshold`` (inductor's default: 12 on a CPU, 8 on a GPU), or past
    ``realize_reads_threshold`` (4) where several kernels read it (``TensorBox.has_exceeded_max_reads``,
    ``StorageBox.should_realize_on_reuse``)."""
    from torch._inductor import config
    accumulated = config.realize_acc_reads_threshold
    if accumulated is None:  # a per-device default (torch 2.12 on; 8 for both before)
        accumulated = getattr(config, "realize_cpu_acc_reads_threshold", 8) if cpu else getattr(
            config, "_realize_acc_reads_threshold_default", 8)
    return loads > accumulated or (readers > 1 and loads > config.realize_reads_threshold)


# Ops inductor lowers as an element-wise loop besides the pointwise-tagged ones, and readers that compute an
# element-wise input inside their own loop besides element-wise ops and reductions: cat writes each input into its
# slice of the output, index_put scatters into a copy of its first input that it computes.
_ELEMENTWISE = DTYPE_CASTS | CONSTANT_FILLS | {aten.slice_scatter.default, aten.select_scatter.default}
_TAKES_INLINE = _ELEMENTWISE | {aten.cat.default, aten.index_put.default}
# Inductor stores a value read by several kernels where recomputing it in each would cost (realize_reads_threshold,
# 4, counts the loads inside it; on a CPU an exp, log, sigmoid or tanh always): a bound in readers stands for that.
# A constant fill loads nothing, so it is never stored for its readers' sake (StorageBox.should_realize_on_reuse):
# AOTAutograd's CSE gives every block's rotary backward one shared buffer of zeros, read far apart.
_MAX_INLINED_READERS = 4


def _elementwise(node: Node) -> bool:
    return node.target in _ELEMENTWISE or (isinstance(node.target, torch._ops.OpOverload)
                                           and torch.Tag.pointwise in node.target.tags)


def _takes_inline(node: Node) -> bool:
    return node.op == "call_function" and (node.target in _TAKES_INLINE or _elementwise(node) or (
        isinstance(node.target, torch._ops.OpOverload) and torch.Tag.reduction in node.target.tags))


def graph_liveness(graph: Graph, workspace: Callable[[Node], int] = lambda node: 0, *,
                   released: dict[Node, tuple[Node, int]] | None = None,
                   inlined: frozenset[Node] = frozenset(), reuse_buffers: bool = False,
                   group_kernels: bool = False) -> Liveness:
    """The most bytes ``graph``'s ops hold at once when run in order, and what its outputs hold at the end.
    ``workspace(node)``: what the op holds inside while it runs, beyond its inputs and outputs (an opaque op that
    works in chunks). As inductor runs a graph (``compiled_liveness``): ``released``, inputs counted until their
    last reader, the peak then given beyond all of them; ``inlined``, ops that store nothing, their readers reading
    their inputs instead; ``reuse_buffers``, a freed buffer held for a later one of its size (``_reused_buffers``);
    ``group_kernels``, the kernels between two library calls run as one call (``_kernel_groups``)."""
    released = released or {}
    nodes = list(graph.nodes)
    groups = _kernel_groups(nodes, inlined) if group_kernels else {}
    reads_of_inlined: dict[Node, set[Storage]] = {}

    def reads(arg: Node) -> set[Storage]:
        storage = _storage(arg)
        if storage in released:
            return {released[storage][0]}
        return reads_of_inlined.get(storage, {storage}) if isinstance(storage, Node) else {storage}

    last_reader: dict[Storage, int] = {}  # the position of each storage's last reader (through views)
    reads_at: dict[int, set[Storage]] = {}  # what each grouped kernel reads
    outputs: set[Storage] = set()
    for position, node in enumerate(nodes):
        if node.target is operator.getitem or _base(node) is not node:
            continue  # taking an item or a view reads nothing; its readers read the storage
        if node in inlined:
            reads_of_inlined[node] = set().union(*(reads(arg) for arg in node.all_input_nodes))
            continue
        for arg in node.all_input_nodes:
            for storage in reads(arg):
                if node.op == "output":
                    outputs.add(storage)
                else:
                    last_reader[storage] = position
                    if position in groups:
                        reads_at.setdefault(position, set()).add(storage)
    # where each storage is freed: after its last reader, or after the last kernel of that reader's group
    last_read = {storage: groups.get(position, (position,))[-1] for storage, position in last_reader.items()}
    frees_after: dict[int, list[Storage]] = {}
    for storage, position in last_read.items():
        if storage not in outputs:
            frees_after.setdefault(position, []).append(storage)
    inputs = dict(released.values())
    live = {storage: size for storage, size in inputs.items() if storage in last_read or storage in outputs}
    current = start = sum(live.values())
    held: list[int] = []  # the bytes held at each position once its op's outputs exist, before it frees anything
    inputs_held: list[int] = []  # of which released inputs
    inputs_current = start
    allocations: list[dict[Storage, int]] = []
    freed: list[list[Storage]] = []
    sizes: dict[Storage, int] = {}  # what each storage allocated here holds
    unread: dict[int, list[Storage]] = {}  # outputs no op reads, freed where their group of kernels ends
    for position, node in enumerate(nodes):
        group = groups.get(position, (position,))
        kernels = {} if node in inlined or position != group[0] else {p: _allocations(nodes[p]) for p in group}
        allocated = {s: size for made in kernels.values() for s, size in made.items()}
        unread.setdefault(group[-1], []).extend(s for s in allocated if s not in last_read and s not in outputs)
        if position in groups:  # a kernel writes its output over an input it is the last to read
            for member, made in kernels.items():
                dying = [s for s in reads_at.get(member, ()) if last_reader[s] == member and live.get(s)
                         and s not in outputs and s not in inputs and s in sizes]
                for output, overwritten in _written_in_place(made, dying).items():
                    live[overwritten] = 0  # its buffer is the output's now
                    live[output] = sizes[output] = allocated.pop(output)
        sizes.update(allocated)
        live.update(allocated)
        current += sum(allocated.values())
        held.append(current)
        inputs_held.append(inputs_current)
        allocations.append(allocated)
        freed.append([])
        for storage in [*frees_after.get(position, ()), *unread.pop(position, ())]:
            size = live.pop(storage, 0)
            current -= size
            inputs_current -= size if storage in inputs else 0
            if size:
                freed[-1].append(storage)
    if reuse_buffers:
        _reused_buffers(nodes, allocations, freed, held, inputs_held, sizes, groups)
    peak = max([start, *(size + workspace(node) for size, node in zip(held, nodes))])
    released_bytes = sum(inputs.values())
    return Liveness(peak_bytes=peak - released_bytes, end_bytes=current - sum(
        size for storage, size in inputs.items() if storage in outputs))


def _kernel_groups(nodes: list[Node], inlined: frozenset[Node]) -> dict[int, tuple[int, ...]]:
    """The positions of the ops whose kernels inductor runs as one call, each mapped to its group's. On a CPU its
    C++ backend gathers every kernel it generates between two library calls (a matmul, an op it falls back to)
    into one function, allocating their outputs before the call and freeing their inputs after it (``flush``):
    llama-small's attention so holds q's, k's and v's adapter products with both rotary outputs at once. (It also
    ends a group past 500 arguments, which is not modelled.)"""
    groups: dict[int, tuple[int, ...]] = {}
    run: list[int] = []
    for position, node in enumerate(list(nodes) + [None]):
        if node is not None and (node.op != "call_function" or node in inlined or node.target is operator.getitem
                                 or _base(node) is not node):
            continue
        if node is not None and _inductor_allocates(node) and node.target not in _LIBRARY_CALLS:
            run.append(position)
            continue
        for member in run:
            groups[member] = tuple(run)
        run = []
    return groups


# Ops inductor lowers to a library call on a CPU (extern_kernels), which ends a group of generated kernels.
_LIBRARY_CALLS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                            aten.convolution.default})


def _written_in_place(outputs: dict[Storage, int], dying: list[Storage]) -> dict[Storage, Storage]:
    """Which of a kernel's ``outputs`` (not a cat's, whose inputs are written into its slices) it writes over one of
    its own inputs that it is the last to read, ``dying``: one of inductor's own buffers of the same dtype and bytes
    (its wrapper's in-place reuse, ``in_out_ptr``; inductor also asks that the kernel read it where it writes, which
    is not checked)."""
    free: dict[tuple[torch.dtype | None, int], list[Storage]] = {}
    for storage in dying:
        if _inductor_allocates(storage if isinstance(storage, Node) else storage[0]):
            free.setdefault((_dtype(storage), storage_bytes(_val(storage))), []).append(storage)
    in_place = {}
    for output, size in outputs.items():
        node = output if isinstance(output, Node) else output[0]
        waiting = free.get((_dtype(output), size))
        if waiting and node.target is not aten.cat.default:
            in_place[output] = waiting.pop()
    return in_place


def _reused_buffers(nodes: list[Node], allocations: list[dict[Storage, int]], freed: list[list[Storage]],
                    held: list[int], estimate: list[int], sizes: dict[Storage, int],
                    groups: dict[int, tuple[int, ...]]) -> None:
    """Inductor's buffer reuse, added to ``held`` in place. Its wrapper keeps a freed buffer in a pool and hands
    it to the next allocation of its dtype and size (the last freed first) instead of freeing it: always when
    that allocation is the next kernel's, and otherwise when the bytes its own estimate holds in between, plus
    the buffer, stay under the peak of that estimate (``AllocateLine.should_reuse_buffer``). With its peak-memory
    reordering off (fxmem's lowering) the estimate sizes none of its own buffers, so it is ``estimate``: the
    released inputs not yet freed, and the buffers so kept. Backward therefore keeps more buffers the more saved
    activations it has freed, across each opaque op's workspace too, and forward (no released inputs) reuses a
    buffer only from one kernel to the next. Only buffers inductor allocates itself take part: an op it falls
    back to (a custom op, CPU flash attention) allocates its own outputs, which inductor marks unaligned, so that
    no allocation of its own (aligned) matches them in its pool. Simplified: inductor's estimate counts every input
    of backward but the parameters and tangents, ``estimate`` the released ones only (not what forward also returns
    or AOTAutograd stashes), so the model keeps slightly fewer buffers than inductor may."""
    estimated_peak = max(estimate, default=0)
    pool: dict[tuple[torch.dtype | None, int], list[int]] = {}  # (dtype, bytes) -> where each waiting one was freed
    kernels = [p for p, allocated in enumerate(allocations) if allocated]
    # where the kernel (or group of kernels) before each one frees its inputs
    previous_kernel = {p: groups.get(kernels[i - 1], (kernels[i - 1],))[-1] if i else -1 for i, p in enumerate(kernels)}
    for position, node in enumerate(nodes):
        own = _inductor_allocates(node)
        for storage, size in allocations[position].items() if own else ():
            waiting = pool.get((_dtype(storage), size))
            if not waiting:
                continue
            free_position = waiting.pop()
            between = range(free_position + 1, position)
            if free_position == previous_kernel[position] or max(
                    (estimate[p] for p in between), default=0) + size <= estimated_peak:
                for p in between:
                    held[p] += size
                    estimate[p] += size
            else:
                waiting.append(free_position)
        for storage in freed[position]:
            if storage in sizes and _inductor_allocates(storage if isinstance(storage, Node) else storage[0]):
                pool.setdefault((_dtype(storage), sizes[storage]), []).append(position)


def _val(storage: Storage) -> object:
    node, item = (storage, None) if isinstance(storage, Node) else storage
    val = node.meta.get("val")
    return val[item] if item is not None else val


def _dtype(storage: Storage) -> torch.dtype | None:
    return getattr(_val(storage), "dtype", None)


def _inductor_allocates(node: Node) -> bool:
    """Whether inductor makes ``node``'s output buffer itself (a kernel it generates, or an external kernel that
    writes into a buffer it passes), rather than calling an op that allocates it."""
    from torch._inductor.lowering import fallbacks, lowerings
    return node.target in lowerings and node.target not in fallbacks


def compiled_liveness(fw: Graph, bw: Graph, num_fwd_outputs: int,
                      workspace: Callable[[Node], int] = lambda node: 0) -> tuple[Liveness, Liveness]:
    """Forward's and backward's ``graph_liveness`` as inductor runs them: element-wise ops inside their readers'
    kernels, backward freeing each saved activation after its last reader, freed buffers kept for reuse, and on a
    CPU the kernels between two library calls run as one call (a GPU launches each Triton kernel apart). Where
    inductor places each kernel is not modelled."""
    group = _runs_on_cpu(fw)
    return (graph_liveness(fw, workspace, inlined=inlined_elementwise(fw), reuse_buffers=True, group_kernels=group),
            graph_liveness(bw, workspace, released=released_activations(fw, bw, num_fwd_outputs),
                           inlined=inlined_elementwise(bw), reuse_buffers=True, group_kernels=group))


def _runs_on_cpu(graph: Graph) -> bool:
    """Whether ``graph``'s first tensor is a CPU one."""
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device.type == "cpu"
    return False
