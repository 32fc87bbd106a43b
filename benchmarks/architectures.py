"""The architecture matrix as a table: each tiny model of :mod:`remat.bench.arch_zoo` through find_chains,
profile -> plan("optimal", budget) -> apply and the Hugging Face integration, compared with plain steps
(see :mod:`remat.bench.arch_check`; ``tests/test_architectures.py`` asserts the same matrix).

    .venv/bin/python -m benchmarks.architectures                       # every architecture, budget 0.5
    .venv/bin/python -m benchmarks.architectures --only llama,t5 --budget 0.6 --json arch.json

Columns: ``chains`` the stacks ``remat.find_chains`` found (several are planned together under the one budget),
``blocks`` the blocks planned,
``exact`` whether gradients, buffers and outputs were bitwise those of a plain step in every step checked,
``peak / budget`` the activation peak a live-tensor tracker saw in the planned step (its output included)
against the plan's budget (when the budget is below the feasible minimum the plan is refused, naming the
minimum, and the plan at that minimum is measured), ``predicted`` the simulator's peak for the plan, ``status``
what happened.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings
from dataclasses import asdict

import torch

from remat.bench import architectures, check, format_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated architecture names (default: all)")
    parser.add_argument("--budget", type=float, default=0.5, help="fraction of the no-checkpoint activation peak")
    parser.add_argument("--no-integration", action="store_true", help="skip the Hugging Face integration steps")
    parser.add_argument("--json", default="", help="write every row (with its problems) to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("remat").setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    wanted = {n for n in args.only.split(",") if n}
    results, seconds = [], {}
    for arch in architectures():
        if wanted and arch.name not in wanted:
            continue
        start = time.perf_counter()
        results.append(check(arch, budget=args.budget, integration=not args.no_integration))
        seconds[arch.name] = time.perf_counter() - start
    print(format_table(results))
    for result in results:
        for line in [result.error, *result.problems][:3]:
            if line:
                print(f"  {result.name}: {line}")
    print(f"{len(results)} architectures in {sum(seconds.values()):.1f} s")
    if args.json:
        rows = [{**asdict(r), "exact": r.exact, "status": r.status, "seconds": seconds[r.name]} for r in results]
        with open(args.json, "w") as f:
            json.dump({"budget": args.budget, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
