"""The passes that rewrite the graph dynamo captured, before AOTAutograd traces it: they change what is traced.

ORDER is the order they run in: gqa_attention after causal_mask, which removes the mask gqa_attention needs gone;
dequantize_bases before the chunked ops that read its weights; chunk_linears after chunk_mlp, which takes an MLP's
linears whole.
"""

ORDER = ("causal_mask", "gqa_attention", "chunk_loss", "dequantize_bases", "chunk_mlp", "chunk_norm", "chunk_linears")
