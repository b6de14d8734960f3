"""The source checkpoint: its lazy safetensors reader, MXFP4 decode and compressed-tensors scheme matching."""
