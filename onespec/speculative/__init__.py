"""Speculative decoding: the worker's step, the drafters behind one interface (one file
each), acceptance rules and the draft-length policy."""
