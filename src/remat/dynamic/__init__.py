"""Dynamic controllers that observe training and change what is stored: PGAC (gradient-aware masks
re-planned between steps, :mod:`remat.dynamic.pgac`) and DTR (eviction inside a step, :mod:`remat.dynamic.dtr`).
"""
