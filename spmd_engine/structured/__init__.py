"""Structured outputs: decoding constrained to a JSON schema, any JSON object, a regex, a list of choices or an
EBNF grammar (xgrammar). `params` is plain Python (the request side); `grammars` holds the compiler and the
per-sequence matchers rank 0 advances, and fills the token bitmasks the sampler applies."""
from spmd_engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
