"""Model definitions (Llama-family targets, the EAGLE-3 head), checkpoint loading and the
architecture registry."""
