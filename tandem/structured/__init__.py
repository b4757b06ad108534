"""Structured output on the CPU side: grammar compile cache, per-request matcher state, bitmask fill."""
