"""Speculative decoding's proposers: where a request's draft tokens come from (the verify step is the runner's)."""
