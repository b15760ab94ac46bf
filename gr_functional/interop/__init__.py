"""Interop with other libraries' model APIs, for users who put the project's models inside their own
(``interop.flax_nnx``: flax.nnx modules). Imported by user code only: nothing in gr_functional
imports this package, so gr_functional itself still imports no array library."""
