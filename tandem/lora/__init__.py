"""LoRA adapters: PEFT loading, the host-side cache, the device slot pool and the per-linear delta."""
