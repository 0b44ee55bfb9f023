"""The passes that rewrite the joint forward and backward graph before torch's min-cut partition: they tag nodes
must-recompute (or must-save) or reassociate LoRA products.

ORDER is the order they run in: merge_casts first, since the LoRA matcher the others run must see one cast of x;
recompute_adapter_cast next, its must-save of x a default the later ones may override; lora_reorder tags what
runlora must leave alone; checkpoint_blocks last, its tags overriding theirs inside a block.
"""

ORDER = ("merge_casts", "recompute_adapter_cast", "replay_dropout", "recompute_inputs", "lora_reorder", "runlora",
         "recompute_logits", "recompute_attention", "checkpoint_blocks")
