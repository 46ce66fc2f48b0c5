"""FP8 GEMMs for attention's and the MLP's linears (``model.fp8``): operands, scales, the autograd step."""
