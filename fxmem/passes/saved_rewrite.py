"""Shared machinery of the partitioned passes: replace a saved tensor by others and rebuild it in backward.

A partitioned region hands backward its saved tensors positionally: the
forward returns them after its user outputs, the backward takes them as
placeholders in the same order (after any SymInts). ``SavedTensorEditor`` adds
and removes saved tensors keeping both sides aligned, creates nodes with the
fake values inductor needs, and copies forward nodes into backward.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.analysis.graph import storage_base, tensor_args, view_chain
from fxmem.analysis.meta import VALUE
from fxmem.analysis.norm import scale_source
from fxmem.analysis.rope import Replay
from fxmem.analysis.saved import SYMBOLIC, saved_placeholders, stashed_unchecked
from fxmem.cost_model.plan import Action, Keep, Plan
from fxmem.fallback import fall_back
from fxmem.kernels import probe as probe_kernel
from fxmem.passes.manager import PipelineState

aten = torch.ops.aten
prims = torch.ops.prims


class Unmappable(Exception):
    """Backward cannot rebuild a saved tensor: a forward value it needs is not available there."""


class SavedTensorEditor:
    def __init__(self, state: PipelineState) -> None:
        self.fw: GraphModule = state.fw
        self.bw: GraphModule = state.bw
        self.num_fwd_outputs = state.num_fwd_outputs
        self.probes = state.probes
        self.stored = state.stored
        self.fw_output = self.fw.graph.find_nodes(op="output")[0]
        self.bw_nodes = {n.name: n for n in self.bw.graph.nodes}
        self.placeholder_of: dict[Node, Node] = saved_placeholders(self.fw.graph, self.bw.graph, self.num_fwd_outputs)
        # New saved tensors go after the last version-checked one: AOTAutograd counts the unchecked ones from the end.
        checked = [n for n in self.placeholder_of if not stashed_unchecked(n)]
        self._last_saved = checked[-1] if checked else None

    def _outputs(self) -> list[Any]:
        return list(self.fw_output.args[0])

    def _set_outputs(self, outputs: list[Any]) -> None:
        self.fw_output.args = (tuple(outputs), *self.fw_output.args[1:])

    def save(self, node: Node) -> Node:
        """Make forward ``node`` a saved tensor (if it is not one already); its backward placeholder."""
        if node in self.placeholder_of:
            return self.placeholder_of[node]
        if self._last_saved is None:
            raise Unmappable("the region saves no tensor to place a new one after")
        outputs = self._outputs()
        position = self.num_fwd_outputs + outputs[self.num_fwd_outputs:].index(self._last_saved) + 1
        outputs.insert(position, node)
        self._set_outputs(outputs)
        with self.bw.graph.inserting_after(self.placeholder_of[self._last_saved]):
            placeholder = self.bw.graph.placeholder(node.name)
        placeholder.target = placeholder.name  # the argument is named as the node (renamed on a clash)
        placeholder.meta[VALUE] = node.meta[VALUE]
        self.placeholder_of[node] = placeholder
        self.bw_nodes[placeholder.name] = placeholder
        self._last_saved = node
        return placeholder

    def replace_saved(self, node: Node, new: Node) -> Node:
        """Save forward ``new`` in the place of saved ``node``: the same backward placeholder, now of ``new``'s
        value."""
        outputs = self._outputs()
        outputs[outputs.index(node, self.num_fwd_outputs)] = new
        self._set_outputs(outputs)
        placeholder = self.placeholder_of.pop(node)
        self.placeholder_of[new] = placeholder
        placeholder.meta[VALUE] = new.meta[VALUE]
        if self._last_saved is node:
            self._last_saved = new
        return placeholder

    def unsave(self, node: Node) -> None:
        """Stop saving ``node``; its placeholder must have no users left."""
        placeholder = self.placeholder_of.pop(node)
        outputs = self._outputs()
        index = self.num_fwd_outputs + outputs[self.num_fwd_outputs:].index(node)
        del outputs[index]
        self._set_outputs(outputs)
        if self._last_saved is node:
            previous = [n for n in outputs[self.num_fwd_outputs:index] if n in self.placeholder_of]
            self._last_saved = previous[-1] if previous else None
        self.bw.graph.erase_node(placeholder)
        del self.bw_nodes[placeholder.name]

    def first_backward_use(self, placeholders: Iterable[Node]) -> Node:
        """The earliest backward node reading any of ``placeholders``: rebuilt values go right before it."""
        users = {u for p in placeholders for u in p.users}
        return next(n for n in self.bw.graph.nodes if n in users)

    def check_copyable(self, nodes: Sequence[Node], known: set[Node]) -> None:
        """Raise ``Unmappable`` (before anything is edited) if ``copy_to_backward(nodes)`` would."""
        available = set(known) | set(nodes)
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg not in available and (not isinstance(arg.meta.get("val"), SYMBOLIC)
                                             or arg.name not in self.bw_nodes):
                    raise Unmappable(f"backward has no value for forward node {arg.name}")

    def copy_to_backward(self, nodes: Sequence[Node], values: dict[Node, Node]) -> None:
        """Copy forward ``nodes`` (in order) into backward at the current insertion point.

        ``values`` maps forward nodes to their backward counterparts and receives the copies. Other
        forward arguments (symbolic sizes) are found in backward by name, else ``Unmappable``.
        """
        for node in nodes:
            if node not in values:
                values[node] = self.bw.graph.node_copy(node, lambda arg: self._backward_value(arg, values))

    def _backward_value(self, arg: Node, values: dict[Node, Node]) -> Node:
        if arg in values:
            return values[arg]
        twin = self.bw_nodes.get(arg.name)
        if twin is None or not isinstance(arg.meta.get("val"), SYMBOLIC):
            raise Unmappable(f"backward has no value for forward node {arg.name}")
        return twin


def rewrite_planned(state: PipelineState, action: Action,
                    rewrite: Callable[[SavedTensorEditor, list[Node], Plan], object],
                    where: Callable[[Plan], bool] = lambda plan: True) -> list[object]:
    """Call ``rewrite(editor, members, owner_plan)`` for every storage planned ``action`` whose owner's plan is
    ``where``; what they return.

    A storage whose tensors backward could not rebuild is left saved as it was, and its plans say why.
    """
    editor = SavedTensorEditor(state)
    groups: dict[str, list[int]] = {}
    for index, (saved, plan) in enumerate(zip(state.analysis.saved, state.plans, strict=True)):
        if plan.action is action:
            groups.setdefault(saved.storage, []).append(index)
    done, left = [], []
    for indices in groups.values():
        members = [state.analysis.saved[i].node for i in indices]
        owner_plan = next(state.plans[i] for i in indices if state.plans[i].nbytes is not None)
        if not where(owner_plan):
            continue
        try:
            done.append(rewrite(editor, members, owner_plan))
        except Unmappable as error:
            for i in indices:
                state.plans[i] = Keep(f"planned {action}, left as it was: {error}")
            left.append(f"{', '.join(m.name for m in members)} ({error})")
    if left:  # one warning for the pass: each storage's reason is in its plan too
        fall_back(f"planned {action} left undone, the tensors kept exact: {'; '.join(left)}", state.config,
                  stacklevel=3)
    return done


def compressed_source(members: list[Node], plan: Plan) -> tuple[Node, Replay | None]:
    """What ``plan`` compresses for ``members`` (saved views of one storage): the storage itself, or the tensor
    before RoPE or a repeat, with the replay that rebuilds the members from it."""
    replay = plan.replay
    return (replay.source if replay is not None else storage_base(members[0])), replay


def compress_storage(editor: SavedTensorEditor, members: list[Node],
                     compress: Callable[[torch.fx.Graph, Node], list[Node]],
                     restore: Callable[[torch.fx.Graph, list[Node]], Node],
                     replay: Replay | None = None) -> None:
    """Save ``compress(source)`` instead of ``members`` (saved views of one storage) and rebuild them in backward.

    ``source`` is the members' storage, or with ``replay`` the tensor before rotation or repeat: those are
    replayed in backward from the restored source and the (saved) cos/sin tables. Raises ``Unmappable``
    before editing anything if backward could not rebuild the members.
    """
    source = replay.source if replay is not None else storage_base(members[0])
    replayed = (list(replay.nodes) if replay is not None else []) + [v for m in members for v in view_chain(m)]
    tables = list(replay.tables) if replay is not None else []
    editor.check_copyable(replayed, known={source, *tables})
    placeholders = [editor.placeholder_of[m] for m in members]
    first_use = editor.first_backward_use(placeholders)

    with editor.fw.graph.inserting_before(source.next):
        parts = compress(editor.fw.graph, source)
    saved_parts = [editor.save(part) for part in parts]
    editor.stored[source.name] = parts
    values = {t: editor.save(t) for t in tables}
    exact = probe_node = None
    with editor.bw.graph.inserting_before(first_use):
        values[source] = restore(editor.bw.graph, saved_parts)
        if editor.probes is not None:  # the exact value saved too, and a switch between the two (kernels/probe.py)
            probe = probe_kernel.register()
            editor.probes.append((probe, members[0].name))
            exact = editor.save(source)  # the member's own placeholder where the source is saved already
            probe_node = call(editor.bw.graph, torch.ops.fxmem.fidelity_probe.default, (values[source], exact, probe))
            values[source] = probe_node
        editor.copy_to_backward(replayed, values)
    for member, placeholder in zip(members, placeholders, strict=True):
        if placeholder is exact:  # stays saved, read by the probe alone
            placeholder.replace_all_uses_with(values[member], delete_user_cb=lambda user: user is not probe_node)
            continue
        placeholder.replace_all_uses_with(values[member])
        editor.unsave(member)


def permute_back(graph: torch.fx.Graph, node: Node, order: list[int]) -> Node:
    """Undo ``permute(x, order)``: a tensor permuted into memory order, back to its logical dimension order."""
    return call(graph, aten.permute.default, (node, sorted(range(len(order)), key=order.__getitem__)))


def call(graph: torch.fx.Graph, target: Callable, args: tuple, outputs: int = 0,
         kwargs: dict[str, Any] | None = None) -> Node | list[Node]:
    """Insert ``target(*args, **kwargs)`` with its fake value; with ``outputs`` > 0, its first getitems."""
    kwargs = kwargs or {}
    fake_args = tuple(_fake(a) for a in args)
    with torch._guards.detect_fake_mode(fake_args):
        val = target(*fake_args, **kwargs)
    node = graph.call_function(target, args, kwargs)
    node.meta[VALUE] = val
    if not outputs:
        return node
    items = []
    for index in range(outputs):
        item = graph.call_function(operator.getitem, (node, index))
        item.meta[VALUE] = val[index]
        items.append(item)
    return items


def _fake(arg: Any) -> Any:
    if isinstance(arg, Node):
        return arg.meta["val"]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_fake(a) for a in arg)
    return arg


def trace_into(graph: Graph, function: Callable[..., Any], inputs: Sequence[Node]) -> list[Node]:
    """Insert ``function``'s ops at ``graph``'s insertion point, applied to ``inputs``; its outputs, as nodes.

    The function is plain torch code (a kernel's formula): it is traced on the inputs' fake values, under their
    fake mode, into aten ops with inductor's decompositions, so inductor fuses them with the ops around them.
    Sizes it reads become ``sym_size`` nodes of the inputs: symbolic sizes stay symbolic.
    """
    values = [node.meta[VALUE] for node in inputs]
    with torch._guards.detect_fake_mode(values):
        traced = make_fx(function, decomposition_table=select_decomp_table())(*values)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    outputs = graph.graph_copy(traced.graph, dict(zip(placeholders, inputs, strict=True)))
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def rebuild_norm_input(editor: SavedTensorEditor, members: list[Node], plan: Plan,
                       rebuilt: dict[Node, list[Node]]) -> Node:
    """A ``prenorm`` plan: save only the norm input's exact channels (the smallest |gamma|) and their ids, plus
    rstd (and a LayerNorm's mean) if backward did not keep them, and rebuild the input in backward from its output as restored there
    (``rebuilt``: forward storage -> the backward nodes that restore it, which read only saved tensors)."""
    unit = plan.norm
    if unit.output not in rebuilt:
        raise Unmappable(f"its norm output {unit.output.name} was not stored as planned")
    output_nodes = rebuilt[unit.output]
    first_use = editor.first_backward_use([editor.placeholder_of[m] for m in members])
    position = {n: i for i, n in enumerate(editor.bw.graph.nodes)}
    if position[output_nodes[-1]] > position[first_use]:
        for node in output_nodes:  # they read only saved tensors (placeholders): safe to move earlier
            first_use.prepend(node)
    compute_dtype = unit.normalized.meta["val"].dtype
    x_dtype = unit.x.meta["val"].dtype

    # Index the norm's last dimension with aten.index / index_put (index_select and index_copy are decomposed away
    # before partitioning, and inductor refuses them in the rewritten graph), in the shape the norm reads x in: x
    # itself, its rows flattened, or its last dimension split into heads (each head's channels by gamma's).
    x_shape = list(unit.x.meta["val"].shape)
    norm_shape = list(unit.normalized.meta["val"].shape)
    leading = [None] * (len(norm_shape) - 1)

    def compress(graph: torch.fx.Graph, x: Node) -> list[Node]:
        magnitude = call(graph, aten.abs.default, (_replayed_scale(graph, unit.gamma, scale_source(unit.gamma)[0]),))
        _, ids = call(graph, aten.topk.default, (magnitude, plan.exact_channels, -1, False), outputs=2)
        if norm_shape != x_shape:
            x = call(graph, aten.view.default, (x, norm_shape))
        return [call(graph, aten.index.Tensor, (x, [*leading, ids])), ids]

    def restore(graph: torch.fx.Graph, parts: list[Node]) -> Node:
        exact, ids = parts
        # Saved only now, once compress_storage has checked that backward can rebuild the members: parameters
        # cost nothing to keep, and rstd and mean only what the plan priced.
        output = _cast(graph, output_nodes[-1], compute_dtype)
        if unit.beta is not None:
            beta = _replayed_scale(graph, unit.beta, editor.save(scale_source(unit.beta)[0]))
            output = call(graph, aten.sub.Tensor, (output, _cast(graph, beta, compute_dtype)))
        weight = _cast(graph, _replayed_scale(graph, unit.gamma, editor.save(scale_source(unit.gamma)[0])),
                       compute_dtype)
        # gamma == 0 divides by 1 instead: those channels are written back from the exact copy below
        nonzero = call(graph, aten.add.Tensor, (weight, call(graph, aten.eq.Scalar, (weight, 0))))
        x = call(graph, aten.div.Tensor, (output, nonzero))
        if unit.rstd is not None:
            x = call(graph, aten.div.Tensor, (x, editor.save(unit.rstd)))
        if unit.mean is not None:
            x = call(graph, aten.add.Tensor, (x, editor.save(unit.mean)))
        x = _cast(graph, x, x_dtype)
        if list(x.meta["val"].shape) != norm_shape:
            x = call(graph, aten.view.default, (x, norm_shape))
        x = call(graph, aten.index_put.default, (x, [*leading, ids], exact))
        if norm_shape != x_shape:  # the norm read a reshape of x (norm_unit: a static shape)
            x = call(graph, aten.view.default, (x, x_shape))
        return x

    compress_storage(editor, members, compress, restore)
    return unit.x


def _replayed_scale(graph: torch.fx.Graph, scale: Node, weight: Node) -> Node:
    """A norm's scale or bias made again in ``graph`` from ``weight`` (its parameter there) by the ops that make it
    (Gemma's 1 + weight, a cast): backward keeps the parameter for free, and forward may need the scale before it
    is made."""
    value = weight
    for op in scale_source(scale)[1]:
        source = tensor_args(op)[0]
        value = call(graph, op.target, tuple(value if a is source else a for a in op.args), kwargs=dict(op.kwargs))
    return value


def _cast(graph: torch.fx.Graph, node: Node, dtype: torch.dtype) -> Node:
    if node.meta["val"].dtype == dtype:
        return node
    return call(graph, prims.convert_element_type.default, (node, dtype))
