"""Checkpoint each repeated block (a decoder layer) from its input: only the block's output is saved, and backward
recomputes the block's forward from it.

Tags every forward node of a block (``model.layers.N``, from the module stack) must-recompute and the block's
outputs, the nodes a later block or the head reads, must-save. torch's min-cut then saves the residual stream
between blocks and nothing inside them: at long context one block's activations live at a time, in backward,
instead of every block's. The recomputed forward runs on the very values saved, so under ``exact`` the gradients
are torch's. A quantizing preset stores each block's output at no fewer than REBUILD_SOURCE_BITS (a block is
rebuilt from it, as an X W is from its x: analysis/saved.py). A block's dropout that inductor draws from the step's
seeds (every dropout it compiles, unless ``torch._inductor.config.fallback_random``) is drawn again from the same
seed in backward: the same masks, as passes/joint/replay_dropout.py replays them. A block that draws random numbers
otherwise is left as it is: the recomputation would draw others.

Under ``memory_budget`` a block's checkpoint is one of the budget's options: the region is planned first without
this pass, and it then runs on the blocks that plan chose (``PipelineState.blocks``; backend.py).
"""

from __future__ import annotations

from torch.fx import Node
from torch.utils.checkpoint import CheckpointPolicy

from fxmem.analysis.blocks import draws_random_numbers, find_blocks
from fxmem.analysis.meta import BLOCK_SOURCE, RECOMPUTE
from fxmem.fallback import unsupported
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, pass_result, tag_must_recompute


class CheckpointBlocks(GraphPass):
    name = "checkpoint_blocks"
    stage = "joint"

    def run(self, state: PipelineState) -> PassResult:
        blocks = find_blocks(state.joint.graph)
        chosen = [b for b in blocks if state.blocks is None or b.name in state.blocks]
        checkpointed = [b for b in chosen if b.random is None]
        for block in checkpointed:
            tag_must_recompute(n for n in block.nodes if n not in block.outputs)
            for output in block.outputs:
                _must_save(output, block.name)
            for source in block.sources:  # an unchosen block's output too, where only some blocks are checkpointed
                source.meta.setdefault(BLOCK_SOURCE, block.name)
        saved = sum(len(b.outputs) for b in checkpointed)
        parts = [f"{len(checkpointed)} block(s) checkpointed from their outputs, {saved} tensor(s) saved between blocks"
                 ] if checkpointed else []
        if len(chosen) < len(blocks):
            parts.append(f"{len(blocks) - len(chosen)} left to their saved tensors' plans: memory_budget chose "
                         f"{', '.join(b.name for b in chosen)}")
        left = [b for b in chosen if b.random is not None]
        if left:
            parts.append(f"{len(left)} block(s) left as they are: they draw random numbers ({left[0].random})")
            unsupported(f"checkpoint_blocks: {parts[-1]}", state.config)
        if not blocks:
            return PassResult(False, "no repeated blocks (model.layers.N) found in the forward")
        redraws = any(draws_random_numbers(n) for block in checkpointed for n in block.nodes)  # from the step's seeds
        return pass_result(bool(checkpointed), *parts, redraws=redraws)


def _must_save(node: Node, block: str) -> None:
    node.meta[RECOMPUTE] = CheckpointPolicy.MUST_SAVE
    node.meta[BLOCK_SOURCE] = block
