"""Structured output: the constraint fields of the APIs (frontends), and the grammars compiled by
llguidance with the allowed-token masks each step carries (engine core)."""
