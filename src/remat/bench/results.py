"""A results folder as the report reads it: the runner's files (``config.json``, ``runs.jsonl``,
``steps.jsonl``, ``ddp.jsonl``, ``pipeline.jsonl``) loaded once, with the choices every table makes about them
(the finished runs, the timed steps, the order of the strategies, which label is the static, DTR and PGAC
baseline)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .records import read_jsonl


class Results:
    """The contents of a results folder, with the choices the report makes about them."""

    def __init__(self, out: Path) -> None:
        self.out = out
        config_path = out / "config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"{out} has no config.json: it is not a `remat bench` results folder")
        self.config = json.loads(config_path.read_text())
        self.settings = self.config["settings"]
        self.runs_all = read_jsonl(out / "runs.jsonl")
        self.runs = [r for r in self.runs_all if r.get("status") == "ok"]
        ok = {(r["strategy"], r["seed"]) for r in self.runs}
        self.steps = [s for s in read_jsonl(out / "steps.jsonl") if (s["strategy"], s["seed"]) in ok]
        self.timed = [s for s in self.steps if s.get("timed")]
        order = self.config.get("all_strategies", [])
        present = {r["strategy"] for r in self.runs}
        self.labels = [label for label in order if label in present] + sorted(present - set(order))
        self.name_of = {r["strategy"]: r["strategy_name"] for r in self.runs}
        self.budget = self.config["budget"]["bytes"]
        self.env = self.config["environment"]
        self.command = self.config["commands"][-1] if self.config.get("commands") else ""
        self.ddp = read_jsonl(out / "ddp.jsonl")
        self.pipeline = read_jsonl(out / "pipeline.jsonl")

    def first(self, name: str) -> str | None:
        """The first strategy label of ``name`` (unswept options first)."""
        plain = [label for label in self.labels if label == name]
        if plain:
            return plain[0]
        return next((label for label in self.labels if self.name_of.get(label) == name), None)

    @property
    def static_label(self) -> str | None:
        """Static uniform checkpointing: ``every_k`` if it ran, else ``full``."""
        return self.first("every_k") or self.first("full")

    @property
    def pgac_label(self) -> str | None:
        listed = [s for s in self.settings.get("strategies", []) if s.split("[")[0] == "pgac"]
        for label in listed:
            if label in self.labels:
                return label
        return self.first("pgac")

    @property
    def dtr_label(self) -> str | None:
        return self.first("dtr")

    def runs_of(self, label: str) -> list[dict[str, Any]]:
        return [r for r in self.runs if r["strategy"] == label]

    def values(self, label: str, key: str, rows: list[dict[str, Any]] | None = None) -> dict[tuple[int, int], float]:
        rows = self.timed if rows is None else rows
        return {
            (r["seed"], r["step"]): float(r[key]) for r in rows if r["strategy"] == label and r.get(key) is not None
        }

    @property
    def footer(self) -> str:
        return f"machine: {self.env['machine']} | command: {self.command}"

    @property
    def is_text(self) -> bool:
        kind = self.config.get("facts", {}).get("kind")
        return kind in ("lm", "mlm") if kind else self.settings["model"] in ("gpt2", "bert")
