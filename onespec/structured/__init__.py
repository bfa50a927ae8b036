"""Structured outputs (guided decoding): JSON schema, regex, choice and EBNF constraints.

params.py    StructuredOutputsParams: what a request asks for (no grammar library needed)
backend.py   GrammarBackend: compiles specs with xgrammar (cached), one matcher a request
step.py      StepGrammar: one engine step's masks, for the verify rows and every draft step
"""
from onespec.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
