"""Every ``node.meta`` key fxmem writes, declared once.

fxmem's own keys:

- ``LORA_REORDERED`` on a LoRA linear's frozen product x W^T in the joint graph: the non-linear consumer ('silu',
  'gelu', 'product', 'q', 'k', 'v') whose input backward rebuilds from it. Written by passes/joint/lora_reorder.py; read
  by the analysis (``SavedTensor.rebuilt_for``) and by passes/joint/runlora.py, which leaves such a layer as traced.

- ``BLOCK_SOURCE`` on what a checkpointed block is recomputed from in the joint graph (its outputs, which the
  next block reads, and the activations from outside any block it reads): the block's module path. Written by
  passes/joint/checkpoint_blocks.py; read by the analysis (``Analysis.rebuild_sources``).

- ``HOST`` on a forward node that copies a saved tensor to host memory, and on the backward placeholder that
  receives that copy: its bytes are the host's, not the device's. Written by passes/partitioned/offload_blocks.py; read by
  analysis/liveness.py.

Every value is plain data: inductor pickles the graphs, meta included, for its cache key. (What a pass tells a
later one about nodes, the quantize pass's restored tensors, travels in ``PipelineState`` instead.)

torch's keys fxmem writes:

- ``RECOMPUTE`` (``CheckpointPolicy.MUST_RECOMPUTE``) on joint-graph nodes: torch's min-cut recomputes them in
  backward instead of saving them (passes.manager.tag_must_recompute). passes/dynamo/chunk_norm.py writes it on a dynamo
  graph's node, which AOTAutograd copies onto the joint nodes it traces from it.
- ``VALUE``: the fake tensor (or SymInt) of every node fxmem inserts, which inductor needs to lower it
  (passes.saved_rewrite.call and SavedTensorEditor.save).
- ``EXAMPLE_VALUE`` and ``MODULE_STACK`` on a node a dynamo pass inserts: what dynamo gives every node of its graph,
  the value it traced and the modules it ran in (passes.manager.replace_with_call, passes/dynamo/chunk_norm.py).
"""

LORA_REORDERED = "fxmem_lora_reorder"
BLOCK_SOURCE = "fxmem_block_source"
HOST = "fxmem_host"
RECOMPUTE = "recompute"
VALUE = "val"
EXAMPLE_VALUE = "example_value"
MODULE_STACK = "nn_module_stack"
