"""The engine and its kernels on one GPU: engine and kernel measurements, decode profile, kernel split, launch cost,
mixed steps, host step, FP8 numerics and GEMMs, speculative decoding, one runner flag A/B."""
