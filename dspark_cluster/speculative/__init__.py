"""Speculative decoding: proposers (n-gram, draft model, DSpark), lossless verification, the
engine's drafter (in process or a Ray actor group), and the DSpark drafter's model and context."""
