"""Flows users hit: options checked before any work, a plan's blocks in any order, and what the front door and the
Hugging Face door take. Each test here failed before its fix."""

from __future__ import annotations

import pytest
import torch

import remat

pytest.importorskip("transformers")


def _batch(rows: int = 2, positions: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (rows, positions), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_an_unknown_option_is_refused_before_any_profile_runs(make_gpt2, monkeypatch) -> None:
    import remat.integrations.session as session

    model = make_gpt2(n_layer=2, n_embd=32, seed=0)
    profiled = []
    monkeypatch.setattr(session, "profile", lambda *a, **k: profiled.append(1))
    monkeypatch.setattr(session, "fit_memory", lambda *a, **k: profiled.append(1))
    with pytest.raises(TypeError, match=r"unknown option \['resolutoin'\] for strategy 'optimal'; it takes"):
        remat.fit(model, "1GiB", batch=_batch(), resolutoin=4096)
    with pytest.raises(TypeError, match=r"unknown option \['k'\] for strategy 'full'"):
        remat.fit(model, activations=0.5, strategy="full", batch=_batch(), k=2)
    assert not profiled and getattr(model, "_remat_session", None) is None


def test_the_hugging_face_door_takes_holds_output(make_gpt2) -> None:
    from remat.integrations import hf

    model = make_gpt2(n_layer=2, n_embd=32, dropout=0.0, seed=0)
    session = hf.enable(model, "optimal", 0.6, batch=_batch(), holds_output=False)
    assert session.costs is not None and session.costs.info["holds_output"] is False
    model(**_batch()).loss.backward()
    session.remove()


def test_a_second_backward_through_a_policy_that_keeps_outputs_says_what_to_do() -> None:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 8, requires_grad=True)
    loss = remat.checkpoint(mlp, x, policy="dots_saveable").square().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"backward an extra time.*double_backward=True"):
        loss.backward()
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(2)])
    handle = remat.apply(model, remat.Plan({"0": "selective:dots_saveable", "1": "keep"}))
    loss = model(x).square().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"backward an extra time.*leaves such policies out"):
        loss.backward()
    handle.remove()


def test_the_five_minute_example_runs_without_a_warning() -> None:
    """The README's first example, run as written, draws no warning from transformers (its once-only warnings
    forgotten first, so one an earlier test drew still counts) nor from Python."""
    import logging
    import warnings
    from pathlib import Path

    import transformers.utils.logging as transformers_logging

    readme = Path(__file__).resolve().parents[1] / "README.md"
    block = readme.read_text().split("## Five minutes", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    transformers_logging.warning_once.cache_clear()
    handlers = [(logging.getLogger(name), Collect()) for name in ("transformers", "remat")]
    for logger, handler in handlers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(block, "README.md", "exec"), {})  # noqa: S102
    finally:
        for logger, handler in handlers:
            logger.removeHandler(handler)
    assert not seen, seen
    assert not [str(w.message) for w in caught], [str(w.message) for w in caught]


def test_the_use_cache_note_comes_once_per_model_and_not_where_its_config_says_false(make_gpt2, caplog) -> None:
    import transformers

    model = make_gpt2(n_layer=2, n_embd=32, dropout=0.0, seed=0, use_cache=True)
    with caplog.at_level("WARNING", logger="remat"):
        for _ in range(2):  # profiled, applied, stepped: one note for the model
            costs = remat.profile(model, _batch(), repeats=1)
            handle = remat.apply(model, remat.plan(costs, "full"))
            model(**_batch()).loss.backward()
            handle.remove()
    assert sum("use_cache=True in a training step" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    config = transformers.T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    t5 = transformers.T5ForConditionalGeneration(config).train()
    t5.config.use_cache = False  # the user's word; the decoder stack keeps a copy of the config saying True
    assert t5.decoder.config.use_cache is True
    with caplog.at_level("WARNING", logger="remat"):
        handle = remat.apply(t5, remat.plan(remat.profile(t5, _batch(), repeats=1), "full"))
        t5(**_batch()).loss.backward()
        handle.remove()
    assert not [r for r in caplog.records if "use_cache" in r.getMessage()]
    assert t5.decoder.config.use_cache is True  # as it was


def test_the_hugging_face_door_on_a_sharded_model_says_to_plan_before_sharding(make_gpt2, free_port) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from remat.integrations import hf

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = make_gpt2(n_layer=2, n_embd=32, dropout=0.0, seed=0)
        for layer in model.transformer.h:
            fully_shard(layer)
        fully_shard(model)
        with pytest.raises(ValueError, match="already sharded with fully_shard; activation checkpointing goes on"):
            hf.enable(model, "optimal", 0.5, batch=_batch())
    finally:
        dist.destroy_process_group()


def test_the_plan_table_reads_an_overhead_within_noise_as_zero_and_keeps_long_actions_aligned() -> None:
    from remat.core import BlockCost, CostTable

    def row(fqn: str) -> BlockCost:
        return BlockCost(fqn, 1e-3, 2e-3, 10, 10,
                         {"keep": 100, "checkpoint": 10, "selective:dots_every_other_saveable": 40},
                         {"keep": 0.0, "checkpoint": 1e-3, "selective:dots_every_other_saveable": 5e-4},
                         overhead_s={"checkpoint": -2e-5, "selective:dots_every_other_saveable": 3e-3})  # fmt: skip

    costs = CostTable([row(f"h.{i}") for i in range(3)], info={"time_noise_s": 1e-4})
    plan = remat.Plan.from_actions(costs, ["checkpoint", "selective:dots_every_other_saveable", "keep"])
    lines = plan.table(costs).splitlines()
    assert "within the profile's noise, 0.100 ms a block, reads 0" in lines[1]
    header, body = lines[2], lines[3:]
    assert len({len(line) for line in [header, *body]}) == 1  # columns aligned past the longest action
    overheads = [float(line.split()[-1]) for line in body]
    assert overheads == [0.0, 3.0, 0.0]  # -0.02 ms is noise; 3 ms is not


def test_a_copy_of_a_model_with_dtr_attached_is_its_own_plain_model_and_pickling_says_what_to_do(tmp_path) -> None:
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                                      torch.nn.Linear(32, 8)) for _ in range(3)])  # fmt: skip
    x = torch.randn(4, 8)
    dtr = remat.DTR(model, "1MiB").attach()
    with pytest.warns(UserWarning, match="the copy is the plain model"):
        twin = copy.deepcopy(model)
    for p in twin.parameters():
        torch.nn.init.zeros_(p)
    assert torch.equal(twin(x), torch.zeros(4, 8))  # its own (zeroed) weights, not the original's
    twin(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # the gradients land on the copy
    assert "forward" not in twin.__dict__ and "forward" in model.__dict__  # DTR stays with the original
    with pytest.raises(TypeError, match=r"cannot be pickled \(torch.save\(model\)\).*state_dict\(\)"):
        torch.save(model, tmp_path / "model.pt")
    dtr.detach()
    torch.save(model, tmp_path / "model.pt")  # detached: the plain model
    assert "__deepcopy__" not in model.__dict__


def test_the_block_memory_legend_stays_inside_the_figure(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from remat.bench import plots

    actions = ["keep", "checkpoint", "selective:dots_saveable", "selective:all_but_pointwise_saveable",
               "selective:attention_saveable", "selective:dots_every_other_saveable"]  # fmt: skip
    saved = {a: [(i + 1) * 2**20 * (k + 1) for i in range(6)] for k, a in enumerate(actions)}
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))  # kept open to read the legend's place
    plots.block_memory([f"transformer.h.{i}" for i in range(6)], saved, tmp_path / "block_memory.png", "footer")
    fig = figures[0]
    fig.canvas.draw()
    legend = fig.axes[0].get_legend().get_window_extent()
    axes_box = fig.axes[0].get_window_extent()
    assert axes_box.x0 <= legend.x0 and legend.x1 <= axes_box.x1  # the legend fits the axes' width
    assert (tmp_path / "block_memory.png").stat().st_size > 0


@pytest.mark.parametrize("share", [0.5, 0.35])
def test_a_t5_step_profiled_as_the_first_training_step_is_not_under_predicted(share: float) -> None:
    """The session's first step runs every block checkpointed and the profile reads it so (T5's position bias, made by
    its first block and taken by the others, counted beside the blocks): the plan's activations stay within the
    budget and measure at most its prediction."""
    transformers = pytest.importorskip("transformers")
    import logging

    logging.getLogger("remat").setLevel(logging.ERROR)  # the use_cache note
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=512, d_model=128, d_kv=32, d_ff=256, num_layers=4, num_heads=4,
                                   decoder_start_token_id=0, dropout_rate=0.1)  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).train()
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    session = remat.fit(model, activations=share)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        with remat.measure() as meter:
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step > 0:  # from the second step on the plan runs
            plan = session.plan
            assert meter.activation_bytes <= plan.budget_bytes, (meter.activation_bytes, plan.budget_bytes)
            assert meter.activation_bytes <= 1.002 * plan.predicted_peak_bytes, (
                meter.activation_bytes, plan.predicted_peak_bytes)  # fmt: skip
    session.remove()
