"""Shared pieces of the distributed speculative decoder: wire protocol, tree and sampling
math, model loading, configuration."""
