"""remat's measurement suite: scripts that print figures (``python -m benchmarks.<name>``, from the repository's
root) and write the results recorded under ``docs/results/``. They use remat only through its public faces
(``remat`` and the faces of its folders), as a user would; :mod:`benchmarks.peers` is the table of remat next to
what users run instead."""
