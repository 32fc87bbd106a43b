"""The peers benchmark: remat next to what a user would otherwise run at the same byte budget, one command and
one table (``python -m benchmarks.peers``; :mod:`.run` orchestrates, :mod:`.child` measures one model and
precision in a process of its own, :mod:`.contenders` holds what runs, :mod:`.duel` the head-to-head rounds,
:mod:`.table` the table and its targets, :mod:`.attempts` the units run again when the machine's speed changed,
:mod:`.models` and :mod:`.device` the models, batches and device, :mod:`.ckptplan` the PyPI planner)."""
