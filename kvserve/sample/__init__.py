"""Choosing tokens: sampling parameters, logits processing and sampling, structured-output
grammars, and the verification of speculative drafts."""
