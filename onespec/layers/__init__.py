"""Model building blocks: attention metadata, RMSNorm, rotary embedding, sampling, and the
backend objects (PyTorch or Triton) the layers compute with."""
