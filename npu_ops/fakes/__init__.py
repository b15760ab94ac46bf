"""FAKES of vendor ops, written from their documentation, for CPU tests of our adapters.

A fake checks our argument translation against OUR READING of the vendor docs; it says nothing
about the real kernels' numerics, limits or speed (see each module's docstring). Nothing here
is used outside tests.
"""
