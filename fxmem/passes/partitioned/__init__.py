"""The passes that rewrite the forward and backward graphs after the partition, with the analysis and the plan in
hand: they rewrite the saved tensors as planned.

ORDER is the order they run in: sparsify, quantize and lowrank rewrite saved tensors that fuse_epilogue then fuses;
offload_blocks moves what is then saved for the blocks; lora_half_products and onednn_matmul swap the products of
the finished graphs.
"""

ORDER = ("sparsify_attention", "quantize", "lowrank", "fuse_epilogue", "offload_blocks", "lora_half_products",
         "onednn_matmul")
